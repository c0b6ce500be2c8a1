//! Fault holes of issue 15, each on real `lockstep-replica` processes (the
//! binary next to the `lockstep` binary under test, or
//! `$LOCKSTEP_REPLICA_BIN`):
//!
//! - a replica process's ports cannot be taken while the orchestrator runs
//!   (it holds every port it chose); one taken while the environment was
//!   down: the next orchestrator re-chooses every process's ports after
//!   repeated quick exits, the controller follows, and the replica answers
//!   again;
//! - a dataflow a replica refuses as malformed (here: its processes run with
//!   a smaller frame limit than the environment's): the request fails, the
//!   dataflow leaves the history and the catalog, and the replica's other
//!   dataflows keep answering, across an environment restart too;
//! - plan depth through the gRPC API: the environment refuses exactly what a
//!   replica's decoder and checks would refuse (one shared validation,
//!   `lockstep_protocol::validate`), at the boundary depths.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use lockstep_chaos::environment::Sandbox;
use lockstep_plan::reference::evaluate;

mod common;
use common::*;

/// How long recovery may take on a slow shared machine.
const RECOVERY_BOUND: Duration = Duration::from_secs(60);

fn controller_addr(s: &lockstep_orchestrator::ServiceStatus, i: usize) -> SocketAddr {
    s.processes[i].addresses["controller"]
}

