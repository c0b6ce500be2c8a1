//! The process backend on real OS processes: assignment of ports and
//! arguments, adoption across orchestrator instances, restart on crash with
//! watch events, shared fate (one generation), private state files and an
//! explicit child environment, conditional writes (O4), process-group kill, PID-reuse
//! guard, restarting a whole service (a stopped one included), and bad input.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use lockstep_orchestrator::process::{
    kill_all_services, Backoff, NewError, ProcessOrchestrator, ProcessOrchestratorConfig,
};
use lockstep_orchestrator::{
    EnsureError, Orchestrator, RestartError, ServiceConfig, ServiceEventKind, ServiceStatus,
    EPOCH_LABEL, ID_LABEL,
};

/// A state directory whose services are killed when the test ends, however it ends.
struct Sandbox(tempfile::TempDir);

impl Sandbox {
    fn new() -> Sandbox {
        Sandbox(tempfile::tempdir().unwrap())
    }
    fn path(&self) -> &Path {
        self.0.path()
    }
    fn orchestrator(&self, epoch: u64) -> ProcessOrchestrator {
        let mut config = ProcessOrchestratorConfig::new(self.path(), epoch);
        config.backoff = Backoff {
            initial: Duration::from_millis(50),
            max: Duration::from_millis(200),
            reset_after: Duration::from_secs(10),
        };
        config.poll_interval = Duration::from_millis(20);
        ProcessOrchestrator::new(config).unwrap()
    }
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        let _ = kill_all_services(self.path());
    }
}

fn sleeper(name: &str, id: u64, scale: usize) -> ServiceConfig {
    ServiceConfig::new(name, id, "sleep")
        .scale(scale)
        .fixed_args(["300"])
}

fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            let state = s[s.rfind(')').unwrap() + 2..].chars().next();
            state != Some('Z')
        })
        .unwrap_or(false)
}

async fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn every_process_is_told_its_ports_and_its_peers() {
    let sandbox = Sandbox::new();
    let out: PathBuf = sandbox.path().join("args");
    std::fs::create_dir(&out).unwrap();
    let o = sandbox.orchestrator(1);
    let dir = out.clone();
    let config = ServiceConfig::new("replica-1", 1, "sh")
        .scale(3)
        .port("timely")
        .port("controller")
        .label("replica-name", "r1")
        .args(move |a| {
            vec![
                "-c".into(),
                format!(
                    "echo \"$@\" > {}/{}; exec sleep 300",
                    dir.display(),
                    a.process
                ),
                "sh".into(),
                format!("--process={}", a.process),
                format!("--processes={}", a.scale),
                format!("--timely-port={}", a.port("timely")),
                format!("--controller-port={}", a.port("controller")),
                format!("--peers={}", a.peer_addrs("timely").join(",")),
            ]
        });
    let status = o.ensure_service(config).await.unwrap();
    assert_eq!(status.processes.len(), 3);
    assert_eq!(status.labels[EPOCH_LABEL], "1");
    assert_eq!(status.labels[ID_LABEL], "1");
    assert_eq!(status.labels["replica-name"], "r1");
    let peers: Vec<String> = status
        .processes
        .iter()
        .map(|p| p.addresses["timely"].to_string())
        .collect();
    let mut all_ports: Vec<u16> = status
        .processes
        .iter()
        .flat_map(|p| p.addresses.values().map(|a| a.port()))
        .collect();
    all_ports.sort();
    all_ports.dedup();
    assert_eq!(
        all_ports.len(),
        6,
        "every port of every process is distinct"
    );
    for p in &status.processes {
        let file = out.join(p.index.to_string());
        eventually("the process to write its args", || file.exists()).await;
        let mut args = String::new();
        eventually("the args to be complete", || {
            args = std::fs::read_to_string(&file).unwrap();
            args.ends_with('\n')
        })
        .await;
        assert_eq!(
            args.trim(),
            format!(
                "--process={} --processes=3 --timely-port={} --controller-port={} --peers={}",
                p.index,
                p.addresses["timely"].port(),
                p.addresses["controller"].port(),
                peers.join(",")
            )
        );
    }
    assert!(o.drop_service("replica-1").await.unwrap());
    assert!(!o.drop_service("replica-1").await.unwrap());
    for p in &status.processes {
        assert!(!alive(p.pid.unwrap()));
    }
}

