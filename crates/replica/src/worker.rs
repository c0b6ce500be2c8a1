//! What one timely worker does with the commands its process hands it.
//!
//! Every worker of every process receives the same command stream and applies
//! it in the same order, so every worker builds the same dataflows in the same
//! order (invariant I1). Each worker keeps:
//!
//! - the input collections' updates *it* introduced (each WriteInput update is
//!   introduced on exactly one worker of the replica, chosen by a hash of the
//!   row), so that a dataflow built later replays them;
//! - its installed dataflows: input sessions, and per export an arrangement
//!   (for peeks), a tap after the arrangement (for subscribes) and a probe
//!   (for frontiers);
//! - its dataflow-creation log (timely index, dataflow ID, description hash);
//! - the history of what it applied, whose digest it reports in Status.
//!
//! A Hello with a new nonce starts reconciliation: commands are buffered until
//! InitializationComplete, then the worker keeps the installed dataflows the
//! controller asked for again (same ID and description hash), drops the
//! others, and builds the missing ones in the controller's order. This is the
//! per-worker reconciliation, used for commands sent with the `naive`
//! strategy: it is wrong as soon as workers disagree on what is installed,
//! which is what the fault suite shows.
//!
//! Under the `barrier` strategy:
//! - a CreateDataflow is a *round*: the worker announces (session, seqno,
//!   description hash) on the control mesh, a timely dataflow every worker
//!   builds first, at start-up, and waits (still stepping, still reading the
//!   mesh, but applying nothing else) until `lockstep_reconcile::barrier`
//!   says every worker announced the same (pass: build), that a worker moved
//!   on to a newer session without it (abandoned: build nowhere), or that the
//!   workers received different commands (diverged: halt, so the controller
//!   restarts the replica);
//! - reconciliation is collective: at InitializationComplete every worker
//!   announces its installed dataflows in one round, and every worker applies
//!   the same `lockstep_reconcile::collective` plan: keep what every worker
//!   has with the target's hash, drop the rest, build the missing ones in the
//!   target's order, together.
//!
//! A session is one controller connection attempt (epoch, then the Hello's
//! nonce, which increases per attempt within an epoch). The model checker
//! (crates/model) runs the same `lockstep_reconcile` functions.
//!
//! Under the `broadcast` strategy (the Materialize baseline) global worker 0
//! is the sequencer: it forwards each broadcast command it receives from its
//! controller connection onto the control mesh, and every worker applies
//! broadcast commands only in the order the mesh delivers them from worker 0;
//! the copies other workers receive from their own connections only wake
//! them. A Hello sent with `broadcast` is sequenced too, so a session starts
//! at the same point of the stream on every worker.
//!
//! Under the `log` strategy the controller appends every command to the
//! replica's command log (`lockstep_command_log`) before sending it; workers
//! apply log commands only as they read them from the log, from one start
//! offset that worker 0 chooses (the newest epoch marker) and announces on
//! the mesh, so every worker applies the same sequence. The socket copy only
//! makes the worker read the log at once (it also polls every
//! [`LOG_POLL`]).
//!
//! Broadcast and log sessions reconcile collectively, like barrier sessions:
//! earlier sessions may have used another strategy.

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::hash::{Hash, Hasher};
use std::rc::Rc;
use std::sync::mpsc::{Receiver, TryRecvError};
use std::time::Duration;

use differential_dataflow::input::InputSession;
use differential_dataflow::operators::arrange::TraceAgent;
use differential_dataflow::trace::cursor::{cursor_list, Cursor};
use differential_dataflow::trace::implementations::KeySpine;
use differential_dataflow::trace::TraceReader;
use lockstep_command_log::{CommandLog, SqliteLog};
use lockstep_protocol::history::consolidate;
use lockstep_protocol::{
    Command, CommandHistory, CommandKind, CreationLogEntry, DataflowDescription, Digest, ErrorKind,
    ErrorResponse, Frontier, Peek, PeekResult, Row, Status, Strategy, Subscribe, SubscribeBatch,
    Update, WireMessage, WriteInput,
};
use lockstep_reconcile::{Announcement, BarrierDecision, DataflowKey, RoundBook};
use serde_bytes::ByteBuf;
use timely::dataflow::operators::vec::Broadcast;
use timely::dataflow::operators::Inspect;
use timely::dataflow::{InputHandleVec, ProbeHandle};
use timely::progress::Antichain;
use timely::worker::Worker;
use tokio::sync::mpsc::UnboundedSender;

use crate::render::{render, validate, Coll};

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
        session: u64,
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

struct Installed {
    desc: DataflowDescription,
    hash: Digest,
    timely_index: usize,
    sessions: Vec<(u64, InputSession<u64, Row, i64>)>,
    exports: BTreeMap<u64, ExportState>,
}

