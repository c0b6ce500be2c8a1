//! Model 1: the compute protocol, one strategy at a time.
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
//!   [`WorkerSession`], the type the replica's workers run: the model hands
//!   it the commands in the worker's order and performs the actions it hands
//!   out (build, drop, announce on the mesh, halt) as the replica's worker
//!   does. What differs per strategy is only where the commands come from:
//!   - `naive`, `barrier`: the worker's own channel;
//!   - `broadcast`: process 0 sequences what it receives into a stream every
//!     worker applies in order (the other processes' copies are
//!     acknowledgements only and are not modelled);
//!   - `log`: the controller appends commands, epoch markers and targets to a
//!     durable log (it survives crashes) that every worker tails.
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

use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};
use std::fmt;
use std::sync::{Arc, Mutex};

use lockstep_protocol::{DataflowDescription, Digest, Export, Plan, Strategy};
use lockstep_reconcile::{
    lockstep_check, lockstep_prefix_check, Action, BarrierDecision, CommandClass,
    ControllerSession, CreationEntry, DataflowKey, GateMutant, HistoryStep, MeshAnnouncement,
    MismatchResolution, Order, Phase, RoundMutant, SessionCommand, WorkerSession, WorkerView,
};
use stateright::{Model, Property};

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
}

/// The compute-protocol model for one strategy.
#[derive(Clone, Debug)]
pub struct ComputeModel {
    /// The strategy under check.
    pub strategy: Strategy,
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

/// A command from the controller, as carried by a channel, the broadcast
/// stream or the durable log.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Msg {
    /// Starts a session (log: the epoch marker).
    Hello {
        /// The session.
        session: u64,
    },
    /// The compacted target followed by InitializationComplete.
    Target {
        /// The session.
        session: u64,
        /// The sequence number in the session.
        seqno: u64,
        /// Every dataflow the controller wants, in catalog order.
        keys: Vec<DataflowKey>,
    },
    /// Create one dataflow.
    Create {
        /// The session.
        session: u64,
        /// The sequence number in the session.
        seqno: u64,
        /// The dataflow.
        key: DataflowKey,
    },
    /// Drop one dataflow (AllowCompaction to the empty frontier).
    Drop {
        /// The session.
        session: u64,
        /// The dataflow's ID.
        id: u64,
    },
}

/// The controller.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Controller {
    /// Running (not crashed).
    pub up: bool,
    /// Its epoch (durable).
    pub epoch: u64,
    /// Its current session (one per Hello broadcast).
    pub session: u64,
    /// The next sequence number in the session.
    pub seqno: u64,
    /// The durable catalog: the target, in creation order.
    pub catalog: Vec<DataflowKey>,
    /// User commands issued so far.
    pub commands: usize,
    /// Faults so far.
    pub faults: usize,
    /// Its session machine (`lockstep_reconcile::ControllerSession`, the
    /// controller's type): phase, nonce and the history check. A restarted
    /// controller starts a new one.
    pub machine: ControllerSession,
}

impl Controller {
    /// Waiting for the history check (Hello sent, InitializationComplete not).
    pub fn awaiting(&self) -> bool {
        matches!(self.machine.phase(), Phase::AwaitingHistories { .. })
    }
}

/// A command as a worker's session machine receives it: the model's
/// messages, with a Target split into its creates and InitializationComplete
/// as the replica receives them.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Cmd {
    /// The order of the strategy it was sent with.
    pub order: Order,
    /// Its sequence number in its session.
    pub seqno: u64,
    /// What it is.
    pub kind: CmdKind,
}

/// What a [`Cmd`] is.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum CmdKind {
    /// Hello of a session.
    Hello(u64),
    /// CreateDataflow.
    Create(DataflowKey),
    /// Drop (AllowCompaction to the empty frontier).
    Drop(u64),
    /// InitializationComplete.
    Complete,
}

impl SessionCommand for Cmd {
    fn seqno(&self) -> u64 {
        self.seqno
    }
    fn order(&self) -> Order {
        self.order
    }
    fn class(&self) -> CommandClass {
        match self.kind {
            CmdKind::Hello(session) => CommandClass::Hello {
                session: session.into(),
            },
            CmdKind::Create(key) => CommandClass::Create { key },
            CmdKind::Complete => CommandClass::InitializationComplete,
            CmdKind::Drop(_) => CommandClass::Other,
        }
    }
}

