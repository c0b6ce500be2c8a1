//! `lockstep-chaos-campaign`: a seeded random fault campaign on real
//! processes (`cargo xtask chaos campaign`).
//!
//! Each seed draws a replica shape (1-4 processes x 1-2 workers) and a
//! sequence of operations and faults, and drives a real `lockstep serve`
//! (its gRPC API) and the replica's real processes with them: dataflows
//! created from random plans over inputs 1-3 and dropped; writes of
//! inserts and retractions advancing the uppers; peeks; subscribes (one
//! kind resumed across a SIGKILL of the environment); the
//! environment killed with SIGKILL while idle, with a request in flight, or
//! with its controller crashed part-way through a broadcast (failpoint
//! `controller_partial_broadcast`) and started again on the same state
//! directory; a replica process killed with SIGKILL, or stopped (SIGSTOP)
//! and resumed; the distribution policy swapped at run time (SetPolicy);
//! the whole replica killed; and, in the variants with a place of their own
//! ([`variant`]), the PostgreSQL server under a `--store` environment
//! restarted with a write in flight (`STRATEGY@postgres`) or a simulated
//! host's control or mesh link cut and healed (`STRATEGY@hosts`). Every
//! request and its answer (or unknown fate)
//! is recorded; after the run the campaign checks:
//!
//! - **I2** the replica reaches the target within [`RECOVERY`] after the
//!   last fault: a fresh write to every input is acknowledged and every live
//!   dataflow answers a peek at the newest time;
//! - **I3** every acknowledged write is visible exactly once, every write
//!   of unknown fate wholly or not at all (each write inserts rows with
//!   unique IDs, so the peeks of the identity dataflows `get(k)` tell which
//!   happened), every peek and subscribe snapshot equals the plain-Rust
//!   reference at its time, over the writes that happened;
//! - **liveness of processes** exactly the catalog's replicas have
//!   processes, all of them alive.
//!
//! - **I1** (indirectly) the workers' creation logs are not exposed by the
//!   environment's API or by a per-process status. The campaign checks them
//!   through the environment's own history check, which compares every
//!   worker's creation log and installed dataflows each time the controller
//!   connects (every environment restart, every replica reconnect) and logs
//!   `workers disagree about what they applied` on a difference, with
//!   `creation_logs` = `differ` when the creation logs differ (read from
//!   its stderr after every operation: JSON lines, `LOCKSTEP_LOG_FORMAT=json`,
//!   the finding in `fields.creation_logs`; the level must be `warn` or
//!   finer: `LOCKSTEP_CAMPAIGN_LOG`, default `warn`). Creation logs that differ are
//!   a violation of I1, even though the environment then repairs them: the
//!   workers did build different dataflows. Installed sets that differ alone
//!   (a drop that reached some processes before the controller crashed,
//!   which `barrier` leaves to the collective reconciliation) are counted as
//!   partial drops repaired; more of them than faults injected means a
//!   repair did not take (I4: each fault leaves at most one command
//!   applied by some processes only). At the end the campaign kills the environment
//!   once more and starts it again, so that one more clean connection is
//!   checked.
//!
//! Each seed's line also counts the partial drops repaired and the replica
//! restarts for lost lockstep.
//!
//! The negative control `naive` runs a WASM policy choosing `naive` for
//! every command under `lockstep serve --experiments-allow-naive
//! --experiments-no-replica-restarts`: the controller's crash part-way
//! through a command leaves workers that applied different commands, which
//! the next connection's history check reports (I1), or a dataflow built on
//! some workers only, which never answers (I2).
//!
//! Every seed runs under a compaction lag drawn from none, 1, 2, 4 and 16
//! (`model::compaction_lag`), with a subscription following each input
//! through every fault (`follow.rs`), checked at every upper it reported.
//! The negative control `STRATEGY+no-holds` compacts ignoring the read
//! holds (failpoint `read_holds_off`): a replica rebuilt after a fault
//! continues a following subscription from inputs compacted past it, which
//! the check finds as a change missed or delivered twice (I3, I5).
//!
//! The `+reconfigure` variants draw resizes and upgrades that keep
//! answering (`reconfigure.rs`) with a reader peeking throughout; their
//! negative control `STRATEGY+early-switch` sends reads to a standby
//! before it has caught up, which holds a read up for seconds (I6).
//!
//! Usage: `lockstep-chaos-campaign [--seeds A..B | --seed S] [--steps N]
//! [--strategy X[@postgres|@hosts][+no-holds][+reconfigure|+early-switch] ...] [--keep I,J,...] [--shrink]`
//! (default, the quick set `cargo xtask test` runs: seeds [`QUICK_SEEDS`] ×
//! [`QUICK_STEPS`] operations and the shrunk [`REGRESSIONS`] for broadcast
//! barrier log, seeds [`QUICK_PLACE_SEEDS`] for the `@postgres` and `@hosts`
//! variants, seeds [`QUICK_NAIVE_SEEDS`] for naive,
//! [`QUICK_NO_HOLDS_SEEDS`] for `+no-holds` and [`QUICK_RECONFIGURE_SEEDS`]
//! for `+reconfigure` and `+early-switch`). Prints one line per seed,
//! the replay command of a failing one, then the reporting contract's JSON
//! line per strategy (suite `campaign`). Exits non-zero if a strategy that
//! must pass had a violation, any seed had a harness error, or a negative
//! control (`naive`, `+no-holds`, `+early-switch`) was not caught.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use futures::StreamExt;
use lockstep_chaos::environment::Sandbox;
use lockstep_chaos::outcome::{violation, Failure, Tally};
use lockstep_environment::proto;
use lockstep_environment::proto::environment_client::EnvironmentClient;
use lockstep_protocol::proto as wire;
use tokio::io::AsyncBufReadExt;
use tonic::transport::Channel;

