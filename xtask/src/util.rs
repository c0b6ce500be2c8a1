//! Running commands and finding the workspace.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{bail, Context};

/// The workspace root (the parent of `xtask/`).
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the workspace")
        .to_path_buf()
}

/// `cargo` as chosen by the cargo that runs us.
pub fn cargo() -> Command {
    let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    cmd.current_dir(root());
    cmd
}

/// The cargo target directory (CARGO_TARGET_DIR, or `target/`).
pub fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join("target"))
}

/// `cargo build --bins` of `packages` with `features` (none: the
/// production build). The one build command of the tasks that run
/// binaries: [`crate::tasks::TEST_FEATURES`] everywhere in `cargo xtask
/// test`, so that one build serves the tests, the demos and every suite.
pub fn build_bins(packages: &[&str], features: Option<&str>) -> Command {
    let mut cmd = cargo();
    cmd.args(["build", "--bins"]);
    for p in packages {
        cmd.args(["-p", p]);
    }
    if let Some(f) = features {
        cmd.args(["--features", f]);
    }
    cmd
}

/// Runs a command, echoing it, and fails with its exit status.
pub fn run(mut cmd: Command) -> anyhow::Result<()> {
    eprintln!("xtask: $ {}", show(&cmd));
    let status = cmd
        .status()
        .with_context(|| format!("could not start {}", show(&cmd)))?;
    if !status.success() {
        bail!("{} failed with {status}", show(&cmd));
    }
    Ok(())
}

/// Prints a step banner so long work shows progress.
pub fn step(what: &str) {
    eprintln!("\nxtask: ==> {what}");
}

fn show(cmd: &Command) -> String {
    let mut s = cmd.get_program().to_string_lossy().into_owned();
    for a in cmd.get_args() {
        s.push(' ');
        s.push_str(&a.to_string_lossy());
    }
    s
}
