//! `deploy/kubernetes/` holds valid Kubernetes objects: every YAML document
//! deserializes into its k8s-openapi type and serializes back to the same
//! JSON (so a misspelled or misplaced field fails), and the Role grants
//! exactly the verbs the backend's requests need (least privilege, checked
//! against the requests recorded by the API double). The Deployment is
//! operable: probes on /healthz of the metrics port, requests and limits, a restricted
//! securityContext, its state on a shipped PersistentVolumeClaim, and a
//! Service reaching its API and metrics ports.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::Duration;

use http::Method;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{
    Container, Namespace, PersistentVolumeClaim, PodSpec, Probe, Service, ServiceAccount,
};
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use lockstep_kube_double::{ApiServerDouble, RecordedRequest};
use lockstep_orchestrator::{Orchestrator, ServiceConfig};
use lockstep_orchestrator_kubernetes::{KubernetesOrchestrator, KubernetesOrchestratorConfig};
use serde_json::Value;

fn deploy_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../deploy/kubernetes/base")
}

/// The base's kustomization: its namespace and its resources.
fn kustomization() -> Value {
    let text = std::fs::read_to_string(deploy_dir().join("kustomization.yaml")).unwrap();
    serde_yaml_ng::from_str(&text).unwrap()
}

/// Every document of every YAML file, as JSON, with its file name.
fn documents() -> Vec<(String, Value)> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(deploy_dir())
        .expect("deploy/kubernetes exists")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .filter(|p| !p.ends_with("kustomization.yaml"))
        .collect();
    files.sort();
    let mut out = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap();
        for doc in serde_yaml_ng::Deserializer::from_str(&text) {
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

/// The shipped Deployment's pod spec.
fn deployment_pod() -> PodSpec {
    let (_, doc) = documents()
        .into_iter()
        .find(|(_, d)| d["kind"] == "Deployment")
        .unwrap();
    let d: Deployment = serde_json::from_value(doc).unwrap();
    d.spec.unwrap().template.spec.unwrap()
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
fn the_kustomization_lists_every_file_and_sets_the_namespace_once() {
    let k = kustomization();
    assert_eq!(k["namespace"], "lockstep");
    let mut listed: Vec<String> = k["resources"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r.as_str().unwrap().to_string())
        .collect();
    listed.sort();
    let mut files: Vec<String> = documents().into_iter().map(|(f, _)| f).collect();
    files.dedup();
    assert_eq!(listed, files, "every manifest is a resource of the base");
    // The namespace every doc and the Deployment's flags leave out is the
    // Namespace object's.
    let ns = documents()
        .into_iter()
        .find(|(_, d)| d["kind"] == "Namespace")
        .unwrap()
        .1;
    assert_eq!(ns["metadata"]["name"], k["namespace"]);
}

#[test]
fn the_images_are_pinned_to_this_build_and_the_namespace_comes_from_the_pod() {
    let pod = deployment_pod();
    let want = lockstep_orchestrator_kubernetes::image::default_image();
    for c in pod
        .containers
        .iter()
        .chain(pod.init_containers.iter().flatten())
    {
        assert_eq!(c.image.as_deref(), Some(want.as_str()), "{}", c.name);
        // A full name: a short one resolves to Docker Hub.
        assert!(
            lockstep_orchestrator_kubernetes::image::fully_qualified(c.image.as_deref().unwrap()),
            "{}",
            c.name
        );
        assert_eq!(
            lockstep_orchestrator_kubernetes::image::check_pinned(c.image.as_deref().unwrap()),
            Ok(())
        );
    }
    let c = &pod.containers[0];
    let args = c.args.clone().unwrap();
    for unset in ["namespace", "kubernetes-image"] {
        assert!(
            flag(&args, unset).is_none(),
            "{unset} is not spelled out: {args:?}"
        );
    }
    assert_eq!(flag(&args, "log-format"), Some("json"));
    let ns = c
        .env
        .iter()
        .flatten()
        .find(|e| e.name == "LOCKSTEP_NAMESPACE")
        .and_then(|e| e.value_from.as_ref()?.field_ref.as_ref())
        .map(|f| f.field_path.clone());
    assert_eq!(ns.as_deref(), Some("metadata.namespace"));
}

#[test]
fn the_prometheus_scrape_config_uses_the_metrics_token_and_discovers_the_replicas() {
    let path = deploy_dir().join("../../prometheus/scrape.yaml");
    let doc: Value = serde_yaml_ng::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let jobs = doc["scrape_configs"].as_array().unwrap();
    assert_eq!(jobs.len(), 2);
    for job in jobs {
        assert!(job["authorization"]["credentials_file"]
            .as_str()
            .is_some_and(|f| f.ends_with("lockstep-metrics.token")));
    }
    let sd = &jobs[1]["http_sd_configs"][0];
    assert!(sd["url"].as_str().unwrap().ends_with("/metrics/targets"));
    assert!(sd["authorization"]["credentials_file"].is_string());
}

#[test]
fn every_manifest_is_a_valid_kubernetes_object() {
    let docs = documents();
    let mut kinds = BTreeMap::new();
    let mut token_secrets = Vec::new();
    let mut deployments = Vec::new();
    let mut services = Vec::new();
    let mut claims = Vec::new();
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
            "Secret" => panic!(
                "{file}: the base holds a Secret, which every reader of the repository knows; an overlay makes it"
            ),
            "Service" => services.push(round_trip::<Service>(file, doc)),
            "PersistentVolumeClaim" => claims.push(round_trip::<PersistentVolumeClaim>(file, doc)),
            "NetworkPolicy" => {
                drop(round_trip::<k8s_openapi::api::networking::v1::NetworkPolicy>(file, doc))
            }
            "Deployment" => {
                let d: Deployment = round_trip(file, doc);
                deployments.push(d.clone());
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
        // The namespace is set once, by the kustomization.
        assert!(
            doc["metadata"].get("namespace").is_none(),
            "{file}: {kind} names its namespace; the kustomization sets it"
        );
        *kinds.entry(kind).or_insert(0) += 1;
    }
    for kind in [
        "Namespace",
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "Deployment",
        "Service",
        "PersistentVolumeClaim",
    ] {
        assert_eq!(kinds.get(kind), Some(&1), "one {kind}: {kinds:?}");
    }
    // The replicas' and the environment's.
    assert_eq!(kinds.get("NetworkPolicy"), Some(&2), "{kinds:?}");
    // The API token's Secret is one the example overlay makes.
    let generated = generated_secrets();
    for s in &token_secrets {
        assert!(
            generated.contains_key(s),
            "the token's Secret {s} is made by no overlay: {generated:?}"
        );
    }
    operable(&deployments[0], &services[0], &claims[0]);
}

/// The Secrets the example overlay makes (`secretGenerator`): name -> the
/// keys of each.
fn generated_secrets() -> BTreeMap<String, BTreeSet<String>> {
    let path = deploy_dir().join("../overlays/example/kustomization.yaml");
    let k: Value = serde_yaml_ng::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    k["secretGenerator"]
        .as_array()
        .expect("the example overlay makes its Secrets")
        .iter()
        .map(|g| {
            let keys = g["files"]
                .as_array()
                .unwrap()
                .iter()
                .map(|f| {
                    let f = f.as_str().unwrap();
                    // `KEY=PATH`, or `PATH` whose file name is the key.
                    let key = f
                        .split_once('=')
                        .map_or_else(|| f.rsplit('/').next().unwrap(), |(k, _)| k);
                    // The file is one the operator makes, never committed.
                    let file = f.split_once('=').map_or(f, |(_, p)| p);
                    assert!(file.starts_with("secrets/"), "{file}: not under secrets/");
                    key.to_string()
                })
                .collect();
            (g["name"].as_str().unwrap().to_string(), keys)
        })
        .collect()
}

#[test]
fn every_secret_the_deployment_reads_is_one_the_example_overlay_makes() {
    let pod = deployment_pod();
    let generated = generated_secrets();
    let mut read = BTreeSet::new();
    let c = &pod.containers[0];
    for e in c.env.iter().flatten() {
        if let Some(r) = e
            .value_from
            .as_ref()
            .and_then(|v| v.secret_key_ref.as_ref())
        {
            assert!(
                generated.get(&r.name).is_some_and(|k| k.contains(&r.key)),
                "{}: the Secret {} with key {} is made by no overlay: {generated:?}",
                e.name,
                r.name,
                r.key
            );
            read.insert(r.name.clone());
        }
    }
    // The metrics token is a file (Prometheus is given the same Secret): a
    // key of a Secret volume mounted where LOCKSTEP_METRICS_TOKEN_FILE says.
    let file = c
        .env
        .iter()
        .flatten()
        .find(|e| e.name == "LOCKSTEP_METRICS_TOKEN_FILE")
        .and_then(|e| e.value.clone())
        .expect("the metrics token from a file");
    let (dir, key) = file.rsplit_once('/').unwrap();
    let mount = c
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| m.mount_path.trim_end_matches('/') == dir)
        .unwrap_or_else(|| panic!("{file} is on no volume"));
    assert_eq!(mount.read_only, Some(true));
    let secret = pod
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == mount.name)
        .and_then(|v| v.secret.as_ref())
        .and_then(|s| s.secret_name.clone())
        .expect("the metrics token's volume is a Secret");
    assert!(
        generated.get(&secret).is_some_and(|k| k.contains(key)),
        "the metrics token's Secret {secret} (key {key}) is made by no overlay: {generated:?}"
    );
    read.insert(secret);
    // The overlay's own patch (the API over TLS) mounts its certificate's
    // Secret and hands serve the files of both its keys.
    let patch = deploy_dir().join("../overlays/example/api-tls.yaml");
    let ops: Value = serde_yaml_ng::from_str(&std::fs::read_to_string(patch).unwrap()).unwrap();
    let ops = ops.as_array().expect("a JSON patch");
    let tls_secret = ops
        .iter()
        .find_map(|op| op["value"]["secret"]["secretName"].as_str())
        .expect("the patch mounts a Secret");
    let mount = ops
        .iter()
        .find_map(|op| op["value"]["mountPath"].as_str())
        .expect("the patch mounts it");
    for (flag, key) in [("--tls-cert", "tls.crt"), ("--tls-key", "tls.key")] {
        assert!(
            generated.get(tls_secret).is_some_and(|k| k.contains(key)),
            "{tls_secret} (key {key}) is made by no overlay: {generated:?}"
        );
        let arg = format!("{flag}={mount}/{key}");
        assert!(
            ops.iter().any(|op| op["value"] == arg.as_str()),
            "the patch does not pass {arg}"
        );
    }
    read.insert(tls_secret.to_string());
    // Nothing generated goes unread.
    let made: BTreeSet<String> = generated.keys().cloned().collect();
    assert_eq!(read, made);
}

