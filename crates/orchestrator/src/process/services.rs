//! A service as a whole, under the state-directory lock: ensure
//! (conditional on the epoch, adopting an unchanged spec), drop (a
//! tombstone first), restart (a new generation) and its status.

use super::*;

impl Inner {
    pub(super) fn ensure(
        &self,
        config: ServiceConfig,
    ) -> Result<(ServiceRecord, Vec<u32>), EnsureError> {
        validate_name(&config.name)?;
        if config.scale == 0 {
            return Err(EnsureError::Invalid(format!(
                "service {} needs at least one process",
                config.name
            )));
        }
        let program =
            resolve_program(&config.program).ok_or_else(|| EnsureError::ProgramNotFound {
                service: config.name.clone(),
                program: config.program.clone(),
            })?;
        let _lock = self.lock()?;
        let existing = self.read(&config.name)?;
        let ours = self.config.epoch;
        self.check_fence(&config.name, existing.as_ref(), ours)?;
        // Reuse the ports of an existing service of the same shape, so an
        // unchanged spec yields the same command lines and is adopted.
        let alloc = || {
            self.allocate_held(&config.name, config.scale, &config.ports)
                .map_err(|e| EnsureError::Spawn {
                    service: config.name.clone(),
                    program: program.clone(),
                    source: e,
                })
        };
        let placements: Vec<Placement> = (0..config.scale).map(|i| self.placement(i)).collect();
        let args_for = |ports: &[BTreeMap<String, u16>]| argv_for(&config.args, &placements, ports);
        // Try the ports of an existing service of the same shape first, so an
        // unchanged spec yields the same command lines and is adopted.
        let reused = match &existing {
            Some(e) if e.processes.len() == config.scale && e.port_names == config.ports => Some(
                e.processes
                    .iter()
                    .map(|p| p.ports.clone())
                    .collect::<Vec<_>>(),
            ),
            _ => None,
        };
        let mut ports = match reused {
            Some(p) => p,
            None => alloc()?,
        };
        let mut argv = args_for(&ports);
        let mut labels = config.labels.clone();
        labels.insert(EPOCH_LABEL.to_string(), ours.to_string());
        labels.insert(ID_LABEL.to_string(), config.id.to_string());

        let same_spec = existing.as_ref().is_some_and(|e| {
            e.program == program
                && e.env == config.env
                && e.processes.iter().map(|p| &p.argv).eq(argv.iter())
                && e.processes
                    .iter()
                    .map(|p| &p.namespace)
                    .eq(placements.iter().map(|p| &p.namespace))
        });
        if let (true, Some(record)) = (same_spec, existing.clone()) {
            return self.adopt(record, &config, labels);
        }

        // A new or changed spec: start the new processes first, so that a
        // failure leaves the old service untouched. They get fresh ports, as
        // the old processes still hold theirs until they are killed.
        if existing.is_some() {
            ports = alloc()?;
            argv = args_for(&ports);
        }
        let mut record = ServiceRecord {
            version: RECORD_VERSION,
            name: config.name.clone(),
            id: config.id,
            epoch: ours,
            labels,
            program: program.clone(),
            env: config.env.clone(),
            port_names: config.ports.clone(),
            generation: existing.as_ref().map_or(1, |e| e.generation + 1),
            processes: argv
                .into_iter()
                .zip(ports)
                .zip(placements)
                .map(|((argv, ports), placement)| ProcessRecord {
                    argv,
                    ports,
                    pid: None,
                    start_time: None,
                    restarts: 0,
                    namespace: placement.namespace,
                    address: placement.address,
                })
                .collect(),
        };
        let spawned = self
            .spawn_all(&mut record)
            .map_err(|source| EnsureError::Spawn {
                service: config.name.clone(),
                program,
                source,
            })?;
        if let Some(old) = &existing {
            self.kill_processes(old);
        }
        if let Err(e) = self.write(&record) {
            self.kill_processes(&record);
            return Err(e.into());
        }
        self.remember_args(&config);
        for (i, pid) in spawned.iter().enumerate() {
            self.emit(
                &record.name,
                Some(i),
                ServiceEventKind::Started { pid: *pid },
            );
        }
        Ok((record, spawned))
    }

    /// Refuses the write of a stale controller: a service ensured at a newer
    /// epoch, or dropped at one (a drop is a write too: a stale controller
    /// must not resurrect a service that a newer one dropped).
    fn check_fence(
        &self,
        name: &str,
        existing: Option<&ServiceRecord>,
        ours: u64,
    ) -> Result<(), EnsureError> {
        if !self.config.conditional_writes {
            return Ok(());
        }
        if let Some(existing) = existing.filter(|e| e.epoch > ours) {
            return Err(EnsureError::StaleEpoch {
                service: name.to_string(),
                stored: existing.epoch,
                ours,
            });
        }
        if let Some(dropped_at) = self.read_tombstone(name)?.filter(|d| *d > ours) {
            return Err(EnsureError::DroppedByNewer {
                service: name.to_string(),
                dropped_at,
                ours,
            });
        }
        Ok(())
    }

    /// Adopts an unchanged service: keeps its processes, rewrites the epoch,
    /// ID and labels. Dead processes are restarted by the supervisors.
    fn adopt(
        &self,
        mut record: ServiceRecord,
        config: &ServiceConfig,
        labels: BTreeMap<String, String>,
    ) -> Result<(ServiceRecord, Vec<u32>), EnsureError> {
        record.epoch = self.config.epoch;
        record.id = config.id;
        record.labels = labels;
        self.write(&record)?;
        self.remember_args(config);
        for (i, p) in record.processes.iter().enumerate() {
            if let Some((pid, start)) = p.handle() {
                if self.alive(pid, start) {
                    self.emit(&record.name, Some(i), ServiceEventKind::Adopted { pid });
                }
            }
        }
        Ok((record, Vec::new()))
    }

