//! The SQLite backend: one file in the state directory (rusqlite, bundled).
//!
//! Fencing: every write runs in one `BEGIN IMMEDIATE` transaction that first
//! reads the stored epoch; the epoch bump on open takes the same write lock.
//! The file is validated read-only before anything writes to it (see the
//! crate docs).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use rusqlite::{params, Connection, OpenFlags, OptionalExtension, TransactionBehavior};

use crate::{
    check_replica, CatalogState, Dataflow, Fenced, InputWrite, OpenError, ReadError, Replica,
    ReplicaConfig, StoredPolicy, WriteError, APPLICATION_ID, SCHEMA_VERSION,
};

/// How long a transaction waits for another controller's transaction on the
/// same file before it gives up.
const BUSY_TIMEOUT: Duration = Duration::from_secs(10);

const SCHEMA: &str = "
CREATE TABLE meta (
    key   TEXT PRIMARY KEY NOT NULL,
    value INTEGER NOT NULL
) STRICT;
INSERT INTO meta (key, value) VALUES ('epoch', 0), ('next_replica_id', 1), ('next_dataflow_id', 1);
CREATE TABLE replicas (
    id                  INTEGER PRIMARY KEY NOT NULL,
    name                TEXT NOT NULL UNIQUE,
    processes           INTEGER NOT NULL,
    workers_per_process INTEGER NOT NULL,
    config              TEXT NOT NULL
) STRICT;
CREATE TABLE dataflows (
    id          INTEGER PRIMARY KEY NOT NULL,
    replica_id  INTEGER NOT NULL REFERENCES replicas (id) ON DELETE CASCADE,
    description BLOB NOT NULL
) STRICT;
CREATE TABLE input_writes (
    seq           INTEGER PRIMARY KEY AUTOINCREMENT,
    replica_id    INTEGER NOT NULL REFERENCES replicas (id) ON DELETE CASCADE,
    collection_id INTEGER NOT NULL,
    write         BLOB NOT NULL
) STRICT;
";

/// Version 2 adds the policies in force (set at run time).
const SCHEMA_V2: &str = "
CREATE TABLE IF NOT EXISTS policies (
    kind   TEXT PRIMARY KEY NOT NULL,
    name   TEXT NOT NULL,
    wasm   BLOB NOT NULL,
    set_at INTEGER NOT NULL
) STRICT;
";

/// Version 3 adds per-replica policies, which go with their replica.
const SCHEMA_V3: &str = "
CREATE TABLE IF NOT EXISTS replica_policies (
    replica_id INTEGER NOT NULL REFERENCES replicas (id) ON DELETE CASCADE,
    kind       TEXT NOT NULL,
    name       TEXT NOT NULL,
    wasm       BLOB NOT NULL,
    set_at     INTEGER NOT NULL,
    PRIMARY KEY (replica_id, kind)
) STRICT;
";

/// Version 4 adds the environment's settings (the dataflow format its
/// replicas build, under `format`).
const SCHEMA_V4: &str = "
CREATE TABLE IF NOT EXISTS settings (
    key   TEXT PRIMARY KEY NOT NULL,
    value TEXT NOT NULL
) STRICT;
";

/// An open SQLite catalog, owning the epoch it bumped when it was opened.
#[derive(Debug)]
pub(crate) struct SqliteCatalog {
    /// Before `conn`: stopped first, so that `conn`, the last connection,
    /// checkpoints what is left when it closes.
    _checkpointer: crate::checkpoint::Checkpointer,
    pub(crate) conn: Connection,
    path: PathBuf,
    epoch: u64,
}

mod settings;

