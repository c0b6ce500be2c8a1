//! The replica a scenario runs on: its start-up through the process
//! orchestrator (with a command log and a session key), the controller that
//! drives it under a variant's strategy, and signals to its processes.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use lockstep_controller::{Controller, ReplicaAddrs, Timeouts};
use lockstep_orchestrator::process::{
    kill_all_services, ProcessOrchestrator, ProcessOrchestratorConfig,
};
use lockstep_orchestrator::{Orchestrator, ServiceStatus};
use lockstep_policy::{
    CommandInfo, DistributionPolicy, FixedStrategy, MismatchAction, MismatchInfo, PolicyError,
};
use lockstep_protocol::{CommandHistory, Strategy};

use super::variant::{Family, Variant};

pub(crate) struct Replica {
    pub(crate) dir: tempfile::TempDir,
    pub(crate) orchestrator: Arc<ProcessOrchestrator>,
    pub(crate) service: String,
    pub(crate) addrs: ReplicaAddrs,
}

impl Drop for Replica {
    fn drop(&mut self) {
        let _ = kill_all_services(self.dir.path());
    }
}

/// The replica binary that builds `family`, beside this one.
pub(crate) fn replica_binary(family: Family) -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    exe.parent().expect("a directory").join(family.binary())
}

/// Starts replica `id` of `processes` x `workers` of the binary that builds
/// `family`, on `hosts` simulated hosts if not 0; its command log is a
/// SQLite file in its directory, or the log `replica-ID` in the PostgreSQL
/// database at `postgres`.
pub(crate) async fn start_replica(
    id: u64,
    processes: usize,
    workers: u32,
    postgres: Option<&str>,
    hosts: usize,
    family: Family,
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
    let config = lockstep_launch::with_session_key(
        lockstep_launch::with_command_log(
            lockstep_launch::replica_service(&replica_binary(family), id, processes, workers),
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
    let mut addrs = lockstep_launch::replica_addrs(&status, workers).map_err(|e| e.to_string())?;
    addrs.command_log = Some(log);
    addrs.session_key = Some(key);
    Ok(Replica {
        dir,
        orchestrator: Arc::new(orchestrator),
        service: status.name.clone(),
        addrs,
    })
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

pub(crate) fn controller(
    r: &Replica,
    epoch: u64,
    v: Variant,
    history: CommandHistory,
) -> Controller {
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

pub(crate) async fn pid_of(r: &Replica, process: usize) -> Result<i32, String> {
    lockstep_chaos::pid_of(r.orchestrator.as_ref(), process)
        .await
        .map(|p| p as i32)
}

pub(crate) fn signal(pid: i32, sig: i32) -> Result<(), String> {
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
