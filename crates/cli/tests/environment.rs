//! The environment on real processes: the seed's three-controller timeline
//! and the other orphan scenarios for every rule (the negative control must
//! be caught), the `lockstep` CLI, halting when overtaken, and bad input.

use std::path::Path;
use std::process::Output;

use lockstep_chaos::environment::{
    cli, o4_control, stale_binary_halts, stale_cannot_resurrect, stale_halts_on_write,
    stale_loads_before_newer_creates, timeline, EnvProcess, Outcome, Sandbox,
};

fn bin() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_lockstep"))
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn is_o1_violation(o: &Outcome) -> bool {
    matches!(o, Outcome::Violation(v) if v.starts_with("O1"))
}

#[tokio::test]
async fn the_seed_timeline_keeps_o1_to_o4_with_epoch_and_id_watermark() {
    for rule in ["epoch", "id-watermark"] {
        assert_eq!(timeline(rule, true).await, Outcome::Pass, "rule {rule}");
    }
}

#[tokio::test]
async fn the_seed_timeline_catches_catalog_only() {
    let o = timeline("catalog-only", true).await;
    assert!(is_o1_violation(&o), "{o:?}");
}

#[tokio::test]
async fn without_conditional_writes_a_stale_ensure_sends_the_label_backwards() {
    // o4_control passes only when the harness saw the label go backwards.
    for rule in ["epoch", "id-watermark", "catalog-only"] {
        assert_eq!(o4_control(rule).await, Outcome::Pass, "rule {rule}");
    }
}

#[tokio::test]
async fn a_replica_created_after_a_stale_load_survives_only_the_safe_rules() {
    for rule in ["epoch", "id-watermark"] {
        assert_eq!(
            stale_loads_before_newer_creates(rule).await,
            Outcome::Pass,
            "rule {rule}"
        );
    }
    let o = stale_loads_before_newer_creates("catalog-only").await;
    assert!(is_o1_violation(&o), "catalog-only must be caught: {o:?}");
}

#[tokio::test]
async fn a_stale_environment_cannot_resurrect_a_replica_a_newer_one_dropped() {
    for rule in ["epoch", "id-watermark", "catalog-only"] {
        assert_eq!(
            stale_cannot_resurrect(rule).await,
            Outcome::Pass,
            "rule {rule}"
        );
    }
}

#[tokio::test]
async fn a_stale_environment_halts_on_its_next_catalog_write() {
    for rule in ["epoch", "id-watermark", "catalog-only"] {
        assert_eq!(
            stale_halts_on_write(rule).await,
            Outcome::Pass,
            "rule {rule}"
        );
    }
}

#[tokio::test]
async fn a_stale_lockstep_process_exits_saying_another_controller_took_over() {
    assert_eq!(
        stale_binary_halts(bin(), "id-watermark").await,
        Outcome::Pass
    );
}

#[tokio::test]
async fn the_cli_creates_lists_and_drops_replicas() {
    let sandbox = Sandbox::new().unwrap();
    let env = EnvProcess::start(bin(), sandbox.path(), "epoch", None, &[])
        .await
        .unwrap();
    let url = env.url.as_str();
    let o = cli(
        bin(),
        url,
        &["create", "r1", "--processes", "2", "--workers", "3"],
    )
    .await
    .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stdout(&o).contains("created replica r1 (id 1)"),
        "{}",
        stdout(&o)
    );
    let o = cli(bin(), url, &["list"]).await.unwrap();
    let list = stdout(&o);
    assert!(list.contains("r1"), "{list}");
    assert_eq!(list.matches(" running ").count(), 2, "{list}");
    assert!(list.contains("timely=127.0.0.1:"), "{list}");
    let services = sandbox.services().await.unwrap();
    assert_eq!(services.len(), 1);
    assert_eq!(services[0].processes.len(), 2);

    let o = cli(bin(), url, &["create", "r1"]).await.unwrap();
    assert!(!o.status.success());
    assert!(stderr(&o).contains("exists already"), "{}", stderr(&o));
    let o = cli(bin(), url, &["create", "r2", "--processes", "0"])
        .await
        .unwrap();
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("at least one process"),
        "{}",
        stderr(&o)
    );
    let o = cli(bin(), url, &["drop", "nope"]).await.unwrap();
    assert!(!o.status.success());
    assert!(stderr(&o).contains("no replica"), "{}", stderr(&o));

    let o = cli(bin(), url, &["drop", "r1"]).await.unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(sandbox.services().await.unwrap().is_empty());
    let o = cli(bin(), url, &["list"]).await.unwrap();
    assert!(!stdout(&o).contains("r1"));
}

