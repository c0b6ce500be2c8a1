//! `lockstep-chaos-hostile`: a seeded hostile-neighbour campaign on real
//! processes (`cargo xtask chaos hostile`), checking R1 (a budget, not a
//! race for descriptors; private by default) while the system does its
//! work.
//!
//! Each seed starts a real `lockstep serve` in its default posture (the
//! API and metrics tokens it makes in a fresh 0700 state directory, a
//! metrics endpoint) and lowers its descriptor limit to [`ENV_NOFILE`]
//! (`prlimit`), so that exhaustion is within reach; creates a replica of
//! [`PROCESSES`] real processes (1 or 2 workers each, by the seed) whose
//! limits are lowered to [`REPLICA_NOFILE`], and a dataflow exporting
//! `get(1)` and a reduce over it. Then, for [`ATTACK`], all at once:
//!
//! - a legitimate client (`workload`) writes and peeks with the token, each
//!   call on a new connection: every acknowledged write must be visible
//!   exactly once and every peek right (I3), and every call answered
//!   within [`OP_BOUND`] (R1: a token holder is never kept out);
//! - a seeded mix of attackers (`plan`, `attack`) on every port kind: the
//!   API, the metrics endpoint and each replica process's controller port:
//!   connection floods held open (always one of more connections than the
//!   environment has descriptors on the API), half-open handshakes (a TLS
//!   ClientHello's start, part of an HTTP/2 preface, part of a Noise
//!   message, a lone `G`, a request head without its end), slowloris
//!   trickles (a byte a second, back when closed), API calls without a
//!   token or with a wrong one, scrapes without the metrics token or with
//!   the API token. No port may hold many more of their connections than
//!   its unproven pool for long, nor one past its deadline, nor serve one
//!   of those calls (R1);
//! - one replica process killed with SIGKILL: the replica must be back
//!   within [`RESTART_BOUND`], seen through ListReplicas (R1);
//! - a token holder's GetStatus on a new connection about every second,
//!   and a scrape with the metrics token: each answered within
//!   [`OP_BOUND`], with no allowance for the restart (R1);
//! - as root, another user (`nobody`) tries to read everything in the
//!   state directory, to call the API and to scrape without the tokens,
//!   and every mode there is checked (R1: private by default);
//! - the environment's and each replica process's peak memory, bounded
//!   (the environment's by the byte budget's ceiling over its peak when
//!   the attacks start).
//!
//! Then, as root, the same other user plants a state directory that
//! `lockstep serve` must refuse, and listens on a port the CLI is pointed
//! at, which must get no token (`doors`).
//!
//! A seed ends as a pass, a violation (R1, or I3 for a wrong answer), or a
//! harness error (the harness could not do its job: `lockstep serve` did
//! not start, the replica never served before the attacks...), which
//! fails the run. The first finding stops the seed.
//!
//! Variants: `bounded` (what runs) must pass every seed; the negative
//! controls must be caught (violations only; a harness error fails the
//! run): `no-bounds` runs the environment with [`NO_BOUNDS_ENV`] (its
//! pools without caps, deadline or byte budget), which the API flood must
//! catch; `released-ports` with the orchestrator releasing every port once
//! chosen, which the squatter's bind after the kill must catch;
//! `unowned-state` with no owner checked and `unproven-server` with the
//! CLI sending its token to any listener, each trying only its door.
//!
//! Usage: `lockstep-chaos-hostile [--seeds A..B | A..=B | --seed N]
//! [--long] [--variant NAME ...]`. Default, the quick set of `cargo xtask
//! test`: seeds [`QUICK_BOUNDED`], [`QUICK_NO_BOUNDS`] and
//! [`QUICK_RELEASED_PORTS`] (for the three other controls); `--long`:
//! [`LONG_BOUNDED`] and [`LONG_NO_BOUNDS`] (for every control). Prints one
//! line per seed, then the reporting contract's JSON line per variant
//! (suite `hostile`); exits non-zero if `bounded` had a violation, any seed
//! a harness error, or a control was not caught.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lockstep_chaos::outcome::{violation, Failure, Tally};
use lockstep_environment::proto;
use tokio_util::sync::CancellationToken;

