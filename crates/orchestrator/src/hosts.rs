//! Simulated hosts for the process backend: each host is a Linux network
//! namespace of its own, joined to the orchestrator's namespace by veth
//! pairs, so that the processes of a replica talk over separate network
//! stacks and a link can be cut ([`SimulatedHosts::set_link`]) the way a
//! network partition cuts it: silence, not a reset.
//!
//! # Topology
//!
//! Hosts of one orchestrator state directory share a number `E` (1..=250),
//! allocated in a registry under [`REGISTRY_DIR`]; host `k` is:
//!
//! ```text
//! namespace lockstep-hE-k            (also its host name: see below)
//!   ctl   10.77.E.(4k+2)/30 ◀─veth─▶ lsE-ck  10.77.E.(4k+1)/30   (root namespace)
//!   mesh  10.78.E.(k+1)/24  ◀─veth─▶ lsE-mk  enslaved to bridge lsE-br (root namespace)
//! ```
//!
//! The **control** link is a point-to-point /30 between the root namespace
//! and the host: the environment (the controller) reaches a process at the
//! host's `ctl` address. The **mesh** links all hang off one bridge in the
//! root namespace, which carries the hosts' traffic to each other at layer 2
//! (no IP forwarding, no routes, no sysctl); the root namespace has no
//! address on it. So the controller↔process link and the process↔process
//! link of a host can be cut separately: `ip -n lockstep-hE-k link set ctl
//! down` silences the controller's connections to host `k` (the host's end
//! goes down, so the root namespace keeps its route, marked `linkdown`, and
//! what it sends is dropped in the veth rather than routed anywhere else),
//! `ip link set lsE-mk down` its mesh connections.
//!
//! A process is spawned with `ip netns exec lockstep-hE-k PROGRAM ...`
//! (which keeps the PID: `ip` enters the namespace and execs), binds
//! `0.0.0.0`, and its peers know it by its namespace's name: every host gets
//! `/etc/netns/lockstep-hE-k/hosts`, which `ip netns exec` mounts over
//! `/etc/hosts`, naming every host's mesh address. So `--peers` is a list of
//! names resolved by the ordinary resolver, as in a Kubernetes pod.
//!
//! # Lifetime
//!
//! The hosts outlive the orchestrator that created them (its processes do
//! too: surviving a controller restart is the point); an orchestrator on the
//! same state directory adopts them. Each live orchestrator holds a shared
//! lock on its hosts' registry entry. [`remove_for_state_dir`] (called by
//! `kill_all_services`) removes them; and every [`SimulatedHosts::create`]
//! first sweeps the registry: hosts whose entry nobody holds and whose
//! namespaces run no process are left over from a crash, and are removed,
//! as are namespaces named with [`NAMESPACE_PREFIX`] that no entry names
//! and that run no process. (A namespace's veth pairs go with it; a bridge
//! without its registry entry is reused when its number is allocated
//! again.)
//!
//! Needs root (`CAP_NET_ADMIN`, `CAP_SYS_ADMIN`) and `ip` (iproute2); without
//! them [`SimulatedHosts::create`] fails with a [`HostsError`] that says so.

