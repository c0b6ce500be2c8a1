//! The `log` strategy: the controller's appends (the rule; the store is the
//! controller's shell), the worker's reading of the command log, and the
//! log's cut between sessions.
//!
//! Command-log entries belong to the session of the epoch marker (a Hello)
//! before them. A worker applies a cut-off log session's entries only up to
//! the marker of the session after it, and every worker up to the same one:
//!
//! - The controller appends a marker for every session to the log of a
//!   replica that has one, before it sends the session's Hellos, whatever
//!   the session's strategy.
//! - A worker that tails the log holds the socket-ordered commands of a
//!   newer session (a Hello and what follows it) until it has read that
//!   session's marker from the log ([`WorkerSession::on_log_marker`]); the
//!   log entries before the marker join the queue first. So the entries of
//!   a cut-off log session that every worker applies are exactly those
//!   before the next marker. (Without the hold, a worker that received the
//!   next Hello before it read a create of the cut-off session skipped the
//!   create while its peers had built it: their timely dataflow counters
//!   parted, and the replica hung.) No marker within [`BARRIER_TIMEOUT_MS`]
//!   halts the worker.
//! - Entries of a session older than the one the worker joined, should they
//!   still come (a worker without a log hold), are skipped, and so are
//!   socket-ordered (`barrier`, `naive`) commands of an older session: a
//!   newer `log` session starts when its Hello is read from the log, and
//!   that may come before the last socket copies of the session it cuts
//!   off reach the worker (the controller appends the Hello before it
//!   connects anew, and the old connection's last frames are still
//!   forwarded until the new one is accepted). The rule is every source's
//!   (`SourceMarkers` in [`crate::strategy`]); skipping them is what a
//!   worker that joined the log session later does anyway: its `barrier`
//!   rounds of the old session are abandoned once a peer joined the new
//!   one, and the new session's reconciliation repairs a drop that only
//!   some workers applied.
//!
//! What a read of the log does to the machine is here too,
//! [`WorkerSession::on_log_entries`]: the entries sent with `log` join the
//! queue, and every session's marker, whatever its strategy, is passed to
//! [`WorkerSession::on_log_marker`]. The replica's shell
//! (`crates/replica/src/order/log.rs`) reads the entries from its command
//! log and hands them over; the model checker (`crates/model`, variant
//! `log-then-barrier`) hands over the entries of its in-memory log, so both
//! run the same reading code. Where the worker reads from, when, and how
//! many entries at a time are the shell's.
//!
//! [`BARRIER_TIMEOUT_MS`]: crate::worker::BARRIER_TIMEOUT_MS

use std::collections::VecDeque;

use super::{source_of, Source, StrategyRules};
use crate::worker::{SessionCommand, WorkerSession, BARRIER_TIMEOUT_MS};
use crate::Session;

/// A deliberate flaw planted in the log-marker hold, so that the model
/// checker can show it catches it (feature `mutants`; the replica never
/// sets one).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum LogHoldMutant {
    /// The hold as it is meant to be.
    #[default]
    None,
    /// Nothing is held: a newer socket-ordered session starts as soon as
    /// its Hello arrives, whatever the worker has read from its log.
    NoHold,
}

/// The `log` strategy: the controller appends each command to the
/// replica's command log before its socket copies, and a session started
/// with it sends every command with it; on the worker, commands come from
/// the command log; a session reconciles collectively.
#[derive(Clone, Copy, Debug)]
pub struct Log;

impl StrategyRules for Log {
    fn source(&self) -> Source {
        Source::Log
    }
    fn appends_to_log(&self) -> bool {
        true
    }
}

/// The command log as one worker tails it: `log`'s part of a
/// [`WorkerSession`]'s state.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct LogCursor<C> {
    /// Whether the worker tails a command log.
    pub(crate) tails: bool,
    /// The newest session whose marker the worker read from the log.
    pub(crate) fence: Session,
    /// The offset of the next log entry to read, once worker 0 announced
    /// where to start.
    pub(crate) next: Option<u64>,
    /// Commands of a newer socket-ordered session, held until the log was
    /// read up to that session's marker, and since when (ms).
    pub(crate) held: VecDeque<C>,
    pub(crate) held_since_ms: Option<u64>,
    /// A flaw planted in the hold (model checking only).
    pub(crate) hold_mutant: LogHoldMutant,
}

impl<C> Default for LogCursor<C> {
    fn default() -> Self {
        LogCursor {
            tails: false,
            fence: 0,
            next: None,
            held: VecDeque::new(),
            held_since_ms: None,
            hold_mutant: LogHoldMutant::None,
        }
    }
}