#[path = "hostile/attack.rs"]
mod attack;
#[path = "hostile/doors.rs"]
mod doors;
#[path = "hostile/env.rs"]
mod env;
#[path = "hostile/other_user.rs"]
mod other_user;
#[path = "hostile/plan.rs"]
mod plan;
#[path = "hostile/seed.rs"]
mod seed;
#[path = "hostile/workload.rs"]
mod workload;

use env::{code, kill9, limit_descriptors, Api, Client, Env};
use seed::EnvView;

/// The suite's name in its summary lines.
const SUITE: &str = "hostile";
/// The replica's name.
const REPLICA: &str = "h";
/// Processes of the replica.
const PROCESSES: u32 = 2;
/// The environment's descriptor limit (soft and hard), set once it serves.
const ENV_NOFILE: u64 = 512;
/// Each replica process's descriptor limit, set once it runs.
const REPLICA_NOFILE: u64 = 256;
/// How long the attacks, the workload and the fault run.
const ATTACK: Duration = Duration::from_secs(12);
/// The bound on a legitimate call (with its retries), and on a scrape.
const OP_BOUND: Duration = Duration::from_secs(6);
/// The bound on one attempt of a call.
const ATTEMPT: Duration = Duration::from_secs(4);
/// The bound on the killed process's return, seen through ListReplicas;
/// the calls under way then get [`OP_BOUND`] from its return.
const RESTART_BOUND: Duration = Duration::from_secs(20);
/// The bound on each setup step (the replica's first answer among them).
const SETUP_BOUND: Duration = Duration::from_secs(60);
/// The bound on one seed.
const SEED_BOUND: Duration = Duration::from_secs(180);
/// Between a legitimate call's attempts.
const RETRY_PAUSE: Duration = Duration::from_millis(100);
/// Between the workload's rounds (two writes and a peek).
const WORKLOAD_PAUSE: Duration = Duration::from_millis(50);
/// How long past its deadline a port may take to close an unproven
/// connection.
const DEADLINE_SLACK: Duration = Duration::from_secs(3);
/// How many attackers' connections a port may hold beyond its pool's cap
/// (the ones it has not accepted yet, or is closing).
const OVER_CAP_SLACK: usize = 16;
/// How long a port may hold more than that.
const OVER_CAP_FOR: Duration = Duration::from_secs(3);
/// The metrics endpoint's deadline for a request head
/// (`lockstep_metrics_http::HEAD_TIMEOUT`, its pool's deadline).
const METRICS_HEAD_TIMEOUT: Duration = Duration::from_secs(5);
/// The most bytes one connection of unfinished messages sends (then it
/// holds): what the environment may buffer of it without a byte budget.
const UNFINISHED_BYTES: usize = 8 << 20;
/// What the environment's peak resident memory (`VmHWM`) may grow by under
/// the whole mix beyond its peak when the attacks start, besides the byte
/// budget's ceiling ([`env_budget_mib`]): the proven work, the metrics
/// endpoint's requests and the allocator's slack. Measured over seeds
/// 1–110 of `bounded`: peaks of 70–165 MiB, the budget's ceiling 128 MiB.
const ENV_SLACK_MIB: f64 = 32.0;

/// The byte budget's ceiling before proof: every unproven API connection
/// the pool admits holding its whole budget, in MiB
/// (`API_UNPROVEN` x `API_UNPROVEN_READ_BYTES`, 64 x 2 MiB).
fn env_budget_mib() -> f64 {
    use lockstep_environment::listeners::{API_UNPROVEN, API_UNPROVEN_READ_BYTES};
    (API_UNPROVEN * API_UNPROVEN_READ_BYTES) as f64 / f64::from(1u32 << 20)
}
/// A replica process's peak resident memory (`VmHWM`) a seed may reach
/// under the attacks on its controller port (measured: 18 MiB on seed 1
/// of `bounded`; before proof a connection is bounded by the Noise
/// handshake's frame, and their number by the unproven pool's cap).
const REPLICA_PEAK_MIB: f64 = 64.0;
/// `lockstep_admission::NO_BOUNDS_ENV`: set, a process's pools have no caps
/// and no deadline (the negative control).
const NO_BOUNDS_ENV: &str = "LOCKSTEP_EXPERIMENT_NO_ADMISSION_BOUNDS";

