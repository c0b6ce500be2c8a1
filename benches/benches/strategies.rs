//! Every distribution strategy side by side, on real replicas, in one run.
//!
//! For each replica shape (processes x workers per process: 1x1, 2x1, 2x2,
//! 4x1, and 4x2 outside quick mode) and each strategy (`broadcast`,
//! `barrier`, `log`, `naive`, and `log@postgres`: the log strategy with the
//! command log in a throw-away PostgreSQL server instead of a SQLite file,
//! when the PostgreSQL binaries are installed), it starts a fresh replica with a controller
//! that sends every command with that strategy, and measures:
//!
//! - `small_command`: a light StatusRequest, until every worker answered it;
//! - `peek`: a peek of 100 rows, until every process answered;
//! - `install`: creating a small dataflow until its frontier passes 0 on
//!   every worker (then dropping it, outside the measurement's meaning but
//!   inside its loop);
//! - `write_1KiB`, `write_64KiB`, `write_1MiB`: a WriteInput whose rows hold
//!   that many bytes of row data (16 columns of 8 bytes each), until the
//!   frontier of a dataflow reading it passes the write's time (criterion
//!   reports bytes per second);
//! - `reconcile_10`, `reconcile_100`, `reconcile_1000`: on a second fresh
//!   replica with that many dataflows installed, a new controller at a new
//!   epoch connects, rehydrates its history and waits for a full Status from
//!   every worker. Every worker's creation log must be unchanged: nothing was
//!   rebuilt (asserted each iteration).
//!
//! Benchmark IDs are `strategies/{measurement}/{strategy}/{p}x{w}`, which
//! `cargo xtask bench` parses to compare each strategy with `broadcast`.
//!
//! A strategy whose setup fails on a shape (the replica refuses it, or a
//! wait times out) is skipped there with a message on stderr, and appended
//! to the file named by `$LOCKSTEP_BENCH_SKIPS` if set, so the rest of the
//! run goes on. A failure in the middle of a measurement is caught and
//! reported the same way.
//!
//! Quick mode (`$LOCKSTEP_BENCH_QUICK=1`, or `--quick` on the command line)
//! drops the 4x2 shape and shortens warm-up and measurement.
//! `$LOCKSTEP_BENCH_STRATEGIES` (e.g. `barrier,naive`) and
//! `$LOCKSTEP_BENCH_SHAPES` (e.g. `1x1,2x2`) restrict the run (`log@postgres`
//! is a strategy name there too).
//!
//! Needs the release replica: `cargo build --release -p lockstep-replica`.

#![allow(missing_docs)] // criterion_group! generates undocumented functions

use std::panic::AssertUnwindSafe;
use std::time::{Duration, Instant};

use criterion::{
    criterion_group, criterion_main, BatchSize, BenchmarkGroup, Criterion, SamplingMode, Throughput,
};
use lockstep_benches::harness::{self, rt};
use lockstep_benches::replica::{self, BenchReplica};
use lockstep_benches::{dataflow_over, payload, small_dataflow, COLUMNS};
use lockstep_controller::{Controller, ControllerError, Event};
use lockstep_protocol::{Strategy, Update};
use tokio::runtime::Runtime;

/// The input collection every small dataflow reads.
const INPUT: u64 = 1;
/// The input collection the writes go to.
const WRITE_INPUT: u64 = 2;
/// The dataflow that is peeked (it exports `1000 + PEEK_DATAFLOW`).
const PEEK_DATAFLOW: u64 = 1;
/// The dataflow over [`WRITE_INPUT`] whose frontier the writes wait for.
const WRITE_DATAFLOW: u64 = 2;
const WRITE_EXPORT: u64 = 3002;
/// The write benchmarks: name and bytes of row data per WriteInput.
const PAYLOADS: [(&str, usize); 3] = [
    ("write_1KiB", 1 << 10),
    ("write_64KiB", 64 << 10),
    ("write_1MiB", 1 << 20),
];
/// How long setup may take before the strategy is skipped.
const SETUP_BOUND: Duration = Duration::from_secs(20);
/// How long one measured operation may take before the strategy is skipped
/// on this shape (the controller's own bound is 30 s; a hung replica should
/// not cost that much of a quick run).
const OP_BOUND: Duration = Duration::from_secs(10);

/// A strategy, and where the replica's command log lives.
#[derive(Clone, Copy)]
struct Variant {
    strategy: Strategy,
    /// The command log in PostgreSQL (`log@postgres`), not SQLite.
    postgres: bool,
}

