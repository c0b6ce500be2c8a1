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

    /// Appends itself to `dst` as one frame ([`encode_frame`]); by default
    /// through its wire form.
    fn encode_frame_into(self, max: usize, dst: &mut BytesMut) -> Result<(), CodecError> {
        encode_wire_frame(&self.to_wire(), max, dst)
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
    /// A write is encoded from its rows where they are (the same bytes as
    /// its wire form's): moving 10,000 rows into a wire form first cost
    /// more than encoding them.
    fn encode_frame_into(self, max: usize, dst: &mut BytesMut) -> Result<(), CodecError> {
        match &self.kind {
            crate::CommandKind::WriteInput(w) => {
                encode_write_frame(self.seqno, self.strategy, w, max, dst)
            }
            _ => encode_wire_frame(&self.to_wire(), max, dst),
        }
    }
}

/// A write command's wire form without its updates, measured with them:
/// the command's own fields (`head`, its kind taken out), the write's
/// (`tail`), the length of the write's encoding with its updates (`inner`)
/// and of the whole command's (`len`). The one place both
/// [`command_encoded_len`] and a write's frame measure a write.
struct WriteFrame {
    head: proto::Command,
    tail: proto::WriteInput,
    inner: usize,
    len: usize,
}

impl WriteFrame {
    fn of(seqno: u64, strategy: crate::Strategy, w: &crate::WriteInput) -> WriteFrame {
        let bare = crate::WriteInput {
            collection_id: w.collection_id,
            updates: Vec::new(),
            upper: w.upper,
            more: w.more,
            batch_digest: w.batch_digest,
        };
        let mut head = proto::Command::from(Command {
            seqno,
            strategy,
            kind: crate::CommandKind::WriteInput(bare),
        });
        let Some(proto::command::Kind::WriteInput(tail)) = head.kind.take() else {
            unreachable!("a write's wire form is a write");
        };
        let updates: usize = w.updates.iter().map(update_encoded_len).sum();
        let inner = tail.encoded_len() + updates;
        // The write is field 20 of the command: a two-byte key.
        let len =
            head.encoded_len() + 2 + prost::encoding::encoded_len_varint(inner as u64) + inner;
        WriteFrame {
            head,
            tail,
            inner,
            len,
        }
    }
}

/// Appends the write command `seqno`, `strategy`, `w` to `dst` as one frame,
/// written from references: the bytes of its wire form's frame.
fn encode_write_frame(
    seqno: u64,
    strategy: crate::Strategy,
    w: &crate::WriteInput,
    max: usize,
    dst: &mut BytesMut,
) -> Result<(), CodecError> {
    use prost::encoding::{encode_key, encode_varint, WireType};
    let WriteFrame {
        head,
        mut tail,
        inner,
        len,
    } = WriteFrame::of(seqno, strategy, w);
    if len > max {
        return Err(CodecError::FrameTooLarge { len, max });
    }
    dst.reserve(4 + len);
    dst.put_u32(len as u32);
    // seqno and strategy; then the write (field 20): its collection, its
    // updates, then its other fields, in field order as prost writes them.
    head.encode_raw(dst);
    encode_key(20, WireType::LengthDelimited, dst);
    encode_varint(inner as u64, dst);
    if tail.collection_id != 0 {
        prost::encoding::uint64::encode(1, &tail.collection_id, dst);
    }
    encode_updates(&w.updates, dst);
    tail.collection_id = 0;
    tail.encode_raw(dst);
    Ok(())
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
    let crate::CommandKind::WriteInput(w) = kind else {
        let cmd = Command {
            seqno,
            strategy,
            kind: kind.clone(),
        };
        return cmd.encoded_len();
    };
    WriteFrame::of(seqno, strategy, w).len
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
    let body: usize = updates.iter().map(update_encoded_len).sum();
    let mut buf = Vec::with_capacity(body + 24);
    if collection_id != 0 {
        prost::encoding::uint64::encode(1, &collection_id, &mut buf);
    }
    encode_updates(updates, &mut buf);
    if upper != 0 {
        prost::encoding::uint64::encode(3, &upper, &mut buf);
    }
    buf
}

