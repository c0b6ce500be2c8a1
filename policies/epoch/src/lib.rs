//! The `epoch` orphan policy (the epoch rule): delete every listed service that
//! the catalog does not keep and whose epoch label is older than ours.
//!
//! A service with our epoch or a newer one was ensured by this controller or
//! by a newer one, so it is spared. The rule is only safe when the
//! orchestrator's `ensure` is conditional (an epoch label never goes back);
//! see docs/policies.md. Same rule as `lockstep_policy::EpochRule`.

use lockstep_policy_sdk::orphans::{CatalogView, OrphanDecision, Orphans, Service};

/// The epoch rule.
pub struct Epoch;

impl Orphans for Epoch {
    fn classify(services: &[Service], view: &CatalogView) -> OrphanDecision {
        OrphanDecision::Delete(
            services
                .iter()
                .filter(|s| view.keep.binary_search(&s.id).is_err() && s.epoch < view.our_epoch)
                .map(|s| s.id)
                .collect(),
        )
    }
}

lockstep_policy_sdk::export_orphans!(Epoch);
