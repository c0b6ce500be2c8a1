//! The PostgreSQL backend: the catalog's tables (`catalog_*`) in one
//! database, reached with tokio-postgres through [`lockstep_pg::Conn`].
//!
//! - **Schema.** The table `lockstep_schema (component, version)` holds the
//!   schema version of each component sharing the database (`catalog` here;
//!   the command log keeps its own row). Opening takes a transaction-scoped
//!   advisory lock, so concurrent first opens do not race to create the
//!   tables, then creates the schema (absent), migrates it (older) or
//!   refuses it (newer: [`OpenError::NewerSchema`], nothing changed), and
//!   bumps the epoch, all in one transaction.
//! - **Fencing.** Every write runs in one transaction that starts with
//!   `SELECT … FROM catalog_meta WHERE key = 'epoch' FOR UPDATE`. The epoch
//!   bump of a newer opener updates that row, so it waits for a running
//!   write and every later write sees the new epoch and fails with
//!   [`Fenced`]. Holding that row lock also serializes the writers, as
//!   SQLite's `BEGIN IMMEDIATE` does. BEGIN and the lock go out together
//!   (one round trip, the lock's statement prepared once per connection);
//!   an input write, which every WriteInput pays, is one round trip in all
//!   (see `PgCatalog::append_input`).
//! - **Failures.** A write whose connection breaks returns
//!   [`WriteError::Postgres`]; it either committed entirely or not at all
//!   (a reopened catalog tells which). The next call reconnects.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use lockstep_pg::tokio_postgres::types::{ToSql, Type};
use lockstep_pg::tokio_postgres::{Client, IsolationLevel};
use lockstep_pg::{BoxFuture, Conn, Options, PgError, Session};

use crate::{
    CatalogState, Dataflow, Fenced, InputWrite, OpenError, ReadError, Replica, ReplicaConfig,
    StoredPolicy, WriteError,
};

mod replicas;
mod schema;
mod settings;

use schema::open_transaction;

/// An open PostgreSQL catalog, owning the epoch it bumped when it was opened.
#[derive(Debug)]
pub(crate) struct PgCatalog {
    conn: Conn,
    location: PathBuf,
    epoch: u64,
}

impl PgCatalog {
    /// Connects, creates or migrates the schema, and bumps the epoch.
    pub(crate) fn open(url: &str) -> Result<PgCatalog, OpenError> {
        let redacted = lockstep_pg::redact(url);
        let postgres = |source| OpenError::Postgres {
            location: redacted.clone(),
            source,
        };
        let conn = Conn::connect(
            url,
            Options {
                application_name: "lockstep-catalog".into(),
                ..Options::default()
            },
        )
        .map_err(postgres)?;
        let location = PathBuf::from(conn.location());
        let path = location.clone();
        let epoch = conn
            .run(move |s: &mut Session| {
                Box::pin(async move { Ok::<_, PgError>(open_transaction(&s.client, path).await) })
            })
            .map_err(postgres)??;
        Ok(PgCatalog {
            conn,
            location,
            epoch,
        })
    }

    /// The epoch this handle owns.
    pub(crate) fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The redacted connection string.
    pub(crate) fn path(&self) -> &Path {
        &self.location
    }

