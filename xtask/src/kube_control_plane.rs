//! A real Kubernetes control plane on loopback, for tests: etcd,
//! kube-apiserver, kube-controller-manager and kube-scheduler, built from
//! their Go modules (tools/kube/), with kwok as the kubelet of one fake
//! node (pods are bound by the scheduler; kwok marks them Running and Ready
//! with a podIP from 127.0.100.0/24 and finishes their graceful deletion).
//!
//! [`ensure_built`] builds the programs into `target/kube/bin/` (the Go
//! module and build caches under `target/go/`); [`ControlPlane::start`]
//! starts them on free loopback ports and [`ControlPlane`]'s `Drop` stops
//! them all. `cargo xtask kube-up` runs one until Ctrl-C.

use std::collections::hash_map::DefaultHasher;
use std::fs;
use std::hash::{Hash, Hasher};
use std::io::{Read, Seek, SeekFrom};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::thread::sleep;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use crate::util::{root, run, target_dir};

/// The Kubernetes release of kube-apiserver and the other programs (and of
/// every k8s.io staging module, at v0.37.2): tools/kube/k8s/go.mod.
pub const KUBERNETES_VERSION: &str = "v1.37.2";

/// The name of the one fake node (managed by kwok).
pub const NODE_NAME: &str = "kwok-node-0";

/// Where kwok takes pod IPs from.
pub const POD_CIDR: &str = "127.0.100.0/24";

/// How long [`ControlPlane::start`] waits for each piece to be ready.
const READY_TIMEOUT: Duration = Duration::from_secs(120);

/// How long `Drop` gives each process after SIGTERM before SIGKILL.
const STOP_TIMEOUT: Duration = Duration::from_secs(5);

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
}

/// One Go module of tools/kube/ and the programs built from it.
struct GoModule {
    /// Its directory under tools/kube/.
    dir: &'static str,
    /// The packages to build (each gives a program of its last element's name).
    packages: &'static [&'static str],
    /// Extra linker flags.
    ldflags: &'static str,
}

/// The version stamps kube's own Makefile sets (`/version` answers
/// `v1.37.2`, not `v0.0.0-master`).
const K8S_LDFLAGS: &str = "-X k8s.io/component-base/version.gitVersion=v1.37.2 \
     -X k8s.io/component-base/version.gitMajor=1 \
     -X k8s.io/component-base/version.gitMinor=37 \
     -X k8s.io/component-base/version.gitTreeState=clean \
     -X k8s.io/client-go/pkg/version.gitVersion=v1.37.2 \
     -X k8s.io/client-go/pkg/version.gitMajor=1 \
     -X k8s.io/client-go/pkg/version.gitMinor=37 \
     -X k8s.io/client-go/pkg/version.gitTreeState=clean";

const MODULES: &[GoModule] = &[
    GoModule {
        dir: "etcd",
        packages: &["."],
        ldflags: "",
    },
    GoModule {
        dir: "kwok",
        packages: &["."],
        ldflags: "",
    },
    GoModule {
        dir: "k8s",
        packages: &[
            "k8s.io/kubernetes/cmd/kube-apiserver",
            "k8s.io/kubernetes/cmd/kube-controller-manager",
            "k8s.io/kubernetes/cmd/kube-scheduler",
            "k8s.io/kubernetes/cmd/kubectl",
        ],
        ldflags: K8S_LDFLAGS,
    },
];

/// `target/kube/bin/`: the built programs.
pub fn bin_dir() -> PathBuf {
    target_dir().join("kube/bin")
}

/// `target/go/`: GOPATH, the module cache and the build cache.
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
    for f in files {
        f.file_name().hash(&mut h);
        fs::read(&f)
            .with_context(|| format!("reading {}", f.display()))?
            .hash(&mut h);
    }
    Ok(format!("{:016x}", h.finish()))
}

