//! The session: connecting to every process, Hello and the replay of the
//! compacted history, the history check, InitializationComplete, and
//! disconnecting.
//!
//! Where a session is, is one [`Phase`], and only [`Actor::enter`] changes
//! it:
//!
//! ```text
//! Disconnected ─▶ Connecting ─▶ Rehydrating ─▶ AwaitingHistories ─▶ Serving
//!                   ▲    │ no process           (history check;
//!                   │    ▼                       RestartReplica: again)
//!                   │  Disconnected
//!                   └── disconnect(): a connection closed, or reconnect()
//! any phase ─▶ Crashed (a failed log append, the partial-broadcast failpoint)
//! ```

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use lockstep_policy::{MismatchAction, MismatchInfo};
use lockstep_protocol::{Command, CommandKind, Status, Strategy};
use lockstep_reconcile::{InitializationDecision, InitializationGate};
use tokio::time::Instant;

use super::{Actor, Event};
use crate::connection;
use crate::deliver::LogBatch;

/// A session that served this long ends a run of failed sessions.
const STABLE_SESSION: Duration = Duration::from_secs(10);
/// The wait before reconnecting after the first quickly failed session;
/// doubled per further one, up to [`MAX_RECONNECT_BACKOFF`].
const RECONNECT_BACKOFF: Duration = Duration::from_millis(50);
/// The longest wait before reconnecting.
pub(crate) const MAX_RECONNECT_BACKOFF: Duration = Duration::from_secs(5);

/// The wait before reconnecting after `failed` sessions in a row that ended
/// before serving for [`STABLE_SESSION`]: none after the first, then 50 ms
/// doubling up to 5 s.
pub(crate) fn reconnect_backoff(failed: u32) -> Duration {
    match failed {
        0 | 1 => Duration::ZERO,
        n => RECONNECT_BACKOFF
            .saturating_mul(1u32 << (n - 2).min(16))
            .min(MAX_RECONNECT_BACKOFF),
    }
}

/// Where the controller's session is. Changed only by [`Actor::enter`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Phase {
    /// Not connected and not connecting: before the first attempt, and
    /// after an attempt that found no process to connect to.
    Disconnected,
    /// Connecting to every process, under a new connection generation;
    /// each failed round is reported and retried.
    Connecting {
        /// Whether the session before was cut off before it sent
        /// InitializationComplete. The policy is told so
        /// (`CommandInfo::reconciling`) when it chooses the next Hello's
        /// strategy.
        reconciling: bool,
    },
    /// Connected under a new nonce: Hello and the reduced history are being
    /// sent.
    Rehydrating,
    /// Hello and the history were sent; waiting for every worker's full
    /// status (the history check), or, after the policy answered
    /// `RestartReplica`, for the replica to be restarted. `since` is when
    /// the wait (re)started; it is checked again after each request bound.
    AwaitingHistories {
        /// When the wait started.
        since: Instant,
    },
    /// InitializationComplete was sent: the replica serves.
    Serving,
    /// Stopped for good (a failed log append, the partial-broadcast
    /// failpoint): the connections are dropped and the task ends.
    Crashed,
}

impl Phase {
    /// Whether every process is connected (commands are sent).
    pub(crate) fn is_connected(self) -> bool {
        matches!(
            self,
            Phase::Rehydrating | Phase::AwaitingHistories { .. } | Phase::Serving
        )
    }

    /// Whether a command chosen now is sent during reconciliation, between
    /// Hello and InitializationComplete (`CommandInfo::reconciling`). While
    /// connecting: whether the previous session was cut off while
    /// reconciling, which is what the next Hello is chosen with.
    pub(crate) fn reconciling(self) -> bool {
        match self {
            Phase::Connecting { reconciling } => reconciling,
            Phase::Rehydrating | Phase::AwaitingHistories { .. } => true,
            Phase::Disconnected | Phase::Serving | Phase::Crashed => false,
        }
    }

