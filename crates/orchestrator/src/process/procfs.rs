//! The operating system's view of processes: `/proc` start times (a PID
//! counts as ours only with its start time), and processes an orchestrator
//! spawned but never recorded.

use super::*;

/// The start time of a live (non-zombie) process, from `/proc/PID/stat`.
pub(super) fn proc_start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may contain spaces.
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // fields[0] is field 3 (state); field 22 (starttime) is fields[19].
    if matches!(fields.first(), Some(&"Z") | Some(&"X")) {
        return None;
    }
    fields.get(19)?.parse().ok()
}

/// Whether `pid` is alive and is the process that started at `start_time`.
pub(super) fn proc_alive(pid: u32, start_time: u64) -> bool {
    proc_start_time(pid) == Some(start_time)
}

/// The process groups of processes that carry `state_dir` in
/// [`ORCHESTRATOR_ENV`] but that no record in `state_dir/services` names.
/// Call it under the lock to act on it: a spawn and its record happen under
/// it too.
pub fn strays(state_dir: &Path) -> Vec<u32> {
    let Ok(marker) = std::path::absolute(state_dir) else {
        return Vec::new();
    };
    let needle = format!("{ORCHESTRATOR_ENV}={}", marker.display());
    let mut recorded = std::collections::BTreeSet::new();
    if let Ok(entries) = std::fs::read_dir(state_dir.join("services")) {
        for entry in entries.flatten() {
            // Only the records: not `NAME.json.tmp`, which an orchestrator
            // killed part-way through a write leaves, naming processes it
            // spawned and never recorded (they are strays).
            let path = entry.path();
            if path.extension().is_none_or(|e| e != "json") {
                continue;
            }
            if let Ok(Some(record)) = read_record(&path) {
                recorded.extend(record.processes.iter().filter_map(|p| p.pid));
            }
        }
    }
    let mut groups = std::collections::BTreeSet::new();
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
        let Ok(environ) = std::fs::read(format!("/proc/{pid}/environ")) else {
            continue;
        };
        if !environ.split(|b| *b == 0).any(|v| v == needle.as_bytes()) {
            continue;
        }
        // Field 5 of /proc/PID/stat: the process group (our processes lead
        // their own; what they spawn shares it).
        let Some(pgid) = std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|stat| {
                let rest = stat[stat.rfind(')')? + 1..].to_string();
                rest.split_whitespace().nth(2)?.parse::<u32>().ok()
            })
        else {
            continue;
        };
        if proc_start_time(pid).is_some() && !recorded.contains(&pgid) {
            groups.insert(pgid);
        }
    }
    groups.into_iter().collect()
}

/// Kills the process groups [`strays`] finds; returns how many.
pub(super) fn kill_strays(state_dir: &Path) -> usize {
    let groups = strays(state_dir);
    for &pgid in &groups {
        tracing::warn!(
            pgid,
            "killing processes that escaped the orchestrator (spawned, never recorded)"
        );
        let _ = nix::sys::signal::killpg(
            nix::unistd::Pid::from_raw(pgid as i32),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
    groups.len()
}

/// The environment variable every spawned process carries: the state
/// directory of the orchestrator that spawned it. A process that carries ours
/// but whose process group no record names escaped the orchestrator (it was
/// spawned, then the orchestrator was killed before it recorded the PID).
pub const ORCHESTRATOR_ENV: &str = "LOCKSTEP_ORCHESTRATOR";

/// The resident memory of process `pid` in MiB (0 if it is gone).
pub fn rss_mib(pid: u32) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<f64>().ok())
        })
        .map_or(0.0, |kb| kb / 1024.0)
}
