//! `deploy/kubernetes/` holds valid Kubernetes objects: every YAML document
//! deserializes into its k8s-openapi type and serializes back to the same
//! JSON (so a misspelled or misplaced field fails), and the Role grants
//! exactly the verbs the backend's requests need (least privilege, checked
//! against the requests recorded by the API double).

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::Duration;

use http::Method;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Namespace, Secret, ServiceAccount};
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use lockstep_kube_double::{ApiServerDouble, RecordedRequest};
use lockstep_orchestrator::{Orchestrator, ServiceConfig};
use lockstep_orchestrator_kubernetes::{KubernetesOrchestrator, KubernetesOrchestratorConfig};
use serde_json::Value;

fn deploy_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../deploy/kubernetes")
}

/// Every document of every YAML file, as JSON, with its file name.
fn documents() -> Vec<(String, Value)> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(deploy_dir())
        .expect("deploy/kubernetes exists")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    let mut out = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap();
        for doc in serde_yaml::Deserializer::from_str(&text) {
            let value: Value = serde::Deserialize::deserialize(doc)
                .unwrap_or_else(|e| panic!("{}: not YAML: {e}", file.display()));
            out.push((
                file.file_name().unwrap().to_string_lossy().into_owned(),
                value,
            ));
        }
    }
    out
}

/// Deserializes into `T` and checks nothing was lost or renamed.
fn round_trip<T: serde::de::DeserializeOwned + serde::Serialize>(file: &str, doc: &Value) -> T {
    let typed: T = serde_json::from_value(doc.clone()).unwrap_or_else(|e| panic!("{file}: {e}"));
    let back = serde_json::to_value(&typed).unwrap();
    assert_eq!(
        &back, doc,
        "{file}: fields k8s-openapi does not know were dropped"
    );
    typed
}

#[test]
fn every_manifest_is_a_valid_kubernetes_object() {
    let docs = documents();
    let mut kinds = BTreeMap::new();
    let mut token_secrets = Vec::new();
    for (file, doc) in &docs {
        let kind = doc["kind"]
            .as_str()
            .unwrap_or_else(|| panic!("{file}: no kind"))
            .to_string();
        match kind.as_str() {
            "Namespace" => drop(round_trip::<Namespace>(file, doc)),
            "ServiceAccount" => drop(round_trip::<ServiceAccount>(file, doc)),
            "Role" => drop(round_trip::<Role>(file, doc)),
            "RoleBinding" => drop(round_trip::<RoleBinding>(file, doc)),
            "Secret" => drop(round_trip::<Secret>(file, doc)),
            "Deployment" => {
                let d: Deployment = round_trip(file, doc);
                let pod = d.spec.unwrap().template.spec.unwrap();
                assert_eq!(
                    pod.service_account_name.as_deref(),
                    Some("lockstep-environment")
                );
                let args = pod.containers[0].args.clone().unwrap();
                assert!(
                    args.iter().any(|a| a == "--orchestrator=kubernetes"),
                    "{args:?}"
                );
                // `lockstep serve` refuses to listen off loopback without a
                // token: the Deployment must give one, from a Secret.
                let listen = args.iter().find_map(|a| a.strip_prefix("--listen="));
                if listen.is_some_and(|l| !l.starts_with("127.") && !l.starts_with("[::1]")) {
                    let env = pod.containers[0].env.clone().unwrap_or_default();
                    let token = env
                        .iter()
                        .find(|e| e.name == "LOCKSTEP_API_TOKEN")
                        .unwrap_or_else(|| {
                            panic!("{file}: listens on {listen:?} without LOCKSTEP_API_TOKEN")
                        });
                    let secret = token
                        .value_from
                        .as_ref()
                        .and_then(|v| v.secret_key_ref.as_ref())
                        .map(|r| r.name.clone())
                        .unwrap_or_else(|| panic!("{file}: the API token must come from a Secret"));
                    token_secrets.push(secret);
                }
            }
            other => panic!("{file}: unexpected kind {other}"),
        }
        if kind != "Namespace" {
            assert_eq!(
                doc["metadata"]["namespace"], "lockstep",
                "{file}: {kind} in the lockstep namespace"
            );
        }
        *kinds.entry(kind).or_insert(0) += 1;
    }
    for kind in [
        "Namespace",
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "Deployment",
    ] {
        assert_eq!(kinds.get(kind), Some(&1), "one {kind}: {kinds:?}");
    }
    // The store's connection string and the API token.
    assert_eq!(kinds.get("Secret"), Some(&2), "two Secrets: {kinds:?}");
    let secrets: Vec<&str> = docs
        .iter()
        .filter(|(_, d)| d["kind"] == "Secret")
        .filter_map(|(_, d)| d["metadata"]["name"].as_str())
        .collect();
    for s in &token_secrets {
        assert!(
            secrets.contains(&s.as_str()),
            "the token's Secret {s} is not shipped: {secrets:?}"
        );
    }
}

