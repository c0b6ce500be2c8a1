//! Trait-level tests of the Kubernetes backend on the in-memory API server
//! double, behind a real `kube::Client`: ensure, adopt, drop, restart, list
//! and watch, the conditional writes of O4, and the races only this backend
//! has (a delete racing a re-create, a 409 on ensure, a watch that drops).

use std::time::Duration;

use http::Method;
use lockstep_kube_double::{ApiServerDouble, Matcher};
use lockstep_orchestrator::{
    EnsureError, Orchestrator, RestartError, ServiceConfig, ServiceEventKind,
};
use lockstep_orchestrator_kubernetes::{KubernetesOrchestrator, KubernetesOrchestratorConfig};
use serde_json::json;

const NS: &str = "lockstep";

fn config(epoch: u64) -> KubernetesOrchestratorConfig {
    let mut c = KubernetesOrchestratorConfig::new(NS, epoch);
    c.environment = "test".into();
    c.ready_timeout = Duration::from_secs(2);
    c.delete_timeout = Duration::from_secs(2);
    c.poll_interval = Duration::from_millis(5);
    c.shared_fate_delay = Duration::from_millis(50);
    c
}

fn orchestrator(api: &ApiServerDouble, epoch: u64) -> KubernetesOrchestrator {
    KubernetesOrchestrator::new(api.client(NS), config(epoch))
}

fn replica(name: &str, id: u64, scale: usize) -> ServiceConfig {
    ServiceConfig::new(name, id, "/usr/local/bin/lockstep-replica")
        .scale(scale)
        .port("timely")
        .port("controller")
        .env("LOCKSTEP_SESSION_KEY", "k")
        .args(|a| {
            vec![
                format!("--process={}", a.process),
                format!("--peers={}", a.peer_addrs("timely").join(",")),
            ]
        })
}

/// The pod (and host name) of process `index` of `service`, a service of
/// `scale` processes, in `generation`: `NAME-gGENERATION-INDEX`
/// (`replica-1-g1-0`). The first generation of a new service is 1; each
/// whole restart, shared-fate restart or new spec is the next.
fn pod_name(service: &str, scale: usize, generation: u64, index: usize) -> String {
    lockstep_orchestrator_kubernetes::objects::pod_name(service, scale, generation, index)
}

/// The names of every pod in the namespace, sorted.
fn pod_names(api: &ApiServerDouble) -> Vec<String> {
    let mut names = api.names("pods", NS);
    names.sort();
    names
}

fn uid(api: &ApiServerDouble, resource: &str, name: &str) -> String {
    api.get(resource, NS, name).expect("exists")["metadata"]["uid"]
        .as_str()
        .unwrap()
        .to_string()
}

#[tokio::test]
async fn ensure_list_restart_drop_round_trip() {
    let api = ApiServerDouble::new();
    let o = orchestrator(&api, 3);
    let status = o.ensure_service(replica("replica-1", 1, 2)).await.unwrap();
    assert_eq!((status.id, status.epoch, status.processes.len()), (1, 3, 2));
    assert!(status
        .processes
        .iter()
        .all(|p| p.running && p.addresses.len() == 2));
    // Named by their generation, the first of a new service.
    assert_eq!(pod_names(&api), ["replica-1-g1-0", "replica-1-g1-1"]);
    assert!(api.get("secrets", NS, "replica-1-env").is_some());
    // The kubelet probes GET /healthz on the controller port; the process
    // logs JSON.
    let first = pod_name("replica-1", 2, 1, 0);
    let container = &api.get("pods", NS, &first).unwrap()["spec"]["containers"][0];
    for probe in ["startupProbe", "livenessProbe", "readinessProbe"] {
        assert_eq!(container[probe]["httpGet"]["path"], "/healthz", "{probe}");
        assert_eq!(container[probe]["httpGet"]["port"], "controller", "{probe}");
    }
    assert!(container["env"]
        .as_array()
        .unwrap()
        .contains(&serde_json::json!({"name": "LOCKSTEP_LOG_FORMAT", "value": "json"})));

    let listed = o.list_services().await.unwrap();
    assert_eq!(listed, vec![status.clone()]);

    let before = uid(&api, "pods", &first);
    let restarted = o.restart_service("replica-1").await.unwrap();
    // New pods, of the next generation: the old ones are gone.
    assert!(api.get("pods", NS, &first).is_none(), "the old pod is gone");
    assert_ne!(
        uid(&api, "pods", &pod_name("replica-1", 2, 2, 0)),
        before,
        "a new pod"
    );
    assert_eq!(
        pod_names(&api),
        [
            pod_name("replica-1", 2, 2, 0),
            pod_name("replica-1", 2, 2, 1)
        ]
    );
    assert!(restarted
        .processes
        .iter()
        .all(|p| p.restarts == 1 && p.running));

    assert!(o.drop_service("replica-1").await.unwrap());
    assert!(api.names("pods", NS).is_empty());
    assert!(api.get("secrets", NS, "replica-1-env").is_none());
    assert!(o.list_services().await.unwrap().is_empty());
    assert!(
        !o.drop_service("replica-1").await.unwrap(),
        "already dropped"
    );
    assert!(matches!(
        o.restart_service("replica-1").await,
        Err(RestartError::NoSuchService(_))
    ));
}

#[tokio::test]
async fn a_newer_controller_adopts_unchanged_pods_and_relabels_them() {
    let api = ApiServerDouble::new();
    orchestrator(&api, 3)
        .ensure_service(replica("replica-1", 1, 2))
        .await
        .unwrap();
    let uids: Vec<String> = (0..2)
        .map(|i| uid(&api, "pods", &pod_name("replica-1", 2, 1, i)))
        .collect();
    let status = orchestrator(&api, 4)
        .ensure_service(replica("replica-1", 1, 2))
        .await
        .unwrap();
    assert_eq!(status.epoch, 4);
    for (i, u) in uids.iter().enumerate() {
        let pod = api
            .get("pods", NS, &pod_name("replica-1", 2, 1, i))
            .unwrap();
        assert_eq!(pod["metadata"]["uid"], json!(u), "adopted, not replaced");
        assert_eq!(pod["metadata"]["labels"]["lockstep/epoch"], "4");
    }
    // A changed spec replaces the pods.
    let changed = replica("replica-1", 1, 2).env("EXTRA", "1");
    orchestrator(&api, 4).ensure_service(changed).await.unwrap();
    assert!(api
        .get("pods", NS, &pod_name("replica-1", 2, 1, 0))
        .is_none());
    assert_ne!(uid(&api, "pods", &pod_name("replica-1", 2, 2, 0)), uids[0]);
    // A smaller scale removes the extra pod.
    orchestrator(&api, 4)
        .ensure_service(replica("replica-1", 1, 1))
        .await
        .unwrap();
    // (A new template: the next generation.)
    assert_eq!(api.names("pods", NS), [pod_name("replica-1", 1, 3, 0)]);
}

