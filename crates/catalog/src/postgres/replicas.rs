//! A PostgreSQL catalog's replicas: created, resized, dropped (with their
//! dataflows and inputs), each one fenced write.

use lockstep_pg::tokio_postgres::Client;

use super::{allocate, PgCatalog};
use crate::{check_replica, Replica, ReplicaConfig, WriteError};

impl PgCatalog {
    /// Creates a replica, allocating its ID.
    pub(crate) fn create_replica(
        &mut self,
        name: &str,
        config: ReplicaConfig,
    ) -> Result<Replica, WriteError> {
        check_replica(name, &config).map_err(WriteError::Invalid)?;
        let name = name.to_string();
        self.write(move |c| {
            Box::pin(async move {
                let taken = c
                    .query_opt("SELECT id FROM catalog_replicas WHERE name = $1", &[&name])
                    .await?;
                if taken.is_some() {
                    return Err(WriteError::ReplicaExists(name));
                }
                let id = allocate(c, "next_replica_id").await?;
                c.execute(
                    "INSERT INTO catalog_replicas (id, name, processes, workers_per_process, config) \
                     VALUES ($1, $2, $3, $4, $5)",
                    &[
                        &(id as i64),
                        &name,
                        &(config.processes as i32),
                        &(config.workers_per_process as i32),
                        &config.config,
                    ],
                )
                .await?;
                Ok(Replica { id, name, config })
            })
        })
    }

    /// See [`crate::Catalog::resize_replica`].
    pub(crate) fn resize_replica(
        &mut self,
        name: &str,
        processes: u32,
        workers_per_process: u32,
    ) -> Result<Replica, WriteError> {
        let name = name.to_string();
        self.write(move |c| {
            Box::pin(async move {
                let mut replica = replica_named(c, name).await?;
                replica.config.processes = processes;
                replica.config.workers_per_process = workers_per_process;
                check_replica(&replica.name, &replica.config).map_err(WriteError::Invalid)?;
                c.execute(
                    "UPDATE catalog_replicas SET processes = $1, workers_per_process = $2 \
                     WHERE id = $3",
                    &[
                        &(processes as i32),
                        &(workers_per_process as i32),
                        &(replica.id as i64),
                    ],
                )
                .await?;
                Ok(replica)
            })
        })
    }

    /// Drops the replica with this name, and its dataflows and inputs.
    pub(crate) fn drop_replica(&mut self, name: &str) -> Result<Replica, WriteError> {
        if name.is_empty() {
            return Err(WriteError::Invalid("a replica needs a name".into()));
        }
        let name = name.to_string();
        self.write(move |c| {
            Box::pin(async move {
                let replica = replica_named(c, name).await?;
                let id = replica.id as i64;
                c.execute(
                    "DELETE FROM catalog_dataflows WHERE replica_id = $1",
                    &[&id],
                )
                .await?;
                c.execute(
                    "DELETE FROM catalog_input_writes WHERE replica_id = $1",
                    &[&id],
                )
                .await?;
                c.execute("DELETE FROM catalog_replicas WHERE id = $1", &[&id])
                    .await?;
                Ok(replica)
            })
        })
    }
}

/// The replica named `name`, read on `c` (in the write's transaction).
async fn replica_named(c: &Client, name: String) -> Result<Replica, WriteError> {
    let row = c
        .query_opt(
            "SELECT id, processes, workers_per_process, config \
             FROM catalog_replicas WHERE name = $1",
            &[&name],
        )
        .await?
        .ok_or_else(|| WriteError::NoSuchReplica(name.clone()))?;
    Ok(Replica {
        id: row.get::<_, i64>(0) as u64,
        name,
        config: ReplicaConfig {
            processes: row.get::<_, i32>(1) as u32,
            workers_per_process: row.get::<_, i32>(2) as u32,
            config: row.get(3),
        },
    })
}
