//! The environment's compute requests: a replica's target history from the
//! catalog, and creating and dropping dataflows, writes, peeks and
//! subscribes (each a catalog transaction first, then the controller call).

use super::*;

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
/// continued, no batch digest), from its rows where they are (copying them
/// into the wire form first cost as much as the encoding).
pub(super) fn encode_write(w: &WriteInput) -> Vec<u8> {
    lockstep_protocol::encode_whole_write(w.collection_id, &w.updates, w.upper)
}

/// The largest since among a dataflow's inputs.
pub(super) fn since_of(desc: &DataflowDescription, sinces: &BTreeMap<u64, Timestamp>) -> Timestamp {
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

    pub(super) fn controller_of(&self, replica: &Replica) -> Result<Controller, ComputeError> {
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
    pub(super) fn namespace(
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
    pub(crate) fn dataflows_of(
        &self,
        replica_id: u64,
    ) -> Result<Vec<Arc<DataflowDescription>>, ComputeError> {
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
        let services = self.services().await?;
        for replica in view.replicas.values() {
            let own = ServiceTemplate::service_name(replica.id);
            let Some(status) = services.iter().find(|s| s.name == own) else {
                tracing::warn!(replica = %replica.name, "no service listed; not driving it");
                continue;
            };
            let history = self.history_of(replica.id)?;
            tracing::info!(replica = %replica.name, commands = history.len(), "driving replica");
            self.drive(replica, status, history);
        }
        Ok(())
    }

    pub(crate) fn compute_started(&self, replica: &Replica, status: &ServiceStatus) {
        self.drive(
            replica,
            status,
            self.history_of(replica.id).unwrap_or_default(),
        );
    }

    /// Starts the controller of `replica` (its own processes, which `status`
    /// lists) towards `history`, and its watcher.
    fn drive(&self, replica: &Replica, status: &ServiceStatus, history: CommandHistory) {
        let connection = (self.command_log(replica.id), self.session_key(replica.id));
        match self
            .compute
            .controller_for(replica, status, history, connection, self.epoch)
        {
            Ok(controller) => self.compute.start(replica, controller, self.restarter()),
            Err(e) => tracing::error!(replica = %replica.name, "cannot drive replica: {e}"),
        }
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

    /// Creates a dataflow of the replicas' format on a replica: catalog
    /// transaction, then the replica.
    pub async fn create_dataflow(
        &self,
        replica_name: &str,
        debug_name: &str,
        as_of: Timestamp,
        inputs: Vec<u64>,
        exports: Vec<Export>,
    ) -> Result<DataflowDescription, ComputeError> {
        self.create_dataflow_of("", replica_name, debug_name, as_of, inputs, exports)
            .await
    }

    /// Creates a dataflow of `format` (empty: the replicas' format, which
    /// any other is refused for) on a replica: catalog transaction, then
    /// the replica.
    pub async fn create_dataflow_of(
        &self,
        format: &str,
        replica_name: &str,
        debug_name: &str,
        as_of: Timestamp,
        inputs: Vec<u64>,
        exports: Vec<Export>,
    ) -> Result<DataflowDescription, ComputeError> {
        let ops = self.ops.lock().await;
        self.check_not_halted()?;
        let served = self.compute.format();
        if !format.is_empty() && format != served {
            return Err(ComputeError::Invalid(format!(
                "a dataflow of format {format:?}: this environment's replicas build {served:?}"
            )));
        }
        let plans = served == lockstep_plan::FORMAT;
        let replica = self.replica_named(replica_name)?;
        let mut desc = DataflowDescription {
            id: 0,
            as_of,
            inputs,
            exports,
            debug_name: debug_name.to_string(),
            format: served,
        };
        // What a replica would refuse (the same checks, the built-in family's
        // included, and its decoder's limits) is refused here, before
        // anything is recorded. Another family's descriptions are its
        // replicas' to check (their refusal removes the dataflow below).
        if plans {
            lockstep_plan::check(&desc, self.compute.max_frame_len())
        } else {
            lockstep_protocol::validate::check_dataflow(&desc, self.compute.max_frame_len())
        }
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
        let send = |c: &Controller| -> Result<(), ControllerError> {
            c.create_dataflow(desc.clone())?;
            if since > 0 {
                for e in &desc.exports {
                    c.allow_compaction(e.collection_id, Some(since))?;
                }
            }
            Ok(())
        };
        send(&controller)?;
        self.compute.to_standby(replica.id, send);
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
                if !plans {
                    // The family's own check, which only its replicas run.
                    return Err(ComputeError::Invalid(format!(
                        "replica {:?} refused the dataflow; it was not created: {message}",
                        replica.name
                    )));
                }
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
        self.compute
            .to_standby(record.replica_id, |c| c.drop_dataflow(&desc));
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

    /// The compaction frontiers of a replica's collections: of each input
    /// collection (only `input` if given) with a since above 0, and of each
    /// export of a live dataflow reading it (the largest since among the
    /// dataflow's inputs).
    pub(super) fn compactions(
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
        if timestamp == Timestamp::MAX {
            return Err(ComputeError::OutOfRange(format!(
                "no frontier passes time {timestamp}: a peek there could never be answered"
            )));
        }
        // The peek holds its inputs at its time until it is answered (I5):
        // a replica restarted meanwhile rebuilds what it reads.
        let held = self.hold(&replica, &desc, collection_id, timestamp, "a peek at")?;
        let _release = Release {
            inputs: self.inputs.clone(),
            id: held.id,
        };
        let (reader, _reading) = self.compute.reader(replica.id).ok_or_else(|| {
            ComputeError::Unavailable(format!(
                "replica {:?} has no running controller yet",
                replica.name
            ))
        })?;
        let mut broken = held.broken;
        tokio::select! {
            answer = reader.peek(collection_id, timestamp) => {
                // An answer computed after the hold broke may be wrong.
                let why = broken.borrow().clone();
                match why {
                    Some(why) => Err(ComputeError::OutOfRange(format!("peek at {timestamp} on collection {collection_id}: {why}"))),
                    None => Ok(answer?),
                }
            }
            Ok(()) = broken.changed() => {
                let why = broken.borrow().clone().unwrap_or_default();
                Err(ComputeError::OutOfRange(format!("peek at {timestamp} on collection {collection_id}: {why}")))
            }
        }
    }

    /// Holds the inputs of `desc` (exporting `collection_id`) at `at`, or
    /// says why not: a since already past it.
    fn hold(
        &self,
        replica: &Replica,
        desc: &DataflowDescription,
        collection_id: u64,
        at: Timestamp,
        what: &str,
    ) -> Result<crate::inputs::Held, ComputeError> {
        // A dataflow computes nothing before its as_of.
        if at < desc.as_of {
            return Err(ComputeError::OutOfRange(format!(
                "collection {collection_id} is computed from time {} on (its dataflow's as_of); {what} {at} is below it",
                desc.as_of
            )));
        }
        self.inputs
            .lock()
            .expect("poisoned")
            .hold(replica.id, &desc.inputs, at)
            .map_err(|(_, since)| {
                ComputeError::OutOfRange(format!(
                    "collection {collection_id} is compacted to {since}; {what} {at} is below it"
                ))
            })
    }

    /// Streams a collection's changes from `as_of`.
    pub fn subscribe(
        &self,
        replica_name: &str,
        collection_id: u64,
        as_of: Timestamp,
    ) -> Result<mpsc::Receiver<Result<SubscribeBatch, ComputeError>>, ComputeError> {
        self.check_not_halted()?;
        let replica = self.replica_named(replica_name)?;
        let desc = self.check_exported(&replica, collection_id)?;
        let held = self.hold(
            &replica,
            &desc,
            collection_id,
            as_of,
            "a subscription as of",
        )?;
        let release = Release {
            inputs: self.inputs.clone(),
            id: held.id,
        };
        let rx = self
            .controller_of(&replica)?
            .subscribe(collection_id, as_of)?;
        let (tx, out) = mpsc::channel(SUBSCRIBE_RELAY_BATCHES);
        tokio::spawn(relay_held(rx, tx, held.broken, release, as_of));
        Ok(out)
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

/// Batches a subscription's relay holds between its controller and its
/// client (the controller's own channel bounds what a slow client costs).
const SUBSCRIBE_RELAY_BATCHES: usize = 4;

/// Releases a read hold when dropped (the read ended, or its client went
/// away).
struct Release {
    inputs: Arc<Mutex<crate::inputs::Inputs>>,
    id: u64,
}

impl Drop for Release {
    fn drop(&mut self) {
        self.inputs.lock().expect("poisoned").release(self.id);
    }
}

/// Passes a subscription's batches to its client, moving its read hold to
/// the last time every update of which was passed (the upper - 1: a replica
/// rebuilt from inputs compacted to there continues the stream exactly);
/// ends it with OUT_OF_RANGE, passing nothing more, once the hold is broken.
/// The hold is released when the stream ends or the client goes away.
async fn relay_held(
    mut rx: mpsc::Receiver<Result<SubscribeBatch, ControllerError>>,
    tx: mpsc::Sender<Result<SubscribeBatch, ComputeError>>,
    mut broken: watch::Receiver<Option<String>>,
    release: Release,
    as_of: Timestamp,
) {
    let out_of_range = |why: String| {
        ComputeError::OutOfRange(format!(
            "the subscription ended: {why}; everything before it was exact"
        ))
    };
    loop {
        tokio::select! {
            biased;
            Ok(()) = broken.changed() => {
                let why = broken.borrow().clone();
                if let Some(why) = why {
                    let _ = tx.send(Err(out_of_range(why))).await;
                    return;
                }
            }
            batch = rx.recv() => {
                let batch = match batch {
                    None => return,
                    Some(Err(e)) => {
                        let _ = tx.send(Err(e.into())).await;
                        return;
                    }
                    Some(Ok(batch)) => batch,
                };
                // A batch that arrives after the hold broke may come from a
                // replica rebuilt past it.
                let why = broken.borrow().clone();
                if let Some(why) = why {
                    let _ = tx.send(Err(out_of_range(why))).await;
                    return;
                }
                let upper = batch.upper;
                if tx.send(Ok(batch)).await.is_err() {
                    return;
                }
                match upper {
                    Some(upper) => release
                        .inputs
                        .lock()
                        .expect("poisoned")
                        .advance_hold(release.id, upper.saturating_sub(1).max(as_of)),
                    None => return,
                }
            }
            () = tx.closed() => return,
        }
    }
}
