//! The system under test: a real `lockstep serve` in its default posture
//! (the API token and the metrics token it makes in its state directory),
//! its API as a legitimate client sees it (a new connection per call, as
//! separate CLI invocations make), and the process tools the seed uses
//! (`prlimit`, `kill -9`).
//!
//! `lockstep_chaos::environment::EnvProcess` starts `lockstep serve` with
//! `sleep` services; this suite needs real replica processes, so it starts
//! the environment itself (as the campaign does), with `--metrics-listen`.

use super::*;

use lockstep_environment::proto::environment_client::EnvironmentClient;
use tokio::io::AsyncBufReadExt;

/// A client of the API, sending a bearer token (or none).
pub(crate) type Client = EnvironmentClient<
    tonic::service::interceptor::InterceptedService<tonic::transport::Channel, Bearer>,
>;

/// Adds `authorization: Bearer TOKEN` to every call, if there is a token.
#[derive(Clone)]
pub(crate) struct Bearer(Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>);

impl tonic::service::Interceptor for Bearer {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(v) = &self.0 {
            req.metadata_mut().insert("authorization", v.clone());
        }
        Ok(req)
    }
}

/// Where the binaries are: beside this one.
pub(crate) fn target_debug() -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(Path::to_path_buf))
        .unwrap_or_else(|| PathBuf::from("target/debug"))
}

/// `lockstep`.
pub(crate) fn lockstep_binary() -> PathBuf {
    target_debug().join("lockstep")
}

/// `lockstep-replica`, which `lockstep serve` runs from beside itself.
pub(crate) fn replica_binary() -> PathBuf {
    target_debug().join("lockstep-replica")
}

/// `target/lockstep/hostile`, beside `target/debug`: the environments' logs.
pub(crate) fn out_dir() -> PathBuf {
    target_debug()
        .parent()
        .map(|t| t.join("lockstep/hostile"))
        .unwrap_or_else(|| PathBuf::from("target/lockstep/hostile"))
}

/// The API as a token holder (or anyone) reaches it.
#[derive(Clone)]
pub(crate) struct Api {
    /// `http://127.0.0.1:PORT`.
    pub(crate) url: String,
    /// Its address.
    pub(crate) addr: SocketAddr,
    /// The token `lockstep serve` made in its state directory.
    pub(crate) token: String,
}

/// One process of the replica, as ListReplicas shows it.
#[derive(Clone, Debug)]
pub(crate) struct ProcessView {
    /// Its PID (0 if never started).
    pub(crate) pid: u32,
    /// Whether it runs.
    pub(crate) running: bool,
    /// Its controller address.
    pub(crate) controller: Option<SocketAddr>,
}

impl Api {
    /// A client on a new connection sending `token` (none: no header),
    /// connected within `bound`.
    pub(crate) async fn client_with(
        &self,
        token: Option<&str>,
        bound: Duration,
    ) -> Result<Client, String> {
        let header = token
            .map(|t| format!("Bearer {t}").parse())
            .transpose()
            .map_err(|e| format!("a token that is no header value: {e}"))?;
        let channel = tonic::transport::Endpoint::from_shared(self.url.clone())
            .map_err(|e| e.to_string())?
            .connect_timeout(bound);
        let channel = tokio::time::timeout(bound, channel.connect())
            .await
            .map_err(|_| format!("not connected within {:.1} s", bound.as_secs_f64()))?
            .map_err(|e| format!("connecting: {e}"))?;
        Ok(EnvironmentClient::with_interceptor(channel, Bearer(header)))
    }

    /// A token holder's client on a new connection.
    pub(crate) async fn client(&self, bound: Duration) -> Result<Client, String> {
        self.client_with(Some(&self.token), bound).await
    }

    /// The processes of the replica, on a new connection, within `bound`.
    pub(crate) async fn processes(&self, bound: Duration) -> Result<Vec<ProcessView>, String> {
        let call = async {
            let mut c = self.client(bound).await?;
            let replicas = c
                .list_replicas(proto::ListReplicasRequest::default())
                .await
                .map_err(|s| code(&s))?
                .into_inner()
                .replicas;
            let r = replicas
                .into_iter()
                .find(|r| r.name == REPLICA)
                .ok_or_else(|| format!("no replica {REPLICA} listed"))?;
            Ok::<_, String>(
                r.process_status
                    .into_iter()
                    .map(|p| ProcessView {
                        pid: p.pid,
                        running: p.running,
                        controller: p.addresses.get("controller").and_then(|a| a.parse().ok()),
                    })
                    .collect(),
            )
        };
        tokio::time::timeout(bound, call)
            .await
            .map_err(|_| format!("ListReplicas did not answer within {bound:?}"))?
    }
}

/// A running `lockstep serve`.
pub(crate) struct Env {
    child: tokio::process::Child,
    /// Its PID.
    pub(crate) pid: u32,
    /// Its API.
    pub(crate) api: Api,
    /// Its metrics endpoint.
    pub(crate) metrics: SocketAddr,
    /// The read-only metrics token it made in its state directory.
    pub(crate) metrics_token: String,
}

/// The first line of the token file `name` in `state`.
fn read_token(state: &Path, name: &str) -> Result<String, String> {
    let file = state.join(name);
    let text = std::fs::read_to_string(&file).map_err(|e| format!("{}: {e}", file.display()))?;
    Ok(text.lines().next().unwrap_or("").trim().to_string())
}

