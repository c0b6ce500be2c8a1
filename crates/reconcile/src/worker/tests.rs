use super::*;
use crate::strategy::barrier;
use crate::Digest;

/// A command as the tests write it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Cmd {
    seqno: u64,
    strategy: Strategy,
    class: TestClass,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum TestClass {
    Hello(Session),
    Complete,
    Create(u64, u8),
    Other,
}

impl SessionCommand for Cmd {
    fn seqno(&self) -> u64 {
        self.seqno
    }
    fn strategy(&self) -> Strategy {
        self.strategy
    }
    fn class(&self) -> CommandClass {
        match self.class {
            TestClass::Hello(session) => CommandClass::Hello { session },
            TestClass::Complete => CommandClass::InitializationComplete,
            TestClass::Create(id, h) => CommandClass::Create { key: key(id, h) },
            TestClass::Other => CommandClass::Other,
        }
    }
}

fn key(id: u64, h: u8) -> DataflowKey {
    DataflowKey {
        id,
        hash: Digest([h; 32]),
    }
}

fn cmd(strategy: Strategy, seqno: u64, class: TestClass) -> Cmd {
    Cmd {
        seqno,
        strategy,
        class,
    }
}

/// A worker's dataflows, as the shell keeps them.
#[derive(Default)]
struct Runs(Vec<DataflowKey>);

impl WorkerView<Cmd> for Runs {
    fn is_installed(&self, id: u64) -> bool {
        self.0.iter().any(|k| k.id == id)
    }
    fn installed(&self) -> Vec<DataflowKey> {
        self.0.clone()
    }
    fn buildable(&self, _: &Cmd) -> bool {
        true
    }
    fn creation_digest(&self) -> Digest {
        Digest([1; 32])
    }
}

/// Worker 1's round (session, seqno, hash) on the mesh, with its report for
/// a reconciliation round.
fn peer_round(
    session: Session,
    seqno: u64,
    hash: Digest,
    report: Option<Report>,
) -> MeshAnnouncement {
    MeshAnnouncement::Round {
        session,
        announcement: Announcement {
            worker: 1,
            seqno,
            hash,
        },
        report,
    }
}

fn report(installed: Vec<DataflowKey>) -> Option<Report> {
    Some(Report {
        installed,
        created: Digest([1; 32]),
    })
}

/// Runs the machine until it waits, performing builds and drops on `runs`.
fn run(m: &mut WorkerSession<Cmd>, runs: &mut Runs, now_ms: u64) -> Vec<Action<Cmd>> {
    let mut out = Vec::new();
    while let Some(a) = m.next(runs, now_ms) {
        match &a {
            Action::Apply(c) => {
                if let TestClass::Create(id, h) = c.class {
                    if !runs.is_installed(id) {
                        runs.0.push(key(id, h));
                    }
                }
            }
            Action::Drop { id, .. } => runs.0.retain(|k| k.id != *id),
            _ => {}
        }
        out.push(a);
    }
    out
}

fn session_start(
    m: &mut WorkerSession<Cmd>,
    strategy: Strategy,
    session: Session,
    target: &[(u64, u8)],
) {
    m.push(cmd(strategy, 0, TestClass::Hello(session)));
    for (i, (id, h)) in target.iter().enumerate() {
        m.push(cmd(strategy, 1 + i as u64, TestClass::Create(*id, *h)));
    }
    m.push(cmd(strategy, 1 + target.len() as u64, TestClass::Complete));
}

#[test]
fn a_naive_session_start_reconciles_alone() {
    let mut m = WorkerSession::new(0, 2, true);
    let mut runs = Runs(vec![key(1, 1), key(2, 2)]);
    session_start(&mut m, Strategy::Naive, 7, &[(1, 1), (3, 3)]);
    let actions = run(&mut m, &mut runs, 0);
    assert!(matches!(
        &actions[0],
        Action::Announce(MeshAnnouncement::Joined { session: 7 })
    ));
    assert!(matches!(
        &actions[1],
        Action::Hello {
            started: Some(7),
            ..
        }
    ));
    assert!(actions.contains(&Action::Drop {
        id: 2,
        how: Reconciliation::PerWorker
    }));
    assert_eq!(runs.0, vec![key(1, 1), key(3, 3)]);
    assert!(!m.is_reconciling());
}

