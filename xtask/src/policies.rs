//! Building the WASM policies.
//!
//! Each crate under `policies/` is built as a WebAssembly *component* with no
//! imports: `cargo rustc --target wasm32-unknown-unknown --crate-type cdylib`
//! linked by `wasm-component-ld` (shipped with rustup). A plain `cargo build`
//! for that target would silently write a core module instead.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{bail, Context};

use crate::util::{cargo, root, run, step};

/// The wasm target the policies are built for.
pub const WASM_TARGET: &str = "wasm32-unknown-unknown";

/// Where built policies go.
pub fn out_dir() -> PathBuf {
    root().join("target/lockstep/policies")
}

/// Installs the wasm target with rustup if it is missing.
pub fn ensure_wasm_target() -> anyhow::Result<()> {
    let out = Command::new("rustup")
        .args(["target", "list", "--installed"])
        .output()
        .context("rustup is needed to install the wasm target")?;
    if String::from_utf8_lossy(&out.stdout)
        .lines()
        .any(|l| l.trim() == WASM_TARGET)
    {
        return Ok(());
    }
    step(&format!("installing the {WASM_TARGET} target"));
    let mut cmd = Command::new("rustup");
    cmd.args(["target", "add", WASM_TARGET]);
    run(cmd)
}

/// The policy crates: every directory under `policies/` with a Cargo.toml.
pub fn policy_crates() -> anyhow::Result<Vec<String>> {
    let dir = root().join("policies");
    let mut names = Vec::new();
    if !dir.exists() {
        return Ok(names);
    }
    for entry in std::fs::read_dir(&dir)? {
        let path = entry?.path();
        let manifest = path.join("Cargo.toml");
        if !manifest.exists() {
            continue;
        }
        let text = std::fs::read_to_string(&manifest)?;
        let name = text
            .lines()
            .find_map(|l| {
                let l = l.trim();
                l.strip_prefix("name")
                    .and_then(|r| r.trim().strip_prefix('='))
                    .map(|r| r.trim().trim_matches('"').to_string())
            })
            .with_context(|| format!("no package name in {}", manifest.display()))?;
        names.push(name);
    }
    names.sort();
    Ok(names)
}

/// Builds every policy and returns the paths of the `.wasm` files.
pub fn build_all() -> anyhow::Result<Vec<PathBuf>> {
    let crates = policy_crates()?;
    if crates.is_empty() {
        eprintln!("xtask: no policy crates under policies/ yet");
        return Ok(vec![]);
    }
    ensure_wasm_target()?;
    std::fs::create_dir_all(out_dir())?;
    let mut outputs = Vec::new();
    for (i, name) in crates.iter().enumerate() {
        step(&format!(
            "building policy {name} ({}/{})",
            i + 1,
            crates.len()
        ));
        let mut cmd = cargo();
        cmd.args([
            "rustc",
            "--release",
            "--quiet",
            "-p",
            name,
            "--target",
            WASM_TARGET,
        ])
        .args([
            "--crate-type",
            "cdylib",
            "--",
            "-C",
            "linker=wasm-component-ld",
        ]);
        run(cmd)?;
        let file = name.replace('-', "_");
        let built = root().join(format!("target/{WASM_TARGET}/release/{file}.wasm"));
        if !built.exists() {
            bail!("policy {name} built but {} is missing", built.display());
        }
        let dest = out_dir().join(format!("{name}.wasm"));
        std::fs::copy(&built, &dest)
            .with_context(|| format!("copying {} to {}", built.display(), dest.display()))?;
        outputs.push(dest);
    }
    eprintln!(
        "xtask: {} policies in {}",
        outputs.len(),
        out_dir().display()
    );
    Ok(outputs)
}
