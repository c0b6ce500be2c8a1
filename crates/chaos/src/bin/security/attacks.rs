//! The attacks of issue 27: an impostor on a freed controller port, frames
//! injected into a proven session, unproven connections that crowd the real
//! controller out, slow handshakes, log floods, secrets at rest and in child
//! processes, and a replica process that lies (worker indices, endless peek
//! parts). `no-mutual` (the old one-way proof) must be caught by the first
//! two, `open` by those and the ones that need a key.
//!
//! By what they attack: [`session`] (the path between the controller and a
//! process), [`replica`] (a process's controller port), [`lying_process`]
//! (the controller, by a process that holds the key) and [`environment`]
//! (`lockstep serve`).

#[path = "attacks/environment.rs"]
mod environment;
#[path = "attacks/lying_process.rs"]
mod lying_process;
#[path = "attacks/replica.rs"]
mod replica;
#[path = "attacks/session.rs"]
mod session;

pub(super) use environment::{
    api_connection_exhaustion, keys_at_rest_and_in_children, metrics_without_token,
    state_dir_open_to_others,
};
pub(super) use lying_process::{lying_worker_index, parts_flood};
pub(super) use replica::{
    keyless_peer_gets_nothing, log_flood, slow_handshake, unproven_flood_during_reconnect,
};
pub(super) use session::{impostor_on_freed_port, injected_frame};
