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
//! [`SqliteLog`] is the embedded backend: one SQLite file in WAL mode shared
//! by the processes of one machine (`synchronous=NORMAL`: an append survives
//! a process crash, not a power cut). A PostgreSQL backend can implement the
//! same trait; it is not built.

use std::path::{Path, PathBuf};
use std::time::Duration;

use lockstep_protocol::{Command, CommandKind, WireMessage};
use rusqlite::{params, Connection, OptionalExtension, TransactionBehavior};

/// Why a log operation failed.
#[derive(Debug, thiserror::Error)]
pub enum LogError {
    /// A newer epoch already appended: this writer is fenced out.
    #[error("command log {path}: epoch {epoch} is fenced out by epoch {newest}")]
    Fenced {
        /// The log.
        path: PathBuf,
        /// The writer's epoch.
        epoch: u64,
        /// The newest epoch that appended.
        newest: u64,
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

/// The embedded SQLite backend.
pub struct SqliteLog {
    path: PathBuf,
    conn: Connection,
}

impl std::fmt::Debug for SqliteLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteLog")
            .field("path", &self.path)
            .finish()
    }
}

impl SqliteLog {
    /// Opens (creating if missing) the log at `path`. A file that is not a
    /// command log, or of a newer format, is refused and left untouched.
    pub fn open(path: &Path) -> Result<Self, LogError> {
        let store = |source| LogError::Store {
            path: path.to_path_buf(),
            source,
        };
        let format_err = |message: String| LogError::Format {
            path: path.to_path_buf(),
            message,
        };
        let conn = Connection::open(path).map_err(store)?;
        conn.busy_timeout(Duration::from_secs(10)).map_err(store)?;
        // Refuse a foreign file before changing anything in it.
        let tables: Vec<String> = conn
            .prepare("SELECT name FROM sqlite_master WHERE type = 'table'")
            .and_then(|mut s| {
                s.query_map([], |r| r.get(0))?
                    .collect::<Result<Vec<String>, _>>()
            })
            .map_err(|e| format_err(e.to_string()))?;
        let ours = ["meta", "fence", "entries"];
        if let Some(t) = tables.iter().find(|t| !ours.contains(&t.as_str())) {
            return Err(format_err(format!("unexpected table {t:?}")));
        }
        conn.pragma_update(None, "journal_mode", "WAL")
            .map_err(store)?;
        conn.pragma_update(None, "synchronous", "NORMAL")
            .map_err(store)?;
        conn.execute_batch(
            "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
             CREATE TABLE IF NOT EXISTS fence (id INTEGER PRIMARY KEY CHECK (id = 0), epoch INTEGER NOT NULL);
             CREATE TABLE IF NOT EXISTS entries (
                 offset INTEGER PRIMARY KEY,
                 epoch INTEGER NOT NULL,
                 marker INTEGER NOT NULL,
                 command BLOB NOT NULL);
             CREATE INDEX IF NOT EXISTS entries_marker ON entries (marker, offset);
             INSERT OR IGNORE INTO meta (key, value) VALUES ('format', 1);",
        )
        .map_err(store)?;
        let format: i64 = conn
            .query_row("SELECT value FROM meta WHERE key = 'format'", [], |r| {
                r.get(0)
            })
            .map_err(store)?;
        if format != FORMAT {
            return Err(format_err(format!("format {format}")));
        }
        Ok(SqliteLog {
            path: path.to_path_buf(),
            conn,
        })
    }

    /// Opens an existing log for reading and tailing only: changes nothing
    /// in the file (no schema creation), so that many readers can open it at
    /// once without taking the write lock. Refuses a file that is not a
    /// command log of this format.
    pub fn open_reader(path: &Path) -> Result<Self, LogError> {
        let store = |source| LogError::Store {
            path: path.to_path_buf(),
            source,
        };
        let conn = Connection::open_with_flags(
            path,
            rusqlite::OpenFlags::SQLITE_OPEN_READ_WRITE | rusqlite::OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )
        .map_err(store)?;
        conn.busy_timeout(Duration::from_secs(10)).map_err(store)?;
        let format: Option<i64> = conn
            .query_row("SELECT value FROM meta WHERE key = 'format'", [], |r| {
                r.get(0)
            })
            .optional()
            .map_err(|e| LogError::Format {
                path: path.to_path_buf(),
                message: e.to_string(),
            })?;
        if format != Some(FORMAT) {
            return Err(LogError::Format {
                path: path.to_path_buf(),
                message: format!("format {format:?}"),
            });
        }
        Ok(SqliteLog {
            path: path.to_path_buf(),
            conn,
        })
    }

    fn store(&self, source: rusqlite::Error) -> LogError {
        LogError::Store {
            path: self.path.clone(),
            source,
        }
    }
}

