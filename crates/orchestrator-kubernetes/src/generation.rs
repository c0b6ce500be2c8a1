//! Generations: a whole restart (kill all, start all) as the next generation, and the shared-fate check that asks for one.

use super::*;
use crate::events::Replaced;

impl Inner {
    /// Compare-and-swap of the record's generation to one more than it is,
    /// and of its template to `template`. With `expected`, only if it
    /// still is `expected` (a shared-fate restart decided on it: if it
    /// moved, someone else restarted the service).
    pub(super) async fn bump_generation(
        &self,
        name: &str,
        mut record: Service,
        expected: Option<u64>,
        template: &PodTemplate,
    ) -> Result<Service, GenerationError> {
        let template_json = serde_json::to_string(template).expect("a template serializes");
        for _ in 0..CONFLICT_ATTEMPTS {
            let generation = generation_of(&record);
            if expected.is_some_and(|e| e != generation) {
                return Err(GenerationError::Superseded);
            }
            let mut next = record.clone();
            next.metadata.managed_fields = None;
            next.annotations_mut()
                .insert(GENERATION_KEY.to_string(), (generation + 1).to_string());
            next.annotations_mut()
                .insert(TEMPLATE_ANNOTATION.to_string(), template_json.clone());
            match self
                .services
                .replace(name, &PostParams::default(), &next)
                .await
            {
                Ok(s) => return Ok(s),
                Err(e) if is_conflict(&e) => {
                    tracing::info!(
                        service = name,
                        "record changed under us (409): reading again"
                    );
                    record = self.live_record(name).await?;
                }
                Err(e) => return Err(api_error("write service", e).into()),
            }
        }
        Err(too_many_conflicts(&format!("service {name}")).into())
    }

    /// Kill all, then start all: the record's generation goes up by one
    /// (compare-and-swap, fenced by the epoch), every pod of the service is
    /// deleted as read (preconditions) and waited for until gone (or stuck),
    /// then every pod is created in the new generation from the record's
    /// template on this environment's image ([`PodTemplate::with_image`]:
    /// the restart of a service made by an older build is its upgrade).
    /// `record` is the live record as last read; `expected`: see
    /// [`Inner::bump_generation`]; `keep_restarts`: the new pods count one
    /// restart more than the old ones (`false`: a new spec, from 0).
    /// Returns the record and the pods created.
    pub(super) async fn new_generation(
        &self,
        name: &str,
        record: Service,
        expected: Option<u64>,
        keep_restarts: bool,
    ) -> Result<(Service, Vec<Created>), GenerationError> {
        // A new generation runs this environment's build (an upgrade when
        // the record's pods were made by another).
        let template = template_of(&record)?.with_image(&self.config.image);
        let record = self
            .bump_generation(name, record, expected, &template)
            .await?;
        let generation = generation_of(&record);
        let mut restarts: BTreeMap<usize, u32> = BTreeMap::new();
        let mut gone = false;
        for _ in 0..CONFLICT_ATTEMPTS {
            // Pods left terminating by an earlier generation are not waited
            // for again.
            let pods = current(self.service_pods(name).await?, generation.saturating_sub(1));
            for p in &pods {
                let r = restarts.entry(pod_index(p)).or_default();
                *r = (*r).max(pod_annotation_u32(p, RESTARTS_ANNOTATION));
            }
            let deletes = self.delete_as_read(&pods).await?;
            let conflicts = deletes.conflicts;
            let stuck = self.wait_all_gone(deletes.accepted).await?;
            if let (Some(pod), false) = (stuck.first(), template.generation_names) {
                // Its name would be the new pod's: nothing can start.
                return Err(StateError::Io {
                    path: format!("kubernetes API: pod {pod}").into(),
                    source: std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        "stuck terminating, and the service's pods keep their names across generations (a record written before pods were named by generation)",
                    ),
                }
                .into());
            }
            if conflicts == 0 {
                gone = true;
                break;
            }
            // A pod changed since we read it: read again, if the service is
            // still ours to act on.
            tracing::info!(
                service = name,
                "a pod changed under us (409): reading again"
            );
            if generation_of(&self.live_record(name).await?) != generation {
                return Err(GenerationError::Superseded);
            }
        }
        if !gone {
            return Err(too_many_conflicts(&format!("pods of {name}")).into());
        }
        // Still ours, and still our generation, before anything starts.
        let record = self.live_record(name).await?;
        if generation_of(&record) != generation {
            return Err(GenerationError::Superseded);
        }
        let base = restarts.values().copied().max().unwrap_or(0);
        let created = self
            .create_pods(&record, &template, generation, |i| {
                if keep_restarts {
                    restarts.get(&i).copied().unwrap_or(base) + 1
                } else {
                    0
                }
            })
            .await?;
        tracing::info!(
            service = name,
            generation,
            "started every pod of the service as a new generation"
        );
        Ok((record, created))
    }

    pub(super) async fn restart_inner(&self, name: &str) -> Result<ServiceStatus, RestartError> {
        objects::validate_name(name).map_err(RestartError::Invalid)?;
        let lock = self.lock(name).await;
        let ours = self.config.epoch;
        let record = self
            .live_record(name)
            .await
            .map_err(|e| e.into_restart(name, ours))?;
        let (record, created) = self
            .new_generation(name, record, None, true)
            .await
            .map_err(|e| e.into_restart(name, ours))?;
        self.announce(name, &created);
        let status = self.announce_addresses(&record).await;
        drop(lock);
        self.replaced_event(name, Replaced::Restarted, generation_of(&record))
            .await;
        Ok(status?)
    }

    /// Shared fate: restarts service `name` as a whole (a new generation)
    /// if a pod of its current generation died, went or is missing, or a
    /// pod of another generation or spec runs. Under the service's lock, so
    /// a write of our own in progress is never mistaken for a death. Quiet
    /// when the service is not ours to act on (dropped, a newer epoch, or
    /// restarted by someone else meanwhile).
    pub(super) async fn check_shared_fate(&self, name: &str) -> Result<(), StateError> {
        // The real-node suite's negative control (feature `failpoints`
        // only): no shared-fate restart, the kubelet's in-place restarts
        // alone.
        fail::fail_point!("kube_shared_fate_off", |_| Ok(()));
        let lock = self.lock(name).await;
        let record = match self.live_record(name).await {
            Ok(r) => r,
            Err(GenerationError::State(e)) => return Err(e),
            Err(_) => return Ok(()),
        };
        let Ok(template) = template_of(&record) else {
            return Ok(());
        };
        let generation = generation_of(&record);
        let pods = current(self.service_pods(name).await?, generation);
        let Some(reason) = shared_fate_reason(&pods, &template, generation) else {
            return Ok(());
        };
        tracing::warn!(
            service = name,
            generation = generation + 1,
            "{reason}: restarting every pod of the service (shared fate)"
        );
        match self
            .new_generation(name, record, Some(generation), true)
            .await
        {
            Ok((record, created)) => {
                self.announce(name, &created);
                let status = self.announce_addresses(&record).await;
                drop(lock);
                self.replaced_event(name, Replaced::SharedFate(&reason), generation_of(&record))
                    .await;
                status.map(drop)
            }
            Err(GenerationError::State(e)) => Err(e),
            Err(GenerationError::Spawn {
                process, source, ..
            }) => Err(StateError::Io {
                path: format!("kubernetes API: the pod of process {process} of {name}").into(),
                source,
            }),
            Err(other) => {
                tracing::info!(
                    service = name,
                    "shared-fate restart not ours to finish: {other:?}"
                );
                Ok(())
            }
        }
    }
}
