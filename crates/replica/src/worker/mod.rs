//! What one timely worker does with the commands its process hands it.
//!
//! Every worker of every process receives the same command stream and applies
//! it in the same order, so every worker builds the same dataflows in the same
//! order (invariant I1). Each worker keeps:
//!
//! - the input collections' updates *it* introduced (each WriteInput update is
//!   introduced on exactly one worker of the replica, chosen by a hash of the
//!   row, see [`owner`]), so that a dataflow built later replays them;
//! - its installed dataflows: input sessions, and per export an arrangement
//!   (for peeks), a tap after the arrangement (for subscribes) and a probe
//!   (for frontiers);
//! - its dataflow-creation log (timely index, dataflow ID, description hash);
//! - the history of what it applied, whose digest it reports in Status.
//!
//! A Hello with a new nonce starts reconciliation: commands are buffered until
//! InitializationComplete, then the worker keeps the installed dataflows the
//! controller asked for again (same ID and description hash), drops the
//! others, and builds the missing ones in the controller's order: alone under
//! `naive` ([`crate::order::naive`]), together with every other worker under
//! the other strategies ([`crate::order::barrier`]).
//!
//! A session is one controller connection attempt (epoch, then the Hello's
//! nonce, which increases per attempt within an epoch). The model checker
//! (crates/model) runs the same `lockstep_reconcile` functions.
//!
//! Which copy of a command a worker applies, and what the command waits for,
//! is decided by its strategy: see [`crate::order`], one module per strategy.
//! The worker itself is split into:
//!
//! - this module: [`WorkerState`], the start of a session on Hello, the drive
//!   loop ([`WorkerState::drive`], [`WorkerState::handle`]), the one place
//!   that halts, and [`run_worker`];
//! - `mesh`: the control mesh ([`Mesh`], [`MeshRecord`], [`MeshMessage`]) and
//!   what a worker does with what it delivers;
//! - `apply`: applying one command (builds, drops, compaction, inputs);
//! - `maintain`: reporting frontiers, answering peeks, emitting subscribes.

mod apply;
mod maintain;
mod mesh;

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::rc::Rc;
use std::sync::mpsc::{Receiver, TryRecvError};
use std::time::Duration;

use differential_dataflow::input::InputSession;
use differential_dataflow::operators::arrange::TraceAgent;
use differential_dataflow::trace::implementations::KeySpine;
use lockstep_command_log::SqliteLog;
use lockstep_protocol::{
    Command, CommandHistory, CommandKind, CreationLogEntry, DataflowDescription, Digest, ErrorKind,
    ErrorResponse, Frontier, Peek, PeekResult, Row, Status, Subscribe, SubscribeBatch, Update,
};
use lockstep_reconcile::RoundBook;
use timely::dataflow::ProbeHandle;
use timely::worker::Worker;
use tokio::sync::mpsc::UnboundedSender;

use crate::order::barrier::Pending;
use crate::order::log::LogTail;

pub use crate::order::barrier::BARRIER_TIMEOUT;
pub use crate::order::log::LOG_POLL;
pub use apply::owner;
pub use mesh::{Mesh, MeshMessage, MeshRecord};

/// What a worker reports to its process's aggregator.
#[derive(Debug)]
pub enum FromWorker {
    /// A collection's frontier on this worker changed.
    Frontier {
        /// Global worker index.
        worker: usize,
        /// The collection.
        collection: u64,
        /// Its new upper.
        upper: Frontier,
    },
    /// This worker's share of a peek.
    Peek {
        /// Global worker index.
        worker: usize,
        /// The peek.
        peek_id: u64,
        /// Its rows, error or cancellation.
        result: PeekResult,
    },
    /// This worker's changes of a subscription.
    Subscribe {
        /// Global worker index.
        worker: usize,
        /// The batch.
        batch: SubscribeBatch,
    },
    /// A worker's Status.
    Status(Status),
    /// An error about a command (sent by the first local worker only).
    Error(ErrorResponse),
    /// The worker accepted a Hello of a new session: forget per-session state.
    NewSession {
        /// Global worker index.
        worker: usize,
        /// The new session (see [`session_of`]).
        session: Session,
    },
}

type Trace = TraceAgent<KeySpine<Row, u64, i64>>;

/// The updates an export emitted that subscribers may still need.
#[derive(Default)]
struct Tap {
    /// Updates at or beyond the last trim point (all subscribers start there or later).
    recent: Vec<Update>,
    /// Per subscription: updates not yet emitted.
    subs: BTreeMap<u64, Vec<Update>>,
}

struct ExportState {
    trace: Trace,
    probe: ProbeHandle<u64>,
    tap: Rc<RefCell<Tap>>,
    since: u64,
    reported: Option<Frontier>,
}

/// An installed dataflow.
pub(crate) struct Installed {
    desc: DataflowDescription,
    pub(crate) hash: Digest,
    pub(crate) timely_index: usize,
    sessions: Vec<(u64, InputSession<u64, Row, i64>)>,
    exports: BTreeMap<u64, ExportState>,
}

