//! The catalog's write latency on both stores, side by side in one run:
//! SQLite in a temporary directory (the embedded default) and PostgreSQL on
//! a throw-away server on this machine (`lockstep-pgtest`; skipped, and
//! recorded in `$LOCKSTEP_BENCH_SKIPS`, if the binaries are missing).
//!
//! - `stores/catalog_append_input/{sqlite,postgres}`: one fenced write of a
//!   100-row input batch, durable when it returns (what every WriteInput
//!   pays before it is sent to a replica);
//! - `stores/catalog_create_dataflow/{sqlite,postgres}`: one fenced
//!   dataflow record (what every CreateDataflow pays).
//!
//! `cargo xtask bench` compares each PostgreSQL figure with SQLite's. The
//! command log on both stores is measured through real replicas in the
//! `strategies` bench (`log` against `log@postgres`).

#![allow(missing_docs)] // criterion_group! generates undocumented functions

use criterion::{criterion_group, criterion_main, Criterion};
use lockstep_catalog::{Catalog, ReplicaConfig, Store};

/// A 100-row input write as the environment stores it (encoded updates).
fn batch() -> Vec<u8> {
    lockstep_benches::rows(100)
        .iter()
        .flat_map(|u| {
            u.row
                .iter()
                .chain([u.time as i64, u.diff].iter())
                .flat_map(|v| v.to_le_bytes())
                .collect::<Vec<u8>>()
        })
        .collect()
}

fn measure(c: &mut Criterion, name: &str, store: &Store) {
    let mut catalog = Catalog::open_store(store).expect("open the catalog");
    let replica = catalog
        .create_replica(
            "bench",
            ReplicaConfig {
                processes: 1,
                workers_per_process: 1,
                config: String::new(),
            },
        )
        .expect("create a replica");
    let write = batch();
    let mut g = c.benchmark_group("stores/catalog_append_input");
    g.bench_function(name, |b| {
        b.iter(|| {
            catalog
                .append_input(replica.id, 1, &write)
                .expect("append an input write")
        })
    });
    g.finish();
    let description = vec![7u8; 200];
    let mut g = c.benchmark_group("stores/catalog_create_dataflow");
    g.bench_function(name, |b| {
        b.iter(|| {
            catalog
                .create_dataflow(replica.id, &description)
                .expect("record a dataflow")
        })
    });
    g.finish();
}

fn stores(c: &mut Criterion) {
    let dir = tempfile::tempdir().expect("tempdir");
    measure(c, "sqlite", &Store::Sqlite(dir.path().join("catalog.db")));
    match lockstep_pgtest::PgServer::start() {
        Ok(pg) => measure(c, "postgres", &Store::Postgres(pg.url())),
        Err(e) => {
            eprintln!("stores: SKIPPED postgres: {e}");
            lockstep_benches::record_skip("catalog@postgres", "-", &format!("no PostgreSQL: {e}"));
        }
    }
}

criterion_group!(benches, stores);
criterion_main!(benches);
