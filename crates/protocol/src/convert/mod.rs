//! Conversions between the wire types ([`crate::proto`]) and the plain types.
//!
//! Plain to wire is infallible; wire to plain checks every rule a decoder can
//! check (required fields present, enums known, frontiers well formed) and
//! returns a [`ConvertError`] naming what is wrong.

use crate::proto as p;
use crate::types::*;

/// A wire message that decodes but breaks a rule of the protocol.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConvertError {
    /// A required field or oneof is absent.
    #[error("malformed {message}: missing field `{field}`")]
    Missing {
        /// The message type.
        message: &'static str,
        /// The field.
        field: &'static str,
    },
    /// An enum holds a value this version does not know (or UNSPECIFIED).
    #[error("malformed {message}: unknown value {value} for `{field}`")]
    UnknownEnum {
        /// The message type.
        message: &'static str,
        /// The field.
        field: &'static str,
        /// The value found.
        value: i32,
    },
    /// A frontier with more than one element.
    #[error("malformed frontier for `{field}`: {len} elements, at most 1 allowed for totally ordered time")]
    Frontier {
        /// The field.
        field: &'static str,
        /// The number of elements.
        len: usize,
    },
    /// A split write's digest that is not empty or 4 lanes.
    #[error("malformed digest in `{field}`: {len} lanes, expected none or 4")]
    DigestLanes {
        /// The field.
        field: &'static str,
        /// How many lanes it had.
        len: usize,
    },
    /// A digest of the wrong length.
    #[error("malformed digest in `{field}`: {len} bytes, expected 32")]
    Digest {
        /// The field.
        field: &'static str,
        /// Its length.
        len: usize,
    },
}

fn missing(message: &'static str, field: &'static str) -> ConvertError {
    ConvertError::Missing { message, field }
}

fn frontier_from(field: &'static str, v: Vec<u64>) -> Result<Frontier, ConvertError> {
    match v.len() {
        0 => Ok(None),
        1 => Ok(Some(v[0])),
        len => Err(ConvertError::Frontier { field, len }),
    }
}

fn frontier_to(f: Frontier) -> Vec<u64> {
    f.into_iter().collect()
}

fn digest_from(field: &'static str, v: Vec<u8>) -> Result<Digest, ConvertError> {
    let len = v.len();
    v.try_into()
        .map(Digest)
        .map_err(|_| ConvertError::Digest { field, len })
}

// ---------------------------------------------------------------- strategy

impl From<Strategy> for p::Strategy {
    fn from(s: Strategy) -> Self {
        match s {
            Strategy::Broadcast => p::Strategy::Broadcast,
            Strategy::Barrier => p::Strategy::Barrier,
            Strategy::Log => p::Strategy::Log,
            Strategy::Naive => p::Strategy::Naive,
        }
    }
}

fn strategy_from(v: i32) -> Result<Strategy, ConvertError> {
    let bad = ConvertError::UnknownEnum {
        message: "Command",
        field: "strategy",
        value: v,
    };
    match p::Strategy::try_from(v).map_err(|_| bad.clone())? {
        p::Strategy::Unspecified => Err(bad),
        p::Strategy::Broadcast => Ok(Strategy::Broadcast),
        p::Strategy::Barrier => Ok(Strategy::Barrier),
        p::Strategy::Log => Ok(Strategy::Log),
        p::Strategy::Naive => Ok(Strategy::Naive),
    }
}

// ---------------------------------------------------------------- dataflows

impl From<DataflowDescription> for p::DataflowDescription {
    fn from(d: DataflowDescription) -> Self {
        p::DataflowDescription {
            id: d.id,
            as_of: d.as_of,
            inputs: d.inputs,
            exports: d
                .exports
                .into_iter()
                .map(|e| p::Export {
                    collection_id: e.collection_id,
                    description: e.description,
                })
                .collect(),
            debug_name: d.debug_name,
            format: if d.format == DEFAULT_FORMAT {
                String::new()
            } else {
                d.format
            },
        }
    }
}