/// The updates of one input collection this worker introduces (the rows it
/// owns), consolidated whenever they doubled since the last time; dataflows
/// built later read them from here.
#[derive(Default)]
struct InputStore {
    updates: Vec<Update>,
    consolidated: usize,
    upper: u64,
}

impl InputStore {
    /// Advances every update below `since` to `since` and consolidates.
    fn compact(&mut self, since: u64) {
        if self.updates.iter().any(|u| u.time < since) {
            for u in &mut self.updates {
                u.time = u.time.max(since);
            }
            self.updates =
                lockstep_protocol::history::consolidate(std::mem::take(&mut self.updates));
            self.consolidated = self.updates.len();
        }
    }

    fn extend(&mut self, fresh: impl IntoIterator<Item = Update>) {
        self.updates.extend(fresh);
        if self.updates.len() > 2 * self.consolidated + 1024 {
            self.updates =
                lockstep_protocol::history::consolidate(std::mem::take(&mut self.updates));
            self.consolidated = self.updates.len();
        }
    }
}

struct SubState {
    sub: Subscribe,
    /// `None` until the snapshot was emitted; then the next lower bound.
    lower: Option<Frontier>,
}

pub use lockstep_reconcile::{session_of, Session};

/// One worker's state.
pub struct WorkerState {
    pub(crate) index: usize,
    peers: usize,
    reports_errors: bool,
    epoch: u64,
    nonce: u64,
    applied_seqno: u64,
    pub(crate) history: CommandHistory,
    reconciling: Option<Vec<Command>>,
    inputs: BTreeMap<u64, InputStore>,
    /// Parts of a write split by the controller, held until its last part
    /// arrives (forgotten when a new session starts: it resends them).
    write_parts: BTreeMap<u64, Vec<Update>>,
    pub(crate) dataflows: BTreeMap<u64, Installed>,
    collections: BTreeMap<u64, u64>,
    pub(crate) creation_log: Vec<CreationLogEntry>,
    peeks: Vec<Peek>,
    subs: BTreeMap<u64, SubState>,
    tx: UnboundedSender<FromWorker>,
    pub(crate) mesh: Option<Mesh>,
    pub(crate) session: Session,
    /// The session of the last command-log marker taken from the queue.
    log_marker: Session,
    /// What the mesh said about barrier rounds (shared with the model).
    pub(crate) rounds: RoundBook,
    pub(crate) queue: VecDeque<Command>,
    pub(crate) pending: Option<Pending>,
    pub(crate) log: Option<LogTail>,
}

impl WorkerState {
    /// A worker with global index `index` of `peers`; `reports_errors` for the
    /// first worker of each process, which alone reports command errors.
    pub fn new(
        index: usize,
        peers: usize,
        reports_errors: bool,
        tx: UnboundedSender<FromWorker>,
    ) -> Self {
        WorkerState {
            index,
            peers,
            reports_errors,
            epoch: 0,
            nonce: 0,
            applied_seqno: 0,
            history: CommandHistory::summarizing(),
            reconciling: None,
            inputs: BTreeMap::new(),
            write_parts: BTreeMap::new(),
            dataflows: BTreeMap::new(),
            collections: BTreeMap::new(),
            creation_log: Vec::new(),
            peeks: Vec::new(),
            subs: BTreeMap::new(),
            tx,
            mesh: None,
            session: 0,
            log_marker: 0,
            rounds: RoundBook::new(peers),
            queue: VecDeque::new(),
            pending: None,
            log: None,
        }
    }

    fn send(&self, msg: FromWorker) {
        // The aggregator is gone only when the process shuts down.
        let _ = self.tx.send(msg);
    }

    pub(crate) fn error(&self, seqno: u64, kind: ErrorKind, message: String) {
        tracing::warn!(worker = self.index, seqno, %message, "command error");
        if self.reports_errors {
            self.send(FromWorker::Error(ErrorResponse {
                kind,
                message,
                seqno,
            }));
        }
    }

    /// This worker's Status; the history digest costs time proportional to
    /// the history, so it is computed only when asked for.
    pub fn status(&self, full: bool) -> Status {
        Status {
            worker_index: self.index as u32,
            epoch: self.epoch,
            nonce: self.nonce,
            applied_seqno: self.applied_seqno,
            history_hash: full.then(|| self.history.digest()),
            creation_log: if full {
                self.creation_log.clone()
            } else {
                Vec::new()
            },
            installed: self.dataflows.keys().copied().collect(),
        }
    }