#[tokio::test]
async fn a_new_orchestrator_adopts_running_services_without_restarting_them() {
    let sandbox = Sandbox::new();
    let first = sandbox.orchestrator(1);
    let before = first
        .ensure_service(sleeper("replica-1", 1, 2).port("timely"))
        .await
        .unwrap();
    drop(first); // the controller goes away; its services stay
    for p in &before.processes {
        assert!(alive(p.pid.unwrap()));
    }
    let second = sandbox.orchestrator(2);
    let listed = second.list_services().await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].epoch, 1);
    assert!(listed[0].processes.iter().all(|p| p.running));
    let mut events = second.watch_services();
    let after = second
        .ensure_service(sleeper("replica-1", 1, 2).port("timely"))
        .await
        .unwrap();
    assert_eq!(after.epoch, 2, "the label moves forward");
    let pids = |s: &lockstep_orchestrator::ServiceStatus| {
        s.processes.iter().map(|p| p.pid).collect::<Vec<_>>()
    };
    assert_eq!(pids(&before), pids(&after), "adopted, not restarted");
    assert!(matches!(
        events.try_recv().unwrap().kind,
        ServiceEventKind::Adopted { .. }
    ));

    // Changed arguments, same shape: new processes on fresh ports (the old
    // processes hold theirs until they are killed).
    let relabelled = second
        .ensure_service(
            ServiceConfig::new("replica-1", 1, "sleep")
                .scale(2)
                .port("timely")
                .fixed_args(["299"]),
        )
        .await
        .unwrap();
    assert_ne!(pids(&relabelled), pids(&after));
    let ports = |s: &lockstep_orchestrator::ServiceStatus| {
        s.processes
            .iter()
            .map(|p| p.addresses["timely"].port())
            .collect::<Vec<_>>()
    };
    assert!(ports(&relabelled)
        .iter()
        .all(|p| !ports(&after).contains(p)));
    for p in &after.processes {
        assert!(!alive(p.pid.unwrap()), "the old processes are gone");
    }

    // A changed shape replaces the processes too.
    let changed = second
        .ensure_service(sleeper("replica-1", 1, 3).port("timely"))
        .await
        .unwrap();
    assert_eq!(changed.processes.len(), 3);
    for p in &relabelled.processes {
        assert!(!alive(p.pid.unwrap()), "the old processes are gone");
    }
}

