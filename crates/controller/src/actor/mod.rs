//! The task that owns a controller's state: connections, history, merges.
//!
//! One task handles, in one order, the owner's requests, what the
//! connections forward and a heartbeat tick. This module holds the state
//! ([`Actor`]), [`spawn`] and the event loop, request handling and the
//! merging of responses; the rest is split by concern:
//!
//! - `session`: the shell of the session machine
//!   ([`lockstep_reconcile::ControllerSession`]: connect, Hello and replay,
//!   the history check, InitializationComplete, disconnect);
//! - `failpoint`: the partial-broadcast failpoint;
//! - [`crate::deliver`]: which strategy a command is sent with, and what each
//!   strategy does when it is sent.

mod failpoint;
mod session;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use lockstep_command_log::AnyLog;
use lockstep_policy::{DistributionPolicy, MismatchAction};
use lockstep_protocol::merge::{meet, merge_peek, SubscribeMerge};
use lockstep_protocol::{
    CommandHistory, CommandKind, ErrorResponse, Frontier, Peek, PeekResult, ResponseKind, Row,
    Status, Strategy, Subscribe, SubscribeBatch,
};
use lockstep_reconcile::ControllerSession;
use tokio::sync::{broadcast, mpsc, oneshot};
use tokio::time::Instant;

use crate::connection::{self, Conn, ConnEvent, FromConn};
use crate::deliver::LogBatch;
use crate::{ControllerError, ReplicaAddrs, Request, Timeouts};

pub(crate) use failpoint::{CrashHook, Reach};
pub(crate) use lockstep_reconcile::Phase;

/// Something the owner of a controller should know.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// Every process is connected and was sent the history under `nonce`.
    Connected {
        /// The session's nonce.
        nonce: u64,
    },
    /// A connection ended; the controller reconnects every process.
    Disconnected {
        /// The process.
        process: usize,
        /// Why.
        reason: String,
    },
    /// Connecting to every process did not succeed within the bound; the
    /// controller keeps trying.
    ConnectFailed {
        /// Why.
        reason: String,
    },
    /// A process has not answered for longer than the heartbeat timeout: a
    /// stopped or hung process. The replica must be restarted.
    ProcessSilent {
        /// The process.
        process: usize,
        /// For how long.
        silent_for: Duration,
    },
    /// Appending to the command log failed. Fenced out by a newer
    /// controller (`fenced`): the controller stopped, and its owner must
    /// halt (O3). Otherwise (a broken store): the controller dropped the log
    /// and reconnects, with backoff, reopening it.
    LogFailed {
        /// Why.
        message: String,
        /// Whether a newer controller fenced this one out of the log.
        fenced: bool,
    },
    /// On connect, the workers reported different histories (creation logs
    /// or installed dataflows); the distribution policy chose `action`.
    /// `RestartReplica` asks the owner to restart the replica.
    HistoryMismatch {
        /// How many different histories were reported.
        distinct_digests: u32,
        /// What the policy decided.
        action: MismatchAction,
    },
    /// A process refused the CreateDataflow of `dataflow` as malformed (its
    /// frame did not decode there: too large for the process's frame limit,
    /// too deep for its decoder, or a build that does not know a field).
    /// The dataflow left the controller's history, so it is not resent; the
    /// owner should forget it too (the catalog), and fail its request.
    DataflowRefused {
        /// The dataflow.
        dataflow: u64,
        /// The process that refused it.
        process: usize,
        /// What the process said.
        message: String,
    },
    /// A process reported an error.
    ReplicaError {
        /// The process.
        process: usize,
        /// The error.
        error: ErrorResponse,
    },
}

/// A caller waiting for statuses, and the (nonce, seqno) of its request.
type StatusWaiter = (Option<(u64, u64)>, bool, oneshot::Sender<Vec<Status>>);

/// A subscription: its collection, the merge of the processes' batches, and
/// where the merged batches go (until the receiver is dropped: then it is
/// canceled).
pub(crate) struct Sub {
    collection: u64,
    pub(crate) merge: SubscribeMerge,
    sink: mpsc::Sender<Result<SubscribeBatch, ControllerError>>,
    /// What `merge` holds back (updates at or past the meet of the parts'
    /// uppers), as estimated bytes per time, and their sum: the mirror of
    /// `merge`'s buffer that bounds it.
    buffered: BTreeMap<u64, usize>,
    buffered_bytes: usize,
    /// The upper `merge` emitted last: updates before it are dropped.
    floor: Option<u64>,
}

impl Sub {
    fn new(
        collection: u64,
        parts: usize,
        sink: mpsc::Sender<Result<SubscribeBatch, ControllerError>>,
    ) -> Sub {
        Sub {
            collection,
            merge: SubscribeMerge::new(parts),
            sink,
            buffered: BTreeMap::new(),
            buffered_bytes: 0,
            floor: None,
        }
    }

    /// Feeds part `part`'s batch to the merge; returns the merged batch, if
    /// any, and the estimated bytes the merge then holds back.
    fn push(&mut self, part: usize, batch: SubscribeBatch) -> (Option<SubscribeBatch>, usize) {
        // The merge keeps the updates not before the last emitted upper.
        for u in &batch.updates {
            if self.floor.is_none_or(|f| u.time >= f) {
                let bytes = update_bytes(u.row.len());
                *self.buffered.entry(u.time).or_default() += bytes;
                self.buffered_bytes += bytes;
            }
        }
        let out = self.merge.push(part, batch);
        if let Some(out) = &out {
            // It emitted every update before the new upper.
            let kept = match out.upper {
                Some(m) => self.buffered.split_off(&m),
                None => BTreeMap::new(),
            };
            self.buffered = kept;
            self.buffered_bytes = self.buffered.values().sum();
            self.floor = out.upper;
        }
        (out, self.buffered_bytes)
    }

    /// The parts restart the subscription (a new session): the merge
    /// forgets what they sent.
    pub(crate) fn restart(&mut self) {
        self.merge.restart();
        self.buffered.clear();
        self.buffered_bytes = 0;
    }
}

