//! Helpers of the environment tests that run real replica processes.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use tokio::io::AsyncBufReadExt;

use lockstep_environment::{Environment, EnvironmentConfig, ServiceTemplate};
use lockstep_orchestrator::ServiceStatus;
use lockstep_plan::reference::Multiset;
use lockstep_plan::text::parse_plan;
use lockstep_protocol::Update;

pub fn replica_binary() -> PathBuf {
    let path = std::env::var_os("LOCKSTEP_REPLICA_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_BIN_EXE_lockstep")).with_file_name("lockstep-replica")
        });
    assert!(
        path.is_file(),
        "{} is missing: build it first with `cargo build -p lockstep-replica` \
         (`cargo test --workspace` and `cargo xtask test` do), or set LOCKSTEP_REPLICA_BIN",
        path.display()
    );
    path
}

/// The replica binary of the example family beside `lockstep`
/// (`examples/reachability`, built by `cargo test --workspace`).
pub fn reachability_binary() -> PathBuf {
    let path =
        Path::new(env!("CARGO_BIN_EXE_lockstep")).with_file_name("lockstep-replica-reachability");
    assert!(
        path.is_file(),
        "{} is missing: build it first with `cargo build -p lockstep-example-reachability` \
         (`cargo test --workspace` and `cargo xtask test` do)",
        path.display()
    );
    path
}

/// Starts `lockstep serve` on `state` (which must be private, 0700: a
/// `tempfile` directory or a [`lockstep_chaos::environment::Sandbox`]) with
/// replica program `replica` and `extra` arguments (its stderr in
/// `state/serve.stderr`); the child (killed on drop) and the API's URL, once
/// it printed it (within 90 s). Unless `extra` says otherwise, every API
/// call must then carry the token it made in `state` ([`api_token`],
/// [`client`]; the CLI finds it with `--state-dir` or `LOCKSTEP_STATE_DIR`).
pub async fn serve(
    state: &Path,
    replica: &Path,
    extra: &[&str],
) -> (tokio::process::Child, String) {
    use tokio::io::AsyncBufReadExt;
    let stderr = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(state.join("serve.stderr"))
        .unwrap();
    let mut serve = tokio::process::Command::new(env!("CARGO_BIN_EXE_lockstep"))
        .args(["serve", "--listen", "127.0.0.1:0"])
        .args(extra)
        .arg("--state-dir")
        .arg(state)
        .arg("--service-binary")
        .arg(replica)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(stderr)
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = tokio::io::BufReader::new(serve.stdout.take().unwrap()).lines();
    let line = tokio::time::timeout(Duration::from_secs(90), lines.next_line())
        .await
        .expect("lockstep serve served in time")
        .unwrap()
        .expect("a serving line");
    let addr = line
        .strip_prefix("lockstep: serving on ")
        .and_then(|r| r.split_whitespace().next())
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"));
    let url = format!("http://{addr}");
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    (serve, url)
}

/// The API token `lockstep serve` made in its state directory `state`
/// (`api.token`, written before it printed its serving line).
pub fn api_token(state: &Path) -> String {
    let file = state.join("api.token");
    let text = std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
    text.lines().next().unwrap_or("").trim().to_string()
}

/// Adds `authorization: Bearer TOKEN` to every call.
#[derive(Clone)]
pub struct Bearer(tonic::metadata::MetadataValue<tonic::metadata::Ascii>);

impl tonic::service::Interceptor for Bearer {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        req.metadata_mut().insert("authorization", self.0.clone());
        Ok(req)
    }
}

/// A client of the API of a `lockstep serve`, sending its token.
pub type Client = lockstep_environment::proto::environment_client::EnvironmentClient<
    tonic::service::interceptor::InterceptedService<tonic::transport::Channel, Bearer>,
>;

/// A client of the `lockstep serve` at `url` on state directory `state`,
/// sending the token it made there; each call bounded by `timeout`.
pub async fn client(url: &str, state: &Path, timeout: Duration) -> Client {
    let channel = tonic::transport::Endpoint::from_shared(url.to_string())
        .unwrap()
        .connect_timeout(Duration::from_secs(5))
        .timeout(timeout)
        .connect()
        .await
        .unwrap();
    let bearer = Bearer(format!("Bearer {}", api_token(state)).parse().unwrap());
    lockstep_environment::proto::environment_client::EnvironmentClient::with_interceptor(
        channel, bearer,
    )
}