/// The permission bits of `path`.
fn mode(path: &Path) -> u32 {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path).unwrap().permissions().mode() & 0o777
}

fn set_mode(path: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}

/// Runs `lockstep replica ARGS --server URL` as a user would: no token but
/// what `args` give (not even from the state directory of the environment
/// this test started, which [`cli`] would pass).
async fn cli_as_given(url: &str, args: &[&str]) -> Output {
    tokio::time::timeout(
        std::time::Duration::from_secs(30),
        tokio::process::Command::new(bin())
            .arg("replica")
            .args(args)
            .args(["--server", url])
            .env_remove("LOCKSTEP_STATE_DIR")
            .env_remove("LOCKSTEP_API_TOKEN")
            .env_remove("LOCKSTEP_TOKEN_FILE")
            .stdin(std::process::Stdio::null())
            .output(),
    )
    .await
    .expect("the CLI finished in time")
    .unwrap()
}

async fn serve_fails(state_dir: &Path, extra: &[&str]) -> String {
    let o = tokio::time::timeout(
        std::time::Duration::from_secs(30),
        tokio::process::Command::new(bin())
            .args(["serve", "--state-dir"])
            .arg(state_dir)
            .args(["--listen", "127.0.0.1:0"])
            .args(extra)
            .output(),
    )
    .await
    .expect("lockstep serve did not exit")
    .unwrap();
    assert_eq!(o.status.code(), Some(1), "{o:?}");
    stderr(&o)
}

#[tokio::test]
async fn bad_input_is_refused_clearly_and_deletes_nothing() {
    let sandbox = Sandbox::new().unwrap();
    let sleep = ["--service-binary", "sleep", "--service-arg", "300"];

    // A missing state directory is created 0700 (before the bad service
    // binary is refused).
    let missing = sandbox.path().join("missing");
    let err = serve_fails(&missing, &["--service-binary", "/nonexistent/replica"]).await;
    assert!(err.contains("does not exist"), "{err}");
    assert_eq!(mode(&missing), 0o700, "created private");
    // One other users can write is refused, naming its mode.
    let shared = sandbox.path().join("shared");
    std::fs::create_dir(&shared).unwrap();
    set_mode(&shared, 0o775);
    let err = serve_fails(&shared, &sleep).await;
    assert!(
        err.contains("open to other users") && err.contains("775"),
        "{err}"
    );
    assert_eq!(mode(&shared), 0o775, "left as it is");
    // One of ours others can only read or enter (what `mkdir` makes under a
    // 022 umask) is never used open: refused naming its mode, or made 0700
    // before anything is written in it (before the bad service binary is
    // refused).
    let readable = sandbox.path().join("readable");
    std::fs::create_dir(&readable).unwrap();
    set_mode(&readable, 0o755);
    let err = serve_fails(&readable, &["--service-binary", "/nonexistent/replica"]).await;
    let refused = err.contains("open to other users") && err.contains("755");
    assert!(refused || mode(&readable) == 0o700, "{err}");
    let file = sandbox.path().join("file");
    std::fs::write(&file, b"x").unwrap();
    let err = serve_fails(&file, &sleep).await;
    assert!(err.contains("is not a directory"), "{err}");
    // Even root cannot create files in /proc/self/fd (a 0500 directory).
    let err = serve_fails(Path::new("/proc/self/fd"), &sleep).await;
    assert!(err.contains("not writable"), "{err}");

    // A running environment with a replica, then crashed.
    let state_sandbox = Sandbox::new().unwrap();
    let state = state_sandbox.path().to_path_buf();
    let mut env = EnvProcess::start(bin(), &state, "id-watermark", None, &[])
        .await
        .unwrap();
    let o = cli(bin(), &env.url, &["create", "r1", "--processes", "2"])
        .await
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    env.kill().await.unwrap();
    let services_dir = state.join("orchestrator");
    let list = |dir: std::path::PathBuf| async move {
        let o = lockstep_orchestrator::process::ProcessOrchestrator::new(
            lockstep_orchestrator::process::ProcessOrchestratorConfig::new(dir, 0),
        )
        .unwrap();
        use lockstep_orchestrator::Orchestrator;
        o.list_services().await.unwrap()
    };
    let before = list(services_dir.clone()).await;
    assert!(before[0].processes.iter().all(|p| p.running));
    let catalog = state.join("catalog.db");
    let catalog_bytes = std::fs::read(&catalog).unwrap();

    let err = serve_fails(
        &state,
        &["--service-binary", "/nonexistent/lockstep-replica"],
    )
    .await;
    assert!(
        err.contains("service binary /nonexistent/lockstep-replica does not exist"),
        "{err}"
    );
    assert_eq!(std::fs::read(&catalog).unwrap(), catalog_bytes);
    assert_eq!(list(services_dir.clone()).await, before, "nothing deleted");

    // The catalog is the file and its write-ahead log (the environment was
    // killed, so the log is still there and holds the newest pages): both
    // are lost and the file is garbage.
    let garbage = b"definitely not SQLite".repeat(300);
    std::fs::write(&catalog, &garbage).unwrap();
    for side in ["catalog.db-wal", "catalog.db-shm"] {
        let _ = std::fs::remove_file(state.join(side));
    }
    let err = serve_fails(&state, &sleep).await;
    assert!(err.contains("corrupt"), "{err}");
    assert_eq!(std::fs::read(&catalog).unwrap(), garbage, "not modified");
    assert_eq!(list(services_dir).await, before, "nothing deleted");
}

