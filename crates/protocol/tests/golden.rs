//! Golden wire encodings of released protocol versions (docs/compatibility.md).
//!
//! `crates/protocol/golden/<release>/` holds, for a release listed in the
//! repository's `RELEASES` file, the prost encoding of one value of every
//! command and response that crosses the replica wire (`encodings.hex`:
//! `<name> <hex>` per line; a `Command` is also what the `log` strategy's
//! command log stores), generated once by the released code, and the
//! release's proto descriptors (`descriptors.binpb`, a `FileDescriptorSet`
//! compiled by protox from `proto/`, imports included, no source info).
//!
//! The checks in the default suite: every golden encoding decodes with
//! today's code into the value [`v0_2_0`] constructs, and today's encoding of
//! that value is byte for byte the golden one (so a v0.2.0 process decodes it
//! as it decoded its own).
//!
//! Regenerating is for cutting a release, never for making a test pass: it
//! refuses to overwrite a release's files.
//!
//! ```text
//! LOCKSTEP_GOLDEN_RELEASE=v0.2.0 cargo test -p lockstep-protocol --test golden -- --ignored regenerate
//! ```

mod common;

use std::collections::BTreeMap;
use std::fmt::Debug;

use lockstep_plan::{Aggregate, CompareOp, Expr, Plan, Predicate};
use lockstep_protocol::*;
use prost::Message as _;

/// One golden value: a command or a response.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Wire {
    Command(Command),
    Response(Response),
}

impl Wire {
    fn encode(&self) -> Vec<u8> {
        match self {
            Wire::Command(c) => proto::Command::from(c.clone()).encode_to_vec(),
            Wire::Response(r) => proto::Response::from(r.clone()).encode_to_vec(),
        }
    }

    /// Decodes `bytes` as the same message type as `self`, with today's code.
    fn decode_like(&self, bytes: &[u8]) -> Result<Wire, String> {
        match self {
            Wire::Command(_) => {
                let wire = proto::Command::decode(bytes).map_err(|e| e.to_string())?;
                Command::try_from(wire)
                    .map(Wire::Command)
                    .map_err(|e| e.to_string())
            }
            Wire::Response(_) => {
                let wire = proto::Response::decode(bytes).map_err(|e| e.to_string())?;
                Response::try_from(wire)
                    .map(Wire::Response)
                    .map_err(|e| e.to_string())
            }
        }
    }
}

/// The `FileDescriptorSet` of today's `proto/`, encoded.
fn todays_descriptors() -> Vec<u8> {
    common::todays_compiler().encode_file_descriptor_set()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> Vec<u8> {
    assert!(text.len().is_multiple_of(2), "odd hex length");
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&text[i..i + 2], 16).expect("hex"))
        .collect()
}

/// The golden encodings of `release`, in file order.
fn read_encodings(release: &str) -> Vec<(String, Vec<u8>)> {
    let path = common::golden_dir(release).join("encodings.hex");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    text.lines()
        .filter(|l| !l.trim().is_empty() && !l.starts_with('#'))
        .map(|l| {
            let (name, h) = l
                .split_once(' ')
                .unwrap_or_else(|| panic!("malformed line {l:?}"));
            (name.to_string(), unhex(h.trim()))
        })
        .collect()
}

/// The first line where the pretty `Debug` forms of two values differ: it
/// names the field (and its enclosing fields, by indentation) that differs.
fn first_difference(expected: &impl Debug, got: &impl Debug) -> String {
    let (e, g) = (format!("{expected:#?}"), format!("{got:#?}"));
    for (i, (le, lg)) in e.lines().zip(g.lines()).enumerate() {
        if le != lg {
            return format!(
                "line {}: expected `{}`, got `{}`",
                i + 1,
                le.trim(),
                lg.trim()
            );
        }
    }
    format!(
        "one is a prefix of the other ({} vs {} lines)",
        e.lines().count(),
        g.lines().count()
    )
}

fn command(seqno: u64, strategy: Strategy, kind: CommandKind) -> Wire {
    Wire::Command(Command {
        seqno,
        strategy,
        kind,
    })
}

