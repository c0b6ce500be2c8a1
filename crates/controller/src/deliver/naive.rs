//! `naive` on the controller side. Each worker applies the copy from its
//! own process's connection on arrival, with no coordination: the negative
//! control. The controller's part is one copy per process. (The replica's
//! side: `crates/reconcile/src/worker/naive.rs`.)

use lockstep_protocol::Command;

use super::Delivery;
use crate::actor::Actor;

/// `naive` on the controller side: a copy to every process.
pub(crate) struct Naive;

impl Delivery for Naive {
    fn deliver(&self, actor: &mut Actor, cmd: Command) {
        actor.send_copies(cmd);
    }
}
