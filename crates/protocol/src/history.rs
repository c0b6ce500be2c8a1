//! The compacted command history.
//!
//! The controller keeps every command it sent, compacted, so that a process
//! that reconnects (or a new replica) can be brought to the target state by
//! replaying the history. Each replica process keeps the history of what it
//! applied too, and the two are compared by [`CommandHistory::digest`] when a
//! controller connects (the history check).
//!
//! Compaction follows Materialize's `ComputeCommandHistory::reduce`:
//! - a dataflow whose exports were all dropped (empty compaction frontier)
//!   vanishes with its Schedule, AllowCompaction, Peek and Subscribe commands;
//! - answered ([`CommandHistory::retire_peek`]) and canceled peeks vanish,
//!   and so do canceled subscriptions;
//! - configuration updates merge into one (later values win);
//! - writes to one input collection consolidate into one WriteInput (kept
//!   apart, in an [`InputLog`], so that writing costs amortized O(batch));
//! - only the last AllowCompaction per collection, the last CreateInstance and
//!   the last InitializationComplete stay;
//! - Hello and StatusRequest are never kept.
//!
//! Two histories that reduce to the same commands have the same digest.

use std::collections::{BTreeMap, BTreeSet};

use prost::Message;

use crate::proto;
use crate::types::{
    CommandKind, DataflowDescription, Digest, Frontier, Timestamp, Update, WriteInput,
};

/// A compacted sequence of commands.
///
/// Writes to input collections are kept apart from the other commands, one
/// [`InputLog`] per collection, consolidated as they grow; the command list
/// holds one placeholder per collection where its first write appeared. A
/// history made with [`CommandHistory::summarizing`] keeps only each
/// collection's upper and digest, not its updates (a replica worker, which
/// keeps its input elsewhere, needs no second copy to report its digest).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CommandHistory {
    commands: Vec<CommandKind>,
    inputs: BTreeMap<u64, InputLog>,
    summarizing: bool,
    retired_peeks: BTreeSet<u64>,
    reduced_len: usize,
}

impl CommandHistory {
    /// An empty history.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty history that keeps no input updates, only their digest.
    pub fn summarizing() -> Self {
        CommandHistory {
            summarizing: true,
            ..Self::default()
        }
    }

    /// Whether it keeps only the digest of input updates
    /// ([`summarizing`](Self::summarizing)).
    pub fn is_summarizing(&self) -> bool {
        self.summarizing
    }

    /// Appends a command. Hello and StatusRequest are not history and are
    /// ignored. Compacts now and then so that the history stays proportional
    /// to the live state rather than to the number of commands sent.
    pub fn push(&mut self, kind: CommandKind) {
        match kind {
            CommandKind::Hello(_) | CommandKind::StatusRequest { .. } => return,
            CommandKind::WriteInput(w) => {
                let summarizing = self.summarizing;
                let log = match self.inputs.entry(w.collection_id) {
                    std::collections::btree_map::Entry::Occupied(o) => o.into_mut(),
                    std::collections::btree_map::Entry::Vacant(v) => {
                        self.commands.push(placeholder(w.collection_id));
                        v.insert(InputLog::default())
                    }
                };
                match w.batch_digest {
                    // A split write: this copy holds a part of the batch,
                    // the digest counts all of it.
                    Some(digest) => {
                        log.append_with_digest(w.updates, w.upper, !summarizing, digest)
                    }
                    None => log.append(w.updates, w.upper, !summarizing),
                }
            }
            CommandKind::AllowCompaction {
                collection_id,
                frontier,
            } => {
                // An input collection's updates compact with it.
                if let (Some(log), Some(since)) = (self.inputs.get_mut(&collection_id), frontier) {
                    log.compact(since);
                }
                self.commands.push(kind);
            }
            kind => self.commands.push(kind),
        }
        if self.commands.len() > 2 * self.reduced_len + 32 {
            self.reduce();
        }
    }

