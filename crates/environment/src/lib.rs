//! The lockstep environment: the controller process that owns the catalog,
//! starts replicas through the orchestrator, removes orphans and serves the
//! user-facing gRPC API (`proto/lockstep/environment/v1/environment.proto`).
//!
//! # Why it is shaped like this
//!
//! A controller can crash between its catalog transaction and the
//! orchestrator call, and a restarted controller can overlap with the one it
//! replaces. The seed discussion (Materialize PR 16114) shows both. So:
//!
//! - Every mutation is **a catalog transaction, then the orchestrator call**.
//!   A crash in between leaves either a wanted replica without a service
//!   (fixed by the next start, which ensures every catalog replica) or a
//!   service without a replica, an orphan (removed by the next start).
//! - On start, in this order: [`Environment::load`] opens the catalog (which
//!   bumps the epoch and fences every older controller),
//!   [`Environment::ensure_replicas`] ensures every catalog replica (adopting
//!   running processes), [`Environment::remove_orphans`] lists the services and
//!   asks the [`OrphanPolicy`] which to delete or whether to halt, and only
//!   then [`Environment::serve`] serves. The steps are public so tests can
//!   interleave several controllers step by step, as in the seed's timeline.
//! - A controller that finds it was overtaken — its catalog write is fenced,
//!   its conditional ensure is refused, or its orphan policy says so —
//!   **halts** ([`EnvError::Halted`]): the `lockstep` binary exits non-zero
//!   with a message saying another controller took over (O3).
//! - The orphan rule is a `Box<dyn OrphanPolicy>` chosen by the caller: the
//!   binary maps `--orphan-rule epoch|id-watermark|catalog-only` to the native
//!   rules; a WASM policy implements the same trait and plugs in the same way.
//!
//! The server logic lives here rather than in the binary so that dataflow,
//! peek and subscribe RPCs can be added next to the replica ones
//! ([`server::EnvironmentService`]).
//!
//! # State directory
//!
//! ```text
//! STATE_DIR/catalog.db       the fenced catalog (lockstep-catalog)
//! STATE_DIR/orchestrator/    the process backend's state: one file per
//!                            service, tombstones, process logs
//! STATE_DIR/command-logs/    replica-N.sqlite: replica N's command log, for
//!                            the `log` distribution strategy
//! ```
//!
//! Replica *N* runs as the service `replica-N` ([`ServiceTemplate`] builds
//! its command line), labelled with its catalog ID, its name and the epoch of
//! the controller that last ensured it. Its processes get its command log in
//! the environment variable `LOCKSTEP_COMMAND_LOG` (read by
//! `lockstep-replica --command-log`), and its controller gets the same path.
//! The path depends only on the state directory and the replica ID, so a
//! restarted environment ensures the same spec and adopts the processes.
//!
//! # Restarting a replica that is not working
//!
//! The orchestrator's supervisors restart a process that exits (a crash, or
//! a halt on lost lockstep). A process that is alive but silent (stopped or
//! hung) is seen only by the replica's controller, as
//! [`Event::ProcessSilent`](lockstep_controller::Event::ProcessSilent). On
//! that event, and on a `LOCKSTEP_LOST` error from a process, the environment
//! restarts every process of the replica through
//! [`Orchestrator::restart_service`] (same ports), at most once per
//! [`REPLICA_RESTART_INTERVAL`] per replica, logging the reason; the
//! controller reconnects and rehydrates the new processes by itself. An event
//! that comes within the interval is checked again when the interval ends:
//! if the replica then does not answer a ping, it is restarted again.
//!
//! A replica whose processes are gone with nothing to restart them (their
//! node lost: no kubelet acts, and the API still shows the pods running)
//! is seen only as connections that are lost and not made again: a
//! replica that served and has had no session for 30 s (and does not
//! answer a ping) is restarted too (reason `unreachable`). One that has
//! not served since its processes last started (a generation still
//! starting, an image being pulled) is left to the orchestrator.
//!
//! # Failpoints
//!
//! With the cargo feature `failpoints`, the create and drop paths carry
//! failpoints (the `fail` crate, configured by the `FAILPOINTS` environment
//! variable, e.g. `FAILPOINTS=after_catalog_drop_replica=panic`):
//! `before_catalog_create_replica`, `after_catalog_create_replica`,
//! `after_orchestrator_create_replica`, and the same three for
//! `drop_replica`. The `lockstep` binary turns a panic into an abort, so a
//! `panic` action crashes the whole controller as a real crash would.

