//! Request-level tests: a `tower-test` mock stands where the API server is,
//! behind a real `kube::Client`. Each test asserts the exact HTTP requests
//! the backend sends (method, path, query, body: labels, preconditions) and
//! answers them with real API responses, 409 Conflict included.

use std::sync::Arc;

use http::{Method, Request, Response, StatusCode};
use lockstep_orchestrator::{EnsureError, Orchestrator, RestartError, ServiceConfig};
use lockstep_orchestrator_kubernetes::{KubernetesOrchestrator, KubernetesOrchestratorConfig};
use serde_json::{json, Value};
use tower_test::mock::{Handle, SendResponse};

type Mock = Handle<Request<kube::client::Body>, Response<kube::client::Body>>;

const NS: &str = "lockstep";
const SELECTOR: &str = "app.kubernetes.io/managed-by=lockstep,lockstep/environment=test";

fn orchestrator(epoch: u64) -> (Arc<KubernetesOrchestrator>, Mock) {
    let (service, handle) =
        tower_test::mock::pair::<Request<kube::client::Body>, Response<kube::client::Body>>();
    let client = kube::Client::new(service, NS);
    let mut config = KubernetesOrchestratorConfig::new(NS, epoch);
    config.environment = "test".into();
    config.image = "lockstep:test".into();
    config.ready_timeout = std::time::Duration::from_millis(0);
    config.poll_interval = std::time::Duration::from_millis(1);
    (
        Arc::new(KubernetesOrchestrator::new(client, config)),
        handle,
    )
}

fn replica(scale: usize) -> ServiceConfig {
    ServiceConfig::new("replica-5", 5, "/usr/local/bin/lockstep-replica")
        .scale(scale)
        .port("timely")
        .port("controller")
        .label("replica-name", "r1")
        .env("LOCKSTEP_SESSION_KEY", "c2VjcmV0")
        .args(|a| {
            vec![
                format!("--process={}", a.process),
                format!("--timely-port={}", a.port("timely")),
                format!("--peers={}", a.peer_addrs("timely").join(",")),
            ]
        })
}

fn decode(q: &str) -> Vec<(String, String)> {
    q.split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            let d = |s: &str| {
                let mut out = Vec::new();
                let b = s.as_bytes();
                let mut i = 0;
                while i < b.len() {
                    if b[i] == b'%' {
                        out.push(
                            u8::from_str_radix(std::str::from_utf8(&b[i + 1..i + 3]).unwrap(), 16)
                                .unwrap(),
                        );
                        i += 3;
                    } else {
                        out.push(b[i]);
                        i += 1;
                    }
                }
                String::from_utf8(out).unwrap()
            };
            (d(k), d(v))
        })
        .collect()
}

/// The next request: asserts its method, path and decoded query; returns
/// its JSON body and the responder.
async fn expect(
    mock: &mut Mock,
    method: Method,
    path: &str,
    query: &[(&str, &str)],
) -> (Value, SendResponse<Response<kube::client::Body>>) {
    let (request, send) =
        tokio::time::timeout(std::time::Duration::from_secs(5), mock.next_request())
            .await
            .unwrap_or_else(|_| panic!("no request came; expected {method} {path}"))
            .expect("the client is alive");
    assert_eq!(request.method(), method, "method of {}", request.uri());
    assert_eq!(request.uri().path(), path);
    let got = decode(request.uri().query().unwrap_or(""));
    let want: Vec<(String, String)> = query
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    assert_eq!(got, want, "query of {method} {path}");
    let bytes = http_body_util::BodyExt::collect(request.into_body())
        .await
        .unwrap()
        .to_bytes();
    let body = if bytes.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&bytes).unwrap()
    };
    (body, send)
}

/// The next request is the Event about `replica-5` with `reason`: answered
/// 201.
async fn expect_event(mock: &mut Mock, reason: &str) {
    let (body, send) = expect(
        mock,
        Method::POST,
        &format!("/api/v1/namespaces/{NS}/events"),
        &[],
    )
    .await;
    assert_eq!(body["reason"], reason, "{body}");
    assert_eq!(body["involvedObject"]["kind"], "Service");
    assert_eq!(body["involvedObject"]["name"], "replica-5");
    respond(send, 201, &body);
}

