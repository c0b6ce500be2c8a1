//! The library orphan scenarios: the seed's three-controller timeline, its
//! O4 negative control, and the stale-controller cases, each driving
//! [`Environment`](lockstep_environment::Environment)s step by step on one
//! sandbox.

use std::collections::{BTreeMap, BTreeSet};

use anyhow::anyhow;

use lockstep_environment::EnvError;

use super::{check_o1_o2, outcome, replica_config, Backend, Outcome, Sandbox};

/// Records every service's epoch label after each step and reports the first
/// label that went backwards (O4).
#[derive(Default)]
struct LabelWatch {
    max: BTreeMap<String, u64>,
    violation: Option<String>,
}

impl LabelWatch {
    async fn observe(&mut self, sandbox: &Sandbox, after: &str) -> anyhow::Result<()> {
        for s in sandbox.services().await? {
            let max = self.max.entry(s.name.clone()).or_insert(s.epoch);
            if s.epoch < *max && self.violation.is_none() {
                self.violation = Some(format!(
                    "O4: service {}'s epoch label went back from {} to {} after step '{after}'",
                    s.name, max, s.epoch
                ));
            }
            *max = (*max).max(s.epoch);
        }
        Ok(())
    }
}

/// What a step of a stale or current controller did.
enum StepResult {
    Done,
    Halted,
}

fn step<T>(result: Result<T, EnvError>) -> anyhow::Result<StepResult> {
    match result {
        Ok(_) => Ok(StepResult::Done),
        Err(EnvError::Halted(_)) => Ok(StepResult::Halted),
        Err(e) => Err(anyhow!(e)),
    }
}

/// Sets up an environment with replicas `r1` (two processes) and `r2`, then
/// makes `r2` an orphan the way a crash after the catalog transaction of drop
/// replica does: a controller drops it from the catalog and dies before the
/// orchestrator call. Returns the IDs of r1 and r2.
async fn setup_with_orphan(sandbox: &Sandbox, rule: &str) -> anyhow::Result<(u64, u64)> {
    let env0 = sandbox.load(rule, true)?;
    env0.ensure_replicas().await?;
    env0.remove_orphans().await?;
    let r1 = env0.create_replica("r1", replica_config(2)).await?;
    let r2 = env0.create_replica("r2", replica_config(1)).await?;
    drop(env0);
    let mut crashed = sandbox.open_catalog()?;
    crashed.drop_replica("r2")?;
    Ok((r1.replica.id, r2.replica.id))
}

/// The seed's three-controller timeline (PR 16114): three environments load
/// the same catalog; their ensure, remove_orphans and serve steps interleave
/// as in the PR's diagram; serving is a catalog write (create a replica).
/// Checks O1–O4 after it.
pub async fn timeline(rule: &str, conditional_writes: bool) -> Outcome {
    timeline_on(Backend::Process, rule, conditional_writes).await
}

/// [`timeline`] on `backend`.
pub async fn timeline_on(backend: Backend, rule: &str, conditional_writes: bool) -> Outcome {
    outcome(timeline_inner(backend, rule, conditional_writes).await)
}

