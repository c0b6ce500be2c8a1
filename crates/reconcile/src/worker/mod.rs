//! One worker's session and command ordering as a sans-IO state machine.
//!
//! [`WorkerSession`] decides, for one timely worker, what happens to each
//! command in the order the worker's strategy delivers it: a Hello starts a
//! session, the session start is buffered until InitializationComplete and
//! then reconciled (alone or collectively), a CreateDataflow of a new dataflow
//! waits at a barrier round, commands of an older session are skipped (see
//! [`log`]), and a worker that cannot prove it is in lockstep halts. It owns
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
//! Each strategy's part of the machine is one type in the file named after
//! it, implementing [`WorkerStrategy`] (where its commands come from, what
//! gates them, how it reconciles), chosen by [`rules`]: [`naive`]
//! (per-worker reconciliation), [`barrier`] (create rounds, and the
//! collective reconciliation every other strategy uses), [`broadcast`] (the
//! sequencer), [`log`] (what a read of the command log does, the hold of a
//! newer session until its log marker was read, and the skip of entries of
//! older log sessions). Taking the commands from their [`Source`] (the
//! socket, the sequencer on the mesh, the command log) is the shell's part.

pub mod barrier;
pub mod broadcast;
pub mod log;
pub mod naive;

use std::collections::VecDeque;

use lockstep_protocol::{Command, CommandKind, Strategy};

use crate::{
    session_of, Announcement, BarrierDecision, DataflowKey, Digest, Report, RoundBook, Session,
};

pub use barrier::BARRIER_TIMEOUT_MS;

/// Where a worker takes a strategy's commands from.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub enum Source {
    /// The worker's own process's controller connection, in socket order
    /// (the *socket-ordered* strategies).
    Socket,
    /// Worker 0's socket copy, forwarded on the control mesh, in the order
    /// the mesh delivers it; other socket copies are not applied.
    Sequencer,
    /// The command log, read from the offset worker 0 announced; the socket
    /// copy only makes the worker read the log now.
    Log,
}

/// One strategy's part of the worker session: where its commands come from
/// and what gates them. One type per strategy, in the file named after it
/// ([`naive::Naive`], [`barrier::Barrier`], [`broadcast::Broadcast`],
/// [`log::Log`]); [`rules`] is the one place a strategy is registered. The
/// replica's shell takes commands from each [`Source`]
/// (`crates/replica/src/order/`), the controller's side of each strategy
/// is in `crates/controller/src/deliver/`, and the model routes its
/// messages by the same rules.
pub trait WorkerStrategy: Sync {
    /// Where a worker takes the commands sent with it from.
    fn source(&self) -> Source;
    /// Whether a CreateDataflow of a new, valid dataflow waits at a barrier
    /// round before it builds.
    fn creates_in_rounds(&self) -> bool {
        false
    }
    /// Whether an InitializationComplete sent with it starts a collective
    /// reconciliation (on a worker with a control mesh); otherwise the
    /// worker reconciles alone.
    fn reconciles_collectively(&self) -> bool {
        true
    }
}

/// The worker-side rules of `strategy`: the one place each strategy's type
/// is chosen.
pub fn rules(strategy: Strategy) -> &'static dyn WorkerStrategy {
    match strategy {
        Strategy::Naive => &naive::Naive,
        Strategy::Barrier => &barrier::Barrier,
        Strategy::Broadcast => &broadcast::Broadcast,
        Strategy::Log => &log::Log,
    }
}

/// Where a worker takes `cmd` from: the source of its strategy.
fn source_of<C: SessionCommand>(cmd: &C) -> Source {
    rules(cmd.strategy()).source()
}

/// Whether commands sent with `strategy` are applied in socket order
/// (each worker applies its own process's copy).
pub fn socket_ordered(strategy: Strategy) -> bool {
    rules(strategy).source() == Source::Socket
}

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
    fn mine(&self) -> (Announcement, u64) {
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
    index: usize,
    has_mesh: bool,
    session: Session,
    /// The session of the last command-log marker taken from the queue.
    log_marker: Session,
    /// The session of the last socket-ordered Hello taken from the queue.
    socket_marker: Session,
    /// Commands of a session start, until InitializationComplete.
    reconciling: Option<Vec<C>>,
    queue: VecDeque<C>,
    pending: Option<Pending<C>>,
    rounds: RoundBook,
    out: VecDeque<Action<C>>,
    halted: bool,
    /// Whether the worker tails a command log (see [`log`]).
    tails_log: bool,
    /// The newest session whose marker the worker read from the log.
    log_fence: Session,
    /// The offset of the next log entry to read, once worker 0 announced
    /// where to start.
    log_next: Option<u64>,
    /// Commands of a newer socket-ordered session, held until the log was
    /// read up to that session's marker, and since when (ms).
    held: VecDeque<C>,
    held_since_ms: Option<u64>,
    /// A flaw planted in the hold (model checking only).
    hold_mutant: log::LogHoldMutant,
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
            log_marker: 0,
            socket_marker: 0,
            reconciling: None,
            queue: VecDeque::new(),
            pending: None,
            rounds: RoundBook::new(peers),
            out: VecDeque::new(),
            halted: false,
            tails_log: false,
            log_fence: 0,
            log_next: None,
            held: VecDeque::new(),
            held_since_ms: None,
            hold_mutant: log::LogHoldMutant::None,
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
        self.log_marker = session;
        self.socket_marker = session;
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
        self.queue.len() + self.held.len()
    }

    /// A command in this worker's order (its socket copy for `naive` and
    /// `barrier`, the sequencer's copy for `broadcast`, a log entry for
    /// `log`): queued until [`WorkerSession::next`] hands it out.
    pub fn push(&mut self, cmd: C) {
        if self.holds(&cmd) {
            self.held.push_back(cmd);
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
            if self.stale_log_entry(&cmd) || self.stale_socket_command(&cmd) {
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
    fn finish_reconcile(&mut self, drops: Vec<u64>, buffer: Vec<C>, how: Reconciliation) {
        for id in drops {
            self.out.push_back(Action::Drop { id, how });
        }
        self.out.push_back(Action::ResetHistory);
        self.out.extend(buffer.into_iter().map(Action::Apply));
    }

    /// Stops: nothing is handed out after the halt.
    fn halt(&mut self, reason: String) {
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
