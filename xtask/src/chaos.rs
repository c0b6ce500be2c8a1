//! `cargo xtask chaos SUITE`: the fault suites on real processes.
//!
//! Each suite builds what it needs with the `failpoints` feature, runs its
//! scenarios, passes on the lines that say what broke and the one-JSON-line
//! summaries of the reporting contract (DESIGN.md), and fails when a variant
//! that must pass failed or a negative control was not caught.
//!
//! Suites: `security` (attacks; `authenticated` must pass, the negative
//! control `open` must be caught; `crates/chaos/src/bin/security.rs`),
//! `orphans` (the orphan rules `epoch`, `id-watermark` and the
//! negative control `catalog-only`, each on the process backend, as
//! `RULE@kubernetes` on the Kubernetes backend over an in-memory API
//! server double, and as `RULE@postgres` with the catalog in a throw-away
//! PostgreSQL; scenarios in `crates/environment/src/chaos.rs`) and `distribution` (the strategies
//! `broadcast`, `barrier`, `log`, `log@postgres` (the command log in a
//! throw-away PostgreSQL), the negative control `naive`, and
//! `naive+history-check` (naive delivery, history check restarting the
//! replica) on real 2x2 and 3x1 replicas, and `STRATEGY@hosts`, network
//! partitions on two simulated hosts where namespaces can be made; scenarios
//! in `crates/chaos/src/bin/distribution.rs` and `distribution/partitions.rs`).

use std::path::PathBuf;
use std::process::{Command, Stdio};

use anyhow::{bail, Context};

use crate::util::{cargo, root, run, step};

/// The suites `run` knows.
pub const SUITES: [&str; 3] = ["orphans", "distribution", "security"];

/// Runs one suite by name (`strategies` only matters for `distribution`;
/// empty means the default set).
pub fn run_suite_with(suite: &str, strategies: &[String]) -> anyhow::Result<()> {
    match suite {
        "distribution" => distribution(strategies),
        other => run_suite(other),
    }
}

/// Runs one suite by name.
pub fn run_suite(suite: &str) -> anyhow::Result<()> {
    match suite {
        "orphans" => orphans(),
        "distribution" => distribution(&[]),
        "security" => security(),
        other => bail!(
            "unknown chaos suite {other:?}; known: {}",
            SUITES.join(", ")
        ),
    }
}

fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join("target"))
}

/// Runs a suite binary, echoes its stdout, and checks the summary lines.
fn run_suite_binary(
    bin: PathBuf,
    args: &[&str],
    suite: &str,
    variants: usize,
) -> anyhow::Result<()> {
    step(&format!("chaos {suite}"));
    let out = Command::new(&bin)
        .args(args)
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("could not start {}", bin.display()))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    print!("{stdout}");
    let prefix = format!("{{\"suite\":\"{suite}\"");
    let summaries = stdout.lines().filter(|l| l.starts_with(&prefix)).count();
    if summaries != variants {
        bail!("chaos {suite}: expected {variants} summary lines, got {summaries}");
    }
    if !out.status.success() {
        bail!("chaos {suite}: a variant that must pass failed, or a negative control was not caught ({})", out.status);
    }
    eprintln!("xtask: chaos {suite}: ok");
    Ok(())
}

/// The orphan-removal suite.
fn orphans() -> anyhow::Result<()> {
    step("building lockstep and lockstep-chaos with failpoints");
    let mut cmd = cargo();
    cmd.args([
        "build",
        "-p",
        "lockstep-environment",
        "-p",
        "lockstep-chaos",
        "--features",
        "lockstep-environment/failpoints",
        "--bins",
    ]);
    run(cmd)?;
    let bin = target_dir().join("debug").join("lockstep-chaos");
    // Three rules on the process backend, three on the Kubernetes one,
    // three with the catalog in PostgreSQL.
    run_suite_binary(bin, &["orphans"], "orphans", 9)
}

/// The security suite: attacks on real replicas and a real environment
/// (`crates/chaos/src/bin/security.rs`); `authenticated` must pass, `open`
/// (no session key, no API token) must be caught.
fn security() -> anyhow::Result<()> {
    step("building lockstep, lockstep-replica and lockstep-chaos-security");
    let mut cmd = cargo();
    cmd.args([
        "build",
        "-p",
        "lockstep-environment",
        "-p",
        "lockstep-replica",
        "-p",
        "lockstep-chaos",
        "--bins",
        "--features",
        crate::tasks::TEST_FEATURES,
    ]);
    run(cmd)?;
    let bin = target_dir().join("debug").join("lockstep-chaos-security");
    run_suite_binary(bin, &[], "security", 2)
}

/// The distribution fault suite.
fn distribution(strategies: &[String]) -> anyhow::Result<()> {
    step("building lockstep-replica and lockstep-chaos-distribution (with failpoints)");
    let mut cmd = cargo();
    cmd.args([
        "build",
        "-p",
        "lockstep-replica",
        "-p",
        "lockstep-chaos",
        "--bins",
        "--features",
        crate::tasks::TEST_FEATURES,
    ]);
    run(cmd)?;
    let bin = target_dir()
        .join("debug")
        .join("lockstep-chaos-distribution");
    let mut defaults = [
        "broadcast",
        "barrier",
        "log",
        "log@postgres",
        "naive",
        "naive+history-check",
    ]
    .map(String::from)
    .to_vec();
    // The partition variants (`crates/chaos/src/bin/distribution/partitions.rs`)
    // need simulated hosts: network namespaces, root and iproute2.
    match crate::tasks::hosts_unavailable() {
        None => defaults.extend(
            [
                "broadcast@hosts",
                "barrier@hosts",
                "log@hosts",
                "naive@hosts",
            ]
            .map(String::from),
        ),
        Some(why) => {
            eprintln!("xtask: the @hosts variants of chaos distribution are skipped: {why}")
        }
    }
    let strategies = if strategies.is_empty() {
        &defaults[..]
    } else {
        strategies
    };
    let args: Vec<&str> = strategies.iter().map(String::as_str).collect();
    run_suite_binary(bin, &args, "distribution", strategies.len())
}
