//! S1 on real processes: connections that never prove a Hello cannot keep
//! the real controller out, and what is refused before proof does not grow
//! the process's log line by line.

mod common;

use std::time::{Duration, Instant};

use common::*;
use futures::SinkExt;
use lockstep_protocol::{Command, CommandHistory, CommandKind, Strategy};
use lockstep_replica::server::{HELLO_DEADLINE, MAX_UNPROVEN_CONNECTIONS};
use lockstep_transport::ControllerCodec;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::codec::Framed;

/// MAX_UNPROVEN_CONNECTIONS + 16 idle connections to every process, held
/// open: the controller still connects, proves its Hello and is served well
/// under the Hello deadline (a new connection past the cap used to be closed
/// at once, so such a flood locked the controller out).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proving_controller_gets_in_past_a_flood_of_idle_connections() {
    let r = start_replica(31, 2, 1).await;
    let mut flood = Vec::new();
    for p in &r.addrs.processes {
        let addr = p.socket_addr().expect("an IP address");
        // The process listens once it started (the first connection waits).
        let deadline = Instant::now() + Duration::from_secs(20);
        let first = loop {
            match tokio::net::TcpStream::connect(addr).await {
                Ok(c) => break c,
                Err(e) if Instant::now() > deadline => {
                    panic!("connecting to {addr}: {e}\n{}", logs(&r, 20))
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        };
        let mut conns = vec![first];
        for _ in 1..MAX_UNPROVEN_CONNECTIONS + 16 {
            let conn = tokio::net::TcpStream::connect(addr).await;
            conns.push(
                conn.unwrap_or_else(|e| panic!("connecting to {addr}: {e}\n{}", logs(&r, 20))),
            );
        }
        flood.push(conns);
    }

    // The controller's connections queue behind the flood's.
    let started = Instant::now();
    let c = controller(&r, 1, CommandHistory::new());
    c.create_dataflow(dataflow(
        1,
        &[1],
        lockstep_plan::Plan::Get { collection_id: 1 },
    ))
    .unwrap();
    c.write_input(1, vec![u(&[7], 0, 1)], 1).unwrap();
    let rows = tokio::time::timeout(HELLO_DEADLINE, c.peek(1001, 0))
        .await
        .unwrap_or_else(|_| panic!("not served within {HELLO_DEADLINE:?}\n{}", logs(&r, 20)))
        .unwrap();
    let elapsed = started.elapsed();
    assert_eq!(rows, vec![(vec![7], 1)]);
    assert!(
        elapsed < HELLO_DEADLINE / 2,
        "the controller waited {elapsed:?} for a replica flooded with idle connections"
    );
    // The 16 oldest of each flood were evicted to admit the newer ones; the
    // rest were held open all along.
    let mut byte = [0u8; 1];
    for conns in &mut flood {
        for oldest in &mut conns[..16] {
            let read = tokio::time::timeout(Duration::from_secs(1), oldest.read(&mut byte))
                .await
                .expect("evicted at once");
            assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
        }
        let newest = conns.last_mut().unwrap();
        let read = tokio::time::timeout(Duration::from_millis(100), newest.read(&mut byte)).await;
        assert!(
            read.is_err() || started.elapsed() >= HELLO_DEADLINE,
            "{read:?}"
        );
    }
    drop(flood);
    c.shutdown();
}

fn strip_ansi(s: &str) -> String {
    let mut out = String::new();
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

fn log_lines(r: &TestReplica) -> Vec<String> {
    let mut lines = Vec::new();
    for e in std::fs::read_dir(r.dir.path().join("logs"))
        .unwrap()
        .flatten()
    {
        let text = std::fs::read_to_string(e.path()).unwrap_or_default();
        lines.extend(text.lines().map(strip_ansi));
    }
    lines
}

/// The `total=N` of a refusal summary line.
fn summary_total(line: &str) -> Option<u64> {
    if !line.contains("closed before a proved Hello") {
        return None;
    }
    let rest = &line[line.find("total=")? + "total=".len()..];
    rest.split(|c: char| !c.is_ascii_digit())
        .next()?
        .parse()
        .ok()
}

/// 500 connections refused before proof (plain Hellos without a session,
/// session messages that prove no key, connections closed at once) add at
/// most a few summary lines to the log, not one line each; the summaries
/// count every one of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_connections_are_summarized_not_logged_one_by_one() {
    let r = start_replica_with_env(32, 1, 1, &[("RUST_LOG", "warn")]).await;
    let addr = r.addrs.processes[0].socket_addr().expect("an IP address");
    // Let the process finish starting (its start-up lines, if any).
    tokio::time::sleep(Duration::from_millis(300)).await;
    let before = log_lines(&r).len();

    const N: usize = 500;
    for i in 0..N {
        let sock = tokio::net::TcpStream::connect(addr).await.unwrap();
        let mut sock = sock;
        let sent: Vec<u8> = match i % 3 {
            // A Hello on plain frames, without a session: no proof of the
            // session key.
            0 => {
                let mut framed = Framed::new(sock, ControllerCodec::default());
                let mut forged = r.addrs.identity(0).hello(u64::MAX, i as u64);
                forged.proof = Vec::new();
                framed
                    .send(Command {
                        seqno: 0,
                        strategy: Strategy::Barrier,
                        kind: CommandKind::Hello(forged),
                    })
                    .await
                    .unwrap();
                sock = framed.into_inner();
                Vec::new()
            }
            // A session's first message that proves no key.
            1 => [&[0u8, 48][..], &[0xab; 48][..]].concat(),
            // Closed at once.
            _ => {
                drop(sock);
                continue;
            }
        };
        sock.write_all(&sent).await.unwrap();
        // Closed without an answer, long before the Hello deadline.
        let mut buf = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(2), sock.read_to_end(&mut buf))
            .await
            .expect("closed at once");
        assert!(buf.is_empty(), "answered {buf:?} ({read:?})");
    }

    // Every refusal is counted into a summary: the first at once, the rest
    // at the next interval.
    let deadline = Instant::now() + lockstep_replica::server::REFUSAL_LOG_INTERVAL * 2;
    let (new, counted) = loop {
        let lines = log_lines(&r);
        let new: Vec<String> = lines[before.min(lines.len())..].to_vec();
        let counted: u64 = new.iter().filter_map(|l| summary_total(l)).sum();
        if counted >= N as u64 || Instant::now() > deadline {
            break (new, counted);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(
        counted,
        N as u64,
        "summaries counted {counted} of {N}:\n{}",
        new.join("\n")
    );
    assert!(
        new.len() <= 3,
        "{N} refused connections wrote {} log lines:\n{}",
        new.len(),
        new.join("\n")
    );
}
