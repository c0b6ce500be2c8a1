//! lockstep's durable, fenced catalog.
//!
//! The catalog is the controller's (the "environment's") truth about what
//! should exist: replicas with their shape and configuration, and the
//! dataflows installed on them. It lives in a [`Store`]: by default one
//! SQLite file in the state directory (rusqlite, bundled) so the embedded
//! default needs no server, or a PostgreSQL database (tokio-postgres), so
//! that an environment can fail over to another machine. [`Catalog`] is one
//! API over both; the backends are `sqlite.rs` and `postgres/`, and
//! [`Catalog`] dispatches to them in one place.
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
//!   transaction (SQLite: `BEGIN IMMEDIATE`; PostgreSQL: the epoch row read
//!   `FOR UPDATE`, which the opener's bump also locks), so no newer opener
//!   can slip in between.
//! - **Monotonic IDs.** Replica IDs and dataflow IDs come from two allocators
//!   that only ever grow and are never reused, even after a drop. The orphan
//!   rule `id-watermark` relies on it: a service whose ID is at or above our
//!   next replica ID was created by a controller that opened after us.
//!
//! A SQLite file is validated before anything writes to it: it is first opened
//! read-only and must carry lockstep's SQLite `application_id` and a schema
//! version (`user_version`) this build understands. A file that is not a
//! SQLite database, is corrupt, belongs to another application or was written
//! by a newer lockstep is refused with [`OpenError`] and left byte-for-byte
//! unchanged. A PostgreSQL catalog keeps its schema version in the table
//! `lockstep_schema` (row `catalog`); the open transaction creates or
//! migrates the schema, and refuses a newer version without changing
//! anything. See `docs/stores.md`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

mod checkpoint;
mod postgres;
mod sqlite;

use postgres::PgCatalog;
use sqlite::SqliteCatalog;

/// SQLite `application_id` of a lockstep catalog ("LKST").
pub const APPLICATION_ID: i32 = 0x4c4b_5354;

/// The schema version this build writes and understands (both backends).
///
/// Version 4 added the table of environment settings (`settings`;
/// PostgreSQL `catalog_settings`), which records the dataflow format the
/// environment's replicas build ([`Catalog::format`]).
pub const SCHEMA_VERSION: i32 = 4;

/// The settings key of the environment's dataflow format.
const FORMAT_SETTING: &str = "format";

/// Why a catalog could not be opened. In every case the store was not
/// modified. For a PostgreSQL store, `path` holds the redacted connection
/// string (`postgres://user@host:port/db`).
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
    /// The PostgreSQL store could not be reached, or failed while opening.
    #[error("cannot open catalog {location}: {source}")]
    Postgres {
        /// The server and database (without the password).
        location: String,
        /// What went wrong.
        source: lockstep_pg::PgError,
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
    /// PostgreSQL failed, or the connection broke (then the write may or
    /// may not have committed; a reopened catalog tells).
    #[error("catalog write failed: {0}")]
    Postgres(#[from] lockstep_pg::PgError),
}

impl From<lockstep_pg::tokio_postgres::Error> for WriteError {
    fn from(e: lockstep_pg::tokio_postgres::Error) -> Self {
        WriteError::Postgres(e.into())
    }
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
pub struct ReadError(#[source] ReadErrorKind);

#[derive(Debug, thiserror::Error)]
enum ReadErrorKind {
    #[error(transparent)]
    Sqlite(rusqlite::Error),
    #[error(transparent)]
    Postgres(lockstep_pg::PgError),
}

impl From<rusqlite::Error> for ReadError {
    fn from(e: rusqlite::Error) -> Self {
        ReadError(ReadErrorKind::Sqlite(e))
    }
}

impl From<lockstep_pg::PgError> for ReadError {
    fn from(e: lockstep_pg::PgError) -> Self {
        ReadError(ReadErrorKind::Postgres(e))
    }
}

impl From<lockstep_pg::tokio_postgres::Error> for ReadError {
    fn from(e: lockstep_pg::tokio_postgres::Error) -> Self {
        ReadError(ReadErrorKind::Postgres(e.into()))
    }
}

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

/// Where a catalog lives.
#[derive(Clone, PartialEq, Eq)]
pub enum Store {
    /// A SQLite file (the embedded default: `catalog.db` in the state
    /// directory).
    Sqlite(PathBuf),
    /// A PostgreSQL database, by connection string (`postgres://…` or
    /// `postgresql://…`). Without a password in it, the one in the
    /// environment variable `PGPASSWORD` is used.
    Postgres(String),
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{self}")
    }
}

impl std::fmt::Display for Store {
    /// The store, with any password left out.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Store::Sqlite(p) => write!(f, "sqlite:{}", p.display()),
            Store::Postgres(url) => f.write_str(&lockstep_pg::redact(url)),
        }
    }
}