impl SqliteCatalog {
    /// Opens (creating if absent) the catalog at `path` and bumps its epoch.
    ///
    /// An existing file is first validated read-only; see the crate docs.
    pub fn open(path: impl AsRef<Path>) -> Result<SqliteCatalog, OpenError> {
        let path = path.as_ref().to_path_buf();
        let exists = match std::fs::metadata(&path) {
            Ok(m) if m.is_file() => m.len() > 0,
            Ok(_) => {
                return Err(OpenError::Io {
                    path,
                    source: std::io::Error::other("not a regular file"),
                })
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => false,
            Err(source) => return Err(OpenError::Io { path, source }),
        };
        if exists {
            validate(&path)?;
        }
        let sqlite = |source| OpenError::Sqlite {
            path: path.clone(),
            source,
        };
        let mut conn = Connection::open_with_flags(
            &path,
            OpenFlags::SQLITE_OPEN_READ_WRITE
                | OpenFlags::SQLITE_OPEN_CREATE
                | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )
        .map_err(|e| classify_open_error(&path, e))?;
        conn.busy_timeout(BUSY_TIMEOUT).map_err(sqlite)?;
        conn.pragma_update(None, "foreign_keys", true)
            .map_err(sqlite)?;
        // WAL with FULL: a commit is durable once its one WAL append is
        // synced, the promise a rollback journal with FULL gave (a power
        // cut loses no acknowledged write) at one fsync per commit instead
        // of one for the journal and one for the file. NORMAL would sync
        // only at checkpoints: a power cut could lose the last commits.
        // Checkpoints run on a thread of their own (`checkpoint.rs`).
        conn.pragma_update(None, "journal_mode", "WAL")
            .map_err(sqlite)?;
        conn.pragma_update(None, "synchronous", "FULL")
            .map_err(sqlite)?;
        let tx = conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(|e| classify_open_error(&path, e))?;
        let version: i32 = tx
            .pragma_query_value(None, "user_version", |r| r.get(0))
            .map_err(|e| classify_open_error(&path, e))?;
        if version == 0 {
            // Either a brand-new file or one created empty: lay out the schema.
            // (A non-empty file with version 0 was refused by `validate`.)
            tx.execute_batch(SCHEMA).map_err(sqlite)?;
            tx.execute_batch(SCHEMA_V2).map_err(sqlite)?;
            tx.execute_batch(SCHEMA_V3).map_err(sqlite)?;
            tx.execute_batch(SCHEMA_V4).map_err(sqlite)?;
            tx.pragma_update(None, "application_id", APPLICATION_ID)
                .map_err(sqlite)?;
            tx.pragma_update(None, "user_version", SCHEMA_VERSION)
                .map_err(sqlite)?;
        } else {
            // Re-check inside the write transaction: the file may have been
            // replaced between validation and now.
            check_header(&path, &tx)?;
            // Migrate, in the same transaction as the epoch bump.
            if version < 2 {
                tx.execute_batch(SCHEMA_V2).map_err(sqlite)?;
            }
            if version < 3 {
                tx.execute_batch(SCHEMA_V3).map_err(sqlite)?;
            }
            if version < 4 {
                tx.execute_batch(SCHEMA_V4).map_err(sqlite)?;
            }
            if version < SCHEMA_VERSION {
                tx.pragma_update(None, "user_version", SCHEMA_VERSION)
                    .map_err(sqlite)?;
            }
        }
        let epoch: u64 = tx
            .query_row("SELECT value FROM meta WHERE key = 'epoch'", [], |r| {
                r.get::<_, i64>(0)
            })
            .map_err(|e| classify_open_error(&path, e))? as u64
            + 1;
        tx.execute(
            "UPDATE meta SET value = ?1 WHERE key = 'epoch'",
            [epoch as i64],
        )
        .map_err(sqlite)?;
        tx.commit().map_err(sqlite)?;
        let _checkpointer = crate::checkpoint::Checkpointer::start(&conn, &path);
        Ok(SqliteCatalog {
            _checkpointer,
            conn,
            path,
            epoch,
        })
    }

    /// The epoch this handle owns.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The file this catalog lives in.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Reads everything in one transaction. Reading is allowed even when
    /// fenced; compare [`CatalogState::epoch`] with [`Catalog::epoch`] to tell.
    pub fn state(&mut self) -> Result<CatalogState, ReadError> {
        let tx = self.conn.transaction()?;
        let meta = |key: &str| -> rusqlite::Result<u64> {
            tx.query_row("SELECT value FROM meta WHERE key = ?1", [key], |r| {
                r.get::<_, i64>(0)
            })
            .map(|v| v as u64)
        };
        let epoch = meta("epoch")?;
        let next_replica_id = meta("next_replica_id")?;
        let next_dataflow_id = meta("next_dataflow_id")?;
        let mut replicas = BTreeMap::new();
        {
            let mut stmt = tx.prepare(
                "SELECT id, name, processes, workers_per_process, config FROM replicas ORDER BY id",
            )?;
            let rows = stmt.query_map([], |r| {
                Ok(Replica {
                    id: r.get::<_, i64>(0)? as u64,
                    name: r.get(1)?,
                    config: ReplicaConfig {
                        processes: r.get(2)?,
                        workers_per_process: r.get(3)?,
                        config: r.get(4)?,
                    },
                })
            })?;
            for row in rows {
                let replica = row?;
                replicas.insert(replica.id, replica);
            }
        }
        let mut dataflows = BTreeMap::new();
        {
            let mut stmt =
                tx.prepare("SELECT id, replica_id, description FROM dataflows ORDER BY id")?;
            let rows = stmt.query_map([], |r| {
                Ok(Dataflow {
                    id: r.get::<_, i64>(0)? as u64,
                    replica_id: r.get::<_, i64>(1)? as u64,
                    description: r.get(2)?,
                })
            })?;
            for row in rows {
                let dataflow = row?;
                dataflows.insert(dataflow.id, dataflow);
            }
        }
        let mut input_writes = Vec::new();
        {
            let mut stmt = tx.prepare(
                "SELECT seq, replica_id, collection_id, write FROM input_writes ORDER BY seq",
            )?;
            let rows = stmt.query_map([], |r| {
                Ok(InputWrite {
                    seq: r.get::<_, i64>(0)? as u64,
                    replica_id: r.get::<_, i64>(1)? as u64,
                    collection_id: r.get::<_, i64>(2)? as u64,
                    write: r.get(3)?,
                })
            })?;
            for row in rows {
                input_writes.push(row?);
            }
        }
        tx.commit()?;
        Ok(CatalogState {
            epoch,
            next_replica_id,
            next_dataflow_id,
            replicas,
            dataflows,
            input_writes,
        })
    }

    /// Checks that no newer controller has opened the catalog, without writing.
    pub fn check_fence(&mut self) -> Result<(), WriteError> {
        self.write(|_| Ok(()))
    }

    /// Creates a replica, allocating its ID.
    pub fn create_replica(
        &mut self,
        name: &str,
        config: ReplicaConfig,
    ) -> Result<Replica, WriteError> {
        check_replica(name, &config).map_err(WriteError::Invalid)?;
        self.write(|tx| {
            let taken: Option<i64> = tx
                .query_row("SELECT id FROM replicas WHERE name = ?1", [name], |r| {
                    r.get(0)
                })
                .optional()?;
            if taken.is_some() {
                return Err(WriteError::ReplicaExists(name.to_string()));
            }
            let id = allocate(tx, "next_replica_id")?;
            tx.execute(
                "INSERT INTO replicas (id, name, processes, workers_per_process, config) VALUES (?1, ?2, ?3, ?4, ?5)",
                params![id as i64, name, config.processes, config.workers_per_process, config.config],
            )?;
            Ok(Replica {
                id,
                name: name.to_string(),
                config,
            })
        })
    }

    /// See [`crate::Catalog::resize_replica`].
    pub fn resize_replica(
        &mut self,
        name: &str,
        processes: u32,
        workers_per_process: u32,
    ) -> Result<Replica, WriteError> {
        self.write(|tx| {
            let mut replica = replica_named(tx, name)?;
            replica.config.processes = processes;
            replica.config.workers_per_process = workers_per_process;
            check_replica(name, &replica.config).map_err(WriteError::Invalid)?;
            tx.execute(
                "UPDATE replicas SET processes = ?1, workers_per_process = ?2 WHERE id = ?3",
                params![processes, workers_per_process, replica.id as i64],
            )?;
            Ok(replica)
        })
    }

    /// Drops the replica with this name, and its dataflows.
    pub fn drop_replica(&mut self, name: &str) -> Result<Replica, WriteError> {
        if name.is_empty() {
            return Err(WriteError::Invalid("a replica needs a name".into()));
        }
        self.write(|tx| {
            let replica = replica_named(tx, name)?;
            tx.execute(
                "DELETE FROM dataflows WHERE replica_id = ?1",
                [replica.id as i64],
            )?;
            tx.execute(
                "DELETE FROM input_writes WHERE replica_id = ?1",
                [replica.id as i64],
            )?;
            tx.execute("DELETE FROM replicas WHERE id = ?1", [replica.id as i64])?;
            Ok(replica)
        })
    }

    /// Records a dataflow on a replica, allocating its ID and passing it to
    /// `describe`, which returns the description to store (descriptions that
    /// embed their own ID need it).
    pub fn create_dataflow_with(
        &mut self,
        replica_id: u64,
        describe: impl FnOnce(u64) -> Vec<u8>,
    ) -> Result<Dataflow, WriteError> {
        self.write(|tx| {
            replica_exists(tx, replica_id)?;
            let id = allocate(tx, "next_dataflow_id")?;
            let description = describe(id);
            tx.execute(
                "INSERT INTO dataflows (id, replica_id, description) VALUES (?1, ?2, ?3)",
                params![id as i64, replica_id as i64, description],
            )?;
            Ok(Dataflow {
                id,
                replica_id,
                description,
            })
        })
    }

    /// Appends `writes` (replica, collection, write) in one fenced
    /// transaction; their positions, in order.
    pub fn append_inputs(&mut self, writes: &[(u64, u64, &[u8])]) -> Result<Vec<u64>, WriteError> {
        self.write(|tx| {
            let mut known = std::collections::BTreeSet::new();
            let mut seqs = Vec::with_capacity(writes.len());
            for &(replica_id, collection_id, write) in writes {
                if known.insert(replica_id) {
                    replica_exists(tx, replica_id)?;
                }
                seqs.push(insert_input(tx, replica_id, collection_id, write)?);
            }
            Ok(seqs)
        })
    }

    /// Replaces every stored write to an input collection of a replica with
    /// one `write` (their consolidation), in one fenced transaction: the
    /// collection's rows stay proportional to its live updates, not to how
    /// often it was written.
    pub fn replace_inputs(
        &mut self,
        replica_id: u64,
        collection_id: u64,
        write: &[u8],
    ) -> Result<InputWrite, WriteError> {
        self.write(|tx| {
            replica_exists(tx, replica_id)?;
            tx.execute(
                "DELETE FROM input_writes WHERE replica_id = ?1 AND collection_id = ?2",
                params![replica_id as i64, collection_id as i64],
            )?;
            Ok(InputWrite {
                seq: insert_input(tx, replica_id, collection_id, write)?,
                replica_id,
                collection_id,
                write: write.to_vec(),
            })
        })
    }

    /// Records `policy` as the one in force for its kind (replacing any).
    pub fn set_policy(&mut self, policy: &StoredPolicy) -> Result<(), WriteError> {
        self.write(|tx| {
            tx.execute(
                "INSERT INTO policies (kind, name, wasm, set_at) VALUES (?1, ?2, ?3, ?4) \
                 ON CONFLICT (kind) DO UPDATE SET name = ?2, wasm = ?3, set_at = ?4",
                params![policy.kind, policy.name, policy.wasm, policy.set_at as i64],
            )?;
            Ok(())
        })
    }

    /// The policies set at run time, by kind.
    pub fn policies(&mut self) -> Result<Vec<StoredPolicy>, ReadError> {
        let mut stmt = self
            .conn
            .prepare("SELECT kind, name, wasm, set_at FROM policies ORDER BY kind")?;
        let rows = stmt.query_map([], |r| {
            Ok(StoredPolicy {
                kind: r.get(0)?,
                name: r.get(1)?,
                wasm: r.get(2)?,
                set_at: r.get::<_, i64>(3)? as u64,
            })
        })?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    /// Records `policy` as the one in force for its kind on one replica.
    pub fn set_replica_policy(
        &mut self,
        replica_id: u64,
        policy: &StoredPolicy,
    ) -> Result<(), WriteError> {
        self.write(|tx| {
            let known: bool = tx.query_row(
                "SELECT EXISTS (SELECT 1 FROM replicas WHERE id = ?1)",
                [replica_id as i64],
                |r| r.get(0),
            )?;
            if !known {
                return Err(WriteError::NoSuchReplica(replica_id.to_string()));
            }
            tx.execute(
                "INSERT INTO replica_policies (replica_id, kind, name, wasm, set_at) \
                 VALUES (?1, ?2, ?3, ?4, ?5) \
                 ON CONFLICT (replica_id, kind) DO UPDATE SET name = ?3, wasm = ?4, set_at = ?5",
                params![
                    replica_id as i64,
                    policy.kind,
                    policy.name,
                    policy.wasm,
                    policy.set_at as i64
                ],
            )?;
            Ok(())
        })
    }

    /// The per-replica policies, by replica ID and kind.
    pub fn replica_policies(&mut self) -> Result<Vec<(u64, StoredPolicy)>, ReadError> {
        let mut stmt = self.conn.prepare(
            "SELECT replica_id, kind, name, wasm, set_at FROM replica_policies \
             ORDER BY replica_id, kind",
        )?;
        let rows = stmt.query_map([], |r| {
            Ok((
                r.get::<_, i64>(0)? as u64,
                StoredPolicy {
                    kind: r.get(1)?,
                    name: r.get(2)?,
                    wasm: r.get(3)?,
                    set_at: r.get::<_, i64>(4)? as u64,
                },
            ))
        })?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    /// Drops a dataflow.
    pub fn drop_dataflow(&mut self, id: u64) -> Result<(), WriteError> {
        self.write(|tx| {
            let n = tx.execute("DELETE FROM dataflows WHERE id = ?1", [id as i64])?;
            if n == 0 {
                return Err(WriteError::NoSuchDataflow(id));
            }
            Ok(())
        })
    }

    /// Runs `f` in an immediate (write-locked) transaction after checking the
    /// fence; commits only if `f` succeeds.
    fn write<T>(
        &mut self,
        f: impl FnOnce(&rusqlite::Transaction<'_>) -> Result<T, WriteError>,
    ) -> Result<T, WriteError> {
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)?;
        let current = tx.query_row("SELECT value FROM meta WHERE key = 'epoch'", [], |r| {
            r.get::<_, i64>(0)
        })? as u64;
        if current != self.epoch {
            return Err(Fenced {
                ours: self.epoch,
                current,
            }
            .into());
        }
        let out = f(&tx)?;
        tx.commit()?;
        Ok(out)
    }
}

/// Appends one input write row; returns its position.
fn insert_input(
    tx: &rusqlite::Transaction<'_>,
    replica_id: u64,
    collection_id: u64,
    write: &[u8],
) -> Result<u64, WriteError> {
    tx.execute(
        "INSERT INTO input_writes (replica_id, collection_id, write) VALUES (?1, ?2, ?3)",
        params![replica_id as i64, collection_id as i64, write],
    )?;
    Ok(tx.last_insert_rowid() as u64)
}

/// Fails with `NoSuchReplica` unless the replica is in the catalog.
fn replica_exists(tx: &rusqlite::Transaction<'_>, replica_id: u64) -> Result<(), WriteError> {
    let exists: Option<i64> = tx
        .query_row(
            "SELECT id FROM replicas WHERE id = ?1",
            [replica_id as i64],
            |r| r.get(0),
        )
        .optional()?;
    match exists {
        Some(_) => Ok(()),
        None => Err(WriteError::NoSuchReplica(format!("with ID {replica_id}"))),
    }
}

/// Takes the next value of a monotonic allocator.
fn allocate(tx: &rusqlite::Transaction<'_>, key: &str) -> rusqlite::Result<u64> {
    let id: i64 = tx.query_row("SELECT value FROM meta WHERE key = ?1", [key], |r| r.get(0))?;
    tx.execute(
        "UPDATE meta SET value = ?1 WHERE key = ?2",
        params![id + 1, key],
    )?;
    Ok(id as u64)
}

/// Opens an existing file read-only and checks that it is an intact lockstep
/// catalog of a schema this build knows. Never writes.
fn validate(path: &Path) -> Result<(), OpenError> {
    let conn = Connection::open_with_flags(
        path,
        OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
    .map_err(|e| classify_open_error(path, e))?;
    conn.busy_timeout(BUSY_TIMEOUT)
        .map_err(|e| classify_open_error(path, e))?;
    match check_header(path, &conn) {
        // A hot journal left by a crash needs a writer to roll it back; the
        // read-write open that follows does that and re-checks the header.
        Err(OpenError::Sqlite { source, .. }) if is_hot_journal(&source) => return Ok(()),
        other => other?,
    }
    let result: String = conn
        .query_row("PRAGMA quick_check", [], |r| r.get(0))
        .map_err(|e| classify_open_error(path, e))?;
    if result != "ok" {
        return Err(OpenError::Corrupt {
            path: path.to_path_buf(),
            reason: format!("quick_check: {result}"),
        });
    }
    Ok(())
}

/// Checks `application_id` and `user_version` of an existing catalog.
fn check_header(path: &Path, conn: &Connection) -> Result<(), OpenError> {
    let app: i32 = conn
        .pragma_query_value(None, "application_id", |r| r.get(0))
        .map_err(|e| classify_open_error(path, e))?;
    let version: i32 = conn
        .pragma_query_value(None, "user_version", |r| r.get(0))
        .map_err(|e| classify_open_error(path, e))?;
    if app != APPLICATION_ID {
        return Err(OpenError::Foreign {
            path: path.to_path_buf(),
            found: app,
        });
    }
    if version > SCHEMA_VERSION {
        return Err(OpenError::NewerSchema {
            path: path.to_path_buf(),
            found: version,
        });
    }
    if version < 1 {
        return Err(OpenError::Corrupt {
            path: path.to_path_buf(),
            reason: format!("schema version {version}"),
        });
    }
    Ok(())
}

fn is_hot_journal(e: &rusqlite::Error) -> bool {
    matches!(e, rusqlite::Error::SqliteFailure(f, _)
        if f.code == rusqlite::ErrorCode::ReadOnly || f.code == rusqlite::ErrorCode::CannotOpen)
}

fn classify_open_error(path: &Path, e: rusqlite::Error) -> OpenError {
    match &e {
        rusqlite::Error::SqliteFailure(f, msg)
            if matches!(
                f.code,
                rusqlite::ErrorCode::NotADatabase | rusqlite::ErrorCode::DatabaseCorrupt
            ) =>
        {
            OpenError::Corrupt {
                path: path.to_path_buf(),
                reason: msg.clone().unwrap_or_else(|| f.to_string()),
            }
        }
        _ => OpenError::Sqlite {
            path: path.to_path_buf(),
            source: e,
        },
    }
}

/// The replica named `name`, read in transaction `tx`.
fn replica_named(tx: &rusqlite::Transaction<'_>, name: &str) -> Result<Replica, WriteError> {
    tx.query_row(
        "SELECT id, processes, workers_per_process, config FROM replicas WHERE name = ?1",
        [name],
        |r| {
            Ok(Replica {
                id: r.get::<_, i64>(0)? as u64,
                name: name.to_string(),
                config: ReplicaConfig {
                    processes: r.get(1)?,
                    workers_per_process: r.get(2)?,
                    config: r.get(3)?,
                },
            })
        },
    )
    .optional()?
    .ok_or_else(|| WriteError::NoSuchReplica(name.to_string()))
}
