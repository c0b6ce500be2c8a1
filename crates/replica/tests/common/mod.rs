//! Test support: real replica processes launched through the orchestrator's
//! process backend, and a controller driving them.
#![allow(dead_code, missing_docs)]

use std::collections::BTreeMap;
use std::time::Duration;

use lockstep_controller::{Controller, ReplicaAddrs, Timeouts};
use lockstep_orchestrator::process::{
    kill_all_services, ProcessOrchestrator, ProcessOrchestratorConfig,
};
use lockstep_orchestrator::{Orchestrator, ServiceConfig, ServiceStatus};
use lockstep_plan::reference::{evaluate, Multiset};
use lockstep_plan::{Aggregate, CompareOp, Expr, Plan, Predicate};
use lockstep_policy::FixedStrategy;
use lockstep_protocol::{CommandHistory, DataflowDescription, Strategy, Update};

pub struct TestReplica {
    pub dir: tempfile::TempDir,
    pub orchestrator: ProcessOrchestrator,
    pub status: ServiceStatus,
    pub addrs: ReplicaAddrs,
}

impl Drop for TestReplica {
    fn drop(&mut self) {
        let _ = kill_all_services(self.dir.path());
    }
}

/// The service config of a replica of the real `lockstep-replica` binary.
pub fn replica_service(replica_id: u64, processes: usize, workers: u32) -> ServiceConfig {
    lockstep_launch::replica_service(
        std::path::Path::new(env!("CARGO_BIN_EXE_lockstep-replica")),
        replica_id,
        processes,
        workers,
    )
    .env(
        "RUST_LOG",
        std::env::var("REPLICA_LOG").unwrap_or_else(|_| "warn".into()),
    )
}

/// The last lines of every replica process's log, for failure messages.
pub fn logs(r: &TestReplica, lines: usize) -> String {
    let mut out = String::new();
    if let Ok(entries) = std::fs::read_dir(r.dir.path().join("logs")) {
        for e in entries.flatten() {
            let text = std::fs::read_to_string(e.path()).unwrap_or_default();
            let all: Vec<&str> = text.lines().collect();
            out.push_str(&format!("--- {}\n", e.path().display()));
            for l in &all[all.len().saturating_sub(lines)..] {
                out.push_str(l);
                out.push('\n');
            }
        }
    }
    out
}

pub async fn start_replica(replica_id: u64, processes: usize, workers: u32) -> TestReplica {
    start_replica_with_env(replica_id, processes, workers, &[]).await
}

/// A replica whose processes get `env` on top of the usual environment.
pub async fn start_replica_with_env(
    replica_id: u64,
    processes: usize,
    workers: u32,
    env: &[(&str, &str)],
) -> TestReplica {
    let dir = tempfile::tempdir().expect("tempdir");
    let orchestrator = ProcessOrchestrator::new(ProcessOrchestratorConfig::new(dir.path(), 1))
        .expect("orchestrator");
    let log = lockstep_controller::LogLocation::Sqlite(dir.path().join("command-log.sqlite"));
    // Every test replica has a session key, as under `lockstep serve`.
    let key = test_session_key(replica_id);
    let service = env.iter().fold(
        lockstep_launch::with_session_key(replica_service(replica_id, processes, workers), &key),
        |s, (k, v)| s.env(*k, *v),
    );
    let status = orchestrator
        .ensure_service(lockstep_launch::with_command_log(service, &log))
        .await
        .expect("ensure replica");
    let addrs = ReplicaAddrs {
        replica_id,
        processes: status
            .processes
            .iter()
            .map(|p| p.addresses["controller"].into())
            .collect(),
        workers_per_process: workers,
        command_log: Some(log),
        session_key: Some(key),
        one_way_proof: false,
        max_frame_len: lockstep_protocol::DEFAULT_MAX_FRAME_LEN,
    };
    TestReplica {
        dir,
        orchestrator,
        status,
        addrs,
    }
}

/// The session key of test replica `replica_id`.
pub fn test_session_key(replica_id: u64) -> lockstep_protocol::SessionKey {
    lockstep_protocol::SessionKey::derive(&[0x5e; 32], replica_id)
}