impl Env {
    /// Starts `lockstep serve` on the (0700) state directory `state`, in its
    /// default posture, with a metrics endpoint; its log goes to `log`.
    /// Under a negative control `variant`, with its switch set
    /// ([`NO_BOUNDS_ENV`], the orchestrator's released ports, or no owner
    /// checked).
    pub(crate) async fn start(state: &Path, log: &Path, variant: Variant) -> Result<Env, String> {
        let stderr = std::fs::File::create(log).map_err(|e| format!("{}: {e}", log.display()))?;
        let mut cmd = tokio::process::Command::new(lockstep_binary());
        cmd.args(["serve", "--listen", "127.0.0.1:0"])
            .args(["--metrics-listen", "127.0.0.1:0", "--state-dir"])
            .arg(state)
            .env(
                "LOCKSTEP_LOG",
                std::env::var("LOCKSTEP_HOSTILE_LOG").unwrap_or_else(|_| "warn".into()),
            )
            // Its own posture, whatever this process's environment holds.
            .env_remove("LOCKSTEP_API_TOKEN")
            .env_remove("LOCKSTEP_STATE_DIR")
            .env_remove("LOCKSTEP_STORE")
            .env_remove("FAILPOINTS")
            .env_remove(NO_BOUNDS_ENV)
            .env_remove(lockstep_environment::private::ANY_OWNER_ENV)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(stderr)
            .kill_on_drop(true);
        cmd.env_remove(lockstep_orchestrator::process::RELEASE_PORTS_ENV);
        match variant {
            Variant::Bounded => {}
            Variant::NoBounds => {
                cmd.env(NO_BOUNDS_ENV, "1");
            }
            Variant::ReleasedPorts => {
                cmd.env(lockstep_orchestrator::process::RELEASE_PORTS_ENV, "1");
            }
            Variant::UnownedState => {
                cmd.env(lockstep_environment::private::ANY_OWNER_ENV, "1");
            }
            // The CLI's switch, not the environment's.
            Variant::UnprovenServer => {}
        }
        let mut child = cmd
            .spawn()
            .map_err(|e| format!("starting {}: {e}", lockstep_binary().display()))?;
        let pid = child.id().ok_or("lockstep serve has no PID")?;
        let stdout = child.stdout.take().ok_or("no stdout")?;
        let mut lines = tokio::io::BufReader::new(stdout).lines();
        let line = match tokio::time::timeout(Duration::from_secs(30), lines.next_line()).await {
            Ok(Ok(Some(line))) => line,
            other => {
                let text = std::fs::read_to_string(log).unwrap_or_default();
                let tail: Vec<&str> = text.lines().rev().take(5).collect();
                return Err(format!(
                    "lockstep serve did not serve ({other:?}); its log ends: {}",
                    tail.join(" | ")
                ));
            }
        };
        // Keep draining stdout so that it never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        // `lockstep: serving on ADDR (epoch N), metrics on http://ADDR/metrics`
        let addr: SocketAddr = line
            .strip_prefix("lockstep: serving on ")
            .and_then(|r| r.split_whitespace().next())
            .and_then(|a| a.parse().ok())
            .ok_or_else(|| format!("unexpected serving line {line:?}"))?;
        let metrics: SocketAddr = line
            .rsplit_once("metrics on http://")
            .and_then(|(_, r)| r.split('/').next())
            .and_then(|a| a.parse().ok())
            .ok_or_else(|| format!("no metrics address in {line:?}"))?;
        // Both tokens were written before the serving line.
        let token = read_token(state, "api.token")?;
        let metrics_token = read_token(state, "metrics.token")?;
        Ok(Env {
            child,
            pid,
            api: Api {
                url: format!("http://{addr}"),
                addr,
                token,
            },
            metrics,
            metrics_token,
        })
    }

    /// SIGKILL, and reap it.
    pub(crate) async fn kill(&mut self) {
        let _ = self.child.kill().await;
    }
}

/// A gRPC status in a line.
pub(crate) fn code(s: &tonic::Status) -> String {
    format!("{:?}: {}", s.code(), s.message())
}

/// Lowers process `pid`'s descriptor limit (soft and hard) to `n`
/// (`prlimit`, util-linux).
pub(crate) async fn limit_descriptors(pid: u32, n: u64) -> Result<(), String> {
    let out = tokio::process::Command::new("prlimit")
        .arg(format!("--pid={pid}"))
        .arg(format!("--nofile={n}:{n}"))
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .map_err(|e| format!("prlimit (util-linux) could not run: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "prlimit --pid={pid} --nofile={n}:{n} failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(())
}

/// The soft descriptor limit of process `pid` (`/proc/PID/limits`).
pub(crate) fn descriptor_limit(pid: &str) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/limits")).ok()?;
    let line = text.lines().find(|l| l.starts_with("Max open files"))?;
    line.split_whitespace().nth(3)?.parse().ok()
}

/// SIGKILL to `pid` (through `kill`, which keeps this crate free of unsafe
/// code).
pub(crate) async fn kill9(pid: u32) -> Result<(), String> {
    if pid == 0 {
        return Err("no PID".into());
    }
    let ok = tokio::process::Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .stderr(std::process::Stdio::null())
        .status()
        .await
        .is_ok_and(|s| s.success());
    if ok {
        Ok(())
    } else {
        Err(format!("kill -KILL {pid} failed"))
    }
}
