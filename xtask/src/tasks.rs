//! The top-level tasks: build, test, demo.

use crate::policies;
use crate::util::{build_bins, cargo, run, step, target_dir};

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

/// Features the workspace's tests and lints build with: the test hooks
/// (failpoints) of the replica and of the environment, and the soak harness
/// (so that clippy and the build see it; a release build has none of them).
/// The demos and every chaos suite of `cargo xtask test` build with the
/// same, so one build of each binary serves them all (a crate built with
/// other features is built again).
pub const TEST_FEATURES: &str =
    "lockstep-replica/failpoints,lockstep-cli/failpoints,lockstep-cli/soak";

/// Runs every check CI runs. What a step needs beyond Rust is installed
/// where it can be, else the run fails naming it (`crate::prereqs`);
/// `skips` names steps skipped on purpose, listed again at the end.
pub fn test(lint: bool, skips: &[String]) -> anyhow::Result<()> {
    crate::prereqs::set_skips(skips)?;
    crate::prereqs::set_strict();
    step("what the run needs and cannot install (root, Go, disk, apt), checked first");
    crate::prereqs::check_before_test()?;
    if !crate::prereqs::skipped("kube") {
        // First, while the disk is emptiest: a cold Go build of the control
        // plane needs about 9 GB of caches, removed once the programs are
        // built (CI's disk has run out here when this came last).
        step(
            "the Kubernetes control plane's programs (tools/kube, built once into target/kube/bin)",
        );
        crate::kube_control_plane::ensure_built()?;
    }
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
        client_alone()?;
        release_features()?;
        kubernetes_version_alone()?;
        crate::buf::check()?;
        crate::deny::check()?;
    }
    step("building the policies");
    policies::build_all()?;
    step("PostgreSQL for the store tests (installed if missing)");
    crate::prereqs::postgres()?;
    step("cargo test (every crate)");
    let mut cmd = cargo();
    cmd.args(["test", "--workspace", "--features", TEST_FEATURES]);
    // What was checked before the run: a test that finds it missing fails
    // rather than passing with a "skipped" note.
    let mut has = Vec::new();
    if crate::prereqs::is_root() {
        has.push("root");
        if !crate::prereqs::skipped("hosts") {
            // iproute2, installed now if missing.
            crate::prereqs::hosts()?;
            has.push("hosts");
        }
    }
    cmd.env("LOCKSTEP_TEST_HAS", has.join(","));
    run(cmd)?;
    crate::util::after_workspace_tests();
    demo_built_with(Some(TEST_FEATURES))?;
    demo_on_postgres()?;
    demo_hosts()?;
    python_api()?;
    crate::image::in_test()?;
    policies::check_standalone(&target_dir().join("debug/lockstep"))?;
    crate::outside::check_family()?;
    for suite in crate::chaos::SUITES {
        crate::chaos::run_suite(suite)?;
    }
    if !crate::prereqs::skipped("kube") {
        crate::kube::kube(false)?;
    }
    crate::model::run(&[])?;
    crate::leftovers::check()?;
    crate::util::step_times();
    crate::prereqs::summary();
    eprintln!("\nxtask: test: ok");
    Ok(())
}

/// What the API client must not link: the environment library and what it
/// brings (the policy runtime, the Kubernetes client).
const NOT_IN_THE_CLIENT: [&str; 4] = ["lockstep-environment", "wasmtime", "kube", "kube-client"];

/// What needs only the protocol's types must not link: the sockets, the
/// tokio framing and the Noise session (`lockstep-transport`'s).
const NOT_IN_THE_PROTOCOL: [&str; 5] = [
    "lockstep-transport",
    "tokio",
    "tokio-util",
    "snow",
    "futures",
];

/// The `lockstep` command without its `server` feature is the API client
/// alone: its dependency tree holds none of [`NOT_IN_THE_CLIENT`], and it
/// builds without warnings. The protocol crate links none of
/// [`NOT_IN_THE_PROTOCOL`] (ARCHITECTURE.md's invariant).
fn client_alone() -> anyhow::Result<()> {
    step("the API client alone (no environment, wasmtime or kube) and the protocol without I/O (no tokio or snow)");
    links_none_of(
        &["-p", "lockstep-cli", "--no-default-features"],
        "lockstep-api",
        &NOT_IN_THE_CLIENT,
    )?;
    links_none_of(&["-p", "lockstep-protocol"], "prost", &NOT_IN_THE_PROTOCOL)?;
    let mut cmd = cargo();
    cmd.args([
        "clippy",
        "-p",
        "lockstep-cli",
        "--no-default-features",
        "--",
        "-D",
        "warnings",
    ]);
    run(cmd)
}

