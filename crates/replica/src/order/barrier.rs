//! The `barrier` strategy, and the barrier rounds that also run every
//! collective reconciliation.
//!
//! Each worker applies the copy from its own process's connection. A
//! CreateDataflow of a new, valid dataflow is a *round*: the worker
//! announces (session, seqno, description hash) on the control mesh (see
//! `worker::mesh`) and waits (still stepping, still reading the mesh, but
//! applying nothing else) until its book of rounds
//! ([`lockstep_reconcile::RoundBook`], whose decision is
//! `lockstep_reconcile::barrier`) says every worker announced the same
//! (pass: build), that a worker moved on to a newer session without it
//! (abandoned: build nowhere), or that the workers received different
//! commands (diverged: halt, so the controller restarts the replica). A
//! round that waits longer than [`BARRIER_TIMEOUT`] halts too.
//!
//! Reconciliation is collective for `barrier`, `broadcast` and `log`
//! sessions (earlier sessions may have used another strategy): at
//! InitializationComplete every worker announces its installed dataflows in
//! one round, and every worker applies the same
//! `lockstep_reconcile::collective` plan: keep what every worker has with
//! the target's hash, drop the rest, build the missing ones in the target's
//! order, together.

use std::time::Duration;

use lockstep_protocol::{Command, Digest};
use lockstep_reconcile::{Announcement, BarrierDecision, DataflowKey};
use timely::worker::Worker;

use crate::worker::{MeshMessage, WorkerState};

/// The longest a worker waits at a barrier before it halts.
pub const BARRIER_TIMEOUT: Duration = Duration::from_secs(20);

/// A barrier round this worker announced and waits on; it blocks the queue.
pub(crate) enum Pending {
    /// A CreateDataflow that builds once the round passes.
    Create {
        cmd: Command,
        mine: Announcement,
        since: std::time::Instant,
    },
    /// A collective reconciliation: the buffered session start and the
    /// target it creates.
    Reconcile {
        buffer: Vec<Command>,
        target: Vec<DataflowKey>,
        mine: Announcement,
        since: std::time::Instant,
    },
}

/// An order-sensitive digest of a reconciliation target.
fn target_hash(target: &[DataflowKey]) -> Digest {
    let mut h = blake3::Hasher::new();
    h.update(&(target.len() as u64).to_le_bytes());
    for k in target {
        h.update(&k.id.to_le_bytes());
        h.update(&k.hash.0);
    }
    Digest(*h.finalize().as_bytes())
}

impl WorkerState {
    /// Starts the barrier round of a CreateDataflow whose description hash is
    /// `hash`: announces it and waits for it.
    pub(crate) fn start_create_round(&mut self, cmd: Command, hash: Digest) {
        let mine = Announcement {
            worker: self.index,
            seqno: cmd.seqno,
            hash,
        };
        self.announce(&mine, None);
        self.pending = Some(Pending::Create {
            cmd,
            mine,
            since: std::time::Instant::now(),
        });
    }

    /// Announces this worker's round `a`, with its report for a
    /// reconciliation round.
    fn announce(&mut self, a: &Announcement, report: Option<Vec<DataflowKey>>) {
        let message = MeshMessage::Round {
            session: self.session,
            seqno: a.seqno,
            hash: a.hash.0,
            report: report.map(|r| r.iter().map(|k| (k.id, k.hash.0)).collect()),
        };
        if let Some(mesh) = &mut self.mesh {
            mesh.send(self.index, message);
        }
    }

    fn installed_keys(&self) -> Vec<DataflowKey> {
        // In creation order, so that plans keep that order.
        let mut keys: Vec<DataflowKey> = Vec::new();
        for e in &self.creation_log {
            if let Some(inst) = self.dataflows.get(&e.dataflow_id) {
                if inst.timely_index as u64 == e.timely_index {
                    keys.push(DataflowKey {
                        id: e.dataflow_id,
                        hash: inst.hash,
                    });
                }
            }
        }
        keys
    }

    /// Starts the collective reconciliation round of InitializationComplete
    /// `seqno`: announces the target's hash and this worker's installed
    /// dataflows, and waits, keeping `buffer` to apply once the round passes.
    pub(crate) fn start_collective(&mut self, buffer: Vec<Command>, seqno: u64) {
        let target: Vec<DataflowKey> = super::target_of(&buffer);
        let mine = Announcement {
            worker: self.index,
            seqno,
            hash: target_hash(&target),
        };
        let installed = self.installed_keys();
        self.announce(&mine, Some(installed));
        self.pending = Some(Pending::Reconcile {
            buffer,
            target,
            mine,
            since: std::time::Instant::now(),
        });
    }

    /// Decides the pending round `p` from what the mesh delivered: applies it
    /// if it passed, halts if it diverged or timed out. Returns it if it still
    /// waits.
    pub(crate) fn resolve(&mut self, worker: &mut Worker, p: Pending) -> Option<Pending> {
        let (mine, since) = match &p {
            Pending::Create { mine, since, .. } | Pending::Reconcile { mine, since, .. } => {
                (*mine, *since)
            }
        };
        match self.rounds.decide(self.session, &mine) {
            BarrierDecision::Wait => {
                if since.elapsed() > BARRIER_TIMEOUT {
                    self.halt(format!(
                        "worker {} waited {:?} at the barrier for command {} of session {:#x} without every worker announcing it",
                        self.index, BARRIER_TIMEOUT, mine.seqno, self.session
                    ));
                }
                Some(p)
            }
            BarrierDecision::Diverged {
                worker: w,
                theirs,
                ours,
            } => {
                self.halt(format!(
                    "workers received different commands: worker {w} announced {theirs:?}, worker {} {ours:?}",
                    self.index
                ));
                None
            }
            BarrierDecision::Abandoned { worker: w } => {
                tracing::info!(
                    worker = self.index,
                    seqno = mine.seqno,
                    by = w,
                    "barrier round abandoned: a newer session started"
                );
                self.prune_round(mine.seqno);
                None
            }
            BarrierDecision::Pass => {
                match p {
                    Pending::Create { cmd, .. } => {
                        self.prune_round(mine.seqno);
                        self.apply(worker, cmd);
                    }
                    Pending::Reconcile { buffer, target, .. } => {
                        // Plan from the round's reports before the round is
                        // forgotten.
                        let plan = self.rounds.reconcile_plan(
                            self.session,
                            mine.seqno,
                            self.index,
                            &target,
                        );
                        self.prune_round(mine.seqno);
                        let Some((drops, _builds)) = plan else {
                            self.halt(format!(
                                "the reconciliation round {} of session {:#x} passed without every worker's installed dataflows",
                                mine.seqno, self.session
                            ));
                            return None;
                        };
                        // The builds are the target's missing dataflows, which
                        // the buffer's creates build in target order.
                        self.finish_reconcile(worker, drops, buffer, "collective");
                    }
                }
                None
            }
        }
    }

    /// Forgets the announcements of decided rounds (up to `seqno`) of the
    /// current session: later rounds never look at them.
    fn prune_round(&mut self, seqno: u64) {
        let session = self.session;
        self.rounds.forget_through(session, seqno);
    }
}
