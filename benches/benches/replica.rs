//! Replica costs on real processes (2 processes x 2 workers): start to first
//! Hello answered, create-peek-drop of a small dataflow, peek latency, and
//! WriteInput throughput.

#![allow(missing_docs)] // criterion_group! generates undocumented functions

use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use lockstep_benches::replica;
use lockstep_benches::small_dataflow;
use lockstep_protocol::{Strategy, Update};

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime")
}

fn start(c: &mut Criterion) {
    let rt = rt();
    let mut g = c.benchmark_group("replica");
    g.sample_size(10);
    g.bench_function("start_2x2_to_hello_answered", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for i in 0..iters {
                total += rt.block_on(async {
                    let t = Instant::now();
                    let r = replica::start(100 + i, 2, 2).await;
                    let c = replica::controller(&r, Strategy::Barrier);
                    c.statuses().await.expect("statuses");
                    let elapsed = t.elapsed();
                    c.shutdown();
                    drop(r);
                    elapsed
                });
            }
            total
        })
    });
    g.finish();
}

fn dataflows(c: &mut Criterion) {
    let rt = rt();
    let _guard = rt.enter();
    let r = rt.block_on(replica::start(1, 2, 2));
    let ctl = replica::controller(&r, Strategy::Barrier);
    let rows: Vec<Update> = (0..100)
        .map(|i| Update {
            row: vec![i, i * 10],
            time: 0,
            diff: 1,
        })
        .collect();
    ctl.write_input(1, rows, 1).expect("write");
    let base = small_dataflow(1);
    ctl.create_dataflow(base.clone()).expect("create");
    rt.block_on(ctl.wait_for_frontier(1001, 0))
        .expect("frontier");

    let mut g = c.benchmark_group("replica");
    let mut id = 10_000u64;
    g.bench_function("create_peek_drop_small_dataflow", |b| {
        b.iter(|| {
            id += 1;
            let d = small_dataflow(id);
            ctl.create_dataflow(d.clone()).expect("create");
            let rows = rt.block_on(ctl.peek(1000 + id, 0)).expect("peek");
            assert_eq!(rows.len(), 100);
            ctl.drop_dataflow(&d).expect("drop");
        })
    });
    g.bench_function("peek_100_rows", |b| {
        b.iter(|| rt.block_on(ctl.peek(1001, 0)).expect("peek"))
    });
    let mut time = 1u64;
    g.throughput(Throughput::Elements(1000));
    g.bench_function("write_input_1000_rows_until_frontier", |b| {
        b.iter(|| {
            let rows: Vec<Update> = (0..1000)
                .map(|i| Update {
                    row: vec![i, time as i64],
                    time,
                    diff: 1,
                })
                .collect();
            ctl.write_input(1, rows, time + 1).expect("write");
            rt.block_on(ctl.wait_for_frontier(1001, time))
                .expect("frontier");
            time += 1;
        })
    });
    g.finish();
    ctl.shutdown();
}

criterion_group!(benches, start, dataflows, strategies);
criterion_main!(benches);

/// Strategy costs on the same kind of replica in one run: dataflow install
/// latency and small-command latency under `naive` and `barrier` (broadcast
/// and log are not built yet), and collective reconciliation of 1,000
/// unchanged dataflows after a controller restart.
fn strategies(c: &mut Criterion) {
    let rt = rt();
    let _guard = rt.enter();
    let mut g = c.benchmark_group("strategy");
    for strategy in [Strategy::Naive, Strategy::Barrier] {
        let r = rt.block_on(replica::start(200 + strategy as u64, 2, 2));
        let ctl = replica::controller(&r, strategy);
        let rows: Vec<Update> = (0..100)
            .map(|i| Update {
                row: vec![i, i * 10],
                time: 0,
                diff: 1,
            })
            .collect();
        ctl.write_input(1, rows, 1).expect("write");
        // IDs are never reused: a new dataflow each iteration.
        let mut id = 20_000u64;
        g.bench_function(format!("{strategy}/install_small_dataflow"), |b| {
            b.iter(|| {
                id += 1;
                let d = small_dataflow(id);
                ctl.create_dataflow(d.clone()).expect("create");
                rt.block_on(ctl.wait_for_frontier(1000 + id, 0))
                    .expect("installed");
                ctl.drop_dataflow(&d).expect("drop");
            })
        });
        g.bench_function(format!("{strategy}/small_command_all_workers"), |b| {
            b.iter(|| rt.block_on(ctl.ping()).expect("ping"))
        });
        ctl.shutdown();
    }
    g.finish();

    let mut g = c.benchmark_group("reconcile");
    g.sample_size(10);
    let r = rt.block_on(replica::start(300, 2, 2));
    let ctl = replica::controller(&r, Strategy::Barrier);
    ctl.write_input(1, vec![], 1).expect("write");
    for id in 1..=1000u64 {
        ctl.create_dataflow(small_dataflow(id)).expect("create");
    }
    rt.block_on(ctl.wait_for_frontier(2000, 0))
        .expect("all installed");
    let before = rt.block_on(ctl.statuses()).expect("statuses");
    let history = rt.block_on(ctl.history()).expect("history");
    ctl.shutdown();
    let mut epoch = 1;
    g.bench_function("barrier/restart_1000_unchanged_dataflows", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                epoch += 1;
                let t = Instant::now();
                let c = replica::controller_with(&r, Strategy::Barrier, epoch, history.clone());
                let after = rt.block_on(c.statuses()).expect("statuses");
                total += t.elapsed();
                for (x, y) in before.iter().zip(&after) {
                    assert_eq!(x.creation_log, y.creation_log, "a dataflow was rebuilt");
                }
                c.shutdown();
            }
            total
        })
    });
    g.finish();
}
