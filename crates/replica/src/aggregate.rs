//! Merging the responses of a process's workers into one response per process.
//!
//! - A collection's frontier on this process is the meet (minimum) over its
//!   local workers, reported once every local worker has reported, and again
//!   whenever it changes; the empty frontier only when all are empty.
//! - A peek is answered once every local worker answered: rows are summed per
//!   row; any error makes the answer an error; any cancellation cancels it.
//! - A subscription's batch covers `[lower, meet of the workers' uppers)` and
//!   carries every update below that meet.
//!
//! - An answer of a worker that has not yet started the newest session one
//!   of its peers started belongs to the session before: it is dropped, not
//!   merged into the new session's (the new session replays what it needs).
//!
//! The merging itself is `lockstep_protocol::merge`, shared with the controller.

use std::collections::BTreeMap;

use lockstep_protocol::merge::{meet, merge_peek, SubscribeMerge};
use lockstep_protocol::{Frontier, PeekResponse, PeekResult, ResponseKind};

use crate::worker::FromWorker;

/// Merges worker responses of one process.
pub struct Aggregator {
    local_workers: usize,
    session: Option<lockstep_reconcile::Session>,
    /// The session each local worker last started.
    worker_sessions: BTreeMap<usize, lockstep_reconcile::Session>,
    frontiers: BTreeMap<u64, BTreeMap<usize, Frontier>>,
    reported: BTreeMap<u64, Frontier>,
    peeks: BTreeMap<u64, BTreeMap<usize, PeekResult>>,
    subs: BTreeMap<u64, SubscribeMerge>,
}

impl Aggregator {
    /// An aggregator for a process with `local_workers` workers.
    pub fn new(local_workers: usize) -> Self {
        Aggregator {
            local_workers,
            session: None,
            worker_sessions: BTreeMap::new(),
            frontiers: BTreeMap::new(),
            reported: BTreeMap::new(),
            peeks: BTreeMap::new(),
            subs: BTreeMap::new(),
        }
    }

    /// Whether `worker` has not started the newest session yet: what it
    /// answers belongs to an older one.
    fn behind(&self, worker: usize) -> bool {
        self.session
            .is_some_and(|newest| self.worker_sessions.get(&worker) != Some(&newest))
    }

