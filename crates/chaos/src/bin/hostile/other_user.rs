//! Another local user (uid and gid [`OTHER_UID`], `nobody`): this binary
//! run again as that user ([`PROBE_ARG`]) tries to read every file and
//! list every directory of the state directory, to read the API token,
//! to call the API without it, to scrape the metrics endpoint without its
//! token, and holds a few connections to the API meanwhile. Anything it
//! reads or is served breaks R1 ("by default nothing is reachable or
//! readable by another local user"). The parent also checks every mode in
//! the state directory (0600 files, 0700 directories), which its 0700 top
//! would otherwise hide. Only as root (a uid must be switched); otherwise
//! the seed notes it skipped this.

use super::*;

use std::os::unix::fs::PermissionsExt;

/// The first argument of the probe run as the other user.
pub(crate) const PROBE_ARG: &str = "--probe-as-other-user";

/// The other user: `nobody`.
pub(crate) const OTHER_UID: u32 = 65534;

/// The connections the other user holds to the API while it probes.
const OTHER_USER_CONNECTIONS: usize = 40;

/// What the other user got.
#[derive(serde::Serialize, serde::Deserialize, Debug, Default)]
struct Probe {
    /// Its real uid, as it runs.
    uid: u32,
    /// Paths it could open (files) or list (directories).
    readable: Vec<String>,
    /// Whether it read the API token.
    token_read: bool,
    /// What the API answered a call without the token.
    api: String,
    /// Whether that call was served.
    api_served: bool,
    /// What the metrics endpoint answered a scrape without the token.
    metrics: String,
    /// Connections it held to the API.
    held: usize,
}

/// This process's effective uid: the owner of a file it makes (`/proc`
/// may hide even `/proc/self/status` from an unprivileged user).
fn uid() -> Option<u32> {
    use std::os::unix::fs::MetadataExt;
    Some(tempfile::tempfile().ok()?.metadata().ok()?.uid())
}

/// The probe, run as the other user: `PROBE_ARG STATE_DIR API_URL
/// METRICS_ADDR PATH...`; prints one JSON line ([`Probe`]).
pub(crate) fn probe_main(args: &[String]) -> ! {
    let [state, url, metrics, paths @ ..] = args else {
        eprintln!("usage: {PROBE_ARG} STATE_DIR API_URL METRICS_ADDR PATH...");
        std::process::exit(2);
    };
    let mut p = Probe {
        uid: uid().unwrap_or(u32::MAX),
        ..Probe::default()
    };
    for path in paths {
        let path = Path::new(path);
        let opened = if path.is_dir() {
            std::fs::read_dir(path).is_ok()
        } else {
            std::fs::File::open(path).is_ok()
        };
        if opened {
            p.readable.push(path.display().to_string());
        }
    }
    let token = std::fs::read_to_string(Path::new(state).join("api.token")).ok();
    p.token_read = token.is_some();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let Ok(addr) = url.trim_start_matches("http://").parse::<SocketAddr>() else {
            p.api = format!("not an address: {url}");
            return;
        };
        let mut held = Vec::new();
        for _ in 0..OTHER_USER_CONNECTIONS {
            if let Ok(Ok(s)) = tokio::time::timeout(
                Duration::from_millis(500),
                tokio::net::TcpStream::connect(addr),
            )
            .await
            {
                held.push(s);
            }
        }
        p.held = held.len();
        let api = Api {
            url: url.clone(),
            addr,
            token: String::new(),
        };
        let call = async {
            let mut c = api
                .client_with(token.as_deref(), Duration::from_secs(3))
                .await?;
            c.list_replicas(proto::ListReplicasRequest::default())
                .await
                .map_err(|s| code(&s))
        };
        (p.api, p.api_served) = match tokio::time::timeout(Duration::from_secs(4), call).await {
            Ok(Ok(_)) => ("served".into(), true),
            Ok(Err(e)) => (e, false),
            Err(_) => ("no answer within 4 s".into(), false),
        };
        p.metrics = match metrics.parse() {
            Ok(m) => attack::scrape(m, None).await.unwrap_or_else(|e| e),
            Err(_) => format!("not an address: {metrics}"),
        };
        tokio::time::sleep(Duration::from_secs(1)).await;
        drop(held);
    });
    println!("{}", serde_json::to_string(&p).expect("serializes"));
    std::process::exit(0);
}

/// This binary run as the other user in mode `mode` (its first argument),
/// from `/`, with an empty environment, its output piped and its input
/// closed; killed if dropped.
pub(crate) fn as_other_user(mode: &str) -> tokio::process::Command {
    let mut cmd = tokio::process::Command::new(probe_binary());
    cmd.arg(mode)
        .uid(OTHER_UID)
        .gid(OTHER_UID)
        .current_dir("/")
        .env_clear()
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true);
    cmd
}