impl TryFrom<p::DataflowDescription> for DataflowDescription {
    type Error = ConvertError;
    fn try_from(d: p::DataflowDescription) -> Result<Self, ConvertError> {
        Ok(DataflowDescription {
            id: d.id,
            as_of: d.as_of,
            inputs: d.inputs,
            exports: d
                .exports
                .into_iter()
                .map(|e| Export {
                    collection_id: e.collection_id,
                    description: e.description,
                })
                .collect(),
            debug_name: d.debug_name,
            format: if d.format.is_empty() {
                DEFAULT_FORMAT.to_string()
            } else {
                d.format
            },
        })
    }
}

impl DataflowDescription {
    /// Stable hash of the description: BLAKE3 of its deterministic protobuf
    /// encoding. Equal descriptions hash equal on every worker and build.
    pub fn hash(&self) -> Digest {
        use prost::Message;
        let wire = p::DataflowDescription::from(self.clone());
        Digest(*blake3::hash(&wire.encode_to_vec()).as_bytes())
    }
}

// ---------------------------------------------------------------- commands

impl From<Update> for p::Update {
    fn from(u: Update) -> Self {
        p::Update {
            row: u.row,
            time: u.time,
            diff: u.diff,
        }
    }
}

/// Every wire update is an update: a row is bytes its family reads.
impl From<p::Update> for Update {
    fn from(u: p::Update) -> Self {
        Update {
            row: u.row,
            time: u.time,
            diff: u.diff,
        }
    }
}

impl From<CommandKind> for p::command::Kind {
    fn from(kind: CommandKind) -> Self {
        use p::command::Kind;
        match kind {
            CommandKind::Hello(h) => Kind::Hello(p::Hello {
                protocol_version: h.protocol_version,
                epoch: h.epoch,
                nonce: h.nonce,
                replica_id: h.replica_id,
                process_index: h.process_index,
                process_count: h.process_count,
                workers_per_process: h.workers_per_process,
                proof: h.proof,
                max_protocol_version: h.max_protocol_version,
            }),
            CommandKind::CreateInstance(settings) => {
                Kind::CreateInstance(p::CreateInstance { settings })
            }
            CommandKind::InitializationComplete => {
                Kind::InitializationComplete(p::InitializationComplete {})
            }
            CommandKind::UpdateConfiguration(params) => {
                Kind::UpdateConfiguration(p::UpdateConfiguration { params })
            }
            CommandKind::CreateDataflow(d) => Kind::CreateDataflow(p::CreateDataflow {
                dataflow: Some(d.into()),
            }),
            CommandKind::Schedule { dataflow_id } => Kind::Schedule(p::Schedule { dataflow_id }),
            CommandKind::AllowCompaction {
                collection_id,
                frontier,
            } => Kind::AllowCompaction(p::AllowCompaction {
                collection_id,
                frontier: frontier_to(frontier),
            }),
            CommandKind::Peek(pk) => Kind::Peek(p::Peek {
                peek_id: pk.peek_id,
                collection_id: pk.collection_id,
                timestamp: pk.timestamp,
            }),
            CommandKind::CancelPeek { peek_id } => Kind::CancelPeek(p::CancelPeek { peek_id }),
            CommandKind::CancelSubscribe { subscribe_id } => {
                Kind::CancelSubscribe(p::CancelSubscribe { subscribe_id })
            }
            CommandKind::Subscribe(s) => Kind::Subscribe(p::Subscribe {
                subscribe_id: s.subscribe_id,
                collection_id: s.collection_id,
                as_of: s.as_of,
            }),
            CommandKind::WriteInput(w) => Kind::WriteInput(w.into()),
            CommandKind::StatusRequest { full } => Kind::StatusRequest(p::StatusRequest { full }),
        }
    }
}

