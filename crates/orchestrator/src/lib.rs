//! lockstep's orchestrator: how the controller starts, lists and stops the
//! services (replicas) it wants, without caring where they run.
//!
//! The [`Orchestrator`] trait is deliberately small (the Materialize lesson:
//! "small but powerful"): [`ensure_service`](Orchestrator::ensure_service),
//! [`drop_service`](Orchestrator::drop_service),
//! [`restart_service`](Orchestrator::restart_service),
//! [`list_services`](Orchestrator::list_services) and
//! [`watch_services`](Orchestrator::watch_services). Orphan removal is built
//! *on top of* it by the environment, not inside it.
//!
//! Two things in the trait exist for the orphan invariants of the design:
//!
//! - every service is labelled with the epoch of the controller that last
//!   ensured it ([`ServiceStatus::epoch`]) and with its catalog ID
//!   ([`ServiceStatus::id`]), so an orphan policy can tell old from new;
//! - `ensure_service` is a **conditional write**: it refuses with
//!   [`EnsureError::StaleEpoch`] to overwrite a service whose stored epoch is
//!   newer than the caller's, so a service's spec and epoch label never go
//!   back to an older controller's version (O4). A drop leaves a tombstone
//!   with the dropper's epoch, and `ensure_service` likewise refuses
//!   ([`EnsureError::DroppedByNewer`]) to re-create a service that a newer
//!   controller dropped. `drop_service` itself is not conditional on the
//!   epoch; the orphan policy is what keeps a stale controller from dropping
//!   a newer one's services. (The Kubernetes backend's deletes carry
//!   preconditions, but those only make a delete remove exactly the object
//!   it read.)
//!
//! The Kubernetes backend is in its own crate,
//! `lockstep-orchestrator-kubernetes`, so that users of the process backend
//! do not compile kube.
//!
//! The embedded default backend is [`process::ProcessOrchestrator`]: each
//! process of a service is a supervised OS process on this machine, restarted
//! with backoff when it crashes, with its state in a directory so that a
//! restarted controller lists and adopts the services started before it.
//!
//! # Launching a multi-process timely replica
//!
//! A service has `scale` processes. Each process gets its own localhost port
//! for every named port, allocated by the backend, and its command line is
//! computed from a [`ServiceAssignment`]: its index, the process count, and
//! every process's ports, so process *i* can be told its own listen ports and
//! all its peers' addresses:
//!
//! ```no_run
//! use lockstep_orchestrator::{Orchestrator, ServiceConfig};
//! use lockstep_orchestrator::process::{ProcessOrchestrator, ProcessOrchestratorConfig};
//!
//! # async fn example() -> Result<(), Box<dyn std::error::Error>> {
//! let orchestrator = ProcessOrchestrator::new(ProcessOrchestratorConfig::new(
//!     "/var/lib/lockstep/orchestrator",
//!     7, // the epoch of the controller, from the catalog
//! ))?;
//! let config = ServiceConfig::new("replica-5", 5, "/usr/local/bin/lockstep-replica")
//!     .scale(3)
//!     .port("timely")
//!     .port("controller")
//!     .label("replica-name", "r1")
//!     .args(|a| {
//!         vec![
//!             format!("--process={}", a.process),
//!             format!("--processes={}", a.scale),
//!             "--workers=2".to_string(),
//!             format!("--timely-port={}", a.port("timely")),
//!             format!("--controller-port={}", a.port("controller")),
//!             // Every process's timely address, in process order (own included).
//!             format!("--peers={}", a.peer_addrs("timely").join(",")),
//!             format!("--listen-host={}", a.listen_host),
//!         ]
//!     });
//! let status = orchestrator.ensure_service(config).await?;
//! for p in &status.processes {
//!     println!("process {} listens for the controller on {}", p.index, p.addresses["controller"]);
//! }
//! # Ok(()) }
//! ```

pub mod hosts;
pub mod process;

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::broadcast;

/// The label holding the epoch of the controller that last ensured a service.
pub const EPOCH_LABEL: &str = "lockstep/epoch";
/// The label holding a service's catalog ID.
pub const ID_LABEL: &str = "lockstep/id";

/// Where one process of a service stands, given to the args function so it
/// can build that process's command line.
#[derive(Clone, Copy, Debug)]
pub struct ServiceAssignment<'a> {
    /// This process's index, `0..scale`.
    pub process: usize,
    /// The number of processes in the service.
    pub scale: usize,
    /// This process's host (`hosts[process]`).
    pub host: &'a str,
    /// Every process's host as its peers reach it, in process order:
    /// `127.0.0.1` for each in the process backend (each simulated host's
    /// name with `--hosts`), each pod's stable DNS name in the Kubernetes one.
    pub hosts: &'a [String],
    /// The address this process should bind its ports on: `127.0.0.1` in the
    /// process backend, `0.0.0.0` where it must be reached on several
    /// interfaces (a simulated host, a pod).
    pub listen_host: &'a str,
    /// Every process's ports by name, in process order.
    pub ports: &'a [BTreeMap<String, u16>],
}

