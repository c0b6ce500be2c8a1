//! `lockstep-chaos-node`: replicas on a real Kubernetes node (kubelet,
//! containerd, CoreDNS; `cargo xtask kube` starts it and sets the
//! variables below), driven from outside the cluster as a user would.
//!
//! Per variant (a shipped distribution policy: `barrier`, `broadcast`,
//! `log`), in a fresh `restricted` namespace: `lockstep serve
//! --orchestrator kubernetes` on this host, acting as the shipped service
//! account, runs a replica of [`PROCESSES`] pods x [`WORKERS`] workers of
//! the image the node holds; its processes find each other through CoreDNS
//! (the headless Service) and the controller reaches them at their pod
//! IPs. Then, each a scenario with its own checked outcome:
//!
//! - `create`: the replica and a dataflow (identity and reduce exports)
//!   created, writes answered, both exports equal to the reference (I3);
//! - `process-killed`: process 1's `lockstep-replica` SIGKILLed inside its
//!   container (from the host, by its PID there; kubelet restarts the
//!   container): a new generation must replace every pod (I2: one
//!   shared-fate generation) and the next write and peeks be answered and
//!   right within [`RECOVERY`];
//! - `process-stopped`: process 0 SIGSTOPped for [`STOP_FOR`], then
//!   resumed: answered and right within [`RECOVERY`] of the resume;
//! - `pod-deleted`: process 0's pod deleted through the API: a new
//!   generation, answered and right within [`RECOVERY`];
//! - `drained`: `kubectl drain` of the node (the pods' controller is their
//!   service's record, their budget `minAvailable: scale - 1`), then
//!   `uncordon`: the drain finishes, a new generation runs, answered and
//!   right within [`RECOVERY`];
//! - `environment-killed`: `lockstep serve` SIGKILLed [`KILL_AFTER`] a
//!   write was sent (mid-command) and started again on its state
//!   directory: the write, retried, applied exactly once (I3), the replica
//!   adopted (the same pod uids, no container restarted: O1, nothing
//!   rebuilt) and answering right within [`RECOVERY`];
//! - `upgraded`: `lockstep serve` SIGKILLed and started on another image
//!   (`LOCKSTEP_NODE_IMAGE_NEXT`: the same build under a tag of its own):
//!   the replica adopted (O1: a new environment image restarts no
//!   replica); then `replica upgrade --keep-answering` under a steady
//!   reader: no read refused (I2) or wrong (I3), a new generation whose
//!   every pod names the new image, answering right;
//! - `upgrade-interrupted`: the environment killed mid-upgrade; its
//!   standby goes at the next start ([`backend`]);
//! - the backend's own scenarios, under `barrier` only (they test its
//!   generations and the pod template, which no policy changes; see
//!   [`backend`]): `resized` (`replica resize` to 2x1 and back under a
//!   steady reader: no read refused or wrong, the pod count follows),
//!   `stuck-terminating` (a pod held terminating, as a lost
//!   node's is: a new generation starts beside it), `liveness-failed` (a
//!   process hangs while the environment is away: the kubelet's liveness
//!   probe restarts it) and `node-lost` (the kubelet stopped and every
//!   process killed: the lost pods do not hold the replica down).
//!
//! The negative controls: `barrier+no-shared-fate` turns the backend's
//! shared-fate restart off (failpoint `kube_shared_fate_off`): the
//! kubelet's in-place restart alone must be caught (I2);
//! `barrier+reused-names` gives pods the same names in every generation
//! (failpoint `kube_pod_names_reused`): `stuck-terminating` must catch it.
//!
//! The suite prints each scenario's time (`{"node_scenario":...}`), what
//! broke, and one reporting-contract line per variant (`"suite":"kube-node"`);
//! it exits non-zero unless every variant passed and the control was
//! caught.
//!
//! `lockstep-chaos-node shipped` checks the environment the example
//! overlay deploys instead ([`shipped`]; one line, `"suite":"kube-shipped"`).
//!
//! Variables: `LOCKSTEP_KUBE_KUBECONFIG`, `LOCKSTEP_KUBE_ADMIN_KUBECONFIG`,
//! `LOCKSTEP_KUBECTL` (as for the other real-server suites),
//! `LOCKSTEP_NODE_IMAGE` (the image, as containerd names it),
//! `LOCKSTEP_POLICY_DIR` (the built `*.wasm` policies), `LOCKSTEP_BIN`
//! (`lockstep`, built with the test features), `LOCKSTEP_NODE_NAME` and
//! `LOCKSTEP_NODE_KUBELET_PID` (the node's kubelet, which `node-lost`
//! stops and resumes).

use std::process::ExitCode;
use std::time::{Duration, Instant};

use lockstep_chaos::environment::real_kube::RealCluster;
use lockstep_chaos::outcome::{violation, Failure, Tally};

