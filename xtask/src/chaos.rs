//! `cargo xtask chaos SUITE`: the fault suites on real processes.
//!
//! Each suite builds what it needs with the `failpoints` feature, runs its
//! scenarios, passes on the lines that say what broke and the one-JSON-line
//! summaries of the reporting contract (docs/invariants.md), and fails when a variant
//! that must pass failed or a negative control was not caught.
//!
//! Suites: `security` (attacks; `authenticated` must pass, the negative
//! control `open` must be caught; `crates/chaos/src/bin/security.rs`),
//! `orphans` (the orphan rules `epoch`, `id-watermark` and the
//! negative control `catalog-only`, each on the process backend, as
//! `RULE@kubernetes` on the Kubernetes backend over an in-memory API
//! server double, and as `RULE@postgres` with the catalog in a throw-away
//! PostgreSQL; scenarios in `crates/chaos/src/environment/`) and `distribution` (the strategies
//! `broadcast`, `barrier`, `log`, `log@postgres` (the command log in a
//! throw-away PostgreSQL), the negative control `naive`, and
//! `naive+history-check` (naive delivery, history check restarting the
//! replica) on real 2x2 and 3x1 replicas, and `STRATEGY@hosts`, network
//! partitions on two simulated hosts where namespaces can be made; scenarios
//! in `crates/chaos/src/bin/distribution.rs` and `distribution/partitions.rs`).
//!
//! `hostile` is a seeded hostile-neighbour campaign: attackers on every
//! port of a real `lockstep serve` and its replica processes, their
//! descriptors limited, while a token holder works and a process is killed;
//! `bounded` must pass, the negative controls `no-bounds`,
//! `released-ports`, `unowned-state` and `unproven-server` must be caught
//! (`crates/chaos/src/bin/hostile.rs`; `--seeds`, `--seed`, `--long`).
//!
//! `campaign` is a seeded random fault campaign on a real `lockstep serve`
//! and real replica processes, one variant per strategy (`broadcast`,
//! `barrier`, `log`, and the negative control `naive`), each seed a scenario
//! (`crates/chaos/src/bin/campaign.rs`); see [`CampaignArgs`]. Without
//! options it runs the quick set (`cargo xtask test` does): seeds 1–9 and
//! 20 × 60 operations, and the kept shrunk regressions.

use std::path::PathBuf;
use std::process::{Command, Stdio};

use anyhow::{bail, Context};

use crate::util::{build_bins, cargo, root, run, step, target_dir};

/// The suites `run` knows.
pub const SUITES: [&str; 5] = ["orphans", "distribution", "security", "campaign", "hostile"];

/// The options of `cargo xtask chaos campaign`, passed on to
/// `lockstep-chaos-campaign`.
#[derive(Clone, Debug, Default, clap::Args)]
pub struct CampaignArgs {
    /// For `campaign`: the seeds, `A..B` (B excluded) or `A..=B` (default: the quick set, 1..=8 with the kept regressions; 1, 2 and 103 for the @postgres and @hosts variants; 1..=10 for naive).
    #[arg(long)]
    pub seeds: Option<String>,
    /// For `campaign`: one seed (replays a failing one).
    #[arg(long, conflicts_with = "seeds")]
    pub seed: Option<u64>,
    /// For `campaign`: operations per seed (default 60).
    #[arg(long)]
    pub steps: Option<usize>,
    /// For `campaign`: run only these operations of the seed (`I,J,...`; a shrunk history).
    #[arg(long)]
    pub keep: Option<String>,
    /// For `campaign`: shrink a failing seed's history (drop operations while it still fails).
    #[arg(long)]
    pub shrink: bool,
    /// For `hostile`: the long run (seeds 1..=200 of `bounded`, 1..=20 of each control) instead of the quick set; for `distribution`: every scenario of a negative control, not only up to its first violation.
    #[arg(long)]
    pub long: bool,
}

/// Runs one suite by name (`strategies` only matters for `distribution`
/// and `campaign`; empty means the default set; `campaign` only matters
/// for `campaign`).
pub fn run_suite_with(
    suite: &str,
    strategies: &[String],
    campaign_args: &CampaignArgs,
) -> anyhow::Result<()> {
    match suite {
        "distribution" => distribution(strategies, campaign_args.long),
        "campaign" => campaign(strategies, campaign_args),
        "hostile" => hostile(strategies, campaign_args),
        other => run_suite(other),
    }
}

/// Runs one suite by name.
pub fn run_suite(suite: &str) -> anyhow::Result<()> {
    match suite {
        "orphans" => orphans(),
        "distribution" => distribution(&[], false),
        "security" => security(),
        "campaign" => campaign(&[], &CampaignArgs::default()),
        "hostile" => hostile(&[], &CampaignArgs::default()),
        other => bail!(
            "unknown chaos suite {other:?}; known: {}",
            SUITES.join(", ")
        ),
    }
}

