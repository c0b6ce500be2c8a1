//! Applying one command on one worker, once its strategy let it through:
//! building a dataflow from its description, writing input, compaction and
//! drops, queuing peeks and subscribes. Every command applied here goes into
//! the worker's history.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::rc::Rc;

use differential_dataflow::input::InputSession;
use differential_dataflow::trace::TraceReader;
use lockstep_protocol::{
    Command, CommandKind, CreationLogEntry, DataflowDescription, ErrorKind, Frontier, PeekResult,
    Row, Timestamp, Update, WriteInput,
};
use timely::dataflow::operators::vec::Map;
use timely::dataflow::operators::Probe;
use timely::dataflow::ProbeHandle;
use timely::progress::Antichain;
use timely::worker::Worker;

use crate::metrics::{ExportLabels, METRICS};

use crate::family::Coll;
use crate::family::{prepare, Prepared};
use crate::worker::{ArrangedRow, ExportState, FromWorker, Installed, SubState, Tap, WorkerState};

/// The worker of the replica that introduces an update of `row`: the rule
/// the controller splits writes by ([`lockstep_protocol::row_owner`]).
pub fn owner(row: &Row, peers: usize) -> usize {
    lockstep_protocol::row_owner(row, peers)
}

/// What a worker introduces for a session start's write of a whole
/// collection (`updates`, consolidated and compacted to the controller's
/// since, with the new upper `upper`), given what it introduced so far
/// (`store`, its rows below `store.upper`): the difference between the
/// collection at `store.upper` and what the store holds, at `store.upper`,
/// then the updates after it. The dataflows then accumulate the collection
/// at every time from the since on (below it the collection's times were
/// advanced, and reads are refused). A worker in step with the writes gets
/// exactly the updates at or after its upper (the rest cancels); one that
/// missed writes which the controller compacted past its upper (their
/// updates, and every older one, now sit at the since) gets what it holds
/// retracted at its upper and the collection at the since: never the
/// collection a second time.
fn whole_write(
    store: &super::InputStore,
    updates: Vec<Update>,
    upper: Timestamp,
    peers: usize,
    index: usize,
) -> Vec<Update> {
    let at = store.upper();
    if upper <= at {
        return Vec::new();
    }
    let mut fresh: Vec<Update> = updates
        .into_iter()
        .filter(|u| owner(&u.row, peers) == index)
        .map(|mut u| {
            u.time = u.time.max(at);
            u
        })
        .collect();
    fresh.extend(store.updates().map(|u| Update {
        row: u.row.clone(),
        time: at,
        diff: -u.diff,
    }));
    lockstep_protocol::history::consolidate(fresh)
}

