//! The task that owns a controller's state: connections, history, merges.
//!
//! One task handles, in one order, the owner's requests, what the
//! connections forward and a heartbeat tick. This module holds the state
//! ([`Actor`]), [`spawn`], the event loop and the tick; the rest is split
//! by concern:
//!
//! - `requests`: the owner's requests, and the status and frontier waiters;
//! - `responses`: what the processes send, merged across processes, and
//!   refusals of answers past the bounds ([`Limits`]);
//! - `subscribe`: a subscription's merge and its bound;
//! - `session`: the shell of the session machine
//!   ([`lockstep_reconcile::ControllerSession`]: connect, Hello and replay,
//!   the history check, InitializationComplete, disconnect);
//! - `failpoint`: the partial-broadcast failpoint;
//! - `deliver`: asks the policy and performs the machine's delivery
//!   decisions (which strategy a command is sent with, and how it reaches
//!   the processes); `log`: the command log's appends, batch, truncation.

mod deliver;
mod failpoint;
mod log;
mod requests;
mod responses;
mod session;
mod subscribe;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use lockstep_command_log::AnyLog;
use lockstep_policy::{DistributionPolicy, MismatchAction};
use lockstep_protocol::merge::{meet, merge_peek, SubscribeMerge};
use lockstep_protocol::{
    CommandHistory, CommandKind, ErrorResponse, Frontier, Peek, PeekResult, ResponseKind, Row,
    Status, Subscribe, SubscribeBatch,
};
use lockstep_reconcile::{ControllerSession, ReplicaDelivery};
use tokio::sync::{broadcast, mpsc, oneshot};
use tokio::time::Instant;

use crate::connection::{self, Conn, ConnEvent, FromConn};
use crate::{ControllerError, ReplicaAddrs, Request, Timeouts};

pub(crate) use failpoint::{CrashHook, Reach};
pub(crate) use lockstep_reconcile::Phase;
use subscribe::update_bytes;
pub(crate) use subscribe::Sub;

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
    /// A process refused the CreateDataflow of `dataflow`: as malformed (its
    /// frame did not decode there: too large for the process's frame limit,
    /// too deep for its decoder, or a build that does not know a field), or
    /// as invalid (its family refused the description, or the ID is taken
    /// by another description). The dataflow left the controller's history, so it is not resent; the
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

/// The state of one controller, owned by its task. Where the session is,
/// and how it delivers, is only in `session`.
pub(crate) struct Actor {
    pub(crate) replica: ReplicaAddrs,
    pub(crate) epoch: u64,
    timeouts: Timeouts,
    pub(crate) policy: Box<dyn DistributionPolicy + Send>,
    /// The replica's command log, opened at the first log session.
    pub(crate) log: Option<AnyLog>,
    /// The command log being opened on a blocking thread since the actor
    /// started, so that the first session's marker does not wait for it.
    pub(crate) log_opening:
        Option<std::sync::mpsc::Receiver<Result<AnyLog, lockstep_command_log::LogError>>>,
    /// While a log session starts: the commands to append in one go, each
    /// with the failpoint's crash point, and the per-process Hellos.
    pub(crate) log_batch: Option<log::LogBatch>,
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
    distribution: crate::Distribution,
    timeouts: Timeouts,
    mut requests: mpsc::UnboundedReceiver<Request>,
    events: broadcast::Sender<Event>,
) {
    let (mut actor, mut from_conns, mut connected_rx) =
        Actor::new(replica, epoch, history, distribution, timeouts, events);
    if let Some(location) = actor.replica.command_log.clone() {
        let (tx, rx) = std::sync::mpsc::channel();
        actor.log_opening = Some(rx);
        tokio::task::spawn_blocking(move || {
            let _ = tx.send(AnyLog::open(&location));
        });
    }
    // Every line the controller (and the connection tasks it spawns) logs
    // names its replica.
    let span = tracing::info_span!("controller", replica = actor.replica.replica_id);
    tokio::spawn(tracing::Instrument::instrument(
        async move {
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
        },
        span,
    ));
}

impl Actor {
    /// A controller's state, not connected, with the receivers of what its
    /// connections forward and of its connection attempts.
    #[allow(clippy::type_complexity)]
    fn new(
        replica: ReplicaAddrs,
        epoch: u64,
        mut history: CommandHistory,
        crate::Distribution { policy, rules }: crate::Distribution,
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
        let delivery = ReplicaDelivery {
            processes: n,
            command_log: replica.command_log.is_some(),
            rules,
        };
        let actor = Actor {
            replica,
            epoch,
            timeouts,
            policy,
            log: None,
            log_opening: None,
            log_batch: None,
            crash_hook: CrashHook::default(),
            log_marker: None,
            log_status_requests: Default::default(),
            session: ControllerSession::new(replica_workers, delivery),
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
        // A write's digest is computed once, here, for the history and for
        // every worker.
        let kind = match kind {
            CommandKind::WriteInput(w) => CommandKind::WriteInput(w.digested()),
            kind => kind,
        };
        if !matches!(
            kind,
            CommandKind::InitializationComplete | CommandKind::StatusRequest { .. }
        ) {
            note_collections(&mut self.known_collections, &kind);
            self.history.push(kind.clone());
        }
        self.broadcast(kind);
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
mod tests;