    /// Reads everything in one (repeatable-read, read-only) transaction.
    pub(crate) fn state(&mut self) -> Result<CatalogState, ReadError> {
        self.conn.run(|s: &mut Session| {
            Box::pin(async move {
                let tx = s
                    .client
                    .build_transaction()
                    .isolation_level(IsolationLevel::RepeatableRead)
                    .read_only(true)
                    .start()
                    .await?;
                let mut meta = BTreeMap::new();
                for row in tx.query("SELECT key, value FROM catalog_meta", &[]).await? {
                    meta.insert(row.get::<_, String>(0), row.get::<_, i64>(1) as u64);
                }
                let meta = |key: &str| meta.get(key).copied().unwrap_or(0);
                let mut replicas = BTreeMap::new();
                for r in tx
                    .query(
                        "SELECT id, name, processes, workers_per_process, config \
                         FROM catalog_replicas ORDER BY id",
                        &[],
                    )
                    .await?
                {
                    let replica = Replica {
                        id: r.get::<_, i64>(0) as u64,
                        name: r.get(1),
                        config: ReplicaConfig {
                            processes: r.get::<_, i32>(2) as u32,
                            workers_per_process: r.get::<_, i32>(3) as u32,
                            config: r.get(4),
                        },
                    };
                    replicas.insert(replica.id, replica);
                }
                let mut dataflows = BTreeMap::new();
                for r in tx
                    .query(
                        "SELECT id, replica_id, description FROM catalog_dataflows ORDER BY id",
                        &[],
                    )
                    .await?
                {
                    let dataflow = Dataflow {
                        id: r.get::<_, i64>(0) as u64,
                        replica_id: r.get::<_, i64>(1) as u64,
                        description: r.get(2),
                    };
                    dataflows.insert(dataflow.id, dataflow);
                }
                let input_writes = tx
                    .query(
                        "SELECT seq, replica_id, collection_id, write \
                         FROM catalog_input_writes ORDER BY seq",
                        &[],
                    )
                    .await?
                    .into_iter()
                    .map(|r| InputWrite {
                        seq: r.get::<_, i64>(0) as u64,
                        replica_id: r.get::<_, i64>(1) as u64,
                        collection_id: r.get::<_, i64>(2) as u64,
                        write: r.get(3),
                    })
                    .collect();
                tx.commit().await?;
                Ok(CatalogState {
                    epoch: meta("epoch"),
                    next_replica_id: meta("next_replica_id"),
                    next_dataflow_id: meta("next_dataflow_id"),
                    replicas,
                    dataflows,
                    input_writes,
                })
            })
        })
    }

    /// Checks the fence without writing.
    pub(crate) fn check_fence(&mut self) -> Result<(), WriteError> {
        self.write(|_| Box::pin(async { Ok(()) }))
    }