pub mod compute;
mod health;
mod inputs;
pub mod listeners;
pub mod metrics;
pub mod policies;
pub mod private;
mod reconfiguration;
mod replicas;
pub mod rpc_metrics;
mod serve;
pub mod server;
mod startup;
mod upgrade;

/// The generated gRPC types and services of `lockstep.environment.v1`
/// (crate `lockstep-api`, which clients link alone).
pub use lockstep_api::proto;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use lockstep_catalog::{Catalog, CatalogState, Replica, ReplicaConfig, Store, WriteError};
use lockstep_command_log::LogLocation;
use lockstep_orchestrator::process::{ProcessOrchestrator, ProcessOrchestratorConfig};
use lockstep_orchestrator::{EnsureError, Orchestrator, RestartError, ServiceStatus};
use lockstep_policy::{CatalogView, OrphanDecision, OrphanPolicy, PolicyError, Service};
use tokio::sync::watch;

pub use compute::{Reconfiguration, ReconfigurationPhase, REPLICA_RESTART_INTERVAL};
pub use inputs::{HoldsReport, DEFAULT_READ_HOLD_LIMIT};
pub use lockstep_launch::ServiceTemplate;
pub use upgrade::{AnsweredUpgrade, ReconfigurationStatus, CATCH_UP_BOUND};

/// Concurrent streams (and calls) one API connection may have open.
pub const API_MAX_STREAMS: u32 = 256;

/// The largest request the API's open services (health and reflection,
/// which need no token) decode: their requests are a service or symbol
/// name. A larger one is refused before it is read, so a token-less caller
/// cannot make the environment buffer messages (R1).
pub const API_OPEN_MAX_REQUEST_BYTES: usize = 4 << 10;

/// The catalog file inside the state directory.
pub const CATALOG_FILE: &str = "catalog.db";
/// The orchestrator's directory inside the state directory.
pub const ORCHESTRATOR_DIR: &str = "orchestrator";
/// The directory of the replicas' command logs inside the state directory.
pub const COMMAND_LOG_DIR: &str = "command-logs";

/// The file in the state directory that holds the master secret every
/// replica's session key is derived from (32 random bytes, mode 0600,
/// created on first start).
pub const SESSION_SECRET_FILE: &str = "session.secret";

/// Reads the master secret in `dir`, creating it (32 bytes from the OS's
/// random source, mode 0600) if it does not exist.
pub fn session_secret(dir: &Path) -> std::io::Result<[u8; 32]> {
    let path = dir.join(SESSION_SECRET_FILE);
    match private::read_owned(&path) {
        Ok(bytes) => <[u8; 32]>::try_from(bytes.as_slice()).map_err(|_| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!(
                    "{} holds {} bytes, not 32: remove it only if no replica of this state directory runs",
                    path.display(),
                    bytes.len()
                ),
            )
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let mut secret = [0u8; 32];
            private::random_bytes(&mut secret)?;
            private::create_once(&path, &secret)?;
            session_secret(dir)
        }
        Err(e) => Err(e),
    }
}
/// What an [`OrchestratorFactory`] is given.
#[derive(Clone, Copy, Debug)]
pub struct OrchestratorParams<'a> {
    /// The state directory.
    pub state_dir: &'a Path,
    /// The catalog's epoch, which the orchestrator must label with.
    pub epoch: u64,
    /// Whether ensures are conditional on the epoch (O4).
    pub conditional_writes: bool,
}

