//! A replica's processes replaced three times under one steady read,
//! write and subscribe load, under each shipped distribution policy:
//! `lockstep replica upgrade --keep-answering` (every process restarts),
//! then `lockstep replica resize` from 2x2 to 4x2 and to 1x1 (the processes
//! replaced by processes of another shape). Each time a standby generation
//! answers the replica's peeks meanwhile, and no read is refused or
//! answered wrongly, while writes go on. The assertion that the standby
//! really answered: no peek waited half as long as the replica's own
//! processes were away (replacement to caught up, as the environment
//! reports it), which a peek sent to them then would have (checked by
//! routing every read to them: the longest peek is then about that
//! window). The collection counts [`ROWS`] rows in [`GROUPS`] groups, so
//! that catching up takes a while and a peek's answer is small. A
//! subscription open throughout stays with the replica's own processes and
//! must carry every change exactly once across all three replacements.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::Arc;
use std::time::{Duration, Instant};

mod common;

use common::cli_ok;
use lockstep_chaos::environment::Sandbox;
use lockstep_chaos::environment::{Bearer, Client};
use lockstep_environment::proto;
use lockstep_environment::proto::environment_client::EnvironmentClient;

/// Every bounded wait of this test.
const WAIT: Duration = Duration::from_secs(90);

/// Rows of input 1 at time 0.
const ROWS: i64 = 20_000;

/// Row `i` of input 1 is `(i, i % GROUPS)`; collection 101 counts them by
/// their second column.
const GROUPS: i64 = 100;

/// Writes row `ROWS + t` at time `t` to input 1 of replica r (upper `t + 1`).
async fn write_at(state: &Path, url: &str, t: u64) {
    let i = ROWS + t as i64;
    common::write_to_r(state, url, &format!("{i},{}@{t}", i % GROUPS), t + 1).await;
}

/// The child processes of `pid` (every thread's).
fn children(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let path = task.unwrap().path().join("children");
        let text = std::fs::read_to_string(path).unwrap_or_default();
        out.extend(text.split_whitespace().map(|p| p.parse::<u32>().unwrap()));
    }
    out
}

/// What the reader saw.
#[derive(Debug, Default)]
struct Reads {
    answered: u64,
    refused: BTreeMap<String, u64>,
    wrong: Vec<String>,
    /// The longest peek.
    longest: Duration,
}

/// Peeks collection 101 until `stop`, at time 0 and at the newest written
/// time in turn, checking each answer: per group, the count of input 1's
/// rows `0 ..= ROWS + t` (but row `ROWS`, never written) in it.
async fn read_steadily(mut api: Client, written: Arc<AtomicU64>, stop: Arc<AtomicBool>) -> Reads {
    let mut reads = Reads::default();
    let mut newest = false;
    while !stop.load(SeqCst) {
        newest = !newest;
        let t = if newest { written.load(SeqCst) } else { 0 };
        let started = Instant::now();
        let answer = api
            .peek(proto::PeekRequest {
                replica: "r".into(),
                collection_id: 101,
                timestamp: t,
            })
            .await;
        reads.longest = reads.longest.max(started.elapsed());
        match answer {
            Ok(a) => {
                reads.answered += 1;
                let mut got: Vec<(Vec<i64>, i64)> = a
                    .into_inner()
                    .rows
                    .into_iter()
                    .map(|r| (lockstep_plan::rows::decode(&r.values).unwrap(), r.diff))
                    .collect();
                got.sort();
                if got != counts_at(t) {
                    reads.wrong.push(format!("at {t}: {got:?}"));
                }
            }
            Err(s) => *reads.refused.entry(s.code().to_string()).or_default() += 1,
        }
    }
    reads
}

/// Collection 101 at time `t`: per group, the count of input 1's rows
/// `0 ..= ROWS + t` (but row `ROWS`, never written) in it, sorted.
fn counts_at(t: u64) -> Vec<(Vec<i64>, i64)> {
    let mut counts = BTreeMap::new();
    for i in (0..ROWS).chain(ROWS + 1..=ROWS + t as i64) {
        *counts.entry(i % GROUPS).or_insert(0) += 1;
    }
    counts.into_iter().map(|(g, n)| (vec![g, n], 1)).collect()
}

/// What the subscriber saw: every update, and the longest wait between two
/// batches.
#[derive(Debug, Default)]
struct Stream {
    updates: Vec<(Vec<i64>, u64, i64)>,
    upper: u64,
    longest_gap: Duration,
}

