//! Model 1: the compute protocol, one strategy at a time, or two in turn
//! (`log-then-barrier`, `log-then-broadcast`, `barrier-then-broadcast`).
//!
//! # What is modelled
//!
//! - A **controller** with a durable catalog (the compacted target: the
//!   dataflows it wants, in creation order) and epoch. It issues user commands
//!   (create or drop a dataflow from a small pool: A, B, then A', which is
//!   A's ID with another description, as when a restarted controller plans
//!   A anew), can **crash** (in-flight
//!   messages are lost, the catalog and epoch survive) and **restart** (epoch
//!   and session bump, then Hello and the target to every process), and can
//!   lose **one connection** (that channel is truncated; the controller
//!   reconnects every process with a new session). A **replica process can
//!   die**: timely's mesh fails, every worker stops, and the controller
//!   restarts the replica (fresh processes, a new session with the target).
//! - **Replica processes** with one timely worker each. A worker has a
//!   creation log (timely index, dataflow ID, description hash), the set of
//!   dataflows it runs (with the timely index each was built at, so an "A" built
//!   at another index on another worker is told apart), and the session it is in.
//! - **Channels**: one ordered queue per controller→process connection.
//! - **Workers run the replica's session machine.** Every worker owns a
//!   [`WorkerSession`](lockstep_reconcile::WorkerSession), the type the
//!   replica's workers run: the model hands
//!   it the commands in the worker's order and performs the actions it hands
//!   out (build, drop, announce on the mesh, halt) as the replica's worker
//!   does. What differs per strategy is only where the commands come from:
//!   - `naive`, `barrier`: the worker's own channel;
//!   - `broadcast`: process 0 sequences what it receives into a stream every
//!     worker applies in order (the other processes' copies are
//!     acknowledgements only and are not modelled); the stream lives in the
//!     mesh, so a replica restart empties it;
//!   - `log`: the controller appends commands, epoch markers and targets to a
//!     durable log (it survives crashes) that every worker tails;
//!   - `log-then-barrier`: sessions alternate between `log` and `barrier`
//!     (the first is `log`). The controller appends every session's marker
//!     to the log, whatever its strategy, before it sends the session's
//!     Hellos; a `barrier` session's commands go on the channels. Every
//!     worker tails the log (`WorkerSession::set_tails_log`) and its machine
//!     reads it through the replica's own reading code
//!     (`WorkerSession::read_log` over the model's in-memory `LogRead`), so a newer `barrier` session waits
//!     on a worker until it read that session's marker (the log-marker
//!     hold).
//!   - `log-then-broadcast`, `barrier-then-broadcast`: the same alternation
//!     with `broadcast`; a worker takes a `broadcast` session's commands
//!     from the sequencer's stream and the other session's from its channel
//!     (or the log), in any interleaving of the two, as the replica's
//!     worker does (`order/`: each command by its strategy's source).
//!
//!   The machine reconciles `naive` per worker ([`lockstep_reconcile::local`])
//!   and every other strategy collectively, in a mesh round; `barrier`
//!   creates wait at rounds. A `Diverged` worker halts and the controller
//!   restarts the replica.
//! - **History check** (history check, optional, on top of naive): on
//!   Hello every process reports a digest of its history, and the controller
//!   sends the target only if [`lockstep_reconcile::history_check`] finds the
//!   reports in sync, restarting the replica otherwise. With the *compacted*
//!   history (what `lockstep_protocol::CommandHistory::digest` hashes) it
//!   misses a dataflow that one process built and dropped and another never
//!   built: both compacted histories are empty, but their timely counters
//!   differ. A digest of everything the process did catches it.
//! - **Mesh**: the replica's timely mesh, reliable and ordered per sender
//!   while the replica lives. Each worker has its own queue of records not yet
//!   read (a join, a round announcement with its report), fed by every peer
//!   and read into that worker's machine when it decides a round, any
//!   number of them ([`ComputeAction::Decide`]): a slow worker may read a
//!   peer's reconciliation report and that peer's next create before it
//!   decides, or decide after the first. A worker's own records reach its
//!   machine at once.
//!
//! # Properties
//!
//! - **I1**: at every state every worker's creation log is a prefix of the
//!   longest ([`lockstep_reconcile::lockstep_prefix_check`]), and once the
//!   replica is quiet all logs are equal ([`lockstep_reconcile::lockstep_check`]).
//! - **I4**: once quiet, every worker runs the same dataflows, built at the
//!   same timely index.
//! - **I2** (liveness): from every reachable state, the target (quiet, I1,
//!   every worker running exactly the catalog) is reachable with no further
//!   fault and no new user command. Checked exactly, by a search over the
//!   fault-free successors of each state.
//!
//! "Quiet": the controller is up, no message is in flight, every worker has
//! joined the controller's session, reconciled, has no barrier round pending
//! and nothing queued, has applied the whole stream (broadcast, log) and is
//! not halted.
//!
//! Under a pair one more: **no worker loses lockstep** (no
//! `LOCKSTEP_LOST` halt of a session machine). A cut-off log session is cut
//! at the same entry on every worker, so no reconciliation finds creation
//! logs that differ; without the hold one does, and the replica is
//! restarted (the replica hung before the creation logs were compared).

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex};

