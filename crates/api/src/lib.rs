//! The environment's gRPC API, `lockstep.environment.v1`
//! (`proto/lockstep/environment/v1/environment.proto`), as Rust: the
//! generated messages, the client and the server trait ([`proto`]), the
//! descriptor set served by reflection, and the API's size limits.
//!
//! A client depends on this crate alone (with `lockstep-protocol`, whose
//! types the API imports): `lockstep-environment` serves it, and the
//! `lockstep` command's client commands call it, without linking the
//! environment, wasmtime or kube.

/// The generated API (`tonic-prost-build`, from a descriptor set protox
/// compiled: no system `protoc`).
#[allow(missing_docs, clippy::all)]
pub mod proto {
    tonic::include_proto!("lockstep.environment.v1");

    /// The encoded descriptor set of the API and the compute protocol it
    /// imports, served by gRPC reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] =
        include_bytes!(concat!(env!("OUT_DIR"), "/environment_descriptor.bin"));
}

/// The largest policy component `SetPolicy` accepts, as
/// `environment.proto` documents.
pub const MAX_POLICY_BYTES: usize = 16 << 20;

/// The largest request the API accepts: a `SetPolicy` carrying the largest
/// policy ([`MAX_POLICY_BYTES`]) and its envelope. Derived from that one
/// limit, so the two cannot disagree; clients encode up to it.
pub const MAX_REQUEST_BYTES: usize = MAX_POLICY_BYTES + (64 << 10);

/// The largest answer the API sends, and a client accepts (a peek of many
/// rows; tonic's default of 4 MiB would refuse a large one in the client):
/// a larger peek answer is refused by the server with RESOURCE_EXHAUSTED,
/// naming the limit, not cut off in the client with OUT_OF_RANGE (which the
/// API uses for reads below a since).
pub const MAX_ANSWER_BYTES: usize = 256 << 20;

/// The file name of the API's Unix socket inside the state directory, for
/// the environment whose API listens on TCP `port`: `lockstep serve`
/// listens on it beside its TCP address, and a client given that address
/// and the state directory talks to it, so that it knows whom it sends the
/// token to (only the directory's owner can have made it; the client
/// checks the peer's uid too). Named by the port, so that two
/// environments of one state directory (an older one about to be fenced)
/// each keep theirs.
pub fn local_socket_file(port: u16) -> String {
    format!("api-{port}.sock")
}

/// The minimum length of an API token.
pub const MIN_TOKEN_LEN: usize = 16;