/// Runs a suite binary, echoes its stdout, and checks the summary lines.
pub(crate) fn run_suite_binary(
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
    let summaries = stdout
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["suite"] == suite)
        .count();
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
    build_with_environment("lockstep-chaos")?;
    let bin = target_dir().join("debug").join("lockstep-chaos");
    // Three rules on the process backend, three on the Kubernetes one,
    // three with the catalog in PostgreSQL.
    run_suite_binary(bin, &["orphans"], "orphans", 9)
}

/// Builds `lockstep`, `lockstep-replica` and the chaos binaries (`suite`
/// named in the step) with the test features: the suites that drive a real
/// `lockstep serve` (the controller's failpoints reach `lockstep` through
/// lockstep-chaos, features being unified).
pub(crate) fn build_with_environment(suite: &str) -> anyhow::Result<()> {
    step(&format!(
        "building lockstep, lockstep-replica, lockstep-replica-reachability and {suite}"
    ));
    run(build_bins(
        &[
            "lockstep-cli",
            "lockstep-replica",
            "lockstep-example-reachability",
            "lockstep-chaos",
        ],
        Some(crate::tasks::TEST_FEATURES),
    ))
}

/// The security suite: attacks on real replicas and a real environment
/// (`crates/chaos/src/bin/security.rs`); `authenticated` must pass, `open`
/// (no session key, no API token) must be caught.
fn security() -> anyhow::Result<()> {
    build_with_environment("lockstep-chaos-security")?;
    let bin = target_dir().join("debug").join("lockstep-chaos-security");
    run_suite_binary(bin, &[], "security", 3)
}

/// The distribution fault suite; `every_scenario`: a negative control
/// runs every scenario rather than stopping at its first violation.
fn distribution(strategies: &[String], every_scenario: bool) -> anyhow::Result<()> {
    build_with_environment("lockstep-chaos-distribution")?;
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
        "broadcast+reachability",
        "barrier+reachability",
        "log+reachability",
        "naive+reachability",
    ]
    .map(String::from)
    .to_vec();
    // The partition variants (`crates/chaos/src/bin/distribution/partitions.rs`)
    // need simulated hosts: network namespaces, root and iproute2.
    if crate::tasks::hosts_available()? {
        defaults.extend(
            [
                "broadcast@hosts",
                "barrier@hosts",
                "log@hosts",
                "naive@hosts",
            ]
            .map(String::from),
        );
    }
    let strategies = if strategies.is_empty() {
        &defaults[..]
    } else {
        strategies
    };
    let mut args: Vec<&str> = strategies.iter().map(String::as_str).collect();
    if every_scenario {
        args.insert(0, "--every-scenario");
    }
    run_suite_binary(bin, &args, "distribution", strategies.len())
}

/// The seeded random fault campaign (`crates/chaos/src/bin/campaign.rs`):
/// builds `lockstep`, `lockstep-replica` and `lockstep-chaos-campaign` with
/// failpoints, the shipped distribution policies if missing, and a `naive`
/// policy for the negative control; runs the variants (default:
/// broadcast barrier log log@postgres, log@hosts where simulated hosts can
/// be made, naive, barrier+no-holds: compaction that ignores read holds,
/// I5's negative control, barrier+reconfigure: resizes and upgrades
/// that keep answering among the operations, with faults part-way, and
/// barrier+early-switch: reads sent to a standby before it has caught up,
/// I6's negative control).
fn campaign(strategies: &[String], args: &CampaignArgs) -> anyhow::Result<()> {
    build_with_environment("lockstep-chaos-campaign")?;
    let shipped = crate::policies::out_dir();
    if ["broadcast", "barrier", "log"]
        .iter()
        .any(|p| !shipped.join(format!("{p}.wasm")).exists())
    {
        crate::policies::build_all()?;
    }
    let mut defaults = ["broadcast", "barrier", "log", "log@postgres"]
        .map(String::from)
        .to_vec();
    // The link cuts need simulated hosts: network namespaces, root, iproute2.
    if crate::tasks::hosts_available()? {
        defaults.push("log@hosts".into());
    }
    defaults.push("naive".into());
    defaults.push("barrier+no-holds".into());
    defaults.push("barrier+reconfigure".into());
    defaults.push("barrier+early-switch".into());
    let strategies = if strategies.is_empty() {
        &defaults[..]
    } else {
        strategies
    };
    if strategies.iter().any(|s| s == "naive") {
        build_naive_policy()?;
    }
    let bin = target_dir().join("debug").join("lockstep-chaos-campaign");
    let mut argv: Vec<String> = Vec::new();
    if let Some(seeds) = &args.seeds {
        argv.extend(["--seeds".into(), seeds.clone()]);
    }
    if let Some(seed) = args.seed {
        argv.extend(["--seed".into(), seed.to_string()]);
    }
    if let Some(steps) = args.steps {
        argv.extend(["--steps".into(), steps.to_string()]);
    }
    if let Some(keep) = &args.keep {
        argv.extend(["--keep".into(), keep.clone()]);
    }
    if args.shrink {
        argv.push("--shrink".into());
    }
    for s in strategies {
        argv.extend(["--strategy".into(), s.clone()]);
    }
    let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
    run_suite_binary(bin, &argv, "campaign", strategies.len())
}

