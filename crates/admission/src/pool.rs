//! One port's connections: a small pool of unproven ones with one
//! whole-handshake deadline (the oldest closed past its cap), and a cap on
//! the proven ones.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use tokio_util::sync::CancellationToken;

use crate::budget::{Caps, ListenerLabels};

/// At most one summary line of closed connections per this interval and
/// pool: a peer without a credential must not be able to grow the log.
pub const SUMMARY_INTERVAL: Duration = Duration::from_secs(10);

/// Set in a process's environment, its pools have no caps and no
/// deadline: the negative control of the hostile-neighbour campaign, which
/// must catch it. Read only in a build with the `experiments` feature
/// (which only the test command turns on); a release build ignores it.
pub const NO_BOUNDS_ENV: &str = "LOCKSTEP_EXPERIMENT_NO_ADMISSION_BOUNDS";

/// Whether [`NO_BOUNDS_ENV`] lifts every admission bound of this process
/// (caps, deadlines, byte budgets): only in a build with the
/// `experiments` feature (the test command's), else never.
pub fn bounds_lifted() -> bool {
    cfg!(feature = "experiments") && std::env::var_os(NO_BOUNDS_ENV).is_some()
}

/// What a port has open, for tests and logs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolUsage {
    /// Proven connections open.
    pub proven: usize,
    /// Unproven connections open.
    pub unproven: usize,
}

#[derive(Default)]
struct Counts {
    evicted: u64,
    timed_out: u64,
    refused_proven: u64,
    last_summary: Option<Instant>,
}

struct Book {
    unproven: VecDeque<(u64, CancellationToken)>,
    proven: usize,
    next: u64,
    counts: Counts,
}

struct Shared {
    name: &'static str,
    caps: Caps,
    deadline: Duration,
    book: Mutex<Book>,
    /// One permit per connection the port may hold open at once: both
    /// caps and [`closing_margin`] more, for evicted connections whose
    /// sockets are not closed yet (their tasks close them when next run).
    /// [`Pool::ready`] waits for one before an accept, so a busy machine
    /// that runs the evicted tasks late still cannot run the process out
    /// of descriptors.
    held: Arc<tokio::sync::Semaphore>,
    gauges: Option<Family<ListenerLabels, Gauge>>,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, Book> {
        self.book.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Publishes the usage and, when due, one summary of what was closed.
    fn after_change(&self, b: &mut Book) {
        if let Some(g) = &self.gauges {
            for (kind, n) in [("proven", b.proven), ("unproven", b.unproven.len())] {
                g.get_or_create(&ListenerLabels {
                    listener: self.name,
                    kind,
                })
                .set(n as i64);
            }
        }
        let c = &mut b.counts;
        let any = c.evicted + c.timed_out + c.refused_proven > 0;
        let due = c
            .last_summary
            .is_none_or(|t| t.elapsed() >= SUMMARY_INTERVAL);
        if any && due {
            tracing::warn!(
                listener = self.name,
                evicted = c.evicted,
                timed_out = c.timed_out,
                refused_proven = c.refused_proven,
                proven = b.proven,
                unproven = b.unproven.len(),
                caps = ?self.caps,
                "connections closed by the admission bounds since the last summary (at most one line per {:?})",
                SUMMARY_INTERVAL
            );
            (c.evicted, c.timed_out, c.refused_proven) = (0, 0, 0);
            c.last_summary = Some(Instant::now());
        }
    }
}

/// One port's admission: [`Pool::admit`] every accepted connection, and
/// [`Slot::prove`] it once it proved itself.
#[derive(Clone)]
pub struct Pool {
    shared: Arc<Shared>,
}

impl Pool {
    /// A pool named `name` (in logs and metrics) with `caps`; an unproven
    /// connection is closed `deadline` after its admission.
    ///
    /// With [`NO_BOUNDS_ENV`] set (the hostile campaign's negative control
    /// only), the caps and the deadline are as good as none.
    pub fn new(name: &'static str, caps: Caps, deadline: Duration) -> Pool {
        let (caps, deadline) = if bounds_lifted() {
            tracing::warn!(
                listener = name,
                "{NO_BOUNDS_ENV} is set: no caps and no deadline on connections (a negative control)"
            );
            let none = Caps {
                proven: 1 << 30,
                unproven: 1 << 30,
            };
            (none, Duration::from_secs(86_400))
        } else {
            (caps, deadline)
        };
        let permits = (caps.proven + caps.unproven + closing_margin(caps))
            .min(tokio::sync::Semaphore::MAX_PERMITS);
        Pool {
            shared: Arc::new(Shared {
                name,
                caps,
                deadline,
                held: Arc::new(tokio::sync::Semaphore::new(permits)),
                book: Mutex::new(Book {
                    unproven: VecDeque::new(),
                    proven: 0,
                    next: 0,
                    counts: Counts::default(),
                }),
                gauges: None,
            }),
        }
    }