    /// Marks a peek answered: it leaves the history at the next compaction.
    pub fn retire_peek(&mut self, peek_id: u64) {
        self.retired_peeks.insert(peek_id);
    }

    /// The commands, in order (not necessarily compacted; call
    /// [`reduce`](Self::reduce) first for the compacted form). Each input
    /// collection's writes are one `WriteInput` holding its updates (none in
    /// a summarizing history, consolidated), where its first write was.
    pub fn commands(&self) -> Vec<CommandKind> {
        self.commands
            .iter()
            .map(|c| match c {
                CommandKind::WriteInput(w) => {
                    let log = &self.inputs[&w.collection_id];
                    CommandKind::WriteInput(WriteInput {
                        collection_id: w.collection_id,
                        updates: consolidate(log.to_vec()),
                        upper: log.upper,
                        more: false,
                        batch_digest: None,
                    })
                }
                c => c.clone(),
            })
            .collect()
    }

    /// How many commands are held (each input collection's writes count once).
    pub fn len(&self) -> usize {
        self.commands.len()
    }

    /// Whether the history holds no command.
    pub fn is_empty(&self) -> bool {
        self.commands.is_empty()
    }

    /// The upper of an input collection (0 if it was never written).
    pub fn input_upper(&self, collection_id: u64) -> Timestamp {
        self.inputs.get(&collection_id).map_or(0, |l| l.upper)
    }

    /// The dataflows that are live (created and not dropped), in creation order.
    pub fn live_dataflows(&self) -> Vec<DataflowDescription> {
        reduce_commands(self.commands.clone(), self.retired_peeks.clone())
            .into_iter()
            .filter_map(|c| match c {
                CommandKind::CreateDataflow(d) => Some(d),
                _ => None,
            })
            .collect()
    }

    /// Removes dataflow `id` as if it had never been created: its
    /// CreateDataflow, and every later Schedule of it and AllowCompaction,
    /// Peek or Subscribe of one of its exports. For a dataflow a replica
    /// refused: replayed, it would be refused again, and commands naming its
    /// exports would be refused with it. Returns the removed description.
    pub fn forget_dataflow(&mut self, id: u64) -> Option<DataflowDescription> {
        let at = self
            .commands
            .iter()
            .position(|c| matches!(c, CommandKind::CreateDataflow(d) if d.id == id))?;
        let CommandKind::CreateDataflow(desc) = self.commands.remove(at) else {
            unreachable!("found above")
        };
        let exports: BTreeSet<u64> = desc.exports.iter().map(|e| e.collection_id).collect();
        let mut i = 0;
        self.commands.retain(|c| {
            i += 1;
            if i <= at {
                return true;
            }
            !match c {
                CommandKind::Schedule { dataflow_id } => *dataflow_id == id,
                CommandKind::AllowCompaction { collection_id, .. } => {
                    exports.contains(collection_id)
                }
                CommandKind::Peek(p) => exports.contains(&p.collection_id),
                CommandKind::Subscribe(s) => exports.contains(&s.collection_id),
                _ => false,
            }
        });
        Some(desc)
    }

    /// Compacts the history in place.
    pub fn reduce(&mut self) {
        let retired = std::mem::take(&mut self.retired_peeks);
        self.commands = reduce_commands(std::mem::take(&mut self.commands), retired);
        // A log of inserts alone is not re-sorted: it consolidates to
        // itself, and a write's latency must not depend on the rows stored.
        for log in self.inputs.values_mut().filter(|l| l.shrinkable()) {
            log.consolidate();
        }
        self.reduced_len = self.commands.len();
    }

