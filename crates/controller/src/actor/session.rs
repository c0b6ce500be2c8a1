//! The session: connecting to every process, Hello and the replay of the
//! compacted history, the history check, InitializationComplete, and
//! disconnecting.
//!
//! Where a session is, and what happens next, is decided by the sans-IO
//! machine [`lockstep_reconcile::ControllerSession`] (its phases are drawn in
//! its docs; the model checker drives the same type). This module is its
//! shell: it connects, sends Hello and the history, asks the distribution
//! policy about a history mismatch, and feeds the machine what happened and
//! the time.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use lockstep_policy::{MismatchAction, MismatchInfo};
use lockstep_protocol::{Command, CommandKind, Status};
use lockstep_reconcile::{HistoryStep, MismatchResolution, Phase};
use tokio::time::Instant;

use super::log::LogBatch;
use super::{Actor, Event};
use crate::connection;

impl Actor {
    /// The session's phase.
    pub(crate) fn phase(&self) -> Phase {
        self.session.phase()
    }

    /// The machine's clock: milliseconds since the controller started.
    pub(crate) fn now_ms(&self) -> u64 {
        u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Starts connecting to every process under a new generation.
    pub(super) fn start_connecting(&mut self) {
        let backoff = Duration::from_millis(self.session.connect());
        self.connect_after(backoff);
    }

    /// Connects to every process, after `backoff`, under a new generation.
    fn connect_after(&mut self, backoff: Duration) {
        self.generation += 1;
        let generation = self.generation;
        self.current_generation.store(generation, Ordering::SeqCst);
        let current = Arc::clone(&self.current_generation);
        let addrs = self.replica.processes.clone();
        let key = self.replica.session_key.clone();
        let (one_way, replica_id) = (self.replica.one_way_proof, self.replica.replica_id);
        let bound = self.timeouts.connect;
        let tx = self.connected_tx.clone();
        // Keeps trying until every process is connected, or a newer attempt
        // (or shutdown) supersedes this one; each failed round is reported.
        // After sessions that ended quickly, it first waits (backoff): a
        // replica that drops every session must not be reconnected to in a
        // tight loop.
        tokio::spawn(tracing::Instrument::in_current_span(async move {
            tokio::time::sleep(backoff).await;
            'attempt: loop {
                let deadline = Instant::now() + bound;
                let mut socks = Vec::new();
                for (i, a) in addrs.iter().enumerate() {
                    let connected = connection::connect_session(
                        a,
                        deadline,
                        key.as_ref(),
                        one_way,
                        replica_id,
                        i as u32,
                    );
                    match connected.await {
                        Ok(s) => socks.push(s),
                        Err(e) => {
                            if current.load(Ordering::SeqCst) != generation
                                || tx.send((generation, Err(e))).is_err()
                            {
                                return;
                            }
                            tokio::time::sleep(Duration::from_millis(200)).await;
                            continue 'attempt;
                        }
                    }
                }
                let _ = tx.send((generation, Ok(socks)));
                return;
            }
        }));
    }

