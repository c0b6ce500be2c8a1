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
//! [`ServiceEventKind::PortsReassigned`] with the new addresses.
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

use crate::hosts::SimulatedHosts;
use crate::{
    ArgsFn, DropError, EnsureError, ListError, Orchestrator, ProcessStatus, RestartError,
    ServiceAssignment, ServiceConfig, ServiceEvent, ServiceEventKind, ServiceStatus, StateError,
    EPOCH_LABEL, ID_LABEL,
};

/// The host every process listens on, without simulated hosts.
const HOST: &str = "127.0.0.1";
/// The variables a service's process inherits from the orchestrator's
/// environment; everything else it gets comes from its spec.
const INHERITED_ENV: [&str; 6] = ["PATH", "RUST_LOG", "RUST_BACKTRACE", "LANG", "TZ", "TMPDIR"];

/// The variable that tells a process its generation
/// ([`ServiceRecord::generation`]).
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
    /// ([`ServiceEventKind::PortsReassigned`]). `0` never re-chooses ports.
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
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct ServiceRecord {
    version: u32,
    name: String,
    id: u64,
    epoch: u64,
    labels: BTreeMap<String, String>,
    program: PathBuf,
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

/// The held directory lock; released on drop.
struct DirLock(File);

impl Drop for DirLock {
    fn drop(&mut self) {
        let _ = self.0.unlock();
    }
}

impl Inner {
    fn state_err(path: &Path, source: std::io::Error) -> StateError {
        StateError::Io {
            path: path.to_path_buf(),
            source,
        }
    }

    fn lock(&self) -> Result<DirLock, StateError> {
        let path = self.config.state_dir.join("orchestrator.lock");
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(|e| Self::state_err(&path, e))?;
        file.lock().map_err(|e| Self::state_err(&path, e))?;
        Ok(DirLock(file))
    }

    fn record_path(&self, name: &str) -> PathBuf {
        self.config
            .state_dir
            .join("services")
            .join(format!("{name}.json"))
    }

    fn read(&self, name: &str) -> Result<Option<ServiceRecord>, StateError> {
        read_record(&self.record_path(name))
    }

    fn tombstone_path(&self, name: &str) -> PathBuf {
        self.config
            .state_dir
            .join("services")
            .join(format!("{name}.dropped"))
    }

    /// The epoch of the newest controller that dropped the service, if any.
    fn read_tombstone(&self, name: &str) -> Result<Option<u64>, StateError> {
        let path = self.tombstone_path(name);
        match std::fs::read_to_string(&path) {
            Ok(s) => s.trim().parse().map(Some).map_err(|e| StateError::Corrupt {
                path,
                reason: format!("tombstone: {e}"),
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(Self::state_err(&path, e)),
        }
    }

    fn write_tombstone(&self, name: &str, epoch: u64) -> Result<(), StateError> {
        let path = self.tombstone_path(name);
        let tmp = path.with_extension("dropped.tmp");
        let result = (|| {
            let mut f = private_file(&tmp)?;
            writeln!(f, "{epoch}")?;
            f.sync_all()?;
            std::fs::rename(&tmp, &path)
        })();
        result.map_err(|e| Self::state_err(&path, e))
    }

    fn read_all(&self) -> Result<Vec<ServiceRecord>, StateError> {
        read_all_records(&self.config.state_dir)
    }

    fn write(&self, record: &ServiceRecord) -> Result<(), StateError> {
        let path = self.record_path(&record.name);
        let tmp = path.with_extension("json.tmp");
        let bytes = serde_json::to_vec_pretty(record).expect("records serialize");
        let result = (|| {
            let mut f = private_file(&tmp)?;
            f.write_all(&bytes)?;
            f.sync_all()?;
            std::fs::rename(&tmp, &path)?;
            File::open(path.parent().expect("has a parent"))?.sync_all()
        })();
        result.map_err(|e| Self::state_err(&path, e))
    }

    fn emit(&self, service: &str, process: Option<usize>, kind: ServiceEventKind) {
        let _ = self.events.send(ServiceEvent {
            service: service.to_string(),
            process,
            kind,
        });
    }

    /// Whether the process we recorded still runs; reaps it if it is our child.
    fn alive(&self, pid: u32, start_time: u64) -> bool {
        let mut children = self.children.lock().expect("poisoned");
        if let Some(child) = children.get_mut(&pid) {
            // A reaped child stays in the map (its status cached) until
            // `exit_status` takes it.
            return matches!(child.try_wait(), Ok(None));
        }
        drop(children);
        proc_alive(pid, start_time)
    }

    fn exit_status(&self, pid: u32) -> String {
        match self.children.lock().expect("poisoned").remove(&pid) {
            Some(mut child) => match child.try_wait() {
                Ok(Some(status)) => status.to_string(),
                _ => "exited".to_string(),
            },
            None => "exited (not our child)".to_string(),
        }
    }

    fn ensure(&self, config: ServiceConfig) -> Result<(ServiceRecord, Vec<u32>), EnsureError> {
        validate_name(&config.name)?;
        if config.scale == 0 {
            return Err(EnsureError::Invalid(format!(
                "service {} needs at least one process",
                config.name
            )));
        }
        let program =
            resolve_program(&config.program).ok_or_else(|| EnsureError::ProgramNotFound {
                service: config.name.clone(),
                program: config.program.clone(),
            })?;
        let _lock = self.lock()?;
        let existing = self.read(&config.name)?;
        let ours = self.config.epoch;
        if let Some(existing) = &existing {
            if self.config.conditional_writes && existing.epoch > ours {
                return Err(EnsureError::StaleEpoch {
                    service: config.name.clone(),
                    stored: existing.epoch,
                    ours,
                });
            }
        }
        // A drop is a write too: a stale controller must not resurrect a
        // service that a newer one dropped.
        if let Some(dropped_at) = self.read_tombstone(&config.name)? {
            if self.config.conditional_writes && dropped_at > ours {
                return Err(EnsureError::DroppedByNewer {
                    service: config.name.clone(),
                    dropped_at,
                    ours,
                });
            }
        }
        // Reuse the ports of an existing service of the same shape, so an
        // unchanged spec yields the same command lines and is adopted.
        let alloc = || {
            allocate_ports(config.scale, &config.ports).map_err(|e| EnsureError::Spawn {
                service: config.name.clone(),
                program: program.clone(),
                source: e,
            })
        };
        let placements: Vec<Placement> = (0..config.scale).map(|i| self.placement(i)).collect();
        let args_for = |ports: &[BTreeMap<String, u16>]| argv_for(&config.args, &placements, ports);
        // Try the ports of an existing service of the same shape first, so an
        // unchanged spec yields the same command lines and is adopted.
        let reused = match &existing {
            Some(e) if e.processes.len() == config.scale && e.port_names == config.ports => Some(
                e.processes
                    .iter()
                    .map(|p| p.ports.clone())
                    .collect::<Vec<_>>(),
            ),
            _ => None,
        };
        let mut ports = match reused {
            Some(p) => p,
            None => alloc()?,
        };
        let mut argv = args_for(&ports);
        let mut labels = config.labels.clone();
        labels.insert(EPOCH_LABEL.to_string(), ours.to_string());
        labels.insert(ID_LABEL.to_string(), config.id.to_string());

        let same_spec = existing.as_ref().is_some_and(|e| {
            e.program == program
                && e.env == config.env
                && e.processes.iter().map(|p| &p.argv).eq(argv.iter())
                && e.processes
                    .iter()
                    .map(|p| &p.namespace)
                    .eq(placements.iter().map(|p| &p.namespace))
        });
        if let (true, Some(mut record)) = (same_spec, existing.clone()) {
            // Adopt: keep the processes, rewrite the labels. Dead processes
            // are restarted by the supervisors.
            record.epoch = ours;
            record.id = config.id;
            record.labels = labels;
            self.write(&record)?;
            self.remember_args(&config);
            for (i, p) in record.processes.iter().enumerate() {
                if let Some((pid, start)) = p.handle() {
                    if self.alive(pid, start) {
                        self.emit(&record.name, Some(i), ServiceEventKind::Adopted { pid });
                    }
                }
            }
            return Ok((record, Vec::new()));
        }

        // A new or changed spec: start the new processes first, so that a
        // failure leaves the old service untouched. They get fresh ports, as
        // the old processes still hold theirs until they are killed.
        if existing.is_some() {
            ports = alloc()?;
            argv = args_for(&ports);
        }
        let mut record = ServiceRecord {
            version: RECORD_VERSION,
            name: config.name.clone(),
            id: config.id,
            epoch: ours,
            labels,
            program: program.clone(),
            env: config.env.clone(),
            port_names: config.ports.clone(),
            generation: existing.as_ref().map_or(1, |e| e.generation + 1),
            processes: argv
                .into_iter()
                .zip(ports)
                .zip(placements)
                .map(|((argv, ports), placement)| ProcessRecord {
                    argv,
                    ports,
                    pid: None,
                    start_time: None,
                    restarts: 0,
                    namespace: placement.namespace,
                    address: placement.address,
                })
                .collect(),
        };
        let mut spawned = Vec::new();
        for i in 0..record.processes.len() {
            match self.spawn(&record, i) {
                Ok((pid, start)) => {
                    record.processes[i].pid = Some(pid);
                    record.processes[i].start_time = Some(start);
                    spawned.push(pid);
                }
                Err(source) => {
                    for (j, p) in record.processes.iter().enumerate().take(i) {
                        if let Some((pid, start)) = p.handle() {
                            self.kill(&record.name, j, pid, start);
                        }
                    }
                    return Err(EnsureError::Spawn {
                        service: config.name,
                        program,
                        source,
                    });
                }
            }
        }
        if let Some(old) = &existing {
            for (i, p) in old.processes.iter().enumerate() {
                if let Some((pid, start)) = p.handle() {
                    self.kill(&old.name, i, pid, start);
                }
            }
        }
        if let Err(e) = self.write(&record) {
            for (i, p) in record.processes.iter().enumerate() {
                if let Some((pid, start)) = p.handle() {
                    self.kill(&record.name, i, pid, start);
                }
            }
            return Err(e.into());
        }
        self.remember_args(&config);
        for (i, pid) in spawned.iter().enumerate() {
            self.emit(
                &record.name,
                Some(i),
                ServiceEventKind::Started { pid: *pid },
            );
        }
        Ok((record, spawned))
    }

    fn remember_args(&self, config: &ServiceConfig) {
        self.args
            .lock()
            .expect("poisoned")
            .insert(config.name.clone(), config.args.clone());
    }

    /// Starts process `i` of `record`; returns its PID and start time.
    fn spawn(&self, record: &ServiceRecord, i: usize) -> std::io::Result<(u32, u64)> {
        let log_path = self.log_path(&record.name, i);
        if std::fs::metadata(&log_path).is_ok_and(|m| m.len() > self.config.log_rotate_bytes) {
            std::fs::rename(&log_path, log_path.with_extension("log.1"))?;
        }
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .open(&log_path)?;
        let mut cmd = match &record.processes[i].namespace {
            // `ip netns exec` enters the namespace, mounts
            // /etc/netns/NS/hosts over /etc/hosts and execs: the PID is the
            // program's.
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns]).arg(&record.program);
                c
            }
            None => Command::new(&record.program),
        };
        cmd.args(&record.processes[i].argv)
            // An explicit environment: what the service's spec gives and the
            // few variables a process needs, nothing inherited from the
            // controller (its API token, its store URL, its failpoints).
            .env_clear()
            .envs(
                INHERITED_ENV
                    .iter()
                    .filter_map(|k| std::env::var_os(k).map(|v| (*k, v))),
            )
            .envs(&record.env)
            .env("LOCKSTEP_SERVICE", &record.name)
            .env("LOCKSTEP_PROCESS", i.to_string())
            .env(GENERATION_ENV, record.generation.to_string())
            .env(
                ORCHESTRATOR_ENV,
                std::path::absolute(&self.config.state_dir)
                    .unwrap_or_else(|_| self.config.state_dir.clone()),
            )
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .process_group(0);
        let child = cmd.spawn()?;
        let pid = child.id();
        // If it died at once (a zombie we can read no more of), 0 is a start
        // time that never matches, so it counts as dead.
        let start = proc_start_time(pid).unwrap_or_default();
        self.children.lock().expect("poisoned").insert(pid, child);
        tracing::info!(service = %record.name, process = i, pid, "started");
        Ok((pid, start))
    }

    /// Rotates the log of a running process past the limit: copies it to
    /// `.log.1` and truncates it in place (the process appends to the same
    /// open file, O_APPEND, so it goes on at the new end). A process that
    /// logs without end fills at most twice the limit on disk.
    fn rotate_running_log(&self, name: &str, i: usize) {
        let path = self.log_path(name, i);
        let limit = self.config.log_rotate_bytes;
        if !std::fs::metadata(&path).is_ok_and(|m| m.len() > limit) {
            return;
        }
        let rotated = path.with_extension("log.1");
        let result = std::fs::copy(&path, &rotated).and_then(|_| {
            std::fs::set_permissions(&rotated, std::fs::Permissions::from_mode(0o600))?;
            OpenOptions::new().write(true).open(&path)?.set_len(0)
        });
        if let Err(e) = result {
            tracing::warn!(service = name, process = i, "rotating the log failed: {e}");
        }
    }

    /// The log of process `i` of service `name` (`.log.1` beside it is the
    /// rotated one).
    fn log_path(&self, name: &str, i: usize) -> PathBuf {
        self.config
            .state_dir
            .join("logs")
            .join(format!("{name}-{i}.log"))
    }

    /// Kills the process group of a recorded process, if it is still ours.
    fn kill(&self, service: &str, i: usize, pid: u32, start_time: u64) {
        // Signal only a leader that is alive and ours: a PID whose process
        // exited may already belong to someone else.
        let ours = match self.children.lock().expect("poisoned").get_mut(&pid) {
            Some(child) => matches!(child.try_wait(), Ok(None)),
            None => proc_alive(pid, start_time),
        };
        if ours {
            let pg = nix::unistd::Pid::from_raw(pid as i32);
            if let Err(e) = nix::sys::signal::killpg(pg, nix::sys::signal::Signal::SIGKILL) {
                if e != nix::errno::Errno::ESRCH {
                    tracing::warn!(service, process = i, pid, "killpg failed: {e}");
                }
            }
        }
        if let Some(mut child) = self.children.lock().expect("poisoned").remove(&pid) {
            let _ = child.kill();
            let _ = child.wait();
        }
        // Wait (bounded) until it is gone, so callers see it dead.
        let deadline = Instant::now() + Duration::from_secs(5);
        while proc_alive(pid, start_time) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn drop_service(&self, name: &str) -> Result<bool, DropError> {
        validate_name(name).map_err(|e| DropError::Invalid(e.to_string()))?;
        let _lock = self.lock()?;
        // Record the drop first (the highest epoch that dropped it), so that
        // even a drop of an absent service fences stale re-creations.
        let tombstone = self
            .read_tombstone(name)?
            .unwrap_or(0)
            .max(self.config.epoch);
        self.write_tombstone(name, tombstone)?;
        let Some(record) = self.read(name)? else {
            return Ok(false);
        };
        for (i, p) in record.processes.iter().enumerate() {
            if let Some((pid, start)) = p.handle() {
                self.kill(name, i, pid, start);
                if proc_alive(pid, start) {
                    return Err(DropError::Kill {
                        service: name.to_string(),
                        pid,
                        reason: "still alive 5 s after SIGKILL".to_string(),
                    });
                }
            }
        }
        let path = self.record_path(name);
        std::fs::remove_file(&path).map_err(|e| Self::state_err(&path, e))?;
        // Its logs go with it (best effort: a leftover is only disk).
        for i in 0..record.processes.len() {
            let log = self.log_path(name, i);
            let _ = std::fs::remove_file(log.with_extension("log.1"));
            let _ = std::fs::remove_file(&log);
        }
        tracing::info!(service = name, "dropped");
        self.emit(name, None, ServiceEventKind::Dropped);
        Ok(true)
    }

    /// Under the lock: kills every process of the service, then starts each
    /// again from its record. Returns the new record, and the first spawn
    /// failure if a process could not be started (the record then has no PID
    /// for it, and a supervisor starts it later).
    fn restart_service(
        &self,
        name: &str,
    ) -> Result<(ServiceRecord, Option<RestartError>), RestartError> {
        validate_name(name).map_err(|e| RestartError::Invalid(e.to_string()))?;
        let _lock = self.lock()?;
        let Some(mut record) = self.read(name)? else {
            return Err(RestartError::NoSuchService(name.to_string()));
        };
        let ours = self.config.epoch;
        if self.config.conditional_writes && record.epoch > ours {
            return Err(RestartError::StaleEpoch {
                service: name.to_string(),
                stored: record.epoch,
                ours,
            });
        }
        // Every old process must be gone before a new one binds its ports.
        self.kill_all(&record)
            .map_err(|(_, pid)| RestartError::Kill {
                service: name.to_string(),
                pid,
                reason: "still alive 5 s after SIGKILL".to_string(),
            })?;
        let (spawned, failure) = self.start_generation(&mut record);
        self.commit_generation(&record, spawned)?;
        let failure = failure.map(|(process, source)| RestartError::Spawn {
            service: name.to_string(),
            process,
            program: record.program.clone(),
            source,
        });
        Ok((record, failure))
    }

    /// Under the lock: kills every recorded process of `record`. Error: the
    /// first (index, PID) still alive 5 s after SIGKILL.
    fn kill_all(&self, record: &ServiceRecord) -> Result<(), (usize, u32)> {
        for (i, p) in record.processes.iter().enumerate() {
            if let Some((pid, start)) = p.handle() {
                self.kill(&record.name, i, pid, start);
                if proc_alive(pid, start) {
                    return Err((i, pid));
                }
            }
        }
        Ok(())
    }

    /// Under the lock, after [`Inner::kill_all`]: starts every process of
    /// `record` as a new generation, from its recorded command line. Returns
    /// the processes started and the first that could not be (it is left
    /// without a PID; its supervisor starts a generation again later).
    fn start_generation(
        &self,
        record: &mut ServiceRecord,
    ) -> (Vec<Spawned>, Option<(usize, std::io::Error)>) {
        record.generation += 1;
        let mut failure = None;
        let mut spawned = Vec::new();
        for i in 0..record.processes.len() {
            record.processes[i].pid = None;
            record.processes[i].start_time = None;
            let result = self.spawn(record, i);
            let p = &mut record.processes[i];
            p.restarts += 1;
            match result {
                Ok((pid, start)) => {
                    p.pid = Some(pid);
                    p.start_time = Some(start);
                    spawned.push((i, pid, start));
                }
                Err(source) => {
                    tracing::error!(
                        service = %record.name,
                        process = i,
                        "could not start the process: {source}"
                    );
                    failure.get_or_insert((i, source));
                }
            }
        }
        (spawned, failure)
    }

    /// Under the lock: records a generation [`Inner::start_generation`]
    /// started and announces its processes; if the record cannot be written,
    /// kills them (none may run unrecorded; the old record's dead processes
    /// make the supervisors try again).
    fn commit_generation(
        &self,
        record: &ServiceRecord,
        spawned: Vec<Spawned>,
    ) -> Result<(), StateError> {
        if let Err(e) = self.write(record) {
            for (i, pid, start) in spawned {
                self.kill(&record.name, i, pid, start);
            }
            return Err(e);
        }
        tracing::info!(
            service = %record.name,
            generation = record.generation,
            "started every process as a new generation"
        );
        for (i, pid, _) in spawned {
            self.emit(&record.name, Some(i), ServiceEventKind::Started { pid });
        }
        Ok(())
    }

    fn status(&self, record: &ServiceRecord) -> ServiceStatus {
        ServiceStatus {
            name: record.name.clone(),
            id: record.id,
            epoch: record.epoch,
            labels: record.labels.clone(),
            processes: record
                .processes
                .iter()
                .enumerate()
                .map(|(index, p)| ProcessStatus {
                    index,
                    pid: p.pid,
                    running: p.handle().is_some_and(|(pid, s)| self.alive(pid, s)),
                    addresses: addresses(p.address, &p.ports),
                    restarts: p.restarts,
                })
                .collect(),
        }
    }

    /// Starts one supervisor per process of `record`, replacing this
    /// orchestrator's earlier supervisors of the service.
    fn supervise(self: &Arc<Self>, name: &str, record: &ServiceRecord, _spawned: Vec<u32>) {
        let tasks: Vec<JoinHandle<()>> = (0..record.processes.len())
            .map(|i| {
                let inner = self.clone();
                let name = name.to_string();
                let watched = record.processes[i].handle();
                tokio::spawn(async move { inner.supervisor(name, i, watched).await })
            })
            .collect();
        if let Some(old) = self
            .supervisors
            .lock()
            .expect("poisoned")
            .insert(name.to_string(), tasks)
        {
            for t in old {
                t.abort();
            }
        }
    }

    async fn supervisor(self: Arc<Self>, name: String, i: usize, mut watched: Option<(u32, u64)>) {
        let backoff = self.config.backoff;
        let mut wait = backoff.initial;
        let mut attempt = 0u32;
        let mut since = Instant::now();
        loop {
            tokio::time::sleep(self.config.poll_interval).await;
            if let Some((pid, start)) = watched {
                if self.alive(pid, start) {
                    self.rotate_running_log(&name, i);
                    if since.elapsed() >= backoff.reset_after {
                        wait = backoff.initial;
                        attempt = 0;
                    }
                    continue;
                }
                let status = self.exit_status(pid);
                tracing::warn!(service = %name, process = i, pid, %status, "process exited");
                self.emit(&name, Some(i), ServiceEventKind::Exited { pid, status });
            }
            // Dead (or never started): check the record before restarting.
            match self.check_record(&name, i, watched).await {
                Decision::Stop => return,
                Decision::Watch(h) => {
                    watched = Some(h);
                    since = Instant::now();
                    continue;
                }
                Decision::Restart => {}
            }
            let reassign_after = self.config.reassign_ports_after;
            if reassign_after > 0 && attempt >= reassign_after {
                let inner = self.clone();
                let n = name.clone();
                let result =
                    tokio::task::spawn_blocking(move || inner.reassign_ports(&n, i, watched))
                        .await
                        .expect("port reassignment panicked");
                match result {
                    Ok(Reassigned::NotNeeded) => {}
                    Ok(Reassigned::Decided(Decision::Stop)) => return,
                    Ok(Reassigned::Decided(Decision::Watch(h))) => {
                        watched = Some(h);
                        since = Instant::now();
                        wait = backoff.initial;
                        attempt = 0;
                        continue;
                    }
                    Ok(Reassigned::Decided(Decision::Restart)) => {
                        // New ports, but this process could not be started.
                        watched = None;
                        wait = backoff.initial;
                        attempt = 0;
                    }
                    Err(reason) => {
                        tracing::error!(service = %name, process = i, %reason, "re-choosing ports failed");
                        self.emit(&name, Some(i), ServiceEventKind::Failed { reason });
                    }
                }
            }
            attempt += 1;
            self.emit(
                &name,
                Some(i),
                ServiceEventKind::Restarting {
                    attempt,
                    backoff: wait,
                },
            );
            tokio::time::sleep(wait).await;
            wait = (wait * 2).min(backoff.max);
            let inner = self.clone();
            let n = name.clone();
            let result = tokio::task::spawn_blocking(move || inner.restart(&n, i, watched))
                .await
                .expect("restart panicked");
            match result {
                Ok(Decision::Watch(h)) => {
                    watched = Some(h);
                    since = Instant::now();
                }
                Ok(Decision::Stop) => return,
                Ok(Decision::Restart) => {}
                Err(reason) => {
                    tracing::error!(service = %name, process = i, %reason, "restart failed");
                    self.emit(&name, Some(i), ServiceEventKind::Failed { reason });
                    watched = None;
                }
            }
        }
    }

    async fn check_record(
        self: &Arc<Self>,
        name: &str,
        i: usize,
        watched: Option<(u32, u64)>,
    ) -> Decision {
        let inner = self.clone();
        let name = name.to_string();
        tokio::task::spawn_blocking(move || {
            let _lock = match inner.lock() {
                Ok(l) => l,
                Err(_) => return Decision::Restart,
            };
            inner.decide(&name, i, watched)
        })
        .await
        .expect("check panicked")
    }

    /// Under the lock: what to do about a dead process `watched`.
    fn decide(&self, name: &str, i: usize, watched: Option<(u32, u64)>) -> Decision {
        match self.read(name) {
            Ok(Some(record)) => match record.processes.get(i) {
                None => Decision::Stop,
                Some(p) => match p.handle() {
                    Some(h) if Some(h) != watched => Decision::Watch(h),
                    Some(h) if self.alive(h.0, h.1) => Decision::Watch(h),
                    _ => Decision::Restart,
                },
            },
            // Dropped, or unreadable: not ours to restart.
            _ => Decision::Stop,
        }
    }

    /// Under the lock: if process `i` (dead, last seen as `watched`) has a
    /// recorded port that another socket holds, chooses new ports for every
    /// process of the service (their peers must all agree), kills them all,
    /// starts them all with command lines built for the new ports, and
    /// records them. Only for a service of our epoch whose args function we
    /// have (we ensured it): a newer controller's clients would not learn of
    /// the new ports.
    fn reassign_ports(
        &self,
        name: &str,
        i: usize,
        watched: Option<(u32, u64)>,
    ) -> Result<Reassigned, String> {
        let _lock = self.lock().map_err(|e| e.to_string())?;
        match self.decide(name, i, watched) {
            Decision::Restart => {}
            other => return Ok(Reassigned::Decided(other)),
        }
        let mut record = match self.read(name) {
            Ok(Some(r)) => r,
            _ => return Ok(Reassigned::Decided(Decision::Stop)),
        };
        let held: Vec<u16> = record.processes[i]
            .ports
            .values()
            .copied()
            .filter(|p| port_held(*p))
            .collect();
        if held.is_empty() || record.epoch != self.config.epoch {
            return Ok(Reassigned::NotNeeded);
        }
        let Some(args) = self.args.lock().expect("poisoned").get(name).cloned() else {
            tracing::warn!(
                service = name,
                process = i,
                ?held,
                "a port of the process is held by another socket, but this orchestrator did not ensure the service: cannot build new command lines"
            );
            return Ok(Reassigned::NotNeeded);
        };
        tracing::warn!(
            service = name,
            process = i,
            ?held,
            "the process keeps exiting and a port recorded for it is held by another socket: choosing new ports for every process"
        );
        let ports = allocate_ports(record.processes.len(), &record.port_names)
            .map_err(|e| format!("could not choose new ports: {e}"))?;
        let placements: Vec<Placement> = (0..record.processes.len())
            .map(|j| self.placement(j))
            .collect();
        let argv = argv_for(&args, &placements, &ports);
        self.kill_all(&record)
            .map_err(|(j, pid)| format!("process {j} (PID {pid}) still alive 5 s after SIGKILL"))?;
        for (j, (argv, ports)) in argv.into_iter().zip(ports).enumerate() {
            record.processes[j].argv = argv;
            record.processes[j].ports = ports;
        }
        let (spawned, _) = self.start_generation(&mut record);
        // Announced after the new addresses, below.
        if let Err(e) = self.write(&record) {
            for (j, pid, start) in spawned {
                self.kill(name, j, pid, start);
            }
            return Err(e.to_string());
        }
        self.emit(
            name,
            None,
            ServiceEventKind::PortsReassigned {
                addresses: record
                    .processes
                    .iter()
                    .map(|p| addresses(p.address, &p.ports))
                    .collect(),
            },
        );
        for (j, pid, _) in spawned {
            self.emit(name, Some(j), ServiceEventKind::Started { pid });
        }
        Ok(Reassigned::Decided(match record.processes[i].handle() {
            Some(h) => Decision::Watch(h),
            None => Decision::Restart,
        }))
    }

    /// Under the lock: unless someone else did already, restarts every
    /// process of the service as a new generation because process `i`
    /// (last seen as `watched`) is dead.
    fn restart(
        &self,
        name: &str,
        i: usize,
        watched: Option<(u32, u64)>,
    ) -> Result<Decision, String> {
        let _lock = self.lock().map_err(|e| e.to_string())?;
        match self.decide(name, i, watched) {
            Decision::Restart => {}
            other => return Ok(other),
        }
        let mut record = match self.read(name) {
            Ok(Some(r)) => r,
            _ => return Ok(Decision::Stop),
        };
        // Shared fate: the processes of a service form one cluster, and a
        // process started alone would join peers of another generation.
        // Kill them all, start them all.
        self.kill_all(&record)
            .map_err(|(j, pid)| format!("process {j} (PID {pid}) still alive 5 s after SIGKILL"))?;
        tracing::warn!(
            service = name,
            process = i,
            generation = record.generation + 1,
            "a process exited: restarting every process of the service"
        );
        let (spawned, failure) = self.start_generation(&mut record);
        self.commit_generation(&record, spawned)
            .map_err(|e| e.to_string())?;
        if let Some((j, e)) = failure {
            if j == i {
                return Err(format!(
                    "could not start {}: {e}",
                    record.program.as_path().display()
                ));
            }
        }
        Ok(match record.processes[i].handle() {
            Some(h) => Decision::Watch(h),
            None => Decision::Restart,
        })
    }
}

/// Where process `i` runs: its host as peers name it, the address it binds,
/// its namespace and its address from here.
struct Placement {
    host: String,
    listen_host: &'static str,
    namespace: Option<String>,
    address: Option<IpAddr>,
}

impl Inner {
    fn placement(&self, i: usize) -> Placement {
        match &self.hosts {
            None => Placement {
                host: HOST.to_string(),
                listen_host: HOST,
                namespace: None,
                address: None,
            },
            Some(hosts) => {
                let k = i % hosts.count();
                Placement {
                    host: hosts.namespace(k),
                    listen_host: "0.0.0.0",
                    namespace: Some(hosts.namespace(k)),
                    address: Some(hosts.control_addr(k)),
                }
            }
        }
    }
}

/// A process started: its index, PID and start time.
type Spawned = (usize, u32, u64);

enum Decision {
    Stop,
    Watch((u32, u64)),
    Restart,
}

/// What [`Inner::reassign_ports`] did.
enum Reassigned {
    /// Nothing: no port of the process is held by another socket (or the
    /// service is not ours to re-port); restart it as usual.
    NotNeeded,
    /// Handled (by us or someone else): what to do about the process now.
    Decided(Decision),
}

/// Every process's command line for `ports` (one map per process).
fn argv_for(
    args: &ArgsFn,
    placements: &[Placement],
    ports: &[BTreeMap<String, u16>],
) -> Vec<Vec<String>> {
    let hosts: Vec<String> = placements.iter().map(|p| p.host.clone()).collect();
    (0..ports.len())
        .map(|i| {
            args(&ServiceAssignment {
                process: i,
                scale: ports.len(),
                host: &hosts[i],
                hosts: &hosts,
                listen_host: placements[i].listen_host,
                ports,
            })
        })
        .collect()
}

/// The socket addresses of one process's named ports, at `address` (its
/// simulated host's) or on loopback.
fn addresses(
    address: Option<IpAddr>,
    ports: &BTreeMap<String, u16>,
) -> BTreeMap<String, SocketAddr> {
    let ip = address.unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST));
    ports
        .iter()
        .map(|(n, port)| (n.clone(), SocketAddr::new(ip, *port)))
        .collect()
}