/// Every path under `dir` (itself included), as root sees them.
fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
    out.push(dir.to_path_buf());
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let path = e.path();
        if e.file_type().is_ok_and(|t| t.is_dir()) {
            walk(&path, out);
        } else {
            out.push(path);
        }
    }
}

/// Whether this process runs as root (and so can run the probe as
/// another user).
pub(crate) fn can_switch_user() -> bool {
    uid() == Some(0)
}

/// Checks the state directory's modes, then runs the probe as the other
/// user against `state`, the API and the metrics endpoint.
pub(crate) async fn probe(state: &Path, env: &EnvView, shared: &Shared) -> Result<(), Failure> {
    let mut paths = Vec::new();
    walk(state, &mut paths);
    // Modes: what the 0700 top would hide.
    let open: Vec<String> = paths
        .iter()
        .filter_map(|p| {
            let meta = std::fs::symlink_metadata(p).ok()?;
            let mode = meta.permissions().mode() & 0o777;
            (mode & 0o077 != 0).then(|| format!("{} is {mode:o}", p.display()))
        })
        .collect();
    if !open.is_empty() {
        return Err(violation(
            "R1",
            format!(
                "the state directory holds what other users may read: {}",
                open.join(", ")
            ),
        ));
    }
    let mut cmd = as_other_user(PROBE_ARG);
    cmd.arg(state)
        .arg(&env.api.url)
        .arg(env.metrics.to_string())
        .args(&paths);
    let child = cmd
        .spawn()
        .map_err(|e| Failure::Harness(format!("running the probe as uid {OTHER_UID}: {e}")))?;
    let out = tokio::select! {
        out = tokio::time::timeout(Duration::from_secs(20), child.wait_with_output()) => out,
        () = shared.stop.cancelled() => return Ok(()),
    };
    let out = out
        .map_err(|_| Failure::Harness("the other user's probe did not end within 20 s".into()))?
        .map_err(|e| Failure::Harness(format!("the other user's probe: {e}")))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let p: Probe = stdout
        .lines()
        .find_map(|l| serde_json::from_str(l).ok())
        .ok_or_else(|| {
            Failure::Harness(format!(
                "the other user's probe said nothing ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ))
        })?;
    if p.uid != OTHER_UID {
        return Err(Failure::Harness(format!(
            "the probe ran as uid {}, not {OTHER_UID}",
            p.uid
        )));
    }
    if !p.readable.is_empty() || p.token_read {
        return Err(violation(
            "R1",
            format!(
                "another user (uid {OTHER_UID}) could read in the state directory: {}{}",
                p.readable.join(", "),
                if p.token_read { " (the API token)" } else { "" }
            ),
        ));
    }
    if p.api_served {
        return Err(violation(
            "R1",
            format!("another user (uid {OTHER_UID}) was served an API call without the token"),
        ));
    }
    if p.metrics.starts_with("HTTP/1.1 200") {
        return Err(violation(
            "R1",
            format!("another user (uid {OTHER_UID}) was served /metrics without its token"),
        ));
    }
    shared.note(format!(
        "uid {OTHER_UID}: {} paths unreadable, API \"{}\", metrics \"{}\", {} connections held",
        paths.len(),
        p.api.split(':').next().unwrap_or(""),
        p.metrics,
        p.held
    ));
    Ok(())
}

/// The probe's program: a link to this binary made at start
/// ([`keep_probe_binary`]), so a rebuild of the suite's binary while it
/// runs (cargo replaces the file) does not take the probe's program away.
static PROBE_BINARY: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();

/// Links (or copies) this binary to `dir/probe-PID` for the probe, once at
/// start; the links of runs that ended are removed.
pub(crate) fn keep_probe_binary(dir: &std::path::Path) -> Result<(), String> {
    let exe = std::env::current_exe().map_err(|e| format!("this binary's path: {e}"))?;
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    // Links of runs that ended go; a run still going keeps its own.
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let ended = name
                .strip_prefix("probe-")
                .and_then(|pid| pid.parse::<u32>().ok())
                .is_some_and(|pid| !std::path::Path::new(&format!("/proc/{pid}")).exists());
            if ended {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
    let kept = dir.join(format!("probe-{}", std::process::id()));
    if std::fs::hard_link(&exe, &kept).is_err() {
        std::fs::copy(&exe, &kept).map_err(|e| format!("copying {}: {e}", exe.display()))?;
    }
    let _ = PROBE_BINARY.set(kept);
    Ok(())
}

/// The probe's program: the kept link, else this binary's path.
fn probe_binary() -> std::path::PathBuf {
    PROBE_BINARY
        .get()
        .cloned()
        .or_else(|| std::env::current_exe().ok())
        .unwrap_or_else(|| std::path::PathBuf::from("/proc/self/exe"))
}
