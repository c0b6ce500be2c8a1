//! The process backend: every process of a service is a supervised OS process
//! on this machine.
//!
//! # State directory
//!
//! ```text
//! STATE_DIR/orchestrator.lock      flock'd around every read-modify-write
//! STATE_DIR/services/NAME.json     one file per service: spec, labels (epoch,
//!                                  ID), and per process its argv, ports, PID
//!                                  and the PID's start time
//! STATE_DIR/services/NAME.dropped  the highest epoch that dropped NAME: an
//!                                  older controller may not re-create it
//! STATE_DIR/logs/NAME-I.log        stdout and stderr of process I
//! ```
//!
//! The files are the truth, not this process's memory: [`list_services`]
//! reads them, so a controller restarted on the same directory lists the
//! services an earlier one started, and [`ensure_service`] with an unchanged
//! spec adopts their running processes instead of restarting them. Several
//! orchestrators (several controllers) may share a directory; the lock file
//! serializes their writes, which is what makes `ensure` a real conditional
//! write.
//!
//! A PID alone can be reused by the OS after the process exits; each record
//! also stores the process's start time (field 22 of `/proc/PID/stat`), and a
//! PID counts as ours only if both match. We never signal a PID that fails
//! this check.
//!
//! # Simulated hosts
//!
//! With [`ProcessOrchestratorConfig::hosts`] set to N, process *i* of every
//! service runs on simulated host *i mod N*: in a network namespace of its
//! own ([`crate::hosts`]), started with `ip netns exec`, bound to `0.0.0.0`,
//! known to its peers by the host's name and to the orchestrator's side by
//! the host's control address. Its record keeps the namespace and address,
//! so a restart puts it back on the same host.
//!
//! # Processes
//!
//! Each process runs in its own process group (its PGID is its PID), so that
//! dropping a service kills whatever the process spawned too (`killpg`
//! SIGKILL). Processes are *not* killed when the orchestrator is dropped or
//! the controller exits: surviving a controller restart is the point. Tests
//! tear down with [`kill_all_services`].
//!
//! # Shared fate
//!
//! The processes of a service form one timely cluster: a process started on
//! its own would join peers of another cluster, which then fail on the
//! closed sockets of the one that died, one after another, for ever. So the
//! processes of a service live and die as one *generation*
//! (`NAME.json`'s `generation`, given to each process as
//! [`GENERATION_ENV`]; the replica's mesh refuses a peer of another
//! generation). Each process is watched by a supervisor task in every
//! orchestrator that ensured its service. When one exits, its supervisor
//! waits a backoff (doubling from [`Backoff::initial`] to [`Backoff::max`]),
//! then, under the lock, unless the service was dropped or another
//! supervisor already started a new generation, kills every process of the
//! service and starts them all as the next generation. The other supervisors
//! find their processes replaced in the record and watch the replacements.
//! An orchestrator that adopts a service whose processes all live keeps
//! them (same PIDs); if any is dead, its supervisor starts a new generation
//! within one poll interval and one backoff.
//!
//! Ports are chosen once, when a service is created, and kept across
//! restarts and adoption. If another socket takes one while its process is
//! down, the process exits at once on every restart: after
//! [`ProcessOrchestratorConfig::reassign_ports_after`] such restarts in a
//! row, if a port recorded for the process is held by another socket, the
//! supervisor chooses new ports for *every* process of the service (peers
//! name each other's ports on their command lines), kills them all, starts
//! them with command lines built by the service's args function for the new
//! ports, records them in `NAME.json`, and emits
//! [`ServiceEventKind::AddressesChanged`] with the new addresses.
//!
//! [`restart_service`] kills every process of a service (SIGKILL to each
//! process group, which kills a stopped process too) and starts them again
//! as a new generation from the record (same argv, environment and ports),
//! all under the lock. A
//! supervisor that then sees its process dead finds the replacement in the
//! record and watches it, so nothing is started twice.
//!
//! [`list_services`]: crate::Orchestrator::list_services
//! [`ensure_service`]: crate::Orchestrator::ensure_service
//! [`restart_service`]: crate::Orchestrator::restart_service

