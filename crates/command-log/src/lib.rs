//! The command log of the `log` distribution strategy.
//!
//! The controller appends every command of a `log` session to one durable,
//! totally ordered log per replica; every process of the replica tails it and
//! applies the entries in log order, so every worker applies the same
//! sequence no matter which sockets dropped or which controller crashed.
//!
//! Rules the store keeps, whatever the backend:
//! - **Total order**: entries get consecutive offsets starting at 1; an
//!   append is atomic (all of its commands or none).
//! - **Fencing**: an append carries the controller's epoch; once an epoch
//!   appended, appends of older epochs fail with [`LogError::Fenced`], so a
//!   controller that lost its leadership cannot interleave with its successor.
//! - **Markers**: a `Hello` entry is an epoch marker, followed by the target
//!   state (the compacted history) and `InitializationComplete`. A fresh
//!   replica starts tailing at the newest marker ([`CommandLog::start_offset`]):
//!   what came before it is summarized by the target state after it.
//!
//! Two backends implement [`CommandLog`]:
//! - [`SqliteLog`], the embedded default: one SQLite file in WAL mode shared
//!   by the processes of one machine (`synchronous=NORMAL`: an append
//!   survives a process crash, not a power cut);
//! - [`PgLog`], a PostgreSQL database that may hold the logs of many
//!   replicas (keyed by log name), for replica processes on several
//!   machines. Appends `NOTIFY` a channel per log, so readers tail it with
//!   [`PgLog::wait_for_append`] instead of polling (with a bounded poll as
//!   the fallback: NOTIFY has no replay, the table is the truth).
//!
//! [`AnyLog`] is either, opened from a [`LogLocation`]. See
//! `docs/stores.md`.

use std::path::PathBuf;
use std::time::Duration;

use lockstep_protocol::{Command, CommandKind};

mod postgres;
mod sqlite;

pub use postgres::{PgLog, MAX_LOG_NAME_LEN};
pub use sqlite::{SqliteLog, SQLITE_WAIT_POLL};

/// Why a log operation failed.
#[derive(Debug, thiserror::Error)]
pub enum LogError {
    /// A newer epoch already appended: this writer is fenced out.
    #[error("command log {path}: epoch {epoch} is fenced out by epoch {newest}")]
    Fenced {
        /// The log (a file, or `<redacted connection string>#<log name>`).
        path: PathBuf,
        /// The writer's epoch.
        epoch: u64,
        /// The newest epoch that appended.
        newest: u64,
    },
    /// The PostgreSQL store failed, or the connection broke (an append in
    /// flight then either committed entirely or not at all).
    #[error("command log {path}: {source}")]
    Postgres {
        /// The log (`<redacted connection string>#<log name>`).
        path: PathBuf,
        /// What went wrong.
        #[source]
        source: lockstep_pg::PgError,
    },
    /// The store failed.
    #[error("command log {path}: {source}")]
    Store {
        /// The log.
        path: PathBuf,
        /// The store's error.
        #[source]
        source: rusqlite::Error,
    },
    /// An entry is not a command this build understands.
    #[error("command log {path}: entry {offset} is corrupt: {message}")]
    Corrupt {
        /// The log.
        path: PathBuf,
        /// The entry.
        offset: u64,
        /// What is wrong with it.
        message: String,
    },
    /// The file is not a lockstep command log (or a newer format).
    #[error("command log {path}: not a lockstep command log of format {FORMAT}: {message}")]
    Format {
        /// The log.
        path: PathBuf,
        /// What was found.
        message: String,
    },
}

/// One entry of the log.
#[derive(Debug, Clone, PartialEq)]
pub struct Entry {
    /// Its offset, from 1, consecutive.
    pub offset: u64,
    /// The command.
    pub command: Command,
}

