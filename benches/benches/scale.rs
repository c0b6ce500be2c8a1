//! How costs grow, and how close lockstep comes to timely and differential
//! by themselves. Real release replicas; the `barrier` strategy (the
//! default of `lockstep serve`).
//!
//! Scale sweeps:
//! - `scale/start/{p}x1` for 1, 2, 4 and 8 processes: from asking the
//!   orchestrator for the replica until every worker answered Hello;
//! - `scale/install/{n}_installed/{shape}`: installing one more small
//!   dataflow (until its frontier passes 0) with 0, 1,000 and 10,000 already
//!   installed;
//! - `scale/reconcile/{n}/{shape}`: a new controller at a new epoch until
//!   every worker reported a full status, with 100, 1,000 and 10,000
//!   unchanged dataflows installed; every iteration checks that no worker
//!   rebuilt a dataflow (creation logs unchanged).
//!
//! The shape is 4x2 (`$LOCKSTEP_BENCH_SCALE_SHAPE` changes it); the largest
//! count is 10,000 (`$LOCKSTEP_BENCH_SCALE_MAX` lowers it). Installing them
//! takes ~25 s on the 2-core bench machine (244 s before a worker's loop
//! read only the dataflows in motion).
//!
//! Ratios to the limit, 1x1:
//! - `limits/install/{lockstep,timely}/1x1`: a small dataflow (an input
//!   arranged and probed, as the replica renders `Get`) installed through
//!   the controller until its frontier passes 0, then dropped; and the same
//!   dataflow built directly in a timely worker in this process, stepped
//!   until its probe passes 0, then dropped; `limits/install/timely/2x2`:
//!   the same built by every worker of a 2x2 timely cluster (two timely
//!   processes of two workers, threads of this process connected over
//!   loopback TCP), the floor of an install on a 2x2 replica;
//! - `limits/ingest_1M/{lockstep,floor,differential}/1x1`: 1,000,000 rows
//!   in batches of 10,000 through the controller until the frontier passes
//!   the last; its like-for-like floor (the same rows as bytes into a fresh
//!   one-worker cluster arranging them as the replica's export does, each
//!   batch stepped as it comes: `floor_ingest`); and integer rows into a
//!   differential `InputSession` in one worker, stepped once after the last
//!   batch (reported beside the floor, not a divisor);
//! - the small command at 1x1 is compared with `network/tcp_rtt/direct`
//!   (one loopback round trip) by the report.
//!
//! Needs the release replica: `cargo build --release -p lockstep-replica`.

#![allow(missing_docs)] // criterion_group! generates undocumented functions

use std::time::{Duration, Instant};

use criterion::measurement::WallTime;
use criterion::{criterion_group, criterion_main, BenchmarkGroup, Criterion, SamplingMode};
use lockstep_benches::harness::{self, env_shape, rt};
use lockstep_benches::replica::{self, BenchReplica};
use lockstep_benches::small_dataflow;
use lockstep_controller::{Controller, ControllerError};
use lockstep_protocol::{Strategy, Update};
use tokio::runtime::Runtime;

/// The input every small dataflow reads.
const INPUT: u64 = 1;
/// How long one operation may take.
const OP_BOUND: Duration = Duration::from_secs(120);
/// Rows per ingest batch, and batches per ingest.
const BATCH_ROWS: u64 = 10_000;
const BATCHES: u64 = 100;

fn group<'a>(c: &'a mut Criterion, name: &str) -> BenchmarkGroup<'a, WallTime> {
    let mut g = c.benchmark_group(name);
    harness::timings(&mut g, 10, 1000);
    g
}

fn op<T>(
    rt: &Runtime,
    what: &str,
    fut: impl std::future::Future<Output = Result<T, ControllerError>>,
) -> T {
    harness::op(rt, what, OP_BOUND, fut)
}

fn start(c: &mut Criterion) {
    let rt = rt();
    let mut g = group(c, "scale/start");
    g.sampling_mode(SamplingMode::Flat);
    let mut id = 4000;
    for p in [1usize, 2, 4, 8] {
        g.bench_function(format!("{p}x1"), |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    id += 1;
                    total += rt.block_on(async {
                        let t = Instant::now();
                        let r = replica::start(id, p, 1).await;
                        let c = replica::controller(&r, Strategy::Barrier);
                        let statuses = c.statuses().await.expect("statuses");
                        let elapsed = t.elapsed();
                        assert_eq!(statuses.len(), p, "a worker is missing");
                        c.shutdown();
                        drop(r);
                        elapsed
                    });
                }
                total
            })
        });
    }
    g.finish();
}

/// Installs small dataflow `id`, waits until its frontier passes 0, and
/// drops it.
fn install_one(rt: &Runtime, ctl: &Controller, id: u64) {
    let d = small_dataflow(id);
    ctl.create_dataflow(d.clone()).expect("create");
    op(rt, "install", ctl.wait_for_frontier(1000 + id, 0));
    ctl.drop_dataflow(&d).expect("drop");
}