use std::collections::{BTreeMap, HashMap};
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::sync::broadcast;
use tokio::task::JoinHandle;

mod launch;
mod procfs;
mod services;
mod state;
mod supervisor;

use launch::*;
pub use launch::{LISTEN_FDS_ENV, RELEASE_PORTS_ENV};
use procfs::*;
pub use procfs::{cpu_time, peak_rss_mib, rss_mib, strays, ORCHESTRATOR_ENV};
pub use state::kill_all_services;
use state::*;

use crate::hosts::SimulatedHosts;
use crate::{
    ArgsFn, DropError, EnsureError, ListError, Orchestrator, ProcessStatus, RestartError,
    ServiceAssignment, ServiceConfig, ServiceEvent, ServiceEventKind, ServiceStatus, StateError,
    EPOCH_LABEL, ID_LABEL,
};

/// The host every process listens on, without simulated hosts.
const HOST: &str = "127.0.0.1";

/// The variable that tells a process its generation (the one its service
/// record keeps).
pub const GENERATION_ENV: &str = "LOCKSTEP_GENERATION";

/// The version of the state file format.
const RECORD_VERSION: u32 = 1;

/// Restart backoff of crashed processes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Backoff {
    /// The first wait.
    pub initial: Duration,
    /// The longest wait.
    pub max: Duration,
    /// A process that ran at least this long restarts with the initial wait again.
    pub reset_after: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff {
            initial: Duration::from_millis(100),
            max: Duration::from_secs(5),
            reset_after: Duration::from_secs(10),
        }
    }
}

/// How to build a [`ProcessOrchestrator`].
#[derive(Clone, Debug)]
pub struct ProcessOrchestratorConfig {
    /// The state directory; must exist and be writable.
    pub state_dir: PathBuf,
    /// The controller's epoch, which labels every service it ensures.
    pub epoch: u64,
    /// Whether `ensure_service` refuses to overwrite a service with a newer
    /// epoch (O4). Only the negative tests turn this off.
    pub conditional_writes: bool,
    /// Restart backoff.
    pub backoff: Backoff,
    /// How often supervisors check their process.
    pub poll_interval: Duration,
    /// A process's log that has grown past this many bytes is moved to
    /// `NAME-I.log.1` (replacing the one before) when the process is
    /// (re)started, so each process keeps at most two logs.
    pub log_rotate_bytes: u64,
    /// After this many restarts of a process in a row (each exiting before
    /// [`Backoff::reset_after`]), if a port recorded for it is held by another
    /// socket, every process of the service gets new ports and is restarted
    /// ([`ServiceEventKind::AddressesChanged`]). `0` never re-chooses ports.
    pub reassign_ports_after: u32,
    /// Simulated hosts (network namespaces, see [`crate::hosts`]) to place
    /// processes on; 0: every process on this host's loopback (`127.0.0.1`).
    pub hosts: usize,
}

impl ProcessOrchestratorConfig {
    /// Defaults: conditional writes on, default backoff, 100 ms polling.
    pub fn new(state_dir: impl Into<PathBuf>, epoch: u64) -> Self {
        ProcessOrchestratorConfig {
            state_dir: state_dir.into(),
            epoch,
            conditional_writes: true,
            backoff: Backoff::default(),
            poll_interval: Duration::from_millis(100),
            log_rotate_bytes: 16 << 20,
            reassign_ports_after: 3,
            hosts: 0,
        }
    }
}

