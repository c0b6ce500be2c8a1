//! ensure and list: a service's record, Secret and pods made to match its config, and its status.

use super::*;
use crate::events::Replaced;

impl Inner {
    /// Waits (bounded by `ready_timeout`) until every pod has an IP, then
    /// returns the status.
    pub(super) async fn status_when_ready(
        &self,
        record: &Service,
    ) -> Result<ServiceStatus, StateError> {
        let deadline = tokio::time::Instant::now() + self.config.ready_timeout;
        loop {
            let pods = current(
                self.service_pods(&record.name_any()).await?,
                generation_of(record),
            );
            let status = self.status_of(record, &pods);
            let ready = pods.iter().all(|p| pod_ip(p).is_some());
            if ready || tokio::time::Instant::now() >= deadline {
                return Ok(status);
            }
            tokio::time::sleep(self.config.poll_interval).await;
        }
    }

    pub(super) fn status_of(&self, record: &Service, pods: &[Pod]) -> ServiceStatus {
        let labels = record.labels();
        let mut all: BTreeMap<String, String> = record
            .annotations()
            .get(LABELS_ANNOTATION)
            .and_then(|j| serde_json::from_str(j).ok())
            .unwrap_or_default();
        let epoch = label_u64(labels, EPOCH_LABEL).unwrap_or(0);
        let id = label_u64(labels, ID_LABEL).unwrap_or(0);
        all.insert(EPOCH_LABEL.to_string(), epoch.to_string());
        all.insert(ID_LABEL.to_string(), id.to_string());
        let ports: Vec<(String, u16)> = record
            .spec
            .as_ref()
            .and_then(|s| s.ports.as_ref())
            .map(|ps| {
                ps.iter()
                    .filter_map(|p| Some((p.name.clone()?, u16::try_from(p.port).ok()?)))
                    .collect()
            })
            .unwrap_or_default();
        ServiceStatus {
            name: record.name_any(),
            id,
            epoch,
            labels: all,
            processes: pods
                .iter()
                .filter_map(|p| {
                    let index = pod_index(p);
                    (index != usize::MAX).then(|| ProcessStatus {
                        index,
                        pid: None,
                        running: pod_running(p),
                        addresses: pod_ip(p)
                            .map(|ip| {
                                ports
                                    .iter()
                                    .map(|(n, port)| (n.clone(), SocketAddr::new(ip, *port)))
                                    .collect()
                            })
                            .unwrap_or_default(),
                        restarts: pod_restarts(p),
                    })
                })
                .collect(),
        }
    }

    pub(super) async fn ensure(&self, config: ServiceConfig) -> Result<ServiceStatus, EnsureError> {
        objects::validate_name(&config.name).map_err(EnsureError::Invalid)?;
        let lock = self.lock(&config.name).await;
        let name = config.name.clone();
        let mut replaced = None;
        let result = self.ensure_locked(config, &mut replaced).await;
        drop(lock);
        if let Some(generation) = replaced {
            self.replaced_event(&name, Replaced::NewGeneration, generation)
                .await;
        }
        result
    }

