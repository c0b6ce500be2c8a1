//! The PostgreSQL backend: the logs of many replicas in one database, keyed
//! by log name.
//!
//! - **Schema.** `command_log_fence (log, epoch, truncated)`, one row per
//!   log: the newest epoch that appended and the highest offset ever
//!   deleted; `command_log_entries (log, log_offset, epoch, marker,
//!   command)`. The format is the `command_log` row of `lockstep_schema`
//!   (shared with the catalog); a newer one is refused without changes.
//! - **Fencing.** Every append, truncation and forgetting runs in one
//!   transaction that first locks the log's fence row (`SELECT … FOR
//!   UPDATE`) and fails with [`LogError::Fenced`] if a newer epoch appended;
//!   the lock also serializes writers, so offsets stay consecutive.
//! - **Wake-ups.** An append calls `pg_notify('lockstep_log_<name>', <last
//!   offset>)` in its transaction; the notification is delivered when it
//!   commits. Readers `LISTEN` on that channel and
//!   [`PgLog::wait_for_append`] returns on a notification, or after its
//!   timeout (the bounded poll: NOTIFY has no replay and a reconnect can
//!   lose one, so the table stays the truth).

use std::path::PathBuf;
use std::time::Duration;

use lockstep_pg::tokio_postgres::types::Type;
use lockstep_pg::tokio_postgres::Client;
use lockstep_pg::{Conn, Options, PgError, Session};
use lockstep_protocol::{Command, WireMessage};

use crate::{marker_of, CommandLog, Entry, LogError, FORMAT};

/// The longest log name, in bytes (the notification channel, its name
/// prefixed, must stay below PostgreSQL's 63-byte identifiers).
pub const MAX_LOG_NAME_LEN: usize = 48;

/// Advisory lock key serializing schema creation ("LKCL").
const SCHEMA_LOCK: i64 = 0x4c4b_434c;

const SCHEMA: &str = "
CREATE TABLE command_log_fence (
    log       TEXT PRIMARY KEY,
    epoch     BIGINT NOT NULL,
    truncated BIGINT NOT NULL
);
CREATE TABLE command_log_entries (
    log        TEXT NOT NULL REFERENCES command_log_fence (log),
    log_offset BIGINT NOT NULL,
    epoch      BIGINT NOT NULL,
    marker     SMALLINT NOT NULL,
    command    BYTEA NOT NULL,
    PRIMARY KEY (log, log_offset)
);
CREATE INDEX command_log_markers ON command_log_entries (log, marker, log_offset);
";

/// Checks a log name: 1 to [`MAX_LOG_NAME_LEN`] of `a-z`, `0-9`, `-`, `_`.
pub(crate) fn check_name(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > MAX_LOG_NAME_LEN {
        return Err(format!(
            "a command log name has 1 to {MAX_LOG_NAME_LEN} characters: {name:?}"
        ));
    }
    if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '-' || *c == '_'))
    {
        return Err(format!(
            "a command log name may hold only a-z, 0-9, '-' and '_'; {name:?} holds {c:?}"
        ));
    }
    Ok(())
}

/// The PostgreSQL backend of one named log.
pub struct PgLog {
    conn: Conn,
    name: String,
    path: PathBuf,
}

impl std::fmt::Debug for PgLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgLog").field("path", &self.path).finish()
    }
}

/// A failure inside a job, before it gets the log's path.
enum Failure {
    Pg(PgError),
    Log(LogError),
}

impl From<PgError> for Failure {
    fn from(e: PgError) -> Self {
        Failure::Pg(e)
    }
}

impl From<lockstep_pg::tokio_postgres::Error> for Failure {
    fn from(e: lockstep_pg::tokio_postgres::Error) -> Self {
        Failure::Pg(e.into())
    }
}

impl From<LogError> for Failure {
    fn from(e: LogError) -> Self {
        Failure::Log(e)
    }
}

