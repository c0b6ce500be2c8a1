//! Truncated, oversized, garbage and unknown-variant frames give errors, not panics.

use bytes::{BufMut, BytesMut};
use lockstep_protocol::*;
use prost::Message;

/// Command frames at a maximum length: what a controller writes and a
/// process reads (`encode_frame`, `decode_frame`).
struct Frames(usize);

impl Frames {
    fn default() -> Self {
        Frames(DEFAULT_MAX_FRAME_LEN)
    }
    fn new(max: usize) -> Self {
        Frames(max)
    }
    fn encode(&mut self, cmd: Command, dst: &mut BytesMut) -> Result<(), CodecError> {
        encode_frame(cmd, self.0, dst)
    }
    fn decode(&mut self, src: &mut BytesMut) -> Result<Option<Command>, CodecError> {
        decode_frame(src, self.0)
    }
    fn decode_eof(&mut self, src: &mut BytesMut) -> Result<Option<Command>, CodecError> {
        decode_frame_eof(src, self.0)
    }
}

fn frame(body: &[u8]) -> BytesMut {
    let mut buf = BytesMut::new();
    buf.put_u32(body.len() as u32);
    buf.put_slice(body);
    buf
}

fn init_complete() -> Command {
    Command {
        seqno: 1,
        strategy: lockstep_protocol::Strategy::Naive,
        kind: CommandKind::InitializationComplete,
    }
}

#[test]
fn truncated_frame_waits_then_fails_at_eof() {
    let mut full = BytesMut::new();
    Frames::default()
        .encode(init_complete(), &mut full)
        .unwrap();
    let mut cut = BytesMut::from(&full[..full.len() - 1]);
    let mut dec = Frames::default();
    assert!(
        dec.decode(&mut cut).unwrap().is_none(),
        "a partial frame waits"
    );
    let err = dec.decode_eof(&mut cut).unwrap_err();
    assert!(err.to_string().contains("closed inside a frame"), "{err}");
}

#[test]
fn oversized_frame_is_refused_before_reading_it() {
    let mut dec = Frames::new(100);
    let mut buf = BytesMut::new();
    buf.put_u32(1_000_000);
    let err = dec.decode(&mut buf).unwrap_err();
    assert!(
        matches!(
            err,
            CodecError::FrameTooLarge {
                len: 1_000_000,
                max: 100
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("exceeds the maximum"));
}

#[test]
fn oversized_message_is_not_sent() {
    let mut enc = Frames::new(16);
    let big = Command {
        seqno: 1,
        strategy: lockstep_protocol::Strategy::Log,
        kind: CommandKind::WriteInput(WriteInput {
            collection_id: 1,
            updates: vec![Update {
                row: vec![1; 100],
                time: 0,
                diff: 1,
            }],
            upper: 1,
            more: false,
            batch_digest: None,
        }),
    };
    let mut buf = BytesMut::new();
    assert!(matches!(
        enc.encode(big, &mut buf),
        Err(CodecError::FrameTooLarge { .. })
    ));
    assert!(buf.is_empty(), "nothing partial was written");
}

#[test]
fn garbage_body_is_a_decode_error() {
    let mut dec = Frames::default();
    let mut buf = frame(&[0xff, 0xff, 0xff, 0xff, 0xff]);
    assert!(matches!(dec.decode(&mut buf), Err(CodecError::Decode(_))));
}

#[test]
fn empty_command_is_missing_its_kind() {
    let mut dec = Frames::default();
    let mut buf = frame(&[]);
    let err = dec.decode(&mut buf).unwrap_err();
    assert!(err.to_string().contains("missing field `kind`"), "{err}");
}

#[test]
fn unknown_command_variant_is_an_error() {
    // Field 99 is not a variant of this version's oneof: prost skips it, so the
    // command has no kind and is refused.
    let mut body = Vec::new();
    prost::encoding::uint64::encode(1, &5, &mut body);
    prost::encoding::int32::encode(2, &2, &mut body);
    prost::encoding::string::encode(99, &"from the future".to_string(), &mut body);
    let err = Frames::default().decode(&mut frame(&body)).unwrap_err();
    assert!(matches!(
        err,
        CodecError::Invalid(ConvertError::Missing { field: "kind", .. })
    ));
}

#[test]
fn unknown_strategy_is_an_error() {
    let mut wire = proto::Command::from(init_complete());
    wire.strategy = 42;
    let err = Frames::default()
        .decode(&mut frame(&wire.encode_to_vec()))
        .unwrap_err();
    assert!(err.to_string().contains("unknown value 42"), "{err}");
    wire.strategy = 0;
    assert!(
        Frames::default()
            .decode(&mut frame(&wire.encode_to_vec()))
            .is_err(),
        "UNSPECIFIED is refused"
    );
}

#[test]
fn multi_element_frontier_is_an_error() {
    let wire = proto::Command {
        seqno: 1,
        strategy: proto::Strategy::Barrier as i32,
        kind: Some(proto::command::Kind::AllowCompaction(
            proto::AllowCompaction {
                collection_id: 1,
                frontier: vec![1, 2],
            },
        )),
    };
    let err = Command::try_from(wire).unwrap_err();
    assert!(matches!(err, ConvertError::Frontier { len: 2, .. }));
}

#[test]
fn short_digest_is_an_error() {
    let wire = proto::Response {
        process_index: 0,
        kind: Some(proto::response::Kind::Status(proto::Status {
            history_hash: vec![1, 2, 3],
            ..Default::default()
        })),
    };
    assert!(matches!(
        Response::try_from(wire),
        Err(ConvertError::Digest { len: 3, .. })
    ));
}

#[test]
fn a_split_write_digest_of_the_wrong_length_names_its_field() {
    let wire = proto::Command {
        seqno: 1,
        strategy: proto::Strategy::Barrier as i32,
        kind: Some(proto::command::Kind::WriteInput(proto::WriteInput {
            collection_id: 1,
            upper: 1,
            batch_digest: vec![1, 2, 3],
            ..Default::default()
        })),
    };
    let err = Command::try_from(wire).unwrap_err();
    assert_eq!(
        err,
        ConvertError::DigestLanes {
            field: "WriteInput.batch_digest",
            len: 3
        }
    );
    assert!(err.to_string().contains("WriteInput.batch_digest"), "{err}");
}