impl Msg {
    /// The commands a worker receives for this message.
    fn commands(&self, order: Order) -> Vec<Cmd> {
        let cmd = |seqno, kind| Cmd { order, seqno, kind };
        match self {
            Msg::Hello { session } => vec![cmd(0, CmdKind::Hello(*session))],
            Msg::Target { seqno, keys, .. } => keys
                .iter()
                .map(|k| cmd(*seqno, CmdKind::Create(*k)))
                .chain([cmd(*seqno, CmdKind::Complete)])
                .collect(),
            Msg::Create { seqno, key, .. } => vec![cmd(*seqno, CmdKind::Create(*key))],
            Msg::Drop { id, .. } => vec![cmd(0, CmdKind::Drop(*id))],
        }
    }
}

/// One timely worker (one per process): what it runs, and the session
/// machine the replica's worker runs.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Worker {
    /// Its session machine (`lockstep_reconcile::WorkerSession`, the
    /// replica's type).
    pub machine: WorkerSession<Cmd>,
    /// What it runs: (timely index, dataflow).
    pub installed: Vec<(u64, DataflowKey)>,
    /// Every dataflow it built, in order.
    pub log: Vec<CreationEntry>,
    /// Its next timely dataflow index.
    pub next_index: u64,
    /// Position in the broadcast stream or durable log.
    pub cursor: usize,
    /// It halted (a barrier diverged, or its process died).
    pub halted: bool,
}

/// What a model worker runs, as its session machine sees it: what it runs
/// and everything it built.
struct Runs<'a>(&'a [(u64, DataflowKey)], &'a [CreationEntry]);

impl WorkerView<Cmd> for Runs<'_> {
    fn is_installed(&self, id: u64) -> bool {
        self.0.iter().any(|(_, k)| k.id == id)
    }
    fn installed(&self) -> Vec<DataflowKey> {
        self.0.iter().map(|(_, k)| *k).collect()
    }
    fn buildable(&self, _: &Cmd) -> bool {
        true
    }
    fn creation_digest(&self) -> Digest {
        digest_of(&self.1)
    }
}

impl Worker {
    /// Fresh worker `index` of a replica of `peers` workers, in session 0.
    fn fresh(index: usize, peers: usize, mutant: RoundMutant, cursor: usize) -> Self {
        let machine = WorkerSession::new(index, peers, true).with_mutant(mutant);
        Worker {
            machine,
            installed: Vec::new(),
            log: Vec::new(),
            next_index: 0,
            cursor,
            halted: false,
        }
    }

    fn keys(&self) -> Vec<DataflowKey> {
        self.installed.iter().map(|(_, k)| *k).collect()
    }
    fn build(&mut self, key: DataflowKey) {
        self.log.push((self.next_index, key.id, key.hash));
        self.installed.push((self.next_index, key));
        self.next_index += 1;
    }
    fn drop_id(&mut self, id: u64) {
        self.installed.retain(|(_, k)| k.id != id);
    }
    /// Applies a command the machine let through, as the replica's worker
    /// does: a create of an installed ID builds nothing (kept with the same
    /// description, refused with another).
    fn apply(&mut self, cmd: &Cmd) {
        match cmd.kind {
            CmdKind::Create(key) if !self.installed.iter().any(|(_, k)| k.id == key.id) => {
                self.build(key)
            }
            CmdKind::Drop(id) => self.drop_id(id),
            _ => {}
        }
    }
    /// The worker has joined `session` and has nothing left to do in it.
    fn settled_in(&self, session: u64) -> bool {
        !self.halted
            && self.machine.session() == u128::from(session)
            && !self.machine.is_reconciling()
            && self.machine.pending().is_none()
            && self.machine.queued() == 0
    }
}

/// A state of the compute model.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ComputeState {
    /// The controller.
    pub ctl: Controller,
    /// Controller→process channels.
    pub channels: Vec<VecDeque<Msg>>,
    /// The workers.
    pub workers: Vec<Worker>,
    /// Per worker: the mesh records it has not read yet, in order, with
    /// their sender.
    pub inboxes: Vec<VecDeque<(usize, MeshAnnouncement)>>,
    /// Broadcast: the sequenced stream. Log: the durable log.
    pub stream: Vec<Msg>,
    /// Replica restarts after a halt.
    pub replica_restarts: usize,
    /// History check: each process's report, (session, digest).
    pub reports: Vec<Option<(u64, Digest)>>,
}