/// Whether another socket listens on `port` (so a process given it cannot
/// bind it).
fn port_held(port: u16) -> bool {
    matches!(
        TcpListener::bind((HOST, port)),
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse
    )
}

fn validate_name(name: &str) -> Result<(), EnsureError> {
    let ok = !name.is_empty()
        && name.len() <= 200
        && !name.starts_with('.')
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if ok {
        Ok(())
    } else {
        Err(EnsureError::Invalid(format!(
            "service name {name:?} must be letters, digits, '-', '_' or '.', not starting with '.'"
        )))
    }
}

/// Finds an executable: a path with a slash is checked as is, a bare name is
/// looked up in `PATH`. Returns the absolute path.
fn resolve_program(program: &Path) -> Option<PathBuf> {
    let executable = |p: &Path| {
        std::fs::metadata(p)
            .ok()
            .filter(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
            .map(|_| std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf()))
    };
    if program.components().count() > 1 || program.is_absolute() {
        return executable(program);
    }
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths).find_map(|dir| executable(&dir.join(program)))
    })
}

fn allocate_ports(scale: usize, names: &[String]) -> std::io::Result<Vec<BTreeMap<String, u16>>> {
    // Hold every listener until all are allocated, so no two coincide.
    let mut held = Vec::new();
    let mut out = Vec::new();
    for _ in 0..scale {
        let mut ports = BTreeMap::new();
        for n in names {
            let l = TcpListener::bind((HOST, 0))?;
            ports.insert(n.clone(), l.local_addr()?.port());
            held.push(l);
        }
        out.push(ports);
    }
    Ok(out)
}

