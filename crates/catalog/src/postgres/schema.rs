//! The catalog's PostgreSQL schema: the tables of each version and the
//! open transaction that creates, migrates or refuses them and bumps the epoch.

use std::path::PathBuf;

use lockstep_pg::tokio_postgres::Client;

use crate::{OpenError, APPLICATION_ID, SCHEMA_VERSION};

/// The tables of schema version 1.
const SCHEMA: &str = "
CREATE TABLE catalog_meta (
    key   TEXT PRIMARY KEY,
    value BIGINT NOT NULL
);
INSERT INTO catalog_meta (key, value) VALUES ('epoch', 0), ('next_replica_id', 1), ('next_dataflow_id', 1);
CREATE TABLE catalog_replicas (
    id                  BIGINT PRIMARY KEY,
    name                TEXT NOT NULL UNIQUE,
    processes           INTEGER NOT NULL,
    workers_per_process INTEGER NOT NULL,
    config              TEXT NOT NULL
);
CREATE TABLE catalog_dataflows (
    id          BIGINT PRIMARY KEY,
    replica_id  BIGINT NOT NULL REFERENCES catalog_replicas (id) ON DELETE CASCADE,
    description BYTEA NOT NULL
);
CREATE TABLE catalog_input_writes (
    seq           BIGSERIAL PRIMARY KEY,
    replica_id    BIGINT NOT NULL REFERENCES catalog_replicas (id) ON DELETE CASCADE,
    collection_id BIGINT NOT NULL,
    write         BYTEA NOT NULL
);
";

/// Version 2 adds the policies in force (set at run time).
const SCHEMA_V2: &str = "
CREATE TABLE IF NOT EXISTS catalog_policies (
    kind   TEXT PRIMARY KEY,
    name   TEXT NOT NULL,
    wasm   BYTEA NOT NULL,
    set_at BIGINT NOT NULL
);
";

/// Version 3 adds per-replica policies, which go with their replica.
const SCHEMA_V3: &str = "
CREATE TABLE IF NOT EXISTS catalog_replica_policies (
    replica_id BIGINT NOT NULL REFERENCES catalog_replicas (id) ON DELETE CASCADE,
    kind       TEXT NOT NULL,
    name       TEXT NOT NULL,
    wasm       BYTEA NOT NULL,
    set_at     BIGINT NOT NULL,
    PRIMARY KEY (replica_id, kind)
);
";

/// Version 4 adds the environment's settings (the dataflow format its
/// replicas build, under `format`).
const SCHEMA_V4: &str = "
CREATE TABLE IF NOT EXISTS catalog_settings (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
";

/// The open transaction: schema check, creation or migration, epoch bump.
pub(super) async fn open_transaction(c: &Client, path: PathBuf) -> Result<u64, OpenError> {
    let pg = |source: lockstep_pg::tokio_postgres::Error| OpenError::Postgres {
        location: path.display().to_string(),
        source: source.into(),
    };
    c.batch_execute("BEGIN").await.map_err(pg)?;
    let out = async {
        // Serialize first opens: CREATE TABLE IF NOT EXISTS races otherwise.
        c.execute(
            "SELECT pg_advisory_xact_lock($1)",
            &[&i64::from(APPLICATION_ID)],
        )
        .await
        .map_err(pg)?;
        c.batch_execute(
            "CREATE TABLE IF NOT EXISTS lockstep_schema (\
                 component TEXT PRIMARY KEY, version INTEGER NOT NULL)",
        )
        .await
        .map_err(pg)?;
        let version: Option<i32> = c
            .query_opt(
                "SELECT version FROM lockstep_schema WHERE component = 'catalog'",
                &[],
            )
            .await
            .map_err(pg)?
            .map(|r| r.get(0));
        match version {
            None => {
                let leftover: Option<String> = c
                    .query_one("SELECT to_regclass('catalog_meta')::text", &[])
                    .await
                    .map_err(pg)?
                    .get(0);
                if leftover.is_some() {
                    return Err(OpenError::Corrupt {
                        path: path.clone(),
                        reason: "catalog tables without a schema version in lockstep_schema".into(),
                    });
                }
                c.batch_execute(SCHEMA).await.map_err(pg)?;
                c.batch_execute(SCHEMA_V2).await.map_err(pg)?;
                c.batch_execute(SCHEMA_V3).await.map_err(pg)?;
                c.batch_execute(SCHEMA_V4).await.map_err(pg)?;
                c.execute(
                    "INSERT INTO lockstep_schema (component, version) VALUES ('catalog', $1)",
                    &[&SCHEMA_VERSION],
                )
                .await
                .map_err(pg)?;
            }
            Some(found) if found > SCHEMA_VERSION => {
                return Err(OpenError::NewerSchema {
                    path: path.clone(),
                    found,
                })
            }
            Some(found) if found < 1 => {
                return Err(OpenError::Corrupt {
                    path: path.clone(),
                    reason: format!("schema version {found}"),
                })
            }
            Some(found) => {
                if found < 2 {
                    c.batch_execute(SCHEMA_V2).await.map_err(pg)?;
                }
                if found < 3 {
                    c.batch_execute(SCHEMA_V3).await.map_err(pg)?;
                }
                if found < 4 {
                    c.batch_execute(SCHEMA_V4).await.map_err(pg)?;
                }
                if found < SCHEMA_VERSION {
                    c.execute(
                        "UPDATE lockstep_schema SET version = $1 WHERE component = 'catalog'",
                        &[&SCHEMA_VERSION],
                    )
                    .await
                    .map_err(pg)?;
                }
            }
        }
        let epoch: i64 = c
            .query_one(
                "UPDATE catalog_meta SET value = value + 1 WHERE key = 'epoch' RETURNING value",
                &[],
            )
            .await
            .map_err(pg)?
            .get(0);
        Ok(epoch as u64)
    }
    .await;
    match out {
        Ok(epoch) => {
            c.batch_execute("COMMIT").await.map_err(pg)?;
            Ok(epoch)
        }
        Err(e) => {
            let _ = c.batch_execute("ROLLBACK").await;
            Err(e)
        }
    }
}
