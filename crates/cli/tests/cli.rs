//! The `lockstep` CLI for scripts and people, on a real `lockstep serve`
//! with a real replica: `-o json` on every list and status command (parsed
//! here with serde_json), tables as wide as their content, `replica create
//! --wait`, shell completions, and `-o` refusing an unknown format; errors
//! in lockstep's words with the gRPC code's name, `--server HOST:PORT`
//! without a scheme, and no ANSI colour in a replica process's log file.

use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::time::Duration;

mod common;

use lockstep_chaos::environment::Sandbox;
use serde_json::Value;

fn bin() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_lockstep"))
}

/// Every bounded wait of this test.
const WAIT: Duration = Duration::from_secs(90);

/// A `lockstep serve` of this test: its API's URL and its state directory,
/// whose `api.token` (made by `lockstep serve`) the CLI sends, given the
/// directory as a user gives it (`LOCKSTEP_STATE_DIR`).
struct Api {
    url: String,
    state: PathBuf,
}

/// Runs `lockstep ARGS` (bounded).
async fn run(args: &[&str]) -> Output {
    command(args, None).await
}

/// Runs `lockstep ARGS --server URL` against `api` (bounded).
async fn run_on(api: &Api, args: &[&str]) -> Output {
    let mut all = args.to_vec();
    all.extend(["--server", &api.url]);
    command(&all, Some(&api.state)).await
}

/// Runs `lockstep ARGS` with `LOCKSTEP_STATE_DIR` set to `state`, if any
/// (bounded).
async fn command(args: &[&str], state: Option<&Path>) -> Output {
    let mut cmd = tokio::process::Command::new(bin());
    cmd.args(args).stdin(Stdio::null()).kill_on_drop(true);
    match state {
        Some(state) => cmd.env("LOCKSTEP_STATE_DIR", state),
        None => cmd.env_remove("LOCKSTEP_STATE_DIR"),
    };
    tokio::time::timeout(WAIT, cmd.output())
        .await
        .expect("the CLI finished in time")
        .unwrap()
}

/// Runs `lockstep ARGS --server URL` against `api`, which must succeed; its
/// stdout.
async fn ok(api: &Api, args: &[&str]) -> String {
    let o = run_on(api, args).await;
    assert!(
        o.status.success(),
        "lockstep {args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout).unwrap()
}

/// `lockstep ARGS -o json`, parsed.
async fn json(api: &Api, args: &[&str]) -> Value {
    let mut all = args.to_vec();
    all.extend(["-o", "json"]);
    let text = ok(api, &all).await;
    serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("lockstep {all:?}: not JSON ({e}): {text}"))
}

/// Starts `lockstep serve` on `sandbox` with `extra` arguments; the child
/// (killed on drop) and its API.
async fn serve(sandbox: &Sandbox, extra: &[&str]) -> (tokio::process::Child, Api) {
    let (child, url) = common::serve(sandbox.path(), &common::replica_binary(), extra).await;
    let state = sandbox.path().to_path_buf();
    (child, Api { url, state })
}

/// `lockstep input write --replica REPLICA --collection ARGS`, which must
/// succeed.
async fn write(api: &Api, replica: &str, args: &[&str]) {
    let all = [
        &["input", "write", "--replica", replica, "--collection"][..],
        args,
    ]
    .concat();
    ok(api, &all).await;
}

/// The PIDs of replica `name`'s processes, from `replica list -o json`.
async fn pids(api: &Api, name: &str) -> Vec<u64> {
    let v = json(api, &["replica", "list"]).await;
    let r = v["replicas"]
        .as_array()
        .and_then(|rs| rs.iter().find(|r| r["name"] == name))
        .unwrap_or_else(|| panic!("no replica {name}: {v}"))
        .clone();
    r["process_status"]
        .as_array()
        .expect("process_status")
        .iter()
        .map(|p| p["pid"].as_u64().expect("a pid"))
        .collect()
}

