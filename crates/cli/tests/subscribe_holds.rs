//! A plain subscription open across replica restarts under compaction
//! (`lockstep serve --compaction-lag 4`), under each shipped distribution
//! policy: one process of a 2x2 replica is stopped while writes go on (the
//! inputs' upper passes the subscription's last emitted upper by more than
//! the lag), then killed; the environment restarts the generation and the
//! controller rehydrates it. The subscription holds its inputs' since at its
//! last emitted upper (I5), so the rebuilt dataflow continues it exactly:
//! every change printed once, against the reference, across two restarts
//! and an upgrade that keeps answering (`replica upgrade --keep-answering`
//! restarts the replica's processes while the writes go on).
//! Without the hold the rebuilt dataflow's first batch is the whole
//! collection at the since: the times the processes were away are missing
//! and the collection arrives twice (issue 54's scenario).

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

mod common;

use lockstep_chaos::environment::Sandbox;

/// Every bounded wait of this test.
const WAIT: Duration = Duration::from_secs(90);
/// The groups of the reduce: the row written at time `t` is `(t % GROUPS, t)`.
const GROUPS: u64 = 4;
/// Writes before each stop, during each stop, and after the last restart.
const BEFORE: u64 = 8;
const DURING: u64 = 12;
const AFTER: u64 = 4;
/// The dataflow: per group, the count and the sum of the second column.
const REDUCE: &str = "reduce(get(1), [#0], count, sum(#1))";
/// The subscriber's `--until`: the last write's upper jumps past it.
const UNTIL: u64 = 10_000;

/// Writes row `(t % GROUPS, t)` at time `t` to input 1 (upper `t + 1`).
async fn write_at(state: &Path, url: &str, t: u64) {
    common::write_to_r(state, url, &format!("{},{t}@{t}", t % GROUPS), t + 1).await;
}

/// [`write_at`] at the next `n` times from `*t` on.
async fn write_times(state: &Path, url: &str, t: &mut u64, n: u64) {
    for _ in 0..n {
        write_at(state, url, *t).await;
        *t += 1;
    }
}

/// [`write_at`], but the upper jumps past [`UNTIL`]: the subscriber ends.
async fn write_last(state: &Path, url: &str, t: u64) {
    common::write_to_r(state, url, &format!("{},{t}@{t}", t % GROUPS), UNTIL + 1).await;
}

/// The reference: `reduce(get(1), [#0], count, sum(#1))`'s changes, as the
/// subscriber prints them (`time<TAB>row<TAB>diff`), for writes at
/// `0..times`.
fn reference(times: u64) -> BTreeMap<String, usize> {
    let mut groups: BTreeMap<u64, (u64, u64)> = BTreeMap::new();
    let mut out = BTreeMap::new();
    for t in 0..times {
        let g = t % GROUPS;
        let (count, sum) = groups.get(&g).copied().unwrap_or((0, 0));
        if count > 0 {
            out.insert(format!("{t}\t{g},{count},{sum}\t-1"), 1);
        }
        out.insert(format!("{t}\t{g},{},{}\t1", count + 1, sum + t), 1);
        groups.insert(g, (count + 1, sum + t));
    }
    out
}

fn signal(pid: u64, sig: &str) {
    let status = std::process::Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .unwrap();
    assert!(status.success(), "kill {sig} {pid}");
}

/// Replica r's open read holds and the span they keep its since back.
async fn holds_of_r(state: &Path, url: &str) -> (u64, u64) {
    let v: serde_json::Value =
        serde_json::from_str(&common::cli_ok(state, url, &["replica", "list", "-o", "json"]).await)
            .unwrap();
    let r = &v["replicas"][0];
    (
        r["read_holds"].as_u64().unwrap(),
        r["read_hold_span"].as_u64().unwrap(),
    )
}

