//! lockstep's durable, fenced catalog.
//!
//! The catalog is the controller's (the "environment's") truth about what
//! should exist: replicas with their shape and configuration, and the
//! dataflows installed on them. It lives in one SQLite file (rusqlite,
//! bundled) so the embedded default needs no server.
//!
//! Three properties make it safe to run several controllers against it, which
//! is what happens when a controller is restarted while the old one is still
//! alive (design invariants O1–O3):
//!
//! - **Epochs.** [`Catalog::open`] bumps the stored epoch in the same
//!   transaction that reads it; the opener owns that epoch. Two openers never
//!   get the same epoch.
//! - **Fencing.** Every write transaction first checks that the stored epoch is
//!   still the one this handle opened with. If a newer controller has opened the
//!   catalog since, the write fails with [`Fenced`] and changes nothing; the
//!   caller must halt (O3). The check and the write happen in one
//!   `BEGIN IMMEDIATE` transaction, so no newer opener can slip in between.
//! - **Monotonic IDs.** Replica IDs and dataflow IDs come from two allocators
//!   that only ever grow and are never reused, even after a drop. The orphan
//!   rule `id-watermark` relies on it: a service whose ID is at or above our
//!   next replica ID was created by a controller that opened after us.
//!
//! The file is validated before anything writes to it: it is first opened
//! read-only and must carry lockstep's SQLite `application_id` and a schema
//! version (`user_version`) this build understands. A file that is not a
//! SQLite database, is corrupt, belongs to another application or was written
//! by a newer lockstep is refused with [`OpenError`] and left byte-for-byte
//! unchanged.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use rusqlite::{params, Connection, OpenFlags, OptionalExtension, TransactionBehavior};

/// SQLite `application_id` of a lockstep catalog ("LKST").
pub const APPLICATION_ID: i32 = 0x4c4b_5354;

/// The schema version this build writes and understands.
pub const SCHEMA_VERSION: i32 = 2;

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

/// Why a catalog could not be opened. In every case the file was not modified.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// The directory or file could not be accessed.
    #[error("cannot access catalog {path}: {source}")]
    Io {
        /// The catalog file.
        path: PathBuf,
        /// What the OS said.
        source: std::io::Error,
    },
    /// The file is not a SQLite database, or is damaged.
    #[error("catalog {path} is corrupt or not a SQLite database ({reason}); refusing to touch it")]
    Corrupt {
        /// The catalog file.
        path: PathBuf,
        /// What SQLite reported.
        reason: String,
    },
    /// The file is a SQLite database of some other application.
    #[error(
        "{path} is not a lockstep catalog (SQLite application_id {found:#x}, expected {APPLICATION_ID:#x}); refusing to touch it"
    )]
    Foreign {
        /// The catalog file.
        path: PathBuf,
        /// The application ID found.
        found: i32,
    },
    /// The file was written by a newer lockstep with a schema this build does
    /// not know.
    #[error(
        "catalog {path} has schema version {found}, newer than this build's {SCHEMA_VERSION}; upgrade lockstep instead of downgrading the catalog"
    )]
    NewerSchema {
        /// The catalog file.
        path: PathBuf,
        /// The schema version found.
        found: i32,
    },
    /// Any other SQLite failure while opening.
    #[error("cannot open catalog {path}: {source}")]
    Sqlite {
        /// The catalog file.
        path: PathBuf,
        /// What SQLite reported.
        source: rusqlite::Error,
    },
}

/// A write was refused because a newer controller has opened the catalog.
/// The holder of the stale handle must stop acting (design invariant O3).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "fenced out: this controller opened the catalog at epoch {ours}, but another controller took over at epoch {current}"
)]
pub struct Fenced {
    /// The epoch this handle opened with.
    pub ours: u64,
    /// The epoch now stored.
    pub current: u64,
}

