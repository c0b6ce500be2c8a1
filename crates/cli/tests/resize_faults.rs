//! `lockstep replica resize` when things fail, on real replica processes
//! under `barrier`.
//!
//! The environment killed (a panic at a failpoint: the process exits at
//! once) in each phase: the standby started (the catalog still names the
//! old shape), the new shape written to the catalog (the old processes
//! still running), the processes replaced (the controller not yet pointed
//! at them). The next environment must leave no standby, run the replica
//! at the shape its catalog names (the old one before the commit point,
//! the new one after it) with that many processes, and answer a peek
//! right, a write made after the restart included: nothing lost, nothing
//! doubled (O2, I3). The record of the resize it left is settled at that
//! start and said by `lockstep status` (completed after the commit point,
//! rolled back before it).
//!
//! New processes that never catch up (out of the controller's reach): the
//! resize is rolled back to the old shape while the standby keeps
//! answering, no read refused or wrong, and the call fails saying so.
//!
//! Needs the `failpoints` feature (`cargo test -p lockstep-cli --features
//! failpoints`).

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::Arc;
use std::time::{Duration, Instant};

mod common;

use lockstep_chaos::environment::{Client, EnvProcess, Sandbox};
use lockstep_environment::{proto, ServiceTemplate};

/// Rows of input 1 at time 0; row `i` is `(i, i % GROUPS)`.
const ROWS: i64 = 1_000;
/// Collection 101 counts input 1's rows by their second column.
const GROUPS: i64 = 10;
/// Every bounded wait.
const WAIT: Duration = Duration::from_secs(90);

