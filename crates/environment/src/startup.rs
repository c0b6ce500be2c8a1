//! Starting an environment: the state directory checked, the catalog
//! opened (which bumps the epoch and fences older controllers), the
//! orchestrator, command logs, policies and session secret set up, the
//! replica's service configuration (Step 1 of the start in the crate docs).

use super::*;

impl Environment {
    /// Step 1: checks the state directory and the service binary, opens the
    /// catalog (bumping the epoch) and loads it, and creates the process
    /// orchestrator on `STATE_DIR/orchestrator` with our epoch.
    pub fn load(config: EnvironmentConfig) -> Result<Environment, StartError> {
        Self::load_with(config, Box::new(process_orchestrator))
    }

    /// [`load`](Self::load) with another orchestrator backend, built by
    /// `orchestrator` once the catalog's epoch is known (the Kubernetes
    /// backend, in `lockstep serve --orchestrator kubernetes` and the
    /// `@kubernetes` orphan scenarios).
    pub fn load_with(
        config: EnvironmentConfig,
        orchestrator: OrchestratorFactory,
    ) -> Result<Environment, StartError> {
        Self::load_with_secret(config, orchestrator, None)
    }

    /// [`load_with`](Self::load_with), with the master secret of the
    /// replicas' session keys given (`Some`: e.g. read from a Kubernetes
    /// Secret, as the state directory of a pod does not outlive it) instead
    /// of read from the state directory's [`SESSION_SECRET_FILE`] (`None`).
    pub fn load_with_secret(
        config: EnvironmentConfig,
        orchestrator: OrchestratorFactory,
        master_secret: Option<[u8; 32]>,
    ) -> Result<Environment, StartError> {
        check_state_dir(&config.state_dir)?;
        // A pod's program is a path in its image, not here.
        if config.replicas_here && !program_exists(&config.service.program) {
            return Err(StartError::ServiceBinaryMissing(config.service.program));
        }
        let store = Store::from_arg(config.store.as_deref(), config.state_dir.join(CATALOG_FILE))
            .map_err(StartError::Store)?;
        let mut catalog = Catalog::open_store(&store)?;
        let format = resolve_format(&mut catalog, config.format.clone())?;
        let orchestrator = orchestrator(OrchestratorParams {
            state_dir: &config.state_dir,
            epoch: catalog.epoch(),
            conditional_writes: config.conditional_writes,
        })?;
        let command_logs = match &store {
            Store::Postgres(url) => Some(CommandLogs::Postgres(url.clone())),
            // A SQLite file is shared by the replica's processes and its
            // controller: only where they run on this machine. Pods get no
            // command log (the `log` strategy falls back) unless the store
            // is PostgreSQL.
            Store::Sqlite(_) if !config.replicas_here => {
                tracing::warn!(
                    "replicas run elsewhere and the store is SQLite: replicas have no command log, so a `log` choice falls back (give --store postgres://... for the log strategy)"
                );
                None
            }
            Store::Sqlite(_) => Some(CommandLogs::Dir(
                std::path::absolute(config.state_dir.join(COMMAND_LOG_DIR))
                    .and_then(|dir| std::fs::create_dir_all(&dir).map(|()| dir))
                    .map_err(|source| StartError::StateDirUnwritable {
                        path: config.state_dir.join(COMMAND_LOG_DIR),
                        source,
                    })?,
            )),
        };
        let secret = match master_secret {
            Some(secret) => secret,
            None => session_secret(&config.state_dir).map_err(|source| {
                StartError::StateDirUnwritable {
                    path: config.state_dir.join(SESSION_SECRET_FILE),
                    source,
                }
            })?,
        };
        let mut env =
            Self::with_orchestrator(catalog, orchestrator, config.orphan_policy, config.service)?
                .with_session_secret(secret)
                .with_api_token(config.api_token);
        if let Some(logs) = command_logs {
            env = env.with_command_logs(logs);
        }
        if let Some(path) = &config.distribution_policy {
            let wasm = std::fs::read(path).unwrap_or_default();
            env.policies_in_force.lock().expect("poisoned").insert(
                "distribution".into(),
                policies::PolicyInForce {
                    kind: "distribution".into(),
                    name: lockstep_policy_host::policy_name(path),
                    hash: policies::short_hash(&wasm),
                    since: 0,
                    replica: None,
                },
            );
        }
        env.compute
            .set_distribution_policy(config.distribution_policy);
        env.compute.set_max_frame_len(config.max_frame_len);
        env.compute.set_format(Some(format));
        env.compute.set_naive_allowed(config.allow_naive);
        env.inputs
            .lock()
            .expect("poisoned")
            .set_lag(config.compaction_lag);
        env.inputs
            .lock()
            .expect("poisoned")
            .set_hold_limit(config.read_hold_limit);
        let mut env = env;
        env.policies_dir = Some(config.state_dir.join("policies"));
        env.restore_policies()
            .map_err(|e| StartError::PolicyRestore(e.to_string()))?;
        Ok(env)
    }

