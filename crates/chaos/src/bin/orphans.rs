//! `lockstep-chaos`: runs the orphan fault scenarios against the `lockstep`
//! binary beside it (both built with the `failpoints` feature) and prints,
//! per variant, what broke and then one JSON summary line (the reporting
//! contract of docs/invariants.md). `cargo xtask chaos orphans` runs it. Each rule
//! runs on the process backend (variant `RULE`), on the Kubernetes
//! backend over the in-memory API server double (`RULE@kubernetes`), and
//! on the process backend with the catalog in PostgreSQL (`RULE@postgres`,
//! on a throw-away server this binary starts: the PostgreSQL binaries must
//! be installed, as `.ci/run` does). Named explicitly (`cargo xtask kube`
//! does), `RULE@kube-apiserver` runs on a real API server
//! (`lockstep_chaos::environment::real_kube`).
//!
//! Every scenario ends as a pass, a violation or a harness error
//! (`lockstep_chaos::outcome`). Exit status: 0 when `epoch` and
//! `id-watermark` pass every scenario and `catalog-only` is caught by
//! violations with no harness error; 1 otherwise.

use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use lockstep_chaos::environment::real_kube::RealCluster;
use lockstep_chaos::environment::FreshDatabase;
use lockstep_chaos::orphans::{run_variant_with, variant_name, BACKENDS, VARIANTS};

/// The backend of a real API server's variants (`RULE@kube-apiserver`).
const REAL: &str = "kube-apiserver";
use lockstep_pgtest::PgServer;

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
    let wanted = |name: &str| only.is_empty() || only.contains(&name);
    // One throw-away PostgreSQL server for the `@postgres` variants; every
    // scenario gets its own database on it.
    let databases = if VARIANTS
        .iter()
        .any(|(rule, _)| wanted(&variant_name(rule, "postgres")))
    {
        match PgServer::start() {
            Ok(server) => Some(fresh_databases(Arc::new(server))),
            Err(e) => {
                eprintln!(
                    "lockstep-chaos: cannot start PostgreSQL for the @postgres variants: {e}"
                );
                return ExitCode::FAILURE;
            }
        }
    } else {
        None
    };
    // The variants on a real API server run only when asked for by name
    // (`cargo xtask kube` starts the server and names them).
    let real = if only.iter().any(|v| v.ends_with(&format!("@{REAL}"))) {
        match runtime.block_on(RealCluster::from_env()) {
            Ok(cluster) => Some(cluster),
            Err(e) => {
                eprintln!("lockstep-chaos: the @{REAL} variants: {e:#}");
                return ExitCode::FAILURE;
            }
        }
    } else {
        None
    };
    let backends = BACKENDS.iter().chain(real.as_ref().map(|_| &REAL));
    let mut ok = true;
    for backend in backends {
        for (rule, _) in VARIANTS {
            let name = variant_name(rule, backend);
            if !wanted(&name) {
                continue;
            }
            let report = runtime.block_on(run_variant_with(
                backend,
                rule,
                Some(&bin),
                databases.as_ref(),
                real.as_ref(),
            ));
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

/// A maker of fresh databases (`orphans_1`, `orphans_2`, ...) on `server`.
fn fresh_databases(server: Arc<PgServer>) -> FreshDatabase {
    let next = AtomicU64::new(1);
    FreshDatabase(Arc::new(move || {
        let n = next.fetch_add(1, Ordering::Relaxed);
        Ok(server.new_database(&format!("orphans_{n}"))?)
    }))
}