use lockstep_protocol::Strategy;
use lockstep_reconcile::{DataflowKey, DeliveryMutant, GateMutant, LogHoldMutant, RoundMutant};

mod model;
mod properties;
mod state;
mod steps;
mod trace;

pub use state::{
    Cmd, CmdKind, ComputeAction, ComputeState, Controller, Msg, Worker, MAX_DATAFLOWS,
};

/// How many times the controller restarts a halted replica in one run of
/// the model (a flaw that halts after every restart would otherwise make the
/// state space infinite).
pub const MAX_REPLICA_RESTARTS: usize = 3;

/// The bounds of one check of the compute model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ComputeBounds {
    /// Replica processes (one worker each).
    pub processes: usize,
    /// Dataflows in the pool the controller creates and drops from (named A, B, ...).
    pub dataflows: usize,
    /// User commands (create or drop) the controller issues in total.
    pub commands: usize,
    /// Faults in total: controller crashes, dropped connections and process
    /// crashes.
    pub faults: usize,
}

impl fmt::Display for ComputeBounds {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} processes x 1 worker, {} dataflows, {} commands, {} faults (controller crash, dropped connection or process crash)",
            self.processes, self.dataflows, self.commands, self.faults
        )
    }
}

/// The history check on top of the naive strategy: on Hello every process
/// reports a digest of its history; the controller sends the target only if
/// [`lockstep_reconcile::history_check`] finds the processes in sync with each
/// other, and restarts the replica otherwise.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HistoryCheck {
    /// No history check (plain naive).
    Off,
    /// The digest of the *compacted* history (what
    /// `lockstep_protocol::CommandHistory::digest` hashes: a dropped dataflow
    /// vanishes).
    Compacted,
    /// A digest of everything the process did (its creation log and what it
    /// runs).
    Full,
    /// The same digest, and on a mismatch the policy answers
    /// `ReconcileCollectively` instead of restarting the replica: the
    /// controller's machine sends the naive session's InitializationComplete
    /// with `barrier` (`ControllerSession::completion_strategy`), and the
    /// workers reconcile in one round.
    FullCollective,
}

/// The compute-protocol model for one strategy.
#[derive(Clone, Debug)]
pub struct ComputeModel {
    /// The strategy under check (of every session, or of the odd ones when
    /// sessions alternate, see [`ComputeModel::then`]).
    pub strategy: Strategy,
    /// The strategy of every even session (a pair): sessions
    /// alternate between [`ComputeModel::strategy`] (the first session's)
    /// and this one, as when a restarted controller or a changed policy
    /// starts the next session with another strategy. `None`: every
    /// session uses `strategy`.
    pub then: Option<Strategy>,
    /// A flaw planted in every worker's log-marker hold
    /// (`mutant-no-log-hold`); [`LogHoldMutant::None`] otherwise.
    pub hold_mutant: LogHoldMutant,
    /// A flaw planted in the controller's delivery decisions
    /// (`mutant-no-session-marker`); [`DeliveryMutant::None`] otherwise.
    pub delivery_mutant: DeliveryMutant,
    /// A flaw planted in every worker's round book (`mutant-*` variants,
    /// the model's own tests); [`RoundMutant::None`] otherwise.
    pub mutant: RoundMutant,
    /// A flaw planted in the controller's history check.
    pub gate_mutant: GateMutant,
    /// The history check on reconnect (naive only).
    pub history: HistoryCheck,
    /// Its bounds.
    pub bounds: ComputeBounds,
    pool: Vec<DataflowKey>,
    /// Liveness answers already known, by state fingerprint (64 bits, as
    /// stateright's own), shared by the clones the checker makes.
    reachable: Arc<Mutex<HashMap<u64, bool>>>,
}
