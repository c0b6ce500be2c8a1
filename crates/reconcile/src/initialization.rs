//! When a controller session may send InitializationComplete: the history
//! check on connect, as a pure decision.
//!
//! The controller (`crates/controller/src/actor/session.rs`) and the model checker
//! (`crates/model`, the `history-*` variants) run this same type: after
//! Hello and the replayed target, the controller collects every worker's
//! digest of what it did (its creation log and installed dataflows) and asks
//! the gate whether to complete initialization.
//!
//! Guarantees:
//! - **Complete** only once every worker reported and all reports are equal
//!   ([`history_check`] against the first report);
//! - **Mismatch** once every worker reported and the reports differ (a
//!   distribution policy then decides: restart the replica, or reconcile
//!   collectively);
//! - **Unchecked** when the request bound passed first: the controller goes
//!   ahead without the check and says so;
//! - **Wait** otherwise. Silence is never proof of agreement.

use crate::{history_check, Digest, HistoryVerdict};

/// A deliberate flaw planted in [`InitializationGate`], so that the model
/// checker can show it catches it (feature `mutants`; the controller never
/// sets one).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum GateMutant {
    /// The gate as it is meant to be.
    #[default]
    None,
    /// InitializationComplete goes out at once, before any report is in.
    CompleteBeforeHistoryCheck,
}

impl GateMutant {
    /// The planted flaw's variant name in the model's report.
    pub const NAME: &'static str = "mutant-complete-before-history-check";
}

/// What the controller does next in a session's initialization.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InitializationDecision {
    /// Not every worker reported yet.
    Wait,
    /// Every worker reported the same: send InitializationComplete.
    Complete,
    /// Every worker reported, and the reports differ.
    Mismatch {
        /// How many different digests the workers reported.
        distinct: u32,
    },
    /// The bound passed before every worker reported: complete unchecked.
    Unchecked {
        /// How many workers reported.
        answered: usize,
    },
}

/// The history check of one controller session.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct InitializationGate {
    workers: usize,
    mutant: GateMutant,
}

impl InitializationGate {
    /// The gate of a replica of `workers` workers.
    pub fn new(workers: usize) -> Self {
        InitializationGate {
            workers,
            mutant: GateMutant::None,
        }
    }

    /// The gate of a replica resized to `workers` workers (its flaw, if
    /// any, kept).
    pub(crate) fn resized(self, workers: usize) -> Self {
        InitializationGate { workers, ..self }
    }

    /// The same gate with a planted flaw (model checking only).
    #[cfg(feature = "mutants")]
    pub fn with_mutant(mut self, mutant: GateMutant) -> Self {
        self.mutant = mutant;
        self
    }

    /// The decision, given the digests reported so far in this session (one
    /// per worker) and whether the bound for them passed.
    pub fn decide(&self, reports: &[Digest], timed_out: bool) -> InitializationDecision {
        if self.mutant == GateMutant::CompleteBeforeHistoryCheck {
            return InitializationDecision::Complete;
        }
        if reports.len() < self.workers || reports.is_empty() {
            return if timed_out {
                InitializationDecision::Unchecked {
                    answered: reports.len(),
                }
            } else {
                InitializationDecision::Wait
            };
        }
        match history_check(reports[0], reports) {
            HistoryVerdict::InSync => InitializationDecision::Complete,
            HistoryVerdict::Mismatch { distinct, .. } => {
                InitializationDecision::Mismatch { distinct }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_for_every_report_then_compares() {
        let g = InitializationGate::new(2);
        let a = Digest([1; 32]);
        let b = Digest([2; 32]);
        assert_eq!(g.decide(&[], false), InitializationDecision::Wait);
        assert_eq!(g.decide(&[a], false), InitializationDecision::Wait);
        assert_eq!(
            g.decide(&[a], true),
            InitializationDecision::Unchecked { answered: 1 }
        );
        assert_eq!(g.decide(&[a, a], false), InitializationDecision::Complete);
        assert_eq!(
            g.decide(&[a, b], false),
            InitializationDecision::Mismatch { distinct: 2 }
        );
    }
}
