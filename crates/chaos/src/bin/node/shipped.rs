//! `lockstep-chaos-node shipped`: the environment as the example overlay
//! deploys it (in the cluster, its catalog on PostgreSQL or on SQLite on its
//! PVC, `LOCKSTEP_SHIPPED_VARIANT`; `cargo xtask kube` applied it), driven
//! from this host at its pod's IP with the token of its Secret
//! (`LOCKSTEP_SHIPPED_TOKEN`, in `LOCKSTEP_SHIPPED_NAMESPACE`), over the
//! TLS the overlay turns on (its certificate checked against
//! `LOCKSTEP_SHIPPED_API_CA` for the Service's DNS name):
//!
//! - `create`: a 2 x 2 replica (the Deployment's replica requests, 500m a
//!   pod, fit two on two cores) and a dataflow; writes answered, both
//!   exports right (I3), its pods one ready generation (I2);
//! - `scraped`: `deploy/prometheus/scrape.yaml` carried out with the
//!   metrics token read back from its Secret (`super::scrape`): the
//!   environment and each replica process, one `instance` each, and
//!   nothing without the token (R1); then Prometheus itself, in a pod,
//!   with the same configuration and the Secret mounted
//!   (`super::prometheus`): every target up, each process its own
//!   `instance`;
//! - `environment-pod-deleted`: the environment's pod deleted; the
//!   Deployment makes another, which adopts the replica (the same pod uids
//!   and restart counts: O1, nothing rebuilt) and answers right within
//!   [`super::RECOVERY`] of being ready.

use std::time::{Duration, Instant};

use lockstep_chaos::environment::real_kube::RealCluster;
use lockstep_chaos::outcome::{violation, Failure};

use super::pods;
use super::workload::{Api, Workload};
use super::{harness, timed, Scenario, RECOVERY, SET_UP};

/// The scenarios a run has (one cut short reports fewer, which fails).
pub const SCENARIOS: usize = 3;

/// The environment pods' label.
const SELECTOR: &str = "app.kubernetes.io/name=lockstep,app.kubernetes.io/component=environment";
/// The replica's service.
const SERVICE: &str = "replica-1";
/// The replica's processes.
const PROCESSES: u32 = 2;

