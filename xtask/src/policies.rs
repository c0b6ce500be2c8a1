//! Building the WASM policies.
//!
//! Each crate under `policies/` is built as a WebAssembly *component* with no
//! imports but `log`: `cargo rustc --target wasm32-unknown-unknown --crate-type
//! cdylib` linked by `wasm-component-ld` (shipped with rustup), debug info
//! stripped (it would make a 28 KB policy 1.6 MB). A plain `cargo build` for
//! that target would silently write a core module instead.
//!
//! `policies/NAME` becomes `target/lockstep/policies/NAME.wasm`. The hostile
//! policies the policy host's tests load (`crates/policy-host/tests/fixtures`,
//! a separate workspace) become `target/lockstep/test-policies/NAME.wasm`,
//! with one fresh `new-policy` scaffold of each kind beside them.

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

/// Where the policy host's test fixtures go.
pub fn test_out_dir() -> PathBuf {
    root().join("target/lockstep/test-policies")
}

/// The workspace of the policy host's hostile test policies.
fn fixtures_dir() -> PathBuf {
    root().join("crates/policy-host/tests/fixtures")
}

/// A policy crate: its directory name (the `.wasm` file's name) and its
/// package name.
pub struct PolicyCrate {
    /// The directory under `policies/`.
    pub dir: String,
    /// The package name in its Cargo.toml.
    pub package: String,
}

/// The policy crates: every directory under `policies/` with a Cargo.toml.
pub fn policy_crates() -> anyhow::Result<Vec<PolicyCrate>> {
    crates_in(&root().join("policies"))
}

/// Every directory under `dir` with a Cargo.toml, sorted.
fn crates_in(dir: &std::path::Path) -> anyhow::Result<Vec<PolicyCrate>> {
    let mut names = Vec::new();
    if !dir.exists() {
        return Ok(names);
    }
    for entry in std::fs::read_dir(dir)? {
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
        let dir = path
            .file_name()
            .map(|d| d.to_string_lossy().into_owned())
            .unwrap_or_else(|| name.clone());
        names.push(PolicyCrate { dir, package: name });
    }
    names.sort_by(|a, b| a.dir.cmp(&b.dir));
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
    for (i, krate) in crates.iter().enumerate() {
        step(&format!(
            "building policy {} ({}/{})",
            krate.dir,
            i + 1,
            crates.len()
        ));
        let built = build_component(None, &krate.package, &root().join("target"))?;
        outputs.push(copy_out(&built, &out_dir(), &krate.dir)?);
    }
    eprintln!(
        "xtask: {} policies in {}",
        outputs.len(),
        out_dir().display()
    );
    build_test_policies()?;
    Ok(outputs)
}

/// Builds the policy host's hostile test policies. Crates whose name ends in
/// `core-module` are built without the component linker, on purpose.
pub fn build_test_policies() -> anyhow::Result<Vec<PathBuf>> {
    let crates = crates_in(&fixtures_dir())?;
    std::fs::create_dir_all(test_out_dir())?;
    let manifest = fixtures_dir().join("Cargo.toml");
    // A separate target directory: the fixtures are another workspace, and
    // building them must not touch the shipped policies' artefacts.
    let target = root().join("target/lockstep/test-policies-build");
    let mut outputs = Vec::new();
    step(&format!("building {} test policies", crates.len()));
    for krate in &crates {
        let built = if krate.dir.ends_with("core-module") {
            let mut cmd = cargo();
            cmd.args(["build", "--release", "--quiet", "-p", &krate.package])
                .args(["--target", WASM_TARGET, "--manifest-path"])
                .arg(&manifest)
                .arg("--target-dir")
                .arg(&target);
            run(cmd)?;
            artefact(&target, &krate.package)
        } else {
            build_component(Some(&manifest), &krate.package, &target)?
        };
        outputs.push(copy_out(&built, &test_out_dir(), &krate.dir)?);
    }
    outputs.extend(build_scaffolds(&target)?);
    Ok(outputs)
}

/// Scaffolds one policy of each kind with `new-policy`'s templates into a
/// scratch workspace and builds them to
/// `target/lockstep/test-policies/scaffold-{distribution,orphans}.wasm`; the
/// policy host's tests run the conformance check on them, so a fresh
/// scaffold is known to build and pass.
fn build_scaffolds(target: &std::path::Path) -> anyhow::Result<Vec<PathBuf>> {
    use crate::new_policy::{write, Kind};
    let dir = root().join("target/lockstep/scaffold-check");
    let sdk = root().join("crates/policy-sdk");
    std::fs::create_dir_all(&dir)?;
    std::fs::write(
        dir.join("Cargo.toml"),
        format!(
            r#"# Written by `cargo xtask build-policies`: fresh `new-policy` scaffolds.
[workspace]
resolver = "2"
members = ["scaffold-distribution", "scaffold-orphans"]

[workspace.package]
version = "0.0.0"
edition = "2021"
rust-version = "1.95"
license = "Apache-2.0"
publish = false

[workspace.dependencies]
lockstep-policy-sdk = {{ path = {sdk:?} }}

[workspace.lints.rust]
missing_docs = "deny"
"#
        ),
    )?;
    // Start from the fixtures' lock file so no new versions are resolved.
    let lock = dir.join("Cargo.lock");
    if !lock.exists() {
        std::fs::copy(fixtures_dir().join("Cargo.lock"), &lock)?;
    }
    let manifest = dir.join("Cargo.toml");
    let scaffolds = [
        ("scaffold-distribution", Kind::Distribution),
        ("scaffold-orphans", Kind::Orphans),
    ];
    for (name, kind) in scaffolds {
        let crate_dir = dir.join(name);
        if crate_dir.exists() {
            std::fs::remove_dir_all(&crate_dir)?;
        }
        write(&crate_dir, name, kind)?;
    }
    let mut outputs = Vec::new();
    for (name, _) in scaffolds {
        let built = build_component(Some(&manifest), name, target)?;
        outputs.push(copy_out(&built, &test_out_dir(), name)?);
    }
    Ok(outputs)
}

