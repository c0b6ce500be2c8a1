//! Replica costs on real processes (2 processes x 2 workers): start to first
//! Hello answered, and create-peek-drop of a small dataflow. Per-strategy
//! figures (small commands, peeks, installs, writes, reconciliation) are in
//! `strategies.rs`.

#![allow(missing_docs)] // criterion_group! generates undocumented functions

use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};
use lockstep_benches::harness::rt;
use lockstep_benches::replica;
use lockstep_benches::small_dataflow;
use lockstep_protocol::{Strategy, Update};

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
    let rows: Vec<Update> = lockstep_benches::rows(100);
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
    g.finish();
    ctl.shutdown();
}

criterion_group!(benches, start, dataflows);
criterion_main!(benches);