impl std::str::FromStr for Store {
    type Err = String;

    /// `postgres://…` or `postgresql://…` is a PostgreSQL store;
    /// `sqlite:PATH` is a SQLite file.
    fn from_str(s: &str) -> Result<Store, String> {
        if s.starts_with("postgres://") || s.starts_with("postgresql://") {
            Ok(Store::Postgres(s.to_string()))
        } else if let Some(path) = s.strip_prefix("sqlite:") {
            if path.is_empty() {
                return Err("a sqlite: store needs a path".into());
            }
            Ok(Store::Sqlite(PathBuf::from(path)))
        } else {
            Err(format!(
                "unknown store {:?}: give a postgres:// or postgresql:// connection string, or sqlite:PATH",
                if s.contains('@') { "<redacted>" } else { s }
            ))
        }
    }
}

impl Store {
    /// The store a `--store` option names, or the SQLite file
    /// `default_sqlite` (e.g. `STATE_DIR/catalog.db`) when it is omitted.
    pub fn from_arg(
        arg: Option<&str>,
        default_sqlite: impl Into<PathBuf>,
    ) -> Result<Store, String> {
        match arg {
            None => Ok(Store::Sqlite(default_sqlite.into())),
            Some(s) => s.parse(),
        }
    }
}

/// An open catalog, owning the epoch it bumped when it was opened.
///
/// A `Catalog` is `Send` but not `Sync`; share it behind a mutex. Its
/// methods are synchronous on both backends and may be called inside or
/// outside a tokio runtime (the PostgreSQL backend runs its client on a
/// thread of its own).
#[derive(Debug)]
pub struct Catalog(Backend);

#[derive(Debug)]
enum Backend {
    Sqlite(SqliteCatalog),
    Postgres(PgCatalog),
}

/// Calls the same method on whichever backend this is.
/// The settings key of a replica's reconfiguration record, before its ID.
const RECONFIGURATION_PREFIX: &str = "reconfiguration/";

macro_rules! dispatch {
    ($self:ident, $b:ident => $e:expr) => {
        match &mut $self.0 {
            Backend::Sqlite($b) => $e,
            Backend::Postgres($b) => $e,
        }
    };
}

impl Catalog {
    /// Opens (creating if absent) the SQLite catalog at `path` and bumps its
    /// epoch.
    ///
    /// An existing file is first validated read-only; see the crate docs.
    pub fn open(path: impl AsRef<Path>) -> Result<Catalog, OpenError> {
        SqliteCatalog::open(path).map(|c| Catalog(Backend::Sqlite(c)))
    }

    /// Opens (creating or migrating the schema if needed) the catalog in
    /// `store` and bumps its epoch.
    pub fn open_store(store: &Store) -> Result<Catalog, OpenError> {
        match store {
            Store::Sqlite(path) => Catalog::open(path),
            Store::Postgres(url) => PgCatalog::open(url).map(|c| Catalog(Backend::Postgres(c))),
        }
    }

    /// The epoch this handle owns.
    pub fn epoch(&self) -> u64 {
        match &self.0 {
            Backend::Sqlite(c) => c.epoch(),
            Backend::Postgres(c) => c.epoch(),
        }
    }

    /// The file this catalog lives in; for a PostgreSQL store, its redacted
    /// connection string.
    pub fn path(&self) -> &Path {
        match &self.0 {
            Backend::Sqlite(c) => c.path(),
            Backend::Postgres(c) => c.path(),
        }
    }

    /// Reads everything in one transaction. Reading is allowed even when
    /// fenced; compare [`CatalogState::epoch`] with [`Catalog::epoch`] to tell.
    pub fn state(&mut self) -> Result<CatalogState, ReadError> {
        dispatch!(self, c => c.state())
    }

    /// Checks that no newer controller has opened the catalog, without writing.
    pub fn check_fence(&mut self) -> Result<(), WriteError> {
        dispatch!(self, c => c.check_fence())
    }

    /// Creates a replica, allocating its ID.
    pub fn create_replica(
        &mut self,
        name: &str,
        config: ReplicaConfig,
    ) -> Result<Replica, WriteError> {
        dispatch!(self, c => c.create_replica(name, config))
    }

    /// Drops the replica with this name, and its dataflows.
    pub fn drop_replica(&mut self, name: &str) -> Result<Replica, WriteError> {
        dispatch!(self, c => c.drop_replica(name))
    }

