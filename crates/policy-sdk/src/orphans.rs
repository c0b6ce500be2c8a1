//! The `orphans` world: decide which orchestrator services to delete on
//! controller start, or halt.
//!
//! Implement [`Orphans`] and export it with
//! [`export_orphans!`](crate::export_orphans).

#[doc(hidden)]
pub mod bindings {
    wit_bindgen::generate!({
        path: "../../wit/lockstep-policy.wit",
        world: "orphans",
        pub_export_macro: true,
        export_macro_name: "__export_orphans_world",
        default_bindings_module: "lockstep_policy_sdk::orphans::bindings",
    });
}

pub use bindings::lockstep::policy::types::{CatalogView, OrphanDecision, Service};

/// Writes a message to the host's log (at info level). Outside WebAssembly
/// (a policy's native unit tests) it writes to stderr instead.
pub fn log(msg: &str) {
    #[cfg(target_family = "wasm")]
    bindings::log(msg);
    #[cfg(not(target_family = "wasm"))]
    eprintln!("policy log: {msg}");
}

/// An orphan policy.
///
/// The host checks the answer: deleting an ID that was not listed, listing
/// one twice, deleting an ID the catalog keeps, or halting with an empty
/// reason is refused as nonsense and the controller deletes nothing.
pub trait Orphans {
    /// Classifies the listed services: which to delete, or a halt.
    fn classify(services: &[Service], view: &CatalogView) -> OrphanDecision;
}

/// Exports a type implementing [`Orphans`] as the component's `orphans`
/// world, and forwards panic messages to the host's log.
///
/// Use it once, at the top level of the policy crate.
#[macro_export]
macro_rules! export_orphans {
    ($ty:ty) => {
        const _: () = {
            struct __LockstepOrphans;

            impl $crate::orphans::bindings::Guest for __LockstepOrphans {
                fn classify(
                    services: ::std::vec::Vec<$crate::orphans::Service>,
                    view: $crate::orphans::CatalogView,
                ) -> $crate::orphans::OrphanDecision {
                    $crate::__private::install_panic_hook($crate::orphans::log);
                    <$ty as $crate::orphans::Orphans>::classify(&services, &view)
                }
            }

            $crate::orphans::bindings::__export_orphans_world!(
                __LockstepOrphans with_types_in $crate::orphans::bindings
            );
        };
    };
}
