//! The decision interfaces behind lockstep's policies, in plain Rust.
//!
//! A policy *decides*, it does not act. Two kinds exist:
//!
//! - a [`DistributionPolicy`] chooses the [`Strategy`] for every command the
//!   controller sends, and what a history mismatch between processes does;
//! - an [`OrphanPolicy`] decides which orchestrator services to delete on
//!   controller start, or that the controller must halt.
//!
//! The native rules here ([`FixedStrategy`], [`EpochRule`], [`IdWatermarkRule`],
//! [`CatalogOnlyRule`]) are the reference; the WASM policies implement the same
//! traits through the policy host, so callers do not care which one is in force.
//! `CatalogOnlyRule` is the negative control the orphan tests must catch.

use std::collections::{BTreeMap, BTreeSet};

pub use lockstep_protocol::Strategy;

/// Why a policy gave no usable answer. Callers fall back to a stated safe
/// default (orphans: delete nothing; distribution: the configured fallback).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    /// The policy trapped, ran out of fuel or memory, or failed to run.
    #[error("policy {policy} failed: {reason}")]
    Failed {
        /// The policy's name.
        policy: String,
        /// What happened.
        reason: String,
    },
    /// The policy answered something that makes no sense for the question.
    #[error("policy {policy} answered nonsense: {reason}")]
    Nonsense {
        /// The policy's name.
        policy: String,
        /// What was wrong with the answer.
        reason: String,
    },
}

/// The kind of a command, as a policy sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CommandClass {
    /// Hello.
    Hello,
    /// CreateInstance.
    CreateInstance,
    /// InitializationComplete.
    InitializationComplete,
    /// UpdateConfiguration.
    UpdateConfiguration,
    /// CreateDataflow.
    CreateDataflow,
    /// Schedule.
    Schedule,
    /// AllowCompaction.
    AllowCompaction,
    /// Peek.
    Peek,
    /// CancelPeek.
    CancelPeek,
    /// Subscribe.
    Subscribe,
    /// WriteInput.
    WriteInput,
    /// StatusRequest.
    StatusRequest,
}

impl CommandClass {
    /// Every command class, in protocol order.
    pub const ALL: [CommandClass; 12] = [
        Self::Hello,
        Self::CreateInstance,
        Self::InitializationComplete,
        Self::UpdateConfiguration,
        Self::CreateDataflow,
        Self::Schedule,
        Self::AllowCompaction,
        Self::Peek,
        Self::CancelPeek,
        Self::Subscribe,
        Self::WriteInput,
        Self::StatusRequest,
    ];

    /// The class of a protocol command.
    pub fn of(kind: &lockstep_protocol::CommandKind) -> Self {
        use lockstep_protocol::CommandKind as K;
        match kind {
            K::Hello(_) => Self::Hello,
            K::CreateInstance(_) => Self::CreateInstance,
            K::InitializationComplete => Self::InitializationComplete,
            K::UpdateConfiguration(_) => Self::UpdateConfiguration,
            K::CreateDataflow(_) => Self::CreateDataflow,
            K::Schedule { .. } => Self::Schedule,
            K::AllowCompaction { .. } => Self::AllowCompaction,
            K::Peek(_) => Self::Peek,
            K::CancelPeek { .. } => Self::CancelPeek,
            // Classed with the subscription it ends (the policy interface's
            // command kinds stay as they are, so built policies keep working).
            K::Subscribe(_) | K::CancelSubscribe { .. } => Self::Subscribe,
            K::WriteInput(_) => Self::WriteInput,
            K::StatusRequest { .. } => Self::StatusRequest,
        }
    }
}

/// What the controller knows about a command when it asks for a strategy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CommandInfo {
    /// The command's kind.
    pub class: CommandClass,
    /// Its encoded size in bytes.
    pub size_bytes: u64,
    /// The dataflow it concerns, if any.
    pub dataflow_id: Option<u64>,
    /// Processes in the replica.
    pub process_count: u32,
    /// Workers per process.
    pub workers_per_process: u32,
    /// Whether it is sent during reconciliation (between Hello and
    /// InitializationComplete).
    pub reconciling: bool,
}

/// What processes reported when their history digests differ on connect.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MismatchInfo {
    /// Processes in the replica.
    pub process_count: u32,
    /// How many different digests were reported.
    pub distinct_digests: u32,
    /// How many processes reported a digest equal to the controller's own.
    pub matching_controller: u32,
}

/// What to do when processes' histories differ.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MismatchAction {
    /// Restart every process of the replica through the orchestrator.
    RestartReplica,
    /// Reconcile collectively: keep what every worker agrees on, rebuild the rest.
    ReconcileCollectively,
}

/// Chooses how each command is distributed.
pub trait DistributionPolicy {
    /// The policy's name, for logs.
    fn name(&self) -> &str;
    /// The strategy for one command.
    fn choose(&mut self, info: &CommandInfo) -> Result<Strategy, PolicyError>;
    /// What a history mismatch does.
    fn on_mismatch(&mut self, info: &MismatchInfo) -> Result<MismatchAction, PolicyError>;
}

/// The native distribution rule: one strategy for every command; on a
/// mismatch, the machine's own rule for that strategy
/// (`lockstep_reconcile::rules`: collective reconciliation, a restart for
/// `naive`, which cannot reconcile), not a copy of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FixedStrategy(pub Strategy);

impl DistributionPolicy for FixedStrategy {
    fn name(&self) -> &str {
        self.0.name()
    }
    fn choose(&mut self, _info: &CommandInfo) -> Result<Strategy, PolicyError> {
        Ok(self.0)
    }
    fn on_mismatch(&mut self, _info: &MismatchInfo) -> Result<MismatchAction, PolicyError> {
        Ok(
            if lockstep_reconcile::rules(self.0).reconciles_collectively() {
                MismatchAction::ReconcileCollectively
            } else {
                MismatchAction::RestartReplica
            },
        )
    }
}