/// The estimated bytes an update (or a peek's row) of `width` columns
/// takes in memory.
fn update_bytes(width: usize) -> usize {
    std::mem::size_of::<lockstep_protocol::Update>() + 8 * width
}

/// The most a replica's answers may make the controller keep (S1 of the
/// controller's side: nothing a replica sends grows its memory without
/// bound). Exceeding one ends the session with that process, with an error.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    /// Collections the controller does not know with a reported frontier,
    /// per session.
    pub(crate) unknown_frontiers: usize,
    /// Estimated bytes of the rows of one peek's answers that came in parts
    /// and wait for their last part, over all processes.
    pub(crate) peek_part_bytes: usize,
    /// Estimated bytes of the updates one subscription's merge holds back.
    pub(crate) subscribe_buffer_bytes: usize,
}

/// See [`Limits::unknown_frontiers`].
pub(crate) const MAX_UNKNOWN_FRONTIERS: usize = 4096;
/// See [`Limits::peek_part_bytes`].
pub(crate) const MAX_PEEK_PART_BYTES: usize = 512 << 20;
/// See [`Limits::subscribe_buffer_bytes`].
pub(crate) const MAX_SUBSCRIBE_BUFFER_BYTES: usize = 512 << 20;

impl Default for Limits {
    fn default() -> Self {
        Limits {
            unknown_frontiers: MAX_UNKNOWN_FRONTIERS,
            peek_part_bytes: MAX_PEEK_PART_BYTES,
            subscribe_buffer_bytes: MAX_SUBSCRIBE_BUFFER_BYTES,
        }
    }
}

/// Adds the collections `kind` names (dataflow inputs and exports, a
/// written input) to `known`.
fn note_collections(known: &mut std::collections::BTreeSet<u64>, kind: &CommandKind) {
    match kind {
        CommandKind::CreateDataflow(d) => {
            known.extend(d.inputs.iter().copied());
            known.extend(d.exports.iter().map(|e| e.collection_id));
        }
        CommandKind::WriteInput(w) => {
            known.insert(w.collection_id);
        }
        _ => {}
    }
}

struct PendingPeek {
    results: BTreeMap<usize, PeekResult>,
    /// Rows of answers that came in parts, per process, until the last part.
    parts: BTreeMap<usize, Vec<(Row, i64)>>,
    /// The estimated bytes in `parts`.
    parts_bytes: usize,
    reply: oneshot::Sender<Result<Vec<(Row, i64)>, ControllerError>>,
}

/// The state of one controller, owned by its task. The fields
/// [`crate::deliver`] uses are `pub(crate)`; the rest belongs to this module
/// and its submodules. Where the session is, is only in `session`.
pub(crate) struct Actor {
    pub(crate) replica: ReplicaAddrs,
    pub(crate) epoch: u64,
    timeouts: Timeouts,
    pub(crate) policy: Box<dyn DistributionPolicy + Send>,
    pub(crate) fallback: Strategy,
    /// The strategy chosen for this session's Hello. Broadcast and log order
    /// commands themselves, so a session that starts with one of them sends
    /// every command with it; a socket-ordered session (barrier, naive) asks
    /// the policy per command.
    pub(crate) session_strategy: Strategy,
    /// The replica's command log, opened at the first log session.
    pub(crate) log: Option<AnyLog>,
    /// The command log being opened on a blocking thread since the actor
    /// started, so that the first session's marker does not wait for it.
    pub(crate) log_opening:
        Option<std::sync::mpsc::Receiver<Result<AnyLog, lockstep_command_log::LogError>>>,
    /// While a log session starts: the commands to append in one go, each
    /// with the failpoint's crash point, and the per-process Hellos.
    pub(crate) log_batch: Option<LogBatch>,
    /// The partial-broadcast failpoint's hold on the command being
    /// delivered (disarmed in production builds).
    pub(crate) crash_hook: CrashHook,
    /// The log offset of this session's Hello marker (log sessions).
    pub(crate) log_marker: Option<u64>,
    /// The (sequence number, log offset) of this session's StatusRequests
    /// in the command log, oldest first, until every worker applied them.
    pub(crate) log_status_requests: std::collections::VecDeque<(u64, u64)>,
    /// The session machine: phase, nonce, reconnect backoff, the history
    /// check.
    session: ControllerSession,
    /// The session machine's clock.
    started: Instant,
    history: CommandHistory,
    /// This session's sequence numbers of CreateDataflow commands, with the
    /// dataflow each carried: a process that cannot decode a frame names
    /// only its sequence number.
    pub(crate) sent_creates: BTreeMap<u64, u64>,
    generation: u64,
    current_generation: Arc<AtomicU64>,
    pub(crate) seqno: u64,
    pub(crate) conns: Vec<Option<Conn>>,
    last_heard: Vec<Instant>,
    silent_reported: Vec<bool>,
    frontiers: BTreeMap<u64, BTreeMap<usize, Frontier>>,
    /// How many collections in `frontiers` this session the controller
    /// does not know (bounded by [`Limits::unknown_frontiers`]).
    unknown_frontiers: usize,
    /// Every collection a command of this controller named (dataflow
    /// inputs and exports, written inputs): frontiers of others count as
    /// unknown.
    known_collections: std::collections::BTreeSet<u64>,
    /// The bounds on what a replica's answers may make the controller keep.
    limits: Limits,
    peeks: BTreeMap<u64, PendingPeek>,
    next_peek_id: u64,
    next_subscribe_id: u64,
    subs: BTreeMap<u64, Sub>,
    statuses: BTreeMap<u32, Status>,
    /// Per process, the protocol version agreed in this session and its
    /// build, once known: from its HelloResponse (version 3 and up), or
    /// version 2 when a Status came first (a version-2 process).
    versions: Vec<Option<crate::ProcessVersion>>,
    /// The latest full status (history digest and creation log) per worker.
    full_statuses: BTreeMap<u32, Status>,
    /// Callers waiting for a Status from every worker that answers the
    /// StatusRequest with this (nonce, sequence number), or a later one.
    status_waiters: Vec<StatusWaiter>,
    frontier_waiters: Vec<(u64, u64, oneshot::Sender<()>)>,
    events: broadcast::Sender<Event>,
    to_self: mpsc::UnboundedSender<FromConn>,
    connected_tx: mpsc::UnboundedSender<(u64, Result<Vec<connection::Connected>, String>)>,
}

