//! The command log's I/O on the controller side (the `log` strategy's rules
//! are `lockstep_reconcile::strategy::log`): the command log is the truth. Each command
//! is appended to the replica's command log before its socket copies are
//! written; the copies only make the workers read the log at once. A log
//! session starts with one append (`LogBatch`: process 0's Hello, which is
//! the session's epoch marker, and the replayed history); once every worker
//! answered that Hello, the log is truncated before the marker
//! (`truncate_log`). Within a session, the StatusRequests (heartbeats)
//! every worker applied are deleted in batches
//! (`forget_applied_status_requests`), so the log grows with the commands
//! that change state, not with time. A failed append stops the controller
//! (`Event::LogFailed`). (The replica's side:
//! `crates/replica/src/order/log.rs`.)

use lockstep_command_log::{AnyLog, CommandLog};
use lockstep_protocol::{Command, CommandKind};

use super::{Actor, Event, Reach};

/// How many applied StatusRequests are deleted from the log at once.
pub(crate) const FORGET_BATCH: usize = 16;

/// The start of a log session, appended to the log in one transaction.
#[derive(Default)]
pub(crate) struct LogBatch {
    /// The Hello of each process, in process order.
    pub(crate) hellos: Vec<Command>,
    /// The commands sent while the session starts.
    pub(crate) commands: Vec<Command>,
    /// The failpoint's crash point, if it was armed for one of them: the
    /// command's position in `commands` and the processes it reaches.
    pub(crate) crash: Option<(usize, Reach)>,
}

impl Actor {
    /// Sends a command appended to the log first
    /// ([`lockstep_reconcile::Delivery::AppendThenCopies`]; `batched`:
    /// into the session start's batch), then a copy to every process. A
    /// crash before any process got its copy is a crash before the append.
    pub(super) fn deliver_log(&mut self, cmd: Command, batched: bool) {
        if let (true, Some(batch)) = (batched, &mut self.log_batch) {
            if let Some(reach) = self.crash_hook.take() {
                batch.crash.get_or_insert((batch.commands.len(), reach));
            }
            batch.commands.push(cmd);
            return;
        }
        // The log is the truth: append first; the socket copies only
        // wake the processes. A crash before any process got its copy
        // is a crash before the append.
        if self
            .crash_hook
            .peek()
            .is_some_and(|r| r.count(self.conns.len()) == 0)
        {
            self.crash_hook.take();
            self.crash();
            return;
        }
        let Some(offset) = self.append_log_at(std::slice::from_ref(&cmd)) else {
            self.crash_hook.take();
            return;
        };
        if matches!(cmd.kind, CommandKind::StatusRequest { .. }) {
            self.log_status_requests.push_back((cmd.seqno, offset));
        }
        self.send_copies(cmd);
    }

    /// Deletes the StatusRequests (heartbeats) every worker of this session
    /// applied (`applied`: the least sequence number they report), once
    /// there are at least [`FORGET_BATCH`] of them: they change no state, and
    /// a long session would otherwise grow the log by four entries a second.
    /// A failure only leaves the entries.
    pub(crate) fn forget_applied_status_requests(&mut self, applied: u64) {
        let ready = self
            .log_status_requests
            .iter()
            .take_while(|(seqno, _)| *seqno <= applied)
            .count();
        if ready < FORGET_BATCH {
            return;
        }
        let (_, through) = self.log_status_requests[ready - 1];
        self.log_status_requests.drain(..ready);
        let Some(log) = self.log.as_mut() else { return };
        match log.forget_status_requests(self.epoch, through) {
            Ok(gone) => tracing::debug!(through, gone, "applied status requests forgotten"),
            Err(e) => tracing::warn!(error = %e, "forgetting status requests failed; entries kept"),
        }
    }

    /// Appends the marker of a session that does not use the log; returns
    /// its offset (`None`: the append failed, see `fail_log`).
    pub(crate) fn append_marker(&mut self, marker: Command) -> Option<u64> {
        self.append_log_at(std::slice::from_ref(&marker))
    }

    /// Appends to the command log; returns the offset of the first appended
    /// entry. A failure (fenced by a newer controller, a broken store) stops
    /// this controller: it must not go on without its log.
    fn append_log_at(&mut self, commands: &[Command]) -> Option<u64> {
        if self.log.is_none() {
            let Some(location) = &self.replica.command_log else {
                unreachable!("the log is written only on a replica with a command log")
            };
            // Opened ahead since the actor started, or now.
            let opened = match self.log_opening.take().map(|rx| rx.recv()) {
                Some(Ok(result)) => result,
                _ => AnyLog::open(location),
            };
            match opened {
                Ok(l) => self.log = Some(l),
                Err(e) => {
                    self.fail_log(e);
                    return None;
                }
            }
        }
        let log = self.log.as_mut().expect("opened above");
        match log.append(self.epoch, commands) {
            Ok(last) => Some(last + 1 - commands.len() as u64),
            Err(e) => {
                self.fail_log(e);
                None
            }
        }
    }

    /// A failed append, reported as [`Event::LogFailed`]. Fenced: the
    /// controller stops (it must not go on without its log, and its owner
    /// halts). Otherwise the log is dropped and the controller reconnects
    /// (with backoff); the next log session reopens it, and the history
    /// still holds every command, so nothing is lost.
    fn fail_log(&mut self, e: lockstep_command_log::LogError) {
        let fenced = matches!(e, lockstep_command_log::LogError::Fenced { .. });
        let message = e.to_string();
        if fenced {
            tracing::error!(%message, "fenced out of the command log; the controller stops");
            self.emit(Event::LogFailed { message, fenced });
            self.stop();
        } else {
            tracing::error!(%message, "command log append failed; reconnecting");
            self.emit(Event::LogFailed {
                message: message.clone(),
                fenced,
            });
            self.log = None;
            self.log_batch = None;
            self.disconnect(format!("command log: {message}"));
        }
    }

    /// Appends the start of a log session in one transaction, then sends
    /// the socket copies; honours the failpoint's crash point.
    pub(crate) fn flush_log_batch(&mut self) {
        let Some(batch) = self.log_batch.take() else {
            return;
        };
        let n = self.conns.len();
        let appended = match batch.crash {
            Some((i, r)) if r.count(n) == 0 => i,
            Some((i, _)) => i + 1,
            None => batch.commands.len(),
        };
        let mut entries = vec![batch.hellos[0].clone()];
        entries.extend(batch.commands[..appended].iter().cloned());
        match self.append_log_at(&entries) {
            Some(marker) => self.log_marker = Some(marker),
            None => return,
        }
        for (i, hello) in batch.hellos.into_iter().enumerate() {
            self.write(i, hello);
        }
        for (k, cmd) in batch.commands.into_iter().enumerate() {
            if k == appended {
                self.crash();
                return;
            }
            if let Some(reach) = batch.crash.filter(|(at, _)| *at == k).map(|(_, r)| r) {
                self.write_reached(&cmd, reach);
                self.crash();
                return;
            }
            for i in 0..n {
                self.write(i, cmd.clone());
            }
        }
    }

    /// Every worker read this log session's marker (it answered the Hello
    /// there), and a fresh replica starts at the newest marker: what came
    /// before it is needed by no one. A failure only leaves the entries.
    pub(crate) fn truncate_log(&mut self) {
        let (Some(marker), Some(log)) = (self.log_marker.take(), self.log.as_mut()) else {
            return;
        };
        match log.truncate_before(self.epoch, marker) {
            Ok(gone) => tracing::debug!(marker, gone, "command log truncated"),
            Err(e) => tracing::warn!(error = %e, "command log truncation failed; entries kept"),
        }
    }
}