    /// A stable digest of the compacted history: BLAKE3 over the
    /// length-prefixed protobuf encoding of each compacted command; an input
    /// collection's writes count by their upper and their [`InputLog`]
    /// digest, which does not depend on how the updates were split into
    /// writes or consolidated.
    pub fn digest(&self) -> Digest {
        let mut hasher = blake3::Hasher::new();
        for c in reduce_commands(self.commands.clone(), self.retired_peeks.clone()) {
            let sum = match &c {
                CommandKind::WriteInput(w) => {
                    let log = &self.inputs[&w.collection_id];
                    Some((log.upper, log.sum))
                }
                _ => None,
            };
            let wire = proto::Command {
                seqno: 0,
                strategy: 0,
                kind: Some(c.into()),
            };
            let bytes = wire.encode_to_vec();
            hasher.update(&(bytes.len() as u64).to_le_bytes());
            hasher.update(&bytes);
            if let Some((upper, sum)) = sum {
                hasher.update(&upper.to_le_bytes());
                for lane in sum {
                    hasher.update(&lane.to_le_bytes());
                }
            }
        }
        Digest(*hasher.finalize().as_bytes())
    }
}

/// The placeholder a collection's writes hold in the command list.
fn placeholder(collection_id: u64) -> CommandKind {
    CommandKind::WriteInput(WriteInput {
        collection_id,
        updates: Vec::new(),
        upper: 0,
        more: false,
        batch_digest: None,
    })
}

/// The writes to one input collection: its upper, its updates (consolidated
/// whenever they doubled since the last time and a retraction among them
/// could cancel something, so that appending costs amortized O(batch), the
/// log stays within twice its consolidated size, and a log of inserts alone,
/// which consolidates to itself, is never re-sorted), and an additive digest
/// of every update ever appended.
///
/// The updates are held as the batches they were appended in, each moved in
/// whole: appending never copies the updates already held (one vector of
/// every update would be copied whole each time it doubled).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct InputLog {
    batches: Vec<Vec<Update>>,
    /// The updates in `batches`.
    len: usize,
    consolidated: usize,
    /// A retraction was appended since the last consolidation.
    shrinkable: bool,
    upper: Timestamp,
    sum: [u64; 4],
}

impl InputLog {
    /// Appends updates (kept only if `keep`) and advances the upper.
    pub fn append(&mut self, updates: Vec<Update>, upper: Timestamp, keep: bool) {
        let digest = updates_digest(&updates);
        self.append_with_digest(updates, upper, keep, digest);
    }

    /// Appends updates (kept only if `keep`) and advances the upper, adding
    /// `digest` (the [`updates_digest`] of the whole batch these updates are
    /// a part of) rather than the updates' own.
    pub fn append_with_digest(
        &mut self,
        updates: Vec<Update>,
        upper: Timestamp,
        keep: bool,
        digest: [u64; 4],
    ) {
        for (lane, d) in self.sum.iter_mut().zip(digest) {
            *lane = lane.wrapping_add(d);
        }
        self.upper = self.upper.max(upper);
        if keep {
            self.push(updates);
            if self.shrinkable && self.len > 2 * self.consolidated + 1024 {
                self.consolidate();
            }
        }
    }

    /// Appends updates and advances the upper without adding them to the
    /// digest: for a holder that never reads one (the environment's index
    /// of stored writes, a replica worker's input store).
    /// [`digest`](Self::digest) then does not cover these updates.
    pub fn append_undigested(&mut self, updates: Vec<Update>, upper: Timestamp) {
        self.append_with_digest(updates, upper, true, [0; 4]);
    }

    fn push(&mut self, updates: Vec<Update>) {
        if updates.is_empty() {
            return;
        }
        self.shrinkable |= updates.iter().any(|u| u.diff < 0);
        self.len += updates.len();
        self.batches.push(updates);
    }

    /// Replaces the batches by their consolidation, as one batch.
    fn replace_by_consolidation(&mut self) {
        let all = consolidate(self.take_all());
        self.len = all.len();
        self.consolidated = all.len();
        self.batches = if all.is_empty() {
            Vec::new()
        } else {
            vec![all]
        };
    }