pub(crate) fn spawn(
    replica: ReplicaAddrs,
    epoch: u64,
    history: CommandHistory,
    policy: Box<dyn DistributionPolicy + Send>,
    timeouts: Timeouts,
    mut requests: mpsc::UnboundedReceiver<Request>,
    events: broadcast::Sender<Event>,
) {
    let (mut actor, mut from_conns, mut connected_rx) =
        Actor::new(replica, epoch, history, policy, timeouts, events);
    if let Some(location) = actor.replica.command_log.clone() {
        let (tx, rx) = std::sync::mpsc::channel();
        actor.log_opening = Some(rx);
        tokio::task::spawn_blocking(move || {
            let _ = tx.send(AnyLog::open(&location));
        });
    }
    tokio::spawn(async move {
        actor.start_connecting();
        let mut tick = tokio::time::interval(actor.timeouts.heartbeat_interval);
        loop {
            tokio::select! {
                req = requests.recv() => match req {
                    None | Some(Request::Shutdown) => break,
                    Some(r) => actor.on_request(r),
                },
                Some(msg) = from_conns.recv() => actor.on_conn(msg),
                Some((generation, result)) = connected_rx.recv() => actor.on_connected(generation, result),
                _ = tick.tick() => actor.on_tick(),
            }
            if actor.phase() == Phase::Crashed {
                break;
            }
        }
        actor.current_generation.store(u64::MAX, Ordering::SeqCst);
        tracing::info!("controller shut down");
    });
}

impl Actor {
    /// A controller's state, not connected, with the receivers of what its
    /// connections forward and of its connection attempts.
    #[allow(clippy::type_complexity)]
    fn new(
        replica: ReplicaAddrs,
        epoch: u64,
        mut history: CommandHistory,
        policy: Box<dyn DistributionPolicy + Send>,
        timeouts: Timeouts,
        events: broadcast::Sender<Event>,
    ) -> (
        Actor,
        mpsc::UnboundedReceiver<FromConn>,
        mpsc::UnboundedReceiver<(u64, Result<Vec<connection::Connected>, String>)>,
    ) {
        if !history
            .commands()
            .iter()
            .any(|c| matches!(c, CommandKind::CreateInstance(_)))
        {
            history.push(CommandKind::CreateInstance(Default::default()));
        }
        let n = replica.processes.len();
        let replica_workers = replica.total_workers();
        let (to_self, from_conns) = mpsc::unbounded_channel();
        let (connected_tx, connected_rx) = mpsc::unbounded_channel();
        let mut known_collections = std::collections::BTreeSet::new();
        for c in history.commands() {
            note_collections(&mut known_collections, &c);
        }
        let actor = Actor {
            replica,
            epoch,
            timeouts,
            policy,
            fallback: Strategy::Barrier,
            session_strategy: Strategy::Barrier,
            log: None,
            log_opening: None,
            log_batch: None,
            crash_hook: CrashHook::default(),
            log_marker: None,
            log_status_requests: Default::default(),
            session: ControllerSession::new(replica_workers),
            started: Instant::now(),
            history,
            sent_creates: BTreeMap::new(),
            generation: 0,
            current_generation: Arc::new(AtomicU64::new(0)),
            seqno: 0,
            conns: (0..n).map(|_| None).collect(),
            last_heard: vec![Instant::now(); n],
            silent_reported: vec![false; n],
            frontiers: BTreeMap::new(),
            unknown_frontiers: 0,
            known_collections,
            limits: Limits::default(),
            peeks: BTreeMap::new(),
            // Peek and subscribe IDs carry the controller's epoch in their
            // upper half, so an answer to an earlier controller's request
            // (a peek a restarted replica replays from the command log, say)
            // never matches one of ours by number alone.
            next_peek_id: first_request_id(epoch),
            next_subscribe_id: first_request_id(epoch),
            subs: BTreeMap::new(),
            statuses: BTreeMap::new(),
            versions: Vec::new(),
            full_statuses: BTreeMap::new(),
            status_waiters: Vec::new(),
            frontier_waiters: Vec::new(),
            events,
            to_self,
            connected_tx,
        };
        (actor, from_conns, connected_rx)
    }

    pub(crate) fn emit(&self, e: Event) {
        let _ = self.events.send(e);
    }

    /// Records a command in the history and sends it.
    fn send(&mut self, kind: CommandKind) {
        if !matches!(
            kind,
            CommandKind::InitializationComplete | CommandKind::StatusRequest { .. }
        ) {
            note_collections(&mut self.known_collections, &kind);
            self.history.push(kind.clone());
        }
        self.broadcast(kind);
    }

