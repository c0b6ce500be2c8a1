//! What `cargo xtask test` needs beyond Rust, installed where it can be
//! (Debian's packages as root, Python packages into a virtual environment
//! under `target/`), else a failure that names the missing piece. Nothing
//! is skipped silently: `--skip NAME` skips a step on purpose, and the
//! summary at the end lists every skip.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

use anyhow::{bail, Context};

use crate::util::target_dir;

/// The steps `--skip` may name, and what each needs.
pub const SKIPPABLE: [(&str, &str); 5] = [
    (
        "python",
        "the API from a generated Python client (python3, grpcio and friends in a venv)",
    ),
    (
        "hosts",
        "simulated hosts: demo --hosts 2 and the @hosts variants (root, iproute2)",
    ),
    (
        "image",
        "the container image check (podman, debootstrap, runc)",
    ),
    (
        "kube",
        "cargo xtask kube: the Kubernetes backend on a real API server (Go, the module proxy)",
    ),
    (
        "kube-node",
        "cargo xtask kube's real node: replica pods on kubelet, containerd and CoreDNS (root)",
    ),
];

/// The steps skipped on purpose, by name.
static SKIPS: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// Whether a missing piece fails the run (`cargo xtask test`) rather than
/// leaving its step out, said (a task run alone).
static STRICT: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// From now on a missing piece fails the run.
pub fn set_strict() {
    STRICT.store(true, std::sync::atomic::Ordering::Relaxed);
}

/// Whether a missing piece fails the run.
pub fn strict() -> bool {
    STRICT.load(std::sync::atomic::Ordering::Relaxed)
}

/// Takes the names given to `--skip`; an unknown one is an error listing
/// the known ones.
pub fn set_skips(names: &[String]) -> anyhow::Result<()> {
    for n in names {
        if !SKIPPABLE.iter().any(|(k, _)| k == n) {
            bail!(
                "--skip {n}: no such step; the steps that can be skipped are {}",
                SKIPPABLE
                    .iter()
                    .map(|(k, _)| *k)
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
    }
    *SKIPS.lock().unwrap_or_else(|e| e.into_inner()) = names.to_vec();
    Ok(())
}

/// Whether the step `name` is skipped on purpose (said once, at the step).
pub fn skipped(name: &str) -> bool {
    let skip = SKIPS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .any(|n| n == name);
    if skip {
        eprintln!("xtask: {name}: skipped on purpose (--skip {name})");
    }
    skip
}

/// The closing lines: every step skipped on purpose, or that none was.
pub fn summary() {
    let skips = SKIPS.lock().unwrap_or_else(|e| e.into_inner());
    if skips.is_empty() {
        eprintln!("xtask: nothing was skipped");
        return;
    }
    eprintln!("xtask: skipped on purpose (--skip):");
    for name in skips.iter() {
        let what = SKIPPABLE
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, w)| *w)
            .unwrap_or("");
        eprintln!("  {name}: {what}");
    }
}

/// Disk a run needs under the target directory before the Go build of the
/// control plane, in GB: that build fills about 9 GB of caches (removed
/// once the programs are built).
const COLD_DISK_GB: f64 = 12.0;
/// Disk below which no run gets far (the Rust builds alone fill more).
const WARM_DISK_GB: f64 = 3.0;