/// Builds the orchestrator once the catalog is open (its epoch known).
pub type OrchestratorFactory =
    Box<dyn FnOnce(OrchestratorParams<'_>) -> Result<Arc<dyn Orchestrator>, StartError> + Send>;

/// The default backend: the process orchestrator on `STATE_DIR/orchestrator`.
pub fn process_orchestrator(
    params: OrchestratorParams<'_>,
) -> Result<Arc<dyn Orchestrator>, StartError> {
    process_orchestrator_on(params, 0)
}

/// The process backend with every replica's process *i* on simulated host
/// *i mod `hosts`* (a network namespace of its own; see
/// `lockstep_orchestrator::hosts`); needs root.
pub fn process_orchestrator_on_hosts(hosts: usize) -> OrchestratorFactory {
    Box::new(move |params| process_orchestrator_on(params, hosts))
}

fn process_orchestrator_on(
    params: OrchestratorParams<'_>,
    hosts: usize,
) -> Result<Arc<dyn Orchestrator>, StartError> {
    let dir = params.state_dir.join(ORCHESTRATOR_DIR);
    std::fs::create_dir_all(&dir).map_err(|source| StartError::StateDirUnwritable {
        path: dir.clone(),
        source,
    })?;
    let mut config = ProcessOrchestratorConfig::new(dir, params.epoch);
    config.conditional_writes = params.conditional_writes;
    config.hosts = hosts;
    Ok(Arc::new(ProcessOrchestrator::new(config)?))
}

/// How long a halted environment keeps answering in-flight requests.
pub const HALT_GRACE: std::time::Duration = std::time::Duration::from_secs(2);

/// Where the replicas' command logs live.
#[derive(Clone, Debug)]
pub enum CommandLogs {
    /// One SQLite file per replica in this directory.
    Dir(PathBuf),
    /// One log per replica in this PostgreSQL database (a connection string).
    Postgres(String),
}

/// How to start an environment.
pub struct EnvironmentConfig {
    /// Holds `catalog.db` and `orchestrator/`; must exist and be writable.
    pub state_dir: PathBuf,
    /// Decides which services are orphans.
    pub orphan_policy: Box<dyn OrphanPolicy + Send>,
    /// The program and arguments of replica services.
    pub service: ServiceTemplate,
    /// Whether orchestrator ensures are conditional on the epoch (O4). Only
    /// the negative tests turn this off.
    pub conditional_writes: bool,
    /// A WASM distribution policy for the replicas' controllers; `None` uses
    /// the native rule: `barrier` for every command.
    pub distribution_policy: Option<PathBuf>,
    /// The largest frame on a replica connection (both sides); writes and
    /// peek answers larger than half of it travel in parts.
    pub max_frame_len: usize,
    /// How far (in timestamps) an input collection's since stays behind its
    /// upper; below it, updates are compacted and reads are refused. `None`
    /// keeps every time (see `inputs.rs`).
    pub compaction_lag: Option<u64>,
    /// How far (in times) a read hold (an open subscription, a peek in
    /// flight) may keep an input collection's since behind its upper
    /// before it is broken and its read ends with OUT_OF_RANGE.
    pub read_hold_limit: u64,
    /// The token every API call must carry (`None`: none is asked, which
    /// `lockstep serve` allows only on a loopback address).
    pub api_token: Option<String>,
    /// Whether a WASM distribution policy may choose `naive` (the negative
    /// control); refused by default.
    pub allow_naive: bool,
    /// Where the catalog and the replicas' command logs live: `None` for
    /// SQLite files in the state directory, or a PostgreSQL connection
    /// string (`postgres://…`).
    pub store: Option<String>,
    /// The dataflow format the replica program builds (its family's
    /// `format`): `None` for the built-in plan language
    /// (`lockstep.plan.v1`), whose descriptions and rows the environment
    /// checks before recording them. For another family it checks the
    /// envelope and the frame limit, and a description the replicas refuse
    /// is not created (docs/embedding.md).
    pub format: Option<String>,
    /// Whether replica processes run on this machine (the process backend:
    /// the service program is a path here, checked before anything is
    /// opened, and a SQLite store gives them command logs in the state
    /// directory), or elsewhere (pods: the program is a path in their
    /// image, and only a PostgreSQL store gives them command logs).
    pub replicas_here: bool,
}

impl EnvironmentConfig {
    /// An environment on `state_dir` with `orphan_policy` and replica
    /// `service`, and the defaults of everything else: conditional writes,
    /// the native distribution rule (barrier), the default frame limit,
    /// every time kept, no API token, no `naive`, SQLite in the state
    /// directory, the built-in plan language, replicas on this machine.
    pub fn new(
        state_dir: impl Into<PathBuf>,
        orphan_policy: Box<dyn OrphanPolicy + Send>,
        service: ServiceTemplate,
    ) -> Self {
        EnvironmentConfig {
            state_dir: state_dir.into(),
            orphan_policy,
            service,
            conditional_writes: true,
            distribution_policy: None,
            max_frame_len: lockstep_protocol::DEFAULT_MAX_FRAME_LEN,
            compaction_lag: None,
            read_hold_limit: inputs::DEFAULT_READ_HOLD_LIMIT,
            api_token: None,
            allow_naive: false,
            store: None,
            format: None,
            replicas_here: true,
        }
    }
}

impl std::fmt::Debug for EnvironmentConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EnvironmentConfig")
            .field("state_dir", &self.state_dir)
            .field("orphan_policy", &self.orphan_policy.name())
            .field("service", &self.service)
            .field("conditional_writes", &self.conditional_writes)
            .field("distribution_policy", &self.distribution_policy)
            .field("max_frame_len", &self.max_frame_len)
            .field("compaction_lag", &self.compaction_lag)
            .field("read_hold_limit", &self.read_hold_limit)
            .field("api_token", &self.api_token.as_ref().map(|_| "(set)"))
            .field("allow_naive", &self.allow_naive)
            .field(
                "store",
                &self.store.as_deref().map(|s| {
                    if s.starts_with("postgres") {
                        lockstep_pg::redact(s)
                    } else {
                        s.to_string()
                    }
                }),
            )
            .field("format", &self.format)
            .field("replicas_here", &self.replicas_here)
            .finish()
    }
}