#[test]
fn a_barrier_create_waits_for_every_worker() {
    let mut m = WorkerSession::new(0, 2, true);
    let mut runs = Runs::default();
    session_start(&mut m, Strategy::Barrier, 5, &[]);
    m.on_mesh(1, MeshAnnouncement::Joined { session: 5 });
    let start = run(&mut m, &mut runs, 0);
    assert!(m.pending().is_some_and(|p| p.reconcile), "{start:?}");
    // The peer's reconciliation report arrives: the round passes.
    let create_round = |seqno, h| peer_round(5, seqno, Digest([h; 32]), None);
    m.on_mesh(
        1,
        peer_round(5, 1, barrier::target_hash(&[]), report(vec![])),
    );
    run(&mut m, &mut runs, 0);
    assert!(m.pending().is_none());
    m.push(cmd(Strategy::Barrier, 2, TestClass::Create(4, 4)));
    m.push(cmd(Strategy::Barrier, 3, TestClass::Other));
    let waiting = run(&mut m, &mut runs, 0);
    assert_eq!(waiting.len(), 1, "only the announcement: {waiting:?}");
    assert!(runs.0.is_empty(), "nothing built before the round passes");
    assert_eq!(m.queued(), 1, "the next command waits behind the round");
    m.on_mesh(1, create_round(2, 4));
    let passed = run(&mut m, &mut runs, 0);
    assert_eq!(runs.0, vec![key(4, 4)]);
    assert_eq!(
        passed.len(),
        2,
        "the create, then the next command: {passed:?}"
    );
}

#[test]
fn different_commands_halt() {
    let mut m = WorkerSession::new(0, 2, true);
    let mut runs = Runs::default();
    m.push(cmd(Strategy::Barrier, 0, TestClass::Hello(5)));
    m.push(cmd(Strategy::Barrier, 1, TestClass::Complete));
    m.on_mesh(1, MeshAnnouncement::Joined { session: 5 });
    m.on_mesh(1, peer_round(5, 1, Digest([9; 32]), report(vec![])));
    let actions = run(&mut m, &mut runs, 0);
    assert!(
        matches!(actions.last(), Some(Action::Halt(_))),
        "{actions:?}"
    );
    assert!(m.halted());
    m.push(cmd(Strategy::Barrier, 2, TestClass::Other));
    assert_eq!(m.next(&runs, 0), None, "nothing after a halt");
}

#[test]
fn a_round_that_waits_too_long_halts() {
    let mut m = WorkerSession::new(0, 2, true);
    let mut runs = Runs::default();
    m.push(cmd(Strategy::Barrier, 0, TestClass::Hello(5)));
    m.push(cmd(Strategy::Barrier, 1, TestClass::Complete));
    run(&mut m, &mut runs, 1_000);
    assert!(m.pending().is_some());
    assert!(run(&mut m, &mut runs, 1_000 + BARRIER_TIMEOUT_MS).is_empty());
    let late = run(&mut m, &mut runs, 1_001 + BARRIER_TIMEOUT_MS);
    assert!(matches!(late.as_slice(), [Action::Halt(_)]), "{late:?}");
}

/// The defect of a worker that reads a peer's reconciliation report and
/// that peer's next create before it decides its own reconciliation.
#[test]
fn a_peer_create_read_with_its_report_keeps_every_dataflow() {
    let installed = vec![key(1, 1), key(2, 2)];
    let mut m = WorkerSession::new(0, 2, true);
    let mut runs = Runs(installed.clone());
    session_start(&mut m, Strategy::Barrier, 9, &[(1, 1), (2, 2)]);
    m.on_mesh(1, MeshAnnouncement::Joined { session: 9 });
    run(&mut m, &mut runs, 0);
    let target_hash = barrier::target_hash(&installed);
    m.on_mesh(1, peer_round(9, 3, target_hash, report(installed.clone())));
    m.on_mesh(1, peer_round(9, 4, Digest([7; 32]), None));
    let actions = run(&mut m, &mut runs, 0);
    assert!(
        !actions.iter().any(|a| matches!(a, Action::Drop { .. })),
        "{actions:?}"
    );
    assert_eq!(runs.0, installed);
}

#[test]
fn log_entries_of_an_older_session_are_skipped() {
    let mut m = WorkerSession::new(0, 1, false);
    let mut runs = Runs::default();
    // A log session 3 starts, then a barrier session 4 cuts it off; the
    // log's remaining entries of session 3 are read afterwards.
    m.push(cmd(Strategy::Log, 0, TestClass::Hello(3)));
    m.push(cmd(Strategy::Log, 1, TestClass::Complete));
    run(&mut m, &mut runs, 0);
    session_start(&mut m, Strategy::Barrier, 4, &[]);
    run(&mut m, &mut runs, 0);
    m.push(cmd(Strategy::Log, 2, TestClass::Create(1, 1)));
    let actions = run(&mut m, &mut runs, 0);
    assert_eq!(actions, vec![Action::Skipped { seqno: 2 }]);
    assert!(runs.0.is_empty());
    // A newer log marker: its entries apply again.
    m.push(cmd(Strategy::Log, 0, TestClass::Hello(6)));
    m.push(cmd(Strategy::Log, 1, TestClass::Complete));
    m.push(cmd(Strategy::Log, 2, TestClass::Create(1, 1)));
    run(&mut m, &mut runs, 0);
    assert_eq!(runs.0, vec![key(1, 1)]);
}

