//! The environment on PostgreSQL (`--store postgres://…`), against a real,
//! throw-away server (`lockstep-pgtest`): the catalog and the replicas'
//! command logs live in the database, the `log` strategy runs through it,
//! a restarted environment (a new epoch) answers again and fences the old
//! one out, and a dropped replica's log leaves the database.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::*;
use lockstep_chaos::environment::Sandbox;
use lockstep_command_log::{CommandLog, LogLocation};
use lockstep_pgtest::PgServer;
use lockstep_plan::reference::evaluate;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_environment_runs_on_postgresql() {
    let mut pg =
        PgServer::start().expect("a PostgreSQL server (binaries on PATH or LOCKSTEP_PG_BIN)");
    let url = pg.url();
    let policy = built_policy("log");
    // Sandboxes stop the replica processes when the test ends.
    let dir = Sandbox::new().unwrap();
    let with_store = || {
        let mut c = config(dir.path(), Some(policy.clone()));
        c.store = Some(url.clone());
        c
    };
    let env = start_config(with_store()).await;
    assert!(
        !dir.path().join("catalog.db").exists(),
        "the catalog is in the database, not the state directory"
    );
    let created = env.create_replica("r1", shape(2, 1)).await.unwrap();
    let location = env.command_log(created.replica.id).unwrap();
    assert!(
        matches!(&location, LogLocation::Postgres { name, .. } if name == "replica-1"),
        "{location}"
    );
    let plan = create_reduce(&env).await;
    let updates = vec![u(&[1, 10], 0, 1), u(&[1, 5], 0, 1), u(&[2, 7], 1, 1)];
    env.write_input("r1", 1, updates.clone(), 2).await.unwrap();
    let expected = evaluate(&plan, &BTreeMap::from([(1, updates)]), 1);
    peek_until(&env, 101, 1, &expected, Duration::from_secs(30))
        .await
        .expect("the replica answers under the log policy on PostgreSQL");
    let mut log = lockstep_command_log::AnyLog::open_reader(&location).unwrap();
    let logged = log.read_from(1, 100_000).unwrap();
    assert!(
        logged.iter().any(|e| matches!(
            e.command.kind,
            lockstep_protocol::CommandKind::CreateDataflow(_)
        )),
        "the dataflow went through the PostgreSQL command log"
    );

    // A second environment on the same database: a newer epoch. It loads
    // the replica and the dataflow from the database, answers, and the old
    // one is fenced out (O3): its next write fails and changes nothing.
    let dir2 = Sandbox::new().unwrap();
    let mut second = config(dir2.path(), Some(policy.clone()));
    second.store = Some(url.clone());
    let newer = start_config(second).await;
    assert!(newer.epoch() > env.epoch());
    peek_until(&newer, 101, 1, &expected, Duration::from_secs(30))
        .await
        .expect("the newer environment answers from the catalog in the database");
    let stale = env.create_replica("r2", shape(1, 1)).await;
    assert!(
        stale.is_err(),
        "a stale environment cannot write: {stale:?}"
    );
    drop(env);
    assert_eq!(
        newer
            .list_replicas()
            .await
            .unwrap()
            .iter()
            .map(|r| r.replica.name.clone())
            .collect::<Vec<_>>(),
        vec!["r1".to_string()],
        "the stale write changed nothing"
    );

    // The database restarts under the environment: acknowledged writes are
    // kept, and the next write succeeds once it is back.
    pg.restart().expect("restart PostgreSQL");
    let more = vec![u(&[3, 1], 2, 1)];
    let mut last_error = None;
    let mut written = false;
    for _ in 0..50 {
        match newer.write_input("r1", 1, more.clone(), 3).await {
            Ok(()) => {
                written = true;
                break;
            }
            Err(e) => last_error = Some(e.to_string()),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        written,
        "no write after the database came back: {last_error:?}"
    );
    let all = vec![
        u(&[1, 10], 0, 1),
        u(&[1, 5], 0, 1),
        u(&[2, 7], 1, 1),
        u(&[3, 1], 2, 1),
    ];
    let expected = evaluate(&plan, &BTreeMap::from([(1, all)]), 2);
    peek_until(&newer, 101, 2, &expected, Duration::from_secs(30))
        .await
        .expect("answers after the database restarted");

    // A dropped replica's command log leaves the database.
    newer.drop_replica("r1").await.unwrap();
    let rows = pg
        .psql(
            "lockstep",
            "SELECT count(*) FROM command_log_entries WHERE log = 'replica-1'",
        )
        .unwrap();
    assert_eq!(rows.trim(), "0", "the dropped replica's log rows are gone");
}

/// A replica process that cannot reach the database holding its command
/// log: it exits with an error naming the database (bounded: the refused
/// connection, or the connect timeout), the orchestrator restarts it, and
/// once the database is back the replica answers again, right.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_process_that_cannot_reach_the_database_exits_clearly_and_comes_back() {
    let mut pg =
        PgServer::start().expect("a PostgreSQL server (binaries on PATH or LOCKSTEP_PG_BIN)");
    let dir = Sandbox::new().unwrap();
    let mut c = config(dir.path(), None);
    c.store = Some(pg.url());
    let env = start_config(c).await;
    env.create_replica("r1", shape(2, 1)).await.unwrap();
    let plan = create_reduce(&env).await;
    let updates = vec![u(&[1, 10], 0, 1), u(&[2, 7], 0, 1)];
    env.write_input("r1", 1, updates.clone(), 1).await.unwrap();
    let expected = evaluate(&plan, &BTreeMap::from([(1, updates)]), 0);
    peek_until(&env, 101, 0, &expected, Duration::from_secs(30))
        .await
        .expect("the replica answers before the outage");

    let before = service(&env).await;
    let restarts_before: u32 = before.processes.iter().map(|p| p.restarts).sum();
    let log_path = dir
        .path()
        .join(lockstep_environment::ORCHESTRATOR_DIR)
        .join("logs")
        .join(format!("{}-1.log", before.name));
    let log_len = std::fs::metadata(&log_path).map(|m| m.len()).unwrap_or(0) as usize;

    // The database goes away, and so does process 1: its restarts must fail
    // to open the command log, each with an error that names the database.
    pg.stop().expect("stop PostgreSQL");
    let pid = before.processes[1].pid.expect("process 1 runs");
    let killed = std::process::Command::new("kill")
        .args(["-9", &pid.to_string()])
        .status()
        .unwrap();
    assert!(killed.success(), "kill -9 {pid}");
    let seen = lockstep_pgtest::wait_until(Duration::from_secs(30), || {
        let text = std::fs::read(&log_path).unwrap_or_default();
        let new = String::from_utf8_lossy(&text[log_len.min(text.len())..]).to_string();
        // What a restarted process prints as it exits (the killed one only
        // warned that its reads are retried).
        new.lines().any(|l| {
            l.contains("lockstep-replica: error: command log")
                && l.contains(&format!("127.0.0.1:{}", pg.port()))
        })
    });
    let text = std::fs::read(&log_path).unwrap_or_default();
    let new = String::from_utf8_lossy(&text[log_len.min(text.len())..]).to_string();
    assert!(
        seen,
        "within 30 s, a restarted process 1 said it cannot reach the database; its log:\n{new}"
    );

    // The database comes back: the orchestrator's next restart succeeds and
    // the replica answers, right, with no write lost.
    pg.start_again().expect("start PostgreSQL again");
    peek_until(&env, 101, 0, &expected, Duration::from_secs(60))
        .await
        .expect("the replica answers once the database is back");
    let after = service(&env).await;
    let restarts_after: u32 = after.processes.iter().map(|p| p.restarts).sum();
    assert!(
        restarts_after > restarts_before,
        "the orchestrator restarted the process ({restarts_before} -> {restarts_after})"
    );
}