#[tokio::test]
async fn ensure_is_conditional_on_the_epoch_and_on_tombstones() {
    let api = ApiServerDouble::new();
    orchestrator(&api, 5)
        .ensure_service(replica("replica-1", 1, 1))
        .await
        .unwrap();
    match orchestrator(&api, 4)
        .ensure_service(replica("replica-1", 1, 1))
        .await
    {
        Err(EnsureError::StaleEpoch {
            stored: 5, ours: 4, ..
        }) => {}
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        orchestrator(&api, 4).restart_service("replica-1").await,
        Err(RestartError::StaleEpoch {
            stored: 5,
            ours: 4,
            ..
        })
    ));
    // A drop by 6 fences 5 from re-creating it.
    orchestrator(&api, 6)
        .drop_service("replica-1")
        .await
        .unwrap();
    match orchestrator(&api, 5)
        .ensure_service(replica("replica-1", 1, 1))
        .await
    {
        Err(EnsureError::DroppedByNewer {
            dropped_at: 6,
            ours: 5,
            ..
        }) => {}
        other => panic!("{other:?}"),
    }
    assert!(api.names("pods", NS).is_empty());
    // The dropping epoch itself, or a newer one, may create it again.
    orchestrator(&api, 7)
        .ensure_service(replica("replica-1", 1, 1))
        .await
        .unwrap();
    // A drop of a service that never existed fences too.
    orchestrator(&api, 9)
        .drop_service("replica-2")
        .await
        .unwrap();
    assert!(matches!(
        orchestrator(&api, 8)
            .ensure_service(replica("replica-2", 2, 1))
            .await,
        Err(EnsureError::DroppedByNewer { dropped_at: 9, .. })
    ));
    // With conditional writes off (the negative control), the label goes back.
    let mut unconditional = config(3);
    unconditional.conditional_writes = false;
    let stale = KubernetesOrchestrator::new(api.client(NS), unconditional);
    let status = stale
        .ensure_service(replica("replica-1", 1, 1))
        .await
        .unwrap();
    assert_eq!(status.epoch, 3, "O4 broken on purpose");
}

/// Relabels object `name` with `epoch` behind the backend's back, as a newer
/// controller's write would.
fn relabel_epoch(api: &ApiServerDouble, resource: &str, name: &str, epoch: &str) {
    let mut object = api.get(resource, NS, name).unwrap();
    object["metadata"]["labels"]["lockstep/epoch"] = json!(epoch);
    api.replace(resource, NS, name, object).unwrap();
}

/// The precondition must stop a delete racing a re-create with the same
/// name: controller A (epoch 1) drops `replica-1` (one process, generation
/// 1); between its read of pod `replica-1-g1-0` and its delete, controller
/// B (epoch 2) re-creates the service (a new record and a new pod of the
/// same name).
fn race_recreate(api: &ApiServerDouble) {
    let b = api.clone();
    let name = pod_name("replica-1", 1, 1, 0);
    api.before_next(
        Matcher::new(Method::DELETE, "pods", Some(name.as_str())),
        move |_| {
            let mut record = b.get("services", NS, "replica-1").unwrap();
            let labels = &mut record["metadata"]["labels"];
            labels["lockstep/state"] = json!("live");
            labels["lockstep/epoch"] = json!("2");
            labels
                .as_object_mut()
                .unwrap()
                .remove("lockstep/dropped-by");
            b.replace("services", NS, "replica-1", record).unwrap();
            let mut pod = b.get("pods", NS, &name).unwrap();
            b.delete("pods", NS, &name).unwrap();
            pod["metadata"]["labels"]["lockstep/epoch"] = json!("2");
            for k in ["uid", "resourceVersion"] {
                pod["metadata"].as_object_mut().unwrap().remove(k);
            }
            b.create("pods", NS, pod).unwrap();
        },
    );
}

#[tokio::test]
async fn a_delete_racing_a_recreate_is_stopped_by_its_precondition() {
    let api = ApiServerDouble::new();
    orchestrator(&api, 1)
        .ensure_service(replica("replica-1", 1, 1))
        .await
        .unwrap();
    let name = pod_name("replica-1", 1, 1, 0);
    let old = uid(&api, "pods", &name);
    race_recreate(&api);
    assert!(orchestrator(&api, 1)
        .drop_service("replica-1")
        .await
        .unwrap());
    let pod = api.get("pods", NS, &name).expect("B's pod survives");
    assert_ne!(pod["metadata"]["uid"], json!(old));
    assert_eq!(pod["metadata"]["labels"]["lockstep/epoch"], "2");
    assert_eq!(
        pod_deletes(&api, &name),
        1,
        "one delete, refused; no blind retry"
    );
}

#[tokio::test]
async fn without_preconditions_the_racing_delete_removes_the_new_pod() {
    // The negative control of the test above: it must see the damage.
    let api = ApiServerDouble::new();
    orchestrator(&api, 1)
        .ensure_service(replica("replica-1", 1, 1))
        .await
        .unwrap();
    race_recreate(&api);
    let mut c = config(1);
    c.delete_preconditions = false;
    KubernetesOrchestrator::new(api.client(NS), c)
        .drop_service("replica-1")
        .await
        .unwrap();
    // The race happened (B's record is there), and its pod went.
    let record = api.get("services", NS, "replica-1").unwrap();
    assert_eq!(record["metadata"]["labels"]["lockstep/epoch"], "2");
    assert!(
        api.get("pods", NS, &pod_name("replica-1", 1, 1, 0))
            .is_none(),
        "B's new pod was deleted"
    );
}

#[tokio::test]
async fn a_409_on_ensure_is_read_again_and_decided_again() {
    let api = ApiServerDouble::new();
    orchestrator(&api, 1)
        .ensure_service(replica("replica-1", 1, 1))
        .await
        .unwrap();
    // A plain conflict: read again, write again, succeed.
    api.fail_next(
        Matcher::new(Method::PUT, "services", Some("replica-1")),
        409,
        "the object has been modified",
    );
    let status = orchestrator(&api, 2)
        .ensure_service(replica("replica-1", 1, 1))
        .await
        .unwrap();
    assert_eq!(status.epoch, 2);
    let record_calls: Vec<Method> = api
        .requests()
        .into_iter()
        .filter(|r| r.path.ends_with("/services/replica-1"))
        .map(|r| r.method)
        .collect();
    // The first ensure: read (404 then create by POST on the collection),
    // post-check read; the second: read, refused write, read again, write,
    // post-check read.
    assert_eq!(
        record_calls[record_calls.len() - 5..],
        [
            Method::GET,
            Method::PUT,
            Method::GET,
            Method::PUT,
            Method::GET
        ],
        "the refused write, a re-read, the write after it"
    );
    // A newer controller wrote between our read and our write: the CAS
    // fails on the server, the re-read shows epoch 4, and we refuse.
    let b = api.clone();
    api.before_next(
        Matcher::new(Method::PUT, "services", Some("replica-1")),
        move |_| {
            relabel_epoch(&b, "services", "replica-1", "4");
        },
    );
    match orchestrator(&api, 3)
        .ensure_service(replica("replica-1", 1, 1))
        .await
    {
        Err(EnsureError::StaleEpoch {
            stored: 4, ours: 3, ..
        }) => {}
        other => panic!("{other:?}"),
    }
    let record = api.get("services", NS, "replica-1").unwrap();
    assert_eq!(
        record["metadata"]["labels"]["lockstep/epoch"], "4",
        "O4: never back to 3"
    );
}