/// A worker that tails a log holds a newer socket session until it read
/// that session's marker, so the cut-off log session's entries read
/// meanwhile apply in the old session, as on every other worker.
#[test]
fn a_newer_session_waits_for_its_log_marker() {
    let mut m = WorkerSession::new(0, 1, false);
    m.set_tails_log();
    let mut runs = Runs::default();
    m.push(cmd(Strategy::Log, 0, TestClass::Hello(3)));
    m.on_log_marker(3);
    m.push(cmd(Strategy::Log, 1, TestClass::Complete));
    run(&mut m, &mut runs, 0);
    // The barrier session 4 arrives on the socket before the log's last
    // entry of session 3 was read.
    session_start(&mut m, Strategy::Barrier, 4, &[(1, 1)]);
    assert!(run(&mut m, &mut runs, 0).is_empty(), "held");
    m.push(cmd(Strategy::Log, 2, TestClass::Create(2, 2)));
    run(&mut m, &mut runs, 0);
    assert_eq!(
        runs.0,
        vec![key(2, 2)],
        "the log entry applied in session 3"
    );
    assert_eq!(m.session(), 3);
    m.on_log_marker(4);
    run(&mut m, &mut runs, 0);
    assert_eq!(m.session(), 4);
    assert_eq!(
        runs.0,
        vec![key(1, 1)],
        "session 4 reconciled to its target"
    );
}

/// A read of the log queues the `log` entries and takes every Hello, of
/// any strategy, as its session's marker: a barrier session's marker is not
/// applied, but it releases that session's held socket commands after the
/// log session's entries read before it.
#[test]
fn a_log_read_queues_log_entries_and_takes_every_marker() {
    let mut m = WorkerSession::new(0, 1, false);
    m.set_tails_log();
    let mut runs = Runs::default();
    let read = m.on_log_entries([
        cmd(Strategy::Log, 0, TestClass::Hello(3)),
        cmd(Strategy::Log, 1, TestClass::Complete),
    ]);
    assert_eq!(read, 2);
    run(&mut m, &mut runs, 0);
    assert_eq!(m.session(), 3);
    // The barrier session 4 arrives on the socket first: held.
    session_start(&mut m, Strategy::Barrier, 4, &[(1, 1)]);
    assert!(m.holding());
    assert!(run(&mut m, &mut runs, 0).is_empty(), "held");
    // One read: the cut-off session's last create, then session 4's marker.
    let read = m.on_log_entries([
        cmd(Strategy::Log, 2, TestClass::Create(2, 2)),
        cmd(Strategy::Barrier, 0, TestClass::Hello(4)),
    ]);
    assert_eq!(read, 2);
    assert!(!m.holding(), "the marker released session 4");
    let actions = run(&mut m, &mut runs, 0);
    let hellos: Vec<_> = actions
        .iter()
        .filter_map(|a| match a {
            Action::Hello { started, .. } => Some(*started),
            _ => None,
        })
        .collect();
    assert_eq!(hellos, vec![Some(4)], "only the socket Hello is answered");
    assert_eq!(m.session(), 4);
    assert_eq!(
        runs.0,
        vec![key(1, 1)],
        "session 4 reconciled to its target"
    );
}

/// Under the planted flaw nothing is held: the newer session starts at once.
#[cfg(feature = "mutants")]
#[test]
fn the_no_hold_mutant_holds_nothing() {
    let mut m = WorkerSession::new(0, 1, false)
        .with_log_hold_mutant(crate::strategy::log::LogHoldMutant::NoHold);
    m.set_tails_log();
    let mut runs = Runs::default();
    m.on_log_entries([cmd(Strategy::Log, 0, TestClass::Hello(3))]);
    run(&mut m, &mut runs, 0);
    session_start(&mut m, Strategy::Barrier, 4, &[]);
    assert!(!m.holding());
    run(&mut m, &mut runs, 0);
    assert_eq!(m.session(), 4);
}

