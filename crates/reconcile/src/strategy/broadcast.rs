//! The `broadcast` strategy (the Materialize baseline): global worker 0 is
//! the sequencer. The controller sends every process a copy (the others
//! are not applied; a session whose Hello was sent with `broadcast` sends
//! every command with it, [`StrategyRules::pins_session`]).
//!
//! Every worker, worker 0 included, applies broadcast commands in the order
//! the control mesh delivers them from worker 0, which forwards the copy of
//! its own process's connection (the replica's shell does:
//! `crates/replica/src/order/broadcast.rs`); the other socket copies are not
//! applied. A Hello sent with `broadcast` is sequenced too, so a session
//! starts at the same point of the stream on every worker. Nothing else
//! gates a command: the sequence is the same everywhere. Broadcast sessions
//! reconcile collectively ([`super::barrier`]).

use super::{Source, StrategyRules};

/// The `broadcast` strategy: a copy to every process, a pinned session; on
/// the worker, the sequencer's order, ungated; a session reconciles
/// collectively.
#[derive(Clone, Copy, Debug)]
pub struct Broadcast;

impl StrategyRules for Broadcast {
    fn source(&self) -> Source {
        Source::Sequencer
    }
}
