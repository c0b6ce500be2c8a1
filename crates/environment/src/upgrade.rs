//! An upgrade that keeps answering (`lockstep replica upgrade
//! --keep-answering`): the replica's reads are answered while every one of
//! its processes restarts on the program its service names; a resize
//! (`lockstep replica resize`) is the same motion with the replica's
//! processes replaced by processes of a new shape in step 3.
//!
//! 1. A standby generation is started: a second service of the replica
//!    (`replica-N-standby`, its own command log), on that program, driven by
//!    a second controller towards the replica's target history from the
//!    catalog. From now on every mutation of the replica goes to both.
//! 2. Once the standby's frontier of every export is at or past the
//!    replica's own, reads (peeks) go to the standby; the reads the
//!    replica's own processes still owe are answered first.
//! 3. The replica's own processes restart as one new generation (as
//!    [`Environment::restart_replica`]) and catch up to the standby the
//!    same way; reads go back to them, the standby's owed reads are
//!    answered, and the standby is dropped. A resize first writes the new
//!    shape to the catalog (the commit point: an environment killed before
//!    it finds the old shape at its next start, one killed after it the
//!    new), then ensures the replica's service at that shape (its
//!    processes replaced) and points the replica's controller at the new
//!    processes ([`lockstep_controller::Controller::reshape`]); the standby
//!    keeps the old shape throughout.
//!
//! Subscriptions stay with the replica's own controller, which resumes them
//! after the restart or resize (no gap, no duplicate; they stall
//! meanwhile). Moving
//! them to the standby is not built. A failure at any step routes reads back
//! to the replica's own processes and drops the standby; a standby left by
//! an environment that crashed mid-upgrade is dropped at the next start
//! ([`Environment::drop_leftover_standbys`]).

use std::time::{Duration, Instant};

use lockstep_controller::Controller;

use super::*;
use crate::compute::{ComputeError, Generation, Reconfiguration, ReconfigurationPhase};

/// How long each generation may take to catch up before the upgrade fails
/// (twice this stays within the CLI's 60 s bound on a request).
pub const CATCH_UP_BOUND: Duration = Duration::from_secs(25);

/// How long an upgrade waits for the reads a generation owes before it
/// takes that generation away (the controller's request bound).
const DRAIN_BOUND: Duration = Duration::from_secs(20);

/// What an upgrade that keeps answering did.
#[derive(Clone, Debug)]
pub struct AnsweredUpgrade {
    /// The replica with its processes as they were started again.
    pub info: ReplicaInfo,
    /// From the call to the standby caught up.
    pub standby_ready: Duration,
    /// How long the standby answered the replica's reads.
    pub standby_served: Duration,
}

/// A reconfiguration under way as `ListReplicas` shows it.
#[derive(Clone, Debug)]
pub struct ReconfigurationStatus {
    /// What, where, since when.
    pub reconfiguration: Reconfiguration,
    /// How many timestamps the standby's slowest export is behind the
    /// writes to its inputs; `None` without a standby, or until each of
    /// its processes reported every export.
    pub standby_lag: Option<u64>,
    /// The standby's dataflows caught up, if it has a controller.
    pub standby_caught_up: Option<lockstep_controller::CaughtUp>,
    /// The replica's own dataflows caught up.
    pub own_caught_up: Option<lockstep_controller::CaughtUp>,
    /// At the rate the generation this phase waits for has caught up its
    /// dataflows so far, the time left until all are; `None` before the
    /// first, or in a phase that waits for no rebuild.
    pub estimated_left: Option<Duration>,
}

/// What step 3 does to the replica's own processes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Replacement {
    /// Restart them as they are.
    Restart,
    /// Replace them with `processes` processes of `workers_per_process`
    /// workers.
    Resize {
        processes: u32,
        workers_per_process: u32,
    },
}

impl Environment {
    /// Restarts every process of replica `name` as one new generation while
    /// a standby generation answers its reads (see the module docs).
    pub async fn upgrade_replica_answering(
        &self,
        name: &str,
    ) -> Result<AnsweredUpgrade, ComputeError> {
        self.replace_answering(name, Replacement::Restart).await
    }

