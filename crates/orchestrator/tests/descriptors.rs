//! The supervisor while the orchestrator's process is out of file
//! descriptors (EMFILE), on a real child process: no transient error is
//! taken for a decision (R1). A service record that cannot be read now, a
//! state lock that cannot be taken now, a restart whose spawn fails now:
//! none of them means the service was dropped, so the supervisor reports
//! the failure, keeps trying, and restarts the process once descriptors are
//! back.
//!
//! Its own test binary: the descriptor limit (`RLIMIT_NOFILE`) and the
//! descriptors this test holds are process-wide, and would fail any test
//! running beside it.

use std::fs::File;
use std::path::Path;
use std::time::{Duration, Instant};

use lockstep_orchestrator::process::{
    kill_all_services, Backoff, ProcessOrchestrator, ProcessOrchestratorConfig,
};
use lockstep_orchestrator::{Orchestrator, ServiceConfig, ServiceEvent, ServiceEventKind};
use nix::sys::resource::{getrlimit, rlim_t, setrlimit, Resource};
use tokio::sync::broadcast;

/// A state directory whose services are killed when the test ends, however
/// it ends.
struct Sandbox(tempfile::TempDir);

impl Sandbox {
    fn path(&self) -> &Path {
        self.0.path()
    }
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        let _ = kill_all_services(self.path());
    }
}

/// This process out of descriptors: the soft `RLIMIT_NOFILE` lowered to a
/// little above the descriptors open now, and every descriptor below it
/// taken but `free`. Dropping it closes them and restores the limit.
struct Exhausted {
    held: Vec<File>,
    limits: (rlim_t, rlim_t),
}

impl Exhausted {
    /// Takes every descriptor but `free`: afterwards exactly `free` more
    /// can be opened, and the next one fails with EMFILE.
    fn leaving(free: usize) -> Exhausted {
        let limits = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
        let highest = std::fs::read_dir("/proc/self/fd")
            .unwrap()
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<rlim_t>().ok())
            .max()
            .unwrap_or(2);
        // Lowered, so that exhausting takes a few dozen files, not however
        // many the environment allows.
        let soft = (highest + 1 + 64).min(limits.0);
        setrlimit(Resource::RLIMIT_NOFILE, soft, limits.1).unwrap();
        let mut exhausted = Exhausted {
            held: Vec::new(),
            limits,
        };
        loop {
            match File::open("/dev/null") {
                Ok(f) => exhausted.held.push(f),
                Err(e) if e.raw_os_error() == Some(nix::errno::Errno::EMFILE as i32) => break,
                Err(e) => panic!("opening /dev/null: {e}"),
            }
        }
        assert!(
            exhausted.held.len() > free,
            "held only {} descriptors",
            exhausted.held.len()
        );
        exhausted.held.truncate(exhausted.held.len() - free);
        exhausted
    }
}

impl Drop for Exhausted {
    fn drop(&mut self) {
        self.held.clear();
        let _ = setrlimit(Resource::RLIMIT_NOFILE, self.limits.0, self.limits.1);
    }
}

/// The next event of process 0 of the service that `pick` maps to a value,
/// within 10 s (every event of process 0 before it is passed to `pick`
/// too).
async fn next_event<T>(
    events: &mut broadcast::Receiver<ServiceEvent>,
    what: &str,
    mut pick: impl FnMut(&ServiceEventKind) -> Option<T>,
) -> T {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let event = match tokio::time::timeout(left, events.recv()).await {
            Err(_) => panic!("no {what} within 10 s"),
            Ok(Err(broadcast::error::RecvError::Lagged(_))) => continue,
            Ok(Err(e)) => panic!("events: {e}"),
            Ok(Ok(e)) => e,
        };
        if event.service != "replica-1" || event.process != Some(0) {
            continue;
        }
        if let Some(found) = pick(&event.kind) {
            return found;
        }
    }
}

/// Kills the supervised process three times, each time with the
/// orchestrator's process out of descriptors in another way, and each time
/// the supervisor reports the failure, starts nothing while descriptors are
/// exhausted, keeps supervising, and restarts the process (a new PID) once
/// they are back:
///
/// - no descriptor free: the state lock cannot be taken;
/// - one free: the lock is taken, but the service record cannot be read
///   (the supervisor used to take this for a dropped service and stop
///   supervising the process for ever);
/// - two free: the record is read, but starting the process fails.
#[tokio::test]
async fn a_process_killed_while_descriptors_are_exhausted_is_restarted_once_they_are_back() {
    let sandbox = Sandbox(tempfile::tempdir().unwrap());
    let mut config = ProcessOrchestratorConfig::new(sandbox.path(), 1);
    config.backoff = Backoff {
        initial: Duration::from_millis(50),
        max: Duration::from_millis(200),
        reset_after: Duration::from_secs(10),
    };
    config.poll_interval = Duration::from_millis(20);
    let o = ProcessOrchestrator::new(config).unwrap();
    let mut events = o.watch_services();
    let status = o
        .ensure_service(ServiceConfig::new("replica-1", 1, "sleep").fixed_args(["300"]))
        .await
        .unwrap();
    let mut pid = status.processes[0].pid.unwrap();
    for (free, failure) in [
        (0, "cannot take the state lock"),
        (1, "cannot read the service record"),
        (2, "could not start"),
    ] {
        let exhausted = Exhausted::leaving(free);
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid as i32),
            nix::sys::signal::Signal::SIGKILL,
        )
        .unwrap();
        let victim = pid;
        next_event(&mut events, "exit of the killed process", |k| {
            matches!(k, ServiceEventKind::Exited { pid, .. } if *pid == victim).then_some(())
        })
        .await;
        // The supervisor decided Retry (not Stop): it reports, and starts
        // nothing while descriptors are exhausted.
        let reason = next_event(&mut events, "report of the failure", |k| match k {
            ServiceEventKind::Failed { reason } => Some(reason.clone()),
            ServiceEventKind::Started { pid } => {
                panic!("{free} descriptors free: started PID {pid} while exhausted")
            }
            _ => None,
        })
        .await;
        assert!(
            reason.contains(failure) && reason.contains("os error 24"),
            "{free} descriptors free: {reason}"
        );
        drop(exhausted);
        pid = next_event(
            &mut events,
            "restart once descriptors are back",
            |k| match k {
                ServiceEventKind::Started { pid } if *pid != victim => Some(*pid),
                _ => None,
            },
        )
        .await;
        let listed = o.list_services().await.unwrap();
        assert_eq!(listed.len(), 1, "{listed:?}");
        assert_eq!(listed[0].processes[0].pid, Some(pid), "{listed:?}");
        assert!(listed[0].processes[0].running, "{listed:?}");
    }
    assert!(o.drop_service("replica-1").await.unwrap());
}
