//! An orphan policy running as a WebAssembly component.

use std::collections::BTreeSet;
use std::path::Path;

use lockstep_policy::{CatalogView, OrphanDecision, OrphanPolicy, PolicyError, Service};
use wasmtime::component::{ComponentType, Func, HasSelf, Linker, Lower};
use wasmtime::Store;

use crate::load::{self, Loaded};
use crate::state::{HostState, Instantiate, Runner};
use crate::{CallError, ComponentCache, Limits, LoadError, PolicyKind};

mod bindings {
    wasmtime::component::bindgen!({
        path: "../../wit/lockstep-policy.wit",
        world: "orphans",
    });
}

use bindings::lockstep::policy::types as wit;

/// The types interface has no functions: nothing to provide.
impl wit::Host for HostState {}

impl bindings::OrphansImports for HostState {
    fn log(&mut self, msg: String) {
        HostState::log(self, msg);
    }
}

/// The `service` record, borrowing from the caller's [`Service`]s, so that
/// lowering copies strings straight from them into the guest with no copy
/// on the host first (10,000 services carry tens of thousands of strings).
/// Its type is checked against the WIT record when the call is made.
#[derive(ComponentType, Lower)]
#[component(record)]
struct ServiceRef<'a> {
    id: u64,
    name: &'a str,
    epoch: u64,
    labels: Vec<(&'a str, &'a str)>,
}

/// The `catalog-view` record (keep as a sorted list).
#[derive(ComponentType, Lower)]
#[component(record)]
struct CatalogViewRef {
    keep: Vec<u64>,
    #[component(name = "our-epoch")]
    our_epoch: u64,
    #[component(name = "next-id")]
    next_id: u64,
}

impl Instantiate for bindings::OrphansPre<HostState> {
    /// The `classify` export; its type was checked against the world by
    /// `OrphansPre::new` at load time.
    type Bindings = Func;
    fn instantiate(&self, store: &mut Store<HostState>) -> wasmtime::Result<Self::Bindings> {
        let instance = self.instance_pre().instantiate(&mut *store)?;
        instance
            .get_func(&mut *store, "classify")
            .ok_or_else(|| wasmtime::format_err!("the component exports no `classify`"))
    }
    fn engine(&self) -> &wasmtime::Engine {
        self.instance_pre().engine()
    }
}

/// An orphan policy loaded from a component file.
///
/// Every answer is checked with [`check_decision`] before it is returned. On
/// error the safe default is to **delete nothing** (and serve: orphans wait
/// for the next start); [`crate::SafeOrphans`] applies it.
pub struct WasmOrphanPolicy {
    runner: Runner<bindings::OrphansPre<HostState>>,
}

impl std::fmt::Debug for WasmOrphanPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WasmOrphanPolicy")
            .field("name", &self.runner.name())
            .field("limits", &self.runner.limits())
            .finish_non_exhaustive()
    }
}

impl WasmOrphanPolicy {
    /// Loads, compiles and checks the component at `path`. Its name (for logs)
    /// is the file name without `.wasm`.
    pub fn load(path: impl AsRef<Path>, limits: Limits) -> Result<Self, LoadError> {
        Self::load_inner(path.as_ref(), limits, None)
    }

    /// Like [`load`](Self::load), reusing and filling a [`ComponentCache`].
    pub fn load_cached(
        path: impl AsRef<Path>,
        limits: Limits,
        cache: &ComponentCache,
    ) -> Result<Self, LoadError> {
        Self::load_inner(path.as_ref(), limits, Some(cache))
    }

    fn load_inner(
        path: &Path,
        limits: Limits,
        cache: Option<&ComponentCache>,
    ) -> Result<Self, LoadError> {
        let loaded = load::compile(path, cache)?;
        load::check_world(&loaded, PolicyKind::Orphans)?;
        let pre = prepare(&loaded)?;
        let runner = Runner::new(loaded.name.clone(), limits, pre).map_err(|source| {
            LoadError::Instantiate {
                path: loaded.path.clone(),
                source,
            }
        })?;
        tracing::info!(policy = %loaded.name, path = %loaded.path.display(), "orphan policy loaded");
        Ok(Self { runner })
    }