/// A step of the compute model.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum ComputeAction {
    /// The controller creates dataflow `pool[i]`.
    Create(usize),
    /// The controller drops dataflow `pool[i]`.
    Drop(usize),
    /// The controller crashes (fault).
    Crash,
    /// The controller restarts with a new epoch.
    Restart,
    /// The connection to a process drops (fault); the controller reconnects all.
    DropConnection(usize),
    /// A replica process dies (fault): timely's mesh fails, so every worker
    /// of the replica stops.
    ProcessCrash(usize),
    /// A worker halted: the controller restarts the whole replica.
    RestartReplica,
    /// History check: every process reported; the controller decides.
    CheckHistories,
    /// A process takes the next message off its channel.
    Receive(usize),
    /// Worker `.0` reads the next `.1` records its mesh delivered into its
    /// book, then decides its pending barrier round. (Reading and deciding
    /// are one step: the book is read only to decide, so reading earlier
    /// leads to the same decision; exploring every count of records read
    /// covers every state the worker's book can be in when it decides.)
    Decide(usize, usize),
    /// A worker applies the next entry of the stream (broadcast, log).
    Apply(usize),
}

impl ComputeAction {
    /// Faults and new user commands: what the liveness search may not use.
    fn is_fault_or_user(&self) -> bool {
        matches!(
            self,
            ComputeAction::Crash
                | ComputeAction::DropConnection(_)
                | ComputeAction::ProcessCrash(_)
                | ComputeAction::Create(_)
                | ComputeAction::Drop(_)
        )
    }
}

/// The pool's dataflows, by index: A, B, then A' (A's ID with another
/// description, as when a restarted controller plans A anew), then C.
const LABELS: [&str; 4] = ["A", "B", "A'", "C"];

/// The most dataflows the pool holds.
pub const MAX_DATAFLOWS: usize = LABELS.len();

/// The description of pool dataflow `i`: its hash is the real
/// [`DataflowDescription::hash`].
fn description(i: usize) -> DataflowDescription {
    let (id, as_of) = match i {
        0 => (1, 0),
        1 => (2, 0),
        2 => (1, 1),
        _ => (3, 0),
    };
    DataflowDescription {
        id,
        as_of,
        inputs: vec![100],
        exports: vec![Export {
            collection_id: 1000 + id,
            plan: Plan::Get { collection_id: 100 },
        }],
        debug_name: LABELS[i.min(MAX_DATAFLOWS - 1)].to_string(),
    }
}

/// A state's 64-bit fingerprint, for the liveness cache.
fn fingerprint(s: &ComputeState) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    s.hash(&mut h);
    h.finish()
}

/// A model-local digest of anything hashable (the model is tiny, so a 64-bit
/// hash stands in for BLAKE3).
fn digest_of<T: std::hash::Hash>(value: &T) -> Digest {
    use std::hash::Hasher;
    let mut h = std::collections::hash_map::DefaultHasher::new();
    value.hash(&mut h);
    let mut d = [0u8; 32];
    d[..8].copy_from_slice(&h.finish().to_le_bytes());
    Digest(d)
}

impl ComputeModel {
    /// The digest a worker reports on Hello under the history check.
    fn history_digest(&self, w: &Worker) -> Digest {
        match self.history {
            // The compacted history: the creates of what still runs, in order.
            HistoryCheck::Compacted | HistoryCheck::Off => digest_of(&w.keys()),
            HistoryCheck::Full => digest_of(&(&w.log, &w.installed)),
        }
    }

