//! `lockstep-chaos-distribution`: the distribution fault suite.
//!
//! Every scenario starts a fresh replica of 2 processes x 2 workers (3 x 1
//! where a third process adds coverage) through
//! the orchestrator's process backend, drives it with a controller whose
//! distribution policy picks one strategy for every command, injects one real
//! fault, and then checks the invariants of docs/invariants.md on the real processes:
//!
//! - **I1** every worker's dataflow-creation log is the same
//!   (`lockstep_reconcile::lockstep_check`);
//! - **I2** every dataflow of the newest controller's target reaches the
//!   latest input time within a bound (no silent hang);
//! - **I3** every peek equals the plain-Rust reference;
//! - **I4** every worker has exactly the target installed (no partial install).
//!
//! Faults: the controller crashed by the failpoint
//! `controller_partial_broadcast` after a command reached process 0 and not
//! process 1, or process 1 and not process 0 (create, drop, write, peek, and
//! InitializationComplete during reconciliation itself), twice in a row, or
//! on 2 of 3 processes; the partial drop, both ways round; every connection
//! dropped, also between two creates; a replica process killed (process 0,
//! process 1, during reconciliation); a replica process stopped (SIGSTOP) and
//! resumed, or stopped and the replica restarted; a stale controller that
//! keeps sending after its successor connected; a restart with a changed
//! target. Every replica has a command log, so the `log` strategy runs too.
//!
//! Every scenario ends in one of three outcomes (`lockstep_chaos::outcome`): pass, a
//! violation of a named invariant, or a harness error (the replica did not
//! start, the setup before the fault failed, a signal could not be sent). A
//! harness error fails the run whatever the variant; `naive`, the negative
//! control, is caught only by violations.
//!
//! The `@hosts` variants (`barrier@hosts` and so on) run the partition
//! scenarios instead, on two simulated hosts ([`partitions`]); they need
//! root and iproute2.
//!
//! Usage: `lockstep-chaos-distribution [VARIANT...]` (default: broadcast
//! barrier log log@postgres naive naive+history-check, and where simulated
//! hosts can be made, broadcast@hosts barrier@hosts log@hosts naive@hosts;
//! `STRATEGY@postgres` keeps the replica's command log in a throw-away
//! PostgreSQL server instead of a SQLite file). Prints what broke, then one JSON
//! line per variant. Exits non-zero if a variant that must pass had a
//! violation, if any scenario had a harness error, or if `naive` was not
//! caught.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::Duration;

use lockstep_controller::{launch, Controller, ReplicaAddrs, Timeouts};
use lockstep_orchestrator::process::{
    kill_all_services, ProcessOrchestrator, ProcessOrchestratorConfig,
};
use lockstep_orchestrator::{Orchestrator, ServiceStatus};
use lockstep_policy::{
    CommandInfo, DistributionPolicy, FixedStrategy, MismatchAction, MismatchInfo, PolicyError,
};
use lockstep_protocol::reference::evaluate;
use lockstep_protocol::text::parse_plan;
use lockstep_protocol::{
    CommandHistory, CommandKind, DataflowDescription, Export, Strategy, Update,
};
use std::sync::Arc;

use lockstep_chaos::outcome::{violation, Failure, Tally};

#[path = "distribution/partitions.rs"]
mod partitions;

const LAST_TIME: u64 = 3;
const FAILPOINT: &str = "controller_partial_broadcast";

struct Replica {
    dir: tempfile::TempDir,
    orchestrator: Arc<ProcessOrchestrator>,
    service: String,
    addrs: ReplicaAddrs,
}

impl Drop for Replica {
    fn drop(&mut self) {
        let _ = kill_all_services(self.dir.path());
    }
}

fn replica_binary() -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    exe.parent().expect("a directory").join("lockstep-replica")
}