impl std::fmt::Display for Variant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.strategy)?;
        if self.postgres {
            f.write_str("@postgres")?;
        }
        Ok(())
    }
}

/// What this run measures.
struct Run {
    shapes: Vec<(usize, u32)>,
    strategies: Vec<Variant>,
    /// The throw-away server of the `@postgres` variants.
    pg: Option<lockstep_pgtest::PgServer>,
}

impl Run {
    fn from_env() -> Run {
        let quick = harness::quick();
        let mut shapes = vec![(1, 1), (2, 1), (2, 2), (4, 1)];
        if !quick {
            shapes.push((4, 2));
        }
        if let Ok(only) = std::env::var("LOCKSTEP_BENCH_SHAPES") {
            let wanted: Vec<String> = only.split(',').map(|s| s.trim().to_string()).collect();
            shapes.retain(|(p, w)| wanted.contains(&format!("{p}x{w}")));
        }
        let mut strategies: Vec<Variant> = Strategy::ALL
            .iter()
            .map(|&strategy| Variant {
                strategy,
                postgres: false,
            })
            .collect();
        strategies.push(Variant {
            strategy: Strategy::Log,
            postgres: true,
        });
        if let Ok(only) = std::env::var("LOCKSTEP_BENCH_STRATEGIES") {
            let wanted: Vec<&str> = only.split(',').map(str::trim).collect();
            strategies.retain(|s| wanted.contains(&s.to_string().as_str()));
        }
        let pg = if strategies.iter().any(|s| s.postgres) {
            match lockstep_pgtest::PgServer::start() {
                Ok(pg) => Some(pg),
                Err(e) => {
                    for &(p, w) in &shapes {
                        skip(
                            "log@postgres",
                            &format!("{p}x{w}"),
                            &format!("no PostgreSQL: {e}"),
                        );
                    }
                    strategies.retain(|s| !s.postgres);
                    None
                }
            }
        } else {
            None
        };
        Run {
            shapes,
            strategies,
            pg,
        }
    }

    /// Where `variant`'s replicas keep their command log: a database URL,
    /// or none (a SQLite file).
    fn log_url(&self, variant: Variant) -> Option<String> {
        if variant.postgres {
            self.pg.as_ref().map(|pg| pg.url())
        } else {
            None
        }
    }

    /// A benchmark group with this run's timing.
    fn group<'a>(
        &self,
        c: &'a mut Criterion,
        measurement: &str,
    ) -> BenchmarkGroup<'a, criterion::measurement::WallTime> {
        let mut g = c.benchmark_group(format!("strategies/{measurement}"));
        harness::timings(&mut g, 10, 1000);
        g
    }
}

/// Records a skipped strategy on stderr and in `$LOCKSTEP_BENCH_SKIPS`.
fn skip(strategy: &str, shape: &str, why: &str) {
    eprintln!("strategies: SKIPPED {strategy} on {shape}: {why}");
    // The first line says what failed; the rest (log tails) is on stderr.
    lockstep_benches::record_skip(strategy, shape, why);
}

/// The first error a replica reports to `ctl`; the other events before it
/// are kept in `seen`, for the message.
async fn first_replica_error(
    mut events: tokio::sync::broadcast::Receiver<Event>,
    seen: &mut Vec<Event>,
) -> String {
    loop {
        match events.recv().await {
            Ok(Event::ReplicaError { process, error }) => {
                return format!("process {process} refused: {}", error.message)
            }
            Ok(other) => seen.push(other),
            Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
            Err(tokio::sync::broadcast::error::RecvError::Closed) => {
                return "the controller shut down".into()
            }
        }
    }
}

/// What the controller saw, in a few words: which processes went silent
/// (stopped answering heartbeats), and any other event.
fn summarize(events: &[Event]) -> String {
    let mut silent = std::collections::BTreeSet::new();
    let mut other = Vec::new();
    for e in events {
        match e {
            Event::ProcessSilent { process, .. } => {
                silent.insert(*process);
            }
            Event::Connected { .. } => {}
            e => other.push(format!("{e:?}")),
        }
    }
    let mut s = String::new();
    if !silent.is_empty() {
        let list: Vec<String> = silent.iter().map(|p| p.to_string()).collect();
        s.push_str(&format!(
            "; process(es) {} went silent (no heartbeat answer for 2 s)",
            list.join(", ")
        ));
    }
    if !other.is_empty() {
        s.push_str(&format!("; controller events: {}", other.join(", ")));
    }
    s
}

