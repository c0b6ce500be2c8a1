//! The user path: the environment's gRPC API through a tonic client, side by
//! side in one run with the same operations called in process on the
//! `Environment` (the core path: the same catalog write, controller and
//! replica, without gRPC), and for ingest with raw differential input in one
//! process (the limit of what the replica's dataflows can take).
//!
//! - `api/peek_100/{grpc,core}`: a peek of 100 rows;
//! - `api/write_100/{grpc,core}`: a WriteInput of 100 rows, until it is
//!   acknowledged (durable in the catalog, sent to the replica);
//! - `api/write_100_x8/{grpc,core}`: eight WriteInputs of 100 rows at once,
//!   each to a collection of its own, until all eight are acknowledged
//!   (the environment stores concurrent writes in one catalog transaction:
//!   group commit), in rows per second;
//! - `api/ingest_10k/{grpc,core,differential}`: WriteInputs of 10,000 rows
//!   back to back, until the replica applied them all (a peek of a small
//!   second export at the last batch's time answers), in rows per second;
//!   `floor_2x2` is its like-for-like floor: differential alone on the
//!   same 2x2 shape (two timely processes of two workers over loopback),
//!   the same rows built the same way in the timed loop, the same two
//!   exports, state growing across samples as the replica's does
//!   ([`lockstep_benches::ingest_floor`]); `differential` inserts
//!   pre-built batches into an `InputSession` feeding one arrangement in
//!   one worker, a fresh dataflow per sample (a reported figure, not a
//!   divisor).
//!
//! One environment with a 2x2 replica of the release `lockstep-replica`
//! serves every measurement; `cargo xtask bench` compares `grpc` with `core`
//! and `core` with `differential`.

#![allow(missing_docs)] // criterion_group! generates undocumented functions

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use lockstep_benches::replica;
use lockstep_catalog::ReplicaConfig;
use lockstep_environment::proto::environment_client::EnvironmentClient;
use lockstep_environment::proto::{PeekRequest, WriteInputRequest};
use lockstep_environment::{Environment, EnvironmentConfig, ServiceTemplate};
use lockstep_plan::text::parse_plan;
use lockstep_protocol::{proto as wire, Update};
use tokio::runtime::Runtime;
use tonic::transport::Channel;

const REPLICA: &str = "bench";
/// Read by the peeks: 100 rows.
const PEEKED: u64 = 1;
/// Written by the write and ingest measurements, one collection each.
const WRITE_GRPC: u64 = 2;
const WRITE_CORE: u64 = 3;
const INGEST_GRPC: u64 = 4;
const INGEST_CORE: u64 = 5;
const INGEST_ROWS: i64 = 10_000;
/// Written by the concurrent writes: eight collections from here for gRPC,
/// eight from `CONCURRENT_CORE` in process.
const CONCURRENT_GRPC: u64 = 10;
const CONCURRENT_CORE: u64 = 20;
const CONCURRENT: u64 = 8;
/// Written by the latency figures alone, up to 10M rows.
const LATENCY: u64 = 30;

struct Fixture {
    _dir: tempfile::TempDir,
    env: Arc<Environment>,
    client: EnvironmentClient<Channel>,
    /// The next time to write at, per collection.
    next: [AtomicU64; 32],
}

/// The columns of the `n` rows written at `t`.
fn values(n: i64, t: u64) -> impl Iterator<Item = Vec<i64>> {
    (0..n).map(move |i| vec![i, t as i64, 7])
}

fn rows(n: i64, t: u64) -> Vec<Update> {
    values(n, t)
        .map(|v| Update {
            row: lockstep_plan::row(&v),
            time: t,
            diff: 1,
        })
        .collect()
}

