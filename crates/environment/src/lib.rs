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
//! # Failpoints
//!
//! With the cargo feature `failpoints`, the create and drop paths carry
//! failpoints (the `fail` crate, configured by the `FAILPOINTS` environment
//! variable, e.g. `FAILPOINTS=after_catalog_drop_replica=panic`):
//! `before_catalog_create_replica`, `after_catalog_create_replica`,
//! `after_orchestrator_create_replica`, and the same three for
//! `drop_replica`. The `lockstep` binary turns a panic into an abort, so a
//! `panic` action crashes the whole controller as a real crash would.

pub mod admission;
pub mod compute;
mod inputs;
pub mod metrics;
pub mod policies;
pub mod rpc_metrics;
pub mod server;
pub mod template;

/// The generated gRPC types and services of `lockstep.environment.v1`.
#[allow(missing_docs, clippy::all)]
pub mod proto {
    tonic::include_proto!("lockstep.environment.v1");

    /// The encoded descriptor set of the API and the compute protocol it
    /// imports, served by gRPC reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] =
        include_bytes!(concat!(env!("OUT_DIR"), "/environment_descriptor.bin"));
}

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use lockstep_catalog::{Catalog, CatalogState, Replica, ReplicaConfig, Store, WriteError};
use lockstep_command_log::LogLocation;
use lockstep_orchestrator::process::{ProcessOrchestrator, ProcessOrchestratorConfig};
use lockstep_orchestrator::{EnsureError, Orchestrator, ServiceStatus};
use lockstep_policy::{CatalogView, OrphanDecision, OrphanPolicy, PolicyError, Service};
use tokio::sync::watch;

pub use compute::REPLICA_RESTART_INTERVAL;
pub use template::ServiceTemplate;

/// Concurrent streams (and calls) one API connection may have open.
pub const API_MAX_STREAMS: u32 = 256;

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
    use std::io::{Read, Write};
    use std::os::unix::fs::OpenOptionsExt;
    let path = dir.join(SESSION_SECRET_FILE);
    match std::fs::read(&path) {
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
            std::fs::File::open("/dev/urandom")?.read_exact(&mut secret)?;
            let tmp = dir.join(format!("{SESSION_SECRET_FILE}.{}", std::process::id()));
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&tmp)?;
            f.write_all(&secret)?;
            f.sync_all()?;
            // Two environments starting at once: the first link wins, and
            // both read what it wrote.
            if std::fs::hard_link(&tmp, &path).is_err() && !path.exists() {
                std::fs::remove_file(&tmp)?;
                return Err(std::io::Error::other(format!(
                    "cannot create {}",
                    path.display()
                )));
            }
            std::fs::remove_file(&tmp)?;
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

/// Why [`Environment::serve_until`] stops serving.
#[derive(Clone, Copy, Debug)]
enum Stop {
    /// Another controller took over (O3).
    Halted,
    /// The caller's shutdown signal.
    Shutdown,
}

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
    /// Other users can write the state directory.
    #[error("state directory {path} is writable by other users (mode {mode:o}); it holds the replicas' secrets: chmod go-w it, or use a directory only you can write")]
    StateDirUnsafe {
        /// The directory.
        path: PathBuf,
        /// Its permission bits.
        mode: u32,
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
    inputs: Mutex<inputs::Inputs>,
    /// The view's dataflow descriptions, decoded (kept in step with the
    /// view by `dataflows_of`).
    decoded: Mutex<BTreeMap<u64, Arc<lockstep_protocol::DataflowDescription>>>,
    orchestrator: Arc<dyn Orchestrator>,
    policy: Mutex<Box<dyn OrphanPolicy + Send>>,
    template: ServiceTemplate,
    epoch: u64,
    halt: watch::Sender<Option<String>>,
    orphans_removed: Mutex<Vec<String>>,
    /// Serializes mutations and orphan removal, so that a background orphan
    /// removal never classifies against a half-applied create or drop.
    ops: tokio::sync::Mutex<()>,
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
}

impl std::fmt::Debug for Environment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Environment")
            .field("epoch", &self.epoch)
            .field("template", &self.template)
            .finish_non_exhaustive()
    }
}

/// Checks that `dir` exists, is a directory and is writable (by creating and
/// removing a probe file).
pub fn check_state_dir(dir: &Path) -> Result<(), StartError> {
    match std::fs::metadata(dir) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => return Err(StartError::StateDirNotADirectory(dir.to_path_buf())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(StartError::StateDirMissing(dir.to_path_buf()))
        }
        Err(source) => {
            return Err(StartError::StateDirUnwritable {
                path: dir.to_path_buf(),
                source,
            })
        }
    }
    // The directory holds the master secret and every replica's key: a
    // directory other users can write lets them replace or move those.
    if let Ok(m) = std::fs::metadata(dir) {
        use std::os::unix::fs::PermissionsExt;
        let mode = m.permissions().mode() & 0o777;
        if mode & 0o022 != 0 {
            return Err(StartError::StateDirUnsafe {
                path: dir.to_path_buf(),
                mode,
            });
        }
    }
    let probe = dir.join(format!(".lockstep-probe-{}", std::process::id()));
    std::fs::write(&probe, b"probe")
        .and_then(|_| std::fs::remove_file(&probe))
        .map_err(|source| StartError::StateDirUnwritable {
            path: dir.to_path_buf(),
            source,
        })
}

