//! The crash scenarios: `lockstep serve` crashed at a failpoint and
//! restarted, and a stale `lockstep serve` halting on its next write.

use std::collections::BTreeSet;
use std::path::Path;

use anyhow::{anyhow, bail};

use super::process::list;
use super::{check_o1_o2, cli, outcome, Backend, Outcome, Sandbox};

/// Crashes `lockstep serve` at `failpoint` during create replica (for the
/// create failpoints) or drop replica, restarts it, and checks: O1 and O2
/// against the restarted controller's catalog, and that the replica that was
/// never touched kept its processes (adopted, not restarted).
pub async fn crash_scenario(bin: &Path, rule: &str, failpoint: &str) -> Outcome {
    crash_scenario_on(Backend::Process, bin, rule, failpoint).await
}

/// [`crash_scenario`] on `backend` (on Kubernetes, `lockstep serve` reaches
/// the API double over loopback HTTP through a kubeconfig).
pub async fn crash_scenario_on(
    backend: Backend,
    bin: &Path,
    rule: &str,
    failpoint: &str,
) -> Outcome {
    outcome(crash_inner(backend, bin, rule, failpoint).await)
}

async fn crash_inner(
    backend: Backend,
    bin: &Path,
    rule: &str,
    failpoint: &str,
) -> anyhow::Result<Result<(), String>> {
    let sandbox = Sandbox::on(backend)?;
    let dropping = failpoint.contains("drop");
    // A: creates the replicas, then crashes (SIGKILL) with them running.
    let mut a = sandbox.start_env(bin, rule, None).await?;
    let ok = |o: std::process::Output, what: &str| -> anyhow::Result<()> {
        if !o.status.success() {
            bail!("{what} failed: {}", String::from_utf8_lossy(&o.stderr));
        }
        Ok(())
    };
    ok(
        cli(bin, &a.url, &["create", "keep", "--processes", "2"]).await?,
        "create keep",
    )?;
    if dropping {
        ok(
            cli(bin, &a.url, &["create", "doomed", "--processes", "2"]).await?,
            "create doomed",
        )?;
    }
    let keep_id = list(&a)
        .await?
        .iter()
        .find(|r| r.name == "keep")
        .map(|r| r.id)
        .ok_or_else(|| anyhow!("keep is not listed"))?;
    a.kill().await?;
    let keep_pids = sandbox.identities(&sandbox.services().await?, keep_id)?;

    // B: crashes at the failpoint.
    let mut b = sandbox
        .start_env(bin, rule, Some(&format!("{failpoint}=panic")))
        .await?;
    let out = if dropping {
        cli(bin, &b.url, &["drop", "doomed"]).await?
    } else {
        cli(bin, &b.url, &["create", "doomed", "--processes", "2"]).await?
    };
    let (status, stderr) = b.wait_exit().await?;
    if status.success() || out.status.success() || !stderr.contains(failpoint) {
        bail!(
            "the environment did not crash at {failpoint} (is `lockstep` built with the failpoints feature?): exit {status}, CLI {:?}; stderr:\n{stderr}",
            out.status
        );
    }

    // C: restarts; loads, ensures, removes orphans, serves.
    let c = sandbox.start_env(bin, rule, None).await?;
    let catalog = list(&c).await?;
    let services = sandbox.services().await?;
    let newest: BTreeSet<u64> = catalog.iter().map(|r| r.id).collect();
    if let Err(v) = check_o1_o2(&newest, &services) {
        return Ok(Err(format!(
            "after a crash at {failpoint} and a restart: {v}"
        )));
    }
    if !catalog.iter().any(|r| r.name == "keep") {
        return Ok(Err(format!(
            "O1: replica 'keep' vanished from the catalog after a crash at {failpoint}"
        )));
    }
    let now = sandbox.identities(&services, keep_id)?;
    if now != keep_pids {
        return Ok(Err(format!(
            "adoption: replica 'keep' was restarted instead of adopted across two controller restarts (pids {keep_pids:?} -> {now:?})"
        )));
    }
    Ok(Ok(()))
}

/// A stale `lockstep serve` halts (exits 3, saying another controller took
/// over) on its next catalog write, and the newer one is unaffected (O3).
pub async fn stale_binary_halts(bin: &Path, rule: &str) -> Outcome {
    stale_binary_halts_on(Backend::Process, bin, rule).await
}

/// [`stale_binary_halts`] on `backend`.
pub async fn stale_binary_halts_on(backend: Backend, bin: &Path, rule: &str) -> Outcome {
    outcome(stale_binary_inner(backend, bin, rule).await)
}

async fn stale_binary_inner(
    backend: Backend,
    bin: &Path,
    rule: &str,
) -> anyhow::Result<Result<(), String>> {
    let sandbox = Sandbox::on(backend)?;
    let mut a = sandbox.start_env(bin, rule, None).await?;
    let out = cli(bin, &a.url, &["create", "r1"]).await?;
    if !out.status.success() {
        bail!("create r1 failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let b = sandbox.start_env(bin, rule, None).await?;
    let out = cli(bin, &a.url, &["create", "r2"]).await?;
    if out.status.success() {
        return Ok(Err("O3: the stale controller accepted a create".into()));
    }
    let (status, stderr) = a.wait_exit().await?;
    if status.code() != Some(3) || !stderr.contains("another controller took over") {
        return Ok(Err(format!(
            "O3: the stale controller did not halt with a clear message: exit {status}; stderr:\n{stderr}"
        )));
    }
    let catalog = list(&b).await?;
    if catalog.iter().map(|r| r.name.as_str()).collect::<Vec<_>>() != ["r1"] {
        return Ok(Err(format!(
            "O3: the stale controller changed the catalog: {catalog:?}"
        )));
    }
    let newest: BTreeSet<u64> = catalog.iter().map(|r| r.id).collect();
    Ok(check_o1_o2(&newest, &sandbox.services().await?))
}
