//! The lockstep compute protocol.
//!
//! A controller drives a multi-process timely replica by sending the same
//! stream of [`Command`]s to every process itself (the protocol is symmetric:
//! no process forwards commands to another). This crate is the one place that
//! knows the wire format:
//!
//! - [`proto`]: the prost types generated from `proto/lockstep/compute/v1`,
//!   used only at the edges;
//! - [`types`]: the plain Rust types used everywhere else, with fallible
//!   conversions from the wire types in [`convert`] (a malformed message is an
//!   error, never a panic);
//! - [`codec`]: length-delimited framing with a maximum frame size (plain
//!   functions: the sockets, tokio framing and the Noise session are the
//!   `lockstep-transport` crate's, so what only needs the types links no
//!   tokio and no snow);
//! - [`handshake`]: the checks a process makes on `Hello`;
//! - [`history`]: the compacted command history and its stable hash, which
//!   rehydration and the history check are built on;
//! - [`validate`]: the checks a replica makes on a dataflow's envelope before
//!   building it, shared with the environment, which refuses exactly what a
//!   replica would.
//!
//! The protocol carries dataflows it does not understand: an export's
//! description is the dataflow family's own bytes (the built-in family, the
//! plan language, is the `lockstep-plan` crate).
//! - [`endpoint`]: the `host:port` addresses processes are reached at.

pub mod codec;
pub mod convert;
pub mod endpoint;
pub mod handshake;
pub mod history;
pub mod merge;
pub mod types;
pub mod validate;

pub use codec::{
    command_encoded_len, decode_frame, decode_frame_eof, encode_frame, encode_whole_write,
    encode_wire_frame, CodecError, WireMessage, DEFAULT_MAX_FRAME_LEN, HELLO_MAX_FRAME_LEN,
};
pub use convert::ConvertError;
pub use endpoint::{Endpoint, EndpointError};
pub use handshake::{
    negotiate, HandshakeError, ProcessIdentity, SessionKey, REPLICA_CONFIG_ENV, SESSION_KEY_ENV,
};
pub use history::CommandHistory;
pub use types::*;

/// The newest protocol version this build speaks. Version 3 added the
/// version range in `Hello` and the `HelloResponse`
/// (docs/compatibility.md).
pub const PROTOCOL_VERSION: u32 = 3;

/// The oldest protocol version this build speaks: an environment of release
/// N drives the replicas of release N-1 and N, and a replica of release N
/// accepts the controllers of both. A controller sends it as `Hello`'s
/// `protocol_version`, since a version-2 process accepts exactly 2 there.
pub const MIN_PROTOCOL_VERSION: u32 = 2;

/// The generated wire types. Use [`types`] inside the code; these only at the edges.
#[allow(missing_docs, clippy::all)]
pub mod proto {
    include!(concat!(env!("OUT_DIR"), "/lockstep.compute.v1.rs"));
}
