//! The embedded SQLite backend: one file in WAL mode shared by the
//! processes of one machine.

use std::path::{Path, PathBuf};
use std::time::Duration;

use lockstep_protocol::{Command, WireMessage};
use rusqlite::{params, Connection, OptionalExtension, TransactionBehavior};

use crate::{marker_of, CommandLog, Entry, LogError, FORMAT};

/// How often [`SqliteLog::wait_for_append`] looks for a commit.
pub const SQLITE_WAIT_POLL: Duration = Duration::from_millis(2);

/// The embedded SQLite backend.
pub struct SqliteLog {
    path: PathBuf,
    conn: Connection,
    /// `PRAGMA data_version` before the last read: it changes when another
    /// connection commits.
    seen_version: Option<i64>,
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
            seen_version: None,
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
            seen_version: None,
        })
    }

    /// Waits until another connection commits to the log (an append, most
    /// likely) or `timeout` passes; returns whether it did. SQLite has no
    /// notifications: this polls `PRAGMA data_version` every
    /// [`SQLITE_WAIT_POLL`]. A commit after the last
    /// [`CommandLog::read_from`] started counts, so none is missed.
    pub fn wait_for_append(&mut self, timeout: Duration) -> Result<bool, LogError> {
        let started = std::time::Instant::now();
        loop {
            let now = self.data_version()?;
            if self.seen_version != Some(now) {
                return Ok(true);
            }
            let left = timeout.saturating_sub(started.elapsed());
            if left.is_zero() {
                return Ok(false);
            }
            std::thread::sleep(left.min(SQLITE_WAIT_POLL));
        }
    }

    fn data_version(&self) -> Result<i64, LogError> {
        self.conn
            .query_row("PRAGMA data_version", [], |r| r.get(0))
            .map_err(|e| self.store(e))
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
        self.seen_version = Some(self.data_version()?);
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