    /// The transitions drawn in the module docs.
    fn may_become(self, next: Phase) -> bool {
        match (self, next) {
            (Phase::Crashed, _) => false,
            (_, Phase::Crashed | Phase::Connecting { .. }) => true,
            (Phase::Connecting { .. }, Phase::Disconnected | Phase::Rehydrating) => true,
            (Phase::Rehydrating, Phase::AwaitingHistories { .. }) => true,
            (Phase::AwaitingHistories { .. }, Phase::AwaitingHistories { .. } | Phase::Serving) => {
                true
            }
            _ => false,
        }
    }
}

impl Actor {
    /// The session's phase.
    pub(crate) fn phase(&self) -> Phase {
        self.phase
    }

    /// The one place the phase changes. `Crashed` is final.
    fn enter(&mut self, next: Phase) {
        debug_assert!(
            self.phase.may_become(next),
            "session phase {:?} cannot become {next:?}",
            self.phase
        );
        if self.phase != Phase::Crashed {
            self.phase = next;
        }
    }

    /// Starts connecting to every process under a new generation.
    pub(super) fn start_connecting(&mut self) {
        self.enter(Phase::Connecting {
            reconciling: self.phase.reconciling(),
        });
        self.generation += 1;
        let generation = self.generation;
        self.current_generation.store(generation, Ordering::SeqCst);
        let current = Arc::clone(&self.current_generation);
        let addrs = self.replica.processes.clone();
        let bound = self.timeouts.connect;
        let tx = self.connected_tx.clone();
        let backoff = reconnect_backoff(self.failed_sessions);
        // Keeps trying until every process is connected, or a newer attempt
        // (or shutdown) supersedes this one; each failed round is reported.
        // After sessions that ended quickly, it first waits (backoff): a
        // replica that drops every session must not be reconnected to in a
        // tight loop.
        tokio::spawn(async move {
            tokio::time::sleep(backoff).await;
            'attempt: loop {
                let deadline = Instant::now() + bound;
                let mut socks = Vec::new();
                for a in &addrs {
                    match connection::connect(*a, deadline).await {
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
        });
    }

    pub(super) fn on_connected(
        &mut self,
        generation: u64,
        result: Result<Vec<tokio::net::TcpStream>, String>,
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
        if socks.is_empty() {
            self.enter(Phase::Disconnected);
            return;
        }
        // Increasing per connection attempt within our epoch: replicas order
        // sessions by (epoch, nonce), and a barrier round of an older
        // session is abandoned once a worker joined a newer one.
        self.nonce += 1;
        self.seqno = 0;
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
        self.statuses.clear();
        self.full_statuses.clear();
        for p in self.peeks.values_mut() {
            p.results.clear();
            p.parts.clear();
        }
        for sub in self.subs.values_mut() {
            sub.merge.restart();
        }
        // Hello to every process, then the compacted history, then
        // InitializationComplete: the replica reconciles to this target.
        // The Hello's strategy is chosen while still `Connecting`, so the
        // policy sees whether the previous session was cut off reconciling.
        let first = CommandKind::Hello(self.replica.hello(0, self.epoch, self.nonce));
        self.session_strategy = self.choose(&first);
        self.enter(Phase::Rehydrating);
        if matches!(self.session_strategy, Strategy::Log) {
            self.log_batch = Some(LogBatch::default());
        }
        for i in 0..self.conns.len() {
            let hello = Command {
                seqno: 0,
                strategy: self.session_strategy,
                kind: CommandKind::Hello(self.replica.hello(i, self.epoch, self.nonce)),
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
        if self.phase != Phase::Rehydrating {
            return;
        }
        tracing::debug!(
            nonce = self.nonce,
            replayed,
            "Hello and target sent; waiting for every worker's history before InitializationComplete"
        );
        self.enter(Phase::AwaitingHistories {
            since: Instant::now(),
        });
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
    pub(super) fn check_histories(&mut self, timed_out: bool) {
        let Phase::AwaitingHistories { since } = self.phase else {
            return;
        };
        let nonce = self.nonce;
        let reported: Vec<Status> = self
            .full_statuses
            .values()
            .filter(|s| s.epoch == self.epoch && s.nonce == nonce)
            .cloned()
            .collect();
        let digests: Vec<lockstep_protocol::Digest> = reported.iter().map(state_digest).collect();
        let gate = InitializationGate::new(self.replica.total_workers());
        let mut collective = false;
        match gate.decide(&digests, timed_out) {
            InitializationDecision::Wait => return,
            InitializationDecision::Unchecked { answered } => {
                tracing::warn!(
                    answered,
                    total = self.replica.total_workers(),
                    waited = ?since.elapsed(),
                    "not every worker answered Hello in time; completing initialization without the history check"
                );
            }
            InitializationDecision::Complete => self.truncate_log(),
            InitializationDecision::Mismatch { distinct } => {
                self.truncate_log();
                let own = self.history.digest();
                let info = MismatchInfo {
                    process_count: self.replica.processes.len() as u32,
                    distinct_digests: distinct,
                    matching_controller: reported
                        .iter()
                        .filter(|s| s.history_hash == Some(own))
                        .count() as u32,
                };
                let action = match self.policy.on_mismatch(&info) {
                    Ok(a) => a,
                    Err(e) => {
                        tracing::warn!(error = %e, "distribution policy failed on a history mismatch; reconciling collectively");
                        MismatchAction::ReconcileCollectively
                    }
                };
                tracing::warn!(
                    distinct,
                    ?action,
                    "workers disagree about what they applied"
                );
                collective = action == MismatchAction::ReconcileCollectively;
                self.emit(Event::HistoryMismatch {
                    distinct_digests: distinct,
                    action,
                });
                if action == MismatchAction::RestartReplica {
                    // Not in lockstep: serve nothing until the replica was
                    // restarted (the connections drop, and the next session
                    // checks again). Asked again after every request bound.
                    tracing::error!(
                        "the replica must be restarted; initialization stays incomplete until it is"
                    );
                    self.enter(Phase::AwaitingHistories {
                        since: Instant::now(),
                    });
                    return;
                }
            }
        }
        self.complete_initialization(collective);
    }

    /// Sends InitializationComplete (with `barrier` instead of `naive` if
    /// the replica must reconcile collectively); the session then serves,
    /// and status requests from before it are asked again.
    fn complete_initialization(&mut self, collective: bool) {
        let strategy = self.strategy_for(&CommandKind::InitializationComplete);
        let strategy = if collective && strategy == Strategy::Naive {
            Strategy::Barrier
        } else {
            strategy
        };
        self.broadcast_with(CommandKind::InitializationComplete, strategy);
        if !self.phase.is_connected() {
            return;
        }
        self.enter(Phase::Serving);
        tracing::info!(
            nonce = self.nonce,
            "connected to every process and rehydrated"
        );
        // Status requests made before this session are asked again.
        let nonce = self.nonce;
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
        self.served_at = Some(Instant::now());
        self.emit(Event::Connected { nonce: self.nonce });
    }

    /// Drops every connection and connects to every process again, under a
    /// new generation (and, once connected, a new nonce).
    pub(crate) fn disconnect(&mut self, reason: String) {
        self.conns.iter_mut().for_each(|c| *c = None);
        // A session that served for a while ends the run of failures.
        if self
            .served_at
            .take()
            .is_some_and(|t| t.elapsed() >= STABLE_SESSION)
        {
            self.failed_sessions = 0;
        }
        self.failed_sessions = self.failed_sessions.saturating_add(1);
        tracing::info!(%reason, backoff = ?reconnect_backoff(self.failed_sessions), "reconnecting to every process");
        self.start_connecting();
    }

    /// Stops the controller for good: drops every connection and
    /// supersedes any connect attempt; the event loop then ends.
    pub(crate) fn stop(&mut self) {
        self.enter(Phase::Crashed);
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