/// `lockstep serve` on `state` at `port` under `barrier`, running the
/// replica program, with `failpoints` if given.
async fn serve(state: &Path, port: u16, failpoints: Option<&str>) -> EnvProcess {
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

/// One peek of collection 101 at `t`: its rows, sorted, or the refusal.
async fn peek_once(api: &mut Client, t: u64) -> Result<Vec<(Vec<i64>, i64)>, String> {
    let answer = api
        .peek(proto::PeekRequest {
            replica: "r".into(),
            collection_id: 101,
            timestamp: t,
        })
        .await
        .map_err(|s| s.to_string())?;
    let mut rows: Vec<(Vec<i64>, i64)> = answer
        .into_inner()
        .rows
        .into_iter()
        .map(|r| (lockstep_plan::rows::decode(&r.values).unwrap(), r.diff))
        .collect();
    rows.sort();
    Ok(rows)
}

/// Peeks collection 101 at `t` (retried while the replica comes back,
/// bounded); its rows, sorted.
async fn peek(env: &EnvProcess, t: u64) -> Vec<(Vec<i64>, i64)> {
    let deadline = Instant::now() + WAIT;
    loop {
        let answer = match env.client().await {
            Ok(mut c) => peek_once(&mut c, t).await,
            Err(e) => Err(e.to_string()),
        };
        match answer {
            Ok(rows) => return rows,
            Err(e) => {
                assert!(Instant::now() < deadline, "no answer to a peek at {t}: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// Replica r (2x1) counting [`ROWS`] rows by group, through `env` at
/// `url`, answered once before this returns.
async fn replica_with_rows(state: &Path, url: &str, env: &EnvProcess) {
    common::replica_r_with(state, url, 2, 1, "reduce(get(1), [#1], count)").await;
    common::write_grouped_to_r(&mut env.client().await.unwrap(), ROWS, GROUPS).await;
    assert_eq!(peek(env, 0).await, counts(&[]), "before");
}

/// `lockstep replica resize r --processes 3 --workers 1` through `url`:
/// its output.
async fn resize_to_3x1(state: &Path, url: &str) -> std::process::Output {
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
        .args(["--server", url])
        .env("LOCKSTEP_STATE_DIR", state)
        .output();
    tokio::time::timeout(WAIT, out).await.unwrap().unwrap()
}

/// Waits (bounded) until the only service is replica `id`'s own, with
/// `processes` processes running: no standby left.
async fn only_own_running(sandbox: &Sandbox, id: u64, processes: usize, what: &str) {
    let deadline = Instant::now() + WAIT;
    loop {
        let services = sandbox.services().await.unwrap();
        let names: Vec<&str> = services.iter().map(|s| s.name.as_str()).collect();
        let own = services
            .iter()
            .find(|s| s.name == ServiceTemplate::service_name(id));
        let running = own.map_or(0, |s| s.processes.iter().filter(|p| p.running).count());
        if names == [ServiceTemplate::service_name(id)] && running == processes {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: services {names:?}, {running} of the replica's processes running"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Kills the environment at `failpoint` during a resize of r from 2x1 to
/// 3x1 and checks the next environment's replica (see the module docs):
/// `expected` is the shape it must have (processes, workers), and the
/// record it settled at its start must say `outcome`.
async fn killed_at(failpoint: &str, expected: (u64, u64), outcome: &str) {
    let sandbox = Sandbox::new().unwrap();
    let state = sandbox.path();
    let (port, url) = common::free_port_url();
    let mut env = serve(state, port, Some(&format!("{failpoint}=panic"))).await;
    replica_with_rows(state, &url, &env).await;
    let out = resize_to_3x1(state, &url).await;
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
    let (id, shape) = common::listed_r(state, &url).await;
    assert_eq!(shape, expected, "{failpoint}: the shape the catalog names");
    only_own_running(&sandbox, id, expected.0 as usize, failpoint).await;
    // The record the killed environment left, settled and said.
    let settled = settled(state, &url).await;
    assert!(
        settled.len() == 1 && settled[0].contains(outcome),
        "{failpoint}: settled at start {settled:?}, not {outcome:?}"
    );
}

/// The reconfigurations the environment at `url` settled at its start
/// (`lockstep status -o json`).
async fn settled(state: &Path, url: &str) -> Vec<String> {
    let v: serde_json::Value =
        serde_json::from_str(&common::cli_ok(state, url, &["status", "-o", "json"]).await).unwrap();
    v["reconfigurations_settled"]
        .as_array()
        .unwrap_or_else(|| panic!("{v}"))
        .iter()
        .map(|l| l.as_str().unwrap().to_string())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_with_the_standby_started_the_replica_keeps_its_old_shape() {
    killed_at("upgrade_after_standby_started", (2, 1), "rolled back").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_after_the_catalog_names_the_new_shape_the_replica_takes_it() {
    killed_at("resize_after_catalog", (3, 1), "completed").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_with_the_processes_replaced_the_replica_keeps_the_new_shape() {
    killed_at("resize_after_replaced", (3, 1), "completed").await;
}

/// What a steady reader saw.
#[derive(Debug, Default)]
struct Reads {
    answered: u64,
    refused: Vec<String>,
    wrong: u64,
}

/// The resize's new processes are out of the controller's reach (the
/// failpoint, the first resize only), so they never catch up (bound 3 s
/// here): the replica goes back to 2x1 while the standby answers, a reader
/// sees no read refused or wrong, and the call fails naming the roll-back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_processes_that_never_catch_up_are_rolled_back_and_reads_go_on() {
    let sandbox = Sandbox::new().unwrap();
    let state = sandbox.path();
    let (port, url) = common::free_port_url();
    let failpoints =
        "resize_new_processes_unreachable=1*return;resize_catch_up_bound_ms=return(3000)";
    let env = serve(state, port, Some(failpoints)).await;
    replica_with_rows(state, &url, &env).await;
    let stop = Arc::new(AtomicBool::new(false));
    let reader = {
        let (mut api, stop) = (env.client().await.unwrap(), stop.clone());
        tokio::spawn(async move {
            let mut reads = Reads::default();
            while !stop.load(SeqCst) {
                match peek_once(&mut api, 0).await {
                    Ok(rows) => {
                        reads.answered += 1;
                        reads.wrong += u64::from(rows != counts(&[]));
                    }
                    Err(e) => reads.refused.push(e),
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            reads
        })
    };
    let out = resize_to_3x1(state, &url).await;
    stop.store(true, SeqCst);
    let reads = reader.await.unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the resize failed: {stderr}");
    assert!(
        stderr.contains("did not catch up within") && stderr.contains("rolled back to 2x1"),
        "{stderr}"
    );
    assert!(
        reads.refused.is_empty() && reads.wrong == 0 && reads.answered >= 10,
        "reads across the roll-back: {reads:?}"
    );
    let (id, shape) = common::listed_r(state, &url).await;
    assert_eq!(shape, (2, 1), "rolled back to the old shape");
    only_own_running(&sandbox, id, 2, "rolled back").await;
    common::write_to_r(state, &url, &format!("{ROWS},{}@1", ROWS % GROUPS), 2).await;
    assert_eq!(peek(&env, 1).await, counts(&[ROWS]), "after the roll-back");
    // The failed resize removed its record: the next start settles none.
    let mut env = env;
    env.kill().await.unwrap();
    let env = serve(state, port, None).await;
    assert_eq!(settled(state, &url).await, Vec::<String>::new());
    assert_eq!(peek(&env, 1).await, counts(&[ROWS]), "after a restart");
}
