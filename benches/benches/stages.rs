//! Where a write's time goes (issue 33): one 10,000-row write, the batch of
//! `limits/ingest_1M` and `api/ingest_10k`, through each stage of its path,
//! every stage the production code's own functions on the same bytes, each
//! beside its floor (what the machine costs for that stage's work with no
//! lockstep code) measured in the same run. `cargo xtask bench` states each
//! stage as a ratio to its floor and the stages' sum against the whole write.
//!
//! `stages/ingest_10k/<stage>`, with its floor `stages/ingest_10k/floor_<f>`:
//!
//! - `api_decode`: the gRPC request decoded (prost, as tonic does) and its
//!   updates converted (`Update::from`, as the environment's server does);
//!   floor `row_copies`: every row's bytes copied into a row of its own
//!   (what any decoder into owned rows does: an allocation and a copy per
//!   row; `memcpy`, the request's bytes copied once, is beside it); bound
//!   `prost_decode`: prost decoding the request by itself (10,000 nested
//!   messages), which the API's framework does before lockstep sees it;
//! - `validate`: every row checked (`lockstep_plan::rows::check`, what the
//!   environment does before it records a write); floor `memcpy`; bound
//!   `row_reads`: every row's bytes read once (each row is an allocation of
//!   its own), which any check of every row costs;
//! - `durable_append`: the write encoded for the catalog and appended in a
//!   fenced SQLite transaction, durable when it returns
//!   (`Catalog::append_input`); floor `sqlite_insert`: the same bytes
//!   inserted in one transaction of a bare SQLite file with the same
//!   durability (`synchronous = FULL`), no fence, no lockstep code;
//! - `encode_seal`: the command framed and encrypted by the controller's
//!   codec (`SecureCodec<ControllerCodec>`, under a session set up by
//!   `secure::initiate` and `secure::respond`; the command it consumes is
//!   copied outside the measurement); floor `memcpy` + `cipher_seal`: the
//!   bytes written once, and snow alone encrypting the frame's bytes in
//!   records of the same size; bound `prost_encode` + `cipher_seal`: prost
//!   encoding the command's wire form (10,000 nested messages) by itself;
//! - the wire, floor `tcp`: the sealed bytes over a loopback TCP connection
//!   to a reader that acknowledges them with one byte (lockstep adds nothing
//!   to this stage: its framing is already in the bytes, so it has no
//!   lockstep figure of its own);
//! - `open_decode`: the replica's codec (`SecureCodec<ReplicaCodec>`)
//!   decrypting and decoding the frame; floor `cipher_open` + `row_copies`:
//!   snow alone decrypting the records, and the rows copied out;
//! - `replica_ingest`: a replica worker (`lockstep_replica::worker::run_worker`
//!   with the built-in family, in this process, one worker: 1x1) applying
//!   the decoded write (as the controller sends it: with its digest) until
//!   its export's frontier passes it; floor
//!   `differential`: the same rows into a differential `InputSession`
//!   feeding an arrangement, stepped until a probe passes each batch. Each
//!   sample of either starts from an empty arrangement.

#![allow(missing_docs)] // criterion_group! generates undocumented functions

use std::hint::black_box;
use std::io::{Read, Write};
use std::sync::mpsc as std_mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use criterion::{criterion_group, criterion_main, Criterion};
use lockstep_benches::harness;
use lockstep_catalog::{Catalog, ReplicaConfig};
use lockstep_environment::proto::WriteInputRequest;
use lockstep_protocol::{
    encode_whole_write, proto as wire, Command, CommandKind, ProcessIdentity, SessionKey, Strategy,
    Update, WireMessage, WriteInput,
};
use lockstep_replica::family::PlanFamily;
use lockstep_replica::worker::{run_worker, FromWorker};
use lockstep_transport::secure::{self, SecureCodec, Session, NOISE_PARAMS};
use lockstep_transport::{ControllerCodec, ReplicaCodec};
use prost::Message;
use tokio_util::codec::{Decoder, Encoder};

const ROWS: i64 = 10_000;
/// The input collection the replica worker's dataflows read first.
const INPUT: u64 = 1;
/// A Noise record's most plaintext (65,535 bytes less the 16-byte tag), as
/// `SecureCodec` cuts frames.
const RECORD_PLAIN: usize = 65_535 - 16;

/// The rows of the write at time `t`, as `limits/ingest_1M` writes them.
fn updates(t: u64) -> Vec<Update> {
    (0..ROWS)
        .map(|i| Update {
            row: lockstep_plan::row(&[i, t as i64]),
            time: t,
            diff: 1,
        })
        .collect()
}

fn write(collection_id: u64, t: u64) -> WriteInput {
    WriteInput {
        collection_id,
        updates: updates(t),
        upper: t + 1,
        more: false,
        batch_digest: None,
    }
}

