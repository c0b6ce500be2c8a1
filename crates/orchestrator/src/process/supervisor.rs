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

    /// Watches process `i` of service `name` (last seen as `watched`) until
    /// the service is dropped or the process leaves its record
    /// ([`Decision::Stop`]): restarts the service when the process exits.
    /// A check it cannot make now ([`Decision::Retry`]: the lock, the record
    /// or `/proc` cannot be read, e.g. EMFILE) is made again after a wait
    /// ([`RETRY_INITIAL`] doubling to [`RETRY_MAX`]), reported at most once
    /// per [`REPORT_EVERY`]; a restart that fails is tried again after the
    /// restart backoff. Neither ends the supervision (R1).
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
        // Whether `watched` is known to have exited (its exit reported), or
        // there is no process to watch.
        let mut down = watched.is_none();
        let mut retries = Retries::default();
        let mut pause = self.config.poll_interval;
        loop {
            tokio::time::sleep(pause).await;
            pause = self.config.poll_interval;
            if let Some((pid, start)) = watched.filter(|_| !down) {
                match self.liveness(pid, start) {
                    Ok(true) => {
                        retries.watching(&name, i);
                        self.rotate_running_log(&name, i);
                        if since.elapsed() >= backoff.reset_after {
                            wait = backoff.initial;
                            attempt = 0;
                        }
                        continue;
                    }
                    Ok(false) => {
                        let status = self.exit_status(pid);
                        tracing::warn!(service = %name, process = i, pid, %status, "process exited");
                        self.emit(&name, Some(i), ServiceEventKind::Exited { pid, status });
                        down = true;
                    }
                    Err(e) => {
                        let reason = format!("cannot tell whether PID {pid} still runs: {e}");
                        pause = self.retry_later(&name, i, &mut retries, down, reason);
                        continue;
                    }
                }
            }
            // Down (or never started): check the record before restarting.
            match self.check_record(&name, i, watched).await {
                Decision::Stop => return,
                Decision::Watch(h) => {
                    retries.watching(&name, i);
                    watched = Some(h);
                    down = false;
                    since = Instant::now();
                    continue;
                }
                Decision::Restart => retries.checked(&name, i),
                Decision::Retry(reason) => {
                    pause = self.retry_later(&name, i, &mut retries, down, reason);
                    continue;
                }
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
                        retries.watching(&name, i);
                        watched = Some(h);
                        down = false;
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
                    Ok(Reassigned::Decided(Decision::Retry(reason))) => {
                        pause = self.retry_later(&name, i, &mut retries, down, reason);
                        continue;
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
                    retries.watching(&name, i);
                    watched = Some(h);
                    down = false;
                    since = Instant::now();
                }
                Ok(Decision::Stop) => return,
                Ok(Decision::Restart) => {}
                Ok(Decision::Retry(reason)) => {
                    pause = self.retry_later(&name, i, &mut retries, down, reason);
                }
                // Not an end either (a spawn that failed with EMFILE, a
                // record that could not be written): the next check finds
                // the process still dead (the record names it, or none) and
                // restarts again after the backoff. `watched` stays the dead
                // process, so its exit is not reported twice.
                Err(reason) => {
                    tracing::error!(service = %name, process = i, %reason, "restart failed");
                    self.emit(&name, Some(i), ServiceEventKind::Failed { reason });
                }
            }
        }
    }

    /// A check of process `i` that could not be made now: not a decision
    /// (R1). Logs it, and if the process is `down` reports it as
    /// [`ServiceEventKind::Failed`] (it cannot be restarted now), both at
    /// most once per [`REPORT_EVERY`] while the process stays down. Returns
    /// how long to wait before checking again.
    fn retry_later(
        &self,
        name: &str,
        i: usize,
        retries: &mut Retries,
        down: bool,
        reason: String,
    ) -> Duration {
        let (wait, report) = retries.fail();
        if report {
            tracing::warn!(
                service = name,
                process = i,
                %reason,
                retry_in = ?wait,
                failed_checks = retries.failed,
                "cannot check the process now: trying again (reported at most every {REPORT_EVERY:?})"
            );
            if down {
                let reason = format!("{reason}; trying again");
                self.emit(name, Some(i), ServiceEventKind::Failed { reason });
            }
        }
        wait
    }

    /// What to do about process `i` (last seen as `watched`), decided under
    /// the lock; [`Decision::Retry`] if the lock cannot be taken now.
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
                Err(e) => return Decision::Retry(lock_failed(&e)),
            };
            inner.decide(&name, i, watched)
        })
        .await
        .expect("check panicked")
    }

    /// Under the lock: what to do about a dead process `watched`.
    pub(super) fn decide(&self, name: &str, i: usize, watched: Option<(u32, u64)>) -> Decision {
        match self.decide_restart(name, i, watched) {
            Ok(_) => Decision::Restart,
            Err(decision) => decision,
        }
    }

    /// Under the lock: [`Decision::Restart`] as the record to restart from
    /// (`Ok`), or any other decision (`Err`). Only a record read as gone
    /// (the service was dropped) or without process `i` (its shape changed)
    /// stops the supervisor; one that cannot be read now, the environment
    /// file beside it included, is [`Decision::Retry`] (R1: a transient
    /// error, EMFILE, is not a drop), and so is a process whose liveness
    /// `/proc` cannot tell now.
    pub(super) fn decide_restart(
        &self,
        name: &str,
        i: usize,
        watched: Option<(u32, u64)>,
    ) -> Result<ServiceRecord, Decision> {
        let record = match self.read(name) {
            Ok(Some(record)) => record,
            // Dropped: not ours to restart.
            Ok(None) => return Err(Decision::Stop),
            Err(e) => {
                return Err(Decision::Retry(format!(
                    "cannot read the service record: {e}"
                )))
            }
        };
        let Some(p) = record.processes.get(i) else {
            return Err(Decision::Stop);
        };
        match p.handle() {
            Some(h) if Some(h) != watched => Err(Decision::Watch(h)),
            Some(h) => match self.liveness(h.0, h.1) {
                Ok(true) => Err(Decision::Watch(h)),
                Ok(false) => Ok(record),
                Err(e) => Err(Decision::Retry(format!(
                    "cannot tell whether PID {} still runs: {e}",
                    h.0
                ))),
            },
            None => Ok(record),
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
        let _lock = match self.lock() {
            Ok(l) => l,
            Err(e) => return Ok(Reassigned::Decided(Decision::Retry(lock_failed(&e)))),
        };
        let mut record = match self.decide_restart(name, i, watched) {
            Ok(record) => record,
            Err(other) => return Ok(Reassigned::Decided(other)),
        };
        let held: Vec<u16> = record.processes[i]
            .ports
            .values()
            .copied()
            .filter(|p| !self.holds(name, i, *p) && port_held(*p))
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
        let ports = self
            .allocate_held(name, record.processes.len(), &record.port_names)
            .map_err(|e| format!("could not choose new ports: {e}"))?;
        let placements: Vec<Placement> = (0..record.processes.len())
            .map(|j| self.placement(j))
            .collect();
        let argv = argv_for(&args, &placements, &ports);
        self.kill_all(&record)
            .map_err(|(j, pid, reason)| format!("process {j} (PID {pid}): {reason}"))?;
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
            ServiceEventKind::AddressesChanged {
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
        let _lock = match self.lock() {
            Ok(l) => l,
            Err(e) => return Ok(Decision::Retry(lock_failed(&e))),
        };
        let mut record = match self.decide_restart(name, i, watched) {
            Ok(record) => record,
            Err(other) => return Ok(other),
        };
        // Shared fate: the processes of a service form one cluster, and a
        // process started alone would join peers of another generation.
        // Kill them all, start them all.
        self.kill_all(&record)
            .map_err(|(j, pid, reason)| format!("process {j} (PID {pid}): {reason}"))?;
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
    /// first (index, PID) not known to be gone after, and why (see
    /// [`Inner::kill_confirmed`]).
    pub(super) fn kill_all(&self, record: &ServiceRecord) -> Result<(), (usize, u32, String)> {
        for (i, p) in record.processes.iter().enumerate() {
            if let Some((pid, start)) = p.handle() {
                self.kill_confirmed(&record.name, i, pid, start)
                    .map_err(|reason| (i, pid, reason))?;
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

/// What a supervisor does about its process.
pub(super) enum Decision {
    /// Stop supervising: the service was dropped (no record), or its
    /// record has no such process any more. Only a record read says so.
    Stop,
    /// Watch this process (PID, start time): it runs, or replaced ours.
    Watch((u32, u64)),
    /// Start the service again as a new generation.
    Restart,
    /// Nothing can be decided now (the lock, the record or `/proc` cannot be
    /// read: EMFILE, ENFILE, ENOMEM, an IO error): check again after a wait.
    /// Why, for the report.
    Retry(String),
}

/// Why the state lock cannot be taken now, for [`Decision::Retry`].
fn lock_failed(e: &StateError) -> String {
    format!("cannot take the state lock: {e}")
}

/// The first wait of a supervisor before checking again after a check it
/// could not make; it doubles up to [`RETRY_MAX`].
const RETRY_INITIAL: Duration = Duration::from_millis(100);

/// The longest wait of a supervisor before checking again after a check it
/// could not make.
const RETRY_MAX: Duration = Duration::from_secs(2);

/// A supervisor whose checks keep failing while its process is down reports
/// it (a warning, and [`ServiceEventKind::Failed`]) at most once per this
/// interval, not once per retry.
const REPORT_EVERY: Duration = Duration::from_secs(10);

/// A supervisor's checks that could not be made ([`Decision::Retry`]): how
/// many in a row, the wait before the next, and when they were last
/// reported.
#[derive(Debug, Default)]
struct Retries {
    /// Checks that failed in a row.
    failed: u32,
    /// The wait before the next check.
    wait: Duration,
    /// When a failed check was last reported, while the process stays down.
    reported: Option<Instant>,
}

impl Retries {
    /// Counts a check that could not be made. Returns the wait before the
    /// next ([`RETRY_INITIAL`], doubling to [`RETRY_MAX`]) and whether to
    /// report this one (the first, then one per [`REPORT_EVERY`]).
    fn fail(&mut self) -> (Duration, bool) {
        self.failed += 1;
        self.wait = if self.failed == 1 {
            RETRY_INITIAL
        } else {
            (self.wait * 2).min(RETRY_MAX)
        };
        let report = self.reported.is_none_or(|at| at.elapsed() >= REPORT_EVERY);
        if report {
            self.reported = Some(Instant::now());
        }
        (self.wait, report)
    }

    /// A check was made again: the next failure waits from
    /// [`RETRY_INITIAL`] again (but is reported only once per
    /// [`REPORT_EVERY`] while the process stays down).
    fn checked(&mut self, name: &str, i: usize) {
        if self.failed > 0 {
            tracing::info!(
                service = name,
                process = i,
                failed_checks = self.failed,
                "the process can be checked again"
            );
        }
        self.failed = 0;
        self.wait = Duration::ZERO;
    }

    /// The process runs (or is watched) again: the next failure is
    /// reported at once.
    fn watching(&mut self, name: &str, i: usize) {
        self.checked(name, i);
        self.reported = None;
    }
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

#[cfg(test)]
mod tests;
