//! The demo, the README's main job: every piece on the embedded default.
//!
//! It starts `lockstep serve` (this very binary) on a fresh state directory,
//! creates a replica of 2 processes x 2 workers through the orchestrator's
//! process backend, creates three dataflows (a join, a reduce, a filter+map),
//! writes inputs with retractions over several timestamps, and checks every
//! peek and a subscription against a reference computed in plain Rust
//! ([`lockstep_plan::reference`]). Then it kills the environment with
//! SIGKILL, starts it again on the same state directory, and checks that the
//! replica's processes were adopted (same PIDs), that the new controller
//! reconnected, and that the answers, old and new, are still right.
//!
//! With `--hosts N` the environment is started with `lockstep serve --hosts
//! N`: the replica's two processes run on simulated hosts (network
//! namespaces of their own, `lockstep_orchestrator::hosts`), reach each
//! other by host name and are reached by the controller over veth links;
//! the demo checks that each process is in its own namespace.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use futures::StreamExt;
use lockstep_plan::reference::{at_time, evaluate, Multiset};
use lockstep_plan::text::parse_plan;
use lockstep_plan::Plan;
use lockstep_protocol::proto as wire;
use lockstep_protocol::Update;

use tokio::process::Command;

use crate::serve_child::{client, fetch_metrics, sample, start_env_with, Env};
use lockstep_environment::proto;

const STEPS: usize = 11;

fn step(n: usize, what: &str) {
    println!("demo: [{n}/{STEPS}] {what}");
}

/// Where the demo runs: the environment's `--store` (none: SQLite in the
/// state directory) and how many simulated hosts its replicas' processes
/// run on (0: none).
#[derive(Clone, Copy)]
struct On<'a> {
    store: Option<&'a str>,
    hosts: usize,
}

async fn start_env(bin: &Path, state: &Path, on: On<'_>) -> anyhow::Result<Env> {
    let hosts = on.hosts.to_string();
    let mut args = vec!["--metrics-listen", "127.0.0.1:0"];
    if on.hosts > 0 {
        args.extend(["--hosts", &hosts]);
    }
    if let Some(url) = on.store {
        args.extend(["--store", url]);
    }
    start_env_with(bin, state, &args).await
}

/// Checks that every process runs in a network namespace of its own (not
/// ours, not another's), and prints the namespaces' names.
fn check_hosts(pids: &[u32]) -> anyhow::Result<()> {
    let ns_of = |pid: &str| {
        std::fs::read_link(format!("/proc/{pid}/ns/net"))
            .with_context(|| format!("reading the network namespace of process {pid}"))
    };
    let ours = ns_of("self")?;
    let mut seen = Vec::new();
    for pid in pids {
        let theirs = ns_of(&pid.to_string())?;
        if theirs == ours || seen.contains(&theirs) {
            bail!("process {pid} does not run on a simulated host of its own ({theirs:?})");
        }
        seen.push(theirs);
        let name = std::process::Command::new("ip")
            .args(["netns", "identify", &pid.to_string()])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
            .unwrap_or_default();
        println!("demo:       process {pid} runs on simulated host {name}");
    }
    Ok(())
}

/// Checks the default posture on disk: the state directory 0700 and
/// everything in it (the tokens, the catalog) 0600 or 0700.
fn check_private(state: &Path) -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let mode = |p: &Path| -> anyhow::Result<u32> {
        Ok(std::fs::symlink_metadata(p)
            .with_context(|| format!("reading the mode of {}", p.display()))?
            .permissions()
            .mode()
            & 0o777)
    };
    if mode(state)? != 0o700 {
        bail!("the state directory is {:o}, not 0700", mode(state)?);
    }
    let mut open = Vec::new();
    for entry in std::fs::read_dir(state)? {
        let path = entry?.path();
        if mode(&path)? & 0o077 != 0 {
            open.push(format!("{} ({:o})", path.display(), mode(&path)?));
        }
    }
    if !open.is_empty() {
        bail!(
            "files of the state directory open to other users: {}",
            open.join(", ")
        );
    }
    println!(
        "demo:       state directory 0700, its files private; the API asks the token in {}",
        state
            .join(lockstep_environment::private::API_TOKEN_FILE)
            .display()
    );
    Ok(())
}

fn u(row: &[i64], time: u64, diff: i64) -> Update {
    Update {
        row: lockstep_plan::row(row),
        time,
        diff,
    }
}

