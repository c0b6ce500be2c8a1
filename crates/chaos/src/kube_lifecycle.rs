//! A replica's life on a real Kubernetes API server (`cargo xtask kube`):
//! the Kubernetes backend, acting as the shipped service account, creates a
//! 2-process service, survives a pod's death as one generation (shared
//! fate), restarts it whole, upgrades it, and drops it — each step timed
//! and checked at the objects the real server holds.
//!
//! Pods get their phase and IP from kwok (no kubelet runs, no container
//! runs): what is proven is the backend against the real API server's
//! semantics (admission with the `restricted` pod security standard, RBAC,
//! graceful deletion, resourceVersions, watches), not a running replica.
//!
//! Each step is a scenario of the reporting contract: a pass, a violation of
//! a named invariant (I2: a replica's processes are one generation; O2: a
//! dropped service's objects go), or a harness error.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use lockstep_orchestrator::{Orchestrator, ServiceConfig, ServiceStatus};
use lockstep_orchestrator_kubernetes::KubernetesOrchestrator;

use crate::environment::real_config;
use crate::environment::real_kube::RealCluster;
use crate::outcome::{violation, Failure};

/// The bound on every wait for the real server (and kwok) to settle.
const SETTLE: Duration = Duration::from_secs(60);

/// The service every step acts on.
const SERVICE: &str = "replica-1";

/// One step's result and how long it took.
pub struct Step {
    /// Its name (`create`, `shared-fate-restart`, ...).
    pub name: &'static str,
    /// Its outcome.
    pub result: Result<(), Failure>,
    /// Its wall-clock time, from the first request to the settled state.
    pub seconds: f64,
}

/// The service config of generation `version` (an upgrade changes it).
fn config(version: u32) -> ServiceConfig {
    ServiceConfig::new(SERVICE, 1, "/usr/local/bin/lockstep-replica")
        .scale(2)
        .port("timely")
        .port("controller")
        .env("LOCKSTEP_SESSION_KEY", "k")
        .args(move |a| {
            vec![
                format!("--process={}", a.process),
                format!("--peers={}", a.peer_addrs("timely").join(",")),
                format!("--build=v{version}"),
            ]
        })
}

fn harness(what: impl std::fmt::Display) -> Failure {
    Failure::Harness(what.to_string())
}

/// Runs every step in a fresh namespace of `cluster`.
pub async fn run(cluster: &RealCluster) -> Vec<Step> {
    let mut steps = Vec::new();
    let set_up = cluster.fresh_namespace().and_then(|namespace| {
        let client = cluster.client(&namespace)?;
        let config = real_config(&namespace, 1, true);
        Ok((namespace, KubernetesOrchestrator::new(client, config)))
    });
    let (namespace, orchestrator) = match set_up {
        Ok(set_up) => set_up,
        Err(e) => {
            steps.push(Step {
                name: "create",
                result: Err(harness(format!("{e:#}"))),
                seconds: 0.0,
            });
            return steps;
        }
    };
    // The pod watch and the shared-fate task run from here on.
    let _events = orchestrator.watch_services();
    let mut timed = |name: &'static str, start: Instant, result: Result<(), Failure>| {
        steps.push(Step {
            name,
            result,
            seconds: start.elapsed().as_secs_f64(),
        })
    };

    let start = Instant::now();
    let created = create(&orchestrator).await;
    timed("create", start, created);

    let start = Instant::now();
    let fate = shared_fate(cluster, &namespace, &orchestrator).await;
    timed("shared-fate-restart", start, fate);

    let start = Instant::now();
    let restarted = restart(cluster, &namespace, &orchestrator).await;
    timed("whole-replica-restart", start, restarted);

    let start = Instant::now();
    let upgraded = upgrade(cluster, &namespace, &orchestrator).await;
    timed("upgrade", start, upgraded);

    let start = Instant::now();
    let dropped = drop_all(cluster, &namespace, &orchestrator).await;
    timed("drop", start, dropped);
    steps
}

/// The uids of the service's pods, by pod name (a harness error if they
/// cannot be read).
fn uids(cluster: &RealCluster, namespace: &str) -> Result<Vec<String>, Failure> {
    cluster
        .pod_uids(namespace, SERVICE)
        .map_err(|e| harness(format!("reading the pods: {e:#}")))
}

/// `restart_service`: every pod replaced as one new generation.
async fn restart(
    cluster: &RealCluster,
    namespace: &str,
    o: &KubernetesOrchestrator,
) -> Result<(), Failure> {
    let before = uids(cluster, namespace)?;
    let status = o
        .restart_service(SERVICE)
        .await
        .map_err(|e| harness(format!("restart_service: {e}")))?;
    whole_new_generation(&before, cluster, namespace, &status, "restart")
}

fn running(status: &ServiceStatus) -> bool {
    status.processes.len() == 2
        && status
            .processes
            .iter()
            .all(|p| p.running && p.addresses.contains_key("controller"))
}

async fn create(o: &KubernetesOrchestrator) -> Result<(), Failure> {
    let status = o
        .ensure_service(config(1))
        .await
        .map_err(|e| harness(format!("ensure_service: {e}")))?;
    if !running(&status) {
        return Err(harness(format!(
            "the pods did not run with addresses within the ready timeout: {status:?}"
        )));
    }
    Ok(())
}

