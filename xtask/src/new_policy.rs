//! `cargo xtask new-policy NAME --kind distribution|orphans`: scaffolds a
//! policy crate under `policies/NAME` that builds with `cargo xtask
//! build-policies` and passes the conformance check as it is, so a user
//! starts from something that works and changes the rule.
//!
//! With `--out DIR` it writes a standalone crate `DIR/NAME` instead, for a
//! policy kept outside this repository: its own workspace, a path (or,
//! with `--sdk-git URL`, git) dependency on `lockstep-policy-sdk`, and a
//! `.cargo/config.toml` that links the wasm target with `wasm-component-ld`,
//! so `cargo build --release --target wasm32-unknown-unknown` there writes
//! the component (`cargo xtask test` scaffolds one into a temporary
//! directory outside the checkout, builds it there and runs the conformance
//! check on it: [`crate::policies::check_standalone`]).

use std::path::Path;

use anyhow::{bail, Context};

use crate::util::{root, step};

/// The two kinds of policy, one per world of `wit/lockstep-policy.wit`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Kind {
    /// Chooses the distribution strategy of every command.
    Distribution,
    /// Decides which orchestrator services are orphans.
    Orphans,
}

/// Where a standalone policy takes `lockstep-policy-sdk` from.
#[derive(Clone, Debug)]
pub enum Sdk {
    /// A path (this checkout's `crates/policy-sdk`).
    Path(std::path::PathBuf),
    /// A git repository holding this workspace.
    Git(String),
    /// A git repository at a revision (the checked-in templates name
    /// placeholders the user replaces).
    GitRev {
        /// The repository.
        url: String,
        /// The commit.
        rev: String,
    },
}

/// The checked-in templates of a standalone policy, one per kind: what
/// [`write_standalone`] writes for a policy named as the folder, with the
/// SDK taken from git at a revision the user fills in. A user copies one
/// and needs no lockstep build; `cargo xtask test` checks they are what the
/// generator writes, and builds one from a scratch directory.
pub const TEMPLATES: [(Kind, &str); 2] = [
    (Kind::Distribution, "templates/my-distribution-policy"),
    (Kind::Orphans, "templates/my-orphan-policy"),
];

/// The SDK line of the checked-in templates: the placeholders a user
/// replaces with this repository's git URL and a commit.
pub fn template_sdk() -> Sdk {
    Sdk::GitRev {
        url: "GIT-URL-OF-LOCKSTEP".into(),
        rev: "COMMIT".into(),
    }
}

/// (Re)writes the checked-in templates under `root` (`cargo xtask
/// new-policy --templates`).
pub fn write_templates(root: &Path) -> anyhow::Result<()> {
    for (kind, folder) in TEMPLATES {
        let dir = root.join(folder);
        let name = dir
            .file_name()
            .expect("a folder name")
            .to_string_lossy()
            .into_owned();
        if dir.exists() {
            std::fs::remove_dir_all(&dir)?;
        }
        write_standalone(&dir, &name, kind, &template_sdk())?;
    }
    Ok(())
}

/// Writes the standalone crate `out/NAME` (see the module docs). Refuses to
/// overwrite.
pub fn scaffold_standalone(name: &str, kind: Kind, out: &Path, sdk: &Sdk) -> anyhow::Result<()> {
    check_name(name)?;
    let dir = out.join(name);
    if dir.exists() {
        bail!(
            "{} already exists: pick another name or directory",
            dir.display()
        );
    }
    step(&format!(
        "scaffolding {} ({kind:?} policy, standalone)",
        dir.display()
    ));
    write_standalone(&dir, name, kind, sdk)?;
    eprintln!(
        "xtask: wrote {dir}\n\
         xtask: build it there with `cargo build --release --target {target}` (-> target/{target}/release/{file}.wasm)\n\
         xtask: check it with `lockstep policy check target/{target}/release/{file}.wasm`",
        dir = dir.display(),
        target = crate::policies::WASM_TARGET,
        file = name.replace('-', "_"),
    );
    Ok(())
}

