//! The `id-watermark` orphan policy (the ID-watermark rule, what Materialize merged).
//!
//! Catalog IDs are allocated monotonically, so a listed service with an ID at
//! or above our next ID was created by a controller that loaded the catalog
//! after us: another controller has taken over, and we halt. Otherwise every
//! service the catalog does not keep is an orphan. Same rule as
//! `lockstep_policy::IdWatermarkRule`.

use lockstep_policy_sdk::orphans::{CatalogView, OrphanDecision, Orphans, Service};

/// The ID-watermark rule.
pub struct IdWatermark;

impl Orphans for IdWatermark {
    fn classify(services: &[Service], view: &CatalogView) -> OrphanDecision {
        if let Some(s) = services.iter().find(|s| s.id >= view.next_id) {
            return OrphanDecision::Halt(format!(
                "service {} has ID {} at or above our next ID {}: another controller has taken over",
                s.name, s.id, view.next_id
            ));
        }
        OrphanDecision::Delete(
            services
                .iter()
                .filter(|s| view.keep.binary_search(&s.id).is_err())
                .map(|s| s.id)
                .collect(),
        )
    }
}

lockstep_policy_sdk::export_orphans!(IdWatermark);
