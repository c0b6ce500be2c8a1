//! A replica process's `/metrics` on its controller port: served beside the
//! compute protocol (a controller session still works after scrapes), open
//! on loopback, and off loopback only to a request bearing the token derived
//! from the replica's session key; `/healthz` (the kubelet's probes) is
//! open and says only `ok`.

mod common;

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use lockstep_controller::ReplicaAddrs;
use lockstep_orchestrator::process::{ProcessOrchestrator, ProcessOrchestratorConfig};
use lockstep_orchestrator::{Orchestrator, ServiceConfig};
use lockstep_protocol::CommandHistory;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use common::{controller, test_session_key, TestReplica};

const BINARY: &str = env!("CARGO_BIN_EXE_lockstep-replica");

/// This machine's address on its default route (no packet is sent).
fn routed_address() -> IpAddr {
    let s = std::net::UdpSocket::bind("0.0.0.0:0").expect("bind a UDP socket");
    s.connect("192.0.2.1:9")
        .or_else(|_| s.connect("8.8.8.8:53"))
        .expect("this test needs a non-loopback address (a default route)");
    let ip = s.local_addr().unwrap().ip();
    assert!(!ip.is_loopback(), "the routed address {ip} is loopback");
    ip
}

/// Sends a `GET /metrics` (with `authorization`, if any) to `addr` and
/// reads the whole answer.
async fn get(addr: SocketAddr, authorization: Option<&str>) -> String {
    get_path(addr, "/metrics", authorization).await
}

/// Sends `GET PATH` (with `authorization`, if any) and reads the answer.
async fn get_path(addr: SocketAddr, path: &str, authorization: Option<&str>) -> String {
    let mut sock = tokio::net::TcpStream::connect(addr).await.unwrap();
    let auth = authorization
        .map(|a| format!("Authorization: {a}\r\n"))
        .unwrap_or_default();
    sock.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\n{auth}\r\n").as_bytes())
        .await
        .unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), sock.read_to_end(&mut out))
        .await
        .expect("answered and closed within 10 s")
        .unwrap();
    String::from_utf8_lossy(&out).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_are_served_on_the_controller_port_and_off_loopback_need_the_token() {
    let routed = routed_address();
    let dir = tempfile::tempdir().unwrap();
    let orchestrator =
        ProcessOrchestrator::new(ProcessOrchestratorConfig::new(dir.path(), 1)).unwrap();
    let key = test_session_key(43);
    let service = ServiceConfig::new("replica-43", 43, BINARY)
        .scale(1)
        .port("timely")
        .port("controller")
        .args(|a| {
            vec![
                "--replica-id=43".to_string(),
                "--process=0".to_string(),
                "--processes=1".to_string(),
                "--workers=1".to_string(),
                "--listen-host=0.0.0.0".to_string(),
                format!("--timely-port={}", a.port("timely")),
                format!("--controller-port={}", a.port("controller")),
                format!("--peers=127.0.0.1:{}", a.port("timely")),
            ]
        });
    let status = orchestrator
        .ensure_service(lockstep_launch::with_session_key(service, &key))
        .await
        .unwrap();
    let port = status.processes[0].addresses["controller"].port();
    let r = TestReplica {
        dir,
        orchestrator,
        status,
        addrs: ReplicaAddrs {
            replica_id: 43,
            processes: vec![SocketAddr::from(([127, 0, 0, 1], port)).into()],
            workers_per_process: 1,
            command_log: None,
            session_key: Some(key.clone()),
            one_way_proof: false,
            max_frame_len: lockstep_protocol::DEFAULT_MAX_FRAME_LEN,
        },
    };
    // A session first: the process is up and its port answers the protocol.
    let c = controller(&r, 1, CommandHistory::new());
    c.statuses()
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", common::logs(&r, 20)));

    let loopback = get(SocketAddr::from(([127, 0, 0, 1], port)), None).await;
    assert!(loopback.starts_with("HTTP/1.1 200"), "{loopback}");
    assert!(
        loopback.contains("lockstep_replica_sessions_total 1"),
        "{loopback}"
    );
    assert!(loopback.contains("lockstep_replica_commands_applied_total{kind=\"hello\""));

    let off = SocketAddr::new(routed, port);
    let bare = get(off, None).await;
    assert!(bare.starts_with("HTTP/1.1 401"), "{bare}");
    assert!(!bare.contains("lockstep_replica"), "{bare}");
    let wrong = get(off, Some(&format!("Bearer {}", key.to_hex()))).await;
    assert!(
        wrong.starts_with("HTTP/1.1 401"),
        "the session key itself is not the metrics token: {wrong}"
    );
    let right = get(off, Some(&format!("Bearer {}", key.metrics_token()))).await;
    assert!(right.starts_with("HTTP/1.1 200"), "{right}");
    assert!(right.contains("lockstep_replica_build_info"), "{right}");
    // The kubelet's probe: /healthz off loopback with no token says only ok.
    let health = get_path(off, "/healthz", None).await;
    assert!(health.starts_with("HTTP/1.1 200"), "{health}");
    assert!(
        health.ends_with("ok\n") && !health.contains("lockstep_replica"),
        "{health}"
    );

    // The scrapes took nothing from the protocol: the session still answers.
    c.statuses()
        .await
        .unwrap_or_else(|e| panic!("after the scrapes: {e}\n{}", common::logs(&r, 20)));
}
