//! `broadcast` on the controller side. Every process gets a copy; global
//! worker 0 forwards its process's copy onto the control mesh, and every
//! worker applies broadcast commands in the order the mesh delivers them
//! (the other copies are not applied). A session whose Hello was chosen
//! `broadcast` sends every command with it (`strategy_for`). (The replica's
//! side: `crates/replica/src/order/broadcast.rs`.)

use lockstep_protocol::Command;

use crate::actor::Actor;

impl Actor {
    /// Sends a `broadcast` command: a copy to every process.
    pub(super) fn deliver_broadcast(&mut self, cmd: Command) {
        self.send_copies(cmd);
    }
}