    /// Step 1 with any orchestrator backend: loads the already opened
    /// `catalog`. The orchestrator must label with the catalog's epoch.
    pub fn with_orchestrator(
        mut catalog: Catalog,
        orchestrator: Arc<dyn Orchestrator>,
        orphan_policy: Box<dyn OrphanPolicy + Send>,
        template: ServiceTemplate,
    ) -> Result<Environment, StartError> {
        let orphan_rule_name = orphan_policy.name().to_string();
        let mut view = catalog.state()?;
        let inputs = inputs::Inputs::load(
            std::mem::take(&mut view.input_writes)
                .into_iter()
                .map(|w| {
                    compute::decode_write(&w.write)
                        .map(|write| (w.replica_id, write))
                        .map_err(|e| StartError::CorruptInput {
                            seq: w.seq,
                            replica_id: w.replica_id,
                            reason: e.to_string(),
                        })
                })
                .collect::<Result<Vec<_>, _>>()?,
            None,
        );
        let epoch = catalog.epoch();
        if orchestrator.epoch() != epoch {
            return Err(StartError::EpochMismatch {
                catalog: epoch,
                orchestrator: orchestrator.epoch(),
            });
        }
        tracing::info!(
            epoch,
            replicas = view.replicas.len(),
            next_replica_id = view.next_replica_id,
            rule = orphan_policy.name(),
            "catalog loaded"
        );
        let compute = compute::Compute::default();
        compute.metrics().epoch.set(epoch as i64);
        Ok(Environment {
            catalog: Arc::new(Mutex::new(catalog)),
            view: Arc::new(Mutex::new(view)),
            inputs: Arc::new(Mutex::new(inputs)),
            decoded: Mutex::new(BTreeMap::new()),
            orchestrator,
            policy: Mutex::new(orphan_policy),
            template,
            epoch,
            halt: watch::channel(None).0,
            orphans_removed: Mutex::new(Vec::new()),
            reconfigurations_settled: Mutex::new(Vec::new()),
            ops: tokio::sync::Mutex::new(()),
            pending_writes: Default::default(),
            compute,
            command_logs: None,
            session_secret: None,
            api_token: None,
            max_answer_bytes: std::sync::atomic::AtomicUsize::new(server::MAX_ANSWER_BYTES),
            api_serving: std::sync::atomic::AtomicBool::new(false),
            policies_dir: None,
            replica_policies_in_force: Mutex::new(BTreeMap::new()),
            policies_in_force: Mutex::new(BTreeMap::from([
                (
                    "distribution".to_string(),
                    policies::PolicyInForce {
                        kind: "distribution".into(),
                        name: "native barrier".into(),
                        hash: String::new(),
                        since: 0,
                        replica: None,
                    },
                ),
                (
                    "orphans".to_string(),
                    policies::PolicyInForce {
                        kind: "orphans".into(),
                        name: orphan_rule_name,
                        hash: String::new(),
                        since: 0,
                        replica: None,
                    },
                ),
            ])),
        })
    }

    /// Turns off the replica restarts that controller events trigger (a
    /// silent process, lost lockstep, a history mismatch): for the negative
    /// control of the seeded campaign only (`lockstep serve
    /// --experiments-no-replica-restarts`).
    pub fn set_replica_restarts(&self, on: bool) {
        self.compute.set_replica_restarts(on);
    }