use std::fs::{File, OpenOptions};
use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Where the registry of simulated hosts lives: one `E.json` (the state
/// directory) and one `E.lock` (held shared by every live orchestrator of
/// that directory) per allocation, and `registry.lock` around allocation.
pub const REGISTRY_DIR: &str = "/run/lockstep-hosts";
/// The prefix of every namespace this module creates.
pub const NAMESPACE_PREFIX: &str = "lockstep-h";
/// The most simulated hosts of one orchestrator.
pub const MAX_HOSTS: usize = 16;
/// The highest allocation number (`E`).
const MAX_ALLOCATION: u8 = 250;

/// Why simulated hosts could not be set up or changed.
#[derive(Debug, thiserror::Error)]
pub enum HostsError {
    /// Not root: namespaces and veth pairs need `CAP_NET_ADMIN`.
    #[error(
        "simulated hosts need root (network namespaces and veth pairs need CAP_NET_ADMIN and CAP_SYS_ADMIN); running as uid {0}"
    )]
    NotRoot(u32),
    /// `ip` (iproute2) is not installed.
    #[error("simulated hosts need the `ip` command (iproute2), which is not on PATH")]
    NoIpCommand,
    /// A bad host count.
    #[error("simulated hosts: {0}")]
    Invalid(String),
    /// An `ip` command failed.
    #[error("simulated hosts: `ip {args}` failed: {stderr}")]
    Ip {
        /// Its arguments.
        args: String,
        /// What it printed.
        stderr: String,
    },
    /// All allocation numbers are taken.
    #[error("simulated hosts: all {MAX_ALLOCATION} allocations in {REGISTRY_DIR} are in use")]
    Exhausted,
    /// The registry could not be read or written.
    #[error("simulated hosts registry {path}: {source}")]
    Registry {
        /// The file.
        path: PathBuf,
        /// What the OS said.
        source: std::io::Error,
    },
}

/// Which of a host's two links.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Link {
    /// Between the orchestrator's (the controller's) namespace and the host.
    Control,
    /// Between the host and the other hosts (the timely mesh).
    Mesh,
}

/// The simulated hosts of one orchestrator state directory. Dropping it
/// releases its hold on the registry entry but leaves the hosts (and the
/// processes in them) in place.
#[derive(Debug)]
pub struct SimulatedHosts {
    allocation: u8,
    count: usize,
    /// Held shared while this value lives: the hosts are in use.
    _hold: File,
}

/// Checks that simulated hosts can be made here: root and `ip`.
pub fn available() -> Result<(), HostsError> {
    use std::os::unix::fs::MetadataExt;
    // /proc/self belongs to the effective user.
    let uid = std::fs::metadata("/proc/self")
        .map(|m| m.uid())
        .unwrap_or(u32::MAX);
    if uid != 0 {
        return Err(HostsError::NotRoot(uid));
    }
    match Command::new("ip").arg("-V").output() {
        Ok(o) if o.status.success() => Ok(()),
        _ => Err(HostsError::NoIpCommand),
    }
}

fn ip(args: &[&str]) -> Result<(), HostsError> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|_| HostsError::NoIpCommand)?;
    if out.status.success() {
        Ok(())
    } else {
        Err(HostsError::Ip {
            args: args.join(" "),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        })
    }
}

/// Whether a link of this name exists in the root namespace.
fn link_exists(name: &str) -> bool {
    Path::new("/sys/class/net").join(name).exists()
}

fn namespace_exists(name: &str) -> bool {
    Path::new("/run/netns").join(name).exists()
}

/// The PIDs running in a namespace (`ip netns pids`); empty if it is gone.
fn namespace_pids(name: &str) -> Vec<u32> {
    Command::new("ip")
        .args(["netns", "pids", name])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

fn registry_err(path: &Path) -> impl FnOnce(std::io::Error) -> HostsError + '_ {
    move |source| HostsError::Registry {
        path: path.to_path_buf(),
        source,
    }
}

/// One registry entry: the state directory an allocation belongs to and its
/// host count.
#[derive(serde::Serialize, serde::Deserialize)]
struct Entry {
    state_dir: PathBuf,
    count: usize,
}

fn entry_path(allocation: u8) -> PathBuf {
    Path::new(REGISTRY_DIR).join(format!("{allocation}.json"))
}

fn hold_path(allocation: u8) -> PathBuf {
    Path::new(REGISTRY_DIR).join(format!("{allocation}.lock"))
}

fn read_entry(allocation: u8) -> Option<Entry> {
    serde_json::from_slice(&std::fs::read(entry_path(allocation)).ok()?).ok()
}

/// The registry lock, held around allocation, sweeping and removal.
fn registry_lock() -> Result<File, HostsError> {
    let dir = Path::new(REGISTRY_DIR);
    std::fs::create_dir_all(dir).map_err(registry_err(dir))?;
    let path = dir.join("registry.lock");
    let f = OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .map_err(registry_err(&path))?;
    f.lock().map_err(registry_err(&path))?;
    Ok(f)
}

