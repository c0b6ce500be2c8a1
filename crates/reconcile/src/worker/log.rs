//! The `log` strategy's part of the worker session, and the command log's
//! cut between sessions.
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
//!   still come (a worker without a log hold), are skipped: applying them
//!   inside the newer session would apply commands the controller never
//!   sent in it (I2).
//!
//! [`BARRIER_TIMEOUT_MS`]: super::BARRIER_TIMEOUT_MS

use super::{Order, SessionCommand, WorkerSession, BARRIER_TIMEOUT_MS};
use crate::Session;

impl<C: SessionCommand> WorkerSession<C> {
    /// Makes this worker hold newer socket-ordered sessions until their log
    /// marker was read: the worker tails a command log.
    pub fn set_tails_log(&mut self) {
        self.tails_log = true;
    }

    /// Whether `cmd`, just taken from the queue, is a command-log entry of a
    /// session older than the one this worker joined (and notes the session
    /// of a log marker).
    pub(super) fn stale_log_entry(&mut self, cmd: &C) -> bool {
        if cmd.order() != Order::Log {
            return false;
        }
        match cmd.hello_session() {
            Some(session) => {
                self.log_marker = session;
                false
            }
            None => self.log_marker < self.session,
        }
    }

    /// The worker read the marker of `session` from its command log (a
    /// Hello entry, of any strategy): held commands up to the next newer
    /// session join the queue.
    pub fn on_log_marker(&mut self, session: Session) {
        self.log_fence = self.log_fence.max(session);
        let mut released = false;
        while let Some(front) = self.held.front() {
            if front.hello_session().is_some_and(|s| s > self.log_fence) {
                break;
            }
            let cmd = self.held.pop_front().expect("a front");
            self.queue.push_back(cmd);
            released = true;
        }
        if released {
            // What is still held (a newer session) waits afresh.
            self.held_since_ms = None;
        }
    }

    /// Whether commands wait for a log marker (the shell should read the
    /// log now).
    pub fn holding(&self) -> bool {
        !self.held.is_empty()
    }

    /// Whether a command that arrives now waits for a log marker: on a
    /// worker that tails a log, a socket-ordered Hello of a session newer
    /// than every marker read, and what follows it.
    pub(super) fn holds(&self, cmd: &C) -> bool {
        if !self.tails_log || cmd.order() == Order::Log {
            return false;
        }
        !self.held.is_empty()
            || cmd
                .hello_session()
                .is_some_and(|s| s > self.log_fence && s > self.session)
    }

    /// Halts a worker that held a session's commands too long.
    pub(super) fn check_held(&mut self, now_ms: u64) {
        if self.held.is_empty() {
            return;
        }
        let since = *self.held_since_ms.get_or_insert(now_ms);
        if now_ms.saturating_sub(since) > BARRIER_TIMEOUT_MS {
            let session = self
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
