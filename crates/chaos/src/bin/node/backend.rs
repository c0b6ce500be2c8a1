//! The scenarios of the Kubernetes backend itself: `stuck-terminating`
//! ([`stuck_terminating`]), `resized`, and three in which what would
//! repair the replica is away. All but `upgrade-interrupted` (whose
//! standby replays under the policy) run under `barrier` only: they test
//! the backend's generations and the pod template, which no distribution
//! policy changes (the policies' resizes are tested on local processes,
//! `crates/cli/tests/upgrade_answering.rs`).
//!
//! - `upgrade-interrupted`: the environment SIGKILLed in the middle of
//!   `replica upgrade --keep-answering`, once its standby generation's pods
//!   exist, and started again: the standby, which no catalog names, must
//!   go within [`RECOVERY`] (O2), and the replica answer right (I2, I3).
//!   (A standby that carries on is issue 60's durable reconfiguration
//!   record, not built.)
//! - `resized`: `replica resize` from [`PROCESSES`] x [`WORKERS`] to 2 x 1
//!   and back, under a steady reader: no read refused (I2) or wrong (I3),
//!   each time the replica one generation of the new pod count within
//!   [`RECOVERY`] (its standby's pods gone), and a write then answered
//!   right.
//! - `liveness-failed`: the environment SIGKILLed, then process 2
//!   SIGSTOPped. Nothing but the kubelet's liveness probe can see the hung
//!   process: it must restart the container within [`LIVENESS_BOUND`]
//!   (else I2). The environment, started again, must replace the whole
//!   generation (a container restarted in place is not the replica's: I2)
//!   and answer right within [`RECOVERY`].
//! - `node-lost`: the kubelet SIGSTOPped (the node stops reporting, as a
//!   lost node does) and every replica process SIGKILLed (the node's power
//!   with it). The lost pods cannot go (nothing on the node confirms their
//!   deletion), so they must not hold the replica: a new generation's pods
//!   must be created while they are still there, within [`LOST_BOUND`]
//!   (else I2; the lost pods gone by then is a harness error: nothing was
//!   tested). The kubelet resumed (the node back), the replica must be one
//!   generation and answer right within [`RECOVERY`]. With one node, no
//!   replica can run before the node is back: on a cluster of several, the
//!   new pods are scheduled elsewhere.

use std::time::{Duration, Instant};

use lockstep_chaos::environment::EnvProcess;
use lockstep_chaos::outcome::{violation, Failure};

use super::{harness, pods, Setting, Workload, PROCESSES, RECOVERY, WORKERS};

/// The bound on the kubelet's restart of a hung container: its liveness
/// probe fails 3 times 10 s apart (`lockstep_orchestrator_kubernetes`'s
/// probes), then it is killed; 60 s leaves a period and more to spare.
const LIVENESS_BOUND: Duration = Duration::from_secs(60);

/// The bound on the new generation's pods after the node is lost: the
/// environment's wait before it counts a replica that served and cannot
/// be reached as lost (30 s), one wait for the lost pods (`stuck_after`,
/// 20 s) and the pods' creation, with room to spare.
const LOST_BOUND: Duration = Duration::from_secs(90);

/// `resized` (see the module's docs).
pub async fn resized(setting: &Setting, w: &mut Workload) -> Result<(), Failure> {
    for (processes, workers) in [(2, 1), (PROCESSES, WORKERS)] {
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let (reads, resized) = tokio::join!(w.read_steadily(stopped), async {
            let resized = w.resize(processes, workers, RECOVERY).await;
            let _ = stop.send(true);
            resized
        });
        resized?;
        let what = format!("replica resize to {processes}x{workers}");
        eprintln!("node: reads across {what}: {reads:?}");
        reads.check(&what)?;
        setting.one_generation_of(processes as usize, &[]).await?;
        let standby = lockstep_launch::ServiceTemplate::standby_service_name(1);
        pods::until(RECOVERY, Duration::from_millis(200), || {
            let left = pods::pods(&setting.cluster, &setting.ns, &standby)
                .map_err(|e| harness(format!("{e:#}")))?;
            Ok(left.is_empty().then_some(()))
        })
        .await?
        .ok_or_else(|| {
            violation(
                "O2",
                format!("after {what} the standby's pods are still there"),
            )
        })?;
    }
    w.write_and_check(RECOVERY, "I2").await
}

