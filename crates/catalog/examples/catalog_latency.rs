//! Measures catalog write latency on both backends (informative; see
//! `docs/stores.md`): `cargo run --release -p lockstep-catalog --example
//! catalog_latency [WRITES]`. The PostgreSQL server is a throw-away one
//! (lockstep-pgtest) on 127.0.0.1 with default durability (`fsync=on`,
//! `synchronous_commit=on`); the SQLite file is in a temporary directory
//! (`synchronous=FULL`).

use std::time::{Duration, Instant};

use lockstep_catalog::{Catalog, ReplicaConfig, Store};

fn main() {
    let n: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(500);
    let dir = tempfile::tempdir().unwrap();
    let pg = lockstep_pgtest::PgServer::start().unwrap();
    for (label, store) in [
        ("sqlite", Store::Sqlite(dir.path().join("catalog.db"))),
        ("postgres", Store::Postgres(pg.url())),
    ] {
        let t = Instant::now();
        let mut c = Catalog::open_store(&store).unwrap();
        let open = t.elapsed();
        let r = c
            .create_replica(
                "r",
                ReplicaConfig {
                    processes: 1,
                    workers_per_process: 1,
                    config: String::new(),
                },
            )
            .unwrap();
        let mut appends = Vec::with_capacity(n);
        for i in 0..n {
            let t = Instant::now();
            c.append_input(r.id, 1, &(i as u64).to_le_bytes()).unwrap();
            appends.push(t.elapsed());
        }
        let mut dataflows = Vec::with_capacity(n);
        for _ in 0..n {
            let t = Instant::now();
            c.create_dataflow_with(r.id, |id| id.to_le_bytes().to_vec())
                .unwrap();
            dataflows.push(t.elapsed());
        }
        let t = Instant::now();
        let state = c.state().unwrap();
        let read = t.elapsed();
        assert_eq!(state.input_writes.len(), n);
        println!(
            "{label:8} open {open:>9.2?}  append_input {}  create_dataflow_with {}  state() of {} rows {read:.2?}",
            summary(&mut appends),
            summary(&mut dataflows),
            2 * n
        );
    }
}

/// `p50 / p99` of the samples.
fn summary(samples: &mut [Duration]) -> String {
    samples.sort();
    let at = |q: f64| samples[((samples.len() as f64 - 1.0) * q) as usize];
    format!("p50 {:>9.2?} p99 {:>9.2?}", at(0.5), at(0.99))
}
