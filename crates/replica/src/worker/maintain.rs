//! What a worker reports while it steps, outside of any command: frontiers
//! as they move, peeks once their time has passed, subscribe batches from
//! each export's tap.

use std::collections::BTreeMap;

use differential_dataflow::trace::cursor::{cursor_list, Cursor};
use differential_dataflow::trace::TraceReader;
use lockstep_protocol::history::consolidate;
use lockstep_protocol::{Frontier, Peek, PeekResult, Row, SubscribeBatch, Update};
use timely::dataflow::ProbeHandle;
use timely::progress::Antichain;

use crate::metrics::{ExportLabels, METRICS};
use crate::worker::{ArrangedRow, FromWorker, Trace, WorkerState};

fn passed(upper: Frontier, t: u64) -> bool {
    upper.is_none_or(|u| u > t)
}

fn probe_frontier(probe: &ProbeHandle<u64>) -> Frontier {
    probe.with_frontier(|f| f.iter().min().copied())
}

/// Every (row, time, diff) in a trace.
fn read_trace(trace: &mut Trace) -> Vec<Update> {
    let Some(batches) = trace.batches_through(Antichain::new().borrow()) else {
        return Vec::new();
    };
    let (mut cursor, storage) = cursor_list(batches);
    let mut out = Vec::new();
    for ((row, ()), times) in cursor.to_vec(&storage, |k: &ArrangedRow| k.0.clone(), |_v| ()) {
        for (time, diff) in times {
            out.push(Update {
                row: row.clone(),
                time,
                diff,
            });
        }
    }
    out
}

impl WorkerState {
    /// Reports frontiers, answers peeks that are ready, emits subscribe batches.
    pub fn maintain(&mut self) {
        self.report_frontiers();
        self.answer_peeks();
        self.emit_subscribe_batches();
    }

    /// Reports the frontiers of the dataflows in motion only.
    fn report_frontiers(&mut self) {
        // Frontiers, of the dataflows in motion only. A dataflow settles
        // once every export's frontier reached its inputs' uppers and was
        // reported: nothing moves it again until a write to one of its
        // inputs or a new session (which mark it unsettled).
        let mut changes = Vec::new();
        let mut settled = Vec::new();
        for &df in &self.unsettled {
            let Some(inst) = self.dataflows.get_mut(&df) else {
                settled.push(df);
                continue;
            };
            // Where the exports' frontiers end while the inputs stand still
            // (a dataflow without inputs may never settle: it is only read
            // again, which is always safe).
            let target: Frontier = inst.sessions.iter().map(|(_, s)| *s.time()).min();
            let mut done = target.is_some();
            for (id, e) in inst.exports.iter_mut() {
                let f = probe_frontier(&e.probe);
                if e.reported != Some(f) {
                    tracing::trace!(worker = self.index, collection = id, upper = ?f, "frontier");
                    e.reported = Some(f);
                    changes.push((*id, f));
                }
                // Subscribers start at or beyond the probe frontier: older
                // tapped updates are in the trace.
                if let Some(f) = f {
                    e.tap.borrow_mut().recent.retain(|u| u.time >= f);
                }
                // How far behind its inputs this export is (0 once caught
                // up or closed; unknown, and left as it was, without inputs).
                if let Some(lag) = target.map(|t| f.map_or(0, |f| t.saturating_sub(f))) {
                    if e.lag != Some(lag) {
                        e.lag = Some(lag);
                        METRICS
                            .frontier_lag
                            .get_or_create(&ExportLabels {
                                export: *id,
                                worker: self.index as u64,
                            })
                            .set(i64::try_from(lag).unwrap_or(i64::MAX));
                    }
                }
                done &= f == target;
            }
            if done {
                settled.push(df);
            }
        }
        for df in settled {
            self.unsettled.remove(&df);
        }
        for (collection, upper) in changes {
            self.send(FromWorker::Frontier {
                worker: self.index,
                collection,
                upper,
            });
        }
    }

    /// Answers the peeks that are ready; the others wait.
    fn answer_peeks(&mut self) {
        let mut answered = Vec::new();
        let peeks = std::mem::take(&mut self.peeks);
        for p in peeks {
            match self.try_peek(&p) {
                Some(result) => answered.push((p.peek_id, result)),
                None => self.peeks.push(p),
            }
        }
        for (peek_id, result) in answered {
            self.history.retire_peek(peek_id);
            self.send(FromWorker::Peek {
                worker: self.index,
                peek_id,
                result,
            });
        }
    }