#[path = "campaign/check.rs"]
mod check;
#[path = "campaign/env.rs"]
mod env;
#[path = "campaign/follow.rs"]
mod follow;
#[path = "campaign/model.rs"]
mod model;
#[path = "campaign/ops.rs"]
mod ops;
#[path = "campaign/reconfigure.rs"]
mod reconfigure;
#[path = "campaign/resume.rs"]
mod resume;
#[path = "campaign/run.rs"]
mod run;
#[path = "campaign/variant.rs"]
mod variant;

use env::{lockstep_binary, lockstep_dir, policy_file, target_debug, Client, Env};
use model::World;
use variant::{Place, SeedStore, Store, Variant};

const SUITE: &str = "campaign";
const REPLICA: &str = "c";
/// The bound on recovery after the last fault (I2): the environment
/// restarts a replica at most every 10 s (`REPLICA_RESTART_INTERVAL`).
const RECOVERY: Duration = Duration::from_secs(60);
/// The bound on one API call.
const CALL: Duration = Duration::from_secs(15);
/// The bound on one seed.
const SEED_BOUND: Duration = Duration::from_secs(360);
const STRATEGIES: [&str; 3] = ["broadcast", "barrier", "log"];

/// One seed's run: its sandbox, environment, client and model.
struct Run {
    seed: u64,
    /// The distribution policy's strategy.
    strategy: String,
    /// Where the environment runs.
    place: Place,
    /// `lockstep serve`'s arguments for that place (`--store`, `--hosts`).
    serve_args: Vec<String>,
    /// The seed's database (`@postgres`).
    store: Option<SeedStore>,
    /// The simulated hosts, adopted at the first link cut (`@hosts`).
    hosts: Option<lockstep_orchestrator::hosts::SimulatedHosts>,
    processes: u32,
    sandbox: Sandbox,
    env: Env,
    client: Client,
    world: World,
    /// Faults injected (for the seed's line).
    faults: usize,
    /// The environment runs with its controller crashed at the failpoint:
    /// it is killed and started again after this many more operations.
    crashed_for: Option<usize>,
    /// How far the environment's stderr has been read for the history
    /// check's findings (see [`Run::workers_agreed`]).
    log_read: usize,
    /// History mismatches in installed sets alone (see
    /// [`Run::workers_agreed`]), for the seed's line.
    partial_drops: usize,
    /// The failpoints of every environment the seed starts (a negative
    /// control's).
    failpoints: Option<&'static str>,
    /// The negative control of reconfigurations (`+early-switch`): every
    /// reconfiguration without a fault, so that its reads are checked.
    reads_switch_early: bool,
    /// The subscriptions that follow each input through the whole seed.
    follows: Vec<follow::Follow>,
}