/// Builds one crate as a component and returns the built file.
fn build_component(
    manifest: Option<&std::path::Path>,
    package: &str,
    target_dir: &std::path::Path,
) -> anyhow::Result<PathBuf> {
    let mut cmd = cargo();
    cmd.args([
        "rustc",
        "--release",
        "--quiet",
        "-p",
        package,
        "--target",
        WASM_TARGET,
    ]);
    if let Some(manifest) = manifest {
        cmd.arg("--manifest-path").arg(manifest);
    }
    cmd.arg("--target-dir").arg(target_dir).args([
        "--crate-type",
        "cdylib",
        "--",
        "-C",
        "linker=wasm-component-ld",
        "-C",
        "strip=debuginfo",
    ]);
    run(cmd)?;
    Ok(artefact(target_dir, package))
}

fn artefact(target_dir: &std::path::Path, package: &str) -> PathBuf {
    let file = package.replace('-', "_");
    target_dir.join(format!("{WASM_TARGET}/release/{file}.wasm"))
}

fn copy_out(built: &std::path::Path, dir: &std::path::Path, name: &str) -> anyhow::Result<PathBuf> {
    if !built.exists() {
        bail!("{name} built but {} is missing", built.display());
    }
    let dest = dir.join(format!("{name}.wasm"));
    std::fs::copy(built, &dest)
        .with_context(|| format!("copying {} to {}", built.display(), dest.display()))?;
    Ok(dest)
}

/// A policy kept outside this repository: scaffolds a standalone
/// distribution policy (the checked-in `templates/my-distribution-policy`,
/// copied as a user would, its SDK line pointed at this checkout) into a
/// temporary directory outside the checkout, builds it there with plain
/// `cargo build` (its own workspace and `.cargo/config.toml`), and runs
/// `lockstep policy check` (the binary `cargo xtask test` built) on what it
/// built. It builds into the policy fixtures' target directory, where
/// [`build_all`] built the dependencies already.
pub fn check_standalone(lockstep: &std::path::Path) -> anyhow::Result<()> {
    use crate::new_policy::TEMPLATES;
    step("a standalone policy, scaffolded and built outside the checkout, passes `lockstep policy check`");
    let scratch = crate::util::scratch_outside("lockstep-standalone-policy-")?;
    // The checked-in template, copied as a user would, with its SDK line
    // (a git URL and commit to fill in) pointed at this checkout.
    let (_, folder) = TEMPLATES[0];
    let name = std::path::Path::new(folder)
        .file_name()
        .expect("a folder")
        .to_string_lossy()
        .into_owned();
    let name = name.as_str();
    let dir = scratch.path().join(name);
    crate::util::copy_tree(&root().join(folder), &dir)?;
    let manifest = dir.join("Cargo.toml");
    let text = std::fs::read_to_string(&manifest)?;
    let sdk_line = text
        .lines()
        .find(|l| l.starts_with("lockstep-policy-sdk = "))
        .context("the template names lockstep-policy-sdk")?
        .to_string();
    std::fs::write(
        &manifest,
        text.replace(
            &sdk_line,
            &format!(
                "lockstep-policy-sdk = {{ path = {:?} }}",
                root().join("crates/policy-sdk").display().to_string()
            ),
        ),
    )?;
    // Start from the fixtures' lock file so no new versions are resolved.
    std::fs::copy(fixtures_dir().join("Cargo.lock"), dir.join("Cargo.lock"))?;
    // The fixtures' target directory (`build_all` filled it): the
    // dependencies are built already.
    let target = root().join("target/lockstep/test-policies-build");
    let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    // From the crate's directory, so its .cargo/config.toml applies.
    cmd.current_dir(&dir)
        .args(["build", "--release", "--quiet", "--target", WASM_TARGET])
        .arg("--target-dir")
        .arg(&target);
    run(cmd)?;
    let built = artefact(&target, name);
    if !built.exists() {
        bail!(
            "the standalone policy built, but {} is missing",
            built.display()
        );
    }
    let out = Command::new(lockstep)
        .args(["policy", "check"])
        .arg(&built)
        .output()
        .with_context(|| format!("running {}", lockstep.display()))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    print!("{stdout}");
    if !out.status.success() {
        bail!(
            "lockstep policy check refused the standalone policy ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // The reporting contract's line: every scenario passed.
    let line: serde_json::Value = stdout
        .lines()
        .find_map(|l| serde_json::from_str(l).ok())
        .with_context(|| format!("lockstep policy check printed no JSON line: {stdout}"))?;
    let (scenarios, passed) = (&line["scenarios"], &line["passed"]);
    if scenarios.as_u64().unwrap_or(0) == 0 || scenarios != passed {
        bail!("the standalone policy did not pass every scenario: {line}");
    }
    eprintln!("xtask: standalone policy: ok");
    Ok(())
}