/// Starts replica `id` of `processes` x `workers`, on `hosts` simulated
/// hosts if not 0; its command log is a SQLite file in its directory, or the
/// log `replica-ID` in the PostgreSQL database at `postgres`.
async fn start_replica(
    id: u64,
    processes: usize,
    workers: u32,
    postgres: Option<&str>,
    hosts: usize,
) -> Result<Replica, String> {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let mut config = ProcessOrchestratorConfig::new(dir.path(), 1);
    config.hosts = hosts;
    let orchestrator = ProcessOrchestrator::new(config).map_err(|e| e.to_string())?;
    let log = match postgres {
        Some(url) => lockstep_controller::LogLocation::Postgres {
            url: url.to_string(),
            name: format!("replica-{id}"),
        },
        None => lockstep_controller::LogLocation::Sqlite(dir.path().join("command-log.sqlite")),
    };
    // A session key, as under `lockstep serve`.
    let key = lockstep_protocol::SessionKey::derive(&[0xc4; 32], id);
    let config = launch::with_session_key(
        launch::with_command_log(
            launch::replica_service(&replica_binary(), id, processes, workers),
            &log,
        ),
        &key,
    )
    .env(
        "RUST_LOG",
        std::env::var("LOCKSTEP_CHAOS_REPLICA_LOG").unwrap_or_else(|_| "error".into()),
    );
    let status: ServiceStatus = orchestrator
        .ensure_service(config)
        .await
        .map_err(|e| e.to_string())?;
    let mut addrs = launch::replica_addrs(&status, workers).map_err(|e| e.to_string())?;
    addrs.command_log = Some(log);
    addrs.session_key = Some(key);
    Ok(Replica {
        dir,
        orchestrator: Arc::new(orchestrator),
        service: status.name.clone(),
        addrs,
    })
}

/// What a scenario runs: one strategy for every command, what the
/// history check on connect does on a mismatch, and where the command log
/// lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Variant {
    strategy: Strategy,
    /// `STRATEGY@postgres`: the replica's command log is in PostgreSQL (a
    /// throw-away server this binary starts), not a SQLite file.
    postgres: bool,
    /// `naive+history-check`: naive delivery, but the history check on
    /// connect (history check) restarts the replica on a mismatch, which
    /// the harness then does through the orchestrator, as the environment
    /// does. Plain `naive` is the negative control: its mismatches are
    /// reported and nobody acts on them.
    check_reconciles: bool,
    /// `@hosts`: the partition scenarios, on two simulated hosts.
    hosts: bool,
}

impl std::fmt::Display for Variant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.strategy)?;
        if self.check_reconciles {
            write!(f, "+history-check")?;
        }
        if self.hosts {
            write!(f, "@hosts")?;
        }
        if self.postgres {
            write!(f, "@postgres")?;
        }
        Ok(())
    }
}

impl std::str::FromStr for Variant {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (s, postgres, hosts) = match s.split_once('@') {
            Some((s, "postgres")) => (s, true, false),
            Some((s, "hosts")) => (s, false, true),
            Some((_, other)) => {
                return Err(format!(
                    "unknown variant suffix @{other} (known: @postgres, @hosts)"
                ))
            }
            None => (s, false, false),
        };
        let (name, check_reconciles) = match s.strip_suffix("+history-check") {
            Some(n) => (n, true),
            None => (s, false),
        };
        Ok(Variant {
            strategy: name.parse()?,
            postgres,
            check_reconciles,
            hosts,
        })
    }
}

/// A strategy (naive, in the `naive+history-check` variant) whose history
/// check restarts the replica on a mismatch. (Reconciling collectively
/// cannot repair naive delivery: a dataflow built on some workers only has
/// already shifted their timely dataflow indices.)
struct CheckThenRestart(Strategy);

impl DistributionPolicy for CheckThenRestart {
    fn name(&self) -> &str {
        "naive+history-check"
    }
    fn choose(&mut self, _info: &CommandInfo) -> Result<Strategy, PolicyError> {
        Ok(self.0)
    }
    fn on_mismatch(&mut self, _info: &MismatchInfo) -> Result<MismatchAction, PolicyError> {
        Ok(MismatchAction::RestartReplica)
    }
}