    /// Gives replica `name` `processes` processes of `workers_per_process`
    /// workers each while a standby generation of its old shape answers its
    /// reads (see the module docs). INVALID_ARGUMENT, with nothing started,
    /// for a shape `replica create` would refuse or the shape it has.
    pub async fn resize_replica_answering(
        &self,
        name: &str,
        processes: u32,
        workers_per_process: u32,
    ) -> Result<AnsweredUpgrade, ComputeError> {
        let replica = self.replica_named(name)?;
        let target = ReplicaConfig {
            processes,
            workers_per_process,
            config: replica.config.config.clone(),
        };
        lockstep_catalog::check_replica(name, &target).map_err(ComputeError::Invalid)?;
        if (processes, workers_per_process)
            == (replica.config.processes, replica.config.workers_per_process)
        {
            return Err(ComputeError::Invalid(format!(
                "replica {name:?} already has {processes} processes of {workers_per_process} workers"
            )));
        }
        self.replace_answering(
            name,
            Replacement::Resize {
                processes,
                workers_per_process,
            },
        )
        .await
    }

    async fn replace_answering(
        &self,
        name: &str,
        replacement: Replacement,
    ) -> Result<AnsweredUpgrade, ComputeError> {
        let started = Instant::now();
        let replica = self.start_standby(name, replacement).await?;
        let result = self
            .serve_from_standby(&replica, replacement, started)
            .await;
        self.compute.route_reads(replica.id, Generation::Own);
        self.phase(&replica, ReconfigurationPhase::DroppingStandby);
        if !self
            .compute
            .drain_reads(replica.id, Generation::Standby, DRAIN_BOUND)
            .await
        {
            tracing::warn!(replica = %replica.name, "reads the standby owed were cut off");
        }
        self.drop_standby(replica.id).await;
        self.clear_reconfiguration(replica.id);
        self.compute.reconfigured(replica.id);
        result
    }

    /// Replica `replica_id`'s reconfiguration under way, if any, with how
    /// far each generation has caught up.
    pub async fn reconfiguration(&self, replica_id: u64) -> Option<ReconfigurationStatus> {
        let reconfiguration = self.compute.reconfiguration(replica_id)?;
        let standby = self.compute.standby(replica_id);
        let (standby_lag, standby_caught_up) = match &standby {
            Some(s) => (
                s.process_lags()
                    .await
                    .ok()
                    .and_then(|lags| lags.into_iter().try_fold(0, |m, l| l.map(|l| m.max(l)))),
                s.caught_up().await.ok(),
            ),
            None => (None, None),
        };
        let own_caught_up = match self.compute.controller(replica_id) {
            Some(c) => c.caught_up().await.ok(),
            None => None,
        };
        // The generation this phase waits for, and its rate so far.
        let hydrating = match reconfiguration.phase {
            ReconfigurationPhase::StandbyHydrating => standby_caught_up,
            ReconfigurationPhase::Hydrating | ReconfigurationPhase::RollingBack => own_caught_up,
            ReconfigurationPhase::Replacing | ReconfigurationPhase::DroppingStandby => None,
        };
        let estimated_left = hydrating.and_then(|h| {
            let left = h.dataflows.checked_sub(h.caught_up)?;
            if left == 0 {
                return Some(Duration::ZERO);
            }
            let per = reconfiguration
                .phase_started
                .elapsed()
                .checked_div(u32::try_from(h.caught_up).ok().filter(|n| *n > 0)?)?;
            per.checked_mul(u32::try_from(left).ok()?)
        });
        Some(ReconfigurationStatus {
            reconfiguration,
            standby_lag,
            standby_caught_up,
            own_caught_up,
            estimated_left,
        })
    }

    /// Replica `replica`'s reconfiguration moved to `phase`.
    fn phase(&self, replica: &Replica, phase: ReconfigurationPhase) {
        tracing::info!(replica = %replica.name, phase = phase.name(), "reconfiguration");
        self.compute.reconfiguration_moved(replica.id, phase);
        if let Some(rc) = self.compute.reconfiguration(replica.id) {
            if let Err(e) = self.record_reconfiguration(replica, &rc) {
                tracing::warn!(replica = %replica.name, "the reconfiguration record was not updated: {e}");
            }
        }
    }

