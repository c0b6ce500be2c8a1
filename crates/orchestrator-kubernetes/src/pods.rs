//! Pods: created from the record's template, deleted exactly as read, and what their status says.

use super::*;

impl Inner {
    /// Deletes `pod` exactly as read (uid and resourceVersion preconditions)
    /// and waits until it is gone. `Ok(false)`: the precondition failed (409),
    /// the pod changed since it was read.
    pub(super) async fn delete_pod_as_read(&self, pod: &Pod) -> Result<bool, StateError> {
        let name = pod.name_any();
        match self.pods.delete(&name, &self.pod_delete_params(pod)).await {
            Ok(_) => {}
            Err(e) if is_conflict(&e) => return Ok(false),
            Err(e) if is_not_found(&e) => return Ok(true),
            Err(e) => return Err(api_error("delete pod", e)),
        }
        self.wait_gone(&name, pod.uid()).await?;
        Ok(true)
    }

    /// Waits (bounded by the delete timeout) until no pod `name` with
    /// `uid` exists: kube's `await_condition`, a watch of that one pod
    /// (a pod of the same name and another uid is a new one: gone).
    pub(super) async fn wait_gone(
        &self,
        name: &str,
        uid: Option<String>,
    ) -> Result<(), StateError> {
        let gone = move |p: Option<&Pod>| p.is_none_or(|p| p.uid() != uid);
        let wait = kube::runtime::wait::await_condition(self.pods.clone(), name, gone);
        let error = |source| StateError::Io {
            path: format!("kubernetes API: pod {name}").into(),
            source,
        };
        match tokio::time::timeout(self.config.delete_timeout, wait).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(error(std::io::Error::other(format!(
                "waiting for it to go after its delete: {e}"
            )))),
            Err(_) => Err(error(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!(
                    "still there {:?} after its delete",
                    self.config.delete_timeout
                ),
            ))),
        }
    }

    /// Creates every pod of `record`'s template in `generation`; `restarts`
    /// gives each one's [`RESTARTS_ANNOTATION`]. Returns (name, uid) of each.
    pub(super) async fn create_pods(
        &self,
        record: &Service,
        template: &PodTemplate,
        generation: u64,
        restarts: impl Fn(usize) -> u32,
    ) -> Result<Vec<(String, String)>, GenerationError> {
        let ctx = self.context_of(record);
        let name = record.name_any();
        let id = label_u64(record.labels(), ID_LABEL).unwrap_or(0);
        let mut created = Vec::new();
        for i in 0..template.argv.len() {
            let mut pod = objects::pod(&ctx, &name, id, template, i, generation, restarts(i));
            if let Some(uid) = record.uid() {
                pod.metadata
                    .owner_references
                    .get_or_insert_with(Vec::new)
                    .push(objects::record_controls(&name, &uid));
            }
            match self.pods.create(&PostParams::default(), &pod).await {
                Ok(p) => created.push((p.name_any(), p.uid().unwrap_or_default())),
                Err(e) if is_conflict(&e) => {
                    // Someone created it between our delete and our create.
                    let now = self.live_record(&name).await?;
                    if generation_of(&now) != generation {
                        return Err(GenerationError::Superseded);
                    }
                    return Err(api_error("create pod", e).into());
                }
                Err(e) => {
                    return Err(GenerationError::Spawn {
                        process: i,
                        program: template.program.clone(),
                        source: std::io::Error::other(e.to_string()),
                    })
                }
            }
        }
        Ok(created)
    }
}

/// Whether `pods` (sorted by index) are exactly `desired`, alive: same
/// names, same spec hash (so the same generation), none dead or going.
pub(super) fn adoptable(pods: &[Pod], desired: &[Pod]) -> bool {
    pods.len() == desired.len()
        && pods.iter().zip(desired).all(|(p, d)| {
            p.name_any() == d.name_any()
                && p.metadata.deletion_timestamp.is_none()
                && p.annotations().get(SPEC_HASH_ANNOTATION)
                    == d.annotations().get(SPEC_HASH_ANNOTATION)
                && !pod_dead(p)
        })
}

/// Why the pods of a service of generation `generation` and pod template
/// `template` need a whole restart, if they do.
pub(super) fn shared_fate_reason(
    pods: &[Pod],
    template: &PodTemplate,
    generation: u64,
) -> Option<String> {
    for (i, hash) in template.hash.iter().enumerate() {
        let Some(p) = pods.iter().find(|p| pod_index(p) == i) else {
            return Some(format!("the pod of process {i} is gone"));
        };
        let name = p.name_any();
        if p.metadata.deletion_timestamp.is_some() {
            return Some(format!("pod {name} is being deleted"));
        }
        let of = label_u64(p.labels(), GENERATION_KEY).unwrap_or(0);
        if of != generation {
            return Some(format!(
                "pod {name} is of generation {of}, the service of {generation}"
            ));
        }
        if p.annotations().get(SPEC_HASH_ANNOTATION) != Some(&objects::spec_hash(hash, generation))
        {
            return Some(format!("pod {name} does not run the service's spec"));
        }
        let restarts = container_restarts(p);
        if restarts > 0 {
            return Some(format!(
                "the container of pod {name} exited (restarted in place {restarts} times)"
            ));
        }
        if pod_failed(p) {
            return Some(format!("pod {name} failed"));
        }
    }
    None
}

pub(super) fn pod_index(p: &Pod) -> usize {
    p.labels()
        .get(PROCESS_LABEL)
        .and_then(|i| i.parse().ok())
        .unwrap_or(usize::MAX)
}

pub(super) fn pod_ip(p: &Pod) -> Option<IpAddr> {
    p.status.as_ref()?.pod_ip.as_ref()?.parse().ok()
}

pub(super) fn pod_running(p: &Pod) -> bool {
    p.metadata.deletion_timestamp.is_none()
        && p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
}

/// The pod's phase says its containers ended (evicted, or failed for good).
pub(super) fn pod_failed(p: &Pod) -> bool {
    matches!(
        p.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Failed" | "Succeeded")
    )
}

/// A process of the pod died: its container restarted in place, or the pod failed.
pub(super) fn pod_dead(p: &Pod) -> bool {
    container_restarts(p) > 0 || pod_failed(p)
}

pub(super) fn pod_annotation_u32(p: &Pod, key: &str) -> u32 {
    p.annotations()
        .get(key)
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// Replacements by `restart_service` plus the kubelet's in-place restarts.
pub(super) fn pod_restarts(p: &Pod) -> u32 {
    pod_annotation_u32(p, RESTARTS_ANNOTATION) + u32::try_from(container_restarts(p)).unwrap_or(0)
}

pub(super) fn container_restarts(p: &Pod) -> i32 {
    p.status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .map(|cs| cs.iter().map(|c| c.restart_count).sum())
        .unwrap_or(0)
}

pub(super) fn seen(p: &Pod) -> Seen {
    (p.uid(), container_restarts(p), pod_failed(p))
}