/// Sends `setup` and waits until `collection`'s frontier passes `t`, or the
/// replica reports an error, or [`SETUP_BOUND`] passes.
fn settle(
    rt: &Runtime,
    ctl: &Controller,
    setup: impl FnOnce(&Controller) -> Result<(), ControllerError>,
    collection: u64,
    t: u64,
) -> Result<(), String> {
    let events = ctl.events();
    setup(ctl).map_err(|e| e.to_string())?;
    let mut seen = Vec::new();
    let result = rt.block_on(async {
        let wait = tokio::time::timeout(SETUP_BOUND, ctl.wait_for_frontier(collection, t));
        tokio::select! {
            r = wait => match r {
                Ok(r) => r.map_err(|e| e.to_string()),
                Err(_) => Err(format!(
                    "collection {collection}'s frontier did not pass {t} within {SETUP_BOUND:?}"
                )),
            },
            e = first_replica_error(events, &mut seen) => Err(e),
        }
    });
    result.map_err(|e| format!("{e}{}", summarize(&seen)))
}

/// Runs one controller operation within [`OP_BOUND`]; panics (caught by
/// [`strategies`], which skips the strategy on this shape) if it fails.
fn op<T>(
    rt: &Runtime,
    what: &str,
    fut: impl std::future::Future<Output = Result<T, ControllerError>>,
) -> T {
    harness::op(rt, what, OP_BOUND, fut)
}

fn strategies(c: &mut Criterion) {
    let run = Run::from_env();
    for (name, bytes) in PAYLOADS {
        let rows = payload(bytes);
        eprintln!(
            "strategies: {name}: {} rows of {COLUMNS} columns, {bytes} bytes of row data, a {}-byte WriteInput frame to each process",
            rows.len(),
            lockstep_benches::write_len(WRITE_INPUT, &rows)
        );
    }
    let rt = rt();
    let _guard = rt.enter();
    let mut replica_id = 1000;
    for &(p, w) in &run.shapes {
        let shape = format!("{p}x{w}");
        for &strategy in &run.strategies {
            replica_id += 2;
            let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| {
                measure(c, &run, &rt, replica_id, strategy, p, w)
            }));
            match outcome {
                Ok(Ok(())) => {}
                Ok(Err(why)) => skip(&strategy.to_string(), &shape, &why),
                Err(panic) => {
                    let why = harness::panic_message(&*panic);
                    skip(
                        &strategy.to_string(),
                        &shape,
                        &format!("failed mid-run: {why}"),
                    );
                }
            }
        }
    }
}

/// Every measurement of one strategy on one shape. `Err` means the setup
/// failed and nothing was measured past that point.
fn measure(
    c: &mut Criterion,
    run: &Run,
    rt: &Runtime,
    replica_id: u64,
    variant: Variant,
    p: usize,
    w: u32,
) -> Result<(), String> {
    let id = format!("{variant}/{p}x{w}");
    eprintln!("strategies: {id}: starting a {p}x{w} replica");
    let r = rt.block_on(replica::start_on(
        replica_id,
        p,
        w,
        run.log_url(variant).as_deref(),
    ));
    let ctl = replica::controller(&r, variant.strategy);
    let rows: Vec<Update> = lockstep_benches::rows(100);
    settle(
        rt,
        &ctl,
        |ctl| {
            ctl.write_input(INPUT, rows, 1)?;
            ctl.create_dataflow(small_dataflow(PEEK_DATAFLOW))
        },
        1000 + PEEK_DATAFLOW,
        0,
    )
    .map_err(|e| {
        format!(
            "setup (write 100 rows, install a dataflow): {e}\n{}",
            replica::log_tail(&r, 10)
        )
    })?;

    let mut g = run.group(c, "small_command");
    g.bench_function(&id, |b| b.iter(|| op(rt, "ping", ctl.ping())));
    g.finish();

    let mut g = run.group(c, "peek");
    g.bench_function(&id, |b| {
        b.iter(|| {
            let rows = op(rt, "peek", ctl.peek(1000 + PEEK_DATAFLOW, 0));
            assert_eq!(rows.len(), 100, "peek answered a wrong row count");
        })
    });
    g.finish();

    // IDs are never reused: a new dataflow each iteration.
    let mut next = 20_000u64;
    let mut g = run.group(c, "install");
    g.bench_function(&id, |b| {
        b.iter(|| {
            next += 1;
            let d = small_dataflow(next);
            ctl.create_dataflow(d.clone()).expect("create");
            op(rt, "install", ctl.wait_for_frontier(1000 + next, 0));
            ctl.drop_dataflow(&d).expect("drop");
        })
    });
    g.finish();

    settle(
        rt,
        &ctl,
        |ctl| {
            ctl.write_input(WRITE_INPUT, vec![], 1)?;
            ctl.create_dataflow(dataflow_over(WRITE_DATAFLOW, WRITE_INPUT, WRITE_EXPORT))
        },
        WRITE_EXPORT,
        0,
    )
    .map_err(|e| {
        format!(
            "setup of the write benchmarks: {e}\n{}",
            replica::log_tail(&r, 10)
        )
    })?;
    // Each write inserts the payload at a new time, the next retracts it, so
    // the arranged collection stays small.
    let mut time = 1u64;
    for (name, bytes) in PAYLOADS {
        let rows = payload(bytes);
        let mut g = run.group(c, name);
        g.throughput(Throughput::Bytes(bytes as u64));
        g.bench_function(&id, |b| {
            b.iter_batched(
                || {
                    let t = time;
                    time += 1;
                    (t, lockstep_benches::alternating_write(&rows, t))
                },
                |(t, updates)| {
                    ctl.write_input(WRITE_INPUT, updates, t + 1).expect("write");
                    op(rt, "write", ctl.wait_for_frontier(WRITE_EXPORT, t));
                },
                BatchSize::PerIteration,
            )
        });
        g.finish();
    }
    ctl.shutdown();
    drop(r);

    reconcile(c, run, rt, replica_id + 1, variant, p, w, &id)
}

