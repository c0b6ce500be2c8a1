//! Plain Rust types of the compute protocol.
//!
//! These mirror `proto/lockstep/compute/v1/compute.proto`; the .proto file is
//! the specification of what each message means and which rules it obeys.

use std::collections::BTreeMap;
use std::fmt;

mod rows;
pub(crate) use rows::{for_each_canonical_varint, next_varint};
pub use rows::{is_canonical_varints, row_owner, varint_count, varint_values};

/// A logical timestamp.
pub type Timestamp = u64;

/// A frontier over totally ordered time: `Some(t)` is the antichain `[t]`,
/// `None` is the empty antichain (complete, or dropped).
pub type Frontier = Option<Timestamp>;

/// A row in its dataflow family's encoding: the control plane only routes
/// and hashes it ([`row_owner`], [`crate::history::updates_digest`]). The
/// built-in family's rows are 64-bit integers as back-to-back varints
/// (`lockstep_plan::row`).
pub type Row = Vec<u8>;

/// A 32-byte digest (BLAKE3).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Digest(pub [u8; 32]);

impl fmt::Debug for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self}")
    }
}

impl fmt::Display for Digest {
    /// The first 8 bytes in hex, enough to tell digests apart in logs.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in &self.0[..8] {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

/// How a command is distributed to the workers. See `docs/strategies.md`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Strategy {
    /// Ordered by one sequencing worker over a timely dataflow.
    Broadcast,
    /// Applied on arrival; dataflow creation waits for all workers to agree.
    Barrier,
    /// Read from a durable totally ordered log.
    Log,
    /// No protection: the negative control.
    Naive,
}

impl Strategy {
    /// Every strategy, in a fixed order.
    pub const ALL: [Strategy; 4] = [
        Strategy::Broadcast,
        Strategy::Barrier,
        Strategy::Log,
        Strategy::Naive,
    ];

    /// The lower-case name used on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            Strategy::Broadcast => "broadcast",
            Strategy::Barrier => "barrier",
            Strategy::Log => "log",
            Strategy::Naive => "naive",
        }
    }
}

impl fmt::Display for Strategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Strategy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Strategy::ALL
            .into_iter()
            .find(|st| st.name() == s)
            .ok_or_else(|| {
                format!("unknown strategy {s:?}: expected broadcast, barrier, log or naive")
            })
    }
}

/// One command, as sent to every process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Command {
    /// Position in the stream of this connection nonce (Hello is 0).
    pub seqno: u64,
    /// The distribution strategy chosen for this command.
    pub strategy: Strategy,
    /// What to do.
    pub kind: CommandKind,
}

/// The command variants. Their rules are documented in the .proto file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CommandKind {
    /// First command on every connection.
    Hello(Hello),
    /// Creates the compute instance with its settings.
    CreateInstance(BTreeMap<String, String>),
    /// Ends reconciliation.
    InitializationComplete,
    /// Changes configuration parameters.
    UpdateConfiguration(BTreeMap<String, String>),
    /// Builds a dataflow on every worker.
    CreateDataflow(DataflowDescription),
    /// Hint that a dataflow may run.
    Schedule {
        /// The dataflow.
        dataflow_id: u64,
    },
    /// Allows compaction of a collection; `None` drops it.
    AllowCompaction {
        /// The collection.
        collection_id: u64,
        /// The new compaction frontier.
        frontier: Frontier,
    },
    /// Reads a collection at a time.
    Peek(Peek),
    /// Cancels a peek.
    CancelPeek {
        /// The peek.
        peek_id: u64,
    },
    /// Streams a collection's changes.
    Subscribe(Subscribe),
    /// Ends a subscription.
    CancelSubscribe {
        /// The subscription.
        subscribe_id: u64,
    },
    /// Appends updates to an input collection.
    WriteInput(WriteInput),
    /// Asks every worker for its Status (the heartbeat).
    StatusRequest {
        /// Whether the Status carries the history digest (costly).
        full: bool,
    },
}

