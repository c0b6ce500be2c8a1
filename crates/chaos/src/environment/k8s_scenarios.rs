//! The Kubernetes-only orphan scenarios: a delete racing a re-create, 409
//! Conflict on ensure, and dropped watches, driven through the backend on
//! the in-memory API server double.

use std::collections::BTreeSet;
use std::time::Duration;

use anyhow::anyhow;
use lockstep_orchestrator::Orchestrator;

use lockstep_kube_double::{ApiServerDouble, Matcher};
use lockstep_orchestrator_kubernetes::KubernetesOrchestrator;

use lockstep_environment::{EnvError, ServiceTemplate};

use super::{
    check_o1_o2, k8s_config, outcome, replica_config, Backend, Outcome, Sandbox, K8S_NAMESPACE,
};

/// The service of the Kubernetes-only scenarios.
fn k8s_service(id: u64) -> lockstep_orchestrator::ServiceConfig {
    lockstep_orchestrator::ServiceConfig::new(ServiceTemplate::service_name(id), id, "sleep")
        .port("timely")
        .fixed_args(["300"])
}

/// The name of the pod of process `index` of service `name` on the double
/// (pods are named by their generation too: `NAME-gGENERATION-INDEX`);
/// the newest generation's if several are there.
fn pod_of_process(api: &ApiServerDouble, name: &str, index: usize) -> String {
    let prefix = format!("{name}-g");
    let suffix = format!("-{index}");
    api.names("pods", K8S_NAMESPACE)
        .into_iter()
        .filter(|n| n.starts_with(&prefix) && n.ends_with(&suffix))
        .max_by_key(|n| {
            n[prefix.len()..n.len() - suffix.len()]
                .parse::<u64>()
                .unwrap_or(0)
        })
        .unwrap_or_else(|| format!("{name}-g?{suffix}"))
}

/// The record and pod labels of the service of `id` on the double.
fn k8s_epochs(api: &ApiServerDouble, id: u64) -> (Option<String>, Option<String>) {
    let name = ServiceTemplate::service_name(id);
    let epoch = |o: Option<serde_json::Value>| {
        o.and_then(|o| {
            o["metadata"]["labels"]["lockstep/epoch"]
                .as_str()
                .map(str::to_string)
        })
    };
    (
        epoch(api.get("services", K8S_NAMESPACE, &name)),
        epoch(api.get("pods", K8S_NAMESPACE, &pod_of_process(api, &name, 0))),
    )
}

/// Kubernetes only: a delete racing a re-create with the same name. A stale
/// controller (epoch 1) drops a service; between its read of the pod and
/// its delete, a newer controller (epoch 2) re-creates the service (a new
/// record, a new pod of the same name). The delete's preconditions (uid and
/// resourceVersion) must stop it: the newer pod survives (O1) and the
/// record keeps epoch 2 (O4).
pub async fn k8s_delete_races_recreate() -> Outcome {
    outcome(k8s_delete_races_inner().await)
}

async fn k8s_delete_races_inner() -> anyhow::Result<Result<(), String>> {
    let api = ApiServerDouble::new();
    let stale = KubernetesOrchestrator::new(api.client(K8S_NAMESPACE), k8s_config(1, true));
    stale.ensure_service(k8s_service(1)).await?;
    let name = ServiceTemplate::service_name(1);
    let b = api.clone();
    let (record_name, pod_name) = (name.clone(), pod_of_process(&api, &name, 0));
    api.before_next(
        Matcher::new(http::Method::DELETE, "pods", Some(&pod_name)),
        move |_| {
            // The newer controller's ensure, as its requests would leave it.
            let Some(mut record) = b.get("services", K8S_NAMESPACE, &record_name) else {
                return;
            };
            let labels = &mut record["metadata"]["labels"];
            labels["lockstep/state"] = serde_json::json!("live");
            labels["lockstep/epoch"] = serde_json::json!("2");
            if let Some(l) = labels.as_object_mut() {
                l.remove("lockstep/dropped-by");
            }
            let _ = b.replace("services", K8S_NAMESPACE, &record_name, record);
            if let Some(mut pod) = b.get("pods", K8S_NAMESPACE, &pod_name) {
                let _ = b.delete("pods", K8S_NAMESPACE, &pod_name);
                pod["metadata"]["labels"]["lockstep/epoch"] = serde_json::json!("2");
                if let Some(m) = pod["metadata"].as_object_mut() {
                    m.remove("uid");
                    m.remove("resourceVersion");
                }
                let _ = b.create("pods", K8S_NAMESPACE, pod);
            }
        },
    );
    stale.drop_service(&name).await?;
    match k8s_epochs(&api, 1) {
        (Some(r), Some(p)) if r == "2" && p == "2" => Ok(Ok(())),
        (r, None) => Ok(Err(format!(
            "O1: the stale controller's delete removed the pod the newer controller (epoch 2) re-created (record epoch {r:?})"
        ))),
        (r, p) => Ok(Err(format!(
            "O4: after the race the record says epoch {r:?} and the pod {p:?}, not 2"
        ))),
    }
}

/// Kubernetes only: 409 Conflict on ensure. A newer environment's ensure
/// meets a plain 409 on its record write (it must read again and succeed,
/// not fail or halt); then a stale environment's ensure loses the
/// compare-and-swap to a write of the newer epoch between its read and its
/// write (it must read again, refuse and halt: O3), and the record's epoch
/// never goes back (O4). O1 and O2 hold for the newest catalog.
pub async fn k8s_conflict_on_ensure(rule: &str) -> Outcome {
    outcome(k8s_conflict_inner(rule).await)
}