    /// Takes one worker message; returns the process-level responses it completes.
    pub fn on(&mut self, msg: FromWorker) -> Vec<ResponseKind> {
        match &msg {
            FromWorker::Frontier { worker, .. }
            | FromWorker::Peek { worker, .. }
            | FromWorker::Subscribe { worker, .. }
                if self.behind(*worker) =>
            {
                return vec![];
            }
            _ => {}
        }
        match msg {
            FromWorker::NewSession { worker, session } => {
                self.worker_sessions.insert(worker, session);
                if self.session.is_none_or(|s| session > s) {
                    self.session = Some(session);
                    self.frontiers.clear();
                    self.reported.clear();
                    self.peeks.clear();
                    self.subs.clear();
                }
                vec![]
            }
            FromWorker::Status(s) => vec![ResponseKind::Status(s)],
            FromWorker::Error(e) => vec![ResponseKind::Error(e)],
            FromWorker::Frontier {
                worker,
                collection,
                upper,
            } => {
                let per = self.frontiers.entry(collection).or_default();
                per.insert(worker, upper);
                if per.len() < self.local_workers {
                    return vec![];
                }
                let m = meet(per.values());
                if m.is_none() {
                    self.frontiers.remove(&collection);
                }
                if self.reported.get(&collection) == Some(&m) {
                    return vec![];
                }
                if m.is_none() {
                    self.reported.remove(&collection);
                } else {
                    self.reported.insert(collection, m);
                }
                vec![ResponseKind::Frontiers(vec![(collection, m)])]
            }
            FromWorker::Peek {
                worker,
                peek_id,
                result,
            } => {
                let per = self.peeks.entry(peek_id).or_default();
                per.insert(worker, result);
                if per.len() < self.local_workers {
                    return vec![];
                }
                let per = self.peeks.remove(&peek_id).unwrap_or_default();
                vec![ResponseKind::PeekResponse(PeekResponse {
                    peek_id,
                    result: merge_peek(per.into_values()),
                })]
            }
            FromWorker::Subscribe { worker, batch } => {
                let id = batch.subscribe_id;
                let merge = self
                    .subs
                    .entry(id)
                    .or_insert_with(|| SubscribeMerge::new(self.local_workers));
                let out = merge.push(worker, batch);
                if merge.is_done() {
                    self.subs.remove(&id);
                }
                out.map(ResponseKind::SubscribeResponse)
                    .into_iter()
                    .collect()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lockstep_protocol::Row;

    fn fr(worker: usize, upper: Frontier) -> FromWorker {
        FromWorker::Frontier {
            worker,
            collection: 7,
            upper,
        }
    }

    #[test]
    fn frontier_is_the_meet_once_all_reported() {
        let mut a = Aggregator::new(2);
        assert!(a.on(fr(0, Some(5))).is_empty());
        assert_eq!(
            a.on(fr(1, Some(3))),
            vec![ResponseKind::Frontiers(vec![(7, Some(3))])]
        );
        assert!(a.on(fr(0, Some(6))).is_empty(), "meet unchanged");
        assert_eq!(
            a.on(fr(1, None)),
            vec![ResponseKind::Frontiers(vec![(7, Some(6))])]
        );
        assert_eq!(
            a.on(fr(0, None)),
            vec![ResponseKind::Frontiers(vec![(7, None)])]
        );
    }

    /// Worker 0 started session 2 while worker 1 still answers session 1:
    /// worker 1's batch of session 1 is not merged into session 2's (it
    /// would be counted with the replay's), its batch of session 2 is.
    #[test]
    fn a_worker_behind_the_newest_session_is_not_merged() {
        let mut a = Aggregator::new(2);
        let started = |worker, session| FromWorker::NewSession { worker, session };
        let batch = |worker, rows: &[i64]| FromWorker::Subscribe {
            worker,
            batch: lockstep_protocol::SubscribeBatch {
                subscribe_id: 3,
                lower: 0,
                upper: Some(1),
                updates: rows
                    .iter()
                    .map(|r| lockstep_protocol::Update {
                        row: r.to_le_bytes().to_vec(),
                        time: 0,
                        diff: 1,
                    })
                    .collect(),
            },
        };
        a.on(started(0, 1));
        a.on(started(1, 1));
        a.on(started(0, 2));
        assert!(a.on(batch(1, &[10])).is_empty(), "worker 1 is in session 1");
        assert!(
            a.on(batch(0, &[20])).is_empty(),
            "worker 1 has not answered"
        );
        a.on(started(1, 2));
        let out = a.on(batch(1, &[10]));
        let [ResponseKind::SubscribeResponse(b)] = out.as_slice() else {
            panic!("one merged batch, got {out:?}");
        };
        let rows: Vec<_> = b.updates.iter().map(|u| u.row[0]).collect();
        assert_eq!(rows, vec![10, 20], "each row once");
    }

    #[test]
    fn peek_waits_for_every_worker_and_sums() {
        let mut a = Aggregator::new(2);
        let p = |w, rows: Vec<(Row, i64)>| FromWorker::Peek {
            worker: w,
            peek_id: 1,
            result: PeekResult::Rows(rows),
        };
        assert!(a.on(p(0, vec![(vec![1], 1), (vec![2], 1)])).is_empty());
        let out = a.on(p(1, vec![(vec![1], 2), (vec![2], -1)]));
        assert_eq!(
            out,
            vec![ResponseKind::PeekResponse(PeekResponse {
                peek_id: 1,
                result: PeekResult::Rows(vec![(vec![1], 3)])
            })]
        );
    }
}
