//! The distribution strategies, one module each, holding both sides.
//!
//! A strategy decides which copy of a command a worker applies. Each one is
//! a type in the file named after it, implementing [`StrategyRules`]:
//!
//! - the **controller's side**: whether a command is appended to the
//!   command log before its socket copies ([`StrategyRules::appends_to_log`]),
//!   whether a session started with it sends every command with it
//!   ([`StrategyRules::pins_session`]), whether a write is split so each
//!   process gets only the rows its workers own
//!   ([`StrategyRules::splits_writes`]). [`crate::ControllerSession`] turns
//!   these into what the controller's shell does ([`crate::Delivery`],
//!   [`crate::SessionStart`]);
//! - the **worker's side**: where a worker takes the commands from
//!   ([`Source`]), whether a create waits at a barrier round, whether a
//!   session reconciles collectively, and the strategy's part of
//!   [`crate::WorkerSession`] (per-worker reconciliation in [`naive`], the
//!   barrier rounds in [`barrier`], the log's reading, hold and cut in
//!   [`log`], with its state in one [`log::LogCursor`]).
//!
//! [`rules`] is the one place a strategy is registered. A new strategy is
//! one module here plus its line in [`rules`] (and its wire name in
//! `lockstep-protocol`); the replica's shell takes commands from each
//! [`Source`] (`crates/replica/src/order/`), and the model routes its
//! messages by the same rules.

pub mod barrier;
pub mod broadcast;
pub mod log;
pub mod naive;

use lockstep_protocol::Strategy;

use crate::worker::SessionCommand;
use crate::Session;

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

/// The session of the last Hello a worker took from each [`Source`]: a
/// command belongs to the session of the Hello before it in its source's
/// order (each session's commands come from its strategy's one source).
///
/// A command whose source's session is older than the one the worker
/// joined is skipped, whatever the source: once sessions of different
/// strategies follow each other, a worker can join the newer session from
/// one source before the older session's last commands reach it from
/// another, and taken into the newer session they would apply commands
/// the controller never sent in it, on some workers only. The model
/// checker found it for every pair: a `log` session's entries read after a
/// newer `barrier` Hello, a `barrier` session's last socket copies after a
/// newer `log` Hello (`log-then-barrier`, I1), and a `broadcast` session's
/// target still on the sequencer's stream after a newer `barrier` session
/// began on the socket, which a worker then built on its own
/// (`barrier-then-broadcast`, I1).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub(crate) struct SourceMarkers {
    socket: Session,
    sequencer: Session,
    log: Session,
}

impl SourceMarkers {
    /// Every source in `session` (a worker resumed in it).
    pub(crate) fn all(session: Session) -> Self {
        SourceMarkers {
            socket: session,
            sequencer: session,
            log: session,
        }
    }

    /// Whether `cmd`, just taken from the queue, belongs to a session
    /// older than `joined` (and notes the session of a Hello).
    pub(crate) fn stale<C: SessionCommand>(&mut self, cmd: &C, joined: Session) -> bool {
        let marker = match source_of(cmd) {
            Source::Socket => &mut self.socket,
            Source::Sequencer => &mut self.sequencer,
            Source::Log => &mut self.log,
        };
        match cmd.hello_session() {
            Some(session) => {
                *marker = session;
                false
            }
            None => *marker < joined,
        }
    }
}

/// One strategy's rules, on both sides of the wire (see the module docs).
pub trait StrategyRules: Sync {
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
    /// Whether the controller appends a command sent with it to the
    /// replica's command log before its socket copies (a choice of it for a
    /// replica without a log gets the fallback, and a session started with
    /// it appends its start in one batch).
    fn appends_to_log(&self) -> bool {
        false
    }
    /// Whether a session whose Hello was sent with it sends every command
    /// with it: its workers apply only that order. A socket-ordered session
    /// lets the policy choose among the socket-ordered strategies.
    fn pins_session(&self) -> bool {
        self.source() != Source::Socket
    }
    /// Whether a write is split so that each process gets only the rows
    /// its workers own: each process applies its own copy. Not where one
    /// copy serves every worker (the sequencer's, the log's).
    fn splits_writes(&self) -> bool {
        self.source() == Source::Socket
    }
}

/// The rules of `strategy`: the one place each strategy's type is chosen.
pub fn rules(strategy: Strategy) -> &'static dyn StrategyRules {
    match strategy {
        Strategy::Naive => &naive::Naive,
        Strategy::Barrier => &barrier::Barrier,
        Strategy::Broadcast => &broadcast::Broadcast,
        Strategy::Log => &log::Log,
    }
}

/// Where a worker takes `cmd` from: the source of its strategy.
pub(crate) fn source_of<C: SessionCommand>(cmd: &C) -> Source {
    rules(cmd.strategy()).source()
}

/// Whether commands sent with `strategy` are applied in socket order
/// (each worker applies its own process's copy).
pub fn socket_ordered(strategy: Strategy) -> bool {
    rules(strategy).source() == Source::Socket
}