/// The RBAC verb of a recorded request.
fn verb(r: &RecordedRequest) -> (String, &'static str) {
    let parts: Vec<&str> = r.path.trim_matches('/').split('/').collect();
    let resource = parts[4].to_string();
    let item = parts.len() > 5;
    let verb = match (&r.method, item) {
        (&Method::GET, true) => "get",
        (&Method::GET, false) if r.query.contains_key("watch") => "watch",
        (&Method::GET, false) => "list",
        (&Method::POST, _) => "create",
        (&Method::PUT, _) => "update",
        (&Method::DELETE, _) => "delete",
        _ => "unknown",
    };
    (resource, verb)
}

#[tokio::test]
async fn the_role_grants_exactly_what_the_backend_uses() {
    // Every operation of the trait, on the double, recording the requests.
    let api = ApiServerDouble::new();
    let mut c = KubernetesOrchestratorConfig::new("lockstep", 1);
    c.poll_interval = Duration::from_millis(5);
    let o = KubernetesOrchestrator::new(api.client("lockstep"), c.clone());
    let mut events = o.watch_services();
    o.master_secret().await.unwrap();
    let config = || {
        ServiceConfig::new("replica-1", 1, "lockstep-replica")
            .port("timely")
            .env("K", "v")
    };
    o.ensure_service(config()).await.unwrap();
    let mut c2 = c.clone();
    c2.epoch = 2;
    let o2 = KubernetesOrchestrator::new(api.client("lockstep"), c2);
    o2.ensure_service(config()).await.unwrap();
    o2.ensure_service(config().env("K", "changed"))
        .await
        .unwrap();
    o2.restart_service("replica-1").await.unwrap();
    o2.list_services().await.unwrap();
    o2.drop_service("replica-1").await.unwrap();
    let _ = tokio::time::timeout(Duration::from_secs(2), events.recv()).await;
    let used: BTreeSet<(String, &str)> = api.requests().iter().map(verb).collect();

    let role: Role = documents()
        .into_iter()
        .find(|(_, d)| d["kind"] == "Role")
        .map(|(f, d)| round_trip(&f, &d))
        .unwrap();
    let granted: BTreeSet<(String, &str)> = role
        .rules
        .unwrap()
        .iter()
        .flat_map(|r| {
            assert_eq!(
                r.api_groups.as_deref(),
                Some(&[String::new()][..]),
                "core group only"
            );
            let verbs: Vec<&'static str> = r
                .verbs
                .iter()
                .map(|v| &*Box::leak(v.clone().into_boxed_str()))
                .collect();
            r.resources
                .clone()
                .unwrap()
                .into_iter()
                .flat_map(move |res| verbs.clone().into_iter().map(move |v| (res.clone(), v)))
        })
        .collect();
    assert_eq!(granted, used, "the Role must grant exactly the verbs used");
}