/// Builds (or finds up to date) etcd, kube-apiserver, kube-controller-manager,
/// kube-scheduler, kubectl and kwok in `target/kube/bin/`. A module is
/// rebuilt only when its stamp (go.mod, go.sum, Go files, Go version)
/// changed; a cold build of all takes many minutes on two cores.
pub fn ensure_built() -> anyhow::Result<Binaries> {
    let bin = bin_dir();
    fs::create_dir_all(&bin).with_context(|| format!("creating {}", bin.display()))?;
    let out = Command::new("go")
        .arg("env")
        .arg("GOVERSION")
        .output()
        .context("running `go env GOVERSION`: is Go (1.26 or newer) installed?")?;
    if !out.status.success() {
        bail!(
            "`go env GOVERSION` failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let go_version = String::from_utf8_lossy(&out.stdout).trim().to_string();

    for module in MODULES {
        let stamp = module_stamp(module, &go_version)?;
        let stamp_file = bin.join(format!(".{}.stamp", module.dir));
        let programs: Vec<PathBuf> = module
            .packages
            .iter()
            .map(|p| bin.join(program_name(module, p)))
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
        eprintln!(
            "xtask: kube: building {} from tools/kube/{} (Go {go_version}; the first build takes minutes)",
            names.join(", "),
            module.dir
        );
        let started = Instant::now();
        let _ = fs::remove_file(&stamp_file);
        let mut cmd = go(module.dir);
        cmd.args(["build", "-trimpath", "-ldflags"])
            .arg(format!("-s -w {}", module.ldflags).trim_end())
            .arg("-o");
        if module.packages.len() == 1 {
            cmd.arg(&programs[0]);
        } else {
            // `-o DIR/` with several packages: one program each.
            cmd.arg(format!("{}/", bin.display()));
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
    }
    Ok(Binaries {
        etcd: bin.join("etcd"),
        kube_apiserver: bin.join("kube-apiserver"),
        kube_controller_manager: bin.join("kube-controller-manager"),
        kube_scheduler: bin.join("kube-scheduler"),
        kubectl: bin.join("kubectl"),
        kwok: bin.join("kwok"),
    })
}

/// A running control plane. `Drop` stops every process it started (SIGTERM,
/// then SIGKILL after a few seconds) and waits for each.
pub struct ControlPlane {
    dir: PathBuf,
    binaries: Binaries,
    kubeconfig: PathBuf,
    server: String,
    etcd_endpoint: String,
    /// Started processes, in start order: (name, child, log file).
    processes: Vec<(&'static str, Child, PathBuf)>,
}

impl std::fmt::Debug for ControlPlane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlPlane")
            .field("dir", &self.dir)
            .field("server", &self.server)
            .field("kubeconfig", &self.kubeconfig)
            .finish()
    }
}

impl ControlPlane {
    /// Builds what is missing ([`ensure_built`]) and starts a control plane
    /// whose files (certificates, kubeconfig, etcd's data, one log per
    /// process) are in `dir`; returns once the API server is ready, the
    /// node is Ready and the `default` service account exists.
    pub fn start(dir: &Path) -> anyhow::Result<ControlPlane> {
        let binaries = ensure_built()?;
        Self::start_with(&binaries, dir)
    }

    /// [`ControlPlane::start`] with programs already built.
    pub fn start_with(binaries: &Binaries, dir: &Path) -> anyhow::Result<ControlPlane> {
        let started = Instant::now();
        fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let dir = fs::canonicalize(dir)?;
        let pki = dir.join("pki");
        // A fresh start: no data of an earlier control plane in `dir`.
        for old in ["etcd-data", "pki"] {
            let p = dir.join(old);
            if p.exists() {
                fs::remove_dir_all(&p).with_context(|| format!("removing {}", p.display()))?;
            }
        }
        fs::create_dir_all(&pki)?;
        make_pki(&pki)?;

        let etcd_client = free_port()?;
        let etcd_peer = free_port()?;
        let api_port = free_port()?;
        let server = format!("https://127.0.0.1:{api_port}");
        let kubeconfig = dir.join("admin.kubeconfig");
        fs::write(&kubeconfig, kubeconfig_yaml(&server, &pki))?;

        let mut cp = ControlPlane {
            dir: dir.clone(),
            binaries: binaries.clone(),
            kubeconfig,
            server,
            etcd_endpoint: format!("http://127.0.0.1:{etcd_client}"),
            processes: Vec::new(),
        };

        let p = |s: &str| pki.join(s).display().to_string();

        let mut etcd = Command::new(&binaries.etcd);
        etcd.args([
            "--name=lockstep",
            &format!("--data-dir={}", dir.join("etcd-data").display()),
            &format!("--listen-client-urls={}", cp.etcd_endpoint),
            &format!("--advertise-client-urls={}", cp.etcd_endpoint),
            &format!("--listen-peer-urls=http://127.0.0.1:{etcd_peer}"),
            &format!("--initial-advertise-peer-urls=http://127.0.0.1:{etcd_peer}"),
            &format!("--initial-cluster=lockstep=http://127.0.0.1:{etcd_peer}"),
            // Throwaway data: no fsync (much faster on a busy machine).
            "--unsafe-no-fsync=true",
            "--auto-compaction-retention=1",
            "--quota-backend-bytes=2147483648",
        ]);
        cp.spawn("etcd", etcd)?;

        let mut apiserver = Command::new(&binaries.kube_apiserver);
        apiserver.args([
            &format!("--etcd-servers={}", cp.etcd_endpoint),
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            &format!("--secure-port={api_port}"),
            &format!("--tls-cert-file={}", p("apiserver.crt")),
            &format!("--tls-private-key-file={}", p("apiserver.key")),
            &format!("--client-ca-file={}", p("ca.crt")),
            "--authorization-mode=Node,RBAC",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            &format!("--service-account-key-file={}", p("sa.pub")),
            &format!("--service-account-signing-key-file={}", p("sa.key")),
            "--service-cluster-ip-range=10.96.0.0/16",
            // No kube-proxy or endpoint traffic: the `kubernetes` service's
            // endpoints would name 127.0.0.1, which endpoints may not.
            "--endpoint-reconciler-type=none",
            "--profiling=false",
        ]);
        cp.spawn("kube-apiserver", apiserver)?;
        cp.wait_for("the API server's /readyz", |cp| {
            Ok(cp.kubectl_quiet(&["get", "--raw=/readyz"])?.is_some())
        })?;
        let api_ready = started.elapsed();

        let mut kcm = Command::new(&binaries.kube_controller_manager);
        kcm.args([
            &format!("--kubeconfig={}", cp.kubeconfig.display()),
            "--leader-elect=false",
            "--secure-port=0",
            &format!("--root-ca-file={}", p("ca.crt")),
            &format!("--service-account-private-key-file={}", p("sa.key")),
            "--use-service-account-credentials=false",
        ]);
        cp.spawn("kube-controller-manager", kcm)?;

        let mut scheduler = Command::new(&binaries.kube_scheduler);
        scheduler.args([
            &format!("--kubeconfig={}", cp.kubeconfig.display()),
            "--leader-elect=false",
            "--secure-port=0",
        ]);
        cp.spawn("kube-scheduler", scheduler)?;

        let stages = dir.join("kwok-stages.yaml");
        let out = Command::new(&binaries.kwok)
            .arg("stages")
            .output()
            .context("running `kwok stages`")?;
        if !out.status.success() {
            bail!(
                "`kwok stages` failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        fs::write(&stages, &out.stdout)?;
        let mut kwok = Command::new(&binaries.kwok);
        kwok.args([
            &format!("--kubeconfig={}", cp.kubeconfig.display()),
            &format!("--config={}", stages.display()),
            "--manage-all-nodes=true",
            &format!("--cidr={POD_CIDR}"),
            "--node-ip=127.0.0.1",
            "--node-lease-duration-seconds=40",
        ]);
        cp.spawn("kwok", kwok)?;

        let node = dir.join("node.yaml");
        fs::write(&node, NODE_YAML)?;
        let mut apply = cp.kubectl();
        apply.args(["apply", "-f"]).arg(&node).stdout(Stdio::null());
        run(apply).context("creating the fake node")?;
        cp.wait_for("the node to be Ready", |cp| {
            Ok(cp
                .kubectl_quiet(&[
                    "get",
                    "node",
                    NODE_NAME,
                    "-o",
                    "jsonpath={.status.conditions[?(@.type==\"Ready\")].status}",
                ])?
                .is_some_and(|s| s.trim() == "True"))
        })?;
        cp.wait_for("the default service account", |cp| {
            Ok(cp
                .kubectl_quiet(&[
                    "get",
                    "serviceaccount",
                    "default",
                    "-n",
                    "default",
                    "-o",
                    "name",
                ])?
                .is_some())
        })?;
        eprintln!(
            "xtask: kube: control plane ready at {} (API server ready after {:.1} s, all after {:.1} s); files and logs in {}",
            cp.server,
            api_ready.as_secs_f64(),
            started.elapsed().as_secs_f64(),
            cp.dir.display()
        );
        Ok(cp)
    }

    /// The kubeconfig of the administrator (a client certificate in group
    /// `system:masters`).
    pub fn admin_kubeconfig(&self) -> PathBuf {
        self.kubeconfig.clone()
    }

    /// `kubectl --kubeconfig ADMIN` (the built kubectl, of the API server's
    /// release).
    pub fn kubectl(&self) -> Command {
        let mut cmd = Command::new(&self.binaries.kubectl);
        cmd.arg(format!("--kubeconfig={}", self.kubeconfig.display()));
        cmd
    }

    /// The API server's URL (`https://127.0.0.1:PORT`).
    pub fn server(&self) -> &str {
        &self.server
    }

    /// The CA certificate that signed the API server's serving certificate
    /// and the client certificates.
    pub fn ca_cert(&self) -> PathBuf {
        self.dir.join("pki/ca.crt")
    }

    /// The directory of the control plane's files and logs (`NAME.log`).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    #[allow(dead_code)] // for `cargo xtask kube`'s failure reports
    /// The last `lines` lines of process `name`'s log (`etcd`,
    /// `kube-apiserver`, `kube-controller-manager`, `kube-scheduler`, `kwok`).
    pub fn log_tail(&self, name: &str, lines: usize) -> String {
        tail(&self.dir.join(format!("{name}.log")), lines)
    }

    /// Starts `cmd` as process `name`, its output to `dir/NAME.log`.
    fn spawn(&mut self, name: &'static str, mut cmd: Command) -> anyhow::Result<()> {
        let log = self.dir.join(format!("{name}.log"));
        let file = fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        cmd.stdin(Stdio::null())
            .stdout(file.try_clone()?)
            .stderr(file)
            .current_dir(&self.dir);
        let child = cmd.spawn().with_context(|| {
            format!("starting {name} ({})", cmd.get_program().to_string_lossy())
        })?;
        self.processes.push((name, child, log));
        Ok(())
    }

    /// Runs kubectl with `args`: its stdout if it succeeded, `None` if not.
    fn kubectl_quiet(&self, args: &[&str]) -> anyhow::Result<Option<String>> {
        let out = self
            .kubectl()
            .args(["--request-timeout=5s"])
            .args(args)
            .stdin(Stdio::null())
            .output()
            .context("running kubectl")?;
        Ok(out
            .status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).into_owned()))
    }

    /// Polls `ready` until true, failing (with every process's log tail)
    /// when a process exits or [`READY_TIMEOUT`] passes.
    fn wait_for(
        &mut self,
        what: &str,
        ready: impl Fn(&Self) -> anyhow::Result<bool>,
    ) -> anyhow::Result<()> {
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            for (name, child, log) in &mut self.processes {
                if let Some(status) = child.try_wait()? {
                    bail!(
                        "waiting for {what}: {name} exited ({status}); the end of {}:\n{}",
                        log.display(),
                        tail(log, 40)
                    );
                }
            }
            if ready(self)? {
                return Ok(());
            }
            if Instant::now() > deadline {
                let mut logs = String::new();
                for (name, _, log) in self.processes.iter().rev() {
                    logs.push_str(&format!(
                        "\n--- {name} ({}):\n{}",
                        log.display(),
                        tail(log, 25)
                    ));
                }
                bail!(
                    "{what} not ready after {} s; the ends of the logs:{logs}",
                    READY_TIMEOUT.as_secs()
                );
            }
            sleep(Duration::from_millis(250));
        }
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        // One at a time, the reverse of the start order (kwok first, etcd
        // last): an API server whose etcd is gone does not shut down, nor
        // does an etcd with an API server still watching it.
        for (name, child, _) in self.processes.iter_mut().rev() {
            if let Ok(pid) = i32::try_from(child.id()) {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGTERM,
                );
            }
            let deadline = Instant::now() + STOP_TIMEOUT;
            loop {
                match child.try_wait() {
                    Ok(Some(_)) => break,
                    Ok(None) if Instant::now() < deadline => sleep(Duration::from_millis(20)),
                    _ => {
                        eprintln!(
                            "xtask: kube: {name} did not stop {} s after SIGTERM: killing it",
                            STOP_TIMEOUT.as_secs()
                        );
                        let _ = child.kill();
                        let _ = child.wait();
                        break;
                    }
                }
            }
        }
    }
}

