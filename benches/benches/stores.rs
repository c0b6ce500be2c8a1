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
//! - `stores/log_append_read/{sqlite,postgres}`: one fenced command-log
//!   append of a small command, then reading it back through a second
//!   connection (a worker's read once the command's socket copy poked it):
//!   the store's part of a `log` or `log@postgres` command's floor;
//! - `stores/log_append_notify/postgres`: the same append, and a reader on
//!   another connection, on its own thread, woken by the append's
//!   LISTEN/NOTIFY (the path of a worker that no socket copy poked);
//! - `stores/fenced_insert_read/postgres`: the server's own floor for that
//!   work, with no lockstep code: one statement that checks a fence row and
//!   inserts the command's bytes (its own transaction, durable at commit),
//!   then one SELECT of it on a second connection.
//!
//! `cargo xtask bench` compares each PostgreSQL figure with SQLite's, and
//! the command-log figures, plus a loopback round trip, with the `log` and
//! `log@postgres` small commands of the `strategies` bench.

#![allow(missing_docs)] // criterion_group! generates undocumented functions

use criterion::{criterion_group, criterion_main, Criterion};
use lockstep_catalog::{Catalog, ReplicaConfig, Store};
use lockstep_command_log::LogLocation;
use lockstep_protocol::WireMessage;

/// A 100-row input write as the environment stores it (encoded updates).
fn batch() -> Vec<u8> {
    lockstep_benches::rows(100)
        .iter()
        .flat_map(|u| {
            u.row
                .iter()
                .copied()
                .chain([u.time as i64, u.diff].iter().flat_map(|v| v.to_le_bytes()))
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

/// A small command as the log strategy appends it.
fn small_command(seqno: u64) -> lockstep_protocol::Command {
    lockstep_protocol::Command {
        seqno,
        strategy: lockstep_protocol::Strategy::Log,
        kind: lockstep_protocol::CommandKind::StatusRequest { full: false },
    }
}

/// The command log's floor on `location`: an append, then the entry read
/// by another connection; on PostgreSQL that reader runs on its own thread
/// and waits for the append's notification, as a worker does.
fn measure_log(c: &mut Criterion, location: &LogLocation) {
    use lockstep_command_log::{AnyLog, CommandLog};
    let mut writer = AnyLog::open(location).expect("open the command log");
    let mut seqno = 0;
    let mut g = c.benchmark_group("stores");
    let store = match location {
        LogLocation::Sqlite(_) => "sqlite",
        LogLocation::Postgres { .. } => "postgres",
    };
    let mut reader = AnyLog::open_reader(location).expect("open a reader");
    g.bench_function(format!("log_append_read/{store}"), |b| {
        b.iter(|| {
            seqno += 1;
            let at = writer.append(1, &[small_command(seqno)]).expect("append");
            let read = reader.read_from(at, 1).expect("read");
            assert_eq!(read.len(), 1, "the entry appended at {at}");
        })
    });
    if let LogLocation::Postgres { .. } = location {
        // The reader thread reads every entry as it is notified and says
        // which offset it reached.
        let (reached_tx, reached_rx) = std::sync::mpsc::channel::<u64>();
        let (stop_tx, stop_rx) = std::sync::mpsc::channel::<()>();
        let mut next = writer.append(1, &[small_command(0)]).expect("append") + 1;
        let thread = std::thread::spawn(move || {
            while stop_rx.try_recv().is_err() {
                let _ = reader.wait_for_append(std::time::Duration::from_millis(200));
                if let Ok(entries) = reader.read_from(next, 256) {
                    if let Some(last) = entries.last() {
                        next = last.offset + 1;
                        let _ = reached_tx.send(last.offset);
                    }
                }
            }
        });
        g.bench_function("log_append_notify/postgres", |b| {
            b.iter(|| {
                seqno += 1;
                let at = writer.append(1, &[small_command(seqno)]).expect("append");
                loop {
                    let reached = reached_rx
                        .recv_timeout(std::time::Duration::from_secs(5))
                        .expect("the reader woke within 5 s");
                    if reached >= at {
                        break;
                    }
                }
            })
        });
        let _ = stop_tx.send(());
        let _ = thread.join();
    }
    g.finish();
}

/// The PostgreSQL floor of a fenced append read back: one statement (a
/// fence check and an insert, committed), one SELECT on another connection.
fn measure_pg_floor(c: &mut Criterion, url: &str) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let connect = || async {
        let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
            .await
            .expect("connect to PostgreSQL");
        tokio::spawn(conn);
        client
    };
    let (writer, reader) = rt.block_on(async {
        let writer = connect().await;
        writer
            .batch_execute(
                "CREATE TABLE floor_fence (id INT PRIMARY KEY, epoch BIGINT NOT NULL);
                 INSERT INTO floor_fence VALUES (1, 1);
                 CREATE TABLE floor_log (id BIGSERIAL PRIMARY KEY, epoch BIGINT NOT NULL, command BYTEA NOT NULL);",
            )
            .await
            .expect("create the floor tables");
        (writer, connect().await)
    });
    let command = small_command(1).encode_to_vec();
    let (insert, select) = rt.block_on(async {
        (
            writer
                .prepare(
                    "INSERT INTO floor_log (epoch, command) \
                     SELECT $1, $2 FROM floor_fence WHERE id = 1 AND epoch <= $1 RETURNING id",
                )
                .await
                .expect("prepare the insert"),
            reader
                .prepare("SELECT command FROM floor_log WHERE id = $1")
                .await
                .expect("prepare the select"),
        )
    });
    let mut g = c.benchmark_group("stores");
    g.bench_function("fenced_insert_read/postgres", |b| {
        b.iter(|| {
            rt.block_on(async {
                let row = writer
                    .query_one(&insert, &[&1i64, &command])
                    .await
                    .expect("the fenced insert");
                let id: i64 = row.get(0);
                let read = reader.query_one(&select, &[&id]).await.expect("the read");
                assert_eq!(read.get::<_, Vec<u8>>(0).len(), command.len());
            })
        })
    });
    g.finish();
}

fn stores(c: &mut Criterion) {
    let dir = tempfile::tempdir().expect("tempdir");
    measure(c, "sqlite", &Store::Sqlite(dir.path().join("catalog.db")));
    measure_log(c, &LogLocation::Sqlite(dir.path().join("log.db")));
    match lockstep_pgtest::PgServer::start() {
        Ok(pg) => {
            measure(c, "postgres", &Store::Postgres(pg.url()));
            measure_log(
                c,
                &LogLocation::Postgres {
                    url: pg.url(),
                    name: "bench".into(),
                },
            );
            measure_pg_floor(c, &pg.url());
        }
        Err(e) => {
            eprintln!("stores: SKIPPED postgres: {e}");
            lockstep_benches::record_skip("catalog@postgres", "-", &format!("no PostgreSQL: {e}"));
        }
    }
}

criterion_group!(benches, stores);
criterion_main!(benches);