/// Why an environment could not start. Nothing was changed: no service was
/// deleted and, for every case but a failing orchestrator, the catalog was
/// not touched.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The `--store` argument is not a store.
    #[error("bad store: {0}")]
    Store(String),
    /// The state directory does not exist.
    #[error("state directory {0} does not exist (create it first)")]
    StateDirMissing(PathBuf),
    /// The state directory is not a directory.
    #[error("state directory {0} is not a directory")]
    StateDirNotADirectory(PathBuf),
    /// The state directory cannot be written.
    #[error("state directory {path} is not writable: {source}")]
    StateDirUnwritable {
        /// The directory.
        path: PathBuf,
        /// What the OS said.
        source: std::io::Error,
    },
    /// Other users can read, write or enter the state directory.
    #[error("state directory {path} is open to other users (mode {mode:o}); it holds every input row, plan, token and the replicas' secrets: chmod 700 it, or use a directory only you can enter")]
    StateDirUnsafe {
        /// The directory.
        path: PathBuf,
        /// Its permission bits.
        mode: u32,
    },
    /// The state directory, or a directory or link on its path, belongs to
    /// another user, or others can write a directory on its path.
    #[error("state directory {path} cannot be trusted: {reason}; it holds every input row, plan, token and the replicas' secrets, so it and every directory above it must be yours or root's and not writable by others")]
    StateDirUntrusted {
        /// The directory.
        path: PathBuf,
        /// Which component, and why.
        reason: String,
    },
    /// The replica service program does not exist.
    #[error(
        "service binary {0} does not exist or is not executable (set it with --service-binary)"
    )]
    ServiceBinaryMissing(PathBuf),
    /// The catalog could not be opened.
    #[error(transparent)]
    Catalog(#[from] lockstep_catalog::OpenError),
    /// The catalog could not be read after opening.
    #[error(transparent)]
    CatalogRead(#[from] lockstep_catalog::ReadError),
    /// The orchestrator could not be created.
    #[error(transparent)]
    Orchestrator(#[from] lockstep_orchestrator::process::NewError),
    /// Another orchestrator backend could not be created.
    #[error("orchestrator: {0}")]
    OrchestratorBackend(String),
    /// The orchestrator was built for another epoch than the catalog's.
    #[error("the orchestrator labels with epoch {orchestrator}, but the catalog was opened at epoch {catalog}")]
    EpochMismatch {
        /// The catalog's epoch.
        catalog: u64,
        /// The orchestrator's epoch.
        orchestrator: u64,
    },
    /// A policy set at run time could not be put in force again.
    #[error("cannot put the catalog's policies in force again: {0}")]
    PolicyRestore(String),
    /// A stored input write does not decode.
    #[error("the catalog's input write {seq} (replica {replica_id}) does not decode: {reason}")]
    CorruptInput {
        /// Its position in the catalog.
        seq: u64,
        /// Its replica.
        replica_id: u64,
        /// What the decoder said.
        reason: String,
    },
    /// The dataflow format asked for (`--format`, or the built-in one when
    /// none is given) is not the one the catalog's replicas build.
    #[error(
        "this catalog's replicas build format {recorded}; {}: start with --format {recorded} (or a fresh state directory)",
        match .given {
            Some(g) => format!("--format says {g}"),
            None => format!("no --format was given, which means the built-in {}", lockstep_plan::FORMAT),
        }
    )]
    FormatMismatch {
        /// The catalog's format (recorded, or named by its dataflows).
        recorded: String,
        /// The `--format` given, if any.
        given: Option<String>,
    },
    /// The catalog could not record the environment's format.
    #[error("cannot record the dataflow format in the catalog: {0}")]
    FormatRecord(#[source] WriteError),
}

/// Why an environment operation failed.
#[derive(Debug, thiserror::Error)]
pub enum EnvError {
    /// Another controller took over; this one has halted and must exit (O3).
    #[error("halting: another controller took over: {0}")]
    Halted(String),
    /// The request was refused by the catalog (name taken, unknown, invalid).
    #[error(transparent)]
    Catalog(WriteError),
    /// The orchestrator failed.
    #[error("orchestrator: {0}")]
    Orchestrator(String),
}

/// A replica with the status of its service, as listed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplicaInfo {
    /// The catalog replica.
    pub replica: Replica,
    /// Its service, if the orchestrator lists one.
    pub service: Option<ServiceStatus>,
}

