//! Signals to real processes, as the fault suites send them: through the
//! `kill` command, which keeps this crate free of unsafe code.

use std::process::Stdio;

/// Sends `sig` (`SIGKILL`, `SIGSTOP`, `SIGCONT`) to `pid`.
pub fn send(pid: u32, sig: libc::c_int) -> Result<(), String> {
    if pid == 0 {
        return Err("no PID".into());
    }
    let name = match sig {
        libc::SIGKILL => "KILL",
        libc::SIGSTOP => "STOP",
        libc::SIGCONT => "CONT",
        other => return Err(format!("signal {other} is not one the suites send")),
    };
    let ok = std::process::Command::new("kill")
        .args([format!("-{name}"), pid.to_string()])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if ok {
        Ok(())
    } else {
        Err(format!("kill -{name} {pid} failed"))
    }
}
