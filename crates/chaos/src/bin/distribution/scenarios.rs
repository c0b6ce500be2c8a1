//! The distribution suite's scenario table and the scenarios themselves:
//! start a replica, run the scenario's fault (on the replica, or, for the
//! `@hosts` variants, the partitions), and check I1 to I4.

use std::time::Duration;

use lockstep_chaos::outcome::{violation, Failure};
use lockstep_controller::Controller;
use lockstep_orchestrator::Orchestrator;
use lockstep_protocol::{DataflowDescription, Strategy};

use super::partitions;
use super::replica::{controller, pid_of, signal, start_replica, Replica};
use super::variant::Variant;
use super::workload::{
    check, crash_on, crash_reaching, crashed, crashed_if_reached, d1, d2, history, ready, x, y,
    LAST_TIME,
};

/// The scenarios of a variant with another dataflow family (`+reachability`):
/// a partial create (unwanted, wanted), a partial drop, a partial write, a
/// partial reconciliation and a killed process, which between them reach
/// every command a family's dataflows go through.
pub(crate) const FAMILY_SCENARIOS: [&str; 6] = [
    "partial-create-unwanted",
    "partial-create-wanted",
    "partial-drop-wanted-again",
    "partial-write",
    "partial-reconcile",
    "killed-process",
];