#[derive(Default)]
struct InputStore {
    updates: Vec<Update>,
    upper: u64,
}

struct SubState {
    sub: Subscribe,
    /// `None` until the snapshot was emitted; then the next lower bound.
    lower: Option<Frontier>,
}

/// A record on the control mesh, from the worker `from`.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct MeshRecord {
    /// The sender's global worker index.
    pub from: u64,
    /// What it says.
    pub message: MeshMessage,
}

/// What a worker tells every worker over the control mesh.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub enum MeshMessage {
    /// The sender accepted the Hello of `session`.
    Joined {
        /// The session.
        session: u64,
    },
    /// The sender reached the barrier round `seqno` of `session`.
    Round {
        /// The session.
        session: u64,
        /// The round's command.
        seqno: u64,
        /// The command's hash (a reconciliation round: the target's hash).
        hash: [u8; 32],
        /// A reconciliation round: the sender's installed dataflows as (ID,
        /// description hash), in creation order. `None` for a create.
        report: Option<Vec<(u64, [u8; 32])>>,
    },
    /// A broadcast command from the sequencer (worker 0). The payload is a
    /// `ByteBuf`: bincode encodes a `Vec<u8>` byte by byte, which made 1 MiB
    /// broadcast commands 3x slower (see ../shared/notes/timely-differential.md).
    Command {
        /// Its sequence number.
        seqno: u64,
        /// The encoded command.
        bytes: ByteBuf,
    },
    /// Where every worker starts reading the command log (from worker 0).
    LogStart {
        /// The first offset to read.
        offset: u64,
    },
}

/// How often a worker reads the command log when nothing woke it.
pub const LOG_POLL: Duration = Duration::from_millis(2);

/// How many log entries a worker reads at once.
const LOG_BATCH: usize = 256;

/// A worker's position in the command log.
struct LogTail {
    log: SqliteLog,
    /// `None` until worker 0 announced the start offset on the mesh.
    next: Option<u64>,
    /// A socket copy of a log command arrived: read the log now.
    poked: bool,
    last_read: std::time::Instant,
}

/// The longest a worker waits at a barrier before it halts.
pub const BARRIER_TIMEOUT: Duration = Duration::from_secs(20);

/// The control mesh: a broadcast dataflow every worker builds first.
pub struct Mesh {
    input: InputHandleVec<u64, MeshRecord>,
    received: Rc<RefCell<Vec<MeshRecord>>>,
}

impl Mesh {
    /// Builds the mesh dataflow; must be the first dataflow of every worker.
    pub fn build(worker: &mut Worker) -> Mesh {
        let mut input = InputHandleVec::new();
        let received: Rc<RefCell<Vec<MeshRecord>>> = Rc::default();
        let sink = Rc::clone(&received);
        worker.dataflow_named::<u64, _, _>("lockstep-control-mesh", |scope| {
            input
                .to_stream(scope)
                .broadcast()
                .inspect(move |r: &MeshRecord| sink.borrow_mut().push(r.clone()));
        });
        Mesh { input, received }
    }

    fn send(&mut self, from: usize, message: MeshMessage) {
        self.input.send(MeshRecord {
            from: from as u64,
            message,
        });
        self.input.flush();
    }
}

/// The session of a Hello: epoch first, then the connection attempt.
pub fn session_of(epoch: u64, nonce: u64) -> u64 {
    (epoch << 32) | (nonce & 0xffff_ffff)
}

enum Pending {
    Create {
        cmd: Command,
        mine: Announcement,
        since: std::time::Instant,
    },
    Reconcile {
        buffer: Vec<Command>,
        target: Vec<DataflowKey>,
        mine: Announcement,
        since: std::time::Instant,
    },
}

/// An order-sensitive digest of a reconciliation target.
fn target_hash(target: &[DataflowKey]) -> Digest {
    let mut h = blake3::Hasher::new();
    h.update(&(target.len() as u64).to_le_bytes());
    for k in target {
        h.update(&k.id.to_le_bytes());
        h.update(&k.hash.0);
    }
    Digest(*h.finalize().as_bytes())
}

/// One worker's state.
pub struct WorkerState {
    index: usize,
    peers: usize,
    reports_errors: bool,
    epoch: u64,
    nonce: u64,
    applied_seqno: u64,
    history: CommandHistory,
    reconciling: Option<Vec<Command>>,
    inputs: BTreeMap<u64, InputStore>,
    dataflows: BTreeMap<u64, Installed>,
    collections: BTreeMap<u64, u64>,
    creation_log: Vec<CreationLogEntry>,
    peeks: Vec<Peek>,
    subs: BTreeMap<u64, SubState>,
    tx: UnboundedSender<FromWorker>,
    mesh: Option<Mesh>,
    session: u64,
    /// What the mesh said about barrier rounds (shared with the model).
    rounds: RoundBook,
    queue: VecDeque<Command>,
    pending: Option<Pending>,
    log: Option<LogTail>,
}

