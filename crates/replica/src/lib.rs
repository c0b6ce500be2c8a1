//! One process of a lockstep replica.
//!
//! A replica is `process_count` OS processes whose timely workers form one
//! cluster. Each process:
//!
//! - forms the timely cluster itself over TCP ([`cluster`]), in milliseconds
//!   rather than timely's one-second retry steps;
//! - accepts controller connections ([`server`]): every process receives every
//!   command itself, Hello included; there is no command-forwarding dataflow;
//! - hands each command to each of its workers ([`worker`]), which render
//!   dataflows with their [`family`] (the built-in one renders the plan
//!   language with differential, [`render`]), keep inputs,
//!   answer peeks and subscribes, and keep the dataflow-creation log that
//!   invariant I1 is checked against; which copy of a command a worker
//!   applies, and what it waits for, is the command's strategy ([`order`]);
//! - merges its workers' responses into one response per process
//!   ([`aggregate`]): frontiers as the meet, peeks once every local worker
//!   answered, subscribe batches by time;
//! - serves its Prometheus metrics on its controller port ([`metrics`]).

pub mod aggregate;
pub mod cluster;
pub mod family;
pub mod metrics;
pub mod order;
pub mod process;
pub mod render;
pub mod server;
pub mod worker;

pub use process::Builder;
pub use server::{run, ReplicaConfig};
