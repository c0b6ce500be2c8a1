//! `barrier` on the controller side. Each worker applies the copy from its
//! own process's connection; a `CreateDataflow` of a new dataflow waits at a
//! barrier round among the workers, on the replica. The controller's part
//! is one copy per process. A `naive` session's InitializationComplete is
//! sent with `barrier` when the replica must reconcile collectively
//! (`complete_initialization`). (The replica's side:
//! `crates/reconcile/src/worker/barrier.rs`, run by
//! `crates/replica/src/worker/mod.rs`.)

use lockstep_protocol::Command;

use super::Delivery;
use crate::actor::Actor;

/// `barrier` on the controller side: a copy to every process.
pub(crate) struct Barrier;

impl Delivery for Barrier {
    fn deliver(&self, actor: &mut Actor, cmd: Command) {
        actor.send_copies(cmd);
    }
}
