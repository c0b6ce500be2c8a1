//! Runs lockstep's WASM policies with wasmtime.
//!
//! A lockstep policy decides, it does not act: which strategy each command is
//! distributed with, which orchestrator services are orphans. Users write
//! policies in Rust against `lockstep-policy-sdk` and ship them as
//! WebAssembly components implementing a world of `wit/lockstep-policy.wit`.
//! This crate loads such a component at runtime and puts it behind the plain
//! Rust traits of `lockstep-policy`, so the controller and the environment do
//! not care whether a native rule or a WASM policy is in force:
//!
//! - [`WasmDistributionPolicy`] implements [`lockstep_policy::DistributionPolicy`];
//! - [`WasmOrphanPolicy`] implements [`lockstep_policy::OrphanPolicy`].
//!
//! # Why this shape
//!
//! A policy comes from outside the project, so it is treated as untrusted:
//!
//! - **No ambient authority.** The linker provides one import, `log`; no WASI,
//!   so a policy has no filesystem, network or clock. A component that wants
//!   anything else is refused at load time, naming the import.
//! - **Bounded.** Every call gets a fresh fuel budget ([`Limits::fuel_per_call`])
//!   and the instance's memory is capped ([`Limits::memory_bytes`]); a loop
//!   ends in [`CallError::OutOfFuel`], a runaway allocation in
//!   [`CallError::MemoryLimit`].
//! - **Checked.** The component's world and version are checked when it is
//!   loaded ([`LoadError::WrongWorld`]); every answer is checked when it comes
//!   back ([`CallError::Nonsense`]), e.g. an orphan decision that deletes a
//!   service that was not listed or that the catalog keeps.
//! - **Never fatal.** After any failure the instance is dropped and the next
//!   call instantiates the component again from its pre-instantiated form, so
//!   the host stays usable. Callers apply a stated safe default on error:
//!   - **orphans: delete nothing** (never wrong for O1; orphans wait for the
//!     next start): the [`SafeOrphans`] wrapper does it and logs it with
//!     `tracing`;
//!   - **distribution: the controller's machine decides** (its fallback
//!     strategy, and on a history mismatch its model-checked rule): the
//!     policy is handed to `lockstep-controller` as it is.
//!
//! # Use
//!
//! ```no_run
//! use lockstep_policy::{DistributionPolicy, OrphanPolicy};
//! use lockstep_policy_host::{Limits, SafeOrphans, WasmDistributionPolicy, WasmOrphanPolicy};
//!
//! # fn main() -> Result<(), lockstep_policy_host::LoadError> {
//! let dist = WasmDistributionPolicy::load("target/lockstep/policies/barrier.wasm", Limits::default())?;
//! let mut dist: Box<dyn DistributionPolicy + Send> = Box::new(dist);
//! let orphans = WasmOrphanPolicy::load("target/lockstep/policies/id-watermark.wasm", Limits::default())?;
//! let mut orphans = SafeOrphans::new(orphans);
//! # let _ = (&mut dist, &mut orphans);
//! # Ok(())
//! # }
//! ```
//!
//! Loading compiles the component with cranelift (tens of milliseconds); a
//! [`ComponentCache`] directory makes a restart deserialize instead.
//! [`conformance::check`] runs the conformance scenarios against a policy file.

mod cache;
pub mod conformance;
mod distribution;
mod error;
mod load;
mod orphans;
mod safe;
mod state;

use std::path::{Path, PathBuf};

pub use cache::ComponentCache;
pub use distribution::WasmDistributionPolicy;
pub use error::{CallError, LoadError};
pub use load::detect_kind;
pub use orphans::{check_decision, WasmOrphanPolicy};
pub use safe::SafeOrphans;

/// The version of the WIT package (`lockstep:policy`) this host speaks.
pub const WIT_VERSION: &str = "0.1.0";

/// The wasmtime version this host is built with (pinned in the workspace).
pub const WASMTIME_VERSION: &str = "48.0.8";

/// What a policy may use per call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Fuel (roughly, WebAssembly instructions) for one call. An infinite
    /// loop ends after about a millisecond per 10,000,000 units.
    pub fuel_per_call: u64,
    /// The most linear memory the instance may have, in bytes.
    pub memory_bytes: usize,
}

impl Default for Limits {
    /// 100,000,000 fuel per call and 64 MiB of memory.
    ///
    /// A looping policy is stopped after about 10 ms. Copying arguments in
    /// costs fuel too: classifying 10,000 services with one label each uses
    /// about 20,000,000 (see `last_fuel_used`), so raise the fuel for much
    /// larger listings; a distribution decision uses a few hundred.
    fn default() -> Self {
        Self {
            fuel_per_call: 100_000_000,
            memory_bytes: 64 << 20,
        }
    }
}

/// Which world a policy implements.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PolicyKind {
    /// The `distribution` world: `choose` and `on-mismatch`.
    Distribution,
    /// The `orphans` world: `classify`.
    Orphans,
}

impl PolicyKind {
    /// The world's name in the WIT file.
    pub fn world(self) -> &'static str {
        match self {
            PolicyKind::Distribution => "distribution",
            PolicyKind::Orphans => "orphans",
        }
    }

    /// The functions a component of this world must export.
    pub fn exports(self) -> &'static [&'static str] {
        match self {
            PolicyKind::Distribution => &["choose", "on-mismatch"],
            PolicyKind::Orphans => &["classify"],
        }
    }
}

impl std::fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.world())
    }
}

/// The name a policy is known by in logs and reports: its file name without
/// the `.wasm` extension (`target/lockstep/policies/epoch.wasm` is `epoch`).
pub fn policy_name(path: &Path) -> String {
    path.file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| path.display().to_string())
}

/// Where `cargo xtask build-policies` puts the shipped policy `name`
/// (`broadcast`, `barrier`, `log`, `epoch`, `id-watermark`) in this checkout:
/// `<workspace>/target/lockstep/policies/<name>.wasm`.
pub fn shipped_policy(name: &str) -> PathBuf {
    workspace_root()
        .join("target/lockstep/policies")
        .join(format!("{name}.wasm"))
}

/// The workspace root of this checkout (two levels above this crate).
pub(crate) fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .expect("crates/policy-host lives two levels below the workspace root")
        .to_path_buf()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The controller and the environment keep policies as
    /// `Box<dyn ... + Send>` and may move them between threads.
    #[test]
    fn policies_are_send() {
        fn send<T: Send>() {}
        send::<WasmDistributionPolicy>();
        send::<WasmOrphanPolicy>();
        send::<SafeOrphans<WasmOrphanPolicy>>();
        send::<ComponentCache>();
    }

    #[test]
    fn names_and_paths() {
        assert_eq!(
            policy_name(Path::new("a/b/id-watermark.wasm")),
            "id-watermark"
        );
        assert!(shipped_policy("epoch").ends_with("target/lockstep/policies/epoch.wasm"));
        assert_eq!(PolicyKind::Orphans.to_string(), "orphans");
        assert_eq!(
            PolicyKind::Distribution.exports(),
            ["choose", "on-mismatch"]
        );
    }
}