    /// Records a dataflow, allocating its ID and passing it to `describe`.
    ///
    /// `describe` runs on the caller's thread while the transaction is open
    /// on the connection thread: the first step checks the fence and
    /// allocates the ID, the second stores the description and commits. If
    /// the connection was replaced in between, nothing was committed.
    pub(crate) fn create_dataflow_with(
        &mut self,
        replica_id: u64,
        describe: impl FnOnce(u64) -> Vec<u8>,
    ) -> Result<Dataflow, WriteError> {
        let epoch = self.epoch;
        let (id, generation) = self.conn.run(move |s: &mut Session| {
            Box::pin(async move {
                let generation = s.generation;
                let c = &s.client;
                c.batch_execute("BEGIN").await?;
                let step = async {
                    fence(c, epoch).await?;
                    replica_exists(c, replica_id).await?;
                    allocate(c, "next_dataflow_id").await
                }
                .await;
                match step {
                    Ok(id) => Ok((id, generation)),
                    Err(e) => {
                        let _ = c.batch_execute("ROLLBACK").await;
                        Err(e)
                    }
                }
            })
        })?;
        // Roll back if `describe` panics.
        struct Open<'a>(Option<&'a Conn>);
        impl Drop for Open<'_> {
            fn drop(&mut self) {
                if let Some(conn) = self.0 {
                    let _ = conn.run(|s: &mut Session| {
                        Box::pin(async move {
                            s.client.batch_execute("ROLLBACK").await?;
                            Ok::<_, WriteError>(())
                        })
                    });
                }
            }
        }
        let mut open = Open(Some(&self.conn));
        let description = describe(id);
        open.0 = None;
        let stored = description.clone();
        self.conn.run(move |s: &mut Session| {
            Box::pin(async move {
                if s.generation != generation {
                    return Err(WriteError::Postgres(PgError::Reconnected(
                        "the catalog".into(),
                    )));
                }
                let c = &s.client;
                let step = c
                    .execute(
                        "INSERT INTO catalog_dataflows (id, replica_id, description) VALUES ($1, $2, $3)",
                        &[&(id as i64), &(replica_id as i64), &stored],
                    )
                    .await;
                if let Err(e) = step {
                    let _ = c.batch_execute("ROLLBACK").await;
                    return Err(e.into());
                }
                c.batch_execute("COMMIT").await?;
                Ok(())
            })
        })?;
        Ok(Dataflow {
            id,
            replica_id,
            description,
        })
    }

    /// Records a write to an input collection, in one round trip (every
    /// WriteInput pays it): BEGIN, the fence lock, an insert that checks the
    /// epoch and the replica itself, and COMMIT go out pipelined. The insert
    /// is a statement of its own after the lock, so it sees every write
    /// committed before (and a newer opener's epoch); when it inserts
    /// nothing, the fence row's epoch says whether this catalog was fenced
    /// out or the replica is missing.
    ///
    /// Several writes (a group commit) go in one fenced transaction of a
    /// round trip per statement: every replica checked, every write
    /// inserted, one COMMIT.
    pub(crate) fn append_inputs(
        &mut self,
        writes: &[(u64, u64, &[u8])],
    ) -> Result<Vec<u64>, WriteError> {
        if let [(replica_id, collection_id, write)] = writes {
            return Ok(vec![self.append_input(
                *replica_id,
                *collection_id,
                write,
            )?]);
        }
        let writes: Vec<(u64, u64, Vec<u8>)> = writes
            .iter()
            .map(|(r, c, w)| (*r, *c, w.to_vec()))
            .collect();
        self.write(move |c| {
            Box::pin(async move {
                let mut seqs = Vec::with_capacity(writes.len());
                let mut known = std::collections::BTreeSet::new();
                for (replica_id, collection_id, write) in writes {
                    if known.insert(replica_id) {
                        replica_exists(c, replica_id).await?;
                    }
                    seqs.push(insert_input(c, replica_id, collection_id, write).await?.seq);
                }
                Ok(seqs)
            })
        })
    }

    /// One write, pipelined: its position.
    fn append_input(
        &mut self,
        replica_id: u64,
        collection_id: u64,
        write: &[u8],
    ) -> Result<u64, WriteError> {
        let epoch = self.epoch;
        let write = write.to_vec();
        self.conn.run(move |s: &mut Session| {
            Box::pin(async move {
                let lock = s.prepare_cached(FENCE, &[]).await?;
                let insert = s
                    .prepare_cached(
                        INSERT_INPUT,
                        &[Type::INT8, Type::INT8, Type::BYTEA, Type::INT8],
                    )
                    .await?;
                let c = &s.client;
                let params: [&(dyn ToSql + Sync); 4] = [
                    &(replica_id as i64),
                    &(collection_id as i64),
                    &write,
                    &(epoch as i64),
                ];
                let (current, inserted) = lockstep_pg::pipelined_transaction(
                    c,
                    c.query_one(&lock, &[]),
                    c.query_opt(&insert, &params),
                )
                .await?;
                check_fence(current.get(0), epoch)?;
                match inserted {
                    Some(row) => Ok(row.get::<_, i64>(0) as u64),
                    None => Err(WriteError::NoSuchReplica(format!("with ID {replica_id}"))),
                }
            })
        })
    }

    /// Replaces every stored write to an input collection with `write`.
    pub(crate) fn replace_inputs(
        &mut self,
        replica_id: u64,
        collection_id: u64,
        write: &[u8],
    ) -> Result<InputWrite, WriteError> {
        let write = write.to_vec();
        self.write(move |c| {
            Box::pin(async move {
                replica_exists(c, replica_id).await?;
                c.execute(
                    "DELETE FROM catalog_input_writes WHERE replica_id = $1 AND collection_id = $2",
                    &[&(replica_id as i64), &(collection_id as i64)],
                )
                .await?;
                insert_input(c, replica_id, collection_id, write).await
            })
        })
    }

    /// Records `policy` as the one in force for its kind.
    pub(crate) fn set_policy(&mut self, policy: &StoredPolicy) -> Result<(), WriteError> {
        let policy = policy.clone();
        self.write(move |c| {
            Box::pin(async move {
                c.execute(
                    "INSERT INTO catalog_policies (kind, name, wasm, set_at) VALUES ($1, $2, $3, $4) \
                     ON CONFLICT (kind) DO UPDATE SET name = $2, wasm = $3, set_at = $4",
                    &[&policy.kind, &policy.name, &policy.wasm, &(policy.set_at as i64)],
                )
                .await?;
                Ok(())
            })
        })
    }

    /// The policies set at run time, by kind.
    pub(crate) fn policies(&mut self) -> Result<Vec<StoredPolicy>, ReadError> {
        self.conn.run(|s: &mut Session| {
            Box::pin(async move {
                let rows = s
                    .client
                    .query(
                        "SELECT kind, name, wasm, set_at FROM catalog_policies ORDER BY kind",
                        &[],
                    )
                    .await?;
                Ok(rows
                    .into_iter()
                    .map(|r| StoredPolicy {
                        kind: r.get(0),
                        name: r.get(1),
                        wasm: r.get(2),
                        set_at: r.get::<_, i64>(3) as u64,
                    })
                    .collect())
            })
        })
    }

    /// Records `policy` as the one in force for its kind on one replica.
    pub(crate) fn set_replica_policy(
        &mut self,
        replica_id: u64,
        policy: &StoredPolicy,
    ) -> Result<(), WriteError> {
        let policy = policy.clone();
        self.write(move |c| {
            Box::pin(async move {
                let known: bool = c
                    .query_one(
                        "SELECT EXISTS (SELECT 1 FROM catalog_replicas WHERE id = $1)",
                        &[&(replica_id as i64)],
                    )
                    .await?
                    .get(0);
                if !known {
                    return Err(WriteError::NoSuchReplica(replica_id.to_string()));
                }
                c.execute(
                    "INSERT INTO catalog_replica_policies (replica_id, kind, name, wasm, set_at) \
                     VALUES ($1, $2, $3, $4, $5) \
                     ON CONFLICT (replica_id, kind) DO UPDATE SET name = $3, wasm = $4, set_at = $5",
                    &[
                        &(replica_id as i64),
                        &policy.kind,
                        &policy.name,
                        &policy.wasm,
                        &(policy.set_at as i64),
                    ],
                )
                .await?;
                Ok(())
            })
        })
    }

    /// The per-replica policies, by replica ID and kind.
    pub(crate) fn replica_policies(&mut self) -> Result<Vec<(u64, StoredPolicy)>, ReadError> {
        self.conn.run(|s: &mut Session| {
            Box::pin(async move {
                let rows = s
                    .client
                    .query(
                        "SELECT replica_id, kind, name, wasm, set_at FROM catalog_replica_policies \
                         ORDER BY replica_id, kind",
                        &[],
                    )
                    .await?;
                Ok(rows
                    .into_iter()
                    .map(|r| {
                        (
                            r.get::<_, i64>(0) as u64,
                            StoredPolicy {
                                kind: r.get(1),
                                name: r.get(2),
                                wasm: r.get(3),
                                set_at: r.get::<_, i64>(4) as u64,
                            },
                        )
                    })
                    .collect())
            })
        })
    }

    /// Drops a dataflow.
    pub(crate) fn drop_dataflow(&mut self, id: u64) -> Result<(), WriteError> {
        self.write(move |c| {
            Box::pin(async move {
                let n = c
                    .execute(
                        "DELETE FROM catalog_dataflows WHERE id = $1",
                        &[&(id as i64)],
                    )
                    .await?;
                if n == 0 {
                    return Err(WriteError::NoSuchDataflow(id));
                }
                Ok(())
            })
        })
    }

    /// Runs `f` in one transaction that first locks the epoch row and checks
    /// the fence; commits only if `f` succeeds.
    fn write<T, F>(&mut self, f: F) -> Result<T, WriteError>
    where
        T: Send + 'static,
        F: for<'c> FnOnce(&'c Client) -> BoxFuture<'c, Result<T, WriteError>> + Send + 'static,
    {
        let epoch = self.epoch;
        self.conn.run(move |s: &mut Session| {
            Box::pin(async move {
                let lock = s.prepare_cached(FENCE, &[]).await?;
                let c = &s.client;
                // BEGIN and the fence lock in one round trip.
                let (begin, current) =
                    futures::join!(c.batch_execute("BEGIN"), c.query_one(&lock, &[]));
                let out = async {
                    begin?;
                    check_fence(current?.get(0), epoch)?;
                    f(c).await
                }
                .await;
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
            })
        })
    }
}