/// One orchestrator service as listed, with its labels.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Service {
    /// The catalog ID of what the service runs (a replica ID).
    pub id: u64,
    /// The service's name.
    pub name: String,
    /// The epoch of the controller that last ensured it.
    pub epoch: u64,
    /// Every other label.
    pub labels: BTreeMap<String, String>,
}

/// The controller's catalog, as an orphan policy sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CatalogView {
    /// IDs the catalog holds: these services are wanted.
    pub keep: BTreeSet<u64>,
    /// The controller's epoch.
    pub our_epoch: u64,
    /// The next ID the catalog will allocate (every ID in use is below it).
    pub next_id: u64,
}

/// An orphan policy's answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OrphanDecision {
    /// Delete these service IDs (possibly none).
    Delete(Vec<u64>),
    /// Do not act: another controller has taken over.
    Halt(String),
}

/// Decides which services are orphans.
pub trait OrphanPolicy {
    /// The policy's name, for logs.
    fn name(&self) -> &str;
    /// Classifies the listed services.
    fn classify(
        &mut self,
        services: &[Service],
        view: &CatalogView,
    ) -> Result<OrphanDecision, PolicyError>;
}

/// The epoch rule: delete services absent from the catalog whose epoch is older
/// than ours.
#[derive(Clone, Copy, Debug, Default)]
pub struct EpochRule;

impl OrphanPolicy for EpochRule {
    fn name(&self) -> &str {
        "epoch"
    }
    fn classify(
        &mut self,
        services: &[Service],
        view: &CatalogView,
    ) -> Result<OrphanDecision, PolicyError> {
        Ok(delete_unkept(services, view, |s| s.epoch < view.our_epoch))
    }
}

/// Deletes every listed service the catalog does not keep and for which
/// `also` holds.
fn delete_unkept(
    services: &[Service],
    view: &CatalogView,
    also: impl Fn(&Service) -> bool,
) -> OrphanDecision {
    OrphanDecision::Delete(
        services
            .iter()
            .filter(|s| !view.keep.contains(&s.id) && also(s))
            .map(|s| s.id)
            .collect(),
    )
}

/// The ID-watermark rule: a service with an ID at or above our next ID means another
/// controller allocated it after we loaded the catalog: halt. Otherwise delete
/// every service absent from the catalog.
#[derive(Clone, Copy, Debug, Default)]
pub struct IdWatermarkRule;

impl OrphanPolicy for IdWatermarkRule {
    fn name(&self) -> &str {
        "id-watermark"
    }
    fn classify(
        &mut self,
        services: &[Service],
        view: &CatalogView,
    ) -> Result<OrphanDecision, PolicyError> {
        if let Some(s) = services.iter().find(|s| s.id >= view.next_id) {
            return Ok(OrphanDecision::Halt(format!(
                "service {} has ID {} at or above our next ID {}: another controller has taken over",
                s.name, s.id, view.next_id
            )));
        }
        Ok(delete_unkept(services, view, |_| true))
    }
}

/// The negative control: delete every service the catalog lacks, with no
/// epoch or watermark check. A stale controller deletes a newer one's
/// services with it; the orphan tests must catch that (O1).
#[derive(Clone, Copy, Debug, Default)]
pub struct CatalogOnlyRule;

impl OrphanPolicy for CatalogOnlyRule {
    fn name(&self) -> &str {
        "catalog-only"
    }
    fn classify(
        &mut self,
        services: &[Service],
        view: &CatalogView,
    ) -> Result<OrphanDecision, PolicyError> {
        Ok(delete_unkept(services, view, |_| true))
    }
}

/// The native orphan rule with this name (`epoch`, `id-watermark`, `catalog-only`).
pub fn native_orphan_rule(name: &str) -> Option<Box<dyn OrphanPolicy + Send>> {
    match name {
        "epoch" => Some(Box::new(EpochRule)),
        "id-watermark" => Some(Box::new(IdWatermarkRule)),
        "catalog-only" => Some(Box::new(CatalogOnlyRule)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn svc(id: u64, epoch: u64) -> Service {
        Service {
            id,
            name: format!("replica-{id}"),
            epoch,
            labels: BTreeMap::new(),
        }
    }

    fn view(keep: &[u64], our_epoch: u64, next_id: u64) -> CatalogView {
        CatalogView {
            keep: keep.iter().copied().collect(),
            our_epoch,
            next_id,
        }
    }

    #[test]
    fn epoch_rule_spares_newer_and_kept_services() {
        let services = [svc(1, 1), svc(2, 1), svc(3, 5)];
        let d = EpochRule.classify(&services, &view(&[1], 3, 10)).unwrap();
        assert_eq!(d, OrphanDecision::Delete(vec![2]));
    }

    #[test]
    fn id_watermark_halts_on_a_newer_id() {
        let services = [svc(1, 1), svc(7, 4)];
        let d = IdWatermarkRule
            .classify(&services, &view(&[1], 3, 7))
            .unwrap();
        assert!(matches!(d, OrphanDecision::Halt(r) if r.contains("another controller")));
        let d = IdWatermarkRule
            .classify(&services, &view(&[1], 3, 8))
            .unwrap();
        assert_eq!(d, OrphanDecision::Delete(vec![7]));
    }

    #[test]
    fn catalog_only_deletes_everything_unlisted() {
        let services = [svc(1, 1), svc(9, 9)];
        let d = CatalogOnlyRule
            .classify(&services, &view(&[1], 3, 5))
            .unwrap();
        assert_eq!(d, OrphanDecision::Delete(vec![9]));
    }
}