/// Both ends of one secured session, set up by lockstep's own handshake
/// over an in-memory pipe.
fn sessions(rt: &tokio::runtime::Runtime) -> (Session, Session) {
    let key = SessionKey::from_bytes([7; 32]);
    rt.block_on(async {
        let (mut a, mut b) = tokio::io::duplex(1024);
        let (c, r) = tokio::join!(
            secure::initiate(&mut a, &key, 1, 0),
            secure::respond(&mut b, &key, 1, 0)
        );
        (c.expect("initiate"), r.expect("respond"))
    })
}

/// Both ends of a bare Noise transport with the same parameters, for the
/// cipher's own floor.
fn noise_pair() -> (snow::TransportState, snow::TransportState) {
    let params: snow::params::NoiseParams = NOISE_PARAMS.parse().expect("params");
    let key = [7u8; 32];
    let build = || {
        snow::Builder::new(params.clone())
            .psk(0, &key)
            .expect("psk")
    };
    let mut i = build().build_initiator().expect("initiator");
    let mut r = build().build_responder().expect("responder");
    let (mut m, mut p) = ([0u8; 256], [0u8; 256]);
    let n = i.write_message(&[], &mut m).expect("handshake 1");
    r.read_message(&m[..n], &mut p).expect("handshake 1");
    let n = r.write_message(&[], &mut m).expect("handshake 2");
    i.read_message(&m[..n], &mut p).expect("handshake 2");
    (
        i.into_transport_mode().expect("transport"),
        r.into_transport_mode().expect("transport"),
    )
}

/// One replica worker in this process, driven through its command channel
/// as a replica process's connection drives it.
struct InProcessWorker {
    commands: std_mpsc::Sender<Command>,
    reports: tokio::sync::mpsc::UnboundedReceiver<FromWorker>,
    thread: std::thread::Thread,
    seqno: u64,
}

impl InProcessWorker {
    fn start() -> InProcessWorker {
        let (commands, rx) = std_mpsc::channel();
        let (tx, reports) = tokio::sync::mpsc::unbounded_channel();
        let (thread_tx, thread_rx) = std_mpsc::channel();
        std::thread::spawn(move || {
            // execute_directly asks for a closure it could share.
            let rx = std::sync::Mutex::new(Some(rx));
            timely::execute_directly(move |worker| {
                let _ = thread_tx.send(std::thread::current());
                let rx = rx.lock().expect("not poisoned").take().expect("once");
                run_worker(worker, rx, tx, 1, None, Arc::new(PlanFamily));
            })
        });
        let thread = thread_rx.recv().expect("the worker thread started");
        let mut w = InProcessWorker {
            commands,
            reports,
            thread,
            seqno: 0,
        };
        w.send_seq(
            0,
            CommandKind::Hello(
                ProcessIdentity {
                    replica_id: 1,
                    process_index: 0,
                    process_count: 1,
                    workers_per_process: 1,
                }
                .hello(1, 1),
            ),
        );
        // Nothing to reconcile: the session's history starts empty.
        w.send(CommandKind::InitializationComplete);
        w
    }

    fn send_seq(&mut self, seqno: u64, kind: CommandKind) {
        self.commands
            .send(Command {
                seqno,
                strategy: Strategy::Barrier,
                kind,
            })
            .expect("the worker is running");
        self.thread.unpark();
    }

    fn send(&mut self, kind: CommandKind) {
        self.seqno += 1;
        self.send_seq(self.seqno, kind);
    }

    /// Waits until `collection`'s frontier on the worker passes `t`.
    fn passed(&mut self, rt: &tokio::runtime::Runtime, collection: u64, t: u64) {
        let bound = Duration::from_secs(60);
        let wait = async {
            loop {
                match self.reports.recv().await {
                    Some(FromWorker::Frontier {
                        collection: c,
                        upper,
                        ..
                    }) if c == collection && upper.is_none_or(|u| u > t) => return,
                    Some(FromWorker::Error(e)) => panic!("the worker refused a command: {e:?}"),
                    Some(_) => {}
                    None => panic!("the worker stopped"),
                }
            }
        };
        if rt
            .block_on(async { tokio::time::timeout(bound, wait).await })
            .is_err()
        {
            panic!("collection {collection} did not pass {t} within {bound:?}");
        }
    }
}

/// `iters` writes of [`ROWS`] rows, as bytes, into an arranged
/// `InputSession` in one worker, each stepped until the probe passes it.
fn differential_ingest(iters: u64) -> Duration {
    let batches = (0..iters)
        .map(|t| updates(t).into_iter().map(|u| u.row).collect())
        .collect();
    lockstep_benches::differential_ingest::<Vec<u8>>(batches, 0, true)
}

