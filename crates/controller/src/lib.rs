//! The lockstep compute controller.
//!
//! A [`Controller`] drives one replica: it connects to **every** process
//! itself (the protocol is symmetric: no process forwards commands), sends
//! every command to all of them with the strategy the distribution policy
//! chose, keeps the compacted [`CommandHistory`], and merges the processes'
//! responses ([`lockstep_protocol::merge`]): a frontier is the meet over the
//! processes, a peek is answered once every process answered, subscribe
//! batches are merged by time.
//!
//! Failures are never silent:
//! - a lost connection makes the controller reconnect to every process with a
//!   new nonce and rehydrate it from the compacted history;
//! - a process that stops answering heartbeats (a stopped timely peer hangs
//!   the others without an error) is reported as [`Event::ProcessSilent`]
//!   within the configured timeout, so the owner can restart the replica;
//! - every wait has a bound and a message ([`ControllerError::Timeout`]).
//!
//! The controller is an actor: [`Controller`] is a cheap handle that sends
//! requests to one task owning all state, so responses and commands are
//! processed in one order. That task is `actor` (its session lifecycle, one
//! phase enum, in `actor::session`). Which strategy a command is sent with,
//! and how it reaches the processes, is decided by the session machine
//! ([`lockstep_reconcile::ControllerSession`], from each strategy's module
//! in `lockstep_reconcile::strategy`); `actor::deliver` and `actor::log`
//! only perform it. `connection` reads and writes one process's socket.

mod actor;
mod connection;
/// Where a replica's command log lives (re-exported for launchers).
pub use lockstep_command_log::LogLocation;

use std::time::Duration;

use lockstep_policy::DistributionPolicy;
pub use lockstep_protocol::CommandHistory;
use lockstep_protocol::{
    CommandKind, DataflowDescription, Frontier, ProcessIdentity, Row, Status, SubscribeBatch,
    Timestamp, Update, WriteInput,
};
pub use lockstep_reconcile::DeliveryRules;
use tokio::sync::{broadcast, mpsc, oneshot};

pub use actor::Event;

/// What the controller needs to know about a replica.
#[derive(Clone, Debug)]
pub struct ReplicaAddrs {
    /// The replica's catalog ID.
    pub replica_id: u64,
    /// Every process's controller address (`host:port`, a name or an IP),
    /// in process order; a name is looked up at every connection attempt.
    pub processes: Vec<lockstep_protocol::Endpoint>,
    /// Timely workers per process.
    pub workers_per_process: u32,
    /// The replica's command log, needed by the `log` strategy; the replica's
    /// processes must have been started with the same file.
    pub command_log: Option<lockstep_command_log::LogLocation>,
    /// The replica's session key, which every Hello proves; the replica's
    /// processes must have been started with the same key
    /// (`lockstep_launch::with_session_key`).
    pub session_key: Option<lockstep_protocol::SessionKey>,
    /// With a key, connect as before sessions were mutual: only the Hello
    /// proves the key, the process never proves it back, frames are plain.
    /// The negative control `no-mutual` of the security suite only.
    pub one_way_proof: bool,
    /// The largest frame either side sends or accepts; the replica's
    /// processes must have been started with the same limit
    /// (`lockstep_launch::with_max_frame_len`). Writes and peek answers larger than
    /// half of it travel in parts.
    pub max_frame_len: usize,
}

impl ReplicaAddrs {
    /// The identity of process `i`.
    pub fn identity(&self, i: usize) -> ProcessIdentity {
        ProcessIdentity {
            replica_id: self.replica_id,
            process_index: i as u32,
            process_count: self.processes.len() as u32,
            workers_per_process: self.workers_per_process,
        }
    }

    /// The Hello for process `i` of session (`epoch`, `nonce`), with its
    /// proof of the session key when the replica has one.
    pub fn hello(&self, i: usize, epoch: u64, nonce: u64) -> lockstep_protocol::Hello {
        let hello = self.identity(i).hello(epoch, nonce);
        match &self.session_key {
            Some(key) => key.sign(hello),
            None => hello,
        }
    }

    /// Workers in the whole replica.
    pub fn total_workers(&self) -> usize {
        self.processes.len() * self.workers_per_process as usize
    }
}

/// Batches of one subscription that may wait for its receiver.
pub const SUBSCRIBE_CHANNEL_BATCHES: usize = 1024;

/// Timeouts and intervals.
#[derive(Clone, Debug)]
pub struct Timeouts {
    /// How long to keep trying to connect to every process.
    pub connect: Duration,
    /// How often to send heartbeats.
    pub heartbeat_interval: Duration,
    /// A process that has not answered for this long is reported silent.
    pub heartbeat_timeout: Duration,
    /// The default bound on peeks, status requests and frontier waits.
    pub request: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts {
            connect: Duration::from_secs(30),
            heartbeat_interval: Duration::from_millis(250),
            heartbeat_timeout: Duration::from_secs(2),
            request: Duration::from_secs(20),
        }
    }
}

