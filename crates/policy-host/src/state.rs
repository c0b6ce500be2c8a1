//! The store's data and the instance lifecycle shared by both policy kinds.

use std::collections::VecDeque;

use wasmtime::{ResourceLimiter, Store, StoreLimits, StoreLimitsBuilder, Trap};

use crate::{CallError, Limits};

/// Messages logged to `tracing`, and kept, per call.
const MAX_MESSAGES: usize = 16;
/// Characters kept per message.
const MAX_MESSAGE_CHARS: usize = 4096;

/// What the host keeps per instance.
pub(crate) struct HostState {
    policy: String,
    limits: MemoryCap,
    /// The last messages of the current call (the panic message, if any,
    /// is the last one).
    messages: VecDeque<String>,
    /// Messages of the current call, kept or not.
    logged: usize,
}

impl HostState {
    fn new(policy: &str, limits: &Limits) -> Self {
        Self {
            policy: policy.to_string(),
            limits: MemoryCap::new(limits.memory_bytes),
            messages: VecDeque::new(),
            logged: 0,
        }
    }

    /// Forgets what the previous call logged.
    fn begin_call(&mut self) {
        self.messages.clear();
        self.logged = 0;
        self.limits.denied = None;
    }

    /// The `log` import: the first messages of a call go to `tracing`, the
    /// last ones are kept for the error if the call fails. A chatty policy
    /// costs neither unbounded logs nor unbounded memory.
    pub(crate) fn log(&mut self, msg: String) {
        let msg: String = msg.chars().take(MAX_MESSAGE_CHARS).collect();
        self.logged += 1;
        if self.logged <= MAX_MESSAGES {
            tracing::info!(target: "lockstep_policy", policy = %self.policy, "{msg}");
        } else if self.logged == MAX_MESSAGES + 1 {
            tracing::info!(target: "lockstep_policy", policy = %self.policy, "(more messages in this call are not logged)");
        }
        if self.messages.len() == MAX_MESSAGES {
            self.messages.pop_front();
        }
        self.messages.push_back(msg);
    }

    /// What the guest logged during this call, joined, if anything.
    fn logged(&self) -> Option<String> {
        if self.messages.is_empty() {
            return None;
        }
        let earlier = self.logged - self.messages.len();
        let mut text = String::new();
        if earlier > 0 {
            text.push_str(&format!("({earlier} earlier messages) "));
        }
        text.push_str(&self.messages.iter().cloned().collect::<Vec<_>>().join("; "));
        Some(text)
    }
}

/// `StoreLimits`, plus a ceiling on the total of every linear memory of the
/// store (a component may have several memories and instances: each capped
/// alone would allow their product), remembering whether it refused to grow
/// a memory so that the resulting trap can be reported as a memory limit.
struct MemoryCap {
    inner: StoreLimits,
    limit: usize,
    /// The bytes of every memory of the store, as granted so far.
    total: usize,
    denied: Option<usize>,
}

impl MemoryCap {
    fn new(limit: usize) -> Self {
        Self {
            inner: StoreLimitsBuilder::new()
                .memory_size(limit)
                .table_elements(1 << 16)
                .instances(64)
                .tables(64)
                .memories(16)
                .trap_on_grow_failure(true)
                .build(),
            limit,
            total: 0,
            denied: None,
        }
    }
}

impl ResourceLimiter for MemoryCap {
    fn memory_growing(
        &mut self,
        current: usize,
        desired: usize,
        maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        let total = (self.total - current.min(self.total)).saturating_add(desired);
        if desired > self.limit || total > self.limit {
            self.denied = Some(total.max(desired));
            return Err(wasmtime::Error::msg(format!(
                "the policy's memories would take {total} bytes in all, over its limit of {} bytes",
                self.limit
            )));
        }
        let granted = self.inner.memory_growing(current, desired, maximum)?;
        if granted {
            self.total = total;
        }
        Ok(granted)
    }

    fn memory_grow_failed(&mut self, error: wasmtime::Error) -> wasmtime::Result<()> {
        self.inner.memory_grow_failed(error)
    }

    fn table_growing(
        &mut self,
        current: usize,
        desired: usize,
        maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        self.inner.table_growing(current, desired, maximum)
    }

    fn table_grow_failed(&mut self, error: wasmtime::Error) -> wasmtime::Result<()> {
        self.inner.table_grow_failed(error)
    }

    fn instances(&self) -> usize {
        self.inner.instances()
    }

    fn tables(&self) -> usize {
        self.inner.tables()
    }

    fn memories(&self) -> usize {
        self.inner.memories()
    }
}