/// The features that turn test machinery on: failpoints, the model's
/// mutants, the negative controls' switches, the soak.
const TEST_MACHINERY: [&str; 4] = ["failpoints", "mutants", "experiments", "soak"];

/// What a plain `cargo build --release` at the workspace root builds (the
/// default members, normal and build dependencies) turns none of
/// [`TEST_MACHINERY`] on: the shipped binaries link no failpoint, mutant or
/// negative control (a `FAILPOINTS=...` or experiment variable does
/// nothing in them). Checked on the whole workspace too, which does, so
/// that the check is seen to read the features.
fn release_features() -> anyhow::Result<()> {
    step("a release build at the root turns no test machinery on (failpoints, mutants, experiments, soak)");
    let machinery = |args: &[&str]| -> anyhow::Result<Vec<String>> {
        let mut all = args.to_vec();
        all.extend(["-e", "features,normal,build"]);
        let tree = cargo_tree(&all)?;
        let mut found: Vec<String> = tree
            .lines()
            .filter(|l| {
                TEST_MACHINERY
                    .iter()
                    .any(|f| l.contains(&format!("feature \"{f}\"")))
            })
            .map(|l| l.trim_end_matches(" (*)").to_string())
            .collect();
        found.sort();
        found.dedup();
        Ok(found)
    };
    let shipped = machinery(&[])?;
    anyhow::ensure!(
        shipped.is_empty(),
        "a plain cargo build --release at the root would turn test machinery on: {shipped:?} (a default member's normal dependency enables it)"
    );
    let workspace = machinery(&["--workspace"])?;
    anyhow::ensure!(
        !workspace.is_empty(),
        "cargo tree --workspace lists no test machinery feature: the check reads nothing"
    );
    Ok(())
}

/// The normal dependency tree of `package_args` lists `must` (so the tree
/// was read) and none of `forbidden`.
fn links_none_of(package_args: &[&str], must: &str, forbidden: &[&str]) -> anyhow::Result<()> {
    let mut args = package_args.to_vec();
    args.extend(["-e", "normal", "--format", "{p}"]);
    let tree = cargo_tree(&args)?;
    let linked: Vec<&str> = tree
        .lines()
        .filter(|l| forbidden.contains(&l.split_whitespace().next().unwrap_or("")))
        .collect();
    anyhow::ensure!(
        tree.lines().any(|l| l.starts_with(&format!("{must} "))),
        "cargo tree {} does not list {must}: {tree}",
        package_args.join(" ")
    );
    anyhow::ensure!(
        linked.is_empty(),
        "{} links {linked:?}",
        package_args.join(" ")
    );
    Ok(())
}

/// Every package whose tests or benchmarks link k8s-openapi picks its
/// Kubernetes API version (a `v1_*` feature) when built alone (`cargo test
/// -p NAME`, `cargo bench -p NAME`): a library leaves the choice to the
/// final crate (k8s-openapi's rule), and `cargo test --workspace` unifies
/// features, so only this catches a crate that builds in the workspace and
/// not alone (as `cargo xtask bench` did not, after the environment stopped
/// choosing). Reads `cargo tree`; builds nothing.
fn kubernetes_version_alone() -> anyhow::Result<()> {
    step("every package that links k8s-openapi picks its API version when built alone");
    let mut cmd = cargo();
    cmd.args(["metadata", "--no-deps", "--format-version", "1"]);
    let out = cmd.output()?;
    anyhow::ensure!(out.status.success(), "cargo metadata failed");
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    let mut missing = Vec::new();
    for package in meta["packages"].as_array().into_iter().flatten() {
        let Some(name) = package["name"].as_str() else {
            continue;
        };
        let tree = cargo_tree(&[
            "-p",
            name,
            "-e",
            "normal,dev,build",
            "--format",
            "{p} [{f}]",
        ])?;
        if tree
            .lines()
            .any(|l| l.starts_with("k8s-openapi ") && !l.contains("v1_"))
        {
            missing.push(name.to_string());
        }
    }
    anyhow::ensure!(
        missing.is_empty(),
        "these packages link k8s-openapi without a Kubernetes version when built alone \
         (add a dev-dependency `k8s-openapi = {{ workspace = true, features = [\"v1_33\"] }}`): {missing:?}"
    );
    Ok(())
}

