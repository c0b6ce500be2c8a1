//! The `naive` strategy's part of the worker session: reconciliation per
//! worker. It is the negative control.
//!
//! At InitializationComplete each worker keeps the installed dataflows the
//! controller asked for again (same ID and description hash), drops the
//! others, and builds the missing ones in the controller's order, alone: the
//! drops are those of the [`crate::local`] plan, and applying the buffered
//! commands builds the rest. It is wrong as soon as workers disagree on
//! what is installed, which is what the fault suite and the model show.

use super::{
    target_of, Reconciliation, SessionCommand, Source, WorkerSession, WorkerStrategy, WorkerView,
};

/// The `naive` strategy on the worker side: the socket copy, ungated,
/// reconciled per worker.
#[derive(Clone, Copy, Debug)]
pub struct Naive;

impl WorkerStrategy for Naive {
    fn source(&self) -> Source {
        Source::Socket
    }
    fn reconciles_collectively(&self) -> bool {
        false
    }
}

impl<C: SessionCommand> WorkerSession<C> {
    /// Per-worker reconciliation at InitializationComplete: drops every
    /// installed dataflow whose (ID, description hash) is not in the target
    /// the buffer creates, then applies the buffer.
    pub(super) fn reconcile_locally(&mut self, buffer: Vec<C>, view: &impl WorkerView<C>) {
        let plan = crate::local(&view.installed(), &target_of(&buffer));
        self.finish_reconcile(plan.drop, buffer, Reconciliation::PerWorker);
    }
}