/// What orphan removal did.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct OrphanReport {
    /// Services deleted.
    pub deleted: Vec<String>,
    /// Set when the policy failed or answered nonsense and nothing was
    /// deleted (the safe default).
    pub policy_error: Option<String>,
}

/// A running environment. See the crate docs for the start-up steps.
pub struct Environment {
    /// Shared with each replica's watcher, which forgets a dataflow a
    /// replica refused.
    catalog: Arc<Mutex<Catalog>>,
    /// Our view of the catalog: what we loaded plus our own writes (its
    /// input writes are moved to `inputs` on load).
    view: Arc<Mutex<CatalogState>>,
    /// What the catalog stores of every input collection, consolidated.
    inputs: Arc<Mutex<inputs::Inputs>>,
    /// The view's dataflow descriptions, decoded (kept in step with the
    /// view by `dataflows_of`).
    decoded: Mutex<BTreeMap<u64, Arc<lockstep_protocol::DataflowDescription>>>,
    orchestrator: Arc<dyn Orchestrator>,
    policy: Mutex<Box<dyn OrphanPolicy + Send>>,
    template: ServiceTemplate,
    epoch: u64,
    halt: watch::Sender<Option<String>>,
    orphans_removed: Mutex<Vec<String>>,
    /// The reconfiguration records settled at start (`reconfiguration.rs`).
    reconfigurations_settled: Mutex<Vec<String>>,
    /// Serializes mutations and orphan removal, so that a background orphan
    /// removal never classifies against a half-applied create or drop.
    ops: tokio::sync::Mutex<()>,
    /// Writes waiting for their group commit (`compute::writes`).
    pending_writes: compute::PendingWrites,
    /// One controller per replica.
    compute: compute::Compute,
    /// Where the replicas' command logs live (`None`: no command logs).
    command_logs: Option<CommandLogs>,
    /// The master secret of the replicas' session keys (`None`: replicas
    /// have none, and anyone who reaches a replica can drive it).
    session_secret: Option<[u8; 32]>,
    /// The token every API call must carry (`None`: no token is asked).
    api_token: Option<String>,
    /// Where policies set at run time are written (`STATE_DIR/policies`).
    policies_dir: Option<PathBuf>,
    /// The policies in force, by kind.
    policies_in_force: Mutex<BTreeMap<String, policies::PolicyInForce>>,
    /// The per-replica policies in force (over the environment-wide ones),
    /// by replica ID.
    replica_policies_in_force: Mutex<BTreeMap<u64, policies::PolicyInForce>>,
    /// The largest answer the API sends ([`server::MAX_ANSWER_BYTES`]
    /// unless set): a larger one is RESOURCE_EXHAUSTED.
    max_answer_bytes: std::sync::atomic::AtomicUsize,
    /// Whether the API serves (grpc.health.v1 SERVING): from
    /// [`Environment::serve`] until its shutdown began or a halt. What the
    /// metrics endpoint's `GET /healthz` says (probes that do not speak
    /// the API's TLS).
    api_serving: std::sync::atomic::AtomicBool,
}