/// A durable, totally ordered, fenced command log.
pub trait CommandLog: Send {
    /// Appends `commands` atomically for a controller at `epoch`; returns the
    /// offset of the last one. Fails with [`LogError::Fenced`] if a newer
    /// epoch appended before.
    fn append(&mut self, epoch: u64, commands: &[Command]) -> Result<u64, LogError>;
    /// Up to `max` entries at or after `offset`, in order.
    fn read_from(&mut self, offset: u64, max: usize) -> Result<Vec<Entry>, LogError>;
    /// Where a fresh replica starts tailing: the newest epoch marker, or 1
    /// if the log has none.
    fn start_offset(&mut self) -> Result<u64, LogError>;
    /// Deletes the entries before `offset`, for a controller at `epoch`
    /// (fenced like [`CommandLog::append`]); returns how many went. The
    /// caller must know that no process still needs them: every worker read
    /// past `offset`, and `offset` is a marker, so a fresh replica starts
    /// there or later. Offsets of the remaining entries do not change.
    fn truncate_before(&mut self, epoch: u64, offset: u64) -> Result<usize, LogError>;
    /// Deletes the StatusRequest entries (heartbeats and status requests,
    /// which change no state) at or before `offset`, for a controller at
    /// `epoch` (fenced like [`CommandLog::append`]); returns how many went.
    /// The caller must know that every worker read past `offset`. Within a
    /// long session this keeps the log proportional to the commands that
    /// change state, not to the time the session ran.
    fn forget_status_requests(&mut self, epoch: u64, offset: u64) -> Result<usize, LogError>;
}

/// The `marker` column: 1 for an epoch marker (Hello), 2 for a
/// StatusRequest (forgettable), 0 for every other command.
fn marker_of(kind: &CommandKind) -> i64 {
    match kind {
        CommandKind::Hello(_) => 1,
        CommandKind::StatusRequest { .. } => 2,
        _ => 0,
    }
}

/// The on-disk format this build reads and writes.
pub const FORMAT: i64 = 1;

/// Where a command log lives.
#[derive(Clone, PartialEq, Eq)]
pub enum LogLocation {
    /// A SQLite file.
    Sqlite(PathBuf),
    /// The log `name` in a PostgreSQL database.
    Postgres {
        /// The connection string (`postgres://…`); without a password in
        /// it, `PGPASSWORD` from the environment is used.
        url: String,
        /// The log's name (one per replica), 1 to [`MAX_LOG_NAME_LEN`] of
        /// `a-z`, `0-9`, `-` and `_`.
        name: String,
    },
}

impl LogLocation {
    /// Removes the log at this location as the controller of `epoch` (a
    /// dropped replica's): a SQLite file with its WAL files, or a
    /// PostgreSQL log's rows (fenced: a newer epoch's log stays). A log
    /// that is not there is not an error.
    pub fn remove(&self, epoch: u64) -> Result<(), LogError> {
        match self {
            LogLocation::Sqlite(path) => {
                for suffix in ["", "-wal", "-shm"] {
                    let mut p = path.clone().into_os_string();
                    p.push(suffix);
                    let _ = std::fs::remove_file(p);
                }
                Ok(())
            }
            LogLocation::Postgres { url, name } => PgLog::open(url, name)?.remove(epoch).map(drop),
        }
    }

    /// The file of a SQLite log.
    pub fn sqlite_path(&self) -> Option<&std::path::Path> {
        match self {
            LogLocation::Sqlite(p) => Some(p),
            LogLocation::Postgres { .. } => None,
        }
    }

    /// The PostgreSQL password in the location's connection string, if any.
    /// The location's `Display` leaves it out; a reader started as another
    /// process gets it in `PGPASSWORD`.
    pub fn password(&self) -> Option<String> {
        match self {
            LogLocation::Sqlite(_) => None,
            LogLocation::Postgres { url, .. } => lockstep_pg::password(url),
        }
    }
}

impl std::str::FromStr for LogLocation {
    type Err = String;

    /// `postgres://…#NAME` (or `postgresql://…#NAME`) is the log `NAME` in
    /// that database; anything else is a SQLite file path.
    fn from_str(s: &str) -> Result<LogLocation, String> {
        if s.starts_with("postgres://") || s.starts_with("postgresql://") {
            let (url, name) = s
                .rsplit_once('#')
                .ok_or("a PostgreSQL command log needs its name after '#': postgres://…#NAME")?;
            postgres::check_name(name)?;
            Ok(LogLocation::Postgres {
                url: url.to_string(),
                name: name.to_string(),
            })
        } else if s.is_empty() {
            Err("an empty command log location".into())
        } else {
            Ok(LogLocation::Sqlite(PathBuf::from(s)))
        }
    }
}

