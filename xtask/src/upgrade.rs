//! `cargo xtask upgrade`: today's `lockstep serve` adopts the replica
//! processes of the newest release in `RELEASES` (docs/compatibility.md).
//!
//! 1. `git worktree add` the release's commit at `target/upgrade/src` and
//!    build its `lockstep` and `lockstep-replica` into
//!    `target/upgrade/target`; build today's into `target/debug`.
//! 2. Start the release's `lockstep serve` on a fresh state dir
//!    (`target/upgrade/state`) with the release's replica binary (copied to
//!    `target/upgrade/bin`, the one path both environments are given), create
//!    three replicas of 2 processes x 2 workers, one per strategy (`r1`
//!    barrier, the default; `r2` broadcast and `r3` log, by `policy set
//!    --replica`), two dataflows on each, write, peek.
//! 3. SIGKILL that environment (the replica processes run on), start
//!    today's `lockstep serve` on the same state dir (0700; in its default
//!    posture: from then on every client command sends the API token it
//!    makes there, by `--token-file`), and check: the same
//!    replica PIDs, no process restarted, no dataflow dropped by
//!    reconciliation (the replica logs' "reconciliation drops dataflow"
//!    lines), the version agreed with the old processes is 2 (today's `replica
//!    list`), the old answers are still right, and a new write is answered.
//! 4. Put today's `lockstep-replica` at the one path (a rename: the old
//!    binary is running) and run today's `lockstep replica upgrade` on each
//!    replica: every process restarts on it, reports protocol 3 and today's
//!    build, and the answers are right again; the downtimes it printed go
//!    into the contract line.
//!
//! Every client command is the release's own `lockstep` binary, so the API
//! is exercised across versions too. Not in `cargo xtask test`: it builds a
//! second copy of the workspace.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use crate::util::{build_bins, root, run, step};

mod reverse;
use reverse::reverse;

/// The newest release in `RELEASES`: (version, commit).
fn newest_release(root: &Path) -> anyhow::Result<(String, String)> {
    let text = std::fs::read_to_string(root.join("RELEASES")).context("reading RELEASES")?;
    text.lines()
        .map(str::trim)
        .rfind(|l| !l.is_empty() && !l.starts_with('#'))
        .and_then(|l| {
            let mut f = l.split_whitespace();
            Some((f.next()?.to_string(), f.next()?.to_string()))
        })
        .context("RELEASES names no release")
}

