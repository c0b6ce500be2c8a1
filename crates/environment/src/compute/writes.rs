//! Writes to input collections, stored in groups (group commit): a write
//! that arrives while another is being stored waits for the next group,
//! and the first of the waiting writers to run stores every waiting write
//! in one catalog transaction (one commit, one flush). A write is still
//! acknowledged only after the transaction that stored it committed;
//! each write is checked, recorded and sent on its own, in arrival order.

use std::collections::VecDeque;

use tokio::sync::oneshot;

use super::requests::encode_write;
use super::*;

/// A write waiting for its group.
struct PendingWrite {
    id: u64,
    replica_name: String,
    collection_id: u64,
    updates: Vec<Update>,
    upper: Timestamp,
    done: oneshot::Sender<Result<(), ComputeError>>,
}

/// The writes waiting for the next group, in arrival order.
#[derive(Default)]
pub(crate) struct PendingWrites {
    queue: Mutex<VecDeque<PendingWrite>>,
    next_id: std::sync::atomic::AtomicU64,
}

impl PendingWrites {
    /// The next group: the waiting writes in arrival order, at most one per
    /// input collection (a second write to a collection waits for the next
    /// group: its checks depend on the upper the first one sets).
    fn next_group(&self) -> Vec<PendingWrite> {
        let mut queue = self.queue.lock().expect("poisoned");
        let mut seen = BTreeSet::new();
        let (group, rest): (Vec<_>, Vec<_>) = queue
            .drain(..)
            .partition(|w| seen.insert((w.replica_name.clone(), w.collection_id)));
        queue.extend(rest);
        group
    }

    /// Takes back a write no group took yet (its writer went away).
    fn withdraw(&self, id: u64) {
        self.queue.lock().expect("poisoned").retain(|w| w.id != id);
    }
}

/// Withdraws its write when dropped: a writer that goes away (a client
/// that hung up) before any group took its write leaves nothing behind.
/// Once a group took it, the write is stored and sent as if it stayed.
struct Withdraw<'a>(&'a PendingWrites, u64);

impl Drop for Withdraw<'_> {
    fn drop(&mut self) {
        self.0.withdraw(self.1);
    }
}

/// A write that passed its checks, with what storing and sending it needs.
struct Checked {
    replica: Replica,
    controller: Controller,
    write: WriteInput,
    encoded: Vec<u8>,
}

/// Runs `f`, which blocks (a catalog commit waits for its fsync), with the
/// runtime's other tasks handed to its other workers (`block_in_place`) on
/// a multi-threaded runtime, as `lockstep serve` runs; inline on a
/// current-thread one. Unlike a spawned blocking task it cannot be dropped
/// half way: a group, once taken, is stored and sent whole.
fn off_runtime<T>(f: impl FnOnce() -> T) -> T {
    use tokio::runtime::{Handle, RuntimeFlavor};
    match Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(RuntimeFlavor::MultiThread) => tokio::task::block_in_place(f),
        _ => f(),
    }
}

impl Environment {
    /// Appends updates to an input collection: recorded in the catalog, then
    /// sent. Concurrent writes are stored in one transaction (see the
    /// module docs); the answer is this write's own.
    pub async fn write_input(
        &self,
        replica_name: &str,
        collection_id: u64,
        updates: Vec<Update>,
        upper: Timestamp,
    ) -> Result<(), ComputeError> {
        let pending = &self.pending_writes;
        let id = pending
            .next_id
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (done, mut answer) = oneshot::channel();
        pending
            .queue
            .lock()
            .expect("poisoned")
            .push_back(PendingWrite {
                id,
                replica_name: replica_name.to_string(),
                collection_id,
                updates,
                upper,
                done,
            });
        let _withdraw = Withdraw(pending, id);
        let _ops = self.ops.lock().await;
        loop {
            match answer.try_recv() {
                Ok(result) => return result,
                // Not stored yet: this writer stores the next group. Each
                // group takes the oldest waiting write, so this ends.
                Err(oneshot::error::TryRecvError::Empty) => off_runtime(|| self.store_group()),
                Err(oneshot::error::TryRecvError::Closed) => {
                    return Err(ComputeError::Unavailable(
                        "the write was dropped before it was stored; nothing was written".into(),
                    ))
                }
            }
        }
    }

