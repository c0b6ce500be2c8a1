//! Addresses as names: a replica whose `--peers` are host names (resolved by
//! the system resolver, `localhost` from /etc/hosts) and which binds its own
//! entry's address by default, driven by a controller that reaches its
//! processes by name; and a malformed peer refused with a message naming it.

mod common;

use lockstep_controller::ReplicaAddrs;
use lockstep_orchestrator::process::{ProcessOrchestrator, ProcessOrchestratorConfig};
use lockstep_orchestrator::{Orchestrator, ServiceConfig};
use lockstep_protocol::{CommandHistory, Endpoint};

use common::{controller, test_session_key, TestReplica};

const BINARY: &str = env!("CARGO_BIN_EXE_lockstep-replica");

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_forms_and_is_driven_by_host_names() {
    let dir = tempfile::tempdir().unwrap();
    let orchestrator =
        ProcessOrchestrator::new(ProcessOrchestratorConfig::new(dir.path(), 1)).unwrap();
    let key = test_session_key(41);
    // No --listen-host: each process binds what its own entry resolves to.
    let service = ServiceConfig::new("replica-41", 41, BINARY)
        .scale(2)
        .port("timely")
        .port("controller")
        .args(|a| {
            let peers: Vec<String> = (0..a.scale)
                .map(|i| format!("localhost:{}", a.port_of(i, "timely")))
                .collect();
            vec![
                "--replica-id=41".to_string(),
                format!("--process={}", a.process),
                format!("--processes={}", a.scale),
                "--workers=2".to_string(),
                format!("--timely-port={}", a.port("timely")),
                format!("--controller-port={}", a.port("controller")),
                format!("--peers={}", peers.join(",")),
            ]
        });
    let status = orchestrator
        .ensure_service(lockstep_launch::with_session_key(service, &key))
        .await
        .unwrap();
    let processes: Vec<Endpoint> = status
        .processes
        .iter()
        .map(|p| Endpoint::new("localhost", p.addresses["controller"].port()).unwrap())
        .collect();
    let r = TestReplica {
        dir,
        orchestrator,
        status,
        addrs: ReplicaAddrs {
            replica_id: 41,
            processes,
            workers_per_process: 2,
            command_log: None,
            session_key: Some(key),
            one_way_proof: false,
            max_frame_len: lockstep_protocol::DEFAULT_MAX_FRAME_LEN,
        },
    };
    let c = controller(&r, 1, CommandHistory::new());
    let statuses = c
        .statuses()
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", common::logs(&r, 20)));
    let mut workers: Vec<u32> = statuses.iter().map(|s| s.worker_index).collect();
    workers.sort();
    assert_eq!(
        workers,
        [0, 1, 2, 3],
        "every worker of both processes answers"
    );
}

#[test]
fn a_malformed_peer_is_refused_naming_it() {
    let out = std::process::Command::new(BINARY)
        .args([
            "--replica-id=1",
            "--process=0",
            "--processes=2",
            "--timely-port=7000",
            "--controller-port=7001",
            "--peers=localhost:7000,bad..name:7002",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("\"bad..name:7002\" is not a host:port address"),
        "{stderr}"
    );
}