#[tokio::test]
async fn a_crashed_process_restarts_its_whole_service_with_backoff_and_is_reported() {
    let sandbox = Sandbox::new();
    let o = sandbox.orchestrator(1);
    let mut events = o.watch_services();
    let status = o.ensure_service(sleeper("replica-1", 1, 3)).await.unwrap();
    let generation = generations(&status)[0].unwrap();
    let victim = status.processes[1].pid.unwrap();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(victim as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let mut seen = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !seen
        .iter()
        .any(|k| matches!(k, ServiceEventKind::Started { pid } if *pid != victim))
    {
        let left = deadline.saturating_duration_since(Instant::now());
        let e = tokio::time::timeout(left, events.recv())
            .await
            .expect("no restart within 10 s")
            .unwrap();
        if e.process == Some(1) {
            seen.push(e.kind);
        }
    }
    assert!(seen
        .iter()
        .any(|k| matches!(k, ServiceEventKind::Exited { pid, .. } if *pid == victim)));
    assert!(seen
        .iter()
        .any(|k| matches!(k, ServiceEventKind::Restarting { attempt: 1, .. })));
    // Shared fate: the whole service was started again as one generation.
    let listed = settled(&o, 3).await;
    for (before, after) in status.processes.iter().zip(&listed.processes) {
        assert!(after.running, "{after:?}");
        assert_eq!(after.restarts, 1, "{after:?}");
        assert_ne!(
            after.pid, before.pid,
            "process {} was replaced",
            before.index
        );
    }
    assert_eq!(
        generations(&listed),
        vec![Some(generation + 1); 3],
        "one new generation, started once"
    );
}

/// The generation (`LOCKSTEP_GENERATION`) of every process of `s`.
fn generations(s: &ServiceStatus) -> Vec<Option<u64>> {
    s.processes
        .iter()
        .map(|p| {
            let environ = std::fs::read(format!("/proc/{}/environ", p.pid?)).ok()?;
            environ.split(|b| *b == 0).find_map(|kv| {
                std::str::from_utf8(kv)
                    .ok()?
                    .strip_prefix("LOCKSTEP_GENERATION=")?
                    .parse()
                    .ok()
            })
        })
        .collect()
}

/// The only service, once all its `scale` processes run and have stayed the
/// same for a few poll intervals.
async fn settled(o: &ProcessOrchestrator, scale: usize) -> ServiceStatus {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut last: Option<ServiceStatus> = None;
    let mut stable = 0;
    loop {
        let listed = o.list_services().await.unwrap().remove(0);
        let running = listed.processes.len() == scale && listed.processes.iter().all(|p| p.running);
        if running
            && last
                .as_ref()
                .is_some_and(|l| pids_of(l) == pids_of(&listed))
        {
            stable += 1;
            if stable == 10 {
                return listed;
            }
        } else {
            stable = 0;
        }
        assert!(Instant::now() < deadline, "never settled: {listed:?}");
        last = Some(listed);
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
}

/// Issue 28's crash loop at its root: processes of one service exit while no
/// orchestrator runs (one killed, one stopped and so not exiting), and an
/// orchestrator started meanwhile adopts the service. Each process used to
/// be restarted on its own, joining peers of another generation; now every
/// process is replaced together, once, with one new generation.
#[tokio::test]
async fn processes_lost_while_no_orchestrator_runs_come_back_as_one_generation() {
    let sandbox = Sandbox::new();
    let first = sandbox.orchestrator(1);
    let status = first
        .ensure_service(sleeper("replica-1", 1, 4))
        .await
        .unwrap();
    let generation = generations(&status);
    assert!(
        generation
            .iter()
            .all(|g| g.is_some() && *g == generation[0]),
        "{generation:?}"
    );
    drop(first);
    let kill = |i: usize| {
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(status.processes[i].pid.unwrap() as i32),
            nix::sys::signal::Signal::SIGKILL,
        )
        .unwrap()
    };
    stop(status.processes[2].pid.unwrap());
    kill(1);
    kill(3);
    let second = sandbox.orchestrator(2);
    second
        .ensure_service(sleeper("replica-1", 1, 4))
        .await
        .unwrap();
    let listed = settled(&second, 4).await;
    for (before, after) in status.processes.iter().zip(&listed.processes) {
        assert_ne!(
            after.pid, before.pid,
            "process {} was replaced",
            before.index
        );
    }
    assert_ne!(
        proc_state(status.processes[2].pid.unwrap()),
        Some('T'),
        "the stopped process of the old generation is gone"
    );
    assert_eq!(
        generations(&listed),
        vec![Some(generation[0].unwrap() + 1); 4],
        "one new generation, started once"
    );
}

/// An orchestrator that adopts a service whose processes all live keeps them
/// and their generation.
#[tokio::test]
async fn adopting_live_processes_keeps_their_generation() {
    let sandbox = Sandbox::new();
    let first = sandbox.orchestrator(1);
    let status = first
        .ensure_service(sleeper("replica-1", 1, 2))
        .await
        .unwrap();
    drop(first);
    let second = sandbox.orchestrator(2);
    let adopted = second
        .ensure_service(sleeper("replica-1", 1, 2))
        .await
        .unwrap();
    assert_eq!(pids_of(&adopted), pids_of(&status));
    assert_eq!(generations(&adopted), generations(&status));
}

/// The state files hold each service's environment (a session key): they
/// are private to the user from the moment they exist, and a process gets
/// only its spec's variables and a few harmless ones, never the
/// orchestrator's own (its API token, its store URL).
#[tokio::test]
async fn state_files_are_private_and_processes_get_an_explicit_environment() {
    use std::os::unix::fs::PermissionsExt;
    let sandbox = Sandbox::new();
    let o = sandbox.orchestrator(1);
    let allowed = |name: &str| {
        name.starts_with("LOCKSTEP_")
            || ["PATH", "RUST_LOG", "RUST_BACKTRACE", "LANG", "TZ", "TMPDIR"].contains(&name)
    };
    // The test process has variables a child must not inherit (HOME, cargo's
    // CARGO_*), so the check below can fail.
    assert!(std::env::vars().any(|(k, _)| !allowed(&k)));
    let key = "a-session-key-that-stays-out-of-the-record";
    let status = o
        .ensure_service(sleeper("replica-1", 1, 1).env("LOCKSTEP_SESSION_KEY", key))
        .await
        .unwrap();
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(sandbox.path()), 0o700);
    assert_eq!(mode(&sandbox.path().join("services")), 0o700);
    assert_eq!(mode(&sandbox.path().join("logs")), 0o700);
    assert_eq!(mode(&sandbox.path().join("services/replica-1.json")), 0o600);
    // The key is in its own private file, not in the service record.
    let record = std::fs::read_to_string(sandbox.path().join("services/replica-1.json")).unwrap();
    assert!(!record.contains(key), "the record holds the key: {record}");
    let env_file = sandbox.path().join("services/replica-1.env");
    assert_eq!(mode(&env_file), 0o600);
    assert!(std::fs::read_to_string(&env_file).unwrap().contains(key));
    // A new orchestrator reads it back: the unchanged service is adopted.
    drop(o);
    let again = sandbox
        .orchestrator(2)
        .ensure_service(sleeper("replica-1", 1, 1).env("LOCKSTEP_SESSION_KEY", key))
        .await
        .unwrap();
    assert_eq!(
        again.processes[0].pid, status.processes[0].pid,
        "adopted, not restarted"
    );
    assert_eq!(mode(&sandbox.path().join("logs/replica-1-0.log")), 0o600);
    let pid = status.processes[0].pid.unwrap();
    let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap();
    let names: Vec<String> = environ
        .split(|b| *b == 0)
        .filter_map(|kv| {
            std::str::from_utf8(kv)
                .ok()?
                .split_once('=')
                .map(|(k, _)| k.to_string())
        })
        .collect();
    assert!(
        names.contains(&"LOCKSTEP_SESSION_KEY".to_string()),
        "{names:?}"
    );
    for name in &names {
        assert!(allowed(name), "inherited {name}: {names:?}");
    }
}

