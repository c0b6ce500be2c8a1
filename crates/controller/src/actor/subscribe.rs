//! A subscription as the controller keeps it: the merge of the processes'
//! batches, bounded by what it holds back.

use super::*;

/// A subscription: its collection, the merge of the processes' batches, and
/// where the merged batches go (until the receiver is dropped: then it is
/// canceled).
pub(crate) struct Sub {
    pub(super) collection: u64,
    pub(crate) merge: SubscribeMerge,
    pub(super) sink: mpsc::Sender<Result<SubscribeBatch, ControllerError>>,
    /// What `merge` holds back (updates at or past the meet of the parts'
    /// uppers), as estimated bytes per time, and their sum: the mirror of
    /// `merge`'s buffer that bounds it.
    buffered: BTreeMap<u64, usize>,
    buffered_bytes: usize,
    /// The upper `merge` emitted last: updates before it are dropped.
    floor: Option<u64>,
}

impl Sub {
    pub(super) fn new(
        collection: u64,
        parts: usize,
        sink: mpsc::Sender<Result<SubscribeBatch, ControllerError>>,
    ) -> Sub {
        Sub {
            collection,
            merge: SubscribeMerge::new(parts),
            sink,
            buffered: BTreeMap::new(),
            buffered_bytes: 0,
            floor: None,
        }
    }

    /// Feeds part `part`'s batch to the merge; returns the merged batch, if
    /// any, and the estimated bytes the merge then holds back.
    pub(super) fn push(
        &mut self,
        part: usize,
        batch: SubscribeBatch,
    ) -> (Option<SubscribeBatch>, usize) {
        // The merge keeps the updates not before the last emitted upper.
        for u in &batch.updates {
            if self.floor.is_none_or(|f| u.time >= f) {
                let bytes = update_bytes(u.row.len());
                *self.buffered.entry(u.time).or_default() += bytes;
                self.buffered_bytes += bytes;
            }
        }
        let out = self.merge.push(part, batch);
        if let Some(out) = &out {
            // It emitted every update before the new upper.
            let kept = match out.upper {
                Some(m) => self.buffered.split_off(&m),
                None => BTreeMap::new(),
            };
            self.buffered = kept;
            self.buffered_bytes = self.buffered.values().sum();
            self.floor = out.upper;
        }
        (out, self.buffered_bytes)
    }

    /// The subscription now comes from `parts` processes (a resize): as
    /// [`restart`](Self::restart), over that many.
    pub(crate) fn reshape(&mut self, parts: usize) {
        self.restart();
        self.merge.reshape(parts);
    }

    /// The parts restart the subscription (a new session): the merge
    /// forgets what they sent.
    pub(crate) fn restart(&mut self) {
        self.merge.restart();
        self.buffered.clear();
        self.buffered_bytes = 0;
    }
}

/// The estimated bytes an update (or a peek's row) whose row takes
/// `row_bytes` bytes takes in memory.
pub(super) fn update_bytes(row_bytes: usize) -> usize {
    std::mem::size_of::<lockstep_protocol::Update>() + row_bytes
}