    /// Step 1: the standby's service and controller, under the lock every
    /// mutation takes, so the standby misses none. The reconfiguration is
    /// recorded from here on.
    async fn start_standby(
        &self,
        name: &str,
        replacement: Replacement,
    ) -> Result<Replica, ComputeError> {
        let _ops = self.ops.lock().await;
        self.check_not_halted()?;
        let replica = self.replica_named(name)?;
        if self.compute.controller(replica.id).is_none() {
            return Err(ComputeError::Unavailable(format!(
                "replica {name:?} has no running controller: nothing answers its reads to keep answering"
            )));
        }
        if self.compute.standby(replica.id).is_some() {
            return Err(ComputeError::Unavailable(format!(
                "an upgrade or a resize of replica {name:?} is already under way"
            )));
        }
        let (kind, target) = match replacement {
            Replacement::Restart => (
                "upgrade",
                (replica.config.processes, replica.config.workers_per_process),
            ),
            Replacement::Resize {
                processes,
                workers_per_process,
            } => ("resize", (processes, workers_per_process)),
        };
        self.compute.reconfiguring(replica.id, kind, target);
        // Stored before anything starts.
        let recorded = self
            .compute
            .reconfiguration(replica.id)
            .map(|rc| self.record_reconfiguration(&replica, &rc));
        if let Some(Err(e)) = recorded {
            self.compute.reconfigured(replica.id);
            return Err(e);
        }
        let started = async {
            let status = self
                .orchestrator
                .ensure_service(self.standby_service_config(&replica))
                .await
                .map_err(|e| self.ensure_error(e))?;
            let history = self.history_of(replica.id)?;
            self.compute
                .controller_for(
                    &replica,
                    &status,
                    history,
                    (
                        self.standby_command_log(replica.id),
                        self.session_key(replica.id),
                    ),
                    self.epoch,
                )
                .map_err(ComputeError::Unavailable)
        };
        let controller = match started.await {
            Ok(c) => c,
            Err(e) => {
                self.clear_reconfiguration(replica.id);
                self.compute.reconfigured(replica.id);
                return Err(e);
            }
        };
        self.compute.add_standby(replica.id, controller);
        fail::fail_point!("upgrade_after_standby_started");
        tracing::info!(
            replica = %replica.name,
            service = %ServiceTemplate::standby_service_name(replica.id),
            "standby generation started"
        );
        Ok(replica)
    }

    /// Steps 2 and 3.
    async fn serve_from_standby(
        &self,
        replica: &Replica,
        replacement: Replacement,
        started: Instant,
    ) -> Result<AnsweredUpgrade, ComputeError> {
        let missing = || {
            ComputeError::Unavailable(format!(
                "replica {:?}'s standby or controller went away during the upgrade",
                replica.name
            ))
        };
        let standby = self.compute.standby(replica.id).ok_or_else(missing)?;
        let own = self.compute.controller(replica.id).ok_or_else(missing)?;
        // The campaign's negative control: reads switched before the lag
        // closes (`reads_switch_early`).
        if fail::eval("reads_switch_early", |_| ()).is_some() {
            self.compute.route_reads(replica.id, Generation::Standby);
        }
        self.catch_up(replica, &own, &standby, "the standby")
            .await?;
        // A mutation the standby could not take removed it.
        self.compute.standby(replica.id).ok_or_else(missing)?;
        self.compute.route_reads(replica.id, Generation::Standby);
        self.phase(replica, ReconfigurationPhase::Replacing);
        let standby_ready = started.elapsed();
        tracing::info!(replica = %replica.name, "standby caught up; it answers reads");
        if !self
            .compute
            .drain_reads(replica.id, Generation::Own, DRAIN_BOUND)
            .await
        {
            tracing::warn!(replica = %replica.name, "reads the replica owed wait for its restart");
        }
        let serving = Instant::now();
        let info = match replacement {
            Replacement::Restart => {
                let info = self.restart_replica(&replica.name).await?;
                self.phase(replica, ReconfigurationPhase::Hydrating);
                let own = self.own_controller(replica, "the upgrade")?;
                self.catch_up(replica, &standby, &own, "the restarted replica")
                    .await?;
                info
            }
            Replacement::Resize {
                processes,
                workers_per_process,
            } => {
                let target = (processes, workers_per_process);
                let resized = self
                    .resized_and_caught_up(
                        replica,
                        target,
                        &standby,
                        ReconfigurationPhase::Hydrating,
                    )
                    .await;
                match resized {
                    Ok(info) => info,
                    Err(e) => return Err(self.roll_back(replica, &standby, e).await),
                }
            }
        };
        self.compute.standby(replica.id).ok_or_else(missing)?;
        let standby_served = serving.elapsed();
        tracing::info!(
            replica = %replica.name,
            served_ms = standby_served.as_millis() as u64,
            "restarted replica caught up; it answers reads again"
        );
        Ok(AnsweredUpgrade {
            info,
            standby_ready,
            standby_served,
        })
    }

