//! A distribution policy running as a WebAssembly component.

use std::path::Path;

use lockstep_policy::{
    CommandClass, CommandInfo, DistributionPolicy, MismatchAction, MismatchInfo, PolicyError,
    Strategy,
};
use wasmtime::component::{HasSelf, Linker};
use wasmtime::Store;

use crate::load::{self, Loaded};
use crate::state::{HostState, Instantiate, Runner};
use crate::{CallError, ComponentCache, Limits, LoadError, PolicyKind};

mod bindings {
    wasmtime::component::bindgen!({
        path: "../../wit/lockstep-policy.wit",
        world: "distribution",
    });
}

use bindings::lockstep::policy::types as wit;

/// The types interface has no functions: nothing to provide.
impl wit::Host for HostState {}

impl bindings::DistributionImports for HostState {
    fn log(&mut self, msg: String) {
        HostState::log(self, msg);
    }
}

impl Instantiate for bindings::DistributionPre<HostState> {
    type Bindings = bindings::Distribution;
    fn instantiate(&self, store: &mut Store<HostState>) -> wasmtime::Result<Self::Bindings> {
        bindings::DistributionPre::instantiate(self, store)
    }
    fn engine(&self) -> &wasmtime::Engine {
        self.instance_pre().engine()
    }
}

/// A distribution policy loaded from a component file.
///
/// Each call runs with [`Limits`]; a failed call is a [`CallError`] (through
/// the trait: a [`PolicyError`]) and the next call runs in a fresh instance.
/// On error, the controller's machine uses its fallback (hand the policy to
/// `lockstep-controller` as it is).
pub struct WasmDistributionPolicy {
    runner: Runner<bindings::DistributionPre<HostState>>,
}

impl std::fmt::Debug for WasmDistributionPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WasmDistributionPolicy")
            .field("name", &self.runner.name())
            .field("limits", &self.runner.limits())
            .finish_non_exhaustive()
    }
}

impl WasmDistributionPolicy {
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
        let kind = PolicyKind::Distribution;
        let loaded = load::compile(path, cache)?;
        load::check_world(&loaded, kind)?;
        let pre = prepare(&loaded)?;
        let runner = Runner::new(loaded.name.clone(), limits, pre).map_err(|source| {
            LoadError::Instantiate {
                path: loaded.path.clone(),
                source,
            }
        })?;
        tracing::info!(policy = %loaded.name, path = %loaded.path.display(), "distribution policy loaded");
        Ok(Self { runner })
    }

    /// The strategy for one command, or why the policy gave none.
    pub fn call_choose(&mut self, info: &CommandInfo) -> Result<Strategy, CallError> {
        let arg = to_wit_command(info);
        self.runner
            .call(|b, store| b.call_choose(store, arg))
            .map(from_wit_strategy)
    }

    /// What a history mismatch does, or why the policy gave no answer.
    pub fn call_on_mismatch(&mut self, info: &MismatchInfo) -> Result<MismatchAction, CallError> {
        let arg = wit::MismatchInfo {
            process_count: info.process_count,
            distinct_digests: info.distinct_digests,
            matching_controller: info.matching_controller,
        };
        self.runner
            .call(|b, store| b.call_on_mismatch(store, arg))
            .map(|a| match a {
                wit::MismatchAction::RestartReplica => MismatchAction::RestartReplica,
                wit::MismatchAction::ReconcileCollectively => MismatchAction::ReconcileCollectively,
            })
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

    /// Drops the live instance; the next call starts from a fresh one (as
    /// after a failure).
    pub fn reset(&mut self) {
        self.runner.reset();
    }
}

fn prepare(loaded: &Loaded) -> Result<bindings::DistributionPre<HostState>, LoadError> {
    let kind = PolicyKind::Distribution;
    let mut linker = Linker::<HostState>::new(load::engine());
    bindings::Distribution::add_to_linker::<_, HasSelf<_>>(&mut linker, |s| s)
        .expect("the distribution imports are defined once");
    let pre = linker
        .instantiate_pre(&loaded.component)
        .map_err(|e| load::wrong_world(loaded, kind, e))?;
    bindings::DistributionPre::new(pre).map_err(|e| load::wrong_world(loaded, kind, e))
}

impl DistributionPolicy for WasmDistributionPolicy {
    fn name(&self) -> &str {
        self.runner.name()
    }

    fn choose(&mut self, info: &CommandInfo) -> Result<Strategy, PolicyError> {
        self.call_choose(info).map_err(PolicyError::from)
    }

    fn on_mismatch(&mut self, info: &MismatchInfo) -> Result<MismatchAction, PolicyError> {
        self.call_on_mismatch(info).map_err(PolicyError::from)
    }
}

fn to_wit_command(info: &CommandInfo) -> wit::CommandInfo {
    wit::CommandInfo {
        kind: match info.class {
            CommandClass::Hello => wit::CommandKind::Hello,
            CommandClass::CreateInstance => wit::CommandKind::CreateInstance,
            CommandClass::InitializationComplete => wit::CommandKind::InitializationComplete,
            CommandClass::UpdateConfiguration => wit::CommandKind::UpdateConfiguration,
            CommandClass::CreateDataflow => wit::CommandKind::CreateDataflow,
            CommandClass::Schedule => wit::CommandKind::Schedule,
            CommandClass::AllowCompaction => wit::CommandKind::AllowCompaction,
            CommandClass::Peek => wit::CommandKind::Peek,
            CommandClass::CancelPeek => wit::CommandKind::CancelPeek,
            CommandClass::Subscribe => wit::CommandKind::Subscribe,
            CommandClass::WriteInput => wit::CommandKind::WriteInput,
            CommandClass::StatusRequest => wit::CommandKind::StatusRequest,
        },
        size_bytes: info.size_bytes,
        dataflow_id: info.dataflow_id,
        process_count: info.process_count,
        workers_per_process: info.workers_per_process,
        reconciling: info.reconciling,
    }
}

fn from_wit_strategy(s: wit::Strategy) -> Strategy {
    match s {
        wit::Strategy::Broadcast => Strategy::Broadcast,
        wit::Strategy::Barrier => Strategy::Barrier,
        wit::Strategy::Log => Strategy::Log,
        wit::Strategy::Naive => Strategy::Naive,
    }
}