    pub(super) fn on_connected(
        &mut self,
        generation: u64,
        result: Result<Vec<connection::Connected>, String>,
    ) {
        if generation != self.generation {
            return;
        }
        let socks = match result {
            Ok(s) => s,
            Err(reason) => {
                tracing::warn!(%reason, "connecting to every replica process failed; still trying");
                self.emit(Event::ConnectFailed { reason });
                return;
            }
        };
        // The Hello's strategy is chosen while still connecting, so the
        // policy sees whether the previous session was cut off reconciling.
        let first = CommandKind::Hello(self.replica.hello(0, self.epoch, self.session.nonce() + 1));
        let strategy = self.session_strategy(&first);
        // The nonce increases per connection attempt within our epoch:
        // replicas order sessions by (epoch, nonce), and a barrier round of
        // an older session is abandoned once a worker joined a newer one.
        let Some(nonce) = self.session.connected(socks.len()) else {
            return;
        };
        self.seqno = 0;
        self.sent_creates.clear();
        self.log_status_requests.clear();
        self.conns = socks
            .into_iter()
            .enumerate()
            .map(|(i, s)| {
                Some(connection::spawn(
                    s,
                    i,
                    generation,
                    self.replica.max_frame_len,
                    self.to_self.clone(),
                ))
            })
            .collect();
        let now = Instant::now();
        self.last_heard = vec![now; self.conns.len()];
        self.silent_reported = vec![false; self.conns.len()];
        self.frontiers.clear();
        self.unknown_frontiers = 0;
        self.statuses.clear();
        self.versions = vec![None; self.conns.len()];
        self.full_statuses.clear();
        for p in self.peeks.values_mut() {
            p.results.clear();
            p.parts.clear();
            p.parts_bytes = 0;
        }
        for sub in self.subs.values_mut() {
            sub.restart();
        }
        // Hello to every process, then the compacted history, then
        // InitializationComplete: the replica reconciles to this target.
        // The machine decides how the session starts: a log session appends
        // its start in one batch; any other session of a replica with a
        // command log appends its marker first (its workers cut a log
        // session that this one ends at the same entry: they hold this
        // session's commands until they read the marker).
        let start = self.session.start_delivery(strategy);
        self.log_batch = start.batch.then(LogBatch::default);
        if start.marker {
            let marker = Command {
                seqno: 0,
                strategy,
                kind: CommandKind::Hello(self.replica.hello(0, self.epoch, nonce)),
            };
            match self.append_marker(marker) {
                Some(offset) => self.log_marker = Some(offset),
                // Stopped, or reconnecting.
                None => return,
            }
        }
        for i in 0..self.conns.len() {
            let hello = Command {
                seqno: 0,
                strategy,
                kind: CommandKind::Hello(self.replica.hello(i, self.epoch, nonce)),
            };
            match &mut self.log_batch {
                Some(batch) => batch.hellos.push(hello),
                None => self.write(i, hello),
            }
        }
        self.history.reduce();
        let commands: Vec<CommandKind> = self
            .history
            .commands()
            .iter()
            .filter(|c| !matches!(c, CommandKind::InitializationComplete))
            .cloned()
            .collect();
        let replayed = commands.len();
        for c in commands {
            self.broadcast(c);
        }
        self.flush_log_batch();
        // A failed log append stopped the controller or started another
        // connection attempt.
        if self.phase() != Phase::Rehydrating {
            return;
        }
        tracing::debug!(
            nonce,
            replayed,
            "Hello and target sent; waiting for every worker's history before InitializationComplete"
        );
        let now = self.now_ms();
        self.session.rehydrated(now);
    }

    /// The history check: once every worker answered
    /// this session's Hello with its full status, compare what they report
    /// (their creation logs and installed dataflows); if they differ, the
    /// distribution policy decides: reconcile collectively (a naive session's
    /// InitializationComplete is then sent with `barrier`, which makes the
    /// replica reconcile collectively), or restart the replica (reported as
    /// [`Event::HistoryMismatch`]; the environment restarts it). Then
    /// InitializationComplete ends the reconciliation. Without every answer
    /// within the request bound, it goes ahead unchecked, and says so.
    pub(super) fn check_histories(&mut self) {
        let now = self.now_ms();
        let bound = u64::try_from(self.timeouts.request.as_millis()).unwrap_or(u64::MAX);
        let step = match self.session.check_histories(now, bound) {
            HistoryStep::AskPolicy { distinct } => {
                self.truncate_log();
                let resolution = self.ask_mismatch_policy(distinct);
                self.session.mismatch_resolved(resolution, now)
            }
            step => step,
        };
        match step {
            HistoryStep::Wait | HistoryStep::AskPolicy { .. } => {}
            HistoryStep::RestartReplica => {
                // Not in lockstep: serve nothing until the replica was
                // restarted (the connections drop, and the next session
                // checks again). Asked again after every request bound.
                tracing::error!(
                    "the replica must be restarted; initialization stays incomplete until it is"
                );
            }
            HistoryStep::Complete {
                collective,
                checked,
            } => {
                if checked {
                    self.truncate_log();
                } else {
                    tracing::warn!(
                        answered = self.session_reports().len(),
                        total = self.replica.total_workers(),
                        "not every worker answered Hello in time; completing initialization without the history check"
                    );
                }
                self.complete_initialization(collective);
            }
        }
    }

    /// The full statuses workers reported on this session's Hello.
    fn session_reports(&self) -> Vec<&Status> {
        let nonce = self.session.nonce();
        self.full_statuses
            .values()
            .filter(|s| s.epoch == self.epoch && s.nonce == nonce)
            .collect()
    }

