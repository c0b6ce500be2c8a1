//! A `lockstep serve` child process, as the demo and the soak run it: its
//! start (the serving line, the tokens it made), a client sending its
//! token, and its metrics endpoint read with the metrics token.

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{bail, Context};
use lockstep_environment::proto::environment_client::EnvironmentClient;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

/// A running `lockstep serve` child and its API address.
pub(crate) struct Env {
    pub(crate) child: Child,
    pub(crate) url: String,
    /// `host:port` of the metrics endpoint, if it serves one.
    pub(crate) metrics: Option<String>,
    /// The API token `lockstep serve` made in the state directory (none
    /// with `--insecure-loopback`).
    pub(crate) token: Option<String>,
    /// The read-only metrics token it made there.
    pub(crate) metrics_token: Option<String>,
}

impl Env {
    /// A client of this environment, sending its token.
    pub(crate) async fn client(&self) -> anyhow::Result<crate::api_client::Client> {
        client(&self.url, self.token.as_deref()).await
    }
}

/// Starts `bin serve` on `state` with `extra` arguments; returns once it
/// printed its address.
pub(crate) async fn start_env_with(
    bin: &Path,
    state: &Path,
    extra: &[&str],
) -> anyhow::Result<Env> {
    let mut child = Command::new(bin)
        .args(["serve", "--listen", "127.0.0.1:0", "--state-dir"])
        .arg(state)
        .args(extra)
        .env(
            "LOCKSTEP_LOG",
            std::env::var("LOCKSTEP_LOG").unwrap_or_else(|_| "warn".into()),
        )
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))?;
    let stdout = child.stdout.take().context("no stdout")?;
    let mut lines = BufReader::new(stdout).lines();
    let line = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
        .await
        .context("the environment did not report its address within 30 s")??
        .context("the environment exited before serving")?;
    let addr = line
        .strip_prefix("lockstep: serving on ")
        .and_then(|r| r.split_whitespace().next())
        .with_context(|| format!("unexpected first line from the environment: {line:?}"))?;
    let metrics = line
        .split_once("metrics on http://")
        .and_then(|(_, r)| r.split('/').next())
        .map(str::to_string);
    // Keep draining stdout so the child never blocks on it.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    // The tokens `serve` made before it printed its address (none with
    // --insecure-loopback).
    let insecure = extra.contains(&"--insecure-loopback");
    let token_in = |file: &str| -> anyhow::Result<Option<String>> {
        if insecure {
            return Ok(None);
        }
        let path = state.join(file);
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading the token {}", path.display()))?;
        Ok(Some(text.trim().to_string()))
    };
    Ok(Env {
        child,
        url: format!("http://{addr}"),
        metrics,
        token: token_in(lockstep_environment::private::API_TOKEN_FILE)?,
        metrics_token: token_in(lockstep_environment::private::METRICS_TOKEN_FILE)?,
    })
}

/// A client of the environment at `url`, sending `token`.
pub(crate) async fn client(
    url: &str,
    token: Option<&str>,
) -> anyhow::Result<crate::api_client::Client> {
    let channel = tonic::transport::Endpoint::from_shared(url.to_string())?
        .connect_timeout(Duration::from_secs(5))
        .timeout(Duration::from_secs(60))
        .connect()
        .await
        .with_context(|| format!("connecting to {url}"))?;
    Ok(EnvironmentClient::with_interceptor(
        channel,
        crate::api_client::AddToken::bearer(token)?,
    ))
}

/// `GET /metrics` from `addr` with `token`: the response body.
pub(crate) async fn fetch_metrics(addr: &str, token: Option<&str>) -> anyhow::Result<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut sock = tokio::net::TcpStream::connect(addr)
        .await
        .with_context(|| format!("connecting to the metrics endpoint {addr}"))?;
    let auth = token
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    sock.write_all(
        format!("GET /metrics HTTP/1.1\r\nHost: lockstep\r\n{auth}Connection: close\r\n\r\n")
            .as_bytes(),
    )
    .await?;
    let mut response = String::new();
    tokio::time::timeout(Duration::from_secs(10), sock.read_to_string(&mut response))
        .await
        .context("no metrics within 10 s")??;
    let (head, body) = response
        .split_once("\r\n\r\n")
        .context("the metrics response has no body")?;
    if !head.starts_with("HTTP/1.1 200") {
        bail!(
            "the metrics endpoint answered {}",
            head.lines().next().unwrap_or("")
        );
    }
    Ok(body.to_string())
}

/// The value of the sample `name` (with its labels, as printed) in
/// OpenMetrics text.
pub(crate) fn sample(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}