    /// Every update, taken out of the batches.
    fn take_all(&mut self) -> Vec<Update> {
        let mut batches = std::mem::take(&mut self.batches);
        if batches.len() == 1 {
            return batches.pop().unwrap_or_default();
        }
        let mut all = Vec::with_capacity(self.len);
        for b in batches {
            all.extend(b);
        }
        all
    }

    /// Advances the time of every update held below `since` to `since`, and
    /// consolidates: what is read at `since` or later does not change, and
    /// updates that cancel out there go. (The digest keeps counting the
    /// updates as they were appended.)
    pub fn compact(&mut self, since: Timestamp) {
        let mut moved = false;
        for u in self.batches.iter_mut().flatten() {
            if u.time < since {
                u.time = since;
                moved = true;
            }
        }
        if moved {
            self.replace_by_consolidation();
        }
    }

    /// Consolidates the updates held.
    pub fn consolidate(&mut self) {
        if self.len != self.consolidated || self.batches.len() > 1 {
            self.replace_by_consolidation();
        }
        self.shrinkable = false;
    }

    /// Whether a retraction was appended since the last consolidation (until
    /// then, consolidating could merge only equal rows of one write).
    pub fn shrinkable(&self) -> bool {
        self.shrinkable
    }

    /// The upper.
    pub fn upper(&self) -> Timestamp {
        self.upper
    }

    /// The updates held (not necessarily consolidated), in the order they
    /// were appended.
    pub fn updates(&self) -> impl Iterator<Item = &Update> {
        self.batches.iter().flatten()
    }

    /// How many updates are held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no update is held.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// A copy of the updates held, in the order they were appended.
    pub fn to_vec(&self) -> Vec<Update> {
        self.updates().cloned().collect()
    }

    /// The digest of every update appended: for each update, its diff times
    /// a BLAKE3 hash of (row, time), summed in four wrapping 64-bit lanes.
    /// Linear, so consolidating or splitting writes does not change it.
    pub fn digest(&self) -> [u64; 4] {
        self.sum
    }
}

/// The additive digest of `updates` (see [`InputLog::digest`]): the sum of
/// the digests of any split of them.
pub fn updates_digest(updates: &[Update]) -> [u64; 4] {
    let mut sum = [0u64; 4];
    let mut material = Vec::new();
    for u in updates {
        add_to_sum(&mut sum, u, &mut material);
    }
    sum
}

/// Adds one update's digest to `sum`; `material` is scratch space, kept
/// between updates so that hashing a row allocates nothing.
fn add_to_sum(sum: &mut [u64; 4], u: &Update, material: &mut Vec<u8>) {
    // A row of canonical varints (the built-in family's, and every row up
    // to v0.2.0) is hashed by its values as v0.2.0 did, so histories
    // recorded then keep their digests; any other row by its bytes, under a
    // key of its own so the two kinds never collide by construction. Both
    // hash the same bytes as one BLAKE3 update per field would: the values
    // (or the bytes), the count, the time.
    static OPAQUE: std::sync::LazyLock<blake3::Hasher> = std::sync::LazyLock::new(|| {
        blake3::Hasher::new_derive_key("lockstep 2026 opaque row digest")
    });
    material.clear();
    let canonical = crate::types::for_each_canonical_varint(&u.row, |v| {
        material.extend_from_slice(&v.to_le_bytes())
    });
    let hash = if canonical {
        let n = material.len() / 8;
        material.extend_from_slice(&(n as u64).to_le_bytes());
        material.extend_from_slice(&u.time.to_le_bytes());
        blake3::hash(material)
    } else {
        let mut h = OPAQUE.clone();
        h.update(&u.row);
        h.update(&(u.row.len() as u64).to_le_bytes());
        h.update(&u.time.to_le_bytes());
        h.finalize()
    };
    for (lane, chunk) in sum.iter_mut().zip(hash.as_bytes().chunks_exact(8)) {
        let x = u64::from_le_bytes(chunk.try_into().expect("8 bytes"));
        *lane = lane.wrapping_add(x.wrapping_mul(u.diff as u64));
    }
}

