//! The campaign's view of the system under test: where the binaries and
//! policies are, a running `lockstep serve` ([`Env`]), the API requests the
//! campaign sends and the fates of their answers, and signals to processes.

use super::*;
use model::Fate;

/// A client of the environment's API, sending its token.
pub(super) type Client =
    EnvironmentClient<tonic::service::interceptor::InterceptedService<Channel, Bearer>>;

/// Adds `authorization: Bearer TOKEN` to every call.
#[derive(Clone)]
pub(super) struct Bearer(tonic::metadata::MetadataValue<tonic::metadata::Ascii>);

impl tonic::service::Interceptor for Bearer {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        req.metadata_mut().insert("authorization", self.0.clone());
        Ok(req)
    }
}

pub(super) fn target_debug() -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(Path::to_path_buf))
        .unwrap_or_else(|| PathBuf::from("target/debug"))
}

pub(super) fn lockstep_binary() -> PathBuf {
    target_debug().join("lockstep")
}

/// `target/lockstep`, beside `target/debug`.
pub(super) fn lockstep_dir() -> PathBuf {
    target_debug()
        .parent()
        .map(|t| t.join("lockstep"))
        .unwrap_or_else(|| PathBuf::from("target/lockstep"))
}

/// The WASM distribution policy choosing `strategy` for every command:
/// the shipped ones (`cargo xtask build-policies`), and `naive.wasm`,
/// which `cargo xtask chaos campaign` builds for the negative control.
pub(super) fn policy_file(strategy: &str) -> PathBuf {
    if strategy == "naive" {
        lockstep_dir().join("campaign-policies/naive.wasm")
    } else {
        lockstep_dir().join(format!("policies/{strategy}.wasm"))
    }
}

/// A running `lockstep serve`, in its default posture: every API call
/// carries the token it made in its state directory.
pub(super) struct Env {
    child: tokio::process::Child,
    url: String,
    /// `Bearer TOKEN`, of the token in the state directory.
    bearer: Bearer,
}

impl Env {
    /// Starts `lockstep serve` on `state` with `serve_args` (`--store`,
    /// `--hosts`) and `failpoints`.
    pub(super) async fn start(
        state: &Path,
        naive: bool,
        serve_args: &[String],
        failpoints: Option<&str>,
    ) -> Result<Env, String> {
        let stderr = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(state.join("campaign-env.stderr"))
            .map_err(|e| e.to_string())?;
        let mut cmd = tokio::process::Command::new(lockstep_binary());
        cmd.args(["serve", "--listen", "127.0.0.1:0", "--state-dir"])
            .arg(state)
            .env(
                "LOCKSTEP_LOG",
                std::env::var("LOCKSTEP_CAMPAIGN_LOG").unwrap_or_else(|_| "warn".into()),
            )
            // One JSON object per line: the campaign reads the history
            // check's findings from its fields.
            .env("LOCKSTEP_LOG_FORMAT", "json")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .kill_on_drop(true);
        cmd.args(serve_args);
        if naive {
            // The negative control: naive delivery, and none of the
            // environment's repairs (restarts on a silent process, lost
            // lockstep or a history mismatch) behind it.
            cmd.args([
                "--experiments-allow-naive",
                "--experiments-no-replica-restarts",
            ]);
        }
        match failpoints {
            Some(fp) => cmd.env("FAILPOINTS", fp),
            None => cmd.env_remove("FAILPOINTS"),
        };
        let mut child = cmd
            .spawn()
            .map_err(|e| format!("starting {}: {e}", lockstep_binary().display()))?;
        let stdout = child.stdout.take().ok_or("no stdout")?;
        let mut lines = tokio::io::BufReader::new(stdout).lines();
        let line = match tokio::time::timeout(Duration::from_secs(30), lines.next_line()).await {
            Ok(Ok(Some(line))) => line,
            other => {
                let tail =
                    std::fs::read_to_string(state.join("campaign-env.stderr")).unwrap_or_default();
                let tail: String = tail.lines().rev().take(5).collect::<Vec<_>>().join(" | ");
                return Err(format!(
                    "lockstep serve did not serve ({other:?}); stderr tail: {tail}"
                ));
            }
        };
        let addr = line
            .strip_prefix("lockstep: serving on ")
            .and_then(|r| r.split_whitespace().next())
            .ok_or_else(|| format!("unexpected first line {line:?}"))?
            .to_string();
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        // The token it made in the state directory (the same across
        // restarts), written before its serving line.
        let file = state.join("api.token");
        let token = std::fs::read_to_string(&file)
            .map_err(|e| format!("reading the API token {}: {e}", file.display()))?;
        let bearer = format!("Bearer {}", token.lines().next().unwrap_or("").trim())
            .parse()
            .map_err(|e| format!("the API token in {}: {e}", file.display()))?;
        Ok(Env {
            child,
            url: format!("http://{addr}"),
            bearer: Bearer(bearer),
        })
    }