/// The quick set's seeds for `bounded` (`cargo xtask test`).
const QUICK_BOUNDED: std::ops::RangeInclusive<u64> = 1..=3;
/// The quick set's seeds for `no-bounds`.
const QUICK_NO_BOUNDS: std::ops::RangeInclusive<u64> = 1..=2;
/// `--long`: seeds for `bounded`.
const LONG_BOUNDED: std::ops::RangeInclusive<u64> = 1..=200;
/// The quick set's seeds for `released-ports`, `unowned-state` and
/// `unproven-server`.
const QUICK_RELEASED_PORTS: std::ops::RangeInclusive<u64> = 1..=1;
/// `--long`: seeds for each negative control.
const LONG_NO_BOUNDS: std::ops::RangeInclusive<u64> = 1..=20;

/// A variant of the campaign.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Variant {
    /// The environment as it runs: every pool bounded.
    Bounded,
    /// The negative control: the environment with [`NO_BOUNDS_ENV`].
    NoBounds,
    /// The negative control of held ports: the environment's orchestrator
    /// releases every port once chosen
    /// (`lockstep_orchestrator::process::RELEASE_PORTS_ENV`).
    ReleasedPorts,
    /// The negative control of owned state: `lockstep serve` checks no
    /// owner (`lockstep_environment::private::ANY_OWNER_ENV`), which the
    /// planted state directory must catch.
    UnownedState,
    /// The negative control of the client's proof of the server: the CLI
    /// sends its token to any listener ([`doors::UNPROVEN_SERVER_ENV`]),
    /// which the squatter must catch.
    UnprovenServer,
}

impl Variant {
    /// Its name (`--variant`, the summary line).
    fn name(self) -> &'static str {
        match self {
            Variant::Bounded => "bounded",
            Variant::NoBounds => "no-bounds",
            Variant::ReleasedPorts => "released-ports",
            Variant::UnownedState => "unowned-state",
            Variant::UnprovenServer => "unproven-server",
        }
    }

    /// The variant named `s`.
    fn parse(s: &str) -> Result<Variant, String> {
        match s {
            "bounded" => Ok(Variant::Bounded),
            "no-bounds" => Ok(Variant::NoBounds),
            "released-ports" => Ok(Variant::ReleasedPorts),
            "unowned-state" => Ok(Variant::UnownedState),
            "unproven-server" => Ok(Variant::UnprovenServer),
            other => Err(format!(
                "unknown variant {other:?} (bounded, no-bounds, released-ports, unowned-state or unproven-server)"
            )),
        }
    }

    /// Whether it is the negative control (caught by violations).
    fn negative(self) -> bool {
        self != Variant::Bounded
    }

    /// Whether its seeds run the attack phase (the controls of a door
    /// only try that door).
    fn attacks(self) -> bool {
        !matches!(self, Variant::UnownedState | Variant::UnprovenServer)
    }

    /// Every variant, in the order the default run takes them.
    const ALL: [Variant; 5] = [
        Variant::Bounded,
        Variant::NoBounds,
        Variant::ReleasedPorts,
        Variant::UnownedState,
        Variant::UnprovenServer,
    ];
}

/// The highest peak resident memory (`VmHWM`) of the environment and of a
/// replica process over the seeds of the variant under way, in MiB.
static PEAKS: Mutex<(f64, f64)> = Mutex::new((0.0, 0.0));

/// Counts for a seed's line.
#[derive(Default)]
struct Stats {
    /// Connections the attackers made.
    connections: AtomicUsize,
    /// Writes answered.
    writes: AtomicUsize,
    /// Peeks answered and checked.
    peeks: AtomicUsize,
    /// Scrapes with the metrics token answered.
    scrapes: AtomicUsize,
    /// GetStatus calls with the token answered.
    status_calls: AtomicUsize,
    /// Calls without the token (or with a wrong one) refused.
    refused_calls: AtomicUsize,
    /// Scrapes without the metrics token refused.
    refused_scrapes: AtomicUsize,
}