/// The compaction of a command list whose writes are placeholders.
fn reduce_commands(commands: Vec<CommandKind>, retired: BTreeSet<u64>) -> Vec<CommandKind> {
    // Pass 1: what the whole history says.
    let mut final_compaction: BTreeMap<u64, Frontier> = BTreeMap::new();
    let mut canceled: BTreeSet<u64> = retired;
    let mut canceled_subs: BTreeSet<u64> = BTreeSet::new();
    let mut config: BTreeMap<String, String> = BTreeMap::new();
    let mut last_instance = None;
    let mut last_init = None;
    for (i, c) in commands.iter().enumerate() {
        match c {
            CommandKind::AllowCompaction {
                collection_id,
                frontier,
            } => {
                final_compaction.insert(*collection_id, *frontier);
            }
            CommandKind::CancelPeek { peek_id } => {
                canceled.insert(*peek_id);
            }
            CommandKind::CancelSubscribe { subscribe_id } => {
                canceled_subs.insert(*subscribe_id);
            }
            CommandKind::UpdateConfiguration(params) => {
                config.extend(params.iter().map(|(k, v)| (k.clone(), v.clone())));
            }
            CommandKind::CreateInstance(_) => last_instance = Some(i),
            CommandKind::InitializationComplete => last_init = Some(i),
            _ => {}
        }
    }
    // Collections dropped for good, and dataflows all of whose exports are.
    let dropped: BTreeSet<u64> = final_compaction
        .iter()
        .filter(|(_, f)| f.is_none())
        .map(|(id, _)| *id)
        .collect();
    let mut dead_dataflows = BTreeSet::new();
    let mut dead_collections = BTreeSet::new();
    for c in &commands {
        if let CommandKind::CreateDataflow(d) = c {
            if !d.exports.is_empty() && d.exports.iter().all(|e| dropped.contains(&e.collection_id))
            {
                dead_dataflows.insert(d.id);
                dead_collections.extend(d.exports.iter().map(|e| e.collection_id));
            }
        }
    }

    // Pass 2: rebuild in order of first appearance.
    let mut out = Vec::with_capacity(commands.len());
    let mut config_done = false;
    let mut writes_done = BTreeSet::new();
    let mut compaction_done = BTreeSet::new();
    let mut scheduled = BTreeSet::new();
    for (i, c) in commands.into_iter().enumerate() {
        match c {
            CommandKind::Hello(_)
            | CommandKind::StatusRequest { .. }
            | CommandKind::CancelPeek { .. }
            | CommandKind::CancelSubscribe { .. } => {}
            CommandKind::CreateInstance(_) => {
                if Some(i) == last_instance {
                    out.push(c);
                }
            }
            CommandKind::InitializationComplete => {
                if Some(i) == last_init {
                    out.push(c);
                }
            }
            CommandKind::UpdateConfiguration(_) => {
                if !config_done {
                    config_done = true;
                    out.push(CommandKind::UpdateConfiguration(std::mem::take(
                        &mut config,
                    )));
                }
            }
            CommandKind::WriteInput(ref w) => {
                if writes_done.insert(w.collection_id) {
                    out.push(placeholder(w.collection_id));
                }
            }
            CommandKind::CreateDataflow(ref d) => {
                if !dead_dataflows.contains(&d.id) {
                    out.push(c);
                }
            }
            CommandKind::Schedule { dataflow_id } => {
                if !dead_dataflows.contains(&dataflow_id) && scheduled.insert(dataflow_id) {
                    out.push(c);
                }
            }
            CommandKind::AllowCompaction { collection_id, .. } => {
                if !dead_collections.contains(&collection_id)
                    && compaction_done.insert(collection_id)
                {
                    out.push(CommandKind::AllowCompaction {
                        collection_id,
                        frontier: final_compaction[&collection_id],
                    });
                }
            }
            CommandKind::Peek(ref p) => {
                if !canceled.contains(&p.peek_id) && !dropped.contains(&p.collection_id) {
                    out.push(c);
                }
            }
            CommandKind::Subscribe(ref s) => {
                if !dropped.contains(&s.collection_id) && !canceled_subs.contains(&s.subscribe_id) {
                    out.push(c);
                }
            }
        }
    }
    out
}