fn respond(send: SendResponse<Response<kube::client::Body>>, code: u16, body: &Value) {
    send.send_response(
        Response::builder()
            .status(StatusCode::from_u16(code).unwrap())
            .header("content-type", "application/json")
            .body(kube::client::Body::from(body.to_string().into_bytes()))
            .unwrap(),
    );
}

fn status(code: u16, reason: &str, message: &str) -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
           "message": message, "reason": reason, "code": code})
}

/// The next request is the delete wait's (kube's `await_condition`): a
/// list of pods with the one name, read from etcd (no resourceVersion: a
/// cache may still hold the pod); answered empty, the pod is gone.
async fn expect_gone(mock: &mut Mock, pod: &str) {
    let selector = format!("metadata.name={pod}");
    let (_, send) = expect(
        mock,
        Method::GET,
        &format!("/api/v1/namespaces/{NS}/pods"),
        &[("fieldSelector", &selector), ("limit", "500")],
    )
    .await;
    respond(send, 200, &list("Pod", Vec::new()));
}

fn not_found(send: SendResponse<Response<kube::client::Body>>, what: &str) {
    respond(
        send,
        404,
        &status(404, "NotFound", &format!("{what} not found")),
    );
}

/// What the API server answers to a create: the object with a uid and a
/// resourceVersion (and, for a pod, a status with an IP).
fn stored(mut object: Value, uid: &str, rv: u64) -> Value {
    object["metadata"]["uid"] = json!(uid);
    object["metadata"]["resourceVersion"] = json!(rv.to_string());
    if object["kind"] == "Pod" {
        object["status"] = json!({"phase": "Running", "podIP": "127.0.100.7"});
    }
    object
}

fn list(kind: &str, items: Vec<Value>) -> Value {
    json!({"kind": format!("{kind}List"), "apiVersion": "v1", "metadata": {"resourceVersion": "100"}, "items": items})
}

/// The pod (and host name) of process `index` of `replica-5`, a service of
/// `scale` processes, in `generation`: `replica-5-gGENERATION-INDEX`.
fn pod_name(scale: usize, generation: u64, index: usize) -> String {
    lockstep_orchestrator_kubernetes::objects::pod_name("replica-5", scale, generation, index)
}

/// A record of `replica-5` (one process, generation 1) as written before
/// pods were named by their generation: its template has no
/// `generation_names`, so its pods keep the names `replica-5-INDEX`
/// (`pod`).
fn record(epoch: u64, uid: &str, rv: u64) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "replica-5", "namespace": NS, "uid": uid, "resourceVersion": rv.to_string(),
            "labels": {"app.kubernetes.io/managed-by": "lockstep", "lockstep/environment": "test",
                "lockstep/service": "replica-5", "lockstep/state": "live",
                "lockstep/epoch": epoch.to_string(), "lockstep/id": "5"},
            "annotations": {"lockstep/labels": "{\"replica-name\":\"r1\"}", "lockstep/generation": "1",
                "lockstep/template": json!({"image": "lockstep:test", "program": "/usr/local/bin/lockstep-replica",
                    "ports": {"controller": 2101, "timely": 2100}, "argv": [["--process=0"]], "hash": ["h0"]}).to_string()}},
        "spec": {"clusterIP": "None", "ports": [{"name": "controller", "port": 2101}, {"name": "timely", "port": 2100}]}
    })
}

