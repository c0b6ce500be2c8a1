//! End to end on real processes: a 2-process x 2-worker replica launched by
//! the orchestrator's process backend, driven by the controller.

mod common;

use common::*;
use lockstep_protocol::WireMessage;
use lockstep_protocol::{CommandHistory, Strategy};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_operator_matches_the_reference() {
    operators_match_the_reference(1, Strategy::Barrier).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_operator_matches_the_reference_broadcast() {
    operators_match_the_reference(11, Strategy::Broadcast).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_operator_matches_the_reference_log() {
    operators_match_the_reference(12, Strategy::Log).await;
}

async fn operators_match_the_reference(replica_id: u64, strategy: Strategy) {
    let r = start_replica(replica_id, 2, 2).await;
    let c = controller_with(&r, 1, CommandHistory::new(), strategy);
    let dataflows = operator_dataflows();
    for d in &dataflows {
        c.create_dataflow(d.clone()).unwrap();
    }
    let writes = operator_writes();
    for (coll, ups, upper) in &writes {
        c.write_input(*coll, ups.clone(), *upper).unwrap();
    }
    for d in &dataflows {
        let coll = d.exports[0].collection_id;
        for t in 0..4 {
            let got = as_multiset(c.peek(coll, t).await.unwrap());
            assert_eq!(
                got,
                reference(d, &writes, t),
                "dataflow {} at time {t}",
                d.id
            );
        }
    }
    if strategy == Strategy::Log {
        // The commands went through the log, not around it.
        use lockstep_command_log::CommandLog;
        let mut log =
            lockstep_command_log::AnyLog::open(r.addrs.command_log.as_ref().unwrap()).unwrap();
        let creates = log
            .read_from(1, 10_000)
            .unwrap()
            .iter()
            .filter(|e| {
                matches!(
                    e.command.kind,
                    lockstep_protocol::CommandKind::CreateDataflow(_)
                )
            })
            .count();
        assert_eq!(creates, dataflows.len());
    }
    // I1: every worker built the same dataflows in the same order.
    let statuses = c.statuses().await.unwrap();
    assert_eq!(statuses.len(), 4);
    for s in &statuses {
        assert_eq!(
            s.creation_log, statuses[0].creation_log,
            "worker {}",
            s.worker_index
        );
        assert_eq!(s.creation_log.len(), dataflows.len());
    }
    c.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscribe_streams_every_change() {
    let r = start_replica(2, 2, 2).await;
    let c = controller(&r, 1, CommandHistory::new());
    let dataflows = operator_dataflows();
    let reduce = dataflows.iter().find(|d| d.id == 14).unwrap().clone();
    let join = dataflows.iter().find(|d| d.id == 13).unwrap().clone();
    c.create_dataflow(reduce.clone()).unwrap();
    c.create_dataflow(join.clone()).unwrap();
    let writes = operator_writes();
    // Half the writes before subscribing (the snapshot), half after.
    for (coll, ups, upper) in &writes[..2] {
        c.write_input(*coll, ups.clone(), *upper).unwrap();
    }
    let mut subs = Vec::new();
    for d in [&reduce, &join] {
        let coll = d.exports[0].collection_id;
        c.wait_for_frontier(coll, 0).await.unwrap();
        subs.push((d, c.subscribe(coll, 0).unwrap()));
    }
    for (coll, ups, upper) in &writes[2..] {
        c.write_input(*coll, ups.clone(), *upper).unwrap();
    }
    for (d, mut rx) in subs {
        let mut acc: Vec<lockstep_protocol::Update> = Vec::new();
        let mut upper = Some(0);
        while upper.is_some_and(|u| u < 4) {
            let b = tokio::time::timeout(std::time::Duration::from_secs(20), rx.recv())
                .await
                .expect("subscribe batch within 20 s")
                .expect("subscription open")
                .expect("a batch, not an error");
            assert!(b
                .updates
                .iter()
                .all(|u| b.upper.is_none_or(|up| u.time < up)));
            acc.extend(b.updates);
            upper = b.upper;
        }
        for t in 0..4 {
            let got = lockstep_plan::reference::at_time(&acc, t);
            assert_eq!(
                got,
                reference(d, &writes, t),
                "subscription to dataflow {} at {t}",
                d.id
            );
        }
    }
    c.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn controller_restart_keeps_unchanged_dataflows() {
    restart_keeps_unchanged_dataflows(3, Strategy::Barrier).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn controller_restart_keeps_unchanged_dataflows_broadcast() {
    restart_keeps_unchanged_dataflows(13, Strategy::Broadcast).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn controller_restart_keeps_unchanged_dataflows_log() {
    restart_keeps_unchanged_dataflows(14, Strategy::Log).await;
}

async fn restart_keeps_unchanged_dataflows(replica_id: u64, strategy: Strategy) {
    let r = start_replica(replica_id, 2, 2).await;
    let a = controller_with(&r, 1, CommandHistory::new(), strategy);
    let dataflows = operator_dataflows();
    for d in &dataflows {
        a.create_dataflow(d.clone()).unwrap();
    }
    let writes = operator_writes();
    for (coll, ups, upper) in &writes {
        a.write_input(*coll, ups.clone(), *upper).unwrap();
    }
    for d in &dataflows {
        a.wait_for_frontier(d.exports[0].collection_id, 3)
            .await
            .unwrap();
    }
    let before = a.statuses().await.unwrap();
    let history = a.history().await.unwrap();
    a.shutdown();

    // A new controller (a restarted environment) with the same target state.
    let b = controller_with(&r, 2, history.clone(), strategy);
    let after = b.statuses().await.unwrap();
    if strategy == Strategy::Log {
        // Every worker read b's marker: a's session was truncated away, and
        // the log now starts with b's Hello.
        use lockstep_command_log::CommandLog;
        let mut log =
            lockstep_command_log::AnyLog::open(r.addrs.command_log.as_ref().unwrap()).unwrap();
        let first = log.read_from(1, 1).unwrap().remove(0);
        assert!(first.offset > 1, "nothing was truncated");
        match first.command.kind {
            lockstep_protocol::CommandKind::Hello(h) => assert_eq!(h.epoch, 2),
            other => panic!("the log starts with {other:?}, not b's marker"),
        }
    }
    for (x, y) in before.iter().zip(&after) {
        assert_eq!(
            x.creation_log, y.creation_log,
            "worker {} rebuilt a dataflow",
            x.worker_index
        );
    }
    for d in &dataflows {
        let coll = d.exports[0].collection_id;
        for t in 0..4 {
            assert_eq!(
                as_multiset(b.peek(coll, t).await.unwrap()),
                reference(d, &writes, t)
            );
        }
    }
    // A third controller wants one dataflow fewer and one new one.
    let mut changed = history;
    let gone = &dataflows[0];
    changed.push(lockstep_protocol::CommandKind::AllowCompaction {
        collection_id: gone.exports[0].collection_id,
        frontier: None,
    });
    let new = dataflow(
        20,
        &[1, 2],
        lockstep_plan::Plan::Join {
            left: get(2),
            right: get(1),
            left_key: 0,
            right_key: 0,
        },
    );
    changed.push(lockstep_protocol::CommandKind::CreateDataflow(new.clone()));
    b.shutdown();
    let c = controller_with(&r, 3, changed, strategy);
    let statuses = c.statuses().await.unwrap();
    for s in &statuses {
        assert!(
            !s.installed.contains(&gone.id),
            "worker {} still runs dataflow {}\n{}",
            s.worker_index,
            gone.id,
            logs(&r, 30)
        );
        assert!(s.installed.contains(&new.id));
        assert_eq!(
            s.creation_log.len(),
            before[0].creation_log.len() + 1,
            "only the new dataflow was built"
        );
        assert_eq!(s.creation_log, statuses[0].creation_log);
    }
    assert_eq!(
        as_multiset(c.peek(1020, 3).await.unwrap()),
        reference(&new, &writes, 3)
    );
    c.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_process_is_reported_and_the_replica_recovers() {
    use lockstep_controller::Event;
    use lockstep_orchestrator::Orchestrator;
    let r = start_replica(4, 2, 2).await;
    let c = controller(&r, 1, CommandHistory::new());
    let mut events = c.events();
    let d = operator_dataflows().remove(4); // the reduce
    c.create_dataflow(d.clone()).unwrap();
    let writes = operator_writes();
    for (coll, ups, upper) in &writes {
        c.write_input(*coll, ups.clone(), *upper).unwrap();
    }
    assert_eq!(
        as_multiset(c.peek(1014, 3).await.unwrap()),
        reference(&d, &writes, 3)
    );

    let services = r.orchestrator.list_services().await.unwrap();
    let pid = services[0].processes[1].pid.expect("process 1 runs");
    let killed = std::time::Instant::now();
    let rc = unsafe_free_kill(pid);
    assert!(rc, "kill -9 {pid}");
    // Reported within the bound: a lost connection is noticed at once.
    let reported = loop {
        let e = tokio::time::timeout(std::time::Duration::from_secs(5), events.recv())
            .await
            .expect("an event within 5 s of the kill")
            .unwrap();
        if matches!(e, Event::Disconnected { .. } | Event::ProcessSilent { .. }) {
            break killed.elapsed();
        }
    };
    assert!(
        reported < std::time::Duration::from_secs(3),
        "reported after {reported:?}"
    );
    // The orchestrator restarts the processes, the controller reconnects and
    // rehydrates, and the answers are right again.
    assert_eq!(
        as_multiset(c.peek(1014, 3).await.unwrap()),
        reference(&d, &writes, 3)
    );
    let statuses = c.statuses().await.unwrap();
    for s in &statuses {
        assert_eq!(s.creation_log, statuses[0].creation_log);
    }
    eprintln!(
        "kill reported after {reported:?}, recovered after {:?}",
        killed.elapsed()
    );
    c.shutdown();
}

fn unsafe_free_kill(pid: u32) -> bool {
    std::process::Command::new("kill")
        .args(["-9", &pid.to_string()])
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_writes_keep_frontiers_moving() {
    // Regression: a Status carrying the history digest on every heartbeat
    // cost time proportional to the history, until workers did nothing else.
    let r = start_replica(6, 2, 2).await;
    let c = controller(&r, 1, CommandHistory::new());
    let d = operator_dataflows().remove(0);
    c.create_dataflow(d.clone()).unwrap();
    for time in 0..400u64 {
        let rows: Vec<_> = (0..200).map(|i| u(&[i, time as i64], time, 1)).collect();
        c.write_input(1, rows, time + 1).unwrap();
        if let Err(e) = c.wait_for_frontier(1010, time).await {
            let f = c.frontier(1010).await;
            panic!("at time {time}: {e}; frontier {f:?}\n{}", logs(&r, 400));
        }
    }
    let rows = c.peek(1010, 399).await.unwrap();
    assert_eq!(rows.len(), 400 * 200);
    c.shutdown();
}

/// Many controllers in quick succession (each reconciles and leaves), then
/// one that creates more dataflows: every new dataflow must come up. (The
/// benchmark of reconciliation after restarts found a hang here.)
async fn restarts_then_more_creates(replica_id: u64, strategy: Strategy) {
    let r = start_replica(replica_id, 2, 2).await;
    let small = |id: u64| dataflow(id, &[1], lockstep_plan::Plan::Get { collection_id: 1 });
    let a = controller_with(&r, 1, CommandHistory::new(), strategy);
    a.write_input(1, vec![u(&[1, 1], 0, 1)], 1).unwrap();
    for id in 1..=100 {
        a.create_dataflow(small(id)).unwrap();
    }
    a.wait_for_frontier(1100, 0).await.unwrap();
    let history = a.history().await.unwrap();
    a.shutdown();
    let mut epoch = 1;
    for _ in 0..50 {
        epoch += 1;
        let c = controller_with(&r, epoch, history.clone(), strategy);
        c.statuses().await.unwrap();
        c.shutdown();
    }
    epoch += 1;
    let c = controller_with(&r, epoch, history, strategy);
    for id in 101..=400 {
        c.create_dataflow(small(id)).unwrap();
    }
    if let Err(e) = tokio::time::timeout(
        std::time::Duration::from_secs(15),
        c.wait_for_frontier(1400, 0),
    )
    .await
    {
        panic!("dataflow 400 did not come up: {e}\n{}", logs(&r, 20));
    }
    let statuses = c.statuses().await.unwrap();
    for s in &statuses {
        assert_eq!(s.installed.len(), 400, "worker {}", s.worker_index);
        assert_eq!(s.creation_log, statuses[0].creation_log);
    }
    c.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarts_then_more_creates_barrier() {
    restarts_then_more_creates(21, Strategy::Barrier).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarts_then_more_creates_broadcast() {
    restarts_then_more_creates(22, Strategy::Broadcast).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarts_then_more_creates_log() {
    restarts_then_more_creates(23, Strategy::Log).await;
}

/// A peek answer over the frame limit is answered with an error, and the
/// process keeps answering: it used to kill the process's response writer,
/// so the process went silent, was restarted and was asked again, forever.
/// A controller of `r` whose connections use `max_frame_len`, like the
/// replica's processes.
fn controller_framed(
    r: &TestReplica,
    epoch: u64,
    history: CommandHistory,
    strategy: Strategy,
    max_frame_len: usize,
) -> lockstep_controller::Controller {
    let mut addrs = r.addrs.clone();
    addrs.max_frame_len = max_frame_len;
    lockstep_controller::Controller::start(
        addrs,
        epoch,
        history,
        Box::new(lockstep_policy::FixedStrategy(strategy)),
        test_timeouts(),
    )
}

/// A write, a peek answer and a rehydration 50 times the frame limit travel
/// in parts. Before parts, the controller could not encode the write (it
/// reconnected forever and the frontier never advanced), and a process could
/// only answer such a peek with an error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_peeks_and_rehydration_50_times_the_frame_limit_travel_in_parts() {
    const LIMIT: usize = 64 << 10;
    let limit = LIMIT.to_string();
    let env = [("LOCKSTEP_MAX_FRAME_LEN", limit.as_str())];
    let identity = dataflow(1, &[1], lockstep_plan::text::parse_plan("get(1)").unwrap());
    // 60,000 rows of 8 large values: about 3.7 MB encoded, over 50 frames.
    let rows: Vec<_> = (0..60_000i64)
        .map(|i| {
            let row: Vec<i64> = (0..8).map(|c| i * 1_000_000_007 + c).collect();
            u(&row, 0, 1)
        })
        .collect();
    let write = lockstep_protocol::WriteInput {
        collection_id: 1,
        updates: rows.clone(),
        upper: 1,
        more: false,
        batch_digest: None,
    };
    let encoded = lockstep_protocol::Command {
        seqno: 1,
        strategy: Strategy::Barrier,
        kind: lockstep_protocol::CommandKind::WriteInput(write.clone()),
    }
    .encode_to_vec()
    .len();
    assert!(encoded > 50 * LIMIT, "only {encoded} bytes");
    let expected = as_multiset(rows.iter().map(|u| (u.row.clone(), 1)).collect());

    let r = start_replica_with_env(24, 2, 1, &env).await;
    let c = controller_framed(&r, 1, CommandHistory::new(), Strategy::Barrier, LIMIT);
    c.create_dataflow(identity.clone()).unwrap();
    c.write_input(1, rows.clone(), 1).unwrap();
    if let Err(e) = c.wait_for_frontier(1001, 0).await {
        panic!("{e}\n{}", logs(&r, 10));
    }
    let got = c.peek(1001, 0).await.unwrap();
    assert_eq!(as_multiset(got), expected);
    c.shutdown();

    // A fresh replica rehydrated from a history holding that write, with the
    // log strategy (the parts go through the command log).
    let mut history = CommandHistory::new();
    history.push(lockstep_protocol::CommandKind::CreateDataflow(
        identity.clone(),
    ));
    history.push(lockstep_protocol::CommandKind::Schedule { dataflow_id: 1 });
    history.push(lockstep_protocol::CommandKind::WriteInput(write));
    let fresh = start_replica_with_env(25, 2, 1, &env).await;
    let c = controller_framed(&fresh, 1, history, Strategy::Log, LIMIT);
    if let Err(e) = c.wait_for_frontier(1001, 0).await {
        panic!("{e}\n{}", logs(&fresh, 10));
    }
    let got = c.peek(1001, 0).await.unwrap();
    assert_eq!(as_multiset(got), expected);
    for s in c.statuses().await.unwrap() {
        assert_eq!(s.installed, vec![1], "worker {}", s.worker_index);
    }
    c.shutdown();
}

/// In a log session, the StatusRequests (heartbeats, status calls) every
/// worker applied leave the command log: its size follows the commands that
/// change state, not the time the session ran. Before, every heartbeat stayed
/// until the next session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_log_session_does_not_keep_its_status_requests() {
    use lockstep_command_log::CommandLog;
    let r = start_replica(26, 2, 1).await;
    let c = controller_with(&r, 1, CommandHistory::new(), Strategy::Log);
    let identity = dataflow(1, &[1], lockstep_plan::text::parse_plan("get(1)").unwrap());
    c.create_dataflow(identity).unwrap();
    c.write_input(1, vec![u(&[5], 0, 1)], 1).unwrap();
    c.wait_for_frontier(1001, 0).await.unwrap();
    for _ in 0..60 {
        c.statuses().await.unwrap();
    }
    let mut log =
        lockstep_command_log::AnyLog::open(r.addrs.command_log.as_ref().unwrap()).unwrap();
    let count = |log: &mut lockstep_command_log::AnyLog| {
        let entries = log.read_from(1, 100_000).unwrap();
        let status = entries
            .iter()
            .filter(|e| {
                matches!(
                    e.command.kind,
                    lockstep_protocol::CommandKind::StatusRequest { .. }
                )
            })
            .count();
        let creates = entries
            .iter()
            .filter(|e| {
                matches!(
                    e.command.kind,
                    lockstep_protocol::CommandKind::CreateDataflow(_)
                )
            })
            .count();
        (status, creates)
    };
    // At least 60 were appended; wait (bounded) until the applied ones went.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let (status, creates) = count(&mut log);
        assert_eq!(creates, 1, "the create left the log");
        if status < 32 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{status} status requests still in the command log after 10 s"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    // The workers read on past the holes.
    c.write_input(1, vec![u(&[6], 1, 1)], 2).unwrap();
    c.wait_for_frontier(1001, 1).await.unwrap();
    assert_eq!(
        as_multiset(c.peek(1001, 1).await.unwrap()),
        as_multiset(vec![(vec![5], 1), (vec![6], 1)])
    );
    c.shutdown();
}

/// A subscription whose receiver is dropped is canceled and leaves the
/// controller's history (a reconnect does not replay it); a subscription to
/// a collection that is dropped ends with `Dropped`, not with silence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscriptions_end_when_canceled_or_dropped() {
    use lockstep_protocol::CommandKind;
    let r = start_replica(27, 2, 1).await;
    let c = controller(&r, 1, CommandHistory::new());
    let a = dataflow(1, &[1], lockstep_plan::text::parse_plan("get(1)").unwrap());
    let b = dataflow(2, &[1], lockstep_plan::text::parse_plan("get(1)").unwrap());
    c.create_dataflow(a.clone()).unwrap();
    c.create_dataflow(b.clone()).unwrap();
    c.write_input(1, vec![u(&[5], 0, 1)], 1).unwrap();
    c.wait_for_frontier(1002, 0).await.unwrap();
    let subscribed = |mut h: CommandHistory| {
        h.reduce();
        h.commands()
            .iter()
            .filter(|k| matches!(k, CommandKind::Subscribe(_)))
            .count()
    };
    let within = std::time::Duration::from_secs(20);

    // Canceled by dropping the receiver after its first batch.
    let mut rx = c.subscribe(1001, 0).unwrap();
    let first = tokio::time::timeout(within, rx.recv())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(first.updates.len(), 1);
    assert_eq!(subscribed(c.history().await.unwrap()), 1);
    drop(rx);
    let deadline = std::time::Instant::now() + within;
    while subscribed(c.history().await.unwrap()) > 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the canceled subscription is still in the history after 20 s"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }

    // Ended by dropping its dataflow.
    let mut rx = c.subscribe(1002, 0).unwrap();
    tokio::time::timeout(within, rx.recv())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    c.drop_dataflow(&b).unwrap();
    let end = loop {
        match tokio::time::timeout(within, rx.recv()).await.unwrap() {
            Some(Ok(_)) => continue,
            end => break end,
        }
    };
    assert_eq!(
        end,
        Some(Err(lockstep_controller::ControllerError::Dropped {
            collection: 1002
        }))
    );
    assert_eq!(tokio::time::timeout(within, rx.recv()).await.unwrap(), None);
    // The other dataflow still answers.
    assert_eq!(c.peek(1001, 0).await.unwrap(), vec![(vec![5], 1)]);
    c.shutdown();
}

/// A replica that ends every session (here: its frame limit is below the
/// size of a write in the controller's history, so it refuses the frame)
/// is reconnected to with a growing wait, not in a tight loop. Before, the
/// controller reconnected at once, thousands of times a minute. (A refused
/// CreateDataflow leaves the history instead: see the next test.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_drops_every_session_is_reconnected_to_with_backoff() {
    let r = start_replica_with_env(28, 1, 1, &[("LOCKSTEP_MAX_FRAME_LEN", "65536")]).await;
    // One write of 4,000 rows of four large values: about 170 KB in one
    // frame under the controller's limit, over the replica's.
    let mut history = CommandHistory::new();
    history.push(lockstep_protocol::CommandKind::WriteInput(
        lockstep_protocol::WriteInput {
            collection_id: 1,
            updates: (0..4_000)
                .map(|i| {
                    u(
                        &[i64::MAX - i, i64::MAX - i, i64::MAX - i, i64::MAX - i],
                        0,
                        1,
                    )
                })
                .collect(),
            upper: 1,
            more: false,
            batch_digest: None,
        },
    ));
    let c = controller(&r, 1, history);
    let mut events = c.events();
    let mut at = Vec::new();
    let waited = tokio::time::timeout(std::time::Duration::from_secs(30), async {
        while at.len() < 7 {
            match events.recv().await {
                Ok(lockstep_controller::Event::Disconnected { .. }) => {
                    at.push(std::time::Instant::now())
                }
                Ok(_) | Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
                Err(e) => panic!("controller events ended: {e}"),
            }
        }
    })
    .await;
    assert!(
        waited.is_ok(),
        "only {} sessions ended within 30 s",
        at.len()
    );
    // The waits before sessions 3 to 7 are 50, 100, 200, 400 and 800 ms.
    let gaps: Vec<_> = at.windows(2).map(|w| w[1] - w[0]).collect();
    assert!(
        gaps[4] >= std::time::Duration::from_millis(400)
            && gaps[5] >= std::time::Duration::from_millis(800),
        "no backoff between failed sessions: {gaps:?}"
    );
    c.shutdown();
}

/// A dataflow a replica refuses as malformed (here: too large for its frame
/// limit) leaves the controller's history, and the owner is told: it is not
/// resent on every reconnect, and the replica's other dataflow answers.
/// Before, it was resent forever and nothing of the replica answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dataflow_a_replica_refuses_as_malformed_leaves_the_history() {
    let r = start_replica_with_env(29, 1, 1, &[("LOCKSTEP_MAX_FRAME_LEN", "65536")]).await;
    // One dataflow of 8,000 exports: about 100 KB, over the replica's limit.
    let mut big = dataflow(2, &[1], lockstep_plan::text::parse_plan("get(1)").unwrap());
    big.exports = (0..8_000)
        .map(|i| lockstep_plan::export(10_000 + i, &lockstep_plan::Plan::Get { collection_id: 1 }))
        .collect();
    let mut small = dataflow(1, &[1], lockstep_plan::text::parse_plan("get(1)").unwrap());
    small.exports[0].collection_id = 1001;
    let mut history = CommandHistory::new();
    history.push(lockstep_protocol::CommandKind::CreateDataflow(small));
    history.push(lockstep_protocol::CommandKind::CreateDataflow(big));
    let c = controller(&r, 1, history);
    // The refusal comes on the first connection, which may be made before
    // a subscription made now: read the events since the start.
    let mut events = c.events_since_start().expect("nobody took them yet");
    let refused = tokio::time::timeout(std::time::Duration::from_secs(30), async {
        loop {
            match events.recv().await {
                Ok(lockstep_controller::Event::DataflowRefused {
                    dataflow, message, ..
                }) => return (dataflow, message),
                Ok(_) | Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
                Err(e) => panic!("controller events ended: {e}"),
            }
        }
    })
    .await
    .expect("the refusal was reported within 30 s");
    assert_eq!(refused.0, 2, "{refused:?}");
    assert!(refused.1.contains("65536"), "{refused:?}");
    let live: Vec<u64> = c
        .history()
        .await
        .unwrap()
        .live_dataflows()
        .iter()
        .map(|d| d.id)
        .collect();
    assert_eq!(live, vec![1], "the refused dataflow left the history");
    c.write_input(1, vec![u(&[5], 0, 1)], 1).unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        match tokio::time::timeout(std::time::Duration::from_secs(5), c.peek(1001, 0)).await {
            Ok(Ok(rows)) if rows == vec![(vec![5], 1)] => break,
            other => assert!(
                std::time::Instant::now() < deadline,
                "the other dataflow does not answer: {other:?}"
            ),
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    c.shutdown();
}

/// A write sent with `barrier` to a replica of several processes is split
/// at the source: each process gets only the rows its workers own, in
/// parts that line up across processes (64 KiB frames here, so the shares
/// take several parts). Every row still arrives, once, and every worker
/// reports the same history digest as the worker of a one-process replica
/// that got the whole writes, since each share carries the whole batch's
/// digest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_split_per_process_arrives_whole_and_keeps_histories_equal() {
    const LIMIT: usize = 64 << 10;
    let limit = LIMIT.to_string();
    let env = [("LOCKSTEP_MAX_FRAME_LEN", limit.as_str())];
    // About 300 KB encoded: several parts per process.
    let rows: Vec<_> = (0..10_000i64)
        .map(|i| u(&[i, i * 1_000_000_007, -i], 0, 1))
        .collect();
    let mut expected: Vec<_> = rows.iter().map(|u| (u.row.clone(), 1)).collect();
    expected.retain(|(row, _)| row[0] != 1);
    let mut digests = Vec::new();
    for (replica_id, processes) in [(31, 3), (32, 1)] {
        let r = start_replica_with_env(replica_id, processes, 1, &env).await;
        let c = controller_framed(&r, 1, CommandHistory::new(), Strategy::Barrier, LIMIT);
        c.create_dataflow(dataflow(
            1,
            &[1],
            lockstep_plan::text::parse_plan("get(1)").unwrap(),
        ))
        .unwrap();
        c.write_input(1, rows.clone(), 1).unwrap();
        c.write_input(1, vec![u(&[1, 1_000_000_007, -1], 1, -1)], 2)
            .unwrap();
        if let Err(e) = c.wait_for_frontier(1001, 1).await {
            panic!("{e}\n{}", logs(&r, 10));
        }
        assert_eq!(
            as_multiset(c.peek(1001, 1).await.unwrap()),
            as_multiset(expected.clone()),
            "{processes} process(es)"
        );
        let statuses = c.statuses().await.unwrap();
        assert_eq!(statuses.len(), processes);
        digests.push(statuses.iter().map(|s| s.history_hash).collect::<Vec<_>>());
        c.shutdown();
    }
    let whole = digests[1][0];
    assert!(whole.is_some());
    assert_eq!(
        digests[0],
        vec![whole; 3],
        "the split replica's workers report other histories than a whole write's"
    );
}
