//! Prometheus itself scraping the environment the example overlay deployed,
//! with the shipped configuration: `deploy/prometheus/scrape.yaml` (as
//! copied by `cargo xtask kube`, `LOCKSTEP_SHIPPED_DEPLOY`) with a scrape
//! interval of 2 s, and the metrics token's Secret mounted at the path the
//! configuration names. Prometheus runs as a pod of the real node (its
//! image: `LOCKSTEP_PROMETHEUS_IMAGE`, built by `cargo xtask kube` from
//! tools/kube/prometheus). One thing is replaced: the Service's address
//! (`lockstep-environment.lockstep.svc`), by the environment pod's IP. The
//! test node runs no kube-proxy, so a Service's ClusterIP routes nowhere
//! (found by the first run: every scrape of the Service's name timed out).
//! Passes when Prometheus reports the environment and every replica
//! process as healthy targets, each process its own `instance`, and its
//! query of `lockstep_replica_build_info` counts every process.

use std::path::Path;
use std::time::{Duration, Instant};

use lockstep_chaos::environment::real_kube::RealCluster;
use lockstep_chaos::outcome::{violation, Failure};
use serde_json::Value;

use super::harness;

/// How long Prometheus has to start and report every target up (its
/// discovery runs at start; the scrape interval is 2 s).
const UP: Duration = Duration::from_secs(90);
/// The pod's name.
const POD: &str = "prometheus";
/// The address the shipped configuration names, in the base's namespace.
const SHIPPED_ADDRESS: &str = "lockstep-environment.lockstep.svc";

/// See the module docs: the environment's pod is at `pod_ip`; `processes`
/// replica processes must be targets.
pub async fn scrapes_as_shipped(
    cluster: &RealCluster,
    ns: &str,
    deploy: &Path,
    pod_ip: &str,
    processes: usize,
) -> Result<(), Failure> {
    let image = std::env::var("LOCKSTEP_PROMETHEUS_IMAGE").map_err(|_| {
        harness("LOCKSTEP_PROMETHEUS_IMAGE must name Prometheus' image on the node (cargo xtask kube sets it)")
    })?;
    let path = deploy.join("prometheus/scrape.yaml");
    let shipped = std::fs::read_to_string(&path)
        .map_err(|e| harness(format!("reading {}: {e}", path.display())))?;
    if !shipped.contains(SHIPPED_ADDRESS) {
        return Err(harness(format!(
            "{} names no {SHIPPED_ADDRESS}: teach this check where its addresses are",
            path.display()
        )));
    }
    let config = format!(
        "global:\n  scrape_interval: 2s\n  scrape_timeout: 2s\n{}",
        shipped.replace(SHIPPED_ADDRESS, pod_ip)
    );
    let dir = tempfile::tempdir().map_err(|e| harness(format!("a temporary directory: {e}")))?;
    let config_file = dir.path().join("prometheus.yml");
    let pod_file = dir.path().join("pod.yaml");
    std::fs::write(&config_file, config).map_err(|e| harness(e.to_string()))?;
    std::fs::write(&pod_file, pod(ns, &image)).map_err(|e| harness(e.to_string()))?;
    let kubectl = |args: &[&str]| {
        cluster
            .kubectl_out(args)
            .map_err(|e| harness(format!("{e:#}")))
    };
    kubectl(&[
        "create",
        "configmap",
        "prometheus-config",
        "-n",
        ns,
        &format!("--from-file=prometheus.yml={}", config_file.display()),
    ])?;
    kubectl(&["apply", "-f", &pod_file.display().to_string()])?;
    let result = targets_up(cluster, ns, processes).await;
    let _ = kubectl(&["delete", "pod", POD, "-n", ns, "--wait=false"]);
    let _ = kubectl(&["delete", "configmap", "prometheus-config", "-n", ns]);
    result
}

/// The Prometheus pod: restricted (the namespace enforces it), the
/// configuration from its ConfigMap, the metrics token's Secret where the
/// configuration reads it, its storage an emptyDir.
fn pod(ns: &str, image: &str) -> String {
    format!(
        r#"apiVersion: v1
kind: Pod
metadata:
  name: {POD}
  namespace: {ns}
  labels:
    app.kubernetes.io/name: prometheus
spec:
  securityContext:
    runAsNonRoot: true
    runAsUser: 65534
    runAsGroup: 65534
    fsGroup: 65534
    seccompProfile:
      type: RuntimeDefault
  containers:
    - name: prometheus
      image: {image}
      imagePullPolicy: Never
      args:
        - --config.file=/etc/prometheus/config/prometheus.yml
        - --storage.tsdb.path=/prometheus
        - --web.listen-address=:9090
      resources:
        requests:
          cpu: 50m
          memory: 64Mi
        limits:
          memory: 512Mi
      securityContext:
        allowPrivilegeEscalation: false
        readOnlyRootFilesystem: true
        capabilities:
          drop: ["ALL"]
      volumeMounts:
        - name: config
          mountPath: /etc/prometheus/config
        - name: metrics-token
          mountPath: /etc/prometheus/lockstep-metrics.token
          subPath: token
        - name: data
          mountPath: /prometheus
  volumes:
    - name: config
      configMap:
        name: prometheus-config
    - name: metrics-token
      secret:
        secretName: lockstep-metrics-token
    - name: data
      emptyDir: {{}}
"#
    )
}