    /// A dataflow's name in traces.
    fn label(&self, k: &DataflowKey) -> &'static str {
        self.pool
            .iter()
            .position(|p| p == k)
            .map_or("?", |i| LABELS[i])
    }

    /// The name of a dataflow ID in traces (the first pool entry with it).
    fn id_label(&self, id: u64) -> &'static str {
        self.pool
            .iter()
            .position(|p| p.id == id)
            .map_or("?", |i| LABELS[i])
    }

    /// The model of `strategy` within `bounds`.
    pub fn new(strategy: Strategy, bounds: ComputeBounds) -> Self {
        assert!(
            bounds.dataflows <= MAX_DATAFLOWS,
            "at most {MAX_DATAFLOWS} dataflows"
        );
        let pool = (0..bounds.dataflows)
            .map(|i| {
                let d = description(i);
                DataflowKey {
                    id: d.id,
                    hash: d.hash(),
                }
            })
            .collect();
        ComputeModel {
            strategy,
            mutant: RoundMutant::None,
            gate_mutant: GateMutant::None,
            history: HistoryCheck::Off,
            bounds,
            pool,
            reachable: Arc::default(),
        }
    }

    /// The naive model with a history check on reconnect.
    pub fn with_history_check(mut self, history: HistoryCheck) -> Self {
        assert_eq!(
            self.strategy,
            Strategy::Naive,
            "the history check rides on naive"
        );
        self.history = history;
        self
    }

    /// The same model with a flaw planted in the controller's history check.
    pub fn with_gate_mutant(mut self, mutant: GateMutant) -> Self {
        self.gate_mutant = mutant;
        self
    }

    /// The controller's next step in the history check, from the reports of
    /// its session so far (what the controller's actor runs; the model's
    /// bound never passes).
    pub fn history_step(&self, s: &ComputeState) -> HistoryStep {
        s.ctl.machine.clone().check_histories(0, u64::MAX)
    }

    /// A fresh controller session machine.
    fn controller_machine(&self, workers: usize) -> ControllerSession {
        ControllerSession::new(workers).with_gate_mutant(self.gate_mutant)
    }

    /// The same model with a flaw planted in every worker's round book.
    pub fn with_mutant(mut self, mutant: RoundMutant) -> Self {
        self.mutant = mutant;
        self
    }

    fn uses_channels(&self) -> bool {
        self.strategy != Strategy::Log
    }

    /// Sends one command: to every channel (naive, barrier), to the
    /// sequencer's channel (broadcast), or appended to the log (log).
    fn send(&self, s: &mut ComputeState, msg: Msg) {
        match self.strategy {
            Strategy::Naive | Strategy::Barrier => {
                for c in &mut s.channels {
                    c.push_back(msg.clone());
                }
            }
            Strategy::Broadcast => s.channels[0].push_back(msg),
            Strategy::Log => s.stream.push(msg),
        }
    }

    /// A new session (the controller's machine was told the old one
    /// ended, or is new): Hello, then the target, after the history check
    /// if there is one.
    fn start_session(&self, s: &mut ComputeState) {
        if s.ctl.machine.phase().is_connected() {
            s.ctl.machine.disconnected(0);
        } else {
            s.ctl.machine.connect();
        }
        s.ctl.machine.connected(s.workers.len());
        s.ctl.session += 1;
        let session = s.ctl.session;
        self.send(s, Msg::Hello { session });
        s.ctl.machine.rehydrated(0);
        if self.history == HistoryCheck::Off {
            // No history check: the controller's bound for the reports
            // passes at once, and it completes unchecked.
            match s.ctl.machine.check_histories(1, 0) {
                HistoryStep::Complete { .. } => self.complete(s),
                step => unreachable!("an unchecked session completes, not {step:?}"),
            }
        }
    }

    /// InitializationComplete: the target, then the machine serves.
    fn complete(&self, s: &mut ComputeState) {
        self.send_target(s);
        s.ctl.machine.serving(0);
    }

    /// The target and InitializationComplete, after Hello.
    fn send_target(&self, s: &mut ComputeState) {
        let session = s.ctl.session;
        let keys = s.ctl.catalog.clone();
        self.send(
            s,
            Msg::Target {
                session,
                seqno: 1,
                keys,
            },
        );
        s.ctl.seqno = 2;
    }

    /// Restarts the replica: fresh processes, an empty mesh, a new session.
    fn restart_replica(&self, s: &mut ComputeState) {
        s.replica_restarts += 1;
        for c in &mut s.channels {
            c.clear();
        }
        for inbox in &mut s.inboxes {
            inbox.clear();
        }
        if self.strategy == Strategy::Broadcast {
            s.stream.clear();
        }
        let cursor = if self.strategy == Strategy::Log {
            s.stream.len()
        } else {
            0
        };
        let peers = s.workers.len();
        for (i, w) in s.workers.iter_mut().enumerate() {
            *w = Worker::fresh(i, peers, self.mutant, cursor);
        }
        s.reports = vec![None; s.workers.len()];
        self.start_session(s);
    }

    /// Worker `p` receives `msg` in its order: its session machine queues
    /// it, then runs until it waits.
    fn receive(&self, s: &mut ComputeState, p: usize, msg: &Msg) {
        for cmd in msg.commands(Order::of(self.strategy)) {
            s.workers[p].machine.push(cmd);
        }
        self.run(s, p);
    }

    /// Performs what worker `p`'s session machine hands out until it waits,
    /// as the replica's worker does.
    fn run(&self, s: &mut ComputeState, p: usize) {
        loop {
            let w = &mut s.workers[p];
            let Some(action) = w.machine.next(&Runs(&w.installed, &w.log), 0) else {
                return;
            };
            match action {
                Action::Announce(record) => self.mesh_send(s, p, record),
                Action::Hello { cmd, .. } => {
                    if let (CmdKind::Hello(session), true) =
                        (cmd.kind, self.history != HistoryCheck::Off)
                    {
                        let digest = self.history_digest(&s.workers[p]);
                        s.reports[p] = Some((session, digest));
                        if session == s.ctl.session {
                            let nonce = s.ctl.machine.nonce();
                            s.ctl.machine.reported(p as u32, nonce, digest);
                        }
                    }
                }
                Action::Drop { id, .. } => w.drop_id(id),
                Action::Apply(cmd) => w.apply(&cmd),
                Action::ResetHistory | Action::Skipped { .. } => {}
                Action::Halt(_) => {
                    w.halted = true;
                    return;
                }
            }
        }
    }

    /// Worker `me` sends `record` on the mesh: every peer's queue gets it
    /// (its own machine read it when it announced it). Under `naive` no
    /// round is ever announced, so nothing reads the joins it sends and the
    /// model does not queue them.
    fn mesh_send(&self, s: &mut ComputeState, me: usize, record: MeshAnnouncement) {
        if self.strategy == Strategy::Naive {
            return;
        }
        for (w, inbox) in s.inboxes.iter_mut().enumerate() {
            if w != me {
                inbox.push_back((me, record.clone()));
            }
        }
    }

    /// The decision on worker `me`'s pending round after its machine read
    /// 0, 1, ... up to every record of its mesh queue (each record read
    /// once); empty without a pending round.
    fn decisions(&self, s: &ComputeState, me: usize) -> Vec<BarrierDecision> {
        let w = &s.workers[me];
        let Some(first) = w.machine.decision() else {
            return Vec::new();
        };
        let mut machine = w.machine.clone();
        let mut out = vec![first];
        for (from, record) in &s.inboxes[me] {
            machine.on_mesh(*from, record.clone());
            out.extend(machine.decision());
        }
        out
    }

    /// The decision on worker `me`'s pending round after it read the next
    /// `read` records of its mesh queue.
    fn decision(&self, s: &ComputeState, me: usize, read: usize) -> Option<BarrierDecision> {
        self.decisions(s, me).into_iter().nth(read)
    }

    /// The replica is quiet (see the module docs).
    pub fn quiet(&self, s: &ComputeState) -> bool {
        s.ctl.up
            && s.ctl.machine.phase() == Phase::Serving
            && s.channels.iter().all(|c| c.is_empty())
            && s.workers.iter().all(|w| {
                w.settled_in(s.ctl.session)
                    && (!matches!(self.strategy, Strategy::Broadcast | Strategy::Log)
                        || w.cursor == s.stream.len())
            })
    }

    fn logs(s: &ComputeState) -> Vec<Vec<CreationEntry>> {
        s.workers.iter().map(|w| w.log.clone()).collect()
    }

    /// I1 at this state: `Err` says what diverged.
    pub fn check_i1(&self, s: &ComputeState) -> Result<(), String> {
        let logs = Self::logs(s);
        lockstep_prefix_check(&logs).map_err(|d| d.to_string())?;
        if self.quiet(s) {
            lockstep_check(&logs).map_err(|d| format!("{d} (replica quiet)"))?;
        }
        Ok(())
    }

    /// I4 at this state: `Err` names a dataflow installed on some workers only.
    pub fn check_i4(&self, s: &ComputeState) -> Result<(), String> {
        if !self.quiet(s) {
            return Ok(());
        }
        let sets: Vec<BTreeSet<(u64, DataflowKey)>> = s
            .workers
            .iter()
            .map(|w| w.installed.iter().copied().collect())
            .collect();
        for (w, set) in sets.iter().enumerate().skip(1) {
            if let Some((idx, k)) = set.symmetric_difference(&sets[0]).next() {
                let (on, off) = if sets[0].contains(&(*idx, *k)) {
                    (0, w)
                } else {
                    (w, 0)
                };
                return Err(format!(
                    "I4 broken: dataflow {} built at timely index {idx} runs on worker {on} but not on worker {off} (replica quiet)",
                    self.label(k)
                ));
            }
        }
        Ok(())
    }

    /// The target: quiet, lockstep, every worker runs exactly the catalog.
    pub fn done(&self, s: &ComputeState) -> bool {
        if !self.quiet(s) || self.check_i1(s).is_err() || self.check_i4(s).is_err() {
            return false;
        }
        let want: BTreeSet<DataflowKey> = s.ctl.catalog.iter().copied().collect();
        s.workers.iter().all(|w| {
            w.installed.len() == want.len() && w.keys().into_iter().collect::<BTreeSet<_>>() == want
        })
    }

    /// Whether the target is reachable from `s` with no fault and no new
    /// user command (an exhaustive search over those successors).
    pub fn target_reachable(&self, s: &ComputeState) -> bool {
        if let Some(known) = self.known(s) {
            return known;
        }
        let mut stack = vec![s.clone()];
        let mut seen: HashSet<ComputeState> = HashSet::new();
        let mut actions = Vec::new();
        while let Some(st) = stack.pop() {
            match self.known(&st) {
                Some(true) => {
                    self.remember(s, true);
                    return true;
                }
                Some(false) => continue,
                None => {}
            }
            if self.done(&st) {
                self.remember(s, true);
                return true;
            }
            if !seen.insert(st.clone()) {
                continue;
            }
            actions.clear();
            self.actions(&st, &mut actions);
            for a in actions.drain(..).rev() {
                if a.is_fault_or_user() {
                    continue;
                }
                if let Some(next) = self.next_state(&st, a) {
                    stack.push(next);
                }
            }
        }
        // The search was exhaustive: no state it saw reaches the target.
        let mut memo = self.reachable.lock().expect("liveness cache poisoned");
        for st in seen {
            memo.insert(fingerprint(&st), false);
        }
        false
    }

    fn known(&self, s: &ComputeState) -> Option<bool> {
        self.reachable
            .lock()
            .expect("liveness cache poisoned")
            .get(&fingerprint(s))
            .copied()
    }

    fn remember(&self, s: &ComputeState, reachable: bool) {
        self.reachable
            .lock()
            .expect("liveness cache poisoned")
            .insert(fingerprint(s), reachable);
    }

    /// A one-line summary of a state: controller, then each worker.
    pub fn summary(&self, s: &ComputeState) -> String {
        let mut out = format!(
            "controller {} epoch {} session {} catalog [{}]",
            if s.ctl.up { "up" } else { "DOWN" },
            s.ctl.epoch,
            s.ctl.session,
            s.ctl
                .catalog
                .iter()
                .map(|k| self.label(k))
                .collect::<Vec<_>>()
                .join(",")
        );
        for (i, w) in s.workers.iter().enumerate() {
            let log: Vec<String> = w
                .log
                .iter()
                .map(|(idx, id, hash)| {
                    let key = DataflowKey {
                        id: *id,
                        hash: *hash,
                    };
                    format!("{}@{idx}", self.label(&key))
                })
                .collect();
            let inst: Vec<String> = w
                .installed
                .iter()
                .map(|(idx, k)| format!("{}@{idx}", self.label(k)))
                .collect();
            out.push_str(&format!(
                " | p{i}: built [{}] runs [{}]{}{}",
                log.join(","),
                inst.join(","),
                if w.machine.pending().is_some() {
                    " (at barrier)"
                } else {
                    ""
                },
                if w.halted { " HALTED" } else { "" }
            ));
        }
        out
    }

    /// A readable description of a step taken from `s`.
    pub fn describe(&self, s: &ComputeState, a: &ComputeAction) -> String {
        let show = |m: &Msg| match m {
            Msg::Hello { session } => format!("Hello(session {session})"),
            Msg::Target { keys, .. } => format!(
                "Target[{}]+InitializationComplete",
                keys.iter()
                    .map(|k| self.label(k))
                    .collect::<Vec<_>>()
                    .join(",")
            ),
            Msg::Create { key, .. } => format!("CreateDataflow {}", self.label(key)),
            Msg::Drop { id, .. } => format!("Drop {}", self.id_label(*id)),
        };
        match a {
            ComputeAction::Create(i) => format!("controller: create {}", LABELS[*i]),
            ComputeAction::Drop(i) => format!("controller: drop {}", LABELS[*i]),
            ComputeAction::Crash => "controller CRASHES (in-flight messages lost)".into(),
            ComputeAction::Restart if self.history != HistoryCheck::Off => {
                "controller restarts, sends Hello and awaits the history reports".into()
            }
            ComputeAction::Restart => "controller restarts, sends Hello and its target".into(),
            ComputeAction::DropConnection(p) => {
                format!("connection to p{p} DROPS; controller reconnects every process")
            }
            ComputeAction::ProcessCrash(p) => {
                format!("process p{p} DIES; the mesh fails and every worker stops")
            }
            ComputeAction::CheckHistories => {
                let reported: Vec<String> = s
                    .reports
                    .iter()
                    .flatten()
                    .map(|(_, d)| d.to_string())
                    .collect();
                format!(
                    "controller checks the reported history digests [{}]",
                    reported.join(", ")
                )
            }
            ComputeAction::RestartReplica => {
                "controller restarts the replica (fresh processes), sends Hello and its target"
                    .into()
            }
            ComputeAction::Receive(p) => match s.channels[*p].front() {
                Some(m) => format!("p{p} receives {}", show(m)),
                None => format!("p{p} receives nothing"),
            },
            ComputeAction::Decide(p, read) => {
                let records: Vec<String> = s.inboxes[*p]
                    .iter()
                    .take(*read)
                    .map(|(from, m)| match m {
                        MeshAnnouncement::Joined { session } => {
                            format!("p{from} joined session {session}")
                        }
                        MeshAnnouncement::Round {
                            announcement,
                            report: Some(r),
                            ..
                        } => format!(
                            "p{from} reconciles at round {} with [{}]",
                            announcement.seqno,
                            r.installed
                                .iter()
                                .map(|k| self.label(k))
                                .collect::<Vec<_>>()
                                .join(",")
                        ),
                        MeshAnnouncement::Round { announcement, .. } => {
                            format!("p{from} reached create round {}", announcement.seqno)
                        }
                    })
                    .collect();
                format!(
                    "p{p} reads [{}] from the mesh, then its barrier decides {:?}",
                    records.join("; "),
                    self.decision(s, *p, *read)
                )
            }
            ComputeAction::Apply(p) => match s.stream.get(s.workers[*p].cursor) {
                Some(m) => format!("p{p} applies {} from the stream", show(m)),
                None => format!("p{p} applies nothing"),
            },
        }
    }
}