fn git(root: &Path, args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new("git")
        .current_dir(root)
        .args(args)
        .output()
        .with_context(|| format!("git {args:?}"))?;
    if !out.status.success() {
        bail!(
            "git {args:?}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// The environment of the scenario: its API's URL, and the API token
/// today's `lockstep serve` makes in the state directory (the release's
/// serves without one on loopback and makes none).
struct Server {
    url: String,
    token_file: PathBuf,
}

/// Runs a client command of `lockstep` against `server`, with the API token
/// once today's environment made it (`--token-file`, which the release's
/// client knows too); its stdout.
fn client(lockstep: &Path, server: &Server, args: &[&str]) -> anyhow::Result<String> {
    let mut cmd = Command::new(lockstep);
    cmd.args(args).arg("--server").arg(&server.url);
    if server.token_file.is_file() {
        cmd.arg("--token-file").arg(&server.token_file);
    }
    // A release's environment serves no socket in its state directory; the
    // token then goes over plain loopback HTTP (a release's client ignores
    // the variable).
    cmd.env("LOCKSTEP_INSECURE_PLAINTEXT", "true");
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {} {args:?}", lockstep.display()))?;
    if !out.status.success() {
        bail!(
            "lockstep {args:?} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Retries `f` every 200 ms for up to `bound`.
fn eventually<T>(
    what: &str,
    bound: Duration,
    mut f: impl FnMut() -> anyhow::Result<T>,
) -> anyhow::Result<T> {
    let started = Instant::now();
    loop {
        match f() {
            Ok(v) => return Ok(v),
            Err(e) if started.elapsed() > bound => {
                return Err(e.context(format!("{what}: not within {bound:?}")))
            }
            Err(_) => std::thread::sleep(Duration::from_millis(200)),
        }
    }
}

fn serve(
    lockstep: &Path,
    state: &Path,
    port: u16,
    replica_bin: &Path,
    log: &Path,
) -> anyhow::Result<Child> {
    let log = std::fs::File::create(log)?;
    Command::new(lockstep)
        .arg("serve")
        .arg("--state-dir")
        .arg(state)
        .arg("--listen")
        .arg(format!("127.0.0.1:{port}"))
        .arg("--service-binary")
        .arg(replica_bin)
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()
        .with_context(|| format!("starting {} serve", lockstep.display()))
}

/// A replica of the scenario: its name, the strategy it runs under and
/// the shipped policy that chooses it (`None`: the default, barrier).
struct ScenarioReplica {
    name: &'static str,
    strategy: &'static str,
    policy: Option<&'static str>,
}

/// One replica per strategy.
const REPLICAS: [ScenarioReplica; 3] = [
    ScenarioReplica {
        name: "r1",
        strategy: "barrier",
        policy: None,
    },
    ScenarioReplica {
        name: "r2",
        strategy: "broadcast",
        policy: Some("broadcast"),
    },
    ScenarioReplica {
        name: "r3",
        strategy: "log",
        policy: Some("log"),
    },
];

/// The answers of collections 100 (`get(1)`) and 101 (count and sum per
/// key) at time 0 and at time 1 (after the second write).
const AT_0: [&[&str]; 2] = [
    &["1,10\t1", "1,20\t1", "2,5\t1"],
    &["1,2,30\t1", "2,1,5\t1"],
];
const AT_1: [&[&str]; 2] = [
    &["1,20\t1", "2,5\t1", "3,7\t1"],
    &["1,1,20\t1", "2,1,5\t1", "3,1,7\t1"],
];

/// Writes `updates` (`ROW@TIME[:DIFF]`) to collection 1 of `replica`.
fn write(
    lockstep: &Path,
    server: &Server,
    replica: &str,
    updates: &[&str],
    upper: u64,
) -> anyhow::Result<()> {
    let upper = upper.to_string();
    let mut args = vec![
        "input",
        "write",
        "--replica",
        replica,
        "--collection",
        "1",
        "--upper",
        &upper,
    ];
    for u in updates {
        args.extend(["--update", u]);
    }
    client(lockstep, server, &args).map(drop)
}

/// Whether `replica`'s collections 100 and 101 answer `want` at `at`.
fn answers_are(
    lockstep: &Path,
    server: &Server,
    replica: &str,
    at: u64,
    want: &[&[&str]; 2],
) -> anyhow::Result<()> {
    for (collection, want) in [100, 101].into_iter().zip(want) {
        let got = peek(lockstep, server, replica, collection, at)?;
        if got != *want {
            bail!("replica {replica}: collection {collection} at {at}: {got:?}, not {want:?}");
        }
    }
    Ok(())
}

/// Waits (up to 90 s) until every scenario replica answers `want` at `at`.
fn every_replica_answers(
    lockstep: &Path,
    server: &Server,
    at: u64,
    want: &[&[&str]; 2],
    what: &str,
) -> anyhow::Result<()> {
    for r in REPLICAS {
        eventually(what, Duration::from_secs(90), || {
            answers_are(lockstep, server, r.name, at, want)
        })?;
    }
    Ok(())
}

/// `(index, pid, running)` of each process of replica `name` in `replica
/// list` output (a replica's line, then its processes' lines).
fn processes(list: &str, name: &str) -> Vec<(u32, u32, bool)> {
    let mut mine = false;
    list.lines()
        .filter_map(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            if w.first() != Some(&"process") {
                mine = w.get(1) == Some(&name);
                return None;
            }
            if !mine || w.len() < 5 || w[2] != "pid" {
                return None;
            }
            Some((w[1].parse().ok()?, w[3].parse().ok()?, w[4] == "running"))
        })
        .collect()
}

/// The peek's rows, sorted (`ROW\tDIFF` lines).
fn peek(
    lockstep: &Path,
    server: &Server,
    replica: &str,
    collection: u64,
    at: u64,
) -> anyhow::Result<Vec<String>> {
    let out = client(
        lockstep,
        server,
        &[
            "peek",
            "--replica",
            replica,
            "--collection",
            &collection.to_string(),
            "--at",
            &at.to_string(),
        ],
    )?;
    let mut rows: Vec<String> = out.lines().map(str::to_string).collect();
    rows.sort();
    Ok(rows)
}

/// Lines of every process log (`*.log*`) under `state` containing `needle`.
fn count_in_logs(state: &Path, needle: &str) -> anyhow::Result<usize> {
    let mut n = 0;
    let mut dirs = vec![state.to_path_buf()];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d)? {
            let p = e?.path();
            if p.is_dir() {
                dirs.push(p);
            } else if p
                .file_name()
                .is_some_and(|n| n.to_string_lossy().contains(".log"))
            {
                let text = std::fs::read_to_string(&p).unwrap_or_default();
                n += text.lines().filter(|l| l.contains(needle)).count();
            }
        }
    }
    Ok(n)
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

fn kill(pid: u32) {
    let _ = Command::new("kill").arg("-9").arg(pid.to_string()).status();
}

/// Builds both versions and runs the scenario; prints the contract lines.
pub fn upgrade() -> anyhow::Result<()> {
    let root = root();
    let (version, commit) = newest_release(&root)?;
    let head = git(&root, &["rev-parse", "HEAD"])?;
    if head == commit {
        bail!("HEAD is release {version} itself: nothing to upgrade from");
    }
    let base = root.join("target/upgrade");
    let src = base.join("src");
    step(&format!(
        "release {version} ({commit}) at {}",
        src.display()
    ));
    if src.exists() {
        let at = git(&src, &["rev-parse", "HEAD"])?;
        if at != commit {
            bail!(
                "{} is at {at}, not {commit}: remove it (git worktree remove --force {})",
                src.display(),
                src.display()
            );
        }
    } else {
        git(
            &root,
            &[
                "worktree",
                "add",
                "--detach",
                &src.to_string_lossy(),
                &commit,
            ],
        )?;
    }
    let started = Instant::now();
    // The old release's `lockstep` binary is in its `lockstep-environment`
    // package (lockstep-cli came later).
    let mut cmd = build_bins(&["lockstep-environment", "lockstep-replica"], None);
    cmd.current_dir(&src)
        .env("CARGO_TARGET_DIR", base.join("target"));
    run(cmd)?;
    let old_build = started.elapsed();
    step("today's lockstep, lockstep-replica and the shipped policies");
    crate::policies::build_all()?;
    let started = Instant::now();
    run(build_bins(&["lockstep-cli", "lockstep-replica"], None))?;
    let new_build = started.elapsed();
    let old_lockstep = base.join("target/debug/lockstep");
    let new_lockstep = root.join("target/debug/lockstep");

    // One replica binary path for both environments: an environment that
    // sees another command line for the service would restart it.
    let bin = base.join("bin");
    std::fs::create_dir_all(&bin)?;
    let replica_bin = bin.join("lockstep-replica");
    std::fs::copy(base.join("target/debug/lockstep-replica"), &replica_bin)?;
    let state = base.join("state");
    if state.exists() {
        std::fs::remove_dir_all(&state)?;
    }
    std::fs::create_dir_all(&state)?;
    // Private (0700): today's `lockstep serve` refuses a state directory
    // other users can enter. What the release's made in it under the
    // usual umask, today's narrows to 0600/0700.
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o700))?;
    }
    let port = free_port()?;
    // Today's environment serves in its default posture: every call with
    // the token it makes in the state directory.
    let server = Server {
        url: format!("http://127.0.0.1:{port}"),
        token_file: state.join("api.token"),
    };
    let scenario = Instant::now();

    step(&format!(
        "{version}: lockstep serve, a replica, dataflows, writes"
    ));
    let mut old_env = serve(
        &old_lockstep,
        &state,
        port,
        &replica_bin,
        &base.join("env-old.log"),
    )?;
    let mut pids: Vec<u32> = Vec::new();
    let result = (|| -> anyhow::Result<String> {
        eventually(
            "the release's environment serves",
            Duration::from_secs(60),
            || client(&old_lockstep, &server, &["status"]),
        )?;
        // One replica per strategy: barrier is the default policy, the
        // others are set on their replica (the policies today's xtask
        // built; the WIT interface is 0.1.0 on both sides).
        let policies = crate::policies::out_dir();
        for r in REPLICAS {
            client(
                &old_lockstep,
                &server,
                &[
                    "replica",
                    "create",
                    r.name,
                    "--processes",
                    "2",
                    "--workers",
                    "2",
                ],
            )?;
            if let Some(policy) = r.policy {
                let wasm = policies.join(format!("{policy}.wasm"));
                if !wasm.is_file() {
                    bail!("{} is missing: cargo xtask build-policies", wasm.display());
                }
                client(
                    &old_lockstep,
                    &server,
                    &[
                        "policy",
                        "set",
                        "--replica",
                        r.name,
                        &wasm.to_string_lossy(),
                    ],
                )?;
            }
            for (name, export) in [
                ("ident", "100=get(1)"),
                ("count", "101=reduce(get(1), [#0], count, sum(#1))"),
            ] {
                client(
                    &old_lockstep,
                    &server,
                    &[
                        "dataflow",
                        "create",
                        "--replica",
                        r.name,
                        "--name",
                        name,
                        "--input",
                        "1",
                        "--export",
                        export,
                    ],
                )?;
            }
            write(
                &old_lockstep,
                &server,
                r.name,
                &["1,10@0", "1,20@0", "2,5@0"],
                1,
            )?;
        }
        let mut before = Vec::new();
        every_replica_answers(&old_lockstep, &server, 0, &AT_0, "the release answers")?;
        for r in REPLICAS {
            let list = client(&old_lockstep, &server, &["replica", "list"])?;
            let procs = processes(&list, r.name);
            if procs.len() != 2 || !procs.iter().all(|p| p.2 && p.1 != 0) {
                bail!("the release's replica {} is not running: {list}", r.name);
            }
            before.push(procs.iter().map(|p| p.1).collect::<Vec<u32>>());
        }
        pids = before.concat();
        let dropped_before = count_in_logs(&state, "reconciliation drops dataflow")?;

        step(&format!(
            "SIGKILL {version}'s environment; today's lockstep serve on the same state"
        ));
        kill(old_env.id());
        let _ = old_env.wait();
        for pid in &pids {
            if !Path::new(&format!("/proc/{pid}")).exists() {
                bail!("replica process {pid} died with the release's environment");
            }
        }
        let mut new_env = serve(
            &new_lockstep,
            &state,
            port,
            &replica_bin,
            &base.join("env-new.log"),
        )?;
        let checks = (|| -> anyhow::Result<String> {
            every_replica_answers(
                &old_lockstep,
                &server,
                0,
                &AT_0,
                "today's environment answers the old peeks",
            )?;
            let list = eventually(
                "today's replica list shows the agreed version",
                Duration::from_secs(30),
                || {
                    let list = client(&new_lockstep, &server, &["replica", "list"])?;
                    if list.matches(" protocol 2").count() != 2 * REPLICAS.len() {
                        bail!("not every process agreed version 2 yet: {list}");
                    }
                    Ok(list)
                },
            )?;
            for (r, was) in REPLICAS.iter().zip(&before) {
                let now: Vec<u32> = processes(&list, r.name).iter().map(|p| p.1).collect();
                if &now != was {
                    bail!(
                        "replica {}: PIDs {was:?} before, {now:?} after: not adopted",
                        r.name
                    );
                }
            }
            if list.contains(" build ") {
                bail!("a {version} process reported a build version: {list}");
            }
            for r in REPLICAS {
                write(&old_lockstep, &server, r.name, &["3,7@1", "1,10@1:-1"], 2)?;
            }
            every_replica_answers(
                &old_lockstep,
                &server,
                1,
                &AT_1,
                "a write after the upgrade is answered",
            )?;
            let dropped = count_in_logs(&state, "reconciliation drops dataflow")? - dropped_before;
            if dropped != 0 {
                bail!("{dropped} dataflow(s) dropped by reconciliation after the upgrade");
            }
            let final_list = client(&new_lockstep, &server, &["replica", "list"])?;
            let restarts: Vec<&str> = final_list
                .lines()
                .filter(|l| l.trim_start().starts_with("process"))
                .filter(|l| !l.contains("restarts 0"))
                .collect();
            if !restarts.is_empty() {
                bail!("restarted processes: {restarts:?}");
            }

            // The replicas themselves move: today's replica binary put at
            // the path by a rename (the old one is running), then `lockstep
            // replica upgrade` restarts every process of each on it.
            step("lockstep replica upgrade, each replica onto today's lockstep-replica");
            let staged = bin.join("lockstep-replica.new");
            std::fs::copy(root.join("target/debug/lockstep-replica"), &staged)?;
            std::fs::rename(&staged, &replica_bin)?;
            let want = format!(
                "upgraded: no build version (protocol 2) -> build {} (protocol 3); down ",
                env!("CARGO_PKG_VERSION")
            );
            let mut downs = Vec::new();
            for r in REPLICAS {
                let upgraded = client(&new_lockstep, &server, &["replica", "upgrade", r.name])?;
                let prefix = format!("replica {} {want}", r.name);
                let Some(down) = upgraded
                    .lines()
                    .find_map(|l| l.strip_prefix(&prefix))
                    .and_then(|rest| rest.split_whitespace().next())
                else {
                    bail!("replica upgrade printed {upgraded:?}, not {prefix:?}");
                };
                downs.push(format!("{} ({}) {down} s", r.name, r.strategy));
            }
            let list = client(&new_lockstep, &server, &["replica", "list"])?;
            let moved: Vec<u32> = REPLICAS
                .iter()
                .flat_map(|r| processes(&list, r.name))
                .map(|p| p.1)
                .collect();
            if moved.len() != pids.len() || moved.iter().any(|p| pids.contains(p)) {
                bail!("replica upgrade kept a process of the release: {pids:?} -> {moved:?}");
            }
            every_replica_answers(
                &new_lockstep,
                &server,
                1,
                &AT_1,
                "the upgraded replica answers",
            )?;
            let strategies: Vec<&str> = REPLICAS.iter().map(|r| r.strategy).collect();
            Ok(format!(
                "upgrade: {version} -> HEAD {}: replicas {} (2x2, 2 dataflows each) adopted with the same PIDs {pids:?}, 0 restarts, 0 dataflows dropped by reconciliation, agreed protocol version 2, answers right before and after a new write\nupgrade: replica upgrade onto HEAD's binary (protocol 3, build {}): processes {pids:?} -> {moved:?}, down {} (restart to serving, rebuilt from the catalog), answers right after",
                &head[..7],
                strategies.join(", "),
                env!("CARGO_PKG_VERSION"),
                downs.join(", ")
            ))
        })();
        kill(new_env.id());
        let _ = new_env.wait();
        let line = checks?;
        let reverse = reverse(
            &version,
            (&old_lockstep, &new_lockstep),
            &state,
            &server,
            &replica_bin,
            &base,
        )?;
        Ok(format!("{line}\n{reverse}"))
    })();
    let _ = old_env.kill();
    for pid in &pids {
        kill(*pid);
    }
    // And the processes `replica upgrade` started, by their program path.
    let _ = Command::new("pkill")
        .arg("-9")
        .arg("-f")
        .arg(&replica_bin)
        .status();
    let line = result.context(format!(
        "logs: {}, {}, {}",
        base.join("env-old.log").display(),
        base.join("env-new.log").display(),
        state.join("orchestrator").display()
    ))?;
    println!("{line}");
    println!(
        "upgrade: build {version} {:.0} s, build HEAD {:.0} s, scenario {:.1} s",
        old_build.as_secs_f64(),
        new_build.as_secs_f64(),
        scenario.elapsed().as_secs_f64()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_process_lines_of_replica_list() {
        let list = "ID     NAME  PROCESSES WORKERS SERVICE EPOCH\n1 r1 2 2 replica-1 1\n    process 0 pid 123 running restarts 0 timely=1 controller=2 protocol 2\n    process 1 pid 0 down restarts 1 \n2 r2 1 1 replica-2 1\n    process 0 pid 456 running restarts 0 timely=3 controller=4\n";
        assert_eq!(processes(list, "r1"), vec![(0, 123, true), (1, 0, false)]);
        assert_eq!(processes(list, "r2"), vec![(0, 456, true)]);
    }

    #[test]
    fn the_newest_release_is_the_last_line() {
        let (version, commit) = newest_release(&root()).unwrap();
        assert!(version.starts_with('v'), "{version}");
        assert_eq!(commit.len(), 40, "{commit}");
    }
}