/// Waits (bounded) until replica r runs processes none of which is in `old`.
async fn restarted(state: &Path, url: &str, old: &[u64]) -> Vec<u64> {
    let deadline = Instant::now() + WAIT;
    loop {
        let pids = common::pids_of_r(state, url).await;
        if pids.iter().all(|p| *p != 0 && !old.contains(p)) {
            return pids;
        }
        assert!(
            Instant::now() < deadline,
            "replica r was not restarted within {WAIT:?}: {pids:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn holds_under(strategy: &str) {
    let policy = common::built_policy(strategy);
    let sandbox = Sandbox::new().unwrap();
    let state = sandbox.path();
    let (port, url) = common::free_port_url();
    let _env = common::serve_on_with(state, port, &policy, &["--compaction-lag", "4"]).await;
    common::replica_r_with(state, &url, 2, 2, REDUCE).await;
    let until = UNTIL.to_string();
    let (mut subscriber, mut lines) =
        common::subscribe_r(state, &url, &["--as-of", "0", "--until", &until]);
    let mut seen = BTreeMap::new();
    let mut t = 0;
    for _restart in 0..2 {
        write_times(state, &url, &mut t, BEFORE).await;
        common::read_until(&mut lines, &mut seen, t - 1).await;
        // Stop one process: the subscription's merge cannot advance while
        // the writes go on, far past the lag.
        let pids = common::pids_of_r(state, &url).await;
        signal(pids[1], "-STOP");
        write_times(state, &url, &mut t, DURING).await;
        // The subscription's hold is visible, keeping the since back.
        let (holds, span) = holds_of_r(state, &url).await;
        assert_eq!(holds, 1, "{strategy}: one read hold");
        assert!(span >= DURING - 4, "{strategy}: the hold keeps {span} back");
        // Then kill it: the generation restarts and rehydrates from the
        // stored inputs.
        signal(pids[1], "-KILL");
        restarted(state, &url, &pids).await;
    }
    // An upgrade that keeps answering restarts the replica's processes
    // (after its standby caught up) while the writes go on.
    write_times(state, &url, &mut t, BEFORE).await;
    common::read_until(&mut lines, &mut seen, t - 1).await;
    let pids = common::pids_of_r(state, &url).await;
    let upgrade = {
        let (state, url) = (state.to_path_buf(), url.clone());
        tokio::spawn(async move {
            common::cli_ok(
                &state,
                &url,
                &["replica", "upgrade", "r", "--keep-answering"],
            )
            .await
        })
    };
    while !upgrade.is_finished() {
        write_at(state, &url, t).await;
        t += 1;
    }
    upgrade.await.unwrap();
    restarted(state, &url, &pids).await;
    write_times(state, &url, &mut t, AFTER - 1).await;
    write_last(state, &url, t).await;
    t += 1;
    // `--until`: the subscriber exits once it printed every change at or
    // before the last write's time.
    let status = tokio::time::timeout(WAIT, subscriber.wait())
        .await
        .unwrap_or_else(|_| {
            panic!("{strategy}: the subscriber did not end within {WAIT:?}; seen {seen:?}")
        })
        .unwrap();
    let err = common::rest_of(&mut subscriber, &mut lines, &mut seen).await;
    assert!(status.success(), "{strategy}: the subscriber failed: {err}");
    // Its hold goes with it.
    let deadline = Instant::now() + WAIT;
    while holds_of_r(state, &url).await.0 != 0 {
        assert!(
            Instant::now() < deadline,
            "{strategy}: the hold outlived its subscription"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        seen,
        reference(t),
        "{strategy}: every change exactly once across two restarts (stderr: {err})"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscription_is_exact_across_restarts_under_compaction_under_barrier() {
    holds_under("barrier").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscription_is_exact_across_restarts_under_compaction_under_broadcast() {
    holds_under("broadcast").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscription_is_exact_across_restarts_under_compaction_under_log() {
    holds_under("log").await;
}

/// A read hold is bounded: with `--read-hold-limit 8`, a subscription
/// stalled behind a stopped process while 20 writes pass ends with
/// OUT_OF_RANGE naming the limit, and what it printed before is exact
/// (every line one of the reference's, each once).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hold_past_its_limit_ends_the_subscription_after_exact_output() {
    let policy = common::built_policy("barrier");
    let sandbox = Sandbox::new().unwrap();
    let state = sandbox.path();
    let (port, url) = common::free_port_url();
    let _env = common::serve_on_with(
        state,
        port,
        &policy,
        &["--compaction-lag", "4", "--read-hold-limit", "8"],
    )
    .await;
    common::replica_r_with(state, &url, 2, 1, REDUCE).await;
    let (mut subscriber, mut lines) = common::subscribe_r(state, &url, &["--as-of", "0"]);
    let mut seen = BTreeMap::new();
    let mut t = 0;
    write_times(state, &url, &mut t, BEFORE).await;
    common::read_until(&mut lines, &mut seen, t - 1).await;
    let pids = common::pids_of_r(state, &url).await;
    signal(pids[1], "-STOP");
    write_times(state, &url, &mut t, 20).await;
    let status = tokio::time::timeout(WAIT, subscriber.wait())
        .await
        .expect("the subscription ended within its bound")
        .unwrap();
    signal(pids[1], "-CONT");
    let err = common::rest_of(&mut subscriber, &mut lines, &mut seen).await;
    assert!(!status.success(), "the subscription ended in error");
    assert!(
        err.contains("OUT_OF_RANGE: ") && err.contains("--read-hold-limit"),
        "OUT_OF_RANGE naming the limit: {err}"
    );
    let want = reference(t);
    for (line, n) in &seen {
        assert_eq!(
            (want.get(line), *n),
            (Some(&1), 1),
            "{line}: not the reference's, or twice"
        );
    }
    assert!(seen.len() >= 2 * GROUPS as usize, "{seen:?}");
}
