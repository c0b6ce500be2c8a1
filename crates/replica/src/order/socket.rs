//! The socket-ordered strategies (`naive`, `barrier`): a worker applies the
//! copy from its own process's controller connection, in socket order. What
//! gates them (barrier rounds) and how they reconcile is the session
//! machine's part (`lockstep_reconcile::strategy::{naive, barrier}`).

use lockstep_protocol::Command;

use crate::worker::WorkerState;

impl WorkerState {
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
