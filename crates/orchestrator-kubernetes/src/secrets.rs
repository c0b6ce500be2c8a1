//! The Secrets: a service's environment (fenced by epoch) and the environment's master secret (created once).

use super::*;

impl Inner {
    /// Writes the Secret with the service's environment (its session key):
    /// created if missing, kept if equal, else replaced by a write with the
    /// resourceVersion read. Fenced like the record: a Secret labelled with
    /// a newer epoch is that controller's, and is not overwritten
    /// ([`EnsureError::StaleEpoch`]).
    pub(super) async fn write_secret(&self, config: &ServiceConfig) -> Result<(), EnsureError> {
        let name = objects::secret_name(&config.name);
        let ours = self.config.epoch;
        for _ in 0..CONFLICT_ATTEMPTS {
            let mut desired = objects::secret(&self.context(), config);
            let result = match self
                .secrets
                .get_opt(&name)
                .await
                .map_err(|e| api_error("read secret", e))?
            {
                None => self.secrets.create(&PostParams::default(), &desired).await,
                Some(s)
                    if self.config.conditional_writes
                        && label_u64(s.labels(), EPOCH_LABEL).is_some_and(|e| e > ours) =>
                {
                    return Err(EnsureError::StaleEpoch {
                        service: config.name.clone(),
                        stored: label_u64(s.labels(), EPOCH_LABEL).unwrap_or(0),
                        ours,
                    })
                }
                Some(s) if s.data == desired.data && s.labels() == desired.labels() => {
                    return Ok(())
                }
                Some(s) => {
                    desired.metadata.resource_version = s.resource_version();
                    self.secrets
                        .replace(&name, &PostParams::default(), &desired)
                        .await
                }
            };
            match result {
                Ok(_) => return Ok(()),
                Err(e) if is_conflict(&e) => continue,
                Err(e) => return Err(api_error("write secret", e).into()),
            }
        }
        Err(too_many_conflicts(&format!("secret {name}")).into())
    }

    /// Writes the service's PodDisruptionBudget
    /// ([`objects::disruption_budget`]) by the rules of
    /// [`write_secret`](Self::write_secret): created if missing, kept if
    /// equal, else replaced with the resourceVersion read; one labelled with
    /// a newer epoch is refused ([`EnsureError::StaleEpoch`]).
    pub(super) async fn write_budget(&self, config: &ServiceConfig) -> Result<(), EnsureError> {
        let name = config.name.clone();
        let ours = self.config.epoch;
        for _ in 0..CONFLICT_ATTEMPTS {
            let mut desired = objects::disruption_budget(&self.context(), config);
            let result = match self
                .budgets
                .get_opt(&name)
                .await
                .map_err(|e| api_error("read poddisruptionbudget", e))?
            {
                None => self.budgets.create(&PostParams::default(), &desired).await,
                Some(b)
                    if self.config.conditional_writes
                        && label_u64(b.labels(), EPOCH_LABEL).is_some_and(|e| e > ours) =>
                {
                    return Err(EnsureError::StaleEpoch {
                        service: config.name.clone(),
                        stored: label_u64(b.labels(), EPOCH_LABEL).unwrap_or(0),
                        ours,
                    })
                }
                Some(b) if b.spec == desired.spec && b.labels() == desired.labels() => {
                    return Ok(())
                }
                Some(b) => {
                    desired.metadata.resource_version = b.resource_version();
                    self.budgets
                        .replace(&name, &PostParams::default(), &desired)
                        .await
                }
            };
            match result {
                Ok(_) => return Ok(()),
                Err(e) if is_conflict(&e) => continue,
                Err(e) => return Err(api_error("write poddisruptionbudget", e).into()),
            }
        }
        Err(too_many_conflicts(&format!("poddisruptionbudget {name}")).into())
    }

    pub(super) async fn master_secret(&self) -> Result<[u8; 32], StateError> {
        let name = objects::master_secret_name(&self.config.environment);
        let corrupt = |reason: String| StateError::Corrupt {
            path: format!("kubernetes: secret {name}").into(),
            reason,
        };
        for _ in 0..CONFLICT_ATTEMPTS {
            match self
                .secrets
                .get_opt(&name)
                .await
                .map_err(|e| api_error("read secret", e))?
            {
                Some(s) => {
                    if s.labels()
                        .get(objects::MANAGED_BY_LABEL)
                        .map(String::as_str)
                        != Some(objects::MANAGED_BY)
                    {
                        return Err(corrupt(
                            "a Secret of this name exists and is not managed by lockstep".into(),
                        ));
                    }
                    let bytes = s
                        .data
                        .as_ref()
                        .and_then(|d| d.get(objects::MASTER_SECRET_KEY))
                        .map(|b| b.0.as_slice())
                        .unwrap_or_default();
                    return <[u8; 32]>::try_from(bytes).map_err(|_| {
                        corrupt(format!(
                            "its {:?} holds {} bytes, not 32: delete it only if no replica of this environment runs",
                            objects::MASTER_SECRET_KEY,
                            bytes.len()
                        ))
                    });
                }
                None => {
                    let mut secret = [0u8; 32];
                    std::io::Read::read_exact(
                        &mut std::fs::File::open("/dev/urandom").map_err(|source| {
                            StateError::Io {
                                path: "/dev/urandom".into(),
                                source,
                            }
                        })?,
                        &mut secret,
                    )
                    .map_err(|source| StateError::Io {
                        path: "/dev/urandom".into(),
                        source,
                    })?;
                    let desired = objects::master_secret(&self.context(), &secret);
                    match self.secrets.create(&PostParams::default(), &desired).await {
                        Ok(_) => {
                            tracing::info!(secret = %name, "created the master secret");
                            return Ok(secret);
                        }
                        // Another environment created it first: read theirs.
                        Err(e) if is_conflict(&e) => continue,
                        Err(e) => return Err(api_error("create secret", e)),
                    }
                }
            }
        }
        Err(too_many_conflicts(&format!("secret {name}")))
    }
}
