//! `lockstep-chaos-distribution`: the distribution fault suite.
//!
//! Every scenario starts a fresh replica of 2 processes x 2 workers (3 x 1
//! where a third process adds coverage) through
//! the orchestrator's process backend, drives it with a controller whose
//! distribution policy picks one strategy for every command, injects one real
//! fault, and then checks the invariants of docs/invariants.md on the real processes:
//!
//! - **I1** every worker's dataflow-creation log is the same
//!   (`lockstep_reconcile::lockstep_check`);
//! - **I2** every dataflow of the newest controller's target reaches the
//!   latest input time within a bound (no silent hang);
//! - **I3** every peek equals the plain-Rust reference;
//! - **I4** every worker has exactly the target installed (no partial install).
//!
//! Faults: the controller crashed by the failpoint
//! `controller_partial_broadcast` after a command reached process 0 and not
//! process 1, or process 1 and not process 0 (create, drop, write, peek, and
//! InitializationComplete during reconciliation itself), twice in a row, or
//! on 2 of 3 processes; the partial drop, both ways round; every connection
//! dropped, also between two creates; a replica process killed (process 0,
//! process 1, during reconciliation); a replica process stopped (SIGSTOP) and
//! resumed, or stopped and the replica restarted; a stale controller that
//! keeps sending after its successor connected; a restart with a changed
//! target. Every replica has a command log, so the `log` strategy runs too.
//!
//! Every scenario ends in one of three outcomes (`lockstep_chaos::outcome`): pass, a
//! violation of a named invariant, or a harness error (the replica did not
//! start, the setup before the fault failed, a signal could not be sent). A
//! harness error fails the run whatever the variant; `naive`, the negative
//! control, is caught only by violations.
//!
//! The `@hosts` variants (`barrier@hosts` and so on) run the partition
//! scenarios instead, on two simulated hosts ([`partitions`]); they need
//! root and iproute2.
//!
//! The `+reachability` variants run six of the scenarios
//! ([`scenarios::FAMILY_SCENARIOS`]) with the dataflows written in the
//! example family of `examples/reachability`, on its own replica binary
//! (`lockstep-replica-reachability`): the control plane and the checks are
//! the same, only the family and its reference change.
//!
//! A negative control stops at its first violation, which catches it (each
//! of its other scenarios would wait out the I2 bound);
//! `--every-scenario` runs them all.
//!
//! Usage: `lockstep-chaos-distribution [--every-scenario] [VARIANT...]` (default: broadcast
//! barrier log log@postgres naive naive+history-check, the same four
//! strategies' `+reachability` variants (broadcast, barrier, log, naive), and
//! where simulated hosts can be made, broadcast@hosts barrier@hosts log@hosts
//! naive@hosts;
//! `STRATEGY@postgres` keeps the replica's command log in a throw-away
//! PostgreSQL server instead of a SQLite file). Prints what broke, then one JSON
//! line per variant. Exits non-zero if a variant that must pass had a
//! violation, if any scenario had a harness error, or if `naive` was not
//! caught.

use std::time::Duration;

use lockstep_chaos::outcome::{violation, Tally};
use lockstep_protocol::Strategy;

#[path = "distribution/partitions.rs"]
mod partitions;
#[path = "distribution/replica.rs"]
mod replica;
#[path = "distribution/scenarios.rs"]
mod scenarios;
#[path = "distribution/variant.rs"]
mod variant;
#[path = "distribution/workload.rs"]
mod workload;

use replica::replica_binary;
use scenarios::{scenario, FAMILY_SCENARIOS, SCENARIOS};
use variant::{Variant, DEFAULT_VARIANTS, HOSTS_VARIANTS};
use workload::FAILPOINT;