/// Runs one seed with `keep` (indices of the operations to run; all if
/// `None`): its outcome and a line of what happened.
async fn run_seed(
    seed: u64,
    steps: usize,
    variant: &Variant,
    store: Option<&Store>,
    keep: Option<&BTreeSet<usize>>,
    history_file: &Path,
) -> (Result<(), Failure>, String) {
    let plan = model::with_place_fault(model::generate(seed, steps), seed, variant.place_fault());
    let plan = if variant.reconfigure {
        model::with_reconfigurations(plan, seed)
    } else {
        plan
    };
    let started = Instant::now();
    let mut run = match Run::setup(seed, variant, store, plan.processes, plan.workers).await {
        Ok(r) => r,
        Err(e) => return (Err(e), format!("{}x{}", plan.processes, plan.workers)),
    };
    let mut outcome = Ok(());
    for (i, op) in plan.ops.iter().enumerate() {
        if keep.is_some_and(|k| !k.contains(&i)) {
            continue;
        }
        if let Err(e) = run.step(i, *op).await.and_then(|()| run.workers_agreed(i)) {
            outcome = Err(e);
            break;
        }
    }
    let mut detail = String::new();
    if outcome.is_ok() {
        match run.check(steps).await {
            Ok(d) => detail = d,
            Err(e) => outcome = Err(e),
        }
    }
    let restarts = run
        .pids()
        .await
        .map(|p| format!("{p:?}"))
        .unwrap_or_default();
    run.world.log(format!("end: pids {restarts}; {outcome:?}"));
    let _ = std::fs::write(history_file, run.world.history.join("\n") + "\n");
    run.env.kill().await;
    let _ = std::fs::copy(
        run.sandbox.path().join("campaign-env.stderr"),
        history_file.with_extension("env.log"),
    );
    let orchestrator_dir = run
        .sandbox
        .path()
        .join(lockstep_environment::ORCHESTRATOR_DIR);
    if outcome.is_err() {
        // What the processes said and what the orchestrator recorded, for
        // the diagnosis (the sandbox goes with the run).
        keep_orchestrator_files(&orchestrator_dir, &history_file.with_extension("processes"));
    }
    let hosts = run.place == Place::Hosts;
    drop(run);
    if hosts {
        lockstep_orchestrator::hosts::remove_for_state_dir(&orchestrator_dir);
    }
    let line = format!(
        "{}x{}, {} faults, {:.0} s{}{}",
        plan.processes,
        plan.workers,
        plan.ops
            .iter()
            .enumerate()
            .filter(|(i, o)| o.is_fault() && keep.is_none_or(|k| k.contains(i)))
            .count(),
        started.elapsed().as_secs_f64(),
        if detail.is_empty() { "" } else { ", " },
        detail
    );
    (outcome, line)
}

/// Copies the replica processes' logs and the service records (without
/// their `.env` files, which hold the session key) of a failed run to `to`.
fn keep_orchestrator_files(orchestrator_dir: &Path, to: &Path) {
    let _ = std::fs::remove_dir_all(to);
    for sub in ["logs", "services"] {
        let Ok(entries) = std::fs::read_dir(orchestrator_dir.join(sub)) else {
            continue;
        };
        let _ = std::fs::create_dir_all(to.join(sub));
        for e in entries.flatten() {
            let name = e.file_name();
            if name.to_string_lossy().ends_with(".env") {
                continue;
            }
            let _ = std::fs::copy(e.path(), to.join(sub).join(name));
        }
    }
}