impl ServiceAssignment<'_> {
    /// This process's port with this name.
    ///
    /// # Panics
    /// If the service declared no port with this name (a programming error).
    pub fn port(&self, name: &str) -> u16 {
        self.port_of(self.process, name)
    }

    /// Process `process`'s port with this name.
    ///
    /// # Panics
    /// If the service declared no port with this name, or `process >= scale`.
    pub fn port_of(&self, process: usize, name: &str) -> u16 {
        *self.ports[process]
            .get(name)
            .unwrap_or_else(|| panic!("the service declares no port named {name:?}"))
    }

    /// This process's `host:port` address for the named port.
    pub fn addr(&self, name: &str) -> String {
        format!("{}:{}", self.host, self.port(name))
    }

    /// Every process's `host:port` address for the named port, in process
    /// order, this process's own included (what timely's cluster config wants).
    pub fn peer_addrs(&self, name: &str) -> Vec<String> {
        (0..self.scale)
            .map(|i| {
                let host = self.hosts.get(i).map(String::as_str).unwrap_or(self.host);
                format!("{host}:{}", self.port_of(i, name))
            })
            .collect()
    }
}

/// Computes one process's arguments from its assignment.
pub type ArgsFn = Arc<dyn Fn(&ServiceAssignment<'_>) -> Vec<String> + Send + Sync>;

/// What a service should be: the program, how many processes, their ports,
/// arguments and labels. Build it with [`ServiceConfig::new`] and the setters.
#[derive(Clone)]
pub struct ServiceConfig {
    /// The service's name, its key in the orchestrator (letters, digits, `-`,
    /// `_`, `.`).
    pub name: String,
    /// The catalog ID of what it runs (a replica ID).
    pub id: u64,
    /// The program every process runs: a path, or a bare name looked up in `PATH`.
    pub program: PathBuf,
    /// Computes each process's arguments.
    pub args: ArgsFn,
    /// Named ports every process listens on: each gets its own localhost port
    /// in the process backend, the same port on every pod in the Kubernetes one.
    pub ports: Vec<String>,
    /// Number of processes (at least 1).
    pub scale: usize,
    /// Labels to attach (the backend adds [`EPOCH_LABEL`] and [`ID_LABEL`]).
    pub labels: BTreeMap<String, String>,
    /// Extra environment variables for every process.
    pub env: BTreeMap<String, String>,
}

impl ServiceConfig {
    /// A one-process service running `program` with no arguments, ports or labels.
    pub fn new(name: impl Into<String>, id: u64, program: impl Into<PathBuf>) -> Self {
        ServiceConfig {
            name: name.into(),
            id,
            program: program.into(),
            args: Arc::new(|_| Vec::new()),
            ports: Vec::new(),
            scale: 1,
            labels: BTreeMap::new(),
            env: BTreeMap::new(),
        }
    }

    /// Sets the function computing each process's arguments.
    pub fn args(
        mut self,
        f: impl Fn(&ServiceAssignment<'_>) -> Vec<String> + Send + Sync + 'static,
    ) -> Self {
        self.args = Arc::new(f);
        self
    }

    /// Sets the same fixed arguments for every process.
    pub fn fixed_args<S: Into<String>>(self, args: impl IntoIterator<Item = S>) -> Self {
        let args: Vec<String> = args.into_iter().map(Into::into).collect();
        self.args(move |_| args.clone())
    }

    /// Declares a named port.
    pub fn port(mut self, name: impl Into<String>) -> Self {
        self.ports.push(name.into());
        self
    }

    /// Sets the number of processes.
    pub fn scale(mut self, scale: usize) -> Self {
        self.scale = scale;
        self
    }

    /// Adds a label.
    pub fn label(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.labels.insert(key.into(), value.into());
        self
    }

    /// Adds an environment variable.
    pub fn env(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.env.insert(key.into(), value.into());
        self
    }
}

impl fmt::Debug for ServiceConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServiceConfig")
            .field("name", &self.name)
            .field("id", &self.id)
            .field("program", &self.program)
            .field("ports", &self.ports)
            .field("scale", &self.scale)
            .field("labels", &self.labels)
            .field("env", &self.env)
            .finish_non_exhaustive()
    }
}

