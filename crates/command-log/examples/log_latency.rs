//! Measures command-log append latency and reader wake-up latency on both
//! backends (informative; see `docs/stores.md`): `cargo run --release -p
//! lockstep-command-log --example log_latency [APPENDS]`. The PostgreSQL
//! server is a throw-away one (lockstep-pgtest) on 127.0.0.1 with default
//! durability; the SQLite file (WAL, `synchronous=NORMAL`) is in a temporary
//! directory.

use std::time::{Duration, Instant};

use lockstep_command_log::{AnyLog, CommandLog, LogLocation};
use lockstep_protocol::{Command, CommandKind, Strategy};

fn main() {
    let n: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(500);
    let dir = tempfile::tempdir().unwrap();
    let pg = lockstep_pgtest::PgServer::start().unwrap();
    let command = |seqno| Command {
        seqno,
        strategy: Strategy::Log,
        kind: CommandKind::StatusRequest { full: false },
    };
    for (label, location) in [
        ("sqlite", LogLocation::Sqlite(dir.path().join("log.sqlite"))),
        (
            "postgres",
            LogLocation::Postgres {
                url: pg.url(),
                name: "bench".into(),
            },
        ),
    ] {
        let mut log = AnyLog::open(&location).unwrap();
        let mut one = Vec::with_capacity(n);
        for i in 0..n {
            let t = Instant::now();
            log.append(1, &[command(i as u64)]).unwrap();
            one.push(t.elapsed());
        }
        let mut batch = Vec::with_capacity(n / 10);
        for i in 0..n / 10 {
            let commands: Vec<Command> = (0..100).map(|k| command((i * 100 + k) as u64)).collect();
            let t = Instant::now();
            log.append(1, &commands).unwrap();
            batch.push(t.elapsed());
        }
        // Wake-up: a reader waits (30 s bound); the writer appends; how long
        // from the start of the append until the reader returns.
        let mut reader = AnyLog::open_reader(&location).unwrap();
        let mut next = reader.start_offset().unwrap();
        let mut wakes = Vec::new();
        for i in 0..50 {
            while let Some(last) = reader.read_from(next, 100_000).unwrap().last() {
                next = last.offset + 1;
            }
            let waiter = std::thread::spawn(move || {
                let woken = reader.wait_for_append(Duration::from_secs(30)).unwrap();
                (Instant::now(), woken, reader)
            });
            std::thread::sleep(Duration::from_millis(20));
            let started = Instant::now();
            log.append(1, &[command(i)]).unwrap();
            let (woken_at, woken, r) = waiter.join().unwrap();
            assert!(woken);
            reader = r;
            wakes.push(woken_at.saturating_duration_since(started));
        }
        println!(
            "{label:8} append 1 command {}  append 100 commands {}  append-to-wake {}",
            summary(&mut one),
            summary(&mut batch),
            summary(&mut wakes)
        );
    }
}

/// `p50 / p99` of the samples.
fn summary(samples: &mut [Duration]) -> String {
    samples.sort();
    let at = |q: f64| samples[((samples.len() as f64 - 1.0) * q) as usize];
    format!("p50 {:>9.2?} p99 {:>9.2?}", at(0.5), at(0.99))
}
