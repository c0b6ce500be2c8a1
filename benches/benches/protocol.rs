//! Protocol costs: framing a command, compacting a history, and a
//! 10,000-row write's encoded size for the distribution policy
//! (`protocol/write_10k_size/copied`: the write copied into a command and
//! measured, as the controller did; `.../measured`: measured where it is,
//! `command_encoded_len`) and its encoding for the catalog
//! (`protocol/write_10k_catalog_bytes/copied`: copied into its wire form and
//! encoded, as the environment did; `.../written`: `encode_whole_write`),
//! and the controller's frame of it (`protocol/write_10k_frame/wire_form`:
//! through its wire form, as the codec did; `.../written`: `encode_frame`
//! from the command where it is).

#![allow(missing_docs)] // criterion_group! generates undocumented functions

use bytes::BytesMut;
use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use lockstep_benches::small_dataflow;
use lockstep_protocol::*;
use lockstep_transport::{ControllerCodec, ReplicaCodec};
use prost::Message;
use tokio_util::codec::{Decoder, Encoder};

fn codec(c: &mut Criterion) {
    let cmd = Command {
        seqno: 1,
        strategy: Strategy::Barrier,
        kind: CommandKind::CreateDataflow(small_dataflow(1)),
    };
    c.bench_function("protocol/frame_roundtrip_create_dataflow", |b| {
        let mut enc = ControllerCodec::default();
        let mut dec = ReplicaCodec::default();
        let mut buf = BytesMut::new();
        b.iter(|| {
            enc.encode(cmd.clone(), &mut buf).unwrap();
            dec.decode(&mut buf).unwrap().unwrap()
        })
    });
}

fn history(c: &mut Criterion) {
    c.bench_function("protocol/history_reduce_1000_live_1000_dropped", |b| {
        b.iter_batched(
            || {
                let mut h = CommandHistory::new();
                for i in 0..2000u64 {
                    h.push(CommandKind::CreateDataflow(small_dataflow(i)));
                    if i % 2 == 1 {
                        h.push(CommandKind::AllowCompaction {
                            collection_id: 1000 + i,
                            frontier: None,
                        });
                    }
                }
                h
            },
            |mut h| {
                h.reduce();
                h.digest()
            },
            BatchSize::LargeInput,
        )
    });
}

fn write_size(c: &mut Criterion) {
    let kind = CommandKind::WriteInput(WriteInput {
        collection_id: 1,
        updates: (0..10_000i64)
            .map(|i| Update {
                row: lockstep_plan::row(&[i, 7]),
                time: 7,
                diff: 1,
            })
            .collect(),
        upper: 8,
        more: false,
        batch_digest: None,
    });
    let mut g = c.benchmark_group("protocol/write_10k_size");
    g.bench_function("copied", |b| {
        b.iter(|| {
            Command {
                seqno: 0,
                strategy: Strategy::Naive,
                kind: kind.clone(),
            }
            .encoded_len()
        })
    });
    g.bench_function("measured", |b| {
        b.iter(|| command_encoded_len(0, Strategy::Naive, &kind))
    });
    g.finish();
    let CommandKind::WriteInput(w) = &kind else {
        unreachable!("a write")
    };
    let mut g = c.benchmark_group("protocol/write_10k_catalog_bytes");
    g.bench_function("copied", |b| {
        b.iter(|| proto::WriteInput::from(w.clone()).encode_to_vec())
    });
    g.bench_function("written", |b| {
        b.iter(|| encode_whole_write(w.collection_id, &w.updates, w.upper))
    });
    g.finish();
    // The controller's frame of the write (before encryption): through its
    // wire form (rows moved into it), as the codec did, or written from
    // the command where it is (`encode_frame`). The command to consume is
    // copied outside the measurement in both.
    let command = Command {
        seqno: 9,
        strategy: Strategy::Barrier,
        kind,
    };
    let mut g = c.benchmark_group("protocol/write_10k_frame");
    let mut buf = BytesMut::new();
    g.bench_function("wire_form", |b| {
        b.iter_batched(
            || command.clone(),
            |cmd| {
                buf.clear();
                encode_wire_frame(&cmd.to_wire(), usize::MAX, &mut buf).unwrap()
            },
            BatchSize::LargeInput,
        )
    });
    g.bench_function("written", |b| {
        b.iter_batched(
            || command.clone(),
            |cmd| {
                buf.clear();
                encode_frame(cmd, usize::MAX, &mut buf).unwrap()
            },
            BatchSize::LargeInput,
        )
    });
    g.finish();
}

criterion_group!(benches, codec, history, write_size);
criterion_main!(benches);
