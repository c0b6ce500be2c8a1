//! The controller's session as a sans-IO state machine.
//!
//! [`ControllerSession`] holds where a controller's session with one replica
//! is ([`Phase`]), its connection nonce, the run of failed sessions that sets
//! the reconnect backoff, and the history check on connect
//! ([`InitializationGate`]). It changes only through its event methods,
//! each of which returns what the caller must do next:
//!
//! ```text
//! Disconnected ─▶ Connecting ─▶ Rehydrating ─▶ AwaitingHistories ─▶ Serving
//!                   ▲    │ no process           (history check;
//!                   │    ▼                       RestartReplica: again)
//!                   │  Disconnected
//!                   └── disconnected(): a connection closed, or a reconnect
//! any phase ─▶ Crashed (a failed log append, the partial-broadcast failpoint)
//! ```
//!
//! It also decides how each command is delivered (the session's strategy,
//! the fallback, the log appends, the per-process split, the naive→barrier
//! upgrade: [`crate::delivery`]).
//!
//! No sockets, clocks, stores or policies inside: the controller's actor
//! (`crates/controller/src/actor`) connects, sends, asks the distribution
//! policy and passes the time in; the model checker (`crates/model`) drives
//! the same type as its controller.

use std::collections::BTreeMap;

use crate::delivery::{DeliveryMutant, ReplicaDelivery, SessionStart};
use crate::{Digest, InitializationDecision, InitializationGate};

/// A session that served this long ends a run of failed sessions (ms).
pub const STABLE_SESSION_MS: u64 = 10_000;
/// The wait before reconnecting after the first quickly failed session (ms);
/// doubled per further one, up to [`MAX_RECONNECT_BACKOFF_MS`].
pub const RECONNECT_BACKOFF_MS: u64 = 50;
/// The longest wait before reconnecting (ms).
pub const MAX_RECONNECT_BACKOFF_MS: u64 = 5_000;

/// The wait before reconnecting after `failed` sessions in a row that ended
/// before serving for [`STABLE_SESSION_MS`]: none after the first, then 50 ms
/// doubling up to 5 s.
pub fn reconnect_backoff_ms(failed: u32) -> u64 {
    match failed {
        0 | 1 => 0,
        n => RECONNECT_BACKOFF_MS
            .saturating_mul(1u64 << (n - 2).min(16))
            .min(MAX_RECONNECT_BACKOFF_MS),
    }
}

/// Where the controller's session is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Phase {
    /// Not connected and not connecting: before the first attempt, and
    /// after an attempt that found no process to connect to.
    Disconnected,
    /// Connecting to every process; each failed round is reported and
    /// retried.
    Connecting {
        /// Whether the session before was cut off before it sent
        /// InitializationComplete (the distribution policy is told so when
        /// it chooses the next Hello's strategy).
        reconciling: bool,
    },
    /// Connected under a new nonce: Hello and the reduced history are being
    /// sent.
    Rehydrating,
    /// Hello and the history were sent; waiting for every worker's full
    /// status (the history check), or, after the policy answered
    /// `RestartReplica`, for the replica to be restarted.
    AwaitingHistories {
        /// When the wait (re)started (the caller's clock, ms).
        since_ms: u64,
    },
    /// InitializationComplete was sent: the replica serves.
    Serving,
    /// Stopped for good: the connections are dropped and the task ends.
    Crashed,
}

impl Phase {
    /// Whether every process is connected (commands are sent).
    pub fn is_connected(self) -> bool {
        matches!(
            self,
            Phase::Rehydrating | Phase::AwaitingHistories { .. } | Phase::Serving
        )
    }

    /// Whether a command chosen now is sent during reconciliation, between
    /// Hello and InitializationComplete. While connecting: whether the
    /// previous session was cut off while reconciling.
    pub fn reconciling(self) -> bool {
        match self {
            Phase::Connecting { reconciling } => reconciling,
            Phase::Rehydrating | Phase::AwaitingHistories { .. } => true,
            Phase::Disconnected | Phase::Serving | Phase::Crashed => false,
        }
    }