async fn timeline_inner(
    backend: Backend,
    rule: &str,
    conditional: bool,
) -> anyhow::Result<Result<(), String>> {
    let sandbox = Sandbox::on(backend)?;
    let (_r1, orphan) = setup_with_orphan(&sandbox, rule).await?;
    let mut watch = LabelWatch::default();
    watch.observe(&sandbox, "setup").await?;
    // envd@1 loads first, so it has the lowest epoch of the three.
    let e1 = sandbox.load(rule, conditional)?;
    let e2 = sandbox.load(rule, conditional)?;
    let e3 = sandbox.load(rule, conditional)?;
    let envs = [&e1, &e2, &e3];
    let mut halted = [false; 3];
    let mut stale_writes = Vec::new();
    let mut first_violation = None;
    let steps: [(usize, &str); 9] = [
        (1, "ensure"),
        (2, "ensure"),
        (0, "ensure"),
        (2, "remove_orphans"),
        (0, "remove_orphans"),
        (2, "serve"),
        (1, "remove_orphans"),
        (0, "serve"),
        (1, "serve"),
    ];
    for (i, what) in steps {
        if halted[i] {
            continue;
        }
        let env = envs[i];
        let r = match what {
            "ensure" => step(env.ensure_replicas().await)?,
            "remove_orphans" => step(env.remove_orphans().await)?,
            _ => {
                let name = format!("created-by-epoch-{}", env.epoch());
                match env.create_replica(&name, replica_config(1)).await {
                    Ok(_) if i != 2 => {
                        stale_writes.push(format!("envd@{} created {name}", i + 1));
                        StepResult::Done
                    }
                    other => step(other)?,
                }
            }
        };
        if let StepResult::Halted = r {
            halted[i] = true;
        }
        let label = format!("envd@{} {what}", i + 1);
        watch.observe(&sandbox, &label).await?;
        // O4 and O1 after every step, so a violation names the step that
        // broke it; the first one is reported.
        if first_violation.is_none() {
            first_violation = watch.violation.clone();
        }
        if first_violation.is_none() {
            let newest: BTreeSet<u64> = e3.view().replicas.keys().copied().collect();
            let listed: BTreeSet<u64> = sandbox.services().await?.iter().map(|s| s.id).collect();
            if let Some(id) = newest.difference(&listed).next() {
                first_violation = Some(format!(
                    "O1: after step '{label}' (rule {rule}), replica {id} of the newest catalog (epoch {}) has no service",
                    e3.epoch()
                ));
            }
        }
    }
    if let Some(v) = first_violation {
        return Ok(Err(v));
    }
    let services = sandbox.services().await?;
    let newest: BTreeSet<u64> = e3.view().replicas.keys().copied().collect();
    if let Some(v) = watch.violation {
        return Ok(Err(v));
    }
    if halted[2] {
        return Ok(Err(format!(
            "O3: the newest controller (epoch {}) halted: {:?}",
            e3.epoch(),
            e3.halted()
        )));
    }
    if let Err(v) = check_o1_o2(&newest, &services) {
        return Ok(Err(v));
    }
    if services.iter().any(|s| s.id == orphan) {
        return Ok(Err(format!("O2: the orphan {orphan} survived")));
    }
    if !stale_writes.is_empty() {
        return Ok(Err(format!(
            "O3: stale controllers wrote: {}",
            stale_writes.join("; ")
        )));
    }
    if !halted[0] || !halted[1] {
        return Ok(Err(format!(
            "O3: stale controllers still running at the end (envd@1 halted: {}, envd@2 halted: {})",
            halted[0], halted[1]
        )));
    }
    Ok(Ok(()))
}

/// The negative control of conditional writes: with the condition off, the
/// timeline must show an epoch label going backwards (O4), or the harness
/// cannot see O4 violations. Passes when it does.
pub async fn o4_control(rule: &str) -> Outcome {
    o4_control_on(Backend::Process, rule).await
}

/// [`o4_control`] on `backend`.
pub async fn o4_control_on(backend: Backend, rule: &str) -> Outcome {
    match timeline_on(backend, rule, false).await {
        Outcome::Violation(v) if v.starts_with("O4") => Outcome::Pass,
        Outcome::Violation(v) => Outcome::Harness(format!(
            "with conditional writes off the timeline broke something else first: {v}"
        )),
        Outcome::Pass => Outcome::Harness(
            "with conditional writes off, no epoch label went backwards: the harness cannot see O4"
                .into(),
        ),
        h => h,
    }
}

/// The case that catches `catalog-only`: a stale controller loads its
/// catalog, a newer one opens the catalog and creates a replica, then the
/// stale one removes orphans. The newer replica must survive (O1) and the
/// stale controller must halt (O3).
pub async fn stale_loads_before_newer_creates(rule: &str) -> Outcome {
    stale_loads_before_newer_creates_on(Backend::Process, rule).await
}

/// [`stale_loads_before_newer_creates`] on `backend`.
pub async fn stale_loads_before_newer_creates_on(backend: Backend, rule: &str) -> Outcome {
    outcome(stale_loads_inner(backend, rule).await)
}

async fn stale_loads_inner(backend: Backend, rule: &str) -> anyhow::Result<Result<(), String>> {
    let sandbox = Sandbox::on(backend)?;
    let env0 = sandbox.load(rule, true)?;
    env0.create_replica("r1", replica_config(1)).await?;
    drop(env0);
    let stale = sandbox.load(rule, true)?;
    stale.ensure_replicas().await?;
    let newer = sandbox.load(rule, true)?;
    newer.ensure_replicas().await?;
    newer.remove_orphans().await?;
    let fresh = newer.create_replica("fresh", replica_config(2)).await?;
    let stale_halted = match stale.remove_orphans().await {
        Ok(_) => matches!(
            stale.create_replica("by-stale", replica_config(1)).await,
            Err(EnvError::Halted(_))
        ),
        Err(EnvError::Halted(_)) => true,
        Err(e) => return Err(e.into()),
    };
    let newest: BTreeSet<u64> = newer.view().replicas.keys().copied().collect();
    let services = sandbox.services().await?;
    if !services.iter().any(|s| s.id == fresh.replica.id) {
        return Ok(Err(format!(
            "O1: stale controller (epoch {}, rule {rule}) deleted replica 'fresh' (id {}) that the newer controller (epoch {}) created after the stale one loaded its catalog",
            stale.epoch(),
            fresh.replica.id,
            newer.epoch()
        )));
    }
    if let Err(v) = check_o1_o2(&newest, &services) {
        return Ok(Err(v));
    }
    if !stale_halted {
        return Ok(Err(format!(
            "O3: the stale controller (epoch {}) did not halt",
            stale.epoch()
        )));
    }
    Ok(Ok(()))
}

