//! The strategies over a modelled network: every connection of a replica
//! (controller to process, and process to process on the timely mesh) goes
//! through a delaying relay ([`lockstep_benches::relay`]), and the one-way
//! delay is swept.
//!
//! - `network/tcp_rtt/{direct,0us,100us,250us,500us}`: a 64-byte ping-pong
//!   with a loopback echo server, directly and through one relay. The
//!   `0us` point against `direct` is the relay's own cost per round trip
//!   (two relayed hops).
//! - For each strategy (`broadcast`, `barrier`, `naive`, `log`) one relayed
//!   replica of 4x1 (`$LOCKSTEP_BENCH_NET_SHAPE`, e.g. `2x1`, changes it),
//!   measured at each delay: `network/{small_command,install,write_1MiB}/
//!   {strategy}/{p}x{w}/{d}us` (the same operations as the `strategies`
//!   bench). `broadcast` is also measured without relays
//!   (`.../broadcast/{p}x{w}/direct`): the relay's cost on the gRPC path.
//! - After the write measurements, one more 1 MiB write per strategy is
//!   counted on the relays: the bytes the controller sent to each process
//!   and the bytes the processes sent each other on the timely mesh, as
//!   tab-separated lines (`strategy shape process controller_bytes
//!   mesh_bytes batch_bytes`; `mesh_bytes` is the mesh total, on process
//!   0's line; `batch_bytes` the encoded size of the whole write, what one
//!   unsplit copy takes) appended to `$LOCKSTEP_BENCH_WIRE` if set.
//!
//! `cargo xtask bench` fits latency against delay per strategy: the slope is
//! the number of one-way delays on the operation's critical path.
//!
//! Quick mode (`$LOCKSTEP_BENCH_QUICK=1` or `--quick`) shortens warm-up and
//! measurement. `$LOCKSTEP_BENCH_STRATEGIES` restricts the strategies.
//!
//! Needs the release replica: `cargo build --release -p lockstep-replica`.

#![allow(missing_docs)] // criterion_group! generates undocumented functions

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::measurement::WallTime;
use criterion::{criterion_group, criterion_main, BenchmarkGroup, Criterion};
use lockstep_benches::harness::{self, env_shape, rt};
use lockstep_benches::relay::{Link, Relay};
use lockstep_benches::replica::{self, BenchReplica};
use lockstep_benches::{dataflow_over, payload, small_dataflow};
use lockstep_controller::{Controller, ControllerError};
use lockstep_protocol::{Strategy, Update};
use tokio::runtime::Runtime;

/// One-way delays swept, in microseconds.
const DELAYS_US: [u64; 4] = [0, 100, 250, 500];
/// The input every small dataflow reads.
const INPUT: u64 = 1;
/// The input the writes go to, and the dataflow and export over it.
const WRITE_INPUT: u64 = 2;
const WRITE_DATAFLOW: u64 = 2;
const WRITE_EXPORT: u64 = 3002;
/// Bytes of row data per write.
const WRITE_BYTES: usize = 1 << 20;
/// How long one operation may take before the strategy is given up.
const OP_BOUND: Duration = Duration::from_secs(20);

fn group<'a>(c: &'a mut Criterion, name: &str) -> BenchmarkGroup<'a, WallTime> {
    let mut g = c.benchmark_group(format!("network/{name}"));
    // Quick mode still takes 20 samples: the sweep is short, and the
    // fitted slopes need less noise than one figure does.
    harness::timings(&mut g, 20, 1500);
    g
}

fn op<T>(
    rt: &Runtime,
    what: &str,
    fut: impl std::future::Future<Output = Result<T, ControllerError>>,
) -> T {
    harness::op(rt, what, OP_BOUND, fut)
}