/// Writes the standalone crate `name` into `dir`.
pub fn write_standalone(dir: &Path, name: &str, kind: Kind, sdk: &Sdk) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir.join("src"))
        .with_context(|| format!("creating {}", dir.display()))?;
    std::fs::create_dir_all(dir.join(".cargo"))?;
    let what = match kind {
        Kind::Distribution => "distribution",
        Kind::Orphans => "orphan",
    };
    let dependency = match sdk {
        Sdk::Path(p) => format!("{{ path = {:?} }}", p.display().to_string()),
        Sdk::Git(url) => format!("{{ git = {url:?} }}"),
        Sdk::GitRev { url, rev } => format!("{{ git = {url:?}, rev = {rev:?} }}"),
    };
    // The toolchain this repository pins, with the wasm target, so the
    // policy builds the same wherever it is kept.
    let pinned = std::fs::read_to_string(root().join("rust-toolchain.toml"))
        .ok()
        .and_then(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix("channel = ").map(|v| v.trim().to_string()))
        })
        .unwrap_or_else(|| "\"stable\"".into());
    std::fs::write(
        dir.join("rust-toolchain.toml"),
        format!(
            "[toolchain]\nchannel = {pinned}\ntargets = [\"{target}\"]\nprofile = \"minimal\"\n",
            target = crate::policies::WASM_TARGET,
        ),
    )?;
    std::fs::write(
        dir.join("Cargo.toml"),
        format!(
            r#"[package]
name = "{name}"
description = "A lockstep {what} policy."
version = "0.1.0"
edition = "2021"
publish = false

# A WebAssembly component: `cargo build --release --target {target}`
# (the linker is set in .cargo/config.toml).
[lib]
crate-type = ["cdylib", "rlib"]

[dependencies]
lockstep-policy-sdk = {dependency}

# Its own workspace, wherever it is put.
[workspace]
"#,
            target = crate::policies::WASM_TARGET,
        ),
    )?;
    std::fs::write(
        dir.join(".cargo/config.toml"),
        format!(
            r#"# The policy is a WebAssembly component with no imports but `log`:
# wasm-component-ld (shipped with rustup's {target} target support)
# wraps the core module, and debug info is stripped (it would make a 28 KB
# policy 1.6 MB).
[target.{target}]
linker = "wasm-component-ld"
rustflags = ["-C", "strip=debuginfo"]
"#,
            target = crate::policies::WASM_TARGET,
        ),
    )?;
    let build = format!(
        "cargo build --release --target {}",
        crate::policies::WASM_TARGET
    );
    std::fs::write(
        dir.join("src/lib.rs"),
        source(name, kind).replace("cargo xtask build-policies", &build),
    )?;
    std::fs::write(
        dir.join("README.md"),
        format!(
            r#"# {name}

A lockstep {what} policy, written with `lockstep-policy-sdk`.

{sdk_note}- Test the rule: `cargo test`
- Build the component: `{build}`
  (`rustup target add {target}` once)
- Check it: `lockstep policy check target/{target}/release/{file}.wasm`
- Put it in force: `lockstep policy set target/{target}/release/{file}.wasm`
"#,
            target = crate::policies::WASM_TARGET,
            file = name.replace('-', "_"),
            sdk_note = match sdk {
                Sdk::GitRev { .. } => "- First, in `Cargo.toml`, put lockstep's git URL and a commit in the\n  `lockstep-policy-sdk` line (`GIT-URL-OF-LOCKSTEP`, `COMMIT`), and rename\n  the package if you like. Nothing of lockstep needs building.\n",
                _ => "",
            },
        ),
    )?;
    Ok(())
}