async fn bounded_seed(
    seed: u64,
    steps: usize,
    variant: &Variant,
    store: Option<&Store>,
    keep: Option<&BTreeSet<usize>>,
    history_file: &Path,
) -> (Result<(), Failure>, String) {
    match tokio::time::timeout(
        SEED_BOUND,
        run_seed(seed, steps, variant, store, keep, history_file),
    )
    .await
    {
        Ok(r) => r,
        Err(_) => (
            Err(Failure::Harness(format!(
                "the seed did not end within {SEED_BOUND:?}"
            ))),
            String::new(),
        ),
    }
}

fn same_failure(a: &Result<(), Failure>, b: &Result<(), Failure>) -> bool {
    match (a, b) {
        (
            Err(Failure::Violation { invariant: x, .. }),
            Err(Failure::Violation { invariant: y, .. }),
        ) => x == y,
        _ => false,
    }
}

/// Drops chunks of operations while the seed still fails with the same
/// invariant (at most `budget`); the operations kept.
async fn shrink(
    seed: u64,
    steps: usize,
    variant: &Variant,
    store: Option<&Store>,
    failure: &Result<(), Failure>,
    budget: Duration,
    scratch: &Path,
) -> BTreeSet<usize> {
    let started = Instant::now();
    let mut kept: Vec<usize> = (0..steps).collect();
    let mut chunk = kept.len().div_ceil(2);
    while chunk >= 1 && started.elapsed() < budget {
        let mut start = 0;
        let mut progressed = false;
        while start < kept.len() && started.elapsed() < budget {
            let candidate: BTreeSet<usize> = kept
                .iter()
                .enumerate()
                .filter(|(j, _)| *j < start || *j >= start + chunk)
                .map(|(_, i)| *i)
                .collect();
            let (o, _) = bounded_seed(seed, steps, variant, store, Some(&candidate), scratch).await;
            if same_failure(&o, failure) {
                eprintln!(
                    "campaign: shrink {variant} seed {seed}: {} operations still fail",
                    candidate.len()
                );
                kept = candidate.into_iter().collect();
                progressed = true;
            } else {
                start += chunk;
            }
        }
        if !progressed {
            chunk /= 2;
        }
    }
    kept.into_iter().collect()
}

struct Args {
    seeds: Vec<u64>,
    steps: usize,
    strategies: Vec<Variant>,
    keep: Option<BTreeSet<usize>>,
    shrink: bool,
    /// The quick set (no `--seeds`, `--seed` or `--keep`): the
    /// [`REGRESSIONS`] run too.
    regressions: bool,
}

/// The quick set's seeds (`cargo xtask test`): 1–8. (Seeds 9 and 20, on
/// which the peek-ID defect was found, ran here until the CI budget needed
/// their time; the shrunk [`REGRESSIONS`] reproduce that defect.)
const QUICK_SEEDS: [u64; 8] = [1, 2, 3, 4, 5, 6, 7, 8];

/// The quick set's seeds for the variants with a place of their own
/// (`@postgres`, `@hosts`): their faults are drawn in place of some of the
/// seed's operations, so these seeds run the embedded seeds' faults too.
/// Seed 103 found a defect as `log@hosts` in the long run (a process named
/// only by an unfinished record write survived the next environment start:
/// `crates/orchestrator/tests/process.rs`,
/// `a_process_named_only_by_an_unfinished_record_write_is_a_stray`, is its
/// deterministic regression; the seed's timing is not).
const QUICK_PLACE_SEEDS: [u64; 3] = [1, 2, 103];

/// The quick set's seeds for the negative control `naive`: more than for
/// the others, since whether a seed catches it depends on where the
/// controller's crashes land (3 to 6 of 10 seeds caught it in single runs,
/// 9 and 10 of 1–20 in two full runs, 9 of 1–14 in one).
const QUICK_NAIVE_SEEDS: std::ops::RangeInclusive<u64> = 1..=10;

/// The quick set's seeds for the negative control of read holds
/// (`+no-holds`): a seed catches it when a following subscription stalls
/// behind a fault while writes pass the lag and the replica is rebuilt, which
/// depends on timing: seeds 1–40 caught it 11 times in one run (6, 7, 10,
/// 23, 24, 25, 31, 33, 34, 36, 37), seed 6 in every run so far.
const QUICK_NO_HOLDS_SEEDS: [u64; 8] = [6, 7, 10, 23, 24, 25, 31, 33];

