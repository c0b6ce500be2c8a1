//! `lockstep subscribe --resume` across a SIGKILL of the environment, under
//! each shipped distribution policy: the CLI reconnects to the restarted
//! environment and resumes after the last time it fully received, so every
//! change is printed exactly once (no gap, no duplicate), read from the
//! adopted replica's arrangement (same processes: nothing rebuilt).

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use tokio::io::{AsyncBufReadExt, AsyncReadExt};

mod common;

use lockstep_chaos::environment::Sandbox;

/// Every bounded wait of this test.
const WAIT: Duration = Duration::from_secs(90);

fn bin() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_lockstep"))
}
/// Writes row `(t, 10)` at time `t` to input 1 (upper `t + 1`).
async fn write_at(state: &Path, url: &str, t: u64) {
    common::write_to_r(state, url, &format!("{t},10@{t}"), t + 1).await;
}

/// Reads the subscriber's lines until one at time `t` arrived (bounded),
/// counting every `(time, row, diff)` line.
async fn read_until(
    lines: &mut tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>,
    seen: &mut BTreeMap<String, usize>,
    t: u64,
) {
    let deadline = Instant::now() + WAIT;
    loop {
        let line = tokio::time::timeout_at(deadline.into(), lines.next_line())
            .await
            .unwrap_or_else(|_| panic!("no change at time {t} within {WAIT:?}; seen {seen:?}"))
            .unwrap()
            .unwrap_or_else(|| panic!("the subscriber ended; seen {seen:?}"));
        let at: u64 = line.split('\t').next().unwrap().parse().unwrap();
        *seen.entry(line).or_insert(0) += 1;
        if at == t {
            return;
        }
    }
}

async fn resume_under(strategy: &str) {
    let policy = common::built_policy(strategy);
    let sandbox = Sandbox::new().unwrap();
    let state = sandbox.path();
    let (port, url) = common::free_port_url();
    let mut first = common::serve_on(state, port, &policy).await;
    common::cli_ok(
        state,
        &url,
        &["replica", "create", "r", "--processes", "2", "--wait"],
    )
    .await;
    common::cli_ok(
        state,
        &url,
        &[
            "dataflow",
            "create",
            "--replica",
            "r",
            "--input",
            "1",
            "--export",
            "101=get(1)",
        ],
    )
    .await;
    for t in 0..5 {
        write_at(state, &url, t).await;
    }
    let before = common::pids_of_r(state, &url).await;

    let mut subscriber = tokio::process::Command::new(bin())
        .args([
            "subscribe",
            "--replica",
            "r",
            "--collection",
            "101",
            "--resume",
        ])
        .args(["--server", &url])
        .env("LOCKSTEP_STATE_DIR", state)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = tokio::io::BufReader::new(subscriber.stdout.take().unwrap()).lines();
    let mut seen = BTreeMap::new();
    read_until(&mut lines, &mut seen, 4).await;

    // SIGKILL the environment mid-stream; a new one on the same state and
    // port adopts the replica.
    first.kill().await.unwrap();
    let _second = common::serve_on(state, port, &policy).await;
    for t in 5..10 {
        write_at(state, &url, t).await;
    }
    read_until(&mut lines, &mut seen, 9).await;
    assert_eq!(
        common::pids_of_r(state, &url).await,
        before,
        "the replica was adopted, not rebuilt"
    );

    subscriber.kill().await.unwrap();
    let mut err = String::new();
    subscriber
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .await
        .unwrap();
    assert!(
        err.contains("connection lost") && err.contains("resumed after the connection was lost"),
        "{strategy}: the subscriber did not say it resumed: {err}"
    );
    let want: BTreeMap<String, usize> = (0..10).map(|t| (format!("{t}\t{t},10\t1"), 1)).collect();
    assert_eq!(
        seen, want,
        "{strategy}: every change exactly once (no gap, no duplicate)"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscribe_resumes_across_an_environment_kill_under_barrier() {
    resume_under("barrier").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscribe_resumes_across_an_environment_kill_under_broadcast() {
    resume_under("broadcast").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscribe_resumes_across_an_environment_kill_under_log() {
    resume_under("log").await;
}