    /// Gives the replica with this name `processes` processes of
    /// `workers_per_process` workers each (its dataflows and inputs stay);
    /// returns it as it is now. The shape is checked as at creation.
    pub fn resize_replica(
        &mut self,
        name: &str,
        processes: u32,
        workers_per_process: u32,
    ) -> Result<Replica, WriteError> {
        dispatch!(self, c => c.resize_replica(name, processes, workers_per_process))
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
        dispatch!(self, c => c.create_dataflow_with(replica_id, describe))
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
        let seq = self.append_inputs(&[(replica_id, collection_id, write)])?[0];
        Ok(InputWrite {
            seq,
            replica_id,
            collection_id,
            write: write.to_vec(),
        })
    }

    /// Appends several writes (each `(replica, collection, write)`) in one
    /// fenced transaction, one commit and one flush for them all (group
    /// commit): every one is stored, in order, or none is (a replica
    /// missing fails the whole group with `NoSuchReplica`). Returns their
    /// positions, in order.
    pub fn append_inputs(&mut self, writes: &[(u64, u64, &[u8])]) -> Result<Vec<u64>, WriteError> {
        dispatch!(self, c => c.append_inputs(writes))
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
        dispatch!(self, c => c.replace_inputs(replica_id, collection_id, write))
    }

    /// Records `policy` as the one in force for its kind (replacing any).
    pub fn set_policy(&mut self, policy: &StoredPolicy) -> Result<(), WriteError> {
        dispatch!(self, c => c.set_policy(policy))
    }

    /// The policies set at run time, by kind.
    pub fn policies(&mut self) -> Result<Vec<StoredPolicy>, ReadError> {
        dispatch!(self, c => c.policies())
    }

    /// Records `policy` as the one in force for its kind on replica
    /// `replica_id` alone (replacing any), over the environment-wide one. It
    /// goes with the replica.
    pub fn set_replica_policy(
        &mut self,
        replica_id: u64,
        policy: &StoredPolicy,
    ) -> Result<(), WriteError> {
        dispatch!(self, c => c.set_replica_policy(replica_id, policy))
    }

    /// The per-replica policies set at run time, by replica ID and kind.
    pub fn replica_policies(&mut self) -> Result<Vec<(u64, StoredPolicy)>, ReadError> {
        dispatch!(self, c => c.replica_policies())
    }

    /// The dataflow format (family) the environment's replicas build, as
    /// recorded by [`record_format`](Self::record_format); `None` if it
    /// never was (a new catalog, or one migrated from schema version 3 or
    /// older). One per environment: the replica program is environment-wide.
    pub fn format(&mut self) -> Result<Option<String>, ReadError> {
        dispatch!(self, c => c.setting(FORMAT_SETTING))
    }

    /// Records the dataflow format the environment's replicas build
    /// (replacing any), fenced like every write. The environment records
    /// it at its first start and refuses later starts that ask for another.
    pub fn record_format(&mut self, format: &str) -> Result<(), WriteError> {
        if format.is_empty() {
            return Err(WriteError::Invalid("a dataflow format needs a name".into()));
        }
        dispatch!(self, c => c.set_setting(FORMAT_SETTING, format))
    }

    /// Drops a dataflow.
    pub fn drop_dataflow(&mut self, id: u64) -> Result<(), WriteError> {
        dispatch!(self, c => c.drop_dataflow(id))
    }

    /// Records what replica `replica_id`'s reconfiguration under way is
    /// (an opaque text the environment writes; `None`: none, the record
    /// removed), fenced like every write.
    pub fn record_reconfiguration(
        &mut self,
        replica_id: u64,
        record: Option<&str>,
    ) -> Result<(), WriteError> {
        let key = format!("{RECONFIGURATION_PREFIX}{replica_id}");
        match record {
            Some(r) => dispatch!(self, c => c.set_setting(&key, r)),
            None => dispatch!(self, c => c.clear_setting(&key)),
        }
    }

    /// Every reconfiguration record, by replica ID.
    pub fn reconfigurations(&mut self) -> Result<Vec<(u64, String)>, ReadError> {
        let rows = dispatch!(self, c => c.settings_under(RECONFIGURATION_PREFIX))?;
        Ok(rows
            .into_iter()
            .filter_map(|(k, v)| {
                let id = k.strip_prefix(RECONFIGURATION_PREFIX)?.parse().ok()?;
                Some((id, v))
            })
            .collect())
    }

    /// The SQLite connection (tests that doctor the file).
    #[cfg(test)]
    fn sqlite_conn(&self) -> &rusqlite::Connection {
        match &self.0 {
            Backend::Sqlite(c) => &c.conn,
            Backend::Postgres(_) => panic!("not a SQLite catalog"),
        }
    }
}

#[cfg(test)]
mod tests;