fn main() {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    // A negative control is caught by one violation: by default it stops
    // there (its other scenarios each wait out the I2 bound, about 4 of
    // the suite's 7 minutes); `--every-scenario` runs them all, to see
    // which scenarios it breaks.
    let every_scenario = {
        let before = args.len();
        args.retain(|a| a != "--every-scenario");
        args.len() != before
    };
    let args = if args.is_empty() {
        let mut v = DEFAULT_VARIANTS.map(String::from).to_vec();
        match lockstep_orchestrator::hosts::available() {
            Ok(()) => v.extend(HOSTS_VARIANTS.map(String::from)),
            Err(e) => {
                eprintln!("lockstep-chaos-distribution: the @hosts variants are skipped: {e}")
            }
        }
        v
    } else {
        args
    };
    let strategies: Vec<Variant> = {
        match args
            .iter()
            .map(|a| a.parse())
            .collect::<Result<Vec<Variant>, String>>()
        {
            Ok(s) => s,
            Err(e) => {
                eprintln!("lockstep-chaos-distribution: {e}");
                std::process::exit(2);
            }
        }
    };
    if strategies.iter().any(|s| s.hosts) {
        if let Err(e) = lockstep_orchestrator::hosts::available() {
            eprintln!("lockstep-chaos-distribution: the @hosts variants need simulated hosts: {e}");
            std::process::exit(2);
        }
    }
    for s in &strategies {
        let binary = replica_binary(s.family);
        if !binary.exists() {
            eprintln!(
                "lockstep-chaos-distribution: {} is missing: build it (cargo xtask chaos distribution does)",
                binary.display()
            );
            std::process::exit(2);
        }
    }
    // One throw-away PostgreSQL server for the `@postgres` variants; each
    // replica's log is its own in it.
    let pg = if strategies.iter().any(|s| s.postgres) {
        match lockstep_pgtest::PgServer::start() {
            Ok(pg) => Some(pg),
            Err(e) => {
                eprintln!(
                    "lockstep-chaos-distribution: cannot start PostgreSQL for the @postgres variants: {e}"
                );
                std::process::exit(2);
            }
        }
    } else {
        None
    };
    let pg_url = pg.as_ref().map(|pg| pg.url());
    let _scenario = fail::FailScenario::setup();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let mut ok = true;
    let mut next_id = 1;
    for s in strategies {
        let mut tally = Tally::default();
        let only = std::env::var("LOCKSTEP_CHAOS_SCENARIOS").unwrap_or_default();
        let scenarios: &[&str] = if s.hosts {
            &partitions::SCENARIOS
        } else if s.family != variant::Family::Plan {
            &FAMILY_SCENARIOS
        } else {
            &SCENARIOS
        };
        let negative_control = s.strategy == Strategy::Naive && !s.check_reconciles;
        let mut left_out = 0;
        for &name in scenarios {
            next_id += 1;
            if !only.is_empty() && !only.split(',').any(|o| o == name) {
                continue;
            }
            if negative_control && !every_scenario && tally.caught() {
                left_out += 1;
                continue;
            }
            let started = std::time::Instant::now();
            let result = runtime.block_on(async {
                match tokio::time::timeout(
                    Duration::from_secs(90),
                    scenario(name, next_id, s, pg_url.as_deref()),
                )
                .await
                {
                    Ok(r) => r,
                    Err(_) => Err(violation(
                        "I2",
                        "the scenario did not finish within 90 s".to_string(),
                    )),
                }
            });
            fail::remove(FAILPOINT);
            let line = tally.record(&result);
            let took = started.elapsed().as_secs_f64();
            match result {
                Ok(()) => eprintln!("distribution/{s}/{name}: {line} ({took:.1} s)"),
                Err(_) => println!("distribution/{s}/{name}: {line} ({took:.1} s)"),
            }
        }
        if left_out > 0 {
            println!(
                "distribution/{s}: caught; its {left_out} other scenarios left out (--every-scenario runs them)"
            );
        }
        ok &= tally.ok(negative_control);
        println!(
            "{}",
            tally.summary_line("distribution", &s.to_string(), negative_control)
        );
    }
    if !ok {
        std::process::exit(1);
    }
}