fn controller(r: &Replica, epoch: u64, v: Variant, history: CommandHistory) -> Controller {
    let policy: Box<dyn DistributionPolicy + Send> = if v.check_reconciles {
        Box::new(CheckThenRestart(v.strategy))
    } else {
        Box::new(FixedStrategy(v.strategy))
    };
    let c = Controller::start(
        r.addrs.clone(),
        epoch,
        history,
        policy,
        Timeouts {
            connect: Duration::from_secs(20),
            heartbeat_interval: Duration::from_millis(100),
            heartbeat_timeout: Duration::from_secs(1),
            request: Duration::from_secs(15),
        },
    );
    if v.check_reconciles {
        // What the environment does with a restart request.
        let mut events = c.events();
        let orchestrator = Arc::clone(&r.orchestrator);
        let service = r.service.clone();
        tokio::spawn(async move {
            while let Ok(e) = events.recv().await {
                if let lockstep_controller::Event::HistoryMismatch {
                    action: MismatchAction::RestartReplica,
                    ..
                } = e
                {
                    eprintln!("history check: the workers disagree; restarting {service}");
                    if let Err(e) = orchestrator.restart_service(&service).await {
                        eprintln!("restarting {service} failed: {e}");
                    }
                }
            }
        });
    }
    c
}

fn u(row: &[i64], time: u64, diff: i64) -> Update {
    Update {
        row: row.to_vec(),
        time,
        diff,
    }
}

fn writes() -> Vec<(u64, Vec<Update>, u64)> {
    vec![
        (
            1,
            vec![u(&[1, 10], 0, 1), u(&[2, 20], 0, 1), u(&[3, 30], 0, 1)],
            1,
        ),
        (2, vec![u(&[1, 100], 0, 1), u(&[2, 200], 0, 1)], 1),
        (1, vec![u(&[1, 10], 1, -1), u(&[1, 11], 1, 1)], 2),
        (2, vec![u(&[3, 300], 2, 2)], 3),
        (1, vec![u(&[4, 40], 3, 1)], LAST_TIME + 1),
        (2, vec![u(&[2, 200], 3, -1)], LAST_TIME + 1),
    ]
}

fn dataflow(id: u64, plan: &str) -> DataflowDescription {
    DataflowDescription {
        id,
        as_of: 0,
        inputs: vec![1, 2],
        exports: vec![Export {
            collection_id: 1000 + id,
            plan: parse_plan(plan).expect("a valid plan"),
        }],
        debug_name: format!("chaos-{id}"),
    }
}

fn d1() -> DataflowDescription {
    dataflow(1, "join(get(1), get(2), #0, #0)")
}
fn d2() -> DataflowDescription {
    dataflow(2, "reduce(get(1), [#0], count, sum(#1))")
}
fn x() -> DataflowDescription {
    dataflow(3, "reduce(get(2), [#1], count)")
}
fn y() -> DataflowDescription {
    dataflow(4, "filter(get(1), #1 > 10)")
}

/// A history: every write, then these dataflows.
fn history(dataflows: &[DataflowDescription]) -> CommandHistory {
    let mut h = CommandHistory::new();
    h.push(CommandKind::CreateInstance(Default::default()));
    for (c, ups, upper) in writes() {
        h.push(CommandKind::WriteInput(lockstep_protocol::WriteInput {
            collection_id: c,
            updates: ups,
            upper,
            more: false,
            batch_digest: None,
        }));
    }
    for d in dataflows {
        h.push(CommandKind::CreateDataflow(d.clone()));
    }
    h
}

