//! Input collections through the environment, on real replica processes:
//! stored writes stay consolidated and survive a restart, overflowing
//! multiplicities are refused before they are stored, and reads of a
//! collection no dataflow exports are NOT_FOUND instead of a wait.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::*;
use lockstep_catalog::Catalog;
use lockstep_chaos::environment::Sandbox;
use lockstep_environment::compute::ComputeError;
use lockstep_plan::reference::evaluate;
use lockstep_plan::text::parse_plan;

/// Thousands of small writes that mostly cancel out: the catalog keeps their
/// consolidation (not one row per write), and an environment restarted on
/// the same state directory rehydrates a fresh replica from it with every
/// acknowledged update.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stored_writes_stay_consolidated_and_survive_a_restart() {
    let sandbox = Sandbox::new().unwrap();
    let env = start(sandbox.path()).await;
    env.create_replica("r1", shape(2, 1)).await.unwrap();
    let plan = first_plan(&create_identity(&env, 101).await);
    const WRITES: u64 = 3_000;
    let mut all = Vec::new();
    for t in 0..WRITES {
        // A row inserted and retracted at the same time, and one that stays.
        let batch = vec![u(&[-1], t, 1), u(&[-1], t, -1), u(&[(t % 50) as i64], t, 1)];
        all.extend(batch.clone());
        env.write_input("r1", 1, batch, t + 1).await.unwrap();
    }
    let expected = evaluate(&plan, &BTreeMap::from([(1, all.clone())]), WRITES - 1);
    peek_until(&env, 101, WRITES - 1, &expected, Duration::from_secs(60))
        .await
        .expect("the replica has every write");
    drop(env);

    let stored = Catalog::open(sandbox.path().join("catalog.db"))
        .unwrap()
        .state()
        .unwrap()
        .input_writes;
    let rows = stored.len() as u64;
    assert!(
        rows < WRITES / 2,
        "{rows} catalog rows for {WRITES} writes: the writes were not consolidated"
    );

    // A new environment adopts the replica; drop its processes so that it
    // must rehydrate a fresh replica from the catalog.
    let env = start(sandbox.path()).await;
    for p in service(&env).await.processes {
        let _ = std::process::Command::new("kill")
            .args(["-9", &p.pid.unwrap().to_string()])
            .status();
    }
    peek_until(&env, 101, WRITES - 1, &expected, Duration::from_secs(90))
        .await
        .expect("the restarted replica was rehydrated with every acknowledged write");
    // Writes go on from the stored upper.
    let refused = env.write_input("r1", 1, vec![u(&[1], 0, 1)], WRITES).await;
    assert!(
        matches!(&refused, Err(ComputeError::OutOfRange(m)) if m.contains("outside")),
        "{refused:?}"
    );
    env.write_input("r1", 1, vec![u(&[7], WRITES, 1)], WRITES + 1)
        .await
        .unwrap();
    all.push(u(&[7], WRITES, 1));
    let expected = evaluate(&plan, &BTreeMap::from([(1, all)]), WRITES);
    peek_until(&env, 101, WRITES, &expected, Duration::from_secs(30))
        .await
        .expect("a write after the restart");
}

/// Two diffs of i64::MAX on one row used to be acknowledged and then crash
/// every replica process on the sum, on every restart. A write that takes a
/// collection's total |diff| past i64::MAX is now refused before it is
/// stored, and the replica keeps answering and taking writes that fit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overflowing_multiplicities_are_refused_before_they_are_stored() {
    let sandbox = Sandbox::new().unwrap();
    let env = start(sandbox.path()).await;
    env.create_replica("r1", shape(2, 1)).await.unwrap();
    create_identity(&env, 101).await;
    const BIG: i64 = i64::MAX - 10;
    env.write_input("r1", 1, vec![u(&[1], 0, BIG)], 1)
        .await
        .unwrap();
    let refused = env
        .write_input("r1", 1, vec![u(&[1], 1, i64::MAX)], 2)
        .await;
    assert!(
        matches!(&refused, Err(ComputeError::Invalid(m)) if m.contains("could overflow")),
        "{refused:?}"
    );
    let before: Vec<Option<u32>> = service(&env)
        .await
        .processes
        .iter()
        .map(|p| p.pid)
        .collect();
    peek_until(
        &env,
        101,
        0,
        &lockstep_plan::reference::Multiset::from([(vec![1], BIG)]),
        Duration::from_secs(30),
    )
    .await
    .expect("the replica answers");
    env.write_input("r1", 1, vec![u(&[2], 1, 1)], 2)
        .await
        .unwrap();
    let after: Vec<Option<u32>> = service(&env)
        .await
        .processes
        .iter()
        .map(|p| p.pid)
        .collect();
    assert_eq!(before, after, "no process was restarted");
}

