//! Length-delimited framing of protocol messages.
//!
//! Every frame is a 4-byte big-endian length followed by that many bytes of one
//! prost-encoded message ([`encode_frame`], [`decode_frame`]); no I/O here (the
//! `lockstep-transport` crate puts these frames on a socket). A frame longer
//! than the maximum, a frame that does not decode and a message that breaks a
//! protocol rule are each a distinct [`CodecError`].

use bytes::{Buf, BufMut, BytesMut};
use prost::Message;

use crate::convert::ConvertError;
use crate::proto;
use crate::types::{Command, Response};

/// The default maximum frame length: 64 MiB.
pub const DEFAULT_MAX_FRAME_LEN: usize = 64 << 20;

/// The longest first frame a process reads from a new connection, before a
/// Hello was accepted on it (a Hello is well under 1 KiB). Nothing sent
/// before the handshake can make a process buffer or decode more than this.
pub const HELLO_MAX_FRAME_LEN: usize = 64 << 10;

/// Why a frame could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum CodecError {
    /// The transport failed.
    #[error("i/o error: {0}")]
    Io(#[from] std::io::Error),
    /// The frame is longer than the maximum.
    #[error("frame of {len} bytes exceeds the maximum of {max} bytes")]
    FrameTooLarge {
        /// The frame's length.
        len: usize,
        /// The configured maximum.
        max: usize,
    },
    /// The bytes are not a valid protobuf message.
    #[error("frame does not decode: {0}")]
    Decode(#[from] prost::DecodeError),
    /// The message decodes but breaks a protocol rule.
    #[error("{0}")]
    Invalid(#[from] ConvertError),
}

/// A plain protocol type with a wire form.
pub trait WireMessage: Sized {
    /// The prost type.
    type Wire: Message + Default;
    /// Converts to the wire form.
    fn to_wire(self) -> Self::Wire;
    /// Converts from the wire form, checking the protocol's rules.
    fn from_wire(wire: Self::Wire) -> Result<Self, ConvertError>;

    /// Encodes to protobuf bytes (no length prefix).
    fn encode_to_vec(self) -> Vec<u8> {
        self.to_wire().encode_to_vec()
    }

    /// The length of its protobuf encoding (no length prefix), without
    /// encoding it.
    fn encoded_len(self) -> usize {
        self.to_wire().encoded_len()
    }

    /// Decodes from protobuf bytes (no length prefix).
    fn decode_from(bytes: &[u8]) -> Result<Self, CodecError> {
        Ok(Self::from_wire(Self::Wire::decode(bytes)?)?)
    }

    /// Decodes from a frame's protobuf bytes (no length prefix). Its
    /// `bytes` fields are decoded as slices of `frame`, so a row costs one
    /// copy (into its [`crate::Row`]), not two.
    fn decode_frame(frame: bytes::Bytes) -> Result<Self, CodecError> {
        Ok(Self::from_wire(Self::Wire::decode(frame)?)?)
    }
}

impl WireMessage for Command {
    type Wire = proto::Command;
    fn to_wire(self) -> proto::Command {
        self.into()
    }
    fn from_wire(wire: proto::Command) -> Result<Self, ConvertError> {
        wire.try_into()
    }
}

impl WireMessage for Response {
    type Wire = proto::Response;
    fn to_wire(self) -> proto::Response {
        self.into()
    }
    fn from_wire(wire: proto::Response) -> Result<Self, ConvertError> {
        wire.try_into()
    }
}

/// The length of the protobuf encoding (no length prefix) of the command
/// `Command { seqno, strategy, kind }`, computed from a reference: a
/// write's updates are measured where they are, not copied (the distribution
/// policy is told every write's size, and a 10,000-row write's copy cost
/// more than its encoding). Equal to [`WireMessage::encoded_len`] of that
/// command.
pub fn command_encoded_len(
    seqno: u64,
    strategy: crate::Strategy,
    kind: &crate::CommandKind,
) -> usize {
    use prost::encoding::encoded_len_varint;
    let crate::CommandKind::WriteInput(w) = kind else {
        let cmd = Command {
            seqno,
            strategy,
            kind: kind.clone(),
        };
        return cmd.encoded_len();
    };
    // The write without its updates, encoded as it would be ...
    let bare = crate::WriteInput {
        collection_id: w.collection_id,
        updates: Vec::new(),
        upper: w.upper,
        more: w.more,
        batch_digest: w.batch_digest,
    };
    let bare_inner = proto::WriteInput::from(bare.clone()).encoded_len();
    let bare_total = Command {
        seqno,
        strategy,
        kind: crate::CommandKind::WriteInput(bare),
    }
    .encoded_len();
    // ... then each update as prost encodes it ...
    let updates: usize = w.updates.iter().map(update_encoded_len).sum();
    // ... and the write's own length prefix grown with them.
    let inner = bare_inner + updates;
    bare_total - encoded_len_varint(bare_inner as u64) + encoded_len_varint(inner as u64) + updates
}

/// The length of one update's protobuf encoding as an element of
/// `repeated Update updates = 2` (its one-byte key and length included; a
/// proto3 scalar at its default is not written).
fn update_encoded_len(u: &crate::Update) -> usize {
    use prost::encoding::encoded_len_varint;
    let len = update_body_len(u);
    1 + encoded_len_varint(len as u64) + len
}

/// The length of one update's own fields, encoded.
fn update_body_len(u: &crate::Update) -> usize {
    use prost::encoding::encoded_len_varint;
    let row = if u.row.is_empty() {
        0
    } else {
        1 + encoded_len_varint(u.row.len() as u64) + u.row.len()
    };
    let time = if u.time == 0 {
        0
    } else {
        1 + encoded_len_varint(u.time)
    };
    let diff = if u.diff == 0 {
        0
    } else {
        1 + encoded_len_varint(u.diff as u64)
    };
    row + time + diff
}

/// The protobuf encoding of the write `collection_id`, `updates`, `upper`
/// (not continued, no batch digest: a whole write, as the environment
/// stores it), written from references: the same bytes as the write's wire
/// form's `encode_to_vec`, without copying its rows into it first.
pub fn encode_whole_write(collection_id: u64, updates: &[crate::Update], upper: u64) -> Vec<u8> {
    use prost::encoding::{encode_key, encode_varint, WireType};
    let body: usize = updates.iter().map(update_encoded_len).sum();
    let mut buf = Vec::with_capacity(body + 24);
    if collection_id != 0 {
        prost::encoding::uint64::encode(1, &collection_id, &mut buf);
    }
    for u in updates {
        encode_key(2, WireType::LengthDelimited, &mut buf);
        encode_varint(update_body_len(u) as u64, &mut buf);
        if !u.row.is_empty() {
            prost::encoding::bytes::encode(1, &u.row, &mut buf);
        }
        if u.time != 0 {
            prost::encoding::uint64::encode(2, &u.time, &mut buf);
        }
        if u.diff != 0 {
            prost::encoding::int64::encode(3, &u.diff, &mut buf);
        }
    }
    if upper != 0 {
        prost::encoding::uint64::encode(3, &upper, &mut buf);
    }
    buf
}

/// Appends `item` to `dst` as one frame: a 4-byte big-endian length, then
/// its protobuf encoding. A frame longer than `max` bytes is refused before
/// anything is written.
pub fn encode_frame<M: WireMessage>(
    item: M,
    max: usize,
    dst: &mut BytesMut,
) -> Result<(), CodecError> {
    let wire = item.to_wire();
    let len = wire.encoded_len();
    if len > max {
        return Err(CodecError::FrameTooLarge { len, max });
    }
    dst.reserve(4 + len);
    dst.put_u32(len as u32);
    wire.encode(dst)
        .map_err(|e| CodecError::Io(std::io::Error::other(e)))?;
    Ok(())
}

/// Takes one whole frame off the front of `src` and decodes it; `None`
/// while the frame is incomplete (room for the rest is reserved). A length
/// over `max` is refused before its bytes are awaited.
pub fn decode_frame<M: WireMessage>(
    src: &mut BytesMut,
    max: usize,
) -> Result<Option<M>, CodecError> {
    if src.len() < 4 {
        return Ok(None);
    }
    let len = (&src[..4]).get_u32() as usize;
    if len > max {
        return Err(CodecError::FrameTooLarge { len, max });
    }
    if src.len() < 4 + len {
        src.reserve(4 + len - src.len());
        return Ok(None);
    }
    src.advance(4);
    let frame = src.split_to(len);
    Ok(Some(M::decode_frame(frame.freeze())?))
}

/// [`decode_frame`] at the end of the stream: bytes left that do not form
/// a whole frame are an error (the connection closed inside a frame).
pub fn decode_frame_eof<M: WireMessage>(
    src: &mut BytesMut,
    max: usize,
) -> Result<Option<M>, CodecError> {
    match decode_frame(src, max)? {
        Some(frame) => Ok(Some(frame)),
        None if src.is_empty() => Ok(None),
        None => Err(CodecError::Io(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            format!(
                "connection closed inside a frame ({} bytes left)",
                src.len()
            ),
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{CommandKind, Strategy, Update, WriteInput};

    fn write(rows: usize, row_len: usize, time: u64, diff: i64, digest: bool) -> CommandKind {
        CommandKind::WriteInput(WriteInput {
            collection_id: 7,
            updates: (0..rows)
                .map(|i| Update {
                    row: vec![(i % 200) as u8; row_len + i % 3],
                    time: time + (i % 2) as u64,
                    diff: if i % 5 == 0 { -diff } else { diff },
                })
                .collect(),
            upper: time + 2,
            more: rows % 2 == 1,
            batch_digest: digest.then_some([1, u64::MAX, 3, 4]),
        })
    }

    /// Written from references, a whole write's encoding is the bytes of
    /// its wire form's.
    #[test]
    fn encode_whole_write_is_the_wire_forms_encoding() {
        for kind in [
            write(0, 0, 0, 0, false),
            write(1, 0, 0, 1, false),
            write(5, 2, 1 << 40, -3, false),
            write(130, 1, 9, 1, false),
            write(300, 200, u64::MAX - 3, i64::MIN + 1, false),
        ] {
            let CommandKind::WriteInput(w) = kind else {
                unreachable!()
            };
            for (collection_id, upper) in [(0, 0), (w.collection_id, w.upper)] {
                let whole = WriteInput {
                    collection_id,
                    upper,
                    more: false,
                    batch_digest: None,
                    ..w.clone()
                };
                assert_eq!(
                    encode_whole_write(collection_id, &whole.updates, upper),
                    proto::WriteInput::from(whole.clone()).encode_to_vec()
                );
            }
        }
    }

    /// Measured from a reference, a command's length is its encoding's,
    /// for writes of every size (the write's length prefix growing past one
    /// and two bytes), defaults that are not written, negative diffs (ten
    /// bytes), and for every other command.
    #[test]
    fn command_encoded_len_is_the_encodings() {
        let kinds = [
            write(0, 0, 0, 0, false),
            write(1, 0, 0, 1, false),
            write(1, 3, 0, 0, true),
            write(5, 2, 1 << 40, -3, true),
            write(130, 1, 9, 1, false),
            write(10_000, 2, 1_000, 1, true),
            write(300, 200, u64::MAX - 3, i64::MIN + 1, false),
            CommandKind::StatusRequest { full: true },
            CommandKind::AllowCompaction {
                collection_id: 3,
                frontier: Some(9),
            },
        ];
        for kind in kinds {
            for (seqno, strategy) in [(0, Strategy::Naive), (u64::MAX, Strategy::Log)] {
                let cmd = Command {
                    seqno,
                    strategy,
                    kind: kind.clone(),
                };
                let encoded = cmd.encode_to_vec().len();
                assert_eq!(
                    command_encoded_len(seqno, strategy, &kind),
                    encoded,
                    "{}",
                    kind.name()
                );
            }
        }
    }
}