/// Appends `updates` as `repeated Update updates = 2` to `buf`, as prost
/// encodes them: sized once, then written byte by byte into the slice (a
/// `BufMut` call per field cost more than the field).
fn encode_updates(updates: &[crate::Update], buf: &mut impl Grow) {
    // Keys: field 2 length-delimited; fields 1 (bytes), 2 and 3 (varints).
    const UPDATE: u8 = (2 << 3) | 2;
    const ROW: u8 = (1 << 3) | 2;
    const TIME: u8 = 2 << 3;
    const DIFF: u8 = 3 << 3;
    let total: usize = updates.iter().map(update_encoded_len).sum();
    let out = buf.grow(total);
    let mut at = 0;
    for u in updates {
        out[at] = UPDATE;
        at += 1;
        put_varint(out, &mut at, update_body_len(u) as u64);
        if !u.row.is_empty() {
            out[at] = ROW;
            at += 1;
            put_varint(out, &mut at, u.row.len() as u64);
            out[at..at + u.row.len()].copy_from_slice(&u.row);
            at += u.row.len();
        }
        if u.time != 0 {
            out[at] = TIME;
            at += 1;
            put_varint(out, &mut at, u.time);
        }
        if u.diff != 0 {
            out[at] = DIFF;
            at += 1;
            put_varint(out, &mut at, u.diff as u64);
        }
    }
    debug_assert_eq!(at, total);
}

/// A byte buffer that grows by zeroed bytes to be written in place.
trait Grow {
    /// Appends `n` zero bytes; returns them.
    fn grow(&mut self, n: usize) -> &mut [u8];
}

impl Grow for Vec<u8> {
    fn grow(&mut self, n: usize) -> &mut [u8] {
        let start = self.len();
        self.resize(start + n, 0);
        &mut self[start..]
    }
}

impl Grow for BytesMut {
    fn grow(&mut self, n: usize) -> &mut [u8] {
        let start = self.len();
        self.resize(start + n, 0);
        &mut self[start..]
    }
}

/// Writes `v` as a varint at `out[*at..]`, advancing `*at`.
#[inline]
fn put_varint(out: &mut [u8], at: &mut usize, mut v: u64) {
    while v >= 0x80 {
        out[*at] = (v as u8) | 0x80;
        v >>= 7;
        *at += 1;
    }
    out[*at] = v as u8;
    *at += 1;
}

/// Appends `item` to `dst` as one frame: a 4-byte big-endian length, then
/// its protobuf encoding. A frame longer than `max` bytes is refused before
/// anything is written.
pub fn encode_frame<M: WireMessage>(
    item: M,
    max: usize,
    dst: &mut BytesMut,
) -> Result<(), CodecError> {
    item.encode_frame_into(max, dst)
}

/// [`encode_frame`] of a wire form.
pub fn encode_wire_frame<W: Message>(
    wire: &W,
    max: usize,
    dst: &mut BytesMut,
) -> Result<(), CodecError> {
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
                let encoded = cmd.clone().encode_to_vec().len();
                assert_eq!(
                    command_encoded_len(seqno, strategy, &kind),
                    encoded,
                    "{}",
                    kind.name()
                );
                // A frame written from references is the wire form's frame,
                // and refused at the same length.
                let mut by_ref = BytesMut::new();
                encode_frame(cmd.clone(), usize::MAX, &mut by_ref).unwrap();
                let mut wire = BytesMut::new();
                encode_wire_frame(&cmd.clone().to_wire(), usize::MAX, &mut wire).unwrap();
                assert_eq!(by_ref, wire, "{}", kind.name());
                assert_eq!(by_ref.len(), 4 + encoded);
                let mut refused = BytesMut::new();
                assert!(matches!(
                    encode_frame(cmd.clone(), encoded - 1, &mut refused),
                    Err(CodecError::FrameTooLarge { len, .. }) if len == encoded
                ));
                assert!(refused.is_empty());
                encode_frame(cmd, encoded, &mut refused).unwrap();
            }
        }
    }
}