async fn stray_service(sandbox: &Sandbox, epoch: u64, id: u64) {
    use lockstep_orchestrator::process::{ProcessOrchestrator, ProcessOrchestratorConfig};
    use lockstep_orchestrator::{Orchestrator, ServiceConfig};
    let stray = ProcessOrchestrator::new(ProcessOrchestratorConfig::new(
        sandbox.path().join("orchestrator"),
        epoch,
    ))
    .unwrap();
    stray
        .ensure_service(
            ServiceConfig::new(format!("replica-{id}"), id, "sleep").fixed_args(["300"]),
        )
        .await
        .unwrap();
}

#[tokio::test]
async fn orphans_are_removed_in_the_background_while_serving() {
    use std::time::{Duration, Instant};
    for rule in ["epoch", "id-watermark"] {
        let sandbox = Sandbox::new().unwrap();
        let env = std::sync::Arc::new(
            lockstep_chaos::environment::load(sandbox.path(), rule, true).unwrap(),
        );
        env.ensure_replicas().await.unwrap();
        env.remove_orphans().await.unwrap();
        let r1 = env
            .create_replica(
                "r1",
                lockstep_catalog::ReplicaConfig {
                    processes: 1,
                    workers_per_process: 1,
                    config: String::new(),
                },
            )
            .await
            .unwrap();
        let task = env.spawn_orphan_removal(Duration::from_millis(50));
        // What a crashed older controller left behind: an older epoch, an ID
        // below our next ID, absent from the catalog.
        stray_service(&sandbox, env.epoch() - 1, r1.replica.id - 1).await;
        assert_eq!(sandbox.services().await.unwrap().len(), 2);
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let ids: Vec<u64> = sandbox
                .services()
                .await
                .unwrap()
                .iter()
                .map(|s| s.id)
                .collect();
            // The report is recorded just after the drop; wait for both.
            if ids == [r1.replica.id] && env.orphans_removed() == ["replica-0"] {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "rule {rule}: the orphan stayed: {ids:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(env.halted().is_none());

        if rule == "id-watermark" {
            // A service with an ID we never allocated: someone took over.
            stray_service(&sandbox, env.epoch() + 1, r1.replica.id + 5).await;
            let reason = tokio::time::timeout(Duration::from_secs(10), env.wait_halted())
                .await
                .expect("did not halt");
            assert!(reason.contains("another controller"), "{reason}");
            assert_eq!(
                sandbox.services().await.unwrap().len(),
                2,
                "a halting controller deletes nothing"
            );
        }
        task.abort();
    }
}

/// A policy that answers what it is told to, to check the safe default.
struct Scripted(Result<lockstep_policy::OrphanDecision, lockstep_policy::PolicyError>);

impl lockstep_policy::OrphanPolicy for Scripted {
    fn name(&self) -> &str {
        "scripted"
    }
    fn classify(
        &mut self,
        _services: &[lockstep_policy::Service],
        _view: &lockstep_policy::CatalogView,
    ) -> Result<lockstep_policy::OrphanDecision, lockstep_policy::PolicyError> {
        self.0.clone()
    }
}

#[tokio::test]
async fn a_failing_or_nonsensical_policy_deletes_nothing() {
    use lockstep_chaos::environment::sleep_template;
    use lockstep_environment::{Environment, EnvironmentConfig};
    use lockstep_policy::{OrphanDecision, PolicyError};
    let sandbox = Sandbox::new().unwrap();
    let answers = [
        // Deleting a replica our catalog holds is never an orphan removal.
        Ok(OrphanDecision::Delete(vec![1])),
        // Deleting something that was not listed.
        Ok(OrphanDecision::Delete(vec![42])),
        Err(PolicyError::Failed {
            policy: "scripted".into(),
            reason: "trapped".into(),
        }),
    ];
    for (i, answer) in answers.into_iter().enumerate() {
        let env = Environment::load(EnvironmentConfig::new(
            sandbox.path(),
            Box::new(Scripted(answer)),
            sleep_template(),
        ))
        .unwrap();
        env.ensure_replicas().await.unwrap();
        if i == 0 {
            env.create_replica(
                "r1",
                lockstep_catalog::ReplicaConfig {
                    processes: 1,
                    workers_per_process: 1,
                    config: String::new(),
                },
            )
            .await
            .unwrap();
        }
        let report = env.remove_orphans().await.unwrap();
        assert!(report.deleted.is_empty(), "answer {i}: {report:?}");
        assert!(report.policy_error.is_some(), "answer {i}: {report:?}");
        assert_eq!(sandbox.services().await.unwrap().len(), 1, "answer {i}");
        assert!(env.halted().is_none());
    }
}

/// The API needs a token, on loopback too, and every call must carry it:
/// without it or with another, UNAUTHENTICATED. By default `lockstep serve`
/// makes it in its state directory (`api.token`, 0600, kept across
/// restarts) and the CLI sends it from `--state-dir`; a given one
/// (`--api-token-file`) the CLI sends from `--token-file`. Without a token
/// (`--insecure-loopback`) it serves on loopback only.
#[tokio::test]
async fn the_api_token_is_required_by_default_and_checked_on_every_call() {
    let sandbox = Sandbox::new().unwrap();
    let o = tokio::process::Command::new(bin())
        .args(["serve", "--state-dir"])
        .arg(sandbox.path())
        .args(["--listen", "0.0.0.0:0", "--insecure-loopback"])
        .env_remove("LOCKSTEP_API_TOKEN")
        .output()
        .await
        .unwrap();
    assert_eq!(o.status.code(), Some(1), "{o:?}");
    assert!(
        stderr(&o).contains("refusing to serve the API on 0.0.0.0:0 without a token"),
        "{}",
        stderr(&o)
    );
    let short = sandbox.path().join("short.token");
    std::fs::write(&short, "abc\n").unwrap();
    let err = serve_fails(
        sandbox.path(),
        &["--api-token-file", short.to_str().unwrap()],
    )
    .await;
    assert!(err.contains("at least 16 characters"), "{err}");
    let placeholder = sandbox.path().join("placeholder.token");
    std::fs::write(
        &placeholder,
        "CHANGE-ME-to-a-random-token-of-32-or-more-characters\n",
    )
    .unwrap();
    let err = serve_fails(
        sandbox.path(),
        &["--api-token-file", placeholder.to_str().unwrap()],
    )
    .await;
    assert!(err.contains("the token is a placeholder"), "{err}");

    let token = sandbox.path().join("api.token");
    std::fs::write(&token, "a-long-enough-api-token\n").unwrap();
    let wrong = sandbox.path().join("wrong.token");
    std::fs::write(&wrong, "another-long-api-token\n").unwrap();
    let state = Sandbox::new().unwrap();
    let mut env = EnvProcess::start(
        bin(),
        state.path(),
        "id-watermark",
        None,
        &["--api-token-file", token.to_str().unwrap()],
    )
    .await
    .unwrap();
    let list = |extra: Vec<String>| {
        let url = env.url.clone();
        async move {
            let mut args: Vec<&str> = vec!["list"];
            args.extend(extra.iter().map(String::as_str));
            cli(bin(), &url, &args).await.unwrap()
        }
    };
    let o = list(vec![]).await;
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("requires an API token"),
        "{}",
        stderr(&o)
    );
    let o = list(vec!["--token-file".into(), wrong.display().to_string()]).await;
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("not this environment's"),
        "{}",
        stderr(&o)
    );
    let o = list(vec!["--token-file".into(), token.display().to_string()]).await;
    assert!(o.status.success(), "{}", stderr(&o));
    env.kill().await.unwrap();

    // The default: the token made in the state directory, on loopback too.
    let state = Sandbox::new().unwrap();
    let env = EnvProcess::start(bin(), state.path(), "id-watermark", None, &[])
        .await
        .unwrap();
    let made = env
        .token
        .clone()
        .expect("a token made in the state directory");
    assert!(
        made.len() == 64 && made.chars().all(|c| c.is_ascii_hexdigit()),
        "{made}"
    );
    let file = state.path().join("api.token");
    assert_eq!(std::fs::read_to_string(&file).unwrap(), format!("{made}\n"));
    assert_eq!(mode(&file), 0o600);
    assert_eq!(mode(&state.path().join("metrics.token")), 0o600);
    let o = cli_as_given(&env.url, &["list"]).await;
    assert!(!o.status.success(), "served a call without the token");
    assert!(
        stderr(&o).contains("requires an API token"),
        "{}",
        stderr(&o)
    );
    let metrics = state.path().join("metrics.token");
    let o = cli_as_given(
        &env.url,
        &["list", "--token-file", metrics.to_str().unwrap()],
    )
    .await;
    assert!(!o.status.success(), "the metrics token drove the API");
    let dir = state.path().to_str().unwrap();
    let o = cli_as_given(&env.url, &["list", "--state-dir", dir]).await;
    assert!(o.status.success(), "{}", stderr(&o));
    drop(env);

    // --insecure-loopback: no token on loopback.
    let state = Sandbox::new().unwrap();
    let env = EnvProcess::start(
        bin(),
        state.path(),
        "id-watermark",
        None,
        &["--insecure-loopback"],
    )
    .await
    .unwrap();
    assert_eq!(env.token, None);
    assert!(!state.path().join("api.token").exists());
    let o = cli_as_given(&env.url, &["list"]).await;
    assert!(o.status.success(), "{}", stderr(&o));
}