impl PgLog {
    /// Opens (creating the schema and the log if missing) the log `name` in
    /// the database at `url`, for a writer. A database whose command-log
    /// format is not this build's is refused and left untouched.
    pub fn open(url: &str, name: &str) -> Result<Self, LogError> {
        let log = Self::connect(url, name, Vec::new())?;
        let name = log.name.clone();
        log.run(move |c| {
            Box::pin(async move {
                c.batch_execute("BEGIN").await?;
                let out = async {
                    c.execute("SELECT pg_advisory_xact_lock($1)", &[&SCHEMA_LOCK])
                        .await?;
                    c.batch_execute(
                        "CREATE TABLE IF NOT EXISTS lockstep_schema (\
                             component TEXT PRIMARY KEY, version INTEGER NOT NULL)",
                    )
                    .await?;
                    match format_of(c).await? {
                        None => {
                            c.batch_execute(SCHEMA).await?;
                            c.execute(
                                "INSERT INTO lockstep_schema (component, version) \
                                 VALUES ('command_log', $1)",
                                &[&(FORMAT as i32)],
                            )
                            .await?;
                        }
                        Some(f) if f == FORMAT => {}
                        Some(f) => return Err(Failure::Log(format_error(f))),
                    }
                    c.execute(
                        "INSERT INTO command_log_fence (log, epoch, truncated) VALUES ($1, 0, 0) \
                         ON CONFLICT (log) DO NOTHING",
                        &[&name],
                    )
                    .await?;
                    Ok(())
                }
                .await;
                finish(c, out).await
            })
        })?;
        Ok(log)
    }

    /// Opens an existing log for reading and tailing: creates nothing, and
    /// `LISTEN`s for its appends (see [`PgLog::wait_for_append`]). Refuses a
    /// database without this log, or of another format.
    pub fn open_reader(url: &str, name: &str) -> Result<Self, LogError> {
        let log = Self::connect(url, name, vec![channel_of(name)])?;
        let name = log.name.clone();
        log.run(move |c| {
            Box::pin(async move {
                let exists: Option<String> = c
                    .query_one("SELECT to_regclass('lockstep_schema')::text", &[])
                    .await?
                    .get(0);
                if exists.is_none() {
                    return Err(Failure::Log(format_error(-1)));
                }
                match format_of(c).await? {
                    Some(f) if f == FORMAT => {}
                    Some(f) => return Err(Failure::Log(format_error(f))),
                    None => return Err(Failure::Log(format_error(-1))),
                }
                let there = c
                    .query_opt("SELECT 1 FROM command_log_fence WHERE log = $1", &[&name])
                    .await?;
                if there.is_none() {
                    return Err(Failure::Log(LogError::Format {
                        path: PathBuf::new(),
                        message: format!("no command log named {name:?} (missing)"),
                    }));
                }
                Ok(())
            })
        })?;
        Ok(log)
    }

    /// Deletes the whole log (its entries and its fence row), fenced like
    /// every write: a newer epoch's log is left alone. Returns how many
    /// entries went.
    pub fn remove(&mut self, epoch: u64) -> Result<usize, LogError> {
        self.fenced(epoch, move |c, name, _| {
            Box::pin(async move {
                let gone = c
                    .execute("DELETE FROM command_log_entries WHERE log = $1", &[&name])
                    .await?;
                c.execute("DELETE FROM command_log_fence WHERE log = $1", &[&name])
                    .await?;
                Ok(gone as usize)
            })
        })
    }

    /// The log's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Waits until an append to this log commits (a notification arrives)
    /// or `timeout` passes; returns whether it was woken. Only a reader
    /// ([`PgLog::open_reader`]) listens; a writer's wait always times out.
    ///
    /// Every notification since the last wait counts, so an append between
    /// a [`CommandLog::read_from`] and this call wakes it at once. A lost
    /// connection wakes it too (notifications may have been lost with it);
    /// the next read reconnects and listens again. A caller must read after
    /// a timeout as well: the timeout is the bounded poll.
    pub fn wait_for_append(&mut self, timeout: Duration) -> bool {
        self.conn.wait_notification(timeout)
    }

    fn connect(url: &str, name: &str, listen: Vec<String>) -> Result<Self, LogError> {
        let path = PathBuf::from(format!("{}#{name}", lockstep_pg::redact(url)));
        check_name(name).map_err(|message| LogError::Format {
            path: path.clone(),
            message,
        })?;
        let conn = Conn::connect(
            url,
            Options {
                listen,
                application_name: format!("lockstep-log-{name}"),
                ..Options::default()
            },
        )
        .map_err(|source| LogError::Postgres {
            path: path.clone(),
            source,
        })?;
        Ok(PgLog {
            conn,
            name: name.to_string(),
            path,
        })
    }