/// The demo's inputs: collection 1 is (key, value) orders, collection 2 is
/// (key, price) items; times 0 to 3 with retractions.
fn writes() -> Vec<(u64, Vec<Update>, u64)> {
    vec![
        (
            1,
            vec![u(&[1, 10], 0, 1), u(&[2, 20], 0, 1), u(&[3, 30], 0, 2)],
            1,
        ),
        (
            2,
            vec![u(&[1, 100], 0, 1), u(&[2, 200], 0, 1), u(&[4, 400], 0, 1)],
            1,
        ),
        (
            1,
            vec![u(&[1, 10], 1, -1), u(&[1, 15], 1, 1), u(&[4, 40], 1, 1)],
            2,
        ),
        (2, vec![u(&[2, 200], 2, -1), u(&[2, 250], 2, 1)], 3),
        (1, vec![u(&[3, 30], 2, -1)], 3),
        (1, vec![], 4),
        (2, vec![u(&[3, 300], 3, 3)], 4),
    ]
}

/// Writes after the restart.
fn later_writes() -> Vec<(u64, Vec<Update>, u64)> {
    vec![
        (1, vec![u(&[2, 20], 4, -1), u(&[5, 50], 4, 1)], 5),
        (2, vec![u(&[5, 500], 4, 1)], 5),
    ]
}

