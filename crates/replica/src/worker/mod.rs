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
//! What happens to each command, and when, is decided by the worker's
//! session machine, [`lockstep_reconcile::WorkerSession`], a sans-IO state
//! machine the model checker (crates/model) drives too: a Hello with a new
//! nonce starts a session, the session start is buffered until
//! InitializationComplete and then reconciled (alone under `naive`, together
//! with every other worker otherwise), a create of a new dataflow under
//! `barrier` waits at a barrier round. This worker is its shell: it feeds the
//! machine the commands in its order and the mesh's records, and performs the
//! [`lockstep_reconcile::Action`]s it hands out.
//!
//! A session is one controller connection attempt (epoch, then the Hello's
//! nonce, which increases per attempt within an epoch).
//!
//! Which copy of a command a worker takes (its socket, the sequencer on the
//! mesh, the command log) is decided by its strategy: see [`crate::order`].
//! The worker itself is split into:
//!
//! - this module: [`WorkerState`], the drive loop ([`WorkerState::drive`])
//!   that performs the machine's actions, the one place that halts, and
//!   [`run_worker`];
//! - `mesh`: the control mesh ([`Mesh`], [`MeshRecord`], [`MeshMessage`]) and
//!   what a worker does with what it delivers;
//! - `apply`: applying one command (builds, drops, compaction, inputs);
//! - `maintain`: reporting frontiers, answering peeks, emitting subscribes.

mod apply;
mod maintain;
mod mesh;

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};
use std::rc::Rc;
use std::sync::mpsc::{Receiver, TryRecvError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use differential_dataflow::input::InputSession;
use differential_dataflow::operators::arrange::TraceAgent;
use differential_dataflow::trace::implementations::KeySpine;
use lockstep_command_log::AnyLog;
use lockstep_protocol::{
    Command, CommandHistory, CommandKind, CreationLogEntry, DataflowDescription, Digest, ErrorKind,
    ErrorResponse, Frontier, Peek, PeekResult, Row, Status, Subscribe, SubscribeBatch, Update,
};
use lockstep_reconcile::{Action, DataflowKey, WorkerSession, WorkerView};
use timely::dataflow::ProbeHandle;
use timely::worker::Worker;
use tokio::sync::mpsc::UnboundedSender;

use crate::family::{prepare, Family};
use crate::metrics::{ReplicaMetrics, WorkerLabel, METRICS};
use crate::order::log::LogReader;

pub use crate::order::log::LOG_POLL;

/// The longest a worker waits at a barrier round before it halts.
pub const BARRIER_TIMEOUT: Duration =
    Duration::from_millis(lockstep_reconcile::worker::BARRIER_TIMEOUT_MS);
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

type Trace = TraceAgent<KeySpine<ArrangedRow, u64, i64>>;

/// A row as an export's arrangement holds it: its bytes, ordered as the
/// control plane consolidates rows ([`lockstep_protocol::history::row_order`]:
/// by their values as varints, then by their bytes). Rows of the built-in
/// family (integers as varints) then sort in numeric order, so the integer
/// rows a writer sends in order reach the arrangement's batcher as one sorted
/// run, as they did when rows were integer vectors; in byte order they do
/// not (128 encodes as `80 01`, after 2's `02`), and sorting them again cost
/// a million-row ingest about a tenth of its time.
#[derive(Clone, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(transparent)]
pub(crate) struct ArrangedRow(pub(crate) Row);

impl Ord for ArrangedRow {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        lockstep_protocol::history::row_order(&self.0, &other.0)
    }
}

