//! lockstep's fault suites on real processes, and their one report.
//!
//! - `lockstep-chaos-distribution` (`src/bin/distribution.rs`): replicas of
//!   real processes under partial broadcasts, killed and stopped processes,
//!   dropped connections and stale controllers; I1–I4 checked per strategy.
//! - `lockstep-chaos` (`src/bin/orphans.rs`, [`orphans`]): real environments
//!   and the real `lockstep` binary crashed at failpoints; O1–O4 checked per
//!   orphan rule. The scenarios themselves live in
//!   `lockstep_environment::chaos`, which the environment's own tests share.
//!
//! Every scenario ends as a pass, a violation of a named invariant or a
//! harness error ([`outcome`]); both suites print the reporting contract's
//! JSON line through [`outcome::Tally`].

pub mod orphans;
pub mod outcome;
