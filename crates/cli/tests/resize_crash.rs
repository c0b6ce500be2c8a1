//! An environment killed (a panic at a failpoint: the process exits at
//! once) in each phase of `lockstep replica resize`, on real replica
//! processes under `barrier`: the standby started (the catalog still
//! names the old shape), the new shape written to the catalog (the old
//! processes still running), the processes replaced (the controller not
//! yet pointed at them). The next environment must leave no standby, run
//! the replica at the shape its catalog names (the old one before the
//! commit point, the new one after it) with that many processes, and
//! answer a peek right, a write made after the restart included: nothing
//! lost, nothing doubled (O2, I3). Needs the `failpoints` feature
//! (`cargo test -p lockstep-cli --features failpoints`).

use std::time::{Duration, Instant};

mod common;

use lockstep_chaos::environment::{EnvProcess, Sandbox};
use lockstep_environment::{proto, ServiceTemplate};

/// Rows of input 1 at time 0; row `i` is `(i, i % GROUPS)`.
const ROWS: i64 = 1_000;
/// Collection 101 counts input 1's rows by their second column.
const GROUPS: i64 = 10;
/// Every bounded wait.
const WAIT: Duration = Duration::from_secs(90);

/// `lockstep serve` on `state` at `port` under `barrier`, running the
/// replica program, with `failpoints` if given.
async fn serve(state: &std::path::Path, port: u16, failpoints: Option<&str>) -> EnvProcess {
    let policy = common::built_policy("barrier");
    let listen = format!("127.0.0.1:{port}");
    let (policy, replica) = (policy.to_string_lossy(), common::replica_binary());
    let replica = replica.to_string_lossy();
    let args = [
        "--listen",
        &listen,
        "--distribution-policy",
        &policy,
        "--service-binary",
        &replica,
    ];
    let env: Vec<(String, std::ffi::OsString)> = failpoints
        .map(|fp| ("FAILPOINTS".to_string(), fp.into()))
        .into_iter()
        .collect();
    EnvProcess::serve(
        std::path::Path::new(env!("CARGO_BIN_EXE_lockstep")),
        state,
        &args,
        &env,
    )
    .await
    .unwrap()
}

/// Collection 101 after input 1's rows `0..ROWS` and `extra`, sorted.
fn counts(extra: &[i64]) -> Vec<(Vec<i64>, i64)> {
    let mut c = std::collections::BTreeMap::new();
    for i in (0..ROWS).chain(extra.iter().copied()) {
        *c.entry(i % GROUPS).or_insert(0i64) += 1;
    }
    c.into_iter().map(|(g, n)| (vec![g, n], 1)).collect()
}

/// Peeks collection 101 at `t` (retried while the replica comes back,
/// bounded); its rows, sorted.
async fn peek(env: &EnvProcess, t: u64) -> Vec<(Vec<i64>, i64)> {
    let deadline = Instant::now() + WAIT;
    loop {
        let answer = match env.client().await {
            Ok(mut c) => c
                .peek(proto::PeekRequest {
                    replica: "r".into(),
                    collection_id: 101,
                    timestamp: t,
                })
                .await
                .map_err(|s| s.to_string()),
            Err(e) => Err(e.to_string()),
        };
        match answer {
            Ok(a) => {
                let mut rows: Vec<(Vec<i64>, i64)> = a
                    .into_inner()
                    .rows
                    .into_iter()
                    .map(|r| (lockstep_plan::rows::decode(&r.values).unwrap(), r.diff))
                    .collect();
                rows.sort();
                return rows;
            }
            Err(e) => {
                assert!(Instant::now() < deadline, "no answer to a peek at {t}: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// Kills the environment at `failpoint` during a resize of r from 2x1 to
/// 3x1 and checks the next environment's replica (see the module docs):
/// `expected` is the shape it must have (processes, workers).
async fn killed_at(failpoint: &str, expected: (u32, u32)) {
    let sandbox = Sandbox::new().unwrap();
    let state = sandbox.path();
    let (port, url) = common::free_port_url();
    let mut env = serve(state, port, Some(&format!("{failpoint}=panic"))).await;
    common::replica_r_with(state, &url, 2, 1, "reduce(get(1), [#1], count)").await;
    let updates = (0..ROWS).map(|i| {
        lockstep_protocol::proto::Update::from(lockstep_protocol::Update {
            row: lockstep_plan::rows::encode(&[i, i % GROUPS]),
            time: 0,
            diff: 1,
        })
    });
    env.client()
        .await
        .unwrap()
        .write_input(proto::WriteInputRequest {
            replica: "r".into(),
            collection_id: 1,
            updates: updates.collect(),
            upper: 1,
        })
        .await
        .unwrap();
    assert_eq!(peek(&env, 0).await, counts(&[]), "{failpoint}: before");

    let resize = [
        "replica",
        "resize",
        "r",
        "--processes",
        "3",
        "--workers",
        "1",
    ];
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_lockstep"))
        .args(resize)
        .args(["--server", &url])
        .env("LOCKSTEP_STATE_DIR", state)
        .output();
    let out = tokio::time::timeout(WAIT, out).await.unwrap().unwrap();
    let (status, stderr) = env.wait_exit().await.unwrap();
    assert!(
        !status.success() && !out.status.success() && stderr.contains(failpoint),
        "{failpoint}: the environment did not crash there: exit {status}; stderr:\n{stderr}"
    );

    let env = serve(state, port, None).await;
    // A write after the restart, then a peek at its time: the rows before
    // it once, it once.
    common::write_to_r(state, &url, &format!("{ROWS},{}@1", ROWS % GROUPS), 2).await;
    assert_eq!(
        peek(&env, 1).await,
        counts(&[ROWS]),
        "{failpoint}: the replica's answer after the restart"
    );
    let v: serde_json::Value = serde_json::from_str(
        &common::cli_ok(state, &url, &["replica", "list", "-o", "json"]).await,
    )
    .unwrap();
    let r = &v["replicas"][0];
    assert_eq!(
        (r["processes"].as_u64(), r["workers_per_process"].as_u64()),
        (Some(expected.0 as u64), Some(expected.1 as u64)),
        "{failpoint}: the shape the catalog names"
    );
    // No standby, and the replica's own service at that shape.
    let deadline = Instant::now() + WAIT;
    loop {
        let services = sandbox.services().await.unwrap();
        let names: Vec<&str> = services.iter().map(|s| s.name.as_str()).collect();
        let id = r["id"].as_u64().unwrap();
        let own = services
            .iter()
            .find(|s| s.name == ServiceTemplate::service_name(id));
        let running = own.map_or(0, |s| s.processes.iter().filter(|p| p.running).count());
        if names == [ServiceTemplate::service_name(id)] && running == expected.0 as usize {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{failpoint}: services {names:?}, {running} of the replica's processes running"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_with_the_standby_started_the_replica_keeps_its_old_shape() {
    killed_at("upgrade_after_standby_started", (2, 1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_after_the_catalog_names_the_new_shape_the_replica_takes_it() {
    killed_at("resize_after_catalog", (3, 1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_with_the_processes_replaced_the_replica_keeps_the_new_shape() {
    killed_at("resize_after_replaced", (3, 1)).await;
}
