//! Building the control plane's programs from `tools/kube/` into
//! `target/kube/bin/` (Go's module and build caches under `target/go/`,
//! removed once the programs are built), once per change of a module (a
//! stamp file per module). Built programs are also kept outside the
//! checkout, in a cache keyed by each module's stamp (its Go files, go.mod,
//! go.sum, the Go version, packages and flags): a fresh clone on the same
//! machine (CI's) restores them instead of building them again
//! ([`cache_dir`]).

use std::collections::hash_map::DefaultHasher;
use std::fs;
use std::hash::{Hash, Hasher};
use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use anyhow::Context;

use crate::util::{root, run, target_dir};

/// The built programs.
#[derive(Debug, Clone)]
pub struct Binaries {
    /// etcd (go.etcd.io/etcd/server/v3).
    pub etcd: PathBuf,
    /// kube-apiserver.
    pub kube_apiserver: PathBuf,
    /// kube-controller-manager (service accounts, namespace deletion,
    /// garbage collection, the workload controllers).
    pub kube_controller_manager: PathBuf,
    /// kube-scheduler (binds pods to the node: kwok does not).
    pub kube_scheduler: PathBuf,
    /// kubectl, of the same release as the API server.
    pub kubectl: PathBuf,
    /// kwok (sigs.k8s.io/kwok), the fake kubelet.
    pub kwok: PathBuf,
    /// kubelet, of the same release: the real node's agent.
    pub kubelet: PathBuf,
    /// CoreDNS (only the plugins the real node's Corefile uses): pod DNS.
    pub coredns: PathBuf,
    /// Prometheus (static and HTTP service discovery only): the shipped
    /// scrape configuration run by Prometheus itself on the real node.
    pub prometheus: PathBuf,
    /// The directory of the oldest stated release's kube-apiserver,
    /// kube-controller-manager, kube-scheduler and kubectl ([`OLDEST`]).
    pub oldest: PathBuf,
}

/// The oldest Kubernetes release lockstep states it supports, built from
/// tools/kube/k8s-oldest (docs/kubernetes.md, "Kubernetes versions").
pub const OLDEST: &str = "v1.33.13";

impl Binaries {
    /// The same programs with the control plane (API server, controller
    /// manager, scheduler, kubectl) of [`OLDEST`].
    pub fn with_oldest_control_plane(&self) -> Binaries {
        Binaries {
            kube_apiserver: self.oldest.join("kube-apiserver"),
            kube_controller_manager: self.oldest.join("kube-controller-manager"),
            kube_scheduler: self.oldest.join("kube-scheduler"),
            kubectl: self.oldest.join("kubectl"),
            ..self.clone()
        }
    }
}

/// One Go module of tools/kube/ and the programs built from it.
struct GoModule {
    /// Its directory under tools/kube/.
    dir: &'static str,
    /// The packages to build (each gives a program of its last element's name).
    packages: &'static [&'static str],
    /// Extra linker flags.
    ldflags: &'static str,
    /// The subdirectory of `target/kube/bin/` its programs go to ("": the
    /// directory itself).
    out: &'static str,
    /// Go build tags ("": none).
    tags: &'static str,
}

/// The version stamps kube's own Makefile sets for release `$version`
/// (minor `$minor`), so that `/version` answers it, not `v0.0.0-master`.
macro_rules! k8s_ldflags {
    ($version:literal, $minor:literal) => {
        concat!(
            "-X k8s.io/component-base/version.gitVersion=",
            $version,
            " -X k8s.io/component-base/version.gitMajor=1",
            " -X k8s.io/component-base/version.gitMinor=",
            $minor,
            " -X k8s.io/component-base/version.gitTreeState=clean",
            " -X k8s.io/client-go/pkg/version.gitVersion=",
            $version,
            " -X k8s.io/client-go/pkg/version.gitMajor=1",
            " -X k8s.io/client-go/pkg/version.gitMinor=",
            $minor,
            " -X k8s.io/client-go/pkg/version.gitTreeState=clean"
        )
    };
}

/// The k8s module's version stamps.
const K8S_LDFLAGS: &str = k8s_ldflags!("v1.37.2", "37");
/// The k8s-oldest module's ([`OLDEST`]).
const K8S_OLDEST_LDFLAGS: &str = k8s_ldflags!("v1.33.13", "33");

