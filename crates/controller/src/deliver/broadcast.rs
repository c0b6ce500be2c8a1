//! `broadcast` on the controller side. Every process gets a copy; global
//! worker 0 forwards its process's copy onto the control mesh, and every
//! worker applies broadcast commands in the order the mesh delivers them
//! (the other copies are not applied). A session whose Hello was chosen
//! `broadcast` sends every command with it (`strategy_for`). (The replica's
//! side: `crates/replica/src/order/broadcast.rs`.)

use lockstep_protocol::Command;

use super::Delivery;
use crate::actor::Actor;

/// `broadcast` on the controller side: a copy to every process.
pub(crate) struct Broadcast;

impl Delivery for Broadcast {
    fn deliver(&self, actor: &mut Actor, cmd: Command) {
        actor.send_copies(cmd);
    }
}