    /// The same pool, publishing its usage in `gauges` (the
    /// `listener_connections` family of [`crate::BudgetMetrics`]).
    pub fn with_gauges(self, gauges: Family<ListenerLabels, Gauge>) -> Pool {
        let shared = Arc::try_unwrap(self.shared)
            .unwrap_or_else(|_| panic!("gauges are set before the pool is shared"));
        let pool = Pool {
            shared: Arc::new(Shared {
                gauges: Some(gauges),
                ..shared
            }),
        };
        pool.shared.after_change(&mut pool.shared.lock());
        pool
    }

    /// The pool's name (its listener's).
    pub fn name(&self) -> &'static str {
        self.shared.name
    }

    /// The pool's caps.
    pub fn caps(&self) -> Caps {
        self.shared.caps
    }

    /// The pool's deadline for an unproven connection.
    pub fn deadline(&self) -> Duration {
        self.shared.deadline
    }

    /// What is open now.
    pub fn usage(&self) -> PoolUsage {
        let b = self.shared.lock();
        PoolUsage {
            proven: b.proven,
            unproven: b.unproven.len(),
        }
    }

    /// Waits until the port may hold one more connection open (see
    /// [`Ready`]); call it before the accept whose connection
    /// [`admit_ready`](Self::admit_ready) admits.
    pub async fn ready(&self) -> Ready {
        Ready {
            _permit: Arc::clone(&self.shared.held)
                .acquire_owned()
                .await
                .expect("the pool's semaphore is never closed"),
        }
    }

    /// [`admit`](Self::admit), the connection holding `ready` until its
    /// slot is dropped.
    pub fn admit_ready(&self, ready: Ready) -> Slot {
        let mut slot = self.admit();
        slot.held = Some(ready);
        slot
    }

    /// Admits a new connection as unproven. Past the unproven cap, the
    /// oldest unproven connection is closed (its [`Slot::closed`]
    /// resolves): the new one may be the real peer, and a flood delays it by
    /// at most one handshake. The slot closes by itself at the deadline
    /// unless proven first (this spawns a timer on the tokio runtime).
    pub fn admit(&self) -> Slot {
        let close = CancellationToken::new();
        let proven = Arc::new(AtomicBool::new(false));
        let id = {
            let mut b = self.shared.lock();
            while b.unproven.len() >= self.shared.caps.unproven {
                let (_, oldest) = b.unproven.pop_front().expect("not empty");
                oldest.cancel();
                b.counts.evicted += 1;
            }
            b.next += 1;
            let id = b.next;
            b.unproven.push_back((id, close.clone()));
            self.shared.after_change(&mut b);
            id
        };
        let proof = Proof {
            shared: Arc::clone(&self.shared),
            id,
            proven: Arc::clone(&proven),
            close: close.clone(),
        };
        {
            let proof = proof.clone();
            let deadline = self.shared.deadline;
            tokio::spawn(async move {
                tokio::select! {
                    () = tokio::time::sleep(deadline) => {
                        let mut b = proof.shared.lock();
                        if let Some(i) = b.unproven.iter().position(|(i, _)| *i == proof.id) {
                            b.unproven.remove(i);
                            proof.close.cancel();
                            b.counts.timed_out += 1;
                            proof.shared.after_change(&mut b);
                        }
                    }
                    () = proof.close.cancelled() => {}
                }
            });
        }
        Slot {
            proof,
            admitted: Instant::now(),
            held: None,
        }
    }
}

