//! What the controller does to send a command: the delivery decisions of
//! [`ControllerSession`], made from each strategy's controller-side rules
//! ([`crate::StrategyRules`]).
//!
//! The controller's shell (`crates/controller/src/actor/deliver.rs`) asks
//! the distribution policy, performs what is decided here (socket copies,
//! appends to the command log) and nothing else; the model checker
//! (`crates/model`) starts its sessions and routes its commands by the same
//! decisions.

use lockstep_protocol::Strategy;

use crate::strategy::{rules, socket_ordered};
use crate::ControllerSession;

/// What the controller's delivery decisions depend on, fixed for a replica.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ReplicaDelivery {
    /// The replica's process count.
    pub processes: usize,
    /// Whether it has a command log.
    pub command_log: bool,
    /// The fallback, and what the policy may choose.
    pub rules: DeliveryRules,
}

/// What is decided once for every replica a controller drives (the
/// environment builds one): the strategy a command is sent with when the
/// policy's choice cannot be taken, and whether the policy may choose
/// `naive`, the negative control. The policy's answers reach the machine
/// unwrapped: the machine alone applies these (and, on a history mismatch
/// the policy cannot answer, [`ControllerSession::mismatch_fallback`], the
/// rule the model checks).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DeliveryRules {
    /// What a command is sent with when the policy failed or its choice
    /// cannot be taken.
    pub fallback: Strategy,
    /// Whether a choice of `naive` is taken (else it gets the fallback).
    pub naive_allowed: bool,
}

impl DeliveryRules {
    /// The fallback strategy: `barrier`, which needs nothing of a replica
    /// (no command log, no pinned session) and orders every command.
    pub const FALLBACK: Strategy = Strategy::Barrier;

    /// The fallback, and the policy's choices taken as they are (`naive`
    /// too): a caller that hands the controller its own policy.
    pub const AS_CHOSEN: DeliveryRules = DeliveryRules {
        fallback: Self::FALLBACK,
        naive_allowed: true,
    };

    /// What `lockstep serve` runs: the fallback, and `naive` refused
    /// unless `naive_allowed` (a build with the test hooks, asked to).
    pub const fn shipped(naive_allowed: bool) -> DeliveryRules {
        DeliveryRules {
            fallback: Self::FALLBACK,
            naive_allowed,
        }
    }
}

/// Why a command is not sent with what the policy chose.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fallback {
    /// The policy failed.
    PolicyFailed,
    /// It chose a strategy that appends to a command log, and the replica
    /// has none.
    NoCommandLog,
    /// It chose a strategy that pins a session, for a command of a session
    /// that does not (choose it for Hello to use it for a whole session).
    PinsSession,
    /// It chose `naive`, the negative control, and the rules refuse it
    /// ([`DeliveryRules::naive_allowed`]).
    NaiveRefused,
}

/// A strategy decided for a command: what it is sent with, and the
/// fallback taken instead of the policy's choice, if one was.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Choice {
    /// What the command is sent with.
    pub strategy: Strategy,
    /// Why the policy's choice was not taken, if it was not.
    pub fallback: Option<Fallback>,
}

/// How a session starts, decided when every process is connected.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SessionStart {
    /// What its Hellos are sent with (and, if it pins the session, every
    /// command).
    pub strategy: Strategy,
    /// Process 0's Hello and the replayed history are appended to the
    /// command log in one transaction before any socket copy (the Hello is
    /// the session's marker).
    pub batch: bool,
    /// Process 0's Hello alone is appended to the command log as the
    /// session's marker before the Hellos are sent: a replica with a log
    /// gets every session's marker, whatever its strategy, so its workers
    /// cut a log session this one ends at the same entry.
    pub marker: bool,
}

/// A deliberate flaw planted in the delivery decisions, so that the model
/// checker can show it catches it (feature `mutants`; the controller never
/// sets one).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum DeliveryMutant {
    /// The decisions as they are meant to be.
    #[default]
    None,
    /// A session that does not use the log appends no marker to it: a
    /// worker that tails the log never learns where a cut-off log session
    /// ends.
    NoMarker,
}

impl DeliveryMutant {
    /// The planted flaw's variant name in the model's report.
    pub const NAME: &'static str = "mutant-no-session-marker";
}

/// How one numbered command reaches the processes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Delivery {
    /// A copy to every process.
    Copies,
    /// Each process its own part of a write (the rows its workers own),
    /// every part under one sequence number.
    PartsPerProcess,
    /// Appended to the command log, then a copy to every process (the
    /// copies only make the workers read the log now); a crash before any
    /// copy is a crash before the append. `batched`: while the session
    /// starts, into the start's one transaction ([`SessionStart::batch`]).
    AppendThenCopies {
        /// Whether it joins the session start's batch.
        batched: bool,
    },
}

