//! Running commands and finding the workspace.

use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Mutex;
use std::time::Instant;

use anyhow::{bail, Context};

/// The workspace root (the parent of `xtask/`).
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the workspace")
        .to_path_buf()
}

/// `cargo` as chosen by the cargo that runs us.
pub fn cargo() -> Command {
    let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    cmd.current_dir(root());
    cmd
}

/// `cargo run --release --quiet -p PACKAGE --bin BIN --` (the program's
/// arguments follow).
pub fn cargo_run_release(package: &str, bin: &str) -> Command {
    let mut cmd = cargo();
    cmd.args([
        "run",
        "--release",
        "--quiet",
        "-p",
        package,
        "--bin",
        bin,
        "--",
    ]);
    cmd
}

/// Set once `cargo test --workspace` with the test features has run: see
/// [`build_bins`].
static WORKSPACE_TESTS_BUILT: AtomicBool = AtomicBool::new(false);

/// Says that `cargo test --workspace --features TEST_FEATURES` has built
/// everything: [`build_bins`] with the test features builds the same units.
pub fn after_workspace_tests() {
    WORKSPACE_TESTS_BUILT.store(true, Relaxed);
}

/// Where programs the test command builds from pinned inputs (the Go
/// programs, cargo-deny) are kept between checkouts: `LOCKSTEP_CACHE_DIR`,
/// else `XDG_CACHE_HOME/lockstep`, else `HOME/.cache/lockstep`. `None`
/// without any of them (nothing is cached).
pub fn cache_root() -> Option<PathBuf> {
    std::env::var_os("LOCKSTEP_CACHE_DIR")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("XDG_CACHE_HOME").map(|d| PathBuf::from(d).join("lockstep")))
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/lockstep")))
}

/// The cargo target directory (CARGO_TARGET_DIR, or `target/`).
pub fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join("target"))
}

/// `cargo build --bins` of `packages` with `features` (none: the
/// production build). The one build command of the tasks that run
/// binaries: [`crate::tasks::TEST_FEATURES`] everywhere in `cargo xtask
/// test`, so that one build serves the tests, the demos and every suite.
///
/// Within `cargo xtask test` ([`after_workspace_tests`]) it builds every
/// package's binaries *and tests* (`--workspace --bins --tests`): features
/// are then resolved as `cargo test --workspace` resolves them
/// (dev-dependencies included), so after the test step it builds nothing.
/// Built per package without `--tests`, the binaries get another feature set
/// and were rebuilt from scratch (238 s of a fresh clone's 36-minute `cargo
/// xtask test`).
pub fn build_bins(packages: &[&str], features: Option<&str>) -> Command {
    let mut cmd = cargo();
    cmd.args(["build", "--bins"]);
    if features == Some(crate::tasks::TEST_FEATURES) && WORKSPACE_TESTS_BUILT.load(Relaxed) {
        cmd.args(["--workspace", "--tests"]);
    } else {
        for p in packages {
            cmd.args(["-p", p]);
        }
    }
    if let Some(f) = features {
        cmd.args(["--features", f]);
    }
    cmd
}

/// `cargo build --bins` of `packages`, which take no test feature: within
/// `cargo xtask test` (after [`after_workspace_tests`]) the test build's
/// own units ([`build_bins`] with the test features, which then builds
/// nothing), else the packages alone. Built alone inside the test, their
/// dependencies get another feature set (`lockstep-kube-double`'s tree
/// cost 69 s of a full run).
pub fn build_plain_bins(packages: &[&str]) -> Command {
    if WORKSPACE_TESTS_BUILT.load(Relaxed) {
        build_bins(packages, Some(crate::tasks::TEST_FEATURES))
    } else {
        build_bins(packages, None)
    }
}

/// Runs a command, echoing it, and fails with its exit status.
pub fn run(mut cmd: Command) -> anyhow::Result<()> {
    eprintln!("xtask: $ {}", show(&cmd));
    let status = cmd
        .status()
        .with_context(|| format!("could not start {}", show(&cmd)))?;
    if !status.success() {
        bail!("{} failed with {status} ({})", show(&cmd), room());
    }
    Ok(())
}