#[test]
fn the_deployment_names_no_object_so_a_name_prefix_changes_nothing() {
    let docs = documents();
    let names: Vec<String> = docs
        .iter()
        .filter(|(_, d)| d["kind"] != "Namespace")
        .filter_map(|(_, d)| d["metadata"]["name"].as_str().map(String::from))
        .collect();
    let (_, d) = docs
        .iter()
        .find(|(_, d)| d["kind"] == "Deployment")
        .unwrap();
    let c = &d["spec"]["template"]["spec"]["containers"][0];
    // kustomize rewrites references in fields it knows (a Secret's name, the
    // service account, a claim); arguments and plain values it does not.
    let texts: Vec<String> = c["args"]
        .as_array()
        .unwrap()
        .iter()
        .chain(c["env"].as_array().unwrap().iter().map(|e| &e["value"]))
        .filter_map(|v| v.as_str().map(String::from))
        .collect();
    for text in &texts {
        for name in &names {
            assert!(
                !text.contains(name.as_str()),
                "{text:?} names the object {name}"
            );
        }
    }
}

#[test]
fn every_object_carries_the_standard_labels_and_the_selectors_name_one_installation() {
    let version = lockstep_orchestrator_kubernetes::image::default_image()
        .rsplit_once(':')
        .unwrap()
        .1
        .to_string();
    for (file, doc) in documents() {
        let labels = &doc["metadata"]["labels"];
        assert_eq!(labels["app.kubernetes.io/part-of"], "lockstep", "{file}");
        if doc["kind"] == "Namespace" {
            continue;
        }
        assert_eq!(labels["app.kubernetes.io/name"], "lockstep", "{file}");
        assert_eq!(labels["app.kubernetes.io/instance"], "lockstep", "{file}");
        assert!(
            labels["app.kubernetes.io/component"].is_string(),
            "{file}: no component"
        );
        assert_eq!(
            labels["app.kubernetes.io/version"],
            version.as_str(),
            "{file}"
        );
    }
    let find = |kind: &str| {
        documents()
            .into_iter()
            .find(|(_, d)| d["kind"] == kind)
            .unwrap()
            .1
    };
    let d = find("Deployment");
    let selector = &d["spec"]["selector"]["matchLabels"];
    let want = serde_json::json!({
        "app.kubernetes.io/name": "lockstep",
        "app.kubernetes.io/component": "environment",
        "app.kubernetes.io/instance": "lockstep",
    });
    // The selector is immutable: no version in it.
    assert_eq!(selector, &want);
    // A scrape by annotation carries no token: it would get 401 for ever.
    let annotations = &d["spec"]["template"]["metadata"]["annotations"];
    assert!(
        annotations.get("prometheus.io/scrape").is_none(),
        "{annotations}"
    );
    assert_eq!(&find("Service")["spec"]["selector"], &want);
    // The replicas' controller port admits the environment's pods.
    let policy = find("NetworkPolicy");
    let from: Vec<&Value> = policy["spec"]["ingress"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|r| r["from"].as_array().unwrap())
        .map(|f| &f["podSelector"]["matchLabels"])
        .collect();
    assert!(from.contains(&&want), "{from:?}");
}

