//! The compute model's state and actions: messages, commands, the controller,
//! workers, the state, the actions, and the dataflow pool.

use std::collections::VecDeque;

use lockstep_protocol::{DataflowDescription, Digest, Export, Strategy};
use lockstep_reconcile::{
    CommandClass, ControllerSession, CreationEntry, DataflowKey, MeshAnnouncement, Phase,
    SessionCommand, WorkerSession, WorkerView,
};

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
        /// What InitializationComplete is sent with (the controller's
        /// machine decides: `barrier` for a naive session that must
        /// reconcile collectively).
        complete: Strategy,
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
    /// The strategy it was sent with.
    pub strategy: Strategy,
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
    fn strategy(&self) -> Strategy {
        self.strategy
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
    /// The session it was sent in.
    pub fn session(&self) -> u64 {
        match self {
            Msg::Hello { session }
            | Msg::Target { session, .. }
            | Msg::Create { session, .. }
            | Msg::Drop { session, .. } => *session,
        }
    }

    /// The commands a worker receives for this message.
    pub(super) fn commands(&self, strategy: Strategy) -> Vec<Cmd> {
        let cmd = |seqno, kind| Cmd {
            strategy,
            seqno,
            kind,
        };
        match self {
            Msg::Hello { session } => vec![cmd(0, CmdKind::Hello(*session))],
            Msg::Target {
                seqno,
                keys,
                complete,
                ..
            } => keys
                .iter()
                .map(|k| cmd(*seqno, CmdKind::Create(*k)))
                .chain([Cmd {
                    strategy: *complete,
                    seqno: *seqno,
                    kind: CmdKind::Complete,
                }])
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
    /// Position in the sequencer's stream (broadcast sessions); a worker
    /// that tails the log keeps its position there in its machine
    /// ([`Worker::log_position`]).
    pub cursor: usize,
    /// It halted (a barrier diverged, or its process died).
    pub halted: bool,
}

/// What a model worker runs, as its session machine sees it: what it runs
/// and everything it built.
pub(super) struct Runs<'a>(
    pub(super) &'a [(u64, DataflowKey)],
    pub(super) &'a [CreationEntry],
);

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
    /// A fresh worker running `machine` (in session 0), at the start of the
    /// sequencer's stream (a fresh mesh's; where it reads the log from, its
    /// machine says).
    pub(super) fn fresh(machine: WorkerSession<Cmd>) -> Self {
        Worker {
            machine,
            installed: Vec::new(),
            log: Vec::new(),
            next_index: 0,
            cursor: 0,
            halted: false,
        }
    }

    /// Its position in the durable log (its machine's), 0 if it tails none.
    pub fn log_position(&self) -> usize {
        self.machine.log_position().map_or(0, |p| p as usize)
    }

    pub(super) fn keys(&self) -> Vec<DataflowKey> {
        self.installed.iter().map(|(_, k)| *k).collect()
    }
    pub(super) fn build(&mut self, key: DataflowKey) {
        self.log.push((self.next_index, key.id, key.hash));
        self.installed.push((self.next_index, key));
        self.next_index += 1;
    }
    pub(super) fn drop_id(&mut self, id: u64) {
        self.installed.retain(|(_, k)| k.id != id);
    }
    /// Applies a command the machine let through, as the replica's worker
    /// does: a create of an installed ID builds nothing (kept with the same
    /// description, refused with another).
    pub(super) fn apply(&mut self, cmd: &Cmd) {
        match cmd.kind {
            CmdKind::Create(key) if !self.installed.iter().any(|(_, k)| k.id == key.id) => {
                self.build(key)
            }
            CmdKind::Drop(id) => self.drop_id(id),
            _ => {}
        }
    }
    /// The worker has joined `session` and has nothing left to do in it.
    pub(super) fn settled_in(&self, session: u64) -> bool {
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
    /// The durable log (with a marker of every session when some session
    /// uses `log` and others do not).
    pub stream: Vec<Msg>,
    /// The sequencer's stream (broadcast sessions): what process 0 received
    /// of them, in the order every worker applies it. It lives in the mesh:
    /// a replica restart empties it.
    pub sequenced: Vec<Msg>,
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
    /// A worker applies the next entry of the sequencer's stream
    /// (broadcast).
    Apply(usize),
    /// A worker reads the next entry of the durable log (log).
    ReadLog(usize),
}

impl ComputeAction {
    /// Faults and new user commands: what the liveness search may not use.
    pub(super) fn is_fault_or_user(&self) -> bool {
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
pub(super) const LABELS: [&str; 4] = ["A", "B", "A'", "C"];

/// The most dataflows the pool holds.
pub const MAX_DATAFLOWS: usize = LABELS.len();

/// The description of pool dataflow `i`: its hash is the real
/// [`DataflowDescription::hash`].
pub(super) fn description(i: usize) -> DataflowDescription {
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
            // The built-in family's `get(100)`; the model never reads it.
            description: vec![0x0a, 0x02, 0x08, 100],
        }],
        debug_name: LABELS[i.min(MAX_DATAFLOWS - 1)].to_string(),
        format: lockstep_protocol::DEFAULT_FORMAT.into(),
    }
}

/// A state's 64-bit fingerprint, for the liveness cache.
pub(super) fn fingerprint(s: &ComputeState) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    s.hash(&mut h);
    h.finish()
}

/// A model-local digest of anything hashable (the model is tiny, so a 64-bit
/// hash stands in for BLAKE3).
pub(super) fn digest_of<T: std::hash::Hash>(value: &T) -> Digest {
    use std::hash::Hasher;
    let mut h = std::collections::hash_map::DefaultHasher::new();
    value.hash(&mut h);
    let mut d = [0u8; 32];
    d[..8].copy_from_slice(&h.finish().to_le_bytes());
    Digest(d)
}