/// Why a [`ProcessOrchestrator`] could not be created.
#[derive(Debug, thiserror::Error)]
pub enum NewError {
    /// The state directory does not exist.
    #[error("orchestrator state directory {0} does not exist")]
    Missing(PathBuf),
    /// The state directory is not a directory.
    #[error("orchestrator state directory {0} is not a directory")]
    NotADirectory(PathBuf),
    /// The simulated hosts could not be set up.
    #[error(transparent)]
    Hosts(#[from] crate::hosts::HostsError),
    /// The state directory cannot be written.
    #[error("orchestrator state directory {path} is not writable: {source}")]
    Unwritable {
        /// The directory.
        path: PathBuf,
        /// What the OS said.
        source: std::io::Error,
    },
}

/// The process backend. Cheap to share behind an `Arc`; dropping it stops its
/// supervisors but leaves the processes running.
pub struct ProcessOrchestrator {
    inner: Arc<Inner>,
}

struct Inner {
    config: ProcessOrchestratorConfig,
    events: broadcast::Sender<ServiceEvent>,
    /// Supervisor tasks by service name.
    supervisors: Mutex<HashMap<String, Vec<JoinHandle<()>>>>,
    /// Children this orchestrator spawned, by PID, so exits can be reaped.
    children: Mutex<HashMap<u32, Child>>,
    /// The args function of every service this orchestrator ensured, by
    /// name: new ports need new command lines.
    args: Mutex<HashMap<String, ArgsFn>>,
    /// The simulated hosts processes are placed on, if any.
    hosts: Option<SimulatedHosts>,
    /// The listening sockets of every service's processes, by service
    /// name and process index (port name to listener), held from the
    /// moment their ports are chosen until the service is dropped or
    /// re-ported: each process inherits its own, so no port is ever
    /// named before it is bound, and none is free between a process's
    /// death and its restart ([`launch`]).
    held: Mutex<HashMap<String, Vec<launch::Listeners>>>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct ServiceRecord {
    version: u32,
    name: String,
    id: u64,
    epoch: u64,
    labels: BTreeMap<String, String>,
    program: PathBuf,
    /// The processes' environment (session keys, passwords): never in the
    /// record itself, but in its own private file beside it
    /// ([`state::env_path`]). Records written before that held it inline;
    /// they are still read.
    #[serde(default, skip_serializing)]
    env: BTreeMap<String, String>,
    port_names: Vec<String>,
    processes: Vec<ProcessRecord>,
    /// The generation its processes were started in: all of them start
    /// together, and a restart of any one starts a new generation (records
    /// written before generations were kept read as 0, as their processes,
    /// which got no `LOCKSTEP_GENERATION`, assume).
    #[serde(default)]
    generation: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct ProcessRecord {
    argv: Vec<String>,
    ports: BTreeMap<String, u16>,
    pid: Option<u32>,
    start_time: Option<u64>,
    restarts: u32,
    /// The simulated host's namespace it runs in (`None`: this host).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    namespace: Option<String>,
    /// The address its ports are reached at from here (`None`: `127.0.0.1`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    address: Option<IpAddr>,
}

impl ProcessRecord {
    fn handle(&self) -> Option<(u32, u64)> {
        Some((self.pid?, self.start_time?))
    }
}

impl ProcessOrchestrator {
    /// Opens the state directory (it must exist and be writable) and creates
    /// its subdirectories. Adopts nothing yet: `ensure_service` with an
    /// unchanged spec adopts a running service.
    pub fn new(config: ProcessOrchestratorConfig) -> Result<Self, NewError> {
        let dir = &config.state_dir;
        match std::fs::metadata(dir) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => return Err(NewError::NotADirectory(dir.clone())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(NewError::Missing(dir.clone()))
            }
            Err(source) => {
                return Err(NewError::Unwritable {
                    path: dir.clone(),
                    source,
                })
            }
        }
        let unwritable = |source| NewError::Unwritable {
            path: dir.clone(),
            source,
        };
        // The records hold each service's environment (a replica's session
        // key): private to this user, created that way.
        private_dir(dir).map_err(unwritable)?;
        private_dir(&dir.join("services")).map_err(unwritable)?;
        private_dir(&dir.join("logs")).map_err(unwritable)?;
        OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join("orchestrator.lock"))
            .map_err(unwritable)?;
        let hosts = match config.hosts {
            0 => None,
            n => Some(SimulatedHosts::create(dir, n)?),
        };
        let (events, _) = broadcast::channel(1024);
        let inner = Inner {
            config,
            events,
            supervisors: Mutex::new(HashMap::new()),
            children: Mutex::new(HashMap::new()),
            args: Mutex::new(HashMap::new()),
            hosts,
            held: Mutex::new(HashMap::new()),
        };
        // Processes spawned by an orchestrator killed before it recorded them
        // would hold their ports and escape orphan removal: kill them now.
        {
            let _lock = inner.lock().map_err(|e| NewError::Unwritable {
                path: inner.config.state_dir.clone(),
                source: std::io::Error::other(e.to_string()),
            })?;
            kill_strays(&inner.config.state_dir);
        }
        Ok(ProcessOrchestrator {
            inner: Arc::new(inner),
        })
    }

