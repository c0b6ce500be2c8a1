//! The `barrier` strategy, and the barrier rounds that also run every
//! collective reconciliation. The controller's part is one copy per process
//! (a write split per process); a `naive` session's InitializationComplete
//! is sent with `barrier` when the replica must reconcile collectively
//! ([`crate::ControllerSession::completion_strategy`]).
//!
//! A CreateDataflow of a new, valid dataflow sent with `barrier` is a
//! *round*: the worker announces (session, seqno, description hash) on the
//! control mesh and applies nothing else until its [`RoundBook`] (whose
//! decision is [`crate::barrier`]) says every worker announced the same
//! (pass: build), that a worker moved on to a newer session without it
//! (abandoned: build nowhere), or that the workers received different
//! commands (diverged: halt, so the controller restarts the replica). A
//! round that waits longer than [`BARRIER_TIMEOUT_MS`] halts too.
//!
//! Reconciliation is collective for `barrier`, `broadcast` and `log`
//! sessions: at InitializationComplete every worker announces its installed
//! dataflows in one round, and every worker applies the same
//! [`crate::collective`] plan: keep what every worker has with the target's
//! hash, drop the rest, build the missing ones in the target's order,
//! together.
//!
//! [`RoundBook`]: crate::RoundBook

use lockstep_protocol::Digest;

use super::{Source, StrategyRules};
use crate::worker::{
    target_of, Action, MeshAnnouncement, Pending, Reconciliation, SessionCommand, WorkerSession,
    WorkerView,
};
use crate::{Announcement, BarrierDecision, DataflowKey, Report};

/// The `barrier` strategy: a copy to every process (a write split so each
/// process gets its workers' rows); on the worker, the socket copy; a
/// CreateDataflow of a new, valid dataflow waits at a barrier round; a
/// session reconciles collectively.
#[derive(Clone, Copy, Debug)]
pub struct Barrier;

impl StrategyRules for Barrier {
    fn source(&self) -> Source {
        Source::Socket
    }
    fn creates_in_rounds(&self) -> bool {
        true
    }
}

/// The longest a worker waits at a barrier before it halts, in ms.
pub const BARRIER_TIMEOUT_MS: u64 = 20_000;

/// An order-sensitive digest of a reconciliation target.
pub fn target_hash(target: &[DataflowKey]) -> Digest {
    let mut h = blake3::Hasher::new();
    h.update(&(target.len() as u64).to_le_bytes());
    for k in target {
        h.update(&k.id.to_le_bytes());
        h.update(&k.hash.0);
    }
    Digest(*h.finalize().as_bytes())
}

impl<C: SessionCommand> WorkerSession<C> {
    /// Starts the barrier round of a CreateDataflow of `key`: announces it
    /// and waits for it.
    pub(crate) fn start_create_round(&mut self, cmd: C, key: DataflowKey, now_ms: u64) {
        let mine = Announcement {
            worker: self.index,
            seqno: cmd.seqno(),
            hash: key.hash,
        };
        self.announce(mine, None);
        self.pending = Some(Pending::Create {
            cmd,
            mine,
            since_ms: now_ms,
        });
    }

    /// Starts the collective reconciliation round of InitializationComplete
    /// `seqno`: announces the target's hash and this worker's installed
    /// dataflows, and waits, keeping `buffer` to apply once the round passes.
    pub(crate) fn start_collective(
        &mut self,
        buffer: Vec<C>,
        seqno: u64,
        view: &impl WorkerView<C>,
        now_ms: u64,
    ) {
        let target = target_of(&buffer);
        let mine = Announcement {
            worker: self.index,
            seqno,
            hash: target_hash(&target),
        };
        self.announce(
            mine,
            Some(Report {
                installed: view.installed(),
                created: view.creation_digest(),
            }),
        );
        self.pending = Some(Pending::Reconcile {
            buffer,
            target,
            mine,
            since_ms: now_ms,
        });
    }

    /// Announces this worker's round `mine` (with its report for a
    /// reconciliation round); its own book reads it at once.
    fn announce(&mut self, mine: Announcement, report: Option<Report>) {
        let session = self.session;
        self.rounds.announced(session, mine, report.clone());
        self.out
            .push_back(Action::Announce(MeshAnnouncement::Round {
                session,
                announcement: mine,
                report,
            }));
    }

    /// Decides the pending round `p` from what the mesh delivered: queues
    /// its actions if it passed, halts if it diverged or timed out. Returns
    /// it if it still waits.
    pub(crate) fn resolve(&mut self, p: Pending<C>, now_ms: u64) -> Option<Pending<C>> {
        let (mine, since_ms) = p.mine();
        let session = self.session;
        match self.rounds.decide(session, &mine) {
            BarrierDecision::Wait => {
                if now_ms.saturating_sub(since_ms) > BARRIER_TIMEOUT_MS {
                    self.halt(format!(
                        "worker {} waited {BARRIER_TIMEOUT_MS} ms at the barrier for command {} of session {session:#x} without every worker announcing it",
                        self.index, mine.seqno
                    ));
                    return None;
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
            BarrierDecision::Abandoned { .. } => {
                // A newer session started: the round builds nowhere.
                self.rounds.forget_through(session, mine.seqno);
                None
            }
            BarrierDecision::Pass => {
                match p {
                    Pending::Create { cmd, .. } => {
                        self.rounds.forget_through(session, mine.seqno);
                        self.out.push_back(Action::Apply(cmd));
                    }
                    Pending::Reconcile { buffer, target, .. } => {
                        // Plan from the round's reports before the round is
                        // forgotten.
                        let plan = self
                            .rounds
                            .reconcile_plan(session, mine.seqno, self.index, &target);
                        self.rounds.forget_through(session, mine.seqno);
                        let (drops, _builds) = match plan {
                            Ok(plan) => plan,
                            Err(e) => {
                                self.halt(format!(
                                    "the reconciliation round {} of session {session:#x} passed, but {e}",
                                    mine.seqno
                                ));
                                return None;
                            }
                        };
                        // The builds are the target's missing dataflows,
                        // which the buffer's creates build in target order.
                        self.finish_reconcile(drops, buffer, Reconciliation::Collective);
                    }
                }
                None
            }
        }
    }
}
