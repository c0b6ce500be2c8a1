//! What the suite reads of a replica's pods on the real node (through the
//! administrator's kubectl) and of their processes on this host (`/proc`).

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use lockstep_chaos::environment::real_kube::RealCluster;
use lockstep_chaos::outcome::{violation, Failure};
use serde_json::Value;

/// One pod of the service, as the API server holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodView {
    /// `NAME-gGENERATION-I`.
    pub name: String,
    /// Its `lockstep/process` label (the process index).
    pub process: String,
    /// Its uid.
    pub uid: String,
    /// Its `lockstep/generation` label.
    pub generation: String,
    /// Running, with every container ready.
    pub ready: bool,
    /// The sum of its containers' restart counts.
    pub restarts: i64,
    /// Being deleted.
    pub deleting: bool,
    /// The image its process container names.
    pub image: String,
}

/// The service's pods, by name.
pub fn pods(cluster: &RealCluster, ns: &str, service: &str) -> anyhow::Result<Vec<PodView>> {
    let out = cluster.kubectl_out(&[
        "get",
        "pods",
        "-n",
        ns,
        "-l",
        &format!("lockstep/service={service}"),
        "-o",
        "json",
    ])?;
    let list: Value = serde_json::from_str(&out).context("kubectl get pods printed no JSON")?;
    let mut pods: Vec<PodView> = list["items"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|p| {
            let statuses = p["status"]["containerStatuses"].as_array();
            PodView {
                name: p["metadata"]["name"].as_str().unwrap_or("").to_string(),
                uid: p["metadata"]["uid"].as_str().unwrap_or("").to_string(),
                process: p["metadata"]["labels"]["lockstep/process"]
                    .as_str()
                    .unwrap_or("")
                    .to_string(),
                generation: p["metadata"]["labels"]["lockstep/generation"]
                    .as_str()
                    .unwrap_or("")
                    .to_string(),
                ready: p["status"]["phase"] == "Running"
                    && statuses
                        .is_some_and(|s| !s.is_empty() && s.iter().all(|c| c["ready"] == true)),
                restarts: statuses
                    .into_iter()
                    .flatten()
                    .map(|c| c["restartCount"].as_i64().unwrap_or(0))
                    .sum(),
                deleting: !p["metadata"]["deletionTimestamp"].is_null(),
                image: p["spec"]["containers"][0]["image"]
                    .as_str()
                    .unwrap_or("")
                    .to_string(),
            }
        })
        .collect();
    pods.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(pods)
}

/// The service record's generation (its `lockstep/generation` annotation).
pub fn generation(cluster: &RealCluster, ns: &str, service: &str) -> anyhow::Result<u64> {
    let out = cluster.kubectl_out(&[
        "get",
        "service",
        service,
        "-n",
        ns,
        "-o",
        "jsonpath={.metadata.annotations.lockstep/generation}",
    ])?;
    out.trim()
        .parse()
        .with_context(|| format!("the record of {service} has no generation ({out:?})"))
}

/// The name of the pod of process `index` of the record's generation.
pub fn pod_of(
    cluster: &RealCluster,
    ns: &str,
    service: &str,
    index: u32,
) -> anyhow::Result<String> {
    let g = generation(cluster, ns, service)?.to_string();
    let index = index.to_string();
    pods(cluster, ns, service)?
        .into_iter()
        .find(|p| p.process == index && p.generation == g && !p.deleting)
        .map(|p| p.name)
        .with_context(|| format!("no pod of process {index} in generation {g}"))
}