/// What every task of a seed shares: the findings (the first is the seed's
/// outcome; a harness error stops the seed), the restart allowance of
/// legitimate calls, notes and counts.
#[derive(Default)]
struct Shared {
    /// Cancelled by a harness error: every task ends.
    stop: CancellationToken,
    /// Violations and harness errors, in the order found.
    findings: Mutex<Vec<Failure>>,
    /// While the killed process is being restarted: the time its return is
    /// bounded by, then the time it was seen back.
    recovery: Mutex<Option<Instant>>,
    /// The environment's peak resident memory when the attacks started, in
    /// MiB (0 until then).
    baseline_mib: Mutex<f64>,
    /// What the seed's line says beside the counts.
    notes: Mutex<Vec<String>>,
    /// The counts.
    stats: Stats,
}

impl Shared {
    /// Records a finding. A harness error stops the seed; after a violation
    /// the other checks go on (each reports once), so that a seed's line
    /// shows everything the attacks broke.
    fn fail(&self, f: Failure) {
        if matches!(f, Failure::Harness(_)) {
            self.stop.cancel();
        }
        self.findings.lock().expect("not poisoned").push(f);
    }

    /// The findings after the first, for the seed's line.
    fn more_findings(&self) -> Vec<String> {
        let findings = self.findings.lock().expect("not poisoned");
        findings.iter().skip(1).map(|f| f.to_string()).collect()
    }

    /// The seed's outcome: its first finding.
    fn outcome(&self) -> Result<(), Failure> {
        let findings = self.findings.lock().expect("not poisoned");
        match findings.first() {
            None => Ok(()),
            Some(f) => Err(f.clone()),
        }
    }

    /// Adds a note to the seed's line.
    fn note(&self, n: String) {
        self.notes.lock().expect("not poisoned").push(n);
    }

    /// The notes so far.
    fn notes(&self) -> Vec<String> {
        self.notes.lock().expect("not poisoned").clone()
    }

    /// Whether a harness error stopped the seed.
    fn stopped(&self) -> bool {
        self.stop.is_cancelled()
    }

    /// Sleeps `d`, or less if the seed stops.
    async fn pause(&self, d: Duration) {
        tokio::select! {
            () = tokio::time::sleep(d) => {}
            () = self.stop.cancelled() => {}
        }
    }

    /// Sleeps until `at`, or less if the seed stops.
    async fn pause_until(&self, at: Instant) {
        self.pause(at.saturating_duration_since(Instant::now()))
            .await;
    }

    /// A killed process is being restarted, bounded by `until`; or (once
    /// seen back) was back at `until`.
    fn recovering(&self, until: Instant) {
        *self.recovery.lock().expect("not poisoned") = Some(until);
    }

    /// The deadline of a legitimate call started at `started`: [`OP_BOUND`]
    /// after it, or after the killed process's return (or its bound).
    fn deadline(&self, started: Instant) -> Instant {
        let recovery = *self.recovery.lock().expect("not poisoned");
        recovery.map_or(started, |r| r.max(started)) + OP_BOUND
    }
}

/// The command line.
struct Args {
    /// Explicit seeds, for every variant.
    seeds: Option<Vec<u64>>,
    /// `--long`: the long run's seeds.
    long: bool,
    /// The variants to run (default: both).
    variants: Vec<Variant>,
}

