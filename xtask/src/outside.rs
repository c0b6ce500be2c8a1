//! A family crate built outside the checkout, as an adopter's repository
//! would hold it (docs/embedding.md, "Depending on lockstep from outside"):
//! the reachability example's sources in a scratch directory with a
//! `Cargo.toml` of its own (its own `[workspace]`, lockstep's crates by
//! path where an adopter gives a git revision, timely and differential at
//! the versions `Coll` is made of), built there, and its replica binary
//! run. It fails if the example needs anything from this workspace that
//! the guide does not list.

use std::process::Command;

use anyhow::{bail, Context};

use crate::util::{root, run, step, target_dir};

/// The binary the scratch crate builds (not the workspace's own name, so
/// the two never overwrite each other in the shared target directory).
const BIN: &str = "outside-family-replica";

/// Builds the reachability family from a scratch directory outside the
/// checkout and runs its binary's `--version`.
pub fn check_family() -> anyhow::Result<()> {
    step("a family crate built outside the checkout (docs/embedding.md's dependencies)");
    let scratch = crate::util::scratch_outside("lockstep-outside-family-")?;
    let dir = scratch.path().join("my-family");
    std::fs::create_dir_all(dir.join("src"))?;
    for file in ["lib.rs", "main.rs"] {
        std::fs::copy(
            root().join("examples/reachability/src").join(file),
            dir.join("src").join(file),
        )
        .with_context(|| format!("copying the example's {file}"))?;
    }
    let path = |c: &str| root().join("crates").join(c).display().to_string();
    std::fs::write(
        dir.join("Cargo.toml"),
        format!(
            r#"[package]
name = "lockstep-example-reachability"
version = "0.1.0"
edition = "2021"
publish = false

[[bin]]
name = "{BIN}"
path = "src/main.rs"

[dependencies]
# An adopter writes {{ git = "GIT-URL-OF-LOCKSTEP", rev = "COMMIT" }}.
lockstep-protocol = {{ path = {protocol:?} }}
lockstep-replica = {{ path = {replica:?} }}
timely = "0.32"
differential-dataflow = "0.26"

[workspace]

# This workspace's profiles, so the shared target directory's builds serve.
[profile.dev]
debug = "line-tables-only"

[profile.dev.package."*"]
opt-level = 1
"#,
            protocol = path("protocol"),
            replica = path("replica"),
        ),
    )?;
    // Start from this workspace's lock file: no new versions resolved.
    std::fs::copy(root().join("Cargo.lock"), dir.join("Cargo.lock"))?;
    let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    cmd.current_dir(&dir)
        .args(["build", "--quiet", "--bins"])
        .arg("--target-dir")
        .arg(target_dir());
    run(cmd)?;
    let bin = target_dir().join("debug").join(BIN);
    let out = Command::new(&bin)
        .arg("--version")
        .output()
        .with_context(|| format!("running {}", bin.display()))?;
    let said = String::from_utf8_lossy(&out.stdout);
    // The scratch crate is version 0.1.0, and the example's `main` gives
    // `Builder::version` its own crate's version: that, not lockstep's.
    if !out.status.success() || !said.contains("0.1.0") {
        bail!(
            "{} --version said {said:?} ({}): the family's own version should be reported",
            bin.display(),
            out.status
        );
    }
    eprintln!(
        "xtask: outside family: built, and it reports {}",
        said.trim()
    );
    Ok(())
}