impl Model for ComputeModel {
    type State = ComputeState;
    type Action = ComputeAction;

    fn init_states(&self) -> Vec<ComputeState> {
        let n = self.bounds.processes;
        let workers = (0..n)
            .map(|i| {
                let mut w = Worker::fresh(i, n, self.mutant, 0);
                w.machine = w.machine.resumed(1);
                w
            })
            .collect();
        vec![ComputeState {
            ctl: Controller {
                up: true,
                epoch: 1,
                session: 1,
                seqno: 2,
                catalog: Vec::new(),
                commands: 0,
                faults: 0,
                machine: {
                    let mut m = self.controller_machine(n);
                    m.connect();
                    m.connected(n);
                    m.rehydrated(0);
                    m.check_histories(1, 0);
                    m.serving(0);
                    m
                },
            },
            channels: vec![VecDeque::new(); n],
            workers,
            inboxes: vec![VecDeque::new(); n],
            stream: Vec::new(),
            replica_restarts: 0,
            reports: vec![None; n],
        }]
    }

    fn actions(&self, s: &ComputeState, actions: &mut Vec<ComputeAction>) {
        let b = &self.bounds;
        if s.ctl.up {
            if s.ctl.awaiting() && self.history_step(s) != HistoryStep::Wait {
                actions.push(ComputeAction::CheckHistories);
            }
            if s.ctl.commands < b.commands && !s.ctl.awaiting() {
                for (i, k) in self.pool.iter().enumerate() {
                    if s.ctl.catalog.contains(k) {
                        actions.push(ComputeAction::Drop(i));
                    } else if !s.ctl.catalog.iter().any(|c| c.id == k.id) {
                        actions.push(ComputeAction::Create(i));
                    }
                }
            }
            if s.ctl.faults < b.faults {
                actions.push(ComputeAction::Crash);
                if self.uses_channels() {
                    let connections = if self.strategy == Strategy::Broadcast {
                        1
                    } else {
                        b.processes
                    };
                    for p in 0..connections {
                        actions.push(ComputeAction::DropConnection(p));
                    }
                }
                // Which process dies makes no difference: the whole replica stops.
                if !s.workers.iter().any(|w| w.halted) {
                    actions.push(ComputeAction::ProcessCrash(b.processes - 1));
                }
            }
            // A replica that halts again after every restart never reaches
            // the target: past MAX_REPLICA_RESTARTS the state is stuck, which
            // the liveness property reports (and the state space stays finite).
            if s.workers.iter().any(|w| w.halted) && s.replica_restarts < MAX_REPLICA_RESTARTS {
                actions.push(ComputeAction::RestartReplica);
            }
        } else {
            actions.push(ComputeAction::Restart);
        }
        for (p, w) in s.workers.iter().enumerate() {
            if w.halted {
                continue;
            }
            let waiting = w.machine.pending().is_some();
            match self.strategy {
                // The sequencer forwards what it receives whatever it waits on.
                Strategy::Broadcast if !s.channels[p].is_empty() => {
                    actions.push(ComputeAction::Receive(p))
                }
                Strategy::Naive | Strategy::Barrier if !waiting && !s.channels[p].is_empty() => {
                    actions.push(ComputeAction::Receive(p))
                }
                _ => {}
            }
            if matches!(self.strategy, Strategy::Broadcast | Strategy::Log)
                && !waiting
                && w.cursor < s.stream.len()
            {
                actions.push(ComputeAction::Apply(p));
            }
            if waiting {
                for (read, d) in self.decisions(s, p).into_iter().enumerate() {
                    if d != BarrierDecision::Wait {
                        actions.push(ComputeAction::Decide(p, read));
                    }
                }
            }
        }
    }