/// Why a controller operation failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ControllerError {
    /// A wait ran past its bound.
    #[error("timed out after {after:?} waiting for {what}")]
    Timeout {
        /// What was awaited.
        what: String,
        /// The bound.
        after: Duration,
    },
    /// The replica answered with an error.
    #[error("replica error: {0}")]
    Replica(String),
    /// The controller task is gone.
    #[error("the controller has shut down")]
    Shutdown,
    /// The collection was dropped (a subscription to it ends with this).
    #[error("collection {collection} was dropped")]
    Dropped {
        /// The collection.
        collection: u64,
    },
}

pub(crate) enum Request {
    Send(CommandKind),
    SetPolicy(Box<dyn DistributionPolicy + Send>),
    SetAddresses(Vec<lockstep_protocol::Endpoint>),
    Reshape(ReplicaAddrs),
    Peek {
        collection: u64,
        timestamp: Timestamp,
        reply: oneshot::Sender<Result<Vec<(Row, i64)>, ControllerError>>,
    },
    Subscribe {
        collection: u64,
        as_of: Timestamp,
        sink: mpsc::Sender<Result<SubscribeBatch, ControllerError>>,
    },
    Statuses {
        full: bool,
        reply: oneshot::Sender<Vec<Status>>,
    },
    Frontier {
        collection: u64,
        reply: oneshot::Sender<Option<Frontier>>,
    },
    WaitFrontier {
        collection: u64,
        beyond: Timestamp,
        reply: oneshot::Sender<()>,
    },
    History {
        reply: oneshot::Sender<CommandHistory>,
    },
    ProcessLags {
        reply: oneshot::Sender<Vec<Option<u64>>>,
    },
    CaughtUp {
        reply: oneshot::Sender<CaughtUp>,
    },
    ProcessVersions {
        reply: oneshot::Sender<Vec<Option<ProcessVersion>>>,
    },
    Reconnect,
    Shutdown,
}

/// How many of a replica's live dataflows have caught up: every export's
/// frontier, on every process, at or past the upper of every input the
/// dataflow reads (what the controller was told so far).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CaughtUp {
    /// The live dataflows.
    pub dataflows: usize,
    /// Those caught up.
    pub caught_up: usize,
}

/// What a replica process speaks, as agreed in the current session.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcessVersion {
    /// The agreed protocol version.
    pub protocol_version: u32,
    /// The process's build version, which it reports from protocol version
    /// 3 on (`None` from a version-2 process).
    pub build_version: Option<String>,
}

/// A handle to a running controller.
#[derive(Clone)]
pub struct Controller {
    tx: mpsc::UnboundedSender<Request>,
    events: broadcast::Sender<Event>,
    /// The receiver made with the channel, holding every event since the
    /// start (the channel's last 1,024), shared by clones, until [`Controller::events_since_start`]
    /// takes it.
    first_events: std::sync::Arc<std::sync::Mutex<Option<broadcast::Receiver<Event>>>>,
    timeouts: Timeouts,
}

/// How a controller distributes commands: the policy it asks, unwrapped,
/// and the rules its session machine applies to the answers (the
/// fallback, whether `naive` is taken).
pub struct Distribution {
    /// The distribution policy.
    pub policy: Box<dyn DistributionPolicy + Send>,
    /// What the machine does with its answers.
    pub rules: lockstep_reconcile::DeliveryRules,
}

impl Controller {
    /// Starts a controller for `replica` at `epoch`, with the distribution
    /// `policy` (its choices taken as they are: [`DeliveryRules::AS_CHOSEN`](lockstep_reconcile::DeliveryRules::AS_CHOSEN)),
    /// rehydrating it from `history` (empty for a new replica). It
    /// connects in the background; commands sent before it is connected are
    /// kept in the history and replayed.
    pub fn start(
        replica: ReplicaAddrs,
        epoch: u64,
        history: CommandHistory,
        policy: Box<dyn DistributionPolicy + Send>,
        timeouts: Timeouts,
    ) -> Controller {
        let distribution = Distribution {
            policy,
            rules: lockstep_reconcile::DeliveryRules::AS_CHOSEN,
        };
        Self::start_distributing(replica, epoch, history, distribution, timeouts)
    }

    /// [`Controller::start`] with the rules the environment decided
    /// ([`Distribution`]).
    pub fn start_distributing(
        replica: ReplicaAddrs,
        epoch: u64,
        history: CommandHistory,
        distribution: Distribution,
        timeouts: Timeouts,
    ) -> Controller {
        let (tx, rx) = mpsc::unbounded_channel();
        let (events, first_events) = broadcast::channel(1024);
        actor::spawn(
            replica,
            epoch,
            history,
            distribution,
            timeouts.clone(),
            rx,
            events.clone(),
        );
        Controller {
            tx,
            events,
            first_events: std::sync::Arc::new(std::sync::Mutex::new(Some(first_events))),
            timeouts,
        }
    }

