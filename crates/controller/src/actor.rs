//! The task that owns a controller's state: connections, history, merges.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use lockstep_command_log::{CommandLog, SqliteLog};
use lockstep_policy::{
    CommandClass, CommandInfo, DistributionPolicy, MismatchAction, MismatchInfo,
};
use lockstep_protocol::merge::{meet, merge_peek, SubscribeMerge};
use lockstep_protocol::{
    Command, CommandHistory, CommandKind, ErrorResponse, Frontier, Peek, PeekResult, ResponseKind,
    Row, Status, Strategy, Subscribe, SubscribeBatch, WireMessage,
};
use lockstep_reconcile::{InitializationDecision, InitializationGate};
use tokio::sync::{broadcast, mpsc, oneshot};
use tokio::time::Instant;

use crate::connection::{self, Conn, ConnEvent, FromConn};
use crate::{ControllerError, ReplicaAddrs, Request, Timeouts};

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
    /// Appending to the command log failed (fenced out by a newer
    /// controller, or a broken store): the controller stopped.
    LogFailed {
        /// Why.
        message: String,
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

struct PendingPeek {
    results: BTreeMap<usize, PeekResult>,
    reply: oneshot::Sender<Result<Vec<(Row, i64)>, ControllerError>>,
}

/// The start of a log session, appended to the log in one transaction.
#[derive(Default)]
struct LogBatch {
    hellos: Vec<Command>,
    commands: Vec<(Command, Option<Reach>)>,
}

struct Actor {
    replica: ReplicaAddrs,
    epoch: u64,
    timeouts: Timeouts,
    policy: Box<dyn DistributionPolicy + Send>,
    fallback: Strategy,
    /// The strategy chosen for this session's Hello. Broadcast and log order
    /// commands themselves, so a session that starts with one of them sends
    /// every command with it; a socket-ordered session (barrier, naive) asks
    /// the policy per command.
    session_strategy: Strategy,
    /// The replica's command log, opened at the first log session.
    log: Option<SqliteLog>,
    /// While a log session starts: the commands to append in one go, each
    /// with the failpoint's crash point, and the per-process Hellos.
    log_batch: Option<LogBatch>,
    /// Since when this session waits for every worker's answer to Hello
    /// (the history check); `None` once InitializationComplete was sent.
    hello_check: Option<Instant>,
    /// The log offset of this session's Hello marker (log sessions).
    log_marker: Option<u64>,
    history: CommandHistory,
    nonce: u64,
    generation: u64,
    current_generation: Arc<AtomicU64>,
    seqno: u64,
    conns: Vec<Option<Conn>>,
    connected: bool,
    connecting: bool,
    crashed: bool,
    reconciling: bool,
    last_heard: Vec<Instant>,
    silent_reported: Vec<bool>,
    frontiers: BTreeMap<u64, BTreeMap<usize, Frontier>>,
    peeks: BTreeMap<u64, PendingPeek>,
    next_peek_id: u64,
    next_subscribe_id: u64,
    subs: BTreeMap<u64, (SubscribeMerge, mpsc::UnboundedSender<SubscribeBatch>)>,
    statuses: BTreeMap<u32, Status>,
    /// The latest full status (history digest and creation log) per worker.
    full_statuses: BTreeMap<u32, Status>,
    /// Callers waiting for a Status from every worker that answers the
    /// StatusRequest with this (nonce, sequence number), or a later one.
    status_waiters: Vec<StatusWaiter>,
    frontier_waiters: Vec<(u64, u64, oneshot::Sender<()>)>,
    events: broadcast::Sender<Event>,
    to_self: mpsc::UnboundedSender<FromConn>,
    connected_tx: mpsc::UnboundedSender<(u64, Result<Vec<tokio::net::TcpStream>, String>)>,
}

pub(crate) fn spawn(
    replica: ReplicaAddrs,
    epoch: u64,
    mut history: CommandHistory,
    policy: Box<dyn DistributionPolicy + Send>,
    timeouts: Timeouts,
    mut requests: mpsc::UnboundedReceiver<Request>,
    events: broadcast::Sender<Event>,
) {
    if !history
        .commands()
        .iter()
        .any(|c| matches!(c, CommandKind::CreateInstance(_)))
    {
        history.push(CommandKind::CreateInstance(Default::default()));
    }
    let n = replica.processes.len();
    let (to_self, mut from_conns) = mpsc::unbounded_channel();
    let (connected_tx, mut connected_rx) = mpsc::unbounded_channel();
    let mut actor = Actor {
        replica,
        epoch,
        timeouts,
        policy,
        fallback: Strategy::Barrier,
        session_strategy: Strategy::Barrier,
        log: None,
        log_batch: None,
        hello_check: None,
        log_marker: None,
        history,
        nonce: 0,
        generation: 0,
        current_generation: Arc::new(AtomicU64::new(0)),
        seqno: 0,
        conns: (0..n).map(|_| None).collect(),
        connected: false,
        connecting: false,
        crashed: false,
        reconciling: false,
        last_heard: vec![Instant::now(); n],
        silent_reported: vec![false; n],
        frontiers: BTreeMap::new(),
        peeks: BTreeMap::new(),
        next_peek_id: 1,
        next_subscribe_id: 1,
        subs: BTreeMap::new(),
        statuses: BTreeMap::new(),
        full_statuses: BTreeMap::new(),
        status_waiters: Vec::new(),
        frontier_waiters: Vec::new(),
        events,
        to_self,
        connected_tx,
    };
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
            if actor.crashed {
                break;
            }
        }
        actor.current_generation.store(u64::MAX, Ordering::SeqCst);
        tracing::info!("controller shut down");
    });
}