/// Locks the epoch row until the transaction ends; returns its value.
const FENCE: &str = "SELECT value FROM catalog_meta WHERE key = 'epoch' FOR UPDATE";

/// Inserts an input write, run after [`FENCE`]: `$1` replica, `$2`
/// collection, `$3` the write, `$4` this catalog's epoch. Inserts nothing
/// (returns no row) if the epoch is not `$4` or the replica is missing.
const INSERT_INPUT: &str = "INSERT INTO catalog_input_writes (replica_id, collection_id, write) \
     SELECT $1, $2, $3 \
     WHERE (SELECT value FROM catalog_meta WHERE key = 'epoch') = $4 \
       AND EXISTS (SELECT 1 FROM catalog_replicas WHERE id = $1) \
     RETURNING seq";

/// Locks the epoch row and fails with [`Fenced`] unless it is still ours.
async fn fence(c: &Client, epoch: u64) -> Result<(), WriteError> {
    check_fence(c.query_one(FENCE, &[]).await?.get(0), epoch)
}

/// Fails with [`Fenced`] unless the stored epoch `current` is `epoch`.
fn check_fence(current: i64, epoch: u64) -> Result<(), WriteError> {
    let current = current as u64;
    if current != epoch {
        return Err(Fenced {
            ours: epoch,
            current,
        }
        .into());
    }
    Ok(())
}