/// A handle that proves a connection from elsewhere (a request's
/// credential checked in a service layer): clones of it share the slot.
#[derive(Clone)]
pub struct Proof {
    shared: Arc<Shared>,
    id: u64,
    proven: Arc<AtomicBool>,
    close: CancellationToken,
}

impl Proof {
    /// Moves the connection from the unproven pool to the proven ones.
    /// Returns false (and closes the connection) if it was already closed
    /// (evicted, timed out) or the proven cap is full. Proving a proven
    /// connection again is a no-op that returns true.
    pub fn prove(&self) -> bool {
        if self.proven.load(Ordering::Acquire) {
            return true;
        }
        let mut b = self.shared.lock();
        let Some(i) = b.unproven.iter().position(|(i, _)| *i == self.id) else {
            return self.proven.load(Ordering::Acquire);
        };
        b.unproven.remove(i);
        let ok = b.proven < self.shared.caps.proven;
        if ok {
            b.proven += 1;
            self.proven.store(true, Ordering::Release);
        } else {
            b.counts.refused_proven += 1;
            self.close.cancel();
        }
        self.shared.after_change(&mut b);
        ok
    }

    /// Whether the connection is proven.
    pub fn is_proven(&self) -> bool {
        self.proven.load(Ordering::Acquire)
    }
}

/// One admitted connection's place in its pool; dropping it frees the
/// place.
pub struct Slot {
    proof: Proof,
    admitted: Instant,
    /// The port's permit to hold this connection open, if it took one
    /// ([`Pool::admit_ready`]); released when the slot is dropped.
    held: Option<Ready>,
}

/// A permit to hold one more connection open on a port ([`Pool::ready`]).
pub struct Ready {
    /// Held, not read: dropping it frees the place.
    _permit: tokio::sync::OwnedSemaphorePermit,
}

/// Connections past both caps a port may still hold while evicted ones
/// wait to be closed: a quarter of the unproven cap, at least 2.
pub fn closing_margin(caps: Caps) -> usize {
    (caps.unproven / 4).max(2)
}

impl Slot {
    /// See [`Proof::prove`].
    pub fn prove(&self) -> bool {
        self.proof.prove()
    }

    /// Whether the connection is proven.
    pub fn is_proven(&self) -> bool {
        self.proof.is_proven()
    }

    /// A handle that proves this connection from elsewhere.
    pub fn proof(&self) -> Proof {
        self.proof.clone()
    }

    /// Resolves once the pool closes the connection: evicted as the oldest
    /// unproven, past the deadline unproven, or refused a proven slot.
    pub async fn closed(&self) {
        self.proof.close.cancelled().await
    }

    /// The token [`Slot::closed`] waits on.
    pub fn close_token(&self) -> CancellationToken {
        self.proof.close.clone()
    }

    /// Whether the pool closed the connection.
    pub fn is_closed(&self) -> bool {
        self.proof.close.is_cancelled()
    }

    /// The caps of the pool the connection is in.
    pub fn caps(&self) -> Caps {
        self.proof.shared.caps
    }

