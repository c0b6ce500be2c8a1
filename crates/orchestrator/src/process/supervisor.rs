//! The supervisors: one task per process watches it, and when it exits,
//! starts the whole service again as a new generation (shared fate), or
//! re-chooses every port when a held port keeps it from starting; and the
//! rotation of a running process's log.

use super::*;

impl Inner {
    /// Starts one supervisor per process of `record`, replacing this
    /// orchestrator's earlier supervisors of the service.
    pub(super) fn supervise(
        self: &Arc<Self>,
        name: &str,
        record: &ServiceRecord,
        _spawned: Vec<u32>,
    ) {
        let tasks: Vec<JoinHandle<()>> = (0..record.processes.len())
            .map(|i| {
                let inner = self.clone();
                let name = name.to_string();
                let watched = record.processes[i].handle();
                tokio::spawn(async move { inner.supervisor(name, i, watched).await })
            })
            .collect();
        if let Some(old) = self
            .supervisors
            .lock()
            .expect("poisoned")
            .insert(name.to_string(), tasks)
        {
            for t in old {
                t.abort();
            }
        }
    }

    pub(super) async fn supervisor(
        self: Arc<Self>,
        name: String,
        i: usize,
        mut watched: Option<(u32, u64)>,
    ) {
        let backoff = self.config.backoff;
        let mut wait = backoff.initial;
        let mut attempt = 0u32;
        let mut since = Instant::now();
        loop {
            tokio::time::sleep(self.config.poll_interval).await;
            if let Some((pid, start)) = watched {
                if self.alive(pid, start) {
                    self.rotate_running_log(&name, i);
                    if since.elapsed() >= backoff.reset_after {
                        wait = backoff.initial;
                        attempt = 0;
                    }
                    continue;
                }
                let status = self.exit_status(pid);
                tracing::warn!(service = %name, process = i, pid, %status, "process exited");
                self.emit(&name, Some(i), ServiceEventKind::Exited { pid, status });
            }
            // Dead (or never started): check the record before restarting.
            match self.check_record(&name, i, watched).await {
                Decision::Stop => return,
                Decision::Watch(h) => {
                    watched = Some(h);
                    since = Instant::now();
                    continue;
                }
                Decision::Restart => {}
            }
            let reassign_after = self.config.reassign_ports_after;
            if reassign_after > 0 && attempt >= reassign_after {
                let inner = self.clone();
                let n = name.clone();
                let result =
                    tokio::task::spawn_blocking(move || inner.reassign_ports(&n, i, watched))
                        .await
                        .expect("port reassignment panicked");
                match result {
                    Ok(Reassigned::NotNeeded) => {}
                    Ok(Reassigned::Decided(Decision::Stop)) => return,
                    Ok(Reassigned::Decided(Decision::Watch(h))) => {
                        watched = Some(h);
                        since = Instant::now();
                        wait = backoff.initial;
                        attempt = 0;
                        continue;
                    }
                    Ok(Reassigned::Decided(Decision::Restart)) => {
                        // New ports, but this process could not be started.
                        watched = None;
                        wait = backoff.initial;
                        attempt = 0;
                    }
                    Err(reason) => {
                        tracing::error!(service = %name, process = i, %reason, "re-choosing ports failed");
                        self.emit(&name, Some(i), ServiceEventKind::Failed { reason });
                    }
                }
            }
            attempt += 1;
            self.emit(
                &name,
                Some(i),
                ServiceEventKind::Restarting {
                    attempt,
                    backoff: wait,
                },
            );
            tokio::time::sleep(wait).await;
            wait = (wait * 2).min(backoff.max);
            let inner = self.clone();
            let n = name.clone();
            let result = tokio::task::spawn_blocking(move || inner.restart(&n, i, watched))
                .await
                .expect("restart panicked");
            match result {
                Ok(Decision::Watch(h)) => {
                    watched = Some(h);
                    since = Instant::now();
                }
                Ok(Decision::Stop) => return,
                Ok(Decision::Restart) => {}
                Err(reason) => {
                    tracing::error!(service = %name, process = i, %reason, "restart failed");
                    self.emit(&name, Some(i), ServiceEventKind::Failed { reason });
                    watched = None;
                }
            }
        }
    }

    pub(super) async fn check_record(
        self: &Arc<Self>,
        name: &str,
        i: usize,
        watched: Option<(u32, u64)>,
    ) -> Decision {
        let inner = self.clone();
        let name = name.to_string();
        tokio::task::spawn_blocking(move || {
            let _lock = match inner.lock() {
                Ok(l) => l,
                Err(_) => return Decision::Restart,
            };
            inner.decide(&name, i, watched)
        })
        .await
        .expect("check panicked")
    }