    /// Classifies the listed services, checking the answer, or says why the
    /// policy gave no usable answer.
    pub fn call_classify(
        &mut self,
        services: &[Service],
        view: &CatalogView,
    ) -> Result<OrphanDecision, CallError> {
        let refs: Vec<ServiceRef<'_>> = services
            .iter()
            .map(|s| ServiceRef {
                id: s.id,
                name: &s.name,
                epoch: s.epoch,
                labels: s
                    .labels
                    .iter()
                    .map(|(k, v)| (k.as_str(), v.as_str()))
                    .collect(),
            })
            .collect();
        let view_ref = CatalogViewRef {
            keep: view.keep.iter().copied().collect(),
            our_epoch: view.our_epoch,
            next_id: view.next_id,
        };
        let (decision,) = self.runner.call(|classify, store| {
            classify
                .typed::<(&[ServiceRef<'_>], &CatalogViewRef), (wit::OrphanDecision,)>(&*store)?
                .call(&mut *store, (&refs, &view_ref))
        })?;
        let decision = match decision {
            wit::OrphanDecision::Delete(ids) => OrphanDecision::Delete(ids),
            wit::OrphanDecision::Halt(reason) => OrphanDecision::Halt(reason),
        };
        check_decision(services, view, &decision).map_err(|reason| CallError::Nonsense {
            policy: self.runner.name().to_string(),
            reason,
        })?;
        Ok(decision)
    }

    /// The limits each call runs under.
    pub fn limits(&self) -> Limits {
        self.runner.limits()
    }

    /// The fuel the last call used, copying its arguments in included
    /// (`None` before the first call): to size [`Limits::fuel_per_call`].
    pub fn last_fuel_used(&self) -> Option<u64> {
        self.runner.last_fuel_used()
    }

    /// Drops the live instance; the next call starts from a fresh one.
    pub fn reset(&mut self) {
        self.runner.reset();
    }
}

fn prepare(loaded: &Loaded) -> Result<bindings::OrphansPre<HostState>, LoadError> {
    let kind = PolicyKind::Orphans;
    let mut linker = Linker::<HostState>::new(load::engine());
    bindings::Orphans::add_to_linker::<_, HasSelf<_>>(&mut linker, |s| s)
        .expect("the orphan imports are defined once");
    let pre = linker
        .instantiate_pre(&loaded.component)
        .map_err(|e| load::wrong_world(loaded, kind, e))?;
    bindings::OrphansPre::new(pre).map_err(|e| load::wrong_world(loaded, kind, e))
}

/// Whether an orphan decision makes sense for the question: every deleted ID
/// is one of the listed services, appears once, and is not kept by the
/// catalog (deleting a kept service would break O1 whatever the rule); a
/// halt gives a reason. `Err` says what is wrong. Any policy's answer,
/// native or WASM, can be checked with it.
pub fn check_decision(
    services: &[Service],
    view: &CatalogView,
    decision: &OrphanDecision,
) -> Result<(), String> {
    match decision {
        OrphanDecision::Delete(ids) => {
            let listed: BTreeSet<u64> = services.iter().map(|s| s.id).collect();
            let mut seen = BTreeSet::new();
            for id in ids {
                if !listed.contains(id) {
                    return Err(format!("it deletes service ID {id}, which was not listed"));
                }
                if !seen.insert(*id) {
                    return Err(format!("it deletes service ID {id} more than once"));
                }
                if view.keep.contains(id) {
                    return Err(format!(
                        "it deletes service ID {id}, which the catalog keeps"
                    ));
                }
            }
            Ok(())
        }
        OrphanDecision::Halt(reason) if reason.trim().is_empty() => {
            Err("it halts without a reason".to_string())
        }
        OrphanDecision::Halt(_) => Ok(()),
    }
}

impl OrphanPolicy for WasmOrphanPolicy {
    fn name(&self) -> &str {
        self.runner.name()
    }

    fn classify(
        &mut self,
        services: &[Service],
        view: &CatalogView,
    ) -> Result<OrphanDecision, PolicyError> {
        self.call_classify(services, view)
            .map_err(PolicyError::from)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    fn svc(id: u64) -> Service {
        Service {
            id,
            name: format!("replica-{id}"),
            epoch: 1,
            labels: BTreeMap::new(),
        }
    }

    fn view(keep: &[u64]) -> CatalogView {
        CatalogView {
            keep: keep.iter().copied().collect(),
            our_epoch: 2,
            next_id: 10,
        }
    }

    #[test]
    fn sane_decisions_pass() {
        let services = [svc(1), svc(2), svc(3)];
        for d in [
            OrphanDecision::Delete(vec![]),
            OrphanDecision::Delete(vec![3, 2]),
            OrphanDecision::Halt("another controller".into()),
        ] {
            assert_eq!(check_decision(&services, &view(&[1]), &d), Ok(()), "{d:?}");
        }
    }

    #[test]
    fn nonsense_is_named() {
        let services = [svc(1), svc(2)];
        let v = view(&[1]);
        let err = |d| check_decision(&services, &v, &d).unwrap_err();
        assert!(err(OrphanDecision::Delete(vec![5])).contains("5, which was not listed"));
        assert!(err(OrphanDecision::Delete(vec![2, 2])).contains("2 more than once"));
        assert!(err(OrphanDecision::Delete(vec![1])).contains("1, which the catalog keeps"));
        assert!(err(OrphanDecision::Halt(" \n".into())).contains("without a reason"));
    }

    #[test]
    fn call_errors_become_policy_errors_without_repeating_the_name() {
        let e: PolicyError = CallError::OutOfFuel {
            policy: "p".into(),
            fuel: 7,
        }
        .into();
        assert_eq!(
            e,
            PolicyError::Failed {
                policy: "p".into(),
                reason: "ran out of fuel (7 units per call): it loops or works too hard".into()
            }
        );
        let e: PolicyError = CallError::Nonsense {
            policy: "p".into(),
            reason: "r".into(),
        }
        .into();
        assert_eq!(
            e,
            PolicyError::Nonsense {
                policy: "p".into(),
                reason: "r".into()
            }
        );
    }
}