/// The TCP (or UDP) ports of a NetworkPolicy rule list (`ingress` or
/// `egress`) whose peers are `to_pods` (a podSelector's labels; `None`: the
/// rules without peers, open to anyone).
fn policy_ports(rules: &Value, peers: &str, to_pods: Option<&Value>) -> BTreeSet<(String, i64)> {
    rules
        .as_array()
        .into_iter()
        .flatten()
        .filter(|r| match to_pods {
            None => r.get(peers).is_none(),
            Some(labels) => r[peers]
                .as_array()
                .into_iter()
                .flatten()
                .any(|p| &p["podSelector"]["matchLabels"] == labels),
        })
        .flat_map(|r| r["ports"].as_array().cloned().unwrap_or_default())
        .map(|p| {
            (
                p["protocol"].as_str().unwrap_or("TCP").to_string(),
                p["port"].as_i64().unwrap(),
            )
        })
        .collect()
}

#[test]
fn the_network_policies_follow_the_deployments_ports_and_the_replicas_ports() {
    let docs = documents();
    let policy = |name: &str| {
        docs.iter()
            .find(|(_, d)| d["kind"] == "NetworkPolicy" && d["metadata"]["name"] == name)
            .unwrap_or_else(|| panic!("no NetworkPolicy {name}"))
            .1
            .clone()
    };
    let (_, d) = docs
        .iter()
        .find(|(_, d)| d["kind"] == "Deployment")
        .unwrap();
    let pod_labels = &d["spec"]["selector"]["matchLabels"];
    let args: Vec<String> = d["spec"]["template"]["spec"]["containers"][0]["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap().to_string())
        .collect();
    let port = |name: &str| -> i64 {
        flag(&args, name)
            .and_then(|a| a.rsplit_once(':'))
            .and_then(|(_, p)| p.parse().ok())
            .unwrap()
    };
    let base = i64::from(KubernetesOrchestratorConfig::new("lockstep", 1).base_port);
    let (mesh, controller) = (base, base + 1);
    let tcp = |p: i64| ("TCP".to_string(), p);
    let dns: BTreeSet<_> = [("UDP".to_string(), 53), tcp(53)].into();

    // The environment's pod: its API and metrics ports in, from anyone.
    let env = policy("lockstep-environment");
    assert_eq!(&env["spec"]["podSelector"]["matchLabels"], pod_labels);
    assert_eq!(
        policy_ports(&env["spec"]["ingress"], "from", None),
        [tcp(port("listen")), tcp(port("metrics-listen"))].into()
    );
    // Out: DNS, the API server and the store, and the replicas' controller port.
    let replicas = &policy("lockstep-replicas")["spec"]["podSelector"]["matchLabels"];
    let open = policy_ports(&env["spec"]["egress"], "to", None);
    assert!(open.is_superset(&dns), "{open:?}");
    assert!(
        open.contains(&tcp(443)) && open.contains(&tcp(5432)),
        "{open:?}"
    );
    assert_eq!(
        policy_ports(&env["spec"]["egress"], "to", Some(replicas)),
        [tcp(controller)].into()
    );

    // A replica pod: the mesh from its peers, the controller port from the
    // environment's pod; out, DNS and its peers' mesh port.
    let rep = policy("lockstep-replicas");
    assert_eq!(
        policy_ports(&rep["spec"]["ingress"], "from", Some(replicas)),
        [tcp(mesh)].into()
    );
    assert_eq!(
        policy_ports(&rep["spec"]["ingress"], "from", Some(pod_labels)),
        [tcp(controller)].into()
    );
    assert!(policy_ports(&rep["spec"]["ingress"], "from", None).is_empty());
    assert!(policy_ports(&rep["spec"]["egress"], "to", None).is_superset(&dns));
    assert_eq!(
        policy_ports(&rep["spec"]["egress"], "to", Some(replicas)),
        [tcp(mesh)].into()
    );
    for p in [&env, &rep] {
        assert_eq!(
            p["spec"]["policyTypes"],
            serde_json::json!(["Ingress", "Egress"])
        );
    }
}

#[test]
fn the_operator_manifests_scrape_with_the_mounted_metrics_token() {
    let path = deploy_dir().join("../../prometheus/operator.yaml");
    let text = std::fs::read_to_string(path).unwrap();
    let docs: Vec<Value> = serde_yaml_ng::Deserializer::from_str(&text)
        .map(|d| serde::Deserialize::deserialize(d).unwrap())
        .collect();
    let credentials = serde_json::json!({
        "type": "Bearer",
        "credentials": {"name": "lockstep-metrics-token", "key": "token"},
    });
    assert!(generated_secrets().contains_key("lockstep-metrics-token"));
    let monitor = docs.iter().find(|d| d["kind"] == "ServiceMonitor").unwrap();
    let service = documents()
        .into_iter()
        .find(|(_, d)| d["kind"] == "Service")
        .unwrap()
        .1;
    // It selects the Service, on a port the Service names.
    for (k, v) in monitor["spec"]["selector"]["matchLabels"]
        .as_object()
        .unwrap()
    {
        assert_eq!(&service["metadata"]["labels"][k], v, "{k}");
    }
    let endpoint = &monitor["spec"]["endpoints"][0];
    assert!(service["spec"]["ports"]
        .as_array()
        .unwrap()
        .iter()
        .any(|p| p["name"] == endpoint["port"]));
    assert_eq!(endpoint["path"], "/metrics");
    assert_eq!(endpoint["authorization"], credentials);
    let scrape = docs.iter().find(|d| d["kind"] == "ScrapeConfig").unwrap();
    assert_eq!(scrape["spec"]["authorization"], credentials);
    let sd = &scrape["spec"]["httpSDConfigs"][0];
    assert_eq!(sd["authorization"], credentials);
    let name = service["metadata"]["name"].as_str().unwrap();
    let at = format!(
        "{name}.{}.svc:9090",
        kustomization()["namespace"].as_str().unwrap()
    );
    assert_eq!(sd["url"], format!("http://{at}/metrics/targets").as_str());
    assert_eq!(scrape["spec"]["relabelings"][0]["replacement"], at.as_str());
}

/// The value of `--NAME=VALUE` in `args`.
fn flag<'a>(args: &'a [String], name: &str) -> Option<&'a str> {
    args.iter()
        .find_map(|a| a.strip_prefix(&format!("--{name}=")))
}

