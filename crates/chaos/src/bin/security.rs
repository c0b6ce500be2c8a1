//! The security suite (`cargo xtask chaos security`): attacks on real
//! replica processes and a real environment, each checked against S1 (only
//! the environment may drive a replica).
//!
//! Variants: `authenticated` (replicas with a session key, the API with the
//! token `lockstep serve` makes in its state directory: what it runs by
//! default) must pass every scenario; `open` (no session key, and
//! `--insecure-loopback`: no API or metrics token) is the negative control
//! and must be caught. `no-mutual` gives the API its token by
//! `--api-token-file`.
//! Each scenario ends as a pass, a violation of S1, or a harness error
//! (which fails the run and never catches the negative control).
//!
//! Scenarios: a forged Hello with epoch 2^64-1; a replayed Hello; a Hello
//! for another replica; a spoofed timely mesh peer; idle connections while
//! the mesh forms; a 1 GiB length prefix; a 60 MiB frame before any Hello; a
//! flood of connections; an API call without a token (on loopback: the
//! default asks one there too), with a wrong one, and with the read-only
//! metrics token; an oversized replica shape; an oversized plan; and
//! (`attacks`) an impostor
//! on a freed controller port, a frame injected into a proven session,
//! unproven-connection floods during a reconnect, slow handshakes, mesh
//! connection floods and trickles, a log flood, a keyless peer, keys at rest
//! and in child processes, a state directory others can enter, /metrics
//! without its token (on and off loopback), a process lying about worker
//! indices, and a flood of peek parts. The second
//! negative control, `no-mutual` (the session key proved by the Hello alone,
//! plain frames after it), must be caught by the impostor or the injection.

use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::time::Duration;

use futures::{SinkExt, StreamExt};
use lockstep_chaos::environment::EnvProcess;
use lockstep_chaos::outcome::{violation, Failure, Tally};
use lockstep_controller::{Controller, ReplicaAddrs, Timeouts};
use lockstep_environment::proto;
use lockstep_environment::proto::environment_client::EnvironmentClient;
use lockstep_orchestrator::process::rss_mib;
use lockstep_orchestrator::process::{
    kill_all_services, ProcessOrchestrator, ProcessOrchestratorConfig,
};
use lockstep_orchestrator::Orchestrator;
use lockstep_plan::Plan;
use lockstep_policy::FixedStrategy;
use lockstep_protocol::{
    Command, CommandHistory, CommandKind, DataflowDescription, ResponseKind, SessionKey, Strategy,
    Update,
};
use lockstep_transport::ControllerCodec;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_util::codec::Framed;

const SUITE: &str = "security";
const MASTER: [u8; 32] = [0x5c; 32];
const TOKEN: &str = "security-suite-api-token";

#[path = "security/attacks.rs"]
mod attacks;
#[path = "security/scenarios.rs"]
mod scenarios;

use scenarios::{scenario, MUTUAL_SCENARIOS, SCENARIOS};

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Variant {
    Authenticated,
    Open,
    NoMutual,
}

impl Variant {
    fn name(self) -> &'static str {
        match self {
            Variant::Authenticated => "authenticated",
            Variant::Open => "open",
            Variant::NoMutual => "no-mutual",
        }
    }

    fn key(self, replica_id: u64) -> Option<SessionKey> {
        (self != Variant::Open).then(|| SessionKey::derive(&MASTER, replica_id))
    }

    /// The negative controls: `open` (no key, no token) and `no-mutual`
    /// (the key proved by the Hello alone, plain frames after it).
    fn negative(self) -> bool {
        self != Variant::Authenticated
    }
}

fn target_debug() -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(Path::to_path_buf))
        .unwrap_or_else(|| PathBuf::from("target/debug"))
}

fn replica_binary() -> PathBuf {
    target_debug().join("lockstep-replica")
}

fn lockstep_binary() -> PathBuf {
    target_debug().join("lockstep")
}

/// A replica started through the process orchestrator; killed on drop.
struct Replica {
    dir: tempfile::TempDir,
    orchestrator: ProcessOrchestrator,
    addrs: ReplicaAddrs,
}

impl Drop for Replica {
    fn drop(&mut self) {
        let _ = kill_all_services(self.dir.path());
    }
}

async fn start_replica(id: u64, processes: usize, v: Variant) -> Result<Replica, String> {
    start_replica_logging(id, processes, v, "error").await
}

