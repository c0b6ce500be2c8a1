//! The `naive` strategy: each worker applies its own socket copy, in the
//! order its process's connection delivers it, with no coordination. It is
//! the negative control.
//!
//! Its reconciliation is per worker: at InitializationComplete each worker
//! keeps the installed dataflows the controller asked for again (same ID and
//! description hash), drops the others, and builds the missing ones in the
//! controller's order, alone: the drops are those of the
//! [`lockstep_reconcile::local`] plan, and applying the buffered commands
//! builds the rest. It is wrong as soon as workers disagree on what is
//! installed, which is what the fault suite and the model show.

use lockstep_protocol::Command;
use lockstep_reconcile::DataflowKey;
use timely::worker::Worker;

use crate::worker::WorkerState;

impl WorkerState {
    /// Per-worker reconciliation at InitializationComplete: drops every
    /// installed dataflow whose (ID, description hash) is not in the target
    /// the buffer creates, then applies the buffer.
    pub(crate) fn reconcile_locally(&mut self, worker: &mut Worker, buffer: Vec<Command>) {
        let target: Vec<DataflowKey> = super::target_of(&buffer);
        // In ID order, the order the drops were always made in.
        let installed: Vec<DataflowKey> = self
            .dataflows
            .iter()
            .map(|(&id, inst)| DataflowKey {
                id,
                hash: inst.hash,
            })
            .collect();
        let plan = lockstep_reconcile::local(&installed, &target);
        self.finish_reconcile(worker, plan.drop, buffer, "per-worker");
    }
}