    /// Step 3 of a resize to `target` (processes, workers), then, in
    /// `phase`, the replica's new processes caught up with `standby`.
    async fn resized_and_caught_up(
        &self,
        replica: &Replica,
        (processes, workers_per_process): (u32, u32),
        standby: &Controller,
        phase: ReconfigurationPhase,
    ) -> Result<ReplicaInfo, ComputeError> {
        let info = self
            .resize_own(replica, processes, workers_per_process)
            .await?;
        let own = self.own_controller(replica, "the resize")?;
        self.phase(replica, phase);
        self.catch_up(replica, standby, &own, "the replica's new processes")
            .await?;
        Ok(info)
    }

    /// A resize whose new processes failed (`failed`): the replica goes
    /// back to its old shape while `standby` keeps answering its reads, and
    /// catches up with it again. Returns the error the call answers: the
    /// failure and that it was rolled back, or what failed in the roll-back.
    async fn roll_back(
        &self,
        replica: &Replica,
        standby: &Controller,
        failed: ComputeError,
    ) -> ComputeError {
        let old = (replica.config.processes, replica.config.workers_per_process);
        let (processes, workers) = old;
        tracing::warn!(
            replica = %replica.name,
            "the resize failed ({failed}): rolling back to {processes}x{workers}"
        );
        let back = self
            .resized_and_caught_up(replica, old, standby, ReconfigurationPhase::RollingBack)
            .await;
        match back {
            Ok(_) => ComputeError::Unavailable(format!(
                "{failed}; rolled back to {processes}x{workers} (processes x workers), reads answered throughout"
            )),
            Err(e) => ComputeError::Unavailable(format!(
                "{failed}; the roll-back to {processes}x{workers} failed too: {e}"
            )),
        }
    }

    /// Replica `replica`'s own controller, or UNAVAILABLE: it went away
    /// during `what`.
    fn own_controller(&self, replica: &Replica, what: &str) -> Result<Controller, ComputeError> {
        self.compute.controller(replica.id).ok_or_else(|| {
            ComputeError::Unavailable(format!(
                "replica {:?}'s controller went away during {what}",
                replica.name
            ))
        })
    }

    /// Step 3 of a resize: the new shape in the catalog, the replica's
    /// service ensured at it (its processes replaced), its controller
    /// pointed at the new processes.
    async fn resize_own(
        &self,
        replica: &Replica,
        processes: u32,
        workers_per_process: u32,
    ) -> Result<ReplicaInfo, ComputeError> {
        let _ops = self.ops.lock().await;
        self.check_not_halted()?;
        // The shape it had: the old one, or the new one when rolling back.
        let (resized, before) = {
            let mut catalog = self.catalog.lock().expect("poisoned");
            let resized = catalog
                .resize_replica(&replica.name, processes, workers_per_process)
                .map_err(|e| self.catalog_error(e))?;
            let before = self
                .view
                .lock()
                .expect("poisoned")
                .replicas
                .insert(resized.id, resized.clone())
                .map_or(replica.config.clone(), |r| r.config);
            (resized, before)
        };
        fail::fail_point!("resize_after_catalog");
        tracing::info!(
            replica = %replica.name,
            from = %format!("{}x{}", before.processes, before.workers_per_process),
            to = %format!("{processes}x{workers_per_process}"),
            "resizing: the new shape is in the catalog"
        );
        self.metrics()
            .forget_processes(&replica.name, processes..before.processes);
        let status = self
            .orchestrator
            .ensure_service(self.service_config(&resized))
            .await
            .map_err(|e| self.ensure_error(e))?;
        fail::fail_point!("resize_after_replaced");
        let mut addrs = self
            .compute
            .addrs_for(
                &resized,
                &status,
                (self.command_log(resized.id), self.session_key(resized.id)),
            )
            .map_err(ComputeError::Unavailable)?;
        let own = self.own_controller(replica, "the resize")?;
        // The new processes out of the controller's reach: the roll-back's
        // test (`resize_new_processes_unreachable=1*return`, the first
        // resize only).
        if fail::eval("resize_new_processes_unreachable", |_| ()).is_some() {
            for p in &mut addrs.processes {
                *p = std::net::SocketAddr::from(([127, 0, 0, 1], 1)).into();
            }
        }
        own.reshape(addrs)?;
        Ok(ReplicaInfo {
            replica: resized,
            service: Some(status),
        })
    }

