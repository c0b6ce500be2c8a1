//! A real Kubernetes node on this machine, for `cargo xtask kube`: kubelet
//! (built from the pinned `k8s.io/kubernetes`), containerd with runc and the
//! CNI bridge (Debian's packages), CoreDNS (its Go module) and the images
//! pods run imported into containerd (no registry). Facts and conditions:
//! `../shared/notes/kubernetes-node.md`-style notes in docs/kubernetes.md.
//!
//! [`RealNode::start`] records the host state it will touch (four sysctls,
//! which of kubelet's and containerd's fixed paths exist), then adds three
//! /32 addresses on `lo` (the node's IP, the cluster DNS, and the API
//! server's ClusterIP), starts containerd
//! in its own directories, imports the images, starts kubelet (cgroupfs,
//! cgroup v1 allowed, no iptables chains) and CoreDNS, and waits until the
//! node is Ready and DNS answers. [`RealNode`]'s `Drop` (also after a failed
//! step of the start) deletes every pod, stops CoreDNS, kubelet and
//! containerd, kills what is left of containers, unmounts, deletes the
//! bridge and the addresses, removes the `kubepods` cgroups and the paths
//! that were absent before, and restores the sysctls. One real node per
//! machine at a time; root only.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::thread::sleep;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use crate::image::node_images::NodeImages;
use crate::kube_control_plane::ControlPlane;

/// The node's name (its kubelet client certificate names it).
pub const NODE_NAME: &str = "lockstep-node-0";
/// The node's IP, a /32 on `lo` (outside the service CIDR 10.96.0.0/16).
pub const NODE_IP: &str = "10.98.0.1";
/// The cluster DNS address (CoreDNS binds it), a /32 on `lo`.
pub const DNS_IP: &str = "10.98.0.10";
/// The `kubernetes` Service's ClusterIP, a /32 on `lo`: in-cluster clients
/// (the environment's pod) reach the API server there, on port 443, with no
/// kube-proxy.
pub const API_SERVICE_IP: &str = "10.96.0.1";
/// The pods' subnet (host-local IPAM on the bridge).
pub const POD_SUBNET: &str = "10.244.0.0/24";
/// The CNI bridge.
const BRIDGE: &str = "lkst0";
/// Where containerd's socket goes (a unix socket path must stay under 108
/// bytes, whatever the checkout's path).
const SOCKET_DIR: &str = "/run/lockstep-kube-node";
/// How long each wait of the start may take.
const READY_TIMEOUT: Duration = Duration::from_secs(120);

/// Sysctls kubelet and the bridge plugin change.
const SYSCTLS: [&str; 4] = [
    "net/ipv4/ip_forward",
    "vm/overcommit_memory",
    "kernel/panic",
    "kernel/panic_on_oops",
];

/// Fixed paths kubelet and containerd create whatever their configuration
/// says; removed at the end when they were absent before.
const FIXED_PATHS: [&str; 6] = [
    "/var/lib/kubelet",
    "/var/log/containers",
    "/var/log/pods",
    "/run/containerd",
    "/var/lib/cni",
    SOCKET_DIR,
];

/// What the host looked like before the node started.
#[derive(Debug, Default)]
struct HostState {
    sysctls: Vec<(&'static str, String)>,
    absent: Vec<&'static str>,
    netns_before: Vec<String>,
}

/// A running real node. See the module docs.
pub struct RealNode {
    run: PathBuf,
    kubectl: PathBuf,
    admin_kubeconfig: PathBuf,
    before: HostState,
    added_addresses: Vec<&'static str>,
    processes: Vec<(&'static str, Child, PathBuf)>,
    /// The lockstep image pods run (its full name).
    pub image: String,
}

impl std::fmt::Debug for RealNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RealNode({})", self.run.display())
    }
}