/// A plan that uses every node, expression, comparison and aggregate.
fn every_plan_node() -> Plan {
    let col = |c| Box::new(Expr::Column(c));
    let get = |c| Box::new(Plan::Get { collection_id: c });
    let mapped = Plan::Map {
        input: get(1),
        exprs: vec![
            Expr::Column(0),
            Expr::Literal(-7),
            Expr::Add(col(0), Box::new(Expr::Literal(i64::MAX))),
            Expr::Sub(col(1), col(0)),
            Expr::Mul(col(0), Box::new(Expr::Literal(i64::MIN))),
        ],
    };
    let ops = [
        CompareOp::Eq,
        CompareOp::Ne,
        CompareOp::Lt,
        CompareOp::Le,
        CompareOp::Gt,
        CompareOp::Ge,
    ];
    let filtered = Plan::Filter {
        input: Box::new(mapped),
        predicates: ops
            .into_iter()
            .enumerate()
            .map(|(i, op)| Predicate {
                op,
                left: Expr::Column(i as u32 % 2),
                right: Expr::Literal(i as i64),
            })
            .collect(),
    };
    let joined = Plan::Join {
        left: Box::new(filtered),
        right: get(2),
        left_key: 0,
        right_key: 1,
    };
    let reduced = Plan::Reduce {
        input: Box::new(joined),
        key: vec![0, 2],
        aggregates: vec![Aggregate::Count, Aggregate::Sum(1)],
    };
    Plan::Arrange {
        input: Box::new(reduced),
        key: vec![1],
    }
}

fn response(process_index: u32, kind: ResponseKind) -> Wire {
    Wire::Response(Response {
        process_index,
        kind,
    })
}