impl Environment {
    /// Step 1: checks the state directory and the service binary, opens the
    /// catalog (bumping the epoch) and loads it, and creates the process
    /// orchestrator on `STATE_DIR/orchestrator` with our epoch.
    pub fn load(config: EnvironmentConfig) -> Result<Environment, StartError> {
        Self::load_with(config, Box::new(process_orchestrator))
    }

    /// [`load`](Self::load) with another orchestrator backend, built by
    /// `orchestrator` once the catalog's epoch is known (the Kubernetes
    /// backend, in `lockstep serve --orchestrator kubernetes` and the
    /// `@kubernetes` orphan scenarios).
    pub fn load_with(
        config: EnvironmentConfig,
        orchestrator: OrchestratorFactory,
    ) -> Result<Environment, StartError> {
        Self::load_with_secret(config, orchestrator, None)
    }

    /// [`load_with`](Self::load_with), with the master secret of the
    /// replicas' session keys given (`Some`: e.g. read from a Kubernetes
    /// Secret, as the state directory of a pod does not outlive it) instead
    /// of read from the state directory's [`SESSION_SECRET_FILE`] (`None`).
    pub fn load_with_secret(
        config: EnvironmentConfig,
        orchestrator: OrchestratorFactory,
        master_secret: Option<[u8; 32]>,
    ) -> Result<Environment, StartError> {
        check_state_dir(&config.state_dir)?;
        if !program_exists(&config.service.program) {
            return Err(StartError::ServiceBinaryMissing(config.service.program));
        }
        let store = Store::from_arg(config.store.as_deref(), config.state_dir.join(CATALOG_FILE))
            .map_err(StartError::Store)?;
        let catalog = Catalog::open_store(&store)?;
        let orchestrator = orchestrator(OrchestratorParams {
            state_dir: &config.state_dir,
            epoch: catalog.epoch(),
            conditional_writes: config.conditional_writes,
        })?;
        let command_logs = match &store {
            Store::Postgres(url) => CommandLogs::Postgres(url.clone()),
            Store::Sqlite(_) => CommandLogs::Dir(
                std::path::absolute(config.state_dir.join(COMMAND_LOG_DIR))
                    .and_then(|dir| std::fs::create_dir_all(&dir).map(|()| dir))
                    .map_err(|source| StartError::StateDirUnwritable {
                        path: config.state_dir.join(COMMAND_LOG_DIR),
                        source,
                    })?,
            ),
        };
        let secret = match master_secret {
            Some(secret) => secret,
            None => session_secret(&config.state_dir).map_err(|source| {
                StartError::StateDirUnwritable {
                    path: config.state_dir.join(SESSION_SECRET_FILE),
                    source,
                }
            })?,
        };
        let env =
            Self::with_orchestrator(catalog, orchestrator, config.orphan_policy, config.service)?
                .with_command_logs(command_logs)
                .with_session_secret(secret)
                .with_api_token(config.api_token);
        if let Some(path) = &config.distribution_policy {
            let wasm = std::fs::read(path).unwrap_or_default();
            env.policies_in_force.lock().expect("poisoned").insert(
                "distribution".into(),
                policies::PolicyInForce {
                    kind: "distribution".into(),
                    name: lockstep_policy_host::policy_name(path),
                    hash: policies::short_hash(&wasm),
                    since: 0,
                    replica: None,
                },
            );
        }
        env.compute
            .set_distribution_policy(config.distribution_policy);
        env.compute.set_max_frame_len(config.max_frame_len);
        env.compute.set_naive_allowed(config.allow_naive);
        env.inputs
            .lock()
            .expect("poisoned")
            .set_lag(config.compaction_lag);
        let mut env = env;
        env.policies_dir = Some(config.state_dir.join("policies"));
        env.restore_policies()
            .map_err(|e| StartError::PolicyRestore(e.to_string()))?;
        Ok(env)
    }