    fn request(&self, r: Request) -> Result<(), ControllerError> {
        self.tx.send(r).map_err(|_| ControllerError::Shutdown)
    }

    async fn ask<T>(
        &self,
        what: &str,
        make: impl FnOnce(oneshot::Sender<T>) -> Request,
        bound: Duration,
    ) -> Result<T, ControllerError> {
        let (reply, rx) = oneshot::channel();
        self.request(make(reply))?;
        match tokio::time::timeout(bound, rx).await {
            Err(_) => Err(ControllerError::Timeout {
                what: what.to_string(),
                after: bound,
            }),
            Ok(Err(_)) => Err(ControllerError::Shutdown),
            Ok(Ok(v)) => Ok(v),
        }
    }

    /// Subscribes to the controller's events (connections, silent processes, errors).
    pub fn events(&self) -> broadcast::Receiver<Event> {
        self.events.subscribe()
    }

    /// The events since the controller started (the last 1,024 of them at
    /// most), for the first caller; `None` after that. [`Controller::events`]
    /// sees only events after it subscribes, and the controller connects in
    /// the background, so an event of the first connection (a dataflow of
    /// the rehydrated history refused, say) may come before it.
    pub fn events_since_start(&self) -> Option<broadcast::Receiver<Event>> {
        self.first_events
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
    }

    /// Builds a dataflow on every worker.
    pub fn create_dataflow(&self, desc: DataflowDescription) -> Result<(), ControllerError> {
        let id = desc.id;
        self.request(Request::Send(CommandKind::CreateDataflow(desc)))?;
        self.request(Request::Send(CommandKind::Schedule { dataflow_id: id }))
    }

    /// Allows compaction of a collection; `None` drops it.
    pub fn allow_compaction(
        &self,
        collection: u64,
        frontier: Frontier,
    ) -> Result<(), ControllerError> {
        self.request(Request::Send(CommandKind::AllowCompaction {
            collection_id: collection,
            frontier,
        }))
    }

    /// Drops every export of a dataflow, and with them the dataflow.
    pub fn drop_dataflow(&self, desc: &DataflowDescription) -> Result<(), ControllerError> {
        for e in &desc.exports {
            self.allow_compaction(e.collection_id, None)?;
        }
        Ok(())
    }

    /// Appends updates to an input collection and advances its upper.
    pub fn write_input(
        &self,
        collection: u64,
        updates: Vec<Update>,
        upper: Timestamp,
    ) -> Result<(), ControllerError> {
        self.request(Request::Send(CommandKind::WriteInput(WriteInput {
            collection_id: collection,
            updates,
            upper,
            more: false,
            batch_digest: None,
        })))
    }

    /// Uses `policy` from the next session on (the strategy of a session is
    /// chosen at its Hello); [`reconnect`](Self::reconnect) starts one now.
    pub fn set_policy(
        &self,
        policy: Box<dyn DistributionPolicy + Send>,
    ) -> Result<(), ControllerError> {
        self.request(Request::SetPolicy(policy))
    }

    /// The replica's processes now listen on `processes` (every process's
    /// controller address, in process order; the orchestrator chose new
    /// ports): reconnects to every process there. A list of another length
    /// than the replica's processes is ignored (logged).
    pub fn set_addresses(
        &self,
        processes: Vec<lockstep_protocol::Endpoint>,
    ) -> Result<(), ControllerError> {
        self.request(Request::SetAddresses(processes))
    }

    /// The replica's processes were replaced by processes of another shape
    /// (a resize): from now on this controller drives the processes
    /// `replica` names, of its shape. It reconnects at once, the new
    /// processes rebuild the replica from the history, and subscriptions
    /// resume as after any restart (no gap, no duplicate). `replica` must
    /// be the same replica (its ID, key and command log).
    pub fn reshape(&self, replica: ReplicaAddrs) -> Result<(), ControllerError> {
        self.request(Request::Reshape(replica))
    }

    /// Sends an UpdateConfiguration.
    pub fn update_configuration(
        &self,
        params: std::collections::BTreeMap<String, String>,
    ) -> Result<(), ControllerError> {
        self.request(Request::Send(CommandKind::UpdateConfiguration(params)))
    }

    /// Reads a collection at `timestamp`, once every process answered.
    pub async fn peek(
        &self,
        collection: u64,
        timestamp: Timestamp,
    ) -> Result<Vec<(Row, i64)>, ControllerError> {
        let what = format!("peek of collection {collection} at {timestamp}");
        self.ask(
            &what,
            |reply| Request::Peek {
                collection,
                timestamp,
                reply,
            },
            self.timeouts.request,
        )
        .await?
    }

