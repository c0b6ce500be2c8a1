//! A running `lockstep serve` process ([`EnvProcess`]) and the
//! `lockstep replica` CLI, as the crash scenarios and the environment's
//! integration tests drive them.
//!
//! `lockstep serve` runs in its default posture unless the caller says
//! otherwise: every API call needs the token it made in its state directory
//! (`api.token`, written before the serving line). [`EnvProcess::client`]
//! sends it, and [`cli`] gives the CLI that state directory
//! (`LOCKSTEP_STATE_DIR`), as a user of `lockstep replica --state-dir` would.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Mutex;

use anyhow::{anyhow, bail, Context};
use lockstep_orchestrator::ServiceStatus;
use tokio::io::AsyncBufReadExt;

use lockstep_environment::proto;
use lockstep_environment::proto::environment_client::EnvironmentClient;

use super::WAIT;

/// A running `lockstep serve` process.
#[derive(Debug)]
pub struct EnvProcess {
    child: tokio::process::Child,
    /// The gRPC address, `http://host:port`.
    pub url: String,
    /// Where its stderr goes.
    pub stderr_path: PathBuf,
    /// The line it printed when it started serving (addresses, epoch).
    pub serving_line: String,
    /// The token every API call must carry: the one it made in its state
    /// directory (`api.token`), or the one it was given
    /// (`--api-token-file`, `LOCKSTEP_API_TOKEN`); none with
    /// `--insecure-loopback`.
    pub token: Option<String>,
    /// Its state directory.
    pub state_dir: PathBuf,
}

/// The file of the API token `lockstep serve` makes in its state directory.
const API_TOKEN_FILE: &str = "api.token";

/// The state directory of every environment this process started, and
/// whether it keeps its token there (the default posture), by its API
/// port: where [`cli`] points the CLI for its token and for the socket
/// that proves the server.
static STATE_DIRS: Mutex<BTreeMap<u16, (PathBuf, bool)>> = Mutex::new(BTreeMap::new());

/// The port of `url` (`scheme://host:port[/]`).
fn port_of(url: &str) -> Option<u16> {
    url.trim_end_matches('/').rsplit_once(':')?.1.parse().ok()
}

/// The value of `--flag VALUE` or `--flag=VALUE` in `args`.
fn flag_value<'a>(args: &[&'a str], flag: &str) -> Option<&'a str> {
    args.iter().enumerate().find_map(|(i, a)| {
        if *a == flag {
            args.get(i + 1).copied()
        } else {
            a.strip_prefix(flag)?.strip_prefix('=')
        }
    })
}

/// The first line of the token file `path`.
fn read_token(path: &Path) -> anyhow::Result<String> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading the API token {}", path.display()))?;
    Ok(text.lines().next().unwrap_or("").trim().to_string())
}

/// Adds `authorization: Bearer TOKEN` to every call, if there is a token.
#[derive(Clone, Debug)]
pub struct Bearer(Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>);

impl Bearer {
    /// The interceptor sending `token`, if any.
    pub fn new(token: Option<&str>) -> anyhow::Result<Bearer> {
        let value = token
            .map(|t| format!("Bearer {t}").parse())
            .transpose()
            .context("the API token is not a valid header value")?;
        Ok(Bearer(value))
    }
}

impl tonic::service::Interceptor for Bearer {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(v) = &self.0 {
            req.metadata_mut().insert("authorization", v.clone());
        }
        Ok(req)
    }
}

/// A client of the API sending the environment's token.
pub type Client = EnvironmentClient<
    tonic::service::interceptor::InterceptedService<tonic::transport::Channel, Bearer>,
>;

impl EnvProcess {
    /// Starts `lockstep serve` on `state_dir` with `rule`, the `sleep`
    /// service, and `failpoints` (the `FAILPOINTS` value) if given, and waits
    /// (bounded) until it serves.
    pub async fn start(
        bin: &Path,
        state_dir: &Path,
        rule: &str,
        failpoints: Option<&str>,
        extra_args: &[&str],
    ) -> anyhow::Result<EnvProcess> {
        Self::start_with_env(bin, state_dir, rule, failpoints, extra_args, &[]).await
    }

    /// [`start`](Self::start) with extra environment variables.
    pub async fn start_with_env(
        bin: &Path,
        state_dir: &Path,
        rule: &str,
        failpoints: Option<&str>,
        extra_args: &[&str],
        env: &[(String, PathBuf)],
    ) -> anyhow::Result<EnvProcess> {
        let mut args = vec!["--listen", "127.0.0.1:0", "--orphan-rule", rule];
        args.extend(["--service-binary", "sleep", "--service-arg", "300"]);
        args.extend(extra_args);
        let mut env: Vec<(String, std::ffi::OsString)> = env
            .iter()
            .map(|(k, v)| (k.clone(), v.clone().into_os_string()))
            .collect();
        if let Some(fp) = failpoints {
            env.push(("FAILPOINTS".into(), fp.into()));
        }
        Self::serve(bin, state_dir, &args, &env).await
    }

