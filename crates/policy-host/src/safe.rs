//! The orphan rule's stated safe default, applied and logged. A
//! distribution policy has none here: its fallbacks are the controller's
//! machine's (`lockstep_reconcile::ControllerSession`), the one place they
//! are decided and model-checked.

use lockstep_policy::{CatalogView, OrphanDecision, OrphanPolicy, PolicyError, Service};

/// An orphan policy that always answers: when the inner policy fails, it
/// **deletes nothing**, logging the error at `error`. Deleting nothing never
/// removes a wanted service (O1); the orphans wait for the next start.
#[derive(Debug)]
pub struct SafeOrphans<P> {
    policy: P,
    failures: u64,
}

impl<P: OrphanPolicy> SafeOrphans<P> {
    /// Wraps `policy`.
    pub fn new(policy: P) -> Self {
        Self {
            policy,
            failures: 0,
        }
    }

    /// The policy's decision, or "delete nothing".
    pub fn decide(&mut self, services: &[Service], view: &CatalogView) -> OrphanDecision {
        match self.policy.classify(services, view) {
            Ok(d) => d,
            Err(e) => {
                self.failures += 1;
                tracing::error!(
                    policy = %self.policy.name(),
                    "orphan policy failed, deleting nothing: {e}"
                );
                OrphanDecision::Delete(Vec::new())
            }
        }
    }

    /// How many calls fell back so far.
    pub fn failures(&self) -> u64 {
        self.failures
    }

    /// The wrapped policy.
    pub fn inner(&self) -> &P {
        &self.policy
    }
}

impl<P: OrphanPolicy> OrphanPolicy for SafeOrphans<P> {
    fn name(&self) -> &str {
        self.policy.name()
    }
    /// Never fails: see [`SafeOrphans::decide`].
    fn classify(
        &mut self,
        services: &[Service],
        view: &CatalogView,
    ) -> Result<OrphanDecision, PolicyError> {
        Ok(self.decide(services, view))
    }
}