impl ControllerSession {
    /// The strategy every command of this session is sent with, if the
    /// session's start pinned one ([`crate::StrategyRules::pins_session`]):
    /// then the policy is not asked.
    pub fn pinned(&self) -> Option<Strategy> {
        let s = self.start?.strategy;
        rules(s).pins_session().then_some(s)
    }

    /// What the policy's choice for a session's Hello (`None`: the policy
    /// failed) becomes: the fallback if it failed, chose `naive` where the
    /// rules refuse it, or chose a strategy that appends to a command log
    /// the replica lacks.
    pub fn session_choice(&self, chosen: Option<Strategy>) -> Choice {
        let fallback = match chosen {
            None => Some(Fallback::PolicyFailed),
            Some(Strategy::Naive) if !self.replica.rules.naive_allowed => {
                Some(Fallback::NaiveRefused)
            }
            Some(s) if rules(s).appends_to_log() && !self.replica.command_log => {
                Some(Fallback::NoCommandLog)
            }
            Some(_) => None,
        };
        match (chosen, fallback) {
            (Some(strategy), None) => Choice {
                strategy,
                fallback: None,
            },
            (_, fallback) => Choice {
                strategy: self.replica.rules.fallback,
                fallback,
            },
        }
    }

    /// What the policy's choice for a command of this session becomes: the
    /// session's own strategy if its start pinned one; else
    /// [`Self::session_choice`], and the fallback for a strategy that pins
    /// a session (only a Hello starts one).
    pub fn command_choice(&self, chosen: Option<Strategy>) -> Choice {
        if let Some(strategy) = self.pinned() {
            return Choice {
                strategy,
                fallback: None,
            };
        }
        let choice = self.session_choice(chosen);
        if rules(choice.strategy).pins_session() {
            return Choice {
                strategy: self.replica.rules.fallback,
                fallback: Some(Fallback::PinsSession),
            };
        }
        choice
    }

    /// Starts the session's delivery with `strategy` (a
    /// [`Self::session_choice`]), once every process is connected
    /// ([`Self::connected`]).
    pub fn start_delivery(&mut self, strategy: Strategy) -> SessionStart {
        let batch = rules(strategy).appends_to_log();
        let start = SessionStart {
            strategy,
            batch,
            marker: !batch
                && self.replica.command_log
                && self.delivery_mutant != DeliveryMutant::NoMarker,
        };
        self.start = Some(start);
        start
    }

    /// What InitializationComplete is sent with, `chosen` being its
    /// [`Self::command_choice`]: `barrier` instead of a strategy that
    /// reconciles per worker (`naive`) when the replica must reconcile
    /// collectively (`collective`, a history mismatch the policy resolved
    /// so).
    pub fn completion_strategy(&self, chosen: Strategy, collective: bool) -> Strategy {
        if collective && !rules(chosen).reconciles_collectively() {
            Strategy::Barrier
        } else {
            chosen
        }
    }

    /// What a history mismatch gets when the policy cannot answer: a
    /// session whose strategy reconciles per worker (`naive`) restarts the
    /// replica, since reconciling collectively cannot repair it (a
    /// dataflow built on some workers only has already shifted their timely
    /// indices, and the session's later commands are not coordinated
    /// either: the model's `history-full-collective` shows it); any other
    /// reconciles collectively.
    pub fn mismatch_fallback(&self) -> crate::MismatchResolution {
        match self.start {
            Some(s) if !rules(s.strategy).reconciles_collectively() => {
                crate::MismatchResolution::RestartReplica
            }
            _ => crate::MismatchResolution::ReconcileCollectively,
        }
    }

