//! A family crate built outside the checkout, as an adopter's repository
//! would hold it (docs/embedding.md, "Depending on lockstep from outside"):
//! the reachability example's sources in a scratch directory with a
//! `Cargo.toml` of its own (its own `[workspace]`, lockstep's crates by
//! path where an adopter gives a git revision, timely and differential at
//! the versions `Coll` is made of), checked there (`cargo check`: every
//! crate compiled as the adopter's build resolves it, features unified
//! over that crate alone, with no code generated; a full build of that
//! tree cost about 4 minutes of CI, shared with nothing else the test
//! builds). It fails if the example needs anything from this workspace
//! that the guide does not list. That the family's binary reports its own
//! version is `lockstep-replica`'s unit test
//! (`version_reports_the_family_version`).

use std::process::Command;

use anyhow::Context;

use crate::util::{root, run, step, target_dir};

/// The binary the scratch crate names (not the workspace's own name, so
/// the two never meet in the shared target directory).
const BIN: &str = "outside-family-replica";

/// Checks the reachability family from a scratch directory outside the
/// checkout.
pub fn check_family() -> anyhow::Result<()> {
    step("a family crate checked outside the checkout (docs/embedding.md's dependencies)");
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
        .args(["check", "--quiet", "--bins"])
        .arg("--target-dir")
        .arg(target_dir());
    run(cmd)?;
    eprintln!("xtask: outside family: checked");
    Ok(())
}