    /// The transitions drawn in the module docs.
    pub fn may_become(self, next: Phase) -> bool {
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

/// What the caller does after the history check decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HistoryStep {
    /// Not every worker reported: wait for more reports or the bound.
    Wait,
    /// Send InitializationComplete (with `barrier` instead of `naive` when
    /// `collective`), then call [`ControllerSession::serving`]. `checked`
    /// is false when the bound passed before every worker reported.
    Complete {
        /// Whether the replica must reconcile collectively.
        collective: bool,
        /// Whether every worker's report was compared.
        checked: bool,
    },
    /// The workers reported different histories: ask the distribution
    /// policy, then call [`ControllerSession::mismatch_resolved`].
    AskPolicy {
        /// How many different histories were reported.
        distinct: u32,
    },
    /// Serve nothing until the replica was restarted (the owner restarts
    /// it; the next session checks again).
    RestartReplica,
}

/// What the distribution policy answered about a history mismatch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MismatchResolution {
    /// Every worker reconciles together.
    ReconcileCollectively,
    /// The replica is restarted.
    RestartReplica,
}

/// One controller's session with one replica (see the module docs).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ControllerSession {
    phase: Phase,
    nonce: u64,
    gate: InitializationGate,
    /// Sessions in a row that ended before serving for a while.
    failed_sessions: u32,
    /// When the current session started serving (ms).
    served_at_ms: Option<u64>,
    /// The workers' reports on this session's Hello, by worker.
    reports: BTreeMap<u32, Digest>,
    /// What delivery decisions depend on ([`crate::delivery`]).
    pub(crate) replica: ReplicaDelivery,
    /// How the current session started delivering, once it did.
    pub(crate) start: Option<SessionStart>,
    /// A flaw planted in the delivery decisions (model checking only).
    pub(crate) delivery_mutant: DeliveryMutant,
}

impl ControllerSession {
    /// The session of a replica of `workers` workers delivered to as
    /// `replica` says, not connected yet.
    pub fn new(workers: usize, replica: ReplicaDelivery) -> Self {
        ControllerSession {
            phase: Phase::Disconnected,
            nonce: 0,
            gate: InitializationGate::new(workers),
            failed_sessions: 0,
            served_at_ms: None,
            reports: BTreeMap::new(),
            replica,
            start: None,
            delivery_mutant: DeliveryMutant::None,
        }
    }

    /// The same session with a flaw planted in its history check (model
    /// checking only).
    #[cfg(feature = "mutants")]
    pub fn with_gate_mutant(mut self, mutant: crate::GateMutant) -> Self {
        self.gate = self.gate.with_mutant(mutant);
        self
    }

    /// The same session with a flaw planted in its delivery decisions
    /// (model checking only).
    #[cfg(feature = "mutants")]
    pub fn with_delivery_mutant(mut self, mutant: DeliveryMutant) -> Self {
        self.delivery_mutant = mutant;
        self
    }

    /// Where the session is.
    pub fn phase(&self) -> Phase {
        self.phase
    }

    /// The nonce of the current (or last) connection; it increases per
    /// connection so that replicas order sessions by (epoch, nonce).
    pub fn nonce(&self) -> u64 {
        self.nonce
    }

    /// The one place the phase changes. `Crashed` is final.
    fn enter(&mut self, next: Phase) {
        if self.phase == Phase::Crashed {
            return;
        }
        debug_assert!(
            self.phase.may_become(next),
            "session phase {:?} cannot become {next:?}",
            self.phase
        );
        self.phase = next;
    }

    /// Starts connecting to every process. Returns how long to wait first
    /// (ms): a replica that drops every session must not be reconnected to
    /// in a tight loop.
    pub fn connect(&mut self) -> u64 {
        self.enter(Phase::Connecting {
            reconciling: self.phase.reconciling(),
        });
        reconnect_backoff_ms(self.failed_sessions)
    }

