//! One worker's session and command ordering as a sans-IO state machine.
//!
//! [`WorkerSession`] decides, for one timely worker, what happens to each
//! command in the order the worker's strategy delivers it: a Hello starts a
//! session, the session start is buffered until InitializationComplete and
//! then reconciled (alone or collectively), a CreateDataflow of a new dataflow
//! waits at a barrier round, commands of an older session are skipped (see
//! [`crate::strategy::log`]), and a worker that cannot prove it is in lockstep halts. It owns
//! the queue of commands the worker has not applied yet, the pending barrier
//! round and the worker's [`RoundBook`].
//!
//! Nothing here does I/O: no timely, sockets, clocks or stores. Events come
//! in ([`WorkerSession::push`] a command in the worker's order,
//! [`WorkerSession::on_mesh`] a record of the control mesh), and
//! [`WorkerSession::next`] hands out one [`Action`] at a time (build or drop
//! by applying a command, announce on the mesh, answer a Hello, halt),
//! given a [`WorkerView`] of what the worker runs and the time. The replica's
//! worker (`crates/replica/src/worker`) is the shell that feeds it and
//! performs its actions; the model checker (`crates/model`) drives the same
//! type under every interleaving of channel and mesh deliveries, crashes and
//! reconnects.
//!
//! Each strategy's part of the machine is in its module of
//! [`crate::strategy`] (where its commands come from, what gates them, how
//! it reconciles; the log's state is one [`LogCursor`] field). Taking the
//! commands from their [`crate::Source`] (the socket, the sequencer on the
//! mesh, the command log) is the shell's part.

use std::collections::VecDeque;

use lockstep_protocol::{Command, CommandKind, Strategy};

use crate::strategy::log::LogCursor;
use crate::strategy::{rules, SourceMarkers};
use crate::{
    session_of, Announcement, BarrierDecision, DataflowKey, Digest, Report, RoundBook, Session,
};

pub use crate::strategy::barrier::BARRIER_TIMEOUT_MS;

/// What the session machine needs to know of a command.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CommandClass {
    /// A Hello of `session`.
    Hello {
        /// The session it starts (see [`session_of`]).
        session: Session,
    },
    /// InitializationComplete: the end of a session start.
    InitializationComplete,
    /// A CreateDataflow of `key`.
    Create {
        /// The dataflow's ID and description hash.
        key: DataflowKey,
    },
    /// Anything else: applied when its turn comes.
    Other,
}

/// A command as the session machine sees it. Implemented for the wire's
/// [`Command`]; the model implements it for its own commands.
pub trait SessionCommand: Clone {
    /// Its sequence number within its session.
    fn seqno(&self) -> u64;
    /// The strategy it was sent with.
    fn strategy(&self) -> Strategy;
    /// What kind of command it is.
    fn class(&self) -> CommandClass;
    /// The session of a Hello, `None` for any other command. Asked of every
    /// command on its way in, so it should not cost what [`class`] may (a
    /// CreateDataflow's description hash).
    ///
    /// [`class`]: SessionCommand::class
    fn hello_session(&self) -> Option<Session> {
        match self.class() {
            CommandClass::Hello { session } => Some(session),
            _ => None,
        }
    }
}

impl SessionCommand for Command {
    fn seqno(&self) -> u64 {
        self.seqno
    }

    fn strategy(&self) -> Strategy {
        self.strategy
    }

    fn class(&self) -> CommandClass {
        match &self.kind {
            CommandKind::Hello(h) => CommandClass::Hello {
                session: session_of(h.epoch, h.nonce),
            },
            CommandKind::InitializationComplete => CommandClass::InitializationComplete,
            CommandKind::CreateDataflow(d) => CommandClass::Create {
                key: DataflowKey {
                    id: d.id,
                    hash: d.hash(),
                },
            },
            _ => CommandClass::Other,
        }
    }