/// Every command and response of protocol version 2 (release v0.2.0), one
/// value per name. Frozen: the golden files of v0.2.0 were generated from
/// exactly these values by the v0.2.0 code; a later release adds its own
/// function and directory rather than changing this one (fields added since
/// are set to their defaults, which is what v0.2.0 bytes decode to).
fn v0_2_0() -> Vec<(&'static str, Wire)> {
    let hello = Hello {
        protocol_version: 2,
        epoch: 7,
        nonce: 3,
        replica_id: 11,
        process_index: 1,
        process_count: 2,
        workers_per_process: 4,
        proof: Vec::new(),
        max_protocol_version: 0,
    };
    let signed = SessionKey::from_bytes([0x5a; 32]).sign(hello.clone());
    let settings: BTreeMap<String, String> = [("a", "1"), ("zeta", "")]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let dataflow = DataflowDescription {
        id: 42,
        as_of: 5,
        inputs: vec![1, 2],
        exports: vec![
            lockstep_plan::export(100, &every_plan_node()),
            lockstep_plan::export(101, &Plan::Get { collection_id: 2 }),
        ],
        debug_name: "golden dataflow ü".to_string(),
        format: lockstep_plan::FORMAT.into(),
    };
    let updates = vec![
        Update {
            row: lockstep_plan::row(&[1, -2, i64::MAX]),
            time: 5,
            diff: 1,
        },
        Update {
            row: vec![],
            time: 6,
            diff: -3,
        },
    ];
    let rows = vec![
        (lockstep_plan::row(&[1, 2]), 1),
        (lockstep_plan::row(&[i64::MIN]), -2),
    ];
    let status = |full: bool| Status {
        worker_index: 3,
        epoch: 7,
        nonce: 3,
        applied_seqno: 12,
        history_hash: full.then_some(Digest([0xab; 32])),
        creation_log: if full {
            vec![
                CreationLogEntry {
                    timely_index: 1,
                    dataflow_id: 42,
                    description_hash: Digest([1; 32]),
                },
                CreationLogEntry {
                    timely_index: 2,
                    dataflow_id: 43,
                    description_hash: Digest([2; 32]),
                },
            ]
        } else {
            Vec::new()
        },
        installed: vec![42, 43],
    };
    let error = |kind| {
        response(
            0,
            ResponseKind::Error(ErrorResponse {
                kind,
                message: "golden error".to_string(),
                seqno: 9,
            }),
        )
    };
    let c = command;
    vec![
        (
            "command/hello",
            c(0, Strategy::Barrier, CommandKind::Hello(hello)),
        ),
        (
            "command/hello-signed",
            c(0, Strategy::Broadcast, CommandKind::Hello(signed)),
        ),
        (
            "command/create-instance",
            c(
                1,
                Strategy::Broadcast,
                CommandKind::CreateInstance(settings.clone()),
            ),
        ),
        (
            "command/initialization-complete",
            c(2, Strategy::Log, CommandKind::InitializationComplete),
        ),
        (
            "command/update-configuration",
            c(
                3,
                Strategy::Naive,
                CommandKind::UpdateConfiguration(settings),
            ),
        ),
        (
            "command/create-dataflow",
            c(4, Strategy::Barrier, CommandKind::CreateDataflow(dataflow)),
        ),
        (
            "command/schedule",
            c(
                5,
                Strategy::Barrier,
                CommandKind::Schedule { dataflow_id: 42 },
            ),
        ),
        (
            "command/allow-compaction",
            c(
                6,
                Strategy::Log,
                CommandKind::AllowCompaction {
                    collection_id: 100,
                    frontier: Some(9),
                },
            ),
        ),
        (
            "command/allow-compaction-drop",
            c(
                7,
                Strategy::Log,
                CommandKind::AllowCompaction {
                    collection_id: 101,
                    frontier: None,
                },
            ),
        ),
        (
            "command/peek",
            c(
                8,
                Strategy::Broadcast,
                CommandKind::Peek(Peek {
                    peek_id: 77,
                    collection_id: 100,
                    timestamp: 6,
                }),
            ),
        ),
        (
            "command/cancel-peek",
            c(
                9,
                Strategy::Broadcast,
                CommandKind::CancelPeek { peek_id: 77 },
            ),
        ),
        (
            "command/subscribe",
            c(
                10,
                Strategy::Naive,
                CommandKind::Subscribe(Subscribe {
                    subscribe_id: 5,
                    collection_id: 100,
                    as_of: 5,
                }),
            ),
        ),
        (
            "command/cancel-subscribe",
            c(
                11,
                Strategy::Naive,
                CommandKind::CancelSubscribe { subscribe_id: 5 },
            ),
        ),
        (
            "command/write-input",
            c(
                12,
                Strategy::Log,
                CommandKind::WriteInput(WriteInput {
                    collection_id: 1,
                    updates: updates.clone(),
                    upper: 7,
                    more: false,
                    batch_digest: None,
                }),
            ),
        ),
        (
            "command/write-input-part",
            c(
                13,
                Strategy::Broadcast,
                CommandKind::WriteInput(WriteInput {
                    collection_id: 1,
                    updates: updates.clone(),
                    upper: 8,
                    more: true,
                    batch_digest: None,
                }),
            ),
        ),
        (
            "command/write-input-split",
            c(
                14,
                Strategy::Barrier,
                CommandKind::WriteInput(WriteInput {
                    collection_id: 2,
                    updates: updates.clone(),
                    upper: 9,
                    more: false,
                    batch_digest: Some([1, u64::MAX, 0, 1 << 63]),
                }),
            ),
        ),
        (
            "command/status-request-full",
            c(
                15,
                Strategy::Barrier,
                CommandKind::StatusRequest { full: true },
            ),
        ),
        (
            "command/status-request",
            c(
                16,
                Strategy::Barrier,
                CommandKind::StatusRequest { full: false },
            ),
        ),
        (
            "response/frontiers",
            response(
                1,
                ResponseKind::Frontiers(vec![(100, Some(8)), (101, None), (102, Some(0))]),
            ),
        ),
        (
            "response/peek-rows",
            response(
                1,
                ResponseKind::PeekResponse(PeekResponse {
                    peek_id: 77,
                    result: PeekResult::Rows(rows.clone()),
                }),
            ),
        ),
        (
            "response/peek-part",
            response(
                0,
                ResponseKind::PeekResponse(PeekResponse {
                    peek_id: 77,
                    result: PeekResult::Part(rows),
                }),
            ),
        ),
        (
            "response/peek-error",
            response(
                0,
                ResponseKind::PeekResponse(PeekResponse {
                    peek_id: 78,
                    result: PeekResult::Error("below since".to_string()),
                }),
            ),
        ),
        (
            "response/peek-canceled",
            response(
                0,
                ResponseKind::PeekResponse(PeekResponse {
                    peek_id: 79,
                    result: PeekResult::Canceled,
                }),
            ),
        ),
        (
            "response/subscribe",
            response(
                1,
                ResponseKind::SubscribeResponse(SubscribeBatch {
                    subscribe_id: 5,
                    lower: 5,
                    upper: Some(7),
                    updates: updates.clone(),
                }),
            ),
        ),
        (
            "response/subscribe-ended",
            response(
                1,
                ResponseKind::SubscribeResponse(SubscribeBatch {
                    subscribe_id: 5,
                    lower: 7,
                    upper: None,
                    updates: Vec::new(),
                }),
            ),
        ),
        (
            "response/status-full",
            response(1, ResponseKind::Status(status(true))),
        ),
        (
            "response/status",
            response(1, ResponseKind::Status(status(false))),
        ),
        (
            "response/error-version-mismatch",
            error(ErrorKind::VersionMismatch),
        ),
        ("response/error-stale-epoch", error(ErrorKind::StaleEpoch)),
        (
            "response/error-config-mismatch",
            error(ErrorKind::ConfigMismatch),
        ),
        ("response/error-malformed", error(ErrorKind::Malformed)),
        ("response/error-sequence", error(ErrorKind::Sequence)),
        (
            "response/error-invalid-command",
            error(ErrorKind::InvalidCommand),
        ),
        (
            "response/error-lockstep-lost",
            error(ErrorKind::LockstepLost),
        ),
        (
            "response/error-unauthenticated",
            error(ErrorKind::Unauthenticated),
        ),
    ]
}

