//! The environment's index of input collections.
//!
//! The catalog stores every acknowledged write to an input collection; this
//! index holds, per replica and collection, the consolidated updates and the
//! upper of what it stores, built once when the environment loads. A write is
//! checked against the index and recorded in it in O(batch). The updates are
//! consolidated (sorted, equal rows summed) only when that could shrink them,
//! once they doubled: a retraction was written or the since moved. A
//! collection that only grows (inserts, no lag) is never re-sorted nor
//! rewritten on a write's path, so no write's latency depends on the rows
//! already stored. A replica's rehydration sends one consolidated write per
//! collection, and the catalog's rows of a collection that could shrink are
//! replaced by their consolidation whenever its stored updates doubled since
//! the last time, so that they stay within about twice the collection's live
//! updates rather than growing with every write.
//!
//! Consolidation sums the diffs of equal (row, time). With a compaction lag
//! `L` (`lockstep serve --compaction-lag`), a collection's since follows its
//! upper `U` in steps of `max(L / 4, 1)`, at most `L` behind (the largest
//! multiple of the step at or below `U - L`): updates below the since are
//! advanced to it when the rows are replaced, so that a row inserted and
//! later retracted leaves nothing once both are below the since, and reads
//! below the since are refused. Without a lag every time is kept (the since
//! stays 0), and a collection whose rows are inserted and later retracted
//! keeps both updates.
//!
//! **Read holds (I5).** A read that needs times of a collection (an open
//! subscription at its last emitted upper, a peek in flight at its time)
//! holds the collection's since at or below that time: the since follows
//! the lag only as far as the lowest hold. A restarted replica, rebuilt
//! from the stored (compacted) writes, can then continue the read exactly.
//! A hold the lag would pass by more than the hold limit (`lockstep serve
//! --read-hold-limit`, in times behind the upper) is broken: the since moves
//! on and the holder learns why (its read ends with OUT_OF_RANGE), so that
//! a stuck reader cannot make the stored writes grow without bound (G1).
//! A hold that advances or is released lets the since catch up at the
//! collection's next write.

use std::collections::BTreeMap;

use tokio::sync::watch;

use lockstep_protocol::history::InputLog;
use lockstep_protocol::{Timestamp, Update, WriteInput};

/// The stored writes of one input collection.
#[derive(Debug, Default)]
struct StoredInput {
    log: InputLog,
    /// Updates in the catalog's rows of this collection.
    catalog_updates: usize,
    /// `catalog_updates` when the rows were last replaced.
    snapshot_updates: usize,
    /// The sum of |diff| over `log`'s updates: no accumulation of a subset of
    /// them overflows i64 while it is at most `i64::MAX`.
    magnitude: u128,
    /// Reads at this time or later are correct.
    since: Timestamp,
    /// The since moved since the last consolidation (see `shrinkable()`).
    since_moved: bool,
}

impl StoredInput {
    fn consolidate(&mut self) {
        self.log.compact(self.since);
        self.log.consolidate();
        self.magnitude = magnitude(self.log.updates());
        self.since_moved = false;
    }

    /// Appends a stored write's updates: no digest (the environment never
    /// reads one) and no consolidation (see `shrinkable`).
    fn append(&mut self, updates: Vec<Update>, upper: Timestamp) {
        self.magnitude += magnitude(&updates);
        self.log.append_undigested(updates, upper);
    }

    /// Whether replacing the catalog's rows by the consolidation could
    /// shrink them: the since moved, a retraction was written since the
    /// log's last consolidation, or the log holds fewer updates than the
    /// catalog's rows (it consolidated them). Inserts at the times they
    /// were written consolidate to themselves (no two writes share a
    /// time), so a collection that only grows is never re-sorted nor
    /// rewritten whole on a write's path.
    fn shrinkable(&self) -> bool {
        self.since_moved || self.log.shrinkable() || self.log.len() < self.catalog_updates
    }
}

/// The since of a collection with upper `upper` under compaction lag `lag`.
pub(crate) fn since_for(upper: Timestamp, lag: Option<u64>) -> Timestamp {
    match lag {
        None => 0,
        Some(lag) => {
            let step = (lag / 4).max(1);
            upper.saturating_sub(lag) / step * step
        }
    }
}