async fn start_replica_logging(
    id: u64,
    processes: usize,
    v: Variant,
    rust_log: &str,
) -> Result<Replica, String> {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let orchestrator = ProcessOrchestrator::new(ProcessOrchestratorConfig::new(dir.path(), 1))
        .map_err(|e| e.to_string())?;
    let mut config = lockstep_launch::replica_service(&replica_binary(), id, processes, 1)
        .env("RUST_LOG", rust_log);
    if let Some(key) = v.key(id) {
        config = lockstep_launch::with_session_key(config, &key);
    }
    if v == Variant::NoMutual {
        config = config.env("LOCKSTEP_INSECURE_ONE_WAY_PROOF", "true");
    }
    let status = orchestrator
        .ensure_service(config)
        .await
        .map_err(|e| e.to_string())?;
    let mut addrs = lockstep_launch::replica_addrs(&status, 1).map_err(|e| e.to_string())?;
    addrs.session_key = v.key(id);
    addrs.one_way_proof = v == Variant::NoMutual;
    Ok(Replica {
        dir,
        orchestrator,
        addrs,
    })
}

fn timeouts() -> Timeouts {
    Timeouts {
        connect: Duration::from_secs(10),
        heartbeat_interval: Duration::from_millis(100),
        heartbeat_timeout: Duration::from_secs(2),
        request: Duration::from_secs(10),
    }
}

fn controller(addrs: &ReplicaAddrs) -> Controller {
    Controller::start(
        addrs.clone(),
        1,
        CommandHistory::new(),
        Box::new(FixedStrategy(Strategy::Barrier)),
        timeouts(),
    )
}

fn identity_dataflow() -> DataflowDescription {
    lockstep_plan::dataflow(
        1,
        0,
        vec![1],
        &[(101, Plan::Get { collection_id: 1 })],
        "identity",
    )
}

/// The controller drives the replica: a create (first time), a write at
/// `t` and a peek that answers every row written so far.
async fn drives(c: &Controller, t: u64) -> Result<(), String> {
    if t == 0 {
        c.create_dataflow(identity_dataflow())
            .map_err(|e| e.to_string())?;
    }
    c.write_input(
        1,
        vec![Update {
            row: lockstep_plan::row(&[t as i64]),
            time: t,
            diff: 1,
        }],
        t + 1,
    )
    .map_err(|e| e.to_string())?;
    let rows = c.peek(101, t).await.map_err(|e| e.to_string())?;
    let mut want: Vec<(Vec<u8>, i64)> = (0..=t)
        .map(|i| (lockstep_plan::row(&[i as i64]), 1))
        .collect();
    want.sort();
    let mut got = rows;
    got.sort();
    if got != want {
        return Err(format!("peek at {t} answered {got:?}, not {want:?}"));
    }
    Ok(())
}

/// Sends `bytes` on a fresh connection to `addr` and returns the first
/// response frame, if one comes within 5 s.
async fn first_answer(addr: SocketAddr, bytes: &[u8]) -> Option<lockstep_protocol::Response> {
    let mut sock = TcpStream::connect(addr).await.ok()?;
    let _ = sock.write_all(bytes).await;
    answer_on(sock).await
}

/// The first response frame on `sock`, if one comes within 5 s.
async fn answer_on(sock: TcpStream) -> Option<lockstep_protocol::Response> {
    let mut framed = Framed::new(sock, ControllerCodec::default());
    tokio::time::timeout(Duration::from_secs(5), framed.next())
        .await
        .ok()
        .flatten()
        .and_then(Result::ok)
}

/// A Hello as its first frame, sent to `addr`; the answer, if any.
async fn send_hello(
    addr: SocketAddr,
    hello: lockstep_protocol::Hello,
) -> Option<lockstep_protocol::Response> {
    let mut sock = Framed::new(
        TcpStream::connect(addr).await.ok()?,
        ControllerCodec::default(),
    );
    sock.send(Command {
        seqno: 0,
        strategy: Strategy::Barrier,
        kind: CommandKind::Hello(hello),
    })
    .await
    .ok()?;
    tokio::time::timeout(Duration::from_secs(5), sock.next())
        .await
        .ok()
        .flatten()
        .and_then(Result::ok)
}

fn is_error(r: &Option<lockstep_protocol::Response>) -> bool {
    matches!(
        r,
        Some(lockstep_protocol::Response {
            kind: ResponseKind::Error(_),
            ..
        })
    )
}

fn free_port() -> Result<u16, String> {
    Ok(TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| e.to_string())?
        .port())
}

/// A replica's processes started by hand, one at a time (to put an attacker
/// between them); killed on drop.
struct ManualReplica {
    children: Vec<std::process::Child>,
    timely: Vec<u16>,
    controller: Vec<u16>,
    id: u64,
    v: Variant,
}

impl ManualReplica {
    fn new(id: u64, v: Variant) -> Result<Self, String> {
        Self::with_processes(id, v, 2)
    }

    fn with_processes(id: u64, v: Variant, n: usize) -> Result<Self, String> {
        Ok(ManualReplica {
            children: Vec::new(),
            timely: (0..n).map(|_| free_port()).collect::<Result<_, _>>()?,
            controller: (0..n).map(|_| free_port()).collect::<Result<_, _>>()?,
            id,
            v,
        })
    }