async fn fixture() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let env = Environment::start(EnvironmentConfig::new(
        dir.path(),
        lockstep_policy::native_orphan_rule("id-watermark").unwrap(),
        ServiceTemplate::new(&replica::binary()),
    ))
    .await
    .unwrap();
    env.create_replica(
        REPLICA,
        ReplicaConfig {
            processes: 2,
            workers_per_process: 2,
            config: String::new(),
        },
    )
    .await
    .unwrap();
    for input in [
        PEEKED,
        WRITE_GRPC,
        WRITE_CORE,
        INGEST_GRPC,
        INGEST_CORE,
        LATENCY,
    ] {
        // The input arranged as it is (100 + input), and its rows with
        // column 0 at 0, one per ingested batch (200 + input), which a peek
        // reads to wait until the replica applied every batch.
        env.create_dataflow(
            REPLICA,
            "identity",
            0,
            vec![input],
            vec![
                lockstep_plan::export(100 + input, &parse_plan(&format!("get({input})")).unwrap()),
                lockstep_plan::export(
                    200 + input,
                    &parse_plan(&format!("filter(get({input}), #0 < 1)")).unwrap(),
                ),
            ],
        )
        .await
        .unwrap();
    }
    env.write_input(REPLICA, PEEKED, rows(100, 0), 1)
        .await
        .unwrap();
    let ready = Instant::now();
    loop {
        match env.peek(REPLICA, 100 + PEEKED, 0).await {
            Ok(r) if r.len() == 100 => break,
            _ if ready.elapsed() < Duration::from_secs(60) => {
                tokio::time::sleep(Duration::from_millis(10)).await
            }
            other => panic!("the bench replica did not answer: {other:?}"),
        }
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(env.clone().serve(listener));
    let client = EnvironmentClient::connect(url).await.unwrap();
    Fixture {
        _dir: dir,
        env,
        client,
        next: Default::default(),
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        // The replica's processes outlive the environment (it would adopt
        // them on a restart): stop them.
        let _ = lockstep_orchestrator::process::kill_all_services(
            &self
                ._dir
                .path()
                .join(lockstep_environment::ORCHESTRATOR_DIR),
        );
    }
}

impl Fixture {
    /// The environment (this process) and the replica's processes: a name
    /// and a PID each.
    async fn processes(&self) -> Vec<(String, u32)> {
        let listed = self
            .client
            .clone()
            .list_replicas(lockstep_environment::proto::ListReplicasRequest::default())
            .await
            .expect("list replicas")
            .into_inner();
        let mut processes = vec![(
            "the environment (this process)".to_string(),
            std::process::id(),
        )];
        for r in listed.replicas.iter().filter(|r| r.name == REPLICA) {
            for (i, p) in r.process_status.iter().enumerate() {
                processes.push((format!("replica process {i}"), p.pid));
            }
        }
        processes
    }

    /// The next (time, upper) to write `collection` at.
    fn tick(&self, collection: u64) -> (u64, u64) {
        let t = self.next[collection as usize].fetch_add(1, Ordering::Relaxed);
        (t, t + 1)
    }

    async fn write_grpc(&mut self, collection: u64, n: i64) {
        let (t, upper) = self.tick(collection);
        self.client
            .write_input(WriteInputRequest {
                replica: REPLICA.into(),
                collection_id: collection,
                updates: rows(n, t).into_iter().map(wire::Update::from).collect(),
                upper,
            })
            .await
            .unwrap();
    }

    /// Waits until the replica applied every batch ingested into
    /// `collection` (the peek at the last batch's time answers once the
    /// dataflow's frontier passed it); returns how many batches there were.
    async fn applied(&self, collection: u64) -> usize {
        let next = self.next[collection as usize].load(Ordering::Relaxed);
        let Some(last) = next.checked_sub(1) else {
            return 0;
        };
        let rows = self
            .env
            .peek(REPLICA, 200 + collection, last)
            .await
            .unwrap();
        assert_eq!(rows.len() as u64, next, "one row per batch");
        rows.len()
    }

    /// Eight writes of `n` rows at once through gRPC, one to each of the
    /// collections from `first`, until all are acknowledged.
    async fn write_grpc_concurrent(&self, first: u64, n: i64) {
        let writes = (first..first + CONCURRENT).map(|collection| {
            let (t, upper) = self.tick(collection);
            let mut client = self.client.clone();
            tokio::spawn(async move {
                client
                    .write_input(WriteInputRequest {
                        replica: REPLICA.into(),
                        collection_id: collection,
                        updates: rows(n, t).into_iter().map(wire::Update::from).collect(),
                        upper,
                    })
                    .await
                    .unwrap();
            })
        });
        for w in writes.collect::<Vec<_>>() {
            w.await.unwrap();
        }
    }

    /// [`Fixture::write_grpc_concurrent`] in process.
    async fn write_core_concurrent(&self, first: u64, n: i64) {
        let writes = (first..first + CONCURRENT).map(|collection| {
            let (t, upper) = self.tick(collection);
            let env = self.env.clone();
            // Each on a task of its own, as the API's requests are.
            tokio::spawn(async move {
                env.write_input(REPLICA, collection, rows(n, t), upper)
                    .await
                    .unwrap()
            })
        });
        for w in writes.collect::<Vec<_>>() {
            w.await.unwrap();
        }
    }

