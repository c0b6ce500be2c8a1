//! A running `lockstep serve` process ([`EnvProcess`]) and the
//! `lockstep replica` CLI, as the crash scenarios and the environment's
//! integration tests drive them.

use std::path::{Path, PathBuf};
use std::process::Stdio;

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
}

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
        let n = std::fs::read_dir(state_dir)?.count();
        let stderr_path = state_dir.join(format!("lockstep-{n}.stderr"));
        let stderr = std::fs::File::create(&stderr_path)?;
        let mut cmd = tokio::process::Command::new(bin);
        cmd.args(["serve", "--state-dir"])
            .arg(state_dir)
            .args(["--listen", "127.0.0.1:0", "--orphan-rule", rule])
            .args(["--service-binary", "sleep", "--service-arg", "300"])
            .args(extra_args)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .kill_on_drop(true);
        match failpoints {
            Some(fp) => cmd.env("FAILPOINTS", fp),
            None => cmd.env_remove("FAILPOINTS"),
        };
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
        Ok(EnvProcess {
            child,
            url: format!("http://{addr}"),
            stderr_path,
            serving_line: line.clone(),
        })
    }

    /// A gRPC client of it.
    pub async fn client(&self) -> anyhow::Result<EnvironmentClient<tonic::transport::Channel>> {
        Ok(
            tokio::time::timeout(WAIT, EnvironmentClient::connect(self.url.clone()))
                .await
                .context("connect timed out")??,
        )
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

/// Runs the `lockstep replica ...` CLI against `url` (bounded).
pub async fn cli(bin: &Path, url: &str, args: &[&str]) -> anyhow::Result<std::process::Output> {
    let mut cmd = tokio::process::Command::new(bin);
    cmd.arg("replica")
        .args(args)
        .args(["--server", url])
        .stdin(Stdio::null())
        .kill_on_drop(true);
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