    /// Connections to `processes` processes are open. Returns the new
    /// session's nonce, under which the caller sends Hello and the reduced
    /// history, then calls [`ControllerSession::rehydrated`]; `None` (no
    /// process) leaves the session disconnected.
    pub fn connected(&mut self, processes: usize) -> Option<u64> {
        if !matches!(self.phase, Phase::Connecting { .. }) {
            return None;
        }
        if processes == 0 {
            self.enter(Phase::Disconnected);
            return None;
        }
        self.nonce += 1;
        self.reports.clear();
        self.start = None;
        self.enter(Phase::Rehydrating);
        Some(self.nonce)
    }

    /// Hello and the history were sent at `now_ms`: wait for the workers'
    /// reports.
    pub fn rehydrated(&mut self, now_ms: u64) {
        if self.phase == Phase::Rehydrating {
            self.enter(Phase::AwaitingHistories { since_ms: now_ms });
        }
    }

    /// Worker `worker` answered Hello of session `nonce` with `digest` (its
    /// creation log and installed dataflows); answers of other sessions are
    /// ignored.
    pub fn reported(&mut self, worker: u32, nonce: u64, digest: Digest) {
        if nonce == self.nonce && self.phase.is_connected() {
            self.reports.insert(worker, digest);
        }
    }

    /// The history check, at `now_ms`, with `bound_ms` the longest wait for
    /// every report.
    pub fn check_histories(&mut self, now_ms: u64, bound_ms: u64) -> HistoryStep {
        let Phase::AwaitingHistories { since_ms } = self.phase else {
            return HistoryStep::Wait;
        };
        let timed_out = now_ms.saturating_sub(since_ms) > bound_ms;
        let digests: Vec<Digest> = self.reports.values().copied().collect();
        match self.gate.decide(&digests, timed_out) {
            InitializationDecision::Wait => HistoryStep::Wait,
            InitializationDecision::Unchecked { .. } => HistoryStep::Complete {
                collective: false,
                checked: false,
            },
            InitializationDecision::Complete => HistoryStep::Complete {
                collective: false,
                checked: true,
            },
            InitializationDecision::Mismatch { distinct } => HistoryStep::AskPolicy { distinct },
        }
    }

    /// The distribution policy resolved a history mismatch at `now_ms`.
    pub fn mismatch_resolved(
        &mut self,
        resolution: MismatchResolution,
        now_ms: u64,
    ) -> HistoryStep {
        match resolution {
            MismatchResolution::ReconcileCollectively => HistoryStep::Complete {
                collective: true,
                checked: true,
            },
            MismatchResolution::RestartReplica => {
                // Asked again after every request bound.
                self.enter(Phase::AwaitingHistories { since_ms: now_ms });
                HistoryStep::RestartReplica
            }
        }
    }

    /// InitializationComplete was sent at `now_ms`: the replica serves.
    /// Returns false if the session was cut off meanwhile.
    pub fn serving(&mut self, now_ms: u64) -> bool {
        if !self.phase.is_connected() {
            return false;
        }
        self.enter(Phase::Serving);
        self.served_at_ms = Some(now_ms);
        true
    }

    /// The session ended at `now_ms` (a connection closed, a reconnect was
    /// asked for): reconnect. Returns the wait before connecting (ms).
    pub fn disconnected(&mut self, now_ms: u64) -> u64 {
        // A session that served for a while ends the run of failures.
        if self
            .served_at_ms
            .take()
            .is_some_and(|t| now_ms.saturating_sub(t) >= STABLE_SESSION_MS)
        {
            self.failed_sessions = 0;
        }
        self.failed_sessions = self.failed_sessions.saturating_add(1);
        self.connect()
    }

    /// The replica's processes were replaced by `processes` processes of
    /// `workers` workers in all (a resize): the next session checks that
    /// many workers' reports and delivers to that many processes. Called
    /// while disconnected (the old processes' session has ended); the run
    /// of failed sessions and the session nonces go on.
    pub fn reshape(&mut self, workers: usize, processes: usize) {
        self.gate = self.gate.resized(workers);
        self.reports.clear();
        self.replica.processes = processes;
        self.start = None;
    }