/// Installs dataflows `from..=to`, waiting after every 500 (so that no
/// wait is longer than the controller's request bound).
fn install_up_to(rt: &Runtime, ctl: &Controller, from: u64, to: u64) {
    let t = Instant::now();
    for d in from..=to {
        ctl.create_dataflow(small_dataflow(d)).expect("create");
        if d % 500 == 0 || d == to {
            op(rt, "install", ctl.wait_for_frontier(1000 + d, 0));
        }
    }
    eprintln!(
        "scale: installed dataflows {from}..={to} in {:.2?}",
        t.elapsed()
    );
}

fn sweeps(c: &mut Criterion) {
    let rt = rt();
    let _guard = rt.enter();
    let (p, w) = env_shape("LOCKSTEP_BENCH_SCALE_SHAPE", (4, 2));
    let max: u64 = std::env::var("LOCKSTEP_BENCH_SCALE_MAX")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(10_000);
    let shape = format!("{p}x{w}");
    let r: BenchReplica = rt.block_on(replica::start(4100, p, w));
    let mut epoch = 1;
    let mut ctl = replica::controller(&r, Strategy::Barrier);
    ctl.write_input(INPUT, vec![], 1).expect("write");
    let mut installed = 0u64;
    // Installed dataflows use IDs 1..=max; the measured installs use IDs
    // above that and are dropped again.
    let mut next = 1_000_000u64;
    for n in [0u64, 100, 1_000, 10_000] {
        if n > max {
            break;
        }
        if n > installed {
            install_up_to(&rt, &ctl, installed + 1, n);
            installed = n;
        }
        if n != 100 {
            let mut g = group(c, "scale/install");
            g.bench_function(format!("{n}_installed/{shape}"), |b| {
                b.iter(|| {
                    next += 1;
                    install_one(&rt, &ctl, next);
                })
            });
            g.finish();
        }
        if n == 0 {
            continue;
        }
        let before = op(&rt, "statuses", ctl.statuses());
        let history = op(&rt, "history", ctl.history());
        ctl.shutdown();
        let mut g = group(c, "scale/reconcile");
        g.sampling_mode(SamplingMode::Flat);
        g.bench_function(format!("{n}/{shape}"), |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    epoch += 1;
                    let t = Instant::now();
                    let c = replica::controller_with(&r, Strategy::Barrier, epoch, history.clone());
                    let after = op(&rt, "reconciliation", c.statuses());
                    total += t.elapsed();
                    replica::assert_nothing_rebuilt(&before, &after);
                    c.shutdown();
                }
                total
            })
        });
        g.finish();
        epoch += 1;
        ctl = replica::controller_with(&r, Strategy::Barrier, epoch, history);
    }
    ctl.shutdown();
}

/// `BATCH_ROWS` rows `[i, t]` at time `t`.
fn batch(t: u64) -> Vec<Update> {
    (0..BATCH_ROWS as i64)
        .map(|i| Update {
            row: lockstep_plan::row(&[i, t as i64]),
            time: t,
            diff: 1,
        })
        .collect()
}

fn limits(c: &mut Criterion) {
    let rt = rt();
    let _guard = rt.enter();
    let r = rt.block_on(replica::start(4200, 1, 1));
    let ctl = replica::controller(&r, Strategy::Barrier);
    ctl.write_input(INPUT, vec![], 1).expect("write");

    let mut g = group(c, "limits/install");
    let mut next = 10_000u64;
    g.bench_function("lockstep/1x1", |b| {
        b.iter(|| {
            next += 1;
            install_one(&rt, &ctl, next);
        })
    });
    g.bench_function("timely/1x1", |b| {
        b.iter_custom(timely_install);
    });
    g.bench_function("timely/2x2", |b| {
        b.iter_custom(timely_install_2x2);
    });
    g.finish();

    // Each ingest writes to a fresh input read by a fresh dataflow, so that
    // every iteration starts from the same state.
    let mut g = group(c, "limits/ingest_1M");
    g.sampling_mode(SamplingMode::Flat);
    g.throughput(criterion::Throughput::Elements(BATCH_ROWS * BATCHES));
    let mut input = 100u64;
    g.bench_function("lockstep/1x1", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                input += 1;
                let d = lockstep_benches::dataflow_over(input, input, 1000 + input);
                ctl.write_input(input, vec![], 1).expect("write");
                ctl.create_dataflow(d.clone()).expect("create");
                op(&rt, "install", ctl.wait_for_frontier(1000 + input, 0));
                let batches: Vec<Vec<Update>> = (1..=BATCHES).map(batch).collect();
                let t = Instant::now();
                for (i, rows) in batches.into_iter().enumerate() {
                    let time = i as u64 + 1;
                    ctl.write_input(input, rows, time + 1).expect("write");
                }
                op(&rt, "ingest", ctl.wait_for_frontier(1000 + input, BATCHES));
                total += t.elapsed();
                ctl.drop_dataflow(&d).expect("drop");
            }
            total
        })
    });
    g.bench_function("floor/1x1", |b| {
        b.iter_custom(|iters| (0..iters).map(|_| floor_ingest()).sum());
    });
    g.bench_function("differential/1x1", |b| {
        b.iter_custom(|iters| (0..iters).map(|_| differential_ingest()).sum());
    });
    g.finish();
    ctl.shutdown();
}