impl TryFrom<p::command::Kind> for CommandKind {
    type Error = ConvertError;
    fn try_from(kind: p::command::Kind) -> Result<Self, ConvertError> {
        use p::command::Kind;
        Ok(match kind {
            Kind::Hello(h) => CommandKind::Hello(Hello {
                protocol_version: h.protocol_version,
                epoch: h.epoch,
                nonce: h.nonce,
                replica_id: h.replica_id,
                process_index: h.process_index,
                process_count: h.process_count,
                workers_per_process: h.workers_per_process,
                proof: h.proof,
                max_protocol_version: h.max_protocol_version,
            }),
            Kind::CreateInstance(c) => CommandKind::CreateInstance(c.settings),
            Kind::InitializationComplete(_) => CommandKind::InitializationComplete,
            Kind::UpdateConfiguration(u) => CommandKind::UpdateConfiguration(u.params),
            Kind::CreateDataflow(c) => CommandKind::CreateDataflow(
                c.dataflow
                    .ok_or_else(|| missing("CreateDataflow", "dataflow"))?
                    .try_into()?,
            ),
            Kind::Schedule(s) => CommandKind::Schedule {
                dataflow_id: s.dataflow_id,
            },
            Kind::AllowCompaction(a) => CommandKind::AllowCompaction {
                collection_id: a.collection_id,
                frontier: frontier_from("AllowCompaction.frontier", a.frontier)?,
            },
            Kind::Peek(pk) => CommandKind::Peek(Peek {
                peek_id: pk.peek_id,
                collection_id: pk.collection_id,
                timestamp: pk.timestamp,
            }),
            Kind::CancelPeek(c) => CommandKind::CancelPeek { peek_id: c.peek_id },
            Kind::CancelSubscribe(c) => CommandKind::CancelSubscribe {
                subscribe_id: c.subscribe_id,
            },
            Kind::Subscribe(s) => CommandKind::Subscribe(Subscribe {
                subscribe_id: s.subscribe_id,
                collection_id: s.collection_id,
                as_of: s.as_of,
            }),
            Kind::WriteInput(w) => CommandKind::WriteInput(w.try_into()?),
            Kind::StatusRequest(s) => CommandKind::StatusRequest { full: s.full },
        })
    }
}

impl From<WriteInput> for p::WriteInput {
    fn from(w: WriteInput) -> Self {
        p::WriteInput {
            collection_id: w.collection_id,
            updates: w.updates.into_iter().map(p::Update::from).collect(),
            upper: w.upper,
            more: w.more,
            batch_digest: w.batch_digest.map(Vec::from).unwrap_or_default(),
        }
    }
}

/// The one conversion of a wire write: the command's, and the environment's
/// stored inputs'. A digest of other than 4 lanes is refused, naming the
/// field.
impl TryFrom<p::WriteInput> for WriteInput {
    type Error = ConvertError;
    fn try_from(w: p::WriteInput) -> Result<Self, ConvertError> {
        Ok(WriteInput {
            collection_id: w.collection_id,
            updates: w.updates.into_iter().map(Update::from).collect(),
            upper: w.upper,
            more: w.more,
            batch_digest: match w.batch_digest.len() {
                0 => None,
                4 => Some(w.batch_digest.try_into().expect("4 lanes")),
                len => {
                    return Err(ConvertError::DigestLanes {
                        field: "WriteInput.batch_digest",
                        len,
                    })
                }
            },
        })
    }
}

impl From<Command> for p::Command {
    fn from(c: Command) -> Self {
        p::Command {
            seqno: c.seqno,
            strategy: p::Strategy::from(c.strategy) as i32,
            kind: Some(c.kind.into()),
        }
    }
}

impl TryFrom<p::Command> for Command {
    type Error = ConvertError;
    fn try_from(c: p::Command) -> Result<Self, ConvertError> {
        let kind = c
            .kind
            .ok_or_else(|| missing("Command", "kind"))?
            .try_into()?;
        Ok(Command {
            seqno: c.seqno,
            strategy: strategy_from(c.strategy)?,
            kind,
        })
    }
}