    fn hello_session(&self) -> Option<Session> {
        match &self.kind {
            CommandKind::Hello(h) => Some(session_of(h.epoch, h.nonce)),
            _ => None,
        }
    }
}

/// What the worker runs, as its session machine needs to see it.
pub trait WorkerView<C> {
    /// Whether dataflow `id` is installed.
    fn is_installed(&self, id: u64) -> bool;
    /// The installed dataflows, in creation order.
    fn installed(&self) -> Vec<DataflowKey>;
    /// A digest of the worker's dataflow-creation log (timely index, ID and
    /// description hash of everything it ever built).
    fn creation_digest(&self) -> Digest;
    /// Whether the worker would build this CreateDataflow (its description
    /// is valid); an invalid one is applied at once, to be refused.
    fn buildable(&self, cmd: &C) -> bool;
}

/// A record a worker sends every worker over the control mesh.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum MeshAnnouncement {
    /// The sender accepted the Hello of `session`.
    Joined {
        /// The session.
        session: Session,
    },
    /// The sender reached a barrier round of `session`.
    Round {
        /// The session.
        session: Session,
        /// The round (the sender, the command's seqno, its hash).
        announcement: Announcement,
        /// A reconciliation round: the sender's installed dataflows in
        /// creation order and its creation log's digest. `None` for a
        /// create round.
        report: Option<Report>,
    },
}

/// How a reconciliation was decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Reconciliation {
    /// By this worker alone ([`crate::local`]).
    PerWorker,
    /// By every worker together ([`crate::collective`]).
    Collective,
}

/// What the shell must do next, in this order.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Action<C> {
    /// Send this record to every worker on the control mesh.
    Announce(MeshAnnouncement),
    /// Answer a Hello: report Status. `started` is the new session if the
    /// Hello started one: forget per-session state (peeks, subscriptions,
    /// write parts) first.
    Hello {
        /// The Hello.
        cmd: C,
        /// The session it started, if any.
        started: Option<Session>,
    },
    /// Reconciliation drops installed dataflow `id`.
    Drop {
        /// The dataflow.
        id: u64,
        /// Decided alone or together.
        how: Reconciliation,
    },
    /// A reconciliation ended: start the applied history afresh.
    ResetHistory,
    /// Apply this command now (build, drop, write, ...).
    Apply(C),
    /// A command of a session older than the worker's was skipped: a
    /// command-log entry, or (on a worker that tails a log) a socket copy
    /// that came after the worker joined a newer session from the log.
    Skipped {
        /// Its sequence number.
        seqno: u64,
    },
    /// Stop the process: the worker cannot prove it is in lockstep (I4).
    Halt(String),
}

/// The barrier round a worker announced and waits on; it blocks the queue.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Pending<C> {
    /// A CreateDataflow that builds once the round passes.
    Create {
        cmd: C,
        mine: Announcement,
        since_ms: u64,
    },
    /// A collective reconciliation: the buffered session start and the
    /// target it creates.
    Reconcile {
        buffer: Vec<C>,
        target: Vec<DataflowKey>,
        mine: Announcement,
        since_ms: u64,
    },
}

impl<C> Pending<C> {
    pub(crate) fn mine(&self) -> (Announcement, u64) {
        match self {
            Pending::Create { mine, since_ms, .. } | Pending::Reconcile { mine, since_ms, .. } => {
                (*mine, *since_ms)
            }
        }
    }
}

/// A pending round as the shell may inspect it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PendingRound {
    /// The round's announcement.
    pub mine: Announcement,
    /// Whether it is a reconciliation round (else a create round).
    pub reconcile: bool,
    /// When it was announced (the shell's clock, ms).
    pub since_ms: u64,
}