/// Every golden encoding of v0.2.0 decodes with today's code into the value
/// the release encoded, and today's encoding of that value is the same bytes.
#[test]
fn v0_2_0_golden_encodings_decode_and_reencode() {
    let expected: BTreeMap<&str, Wire> = v0_2_0().into_iter().collect();
    let golden = read_encodings("v0.2.0");
    assert_eq!(
        golden.len(),
        expected.len(),
        "v0.2.0 has {} golden encodings and {} expected values",
        golden.len(),
        expected.len()
    );
    let mut failures = Vec::new();
    for (name, bytes) in &golden {
        let Some(want) = expected.get(name.as_str()) else {
            failures.push(format!(
                "{name}: a golden encoding without an expected value"
            ));
            continue;
        };
        match want.decode_like(bytes) {
            Err(e) => failures.push(format!("{name}: today's code refuses it: {e}")),
            Ok(got) if &got != want => failures.push(format!(
                "{name}: decodes to another value: {}",
                first_difference(want, &got)
            )),
            Ok(_) => {}
        }
        let ours = want.encode();
        if &ours != bytes {
            failures.push(format!(
                "{name}: today's encoding differs from v0.2.0's\n  v0.2.0: {}\n  today:  {}",
                hex(bytes),
                hex(&ours)
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Writes the golden files of the release named by `LOCKSTEP_GOLDEN_RELEASE`
/// from today's code; refuses to overwrite a release's existing files.
#[test]
#[ignore = "writes the golden files of a release; run once when cutting it"]
fn regenerate() {
    let release = std::env::var("LOCKSTEP_GOLDEN_RELEASE")
        .expect("set LOCKSTEP_GOLDEN_RELEASE to the release being cut, e.g. v0.2.0");
    let cases = match release.as_str() {
        "v0.2.0" => v0_2_0(),
        other => panic!("no golden values are defined for release {other}"),
    };
    let dir = common::golden_dir(&release);
    assert!(
        !dir.exists(),
        "{} exists: a release's golden files are never regenerated",
        dir.display()
    );
    std::fs::create_dir_all(&dir).expect("create the golden dir");
    let mut text = format!(
        "# Golden encodings of release {release} (protocol version {PROTOCOL_VERSION}), \
         generated by crates/protocol/tests/golden.rs: `<name> <prost encoding in hex>`.\n"
    );
    for (name, value) in &cases {
        text.push_str(&format!("{name} {}\n", hex(&value.encode())));
    }
    std::fs::write(dir.join("encodings.hex"), text).expect("write encodings.hex");
    std::fs::write(dir.join("descriptors.binpb"), todays_descriptors())
        .expect("write descriptors.binpb");
}

// ---------------------------------------------------------------------------
// Version negotiation across releases (protocol version 3 against v0.2.0).

/// The identity the golden Hellos were made for.
fn golden_identity() -> ProcessIdentity {
    ProcessIdentity {
        replica_id: 11,
        process_index: 1,
        process_count: 2,
        workers_per_process: 4,
    }
}

fn golden(release: &str, name: &str) -> Vec<u8> {
    read_encodings(release)
        .into_iter()
        .find(|(n, _)| n == name)
        .unwrap_or_else(|| panic!("no golden encoding {name} in {release}"))
        .1
}

/// A v0.2.0 controller's Hello (the golden bytes, signed and unsigned) is
/// accepted by today's replica-side check, at version 2.
#[test]
fn a_v0_2_0_hello_is_accepted_at_version_2() {
    let key = SessionKey::from_bytes([0x5a; 32]);
    for (name, key) in [
        ("command/hello", None),
        ("command/hello-signed", Some(&key)),
    ] {
        let bytes = golden("v0.2.0", name);
        let cmd = Command::try_from(proto::Command::decode(bytes.as_slice()).expect("decodes"))
            .expect("converts");
        let accepted = handshake::check_hello(&cmd, &golden_identity(), 0, key)
            .unwrap_or_else(|e| panic!("{name}: refused: {e}"));
        assert_eq!(accepted.protocol_version, 2, "{name}");
        assert_eq!(accepted.hello.version_range(), (2, 2), "{name}");
    }
}

/// The v0.2.0 rules for a Hello, written out from the v0.2.0 code (not
/// today's): decoded with the v0.2.0 descriptors, `protocol_version` must be
/// exactly 2, and the proof is the keyed BLAKE3 hash of the seven fields.
fn v0_2_0_accepts_hello(bytes: &[u8], key: &[u8; 32]) -> Result<(), String> {
    use protox::prost_reflect::{DescriptorPool, DynamicMessage, Value};
    let pool = DescriptorPool::decode(common::release_descriptor_bytes("v0.2.0").as_slice())
        .map_err(|e| e.to_string())?;
    let command = pool
        .get_message_by_name("lockstep.compute.v1.Command")
        .ok_or("no Command in v0.2.0")?;
    let msg = DynamicMessage::decode(command, bytes).map_err(|e| e.to_string())?;
    let unknown: Vec<u32> = msg.unknown_fields().map(|f| f.number()).collect();
    if !unknown.is_empty() {
        return Err(format!("unknown Command fields {unknown:?}"));
    }
    let hello = match msg.get_field_by_name("hello").as_deref() {
        Some(Value::Message(h)) => h.clone(),
        other => return Err(format!("not a Hello: {other:?}")),
    };
    let u32_of = |f: &str| match hello.get_field_by_name(f).as_deref() {
        Some(Value::U32(v)) => Ok(*v),
        other => Err(format!("{f}: {other:?}")),
    };
    let u64_of = |f: &str| match hello.get_field_by_name(f).as_deref() {
        Some(Value::U64(v)) => Ok(*v),
        other => Err(format!("{f}: {other:?}")),
    };
    let version = u32_of("protocol_version")?;
    if version != 2 {
        return Err(format!(
            "protocol version mismatch: this process speaks version 2, the controller version {version}"
        ));
    }
    let mut mac = blake3::Hasher::new_keyed(key);
    mac.update(&version.to_le_bytes());
    for f in ["epoch", "nonce", "replica_id"] {
        mac.update(&u64_of(f)?.to_le_bytes());
    }
    for f in ["process_index", "process_count", "workers_per_process"] {
        mac.update(&u32_of(f)?.to_le_bytes());
    }
    let proof = match hello.get_field_by_name("proof").as_deref() {
        Some(Value::Bytes(b)) => b.to_vec(),
        other => return Err(format!("proof: {other:?}")),
    };
    if proof != mac.finalize().as_bytes().to_vec() {
        return Err("the proof does not match under the v0.2.0 rule".to_string());
    }
    // What v0.2.0 does not know it skips: only max_protocol_version (9).
    let skipped: Vec<u32> = hello.unknown_fields().map(|f| f.number()).collect();
    if skipped != [9] {
        return Err(format!("unexpected unknown Hello fields {skipped:?}"));
    }
    Ok(())
}

/// Today's controller Hello offers versions 2 to 3 and is accepted under
/// the v0.2.0 rules (`protocol_version` exactly 2, the proof over seven
/// fields); today's replica-side check agrees on 3 for it.
#[test]
fn todays_hello_is_accepted_by_v0_2_0_rules() {
    let key = SessionKey::from_bytes([0x5a; 32]);
    let hello = key.sign(golden_identity().hello(7, 3));
    assert_eq!(hello.version_range(), (2, PROTOCOL_VERSION));
    let cmd = Command {
        seqno: 0,
        strategy: Strategy::Log,
        kind: CommandKind::Hello(hello),
    };
    let bytes = proto::Command::from(cmd.clone()).encode_to_vec();
    v0_2_0_accepts_hello(&bytes, key.bytes()).expect("v0.2.0 accepts today's Hello");
    let accepted =
        handshake::check_hello(&cmd, &golden_identity(), 0, Some(&key)).expect("accepted");
    assert_eq!(accepted.protocol_version, PROTOCOL_VERSION);
    // The rule the test applies can fail: a Hello that starts at 3.
    let mut late = golden_identity().hello(7, 3);
    late.protocol_version = 3;
    let late = Command {
        kind: CommandKind::Hello(key.sign(late)),
        ..cmd
    };
    let err =
        v0_2_0_accepts_hello(&proto::Command::from(late).encode_to_vec(), key.bytes()).unwrap_err();
    assert!(err.contains("controller version 3"), "{err}");
}

/// The fields added in version 3 survive the wire, and a HelloResponse is
/// what a v0.2.0 controller could not read (a Response whose kind it does
/// not know), which is why a process sends it only at version 3.
#[test]
fn version_3_fields_roundtrip() {
    let hello = Command {
        seqno: 0,
        strategy: Strategy::Barrier,
        kind: CommandKind::Hello(golden_identity().hello(1, 2)),
    };
    let wire = Wire::Command(hello);
    assert_eq!(wire.decode_like(&wire.encode()), Ok(wire.clone()));
    let answer = Wire::Response(Response {
        process_index: 1,
        kind: ResponseKind::HelloResponse(HelloResponse {
            protocol_version: 3,
            build_version: "0.3.0-dev".to_string(),
        }),
    });
    let bytes = answer.encode();
    assert_eq!(answer.decode_like(&bytes), Ok(answer.clone()));
    use protox::prost_reflect::{DescriptorPool, DynamicMessage};
    let pool = DescriptorPool::decode(common::release_descriptor_bytes("v0.2.0").as_slice())
        .expect("pool");
    let old = DynamicMessage::decode(
        pool.get_message_by_name("lockstep.compute.v1.Response")
            .expect("Response"),
        bytes.as_slice(),
    )
    .expect("decodes as a Response without a kind");
    assert!(!old.has_field_by_name("status") && !old.has_field_by_name("error"));
    let unknown: Vec<u32> = old.unknown_fields().map(|f| f.number()).collect();
    assert_eq!(unknown, [15]);
}