/// A 64-byte ping-pong with an echo server, directly and through a relay
/// at each delay.
fn tcp_rtt(c: &mut Criterion) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let echo = listener.local_addr().expect("addr");
    std::thread::spawn(move || {
        for s in listener.incoming() {
            let Ok(mut s) = s else { continue };
            std::thread::spawn(move || {
                let _ = s.set_nodelay(true);
                let mut buf = [0u8; 64];
                while s.read_exact(&mut buf).is_ok() {
                    if s.write_all(&buf).is_err() {
                        break;
                    }
                }
            });
        }
    });
    let ping = |b: &mut criterion::Bencher<'_>, s: &mut TcpStream| {
        let mut buf = [7u8; 64];
        b.iter(|| {
            s.write_all(&buf).expect("ping");
            s.read_exact(&mut buf).expect("pong");
        })
    };
    let mut g = group(c, "tcp_rtt");
    let mut s = TcpStream::connect(echo).expect("connect");
    s.set_nodelay(true).expect("nodelay");
    g.bench_function("direct", |b| ping(b, &mut s));
    let link = Link::new();
    let relay = Relay::to(echo, link.clone()).expect("relay");
    let mut s = TcpStream::connect(relay.addr()).expect("connect");
    s.set_nodelay(true).expect("nodelay");
    for d in DELAYS_US {
        link.set_delay(Duration::from_micros(d));
        g.bench_function(format!("{d}us"), |b| ping(b, &mut s));
    }
    g.finish();
}

fn strategies() -> Vec<Strategy> {
    let mut all = vec![
        Strategy::Broadcast,
        Strategy::Barrier,
        Strategy::Naive,
        Strategy::Log,
    ];
    if let Ok(only) = std::env::var("LOCKSTEP_BENCH_STRATEGIES") {
        let wanted: Vec<&str> = only.split(',').map(str::trim).collect();
        all.retain(|s| wanted.contains(&s.to_string().as_str()));
    }
    all
}

/// The state one replica's measurements share.
struct Bench<'a> {
    rt: &'a Runtime,
    ctl: Controller,
    /// The next dataflow ID to install.
    next: u64,
    /// The next write time.
    time: u64,
    rows: Vec<lockstep_protocol::Row>,
}

impl Bench<'_> {
    /// Writes to the inputs and installs the write dataflow, then waits;
    /// panics with the tail of `r`'s process logs if that fails.
    fn setup(&mut self, r: &BenchReplica) {
        self.ctl.write_input(INPUT, vec![], 1).expect("write input");
        self.ctl
            .write_input(WRITE_INPUT, vec![], 1)
            .expect("write input");
        self.ctl
            .create_dataflow(dataflow_over(WRITE_DATAFLOW, WRITE_INPUT, WRITE_EXPORT))
            .expect("create");
        let wait = tokio::time::timeout(OP_BOUND, self.ctl.wait_for_frontier(WRITE_EXPORT, 0));
        match self.rt.block_on(wait) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => panic!("setup: {e}\n{}", replica::log_tail(r, 10)),
            Err(_) => panic!(
                "setup: no answer within {OP_BOUND:?}\n{}",
                replica::log_tail(r, 10)
            ),
        }
    }

    fn install(&mut self) {
        self.next += 1;
        let d = small_dataflow(self.next);
        self.ctl.create_dataflow(d.clone()).expect("create");
        op(
            self.rt,
            "install",
            self.ctl.wait_for_frontier(1000 + self.next, 0),
        );
        self.ctl.drop_dataflow(&d).expect("drop");
    }

    /// The next write: the payload inserted at odd times, retracted at even
    /// ones, so that the arrangement stays small.
    fn next_write(&mut self) -> (u64, Vec<Update>) {
        let t = self.time;
        self.time += 1;
        (t, lockstep_benches::alternating_write(&self.rows, t))
    }

    fn write(&self, (t, updates): (u64, Vec<Update>)) {
        self.ctl
            .write_input(WRITE_INPUT, updates, t + 1)
            .expect("write");
        op(
            self.rt,
            "write",
            self.ctl.wait_for_frontier(WRITE_EXPORT, t),
        );
    }

    /// Measures the three operations at `point` (`{d}us` or `direct`).
    fn measure(&mut self, c: &mut Criterion, id: &str) {
        let mut g = group(c, "small_command");
        g.bench_function(id, |b| b.iter(|| op(self.rt, "ping", self.ctl.ping())));
        g.finish();
        let mut g = group(c, "install");
        g.bench_function(id, |b| b.iter(|| self.install()));
        g.finish();
        let mut g = group(c, "write_1MiB");
        g.throughput(criterion::Throughput::Bytes(WRITE_BYTES as u64));
        g.bench_function(id, |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    // Building the rows is not measured.
                    let w = self.next_write();
                    let t = Instant::now();
                    self.write(w);
                    total += t.elapsed();
                }
                total
            })
        });
        g.finish();
    }
}