/// Whether a real node can run here: root, containerd, runc and the CNI
/// plugins (installed where they are missing), else why not.
pub fn prerequisites() -> anyhow::Result<()> {
    if !crate::prereqs::is_root() {
        bail!("a real Kubernetes node needs root (kubelet, containerd, a bridge, cgroups)");
    }
    crate::prereqs::node()
}

fn socket() -> PathBuf {
    Path::new(SOCKET_DIR).join("containerd.sock")
}

fn read_sysctl(name: &str) -> anyhow::Result<String> {
    Ok(fs::read_to_string(Path::new("/proc/sys").join(name))
        .with_context(|| format!("reading sysctl {name}"))?
        .trim()
        .to_string())
}

fn netns_list() -> Vec<String> {
    fs::read_dir("/run/netns")
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with("cni-"))
                .collect()
        })
        .unwrap_or_default()
}

/// Runs a command, its failure an error naming it (output kept quiet).
fn quiet(mut cmd: Command) -> anyhow::Result<String> {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {:?}", cmd.get_program()))?;
    if !out.status.success() {
        bail!(
            "{:?} {:?} failed ({}): {}",
            cmd.get_program(),
            cmd.get_args().collect::<Vec<_>>(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn ip(args: &[&str]) -> anyhow::Result<String> {
    let mut cmd = Command::new("ip");
    cmd.args(args);
    quiet(cmd)
}

impl RealNode {
    /// Starts the node against `cp` (a control plane started with
    /// [`ControlPlane::start_without_node`]), its files in `run`, the
    /// images of `images` imported. Returns once the node is Ready, the
    /// `default` service account exists and CoreDNS is ready.
    pub fn start(cp: &ControlPlane, run: &Path, images: &NodeImages) -> anyhow::Result<RealNode> {
        prerequisites()?;
        let started = Instant::now();
        if socket().exists() || Path::new(&format!("/sys/class/net/{BRIDGE}")).exists() {
            bail!(
                "another real node seems to run here ({} or the bridge {BRIDGE} exists): one real node per machine at a time",
                socket().display()
            );
        }
        let _ = fs::remove_dir_all(run);
        fs::create_dir_all(run)?;
        let run = fs::canonicalize(run)?;
        let mut before = HostState::default();
        for s in SYSCTLS {
            before.sysctls.push((s, read_sysctl(s)?));
        }
        before.absent = FIXED_PATHS
            .into_iter()
            .filter(|p| !Path::new(p).exists())
            .collect();
        before.netns_before = netns_list();
        let mut node = RealNode {
            run: run.clone(),
            kubectl: cp.binaries().kubectl.clone(),
            admin_kubeconfig: cp.admin_kubeconfig(),
            before,
            added_addresses: Vec::new(),
            processes: Vec::new(),
            image: images.lockstep.clone(),
        };
        // From here on, `Drop` restores whatever was done.
        for addr in [NODE_IP, DNS_IP, API_SERVICE_IP] {
            ip(&["addr", "add", &format!("{addr}/32"), "dev", "lo"])?;
            node.added_addresses.push(addr);
        }
        fs::create_dir_all(SOCKET_DIR)?;
        node.start_containerd()?;
        node.import(images)?;
        node.start_kubelet(cp)?;
        node.start_coredns(cp)?;
        eprintln!(
            "xtask: kube: real node {NODE_NAME} Ready with DNS after {:.1} s (containerd, kubelet, CoreDNS; files in {})",
            started.elapsed().as_secs_f64(),
            run.display()
        );
        Ok(node)
    }

    fn spawn(&mut self, name: &'static str, mut cmd: Command) -> anyhow::Result<()> {
        let log = self.run.join(format!("{name}.log"));
        let file = fs::File::create(&log)?;
        cmd.stdin(Stdio::null())
            .stdout(file.try_clone()?)
            .stderr(file)
            .current_dir(&self.run);
        let child = cmd
            .spawn()
            .with_context(|| format!("starting {name} ({:?})", cmd.get_program()))?;
        self.processes.push((name, child, log));
        Ok(())
    }

    /// Polls `ready` until true; fails with the logs' ends when a process
    /// exits or [`READY_TIMEOUT`] passes.
    fn wait_for(&mut self, what: &str, ready: impl Fn(&Self) -> bool) -> anyhow::Result<()> {
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            for (name, child, log) in &mut self.processes {
                if let Some(status) = child.try_wait()? {
                    bail!(
                        "waiting for {what}: {name} exited ({status}); the end of {}:\n{}",
                        log.display(),
                        crate::kube_control_plane::tail(log, 40)
                    );
                }
            }
            if ready(self) {
                return Ok(());
            }
            if Instant::now() > deadline {
                let mut logs = String::new();
                for (name, _, log) in self.processes.iter().rev() {
                    logs.push_str(&format!(
                        "\n--- {name}:\n{}",
                        crate::kube_control_plane::tail(log, 25)
                    ));
                }
                bail!(
                    "{what} not ready after {} s; the ends of the logs:{logs}",
                    READY_TIMEOUT.as_secs()
                );
            }
            sleep(Duration::from_millis(200));
        }
    }

    /// `ctr --address SOCK -n k8s.io ARGS`.
    fn ctr(&self) -> Command {
        let mut cmd = Command::new("ctr");
        cmd.arg("--address").arg(socket()).args(["-n", "k8s.io"]);
        cmd
    }

    /// The PID of the node's process `name` (`containerd`, `kubelet`,
    /// `coredns`), while it runs.
    pub fn pid(&self, name: &str) -> Option<u32> {
        self.processes
            .iter()
            .find(|(n, _, _)| *n == name)
            .map(|(_, child, _)| child.id())
    }

    /// The log file of `name` (`containerd`, `kubelet`, `coredns`).
    pub fn log(&self, name: &str) -> PathBuf {
        self.run.join(format!("{name}.log"))
    }

    /// kubectl as the administrator.
    pub fn kubectl(&self) -> Command {
        let mut cmd = Command::new(&self.kubectl);
        cmd.arg(format!("--kubeconfig={}", self.admin_kubeconfig.display()))
            .arg(format!(
                "--cache-dir={}",
                self.run.join("kube-cache").display()
            ));
        cmd
    }

    fn start_containerd(&mut self) -> anyhow::Result<()> {
        let r = self.run.display().to_string();
        fs::create_dir_all(self.run.join("cni/net.d"))?;
        fs::write(
            self.run.join("containerd.toml"),
            format!(
                r#"version = 2
root = "{r}/containerd/root"
state = "{r}/containerd/state"
oom_score = 0
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
                    "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs"]
[grpc]
  address = "{sock}"
[plugins]
  [plugins."io.containerd.grpc.v1.cri"]
    sandbox_image = "{pause}"
    restrict_oom_score_adj = true
    disable_apparmor = true
    [plugins."io.containerd.grpc.v1.cri".containerd]
      snapshotter = "overlayfs"
      default_runtime_name = "runc"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
        runtime_type = "io.containerd.runc.v2"
        [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
          SystemdCgroup = false
    [plugins."io.containerd.grpc.v1.cri".cni]
      bin_dir = "/usr/lib/cni"
      conf_dir = "{r}/cni/net.d"
"#,
                sock = socket().display(),
                pause = crate::image::node_images::PAUSE_IMAGE,
            ),
        )?;
        fs::write(
            self.run.join("cni/net.d/10-lockstep.conflist"),
            format!(
                r#"{{
  "cniVersion": "1.0.0",
  "name": "lockstep-pods",
  "plugins": [
    {{"type": "bridge", "bridge": "{BRIDGE}", "isGateway": true, "ipMasq": false, "hairpinMode": true,
     "ipam": {{"type": "host-local", "ranges": [[{{"subnet": "{POD_SUBNET}"}}]],
              "routes": [{{"dst": "0.0.0.0/0"}}], "dataDir": "{r}/cni/ipam"}}}},
    {{"type": "portmap", "capabilities": {{"portMappings": true}}}}
  ]
}}
"#
            ),
        )?;
        let mut containerd = Command::new("containerd");
        containerd
            .arg("--config")
            .arg(self.run.join("containerd.toml"));
        self.spawn("containerd", containerd)?;
        self.wait_for("containerd", |n| {
            let mut v = n.ctr();
            v.arg("version");
            quiet(v).is_ok()
        })
    }

    /// Imports the image archive `archive`, which holds `name`, into
    /// containerd (for a pod of the suite that is not lockstep's).
    pub fn import_image(&self, archive: &Path, name: &str) -> anyhow::Result<()> {
        let started = Instant::now();
        let mut cmd = self.ctr();
        cmd.args(["images", "import"]).arg(archive);
        quiet(cmd).with_context(|| format!("importing {}", archive.display()))?;
        let mut ls = self.ctr();
        ls.args(["images", "ls", "-q"]);
        let listed = quiet(ls)?;
        anyhow::ensure!(
            listed.lines().any(|l| l.trim() == name),
            "containerd does not list {name} after the import; it lists: {listed}"
        );
        eprintln!(
            "xtask: kube: imported {name} into containerd in {:.1} s",
            started.elapsed().as_secs_f64()
        );
        Ok(())
    }

    fn import(&mut self, images: &NodeImages) -> anyhow::Result<()> {
        for (archive, name) in [
            (&images.pause_archive, &images.pause),
            (&images.lockstep_archive, &images.lockstep),
        ] {
            self.import_image(archive, name)?;
        }
        Ok(())
    }

    fn start_kubelet(&mut self, cp: &ControlPlane) -> anyhow::Result<()> {
        let r = self.run.display().to_string();
        let pki = cp.dir().join("pki");
        fs::write(
            self.run.join("kubelet.kubeconfig"),
            crate::kube_control_plane::client_kubeconfig_yaml(cp.server(), &pki, "kubelet"),
        )?;
        let port = crate::kube_control_plane::free_port()?;
        let healthz = crate::kube_control_plane::free_port()?;
        fs::write(
            self.run.join("kubelet-config.yaml"),
            format!(
                r#"apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failCgroupV1: false
cgroupDriver: cgroupfs
containerRuntimeEndpoint: unix://{sock}
failSwapOn: false
oomScoreAdj: 0
address: {NODE_IP}
port: {port}
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: {healthz}
authentication:
  anonymous: {{enabled: false}}
  webhook: {{enabled: false}}
  x509: {{clientCAFile: {ca}}}
authorization: {{mode: AlwaysAllow}}
clusterDomain: cluster.local
clusterDNS: [{DNS_IP}]
resolvConf: ""
podLogsDir: {r}/pod-logs
volumePluginDir: {r}/kubelet/volume-plugins
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {{memory.available: "100Mi", nodefs.available: "1%", nodefs.inodesFree: "1%", imagefs.available: "1%"}}
protectKernelDefaults: false
makeIPTablesUtilChains: false
"#,
                sock = socket().display(),
                ca = pki.join("ca.crt").display(),
            ),
        )?;
        let mut kubelet = Command::new(&cp.binaries().kubelet);
        kubelet.args([
            &format!("--config={r}/kubelet-config.yaml"),
            &format!("--kubeconfig={r}/kubelet.kubeconfig"),
            &format!("--hostname-override={NODE_NAME}"),
            &format!("--node-ip={NODE_IP}"),
            &format!("--root-dir={r}/kubelet"),
            &format!("--cert-dir={r}/kubelet/pki"),
            "--v=1",
        ]);
        self.spawn("kubelet", kubelet)?;
        self.wait_for("the node to be Ready", |n| {
            let mut get = n.kubectl();
            get.args([
                "get",
                "node",
                NODE_NAME,
                "-o",
                "jsonpath={.status.conditions[?(@.type==\"Ready\")].status}",
            ]);
            quiet(get).is_ok_and(|s| s.trim() == "True")
        })
    }

    fn start_coredns(&mut self, cp: &ControlPlane) -> anyhow::Result<()> {
        let ready = crate::kube_control_plane::free_port()?;
        let health = crate::kube_control_plane::free_port()?;
        fs::write(
            self.run.join("Corefile"),
            format!(
                "cluster.local:53 {{\n    bind {DNS_IP}\n    errors\n    kubernetes cluster.local {{\n        kubeconfig {kc}\n        ttl 0\n    }}\n    ready 127.0.0.1:{ready}\n    health 127.0.0.1:{health}\n}}\n.:53 {{\n    bind {DNS_IP}\n    errors\n}}\n",
                kc = cp.admin_kubeconfig().display()
            ),
        )?;
        let mut coredns = Command::new(&cp.binaries().coredns);
        coredns.arg("-conf").arg(self.run.join("Corefile"));
        self.spawn("coredns", coredns)?;
        self.wait_for("CoreDNS", |_| {
            std::net::TcpStream::connect(("127.0.0.1", ready))
                .and_then(|mut s| {
                    use std::io::{Read, Write};
                    s.set_read_timeout(Some(Duration::from_secs(2)))?;
                    s.write_all(b"GET /ready HTTP/1.0\r\n\r\n")?;
                    let mut buf = String::new();
                    s.read_to_string(&mut buf)?;
                    Ok(buf.starts_with("HTTP/1.0 200") || buf.starts_with("HTTP/1.1 200"))
                })
                .unwrap_or(false)
        })
    }

    /// Names the imported image `from` also `to` in containerd (a pod asks
    /// for an image by the name its manifest gives).
    pub fn tag_image(&self, from: &str, to: &str) -> anyhow::Result<()> {
        let mut tag = self.ctr();
        tag.args(["images", "tag", "--force", from, to]);
        quiet(tag).map(drop)
    }

    fn stop(&mut self, name: &str) {
        if let Some((_, child, _)) = self.processes.iter_mut().find(|(n, _, _)| *n == name) {
            crate::kube_control_plane::terminate(name, child);
        }
        self.processes.retain(|(n, _, _)| *n != name);
    }

    fn teardown(&mut self) {
        let kubelet_up = self.processes.iter().any(|(n, _, _)| *n == "kubelet");
        // A suite that stopped the kubelet (its `node-lost` scenario) and
        // died before resuming it: resumed, so that it deletes the pods.
        if let Some(pid) = self.pid("kubelet") {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid as i32),
                nix::sys::signal::Signal::SIGCONT,
            );
        }
        // 1. Every pod deleted through the API while kubelet runs: it stops
        //    the containers and calls CNI DEL (veths and netns go).
        if kubelet_up {
            let mut del = self.kubectl();
            del.args([
                "delete",
                "pods",
                "--all",
                "--all-namespaces",
                "--wait=true",
                "--timeout=60s",
                "--grace-period=2",
            ]);
            if let Err(e) = quiet(del) {
                eprintln!("xtask: kube: node teardown: deleting the pods: {e:#}");
            }
            let deadline = Instant::now() + Duration::from_secs(30);
            while Instant::now() < deadline {
                let mut ls = self.ctr();
                ls.args(["tasks", "ls", "-q"]);
                if quiet(ls).map(|s| s.trim().is_empty()).unwrap_or(true) {
                    break;
                }
                sleep(Duration::from_millis(250));
            }
        }
        // 2. CoreDNS and kubelet.
        self.stop("coredns");
        self.stop("kubelet");
        // 3. Whatever containers are left (shims outlive containerd).
        if self.processes.iter().any(|(n, _, _)| *n == "containerd") {
            let mut ls = self.ctr();
            ls.args(["tasks", "ls", "-q"]);
            for id in quiet(ls).unwrap_or_default().lines().map(str::trim) {
                if id.is_empty() {
                    continue;
                }
                eprintln!("xtask: kube: node teardown: killing leftover container {id}");
                let mut kill = self.ctr();
                kill.args(["tasks", "kill", "-s", "KILL", id]);
                let _ = quiet(kill);
                sleep(Duration::from_millis(300));
                let mut rm = self.ctr();
                rm.args(["tasks", "rm", "-f", id]);
                let _ = quiet(rm);
            }
            let mut ls = self.ctr();
            ls.args(["containers", "ls", "-q"]);
            for id in quiet(ls).unwrap_or_default().lines().map(str::trim) {
                if !id.is_empty() {
                    let mut rm = self.ctr();
                    rm.args(["containers", "rm", id]);
                    let _ = quiet(rm);
                }
            }
        }
        // 4. containerd.
        self.stop("containerd");
        // 5. Mounts under the node's directories and leftover netns.
        let mounts = fs::read_to_string("/proc/mounts").unwrap_or_default();
        let mut ours: Vec<&str> = mounts
            .lines()
            .filter_map(|l| l.split_whitespace().nth(1))
            .filter(|m| {
                m.starts_with(&*self.run.to_string_lossy())
                    || m.starts_with("/run/containerd/")
                    || (m.starts_with("/run/netns/cni-")
                        && !self
                            .before
                            .netns_before
                            .iter()
                            .any(|n| m.ends_with(n.as_str())))
            })
            .collect();
        ours.sort_by_key(|m| std::cmp::Reverse(m.len()));
        for m in ours {
            let mut umount = Command::new("umount");
            umount.args(["--lazy", m]);
            let _ = quiet(umount);
            if m.starts_with("/run/netns/") {
                let _ = fs::remove_file(m);
            }
        }
        // 6. The bridge and the addresses.
        if Path::new(&format!("/sys/class/net/{BRIDGE}")).exists() {
            if let Err(e) = ip(&["link", "del", BRIDGE]) {
                eprintln!("xtask: kube: node teardown: {e:#}");
            }
        }
        for addr in std::mem::take(&mut self.added_addresses) {
            if let Err(e) = ip(&["addr", "del", &format!("{addr}/32"), "dev", "lo"]) {
                eprintln!("xtask: kube: node teardown: {e:#}");
            }
        }
        // 7. The kubepods cgroups, depth first, in every hierarchy.
        if let Ok(hierarchies) = fs::read_dir("/sys/fs/cgroup") {
            for h in hierarchies.flatten() {
                remove_cgroup_tree(&h.path().join("kubepods"));
            }
        }
        // 8. The sysctls.
        for (name, value) in &self.before.sysctls {
            if read_sysctl(name).ok().as_deref() != Some(value.as_str()) {
                if let Err(e) = fs::write(Path::new("/proc/sys").join(name), value) {
                    eprintln!("xtask: kube: node teardown: restoring {name}={value}: {e}");
                }
            }
        }
        // 9. The fixed paths that were absent before, and the node's files.
        for p in &self.before.absent {
            let _ = fs::remove_dir_all(p);
        }
        if let Err(e) = fs::remove_dir_all(&self.run) {
            eprintln!(
                "xtask: kube: node teardown: removing {}: {e}",
                self.run.display()
            );
        }
    }
}

/// Removes cgroup directory `dir` and everything below it, deepest first
/// (a cgroup directory is removed with rmdir once its children are gone).
fn remove_cgroup_tree(dir: &Path) {
    if !dir.is_dir() {
        return;
    }
    if let Ok(children) = fs::read_dir(dir) {
        for c in children.flatten() {
            if c.file_type().is_ok_and(|t| t.is_dir()) {
                remove_cgroup_tree(&c.path());
            }
        }
    }
    if let Err(e) = fs::remove_dir(dir) {
        eprintln!("xtask: kube: node teardown: rmdir {}: {e}", dir.display());
    }
}

impl Drop for RealNode {
    fn drop(&mut self) {
        let started = Instant::now();
        self.teardown();
        eprintln!(
            "xtask: kube: real node torn down, host restored, in {:.1} s",
            started.elapsed().as_secs_f64()
        );
    }
}
