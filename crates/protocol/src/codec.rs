//! Length-delimited framing of protocol messages.
//!
//! Every frame is a 4-byte big-endian length followed by that many bytes of one
//! prost-encoded message. [`FrameCodec`] plugs into `tokio_util::codec::Framed`;
//! a frame longer than the configured maximum, a frame that does not decode and
//! a message that breaks a protocol rule are each a distinct [`CodecError`].

use std::marker::PhantomData;

use bytes::{Buf, BufMut, BytesMut};
use prost::Message;
use tokio_util::codec::{Decoder, Encoder};

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

/// Encodes `Out` frames and decodes `In` frames.
#[derive(Debug)]
pub struct FrameCodec<Out, In> {
    max: usize,
    _marker: PhantomData<fn(Out) -> In>,
}

/// The codec a replica process uses: reads commands, writes responses.
pub type ReplicaCodec = FrameCodec<Response, Command>;
/// The codec a controller uses: writes commands, reads responses.
pub type ControllerCodec = FrameCodec<Command, Response>;

impl<Out, In> FrameCodec<Out, In> {
    /// A codec that refuses frames longer than `max_frame_len` bytes.
    pub fn new(max_frame_len: usize) -> Self {
        FrameCodec {
            max: max_frame_len,
            _marker: PhantomData,
        }
    }
}

impl<Out, In> FrameCodec<Out, In> {
    /// The longest frame it accepts.
    pub fn max_frame_len(&self) -> usize {
        self.max
    }

    /// Changes the longest frame it accepts (a process raises it from
    /// [`HELLO_MAX_FRAME_LEN`] once a Hello was accepted).
    pub fn set_max_frame_len(&mut self, max_frame_len: usize) {
        self.max = max_frame_len;
    }
}

impl<Out, In> Default for FrameCodec<Out, In> {
    fn default() -> Self {
        Self::new(DEFAULT_MAX_FRAME_LEN)
    }
}

impl<Out, In: WireMessage> Decoder for FrameCodec<Out, In> {
    type Item = In;
    type Error = CodecError;

    fn decode(&mut self, src: &mut BytesMut) -> Result<Option<In>, CodecError> {
        if src.len() < 4 {
            return Ok(None);
        }
        let len = (&src[..4]).get_u32() as usize;
        if len > self.max {
            return Err(CodecError::FrameTooLarge { len, max: self.max });
        }
        if src.len() < 4 + len {
            src.reserve(4 + len - src.len());
            return Ok(None);
        }
        src.advance(4);
        let frame = src.split_to(len);
        Ok(Some(In::decode_frame(frame.freeze())?))
    }

    fn decode_eof(&mut self, src: &mut BytesMut) -> Result<Option<In>, CodecError> {
        match self.decode(src)? {
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
}

impl<Out: WireMessage, In> Encoder<Out> for FrameCodec<Out, In> {
    type Error = CodecError;

    fn encode(&mut self, item: Out, dst: &mut BytesMut) -> Result<(), CodecError> {
        let wire = item.to_wire();
        let len = wire.encoded_len();
        if len > self.max {
            return Err(CodecError::FrameTooLarge { len, max: self.max });
        }
        dst.reserve(4 + len);
        dst.put_u32(len as u32);
        wire.encode(dst)
            .map_err(|e| CodecError::Io(std::io::Error::other(e)))?;
        Ok(())
    }
}