/// Fails with `NoSuchReplica` unless the replica is in the catalog.
async fn replica_exists(c: &Client, replica_id: u64) -> Result<(), WriteError> {
    match c
        .query_typed(
            "SELECT id FROM catalog_replicas WHERE id = $1",
            &[(&(replica_id as i64), Type::INT8)],
        )
        .await?
        .first()
    {
        Some(_) => Ok(()),
        None => Err(WriteError::NoSuchReplica(format!("with ID {replica_id}"))),
    }
}

/// Takes the next value of a monotonic allocator.
async fn allocate(c: &Client, key: &str) -> Result<u64, WriteError> {
    let next: i64 = c
        .query_one(
            "UPDATE catalog_meta SET value = value + 1 WHERE key = $1 RETURNING value",
            &[&key],
        )
        .await?
        .get(0);
    Ok(next as u64 - 1)
}

/// Appends one input write row; returns it with its position.
async fn insert_input(
    c: &Client,
    replica_id: u64,
    collection_id: u64,
    write: Vec<u8>,
) -> Result<InputWrite, WriteError> {
    let seq: i64 = c
        .query_one(
            "INSERT INTO catalog_input_writes (replica_id, collection_id, write) \
             VALUES ($1, $2, $3) RETURNING seq",
            &[&(replica_id as i64), &(collection_id as i64), &write],
        )
        .await?
        .get(0);
    Ok(InputWrite {
        seq: seq as u64,
        replica_id,
        collection_id,
        write,
    })
}
