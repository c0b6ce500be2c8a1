//! The physical floors of the replica measurements, measured in the same run
//! (issue 33): what the machine itself costs for the same bytes, with no
//! lockstep in the way, so that `cargo xtask bench` can state each cost as
//! a ratio to its floor.
//!
//! - `floors/tcp_round_trip/{small,install}/{n}`: a frame the size of an
//!   encoded small command (the StatusRequest of `small_command`) or of a
//!   small dataflow's CreateDataflow (`install`), length-prefixed like the
//!   replica's frames, written to `n` echo servers on loopback at once,
//!   until every one answered with a frame the size of a worker's Status.
//!   Each server is a thread with its own current-thread runtime (as a
//!   replica process's connection task is); the client runs on a
//!   one-worker runtime, like the benches' controller. `n` is the replica's
//!   process count: the controller talks to every process.
//!
//! - `floors/worker_handoff/{small,install}/{n}x{w}`: the same round trip
//!   to `n` servers shaped like a replica process: each server's connection
//!   task hands every frame to `w` worker threads (a std channel each and an
//!   unpark, as `server::Workers::send` does), every worker answers with a
//!   Status-sized frame through a tokio channel (as a worker's responses
//!   reach the connection), and the connection writes each answer as it
//!   comes. The client waits for `w` answers per server. What this adds to
//!   the round trip is the cost of a process whose workers are threads
//!   apart from its connection: two thread wake-ups per worker, on a
//!   machine with fewer cores than threads. It is reported as the bound of
//!   the small command and install goals (`cargo xtask bench`), not as
//!   their floor.
//!
//! Timely's own build of the install's dataflow is measured by the scale
//! bench (`limits/install/timely/1x1`); the install floor is the round trip
//! plus that build.

#![allow(missing_docs)] // criterion_group! generates undocumented functions

use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion};
use lockstep_benches::harness;
use lockstep_protocol::{
    Command, CommandKind, Response, ResponseKind, Status, Strategy, WireMessage,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Encoded sizes of the frames the measurements carry.
fn sizes() -> (usize, usize, usize) {
    let small = Command {
        seqno: 1,
        strategy: Strategy::Barrier,
        kind: CommandKind::StatusRequest { full: false },
    }
    .encode_to_vec()
    .len();
    let install = Command {
        seqno: 1,
        strategy: Strategy::Barrier,
        kind: CommandKind::CreateDataflow(lockstep_benches::small_dataflow(20_001)),
    }
    .encode_to_vec()
    .len();
    let status = Response {
        process_index: 0,
        kind: ResponseKind::Status(Status {
            worker_index: 0,
            epoch: 1,
            nonce: 1,
            applied_seqno: 1,
            history_hash: None,
            creation_log: Vec::new(),
            installed: vec![1],
        }),
    }
    .encode_to_vec()
    .len();
    (small, install, status)
}

/// Reads one length-prefixed frame into `buf`; false at end of stream.
async fn read_frame(s: &mut TcpStream, buf: &mut Vec<u8>) -> bool {
    let mut len = [0u8; 4];
    if s.read_exact(&mut len).await.is_err() {
        return false;
    }
    buf.resize(u32::from_be_bytes(len) as usize, 0);
    s.read_exact(buf).await.is_ok()
}

/// Writes one length-prefixed frame of `payload`.
async fn write_frame(s: &mut TcpStream, payload: &[u8]) {
    let mut frame = Vec::with_capacity(4 + payload.len());
    frame.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    frame.extend_from_slice(payload);
    s.write_all(&frame).await.expect("write a frame");
}

/// A non-blocking listener on a free loopback port, and its address.
fn loopback_listener() -> (std::net::TcpListener, std::net::SocketAddr) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    listener.set_nonblocking(true).expect("nonblocking");
    (listener, addr)
}

/// An echo server on its own thread: answers every frame with a frame of
/// `answer` bytes. Returns its address.
fn echo_server(answer: usize) -> std::net::SocketAddr {
    let (listener, addr) = loopback_listener();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async move {
            let listener = TcpListener::from_std(listener).expect("listener");
            loop {
                let Ok((mut s, _)) = listener.accept().await else {
                    return;
                };
                let _ = s.set_nodelay(true);
                tokio::spawn(async move {
                    let reply = vec![7u8; answer];
                    let mut buf = Vec::new();
                    while read_frame(&mut s, &mut buf).await {
                        write_frame(&mut s, &reply).await;
                    }
                });
            }
        });
    });
    addr
}