/// `upgrade-interrupted` (see the module's docs). `env` is started again
/// whatever happened, so that the variant's end finds one.
pub async fn upgrade_interrupted(
    setting: &Setting,
    env: &mut EnvProcess,
    w: &mut Workload,
) -> Result<(), Failure> {
    // The first replica's standby (the setting's service is replica 1's).
    let standby = lockstep_launch::ServiceTemplate::standby_service_name(1);
    let standby_pods = || {
        pods::pods(&setting.cluster, &setting.ns, &standby).map_err(|e| harness(format!("{e:#}")))
    };
    let seen = {
        let upgrade = w.upgrade_keep_answering(RECOVERY);
        let started = async {
            pods::until(RECOVERY, Duration::from_millis(100), || {
                Ok((!standby_pods()?.is_empty()).then_some(()))
            })
            .await?
            .ok_or_else(|| {
                harness(format!(
                    "no pod of {standby} within {} s of replica upgrade --keep-answering",
                    RECOVERY.as_secs()
                ))
            })
        };
        tokio::select! {
            r = upgrade => Err(harness(format!(
                "the upgrade ended ({r:?}) before its standby's pods were seen: nothing was interrupted"
            ))),
            s = started => s,
        }
    };
    env.kill().await.map_err(|e| harness(format!("{e:#}")))?;
    *env = setting
        .serve()
        .await
        .map_err(|e| harness(format!("lockstep serve again: {e:#}")))?;
    w.set_api(Setting::api(env));
    seen?;
    let started = Instant::now();
    let mut left = Vec::new();
    let gone = pods::until(RECOVERY, Duration::from_millis(250), || {
        left = standby_pods()?;
        Ok(left.is_empty().then_some(()))
    })
    .await?;
    if gone.is_none() {
        return Err(violation(
            "O2",
            format!(
                "the standby of an interrupted upgrade was not removed within {} s of the next start: {left:?}",
                RECOVERY.as_secs()
            ),
        ));
    }
    eprintln!(
        "node: the interrupted upgrade's standby removed {:.1} s after the start",
        started.elapsed().as_secs_f64()
    );
    setting.one_generation().await?;
    w.write_and_check(RECOVERY, "I2").await
}

/// `liveness-failed` (see the module's docs). `env` is started again
/// whatever happened, so that the variant's end finds one.
pub async fn liveness_failed(
    setting: &Setting,
    env: &mut EnvProcess,
    w: &mut Workload,
) -> Result<(), Failure> {
    let generation = setting.generation()?;
    let pod = setting.pod_of(2)?;
    let pid = setting.pid_of(2)?;
    env.kill().await.map_err(|e| harness(format!("{e:#}")))?;
    let started = Instant::now();
    // The environment is started again below whatever this gives.
    let restarted = match pods::signal(pid, libc::SIGSTOP) {
        Ok(()) => {
            pods::until(LIVENESS_BOUND, Duration::from_millis(500), || {
                let now = pods::pods(&setting.cluster, &setting.ns, &setting.service)
                    .map_err(|e| harness(format!("{e:#}")))?;
                Ok(now
                    .iter()
                    .any(|p| p.name == pod && p.restarts > 0)
                    .then_some(()))
            })
            .await
        }
        Err(e) => Err(harness(e)),
    };
    let seconds = started.elapsed().as_secs_f64();
    *env = setting
        .serve()
        .await
        .map_err(|e| harness(format!("lockstep serve again: {e:#}")))?;
    w.set_api(Setting::api(env));
    if restarted?.is_none() {
        // Resumed, so that nothing stays stopped past the scenario.
        let _ = pods::signal(pid, libc::SIGCONT);
        return Err(violation(
            "I2",
            format!(
                "process 2 hung (SIGSTOP) for {} s and the kubelet's liveness probe did not restart its container",
                LIVENESS_BOUND.as_secs()
            ),
        ));
    }
    eprintln!("node: liveness probe restarted pod {pod}'s container {seconds:.1} s after the stop");
    setting
        .replaced(generation, "a container restarted by its liveness probe")
        .await?;
    setting.one_generation().await?;
    w.write_and_check(RECOVERY, "I2").await
}

