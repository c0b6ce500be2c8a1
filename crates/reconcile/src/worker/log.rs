//! The `log` strategy's part of the worker session.
//!
//! Command-log entries belong to the session of the epoch marker (a Hello)
//! before them. A worker that joined a newer session since (a log session
//! was cut off, then a barrier one started) skips the entries of the older
//! one: applying them inside the newer session would apply commands the
//! controller never sent in it (I2).

use super::{CommandClass, Order, SessionCommand, WorkerSession};

impl<C: SessionCommand> WorkerSession<C> {
    /// Whether `cmd`, just taken from the queue, is a command-log entry of a
    /// session older than the one this worker joined (and notes the session
    /// of a log marker).
    pub(super) fn stale_log_entry(&mut self, cmd: &C) -> bool {
        if cmd.order() != Order::Log {
            return false;
        }
        match cmd.class() {
            CommandClass::Hello { session } => {
                self.log_marker = session;
                false
            }
            _ => self.log_marker < self.session,
        }
    }
}