/// `iters` small dataflows built directly in one timely worker, each
/// stepped until its probe passes 0, then dropped.
fn timely_install(iters: u64) -> Duration {
    timely::execute_directly(move |worker| build_dataflows(worker, iters, false))
}

/// The same in a 2x2 timely cluster of this process's threads: two timely
/// processes of two workers each, connected over loopback TCP as a
/// replica's processes are; every worker builds each dataflow and steps
/// until its probe passes 0. The slowest worker's time.
fn timely_install_2x2(iters: u64) -> Duration {
    let addresses: Vec<String> = (0..2)
        .map(|_| {
            let l = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
            format!("127.0.0.1:{}", l.local_addr().expect("addr").port())
        })
        .collect();
    let processes: Vec<_> = (0..2)
        .map(|process| {
            let addresses = addresses.clone();
            std::thread::spawn(move || {
                let config = timely::Config {
                    communication: timely::CommunicationConfig::Cluster {
                        threads: 2,
                        process,
                        addresses,
                        report: false,
                        zerocopy: false,
                    },
                    worker: timely::WorkerConfig::default(),
                };
                timely::execute(config, move |worker| build_dataflows(worker, iters, true))
                    .expect("a 2x2 timely cluster")
                    .join()
                    .into_iter()
                    .map(|r| r.expect("a timely worker"))
                    .collect::<Vec<Duration>>()
            })
        })
        .collect();
    processes
        .into_iter()
        .flat_map(|p| p.join().expect("a timely process"))
        .max()
        .expect("four workers")
}

/// Builds one dataflow unmeasured (in a cluster, every worker is then
/// past its connection set-up), then `iters` more, each stepped until its
/// probe passes 0 and dropped; the time of those. With `park`, a worker
/// waiting for its peers parks until their messages wake it, as a
/// replica's workers do (four workers spinning on two cores would measure
/// the scheduler's time slices).
fn build_dataflows(worker: &mut timely::worker::Worker, iters: u64, park: bool) -> Duration {
    use differential_dataflow::input::InputSession;
    use timely::dataflow::operators::Probe;
    let mut start = Instant::now();
    for i in 0..=iters {
        if i == 1 {
            start = Instant::now();
        }
        let mut input: InputSession<u64, Vec<i64>, i64> = InputSession::new();
        let probe = timely::dataflow::ProbeHandle::new();
        let index = worker.next_dataflow_index();
        worker.dataflow::<u64, _, _>(|scope| {
            input
                .to_collection(scope)
                .arrange_by_self()
                .as_collection(|k: &Vec<i64>, _v: &()| k.clone())
                .inner
                .probe_with(&probe);
        });
        input.advance_to(1);
        input.flush();
        while probe.less_than(&1) {
            if park {
                worker.step_or_park(Some(Duration::from_millis(1)));
            } else {
                worker.step();
            }
        }
        drop(input);
        worker.drop_dataflow(index);
    }
    start.elapsed()
}

/// The like-for-like floor of `limits/ingest_1M/lockstep/1x1`: the same
/// rows (bytes, in the replica's order) made before the clock, into a fresh
/// one-worker cluster whose one export arranges them as the replica's does,
/// each batch handed over and stepped as it comes (the replica cannot wait
/// for the last batch before it steps), until the probe passes the last
/// ([`lockstep_benches::ingest_floor`]).
fn floor_ingest() -> Duration {
    let batches: Vec<Vec<lockstep_protocol::Row>> = (1..=BATCHES)
        .map(|t| {
            (0..BATCH_ROWS as i64)
                .map(|i| lockstep_plan::row(&[i, t as i64]))
                .collect()
        })
        .collect();
    let mut cluster = lockstep_benches::ingest_floor::IngestCluster::start(1, 1, false);
    let t = Instant::now();
    for (time, rows) in (1..).zip(batches) {
        cluster.ingest(rows, time);
    }
    cluster.wait_past(BATCHES);
    t.elapsed()
}

/// [`BATCHES`] batches of [`BATCH_ROWS`] into an arranged `InputSession` in
/// one worker, until the probe passes the last.
fn differential_ingest() -> Duration {
    // The same rows as the plan language's columns, made before the
    // clock starts as the lockstep path's are.
    let batches = (1..=BATCHES)
        .map(|t| (0..BATCH_ROWS as i64).map(|i| vec![i, t as i64]).collect())
        .collect();
    lockstep_benches::differential_ingest::<Vec<i64>>(batches, 1, false)
}

criterion_group!(benches, limits, start, sweeps);
criterion_main!(benches);