/// Why a write transaction failed. Nothing was written.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    /// Another controller took over; halt.
    #[error(transparent)]
    Fenced(#[from] Fenced),
    /// A replica with this name exists already.
    #[error("a replica named {0:?} exists already")]
    ReplicaExists(String),
    /// No replica has this name or ID.
    #[error("no replica {0}")]
    NoSuchReplica(String),
    /// No dataflow has this ID.
    #[error("no dataflow {0}")]
    NoSuchDataflow(u64),
    /// The request makes no sense (zero processes, an empty name, ...).
    #[error("invalid request: {0}")]
    Invalid(String),
    /// SQLite failed.
    #[error("catalog write failed: {0}")]
    Sqlite(#[from] rusqlite::Error),
}

impl WriteError {
    /// The fencing error, if that is what this is.
    pub fn fenced(&self) -> Option<Fenced> {
        match self {
            WriteError::Fenced(f) => Some(*f),
            _ => None,
        }
    }
}

/// Why reading the catalog failed.
#[derive(Debug, thiserror::Error)]
#[error("catalog read failed: {0}")]
pub struct ReadError(#[from] rusqlite::Error);

/// The shape and configuration of a replica, as the user asked for it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplicaConfig {
    /// OS processes in the replica's timely cluster (1 to [`MAX_PROCESSES`]).
    pub processes: u32,
    /// Timely workers per process (1 to [`MAX_WORKERS_PER_PROCESS`]).
    pub workers_per_process: u32,
    /// Free-form configuration passed through to the replica (may be empty;
    /// at most [`MAX_CONFIG_LEN`] bytes).
    pub config: String,
}

/// The most processes a replica may have.
pub const MAX_PROCESSES: u32 = 64;
/// The most timely workers a replica process may have.
pub const MAX_WORKERS_PER_PROCESS: u32 = 64;
/// The longest replica name, in bytes.
pub const MAX_NAME_LEN: usize = 63;
/// The longest replica configuration string, in bytes.
pub const MAX_CONFIG_LEN: usize = 4096;

/// Why a replica name or shape is refused, if it is: names are 1 to
/// [`MAX_NAME_LEN`] of `a-z`, `0-9` and `-`, neither starting nor ending
/// with `-` (they end up in service names, paths and command lines); shapes
/// and configurations are bounded so that a typo cannot start a million
/// workers or put megabytes on a command line.
pub fn check_replica(name: &str, config: &ReplicaConfig) -> Result<(), String> {
    if name.is_empty() {
        return Err("a replica needs a name".into());
    }
    if name.len() > MAX_NAME_LEN {
        return Err(format!(
            "a replica name has at most {MAX_NAME_LEN} characters; this one has {}",
            name.len()
        ));
    }
    if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '-'))
    {
        return Err(format!(
            "a replica name may hold only a-z, 0-9 and '-'; {name:?} holds {c:?}"
        ));
    }
    if name.starts_with('-') || name.ends_with('-') {
        return Err(format!(
            "a replica name may not start or end with '-': {name:?}"
        ));
    }
    if config.processes == 0 || config.workers_per_process == 0 {
        return Err("a replica needs at least one process and one worker per process".into());
    }
    if config.processes > MAX_PROCESSES {
        return Err(format!(
            "a replica has at most {MAX_PROCESSES} processes; asked for {}",
            config.processes
        ));
    }
    if config.workers_per_process > MAX_WORKERS_PER_PROCESS {
        return Err(format!(
            "a replica process has at most {MAX_WORKERS_PER_PROCESS} workers; asked for {}",
            config.workers_per_process
        ));
    }
    if config.config.len() > MAX_CONFIG_LEN {
        return Err(format!(
            "a replica configuration has at most {MAX_CONFIG_LEN} bytes; this one has {}",
            config.config.len()
        ));
    }
    Ok(())
}

/// A replica as the catalog holds it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Replica {
    /// Its ID, allocated monotonically, never reused.
    pub id: u64,
    /// Its unique name.
    pub name: String,
    /// Its shape and configuration.
    pub config: ReplicaConfig,
}

