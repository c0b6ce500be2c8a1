//! `cargo xtask model`: exhaustive model checking of the protocols.
//!
//! Builds and runs the `lockstep-model` binary (crate `crates/model`) in
//! release mode: the stateright models of the compute protocol (variants
//! `naive`, `broadcast`, `barrier`, `log`, and `log-then-barrier`, whose
//! sessions alternate between two strategies) and of orphan removal (`epoch`,
//! `id-watermark`, `catalog-only`), each within CI-sized bounds. The binary
//! prints each negative control's shortest counterexample as a readable trace
//! and one JSON line per variant (suite `model`, with the number of states
//! explored). This task passes that output on and then checks the summary
//! lines itself: every variant asked for is reported, the negative controls
//! (`naive`, `catalog-only`, `history-full-collective`, every `mutant-*`) say
//! `"caught":true`, every other variant has
//! `"failed":0`, and the binary exited successfully.

use std::process::Stdio;

use anyhow::{bail, Context};

use crate::util::{cargo, step};

/// Every variant the model binary checks, in report order.
pub const VARIANTS: [&str; 15] = [
    "naive",
    "broadcast",
    "barrier",
    "log",
    "log-then-barrier",
    "history-full-collective",
    "epoch",
    "id-watermark",
    "catalog-only",
    "mutant-overwrite-reports",
    "mutant-local-reconcile-under-barrier",
    "mutant-skip-barrier",
    "mutant-complete-before-history-check",
    "mutant-no-log-hold",
    "mutant-no-session-marker",
];

/// The variants that must be caught (and every `mutant-*` variant).
const NEGATIVE_CONTROLS: [&str; 3] = ["naive", "catalog-only", "history-full-collective"];

/// Runs the model checker on `variants` (every variant when empty).
pub fn run(variants: &[String]) -> anyhow::Result<()> {
    if let Some(v) = variants.iter().find(|v| !VARIANTS.contains(&v.as_str())) {
        bail!(
            "unknown model variant {v:?}; known: {}",
            VARIANTS.join(", ")
        );
    }
    let wanted: Vec<&str> = if variants.is_empty() {
        VARIANTS.to_vec()
    } else {
        variants.iter().map(String::as_str).collect()
    };
    step("model checking (cargo run --release -p lockstep-model)");
    let mut cmd = cargo();
    cmd.args([
        "run",
        "--release",
        "--quiet",
        "-p",
        "lockstep-model",
        "--bin",
        "lockstep-model",
        "--",
    ]);
    cmd.args(&wanted);
    let out = cmd
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .context("could not start cargo run -p lockstep-model")?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    print!("{stdout}");
    let mut problems = Vec::new();
    for variant in &wanted {
        let prefix = format!(r#"{{"suite":"model","variant":"{variant}","#);
        let Some(line) = stdout.lines().find(|l| l.starts_with(&prefix)) else {
            problems.push(format!("{variant}: no summary line"));
            continue;
        };
        if NEGATIVE_CONTROLS.contains(variant) || variant.starts_with("mutant-") {
            if !line.contains(r#""caught":true"#) {
                problems.push(format!("{variant}: negative control not caught"));
            }
        } else if !line.contains(r#""failed":0"#) {
            problems.push(format!("{variant}: failed"));
        }
    }
    if !out.status.success() {
        problems.push(format!("lockstep-model exited with {}", out.status));
    }
    if !problems.is_empty() {
        bail!("model: {}", problems.join("; "));
    }
    eprintln!("\nxtask: model: ok ({} variants)", wanted.len());
    Ok(())
}