/// `lockstep replica upgrade` restarts every process as one new generation
/// and checks the build they report: asked for a build they do not run, it
/// exits 1 naming what they report; asked for this build, it prints the
/// builds before and after and the downtime. The replica rehydrates: the
/// answer after is the answer before. An unknown replica is NOT_FOUND.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replica_upgrade_restarts_every_process_and_checks_the_build() {
    let sandbox = Sandbox::new().unwrap();
    let (_serve, api) = serve(&sandbox, &[]).await;
    let version = env!("CARGO_PKG_VERSION");
    ok(
        &api,
        &["replica", "create", "u", "--processes", "2", "--wait"],
    )
    .await;
    ok(
        &api,
        &[
            "dataflow",
            "create",
            "--replica",
            "u",
            "--input",
            "1",
            "--export",
            "101=get(1)",
        ],
    )
    .await;
    let collection = ["--replica", "u", "--collection"];
    write(&api, "u", &["1", "--upper", "1", "--update", "1,10@0"]).await;
    let peek = [&["peek"][..], &collection, &["101", "--at", "0"]].concat();
    assert_eq!(ok(&api, &peek).await.trim(), "1,10\t1");
    let first = pids(&api, "u").await;

    // Not the build the processes run: restarted, then refused by name.
    let o = run_on(&api, &["replica", "upgrade", "u", "--to", "9.9.9"]).await;
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("not on build 9.9.9") && err.contains(&format!("reports build {version}")),
        "{err}"
    );
    let second = pids(&api, "u").await;
    assert!(
        first.iter().all(|p| !second.contains(p)),
        "every process restarted: {first:?} then {second:?}"
    );

    // This build: upgraded, with the builds and the downtime printed.
    let out = ok(&api, &["replica", "upgrade", "u"]).await;
    assert!(
        out.contains(&format!(
            "replica u upgraded: build {version} (protocol 3) -> build {version} (protocol 3); down "
        )),
        "{out}"
    );
    let third = pids(&api, "u").await;
    assert!(
        second.iter().all(|p| !third.contains(p)),
        "every process restarted: {second:?} then {third:?}"
    );
    assert_eq!(ok(&api, &peek).await.trim(), "1,10\t1", "rehydrated");

    let o = run_on(&api, &["replica", "restart", "nosuch"]).await;
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("NOT_FOUND: "), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_list_and_status_command_prints_json_and_tables_fit_their_content() {
    let sandbox = Sandbox::new().unwrap();
    // A small answer limit, so that a peek can exceed it here.
    let (mut server, api) = serve(&sandbox, &["--max-answer-bytes", "4096"]).await;

    // A replica with a name longer than the old fixed column (20), created
    // with --wait: it returns once the replica serves.
    let long = "a-replica-named-longer-than-twenty-characters";
    let out = ok(
        &api,
        &[
            "replica",
            "create",
            long,
            "--processes",
            "2",
            "--wait",
            "--timeout",
            "60",
        ],
    )
    .await;
    assert!(
        out.contains(&format!("replica {long} serving after")),
        "{out}"
    );
    ok(
        &api,
        &[
            "dataflow",
            "create",
            "--replica",
            long,
            "--input",
            "1",
            "--export",
            "101=reduce(get(1), [#0], count)",
        ],
    )
    .await;

    // replica list -o json.
    let v = json(&api, &["replica", "list"]).await;
    let replicas = v["replicas"].as_array().expect("replicas: an array");
    assert_eq!(replicas.len(), 1, "{v}");
    let r = &replicas[0];
    assert_eq!(r["name"], long);
    assert_eq!(r["processes"], 2);
    assert_eq!(r["workers_per_process"], 1);
    assert_eq!(r["service"], "replica-1");
    let processes = r["process_status"].as_array().expect("process_status");
    assert_eq!(processes.len(), 2, "{v}");
    for p in processes {
        assert_eq!(p["running"], true, "{p}");
        assert!(p["pid"].as_u64().is_some_and(|pid| pid > 0), "{p}");
        assert!(p["addresses"]["controller"].is_string(), "{p}");
    }

    // status -o json: after --wait, the replica serves.
    let v = json(&api, &["status"]).await;
    assert_eq!(v["epoch"], 1, "{v}");
    assert_eq!(v["orphan_rule"], "id-watermark");
    assert_eq!(v["replicas"][0]["name"], long);
    assert_eq!(v["replicas"][0]["running"], 2);
    assert_eq!(v["replicas"][0]["serving"], "SERVING", "{v}");
    assert_eq!(
        v["replicas"][0]["frontier_lag"].as_array().map(Vec::len),
        Some(2)
    );
    assert!(v["replicas"][0]["reconfiguration"].is_null(), "{v}");
    assert!(
        v["replicas"][0]["live_dataflows"].as_u64().is_some(),
        "its controller counts its dataflows: {v}"
    );

    // dataflow list -o json.
    let v = json(&api, &["dataflow", "list"]).await;
    let d = &v["dataflows"][0];
    assert_eq!(d["replica"], long, "{v}");
    assert_eq!(d["inputs"], serde_json::json!([1]));
    assert_eq!(d["exports"][0]["collection_id"], 101);
    assert!(
        d["exports"][0]["plan"]
            .as_str()
            .is_some_and(|p| p.starts_with("reduce(get(1)")),
        "{v}"
    );

    // policy show -o json.
    let v = json(&api, &["policy", "show"]).await;
    let policies = v["policies"].as_array().expect("policies");
    assert!(
        policies.iter().any(|p| p["kind"] == "orphans"
            && p["name"] == "id-watermark"
            && p["replica"].is_null()),
        "{v}"
    );

    // The table sizes its columns to the long name: the row's next column
    // starts where the header's does.
    let table = ok(&api, &["replica", "list"]).await;
    let mut lines = table.lines();
    let header = lines.next().unwrap();
    let row = lines.next().unwrap();
    let name_at = header.find("NAME").unwrap();
    assert_eq!(row.find(long), Some(name_at), "{table}");
    let after_name = name_at + long.len();
    assert!(
        header[after_name..].starts_with("  ") && row[after_name..].starts_with("  "),
        "the NAME column is as wide as the name:\n{table}"
    );
    assert!(header.ends_with("EPOCH") && row.ends_with('1'), "{table}");

    // A peek answer over the API's answer limit (4096 bytes here) is
    // RESOURCE_EXHAUSTED naming the limit; a smaller one is answered.
    let collection = ["--replica", long, "--collection"];
    write(&api, long, &["1", "--upper", "1", "--update", "1,10@0"]).await;
    let small = ok(
        &api,
        &[&["peek"][..], &collection, &["101", "--at", "0"]].concat(),
    )
    .await;
    assert_eq!(small.trim(), "1,1\t1", "{small}");
    let updates: Vec<String> = (0..1000).map(|i| format!("{i},{i}@1")).collect();
    let mut write: Vec<&str> =
        [&["input", "write"][..], &collection, &["1", "--upper", "2"]].concat();
    for u in &updates {
        write.extend(["--update", u]);
    }
    ok(&api, &write).await;
    let o = run_on(
        &api,
        &[&["peek"][..], &collection, &["101", "--at", "1"]].concat(),
    )
    .await;
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("RESOURCE_EXHAUSTED: ") && err.contains("answer limit of 4096 bytes"),
        "{err}"
    );

    // An unknown format is a usage error (2).
    let o = run_on(&api, &["replica", "list", "-o", "yaml"]).await;
    assert_eq!(o.status.code(), Some(2), "{o:?}");

    // Shell completions.
    for shell in ["bash", "zsh", "fish"] {
        let o = run(&["completions", shell]).await;
        assert!(o.status.success(), "{o:?}");
        let script = String::from_utf8(o.stdout).unwrap();
        assert!(
            script.contains("lockstep") && script.contains("replica"),
            "{shell}: {script}"
        );
    }

    // The man pages: lockstep(1) on stdout, and one per subcommand.
    let o = run(&["man"]).await;
    assert!(o.status.success(), "{o:?}");
    let page = String::from_utf8(o.stdout).unwrap();
    assert!(page.contains(".TH lockstep 1"), "{page}");
    assert!(page.contains("replica"), "{page}");
    let dir = tempfile::tempdir().unwrap();
    let o = run(&["man", "--out", dir.path().to_str().unwrap()]).await;
    assert!(o.status.success(), "{o:?}");
    for page in ["lockstep.1", "lockstep-serve.1", "lockstep-replica.1"] {
        let text = std::fs::read_to_string(dir.path().join(page))
            .unwrap_or_else(|e| panic!("{page}: {e}"));
        assert!(text.contains(".TH"), "{page}: {text}");
    }

    server.kill().await.unwrap();
}