/// A demo dataflow: name, inputs, exported collection, plan.
type DemoDataflow = (&'static str, Vec<u64>, u64, Plan);

fn dataflows() -> anyhow::Result<Vec<DemoDataflow>> {
    Ok(vec![
        (
            "join",
            vec![1, 2],
            101,
            parse_plan("join(get(1), get(2), #0, #0)")?,
        ),
        (
            "reduce",
            vec![1],
            102,
            parse_plan("reduce(get(1), [#0], count, sum(#1))")?,
        ),
        (
            "filter-map",
            vec![2],
            103,
            parse_plan("map(filter(get(2), #1 >= 200), #0, mul(#1, 2))")?,
        ),
    ])
}

fn reference(plan: &Plan, writes: &[(u64, Vec<Update>, u64)], t: u64) -> Multiset {
    let mut inputs: BTreeMap<u64, Vec<Update>> = BTreeMap::new();
    for (c, ups, _) in writes {
        inputs.entry(*c).or_default().extend(ups.iter().cloned());
    }
    evaluate(plan, &inputs, t)
}

async fn write_all(
    c: &mut crate::api_client::Client,
    writes: &[(u64, Vec<Update>, u64)],
) -> anyhow::Result<()> {
    for (collection, ups, upper) in writes {
        c.write_input(proto::WriteInputRequest {
            replica: "demo".into(),
            collection_id: *collection,
            updates: ups.iter().cloned().map(wire::Update::from).collect(),
            upper: *upper,
        })
        .await
        .with_context(|| format!("write to collection {collection}"))?;
    }
    Ok(())
}

async fn check_peeks(
    c: &mut crate::api_client::Client,
    writes: &[(u64, Vec<Update>, u64)],
    times: std::ops::Range<u64>,
) -> anyhow::Result<usize> {
    let mut checked = 0;
    for (name, _, collection, plan) in dataflows()? {
        for t in times.clone() {
            let rows = c
                .peek(proto::PeekRequest {
                    replica: "demo".into(),
                    collection_id: collection,
                    timestamp: t,
                })
                .await
                .with_context(|| format!("peek {name} at {t}"))?
                .into_inner()
                .rows;
            let got: Multiset = rows.into_iter().map(|r| (r.values, r.diff)).collect();
            let want = reference(&plan, writes, t);
            if got != want {
                bail!("peek of {name} (collection {collection}) at time {t}: got {got:?}, the reference says {want:?}");
            }
            checked += 1;
        }
    }
    Ok(checked)
}

async fn bad_requests(c: &mut crate::api_client::Client) -> anyhow::Result<()> {
    use tonic::Code;
    let undeclared = c
        .create_dataflow(proto::CreateDataflowRequest {
            replica: "demo".into(),
            name: "bad".into(),
            inputs: vec![1],
            exports: vec![wire::Export {
                collection_id: 900,
                description: lockstep_plan::encode(&parse_plan("get(7)")?),
            }],
            as_of: 0,
            format: String::new(),
        })
        .await;
    let taken = c
        .create_dataflow(proto::CreateDataflowRequest {
            replica: "demo".into(),
            name: "bad".into(),
            inputs: vec![1],
            exports: vec![wire::Export {
                collection_id: 101,
                description: lockstep_plan::encode(&parse_plan("get(1)")?),
            }],
            as_of: 0,
            format: String::new(),
        })
        .await;
    // 48 levels: decodable by the API, but past what a replica command may
    // carry (it used to be accepted, then refused by every replica, forever).
    let mut deep = parse_plan("get(1)")?;
    for _ in 1..48 {
        deep = lockstep_plan::Plan::Arrange {
            input: Box::new(deep),
            key: vec![0],
        };
    }
    let too_deep = c
        .create_dataflow(proto::CreateDataflowRequest {
            replica: "demo".into(),
            name: "bad".into(),
            inputs: vec![1],
            exports: vec![wire::Export {
                collection_id: 901,
                description: lockstep_plan::encode(&deep),
            }],
            as_of: 0,
            format: String::new(),
        })
        .await;
    let backwards = c
        .write_input(proto::WriteInputRequest {
            replica: "demo".into(),
            collection_id: 1,
            updates: vec![wire::Update {
                row: vec![9, 9],
                time: 0,
                diff: 1,
            }],
            upper: 5,
        })
        .await;
    let unknown = c
        .peek(proto::PeekRequest {
            replica: "nope".into(),
            collection_id: 101,
            timestamp: 0,
        })
        .await;
    for (what, result, code) in [
        (
            "a plan reading an undeclared collection",
            undeclared.map(|_| ()),
            Code::InvalidArgument,
        ),
        (
            "a plan nested 48 levels deep",
            too_deep.map(|_| ()),
            Code::InvalidArgument,
        ),
        (
            "a collection ID already in use",
            taken.map(|_| ()),
            Code::AlreadyExists,
        ),
        (
            "a write below the collection's upper",
            backwards.map(|_| ()),
            Code::OutOfRange,
        ),
        (
            "a peek on an unknown replica",
            unknown.map(|_| ()),
            Code::NotFound,
        ),
    ] {
        match result {
            Err(s) if s.code() == code => println!("demo:       refused {what}: {}", s.message()),
            Err(s) => bail!(
                "{what}: expected {code:?}, got {:?}: {}",
                s.code(),
                s.message()
            ),
            Ok(()) => bail!("{what} was accepted"),
        }
    }
    Ok(())
}

async fn replica_pids(c: &mut crate::api_client::Client) -> anyhow::Result<Vec<u32>> {
    let r = c
        .list_replicas(proto::ListReplicasRequest::default())
        .await?
        .into_inner();
    let demo = r
        .replicas
        .iter()
        .find(|r| r.name == "demo")
        .context("replica demo is not listed")?;
    Ok(demo.process_status.iter().map(|p| p.pid).collect())
}

/// Runs the demo; `keep` keeps the state directory; `store` is the
/// environment's `--store` (none: SQLite in the state directory; a
/// `postgres://` database must not hold another demo's catalog); `hosts` > 0
/// runs the replica's processes on that many simulated hosts (needs root).
pub async fn run(keep: bool, store: Option<String>, hosts: usize) -> anyhow::Result<()> {
    let started = Instant::now();
    let bin = std::env::current_exe().context("locating the lockstep binary")?;
    let dir = tempfile::Builder::new()
        .prefix("lockstep-demo-")
        .tempdir()?;
    let state = dir.path().to_path_buf();
    let on = On {
        store: store.as_deref(),
        hosts,
    };
    let result = run_in(&bin, &state, on).await;
    // Whatever happened, stop the replica's processes (and remove the
    // simulated hosts).
    let _ = lockstep_orchestrator::process::kill_all_services(
        &state.join(lockstep_environment::ORCHESTRATOR_DIR),
    );
    if keep {
        println!("demo: state kept in {}", dir.keep().display());
    }
    result?;
    println!("demo: ok ({:.1} s)", started.elapsed().as_secs_f64());
    Ok(())
}

async fn run_in(bin: &Path, state: &Path, on: On<'_>) -> anyhow::Result<()> {
    let hosts = on.hosts;
    let on_hosts = if hosts > 0 {
        format!(", its replicas' processes on {hosts} simulated hosts")
    } else {
        String::new()
    };
    let in_store = match on.store {
        Some(url) => format!(
            " (catalog and command logs in {})",
            lockstep_pg::redact(url)
        ),
        None => String::new(),
    };
    step(
        1,
        &format!(
            "starting the environment on {}{in_store}{on_hosts}",
            state.display()
        ),
    );
    let mut env = start_env(bin, state, on).await?;
    check_private(state)?;
    let mut c = env.client().await?;

    step(
        2,
        "creating replica `demo`: 2 processes x 2 workers, through the process orchestrator",
    );
    let pids = create_demo_replica(&mut c, hosts).await?;

    step(
        3,
        "creating three dataflows: a join, a reduce (count, sum), a filter+map",
    );
    for (name, inputs, collection, plan) in dataflows()? {
        let d = c
            .create_dataflow(proto::CreateDataflowRequest {
                replica: "demo".into(),
                name: name.into(),
                inputs,
                exports: vec![wire::Export {
                    collection_id: collection,
                    description: lockstep_plan::encode(&plan),
                }],
                as_of: 0,
                format: String::new(),
            })
            .await
            .with_context(|| format!("create dataflow {name}"))?
            .into_inner();
        println!(
            "demo:       dataflow {} `{name}`: {collection} = {plan}",
            d.dataflow.map(|d| d.id).unwrap_or_default()
        );
    }

    step(
        4,
        "subscribing to the reduce, then writing inputs at times 0..3 with retractions",
    );
    let mut sub = c
        .subscribe(proto::SubscribeRequest {
            replica: "demo".into(),
            collection_id: 102,
            as_of: 0,
            resume: false,
        })
        .await
        .context("subscribe")?
        .into_inner();
    let writes = writes();
    write_all(&mut c, &writes).await?;

    step(
        5,
        "checking every peek at every time against the plain-Rust reference",
    );
    let n = check_peeks(&mut c, &writes, 0..4).await?;
    println!("demo:       {n} peeks equal the reference");

    step(6, "checking the subscription against the reference");
    check_subscription(&mut sub, &writes).await?;
    drop(sub);

    step(
        7,
        "killing the environment (SIGKILL) and starting it again on the same state",
    );
    env.child.kill().await.context("killing the environment")?;
    let status = env.child.wait().await?;
    println!("demo:       environment exited: {status}");
    let env2 = start_env(bin, state, on).await?;
    let mut c = env2.client().await?;
    let after = replica_pids(&mut c).await?;
    if after != pids {
        bail!("the restarted environment did not adopt the replica: processes {pids:?} became {after:?}");
    }
    println!("demo:       the replica's processes {after:?} were adopted, not restarted");

    step(
        8,
        "checking that the new controller reconnected and the answers are still right",
    );
    let n = check_peeks(&mut c, &writes, 0..4).await?;
    println!("demo:       {n} peeks equal the reference after the restart");

    step(
        9,
        "writing more inputs through the new controller and checking again",
    );
    write_all(&mut c, &later_writes()).await?;
    let mut all = writes.clone();
    all.extend(later_writes());
    let n = check_peeks(&mut c, &all, 3..5).await?;
    println!("demo:       {n} more peeks equal the reference");

    step(
        10,
        "sending bad requests: each must be refused with a clear error, changing nothing",
    );
    bad_requests(&mut c).await?;
    refuse_without_token(&env2.url).await?;
    let n = check_peeks(&mut c, &all, 4..5).await?;
    println!("demo:       {n} peeks still equal the reference");

    step(
        11,
        "reading the Prometheus metrics of the restarted environment",
    );
    check_metrics_and_status(bin, state, &env2).await?;
    drop(env2);
    Ok(())
}

/// Step 2: replica `demo`, 2 processes x 2 workers; its processes' PIDs
/// (on their simulated hosts, if any).
async fn create_demo_replica(
    c: &mut crate::api_client::Client,
    hosts: usize,
) -> anyhow::Result<Vec<u32>> {
    let r = c
        .create_replica(proto::CreateReplicaRequest {
            name: "demo".into(),
            processes: 2,
            workers_per_process: 2,
            config: String::new(),
        })
        .await
        .context("create replica")?
        .into_inner();
    let pids: Vec<u32> = r
        .replica
        .iter()
        .flat_map(|r| r.process_status.iter().map(|p| p.pid))
        .collect();
    println!("demo:       replica processes {pids:?}");
    if hosts > 0 {
        check_hosts(&pids)?;
    }
    Ok(pids)
}

/// Step 6: the subscription's changes accumulate to the reference at every
/// time.
async fn check_subscription(
    sub: &mut tonic::Streaming<wire::SubscribeResponse>,
    writes: &[(u64, Vec<Update>, u64)],
) -> anyhow::Result<()> {
    let mut changes: Vec<Update> = Vec::new();
    loop {
        let batch = tokio::time::timeout(Duration::from_secs(30), sub.next())
            .await
            .context("no subscribe batch within 30 s")?
            .context("the subscription ended early")??;
        changes.extend(batch.updates.into_iter().map(Update::from));
        if batch.upper.first().is_none_or(|&t| t >= 4) {
            break;
        }
    }
    let (_, _, _, reduce) = dataflows()?.remove(1);
    for t in 0..4 {
        let want = reference(&reduce, writes, t);
        if at_time(&changes, t) != want {
            bail!("the subscription's changes accumulated at time {t} differ from the reference {want:?}");
        }
    }
    println!(
        "demo:       {} changes, accumulating to the reference at times 0..3",
        changes.len()
    );
    Ok(())
}

/// Step 10: private by default: a call on loopback without the token that
/// `serve` made in the state directory is refused, with and without a
/// wrong one.
async fn refuse_without_token(url: &str) -> anyhow::Result<()> {
    for (what, token) in [
        ("a call without the API token", None),
        (
            "a call with another token",
            Some("not-this-environments-token"),
        ),
    ] {
        match client(url, token)
            .await?
            .list_replicas(proto::ListReplicasRequest::default())
            .await
        {
            Err(s) if s.code() == tonic::Code::Unauthenticated => {
                println!("demo:       refused {what}: {}", s.message())
            }
            Err(s) => bail!(
                "{what}: expected Unauthenticated, got {:?}: {}",
                s.code(),
                s.message()
            ),
            Ok(_) => bail!("{what} was accepted"),
        }
    }
    Ok(())
}

/// Step 11: the restarted environment's Prometheus metrics, and
/// `lockstep status`.
async fn check_metrics_and_status(bin: &Path, state: &Path, env2: &Env) -> anyhow::Result<()> {
    let addr = env2
        .metrics
        .clone()
        .context("the environment printed no metrics address")?;
    // The replica's serving gauge and its processes' frontier lag are set
    // by a check every second.
    let deadline = Instant::now() + Duration::from_secs(10);
    let text = loop {
        let text = fetch_metrics(&addr, env2.metrics_token.as_deref()).await?;
        if sample(
            &text,
            "lockstep_environment_replica_serving{replica=\"demo\"}",
        ) == Some(1.0)
            && sample(
                &text,
                "lockstep_environment_process_frontier_lag{replica=\"demo\",process=\"0\"}",
            )
            .is_some()
        {
            break text;
        }
        if Instant::now() > deadline {
            bail!("the metrics never reported replica demo serving with its frontier lag:\n{text}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    for (name, at_least) in [
        (
            "lockstep_environment_api_requests_total{method=\"WriteInput\",code=\"OK\"}",
            2.0,
        ),
        (
            "lockstep_environment_api_requests_total{method=\"Peek\",code=\"OK\"}",
            18.0,
        ),
        (
            "lockstep_environment_api_requests_total{method=\"CreateDataflow\",code=\"INVALID_ARGUMENT\"}",
            2.0,
        ),
        ("lockstep_environment_controller_sessions_total{replica=\"demo\"}", 1.0),
        ("lockstep_environment_dataflows{replica=\"demo\"}", 3.0),
        // Present once the process reported every export; any lag passes.
        (
            "lockstep_environment_process_frontier_lag{replica=\"demo\",process=\"0\"}",
            0.0,
        ),
        ("lockstep_environment_epoch", 2.0),
    ] {
        match sample(&text, name) {
            Some(v) if v >= at_least => println!("demo:       {name} {v}"),
            other => bail!("metrics: {name} is {other:?}, expected at least {at_least}:\n{text}"),
        }
    }
    let out = Command::new(bin)
        .args(["status", "--server", &env2.url, "--state-dir"])
        .arg(state)
        .output()
        .await
        .context("running lockstep status")?;
    let summary = String::from_utf8_lossy(&out.stdout);
    if !out.status.success()
        || !summary
            .lines()
            .any(|l| l.starts_with("demo ") && l.trim_end().ends_with("yes"))
    {
        bail!(
            "lockstep status does not show replica demo serving:\n{summary}{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    println!("demo:       lockstep status:");
    for l in summary.lines() {
        println!("demo:         {l}");
    }
    Ok(())
}