impl WorkerState {
    /// Applies one command now. It enters the history unless it was refused
    /// or is a StatusRequest.
    pub(crate) fn apply(&mut self, worker: &mut Worker, cmd: Command) {
        let seqno = cmd.seqno;
        self.applied_seqno = seqno;
        let kind = match cmd.kind {
            CommandKind::WriteInput(w) => return self.apply_write(seqno, w),
            kind => kind,
        };
        match &kind {
            CommandKind::Hello(_) => {}
            CommandKind::WriteInput(_) => unreachable!("a write is applied by apply_write"),
            CommandKind::StatusRequest { full } => {
                self.send(FromWorker::Status(self.status(*full)));
                return;
            }
            CommandKind::InitializationComplete => self.replaying_start = None,
            CommandKind::CreateInstance(_)
            | CommandKind::UpdateConfiguration(_)
            | CommandKind::Schedule { .. } => {}
            CommandKind::CreateDataflow(desc) => {
                if let Some(inst) = self.dataflows.get(&desc.id) {
                    if inst.hash != desc.hash() {
                        self.error(
                            seqno,
                            ErrorKind::InvalidCommand,
                            format!(
                                "dataflow {} already exists with another description",
                                desc.id
                            ),
                        );
                        return;
                    }
                    // Same description: kept (reconciliation), nothing to build.
                } else {
                    let prepared = match prepare(self.family.as_ref(), desc) {
                        Ok(prepared) => prepared,
                        Err(e) => {
                            self.error(
                                seqno,
                                ErrorKind::InvalidCommand,
                                format!("dataflow {}: {e}", desc.id),
                            );
                            return;
                        }
                    };
                    if let Some(c) = desc
                        .exports
                        .iter()
                        .find(|e| self.collections.contains_key(&e.collection_id))
                    {
                        self.error(
                            seqno,
                            ErrorKind::InvalidCommand,
                            format!("collection {} already exists", c.collection_id),
                        );
                        return;
                    }
                    self.build(worker, desc.clone(), prepared.as_ref());
                }
            }
            CommandKind::AllowCompaction {
                collection_id,
                frontier,
            } => {
                if !self.allow_compaction(worker, *collection_id, *frontier) {
                    self.error(
                        seqno,
                        ErrorKind::InvalidCommand,
                        format!("AllowCompaction names unknown collection {collection_id}"),
                    );
                    return;
                }
            }
            CommandKind::Peek(p) => self.peeks.push(p.clone()),
            CommandKind::CancelPeek { peek_id } => {
                if let Some(pos) = self.peeks.iter().position(|p| p.peek_id == *peek_id) {
                    self.peeks.remove(pos);
                    self.history.retire_peek(*peek_id);
                    self.send(FromWorker::Peek {
                        worker: self.index,
                        peek_id: *peek_id,
                        result: PeekResult::Canceled,
                    });
                }
            }
            CommandKind::CancelSubscribe { subscribe_id } => {
                if let Some(s) = self.subs.remove(subscribe_id) {
                    self.forget_subscription(s.sub.collection_id, *subscribe_id);
                }
            }
            CommandKind::Subscribe(s) => {
                if let Some(df) = self.collections.get(&s.collection_id) {
                    let export = &self.dataflows[df].exports[&s.collection_id];
                    // Below the compaction frontier the stream starts at the
                    // frontier: a subscription the controller continues in a
                    // new session (it replays it with its first as_of) was
                    // rebuilt from inputs compacted to at most the last time
                    // it passed on, which it drops as already sent (the
                    // environment's read holds, I5). The history keeps the
                    // command as sent.
                    let mut sub = s.clone();
                    sub.as_of = sub.as_of.max(export.since);
                    self.subs
                        .insert(s.subscribe_id, SubState { sub, lower: None });
                } else {
                    self.error(
                        seqno,
                        ErrorKind::InvalidCommand,
                        format!(
                            "subscribe {} names unknown collection {}",
                            s.subscribe_id, s.collection_id
                        ),
                    );
                    return;
                }
            }
        }
        self.history.push(kind);
    }

    /// Applies a write, or holds it until its last part arrives; it enters
    /// the history whole, once applied.
    fn apply_write(&mut self, seqno: u64, mut whole: WriteInput) {
        if let Some(u) = whole.updates.iter().find(|u| u.time >= whole.upper) {
            self.error(
                seqno,
                ErrorKind::InvalidCommand,
                format!(
                    "WriteInput to {}: update at time {} is not below the new upper {}",
                    whole.collection_id, u.time, whole.upper
                ),
            );
            return;
        }
        if whole.more {
            // Not applied (nor history) before the last part.
            self.write_parts
                .entry(whole.collection_id)
                .or_default()
                .append(&mut whole.updates);
            return;
        }
        if let Some(mut parts) = self.write_parts.remove(&whole.collection_id) {
            parts.append(&mut whole.updates);
            whole.updates = parts;
        }
        // The worker's history keeps a write's digest, not its rows
        // (`CommandHistory::summarizing`): the digest goes in first (the
        // controller's, or computed here), then the rows go on, not copied.
        debug_assert!(self.history.is_summarizing());
        let mut whole = whole.digested();
        let updates = std::mem::take(&mut whole.updates);
        let (collection_id, upper) = (whole.collection_id, whole.upper);
        self.history.push(CommandKind::WriteInput(whole));
        self.write_input(collection_id, updates, upper);
    }

    fn write_input(&mut self, collection_id: u64, updates: Vec<Update>, upper: Timestamp) {
        let store = self.inputs.entry(collection_id).or_default();
        let whole = self
            .replaying_start
            .as_mut()
            .is_some_and(|replayed| replayed.insert(collection_id));
        let fresh: Vec<Update> = if whole {
            whole_write(store, updates, upper, self.peers, self.index)
        } else {
            updates
                .into_iter()
                .filter(|u| u.time >= store.upper() && owner(&u.row, self.peers) == self.index)
                .collect()
        };
        let new_upper = store.upper().max(upper);
        tracing::trace!(
            worker = self.index,
            collection = collection_id,
            fresh = fresh.len(),
            new_upper,
            "write input"
        );
        for (dataflow_id, inst) in self.dataflows.iter_mut() {
            for (id, session) in &mut inst.sessions {
                if *id == collection_id {
                    self.unsettled.insert(*dataflow_id);
                    for u in &fresh {
                        session.update_at(u.row.clone(), u.time, u.diff);
                    }
                    session.advance_to(new_upper);
                    session.flush();
                }
            }
        }
        // The store keeps the fresh updates themselves, not another copy.
        store.append_undigested(fresh, new_upper);
    }