/// The port a probe checks, if it is an HTTP GET of /healthz (-1 for a
/// named port).
fn probe_port(p: &Probe) -> Option<i32> {
    let h = p.http_get.as_ref()?;
    (h.path.as_deref() == Some(lockstep_metrics_http::HEALTH_PATH)).then_some(match &h.port {
        IntOrString::Int(n) => *n,
        IntOrString::String(_) => -1,
    })
}

/// Requests and limits for CPU and memory.
fn has_requests_and_limits(c: &Container) {
    let r = c
        .resources
        .as_ref()
        .unwrap_or_else(|| panic!("container {} has no resources", c.name));
    for (what, m) in [("requests", &r.requests), ("limits", &r.limits)] {
        let m = m
            .as_ref()
            .unwrap_or_else(|| panic!("container {}: no {what}", c.name));
        for res in ["cpu", "memory"] {
            assert!(m.contains_key(res), "container {}: no {what}.{res}", c.name);
        }
    }
}

/// Non-root as the image's user (10001), no privilege escalation, every
/// capability dropped, a read-only root filesystem.
fn restricted(pod: &PodSpec, c: &Container) {
    let psc = pod
        .security_context
        .as_ref()
        .expect("a pod securityContext");
    assert_eq!(psc.run_as_non_root, Some(true), "runAsNonRoot");
    assert_eq!(psc.run_as_user, Some(10001), "the Containerfile's uid");
    assert_eq!(
        psc.seccomp_profile.as_ref().map(|s| s.type_.as_str()),
        Some("RuntimeDefault")
    );
    let sc = c
        .security_context
        .as_ref()
        .unwrap_or_else(|| panic!("container {}: no securityContext", c.name));
    assert_eq!(sc.allow_privilege_escalation, Some(false), "{}", c.name);
    assert_ne!(sc.privileged, Some(true), "{}", c.name);
    assert_eq!(sc.read_only_root_filesystem, Some(true), "{}", c.name);
    assert_eq!(
        sc.capabilities.as_ref().and_then(|c| c.drop.clone()),
        Some(vec!["ALL".to_string()]),
        "{}",
        c.name
    );
    assert!(
        sc.capabilities
            .as_ref()
            .and_then(|c| c.add.as_ref())
            .is_none(),
        "{}: no capability added",
        c.name
    );
}

