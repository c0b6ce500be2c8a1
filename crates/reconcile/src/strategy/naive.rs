//! The `naive` strategy: each worker applies the copy from its own
//! process's connection on arrival, with no coordination, and reconciles
//! per worker. It is the negative control. The controller's part is one
//! copy per process (a write split so each process gets its workers' rows).
//!
//! At InitializationComplete each worker keeps the installed dataflows the
//! controller asked for again (same ID and description hash), drops the
//! others, and builds the missing ones in the controller's order, alone: the
//! drops are those of the [`crate::local`] plan, and applying the buffered
//! commands builds the rest. It is wrong as soon as workers disagree on
//! what is installed, which is what the fault suite and the model show.

use super::{Source, StrategyRules};
use crate::worker::{target_of, Reconciliation, SessionCommand, WorkerSession, WorkerView};

/// The `naive` strategy: a copy to every process (the controller's side is
/// only that); on the worker, the socket copy, ungated, reconciled per
/// worker.
#[derive(Clone, Copy, Debug)]
pub struct Naive;

impl StrategyRules for Naive {
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
    pub(crate) fn reconcile_locally(&mut self, buffer: Vec<C>, view: &impl WorkerView<C>) {
        let plan = crate::local(&view.installed(), &target_of(&buffer));
        self.finish_reconcile(plan.drop, buffer, Reconciliation::PerWorker);
    }
}