/// Free disk under the target directory and available memory: printed with
/// each step and with a failed command, since a full disk or memory shows
/// as a compiler or linker failure that names neither.
pub fn room() -> String {
    let dir = Some(target_dir())
        .filter(|d| d.exists())
        .unwrap_or_else(root);
    let disk = nix::sys::statvfs::statvfs(&dir)
        .map(|s| {
            format!(
                "{:.1} GB",
                s.blocks_available() as f64 * s.fragment_size() as f64 / 1e9
            )
        })
        .unwrap_or_else(|e| format!("unknown ({e})"));
    let memory = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            let line = m.lines().find(|l| l.starts_with("MemAvailable:"))?;
            let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
            Some(format!("{:.1} GB", kb / 1e6))
        })
        .unwrap_or_else(|| "unknown".to_string());
    format!("disk free {disk}, memory available {memory}")
}

/// Prints a step banner so long work shows progress.
pub fn step(what: &str) {
    let now = Instant::now();
    let mut steps = STEPS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((last, since)) = steps.last() {
        eprintln!("xtask: <== {last}: {:.1} s", secs(now, *since));
    }
    steps.push((what.to_string(), now));
    eprintln!("\nxtask: ==> {what} ({})", room());
}

/// Every step so far and when it started (it ends when the next starts).
static STEPS: Mutex<Vec<(String, Instant)>> = Mutex::new(Vec::new());

/// Seconds from `since` to `until`.
fn secs(until: Instant, since: Instant) -> f64 {
    until.duration_since(since).as_secs_f64()
}

/// Prints how long each step took (the last one until now) and the total:
/// where a long task such as `cargo xtask test` spends its time.
pub fn step_times() {
    let now = Instant::now();
    let steps = STEPS.lock().unwrap_or_else(|e| e.into_inner());
    let Some(first) = steps.first().map(|(_, t)| *t) else {
        return;
    };
    eprintln!("\nxtask: step times");
    let ends = steps.iter().skip(1).map(|(_, t)| *t).chain([now]);
    for ((what, since), end) in steps.iter().zip(ends) {
        eprintln!("  {what}: {:.1} s", secs(end, *since));
    }
    eprintln!("  total: {:.1} s", secs(now, first));
}

/// Runs a command quietly: its stdout, or an error naming the command and
/// quoting its stderr.
pub fn stdout(mut cmd: Command) -> anyhow::Result<String> {
    let out = cmd
        .output()
        .with_context(|| format!("could not start {}", show(&cmd)))?;
    if !out.status.success() {
        bail!(
            "{} failed ({}): {}",
            show(&cmd),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn show(cmd: &Command) -> String {
    let mut s = cmd.get_program().to_string_lossy().into_owned();
    for a in cmd.get_args() {
        s.push(' ');
        s.push_str(&a.to_string_lossy());
    }
    s
}

/// A temporary directory outside the checkout (named `PREFIX...`), for what
/// an adopter builds in a repository of their own; an error if TMPDIR puts
/// it inside the checkout.
pub fn scratch_outside(prefix: &str) -> anyhow::Result<tempfile::TempDir> {
    let scratch = tempfile::Builder::new()
        .prefix(prefix)
        .tempdir()
        .context("a temporary directory")?;
    if scratch.path().starts_with(root()) {
        bail!(
            "the temporary directory {} is inside the checkout: set TMPDIR elsewhere",
            scratch.path().display()
        );
    }
    Ok(scratch)
}

/// Copies the directory tree `from` to `to` (files and directories only).
pub fn copy_tree(from: &std::path::Path, to: &std::path::Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from).with_context(|| format!("reading {}", from.display()))? {
        let entry = entry?;
        let target = to.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            copy_tree(&entry.path(), &target)?;
        } else {
            std::fs::copy(entry.path(), &target)
                .with_context(|| format!("copying {}", entry.path().display()))?;
        }
    }
    Ok(())
}
