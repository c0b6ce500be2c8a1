//! The watcher of one controller's events: it restarts the replica through
//! the orchestrator when the controller reports a silent process, lost
//! lockstep or a history mismatch, or cannot reach a replica that served
//! for [`UNREACHABLE_AFTER`] ([`Reach`]), at most once per
//! [`REPLICA_RESTART_INTERVAL`]; and keeps the replica's metrics.

use super::*;

/// How long a replica that served may stay unreachable (its connections
/// lost and not made again) before it is restarted: its processes are
/// gone and nothing else noticed (their node lost: no kubelet restarts
/// them and the API still shows them running). Longer than the Kubernetes
/// backend's own replacement of a generation may take (`stuck_after`, 20
/// s, and the new pods' creation), which starts the processes again.
pub(crate) const UNREACHABLE_AFTER: Duration = Duration::from_secs(30);

/// Whether the replica is reachable, as the controller's events and the
/// orchestrator's say. Only a replica that served since its processes
/// last started counts as lost when it cannot be reached: a generation
/// still starting (an image being pulled) is the orchestrator's to wait
/// for, and restarting it would only start it again.
#[derive(Debug, Default)]
pub(super) struct Reach {
    /// A session was established since the processes last started.
    served: bool,
    /// Since when no session has been up, once it served.
    unreachable_since: Option<Instant>,
}

impl Reach {
    /// Takes in a controller event.
    pub(super) fn on_event(&mut self, e: &Event) {
        match e {
            Event::Connected { .. } => self.reached(),
            Event::Disconnected { .. } | Event::ConnectFailed { .. } if self.served => {
                self.unreachable_since.get_or_insert_with(Instant::now);
            }
            _ => {}
        }
    }

    /// When the replica counts as lost, if it served and is unreachable:
    /// `after` past the loss.
    pub(super) fn deadline(&self, after: Duration) -> Option<Instant> {
        self.unreachable_since
            .filter(|_| self.served)
            .map(|since| since + after)
    }

    /// The restart reason once [`Reach::deadline`] passed (the processes
    /// must then serve again before they can be lost again).
    pub(super) fn lost(&mut self) -> (&'static str, String) {
        let since = self
            .unreachable_since
            .map(|s| s.elapsed())
            .unwrap_or_default();
        self.restarted();
        (
            "unreachable",
            format!(
                "no session with the replica for {since:.1?} after it served (its processes gone; their node lost?)"
            ),
        )
    }

    /// A session is up: the replica served and is reachable.
    pub(super) fn reached(&mut self) {
        self.served = true;
        self.unreachable_since = None;
    }

    /// The processes started again (a restart, a new generation): they
    /// must serve before they can be lost.
    pub(super) fn restarted(&mut self) {
        self.served = false;
        self.unreachable_since = None;
    }
}

/// Why a controller event calls for restarting the replica, if it does:
/// the reason's metrics label (`silent`, `lockstep_lost`,
/// `history_mismatch`) and its text.
pub(super) fn restart_reason(event: &Event) -> Option<(&'static str, String)> {
    match event {
        Event::ProcessSilent {
            process,
            silent_for,
        } => Some((
            "silent",
            format!("process {process} has not answered for {silent_for:.1?} (stopped or hung)"),
        )),
        Event::ReplicaError { process, error } if error.kind == ErrorKind::LockstepLost => Some((
            "lockstep_lost",
            format!("process {process} lost lockstep: {}", error.message),
        )),
        Event::HistoryMismatch {
            distinct_digests,
            action: lockstep_policy::MismatchAction::RestartReplica,
        } => Some((
            "history_mismatch",
            format!(
                "the history check found {distinct_digests} different worker histories and the distribution policy asks for a restart"
            ),
        )),
        _ => None,
    }
}

/// Watches one controller's events: logs them, and restarts the replica
/// through the orchestrator when one calls for it, at most once per
/// `interval`.
pub(super) struct Watcher {
    pub(super) metrics: Arc<crate::metrics::Metrics>,
    pub(super) replica: String,
    pub(super) service: String,
    pub(super) controller: Controller,
    pub(super) restarter: Restarter,
    pub(super) interval: Duration,
    pub(super) ping_bound: Duration,
    pub(super) restarts: Arc<std::sync::atomic::AtomicBool>,
}

