//! Where a worker takes each strategy's commands from.
//!
//! The socket copies of every command always arrive, on every process; the
//! strategy a command carries ([`Order`]) decides which copy a worker hands
//! its session machine ([`lockstep_reconcile::WorkerSession`]), which then
//! decides what waits for what:
//!
//! - `naive` and `barrier`: the worker's own socket copy, in socket order
//!   (the machine's `naive` and `barrier` files hold their reconciliation and
//!   barrier rounds);
//! - [`broadcast`]: the copy worker 0, the sequencer, forwards on the control
//!   mesh;
//! - [`log`]: the copy read from the replica's command log; the socket copy
//!   only makes the worker read the log now.
//!
//! Commands that arrive from the mesh or the log join the machine's queue
//! like the socket copies of `barrier` and `naive` commands; the machine
//! hands them out in order, and a pending barrier round blocks it.

pub mod broadcast;
pub mod log;

use lockstep_protocol::Command;

pub use lockstep_reconcile::Order;

use crate::worker::WorkerState;

impl WorkerState {
    /// Takes one command from this process's controller connection. Commands
    /// of the socket-ordered strategies (barrier, naive) go to the session
    /// machine; a broadcast command is forwarded to the mesh by the sequencer
    /// (worker 0) and otherwise only acknowledged; a log command makes the
    /// worker read the log now.
    pub fn admit(&mut self, cmd: Command) {
        match Order::of(cmd.strategy) {
            Order::Naive | Order::Barrier => self.push_ordered(cmd),
            Order::Broadcast => self.forward_broadcast(cmd),
            Order::Log => self.poke_log(&cmd),
        }
    }

    /// Hands a command in this worker's order to the session machine. If
    /// the machine holds it for a log marker (a newer session on a worker
    /// that tails a log), the log is read now rather than at the next poll:
    /// the controller appended the marker before it sent the command.
    pub(crate) fn push_ordered(&mut self, cmd: Command) {
        self.machine.push(cmd);
        if self.machine.holding() {
            if let Some(tail) = &mut self.log {
                tail.poked = true;
            }
        }
    }
}