    /// Spawns every process of `record`, noting each pid and start time;
    /// returns the pids. A failed spawn kills those already started.
    fn spawn_all(&self, record: &mut ServiceRecord) -> std::io::Result<Vec<u32>> {
        let mut spawned = Vec::new();
        for i in 0..record.processes.len() {
            match self.spawn(record, i) {
                Ok((pid, start)) => {
                    record.processes[i].pid = Some(pid);
                    record.processes[i].start_time = Some(start);
                    spawned.push(pid);
                }
                Err(source) => {
                    for (j, p) in record.processes.iter().enumerate().take(i) {
                        if let Some((pid, start)) = p.handle() {
                            self.kill(&record.name, j, pid, start);
                        }
                    }
                    return Err(source);
                }
            }
        }
        Ok(spawned)
    }

    /// Kills every process of `record` that has a handle, without waiting
    /// to confirm (unlike [`Inner::kill_all`]).
    fn kill_processes(&self, record: &ServiceRecord) {
        for (i, p) in record.processes.iter().enumerate() {
            if let Some((pid, start)) = p.handle() {
                self.kill(&record.name, i, pid, start);
            }
        }
    }

    pub(super) fn remember_args(&self, config: &ServiceConfig) {
        self.args
            .lock()
            .expect("poisoned")
            .insert(config.name.clone(), config.args.clone());
    }

    pub(super) fn drop_service(&self, name: &str) -> Result<bool, DropError> {
        validate_name(name).map_err(|e| DropError::Invalid(e.to_string()))?;
        let _lock = self.lock()?;
        // Record the drop first (the highest epoch that dropped it), so that
        // even a drop of an absent service fences stale re-creations.
        let tombstone = self
            .read_tombstone(name)?
            .unwrap_or(0)
            .max(self.config.epoch);
        self.write_tombstone(name, tombstone)?;
        let Some(record) = self.read(name)? else {
            return Ok(false);
        };
        for (i, p) in record.processes.iter().enumerate() {
            if let Some((pid, start)) = p.handle() {
                self.kill_confirmed(name, i, pid, start)
                    .map_err(|reason| DropError::Kill {
                        service: name.to_string(),
                        pid,
                        reason,
                    })?;
            }
        }
        let path = self.record_path(name);
        remove_record(&path).map_err(|e| Self::state_err(&path, e))?;
        self.release_ports(name);
        // Its logs go with it (best effort: a leftover is only disk).
        for i in 0..record.processes.len() {
            let log = self.log_path(name, i);
            let _ = std::fs::remove_file(log.with_extension("log.1"));
            let _ = std::fs::remove_file(&log);
        }
        tracing::info!(service = name, "dropped");
        self.emit(name, None, ServiceEventKind::Dropped);
        Ok(true)
    }

    /// Under the lock: kills every process of the service, then starts each
    /// again from its record. Returns the new record, and the first spawn
    /// failure if a process could not be started (the record then has no PID
    /// for it, and a supervisor starts it later).
    pub(super) fn restart_service(
        &self,
        name: &str,
    ) -> Result<(ServiceRecord, Option<RestartError>), RestartError> {
        validate_name(name).map_err(|e| RestartError::Invalid(e.to_string()))?;
        let _lock = self.lock()?;
        let Some(mut record) = self.read(name)? else {
            return Err(RestartError::NoSuchService(name.to_string()));
        };
        let ours = self.config.epoch;
        if self.config.conditional_writes && record.epoch > ours {
            return Err(RestartError::StaleEpoch {
                service: name.to_string(),
                stored: record.epoch,
                ours,
            });
        }
        // Every old process must be gone before a new one binds its ports.
        self.kill_all(&record)
            .map_err(|(_, pid, reason)| RestartError::Kill {
                service: name.to_string(),
                pid,
                reason,
            })?;
        let (spawned, failure) = self.start_generation(&mut record);
        self.commit_generation(&record, spawned)?;
        let failure = failure.map(|(process, source)| RestartError::Spawn {
            service: name.to_string(),
            process,
            program: record.program.clone(),
            source,
        });
        Ok((record, failure))
    }

    pub(super) fn status(&self, record: &ServiceRecord) -> ServiceStatus {
        ServiceStatus {
            name: record.name.clone(),
            id: record.id,
            epoch: record.epoch,
            labels: record.labels.clone(),
            processes: record
                .processes
                .iter()
                .enumerate()
                .map(|(index, p)| ProcessStatus {
                    index,
                    pid: p.pid,
                    running: p.handle().is_some_and(|(pid, s)| self.alive(pid, s)),
                    addresses: addresses(p.address, &p.ports),
                    restarts: p.restarts,
                })
                .collect(),
        }
    }
}

pub(super) fn validate_name(name: &str) -> Result<(), EnsureError> {
    let ok = !name.is_empty()
        && name.len() <= 200
        && !name.starts_with('.')
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if ok {
        Ok(())
    } else {
        Err(EnsureError::Invalid(format!(
            "service name {name:?} must be letters, digits, '-', '_' or '.', not starting with '.'"
        )))
    }
}