fn stages(c: &mut Criterion) {
    let rt = harness::rt();
    let mut g = c.benchmark_group("stages/ingest_10k");
    harness::timings(&mut g, 20, 1000);

    // The API's request, and what the environment decodes it into.
    let request = WriteInputRequest {
        replica: "bench".into(),
        collection_id: INPUT,
        updates: updates(1).into_iter().map(wire::Update::from).collect(),
        upper: 2,
    }
    .encode_to_vec();
    let mut copy = vec![0u8; request.len()];
    g.bench_function("floor_memcpy", |b| {
        b.iter(|| copy.copy_from_slice(black_box(&request)))
    });
    g.bench_function("api_decode", |b| {
        b.iter(|| {
            let r = WriteInputRequest::decode(black_box(&request[..])).expect("decode");
            let u: Vec<Update> = r.updates.into_iter().map(Update::from).collect();
            u
        })
    });
    // What bounds the API decode: prost's own decoding of the request,
    // before the environment converts anything.
    g.bench_function("bound_prost_decode", |b| {
        b.iter(|| WriteInputRequest::decode(black_box(&request[..])).expect("decode"))
    });
    let batch = write(INPUT, 1);
    g.bench_function("floor_row_copies", |b| {
        b.iter(|| {
            let rows: Vec<Vec<u8>> = black_box(&batch.updates)
                .iter()
                .map(|u| u.row.to_vec())
                .collect();
            rows
        })
    });
    g.bench_function("validate", |b| {
        b.iter(|| {
            for u in black_box(&batch.updates) {
                lockstep_plan::rows::check(&u.row).expect("a plan row");
            }
        })
    });
    // What bounds a check of every row: reading every row's bytes once
    // (each row its own allocation), checking nothing.
    g.bench_function("bound_row_reads", |b| {
        b.iter(|| {
            black_box(&batch.updates)
                .iter()
                .fold(0u8, |x, u| u.row.iter().fold(x, |x, b| x ^ b))
        })
    });

    // The durable record, and a bare SQLite insert of the same bytes.
    let dir = tempfile::tempdir().expect("tempdir");
    let mut catalog = Catalog::open(dir.path().join("catalog.db")).expect("catalog");
    let replica = catalog
        .create_replica(
            "bench",
            ReplicaConfig {
                processes: 1,
                workers_per_process: 1,
                config: String::new(),
            },
        )
        .expect("replica");
    g.bench_function("durable_append", |b| {
        b.iter(|| {
            // The environment's `encode_write`: the write alone.
            let bytes = encode_whole_write(INPUT, &batch.updates, batch.upper);
            catalog
                .append_input(replica.id, INPUT, &bytes)
                .expect("append")
        })
    });
    let stored = wire::WriteInput::from(batch.clone()).encode_to_vec();
    let bare = rusqlite::Connection::open(dir.path().join("bare.db")).expect("sqlite");
    bare.pragma_update(None, "synchronous", "FULL")
        .expect("pragma");
    bare.execute(
        "CREATE TABLE writes (seq INTEGER PRIMARY KEY, write BLOB NOT NULL)",
        [],
    )
    .expect("table");
    g.bench_function("floor_sqlite_insert", |b| {
        b.iter(|| {
            bare.execute("INSERT INTO writes (write) VALUES (?1)", [&stored])
                .expect("insert")
        })
    });

    // The frame: encoded and sealed by the controller, opened and decoded
    // by the replica, and the cipher by itself on the same bytes.
    let command = Command {
        seqno: 2,
        strategy: Strategy::Barrier,
        kind: CommandKind::WriteInput(batch.clone()),
    };
    let max = lockstep_protocol::DEFAULT_MAX_FRAME_LEN;
    // A record opens only in order (its nonce is a counter): the sealing
    // measurement has a session of its own, whose other end is unused, and
    // the opening one a pair that seals exactly what it opens.
    let mut seal = SecureCodec::new(ControllerCodec::new(max), Some(sessions(&rt).0));
    let (ours, theirs) = sessions(&rt);
    let mut seal_for_open = SecureCodec::new(ControllerCodec::new(max), Some(ours));
    let mut open = SecureCodec::new(ReplicaCodec::new(max), Some(theirs));
    let mut sealed = BytesMut::new();
    // The codec takes a command the controller owns: copied outside the
    // measurement (the copy is delivery's, not the codec's).
    g.bench_function("encode_seal", |b| {
        b.iter_batched(
            || command.clone(),
            |command| {
                sealed.clear();
                seal.encode(command, &mut sealed).expect("encode");
            },
            criterion::BatchSize::LargeInput,
        )
    });
    // What bounds encoding the frame: prost's own encoding of the write's
    // wire form (built outside the measurement) into a buffer.
    let wire_command = wire::Command::from(command.clone());
    let mut encoded = Vec::with_capacity(wire_command.encoded_len());
    g.bench_function("bound_prost_encode", |b| {
        b.iter(|| {
            encoded.clear();
            wire_command.encode(&mut encoded).expect("room");
        })
    });
    g.bench_function("open_decode", |b| {
        b.iter_batched(
            || {
                let mut s = BytesMut::new();
                seal_for_open
                    .encode(command.clone(), &mut s)
                    .expect("encode");
                s
            },
            |mut s| {
                let cmd = open.decode(&mut s).expect("decode").expect("a whole frame");
                assert!(s.is_empty());
                cmd
            },
            criterion::BatchSize::LargeInput,
        )
    });
    let frame_len = command.clone().encode_to_vec().len() + 4;
    let plain = vec![1u8; frame_len];
    let mut i = noise_pair().0;
    let (mut i_for_open, mut r) = noise_pair();
    let mut records = vec![0u8; frame_len + frame_len / RECORD_PLAIN * 16 + 16 + 16];
    let mut opened = vec![0u8; frame_len + 16];
    g.bench_function("floor_cipher_seal", |b| {
        b.iter(|| {
            let mut at = 0;
            for chunk in plain.chunks(RECORD_PLAIN) {
                at += i.write_message(chunk, &mut records[at..]).expect("seal");
            }
            at
        })
    });
    g.bench_function("floor_cipher_open", |b| {
        b.iter_batched(
            || {
                let mut out = Vec::new();
                let mut buf = vec![0u8; RECORD_PLAIN + 16];
                for chunk in plain.chunks(RECORD_PLAIN) {
                    let n = i_for_open.write_message(chunk, &mut buf).expect("seal");
                    out.push(buf[..n].to_vec());
                }
                out
            },
            |records| {
                let mut at = 0;
                for rec in &records {
                    at += r.read_message(rec, &mut opened[at..]).expect("open");
                }
                at
            },
            criterion::BatchSize::LargeInput,
        )
    });

    // The wire: the sealed frame's bytes over loopback TCP, acknowledged.
    let wire_len = {
        let mut s = BytesMut::new();
        seal.encode(command.clone(), &mut s).expect("encode");
        s.len()
    };
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    std::thread::spawn(move || {
        let (mut s, _) = listener.accept().expect("accept");
        s.set_nodelay(true).expect("nodelay");
        let mut buf = vec![0u8; wire_len];
        while s.read_exact(&mut buf).is_ok() {
            if s.write_all(&[1]).is_err() {
                return;
            }
        }
    });
    let mut conn = std::net::TcpStream::connect(addr).expect("connect");
    conn.set_nodelay(true).expect("nodelay");
    let bytes = vec![3u8; wire_len];
    g.bench_function("floor_tcp", |b| {
        b.iter(|| {
            conn.write_all(&bytes).expect("send");
            let mut ack = [0u8; 1];
            conn.read_exact(&mut ack).expect("ack");
        })
    });

    // The replica worker against differential by itself.
    let mut worker = InProcessWorker::start();
    let mut dataflow = 0u64;
    g.bench_function("replica_ingest", |b| {
        b.iter_custom(|iters| {
            // A fresh input and dataflow per sample, as the floor's.
            dataflow += 1;
            let (input, export) = (100 + dataflow, 1_000_000 + dataflow);
            let desc = lockstep_benches::dataflow_over(dataflow, input, export);
            worker.send(CommandKind::WriteInput(WriteInput {
                collection_id: input,
                updates: Vec::new(),
                upper: 1,
                more: false,
                batch_digest: None,
            }));
            worker.send(CommandKind::CreateDataflow(desc));
            worker.passed(&rt, export, 0);
            // As the controller sends them: with their digest, computed once
            // for its history (`WriteInput::digested`).
            let writes: Vec<WriteInput> = (1..=iters).map(|t| write(input, t).digested()).collect();
            let start = Instant::now();
            for w in writes {
                let t = w.upper - 1;
                worker.send(CommandKind::WriteInput(w));
                worker.passed(&rt, export, t);
            }
            let took = start.elapsed();
            worker.send(CommandKind::AllowCompaction {
                collection_id: export,
                frontier: None,
            });
            took
        })
    });
    g.bench_function("floor_differential", |b| b.iter_custom(differential_ingest));
    g.finish();
    eprintln!(
        "stages: a request of {} bytes, a stored write of {} bytes, a frame of {frame_len} bytes, {wire_len} bytes sealed",
        request.len(),
        stored.len()
    );
}

criterion_group!(benches, stages);
criterion_main!(benches);