/// A pod of process `index` of `record`'s service, under the name such a
/// record gives it (`replica-5-INDEX`).
fn pod(index: usize, epoch: u64, uid: &str, rv: u64) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": format!("replica-5-{index}"), "namespace": NS, "uid": uid, "resourceVersion": rv.to_string(),
            "labels": {"app.kubernetes.io/managed-by": "lockstep", "lockstep/environment": "test",
                "lockstep/service": "replica-5", "lockstep/process": index.to_string(),
                "lockstep/epoch": epoch.to_string(), "lockstep/id": "5"},
            "annotations": {"lockstep/spec-hash": "old", "lockstep/restarts": "0"}},
        "spec": {"containers": [{"name": "process", "image": "lockstep:test"}]},
        "status": {"phase": "Running", "podIP": format!("127.0.100.{}", index + 1)}
    })
}

fn labels(object: &Value) -> Value {
    object["metadata"]["labels"].clone()
}

#[tokio::test]
async fn ensure_creates_the_record_the_secret_and_one_pod_per_process() {
    let (orch, mut mock) = orchestrator(7);
    let call = tokio::spawn({
        let orch = orch.clone();
        async move { orch.ensure_service(replica(2)).await }
    });
    let base = format!("/api/v1/namespaces/{NS}");

    // The record: read, then created (nothing existed).
    let (_, send) = expect(
        &mut mock,
        Method::GET,
        &format!("{base}/services/replica-5"),
        &[],
    )
    .await;
    not_found(send, "services \"replica-5\"");
    let (body, send) = expect(&mut mock, Method::POST, &format!("{base}/services"), &[]).await;
    assert_eq!(
        labels(&body),
        json!({"app.kubernetes.io/managed-by": "lockstep", "lockstep/environment": "test",
               "lockstep/service": "replica-5", "lockstep/state": "live",
               "lockstep/epoch": "7", "lockstep/id": "5"})
    );
    assert_eq!(body["spec"]["clusterIP"], "None", "headless");
    assert_eq!(body["spec"]["publishNotReadyAddresses"], true);
    assert_eq!(
        body["spec"]["ports"],
        json!([{"name": "controller", "port": 2101}, {"name": "timely", "port": 2100}])
    );
    assert_eq!(
        serde_json::from_str::<Value>(
            body["metadata"]["annotations"]["lockstep/labels"]
                .as_str()
                .unwrap()
        )
        .unwrap(),
        json!({"replica-name": "r1", "lockstep/epoch": "7", "lockstep/id": "5"})
    );
    assert_eq!(body["metadata"]["annotations"]["lockstep/generation"], "1");
    let template: Value = serde_json::from_str(
        body["metadata"]["annotations"]["lockstep/template"]
            .as_str()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(template["program"], "/usr/local/bin/lockstep-replica");
    assert_eq!(template["argv"].as_array().unwrap().len(), 2);
    // Its pods are named by their generation; the peers' host names in
    // the template hold a placeholder for it, so the template is the same
    // in every generation.
    assert_eq!(template["generation_names"], true);
    assert_eq!(
        template["argv"][0][2],
        "--peers=replica-5-g{generation}-0.replica-5.lockstep.svc.cluster.local:2100,replica-5-g{generation}-1.replica-5.lockstep.svc.cluster.local:2100"
    );
    assert!(
        body["metadata"].get("resourceVersion").is_none(),
        "a create carries no version"
    );
    let record = stored(body, "uid-record", 10);
    respond(send, 201, &record);

    // The Secret with the environment (the session key), base64 in `data`.
    let (_, send) = expect(
        &mut mock,
        Method::GET,
        &format!("{base}/secrets/replica-5-env"),
        &[],
    )
    .await;
    not_found(send, "secrets \"replica-5-env\"");
    let (body, send) = expect(&mut mock, Method::POST, &format!("{base}/secrets"), &[]).await;
    assert_eq!(body["type"], "Opaque");
    assert_eq!(
        body["data"],
        json!({"LOCKSTEP_SESSION_KEY": "YzJWamNtVjA="})
    );
    respond(send, 201, &stored(body, "uid-secret", 11));

    // The PodDisruptionBudget (policy/v1), read and created the same way:
    // at most one of the service's pods evicted at a time.
    let budgets = format!("/apis/policy/v1/namespaces/{NS}/poddisruptionbudgets");
    let (_, send) = expect(&mut mock, Method::GET, &format!("{budgets}/replica-5"), &[]).await;
    not_found(send, "poddisruptionbudgets \"replica-5\"");
    let (body, send) = expect(&mut mock, Method::POST, &budgets, &[]).await;
    assert_eq!(body["metadata"]["name"], "replica-5");
    assert_eq!(body["metadata"]["labels"]["lockstep/epoch"], "7");
    assert_eq!(body["spec"]["minAvailable"], 1);
    assert_eq!(body["spec"]["unhealthyPodEvictionPolicy"], "AlwaysAllow");
    assert_eq!(
        body["spec"]["selector"],
        json!({"matchLabels": {
            "app.kubernetes.io/managed-by": "lockstep",
            "lockstep/environment": "test",
            "lockstep/service": "replica-5"
        }})
    );
    respond(send, 201, &stored(body, "uid-budget", 11));

    // The pods: none yet, so every pod starts in the record's generation.
    let (_, send) = expect(
        &mut mock,
        Method::GET,
        &format!("{base}/pods"),
        &[(
            "labelSelector",
            &format!("{SELECTOR},lockstep/service=replica-5"),
        )],
    )
    .await;
    respond(send, 200, &list("Pod", vec![]));
    // One pod per process, named by its generation (the first), each with
    // its own command line and its peers' DNS names in that generation.
    for i in 0..2 {
        let (body, send) = expect(&mut mock, Method::POST, &format!("{base}/pods"), &[]).await;
        assert_eq!(body["metadata"]["name"], pod_name(2, 1, i));
        assert_eq!(body["metadata"]["name"], format!("replica-5-g1-{i}"));
        assert_eq!(body["metadata"]["labels"]["lockstep/epoch"], "7");
        assert_eq!(body["metadata"]["labels"]["lockstep/id"], "5");
        assert_eq!(body["metadata"]["labels"]["lockstep/generation"], "1");
        assert_eq!(
            body["metadata"]["labels"]["lockstep/process"],
            i.to_string()
        );
        assert_eq!(body["spec"]["hostname"], pod_name(2, 1, i));
        assert_eq!(body["spec"]["subdomain"], "replica-5");
        assert_eq!(body["spec"]["restartPolicy"], "Always");
        let c = &body["spec"]["containers"][0];
        assert_eq!(c["image"], "lockstep:test");
        assert_eq!(c["command"], json!(["/usr/local/bin/lockstep-replica"]));
        assert_eq!(
            c["args"],
            json!([
                format!("--process={i}"),
                "--timely-port=2100",
                "--peers=replica-5-g1-0.replica-5.lockstep.svc.cluster.local:2100,replica-5-g1-1.replica-5.lockstep.svc.cluster.local:2100"
            ])
        );
        assert_eq!(
            c["env"],
            json!([{"name": "LOCKSTEP_SERVICE", "value": "replica-5"},
                   {"name": "LOCKSTEP_PROCESS", "value": i.to_string()},
                   {"name": "LOCKSTEP_GENERATION", "value": "1"},
                   {"name": "LOCKSTEP_LOG_FORMAT", "value": "json"},
                   {"name": "LOCKSTEP_CLUSTER_TIMEOUT_SECS", "value": "120"}])
        );
        // The kubelet probes GET /healthz on the controller port.
        assert_eq!(
            c["livenessProbe"]["httpGet"],
            json!({"path": "/healthz", "port": "controller"})
        );
        assert_eq!(
            c["envFrom"],
            json!([{"secretRef": {"name": "replica-5-env", "optional": false}}])
        );
        let text = body.to_string();
        assert!(
            !text.contains("c2VjcmV0"),
            "the session key is not in the pod spec: {text}"
        );
        respond(
            send,
            201,
            &stored(body, &format!("uid-pod-{i}"), 12 + i as u64),
        );
    }

    // The record is still ours.
    let (_, send) = expect(
        &mut mock,
        Method::GET,
        &format!("{base}/services/replica-5"),
        &[],
    )
    .await;
    respond(send, 200, &record);
    // The status: the pods created.
    let created = |i: usize, uid: &str, rv: u64| {
        let mut p = pod(i, 7, uid, rv);
        p["metadata"]["name"] = json!(pod_name(2, 1, i));
        p["metadata"]["labels"]["lockstep/generation"] = json!("1");
        p
    };
    let (_, send) = expect(
        &mut mock,
        Method::GET,
        &format!("{base}/pods"),
        &[(
            "labelSelector",
            &format!("{SELECTOR},lockstep/service=replica-5"),
        )],
    )
    .await;
    respond(
        send,
        200,
        &list(
            "Pod",
            vec![created(0, "uid-pod-0", 12), created(1, "uid-pod-1", 13)],
        ),
    );

    let status = call.await.unwrap().unwrap();
    assert_eq!(
        (status.name.as_str(), status.id, status.epoch),
        ("replica-5", 5, 7)
    );
    assert_eq!(status.processes.len(), 2);
    assert_eq!(
        status.processes[1].addresses["timely"].to_string(),
        "127.0.100.2:2100"
    );
    assert!(status.processes.iter().all(|p| p.running));
}

#[tokio::test]
async fn ensure_refuses_a_record_of_a_newer_epoch_without_writing() {
    let (orch, mut mock) = orchestrator(7);
    let call = tokio::spawn({
        let orch = orch.clone();
        async move { orch.ensure_service(replica(1)).await }
    });
    let (_, send) = expect(
        &mut mock,
        Method::GET,
        &format!("/api/v1/namespaces/{NS}/services/replica-5"),
        &[],
    )
    .await;
    respond(send, 200, &record(8, "uid-r", 40));
    // The refusal is said on the service (an Event), nothing is written.
    expect_event(&mut mock, "Refused").await;
    match call.await.unwrap() {
        Err(EnsureError::StaleEpoch {
            stored: 8, ours: 7, ..
        }) => {}
        other => panic!("{other:?}"),
    }
    // No further request (no write).
    assert!(
        tokio::time::timeout(std::time::Duration::from_millis(50), mock.next_request())
            .await
            .is_err()
    );
}

#[tokio::test]
async fn a_409_on_the_record_write_is_read_again_and_decided_again() {
    let (orch, mut mock) = orchestrator(7);
    let call = tokio::spawn({
        let orch = orch.clone();
        async move { orch.ensure_service(replica(1)).await }
    });
    let path = format!("/api/v1/namespaces/{NS}/services/replica-5");
    // Read: epoch 6 at version 40.
    let (_, send) = expect(&mut mock, Method::GET, &path, &[]).await;
    respond(send, 200, &record(6, "uid-r", 40));
    // The write is a CAS on version 40 (and the uid).
    let (body, send) = expect(&mut mock, Method::PUT, &path, &[]).await;
    assert_eq!(body["metadata"]["resourceVersion"], "40");
    assert_eq!(body["metadata"]["uid"], "uid-r");
    assert_eq!(body["metadata"]["labels"]["lockstep/epoch"], "7");
    respond(send, 409, &status(409, "Conflict", "Operation cannot be fulfilled on services \"replica-5\": the object has been modified; please apply your changes to the latest version and try again"));
    // Not retried blindly: read again, and now a newer controller (8) owns it.
    let (_, send) = expect(&mut mock, Method::GET, &path, &[]).await;
    respond(send, 200, &record(8, "uid-r", 41));
    expect_event(&mut mock, "Refused").await;
    match call.await.unwrap() {
        Err(EnsureError::StaleEpoch {
            stored: 8, ours: 7, ..
        }) => {}
        other => panic!("{other:?}"),
    }
    assert!(
        tokio::time::timeout(std::time::Duration::from_millis(50), mock.next_request())
            .await
            .is_err()
    );
}

#[tokio::test]
async fn drop_writes_a_tombstone_by_cas_and_deletes_each_object_with_preconditions() {
    let (orch, mut mock) = orchestrator(7);
    let call = tokio::spawn({
        let orch = orch.clone();
        async move { orch.drop_service("replica-5").await }
    });
    let base = format!("/api/v1/namespaces/{NS}");
    let path = format!("{base}/services/replica-5");
    let (_, send) = expect(&mut mock, Method::GET, &path, &[]).await;
    respond(send, 200, &record(6, "uid-r", 40));
    let (body, send) = expect(&mut mock, Method::PUT, &path, &[]).await;
    assert_eq!(body["metadata"]["resourceVersion"], "40");
    assert_eq!(body["metadata"]["uid"], "uid-r");
    assert_eq!(body["metadata"]["labels"]["lockstep/state"], "dropped");
    assert_eq!(body["metadata"]["labels"]["lockstep/dropped-by"], "7");
    let tomb = stored(body, "uid-r", 41);
    respond(send, 200, &tomb);
    // Still our tombstone; list the pods.
    let (_, send) = expect(&mut mock, Method::GET, &path, &[]).await;
    respond(send, 200, &tomb);
    let (_, send) = expect(
        &mut mock,
        Method::GET,
        &format!("{base}/pods"),
        &[(
            "labelSelector",
            &format!("{SELECTOR},lockstep/service=replica-5"),
        )],
    )
    .await;
    respond(
        send,
        200,
        &list(
            "Pod",
            vec![pod(0, 6, "uid-p0", 30), pod(1, 6, "uid-p1", 31)],
        ),
    );
    for (i, (uid, rv)) in [("uid-p0", "30"), ("uid-p1", "31")].into_iter().enumerate() {
        let (body, send) = expect(
            &mut mock,
            Method::DELETE,
            &format!("{base}/pods/replica-5-{i}"),
            &[],
        )
        .await;
        assert_eq!(
            body,
            json!({"gracePeriodSeconds": 5, "preconditions": {"uid": uid, "resourceVersion": rv}})
        );
        respond(send, 200, &pod(i, 6, uid, 50));
    }
    // Every delete first, then the waits, with one deadline for them all.
    for i in 0..2 {
        expect_gone(&mut mock, &format!("replica-5-{i}")).await;
    }
    let (_, send) = expect(&mut mock, Method::GET, &path, &[]).await;
    respond(send, 200, &tomb);
    // The Secret, as read.
    let (_, send) = expect(
        &mut mock,
        Method::GET,
        &format!("{base}/secrets/replica-5-env"),
        &[],
    )
    .await;
    respond(
        send,
        200,
        &json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "replica-5-env", "uid": "uid-s", "resourceVersion": "33"}}),
    );
    let (body, send) = expect(
        &mut mock,
        Method::DELETE,
        &format!("{base}/secrets/replica-5-env"),
        &[],
    )
    .await;
    assert_eq!(
        body,
        json!({"preconditions": {"uid": "uid-s", "resourceVersion": "33"}})
    );
    respond(
        send,
        200,
        &json!({"kind": "Status", "apiVersion": "v1", "status": "Success", "code": 200}),
    );
    // The PodDisruptionBudget, as read, with preconditions too.
    let budget = format!("/apis/policy/v1/namespaces/{NS}/poddisruptionbudgets/replica-5");
    let (_, send) = expect(&mut mock, Method::GET, &budget, &[]).await;
    respond(
        send,
        200,
        &json!({"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": "replica-5", "uid": "uid-b", "resourceVersion": "34"}}),
    );
    let (body, send) = expect(&mut mock, Method::DELETE, &budget, &[]).await;
    assert_eq!(
        body,
        json!({"preconditions": {"uid": "uid-b", "resourceVersion": "34"}})
    );
    respond(
        send,
        200,
        &json!({"kind": "Status", "apiVersion": "v1", "status": "Success", "code": 200}),
    );
    assert!(call.await.unwrap().unwrap(), "it existed");
}