    fn on_request(&mut self, r: Request) {
        match r {
            Request::SetPolicy(policy) => {
                tracing::info!(policy = %policy.name(), "distribution policy replaced; in force from the next session");
                self.policy = policy;
            }
            Request::SetAddresses(addrs) => {
                if addrs.len() != self.replica.processes.len() {
                    tracing::error!(
                        ?addrs,
                        processes = self.replica.processes.len(),
                        "new process addresses ignored: not one per process"
                    );
                    return;
                }
                tracing::info!(?addrs, "the replica's processes moved; reconnecting");
                self.replica.processes = addrs;
                self.disconnect("the replica's processes moved to new addresses".into());
            }
            Request::Send(kind) => {
                // A (re)created collection starts with no reported frontier.
                if let CommandKind::CreateDataflow(d) = &kind {
                    for e in &d.exports {
                        self.frontiers.remove(&e.collection_id);
                    }
                }
                // A dropped collection ends its subscriptions with an error.
                if let CommandKind::AllowCompaction {
                    collection_id,
                    frontier: None,
                } = &kind
                {
                    let ended: Vec<u64> = self
                        .subs
                        .iter()
                        .filter(|(_, s)| s.collection == *collection_id)
                        .map(|(id, _)| *id)
                        .collect();
                    for id in ended {
                        let sub = self.subs.remove(&id).expect("listed");
                        let _ = sub.sink.try_send(Err(ControllerError::Dropped {
                            collection: *collection_id,
                        }));
                    }
                }
                self.send(kind)
            }
            Request::Peek {
                collection,
                timestamp,
                reply,
            } => {
                let peek_id = self.next_peek_id;
                self.next_peek_id += 1;
                self.peeks.insert(
                    peek_id,
                    PendingPeek {
                        results: BTreeMap::new(),
                        parts: BTreeMap::new(),
                        parts_bytes: 0,
                        reply,
                    },
                );
                self.send(CommandKind::Peek(Peek {
                    peek_id,
                    collection_id: collection,
                    timestamp,
                }));
            }
            Request::Subscribe {
                collection,
                as_of,
                sink,
            } => {
                let id = self.next_subscribe_id;
                self.next_subscribe_id += 1;
                self.subs
                    .insert(id, Sub::new(collection, self.replica.processes.len(), sink));
                self.send(CommandKind::Subscribe(Subscribe {
                    subscribe_id: id,
                    collection_id: collection,
                    as_of,
                }));
            }
            Request::Statuses { full, reply } => {
                let at = self.request_status(full);
                self.status_waiters.push((at, full, reply));
            }
            Request::Frontier { collection, reply } => {
                let _ = reply.send(self.frontier_of(collection));
            }
            Request::WaitFrontier {
                collection,
                beyond,
                reply,
            } => {
                self.frontier_waiters.push((collection, beyond, reply));
                self.answer_frontier_waiters();
            }
            Request::History { reply } => {
                let mut h = self.history.clone();
                h.reduce();
                let _ = reply.send(h);
            }
            Request::ProcessLags { reply } => {
                let _ = reply.send(self.process_lags());
            }
            Request::ProcessVersions { reply } => {
                let mut versions = self.versions.clone();
                versions.resize(self.replica.processes.len(), None);
                let _ = reply.send(versions);
            }
            Request::Reconnect => self.disconnect("reconnect requested".into()),
            Request::Shutdown => {}
        }
    }