/// One process of a listed service.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcessStatus {
    /// Its index, `0..scale`.
    pub index: usize,
    /// Its OS process ID, if it has been started.
    pub pid: Option<u32>,
    /// Whether it runs now (the recorded PID is alive and is the process we
    /// started, not a reused PID).
    pub running: bool,
    /// Its address for each named port.
    pub addresses: BTreeMap<String, SocketAddr>,
    /// How often it was restarted after exiting.
    pub restarts: u32,
}

/// A service as listed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceStatus {
    /// Its name.
    pub name: String,
    /// Its catalog ID.
    pub id: u64,
    /// The epoch of the controller that last ensured it.
    pub epoch: u64,
    /// All its labels, [`EPOCH_LABEL`] and [`ID_LABEL`] included.
    pub labels: BTreeMap<String, String>,
    /// Its processes, in index order.
    pub processes: Vec<ProcessStatus>,
}

/// What happened to a service's process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ServiceEventKind {
    /// The process was started.
    Started {
        /// Its PID.
        pid: u32,
    },
    /// A running process started by an earlier controller was adopted.
    Adopted {
        /// Its PID.
        pid: u32,
    },
    /// The process exited (crashed or was killed from outside).
    Exited {
        /// Its PID.
        pid: u32,
        /// How it exited, as far as we can tell.
        status: String,
    },
    /// The process will be restarted after a backoff.
    Restarting {
        /// The restart attempt, counting from 1.
        attempt: u32,
        /// How long we wait first.
        backoff: Duration,
    },
    /// The process could not be restarted now (or its state could not be
    /// read to decide whether to restart it, e.g. out of file descriptors).
    /// Not final: the supervisor keeps trying, with backoff, until the
    /// process runs again or its service is dropped.
    Failed {
        /// Why.
        reason: String,
    },
    /// The service was dropped (every process killed).
    Dropped,
    /// Every process of the service listens on new addresses; clients of
    /// the service must use them. A whole-service event. The process
    /// backend: a process kept exiting at once while a port recorded for it
    /// was held by another socket, so every process got new ports and was
    /// restarted (its peers must agree on everyone's ports). The Kubernetes
    /// backend: a new generation's pods got their IPs.
    AddressesChanged {
        /// Every process's new addresses, in process order.
        addresses: Vec<BTreeMap<String, std::net::SocketAddr>>,
    },
}

/// A status event of a service.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceEvent {
    /// The service's name.
    pub service: String,
    /// The process concerned (`None` for whole-service events).
    pub process: Option<usize>,
    /// What happened.
    pub kind: ServiceEventKind,
}

/// Why the orchestrator's state could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    /// A state file or directory could not be accessed.
    #[error("orchestrator state {path}: {source}")]
    Io {
        /// The path.
        path: PathBuf,
        /// What the OS said.
        source: std::io::Error,
    },
    /// A state file could not be parsed; it is left as it is.
    #[error("orchestrator state file {path} is corrupt: {reason}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What was wrong.
        reason: String,
    },
}

/// Why `ensure_service` failed. On every error, a service that existed keeps
/// its processes, spec and labels.
#[derive(Debug, thiserror::Error)]
pub enum EnsureError {
    /// The stored service was ensured by a newer controller (O4).
    #[error(
        "service {service} was ensured by epoch {stored}, newer than ours ({ours}): refusing to overwrite it; another controller took over"
    )]
    StaleEpoch {
        /// The service.
        service: String,
        /// The epoch stored in its label.
        stored: u64,
        /// The caller's epoch.
        ours: u64,
    },
    /// The service was dropped by a newer controller; an older one may not
    /// re-create it (O4: a drop is a write too).
    #[error(
        "service {service} was dropped by epoch {dropped_at}, newer than ours ({ours}): refusing to re-create it; another controller took over"
    )]
    DroppedByNewer {
        /// The service.
        service: String,
        /// The epoch that dropped it.
        dropped_at: u64,
        /// The caller's epoch.
        ours: u64,
    },
    /// The program does not exist or is not executable.
    #[error("service {service}: program {program} does not exist or is not executable")]
    ProgramNotFound {
        /// The service.
        service: String,
        /// The program.
        program: PathBuf,
    },
    /// A process could not be started.
    #[error("service {service}: could not start {program}: {source}")]
    Spawn {
        /// The service.
        service: String,
        /// The program.
        program: PathBuf,
        /// What the OS said.
        source: std::io::Error,
    },
    /// The config makes no sense.
    #[error("invalid service config: {0}")]
    Invalid(String),
    /// The state could not be read or written.
    #[error(transparent)]
    State(#[from] StateError),
}