/// Sorts updates by (row, time) ([`row_order`]), sums the diffs of equal
/// (row, time) and drops the zeros.
pub fn consolidate(mut updates: Vec<Update>) -> Vec<Update> {
    updates.sort_by(|a, b| row_order(&a.row, &b.row).then(a.time.cmp(&b.time)));
    let mut out: Vec<Update> = Vec::with_capacity(updates.len());
    for u in updates {
        match out.last_mut() {
            Some(last) if last.row == u.row && last.time == u.time => {
                last.diff = last.diff.wrapping_add(u.diff)
            }
            _ => out.push(u),
        }
    }
    out.retain(|u| u.diff != 0);
    out
}

/// The order [`consolidate`] sorts rows in: by the 64-bit values their
/// bytes decode to as varints ([`crate::varint_values`]), then by the bytes.
/// A total order in which equal rows are adjacent. Rows of 64-bit integers
/// (the built-in family's) sort in numeric order, as they did when rows were
/// integer vectors, so a write of rows in that order is already sorted and
/// costs one pass: byte order is not numeric order for varints (128 encodes
/// as `80 01`, after 2's `02`), and sorting every write again showed in the
/// ingest of a million rows (`limits/ingest_1M`, about 0.2 s of 2 s).
pub fn row_order(a: &[u8], b: &[u8]) -> std::cmp::Ordering {
    use std::cmp::Ordering;
    let (mut i, mut j) = (0, 0);
    loop {
        // Compared as `Iterator::cmp` compares the two value sequences
        // (a sequence that ends first is less), written out because it is
        // every comparison of every sort of rows.
        match (
            crate::types::next_varint(a, &mut i),
            crate::types::next_varint(b, &mut j),
        ) {
            (Some(x), Some(y)) => match (x as i64).cmp(&(y as i64)) {
                Ordering::Equal => {}
                other => return other,
            },
            (None, Some(_)) => return Ordering::Less,
            (Some(_), None) => return Ordering::Greater,
            (None, None) => return a.cmp(b),
        }
    }
}

#[cfg(test)]
mod forget_tests {
    use super::*;
    use crate::types::{Export, Peek};

    fn create(id: u64, export: u64) -> CommandKind {
        CommandKind::CreateDataflow(DataflowDescription {
            id,
            as_of: 0,
            inputs: vec![1],
            exports: vec![Export {
                collection_id: export,
                description: vec![1],
            }],
            debug_name: String::new(),
            format: crate::DEFAULT_FORMAT.into(),
        })
    }

    #[test]
    fn a_forgotten_dataflow_leaves_with_the_commands_naming_its_exports() {
        let mut h = CommandHistory::new();
        h.push(create(1, 101));
        h.push(create(2, 102));
        h.push(CommandKind::AllowCompaction {
            collection_id: 102,
            frontier: Some(3),
        });
        h.push(CommandKind::Peek(Peek {
            peek_id: 9,
            collection_id: 102,
            timestamp: 1,
        }));
        h.push(CommandKind::AllowCompaction {
            collection_id: 101,
            frontier: Some(2),
        });
        let forgotten = h.forget_dataflow(2).expect("dataflow 2 was there");
        assert_eq!(forgotten.id, 2);
        assert_eq!(
            h.commands(),
            vec![
                create(1, 101),
                CommandKind::AllowCompaction {
                    collection_id: 101,
                    frontier: Some(2)
                }
            ]
        );
        assert!(h.forget_dataflow(2).is_none());
    }
}