#[path = "node/backend.rs"]
mod backend;
#[path = "node/pods.rs"]
mod pods;
#[path = "node/prometheus.rs"]
mod prometheus;
#[path = "node/scrape.rs"]
mod scrape;
#[path = "node/setting.rs"]
mod setting;
#[path = "node/shipped.rs"]
mod shipped;
#[path = "node/workload.rs"]
mod workload;

use setting::{finish, Setting};
use workload::{Api, Workload};

/// Processes of the replica (pods).
const PROCESSES: u32 = 4;
/// Timely workers per process.
const WORKERS: u32 = 2;
/// The bound on the set-up (first pods, the mesh, the first answers).
const SET_UP: Duration = Duration::from_secs(180);
/// The bound on a recovery after a fault: the next write answered and both
/// exports right. docs/kubernetes.md states it.
const RECOVERY: Duration = Duration::from_secs(60);
/// The scenarios of a variant that is not a control: the backend's own
/// ([`backend`]) under [`STUCK_UNDER`] only.
fn scenarios(variant: &str) -> usize {
    if variant == STUCK_UNDER {
        12
    } else {
        8
    }
}
/// The policy the backend's own scenarios run under.
const STUCK_UNDER: &str = "barrier";
/// How long after a write's first attempt is sent `environment-killed`
/// kills the environment (a write takes longer: the kill cuts it).
const KILL_AFTER: Duration = Duration::from_millis(2);
/// How long process 0 stays stopped.
const STOP_FOR: Duration = Duration::from_secs(8);
/// The variants run by default: every shipped policy, and the negative
/// controls.
const VARIANTS: [&str; 5] = ["barrier", "broadcast", "log", NEGATIVE, NAMES_REUSED];
/// The negative control: barrier with the Kubernetes backend's shared-fate
/// restart off (failpoint `kube_shared_fate_off`), so a dead process is
/// restarted in place by the kubelet alone; `process-killed` must catch it.
const NEGATIVE: &str = "barrier+no-shared-fate";
/// The names' negative control: barrier with pods that keep their names
/// across generations (failpoint `kube_pod_names_reused`, as records
/// written before pods were named by generation): `stuck-terminating`
/// must catch it (the new generation's pod cannot take the held pod's
/// name). It runs `create` and that scenario only.
const NAMES_REUSED: &str = "barrier+reused-names";

fn harness(e: impl std::fmt::Display) -> Failure {
    Failure::Harness(e.to_string())
}

/// Records a scenario (and prints its time); whether it failed (the
/// variant's later scenarios then do not run).
fn timed(
    out: &mut Vec<Scenario>,
    policy: &str,
    name: &'static str,
    started: Instant,
    result: Result<(), Failure>,
) -> bool {
    let seconds = started.elapsed().as_secs_f64();
    println!(
        "{}",
        serde_json::json!({"node_scenario": name, "variant": policy, "seconds": (seconds * 10.0).round() / 10.0, "ok": result.is_ok()})
    );
    let failed = result.is_err();
    out.push(Scenario {
        name,
        result,
        seconds,
    });
    failed
}

/// One scenario's result and time.
struct Scenario {
    name: &'static str,
    result: Result<(), Failure>,
    seconds: f64,
}