/// The Deployment starts and can be operated: probes, resources, security,
/// persistent state, a Service for the API and the metrics.
fn operable(d: &Deployment, service: &Service, claim: &PersistentVolumeClaim) {
    let spec = d.spec.as_ref().unwrap();
    let pod_labels = spec
        .template
        .metadata
        .as_ref()
        .unwrap()
        .labels
        .clone()
        .unwrap();
    let pod = spec.template.spec.as_ref().unwrap();
    let c = &pod.containers[0];
    let args = c.args.clone().unwrap();
    let port_of = |flag_name: &str| -> i32 {
        flag(&args, flag_name)
            .and_then(|a| a.rsplit_once(':'))
            .and_then(|(_, p)| p.parse().ok())
            .unwrap_or_else(|| panic!("no --{flag_name}=HOST:PORT in {args:?}"))
    };
    // The replicas' objects are owned by the Deployment that controls this
    // very pod, found from the pod's own name (the downward API): no
    // object's name in the arguments, so a namePrefix changes nothing.
    assert_eq!(
        flag(&args, "kubernetes-owner"),
        Some("Pod/$(LOCKSTEP_POD_NAME)"),
        "{args:?}"
    );
    let pod_name = c
        .env
        .iter()
        .flatten()
        .find(|e| e.name == "LOCKSTEP_POD_NAME")
        .and_then(|e| e.value_from.as_ref()?.field_ref.as_ref())
        .map(|f| f.field_path.clone());
    assert_eq!(pod_name.as_deref(), Some("metadata.name"));
    let api_port = port_of("listen");
    let metrics_port = port_of("metrics-listen");
    let named = |n: i32| {
        c.ports
            .iter()
            .flatten()
            .find(|p| p.container_port == n)
            .and_then(|p| p.name.clone())
            .unwrap_or_else(|| panic!("port {n} is not a named container port"))
    };
    let (api_name, metrics_name) = (named(api_port), named(metrics_port));

    // Probes on GET /healthz of the metrics port (open without a token,
    // plain HTTP): not grpc probes, which cannot speak the API's TLS once
    // an overlay turns it on.
    for (what, probe) in [
        ("startup", &c.startup_probe),
        ("readiness", &c.readiness_probe),
        ("liveness", &c.liveness_probe),
    ] {
        let probe = probe.as_ref().unwrap_or_else(|| panic!("no {what} probe"));
        assert!(
            probe.grpc.is_none(),
            "{what}: a grpc probe breaks under TLS"
        );
        let port = probe_port(probe).unwrap_or_else(|| panic!("{what}: not GET /healthz"));
        assert!(
            port == metrics_port
                || IntOrString::String(metrics_name.clone())
                    == probe.http_get.as_ref().unwrap().port,
            "{what} probe on port {port}, not the metrics port"
        );
    }

    // The kubelet's SIGKILL comes after the environment's own grace period.
    let grace: i64 = flag(&args, "shutdown-grace-secs")
        .map_or(5, |g| g.parse().expect("--shutdown-grace-secs is a number"));
    let kill_after = pod.termination_grace_period_seconds.unwrap_or(30);
    assert!(
        kill_after > grace,
        "terminationGracePeriodSeconds {kill_after} must exceed --shutdown-grace-secs {grace}"
    );

    // Requests and limits, a restricted securityContext, for every container.
    for c in pod.init_containers.iter().flatten().chain(&pod.containers) {
        has_requests_and_limits(c);
        restricted(pod, c);
    }

    // The state directory is on the shipped PersistentVolumeClaim, not an
    // emptyDir.
    let state_dir = flag(&args, "state-dir").expect("--state-dir");
    let mounts = c.volume_mounts.clone().unwrap_or_default();
    let mount = mounts
        .iter()
        .filter(|m| state_dir.starts_with(&m.mount_path))
        .max_by_key(|m| m.mount_path.len())
        .unwrap_or_else(|| panic!("{state_dir} is on no volume"));
    assert_ne!(mount.read_only, Some(true), "the state volume is writable");
    let volume = pod
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == mount.name)
        .unwrap();
    assert!(
        volume.empty_dir.is_none(),
        "the state dir is not an emptyDir"
    );
    let pvc = volume
        .persistent_volume_claim
        .as_ref()
        .expect("the state dir is on a PersistentVolumeClaim");
    assert_eq!(Some(&pvc.claim_name), claim.metadata.name.as_ref());
    // fsGroup makes the volume's root group-writable, which `lockstep
    // serve` refuses: the state is a subdirectory of it, which serve makes
    // with mode 0700 (the image has no mkdir for an init container).
    let below = state_dir
        .strip_prefix(mount.mount_path.trim_end_matches('/'))
        .unwrap_or_default()
        .trim_matches('/');
    assert!(
        !below.is_empty() && !below.contains('/'),
        "{state_dir} is one directory below the volume's root {}",
        mount.mount_path
    );
    assert!(
        pod.init_containers.iter().flatten().next().is_none(),
        "no init container: the image has no shell or mkdir"
    );
    // With a read-only root, /tmp is a volume too.
    assert!(mounts.iter().any(|m| m.mount_path == "/tmp"), "{mounts:?}");

    // A Service selecting the pod, with the API and the metrics ports.
    let sspec = service.spec.as_ref().unwrap();
    let selector = sspec.selector.clone().expect("a selector");
    assert!(
        selector.iter().all(|(k, v)| pod_labels.get(k) == Some(v)),
        "the Service {selector:?} does not select the pod {pod_labels:?}"
    );
    let targets: Vec<IntOrString> = sspec
        .ports
        .iter()
        .flatten()
        .map(|p| p.target_port.clone().unwrap_or(IntOrString::Int(p.port)))
        .collect();
    for (port, name) in [(api_port, &api_name), (metrics_port, &metrics_name)] {
        assert!(
            targets.contains(&IntOrString::Int(port))
                || targets.contains(&IntOrString::String(name.clone())),
            "the Service does not reach port {port} ({name}): {targets:?}"
        );
    }
    assert!(
        !args.iter().any(|a| a.starts_with("--metrics-listen=127.")),
        "metrics on loopback are unreachable from the Service"
    );
}