/// The seeded hostile-neighbour campaign (`crates/chaos/src/bin/hostile.rs`):
/// attackers on every port of a real `lockstep serve` and its replica
/// processes (descriptors limited with `prlimit`) while a token holder
/// writes and peeks and a process is killed; `bounded` must pass every
/// seed, `no-bounds` (the admission bounds off) and `released-ports` (the
/// orchestrator's ports released once chosen) must be caught. Without
/// options the quick set; `--seeds`/`--seed` and `--long` are passed on,
/// `--strategy` names the variants (`bounded`, `no-bounds`,
/// `released-ports`).
fn hostile(variants: &[String], args: &CampaignArgs) -> anyhow::Result<()> {
    build_with_environment("lockstep-chaos-hostile")?;
    let bin = target_dir().join("debug").join("lockstep-chaos-hostile");
    let mut argv: Vec<String> = Vec::new();
    if let Some(seeds) = &args.seeds {
        argv.extend(["--seeds".into(), seeds.clone()]);
    }
    if let Some(seed) = args.seed {
        argv.extend(["--seed".into(), seed.to_string()]);
    }
    if args.long {
        argv.push("--long".into());
    }
    for v in variants {
        argv.extend(["--variant".into(), v.clone()]);
    }
    let expected = if variants.is_empty() {
        5
    } else {
        variants.len()
    };
    let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
    run_suite_binary(bin, &argv, "hostile", expected)
}

/// Builds `target/lockstep/campaign-policies/naive.wasm`: a distribution
/// policy choosing `naive` (the negative control) for every command, in a
/// scratch workspace beside the scaffolds (`lockstep serve` needs
/// `--experiments-allow-naive` to follow it).
fn build_naive_policy() -> anyhow::Result<()> {
    let lockstep = root().join("target/lockstep");
    let out = lockstep.join("campaign-policies/naive.wasm");
    let dir = lockstep.join("campaign-policies/build");
    let crate_dir = dir.join("naive");
    std::fs::create_dir_all(crate_dir.join("src"))?;
    let sdk = root().join("crates/policy-sdk");
    std::fs::write(
        dir.join("Cargo.toml"),
        format!(
            r#"# Written by `cargo xtask chaos campaign`: the negative control's policy.
[workspace]
resolver = "2"
members = ["naive"]

[workspace.package]
version = "0.0.0"
edition = "2021"
publish = false

[workspace.dependencies]
lockstep-policy-sdk = {{ path = {sdk:?} }}
"#
        ),
    )?;
    std::fs::write(
        crate_dir.join("Cargo.toml"),
        r#"[package]
name = "lockstep-policy-campaign-naive"
version.workspace = true
edition.workspace = true
publish.workspace = true

[dependencies]
lockstep-policy-sdk.workspace = true
"#,
    )?;
    std::fs::write(
        crate_dir.join("src/lib.rs"),
        r#"//! `naive` for every command: the negative control of the campaign.

use lockstep_policy_sdk::distribution::{
    CommandInfo, Distribution, MismatchAction, MismatchInfo, Strategy,
};

/// Naive for every command, and a restart (which the campaign's negative
/// control turns off) rather than a collective reconciliation on a history
/// mismatch: nothing repairs what naive delivery breaks.
pub struct Naive;

impl Distribution for Naive {
    fn choose(_info: &CommandInfo) -> Strategy {
        Strategy::Naive
    }
    fn on_mismatch(_info: &MismatchInfo) -> MismatchAction {
        MismatchAction::RestartReplica
    }
}

lockstep_policy_sdk::export_distribution!(Naive);
"#,
    )?;
    let lock = dir.join("Cargo.lock");
    if !lock.exists() {
        std::fs::copy(
            root().join("crates/policy-host/tests/fixtures/Cargo.lock"),
            &lock,
        )?;
    }
    step("building the campaign's naive policy");
    crate::policies::ensure_wasm_target()?;
    let target = lockstep.join("test-policies-build");
    let mut cmd = cargo();
    cmd.args([
        "rustc",
        "--release",
        "--quiet",
        "-p",
        "lockstep-policy-campaign-naive",
        "--target",
        crate::policies::WASM_TARGET,
        "--manifest-path",
    ])
    .arg(dir.join("Cargo.toml"))
    .arg("--target-dir")
    .arg(&target)
    .args([
        "--crate-type",
        "cdylib",
        "--",
        "-C",
        "linker=wasm-component-ld",
        "-C",
        "strip=debuginfo",
    ]);
    run(cmd)?;
    let built = target.join(format!(
        "{}/release/lockstep_policy_campaign_naive.wasm",
        crate::policies::WASM_TARGET
    ));
    std::fs::create_dir_all(out.parent().expect("a directory"))?;
    std::fs::copy(&built, &out)
        .with_context(|| format!("copying {} to {}", built.display(), out.display()))?;
    Ok(())
}