/// A dataflow as the catalog holds it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Dataflow {
    /// Its ID, allocated monotonically, never reused.
    pub id: u64,
    /// The replica it runs on.
    pub replica_id: u64,
    /// Its description, opaque to the catalog (an encoded protocol message).
    pub description: Vec<u8>,
}

/// One write to an input collection, as the catalog holds it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InputWrite {
    /// Its position among all writes (increasing).
    pub seq: u64,
    /// The replica whose input collection it writes.
    pub replica_id: u64,
    /// The input collection.
    pub collection_id: u64,
    /// The write, opaque to the catalog (an encoded protocol message).
    pub write: Vec<u8>,
}

/// Everything the catalog holds, read in one transaction.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CatalogState {
    /// The newest epoch (which may be newer than the reader's own).
    pub epoch: u64,
    /// The next replica ID to be allocated; every replica ID in use is below it.
    pub next_replica_id: u64,
    /// The next dataflow ID to be allocated.
    pub next_dataflow_id: u64,
    /// Replicas by ID.
    pub replicas: BTreeMap<u64, Replica>,
    /// Dataflows by ID.
    pub dataflows: BTreeMap<u64, Dataflow>,
    /// Writes to input collections, in the order they were made.
    pub input_writes: Vec<InputWrite>,
}

/// A policy set at run time, as the catalog holds it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredPolicy {
    /// `distribution` or `orphans`.
    pub kind: String,
    /// Its name (the file name it was set from, without `.wasm`).
    pub name: String,
    /// The component.
    pub wasm: Vec<u8>,
    /// When it was set, in seconds since the Unix epoch.
    pub set_at: u64,
}

/// An open catalog, owning the epoch it bumped when it was opened.
///
/// A `Catalog` is `Send` but not `Sync`; share it behind a mutex.
#[derive(Debug)]
pub struct Catalog {
    conn: Connection,
    path: PathBuf,
    epoch: u64,
}