    fn on_conn(&mut self, msg: FromConn) {
        if msg.generation != self.generation || !self.phase().is_connected() {
            return;
        }
        let p = msg.process;
        self.last_heard[p] = Instant::now();
        self.silent_reported[p] = false;
        let resp = match msg.event {
            ConnEvent::Closed(reason) => {
                tracing::warn!(process = p, %reason, "connection to replica process lost");
                self.emit(Event::Disconnected {
                    process: p,
                    reason: reason.clone(),
                });
                self.disconnect(format!("process {p}: {reason}"));
                return;
            }
            ConnEvent::Response(r) => r,
        };
        if resp.process_index as usize != p {
            self.refuse_answer(
                p,
                format!(
                    "a response names process {} on the connection to process {p}",
                    resp.process_index
                ),
            );
            return;
        }
        match resp.kind {
            ResponseKind::Frontiers(updates) => {
                for (c, f) in updates {
                    let per = match self.frontiers.entry(c) {
                        std::collections::btree_map::Entry::Occupied(o) => o.into_mut(),
                        std::collections::btree_map::Entry::Vacant(v) => {
                            if !self.known_collections.contains(&c) {
                                self.unknown_frontiers += 1;
                                if self.unknown_frontiers > self.limits.unknown_frontiers {
                                    let limit = self.limits.unknown_frontiers;
                                    self.refuse_answer(
                                        p,
                                        format!(
                                            "frontiers reported for more than {limit} collections the controller does not know (the last: {c})"
                                        ),
                                    );
                                    return;
                                }
                            }
                            v.insert(BTreeMap::new())
                        }
                    };
                    per.insert(p, f);
                }
                self.answer_frontier_waiters();
            }
            ResponseKind::PeekResponse(r) => {
                let n = self.replica.processes.len();
                if let Some(pending) = self.peeks.get_mut(&r.peek_id) {
                    let result = match r.result {
                        PeekResult::Part(rows) => {
                            pending.parts_bytes += rows
                                .iter()
                                .map(|(row, _)| update_bytes(row.len()))
                                .sum::<usize>();
                            if pending.parts_bytes > self.limits.peek_part_bytes {
                                let limit = self.limits.peek_part_bytes;
                                let message = format!(
                                    "the answer to peek {} exceeds {limit} bytes held in parts",
                                    r.peek_id
                                );
                                // Asked again, it would be refused again: the
                                // peek fails and leaves the history.
                                let pending = self.peeks.remove(&r.peek_id).expect("present");
                                self.history.retire_peek(r.peek_id);
                                let _ = pending
                                    .reply
                                    .send(Err(ControllerError::Replica(message.clone())));
                                self.refuse_answer(p, message);
                                return;
                            }
                            pending.parts.entry(p).or_default().extend(rows);
                            return;
                        }
                        PeekResult::Rows(rows) => match pending.parts.remove(&p) {
                            Some(mut parts) => {
                                let bytes: usize =
                                    parts.iter().map(|(row, _)| update_bytes(row.len())).sum();
                                pending.parts_bytes = pending.parts_bytes.saturating_sub(bytes);
                                parts.extend(rows);
                                PeekResult::Rows(parts)
                            }
                            None => PeekResult::Rows(rows),
                        },
                        other => other,
                    };
                    pending.results.insert(p, result);
                    if pending.results.len() == n {
                        let pending = self.peeks.remove(&r.peek_id).expect("present");
                        self.history.retire_peek(r.peek_id);
                        let answer = match merge_peek(pending.results.into_values()) {
                            PeekResult::Rows(rows) | PeekResult::Part(rows) => Ok(rows),
                            PeekResult::Error(e) => Err(ControllerError::Replica(e)),
                            PeekResult::Canceled => {
                                Err(ControllerError::Replica("peek canceled".into()))
                            }
                        };
                        let _ = pending.reply.send(answer);
                    }
                }
            }
            ResponseKind::SubscribeResponse(b) => {
                let id = b.subscribe_id;
                if let Some(sub) = self.subs.get_mut(&id) {
                    let (out, held) = sub.push(p, b);
                    let mut stalled = false;
                    if let Some(out) = out {
                        if sub.sink.capacity() <= 1 {
                            // The receiver stopped reading: the last slot
                            // carries the error, and the subscription ends
                            // here and on the replica.
                            let _ = sub.sink.try_send(Err(ControllerError::Replica(format!(
                                "subscription {id}: the client left more than {} batches unread; ended",
                                crate::SUBSCRIBE_CHANNEL_BATCHES - 1
                            ))));
                            stalled = true;
                        } else {
                            let _ = sub.sink.try_send(Ok(out));
                        }
                    }
                    if stalled {
                        tracing::warn!(
                            subscribe_id = id,
                            "a subscriber did not keep up; ending its subscription"
                        );
                        self.subs.remove(&id);
                        self.send(CommandKind::CancelSubscribe { subscribe_id: id });
                    } else if sub.merge.is_done() {
                        self.subs.remove(&id);
                    } else if held > self.limits.subscribe_buffer_bytes {
                        let limit = self.limits.subscribe_buffer_bytes;
                        let message = format!(
                            "subscription {id} holds back more than {limit} bytes of updates past the processes' common upper"
                        );
                        // The subscription ends with an error and leaves
                        // the history (resent, it would grow again).
                        let sub = self.subs.remove(&id).expect("present");
                        let _ = sub
                            .sink
                            .try_send(Err(ControllerError::Replica(message.clone())));
                        self.refuse_answer(p, message);
                        self.history
                            .push(CommandKind::CancelSubscribe { subscribe_id: id });
                    }
                }
            }
            ResponseKind::Status(s) => {
                // Process p owns workers p*W..(p+1)*W: a status of another
                // worker is a lie (or a bug) that would stand in for that
                // worker's own report, and grow the status maps.
                let per = self.replica.workers_per_process as usize;
                let owned = p * per..(p + 1) * per;
                if !owned.contains(&(s.worker_index as usize)) {
                    self.refuse_answer(
                        p,
                        format!(
                            "a status of worker {}, which process {p} does not own (it owns workers {}..{})",
                            s.worker_index, owned.start, owned.end
                        ),
                    );
                    return;
                }
                // A Status before any HelloResponse: the process agreed
                // on version 2 (it sends a HelloResponse from 3 on).
                if let Some(v @ None) = self.versions.get_mut(p) {
                    *v = Some(crate::ProcessVersion {
                        protocol_version: 2,
                        build_version: None,
                    });
                }
                let full = s.history_hash.is_some();
                if full {
                    self.full_statuses.insert(s.worker_index, s.clone());
                    self.on_full_status(&s);
                }
                self.statuses.insert(s.worker_index, s);
                self.answer_status_waiters();
            }
            ResponseKind::HelloResponse(h) => {
                // The agreed version must be one this controller offered.
                let (low, high) = lockstep_protocol::handshake::SUPPORTED_VERSIONS;
                if !(low..=high).contains(&h.protocol_version) {
                    self.refuse_answer(
                        p,
                        format!(
                            "a HelloResponse agreeing on protocol version {}, outside the offered {low} to {high}",
                            h.protocol_version
                        ),
                    );
                    return;
                }
                tracing::info!(
                    process = p,
                    protocol_version = h.protocol_version,
                    build_version = %h.build_version,
                    "replica process agreed on a protocol version"
                );
                if let Some(v) = self.versions.get_mut(p) {
                    *v = Some(crate::ProcessVersion {
                        protocol_version: h.protocol_version,
                        // For display only: bounded, whatever the process sent.
                        build_version: Some(h.build_version.chars().take(64).collect()),
                    });
                }
            }
            ResponseKind::Error(error) => {
                tracing::warn!(process = p, ?error, "replica error");
                if error.kind == lockstep_protocol::ErrorKind::Malformed {
                    self.refuse_dataflow(p, &error);
                }
                self.emit(Event::ReplicaError { process: p, error });
            }
        }
    }

    /// Process `p` sent an answer the controller refuses (`reason`): the
    /// session ends with an error, reported as a lost connection, and the
    /// controller reconnects (with backoff).
    fn refuse_answer(&mut self, p: usize, reason: String) {
        tracing::error!(process = p, %reason, "refused a replica process's answer; ending the session");
        let reason = format!("refused answer: {reason}");
        self.emit(Event::Disconnected {
            process: p,
            reason: reason.clone(),
        });
        self.disconnect(format!("process {p}: {reason}"));
    }

    /// A process refused a frame as malformed; if it carried a
    /// CreateDataflow, that dataflow leaves the history (resent, it would be
    /// refused again, and the process drops the connection each time, so
    /// none of the replica's dataflows would answer) and the owner is told.
    fn refuse_dataflow(&mut self, process: usize, error: &ErrorResponse) {
        let Some(&id) = self.sent_creates.get(&error.seqno) else {
            return;
        };
        if self.history.forget_dataflow(id).is_some() {
            tracing::error!(
                process,
                dataflow = id,
                message = %error.message,
                "a replica process refused the dataflow's command as malformed: it leaves the history and is not resent"
            );
            self.emit(Event::DataflowRefused {
                dataflow: id,
                process,
                message: error.message.clone(),
            });
        }
    }

