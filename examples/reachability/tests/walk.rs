//! The reachability family through real replica processes of its own
//! binary (`lockstep-replica-reachability`), driven by lockstep's
//! controller, which knows nothing of the family: under every
//! distribution strategy that keeps lockstep, the exports' peeks and a
//! subscription answer what the plain-Rust reference says at every time, every worker built the same
//! dataflows in the same order (I1), and a description the family cannot
//! read is refused by every process before anything is built.

use std::time::Duration;

use lockstep_controller::{Controller, Event, Timeouts};
use lockstep_example_reachability::{self as reachability, describe, distance, reference, FORMAT};
use lockstep_orchestrator::process::{
    kill_all_services, ProcessOrchestrator, ProcessOrchestratorConfig,
};
use lockstep_orchestrator::Orchestrator;
use lockstep_policy::FixedStrategy;
use lockstep_protocol::{
    CommandHistory, DataflowDescription, ErrorKind, SessionKey, Strategy, Update,
};

const PROCESSES: usize = 2;
const WORKERS: u32 = 2;

/// A replica of the family's binary, and a controller that sends every
/// command with `strategy`.
struct Walk {
    dir: tempfile::TempDir,
    controller: Controller,
}

impl Drop for Walk {
    fn drop(&mut self) {
        self.controller.shutdown();
        let _ = kill_all_services(self.dir.path());
    }
}