    /// Step 1 with any orchestrator backend: loads the already opened
    /// `catalog`. The orchestrator must label with the catalog's epoch.
    pub fn with_orchestrator(
        mut catalog: Catalog,
        orchestrator: Arc<dyn Orchestrator>,
        orphan_policy: Box<dyn OrphanPolicy + Send>,
        template: ServiceTemplate,
    ) -> Result<Environment, StartError> {
        let orphan_rule_name = orphan_policy.name().to_string();
        let mut view = catalog.state()?;
        let inputs = inputs::Inputs::load(
            std::mem::take(&mut view.input_writes)
                .into_iter()
                .map(|w| {
                    compute::decode_write(&w.write)
                        .map(|write| (w.replica_id, write))
                        .map_err(|e| StartError::CorruptInput {
                            seq: w.seq,
                            replica_id: w.replica_id,
                            reason: e.to_string(),
                        })
                })
                .collect::<Result<Vec<_>, _>>()?,
            None,
        );
        let epoch = catalog.epoch();
        if orchestrator.epoch() != epoch {
            return Err(StartError::EpochMismatch {
                catalog: epoch,
                orchestrator: orchestrator.epoch(),
            });
        }
        tracing::info!(
            epoch,
            replicas = view.replicas.len(),
            next_replica_id = view.next_replica_id,
            rule = orphan_policy.name(),
            "catalog loaded"
        );
        let compute = compute::Compute::default();
        compute.metrics().epoch.set(epoch as i64);
        Ok(Environment {
            catalog: Arc::new(Mutex::new(catalog)),
            view: Arc::new(Mutex::new(view)),
            inputs: Mutex::new(inputs),
            decoded: Mutex::new(BTreeMap::new()),
            orchestrator,
            policy: Mutex::new(orphan_policy),
            template,
            epoch,
            halt: watch::channel(None).0,
            orphans_removed: Mutex::new(Vec::new()),
            ops: tokio::sync::Mutex::new(()),
            compute,
            command_logs: None,
            session_secret: None,
            api_token: None,
            max_answer_bytes: std::sync::atomic::AtomicUsize::new(server::MAX_ANSWER_BYTES),
            policies_dir: None,
            replica_policies_in_force: Mutex::new(BTreeMap::new()),
            policies_in_force: Mutex::new(BTreeMap::from([
                (
                    "distribution".to_string(),
                    policies::PolicyInForce {
                        kind: "distribution".into(),
                        name: "native barrier".into(),
                        hash: String::new(),
                        since: 0,
                        replica: None,
                    },
                ),
                (
                    "orphans".to_string(),
                    policies::PolicyInForce {
                        kind: "orphans".into(),
                        name: orphan_rule_name,
                        hash: String::new(),
                        since: 0,
                        replica: None,
                    },
                ),
            ])),
        })
    }

    /// Turns off the replica restarts that controller events trigger (a
    /// silent process, lost lockstep, a history mismatch): for the negative
    /// control of the seeded campaign only (`lockstep serve
    /// --experiments-no-replica-restarts`).
    pub fn set_replica_restarts(&self, on: bool) {
        self.compute.set_replica_restarts(on);
    }

    /// Sets the largest answer the API sends (default
    /// [`server::MAX_ANSWER_BYTES`], what the `lockstep` CLI accepts): a peek
    /// whose answer is larger is refused with RESOURCE_EXHAUSTED, naming the
    /// limit, instead of failing in the client. `lockstep serve
    /// --max-answer-bytes` (hidden) lowers it for tests.
    pub fn set_max_answer_bytes(&self, bytes: usize) {
        self.max_answer_bytes
            .store(bytes, std::sync::atomic::Ordering::Relaxed);
    }