/// Everything `cargo xtask test` needs and cannot install itself, checked
/// before its first step: every missing piece named at once (a missing
/// package is fine where it can be installed: root and apt-get).
pub fn check_before_test() -> anyhow::Result<()> {
    let root = is_root();
    let apt = root && on_path("apt-get");
    let uid = nix_uid().map_or_else(|| "unknown".into(), |u| u.to_string());
    let mut missing: Vec<String> = Vec::new();
    let mut packages = |what: &str, wanted: &[(&str, bool)]| {
        let absent: Vec<&str> = wanted
            .iter()
            .filter(|(_, have)| !have)
            .map(|(p, _)| *p)
            .collect();
        if !absent.is_empty() && !apt {
            missing.push(format!(
                "{what}: the Debian packages {} (as root: apt-get install {})",
                absent.join(", "),
                absent.join(" ")
            ));
        }
    };
    let have_pg = (on_path("initdb") && on_path("pg_ctl"))
        || std::fs::read_dir("/usr/lib/postgresql")
            .map(|d| d.flatten().any(|v| v.path().join("bin/pg_ctl").exists()))
            .unwrap_or(false);
    packages("the store tests", &[("postgresql", have_pg)]);
    if !skipped_quietly("python") {
        packages("the Python API test", &[("python3", on_path("python3"))]);
    }
    if !skipped_quietly("image") {
        packages(
            "the image check",
            &[
                ("podman", on_path("podman")),
                ("debootstrap", on_path("debootstrap")),
                ("runc", on_path("runc")),
            ],
        );
    }
    if !skipped_quietly("kube-node") && !skipped_quietly("kube") {
        packages(
            "the real Kubernetes node",
            &[
                ("containerd", on_path("containerd")),
                (
                    "containernetworking-plugins",
                    Path::new("/usr/lib/cni/bridge").is_file(),
                ),
            ],
        );
    }
    let mut need = |what: &str| missing.push(what.to_string());
    if !root {
        for (step, why) in [
            ("hosts", "simulated hosts (network namespaces)"),
            (
                "image",
                "the image check (a volume owned by the image's user)",
            ),
            (
                "kube-node",
                "the real Kubernetes node (kubelet, containerd)",
            ),
        ] {
            let kube_node_without_kube = step == "kube-node" && skipped_quietly("kube");
            if !(skipped_quietly(step) || kube_node_without_kube) {
                need(&format!(
                    "{why} needs root (uid {uid}): run as root or pass --skip {step}"
                ));
            }
        }
    }
    // Built here, or kept between checkouts (the cache outside the target).
    let programs_built = crate::kube_control_plane::bin_dir()
        .join("kubectl")
        .is_file()
        || crate::kube_control_plane::cache_dir()
            .and_then(|d| std::fs::read_dir(d.join("kube")).ok())
            .is_some_and(|mut d| d.next().is_some());
    if !skipped_quietly("kube") && !programs_built && !on_path("go") {
        need("cargo xtask kube builds the control plane with Go (1.26 or newer, the module proxy reachable): install it or pass --skip kube");
    }
    let wanted = if programs_built || skipped_quietly("kube") {
        WARM_DISK_GB
    } else {
        COLD_DISK_GB
    };
    let dir = Some(target_dir())
        .filter(|d| d.exists())
        .unwrap_or_else(crate::util::root);
    if let Ok(s) = nix::sys::statvfs::statvfs(&dir) {
        let free = s.blocks_available() as f64 * s.fragment_size() as f64 / 1e9;
        if free < wanted {
            need(&format!(
                "{free:.1} GB free under {}, and a run needs about {wanted:.0} GB",
                dir.display()
            ));
        }
    }
    if missing.is_empty() {
        return Ok(());
    }
    bail!(
        "cargo xtask test cannot run here; every missing piece:\n  - {}",
        missing.join("\n  - ")
    )
}

/// Whether `name` is skipped on purpose, without saying so.
fn skipped_quietly(name: &str) -> bool {
    SKIPS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .any(|n| n == name)
}

/// Whether this process runs as root.
pub fn is_root() -> bool {
    nix_uid() == Some(0)
}

fn nix_uid() -> Option<u32> {
    let out = Command::new("id").arg("-u").output().ok()?;
    String::from_utf8_lossy(&out.stdout).trim().parse().ok()
}

/// Whether `program` is on PATH.
fn on_path(program: &str) -> bool {
    std::env::var_os("PATH").is_some_and(|p| {
        std::env::split_paths(&p).any(|d| {
            let f = d.join(program);
            f.is_file()
        })
    })
}

/// Installs Debian `packages` (as root, with apt-get), or fails naming
/// them and what needs them.
fn apt_install(packages: &[&str], for_what: &str) -> anyhow::Result<()> {
    if !is_root() || !on_path("apt-get") {
        bail!(
            "{for_what} needs the Debian packages {} (install them as root: apt-get install {}), or pass --skip for its step where it has one",
            packages.join(", "),
            packages.join(" ")
        );
    }
    eprintln!(
        "xtask: installing {} for {for_what} (apt-get)",
        packages.join(" ")
    );
    let update = Command::new("apt-get")
        .args(["update", "-qq"])
        .status()
        .context("running apt-get update")?;
    if !update.success() {
        bail!(
            "apt-get update failed ({update}); {for_what} needs {}",
            packages.join(", ")
        );
    }
    let status = Command::new("apt-get")
        .args(["install", "-y", "-qq"])
        .args(packages)
        .env("DEBIAN_FRONTEND", "noninteractive")
        .status()
        .context("running apt-get install")?;
    if !status.success() {
        bail!(
            "apt-get install {} failed ({status}); {for_what} needs them",
            packages.join(" ")
        );
    }
    Ok(())
}

/// The Python packages of the API client test, and the modules they give.
const PYTHON_PACKAGES: [&str; 5] = [
    "grpcio",
    "grpcio-tools",
    "grpcio-reflection",
    "grpcio-health-checking",
    "prometheus-client",
];
const PYTHON_MODULES: &str = "grpc, grpc_tools, grpc_reflection, grpc_health, prometheus_client";

