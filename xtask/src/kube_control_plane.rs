//! A real Kubernetes control plane on loopback, for tests: etcd,
//! kube-apiserver, kube-controller-manager and kube-scheduler, built from
//! their Go modules (tools/kube/), with kwok as the kubelet of one fake
//! node (pods are bound by the scheduler; kwok marks them Running and Ready
//! with a podIP from 127.0.100.0/24 and finishes their graceful deletion).
//!
//! [`ensure_built`] builds the programs into `target/kube/bin/` (the Go
//! module and build caches under `target/go/` while it builds, removed
//! after); [`ControlPlane::start`]
//! starts them on free loopback ports and [`ControlPlane`]'s `Drop` stops
//! them all. `cargo xtask kube-up` runs one until Ctrl-C.

use std::fs;
use std::io::{Read, Seek, SeekFrom};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::thread::sleep;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use crate::util::{run, target_dir};

mod build;
mod pki;

pub use build::{bin_dir, cache_dir, ensure_built, Binaries, OLDEST};
pub(crate) use pki::client_kubeconfig_yaml;
use pki::{kubeconfig_yaml, make_pki};

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
        Self::start_inner(binaries, dir, true)
    }

    /// A control plane without kwok and its fake node: the real node
    /// ([`crate::kube_node::RealNode`]) registers itself.
    pub fn start_without_node(binaries: &Binaries, dir: &Path) -> anyhow::Result<ControlPlane> {
        Self::start_inner(binaries, dir, false)
    }

    fn start_inner(
        binaries: &Binaries,
        dir: &Path,
        fake_node: bool,
    ) -> anyhow::Result<ControlPlane> {
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
        // The real node's pods reach the API server at the `kubernetes`
        // Service's ClusterIP and port (10.96.0.1:443, an address the node
        // puts on `lo`: there is no kube-proxy), so that control plane
        // listens on 443 on every address; the other on a free loopback port.
        let (api_port, bind) = if fake_node {
            (free_port()?, "127.0.0.1")
        } else {
            (443, "0.0.0.0")
        };
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
            &format!("--bind-address={bind}"),
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
            // The real node's kubelet (logs, exec): by its InternalIP (its
            // hostname resolves nowhere), with the admin's certificate.
            &format!("--kubelet-client-certificate={}", p("admin.crt")),
            &format!("--kubelet-client-key={}", p("admin.key")),
            "--kubelet-preferred-address-types=InternalIP",
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

        if fake_node {
            let stages = dir.join("kwok-stages.yaml");
            let mut kwok_stages = Command::new(&binaries.kwok);
            kwok_stages.arg("stages");
            fs::write(&stages, crate::util::stdout(kwok_stages)?)?;
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
        }
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

    /// The built programs it runs (kubelet and CoreDNS among them).
    pub fn binaries(&self) -> &Binaries {
        &self.binaries
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
            terminate(name, child);
        }
    }
}

/// SIGTERM to `child`, then SIGKILL after [`STOP_TIMEOUT`]; waits for it.
pub(crate) fn terminate(name: &str, child: &mut Child) {
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

/// A free TCP port on 127.0.0.1 (free when asked: another process may
/// take it before ours binds it).
pub(crate) fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// The last `lines` lines of the file at `path` (its last 64 KiB at most).
pub(crate) fn tail(path: &Path, lines: usize) -> String {
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
