//! The `broadcast` distribution policy: every command is ordered by one
//! sequencing worker, the baseline Materialize uses.
//!
//! It is the simplest correct choice and the reference the other strategies
//! are measured against. A history mismatch is reconciled collectively.

use lockstep_policy_sdk::distribution::{CommandInfo, Distribution, Strategy};

/// Broadcast for every command.
pub struct Broadcast;

impl Distribution for Broadcast {
    fn choose(_info: &CommandInfo) -> Strategy {
        Strategy::Broadcast
    }
}

lockstep_policy_sdk::export_distribution!(Broadcast);