#[tokio::test]
async fn a_pod_delete_refused_by_its_precondition_is_decided_again_on_a_fresh_read() {
    let (orch, mut mock) = orchestrator(7);
    let call = tokio::spawn({
        let orch = orch.clone();
        async move { orch.drop_service("replica-5").await }
    });
    let base = format!("/api/v1/namespaces/{NS}");
    let path = format!("{base}/services/replica-5");
    let (_, send) = expect(&mut mock, Method::GET, &path, &[]).await;
    respond(send, 200, &record(6, "uid-r", 40));
    let (body, send) = expect(&mut mock, Method::PUT, &path, &[]).await;
    let tomb = stored(body, "uid-r", 41);
    respond(send, 200, &tomb);
    let (_, send) = expect(&mut mock, Method::GET, &path, &[]).await;
    respond(send, 200, &tomb);
    let (_, send) = expect(
        &mut mock,
        Method::GET,
        &format!("{base}/pods"),
        &[(
            "labelSelector",
            &format!("{SELECTOR},lockstep/service=replica-5"),
        )],
    )
    .await;
    respond(send, 200, &list("Pod", vec![pod(0, 6, "uid-old", 30)]));
    let (body, send) = expect(
        &mut mock,
        Method::DELETE,
        &format!("{base}/pods/replica-5-0"),
        &[],
    )
    .await;
    assert_eq!(
        body,
        json!({"gracePeriodSeconds": 5, "preconditions": {"uid": "uid-old", "resourceVersion": "30"}})
    );
    respond(
        send,
        409,
        &status(
            409,
            "Conflict",
            "Precondition failed: UID in precondition: uid-old, UID in object meta: uid-new",
        ),
    );
    // Decided again: the record is no longer our tombstone (a newer
    // controller re-created the service): the new pod is left alone.
    let (_, send) = expect(&mut mock, Method::GET, &path, &[]).await;
    respond(send, 200, &record(8, "uid-r", 45));
    assert!(call.await.unwrap().unwrap());
    assert!(
        tokio::time::timeout(std::time::Duration::from_millis(50), mock.next_request())
            .await
            .is_err(),
        "no blind retry"
    );
}