/// Subscribes to collection 101 as of 0 and takes every batch until the
/// writer is `done` and its upper passed the newest written time (bounded).
/// The upper moves only with writes: once the writer is done, the batch
/// past its last write may already be here, so the wait for the next batch
/// also ends when `done` turns true.
async fn subscribe_steadily(
    mut api: Client,
    written: Arc<AtomicU64>,
    mut done: tokio::sync::watch::Receiver<bool>,
) -> Stream {
    let mut batches = api
        .subscribe(proto::SubscribeRequest {
            replica: "r".into(),
            collection_id: 101,
            as_of: 0,
            resume: false,
        })
        .await
        .unwrap()
        .into_inner();
    let mut stream = Stream::default();
    let mut last = Instant::now();
    while !(*done.borrow() && stream.upper > written.load(SeqCst)) {
        let next = tokio::select! {
            next = tokio::time::timeout(WAIT, batches.message()) => next,
            // The writer finished: check the upper against its last write.
            _ = done.changed(), if !*done.borrow() => continue,
        };
        let batch = next
            .unwrap_or_else(|_| {
                panic!(
                    "a batch in time: upper {}, written {}",
                    stream.upper,
                    written.load(SeqCst)
                )
            })
            .expect("the stream goes on")
            .expect("the stream does not end");
        stream.longest_gap = stream.longest_gap.max(last.elapsed());
        last = Instant::now();
        stream.upper = batch.upper.first().copied().unwrap_or(u64::MAX);
        for u in batch.updates {
            let values = lockstep_plan::rows::decode(&u.row).unwrap();
            stream.updates.push((values, u.time, u.diff));
        }
    }
    stream
}

/// How the replica's processes are replaced, in turn.
const REPLACEMENTS: [&[&str]; 3] = [
    &["replica", "upgrade", "r", "--keep-answering"],
    &[
        "replica",
        "resize",
        "r",
        "--processes",
        "4",
        "--workers",
        "2",
    ],
    &[
        "replica",
        "resize",
        "r",
        "--processes",
        "1",
        "--workers",
        "1",
    ],
];

/// The replica's shape after each of [`REPLACEMENTS`] (processes, workers).
const SHAPES: [(u64, u64); 3] = [(2, 2), (4, 2), (1, 1)];

/// The seconds the standby answered the replica's reads, from the CLI's
/// line "... (standby caught up after A s, answered the replica's reads
/// for B s)".
fn standby_served(out: &str) -> f64 {
    out.split("answered the replica's reads for ")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no time the standby served in {out:?}"))
}

/// The phases of a reconfiguration, in order (`ListReplicas`).
const PHASES: [&str; 5] = [
    "standby-hydrating",
    "replacing",
    "hydrating",
    "rolling-back",
    "dropping-standby",
];