    /// The largest answer the API sends.
    pub fn max_answer_bytes(&self) -> usize {
        self.max_answer_bytes
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Asks every API call for `token` (`authorization: Bearer TOKEN`).
    pub fn with_api_token(mut self, token: Option<String>) -> Self {
        self.api_token = token;
        self
    }

    /// Gives every replica a session key derived from `secret`: its
    /// processes get it in their environment, its controller proves it in
    /// every Hello, and a Hello without the proof is refused (S1).
    /// [`load`](Self::load) uses the state directory's
    /// [`SESSION_SECRET_FILE`]. Call it before ensuring replicas: the key is
    /// part of each replica's service spec.
    pub fn with_session_secret(mut self, secret: [u8; 32]) -> Self {
        self.session_secret = Some(secret);
        self
    }

    /// The session key of replica `replica_id`, if replicas have keys.
    pub fn session_key(&self, replica_id: u64) -> Option<lockstep_protocol::SessionKey> {
        self.session_secret
            .as_ref()
            .map(|s| lockstep_protocol::SessionKey::derive(s, replica_id))
    }

    /// Gives every replica a command log: `DIR/replica-N.sqlite` in a
    /// directory (which must exist), or the log `replica-N` in a PostgreSQL
    /// database; passed to the replica's processes and to its controller, so
    /// that the `log` strategy can be used. [`load`](Self::load) uses
    /// `STATE_DIR/command-logs`, or the `--store` database; without this the
    /// replicas have no command log and a `log` choice falls back to
    /// `barrier`. Call it before ensuring replicas: the location is part of
    /// each replica's service spec.
    pub fn with_command_logs(mut self, logs: CommandLogs) -> Self {
        self.command_logs = Some(logs);
        self
    }

    /// The command log of replica `replica_id`, if replicas have command logs.
    pub fn command_log(&self, replica_id: u64) -> Option<LogLocation> {
        self.command_logs.as_ref().map(|logs| match logs {
            CommandLogs::Dir(dir) => {
                LogLocation::Sqlite(dir.join(format!("replica-{replica_id}.sqlite")))
            }
            CommandLogs::Postgres(url) => LogLocation::Postgres {
                url: url.clone(),
                name: format!("replica-{replica_id}"),
            },
        })
    }

    /// The orchestrator service of a replica: the template's command line,
    /// plus the replica's command log.
    fn service_config(&self, replica: &Replica) -> lockstep_orchestrator::ServiceConfig {
        let config = self.template.service_config(replica);
        let config = match self.command_log(replica.id) {
            Some(location) => lockstep_controller::launch::with_command_log(config, &location),
            None => config,
        };
        let config =
            lockstep_controller::launch::with_max_frame_len(config, self.compute.max_frame_len());
        match self.session_key(replica.id) {
            Some(key) => lockstep_controller::launch::with_session_key(config, &key),
            None => config,
        }
    }

    /// Steps 1 to 3: load, ensure every catalog replica, remove orphans.
    /// Ready to [`serve`](Self::serve) afterwards.
    pub async fn start(config: EnvironmentConfig) -> anyhow::Result<Arc<Environment>> {
        Self::start_with(config, Box::new(process_orchestrator)).await
    }

    /// [`start`](Self::start) with the orchestrator built by `orchestrator`
    /// (see [`load_with`](Self::load_with)).
    pub async fn start_with(
        config: EnvironmentConfig,
        orchestrator: OrchestratorFactory,
    ) -> anyhow::Result<Arc<Environment>> {
        Self::start_with_secret(config, orchestrator, None).await
    }

    /// [`start_with`](Self::start_with) with the master secret given (see
    /// [`load_with_secret`](Self::load_with_secret)): `lockstep serve
    /// --orchestrator kubernetes` passes the one kept in the cluster.
    pub async fn start_with_secret(
        config: EnvironmentConfig,
        orchestrator: OrchestratorFactory,
        master_secret: Option<[u8; 32]>,
    ) -> anyhow::Result<Arc<Environment>> {
        let env = Environment::load_with_secret(config, orchestrator, master_secret)?;
        env.ensure_replicas().await?;
        env.remove_orphans().await?;
        env.start_compute().await?;
        Ok(Arc::new(env))
    }

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

    /// Step 2: ensures the service of every replica in our catalog view,
    /// adopting running processes. A refused (stale) ensure halts.
    pub async fn ensure_replicas(&self) -> Result<(), EnvError> {
        // Check after taking the lock: the operation before us may have halted us.
        let _ops = self.ops.lock().await;
        self.check_not_halted()?;
        let replicas: Vec<Replica> = self.view().replicas.into_values().collect();
        for replica in replicas {
            let config = self.service_config(&replica);
            match self.orchestrator.ensure_service(config).await {
                Ok(status) => {
                    tracing::info!(replica = %replica.name, service = %status.name, "ensured")
                }
                Err(e @ (EnsureError::StaleEpoch { .. } | EnsureError::DroppedByNewer { .. })) => {
                    return Err(self.ensure_error(e))
                }
                // The replica stays wanted; the error is for the operator.
                Err(e) => tracing::error!(replica = %replica.name, "could not ensure: {e}"),
            }
        }
        Ok(())
    }

    /// Ensures every catalog replica that has no controller (its ensure
    /// failed after the catalog write, at creation or at start) and starts
    /// its controller; returns how many it started. Runs in the background
    /// ([`spawn_replica_retry`](Self::spawn_replica_retry)).
    pub async fn ensure_unserved(&self) -> Result<usize, EnvError> {
        let _ops = self.ops.lock().await;
        self.check_not_halted()?;
        let unserved: Vec<Replica> = self
            .view
            .lock()
            .expect("poisoned")
            .replicas
            .values()
            .filter(|r| self.compute.controller(r.id).is_none())
            .cloned()
            .collect();
        let mut started = 0;
        for replica in unserved {
            match self
                .orchestrator
                .ensure_service(self.service_config(&replica))
                .await
            {
                Ok(status) => {
                    tracing::info!(replica = %replica.name, "ensured on a retry; driving it");
                    self.compute_started(&replica, &status);
                    started += 1;
                }
                Err(e @ (EnsureError::StaleEpoch { .. } | EnsureError::DroppedByNewer { .. })) => {
                    return Err(self.ensure_error(e))
                }
                Err(e) => tracing::warn!(replica = %replica.name, "still cannot ensure: {e}"),
            }
        }
        Ok(started)
    }

    /// Runs [`ensure_unserved`](Self::ensure_unserved) every `every` until
    /// this environment halts.
    pub fn spawn_replica_retry(
        self: &Arc<Self>,
        every: std::time::Duration,
    ) -> tokio::task::JoinHandle<()> {
        self.spawn_every(every, |env| async move {
            env.ensure_unserved()
                .await
                .map(|_| ())
                .map_err(|e| (e, "retrying replicas"))
        })
    }

    /// Runs `task` every `every` until this environment halts; other errors
    /// are logged with their label.
    fn spawn_every<F, Fut>(
        self: &Arc<Self>,
        every: std::time::Duration,
        task: F,
    ) -> tokio::task::JoinHandle<()>
    where
        F: Fn(Arc<Self>) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = Result<(), (EnvError, &'static str)>> + Send,
    {
        let me = self.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                match task(me.clone()).await {
                    Ok(()) => {}
                    Err((EnvError::Halted(_), _)) => return,
                    Err((e, what)) => tracing::warn!("{what} failed: {e}"),
                }
            }
        })
    }

    /// Step 3: lists the services and lets the orphan policy delete orphans
    /// or halt us. A failing or nonsensical policy deletes nothing.
    pub async fn remove_orphans(&self) -> Result<OrphanReport, EnvError> {
        // Check after taking the lock: the operation before us may have halted us.
        let _ops = self.ops.lock().await;
        self.check_not_halted()?;
        let services = self
            .orchestrator
            .list_services()
            .await
            .map_err(|e| EnvError::Orchestrator(e.to_string()))?;
        let view = {
            let v = self.view.lock().expect("poisoned");
            CatalogView {
                keep: v.replicas.keys().copied().collect(),
                our_epoch: self.epoch,
                next_id: v.next_replica_id,
            }
        };
        let listed: Vec<Service> = services
            .iter()
            .map(|s| Service {
                id: s.id,
                name: s.name.clone(),
                epoch: s.epoch,
                labels: s.labels.clone(),
            })
            .collect();
        let decision = {
            let mut policy = self.policy.lock().expect("poisoned");
            let name = policy.name().to_string();
            policy
                .classify(&listed, &view)
                .and_then(|d| check_decision(&name, d, &listed, &view))
        };
        let mut report = OrphanReport::default();
        match decision {
            Ok(OrphanDecision::Halt(reason)) => return Err(self.halt(reason)),
            Err(e) => {
                tracing::error!("orphan policy gave no usable answer, deleting nothing: {e}");
                report.policy_error = Some(e.to_string());
            }
            Ok(OrphanDecision::Delete(ids)) => {
                for s in services.iter().filter(|s| ids.contains(&s.id)) {
                    tracing::info!(service = %s.name, id = s.id, epoch = s.epoch, "removing orphan");
                    self.orchestrator
                        .drop_service(&s.name)
                        .await
                        .map_err(|e| EnvError::Orchestrator(e.to_string()))?;
                    report.deleted.push(s.name.clone());
                }
            }
        }
        self.orphans_removed
            .lock()
            .expect("poisoned")
            .extend(report.deleted.iter().cloned());
        Ok(report)
    }

    /// Creates a replica: catalog transaction, then the orchestrator call.
    pub async fn create_replica(
        &self,
        name: &str,
        config: ReplicaConfig,
    ) -> Result<ReplicaInfo, EnvError> {
        // Check after taking the lock: the operation before us may have halted us.
        let _ops = self.ops.lock().await;
        self.check_not_halted()?;
        fail::fail_point!("before_catalog_create_replica");
        let replica = {
            let mut catalog = self.catalog.lock().expect("poisoned");
            let replica = catalog
                .create_replica(name, config)
                .map_err(|e| self.catalog_error(e))?;
            let mut view = self.view.lock().expect("poisoned");
            view.replicas.insert(replica.id, replica.clone());
            view.next_replica_id = view.next_replica_id.max(replica.id + 1);
            replica
        };
        fail::fail_point!("after_catalog_create_replica");
        let status = self
            .orchestrator
            .ensure_service(self.service_config(&replica))
            .await
            .map_err(|e| self.ensure_error(e))?;
        fail::fail_point!("after_orchestrator_create_replica");
        self.compute_started(&replica, &status);
        tracing::info!(replica = %replica.name, id = replica.id, "created");
        Ok(ReplicaInfo {
            replica,
            service: Some(status),
        })
    }

    /// Drops a replica: catalog transaction, then the orchestrator call.
    pub async fn drop_replica(&self, name: &str) -> Result<Replica, EnvError> {
        // Check after taking the lock: the operation before us may have halted us.
        let _ops = self.ops.lock().await;
        self.check_not_halted()?;
        fail::fail_point!("before_catalog_drop_replica");
        let replica = {
            let mut catalog = self.catalog.lock().expect("poisoned");
            let replica = catalog
                .drop_replica(name)
                .map_err(|e| self.catalog_error(e))?;
            let mut view = self.view.lock().expect("poisoned");
            view.replicas.remove(&replica.id);
            view.dataflows.retain(|_, d| d.replica_id != replica.id);
            self.inputs
                .lock()
                .expect("poisoned")
                .drop_replica(replica.id);
            replica
        };
        fail::fail_point!("after_catalog_drop_replica");
        self.compute_stopped(replica.id);
        // Its own policy went with it in the catalog.
        self.compute
            .set_replica_distribution_policy(replica.id, None);
        self.replica_policies_in_force
            .lock()
            .expect("poisoned")
            .remove(&replica.id);
        self.orchestrator
            .drop_service(&ServiceTemplate::service_name(replica.id))
            .await
            .map_err(|e| EnvError::Orchestrator(e.to_string()))?;
        fail::fail_point!("after_orchestrator_drop_replica");
        // Its command log goes too (nothing reads it once its processes are
        // gone; a leftover is only disk).
        if let Some(log) = self.command_log(replica.id) {
            if let Err(e) = log.remove(self.epoch()) {
                tracing::warn!(%log, error = %e, "a dropped replica's command log was left");
            }
        }
        tracing::info!(replica = %replica.name, id = replica.id, "dropped");
        Ok(replica)
    }

    /// Lists our catalog's replicas with their services' status.
    pub async fn list_replicas(&self) -> Result<Vec<ReplicaInfo>, EnvError> {
        self.check_not_halted()?;
        let mut services: BTreeMap<u64, ServiceStatus> = self
            .orchestrator
            .list_services()
            .await
            .map_err(|e| EnvError::Orchestrator(e.to_string()))?
            .into_iter()
            .map(|s| (s.id, s))
            .collect();
        Ok(self
            .view()
            .replicas
            .into_values()
            .map(|replica| ReplicaInfo {
                service: services.remove(&replica.id),
                replica,
            })
            .collect())
    }

    /// Runs [`remove_orphans`](Self::remove_orphans) every `every` in the
    /// background (O2: orphans left by a crash of another controller go
    /// without waiting for our restart). Stops when we halt; a policy that
    /// says halt halts us, which stops [`serve`](Self::serve).
    pub fn spawn_orphan_removal(
        self: &Arc<Self>,
        every: std::time::Duration,
    ) -> tokio::task::JoinHandle<()> {
        self.spawn_every(every, |env| async move {
            let report = env
                .remove_orphans()
                .await
                .map_err(|e| (e, "background orphan removal"))?;
            if !report.deleted.is_empty() {
                tracing::info!(deleted = ?report.deleted, "background orphan removal");
            }
            Ok(())
        })
    }

    /// Step 4: serves the gRPC API on `listener` until this environment
    /// halts, which is returned as [`EnvError::Halted`]. In-flight requests
    /// are answered before it returns.
    pub async fn serve(self: Arc<Self>, listener: tokio::net::TcpListener) -> Result<(), EnvError> {
        self.serve_with(listener, None).await
    }

    /// [`serve`](Self::serve), with TLS when `tls` is given.
    pub async fn serve_with(
        self: Arc<Self>,
        listener: tokio::net::TcpListener,
        tls: Option<tonic::transport::ServerTlsConfig>,
    ) -> Result<(), EnvError> {
        self.serve_until(listener, tls, std::future::pending(), HALT_GRACE)
            .await
    }

    /// [`serve_with`](Self::serve_with) until `shutdown` resolves (the
    /// `lockstep` binary: SIGTERM or SIGINT), then shuts down gracefully:
    ///
    /// 1. grpc.health.v1 says NOT_SERVING at once, for the server (`""`)
    ///    and the API service, so a watch or a probe sees it;
    /// 2. the listener closes (a new connection is refused) and every open
    ///    connection is told to go away (HTTP/2 GOAWAY: a call the client
    ///    sent before it learnt that is still served, a later one is refused);
    /// 3. calls in flight get up to `grace` to finish; whatever is still open
    ///    then is cut;
    /// 4. it returns `Ok(())`. Replica processes (or pods) are left running,
    ///    for the next environment to adopt.
    ///
    /// A halt still returns [`EnvError::Halted`], after [`HALT_GRACE`].
    pub async fn serve_until(
        self: Arc<Self>,
        listener: tokio::net::TcpListener,
        tls: Option<tonic::transport::ServerTlsConfig>,
        shutdown: impl std::future::Future<Output = ()> + Send + 'static,
        grace: std::time::Duration,
    ) -> Result<(), EnvError> {
        // Bounded acceptance (`admission`): a cap on open connections, a
        // deadline for a silent one, the oldest silent one closed first, an
        // accept loop that backs off on EMFILE. TCP_NODELAY is set on each
        // (without it a small response waits for the client's delayed ACK).
        let incoming = tokio_stream::wrappers::ReceiverStream::new(admission::accept(
            listener,
            admission::Limits::default(),
            "api",
        ));
        // Log every service event (crashes, restarts) while we serve.
        let mut events = self.orchestrator.watch_services();
        let logger = tokio::spawn(async move {
            use tokio::sync::broadcast::error::RecvError;
            loop {
                match events.recv().await {
                    Ok(e) => {
                        tracing::info!(service = %e.service, process = ?e.process, event = ?e.kind, "service event")
                    }
                    Err(RecvError::Lagged(n)) => {
                        tracing::warn!("{n} service events were not logged")
                    }
                    Err(RecvError::Closed) => return,
                }
            }
        });
        // grpc.health.v1: the API, and each replica as `replica/NAME`,
        // serving while it answers a ping.
        let (health, health_service) = tonic_health::server::health_reporter();
        health
            .set_serving::<proto::environment_server::EnvironmentServer<server::EnvironmentService>>()
            .await;
        let checker = tokio::spawn(self.clone().report_replica_health(health.clone()));
        // What stops the server: a halt, or `shutdown` (health turns
        // NOT_SERVING first). `stopping` says which, once one happened.
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(None::<Stop>);
        let me = self.clone();
        let stopper = tokio::spawn(async move {
            let why = tokio::select! {
                _ = me.wait_halted() => Stop::Halted,
                () = shutdown => {
                    health
                        .set_not_serving::<proto::environment_server::EnvironmentServer<server::EnvironmentService>>()
                        .await;
                    health
                        .set_service_status("", tonic_health::ServingStatus::NotServing)
                        .await;
                    tracing::info!(grace = ?grace, "shutting down: health NOT_SERVING, no new calls, in-flight calls get the grace period");
                    Stop::Shutdown
                }
            };
            let _ = stop_tx.send(Some(why));
        });
        let stopped = |mut rx: tokio::sync::watch::Receiver<Option<Stop>>| async move {
            let why = rx.wait_for(Option::is_some).await.map(|why| *why);
            match why {
                Ok(Some(why)) => why,
                // The stopper ended without a reason: never.
                _ => std::future::pending().await,
            }
        };
        let shutdown = {
            let rx = stop_rx.clone();
            async move {
                stopped(rx).await;
            }
        };
        // Server reflection, v1 and v1alpha, over the API, the compute
        // protocol and the health service.
        let reflection = || {
            tonic_reflection::server::Builder::configure()
                .register_encoded_file_descriptor_set(proto::FILE_DESCRIPTOR_SET)
                .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        };
        let reflection_v1 = reflection()
            .build_v1()
            .expect("the built-in descriptor sets decode");
        let reflection_v1alpha = reflection()
            .build_v1alpha()
            .expect("the built-in descriptor sets decode");
        // With a token, every API call must carry it; health and reflection
        // stay open (they say nothing about the replicas' data).
        let service = server::EnvironmentService::new(self.clone());
        let (open, guarded) = match &self.api_token {
            None => (Some(service.into_server()), None),
            Some(token) => (
                None,
                Some(tonic::service::interceptor::InterceptedService::new(
                    service.into_server(),
                    server::TokenCheck::new(token),
                )),
            ),
        };
        // Per connection: a bounded number of concurrent streams and calls,
        // and HTTP/2 keepalive so that dead peers are found.
        let mut builder = tonic::transport::Server::builder()
            .max_concurrent_streams(Some(API_MAX_STREAMS))
            .concurrency_limit_per_connection(API_MAX_STREAMS as usize)
            .http2_keepalive_interval(Some(std::time::Duration::from_secs(30)))
            .http2_keepalive_timeout(Some(std::time::Duration::from_secs(10)));
        if let Some(tls) = tls {
            builder = builder
                .tls_config(tls)
                .map_err(|e| EnvError::Orchestrator(format!("TLS configuration: {e}")))?;
        }
        let server = builder
            .layer(tower::util::MapRequestLayer::new(log_call))
            .layer(rpc_metrics::RpcMetricsLayer::new(self.metrics()))
            .add_optional_service(open)
            .add_optional_service(guarded)
            .add_service(health_service)
            .add_service(reflection_v1)
            .add_service(reflection_v1alpha)
            .serve_with_incoming_shutdown(incoming, shutdown);
        // Once halted or shut down, in-flight requests get a bounded grace
        // period.
        let grace = async move {
            let bound = match stopped(stop_rx).await {
                Stop::Halted => HALT_GRACE,
                Stop::Shutdown => grace,
            };
            tokio::time::sleep(bound).await;
        };
        let result = tokio::select! {
            r = server => r.map_err(|e| EnvError::Orchestrator(format!("gRPC server failed: {e}"))),
            () = grace => {
                tracing::warn!("the grace period ended with calls still open; they are cut");
                Ok(())
            }
        };
        logger.abort();
        checker.abort();
        stopper.abort();
        result?;
        match self.halted() {
            Some(reason) => Err(EnvError::Halted(reason)),
            None => Ok(()),
        }
    }
}