/// The quick set's seeds for the `+reconfigure` variants (resizes and
/// upgrades that keep answering, with faults part-way): seeds 1–3 of
/// `barrier+reconfigure` and 1–2 of `broadcast+reconfigure` and
/// `log+reconfigure` drew 3 to 6 of them each, every one checked.
const QUICK_RECONFIGURE_SEEDS: [u64; 2] = [1, 2];

/// The quick set's operations per seed.
const QUICK_STEPS: usize = 60;

/// Shrunk histories of defects the campaign found, kept as regressions:
/// (seed, operations the seed draws, the operations kept). Run for every
/// strategy that must pass in the quick set.
///
/// - seed 6, 50 operations, kept 19,20,28,29,30: after an environment
///   restart a restarted replica answered an earlier controller's peek
///   replayed from the command log, and the new controller, whose peek IDs
///   restarted at 1, took it for its own (I3; found as barrier seeds 6 and
///   9, broadcast and log seed 20; fixed by epoch-carrying request IDs).
const REGRESSIONS: [(u64, usize, &[usize]); 1] = [(6, 50, &[19, 20, 28, 29, 30])];

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        seeds: QUICK_SEEDS.to_vec(),
        steps: QUICK_STEPS,
        strategies: Vec::new(),
        keep: None,
        shrink: false,
        regressions: true,
    };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        let mut value = |name: &str| it.next().ok_or(format!("{name} needs a value"));
        match a.as_str() {
            "--seeds" => {
                args.regressions = false;
                let v = value("--seeds")?;
                let (a, b) = v
                    .split_once("..")
                    .ok_or("--seeds A..B (B excluded; A..=B includes it)")?;
                let (b, inclusive) = match b.strip_prefix('=') {
                    Some(b) => (b, true),
                    None => (b, false),
                };
                let a: u64 = a.parse().map_err(|e| format!("--seeds: {e}"))?;
                let b: u64 = b.parse().map_err(|e| format!("--seeds: {e}"))?;
                args.seeds = if inclusive {
                    (a..=b).collect()
                } else {
                    (a..b).collect()
                };
            }
            "--seed" => {
                args.regressions = false;
                args.seeds = vec![value("--seed")?
                    .parse()
                    .map_err(|e| format!("--seed: {e}"))?]
            }
            "--steps" => {
                args.steps = value("--steps")?
                    .parse()
                    .map_err(|e| format!("--steps: {e}"))?
            }
            "--strategy" => args.strategies.push(Variant::parse(&value("--strategy")?)?),
            "--keep" => {
                args.regressions = false;
                let v = value("--keep")?;
                args.keep = Some(
                    v.split(',')
                        .filter(|s| !s.is_empty())
                        .map(|s| s.parse().map_err(|e| format!("--keep: {e}")))
                        .collect::<Result<_, _>>()?,
                );
            }
            "--shrink" => args.shrink = true,
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    if args.strategies.is_empty() {
        args.strategies = ["broadcast", "barrier", "log", "naive"]
            .map(|s| Variant::parse(s).expect("known strategies"))
            .to_vec();
    }
    Ok(args)
}