    fn spawn(&mut self, process: usize) -> Result<(), String> {
        let peers = self
            .timely
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect::<Vec<_>>()
            .join(",");
        let mut cmd = std::process::Command::new(replica_binary());
        cmd.args([
            format!("--replica-id={}", self.id),
            format!("--process={process}"),
            format!("--processes={}", self.timely.len()),
            "--workers=1".into(),
            format!("--timely-port={}", self.timely[process]),
            format!("--controller-port={}", self.controller[process]),
            format!("--peers={peers}"),
            "--cluster-timeout-secs=20".into(),
        ])
        .env("RUST_LOG", "error")
        .env_remove(lockstep_protocol::SESSION_KEY_ENV)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
        if let Some(key) = self.v.key(self.id) {
            cmd.env(lockstep_protocol::SESSION_KEY_ENV, key.to_hex());
        }
        if self.v == Variant::NoMutual {
            cmd.env("LOCKSTEP_INSECURE_ONE_WAY_PROOF", "true");
        }
        self.children.push(cmd.spawn().map_err(|e| e.to_string())?);
        Ok(())
    }

    /// A replica whose process 0 runs and listens on its timely port, and
    /// a first connection to that port. The ports are picked free and
    /// released before the process binds them, so another program may take
    /// one meanwhile: process 0 then exits (it cannot bind), and the
    /// replica is set up again on fresh ports (at most 5 times) instead of
    /// the scenario failing for a port it never had.
    async fn first_listening(id: u64, v: Variant) -> Result<(Self, TcpStream), String> {
        let mut last = String::new();
        for _ in 0..5 {
            let mut m = Self::new(id, v)?;
            m.spawn(0)?;
            let addr: SocketAddr = format!("127.0.0.1:{}", m.timely[0])
                .parse()
                .map_err(|e| format!("{e}"))?;
            let child = &mut m.children[0];
            match dial_while(addr, || child.try_wait().ok().flatten()).await {
                Ok(s) => return Ok((m, s)),
                Err(Dialed::Gone(status)) => {
                    last = format!(
                        "process 0 exited ({status}) before it listened on {addr}: its port was taken meanwhile"
                    );
                }
                Err(Dialed::TimedOut(e)) => {
                    return Err(format!("{e} (process 0 runs but does not listen)"))
                }
            }
        }
        Err(last)
    }

