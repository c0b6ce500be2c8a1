//! The `barrier` distribution policy: every command is applied on arrival,
//! and dataflow creation waits until all workers announce the same command.
//!
//! It avoids funnelling commands through one worker while keeping I1
//! (lockstep) through the barrier. A history mismatch is reconciled
//! collectively: the set of dataflows kept is what all workers agree on.

use lockstep_policy_sdk::distribution::{CommandInfo, Distribution, Strategy};

/// Barrier for every command.
pub struct Barrier;

impl Distribution for Barrier {
    fn choose(_info: &CommandInfo) -> Strategy {
        Strategy::Barrier
    }
}

lockstep_policy_sdk::export_distribution!(Barrier);
