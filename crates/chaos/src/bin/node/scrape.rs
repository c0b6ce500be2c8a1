//! The shipped Prometheus scrape configuration (`deploy/prometheus/
//! scrape.yaml`, as copied by `cargo xtask kube`: `LOCKSTEP_SHIPPED_DEPLOY`)
//! carried out against the environment the example overlay deployed, with
//! the metrics token read back from its Secret (`lockstep-metrics-token`),
//! as Prometheus would: each job's targets (static, or from its HTTP service
//! discovery), its relabelling, its bearer credential.
//!
//! This reads the configuration's own fields and refuses any it does not
//! understand (a harness error), so a change to the file that this cannot
//! carry out fails rather than passes unread; it checks what each scrape
//! returns (OpenMetrics, `build_info`, `process_*`), and that nothing is
//! served without the token. Prometheus itself then runs the same file
//! (`super::prometheus`). The Service's DNS name is the
//! one thing replaced: this host is outside the cluster's DNS, so
//! `lockstep-environment.NAMESPACE.svc:PORT` is the environment pod's IP at
//! that port (the Service's only endpoint).

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use lockstep_chaos::environment::real_kube::RealCluster;
use lockstep_chaos::outcome::{violation, Failure};
use serde_json::Value;

use super::harness;

/// One scrape's bound.
const SCRAPE: Duration = Duration::from_secs(10);

/// The metrics token, read back from the Secret the Deployment mounts.
pub fn metrics_token(cluster: &RealCluster, ns: &str) -> Result<String, Failure> {
    let token = cluster
        .kubectl_out(&[
            "get",
            "secret",
            "lockstep-metrics-token",
            "-n",
            ns,
            "-o",
            "go-template={{.data.token | base64decode}}",
        ])
        .map_err(|e| harness(format!("{e:#}")))?;
    Ok(token.trim().to_string())
}