    /// Runs a job on the connection, giving its errors this log's path.
    fn run<T, F>(&self, f: F) -> Result<T, LogError>
    where
        T: Send + 'static,
        F: for<'c> FnOnce(&'c Client) -> lockstep_pg::BoxFuture<'c, Result<T, Failure>>
            + Send
            + 'static,
    {
        let out: Result<T, Failure> = self
            .conn
            .run(move |s: &mut Session| Box::pin(async move { f(&s.client).await }));
        out.map_err(|e| match e {
            Failure::Pg(source) => LogError::Postgres {
                path: self.path.clone(),
                source,
            },
            Failure::Log(e) => with_path(e, &self.path),
        })
    }

    /// Runs `f` in one transaction that locks the log's fence row first and
    /// fails with [`LogError::Fenced`] if a newer epoch than `epoch`
    /// appended. `f` gets the stored `truncated` watermark.
    fn fenced<T, F>(&self, epoch: u64, f: F) -> Result<T, LogError>
    where
        T: Send + 'static,
        F: for<'c> FnOnce(
                &'c Client,
                String,
                i64,
            ) -> lockstep_pg::BoxFuture<'c, Result<T, Failure>>
            + Send
            + 'static,
    {
        let name = self.name.clone();
        self.run(move |c| {
            Box::pin(async move {
                c.batch_execute("BEGIN").await?;
                let out = async {
                    // Typed statements go in one round trip each (no
                    // separate prepare).
                    let row = c
                        .query_typed(
                            "SELECT epoch, truncated FROM command_log_fence WHERE log = $1 FOR UPDATE",
                            &[(&name, Type::TEXT)],
                        )
                        .await?
                        .into_iter()
                        .next()
                        .ok_or_else(|| {
                            Failure::Log(LogError::Format {
                                path: PathBuf::new(),
                                message: format!("no command log named {name:?}"),
                            })
                        })?;
                    let newest = row.get::<_, i64>(0) as u64;
                    if epoch < newest {
                        return Err(Failure::Log(LogError::Fenced {
                            path: PathBuf::new(),
                            epoch,
                            newest,
                        }));
                    }
                    f(c, name, row.get::<_, i64>(1)).await
                }
                .await;
                finish(c, out).await
            })
        })
    }
}

impl CommandLog for PgLog {
    fn append(&mut self, epoch: u64, commands: &[Command]) -> Result<u64, LogError> {
        let mut markers: Vec<i16> = Vec::with_capacity(commands.len());
        let mut encoded: Vec<Vec<u8>> = Vec::with_capacity(commands.len());
        for c in commands {
            markers.push(marker_of(&c.kind) as i16);
            encoded.push(c.clone().encode_to_vec());
        }
        self.fenced(epoch, move |c, name, truncated| {
            Box::pin(async move {
                // The marker at the truncation point always stays, so the
                // newest offset never goes back; `truncated` covers the rest.
                // A statement of its own after the fence row was locked: its
                // snapshot sees every append committed before ours.
                let newest: Option<i64> = c
                    .query_typed(
                        "SELECT MAX(log_offset) FROM command_log_entries WHERE log = $1",
                        &[(&name, Type::TEXT)],
                    )
                    .await?
                    .first()
                    .and_then(|r| r.get(0));
                let first = newest.unwrap_or(0).max(truncated) + 1;
                let offsets: Vec<i64> = (first..first + encoded.len() as i64).collect();
                let last = first + encoded.len() as i64 - 1;
                // The fence's epoch, the entries and the notification in one
                // statement (data-modifying parts run to completion whatever
                // the outer query returns; the notification only when there
                // are entries, and it is delivered at commit).
                c.query_typed(
                    "WITH fence AS (UPDATE command_log_fence SET epoch = $2 WHERE log = $1 RETURNING 1), \
                          entries AS (INSERT INTO command_log_entries (log, log_offset, epoch, marker, command) \
                              SELECT $1, o, $2, m, b FROM UNNEST($3::BIGINT[], $4::SMALLINT[], $5::BYTEA[]) AS t (o, m, b) \
                              RETURNING 1) \
                     SELECT pg_notify($6, $7) WHERE cardinality($3::BIGINT[]) > 0",
                    &[
                        (&name, Type::TEXT),
                        (&(epoch as i64), Type::INT8),
                        (&offsets, Type::INT8_ARRAY),
                        (&markers, Type::INT2_ARRAY),
                        (&encoded, Type::BYTEA_ARRAY),
                        (&channel_of(&name), Type::TEXT),
                        (&last.to_string(), Type::TEXT),
                    ],
                )
                .await?;
                Ok(last as u64)
            })
        })
    }