fn magnitude<'a>(updates: impl IntoIterator<Item = &'a Update>) -> u128 {
    updates
        .into_iter()
        .map(|u| u.diff.unsigned_abs() as u128)
        .sum()
}

/// Why a write is refused (nothing was stored).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WriteRefused {
    /// The new upper is below the collection's.
    #[error("upper {upper} is below collection {collection}'s current upper {current}")]
    UpperBelow {
        /// The collection.
        collection: u64,
        /// The write's upper.
        upper: Timestamp,
        /// The collection's upper.
        current: Timestamp,
    },
    /// An update's time is outside `[current upper, new upper)`.
    #[error("update at time {time} is outside [{current}, {upper})")]
    TimeOutside {
        /// The update's time.
        time: Timestamp,
        /// The collection's upper.
        current: Timestamp,
        /// The write's upper.
        upper: Timestamp,
    },
    /// The collection's diffs would add up beyond what an i64 holds.
    #[error(
        "collection {collection}'s multiplicities would exceed {max} in total (the sum of |diff| over its consolidated updates); sums of them could overflow",
        max = i64::MAX
    )]
    Overflow {
        /// The collection.
        collection: u64,
    },
}

/// The default of how far (in times) a read hold may keep a collection's
/// since behind its upper before it is broken.
pub const DEFAULT_READ_HOLD_LIMIT: u64 = 100_000;

/// One read hold: the collections of a replica whose since stays at or
/// below `at`, and where the holder learns that it was broken.
#[derive(Debug)]
struct Hold {
    replica_id: u64,
    collections: Vec<u64>,
    at: Timestamp,
    broken: watch::Sender<Option<String>>,
}

/// Per replica, per input collection: what the catalog stores.
#[derive(Debug, Default)]
pub(crate) struct Inputs {
    by_replica: BTreeMap<u64, BTreeMap<u64, StoredInput>>,
    /// How far a collection's since stays behind its upper (`None`: at 0).
    lag: Option<u64>,
    /// The read holds, by ID.
    holds: BTreeMap<u64, Hold>,
    next_hold: u64,
    /// How far a hold may keep a since behind its upper (`None`:
    /// [`DEFAULT_READ_HOLD_LIMIT`]).
    hold_limit: Option<u64>,
}

/// A read hold taken: its ID, and where the holder learns (`Some(why)`)
/// that the hold was broken.
#[derive(Debug)]
pub(crate) struct Held {
    pub(crate) id: u64,
    pub(crate) broken: watch::Receiver<Option<String>>,
}

/// What the read holds of a replica keep back, for `status` and the metrics.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct HoldsReport {
    /// Open read holds.
    pub holds: usize,
    /// The largest span (in times) by which a hold keeps a collection's
    /// since behind where the lag alone would put it.
    pub held_span: u64,
}

/// What recording a write changed.
#[derive(Debug, Default)]
pub(crate) struct Recorded {
    /// The collection's consolidated write, when its catalog rows should be
    /// replaced by it (call [`Inputs::replaced`] once they were).
    pub(crate) snapshot: Option<WriteInput>,
    /// The collection's new since, when it advanced.
    pub(crate) since: Option<Timestamp>,
}

impl Inputs {
    /// Indexes the catalog's writes, in their order.
    pub(crate) fn load(
        writes: impl IntoIterator<Item = (u64, WriteInput)>,
        lag: Option<u64>,
    ) -> Inputs {
        let mut inputs = Inputs {
            lag,
            ..Inputs::default()
        };
        for (replica_id, w) in writes {
            let s = inputs.entry(replica_id, w.collection_id);
            s.catalog_updates += w.updates.len();
            s.append(w.updates, w.upper);
        }
        for s in inputs.by_replica.values_mut().flat_map(|m| m.values_mut()) {
            s.since = since_for(s.log.upper(), lag);
            s.consolidate();
            s.snapshot_updates = s.log.len();
        }
        inputs
    }