async fn variant(cluster: &RealCluster, policy: &str) -> Vec<Scenario> {
    let mut out = Vec::new();
    let setting = match Setting::new(cluster, policy) {
        Ok(s) => s,
        Err(e) => {
            out.push(Scenario {
                name: "create",
                result: Err(harness(format!("{e:#}"))),
                seconds: 0.0,
            });
            return out;
        }
    };
    let mut env = match setting.serve().await {
        Ok(env) => env,
        Err(e) => {
            out.push(Scenario {
                name: "create",
                result: Err(harness(format!("lockstep serve: {e:#}"))),
                seconds: 0.0,
            });
            return out;
        }
    };
    let mut w = Workload::new(Setting::api(&env));
    // create
    let started = Instant::now();
    let result = async {
        w.set_up(PROCESSES, WORKERS, SET_UP).await?;
        for _ in 0..3 {
            w.write(SET_UP, "I2").await?;
        }
        w.check(SET_UP, "I2").await?;
        setting.one_generation().await.map(drop)
    }
    .await;
    if timed(&mut out, policy, "create", started, result) {
        return finish(out, env, &setting);
    }
    if setting.names_reused {
        // The names' control: only the scenario it must fail.
        let started = Instant::now();
        let result = backend::stuck_terminating(&setting, &mut w).await;
        timed(&mut out, policy, "stuck-terminating", started, result);
        return finish(out, env, &setting);
    }

    // process-killed
    let started = Instant::now();
    let result = async {
        let before = setting.generation()?;
        let pid = setting.pid_of(1)?;
        pods::signal(pid, libc::SIGKILL).map_err(harness)?;
        setting.replaced(before, "process 1 SIGKILLed").await?;
        // The answers must come from the new generation.
        setting.one_generation().await?;
        w.write_and_check(RECOVERY, "I2").await
    }
    .await;
    if timed(&mut out, policy, "process-killed", started, result) {
        return finish(out, env, &setting);
    }

    // process-stopped
    let result = async {
        let pid = setting.pid_of(0)?;
        pods::signal(pid, libc::SIGSTOP).map_err(harness)?;
        tokio::time::sleep(STOP_FOR).await;
        // The kubelet (liveness probe) or the environment (a silent
        // process) may have replaced it meanwhile: then there is nothing
        // to resume.
        match pods::signal(pid, libc::SIGCONT) {
            Ok(()) => {}
            Err(_) if !std::path::Path::new(&format!("/proc/{pid}")).exists() => {
                eprintln!("node: {policy}: the stopped process {pid} was replaced before SIGCONT");
            }
            Err(e) => return Err(harness(e)),
        }
        Ok::<_, Failure>(())
    }
    .await;
    let started = Instant::now();
    let result = match result {
        Ok(()) => {
            async {
                w.write_and_check(RECOVERY, "I2").await?;
                setting.one_generation().await.map(drop)
            }
            .await
        }
        Err(e) => Err(e),
    };
    if timed(&mut out, policy, "process-stopped", started, result) {
        return finish(out, env, &setting);
    }

    // pod-deleted
    let started = Instant::now();
    let result = async {
        let before = setting.generation()?;
        setting
            .cluster
            .kubectl_out(&[
                "delete",
                "pod",
                &setting.pod_of(0)?,
                "-n",
                &setting.ns,
                "--wait=false",
            ])
            .map_err(|e| harness(format!("{e:#}")))?;
        setting.replaced(before, "pod 0 deleted").await?;
        setting.one_generation().await?;
        w.write_and_check(RECOVERY, "I2").await
    }
    .await;
    if timed(&mut out, policy, "pod-deleted", started, result) {
        return finish(out, env, &setting);
    }

    // drained
    let started = Instant::now();
    let result = async {
        let before = setting.generation()?;
        let node = std::env::var("LOCKSTEP_NODE_NAME")
            .map_err(|_| harness("LOCKSTEP_NODE_NAME is not set (cargo xtask kube sets it)"))?;
        let drained = setting.cluster.kubectl_out(&[
            "drain",
            &node,
            "--ignore-daemonsets",
            "--delete-emptydir-data",
            "--timeout=120s",
        ]);
        let uncordoned = setting.cluster.kubectl_out(&["uncordon", &node]);
        if let Err(e) = drained {
            return Err(violation(
                "I2",
                format!("kubectl drain did not finish with the replica on the node: {e:#}"),
            ));
        }
        uncordoned.map_err(|e| harness(format!("{e:#}")))?;
        setting.replaced(before, "the node drained").await?;
        setting.one_generation().await?;
        w.write_and_check(RECOVERY, "I2").await
    }
    .await;
    if timed(&mut out, policy, "drained", started, result) {
        return finish(out, env, &setting);
    }

    // environment-killed
    let started = Instant::now();
    let result = async {
        let before = pods::pods(&setting.cluster, &setting.ns, &setting.service)
            .map_err(|e| harness(format!("{e:#}")))?;
        // Killed while a write is in flight: applied exactly once.
        let answered = w
            .write_across(
                async {
                    tokio::time::sleep(KILL_AFTER).await;
                    env.kill().await.map_err(|e| harness(format!("{e:#}")))?;
                    env = setting
                        .serve()
                        .await
                        .map_err(|e| harness(format!("lockstep serve again: {e:#}")))?;
                    Ok(Setting::api(&env))
                },
                RECOVERY,
                "I2",
            )
            .await?;
        eprintln!(
            "node: {policy}: the write in flight at the kill was {}",
            if answered {
                "answered before it"
            } else {
                "cut by it, and retried"
            }
        );
        w.check(RECOVERY, "I2").await?;
        setting.one_generation().await?;
        let after = pods::pods(&setting.cluster, &setting.ns, &setting.service)
            .map_err(|e| harness(format!("{e:#}")))?;
        pods::adopted(&before, &after, "across an environment restart")
    }
    .await;
    if timed(&mut out, policy, "environment-killed", started, result) {
        return finish(out, env, &setting);
    }

    // upgraded
    let started = Instant::now();
    let result = async {
        let next = std::env::var("LOCKSTEP_NODE_IMAGE_NEXT").map_err(|_| {
            harness("LOCKSTEP_NODE_IMAGE_NEXT is not set (cargo xtask kube sets it)")
        })?;
        let before = pods::pods(&setting.cluster, &setting.ns, &setting.service)
            .map_err(|e| harness(format!("{e:#}")))?;
        env.kill().await.map_err(|e| harness(format!("{e:#}")))?;
        env = setting
            .serve_on(&next)
            .await
            .map_err(|e| harness(format!("lockstep serve on {next}: {e:#}")))?;
        w.set_api(Setting::api(&env));
        w.write_and_check(RECOVERY, "I2").await?;
        // An environment of a new image restarts no replica.
        let after = pods::pods(&setting.cluster, &setting.ns, &setting.service)
            .map_err(|e| harness(format!("{e:#}")))?;
        pods::adopted(&before, &after, "by an environment of another image")?;
        let generation = setting.generation()?;
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let (reads, upgraded) = tokio::join!(w.read_steadily(stopped), async {
            let upgraded = w.upgrade_keep_answering(RECOVERY).await;
            let _ = stop.send(true);
            upgraded
        });
        upgraded?;
        eprintln!("node: {policy}: reads across the upgrade: {reads:?}");
        reads.check("replica upgrade --keep-answering")?;
        setting.replaced(generation, "replica upgrade").await?;
        setting.one_generation().await?;
        let pods = pods::pods(&setting.cluster, &setting.ns, &setting.service)
            .map_err(|e| harness(format!("{e:#}")))?;
        if let Some(p) = pods.iter().find(|p| p.image != next) {
            return Err(violation(
                "I2",
                format!(
                    "after replica upgrade pod {} runs {}, not {next}",
                    p.name, p.image
                ),
            ));
        }
        w.write_and_check(RECOVERY, "I2").await
    }
    .await;
    if timed(&mut out, policy, "upgraded", started, result) {
        return finish(out, env, &setting);
    }

    let started = Instant::now();
    let result = backend::upgrade_interrupted(&setting, &mut env, &mut w).await;
    if timed(&mut out, policy, "upgrade-interrupted", started, result) || policy != STUCK_UNDER {
        return finish(out, env, &setting);
    }

    let started = Instant::now();
    let result = backend::resized(&setting, &mut w).await;
    if timed(&mut out, policy, "resized", started, result) {
        return finish(out, env, &setting);
    }

    let started = Instant::now();
    let result = backend::stuck_terminating(&setting, &mut w).await;
    if timed(&mut out, policy, "stuck-terminating", started, result) {
        return finish(out, env, &setting);
    }

    let started = Instant::now();
    let result = backend::liveness_failed(&setting, &mut env, &mut w).await;
    if timed(&mut out, policy, "liveness-failed", started, result) {
        return finish(out, env, &setting);
    }

    let started = Instant::now();
    let result = backend::node_lost(&setting, &mut w).await;
    timed(&mut out, policy, "node-lost", started, result);
    finish(out, env, &setting)
}

