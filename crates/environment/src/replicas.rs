//! The replicas as a whole: ensuring every catalog replica (adopting
//! running processes), removing orphans by the policy's decision, and
//! creating, dropping and listing replicas (a catalog transaction, then
//! the orchestrator call).

use super::*;

impl Environment {
    /// Step 2: ensures the service of every replica in our catalog view,
    /// adopting running processes. A refused (stale) ensure halts.
    pub async fn ensure_replicas(&self) -> Result<(), EnvError> {
        // Check after taking the lock: the operation before us may have halted us.
        let _ops = self.ops.lock().await;
        self.check_not_halted()?;
        let replicas: Vec<Replica> = self.view().replicas.into_values().collect();
        for replica in replicas {
            let config = self.service_config(&replica);
            match self.orchestrator.ensure_service(config).await {
                Ok(status) => {
                    tracing::info!(replica = %replica.name, service = %status.name, "ensured")
                }
                Err(e @ (EnsureError::StaleEpoch { .. } | EnsureError::DroppedByNewer { .. })) => {
                    return Err(self.ensure_error(e))
                }
                // The replica stays wanted; the error is for the operator.
                Err(e) => tracing::error!(replica = %replica.name, "could not ensure: {e}"),
            }
        }
        Ok(())
    }

    /// Ensures every catalog replica that has no controller (its ensure
    /// failed after the catalog write, at creation or at start) and starts
    /// its controller; returns how many it started. Runs in the background
    /// ([`spawn_replica_retry`](Self::spawn_replica_retry)).
    pub async fn ensure_unserved(&self) -> Result<usize, EnvError> {
        let _ops = self.ops.lock().await;
        self.check_not_halted()?;
        let unserved: Vec<Replica> = self
            .view
            .lock()
            .expect("poisoned")
            .replicas
            .values()
            .filter(|r| self.compute.controller(r.id).is_none())
            .cloned()
            .collect();
        let mut started = 0;
        for replica in unserved {
            match self
                .orchestrator
                .ensure_service(self.service_config(&replica))
                .await
            {
                Ok(status) => {
                    tracing::info!(replica = %replica.name, "ensured on a retry; driving it");
                    self.compute_started(&replica, &status);
                    started += 1;
                }
                Err(e @ (EnsureError::StaleEpoch { .. } | EnsureError::DroppedByNewer { .. })) => {
                    return Err(self.ensure_error(e))
                }
                Err(e) => tracing::warn!(replica = %replica.name, "still cannot ensure: {e}"),
            }
        }
        Ok(started)
    }

    /// Runs [`ensure_unserved`](Self::ensure_unserved) every `every` until
    /// this environment halts.
    pub fn spawn_replica_retry(
        self: &Arc<Self>,
        every: std::time::Duration,
    ) -> tokio::task::JoinHandle<()> {
        self.spawn_every(every, |env| async move {
            env.ensure_unserved()
                .await
                .map(|_| ())
                .map_err(|e| (e, "retrying replicas"))
        })
    }