    /// Stops for good.
    pub fn crash(&mut self) {
        self.enter(Phase::Crashed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(b: u8) -> Digest {
        Digest([b; 32])
    }

    fn replica(processes: usize) -> ReplicaDelivery {
        ReplicaDelivery {
            processes,
            command_log: false,
            rules: crate::DeliveryRules::AS_CHOSEN,
        }
    }

    #[test]
    fn a_session_checks_every_report_then_serves() {
        let mut s = ControllerSession::new(2, replica(2));
        assert_eq!(s.connect(), 0);
        assert_eq!(s.connected(2), Some(1));
        s.rehydrated(100);
        assert_eq!(s.check_histories(100, 5_000), HistoryStep::Wait);
        s.reported(0, 1, d(1));
        s.reported(1, 0, d(2)); // an older session's answer
        assert_eq!(s.check_histories(200, 5_000), HistoryStep::Wait);
        s.reported(1, 1, d(1));
        assert_eq!(
            s.check_histories(300, 5_000),
            HistoryStep::Complete {
                collective: false,
                checked: true
            }
        );
        assert!(s.serving(300));
        assert_eq!(s.phase(), Phase::Serving);
    }

    #[test]
    fn a_mismatch_goes_to_the_policy_and_a_timeout_completes_unchecked() {
        let mut s = ControllerSession::new(2, replica(2));
        s.connect();
        s.connected(2);
        s.rehydrated(0);
        s.reported(0, 1, d(1));
        s.reported(1, 1, d(2));
        assert_eq!(
            s.check_histories(0, 10),
            HistoryStep::AskPolicy { distinct: 2 }
        );
        assert_eq!(
            s.mismatch_resolved(MismatchResolution::RestartReplica, 50),
            HistoryStep::RestartReplica
        );
        assert_eq!(s.phase(), Phase::AwaitingHistories { since_ms: 50 });
        // The replica restarted: a new session, whose reports never come.
        s.disconnected(60);
        s.connected(2);
        s.rehydrated(70);
        assert_eq!(s.check_histories(80, 10), HistoryStep::Wait);
        assert_eq!(
            s.check_histories(81, 10),
            HistoryStep::Complete {
                collective: false,
                checked: false
            }
        );
    }

    #[test]
    fn quickly_failed_sessions_back_off_and_a_stable_one_resets() {
        let mut s = ControllerSession::new(1, replica(1));
        s.connect();
        let mut waits = Vec::new();
        for t in 0..5 {
            s.connected(1);
            s.rehydrated(t);
            s.serving(t);
            waits.push(s.disconnected(t + 1));
        }
        assert_eq!(waits, vec![0, 50, 100, 200, 400]);
        s.connected(1);
        s.rehydrated(0);
        s.serving(0);
        assert_eq!(s.disconnected(STABLE_SESSION_MS), 0);
        assert_eq!(reconnect_backoff_ms(40), MAX_RECONNECT_BACKOFF_MS);
    }

    #[test]
    fn a_resized_replica_s_session_checks_every_new_worker_with_a_new_nonce() {
        let mut s = ControllerSession::new(2, replica(2));
        s.connect();
        let first = s.connected(2).unwrap();
        s.rehydrated(0);
        s.reported(0, first, d(1));
        s.reported(1, first, d(1));
        s.check_histories(0, 5_000);
        s.serving(0);
        s.disconnected(10);
        s.reshape(3, 3);
        let second = s.connected(3).unwrap();
        assert!(second > first, "a new session's nonce");
        s.rehydrated(20);
        s.reported(0, second, d(1));
        s.reported(1, second, d(1));
        assert_eq!(
            s.check_histories(30, 5_000),
            HistoryStep::Wait,
            "two reports of three workers"
        );
        s.reported(2, second, d(1));
        assert_eq!(
            s.check_histories(40, 5_000),
            HistoryStep::Complete {
                collective: false,
                checked: true
            }
        );
        assert_eq!(s.replica.processes, 3);
    }

    #[test]
    fn crashed_is_final() {
        let mut s = ControllerSession::new(1, replica(1));
        s.connect();
        s.crash();
        assert_eq!(s.connected(1), None);
        s.connect();
        assert_eq!(s.phase(), Phase::Crashed);
    }
}
