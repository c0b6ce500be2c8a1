//! `cargo xtask model`: exhaustive model checking of the protocols.
//!
//! Builds and runs the `lockstep-model` binary (crate `crates/model`) in
//! release mode: the stateright models of the compute protocol (one
//! strategy each, and every pair of them in alternating sessions) and of
//! orphan removal (`epoch`, `id-watermark`, `catalog-only`), each within
//! CI-sized bounds. The binary names its variants and which of them are
//! negative controls (`lockstep-model --list`), prints each negative
//! control's shortest counterexample as a readable trace and one JSON line
//! per variant (suite `model`, with the number of states explored). This
//! task passes that output on and then checks the summary lines itself:
//! every variant asked for is reported, the negative controls say
//! `"caught":true`, every other variant has `"failed":0`, and the binary
//! exited successfully.

use std::process::Stdio;

use anyhow::{bail, Context};

use crate::util::step;

/// Runs the model checker on `variants` (every variant when empty).
pub fn run(variants: &[String]) -> anyhow::Result<()> {
    step("model checking (cargo run --release -p lockstep-model)");
    // The variants and which must be caught, from the model itself.
    let mut list = crate::util::cargo_run_release("lockstep-model", "lockstep-model");
    list.arg("--list");
    let listed = crate::util::stdout(list)?;
    let known: Vec<(&str, bool)> = listed
        .lines()
        .filter_map(|l| l.split_once(' '))
        .map(|(name, kind)| (name, kind == "negative-control"))
        .collect();
    if known.is_empty() {
        bail!("lockstep-model --list named no variant");
    }
    if let Some(v) = variants.iter().find(|v| !known.iter().any(|(k, _)| k == v)) {
        let names: Vec<&str> = known.iter().map(|(k, _)| *k).collect();
        bail!("unknown model variant {v:?}; known: {}", names.join(", "));
    }
    let wanted: Vec<(&str, bool)> = known
        .iter()
        .copied()
        .filter(|(k, _)| variants.is_empty() || variants.iter().any(|v| v == k))
        .collect();
    let mut cmd = crate::util::cargo_run_release("lockstep-model", "lockstep-model");
    cmd.args(wanted.iter().map(|(k, _)| k));
    let out = cmd
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .context("could not start cargo run -p lockstep-model")?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    print!("{stdout}");
    let mut problems = Vec::new();
    for (variant, negative) in &wanted {
        let prefix = format!(r#"{{"suite":"model","variant":"{variant}","#);
        let Some(line) = stdout.lines().find(|l| l.starts_with(&prefix)) else {
            problems.push(format!("{variant}: no summary line"));
            continue;
        };
        if *negative {
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
