//! lockstep's fault suites on real processes, and their one report.
//!
//! - `lockstep-chaos-distribution` (`src/bin/distribution.rs`): replicas of
//!   real processes under partial broadcasts, killed and stopped processes,
//!   dropped connections and stale controllers; I1–I4 checked per strategy.
//! - `lockstep-chaos-security` (`src/bin/security.rs`): attacks on real
//!   replicas and a real environment (forged and replayed Hellos, a spoofed
//!   mesh peer, oversized frames, floods, API calls without a token); S1
//!   checked with authentication on and, as the negative control, off.
//! - `lockstep-chaos` (`src/bin/orphans.rs`, [`orphans`]): real environments
//!   and the real `lockstep` binary crashed at failpoints; O1–O4 checked per
//!   orphan rule. The scenarios themselves live in [`environment`], which
//!   the environment's own integration tests share.
//!
//! - `lockstep-chaos-kube` (`src/bin/kube.rs`, [`kube_lifecycle`]): a
//!   replica's create, shared-fate restart, restart, upgrade and drop on a
//!   real Kubernetes API server (`cargo xtask kube`).
//!
//! Every scenario ends as a pass, a violation of a named invariant or a
//! harness error ([`outcome`]); every suite prints the reporting contract's
//! JSON line through [`outcome::Tally`].

pub mod environment;
pub mod kube_lifecycle;
pub mod orphans;
pub mod outcome;
pub mod reference;
pub mod signal;
pub mod unproven;

/// The PID of process `process` of the first service `orchestrator` lists
/// (the suites run one replica per orchestrator).
pub async fn pid_of(
    orchestrator: &dyn lockstep_orchestrator::Orchestrator,
    process: usize,
) -> Result<u32, String> {
    let services = orchestrator
        .list_services()
        .await
        .map_err(|e| e.to_string())?;
    services
        .first()
        .and_then(|s| s.processes.get(process))
        .and_then(|p| p.pid)
        .ok_or_else(|| format!("process {process} has no PID"))
}
