//! The reverse of `cargo xtask upgrade`: the release's environment on the
//! catalog today's left is refused, and nothing is lost.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use super::{client, eventually, every_replica_answers, free_port, kill, serve, Server, AT_1};
use crate::util::step;

/// The reverse of an upgrade: the release's `lockstep serve` on the state
/// today's left (a catalog of a newer schema) must refuse to start, naming
/// the schema, and lose nothing: today's environment, started again on the
/// same state, adopts every replica and answers as before.
pub(super) fn reverse(
    version: &str,
    (old_lockstep, new_lockstep): (&Path, &Path),
    state: &Path,
    server: &Server,
    replica_bin: &Path,
    base: &Path,
) -> anyhow::Result<String> {
    step(&format!(
        "the reverse: {version}'s lockstep serve on today's catalog is refused"
    ));
    let log = base.join("env-reverse.log");
    let mut refused = serve(old_lockstep, state, free_port()?, replica_bin, &log)?;
    let started = Instant::now();
    let status = loop {
        if let Some(status) = refused.try_wait()? {
            break status;
        }
        if started.elapsed() > Duration::from_secs(60) {
            let _ = refused.kill();
            let _ = refused.wait();
            bail!("{version}'s lockstep serve ran on today's catalog for 60 s: not refused");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let said = std::fs::read_to_string(&log)?;
    if status.success() || !said.contains("newer than this build's") {
        bail!("{version}'s lockstep serve on today's catalog: {status}, said: {said}");
    }
    let why = said
        .lines()
        .find(|l| l.contains("newer than this build's"))
        .unwrap_or("")
        .trim()
        .to_string();

    step("nothing lost: today's lockstep serve on the same state answers as before");
    let mut again = serve(
        new_lockstep,
        state,
        server
            .url
            .rsplit(':')
            .next()
            .and_then(|p| p.parse().ok())
            .context("the server's port")?,
        replica_bin,
        &base.join("env-after-reverse.log"),
    )?;
    let checked = (|| {
        eventually(
            "today's environment serves again",
            Duration::from_secs(60),
            || client(new_lockstep, server, &["status"]),
        )?;
        every_replica_answers(
            new_lockstep,
            server,
            1,
            &AT_1,
            "the answers after the refused downgrade",
        )
    })();
    kill(again.id());
    let _ = again.wait();
    checked?;
    Ok(format!(
        "upgrade: the reverse: {version}'s lockstep serve on HEAD's catalog exited {status} ({why}); HEAD's environment then answered as before"
    ))
}
