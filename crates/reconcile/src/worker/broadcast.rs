//! The `broadcast` strategy's part of the worker session (the Materialize
//! baseline): global worker 0 is the sequencer.
//!
//! Every worker, worker 0 included, applies broadcast commands in the order
//! the control mesh delivers them from worker 0, which forwards the copy of
//! its own process's connection (the replica's shell does:
//! `crates/replica/src/order/broadcast.rs`); the other socket copies are not
//! applied. A Hello sent with `broadcast` is sequenced too, so a session
//! starts at the same point of the stream on every worker. Nothing else
//! gates a command: the sequence is the same everywhere. Broadcast sessions
//! reconcile collectively ([`super::barrier`]).

use super::{Source, WorkerStrategy};

/// The `broadcast` strategy on the worker side: the sequencer's order,
/// ungated; a session reconciles collectively.
#[derive(Clone, Copy, Debug)]
pub struct Broadcast;

impl WorkerStrategy for Broadcast {
    fn source(&self) -> Source {
        Source::Sequencer
    }
}