    /// Runs `task` every `every` until this environment halts; other errors
    /// are logged with their label.
    fn spawn_every<F, Fut>(
        self: &Arc<Self>,
        every: std::time::Duration,
        task: F,
    ) -> tokio::task::JoinHandle<()>
    where
        F: Fn(Arc<Self>) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = Result<(), (EnvError, &'static str)>> + Send,
    {
        let me = self.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                match task(me.clone()).await {
                    Ok(()) => {}
                    Err((EnvError::Halted(_), _)) => return,
                    Err((e, what)) => tracing::warn!("{what} failed: {e}"),
                }
            }
        })
    }

    /// Step 3: lists the services and lets the orphan policy delete orphans
    /// or halt us. A failing or nonsensical policy deletes nothing.
    pub async fn remove_orphans(&self) -> Result<OrphanReport, EnvError> {
        // Check after taking the lock: the operation before us may have halted us.
        let _ops = self.ops.lock().await;
        self.check_not_halted()?;
        let services = self.services().await?;
        let view = {
            let v = self.view.lock().expect("poisoned");
            CatalogView {
                keep: v.replicas.keys().copied().collect(),
                our_epoch: self.epoch,
                next_id: v.next_replica_id,
            }
        };
        let listed: Vec<Service> = services
            .iter()
            .map(|s| Service {
                id: s.id,
                name: s.name.clone(),
                epoch: s.epoch,
                labels: s.labels.clone(),
            })
            .collect();
        let decision = {
            let mut policy = self.policy.lock().expect("poisoned");
            let name = policy.name().to_string();
            policy
                .classify(&listed, &view)
                .and_then(|d| check_decision(&name, d, &listed, &view))
        };
        let mut report = OrphanReport::default();
        match decision {
            Ok(OrphanDecision::Halt(reason)) => return Err(self.halt(reason)),
            Err(e) => {
                tracing::error!("orphan policy gave no usable answer, deleting nothing: {e}");
                report.policy_error = Some(e.to_string());
            }
            Ok(OrphanDecision::Delete(ids)) => {
                for s in services.iter().filter(|s| ids.contains(&s.id)) {
                    tracing::info!(service = %s.name, id = s.id, epoch = s.epoch, "removing orphan");
                    self.orchestrator
                        .drop_service(&s.name)
                        .await
                        .map_err(|e| EnvError::Orchestrator(e.to_string()))?;
                    report.deleted.push(s.name.clone());
                }
            }
        }
        self.orphans_removed
            .lock()
            .expect("poisoned")
            .extend(report.deleted.iter().cloned());
        Ok(report)
    }

    /// Creates a replica: catalog transaction, then the orchestrator call.
    pub async fn create_replica(
        &self,
        name: &str,
        config: ReplicaConfig,
    ) -> Result<ReplicaInfo, EnvError> {
        // Check after taking the lock: the operation before us may have halted us.
        let _ops = self.ops.lock().await;
        self.check_not_halted()?;
        fail::fail_point!("before_catalog_create_replica");
        let replica = {
            let mut catalog = self.catalog.lock().expect("poisoned");
            let replica = catalog
                .create_replica(name, config)
                .map_err(|e| self.catalog_error(e))?;
            let mut view = self.view.lock().expect("poisoned");
            view.replicas.insert(replica.id, replica.clone());
            view.next_replica_id = view.next_replica_id.max(replica.id + 1);
            replica
        };
        fail::fail_point!("after_catalog_create_replica");
        let status = self
            .orchestrator
            .ensure_service(self.service_config(&replica))
            .await
            .map_err(|e| self.ensure_error(e))?;
        fail::fail_point!("after_orchestrator_create_replica");
        self.compute_started(&replica, &status);
        tracing::info!(replica = %replica.name, id = replica.id, "created");
        Ok(ReplicaInfo {
            replica,
            service: Some(status),
        })
    }

    /// Drops a replica: catalog transaction, then the orchestrator call.
    pub async fn drop_replica(&self, name: &str) -> Result<Replica, EnvError> {
        // Check after taking the lock: the operation before us may have halted us.
        let _ops = self.ops.lock().await;
        self.check_not_halted()?;
        fail::fail_point!("before_catalog_drop_replica");
        let replica = {
            let mut catalog = self.catalog.lock().expect("poisoned");
            let replica = catalog
                .drop_replica(name)
                .map_err(|e| self.catalog_error(e))?;
            let mut view = self.view.lock().expect("poisoned");
            view.replicas.remove(&replica.id);
            view.dataflows.retain(|_, d| d.replica_id != replica.id);
            self.inputs
                .lock()
                .expect("poisoned")
                .drop_replica(replica.id);
            replica
        };
        fail::fail_point!("after_catalog_drop_replica");
        self.compute_stopped(replica.id);
        self.metrics()
            .forget_replica(&replica.name, replica.config.processes);
        // Its own policy went with it in the catalog.
        self.compute
            .set_replica_distribution_policy(replica.id, None);
        self.replica_policies_in_force
            .lock()
            .expect("poisoned")
            .remove(&replica.id);
        self.orchestrator
            .drop_service(&ServiceTemplate::service_name(replica.id))
            .await
            .map_err(|e| EnvError::Orchestrator(e.to_string()))?;
        fail::fail_point!("after_orchestrator_drop_replica");
        // Its command log goes too (nothing reads it once its processes are
        // gone; a leftover is only disk).
        if let Some(log) = self.command_log(replica.id) {
            if let Err(e) = log.remove(self.epoch()) {
                tracing::warn!(%log, error = %e, "a dropped replica's command log was left");
            }
        }
        tracing::info!(replica = %replica.name, id = replica.id, "dropped");
        Ok(replica)
    }

    /// Restarts every process of replica `name` as one new generation, on
    /// the program its service names (the way to move a replica to a new
    /// replica binary put at that path: `lockstep replica upgrade`). Its
    /// controller reconnects by itself and the replica rehydrates; nothing
    /// changes in the catalog. A service ensured by a newer controller halts
    /// us (O3), as every fenced write does.
    pub async fn restart_replica(&self, name: &str) -> Result<ReplicaInfo, EnvError> {
        let _ops = self.ops.lock().await;
        self.check_not_halted()?;
        if name.is_empty() {
            return Err(EnvError::Catalog(WriteError::Invalid(
                "a replica needs a name".into(),
            )));
        }
        let replica = self
            .view()
            .replicas
            .into_values()
            .find(|r| r.name == name)
            .ok_or_else(|| EnvError::Catalog(WriteError::NoSuchReplica(name.to_string())))?;
        let service = ServiceTemplate::service_name(replica.id);
        match self.orchestrator.restart_service(&service).await {
            Ok(status) => {
                tracing::info!(replica = %replica.name, %service, "restarted every process");
                // The controller starts a session with the new processes
                // now, not when it notices the old connections died: what
                // it answers after this (versions) is of no old process.
                if let Some(c) = self.compute.controller(replica.id) {
                    let _ = c.reconnect();
                }
                Ok(ReplicaInfo {
                    replica,
                    service: Some(status),
                })
            }
            Err(e @ RestartError::StaleEpoch { .. }) => Err(self.halt(e.to_string())),
            Err(e) => Err(EnvError::Orchestrator(e.to_string())),
        }
    }

    /// Process `index` of replica `name`'s own metrics, fetched from its
    /// controller port (`GET /metrics`) with the replica's metrics token
    /// ([`lockstep_protocol::SessionKey::metrics_token`]) within 5 s.
    pub async fn replica_metrics(&self, name: &str, index: usize) -> lockstep_metrics_http::Answer {
        use lockstep_metrics_http::Answer;
        let replicas = match self.list_replicas().await {
            Ok(r) => r,
            Err(e) => return Answer::Unavailable(e.to_string()),
        };
        let Some(info) = replicas.iter().find(|r| r.replica.name == name) else {
            return Answer::NotFound(format!("no replica named {name:?}"));
        };
        let Some(addr) = info
            .service
            .iter()
            .flat_map(|s| &s.processes)
            .find(|p| p.index == index)
            .and_then(|p| p.addresses.get("controller"))
        else {
            return Answer::NotFound(format!(
                "replica {name:?} has no process {index} with a controller address"
            ));
        };
        let token = self.session_key(info.replica.id).map(|k| k.metrics_token());
        match lockstep_metrics_http::fetch(
            *addr,
            token.as_deref(),
            std::time::Duration::from_secs(5),
        )
        .await
        {
            Ok(text) => Answer::Metrics(text),
            Err(e) => Answer::Unavailable(format!("process {index} of replica {name:?}: {e}")),
        }
    }

    /// Every service the orchestrator lists.
    pub(crate) async fn services(&self) -> Result<Vec<ServiceStatus>, EnvError> {
        self.orchestrator
            .list_services()
            .await
            .map_err(|e| EnvError::Orchestrator(e.to_string()))
    }

    /// Lists our catalog's replicas with their services' status.
    pub async fn list_replicas(&self) -> Result<Vec<ReplicaInfo>, EnvError> {
        self.check_not_halted()?;
        let mut services: BTreeMap<u64, ServiceStatus> = self
            .services()
            .await?
            .into_iter()
            // A replica's own service, not its standby (an upgrade).
            .filter(|s| s.name == ServiceTemplate::service_name(s.id))
            .map(|s| (s.id, s))
            .collect();
        Ok(self
            .replicas()
            .into_values()
            .map(|replica| ReplicaInfo {
                service: services.remove(&replica.id),
                replica,
            })
            .collect())
    }

    /// Runs [`remove_orphans`](Self::remove_orphans) every `every` in the
    /// background (O2: orphans left by a crash of another controller go
    /// without waiting for our restart). Stops when we halt; a policy that
    /// says halt halts us, which stops [`serve`](Self::serve).
    pub fn spawn_orphan_removal(
        self: &Arc<Self>,
        every: std::time::Duration,
    ) -> tokio::task::JoinHandle<()> {
        self.spawn_every(every, |env| async move {
            let report = env
                .remove_orphans()
                .await
                .map_err(|e| (e, "background orphan removal"))?;
            if !report.deleted.is_empty() {
                tracing::info!(deleted = ?report.deleted, "background orphan removal");
            }
            Ok(())
        })
    }
}

/// Refuses answers that make no sense: IDs that were not listed, or that our
/// catalog holds (deleting a wanted service is never an orphan removal).
fn check_decision(
    policy: &str,
    decision: OrphanDecision,
    listed: &[Service],
    view: &CatalogView,
) -> Result<OrphanDecision, PolicyError> {
    if let OrphanDecision::Delete(ids) = &decision {
        for id in ids {
            if !listed.iter().any(|s| s.id == *id) {
                return Err(PolicyError::Nonsense {
                    policy: policy.to_string(),
                    reason: format!("asked to delete ID {id}, which was not listed"),
                });
            }
            if view.keep.contains(id) {
                return Err(PolicyError::Nonsense {
                    policy: policy.to_string(),
                    reason: format!("asked to delete ID {id}, which our catalog holds"),
                });
            }
        }
    }
    Ok(decision)
}