/// The environment variable every spawned process carries: the state
/// directory of the orchestrator that spawned it. A process that carries ours
/// but whose process group no record names escaped the orchestrator (it was
/// spawned, then the orchestrator was killed before it recorded the PID).
pub const ORCHESTRATOR_ENV: &str = "LOCKSTEP_ORCHESTRATOR";

/// The process groups of processes that carry `state_dir` in
/// [`ORCHESTRATOR_ENV`] but that no record in `state_dir/services` names.
/// Call it under the lock to act on it: a spawn and its record happen under
/// it too.
pub fn strays(state_dir: &Path) -> Vec<u32> {
    let Ok(marker) = std::path::absolute(state_dir) else {
        return Vec::new();
    };
    let needle = format!("{ORCHESTRATOR_ENV}={}", marker.display());
    let mut recorded = std::collections::BTreeSet::new();
    if let Ok(entries) = std::fs::read_dir(state_dir.join("services")) {
        for entry in entries.flatten() {
            if let Ok(Some(record)) = read_record(&entry.path()) {
                recorded.extend(record.processes.iter().filter_map(|p| p.pid));
            }
        }
    }
    let mut groups = std::collections::BTreeSet::new();
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    for entry in procs.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(environ) = std::fs::read(format!("/proc/{pid}/environ")) else {
            continue;
        };
        if !environ.split(|b| *b == 0).any(|v| v == needle.as_bytes()) {
            continue;
        }
        // Field 5 of /proc/PID/stat: the process group (our processes lead
        // their own; what they spawn shares it).
        let Some(pgid) = std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|stat| {
                let rest = stat[stat.rfind(')')? + 1..].to_string();
                rest.split_whitespace().nth(2)?.parse::<u32>().ok()
            })
        else {
            continue;
        };
        if proc_start_time(pid).is_some() && !recorded.contains(&pgid) {
            groups.insert(pgid);
        }
    }
    groups.into_iter().collect()
}