#[tokio::test]
async fn restart_bumps_the_generation_deletes_every_pod_with_preconditions_then_creates_them() {
    let (orch, mut mock) = orchestrator(7);
    let call = tokio::spawn({
        let orch = orch.clone();
        async move { orch.restart_service("replica-5").await }
    });
    let base = format!("/api/v1/namespaces/{NS}");
    let path = format!("{base}/services/replica-5");
    let selector = format!("{SELECTOR},lockstep/service=replica-5");
    let (_, send) = expect(&mut mock, Method::GET, &path, &[]).await;
    respond(send, 200, &record(7, "uid-r", 40));
    // The generation goes up by compare-and-swap on the record.
    let (body, send) = expect(&mut mock, Method::PUT, &path, &[]).await;
    assert_eq!(body["metadata"]["resourceVersion"], "40");
    assert_eq!(body["metadata"]["uid"], "uid-r");
    assert_eq!(body["metadata"]["annotations"]["lockstep/generation"], "2");
    assert_eq!(body["metadata"]["labels"]["lockstep/epoch"], "7");
    let bumped = stored(body, "uid-r", 41);
    respond(send, 200, &bumped);
    // Every pod goes, as read.
    let (_, send) = expect(
        &mut mock,
        Method::GET,
        &format!("{base}/pods"),
        &[("labelSelector", &selector)],
    )
    .await;
    respond(send, 200, &list("Pod", vec![pod(0, 7, "uid-p0", 30)]));
    let (body, send) = expect(
        &mut mock,
        Method::DELETE,
        &format!("{base}/pods/replica-5-0"),
        &[],
    )
    .await;
    assert_eq!(
        body,
        json!({"gracePeriodSeconds": 5, "preconditions": {"uid": "uid-p0", "resourceVersion": "30"}})
    );
    respond(send, 200, &pod(0, 7, "uid-p0", 51));
    expect_gone(&mut mock, "replica-5-0").await;
    // Still ours and still our generation: every pod starts.
    let (_, send) = expect(&mut mock, Method::GET, &path, &[]).await;
    respond(send, 200, &bumped);
    let (body, send) = expect(&mut mock, Method::POST, &format!("{base}/pods"), &[]).await;
    // A record written before pods were named by their generation: its
    // pods keep their names (and its arguments name its peers so).
    assert_eq!(body["metadata"]["name"], "replica-5-0");
    assert_eq!(body["metadata"]["annotations"]["lockstep/restarts"], "1");
    assert_eq!(body["metadata"]["labels"]["lockstep/generation"], "2");
    assert_eq!(body["metadata"]["labels"]["lockstep/epoch"], "7");
    assert!(
        body["metadata"].get("uid").is_none() && body["metadata"].get("resourceVersion").is_none()
    );
    let c = &body["spec"]["containers"][0];
    assert_eq!(
        c["args"],
        json!(["--process=0"]),
        "the template's command line"
    );
    assert_eq!(
        c["env"][2],
        json!({"name": "LOCKSTEP_GENERATION", "value": "2"})
    );
    respond(send, 201, &stored(body, "uid-p0b", 52));
    let (_, send) = expect(
        &mut mock,
        Method::GET,
        &format!("{base}/pods"),
        &[("labelSelector", &selector)],
    )
    .await;
    let mut again = pod(0, 7, "uid-p0b", 52);
    again["metadata"]["annotations"]["lockstep/restarts"] = json!("1");
    respond(send, 200, &list("Pod", vec![again]));
    // The Event comes last, once the service's lock is released.
    expect_event(&mut mock, "Restarted").await;
    let status = call.await.unwrap().unwrap();
    assert_eq!(status.processes[0].restarts, 1);
}