/// `cargo tree ARGS --prefix none`: one package per line.
fn cargo_tree(args: &[&str]) -> anyhow::Result<String> {
    let mut cmd = cargo();
    cmd.arg("tree").args(args).args(["--prefix", "none"]);
    let out = cmd.output()?;
    anyhow::ensure!(
        out.status.success(),
        "cargo tree {} failed: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The API through a client generated in another language
/// (`tests/python/api_test.py`, after `demo` built the binaries), with a
/// python3 that has its packages (`crate::prereqs::python`: installed into
/// a virtual environment under `target/` if the system's lacks them).
pub fn python_api() -> anyhow::Result<()> {
    step("the API from a generated Python client (reflection, health, every error code)");
    if crate::prereqs::skipped("python") {
        return Ok(());
    }
    let python = crate::prereqs::python()?;
    let mut cmd = std::process::Command::new(python);
    cmd.arg(crate::util::root().join("tests/python/api_test.py"))
        .arg("--lockstep")
        .arg(target_dir().join("debug/lockstep"));
    run(cmd)
}

/// The demo: builds the `lockstep` and `lockstep-replica` binaries and runs
/// `lockstep demo` (crates/cli/src/demo.rs, a module of the binary), which prints its progress
/// and ends with `demo: ok`, or says what failed and exits non-zero.
pub fn demo() -> anyhow::Result<()> {
    demo_built_with(None)
}

/// The demo on binaries built with `features` (`cargo xtask test` builds
/// them with [`TEST_FEATURES`]: failpoints compiled in, none set).
fn demo_built_with(features: Option<&str>) -> anyhow::Result<()> {
    step("building lockstep and lockstep-replica");
    let mut cmd = build_bins(&["lockstep-cli", "lockstep-replica"], features);
    cmd.arg("--quiet");
    run(cmd)?;
    step("demo");
    let mut cmd = std::process::Command::new(target_dir().join("debug/lockstep"));
    cmd.arg("demo");
    run(cmd)
}

/// The demo again with the catalog and the command logs in PostgreSQL
/// (`lockstep demo --store`), on a throw-away server (`lockstep-pgtest`;
/// the PostgreSQL binaries must be installed, as `.ci/run` does). Run after
/// [`demo`], which built the binaries.
pub fn demo_on_postgres() -> anyhow::Result<()> {
    step("demo on PostgreSQL (--store postgres://...)");
    let pg = lockstep_pgtest::PgServer::start().map_err(|e| {
        anyhow::anyhow!(
            "cannot start PostgreSQL for the demo (install postgresql; .ci/run does): {e}"
        )
    })?;
    let mut cmd = std::process::Command::new(target_dir().join("debug/lockstep"));
    cmd.args(["demo", "--store", &pg.url()]);
    run(cmd)
}

/// `lockstep demo --hosts 2` (after [`demo`] built the binaries): the
/// replica's processes on two simulated hosts.
pub fn demo_hosts() -> anyhow::Result<()> {
    step("demo across 2 simulated hosts (network namespaces)");
    if !hosts_available()? {
        return Ok(());
    }
    let mut cmd = std::process::Command::new(target_dir().join("debug/lockstep"));
    cmd.args(["demo", "--hosts", "2"]);
    run(cmd)
}

/// Whether simulated hosts (network namespaces, `lockstep serve --hosts`:
/// root and iproute2) can run here, iproute2 installed if missing. False
/// when skipped on purpose (`--skip hosts`); under `cargo xtask test` an
/// error when they cannot run, elsewhere false, saying why.
pub fn hosts_available() -> anyhow::Result<bool> {
    if crate::prereqs::skipped("hosts") {
        return Ok(false);
    }
    match crate::prereqs::hosts() {
        Ok(()) => Ok(true),
        Err(e) if crate::prereqs::strict() => Err(e),
        Err(e) => {
            eprintln!("xtask: simulated hosts cannot run here: {e:#}");
            Ok(false)
        }
    }
}
