//! The operating system's view of processes: `/proc` start times (a PID
//! counts as ours only with its start time), and processes an orchestrator
//! spawned but never recorded.

use super::*;

use std::os::fd::OwnedFd;

/// The start time of a live (non-zombie) process, from `/proc/PID/stat`;
/// `None` also when `/proc` cannot be read now (see [`proc_start_time_now`]
/// where that matters).
pub(super) fn proc_start_time(pid: u32) -> Option<u64> {
    proc_start_time_now(pid).ok().flatten()
}

/// The start time of a live (non-zombie) process, from `/proc/PID/stat`:
/// `Ok(None)` if there is no such process (or only its zombie), `Err` if
/// `/proc` cannot be read now (EMFILE, ENOMEM, …). Not knowing is not
/// "dead" (R1): a caller that would act on a dead process tries again later.
pub(super) fn proc_start_time_now(pid: u32) -> std::io::Result<Option<u64>> {
    let stat = match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat,
        // No such process; or it was reaped between the open and the read.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) if e.raw_os_error() == Some(nix::errno::Errno::ESRCH as i32) => return Ok(None),
        Err(e) => return Err(e),
    };
    let malformed = || {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("/proc/{pid}/stat has no start time"),
        )
    };
    // The command name (field 2) is in parentheses and may contain spaces.
    let rest = &stat[stat.rfind(')').ok_or_else(malformed)? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // fields[0] is field 3 (state); field 22 (starttime) is fields[19].
    if matches!(fields.first(), Some(&"Z") | Some(&"X")) {
        return Ok(None);
    }
    let start = fields.get(19).and_then(|f| f.parse().ok());
    start.map(Some).ok_or_else(malformed)
}

/// Whether `pid` is alive and is the process that started at `start_time`;
/// `false` also when `/proc` cannot be read now (see [`proc_liveness`] where
/// that matters).
pub(super) fn proc_alive(pid: u32, start_time: u64) -> bool {
    proc_liveness(pid, start_time).unwrap_or(false)
}

/// Whether `pid` is alive and is the process that started at `start_time`,
/// or `Err` if `/proc` cannot be read now: a process we cannot see is not
/// taken for dead (R1).
pub(super) fn proc_liveness(pid: u32, start_time: u64) -> std::io::Result<bool> {
    Ok(proc_start_time_now(pid)? == Some(start_time))
}

/// The process groups of processes that escaped the orchestrators of
/// `state_dir`: processes that carry `state_dir` in [`ORCHESTRATOR_ENV`],
/// run as this process's user (real and effective uid), lead their own
/// process group (every spawned process does; what they spawn shares it and
/// goes with it), run a program [`PROGRAMS_FILE`] names (one an
/// orchestrator of `state_dir` spawned), and whose group no record in
/// `state_dir/services` names. Another user's process, or one that does not
/// lead its group, is never one: anyone can put the marker in their own
/// environment. Call it under the lock to act on it: a spawn and its record
/// happen under it too. None at all while a record, the directory of
/// records or the programs file cannot be read: a process its unreadable
/// record names is not a stray (R1).
pub fn strays(state_dir: &Path) -> Vec<u32> {
    stray_leaders(state_dir)
        .into_iter()
        .map(|s| s.pid)
        .collect()
}

/// A process [`strays`] found: it leads its group, and `pidfd` (where the
/// kernel has pidfds) was opened before it was checked.
struct Stray {
    /// Its PID, which is its group's ID.
    pid: u32,
    /// A pidfd for it, opened before its `/proc` entries were read: while
    /// it shows the process running, those reads were of this process, not
    /// of one that reused its PID.
    pidfd: Option<OwnedFd>,
}

/// [`strays`], each with its pidfd.
fn stray_leaders(state_dir: &Path) -> Vec<Stray> {
    let Ok(marker) = std::path::absolute(state_dir) else {
        return Vec::new();
    };
    let needle = format!("{ORCHESTRATOR_ENV}={}", marker.display());
    let services = state_dir.join("services");
    let (recorded, programs) = match recorded_pids(&services)
        .and_then(|recorded| Ok((recorded, spawned_programs(&services)?)))
    {
        Ok(known) => known,
        Err(e) => {
            tracing::warn!(
                "cannot read the service records now, so cannot tell strays: none killed: {e}"
            );
            return Vec::new();
        }
    };
    let uid = nix::unistd::geteuid().as_raw();
    let mut groups = std::collections::BTreeMap::new();
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    for entry in procs.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        if recorded.contains(&pid) || process_uids(pid) != Some((uid, uid)) {
            continue;
        }
        // Opened before the checks below, which then hold for this process
        // if it still runs once they are done.
        let Ok(pidfd) = pidfd(pid) else {
            continue;
        };
        if process_uids(pid) != Some((uid, uid)) {
            continue;
        }
        let Ok(environ) = std::fs::read(format!("/proc/{pid}/environ")) else {
            continue;
        };
        if !environ.split(|b| *b == 0).any(|v| v == needle.as_bytes()) {
            continue;
        }
        // Field 5 of /proc/PID/stat: the process group. Only a leader's
        // group is signalled.
        let pgid = std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|stat| {
                let rest = stat[stat.rfind(')')? + 1..].to_string();
                rest.split_whitespace().nth(2)?.parse::<u32>().ok()
            });
        if pgid != Some(pid) {
            continue;
        }
        let Some(exe) = executable_of(pid) else {
            continue;
        };
        let running = pidfd.as_ref().is_none_or(still_running);
        if programs.contains(&exe) && proc_start_time(pid).is_some() && running {
            groups.insert(pid, pidfd);
        }
    }
    groups
        .into_iter()
        .map(|(pid, pidfd)| Stray { pid, pidfd })
        .collect()
}