impl Environment {
    /// The controller of the replica named `name`, if one runs.
    pub fn replica_controller(&self, name: &str) -> Option<lockstep_controller::Controller> {
        let id = self
            .view
            .lock()
            .expect("poisoned")
            .replicas
            .values()
            .find(|r| r.name == name)?
            .id;
        self.compute.controller(id)
    }

    /// The environment's metrics (served by `lockstep serve --metrics-listen`).
    pub fn metrics(&self) -> Arc<metrics::Metrics> {
        self.compute.metrics()
    }

    /// Every [`HEALTH_INTERVAL`], sets each replica's health (`replica/NAME`)
    /// to SERVING if its controller answered a ping within the interval,
    /// NOT_SERVING otherwise; a dropped replica's status is cleared.
    async fn report_replica_health(
        self: Arc<Self>,
        mut health: tonic_health::server::HealthReporter,
    ) {
        use tonic_health::ServingStatus;
        let mut known: std::collections::BTreeSet<String> = Default::default();
        loop {
            let replicas: Vec<Replica> = self
                .view
                .lock()
                .expect("poisoned")
                .replicas
                .values()
                .cloned()
                .collect();
            let mut now = std::collections::BTreeSet::new();
            for r in replicas {
                let controller = self.compute.controller(r.id);
                let answered = match &controller {
                    Some(c) => matches!(
                        tokio::time::timeout(HEALTH_INTERVAL, c.ping()).await,
                        Ok(Ok(()))
                    ),
                    None => false,
                };
                let lags = match &controller {
                    Some(c) => tokio::time::timeout(HEALTH_INTERVAL, c.process_lags())
                        .await
                        .ok()
                        .and_then(Result::ok),
                    None => None,
                }
                .unwrap_or_else(|| vec![None; r.config.processes as usize]);
                let name = format!("replica/{}", r.name);
                let status = if answered {
                    ServingStatus::Serving
                } else {
                    ServingStatus::NotServing
                };
                health.set_service_status(&name, status).await;
                now.insert(name);
                let metrics = self.metrics();
                let label = metrics::ReplicaLabel {
                    replica: r.name.clone(),
                };
                metrics.serving.get_or_create(&label).set(answered as i64);
                for (i, lag) in lags.into_iter().enumerate() {
                    let labels = metrics::ProcessLabels {
                        replica: r.name.clone(),
                        process: i.to_string(),
                    };
                    match lag {
                        Some(lag) => {
                            metrics
                                .frontier_lag
                                .get_or_create(&labels)
                                .set(i64::try_from(lag).unwrap_or(i64::MAX));
                        }
                        None => {
                            metrics.frontier_lag.remove(&labels);
                        }
                    }
                }
                metrics
                    .stored_updates
                    .get_or_create(&label)
                    .set(self.inputs.lock().expect("poisoned").stored_updates(r.id) as i64);
                let dataflows = self
                    .view
                    .lock()
                    .expect("poisoned")
                    .dataflows
                    .values()
                    .filter(|d| d.replica_id == r.id)
                    .count();
                metrics
                    .dataflows
                    .get_or_create(&label)
                    .set(dataflows as i64);
            }
            for gone in known.difference(&now) {
                health.clear_service_status(gone).await;
            }
            known = now;
            tokio::time::sleep(HEALTH_INTERVAL).await;
        }
    }
}

/// Logs (at debug) every call as it arrives, before it is routed or its
/// token checked: what was in flight when something happened.
fn log_call<B>(request: http::Request<B>) -> http::Request<B> {
    tracing::debug!(path = %request.uri().path(), "API call received");
    request
}

/// How often replica health is checked, and how long a ping may take.
const HEALTH_INTERVAL: std::time::Duration = std::time::Duration::from_secs(1);

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

/// Refuses answers that make no sense: IDs that were not listed, or that our
/// catalog holds (deleting a wanted service is never an orphan removal).
fn check_decision(
    policy: &str,
    decision: OrphanDecision,
    listed: &[Service],
    view: &CatalogView,
) -> Result<OrphanDecision, PolicyError> {
    if let OrphanDecision::Delete(ids) = &decision {
        for id in ids {
            if !listed.iter().any(|s| s.id == *id) {
                return Err(PolicyError::Nonsense {
                    policy: policy.to_string(),
                    reason: format!("asked to delete ID {id}, which was not listed"),
                });
            }
            if view.keep.contains(id) {
                return Err(PolicyError::Nonsense {
                    policy: policy.to_string(),
                    reason: format!("asked to delete ID {id}, which our catalog holds"),
                });
            }
        }
    }
    Ok(decision)
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
