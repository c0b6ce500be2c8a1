//! Pods: created from the record's template, deleted exactly as read, and what their status says.

use super::*;

impl Inner {
    /// Deletes every pod of `pods` exactly as read (uid and resourceVersion
    /// preconditions), all before any wait, so they shut down together.
    pub(super) async fn delete_as_read(&self, pods: &[Pod]) -> Result<Deletes, StateError> {
        let mut deletes = Deletes::default();
        for p in pods {
            match self
                .pods
                .delete(&p.name_any(), &self.pod_delete_params(p))
                .await
            {
                Ok(_) => deletes.accepted.push((p.name_any(), p.uid())),
                Err(e) if is_conflict(&e) => deletes.conflicts += 1,
                Err(e) if is_not_found(&e) => {}
                Err(e) => return Err(api_error("delete pod", e)),
            }
        }
        Ok(deletes)
    }

    /// Waits until every pod of `accepted` is gone, with one deadline for
    /// them all ([`KubernetesOrchestratorConfig::stuck_after`] from now: a
    /// pod stuck terminating costs one wait, not one each). Returns the
    /// pods still terminating then.
    pub(super) async fn wait_all_gone(
        &self,
        accepted: Vec<(String, Option<String>)>,
    ) -> Result<Vec<String>, StateError> {
        let deadline = tokio::time::Instant::now() + self.config.stuck_after;
        let mut stuck = Vec::new();
        for (pod, uid) in accepted {
            if self.wait_gone(&pod, uid, deadline).await? == Deleted::Stuck {
                stuck.push(pod);
            }
        }
        Ok(stuck)
    }

    /// Waits until no pod `name` with `uid` exists (kube's
    /// `await_condition`, a watch of that one pod; a pod of the same name
    /// and another uid is a new one: gone), at most until `deadline`. A
    /// pod still there then, but terminating, is [`Deleted::Stuck`] (its node
    /// lost or a finalizer holding it: nothing here can make it go); one
    /// not even terminating after the delete timeout is an error.
    pub(super) async fn wait_gone(
        &self,
        name: &str,
        uid: Option<String>,
        deadline: tokio::time::Instant,
    ) -> Result<Deleted, StateError> {
        let error = |source| StateError::Io {
            path: format!("kubernetes API: pod {name}").into(),
            source,
        };
        let started = tokio::time::Instant::now();
        let mut until = deadline;
        loop {
            let same = uid.clone();
            let gone = move |p: Option<&Pod>| p.is_none_or(|p| p.uid() != same);
            let wait = kube::runtime::wait::await_condition(self.pods.clone(), name, gone);
            match tokio::time::timeout_at(until, wait).await {
                Ok(Ok(_)) => return Ok(Deleted::Gone),
                Ok(Err(e)) => {
                    return Err(error(std::io::Error::other(format!(
                        "waiting for it to go after its delete: {e}"
                    ))))
                }
                Err(_) => {}
            }
            let terminating = match self.pods.get_opt(name).await {
                Ok(Some(p)) if p.uid() == uid => p.metadata.deletion_timestamp.is_some(),
                Ok(_) => return Ok(Deleted::Gone),
                Err(e) => return Err(api_error("read pod", e)),
            };
            if terminating {
                tracing::warn!(
                    pod = name,
                    "still terminating {:?} after its delete (its node lost, or a finalizer holds it): going on without it",
                    started.elapsed()
                );
                return Ok(Deleted::Stuck);
            }
            if started.elapsed() >= self.config.delete_timeout {
                return Err(error(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!(
                        "not even terminating {:?} after its delete",
                        self.config.delete_timeout
                    ),
                )));
            }
            until = started + self.config.delete_timeout;
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
    ) -> Result<Vec<Created>, GenerationError> {
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
                Ok(p) => created.push(Created {
                    name: p.name_any(),
                    uid: p.uid().unwrap_or_default(),
                    process: i,
                }),
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

/// What [`Inner::delete_as_read`] did.
#[derive(Debug, Default)]
pub(super) struct Deletes {
    /// The pods whose delete was accepted (name, uid): to wait for.
    pub(super) accepted: Vec<(String, Option<String>)>,
    /// How many had changed since they were read (409): read them again.
    pub(super) conflicts: usize,
}

/// A pod this environment created.
#[derive(Debug)]
pub(super) struct Created {
    /// Its name.
    pub(super) name: String,
    /// Its uid.
    pub(super) uid: String,
    /// The index of the process it runs.
    pub(super) process: usize,
}

/// How a deleted pod went.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Deleted {
    /// No longer there.
    Gone,
    /// Still there, terminating, when the wait ended.
    Stuck,
}

/// `pods` without those left over from an older generation than
/// `generation` that are terminating (stuck on a lost node, say): they are
/// going, the service's processes are the others.
pub(super) fn current(pods: Vec<Pod>, generation: u64) -> Vec<Pod> {
    pods.into_iter()
        .filter(|p| {
            p.metadata.deletion_timestamp.is_none()
                || label_u64(p.labels(), GENERATION_KEY).unwrap_or(0) >= generation
        })
        .collect()
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
    mixed_images(pods, generation)
}

/// Why the pods of `generation` are not one build, if they are not: their
/// containers run images the kubelets resolved to different IDs (one tag
/// naming different builds on different nodes, which `IfNotPresent` does
/// not notice). One replica runs one build: such a generation is replaced.
fn mixed_images(pods: &[Pod], generation: u64) -> Option<String> {
    let mut seen: Vec<(String, &str)> = pods
        .iter()
        .filter(|p| label_u64(p.labels(), GENERATION_KEY) == Some(generation))
        .filter_map(|p| Some((p.name_any(), running_image(p)?)))
        .collect();
    seen.sort_by(|a, b| a.1.cmp(b.1));
    let (first, last) = (seen.first()?, seen.last()?);
    (first.1 != last.1).then(|| {
        format!(
            "the pods of generation {generation} run different images ({} runs {}, {} runs {}): one replica runs one build",
            first.0, first.1, last.0, last.1
        )
    })
}

/// The image ID the kubelet reports for the pod's process container (the
/// digest it resolved the image's tag to), once it is known.
pub(super) fn running_image(p: &Pod) -> Option<&str> {
    p.status
        .as_ref()?
        .container_statuses
        .as_ref()?
        .iter()
        .find(|c| c.name == CONTAINER)
        .map(|c| c.image_id.as_str())
        .filter(|id| !id.is_empty())
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
    let index = pod_index(p);
    Seen {
        uid: p.uid(),
        restarts: container_restarts(p),
        failed: pod_failed(p),
        deleting: p.metadata.deletion_timestamp.is_some(),
        image: running_image(p).map(str::to_string),
        service: p
            .labels()
            .get(SERVICE_LABEL)
            .cloned()
            .unwrap_or_else(|| p.name_any()),
        process: (index != usize::MAX).then_some(index),
    }
}