/// `node-lost` (see the module's docs).
pub async fn node_lost(setting: &Setting, w: &mut Workload) -> Result<(), Failure> {
    let kubelet: u32 = std::env::var("LOCKSTEP_NODE_KUBELET_PID")
        .ok()
        .and_then(|p| p.parse().ok())
        .ok_or_else(|| {
            harness("LOCKSTEP_NODE_KUBELET_PID is not set (cargo xtask kube sets it)")
        })?;
    let before = setting.generation()?;
    let lost: Vec<String> = pods::pods(&setting.cluster, &setting.ns, &setting.service)
        .map_err(|e| harness(format!("{e:#}")))?
        .into_iter()
        .map(|p| p.name)
        .collect();
    pods::signal(kubelet, libc::SIGSTOP).map_err(harness)?;
    let started = Instant::now();
    let result = async {
        // Read with the kubelet stopped (nothing restarts a container
        // now); a process already gone is as the lost node leaves it.
        for i in 0..PROCESSES {
            let Ok(pid) = setting.pid_of(i) else {
                continue;
            };
            if let Err(e) = pods::signal(pid, libc::SIGKILL) {
                if std::path::Path::new(&format!("/proc/{pid}")).exists() {
                    return Err(harness(e));
                }
            }
        }
        let mut now = Vec::new();
        let created = pods::until(LOST_BOUND, Duration::from_millis(500), || {
            now = pods::pods(&setting.cluster, &setting.ns, &setting.service)
                .map_err(|e| harness(format!("{e:#}")))?;
            let newer = now
                .iter()
                .filter(|p| p.generation.parse::<u64>().is_ok_and(|g| g > before))
                .count();
            Ok((newer >= PROCESSES as usize).then_some(()))
        })
        .await?;
        if created.is_none() {
            return Err(violation(
                "I2",
                format!(
                    "the node lost (kubelet stopped, processes killed): no new generation's pods within {} s; the pods: {now:?}",
                    LOST_BOUND.as_secs()
                ),
            ));
        }
        if !now.iter().any(|p| lost.contains(&p.name)) {
            return Err(harness(
                "the lost pods were gone before the new generation's started: nothing was tested",
            ));
        }
        Ok(())
    }
    .await;
    let seconds = started.elapsed().as_secs_f64();
    // The node back, whatever happened.
    let resumed = pods::signal(kubelet, libc::SIGCONT);
    result?;
    resumed.map_err(harness)?;
    eprintln!("node: the lost node's replacement pods created {seconds:.1} s after the loss");
    let back = Instant::now();
    setting.one_generation().await?;
    w.write_and_check(RECOVERY, "I2").await?;
    eprintln!(
        "node: the replica answered right {:.1} s after the node came back",
        back.elapsed().as_secs_f64()
    );
    Ok(())
}

/// `stuck-terminating`: process 0's pod held by a finalizer, then deleted,
/// so it stays terminating as a pod of a lost node does (the kubelet kills
/// its container; nothing removes the object). A new generation must start
/// beside it and answer right within [`RECOVERY`] while it is still there
/// (else the scenario tested nothing: a harness error); released, it goes
/// and the replica is one generation again.
pub async fn stuck_terminating(setting: &Setting, w: &mut Workload) -> Result<(), Failure> {
    let before = setting.generation()?;
    let held = setting.pod_of(0)?;
    pods::hold(&setting.cluster, &setting.ns, &held).map_err(|e| harness(format!("{e:#}")))?;
    let result = async {
        setting
            .cluster
            .kubectl_out(&["delete", "pod", &held, "-n", &setting.ns, "--wait=false"])
            .map_err(|e| harness(format!("{e:#}")))?;
        setting
            .replaced(before, "pod 0 deleted and stuck terminating")
            .await?;
        setting.one_generation_beside(&[held.as_str()]).await?;
        w.write_and_check(RECOVERY, "I2").await?;
        let pods = pods::pods(&setting.cluster, &setting.ns, &setting.service)
            .map_err(|e| harness(format!("{e:#}")))?;
        if !pods.iter().any(|p| p.name == held && p.deleting) {
            return Err(harness(format!(
                "pod {held} was not held terminating through the recovery: nothing was tested"
            )));
        }
        Ok(())
    }
    .await;
    // Released whatever happened: a held pod would keep its namespace.
    let released = pods::release(&setting.cluster, &setting.ns, &setting.service, &held);
    result?;
    released.map_err(|e| harness(format!("{e:#}")))?;
    setting.one_generation().await.map(drop)
}