/// Checks I1 to I4 against `target`: a broken invariant is a violation.
async fn check(c: &Controller, target: &[DataflowDescription]) -> Result<(), Failure> {
    for d in target {
        for e in &d.exports {
            c.wait_for_frontier(e.collection_id, LAST_TIME)
                .await
                .map_err(|err| {
                    violation(
                        "I2",
                        format!("dataflow {} did not reach time {LAST_TIME}: {err}", d.id),
                    )
                })?;
        }
    }
    let statuses = c
        .statuses()
        .await
        .map_err(|e| violation("I2", format!("no status from every worker: {e}")))?;
    let logs = lockstep_reconcile::creation_logs(&statuses);
    lockstep_reconcile::lockstep_check(&logs).map_err(|d| violation("I1", d.to_string()))?;
    let want: BTreeSet<u64> = target.iter().map(|d| d.id).collect();
    for s in &statuses {
        let got: BTreeSet<u64> = s.installed.iter().copied().collect();
        if got != want {
            return Err(violation(
                "I4",
                format!(
                    "worker {} has dataflows {got:?} installed, the target is {want:?}",
                    s.worker_index
                ),
            ));
        }
    }
    let mut inputs: BTreeMap<u64, Vec<Update>> = BTreeMap::new();
    for (coll, ups, _) in writes() {
        inputs.entry(coll).or_default().extend(ups);
    }
    for d in target {
        for e in &d.exports {
            let got: BTreeMap<Vec<i64>, i64> = c
                .peek(e.collection_id, LAST_TIME)
                .await
                .map_err(|err| {
                    violation("I3", format!("peek of {} failed: {err}", e.collection_id))
                })?
                .into_iter()
                .collect();
            let want = evaluate(&e.plan, &inputs, LAST_TIME);
            if got != want {
                return Err(violation(
                    "I3",
                    format!(
                        "collection {} at {LAST_TIME} is {got:?}, the reference says {want:?}",
                        e.collection_id
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// Sets the failpoint so that the next broadcast of `kind` reaches process 0 only.
fn crash_on(kind: &str) {
    crash_reaching(kind, "1");
}

/// Sets the failpoint so that the next broadcast of `kind` reaches the
/// processes `reach` says (`N`: the first N, `lastN`: the last N).
fn crash_reaching(kind: &str, reach: &str) {
    fail::cfg(FAILPOINT, &format!("return({kind}:{reach})")).expect("failpoint");
}

async fn crashed(c: &Controller) {
    // The actor stops at the failpoint; give it a moment, then clear it.
    for _ in 0..100 {
        if c.history().await.is_err() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    fail::remove(FAILPOINT);
}

/// Waits for the dataflows of the setup, before any fault: a failure here is
/// the harness's (the system never got going), not a violation.
async fn ready(c: &Controller, dataflows: &[DataflowDescription]) -> Result<(), String> {
    for d in dataflows {
        c.wait_for_frontier(d.exports[0].collection_id, LAST_TIME)
            .await
            .map_err(|e| format!("setup: {e}"))?;
    }
    Ok(())
}

/// Runs one scenario. Errors of the harness's own steps (starting the
/// replica, the setup before the fault, sending signals, finding PIDs) are
/// [`Failure::Harness`]; only what [`check`] finds broken, and a stopped
/// process not reported silent, are violations.
async fn scenario(name: &str, id: u64, s: Variant, postgres: Option<&str>) -> Result<(), Failure> {
    let (processes, workers) = if name.starts_with("three-processes") {
        (3, 1)
    } else {
        (2, 2)
    };
    let postgres = if s.postgres { postgres } else { None };
    let hosts = if s.hosts { 2 } else { 0 };
    let r = start_replica(id, processes, workers, postgres, hosts).await?;
    let result = if s.hosts {
        partitions::scenario_on(&r, name, s).await
    } else {
        scenario_on(&r, name, s).await
    };
    if result.is_err() && std::env::var_os("LOCKSTEP_CHAOS_REPLICA_LOG").is_some() {
        print_process_logs(r.dir.path());
    }
    result
}

/// Debugging (with `LOCKSTEP_CHAOS_REPLICA_LOG` set): the replica
/// processes' logs of a failed scenario, to stderr.
fn print_process_logs(dir: &std::path::Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let path = e.path();
        if path.is_dir() {
            print_process_logs(&path);
        } else if path.extension().is_some_and(|x| x == "log") {
            eprintln!("==== {}", path.display());
            eprintln!("{}", std::fs::read_to_string(&path).unwrap_or_default());
        }
    }
}

async fn scenario_on(r: &Replica, name: &str, s: Variant) -> Result<(), Failure> {
    let base = vec![d1(), d2()];
    let a = controller(r, 1, s, history(&base));
    ready(&a, &base).await?;
    match name {
        "partial-create-unwanted" => {
            crash_on("create-dataflow");
            // The controller crashes inside this call: what it returns does not matter.
            let _ = a.create_dataflow(x());
            crashed(&a).await;
            check(&controller(r, 2, s, history(&base)), &base).await
        }
        "partial-create-wanted" => {
            crash_on("create-dataflow");
            // The controller crashes inside this call: what it returns does not matter.
            let _ = a.create_dataflow(x());
            crashed(&a).await;
            let t = vec![d1(), d2(), x()];
            check(&controller(r, 2, s, history(&t)), &t).await
        }
        "strategy-switched-after-partial-create" => {
            // The next controller runs another strategy (log, or barrier
            // after log), as after a policy swapped at run time.
            crash_on("create-dataflow");
            // The controller crashes inside this call: what it returns does not matter.
            let _ = a.create_dataflow(x());
            crashed(&a).await;
            let t = vec![d1(), d2(), x()];
            let switched = Variant {
                strategy: if s.strategy == Strategy::Log {
                    Strategy::Barrier
                } else {
                    Strategy::Log
                },
                // The history check's answer stays what the variant's is.
                check_reconciles: s.check_reconciles,
                postgres: s.postgres,
                hosts: s.hosts,
            };
            check(&controller(r, 2, switched, history(&t)), &t).await
        }
        "partial-create-then-create" => {
            crash_on("create-dataflow");
            // The controller crashes inside this call: what it returns does not matter.
            let _ = a.create_dataflow(x());
            crashed(&a).await;
            let b = controller(r, 2, s, history(&base));
            b.create_dataflow(y()).map_err(|e| e.to_string())?;
            check(&b, &[d1(), d2(), y()]).await
        }
        "partial-drop-wanted-again" => {
            // Process 0 sees build and drop of X, process 1 only the build;
            // the restarted controller wants X again.
            a.create_dataflow(x()).map_err(|e| e.to_string())?;
            ready(&a, &[x()]).await?;
            crash_on("allow-compaction");
            let _ = a.drop_dataflow(&x());
            crashed(&a).await;
            let t = vec![d1(), d2(), x()];
            check(&controller(r, 2, s, history(&t)), &t).await
        }
        "partial-drop-unwanted" => {
            a.create_dataflow(x()).map_err(|e| e.to_string())?;
            ready(&a, &[x()]).await?;
            crash_on("allow-compaction");
            let _ = a.drop_dataflow(&x());
            crashed(&a).await;
            check(&controller(r, 2, s, history(&base)), &base).await
        }
        "partial-peek" => {
            crash_on("peek");
            let _ = tokio::time::timeout(Duration::from_millis(300), a.peek(1001, LAST_TIME)).await;
            crashed(&a).await;
            check(&controller(r, 2, s, history(&base)), &base).await
        }
        "partial-write" => {
            crash_on("write-input");
            let _ = a.write_input(1, vec![], LAST_TIME + 1);
            crashed(&a).await;
            check(&controller(r, 2, s, history(&base)), &base).await
        }
        "partial-reconcile" => {
            // The restarted controller crashes during reconciliation itself.
            a.shutdown();
            let t = vec![d1(), d2(), x()];
            crash_on("initialization-complete");
            let b = controller(r, 2, s, history(&t));
            crashed(&b).await;
            check(&controller(r, 3, s, history(&t)), &t).await
        }
        "partial-reconcile-changed" => {
            a.create_dataflow(x()).map_err(|e| e.to_string())?;
            ready(&a, &[x()]).await?;
            a.shutdown();
            crash_on("initialization-complete");
            let b = controller(r, 2, s, history(&base));
            crashed(&b).await;
            let t = vec![d1(), d2(), x(), y()];
            check(&controller(r, 3, s, history(&t)), &t).await
        }
        "dropped-connections" => {
            a.reconnect().map_err(|e| e.to_string())?;
            a.create_dataflow(x()).map_err(|e| e.to_string())?;
            check(&a, &[d1(), d2(), x()]).await
        }
        "changed-target" => {
            a.shutdown();
            let t = vec![d2(), x()];
            check(&controller(r, 2, s, history(&t)), &t).await
        }
        "partial-create-last" => {
            crash_reaching("create-dataflow", "last1");
            // The controller crashes inside this call: what it returns does not matter.
            let _ = a.create_dataflow(x());
            crashed(&a).await;
            check(&controller(r, 2, s, history(&base)), &base).await
        }
        "partial-create-last-wanted" => {
            crash_reaching("create-dataflow", "last1");
            // The controller crashes inside this call: what it returns does not matter.
            let _ = a.create_dataflow(x());
            crashed(&a).await;
            let t = vec![d1(), d2(), x()];
            check(&controller(r, 2, s, history(&t)), &t).await
        }
        "partial-drop-wanted-again-mirrored" => {
            // Process 1 sees build and drop of X, process 0 only the build.
            a.create_dataflow(x()).map_err(|e| e.to_string())?;
            ready(&a, &[x()]).await?;
            crash_reaching("allow-compaction", "last1");
            let _ = a.drop_dataflow(&x());
            crashed(&a).await;
            let t = vec![d1(), d2(), x()];
            check(&controller(r, 2, s, history(&t)), &t).await
        }
        "partial-write-last" => {
            crash_reaching("write-input", "last1");
            let _ = a.write_input(1, vec![], LAST_TIME + 1);
            crashed(&a).await;
            check(&controller(r, 2, s, history(&base)), &base).await
        }
        "double-crash" => {
            // A crash in a create, then the successor crashes reconciling.
            crash_on("create-dataflow");
            let _ = a.create_dataflow(x());
            crashed(&a).await;
            let t = vec![d1(), d2(), y()];
            crash_on("initialization-complete");
            let b = controller(r, 2, s, history(&t));
            crashed(&b).await;
            check(&controller(r, 3, s, history(&t)), &t).await
        }
        "three-processes-partial-create" => {
            crash_reaching("create-dataflow", "2");
            let _ = a.create_dataflow(x());
            crashed(&a).await;
            check(&controller(r, 2, s, history(&base)), &base).await
        }
        "three-processes-partial-drop-wanted-again" => {
            a.create_dataflow(x()).map_err(|e| e.to_string())?;
            ready(&a, &[x()]).await?;
            crash_reaching("allow-compaction", "last2");
            let _ = a.drop_dataflow(&x());
            crashed(&a).await;
            let t = vec![d1(), d2(), x()];
            check(&controller(r, 2, s, history(&t)), &t).await
        }
        "reconnect-between-creates" => {
            a.create_dataflow(x()).map_err(|e| e.to_string())?;
            a.reconnect().map_err(|e| e.to_string())?;
            a.create_dataflow(y()).map_err(|e| e.to_string())?;
            check(&a, &[d1(), d2(), x(), y()]).await
        }
        "stale-controller" => {
            // The successor connects while the old controller still runs;
            // what the old one sends afterwards must change nothing.
            let t = vec![d1(), d2(), x()];
            let b = controller(r, 2, s, history(&t));
            ready(&b, &[x()]).await?;
            let _ = a.create_dataflow(y());
            let _ = a.drop_dataflow(&d1());
            tokio::time::sleep(Duration::from_millis(300)).await;
            check(&b, &t).await
        }
        "killed-process" => {
            let pid = pid_of(r, 1).await?;
            signal(pid, libc::SIGKILL)?;
            check(&a, &base).await
        }
        "killed-process-0" => {
            let pid = pid_of(r, 0).await?;
            signal(pid, libc::SIGKILL)?;
            check(&a, &base).await
        }
        "killed-during-reconcile" => {
            a.shutdown();
            let t = vec![d1(), d2(), x()];
            let b = controller(r, 2, s, history(&t));
            let pid = pid_of(r, 1).await?;
            signal(pid, libc::SIGKILL)?;
            check(&b, &t).await
        }
        "stopped-process" => {
            stop_until_silent(r, &a, 1).await?;
            signal(pid_of(r, 1).await?, libc::SIGCONT)?;
            check(&a, &base).await
        }
        "stopped-process-0" => {
            stop_until_silent(r, &a, 0).await?;
            signal(pid_of(r, 0).await?, libc::SIGCONT)?;
            check(&a, &base).await
        }
        "stopped-process-restarted" => {
            // What the environment does with a silent process: restart the
            // replica through the orchestrator.
            stop_until_silent(r, &a, 1).await?;
            r.orchestrator
                .restart_service(&r.service)
                .await
                .map_err(|e| format!("restart: {e}"))?;
            check(&a, &base).await
        }
        other => Err(Failure::Harness(format!("unknown scenario {other}"))),
    }
}

/// Stops (SIGSTOP) a process and waits until the controller reports it silent.
async fn stop_until_silent(r: &Replica, a: &Controller, process: usize) -> Result<(), Failure> {
    let pid = pid_of(r, process).await?;
    let mut events = a.events();
    signal(pid, libc::SIGSTOP)?;
    let silent = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            if let Ok(lockstep_controller::Event::ProcessSilent { process, .. }) =
                events.recv().await
            {
                return process;
            }
        }
    })
    .await;
    if silent != Ok(process) {
        signal(pid, libc::SIGCONT)?;
        return Err(violation(
            "I2",
            format!(
                "the stopped process {process} was not reported silent within 5 s ({silent:?})"
            ),
        ));
    }
    Ok(())
}

async fn pid_of(r: &Replica, process: usize) -> Result<i32, String> {
    lockstep_chaos::pid_of(r.orchestrator.as_ref(), process)
        .await
        .map(|p| p as i32)
}

fn signal(pid: i32, sig: i32) -> Result<(), String> {
    // SAFETY-free: kill(2) through the `kill` command keeps this crate free of unsafe code.
    let name = match sig {
        libc::SIGKILL => "KILL",
        libc::SIGSTOP => "STOP",
        _ => "CONT",
    };
    let ok = std::process::Command::new("kill")
        .args([&format!("-{name}"), &pid.to_string()])
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    if ok {
        Ok(())
    } else {
        Err(format!("kill -{name} {pid} failed"))
    }
}

/// The variants run by default: the three strategies that must pass, the
/// log strategy with its command log in PostgreSQL, the negative control,
/// and naive delivery repaired by the history check.
const DEFAULT_VARIANTS: [&str; 6] = [
    "broadcast",
    "barrier",
    "log",
    "log@postgres",
    "naive",
    "naive+history-check",
];

/// The partition variants, run by default where simulated hosts can be made.
const HOSTS_VARIANTS: [&str; 4] = [
    "broadcast@hosts",
    "barrier@hosts",
    "log@hosts",
    "naive@hosts",
];

const SCENARIOS: [&str; 27] = [
    "partial-create-unwanted",
    "partial-create-wanted",
    "strategy-switched-after-partial-create",
    "partial-create-then-create",
    "partial-drop-wanted-again",
    "partial-drop-unwanted",
    "partial-peek",
    "partial-write",
    "partial-reconcile",
    "partial-reconcile-changed",
    "dropped-connections",
    "changed-target",
    "killed-process",
    "stopped-process",
    "partial-create-last",
    "partial-create-last-wanted",
    "partial-drop-wanted-again-mirrored",
    "partial-write-last",
    "double-crash",
    "three-processes-partial-create",
    "three-processes-partial-drop-wanted-again",
    "reconnect-between-creates",
    "stale-controller",
    "killed-process-0",
    "killed-during-reconcile",
    "stopped-process-0",
    "stopped-process-restarted",
];

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let args = if args.is_empty() {
        let mut v = DEFAULT_VARIANTS.map(String::from).to_vec();
        match lockstep_orchestrator::hosts::available() {
            Ok(()) => v.extend(HOSTS_VARIANTS.map(String::from)),
            Err(e) => {
                eprintln!("lockstep-chaos-distribution: the @hosts variants are skipped: {e}")
            }
        }
        v
    } else {
        args
    };
    let strategies: Vec<Variant> = {
        match args
            .iter()
            .map(|a| a.parse())
            .collect::<Result<Vec<Variant>, String>>()
        {
            Ok(s) => s,
            Err(e) => {
                eprintln!("lockstep-chaos-distribution: {e}");
                std::process::exit(2);
            }
        }
    };
    if strategies.iter().any(|s| s.hosts) {
        if let Err(e) = lockstep_orchestrator::hosts::available() {
            eprintln!("lockstep-chaos-distribution: the @hosts variants need simulated hosts: {e}");
            std::process::exit(2);
        }
    }
    if !replica_binary().exists() {
        eprintln!(
            "lockstep-chaos-distribution: {} is missing: build lockstep-replica (cargo xtask chaos distribution does)",
            replica_binary().display()
        );
        std::process::exit(2);
    }
    // One throw-away PostgreSQL server for the `@postgres` variants; each
    // replica's log is its own in it.
    let pg = if strategies.iter().any(|s| s.postgres) {
        match lockstep_pgtest::PgServer::start() {
            Ok(pg) => Some(pg),
            Err(e) => {
                eprintln!(
                    "lockstep-chaos-distribution: cannot start PostgreSQL for the @postgres variants: {e}"
                );
                std::process::exit(2);
            }
        }
    } else {
        None
    };
    let pg_url = pg.as_ref().map(|pg| pg.url());
    let _scenario = fail::FailScenario::setup();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let mut ok = true;
    let mut next_id = 1;
    for s in strategies {
        let mut tally = Tally::default();
        let only = std::env::var("LOCKSTEP_CHAOS_SCENARIOS").unwrap_or_default();
        let scenarios: &[&str] = if s.hosts {
            &partitions::SCENARIOS
        } else {
            &SCENARIOS
        };
        for &name in scenarios {
            next_id += 1;
            if !only.is_empty() && !only.split(',').any(|o| o == name) {
                continue;
            }
            let result = runtime.block_on(async {
                match tokio::time::timeout(
                    Duration::from_secs(90),
                    scenario(name, next_id, s, pg_url.as_deref()),
                )
                .await
                {
                    Ok(r) => r,
                    Err(_) => Err(violation(
                        "I2",
                        "the scenario did not finish within 90 s".to_string(),
                    )),
                }
            });
            fail::remove(FAILPOINT);
            let line = tally.record(&result);
            match result {
                Ok(()) => eprintln!("distribution/{s}/{name}: {line}"),
                Err(_) => println!("distribution/{s}/{name}: {line}"),
            }
        }
        let negative_control = s.strategy == Strategy::Naive && !s.check_reconciles;
        ok &= tally.ok(negative_control);
        println!(
            "{}",
            tally.summary_line("distribution", &s.to_string(), negative_control)
        );
    }
    if !ok {
        std::process::exit(1);
    }
}