/// Waits (bounded) until process `pid` is gone.
async fn wait_gone(pid: u32) {
    let started = Instant::now();
    while proc_state(pid).is_some_and(|s| s != 'Z') && started.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ports_are_held_while_the_environment_runs_and_a_taken_one_is_rechosen() {
    let sandbox = Sandbox::new().unwrap();
    let env = start(sandbox.path()).await;
    env.create_replica("r1", shape(2, 1)).await.unwrap();
    let plan = create_reduce(&env).await;
    let updates = vec![u(&[1, 10], 0, 1), u(&[2, 5], 0, 1), u(&[1, 20], 1, 1)];
    env.write_input("r1", 1, updates.clone(), 2).await.unwrap();
    let expected = evaluate(&plan, &BTreeMap::from([(1, updates)]), 1);
    peek_until(&env, 101, 1, &expected, Duration::from_secs(30))
        .await
        .expect("the replica answers before the fault");
    let before = service(&env).await;
    let taken = controller_addr(&before, 1);
    let timely = before.processes[1].addresses["timely"];

    // While the orchestrator runs it holds every port it chose: process 1
    // killed, neither of its ports can be taken before (or after) its
    // restart, and the replica answers again on the same addresses.
    if let Some(pid) = before.processes[1].pid {
        let _ = std::process::Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .status();
        wait_gone(pid).await;
    }
    for addr in [taken, timely] {
        let e = std::net::TcpListener::bind(addr)
            .expect_err("a killed process's port was free for another socket");
        assert_eq!(e.kind(), std::io::ErrorKind::AddrInUse, "{addr}: {e}");
    }
    peek_until(&env, 101, 1, &expected, RECOVERY_BOUND)
        .await
        .expect("the replica answers again after the kill");
    let restarted = service(&env).await;
    for (old, new) in before.processes.iter().zip(&restarted.processes) {
        assert_eq!(old.addresses, new.addresses, "process {}", old.index);
    }
    let before = restarted;

    // With the environment down, a process that dies frees its ports: one
    // is taken then. The next environment cannot hold it, so it re-chooses
    // every process's ports after a few quick exits.
    drop(env);
    let started = Instant::now();
    let foreign = loop {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "could not take port {taken} with the environment down"
        );
        if let Some(pid) = before.processes[1].pid {
            let _ = std::process::Command::new("kill")
                .args(["-KILL", &pid.to_string()])
                .status();
            wait_gone(pid).await;
        }
        if let Ok(l) = std::net::TcpListener::bind(taken) {
            break l;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let env = start(sandbox.path()).await;

    // Process 1 cannot listen any more; after a few quick exits every
    // process gets new ports, the controller reconnects there, and the
    // replica answers again (rebuilt from the history).
    if let Err(last) = peek_until(&env, 101, 1, &expected, RECOVERY_BOUND).await {
        panic!(
            "no correct answer within {RECOVERY_BOUND:?} of taking {taken}; last: {last}; service: {:?}",
            service(&env).await
        );
    }
    let after = service(&env).await;
    assert!(after.processes.iter().all(|p| p.running), "{after:?}");
    for (old, new) in before.processes.iter().zip(&after.processes) {
        assert_ne!(
            old.addresses, new.addresses,
            "process {}: every process has new ports",
            old.index
        );
        assert_ne!(old.pid, new.pid, "process {} was restarted", old.index);
    }
    assert_eq!(
        foreign.local_addr().unwrap(),
        taken,
        "the foreign listener still holds the old port"
    );

    // The new ports are recorded: an environment restarted on the same
    // state directory adopts the processes on them and answers.
    drop(env);
    let env = start(sandbox.path()).await;
    let adopted = service(&env).await;
    assert_eq!(pids(&adopted), pids(&after), "adopted, not restarted");
    assert_eq!(
        controller_addr(&adopted, 0),
        controller_addr(&after, 0),
        "the recorded ports are the new ones"
    );
    peek_until(&env, 101, 1, &expected, Duration::from_secs(30))
        .await
        .expect("the new environment's controller answers on the new ports");
}

/// A plan of `depth` levels: filters without predicates around `get(1)`.
fn nested(depth: usize) -> lockstep_plan::Plan {
    let mut plan = lockstep_plan::Plan::Get { collection_id: 1 };
    for _ in 1..depth {
        plan = lockstep_plan::Plan::Filter {
            input: Box::new(plan),
            predicates: vec![],
        };
    }
    assert_eq!(plan.depth(), depth);
    plan
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plan_depths_at_the_limit_are_refused_through_the_api_exactly_as_a_replica_would() {
    use lockstep_environment::proto;
    use lockstep_environment::proto::environment_client::EnvironmentClient;
    use lockstep_plan::MAX_PLAN_DEPTH;
    use lockstep_protocol::proto as wire;
    use tonic::Code;

    let sandbox = Sandbox::new().unwrap();
    let env = std::sync::Arc::new(start(sandbox.path()).await);
    env.create_replica("r1", shape(1, 1)).await.unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let server = tokio::spawn(env.clone().serve(listener));
    let mut api = EnvironmentClient::connect(url).await.unwrap();
    let create = |collection_id: u64, depth: usize| proto::CreateDataflowRequest {
        replica: "r1".into(),
        name: format!("depth {depth}"),
        inputs: vec![1],
        exports: vec![wire::Export {
            collection_id,
            description: lockstep_plan::encode(&nested(depth)),
        }],
        as_of: 0,
        format: String::new(),
    };
    let dataflows = |env: &lockstep_environment::Environment| env.view().dataflows.len();

    // At the limit: accepted, built by the replica, and it answers.
    api.create_dataflow(create(100, MAX_PLAN_DEPTH))
        .await
        .expect("a plan exactly at the limit is accepted");
    let updates = vec![u(&[1, 10], 0, 1), u(&[2, 20], 0, 2)];
    env.write_input("r1", 1, updates.clone(), 1).await.unwrap();
    let expected = updates.iter().map(|u| (u.row.clone(), u.diff)).collect();
    peek_until(&env, 100, 0, &expected, Duration::from_secs(30))
        .await
        .expect("the replica built the deepest plan the environment accepts");

    // Past the limit (the report was at 48): refused as
    // INVALID_ARGUMENT, nothing recorded. The API carries the plan as the
    // family's bytes, so its own protobuf decoder never sees the nesting:
    // the family's check names the depth, until the family's decoder
    // (protobuf's recursion limit, 100) refuses the bytes themselves, which
    // is INVALID_ARGUMENT too, naming the export.
    let before = dataflows(&env);
    let mut undecodable_from = None;
    for depth in MAX_PLAN_DEPTH + 1..=64 {
        let e = api.create_dataflow(create(200, depth)).await.unwrap_err();
        assert_eq!(
            e.code(),
            Code::InvalidArgument,
            "depth {depth}: {}",
            e.message()
        );
        if e.message()
            .contains("export 200's description is not a plan")
        {
            undecodable_from.get_or_insert(depth);
        } else {
            assert!(
                undecodable_from.is_none()
                    && e.message().contains(&format!("nests {depth} levels deep")),
                "depth {depth}: {}",
                e.message()
            );
        }
        assert_eq!(dataflows(&env), before, "depth {depth}: nothing recorded");
    }
    let undecodable_from = undecodable_from.expect("the family's decoder has a limit");
    assert!(undecodable_from > 48, "{undecodable_from}");
    eprintln!(
        "the API refuses plans {}..{undecodable_from} deep by their depth, deeper as undecodable",
        MAX_PLAN_DEPTH + 1
    );
    peek_until(&env, 100, 0, &expected, Duration::from_secs(30))
        .await
        .expect("the replica still answers");
    server.abort();
}

/// A dataflow whose CreateDataflow command would not fit the replicas'
/// frame limit is refused before it is recorded (it used to be recorded,
/// acknowledged, and then never sent: the controller cannot encode it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dataflow_too_large_for_a_replica_frame_is_refused_before_it_is_recorded() {
    use lockstep_environment::compute::ComputeError;
    use lockstep_plan::text::parse_plan;

    let sandbox = Sandbox::new().unwrap();
    let mut config = config(sandbox.path(), None);
    config.max_frame_len = 64 << 10;
    let env = start_config(config).await;
    env.create_replica("r1", shape(1, 1)).await.unwrap();
    let before = env.view().dataflows.len();
    let e = env
        .create_dataflow(
            "r1",
            &"x".repeat(100 << 10),
            0,
            vec![1],
            vec![lockstep_plan::export(101, &parse_plan("get(1)").unwrap())],
        )
        .await;
    let Err(e) = e else {
        panic!("a dataflow too large for a replica's frame was accepted")
    };
    match &e {
        ComputeError::Invalid(m) => assert!(m.contains("frame limit of 65536 bytes"), "{m}"),
        other => panic!("expected Invalid, got {other:?}"),
    }
    assert_eq!(env.view().dataflows.len(), before, "nothing recorded");
    // The replica still serves dataflows that fit.
    create_identity(&env, 102).await;
    let updates = vec![u(&[1], 0, 1)];
    env.write_input("r1", 1, updates.clone(), 1).await.unwrap();
    let expected = updates.iter().map(|u| (u.row.clone(), u.diff)).collect();
    peek_until(&env, 102, 0, &expected, Duration::from_secs(30))
        .await
        .expect("the replica answers");
}

/// A replica whose processes accept smaller frames than the environment
/// checks for (64 KiB against the default): a dataflow between the two
/// passes the environment's checks and is refused by every process's
/// decoder. It used to stay in the history and the catalog, be resent on
/// every reconnect, and stop every dataflow of the replica from answering.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dataflow_a_replica_refuses_as_malformed_fails_its_request_and_leaves_the_history() {
    use lockstep_environment::compute::ComputeError;
    use lockstep_plan::text::parse_plan;

    let sandbox = Sandbox::new().unwrap();
    let small_frames = || {
        let mut c = config(sandbox.path(), None);
        c.service.args.push("--max-frame-len=65536".into());
        c
    };
    let env = start_config(small_frames()).await;
    env.create_replica("r1", shape(2, 1)).await.unwrap();
    create_identity(&env, 102).await;
    let updates = vec![u(&[1], 0, 1), u(&[2], 0, 3)];
    env.write_input("r1", 1, updates.clone(), 1).await.unwrap();
    let expected = updates.iter().map(|u| (u.row.clone(), u.diff)).collect();
    peek_until(&env, 102, 0, &expected, Duration::from_secs(30))
        .await
        .expect("the replica answers before the refused dataflow");

    let poison = env
        .create_dataflow(
            "r1",
            &"x".repeat(100 << 10),
            0,
            vec![1],
            vec![lockstep_plan::export(103, &parse_plan("get(1)").unwrap())],
        )
        .await;
    match &poison {
        Err(ComputeError::Refused(m)) => assert!(
            m.contains("refused the dataflow's command as malformed") && m.contains("65536"),
            "{m}"
        ),
        Err(other) => panic!("expected a refusal, got {other:?}"),
        Ok(d) => panic!("dataflow {} was accepted", d.id),
    }
    assert_eq!(
        env.view().dataflows.len(),
        1,
        "the refused dataflow left the catalog"
    );
    let history = env
        .replica_controller("r1")
        .unwrap()
        .history()
        .await
        .unwrap();
    assert_eq!(history.live_dataflows().len(), 1, "and the history");

    // The replica's other dataflow answers, and takes new writes.
    peek_until(&env, 102, 0, &expected, Duration::from_secs(30))
        .await
        .expect("the other dataflow answers after the refusal");
    let more = vec![u(&[4], 1, 1)];
    env.write_input("r1", 1, more.clone(), 2).await.unwrap();
    let expected2: lockstep_plan::reference::Multiset = updates
        .iter()
        .chain(&more)
        .map(|u| (u.row.clone(), u.diff))
        .collect();
    peek_until(&env, 102, 1, &expected2, Duration::from_secs(30))
        .await
        .expect("the other dataflow takes new writes");

    // A restarted environment does not replay it.
    drop(env);
    let env = start_config(small_frames()).await;
    assert_eq!(env.view().dataflows.len(), 1);
    peek_until(&env, 102, 1, &expected2, Duration::from_secs(30))
        .await
        .expect("the other dataflow answers after a restart");
}

/// Per-process frontier lag: in the metrics and in ListReplicas (which
/// `lockstep status` prints). A stopped process stops reporting frontiers,
/// so a write makes the lag visible; once it runs again (or the replica is
/// restarted), the lag goes back to 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frontier_lag_per_process_is_in_the_metrics_and_the_replica_list() {
    use lockstep_environment::proto;
    use lockstep_environment::proto::environment_client::EnvironmentClient;

    let sandbox = Sandbox::new().unwrap();
    let env = std::sync::Arc::new(start(sandbox.path()).await);
    env.create_replica("r1", shape(2, 1)).await.unwrap();
    create_identity(&env, 102).await;
    env.write_input("r1", 1, vec![u(&[1], 0, 1)], 1)
        .await
        .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let server = tokio::spawn(env.clone().serve(listener));
    let api = EnvironmentClient::connect(url).await.unwrap();
    let lags = || {
        let mut api = api.clone();
        async move {
            api.list_replicas(proto::ListReplicasRequest::default())
                .await
                .unwrap()
                .into_inner()
                .replicas[0]
                .process_status
                .iter()
                .map(|p| p.frontier_lag)
                .collect::<Vec<_>>()
        }
    };
    let wait_for = |what: &'static str, want: fn(&[Option<u64>]) -> bool| async move {
        let started = Instant::now();
        loop {
            let got = lags().await;
            if want(&got) {
                return got;
            }
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "{what}: lags {got:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    wait_for("caught up", |l| l.iter().all(|l| *l == Some(0))).await;
    // Each process's agreed protocol version and build are listed too
    // (docs/compatibility.md).
    let listed = api
        .clone()
        .list_replicas(proto::ListReplicasRequest::default())
        .await
        .unwrap()
        .into_inner();
    for p in &listed.replicas[0].process_status {
        assert_eq!(
            p.protocol_version,
            Some(lockstep_protocol::PROTOCOL_VERSION),
            "{p:?}"
        );
        assert_eq!(
            p.build_version.as_deref(),
            Some(env!("CARGO_PKG_VERSION")),
            "{p:?}"
        );
    }
    // The metrics say the same (the health loop updates them every second).
    let started = Instant::now();
    loop {
        let text = env.metrics().encode();
        let found = (0..2).all(|p| {
            text.contains(&format!(
                "lockstep_environment_process_frontier_lag{{replica=\"r1\",process=\"{p}\"}} 0"
            ))
        });
        if found {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(30), "{text}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // Stop process 1 and write up to 50: the lag shows.
    let stopped = service(&env).await.processes[1].pid.unwrap();
    let signal = |sig: &str| {
        std::process::Command::new("kill")
            .args([sig, &stopped.to_string()])
            .status()
            .unwrap()
    };
    assert!(signal("-STOP").success());
    env.write_input("r1", 1, vec![u(&[2], 1, 1)], 50)
        .await
        .unwrap();
    let behind = wait_for("behind after a write to a stopped process", |l| {
        l.iter().any(|l| l.is_some_and(|l| l > 0))
    })
    .await;
    assert!(signal("-CONT").success());
    eprintln!("lags with process 1 stopped: {behind:?}");
    wait_for("caught up again", |l| l.iter().all(|l| *l == Some(0))).await;
    // Dropped, the replica's series end with it.
    assert!(env.metrics().encode().contains("replica=\"r1\""));
    env.drop_replica("r1").await.unwrap();
    let started = Instant::now();
    loop {
        let text = env.metrics().encode();
        if !text.contains("replica=\"r1\"") {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "a dropped replica's series are still exported:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    server.abort();
}
