//! The stated safe defaults, applied and logged.

use lockstep_policy::{
    CatalogView, CommandInfo, DistributionPolicy, MismatchAction, MismatchInfo, OrphanDecision,
    OrphanPolicy, PolicyError, Service, Strategy,
};

/// A distribution policy that always answers: when the inner policy fails,
/// the configured fallback strategy (and, for a history mismatch, the
/// fallback action, [`MismatchAction::RestartReplica`] unless set), with the
/// error logged at `warn`. A command is never lost for want of a strategy.
#[derive(Debug)]
pub struct SafeDistribution<P> {
    policy: P,
    fallback: Strategy,
    mismatch_fallback: MismatchAction,
    failures: u64,
    allow_naive: bool,
}

impl<P: DistributionPolicy> SafeDistribution<P> {
    /// Wraps `policy`, falling back to `fallback` when it fails. On a history
    /// mismatch the fallback is to restart the replica, which is always safe.
    pub fn new(policy: P, fallback: Strategy) -> Self {
        Self {
            policy,
            fallback,
            mismatch_fallback: MismatchAction::RestartReplica,
            failures: 0,
            allow_naive: false,
        }
    }

    /// Whether the policy may choose `naive`, the negative control (each
    /// worker reconciles alone). Refused by default: the choice counts as a
    /// failure and the fallback is used.
    pub fn with_naive_allowed(mut self, allowed: bool) -> Self {
        self.allow_naive = allowed;
        self
    }

    /// Sets what a history mismatch does when the policy fails.
    pub fn with_mismatch_fallback(mut self, action: MismatchAction) -> Self {
        self.mismatch_fallback = action;
        self
    }

    /// The strategy for one command: the policy's, or the fallback.
    pub fn decide(&mut self, info: &CommandInfo) -> Strategy {
        match self.policy.choose(info) {
            Ok(Strategy::Naive) if !self.allow_naive => {
                self.failures += 1;
                tracing::warn!(
                    policy = %self.policy.name(), fallback = %self.fallback,
                    "the distribution policy chose naive, the negative control; refused (a build with the test hooks allows it with --experiments-allow-naive), using the fallback strategy"
                );
                self.fallback
            }
            Ok(s) => s,
            Err(e) => {
                self.failures += 1;
                tracing::warn!(
                    policy = %self.policy.name(), fallback = %self.fallback,
                    "distribution policy failed, using the fallback strategy: {e}"
                );
                self.fallback
            }
        }
    }

    /// What a history mismatch does: the policy's answer, or the fallback.
    pub fn decide_mismatch(&mut self, info: &MismatchInfo) -> MismatchAction {
        match self.policy.on_mismatch(info) {
            Ok(a) => a,
            Err(e) => {
                self.failures += 1;
                tracing::warn!(
                    policy = %self.policy.name(), fallback = ?self.mismatch_fallback,
                    "distribution policy failed on a history mismatch, using the fallback: {e}"
                );
                self.mismatch_fallback
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

impl<P: DistributionPolicy> DistributionPolicy for SafeDistribution<P> {
    fn name(&self) -> &str {
        self.policy.name()
    }
    /// Never fails: see [`SafeDistribution::decide`].
    fn choose(&mut self, info: &CommandInfo) -> Result<Strategy, PolicyError> {
        Ok(self.decide(info))
    }
    /// Never fails: see [`SafeDistribution::decide_mismatch`].
    fn on_mismatch(&mut self, info: &MismatchInfo) -> Result<MismatchAction, PolicyError> {
        Ok(self.decide_mismatch(info))
    }
}

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

#[cfg(test)]
mod tests {
    use lockstep_policy::{CommandClass, FixedStrategy};

    use super::*;

    fn info() -> CommandInfo {
        CommandInfo {
            class: CommandClass::CreateDataflow,
            size_bytes: 10,
            dataflow_id: Some(1),
            process_count: 2,
            workers_per_process: 1,
            reconciling: false,
        }
    }

    #[test]
    fn naive_from_a_policy_is_refused_unless_allowed() {
        let mut refused = SafeDistribution::new(FixedStrategy(Strategy::Naive), Strategy::Barrier);
        assert_eq!(refused.decide(&info()), Strategy::Barrier);
        assert_eq!(refused.failures(), 1);
        let mut allowed = SafeDistribution::new(FixedStrategy(Strategy::Naive), Strategy::Barrier)
            .with_naive_allowed(true);
        assert_eq!(allowed.decide(&info()), Strategy::Naive);
        assert_eq!(allowed.failures(), 0);
        let mut other = SafeDistribution::new(FixedStrategy(Strategy::Log), Strategy::Barrier);
        assert_eq!(other.decide(&info()), Strategy::Log);
    }
}
