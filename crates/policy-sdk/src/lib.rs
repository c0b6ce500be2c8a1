//! Write a lockstep policy in a few lines of Rust.
//!
//! A lockstep policy is a WebAssembly component that implements one world of
//! `wit/lockstep-policy.wit`. Writing the component glue by hand is tedious and
//! easy to get wrong, so this crate wraps [`wit_bindgen`] behind two small
//! traits with plain Rust types and two macros:
//!
//! ```no_run
//! use lockstep_policy_sdk::distribution::{CommandInfo, Distribution, Strategy};
//!
//! struct Barrier;
//!
//! impl Distribution for Barrier {
//!     fn choose(_info: &CommandInfo) -> Strategy {
//!         Strategy::Barrier
//!     }
//! }
//!
//! lockstep_policy_sdk::export_distribution!(Barrier);
//! ```
//!
//! Build it with `cargo xtask build-policies` (or `cargo xtask new-policy NAME
//! --kind distribution` to scaffold one). The result has no WASI imports: a
//! policy gets no filesystem, network or clock, only [`distribution::log`] /
//! [`orphans::log`] to write to the host's log.
//!
//! Both worlds live in this crate; only the one whose export macro a policy
//! invokes ends up in its component (wit-bindgen embeds a world's exports
//! with the macro invocation, and unused imports are dropped).
//!
//! # A policy crate
//!
//! ```toml
//! [package]
//! name = "my-policy"
//!
//! [dependencies]
//! lockstep-policy-sdk.workspace = true
//! ```
//!
//! The types ([`distribution::CommandInfo`], [`orphans::Service`], ...) are
//! plain structs and enums generated from the WIT file, and the trait
//! functions are plain Rust: a policy's rule can be unit tested natively by
//! calling them. The host checks every answer; an orphan decision that
//! deletes a service that was not listed, twice, or that the catalog keeps
//! is refused, and the controller deletes nothing. A policy must be a pure
//! function of its arguments: the host may drop and re-create its instance
//! at any time, and every call has a fuel and a memory limit.
//!
//! # Panics
//!
//! A WebAssembly panic traps with no message. The export macros install a
//! panic hook on the first call that sends the panic message through the
//! `log` import first, so the host's error names what went wrong.

pub mod distribution;
pub mod orphans;

#[doc(hidden)]
pub mod __private {
    /// Installs, once, a panic hook that hands the panic message to `log`.
    pub fn install_panic_hook(log: fn(&str)) {
        static ONCE: std::sync::Once = std::sync::Once::new();
        ONCE.call_once(|| {
            std::panic::set_hook(Box::new(move |info| log(&info.to_string())));
        });
    }
}