/// Starts a write transaction for a writer at `epoch`, or fails with
/// [`LogError::Fenced`] if a newer epoch wrote before.
fn fenced<'c>(
    conn: &'c mut Connection,
    path: &Path,
    epoch: u64,
) -> Result<rusqlite::Transaction<'c>, LogError> {
    let store = |source| LogError::Store {
        path: path.to_path_buf(),
        source,
    };
    let tx = conn
        .transaction_with_behavior(TransactionBehavior::Immediate)
        .map_err(store)?;
    let newest: Option<i64> = tx
        .query_row("SELECT epoch FROM fence WHERE id = 0", [], |r| r.get(0))
        .optional()
        .map_err(store)?;
    let newest = newest.unwrap_or(0) as u64;
    if epoch < newest {
        return Err(LogError::Fenced {
            path: path.to_path_buf(),
            epoch,
            newest,
        });
    }
    Ok(tx)
}

impl CommandLog for SqliteLog {
    fn append(&mut self, epoch: u64, commands: &[Command]) -> Result<u64, LogError> {
        let path = self.path.clone();
        let store = |source| LogError::Store {
            path: path.clone(),
            source,
        };
        let tx = fenced(&mut self.conn, &self.path, epoch)?;
        tx.execute(
            "INSERT INTO fence (id, epoch) VALUES (0, ?1) ON CONFLICT (id) DO UPDATE SET epoch = ?1",
            params![epoch as i64],
        )
        .map_err(store)?;
        // The marker at the truncation point always stays, so MAX(offset)
        // never goes back; `truncated` covers a log emptied by hand.
        let mut last: i64 = tx
            .query_row(
                "SELECT MAX(COALESCE((SELECT MAX(offset) FROM entries), 0), \
                 COALESCE((SELECT value FROM meta WHERE key = 'truncated'), 0))",
                [],
                |r| r.get(0),
            )
            .map_err(store)?;
        {
            let mut insert = tx
                .prepare_cached(
                    "INSERT INTO entries (offset, epoch, marker, command) VALUES (?1, ?2, ?3, ?4)",
                )
                .map_err(store)?;
            for c in commands {
                last += 1;
                insert
                    .execute(params![
                        last,
                        epoch as i64,
                        marker_of(&c.kind),
                        c.clone().encode_to_vec()
                    ])
                    .map_err(store)?;
            }
        }
        tx.commit().map_err(store)?;
        Ok(last as u64)
    }

    fn read_from(&mut self, offset: u64, max: usize) -> Result<Vec<Entry>, LogError> {
        let rows: Vec<(i64, Vec<u8>)> = self
            .conn
            .prepare_cached(
                "SELECT offset, command FROM entries WHERE offset >= ?1 ORDER BY offset LIMIT ?2",
            )
            .and_then(|mut s| {
                s.query_map(params![offset as i64, max as i64], |r| {
                    Ok((r.get(0)?, r.get(1)?))
                })?
                .collect()
            })
            .map_err(|e| self.store(e))?;
        rows.into_iter()
            .map(|(offset, bytes)| {
                let offset = offset as u64;
                Command::decode_from(&bytes)
                    .map(|command| Entry { offset, command })
                    .map_err(|e| LogError::Corrupt {
                        path: self.path.clone(),
                        offset,
                        message: e.to_string(),
                    })
            })
            .collect()
    }

    fn truncate_before(&mut self, epoch: u64, offset: u64) -> Result<usize, LogError> {
        let path = self.path.clone();
        let store = |source| LogError::Store {
            path: path.clone(),
            source,
        };
        let tx = fenced(&mut self.conn, &self.path, epoch)?;
        let gone = tx
            .execute(
                "DELETE FROM entries WHERE offset < ?1",
                params![offset as i64],
            )
            .map_err(store)?;
        tx.execute(
            "INSERT INTO meta (key, value) VALUES ('truncated', ?1) \
             ON CONFLICT (key) DO UPDATE SET value = MAX(value, ?1)",
            params![offset as i64 - 1],
        )
        .map_err(store)?;
        tx.commit().map_err(store)?;
        Ok(gone)
    }

    fn forget_status_requests(&mut self, epoch: u64, offset: u64) -> Result<usize, LogError> {
        let path = self.path.clone();
        let tx = fenced(&mut self.conn, &self.path, epoch)?;
        let gone = tx
            .execute(
                "DELETE FROM entries WHERE marker = 2 AND offset <= ?1",
                params![offset as i64],
            )
            // The numbering must not go back if the newest entry went.
            .and_then(|gone| {
                tx.execute(
                    "INSERT INTO meta (key, value) VALUES ('truncated', ?1) \
                     ON CONFLICT (key) DO UPDATE SET value = MAX(value, ?1)",
                    params![offset as i64],
                )?;
                tx.commit().map(|()| gone)
            })
            .map_err(|source| LogError::Store { path, source })?;
        Ok(gone)
    }

    fn start_offset(&mut self) -> Result<u64, LogError> {
        let newest: Option<i64> = self
            .conn
            .query_row(
                "SELECT MAX(offset) FROM entries WHERE marker = 1",
                [],
                |r| r.get(0),
            )
            .map_err(|e| self.store(e))?;
        Ok(newest.map_or(1, |o| o as u64))
    }
}

#[cfg(test)]
mod tests;