impl PartialOrd for ArrangedRow {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

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
    /// The frontier lag last set in the metrics (set again only when it
    /// changes: `maintain` runs on every loop).
    lag: Option<u64>,
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
/// owns), kept as the batches they came in and consolidated only once a
/// retraction could cancel some and they doubled (an
/// [`InputLog`](lockstep_protocol::history::InputLog) without its digest);
/// dataflows built later read them from here, and its upper is the
/// collection's as this worker introduced it.
type InputStore = lockstep_protocol::history::InputLog;

struct SubState {
    sub: Subscribe,
    /// `None` until the snapshot was emitted; then the next lower bound.
    lower: Option<Frontier>,
}

pub use lockstep_reconcile::{session_of, Session};

/// One worker's state: the dataflows, inputs and answers it keeps, around
/// its session machine ([`WorkerSession`]), which decides what happens to
/// each command and when.
pub struct WorkerState {
    /// What it builds dataflows with.
    family: Arc<dyn Family>,
    pub(crate) index: usize,
    peers: usize,
    reports_errors: bool,
    epoch: u64,
    nonce: u64,
    applied_seqno: u64,
    pub(crate) history: CommandHistory,
    inputs: BTreeMap<u64, InputStore>,
    /// Parts of a write split by the controller, held until its last part
    /// arrives (forgotten when a new session starts: it resends them).
    write_parts: BTreeMap<u64, Vec<Update>>,
    /// Between a reconciliation's end and the session start's
    /// InitializationComplete: the collections whose write in the replayed
    /// history was applied. A collection's first write there is the whole
    /// collection (the controller's consolidated history), not only what
    /// came after the last write (see `apply::whole_write`); writes the
    /// controller sent after its replay (before InitializationComplete) are
    /// ordinary ones.
    replaying_start: Option<std::collections::BTreeSet<u64>>,
    pub(crate) dataflows: BTreeMap<u64, Installed>,
    /// The installed dataflows whose export frontiers may still move: built
    /// or written to since their frontiers last reached their inputs'
    /// uppers, or not reported in this session yet. Only these are read by
    /// `maintain`, so that a worker's loop costs O(dataflows in motion),
    /// not O(dataflows installed).
    unsettled: BTreeSet<u64>,
    collections: BTreeMap<u64, u64>,
    pub(crate) creation_log: Vec<CreationLogEntry>,
    peeks: Vec<Peek>,
    subs: BTreeMap<u64, SubState>,
    tx: UnboundedSender<FromWorker>,
    pub(crate) mesh: Option<Mesh>,
    /// The session machine: sessions, reconciliation, barrier rounds, the
    /// queue of commands in this worker's order.
    pub(crate) machine: WorkerSession<Command>,
    /// The machine's clock.
    started: Instant,
    pub(crate) log: Option<LogReader>,
}

/// What a worker runs, as its session machine sees it.
struct View<'a> {
    family: &'a dyn Family,
    dataflows: &'a BTreeMap<u64, Installed>,
    creation_log: &'a [CreationLogEntry],
}

impl WorkerView<Command> for View<'_> {
    fn is_installed(&self, id: u64) -> bool {
        self.dataflows.contains_key(&id)
    }

    fn installed(&self) -> Vec<DataflowKey> {
        // In creation order, so that plans keep that order.
        self.creation_log
            .iter()
            .filter_map(|e| {
                let inst = self.dataflows.get(&e.dataflow_id)?;
                (inst.timely_index as u64 == e.timely_index).then_some(DataflowKey {
                    id: e.dataflow_id,
                    hash: inst.hash,
                })
            })
            .collect()
    }

    fn buildable(&self, cmd: &Command) -> bool {
        matches!(&cmd.kind, CommandKind::CreateDataflow(d) if prepare(self.family, d).is_ok())
    }

    fn creation_digest(&self) -> Digest {
        let mut h = blake3::Hasher::new();
        for e in self.creation_log {
            h.update(&e.timely_index.to_le_bytes());
            h.update(&e.dataflow_id.to_le_bytes());
            h.update(&e.description_hash.0);
        }
        Digest(*h.finalize().as_bytes())
    }
}

