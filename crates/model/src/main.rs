//! `lockstep-model`: checks every model variant (or those named on the
//! command line) and prints, per variant, the shortest counterexample of every
//! violated property and then the reporting contract's JSON line (suite
//! `model`). Exits non-zero when a variant that must pass fails or a negative
//! control (`naive`, `catalog-only`) is not caught.
//!
//! The extra variants (`history-compacted`, `history-full`) run only when
//! named.
//!
//! Usage: `lockstep-model [VARIANT...] [--processes N] [--dataflows N]
//! [--commands N] [--faults N] [--serve-ops N] [--crashes N]`; the flags
//! override the CI bounds (for exploring larger sizes by hand).
//! `lockstep-model --list` prints the CI variants, one per line, each with
//! `must-pass` or `negative-control` (what `cargo xtask model` checks
//! against).

use std::process::ExitCode;

use lockstep_model::{run, scenarios, Variant, VariantReport, EXTRA_VARIANTS, VARIANTS};

fn main() -> ExitCode {
    let mut wanted: Vec<String> = Vec::new();
    let mut overrides: Vec<(String, usize)> = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        if arg == "--list" {
            for name in VARIANTS {
                let kind = if lockstep_model::is_negative_control(name) {
                    "negative-control"
                } else {
                    "must-pass"
                };
                println!("{name} {kind}");
            }
            return ExitCode::SUCCESS;
        }
        if let Some(flag) = arg.strip_prefix("--") {
            match args.next().and_then(|v| v.parse().ok()) {
                Some(n) => overrides.push((flag.to_string(), n)),
                None => {
                    eprintln!("lockstep-model: --{flag} needs a number");
                    return ExitCode::from(2);
                }
            }
        } else {
            wanted.push(arg);
        }
    }
    if let Some(unknown) = wanted
        .iter()
        .find(|w| !VARIANTS.iter().chain(&EXTRA_VARIANTS).any(|n| n == w))
    {
        eprintln!(
            "lockstep-model: unknown variant {unknown}; known: {}",
            VARIANTS
                .iter()
                .chain(&EXTRA_VARIANTS)
                .copied()
                .collect::<Vec<_>>()
                .join(", ")
        );
        return ExitCode::from(2);
    }
    let mut all_ok = true;
    // The CI variants by default; the extra ones only when named.
    for name in VARIANTS.iter().chain(&EXTRA_VARIANTS).copied() {
        let named = wanted.iter().any(|w| w == name);
        if !named && (!wanted.is_empty() || EXTRA_VARIANTS.contains(&name)) {
            continue;
        }
        let mut variants = Vec::new();
        for v in scenarios(name).expect("every listed variant has scenarios") {
            match apply(v, &overrides) {
                Ok(v) => variants.push(v),
                Err(flag) => {
                    eprintln!("lockstep-model: unknown flag --{flag}");
                    return ExitCode::from(2);
                }
            }
        }
        // With overrides, scenarios may coincide: check each once.
        variants.dedup_by(|a, b| format!("{a:?}") == format!("{b:?}"));
        let mut report = VariantReport {
            variant: name,
            negative_control: lockstep_model::is_negative_control(name),
            scenarios: Vec::new(),
        };
        for variant in variants {
            let r = run(name, variant);
            println!(
                "model {name}: bounds: {}; {} states in {:.1}s",
                r.bounds, r.states, r.seconds
            );
            let mut shown: Vec<&str> = Vec::new();
            for v in &r.violations {
                let same = r
                    .violations
                    .iter()
                    .find(|o| shown.contains(&o.property) && o.trace == v.trace);
                match same {
                    Some(o) => println!(
                        "model {name}: VIOLATED {} -- same counterexample as {}",
                        v.property, o.property
                    ),
                    None => println!(
                        "model {name}: VIOLATED {} -- shortest counterexample, {} steps:\n{}",
                        v.property, v.steps, v.trace
                    ),
                }
                shown.push(v.property);
            }
            for m in &r.missing_examples {
                println!("model {name}: no example of `{m}`: the model is vacuous");
            }
            report.scenarios.push(r);
        }
        let verdict = match (report.negative_control, report.ok()) {
            (true, true) => "negative control caught (expected)",
            (true, false) => "NEGATIVE CONTROL NOT CAUGHT: the model cannot fail it",
            (false, true) => "passed",
            (false, false) => "FAILED",
        };
        println!("model {name}: {verdict}");
        println!("{}", report.json());
        all_ok &= report.ok();
    }
    if all_ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// The variant with the command line's bound overrides; `Err` names an
/// unknown flag.
fn apply(mut variant: Variant, overrides: &[(String, usize)]) -> Result<Variant, String> {
    for (flag, n) in overrides {
        let n = *n;
        match (&mut variant, flag.as_str()) {
            (
                Variant::Compute(_, b)
                | Variant::History(_, b)
                | Variant::Mutant(_, b)
                | Variant::Pair(_, _, b),
                "processes",
            ) => b.processes = n,
            (
                Variant::Compute(_, b)
                | Variant::History(_, b)
                | Variant::Mutant(_, b)
                | Variant::Pair(_, _, b),
                "dataflows",
            ) => b.dataflows = n.min(lockstep_model::compute::MAX_DATAFLOWS),
            (
                Variant::Compute(_, b)
                | Variant::History(_, b)
                | Variant::Mutant(_, b)
                | Variant::Pair(_, _, b),
                "commands",
            ) => b.commands = n,
            (
                Variant::Compute(_, b)
                | Variant::History(_, b)
                | Variant::Mutant(_, b)
                | Variant::Pair(_, _, b),
                "faults",
            ) => b.faults = n,
            (Variant::Orphan(_, b), "serve-ops") => b.serve_ops = n,
            (Variant::Orphan(_, b), "crashes") => b.crashes = n,
            (_, "processes" | "dataflows" | "commands" | "faults" | "serve-ops" | "crashes") => {}
            (_, other) => return Err(other.to_string()),
        }
    }
    Ok(variant)
}