/// The API group, resource and RBAC verb of a recorded request
/// (`/api/v1/namespaces/NS/RESOURCE[/NAME]`: the core group "";
/// `/apis/GROUP/VERSION/namespaces/NS/RESOURCE[/NAME]`: GROUP).
fn verb(r: &RecordedRequest) -> (String, String, &'static str) {
    let parts: Vec<&str> = r.path.trim_matches('/').split('/').collect();
    let group = if parts[0] == "apis" { parts[1] } else { "" }.to_string();
    let ns = parts
        .iter()
        .position(|p| *p == "namespaces")
        .expect("namespaced");
    let resource = parts[ns + 2].to_string();
    let item = parts.len() > ns + 3;
    let verb = match (&r.method, item) {
        (&Method::GET, true) => "get",
        (&Method::GET, false) if r.query.contains_key("watch") => "watch",
        (&Method::GET, false) => "list",
        (&Method::POST, _) => "create",
        (&Method::PUT, _) => "update",
        (&Method::DELETE, _) => "delete",
        _ => "unknown",
    };
    (group, resource, verb)
}

#[tokio::test]
async fn the_role_grants_exactly_what_the_backend_uses() {
    // Every operation of the trait, on the double, recording the requests.
    let api = ApiServerDouble::new();
    let mut c = KubernetesOrchestratorConfig::new("lockstep", 1);
    c.poll_interval = Duration::from_millis(5);
    let o = KubernetesOrchestrator::new(api.client("lockstep"), c.clone());
    let mut events = o.watch_services();
    // `lockstep serve --kubernetes-owner Pod/NAME` reads its pod, the pod's
    // ReplicaSet and their Deployment.
    let deployment = api
        .create(
            "deployments",
            "lockstep",
            serde_json::json!({"metadata": {"name": "lockstep-environment"}, "spec": {}}),
        )
        .unwrap();
    let controlled_by = |kind: &str, object: &serde_json::Value| {
        serde_json::json!([{"apiVersion": "apps/v1", "kind": kind,
            "name": object["metadata"]["name"], "uid": object["metadata"]["uid"], "controller": true}])
    };
    let replica_set = api
        .create(
            "replicasets",
            "lockstep",
            serde_json::json!({"metadata": {"name": "lockstep-environment-7c9",
                "ownerReferences": controlled_by("Deployment", &deployment)}, "spec": {}}),
        )
        .unwrap();
    api.create(
        "pods",
        "lockstep",
        serde_json::json!({"metadata": {"name": "lockstep-environment-7c9-x2",
            "ownerReferences": controlled_by("ReplicaSet", &replica_set)}, "spec": {"containers": []}}),
    )
    .unwrap();
    let owner = lockstep_orchestrator_kubernetes::owner_of(
        api.client("lockstep"),
        "lockstep",
        "Pod/lockstep-environment-7c9-x2",
    )
    .await
    .unwrap();
    assert_eq!(
        (
            owner.kind.as_str(),
            owner.name.as_str(),
            Some(owner.uid.as_str())
        ),
        (
            "Deployment",
            "lockstep-environment",
            deployment["metadata"]["uid"].as_str()
        )
    );
    // A pod no ReplicaSet controls names no Deployment: an error saying so.
    api.create(
        "pods",
        "lockstep",
        serde_json::json!({"metadata": {"name": "bare"}, "spec": {"containers": []}}),
    )
    .unwrap();
    let e =
        lockstep_orchestrator_kubernetes::owner_of(api.client("lockstep"), "lockstep", "Pod/bare")
            .await
            .unwrap_err();
    assert!(e.contains("not controlled by a ReplicaSet"), "{e}");
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
    let used: BTreeSet<(String, String, &str)> = api.requests().iter().map(verb).collect();

    let role: Role = documents()
        .into_iter()
        .find(|(_, d)| d["kind"] == "Role")
        .map(|(f, d)| round_trip(&f, &d))
        .unwrap();
    let granted: BTreeSet<(String, String, &str)> = role
        .rules
        .unwrap()
        .iter()
        .flat_map(|r| {
            let groups = r.api_groups.clone().unwrap_or_default();
            assert_eq!(groups.len(), 1, "one API group per rule: {groups:?}");
            let group = groups[0].clone();
            let verbs: Vec<&'static str> = r
                .verbs
                .iter()
                .map(|v| &*Box::leak(v.clone().into_boxed_str()))
                .collect();
            r.resources
                .clone()
                .unwrap()
                .into_iter()
                .flat_map(move |res| {
                    let group = group.clone();
                    verbs
                        .clone()
                        .into_iter()
                        .map(move |v| (group.clone(), res.clone(), v))
                })
        })
        .collect();
    assert_eq!(granted, used, "the Role must grant exactly the verbs used");
}