/// Reconciliation after a controller restart with 10, 100 and 1,000
/// dataflows installed, on a fresh replica.
#[allow(clippy::too_many_arguments)]
fn reconcile(
    c: &mut Criterion,
    run: &Run,
    rt: &Runtime,
    replica_id: u64,
    variant: Variant,
    p: usize,
    w: u32,
    id: &str,
) -> Result<(), String> {
    let r: BenchReplica = rt.block_on(replica::start_on(
        replica_id,
        p,
        w,
        run.log_url(variant).as_deref(),
    ));
    let strategy = variant.strategy;
    let mut ctl = replica::controller(&r, strategy);
    let mut epoch = 1;
    let mut installed = 0u64;
    for n in [10u64, 100, 1000] {
        let t = Instant::now();
        settle(
            rt,
            &ctl,
            |ctl| {
                if installed == 0 {
                    ctl.write_input(INPUT, vec![], 1)?;
                }
                for d in installed + 1..=n {
                    ctl.create_dataflow(small_dataflow(d))?;
                }
                Ok(())
            },
            1000 + n,
            0,
        )
        .map_err(|e| {
            format!(
                "setup (install {n} dataflows): {e}\n{}",
                replica::log_tail(&r, 10)
            )
        })?;
        eprintln!(
            "strategies: {id}: {} more dataflows installed in {:.2?}",
            n - installed,
            t.elapsed()
        );
        installed = n;
        let before = rt.block_on(ctl.statuses()).map_err(|e| e.to_string())?;
        let history = rt.block_on(ctl.history()).map_err(|e| e.to_string())?;
        ctl.shutdown();

        let mut g = run.group(c, &format!("reconcile_{n}"));
        g.sampling_mode(SamplingMode::Flat);
        g.bench_function(id, |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    epoch += 1;
                    let t = Instant::now();
                    let c = replica::controller_with(&r, strategy, epoch, history.clone());
                    let mut events = c.events();
                    let after = match rt.block_on(tokio::time::timeout(OP_BOUND, c.statuses())) {
                        Ok(Ok(after)) => after,
                        failed => {
                            let e = match failed {
                                Ok(Err(e)) => e.to_string(),
                                _ => {
                                    format!("no full status from every worker within {OP_BOUND:?}")
                                }
                            };
                            let mut seen = Vec::new();
                            while let Ok(ev) = events.try_recv() {
                                seen.push(ev);
                            }
                            panic!(
                                "reconciliation at epoch {epoch}: {e}{}\n{}",
                                summarize(&seen),
                                replica::log_tail(&r, 10)
                            )
                        }
                    };
                    total += t.elapsed();
                    replica::assert_nothing_rebuilt(&before, &after);
                    c.shutdown();
                }
                total
            })
        });
        g.finish();
        epoch += 1;
        ctl = replica::controller_with(&r, strategy, epoch, history);
    }
    ctl.shutdown();
    Ok(())
}

criterion_group!(benches, strategies);
criterion_main!(benches);