/// Holds pod `name` with a finalizer: deleted, it stays terminating (as on
/// a lost node, whose kubelet never confirms the delete) until
/// [`release`].
pub fn hold(cluster: &RealCluster, ns: &str, name: &str) -> anyhow::Result<()> {
    let finalizers = format!(r#"{{"metadata":{{"finalizers":["{HOLD_FINALIZER}"]}}}}"#);
    merge_patch(cluster, ns, name, &finalizers)
}

/// `kubectl patch pod NAME --type=merge -p PATCH`.
fn merge_patch(cluster: &RealCluster, ns: &str, name: &str, patch: &str) -> anyhow::Result<()> {
    cluster.kubectl_out(&["patch", "pod", name, "-n", ns, "--type=merge", "-p", patch])?;
    Ok(())
}

/// Takes [`hold`]'s finalizer off `service`'s pod `name` (gone already:
/// nothing to do).
pub fn release(cluster: &RealCluster, ns: &str, service: &str, name: &str) -> anyhow::Result<()> {
    let there = pods(cluster, ns, service)?.iter().any(|p| p.name == name);
    if there {
        merge_patch(cluster, ns, name, r#"{"metadata":{"finalizers":null}}"#)?;
    }
    Ok(())
}

/// The finalizer [`hold`] puts on a pod.
pub const HOLD_FINALIZER: &str = "lockstep.test/held";

/// Whether the service runs as one generation: `processes` pods, none
/// being deleted, every one ready and labelled with the record's
/// generation; pods named in `beside` (held terminating) left out.
pub fn one_generation(
    cluster: &RealCluster,
    ns: &str,
    service: &str,
    processes: usize,
    beside: &[&str],
) -> anyhow::Result<Result<u64, String>> {
    let g = generation(cluster, ns, service)?;
    let mut pods = pods(cluster, ns, service)?;
    pods.retain(|p| !beside.contains(&p.name.as_str()));
    let bad: Vec<String> = pods
        .iter()
        .filter(|p| !p.ready || p.deleting || p.generation != g.to_string())
        .map(|p| {
            format!(
                "{} (generation {}, ready {}, deleting {})",
                p.name, p.generation, p.ready, p.deleting
            )
        })
        .collect();
    if pods.len() != processes || !bad.is_empty() {
        return Ok(Err(format!(
            "record generation {g}, {} pods of {processes}; not of it or not ready: {bad:?}",
            pods.len()
        )));
    }
    Ok(Ok(g))
}

/// Waits (at most `bound`) until the service runs as one ready generation
/// ([`one_generation`]); a violation of I2 if it does not (a readiness
/// probe trails the first answer, hence the wait).
pub async fn await_one_generation(
    cluster: &RealCluster,
    ns: &str,
    service: &str,
    processes: usize,
    beside: &[&str],
    bound: Duration,
) -> Result<u64, Failure> {
    let deadline = Instant::now() + bound;
    loop {
        match one_generation(cluster, ns, service, processes, beside) {
            Ok(Ok(g)) => return Ok(g),
            Ok(Err(what)) if Instant::now() >= deadline => {
                return Err(violation(
                    "I2",
                    format!(
                        "the replica's pods are not one ready generation within {} s: {what}",
                        bound.as_secs()
                    ),
                ))
            }
            Ok(Err(_)) => tokio::time::sleep(Duration::from_millis(250)).await,
            Err(e) => return Err(Failure::Harness(format!("{e:#}"))),
        }
    }
}

/// The replica was adopted, not rebuilt: its pods after (`after`) are the
/// pods before (`before`), same uids and restart counts; else a violation
/// of O1 saying `across` what.
pub fn adopted(before: &[PodView], after: &[PodView], across: &str) -> Result<(), Failure> {
    let ids = |p: &[PodView]| {
        p.iter()
            .map(|p| (p.uid.clone(), p.restarts))
            .collect::<Vec<_>>()
    };
    if ids(before) == ids(after) {
        return Ok(());
    }
    Err(violation(
        "O1",
        format!(
            "the replica was not adopted {across}: pods (uid, restarts) {:?} became {:?}",
            ids(before),
            ids(after)
        ),
    ))
}

/// Waits (at most `bound`) until the record's generation is above `above`.
pub async fn generation_above(
    cluster: &RealCluster,
    ns: &str,
    service: &str,
    above: u64,
    bound: Duration,
) -> anyhow::Result<Option<u64>> {
    let deadline = Instant::now() + bound;
    loop {
        let g = generation(cluster, ns, service)?;
        if g > above {
            return Ok(Some(g));
        }
        if Instant::now() >= deadline {
            return Ok(None);
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Calls `check` every `every` until it gives `Some`, for at most
/// `bound`: `Ok(None)` if it never did (an error of `check` ends it).
pub async fn until<T>(
    bound: Duration,
    every: Duration,
    mut check: impl FnMut() -> Result<Option<T>, Failure>,
) -> Result<Option<T>, Failure> {
    let started = Instant::now();
    loop {
        if let Some(found) = check()? {
            return Ok(Some(found));
        }
        if started.elapsed() > bound {
            return Ok(None);
        }
        tokio::time::sleep(every).await;
    }
}

/// The host PID of `lockstep-replica` in the pod with `uid` (its cgroup
/// path names the pod: `.../pod<uid>/<container>`).
pub fn replica_pid(uid: &str) -> anyhow::Result<u32> {
    let underscored = uid.replace('-', "_");
    for entry in std::fs::read_dir("/proc")?.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let argv0 = cmdline.split(|b| *b == 0).next().unwrap_or(&[]);
        if !argv0.ends_with(b"lockstep-replica") {
            continue;
        }
        let Ok(cgroup) = std::fs::read_to_string(entry.path().join("cgroup")) else {
            continue;
        };
        if cgroup.contains(&format!("pod{uid}")) || cgroup.contains(&format!("pod{underscored}")) {
            return Ok(pid);
        }
    }
    bail!("no lockstep-replica process on this host is in pod {uid}'s cgroup")
}

/// Sends `signal` to `pid`.
pub fn signal(pid: u32, signal: libc::c_int) -> anyhow::Result<()> {
    lockstep_chaos::signal::send(pid, signal).map_err(anyhow::Error::msg)
}