impl Watcher {
    pub(super) async fn run(
        self,
        mut events: broadcast::Receiver<Event>,
        services: broadcast::Receiver<lockstep_orchestrator::ServiceEvent>,
    ) {
        // `None` once the orchestrator's event channel closed.
        let mut services = Some(services);
        use tokio::sync::broadcast::error::RecvError;
        let mut last_restart: Option<Instant> = None;
        let mut reach = Reach::default();
        // A reason that came within the interval, to check at its end.
        let mut pending: Option<(&'static str, String)> = None;
        loop {
            let recheck_at = match (&pending, last_restart) {
                (Some(_), Some(t)) => Some(t + self.interval),
                _ => None,
            };
            let recheck = async {
                match recheck_at {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            let lost_at = reach.deadline(UNREACHABLE_AFTER);
            let lost = async {
                match lost_at {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            let reason = tokio::select! {
                e = async {
                    match services.as_mut() {
                        Some(s) => s.recv().await,
                        None => std::future::pending().await,
                    }
                } => {
                    match e {
                        Ok(e) if e.service == self.service => {
                            if matches!(e.kind, lockstep_orchestrator::ServiceEventKind::Started { .. }) {
                                reach.restarted();
                            }
                            self.on_service_event(e.kind)
                        }
                        Ok(_) => {}
                        Err(RecvError::Lagged(n)) => {
                            tracing::warn!(replica = %self.replica, "{n} service events were not seen");
                        }
                        // The orchestrator is gone; the controller events still matter.
                        Err(RecvError::Closed) => services = None,
                    }
                    continue;
                }
                e = events.recv() => match e {
                    Ok(e) => {
                        tracing::info!(replica = %self.replica, event = ?e, "controller event");
                        self.count(&e);
                        // Fenced out of the command log: a newer controller
                        // runs; this environment must halt (O3).
                        if let Event::LogFailed { message, fenced: true } = &e {
                            crate::halt_with(&self.restarter.halt, self.restarter.epoch, format!("replica {}: {message}", self.replica));
                            return;
                        }
                        if let Event::DataflowRefused { dataflow, message, .. } = &e {
                            self.forget(*dataflow, message);
                        }
                        reach.on_event(&e);
                        let Some(reason) = restart_reason(&e) else { continue };
                        if let Some(t) = last_restart.filter(|t| t.elapsed() < self.interval) {
                            tracing::warn!(
                                replica = %self.replica,
                                reason = %reason.1,
                                "the replica was restarted {:.1?} ago; checking it again in {:.1?}",
                                t.elapsed(),
                                self.interval.saturating_sub(t.elapsed()),
                            );
                            pending.get_or_insert(reason);
                            continue;
                        }
                        reason
                    }
                    Err(RecvError::Lagged(n)) => {
                        tracing::warn!(replica = %self.replica, "{n} controller events were not seen");
                        continue;
                    }
                    Err(RecvError::Closed) => return,
                },
                () = lost => {
                    if let Ok(Ok(())) = tokio::time::timeout(self.ping_bound, self.controller.ping()).await {
                        // A session is up again (its event on the way).
                        reach.reached();
                        continue;
                    }
                    let reason = reach.lost();
                    if last_restart.is_some_and(|t| t.elapsed() < self.interval) {
                        pending.get_or_insert(reason);
                        continue;
                    }
                    reason
                }
                () = recheck => {
                    let (label, reason) = pending.take().expect("a recheck only with a pending reason");
                    match tokio::time::timeout(self.ping_bound, self.controller.ping()).await {
                        Ok(Ok(())) => {
                            tracing::info!(replica = %self.replica, earlier = %reason, "the replica answers again; not restarting it");
                            continue;
                        }
                        Ok(Err(e)) => (label, format!("{reason}; it still does not answer: {e}")),
                        Err(_) => (label, format!("{reason}; it still does not answer a ping within {:?}", self.ping_bound)),
                    }
                }
            };
            pending = None;
            reach.restarted();
            last_restart = Some(Instant::now());
            self.metrics
                .restarts
                .get_or_create(&crate::metrics::RestartLabels {
                    replica: self.replica.clone(),
                    reason: reason.0.to_string(),
                })
                .inc();
            if !self.restart(&reason.1).await {
                return;
            }
        }
    }

    /// A replica process refused dataflow `id` as malformed (the controller
    /// forgot it already): the catalog forgets it too, so that no restart
    /// replays it.
    pub(super) fn forget(&self, id: u64, message: &str) {
        let Some((catalog, view)) = &self.restarter.catalog else {
            return;
        };
        match forget_refused(
            catalog,
            view,
            &self.restarter.halt,
            self.restarter.epoch,
            id,
        ) {
            Ok(true) => {
                tracing::error!(replica = %self.replica, dataflow = id, %message, "a replica refused the dataflow as malformed: removed from the catalog")
            }
            Ok(false) => {}
            Err(e) => {
                tracing::error!(replica = %self.replica, dataflow = id, "could not remove a refused dataflow from the catalog: {e}")
            }
        }
    }

    /// Acts on an event of the replica's service: new addresses (the
    /// process backend re-chose ports after one was taken; a new
    /// generation of pods got new IPs) go to the controller, which
    /// reconnects there.
    pub(super) fn on_service_event(&self, kind: lockstep_orchestrator::ServiceEventKind) {
        let lockstep_orchestrator::ServiceEventKind::AddressesChanged { addresses } = kind else {
            return;
        };
        let controller: Option<Vec<std::net::SocketAddr>> = addresses
            .iter()
            .map(|a| a.get("controller").copied())
            .collect();
        match controller {
            Some(addrs) => {
                tracing::warn!(replica = %self.replica, ?addrs, "the replica's processes got new addresses; reconnecting there");
                let addrs = addrs
                    .into_iter()
                    .map(lockstep_protocol::Endpoint::from)
                    .collect();
                if let Err(e) = self.controller.set_addresses(addrs) {
                    tracing::error!(replica = %self.replica, "could not give the controller the new addresses: {e}");
                }
            }
            None => tracing::error!(
                replica = %self.replica,
                "the replica's new ports name no controller port"
            ),
        }
    }

    /// Counts what the metrics count of a controller event.
    pub(super) fn count(&self, e: &Event) {
        let label = crate::metrics::ReplicaLabel {
            replica: self.replica.clone(),
        };
        match e {
            Event::Connected { .. } => self.metrics.sessions.get_or_create(&label).inc(),
            Event::Disconnected { .. } => self.metrics.disconnects.get_or_create(&label).inc(),
            Event::HistoryMismatch { .. } => {
                self.metrics.history_mismatches.get_or_create(&label).inc()
            }
            _ => 0,
        };
    }

    /// Restarts the replica's service; returns false if this watcher must
    /// stop (we halted).
    pub(super) async fn restart(&self, reason: &str) -> bool {
        if self.restarter.halt.borrow().is_some() {
            return false;
        }
        if !self.restarts.load(std::sync::atomic::Ordering::Relaxed) {
            tracing::warn!(replica = %self.replica, %reason, "not restarting the replica: restarts are turned off (experiment)");
            return true;
        }
        tracing::warn!(
            replica = %self.replica,
            service = %self.service,
            %reason,
            "restarting the replica through the orchestrator"
        );
        match self
            .restarter
            .orchestrator
            .restart_service(&self.service)
            .await
        {
            Ok(status) => {
                let pids: Vec<Option<u32>> = status.processes.iter().map(|p| p.pid).collect();
                tracing::warn!(
                    replica = %self.replica,
                    ?pids,
                    "replica restarted; its controller reconnects"
                );
                true
            }
            Err(e @ RestartError::StaleEpoch { .. }) => {
                crate::halt_with(&self.restarter.halt, self.restarter.epoch, e.to_string());
                false
            }
            Err(e) => {
                tracing::error!(replica = %self.replica, %reason, "could not restart the replica: {e}");
                true
            }
        }
    }
}
