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
use lockstep_controller::{Controller, ControllerError, DeliveryRules, Event, Timeouts};
use lockstep_orchestrator::{Orchestrator, RestartError, ServiceStatus};
use lockstep_policy::FixedStrategy;
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

mod requests;
mod standby;
mod watcher;
mod writes;

pub use requests::decode_dataflow;
pub(crate) use requests::decode_write;
pub(crate) use standby::Generation;
pub use standby::{Reconfiguration, ReconfigurationPhase};
use watcher::*;
pub(crate) use writes::PendingWrites;

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
    /// The dataflow format the replicas build (`None`: the built-in
    /// family's, [`lockstep_plan::FORMAT`]).
    format: Mutex<Option<String>>,
    /// The environment's metrics.
    metrics: Arc<crate::metrics::Metrics>,
    /// Whether a WASM distribution policy may choose `naive`.
    allow_naive: std::sync::atomic::AtomicBool,
    /// Whether controller events (a silent process, lost lockstep, a
    /// history mismatch) restart replicas: off only in the negative control
    /// of the seeded campaign.
    restarts: Arc<std::sync::atomic::AtomicBool>,
    /// Each replica's standby generation during an upgrade that keeps
    /// answering, by replica ID.
    standbys: Mutex<BTreeMap<u64, standby::Standby>>,
    /// The reconfigurations under way (upgrades that keep answering,
    /// resizes), by replica ID.
    reconfigurations: Mutex<BTreeMap<u64, Reconfiguration>>,
    /// The reads in flight, per replica and the generation they went to.
    reads: Mutex<BTreeMap<(u64, Generation), Arc<()>>>,
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
            format: Mutex::new(None),
            metrics: Default::default(),
            allow_naive: false.into(),
            restarts: Arc::new(true.into()),
            standbys: Mutex::new(BTreeMap::new()),
            reconfigurations: Mutex::new(BTreeMap::new()),
            reads: Mutex::new(BTreeMap::new()),
        }
    }
}

impl Compute {
    /// Sets the frame limit of replica connections started from now on.
    pub fn set_max_frame_len(&self, max_frame_len: usize) {
        self.max_frame_len
            .store(max_frame_len, std::sync::atomic::Ordering::Relaxed);
    }

    /// Sets the dataflow format the replicas build (`None`: the built-in
    /// family's).
    pub fn set_format(&self, format: Option<String>) {
        *self.format.lock().expect("poisoned") = format;
    }

    /// The dataflow format the replicas build.
    pub fn format(&self) -> String {
        self.format
            .lock()
            .expect("poisoned")
            .clone()
            .unwrap_or_else(|| lockstep_plan::FORMAT.to_string())
    }

    /// Whether the replicas build the built-in family, whose descriptions
    /// and rows the environment checks itself.
    pub fn builds_plans(&self) -> bool {
        self.format() == lockstep_plan::FORMAT
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

    /// How a controller of replica `replica_id` distributes: its own WASM
    /// policy, else the environment-wide one, else the native rule (the
    /// fallback strategy), unwrapped, under the one set of rules this
    /// environment runs ([`DeliveryRules::shipped`]): the controller's
    /// machine alone applies the fallback, the refusal of `naive` and, on
    /// a history mismatch the policy cannot answer, its model-checked rule.
    pub(crate) fn distribution_for(&self, replica_id: u64) -> lockstep_controller::Distribution {
        lockstep_controller::Distribution {
            policy: self.policy_for(replica_id),
            rules: DeliveryRules::shipped(
                self.allow_naive.load(std::sync::atomic::Ordering::Relaxed),
            ),
        }
    }

    /// The distribution policy of [`Self::distribution_for`] (also what a
    /// policy swap hands a running controller).
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
                Ok(p) => return Box::new(p),
                Err(e) => tracing::error!(
                    path = %path.display(),
                    fallback = %DeliveryRules::FALLBACK,
                    "distribution policy failed to load; using the native rule, the fallback strategy: {e}"
                ),
            }
        }
        Box::new(FixedStrategy(DeliveryRules::FALLBACK))
    }

    /// A controller of `replica` driving the processes `status` lists
    /// towards `history`, with the replica's policy; an error if `status`
    /// does not name the replica's addresses.
    pub(crate) fn controller_for(
        &self,
        replica: &Replica,
        status: &ServiceStatus,
        history: CommandHistory,
        (command_log, session_key): (
            Option<lockstep_command_log::LogLocation>,
            Option<lockstep_protocol::SessionKey>,
        ),
        epoch: u64,
    ) -> Result<Controller, String> {
        let addrs = self.addrs_for(replica, status, (command_log, session_key))?;
        Ok(Controller::start_distributing(
            addrs,
            epoch,
            history,
            self.distribution_for(replica.id),
            self.timeouts.clone(),
        ))
    }

    /// What a controller of `replica` needs to reach the processes
    /// `status` lists; an error if `status` does not name their addresses.
    pub(crate) fn addrs_for(
        &self,
        replica: &Replica,
        status: &ServiceStatus,
        (command_log, session_key): (
            Option<lockstep_command_log::LogLocation>,
            Option<lockstep_protocol::SessionKey>,
        ),
    ) -> Result<lockstep_controller::ReplicaAddrs, String> {
        let mut addrs = lockstep_launch::replica_addrs(status, replica.config.workers_per_process)
            .map_err(|e| e.to_string())?;
        addrs.command_log = command_log;
        addrs.session_key = session_key;
        addrs.max_frame_len = self
            .max_frame_len
            .load(std::sync::atomic::Ordering::Relaxed);
        Ok(addrs)
    }

    /// Makes `controller` replica `replica`'s and starts its watcher (the
    /// one before, if any, is shut down).
    fn start(&self, replica: &Replica, controller: Controller, restarter: Restarter) {
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
        self.remove_standby(replica_id);
        self.reads
            .lock()
            .expect("poisoned")
            .retain(|(id, _), _| *id != replica_id);
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

#[cfg(test)]
mod tests;
