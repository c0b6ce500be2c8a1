//! Attacks on the environment (`lockstep serve`): its secrets at rest and
//! in its child processes, a state directory others can enter, idle
//! connections that exhaust its API's descriptors, and its metrics endpoint
//! without its token, on and off loopback.

use crate::*;

/// Every file of the state directory that holds or derives a key or a
/// token is 0600 in a 0700 directory; a replica process's environment holds
/// none of the environment's own secrets (its API and metrics tokens). Both
/// ways of giving the API its token: in the environment
/// (`LOCKSTEP_API_TOKEN`, which a child must not inherit), and made in the
/// state directory (the default).
pub(crate) async fn keys_at_rest_and_in_children(_v: Variant) -> Result<(), Failure> {
    keys_at_rest(Some("a-token-that-must-stay-in-the-environment")).await?;
    keys_at_rest(None).await
}

/// [`keys_at_rest_and_in_children`] with the API token given by
/// `LOCKSTEP_API_TOKEN`, or (`None`) made in the state directory.
async fn keys_at_rest(given: Option<&str>) -> Result<(), Failure> {
    let state = tempfile::tempdir().map_err(|e| e.to_string())?;
    let env_vars: Vec<(String, PathBuf)> = given
        .map(|t| ("LOCKSTEP_API_TOKEN".to_string(), PathBuf::from(t)))
        .into_iter()
        .collect();
    let mut env = EnvProcess::start_with_env(
        &lockstep_binary(),
        state.path(),
        "id-watermark",
        None,
        &[],
        &env_vars,
    )
    .await
    .map_err(|e| format!("starting lockstep serve: {e:#}"))?;
    let token = env
        .token
        .clone()
        .ok_or_else(|| Failure::Harness("lockstep serve runs without an API token".into()))?;
    let metrics = metrics_token(state.path())?;
    let mut client = api(&env.url, Some(&token)).await?;
    let created = client
        .create_replica(proto::CreateReplicaRequest {
            name: "r".into(),
            processes: 1,
            workers_per_process: 1,
            config: String::new(),
        })
        .await;
    let result = (|| {
        created.map_err(|e| Failure::Harness(format!("creating a replica: {e}")))?;
        use std::os::unix::fs::PermissionsExt;
        let mut wide = Vec::new();
        let mut in_records = Vec::new();
        let orchestrator = state.path().join("orchestrator");
        let mut check = |p: PathBuf, want: u32| {
            let mode = std::fs::metadata(&p)
                .map(|m| m.permissions().mode() & 0o777)
                .unwrap_or(0);
            if mode & !want != 0 {
                wide.push(format!("{} is {mode:o}", p.display()));
            }
        };
        check(state.path().to_path_buf(), 0o700);
        check(state.path().join("session.secret"), 0o600);
        check(state.path().join("metrics.token"), 0o600);
        if given.is_none() {
            check(state.path().join("api.token"), 0o600);
        }
        check(orchestrator.clone(), 0o700);
        check(orchestrator.join("services"), 0o700);
        for entry in std::fs::read_dir(orchestrator.join("services"))
            .map_err(|e| e.to_string())?
            .flatten()
        {
            check(entry.path(), 0o600);
            // No secret in a service record: the environment (the session
            // key) has its own file.
            if entry.path().extension().is_some_and(|e| e == "json")
                && std::fs::read_to_string(entry.path())
                    .unwrap_or_default()
                    .contains("LOCKSTEP_SESSION_KEY")
            {
                in_records.push(format!("{} holds the session key", entry.path().display()));
            }
        }
        if !wide.is_empty() {
            return Err(violation(
                "S1",
                format!("secrets readable by other users: {}", wide.join(", ")),
            ));
        }
        if !in_records.is_empty() {
            return Err(violation("S1", in_records.join(", ")));
        }
        Ok(())
    })();
    // The replica's processes (`sleep` here) and what they were given.
    let leaked = std::fs::read_dir("/proc")
        .map_err(|e| e.to_string())?
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|pid| std::fs::read(format!("/proc/{pid}/environ")).ok())
        .filter(|environ| {
            let marker = format!(
                "LOCKSTEP_ORCHESTRATOR={}",
                state.path().join("orchestrator").display()
            );
            environ.split(|b| *b == 0).any(|kv| kv == marker.as_bytes())
        })
        .any(|environ| {
            environ.split(|b| *b == 0).any(|kv| {
                kv.starts_with(b"LOCKSTEP_API_TOKEN=")
                    || [&token, &metrics]
                        .iter()
                        .any(|t| kv.windows(t.len()).any(|w| w == t.as_bytes()))
            })
        });
    let _ = env.kill().await;
    let _ = kill_all_services(&state.path().join("orchestrator"));
    result?;
    if leaked {
        return Err(violation(
            "S1",
            "a replica process inherited the environment's API or metrics token".into(),
        ));
    }
    Ok(())
}