impl WorkerState {
    /// A worker with global index `index` of `peers`; `reports_errors` for the
    /// first worker of each process, which alone reports command errors;
    /// `mesh` its control mesh, the first dataflow of every worker (without
    /// one, every reconciliation is per worker and no create waits at a
    /// barrier round); `family` what it builds dataflows with.
    pub fn new(
        index: usize,
        peers: usize,
        reports_errors: bool,
        tx: UnboundedSender<FromWorker>,
        mesh: Option<Mesh>,
        family: Arc<dyn Family>,
    ) -> Self {
        WorkerState {
            family,
            index,
            peers,
            reports_errors,
            epoch: 0,
            nonce: 0,
            applied_seqno: 0,
            history: CommandHistory::summarizing(),
            inputs: BTreeMap::new(),
            write_parts: BTreeMap::new(),
            replaying_start: None,
            dataflows: BTreeMap::new(),
            unsettled: BTreeSet::new(),
            collections: BTreeMap::new(),
            creation_log: Vec::new(),
            peeks: Vec::new(),
            subs: BTreeMap::new(),
            tx,
            machine: WorkerSession::new(index, peers, mesh.is_some()),
            mesh,
            started: Instant::now(),
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

    /// The machine's clock: milliseconds since the worker started.
    pub(crate) fn now_ms(&self) -> u64 {
        u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Performs one action of the session machine.
    fn perform(&mut self, worker: &mut Worker, action: Action<Command>) {
        match action {
            Action::Announce(a) => {
                if let Some(mesh) = &mut self.mesh {
                    mesh.send(self.index, MeshMessage::from(a));
                }
            }
            Action::Hello { cmd, started } => {
                let CommandKind::Hello(h) = &cmd.kind else {
                    return;
                };
                self.epoch = h.epoch;
                if let Some(session) = started {
                    self.nonce = h.nonce;
                    self.peeks.clear();
                    self.subs.clear();
                    self.write_parts.clear();
                    for inst in self.dataflows.values_mut() {
                        for e in inst.exports.values_mut() {
                            e.reported = None;
                            e.tap.borrow_mut().subs.clear();
                        }
                    }
                    // Every frontier is reported again in the new session.
                    self.unsettled.extend(self.dataflows.keys().copied());
                    self.send(FromWorker::NewSession {
                        worker: self.index,
                        session,
                    });
                }
                self.applied_seqno = 0;
                METRICS.applied(cmd.kind.name(), cmd.strategy.name());
                self.send(FromWorker::Status(self.status(true)));
            }
            Action::Drop { id, how } => {
                tracing::info!(
                    worker = self.index,
                    dataflow = id,
                    ?how,
                    "reconciliation drops dataflow"
                );
                self.drop_dataflow(worker, id);
                self.count_installed();
            }
            Action::ResetHistory => {
                self.history = CommandHistory::summarizing();
                self.replaying_start = Some(Default::default());
            }
            Action::Apply(cmd) => {
                METRICS.applied(cmd.kind.name(), cmd.strategy.name());
                let installed = self.dataflows.len();
                self.apply(worker, cmd);
                if self.dataflows.len() != installed {
                    self.count_installed();
                }
            }
            Action::Skipped { seqno } => tracing::debug!(
                worker = self.index,
                seqno,
                "skipping a command-log entry of an older session"
            ),
            Action::Halt(reason) => self.halt(reason),
        }
    }

    /// Sets this worker's installed-dataflows gauge.
    fn count_installed(&self) {
        METRICS
            .dataflows_installed
            .get_or_create(&WorkerLabel {
                worker: self.index as u64,
            })
            .set(self.dataflows.len() as i64);
    }

    /// Performs what the session machine decides until it waits (nothing
    /// queued, or a barrier round pending). Returns whether anything
    /// happened.
    pub fn drive(&mut self, worker: &mut Worker) -> bool {
        let mut progressed = false;
        loop {
            self.absorb_mesh();
            if self.read_log() {
                progressed = true;
            }
            let now_ms = self.now_ms();
            let view = View {
                family: self.family.as_ref(),
                dataflows: &self.dataflows,
                creation_log: &self.creation_log,
            };
            let Some(action) = self.machine.next(&view, now_ms) else {
                return progressed;
            };
            progressed = true;
            self.perform(worker, action);
        }
    }

    /// Stops the process: it cannot prove it is in lockstep (I4). The
    /// orchestrator restarts it and the controller reconnects. The one
    /// place a worker halts.
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
    log: Option<AnyLog>,
    family: Arc<dyn Family>,
) {
    let index = worker.index();
    // The control mesh is every worker's first dataflow.
    let mesh = Mesh::build(worker);
    let mut state = WorkerState::new(
        index,
        worker.peers(),
        index.is_multiple_of(workers_per_process),
        tx,
        Some(mesh),
        family,
    );
    if let Some(log) = log {
        state.tail_log(log);
    }
    // When the current barrier round started, for its wait time.
    let mut round_started: Option<Instant> = None;
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
        let waiting = state.machine.pending().is_some();
        if state.drive(worker) {
            handled = true;
        }
        match (state.machine.pending().is_some(), round_started) {
            (true, None) => round_started = Some(Instant::now()),
            (false, Some(t)) => {
                ReplicaMetrics::observe(&METRICS.barrier_wait, t.elapsed());
                round_started = None;
            }
            _ => {}
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
            let park = state
                .log
                .as_ref()
                .map_or(Duration::from_millis(5), LogReader::park);
            worker.step_or_park(Some(park));
        }
        state.maintain();
    }
}
