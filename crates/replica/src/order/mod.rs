//! Where a worker takes each strategy's commands from.
//!
//! The socket copies of every command always arrive, on every process; the
//! [`Source`] of the strategy a command carries (its type on the machine's
//! side, chosen by [`lockstep_reconcile::rules`]) decides which copy a worker
//! hands its session machine ([`lockstep_reconcile::WorkerSession`]), which
//! then decides what waits for what. One file per source:
//!
//! - [`socket`] (`naive`, `barrier`): the worker's own socket copy, in
//!   socket order (the machine's `naive` and `barrier` files hold their
//!   reconciliation and barrier rounds);
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
pub mod socket;

use lockstep_protocol::Command;
use lockstep_reconcile::{rules, Source};

use crate::worker::WorkerState;

impl WorkerState {
    /// Takes one command from this process's controller connection, by the
    /// source of its strategy: a socket-ordered command goes to the session
    /// machine; a broadcast command is forwarded to the mesh by the
    /// sequencer (worker 0) and otherwise only acknowledged; a log command
    /// makes the worker read the log now.
    pub fn admit(&mut self, cmd: Command) {
        match rules(cmd.strategy).source() {
            Source::Socket => self.push_ordered(cmd),
            Source::Sequencer => self.forward_broadcast(cmd),
            Source::Log => self.poke_log(&cmd),
        }
    }
}