async fn k8s_conflict_inner(rule: &str) -> anyhow::Result<Result<(), String>> {
    let api = ApiServerDouble::new();
    let sandbox = Sandbox::on(Backend::Kubernetes(api.clone()))?;
    let env0 = sandbox.load(rule, true)?;
    let r1 = env0
        .create_replica("r1", replica_config(2))
        .await?
        .replica
        .id;
    drop(env0);
    let name = ServiceTemplate::service_name(r1);
    let stale = sandbox.load(rule, true)?;
    let newer = sandbox.load(rule, true)?;
    // The stale ensure reads the record (epoch of env0), then the newer
    // controller's write lands before the stale one's compare-and-swap.
    let b = api.clone();
    let record_name = name.clone();
    let newer_epoch = newer.epoch().to_string();
    let epoch = newer_epoch.clone();
    api.before_next(
        Matcher::new(http::Method::PUT, "services", Some(&name)),
        move |_| {
            if let Some(mut record) = b.get("services", K8S_NAMESPACE, &record_name) {
                record["metadata"]["labels"]["lockstep/epoch"] = serde_json::json!(epoch);
                let _ = b.replace("services", K8S_NAMESPACE, &record_name, record);
            }
        },
    );
    let stale_halted = matches!(stale.ensure_replicas().await, Err(EnvError::Halted(_)));
    let (record_epoch, _) = k8s_epochs(&api, r1);
    if record_epoch.as_deref() != Some(newer_epoch.as_str()) {
        return Ok(Err(format!(
            "O4: the record's epoch is {record_epoch:?} after the stale ensure (epoch {}) lost the race, not {newer_epoch}",
            stale.epoch()
        )));
    }
    if !stale_halted {
        return Ok(Err(format!(
            "O3: the stale controller (epoch {}) did not halt after losing the compare-and-swap",
            stale.epoch()
        )));
    }
    // A plain 409 on the newest controller's write: read again, write again.
    api.fail_next(
        Matcher::new(http::Method::PUT, "services", Some(&name)),
        409,
        "the object has been modified; please apply your changes to the latest version and try again",
    );
    match newer.ensure_replicas().await {
        Ok(()) => {}
        Err(EnvError::Halted(h)) => {
            return Ok(Err(format!(
                "O3: the newest controller halted on a plain 409 instead of reading again: {h}"
            )))
        }
        Err(e) => return Err(e.into()),
    }
    newer.remove_orphans().await?;
    let newest: BTreeSet<u64> = newer.view().replicas.keys().copied().collect();
    Ok(check_o1_o2(&newest, &sandbox.services().await?))
}

/// Kubernetes only: the watch drops. The API server ends the backend's pod
/// watch, a pod goes while nobody watches, then the same with an etcd
/// compaction between the re-list and the re-watch (410 Gone). Each exit
/// must still be reported (the liveness of what the environment learns
/// from the orchestrator, I2), and the service must still be listed (O1).
pub async fn k8s_watch_drops() -> Outcome {
    outcome(k8s_watch_inner().await)
}

async fn k8s_watch_inner() -> anyhow::Result<Result<(), String>> {
    let api = ApiServerDouble::new();
    let o = KubernetesOrchestrator::new(api.client(K8S_NAMESPACE), k8s_config(1, true));
    o.ensure_service(k8s_service(1).scale(2)).await?;
    let mut events = o.watch_services();
    let watching = |api: &ApiServerDouble| {
        let api = api.clone();
        async move {
            for _ in 0..1000 {
                if api.open_watches() > 0 {
                    return Ok(());
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            Err(anyhow!("the backend never watched"))
        }
    };
    watching(&api).await?;
    let name = ServiceTemplate::service_name(1);
    api.drop_watches();
    api.delete("pods", K8S_NAMESPACE, &pod_of_process(&api, &name, 0))
        .map_err(|e| anyhow!(e))?;
    if !exit_reported(&mut events, &name, 0).await {
        return Ok(Err(
            "I2: a pod deleted while the watch was down was never reported".into(),
        ));
    }
    watching(&api).await?;
    let pod1 = pod_of_process(&api, &name, 1);
    api.before_next(Matcher::new(http::Method::GET, "pods", None), |_| {});
    api.before_next(Matcher::new(http::Method::GET, "pods", None), move |api| {
        let _ = api.delete("pods", K8S_NAMESPACE, &pod1);
        api.compact();
    });
    api.drop_watches();
    if !exit_reported(&mut events, &name, 1).await {
        return Ok(Err(
            "I2: a pod deleted before a 410 Gone watch was never reported".into(),
        ));
    }
    if !o.list_services().await?.iter().any(|s| s.name == name) {
        return Ok(Err(format!(
            "O1: {name} is no longer listed after the watch dropped"
        )));
    }
    Ok(Ok(()))
}

/// Whether an `Exited` event of `service`'s process `process` arrives
/// within 5 s.
async fn exit_reported(
    events: &mut tokio::sync::broadcast::Receiver<lockstep_orchestrator::ServiceEvent>,
    service: &str,
    process: usize,
) -> bool {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        match tokio::time::timeout(left, events.recv()).await {
            Err(_) | Ok(Err(tokio::sync::broadcast::error::RecvError::Closed)) => return false,
            Ok(Err(_)) => continue,
            Ok(Ok(e)) => {
                if e.service == service
                    && e.process == Some(process)
                    && matches!(
                        e.kind,
                        lockstep_orchestrator::ServiceEventKind::Exited { .. }
                    )
                {
                    return true;
                }
            }
        }
    }
}