#[tokio::test]
async fn restart_racing_a_newer_controller_leaves_its_pod_alone() {
    let api = ApiServerDouble::new();
    orchestrator(&api, 1)
        .ensure_service(replica("replica-1", 1, 1))
        .await
        .unwrap();
    let b = api.clone();
    let pod = pod_name("replica-1", 1, 1, 0);
    api.before_next(Matcher::new(Method::DELETE, "pods", Some(&pod)), {
        let pod = pod.clone();
        move |_| {
            relabel_epoch(&b, "services", "replica-1", "2");
            relabel_epoch(&b, "pods", &pod, "2");
        }
    });
    let before = uid(&api, "pods", &pod);
    assert!(matches!(
        orchestrator(&api, 1).restart_service("replica-1").await,
        Err(RestartError::StaleEpoch {
            stored: 2,
            ours: 1,
            ..
        })
    ));
    assert_eq!(uid(&api, "pods", &pod), before, "not deleted");
}

async fn next_exit(
    events: &mut tokio::sync::broadcast::Receiver<lockstep_orchestrator::ServiceEvent>,
) -> (String, Option<usize>, String) {
    loop {
        let e = tokio::time::timeout(Duration::from_secs(5), events.recv())
            .await
            .expect("an event")
            .expect("open");
        if let ServiceEventKind::Exited { status, .. } = e.kind {
            return (e.service, e.process, status);
        }
    }
}