impl CommandKind {
    /// A short name of the variant, for logs, errors and policies.
    pub fn name(&self) -> &'static str {
        match self {
            CommandKind::Hello(_) => "hello",
            CommandKind::CreateInstance(_) => "create-instance",
            CommandKind::InitializationComplete => "initialization-complete",
            CommandKind::UpdateConfiguration(_) => "update-configuration",
            CommandKind::CreateDataflow(_) => "create-dataflow",
            CommandKind::Schedule { .. } => "schedule",
            CommandKind::AllowCompaction { .. } => "allow-compaction",
            CommandKind::Peek(_) => "peek",
            CommandKind::CancelPeek { .. } => "cancel-peek",
            CommandKind::Subscribe(_) => "subscribe",
            CommandKind::CancelSubscribe { .. } => "cancel-subscribe",
            CommandKind::WriteInput(_) => "write-input",
            CommandKind::StatusRequest { .. } => "status-request",
        }
    }
}

/// The handshake command.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hello {
    /// The lowest protocol version the controller speaks (a version-2
    /// controller: its only one). See [`Hello::version_range`].
    pub protocol_version: u32,
    /// The controller's epoch.
    pub epoch: u64,
    /// Random per controller session.
    pub nonce: u64,
    /// The replica's catalog ID.
    pub replica_id: u64,
    /// The index of the receiving process.
    pub process_index: u32,
    /// How many processes the replica has.
    pub process_count: u32,
    /// How many timely workers each process runs.
    pub workers_per_process: u32,
    /// Proof of the replica's session key (see
    /// [`crate::handshake::SessionKey`]); empty without one.
    pub proof: Vec<u8>,
    /// The highest protocol version the controller speaks (since version
    /// 3); 0, as from a version-2 controller, means `protocol_version` only.
    /// Not covered by `proof` (see [`crate::handshake`]).
    pub max_protocol_version: u32,
}

impl Hello {
    /// The versions the sender speaks, `(lowest, highest)`: a
    /// `max_protocol_version` of 0 (a version-2 controller) or below
    /// `protocol_version` means `protocol_version` only.
    pub fn version_range(&self) -> (u32, u32) {
        (
            self.protocol_version,
            self.max_protocol_version.max(self.protocol_version),
        )
    }
}

/// An exported, arranged collection of a dataflow.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Export {
    /// The collection's ID.
    pub collection_id: u64,
    /// How to compute it, in the dataflow family's own encoding (for the
    /// built-in family, `lockstep-plan`, an encoded plan). The control plane
    /// never looks inside: it routes, records and hashes these bytes.
    pub description: Vec<u8>,
}

/// What every worker builds for one CreateDataflow: the envelope the control
/// plane needs (ID, as_of, inputs, exports' IDs) around descriptions only the
/// dataflow's family reads (see [`Export::description`]).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct DataflowDescription {
    /// The dataflow's catalog ID.
    pub id: u64,
    /// Results are correct from this time on.
    pub as_of: Timestamp,
    /// The input collections it reads.
    pub inputs: Vec<u64>,
    /// Its exports (at least one).
    pub exports: Vec<Export>,
    /// For logs only.
    pub debug_name: String,
    /// The family whose encoding the exports' descriptions are in
    /// ([`DEFAULT_FORMAT`] for the built-in plan language).
    pub format: String,
}

/// The format of a dataflow whose description names none: the built-in plan
/// language (`lockstep-plan`), the only family before protocol version 3. On
/// the wire it is the empty string, so such a dataflow encodes as in v0.2.0.
pub const DEFAULT_FORMAT: &str = "lockstep.plan.v1";

/// A read of a collection at a time.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Peek {
    /// Unique among outstanding peeks.
    pub peek_id: u64,
    /// The collection.
    pub collection_id: u64,
    /// The time to read at.
    pub timestamp: Timestamp,
}

/// A subscription to a collection's changes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Subscribe {
    /// Unique among subscriptions.
    pub subscribe_id: u64,
    /// The collection.
    pub collection_id: u64,
    /// Changes from this time on.
    pub as_of: Timestamp,
}

/// `diff` copies of `row` at `time`.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Update {
    /// The row.
    pub row: Row,
    /// When.
    pub time: Timestamp,
    /// How many copies (negative: retraction).
    pub diff: i64,
}

/// Updates to an input collection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WriteInput {
    /// The input collection.
    pub collection_id: u64,
    /// The updates, each at or above the current upper and below `upper`.
    pub updates: Vec<Update>,
    /// The new upper.
    pub upper: Timestamp,
    /// More parts of this write follow (see [`WriteInput::split`]); a worker
    /// holds a part until the last one arrives.
    pub more: bool,
    /// The digest of the whole write's updates
    /// ([`crate::history::updates_digest`]), which a worker adds to its
    /// history instead of computing its own (of its own part, for a write
    /// split per process: [`WriteInput::split_per_process`]). The
    /// controller attaches it to every write it sends
    /// ([`WriteInput::digested`]); `None`: the worker computes it.
    pub batch_digest: Option<[u64; 4]>,
}