    fn build(&mut self, worker: &mut Worker, desc: DataflowDescription, prepared: &dyn Prepared) {
        let timely_index = worker.next_dataflow_index();
        let hash = desc.hash();
        let name = format!("dataflow-{}-{}", desc.id, desc.debug_name);
        let (mut sessions, exports) = worker.dataflow_named::<u64, _, _>(&name, |scope| {
            let mut sessions = Vec::new();
            let mut colls: BTreeMap<u64, Coll<'_>> = BTreeMap::new();
            for &id in &desc.inputs {
                let mut session = InputSession::new();
                colls.insert(id, session.to_collection(scope));
                sessions.push((id, session));
            }
            let mut exports = BTreeMap::new();
            for (collection_id, collection) in prepared.render(&colls) {
                let tap: Rc<RefCell<Tap>> = Rc::default();
                let tap2 = Rc::clone(&tap);
                let probe = ProbeHandle::new();
                let arranged = collection.map(ArrangedRow).arrange_by_self();
                let trace = arranged.trace.clone();
                // The tap takes each change as it is (one copy of its row,
                // out of the arrangement), a copy more per subscription.
                arranged
                    .as_collection(|k: &ArrangedRow, _v: &()| k.0.clone())
                    .inner
                    .map(move |(row, time, diff): (Row, u64, i64)| {
                        let u = Update { row, time, diff };
                        let mut tap = tap2.borrow_mut();
                        for buf in tap.subs.values_mut() {
                            buf.push(u.clone());
                        }
                        tap.recent.push(u);
                    })
                    .probe_with(&probe);
                exports.insert(
                    collection_id,
                    ExportState {
                        trace,
                        probe,
                        tap,
                        since: 0,
                        reported: None,
                        lag: None,
                    },
                );
            }
            (sessions, exports)
        });
        for (id, session) in &mut sessions {
            let store = self.inputs.entry(*id).or_default();
            for u in store.updates() {
                session.update_at(u.row.clone(), u.time, u.diff);
            }
            session.advance_to(store.upper());
            session.flush();
        }
        for id in exports.keys() {
            self.collections.insert(*id, desc.id);
        }
        tracing::debug!(
            worker = self.index,
            dataflow = desc.id,
            timely_index,
            "built dataflow"
        );
        self.creation_log.push(CreationLogEntry {
            timely_index: timely_index as u64,
            dataflow_id: desc.id,
            description_hash: hash,
        });
        self.unsettled.insert(desc.id);
        self.dataflows.insert(
            desc.id,
            Installed {
                desc,
                hash,
                timely_index,
                sessions,
                exports,
            },
        );
    }

    /// Returns false if the collection is unknown. An input collection's
    /// store compacts (dataflows built later read it at `frontier` or later);
    /// an export's arrangement compacts, or the export goes (`None`).
    fn allow_compaction(
        &mut self,
        worker: &mut Worker,
        collection: u64,
        frontier: Frontier,
    ) -> bool {
        let Some(&df) = self.collections.get(&collection) else {
            let Some(store) = self.inputs.get_mut(&collection) else {
                return false;
            };
            if let Some(since) = frontier {
                store.compact(since);
            }
            return true;
        };
        let inst = self
            .dataflows
            .get_mut(&df)
            .expect("collections index is in sync");
        match frontier {
            Some(t) => {
                let export = inst.exports.get_mut(&collection).expect("in sync");
                if t > export.since {
                    export.since = t;
                    export
                        .trace
                        .set_logical_compaction(Antichain::from_elem(t).borrow());
                    export
                        .trace
                        .set_physical_compaction(Antichain::from_elem(t).borrow());
                }
            }
            None => {
                inst.exports.remove(&collection);
                let now_empty = inst.exports.is_empty();
                self.collections.remove(&collection);
                self.send(FromWorker::Frontier {
                    worker: self.index,
                    collection,
                    upper: None,
                });
                for p in self.peeks.iter().filter(|p| p.collection_id == collection) {
                    let _ = self.tx.send(FromWorker::Peek {
                        worker: self.index,
                        peek_id: p.peek_id,
                        result: PeekResult::Error(format!("collection {collection} was dropped")),
                    });
                }
                self.peeks.retain(|p| p.collection_id != collection);
                self.subs.retain(|_, s| s.sub.collection_id != collection);
                if now_empty {
                    self.drop_dataflow(worker, df);
                }
            }
        }
        true
    }