/// A pidfd for `pid`: `Err` if there is no such process; `Ok(None)` where
/// none can be had (a kernel before Linux 5.3, a seccomp filter that
/// refuses the call), and then the process is checked and signalled by PID
/// as before pidfds.
fn pidfd(pid: u32) -> Result<Option<OwnedFd>, rustix::io::Errno> {
    let p = i32::try_from(pid)
        .ok()
        .and_then(rustix::process::Pid::from_raw)
        .ok_or(rustix::io::Errno::SRCH)?;
    match rustix::process::pidfd_open(p, rustix::process::PidfdFlags::empty()) {
        Ok(fd) => Ok(Some(fd)),
        Err(rustix::io::Errno::SRCH) => Err(rustix::io::Errno::SRCH),
        Err(_) => Ok(None),
    }
}

/// Whether the process `pidfd` refers to has not exited (a pidfd turns
/// readable when its process exits).
fn still_running(pidfd: &OwnedFd) -> bool {
    use rustix::event::{poll, PollFd, PollFlags, Timespec};
    let mut fds = [PollFd::new(pidfd, PollFlags::IN)];
    let now = Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    matches!(poll(&mut fds, Some(&now)), Ok(0))
}

/// The real and effective uid of `pid` (`/proc/PID/status`).
fn process_uids(pid: u32) -> Option<(u32, u32)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("Uid:"))?;
    let mut ids = line.split_whitespace().skip(1).map(|f| f.parse::<u32>());
    Some((ids.next()?.ok()?, ids.next()?.ok()?))
}

/// The program `pid` runs (`/proc/PID/exe`), also when its file was
/// replaced since (a rebuild): the kernel then appends " (deleted)".
fn executable_of(pid: u32) -> Option<PathBuf> {
    let exe = std::fs::read_link(format!("/proc/{pid}/exe")).ok()?;
    let text = exe.to_str()?;
    Some(PathBuf::from(
        text.strip_suffix(" (deleted)").unwrap_or(text),
    ))
}

/// The file in the records' directory that names, one absolute path per
/// line, every program an orchestrator of the state directory spawned:
/// written before the first spawn of each, so a process spawned and never
/// recorded still runs a program it names.
pub const PROGRAMS_FILE: &str = "programs";

/// The most programs [`PROGRAMS_FILE`] is read for (a bound on a file
/// someone filled).
const MAX_PROGRAMS: usize = 1024;

/// The programs [`PROGRAMS_FILE`] in `dir` names (none if it does not
/// exist). Error: it cannot be read now.
fn spawned_programs(dir: &Path) -> Result<std::collections::BTreeSet<PathBuf>, String> {
    match std::fs::read_to_string(dir.join(PROGRAMS_FILE)) {
        Ok(text) => Ok(text.lines().take(MAX_PROGRAMS).map(PathBuf::from).collect()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Default::default()),
        Err(e) => Err(format!("{}: {e}", dir.join(PROGRAMS_FILE).display())),
    }
}

/// Adds `program` (resolved as a spawn resolves it, with its links
/// followed, as `/proc/PID/exe` shows it) to [`PROGRAMS_FILE`] in `dir`
/// unless it is there: call it before spawning it. A program that cannot be
/// resolved is not added (its spawn fails).
pub(super) fn note_program(dir: &Path, program: &Path) -> std::io::Result<()> {
    let Some(resolved) = resolve_program(program).and_then(|p| std::fs::canonicalize(p).ok())
    else {
        return Ok(());
    };
    let known = spawned_programs(dir).map_err(std::io::Error::other)?;
    if known.contains(&resolved) {
        return Ok(());
    }
    let mut file = OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o600)
        .open(dir.join(PROGRAMS_FILE))?;
    file.write_all(format!("{}\n", resolved.display()).as_bytes())?;
    file.sync_data()
}