/// An upper bound on the bytes one update or peek row whose row takes
/// `row_bytes` bytes takes in an encoded message (its tags, lengths, time
/// and diff included).
pub fn encoded_row_bound(row_bytes: usize) -> usize {
    row_bytes + 40
}

/// Splits `items` into runs whose encoded size (by `bound`) stays within
/// `max_bytes` (every run holds at least one item).
pub fn split_by_size<T>(
    items: Vec<T>,
    max_bytes: usize,
    bound: impl Fn(&T) -> usize,
) -> Vec<Vec<T>> {
    let mut parts = Vec::new();
    let mut part = Vec::new();
    let mut size = 0;
    for item in items {
        let b = bound(&item);
        if !part.is_empty() && size + b > max_bytes {
            parts.push(std::mem::take(&mut part));
            size = 0;
        }
        size += b;
        part.push(item);
    }
    if !part.is_empty() || parts.is_empty() {
        parts.push(part);
    }
    parts
}

impl WriteInput {
    /// The write with its digest (`batch_digest`: the
    /// [`crate::history::updates_digest`] of its updates) attached, if it is
    /// a whole write without one: the controller computes it once for its
    /// own history, and every worker adds it to its history instead of
    /// hashing every row again.
    pub fn digested(mut self) -> WriteInput {
        if self.batch_digest.is_none() && !self.more {
            self.batch_digest = Some(crate::history::updates_digest(&self.updates));
        }
        self
    }

    /// Splits the write into parts whose updates take at most `max_bytes`
    /// encoded: every part but the last has `more` set, and all carry the
    /// same upper. A write that fits is returned as it is.
    /// Only the last part keeps `batch_digest`.
    pub fn split(self, max_bytes: usize) -> Vec<WriteInput> {
        let WriteInput {
            collection_id,
            updates,
            upper,
            more,
            batch_digest,
        } = self;
        let parts = split_by_size(updates, max_bytes, |u| encoded_row_bound(u.row.len()));
        let n = parts.len();
        parts
            .into_iter()
            .enumerate()
            .map(|(i, updates)| WriteInput {
                collection_id,
                updates,
                upper,
                more: more || i + 1 < n,
                batch_digest: if i + 1 == n { batch_digest } else { None },
            })
            .collect()
    }

    /// Splits a whole write for a replica of `processes` x
    /// `workers_per_process`: process `p` gets only the updates its workers
    /// introduce ([`row_owner`]), in parts of at most `max_bytes` encoded
    /// ([`WriteInput::split`]). Every process gets the same number of parts
    /// (padded with empty ones), so that part `k` takes the same sequence
    /// number everywhere, and each process's last part carries the whole
    /// write's digest. Returns one list of parts per process.
    pub fn split_per_process(
        self,
        processes: usize,
        workers_per_process: usize,
        max_bytes: usize,
    ) -> Vec<Vec<WriteInput>> {
        let digest = self
            .batch_digest
            .unwrap_or_else(|| crate::history::updates_digest(&self.updates));
        let workers = processes * workers_per_process;
        let mut shares: Vec<Vec<Update>> = vec![Vec::new(); processes];
        for u in self.updates {
            let p = row_owner(&u.row, workers) / workers_per_process.max(1);
            shares[p.min(processes - 1)].push(u);
        }
        let mut per_process: Vec<Vec<WriteInput>> = shares
            .into_iter()
            .map(|updates| {
                WriteInput {
                    collection_id: self.collection_id,
                    updates,
                    upper: self.upper,
                    more: self.more,
                    batch_digest: Some(digest),
                }
                .split(max_bytes)
            })
            .collect();
        let n = per_process.iter().map(Vec::len).max().unwrap_or(1);
        for parts in &mut per_process {
            // Pad in front of the last part, which keeps `more` and the
            // digest.
            while parts.len() < n {
                let at = parts.len() - 1;
                parts.insert(
                    at,
                    WriteInput {
                        collection_id: self.collection_id,
                        updates: Vec::new(),
                        upper: self.upper,
                        more: true,
                        batch_digest: None,
                    },
                );
            }
        }
        per_process
    }
}

