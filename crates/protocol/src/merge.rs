//! Merging the partial answers of several parts (workers of a process, or
//! processes of a replica) into one answer. The replica's process-level
//! aggregator and the controller use the same code, so both merge alike:
//!
//! - a frontier is the meet (minimum) over the parts; the empty frontier only
//!   when every part's is empty ([`meet`]);
//! - a peek's answer sums the rows of every part; any error makes it an
//!   error, any cancellation cancels it ([`merge_peek`]);
//! - a subscription's batch covers `[lower, meet of the parts' uppers)` and
//!   carries every update below that meet ([`SubscribeMerge`]).

use std::collections::BTreeMap;

use crate::history::consolidate;
use crate::types::{Frontier, PeekResult, Row, SubscribeBatch, Update};

/// The meet of frontiers over totally ordered time.
pub fn meet<'a>(fs: impl IntoIterator<Item = &'a Frontier>) -> Frontier {
    fs.into_iter().filter_map(|f| *f).min()
}

/// Combines the answers of every part to one peek.
pub fn merge_peek(results: impl IntoIterator<Item = PeekResult>) -> PeekResult {
    let mut rows: BTreeMap<Row, i64> = BTreeMap::new();
    let mut canceled = false;
    for r in results {
        match r {
            PeekResult::Error(e) => return PeekResult::Error(e),
            PeekResult::Canceled => canceled = true,
            PeekResult::Rows(rs) | PeekResult::Part(rs) => {
                for (row, d) in rs {
                    *rows.entry(row).or_default() += d;
                }
            }
        }
    }
    if canceled {
        return PeekResult::Canceled;
    }
    PeekResult::Rows(rows.into_iter().filter(|(_, d)| *d != 0).collect())
}

/// Merges one subscription's batches from `parts` parts by time.
#[derive(Clone, Debug)]
pub struct SubscribeMerge {
    parts: usize,
    lower: Option<u64>,
    emitted: Option<Frontier>,
    uppers: BTreeMap<usize, Frontier>,
    updates: Vec<Update>,
}

impl SubscribeMerge {
    /// A merge over `parts` parts.
    pub fn new(parts: usize) -> Self {
        SubscribeMerge {
            parts,
            lower: None,
            emitted: None,
            uppers: BTreeMap::new(),
            updates: Vec::new(),
        }
    }

    /// Forgets what the parts sent so far (they restart the subscription,
    /// after a reconnect), but remembers what was emitted: updates below the
    /// emitted upper are not emitted again.
    pub fn restart(&mut self) {
        self.uppers.clear();
        self.updates.clear();
    }

    /// The subscription now comes from `parts` parts (the replica was
    /// resized): as [`restart`](Self::restart), over that many.
    pub fn reshape(&mut self, parts: usize) {
        self.parts = parts;
        self.restart();
    }

    /// Whether the merged subscription is complete (empty upper emitted).
    pub fn is_done(&self) -> bool {
        self.emitted == Some(None)
    }

    /// Takes one part's batch; returns a merged batch when the meet advanced.
    pub fn push(&mut self, part: usize, batch: SubscribeBatch) -> Option<SubscribeBatch> {
        self.lower.get_or_insert(batch.lower);
        self.uppers.insert(part, batch.upper);
        let floor = match self.emitted {
            Some(Some(e)) => Some(e),
            Some(None) => return None,
            None => None,
        };
        self.updates.extend(
            batch
                .updates
                .into_iter()
                .filter(|u| floor.is_none_or(|f| u.time >= f)),
        );
        if self.uppers.len() < self.parts {
            return None;
        }
        let m = meet(self.uppers.values());
        if let Some(Some(e)) = self.emitted {
            if m.is_some_and(|m| m <= e) {
                return None;
            }
        }
        let (ready, rest): (Vec<Update>, Vec<Update>) = self
            .updates
            .drain(..)
            .partition(|u| m.is_none_or(|m| u.time < m));
        self.updates = rest;
        let lower = floor.unwrap_or(self.lower.unwrap_or(0));
        self.emitted = Some(m);
        Some(SubscribeBatch {
            subscribe_id: batch.subscribe_id,
            lower,
            upper: m,
            updates: consolidate(ready),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(lower: u64, upper: Frontier, updates: Vec<(i64, u64)>) -> SubscribeBatch {
        SubscribeBatch {
            subscribe_id: 9,
            lower,
            upper,
            updates: updates
                .into_iter()
                .map(|(v, t)| Update {
                    row: vec![v as u8],
                    time: t,
                    diff: 1,
                })
                .collect(),
        }
    }

    #[test]
    fn batches_merge_by_time() {
        let mut m = SubscribeMerge::new(2);
        assert!(m.push(0, b(0, Some(4), vec![(1, 0), (2, 3)])).is_none());
        let out = m.push(1, b(0, Some(2), vec![(3, 1)])).unwrap();
        assert_eq!((out.lower, out.upper, out.updates.len()), (0, Some(2), 2));
        let out = m.push(1, b(2, Some(5), vec![])).unwrap();
        assert_eq!((out.lower, out.upper), (2, Some(4)));
        assert_eq!(
            out.updates,
            vec![Update {
                row: vec![2],
                time: 3,
                diff: 1
            }]
        );
    }

    #[test]
    fn restart_does_not_repeat_emitted_updates() {
        let mut m = SubscribeMerge::new(1);
        let out = m.push(0, b(0, Some(3), vec![(1, 0), (2, 2)])).unwrap();
        assert_eq!(out.updates.len(), 2);
        m.restart();
        // The part starts over from as_of 0 and resends everything.
        let out = m
            .push(0, b(0, Some(5), vec![(1, 0), (2, 2), (3, 4)]))
            .unwrap();
        assert_eq!((out.lower, out.upper), (3, Some(5)));
        assert_eq!(
            out.updates,
            vec![Update {
                row: vec![3],
                time: 4,
                diff: 1
            }]
        );
    }

    #[test]
    fn peek_merge_sums_and_propagates_errors() {
        let r = merge_peek([
            PeekResult::Rows(vec![(vec![1], 1), (vec![2], 1)]),
            PeekResult::Rows(vec![(vec![1], 2), (vec![2], -1)]),
        ]);
        assert_eq!(r, PeekResult::Rows(vec![(vec![1], 3)]));
        let r = merge_peek([PeekResult::Rows(vec![]), PeekResult::Error("x".into())]);
        assert_eq!(r, PeekResult::Error("x".into()));
    }
}
