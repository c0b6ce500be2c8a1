//! How a broadcast strategy should order commands inside a timely cluster:
//! timely's `Sequencer` against the explicit broadcast exchange the replica
//! uses (worker 0 sends into a dataflow every worker built first, at start-up,
//! and every worker reads it in order). Issue #6 asks to measure both and keep
//! the better; the replica keeps the exchange.
//!
//! One process with 4 worker threads (timely's process allocator), so what
//! differs is the ordering machinery, not the network. Each iteration is one
//! command from worker 0 until every worker has it; waiting workers park
//! (50 µs at most), as the replica's do.

#![allow(missing_docs)] // criterion_group! generates undocumented functions

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use serde_bytes::ByteBuf;
use timely::dataflow::operators::vec::Broadcast;
use timely::dataflow::operators::Inspect;
use timely::dataflow::InputHandleVec;
use timely::synchronization::Sequencer;

const WORKERS: usize = 4;

#[derive(Clone, Copy, Debug)]
enum Mechanism {
    Sequencer,
    Exchange,
}

/// Sends `n` commands of `size` bytes from worker 0, one at a time, each
/// until every worker received it; returns the total time.
fn run(mechanism: Mechanism, n: u64, size: usize) -> Duration {
    let received = Arc::new(AtomicU64::new(0));
    let (tx, rx) = mpsc::channel();
    // The Sequencer orders by elapsed time: every worker needs the same origin.
    let origin = Instant::now();
    let guards = timely::execute(timely::Config::process(WORKERS), move |worker| {
        let received = Arc::clone(&received);
        let index = worker.index();
        let payload = ByteBuf::from(vec![7u8; size]);
        match mechanism {
            Mechanism::Sequencer => {
                let mut seq: Sequencer<ByteBuf> = Sequencer::new(worker, origin);
                let start = Instant::now();
                for k in 0..n {
                    if index == 0 {
                        seq.push(payload.clone());
                    }
                    let mut got = false;
                    while received.load(Ordering::SeqCst) < (k + 1) * WORKERS as u64 {
                        if !got && seq.next().is_some() {
                            got = true;
                            received.fetch_add(1, Ordering::SeqCst);
                        }
                        // Park (4 workers share 2 cores): data arriving wakes
                        // a worker; the timeout covers the shared counter.
                        worker.step_or_park(Some(Duration::from_micros(50)));
                    }
                }
                if index == 0 {
                    tx.send(start.elapsed()).expect("send");
                }
                // Let the others finish their last step.
                for _ in 0..100 {
                    worker.step();
                }
            }
            Mechanism::Exchange => {
                let mut input = InputHandleVec::new();
                let inbox: Rc<RefCell<u64>> = Rc::default();
                let sink = Rc::clone(&inbox);
                worker.dataflow::<u64, _, _>(|scope| {
                    input
                        .to_stream(scope)
                        .broadcast()
                        .inspect(move |_b: &ByteBuf| *sink.borrow_mut() += 1);
                });
                let start = Instant::now();
                for k in 0..n {
                    if index == 0 {
                        input.send(payload.clone());
                        input.flush();
                    }
                    let mut got = false;
                    while received.load(Ordering::SeqCst) < (k + 1) * WORKERS as u64 {
                        if !got && *inbox.borrow() > k {
                            got = true;
                            received.fetch_add(1, Ordering::SeqCst);
                        }
                        worker.step_or_park(Some(Duration::from_micros(50)));
                    }
                }
                if index == 0 {
                    tx.send(start.elapsed()).expect("send");
                }
            }
        }
    })
    .expect("timely");
    drop(guards);
    rx.recv().expect("elapsed")
}

fn sequencing(c: &mut Criterion) {
    let mut g = c.benchmark_group("sequencing");
    g.sample_size(10);
    for (label, size) in [("small", 64usize), ("1MiB", 1 << 20)] {
        g.throughput(Throughput::Bytes(size as u64));
        for m in [Mechanism::Sequencer, Mechanism::Exchange] {
            g.bench_with_input(
                BenchmarkId::new(format!("{m:?}").to_lowercase(), label),
                &size,
                |b, &size| b.iter_custom(|iters| run(m, iters, size)),
            );
        }
    }
    g.finish();
}

criterion_group!(benches, sequencing);
criterion_main!(benches);