    fn read_from(&mut self, offset: u64, max: usize) -> Result<Vec<Entry>, LogError> {
        let name = self.name.clone();
        let rows: Vec<(i64, Vec<u8>)> = self.run(move |c| {
            Box::pin(async move {
                // Typed: one round trip (a worker reads on every poke).
                Ok(c.query_typed(
                    "SELECT log_offset, command FROM command_log_entries \
                         WHERE log = $1 AND log_offset >= $2 ORDER BY log_offset LIMIT $3",
                    &[
                        (&name, Type::TEXT),
                        (&(offset as i64), Type::INT8),
                        (&(max.min(i64::MAX as usize) as i64), Type::INT8),
                    ],
                )
                .await?
                .into_iter()
                .map(|r| (r.get(0), r.get(1)))
                .collect())
            })
        })?;
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

    fn start_offset(&mut self) -> Result<u64, LogError> {
        let name = self.name.clone();
        let newest: Option<i64> = self.run(move |c| {
            Box::pin(async move {
                Ok(c.query_one(
                    "SELECT MAX(log_offset) FROM command_log_entries WHERE log = $1 AND marker = 1",
                    &[&name],
                )
                .await?
                .get(0))
            })
        })?;
        Ok(newest.map_or(1, |o| o as u64))
    }

    fn truncate_before(&mut self, epoch: u64, offset: u64) -> Result<usize, LogError> {
        self.fenced(epoch, move |c, name, _| {
            Box::pin(async move {
                let gone = c
                    .execute(
                        "DELETE FROM command_log_entries WHERE log = $1 AND log_offset < $2",
                        &[&name, &(offset as i64)],
                    )
                    .await?;
                c.execute(
                    "UPDATE command_log_fence SET truncated = GREATEST(truncated, $2) WHERE log = $1",
                    &[&name, &(offset as i64 - 1)],
                )
                .await?;
                Ok(gone as usize)
            })
        })
    }

    fn forget_status_requests(&mut self, epoch: u64, offset: u64) -> Result<usize, LogError> {
        self.fenced(epoch, move |c, name, _| {
            Box::pin(async move {
                let gone = c
                    .execute(
                        "DELETE FROM command_log_entries WHERE log = $1 AND marker = 2 AND log_offset <= $2",
                        &[&name, &(offset as i64)],
                    )
                    .await?;
                // The numbering must not go back if the newest entry went.
                c.execute(
                    "UPDATE command_log_fence SET truncated = GREATEST(truncated, $2) WHERE log = $1",
                    &[&name, &(offset as i64)],
                )
                .await?;
                Ok(gone as usize)
            })
        })
    }
}

/// The notification channel of log `name`.
fn channel_of(name: &str) -> String {
    format!("lockstep_log_{name}")
}

/// The command-log format stored in the database, if any.
async fn format_of(c: &Client) -> Result<Option<i64>, Failure> {
    Ok(c.query_opt(
        "SELECT version FROM lockstep_schema WHERE component = 'command_log'",
        &[],
    )
    .await?
    .map(|r| i64::from(r.get::<_, i32>(0))))
}

fn format_error(found: i64) -> LogError {
    LogError::Format {
        path: PathBuf::new(),
        message: if found < 0 {
            "no command-log schema in this database (missing)".into()
        } else {
            format!("format {found}")
        },
    }
}

/// Commits if `out` succeeded, rolls back otherwise.
async fn finish<T>(c: &Client, out: Result<T, Failure>) -> Result<T, Failure> {
    match out {
        Ok(v) => {
            c.batch_execute("COMMIT").await?;
            Ok(v)
        }
        Err(e) => {
            let _ = c.batch_execute("ROLLBACK").await;
            Err(e)
        }
    }
}

/// Fills in the path of an error made inside a job.
fn with_path(e: LogError, p: &std::path::Path) -> LogError {
    let path = p.to_path_buf();
    match e {
        LogError::Fenced { epoch, newest, .. } => LogError::Fenced {
            path,
            epoch,
            newest,
        },
        LogError::Format { message, .. } => LogError::Format { path, message },
        LogError::Corrupt {
            offset, message, ..
        } => LogError::Corrupt {
            path,
            offset,
            message,
        },
        other => other,
    }
}