    pub(super) async fn client(&self) -> Result<Client, String> {
        let channel = tonic::transport::Endpoint::from_shared(self.url.clone())
            .map_err(|e| e.to_string())?
            .connect_timeout(Duration::from_secs(5))
            .timeout(CALL)
            .connect()
            .await
            .map_err(|e| format!("connecting to {}: {e}", self.url))?;
        Ok(EnvironmentClient::with_interceptor(
            channel,
            self.bearer.clone(),
        ))
    }

    /// SIGKILL, and reap it.
    pub(super) async fn kill(&mut self) {
        let _ = self.child.kill().await;
    }
}

/// What the environment's controller logs when its history check on a
/// connection finds workers that applied different commands (I1).
pub(super) const DISAGREEMENT: &str = "workers disagree";

/// The whole message of that line (`fields.message` in the JSON log).
pub(super) const DISAGREEMENT_MESSAGE: &str = "workers disagree about what they applied";

pub(super) fn code(s: &tonic::Status) -> String {
    format!("{:?}: {}", s.code(), s.message())
}

/// Fates of an answer: success, or an error that says nothing was done
/// (the request was refused as a whole), or unknown.
pub(super) fn fate_of<T>(r: &Result<T, tonic::Status>) -> Fate {
    match r {
        Ok(_) => Fate::Acked,
        Err(s)
            if matches!(
                s.code(),
                tonic::Code::InvalidArgument
                    | tonic::Code::NotFound
                    | tonic::Code::AlreadyExists
                    | tonic::Code::OutOfRange
            ) =>
        {
            Fate::Absent
        }
        Err(_) => Fate::Unknown,
    }
}

pub(super) fn write_request(w: &model::WriteRec) -> proto::WriteInputRequest {
    proto::WriteInputRequest {
        replica: REPLICA.into(),
        collection_id: w.input,
        updates: w.updates.iter().cloned().map(wire::Update::from).collect(),
        upper: w.time + 1,
    }
}

pub(super) fn create_request(d: &model::DataflowRec) -> proto::CreateDataflowRequest {
    proto::CreateDataflowRequest {
        replica: REPLICA.into(),
        name: format!("c{}", d.collection),
        inputs: d.inputs.clone(),
        exports: vec![wire::Export {
            collection_id: d.collection,
            description: lockstep_plan::encode(&d.plan),
        }],
        as_of: 0,
        format: String::new(),
    }
}

pub(super) fn signal(pid: u32, sig: libc::c_int) -> Result<(), String> {
    lockstep_chaos::signal::send(pid, sig)
}

pub(super) fn alive(pid: u32) -> bool {
    // A zombie still answers kill(0): read its state.
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    let state = stat
        .rsplit_once(')')
        .and_then(|(_, r)| r.split_whitespace().next())
        .unwrap_or("X");
    !matches!(state, "Z" | "X")
}