    /// Kills process `i` (spawned `i`-th) and waits for it.
    fn kill(&mut self, i: usize) {
        if let Some(c) = self.children.get_mut(i) {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    fn addrs(&self) -> Result<ReplicaAddrs, String> {
        Ok(ReplicaAddrs {
            replica_id: self.id,
            processes: self
                .controller
                .iter()
                .map(|p| format!("127.0.0.1:{p}").parse().map_err(|e| format!("{e}")))
                .collect::<Result<_, _>>()?,
            workers_per_process: 1,
            command_log: None,
            session_key: self.v.key(self.id),
            one_way_proof: self.v == Variant::NoMutual,
            max_frame_len: lockstep_protocol::DEFAULT_MAX_FRAME_LEN,
        })
    }
}

impl Drop for ManualReplica {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Connects to `addr` until it listens (10 s).
/// A process's controller address: the process backend reports IP addresses.
fn ip_addr(endpoint: &lockstep_protocol::Endpoint) -> SocketAddr {
    endpoint
        .socket_addr()
        .expect("the process backend reports IP addresses")
}

async fn dial(addr: SocketAddr) -> Result<TcpStream, String> {
    dial_while(addr, || None::<std::convert::Infallible>)
        .await
        .map_err(|e| match e {
            Dialed::TimedOut(e) => e,
            Dialed::Gone(never) => match never {},
        })
}

/// Why [`dial_while`] gave up.
enum Dialed<G> {
    /// What `gone` said: nothing will ever listen.
    Gone(G),
    /// Nothing answered within 10 s.
    TimedOut(String),
}

/// Connects to `addr` until it answers, within 10 s, unless `gone` says
/// first that nothing will ever listen there (the listener's process
/// exited).
async fn dial_while<G>(
    addr: SocketAddr,
    mut gone: impl FnMut() -> Option<G>,
) -> Result<TcpStream, Dialed<G>> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(why) = gone() {
            return Err(Dialed::Gone(why));
        }
        match TcpStream::connect(addr).await {
            Ok(s) => return Ok(s),
            Err(e) if tokio::time::Instant::now() > deadline => {
                return Err(Dialed::TimedOut(format!("{addr}: {e}")))
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
        }
    }
}

/// The mesh header of process `index` of replica `id` (generation 0, what
/// processes started by hand have), with a zero nonce.
fn mesh_header(id: u64, index: u64) -> Vec<u8> {
    let mut h = Vec::with_capacity(48);
    h.extend_from_slice(&0x6c6f_636b_7374_6570u64.to_be_bytes());
    h.extend_from_slice(&id.to_be_bytes());
    h.extend_from_slice(&0u64.to_be_bytes());
    h.extend_from_slice(&index.to_be_bytes());
    h.extend_from_slice(&[0u8; 16]);
    h
}

/// An API client sending `token`, if any.
async fn api(
    url: &str,
    token: Option<&str>,
) -> Result<
    EnvironmentClient<
        tonic::service::interceptor::InterceptedService<
            tonic::transport::Channel,
            impl tonic::service::Interceptor,
        >,
    >,
    String,
> {
    let channel = tonic::transport::Endpoint::from_shared(url.to_string())
        .map_err(|e| e.to_string())?
        .connect()
        .await
        .map_err(|e| e.to_string())?;
    let header: Option<tonic::metadata::MetadataValue<_>> = match token {
        Some(t) => Some(format!("Bearer {t}").parse().map_err(|e| format!("{e}"))?),
        None => None,
    };
    Ok(EnvironmentClient::with_interceptor(
        channel,
        move |mut req: tonic::Request<()>| {
            if let Some(h) = &header {
                req.metadata_mut().insert("authorization", h.clone());
            }
            Ok(req)
        },
    ))
}

/// The read-only metrics token `lockstep serve` made in `state`.
fn metrics_token(state: &Path) -> Result<String, Failure> {
    let file = state.join("metrics.token");
    std::fs::read_to_string(&file)
        .map(|t| t.lines().next().unwrap_or("").trim().to_string())
        .map_err(|e| Failure::Harness(format!("{}: {e}", file.display())))
}

/// `lockstep serve` on a fresh private state directory (a `tempfile`
/// directory: 0700) with the variant's API posture: `authenticated` the
/// default (the token made in the state directory, on loopback too),
/// `no-mutual` [`TOKEN`] given by `--api-token-file`, `open`
/// `--insecure-loopback` (no token). Its token, if any, is the returned
/// [`EnvProcess::token`].
async fn start_env(v: Variant) -> Result<(EnvProcess, tempfile::TempDir), String> {
    start_env_with(v, &[]).await
}

/// [`start_env`] with `more` arguments.
async fn start_env_with(
    v: Variant,
    more: &[&str],
) -> Result<(EnvProcess, tempfile::TempDir), String> {
    let state = tempfile::tempdir().map_err(|e| e.to_string())?;
    let token = state.path().join("given.token");
    std::fs::write(&token, format!("{TOKEN}\n")).map_err(|e| e.to_string())?;
    let token = token.to_string_lossy().into_owned();
    let mut extra: Vec<&str> = match v {
        Variant::Authenticated => vec![],
        Variant::NoMutual => vec!["--api-token-file", &token],
        Variant::Open => vec!["--insecure-loopback"],
    };
    extra.extend(more);
    let env = EnvProcess::start(
        &lockstep_binary(),
        state.path(),
        "id-watermark",
        None,
        &extra,
    )
    .await
    .map_err(|e| format!("starting lockstep serve: {e:#}"))?;
    Ok((env, state))
}

fn main() {
    for bin in [replica_binary(), lockstep_binary()] {
        if !bin.exists() {
            eprintln!("lockstep-chaos-security: {} is missing: build it (cargo xtask chaos security does)", bin.display());
            std::process::exit(2);
        }
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let mut ok = true;
    let mut id = 100;
    for v in [Variant::Authenticated, Variant::Open, Variant::NoMutual] {
        let mut tally = Tally::default();
        let mut mutual_caught = false;
        for name in SCENARIOS {
            id += 1;
            let outcome = runtime.block_on(async {
                match tokio::time::timeout(Duration::from_secs(90), scenario(name, id, v)).await {
                    Ok(r) => r,
                    Err(_) => Err(Failure::Harness(format!("{name} did not end within 90 s"))),
                }
            });
            if MUTUAL_SCENARIOS.contains(&name) && matches!(outcome, Err(Failure::Violation { .. }))
            {
                mutual_caught = true;
            }
            let line = tally.record(&outcome);
            eprintln!("security: {} {name}: {line}", v.name());
        }
        let negative = v.negative();
        println!("{}", tally.summary_line(SUITE, v.name(), negative));
        ok &= tally.ok(negative);
        if v == Variant::NoMutual && !mutual_caught {
            eprintln!("security: no-mutual was not caught by the scenarios that need mutual proof ({MUTUAL_SCENARIOS:?})");
            ok = false;
        }
    }
    std::process::exit(if ok { 0 } else { 1 });
}