    /// `lockstep serve --state-dir STATE_DIR ARGS` with `env` (and no
    /// `FAILPOINTS` but the one `env` names), waited for (bounded) until it
    /// serves. `ARGS` must name `--listen` (its serving line gives the
    /// address).
    pub async fn serve(
        bin: &Path,
        state_dir: &Path,
        extra_args: &[&str],
        env: &[(String, std::ffi::OsString)],
    ) -> anyhow::Result<EnvProcess> {
        let n = std::fs::read_dir(state_dir)?.count();
        let stderr_path = state_dir.join(format!("lockstep-{n}.stderr"));
        let stderr = std::fs::File::create(&stderr_path)?;
        let mut cmd = tokio::process::Command::new(bin);
        cmd.args(["serve", "--state-dir"])
            .arg(state_dir)
            .args(extra_args)
            .env_remove("FAILPOINTS")
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .kill_on_drop(true);
        let mut child = cmd
            .spawn()
            .with_context(|| format!("cannot start {}", bin.display()))?;
        let stdout = child.stdout.take().expect("piped");
        let mut lines = tokio::io::BufReader::new(stdout).lines();
        let line = tokio::time::timeout(WAIT, lines.next_line()).await;
        let stderr_text = || std::fs::read_to_string(&stderr_path).unwrap_or_default();
        let line = match line {
            Ok(Ok(Some(line))) => line,
            Ok(_) => bail!(
                "lockstep serve exited before serving: {:?}; stderr:\n{}",
                child.wait().await,
                stderr_text()
            ),
            Err(_) => bail!(
                "lockstep serve did not serve within {WAIT:?}; stderr:\n{}",
                stderr_text()
            ),
        };
        let addr = line
            .strip_prefix("lockstep: serving on ")
            .and_then(|r| r.split_whitespace().next())
            .ok_or_else(|| anyhow!("unexpected first line {line:?}"))?;
        // Keep draining stdout so the server never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        let url = format!("http://{addr}");
        // Its token, which it wrote before its serving line: none with
        // --insecure-loopback, else the one it was given, else the one it
        // keeps in its state directory.
        let given = env
            .iter()
            .find(|(k, _)| k == "LOCKSTEP_API_TOKEN")
            .map(|(_, v)| v.to_string_lossy().into_owned())
            .or_else(|| std::env::var("LOCKSTEP_API_TOKEN").ok());
        let (token, keeps_it) = if extra_args.contains(&"--insecure-loopback") {
            (None, false)
        } else if let Some(file) = flag_value(extra_args, "--api-token-file") {
            (Some(read_token(Path::new(file))?), false)
        } else if let Some(t) = given {
            (Some(t), false)
        } else {
            (Some(read_token(&state_dir.join(API_TOKEN_FILE))?), true)
        };
        if let Some(port) = port_of(&url) {
            STATE_DIRS
                .lock()
                .expect("poisoned")
                .insert(port, (state_dir.to_path_buf(), keeps_it));
        }
        Ok(EnvProcess {
            child,
            url,
            stderr_path,
            serving_line: line.clone(),
            token,
            state_dir: state_dir.to_path_buf(),
        })
    }

    /// A gRPC client of it, sending its token.
    pub async fn client(&self) -> anyhow::Result<Client> {
        let channel = tonic::transport::Endpoint::from_shared(self.url.clone())?;
        let channel = tokio::time::timeout(WAIT, channel.connect())
            .await
            .context("connect timed out")??;
        Ok(EnvironmentClient::with_interceptor(
            channel,
            Bearer::new(self.token.as_deref())?,
        ))
    }

    /// Waits (bounded) for it to exit; returns its status and stderr.
    pub async fn wait_exit(&mut self) -> anyhow::Result<(std::process::ExitStatus, String)> {
        let status = tokio::time::timeout(WAIT, self.child.wait())
            .await
            .context("lockstep did not exit in time")??;
        Ok((status, std::fs::read_to_string(&self.stderr_path)?))
    }

    /// Its PID, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    /// Kills it (SIGKILL, a crash) and waits for it.
    pub async fn kill(&mut self) -> anyhow::Result<()> {
        self.child.kill().await?;
        Ok(())
    }
}

/// Runs the `lockstep replica ...` CLI against `url` (bounded). For an
/// environment this process started that keeps its token in its state
/// directory (the default posture), the CLI is given that directory
/// (`LOCKSTEP_STATE_DIR`) and so sends the token, unless `args` name a
/// token file or a state directory themselves; otherwise it sends what
/// `args` say (nothing, by default). Given a token file, the CLI is given
/// the environment's state directory too, for its socket: the CLI sends a
/// token over plain HTTP to nothing.
pub async fn cli(bin: &Path, url: &str, args: &[&str]) -> anyhow::Result<std::process::Output> {
    let mut cmd = tokio::process::Command::new(bin);
    cmd.arg("replica")
        .args(args)
        .args(["--server", url])
        .stdin(Stdio::null())
        .kill_on_drop(true);
    let names = |flag: &str| {
        args.iter()
            .any(|a| *a == flag || a.starts_with(&format!("{flag}=")))
    };
    let state_dir =
        port_of(url).and_then(|p| STATE_DIRS.lock().expect("poisoned").get(&p).cloned());
    match state_dir {
        // Its token, and its socket (which proves the server).
        Some((dir, true)) if !names("--token-file") && !names("--state-dir") => {
            cmd.env("LOCKSTEP_STATE_DIR", dir)
        }
        // The token `args` name, sent over the state directory's socket
        // (a token file outranks the directory's token).
        Some((dir, _)) if names("--token-file") && !names("--state-dir") => {
            cmd.env("LOCKSTEP_STATE_DIR", dir)
        }
        _ => cmd.env_remove("LOCKSTEP_STATE_DIR"),
    };
    Ok(tokio::time::timeout(WAIT, cmd.output())
        .await
        .context("the CLI did not finish in time")??)
}

pub(super) async fn list(env: &EnvProcess) -> anyhow::Result<Vec<proto::Replica>> {
    Ok(env
        .client()
        .await?
        .list_replicas(proto::ListReplicasRequest::default())
        .await?
        .into_inner()
        .replicas)
}

pub(super) fn pids(services: &[ServiceStatus], id: u64) -> Vec<Option<u32>> {
    services
        .iter()
        .filter(|s| s.id == id)
        .flat_map(|s| s.processes.iter().map(|p| p.pid))
        .collect()
}