/// A log session read from the log before the last socket copies of the
/// barrier session it cuts off: those copies are skipped, not taken into
/// the log session's start (found by the model, `log-then-barrier`).
#[test]
fn socket_commands_of_an_older_session_are_skipped_on_a_log_tailing_worker() {
    let mut m = WorkerSession::new(0, 1, false);
    m.set_tails_log();
    let mut runs = Runs::default();
    // Barrier session 2: its marker, then its Hello on the socket.
    m.on_log_entries([cmd(Strategy::Barrier, 0, TestClass::Hello(2))]);
    m.push(cmd(Strategy::Barrier, 0, TestClass::Hello(2)));
    run(&mut m, &mut runs, 0);
    assert_eq!(m.session(), 2);
    // Log session 3 starts from the log with an empty target ...
    m.on_log_entries([
        cmd(Strategy::Log, 0, TestClass::Hello(3)),
        cmd(Strategy::Log, 1, TestClass::Complete),
    ]);
    // ... and session 2's target reaches the worker only now.
    m.push(cmd(Strategy::Barrier, 1, TestClass::Create(1, 1)));
    m.push(cmd(Strategy::Barrier, 2, TestClass::Complete));
    let actions = run(&mut m, &mut runs, 0);
    assert_eq!(m.session(), 3);
    assert!(!m.is_reconciling());
    assert!(
        actions.contains(&Action::Skipped { seqno: 1 })
            && actions.contains(&Action::Skipped { seqno: 2 }),
        "{actions:?}"
    );
    assert!(runs.0.is_empty(), "session 2's create is not built");
    // A newer barrier session's commands apply again.
    m.on_log_entries([cmd(Strategy::Barrier, 0, TestClass::Hello(4))]);
    session_start(&mut m, Strategy::Barrier, 4, &[(1, 1)]);
    run(&mut m, &mut runs, 0);
    assert_eq!(m.session(), 4);
    assert_eq!(runs.0, vec![key(1, 1)]);
}

/// A barrier session joined from the socket before the sequencer's stream
/// delivered the last commands of the broadcast session it cuts off: those
/// are skipped, not built in the barrier session on this worker only
/// (found by the model, `barrier-then-broadcast`, I1).
#[test]
fn sequencer_commands_of_an_older_session_are_skipped() {
    let mut m = WorkerSession::new(0, 1, false);
    let mut runs = Runs::default();
    // Broadcast session 2 from the sequencer, with an empty target.
    session_start(&mut m, Strategy::Broadcast, 2, &[]);
    run(&mut m, &mut runs, 0);
    assert_eq!(m.session(), 2);
    // Barrier session 3 from the socket ...
    session_start(&mut m, Strategy::Barrier, 3, &[]);
    run(&mut m, &mut runs, 0);
    assert_eq!(m.session(), 3);
    // ... and session 2's create reaches the worker only now.
    m.push(cmd(Strategy::Broadcast, 7, TestClass::Create(1, 1)));
    let actions = run(&mut m, &mut runs, 0);
    assert_eq!(actions, vec![Action::Skipped { seqno: 7 }]);
    assert!(runs.0.is_empty(), "session 2's create is not built");
    // A newer broadcast session's commands apply again.
    session_start(&mut m, Strategy::Broadcast, 4, &[(1, 1)]);
    run(&mut m, &mut runs, 0);
    assert_eq!(m.session(), 4);
    assert_eq!(runs.0, vec![key(1, 1)]);
}

/// A worker resumed in a session takes that session's socket commands:
/// every source starts in the resumed session, and nothing is stale until
/// a newer session begins.
#[test]
fn socket_commands_of_the_resumed_session_are_not_skipped() {
    let mut m = WorkerSession::new(0, 1, false).resumed(3);
    let mut runs = Runs::default();
    m.push(cmd(Strategy::Barrier, 5, TestClass::Create(1, 1)));
    let actions = run(&mut m, &mut runs, 0);
    assert!(!actions.iter().any(|a| matches!(a, Action::Skipped { .. })));
    assert_eq!(runs.0, vec![key(1, 1)]);
}

#[test]
fn a_missing_log_marker_halts() {
    let mut m = WorkerSession::new(0, 1, false);
    m.set_tails_log();
    let mut runs = Runs::default();
    session_start(&mut m, Strategy::Barrier, 4, &[]);
    assert!(run(&mut m, &mut runs, 5).is_empty());
    let late = run(&mut m, &mut runs, 6 + BARRIER_TIMEOUT_MS);
    assert!(matches!(late.as_slice(), [Action::Halt(_)]), "{late:?}");
}

/// Workers whose creation logs differ cannot be reconciled: they halt.
#[test]
fn different_creation_logs_halt_the_reconciliation() {
    let mut m = WorkerSession::new(0, 2, true);
    let mut runs = Runs::default();
    session_start(&mut m, Strategy::Barrier, 5, &[]);
    m.on_mesh(1, MeshAnnouncement::Joined { session: 5 });
    m.on_mesh(
        1,
        peer_round(
            5,
            1,
            barrier::target_hash(&[]),
            Some(Report {
                installed: vec![],
                created: Digest([2; 32]),
            }),
        ),
    );
    let actions = run(&mut m, &mut runs, 0);
    assert!(
        matches!(actions.last(), Some(Action::Halt(r)) if r.contains("creation logs differ")),
        "{actions:?}"
    );
}
