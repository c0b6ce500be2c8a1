//! Graceful shutdown of a real `lockstep serve`: on SIGTERM its health turns
//! NOT_SERVING at once, new connections are refused, a call in flight is
//! still answered, the process exits 0, and its replica processes keep
//! running for the next environment to adopt.

use std::path::Path;
use std::time::{Duration, Instant};

use lockstep_chaos::environment::{cli, EnvProcess, Sandbox};
use lockstep_environment::proto;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

fn bin() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_lockstep"))
}

/// Every bounded wait of this test.
const WAIT: Duration = Duration::from_secs(30);

/// Polls `check` every 10 ms until it holds; panics with `what` after [`WAIT`].
async fn wait_until(what: &str, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !check() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Whether process `pid` exists and is not a zombie.
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        let state = stat
            .rfind(')')
            .and_then(|i| stat[i + 1..].split_whitespace().next());
        !matches!(state, Some("Z") | Some("X") | None)
    })
}

/// The PIDs of replica `name`'s processes, as the API of `env` lists them
/// (called with the token `lockstep serve` made in its state directory).
async fn pids(env: &EnvProcess, name: &str) -> Vec<u32> {
    let mut client = env.client().await.unwrap();
    let replicas = client
        .list_replicas(proto::ListReplicasRequest::default())
        .await
        .unwrap()
        .into_inner()
        .replicas;
    replicas
        .iter()
        .filter(|r| r.name == name)
        .flat_map(|r| r.process_status.iter().map(|p| p.pid))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_in_flight_calls_exits_0_and_leaves_replicas_to_be_adopted() {
    let barrier = lockstep_policy_host::shipped_policy("barrier");
    assert!(
        barrier.is_file(),
        "{} is missing: run `cargo xtask build-policies` first (`cargo xtask test` does)",
        barrier.display()
    );
    let sandbox = Sandbox::new().unwrap();
    let mut env = EnvProcess::start_with_env(
        bin(),
        sandbox.path(),
        "id-watermark",
        None,
        &[
            "--shutdown-grace-secs",
            "20",
            "--metrics-listen",
            "127.0.0.1:0",
        ],
        // The debug log says when a call has arrived.
        &[(
            "LOCKSTEP_LOG".to_string(),
            "info,lockstep_environment=debug".into(),
        )],
    )
    .await
    .unwrap();
    let url = env.url.clone();

    // A replica (its processes are `sleep 300`).
    let o = cli(bin(), &url, &["create", "r1", "--processes", "2"])
        .await
        .unwrap();
    assert!(o.status.success(), "{o:?}");
    let before = pids(&env, "r1").await;
    assert_eq!(before.len(), 2, "{before:?}");
    assert!(before.iter().all(|p| *p != 0 && alive(*p)), "{before:?}");

    // A health watch of the whole server, SERVING to begin with (health
    // asks no token).
    let channel = tonic::transport::Endpoint::from_shared(url.clone())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = HealthClient::new(channel);
    let mut watch = health
        .watch(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    let first = tokio::time::timeout(WAIT, watch.message())
        .await
        .expect("a first health status")
        .unwrap()
        .unwrap();
    assert_eq!(first.status(), ServingStatus::Serving);
    // The metrics endpoint's /healthz (the Deployment's probes: plain HTTP,
    // whatever the API speaks) says the same, to anyone.
    let metrics: std::net::SocketAddr = env
        .serving_line
        .split("metrics on http://")
        .nth(1)
        .and_then(|r| r.split('/').next())
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| panic!("no metrics address in {:?}", env.serving_line));
    let healthz = || lockstep_metrics_http::fetch_path(metrics, "/healthz", None, WAIT);
    assert_eq!(healthz().await.as_deref(), Ok("ok\n"));

    // A slow call (SetPolicy runs the policy's conformance check), in
    // flight: the server logged its arrival before the signal.
    let mut client = env.client().await.unwrap();
    let wasm = std::fs::read(&barrier).unwrap();
    let call = tokio::spawn(async move {
        let answer = client
            .set_policy(proto::SetPolicyRequest {
                name: "barrier".to_string(),
                wasm,
                replica: String::new(),
            })
            .await;
        (answer, Instant::now())
    });
    let stderr_path = env.stderr_path.clone();
    wait_until("the server to log the SetPolicy call", || {
        std::fs::read_to_string(&stderr_path).is_ok_and(|t| {
            t.lines()
                .any(|l| l.contains("API call received") && l.contains("/SetPolicy"))
        })
    })
    .await;

    let pid = env.pid().expect("running");
    let signalled = Instant::now();
    let status = std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .unwrap();
    assert!(status.success());

    // Health turns NOT_SERVING at once, on the watch already open.
    let next = tokio::time::timeout(WAIT, watch.message())
        .await
        .expect("a health status after SIGTERM")
        .expect("the watch still streams")
        .expect("a status, not the end of the stream");
    assert_eq!(next.status(), ServingStatus::NotServing);
    // And so does /healthz, while the call in flight keeps the process up.
    let said = healthz().await;
    assert!(
        said.as_ref().is_err_and(|e| e.contains("503")),
        "/healthz after SIGTERM: {said:?}"
    );
    drop(watch);
    drop(health);

    // A new connection is refused (the listener is closed).
    let addr = url.strip_prefix("http://").unwrap().to_string();
    let deadline = Instant::now() + WAIT;
    loop {
        match tokio::net::TcpStream::connect(&addr).await {
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => break,
            // A connection caught as the listener closed.
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
            Err(e) => panic!("{e}"),
            Ok(_) => {
                assert!(
                    Instant::now() < deadline,
                    "{addr} still accepts connections"
                );
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }

    // The call in flight is answered, within the grace period.
    let (answer, answered) = tokio::time::timeout(WAIT, call)
        .await
        .expect("the call in flight was answered")
        .unwrap();
    let policy = answer
        .expect("the call in flight succeeds")
        .into_inner()
        .policy
        .expect("the policy in force");
    assert_eq!(
        (policy.kind.as_str(), policy.name.as_str()),
        ("distribution", "barrier")
    );
    eprintln!(
        "SetPolicy answered {:?} after SIGTERM",
        answered.saturating_duration_since(signalled)
    );

    // Exit 0, well within the grace period (nothing else was open).
    let (status, stderr) = env.wait_exit().await.unwrap();
    assert_eq!(status.code(), Some(0), "{stderr}");
    assert!(
        stderr.contains("SIGTERM: shutting down gracefully"),
        "{stderr}"
    );
    assert!(
        signalled.elapsed() < Duration::from_secs(20),
        "exited only after the grace period: {:?}",
        signalled.elapsed()
    );

    // The replica's processes run on, and the next environment adopts them.
    assert!(before.iter().all(|p| alive(*p)), "a replica process died");
    let next_env = EnvProcess::start(bin(), sandbox.path(), "id-watermark", None, &[])
        .await
        .unwrap();
    assert_eq!(
        next_env.token, env.token,
        "the API token made in the state directory is kept across restarts"
    );
    assert_eq!(pids(&next_env, "r1").await, before, "adopted, not replaced");
    let o = cli(bin(), &next_env.url, &["list"]).await.unwrap();
    assert!(String::from_utf8_lossy(&o.stdout).contains("r1"), "{o:?}");
}