    /// Under the lock: what to do about a dead process `watched`.
    pub(super) fn decide(&self, name: &str, i: usize, watched: Option<(u32, u64)>) -> Decision {
        match self.read(name) {
            Ok(Some(record)) => match record.processes.get(i) {
                None => Decision::Stop,
                Some(p) => match p.handle() {
                    Some(h) if Some(h) != watched => Decision::Watch(h),
                    Some(h) if self.alive(h.0, h.1) => Decision::Watch(h),
                    _ => Decision::Restart,
                },
            },
            // Dropped, or unreadable: not ours to restart.
            _ => Decision::Stop,
        }
    }

    /// Under the lock: if process `i` (dead, last seen as `watched`) has a
    /// recorded port that another socket holds, chooses new ports for every
    /// process of the service (their peers must all agree), kills them all,
    /// starts them all with command lines built for the new ports, and
    /// records them. Only for a service of our epoch whose args function we
    /// have (we ensured it): a newer controller's clients would not learn of
    /// the new ports.
    pub(super) fn reassign_ports(
        &self,
        name: &str,
        i: usize,
        watched: Option<(u32, u64)>,
    ) -> Result<Reassigned, String> {
        let _lock = self.lock().map_err(|e| e.to_string())?;
        match self.decide(name, i, watched) {
            Decision::Restart => {}
            other => return Ok(Reassigned::Decided(other)),
        }
        let mut record = match self.read(name) {
            Ok(Some(r)) => r,
            _ => return Ok(Reassigned::Decided(Decision::Stop)),
        };
        let held: Vec<u16> = record.processes[i]
            .ports
            .values()
            .copied()
            .filter(|p| port_held(*p))
            .collect();
        if held.is_empty() || record.epoch != self.config.epoch {
            return Ok(Reassigned::NotNeeded);
        }
        let Some(args) = self.args.lock().expect("poisoned").get(name).cloned() else {
            tracing::warn!(
                service = name,
                process = i,
                ?held,
                "a port of the process is held by another socket, but this orchestrator did not ensure the service: cannot build new command lines"
            );
            return Ok(Reassigned::NotNeeded);
        };
        tracing::warn!(
            service = name,
            process = i,
            ?held,
            "the process keeps exiting and a port recorded for it is held by another socket: choosing new ports for every process"
        );
        let ports = allocate_ports(record.processes.len(), &record.port_names)
            .map_err(|e| format!("could not choose new ports: {e}"))?;
        let placements: Vec<Placement> = (0..record.processes.len())
            .map(|j| self.placement(j))
            .collect();
        let argv = argv_for(&args, &placements, &ports);
        self.kill_all(&record)
            .map_err(|(j, pid)| format!("process {j} (PID {pid}) still alive 5 s after SIGKILL"))?;
        for (j, (argv, ports)) in argv.into_iter().zip(ports).enumerate() {
            record.processes[j].argv = argv;
            record.processes[j].ports = ports;
        }
        let (spawned, _) = self.start_generation(&mut record);
        // Announced after the new addresses, below.
        if let Err(e) = self.write(&record) {
            for (j, pid, start) in spawned {
                self.kill(name, j, pid, start);
            }
            return Err(e.to_string());
        }
        self.emit(
            name,
            None,
            ServiceEventKind::PortsReassigned {
                addresses: record
                    .processes
                    .iter()
                    .map(|p| addresses(p.address, &p.ports))
                    .collect(),
            },
        );
        for (j, pid, _) in spawned {
            self.emit(name, Some(j), ServiceEventKind::Started { pid });
        }
        Ok(Reassigned::Decided(match record.processes[i].handle() {
            Some(h) => Decision::Watch(h),
            None => Decision::Restart,
        }))
    }

    /// Under the lock: unless someone else did already, restarts every
    /// process of the service as a new generation because process `i`
    /// (last seen as `watched`) is dead.
    pub(super) fn restart(
        &self,
        name: &str,
        i: usize,
        watched: Option<(u32, u64)>,
    ) -> Result<Decision, String> {
        let _lock = self.lock().map_err(|e| e.to_string())?;
        match self.decide(name, i, watched) {
            Decision::Restart => {}
            other => return Ok(other),
        }
        let mut record = match self.read(name) {
            Ok(Some(r)) => r,
            _ => return Ok(Decision::Stop),
        };
        // Shared fate: the processes of a service form one cluster, and a
        // process started alone would join peers of another generation.
        // Kill them all, start them all.
        self.kill_all(&record)
            .map_err(|(j, pid)| format!("process {j} (PID {pid}) still alive 5 s after SIGKILL"))?;
        tracing::warn!(
            service = name,
            process = i,
            generation = record.generation + 1,
            "a process exited: restarting every process of the service"
        );
        let (spawned, failure) = self.start_generation(&mut record);
        self.commit_generation(&record, spawned)
            .map_err(|e| e.to_string())?;
        if let Some((j, e)) = failure {
            if j == i {
                return Err(format!(
                    "could not start {}: {e}",
                    record.program.as_path().display()
                ));
            }
        }
        Ok(match record.processes[i].handle() {
            Some(h) => Decision::Watch(h),
            None => Decision::Restart,
        })
    }