impl std::fmt::Debug for Environment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Environment")
            .field("epoch", &self.epoch)
            .field("template", &self.template)
            .finish_non_exhaustive()
    }
}

/// Checks that `dir` is a state directory this process may trust and use:
/// every directory on its path owned by this user or root and not writable
/// by others (unless sticky), every symbolic link on it owned by this user
/// or root, the directory itself owned by this user, not writable by
/// others (one only others can read or enter is made 0700 through its
/// descriptor), and writable (a probe file is created and removed).
pub fn check_state_dir(dir: &Path) -> Result<(), StartError> {
    private::checked_state_dir(dir).map(drop)
}

impl Environment {
    /// The epoch this environment owns.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The orchestrator.
    pub fn orchestrator(&self) -> &Arc<dyn Orchestrator> {
        &self.orchestrator
    }

    /// The orphan policy's name.
    pub fn orphan_rule(&self) -> String {
        self.policy.lock().expect("poisoned").name().to_string()
    }

    /// Services removed as orphans so far.
    pub fn orphans_removed(&self) -> Vec<String> {
        self.orphans_removed.lock().expect("poisoned").clone()
    }

    /// Our view of the catalog (what we loaded, plus our own writes).
    pub fn view(&self) -> CatalogState {
        self.view.lock().expect("poisoned").clone()
    }

    /// Our view's replicas alone (no copy of the rest of the catalog, its
    /// input writes among it).
    pub fn replicas(&self) -> BTreeMap<u64, Replica> {
        self.view.lock().expect("poisoned").replicas.clone()
    }

    /// Why we halted, if we did.
    pub fn halted(&self) -> Option<String> {
        self.halt.borrow().clone()
    }

    /// Resolves once this environment has halted, with the reason.
    pub async fn wait_halted(&self) -> String {
        let mut rx = self.halt.subscribe();
        loop {
            if let Some(reason) = rx.borrow_and_update().clone() {
                return reason;
            }
            if rx.changed().await.is_err() {
                // The sender lives as long as `self`; unreachable in practice.
                std::future::pending::<()>().await;
            }
        }
    }

    /// Marks this environment halted and returns the error to propagate.
    fn halt(&self, reason: String) -> EnvError {
        halt_with(&self.halt, self.epoch, reason)
    }

    /// Whether the API serves (see the field `api_serving`), and is not
    /// halted.
    pub fn api_serving(&self) -> bool {
        self.api_serving.load(std::sync::atomic::Ordering::Relaxed) && self.halt.borrow().is_none()
    }

    fn check_not_halted(&self) -> Result<(), EnvError> {
        match self.halted() {
            Some(reason) => Err(EnvError::Halted(reason)),
            None => Ok(()),
        }
    }

    fn catalog_error(&self, e: WriteError) -> EnvError {
        match e.fenced() {
            Some(f) => self.halt(f.to_string()),
            None => EnvError::Catalog(e),
        }
    }

    fn ensure_error(&self, e: EnsureError) -> EnvError {
        match e {
            EnsureError::StaleEpoch { .. } | EnsureError::DroppedByNewer { .. } => {
                self.halt(e.to_string())
            }
            other => EnvError::Orchestrator(other.to_string()),
        }
    }
}

/// Marks an environment halted through its halt channel and returns the
/// error to propagate.
fn halt_with(halt: &watch::Sender<Option<String>>, epoch: u64, reason: String) -> EnvError {
    tracing::error!(epoch, %reason, "another controller took over: halting");
    halt.send_if_modified(|h| {
        if h.is_none() {
            *h = Some(reason.clone());
            true
        } else {
            false
        }
    });
    EnvError::Halted(reason)
}

/// Whether `program` names an executable file (a path, or a name in `PATH`).
fn program_exists(program: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    let executable = |p: &Path| {
        std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    };
    if program.components().count() > 1 || program.is_absolute() {
        return executable(program);
    }
    std::env::var_os("PATH").is_some_and(|paths| {
        std::env::split_paths(&paths).any(|dir| executable(&dir.join(program)))
    })
}
