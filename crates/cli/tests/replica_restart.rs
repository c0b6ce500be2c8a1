//! The environment restarts a replica that cannot prove it is working: a
//! replica process is stopped with SIGSTOP (alive, so no supervisor restarts
//! it, but silent), the controller reports it silent, and the environment
//! restarts the whole replica through the orchestrator, after which a peek of
//! an existing dataflow answers correctly again. Also: every replica gets its
//! command log, and an environment restarted on the same state directory
//! still adopts the replica's processes.
//!
//! This runs real `lockstep-replica` processes: the binary next to the
//! `lockstep` binary under test (which `cargo test --workspace`, and so
//! `cargo xtask test`, builds), or `$LOCKSTEP_REPLICA_BIN`.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use lockstep_chaos::environment::Sandbox;
use lockstep_environment::compute::ComputeError;
use lockstep_plan::reference::evaluate;
use lockstep_protocol::Update;
use std::path::Path;

/// How long the environment may take from the SIGSTOP to a correct answer:
/// the controller's 2 s heartbeat timeout, the restart, the reconnection and
/// the rehydration, with room for a slow shared machine.
const RECOVERY_BOUND: Duration = Duration::from_secs(60);

mod common;
use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_replica_process_is_restarted_and_the_replica_answers_again() {
    let sandbox = Sandbox::new().unwrap();
    let env = start(sandbox.path()).await;
    let created = env.create_replica("r1", shape(2, 2)).await.unwrap();
    let id = created.replica.id;

    // The replica has its command log: the processes were given the path
    // (and opened the file at start), and it lies in the state directory.
    let log = sqlite_log(&env, id);
    assert_eq!(
        log,
        std::path::absolute(sandbox.path())
            .unwrap()
            .join(format!("command-logs/replica-{id}.sqlite"))
    );
    let before = service(&env).await;
    for p in &before.processes {
        assert_eq!(
            environ(p.pid.unwrap(), "LOCKSTEP_COMMAND_LOG").as_deref(),
            Some(log.to_str().unwrap()),
            "process {}",
            p.index
        );
    }

    // An existing dataflow with data, answering correctly.
    let plan = create_reduce(&env).await;
    let updates = vec![
        u(&[1, 10], 0, 1),
        u(&[1, 20], 0, 1),
        u(&[2, 5], 1, 1),
        u(&[3, 7], 1, 2),
        u(&[1, 10], 1, -1),
    ];
    env.write_input("r1", 1, updates.clone(), 2).await.unwrap();
    let expected = evaluate(&plan, &BTreeMap::from([(1, updates)]), 1);
    assert!(!expected.is_empty());
    peek_until(&env, 101, 1, &expected, Duration::from_secs(30))
        .await
        .expect("the replica answers before the fault");
    assert!(log.is_file(), "the command log {} exists", log.display());

    // Stop process 1: alive, so the supervisors leave it alone, but silent.
    let stopped = before.processes[1].pid.unwrap();
    let status = std::process::Command::new("kill")
        .args(["-STOP", &stopped.to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    // kill(2) returns before the process is stopped: wait (bounded) for it.
    let stop_seen = Instant::now();
    while proc_state(stopped) != Some('T') && stop_seen.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(proc_state(stopped), Some('T'));
    let fault = Instant::now();

    // The environment notices and restarts the replica, and the peek answers
    // correctly again.
    if let Err(last) = peek_until(&env, 101, 1, &expected, RECOVERY_BOUND).await {
        panic!(
            "no correct answer within {RECOVERY_BOUND:?} of the SIGSTOP; last: {last}; service: {:?}",
            service(&env).await
        );
    }
    let recovered = fault.elapsed();
    let after = service(&env).await;
    assert!(after.processes.iter().all(|p| p.running), "{after:?}");
    for (old, new) in before.processes.iter().zip(&after.processes) {
        assert_ne!(old.pid, new.pid, "process {} was restarted", old.index);
        assert_eq!(old.addresses, new.addresses, "on the same ports");
    }
    assert_ne!(
        proc_state(stopped),
        Some('T'),
        "the stopped process is gone"
    );
    eprintln!("recovered {recovered:.1?} after the SIGSTOP");

    // Writes after the restart reach the new processes too.
    let more = vec![u(&[2, 5], 2, -1), u(&[4, 1], 2, 1)];
    env.write_input("r1", 1, more.clone(), 3).await.unwrap();
    let all: Vec<Update> = [
        vec![
            u(&[1, 10], 0, 1),
            u(&[1, 20], 0, 1),
            u(&[2, 5], 1, 1),
            u(&[3, 7], 1, 2),
            u(&[1, 10], 1, -1),
        ],
        more,
    ]
    .concat();
    let expected2 = evaluate(&plan, &BTreeMap::from([(1, all)]), 2);
    peek_until(&env, 101, 2, &expected2, Duration::from_secs(30))
        .await
        .expect("the restarted replica takes new writes");

    // An environment restarted on the same state directory ensures the same
    // spec (command log included), so it adopts the processes: same PIDs.
    drop(env);
    let env = start(sandbox.path()).await;
    let adopted = service(&env).await;
    assert_eq!(pids(&adopted), pids(&after), "adopted, not restarted");
    assert_eq!(sqlite_log(&env, id), log);
    peek_until(&env, 101, 2, &expected2, Duration::from_secs(30))
        .await
        .expect("the new environment's controller answers");
}

/// The shipped `log` distribution policy drives a replica through its
/// command log under the environment: answers are right, the commands are in
/// the log, and a restarted environment (a new controller epoch) reconnects,
/// answers again, and truncates the log before its own marker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_log_policy_sends_commands_through_the_command_log() {
    let policy = built_policy("log");
    let sandbox = Sandbox::new().unwrap();
    let env = start_with(sandbox.path(), Some(policy.clone())).await;
    let created = env.create_replica("r1", shape(2, 2)).await.unwrap();
    let log_path = sqlite_log(&env, created.replica.id);
    let plan = create_reduce(&env).await;
    let updates = vec![u(&[1, 10], 0, 1), u(&[1, 5], 0, 1), u(&[2, 7], 1, 1)];
    env.write_input("r1", 1, updates.clone(), 2).await.unwrap();
    let expected = evaluate(&plan, &BTreeMap::from([(1, updates)]), 1);
    peek_until(&env, 101, 1, &expected, Duration::from_secs(30))
        .await
        .expect("the replica answers under the log policy");

    use lockstep_command_log::CommandLog;
    let mut log = lockstep_command_log::SqliteLog::open_reader(&log_path).unwrap();
    let entries = log.read_from(1, 100_000).unwrap();
    assert!(
        entries
            .iter()
            .all(|e| e.command.strategy == lockstep_protocol::Strategy::Log),
        "every logged command was sent with the log strategy"
    );
    let creates = entries
        .iter()
        .filter(|e| {
            matches!(
                e.command.kind,
                lockstep_protocol::CommandKind::CreateDataflow(_)
            )
        })
        .count();
    assert_eq!(creates, 1, "the dataflow went through the log");

    // A restarted environment: a new epoch, a new marker, the same answers,
    // and everything before the new marker truncated.
    drop(env);
    let env = start_with(sandbox.path(), Some(policy)).await;
    peek_until(&env, 101, 1, &expected, Duration::from_secs(30))
        .await
        .expect("the replica answers after the environment restarted");
    let first = log.read_from(1, 1).unwrap().remove(0);
    match first.command.kind {
        lockstep_protocol::CommandKind::Hello(h) => {
            assert!(
                h.epoch >= 2,
                "the log starts at the new epoch's marker: {h:?}"
            )
        }
        other => panic!("the log starts with {other:?}, not the new marker"),
    }
    assert!(first.offset > 1, "nothing was truncated");
}

/// A dropped replica leaves no files behind: its command log and its
/// processes' logs go with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_replica_leaves_no_files() {
    let sandbox = Sandbox::new().unwrap();
    let env = start(sandbox.path()).await;
    let created = env.create_replica("r1", shape(2, 1)).await.unwrap();
    let log = sqlite_log(&env, created.replica.id);
    let process_logs: Vec<_> = (0..2)
        .map(|i| {
            sandbox.path().join(format!(
                "orchestrator/logs/replica-{}-{i}.log",
                created.replica.id
            ))
        })
        .collect();
    // The processes opened the command log and their logs at start.
    let deadline = Instant::now() + Duration::from_secs(20);
    while !(log.is_file() && process_logs.iter().all(|p| p.is_file())) {
        assert!(
            Instant::now() < deadline,
            "the replica's files never appeared"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    env.drop_replica("r1").await.unwrap();
    assert!(!log.exists(), "{} is left", log.display());
    for p in &process_logs {
        assert!(!p.exists(), "{} is left", p.display());
    }
}

/// A replica whose ensure failed after its catalog write (here: the replica
/// program is missing for a moment) is refused as UNAVAILABLE, stays
/// wanted, and is ensured and driven by the background retry once the
/// program is back; it used to get no controller until the environment
/// restarted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_whose_ensure_failed_is_ensured_in_the_background() {
    let sandbox = Sandbox::new().unwrap();
    let program = sandbox.path().join("replica-program");
    std::os::unix::fs::symlink(replica_binary(), &program).unwrap();
    let mut cfg = config(sandbox.path(), None);
    cfg.service.program = program.clone();
    let env = std::sync::Arc::new(start_config(cfg).await);
    std::fs::remove_file(&program).unwrap();
    let created = env.create_replica("r1", shape(2, 1)).await;
    assert!(
        matches!(
            created,
            Err(lockstep_environment::EnvError::Orchestrator(_))
        ),
        "{created:?}"
    );
    // Nothing serves it: a dataflow is refused before it is written.
    let refused = try_create_identity(&env, 101).await;
    assert!(
        matches!(
            refused,
            Err(lockstep_environment::compute::ComputeError::Unavailable(_))
        ),
        "{refused:?}"
    );
    assert!(
        env.list_dataflows().unwrap().is_empty(),
        "nothing was written"
    );

    std::os::unix::fs::symlink(replica_binary(), &program).unwrap();
    let retry = env.spawn_replica_retry(Duration::from_millis(100));
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match try_create_identity(&env, 101).await {
            Ok(_) => break,
            Err(e) => assert!(
                Instant::now() < deadline,
                "the replica was not ensured in the background within 30 s: {e}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    env.write_input("r1", 1, vec![u(&[4], 0, 1)], 1)
        .await
        .unwrap();
    let expected = lockstep_plan::reference::Multiset::from([(vec![4], 1)]);
    peek_until(&env, 101, 0, &expected, Duration::from_secs(30))
        .await
        .expect("the replica ensured in the background answers");
    retry.abort();
}

/// A distribution policy set at run time passes its conformance check, is in
/// force from the replica's next session (which starts at once) without a
/// dataflow rebuilt, and stays in force across an environment restart; a
/// policy that fails its check, or is no policy, is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_set_at_run_time_takes_over_at_the_next_session_without_rebuilding() {
    use lockstep_command_log::CommandLog;
    let log_wasm = lockstep_policy_host::shipped_policy("log");
    let nonsense = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../target/lockstep/test-policies/nonsense.wasm");
    require_built(&[&log_wasm, &nonsense]);
    let sandbox = Sandbox::new().unwrap();
    let env = start(sandbox.path()).await;
    let created = env.create_replica("r1", shape(2, 1)).await.unwrap();
    let log_path = sqlite_log(&env, created.replica.id);
    let plan = create_reduce(&env).await;
    let updates = vec![u(&[1, 10], 0, 1), u(&[2, 7], 0, 1)];
    env.write_input("r1", 1, updates.clone(), 1).await.unwrap();
    let expected = evaluate(&plan, &BTreeMap::from([(1, updates.clone())]), 0);
    peek_until(&env, 101, 0, &expected, Duration::from_secs(30))
        .await
        .expect("the replica answers under the native barrier rule");
    let c = env.replica_controller("r1").unwrap();
    let before: Vec<_> = c
        .statuses()
        .await
        .unwrap()
        .into_iter()
        .map(|s| s.creation_log)
        .collect();
    let logged = |path: &Path| {
        lockstep_command_log::SqliteLog::open_reader(path)
            .and_then(|mut l| l.read_from(1, 100_000))
            .unwrap_or_default()
    };
    // Hellos of log sessions in the log.
    let logged_hellos = |path: &Path| {
        logged(path)
            .iter()
            .filter_map(|e| match &e.command.kind {
                lockstep_protocol::CommandKind::Hello(h)
                    if e.command.strategy == lockstep_protocol::Strategy::Log =>
                {
                    Some(h.epoch)
                }
                _ => None,
            })
            .collect::<Vec<_>>()
    };
    let barrier_entries = logged(&log_path);
    assert!(
        !barrier_entries.is_empty()
            && barrier_entries.iter().all(|e| matches!(
                e.command.kind,
                lockstep_protocol::CommandKind::Hello(_)
            ) && e.command.strategy
                == lockstep_protocol::Strategy::Barrier),
        "barrier sessions put only their markers in the log: {barrier_entries:?}"
    );

    // Refused: no policy at all, and a policy that fails its conformance check.
    let garbage = env.set_policy("garbage", b"not wasm".to_vec()).await;
    assert!(
        matches!(&garbage, Err(ComputeError::Invalid(m)) if m.contains("not a lockstep policy")),
        "{garbage:?}"
    );
    let failing = env
        .set_policy("nonsense", std::fs::read(&nonsense).unwrap())
        .await;
    assert!(
        matches!(&failing, Err(ComputeError::Invalid(m)) if m.contains("conformance")),
        "{failing:?}"
    );

    let set = env
        .set_policy("log", std::fs::read(&log_wasm).unwrap())
        .await
        .unwrap();
    assert_eq!(
        (set.kind.as_str(), set.name.as_str()),
        ("distribution", "log")
    );
    // The next session goes through the command log.
    let deadline = Instant::now() + Duration::from_secs(30);
    while logged_hellos(&log_path).is_empty() {
        assert!(
            Instant::now() < deadline,
            "no log session within 30 s of the policy"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    env.write_input("r1", 1, vec![u(&[3, 1], 1, 1)], 2)
        .await
        .unwrap();
    let mut all = updates;
    all.push(u(&[3, 1], 1, 1));
    let expected = evaluate(&plan, &BTreeMap::from([(1, all)]), 1);
    peek_until(&env, 101, 1, &expected, Duration::from_secs(30))
        .await
        .expect("the replica answers under the log policy");
    let after: Vec<_> = c
        .statuses()
        .await
        .unwrap()
        .into_iter()
        .map(|s| s.creation_log)
        .collect();
    assert_eq!(
        after, before,
        "a dataflow was rebuilt when the strategy changed"
    );

    // Kept across a restart, from the catalog.
    drop(c);
    drop(env);
    let env = start(sandbox.path()).await;
    let in_force = env.policies_in_force();
    assert!(
        in_force
            .iter()
            .any(|p| p.kind == "distribution" && p.name == "log" && p.hash == set.hash),
        "{in_force:?}"
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    while !logged_hellos(&log_path).iter().any(|&e| e >= 2) {
        assert!(
            Instant::now() < deadline,
            "the restarted environment did not use the log policy"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    peek_until(&env, 101, 1, &expected, Duration::from_secs(30))
        .await
        .expect("the restarted environment answers under the log policy");
}

/// Replica `id`'s command log, a SQLite file in these tests.
fn sqlite_log(env: &lockstep_environment::Environment, id: u64) -> std::path::PathBuf {
    let log = env.command_log(id).expect("replicas have command logs");
    log.sqlite_path()
        .expect("the embedded store keeps command logs in SQLite files")
        .to_path_buf()
}

/// The Hello epochs of the log sessions in the command log at `path`.
fn log_session_epochs(path: &Path) -> Vec<u64> {
    use lockstep_command_log::CommandLog;
    lockstep_command_log::SqliteLog::open_reader(path)
        .and_then(|mut l| l.read_from(1, 100_000))
        .unwrap_or_default()
        .iter()
        .filter_map(|e| match &e.command.kind {
            lockstep_protocol::CommandKind::Hello(h)
                if e.command.strategy == lockstep_protocol::Strategy::Log =>
            {
                Some(h.epoch)
            }
            _ => None,
        })
        .collect()
}

/// `lockstep policy set --replica NAME`: a distribution policy in force on
/// one replica alone, kept in the catalog across a restart, listed per
/// replica, and gone with its replica.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_set_on_one_replica_takes_over_that_replica_alone_and_survives_a_restart() {
    let log_wasm = lockstep_policy_host::shipped_policy("log");
    let orphans_wasm = lockstep_policy_host::shipped_policy("epoch");
    require_built(&[&log_wasm, &orphans_wasm]);
    let sandbox = Sandbox::new().unwrap();
    let env = start(sandbox.path()).await;
    let r1 = env.create_replica("r1", shape(1, 1)).await.unwrap().replica;
    let r2 = env.create_replica("r2", shape(1, 1)).await.unwrap().replica;
    let (log1, log2) = (sqlite_log(&env, r1.id), sqlite_log(&env, r2.id));

    // Refused: an unknown replica, and an orphan policy on one replica.
    let unknown = env
        .set_policy_on(Some("nope"), "log", std::fs::read(&log_wasm).unwrap())
        .await;
    assert!(
        matches!(unknown, Err(ComputeError::NoSuchReplica(_))),
        "{unknown:?}"
    );
    let orphans = env
        .set_policy_on(Some("r1"), "epoch", std::fs::read(&orphans_wasm).unwrap())
        .await;
    assert!(
        matches!(&orphans, Err(ComputeError::Invalid(m)) if m.contains("environment-wide")),
        "{orphans:?}"
    );

    let set = env
        .set_policy_on(Some("r1"), "log", std::fs::read(&log_wasm).unwrap())
        .await
        .unwrap();
    assert_eq!(set.replica.as_deref(), Some("r1"));
    assert!(env.policies_in_force().contains(&set));
    let deadline = Instant::now() + Duration::from_secs(30);
    while log_session_epochs(&log1).is_empty() {
        assert!(
            Instant::now() < deadline,
            "r1 ran no log session within 30 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // r2 keeps the environment-wide rule (barrier): a new session of it is
    // not a log session.
    let c2 = env.replica_controller("r2").unwrap();
    let mut events = c2.events();
    c2.reconnect().unwrap();
    tokio::time::timeout(Duration::from_secs(30), async {
        while !matches!(
            events.recv().await,
            Ok(lockstep_controller::Event::Connected { .. })
        ) {}
    })
    .await
    .expect("r2 reconnects within 30 s");
    assert!(
        log_session_epochs(&log2).is_empty(),
        "r2 ran a log session: the policy was set on r1 alone"
    );

    // Kept across a restart, on r1 alone.
    drop((c2, events));
    let epoch_before = env.epoch();
    drop(env);
    let env = start(sandbox.path()).await;
    let mine: Vec<_> = env
        .policies_in_force()
        .into_iter()
        .filter(|p| p.replica.is_some())
        .collect();
    assert_eq!(
        mine,
        vec![set.clone()],
        "listed per replica after a restart"
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    while !log_session_epochs(&log1).iter().any(|&e| e > epoch_before) {
        assert!(
            Instant::now() < deadline,
            "the restarted environment did not use r1's policy"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(log_session_epochs(&log2).is_empty());

    // Gone with its replica.
    env.drop_replica("r1").await.unwrap();
    assert!(env.policies_in_force().iter().all(|p| p.replica.is_none()));
}

/// Issue 28's story: a 4-process × 1-worker replica under the `log` policy,
/// the environment dead while a replica process is killed, another stopped
/// and the others exit (timely panics on the closed sockets), then the
/// environment started again while they are still exiting. Before shared-fate restarts, every
/// process was restarted on its own with its own backoff and joined peers of
/// another generation: the replica never came back. Now any exit restarts
/// the whole replica as one new generation, and a peek answers correctly
/// within the stated recovery bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_whose_processes_exit_while_the_environment_restarts_comes_back_as_one_generation(
) {
    let sandbox = Sandbox::new().unwrap();
    let log_policy = built_policy("log");
    let env = start_with(sandbox.path(), Some(log_policy.clone())).await;
    env.create_replica("r1", shape(4, 1)).await.unwrap();
    let plan = create_reduce(&env).await;
    let updates = vec![u(&[1, 10], 0, 1), u(&[2, 20], 0, 1), u(&[1, 5], 1, 1)];
    env.write_input("r1", 1, updates.clone(), 2).await.unwrap();
    let expected = evaluate(&plan, &BTreeMap::from([(1, updates.clone())]), 1);
    peek_until(&env, 101, 1, &expected, Duration::from_secs(30))
        .await
        .expect("the replica answers before the fault");
    let before = service(&env).await;
    let generation_before = environ(before.processes[0].pid.unwrap(), "LOCKSTEP_GENERATION");

    // The environment dies (its supervisors with it); then process 2 is
    // stopped (alive, its mesh sockets open) and process 1 is killed: the
    // others exit on the closed mesh sockets, one after another.
    drop(env);
    let signal = |sig: &str, pid: u32| {
        let status = std::process::Command::new("kill")
            .args([sig, &pid.to_string()])
            .status()
            .unwrap();
        assert!(status.success());
    };
    let stopped = before.processes[2].pid.unwrap();
    signal("-STOP", stopped);
    signal("-KILL", before.processes[1].pid.unwrap());
    let fault = Instant::now();

    // Started again at once, while the other processes are still exiting.
    let env = start_with(sandbox.path(), Some(log_policy)).await;
    if let Err(last) = peek_until(&env, 101, 1, &expected, RECOVERY_BOUND).await {
        panic!(
            "no correct answer within {RECOVERY_BOUND:?} of the fault; last: {last}; service: {:?}",
            service(&env).await
        );
    }
    eprintln!("recovered {:.1?} after the fault", fault.elapsed());

    // One generation: every process was replaced, and all carry the same
    // generation, newer than before.
    let after = service(&env).await;
    assert!(after.processes.iter().all(|p| p.running), "{after:?}");
    let generations: Vec<Option<String>> = after
        .processes
        .iter()
        .map(|p| environ(p.pid.unwrap(), "LOCKSTEP_GENERATION"))
        .collect();
    assert!(
        generations
            .iter()
            .all(|g| g.is_some() && *g == generations[0]),
        "one generation: {generations:?}"
    );
    assert_ne!(generations[0], generation_before, "a new generation");
    assert_ne!(
        proc_state(stopped),
        Some('T'),
        "the stopped process is gone"
    );
    for (old, new) in before.processes.iter().zip(&after.processes) {
        assert_ne!(old.pid, new.pid, "process {} was restarted", old.index);
    }

    // It stays up: a write after recovery is answered too.
    let more = vec![u(&[2, 20], 2, -1), u(&[3, 1], 2, 1)];
    env.write_input("r1", 1, more.clone(), 3).await.unwrap();
    let expected2 = evaluate(&plan, &BTreeMap::from([(1, [updates, more].concat())]), 2);
    peek_until(&env, 101, 2, &expected2, Duration::from_secs(30))
        .await
        .expect("the recovered replica takes new writes");
}