fn main() -> ExitCode {
    let variants: Vec<String> = {
        let args: Vec<String> = std::env::args().skip(1).collect();
        if args.is_empty() {
            VARIANTS.map(String::from).to_vec()
        } else {
            args
        }
    };
    let runtime = tokio::runtime::Runtime::new().expect("a tokio runtime");
    let cluster = match runtime.block_on(RealCluster::from_env()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("lockstep-chaos-node: {e:#}");
            return ExitCode::FAILURE;
        }
    };
    if variants.first().map(String::as_str) == Some("shipped") {
        let scenarios = runtime.block_on(shipped::run(&cluster));
        let mut tally = Tally::default();
        for s in &scenarios {
            let said = tally.record(&s.result);
            eprintln!("node: shipped {}: {said} ({:.1} s)", s.name, s.seconds);
        }
        let variant =
            std::env::var("LOCKSTEP_SHIPPED_VARIANT").unwrap_or_else(|_| "postgres".into());
        println!("{}", tally.summary_line("kube-shipped", &variant, false));
        // create, scraped, environment-pod-deleted: none may be left out.
        return if tally.ok(false) && scenarios.len() == shipped::SCENARIOS {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        };
    }
    let mut all_ok = true;
    let mut lines = Vec::new();
    for v in &variants {
        eprintln!("node: variant {v}");
        let scenarios = runtime.block_on(variant(&cluster, v));
        let mut tally = Tally::default();
        for s in &scenarios {
            let said = tally.record(&s.result);
            eprintln!("node: {v} {}: {said} ({:.1} s)", s.name, s.seconds);
        }
        let control = v == NEGATIVE || v == NAMES_REUSED;
        all_ok &= tally.ok(control) && (control || scenarios.len() == self::scenarios(v));
        lines.push(tally.summary_line("kube-node", v, control));
    }
    for l in lines {
        println!("{l}");
    }
    if all_ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