/// Writes `policies/NAME` (its Cargo.toml and its lib.rs). Refuses to overwrite.
pub fn scaffold(name: &str, kind: Kind) -> anyhow::Result<()> {
    check_name(name)?;
    let dir = root().join("policies").join(name);
    if dir.exists() {
        bail!("{} already exists: pick another name", dir.display());
    }
    step(&format!("scaffolding policies/{name} ({kind:?} policy)"));
    write(&dir, name, kind)?;
    eprintln!(
        "xtask: wrote policies/{name}\n\
         xtask: build it with `cargo xtask build-policies` (-> target/lockstep/policies/{name}.wasm)\n\
         xtask: check it with `lockstep policy check target/lockstep/policies/{name}.wasm`"
    );
    Ok(())
}

/// Writes the crate `name` into `dir` (which must be a member of a workspace
/// that defines the package fields, `lockstep-policy-sdk` and the lints).
/// `cargo xtask build-policies` also uses it to check that a fresh scaffold
/// builds and passes the conformance check.
pub fn write(dir: &Path, name: &str, kind: Kind) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir.join("src"))
        .with_context(|| format!("creating {}", dir.display()))?;
    std::fs::write(dir.join("Cargo.toml"), manifest(name, kind))?;
    std::fs::write(dir.join("src/lib.rs"), source(name, kind))?;
    Ok(())
}

/// A name is a crate directory and a file name: lower-case ASCII letters,
/// digits and dashes, starting with a letter.
fn check_name(name: &str) -> anyhow::Result<()> {
    let ok = name.chars().next().is_some_and(|c| c.is_ascii_lowercase())
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        && !name.ends_with('-');
    if !ok {
        bail!("policy name {name:?}: use lower-case letters, digits and dashes, starting with a letter");
    }
    Ok(())
}

fn manifest(name: &str, kind: Kind) -> String {
    let what = match kind {
        Kind::Distribution => "distribution",
        Kind::Orphans => "orphan",
    };
    format!(
        r#"[package]
name = "{name}"
description = "A lockstep {what} policy."
version.workspace = true
edition.workspace = true
rust-version.workspace = true
license.workspace = true
publish.workspace = true

[dependencies]
lockstep-policy-sdk.workspace = true

[lints]
workspace = true
"#
    )
}

/// The type name: `my-policy` -> `MyPolicy`.
fn type_name(name: &str) -> String {
    name.split('-')
        .map(|part| {
            let mut c = part.chars();
            c.next()
                .map(|f| f.to_ascii_uppercase().to_string() + c.as_str())
                .unwrap_or_default()
        })
        .collect()
}

