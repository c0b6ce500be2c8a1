//! The environment on PostgreSQL (`--store postgres://…`), against a real,
//! throw-away server (`lockstep-pgtest`): the catalog and the replicas'
//! command logs live in the database, the `log` strategy runs through it,
//! a restarted environment (a new epoch) answers again and fences the old
//! one out, and a dropped replica's log leaves the database.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::*;
use lockstep_command_log::{CommandLog, LogLocation};
use lockstep_environment::chaos::Sandbox;
use lockstep_pgtest::PgServer;
use lockstep_protocol::reference::evaluate;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_environment_runs_on_postgresql() {
    let mut pg =
        PgServer::start().expect("a PostgreSQL server (binaries on PATH or LOCKSTEP_PG_BIN)");
    let url = pg.url();
    let policy = lockstep_policy_host::shipped_policy("log");
    assert!(
        policy.is_file(),
        "{} is missing: run `cargo xtask build-policies` first (`cargo xtask test` does)",
        policy.display()
    );
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