/// The fake node; kwok fills its status (Ready, 1k CPUs, 1 TiB, 1M pods)
/// and keeps its lease.
const NODE_YAML: &str = r#"apiVersion: v1
kind: Node
metadata:
  name: kwok-node-0
  annotations:
    kwok.x-k8s.io/node: fake
    node.alpha.kubernetes.io/ttl: "0"
  labels:
    kubernetes.io/hostname: kwok-node-0
    kubernetes.io/os: linux
    kubernetes.io/arch: amd64
    type: kwok
spec: {}
"#;

/// The admin kubeconfig, naming the certificate files in `pki`.
fn kubeconfig_yaml(server: &str, pki: &Path) -> String {
    let p = |s: &str| pki.join(s).display().to_string();
    format!(
        "apiVersion: v1
kind: Config
clusters:
- name: lockstep
  cluster:
    server: {server}
    certificate-authority: {ca}
users:
- name: admin
  user:
    client-certificate: {cert}
    client-key: {key}
contexts:
- name: lockstep
  context:
    cluster: lockstep
    user: admin
current-context: lockstep
",
        ca = p("ca.crt"),
        cert = p("admin.crt"),
        key = p("admin.key"),
    )
}

/// Makes (with the openssl CLI) a CA, the API server's serving certificate,
/// the admin's client certificate (group system:masters) and the service
/// accounts' signing key pair, all P-256.
fn make_pki(pki: &Path) -> anyhow::Result<()> {
    let openssl = |args: &[&str]| -> anyhow::Result<()> {
        let out = Command::new("openssl")
            .args(args)
            .current_dir(pki)
            .stdin(Stdio::null())
            .output()
            .context("running openssl (is it installed?)")?;
        if !out.status.success() {
            bail!(
                "openssl {} failed: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(())
    };
    let ec = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-noenc",
    ];
    let mut ca = vec![
        "req", "-x509", "-days", "3650", "-keyout", "ca.key", "-out", "ca.crt",
    ];
    ca.extend(ec);
    ca.extend([
        "-subj",
        "/CN=lockstep-kube-ca",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign,digitalSignature",
    ]);
    openssl(&ca)?;
    let leaves = [
        (
            "apiserver",
            "/CN=kube-apiserver",
            "subjectAltName=IP:127.0.0.1,IP:10.96.0.1,DNS:localhost,DNS:kubernetes,\
             DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local\n\
             extendedKeyUsage=serverAuth\nkeyUsage=critical,digitalSignature\n",
        ),
        (
            "admin",
            "/O=system:masters/CN=lockstep-admin",
            "extendedKeyUsage=clientAuth\nkeyUsage=critical,digitalSignature\n",
        ),
    ];
    for (name, subject, ext) in leaves {
        let (key, csr, crt, extfile) = (
            format!("{name}.key"),
            format!("{name}.csr"),
            format!("{name}.crt"),
            format!("{name}.ext"),
        );
        fs::write(pki.join(&extfile), ext)?;
        let mut req = vec![
            "req", "-new", "-keyout", &key, "-out", &csr, "-subj", subject,
        ];
        req.extend(ec);
        openssl(&req)?;
        openssl(&[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "3650",
            "-out",
            &crt,
            "-extfile",
            &extfile,
        ])?;
    }
    openssl(&[
        "genpkey",
        "-algorithm",
        "EC",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-out",
        "sa.key",
    ])?;
    openssl(&["pkey", "-in", "sa.key", "-pubout", "-out", "sa.pub"])?;
    Ok(())
}

/// A free TCP port on 127.0.0.1 (free when asked: another process may
/// take it before ours binds it).
fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// The last `lines` lines of the file at `path` (its last 64 KiB at most).
fn tail(path: &Path, lines: usize) -> String {
    let Ok(mut f) = fs::File::open(path) else {
        return format!("(no {})", path.display());
    };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let _ = f.seek(SeekFrom::Start(len.saturating_sub(64 * 1024)));
    let mut buf = Vec::new();
    let _ = f.read_to_end(&mut buf);
    let text = String::from_utf8_lossy(&buf);
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// `cargo xtask kube-up`: builds, starts a control plane in
/// `target/kube/up/`, prints the admin kubeconfig's path and waits for
/// Ctrl-C (SIGINT) or SIGTERM, then stops it.
pub fn kube_up() -> anyhow::Result<()> {
    use nix::sys::signal::{SigSet, Signal};
    let dir = target_dir().join("kube/up");
    let cp = ControlPlane::start(&dir)?;
    println!("export KUBECONFIG={}", cp.admin_kubeconfig().display());
    println!(
        "Kubernetes {KUBERNETES_VERSION} at {} (CA {}); kubectl: {}; logs in {}; Ctrl-C stops it",
        cp.server(),
        cp.ca_cert().display(),
        cp.binaries.kubectl.display(),
        cp.dir().display()
    );
    // Blocked here (in the one thread, after the processes started, so they
    // do not inherit the mask) and taken by sigwait.
    let mut set = SigSet::empty();
    set.add(Signal::SIGINT);
    set.add(Signal::SIGTERM);
    set.thread_block().context("blocking SIGINT and SIGTERM")?;
    let sig = set.wait().context("waiting for SIGINT or SIGTERM")?;
    eprintln!("xtask: kube: {sig}: stopping the control plane");
    let stopping = Instant::now();
    drop(cp);
    eprintln!(
        "xtask: kube: stopped in {:.1} s",
        stopping.elapsed().as_secs_f64()
    );
    Ok(())
}