fn open_hold(allocation: u8) -> Result<File, HostsError> {
    let path = hold_path(allocation);
    OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .map_err(registry_err(&path))
}

fn absolute(dir: &Path) -> PathBuf {
    std::path::absolute(dir).unwrap_or_else(|_| dir.to_path_buf())
}

/// Names of the pieces of allocation `e`'s host `k`.
fn namespace(e: u8, k: usize) -> String {
    format!("{NAMESPACE_PREFIX}{e}-{k}")
}
fn control_link(e: u8, k: usize) -> String {
    format!("ls{e}-c{k}")
}
fn mesh_link(e: u8, k: usize) -> String {
    format!("ls{e}-m{k}")
}
fn bridge(e: u8) -> String {
    format!("ls{e}-br")
}
fn control_ip(e: u8, k: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 77, e, 4 * k as u8 + 2)
}
fn control_gateway(e: u8, k: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 77, e, 4 * k as u8 + 1)
}
fn mesh_ip(e: u8, k: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 78, e, k as u8 + 1)
}
/// A fixed, locally administered MAC address for one end of one of host
/// `k`'s veths: `link` 0 control, 1 mesh; `side` 0 the root's, 1 the host's.
fn mac(e: u8, k: usize, link: u8, side: u8) -> String {
    format!("02:6c:{e:02x}:{k:02x}:{link:02x}:{side:02x}")
}

impl SimulatedHosts {
    /// Sets up (or adopts, if an earlier orchestrator on `state_dir` left
    /// them) `count` simulated hosts for the orchestrator on `state_dir`.
    /// Sweeps crashed leftovers first.
    pub fn create(state_dir: &Path, count: usize) -> Result<Self, HostsError> {
        if count == 0 || count > MAX_HOSTS {
            return Err(HostsError::Invalid(format!(
                "{count} hosts: give between 1 and {MAX_HOSTS}"
            )));
        }
        available()?;
        let state_dir = absolute(state_dir);
        let _registry = registry_lock()?;
        sweep_locked();
        let mine = (1..=MAX_ALLOCATION)
            .find(|&e| read_entry(e).is_some_and(|en| en.state_dir == state_dir));
        let allocation = match mine {
            Some(e) => e,
            None => {
                let e = (1..=MAX_ALLOCATION)
                    .find(|&e| !entry_path(e).exists())
                    .ok_or(HostsError::Exhausted)?;
                let path = entry_path(e);
                let bytes = serde_json::to_vec(&Entry {
                    state_dir: state_dir.clone(),
                    count,
                })
                .expect("entries serialize");
                std::fs::write(&path, bytes).map_err(registry_err(&path))?;
                e
            }
        };
        let hold = open_hold(allocation)?;
        let path = hold_path(allocation);
        hold.lock_shared().map_err(registry_err(&path))?;
        let hosts = SimulatedHosts {
            allocation,
            count,
            _hold: hold,
        };
        if let Err(e) = hosts.build() {
            if mine.is_none() {
                remove_allocation(allocation, count);
            }
            return Err(e);
        }
        Ok(hosts)
    }