    /// Handles one command, in the order its strategy defines.
    pub fn handle(&mut self, worker: &mut Worker, cmd: Command) {
        if let CommandKind::Hello(h) = &cmd.kind {
            self.epoch = h.epoch;
            let session = session_of(h.epoch, h.nonce);
            if session > self.session {
                self.session = session;
                self.rounds.start_session(session);
                if let Some(mesh) = &mut self.mesh {
                    mesh.send(self.index, MeshMessage::Joined { session });
                }
                self.nonce = h.nonce;
                self.reconciling = Some(Vec::new());
                self.peeks.clear();
                self.subs.clear();
                self.write_parts.clear();
                for inst in self.dataflows.values_mut() {
                    for e in inst.exports.values_mut() {
                        e.reported = None;
                        e.tap.borrow_mut().subs.clear();
                    }
                }
                self.send(FromWorker::NewSession {
                    worker: self.index,
                    session,
                });
            }
            self.applied_seqno = 0;
            self.send(FromWorker::Status(self.status(true)));
            return;
        }
        if let Some(buffer) = &mut self.reconciling {
            let done = matches!(cmd.kind, CommandKind::InitializationComplete);
            let strategy = cmd.strategy;
            let seqno = cmd.seqno;
            buffer.push(cmd);
            if done {
                let buffer = self.reconciling.take().unwrap_or_default();
                self.reconcile(worker, buffer, strategy, seqno);
            }
            return;
        }
        if let Some(hash) = self.round_gate(&cmd) {
            self.start_create_round(cmd, hash);
            return;
        }
        self.apply(worker, cmd);
    }

    /// Applies queued commands until one waits at a barrier. Returns whether
    /// anything happened.
    pub fn drive(&mut self, worker: &mut Worker) -> bool {
        let mut progressed = false;
        loop {
            self.absorb_mesh();
            if self.read_log() {
                progressed = true;
            }
            if let Some(p) = self.pending.take() {
                match self.resolve(worker, p) {
                    Some(p) => {
                        self.pending = Some(p);
                        return progressed;
                    }
                    None => progressed = true,
                }
            }
            let Some(cmd) = self.queue.pop_front() else {
                return progressed;
            };
            progressed = true;
            // Command-log entries belong to the session of the marker before
            // them; those of a session older than the one this worker joined
            // since (a log session cut off, then a barrier one) are stale.
            if cmd.strategy == lockstep_protocol::Strategy::Log {
                match &cmd.kind {
                    CommandKind::Hello(h) => self.log_marker = session_of(h.epoch, h.nonce),
                    _ if self.log_marker < self.session => {
                        tracing::debug!(
                            worker = self.index,
                            seqno = cmd.seqno,
                            "skipping a command-log entry of an older session"
                        );
                        continue;
                    }
                    _ => {}
                }
            }
            self.handle(worker, cmd);
        }
    }

    /// Stops the process: it cannot prove it is in lockstep (I4). The
    /// orchestrator restarts it and the controller reconnects.
    pub(crate) fn halt(&self, reason: String) {
        tracing::error!(worker = self.index, %reason, "halting: lockstep lost");
        self.send(FromWorker::Error(ErrorResponse {
            kind: ErrorKind::LockstepLost,
            message: reason.clone(),
            seqno: 0,
        }));
        std::thread::sleep(Duration::from_millis(100));
        eprintln!("lockstep-replica: halting: lockstep lost: {reason}");
        std::process::exit(71);
    }

    /// The IDs of installed dataflows.
    pub fn installed(&self) -> BTreeSet<u64> {
        self.dataflows.keys().copied().collect()
    }

    /// Drops every dataflow, so that the worker can shut down.
    pub fn shutdown(&mut self, worker: &mut Worker) {
        let ids: Vec<u64> = self.dataflows.keys().copied().collect();
        for id in ids {
            self.drop_dataflow(worker, id);
        }
    }
}

/// The worker loop: apply commands as they come, step the dataflows, report.
/// Returns when the command channel closes.
pub fn run_worker(
    worker: &mut Worker,
    commands: Receiver<Command>,
    tx: UnboundedSender<FromWorker>,
    workers_per_process: usize,
    log: Option<SqliteLog>,
) {
    let index = worker.index();
    let mut state = WorkerState::new(
        index,
        worker.peers(),
        index.is_multiple_of(workers_per_process),
        tx,
    );
    // The control mesh is every worker's first dataflow.
    state.mesh = Some(Mesh::build(worker));
    if let Some(log) = log {
        state.tail_log(log);
    }
    loop {
        let mut handled = false;
        loop {
            match commands.try_recv() {
                Ok(cmd) => {
                    handled = true;
                    state.admit(cmd);
                }
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    state.shutdown(worker);
                    return;
                }
            }
        }
        let waiting = state.pending.is_some();
        if state.drive(worker) {
            handled = true;
        }
        if handled {
            // Answer what is ready now (a peek at a passed time, say), then
            // step without parking.
            state.maintain();
            worker.step();
        } else if waiting {
            // A barrier waits on the mesh: park briefly; mesh data arriving
            // from other workers unparks this thread.
            worker.step_or_park(Some(Duration::from_micros(500)));
        } else {
            // Commands unpark this thread (see `server::Workers::send`), as
            // do timely's channels; the timeout bounds everything else.
            let park = if state.log.is_some() {
                LOG_POLL
            } else {
                Duration::from_millis(5)
            };
            worker.step_or_park(Some(park));
        }
        state.maintain();
    }
}
