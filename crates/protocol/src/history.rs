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
//! - answered ([`CommandHistory::retire_peek`]) and canceled peeks vanish;
//! - configuration updates merge into one (later values win);
//! - writes to one input collection consolidate into one WriteInput;
//! - only the last AllowCompaction per collection, the last CreateInstance and
//!   the last InitializationComplete stay;
//! - Hello and StatusRequest are never kept.
//!
//! Two histories that reduce to the same commands have the same digest.

use std::collections::{BTreeMap, BTreeSet};

use prost::Message;

use crate::proto;
use crate::types::{CommandKind, DataflowDescription, Digest, Frontier, Update, WriteInput};

/// A compacted sequence of commands.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CommandHistory {
    commands: Vec<CommandKind>,
    retired_peeks: BTreeSet<u64>,
    reduced_len: usize,
}

impl CommandHistory {
    /// An empty history.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends a command. Hello and StatusRequest are not history and are
    /// ignored. Compacts now and then so that the history stays proportional
    /// to the live state rather than to the number of commands sent.
    pub fn push(&mut self, kind: CommandKind) {
        if matches!(
            kind,
            CommandKind::Hello(_) | CommandKind::StatusRequest { .. }
        ) {
            return;
        }
        self.commands.push(kind);
        if self.commands.len() > 2 * self.reduced_len + 32 {
            self.reduce();
        }
    }

    /// Marks a peek answered: it leaves the history at the next compaction.
    pub fn retire_peek(&mut self, peek_id: u64) {
        self.retired_peeks.insert(peek_id);
    }

    /// The commands, in order (not necessarily compacted; call
    /// [`reduce`](Self::reduce) first for the compacted form).
    pub fn commands(&self) -> &[CommandKind] {
        &self.commands
    }

    /// How many commands are held.
    pub fn len(&self) -> usize {
        self.commands.len()
    }

    /// Whether the history holds no command.
    pub fn is_empty(&self) -> bool {
        self.commands.is_empty()
    }

    /// The dataflows that are live (created and not dropped), in creation order.
    pub fn live_dataflows(&self) -> Vec<DataflowDescription> {
        let mut reduced = self.clone();
        reduced.reduce();
        reduced
            .commands
            .into_iter()
            .filter_map(|c| match c {
                CommandKind::CreateDataflow(d) => Some(d),
                _ => None,
            })
            .collect()
    }

    /// Compacts the history in place.
    pub fn reduce(&mut self) {
        // Pass 1: what the whole history says.
        let mut final_compaction: BTreeMap<u64, Frontier> = BTreeMap::new();
        let mut canceled: BTreeSet<u64> = std::mem::take(&mut self.retired_peeks);
        let mut config: BTreeMap<String, String> = BTreeMap::new();
        let mut writes: BTreeMap<u64, (Vec<Update>, u64)> = BTreeMap::new();
        let mut last_instance = None;
        let mut last_init = None;
        for (i, c) in self.commands.iter().enumerate() {
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
                CommandKind::UpdateConfiguration(params) => {
                    config.extend(params.iter().map(|(k, v)| (k.clone(), v.clone())));
                }
                CommandKind::WriteInput(w) => {
                    let entry = writes.entry(w.collection_id).or_default();
                    entry.0.extend(w.updates.iter().cloned());
                    entry.1 = entry.1.max(w.upper);
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
        for c in &self.commands {
            if let CommandKind::CreateDataflow(d) = c {
                if !d.exports.is_empty()
                    && d.exports.iter().all(|e| dropped.contains(&e.collection_id))
                {
                    dead_dataflows.insert(d.id);
                    dead_collections.extend(d.exports.iter().map(|e| e.collection_id));
                }
            }
        }

        // Pass 2: rebuild in order of first appearance.
        let mut out = Vec::with_capacity(self.commands.len());
        let mut config_done = false;
        let mut writes_done = BTreeSet::new();
        let mut compaction_done = BTreeSet::new();
        let mut scheduled = BTreeSet::new();
        let commands = std::mem::take(&mut self.commands);
        for (i, c) in commands.into_iter().enumerate() {
            match c {
                CommandKind::Hello(_)
                | CommandKind::StatusRequest { .. }
                | CommandKind::CancelPeek { .. } => {}
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
                CommandKind::WriteInput(w) => {
                    if writes_done.insert(w.collection_id) {
                        let (updates, upper) = writes.remove(&w.collection_id).unwrap_or_default();
                        out.push(CommandKind::WriteInput(WriteInput {
                            collection_id: w.collection_id,
                            updates: consolidate(updates),
                            upper,
                        }));
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
                    if !dropped.contains(&s.collection_id) {
                        out.push(c);
                    }
                }
            }
        }
        self.commands = out;
        self.reduced_len = self.commands.len();
    }

    /// A stable digest of the compacted history: BLAKE3 over the
    /// length-prefixed protobuf encoding of each compacted command.
    pub fn digest(&self) -> Digest {
        let mut reduced = self.clone();
        reduced.reduce();
        let mut hasher = blake3::Hasher::new();
        for c in reduced.commands {
            let wire = proto::Command {
                seqno: 0,
                strategy: 0,
                kind: Some(c.into()),
            };
            let bytes = wire.encode_to_vec();
            hasher.update(&(bytes.len() as u64).to_le_bytes());
            hasher.update(&bytes);
        }
        Digest(*hasher.finalize().as_bytes())
    }
}

/// Sorts updates by (row, time), sums the diffs of equal (row, time) and drops
/// the zeros.
pub fn consolidate(mut updates: Vec<Update>) -> Vec<Update> {
    updates.sort_by(|a, b| (&a.row, a.time).cmp(&(&b.row, b.time)));
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
