//! The `log` distribution policy: every command goes through the durable,
//! totally ordered command log that every process tails.
//!
//! The log is the truth, so a restarted controller and a reconnecting process
//! agree by construction. A history mismatch is reconciled collectively.

use lockstep_policy_sdk::distribution::{CommandInfo, Distribution, Strategy};

/// Log for every command.
pub struct Log;

impl Distribution for Log {
    fn choose(_info: &CommandInfo) -> Strategy {
        Strategy::Log
    }
}

lockstep_policy_sdk::export_distribution!(Log);