/// Kills the process groups [`strays`] finds; returns how many.
fn kill_strays(state_dir: &Path) -> usize {
    let groups = strays(state_dir);
    for &pgid in &groups {
        tracing::warn!(
            pgid,
            "killing processes that escaped the orchestrator (spawned, never recorded)"
        );
        let _ = nix::sys::signal::killpg(
            nix::unistd::Pid::from_raw(pgid as i32),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
    groups.len()
}

/// The start time of a live (non-zombie) process, from `/proc/PID/stat`.
fn proc_start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may contain spaces.
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // fields[0] is field 3 (state); field 22 (starttime) is fields[19].
    if matches!(fields.first(), Some(&"Z") | Some(&"X")) {
        return None;
    }
    fields.get(19)?.parse().ok()
}

/// Creates `dir` (and its parents) if missing, mode 0700 from the start, and
/// narrows an existing one to 0700.
fn private_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
}

/// Creates (or truncates) `path` for writing, mode 0600 from the start (an
/// existing file is narrowed to 0600 before anything is written).
fn private_file(path: &Path) -> std::io::Result<File> {
    let f = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)?;
    f.set_permissions(std::fs::Permissions::from_mode(0o600))?;
    Ok(f)
}

/// Whether `pid` is alive and is the process that started at `start_time`.
fn proc_alive(pid: u32, start_time: u64) -> bool {
    proc_start_time(pid) == Some(start_time)
}