    /// Emits what each subscription can send now: its snapshot once the
    /// frontier passed its as_of, then the changes between frontiers.
    fn emit_subscribe_batches(&mut self) {
        let mut batches = Vec::new();
        let mut finished = Vec::new();
        for (sid, s) in self.subs.iter_mut() {
            let Some(df) = self.collections.get(&s.sub.collection_id) else {
                continue;
            };
            let Some(e) = self
                .dataflows
                .get_mut(df)
                .and_then(|i| i.exports.get_mut(&s.sub.collection_id))
            else {
                continue;
            };
            let upper = probe_frontier(&e.probe);
            match s.lower {
                None => {
                    if !passed(upper, s.sub.as_of) {
                        continue;
                    }
                    let as_of = s.sub.as_of;
                    let snapshot = read_trace(&mut e.trace)
                        .into_iter()
                        .filter(|u| passed(upper, u.time))
                        .map(|mut u| {
                            u.time = u.time.max(as_of);
                            u
                        })
                        .collect();
                    let mut tap = e.tap.borrow_mut();
                    let pending: Vec<Update> = tap
                        .recent
                        .iter()
                        .filter(|u| !passed(upper, u.time))
                        .cloned()
                        .collect();
                    tap.subs.insert(*sid, pending);
                    batches.push(SubscribeBatch {
                        subscribe_id: *sid,
                        lower: as_of,
                        upper,
                        updates: consolidate(snapshot),
                    });
                    s.lower = Some(upper);
                }
                Some(Some(lower)) if upper != Some(lower) => {
                    let mut tap = e.tap.borrow_mut();
                    let buf = tap.subs.entry(*sid).or_default();
                    let (ready, rest): (Vec<Update>, Vec<Update>) = buf
                        .drain(..)
                        .filter(|u| u.time >= lower)
                        .partition(|u| passed(upper, u.time));
                    *buf = rest;
                    batches.push(SubscribeBatch {
                        subscribe_id: *sid,
                        lower,
                        upper,
                        updates: consolidate(ready),
                    });
                    s.lower = Some(upper);
                }
                _ => {}
            }
            if upper.is_none() {
                finished.push(*sid);
            }
        }
        for sid in finished {
            if let Some(s) = self.subs.remove(&sid) {
                self.forget_subscription(s.sub.collection_id, sid);
            }
        }
        for batch in batches {
            self.send(FromWorker::Subscribe {
                worker: self.index,
                batch,
            });
        }
    }

    fn try_peek(&mut self, p: &Peek) -> Option<PeekResult> {
        let Some(df) = self.collections.get(&p.collection_id) else {
            return Some(PeekResult::Error(format!(
                "peek {}: unknown collection {}",
                p.peek_id, p.collection_id
            )));
        };
        let e = self
            .dataflows
            .get_mut(df)?
            .exports
            .get_mut(&p.collection_id)?;
        if p.timestamp < e.since {
            return Some(PeekResult::Error(format!(
                "peek {} at {} is below collection {}'s compaction frontier {}",
                p.peek_id, p.timestamp, p.collection_id, e.since
            )));
        }
        if !passed(probe_frontier(&e.probe), p.timestamp) {
            return None;
        }
        let mut acc: BTreeMap<Row, i64> = BTreeMap::new();
        for u in read_trace(&mut e.trace) {
            if u.time <= p.timestamp {
                *acc.entry(u.row).or_default() += u.diff;
            }
        }
        Some(PeekResult::Rows(
            acc.into_iter().filter(|(_, d)| *d != 0).collect(),
        ))
    }
}

impl WorkerState {
    /// Drops what an export's tap keeps for a subscription that ended.
    pub(crate) fn forget_subscription(&mut self, collection_id: u64, subscribe_id: u64) {
        if let Some(e) = self
            .collections
            .get(&collection_id)
            .and_then(|df| self.dataflows.get(df))
            .and_then(|i| i.exports.get(&collection_id))
        {
            e.tap.borrow_mut().subs.remove(&subscribe_id);
        }
    }
}