    async fn write_core(&self, collection: u64, n: i64) {
        let (t, upper) = self.tick(collection);
        self.env
            .write_input(REPLICA, collection, rows(n, t), upper)
            .await
            .unwrap();
    }
}

/// Raw differential: `iters` batches of `INGEST_ROWS` into an arranged input
/// in one worker, each stepped until the probe passes it.
fn differential_ingest(iters: u64) -> Duration {
    let batches = (0..iters)
        .map(|t| values(INGEST_ROWS, t).collect())
        .collect();
    lockstep_benches::differential_ingest::<Vec<i64>>(batches, 0, true)
}

/// The CPU time each of `processes` (name, PID) has used so far.
fn cpu_times(processes: &[(String, u32)]) -> Vec<Option<Duration>> {
    processes
        .iter()
        .map(|(_, pid)| lockstep_orchestrator::process::cpu_time(*pid))
        .collect()
}

/// Prints the CPU time each of `processes` used per batch since `before`
/// (over every batch of the measurement, warm-up included) and its
/// resident memory now.
fn report_cpu(name: &str, processes: &[(String, u32)], before: &[Option<Duration>], batches: u64) {
    let after = cpu_times(processes);
    for (((what, pid), before), after) in processes.iter().zip(before).zip(after) {
        let per_batch = match (before, after) {
            (Some(b), Some(a)) if batches > 0 => {
                format!("{:.2} ms", (a - *b).as_secs_f64() * 1e3 / batches as f64)
            }
            _ => "unknown".to_string(),
        };
        println!(
            "api/{name}/cpu: {what}: {per_batch} CPU a batch ({batches} batches), RSS {:.0} MiB",
            lockstep_orchestrator::process::rss_mib(*pid)
        );
    }
}

/// A writer's latency as the collection grows: 100 writes of 10,000 rows,
/// each until acknowledged (durable in the catalog and sent), once the
/// collection stored 1M rows and (outside quick mode) 10M; p50, p99 and
/// max, printed as one line each (`api/write_10k_latency/at_1M/paced:
/// ...`). `paced`: each write after the replica applied the one before (a
/// writer at a rate the replica sustains); `back_to_back`: the next write
/// as soon as this one is acknowledged (the replica falls behind and its
/// four workers take the two cores from the writer). Not a criterion
/// measurement: criterion reports each sample's mean, and this is the
/// spread.
fn write_latencies(rt: &Runtime, f: &Fixture) {
    let quick = std::env::var_os("LOCKSTEP_BENCH_QUICK").is_some();
    let targets: &[u64] = if quick {
        &[1_000_000]
    } else {
        &[1_000_000, 10_000_000]
    };
    let mut stored = 0u64;
    for &target in targets {
        while stored < target {
            rt.block_on(f.write_core(LATENCY, INGEST_ROWS));
            stored += INGEST_ROWS as u64;
            // Acknowledgements outrun the replica: a bounded backlog.
            if stored.is_multiple_of(50 * INGEST_ROWS as u64) {
                rt.block_on(f.applied(LATENCY));
            }
        }
        for paced in [true, false] {
            // The replica caught up: what is measured is the writer's path.
            rt.block_on(f.applied(LATENCY));
            let mut took: Vec<Duration> = (0..100)
                .map(|_| {
                    let t = Instant::now();
                    rt.block_on(f.write_core(LATENCY, INGEST_ROWS));
                    let took = t.elapsed();
                    if paced {
                        rt.block_on(f.applied(LATENCY));
                    }
                    took
                })
                .collect();
            stored += 100 * INGEST_ROWS as u64;
            took.sort();
            let ms = |d: Duration| d.as_secs_f64() * 1e3;
            println!(
                "api/write_10k_latency/at_{}M/{}: p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
                target / 1_000_000,
                if paced { "paced" } else { "back_to_back" },
                ms(took[49]),
                ms(took[98]),
                ms(took[99])
            );
        }
    }
}