const MODULES: &[GoModule] = &[
    GoModule {
        dir: "etcd",
        packages: &["."],
        ldflags: "",
        out: "",
        tags: "",
    },
    GoModule {
        dir: "kwok",
        packages: &["."],
        ldflags: "",
        out: "",
        tags: "",
    },
    GoModule {
        dir: "k8s",
        packages: &[
            "k8s.io/kubernetes/cmd/kube-apiserver",
            "k8s.io/kubernetes/cmd/kube-controller-manager",
            "k8s.io/kubernetes/cmd/kube-scheduler",
            "k8s.io/kubernetes/cmd/kubectl",
            "k8s.io/kubernetes/cmd/kubelet",
        ],
        ldflags: K8S_LDFLAGS,
        out: "",
        tags: "",
    },
    GoModule {
        dir: "k8s-oldest",
        packages: &[
            "k8s.io/kubernetes/cmd/kube-apiserver",
            "k8s.io/kubernetes/cmd/kube-controller-manager",
            "k8s.io/kubernetes/cmd/kube-scheduler",
            "k8s.io/kubernetes/cmd/kubectl",
        ],
        ldflags: K8S_OLDEST_LDFLAGS,
        out: "k8s-oldest",
        tags: "",
    },
    GoModule {
        dir: "coredns",
        packages: &["."],
        ldflags: "",
        out: "",
        tags: "",
    },
    GoModule {
        dir: "prometheus",
        packages: &["github.com/prometheus/prometheus/cmd/prometheus"],
        ldflags: "",
        out: "",
        tags: "remove_all_sd",
    },
];

/// `target/kube/bin/`: the built programs.
pub fn bin_dir() -> PathBuf {
    target_dir().join("kube/bin")
}

/// `target/go/`: GOPATH, the module cache and the build cache.
/// Where the control plane's programs are kept between checkouts:
/// `kube/DIR-STAMP/` per module under [`crate::util::cache_root`]. `None`
/// without one (nothing is cached).
pub fn cache_dir() -> Option<PathBuf> {
    crate::util::cache_root().map(|base| base.join("kube"))
}

/// Copies `names` from `from` to `to` (each through a temporary name, then
/// renamed: a reader never sees half a program).
fn copy_programs(
    from: &std::path::Path,
    to: &std::path::Path,
    names: &[String],
) -> anyhow::Result<()> {
    fs::create_dir_all(to).with_context(|| format!("creating {}", to.display()))?;
    for n in names {
        let tmp = to.join(format!(".{n}.part"));
        fs::copy(from.join(n), &tmp)
            .with_context(|| format!("copying {} to {}", from.join(n).display(), tmp.display()))?;
        fs::rename(&tmp, to.join(n))?;
    }
    Ok(())
}

/// Keeps module `dir`'s programs built at `stamp` in the cache, and removes
/// its entries of other stamps (the cache holds one build per module).
fn keep_in_cache(
    cache: &std::path::Path,
    dir: &str,
    stamp: &str,
    bin: &std::path::Path,
    names: &[String],
) -> anyhow::Result<()> {
    let entry = cache.join(format!("{dir}-{stamp}"));
    let part = cache.join(format!(".{dir}-{stamp}.part"));
    let _ = fs::remove_dir_all(&part);
    copy_programs(bin, &part, names)?;
    let _ = fs::remove_dir_all(&entry);
    fs::rename(&part, &entry)?;
    for e in fs::read_dir(cache)?.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        // `DIR-` and a stamp (16 hex digits): `k8s-` must not match
        // `k8s-oldest-...`.
        let of_dir = name
            .strip_prefix(&format!("{dir}-"))
            .is_some_and(|rest| rest.len() == 16 && rest.chars().all(|c| c.is_ascii_hexdigit()));
        if of_dir && e.path() != entry {
            let _ = fs::remove_dir_all(e.path());
        }
    }
    Ok(())
}

fn go_dir() -> PathBuf {
    target_dir().join("go")
}

/// `go` with its caches under `target/go/`, run in tools/kube/`module`.
fn go(module: &str) -> Command {
    let go_dir = go_dir();
    let mut cmd = Command::new("nice");
    cmd.arg("go")
        .current_dir(root().join("tools/kube").join(module))
        .env("GOPATH", &go_dir)
        .env("GOMODCACHE", go_dir.join("mod"))
        .env("GOCACHE", go_dir.join("cache"))
        // A module cache that `rm -rf` can remove; no VCS stamping (the
        // checkout is the main module's repository, not the programs').
        .env("GOFLAGS", "-modcacherw -buildvcs=false")
        .env("CGO_ENABLED", "0");
    cmd
}

/// The name of the program built from `package` in `module`.
fn program_name(module: &GoModule, package: &str) -> String {
    if package == "." {
        module.dir.to_string()
    } else {
        package.rsplit('/').next().unwrap_or(package).to_string()
    }
}

/// A hash of what a module's programs are built from: its go.mod, go.sum,
/// Go files, the packages and linker flags, and the Go version.
fn module_stamp(module: &GoModule, go_version: &str) -> anyhow::Result<String> {
    let dir = root().join("tools/kube").join(module.dir);
    let mut files: Vec<PathBuf> = fs::read_dir(&dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
            name == "go.mod" || name == "go.sum" || name.ends_with(".go")
        })
        .collect();
    files.sort();
    let mut h = DefaultHasher::new();
    go_version.hash(&mut h);
    module.packages.hash(&mut h);
    module.ldflags.hash(&mut h);
    // Hashed only when set: the stamps of the modules without tags stay
    // what they were (their cached programs stay valid).
    if !module.tags.is_empty() {
        module.tags.hash(&mut h);
    }
    for f in files {
        f.file_name().hash(&mut h);
        fs::read(&f)
            .with_context(|| format!("reading {}", f.display()))?
            .hash(&mut h);
    }
    Ok(format!("{:016x}", h.finish()))
}