/// The PIDs the records in `dir` name (none if there is no `dir`). Error:
/// `dir` or a record in it cannot be read now.
fn recorded_pids(dir: &Path) -> Result<std::collections::BTreeSet<u32>, String> {
    let mut recorded = std::collections::BTreeSet::new();
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(recorded),
        Err(e) => return Err(format!("{}: {e}", dir.display())),
    };
    for entry in entries {
        let path = entry.map_err(|e| format!("{}: {e}", dir.display()))?.path();
        // Only the records: not `NAME.json.tmp`, which an orchestrator
        // killed part-way through a write leaves, naming processes it
        // spawned and never recorded (they are strays).
        if path.extension().is_none_or(|e| e != "json") {
            continue;
        }
        match read_record(&path) {
            Ok(Some(record)) => recorded.extend(record.processes.iter().filter_map(|p| p.pid)),
            // Removed since it was listed.
            Ok(None) => {}
            Err(e) => return Err(e.to_string()),
        }
    }
    Ok(recorded)
}

/// Kills the process groups [`strays`] finds (each led by the stray
/// process found); returns how many.
/// A group is signalled only while its leader's pidfd (opened before it
/// was checked) shows it running, so its PID is still the checked
/// process's: what is left is the moment between that look and the
/// signal, in which the leader would have to die, be reaped, and its PID
/// be taken by a new group's leader.
pub(super) fn kill_strays(state_dir: &Path) -> usize {
    let groups = stray_leaders(state_dir);
    let mut killed = 0;
    for stray in &groups {
        if !stray.pidfd.as_ref().is_none_or(still_running) {
            continue;
        }
        tracing::warn!(
            pgid = stray.pid,
            "killing processes that escaped the orchestrator (spawned, never recorded)"
        );
        let _ = nix::sys::signal::killpg(
            nix::unistd::Pid::from_raw(stray.pid as i32),
            nix::sys::signal::Signal::SIGKILL,
        );
        killed += 1;
    }
    killed
}

/// The environment variable every spawned process carries: the state
/// directory of the orchestrator that spawned it. A process that carries ours
/// but whose process group no record names escaped the orchestrator (it was
/// spawned, then the orchestrator was killed before it recorded the PID).
pub const ORCHESTRATOR_ENV: &str = "LOCKSTEP_ORCHESTRATOR";

/// The resident memory of process `pid` in MiB (0 if it is gone).
pub fn rss_mib(pid: u32) -> f64 {
    status_mib(pid, "VmRSS:")
}

/// The peak resident memory of process `pid` in MiB (`VmHWM`; 0 if it is
/// gone).
pub fn peak_rss_mib(pid: u32) -> f64 {
    status_mib(pid, "VmHWM:")
}

/// The CPU time process `pid` has used so far, user and system
/// (fields 14 and 15 of `/proc/PID/stat`, in clock ticks: 10 ms at the
/// usual 100 Hz); `None` if it is gone.
pub fn cpu_time(pid: u32) -> Option<std::time::Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // After the command name (which may hold spaces and parentheses):
    // field 3 (the state) is the first.
    let mut fields = stat.get(stat.rfind(')')? + 2..)?.split(' ');
    let utime: u64 = fields.nth(11)?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    let hz = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .ok()
        .flatten()
        .filter(|&hz| hz > 0)? as u64;
    Some(std::time::Duration::from_millis(
        (utime + stime) * 1000 / hz,
    ))
}

/// A `kB` figure of `/proc/PID/status` (its line starting with `field`) in
/// MiB; 0 if it cannot be read.
fn status_mib(pid: u32, field: &str) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(field))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<f64>().ok())
        })
        .map_or(0.0, |kb| kb / 1024.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A process's CPU time grows as it works (within a bound however
    /// loaded the machine), and a gone one has none.
    #[test]
    fn cpu_time_counts_this_process_s_work() {
        let me = std::process::id();
        let before = cpu_time(me).expect("this process");
        let start = std::time::Instant::now();
        let mut x = 0u64;
        while cpu_time(me).expect("this process") < before + std::time::Duration::from_millis(50) {
            for _ in 0..1_000_000 {
                x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
            }
            assert!(
                start.elapsed() < std::time::Duration::from_secs(60),
                "no CPU time counted in 60 s of work"
            );
        }
        assert_eq!(cpu_time(u32::MAX), None);
    }

    /// A pidfd shows its own process running, and gone once it exits.
    #[test]
    fn a_pidfd_shows_its_process_running_then_gone() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let fd = pidfd(child.id())
            .unwrap()
            .expect("this kernel gives pidfds (Linux 5.3 or later)");
        assert!(still_running(&fd));
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(
            !still_running(&fd),
            "a pidfd of an exited process showed it running"
        );
    }
}