    /// Sets the compaction lag, recomputes every collection's since and
    /// compacts to it (so that the next replacement of the catalog's rows
    /// is due once they hold twice the compacted updates, not twice what
    /// was loaded).
    pub(crate) fn set_lag(&mut self, lag: Option<u64>) {
        self.lag = lag;
        for s in self.by_replica.values_mut().flat_map(|m| m.values_mut()) {
            s.since = since_for(s.log.upper(), lag);
            s.consolidate();
            s.snapshot_updates = s.log.len();
        }
    }

    /// Sets how far (in times) a read hold may keep a since behind its
    /// upper before it is broken.
    pub(crate) fn set_hold_limit(&mut self, limit: u64) {
        self.hold_limit = Some(limit);
    }

    /// Holds the since of `collections` of a replica at or below `at`, or
    /// says (the collection and its since) why it cannot: a since already
    /// past `at`.
    pub(crate) fn hold(
        &mut self,
        replica_id: u64,
        collections: &[u64],
        at: Timestamp,
    ) -> Result<Held, (u64, Timestamp)> {
        if let Some((c, since)) = collections
            .iter()
            .map(|c| (*c, self.since(replica_id, *c)))
            .find(|(_, since)| at < *since)
        {
            return Err((c, since));
        }
        let id = self.next_hold;
        self.next_hold += 1;
        let (broken, rx) = watch::channel(None);
        self.holds.insert(
            id,
            Hold {
                replica_id,
                collections: collections.to_vec(),
                at,
                broken,
            },
        );
        Ok(Held { id, broken: rx })
    }

    /// Moves a hold forward to `at` (never back); the since catches up at
    /// the next write.
    pub(crate) fn advance_hold(&mut self, id: u64, at: Timestamp) {
        if let Some(h) = self.holds.get_mut(&id) {
            h.at = h.at.max(at);
        }
    }

    /// Releases a hold (nothing if it was broken or released before).
    pub(crate) fn release(&mut self, id: u64) {
        self.holds.remove(&id);
    }

    /// What the read holds of `replica_id` keep back.
    pub(crate) fn holds_of(&self, replica_id: u64) -> HoldsReport {
        let mut report = HoldsReport::default();
        for h in self.holds.values().filter(|h| h.replica_id == replica_id) {
            report.holds += 1;
            for c in &h.collections {
                let target = since_for(self.upper(replica_id, *c), self.lag);
                report.held_span = report.held_span.max(target.saturating_sub(h.at));
            }
        }
        report
    }

    /// The since of a collection at upper `upper` under the lag and the
    /// read holds on it: holds the lag passes by more than the limit are
    /// broken (and removed) first.
    fn held_since(&mut self, replica_id: u64, collection_id: u64, upper: Timestamp) -> Timestamp {
        let target = since_for(upper, self.lag);
        // The seeded campaign's negative control: compaction ignores holds.
        fail::fail_point!("read_holds_off", |_| target);
        let limit = self.hold_limit.unwrap_or(DEFAULT_READ_HOLD_LIMIT);
        let mut since = target;
        self.holds.retain(|_, h| {
            if h.replica_id != replica_id || !h.collections.contains(&collection_id) || h.at >= target
            {
                return true;
            }
            if upper.saturating_sub(h.at) > limit {
                let why = format!(
                    "the read hold at time {} on input collection {collection_id} fell more than {limit} times behind its upper {upper} (the read hold limit, lockstep serve --read-hold-limit); the collection is compacted past it",
                    h.at
                );
                h.broken.send_replace(Some(why));
                return false;
            }
            since = since.min(h.at);
            true
        });
        since
    }

    /// The since of a collection (0 if never written).
    pub(crate) fn since(&self, replica_id: u64, collection_id: u64) -> Timestamp {
        self.by_replica
            .get(&replica_id)
            .and_then(|m| m.get(&collection_id))
            .map_or(0, |s| s.since)
    }

    /// The updates the catalog stores for a replica's inputs.
    pub(crate) fn stored_updates(&self, replica_id: u64) -> usize {
        self.by_replica
            .get(&replica_id)
            .map_or(0, |m| m.values().map(|s| s.catalog_updates).sum())
    }

