//! The `log` strategy: the controller appends every command to the
//! replica's command log (`lockstep_command_log`) before it sends the socket
//! copies, and workers apply log commands only as they read them from the
//! log.
//!
//! Every worker reads from one start offset that worker 0 chooses when the
//! process starts (the newest epoch marker) and announces on the control
//! mesh, so every worker applies the same sequence; until that announcement
//! arrives, no worker reads. A worker then reads up to `LOG_BATCH` (256) entries
//! at a time, when a socket copy pokes it or at least every [`LOG_POLL`]
//! (backing off, while reads find nothing, to [`IDLE_LOG_POLL`]), and
//! hands them to the session machine, which keeps the worker's position in
//! the log (`WorkerSession::read_log`, through the `LogRead` trait the model
//! implements over its in-memory log too) and queues only the entries that carry `log` and takes every session's
//! marker (a Hello of any strategy): it holds a newer socket-ordered session
//! until its marker was read, so that every worker cuts a log session at the
//! same entry (`lockstep_reconcile::strategy::log`).
//! A corrupt entry halts the worker; other read errors are retried. A worker
//! of a replica started without a command log refuses `log` commands. Log
//! sessions reconcile collectively (`lockstep_reconcile::strategy::barrier`).

use std::time::Duration;

use lockstep_command_log::{AnyLog, CommandLog, LogError};
use lockstep_protocol::{Command, ErrorKind};
use lockstep_reconcile::LogRead;

use crate::metrics::{ReplicaMetrics, METRICS};
use crate::worker::{MeshMessage, WorkerState};

/// How often a worker reads a SQLite command log when nothing woke it and
/// its last read found entries.
pub const LOG_POLL: Duration = Duration::from_millis(2);

/// The longest a worker waits between reads of a SQLite command log when
/// nothing woke it: each read that finds nothing doubles the wait from
/// [`LOG_POLL`] up to this, and a read that finds entries (or a poke)
/// returns it to [`LOG_POLL`]. An idle replica then reads its log 20 times a
/// second rather than 500 (each process spent about 2.5% of a core on it);
/// only an entry whose socket copy never arrives waits up to this long.
pub const IDLE_LOG_POLL: Duration = Duration::from_millis(50);

/// How often a worker reads a PostgreSQL command log when no notification
/// and no socket copy woke it (the bounded poll behind LISTEN/NOTIFY).
pub const NOTIFIED_LOG_POLL: Duration = Duration::from_millis(100);

/// How many log entries a worker reads at once.
const LOG_BATCH: usize = 256;

/// A worker's command log (its position in it is the session machine's:
/// `WorkerSession::log_position`).
pub(crate) struct LogReader {
    log: AnyLog,
    /// A socket copy of a log command arrived, or a newer session waits for
    /// its marker: read the log now.
    pub(crate) poked: bool,
    last_read: std::time::Instant,
    /// The wait before the next unprompted read of a SQLite log: from
    /// [`LOG_POLL`] to [`IDLE_LOG_POLL`].
    poll: Duration,
    /// When the oldest socket copy not yet followed by a log read arrived
    /// (for [`crate::metrics::ReplicaMetrics::log_wait`]).
    copy_arrived: Option<std::time::Instant>,
}

impl LogReader {
    /// How long the worker may park before its next unprompted read.
    pub(crate) fn park(&self) -> Duration {
        match self.log {
            AnyLog::Sqlite(_) => self.poll,
            AnyLog::Postgres(_) => LOG_POLL,
        }
    }
}

impl WorkerState {
    /// Starts tailing the command log `log`. Worker 0 announces the start
    /// offset on the control mesh, which must be built already.
    pub(crate) fn tail_log(&mut self, mut log: AnyLog) {
        self.machine.set_tails_log();
        if self.index == 0 {
            // Every worker starts reading where worker 0 says: the newest
            // epoch marker now. Before it, everything is summarized by the
            // target state that follows it.
            let start = match log.start_offset() {
                Ok(o) => o,
                Err(e) => {
                    self.halt(format!("cannot read the command log: {e}"));
                    1
                }
            };
            if let Some(mesh) = &mut self.mesh {
                mesh.send(0, MeshMessage::LogStart { offset: start });
            }
        }
        self.log = Some(LogReader {
            log,
            poked: false,
            last_read: std::time::Instant::now(),
            poll: LOG_POLL,
            copy_arrived: None,
        });
    }

