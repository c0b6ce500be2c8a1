//! The compute protocol on a socket.
//!
//! `lockstep-protocol` knows the messages and their frames and does no I/O;
//! this crate is what a controller and a replica process put on a TCP
//! connection:
//!
//! - [`FrameCodec`] (and its two directions, [`ReplicaCodec`] and
//!   [`ControllerCodec`]): the protocol's length-delimited frames as a
//!   `tokio_util` codec, for `Framed`;
//! - [`secure`]: the Noise session (from the `snow` crate) every
//!   controller connection runs in, and [`SecureCodec`], which encrypts and
//!   authenticates each frame under it.
//!
//! Architecture invariant: what needs only the protocol's types (the
//! reconciliation machines, the model, the policies, the plan family, the
//! API client) depends on `lockstep-protocol` and never on this crate, so it
//! links neither tokio nor snow.

pub mod frame;
pub mod secure;

pub use frame::{ControllerCodec, FrameCodec, ReplicaCodec};
pub use secure::{SecureCodec, SecureError, Session};