/// `lockstep serve --orchestrator kubernetes` refuses a moving image tag
/// before it connects to any cluster: a replica must never mix builds.
#[tokio::test]
async fn serve_refuses_an_unpinned_replica_image() {
    let state = tempfile::tempdir().unwrap();
    for image in ["lockstep:latest", "lockstep", "registry:5000/lockstep"] {
        let out = tokio::time::timeout(
            WAIT,
            tokio::process::Command::new(bin())
                .args([
                    "serve",
                    "--listen",
                    "127.0.0.1:0",
                    "--orchestrator",
                    "kubernetes",
                ])
                .args(["--kubernetes-image", image])
                .arg("--state-dir")
                .arg(state.path().join("state"))
                .env("KUBECONFIG", state.path().join("no-such-kubeconfig"))
                .stdin(Stdio::null())
                .output(),
        )
        .await
        .expect("lockstep serve exited in time")
        .unwrap();
        assert!(!out.status.success(), "{image} was accepted");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains("--kubernetes-image") && stderr.contains("version tag or a digest"),
            "{image}: {stderr}"
        );
        assert!(
            !stderr.contains("connecting to the Kubernetes API server"),
            "{stderr}"
        );
    }
}

/// As a psql or kubectl user expects: an API error names its gRPC code
/// (`NOT_FOUND`) and the environment's message, not tonic's English for
/// the code; `--server HOST:PORT` needs no scheme (a bad one is refused
/// naming the forms); a replica process's log file (stderr not a terminal)
/// holds no ANSI escape.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_name_their_code_addresses_need_no_scheme_and_logs_have_no_colour() {
    let sandbox = Sandbox::new().unwrap();
    let (mut server, api) = serve(&sandbox, &[]).await;
    ok(
        &api,
        &[
            "replica",
            "create",
            "r1",
            "--processes",
            "1",
            "--wait",
            "--timeout",
            "60",
        ],
    )
    .await;
    let o = run_on(&api, &["replica", "drop", "nosuch"]).await;
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "dropped a replica that does not exist");
    assert!(stderr.contains("NOT_FOUND: "), "{stderr}");
    assert!(!stderr.contains("Some requested entity"), "{stderr}");

    let bare = Api {
        url: api.url.trim_start_matches("http://").to_string(),
        state: api.state.clone(),
    };
    assert!(ok(&bare, &["replica", "list"]).await.contains("r1"));
    let o = run_on(
        &Api {
            url: "not an address".into(),
            state: api.state.clone(),
        },
        &["replica", "list"],
    )
    .await;
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("is not an address"), "{stderr}");

    let log = sandbox.path().join("orchestrator/logs/replica-1-0.log");
    let bytes = std::fs::read(&log).unwrap();
    assert!(!bytes.is_empty(), "{} is empty", log.display());
    assert!(
        !bytes.contains(&0x1b),
        "ANSI escapes in {}: {}",
        log.display(),
        String::from_utf8_lossy(&bytes[..bytes.len().min(300)])
    );
    server.kill().await.unwrap();
}