fn network(c: &mut Criterion) {
    tcp_rtt(c);
    let rt = rt();
    let _guard = rt.enter();
    let (p, w) = env_shape("LOCKSTEP_BENCH_NET_SHAPE", (4, 1));
    let shape = format!("{p}x{w}");
    let rows = payload(WRITE_BYTES);
    let mut replica_id = 3000;
    for strategy in strategies() {
        replica_id += 2;
        let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| {
            measure(c, &rt, replica_id, strategy, p, w, &rows)
        }));
        if let Err(panic) = outcome {
            let why = harness::panic_message(&*panic);
            eprintln!("network: SKIPPED {strategy} on {shape}: {why}");
            lockstep_benches::record_skip(
                &format!("network {strategy}"),
                &shape,
                &format!("failed: {why}"),
            );
        }
    }
}

/// One strategy: without relays (broadcast only), then relayed at each
/// delay, then the bytes of one write.
fn measure(
    c: &mut Criterion,
    rt: &Runtime,
    replica_id: u64,
    strategy: Strategy,
    p: usize,
    w: u32,
    rows: &[lockstep_protocol::Row],
) {
    let shape = format!("{p}x{w}");
    if strategy == Strategy::Broadcast {
        let r = rt.block_on(replica::start(replica_id, p, w));
        let mut bench = bench(rt, &r, strategy, rows);
        eprintln!("network: {strategy}/{shape}/direct");
        bench.measure(c, &format!("{strategy}/{shape}/direct"));
        bench.ctl.shutdown();
    }
    let link = Link::new();
    let r = rt.block_on(replica::start_relayed(replica_id + 1, p, w, link.clone()));
    let mut bench = bench(rt, &r, strategy, rows);
    for d in DELAYS_US {
        link.set_delay(Duration::from_micros(d));
        eprintln!("network: {strategy}/{shape}/{d}us");
        bench.measure(c, &format!("{strategy}/{shape}/{d}us"));
    }
    count_write(&mut bench, &r, strategy, &shape, p);
    bench.ctl.shutdown();
}

/// A controller of `r` with its inputs and write dataflow set up.
fn bench<'a>(
    rt: &'a Runtime,
    r: &BenchReplica,
    strategy: Strategy,
    rows: &[lockstep_protocol::Row],
) -> Bench<'a> {
    let mut b = Bench {
        rt,
        ctl: replica::controller(r, strategy),
        next: 20_000,
        time: 1,
        rows: rows.to_vec(),
    };
    b.setup(r);
    b
}

/// One more write, counted on the relays: bytes per process from the
/// controller, and the mesh total.
fn count_write(b: &mut Bench<'_>, r: &BenchReplica, strategy: Strategy, shape: &str, p: usize) {
    let (mesh, ctl) = r.relays.split_at(p);
    let total = |rs: &[Arc<Relay>]| -> Vec<u64> {
        rs.iter()
            .map(|r| {
                r.counters().to_target.load(Ordering::Relaxed)
                    + r.counters().from_target.load(Ordering::Relaxed)
            })
            .collect()
    };
    let to_process = |rs: &[Arc<Relay>]| -> Vec<u64> {
        rs.iter()
            .map(|r| r.counters().to_target.load(Ordering::Relaxed))
            .collect()
    };
    // Let heartbeats and frontier reports of earlier writes drain first.
    let w = b.next_write();
    b.write(w);
    let (mesh0, ctl0) = (total(mesh), to_process(ctl));
    let w = b.next_write();
    b.write(w);
    let (mesh1, ctl1) = (total(mesh), to_process(ctl));
    let mesh_bytes: u64 = mesh1.iter().sum::<u64>() - mesh0.iter().sum::<u64>();
    let batch = lockstep_benches::write_len(WRITE_INPUT, &b.rows);
    let mut lines = String::new();
    for i in 0..p {
        let sent = ctl1[i] - ctl0[i];
        let mesh = if i == 0 { mesh_bytes } else { 0 };
        eprintln!("network: {strategy}/{shape}: a 1 MiB write sent {sent} bytes to process {i}");
        lines.push_str(&format!(
            "{strategy}\t{shape}\t{i}\t{sent}\t{mesh}\t{batch}\n"
        ));
    }
    eprintln!("network: {strategy}/{shape}: the mesh carried {mesh_bytes} bytes");
    if let Ok(path) = std::env::var("LOCKSTEP_BENCH_WIRE") {
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .unwrap_or_else(|e| panic!("{path}: {e}"));
        f.write_all(lines.as_bytes())
            .unwrap_or_else(|e| panic!("{path}: {e}"));
    }
}

criterion_group!(benches, network);
criterion_main!(benches);