async fn wait_watching(api: &ApiServerDouble) {
    for _ in 0..500 {
        if api.open_watches() > 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("the backend never watched");
}

#[tokio::test]
async fn watch_reports_exits_and_survives_a_dropped_watch_and_a_compaction() {
    let api = ApiServerDouble::new();
    // The watch alone: no whole restart reads pods between the faults below.
    let mut c = config(1);
    c.shared_fate = false;
    let o = KubernetesOrchestrator::new(api.client(NS), c);
    o.ensure_service(replica("replica-1", 1, 2)).await.unwrap();
    let mut events = o.watch_services();
    wait_watching(&api).await;

    // No whole restart here: the pods stay those of the first generation.
    let pod = |i| pod_name("replica-1", 2, 1, i);
    api.restart_container(NS, &pod(1)).unwrap();
    let (service, process, status) = next_exit(&mut events).await;
    assert_eq!((service.as_str(), process), ("replica-1", Some(1)));
    assert!(status.contains("restarted"), "{status}");

    // The watch drops; a pod goes while nobody watches: the re-list sees it.
    assert_eq!(api.drop_watches(), 1);
    api.delete("pods", NS, &pod(0)).unwrap();
    let (_, process, _) = next_exit(&mut events).await;
    assert_eq!(process, Some(0));
    wait_watching(&api).await;

    // A change and a compaction before the watch is opened again from the
    // version it had seen: it gets 410 Gone, and the backend lists again,
    // which shows the change.
    let second = pod(1);
    api.before_next(Matcher::new(Method::GET, "pods", None), move |api| {
        api.delete("pods", NS, &second).unwrap();
        api.compact();
    });
    api.drop_watches();
    let (_, process, status) = next_exit(&mut events).await;
    assert_eq!(process, Some(1));
    assert!(status.contains("while the watch was down"), "{status}");
    let gone = api
        .requests()
        .iter()
        .filter(|r| r.query.contains_key("watch"))
        .count();
    assert!(gone >= 3, "watched again after the 410: {gone} watches");
}

#[tokio::test]
async fn pods_without_an_ip_are_listed_not_running_and_without_addresses() {
    let api = ApiServerDouble::new();
    api.set_kubelet(false);
    let mut c = config(1);
    c.ready_timeout = Duration::from_millis(20);
    let o = KubernetesOrchestrator::new(api.client(NS), c);
    let status = o.ensure_service(replica("replica-1", 1, 1)).await.unwrap();
    assert!(!status.processes[0].running);
    assert!(status.processes[0].addresses.is_empty());
}

#[tokio::test]
async fn invalid_names_and_foreign_objects_are_refused() {
    let api = ApiServerDouble::new();
    let o = orchestrator(&api, 1);
    assert!(matches!(
        o.ensure_service(replica("Replica_1", 1, 1)).await,
        Err(EnsureError::Invalid(_))
    ));
    assert!(matches!(
        o.ensure_service(replica("replica-1", 1, 0)).await,
        Err(EnsureError::Invalid(_))
    ));
    api.create(
        "services",
        NS,
        json!({"metadata": {"name": "someone-else"}, "spec": {}}),
    )
    .unwrap();
    assert!(matches!(
        o.ensure_service(replica("someone-else", 2, 1)).await,
        Err(EnsureError::State(_))
    ));
}

#[tokio::test]
async fn every_object_is_owned_by_the_environment_object_when_one_is_given() {
    let api = ApiServerDouble::new();
    let mut c = config(1);
    c.owner = Some(lockstep_orchestrator_kubernetes::owner_reference(
        "apps/v1",
        "Deployment",
        "lockstep-environment",
        "uid-env",
    ));
    let o = KubernetesOrchestrator::new(api.client(NS), c);
    o.ensure_service(replica("replica-1", 1, 1)).await.unwrap();
    let environment = json!({"apiVersion": "apps/v1", "kind": "Deployment", "name": "lockstep-environment",
                             "uid": "uid-env", "controller": false, "blockOwnerDeletion": false});
    for (resource, name) in [("services", "replica-1"), ("secrets", "replica-1-env")] {
        let object = api.get(resource, NS, name).unwrap();
        assert_eq!(
            object["metadata"]["ownerReferences"],
            json!([environment]),
            "{resource}/{name}"
        );
    }
    // A pod is also controlled by its service's record (so `kubectl drain`
    // evicts it).
    let record_uid = api.get("services", NS, "replica-1").unwrap()["metadata"]["uid"].clone();
    let pod = api
        .get("pods", NS, &pod_name("replica-1", 1, 1, 0))
        .unwrap();
    assert_eq!(
        pod["metadata"]["ownerReferences"],
        json!([environment, {"apiVersion": "v1", "kind": "Service", "name": "replica-1",
                             "uid": record_uid, "controller": true}])
    );
}

#[tokio::test]
async fn the_owner_is_read_from_the_named_deployment_and_a_bad_one_is_named() {
    let api = ApiServerDouble::new();
    let created = api
        .create(
            "deployments",
            NS,
            json!({"metadata": {"name": "lockstep-environment"}, "spec": {}}),
        )
        .unwrap();
    let uid = created["metadata"]["uid"].as_str().unwrap().to_string();
    let owner = lockstep_orchestrator_kubernetes::owner_of(
        api.client(NS),
        NS,
        "Deployment/lockstep-environment",
    )
    .await
    .unwrap();
    assert_eq!(
        owner,
        lockstep_orchestrator_kubernetes::owner_reference(
            "apps/v1",
            "Deployment",
            "lockstep-environment",
            &uid
        )
    );
    let missing = lockstep_orchestrator_kubernetes::owner_of(api.client(NS), NS, "Deployment/nope")
        .await
        .unwrap_err();
    assert!(missing.contains("Deployment nope"), "{missing}");
    let bad = lockstep_orchestrator_kubernetes::owner_of(api.client(NS), NS, "Service/x")
        .await
        .unwrap_err();
    assert!(bad.contains("not Deployment/NAME or Pod/NAME"), "{bad}");
    let no_pod = lockstep_orchestrator_kubernetes::owner_of(api.client(NS), NS, "Pod/x")
        .await
        .unwrap_err();
    assert!(no_pod.contains("Pod x"), "{no_pod}");
}

/// The pod of process `index` of `service`, whatever its generation, by
/// its labels; at most one (a generation's pods replace the last one's).
fn pod_of(api: &ApiServerDouble, service: &str, index: usize) -> Option<serde_json::Value> {
    let mut found: Vec<serde_json::Value> = pod_names(api)
        .iter()
        .filter_map(|n| api.get("pods", NS, n))
        .filter(|p| {
            let labels = &p["metadata"]["labels"];
            labels["lockstep/service"] == service
                && labels["lockstep/process"] == json!(index.to_string())
        })
        .collect();
    assert!(
        found.len() <= 1,
        "one pod per process of {service}: {found:#?}"
    );
    found.pop()
}

/// Each pod's (uid, `LOCKSTEP_GENERATION` of its container), by index;
/// each pod is named (and its host) by its generation.
fn pods_of(api: &ApiServerDouble, service: &str, scale: usize) -> Vec<Option<(String, String)>> {
    (0..scale)
        .map(|i| {
            let pod = pod_of(api, service, i)?;
            let generation = pod["spec"]["containers"][0]["env"]
                .as_array()?
                .iter()
                .find(|e| e["name"] == "LOCKSTEP_GENERATION")?["value"]
                .as_str()?
                .to_string();
            assert_eq!(
                pod["metadata"]["labels"]["lockstep/generation"],
                json!(generation),
                "label and env agree"
            );
            let name = pod_name(service, scale, generation.parse().unwrap(), i);
            assert_eq!(
                pod["metadata"]["name"],
                json!(name),
                "named by its generation"
            );
            assert_eq!(pod["spec"]["hostname"], json!(name));
            Some((pod["metadata"]["uid"].as_str()?.to_string(), generation))
        })
        .collect()
}

fn record_generation(api: &ApiServerDouble, service: &str) -> String {
    api.get("services", NS, service).expect("a record")["metadata"]["annotations"]
        ["lockstep/generation"]
        .as_str()
        .expect("a generation")
        .to_string()
}

/// Polls (bounded) until every pod of `service` is new (none of the uids in
/// `before`) and of `generation`; returns them.
async fn wait_replaced(
    api: &ApiServerDouble,
    service: &str,
    before: &[Option<(String, String)>],
    generation: &str,
) -> Vec<Option<(String, String)>> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let now = pods_of(api, service, before.len());
        let replaced = now.iter().all(|p| {
            p.as_ref().is_some_and(|(uid, g)| {
                g == generation
                    && !before
                        .iter()
                        .any(|b| b.as_ref().is_some_and(|(u, _)| u == uid))
            })
        });
        if replaced {
            return now;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "not every pod replaced as generation {generation} within 10 s: {now:?} (before: {before:?})"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn a_container_restart_restarts_every_pod_as_a_new_generation() {
    let api = ApiServerDouble::new();
    let o = orchestrator(&api, 1);
    o.ensure_service(replica("replica-1", 1, 3)).await.unwrap();
    let _events = o.watch_services();
    wait_watching(&api).await;
    let first = pods_of(&api, "replica-1", 3);
    assert!(
        first.iter().all(|p| p.as_ref().unwrap().1 == "1"),
        "{first:?}"
    );
    assert_eq!(record_generation(&api, "replica-1"), "1");

    // One process exits; the kubelet restarts its container in place.
    let pod = |generation, i| pod_name("replica-1", 3, generation, i);
    api.restart_container(NS, &pod(1, 1)).unwrap();
    let second = wait_replaced(&api, "replica-1", &first, "2").await;
    assert_eq!(record_generation(&api, "replica-1"), "2");

    // Two exit together: one whole restart, not two.
    api.restart_container(NS, &pod(2, 0)).unwrap();
    api.restart_container(NS, &pod(2, 2)).unwrap();
    let third = wait_replaced(&api, "replica-1", &second, "3").await;
    // Our own deletes and creates are not deaths: nothing more happens.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(pods_of(&api, "replica-1", 3), third, "no further restart");
    assert_eq!(record_generation(&api, "replica-1"), "3");

    // A pod deleted by someone else: the same.
    api.delete("pods", NS, &pod(3, 2)).unwrap();
    wait_replaced(&api, "replica-1", &third, "4").await;
}

#[tokio::test]
async fn a_shared_fate_restart_leaves_a_service_of_a_newer_epoch_alone() {
    let api = ApiServerDouble::new();
    let old = orchestrator(&api, 1);
    old.ensure_service(replica("replica-1", 1, 2))
        .await
        .unwrap();
    let _events = old.watch_services();
    wait_watching(&api).await;
    orchestrator(&api, 2)
        .ensure_service(replica("replica-1", 1, 2))
        .await
        .unwrap();
    let before = pods_of(&api, "replica-1", 2);
    assert!(before.iter().all(Option::is_some), "{before:?}");
    let n = api.requests().len();
    // Adopted, not replaced: still the first generation's pods.
    api.restart_container(NS, &pod_name("replica-1", 2, 1, 0))
        .unwrap();
    // The old controller reads the record (epoch 2) and stops there.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while !api.requests()[n..]
        .iter()
        .any(|r| r.method == Method::GET && r.path.ends_with("/services/replica-1"))
    {
        assert!(tokio::time::Instant::now() < deadline, "never checked");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(pods_of(&api, "replica-1", 2), before, "not restarted");
    assert!(
        !api.requests()[n..].iter().any(|r| r.method != Method::GET),
        "no write by the old controller"
    );
}

#[tokio::test]
async fn restart_service_deletes_every_pod_before_it_creates_any_as_a_new_generation() {
    let api = ApiServerDouble::new();
    let o = orchestrator(&api, 1);
    o.ensure_service(replica("replica-1", 1, 3)).await.unwrap();
    let before = pods_of(&api, "replica-1", 3);
    let n = api.requests().len();
    let status = o.restart_service("replica-1").await.unwrap();
    assert!(status.processes.iter().all(|p| p.restarts == 1));
    let after = wait_replaced(&api, "replica-1", &before, "2").await;
    assert_eq!(record_generation(&api, "replica-1"), "2");
    let requests = api.requests()[n..].to_vec();
    let at = |method: Method| -> Vec<usize> {
        requests
            .iter()
            .enumerate()
            .filter(|(_, r)| r.method == method && r.path.contains("/pods"))
            .map(|(i, _)| i)
            .collect()
    };
    let (deletes, creates) = (at(Method::DELETE), at(Method::POST));
    assert_eq!((deletes.len(), creates.len()), (3, 3), "{requests:#?}");
    assert!(
        deletes.iter().max() < creates.iter().min(),
        "every delete before any create: {requests:#?}"
    );
    // The generation's compare-and-swap comes first.
    let bump = requests
        .iter()
        .position(|r| r.method == Method::PUT && r.path.ends_with("/services/replica-1"))
        .expect("the record is written");
    assert!(bump < deletes[0]);
    // A newer controller adopts the new generation's pods as they are.
    orchestrator(&api, 2)
        .ensure_service(replica("replica-1", 1, 3))
        .await
        .unwrap();
    assert_eq!(pods_of(&api, "replica-1", 3), after, "adopted");
}

#[tokio::test]
async fn a_fresh_orchestrator_restarts_a_service_whose_container_restarted_while_it_was_down() {
    let api = ApiServerDouble::new();
    orchestrator(&api, 1)
        .ensure_service(replica("replica-1", 1, 3))
        .await
        .unwrap();
    let before = pods_of(&api, "replica-1", 3);
    // While no orchestrator runs, a container exits and restarts in place.
    api.restart_container(NS, &pod_name("replica-1", 3, 1, 2))
        .unwrap();
    let o = orchestrator(&api, 2);
    let _events = o.watch_services();
    wait_replaced(&api, "replica-1", &before, "2").await;
    assert_eq!(record_generation(&api, "replica-1"), "2");
}

#[tokio::test]
async fn a_fresh_orchestrator_keeps_a_service_where_nothing_died() {
    let api = ApiServerDouble::new();
    orchestrator(&api, 1)
        .ensure_service(replica("replica-1", 1, 3))
        .await
        .unwrap();
    let before = pods_of(&api, "replica-1", 3);
    assert!(before.iter().all(Option::is_some), "{before:?}");
    let n = api.requests().len();
    let o = orchestrator(&api, 2);
    let _events = o.watch_services();
    // Wait (bounded) until the startup check listed the service's pods.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while !api.requests()[n..].iter().any(|r| {
        r.method == Method::GET
            && r.query
                .get("labelSelector")
                .is_some_and(|s| s.contains("lockstep/service=replica-1"))
    }) {
        assert!(tokio::time::Instant::now() < deadline, "never checked");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(pods_of(&api, "replica-1", 3), before, "the same pods");
    assert!(
        !api.requests()[n..].iter().any(|r| r.method != Method::GET),
        "nothing written"
    );
    // And the environment's ensure at the new epoch adopts them.
    o.ensure_service(replica("replica-1", 1, 3)).await.unwrap();
    assert_eq!(pods_of(&api, "replica-1", 3), before, "adopted");
}

#[tokio::test]
async fn an_older_epoch_cannot_overwrite_the_key_secret_of_a_newer_one() {
    let api = ApiServerDouble::new();
    orchestrator(&api, 1)
        .ensure_service(replica("replica-1", 1, 1))
        .await
        .unwrap();
    // Epoch 2's ensure lands between epoch 1's record write and its Secret
    // write: the record and the Secret become epoch 2's.
    let b = api.clone();
    api.before_next(
        Matcher::new(Method::GET, "secrets", Some("replica-1-env")),
        move |_| {
            relabel_epoch(&b, "services", "replica-1", "2");
            let mut secret = b.get("secrets", NS, "replica-1-env").unwrap();
            secret["metadata"]["labels"]["lockstep/epoch"] = json!("2");
            secret["data"]["LOCKSTEP_SESSION_KEY"] = json!("ZXBvY2gtMg==");
            b.replace("secrets", NS, "replica-1-env", secret).unwrap();
        },
    );
    let changed = replica("replica-1", 1, 1).env("LOCKSTEP_SESSION_KEY", "epoch-1");
    match orchestrator(&api, 1).ensure_service(changed.clone()).await {
        Err(EnsureError::StaleEpoch {
            stored: 2, ours: 1, ..
        }) => {}
        other => panic!("{other:?}"),
    }
    let secret = api.get("secrets", NS, "replica-1-env").unwrap();
    assert_eq!(secret["data"]["LOCKSTEP_SESSION_KEY"], "ZXBvY2gtMg==");
    assert_eq!(secret["metadata"]["labels"]["lockstep/epoch"], "2");
    assert!(
        !api.requests()
            .iter()
            .any(|r| r.method == Method::PUT && r.path.ends_with("/secrets/replica-1-env")),
        "no write of the Secret by epoch 1"
    );
    // The negative control: with conditional writes off, it is overwritten.
    let mut unconditional = config(1);
    unconditional.conditional_writes = false;
    KubernetesOrchestrator::new(api.client(NS), unconditional)
        .ensure_service(changed)
        .await
        .unwrap();
    let secret = api.get("secrets", NS, "replica-1-env").unwrap();
    assert_eq!(secret["metadata"]["labels"]["lockstep/epoch"], "1");
}

#[tokio::test]
async fn every_start_gets_the_same_master_secret_created_once() {
    let api = ApiServerDouble::new();
    let first = orchestrator(&api, 1).master_secret().await.unwrap();
    let second = orchestrator(&api, 2).master_secret().await.unwrap();
    assert_eq!(first, second);
    assert_ne!(first, [0u8; 32]);
    let secret = api.get("secrets", NS, "test-master").expect("the Secret");
    assert_eq!(
        secret["metadata"]["labels"],
        json!({"app.kubernetes.io/managed-by": "lockstep", "lockstep/environment": "test"})
    );
    let creates = api
        .requests()
        .iter()
        .filter(|r| r.method == Method::POST && r.path.ends_with("/secrets"))
        .count();
    assert_eq!(creates, 1, "created once, never replaced");
    assert!(!api.requests().iter().any(|r| r.method == Method::PUT));

    // Two starts racing: another environment's create lands between our
    // read (404) and our create, which is refused (409 AlreadyExists): we
    // read theirs back and never replace it.
    let api = ApiServerDouble::new();
    let b = api.clone();
    api.before_next(Matcher::new(Method::POST, "secrets", None), move |_| {
        b.create(
            "secrets",
            NS,
            json!({"metadata": {"name": "test-master", "labels": {
                    "app.kubernetes.io/managed-by": "lockstep", "lockstep/environment": "test"}},
                   "data": {"master": base64_of(&[9; 32])}}),
        )
        .unwrap();
    });
    assert_eq!(
        orchestrator(&api, 2).master_secret().await.unwrap(),
        [9; 32]
    );
    assert!(!api.requests().iter().any(|r| r.method == Method::PUT));
}

fn base64_of(bytes: &[u8]) -> String {
    let v = serde_json::to_value(k8s_openapi::ByteString(bytes.to_vec())).unwrap();
    v.as_str().unwrap().to_string()
}

#[tokio::test]
async fn a_restart_with_the_master_secret_from_the_cluster_keeps_every_pod() {
    // The environment derives each replica's key from the master secret and
    // puts it in the replica's environment; a key that changes on a restart
    // changes the Secret and the spec hash, and so replaces every pod.
    let key = |master: [u8; 32]| {
        let mut h = blake3::Hasher::new();
        h.update(&master);
        h.update(b"replica-1");
        h.finalize().to_hex().to_string()
    };
    let api = ApiServerDouble::new();
    let first = orchestrator(&api, 1);
    let master = first.master_secret().await.unwrap();
    let service = |k: String| replica("replica-1", 1, 3).env("LOCKSTEP_SESSION_KEY", k);
    first.ensure_service(service(key(master))).await.unwrap();
    let before = pods_of(&api, "replica-1", 3);
    assert!(before.iter().all(Option::is_some), "{before:?}");
    drop(first);
    // The environment restarts (epoch 2): same master secret, same pods.
    let second = orchestrator(&api, 2);
    let master = second.master_secret().await.unwrap();
    second.ensure_service(service(key(master))).await.unwrap();
    assert_eq!(pods_of(&api, "replica-1", 3), before, "every pod kept");
    // What a master secret in an emptyDir did: a new one replaces them all.
    orchestrator(&api, 3)
        .ensure_service(service(key([7; 32])))
        .await
        .unwrap();
    wait_replaced(&api, "replica-1", &before, "2").await;
}

/// Every pod of a service, by index, as its k8s-openapi type.
fn typed_pods(
    api: &ApiServerDouble,
    service: &str,
    scale: usize,
) -> Vec<k8s_openapi::api::core::v1::Pod> {
    (0..scale)
        .map(|i| {
            let v = pod_of(api, service, i).expect("the pod exists");
            serde_json::from_value(v).expect("a valid Pod")
        })
        .collect()
}

#[tokio::test]
async fn replica_pods_have_resources_a_restricted_security_context_and_spread_over_nodes() {
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
    let api = ApiServerDouble::new();
    let o = orchestrator(&api, 1);
    o.ensure_service(replica("replica-1", 1, 2)).await.unwrap();
    let check = |pods: &[k8s_openapi::api::core::v1::Pod], cpu: &str, memory_limit: &str| {
        for pod in pods {
            let spec = pod.spec.as_ref().unwrap();
            let c = &spec.containers[0];
            // Not BestEffort: requests for CPU and memory, a memory limit.
            let r = c.resources.as_ref().expect("resources");
            let requests = r.requests.as_ref().expect("requests");
            assert_eq!(requests.get("cpu"), Some(&Quantity(cpu.into())));
            assert!(requests.contains_key("memory"), "{requests:?}");
            let limits = r.limits.as_ref().expect("limits");
            assert_eq!(limits.get("memory"), Some(&Quantity(memory_limit.into())));
            // Restricted: non-root as the image's user, no escalation,
            // every capability dropped, read-only root, seccomp.
            let psc = spec.security_context.as_ref().expect("pod securityContext");
            assert_eq!(psc.run_as_non_root, Some(true));
            assert_eq!(psc.run_as_user, Some(10001));
            assert_eq!(
                psc.seccomp_profile.as_ref().map(|s| s.type_.as_str()),
                Some("RuntimeDefault")
            );
            let sc = c
                .security_context
                .as_ref()
                .expect("container securityContext");
            assert_eq!(sc.allow_privilege_escalation, Some(false));
            assert_eq!(sc.read_only_root_filesystem, Some(true));
            assert_eq!(
                sc.capabilities.as_ref().and_then(|c| c.drop.clone()),
                Some(vec!["ALL".to_string()])
            );
            // A writable /tmp on the read-only root.
            let mounts = c.volume_mounts.as_ref().expect("mounts");
            assert!(mounts.iter().any(|m| m.mount_path == "/tmp"), "{mounts:?}");
            // Preferred anti-affinity against the service's own pods, per node.
            let terms = spec
                .affinity
                .as_ref()
                .and_then(|a| a.pod_anti_affinity.as_ref())
                .and_then(|a| {
                    a.preferred_during_scheduling_ignored_during_execution
                        .clone()
                })
                .expect("preferred pod anti-affinity");
            assert_eq!(terms.len(), 1);
            let term = &terms[0].pod_affinity_term;
            assert_eq!(term.topology_key, "kubernetes.io/hostname");
            let select = term
                .label_selector
                .as_ref()
                .and_then(|s| s.match_labels.clone())
                .expect("matchLabels");
            assert_eq!(
                select.get("lockstep/service").map(String::as_str),
                Some("replica-1")
            );
            // The selector picks every pod of the service and no other.
            let labels = pod.metadata.labels.clone().unwrap();
            assert!(select.iter().all(|(k, v)| labels.get(k) == Some(v)));
        }
    };
    check(&typed_pods(&api, "replica-1", 2), "500m", "2Gi");

    // A whole restart rebuilds the pods from the record's template: the
    // same resources.
    o.restart_service("replica-1").await.unwrap();
    check(&typed_pods(&api, "replica-1", 2), "500m", "2Gi");

    // Resources come from the configuration, and a change replaces the pods
    // (a pod's resources cannot change in place).
    let before = uid(&api, "pods", &pod_name("replica-1", 2, 2, 0));
    let mut c = config(1);
    c.resources.requests.insert("cpu".into(), "2".into());
    c.resources.limits.insert("memory".into(), "8Gi".into());
    let o = KubernetesOrchestrator::new(api.client(NS), c);
    o.ensure_service(replica("replica-1", 1, 2)).await.unwrap();
    assert!(
        api.get("pods", NS, &pod_name("replica-1", 2, 2, 0))
            .is_none(),
        "replaced"
    );
    assert_ne!(
        uid(&api, "pods", &pod_name("replica-1", 2, 3, 0)),
        before,
        "replaced"
    );
    check(&typed_pods(&api, "replica-1", 2), "2", "8Gi");
}

#[tokio::test]
async fn every_replica_has_a_disruption_budget_over_its_own_pods_dropped_with_it() {
    use k8s_openapi::api::policy::v1::PodDisruptionBudget;
    use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
    let api = ApiServerDouble::new();
    let o = orchestrator(&api, 1);
    o.ensure_service(replica("replica-1", 1, 3)).await.unwrap();
    o.ensure_service(replica("replica-2", 2, 1)).await.unwrap();
    let budget: PodDisruptionBudget = serde_json::from_value(
        api.get("poddisruptionbudgets", NS, "replica-1")
            .expect("a budget"),
    )
    .expect("a valid PodDisruptionBudget");
    let spec = budget.spec.unwrap();
    assert_eq!(
        spec.min_available,
        Some(IntOrString::Int(2)),
        "3 processes, one evicted at a time"
    );
    assert_eq!(
        spec.unhealthy_pod_eviction_policy.as_deref(),
        Some("AlwaysAllow")
    );
    let select = spec.selector.unwrap().match_labels.unwrap();
    // It selects exactly replica-1's three pods.
    let mut selected: Vec<String> = api
        .names("pods", NS)
        .into_iter()
        .filter(|p| {
            let pod = api.get("pods", NS, p).unwrap();
            select
                .iter()
                .all(|(k, v)| pod["metadata"]["labels"][k].as_str() == Some(v))
        })
        .collect();
    selected.sort();
    assert_eq!(
        selected,
        (0..3)
            .map(|i| pod_name("replica-1", 3, 1, i))
            .collect::<Vec<_>>()
    );

    // A newer controller takes it over (relabelled), an older one may not.
    let newer = orchestrator(&api, 2);
    newer
        .ensure_service(replica("replica-1", 1, 3))
        .await
        .unwrap();
    let labels = &api.get("poddisruptionbudgets", NS, "replica-1").unwrap()["metadata"]["labels"];
    assert_eq!(labels["lockstep/epoch"], "2");

    // Dropped with its service; the other replica's stays.
    assert!(newer.drop_service("replica-1").await.unwrap());
    assert!(api.get("poddisruptionbudgets", NS, "replica-1").is_none());
    assert!(api.get("poddisruptionbudgets", NS, "replica-2").is_some());
}

/// The Events on a service's record: (reason, type, message), in order.
fn events_of(api: &ApiServerDouble, service: &str) -> Vec<(String, String, String)> {
    let mut names = api.names("events", NS);
    names.sort();
    names
        .iter()
        .filter_map(|n| api.get("events", NS, n))
        .filter(|e| {
            e["involvedObject"]["kind"] == "Service" && e["involvedObject"]["name"] == service
        })
        .map(|e| {
            assert_eq!(
                e["metadata"]["labels"]["app.kubernetes.io/managed-by"],
                "lockstep"
            );
            let s = |k: &str| e[k].as_str().unwrap_or("").to_string();
            (s("reason"), s("type"), s("message"))
        })
        .collect()
}

#[tokio::test]
async fn restarts_new_generations_and_refusals_are_events_on_the_service() {
    let api = ApiServerDouble::new();
    let o = orchestrator(&api, 3);
    o.ensure_service(replica("replica-1", 1, 2)).await.unwrap();
    // Creating and adopting say nothing.
    o.ensure_service(replica("replica-1", 1, 2)).await.unwrap();
    assert_eq!(events_of(&api, "replica-1"), vec![]);

    o.restart_service("replica-1").await.unwrap();
    // A changed spec (an upgrade: other arguments) is a new generation.
    o.ensure_service(replica("replica-1", 1, 2).env("LOCKSTEP_UPGRADED", "1"))
        .await
        .unwrap();
    // An older environment's write is refused, and said so.
    let refused = orchestrator(&api, 2)
        .ensure_service(replica("replica-1", 1, 2))
        .await;
    assert!(
        matches!(refused, Err(EnsureError::StaleEpoch { .. })),
        "{refused:?}"
    );

    let seen = events_of(&api, "replica-1");
    let kinds: Vec<(&str, &str)> = seen
        .iter()
        .map(|(r, t, _)| (r.as_str(), t.as_str()))
        .collect();
    assert_eq!(
        kinds,
        [
            ("Restarted", "Normal"),
            ("NewGeneration", "Normal"),
            ("Refused", "Warning")
        ],
        "{seen:?}"
    );
    assert!(seen[0].2.contains("generation 2"), "{seen:?}");
    assert!(seen[2].2.contains("epoch 3"), "{seen:?}");
}

/// Pod `name` as a finalizer holds it after someone's delete (its node
/// lost, say): terminating (a `deletionTimestamp`, the finalizer), and
/// there. The double has no finalizers: the backend's one delete of it is
/// answered as the API server answers a delete of an object a finalizer
/// holds (200, the object stays). Returns its uid.
fn hold_terminating(api: &ApiServerDouble, name: &str) -> String {
    let mut pod = api.get("pods", NS, name).expect("the pod");
    let meta = &mut pod["metadata"];
    meta["deletionTimestamp"] = json!("2026-01-01T00:00:01Z");
    meta["deletionGracePeriodSeconds"] = json!(5);
    meta["finalizers"] = json!(["example.com/hold"]);
    api.replace("pods", NS, name, pod).unwrap();
    api.fail_next(
        Matcher::new(Method::DELETE, "pods", Some(name)),
        200,
        "held by finalizer example.com/hold",
    );
    uid(api, "pods", name)
}

/// Whether pod `name` is still there as `hold_terminating` left it.
fn still_terminating(api: &ApiServerDouble, name: &str, uid: &str) -> bool {
    api.get("pods", NS, name).is_some_and(|p| {
        p["metadata"]["uid"] == uid && p["metadata"]["deletionTimestamp"].is_string()
    })
}

/// The IP of pod `name`.
fn pod_ip(api: &ApiServerDouble, name: &str) -> std::net::IpAddr {
    api.get("pods", NS, name).expect("the pod")["status"]["podIP"]
        .as_str()
        .expect("an IP")
        .parse()
        .unwrap()
}

/// `status` is exactly the processes of `pods` (by index): their IPs, each
/// running, `restarts` each.
fn processes_are(
    api: &ApiServerDouble,
    status: &lockstep_orchestrator::ServiceStatus,
    pods: &[String],
    restarts: u32,
) {
    let got: Vec<(usize, Option<std::net::IpAddr>, bool, u32)> = status
        .processes
        .iter()
        .map(|p| {
            (
                p.index,
                p.addresses.get("timely").map(|a| a.ip()),
                p.running,
                p.restarts,
            )
        })
        .collect();
    let want: Vec<(usize, Option<std::net::IpAddr>, bool, u32)> = pods
        .iter()
        .enumerate()
        .map(|(i, p)| (i, Some(pod_ip(api, p)), true, restarts))
        .collect();
    assert_eq!(got, want, "{status:#?}");
}

#[tokio::test]
async fn a_pod_stuck_terminating_does_not_stop_a_new_generation() {
    let mut c = config(1);
    c.stuck_after = Duration::from_millis(300);
    // A wait bounded by the delete timeout alone would miss the bound below.
    c.delete_timeout = Duration::from_secs(30);
    let bound = Duration::from_secs(5);
    let (api, o, _events) = watched_pair(c).await;
    let pod = |generation, i| pod_name("replica-1", 2, generation, i);

    // Shared fate: process 0's pod of generation 1 is stuck terminating
    // when process 1's container exits.
    let stuck = hold_terminating(&api, &pod(1, 0));
    api.restart_container(NS, &pod(1, 1)).unwrap();
    let new = [pod(2, 0), pod(2, 1)];
    await_pods(&api, &new, bound, "a new generation beside the stuck pod").await;
    // Beside it, under new names; the record's generation is the new one's.
    assert!(still_terminating(&api, &pod(1, 0), &stuck));
    assert_eq!(pod_names(&api), [pod(1, 0), pod(2, 0), pod(2, 1)]);
    assert_eq!(record_generation(&api, "replica-1"), "2");
    let listed = o.list_services().await.unwrap();
    assert_eq!(listed.len(), 1);
    processes_are(&api, &listed[0], &new, 1);

    // restart_service: now process 1's pod of generation 2 is stuck.
    let stuck_2 = hold_terminating(&api, &pod(2, 1));
    let started = tokio::time::Instant::now();
    let status = tokio::time::timeout(bound, o.restart_service("replica-1"))
        .await
        .expect("restarted within the bound")
        .unwrap();
    let newer = [pod(3, 0), pod(3, 1)];
    assert!(started.elapsed() < bound);
    assert!(still_terminating(&api, &pod(1, 0), &stuck));
    assert!(still_terminating(&api, &pod(2, 1), &stuck_2));
    assert_eq!(
        pod_names(&api),
        [pod(1, 0), pod(2, 1), pod(3, 0), pod(3, 1)]
    );
    assert_eq!(record_generation(&api, "replica-1"), "3");
    processes_are(&api, &status, &newer, 2);
    let listed = o.list_services().await.unwrap();
    assert_eq!(listed, vec![status]);
    // Each stuck pod was deleted once, and not waited for again by the
    // next generation.
    for name in [pod(1, 0), pod(2, 1)] {
        assert_eq!(pod_deletes(&api, &name), 1, "{name}");
    }
}

/// How many DELETE requests for pod `name` the double received.
fn pod_deletes(api: &ApiServerDouble, name: &str) -> usize {
    api.requests()
        .iter()
        .filter(|r| r.method == Method::DELETE && r.path.ends_with(&format!("/pods/{name}")))
        .count()
}

/// A pod that begins terminating and stays (its node lost: no kubelet
/// confirms the delete, no delete event follows) is a death of its
/// generation by itself: a new generation starts beside it.
#[tokio::test]
async fn a_pod_that_begins_terminating_and_stays_is_replaced_with_its_generation() {
    let mut c = config(1);
    c.stuck_after = Duration::from_millis(300);
    let bound = Duration::from_secs(5);
    let (api, _o, _events) = watched_pair(c).await;
    let pod = |generation, i| pod_name("replica-1", 2, generation, i);
    let stuck = hold_terminating(&api, &pod(1, 0));
    let new = [pod(2, 0), pod(2, 1)];
    await_pods(
        &api,
        &new,
        bound,
        "a new generation after a pod was left terminating",
    )
    .await;
    assert!(still_terminating(&api, &pod(1, 0), &stuck));
    assert_eq!(pod_names(&api), [pod(1, 0), pod(2, 0), pod(2, 1)]);
    assert_eq!(record_generation(&api, "replica-1"), "2");
}

/// One replica runs one build: when the kubelets report that the pods of a
/// generation run images resolved to different IDs (one tag naming two
/// builds on two nodes), the generation is replaced.
#[tokio::test]
async fn a_generation_whose_pods_run_different_images_is_replaced() {
    let bound = Duration::from_secs(5);
    let (api, _o, _events) = watched_pair(config(1)).await;
    let pod = |generation, i| pod_name("replica-1", 2, generation, i);
    let report_image = |name: &str, id: &str| {
        api.update_pod_status(NS, name, |s| {
            s["containerStatuses"][0]["imageID"] = json!(id);
        })
        .unwrap();
    };
    // The same build on both: nothing to do.
    report_image(&pod(1, 0), "localhost/lockstep@sha256:aaaa");
    report_image(&pod(1, 1), "localhost/lockstep@sha256:aaaa");
    // Another build on process 1 (its container started again on a node
    // whose tag names another image): a new generation.
    let started = tokio::time::Instant::now();
    report_image(&pod(1, 1), "localhost/lockstep@sha256:bbbb");
    while record_generation(&api, "replica-1") != "2" {
        assert!(
            started.elapsed() < bound,
            "a generation of two builds was not replaced within {bound:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    await_pods(
        &api,
        &[pod(2, 0), pod(2, 1)],
        bound,
        "the new generation's pods",
    )
    .await;
}

/// A fresh double with replica-1 of two processes, ensured by an
/// orchestrator of config `c` that watches its pods.
async fn watched_pair(
    c: KubernetesOrchestratorConfig,
) -> (
    ApiServerDouble,
    KubernetesOrchestrator,
    tokio::sync::broadcast::Receiver<lockstep_orchestrator::ServiceEvent>,
) {
    let api = ApiServerDouble::new();
    let o = KubernetesOrchestrator::new(api.client(NS), c);
    o.ensure_service(replica("replica-1", 1, 2)).await.unwrap();
    let events = o.watch_services();
    wait_watching(&api).await;
    (api, o, events)
}

/// Waits until every pod in `names` exists; fails naming `what` after
/// `bound`.
async fn await_pods(api: &ApiServerDouble, names: &[String], bound: Duration, what: &str) {
    let started = tokio::time::Instant::now();
    while !names.iter().all(|p| api.get("pods", NS, p).is_some()) {
        assert!(
            started.elapsed() < bound,
            "no {what} within {bound:?}: {:?}",
            pod_names(api)
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// An environment of a new build (another image) adopts a running service
/// as it is, and moves it to its build only when it restarts it (`replica
/// upgrade`): no environment upgrade restarts every replica at once.
#[tokio::test]
async fn a_new_image_is_taken_at_a_restart_not_at_an_ensure() {
    let api = ApiServerDouble::new();
    let image = |o: &str| format!("localhost/lockstep:{o}");
    let on = |epoch, tag: &str| {
        let mut c = config(epoch);
        c.image = image(tag);
        KubernetesOrchestrator::new(api.client(NS), c)
    };
    let pod = |generation, i| pod_name("replica-1", 2, generation, i);
    let running = |name: &str| {
        let p = api.get("pods", NS, name).expect("the pod");
        (
            p["metadata"]["uid"].as_str().unwrap().to_string(),
            p["spec"]["containers"][0]["image"]
                .as_str()
                .unwrap()
                .to_string(),
        )
    };
    let old = on(1, "1.0");
    old.ensure_service(replica("replica-1", 1, 2))
        .await
        .unwrap();
    let before = [running(&pod(1, 0)), running(&pod(1, 1))];
    assert!(before.iter().all(|(_, i)| *i == image("1.0")));

    // The environment of build 2.0 adopts: the same pods, the old image.
    let new = on(2, "2.0");
    new.ensure_service(replica("replica-1", 1, 2))
        .await
        .unwrap();
    assert_eq!([running(&pod(1, 0)), running(&pod(1, 1))], before);
    assert_eq!(record_generation(&api, "replica-1"), "1");

    // Its restart is the upgrade: a new generation on 2.0.
    new.restart_service("replica-1").await.unwrap();
    for i in 0..2 {
        assert_eq!(running(&pod(2, i)).1, image("2.0"));
    }
    assert!(api.get("pods", NS, &pod(1, 0)).is_none());
    // And it is now the record's build: ensured again, adopted.
    let upgraded = [running(&pod(2, 0)), running(&pod(2, 1))];
    new.ensure_service(replica("replica-1", 1, 2))
        .await
        .unwrap();
    assert_eq!([running(&pod(2, 0)), running(&pod(2, 1))], upgraded);
    assert_eq!(record_generation(&api, "replica-1"), "2");

    // A changed spec besides the image is a new generation at the ensure,
    // on the ensuring environment's build.
    let newest = on(3, "3.0");
    newest
        .ensure_service(replica("replica-1", 1, 2).env("EXTRA", "1"))
        .await
        .unwrap();
    assert_eq!(record_generation(&api, "replica-1"), "3");
    assert_eq!(running(&pod(3, 0)).1, image("3.0"));
}