#[tokio::test]
async fn an_adopted_process_that_crashes_is_restarted_too() {
    let sandbox = Sandbox::new();
    let first = sandbox.orchestrator(1);
    first
        .ensure_service(sleeper("replica-1", 1, 1))
        .await
        .unwrap();
    drop(first);
    let second = sandbox.orchestrator(2);
    let status = second
        .ensure_service(sleeper("replica-1", 1, 1))
        .await
        .unwrap();
    let victim = status.processes[0].pid.unwrap();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(victim as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let listed = second.list_services().await.unwrap();
        let p = &listed[0].processes[0];
        if p.running && p.pid != Some(victim) {
            assert_eq!(p.restarts, 1);
            break;
        }
        assert!(Instant::now() < deadline, "not restarted: {p:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn ensure_is_conditional_on_the_epoch_unless_switched_off() {
    let sandbox = Sandbox::new();
    let newer = sandbox.orchestrator(3);
    let stale = sandbox.orchestrator(2);
    let s = newer
        .ensure_service(sleeper("replica-1", 1, 1))
        .await
        .unwrap();
    let err = stale
        .ensure_service(sleeper("replica-1", 1, 2))
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            EnsureError::StaleEpoch {
                stored: 3,
                ours: 2,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("another controller took over"));
    let listed = newer.list_services().await.unwrap();
    assert_eq!(listed[0].epoch, 3);
    assert_eq!(listed[0].processes.len(), 1, "the spec was not overwritten");
    assert_eq!(listed[0].processes[0].pid, s.processes[0].pid);

    // The negative test: without the condition the stale write goes through
    // and the label goes backwards.
    let mut config = ProcessOrchestratorConfig::new(sandbox.path(), 2);
    config.conditional_writes = false;
    let unconditional = ProcessOrchestrator::new(config).unwrap();
    let s = unconditional
        .ensure_service(sleeper("replica-1", 1, 2))
        .await
        .unwrap();
    assert_eq!(s.epoch, 2);
    assert_eq!(s.processes.len(), 2);
    assert_eq!(newer.list_services().await.unwrap()[0].epoch, 2);
}

#[tokio::test]
async fn dropping_kills_the_whole_process_group() {
    let sandbox = Sandbox::new();
    let o = sandbox.orchestrator(1);
    let pidfile = sandbox.path().join("grandchild.pid");
    let config = ServiceConfig::new("replica-1", 1, "sh").fixed_args([
        "-c".to_string(),
        format!("sleep 300 & echo $! > {}; wait", pidfile.display()),
    ]);
    o.ensure_service(config).await.unwrap();
    eventually("the grandchild", || {
        std::fs::read_to_string(&pidfile).is_ok_and(|s| s.ends_with('\n'))
    })
    .await;
    let grandchild: u32 = std::fs::read_to_string(&pidfile)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert!(alive(grandchild));
    let log = sandbox.path().join("logs/replica-1-0.log");
    assert!(log.is_file());
    assert!(o.drop_service("replica-1").await.unwrap());
    eventually("the grandchild to die", || !alive(grandchild)).await;
    assert!(!log.exists(), "a dropped service's logs go with it");
}

#[tokio::test]
async fn a_log_past_the_limit_is_rotated_when_its_process_starts() {
    let sandbox = Sandbox::new();
    let mut config = ProcessOrchestratorConfig::new(sandbox.path(), 1);
    config.log_rotate_bytes = 1000;
    config.poll_interval = Duration::from_millis(20);
    let o = ProcessOrchestrator::new(config).unwrap();
    let logs = sandbox.path().join("logs");
    std::fs::write(logs.join("replica-1-0.log"), vec![b'x'; 1001]).unwrap();
    std::fs::write(logs.join("replica-1-0.log.1"), b"oldest").unwrap();
    o.ensure_service(sleeper("replica-1", 1, 1)).await.unwrap();
    assert_eq!(
        std::fs::read(logs.join("replica-1-0.log.1")).unwrap().len(),
        1001,
        "the full log became the rotated one, replacing the oldest"
    );
    assert!(
        std::fs::metadata(logs.join("replica-1-0.log"))
            .unwrap()
            .len()
            < 1000
    );
    o.drop_service("replica-1").await.unwrap();
    assert!(!logs.join("replica-1-0.log.1").exists());
}

/// A process that logs without end: its log is rotated while it runs, so
/// the disk holds at most about twice the limit.
#[tokio::test]
async fn a_running_process_log_is_rotated_by_size() {
    let sandbox = Sandbox::new();
    let mut config = ProcessOrchestratorConfig::new(sandbox.path(), 1);
    config.log_rotate_bytes = 64 << 10;
    config.poll_interval = Duration::from_millis(20);
    let o = ProcessOrchestrator::new(config).unwrap();
    let noisy = ServiceConfig::new("replica-1", 1, "sh").fixed_args([
        "-c",
        "while true; do echo 0123456789012345678901234567890123456789; done",
    ]);
    o.ensure_service(noisy).await.unwrap();
    let logs = sandbox.path().join("logs");
    let rotated = logs.join("replica-1-0.log.1");
    eventually("a rotation", || rotated.exists()).await;
    // Well past the limit in bytes written, the files stay bounded.
    for _ in 0..20 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let current = std::fs::metadata(logs.join("replica-1-0.log"))
            .unwrap()
            .len();
        assert!(current < 8 << 20, "the running log grew to {current} bytes");
    }
    o.drop_service("replica-1").await.unwrap();
}

#[tokio::test]
async fn a_reused_pid_is_never_ours() {
    let sandbox = Sandbox::new();
    let o = sandbox.orchestrator(1);
    o.ensure_service(sleeper("replica-1", 1, 1)).await.unwrap();
    drop(o); // no supervisor may react to the rewrite below
             // Rewrite the record as if the process had died and the OS had given its
             // PID to this test process: same PID scheme, different start time.
    let path = sandbox.path().join("services/replica-1.json");
    let mut record: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let real = record["processes"][0]["pid"].as_u64().unwrap() as u32;
    record["processes"][0]["pid"] = std::process::id().into();
    record["processes"][0]["start_time"] = 1.into();
    std::fs::write(&path, serde_json::to_vec(&record).unwrap()).unwrap();
    let o = sandbox.orchestrator(1);
    let listed = o.list_services().await.unwrap();
    assert!(!listed[0].processes[0].running);
    // Dropping must not signal our (reused) PID; reaching the next line proves it.
    assert!(o.drop_service("replica-1").await.unwrap());
    // The real process was left behind by the rewrite; clean it up.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(real as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
}

#[tokio::test]
async fn bad_input_gives_clear_errors() {
    let sandbox = Sandbox::new();
    let missing = sandbox.path().join("missing");
    assert!(matches!(
        ProcessOrchestrator::new(ProcessOrchestratorConfig::new(&missing, 1)),
        Err(NewError::Missing(_))
    ));
    let file = sandbox.path().join("file");
    std::fs::write(&file, b"x").unwrap();
    assert!(matches!(
        ProcessOrchestrator::new(ProcessOrchestratorConfig::new(&file, 1)),
        Err(NewError::NotADirectory(_))
    ));
    // Root may write anywhere a mode allows nothing; /proc refuses everyone.
    assert!(matches!(
        ProcessOrchestrator::new(ProcessOrchestratorConfig::new("/proc", 1)),
        Err(NewError::Unwritable { .. })
    ));

    let o = sandbox.orchestrator(1);
    let err = o
        .ensure_service(ServiceConfig::new(
            "replica-1",
            1,
            "/nonexistent/lockstep-replica",
        ))
        .await
        .unwrap_err();
    assert!(matches!(err, EnsureError::ProgramNotFound { .. }), "{err}");
    assert!(err.to_string().contains("/nonexistent/lockstep-replica"));
    assert!(matches!(
        o.ensure_service(sleeper("../escape", 1, 1)).await,
        Err(EnsureError::Invalid(_))
    ));
    assert!(matches!(
        o.ensure_service(sleeper("replica-1", 1, 0)).await,
        Err(EnsureError::Invalid(_))
    ));
    assert!(o.list_services().await.unwrap().is_empty());

    // A corrupt state file is reported, not deleted.
    let path = sandbox.path().join("services/replica-9.json");
    std::fs::write(&path, b"{ not json").unwrap();
    let err = o.list_services().await.unwrap_err();
    assert!(err.to_string().contains("corrupt"), "{err}");
    assert_eq!(std::fs::read(&path).unwrap(), b"{ not json");
}

#[tokio::test]
async fn a_stale_ensure_cannot_resurrect_a_service_a_newer_epoch_dropped() {
    let sandbox = Sandbox::new();
    let stale = sandbox.orchestrator(2);
    let newer = sandbox.orchestrator(3);
    stale
        .ensure_service(sleeper("replica-1", 1, 1))
        .await
        .unwrap();
    assert!(newer.drop_service("replica-1").await.unwrap());
    let err = stale
        .ensure_service(sleeper("replica-1", 1, 1))
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            EnsureError::DroppedByNewer {
                dropped_at: 3,
                ours: 2,
                ..
            }
        ),
        "{err}"
    );
    assert!(stale.list_services().await.unwrap().is_empty());
    // The same or a newer epoch may create it again.
    newer
        .ensure_service(sleeper("replica-1", 1, 1))
        .await
        .unwrap();
    assert_eq!(newer.list_services().await.unwrap().len(), 1);
    // A stale drop does not lower the tombstone.
    assert!(stale.drop_service("replica-1").await.unwrap());
    assert!(matches!(
        stale.ensure_service(sleeper("replica-1", 1, 1)).await,
        Err(EnsureError::DroppedByNewer { dropped_at: 3, .. })
    ));
    // Without the condition the stale controller resurrects it.
    let mut config = ProcessOrchestratorConfig::new(sandbox.path(), 2);
    config.conditional_writes = false;
    let unconditional = ProcessOrchestrator::new(config).unwrap();
    unconditional
        .ensure_service(sleeper("replica-1", 1, 1))
        .await
        .unwrap();
    assert_eq!(newer.list_services().await.unwrap()[0].epoch, 2);
}