/// Parses the command line (without the program name).
fn parse_args(argv: &[String]) -> Result<Args, String> {
    let mut args = Args {
        seeds: None,
        long: false,
        variants: Vec::new(),
    };
    let mut it = argv.iter();
    while let Some(a) = it.next() {
        let mut value = |name: &str| it.next().cloned().ok_or(format!("{name} needs a value"));
        match a.as_str() {
            "--seeds" => {
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
                args.seeds = Some(if inclusive {
                    (a..=b).collect()
                } else {
                    (a..b).collect()
                });
            }
            "--seed" => {
                args.seeds = Some(vec![value("--seed")?
                    .parse()
                    .map_err(|e| format!("--seed: {e}"))?])
            }
            "--long" => args.long = true,
            "--variant" => args.variants.push(Variant::parse(&value("--variant")?)?),
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    if args.variants.is_empty() {
        args.variants = Variant::ALL.to_vec();
    }
    Ok(args)
}

/// Seed `seed` of `variant`, within [`SEED_BOUND`].
async fn bounded_seed(seed: u64, variant: Variant) -> (Result<(), Failure>, String) {
    match tokio::time::timeout(SEED_BOUND, seed::run(seed, variant)).await {
        Ok(r) => r,
        Err(_) => (
            Err(Failure::Harness(format!(
                "the seed did not end within {SEED_BOUND:?}"
            ))),
            String::new(),
        ),
    }
}

fn main() {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    match argv.first().map(String::as_str) {
        Some(other_user::PROBE_ARG) => other_user::probe_main(&argv[1..]),
        Some(doors::PLANT_ARG) => doors::plant_main(&argv[1..]),
        Some(doors::SQUAT_ARG) => doors::squat_main(),
        _ => {}
    }
    let args = match parse_args(&argv) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("lockstep-chaos-hostile: {e}");
            std::process::exit(2);
        }
    };
    let missing: Vec<PathBuf> = [env::lockstep_binary(), env::replica_binary()]
        .into_iter()
        .filter(|p| !p.exists())
        .collect();
    if !missing.is_empty() {
        eprintln!(
            "lockstep-chaos-hostile: missing {missing:?}: build them (cargo xtask chaos hostile does)"
        );
        std::process::exit(2);
    }
    // The other user's probe runs this binary: keep it where a rebuild
    // cannot take it away mid-run.
    if let Err(e) = other_user::keep_probe_binary(&env::out_dir()) {
        eprintln!("lockstep-chaos-hostile: {e}");
        std::process::exit(2);
    }
    // The attackers hold thousands of sockets: this process's soft
    // descriptor limit goes up to its hard one (what the budget of a
    // lockstep process does first).
    let _ = lockstep_environment::listeners::process_budget();
    match env::descriptor_limit("self") {
        Some(n) if n >= 8192 => {}
        other => {
            eprintln!(
                "lockstep-chaos-hostile: the attackers need 8192 descriptors, this process may open {other:?} (raise the hard limit: ulimit -Hn)"
            );
            std::process::exit(2);
        }
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let mut ok = true;
    for variant in &args.variants {
        let negative = variant.negative();
        let seeds: Vec<u64> = match (&args.seeds, args.long, *variant) {
            (Some(s), _, _) => s.clone(),
            (None, false, Variant::Bounded) => QUICK_BOUNDED.collect(),
            (None, false, Variant::NoBounds) => QUICK_NO_BOUNDS.collect(),
            (None, false, _) => QUICK_RELEASED_PORTS.collect(),
            (None, true, Variant::Bounded) => LONG_BOUNDED.collect(),
            (None, true, _) => LONG_NO_BOUNDS.collect(),
        };
        let mut tally = Tally::default();
        *PEAKS.lock().expect("not poisoned") = (0.0, 0.0);
        for seed in seeds {
            let (outcome, line) = runtime.block_on(bounded_seed(seed, *variant));
            let what = tally.record(&outcome);
            eprintln!("hostile: {} seed {seed} ({line}): {what}", variant.name());
            if outcome.is_err() {
                eprintln!(
                    "hostile:   environment log: {}\nhostile:   replay: cargo xtask chaos hostile --seed {seed} --strategy {}",
                    env::out_dir()
                        .join(format!("{}-seed-{seed}.env.log", variant.name()))
                        .display(),
                    variant.name()
                );
            }
        }
        if variant.attacks() {
            let (env, replica) = *PEAKS.lock().expect("not poisoned");
            eprintln!(
                "hostile: {}: highest peak RSS under attack: environment {env:.0} MiB, a replica process {replica:.0} MiB",
                variant.name()
            );
        }
        println!("{}", tally.summary_line(SUITE, variant.name(), negative));
        ok &= tally.ok(negative);
    }
    std::process::exit(if ok { 0 } else { 1 });
}