    /// Creates whatever of the topology is missing.
    fn build(&self) -> Result<(), HostsError> {
        let e = self.allocation;
        let br = bridge(e);
        if !link_exists(&br) {
            ip(&["link", "add", &br, "type", "bridge"])?;
        }
        ip(&["link", "set", &br, "up"])?;
        let hosts_file: String = (0..self.count)
            .map(|k| format!("{} {}\n", mesh_ip(e, k), namespace(e, k)))
            .collect();
        for k in 0..self.count {
            let ns = namespace(e, k);
            let (ctl, mesh) = (control_link(e, k), mesh_link(e, k));
            let complete = namespace_exists(&ns) && link_exists(&ctl) && link_exists(&mesh);
            if !complete {
                // Partial leftovers of a crash in the middle of building.
                let _ = ip(&["link", "del", &ctl]);
                let _ = ip(&["link", "del", &mesh]);
                if namespace_exists(&ns) {
                    let _ = ip(&["netns", "del", &ns]);
                }
                ip(&["netns", "add", &ns])?;
                ip(&["-n", &ns, "link", "set", "lo", "up"])?;
                let (root_mac, host_mac) = (mac(e, k, 0, 0), mac(e, k, 0, 1));
                ip(&[
                    "link", "add", &ctl, "address", &root_mac, "type", "veth", "peer", "name",
                    "ctl", "address", &host_mac, "netns", &ns,
                ])?;
                let gw = format!("{}/30", control_gateway(e, k));
                ip(&["addr", "add", &gw, "dev", &ctl])?;
                ip(&["link", "set", &ctl, "up"])?;
                let addr = format!("{}/30", control_ip(e, k));
                ip(&["-n", &ns, "addr", "add", &addr, "dev", "ctl"])?;
                ip(&["-n", &ns, "link", "set", "ctl", "up"])?;
                let (root_mac, host_mac) = (mac(e, k, 1, 0), mac(e, k, 1, 1));
                ip(&[
                    "link", "add", &mesh, "address", &root_mac, "type", "veth", "peer", "name",
                    "mesh", "address", &host_mac, "netns", &ns,
                ])?;
                ip(&["link", "set", &mesh, "master", &br])?;
                ip(&["link", "set", &mesh, "up"])?;
                let addr = format!("{}/24", mesh_ip(e, k));
                ip(&["-n", &ns, "addr", "add", &addr, "dev", "mesh"])?;
                ip(&["-n", &ns, "link", "set", "mesh", "up"])?;
            }
            // Permanent neighbour entries: a link that loses its carrier
            // keeps them, so what is sent into a cut is dropped at once
            // (and TCP retransmits on its own schedule) instead of waiting
            // in the ARP queue to be sent the moment the link comes back.
            let neigh = |ns: Option<&str>, addr: Ipv4Addr, mac: String, dev: &str| {
                let addr = addr.to_string();
                let mut args = Vec::new();
                if let Some(ns) = ns {
                    args.extend(["-n", ns]);
                }
                args.extend(["neigh", "replace", &addr, "lladdr", &mac]);
                args.extend(["nud", "permanent", "dev", dev]);
                ip(&args)
            };
            neigh(None, control_ip(e, k), mac(e, k, 0, 1), &ctl)?;
            neigh(Some(&ns), control_gateway(e, k), mac(e, k, 0, 0), "ctl")?;
            for j in (0..self.count).filter(|&j| j != k) {
                neigh(Some(&ns), mesh_ip(e, j), mac(e, j, 1, 1), "mesh")?;
            }
            let dir = Path::new("/etc/netns").join(&ns);
            std::fs::create_dir_all(&dir).map_err(registry_err(&dir))?;
            let path = dir.join("hosts");
            std::fs::write(&path, &hosts_file).map_err(registry_err(&path))?;
        }
        Ok(())
    }

    /// How many hosts there are.
    pub fn count(&self) -> usize {
        self.count
    }

    /// Host `k`'s namespace, which is also its host name inside every host.
    pub fn namespace(&self, k: usize) -> String {
        namespace(self.allocation, k)
    }

    /// The address the orchestrator's namespace reaches host `k` at.
    pub fn control_addr(&self, k: usize) -> IpAddr {
        IpAddr::V4(control_ip(self.allocation, k))
    }