/// Something that instantiates a pre-instantiated component in a store: the
/// `*Pre` types that `bindgen!` generates.
pub(crate) trait Instantiate {
    /// The bindings of a live instance.
    type Bindings;
    /// Instantiates in `store`.
    fn instantiate(&self, store: &mut Store<HostState>) -> wasmtime::Result<Self::Bindings>;
    /// The engine the component was compiled for.
    fn engine(&self) -> &wasmtime::Engine;
}

/// One loaded policy: its pre-instantiated component and, between calls, a
/// live instance. Any failure drops the instance (and its store); the next
/// call instantiates again, so a trap never leaves the host unusable.
pub(crate) struct Runner<P: Instantiate> {
    name: String,
    limits: Limits,
    pre: P,
    live: Option<(Store<HostState>, P::Bindings)>,
    last_fuel_used: Option<u64>,
}

impl<P: Instantiate> Runner<P> {
    /// A runner; it instantiates once right away so that a component that
    /// cannot even start is refused at load time.
    pub(crate) fn new(name: String, limits: Limits, pre: P) -> Result<Self, CallError> {
        let mut runner = Self {
            name,
            limits,
            pre,
            live: None,
            last_fuel_used: None,
        };
        runner.ensure_live()?;
        Ok(runner)
    }

    /// The policy's name.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// The limits calls run under.
    pub(crate) fn limits(&self) -> Limits {
        self.limits
    }

    fn ensure_live(&mut self) -> Result<(), CallError> {
        if self.live.is_some() {
            return Ok(());
        }
        let mut store = Store::new(self.pre.engine(), HostState::new(&self.name, &self.limits));
        store.limiter(|s| &mut s.limits);
        store
            .set_fuel(self.limits.fuel_per_call)
            .expect("the engine is configured to consume fuel");
        match self.pre.instantiate(&mut store) {
            Ok(bindings) => {
                self.live = Some((store, bindings));
                Ok(())
            }
            Err(e) => Err(classify(&self.name, &self.limits, &store, e)),
        }
    }

    /// Runs one call with a fresh fuel budget. On any error the instance is
    /// dropped and the error says what happened.
    pub(crate) fn call<R>(
        &mut self,
        f: impl FnOnce(&P::Bindings, &mut Store<HostState>) -> wasmtime::Result<R>,
    ) -> Result<R, CallError> {
        self.ensure_live()?;
        let (store, bindings) = self.live.as_mut().expect("instantiated above");
        store
            .set_fuel(self.limits.fuel_per_call)
            .expect("the engine is configured to consume fuel");
        store.data_mut().begin_call();
        let result = f(bindings, store);
        self.last_fuel_used = store
            .get_fuel()
            .ok()
            .map(|left| self.limits.fuel_per_call.saturating_sub(left));
        match result {
            Ok(r) => Ok(r),
            Err(e) => {
                let err = classify(&self.name, &self.limits, store, e);
                tracing::debug!(policy = %self.name, "dropping the policy's instance after: {err}");
                self.live = None;
                Err(err)
            }
        }
    }

    /// The fuel the last call used (argument copying included).
    pub(crate) fn last_fuel_used(&self) -> Option<u64> {
        self.last_fuel_used
    }

    /// Drops the live instance (the next call instantiates again).
    pub(crate) fn reset(&mut self) {
        self.live = None;
    }
}

/// Turns wasmtime's error into what happened, using what the store saw.
fn classify(
    policy: &str,
    limits: &Limits,
    store: &Store<HostState>,
    e: wasmtime::Error,
) -> CallError {
    let state = store.data();
    let policy = policy.to_string();
    if let Some(requested) = state.limits.denied {
        return CallError::MemoryLimit {
            policy,
            limit: limits.memory_bytes,
            requested,
        };
    }
    match e.downcast_ref::<Trap>() {
        Some(Trap::OutOfFuel) => CallError::OutOfFuel {
            policy,
            fuel: limits.fuel_per_call,
        },
        Some(trap) => CallError::Trap {
            policy,
            trap: trap.to_string(),
            message: state.logged(),
        },
        None => CallError::Failed {
            policy,
            reason: format!("{e:#}"),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_memory_limit_is_on_the_total_of_every_memory() {
        let mut cap = MemoryCap::new(1000);
        // Two memories of 400 bytes fit; a third does not, though each alone would.
        assert!(cap.memory_growing(0, 400, None).unwrap());
        assert!(cap.memory_growing(0, 400, None).unwrap());
        assert!(cap.memory_growing(0, 400, None).is_err());
        assert_eq!(cap.denied, Some(1200));
        // Growing one of them within the total is fine.
        assert!(cap.memory_growing(400, 600, None).unwrap());
        assert!(cap.memory_growing(600, 700, None).is_err());
    }
}