    /// Asks the distribution policy what to do about workers that reported
    /// `distinct` different histories, and says what it chose.
    fn ask_mismatch_policy(&mut self, distinct: u32) -> MismatchResolution {
        let own = self.history.digest();
        let info = MismatchInfo {
            process_count: self.replica.processes.len() as u32,
            distinct_digests: distinct,
            matching_controller: self
                .session_reports()
                .iter()
                .filter(|s| s.history_hash == Some(own))
                .count() as u32,
        };
        let action = match self.policy.on_mismatch(&info) {
            Ok(a) => a,
            Err(e) => {
                // The machine's fallback: a naive session restarts the
                // replica, any other reconciles collectively.
                let action = match self.session.mismatch_fallback() {
                    MismatchResolution::RestartReplica => MismatchAction::RestartReplica,
                    MismatchResolution::ReconcileCollectively => {
                        MismatchAction::ReconcileCollectively
                    }
                };
                tracing::warn!(error = %e, ?action, "distribution policy failed on a history mismatch; taking the fallback");
                action
            }
        };
        // I1 is about creation logs: say whether they differ, or only the
        // installed sets do (a drop that reached some processes: repaired
        // by reconciling collectively).
        let logs = lockstep_reconcile::creation_logs(self.session_reports());
        let creation_logs = match lockstep_reconcile::lockstep_check(&logs) {
            Ok(()) => "same",
            Err(_) => "differ",
        };
        tracing::warn!(
            distinct,
            creation_logs,
            ?action,
            "workers disagree about what they applied"
        );
        self.emit(Event::HistoryMismatch {
            distinct_digests: distinct,
            action,
        });
        match action {
            MismatchAction::RestartReplica => MismatchResolution::RestartReplica,
            MismatchAction::ReconcileCollectively => MismatchResolution::ReconcileCollectively,
        }
    }

    /// A worker's full status: its report for the history check.
    pub(super) fn on_full_status(&mut self, s: &Status) {
        if s.epoch != self.epoch {
            return;
        }
        self.session
            .reported(s.worker_index, s.nonce, state_digest(s));
        self.check_histories();
    }

    /// Sends InitializationComplete (with `barrier` instead of `naive` if
    /// the replica must reconcile collectively); the session then serves,
    /// and status requests from before it are asked again.
    fn complete_initialization(&mut self, collective: bool) {
        let chosen = self.strategy_for(&CommandKind::InitializationComplete);
        let strategy = self.session.completion_strategy(chosen, collective);
        self.broadcast_with(CommandKind::InitializationComplete, strategy);
        let now = self.now_ms();
        if !self.session.serving(now) {
            return;
        }
        let nonce = self.session.nonce();
        tracing::info!(nonce, "connected to every process and rehydrated");
        // Status requests made before this session are asked again.
        if self
            .status_waiters
            .iter()
            .any(|(at, _, _)| at.is_none_or(|(n, _)| n != nonce))
        {
            let at = self.request_status(true);
            for (w, _, _) in self.status_waiters.iter_mut() {
                if w.is_none_or(|(n, _)| n != nonce) {
                    *w = at;
                }
            }
        }
        self.emit(Event::Connected { nonce });
    }

    /// Drops every connection and connects to every process again, under a
    /// new generation (and, once connected, a new nonce).
    pub(crate) fn disconnect(&mut self, reason: String) {
        self.conns.iter_mut().for_each(|c| *c = None);
        // No session: no version agreed (the next session's processes may
        // be other builds).
        self.versions.iter_mut().for_each(|v| *v = None);
        let now = self.now_ms();
        let backoff = Duration::from_millis(self.session.disconnected(now));
        tracing::info!(%reason, ?backoff, "reconnecting to every process");
        self.connect_after(backoff);
    }

    /// Stops the controller for good: drops every connection and
    /// supersedes any connect attempt; the event loop then ends.
    pub(crate) fn stop(&mut self) {
        self.session.crash();
        self.conns.iter_mut().for_each(|c| *c = None);
        self.current_generation.store(u64::MAX, Ordering::SeqCst);
    }
}

/// What a worker reported about its state on Hello, as one digest: its
/// dataflow-creation log and its installed dataflows. Two workers in
/// lockstep report the same. (The compacted history digest alone misses a
/// dataflow built and dropped on one worker only; the creation log does not.)
fn state_digest(s: &Status) -> lockstep_protocol::Digest {
    let mut h = blake3::Hasher::new();
    h.update(&(s.creation_log.len() as u64).to_le_bytes());
    for e in &s.creation_log {
        h.update(&e.timely_index.to_le_bytes());
        h.update(&e.dataflow_id.to_le_bytes());
        h.update(&e.description_hash.0);
    }
    h.update(&(s.installed.len() as u64).to_le_bytes());
    for id in &s.installed {
        h.update(&id.to_le_bytes());
    }
    lockstep_protocol::Digest(*h.finalize().as_bytes())
}