    /// See [`crate::Controller::process_lags`].
    fn process_lags(&self) -> Vec<Option<u64>> {
        let mut lags = vec![Some(0u64); self.replica.processes.len()];
        for d in self.history.live_dataflows() {
            let Some(written) = d.inputs.iter().map(|c| self.history.input_upper(*c)).min() else {
                continue;
            };
            for e in &d.exports {
                let reported = self.frontiers.get(&e.collection_id);
                for (p, lag) in lags.iter_mut().enumerate() {
                    let this = match reported.and_then(|r| r.get(&p)) {
                        None => None,
                        // Complete: nothing more to come.
                        Some(None) => Some(0),
                        Some(Some(t)) => Some(written.saturating_sub(*t)),
                    };
                    *lag = match (*lag, this) {
                        (Some(a), Some(b)) => Some(a.max(b)),
                        _ => None,
                    };
                }
            }
        }
        lags
    }

    /// The meet of a collection's frontier over all processes, once every
    /// process reported it.
    fn frontier_of(&self, collection: u64) -> Option<Frontier> {
        self.frontiers
            .get(&collection)
            .and_then(|per| (per.len() == self.replica.processes.len()).then(|| meet(per.values())))
    }

    fn answer_frontier_waiters(&mut self) {
        let waiters = std::mem::take(&mut self.frontier_waiters);
        for (c, t, reply) in waiters {
            if reply.is_closed() {
                continue;
            }
            match self.frontier_of(c) {
                Some(f) if f.is_none_or(|f| f > t) => {
                    let _ = reply.send(());
                }
                _ => self.frontier_waiters.push((c, t, reply)),
            }
        }
    }

    /// Sends a StatusRequest; returns its (nonce, sequence number) if connected.
    fn request_status(&mut self, full: bool) -> Option<(u64, u64)> {
        if !self.phase().is_connected() {
            return None;
        }
        self.broadcast(CommandKind::StatusRequest { full });
        Some((self.session.nonce(), self.seqno))
    }

    fn answer_status_waiters(&mut self) {
        let total = self.replica.total_workers();
        let epoch = self.epoch;
        let waiters = std::mem::take(&mut self.status_waiters);
        for (at, full, reply) in waiters {
            if reply.is_closed() {
                continue;
            }
            let Some((nonce, seqno)) = at else {
                self.status_waiters.push((at, full, reply));
                continue;
            };
            let map = if full {
                &self.full_statuses
            } else {
                &self.statuses
            };
            let fresh = map
                .values()
                .filter(|s| s.epoch == epoch && s.nonce == nonce && s.applied_seqno >= seqno)
                .count();
            if fresh == total {
                let _ = reply.send(map.values().cloned().collect());
            } else {
                self.status_waiters.push((at, full, reply));
            }
        }
    }

    fn on_tick(&mut self) {
        if !self.phase().is_connected() {
            return;
        }
        if matches!(self.phase(), Phase::AwaitingHistories { .. }) {
            self.check_histories();
        }
        // Peeks whose caller gave up are canceled.
        let abandoned: Vec<u64> = self
            .peeks
            .iter()
            .filter(|(_, p)| p.reply.is_closed())
            .map(|(id, _)| *id)
            .collect();
        for id in abandoned {
            self.peeks.remove(&id);
            self.send(CommandKind::CancelPeek { peek_id: id });
        }
        // Subscriptions whose receiver went away are canceled (and leave
        // the history).
        let abandoned: Vec<u64> = self
            .subs
            .iter()
            .filter(|(_, s)| s.sink.is_closed())
            .map(|(id, _)| *id)
            .collect();
        for id in abandoned {
            self.subs.remove(&id);
            self.send(CommandKind::CancelSubscribe { subscribe_id: id });
        }
        // What every worker of this session applied (once all reported).
        let applied: Vec<u64> = self
            .statuses
            .values()
            .filter(|s| s.epoch == self.epoch && s.nonce == self.session.nonce())
            .map(|s| s.applied_seqno)
            .collect();
        if applied.len() == self.replica.total_workers() {
            self.forget_applied_status_requests(applied.into_iter().min().unwrap_or(0));
        }
        self.broadcast(CommandKind::StatusRequest { full: false });
        let now = Instant::now();
        for p in 0..self.last_heard.len() {
            let silent = now - self.last_heard[p];
            if silent > self.timeouts.heartbeat_timeout && !self.silent_reported[p] {
                self.silent_reported[p] = true;
                tracing::error!(process = p, ?silent, "replica process is silent");
                self.emit(Event::ProcessSilent {
                    process: p,
                    silent_for: silent,
                });
            }
        }
    }
}

/// The first peek or subscribe ID of a controller of `epoch`: the epoch in
/// the upper 32 bits, a counter from 1 in the lower.
fn first_request_id(epoch: u64) -> u64 {
    (epoch << 32) | 1
}

#[cfg(test)]
mod tests {
    //! What a replica sends cannot make the controller keep more than a
    //! bound, nor pass one worker's answer off as another's: each check
    //! below ends the session with an error (a `Disconnected` event).

    use lockstep_protocol::{PeekResponse, Response, Update};

    use super::*;

    struct Harness {
        actor: Actor,
        events: broadcast::Receiver<Event>,
        _peers: Vec<tokio::net::TcpStream>,
        _from_conns: mpsc::UnboundedReceiver<FromConn>,
        _connected: mpsc::UnboundedReceiver<(u64, Result<Vec<connection::Connected>, String>)>,
    }