pub(crate) const SCENARIOS: [&str; 27] = [
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

/// Runs one scenario. Errors of the harness's own steps (starting the
/// replica, the setup before the fault, sending signals, finding PIDs) are
/// [`Failure::Harness`]; only what [`check`] finds broken, and a stopped
/// process not reported silent, are violations.
pub(crate) async fn scenario(
    name: &str,
    id: u64,
    s: Variant,
    postgres: Option<&str>,
) -> Result<(), Failure> {
    let (processes, workers) = if name.starts_with("three-processes") {
        (3, 1)
    } else {
        (2, 2)
    };
    let postgres = if s.postgres { postgres } else { None };
    let hosts = if s.hosts { 2 } else { 0 };
    let r = start_replica(id, processes, workers, postgres, hosts, s.family).await?;
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
    let base = vec![d1(s), d2(s)];
    let a = controller(r, 1, s, history(s, &base));
    ready(&a, &base).await?;
    match name {
        "partial-create-unwanted" => partial_create(r, s, a, base, "1", false).await,
        "partial-create-wanted" => partial_create(r, s, a, base, "1", true).await,
        "strategy-switched-after-partial-create" => {
            strategy_switched_after_partial_create(r, s, a).await
        }
        "partial-create-then-create" => partial_create_then_create(r, s, a, base).await,
        "partial-drop-wanted-again" => partial_drop_wanted_again(r, s, a, "1").await,
        "partial-drop-unwanted" => partial_drop_unwanted(r, s, a, base).await,
        "partial-peek" => partial_peek(r, s, a, base).await,
        "partial-write" => partial_write(r, s, a, base, "1").await,
        "partial-reconcile" => partial_reconcile(r, s, a).await,
        "partial-reconcile-changed" => partial_reconcile_changed(r, s, a, base).await,
        "dropped-connections" => dropped_connections(s, a).await,
        "changed-target" => changed_target(r, s, a).await,
        "partial-create-last" => partial_create(r, s, a, base, "last1", false).await,
        "partial-create-last-wanted" => partial_create(r, s, a, base, "last1", true).await,
        "partial-drop-wanted-again-mirrored" => partial_drop_wanted_again(r, s, a, "last1").await,
        "partial-write-last" => partial_write(r, s, a, base, "last1").await,
        "double-crash" => double_crash(r, s, a).await,
        "three-processes-partial-create" => partial_create(r, s, a, base, "2", false).await,
        "three-processes-partial-drop-wanted-again" => {
            partial_drop_wanted_again(r, s, a, "last2").await
        }
        "reconnect-between-creates" => reconnect_between_creates(s, a).await,
        "stale-controller" => stale_controller(r, s, a).await,
        "killed-process" => killed_process(r, s, a, base, 1).await,
        "killed-process-0" => killed_process(r, s, a, base, 0).await,
        "killed-during-reconcile" => killed_during_reconcile(r, s, a).await,
        "stopped-process" => stopped_process(r, s, a, base, 1).await,
        "stopped-process-0" => stopped_process(r, s, a, base, 0).await,
        "stopped-process-restarted" => stopped_process_restarted(r, s, a, base).await,
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

/// Scenarios `partial-create-unwanted` and `-wanted` (`reach` "1": only
/// process 0 got the create) and `partial-create-last` and `-last-wanted`
/// (`reach` "last1": only the last process got it), and
/// `three-processes-partial-create` ("2": the first two of three got it);
/// `wanted`: the next controller wants the dataflow too.
async fn partial_create(
    r: &Replica,
    s: Variant,
    a: Controller,
    base: Vec<DataflowDescription>,
    reach: &str,
    wanted: bool,
) -> Result<(), Failure> {
    crash_reaching("create-dataflow", reach);
    // The controller crashes inside this call: what it returns does not matter.
    let _ = a.create_dataflow(x(s));
    crashed(&a).await?;
    let mut target = base;
    if wanted {
        target.push(x(s));
    }
    check(s, &controller(r, 2, s, history(s, &target)), &target).await
}

/// Scenario `strategy-switched-after-partial-create`.
async fn strategy_switched_after_partial_create(
    r: &Replica,
    s: Variant,
    a: Controller,
) -> Result<(), Failure> {
    // The next controller runs another strategy (log, or barrier
    // after log), as after a policy swapped at run time.
    crash_on("create-dataflow");
    // The controller crashes inside this call: what it returns does not matter.
    let _ = a.create_dataflow(x(s));
    crashed(&a).await?;
    let t = vec![d1(s), d2(s), x(s)];
    // Everything else (the history check's answer, the store, the hosts,
    // the family) stays the variant's.
    let switched = Variant {
        strategy: if s.strategy == Strategy::Log {
            Strategy::Barrier
        } else {
            Strategy::Log
        },
        ..s
    };
    check(s, &controller(r, 2, switched, history(s, &t)), &t).await
}

/// Scenario `partial-create-then-create`.
async fn partial_create_then_create(
    r: &Replica,
    s: Variant,
    a: Controller,
    base: Vec<DataflowDescription>,
) -> Result<(), Failure> {
    crash_on("create-dataflow");
    // The controller crashes inside this call: what it returns does not matter.
    let _ = a.create_dataflow(x(s));
    crashed(&a).await?;
    let b = controller(r, 2, s, history(s, &base));
    b.create_dataflow(y(s)).map_err(|e| e.to_string())?;
    check(s, &b, &[d1(s), d2(s), y(s)]).await
}

/// Scenarios `partial-drop-wanted-again` (`reach` "1": process 0 sees the
/// build and the drop of X, process 1 only the build), `-mirrored` ("last1":
/// process 1 sees both, process 0 only the build) and
/// `three-processes-partial-drop-wanted-again` ("last2"); the restarted
/// controller wants X again.
async fn partial_drop_wanted_again(
    r: &Replica,
    s: Variant,
    a: Controller,
    reach: &str,
) -> Result<(), Failure> {
    a.create_dataflow(x(s)).map_err(|e| e.to_string())?;
    ready(&a, &[x(s)]).await?;
    crash_reaching("allow-compaction", reach);
    let _ = a.drop_dataflow(&x(s));
    crashed(&a).await?;
    let t = vec![d1(s), d2(s), x(s)];
    check(s, &controller(r, 2, s, history(s, &t)), &t).await
}

/// Scenario `partial-drop-unwanted`.
async fn partial_drop_unwanted(
    r: &Replica,
    s: Variant,
    a: Controller,
    base: Vec<DataflowDescription>,
) -> Result<(), Failure> {
    a.create_dataflow(x(s)).map_err(|e| e.to_string())?;
    ready(&a, &[x(s)]).await?;
    crash_on("allow-compaction");
    let _ = a.drop_dataflow(&x(s));
    crashed(&a).await?;
    check(s, &controller(r, 2, s, history(s, &base)), &base).await
}

/// Scenario `partial-peek`.
async fn partial_peek(
    r: &Replica,
    s: Variant,
    a: Controller,
    base: Vec<DataflowDescription>,
) -> Result<(), Failure> {
    crash_on("peek");
    let _ = tokio::time::timeout(Duration::from_millis(300), a.peek(1001, LAST_TIME)).await;
    crashed(&a).await?;
    check(s, &controller(r, 2, s, history(s, &base)), &base).await
}

/// Scenarios `partial-write` (`reach` "1") and `partial-write-last`
/// (`reach` "last1").
async fn partial_write(
    r: &Replica,
    s: Variant,
    a: Controller,
    base: Vec<DataflowDescription>,
    reach: &str,
) -> Result<(), Failure> {
    crash_reaching("write-input", reach);
    let _ = a.write_input(1, vec![], LAST_TIME + 1);
    crashed(&a).await?;
    check(s, &controller(r, 2, s, history(s, &base)), &base).await
}

/// Scenario `partial-reconcile`.
async fn partial_reconcile(r: &Replica, s: Variant, a: Controller) -> Result<(), Failure> {
    // The restarted controller crashes during reconciliation itself.
    a.shutdown();
    let t = vec![d1(s), d2(s), x(s)];
    crash_on("initialization-complete");
    let b = controller(r, 2, s, history(s, &t));
    crashed(&b).await?;
    check(s, &controller(r, 3, s, history(s, &t)), &t).await
}

/// Scenario `partial-reconcile-changed`.
async fn partial_reconcile_changed(
    r: &Replica,
    s: Variant,
    a: Controller,
    base: Vec<DataflowDescription>,
) -> Result<(), Failure> {
    a.create_dataflow(x(s)).map_err(|e| e.to_string())?;
    ready(&a, &[x(s)]).await?;
    a.shutdown();
    crash_on("initialization-complete");
    let b = controller(r, 2, s, history(s, &base));
    crashed(&b).await?;
    let t = vec![d1(s), d2(s), x(s), y(s)];
    check(s, &controller(r, 3, s, history(s, &t)), &t).await
}

/// Scenario `dropped-connections`.
async fn dropped_connections(s: Variant, a: Controller) -> Result<(), Failure> {
    a.reconnect().map_err(|e| e.to_string())?;
    a.create_dataflow(x(s)).map_err(|e| e.to_string())?;
    check(s, &a, &[d1(s), d2(s), x(s)]).await
}

/// Scenario `changed-target`.
async fn changed_target(r: &Replica, s: Variant, a: Controller) -> Result<(), Failure> {
    a.shutdown();
    let t = vec![d2(s), x(s)];
    check(s, &controller(r, 2, s, history(s, &t)), &t).await
}

/// Scenario `double-crash`.
async fn double_crash(r: &Replica, s: Variant, a: Controller) -> Result<(), Failure> {
    // A crash in a create, then the successor crashes reconciling.
    crash_on("create-dataflow");
    let _ = a.create_dataflow(x(s));
    crashed(&a).await?;
    let t = vec![d1(s), d2(s), y(s)];
    crash_on("initialization-complete");
    let b = controller(r, 2, s, history(s, &t));
    crashed_if_reached(&b).await;
    check(s, &controller(r, 3, s, history(s, &t)), &t).await
}

/// Scenario `reconnect-between-creates`.
async fn reconnect_between_creates(s: Variant, a: Controller) -> Result<(), Failure> {
    a.create_dataflow(x(s)).map_err(|e| e.to_string())?;
    a.reconnect().map_err(|e| e.to_string())?;
    a.create_dataflow(y(s)).map_err(|e| e.to_string())?;
    check(s, &a, &[d1(s), d2(s), x(s), y(s)]).await
}

/// Scenario `stale-controller`.
async fn stale_controller(r: &Replica, s: Variant, a: Controller) -> Result<(), Failure> {
    // The successor connects while the old controller still runs;
    // what the old one sends afterwards must change nothing.
    let t = vec![d1(s), d2(s), x(s)];
    let b = controller(r, 2, s, history(s, &t));
    ready(&b, &[x(s)]).await?;
    let _ = a.create_dataflow(y(s));
    let _ = a.drop_dataflow(&d1(s));
    tokio::time::sleep(Duration::from_millis(300)).await;
    check(s, &b, &t).await
}

/// Scenarios `killed-process` (`process` 1) and `killed-process-0`.
async fn killed_process(
    r: &Replica,
    s: Variant,
    a: Controller,
    base: Vec<DataflowDescription>,
    process: usize,
) -> Result<(), Failure> {
    let pid = pid_of(r, process).await?;
    signal(pid, libc::SIGKILL)?;
    check(s, &a, &base).await
}

/// Scenario `killed-during-reconcile`.
async fn killed_during_reconcile(r: &Replica, s: Variant, a: Controller) -> Result<(), Failure> {
    a.shutdown();
    let t = vec![d1(s), d2(s), x(s)];
    let b = controller(r, 2, s, history(s, &t));
    let pid = pid_of(r, 1).await?;
    signal(pid, libc::SIGKILL)?;
    check(s, &b, &t).await
}

/// Scenarios `stopped-process` (`process` 1) and `stopped-process-0`.
async fn stopped_process(
    r: &Replica,
    s: Variant,
    a: Controller,
    base: Vec<DataflowDescription>,
    process: usize,
) -> Result<(), Failure> {
    stop_until_silent(r, &a, process).await?;
    signal(pid_of(r, process).await?, libc::SIGCONT)?;
    check(s, &a, &base).await
}

/// Scenario `stopped-process-restarted`.
async fn stopped_process_restarted(
    r: &Replica,
    s: Variant,
    a: Controller,
    base: Vec<DataflowDescription>,
) -> Result<(), Failure> {
    // What the environment does with a silent process: restart the
    // replica through the orchestrator.
    stop_until_silent(r, &a, 1).await?;
    r.orchestrator
        .restart_service(&r.service)
        .await
        .map_err(|e| format!("restart: {e}"))?;
    check(s, &a, &base).await
}
