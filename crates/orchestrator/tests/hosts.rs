//! Simulated hosts (network namespaces) of the process backend, on real
//! processes: each process runs in its host's namespace, peers reach each
//! other by host name, the orchestrator's side reaches them at their control
//! addresses, a cut link is silent until healed, and the teardown removes
//! the namespaces. Skipped, with the reason printed, where namespaces are
//! not available (not root, no `ip`) or `python3` is missing.

use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::time::{Duration, Instant};

use lockstep_orchestrator::hosts::{self, Link};
use lockstep_orchestrator::process::{
    kill_all_services, ProcessOrchestrator, ProcessOrchestratorConfig,
};
use lockstep_orchestrator::{Orchestrator, ServiceConfig};

/// A state directory whose services and hosts are removed when the test
/// ends, however it ends.
struct Sandbox(tempfile::TempDir);

impl Drop for Sandbox {
    fn drop(&mut self) {
        let _ = kill_all_services(self.0.path());
    }
}

/// Held by the tests that make simulated hosts: a sweep in one test's
/// orchestrator start would remove another's leftovers, and its allocation
/// could then take their names.
static HOSTS: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Why this test cannot run here, if it cannot.
fn skip_reason() -> Option<String> {
    if let Err(e) = hosts::available() {
        return Some(e.to_string());
    }
    match std::process::Command::new("python3").arg("-V").output() {
        Ok(o) if o.status.success() => None,
        _ => Some("python3 is not installed".to_string()),
    }
}

/// Each process listens on `0.0.0.0:PORT`; process 0 also connects to
/// process 1 by its host name and, once connected, writes `reached` to a
/// file.
const PROGRAM: &str = r#"
import os, socket, sys, time
port, peer, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", port)); s.listen(16)
if out != "-":
    host, p = peer.rsplit(":", 1)
    deadline = time.time() + 20
    while True:
        try:
            socket.create_connection((host, int(p)), timeout=1).close(); break
        except OSError:
            if time.time() > deadline: raise
            time.sleep(0.05)
    # Written whole, then renamed: the test polls for the file and must
    # never read it created but still empty.
    with open(out + ".part", "w") as f:
        f.write("reached " + host)
    os.replace(out + ".part", out)
while True:
    c, _ = s.accept(); c.close()
"#;

