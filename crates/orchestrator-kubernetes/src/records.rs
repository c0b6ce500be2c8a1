//! The service records (headless Services): read, written by compare-and-swap, listed.

use super::*;

impl Inner {
    pub(super) async fn read_record(&self, name: &str) -> Result<Record, StateError> {
        let Some(service) = self
            .services
            .get_opt(name)
            .await
            .map_err(|e| api_error("read service", e))?
        else {
            return Ok(Record::Missing);
        };
        let labels = service.labels();
        if labels.get(objects::MANAGED_BY_LABEL).map(String::as_str) != Some(objects::MANAGED_BY) {
            return Err(StateError::Corrupt {
                path: format!("kubernetes: service {name}").into(),
                reason: "a Service of this name exists and is not managed by lockstep".into(),
            });
        }
        Ok(match labels.get(STATE_LABEL).map(String::as_str) {
            Some("dropped") => Record::Dropped {
                by: label_u64(labels, DROPPED_BY_LABEL).unwrap_or(0),
                service: Box::new(service),
            },
            _ => Record::Live {
                epoch: label_u64(labels, EPOCH_LABEL).unwrap_or(0),
                service: Box::new(service),
            },
        })
    }

    /// The record if it is live and ours to act on (not of a newer epoch).
    pub(super) async fn live_record(&self, name: &str) -> Result<Service, GenerationError> {
        match self.read_record(name).await? {
            Record::Missing => Err(GenerationError::Gone { dropped_by: None }),
            Record::Dropped { by, .. } => Err(GenerationError::Gone {
                dropped_by: Some(by),
            }),
            Record::Live { epoch, .. }
                if self.config.conditional_writes && epoch > self.config.epoch =>
            {
                Err(GenerationError::Stale { stored: epoch })
            }
            Record::Live { service, .. } => Ok(*service),
        }
    }

    /// Writes the record (CAS on the resourceVersion read), deciding again
    /// on a 409. It keeps the stored generation (a new record starts at 1,
    /// one over a tombstone at the tombstone's generation + 1), and the
    /// stored template where `fresh` differs from it in the image alone:
    /// an environment of a new build adopts every running service as it
    /// is, and a service moves to the new build only when it is restarted
    /// (`replica upgrade`, a death). Returns the written record and the
    /// template it holds.
    pub(super) async fn write_record(
        &self,
        config: &ServiceConfig,
        fresh: &PodTemplate,
    ) -> Result<(Service, PodTemplate), EnsureError> {
        let ours = self.config.epoch;
        let ctx = self.context();
        for _ in 0..CONFLICT_ATTEMPTS {
            let read = self.read_record(&config.name).await?;
            let generation = match &read {
                Record::Missing => 1,
                Record::Dropped { service, .. } => generation_of(service) + 1,
                Record::Live { service, .. } => generation_of(service),
            };
            let template = match &read {
                Record::Live { service, .. } => template_of(service)
                    .ok()
                    .filter(|stored| stored.with_image(&fresh.image) == *fresh)
                    .unwrap_or_else(|| fresh.clone()),
                _ => fresh.clone(),
            };
            let mut desired = objects::service(&ctx, config, generation, &template);
            let result = match read {
                Record::Live { epoch, .. } if self.config.conditional_writes && epoch > ours => {
                    return Err(EnsureError::StaleEpoch {
                        service: config.name.clone(),
                        stored: epoch,
                        ours,
                    })
                }
                Record::Dropped { by, .. } if self.config.conditional_writes && by > ours => {
                    return Err(EnsureError::DroppedByNewer {
                        service: config.name.clone(),
                        dropped_at: by,
                        ours,
                    })
                }
                Record::Missing => self.services.create(&PostParams::default(), &desired).await,
                Record::Live { service, .. } | Record::Dropped { service, .. } => {
                    // The CAS: this write holds only if nobody wrote since our read.
                    desired.metadata.resource_version = service.resource_version();
                    desired.metadata.uid = service.uid();
                    self.services
                        .replace(&config.name, &PostParams::default(), &desired)
                        .await
                }
            };
            match result {
                Ok(s) => return Ok((s, template)),
                Err(e) if is_conflict(&e) => {
                    tracing::info!(service = %config.name, "record changed under us (409): reading again");
                }
                Err(e) => return Err(api_error("write service", e).into()),
            }
        }
        Err(too_many_conflicts(&format!("service {}", config.name)).into())
    }

    pub(super) async fn list_records(&self) -> Result<Vec<Service>, StateError> {
        let lp = ListParams::default().labels(&objects::live_selector(&self.config.environment));
        Ok(self
            .services
            .list(&lp)
            .await
            .map_err(|e| api_error("list services", e))?
            .items)
    }
}