/// One worker's session state machine (see the module docs).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct WorkerSession<C> {
    pub(crate) index: usize,
    pub(crate) has_mesh: bool,
    pub(crate) session: Session,
    /// The session of the last Hello taken from the queue, per source.
    pub(crate) markers: SourceMarkers,
    /// Commands of a session start, until InitializationComplete.
    pub(crate) reconciling: Option<Vec<C>>,
    pub(crate) queue: VecDeque<C>,
    pub(crate) pending: Option<Pending<C>>,
    pub(crate) rounds: RoundBook,
    pub(crate) out: VecDeque<Action<C>>,
    pub(crate) halted: bool,
    /// The command log as this worker tails it (`log`'s state).
    pub(crate) log: LogCursor<C>,
}

impl<C: SessionCommand> WorkerSession<C> {
    /// The machine of worker `index` of `peers`, in no session yet;
    /// `has_mesh` whether the worker has a control mesh (without one, every
    /// reconciliation is per worker and no create waits at a round).
    pub fn new(index: usize, peers: usize, has_mesh: bool) -> Self {
        WorkerSession {
            index,
            has_mesh,
            session: 0,
            markers: SourceMarkers::default(),
            reconciling: None,
            queue: VecDeque::new(),
            pending: None,
            rounds: RoundBook::new(peers),
            out: VecDeque::new(),
            halted: false,
            log: LogCursor::default(),
        }
    }

    /// The same machine with a flaw planted in its round book (model
    /// checking only).
    #[cfg(feature = "mutants")]
    pub fn with_mutant(mut self, mutant: crate::RoundMutant) -> Self {
        self.rounds = self.rounds.with_mutant(mutant);
        self
    }

    /// The same machine as a worker that joined `session`, reconciled in
    /// it, and knows every peer joined it too (a replica in its steady
    /// state: the model checker's initial state).
    pub fn resumed(mut self, session: Session) -> Self {
        self.session = session;
        self.markers = SourceMarkers::all(session);
        self.reconciling = None;
        self.rounds.start_session(session);
        for w in 0..self.rounds.peers() {
            self.rounds.joined(w, session);
        }
        self
    }

    /// The newest session this worker joined.
    pub fn session(&self) -> Session {
        self.session
    }

    /// Whether a session start is buffered, waiting for InitializationComplete.
    pub fn is_reconciling(&self) -> bool {
        self.reconciling.is_some()
    }

    /// The barrier round this worker waits on, if any.
    pub fn pending(&self) -> Option<PendingRound> {
        self.pending.as_ref().map(|p| {
            let (mine, since_ms) = p.mine();
            PendingRound {
                mine,
                reconcile: matches!(p, Pending::Reconcile { .. }),
                since_ms,
            }
        })
    }

    /// The decision the pending round would take now, from what the mesh
    /// delivered so far; `None` without a pending round.
    pub fn decision(&self) -> Option<BarrierDecision> {
        let p = self.pending.as_ref()?;
        Some(self.rounds.decide(self.session, &p.mine().0))
    }

    /// Whether the machine halted.
    pub fn halted(&self) -> bool {
        self.halted
    }

    /// Commands queued and not yet handed out.
    pub fn queued(&self) -> usize {
        self.queue.len() + self.log.held.len()
    }

    /// A command in this worker's order (its socket copy for `naive` and
    /// `barrier`, the sequencer's copy for `broadcast`, a log entry for
    /// `log`): queued until [`WorkerSession::next`] hands it out.
    pub fn push(&mut self, cmd: C) {
        if self.holds(&cmd) {
            self.log.held.push_back(cmd);
        } else {
            self.queue.push_back(cmd);
        }
    }

    /// A record the control mesh delivered from worker `from`. Records of
    /// workers outside the replica are ignored, as are this worker's own:
    /// its book read them when it announced them.
    pub fn on_mesh(&mut self, from: usize, record: MeshAnnouncement) {
        if from == self.index {
            return;
        }
        match record {
            MeshAnnouncement::Joined { session } => self.rounds.joined(from, session),
            MeshAnnouncement::Round {
                session,
                announcement,
                report,
            } => {
                if announcement.worker == from {
                    self.rounds.announced(session, announcement, report);
                }
            }
        }
    }

