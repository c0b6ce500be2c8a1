//! `cargo deny` over the dependency graph (a step of `cargo xtask test`):
//! `cargo deny check licenses bans sources` with the repository's
//! `deny.toml` (permissive licenses only, no OpenSSL, no deprecated
//! `serde_yaml`, crates.io only).
//!
//! - cargo-deny itself: the pinned [`VERSION`] from crates.io, built once
//!   by `cargo install --locked` into the cache outside the checkout
//!   ([`crate::util::cache_root`]`/cargo-deny/VERSION`, else
//!   `target/cargo-deny/VERSION`) and reused from there.
//! - Advisories are not checked: the RustSec database is a git repository
//!   on GitHub, which the machines that run the tests cannot reach.
//! - A self-test runs the same check with `MIT` taken out of the allowed
//!   licenses and requires it to fail naming `MIT`: the check can fail.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context};

use crate::util::{cargo, root, run, step, target_dir};

/// cargo-deny's version (crates.io).
const VERSION: &str = "0.20.2";

/// The checks run (advisories need GitHub: see the module docs).
const CHECKS: [&str; 3] = ["licenses", "bans", "sources"];

/// The step of `cargo xtask test`.
pub fn check() -> anyhow::Result<()> {
    step("cargo deny check licenses bans sources (deny.toml; advisories need GitHub)");
    let bin = ensure_installed()?;
    run(deny(&bin, &root().join("deny.toml")))?;
    planted_license_fails(&bin)
}

/// `cargo deny --config CONFIG check CHECKS` with cargo-deny from `bin`.
fn deny(bin: &Path, config: &Path) -> Command {
    let mut cmd = cargo();
    let path = std::env::var_os("PATH").unwrap_or_default();
    let mut dirs = vec![bin.to_path_buf()];
    dirs.extend(std::env::split_paths(&path));
    cmd.env("PATH", std::env::join_paths(dirs).expect("PATH entries"));
    cmd.args(["deny", "--log-level", "error", "--config"])
        .arg(config)
        .arg("check")
        .args(CHECKS);
    cmd
}

/// The self-test: the policy without `MIT` must refuse the graph (most
/// crates are MIT or dual-licensed with it, some MIT alone).
fn planted_license_fails(bin: &Path) -> anyhow::Result<()> {
    let policy = std::fs::read_to_string(root().join("deny.toml"))?;
    let planted: String = policy
        .lines()
        .filter(|l| l.trim() != "\"MIT\",")
        .map(|l| format!("{l}\n"))
        .collect();
    if planted == policy {
        bail!("deny.toml allows no \"MIT\" line to take out: the self-test has nothing to plant");
    }
    let dir = target_dir().join("cargo-deny");
    std::fs::create_dir_all(&dir)?;
    let config = dir.join("planted.toml");
    std::fs::write(&config, planted)?;
    let out = deny(bin, &config)
        .output()
        .context("running cargo deny (self-test)")?;
    let said = String::from_utf8_lossy(&out.stderr);
    if out.status.success() || !said.contains("MIT") {
        bail!(
            "cargo deny passed a graph with MIT crates under a policy that does not allow MIT ({}): the check cannot fail\n{said}",
            out.status
        );
    }
    eprintln!("xtask: cargo deny refuses the graph when MIT is not allowed (self-test)");
    Ok(())
}

/// The directory holding `cargo-deny` of [`VERSION`], installed if missing.
fn ensure_installed() -> anyhow::Result<PathBuf> {
    let home = crate::util::cache_root()
        .unwrap_or_else(target_dir)
        .join("cargo-deny");
    let root_dir = home.join(VERSION);
    let bin = root_dir.join("bin");
    if bin.join("cargo-deny").is_file() {
        return Ok(bin);
    }
    eprintln!(
        "xtask: building cargo-deny {VERSION} from crates.io into {} (once; a few minutes)",
        root_dir.display()
    );
    let partial = home.join(format!("{VERSION}.part"));
    let _ = std::fs::remove_dir_all(&partial);
    std::fs::create_dir_all(&home).with_context(|| format!("creating {}", home.display()))?;
    let mut cmd = cargo();
    cmd.args([
        "install",
        "--locked",
        "--quiet",
        "cargo-deny",
        "--version",
        VERSION,
    ])
    .arg("--root")
    .arg(&partial)
    .arg("--target-dir")
    .arg(target_dir().join("cargo-deny/build"));
    run(cmd).context("installing cargo-deny from crates.io")?;
    let _ = std::fs::remove_dir_all(&root_dir);
    std::fs::rename(&partial, &root_dir)
        .with_context(|| format!("moving cargo-deny into {}", root_dir.display()))?;
    let _ = std::fs::remove_dir_all(target_dir().join("cargo-deny/build"));
    Ok(bin)
}