/// A peek or a subscribe of a collection no live dataflow exports fails at
/// once with NoSuchCollection (NOT_FOUND on the API), where it used to wait
/// out its bound or, for a subscribe, forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_of_a_collection_nobody_exports_are_not_found() {
    let sandbox = Sandbox::new().unwrap();
    let env = start(sandbox.path()).await;
    env.create_replica("r1", shape(2, 1)).await.unwrap();
    let desc = env
        .create_dataflow(
            "r1",
            "identity",
            0,
            vec![1],
            vec![lockstep_plan::export(101, &parse_plan("get(1)").unwrap())],
        )
        .await
        .unwrap();
    let not_found = |r: Result<(), ComputeError>| match r {
        Err(e @ ComputeError::NoSuchCollection { .. }) => {
            assert_eq!(
                lockstep_environment::server::compute_status(e).code(),
                tonic::Code::NotFound
            );
        }
        other => panic!("{other:?}"),
    };
    not_found(env.peek("r1", 555, 0).await.map(|_| ()));
    not_found(env.subscribe("r1", 555, 0).map(|_| ()));
    // The input is not an export either.
    not_found(env.subscribe("r1", 1, 0).map(|_| ()));
    env.drop_dataflow(desc.id).await.unwrap();
    not_found(env.peek("r1", 101, 0).await.map(|_| ()));
    not_found(env.subscribe("r1", 101, 0).map(|_| ()));
}

/// With a compaction lag, rows inserted and later retracted leave the
/// catalog once both are below the since, reads below the since are
/// OUT_OF_RANGE, and a replica rehydrated from the compacted catalog answers
/// every read at or above it like the uncompacted reference.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_compaction_lag_storage_follows_the_live_rows() {
    let sandbox = Sandbox::new().unwrap();
    let mut cfg = config(sandbox.path(), None);
    cfg.compaction_lag = Some(8);
    let env = start_config(cfg).await;
    env.create_replica("r1", shape(2, 1)).await.unwrap();
    let plan = first_plan(&create_identity(&env, 101).await);
    // Batch t inserts 10 rows and retracts those of batch t - 4.
    const BATCHES: u64 = 2_000;
    let mut all = Vec::new();
    for t in 0..BATCHES {
        let mut batch: Vec<_> = (0..10).map(|i| u(&[t as i64, i], t, 1)).collect();
        if t >= 4 {
            batch.extend((0..10).map(|i| u(&[t as i64 - 4, i], t, -1)));
        }
        all.extend(batch.clone());
        env.write_input("r1", 1, batch, t + 1).await.unwrap();
    }
    let last = BATCHES - 1;
    let expected = evaluate(&plan, &BTreeMap::from([(1, all.clone())]), last);
    assert_eq!(expected.len(), 40);
    peek_until(&env, 101, last, &expected, Duration::from_secs(60))
        .await
        .expect("the replica answers at the upper");
    let below = env.peek("r1", 101, 100).await;
    match below {
        Err(e @ ComputeError::OutOfRange(_)) => assert_eq!(
            lockstep_environment::server::compute_status(e).code(),
            tonic::Code::OutOfRange
        ),
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        env.subscribe("r1", 101, 0),
        Err(ComputeError::OutOfRange(_))
    ));
    drop(env);

    let stored: usize = Catalog::open(sandbox.path().join("catalog.db"))
        .unwrap()
        .state()
        .unwrap()
        .input_writes
        .iter()
        .map(|w| {
            use prost::Message;
            lockstep_protocol::proto::WriteInput::decode(w.write.as_slice())
                .unwrap()
                .updates
                .len()
        })
        .sum();
    assert!(
        stored < 4_000,
        "{stored} updates stored for {} written, 40 live",
        all.len()
    );

    // Rehydrated from the compacted catalog: the same answers at and above
    // the since.
    let mut cfg = config(sandbox.path(), None);
    cfg.compaction_lag = Some(8);
    let env = start_config(cfg).await;
    for p in service(&env).await.processes {
        let _ = std::process::Command::new("kill")
            .args(["-9", &p.pid.unwrap().to_string()])
            .status();
    }
    peek_until(&env, 101, last, &expected, Duration::from_secs(90))
        .await
        .expect("the rehydrated replica answers at the upper");
    // The since: the largest multiple of the step (8 / 4) at or below the
    // upper (2,000) minus the lag (8).
    let at_since = 1_992;
    let expected_since = evaluate(&plan, &BTreeMap::from([(1, all)]), at_since);
    peek_until(
        &env,
        101,
        at_since,
        &expected_since,
        Duration::from_secs(30),
    )
    .await
    .expect("and at the since");
}