fn main() {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("lockstep-chaos-campaign: {e}");
            std::process::exit(2);
        }
    };
    let mut missing: Vec<PathBuf> =
        vec![lockstep_binary(), target_debug().join("lockstep-replica")];
    missing.extend(STRATEGIES.iter().map(|s| policy_file(s)));
    if args.strategies.iter().any(|v| v.strategy == "naive") {
        missing.push(policy_file("naive"));
    }
    missing.retain(|p| !p.exists());
    if !missing.is_empty() {
        eprintln!(
            "lockstep-chaos-campaign: missing {missing:?}: build them (cargo xtask chaos campaign does)"
        );
        std::process::exit(2);
    }
    if args.strategies.iter().any(|s| s.place == Place::Hosts) {
        if let Err(e) = lockstep_orchestrator::hosts::available() {
            eprintln!("lockstep-chaos-campaign: the @hosts variants need simulated hosts: {e}");
            std::process::exit(2);
        }
    }
    // One throw-away PostgreSQL server for the `@postgres` variants; each
    // seed run gets a database of its own.
    let store = if args.strategies.iter().any(|s| s.place == Place::Postgres) {
        match Store::start() {
            Ok(s) => Some(s),
            Err(e) => {
                eprintln!("lockstep-chaos-campaign: the @postgres variants: {e}");
                std::process::exit(2);
            }
        }
    } else {
        None
    };
    let out_dir = lockstep_dir().join("campaign");
    let _ = std::fs::create_dir_all(&out_dir);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let mut ok = true;
    for strategy in &args.strategies {
        let negative = strategy.negative();
        let mut tally = Tally::default();
        let seeds: Vec<u64> = if args.regressions && strategy.holds_off {
            QUICK_NO_HOLDS_SEEDS.to_vec()
        } else if args.regressions && strategy.reconfigure {
            QUICK_RECONFIGURE_SEEDS.to_vec()
        } else if args.regressions && negative {
            QUICK_NAIVE_SEEDS.collect()
        } else if args.regressions && strategy.place != Place::Embedded {
            QUICK_PLACE_SEEDS.to_vec()
        } else {
            args.seeds.clone()
        };
        let mut cases: Vec<(u64, usize, Option<BTreeSet<usize>>)> = seeds
            .iter()
            .map(|&seed| (seed, args.steps, args.keep.clone()))
            .collect();
        if args.regressions
            && !negative
            && !strategy.reconfigure
            && strategy.place == Place::Embedded
        {
            cases.extend(
                REGRESSIONS.iter().map(|&(seed, steps, keep)| {
                    (seed, steps, Some(keep.iter().copied().collect()))
                }),
            );
        }
        for (seed, steps, keep) in cases {
            let keep_arg = keep
                .as_ref()
                .map(|k| {
                    let k: Vec<String> = k.iter().map(|i| i.to_string()).collect();
                    format!(" --keep {}", k.join(","))
                })
                .unwrap_or_default();
            let history = out_dir.join(format!(
                "{strategy}-seed-{seed}{}.log",
                if keep.is_some() { "-kept" } else { "" }
            ));
            let (outcome, line) = runtime.block_on(bounded_seed(
                seed,
                steps,
                strategy,
                store.as_ref(),
                keep.as_ref(),
                &history,
            ));
            let what = tally.record(&outcome);
            eprintln!("campaign: {strategy} seed {seed}{keep_arg} ({line}): {what}");
            if outcome.is_err() {
                eprintln!(
                    "campaign:   history: {}\ncampaign:   replay: cargo xtask chaos campaign --seed {seed} --steps {steps} --strategy {strategy}{keep_arg}",
                    history.display(),
                );
                if args.shrink && matches!(outcome, Err(Failure::Violation { .. })) {
                    let scratch = out_dir.join(format!("{strategy}-seed-{seed}-shrink.log"));
                    let kept = runtime.block_on(shrink(
                        seed,
                        steps,
                        strategy,
                        store.as_ref(),
                        &outcome,
                        Duration::from_secs(300),
                        &scratch,
                    ));
                    let kept: Vec<String> = kept.iter().map(|i| i.to_string()).collect();
                    eprintln!(
                        "campaign:   shrunk to {} operations: cargo xtask chaos campaign --seed {seed} --steps {steps} --strategy {strategy} --keep {}",
                        kept.len(),
                        kept.join(",")
                    );
                }
            }
        }
        println!(
            "{}",
            tally.summary_line(SUITE, &strategy.to_string(), negative)
        );
        ok &= tally.ok(negative);
    }
    // `exit` runs no destructor: stop the throw-away PostgreSQL server of
    // the `@postgres` variants first, or it outlives the campaign.
    drop(runtime);
    drop(store);
    std::process::exit(if ok { 0 } else { 1 });
}
