//! Attacks on the environment (`lockstep serve`): its secrets at rest and
//! in its child processes, a state directory others can write, idle
//! connections that exhaust its API's descriptors, and its metrics endpoint
//! off loopback without a token.

use crate::*;

/// Every file of the state directory that holds or derives a key is 0600 in
/// a 0700 directory; a replica process's environment holds none of the
/// environment's own secrets (its API token).
pub(crate) async fn keys_at_rest_and_in_children(_v: Variant) -> Result<(), Failure> {
    let state = tempfile::tempdir().map_err(|e| e.to_string())?;
    let token = "a-token-that-must-stay-in-the-environment";
    let env_vars = [("LOCKSTEP_API_TOKEN".to_string(), PathBuf::from(token))];
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
    let mut client = api(&env.url, Some(token)).await?;
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
        check(state.path().join("session.secret"), 0o600);
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
            environ
                .split(|b| *b == 0)
                .any(|kv| kv.starts_with(b"LOCKSTEP_API_TOKEN="))
        });
    let _ = env.kill().await;
    let _ = kill_all_services(&state.path().join("orchestrator"));
    result?;
    if leaked {
        return Err(violation(
            "S1",
            "a replica process inherited the environment's API token".into(),
        ));
    }
    Ok(())
}

/// `lockstep serve` refuses a state directory that other users can write.
pub(crate) async fn state_dir_writable_by_others(_v: Variant) -> Result<(), Failure> {
    use std::os::unix::fs::PermissionsExt;
    let state = tempfile::tempdir().map_err(|e| e.to_string())?;
    std::fs::set_permissions(state.path(), std::fs::Permissions::from_mode(0o777))
        .map_err(|e| e.to_string())?;
    let started =
        EnvProcess::start(&lockstep_binary(), state.path(), "id-watermark", None, &[]).await;
    match started {
        Err(e) if format!("{e:#}").contains("writable by other users") => Ok(()),
        Err(e) => Err(Failure::Harness(format!(
            "lockstep serve failed otherwise: {e:#}"
        ))),
        Ok(mut env) => {
            let _ = env.kill().await;
            let _ = kill_all_services(&state.path().join("orchestrator"));
            Err(violation(
                "S1",
                "lockstep serve ran on a state directory every user can write".into(),
            ))
        }
    }
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
        let mut client = api(&env.url, Some(TOKEN)).await?;
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

/// The metrics endpoint off loopback answers only with the API token.
pub(crate) async fn metrics_off_loopback_without_token(v: Variant) -> Result<(), Failure> {
    let state = tempfile::tempdir().map_err(|e| e.to_string())?;
    let token_file = state.path().join("api.token");
    std::fs::write(&token_file, format!("{TOKEN}\n")).map_err(|e| e.to_string())?;
    let token_file = token_file.to_string_lossy().into_owned();
    let mut args = vec!["--metrics-listen", "0.0.0.0:0"];
    if v != Variant::Open {
        args.extend(["--api-token-file", &token_file]);
    }
    let mut env = EnvProcess::start(
        &lockstep_binary(),
        state.path(),
        "id-watermark",
        None,
        &args,
    )
    .await
    .map_err(|e| format!("starting lockstep serve: {e:#}"))?;
    let port = env
        .serving_line
        .rsplit_once("metrics on http://")
        .and_then(|(_, r)| r.split('/').next())
        .and_then(|a| a.rsplit_once(':'))
        .and_then(|(_, p)| p.parse::<u16>().ok())
        .ok_or_else(|| format!("no metrics address in {:?}", env.serving_line))?;
    let get = |auth: Option<&str>| {
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
    let without = get(None).await;
    let with = get(Some(TOKEN)).await;
    let _ = env.kill().await;
    let _ = kill_all_services(&state.path().join("orchestrator"));
    let without = without?;
    if without.starts_with("HTTP/1.1 200") {
        return Err(violation(
            "S1",
            "the metrics endpoint off loopback answered without a token".into(),
        ));
    }
    let with = with?;
    if !with.starts_with("HTTP/1.1 200") {
        return Err(Failure::Harness(format!(
            "the metrics endpoint refused the token: {}",
            with.lines().next().unwrap_or("")
        )));
    }
    Ok(())
}