    /// The next action, or `None` when the worker has nothing to do until
    /// the next event (nothing queued, or a barrier round still waits).
    /// `view` is what the worker runs after every earlier action was
    /// performed; `now_ms` the shell's monotonic clock (a waiting round
    /// halts after [`BARRIER_TIMEOUT_MS`]).
    pub fn next(&mut self, view: &impl WorkerView<C>, now_ms: u64) -> Option<Action<C>> {
        loop {
            if let Some(a) = self.out.pop_front() {
                return Some(a);
            }
            if self.halted {
                return None;
            }
            self.check_held(now_ms);
            if self.halted {
                continue;
            }
            if let Some(p) = self.pending.take() {
                self.pending = self.resolve(p, now_ms);
                if self.pending.is_some() && self.out.is_empty() {
                    return None;
                }
                continue;
            }
            let cmd = self.queue.pop_front()?;
            if self.markers.stale(&cmd, self.session) {
                return Some(Action::Skipped { seqno: cmd.seqno() });
            }
            self.handle(cmd, view, now_ms);
        }
    }

    /// One command, in this worker's order.
    fn handle(&mut self, cmd: C, view: &impl WorkerView<C>, now_ms: u64) {
        let class = cmd.class();
        if let CommandClass::Hello { session } = class {
            let started = (session > self.session).then(|| {
                self.session = session;
                self.rounds.start_session(session);
                self.rounds.joined(self.index, session);
                if self.has_mesh {
                    self.out
                        .push_back(Action::Announce(MeshAnnouncement::Joined { session }));
                }
                self.reconciling = Some(Vec::new());
                session
            });
            self.out.push_back(Action::Hello { cmd, started });
            return;
        }
        if let Some(buffer) = &mut self.reconciling {
            let (strategy, seqno) = (cmd.strategy(), cmd.seqno());
            buffer.push(cmd);
            if class == CommandClass::InitializationComplete {
                let buffer = self.reconciling.take().unwrap_or_default();
                if rules(strategy).reconciles_collectively() && self.has_mesh {
                    self.start_collective(buffer, seqno, view, now_ms);
                } else {
                    self.reconcile_locally(buffer, view);
                }
            }
            return;
        }
        if let CommandClass::Create { key } = class {
            if rules(cmd.strategy()).creates_in_rounds()
                && self.has_mesh
                && !view.is_installed(key.id)
                && view.buildable(&cmd)
            {
                self.start_create_round(cmd, key, now_ms);
                return;
            }
        }
        self.out.push_back(Action::Apply(cmd));
    }

    /// Ends a reconciliation, alone or collective (`how`): drops `drops`,
    /// starts the applied history afresh, then applies the buffered session
    /// start, whose creates build what is missing in target order.
    pub(crate) fn finish_reconcile(
        &mut self,
        drops: Vec<u64>,
        buffer: Vec<C>,
        how: Reconciliation,
    ) {
        for id in drops {
            self.out.push_back(Action::Drop { id, how });
        }
        self.out.push_back(Action::ResetHistory);
        self.out.extend(buffer.into_iter().map(Action::Apply));
    }

    /// Stops: nothing is handed out after the halt.
    pub(crate) fn halt(&mut self, reason: String) {
        self.halted = true;
        self.out.push_back(Action::Halt(reason));
    }
}

/// The reconciliation target a buffered session start asks for: every
/// dataflow its creates name, in the order they come.
pub fn target_of<C: SessionCommand>(buffer: &[C]) -> Vec<DataflowKey> {
    buffer
        .iter()
        .filter_map(|c| match c.class() {
            CommandClass::Create { key } => Some(key),
            _ => None,
        })
        .collect()
}

#[cfg(test)]
mod tests;