    /// A controller of `processes` x `workers` whose session is past
    /// Hello, over sockets that stand in for the processes.
    async fn connected(processes: usize, workers: u32) -> Harness {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let replica = ReplicaAddrs {
            replica_id: 1,
            processes: vec![addr.into(); processes],
            workers_per_process: workers,
            command_log: None,
            session_key: None,
            one_way_proof: false,
            max_frame_len: lockstep_protocol::DEFAULT_MAX_FRAME_LEN,
        };
        let timeouts = Timeouts {
            connect: Duration::from_secs(5),
            heartbeat_interval: Duration::from_millis(100),
            heartbeat_timeout: Duration::from_secs(2),
            request: Duration::from_secs(20),
        };
        let (events_tx, events) = broadcast::channel(1024);
        let (mut actor, from_conns, connected_rx) = Actor::new(
            replica,
            1,
            CommandHistory::new(),
            Box::new(lockstep_policy::FixedStrategy(Strategy::Barrier)),
            timeouts,
            events_tx,
        );
        actor.session.connect();
        let mut socks = Vec::new();
        let mut peers = Vec::new();
        for _ in 0..processes {
            socks.push(connection::Connected::plain(
                tokio::net::TcpStream::connect(addr).await.unwrap(),
            ));
            peers.push(listener.accept().await.unwrap().0);
        }
        let generation = actor.generation;
        actor.on_connected(generation, Ok(socks));
        assert!(actor.phase().is_connected(), "{:?}", actor.phase());
        Harness {
            actor,
            events,
            _peers: peers,
            _from_conns: from_conns,
            _connected: connected_rx,
        }
    }

    impl Harness {
        /// Process `p` answers `kind`.
        fn answer(&mut self, p: usize, kind: ResponseKind) {
            let generation = self.actor.generation;
            self.actor.on_conn(FromConn {
                process: p,
                generation,
                event: ConnEvent::Response(Response {
                    process_index: p as u32,
                    kind,
                }),
            });
        }

        /// The reason the session ended, if it did.
        fn ended(&mut self) -> Option<String> {
            while let Ok(e) = self.events.try_recv() {
                if let Event::Disconnected { reason, .. } = e {
                    assert!(
                        matches!(self.actor.phase(), Phase::Connecting { .. }),
                        "{:?}",
                        self.actor.phase()
                    );
                    return Some(reason);
                }
            }
            None
        }
    }

    fn status(worker_index: u32) -> Status {
        Status {
            worker_index,
            epoch: 1,
            nonce: 1,
            applied_seqno: 0,
            history_hash: None,
            creation_log: Vec::new(),
            installed: Vec::new(),
        }
    }

    #[tokio::test]
    async fn a_status_of_a_worker_the_process_does_not_own_ends_the_session() {
        let mut h = connected(2, 2).await;
        // Process 1 owns workers 2 and 3.
        h.answer(1, ResponseKind::Status(status(2)));
        h.answer(1, ResponseKind::Status(status(3)));
        assert_eq!(h.ended(), None);
        h.answer(1, ResponseKind::Status(status(0)));
        let reason = h.ended().expect("the session ended");
        assert!(
            reason.contains("worker 0") && reason.contains("does not own"),
            "{reason}"
        );
        assert!(!h.actor.statuses.contains_key(&0));

        // A worker index past the replica's workers.
        let mut h = connected(2, 2).await;
        h.answer(0, ResponseKind::Status(status(u32::MAX)));
        assert!(h.ended().is_some());
        assert!(h.actor.statuses.is_empty());
    }

    #[tokio::test]
    async fn a_response_naming_another_process_ends_the_session() {
        let mut h = connected(2, 1).await;
        let generation = h.actor.generation;
        h.actor.on_conn(FromConn {
            process: 0,
            generation,
            event: ConnEvent::Response(Response {
                process_index: 1,
                kind: ResponseKind::Frontiers(Vec::new()),
            }),
        });
        let reason = h.ended().expect("the session ended");
        assert!(reason.contains("names process 1"), "{reason}");
    }

    #[tokio::test]
    async fn frontiers_of_too_many_unknown_collections_end_the_session() {
        let mut h = connected(1, 1).await;
        h.actor.limits.unknown_frontiers = 10;
        // Known collections do not count.
        h.actor.send(CommandKind::CreateDataflow(
            lockstep_protocol::DataflowDescription {
                id: 1,
                as_of: 0,
                inputs: vec![1],
                exports: vec![lockstep_protocol::Export {
                    collection_id: 1001,
                    plan: lockstep_protocol::Plan::Get { collection_id: 1 },
                }],
                debug_name: "d".into(),
            },
        ));
        h.answer(
            0,
            ResponseKind::Frontiers(vec![(1, Some(1)), (1001, Some(1))]),
        );
        h.answer(
            0,
            ResponseKind::Frontiers((5000..5010).map(|c| (c, Some(1))).collect()),
        );
        // Again: the same collections are not counted twice.
        h.answer(
            0,
            ResponseKind::Frontiers((5000..5010).map(|c| (c, Some(2))).collect()),
        );
        assert_eq!(h.ended(), None);
        h.answer(0, ResponseKind::Frontiers(vec![(6000, Some(1))]));
        let reason = h.ended().expect("the session ended");
        assert!(reason.contains("does not know"), "{reason}");
        assert!(h.actor.frontiers.len() <= 12);
    }

    #[tokio::test]
    async fn peek_parts_past_the_bound_end_the_session_and_fail_the_peek() {
        let mut h = connected(2, 1).await;
        h.actor.limits.peek_part_bytes = 100 * update_bytes(1);
        let (reply, mut answer) = oneshot::channel();
        h.actor.on_request(Request::Peek {
            collection: 1001,
            timestamp: 0,
            reply,
        });
        let peek_id = h.actor.next_peek_id - 1;
        let part = |n: i64| {
            ResponseKind::PeekResponse(PeekResponse {
                peek_id,
                result: PeekResult::Part((0..n).map(|i| (vec![i], 1)).collect()),
            })
        };
        // Within the bound, over both processes.
        h.answer(0, part(50));
        h.answer(1, part(40));
        assert_eq!(h.ended(), None);
        assert!(answer.try_recv().is_err(), "not answered yet");
        h.answer(0, part(20));
        let reason = h.ended().expect("the session ended");
        assert!(reason.contains(&format!("peek {peek_id}")), "{reason}");
        let err = answer.try_recv().expect("answered").unwrap_err();
        assert!(err.to_string().contains("exceeds"), "{err}");
        assert!(h.actor.peeks.is_empty());
    }