fn read_record(path: &Path) -> Result<Option<ServiceRecord>, StateError> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Inner::state_err(path, e)),
    };
    let record: ServiceRecord =
        serde_json::from_slice(&bytes).map_err(|e| StateError::Corrupt {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })?;
    if record.version != RECORD_VERSION {
        return Err(StateError::Corrupt {
            path: path.to_path_buf(),
            reason: format!("unknown record version {}", record.version),
        });
    }
    Ok(Some(record))
}

fn read_all_records(state_dir: &Path) -> Result<Vec<ServiceRecord>, StateError> {
    let dir = state_dir.join("services");
    let entries = std::fs::read_dir(&dir).map_err(|e| Inner::state_err(&dir, e))?;
    let mut records = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| Inner::state_err(&dir, e))?;
        let path = entry.path();
        if path.extension().is_some_and(|e| e == "json") {
            if let Some(r) = read_record(&path)? {
                records.push(r);
            }
        }
    }
    records.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(records)
}

/// Kills every process recorded under `state_dir` and removes the records:
/// the teardown for tests and for decommissioning a machine. Only processes
/// whose PID and start time both match are signalled. Also removes the
/// directory's simulated hosts ([`crate::hosts::remove_for_state_dir`]).
/// Returns how many processes were killed.
pub fn kill_all_services(state_dir: &Path) -> Result<usize, StateError> {
    let dir = state_dir.join("services");
    if !dir.exists() {
        return Ok(0);
    }
    // Under the lock, so that no supervisor restarts a process in between:
    // one that restarts later finds the record gone and stops.
    let lock_path = state_dir.join("orchestrator.lock");
    let lock = OpenOptions::new()
        .create(true)
        .append(true)
        .open(&lock_path)
        .map_err(|e| Inner::state_err(&lock_path, e))?;
    lock.lock().map_err(|e| Inner::state_err(&lock_path, e))?;
    let _lock = DirLock(lock);
    let mut killed = 0;
    let entries = std::fs::read_dir(&dir).map_err(|e| Inner::state_err(&dir, e))?;
    for entry in entries.flatten() {
        let path = entry.path();
        if path.extension().is_none_or(|e| e != "json") {
            continue;
        }
        if let Ok(Some(record)) = read_record(&path) {
            for p in &record.processes {
                if let Some((pid, start)) = p.handle() {
                    if proc_alive(pid, start) {
                        let _ = nix::sys::signal::killpg(
                            nix::unistd::Pid::from_raw(pid as i32),
                            nix::sys::signal::Signal::SIGKILL,
                        );
                        killed += 1;
                    }
                }
            }
        }
        let _ = std::fs::remove_file(&path);
    }
    killed += kill_strays(state_dir);
    crate::hosts::remove_for_state_dir(state_dir);
    Ok(killed)
}

#[cfg(test)]
mod tests {
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
