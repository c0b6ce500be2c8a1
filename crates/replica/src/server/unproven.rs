//! Connections before their Hello is proved (S1, R1): the controller
//! port's caps and deadline (its [`lockstep_admission::Pool`] closes the
//! oldest unproven connection first and any unproven one at the deadline),
//! and the rate-limited summary of refusals.

use super::*;

/// Connections a process keeps while they have not proved a Hello (the
/// most: a small descriptor limit shrinks it, [`controller_share`]); past
/// it, the oldest of them is closed to admit a new one. Controller
/// handshakes and metrics scrapes share it.
pub const MAX_UNPROVEN_CONNECTIONS: usize = 64;

/// Proven controller connections a process keeps at most: the current
/// session's, and older ones on their way out.
pub const MAX_PROVEN_CONNECTIONS: usize = 16;

/// The controller port's share of the process's descriptor budget.
pub fn controller_share() -> lockstep_admission::Share {
    lockstep_admission::Share {
        name: "controller",
        weight: 1,
        max_proven: MAX_PROVEN_CONNECTIONS,
        unproven: MAX_UNPROVEN_CONNECTIONS,
    }
}

/// The time a connection has, from its accept, to deliver a whole first
/// frame (its Hello) and have it checked; after it, it is closed.
pub const HELLO_DEADLINE: Duration = Duration::from_secs(5);

/// At most one summary line of connections refused before proof per this
/// interval (a key-less client must not be able to grow the log).
pub const REFUSAL_LOG_INTERVAL: Duration = Duration::from_secs(10);

/// Why a connection ended before it proved a Hello: counted, not logged
/// one by one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Refusal {
    /// Closed to admit a newer connection past [`MAX_UNPROVEN_CONNECTIONS`].
    Evicted,
    /// Proved, but [`MAX_PROVEN_CONNECTIONS`] were open.
    Full,
    /// No checked Hello within [`HELLO_DEADLINE`].
    TimedOut,
    /// Closed by the peer before a first frame.
    Closed,
    /// A first frame that does not decode (or is too long).
    Malformed,
    /// A Hello refused by the checks (proof, version, epoch, shape).
    RefusedHello,
    /// A Hello not newer than the current session.
    Replayed,
    /// No session: the peer did not prove the session key.
    NotProven,
}

impl Refusal {
    pub(super) fn name(self) -> &'static str {
        match self {
            Refusal::Evicted => "evicted",
            Refusal::Full => "full",
            Refusal::TimedOut => "timed_out",
            Refusal::Closed => "closed",
            Refusal::Malformed => "malformed",
            Refusal::RefusedHello => "refused_hello",
            Refusal::Replayed => "replayed",
            Refusal::NotProven => "not_proven",
        }
    }
}

/// How a connection ended, if not cleanly.
pub(super) enum Ended {
    /// Before its Hello was proved and accepted: counted.
    Unproven((Refusal, String)),
    /// After: logged.
    Proven(anyhow::Error),
}

impl From<anyhow::Error> for Ended {
    fn from(e: anyhow::Error) -> Self {
        Ended::Proven(e)
    }
}

/// The connections refused before proof since the last summary line.
#[derive(Default)]
pub(super) struct Refusals {
    pub(super) counts: std::collections::BTreeMap<Refusal, u64>,
    pub(super) last: Option<(SocketAddr, String)>,
    pub(super) last_logged: Option<std::time::Instant>,
}

impl Refusals {
    /// Counts one refusal; logs a summary if none was logged within the
    /// interval.
    pub(super) fn note(&mut self, (refusal, detail): (Refusal, String), peer: SocketAddr) {
        *self.counts.entry(refusal).or_default() += 1;
        crate::metrics::METRICS
            .refused
            .get_or_create(&crate::metrics::ReasonLabel {
                reason: refusal.name(),
            })
            .inc();
        self.last = Some((peer, format!("{}: {detail}", refusal.name())));
        self.flush();
    }

    /// Logs the summary of what was counted, unless one was logged within
    /// the interval; at most one line.
    pub(super) fn flush(&mut self) {
        if self.counts.is_empty() {
            return;
        }
        if self
            .last_logged
            .is_some_and(|t| t.elapsed() < REFUSAL_LOG_INTERVAL)
        {
            return;
        }
        let total: u64 = self.counts.values().sum();
        let by_reason = self
            .counts
            .iter()
            .map(|(r, n)| format!("{}:{n}", r.name()))
            .collect::<Vec<_>>()
            .join(",");
        let (peer, last) = self.last.take().expect("set with the counts");
        tracing::warn!(
            total,
            %by_reason,
            %peer,
            %last,
            "controller-port connections closed before a proved Hello (summary, at most one line per {:?})",
            REFUSAL_LOG_INTERVAL
        );
        self.counts.clear();
        self.last_logged = Some(std::time::Instant::now());
    }
}
