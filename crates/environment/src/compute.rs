//! The compute side of the environment: one [`Controller`] per replica,
//! rehydrated from the catalog.
//!
//! The catalog is the truth for what a replica should compute: its dataflows
//! (encoded `DataflowDescription`s) and every write to its input collections
//! (encoded `WriteInput`s, recorded before they are sent). A restarted
//! environment rebuilds each replica's command history from the catalog and
//! hands it to a new controller, which connects to every process with a new
//! nonce; the replica keeps the dataflows that did not change and rebuilds
//! nothing else. Every compute mutation is, like the replica ones, a catalog
//! transaction followed by the call to the replica.
//!
//! Each controller's events are watched by a task of its own, which restarts
//! the replica through the orchestrator when the controller reports a silent
//! process or a process reports that it lost lockstep (see the crate docs).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lockstep_catalog::Replica;
use lockstep_controller::{launch, Controller, ControllerError, Event, Timeouts};
use lockstep_orchestrator::{Orchestrator, RestartError, ServiceStatus};
use lockstep_policy::{FixedStrategy, Strategy};
use lockstep_protocol::proto as wire;
use lockstep_protocol::{
    CommandHistory, CommandKind, DataflowDescription, ErrorKind, Export, Row, SubscribeBatch,
    Timestamp, Update, WriteInput,
};
use prost::Message;
use tokio::sync::{broadcast, mpsc, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::inputs::WriteRefused;
use crate::{EnvError, Environment, ServiceTemplate};

/// A replica is restarted through the orchestrator at most once per this
/// interval. A restart reason that comes sooner is checked again when the
/// interval has passed.
pub const REPLICA_RESTART_INTERVAL: Duration = Duration::from_secs(10);

/// How long a replica may take to answer a ping before a deferred restart
/// goes ahead.
const PING_BOUND: Duration = Duration::from_secs(5);

/// Why a compute request failed.
#[derive(Debug, thiserror::Error)]
pub enum ComputeError {
    /// The environment could not do it (halted, catalog refused, ...).
    #[error(transparent)]
    Env(#[from] EnvError),
    /// No replica with this name.
    #[error("no replica named {0:?}")]
    NoSuchReplica(String),
    /// No dataflow with this ID.
    #[error("no dataflow with ID {0}")]
    NoSuchDataflow(u64),
    /// No live dataflow of the replica exports this collection.
    #[error("no dataflow on replica {replica:?} exports collection {collection}")]
    NoSuchCollection {
        /// The replica.
        replica: String,
        /// The collection.
        collection: u64,
    },
    /// The request makes no sense.
    #[error("invalid request: {0}")]
    Invalid(String),
    /// A read below a collection's compaction frontier, a write below its
    /// upper, or a time no frontier can pass.
    #[error("{0}")]
    OutOfRange(String),
    /// The collection ID is taken on the replica.
    #[error("{0}")]
    AlreadyExists(String),
    /// The replica has no running controller (yet); nothing was written.
    #[error("{0}")]
    Unavailable(String),
    /// The replica's controller failed or timed out.
    #[error(transparent)]
    Controller(#[from] ControllerError),
    /// The catalog holds something this build cannot decode.
    #[error("catalog entry does not decode: {0}")]
    Corrupt(String),
    /// A replica process refused the dataflow's command as malformed; the
    /// dataflow was forgotten (catalog and history).
    #[error("{0}")]
    Refused(String),
}

/// How long `create_dataflow` waits to learn whether every replica process
/// took the dataflow's command (a ping answered after it) or refused it.
/// Past it, the dataflow stays created and is applied when the replica
/// answers; a refusal found later still removes it from the catalog.
pub const CREATE_OUTCOME_BOUND: Duration = Duration::from_secs(5);

/// The controllers of the replicas, by replica ID.
pub struct Compute {
    controllers: Mutex<BTreeMap<u64, Controller>>,
    /// The task watching each controller's events, by replica ID.
    watchers: Mutex<BTreeMap<u64, JoinHandle<()>>>,
    timeouts: Timeouts,
    distribution: Mutex<Option<std::path::PathBuf>>,
    /// Per-replica distribution policies, over `distribution`.
    replica_distribution: Mutex<BTreeMap<u64, std::path::PathBuf>>,
    restart_interval: Duration,
    /// The frame limit of every replica connection.
    max_frame_len: std::sync::atomic::AtomicUsize,
    /// The environment's metrics.
    metrics: Arc<crate::metrics::Metrics>,
    /// Whether a WASM distribution policy may choose `naive`.
    allow_naive: std::sync::atomic::AtomicBool,
    /// Whether controller events (a silent process, lost lockstep, a
    /// history mismatch) restart replicas: off only in the negative control
    /// of the seeded campaign.
    restarts: Arc<std::sync::atomic::AtomicBool>,
}

impl Drop for Compute {
    fn drop(&mut self) {
        // A watcher holds a controller handle; it must not outlive us.
        for (_, w) in std::mem::take(&mut *self.watchers.lock().expect("poisoned")) {
            w.abort();
        }
    }
}

/// What a replica's watcher needs to restart it: the orchestrator, and the
/// environment's halt channel (a newer controller's service is not ours to
/// restart: we halt).
pub(crate) struct Restarter {
    pub(crate) orchestrator: Arc<dyn Orchestrator>,
    pub(crate) halt: watch::Sender<Option<String>>,
    pub(crate) epoch: u64,
    /// The catalog and the view, to forget a dataflow a replica refused.
    pub(crate) catalog: Option<SharedCatalog>,
}

/// The environment's catalog and its view of it, shared.
pub(crate) type SharedCatalog = (
    Arc<Mutex<lockstep_catalog::Catalog>>,
    Arc<Mutex<lockstep_catalog::CatalogState>>,
);

/// Removes dataflow `id`, which a replica refused, from the catalog and the
/// view, if it is still there. Returns the error of a catalog that refused
/// the write (a fenced one halts the environment).
pub(crate) fn forget_refused(
    catalog: &Mutex<lockstep_catalog::Catalog>,
    view: &Mutex<lockstep_catalog::CatalogState>,
    halt: &watch::Sender<Option<String>>,
    epoch: u64,
    id: u64,
) -> Result<bool, EnvError> {
    if !view.lock().expect("poisoned").dataflows.contains_key(&id) {
        return Ok(false);
    }
    match catalog.lock().expect("poisoned").drop_dataflow(id) {
        Ok(()) | Err(lockstep_catalog::WriteError::NoSuchDataflow(_)) => {}
        Err(e) => {
            return Err(match e.fenced() {
                Some(f) => crate::halt_with(halt, epoch, f.to_string()),
                None => EnvError::Catalog(e),
            })
        }
    }
    view.lock().expect("poisoned").dataflows.remove(&id);
    Ok(true)
}

impl std::fmt::Debug for Compute {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ids: Vec<u64> = self
            .controllers
            .lock()
            .expect("poisoned")
            .keys()
            .copied()
            .collect();
        f.debug_struct("Compute").field("replicas", &ids).finish()
    }
}

impl Default for Compute {
    fn default() -> Self {
        Compute {
            controllers: Mutex::new(BTreeMap::new()),
            watchers: Mutex::new(BTreeMap::new()),
            timeouts: Timeouts::default(),
            distribution: Mutex::new(None),
            replica_distribution: Mutex::new(BTreeMap::new()),
            restart_interval: REPLICA_RESTART_INTERVAL,
            max_frame_len: lockstep_protocol::DEFAULT_MAX_FRAME_LEN.into(),
            metrics: Default::default(),
            allow_naive: false.into(),
            restarts: Arc::new(true.into()),
        }
    }
}

impl Compute {
    /// Sets the frame limit of replica connections started from now on.
    pub fn set_max_frame_len(&self, max_frame_len: usize) {
        self.max_frame_len
            .store(max_frame_len, std::sync::atomic::Ordering::Relaxed);
    }

    /// The environment's metrics.
    pub fn metrics(&self) -> Arc<crate::metrics::Metrics> {
        self.metrics.clone()
    }

    /// The frame limit of replica connections.
    pub fn max_frame_len(&self) -> usize {
        self.max_frame_len
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The controller of a replica, if one runs.
    pub fn controller(&self, replica_id: u64) -> Option<Controller> {
        self.controllers
            .lock()
            .expect("poisoned")
            .get(&replica_id)
            .cloned()
    }

    /// Turns the environment's replica restarts on controller events off
    /// (an experiment for the negative control: without them, nothing
    /// repairs a replica that `naive` delivery broke).
    pub fn set_replica_restarts(&self, on: bool) {
        self.restarts
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Lets a WASM distribution policy choose `naive` (an experiment: the
    /// negative control breaks I1 under faults). Refused by default.
    pub fn set_naive_allowed(&self, allowed: bool) {
        self.allow_naive
            .store(allowed, std::sync::atomic::Ordering::Relaxed);
    }

    /// Uses the WASM distribution policy at `path` for every controller
    /// started from now on (`None`: the native rule, barrier for everything).
    pub fn set_distribution_policy(&self, path: Option<std::path::PathBuf>) {
        *self.distribution.lock().expect("poisoned") = path;
    }

    /// Uses the WASM distribution policy at `path` for replica `replica_id`
    /// alone, over the environment-wide one (`None`: the environment-wide
    /// one again), for its controllers started from now on.
    pub fn set_replica_distribution_policy(
        &self,
        replica_id: u64,
        path: Option<std::path::PathBuf>,
    ) {
        let mut map = self.replica_distribution.lock().expect("poisoned");
        match path {
            Some(p) => map.insert(replica_id, p),
            None => map.remove(&replica_id),
        };
    }

    /// Whether replica `replica_id` has a distribution policy of its own.
    pub(crate) fn has_replica_policy(&self, replica_id: u64) -> bool {
        self.replica_distribution
            .lock()
            .expect("poisoned")
            .contains_key(&replica_id)
    }

    /// The distribution policy for a controller of replica `replica_id`:
    /// its own WASM policy, else the environment-wide one, wrapped so that a
    /// failing call falls back to `barrier` (the safe default), or the
    /// native rule.
    pub(crate) fn policy_for(
        &self,
        replica_id: u64,
    ) -> Box<dyn lockstep_policy::DistributionPolicy + Send> {
        let own = self
            .replica_distribution
            .lock()
            .expect("poisoned")
            .get(&replica_id)
            .cloned();
        let path = own.or_else(|| self.distribution.lock().expect("poisoned").clone());
        if let Some(path) = path {
            match lockstep_policy_host::WasmDistributionPolicy::load(&path, Default::default()) {
                Ok(p) => {
                    return Box::new(
                        lockstep_policy_host::SafeDistribution::new(p, Strategy::Barrier)
                            .with_naive_allowed(
                                self.allow_naive.load(std::sync::atomic::Ordering::Relaxed),
                            ),
                    )
                }
                Err(e) => tracing::error!(
                    path = %path.display(),
                    "distribution policy failed to load; using the native barrier rule: {e}"
                ),
            }
        }
        Box::new(FixedStrategy(Strategy::Barrier))
    }

    fn start(
        &self,
        replica: &Replica,
        status: &ServiceStatus,
        history: CommandHistory,
        (command_log, session_key): (
            Option<lockstep_command_log::LogLocation>,
            Option<lockstep_protocol::SessionKey>,
        ),
        restarter: Restarter,
    ) {
        let mut addrs = match launch::replica_addrs(status, replica.config.workers_per_process) {
            Ok(a) => a,
            Err(e) => {
                tracing::error!(replica = %replica.name, "cannot drive replica: {e}");
                return;
            }
        };
        addrs.command_log = command_log;
        addrs.session_key = session_key;
        addrs.max_frame_len = self
            .max_frame_len
            .load(std::sync::atomic::Ordering::Relaxed);
        let policy = self.policy_for(replica.id);
        let controller = Controller::start(
            addrs,
            restarter.epoch,
            history,
            policy,
            self.timeouts.clone(),
        );
        let watcher = Watcher {
            metrics: self.metrics.clone(),
            replica: replica.name.clone(),
            service: ServiceTemplate::service_name(replica.id),
            controller: controller.clone(),
            restarter,
            interval: self.restart_interval,
            ping_bound: PING_BOUND,
            restarts: Arc::clone(&self.restarts),
        };
        let events = controller.events();
        let services = watcher.restarter.orchestrator.watch_services();
        let task = tokio::spawn(watcher.run(events, services));
        if let Some(old) = self
            .watchers
            .lock()
            .expect("poisoned")
            .insert(replica.id, task)
        {
            old.abort();
        }
        if let Some(old) = self
            .controllers
            .lock()
            .expect("poisoned")
            .insert(replica.id, controller)
        {
            old.shutdown();
        }
    }

    fn stop(&self, replica_id: u64) {
        if let Some(w) = self.watchers.lock().expect("poisoned").remove(&replica_id) {
            w.abort();
        }
        if let Some(c) = self
            .controllers
            .lock()
            .expect("poisoned")
            .remove(&replica_id)
        {
            c.shutdown();
        }
    }
}

/// Why a controller event calls for restarting the replica, if it does:
/// the reason's metrics label (`silent`, `lockstep_lost`,
/// `history_mismatch`) and its text.
fn restart_reason(event: &Event) -> Option<(&'static str, String)> {
    match event {
        Event::ProcessSilent {
            process,
            silent_for,
        } => Some((
            "silent",
            format!("process {process} has not answered for {silent_for:.1?} (stopped or hung)"),
        )),
        Event::ReplicaError { process, error } if error.kind == ErrorKind::LockstepLost => Some((
            "lockstep_lost",
            format!("process {process} lost lockstep: {}", error.message),
        )),
        Event::HistoryMismatch {
            distinct_digests,
            action: lockstep_policy::MismatchAction::RestartReplica,
        } => Some((
            "history_mismatch",
            format!(
                "the history check found {distinct_digests} different worker histories and the distribution policy asks for a restart"
            ),
        )),
        _ => None,
    }
}

/// Watches one controller's events: logs them, and restarts the replica
/// through the orchestrator when one calls for it, at most once per
/// `interval`.
struct Watcher {
    metrics: Arc<crate::metrics::Metrics>,
    replica: String,
    service: String,
    controller: Controller,
    restarter: Restarter,
    interval: Duration,
    ping_bound: Duration,
    restarts: Arc<std::sync::atomic::AtomicBool>,
}

impl Watcher {
    async fn run(
        self,
        mut events: broadcast::Receiver<Event>,
        services: broadcast::Receiver<lockstep_orchestrator::ServiceEvent>,
    ) {
        // `None` once the orchestrator's event channel closed.
        let mut services = Some(services);
        use tokio::sync::broadcast::error::RecvError;
        let mut last_restart: Option<Instant> = None;
        // A reason that came within the interval, to check at its end.
        let mut pending: Option<(&'static str, String)> = None;
        loop {
            let recheck_at = match (&pending, last_restart) {
                (Some(_), Some(t)) => Some(t + self.interval),
                _ => None,
            };
            let recheck = async {
                match recheck_at {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            let reason = tokio::select! {
                e = async {
                    match services.as_mut() {
                        Some(s) => s.recv().await,
                        None => std::future::pending().await,
                    }
                } => {
                    match e {
                        Ok(e) if e.service == self.service => self.on_service_event(e.kind),
                        Ok(_) => {}
                        Err(RecvError::Lagged(n)) => {
                            tracing::warn!(replica = %self.replica, "{n} service events were not seen");
                        }
                        // The orchestrator is gone; the controller events still matter.
                        Err(RecvError::Closed) => services = None,
                    }
                    continue;
                }
                e = events.recv() => match e {
                    Ok(e) => {
                        tracing::info!(replica = %self.replica, event = ?e, "controller event");
                        self.count(&e);
                        // Fenced out of the command log: a newer controller
                        // runs; this environment must halt (O3).
                        if let Event::LogFailed { message, fenced: true } = &e {
                            crate::halt_with(&self.restarter.halt, self.restarter.epoch, format!("replica {}: {message}", self.replica));
                            return;
                        }
                        if let Event::DataflowRefused { dataflow, message, .. } = &e {
                            self.forget(*dataflow, message);
                        }
                        let Some(reason) = restart_reason(&e) else { continue };
                        if let Some(t) = last_restart.filter(|t| t.elapsed() < self.interval) {
                            tracing::warn!(
                                replica = %self.replica,
                                reason = %reason.1,
                                "the replica was restarted {:.1?} ago; checking it again in {:.1?}",
                                t.elapsed(),
                                self.interval.saturating_sub(t.elapsed()),
                            );
                            pending.get_or_insert(reason);
                            continue;
                        }
                        reason
                    }
                    Err(RecvError::Lagged(n)) => {
                        tracing::warn!(replica = %self.replica, "{n} controller events were not seen");
                        continue;
                    }
                    Err(RecvError::Closed) => return,
                },
                () = recheck => {
                    let (label, reason) = pending.take().expect("a recheck only with a pending reason");
                    match tokio::time::timeout(self.ping_bound, self.controller.ping()).await {
                        Ok(Ok(())) => {
                            tracing::info!(replica = %self.replica, earlier = %reason, "the replica answers again; not restarting it");
                            continue;
                        }
                        Ok(Err(e)) => (label, format!("{reason}; it still does not answer: {e}")),
                        Err(_) => (label, format!("{reason}; it still does not answer a ping within {:?}", self.ping_bound)),
                    }
                }
            };
            pending = None;
            last_restart = Some(Instant::now());
            self.metrics
                .restarts
                .get_or_create(&crate::metrics::RestartLabels {
                    replica: self.replica.clone(),
                    reason: reason.0.to_string(),
                })
                .inc();
            if !self.restart(&reason.1).await {
                return;
            }
        }
    }

    /// A replica process refused dataflow `id` as malformed (the controller
    /// forgot it already): the catalog forgets it too, so that no restart
    /// replays it.
    fn forget(&self, id: u64, message: &str) {
        let Some((catalog, view)) = &self.restarter.catalog else {
            return;
        };
        match forget_refused(
            catalog,
            view,
            &self.restarter.halt,
            self.restarter.epoch,
            id,
        ) {
            Ok(true) => {
                tracing::error!(replica = %self.replica, dataflow = id, %message, "a replica refused the dataflow as malformed: removed from the catalog")
            }
            Ok(false) => {}
            Err(e) => {
                tracing::error!(replica = %self.replica, dataflow = id, "could not remove a refused dataflow from the catalog: {e}")
            }
        }
    }

    /// Acts on an event of the replica's service: new ports (the
    /// orchestrator re-chose them after a port was taken) go to the
    /// controller, which reconnects there.
    fn on_service_event(&self, kind: lockstep_orchestrator::ServiceEventKind) {
        let lockstep_orchestrator::ServiceEventKind::PortsReassigned { addresses } = kind else {
            return;
        };
        let controller: Option<Vec<std::net::SocketAddr>> = addresses
            .iter()
            .map(|a| a.get("controller").copied())
            .collect();
        match controller {
            Some(addrs) => {
                tracing::warn!(replica = %self.replica, ?addrs, "the replica's processes got new ports; reconnecting there");
                let addrs = addrs
                    .into_iter()
                    .map(lockstep_protocol::Endpoint::from)
                    .collect();
                if let Err(e) = self.controller.set_addresses(addrs) {
                    tracing::error!(replica = %self.replica, "could not give the controller the new addresses: {e}");
                }
            }
            None => tracing::error!(
                replica = %self.replica,
                "the replica's new ports name no controller port"
            ),
        }
    }

    /// Counts what the metrics count of a controller event.
    fn count(&self, e: &Event) {
        let label = crate::metrics::ReplicaLabel {
            replica: self.replica.clone(),
        };
        match e {
            Event::Connected { .. } => self.metrics.sessions.get_or_create(&label).inc(),
            Event::Disconnected { .. } => self.metrics.disconnects.get_or_create(&label).inc(),
            Event::HistoryMismatch { .. } => {
                self.metrics.history_mismatches.get_or_create(&label).inc()
            }
            _ => 0,
        };
    }

    /// Restarts the replica's service; returns false if this watcher must
    /// stop (we halted).
    async fn restart(&self, reason: &str) -> bool {
        if self.restarter.halt.borrow().is_some() {
            return false;
        }
        if !self.restarts.load(std::sync::atomic::Ordering::Relaxed) {
            tracing::warn!(replica = %self.replica, %reason, "not restarting the replica: restarts are turned off (experiment)");
            return true;
        }
        tracing::warn!(
            replica = %self.replica,
            service = %self.service,
            %reason,
            "restarting the replica through the orchestrator"
        );
        match self
            .restarter
            .orchestrator
            .restart_service(&self.service)
            .await
        {
            Ok(status) => {
                let pids: Vec<Option<u32>> = status.processes.iter().map(|p| p.pid).collect();
                tracing::warn!(
                    replica = %self.replica,
                    ?pids,
                    "replica restarted; its controller reconnects"
                );
                true
            }
            Err(e @ RestartError::StaleEpoch { .. }) => {
                crate::halt_with(&self.restarter.halt, self.restarter.epoch, e.to_string());
                false
            }
            Err(e) => {
                tracing::error!(replica = %self.replica, %reason, "could not restart the replica: {e}");
                true
            }
        }
    }
}

/// Decodes a catalog dataflow.
pub fn decode_dataflow(bytes: &[u8]) -> Result<DataflowDescription, ComputeError> {
    let w = wire::DataflowDescription::decode(bytes)
        .map_err(|e| ComputeError::Corrupt(e.to_string()))?;
    DataflowDescription::try_from(w).map_err(|e| ComputeError::Corrupt(e.to_string()))
}

/// Decodes a write the catalog holds, through the protocol's one wire
/// conversion (which checks every field, the digest's lanes among them).
pub(crate) fn decode_write(bytes: &[u8]) -> Result<WriteInput, ComputeError> {
    let w = wire::WriteInput::decode(bytes).map_err(|e| ComputeError::Corrupt(e.to_string()))?;
    WriteInput::try_from(w).map_err(|e| ComputeError::Corrupt(e.to_string()))
}

/// Encodes a write for the catalog: the consolidated write alone (not
/// continued, no batch digest).
fn encode_write(w: &WriteInput) -> Vec<u8> {
    wire::WriteInput::from(WriteInput {
        more: false,
        batch_digest: None,
        ..w.clone()
    })
    .encode_to_vec()
}

/// The largest since among a dataflow's inputs.
fn since_of(desc: &DataflowDescription, sinces: &BTreeMap<u64, Timestamp>) -> Timestamp {
    desc.inputs
        .iter()
        .filter_map(|i| sinces.get(i).copied())
        .max()
        .unwrap_or(0)
}

impl Environment {
    /// The target command history of a replica: its input collections (one
    /// consolidated write each), then its dataflows in creation order.
    pub fn history_of(&self, replica_id: u64) -> Result<CommandHistory, ComputeError> {
        let mut h = CommandHistory::new();
        h.push(CommandKind::CreateInstance(Default::default()));
        for w in self.inputs.lock().expect("poisoned").writes_of(replica_id) {
            h.push(CommandKind::WriteInput(w));
        }
        for desc in self.dataflows_of(replica_id)? {
            let dataflow_id = desc.id;
            h.push(CommandKind::CreateDataflow((*desc).clone()));
            h.push(CommandKind::Schedule { dataflow_id });
        }
        let replica = self
            .view
            .lock()
            .expect("poisoned")
            .replicas
            .get(&replica_id)
            .cloned();
        if let Some(replica) = replica {
            for (collection_id, since) in self.compactions(&replica, None)? {
                h.push(CommandKind::AllowCompaction {
                    collection_id,
                    frontier: Some(since),
                });
            }
        }
        h.reduce();
        Ok(h)
    }
}

impl Environment {
    pub(crate) fn replica_named(&self, name: &str) -> Result<Replica, ComputeError> {
        if name.is_empty() {
            return Err(ComputeError::Invalid(
                "a request needs a replica name".into(),
            ));
        }
        self.view
            .lock()
            .expect("poisoned")
            .replicas
            .values()
            .find(|r| r.name == name)
            .cloned()
            .ok_or_else(|| ComputeError::NoSuchReplica(name.to_string()))
    }

    fn controller_of(&self, replica: &Replica) -> Result<Controller, ComputeError> {
        self.compute.controller(replica.id).ok_or_else(|| {
            ComputeError::Unavailable(format!(
                "replica {:?} has no running controller yet; nothing was written",
                replica.name
            ))
        })
    }

    /// The collection namespace of a replica: each export with the dataflow
    /// that exports it, and every input collection (written, or read by a
    /// live dataflow). An ID is an input or an export, never both.
    fn namespace(
        &self,
        replica: &Replica,
    ) -> Result<(BTreeMap<u64, u64>, BTreeSet<u64>), ComputeError> {
        let mut exports = BTreeMap::new();
        let mut inputs: BTreeSet<u64> = self
            .inputs
            .lock()
            .expect("poisoned")
            .sinces_of(replica.id)
            .into_iter()
            .map(|(c, _)| c)
            .collect();
        for desc in self.dataflows_of(replica.id)? {
            inputs.extend(desc.inputs.iter().copied());
            exports.extend(desc.exports.iter().map(|e| (e.collection_id, desc.id)));
        }
        Ok((exports, inputs))
    }

    /// The live dataflows of a replica, decoded, in creation order. Each
    /// description is decoded once (IDs are never reused and descriptions
    /// never change), not on every write, peek or create that checks the
    /// replica's namespace.
    fn dataflows_of(&self, replica_id: u64) -> Result<Vec<Arc<DataflowDescription>>, ComputeError> {
        let view = self.view.lock().expect("poisoned");
        let mut decoded = self.decoded.lock().expect("poisoned");
        decoded.retain(|id, _| view.dataflows.contains_key(id));
        view.dataflows
            .values()
            .filter(|d| d.replica_id == replica_id)
            .map(|d| match decoded.get(&d.id) {
                Some(desc) => Ok(Arc::clone(desc)),
                None => {
                    let desc = Arc::new(decode_dataflow(&d.description)?);
                    decoded.insert(d.id, Arc::clone(&desc));
                    Ok(desc)
                }
            })
            .collect()
    }

    /// Starts a controller for every catalog replica whose service is listed,
    /// rehydrated from the catalog. Called once on start, after orphan removal.
    pub async fn start_compute(&self) -> Result<(), ComputeError> {
        let view = self.view();
        let services = self
            .orchestrator
            .list_services()
            .await
            .map_err(|e| EnvError::Orchestrator(e.to_string()))?;
        for replica in view.replicas.values() {
            let Some(status) = services.iter().find(|s| s.id == replica.id) else {
                tracing::warn!(replica = %replica.name, "no service listed; not driving it");
                continue;
            };
            let history = self.history_of(replica.id)?;
            tracing::info!(replica = %replica.name, commands = history.len(), "driving replica");
            self.compute.start(
                replica,
                status,
                history,
                (self.command_log(replica.id), self.session_key(replica.id)),
                self.restarter(),
            );
        }
        Ok(())
    }

    pub(crate) fn compute_started(&self, replica: &Replica, status: &ServiceStatus) {
        self.compute.start(
            replica,
            status,
            self.history_of(replica.id).unwrap_or_default(),
            (self.command_log(replica.id), self.session_key(replica.id)),
            self.restarter(),
        );
    }

    fn restarter(&self) -> Restarter {
        Restarter {
            orchestrator: self.orchestrator.clone(),
            halt: self.halt.clone(),
            epoch: self.epoch,
            catalog: Some((self.catalog.clone(), self.view.clone())),
        }
    }

    pub(crate) fn compute_stopped(&self, replica_id: u64) {
        self.compute.stop(replica_id);
    }

    /// Creates a dataflow on a replica: catalog transaction, then the replica.
    pub async fn create_dataflow(
        &self,
        replica_name: &str,
        debug_name: &str,
        as_of: Timestamp,
        inputs: Vec<u64>,
        exports: Vec<Export>,
    ) -> Result<DataflowDescription, ComputeError> {
        let ops = self.ops.lock().await;
        self.check_not_halted()?;
        let replica = self.replica_named(replica_name)?;
        let mut desc = DataflowDescription {
            id: 0,
            as_of,
            inputs,
            exports,
            debug_name: debug_name.to_string(),
        };
        // What a replica would refuse (the same checks, and its decoder's
        // limits) is refused here, before anything is recorded.
        lockstep_protocol::validate::check_dataflow(&desc, self.compute.max_frame_len())
            .map_err(|e| ComputeError::Invalid(e.to_string()))?;
        let declared: BTreeSet<u64> = desc.inputs.iter().copied().collect();
        let (exported, written) = self.namespace(&replica)?;
        if let Some((c, d)) = declared
            .iter()
            .find_map(|c| exported.get(c).map(|d| (*c, *d)))
        {
            return Err(ComputeError::Invalid(format!(
                "collection {c} is an export of dataflow {d}; a dataflow reads input collections only (reading another dataflow's export is not supported)"
            )));
        }
        for e in &desc.exports {
            let c = e.collection_id;
            if let Some(d) = exported.get(&c) {
                return Err(ComputeError::AlreadyExists(format!(
                    "collection {c} is already exported by dataflow {d} on replica {replica_name:?}"
                )));
            }
            if written.contains(&c) {
                return Err(ComputeError::AlreadyExists(format!(
                    "collection {c} is an input collection of replica {replica_name:?}"
                )));
            }
        }
        // Refused before anything is written if nothing could serve it.
        let controller = self.controller_of(&replica)?;
        // Results below the inputs' since cannot be correct: start there.
        let since = self.export_since(&replica, &desc);
        desc.as_of = desc.as_of.max(since);
        let record = {
            let mut catalog = self.catalog.lock().expect("poisoned");
            let record = catalog
                .create_dataflow_with(replica.id, |id| {
                    desc.id = id;
                    wire::DataflowDescription::from(desc.clone()).encode_to_vec()
                })
                .map_err(|e| self.catalog_error(e))?;
            self.view
                .lock()
                .expect("poisoned")
                .dataflows
                .insert(record.id, record.clone());
            record
        };
        desc.id = record.id;
        let mut events = controller.events();
        controller.create_dataflow(desc.clone())?;
        if since > 0 {
            for e in &desc.exports {
                controller.allow_compaction(e.collection_id, Some(since))?;
            }
        }
        // The dataflow is recorded and sent: other operations need not wait
        // for its outcome.
        drop(ops);
        // Every process applies commands in order: a ping answered by every
        // worker after the create means every process took it. A process
        // that cannot decode it refuses it instead.
        let refused = async {
            loop {
                match events.recv().await {
                    Ok(Event::DataflowRefused {
                        dataflow, message, ..
                    }) if dataflow == desc.id => return message,
                    Err(broadcast::error::RecvError::Closed) => {
                        return std::future::pending().await
                    }
                    _ => {}
                }
            }
        };
        tokio::select! {
            biased;
            message = refused => {
                forget_refused(&self.catalog, &self.view, &self.halt, self.epoch, desc.id)?;
                return Err(ComputeError::Refused(format!(
                    "replica {:?} refused the dataflow's command as malformed; the dataflow was not created: {message}",
                    replica.name
                )));
            }
            answered = tokio::time::timeout(CREATE_OUTCOME_BOUND, controller.ping()) => {
                if !matches!(answered, Ok(Ok(()))) {
                    tracing::warn!(replica = %replica.name, dataflow = desc.id, "the replica did not confirm the dataflow within {CREATE_OUTCOME_BOUND:?}; it applies it when it answers");
                }
            }
        }
        tracing::info!(replica = %replica.name, dataflow = desc.id, "dataflow created");
        Ok(desc)
    }

    /// Drops a dataflow: catalog transaction, then the replica.
    pub async fn drop_dataflow(&self, id: u64) -> Result<(), ComputeError> {
        let _ops = self.ops.lock().await;
        self.check_not_halted()?;
        let record = self
            .view()
            .dataflows
            .get(&id)
            .cloned()
            .ok_or(ComputeError::NoSuchDataflow(id))?;
        let desc = decode_dataflow(&record.description)?;
        {
            let mut catalog = self.catalog.lock().expect("poisoned");
            catalog
                .drop_dataflow(id)
                .map_err(|e| self.catalog_error(e))?;
            self.view.lock().expect("poisoned").dataflows.remove(&id);
        }
        if let Some(c) = self.compute.controller(record.replica_id) {
            c.drop_dataflow(&desc)?;
        }
        Ok(())
    }

    /// Every dataflow of the catalog with its replica's name.
    pub fn list_dataflows(&self) -> Result<Vec<(String, DataflowDescription)>, ComputeError> {
        let view = self.view();
        view.dataflows
            .values()
            .map(|d| {
                let name = view
                    .replicas
                    .get(&d.replica_id)
                    .map(|r| r.name.clone())
                    .unwrap_or_default();
                Ok((name, decode_dataflow(&d.description)?))
            })
            .collect()
    }

    /// Appends updates to an input collection: recorded in the catalog, then sent.
    pub async fn write_input(
        &self,
        replica_name: &str,
        collection_id: u64,
        updates: Vec<Update>,
        upper: Timestamp,
    ) -> Result<(), ComputeError> {
        let _ops = self.ops.lock().await;
        self.check_not_halted()?;
        let replica = self.replica_named(replica_name)?;
        let (exported, _) = self.namespace(&replica)?;
        if let Some(d) = exported.get(&collection_id) {
            return Err(ComputeError::Invalid(format!(
                "collection {collection_id} is an export of dataflow {d}, not an input collection"
            )));
        }
        self.inputs
            .lock()
            .expect("poisoned")
            .check(replica.id, collection_id, &updates, upper)
            .map_err(|e| match e {
                WriteRefused::Overflow { .. } => ComputeError::Invalid(e.to_string()),
                _ => ComputeError::OutOfRange(e.to_string()),
            })?;
        // Refused before anything is written if nothing could serve it.
        let controller = self.controller_of(&replica)?;
        let write = WriteInput {
            collection_id,
            updates,
            upper,
            more: false,
            batch_digest: None,
        };
        let since = {
            let mut catalog = self.catalog.lock().expect("poisoned");
            catalog
                .append_input(replica.id, collection_id, &encode_write(&write))
                .map_err(|e| self.catalog_error(e))?;
            let mut inputs = self.inputs.lock().expect("poisoned");
            let recorded = inputs.record(
                replica.id,
                collection_id,
                write.updates.clone(),
                write.upper,
            );
            if let Some(snapshot) = recorded.snapshot {
                // Best effort: the rows already stored stay valid if this fails.
                match catalog.replace_inputs(replica.id, collection_id, &encode_write(&snapshot)) {
                    Ok(_) => inputs.replaced(replica.id, collection_id),
                    Err(e) => tracing::warn!(
                        collection = collection_id,
                        "could not consolidate the stored writes: {e}"
                    ),
                }
            }
            recorded.since
        };
        controller.write_input(collection_id, write.updates, write.upper)?;
        if since.is_some() {
            for (collection, since) in self.compactions(&replica, Some(collection_id))? {
                controller.allow_compaction(collection, Some(since))?;
            }
        }
        Ok(())
    }

    /// The compaction frontiers of a replica's collections: of each input
    /// collection (only `input` if given) with a since above 0, and of each
    /// export of a live dataflow reading it (the largest since among the
    /// dataflow's inputs).
    fn compactions(
        &self,
        replica: &Replica,
        input: Option<u64>,
    ) -> Result<Vec<(u64, Timestamp)>, ComputeError> {
        let sinces: BTreeMap<u64, Timestamp> = self
            .inputs
            .lock()
            .expect("poisoned")
            .sinces_of(replica.id)
            .into_iter()
            .collect();
        let mut out: Vec<(u64, Timestamp)> = sinces
            .iter()
            .filter(|(c, s)| **s > 0 && input.is_none_or(|i| i == **c))
            .map(|(c, s)| (*c, *s))
            .collect();
        for desc in self.dataflows_of(replica.id)? {
            if input.is_some_and(|i| !desc.inputs.contains(&i)) {
                continue;
            }
            let since = since_of(&desc, &sinces);
            if since > 0 {
                out.extend(desc.exports.iter().map(|e| (e.collection_id, since)));
            }
        }
        Ok(out)
    }

    /// The since of a dataflow's exports: reads below it are refused.
    fn export_since(&self, replica: &Replica, desc: &DataflowDescription) -> Timestamp {
        let inputs = self.inputs.lock().expect("poisoned");
        desc.inputs
            .iter()
            .map(|i| inputs.since(replica.id, *i))
            .max()
            .unwrap_or(0)
    }

    /// Reads a collection of a replica at a time.
    pub async fn peek(
        &self,
        replica_name: &str,
        collection_id: u64,
        timestamp: Timestamp,
    ) -> Result<Vec<(Row, i64)>, ComputeError> {
        self.check_not_halted()?;
        let replica = self.replica_named(replica_name)?;
        let desc = self.check_exported(&replica, collection_id)?;
        let since = self.export_since(&replica, &desc);
        if timestamp == Timestamp::MAX {
            return Err(ComputeError::OutOfRange(format!(
                "no frontier passes time {timestamp}: a peek there could never be answered"
            )));
        }
        if timestamp < since {
            return Err(ComputeError::OutOfRange(format!(
                "collection {collection_id} is compacted to {since}; a peek at {timestamp} is below it"
            )));
        }
        Ok(self
            .controller_of(&replica)?
            .peek(collection_id, timestamp)
            .await?)
    }

    /// Streams a collection's changes from `as_of`.
    pub fn subscribe(
        &self,
        replica_name: &str,
        collection_id: u64,
        as_of: Timestamp,
    ) -> Result<mpsc::Receiver<Result<SubscribeBatch, ControllerError>>, ComputeError> {
        self.check_not_halted()?;
        let replica = self.replica_named(replica_name)?;
        let desc = self.check_exported(&replica, collection_id)?;
        let since = self.export_since(&replica, &desc);
        if as_of < since {
            return Err(ComputeError::OutOfRange(format!(
                "collection {collection_id} is compacted to {since}; a subscription as of {as_of} is below it"
            )));
        }
        Ok(self
            .controller_of(&replica)?
            .subscribe(collection_id, as_of)?)
    }

    /// Fails with [`ComputeError::NoSuchCollection`] unless a live dataflow
    /// of `replica` exports `collection_id`.
    /// Returns that dataflow.
    fn check_exported(
        &self,
        replica: &Replica,
        collection_id: u64,
    ) -> Result<DataflowDescription, ComputeError> {
        for desc in self.dataflows_of(replica.id)? {
            if desc
                .exports
                .iter()
                .any(|e| e.collection_id == collection_id)
            {
                return Ok((*desc).clone());
            }
        }
        Err(ComputeError::NoSuchCollection {
            replica: replica.name.clone(),
            collection: collection_id,
        })
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use lockstep_controller::ReplicaAddrs;
    use lockstep_orchestrator::{DropError, EnsureError, ListError, ServiceConfig, ServiceEvent};
    use lockstep_protocol::ErrorResponse;

    use super::*;

    #[test]
    fn a_stored_write_goes_through_the_protocols_checks() {
        let w = WriteInput {
            collection_id: 7,
            updates: vec![Update {
                row: vec![1, 2],
                time: 3,
                diff: -1,
            }],
            upper: 4,
            more: true,
            batch_digest: Some([1, 2, 3, 4]),
        };
        // Stored as the consolidated write alone.
        let back = decode_write(&encode_write(&w)).expect("round trip");
        assert_eq!(back.updates, w.updates);
        assert_eq!((back.more, back.batch_digest), (false, None));
        // A digest of 3 lanes is refused, naming the field (the copy this
        // replaced dropped the digest unchecked).
        let bad = wire::WriteInput {
            collection_id: 7,
            batch_digest: vec![1, 2, 3],
            ..Default::default()
        }
        .encode_to_vec();
        let err = decode_write(&bad).expect_err("3 lanes").to_string();
        assert!(err.contains("WriteInput.batch_digest"), "{err}");
    }

    /// Counts restarts; refuses them as stale when told to.
    struct Fake {
        restarts: AtomicUsize,
        stale: bool,
        /// When each restart happened.
        at: std::sync::Mutex<Vec<Instant>>,
    }

    #[async_trait::async_trait]
    impl Orchestrator for Fake {
        fn epoch(&self) -> u64 {
            1
        }
        async fn ensure_service(&self, _: ServiceConfig) -> Result<ServiceStatus, EnsureError> {
            Err(EnsureError::Invalid("the fake ensures nothing".into()))
        }
        async fn drop_service(&self, _: &str) -> Result<bool, DropError> {
            Ok(false)
        }
        async fn restart_service(&self, name: &str) -> Result<ServiceStatus, RestartError> {
            if self.stale {
                return Err(RestartError::StaleEpoch {
                    service: name.to_string(),
                    stored: 2,
                    ours: 1,
                });
            }
            self.at.lock().unwrap().push(Instant::now());
            self.restarts.fetch_add(1, Ordering::SeqCst);
            Ok(ServiceStatus {
                name: name.to_string(),
                id: 1,
                epoch: 1,
                labels: BTreeMap::new(),
                processes: Vec::new(),
            })
        }
        async fn list_services(&self) -> Result<Vec<ServiceStatus>, ListError> {
            Ok(Vec::new())
        }
        fn watch_services(&self) -> broadcast::Receiver<ServiceEvent> {
            broadcast::channel(1).1
        }
    }

    /// A watcher over a controller of a replica that does not exist (so
    /// every ping fails), fed events by hand.
    fn watcher(
        fake: Arc<Fake>,
    ) -> (
        broadcast::Sender<Event>,
        watch::Receiver<Option<String>>,
        JoinHandle<()>,
    ) {
        let (tx, halted, task, _) = watcher_with_metrics(fake);
        (tx, halted, task)
    }

    /// [`watcher`], and the metrics its watcher counts into.
    fn watcher_with_metrics(
        fake: Arc<Fake>,
    ) -> (
        broadcast::Sender<Event>,
        watch::Receiver<Option<String>>,
        JoinHandle<()>,
        Arc<crate::metrics::Metrics>,
    ) {
        let metrics: Arc<crate::metrics::Metrics> = Default::default();
        let controller = Controller::start(
            ReplicaAddrs {
                replica_id: 1,
                processes: vec!["127.0.0.1:1".parse().unwrap()],
                workers_per_process: 1,
                command_log: None,
                session_key: None,
                one_way_proof: false,
                max_frame_len: lockstep_protocol::DEFAULT_MAX_FRAME_LEN,
            },
            1,
            CommandHistory::new(),
            Box::new(FixedStrategy(Strategy::Barrier)),
            Timeouts::default(),
        );
        let (halt, halted) = watch::channel(None);
        let w = Watcher {
            metrics: metrics.clone(),
            replica: "r1".into(),
            service: "replica-1".into(),
            controller,
            restarter: Restarter {
                orchestrator: fake,
                halt,
                epoch: 1,
                catalog: None,
            },
            interval: INTERVAL,
            ping_bound: Duration::from_millis(100),
            restarts: Arc::new(true.into()),
        };
        let (tx, rx) = broadcast::channel(16);
        let services = w.restarter.orchestrator.watch_services();
        (tx, halted, tokio::spawn(w.run(rx, services)), metrics)
    }

    /// Sends a Disconnected event and waits until the watcher counted it:
    /// every event sent before it has been handled too (one task, in order).
    async fn probe(tx: &broadcast::Sender<Event>, metrics: &crate::metrics::Metrics) {
        let label = crate::metrics::ReplicaLabel {
            replica: "r1".into(),
        };
        let before = metrics.disconnects.get_or_create(&label).get();
        tx.send(Event::Disconnected {
            process: 0,
            reason: "probe".into(),
        })
        .unwrap();
        eventually("the watcher to handle the events before the probe", || {
            metrics.disconnects.get_or_create(&label).get() > before
        })
        .await;
    }

    const INTERVAL: Duration = Duration::from_secs(1);

    async fn eventually(what: &str, f: impl Fn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !f() {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    fn silent() -> Event {
        Event::ProcessSilent {
            process: 1,
            silent_for: Duration::from_secs(2),
        }
    }

    fn error(kind: ErrorKind) -> Event {
        Event::ReplicaError {
            process: 0,
            error: ErrorResponse {
                kind,
                message: "diverged".into(),
                seqno: 3,
            },
        }
    }

    #[test]
    fn only_silence_lost_lockstep_and_a_restart_verdict_call_for_a_restart() {
        let (label, text) = restart_reason(&silent()).unwrap();
        assert_eq!(label, "silent");
        assert!(text.contains("process 1"));
        let (label, text) = restart_reason(&error(ErrorKind::LockstepLost)).unwrap();
        assert_eq!(label, "lockstep_lost");
        assert!(text.contains("lost lockstep: diverged"));
        assert_eq!(restart_reason(&error(ErrorKind::InvalidCommand)), None);
        assert!(restart_reason(&Event::HistoryMismatch {
            distinct_digests: 2,
            action: lockstep_policy::MismatchAction::RestartReplica,
        })
        .unwrap()
        .1
        .contains("2 different worker histories"));
        assert_eq!(
            restart_reason(&Event::HistoryMismatch {
                distinct_digests: 2,
                action: lockstep_policy::MismatchAction::ReconcileCollectively,
            }),
            None
        );
        assert_eq!(restart_reason(&Event::Connected { nonce: 1 }), None);
        assert_eq!(
            restart_reason(&Event::Disconnected {
                process: 0,
                reason: "eof".into()
            }),
            None
        );
    }

    #[tokio::test]
    async fn restarts_are_rate_limited_and_a_reason_within_the_interval_is_checked_again() {
        let fake = Arc::new(Fake {
            restarts: AtomicUsize::new(0),
            stale: false,
            at: Default::default(),
        });
        let (tx, _halted, task, metrics) = watcher_with_metrics(fake.clone());
        let count = || fake.restarts.load(Ordering::SeqCst);

        tx.send(Event::Connected { nonce: 1 }).unwrap();
        tx.send(error(ErrorKind::InvalidCommand)).unwrap();
        probe(&tx, &metrics).await;
        assert_eq!(count(), 0, "nothing to restart for");

        tx.send(silent()).unwrap();
        eventually("the first restart", || count() == 1).await;

        // A burst (every worker reports the halt) within the interval: no
        // restart now, one check when the interval ends.
        for _ in 0..4 {
            tx.send(error(ErrorKind::LockstepLost)).unwrap();
        }
        probe(&tx, &metrics).await;
        // The replica does not answer the ping (it does not exist): restarted.
        eventually("the deferred restart", || count() == 2).await;
        let at = fake.at.lock().unwrap().clone();
        assert!(
            at[1] - at[0] >= INTERVAL,
            "restarted again {:?} after the first, within the interval",
            at[1] - at[0]
        );
        probe(&tx, &metrics).await;
        assert_eq!(count(), 2, "the burst gave one restart, not four");
        assert!(!task.is_finished());
        task.abort();
    }

    #[tokio::test]
    async fn a_newer_controllers_service_halts_the_environment() {
        let fake = Arc::new(Fake {
            restarts: AtomicUsize::new(0),
            stale: true,
            at: Default::default(),
        });
        let (tx, mut halted, task) = watcher(fake);
        tx.send(silent()).unwrap();
        tokio::time::timeout(Duration::from_secs(5), halted.wait_for(|h| h.is_some()))
            .await
            .expect("halted")
            .unwrap();
        assert!(halted
            .borrow()
            .as_deref()
            .unwrap()
            .contains("another controller took over"));
        tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .expect("the watcher stops")
            .unwrap();
    }

    #[tokio::test]
    async fn fenced_out_of_the_command_log_halts_the_environment_and_a_broken_log_does_not() {
        let fake = Arc::new(Fake {
            restarts: AtomicUsize::new(0),
            stale: false,
            at: Default::default(),
        });
        let (tx, mut halted, task) = watcher(fake.clone());
        tx.send(Event::LogFailed {
            message: "disk I/O error".into(),
            fenced: false,
        })
        .unwrap();
        tx.send(Event::LogFailed {
            message: "epoch 1 is fenced out by epoch 2".into(),
            fenced: true,
        })
        .unwrap();
        tokio::time::timeout(Duration::from_secs(5), halted.wait_for(|h| h.is_some()))
            .await
            .expect("halted")
            .unwrap();
        let reason = halted.borrow().clone().unwrap();
        assert!(reason.contains("fenced out by epoch 2"), "{reason}");
        assert_eq!(
            fake.restarts.load(Ordering::SeqCst),
            0,
            "a log failure is no reason to restart the replica"
        );
        tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .expect("the watcher stops")
            .unwrap();
    }
}