    /// Sets the largest answer the API sends (default
    /// [`server::MAX_ANSWER_BYTES`], what the `lockstep` CLI accepts): a peek
    /// whose answer is larger is refused with RESOURCE_EXHAUSTED, naming the
    /// limit, instead of failing in the client. `lockstep serve
    /// --max-answer-bytes` (hidden) lowers it for tests.
    pub fn set_max_answer_bytes(&self, bytes: usize) {
        self.max_answer_bytes
            .store(bytes, std::sync::atomic::Ordering::Relaxed);
    }

    /// The largest answer the API sends.
    pub fn max_answer_bytes(&self) -> usize {
        self.max_answer_bytes
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Asks every API call for `token` (`authorization: Bearer TOKEN`).
    pub fn with_api_token(mut self, token: Option<String>) -> Self {
        self.api_token = token;
        self
    }

    /// Gives every replica a session key derived from `secret`: its
    /// processes get it in their environment, its controller proves it in
    /// every Hello, and a Hello without the proof is refused (S1).
    /// [`load`](Self::load) uses the state directory's
    /// [`SESSION_SECRET_FILE`]. Call it before ensuring replicas: the key is
    /// part of each replica's service spec.
    pub fn with_session_secret(mut self, secret: [u8; 32]) -> Self {
        self.session_secret = Some(secret);
        self
    }

    /// The session key of replica `replica_id`, if replicas have keys.
    pub fn session_key(&self, replica_id: u64) -> Option<lockstep_protocol::SessionKey> {
        self.session_secret
            .as_ref()
            .map(|s| lockstep_protocol::SessionKey::derive(s, replica_id))
    }

    /// Gives every replica a command log: `DIR/replica-N.sqlite` in a
    /// directory (which must exist), or the log `replica-N` in a PostgreSQL
    /// database; passed to the replica's processes and to its controller, so
    /// that the `log` strategy can be used. [`load`](Self::load) uses
    /// `STATE_DIR/command-logs`, or the `--store` database; without this the
    /// replicas have no command log and a `log` choice falls back to
    /// `barrier`. Call it before ensuring replicas: the location is part of
    /// each replica's service spec.
    pub fn with_command_logs(mut self, logs: CommandLogs) -> Self {
        self.command_logs = Some(logs);
        self
    }

    /// The command log of replica `replica_id`, if replicas have command logs.
    pub fn command_log(&self, replica_id: u64) -> Option<LogLocation> {
        self.log_of_service(&ServiceTemplate::service_name(replica_id))
    }

    /// The command log of replica `replica_id`'s standby generation, if
    /// replicas have command logs: a log of its own, as a log orders one
    /// controller's sessions.
    pub(crate) fn standby_command_log(&self, replica_id: u64) -> Option<LogLocation> {
        self.log_of_service(&ServiceTemplate::standby_service_name(replica_id))
    }

    /// The command log of the service named `service` (`DIR/NAME.sqlite`,
    /// or the log `NAME`).
    fn log_of_service(&self, service: &str) -> Option<LogLocation> {
        self.command_logs.as_ref().map(|logs| match logs {
            CommandLogs::Dir(dir) => LogLocation::Sqlite(dir.join(format!("{service}.sqlite"))),
            CommandLogs::Postgres(url) => LogLocation::Postgres {
                url: url.clone(),
                name: service.to_string(),
            },
        })
    }

    /// The orchestrator service of a replica: the template's command line,
    /// plus the replica's command log.
    pub(crate) fn service_config(&self, replica: &Replica) -> lockstep_orchestrator::ServiceConfig {
        self.service_config_with_log(replica, self.command_log(replica.id))
    }

    /// The orchestrator service of replica `replica`'s standby generation:
    /// its own name and command log, the rest as the replica's.
    pub(crate) fn standby_service_config(
        &self,
        replica: &Replica,
    ) -> lockstep_orchestrator::ServiceConfig {
        let mut config =
            self.service_config_with_log(replica, self.standby_command_log(replica.id));
        config.name = ServiceTemplate::standby_service_name(replica.id);
        // The standby's processes' own failpoints (the campaign starts them
        // late: `standby_failpoints=return(replica_start=sleep(MS))`).
        if let Some(Some(failpoints)) = fail::eval("standby_failpoints", |arg| arg) {
            config.env.insert("FAILPOINTS".into(), failpoints);
        }
        config
    }

    fn service_config_with_log(
        &self,
        replica: &Replica,
        log: Option<LogLocation>,
    ) -> lockstep_orchestrator::ServiceConfig {
        let config = self
            .template
            .service_config(&lockstep_launch::ReplicaShape {
                id: replica.id,
                name: replica.name.clone(),
                processes: replica.config.processes as usize,
                workers_per_process: replica.config.workers_per_process,
                config: replica.config.config.clone(),
            });
        let config = match log {
            Some(location) => lockstep_launch::with_command_log(config, &location),
            None => config,
        };
        let config = lockstep_launch::with_max_frame_len(config, self.compute.max_frame_len());
        let config = lockstep_launch::with_replica_config(config, &replica.config.config);
        match self.session_key(replica.id) {
            Some(key) => lockstep_launch::with_session_key(config, &key),
            None => config,
        }
    }

    /// Steps 1 to 3: load, ensure every catalog replica, remove orphans.
    /// Ready to [`serve`](Self::serve) afterwards.
    pub async fn start(config: EnvironmentConfig) -> anyhow::Result<Arc<Environment>> {
        Self::start_with(config, Box::new(process_orchestrator)).await
    }

    /// [`start`](Self::start) with the orchestrator built by `orchestrator`
    /// (see [`load_with`](Self::load_with)).
    pub async fn start_with(
        config: EnvironmentConfig,
        orchestrator: OrchestratorFactory,
    ) -> anyhow::Result<Arc<Environment>> {
        Self::start_with_secret(config, orchestrator, None).await
    }

    /// [`start_with`](Self::start_with) with the master secret given (see
    /// [`load_with_secret`](Self::load_with_secret)): `lockstep serve
    /// --orchestrator kubernetes` passes the one kept in the cluster.
    pub async fn start_with_secret(
        config: EnvironmentConfig,
        orchestrator: OrchestratorFactory,
        master_secret: Option<[u8; 32]>,
    ) -> anyhow::Result<Arc<Environment>> {
        let env = Environment::load_with_secret(config, orchestrator, master_secret)?;
        env.ensure_replicas().await?;
        env.remove_orphans().await?;
        env.drop_leftover_standbys().await?;
        env.settle_reconfigurations()?;
        env.start_compute().await?;
        Ok(Arc::new(env))
    }
}

/// The dataflow format (family) this start serves: the one the catalog
/// records, which a `--format` (`given`) must not contradict. A catalog that
/// records none (a new one, or one of schema version 3 or older) records
/// `given`, or the built-in [`lockstep_plan::FORMAT`]; unless its dataflows
/// (stored before formats were recorded) are of another format, which is
/// refused as a contradiction too. Nothing is recorded on a refusal.
pub(crate) fn resolve_format(
    catalog: &mut Catalog,
    given: Option<String>,
) -> Result<String, StartError> {
    match (catalog.format()?, given) {
        (Some(recorded), None) => {
            tracing::info!(format = %recorded, "format taken from the catalog");
            Ok(recorded)
        }
        (Some(recorded), Some(given)) if recorded == given => Ok(recorded),
        (Some(recorded), Some(given)) => Err(StartError::FormatMismatch {
            recorded,
            given: Some(given),
        }),
        (None, given) => {
            let format = given
                .clone()
                .unwrap_or_else(|| lockstep_plan::FORMAT.to_string());
            let state = catalog.state()?;
            let stored = state.dataflows.values().find_map(|d| {
                compute::decode_dataflow(&d.description)
                    .ok()
                    .map(|desc| desc.format)
                    .filter(|f| *f != format)
            });
            if let Some(recorded) = stored {
                return Err(StartError::FormatMismatch { recorded, given });
            }
            catalog
                .record_format(&format)
                .map_err(StartError::FormatRecord)?;
            tracing::info!(%format, "format recorded in the catalog");
            Ok(format)
        }
    }
}
