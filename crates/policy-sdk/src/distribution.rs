//! The `distribution` world: choose a strategy for every command.
//!
//! Implement [`Distribution`] and export it with
//! [`export_distribution!`](crate::export_distribution).

#[doc(hidden)]
pub mod bindings {
    wit_bindgen::generate!({
        path: "../../wit/lockstep-policy.wit",
        world: "distribution",
        pub_export_macro: true,
        export_macro_name: "__export_distribution_world",
        default_bindings_module: "lockstep_policy_sdk::distribution::bindings",
    });
}

pub use bindings::lockstep::policy::types::{
    CommandInfo, CommandKind, MismatchAction, MismatchInfo, Strategy,
};

/// Writes a message to the host's log (at info level). Outside WebAssembly
/// (a policy's native unit tests) it writes to stderr instead.
pub fn log(msg: &str) {
    #[cfg(target_family = "wasm")]
    bindings::log(msg);
    #[cfg(not(target_family = "wasm"))]
    eprintln!("policy log: {msg}");
}

/// A distribution policy.
///
/// The functions take no `self`: a policy is a pure decision function, and the
/// host may drop and re-create its instance at any time (after a trap, for
/// example), so it must not rely on state kept between calls.
pub trait Distribution {
    /// The strategy for one command. Every process receives the chosen
    /// strategy with the command, so they all agree on it.
    fn choose(info: &CommandInfo) -> Strategy;

    /// What to do when processes report different command-history digests
    /// on connect. The default reconciles collectively (keep what every
    /// worker agrees on, rebuild the rest together), like the native
    /// `FixedStrategy` rule.
    fn on_mismatch(info: &MismatchInfo) -> MismatchAction {
        let _ = info;
        MismatchAction::ReconcileCollectively
    }
}

/// Exports a type implementing [`Distribution`] as the component's
/// `distribution` world, and forwards panic messages to the host's log.
///
/// Use it once, at the top level of the policy crate.
#[macro_export]
macro_rules! export_distribution {
    ($ty:ty) => {
        const _: () = {
            struct __LockstepDistribution;

            impl $crate::distribution::bindings::Guest for __LockstepDistribution {
                fn choose(
                    info: $crate::distribution::CommandInfo,
                ) -> $crate::distribution::Strategy {
                    $crate::__private::install_panic_hook($crate::distribution::log);
                    <$ty as $crate::distribution::Distribution>::choose(&info)
                }

                fn on_mismatch(
                    info: $crate::distribution::MismatchInfo,
                ) -> $crate::distribution::MismatchAction {
                    $crate::__private::install_panic_hook($crate::distribution::log);
                    <$ty as $crate::distribution::Distribution>::on_mismatch(&info)
                }
            }

            $crate::distribution::bindings::__export_distribution_world!(
                __LockstepDistribution with_types_in $crate::distribution::bindings
            );
        };
    };
}