/// With --tls-cert and --tls-key the API speaks TLS (a key others could
/// write is refused): a client that trusts the certificate's CA
/// (`--tls-ca`) is served, one that does not cannot
/// connect, and plain HTTP/2 is not answered.
#[tokio::test]
async fn the_api_serves_tls_with_a_given_certificate() {
    let dir = Sandbox::new().unwrap();
    let p = |name: &str| dir.path().join(name).to_str().unwrap().to_string();
    let (ca, cert, key) = (p("ca.pem"), p("cert.pem"), p("key.pem"));
    // A CA, and a certificate for localhost that it signs (rcgen).
    let made = lockstep_pgtest::Certificates::for_localhost();
    std::fs::write(&ca, &made.ca_pem).unwrap();
    std::fs::write(&cert, &made.cert_pem).unwrap();
    std::fs::write(&key, &made.key_pem).unwrap();
    let state = Sandbox::new().unwrap();
    // A key other users could have written may have been planted: refused,
    // naming it.
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o666)).unwrap();
    let tls = ["--tls-cert", cert.as_str(), "--tls-key", key.as_str()];
    let start = || EnvProcess::start(bin(), state.path(), "id-watermark", None, &tls);
    let Err(refused) = start().await else {
        panic!("a key other users can write was used");
    };
    assert!(
        format!("{refused:#}").contains("is writable by other users"),
        "{refused:#}"
    );
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
    let mut env = start().await.unwrap();
    let https = env.url.replace("http://127.0.0.1", "https://localhost");
    let trusted = cli(bin(), &https, &["list", "--tls-ca", &ca])
        .await
        .unwrap();
    assert!(trusted.status.success(), "{}", stderr(&trusted));
    let untrusted = cli(bin(), &https, &["list"]).await.unwrap();
    assert!(
        !untrusted.status.success(),
        "a client that does not trust the certificate was served"
    );
    // Plain HTTP/2 on the TCP port (no token: nothing is refused before
    // it is sent).
    let plain = cli_as_given(&env.url, &["list"]).await;
    assert!(!plain.status.success(), "plain HTTP/2 was served");
    env.kill().await.unwrap();
}