#[tokio::test]
async fn restart_refuses_a_service_of_a_newer_epoch_without_deleting() {
    let (orch, mut mock) = orchestrator(7);
    let call = tokio::spawn({
        let orch = orch.clone();
        async move { orch.restart_service("replica-5").await }
    });
    let (_, send) = expect(
        &mut mock,
        Method::GET,
        &format!("/api/v1/namespaces/{NS}/services/replica-5"),
        &[],
    )
    .await;
    respond(send, 200, &record(9, "uid-r", 40));
    assert!(matches!(
        call.await.unwrap(),
        Err(RestartError::StaleEpoch {
            stored: 9,
            ours: 7,
            ..
        })
    ));
    assert!(
        tokio::time::timeout(std::time::Duration::from_millis(50), mock.next_request())
            .await
            .is_err()
    );
}

#[tokio::test]
async fn list_reads_live_records_and_their_pods_by_label_selector() {
    let (orch, mut mock) = orchestrator(7);
    let call = tokio::spawn({
        let orch = orch.clone();
        async move { orch.list_services().await }
    });
    let base = format!("/api/v1/namespaces/{NS}");
    let (_, send) = expect(
        &mut mock,
        Method::GET,
        &format!("{base}/services"),
        &[("labelSelector", &format!("{SELECTOR},lockstep/state=live"))],
    )
    .await;
    respond(send, 200, &list("Service", vec![record(6, "uid-r", 40)]));
    let (_, send) = expect(
        &mut mock,
        Method::GET,
        &format!("{base}/pods"),
        &[("labelSelector", SELECTOR)],
    )
    .await;
    respond(
        send,
        200,
        &list("Pod", vec![pod(1, 6, "b", 2), pod(0, 6, "a", 1)]),
    );
    let services = call.await.unwrap().unwrap();
    assert_eq!(services.len(), 1);
    let s = &services[0];
    assert_eq!((s.id, s.epoch), (5, 6));
    assert_eq!(s.labels["replica-name"], "r1");
    assert_eq!(s.labels["lockstep/epoch"], "6");
    assert_eq!(
        s.processes.iter().map(|p| p.index).collect::<Vec<_>>(),
        [0, 1]
    );
}