/// The state letter of `/proc/PID/stat` (`T` for a stopped process).
fn proc_state(pid: u32) -> Option<char> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    s[s.rfind(')')? + 2..].chars().next()
}

fn stop(pid: u32) {
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGSTOP,
    )
    .unwrap();
}

fn pids_of(s: &ServiceStatus) -> Vec<Option<u32>> {
    s.processes.iter().map(|p| p.pid).collect()
}

fn ports_of(s: &ServiceStatus) -> Vec<u16> {
    s.processes
        .iter()
        .map(|p| p.addresses["timely"].port())
        .collect()
}

/// Restarts a service with one stopped process through `o`, and checks
/// that every process was replaced on the same ports, that the stopped one
/// is gone, and that no supervisor started anything on top.
async fn restart_with_a_stopped_process(o: &ProcessOrchestrator, victim: usize) {
    let before = o.list_services().await.unwrap().remove(0);
    let stopped = before.processes[victim].pid.unwrap();
    stop(stopped);
    eventually("the process to stop", || proc_state(stopped) == Some('T')).await;
    let mut events = o.watch_services();

    let after = o.restart_service("replica-1").await.unwrap();

    assert!(after.processes.iter().all(|p| p.running), "{after:?}");
    for (old, new) in before.processes.iter().zip(&after.processes) {
        assert_ne!(old.pid, new.pid, "process {} has a new PID", old.index);
        assert!(
            !alive(old.pid.unwrap()),
            "old process {} is gone",
            old.index
        );
        assert_eq!(new.restarts, old.restarts + 1);
    }
    assert!(!alive(stopped), "the stopped process was killed");
    assert_eq!(ports_of(&after), ports_of(&before), "the same ports");
    assert_eq!(after.labels, before.labels, "the same labels");
    let started: Vec<u32> = std::iter::from_fn(|| events.try_recv().ok())
        .filter_map(|e| match e.kind {
            ServiceEventKind::Started { pid } => Some(pid),
            _ => None,
        })
        .collect();
    assert_eq!(
        started.iter().map(|p| Some(*p)).collect::<Vec<_>>(),
        pids_of(&after)
    );
    // The supervisors see their old processes dead and must adopt the
    // replacements rather than start more.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let listed = o.list_services().await.unwrap().remove(0);
    assert_eq!(pids_of(&listed), pids_of(&after), "nothing restarted twice");
    assert!(listed.processes.iter().all(|p| p.running));
    assert_eq!(
        listed
            .processes
            .iter()
            .map(|p| p.restarts)
            .collect::<Vec<_>>(),
        after
            .processes
            .iter()
            .map(|p| p.restarts)
            .collect::<Vec<_>>()
    );
}