fn imports_all(python: &Path) -> bool {
    Command::new(python)
        .args(["-c", &format!("import {PYTHON_MODULES}")])
        .output()
        .is_ok_and(|o| o.status.success())
}

/// A python3 that imports the API test's modules: the system's if it
/// does, else the virtual environment `target/xtask-venv` (made, with the
/// packages installed by pip, on first use; Debian's python3-venv installed
/// if the system Python cannot make one).
pub fn python() -> anyhow::Result<PathBuf> {
    let system = PathBuf::from("python3");
    if !on_path("python3") {
        apt_install(&["python3", "python3-venv"], "the Python API test")?;
    }
    if imports_all(&system) {
        return Ok(system);
    }
    let venv = target_dir().join("xtask-venv");
    let python = venv.join("bin/python3");
    if python.exists() && imports_all(&python) {
        return Ok(python);
    }
    let make = |venv: &Path| {
        Command::new("python3")
            .args(["-m", "venv"])
            .arg(venv)
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if !make(&venv) {
        apt_install(
            &["python3-venv"],
            "the Python API test's virtual environment",
        )?;
        if !make(&venv) {
            bail!(
                "python3 -m venv {} failed even with python3-venv installed",
                venv.display()
            );
        }
    }
    eprintln!(
        "xtask: installing {} into {}",
        PYTHON_PACKAGES.join(" "),
        venv.display()
    );
    let status = Command::new(&python)
        .args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
        ])
        .args(PYTHON_PACKAGES)
        .status()
        .context("running pip in the virtual environment")?;
    if !status.success() || !imports_all(&python) {
        bail!(
            "pip could not install {} into {} (is PyPI reachable?)",
            PYTHON_PACKAGES.join(" "),
            venv.display()
        );
    }
    Ok(python)
}

/// PostgreSQL's server binaries (for `lockstep-pgtest`'s throw-away
/// servers: the store tests and the demo on PostgreSQL) and, as root, the
/// `postgres` user they run as.
pub fn postgres() -> anyhow::Result<()> {
    let have = (on_path("initdb") && on_path("pg_ctl"))
        || std::fs::read_dir("/usr/lib/postgresql")
            .map(|d| d.flatten().any(|v| v.path().join("bin/pg_ctl").exists()))
            .unwrap_or(false);
    if !have {
        apt_install(&["postgresql"], "the PostgreSQL store tests and demo")?;
    }
    if is_root()
        && !Command::new("id")
            .arg("postgres")
            .output()
            .is_ok_and(|o| o.status.success())
    {
        eprintln!("xtask: adding the system user postgres (PostgreSQL refuses to run as root)");
        let status = Command::new("useradd")
            .args(["--system", "--no-create-home", "postgres"])
            .status()
            .context("running useradd")?;
        if !status.success() {
            bail!("useradd postgres failed ({status}); PostgreSQL refuses to run as root");
        }
    }
    Ok(())
}

/// What simulated hosts need (root, iproute2), installed where it can be;
/// else why not.
pub fn hosts() -> anyhow::Result<()> {
    if !is_root() {
        bail!(
            "simulated hosts (network namespaces) need root (uid {}); run as root or pass --skip hosts",
            nix_uid().map(|u| u.to_string()).unwrap_or_else(|| "unknown".into())
        );
    }
    if !on_path("ip") {
        apt_install(&["iproute2"], "simulated hosts")?;
    }
    Ok(())
}

/// The real Kubernetes node's runtime: containerd, runc and the CNI
/// plugins (Debian's packages), and podman (its catatonit is the pause
/// image), installed where they can be.
pub fn node() -> anyhow::Result<()> {
    podman()?;
    let mut missing: Vec<&str> = ["containerd", "ctr"]
        .into_iter()
        .filter(|p| !on_path(p))
        .map(|_| "containerd")
        .collect();
    if !Path::new("/usr/lib/cni/bridge").is_file() {
        missing.push("containernetworking-plugins");
    }
    missing.dedup();
    if !missing.is_empty() {
        apt_install(&missing, "the real Kubernetes node")?;
    }
    Ok(())
}

/// podman, and debootstrap and runc to make the base image where no
/// registry is reachable (the image check), installed where they can be.
pub fn podman() -> anyhow::Result<()> {
    let missing: Vec<&str> = ["podman", "debootstrap", "runc"]
        .into_iter()
        .filter(|p| !on_path(p))
        .collect();
    if !missing.is_empty() {
        apt_install(&missing, "the container image check")?;
    }
    Ok(())
}
