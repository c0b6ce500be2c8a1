//! The `my-orphan-policy` orphan policy.
//!
//! Called once on controller start with the listed services and the
//! catalog's view. Start: the ID-watermark rule (halt if a service has
//! an ID at or above our next ID, else delete every service the catalog does
//! not keep). Change the rule and run `cargo build --release --target wasm32-unknown-unknown`.

use lockstep_policy_sdk::orphans::{CatalogView, OrphanDecision, Orphans, Service};

/// The policy.
pub struct MyOrphanPolicy;

impl Orphans for MyOrphanPolicy {
    fn classify(services: &[Service], view: &CatalogView) -> OrphanDecision {
        if let Some(s) = services.iter().find(|s| s.id >= view.next_id) {
            return OrphanDecision::Halt(format!(
                "service {} has ID {} at or above our next ID {}",
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

lockstep_policy_sdk::export_orphans!(MyOrphanPolicy);

#[cfg(test)]
mod tests {
    use super::*;

    fn svc(id: u64) -> Service {
        Service {
            id,
            name: format!("replica-{id}"),
            epoch: 1,
            labels: vec![],
        }
    }

    #[test]
    fn deletes_what_the_catalog_does_not_keep() {
        let view = CatalogView {
            keep: vec![1],
            our_epoch: 2,
            next_id: 5,
        };
        match MyOrphanPolicy::classify(&[svc(1), svc(2)], &view) {
            OrphanDecision::Delete(ids) => assert_eq!(ids, vec![2]),
            other => panic!("expected a deletion, got {other:?}"),
        }
    }

    #[test]
    fn halts_on_an_id_above_the_watermark() {
        let view = CatalogView {
            keep: vec![1],
            our_epoch: 2,
            next_id: 5,
        };
        assert!(matches!(
            MyOrphanPolicy::classify(&[svc(1), svc(5)], &view),
            OrphanDecision::Halt(_)
        ));
    }
}
