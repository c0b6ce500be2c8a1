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

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;

use lockstep_catalog::{CatalogState, Replica};
use lockstep_controller::{launch, Controller, ControllerError, Timeouts};
use lockstep_orchestrator::ServiceStatus;
use lockstep_policy::{FixedStrategy, Strategy};
use lockstep_protocol::proto as wire;
use lockstep_protocol::{
    CommandHistory, CommandKind, DataflowDescription, Export, Row, SubscribeBatch, Timestamp,
    Update, WriteInput,
};
use prost::Message;
use tokio::sync::mpsc;

use crate::{EnvError, Environment};

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
    /// The request makes no sense.
    #[error("invalid request: {0}")]
    Invalid(String),
    /// The replica's controller failed or timed out.
    #[error(transparent)]
    Controller(#[from] ControllerError),
    /// The catalog holds something this build cannot decode.
    #[error("catalog entry does not decode: {0}")]
    Corrupt(String),
}

/// The controllers of the replicas, by replica ID.
pub struct Compute {
    controllers: Mutex<BTreeMap<u64, Controller>>,
    timeouts: Timeouts,
    distribution: Mutex<Option<std::path::PathBuf>>,
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
            timeouts: Timeouts::default(),
            distribution: Mutex::new(None),
        }
    }
}

impl Compute {
    /// The controller of a replica, if one runs.
    pub fn controller(&self, replica_id: u64) -> Option<Controller> {
        self.controllers
            .lock()
            .expect("poisoned")
            .get(&replica_id)
            .cloned()
    }

    /// Uses the WASM distribution policy at `path` for every controller
    /// started from now on (`None`: the native rule, barrier for everything).
    pub fn set_distribution_policy(&self, path: Option<std::path::PathBuf>) {
        *self.distribution.lock().expect("poisoned") = path;
    }