fn api(c: &mut Criterion) {
    let rt = Runtime::new().unwrap();
    let mut f = rt.block_on(fixture());
    let mut floor = lockstep_benches::ingest_floor::IngestCluster::start(2, 2, true);
    let mut floor_next = 0u64;
    let mut group = c.benchmark_group("api");
    group.sample_size(20);

    group.bench_function("peek_100/grpc", |b| {
        b.iter_custom(|iters| {
            rt.block_on(async {
                let start = Instant::now();
                for _ in 0..iters {
                    let r = f
                        .client
                        .peek(PeekRequest {
                            replica: REPLICA.into(),
                            collection_id: 100 + PEEKED,
                            timestamp: 0,
                        })
                        .await
                        .unwrap();
                    assert_eq!(r.into_inner().rows.len(), 100);
                }
                start.elapsed()
            })
        })
    });
    group.bench_function("peek_100/core", |b| {
        b.iter_custom(|iters| {
            rt.block_on(async {
                let start = Instant::now();
                for _ in 0..iters {
                    let r = f.env.peek(REPLICA, 100 + PEEKED, 0).await.unwrap();
                    assert_eq!(r.len(), 100);
                }
                start.elapsed()
            })
        })
    });
    group.bench_function("write_100/grpc", |b| {
        b.iter_custom(|iters| {
            rt.block_on(async {
                let start = Instant::now();
                for _ in 0..iters {
                    f.write_grpc(WRITE_GRPC, 100).await;
                }
                start.elapsed()
            })
        })
    });
    group.bench_function("write_100/core", |b| {
        b.iter_custom(|iters| {
            rt.block_on(async {
                let start = Instant::now();
                for _ in 0..iters {
                    f.write_core(WRITE_CORE, 100).await;
                }
                start.elapsed()
            })
        })
    });
    // In rows, as the report reads every throughput.
    group.throughput(Throughput::Elements(CONCURRENT * 100));
    group.bench_function("write_100_x8/grpc", |b| {
        b.iter_custom(|iters| {
            rt.block_on(async {
                let start = Instant::now();
                for _ in 0..iters {
                    f.write_grpc_concurrent(CONCURRENT_GRPC, 100).await;
                }
                start.elapsed()
            })
        })
    });
    group.bench_function("write_100_x8/core", |b| {
        b.iter_custom(|iters| {
            rt.block_on(async {
                let start = Instant::now();
                for _ in 0..iters {
                    f.write_core_concurrent(CONCURRENT_CORE, 100).await;
                }
                start.elapsed()
            })
        })
    });
    group.throughput(Throughput::Elements(INGEST_ROWS as u64));
    group.bench_function("ingest_10k/grpc", |b| {
        b.iter_custom(|iters| {
            rt.block_on(async {
                let start = Instant::now();
                for _ in 0..iters {
                    f.write_grpc(INGEST_GRPC, INGEST_ROWS).await;
                }
                f.applied(INGEST_GRPC).await;
                start.elapsed()
            })
        })
    });
    let processes = rt.block_on(f.processes());
    let cpu_before = cpu_times(&processes);
    let mut core_batches = 0u64;
    group.bench_function("ingest_10k/core", |b| {
        b.iter_custom(|iters| {
            core_batches += iters;
            rt.block_on(async {
                let start = Instant::now();
                for _ in 0..iters {
                    f.write_core(INGEST_CORE, INGEST_ROWS).await;
                }
                f.applied(INGEST_CORE).await;
                start.elapsed()
            })
        })
    });
    report_cpu("ingest_10k/core", &processes, &cpu_before, core_batches);
    let bench_process = [(
        "the floor's 2x2 (this process)".to_string(),
        std::process::id(),
    )];
    let cpu_before = cpu_times(&bench_process);
    let mut floor_batches = 0u64;
    group.bench_function("ingest_10k/floor_2x2", |b| {
        b.iter_custom(|iters| {
            floor_batches += iters;
            let start = Instant::now();
            for _ in 0..iters {
                let t = floor_next;
                floor_next += 1;
                floor.ingest(
                    values(INGEST_ROWS, t)
                        .map(|v| lockstep_plan::row(&v))
                        .collect(),
                    t,
                );
            }
            if let Some(last) = floor_next.checked_sub(1) {
                floor.wait_past(last);
            }
            start.elapsed()
        })
    });
    report_cpu(
        "ingest_10k/floor_2x2",
        &bench_process,
        &cpu_before,
        floor_batches,
    );
    group.bench_function("ingest_10k/differential", |b| {
        b.iter_custom(differential_ingest)
    });
    group.finish();
    drop(floor);
    write_latencies(&rt, &f);
    drop(f);
}

criterion_group!(benches, api);
criterion_main!(benches);