impl Catalog {
    /// Opens (creating if absent) the catalog at `path` and bumps its epoch.
    ///
    /// An existing file is first validated read-only; see the crate docs.
    pub fn open(path: impl AsRef<Path>) -> Result<Catalog, OpenError> {
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
            tx.pragma_update(None, "application_id", APPLICATION_ID)
                .map_err(sqlite)?;
            tx.pragma_update(None, "user_version", SCHEMA_VERSION)
                .map_err(sqlite)?;
        } else {
            // Re-check inside the write transaction: the file may have been
            // replaced between validation and now.
            check_header(&path, &tx)?;
            if version < 2 {
                // Migrate, in the same transaction as the epoch bump.
                tx.execute_batch(SCHEMA_V2).map_err(sqlite)?;
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
        Ok(Catalog { conn, path, epoch })
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

    /// Drops the replica with this name, and its dataflows.
    pub fn drop_replica(&mut self, name: &str) -> Result<Replica, WriteError> {
        if name.is_empty() {
            return Err(WriteError::Invalid("a replica needs a name".into()));
        }
        self.write(|tx| {
            let replica = tx
                .query_row(
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
                .ok_or_else(|| WriteError::NoSuchReplica(name.to_string()))?;
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

    /// Records a dataflow on a replica, allocating its ID.
    pub fn create_dataflow(
        &mut self,
        replica_id: u64,
        description: &[u8],
    ) -> Result<Dataflow, WriteError> {
        self.create_dataflow_with(replica_id, |_| description.to_vec())
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

    /// Records a write to an input collection of a replica. Durable before
    /// the write is sent, so that a restarted controller (or a restarted
    /// replica) gets every input back.
    pub fn append_input(
        &mut self,
        replica_id: u64,
        collection_id: u64,
        write: &[u8],
    ) -> Result<InputWrite, WriteError> {
        self.write(|tx| {
            replica_exists(tx, replica_id)?;
            insert_input(tx, replica_id, collection_id, write)
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
            insert_input(tx, replica_id, collection_id, write)
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

/// Appends one input write row; returns it with its position.
fn insert_input(
    tx: &rusqlite::Transaction<'_>,
    replica_id: u64,
    collection_id: u64,
    write: &[u8],
) -> Result<InputWrite, WriteError> {
    tx.execute(
        "INSERT INTO input_writes (replica_id, collection_id, write) VALUES (?1, ?2, ?3)",
        params![replica_id as i64, collection_id as i64, write],
    )?;
    Ok(InputWrite {
        seq: tx.last_insert_rowid() as u64,
        replica_id,
        collection_id,
        write: write.to_vec(),
    })
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inputs_and_dataflows_survive_reopen_and_go_with_their_replica() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.db");
        let mut c = Catalog::open(&path).unwrap();
        let r = c.create_replica("r", cfg(2)).unwrap();
        let d = c
            .create_dataflow_with(r.id, |id| format!("df{id}").into_bytes())
            .unwrap();
        assert_eq!(d.description, format!("df{}", d.id).into_bytes());
        let w1 = c.append_input(r.id, 7, b"one").unwrap();
        let w2 = c.append_input(r.id, 7, b"two").unwrap();
        assert!(w2.seq > w1.seq);
        assert!(matches!(
            c.append_input(r.id + 100, 7, b"x"),
            Err(WriteError::NoSuchReplica(_))
        ));
        drop(c);
        let mut c = Catalog::open(&path).unwrap();
        let state = c.state().unwrap();
        assert_eq!(state.dataflows[&d.id].description, d.description);
        let writes: Vec<&[u8]> = state.input_writes.iter().map(|w| &w.write[..]).collect();
        assert_eq!(writes, vec![&b"one"[..], &b"two"[..]]);
        c.drop_replica("r").unwrap();
        let state = c.state().unwrap();
        assert!(state.input_writes.is_empty() && state.dataflows.is_empty());
    }

    fn cfg(processes: u32) -> ReplicaConfig {
        ReplicaConfig {
            processes,
            workers_per_process: 2,
            config: String::new(),
        }
    }

    #[test]
    fn a_version_1_catalog_is_migrated_and_policies_are_kept_and_fenced() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("catalog.db");
        {
            let mut c = Catalog::open(&path).unwrap();
            c.create_replica("r", cfg(1)).unwrap();
            // Make it a version 1 file, as an older build left it.
            c.conn
                .execute_batch("DROP TABLE policies; PRAGMA user_version = 1;")
                .unwrap();
        }
        let mut c = Catalog::open(&path).unwrap();
        assert_eq!(
            c.state().unwrap().replicas.len(),
            1,
            "kept across the migration"
        );
        assert!(c.policies().unwrap().is_empty());
        let p = StoredPolicy {
            kind: "distribution".into(),
            name: "log".into(),
            wasm: vec![0, 97, 115, 109],
            set_at: 7,
        };
        c.set_policy(&p).unwrap();
        let newer = StoredPolicy {
            name: "barrier".into(),
            set_at: 8,
            ..p.clone()
        };
        c.set_policy(&newer).unwrap();
        assert_eq!(c.policies().unwrap(), vec![newer.clone()]);
        let mut reopened = Catalog::open(&path).unwrap();
        assert_eq!(reopened.policies().unwrap(), vec![newer]);
        assert!(c.set_policy(&p).unwrap_err().fenced().is_some());
    }

    #[test]
    fn replacing_inputs_keeps_other_collections_and_is_fenced() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("catalog.db");
        let mut c = Catalog::open(&path).unwrap();
        let r = c.create_replica("r", cfg(1)).unwrap();
        for i in 0..5u8 {
            c.append_input(r.id, 1, &[i]).unwrap();
        }
        c.append_input(r.id, 2, b"other").unwrap();
        c.replace_inputs(r.id, 1, b"snapshot").unwrap();
        let writes: Vec<(u64, Vec<u8>)> = c
            .state()
            .unwrap()
            .input_writes
            .into_iter()
            .map(|w| (w.collection_id, w.write))
            .collect();
        assert_eq!(
            writes,
            vec![(2, b"other".to_vec()), (1, b"snapshot".to_vec())]
        );
        let _newer = Catalog::open(&path).unwrap();
        assert!(c
            .replace_inputs(r.id, 1, b"stale")
            .unwrap_err()
            .fenced()
            .is_some());
    }

    #[test]
    fn opening_bumps_the_epoch_and_ids_are_monotonic() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("catalog.db");
        let mut a = Catalog::open(&path).unwrap();
        assert_eq!(a.epoch(), 1);
        let r1 = a.create_replica("r1", cfg(2)).unwrap();
        let r2 = a.create_replica("r2", cfg(1)).unwrap();
        assert!(r2.id > r1.id);
        a.drop_replica("r2").unwrap();
        let r3 = a.create_replica("r3", cfg(1)).unwrap();
        assert!(r3.id > r2.id, "IDs are never reused");
        let d = a.create_dataflow(r1.id, b"desc").unwrap();
        let gone = a.create_dataflow(r1.id, b"gone").unwrap();
        assert!(gone.id > d.id);
        a.drop_dataflow(gone.id).unwrap();
        assert!(matches!(
            a.drop_dataflow(gone.id),
            Err(WriteError::NoSuchDataflow(_))
        ));
        assert!(matches!(
            a.create_dataflow(r2.id, b"on a dropped replica"),
            Err(WriteError::NoSuchReplica(_))
        ));
        drop(a);
        let mut b = Catalog::open(&path).unwrap();
        assert_eq!(b.epoch(), 2);
        let state = b.state().unwrap();
        assert_eq!(state.epoch, 2);
        assert_eq!(state.next_replica_id, r3.id + 1);
        assert_eq!(
            state.replicas.keys().copied().collect::<Vec<_>>(),
            vec![r1.id, r3.id]
        );
        assert_eq!(state.replicas[&r1.id].config, cfg(2));
        assert_eq!(state.dataflows[&d.id].description, b"desc");
        assert_eq!(state.dataflows.len(), 1);
        assert_eq!(state.next_dataflow_id, gone.id + 1);
        b.drop_replica("r1").unwrap();
        assert!(b.state().unwrap().dataflows.is_empty());
        assert!(matches!(
            b.drop_replica("r1"),
            Err(WriteError::NoSuchReplica(_))
        ));
        assert!(matches!(
            b.create_replica("r3", cfg(1)),
            Err(WriteError::ReplicaExists(_))
        ));
        assert!(matches!(
            b.create_replica("r4", cfg(0)),
            Err(WriteError::Invalid(_))
        ));
    }

    #[test]
    fn replica_names_and_shapes_are_bounded() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = Catalog::open(dir.path().join("catalog.db")).unwrap();
        let shape = |processes, workers_per_process, config: &str| ReplicaConfig {
            processes,
            workers_per_process,
            config: config.into(),
        };
        for (name, config, says) in [
            ("", shape(1, 1, ""), "needs a name"),
            ("Upper", shape(1, 1, ""), "only a-z"),
            ("a b", shape(1, 1, ""), "only a-z"),
            ("r\u{e9}", shape(1, 1, ""), "only a-z"),
            ("-r", shape(1, 1, ""), "start or end"),
            (
                &"r".repeat(MAX_NAME_LEN + 1),
                shape(1, 1, ""),
                "at most 63 characters",
            ),
            ("r", shape(0, 1, ""), "at least one process"),
            ("r", shape(MAX_PROCESSES + 1, 1, ""), "at most 64 processes"),
            ("r", shape(1, 1_000_000, ""), "at most 64 workers"),
            (
                "r",
                shape(1, 1, &"x".repeat(MAX_CONFIG_LEN + 1)),
                "at most 4096 bytes",
            ),
        ] {
            match c.create_replica(name, config) {
                Err(WriteError::Invalid(m)) => assert!(m.contains(says), "{name:?}: {m}"),
                other => panic!("{name:?} was not refused: {other:?}"),
            }
        }
        assert!(
            c.state().unwrap().replicas.is_empty(),
            "nothing was written"
        );
        let longest = "r".repeat(MAX_NAME_LEN);
        c.create_replica(&longest, shape(MAX_PROCESSES, MAX_WORKERS_PER_PROCESS, ""))
            .unwrap();
        c.create_replica("replica-2", shape(1, 1, "x")).unwrap();
    }

    #[test]
    fn a_stale_handle_is_fenced_and_writes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("catalog.db");
        let mut old = Catalog::open(&path).unwrap();
        old.create_replica("r1", cfg(1)).unwrap();
        let mut new = Catalog::open(&path).unwrap();
        let err = old.create_replica("r2", cfg(1)).unwrap_err();
        assert_eq!(
            err.fenced(),
            Some(Fenced {
                ours: 1,
                current: 2
            })
        );
        assert!(err.to_string().contains("another controller took over"));
        assert!(old.drop_replica("r1").unwrap_err().fenced().is_some());
        assert!(old.check_fence().unwrap_err().fenced().is_some());
        let state = new.state().unwrap();
        assert_eq!(state.replicas.len(), 1);
        assert_eq!(
            state.next_replica_id, 2,
            "the fenced write allocated nothing"
        );
        new.create_replica("r2", cfg(1)).unwrap();
        new.check_fence().unwrap();
    }

    #[test]
    fn garbage_is_refused_and_left_unchanged() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("catalog.db");
        let garbage = b"this is not a database, it is a shopping list\n".repeat(100);
        std::fs::write(&path, &garbage).unwrap();
        let err = Catalog::open(&path).unwrap_err();
        assert!(matches!(err, OpenError::Corrupt { .. }), "{err}");
        assert!(err.to_string().contains("corrupt"));
        assert_eq!(std::fs::read(&path).unwrap(), garbage);
    }

    #[test]
    fn a_truncated_catalog_is_refused_and_left_unchanged() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("catalog.db");
        {
            let mut c = Catalog::open(&path).unwrap();
            for i in 0..200 {
                c.create_replica(&format!("replica-with-a-long-name-{i}"), cfg(1))
                    .unwrap();
            }
        }
        let mut bytes = std::fs::read(&path).unwrap();
        assert!(bytes.len() > 8192);
        // Scribble over the second page (a b-tree page).
        for b in &mut bytes[4096..4096 + 512] {
            *b = 0xa5;
        }
        std::fs::write(&path, &bytes).unwrap();
        let err = Catalog::open(&path).unwrap_err();
        assert!(matches!(err, OpenError::Corrupt { .. }), "{err}");
        assert_eq!(std::fs::read(&path).unwrap(), bytes);
    }

    #[test]
    fn a_newer_schema_or_foreign_file_is_refused_and_left_unchanged() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("catalog.db");
        drop(Catalog::open(&path).unwrap());
        {
            let conn = Connection::open(&path).unwrap();
            conn.pragma_update(None, "user_version", SCHEMA_VERSION + 1)
                .unwrap();
        }
        let before = std::fs::read(&path).unwrap();
        let err = Catalog::open(&path).unwrap_err();
        assert!(
            matches!(err, OpenError::NewerSchema { found, .. } if found == SCHEMA_VERSION + 1),
            "{err}"
        );
        assert_eq!(std::fs::read(&path).unwrap(), before);

        let other = dir.path().join("other.db");
        {
            let conn = Connection::open(&other).unwrap();
            conn.execute_batch("CREATE TABLE t (x INTEGER); INSERT INTO t VALUES (1);")
                .unwrap();
        }
        let before = std::fs::read(&other).unwrap();
        let err = Catalog::open(&other).unwrap_err();
        assert!(matches!(err, OpenError::Foreign { found: 0, .. }), "{err}");
        assert_eq!(std::fs::read(&other).unwrap(), before);
    }
}