    /// The state directory.
    pub fn state_dir(&self) -> &Path {
        &self.inner.config.state_dir
    }

    /// The simulated hosts processes are placed on, if any.
    pub fn hosts(&self) -> Option<&SimulatedHosts> {
        self.inner.hosts.as_ref()
    }
}

impl Drop for ProcessOrchestrator {
    fn drop(&mut self) {
        for (_, tasks) in self.inner.supervisors.lock().expect("poisoned").drain() {
            for t in tasks {
                t.abort();
            }
        }
    }
}

#[async_trait::async_trait]
impl Orchestrator for ProcessOrchestrator {
    fn epoch(&self) -> u64 {
        self.inner.config.epoch
    }

    async fn ensure_service(&self, config: ServiceConfig) -> Result<ServiceStatus, EnsureError> {
        let inner = self.inner.clone();
        let name = config.name.clone();
        let (record, spawned) = tokio::task::spawn_blocking(move || inner.ensure(config))
            .await
            .expect("ensure panicked")?;
        self.inner.supervise(&name, &record, spawned);
        Ok(self.inner.status(&record))
    }

    async fn drop_service(&self, name: &str) -> Result<bool, DropError> {
        self.inner.args.lock().expect("poisoned").remove(name);
        if let Some(tasks) = self
            .inner
            .supervisors
            .lock()
            .expect("poisoned")
            .remove(name)
        {
            for t in tasks {
                t.abort();
            }
        }
        let inner = self.inner.clone();
        let name = name.to_string();
        tokio::task::spawn_blocking(move || inner.drop_service(&name))
            .await
            .expect("drop panicked")
    }

    async fn restart_service(&self, name: &str) -> Result<ServiceStatus, RestartError> {
        let inner = self.inner.clone();
        let n = name.to_string();
        let (record, spawn_failed) = tokio::task::spawn_blocking(move || inner.restart_service(&n))
            .await
            .expect("restart panicked")?;
        // Watch the new processes (and start a missing one) from here on,
        // even if an earlier orchestrator ensured the service.
        self.inner.supervise(name, &record, Vec::new());
        match spawn_failed {
            Some(e) => Err(e),
            None => Ok(self.inner.status(&record)),
        }
    }

    async fn list_services(&self) -> Result<Vec<ServiceStatus>, ListError> {
        let inner = self.inner.clone();
        tokio::task::spawn_blocking(move || {
            let _lock = inner.lock()?;
            let records = inner.read_all()?;
            Ok(records.iter().map(|r| inner.status(r)).collect())
        })
        .await
        .expect("list panicked")
    }

    fn watch_services(&self) -> broadcast::Receiver<ServiceEvent> {
        self.inner.events.subscribe()
    }
}

impl Inner {
    fn emit(&self, service: &str, process: Option<usize>, kind: ServiceEventKind) {
        let _ = self.events.send(ServiceEvent {
            service: service.to_string(),
            process,
            kind,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::services::validate_name;
    use super::*;

    #[test]
    fn start_time_of_self_is_stable_and_pid_reuse_is_detected() {
        let me = std::process::id();
        let a = proc_start_time(me).unwrap();
        assert_eq!(proc_start_time(me), Some(a));
        assert!(proc_alive(me, a));
        assert!(
            !proc_alive(me, a + 1),
            "a different start time is another process"
        );
    }

    #[test]
    fn names_are_checked() {
        assert!(validate_name("replica-1").is_ok());
        assert!(validate_name("../x").is_err());
        assert!(validate_name("").is_err());
        assert!(validate_name(".hidden").is_err());
    }

    #[test]
    fn programs_are_resolved() {
        assert!(resolve_program(Path::new("sleep")).is_some());
        assert!(resolve_program(Path::new("/nonexistent/bin/x")).is_none());
        assert!(resolve_program(Path::new("no-such-program-lockstep")).is_none());
    }
}