    /// When the connection was admitted.
    pub fn admitted(&self) -> Instant {
        self.admitted
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let shared = &self.proof.shared;
        let mut b = shared.lock();
        if self.proof.proven.load(Ordering::Acquire) {
            b.proven -= 1;
        } else if let Some(i) = b.unproven.iter().position(|(i, _)| *i == self.proof.id) {
            b.unproven.remove(i);
        }
        // Ends the deadline's timer.
        self.proof.close.cancel();
        shared.after_change(&mut b);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(proven: usize, unproven: usize, deadline: Duration) -> Pool {
        Pool::new("test", Caps { proven, unproven }, deadline)
    }

    #[tokio::test]
    async fn past_the_unproven_cap_the_oldest_is_closed_and_the_proven_are_kept() {
        let p = pool(8, 4, Duration::from_secs(60));
        let kept = p.admit();
        assert!(kept.prove());
        let flood: Vec<Slot> = (0..10).map(|_| p.admit()).collect();
        assert_eq!(
            p.usage(),
            PoolUsage {
                proven: 1,
                unproven: 4
            }
        );
        // The first six of the flood were closed, oldest first; the newest
        // four and the proven one stay.
        for (i, s) in flood.iter().enumerate() {
            assert_eq!(s.is_closed(), i < 6, "{i}");
        }
        assert!(!kept.is_closed());
        // A closed one cannot be proven after all.
        assert!(!flood[0].prove());
        assert!(flood[9].prove());
        assert_eq!(
            p.usage(),
            PoolUsage {
                proven: 2,
                unproven: 3
            }
        );
        // Closing connections frees their places, proven or not.
        drop(flood);
        assert_eq!(
            p.usage(),
            PoolUsage {
                proven: 1,
                unproven: 0
            }
        );
        drop(kept);
        assert_eq!(p.usage().proven, 0);
    }

    #[tokio::test]
    async fn no_more_connections_are_held_than_both_caps_and_the_closing_margin() {
        let p = pool(1, 2, Duration::from_secs(60));
        let held = 1 + 2 + closing_margin(p.caps());
        let mut slots = Vec::new();
        for _ in 0..held {
            let ready = tokio::time::timeout(Duration::from_secs(10), p.ready())
                .await
                .expect("a permit while under the bound");
            slots.push(p.admit_ready(ready));
        }
        // Evicted ones whose sockets are still open count: no permit now.
        assert!(slots.iter().filter(|s| s.is_closed()).count() >= held - 2);
        assert!(
            tokio::time::timeout(Duration::ZERO, p.ready())
                .await
                .is_err(),
            "a permit past the bound"
        );
        // An evicted connection closed: its permit is free again.
        let closed = slots.iter().position(|s| s.is_closed()).unwrap();
        drop(slots.remove(closed));
        tokio::time::timeout(Duration::from_secs(10), p.ready())
            .await
            .expect("a permit once a held connection closed");
    }

    #[tokio::test]
    async fn an_unproven_connection_is_closed_at_the_deadline_and_a_proven_one_is_not() {
        let p = pool(8, 4, Duration::from_millis(200));
        let silent = p.admit();
        let proven = p.admit();
        assert!(proven.prove());
        tokio::time::timeout(Duration::from_secs(5), silent.closed())
            .await
            .expect("closed at the deadline");
        assert!(silent.admitted().elapsed() >= Duration::from_millis(190));
        assert!(!proven.is_closed());
        assert_eq!(p.usage().unproven, 0);
    }

    #[tokio::test]
    async fn past_the_proven_cap_a_proving_connection_is_refused_and_closed() {
        let p = pool(2, 4, Duration::from_secs(60));
        let a = p.admit();
        let b = p.admit();
        let c = p.admit();
        assert!(a.prove() && b.prove());
        assert!(!c.prove());
        assert!(c.is_closed());
        drop(a);
        let d = p.admit();
        assert!(d.proof().prove(), "a freed proven slot is taken again");
        assert_eq!(
            p.usage(),
            PoolUsage {
                proven: 2,
                unproven: 0
            }
        );
    }
}