/// Carries out every job of `prometheus/scrape.yaml` under `deploy` (the
/// copied `deploy/`) against the environment
/// pod at `pod_ip` with `token`; `processes` replica processes must be
/// discovered, each its own `instance`.
pub async fn scrape_as_shipped(
    deploy: &Path,
    pod_ip: &str,
    token: &str,
    processes: usize,
) -> Result<(), Failure> {
    let path = deploy.join("prometheus/scrape.yaml");
    let text = std::fs::read_to_string(&path)
        .map_err(|e| harness(format!("reading {}: {e}", path.display())))?;
    let config: Value = serde_yaml_ng::from_str(&text)
        .map_err(|e| harness(format!("{}: not YAML: {e}", path.display())))?;
    let jobs = config["scrape_configs"]
        .as_array()
        .ok_or_else(|| harness("scrape.yaml has no scrape_configs"))?;
    let mut environment_scraped = false;
    let mut instances = BTreeSet::new();
    for job in jobs {
        let name = job["job_name"].as_str().unwrap_or("?");
        understood(job, name)?;
        if job["authorization"]["credentials_file"].as_str().is_none() {
            return Err(violation(
                "R1",
                format!("job {name} sends no credential: /metrics asks the metrics token"),
            ));
        }
        // (address, path, instance) per target.
        let mut targets: Vec<(String, String, String)> = Vec::new();
        for s in job["static_configs"].as_array().into_iter().flatten() {
            for t in s["targets"].as_array().into_iter().flatten() {
                let t = t.as_str().unwrap_or_default().to_string();
                targets.push((t.clone(), "/metrics".into(), t));
            }
        }
        for sd in job["http_sd_configs"].as_array().into_iter().flatten() {
            let url = sd["url"].as_str().unwrap_or_default();
            let rest = url
                .strip_prefix("http://")
                .ok_or_else(|| harness(format!("job {name}: {url} is not http://")))?;
            let (at, sd_path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
            if sd["authorization"]["credentials_file"].as_str().is_none() {
                return Err(violation(
                    "R1",
                    format!("job {name}: its discovery sends no credential"),
                ));
            }
            let doc = get(pod_ip, at, sd_path, token).await?;
            let groups: Value = serde_json::from_str(&doc).map_err(|e| {
                violation("R1", format!("job {name}: discovery answered no JSON: {e}"))
            })?;
            for g in groups.as_array().into_iter().flatten() {
                let labels = &g["labels"];
                let path = labels["__metrics_path__"].as_str().unwrap_or("/metrics");
                for t in g["targets"].as_array().into_iter().flatten() {
                    let t = t.as_str().unwrap_or_default().to_string();
                    let instance = labels["instance"].as_str().unwrap_or(&t).to_string();
                    targets.push((t, path.to_string(), instance));
                }
            }
        }
        // The relabelling: a fixed replacement of a target label.
        for r in job["relabel_configs"].as_array().into_iter().flatten() {
            if r["target_label"] == "__address__" {
                let to = r["replacement"].as_str().unwrap_or_default().to_string();
                for t in &mut targets {
                    t.0 = to.clone();
                }
            }
        }
        if targets.is_empty() {
            return Err(violation("R1", format!("job {name} found no target")));
        }
        for (address, path, instance) in &targets {
            let text = get(pod_ip, address, path, token).await?;
            if !text.trim_end().ends_with("# EOF") {
                return Err(violation(
                    "R1",
                    format!("job {name}: {path} is no OpenMetrics exposition"),
                ));
            }
            if text.contains("\nlockstep_environment_build_info{") {
                environment_scraped = true;
            } else if !text.contains("\nlockstep_replica_build_info{") {
                return Err(violation(
                    "R1",
                    format!("job {name}: {path} names no build"),
                ));
            } else if !instances.insert(instance.clone()) {
                return Err(violation(
                    "R1",
                    format!("job {name}: instance {instance} is two targets"),
                ));
            }
            if !text.contains("\nprocess_resident_memory_bytes ") {
                return Err(violation(
                    "R1",
                    format!("job {name}: {path} has no process_* series"),
                ));
            }
        }
    }
    if !environment_scraped || instances.len() != processes {
        return Err(violation(
            "R1",
            format!(
                "the environment scraped: {environment_scraped}; replica processes scraped as their own instances: {instances:?}, want {processes}"
            ),
        ));
    }
    // Without the token, nothing.
    let addr = pod_addr(pod_ip, "lockstep-environment.x.svc:9090")?;
    match lockstep_metrics_http::fetch(addr, None, SCRAPE).await {
        Err(e) if e.contains("401") => Ok(()),
        other => Err(violation(
            "R1",
            format!("/metrics without the token: {other:?}"),
        )),
    }
}

/// Refuses what this does not carry out, so that nothing is passed unread.
fn understood(job: &Value, name: &str) -> Result<(), Failure> {
    const KNOWN: [&str; 5] = [
        "job_name",
        "authorization",
        "static_configs",
        "http_sd_configs",
        "relabel_configs",
    ];
    for key in job.as_object().into_iter().flatten().map(|(k, _)| k) {
        if !KNOWN.contains(&key.as_str()) {
            return Err(harness(format!(
                "job {name}: {key} is not carried out by this check; teach it"
            )));
        }
    }
    for r in job["relabel_configs"].as_array().into_iter().flatten() {
        if r.as_object()
            .is_some_and(|o| o.keys().any(|k| k != "target_label" && k != "replacement"))
            || r["target_label"] != "__address__"
        {
            return Err(harness(format!(
                "job {name}: relabelling {r} is not carried out by this check; teach it"
            )));
        }
    }
    Ok(())
}

/// The pod's address for the Service address `at`
/// (`lockstep-environment.NAMESPACE.svc:PORT`; see the module docs).
fn pod_addr(pod_ip: &str, at: &str) -> Result<SocketAddr, Failure> {
    let (host, port) = at
        .rsplit_once(':')
        .ok_or_else(|| harness(format!("{at}: no port")))?;
    if !host.starts_with("lockstep-environment.") {
        return Err(violation(
            "R1",
            format!("{at} is not the environment's Service"),
        ));
    }
    format!("{pod_ip}:{port}")
        .parse()
        .map_err(|e| harness(format!("{pod_ip}:{port}: {e}")))
}

/// GET `path` from the Service address `at`, with the token.
async fn get(pod_ip: &str, at: &str, path: &str, token: &str) -> Result<String, Failure> {
    let addr = pod_addr(pod_ip, at)?;
    lockstep_metrics_http::fetch_path(addr, path, Some(token), SCRAPE)
        .await
        .map_err(|e| {
            violation(
                "R1",
                format!("GET {path} at {at} with the metrics token: {e}"),
            )
        })
}
