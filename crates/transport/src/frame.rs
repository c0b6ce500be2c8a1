//! The protocol's frames as a `tokio_util` codec.
//!
//! The framing itself (a 4-byte big-endian length, then one prost-encoded
//! message; the maximum checked before the body is awaited) is
//! `lockstep_protocol::codec`'s; this only plugs it into
//! `tokio_util::codec::Framed`.

use std::marker::PhantomData;

use bytes::BytesMut;
use lockstep_protocol::{
    decode_frame, decode_frame_eof, encode_frame, CodecError, Command, Response, WireMessage,
    DEFAULT_MAX_FRAME_LEN,
};
use tokio_util::codec::{Decoder, Encoder};

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

    /// The longest frame it accepts.
    pub fn max_frame_len(&self) -> usize {
        self.max
    }

    /// Changes the longest frame it accepts (a process raises it from
    /// `HELLO_MAX_FRAME_LEN` once a Hello was accepted).
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
        decode_frame(src, self.max)
    }

    fn decode_eof(&mut self, src: &mut BytesMut) -> Result<Option<In>, CodecError> {
        decode_frame_eof(src, self.max)
    }
}

impl<Out: WireMessage, In> Encoder<Out> for FrameCodec<Out, In> {
    type Error = CodecError;

    fn encode(&mut self, item: Out, dst: &mut BytesMut) -> Result<(), CodecError> {
        encode_frame(item, self.max, dst)
    }
}
