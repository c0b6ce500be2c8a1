//! Protocol costs: framing a command and compacting a history.

#![allow(missing_docs)] // criterion_group! generates undocumented functions

use bytes::BytesMut;
use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use lockstep_benches::small_dataflow;
use lockstep_protocol::*;
use lockstep_transport::{ControllerCodec, ReplicaCodec};
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

criterion_group!(benches, codec, history);
criterion_main!(benches);