/// A server shaped like a replica process: a connection task on its own
/// thread, `workers` worker threads, each frame handed to every worker and
/// each worker's answer (`answer` bytes) written back as it comes. Returns
/// its address.
fn handoff_server(workers: usize, answer: usize) -> std::net::SocketAddr {
    use std::sync::mpsc as std_mpsc;
    let (listener, addr) = loopback_listener();
    let (answers_tx, mut answers) = tokio::sync::mpsc::unbounded_channel::<Vec<u8>>();
    let mut senders = Vec::new();
    let mut threads = Vec::new();
    for _ in 0..workers {
        let (tx, rx) = std_mpsc::channel::<Vec<u8>>();
        let answers_tx = answers_tx.clone();
        let t = std::thread::spawn(move || loop {
            match rx.try_recv() {
                Ok(_frame) => {
                    if answers_tx.send(vec![7u8; answer]).is_err() {
                        return;
                    }
                }
                // Parked until a frame's unpark, as a worker between steps.
                Err(std_mpsc::TryRecvError::Empty) => {
                    std::thread::park_timeout(Duration::from_millis(5))
                }
                Err(std_mpsc::TryRecvError::Disconnected) => return,
            }
        });
        senders.push(tx);
        threads.push(t.thread().clone());
    }
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async move {
            let listener = TcpListener::from_std(listener).expect("listener");
            let Ok((s, _)) = listener.accept().await else {
                return;
            };
            let _ = s.set_nodelay(true);
            let (mut r, mut w) = s.into_split();
            let writer = tokio::spawn(async move {
                while let Some(a) = answers.recv().await {
                    let mut frame = Vec::with_capacity(4 + a.len());
                    frame.extend_from_slice(&(a.len() as u32).to_be_bytes());
                    frame.extend_from_slice(&a);
                    if w.write_all(&frame).await.is_err() {
                        return;
                    }
                }
            });
            let mut len = [0u8; 4];
            while r.read_exact(&mut len).await.is_ok() {
                let mut buf = vec![0u8; u32::from_be_bytes(len) as usize];
                if r.read_exact(&mut buf).await.is_err() {
                    break;
                }
                for (tx, t) in senders.iter().zip(&threads) {
                    let _ = tx.send(buf.clone());
                    t.unpark();
                }
            }
            drop(senders);
            writer.abort();
        });
    });
    addr
}

/// Connects to every server at `addrs`, without Nagle's delay.
async fn connect_all(addrs: Vec<std::net::SocketAddr>) -> Vec<TcpStream> {
    let mut conns = Vec::new();
    for a in addrs {
        let s = TcpStream::connect(a).await.expect("connect");
        s.set_nodelay(true).expect("nodelay");
        conns.push(s);
    }
    conns
}

/// One round: `payload` to every connection, then `answers` frames of
/// `status` bytes from each, within 5 s.
async fn round(conns: &mut [TcpStream], payload: &[u8], answers: usize, status: usize) {
    let round = async {
        // Every frame goes out before any answer is awaited, as the
        // controller's do.
        for s in conns.iter_mut() {
            write_frame(s, payload).await;
        }
        let mut buf = Vec::new();
        for s in conns.iter_mut() {
            for _ in 0..answers {
                assert!(read_frame(s, &mut buf).await, "the server left");
                assert_eq!(buf.len(), status);
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(5), round)
        .await
        .expect("a loopback round trip within 5 s");
}

fn floors(c: &mut Criterion) {
    let (small, install, status) = sizes();
    let rt = harness::rt();
    let mut g = c.benchmark_group("floors");
    harness::timings(&mut g, 30, 1000);
    for n in [1usize, 2, 4] {
        let mut conns = rt.block_on(connect_all((0..n).map(|_| echo_server(status)).collect()));
        for (what, size) in [("small", small), ("install", install)] {
            let payload = vec![1u8; size];
            g.bench_function(format!("tcp_round_trip/{what}/{n}"), |b| {
                b.iter(|| rt.block_on(round(&mut conns, &payload, 1, status)))
            });
        }
    }
    for (n, w) in [(1usize, 1usize), (2, 2)] {
        let mut conns = rt.block_on(connect_all(
            (0..n).map(|_| handoff_server(w, status)).collect(),
        ));
        for (what, size) in [("small", small), ("install", install)] {
            let payload = vec![1u8; size];
            g.bench_function(format!("worker_handoff/{what}/{n}x{w}"), |b| {
                b.iter(|| rt.block_on(round(&mut conns, &payload, w, status)))
            });
        }
    }
    g.finish();
    eprintln!(
        "floors: frames of {small} bytes (small command), {install} bytes (install), answered with {status} bytes (a Status)"
    );
}

criterion_group!(benches, floors);
criterion_main!(benches);