    /// How a command sent with `strategy` reaches the processes; `write`
    /// whether it is a write (which a socket-ordered strategy splits per
    /// process on a replica of more than one).
    pub fn delivery(&self, strategy: Strategy, write: bool) -> Delivery {
        let r = rules(strategy);
        if r.appends_to_log() {
            let batched =
                self.start.is_some_and(|s| s.batch) && self.phase() == crate::Phase::Rehydrating;
            return Delivery::AppendThenCopies { batched };
        }
        if write && r.splits_writes() && self.replica.processes > 1 {
            debug_assert!(socket_ordered(strategy));
            return Delivery::PartsPerProcess;
        }
        Delivery::Copies
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn session(processes: usize, command_log: bool) -> ControllerSession {
        let mut s = ControllerSession::new(
            processes,
            ReplicaDelivery {
                processes,
                command_log,
                rules: DeliveryRules::AS_CHOSEN,
            },
        );
        s.connect();
        s.connected(processes);
        s
    }

    #[test]
    fn naive_gets_the_fallback_where_the_rules_refuse_it_for_a_session_and_a_command() {
        let mut refusing = ControllerSession::new(
            2,
            ReplicaDelivery {
                processes: 2,
                command_log: false,
                rules: DeliveryRules::shipped(false),
            },
        );
        refusing.connect();
        refusing.connected(2);
        let refused = Choice {
            strategy: DeliveryRules::FALLBACK,
            fallback: Some(Fallback::NaiveRefused),
        };
        assert_eq!(refusing.session_choice(Some(Strategy::Naive)), refused);
        assert_eq!(refusing.command_choice(Some(Strategy::Naive)), refused);
        // Any other choice is taken as it is.
        assert_eq!(
            refusing.session_choice(Some(Strategy::Broadcast)).fallback,
            None
        );
        // Allowed: taken.
        let allowed = session(2, false).session_choice(Some(Strategy::Naive));
        assert_eq!(
            (allowed.strategy, allowed.fallback),
            (Strategy::Naive, None)
        );
    }

    #[test]
    fn a_log_choice_without_a_log_or_a_failed_policy_gets_the_fallback() {
        let s = session(2, false);
        assert_eq!(
            s.session_choice(Some(Strategy::Log)),
            Choice {
                strategy: Strategy::Barrier,
                fallback: Some(Fallback::NoCommandLog)
            }
        );
        assert_eq!(
            s.session_choice(None).fallback,
            Some(Fallback::PolicyFailed)
        );
        assert_eq!(
            session(2, true)
                .session_choice(Some(Strategy::Log))
                .strategy,
            Strategy::Log
        );
    }

    #[test]
    fn a_pinned_session_sends_everything_with_its_strategy() {
        for pinning in [Strategy::Broadcast, Strategy::Log] {
            let mut s = session(2, true);
            s.start_delivery(pinning);
            assert_eq!(s.pinned(), Some(pinning));
            assert_eq!(s.command_choice(Some(Strategy::Naive)).strategy, pinning);
        }
        let mut s = session(2, true);
        s.start_delivery(Strategy::Barrier);
        assert_eq!(s.pinned(), None);
        assert_eq!(
            s.command_choice(Some(Strategy::Broadcast)),
            Choice {
                strategy: Strategy::Barrier,
                fallback: Some(Fallback::PinsSession)
            }
        );
        assert_eq!(
            s.command_choice(Some(Strategy::Naive)).strategy,
            Strategy::Naive
        );
    }

    #[test]
    fn a_session_start_batches_under_log_and_marks_any_other_with_a_log() {
        let mut s = session(2, true);
        let start = s.start_delivery(Strategy::Log);
        assert!(start.batch && !start.marker);
        assert_eq!(
            s.delivery(Strategy::Log, false),
            Delivery::AppendThenCopies { batched: true }
        );
        s.rehydrated(0);
        assert_eq!(
            s.delivery(Strategy::Log, false),
            Delivery::AppendThenCopies { batched: false }
        );
        for other in [Strategy::Naive, Strategy::Barrier, Strategy::Broadcast] {
            let start = session(2, true).start_delivery(other);
            assert!(!start.batch && start.marker, "{other:?}");
            let start = session(2, false).start_delivery(other);
            assert!(!start.batch && !start.marker, "{other:?}");
        }
    }

    #[test]
    fn writes_split_per_process_only_when_each_process_applies_its_own_copy() {
        let s = session(2, true);
        for (strategy, split) in [
            (Strategy::Naive, true),
            (Strategy::Barrier, true),
            (Strategy::Broadcast, false),
        ] {
            let expected = if split {
                Delivery::PartsPerProcess
            } else {
                Delivery::Copies
            };
            assert_eq!(s.delivery(strategy, true), expected, "{strategy:?}");
            assert_eq!(s.delivery(strategy, false), Delivery::Copies);
        }
        assert_eq!(
            session(1, false).delivery(Strategy::Barrier, true),
            Delivery::Copies
        );
    }

    #[test]
    fn a_mismatch_without_a_policy_answer_restarts_a_naive_replica() {
        let mut s = session(2, false);
        s.start_delivery(Strategy::Naive);
        assert_eq!(
            s.mismatch_fallback(),
            crate::MismatchResolution::RestartReplica
        );
        for collective in [Strategy::Barrier, Strategy::Broadcast] {
            let mut s = session(2, false);
            s.start_delivery(collective);
            assert_eq!(
                s.mismatch_fallback(),
                crate::MismatchResolution::ReconcileCollectively
            );
        }
    }

    #[test]
    fn naive_is_upgraded_to_barrier_to_reconcile_collectively() {
        let s = session(2, false);
        assert_eq!(
            s.completion_strategy(Strategy::Naive, true),
            Strategy::Barrier
        );
        assert_eq!(
            s.completion_strategy(Strategy::Naive, false),
            Strategy::Naive
        );
        for collective in [Strategy::Barrier, Strategy::Broadcast, Strategy::Log] {
            assert_eq!(s.completion_strategy(collective, true), collective);
        }
    }
}
