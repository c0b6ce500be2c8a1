//! What `cargo xtask test` must not leave running when it ends: processes
//! of its own making that outlived the step that started them (a
//! throw-away PostgreSQL server whose owner was killed, a `lockstep serve`
//! or replica process of a suite). Found in `/proc` by what marks them as
//! ours, never by name alone: PostgreSQL with its data directory in a
//! `lockstep-pg-` temporary directory (`lockstep-pgtest`), and programs run
//! from this target directory. Each is killed and named, and the run fails.

use std::path::{Path, PathBuf};

use anyhow::bail;

use crate::util::{step, target_dir};

/// A process of this run's making that is still running.
#[derive(Debug)]
struct Leftover {
    pid: i32,
    command: String,
}

/// Every leftover, by its command line.
fn find(target: &Path) -> Vec<Leftover> {
    let me = std::process::id() as i32;
    let mut found = Vec::new();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return found;
    };
    for entry in entries.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|p| p.parse::<i32>().ok())
        else {
            continue;
        };
        if pid == me {
            continue;
        }
        let Ok(raw) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let args: Vec<String> = raw
            .split(|b| *b == 0)
            .filter(|a| !a.is_empty())
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        let Some(program) = args.first() else {
            continue;
        };
        let exe: Option<PathBuf> = std::fs::read_link(entry.path().join("exe")).ok();
        let ours = postgres_of_pgtest(program, &args)
            || exe
                .as_deref()
                .is_some_and(|e| e.starts_with(target) && !e.ends_with("xtask"));
        if ours {
            found.push(Leftover {
                pid,
                command: args.join(" "),
            });
        }
    }
    found
}

/// A PostgreSQL server (`postgres -D DIR ...`) of `lockstep-pgtest`, whose
/// data directory is in a `lockstep-pg-` temporary directory.
fn postgres_of_pgtest(program: &str, args: &[String]) -> bool {
    Path::new(program)
        .file_name()
        .is_some_and(|n| n == "postgres")
        && args
            .windows(2)
            .any(|w| w[0] == "-D" && w[1].contains("/lockstep-pg-"))
}

/// Kills and names every leftover; an error if there was one.
pub fn check() -> anyhow::Result<()> {
    step("nothing of the run left running");
    let target = std::fs::canonicalize(target_dir()).unwrap_or_else(|_| target_dir());
    let found = find(&target);
    if found.is_empty() {
        eprintln!("xtask: nothing left running");
        return Ok(());
    }
    for l in &found {
        eprintln!("xtask: left running: pid {} {}", l.pid, l.command);
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(l.pid),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
    bail!(
        "{} process(es) of this run were still running at its end (killed now): a step leaks them",
        found.len()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pgtest_server_is_told_from_another_postgres() {
        let args = |s: &str| s.split(' ').map(String::from).collect::<Vec<_>>();
        let ours = args("/usr/lib/postgresql/15/bin/postgres -D /tmp/lockstep-pg-abc/data -p 5");
        assert!(postgres_of_pgtest(&ours[0], &ours));
        let theirs = args("/usr/lib/postgresql/15/bin/postgres -D /var/lib/postgresql/15/main");
        assert!(!postgres_of_pgtest(&theirs[0], &theirs));
        let other = args("/usr/bin/psql -D /tmp/lockstep-pg-abc/data");
        assert!(!postgres_of_pgtest(&other[0], &other));
    }
}
