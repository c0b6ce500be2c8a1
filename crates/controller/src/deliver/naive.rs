//! `naive` on the controller side. Each worker applies the copy from its
//! own process's connection on arrival, with no coordination: the negative
//! control. The controller's part is one copy per process. (The replica's
//! side: `crates/reconcile/src/worker/naive.rs`.)

use lockstep_protocol::Command;

use crate::actor::Actor;

impl Actor {
    /// Sends a `naive` command: a copy to every process.
    pub(super) fn deliver_naive(&mut self, cmd: Command) {
        self.send_copies(cmd);
    }
}