/// A command log as a worker reads it: the replica's
/// (`lockstep_command_log`), or the model's in-memory stream. The machine
/// keeps the worker's position in it ([`WorkerSession::log_starts_at`],
/// [`WorkerSession::read_log`]), so both read the same way.
pub trait LogRead<C> {
    /// Why a read failed.
    type Error;
    /// The entries from `offset` on, at most `max`, in log order, and the
    /// offset after the last one read (`offset` itself if none).
    fn read_from(&mut self, offset: u64, max: usize) -> Result<(Vec<C>, u64), Self::Error>;
}

impl LogHoldMutant {
    /// The planted flaw's variant name in the model's report.
    pub const NAME: &'static str = "mutant-no-log-hold";
}

impl<C: SessionCommand> WorkerSession<C> {
    /// Makes this worker hold newer socket-ordered sessions until their log
    /// marker was read: the worker tails a command log.
    pub fn set_tails_log(&mut self) {
        self.log.tails = true;
    }

    /// The same machine with a flaw planted in its log-marker hold (model
    /// checking only).
    #[cfg(feature = "mutants")]
    pub fn with_log_hold_mutant(mut self, mutant: LogHoldMutant) -> Self {
        self.log.hold_mutant = mutant;
        self
    }

    /// Worker 0 announced where every worker starts reading the log (the
    /// newest epoch marker when the process started); until then
    /// [`WorkerSession::read_log`] reads nothing.
    pub fn log_starts_at(&mut self, offset: u64) {
        self.log.next = Some(offset);
    }

    /// The offset of the next log entry this worker reads, once it knows
    /// where to start.
    pub fn log_position(&self) -> Option<u64> {
        self.log.next
    }

    /// Reads up to `max` entries from `log` at this worker's position and
    /// takes them ([`WorkerSession::on_log_entries`]); returns how many
    /// commands it read (none before [`WorkerSession::log_starts_at`]).
    /// A failed read changes nothing.
    pub fn read_log<L: LogRead<C>>(&mut self, log: &mut L, max: usize) -> Result<usize, L::Error> {
        let Some(next) = self.log.next else {
            return Ok(0);
        };
        let (entries, after) = log.read_from(next, max)?;
        self.log.next = Some(after);
        Ok(self.on_log_entries(entries))
    }

    /// Entries the worker read from its command log, in log order: those
    /// sent with `log` join the queue, and the marker of every session (a
    /// Hello, of any strategy) releases what waits for it
    /// ([`WorkerSession::on_log_marker`]). Returns how many entries there
    /// were.
    pub fn on_log_entries(&mut self, entries: impl IntoIterator<Item = C>) -> usize {
        let mut read = 0;
        for cmd in entries {
            read += 1;
            let marker = cmd.hello_session();
            if source_of(&cmd) == Source::Log {
                self.push(cmd);
            }
            // Every session's marker, whatever its strategy: a newer
            // session's socket commands wait for it.
            if let Some(session) = marker {
                self.on_log_marker(session);
            }
        }
        read
    }

    /// The worker read the marker of `session` from its command log (a
    /// Hello entry, of any strategy): held commands up to the next newer
    /// session join the queue.
    pub fn on_log_marker(&mut self, session: Session) {
        self.log.fence = self.log.fence.max(session);
        let mut released = false;
        while let Some(front) = self.log.held.front() {
            if front.hello_session().is_some_and(|s| s > self.log.fence) {
                break;
            }
            let cmd = self.log.held.pop_front().expect("a front");
            self.queue.push_back(cmd);
            released = true;
        }
        if released {
            // What is still held (a newer session) waits afresh.
            self.log.held_since_ms = None;
        }
    }

    /// Whether commands wait for a log marker (the shell should read the
    /// log now).
    pub fn holding(&self) -> bool {
        !self.log.held.is_empty()
    }

    /// Whether a command that arrives now waits for a log marker: on a
    /// worker that tails a log, a socket-ordered Hello of a session newer
    /// than every marker read, and what follows it.
    pub(crate) fn holds(&self, cmd: &C) -> bool {
        if !self.log.tails
            || source_of(cmd) == Source::Log
            || self.log.hold_mutant == LogHoldMutant::NoHold
        {
            return false;
        }
        !self.log.held.is_empty()
            || cmd
                .hello_session()
                .is_some_and(|s| s > self.log.fence && s > self.session)
    }

    /// Halts a worker that held a session's commands too long.
    pub(crate) fn check_held(&mut self, now_ms: u64) {
        if self.log.held.is_empty() {
            return;
        }
        let since = *self.log.held_since_ms.get_or_insert(now_ms);
        if now_ms.saturating_sub(since) > BARRIER_TIMEOUT_MS {
            let session = self
                .log
                .held
                .front()
                .and_then(SessionCommand::hello_session)
                .unwrap_or(0);
            self.halt(format!(
                "worker {} waited {BARRIER_TIMEOUT_MS} ms for the marker of session {session:#x} in the command log",
                self.index
            ));
        }
    }
}