impl std::fmt::Display for LogLocation {
    /// The location as its `FromStr` implementation reads it, without any
    /// password: safe for messages and for a command line (the reader then
    /// takes the password from `PGPASSWORD`).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LogLocation::Sqlite(p) => write!(f, "{}", p.display()),
            LogLocation::Postgres { url, name } => {
                write!(f, "{}#{name}", lockstep_pg::redact(url))
            }
        }
    }
}

impl std::fmt::Debug for LogLocation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{self}")
    }
}

/// A command log of either backend.
#[derive(Debug)]
pub enum AnyLog {
    /// The embedded SQLite backend.
    Sqlite(SqliteLog),
    /// The PostgreSQL backend.
    Postgres(PgLog),
}

impl AnyLog {
    /// Opens (creating if missing) the log at `location`, for a writer.
    pub fn open(location: &LogLocation) -> Result<AnyLog, LogError> {
        Ok(match location {
            LogLocation::Sqlite(path) => AnyLog::Sqlite(SqliteLog::open(path)?),
            LogLocation::Postgres { url, name } => AnyLog::Postgres(PgLog::open(url, name)?),
        })
    }

    /// Opens an existing log for reading and tailing (see
    /// [`SqliteLog::open_reader`] and [`PgLog::open_reader`]).
    pub fn open_reader(location: &LogLocation) -> Result<AnyLog, LogError> {
        Ok(match location {
            LogLocation::Sqlite(path) => AnyLog::Sqlite(SqliteLog::open_reader(path)?),
            LogLocation::Postgres { url, name } => AnyLog::Postgres(PgLog::open_reader(url, name)?),
        })
    }

    /// Waits until the log was appended to since the last
    /// [`CommandLog::read_from`] began, or `timeout` passes; returns whether
    /// it was woken early. PostgreSQL wakes on a notification; SQLite polls
    /// every [`SQLITE_WAIT_POLL`]. Either may wake without a new entry (read
    /// and wait again), and a caller must read after a timeout as well.
    /// With a zero timeout it only checks, without blocking (for a loop
    /// that must not block, like a timely worker's).
    pub fn wait_for_append(&mut self, timeout: Duration) -> Result<bool, LogError> {
        match self {
            AnyLog::Sqlite(l) => l.wait_for_append(timeout),
            AnyLog::Postgres(l) => Ok(l.wait_for_append(timeout)),
        }
    }
}

impl CommandLog for AnyLog {
    fn append(&mut self, epoch: u64, commands: &[Command]) -> Result<u64, LogError> {
        match self {
            AnyLog::Sqlite(l) => l.append(epoch, commands),
            AnyLog::Postgres(l) => l.append(epoch, commands),
        }
    }

    fn read_from(&mut self, offset: u64, max: usize) -> Result<Vec<Entry>, LogError> {
        match self {
            AnyLog::Sqlite(l) => l.read_from(offset, max),
            AnyLog::Postgres(l) => l.read_from(offset, max),
        }
    }

    fn start_offset(&mut self) -> Result<u64, LogError> {
        match self {
            AnyLog::Sqlite(l) => l.start_offset(),
            AnyLog::Postgres(l) => l.start_offset(),
        }
    }

    fn truncate_before(&mut self, epoch: u64, offset: u64) -> Result<usize, LogError> {
        match self {
            AnyLog::Sqlite(l) => l.truncate_before(epoch, offset),
            AnyLog::Postgres(l) => l.truncate_before(epoch, offset),
        }
    }

    fn forget_status_requests(&mut self, epoch: u64, offset: u64) -> Result<usize, LogError> {
        match self {
            AnyLog::Sqlite(l) => l.forget_status_requests(epoch, offset),
            AnyLog::Postgres(l) => l.forget_status_requests(epoch, offset),
        }
    }
}

#[cfg(test)]
mod tests;