/// Why `drop_service` failed.
#[derive(Debug, thiserror::Error)]
pub enum DropError {
    /// The service name is not a valid name.
    #[error("{0}")]
    Invalid(String),
    /// The state could not be read or written.
    #[error(transparent)]
    State(#[from] StateError),
    /// A process could not be killed.
    #[error("service {service}: could not kill process {pid}: {reason}")]
    Kill {
        /// The service.
        service: String,
        /// The PID.
        pid: u32,
        /// What the OS said.
        reason: String,
    },
}

/// Why `restart_service` failed.
#[derive(Debug, thiserror::Error)]
pub enum RestartError {
    /// No service with this name exists (it was never ensured, or it was
    /// dropped).
    #[error("no service named {0:?} to restart")]
    NoSuchService(String),
    /// The service name is not a valid name.
    #[error("{0}")]
    Invalid(String),
    /// The stored service was ensured by a newer controller: another
    /// controller took over, and an older one must not disturb its processes.
    #[error(
        "service {service} was ensured by epoch {stored}, newer than ours ({ours}): refusing to restart it; another controller took over"
    )]
    StaleEpoch {
        /// The service.
        service: String,
        /// The epoch stored in its label.
        stored: u64,
        /// The caller's epoch.
        ours: u64,
    },
    /// An old process could not be killed; nothing new was started.
    #[error("service {service}: could not kill process {pid}: {reason}")]
    Kill {
        /// The service.
        service: String,
        /// The PID.
        pid: u32,
        /// What the OS said.
        reason: String,
    },
    /// A new process could not be started. The old processes are gone; the
    /// supervisors keep trying to start the missing ones with backoff.
    #[error("service {service}: could not start process {process} ({program}): {source}")]
    Spawn {
        /// The service.
        service: String,
        /// The process index.
        process: usize,
        /// The program.
        program: PathBuf,
        /// What the OS said.
        source: std::io::Error,
    },
    /// The state could not be read or written.
    #[error(transparent)]
    State(#[from] StateError),
}

/// Why `list_services` failed.
#[derive(Debug, thiserror::Error)]
pub enum ListError {
    /// The state could not be read.
    #[error(transparent)]
    State(#[from] StateError),
}

/// Runs services. See the crate docs.
#[async_trait::async_trait]
pub trait Orchestrator: Send + Sync {
    /// The epoch this orchestrator labels services with (the controller's).
    fn epoch(&self) -> u64;

    /// Creates the service, or updates it to `config`, labelled with our
    /// epoch. Conditional: refuses with [`EnsureError::StaleEpoch`] if the
    /// stored service carries a newer epoch, and with
    /// [`EnsureError::DroppedByNewer`] if a newer epoch dropped it. A service whose spec is unchanged
    /// keeps its running processes (that is how a restarted controller adopts
    /// them); only its labels are rewritten.
    async fn ensure_service(&self, config: ServiceConfig) -> Result<ServiceStatus, EnsureError>;

    /// Kills every process of the service, forgets it and records that our
    /// epoch dropped it. Returns whether it existed. Unconditional.
    async fn drop_service(&self, name: &str) -> Result<bool, DropError>;

    /// Restarts every process of the service: the way out for a replica
    /// that is alive but not working (a stopped or hung process, or one that
    /// lost lockstep), which the supervisors cannot see, as they restart only
    /// processes that exited.
    ///
    /// - It kills every process of the service, whatever its state: the
    ///   process backend sends SIGKILL to each process's group, which also
    ///   kills a stopped (SIGSTOP) process and whatever a process spawned. It
    ///   waits until they are gone.
    /// - Then it starts them again with the same spec: the same program,
    ///   arguments, environment and ports (so a controller reconnects to the
    ///   addresses it knows), and the same labels. Each process's `restarts`
    ///   count goes up by one.
    /// - It returns the service's new status once the new processes run.
    ///
    /// It must not race with the backend's own supervision, which restarts
    /// processes that exit: the kill and the start happen under the same
    /// exclusion as every other write (the process backend holds its state
    /// directory lock throughout), so a supervisor that sees a killed process
    /// finds the replacement already recorded and watches it instead of
    /// starting a second one.
    ///
    /// Errors: [`RestartError::NoSuchService`] for a service that does not
    /// exist or was dropped (nothing is started); [`RestartError::StaleEpoch`]
    /// if a newer controller ensured it (with conditional writes on; nothing
    /// is killed); [`RestartError::Spawn`] if a new process could not start
    /// (the old ones are gone; the supervisors keep trying).
    async fn restart_service(&self, name: &str) -> Result<ServiceStatus, RestartError>;

    /// Every service, sorted by name.
    async fn list_services(&self) -> Result<Vec<ServiceStatus>, ListError>;

    /// Status events of every service from now on.
    fn watch_services(&self) -> broadcast::Receiver<ServiceEvent>;
}