    /// The socket copy of a log command: read the log now (or refuse it, on
    /// a replica without a command log).
    pub(crate) fn poke_log(&mut self, cmd: &Command) {
        match &mut self.log {
            Some(tail) => {
                tail.poked = true;
                tail.copy_arrived.get_or_insert_with(std::time::Instant::now);
            }
            None => self.error(
                cmd.seqno,
                ErrorKind::InvalidCommand,
                format!(
                    "{} was sent with the log strategy, but this replica was started without a command log (--command-log); not applied",
                    cmd.kind.name()
                ),
            ),
        }
    }

    /// Worker 0 announced the start `offset` on the mesh: start reading.
    pub(crate) fn log_starts_at(&mut self, offset: u64) {
        if let Some(tail) = &mut self.log {
            tracing::info!(worker = self.index, offset, "tailing the command log");
            self.machine.log_starts_at(offset);
            tail.poked = true;
        }
    }

    /// Reads new command-log entries into the queue, if it is time to.
    pub(crate) fn read_log(&mut self) -> bool {
        let Some(tail) = &mut self.log else {
            return false;
        };
        if self.machine.log_position().is_none() {
            return false;
        }
        if !tail.poked {
            match &mut tail.log {
                AnyLog::Sqlite(_) if tail.last_read.elapsed() < tail.poll => return false,
                AnyLog::Sqlite(_) => {}
                // A notification (or a lost connection) says there may be
                // new entries; otherwise read at the bounded poll only.
                notified @ AnyLog::Postgres(_) => {
                    let woken = notified.wait_for_append(Duration::ZERO).unwrap_or(true);
                    if !woken && tail.last_read.elapsed() < NOTIFIED_LOG_POLL {
                        return false;
                    }
                }
            }
        }
        let poked = std::mem::take(&mut tail.poked);
        tail.last_read = std::time::Instant::now();
        // What a read does to the machine is the machine's (the model runs
        // the same, over its in-memory log): `log` entries are queued, and
        // every session's marker, whatever its strategy, releases the socket
        // commands of that session that wait for it (see
        // `lockstep_reconcile::strategy::log`).
        let read = self.machine.read_log(&mut Reader(&mut tail.log), LOG_BATCH);
        ReplicaMetrics::observe(&METRICS.log_read, tail.last_read.elapsed());
        tail.poll = match read {
            Ok(got) if got == 0 && !poked => (tail.poll * 2).min(IDLE_LOG_POLL),
            _ => LOG_POLL,
        };
        match read {
            Ok(got) => {
                if got > 0 {
                    if let Some(arrived) = tail.copy_arrived.take() {
                        ReplicaMetrics::observe(&METRICS.log_wait, arrived.elapsed());
                    }
                }
                if got == LOG_BATCH {
                    tail.poked = true; // more to read
                }
                got > 0
            }
            Err(e @ LogError::Corrupt { .. }) => {
                self.halt(format!("cannot read the command log: {e}"));
                false
            }
            Err(e) => {
                tracing::warn!(worker = self.index, error = %e, "command log read failed; retrying");
                false
            }
        }
    }
}

/// The replica's command log as the session machine reads it.
struct Reader<'a>(&'a mut AnyLog);

impl LogRead<Command> for Reader<'_> {
    type Error = LogError;

    fn read_from(&mut self, offset: u64, max: usize) -> Result<(Vec<Command>, u64), LogError> {
        let entries = self.0.read_from(offset, max)?;
        let after = entries.last().map_or(offset, |e| e.offset + 1);
        Ok((entries.into_iter().map(|e| e.command).collect(), after))
    }
}
