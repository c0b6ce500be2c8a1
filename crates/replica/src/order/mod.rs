//! Where a worker takes each strategy's commands from, and what gates them.
//!
//! The socket copies of every command always arrive, on every process; the
//! strategy a command carries ([`Order`]) decides which copy a worker applies,
//! and when. Each strategy's logic is in the module named after it:
//!
//! - [`naive`]: the socket copy, applied as it comes; per-worker
//!   reconciliation. The negative control.
//! - [`barrier`]: the socket copy; a CreateDataflow of a new dataflow waits
//!   at a barrier round on the control mesh. Its rounds also run the
//!   collective reconciliation of every strategy but `naive`.
//! - [`broadcast`]: the copy worker 0, the sequencer, forwards on the control
//!   mesh.
//! - [`log`]: the copy read from the replica's command log; the socket copy
//!   only makes the worker read the log now.
//!
//! Commands that arrive from the mesh or the log join the same queue as the
//! socket copies of `barrier` and `naive` commands; the queue applies in
//! order, and a pending barrier round blocks it (`WorkerState::drive`).

pub mod barrier;
pub mod broadcast;
pub mod log;
pub mod naive;

use lockstep_protocol::{Command, CommandKind, Digest, Strategy};
use timely::worker::Worker;

use crate::render::validate;
use crate::worker::WorkerState;

/// The reconciliation target a buffered session start asks for: every
/// dataflow its creates name, in the order they come.
pub(crate) fn target_of(buffer: &[Command]) -> Vec<lockstep_reconcile::DataflowKey> {
    buffer
        .iter()
        .filter_map(|c| match &c.kind {
            CommandKind::CreateDataflow(d) => Some(lockstep_reconcile::DataflowKey {
                id: d.id,
                hash: d.hash(),
            }),
            _ => None,
        })
        .collect()
}

/// Where a worker takes a strategy's commands from, and what gates them.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Order {
    /// `naive`: the worker's own socket copy, in socket order, ungated.
    /// InitializationComplete reconciles per worker.
    Naive,
    /// `barrier`: the worker's own socket copy, in socket order; a
    /// CreateDataflow of a new, valid dataflow waits at a barrier round.
    Barrier,
    /// `broadcast`: worker 0's socket copy, forwarded on the control mesh,
    /// in the order the mesh delivers it; other socket copies are not
    /// applied.
    Broadcast,
    /// `log`: the command log, read from the offset worker 0 announced; the
    /// socket copy only makes the worker read the log now.
    Log,
}

impl Order {
    /// The order of the commands sent with `strategy`.
    pub fn of(strategy: Strategy) -> Order {
        match strategy {
            Strategy::Naive => Order::Naive,
            Strategy::Barrier => Order::Barrier,
            Strategy::Broadcast => Order::Broadcast,
            Strategy::Log => Order::Log,
        }
    }

    /// Whether a CreateDataflow of a new, valid dataflow waits at a barrier
    /// round before it builds.
    pub fn creates_in_rounds(self) -> bool {
        self == Order::Barrier
    }

    /// Whether an InitializationComplete of this order starts a collective
    /// reconciliation (on a worker with a control mesh); otherwise the
    /// worker reconciles alone.
    pub fn reconciles_collectively(self) -> bool {
        self != Order::Naive
    }
}

impl WorkerState {
    /// Takes one command from this process's controller connection. Commands
    /// of the socket-ordered strategies (barrier, naive) are queued; a
    /// broadcast command is forwarded to the mesh by the sequencer (worker 0)
    /// and otherwise only acknowledged; a log command makes the worker read
    /// the log now.
    pub fn admit(&mut self, cmd: Command) {
        match Order::of(cmd.strategy) {
            Order::Naive | Order::Barrier => self.queue.push_back(cmd),
            Order::Broadcast => self.forward_broadcast(cmd),
            Order::Log => self.poke_log(&cmd),
        }
    }

    /// The gate of a command taken from the queue: the description hash to
    /// announce if it waits at a barrier round (a CreateDataflow sent with
    /// `barrier` of a new, valid dataflow, on a worker with a control mesh),
    /// `None` if it applies now.
    pub(crate) fn round_gate(&self, cmd: &Command) -> Option<Digest> {
        let CommandKind::CreateDataflow(desc) = &cmd.kind else {
            return None;
        };
        let new = !self.dataflows.contains_key(&desc.id);
        (Order::of(cmd.strategy).creates_in_rounds()
            && self.mesh.is_some()
            && new
            && validate(desc).is_ok())
        .then(|| desc.hash())
    }

    /// Ends a reconciliation, alone or collective (`how`): drops `drops`,
    /// starts the applied history afresh, then applies the buffered session
    /// start, whose creates build what is missing in target order.
    pub(crate) fn finish_reconcile(
        &mut self,
        worker: &mut Worker,
        drops: Vec<u64>,
        buffer: Vec<Command>,
        how: &'static str,
    ) {
        for id in drops {
            tracing::info!(
                worker = self.index,
                dataflow = id,
                how,
                "reconciliation drops dataflow"
            );
            self.drop_dataflow(worker, id);
        }
        self.history = lockstep_protocol::CommandHistory::summarizing();
        for cmd in buffer {
            self.apply(worker, cmd);
        }
    }

    /// Reconciles at InitializationComplete (sent with `strategy`, sequence
    /// number `seqno`), given the buffered commands of the session so far,
    /// that InitializationComplete last: alone under `naive` or without a
    /// control mesh, otherwise collectively.
    pub(crate) fn reconcile(
        &mut self,
        worker: &mut Worker,
        buffer: Vec<Command>,
        strategy: Strategy,
        seqno: u64,
    ) {
        if Order::of(strategy).reconciles_collectively() && self.mesh.is_some() {
            self.start_collective(buffer, seqno);
        } else {
            self.reconcile_locally(worker, buffer);
        }
    }
}
