//! The `my-distribution-policy` distribution policy.
//!
//! Called by the controller for every command; every process receives the
//! strategy chosen here with the command. Start: barrier for commands that
//! change the set of dataflows, broadcast for the rest. Change the rule and
//! run `cargo build --release --target wasm32-unknown-unknown`.

use lockstep_policy_sdk::distribution::{
    CommandInfo, CommandKind, Distribution, MismatchAction, MismatchInfo, Strategy,
};

/// The policy.
pub struct MyDistributionPolicy;

impl Distribution for MyDistributionPolicy {
    fn choose(info: &CommandInfo) -> Strategy {
        match info.kind {
            CommandKind::CreateDataflow | CommandKind::AllowCompaction => Strategy::Barrier,
            _ => Strategy::Broadcast,
        }
    }

    fn on_mismatch(_info: &MismatchInfo) -> MismatchAction {
        MismatchAction::ReconcileCollectively
    }
}

lockstep_policy_sdk::export_distribution!(MyDistributionPolicy);

#[cfg(test)]
mod tests {
    use super::*;

    fn command(kind: CommandKind) -> CommandInfo {
        CommandInfo {
            kind,
            size_bytes: 64,
            dataflow_id: Some(1),
            process_count: 2,
            workers_per_process: 2,
            reconciling: false,
        }
    }

    #[test]
    fn dataflow_changes_wait_at_the_barrier() {
        assert!(matches!(
            MyDistributionPolicy::choose(&command(CommandKind::CreateDataflow)),
            Strategy::Barrier
        ));
        assert!(matches!(
            MyDistributionPolicy::choose(&command(CommandKind::Peek)),
            Strategy::Broadcast
        ));
    }
}