/// Removes Go's build and module caches (`target/go/`): a cold build of
/// the control plane fills about 9 GB there, more than anything else
/// `cargo xtask test` writes, and once the programs are in
/// `target/kube/bin/` (stamped) nothing reads them again. A change of a
/// module under tools/kube/ then rebuilds cold.
fn drop_go_caches() -> anyhow::Result<()> {
    let dir = go_dir();
    if !dir.exists() {
        return Ok(());
    }
    let before = crate::util::room();
    fs::remove_dir_all(&dir).with_context(|| format!("removing {}", dir.display()))?;
    eprintln!(
        "xtask: kube: removed Go's caches ({}); before: {before}, now: {}",
        dir.display(),
        crate::util::room()
    );
    Ok(())
}

/// Builds (or finds up to date) etcd, kube-apiserver, kube-controller-manager,
/// kube-scheduler, kubectl, kubelet, kwok and CoreDNS in `target/kube/bin/`. A module is
/// rebuilt only when its stamp (go.mod, go.sum, Go files, Go version)
/// changed; a cold build of all takes many minutes on two cores.
pub fn ensure_built() -> anyhow::Result<Binaries> {
    let bin = bin_dir();
    fs::create_dir_all(&bin).with_context(|| format!("creating {}", bin.display()))?;
    let mut go_env = Command::new("go");
    go_env.args(["env", "GOVERSION"]);
    let go_version = crate::util::stdout(go_env)
        .context("is Go (1.26 or newer) installed, with the module proxy reachable?")?
        .trim()
        .to_string();

    for module in MODULES {
        let stamp = module_stamp(module, &go_version)?;
        let stamp_file = bin.join(format!(".{}.stamp", module.dir));
        let out = bin.join(module.out);
        fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
        let programs: Vec<PathBuf> = module
            .packages
            .iter()
            .map(|p| out.join(program_name(module, p)))
            .collect();
        let fresh = fs::read_to_string(&stamp_file).ok().as_deref() == Some(stamp.as_str())
            && programs.iter().all(|p| p.is_file());
        let names: Vec<String> = module
            .packages
            .iter()
            .map(|p| program_name(module, p))
            .collect();
        if fresh {
            eprintln!("xtask: kube: {} up to date", names.join(", "));
            continue;
        }
        let cached = cache_dir().map(|c| c.join(format!("{}-{stamp}", module.dir)));
        if let Some(cached) = cached.filter(|c| names.iter().all(|n| c.join(n).is_file())) {
            let started = Instant::now();
            copy_programs(&cached, &out, &names)?;
            fs::write(&stamp_file, &stamp)?;
            eprintln!(
                "xtask: kube: {} restored from {} in {:.1} s (built before from the same module)",
                names.join(", "),
                cached.display(),
                started.elapsed().as_secs_f64()
            );
            continue;
        }
        eprintln!(
            "xtask: kube: building {} from tools/kube/{} (Go {go_version}; the first build takes minutes)",
            names.join(", "),
            module.dir
        );
        let started = Instant::now();
        let _ = fs::remove_file(&stamp_file);
        let mut cmd = go(module.dir);
        cmd.args(["build", "-trimpath", "-ldflags"])
            .arg(format!("-s -w {}", module.ldflags).trim_end());
        if !module.tags.is_empty() {
            cmd.args(["-tags", module.tags]);
        }
        cmd.arg("-o");
        if module.packages.len() == 1 {
            cmd.arg(&programs[0]);
        } else {
            // `-o DIR/` with several packages: one program each.
            cmd.arg(format!("{}/", out.display()));
        }
        cmd.args(module.packages);
        run(cmd).with_context(|| {
            format!(
                "building {} (tools/kube/{}) failed",
                names.join(", "),
                module.dir
            )
        })?;
        fs::write(&stamp_file, &stamp)?;
        eprintln!(
            "xtask: kube: built {} in {:.0} s",
            names.join(", "),
            started.elapsed().as_secs_f64()
        );
        // Best effort: a cache that cannot be written costs the next clone
        // a build, nothing else.
        if let Some(cache) = cache_dir() {
            match keep_in_cache(&cache, module.dir, &stamp, &out, &names) {
                Ok(()) => eprintln!("xtask: kube: kept in {}", cache.display()),
                Err(e) => eprintln!(
                    "xtask: kube: could not keep the programs in {}: {e:#}",
                    cache.display()
                ),
            }
        }
    }
    drop_go_caches()?;
    Ok(Binaries {
        etcd: bin.join("etcd"),
        kube_apiserver: bin.join("kube-apiserver"),
        kube_controller_manager: bin.join("kube-controller-manager"),
        kube_scheduler: bin.join("kube-scheduler"),
        kubectl: bin.join("kubectl"),
        kwok: bin.join("kwok"),
        kubelet: bin.join("kubelet"),
        coredns: bin.join("coredns"),
        oldest: bin.join("k8s-oldest"),
        prometheus: bin.join("prometheus"),
    })
}