    /// Every input collection of a replica with its since.
    pub(crate) fn sinces_of(&self, replica_id: u64) -> Vec<(u64, Timestamp)> {
        self.by_replica
            .get(&replica_id)
            .map(|m| m.iter().map(|(&c, s)| (c, s.since)).collect())
            .unwrap_or_default()
    }

    fn entry(&mut self, replica_id: u64, collection_id: u64) -> &mut StoredInput {
        self.by_replica
            .entry(replica_id)
            .or_default()
            .entry(collection_id)
            .or_default()
    }

    /// The upper of a collection (0 if never written).
    pub(crate) fn upper(&self, replica_id: u64, collection_id: u64) -> Timestamp {
        self.by_replica
            .get(&replica_id)
            .and_then(|m| m.get(&collection_id))
            .map_or(0, |s| s.log.upper())
    }

    /// Whether a write would be accepted; nothing changes.
    pub(crate) fn check(
        &self,
        replica_id: u64,
        collection_id: u64,
        updates: &[Update],
        upper: Timestamp,
    ) -> Result<(), WriteRefused> {
        let current = self.upper(replica_id, collection_id);
        if upper < current {
            return Err(WriteRefused::UpperBelow {
                collection: collection_id,
                upper,
                current,
            });
        }
        if let Some(u) = updates.iter().find(|u| u.time < current || u.time >= upper) {
            return Err(WriteRefused::TimeOutside {
                time: u.time,
                current,
                upper,
            });
        }
        let stored = self
            .by_replica
            .get(&replica_id)
            .and_then(|m| m.get(&collection_id))
            .map_or(0, |s| s.magnitude);
        if stored + magnitude(updates) > i64::MAX as u128 {
            return Err(WriteRefused::Overflow {
                collection: collection_id,
            });
        }
        Ok(())
    }

    /// Records a write the catalog stored (and [`check`](Self::check)
    /// accepted).
    pub(crate) fn record(
        &mut self,
        replica_id: u64,
        collection_id: u64,
        updates: Vec<Update>,
        upper: Timestamp,
    ) -> Recorded {
        let s = self.entry(replica_id, collection_id);
        s.catalog_updates += updates.len();
        s.append(updates, upper);
        let upper = s.log.upper();
        let since = self.held_since(replica_id, collection_id, upper);
        let s = self.entry(replica_id, collection_id);
        let mut recorded = Recorded::default();
        if since > s.since {
            s.since = since;
            s.since_moved = true;
            recorded.since = Some(since);
        }
        if s.shrinkable() && s.catalog_updates > 2 * s.snapshot_updates + 1024 {
            s.consolidate();
            recorded.snapshot = Some(WriteInput {
                collection_id,
                updates: s.log.to_vec(),
                upper: s.log.upper(),
                more: false,
                batch_digest: None,
            });
        }
        recorded
    }

    /// The catalog's rows of a collection were replaced by its consolidation.
    pub(crate) fn replaced(&mut self, replica_id: u64, collection_id: u64) {
        let s = self.entry(replica_id, collection_id);
        s.catalog_updates = s.log.len();
        s.snapshot_updates = s.catalog_updates;
    }

    /// Every input collection of a replica as one consolidated write each.
    pub(crate) fn writes_of(&mut self, replica_id: u64) -> Vec<WriteInput> {
        let Some(m) = self.by_replica.get_mut(&replica_id) else {
            return Vec::new();
        };
        m.iter_mut()
            .map(|(&collection_id, s)| {
                s.consolidate();
                WriteInput {
                    collection_id,
                    updates: s.log.to_vec(),
                    upper: s.log.upper(),
                    more: false,
                    batch_digest: None,
                }
            })
            .collect()
    }

    /// Forgets a dropped replica's inputs.
    pub(crate) fn drop_replica(&mut self, replica_id: u64) {
        self.by_replica.remove(&replica_id);
        self.holds.retain(|_, h| {
            if h.replica_id != replica_id {
                return true;
            }
            h.broken
                .send_replace(Some("the replica was dropped".to_string()));
            false
        });
    }
}

#[cfg(test)]
mod tests;