impl Actor {
    fn emit(&self, e: Event) {
        let _ = self.events.send(e);
    }

    fn start_connecting(&mut self) {
        if self.connecting {
            return;
        }
        self.connecting = true;
        self.generation += 1;
        let generation = self.generation;
        self.current_generation.store(generation, Ordering::SeqCst);
        let current = Arc::clone(&self.current_generation);
        let addrs = self.replica.processes.clone();
        let bound = self.timeouts.connect;
        let tx = self.connected_tx.clone();
        // Keeps trying until every process is connected, or a newer attempt
        // (or shutdown) supersedes this one; each failed round is reported.
        tokio::spawn(async move {
            'attempt: loop {
                let deadline = Instant::now() + bound;
                let mut socks = Vec::new();
                for a in &addrs {
                    match connection::connect(*a, deadline).await {
                        Ok(s) => socks.push(s),
                        Err(e) => {
                            if current.load(Ordering::SeqCst) != generation
                                || tx.send((generation, Err(e))).is_err()
                            {
                                return;
                            }
                            tokio::time::sleep(Duration::from_millis(200)).await;
                            continue 'attempt;
                        }
                    }
                }
                let _ = tx.send((generation, Ok(socks)));
                return;
            }
        });
    }

    fn on_connected(
        &mut self,
        generation: u64,
        result: Result<Vec<tokio::net::TcpStream>, String>,
    ) {
        if generation != self.generation {
            return;
        }
        let socks = match result {
            Ok(s) => s,
            Err(reason) => {
                tracing::warn!(%reason, "connecting to every replica process failed; still trying");
                self.emit(Event::ConnectFailed { reason });
                return;
            }
        };
        self.connecting = false;
        if socks.is_empty() {
            return;
        }
        // Increasing per connection attempt within our epoch: replicas order
        // sessions by (epoch, nonce), and a barrier round of an older
        // session is abandoned once a worker joined a newer one.
        self.nonce += 1;
        self.seqno = 0;
        self.conns = socks
            .into_iter()
            .enumerate()
            .map(|(i, s)| Some(connection::spawn(s, i, generation, self.to_self.clone())))
            .collect();
        self.connected = true;
        let now = Instant::now();
        self.last_heard = vec![now; self.conns.len()];
        self.silent_reported = vec![false; self.conns.len()];
        self.frontiers.clear();
        self.statuses.clear();
        self.full_statuses.clear();
        for p in self.peeks.values_mut() {
            p.results.clear();
        }
        for (m, _) in self.subs.values_mut() {
            m.restart();
        }
        // Hello to every process, then the compacted history, then
        // InitializationComplete: the replica reconciles to this target.
        let first = CommandKind::Hello(self.replica.identity(0).hello(self.epoch, self.nonce));
        self.session_strategy = self.choose(&first);
        if matches!(self.session_strategy, Strategy::Log) {
            self.log_batch = Some(LogBatch::default());
        }
        for i in 0..self.conns.len() {
            let hello = Command {
                seqno: 0,
                strategy: self.session_strategy,
                kind: CommandKind::Hello(self.replica.identity(i).hello(self.epoch, self.nonce)),
            };
            match &mut self.log_batch {
                Some(batch) => batch.hellos.push(hello),
                None => self.write(i, hello),
            }
        }
        self.reconciling = true;
        self.history.reduce();
        let commands: Vec<CommandKind> = self
            .history
            .commands()
            .iter()
            .filter(|c| !matches!(c, CommandKind::InitializationComplete))
            .cloned()
            .collect();
        let replayed = commands.len();
        for c in commands {
            self.broadcast(c);
        }
        self.flush_log_batch();
        if self.crashed {
            return;
        }
        tracing::debug!(
            nonce = self.nonce,
            replayed,
            "Hello and target sent; waiting for every worker's history before InitializationComplete"
        );
        self.hello_check = Some(Instant::now());
    }

    /// The history check: once every worker answered
    /// this session's Hello with its full status, compare what they report
    /// (their creation logs and installed dataflows); if they differ, the
    /// distribution policy decides: reconcile collectively (a naive session's
    /// InitializationComplete is then sent with `barrier`, which makes the
    /// replica reconcile collectively), or restart the replica (reported as
    /// [`Event::HistoryMismatch`]; the environment restarts it). Then
    /// InitializationComplete ends the reconciliation. Without every answer
    /// within the request bound, it goes ahead unchecked, and says so.
    fn check_histories(&mut self, timed_out: bool) {
        let Some(since) = self.hello_check else {
            return;
        };
        let nonce = self.nonce;
        let reported: Vec<Status> = self
            .full_statuses
            .values()
            .filter(|s| s.epoch == self.epoch && s.nonce == nonce)
            .cloned()
            .collect();
        let digests: Vec<lockstep_protocol::Digest> = reported.iter().map(state_digest).collect();
        let gate = InitializationGate::new(self.replica.total_workers());
        let mut collective = false;
        match gate.decide(&digests, timed_out) {
            InitializationDecision::Wait => return,
            InitializationDecision::Unchecked { answered } => {
                tracing::warn!(
                    answered,
                    total = self.replica.total_workers(),
                    waited = ?since.elapsed(),
                    "not every worker answered Hello in time; completing initialization without the history check"
                );
            }
            InitializationDecision::Complete => self.truncate_log(),
            InitializationDecision::Mismatch { distinct } => {
                self.truncate_log();
                let own = self.history.digest();
                let info = MismatchInfo {
                    process_count: self.replica.processes.len() as u32,
                    distinct_digests: distinct,
                    matching_controller: reported
                        .iter()
                        .filter(|s| s.history_hash == Some(own))
                        .count() as u32,
                };
                let action = match self.policy.on_mismatch(&info) {
                    Ok(a) => a,
                    Err(e) => {
                        tracing::warn!(error = %e, "distribution policy failed on a history mismatch; reconciling collectively");
                        MismatchAction::ReconcileCollectively
                    }
                };
                tracing::warn!(
                    distinct,
                    ?action,
                    "workers disagree about what they applied"
                );
                collective = action == MismatchAction::ReconcileCollectively;
                self.emit(Event::HistoryMismatch {
                    distinct_digests: distinct,
                    action,
                });
                if action == MismatchAction::RestartReplica {
                    // Not in lockstep: serve nothing until the replica was
                    // restarted (the connections drop, and the next session
                    // checks again). Asked again after every request bound.
                    tracing::error!(
                        "the replica must be restarted; initialization stays incomplete until it is"
                    );
                    self.hello_check = Some(Instant::now());
                    return;
                }
            }
        }
        self.hello_check = None;
        self.complete_initialization(collective);
    }

    /// Every worker read this log session's marker (it answered the Hello
    /// there), and a fresh replica starts at the newest marker: what came
    /// before it is needed by no one. A failure only leaves the entries.
    fn truncate_log(&mut self) {
        let (Some(marker), Some(log)) = (self.log_marker.take(), self.log.as_mut()) else {
            return;
        };
        match log.truncate_before(self.epoch, marker) {
            Ok(gone) => tracing::debug!(marker, gone, "command log truncated"),
            Err(e) => tracing::warn!(error = %e, "command log truncation failed; entries kept"),
        }
    }

    fn complete_initialization(&mut self, collective: bool) {
        let strategy = self.strategy_for(&CommandKind::InitializationComplete);
        let strategy = if collective && strategy == Strategy::Naive {
            Strategy::Barrier
        } else {
            strategy
        };
        self.broadcast_with(CommandKind::InitializationComplete, strategy);
        if self.crashed || !self.connected {
            return;
        }
        self.reconciling = false;
        tracing::info!(
            nonce = self.nonce,
            "connected to every process and rehydrated"
        );
        // Status requests made before this session are asked again.
        let nonce = self.nonce;
        if self
            .status_waiters
            .iter()
            .any(|(at, _, _)| at.is_none_or(|(n, _)| n != nonce))
        {
            let at = self.request_status(true);
            for (w, _, _) in self.status_waiters.iter_mut() {
                if w.is_none_or(|(n, _)| n != nonce) {
                    *w = at;
                }
            }
        }
        self.emit(Event::Connected { nonce: self.nonce });
    }

    fn write(&mut self, i: usize, cmd: Command) {
        if let Some(c) = &self.conns[i] {
            if c.writer.send(cmd).is_err() {
                self.conns[i] = None;
            }
        }
    }

    /// The strategy of a command in this session (see `session_strategy`).
    fn strategy_for(&mut self, kind: &CommandKind) -> Strategy {
        match self.session_strategy {
            s @ (Strategy::Broadcast | Strategy::Log) => s,
            _ => match self.choose(kind) {
                s @ (Strategy::Broadcast | Strategy::Log) => {
                    tracing::warn!(
                        chosen = %s,
                        session = %self.session_strategy,
                        fallback = %self.fallback,
                        "the policy chose an ordering strategy for a command of a socket-ordered session; using the fallback (choose it for Hello to use it for a whole session)"
                    );
                    self.fallback
                }
                s => s,
            },
        }
    }

    /// What the policy chooses for `kind`; a log choice without a command
    /// log, or a failing policy, gets the fallback.
    fn choose(&mut self, kind: &CommandKind) -> Strategy {
        let info = CommandInfo {
            class: CommandClass::of(kind),
            size_bytes: encoded_size(kind),
            dataflow_id: match kind {
                CommandKind::CreateDataflow(d) => Some(d.id),
                CommandKind::Schedule { dataflow_id } => Some(*dataflow_id),
                _ => None,
            },
            process_count: self.replica.processes.len() as u32,
            workers_per_process: self.replica.workers_per_process,
            reconciling: self.reconciling,
        };
        match self.policy.choose(&info) {
            Ok(Strategy::Log) if self.replica.command_log.is_none() => {
                tracing::warn!(fallback = %self.fallback, "the policy chose the log strategy but the replica has no command log; using the fallback");
                self.fallback
            }
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, fallback = %self.fallback, "distribution policy failed; using the fallback");
                self.fallback
            }
        }
    }

    /// Sends a command to every process (if connected).
    fn broadcast(&mut self, kind: CommandKind) {
        if !self.connected {
            return;
        }
        let strategy = self.strategy_for(&kind);
        self.broadcast_with(kind, strategy);
    }

    /// Sends a command to every process with `strategy`.
    fn broadcast_with(&mut self, kind: CommandKind, strategy: Strategy) {
        if !self.connected {
            return;
        }
        let crash = partial_broadcast(kind.name());
        self.seqno += 1;
        let cmd = Command {
            seqno: self.seqno,
            strategy,
            kind,
        };
        if strategy == Strategy::Log {
            if let Some(batch) = &mut self.log_batch {
                batch.commands.push((cmd, crash));
                return;
            }
            // The log is the truth: append first; the socket copies only
            // wake the processes. A crash before any process got its copy
            // is a crash before the append.
            if crash.is_some_and(|r| r.count(self.conns.len()) == 0) {
                self.crash();
                return;
            }
            if !self.append_log(std::slice::from_ref(&cmd)) {
                return;
            }
        }
        if let Some(reach) = crash {
            self.write_reached(&cmd, reach);
            self.crash();
            return;
        }
        for i in 0..self.conns.len() {
            self.write(i, cmd.clone());
        }
    }

    /// Appends to the command log; a failure (fenced by a newer controller,
    /// a broken store) stops this controller: it must not go on without its
    /// log.
    fn append_log(&mut self, commands: &[Command]) -> bool {
        self.append_log_at(commands).is_some()
    }

    /// Appends; returns the offset of the first appended entry.
    fn append_log_at(&mut self, commands: &[Command]) -> Option<u64> {
        if self.log.is_none() {
            let Some(path) = &self.replica.command_log else {
                unreachable!("the log strategy is chosen only with a command log")
            };
            match SqliteLog::open(path) {
                Ok(l) => self.log = Some(l),
                Err(e) => {
                    self.fail_log(e.to_string());
                    return None;
                }
            }
        }
        let log = self.log.as_mut().expect("opened above");
        match log.append(self.epoch, commands) {
            Ok(last) => Some(last + 1 - commands.len() as u64),
            Err(e) => {
                self.fail_log(e.to_string());
                None
            }
        }
    }

    fn fail_log(&mut self, message: String) {
        tracing::error!(%message, "command log append failed; the controller stops");
        self.emit(Event::LogFailed { message });
        self.crashed = true;
        self.connected = false;
        self.conns.iter_mut().for_each(|c| *c = None);
        self.current_generation.store(u64::MAX, Ordering::SeqCst);
    }

    /// Appends the start of a log session in one transaction, then sends
    /// the socket copies; honours the failpoint's crash point.
    fn flush_log_batch(&mut self) {
        let Some(batch) = self.log_batch.take() else {
            return;
        };
        let n = self.conns.len();
        let crash = batch
            .commands
            .iter()
            .position(|(_, c)| c.is_some())
            .map(|i| (i, batch.commands[i].1.expect("found")));
        let appended = match crash {
            Some((i, r)) if r.count(n) == 0 => i,
            Some((i, _)) => i + 1,
            None => batch.commands.len(),
        };
        let mut entries = vec![batch.hellos[0].clone()];
        entries.extend(batch.commands[..appended].iter().map(|(c, _)| c.clone()));
        match self.append_log_at(&entries) {
            Some(marker) => self.log_marker = Some(marker),
            None => return,
        }
        for (i, hello) in batch.hellos.into_iter().enumerate() {
            self.write(i, hello);
        }
        for (k, (cmd, crash)) in batch.commands.into_iter().enumerate() {
            if k == appended {
                self.crash();
                return;
            }
            if let Some(reach) = crash {
                self.write_reached(&cmd, reach);
                self.crash();
                return;
            }
            for i in 0..n {
                self.write(i, cmd.clone());
            }
        }
    }

    /// Sends `cmd` to the processes the failpoint lets it reach.
    fn write_reached(&mut self, cmd: &Command, reach: Reach) {
        let n = self.conns.len();
        for i in 0..n {
            if reach.reaches(i, n) {
                self.write(i, cmd.clone());
            }
        }
    }

    /// The failpoint `controller_partial_broadcast` (value `KIND:N`, e.g.
    /// `create-dataflow:1`): the controller crashes while broadcasting a
    /// command of that kind, after it reached the first N processes.
    fn crash(&mut self) {
        tracing::error!("failpoint: controller crashes in the middle of a broadcast");
        self.crashed = true;
        self.connected = false;
        self.conns.iter_mut().for_each(|c| *c = None);
        self.current_generation.store(u64::MAX, Ordering::SeqCst);
    }

    /// Records a command in the history and sends it.
    fn send(&mut self, kind: CommandKind) {
        if !matches!(
            kind,
            CommandKind::InitializationComplete | CommandKind::StatusRequest { .. }
        ) {
            self.history.push(kind.clone());
        }
        self.broadcast(kind);
    }

    fn on_request(&mut self, r: Request) {
        match r {
            Request::Send(kind) => {
                // A (re)created collection starts with no reported frontier.
                if let CommandKind::CreateDataflow(d) = &kind {
                    for e in &d.exports {
                        self.frontiers.remove(&e.collection_id);
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
                self.subs.insert(
                    id,
                    (SubscribeMerge::new(self.replica.processes.len()), sink),
                );
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
            Request::Reconnect => self.disconnect("reconnect requested".into()),
            Request::Shutdown => {}
        }
    }

    fn disconnect(&mut self, reason: String) {
        self.connected = false;
        self.hello_check = None;
        self.conns.iter_mut().for_each(|c| *c = None);
        self.connecting = false;
        tracing::info!(%reason, "reconnecting to every process");
        self.start_connecting();
    }

    fn on_conn(&mut self, msg: FromConn) {
        if msg.generation != self.generation || !self.connected {
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
        match resp.kind {
            ResponseKind::Frontiers(updates) => {
                for (c, f) in updates {
                    self.frontiers.entry(c).or_default().insert(p, f);
                }
                self.answer_frontier_waiters();
            }
            ResponseKind::PeekResponse(r) => {
                let n = self.replica.processes.len();
                if let Some(pending) = self.peeks.get_mut(&r.peek_id) {
                    pending.results.insert(p, r.result);
                    if pending.results.len() == n {
                        let pending = self.peeks.remove(&r.peek_id).expect("present");
                        self.history.retire_peek(r.peek_id);
                        let answer = match merge_peek(pending.results.into_values()) {
                            PeekResult::Rows(rows) => Ok(rows),
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
                if let Some((merge, sink)) = self.subs.get_mut(&id) {
                    if let Some(out) = merge.push(p, b) {
                        let _ = sink.send(out);
                    }
                    if merge.is_done() {
                        self.subs.remove(&id);
                    }
                }
            }
            ResponseKind::Status(s) => {
                let full = s.history_hash.is_some();
                if full {
                    self.full_statuses.insert(s.worker_index, s.clone());
                }
                self.statuses.insert(s.worker_index, s);
                if full {
                    self.check_histories(false);
                }
                self.answer_status_waiters();
            }
            ResponseKind::Error(error) => {
                tracing::warn!(process = p, ?error, "replica error");
                self.emit(Event::ReplicaError { process: p, error });
            }
        }
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
        if !self.connected {
            return None;
        }
        self.broadcast(CommandKind::StatusRequest { full });
        Some((self.nonce, self.seqno))
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
        if !self.connected {
            return;
        }
        if self
            .hello_check
            .is_some_and(|t| t.elapsed() > self.timeouts.request)
        {
            self.check_histories(true);
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

/// Which processes a broadcast reaches before the controller crashes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(not(feature = "failpoints"), allow(dead_code))] // built by the failpoint only
enum Reach {
    /// The first N processes.
    First(usize),
    /// The last N processes (process 0 last to be reached).
    Last(usize),
}

impl Reach {
    fn reaches(self, i: usize, n: usize) -> bool {
        match self {
            Reach::First(k) => i < k,
            Reach::Last(k) => i + k >= n,
        }
    }

    fn count(self, n: usize) -> usize {
        (0..n).filter(|&i| self.reaches(i, n)).count()
    }
}

/// Which processes a broadcast of `kind` reaches before the controller
/// crashes, if the failpoint `controller_partial_broadcast` says so: value
/// `KIND:N` for the first N processes, `KIND:lastN` for the last N.
fn partial_broadcast(kind: &str) -> Option<Reach> {
    let _ = kind;
    fail::fail_point!("controller_partial_broadcast", |arg: Option<String>| {
        let arg = arg?;
        let (k, n) = arg.split_once(':')?;
        if k != kind {
            return None;
        }
        match n.strip_prefix("last") {
            Some(n) => n.parse().ok().map(Reach::Last),
            None => n.parse().ok().map(Reach::First),
        }
    });
    None
}

/// What a worker reported about its state on Hello, as one digest: its
/// dataflow-creation log and its installed dataflows. Two workers in
/// lockstep report the same. (The compacted history digest alone misses a
/// dataflow built and dropped on one worker only; the creation log does not.)
fn state_digest(s: &Status) -> lockstep_protocol::Digest {
    let mut h = blake3::Hasher::new();
    h.update(&(s.creation_log.len() as u64).to_le_bytes());
    for e in &s.creation_log {
        h.update(&e.timely_index.to_le_bytes());
        h.update(&e.dataflow_id.to_le_bytes());
        h.update(&e.description_hash.0);
    }
    h.update(&(s.installed.len() as u64).to_le_bytes());
    for id in &s.installed {
        h.update(&id.to_le_bytes());
    }
    lockstep_protocol::Digest(*h.finalize().as_bytes())
}

/// The encoded size of a command, for policies.
fn encoded_size(kind: &CommandKind) -> u64 {
    Command {
        seqno: 0,
        strategy: Strategy::Naive,
        kind: kind.clone(),
    }
    .encode_to_vec()
    .len() as u64
}
