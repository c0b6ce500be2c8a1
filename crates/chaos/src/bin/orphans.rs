//! `lockstep-chaos`: runs the orphan fault scenarios against the `lockstep`
//! binary beside it (both built with the `failpoints` feature) and prints,
//! per variant, what broke and then one JSON summary line (the reporting
//! contract of DESIGN.md). `cargo xtask chaos orphans` runs it. Each rule
//! runs on the process backend (variant `RULE`) and on the Kubernetes
//! backend over the in-memory API server double (`RULE@kubernetes`).
//!
//! Every scenario ends as a pass, a violation or a harness error
//! (`lockstep_chaos::outcome`). Exit status: 0 when `epoch` and
//! `id-watermark` pass every scenario and `catalog-only` is caught by
//! violations with no harness error; 1 otherwise.

use std::process::ExitCode;

use lockstep_chaos::orphans::{run_variant_on, variant_name, BACKENDS, VARIANTS};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let suite = args.first().map(String::as_str).unwrap_or("orphans");
    if suite != "orphans" {
        eprintln!("lockstep-chaos: unknown suite {suite:?} (known: orphans)");
        return ExitCode::FAILURE;
    }
    let only: Vec<&str> = args[1.min(args.len())..]
        .iter()
        .map(String::as_str)
        .collect();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("LOCKSTEP_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("off")),
        )
        .init();
    let bin = match std::env::current_exe() {
        Ok(exe) => exe.with_file_name("lockstep"),
        Err(e) => {
            eprintln!("lockstep-chaos: cannot find myself: {e}");
            return ExitCode::FAILURE;
        }
    };
    if !bin.is_file() {
        eprintln!(
            "lockstep-chaos: {} is missing; build it with --features failpoints",
            bin.display()
        );
        return ExitCode::FAILURE;
    }
    let runtime = tokio::runtime::Runtime::new().expect("a tokio runtime");
    let mut ok = true;
    for backend in BACKENDS {
        for (rule, _) in VARIANTS {
            let name = variant_name(rule, backend);
            if !only.is_empty() && !only.contains(&name.as_str()) {
                continue;
            }
            let report = runtime.block_on(run_variant_on(backend, rule, Some(&bin)));
            for line in &report.failures {
                println!("{line}");
            }
            println!("{}", report.summary_line());
            ok &= report.ok();
        }
    }
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