fn passed(upper: Frontier, t: u64) -> bool {
    upper.is_none_or(|u| u > t)
}

fn probe_frontier(probe: &ProbeHandle<u64>) -> Frontier {
    probe.with_frontier(|f| f.iter().min().copied())
}

/// The worker of the replica that introduces an update of `row`.
pub fn owner(row: &Row, peers: usize) -> usize {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    row.hash(&mut h);
    (h.finish() % peers as u64) as usize
}

/// Every (row, time, diff) in a trace.
fn read_trace(trace: &mut Trace) -> Vec<Update> {
    let Some(batches) = trace.batches_through(Antichain::new().borrow()) else {
        return Vec::new();
    };
    let (mut cursor, storage) = cursor_list(batches);
    let mut out = Vec::new();
    for ((row, ()), times) in cursor.to_vec(&storage, |k: &Row| k.clone(), |_v| ()) {
        for (time, diff) in times {
            out.push(Update {
                row: row.clone(),
                time,
                diff,
            });
        }
    }
    out
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
            history: CommandHistory::new(),
            reconciling: None,
            inputs: BTreeMap::new(),
            dataflows: BTreeMap::new(),
            collections: BTreeMap::new(),
            creation_log: Vec::new(),
            peeks: Vec::new(),
            subs: BTreeMap::new(),
            tx,
            mesh: None,
            session: 0,
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

    fn error(&self, seqno: u64, kind: ErrorKind, message: String) {
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

    /// Takes one command from this process's controller connection. Commands
    /// of the socket-ordered strategies (barrier, naive) are queued; a
    /// broadcast command is forwarded to the mesh by the sequencer (worker 0)
    /// and otherwise only acknowledged; a log command makes the worker read
    /// the log now.
    pub fn admit(&mut self, cmd: Command) {
        match cmd.strategy {
            Strategy::Barrier | Strategy::Naive => self.queue.push_back(cmd),
            Strategy::Broadcast => {
                if self.index == 0 {
                    let seqno = cmd.seqno;
                    let bytes = cmd.encode_to_vec();
                    if let Some(mesh) = &mut self.mesh {
                        mesh.send(
                            0,
                            MeshMessage::Command {
                                seqno,
                                bytes: ByteBuf::from(bytes),
                            },
                        );
                    } else {
                        self.error(
                            seqno,
                            ErrorKind::InvalidCommand,
                            "broadcast needs the control mesh".into(),
                        );
                    }
                }
            }
            Strategy::Log => match &mut self.log {
                Some(tail) => tail.poked = true,
                None => self.error(
                    cmd.seqno,
                    ErrorKind::InvalidCommand,
                    format!(
                        "{} was sent with the log strategy, but this replica was started without a command log (--command-log); not applied",
                        cmd.kind.name()
                    ),
                ),
            },
        }
    }

    /// Reads new command-log entries into the queue, if it is time to.
    fn read_log(&mut self) -> bool {
        let Some(tail) = &mut self.log else {
            return false;
        };
        let Some(next) = tail.next else { return false };
        if !tail.poked && tail.last_read.elapsed() < LOG_POLL {
            return false;
        }
        tail.poked = false;
        tail.last_read = std::time::Instant::now();
        match tail.log.read_from(next, LOG_BATCH) {
            Ok(entries) => {
                let got = entries.len();
                if got == LOG_BATCH {
                    tail.poked = true; // more to read
                }
                if let Some(last) = entries.last() {
                    tail.next = Some(last.offset + 1);
                }
                for e in entries {
                    if e.command.strategy == Strategy::Log {
                        self.queue.push_back(e.command);
                    }
                }
                got > 0
            }
            Err(e @ lockstep_command_log::LogError::Corrupt { .. }) => {
                self.halt(format!("cannot read the command log: {e}"));
                false
            }
            Err(e) => {
                tracing::warn!(worker = self.index, error = %e, "command log read failed; retrying");
                false
            }
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
            let naive = cmd.strategy == Strategy::Naive;
            let seqno = cmd.seqno;
            buffer.push(cmd);
            if done {
                let buffer = self.reconciling.take().unwrap_or_default();
                if naive || self.mesh.is_none() {
                    self.reconcile(worker, buffer);
                } else {
                    self.start_collective(buffer, seqno);
                }
            }
            return;
        }
        if let CommandKind::CreateDataflow(desc) = &cmd.kind {
            let new = !self.dataflows.contains_key(&desc.id);
            if cmd.strategy == Strategy::Barrier
                && self.mesh.is_some()
                && new
                && validate(desc).is_ok()
            {
                let mine = Announcement {
                    worker: self.index,
                    seqno: cmd.seqno,
                    hash: desc.hash(),
                };
                self.announce(&mine, None);
                self.pending = Some(Pending::Create {
                    cmd,
                    mine,
                    since: std::time::Instant::now(),
                });
                return;
            }
        }
        self.apply(worker, cmd);
    }

    /// Announces this worker's round `a`, with its report for a
    /// reconciliation round.
    fn announce(&mut self, a: &Announcement, report: Option<Vec<DataflowKey>>) {
        let message = MeshMessage::Round {
            session: self.session,
            seqno: a.seqno,
            hash: a.hash.0,
            report: report.map(|r| r.iter().map(|k| (k.id, k.hash.0)).collect()),
        };
        if let Some(mesh) = &mut self.mesh {
            mesh.send(self.index, message);
        }
    }

    fn installed_keys(&self) -> Vec<DataflowKey> {
        // In creation order, so that plans keep that order.
        let mut keys: Vec<DataflowKey> = Vec::new();
        for e in &self.creation_log {
            if let Some(inst) = self.dataflows.get(&e.dataflow_id) {
                if inst.timely_index as u64 == e.timely_index {
                    keys.push(DataflowKey {
                        id: e.dataflow_id,
                        hash: inst.hash,
                    });
                }
            }
        }
        keys
    }

    fn start_collective(&mut self, buffer: Vec<Command>, seqno: u64) {
        let target: Vec<DataflowKey> = buffer
            .iter()
            .filter_map(|c| match &c.kind {
                CommandKind::CreateDataflow(d) => Some(DataflowKey {
                    id: d.id,
                    hash: d.hash(),
                }),
                _ => None,
            })
            .collect();
        let mine = Announcement {
            worker: self.index,
            seqno,
            hash: target_hash(&target),
        };
        let installed = self.installed_keys();
        self.announce(&mine, Some(installed));
        self.pending = Some(Pending::Reconcile {
            buffer,
            target,
            mine,
            since: std::time::Instant::now(),
        });
    }

    /// Moves what the mesh delivered into the barrier's view.
    fn absorb_mesh(&mut self) {
        #[cfg(feature = "failpoints")]
        if self.hold_mesh_for_test() {
            return;
        }
        let Some(mesh) = &self.mesh else { return };
        let records = std::mem::take(&mut *mesh.received.borrow_mut());
        for MeshRecord { from, message } in records {
            let Ok(from) = usize::try_from(from) else {
                continue;
            };
            if from >= self.peers {
                continue;
            }
            match message {
                MeshMessage::Joined { session } => self.rounds.joined(from, session),
                MeshMessage::Command { seqno, bytes } if from == 0 => {
                    match Command::decode_from(&bytes) {
                        Ok(cmd) => self.queue.push_back(cmd),
                        // Worker 0 encoded it: only a broken build gets here,
                        // and every worker sees the same bytes.
                        Err(e) => self.halt(format!(
                            "undecodable broadcast command {seqno} from the sequencer: {e}"
                        )),
                    }
                }
                MeshMessage::LogStart { offset } if from == 0 => {
                    if let Some(tail) = &mut self.log {
                        tracing::info!(worker = self.index, offset, "tailing the command log");
                        tail.next = Some(offset);
                        tail.poked = true;
                    }
                }
                MeshMessage::Round {
                    session,
                    seqno,
                    hash,
                    report,
                } => {
                    let report = report.map(|r| {
                        r.into_iter()
                            .map(|(id, h)| DataflowKey {
                                id,
                                hash: Digest(h),
                            })
                            .collect()
                    });
                    let announcement = Announcement {
                        worker: from,
                        seqno,
                        hash: Digest(hash),
                    };
                    self.rounds.announced(session, announcement, report);
                }
                MeshMessage::Command { .. } | MeshMessage::LogStart { .. } => {}
            }
        }
    }

    /// Test hook (feature `failpoints`), failpoint
    /// `replica_hold_mesh_in_reconcile` with value `return(W)`: worker W,
    /// while its collective reconciliation round is pending and it has
    /// dataflows installed, takes nothing from the mesh until a peer's round
    /// of a later command of the session has arrived (for at most 10 s). It
    /// then reads that peer's reconcile record and its next record together,
    /// the interleaving a slow worker meets when creates follow a reconnect.
    #[cfg(feature = "failpoints")]
    fn hold_mesh_for_test(&self) -> bool {
        let Some(Some(arg)) = fail::eval("replica_hold_mesh_in_reconcile", |a| a) else {
            return false;
        };
        if arg.trim().parse::<usize>().ok() != Some(self.index) || self.dataflows.is_empty() {
            return false;
        }
        let Some(Pending::Reconcile { mine, since, .. }) = &self.pending else {
            return false;
        };
        let Some(mesh) = &self.mesh else { return false };
        if since.elapsed() > Duration::from_secs(10) {
            return false;
        }
        let later_round_in = mesh.received.borrow().iter().any(|r| {
            r.from != self.index as u64
                && matches!(r.message, MeshMessage::Round { session, seqno, .. }
                    if session == self.session && seqno > mine.seqno)
        });
        !later_round_in
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
            self.handle(worker, cmd);
        }
    }

    fn resolve(&mut self, worker: &mut Worker, p: Pending) -> Option<Pending> {
        let (mine, since) = match &p {
            Pending::Create { mine, since, .. } | Pending::Reconcile { mine, since, .. } => {
                (*mine, *since)
            }
        };
        match self.rounds.decide(self.session, &mine) {
            BarrierDecision::Wait => {
                if since.elapsed() > BARRIER_TIMEOUT {
                    self.halt(format!(
                        "worker {} waited {:?} at the barrier for command {} of session {:#x} without every worker announcing it",
                        self.index, BARRIER_TIMEOUT, mine.seqno, self.session
                    ));
                }
                Some(p)
            }
            BarrierDecision::Diverged {
                worker: w,
                theirs,
                ours,
            } => {
                self.halt(format!(
                    "workers received different commands: worker {w} announced {theirs:?}, worker {} {ours:?}",
                    self.index
                ));
                None
            }
            BarrierDecision::Abandoned { worker: w } => {
                tracing::info!(
                    worker = self.index,
                    seqno = mine.seqno,
                    by = w,
                    "barrier round abandoned: a newer session started"
                );
                self.prune_round(mine.seqno);
                None
            }
            BarrierDecision::Pass => {
                // Plan from the round's reports before the round is forgotten.
                let plan = match &p {
                    Pending::Reconcile { target, .. } => Some(self.rounds.reconcile_plan(
                        self.session,
                        mine.seqno,
                        self.index,
                        target,
                    )),
                    Pending::Create { .. } => None,
                };
                self.prune_round(mine.seqno);
                match p {
                    Pending::Create { cmd, .. } => self.apply(worker, cmd),
                    Pending::Reconcile { buffer, .. } => {
                        let Some(Some((drops, _builds))) = plan else {
                            self.halt(format!(
                                "the reconciliation round {} of session {:#x} passed without every worker's installed dataflows",
                                mine.seqno, self.session
                            ));
                            return None;
                        };
                        // The builds are the target's missing dataflows, which
                        // the buffer's creates build in target order.
                        for id in drops {
                            tracing::info!(
                                worker = self.index,
                                dataflow = id,
                                "collective reconciliation drops dataflow"
                            );
                            self.drop_dataflow(worker, id);
                        }
                        self.history = CommandHistory::new();
                        for cmd in buffer {
                            self.apply(worker, cmd);
                        }
                    }
                }
                None
            }
        }
    }

    /// Forgets the announcements of decided rounds (up to `seqno`) of the
    /// current session: later rounds never look at them.
    fn prune_round(&mut self, seqno: u64) {
        let session = self.session;
        self.rounds.forget_through(session, seqno);
    }

    /// Stops the process: it cannot prove it is in lockstep (I4). The
    /// orchestrator restarts it and the controller reconnects.
    fn halt(&self, reason: String) {
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

    /// Per-worker reconciliation at InitializationComplete.
    fn reconcile(&mut self, worker: &mut Worker, buffer: Vec<Command>) {
        let target: BTreeMap<u64, Digest> = buffer
            .iter()
            .filter_map(|c| match &c.kind {
                CommandKind::CreateDataflow(d) => Some((d.id, d.hash())),
                _ => None,
            })
            .collect();
        let stale: Vec<u64> = self
            .dataflows
            .iter()
            .filter(|(id, inst)| target.get(id) != Some(&inst.hash))
            .map(|(id, _)| *id)
            .collect();
        for id in stale {
            tracing::info!(
                worker = self.index,
                dataflow = id,
                "reconciliation drops dataflow"
            );
            self.drop_dataflow(worker, id);
        }
        self.history = CommandHistory::new();
        for cmd in buffer {
            self.apply(worker, cmd);
        }
    }

    fn apply(&mut self, worker: &mut Worker, cmd: Command) {
        let seqno = cmd.seqno;
        self.applied_seqno = seqno;
        match &cmd.kind {
            CommandKind::Hello(_) => {}
            CommandKind::StatusRequest { full } => {
                self.send(FromWorker::Status(self.status(*full)));
                return;
            }
            CommandKind::CreateInstance(_)
            | CommandKind::InitializationComplete
            | CommandKind::UpdateConfiguration(_)
            | CommandKind::Schedule { .. } => {}
            CommandKind::CreateDataflow(desc) => {
                if let Some(inst) = self.dataflows.get(&desc.id) {
                    if inst.hash != desc.hash() {
                        self.error(
                            seqno,
                            ErrorKind::InvalidCommand,
                            format!(
                                "dataflow {} already exists with another description",
                                desc.id
                            ),
                        );
                        return;
                    }
                    // Same description: kept (reconciliation), nothing to build.
                } else if let Err(e) = validate(desc) {
                    self.error(seqno, ErrorKind::InvalidCommand, e.to_string());
                    return;
                } else if let Some(c) = desc
                    .exports
                    .iter()
                    .find(|e| self.collections.contains_key(&e.collection_id))
                {
                    self.error(
                        seqno,
                        ErrorKind::InvalidCommand,
                        format!("collection {} already exists", c.collection_id),
                    );
                    return;
                } else {
                    self.build(worker, desc.clone());
                }
            }
            CommandKind::AllowCompaction {
                collection_id,
                frontier,
            } => {
                if !self.allow_compaction(worker, *collection_id, *frontier) {
                    self.error(
                        seqno,
                        ErrorKind::InvalidCommand,
                        format!("AllowCompaction names unknown collection {collection_id}"),
                    );
                    return;
                }
            }
            CommandKind::Peek(p) => self.peeks.push(p.clone()),
            CommandKind::CancelPeek { peek_id } => {
                if let Some(pos) = self.peeks.iter().position(|p| p.peek_id == *peek_id) {
                    self.peeks.remove(pos);
                    self.history.retire_peek(*peek_id);
                    self.send(FromWorker::Peek {
                        worker: self.index,
                        peek_id: *peek_id,
                        result: PeekResult::Canceled,
                    });
                }
            }
            CommandKind::Subscribe(s) => {
                if let Some(df) = self.collections.get(&s.collection_id) {
                    let export = &self.dataflows[df].exports[&s.collection_id];
                    if s.as_of < export.since {
                        self.error(
                            seqno,
                            ErrorKind::InvalidCommand,
                            format!(
                                "subscribe {} at {} is below collection {}'s compaction frontier {}",
                                s.subscribe_id, s.as_of, s.collection_id, export.since
                            ),
                        );
                        return;
                    }
                    self.subs.insert(
                        s.subscribe_id,
                        SubState {
                            sub: s.clone(),
                            lower: None,
                        },
                    );
                } else {
                    self.error(
                        seqno,
                        ErrorKind::InvalidCommand,
                        format!(
                            "subscribe {} names unknown collection {}",
                            s.subscribe_id, s.collection_id
                        ),
                    );
                    return;
                }
            }
            CommandKind::WriteInput(w) => {
                if let Some(u) = w.updates.iter().find(|u| u.time >= w.upper) {
                    self.error(
                        seqno,
                        ErrorKind::InvalidCommand,
                        format!(
                            "WriteInput to {}: update at time {} is not below the new upper {}",
                            w.collection_id, u.time, w.upper
                        ),
                    );
                    return;
                }
                self.write_input(w);
            }
        }
        self.history.push(cmd.kind);
    }

    fn write_input(&mut self, w: &WriteInput) {
        let store = self.inputs.entry(w.collection_id).or_default();
        let fresh: Vec<Update> = w
            .updates
            .iter()
            .filter(|u| u.time >= store.upper && owner(&u.row, self.peers) == self.index)
            .cloned()
            .collect();
        let new_upper = store.upper.max(w.upper);
        tracing::trace!(
            worker = self.index,
            collection = w.collection_id,
            fresh = fresh.len(),
            new_upper,
            "write input"
        );
        store.upper = new_upper;
        store.updates.extend(fresh.iter().cloned());
        for inst in self.dataflows.values_mut() {
            for (id, session) in &mut inst.sessions {
                if *id == w.collection_id {
                    for u in &fresh {
                        session.update_at(u.row.clone(), u.time, u.diff);
                    }
                    session.advance_to(new_upper);
                    session.flush();
                }
            }
        }
    }

    fn build(&mut self, worker: &mut Worker, desc: DataflowDescription) {
        let timely_index = worker.next_dataflow_index();
        let hash = desc.hash();
        let name = format!("dataflow-{}-{}", desc.id, desc.debug_name);
        let (mut sessions, exports) = worker.dataflow_named::<u64, _, _>(&name, |scope| {
            let mut sessions = Vec::new();
            let mut colls: BTreeMap<u64, Coll<'_>> = BTreeMap::new();
            for &id in &desc.inputs {
                let mut session = InputSession::new();
                colls.insert(id, session.to_collection(scope));
                sessions.push((id, session));
            }
            let mut exports = BTreeMap::new();
            for e in &desc.exports {
                let tap: Rc<RefCell<Tap>> = Rc::default();
                let tap2 = Rc::clone(&tap);
                let probe = ProbeHandle::new();
                let arranged = render(&e.plan, &colls).arrange_by_self();
                let trace = arranged.trace.clone();
                arranged
                    .as_collection(|k: &Row, _v: &()| k.clone())
                    .inspect(move |(row, time, diff): &(Row, u64, i64)| {
                        let u = Update {
                            row: row.clone(),
                            time: *time,
                            diff: *diff,
                        };
                        let mut tap = tap2.borrow_mut();
                        for buf in tap.subs.values_mut() {
                            buf.push(u.clone());
                        }
                        tap.recent.push(u);
                    })
                    .probe_with(&probe);
                exports.insert(
                    e.collection_id,
                    ExportState {
                        trace,
                        probe,
                        tap,
                        since: 0,
                        reported: None,
                    },
                );
            }
            (sessions, exports)
        });
        for (id, session) in &mut sessions {
            let store = self.inputs.entry(*id).or_default();
            for u in &store.updates {
                session.update_at(u.row.clone(), u.time, u.diff);
            }
            session.advance_to(store.upper);
            session.flush();
        }
        for id in exports.keys() {
            self.collections.insert(*id, desc.id);
        }
        tracing::debug!(
            worker = self.index,
            dataflow = desc.id,
            timely_index,
            "built dataflow"
        );
        self.creation_log.push(CreationLogEntry {
            timely_index: timely_index as u64,
            dataflow_id: desc.id,
            description_hash: hash,
        });
        self.dataflows.insert(
            desc.id,
            Installed {
                desc,
                hash,
                timely_index,
                sessions,
                exports,
            },
        );
    }

    /// Returns false if the collection is unknown.
    fn allow_compaction(
        &mut self,
        worker: &mut Worker,
        collection: u64,
        frontier: Frontier,
    ) -> bool {
        let Some(&df) = self.collections.get(&collection) else {
            return false;
        };
        let inst = self
            .dataflows
            .get_mut(&df)
            .expect("collections index is in sync");
        match frontier {
            Some(t) => {
                let export = inst.exports.get_mut(&collection).expect("in sync");
                if t > export.since {
                    export.since = t;
                    export
                        .trace
                        .set_logical_compaction(Antichain::from_elem(t).borrow());
                    export
                        .trace
                        .set_physical_compaction(Antichain::from_elem(t).borrow());
                }
            }
            None => {
                inst.exports.remove(&collection);
                let now_empty = inst.exports.is_empty();
                self.collections.remove(&collection);
                self.send(FromWorker::Frontier {
                    worker: self.index,
                    collection,
                    upper: None,
                });
                for p in self.peeks.iter().filter(|p| p.collection_id == collection) {
                    let _ = self.tx.send(FromWorker::Peek {
                        worker: self.index,
                        peek_id: p.peek_id,
                        result: PeekResult::Error(format!("collection {collection} was dropped")),
                    });
                }
                self.peeks.retain(|p| p.collection_id != collection);
                self.subs.retain(|_, s| s.sub.collection_id != collection);
                if now_empty {
                    self.drop_dataflow(worker, df);
                }
            }
        }
        true
    }

    fn drop_dataflow(&mut self, worker: &mut Worker, id: u64) {
        if let Some(inst) = self.dataflows.remove(&id) {
            for c in &inst.desc.exports {
                self.collections.remove(&c.collection_id);
            }
            let timely_index = inst.timely_index;
            drop(inst);
            worker.drop_dataflow(timely_index);
        }
    }

    /// Reports frontiers, answers peeks that are ready, emits subscribe batches.
    pub fn maintain(&mut self) {
        // Frontiers.
        let mut changes = Vec::new();
        for inst in self.dataflows.values_mut() {
            for (id, e) in inst.exports.iter_mut() {
                let f = probe_frontier(&e.probe);
                if e.reported != Some(f) {
                    tracing::trace!(worker = self.index, collection = id, upper = ?f, "frontier");
                    e.reported = Some(f);
                    changes.push((*id, f));
                }
                // Subscribers start at or beyond the probe frontier: older
                // tapped updates are in the trace.
                if let Some(f) = f {
                    e.tap.borrow_mut().recent.retain(|u| u.time >= f);
                }
            }
        }
        for (collection, upper) in changes {
            self.send(FromWorker::Frontier {
                worker: self.index,
                collection,
                upper,
            });
        }

        // Peeks.
        let mut answered = Vec::new();
        let peeks = std::mem::take(&mut self.peeks);
        for p in peeks {
            match self.try_peek(&p) {
                Some(result) => answered.push((p.peek_id, result)),
                None => self.peeks.push(p),
            }
        }
        for (peek_id, result) in answered {
            self.history.retire_peek(peek_id);
            self.send(FromWorker::Peek {
                worker: self.index,
                peek_id,
                result,
            });
        }

        // Subscribes.
        let mut batches = Vec::new();
        let mut finished = Vec::new();
        for (sid, s) in self.subs.iter_mut() {
            let Some(df) = self.collections.get(&s.sub.collection_id) else {
                continue;
            };
            let Some(e) = self
                .dataflows
                .get_mut(df)
                .and_then(|i| i.exports.get_mut(&s.sub.collection_id))
            else {
                continue;
            };
            let upper = probe_frontier(&e.probe);
            match s.lower {
                None => {
                    if !passed(upper, s.sub.as_of) {
                        continue;
                    }
                    let as_of = s.sub.as_of;
                    let snapshot = read_trace(&mut e.trace)
                        .into_iter()
                        .filter(|u| passed(upper, u.time))
                        .map(|mut u| {
                            u.time = u.time.max(as_of);
                            u
                        })
                        .collect();
                    let mut tap = e.tap.borrow_mut();
                    let pending: Vec<Update> = tap
                        .recent
                        .iter()
                        .filter(|u| !passed(upper, u.time))
                        .cloned()
                        .collect();
                    tap.subs.insert(*sid, pending);
                    batches.push(SubscribeBatch {
                        subscribe_id: *sid,
                        lower: as_of,
                        upper,
                        updates: consolidate(snapshot),
                    });
                    s.lower = Some(upper);
                }
                Some(Some(lower)) if upper != Some(lower) => {
                    let mut tap = e.tap.borrow_mut();
                    let buf = tap.subs.entry(*sid).or_default();
                    let (ready, rest): (Vec<Update>, Vec<Update>) = buf
                        .drain(..)
                        .filter(|u| u.time >= lower)
                        .partition(|u| passed(upper, u.time));
                    *buf = rest;
                    batches.push(SubscribeBatch {
                        subscribe_id: *sid,
                        lower,
                        upper,
                        updates: consolidate(ready),
                    });
                    s.lower = Some(upper);
                }
                _ => {}
            }
            if upper.is_none() {
                finished.push(*sid);
            }
        }
        for sid in finished {
            self.subs.remove(&sid);
        }
        for batch in batches {
            self.send(FromWorker::Subscribe {
                worker: self.index,
                batch,
            });
        }
    }

    fn try_peek(&mut self, p: &Peek) -> Option<PeekResult> {
        let Some(df) = self.collections.get(&p.collection_id) else {
            return Some(PeekResult::Error(format!(
                "peek {}: unknown collection {}",
                p.peek_id, p.collection_id
            )));
        };
        let e = self
            .dataflows
            .get_mut(df)?
            .exports
            .get_mut(&p.collection_id)?;
        if p.timestamp < e.since {
            return Some(PeekResult::Error(format!(
                "peek {} at {} is below collection {}'s compaction frontier {}",
                p.peek_id, p.timestamp, p.collection_id, e.since
            )));
        }
        if !passed(probe_frontier(&e.probe), p.timestamp) {
            return None;
        }
        let mut acc: BTreeMap<Row, i64> = BTreeMap::new();
        for u in read_trace(&mut e.trace) {
            if u.time <= p.timestamp {
                *acc.entry(u.row).or_default() += u.diff;
            }
        }
        Some(PeekResult::Rows(
            acc.into_iter().filter(|(_, d)| *d != 0).collect(),
        ))
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
    if let Some(mut log) = log {
        if index == 0 {
            // Every worker starts reading where worker 0 says: the newest
            // epoch marker now. Before it, everything is summarized by the
            // target state that follows it.
            let start = match log.start_offset() {
                Ok(o) => o,
                Err(e) => {
                    state.halt(format!("cannot read the command log: {e}"));
                    1
                }
            };
            if let Some(mesh) = &mut state.mesh {
                mesh.send(0, MeshMessage::LogStart { offset: start });
            }
        }
        state.log = Some(LogTail {
            log,
            next: None,
            poked: false,
            last_read: std::time::Instant::now(),
        });
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