/// Every pod of the service replaced (no uid of `before` left) and running,
/// else an I2 violation: a replica's processes are one generation.
fn whole_new_generation(
    before: &[String],
    cluster: &RealCluster,
    namespace: &str,
    status: &ServiceStatus,
    what: &str,
) -> Result<(), Failure> {
    let after = uids(cluster, namespace)?;
    let old: BTreeSet<&String> = before.iter().collect();
    let kept: Vec<&String> = after.iter().filter(|u| old.contains(u)).collect();
    if !kept.is_empty() {
        return Err(violation(
            "I2",
            format!(
                "after the {what}, pods {kept:?} of the old generation still run beside new ones"
            ),
        ));
    }
    if after.len() != 2 || !running(status) {
        return Err(harness(format!(
            "after the {what}: {} pods, status {status:?}",
            after.len()
        )));
    }
    Ok(())
}

/// Waits until `check` holds for the listed service: the status, or
/// `None` if it did not within [`SETTLE`]. A failure to read is a harness
/// error, not a service that did not settle.
async fn settle(
    o: &KubernetesOrchestrator,
    mut check: impl FnMut(&ServiceStatus) -> Result<bool, Failure>,
) -> Result<Option<ServiceStatus>, Failure> {
    let deadline = Instant::now() + SETTLE;
    loop {
        let listed = o
            .list_services()
            .await
            .map_err(|e| harness(format!("list_services: {e}")))?;
        if let Some(s) = listed.into_iter().find(|s| s.name == SERVICE) {
            if check(&s)? {
                return Ok(Some(s));
            }
        }
        if Instant::now() > deadline {
            return Ok(None);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// One pod deleted at once (a node lost): the backend must replace both
/// pods as one new generation.
async fn shared_fate(
    cluster: &RealCluster,
    namespace: &str,
    o: &KubernetesOrchestrator,
) -> Result<(), Failure> {
    let before = uids(cluster, namespace)?;
    cluster
        .kubectl_out(&[
            "delete",
            "pod",
            "-n",
            namespace,
            "-l",
            &format!("lockstep/service={SERVICE},lockstep/process=0"),
            "--grace-period=0",
            "--force",
            "--wait=false",
        ])
        .map_err(|e| harness(format!("{e:#}")))?;
    let old: BTreeSet<String> = before.iter().cloned().collect();
    let settled = settle(o, |s| {
        if !running(s) {
            return Ok(false);
        }
        let now = uids(cluster, namespace)?;
        Ok(now.len() == 2 && now.iter().all(|u| !old.contains(u)))
    })
    .await?;
    let Some(status) = settled else {
        return Err(violation(
            "I2",
            format!(
                "a pod died and the service was not restarted as one generation within {SETTLE:?}"
            ),
        ));
    };
    whole_new_generation(&before, cluster, namespace, &status, "shared-fate restart")
}

/// A changed spec (a new build): every pod replaced by one of the new spec.
async fn upgrade(
    cluster: &RealCluster,
    namespace: &str,
    o: &KubernetesOrchestrator,
) -> Result<(), Failure> {
    let before = uids(cluster, namespace)?;
    let status = o
        .ensure_service(config(2))
        .await
        .map_err(|e| harness(format!("ensure_service (upgrade): {e}")))?;
    whole_new_generation(&before, cluster, namespace, &status, "upgrade")?;
    let pods = cluster
        .kubectl_out(&["get", "pods", "-n", namespace, "-o", "json"])
        .map_err(|e| harness(format!("{e:#}")))?;
    let old_build = pods.matches("--build=v1").count();
    if old_build > 0 {
        return Err(violation(
            "I2",
            format!("{old_build} pods still run the old build after the upgrade"),
        ));
    }
    Ok(())
}

/// The service dropped: no pod, Secret or budget of it is left (O2), only
/// its tombstone record.
async fn drop_all(
    cluster: &RealCluster,
    namespace: &str,
    o: &KubernetesOrchestrator,
) -> Result<(), Failure> {
    let dropped = o
        .drop_service(SERVICE)
        .await
        .map_err(|e| harness(format!("drop_service: {e}")))?;
    if !dropped {
        return Err(harness("drop_service found nothing to drop"));
    }
    let left = cluster
        .kubectl_out(&[
            "get",
            "pods,secrets,poddisruptionbudgets",
            "-n",
            namespace,
            "-l",
            &format!("lockstep/service={SERVICE}"),
            "-o",
            "name",
        ])
        .map_err(|e| harness(format!("{e:#}")))?;
    if !left.trim().is_empty() {
        return Err(violation(
            "O2",
            format!("objects of the dropped service remain: {}", left.trim()),
        ));
    }
    let listed = o
        .list_services()
        .await
        .map_err(|e| harness(format!("list_services: {e}")))?;
    if listed.iter().any(|s| s.name == SERVICE) {
        return Err(violation(
            "O2",
            "the dropped service is still listed".into(),
        ));
    }
    Ok(())
}