    /// Under the lock: kills every recorded process of `record`. Error: the
    /// first (index, PID) still alive 5 s after SIGKILL.
    pub(super) fn kill_all(&self, record: &ServiceRecord) -> Result<(), (usize, u32)> {
        for (i, p) in record.processes.iter().enumerate() {
            if let Some((pid, start)) = p.handle() {
                self.kill(&record.name, i, pid, start);
                if proc_alive(pid, start) {
                    return Err((i, pid));
                }
            }
        }
        Ok(())
    }

    /// Under the lock, after [`Inner::kill_all`]: starts every process of
    /// `record` as a new generation, from its recorded command line. Returns
    /// the processes started and the first that could not be (it is left
    /// without a PID; its supervisor starts a generation again later).
    pub(super) fn start_generation(
        &self,
        record: &mut ServiceRecord,
    ) -> (Vec<Spawned>, Option<(usize, std::io::Error)>) {
        record.generation += 1;
        let mut failure = None;
        let mut spawned = Vec::new();
        for i in 0..record.processes.len() {
            record.processes[i].pid = None;
            record.processes[i].start_time = None;
            let result = self.spawn(record, i);
            let p = &mut record.processes[i];
            p.restarts += 1;
            match result {
                Ok((pid, start)) => {
                    p.pid = Some(pid);
                    p.start_time = Some(start);
                    spawned.push((i, pid, start));
                }
                Err(source) => {
                    tracing::error!(
                        service = %record.name,
                        process = i,
                        "could not start the process: {source}"
                    );
                    failure.get_or_insert((i, source));
                }
            }
        }
        (spawned, failure)
    }

    /// Under the lock: records a generation [`Inner::start_generation`]
    /// started and announces its processes; if the record cannot be written,
    /// kills them (none may run unrecorded; the old record's dead processes
    /// make the supervisors try again).
    pub(super) fn commit_generation(
        &self,
        record: &ServiceRecord,
        spawned: Vec<Spawned>,
    ) -> Result<(), StateError> {
        if let Err(e) = self.write(record) {
            for (i, pid, start) in spawned {
                self.kill(&record.name, i, pid, start);
            }
            return Err(e);
        }
        tracing::info!(
            service = %record.name,
            generation = record.generation,
            "started every process as a new generation"
        );
        for (i, pid, _) in spawned {
            self.emit(&record.name, Some(i), ServiceEventKind::Started { pid });
        }
        Ok(())
    }

    /// Rotates the log of a running process past the limit: copies it to
    /// `.log.1` and truncates it in place (the process appends to the same
    /// open file, O_APPEND, so it goes on at the new end). A process that
    /// logs without end fills at most twice the limit on disk.
    pub(super) fn rotate_running_log(&self, name: &str, i: usize) {
        let path = self.log_path(name, i);
        let limit = self.config.log_rotate_bytes;
        if !std::fs::metadata(&path).is_ok_and(|m| m.len() > limit) {
            return;
        }
        let rotated = path.with_extension("log.1");
        let result = std::fs::copy(&path, &rotated).and_then(|_| {
            std::fs::set_permissions(&rotated, std::fs::Permissions::from_mode(0o600))?;
            OpenOptions::new().write(true).open(&path)?.set_len(0)
        });
        if let Err(e) = result {
            tracing::warn!(service = name, process = i, "rotating the log failed: {e}");
        }
    }
}

pub(super) enum Decision {
    Stop,
    Watch((u32, u64)),
    Restart,
}

/// What [`Inner::reassign_ports`] did.
pub(super) enum Reassigned {
    /// Nothing: no port of the process is held by another socket (or the
    /// service is not ours to re-port); restart it as usual.
    NotNeeded,
    /// Handled (by us or someone else): what to do about the process now.
    Decided(Decision),
}

/// A process started: its index, PID and start time.
pub(super) type Spawned = (usize, u32, u64);
