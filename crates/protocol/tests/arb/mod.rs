//! proptest strategies for the plain protocol types, shared by the tests.
#![allow(dead_code, missing_docs)]

use std::collections::BTreeMap;

use lockstep_protocol::{
    Command, CommandKind, CreationLogEntry, DataflowDescription, Digest, ErrorKind, ErrorResponse,
    Export, Frontier, Hello, HelloResponse, Peek, PeekResponse, PeekResult, Response, ResponseKind,
    Row, Status, Subscribe, SubscribeBatch, Update, WriteInput,
};
use proptest::collection::{btree_map, vec};
use proptest::prelude::*;

pub fn strategy() -> impl Strategy<Value = lockstep_protocol::Strategy> {
    prop::sample::select(lockstep_protocol::Strategy::ALL.to_vec())
}

fn frontier() -> impl Strategy<Value = Frontier> {
    prop::option::of(any::<u64>())
}

fn map() -> impl Strategy<Value = BTreeMap<String, String>> {
    btree_map("[a-z]{1,6}", "[a-z0-9]{0,6}", 0..4)
}

fn row() -> impl Strategy<Value = Row> {
    vec(any::<u8>(), 0..24)
}

pub fn update() -> impl Strategy<Value = Update> {
    (row(), any::<u64>(), any::<i64>()).prop_map(|(row, time, diff)| Update { row, time, diff })
}

pub fn dataflow() -> impl Strategy<Value = DataflowDescription> {
    (
        any::<u64>(),
        any::<u64>(),
        vec(0u64..10, 0..3),
        vec((any::<u64>(), vec(any::<u8>(), 0..16)), 1..3),
        "[a-z ]{0,10}",
        // The default (empty on the wire) or another family's name.
        prop_oneof![
            Just(lockstep_protocol::DEFAULT_FORMAT.to_string()),
            "[a-z.]{1,12}"
        ],
    )
        .prop_map(
            |(id, as_of, inputs, exports, debug_name, format)| DataflowDescription {
                id,
                as_of,
                inputs,
                exports: exports
                    .into_iter()
                    .map(|(collection_id, description)| Export {
                        collection_id,
                        description,
                    })
                    .collect(),
                debug_name,
                format,
            },
        )
}

pub fn command_kind() -> impl Strategy<Value = CommandKind> {
    prop_oneof![
        (
            any::<u32>(),
            any::<u64>(),
            any::<u64>(),
            any::<u64>(),
            any::<u32>(),
            any::<u32>(),
            any::<u32>(),
            proptest::collection::vec(any::<u8>(), 0..40),
            any::<u32>()
        )
            .prop_map(
                |(v, e, n, r, pi, pc, w, proof, max)| CommandKind::Hello(Hello {
                    protocol_version: v,
                    epoch: e,
                    nonce: n,
                    replica_id: r,
                    process_index: pi,
                    process_count: pc,
                    workers_per_process: w,
                    proof,
                    max_protocol_version: max,
                })
            ),
        map().prop_map(CommandKind::CreateInstance),
        Just(CommandKind::InitializationComplete),
        map().prop_map(CommandKind::UpdateConfiguration),
        dataflow().prop_map(CommandKind::CreateDataflow),
        any::<u64>().prop_map(|dataflow_id| CommandKind::Schedule { dataflow_id }),
        (any::<u64>(), frontier()).prop_map(|(collection_id, frontier)| {
            CommandKind::AllowCompaction {
                collection_id,
                frontier,
            }
        }),
        (any::<u64>(), any::<u64>(), any::<u64>()).prop_map(|(a, b, c)| CommandKind::Peek(Peek {
            peek_id: a,
            collection_id: b,
            timestamp: c
        })),
        any::<u64>().prop_map(|peek_id| CommandKind::CancelPeek { peek_id }),
        (any::<u64>(), any::<u64>(), any::<u64>()).prop_map(|(a, b, c)| CommandKind::Subscribe(
            Subscribe {
                subscribe_id: a,
                collection_id: b,
                as_of: c
            }
        )),
        (
            any::<u64>(),
            vec(update(), 0..4),
            any::<u64>(),
            any::<bool>(),
            proptest::option::of(any::<[u64; 4]>())
        )
            .prop_map(|(collection_id, updates, upper, more, batch_digest)| {
                CommandKind::WriteInput(WriteInput {
                    collection_id,
                    updates,
                    upper,
                    more,
                    batch_digest,
                })
            }),
        any::<bool>().prop_map(|full| CommandKind::StatusRequest { full }),
    ]
}

pub fn command() -> impl Strategy<Value = Command> {
    (any::<u64>(), strategy(), command_kind()).prop_map(|(seqno, strategy, kind)| Command {
        seqno,
        strategy,
        kind,
    })
}

fn digest() -> impl Strategy<Value = Digest> {
    any::<[u8; 32]>().prop_map(Digest)
}

fn error_kind() -> impl Strategy<Value = ErrorKind> {
    prop::sample::select(vec![
        ErrorKind::VersionMismatch,
        ErrorKind::StaleEpoch,
        ErrorKind::ConfigMismatch,
        ErrorKind::Malformed,
        ErrorKind::Sequence,
        ErrorKind::InvalidCommand,
        ErrorKind::LockstepLost,
    ])
}

pub fn response() -> impl Strategy<Value = Response> {
    let kind = prop_oneof![
        vec((any::<u64>(), frontier()), 0..4).prop_map(ResponseKind::Frontiers),
        (
            any::<u64>(),
            prop_oneof![
                vec((row(), any::<i64>()), 0..4).prop_map(PeekResult::Rows),
                vec((row(), any::<i64>()), 0..4).prop_map(PeekResult::Part),
                ".{0,10}".prop_map(PeekResult::Error),
                Just(PeekResult::Canceled),
            ]
        )
            .prop_map(
                |(peek_id, result)| ResponseKind::PeekResponse(PeekResponse { peek_id, result })
            ),
        (any::<u64>(), any::<u64>(), frontier(), vec(update(), 0..4)).prop_map(
            |(subscribe_id, lower, upper, updates)| ResponseKind::SubscribeResponse(
                SubscribeBatch {
                    subscribe_id,
                    lower,
                    upper,
                    updates
                }
            )
        ),
        (
            any::<u32>(),
            any::<u64>(),
            any::<u64>(),
            any::<u64>(),
            prop::option::of(digest()),
            vec((any::<u64>(), any::<u64>(), digest()), 0..4),
            vec(any::<u64>(), 0..4)
        )
            .prop_map(
                |(w, e, n, s, h, log, installed)| ResponseKind::Status(Status {
                    worker_index: w,
                    epoch: e,
                    nonce: n,
                    applied_seqno: s,
                    history_hash: h,
                    creation_log: log
                        .into_iter()
                        .map(
                            |(timely_index, dataflow_id, description_hash)| CreationLogEntry {
                                timely_index,
                                dataflow_id,
                                description_hash
                            }
                        )
                        .collect(),
                    installed
                })
            ),
        (error_kind(), ".{0,20}", any::<u64>()).prop_map(|(kind, message, seqno)| {
            ResponseKind::Error(ErrorResponse {
                kind,
                message,
                seqno,
            })
        }),
        (any::<u32>(), ".{0,20}").prop_map(|(protocol_version, build_version)| {
            ResponseKind::HelloResponse(HelloResponse {
                protocol_version,
                build_version,
            })
        }),
    ];
    (any::<u32>(), kind).prop_map(|(process_index, kind)| Response {
        process_index,
        kind,
    })
}