pub fn test_timeouts() -> Timeouts {
    Timeouts {
        connect: Duration::from_secs(20),
        heartbeat_interval: Duration::from_millis(100),
        heartbeat_timeout: Duration::from_secs(2),
        request: Duration::from_secs(20),
    }
}

pub fn controller(r: &TestReplica, epoch: u64, history: CommandHistory) -> Controller {
    controller_with(r, epoch, history, Strategy::Barrier)
}

/// A controller that sends every command with `strategy`.
pub fn controller_with(
    r: &TestReplica,
    epoch: u64,
    history: CommandHistory,
    strategy: Strategy,
) -> Controller {
    Controller::start(
        r.addrs.clone(),
        epoch,
        history,
        Box::new(FixedStrategy(strategy)),
        test_timeouts(),
    )
}

pub fn u(row: &[i64], time: u64, diff: i64) -> Update {
    Update {
        row: lockstep_plan::row(row),
        time,
        diff,
    }
}

pub fn get(c: u64) -> Box<Plan> {
    Box::new(Plan::Get { collection_id: c })
}

pub fn dataflow(id: u64, inputs: &[u64], plan: Plan) -> DataflowDescription {
    lockstep_plan::dataflow(
        id,
        0,
        inputs.to_vec(),
        &[(1000 + id, plan)],
        format!("test-{id}"),
    )
}

/// One dataflow per plan operator, reading inputs 1 and 2.
pub fn operator_dataflows() -> Vec<DataflowDescription> {
    vec![
        dataflow(10, &[1], Plan::Get { collection_id: 1 }),
        dataflow(
            11,
            &[1],
            Plan::Map {
                input: get(1),
                exprs: vec![
                    Expr::Column(0),
                    Expr::Mul(Box::new(Expr::Column(1)), Box::new(Expr::Literal(2))),
                ],
            },
        ),
        dataflow(
            12,
            &[1],
            Plan::Filter {
                input: get(1),
                predicates: vec![Predicate {
                    op: CompareOp::Ge,
                    left: Expr::Column(1),
                    right: Expr::Literal(20),
                }],
            },
        ),
        dataflow(
            13,
            &[1, 2],
            Plan::Join {
                left: get(1),
                right: get(2),
                left_key: 0,
                right_key: 0,
            },
        ),
        dataflow(
            14,
            &[1],
            Plan::Reduce {
                input: get(1),
                key: vec![0],
                aggregates: vec![Aggregate::Count, Aggregate::Sum(1)],
            },
        ),
        dataflow(
            15,
            &[2],
            Plan::Arrange {
                input: get(2),
                key: vec![1],
            },
        ),
    ]
}

/// Inputs with retractions over several timestamps: (collection, updates, upper).
pub fn operator_writes() -> Vec<(u64, Vec<Update>, u64)> {
    vec![
        (
            1,
            vec![u(&[1, 10], 0, 1), u(&[2, 20], 0, 1), u(&[3, 30], 0, 2)],
            1,
        ),
        (
            2,
            vec![u(&[1, 100], 0, 1), u(&[2, 200], 0, 1), u(&[9, 900], 0, 1)],
            1,
        ),
        (
            1,
            vec![u(&[1, 10], 1, -1), u(&[1, 11], 1, 1), u(&[4, 40], 1, 1)],
            2,
        ),
        (2, vec![u(&[2, 200], 2, -1), u(&[4, 400], 2, 3)], 3),
        (1, vec![u(&[3, 30], 3, -2), u(&[2, 25], 3, 1)], 4),
        (2, vec![], 4),
    ]
}

pub fn reference(
    desc: &DataflowDescription,
    writes: &[(u64, Vec<Update>, u64)],
    t: u64,
) -> Multiset {
    let mut inputs: BTreeMap<u64, Vec<Update>> = BTreeMap::new();
    for (c, ups, _) in writes {
        inputs.entry(*c).or_default().extend(ups.iter().cloned());
    }
    let export = &desc.exports[0];
    let plan = lockstep_plan::decode(export.collection_id, &export.description)
        .expect("the test's own plan");
    evaluate(&plan, &inputs, t)
}

pub fn as_multiset(rows: Vec<(lockstep_protocol::Row, i64)>) -> Multiset {
    rows.into_iter().collect()
}