    /// Drops an installed dataflow (nothing if `id` is not installed).
    pub(crate) fn drop_dataflow(&mut self, worker: &mut Worker, id: u64) {
        self.unsettled.remove(&id);
        if let Some(inst) = self.dataflows.remove(&id) {
            for c in &inst.desc.exports {
                self.collections.remove(&c.collection_id);
                METRICS.frontier_lag.remove(&ExportLabels {
                    export: c.collection_id,
                    worker: self.index as u64,
                });
            }
            let timely_index = inst.timely_index;
            drop(inst);
            worker.drop_dataflow(timely_index);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn up(v: i64, time: u64, diff: i64) -> Update {
        Update {
            row: lockstep_plan::row(&[v]),
            time,
            diff,
        }
    }

    fn store(updates: Vec<Update>, upper: u64) -> super::super::InputStore {
        let mut store = super::super::InputStore::default();
        store.append_undigested(updates, upper);
        store
    }

    /// Sums each row's diffs at or before `t`.
    fn at(updates: &[Update], t: u64) -> BTreeMap<Row, i64> {
        let mut m = BTreeMap::new();
        for u in updates.iter().filter(|u| u.time <= t) {
            *m.entry(u.row.clone()).or_insert(0) += u.diff;
        }
        m.retain(|_, d| *d != 0);
        m
    }

    #[test]
    fn a_worker_in_step_gets_only_what_came_after_its_upper() {
        let s = store(vec![up(1, 0, 1), up(2, 3, 1), up(1, 4, -1)], 5);
        // The controller's history: consolidated, compacted to 2.
        let whole = vec![
            up(1, 2, 1),
            up(2, 3, 1),
            up(1, 4, -1),
            up(3, 5, 1),
            up(4, 6, 1),
        ];
        let mut fresh = whole_write(&s, whole, 7, 1, 0);
        fresh.sort_by_key(|u| u.time);
        assert_eq!(fresh, vec![up(3, 5, 1), up(4, 6, 1)]);
        // Nothing new: nothing.
        assert!(whole_write(&s, vec![up(2, 3, 1)], 5, 1, 0).is_empty());
    }

    #[test]
    fn a_worker_that_missed_writes_compacted_past_it_gets_them_once() {
        // The worker holds rows 1 and 2 (upper 2); it missed the write of
        // row 3 at time 2 and the retraction of row 1 at 3; the controller
        // compacted the collection to 4.
        let s = store(vec![up(1, 0, 1), up(2, 1, 1)], 2);
        let whole = vec![up(2, 4, 1), up(3, 4, 1), up(5, 5, 1)];
        let fresh = whole_write(&s, whole.clone(), 6, 1, 0);
        let mut all = s.to_vec();
        all.extend(fresh.clone());
        for t in 4..6 {
            assert_eq!(at(&all, t), at(&whole, t), "at {t}");
        }
        assert!(fresh.iter().all(|u| u.time >= 2), "{fresh:?}");
        // The old filter (updates at or after the worker's upper) would
        // have introduced rows 2 and 3 again: row 2 twice.
        let old: Vec<Update> = whole.into_iter().filter(|u| u.time >= 2).collect();
        let mut twice = s.to_vec();
        twice.extend(old);
        assert_eq!(at(&twice, 5)[&lockstep_plan::row(&[2])], 2);
    }

    #[test]
    fn a_worker_writes_only_the_rows_it_owns() {
        let s = store(Vec::new(), 0);
        let whole: Vec<Update> = (0..64).map(|v| up(v, 0, 1)).collect();
        let mut seen = 0;
        for index in 0..4 {
            let fresh = whole_write(&s, whole.clone(), 1, 4, index);
            assert!(fresh.iter().all(|u| owner(&u.row, 4) == index));
            seen += fresh.len();
        }
        assert_eq!(seen, 64);
    }
}