    /// The campaign's defect (seed 6, barrier): after an environment
    /// restart, a restarted replica replayed an earlier controller's peek
    /// from the command log, and its answer, carrying the same peek ID as
    /// the new controller's first peek, was taken as that peek's answer.
    /// IDs now carry the epoch: the old answer matches nothing.
    #[tokio::test]
    async fn an_answer_to_an_earlier_controllers_peek_is_not_taken_for_ours() {
        let mut h = connected(1, 1).await;
        let (reply, mut answer) = oneshot::channel();
        h.actor.on_request(Request::Peek {
            collection: 1001,
            timestamp: 0,
            reply,
        });
        let ours = h.actor.next_peek_id - 1;
        // The same counter value under the previous epoch (0): what the
        // earlier controller's first peek was numbered.
        let earlier = first_request_id(0);
        assert_ne!(earlier, ours);
        h.answer(
            0,
            ResponseKind::PeekResponse(PeekResponse {
                peek_id: earlier,
                result: PeekResult::Rows(vec![(vec![666], 1)]),
            }),
        );
        assert!(
            answer.try_recv().is_err(),
            "an earlier peek's rows were taken"
        );
        h.answer(
            0,
            ResponseKind::PeekResponse(PeekResponse {
                peek_id: ours,
                result: PeekResult::Rows(vec![(vec![1], 1)]),
            }),
        );
        assert_eq!(
            answer.try_recv().expect("answered").unwrap(),
            vec![(vec![1], 1)]
        );
    }

    #[tokio::test]
    async fn completed_peek_parts_are_not_counted_against_the_next() {
        let mut h = connected(1, 1).await;
        h.actor.limits.peek_part_bytes = 100 * update_bytes(1);
        let (reply, mut answer) = oneshot::channel();
        h.actor.on_request(Request::Peek {
            collection: 1001,
            timestamp: 0,
            reply,
        });
        let peek_id = h.actor.next_peek_id - 1;
        let rows = |n: i64| (0..n).map(|i| (vec![i], 1)).collect::<Vec<_>>();
        h.answer(
            0,
            ResponseKind::PeekResponse(PeekResponse {
                peek_id,
                result: PeekResult::Part(rows(90)),
            }),
        );
        h.answer(
            0,
            ResponseKind::PeekResponse(PeekResponse {
                peek_id,
                result: PeekResult::Rows(rows(5)),
            }),
        );
        assert_eq!(h.ended(), None);
        assert_eq!(answer.try_recv().unwrap().unwrap().len(), 90);
    }

    fn batch(id: u64, lower: u64, upper: Frontier, times: std::ops::Range<u64>) -> ResponseKind {
        ResponseKind::SubscribeResponse(SubscribeBatch {
            subscribe_id: id,
            lower,
            upper,
            updates: times
                .map(|t| Update {
                    row: vec![t as i64],
                    time: t,
                    diff: 1,
                })
                .collect(),
        })
    }

    /// A client that stops reading is cut off with an error as its last
    /// item, not buffered without end; the session goes on.
    #[tokio::test]
    async fn a_stalled_subscriber_is_cut_off_not_buffered() {
        let mut h = connected(1, 1).await;
        let (sink, mut out) = mpsc::channel(crate::SUBSCRIBE_CHANNEL_BATCHES);
        h.actor.on_request(Request::Subscribe {
            collection: 1001,
            as_of: 0,
            sink,
        });
        let id = h.actor.next_subscribe_id - 1;
        for t in 0..crate::SUBSCRIBE_CHANNEL_BATCHES as u64 + 10 {
            h.answer(0, batch(id, t, Some(t + 1), t..t + 1));
        }
        assert_eq!(h.ended(), None, "the session goes on");
        assert!(h.actor.subs.is_empty(), "the subscription ended");
        let mut items = 0;
        let mut last = None;
        while let Ok(item) = out.try_recv() {
            items += 1;
            last = Some(item);
        }
        assert_eq!(items, crate::SUBSCRIBE_CHANNEL_BATCHES);
        let err = last
            .expect("items")
            .expect_err("the last item is the error");
        assert!(err.to_string().contains("unread"), "{err}");
    }

    #[tokio::test]
    async fn a_subscription_held_back_past_the_bound_ends_the_session() {
        let mut h = connected(2, 1).await;
        h.actor.limits.subscribe_buffer_bytes = 100 * update_bytes(1);
        let (sink, mut out) = mpsc::channel(crate::SUBSCRIBE_CHANNEL_BATCHES);
        h.actor.on_request(Request::Subscribe {
            collection: 1001,
            as_of: 0,
            sink,
        });
        let id = h.actor.next_subscribe_id - 1;
        // Both processes advance together: what is emitted is not held.
        for round in 0..5u64 {
            let (lo, hi) = (round * 80, (round + 1) * 80);
            h.answer(0, batch(id, lo, Some(hi), lo..hi));
            h.answer(1, batch(id, lo, Some(hi), lo..hi));
            assert_eq!(h.ended(), None, "round {round}");
            // (Both sent the same rows: consolidated, one row each, diff 2.)
            assert_eq!(out.try_recv().unwrap().unwrap().updates.len(), 80);
        }
        // Process 1 runs ahead while process 0 stays: its updates are held
        // back until the bound.
        h.answer(1, batch(id, 400, Some(460), 400..460));
        assert_eq!(h.ended(), None);
        h.answer(1, batch(id, 460, Some(520), 460..520));
        let reason = h.ended().expect("the session ended");
        assert!(reason.contains(&format!("subscription {id}")), "{reason}");
        assert!(
            out.try_recv().unwrap().is_err(),
            "the subscription ends with an error"
        );
        assert!(h.actor.subs.is_empty());
    }
}