#[tokio::test]
async fn restarting_a_service_replaces_a_stopped_process_on_the_same_ports() {
    let sandbox = Sandbox::new();
    let first = sandbox.orchestrator(1);
    first
        .ensure_service(sleeper("replica-1", 1, 2).port("timely"))
        .await
        .unwrap();
    // Processes this orchestrator spawned.
    restart_with_a_stopped_process(&first, 0).await;
    drop(first);
    // Processes an earlier orchestrator spawned, adopted by a new one.
    let second = sandbox.orchestrator(2);
    second
        .ensure_service(sleeper("replica-1", 1, 2).port("timely"))
        .await
        .unwrap();
    restart_with_a_stopped_process(&second, 1).await;
    // And the process that crashes next is still restarted by a supervisor.
    let now = second.list_services().await.unwrap().remove(0);
    let victim = now.processes[0].pid.unwrap();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(victim as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let mut listed = now.clone();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !(listed.processes[0].running && listed.processes[0].pid != Some(victim)) {
        assert!(Instant::now() < deadline, "not restarted: {listed:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
        listed = second.list_services().await.unwrap().remove(0);
    }
    // Shared fate: the other process was replaced with it.
    let listed = settled(&second, 2).await;
    assert_ne!(listed.processes[1].pid, now.processes[1].pid);
}

#[tokio::test]
async fn restarting_an_unknown_dropped_or_newer_service_is_refused() {
    let sandbox = Sandbox::new();
    let o = sandbox.orchestrator(2);
    let err = o.restart_service("replica-9").await.unwrap_err();
    assert!(matches!(err, RestartError::NoSuchService(_)), "{err}");
    assert_eq!(err.to_string(), "no service named \"replica-9\" to restart");
    assert!(matches!(
        o.restart_service("../escape").await,
        Err(RestartError::Invalid(_))
    ));

    o.ensure_service(sleeper("replica-1", 1, 1)).await.unwrap();
    assert!(o.drop_service("replica-1").await.unwrap());
    assert!(matches!(
        o.restart_service("replica-1").await,
        Err(RestartError::NoSuchService(_))
    ));
    assert!(
        o.list_services().await.unwrap().is_empty(),
        "nothing started"
    );

    // A newer controller's service is not ours to disturb.
    let newer = sandbox.orchestrator(3);
    let s = newer
        .ensure_service(sleeper("replica-2", 2, 1))
        .await
        .unwrap();
    let err = o.restart_service("replica-2").await.unwrap_err();
    assert!(
        matches!(
            err,
            RestartError::StaleEpoch {
                stored: 3,
                ours: 2,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("another controller took over"));
    let listed = newer.list_services().await.unwrap();
    assert_eq!(pids_of(&listed[0]), pids_of(&s), "nothing was killed");
    assert!(listed[0].processes[0].running);
}

/// A process spawned by an orchestrator that was killed before it recorded
/// the PID (the window between spawn and record) escapes orphan removal and
/// holds its ports. The next orchestrator on the directory kills it when it
/// starts; what recorded processes spawned (same process group) stays.
#[tokio::test]
async fn processes_that_escaped_the_record_are_killed_when_an_orchestrator_starts() {
    let sandbox = Sandbox::new();
    let o = sandbox.orchestrator(1);
    // A recorded service whose process spawns a child of its own.
    let pidfile = sandbox.path().join("grandchild.pid");
    let config = ServiceConfig::new("replica-1", 1, "sh").fixed_args([
        "-c".to_string(),
        format!("sleep 300 & echo $! > {}; wait", pidfile.display()),
    ]);
    o.ensure_service(config).await.unwrap();
    eventually("the grandchild", || {
        std::fs::read_to_string(&pidfile).is_ok_and(|s| s.ends_with('\n'))
    })
    .await;
    let grandchild: u32 = std::fs::read_to_string(&pidfile)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    // A process as the window leaves it: spawned with the orchestrator's
    // marker, in its own process group, running a program an orchestrator
    // of the directory spawned (`sleep`, here for another service),
    // recorded nowhere.
    o.ensure_service(ServiceConfig::new("replica-2", 1, "sleep").fixed_args(["300".to_string()]))
        .await
        .unwrap();
    let (mut stray, stray_pid) = spawn_stray(&sandbox).await;
    drop(o);
    let _next = sandbox.orchestrator(2);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        // Reap it if it died (it is our child here).
        if stray.try_wait().unwrap().is_some() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the stray process {stray_pid} is still alive; strays seen now: {:?}; its stat: {:?}; marker in its environment: {:?}",
            lockstep_orchestrator::process::strays(sandbox.path()),
            std::fs::read_to_string(format!("/proc/{stray_pid}/stat")),
            std::fs::read(format!("/proc/{stray_pid}/environ")).map(|e| e
                .split(|b| *b == 0)
                .filter(|v| v.starts_with(b"LOCKSTEP_ORCHESTRATOR"))
                .map(|v| String::from_utf8_lossy(v).into_owned())
                .collect::<Vec<_>>()),
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        alive(grandchild),
        "a recorded process's child is not a stray"
    );
}

/// Anyone can put an orchestrator's marker in their own environment: a
/// process is a stray only if it runs as this user, leads its own process
/// group and runs a program an orchestrator of the directory spawned. With
/// the marker, another user's process group (led by it), a process of ours
/// in someone else's group, and one running another program all survive
/// the next orchestrator's start, which kills the real stray.
#[tokio::test]
async fn only_processes_of_this_user_that_lead_their_group_and_run_a_spawned_program_are_strays() {
    use std::os::unix::process::CommandExt;
    let sandbox = Sandbox::new();
    let o = sandbox.orchestrator(1);
    o.ensure_service(ServiceConfig::new("replica-1", 1, "sleep").fixed_args(["300".to_string()]))
        .await
        .unwrap();
    let marker = std::path::absolute(sandbox.path()).unwrap();
    let with_marker = |program: &str, args: &[&str]| {
        let mut c = std::process::Command::new(program);
        c.args(args)
            .env(lockstep_orchestrator::process::ORCHESTRATOR_ENV, &marker);
        c
    };
    let mut spared = Vec::new();
    // Another user's group leader (when this test may start one).
    if nix::unistd::geteuid().is_root() {
        let mut c = with_marker("sleep", &["300"]);
        c.uid(65534).gid(65534).process_group(0);
        spared.push(("another user's group leader", c.spawn().unwrap()));
    }
    // A process of ours that leads no group of its own (it is in this
    // test's group, which a group kill would take down).
    spared.push((
        "a process in someone else's group",
        with_marker("sleep", &["300"]).spawn().unwrap(),
    ));
    // A group leader of ours running a program no orchestrator spawned.
    let mut c = with_marker("tail", &["-f", "/dev/null"]);
    c.process_group(0);
    spared.push(("a leader running another program", c.spawn().unwrap()));
    let (mut stray, stray_pid) = spawn_stray(&sandbox).await;
    for (what, child) in &spared {
        let pid = child.id();
        eventually("the marker in its environment", || {
            std::fs::read(format!("/proc/{pid}/environ")).is_ok_and(|e| {
                e.split(|b| *b == 0)
                    .any(|v| v.starts_with(b"LOCKSTEP_ORCHESTRATOR="))
            })
        })
        .await;
        assert!(
            !lockstep_orchestrator::process::strays(sandbox.path()).contains(&pid),
            "{what} ({pid}) is taken for a stray"
        );
    }
    assert_eq!(
        lockstep_orchestrator::process::strays(sandbox.path()),
        vec![stray_pid]
    );
    drop(o);
    let _next = sandbox.orchestrator(2);
    // The real stray is killed when the next orchestrator starts (under
    // its lock, before it returns): an observable event, then the others'
    // state.
    let deadline = Instant::now() + Duration::from_secs(10);
    while stray.try_wait().unwrap().is_none() {
        assert!(Instant::now() < deadline, "the stray {stray_pid} survived");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for (what, mut child) in spared {
        assert!(
            child.try_wait().unwrap().is_none(),
            "{what} was killed as a stray"
        );
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// A process as an orchestrator killed between spawn and record leaves it:
/// spawned with the orchestrator's marker, in its own process group,
/// recorded nowhere; returned once it runs the program with that
/// environment (and is alive).
async fn spawn_stray(sandbox: &Sandbox) -> (std::process::Child, u32) {
    use std::os::unix::process::CommandExt;
    let stray = std::process::Command::new("sleep")
        .arg("300")
        .env(
            lockstep_orchestrator::process::ORCHESTRATOR_ENV,
            std::path::absolute(sandbox.path()).unwrap(),
        )
        .process_group(0)
        .spawn()
        .unwrap();
    let pid = stray.id();
    eventually("the stray to run with the marker", || {
        std::fs::read(format!("/proc/{pid}/environ")).is_ok_and(|e| {
            e.split(|b| *b == 0)
                .any(|v| v.starts_with(b"LOCKSTEP_ORCHESTRATOR="))
        })
    })
    .await;
    assert!(alive(pid));
    (stray, pid)
}

/// An orchestrator killed while it wrote a record leaves the new record in
/// `NAME.json.tmp`, never renamed: the process it names was spawned and is
/// recorded nowhere that counts. The next orchestrator must kill it (found
/// by the campaign, `log@hosts` seed 103: a process of a generation whose
/// record write was cut short by a kill -9 of the environment survived the
/// next start, held the replica's port and served the controller, while
/// the recorded processes kept failing to bind).
#[tokio::test]
async fn a_process_named_only_by_an_unfinished_record_write_is_a_stray() {
    let sandbox = Sandbox::new();
    let o = sandbox.orchestrator(1);
    o.ensure_service(ServiceConfig::new("replica-1", 1, "sleep").fixed_args(["300".to_string()]))
        .await
        .unwrap();
    let (mut stray, stray_pid) = spawn_stray(&sandbox).await;
    // The unfinished write: the new generation's record, naming the stray,
    // synced but not renamed over the record.
    let path = sandbox.path().join("services").join("replica-1.json");
    let mut record: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    record["processes"][0]["pid"] = serde_json::json!(stray_pid);
    std::fs::write(
        sandbox.path().join("services").join("replica-1.json.tmp"),
        serde_json::to_vec(&record).unwrap(),
    )
    .unwrap();
    assert!(alive(stray_pid));
    drop(o);
    let _next = sandbox.orchestrator(2);
    let deadline = Instant::now() + Duration::from_secs(10);
    while stray.try_wait().unwrap().is_none() {
        assert!(
            Instant::now() < deadline,
            "the process {stray_pid} named only by replica-1.json.tmp is still alive 10 s after the next orchestrator started; strays seen now: {:?}",
            lockstep_orchestrator::process::strays(sandbox.path()),
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A record that cannot be read now (here its environment file, a
/// directory: EISDIR; in production EMFILE) does not name no process (R1):
/// while it cannot be read, nothing is a stray, so an orchestrator starting
/// meanwhile kills neither the process it records nor, for that matter, a
/// real stray; once it can be read again, only the real stray is one.
#[tokio::test]
async fn while_a_record_cannot_be_read_no_process_is_a_stray() {
    let sandbox = Sandbox::new();
    let o = sandbox.orchestrator(1);
    let status = o
        .ensure_service(ServiceConfig::new("replica-1", 1, "sleep").fixed_args(["300".to_string()]))
        .await
        .unwrap();
    let recorded = status.processes[0].pid.unwrap();
    let (mut stray, stray_pid) = spawn_stray(&sandbox).await;
    drop(o);
    let env = sandbox.path().join("services").join("replica-1.env");
    let content = std::fs::read(&env).unwrap();
    std::fs::remove_file(&env).unwrap();
    std::fs::create_dir(&env).unwrap();
    assert_eq!(
        lockstep_orchestrator::process::strays(sandbox.path()),
        Vec::<u32>::new()
    );
    // An orchestrator started now kills nothing (it kills strays under the
    // lock before it returns).
    drop(sandbox.orchestrator(2));
    assert!(
        alive(recorded),
        "the recorded process was killed as a stray"
    );
    assert!(stray.try_wait().unwrap().is_none());
    std::fs::remove_dir(&env).unwrap();
    std::fs::write(&env, content).unwrap();
    assert_eq!(
        lockstep_orchestrator::process::strays(sandbox.path()),
        vec![stray_pid]
    );
    let _next = sandbox.orchestrator(3);
    let deadline = Instant::now() + Duration::from_secs(10);
    while stray.try_wait().unwrap().is_none() {
        assert!(Instant::now() < deadline, "the stray {stray_pid} survived");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(alive(recorded));
}
