//! `lockstep-chaos-kube`: a replica's life on a real Kubernetes API server
//! (`lockstep_chaos::kube_lifecycle`): create, shared-fate restart, whole
//! restart, upgrade, drop. `cargo xtask kube` starts the server and runs
//! it. Prints each step's time, what broke, and one JSON summary line;
//! exits 1 unless every step passed.

use std::process::ExitCode;

use lockstep_chaos::environment::real_kube::RealCluster;
use lockstep_chaos::outcome::Tally;

fn main() -> ExitCode {
    let runtime = tokio::runtime::Runtime::new().expect("a tokio runtime");
    let cluster = match runtime.block_on(RealCluster::from_env()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("lockstep-chaos-kube: {e:#}");
            return ExitCode::FAILURE;
        }
    };
    let steps = runtime.block_on(lockstep_chaos::kube_lifecycle::run(&cluster));
    let mut tally = Tally::default();
    for step in &steps {
        let line = tally.record(&step.result);
        println!(
            "{}",
            serde_json::json!({"kube_step": step.name, "seconds": (step.seconds * 1000.0).round() / 1000.0, "result": line})
        );
    }
    println!("{}", tally.summary_line("kube", "lifecycle", false));
    if tally.ok(false) && steps.len() == 5 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
