//! Connections before their Hello is proved (S1): the cap on waiting ones
//! (the oldest closed first), the deadline for a whole first frame, and the
//! rate-limited summary of refusals.

use super::*;

/// Connections a process keeps while they have not proved a Hello; past
/// it, the oldest of them is closed to admit a new one.
pub const MAX_UNPROVEN_CONNECTIONS: usize = 64;

/// The time a connection has, from its accept, to deliver a whole first
/// frame (its Hello) and have it checked; after it, it is closed.
pub const HELLO_DEADLINE: Duration = Duration::from_secs(5);

/// At most one summary line of connections refused before proof per this
/// interval (a key-less client must not be able to grow the log).
pub const REFUSAL_LOG_INTERVAL: Duration = Duration::from_secs(10);

/// The unproven connections, oldest first, each with the token that closes
/// it.
#[derive(Default)]
pub(super) struct Admission {
    pub(super) next_id: u64,
    pub(super) queue: std::collections::VecDeque<(u64, tokio_util::sync::CancellationToken)>,
}

impl Admission {
    /// Admits one more connection (the last of the queue); returns the
    /// oldest one's token if the cap made room by evicting it.
    pub(super) fn admit(&mut self) -> Option<tokio_util::sync::CancellationToken> {
        let evicted = if self.queue.len() >= MAX_UNPROVEN_CONNECTIONS {
            self.queue.pop_front().map(|(_, c)| c)
        } else {
            None
        };
        self.next_id += 1;
        self.queue
            .push_back((self.next_id, tokio_util::sync::CancellationToken::new()));
        evicted
    }
}

/// Holds a connection's place among the unproven until dropped or
/// [`Unproven::proven`].
pub(super) struct Unproven {
    pub(super) admission: Option<Arc<Mutex<Admission>>>,
    pub(super) id: u64,
}

impl Unproven {
    pub(super) fn proven(&mut self) {
        if let Some(a) = self.admission.take() {
            let mut a = a.lock().expect("not poisoned");
            if let Some(i) = a.queue.iter().position(|(id, _)| *id == self.id) {
                a.queue.remove(i);
            }
        }
    }
}

impl Drop for Unproven {
    fn drop(&mut self) {
        self.proven();
    }
}

/// Why a connection ended before it proved a Hello: counted, not logged
/// one by one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Refusal {
    /// Closed to admit a newer connection past [`MAX_UNPROVEN_CONNECTIONS`].
    Evicted,
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