    fn next_state(&self, last: &ComputeState, action: ComputeAction) -> Option<ComputeState> {
        let mut s = last.clone();
        match action {
            ComputeAction::Create(i) => {
                let key = self.pool[i];
                s.ctl.commands += 1;
                s.ctl.catalog.push(key);
                let (session, seqno) = (s.ctl.session, s.ctl.seqno);
                s.ctl.seqno += 1;
                self.send(
                    &mut s,
                    Msg::Create {
                        session,
                        seqno,
                        key,
                    },
                );
            }
            ComputeAction::Drop(i) => {
                let id = self.pool[i].id;
                s.ctl.commands += 1;
                s.ctl.catalog.retain(|k| k.id != id);
                let session = s.ctl.session;
                s.ctl.seqno += 1;
                self.send(&mut s, Msg::Drop { session, id });
            }
            ComputeAction::Crash => {
                s.ctl.faults += 1;
                s.ctl.up = false;
                for c in &mut s.channels {
                    c.clear();
                }
            }
            ComputeAction::Restart => {
                s.ctl.up = true;
                s.ctl.epoch += 1;
                s.ctl.machine = self.controller_machine(s.workers.len());
                self.start_session(&mut s);
            }
            ComputeAction::DropConnection(p) => {
                s.ctl.faults += 1;
                s.channels[p].clear();
                self.start_session(&mut s);
            }
            ComputeAction::ProcessCrash(_) => {
                s.ctl.faults += 1;
                for w in &mut s.workers {
                    w.halted = true;
                }
            }
            ComputeAction::CheckHistories => {
                // The processes must agree with each other: after a crash the
                // controller cannot know what they applied (it lost what was
                // in flight), and fresh processes have no history at all.
                // The model's policy restarts the replica on a mismatch.
                let step = match s.ctl.machine.check_histories(0, u64::MAX) {
                    HistoryStep::AskPolicy { .. } => s
                        .ctl
                        .machine
                        .mismatch_resolved(MismatchResolution::RestartReplica, 0),
                    step => step,
                };
                match step {
                    HistoryStep::Complete { .. } => self.complete(&mut s),
                    HistoryStep::RestartReplica => self.restart_replica(&mut s),
                    HistoryStep::Wait | HistoryStep::AskPolicy { .. } => return None,
                }
            }
            ComputeAction::RestartReplica => self.restart_replica(&mut s),
            ComputeAction::Receive(p) => {
                let msg = s.channels[p].pop_front()?;
                match self.strategy {
                    Strategy::Naive | Strategy::Barrier => self.receive(&mut s, p, &msg),
                    Strategy::Broadcast => s.stream.push(msg),
                    Strategy::Log => return None,
                }
            }
            ComputeAction::Decide(p, read) => {
                let d = self.decision(&s, p, read)?;
                if d == BarrierDecision::Wait {
                    return None;
                }
                for _ in 0..read {
                    let (from, record) = s.inboxes[p].pop_front()?;
                    s.workers[p].machine.on_mesh(from, record);
                }
                self.run(&mut s, p);
            }
            ComputeAction::Apply(p) => {
                let msg = s.stream.get(s.workers[p].cursor)?.clone();
                s.workers[p].cursor += 1;
                self.receive(&mut s, p, &msg);
            }
        }
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always("I1 lockstep", |m: &Self, s| m.check_i1(s).is_ok()),
            Property::always("I4 no partial install", |m: &Self, s| m.check_i4(s).is_ok()),
            Property::always(
                "I2 target reachable without another fault",
                |m: &Self, s| m.target_reachable(s),
            ),
            Property::sometimes(
                "recovers from a fault with dataflows running",
                |m: &Self, s: &ComputeState| {
                    s.ctl.faults > 0 && !s.ctl.catalog.is_empty() && m.done(s)
                },
            ),
        ]
    }
}