/// Connects to `addr` until it answers, within `bound`.
fn reachable(addr: SocketAddr, bound: Duration) -> bool {
    let deadline = Instant::now() + bound;
    while Instant::now() < deadline {
        if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

/// Whether `cargo xtask test` checked that `what` is here before it ran
/// the tests (`LOCKSTEP_TEST_HAS`, a comma-separated list: `root`,
/// `hosts`): then a test that finds it missing fails instead of passing
/// with a note.
fn promised(what: &str) -> bool {
    std::env::var("LOCKSTEP_TEST_HAS").is_ok_and(|v| v.split(',').any(|h| h == what))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn processes_run_on_their_hosts_reach_each_other_by_name_and_links_can_be_cut() {
    if let Some(why) = skip_reason() {
        assert!(
            !promised("hosts"),
            "simulated hosts are not available: {why}"
        );
        println!("skipped: simulated hosts are not available here: {why}");
        return;
    }
    let _serial = HOSTS.lock().await;
    let sandbox = Sandbox(tempfile::tempdir().unwrap());
    let dir = sandbox.0.path().to_path_buf();
    let mut config = ProcessOrchestratorConfig::new(&dir, 1);
    config.hosts = 2;
    let orchestrator = ProcessOrchestrator::new(config).unwrap();
    let out = dir.join("reached");
    let out_arg = out.display().to_string();
    let service = ServiceConfig::new("hosts-1", 1, "python3")
        .scale(2)
        .port("p")
        .args(move |a| {
            vec![
                "-c".to_string(),
                PROGRAM.to_string(),
                a.port("p").to_string(),
                a.peer_addrs("p")[1].clone(),
                if a.process == 0 {
                    out_arg.clone()
                } else {
                    "-".to_string()
                },
            ]
        });
    let status = orchestrator.ensure_service(service).await.unwrap();
    let hosts = orchestrator.hosts().expect("hosts were asked for");
    let addrs: Vec<SocketAddr> = status.processes.iter().map(|p| p.addresses["p"]).collect();
    for (k, a) in addrs.iter().enumerate() {
        assert_eq!(a.ip(), hosts.control_addr(k), "process {k} on host {k}");
        assert!(reachable(*a, Duration::from_secs(20)), "process {k} at {a}");
    }
    // Each process is in its host's namespace, not ours.
    let ours = std::fs::read_link("/proc/self/ns/net").unwrap();
    for p in &status.processes {
        let theirs = std::fs::read_link(format!("/proc/{}/ns/net", p.pid.unwrap())).unwrap();
        assert_ne!(
            theirs, ours,
            "process {} runs in its own namespace",
            p.index
        );
    }
    // Process 0 reached process 1 by its host name, over the mesh.
    let deadline = Instant::now() + Duration::from_secs(20);
    let reached = loop {
        if let Ok(s) = std::fs::read_to_string(&out) {
            break s;
        }
        assert!(
            Instant::now() < deadline,
            "process 0 never reached process 1"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(reached, format!("reached {}", hosts.namespace(1)));
    // A cut control link: host 1 does not answer (silence, not a refusal);
    // host 0 still does. Healed, host 1 answers again.
    hosts.set_link(1, Link::Control, false).unwrap();
    let err = TcpStream::connect_timeout(&addrs[1], Duration::from_millis(500)).unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::TimedOut, "{err}");
    assert!(reachable(addrs[0], Duration::from_secs(5)));
    hosts.set_link(1, Link::Control, true).unwrap();
    assert!(reachable(addrs[1], Duration::from_secs(20)), "healed");
    // The teardown removes the namespaces.
    let namespaces = [hosts.namespace(0), hosts.namespace(1)];
    drop(orchestrator);
    drop(sandbox);
    for ns in namespaces {
        assert!(!Path::new("/run/netns").join(&ns).exists(), "{ns} removed");
    }
}

#[test]
fn a_bad_host_count_is_refused_clearly() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = ProcessOrchestratorConfig::new(dir.path(), 1);
    config.hosts = hosts::MAX_HOSTS + 1;
    let err = ProcessOrchestrator::new(config).err().expect("refused");
    assert!(err.to_string().contains("give between 1 and"), "{err}");
}

/// Removes the simulated hosts of a directory when the test ends.
struct HostsGuard(tempfile::TempDir);

impl Drop for HostsGuard {
    fn drop(&mut self) {
        hosts::remove_for_state_dir(self.0.path());
    }
}

#[test]
fn leftovers_of_a_crash_are_swept_and_hosts_in_use_are_kept() {
    if let Err(why) = hosts::available() {
        assert!(
            !promised("hosts"),
            "simulated hosts are not available: {why}"
        );
        println!("skipped: simulated hosts are not available here: {why}");
        return;
    }
    let _serial = HOSTS.blocking_lock();
    let in_use = HostsGuard(tempfile::tempdir().unwrap());
    let left = HostsGuard(tempfile::tempdir().unwrap());
    let held = hosts::SimulatedHosts::create(in_use.0.path(), 1).unwrap();
    let crashed = hosts::SimulatedHosts::create(left.0.path(), 2).unwrap();
    let leftovers = [crashed.namespace(0), crashed.namespace(1)];
    // Its orchestrator is gone (the hold released), its namespaces stay,
    // with no process in them.
    drop(crashed);
    let exists = |ns: &str| Path::new("/run/netns").join(ns).exists();
    assert!(leftovers.iter().all(|ns| exists(ns)));
    hosts::sweep();
    for ns in &leftovers {
        assert!(!exists(ns), "{ns} swept");
        assert!(
            !Path::new("/etc/netns").join(ns).exists(),
            "{ns}'s hosts file swept"
        );
    }
    assert!(exists(&held.namespace(0)), "hosts in use are kept");
    // A namespace with our prefix that no registry entry names.
    let stray = format!("{}250-7", hosts::NAMESPACE_PREFIX);
    let made = std::process::Command::new("ip")
        .args(["netns", "add", &stray])
        .status()
        .unwrap();
    assert!(made.success());
    hosts::sweep();
    assert!(!exists(&stray), "{stray} swept");
    // An orchestrator restarted on the same directory adopts its hosts.
    let again = hosts::SimulatedHosts::create(in_use.0.path(), 1).unwrap();
    assert_eq!(again.namespace(0), held.namespace(0));
}