/// With LOCKSTEP_LOG_FORMAT=json every log line of `lockstep serve` is one
/// JSON object, and a controller's lines carry its span (`controller`, with
/// the replica's ID); the replica's processes inherit the setting.
#[tokio::test]
async fn json_logs_carry_the_controllers_replica_and_reach_the_processes() {
    json_logs(&[], &[("LOCKSTEP_LOG_FORMAT".into(), "json".into())]).await;
}

/// The same with `--log-format json` on the command line.
#[tokio::test]
async fn the_log_format_flag_gives_the_same_json_logs() {
    json_logs(&["--log-format", "json"], &[]).await;
}

/// Starts `lockstep serve` with `args` and `vars`, which must make its logs
/// JSON, and checks them and the replica process's inherited setting.
async fn json_logs(args: &[&str], vars: &[(String, std::path::PathBuf)]) {
    let sandbox = Sandbox::new().unwrap();
    let env = EnvProcess::start_with_env(bin(), sandbox.path(), "epoch", None, args, vars)
        .await
        .unwrap();
    let o = cli(bin(), &env.url, &["create", "r1", "--processes", "1"])
        .await
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    // The services run `sleep 300`: the controller cannot connect, and says
    // so (within its connect bound) from inside its span.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(90);
    let lines = loop {
        let text = std::fs::read_to_string(&env.stderr_path).unwrap_or_default();
        let parsed: Vec<serde_json::Value> = text
            .lines()
            .map(|l| {
                serde_json::from_str(l).unwrap_or_else(|e| panic!("not a JSON line ({e}): {l}"))
            })
            .collect();
        if parsed.iter().any(|v| v["span"]["name"] == "controller") {
            break parsed;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no line from a controller's span within 90 s:\n{text}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    };
    let controller = lines
        .iter()
        .find(|v| v["span"]["name"] == "controller")
        .unwrap();
    assert_eq!(controller["span"]["replica"], 1, "{controller}");
    // The API call that created the replica logged inside its request span
    // (method and request ID).
    let created = lines
        .iter()
        .find(|v| v["message"] == "created")
        .unwrap_or_else(|| panic!("no `created` line: {lines:?}"));
    let request = created["spans"]
        .as_array()
        .and_then(|spans| spans.iter().find(|s| s["name"] == "request"))
        .unwrap_or_else(|| panic!("`created` is not inside a request span: {created}"));
    assert_eq!(request["method"], "CreateReplica", "{created}");
    assert!(
        request["id"].as_str().is_some_and(|id| !id.is_empty()),
        "{created}"
    );
    assert!(controller["message"].is_string(), "{controller}");
    let services = sandbox.services().await.unwrap();
    let pid = services[0].processes[0].pid.expect("the process runs");
    let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap();
    assert!(
        environ
            .split(|b| *b == 0)
            .any(|v| v == b"LOCKSTEP_LOG_FORMAT=json"),
        "the replica process did not inherit LOCKSTEP_LOG_FORMAT"
    );
}
