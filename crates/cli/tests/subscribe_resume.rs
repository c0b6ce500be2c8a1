//! `lockstep subscribe --resume` across a SIGKILL of the environment, under
//! each shipped distribution policy: the CLI reconnects to the restarted
//! environment and resumes after the last time it fully received, so every
//! change is printed exactly once (no gap, no duplicate), read from the
//! adopted replica's arrangement (same processes: nothing rebuilt).

use std::collections::BTreeMap;
use std::path::Path;

mod common;

use lockstep_chaos::environment::Sandbox;

/// Writes row `(t, 10)` at time `t` to input 1 (upper `t + 1`).
async fn write_at(state: &Path, url: &str, t: u64) {
    common::write_to_r(state, url, &format!("{t},10@{t}"), t + 1).await;
}

async fn resume_under(strategy: &str) {
    let policy = common::built_policy(strategy);
    let sandbox = Sandbox::new().unwrap();
    let state = sandbox.path();
    let (port, url) = common::free_port_url();
    let mut first = common::serve_on(state, port, &policy).await;
    common::replica_r_with(state, &url, 2, 1, "get(1)").await;
    for t in 0..5 {
        write_at(state, &url, t).await;
    }
    let before = common::pids_of_r(state, &url).await;

    let (mut subscriber, mut lines) = common::subscribe_r(state, &url, &["--resume"]);
    let mut seen = BTreeMap::new();
    common::read_until(&mut lines, &mut seen, 4).await;

    // SIGKILL the environment mid-stream; a new one on the same state and
    // port adopts the replica.
    first.kill().await.unwrap();
    let _second = common::serve_on(state, port, &policy).await;
    for t in 5..10 {
        write_at(state, &url, t).await;
    }
    common::read_until(&mut lines, &mut seen, 9).await;
    assert_eq!(
        common::pids_of_r(state, &url).await,
        before,
        "the replica was adopted, not rebuilt"
    );

    subscriber.kill().await.unwrap();
    let err = common::rest_of(&mut subscriber, &mut lines, &mut seen).await;
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
