//! R1 on real processes, the attack of issue 45 rerun: a flood of held
//! metrics scrapes (a first byte `G`, then nothing) against replica
//! processes whose descriptor limit is 256 used to escape the controller
//! port's cap, run the process out of descriptors and end its accept loop
//! for good (same PID, listening nowhere). Now scrapes share the unproven
//! pool: the flood's oldest are closed, the process's descriptors stay
//! within its budget, and a controller still gets in and is served.

mod common;

use std::time::{Duration, Instant};

use common::*;
use lockstep_protocol::CommandHistory;
use lockstep_replica::server::HELLO_DEADLINE;
use tokio::io::AsyncWriteExt;

/// The descriptor limit the processes get once started (soft and hard).
const LIMIT: u64 = 256;

/// Held scrapes per process: far past the pool's cap and the limit.
const SCRAPES: usize = 1200;

/// Sets process `pid`'s descriptor limit with util-linux's `prlimit`.
fn set_nofile(pid: u32, limit: u64) {
    let out = std::process::Command::new("prlimit")
        .args([
            "--pid",
            &pid.to_string(),
            &format!("--nofile={limit}:{limit}"),
        ])
        .output()
        .expect("running prlimit (util-linux)");
    assert!(
        out.status.success(),
        "prlimit {pid}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn open_descriptors(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_scrapes_past_the_pool_cannot_wedge_a_process() {
    let r = start_replica(45, 2, 1).await;
    let pids: Vec<u32> = r
        .status
        .processes
        .iter()
        .map(|p| p.pid.expect("running"))
        .collect();
    // The controller connects first and is served.
    let c = controller(&r, 1, CommandHistory::new());
    c.create_dataflow(dataflow(
        1,
        &[1],
        lockstep_plan::Plan::Get { collection_id: 1 },
    ))
    .unwrap();
    c.write_input(1, vec![u(&[7], 0, 1)], 1).unwrap();
    assert_eq!(c.peek(1001, 0).await.unwrap(), vec![(vec![7], 1)]);
    for pid in &pids {
        set_nofile(*pid, LIMIT);
    }

    // The flood: held scrapes on every process's controller port.
    let mut held = Vec::new();
    let mut most = vec![0usize; pids.len()];
    for (i, p) in r.addrs.processes.iter().enumerate() {
        let addr = p.socket_addr().expect("an IP address");
        for n in 0..SCRAPES {
            match tokio::net::TcpStream::connect(addr).await {
                Ok(mut s) => {
                    let _ = s.write_all(b"G").await;
                    held.push(s);
                }
                Err(e) => panic!(
                    "connection {n} to process {i} refused: {e} (the accept loop ended?)\n{}",
                    logs(&r, 20)
                ),
            }
            if n % 100 == 0 {
                most[i] = most[i].max(open_descriptors(pids[i]));
            }
        }
        most[i] = most[i].max(open_descriptors(pids[i]));
    }
    for (i, n) in most.iter().enumerate() {
        assert!(
            (*n as u64) < LIMIT,
            "process {i} held {n} descriptors of {LIMIT} during the flood"
        );
    }

    // Cut the controller's connections: it must get back in past the flood
    // (still held) and be served well within the Hello deadline.
    let started = Instant::now();
    c.write_input(1, vec![u(&[8], 1, 1)], 2).unwrap();
    let rows = tokio::time::timeout(HELLO_DEADLINE * 4, c.peek(1001, 1))
        .await
        .unwrap_or_else(|_| panic!("not served during the flood\n{}", logs(&r, 20)))
        .unwrap();
    assert_eq!(rows, vec![(vec![7], 1), (vec![8], 1)]);
    // A new controller (a new session, new connections) also gets in.
    c.shutdown();
    // (A new controller with an empty history: it reconciles the replica
    // to nothing, then builds anew.)
    let c2 = controller(&r, 2, CommandHistory::new());
    c2.create_dataflow(dataflow(
        2,
        &[2],
        lockstep_plan::Plan::Get { collection_id: 2 },
    ))
    .unwrap();
    c2.write_input(2, vec![u(&[9], 0, 1)], 1).unwrap();
    let rows = tokio::time::timeout(HELLO_DEADLINE * 4, c2.peek(1002, 0))
        .await
        .unwrap_or_else(|_| panic!("a new session was kept out\n{}", logs(&r, 20)))
        .unwrap();
    assert_eq!(rows, vec![(vec![9], 1)]);
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "served, but only after {:?}",
        started.elapsed()
    );
    // Same PIDs: nothing died, and every process still listens.
    for (i, p) in r.addrs.processes.iter().enumerate() {
        let addr = p.socket_addr().expect("an IP address");
        tokio::net::TcpStream::connect(addr)
            .await
            .unwrap_or_else(|e| panic!("process {i} listens nowhere: {e}"));
        assert!(std::path::Path::new(&format!("/proc/{}", pids[i])).exists());
    }
    drop(held);
    c2.shutdown();
}
