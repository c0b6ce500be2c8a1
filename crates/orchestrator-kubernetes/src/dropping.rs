//! drop: the record becomes a tombstone, then the pods and the Secret go, each exactly as read.

use super::*;

impl Inner {
    pub(super) async fn drop_inner(&self, name: &str) -> Result<bool, DropError> {
        objects::validate_name(name).map_err(DropError::Invalid)?;
        let _lock = self.lock(name).await;
        let ours = self.config.epoch;
        let ctx = self.context();
        // 1. The record becomes a tombstone with the highest dropping epoch.
        let mut existed = false;
        let mut written = false;
        let mut tombstone_version = None;
        for _ in 0..CONFLICT_ATTEMPTS {
            let result = match self.read_record(name).await? {
                Record::Missing => {
                    existed = false;
                    self.services
                        .create(
                            &PostParams::default(),
                            &objects::tombstone(&ctx, name, ours),
                        )
                        .await
                }
                Record::Dropped { by, service } if by >= ours => {
                    existed = false;
                    written = true;
                    tombstone_version = service.resource_version();
                    break;
                }
                Record::Live { service, .. } | Record::Dropped { service, .. } => {
                    existed = service.labels().get(STATE_LABEL).map(String::as_str) == Some("live");
                    let by = label_u64(service.labels(), DROPPED_BY_LABEL)
                        .unwrap_or(0)
                        .max(ours);
                    let mut t = objects::tombstone(&ctx, name, by);
                    // The generation goes on: a service created again
                    // under this name starts after it.
                    if let Some(g) = service.annotations().get(GENERATION_KEY) {
                        t.annotations_mut()
                            .insert(GENERATION_KEY.to_string(), g.clone());
                    }
                    t.metadata.resource_version = service.resource_version();
                    t.metadata.uid = service.uid();
                    self.services
                        .replace(name, &PostParams::default(), &t)
                        .await
                }
            };
            match result {
                Ok(t) => {
                    written = true;
                    tombstone_version = t.resource_version();
                    break;
                }
                Err(e) if is_conflict(&e) => {
                    tracing::info!(
                        service = name,
                        "record changed under us (409): reading again"
                    )
                }
                Err(e) => return Err(api_error("write tombstone", e).into()),
            }
        }
        if !written {
            return Err(too_many_conflicts(&format!("service {name}")).into());
        }
        // 2. Every pod and the Secret, each exactly as read. The drop took
        // effect when the tombstone was written: if the record changed since
        // (a newer controller re-created the service), what exists now is
        // its, not ours to delete.
        for _ in 0..CONFLICT_ATTEMPTS {
            if !self.tombstone_unchanged(name, &tombstone_version).await? {
                tracing::info!(service = name, "re-created since our drop: leaving it");
                return Ok(existed);
            }
            let pods = self.service_pods(name).await?;
            if pods.is_empty() {
                break;
            }
            let deletes = self.delete_as_read(&pods).await?;
            let conflicts = deletes.conflicts;
            // A pod stuck terminating (its node lost) is not waited for
            // beyond the one deadline: the drop goes on without it.
            self.wait_all_gone(deletes.accepted).await?;
            if conflicts > 0 {
                tracing::info!(
                    service = name,
                    conflicts,
                    "pods changed under us (409): reading again"
                );
            }
            if conflicts == 0 {
                break;
            }
        }
        if !self.tombstone_unchanged(name, &tombstone_version).await? {
            return Ok(existed);
        }
        let secret_name = objects::secret_name(name);
        for _ in 0..CONFLICT_ATTEMPTS {
            match self.secrets.get_opt(&secret_name).await {
                Ok(None) => break,
                Ok(Some(s)) => match self
                    .secrets
                    .delete(&secret_name, &self.delete_params(&s))
                    .await
                {
                    Ok(_) => break,
                    Err(e) if is_conflict(&e) || is_not_found(&e) => continue,
                    Err(e) => return Err(api_error("delete secret", e).into()),
                },
                Err(e) => return Err(api_error("read secret", e).into()),
            }
        }
        for _ in 0..CONFLICT_ATTEMPTS {
            match self.budgets.get_opt(name).await {
                Ok(None) => break,
                Ok(Some(b)) => match self.budgets.delete(name, &self.delete_params(&b)).await {
                    Ok(_) => break,
                    Err(e) if is_conflict(&e) || is_not_found(&e) => continue,
                    Err(e) => return Err(api_error("delete poddisruptionbudget", e).into()),
                },
                Err(e) => return Err(api_error("read poddisruptionbudget", e).into()),
            }
        }
        if existed {
            tracing::info!(service = name, "dropped");
            let _ = self.events.send(ServiceEvent {
                service: name.to_string(),
                process: None,
                kind: ServiceEventKind::Dropped,
            });
        }
        Ok(existed)
    }

    /// Whether the record is still the tombstone we wrote (or read).
    pub(super) async fn tombstone_unchanged(
        &self,
        name: &str,
        version: &Option<String>,
    ) -> Result<bool, StateError> {
        Ok(match self.read_record(name).await? {
            Record::Dropped { service, .. } => service.resource_version() == *version,
            _ => false,
        })
    }
}