/// The name and IP of the environment's ready pod (not `not`), waited for
/// within `bound`.
async fn environment_pod(
    cluster: &RealCluster,
    ns: &str,
    not: Option<&str>,
    bound: Duration,
) -> Result<(String, String), Failure> {
    let deadline = Instant::now() + bound;
    let mut last = String::new();
    loop {
        let out = cluster
            .kubectl_out(&["get", "pods", "-n", ns, "-l", SELECTOR, "-o", "json"])
            .map_err(|e| harness(format!("{e:#}")))?;
        let list: serde_json::Value = serde_json::from_str(&out)
            .map_err(|e| harness(format!("kubectl printed no JSON: {e}")))?;
        for p in list["items"].as_array().into_iter().flatten() {
            let name = p["metadata"]["name"].as_str().unwrap_or("");
            let ready = p["status"]["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|c| c["type"] == "Ready" && c["status"] == "True");
            let deleting = !p["metadata"]["deletionTimestamp"].is_null();
            if ready && !deleting && Some(name) != not {
                if let Some(ip) = p["status"]["podIP"].as_str() {
                    return Ok((name.to_string(), ip.to_string()));
                }
            }
            last = format!("{name}: ready {ready}, deleting {deleting}");
        }
        if Instant::now() >= deadline {
            return Err(violation(
                "I2",
                format!(
                    "no ready environment pod within {} s ({last})",
                    bound.as_secs()
                ),
            ));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// The pods of the replica as one ready generation, within [`RECOVERY`].
async fn one_generation(cluster: &RealCluster, ns: &str) -> Result<(), Failure> {
    pods::await_one_generation(cluster, ns, SERVICE, PROCESSES as usize, &[], RECOVERY)
        .await
        .map(drop)
}

/// The scenarios; see the module docs.
pub async fn run(cluster: &RealCluster) -> Vec<Scenario> {
    let mut out = Vec::new();
    let variant = std::env::var("LOCKSTEP_SHIPPED_VARIANT").unwrap_or_else(|_| "postgres".into());
    let variant = variant.as_str();
    let (ns, token) = match (
        std::env::var("LOCKSTEP_SHIPPED_NAMESPACE"),
        std::env::var("LOCKSTEP_SHIPPED_TOKEN"),
    ) {
        (Ok(ns), Ok(token)) => (ns, token),
        _ => {
            out.push(Scenario {
                name: "create",
                result: Err(harness(
                    "LOCKSTEP_SHIPPED_NAMESPACE and LOCKSTEP_SHIPPED_TOKEN must be set (cargo xtask kube sets them)",
                )),
                seconds: 0.0,
            });
            return out;
        }
    };
    // The overlay turns the API's TLS on: its certificate names the
    // Service, and is its own CA (LOCKSTEP_SHIPPED_API_CA).
    let tls = match std::env::var("LOCKSTEP_SHIPPED_API_CA").map(std::fs::read_to_string) {
        Ok(Ok(ca)) => (ca, format!("lockstep-environment.{ns}.svc")),
        _ => {
            out.push(Scenario {
                name: "create",
                result: Err(harness(
                    "LOCKSTEP_SHIPPED_API_CA must name the API certificate's CA file (cargo xtask kube sets it)",
                )),
                seconds: 0.0,
            });
            return out;
        }
    };
    let api = |ip: &str| Api {
        url: format!("https://{ip}:6875"),
        token: Some(token.clone()),
        tls: Some(tls.clone()),
    };

    let started = Instant::now();
    let mut first = None;
    let mut w = None;
    let result = async {
        let (pod, ip) = environment_pod(cluster, &ns, None, SET_UP).await?;
        first = Some((pod, ip.clone()));
        let workload = w.insert(Workload::new(api(&ip)));
        workload.set_up(PROCESSES, 2, SET_UP).await?;
        for _ in 0..3 {
            workload.write(SET_UP, "I2").await?;
        }
        workload.check(SET_UP, "I2").await?;
        one_generation(cluster, &ns).await
    }
    .await;
    if timed(&mut out, variant, "create", started, result) {
        return out;
    }
    let (Some((first, first_ip)), Some(mut w)) = (first, w) else {
        return out;
    };

    let started = Instant::now();
    let result = async {
        let deploy = std::env::var("LOCKSTEP_SHIPPED_DEPLOY").map_err(|_| {
            harness("LOCKSTEP_SHIPPED_DEPLOY must name the deploy/ directory applied (cargo xtask kube sets it)")
        })?;
        let token = super::scrape::metrics_token(cluster, &ns)?;
        super::scrape::scrape_as_shipped(
            std::path::Path::new(&deploy),
            &first_ip,
            &token,
            PROCESSES as usize,
        )
        .await?;
        super::prometheus::scrapes_as_shipped(
            cluster,
            &ns,
            std::path::Path::new(&deploy),
            &first_ip,
            PROCESSES as usize,
        )
        .await
    }
    .await;
    timed(&mut out, variant, "scraped", started, result);

    let started = Instant::now();
    let result = async {
        let before = pods::pods(cluster, &ns, SERVICE).map_err(|e| harness(format!("{e:#}")))?;
        cluster
            .kubectl_out(&["delete", "pod", &first, "-n", &ns, "--wait=false"])
            .map_err(|e| harness(format!("{e:#}")))?;
        let (_, ip) = environment_pod(cluster, &ns, Some(&first), SET_UP).await?;
        w.set_api(api(&ip));
        w.write_and_check(RECOVERY, "I2").await?;
        one_generation(cluster, &ns).await?;
        let after = pods::pods(cluster, &ns, SERVICE).map_err(|e| harness(format!("{e:#}")))?;
        pods::adopted(&before, &after, "by the new environment pod")
    }
    .await;
    timed(
        &mut out,
        variant,
        "environment-pod-deleted",
        started,
        result,
    );
    out
}