async fn start(replica_id: u64, strategy: Strategy) -> Walk {
    let dir = tempfile::tempdir().expect("tempdir");
    let orchestrator = ProcessOrchestrator::new(ProcessOrchestratorConfig::new(dir.path(), 1))
        .expect("orchestrator");
    let log = lockstep_controller::LogLocation::Sqlite(dir.path().join("command-log.sqlite"));
    let key = SessionKey::derive(&[0x7a; 32], replica_id);
    let service = lockstep_launch::replica_service(
        std::path::Path::new(env!("CARGO_BIN_EXE_lockstep-replica-reachability")),
        replica_id,
        PROCESSES,
        WORKERS,
    )
    .env("RUST_LOG", "warn");
    let status = orchestrator
        .ensure_service(lockstep_launch::with_command_log(
            lockstep_launch::with_session_key(service, &key),
            &log,
        ))
        .await
        .expect("the family's replica starts");
    let mut addrs = lockstep_launch::replica_addrs(&status, WORKERS).expect("controller ports");
    addrs.command_log = Some(log);
    addrs.session_key = Some(key);
    let controller = Controller::start(
        addrs,
        1,
        CommandHistory::new(),
        Box::new(FixedStrategy(strategy)),
        Timeouts {
            connect: Duration::from_secs(20),
            heartbeat_interval: Duration::from_millis(100),
            heartbeat_timeout: Duration::from_secs(2),
            request: Duration::from_secs(20),
        },
    );
    Walk { dir, controller }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn distances_match_the_reference_under_every_strategy() {
    let roots = [(101u64, "n0"), (102, "n5")];
    for (i, strategy) in [Strategy::Barrier, Strategy::Broadcast, Strategy::Log]
        .into_iter()
        .enumerate()
    {
        let walk = start(40 + i as u64, strategy).await;
        let c = &walk.controller;
        c.create_dataflow(DataflowDescription {
            id: 1,
            as_of: 0,
            inputs: vec![1],
            exports: roots.iter().map(|&(c, r)| describe(c, r)).collect(),
            debug_name: "distances".into(),
            format: FORMAT.into(),
        })
        .unwrap();
        // A subscription to the distances from 5, from before the writes.
        let mut changes = c.subscribe(102, 0).unwrap();
        let mut written = Vec::new();
        for (updates, upper) in reachability::sample_writes() {
            written.extend(updates.iter().cloned());
            c.write_input(1, updates, upper).unwrap();
        }
        let mut streamed: Vec<Update> = Vec::new();
        let mut upper = Some(0);
        while upper.is_some_and(|u| u < 3) {
            let batch = tokio::time::timeout(Duration::from_secs(20), changes.recv())
                .await
                .expect("a subscribe batch within 20 s")
                .expect("the subscription is open")
                .expect("a batch, not an error");
            streamed.extend(batch.updates);
            upper = batch.upper;
        }
        for t in 0..3 {
            let mut at: std::collections::BTreeMap<Vec<u8>, i64> = Default::default();
            for u in streamed.iter().filter(|u| u.time <= t) {
                *at.entry(u.row.clone()).or_insert(0) += u.diff;
            }
            at.retain(|_, d| *d != 0);
            assert!(at.values().all(|d| *d == 1), "{strategy}: {at:?} at {t}");
            assert_eq!(
                at.into_keys().collect::<std::collections::BTreeSet<_>>(),
                reference(&written, "n5", t),
                "{strategy}: the subscription's distances from n5 at {t}"
            );
        }
        for &(collection, root) in &roots {
            c.wait_for_frontier(collection, 2).await.unwrap();
            for t in 0..3 {
                let got: std::collections::BTreeSet<Vec<u8>> = c
                    .peek(collection, t)
                    .await
                    .unwrap()
                    .into_iter()
                    .map(|(row, diff)| {
                        assert_eq!(diff, 1, "{strategy}: {row:?} at {t}");
                        row
                    })
                    .collect();
                assert_eq!(
                    got,
                    reference(&written, root, t),
                    "{strategy}: distances from {root} at {t}"
                );
            }
        }
        // The reference is not trivially small: node 7 is 3 steps from 5 at
        // time 2 (5 -> 4 -> 6 -> 7).
        assert!(reference(&written, "n5", 2).contains(&distance("n7", 3)));
        // I1: every worker built the same dataflows in the same order.
        let statuses = c.statuses().await.unwrap();
        assert_eq!(statuses.len(), PROCESSES * WORKERS as usize);
        for s in &statuses {
            assert_eq!(s.creation_log, statuses[0].creation_log, "{strategy}");
            assert_eq!(s.creation_log.len(), 1, "{strategy}");
        }
    }
}

/// The next error a process reports about the command whose message starts
/// with `about` (every process reports its own refusal).
async fn next_error(
    events: &mut tokio::sync::broadcast::Receiver<Event>,
    about: &str,
) -> lockstep_protocol::ErrorResponse {
    loop {
        let e = tokio::time::timeout(Duration::from_secs(20), events.recv())
            .await
            .expect("an error event within 20 s")
            .unwrap();
        match e {
            Event::ReplicaError { error, .. } if error.message.starts_with(about) => return error,
            _ => {}
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_description_the_family_cannot_read_is_refused_before_anything_is_built() {
    let walk = start(50, Strategy::Barrier).await;
    let c = &walk.controller;
    let mut events = c.events();
    let mut bad = DataflowDescription {
        id: 2,
        as_of: 0,
        inputs: vec![1],
        exports: vec![describe(201, "n0")],
        debug_name: "bad".into(),
        format: FORMAT.into(),
    };
    // Not UTF-8: not a node name.
    bad.exports[0].description = vec![0xff, 0xfe];
    c.create_dataflow(bad).unwrap();
    let error = next_error(&mut events, "dataflow 2:").await;
    assert_eq!(error.kind, ErrorKind::InvalidCommand);
    assert!(
        error.message.contains("(2 bytes) is not a") && error.message.contains(FORMAT),
        "{}",
        error.message
    );
    // A dataflow of another family (the built-in plan language's format)
    // is refused by its format, before its descriptions are read.
    let other = DataflowDescription {
        id: 3,
        as_of: 0,
        inputs: vec![1],
        exports: vec![describe(301, "n0")],
        debug_name: "other".into(),
        format: lockstep_protocol::DEFAULT_FORMAT.into(),
    };
    c.create_dataflow(other).unwrap();
    let error = next_error(&mut events, "dataflow 3:").await;
    assert_eq!(error.kind, ErrorKind::InvalidCommand);
    assert!(
        error.message.contains("format \"lockstep.plan.v1\"")
            && error.message.contains(&format!("builds \"{FORMAT}\"")),
        "{}",
        error.message
    );
    let statuses = c.statuses().await.unwrap();
    assert!(statuses.iter().all(|s| s.creation_log.is_empty()));
}