// ---------------------------------------------------------------- responses

impl From<ErrorKind> for p::ErrorKind {
    fn from(k: ErrorKind) -> Self {
        match k {
            ErrorKind::VersionMismatch => p::ErrorKind::VersionMismatch,
            ErrorKind::StaleEpoch => p::ErrorKind::StaleEpoch,
            ErrorKind::ConfigMismatch => p::ErrorKind::ConfigMismatch,
            ErrorKind::Malformed => p::ErrorKind::Malformed,
            ErrorKind::Sequence => p::ErrorKind::Sequence,
            ErrorKind::InvalidCommand => p::ErrorKind::InvalidCommand,
            ErrorKind::LockstepLost => p::ErrorKind::LockstepLost,
            ErrorKind::Unauthenticated => p::ErrorKind::Unauthenticated,
        }
    }
}

fn error_kind_from(v: i32) -> Result<ErrorKind, ConvertError> {
    let bad = ConvertError::UnknownEnum {
        message: "Error",
        field: "kind",
        value: v,
    };
    Ok(match p::ErrorKind::try_from(v).map_err(|_| bad.clone())? {
        p::ErrorKind::Unspecified => return Err(bad),
        p::ErrorKind::VersionMismatch => ErrorKind::VersionMismatch,
        p::ErrorKind::StaleEpoch => ErrorKind::StaleEpoch,
        p::ErrorKind::ConfigMismatch => ErrorKind::ConfigMismatch,
        p::ErrorKind::Malformed => ErrorKind::Malformed,
        p::ErrorKind::Sequence => ErrorKind::Sequence,
        p::ErrorKind::InvalidCommand => ErrorKind::InvalidCommand,
        p::ErrorKind::LockstepLost => ErrorKind::LockstepLost,
        p::ErrorKind::Unauthenticated => ErrorKind::Unauthenticated,
    })
}

impl From<ResponseKind> for p::response::Kind {
    fn from(kind: ResponseKind) -> Self {
        use p::response::Kind;
        match kind {
            ResponseKind::Frontiers(updates) => Kind::Frontiers(p::Frontiers {
                updates: updates
                    .into_iter()
                    .map(|(collection_id, upper)| p::FrontierUpdate {
                        collection_id,
                        upper: frontier_to(upper),
                    })
                    .collect(),
            }),
            ResponseKind::PeekResponse(r) => {
                use p::peek_response::Result as R;
                let result = match r.result {
                    PeekResult::Rows(rows) => R::Rows(p::PeekRows {
                        rows: rows
                            .into_iter()
                            .map(|(values, diff)| p::Row { values, diff })
                            .collect(),
                    }),
                    PeekResult::Part(rows) => R::Part(p::PeekRows {
                        rows: rows
                            .into_iter()
                            .map(|(values, diff)| p::Row { values, diff })
                            .collect(),
                    }),
                    PeekResult::Error(e) => R::Error(e),
                    PeekResult::Canceled => R::Canceled(true),
                };
                Kind::PeekResponse(p::PeekResponse {
                    peek_id: r.peek_id,
                    result: Some(result),
                })
            }
            ResponseKind::SubscribeResponse(b) => Kind::SubscribeResponse(p::SubscribeResponse {
                subscribe_id: b.subscribe_id,
                lower: b.lower,
                upper: frontier_to(b.upper),
                updates: b.updates.into_iter().map(p::Update::from).collect(),
            }),
            ResponseKind::Status(s) => Kind::Status(p::Status {
                worker_index: s.worker_index,
                epoch: s.epoch,
                nonce: s.nonce,
                applied_seqno: s.applied_seqno,
                history_hash: s.history_hash.map(|d| d.0.to_vec()).unwrap_or_default(),
                creation_log: s
                    .creation_log
                    .into_iter()
                    .map(|e| p::CreationLogEntry {
                        timely_index: e.timely_index,
                        dataflow_id: e.dataflow_id,
                        description_hash: e.description_hash.0.to_vec(),
                    })
                    .collect(),
                installed: s.installed,
            }),
            ResponseKind::Error(e) => Kind::Error(p::Error {
                kind: p::ErrorKind::from(e.kind) as i32,
                message: e.message,
                seqno: e.seqno,
            }),
            ResponseKind::HelloResponse(h) => Kind::HelloResponse(p::HelloResponse {
                protocol_version: h.protocol_version,
                build_version: h.build_version,
            }),
        }
    }
}