pub fn load_with(state_dir: &Path, distribution_policy: Option<PathBuf>) -> Environment {
    Environment::load(config(state_dir, distribution_policy)).unwrap()
}

/// The configuration the tests start environments with.
pub fn config(state_dir: &Path, distribution_policy: Option<PathBuf>) -> EnvironmentConfig {
    EnvironmentConfig {
        distribution_policy,
        ..EnvironmentConfig::new(
            state_dir,
            lockstep_policy::native_orphan_rule("id-watermark").unwrap(),
            ServiceTemplate::new(&replica_binary()),
        )
    }
}

/// The start-up steps of `lockstep serve` with `config`, without serving.
pub async fn start_config(config: EnvironmentConfig) -> Environment {
    let env = Environment::load(config).unwrap();
    env.ensure_replicas().await.unwrap();
    env.remove_orphans().await.unwrap();
    env.start_compute().await.unwrap();
    env
}

/// The start-up steps of `lockstep serve`, without serving.
pub async fn start(state_dir: &Path) -> Environment {
    start_with(state_dir, None).await
}

/// [`start`] with a WASM distribution policy.
pub async fn start_with(state_dir: &Path, distribution_policy: Option<PathBuf>) -> Environment {
    start_config(config(state_dir, distribution_policy)).await
}

pub fn u(row: &[i64], time: u64, diff: i64) -> Update {
    Update {
        row: lockstep_plan::row(row),
        time,
        diff,
    }
}

pub async fn service(env: &Environment) -> ServiceStatus {
    let mut services = env.orchestrator().list_services().await.unwrap();
    assert_eq!(services.len(), 1, "{services:?}");
    services.remove(0)
}

/// Creates the dataflow both tests peek: a reduce over input 1, exported as
/// collection 101 on replica `r1`; returns its plan.
pub async fn create_reduce(env: &Environment) -> lockstep_plan::Plan {
    let plan = parse_plan("reduce(get(1), [#0], count, sum(#1))").unwrap();
    env.create_dataflow(
        "r1",
        "reduce",
        0,
        vec![1],
        vec![lockstep_plan::export(101, &plan)],
    )
    .await
    .unwrap();
    plan
}

pub fn pids(s: &ServiceStatus) -> Vec<Option<u32>> {
    s.processes.iter().map(|p| p.pid).collect()
}

/// The state letter of `/proc/PID/stat` (`T`: stopped), if the process exists.
pub fn proc_state(pid: u32) -> Option<char> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    s[s.rfind(')')? + 2..].chars().next()
}

/// One variable of a process's environment.
pub fn environ(pid: u32, key: &str) -> Option<String> {
    let bytes = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    bytes.split(|b| *b == 0).find_map(|kv| {
        let kv = String::from_utf8_lossy(kv);
        kv.strip_prefix(&format!("{key}=")).map(|v| v.to_string())
    })
}