    /// Stores the next group of waiting writes and answers each. Called
    /// with the operations lock held.
    fn store_group(&self) {
        let mut checked = Vec::new();
        for w in self.pending_writes.next_group() {
            match self.check_write(&w.replica_name, w.collection_id, w.updates, w.upper) {
                Ok(c) => checked.push((c, w.done)),
                Err(e) => {
                    let _ = w.done.send(Err(e));
                }
            }
        }
        // A group that fails is stored write by write: each write gets its
        // own answer (a replica dropped meanwhile fails only its writes).
        let group: Vec<&Checked> = checked.iter().map(|(c, _)| c).collect();
        let stored_together = group.len() > 1 && self.store(&group).is_ok();
        for (c, done) in checked {
            let result = if stored_together {
                Ok(())
            } else {
                self.store(&[&c])
            };
            let _ = done.send(result.and_then(|()| self.send_stored(c)));
        }
    }

    /// Checks a write against the replica's namespace, its rows and its
    /// collection's upper; nothing is written.
    fn check_write(
        &self,
        replica_name: &str,
        collection_id: u64,
        updates: Vec<Update>,
        upper: Timestamp,
    ) -> Result<Checked, ComputeError> {
        self.check_not_halted()?;
        let replica = self.replica_named(replica_name)?;
        let (exported, _) = self.namespace(&replica)?;
        if let Some(d) = exported.get(&collection_id) {
            return Err(ComputeError::Invalid(format!(
                "collection {collection_id} is an export of dataflow {d}, not an input collection"
            )));
        }
        // A row no dataflow of the built-in family could read is refused
        // before it is recorded; another family's rows are its own.
        if self.compute.builds_plans() {
            if let Some((i, e)) = updates
                .iter()
                .enumerate()
                .find_map(|(i, u)| lockstep_plan::rows::check(&u.row).err().map(|e| (i, e)))
            {
                return Err(ComputeError::Invalid(format!("update {i}: {e}")));
            }
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
        let encoded = encode_write(&write);
        Ok(Checked {
            replica,
            controller,
            write,
            encoded,
        })
    }

    /// Stores `writes` in one catalog transaction.
    fn store(&self, writes: &[&Checked]) -> Result<(), ComputeError> {
        let rows: Vec<(u64, u64, &[u8])> = writes
            .iter()
            .map(|c| (c.replica.id, c.write.collection_id, c.encoded.as_slice()))
            .collect();
        self.catalog
            .lock()
            .expect("poisoned")
            .append_inputs(&rows)
            .map_err(|e| self.catalog_error(e))?;
        let metrics = self.compute.metrics();
        metrics.input_commits.inc();
        metrics.input_writes_stored.inc_by(writes.len() as u64);
        Ok(())
    }

    /// Records a stored write in memory (consolidating the stored writes
    /// when due) and sends it, with the compactions it allows, to the
    /// replica (and its standby, if an upgrade keeps answering).
    fn send_stored(&self, c: Checked) -> Result<(), ComputeError> {
        let Checked {
            replica,
            controller,
            write,
            ..
        } = c;
        let collection_id = write.collection_id;
        let since = {
            let mut catalog = self.catalog.lock().expect("poisoned");
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
        let compactions = match since {
            Some(_) => self.compactions(&replica, Some(collection_id))?,
            None => Vec::new(),
        };
        let compact = |c: &Controller| -> Result<(), ControllerError> {
            for (collection, since) in &compactions {
                c.allow_compaction(*collection, Some(*since))?;
            }
            Ok(())
        };
        // A standby (an upgrade that keeps answering) takes a copy first.
        self.compute.to_standby(replica.id, |c| {
            c.write_input(collection_id, write.updates.clone(), write.upper)?;
            compact(c)
        });
        controller.write_input(collection_id, write.updates, write.upper)?;
        Ok(compact(&controller)?)
    }
}