impl PeekResponse {
    /// Splits an answer whose rows take more than `max_bytes` encoded into
    /// [`PeekResult::Part`]s ended by a [`PeekResult::Rows`]; any other
    /// answer is returned as it is.
    pub fn split(self, max_bytes: usize) -> Vec<PeekResponse> {
        let PeekResponse { peek_id, result } = self;
        let rows = match result {
            PeekResult::Rows(rows) => rows,
            result => return vec![PeekResponse { peek_id, result }],
        };
        let parts = split_by_size(rows, max_bytes, |(row, _)| encoded_row_bound(row.len()));
        let n = parts.len();
        parts
            .into_iter()
            .enumerate()
            .map(|(i, rows)| PeekResponse {
                peek_id,
                result: if i + 1 < n {
                    PeekResult::Part(rows)
                } else {
                    PeekResult::Rows(rows)
                },
            })
            .collect()
    }
}

/// One response from one process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Response {
    /// The sending process.
    pub process_index: u32,
    /// What it says.
    pub kind: ResponseKind,
}

/// The response variants.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ResponseKind {
    /// Frontier advances: (collection, new upper).
    Frontiers(Vec<(u64, Frontier)>),
    /// This process's share of a peek answer.
    PeekResponse(PeekResponse),
    /// This process's changes of a subscription.
    SubscribeResponse(SubscribeBatch),
    /// A worker's state.
    Status(Status),
    /// An error.
    Error(ErrorResponse),
    /// Since version 3: the agreed version and the process's build, sent
    /// once per accepted Hello before any Status of that session.
    HelloResponse(HelloResponse),
}

/// A process's answer to a Hello accepted at version 3 or more.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HelloResponse {
    /// The agreed protocol version (the highest both ends speak).
    pub protocol_version: u32,
    /// The process's build version (its Cargo package version).
    pub build_version: String,
}

/// A process's share of a peek's answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeekResponse {
    /// The peek.
    pub peek_id: u64,
    /// The answer.
    pub result: PeekResult,
}

/// The outcome of a peek.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PeekResult {
    /// Rows with their multiplicities.
    Rows(Vec<(Row, i64)>),
    /// A part of the rows; more follow, ended by [`PeekResult::Rows`] (an
    /// answer larger than the frame limit is sent in parts).
    Part(Vec<(Row, i64)>),
    /// The peek could not be answered.
    Error(String),
    /// The peek was canceled.
    Canceled,
}

/// Changes of a subscribed collection in `[lower, upper)`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SubscribeBatch {
    /// The subscription.
    pub subscribe_id: u64,
    /// Lower bound of the batch's times.
    pub lower: Timestamp,
    /// Upper bound of the batch's times; `None` if the subscription ended.
    pub upper: Frontier,
    /// The changes.
    pub updates: Vec<Update>,
}

/// One dataflow a worker built (invariant I1).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct CreationLogEntry {
    /// The timely dataflow index the worker allocated.
    pub timely_index: u64,
    /// The dataflow's catalog ID.
    pub dataflow_id: u64,
    /// Hash of the description.
    pub description_hash: Digest,
}

/// A worker's state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Status {
    /// The worker's global index.
    pub worker_index: u32,
    /// The epoch of the controller it last accepted.
    pub epoch: u64,
    /// The nonce it last accepted.
    pub nonce: u64,
    /// The last sequence number it applied for that nonce.
    pub applied_seqno: u64,
    /// Hash of its compacted applied history, when it was asked for.
    pub history_hash: Option<Digest>,
    /// Every dataflow it built since the process started, in order (only in
    /// full statuses; empty in heartbeats).
    pub creation_log: Vec<CreationLogEntry>,
    /// The dataflows installed now.
    pub installed: Vec<u64>,
}

/// Kinds of protocol errors.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// The controller speaks another protocol version.
    VersionMismatch,
    /// The controller's epoch is older than one already seen.
    StaleEpoch,
    /// Hello's replica shape does not match the process.
    ConfigMismatch,
    /// A frame or message could not be decoded.
    Malformed,
    /// A sequence number gap or repeat.
    Sequence,
    /// A well-formed command that cannot be applied.
    InvalidCommand,
    /// The process cannot prove it is in lockstep; it halts.
    LockstepLost,
    /// A Hello without a valid proof of the replica's session key.
    Unauthenticated,
}

/// An error response.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ErrorResponse {
    /// What kind.
    pub kind: ErrorKind,
    /// A message for people.
    pub message: String,
    /// The command it refers to (0 if none).
    pub seqno: u64,
}