/// Peeks until the answer is `expected`, each attempt bounded, up to `bound`;
/// returns the last answer or error otherwise.
pub async fn peek_until(
    env: &Environment,
    collection: u64,
    at: u64,
    expected: &Multiset,
    bound: Duration,
) -> Result<Duration, String> {
    let started = Instant::now();
    let mut last = String::from("no answer yet");
    while started.elapsed() < bound {
        match tokio::time::timeout(Duration::from_secs(5), env.peek("r1", collection, at)).await {
            Ok(Ok(rows)) => {
                let got: Multiset = rows.into_iter().collect();
                if &got == expected {
                    return Ok(started.elapsed());
                }
                last = format!("wrong answer {got:?}");
            }
            Ok(Err(e)) => last = e.to_string(),
            Err(_) => last = "the peek did not answer within 5 s".to_string(),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Err(last)
}

/// A replica shape with no configuration.
pub fn shape(processes: u32, workers_per_process: u32) -> lockstep_catalog::ReplicaConfig {
    lockstep_catalog::ReplicaConfig {
        processes,
        workers_per_process,
        config: String::new(),
    }
}

/// Creates a dataflow on replica `r1` exporting input 1 as it is, as
/// `collection_id`; returns its description.
pub async fn create_identity(
    env: &Environment,
    collection_id: u64,
) -> lockstep_protocol::DataflowDescription {
    try_create_identity(env, collection_id).await.unwrap()
}

/// [`create_identity`], returning what the environment answers.
pub async fn try_create_identity(
    env: &Environment,
    collection_id: u64,
) -> Result<lockstep_protocol::DataflowDescription, lockstep_environment::compute::ComputeError> {
    env.create_dataflow(
        "r1",
        "identity",
        0,
        vec![1],
        vec![lockstep_plan::export(
            collection_id,
            &parse_plan("get(1)").unwrap(),
        )],
    )
    .await
}

/// The shipped policy `name` (`target/lockstep/policies/NAME.wasm`), which
/// must have been built.
pub fn built_policy(name: &str) -> PathBuf {
    let policy = lockstep_policy_host::shipped_policy(name);
    require_built(&[&policy]);
    policy
}

/// Fails the test, saying how to build them, unless every policy file in
/// `paths` exists.
pub fn require_built(paths: &[&Path]) {
    for p in paths {
        assert!(
            p.is_file(),
            "{} is missing: run `cargo xtask build-policies` first (`cargo xtask test` does)",
            p.display()
        );
    }
}

/// The plan of `desc`'s first export (a dataflow of the built-in family).
pub fn first_plan(desc: &lockstep_protocol::DataflowDescription) -> lockstep_plan::Plan {
    let export = &desc.exports[0];
    lockstep_plan::decode(export.collection_id, &export.description).expect("a built-in plan")
}

/// Every bounded wait of [`serve_on`] and [`cli_ok`].
pub const SERVE_WAIT: Duration = Duration::from_secs(90);

/// A loopback port free now and the API URL on it, for [`serve_on`] (a
/// restarted `lockstep serve` takes the same port, so clients keep their
/// URL).
pub fn free_port_url() -> (u16, String) {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    (port, format!("http://127.0.0.1:{port}"))
}

/// `lockstep serve` on `state` listening on `port` (give the same one to a
/// restarted environment for clients to find it again), with `policy`,
/// running [`replica_binary`]; waits (bounded) until it serves.
pub async fn serve_on(state: &Path, port: u16, policy: &Path) -> tokio::process::Child {
    serve_on_with(state, port, policy, &[]).await
}

/// [`serve_on`] with `extra` arguments to `lockstep serve`.
pub async fn serve_on_with(
    state: &Path,
    port: u16,
    policy: &Path,
    extra: &[&str],
) -> tokio::process::Child {
    let stderr = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(state.join("serve.stderr"))
        .unwrap();
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_lockstep"))
        .args(["serve", "--listen", &format!("127.0.0.1:{port}")])
        .arg("--distribution-policy")
        .arg(policy)
        .arg("--state-dir")
        .arg(state)
        .arg("--service-binary")
        .arg(replica_binary())
        .args(extra)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(stderr)
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let line = tokio::time::timeout(SERVE_WAIT, lines.next_line())
        .await
        .expect("lockstep serve served in time")
        .unwrap()
        .unwrap_or_else(|| {
            panic!(
                "no serving line: {}",
                std::fs::read_to_string(state.join("serve.stderr")).unwrap_or_default()
            )
        });
    assert!(line.starts_with("lockstep: serving on "), "{line}");
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    child
}

/// `lockstep ARGS --server URL` with `state` as `LOCKSTEP_STATE_DIR` (the
/// token), which must succeed (bounded); its stdout.
pub async fn cli_ok(state: &Path, url: &str, args: &[&str]) -> String {
    let out = tokio::time::timeout(
        SERVE_WAIT,
        tokio::process::Command::new(env!("CARGO_BIN_EXE_lockstep"))
            .args(args)
            .args(["--server", url])
            .env("LOCKSTEP_STATE_DIR", state)
            .stdin(Stdio::null())
            .output(),
    )
    .await
    .expect("the CLI finished in time")
    .unwrap();
    assert!(
        out.status.success(),
        "lockstep {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Writes `update` (`ROW@TIME`, as `lockstep input write --update` takes it)
/// to input 1 of replica r with the new upper `upper`, through the CLI.
pub async fn write_to_r(state: &Path, url: &str, update: &str, upper: u64) {
    let upper = upper.to_string();
    let args = [
        "input",
        "write",
        "--replica",
        "r",
        "--collection",
        "1",
        "--upper",
        &upper,
        "--update",
        update,
    ];
    cli_ok(state, url, &args).await;
}

/// The PIDs of the processes of the first replica `lockstep replica list`
/// shows (replica r of the tests that have one).
pub async fn pids_of_r(state: &Path, url: &str) -> Vec<u64> {
    let v: serde_json::Value =
        serde_json::from_str(&cli_ok(state, url, &["replica", "list", "-o", "json"]).await)
            .unwrap();
    v["replicas"][0]["process_status"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["pid"].as_u64().unwrap())
        .collect()
}

/// Writes rows `(i, i % groups)` for `i` in `0..rows` to input 1 of
/// replica r at time 0 (upper 1) through `api`.
pub async fn write_grouped_to_r(
    api: &mut lockstep_chaos::environment::Client,
    rows: i64,
    groups: i64,
) {
    let updates = (0..rows).map(|i| {
        lockstep_protocol::proto::Update::from(lockstep_protocol::Update {
            row: lockstep_plan::rows::encode(&[i, i % groups]),
            time: 0,
            diff: 1,
        })
    });
    api.write_input(lockstep_environment::proto::WriteInputRequest {
        replica: "r".into(),
        collection_id: 1,
        updates: updates.collect(),
        upper: 1,
    })
    .await
    .unwrap();
}

/// Replica r's ID and shape (processes, workers) as `replica list -o json`
/// shows it (r must be the only replica).
pub async fn listed_r(state: &Path, url: &str) -> (u64, (u64, u64)) {
    let v: serde_json::Value =
        serde_json::from_str(&cli_ok(state, url, &["replica", "list", "-o", "json"]).await)
            .unwrap();
    let r = &v["replicas"][0];
    (
        r["id"].as_u64().unwrap(),
        (
            r["processes"].as_u64().unwrap(),
            r["workers_per_process"].as_u64().unwrap(),
        ),
    )
}

/// Creates replica r (`--processes P --workers W`, waiting until it
/// serves) and on it a dataflow reading input 1 and exporting
/// `101=EXPORT`, through the CLI.
pub async fn replica_r_with(state: &Path, url: &str, processes: u32, workers: u32, export: &str) {
    let (processes, workers) = (processes.to_string(), workers.to_string());
    let create = [
        "replica",
        "create",
        "r",
        "--processes",
        &processes,
        "--workers",
        &workers,
        "--wait",
    ];
    cli_ok(state, url, &create).await;
    let export = format!("101={export}");
    let dataflow = [
        "dataflow",
        "create",
        "--replica",
        "r",
        "--input",
        "1",
        "--export",
        &export,
    ];
    cli_ok(state, url, &dataflow).await;
}

/// `lockstep subscribe --replica r --collection 101 ARGS` against `url`,
/// and its stdout as lines.
pub fn subscribe_r(
    state: &Path,
    url: &str,
    args: &[&str],
) -> (tokio::process::Child, SubscriberLines) {
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_lockstep"))
        .args(["subscribe", "--replica", "r", "--collection", "101"])
        .args(args)
        .args(["--server", url])
        .env("LOCKSTEP_STATE_DIR", state)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    (child, lines)
}

/// A subscriber's stdout, as lines.
pub type SubscriberLines = tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>;

/// Reads a subscriber's `time<TAB>row<TAB>diff` lines until one at time `t`
/// or later arrived (within [`SERVE_WAIT`]), counting every line in `seen`.
pub async fn read_until(
    lines: &mut SubscriberLines,
    seen: &mut std::collections::BTreeMap<String, usize>,
    t: u64,
) {
    let deadline = Instant::now() + SERVE_WAIT;
    loop {
        let line = tokio::time::timeout_at(deadline.into(), lines.next_line())
            .await
            .unwrap_or_else(|_| {
                panic!("no change at time {t} within {SERVE_WAIT:?}; seen {seen:?}")
            })
            .unwrap()
            .unwrap_or_else(|| panic!("the subscriber ended; seen {seen:?}"));
        let at: u64 = line.split('\t').next().unwrap().parse().unwrap();
        *seen.entry(line).or_insert(0) += 1;
        if at >= t {
            return;
        }
    }
}

/// After a subscriber ended: counts the rest of its lines in `seen`, and
/// returns its stderr.
pub async fn rest_of(
    subscriber: &mut tokio::process::Child,
    lines: &mut SubscriberLines,
    seen: &mut std::collections::BTreeMap<String, usize>,
) -> String {
    use tokio::io::AsyncReadExt;
    while let Some(line) = lines.next_line().await.unwrap() {
        *seen.entry(line).or_insert(0) += 1;
    }
    let mut err = String::new();
    subscriber
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .await
        .unwrap();
    err
}