    /// Streams a collection's changes from `as_of`, merged over all processes.
    /// At most [`SUBSCRIBE_CHANNEL_BATCHES`] batches wait for the receiver: a
    /// receiver that falls that far behind gets an error as its last item
    /// and the subscription ends (a stalled client is cut off, not
    /// buffered).
    /// The stream ends after the batch with the empty upper, or with
    /// [`ControllerError::Dropped`] when the collection is dropped; dropping
    /// the receiver cancels the subscription (on the replica too, and it
    /// leaves the history, so a reconnect does not replay it).
    pub fn subscribe(
        &self,
        collection: u64,
        as_of: Timestamp,
    ) -> Result<mpsc::Receiver<Result<SubscribeBatch, ControllerError>>, ControllerError> {
        let (sink, rx) = mpsc::channel(SUBSCRIBE_CHANNEL_BATCHES);
        self.request(Request::Subscribe {
            collection,
            as_of,
            sink,
        })?;
        Ok(rx)
    }

    /// One full Status per worker (history digest and creation log included),
    /// fresher than this call.
    pub async fn statuses(&self) -> Result<Vec<Status>, ControllerError> {
        self.ask(
            "a Status from every worker",
            |reply| Request::Statuses { full: true, reply },
            self.timeouts.request,
        )
        .await
    }

    /// A small command every worker applies (a StatusRequest without digest
    /// or creation log); returns once every worker has answered it.
    pub async fn ping(&self) -> Result<(), ControllerError> {
        self.ask(
            "every worker to answer a ping",
            |reply| Request::Statuses { full: false, reply },
            self.timeouts.request,
        )
        .await
        .map(|_| ())
    }

    /// The collection's frontier (meet over processes), if every process reported it.
    pub async fn frontier(&self, collection: u64) -> Result<Option<Frontier>, ControllerError> {
        self.ask(
            "a frontier",
            |reply| Request::Frontier { collection, reply },
            self.timeouts.request,
        )
        .await
    }

    /// Waits until the collection's frontier is beyond `t` on every process.
    pub async fn wait_for_frontier(
        &self,
        collection: u64,
        t: Timestamp,
    ) -> Result<(), ControllerError> {
        let what = format!("collection {collection}'s frontier to pass {t}");
        self.ask(
            &what,
            |reply| Request::WaitFrontier {
                collection,
                beyond: t,
                reply,
            },
            self.timeouts.request,
        )
        .await
    }

    /// A copy of the compacted command history.
    pub async fn history(&self) -> Result<CommandHistory, ControllerError> {
        self.ask(
            "the history",
            |reply| Request::History { reply },
            self.timeouts.request,
        )
        .await
    }

    /// Per process, in process order: how far its frontiers are behind the
    /// writes, in timestamps. For every export of every live dataflow, the
    /// lag is the least upper of the dataflow's inputs (what was written)
    /// minus the export's frontier on that process (0 once it is complete,
    /// or ahead); a process's lag is the largest over the exports. `None`
    /// for a process that has not reported a frontier of every export in
    /// this session (not connected, or still building). `Some(0)` with no
    /// dataflow. Answered from what the controller holds: no replica round
    /// trip.
    pub async fn process_lags(&self) -> Result<Vec<Option<u64>>, ControllerError> {
        self.ask(
            "the frontier lags",
            |reply| Request::ProcessLags { reply },
            self.timeouts.request,
        )
        .await
    }

    /// How many of the replica's live dataflows have caught up with the
    /// writes to their inputs (see [`CaughtUp`]): a generation being
    /// rebuilt counts up to all of them. Answered from what the controller
    /// holds: no replica round trip.
    pub async fn caught_up(&self) -> Result<CaughtUp, ControllerError> {
        self.ask(
            "the dataflows caught up",
            |reply| Request::CaughtUp { reply },
            self.timeouts.request,
        )
        .await
    }

    /// Per process, the protocol version agreed in the current session and
    /// the process's build version (reported from protocol version 3 on);
    /// `None` while the process has not answered this session's Hello.
    /// Answered from what the controller holds: no replica round trip.
    pub async fn process_versions(&self) -> Result<Vec<Option<ProcessVersion>>, ControllerError> {
        self.ask(
            "the protocol versions",
            |reply| Request::ProcessVersions { reply },
            self.timeouts.request,
        )
        .await
    }

    /// Reconnects to every process with a new nonce and rehydrates it.
    pub fn reconnect(&self) -> Result<(), ControllerError> {
        self.request(Request::Reconnect)
    }

    /// Stops the controller task and closes its connections.
    pub fn shutdown(&self) {
        let _ = self.request(Request::Shutdown);
    }
}
