//! Group commit of input writes, on real replica processes: writers that
//! write at once share catalog transactions (fewer commits than writes,
//! counted by the environment's metrics) and each gets its own answer; and
//! after a SIGKILL of `lockstep serve` in the middle of eight concurrent
//! writers, a restarted environment serves every acknowledged write and
//! nothing that was never sent (the acknowledgment contract: a write is
//! answered only after the transaction that stored it committed).

use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::Arc;
use std::time::{Duration, Instant};

mod common;

use common::{cli_ok, shape, start, u};
use lockstep_chaos::environment::Sandbox;
use lockstep_environment::compute::ComputeError;
use lockstep_environment::proto;

/// Every bounded wait of this test.
const WAIT: Duration = Duration::from_secs(90);

/// Concurrent writers, each to an input collection of its own (1..=8).
const WRITERS: u64 = 8;

/// The rows of collection `c` at time `t` and before: `(s, c)` for `s <= t`.
fn rows_through(c: u64, t: u64) -> Vec<(Vec<i64>, i64)> {
    (0..=t).map(|s| (vec![s as i64, c as i64], 1)).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_writes_share_commits_and_each_gets_its_own_answer() {
    const EACH: u64 = 25;
    let sandbox = Sandbox::new().unwrap();
    let env = Arc::new(start(sandbox.path()).await);
    env.create_replica("r1", shape(1, 1)).await.unwrap();
    for c in 1..=WRITERS {
        let plan = lockstep_plan::text::parse_plan(&format!("get({c})")).unwrap();
        env.create_dataflow(
            "r1",
            &format!("id{c}"),
            0,
            vec![c],
            vec![lockstep_plan::export(100 + c, &plan)],
        )
        .await
        .unwrap();
    }
    let metrics = env.metrics();
    let (commits, stored) = (
        metrics.input_commits.get(),
        metrics.input_writes_stored.get(),
    );
    let mut writers = Vec::new();
    for c in 1..=WRITERS {
        let env = env.clone();
        writers.push(tokio::spawn(async move {
            for t in 0..EACH {
                env.write_input("r1", c, vec![u(&[t as i64, c as i64], t, 1)], t + 1)
                    .await
                    .unwrap_or_else(|e| panic!("write {t} to {c}: {e}"));
            }
        }));
    }
    // Among them, a writer whose second write is below its collection's
    // upper: refused on its own, the others' writes unharmed.
    let refused = {
        let env = env.clone();
        tokio::spawn(async move {
            env.write_input("r1", 20, vec![u(&[0, 20], 4, 1)], 5)
                .await
                .unwrap();
            env.write_input("r1", 20, vec![u(&[1, 20], 2, 1)], 3).await
        })
    };
    for w in writers {
        w.await.unwrap();
    }
    let refused = refused.await.unwrap();
    assert!(
        matches!(refused, Err(ComputeError::OutOfRange(_))),
        "{refused:?}"
    );
    let commits = metrics.input_commits.get() - commits;
    let stored = metrics.input_writes_stored.get() - stored;
    assert_eq!(
        stored,
        WRITERS * EACH + 1,
        "every accepted write stored once"
    );
    assert!(
        commits < stored,
        "{stored} writes in {commits} commits: no two concurrent writes shared a commit"
    );
    eprintln!("group commit: {stored} writes in {commits} catalog transactions");
    for c in 1..=WRITERS {
        let mut got: Vec<(Vec<i64>, i64)> = env
            .peek("r1", 100 + c, EACH - 1)
            .await
            .unwrap()
            .into_iter()
            .map(|(r, d)| (lockstep_plan::rows::decode(&r).unwrap(), d))
            .collect();
        got.sort();
        assert_eq!(got, rows_through(c, EACH - 1), "collection {c}");
    }
}

/// One writer: writes row `(t, c)` at time `t` (upper `t + 1`) to input
/// `c` of replica r, counting its sent and acknowledged writes, until a
/// write fails (the environment was killed).
async fn writer(mut api: common::Client, c: u64, acked: Arc<AtomicU64>, sent: Arc<AtomicU64>) {
    for t in 0.. {
        sent.store(t + 1, SeqCst);
        let answer = api.write_input(write_request(c, t, t + 1)).await;
        if answer.is_err() {
            return;
        }
        acked.store(t + 1, SeqCst);
    }
}

/// Row `(t, c)` at time `t` to input `c` of replica r, with upper `upper`.
fn write_request(c: u64, t: u64, upper: u64) -> proto::WriteInputRequest {
    proto::WriteInputRequest {
        replica: "r".into(),
        collection_id: c,
        updates: vec![lockstep_protocol::proto::Update::from(u(
            &[t as i64, c as i64],
            t,
            1,
        ))],
        upper,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledged_concurrent_writes_survive_a_sigkill_of_the_environment() {
    let policy = common::built_policy("barrier");
    let sandbox = Sandbox::new().unwrap();
    let state = sandbox.path();
    let (port, url) = common::free_port_url();
    let mut first = common::serve_on(state, port, &policy).await;
    cli_ok(
        state,
        &url,
        &["replica", "create", "r", "--processes", "2", "--wait"],
    )
    .await;
    for c in 1..=WRITERS {
        let (input, export) = (c.to_string(), format!("{}=get({c})", 100 + c));
        let args = [
            "dataflow",
            "create",
            "--replica",
            "r",
            "--input",
            &input,
            "--export",
            &export,
        ];
        cli_ok(state, &url, &args).await;
    }
    let acked: Vec<Arc<AtomicU64>> = (0..WRITERS).map(|_| Arc::default()).collect();
    let sent: Vec<Arc<AtomicU64>> = (0..WRITERS).map(|_| Arc::default()).collect();
    let mut writers = Vec::new();
    for c in 1..=WRITERS {
        let i = (c - 1) as usize;
        let api = common::client(&url, state, WAIT).await;
        writers.push(tokio::spawn(writer(
            api,
            c,
            acked[i].clone(),
            sent[i].clone(),
        )));
    }
    // SIGKILL the environment once every writer had 10 writes answered,
    // with every writer's next write in flight.
    let deadline = Instant::now() + WAIT;
    while acked.iter().any(|a| a.load(SeqCst) < 10) {
        assert!(
            Instant::now() < deadline,
            "the writers did not get 10 writes each answered within {WAIT:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    first.kill().await.unwrap();
    for w in writers {
        tokio::time::timeout(WAIT, w)
            .await
            .expect("a writer noticed the kill")
            .unwrap();
    }
    let _second = common::serve_on(state, port, &policy).await;
    let mut api = common::client(&url, state, WAIT).await;
    for c in 1..=WRITERS {
        let i = (c - 1) as usize;
        let (acked, sent) = (acked[i].load(SeqCst), sent[i].load(SeqCst));
        // Every acknowledged write, at its time; the one in flight (if
        // stored) is at a later time and not read here.
        let at = acked - 1;
        let deadline = Instant::now() + WAIT;
        let got = loop {
            let answer = api
                .peek(proto::PeekRequest {
                    replica: "r".into(),
                    collection_id: 100 + c,
                    timestamp: at,
                })
                .await;
            match answer {
                Ok(a) => break a.into_inner().rows,
                Err(e) if Instant::now() < deadline => {
                    eprintln!("peek {c} at {at}: {e}; again");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(e) => panic!("peek {c} at {at}: {e}"),
            }
        };
        let mut got: Vec<(Vec<i64>, i64)> = got
            .into_iter()
            .map(|r| (lockstep_plan::rows::decode(&r.values).unwrap(), r.diff))
            .collect();
        got.sort();
        assert_eq!(
            got,
            rows_through(c, at),
            "collection {c}: {acked} writes acknowledged, {sent} sent"
        );
        // The stored upper is the acknowledged one, or the in-flight
        // write's if it was stored before the kill: a write at `acked`
        // (the first never acknowledged) goes through or is refused as
        // below the upper, never lost halfway.
        let next = api.write_input(write_request(c, sent, sent + 1)).await;
        assert!(
            next.is_ok(),
            "collection {c}: a write after the restart: {next:?}"
        );
    }
}
