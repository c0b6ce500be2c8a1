//! The top-level tasks: build, test, demo.

use crate::policies;
use crate::util::{cargo, run, step};

/// Builds every host crate and every policy.
pub fn build() -> anyhow::Result<()> {
    step("building the workspace");
    let mut cmd = cargo();
    cmd.args(["build", "--workspace", "--all-targets"]);
    run(cmd)?;
    step("building the policies");
    policies::build_all()?;
    Ok(())
}

/// Features the workspace's tests and lints build with: the replica's test
/// hooks (failpoints). The distribution suite builds with the same, so one
/// build of the replica serves both.
pub const TEST_FEATURES: &str = "lockstep-replica/failpoints";

/// Runs every check CI runs.
pub fn test(lint: bool) -> anyhow::Result<()> {
    if lint {
        step("cargo fmt --check");
        let mut cmd = cargo();
        cmd.args(["fmt", "--all", "--check"]);
        run(cmd)?;
        step("cargo clippy -D warnings");
        let mut cmd = cargo();
        cmd.args([
            "clippy",
            "--workspace",
            "--all-targets",
            "--features",
            TEST_FEATURES,
            "--",
            "-D",
            "warnings",
        ]);
        run(cmd)?;
    }
    step("building the policies");
    policies::build_all()?;
    step("cargo test (every crate)");
    let mut cmd = cargo();
    cmd.args(["test", "--workspace", "--features", TEST_FEATURES]);
    run(cmd)?;
    demo()?;
    for suite in crate::chaos::SUITES {
        crate::chaos::run_suite(suite)?;
    }
    crate::model::run(&[])?;
    eprintln!("\nxtask: test: ok");
    Ok(())
}

/// The demo: builds the `lockstep` and `lockstep-replica` binaries and runs
/// `lockstep demo` (crates/environment/src/demo.rs), which prints its progress
/// and ends with `demo: ok`, or says what failed and exits non-zero.
pub fn demo() -> anyhow::Result<()> {
    step("building lockstep and lockstep-replica");
    let mut cmd = cargo();
    cmd.args([
        "build",
        "--quiet",
        "-p",
        "lockstep-environment",
        "-p",
        "lockstep-replica",
        "--bins",
    ]);
    run(cmd)?;
    step("demo");
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| crate::util::root().join("target"));
    let mut cmd = std::process::Command::new(target.join("debug/lockstep"));
    cmd.arg("demo");
    run(cmd)
}