/// `lockstep serve` refuses a state directory that other users can write
/// (what they may have put in it cannot be trusted), naming its mode; one
/// of ours they can only read or enter (it holds the tokens and every
/// replica's key) it never uses open: refused the same way, or made 0700
/// before it serves.
pub(crate) async fn state_dir_open_to_others(_v: Variant) -> Result<(), Failure> {
    use std::os::unix::fs::PermissionsExt;
    for mode in [0o777, 0o775, 0o757, 0o755, 0o750, 0o701] {
        let writable = mode & 0o022 != 0;
        let state = tempfile::tempdir().map_err(|e| e.to_string())?;
        std::fs::set_permissions(state.path(), std::fs::Permissions::from_mode(mode))
            .map_err(|e| e.to_string())?;
        let started =
            EnvProcess::start(&lockstep_binary(), state.path(), "id-watermark", None, &[]).await;
        let now = std::fs::metadata(state.path())
            .map(|m| m.permissions().mode() & 0o777)
            .unwrap_or(0);
        match started {
            Err(e)
                if format!("{e:#}").contains("open to other users")
                    && format!("{e:#}").contains(&format!("{mode:o}")) => {}
            Err(e) => {
                return Err(Failure::Harness(format!(
                    "lockstep serve on a {mode:o} state directory failed otherwise: {e:#}"
                )))
            }
            Ok(mut env) => {
                let _ = env.kill().await;
                let _ = kill_all_services(&state.path().join("orchestrator"));
                if writable || now & 0o077 != 0 {
                    return Err(violation(
                        "S1",
                        format!(
                            "lockstep serve ran on a state directory of mode {mode:o} (now {now:o})"
                        ),
                    ));
                }
            }
        }
    }
    Ok(())
}

/// With the environment's descriptors limited to 256, 400 idle connections
/// to the API (no token, no bytes) must not keep a token holder out.
pub(crate) async fn api_connection_exhaustion(v: Variant) -> Result<(), Failure> {
    let (mut env, state) = start_env(v).await?;
    let pid = env
        .pid()
        .ok_or_else(|| "lockstep serve has no PID".to_string())?;
    let limited = std::process::Command::new("prlimit")
        .args([format!("--pid={pid}"), "--nofile=256:256".into()])
        .status()
        .map_err(|e| Failure::Harness(format!("prlimit: {e}")))?;
    if !limited.success() {
        return Err(Failure::Harness(format!("prlimit failed: {limited}")));
    }
    let addr: SocketAddr = env
        .url
        .trim_start_matches("http://")
        .parse()
        .map_err(|e| format!("{e}"))?;
    let mut flood = Vec::new();
    for _ in 0..400 {
        if let Ok(s) = TcpStream::connect(addr).await {
            flood.push(s);
        }
    }
    let served = tokio::time::timeout(Duration::from_secs(10), async {
        let mut client = api(&env.url, env.token.as_deref()).await?;
        client
            .list_replicas(proto::ListReplicasRequest::default())
            .await
            .map_err(|e| e.to_string())
    })
    .await;
    drop(flood);
    let _ = env.kill().await;
    let _ = kill_all_services(&state.path().join("orchestrator"));
    match served {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) => Err(violation(
            "S1",
            format!("400 idle connections kept a token holder out of the API: {e}"),
        )),
        Err(_) => Err(violation(
            "S1",
            "400 idle connections kept a token holder out of the API for 10 s".into(),
        )),
    }
}

/// The metrics endpoint answers only with its own read-only token
/// (`STATE/metrics.token`), on loopback too (`on_loopback`) and off it; the
/// API token is not accepted there. `open` (`--insecure-loopback`, the old
/// posture) serves it without a token on loopback, and must refuse to
/// serve it off loopback without one.
pub(crate) async fn metrics_without_token(v: Variant, on_loopback: bool) -> Result<(), Failure> {
    let listen = if on_loopback {
        "127.0.0.1:0"
    } else {
        "0.0.0.0:0"
    };
    let started = start_env_with(v, &["--metrics-listen", listen]).await;
    let (mut env, state) = match started {
        Err(e) if v == Variant::Open && !on_loopback => {
            // Refused at start: a pass, if for this reason.
            return if e.contains("refusing to serve metrics") {
                Ok(())
            } else {
                Err(Failure::Harness(e))
            };
        }
        other => other?,
    };
    let port = env
        .serving_line
        .rsplit_once("metrics on http://")
        .and_then(|(_, r)| r.split('/').next())
        .and_then(|a| a.rsplit_once(':'))
        .and_then(|(_, p)| p.parse::<u16>().ok())
        .ok_or_else(|| format!("no metrics address in {:?}", env.serving_line))?;
    let get = |auth: Option<String>| {
        let auth = auth
            .map(|t| format!("Authorization: Bearer {t}\r\n"))
            .unwrap_or_default();
        async move {
            let mut s = TcpStream::connect(("127.0.0.1", port))
                .await
                .map_err(|e| e.to_string())?;
            s.write_all(format!("GET /metrics HTTP/1.1\r\nHost: x\r\n{auth}\r\n").as_bytes())
                .await
                .map_err(|e| e.to_string())?;
            let mut out = String::new();
            tokio::time::timeout(Duration::from_secs(10), s.read_to_string(&mut out))
                .await
                .map_err(|_| "no answer within 10 s".to_string())?
                .map_err(|e| e.to_string())?;
            Ok::<_, String>(out)
        }
    };
    let where_ = if on_loopback { "on" } else { "off" };
    let without = get(None).await;
    let with_api_token = match &env.token {
        Some(t) => Some(get(Some(t.clone())).await),
        None => None,
    };
    let with = match v {
        Variant::Open => None,
        _ => Some(get(Some(metrics_token(state.path())?)).await),
    };
    let _ = env.kill().await;
    let _ = kill_all_services(&state.path().join("orchestrator"));
    if without?.starts_with("HTTP/1.1 200") {
        return Err(violation(
            "S1",
            format!("the metrics endpoint {where_} loopback answered without a token"),
        ));
    }
    if let Some(answer) = with_api_token {
        if answer?.starts_with("HTTP/1.1 200") {
            return Err(violation(
                "S1",
                format!("the metrics endpoint {where_} loopback took the API token"),
            ));
        }
    }
    if let Some(answer) = with {
        let answer = answer?;
        if !answer.starts_with("HTTP/1.1 200") {
            return Err(Failure::Harness(format!(
                "the metrics endpoint refused its token: {}",
                answer.lines().next().unwrap_or("")
            )));
        }
    }
    Ok(())
}