fn source(name: &str, kind: Kind) -> String {
    let ty = type_name(name);
    match kind {
        Kind::Distribution => format!(
            r#"//! The `{name}` distribution policy.
//!
//! Called by the controller for every command; every process receives the
//! strategy chosen here with the command. Start: barrier for commands that
//! change the set of dataflows, broadcast for the rest. Change the rule and
//! run `cargo xtask build-policies`.

use lockstep_policy_sdk::distribution::{{
    CommandInfo, CommandKind, Distribution, MismatchAction, MismatchInfo, Strategy,
}};

/// The policy.
pub struct {ty};

impl Distribution for {ty} {{
    fn choose(info: &CommandInfo) -> Strategy {{
        match info.kind {{
            CommandKind::CreateDataflow | CommandKind::AllowCompaction => Strategy::Barrier,
            _ => Strategy::Broadcast,
        }}
    }}

    fn on_mismatch(_info: &MismatchInfo) -> MismatchAction {{
        MismatchAction::ReconcileCollectively
    }}
}}

lockstep_policy_sdk::export_distribution!({ty});

#[cfg(test)]
mod tests {{
    use super::*;

    fn command(kind: CommandKind) -> CommandInfo {{
        CommandInfo {{
            kind,
            size_bytes: 64,
            dataflow_id: Some(1),
            process_count: 2,
            workers_per_process: 2,
            reconciling: false,
        }}
    }}

    #[test]
    fn dataflow_changes_wait_at_the_barrier() {{
        assert!(matches!(
            {ty}::choose(&command(CommandKind::CreateDataflow)),
            Strategy::Barrier
        ));
        assert!(matches!(
            {ty}::choose(&command(CommandKind::Peek)),
            Strategy::Broadcast
        ));
    }}
}}
"#
        ),
        Kind::Orphans => format!(
            r#"//! The `{name}` orphan policy.
//!
//! Called once on controller start with the listed services and the
//! catalog's view. Start: the ID-watermark rule (halt if a service has
//! an ID at or above our next ID, else delete every service the catalog does
//! not keep). Change the rule and run `cargo xtask build-policies`.

use lockstep_policy_sdk::orphans::{{CatalogView, OrphanDecision, Orphans, Service}};

/// The policy.
pub struct {ty};

impl Orphans for {ty} {{
    fn classify(services: &[Service], view: &CatalogView) -> OrphanDecision {{
        if let Some(s) = services.iter().find(|s| s.id >= view.next_id) {{
            return OrphanDecision::Halt(format!(
                "service {{}} has ID {{}} at or above our next ID {{}}",
                s.name, s.id, view.next_id
            ));
        }}
        OrphanDecision::Delete(
            services
                .iter()
                .filter(|s| view.keep.binary_search(&s.id).is_err())
                .map(|s| s.id)
                .collect(),
        )
    }}
}}

lockstep_policy_sdk::export_orphans!({ty});

#[cfg(test)]
mod tests {{
    use super::*;

    fn svc(id: u64) -> Service {{
        Service {{
            id,
            name: format!("replica-{{id}}"),
            epoch: 1,
            labels: vec![],
        }}
    }}

    #[test]
    fn deletes_what_the_catalog_does_not_keep() {{
        let view = CatalogView {{
            keep: vec![1],
            our_epoch: 2,
            next_id: 5,
        }};
        match {ty}::classify(&[svc(1), svc(2)], &view) {{
            OrphanDecision::Delete(ids) => assert_eq!(ids, vec![2]),
            other => panic!("expected a deletion, got {{other:?}}"),
        }}
    }}

    #[test]
    fn halts_on_an_id_above_the_watermark() {{
        let view = CatalogView {{
            keep: vec![1],
            our_epoch: 2,
            next_id: 5,
        }};
        assert!(matches!(
            {ty}::classify(&[svc(1), svc(5)], &view),
            OrphanDecision::Halt(_)
        ));
    }}
}}
"#
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every file of `dir`, by its path below it.
    fn files(dir: &Path) -> std::collections::BTreeMap<String, String> {
        let mut out = std::collections::BTreeMap::new();
        let mut stack = vec![dir.to_path_buf()];
        while let Some(d) = stack.pop() {
            for e in std::fs::read_dir(&d).unwrap().flatten() {
                let p = e.path();
                if p.is_dir() {
                    stack.push(p);
                } else {
                    let rel = p.strip_prefix(dir).unwrap().display().to_string();
                    out.insert(rel, std::fs::read_to_string(&p).unwrap());
                }
            }
        }
        out
    }

    #[test]
    fn the_checked_in_templates_are_what_the_generator_writes() {
        let scratch = tempfile::tempdir().unwrap();
        write_templates(scratch.path()).unwrap();
        for (_, folder) in TEMPLATES {
            let want = files(&scratch.path().join(folder));
            let have = files(&root().join(folder));
            assert!(
                want == have,
                "{folder} differs from what the generator writes: run `cargo xtask new-policy --templates`"
            );
            assert!(have.contains_key("rust-toolchain.toml"));
            assert!(have["Cargo.toml"].contains("rev = \"COMMIT\""));
        }
    }

    #[test]
    fn names_are_checked() {
        assert!(check_name("my-policy2").is_ok());
        for bad in ["", "My", "2x", "a_b", "a-", "a/b", "a b"] {
            assert!(check_name(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn type_names_are_camel_case() {
        assert_eq!(type_name("my-policy"), "MyPolicy");
        assert_eq!(type_name("x"), "X");
    }
}