    /// The distribution policy for one controller: the WASM policy wrapped so
    /// that a failing call falls back to `barrier` (the safe default), or the
    /// native rule.
    fn policy(&self) -> Box<dyn lockstep_policy::DistributionPolicy + Send> {
        let path = self.distribution.lock().expect("poisoned").clone();
        if let Some(path) = path {
            match lockstep_policy_host::WasmDistributionPolicy::load(&path, Default::default()) {
                Ok(p) => {
                    return Box::new(lockstep_policy_host::SafeDistribution::new(
                        p,
                        Strategy::Barrier,
                    ))
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
        epoch: u64,
        replica: &Replica,
        status: &ServiceStatus,
        history: CommandHistory,
    ) {
        let addrs = match launch::replica_addrs(status, replica.config.workers_per_process) {
            Ok(a) => a,
            Err(e) => {
                tracing::error!(replica = %replica.name, "cannot drive replica: {e}");
                return;
            }
        };
        let policy = self.policy();
        let controller = Controller::start(addrs, epoch, history, policy, self.timeouts.clone());
        let mut events = controller.events();
        let name = replica.name.clone();
        tokio::spawn(async move {
            while let Ok(e) = events.recv().await {
                tracing::info!(replica = %name, event = ?e, "controller event");
            }
        });
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

/// Decodes a catalog dataflow.
pub fn decode_dataflow(bytes: &[u8]) -> Result<DataflowDescription, ComputeError> {
    let w = wire::DataflowDescription::decode(bytes)
        .map_err(|e| ComputeError::Corrupt(e.to_string()))?;
    DataflowDescription::try_from(w).map_err(|e| ComputeError::Corrupt(e.to_string()))
}

fn decode_write(bytes: &[u8]) -> Result<WriteInput, ComputeError> {
    let w = wire::WriteInput::decode(bytes).map_err(|e| ComputeError::Corrupt(e.to_string()))?;
    Ok(WriteInput {
        collection_id: w.collection_id,
        updates: w
            .updates
            .into_iter()
            .map(|u| Update {
                row: u.row,
                time: u.time,
                diff: u.diff,
            })
            .collect(),
        upper: w.upper,
    })
}

fn encode_write(w: &WriteInput) -> Vec<u8> {
    wire::WriteInput {
        collection_id: w.collection_id,
        updates: w
            .updates
            .iter()
            .map(|u| wire::Update {
                row: u.row.clone(),
                time: u.time,
                diff: u.diff,
            })
            .collect(),
        upper: w.upper,
    }
    .encode_to_vec()
}

/// The target command history of a replica, from the catalog: its input
/// writes, then its dataflows in creation order.
pub fn history_for(view: &CatalogState, replica_id: u64) -> Result<CommandHistory, ComputeError> {
    let mut h = CommandHistory::new();
    h.push(CommandKind::CreateInstance(Default::default()));
    for w in view
        .input_writes
        .iter()
        .filter(|w| w.replica_id == replica_id)
    {
        h.push(CommandKind::WriteInput(decode_write(&w.write)?));
    }
    for d in view
        .dataflows
        .values()
        .filter(|d| d.replica_id == replica_id)
    {
        let desc = decode_dataflow(&d.description)?;
        h.push(CommandKind::CreateDataflow(desc.clone()));
        h.push(CommandKind::Schedule {
            dataflow_id: desc.id,
        });
    }
    h.reduce();
    Ok(h)
}

/// The current upper of every input collection of a replica.
fn input_uppers(view: &CatalogState, replica_id: u64) -> Result<BTreeMap<u64, u64>, ComputeError> {
    let mut uppers = BTreeMap::new();
    for w in view
        .input_writes
        .iter()
        .filter(|w| w.replica_id == replica_id)
    {
        let write = decode_write(&w.write)?;
        let e = uppers.entry(write.collection_id).or_insert(0);
        *e = (*e).max(write.upper);
    }
    Ok(uppers)
}

impl Environment {
    fn replica_named(&self, name: &str) -> Result<Replica, ComputeError> {
        self.view()
            .replicas
            .into_values()
            .find(|r| r.name == name)
            .ok_or_else(|| ComputeError::NoSuchReplica(name.to_string()))
    }

    fn controller_of(&self, replica: &Replica) -> Result<Controller, ComputeError> {
        self.compute.controller(replica.id).ok_or_else(|| {
            ComputeError::Invalid(format!(
                "replica {:?} has no running controller yet",
                replica.name
            ))
        })
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
            let history = history_for(&view, replica.id)?;
            tracing::info!(replica = %replica.name, commands = history.len(), "driving replica");
            self.compute.start(self.epoch, replica, status, history);
        }
        Ok(())
    }

    pub(crate) fn compute_started(&self, replica: &Replica, status: &ServiceStatus) {
        self.compute.start(
            self.epoch,
            replica,
            status,
            history_for(&self.view(), replica.id).unwrap_or_default(),
        );
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
        let _ops = self.ops.lock().await;
        self.check_not_halted()?;
        let replica = self.replica_named(replica_name)?;
        if exports.is_empty() {
            return Err(ComputeError::Invalid(
                "a dataflow must export at least one collection".into(),
            ));
        }
        let declared: BTreeSet<u64> = inputs.iter().copied().collect();
        let view = self.view();
        let mut used: BTreeSet<u64> = BTreeSet::new();
        for d in view
            .dataflows
            .values()
            .filter(|d| d.replica_id == replica.id)
        {
            used.extend(
                decode_dataflow(&d.description)?
                    .exports
                    .iter()
                    .map(|e| e.collection_id),
            );
        }
        for e in &exports {
            if let Some(c) = e.plan.inputs().into_iter().find(|c| !declared.contains(c)) {
                return Err(ComputeError::Invalid(format!(
                    "export {} reads collection {c}, which is not among the inputs {inputs:?}",
                    e.collection_id
                )));
            }
            if declared.contains(&e.collection_id) || !used.insert(e.collection_id) {
                return Err(ComputeError::Invalid(format!(
                    "collection ID {} is already in use on replica {replica_name:?}",
                    e.collection_id
                )));
            }
        }
        let mut desc = DataflowDescription {
            id: 0,
            as_of,
            inputs,
            exports,
            debug_name: debug_name.to_string(),
        };
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
        self.controller_of(&replica)?
            .create_dataflow(desc.clone())?;
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
        let current = input_uppers(&self.view(), replica.id)?
            .get(&collection_id)
            .copied()
            .unwrap_or(0);
        if upper < current {
            return Err(ComputeError::Invalid(format!(
                "upper {upper} is below collection {collection_id}'s current upper {current}"
            )));
        }
        if let Some(u) = updates.iter().find(|u| u.time < current || u.time >= upper) {
            return Err(ComputeError::Invalid(format!(
                "update at time {} is outside [{current}, {upper})",
                u.time
            )));
        }
        let write = WriteInput {
            collection_id,
            updates,
            upper,
        };
        {
            let mut catalog = self.catalog.lock().expect("poisoned");
            let record = catalog
                .append_input(replica.id, collection_id, &encode_write(&write))
                .map_err(|e| self.catalog_error(e))?;
            self.view
                .lock()
                .expect("poisoned")
                .input_writes
                .push(record);
        }
        self.controller_of(&replica)?
            .write_input(collection_id, write.updates, write.upper)?;
        Ok(())
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
    ) -> Result<mpsc::UnboundedReceiver<SubscribeBatch>, ComputeError> {
        self.check_not_halted()?;
        let replica = self.replica_named(replica_name)?;
        Ok(self
            .controller_of(&replica)?
            .subscribe(collection_id, as_of)?)
    }
}