    /// [`Inner::ensure`] under the service's lock; `replaced_generation`
    /// is set when running pods were replaced by a new generation.
    async fn ensure_locked(
        &self,
        config: ServiceConfig,
        replaced_generation: &mut Option<u64>,
    ) -> Result<ServiceStatus, EnsureError> {
        if config.scale == 0 {
            return Err(EnsureError::Invalid(format!(
                "service {} needs at least one process",
                config.name
            )));
        }
        let ours = self.config.epoch;
        let name = config.name.clone();
        let fresh = objects::template(&self.context(), &config);
        let (mut record, template) = self.write_record(&config, &fresh).await?;
        self.write_secret(&config).await?;
        self.write_budget(&config).await?;
        let mut created = Vec::new();
        let mut decided = false;
        let mut replaced = false;
        for _ in 0..CONFLICT_ATTEMPTS {
            let generation = generation_of(&record);
            let pods = current(self.service_pods(&name).await?, generation);
            // Nothing runs (and the record's build is this environment's:
            // else a new generation moves it).
            if pods.is_empty() && template.image == fresh.image {
                // Nothing runs: every pod starts in the record's generation.
                created = self
                    .create_pods(&record, &template, generation, |_| 0)
                    .await
                    .map_err(|e| e.into_ensure(&name, ours))?;
                decided = true;
                break;
            }
            let ctx = self.context();
            let desired: Vec<Pod> = (0..config.scale)
                .map(|i| objects::pod(&ctx, &name, config.id, &template, i, generation, 0))
                .collect();
            if adoptable(&pods, &desired) {
                // Adopt: relabel with our epoch, CAS on what we read.
                let mut conflict = false;
                for (p, d) in pods.iter().zip(&desired) {
                    if p.labels() == d.labels() {
                        continue;
                    }
                    let mut relabelled = p.clone();
                    relabelled.metadata.labels = d.metadata.labels.clone();
                    match self
                        .pods
                        .replace(&p.name_any(), &PostParams::default(), &relabelled)
                        .await
                    {
                        Ok(_) => {}
                        Err(e) if is_conflict(&e) => {
                            tracing::info!(pod = %p.name_any(), "pod changed under us (409): reading again");
                            conflict = true;
                            break;
                        }
                        Err(e) => return Err(api_error("write pod", e).into()),
                    }
                }
                if conflict {
                    continue;
                }
                decided = true;
                break;
            }
            // A changed spec, a pod missing or dead, a pod of another
            // generation: shared fate, every pod goes and a new generation
            // starts.
            let (r, c) = self
                .new_generation(&name, record, None, false)
                .await
                .map_err(|e| e.into_ensure(&name, ours))?;
            *replaced_generation = Some(generation_of(&r));
            record = r;
            created = c;
            replaced = true;
            decided = true;
            break;
        }
        if !decided {
            return Err(too_many_conflicts(&format!("pods of {name}")).into());
        }
        // Did a newer controller take the record over while we wrote pods?
        // Then its deletes may have missed the pods we created: remove them.
        match self.read_record(&name).await? {
            Record::Live { epoch, .. } if self.config.conditional_writes && epoch > ours => {
                self.remove_created(&created).await;
                return Err(EnsureError::StaleEpoch {
                    service: name,
                    stored: epoch,
                    ours,
                });
            }
            Record::Dropped { by, .. } if self.config.conditional_writes && by > ours => {
                self.remove_created(&created).await;
                return Err(EnsureError::DroppedByNewer {
                    service: name,
                    dropped_at: by,
                    ours,
                });
            }
            _ => {}
        }
        self.announce(&name, &created);
        if replaced {
            // A running service's pods were replaced: new IPs.
            return Ok(self.announce_addresses(&record).await?);
        }
        Ok(self.status_when_ready(&record).await?)
    }

    /// `Started` for each pod created.
    /// Once every pod of `record`'s service has an IP (bounded by the ready
    /// timeout): tells watchers the processes' new addresses (a new
    /// generation's pods have new IPs), so a controller reconnects there.
    pub(super) async fn announce_addresses(
        &self,
        record: &Service,
    ) -> Result<ServiceStatus, StateError> {
        let status = self.status_when_ready(record).await?;
        let mut processes = status.processes.clone();
        processes.sort_by_key(|p| p.index);
        if !processes.is_empty() && processes.iter().all(|p| !p.addresses.is_empty()) {
            let _ = self.events.send(ServiceEvent {
                service: status.name.clone(),
                process: None,
                kind: ServiceEventKind::AddressesChanged {
                    addresses: processes.into_iter().map(|p| p.addresses).collect(),
                },
            });
        }
        Ok(status)
    }

    pub(super) fn announce(&self, service: &str, created: &[Created]) {
        for pod in created {
            let _ = self.events.send(ServiceEvent {
                service: service.to_string(),
                process: Some(pod.process),
                kind: ServiceEventKind::Started { pid: 0 },
            });
        }
    }

    /// Deletes the pods this environment created (each as it is now, if it
    /// is still the one created), waiting for them together.
    pub(super) async fn remove_created(&self, created: &[Created]) {
        let mut pods = Vec::new();
        for c in created {
            if let Ok(Some(p)) = self.pods.get_opt(&c.name).await {
                if p.uid().as_deref() == Some(c.uid.as_str()) {
                    pods.push(p);
                }
            }
        }
        if let Ok(deletes) = self.delete_as_read(&pods).await {
            let _ = self.wait_all_gone(deletes.accepted).await;
        }
    }

    pub(super) async fn list_inner(&self) -> Result<Vec<ServiceStatus>, StateError> {
        let records = self.list_records().await?;
        let lp =
            ListParams::default().labels(&objects::environment_selector(&self.config.environment));
        let pods = self
            .pods
            .list(&lp)
            .await
            .map_err(|e| api_error("list pods", e))?
            .items;
        let mut out: Vec<ServiceStatus> = records
            .iter()
            .map(|r| {
                let name = r.name_any();
                let mut mine: Vec<Pod> = pods
                    .iter()
                    .filter(|p| p.labels().get(objects::SERVICE_LABEL) == Some(&name))
                    .cloned()
                    .collect();
                mine.sort_by_key(pod_index);
                self.status_of(r, &current(mine, generation_of(r)))
            })
            .collect();
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }
}