/// A stale controller loads a catalog holding `r2`; a newer one drops `r2`;
/// then the stale one ensures its replicas. It must not re-create `r2` (O4:
/// a drop is a write, and never goes back to an older controller's
/// version), and it must halt (O3); the newest state keeps O1 and O2.
pub async fn stale_cannot_resurrect(rule: &str) -> Outcome {
    stale_cannot_resurrect_on(Backend::Process, rule).await
}

/// [`stale_cannot_resurrect`] on `backend`.
pub async fn stale_cannot_resurrect_on(backend: Backend, rule: &str) -> Outcome {
    outcome(stale_resurrect_inner(backend, rule).await)
}

async fn stale_resurrect_inner(backend: Backend, rule: &str) -> anyhow::Result<Result<(), String>> {
    let sandbox = Sandbox::on(backend)?;
    let env0 = sandbox.load(rule, true)?;
    env0.create_replica("r1", replica_config(2)).await?;
    let r2 = env0.create_replica("r2", replica_config(1)).await?;
    drop(env0);
    let stale = sandbox.load(rule, true)?;
    let newer = sandbox.load(rule, true)?;
    newer.ensure_replicas().await?;
    newer.remove_orphans().await?;
    newer.drop_replica("r2").await?;
    let halted = match stale.ensure_replicas().await {
        Ok(()) => false,
        Err(EnvError::Halted(_)) => true,
        Err(e) => return Err(e.into()),
    };
    let services = sandbox.services().await?;
    if services.iter().any(|s| s.id == r2.replica.id) {
        return Ok(Err(format!(
            "O4: the stale controller (epoch {}) re-created replica r2 (id {}) that the newer controller (epoch {}) dropped",
            stale.epoch(),
            r2.replica.id,
            newer.epoch()
        )));
    }
    if !halted {
        return Ok(Err(format!(
            "O3: the stale controller (epoch {}) did not halt when its ensure was refused",
            stale.epoch()
        )));
    }
    let newest: BTreeSet<u64> = newer.view().replicas.keys().copied().collect();
    Ok(check_o1_o2(&newest, &services))
}

/// A stale controller that was overtaken halts on its next catalog write
/// and changes nothing (O3).
pub async fn stale_halts_on_write(rule: &str) -> Outcome {
    stale_halts_on_write_on(Backend::Process, rule).await
}

/// [`stale_halts_on_write`] on `backend`.
pub async fn stale_halts_on_write_on(backend: Backend, rule: &str) -> Outcome {
    outcome(stale_halts_inner(backend, rule).await)
}

async fn stale_halts_inner(backend: Backend, rule: &str) -> anyhow::Result<Result<(), String>> {
    let sandbox = Sandbox::on(backend)?;
    let a = sandbox.load(rule, true)?;
    a.ensure_replicas().await?;
    a.remove_orphans().await?;
    let r1 = a.create_replica("r1", replica_config(1)).await?;
    let b = sandbox.load(rule, true)?;
    b.ensure_replicas().await?;
    b.remove_orphans().await?;
    let before = sandbox.services().await?;
    match a.drop_replica("r1").await {
        Err(EnvError::Halted(reason)) if reason.contains("another controller took over") => {}
        Err(EnvError::Halted(reason)) => {
            return Ok(Err(format!(
                "O3: halted without saying why clearly: {reason}"
            )))
        }
        other => {
            return Ok(Err(format!(
                "O3: the stale controller's drop was not refused: {other:?}"
            )))
        }
    }
    if a.halted().is_none() {
        return Ok(Err("O3: the stale controller is not marked halted".into()));
    }
    if !matches!(a.list_replicas().await, Err(EnvError::Halted(_))) {
        return Ok(Err("O3: the halted controller still answers".into()));
    }
    let after = sandbox.services().await?;
    if before != after || !after.iter().any(|s| s.id == r1.replica.id) {
        return Ok(Err(format!(
            "O1: the stale controller's refused drop changed the services: {before:?} -> {after:?}"
        )));
    }
    let newest: BTreeSet<u64> = b.view().replicas.keys().copied().collect();
    Ok(check_o1_o2(&newest, &after))
}
