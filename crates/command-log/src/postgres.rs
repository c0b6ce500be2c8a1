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
//! - **Round trips.** An append is one: BEGIN, the lock, one statement that
//!   checks the fence, numbers and inserts the entries and notifies, and
//!   COMMIT go out pipelined. A read is one. Both run statements prepared
//!   once per connection (`Session::prepare_cached`), so they are not parsed
//!   and planned on every call (measured in docs/stores.md).
//! - **Wake-ups.** An append calls `pg_notify('lockstep_log_<name>', <last
//!   offset>)` in its transaction; the notification is delivered when it
//!   commits. Readers `LISTEN` on that channel and
//!   [`PgLog::wait_for_append`] returns on a notification, or after its
//!   timeout (the bounded poll: NOTIFY has no replay and a reconnect can
//!   lose one, so the table stays the truth).

use std::path::PathBuf;
use std::time::Duration;

use lockstep_pg::tokio_postgres::types::{ToSql, Type};
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

/// An append, run after the fence row was locked (see [`PgLog`]'s
/// `append`): `$1` log, `$2` epoch, `$3` markers, `$4` encoded commands,
/// `$5` the notification channel. Returns one row (none if there is no such
/// log): the fence's epoch before this append and, unless a newer epoch
/// appended (then nothing is written), the last offset appended. The
/// marker at the truncation point always stays, so the newest offset never
/// goes back; `truncated` covers the rest. Data-modifying parts run to
/// completion whatever the outer query returns; the notification is sent
/// only when entries were appended, and delivered at commit.
const APPEND: &str = "\
WITH f AS (SELECT epoch, truncated FROM command_log_fence WHERE log = $1), \
     b AS (SELECT GREATEST(COALESCE((SELECT MAX(log_offset) FROM command_log_entries WHERE log = $1), 0), \
                           f.truncated) AS base \
           FROM f WHERE f.epoch <= $2), \
     fence AS (UPDATE command_log_fence SET epoch = $2 \
               WHERE log = $1 AND EXISTS (SELECT 1 FROM b) RETURNING 1), \
     entries AS (INSERT INTO command_log_entries (log, log_offset, epoch, marker, command) \
                 SELECT $1, b.base + t.i, $2, t.m, t.c \
                 FROM b, UNNEST($3::SMALLINT[], $4::BYTEA[]) WITH ORDINALITY AS t (m, c, i) \
                 RETURNING 1) \
SELECT f.epoch, b.base + cardinality($3::SMALLINT[]), \
       CASE WHEN b.base IS NOT NULL AND cardinality($3::SMALLINT[]) > 0 \
            THEN (SELECT 1 FROM pg_notify($5, (b.base + cardinality($3::SMALLINT[]))::TEXT)) END \
FROM f LEFT JOIN b ON TRUE";

/// Reads a log's entries from an offset on: `$1` log, `$2` offset, `$3`
/// the most to read.
const READ: &str = "SELECT log_offset, command FROM command_log_entries \
                    WHERE log = $1 AND log_offset >= $2 ORDER BY log_offset LIMIT $3";

/// Locks a log's fence row until the transaction ends and returns its
/// epoch: `$1` log.
const LOCK: &str = "SELECT epoch FROM command_log_fence WHERE log = $1 FOR UPDATE";

/// What an append's statement returned.
struct Appended {
    /// The fence's epoch before the append.
    newest_epoch: i64,
    /// The last offset appended; none if a newer epoch appended.
    last: Option<i64>,
}

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
        self.fenced(epoch, move |c, name| {
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
        self.run_session(move |s: &mut Session| f(&s.client))
    }

    /// Runs a job on the session (for its prepared statements), giving its
    /// errors this log's path.
    fn run_session<T, F>(&self, f: F) -> Result<T, LogError>
    where
        T: Send + 'static,
        F: for<'c> FnOnce(&'c mut Session) -> lockstep_pg::BoxFuture<'c, Result<T, Failure>>
            + Send
            + 'static,
    {
        let out: Result<T, Failure> = self.conn.run(f);
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
    /// appended.
    fn fenced<T, F>(&self, epoch: u64, f: F) -> Result<T, LogError>
    where
        T: Send + 'static,
        F: for<'c> FnOnce(&'c Client, String) -> lockstep_pg::BoxFuture<'c, Result<T, Failure>>
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
                        .query_typed(LOCK, &[(&name, Type::TEXT)])
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
                    f(c, name).await
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
        let name = self.name.clone();
        let appended: Option<Appended> = self.run_session(move |s| {
            Box::pin(async move {
                let channel = channel_of(&name);
                let epoch = epoch as i64;
                let lock = s.prepare_cached(LOCK, &[Type::TEXT]).await?;
                let append = s
                    .prepare_cached(
                        APPEND,
                        &[
                            Type::TEXT,
                            Type::INT8,
                            Type::INT2_ARRAY,
                            Type::BYTEA_ARRAY,
                            Type::TEXT,
                        ],
                    )
                    .await?;
                let c = &s.client;
                // One round trip; the lock serializes writers (see [`APPEND`]).
                let lock_params: [&(dyn ToSql + Sync); 1] = [&name];
                let append_params: [&(dyn ToSql + Sync); 5] =
                    [&name, &epoch, &markers, &encoded, &channel];
                let (_, row) = lockstep_pg::pipelined_transaction(
                    c,
                    c.query(&lock, &lock_params),
                    c.query(&append, &append_params),
                )
                .await?;
                Ok(row.first().map(|r| Appended {
                    newest_epoch: r.get(0),
                    last: r.get(1),
                }))
            })
        })?;
        match appended {
            Some(Appended {
                last: Some(last), ..
            }) => Ok(last as u64),
            Some(Appended {
                newest_epoch,
                last: None,
            }) => Err(LogError::Fenced {
                path: self.path.clone(),
                epoch,
                newest: newest_epoch as u64,
            }),
            None => Err(LogError::Format {
                path: self.path.clone(),
                message: format!("no command log named {:?}", self.name),
            }),
        }
    }

    fn read_from(&mut self, offset: u64, max: usize) -> Result<Vec<Entry>, LogError> {
        let name = self.name.clone();
        let rows: Vec<(i64, Vec<u8>)> = self.run_session(move |s| {
            Box::pin(async move {
                // Prepared once per connection: a worker reads on every poke.
                let read = s
                    .prepare_cached(READ, &[Type::TEXT, Type::INT8, Type::INT8])
                    .await?;
                let max = max.min(i64::MAX as usize) as i64;
                Ok(s.client
                    .query(&read, &[&name, &(offset as i64), &max])
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
        self.fenced(epoch, move |c, name| {
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
        self.fenced(epoch, move |c, name| {
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