    /// Brings one of host `k`'s links down (`up: false`: a partition; the
    /// other side hears nothing, nothing is reset) or up again.
    pub fn set_link(&self, k: usize, link: Link, up: bool) -> Result<(), HostsError> {
        if k >= self.count {
            return Err(HostsError::Invalid(format!(
                "no host {k}: there are {}",
                self.count
            )));
        }
        let state = if up { "up" } else { "down" };
        match link {
            // The host's end: the root namespace keeps its route to the
            // host (marked linkdown), so what it sends is dropped in the
            // veth, never routed elsewhere.
            Link::Control => ip(&["-n", &self.namespace(k), "link", "set", "ctl", state]),
            // The bridge's port: the root namespace has no route into the
            // mesh, and the host keeps its own, so both sides hear silence.
            Link::Mesh => ip(&["link", "set", &mesh_link(self.allocation, k), state]),
        }
    }
}

/// Removes allocation `e`'s hosts and its registry entry. Under the
/// registry lock.
fn remove_allocation(e: u8, count: usize) {
    for k in 0..count.max(MAX_HOSTS) {
        let ns = namespace(e, k);
        if namespace_exists(&ns) {
            let _ = ip(&["netns", "del", &ns]);
        }
        // The veth pairs go with the namespace once its last process is
        // gone; delete them now in case one lingers.
        for l in [control_link(e, k), mesh_link(e, k)] {
            if link_exists(&l) {
                let _ = ip(&["link", "del", &l]);
            }
        }
        let _ = std::fs::remove_dir_all(Path::new("/etc/netns").join(&ns));
    }
    if link_exists(&bridge(e)) {
        let _ = ip(&["link", "del", &bridge(e)]);
    }
    let _ = std::fs::remove_file(entry_path(e));
    let _ = std::fs::remove_file(hold_path(e));
}

/// Removes leftovers: allocations nobody holds whose namespaces run no
/// process. Under the registry lock. Returns how many were removed.
fn sweep_locked() -> usize {
    let mut removed = 0;
    for e in 1..=MAX_ALLOCATION {
        let Some(entry) = read_entry(e) else {
            continue;
        };
        let Ok(hold) = open_hold(e) else {
            continue;
        };
        if hold.try_lock().is_err() {
            continue; // a live orchestrator holds it
        }
        let busy = (0..entry.count).any(|k| !namespace_pids(&namespace(e, k)).is_empty());
        if !busy {
            tracing::info!(allocation = e, state_dir = %entry.state_dir.display(), "removing leftover simulated hosts");
            remove_allocation(e, entry.count);
            removed += 1;
        }
    }
    // Namespaces with our prefix that no registry entry names (the
    // registry was removed by hand, say) and that run no process.
    if let Ok(entries) = std::fs::read_dir("/run/netns") {
        for ns in entries.flatten() {
            let name = ns.file_name().to_string_lossy().to_string();
            let Some(e) = name
                .strip_prefix(NAMESPACE_PREFIX)
                .and_then(|rest| rest.split('-').next())
                .and_then(|e| e.parse::<u8>().ok())
            else {
                continue;
            };
            if !entry_path(e).exists() && namespace_pids(&name).is_empty() {
                tracing::info!(namespace = %name, "removing a leftover simulated host");
                let _ = ip(&["netns", "del", &name]);
                let _ = std::fs::remove_dir_all(Path::new("/etc/netns").join(&name));
            }
        }
    }
    removed
}

/// Removes leftover simulated hosts (see the module docs); returns how many
/// allocations were removed. Does nothing without root.
pub fn sweep() -> usize {
    if available().is_err() {
        return 0;
    }
    match registry_lock() {
        Ok(_lock) => sweep_locked(),
        Err(_) => 0,
    }
}

/// Removes the simulated hosts of `state_dir`, if it has any: the teardown
/// after its processes were killed. Namespaces that still run a process
/// vanish once it exits.
pub fn remove_for_state_dir(state_dir: &Path) {
    if !Path::new(REGISTRY_DIR).exists() || available().is_err() {
        return;
    }
    let state_dir = absolute(state_dir);
    let Ok(_lock) = registry_lock() else {
        return;
    };
    for e in 1..=MAX_ALLOCATION {
        if let Some(entry) = read_entry(e) {
            if entry.state_dir == state_dir {
                remove_allocation(e, entry.count);
            }
        }
    }
}