impl TryFrom<p::response::Kind> for ResponseKind {
    type Error = ConvertError;
    fn try_from(kind: p::response::Kind) -> Result<Self, ConvertError> {
        use p::response::Kind;
        Ok(match kind {
            Kind::Frontiers(f) => ResponseKind::Frontiers(
                f.updates
                    .into_iter()
                    .map(|u| {
                        Ok((
                            u.collection_id,
                            frontier_from("FrontierUpdate.upper", u.upper)?,
                        ))
                    })
                    .collect::<Result<_, ConvertError>>()?,
            ),
            Kind::PeekResponse(r) => {
                use p::peek_response::Result as R;
                let result = match r.result.ok_or_else(|| missing("PeekResponse", "result"))? {
                    R::Rows(rows) => PeekResult::Rows(
                        rows.rows.into_iter().map(|r| (r.values, r.diff)).collect(),
                    ),
                    R::Part(rows) => PeekResult::Part(
                        rows.rows.into_iter().map(|r| (r.values, r.diff)).collect(),
                    ),
                    R::Error(e) => PeekResult::Error(e),
                    R::Canceled(_) => PeekResult::Canceled,
                };
                ResponseKind::PeekResponse(PeekResponse {
                    peek_id: r.peek_id,
                    result,
                })
            }
            Kind::SubscribeResponse(b) => ResponseKind::SubscribeResponse(SubscribeBatch {
                subscribe_id: b.subscribe_id,
                lower: b.lower,
                upper: frontier_from("SubscribeResponse.upper", b.upper)?,
                updates: b.updates.into_iter().map(Update::from).collect(),
            }),
            Kind::Status(s) => ResponseKind::Status(Status {
                worker_index: s.worker_index,
                epoch: s.epoch,
                nonce: s.nonce,
                applied_seqno: s.applied_seqno,
                history_hash: if s.history_hash.is_empty() {
                    None
                } else {
                    Some(digest_from("Status.history_hash", s.history_hash)?)
                },
                creation_log: s
                    .creation_log
                    .into_iter()
                    .map(|e| {
                        Ok(CreationLogEntry {
                            timely_index: e.timely_index,
                            dataflow_id: e.dataflow_id,
                            description_hash: digest_from(
                                "CreationLogEntry.description_hash",
                                e.description_hash,
                            )?,
                        })
                    })
                    .collect::<Result<_, ConvertError>>()?,
                installed: s.installed,
            }),
            Kind::Error(e) => ResponseKind::Error(ErrorResponse {
                kind: error_kind_from(e.kind)?,
                message: e.message,
                seqno: e.seqno,
            }),
            Kind::HelloResponse(h) => ResponseKind::HelloResponse(HelloResponse {
                protocol_version: h.protocol_version,
                build_version: h.build_version,
            }),
        })
    }
}

impl From<Response> for p::Response {
    fn from(r: Response) -> Self {
        p::Response {
            process_index: r.process_index,
            kind: Some(r.kind.into()),
        }
    }
}

impl TryFrom<p::Response> for Response {
    type Error = ConvertError;
    fn try_from(r: p::Response) -> Result<Self, ConvertError> {
        Ok(Response {
            process_index: r.process_index,
            kind: r
                .kind
                .ok_or_else(|| missing("Response", "kind"))?
                .try_into()?,
        })
    }
}