/// Watches replica r's reconfiguration through ListReplicas until `stop`:
/// every change of (kind, target, phase) seen, in order, and whether a
/// standby's count of dataflows caught up was ever reported.
async fn watch_phases(
    mut api: Client,
    stop: Arc<AtomicBool>,
) -> (Vec<(String, (u32, u32), String)>, bool) {
    let mut seen: Vec<(String, (u32, u32), String)> = Vec::new();
    let mut standby_reported = false;
    while !stop.load(SeqCst) {
        if let Ok(list) = api
            .list_replicas(proto::ListReplicasRequest::default())
            .await
        {
            if let Some(c) = list
                .into_inner()
                .replicas
                .first()
                .and_then(|r| r.reconfiguration.clone())
            {
                // A standby, once it has a controller, reports how far it
                // caught up, out of the one dataflow.
                assert!(
                    c.standby_dataflows_caught_up.is_none_or(|n| n <= 1),
                    "{c:?}"
                );
                standby_reported |= c.standby_dataflows_caught_up.is_some();
                let now = (
                    c.kind,
                    (c.target_processes, c.target_workers_per_process),
                    c.phase,
                );
                if seen.last() != Some(&now) {
                    seen.push(now);
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    (seen, standby_reported)
}

async fn replace_under(strategy: &str) {
    let policy = common::built_policy(strategy);
    let sandbox = Sandbox::new().unwrap();
    let state = sandbox.path();
    let (port, url) = common::free_port_url();
    let serve = common::serve_on(state, port, &policy).await;
    let serve_pid = serve.id().unwrap();
    common::replica_r_with(state, &url, 2, 2, "reduce(get(1), [#1], count)").await;
    let token = std::fs::read_to_string(state.join("api.token")).unwrap();
    let channel = tonic::transport::Endpoint::from_shared(url.clone())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut api =
        EnvironmentClient::with_interceptor(channel, Bearer::new(Some(token.trim())).unwrap());
    common::write_grouped_to_r(&mut api, ROWS, GROUPS).await;
    // Every row counted before the load starts (a peek waits for it).
    api.peek(proto::PeekRequest {
        replica: "r".into(),
        collection_id: 101,
        timestamp: 0,
    })
    .await
    .unwrap();
    assert_eq!(
        children(serve_pid).len(),
        2,
        "{strategy}: the replica's two processes"
    );
    let written = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let (written_all, written_all_rx) = tokio::sync::watch::channel(false);
    let subscriber = tokio::spawn(subscribe_steadily(
        api.clone(),
        written.clone(),
        written_all_rx,
    ));
    let watcher = tokio::spawn(watch_phases(api.clone(), stop.clone()));
    let reader = tokio::spawn(read_steadily(api, written.clone(), stop.clone()));
    // Writes go on throughout: the standby must take them too.
    let writer = {
        let (state, url, written, stop) = (
            state.to_path_buf(),
            url.clone(),
            written.clone(),
            stop.clone(),
        );
        tokio::spawn(async move {
            let mut t = 1;
            while !stop.load(SeqCst) {
                write_at(&state, &url, t).await;
                written.store(t, SeqCst);
                t += 1;
            }
        })
    };

    let mut shortest_served = f64::MAX;
    for (command, shape) in REPLACEMENTS.iter().zip(SHAPES) {
        let before = common::pids_of_r(state, &url).await;
        let out = tokio::time::timeout(WAIT, cli_ok(state, &url, command))
            .await
            .unwrap_or_else(|_| panic!("{strategy}: {command:?} finished in time"));
        eprintln!("{strategy}: {command:?}: {out}");
        assert!(
            out.contains("reads answered throughout"),
            "{strategy}: {out}"
        );
        shortest_served = shortest_served.min(standby_served(&out));
        assert_eq!(
            common::listed_r(state, &url).await.1,
            shape,
            "{strategy}: the shape after {command:?}"
        );
        let after = common::pids_of_r(state, &url).await;
        assert_eq!(after.len() as u64, shape.0, "{strategy}: {after:?}");
        assert!(
            before.iter().all(|p| !after.contains(p)),
            "{strategy}: every process replaced by {command:?}: {before:?} then {after:?}"
        );
        // The standby's processes are gone: only the replica's own are left.
        let deadline = Instant::now() + WAIT;
        while children(serve_pid).len() as u64 != shape.0 {
            assert!(
                Instant::now() < deadline,
                "{strategy}: after {command:?} the standby's or the old processes are still there: {:?}",
                children(serve_pid)
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    stop.store(true, SeqCst);
    let (phases, standby_reported) = watcher.await.unwrap();
    assert!(
        standby_reported,
        "{strategy}: a standby's dataflows caught up shown"
    );
    let reads = reader.await.unwrap();
    writer.await.unwrap();
    written_all.send(true).unwrap();
    let stream = subscriber.await.unwrap();
    eprintln!(
        "{strategy}: {reads:?}; subscription: {} updates, longest gap {:?}",
        stream.updates.len(),
        stream.longest_gap
    );
    // The subscription stayed with the replica's own processes across every
    // replacement: every change exactly once (a gap or a duplicate changes
    // a count).
    let last = written.load(SeqCst);
    let mut sum: BTreeMap<Vec<i64>, i64> = BTreeMap::new();
    for (values, time, diff) in &stream.updates {
        if *time <= last {
            *sum.entry(values.clone()).or_default() += diff;
        }
    }
    let seen: Vec<(Vec<i64>, i64)> = sum.into_iter().filter(|(_, d)| *d != 0).collect();
    assert_eq!(
        seen,
        counts_at(last),
        "{strategy}: the subscription's changes up to {last}, consolidated"
    );
    // ListReplicas showed each reconfiguration, its kind and target, its
    // phases in order, and none once it was done.
    eprintln!("{strategy}: phases seen: {phases:?}");
    for (kind, target) in [("upgrade", (2, 2)), ("resize", (4, 2)), ("resize", (1, 1))] {
        let of: Vec<usize> = phases
            .iter()
            .filter(|(k, t, _)| k == kind && *t == target)
            .map(|(_, _, p)| PHASES.iter().position(|x| x == p).expect("a known phase"))
            .collect();
        assert!(
            !of.is_empty() && of.windows(2).all(|w| w[0] < w[1]),
            "{strategy}: the phases of {kind} to {target:?} in order: {phases:?}"
        );
    }
    // None once done, and the replica's one dataflow caught up with the
    // last write (bounded).
    let deadline = Instant::now() + WAIT;
    loop {
        let listed = cli_ok(state, &url, &["replica", "list", "-o", "json"]).await;
        let listed: serde_json::Value = serde_json::from_str(&listed).unwrap();
        let r = &listed["replicas"][0];
        assert!(
            r["reconfiguration"].is_null(),
            "{strategy}: no reconfiguration once done: {listed}"
        );
        assert_eq!(r["live_dataflows"], 1, "{strategy}: {listed}");
        if r["dataflows_caught_up"] == 1 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{strategy}: the dataflow never caught up: {listed}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        reads.refused.is_empty(),
        "{strategy}: refused reads: {reads:?}"
    );
    assert!(
        reads.wrong.is_empty(),
        "{strategy}: wrong answers: {reads:?}"
    );
    assert!(reads.answered >= 10, "{strategy}: a steady load: {reads:?}");
    assert!(
        reads.longest.as_secs_f64() < shortest_served / 2.0,
        "{strategy}: a peek waited {:?}, as long as the replica's own processes were away ({shortest_served} s at the shortest): the standby did not answer it",
        reads.longest
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upgrade_and_resizes_keep_answering_under_barrier() {
    replace_under("barrier").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upgrade_and_resizes_keep_answering_under_broadcast() {
    replace_under("broadcast").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upgrade_and_resizes_keep_answering_under_log() {
    replace_under("log").await;
}