    /// Waits, at most [`CATCH_UP_BOUND`], until `behind` answers every
    /// worker's ping and its frontier of every export of the replica's live
    /// dataflows is at or past `ahead`'s (as `ahead` reports it now).
    async fn catch_up(
        &self,
        replica: &Replica,
        ahead: &Controller,
        behind: &Controller,
        what: &str,
    ) -> Result<(), ComputeError> {
        // Shorter in the roll-back's test (`resize_catch_up_bound_ms`).
        let bound = fail::eval("resize_catch_up_bound_ms", |ms| {
            ms.and_then(|ms| ms.parse().ok()).map(Duration::from_millis)
        })
        .flatten()
        .unwrap_or(CATCH_UP_BOUND);
        let deadline = tokio::time::Instant::now() + bound;
        let late = || {
            ComputeError::Unavailable(format!(
                "{what} of replica {:?} did not catch up within {bound:?}",
                replica.name
            ))
        };
        // A controller's own bound (its request timeout) may run out first
        // while processes start: asked again until the deadline. A
        // controller that is gone fails the upgrade at once.
        loop {
            match tokio::time::timeout_at(deadline, behind.ping()).await {
                Ok(Ok(())) => break,
                Ok(Err(lockstep_controller::ControllerError::Timeout { .. })) => {}
                Ok(Err(e)) => return Err(e.into()),
                Err(_) => return Err(late()),
            }
        }
        let exports: Vec<u64> = self
            .dataflows_of(replica.id)?
            .iter()
            .flat_map(|d| d.exports.iter().map(|e| e.collection_id))
            .collect();
        for collection in exports {
            // A frontier `f` means complete below `f`: `behind` is there once
            // its frontier passes `f - 1`; an empty one (complete) only by
            // an empty one.
            let beyond = match ahead.frontier(collection).await {
                Ok(Some(Some(0))) | Ok(None) => continue,
                Ok(Some(Some(f))) => f - 1,
                Ok(Some(None)) => lockstep_protocol::Timestamp::MAX - 1,
                Err(e) => return Err(e.into()),
            };
            loop {
                match tokio::time::timeout_at(
                    deadline,
                    behind.wait_for_frontier(collection, beyond),
                )
                .await
                {
                    Ok(Ok(())) => break,
                    Ok(Err(lockstep_controller::ControllerError::Timeout { .. })) => continue,
                    Ok(Err(e)) => return Err(e.into()),
                    Err(_) => return Err(late()),
                }
            }
        }
        Ok(())
    }

    /// Removes replica `replica_id`'s standby: its controller, its service
    /// and its command log (failures logged: a leftover is dropped at the
    /// next start).
    async fn drop_standby(&self, replica_id: u64) {
        let _ops = self.ops.lock().await;
        self.compute.remove_standby(replica_id);
        self.drop_standby_service(replica_id).await;
    }

    async fn drop_standby_service(&self, replica_id: u64) {
        let service = ServiceTemplate::standby_service_name(replica_id);
        if let Err(e) = self.orchestrator.drop_service(&service).await {
            tracing::warn!(%service, "the standby generation was left: {e}");
        }
        if let Some(log) = self.standby_command_log(replica_id) {
            if let Err(e) = log.remove(self.epoch()) {
                tracing::warn!(%log, error = %e, "the standby's command log was left");
            }
        }
    }

    /// Drops every standby generation an earlier environment left (it
    /// crashed mid-upgrade): called at start, after orphan removal. Returns
    /// how many it dropped.
    pub async fn drop_leftover_standbys(&self) -> Result<usize, EnvError> {
        let _ops = self.ops.lock().await;
        self.check_not_halted()?;
        let services = self.services().await?;
        let mut dropped = 0;
        for s in services {
            if s.name == ServiceTemplate::standby_service_name(s.id) {
                tracing::info!(service = %s.name, "dropping a standby generation left by an interrupted upgrade");
                self.drop_standby_service(s.id).await;
                dropped += 1;
            }
        }
        Ok(dropped)
    }
}
