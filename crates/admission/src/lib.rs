//! The resource budget of a lockstep process and the admission of its
//! connections: invariant R1 (`docs/invariants.md`), one model for every
//! listener of both binaries (the environment's API and metrics endpoints,
//! a replica process's controller port and its timely mesh).
//!
//! - [`Budget`]: at start a process raises its soft descriptor limit to the
//!   hard one and splits it: a stated reserve for its own work (stores,
//!   command logs, process logs, supervision, outgoing connections), the
//!   rest between its listeners, so that every cap together stays below the
//!   limit whatever any peer does.
//! - [`Pool`]: one per port. A connection holds an *unproven* slot until it
//!   proves itself (a checked credential, an accepted Hello); unproven
//!   connections of every kind on the port (handshakes, scrapes, HTTP/2
//!   prefaces, TLS hellos) share one small pool with one whole-handshake
//!   deadline, and past its cap the oldest is closed. Only a proven peer
//!   holds one of the port's proven slots.
//! - [`accept`]: an accept that never returns an error: EMFILE, ENFILE,
//!   ENOMEM and the like back off and go on, logged once per interval.
//!
//! Architecture invariant: no listener of a lockstep binary accepts outside
//! a [`Pool`], and no accept loop ends on an error.

mod accept;
mod budget;
mod pool;

pub use accept::{accept, AcceptErrors, ACCEPT_BACKOFF};
pub use budget::{
    raise_descriptor_limit, Budget, BudgetError, BudgetMetrics, Caps, ListenerLabels, Share,
    MIN_RESERVE,
};
pub use pool::{
    bounds_lifted, closing_margin, Pool, PoolUsage, Proof, Ready, Slot, NO_BOUNDS_ENV,
    SUMMARY_INTERVAL,
};
