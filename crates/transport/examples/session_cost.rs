//! What session security costs per frame: encodes and decodes a small
//! command and a 1 MiB write through the plain codec and through
//! `secure::SecureCodec` (Noise transport, ChaCha20-Poly1305), in one run,
//! and prints the times and their ratio. Run it in release:
//! `cargo run --release -p lockstep-transport --example session_cost`.

use std::time::{Duration, Instant};

use bytes::BytesMut;
use lockstep_protocol::{Command, CommandKind, SessionKey, Strategy, Update, WriteInput};
use lockstep_transport::secure::{self, SecureCodec};
use lockstep_transport::{ControllerCodec, ReplicaCodec};
use tokio_util::codec::{Decoder, Encoder};

fn small() -> Command {
    Command {
        seqno: 7,
        strategy: Strategy::Barrier,
        kind: CommandKind::StatusRequest { full: false },
    }
}

fn write_43k_rows() -> Command {
    let updates: Vec<Update> = (0..43_000)
        .map(|i| Update {
            row: lockstep_plan::row(&[i, i * 7]),
            time: 5,
            diff: 1,
        })
        .collect();
    Command {
        seqno: 8,
        strategy: Strategy::Barrier,
        kind: CommandKind::WriteInput(WriteInput {
            collection_id: 1,
            updates,
            upper: 6,
            more: false,
            batch_digest: None,
        }),
    }
}

fn time<C, D>(enc: &mut C, dec: &mut D, cmd: &Command, rounds: u32) -> (Duration, usize)
where
    C: Encoder<Command, Error = lockstep_protocol::CodecError>,
    D: Decoder<Item = Command, Error = lockstep_protocol::CodecError>,
{
    let mut bytes = 0;
    let started = Instant::now();
    for _ in 0..rounds {
        let mut wire = BytesMut::new();
        enc.encode(cmd.clone(), &mut wire).unwrap();
        bytes = wire.len();
        let got = dec.decode(&mut wire).unwrap().unwrap();
        assert_eq!(got.seqno, cmd.seqno);
    }
    (started.elapsed() / rounds, bytes)
}

fn main() {
    tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("runtime")
        .block_on(run());
}

async fn run() {
    let key = SessionKey::from_bytes([9; 32]);
    let (mut a, mut b) = tokio::io::duplex(4096);
    let handshake = Instant::now();
    let (c, r) = tokio::join!(
        secure::initiate(&mut a, &key, 1, 0),
        secure::respond(&mut b, &key, 1, 0)
    );
    let handshake = handshake.elapsed();
    let (c, r) = (c.unwrap(), r.unwrap());
    let mut secure_enc = SecureCodec::new(ControllerCodec::new(64 << 20), Some(c));
    let mut secure_dec = SecureCodec::new(ReplicaCodec::new(64 << 20), Some(r));
    println!("session handshake (both ends, in memory): {handshake:.2?}");
    for (name, cmd, rounds) in [
        ("small command", small(), 20_000),
        ("43,000-row write", write_43k_rows(), 50),
    ] {
        let (plain, plain_len) = time(
            &mut ControllerCodec::new(64 << 20),
            &mut ReplicaCodec::new(64 << 20),
            &cmd,
            rounds,
        );
        let (sealed, sealed_len) = time(&mut secure_enc, &mut secure_dec, &cmd, rounds);
        println!(
            "{name}: plain {plain:.2?} ({plain_len} B), secure {sealed:.2?} ({sealed_len} B), ratio {:.2}",
            sealed.as_secs_f64() / plain.as_secs_f64()
        );
    }
}