/// Waits (within [`UP`]) until Prometheus reports the environment and
/// `processes` replica processes up, then checks its query counts them.
async fn targets_up(cluster: &RealCluster, ns: &str, processes: usize) -> Result<(), Failure> {
    let deadline = Instant::now() + UP;
    let mut last = String::from("the pod has no IP yet");
    loop {
        if let Some(ip) = pod_ip(cluster, ns)? {
            match fetch(&ip, "/api/v1/targets?state=active").await {
                Ok(doc) => match healthy(&doc, processes) {
                    Ok(()) => return counted(&ip, processes).await,
                    Err(why) => last = why,
                },
                Err(e) => last = e,
            }
        }
        if Instant::now() >= deadline {
            return Err(violation(
                "R1",
                format!(
                    "Prometheus with the shipped configuration did not scrape every target within {} s: {last}",
                    UP.as_secs()
                ),
            ));
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// The Prometheus pod's IP once it runs.
fn pod_ip(cluster: &RealCluster, ns: &str) -> Result<Option<String>, Failure> {
    let out = cluster
        .kubectl_out(&["get", "pod", POD, "-n", ns, "-o", "json"])
        .map_err(|e| harness(format!("{e:#}")))?;
    let pod: Value =
        serde_json::from_str(&out).map_err(|e| harness(format!("kubectl printed no JSON: {e}")))?;
    Ok((pod["status"]["phase"] == "Running")
        .then(|| pod["status"]["podIP"].as_str().map(String::from))
        .flatten())
}

/// GET `path` of Prometheus' API at `ip`.
async fn fetch(ip: &str, path: &str) -> Result<String, String> {
    let addr = format!("{ip}:9090")
        .parse()
        .map_err(|e| format!("{ip}: {e}"))?;
    lockstep_metrics_http::fetch_path(addr, path, None, Duration::from_secs(5)).await
}

/// Whether the targets document shows the environment's job and
/// `processes` replica targets (distinct instances) all up; else what is
/// missing, with Prometheus' own last errors.
fn healthy(doc: &str, processes: usize) -> Result<(), String> {
    let doc: Value = serde_json::from_str(doc).map_err(|e| format!("no JSON: {e}"))?;
    let targets = doc["data"]["activeTargets"]
        .as_array()
        .ok_or_else(|| format!("no activeTargets: {doc}"))?;
    let mut environment = 0;
    let mut instances = std::collections::BTreeSet::new();
    let mut seen = Vec::new();
    for t in targets {
        let job = t["labels"]["job"].as_str().unwrap_or("?");
        let instance = t["labels"]["instance"].as_str().unwrap_or("?");
        let health = t["health"].as_str().unwrap_or("?");
        seen.push(format!(
            "{job}/{instance}: {health} {}",
            t["lastError"].as_str().unwrap_or("")
        ));
        if health != "up" {
            continue;
        }
        match job {
            "lockstep-environment" => environment += 1,
            "lockstep-replicas" => {
                instances.insert(instance.to_string());
            }
            _ => {}
        }
    }
    if environment == 1 && instances.len() == processes {
        Ok(())
    } else {
        Err(format!(
            "up: the environment {environment}, replica processes {instances:?} (want {processes}); targets: {seen:?}"
        ))
    }
}

/// Prometheus' own query counts every replica process's `build_info`.
async fn counted(ip: &str, processes: usize) -> Result<(), Failure> {
    let deadline = Instant::now() + UP;
    loop {
        let answer = fetch(ip, "/api/v1/query?query=count(lockstep_replica_build_info)").await;
        let count = answer.as_ref().ok().and_then(|doc| {
            let doc: Value = serde_json::from_str(doc).ok()?;
            doc["data"]["result"][0]["value"][1]
                .as_str()?
                .parse::<usize>()
                .ok()
        });
        if count == Some(processes) {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(violation(
                "R1",
                format!(
                    "Prometheus counts {count:?} lockstep_replica_build_info series, want {processes}: {answer:?}"
                ),
            ));
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}
