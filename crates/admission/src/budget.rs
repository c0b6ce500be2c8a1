//! A process's descriptor budget: the limit, the reserve for its own work,
//! and each listener's caps, derived from the limit so that they add up to
//! less than it.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// The least reserve a process keeps for its own descriptors, whatever the
/// limit: catalog and command-log files (SQLite: the database, its `-wal`
/// and `-shm`), process logs, the supervisor's pipes and pidfds, outgoing
/// connections (to every replica process, to PostgreSQL), the timely mesh.
pub const MIN_RESERVE: u64 = 256;

/// What one listener asks of the budget.
#[derive(Clone, Copy, Debug)]
pub struct Share {
    /// The listener's name (a metrics label: `api`, `metrics`,
    /// `controller`, `mesh`).
    pub name: &'static str,
    /// Its part of what the reserve leaves, relative to the others'.
    pub weight: u64,
    /// The most proven connections it ever needs.
    pub max_proven: usize,
    /// The size of its pool of unproven connections, at most.
    pub unproven: usize,
}

/// One listener's caps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Caps {
    /// Proven connections open at once.
    pub proven: usize,
    /// Unproven connections open at once (the oldest is closed past it).
    pub unproven: usize,
}

/// Why a budget cannot be made.
#[derive(Debug, PartialEq, Eq)]
pub enum BudgetError {
    /// The limit leaves too little beside the reserve for the listeners.
    TooFewDescriptors {
        /// The soft descriptor limit.
        descriptors: u64,
        /// The reserve it must keep.
        reserve: u64,
        /// What the listeners need at the least.
        needed: u64,
    },
}

impl std::fmt::Display for BudgetError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BudgetError::TooFewDescriptors {
                descriptors,
                reserve,
                needed,
            } => write!(
                f,
                "the descriptor limit ({descriptors}) leaves too little beside the reserve of {reserve}: the listeners need at least {needed} more; raise `ulimit -n` (RLIMIT_NOFILE)"
            ),
        }
    }
}

impl std::error::Error for BudgetError {}

/// A process's descriptor budget: its limit, the reserve, and the caps of
/// each listener. Every cap together plus the reserve is at most the limit.
#[derive(Clone, Debug)]
pub struct Budget {
    /// The soft descriptor limit the budget splits.
    pub descriptors: u64,
    /// What is kept for the process's own work.
    pub reserve: u64,
    listeners: Vec<(&'static str, Caps)>,
}

/// The least a listener gets of each kind of slot.
const MIN_SLOTS: usize = 4;

impl Budget {
    /// Splits `descriptors`: the reserve is `reserve` or a quarter of the
    /// limit, whichever is larger; each listener's unproven pool is its
    /// asked size, shrunk to an equal part of an eighth of what is left;
    /// the rest is split by weight into proven caps, each at most its
    /// `max_proven`.
    pub fn split(descriptors: u64, reserve: u64, shares: &[Share]) -> Result<Budget, BudgetError> {
        let reserve = reserve.max(descriptors / 4);
        let n = shares.len() as u64;
        let needed = n * 2 * MIN_SLOTS as u64;
        let available = descriptors.saturating_sub(reserve);
        if available < needed {
            return Err(BudgetError::TooFewDescriptors {
                descriptors,
                reserve,
                needed,
            });
        }
        let unproven_each = (available / 8 / n.max(1)).max(MIN_SLOTS as u64) as usize;
        let unproven: Vec<usize> = shares
            .iter()
            .map(|s| s.unproven.clamp(MIN_SLOTS, unproven_each.max(MIN_SLOTS)))
            .collect();
        let rest = available - unproven.iter().sum::<usize>() as u64;
        let weights: u64 = shares.iter().map(|s| s.weight.max(1)).sum();
        let listeners = shares
            .iter()
            .zip(unproven)
            .map(|(s, unproven)| {
                let part = (rest * s.weight.max(1) / weights.max(1)) as usize;
                let proven = part.min(s.max_proven).max(MIN_SLOTS);
                (s.name, Caps { proven, unproven })
            })
            .collect();
        Ok(Budget {
            descriptors,
            reserve,
            listeners,
        })
    }

    /// Raises the soft descriptor limit to the hard one
    /// ([`raise_descriptor_limit`]) and splits it. A limit too small for
    /// `reserve` keeps half of it as the reserve instead (logged); an error
    /// only if even that leaves too little.
    pub fn for_process(reserve: u64, shares: &[Share]) -> Result<Budget, BudgetError> {
        let descriptors = match raise_descriptor_limit() {
            Ok(d) => d,
            Err(e) => {
                tracing::warn!("cannot read or raise the descriptor limit ({e}); assuming 1024");
                1024
            }
        };
        match Budget::split(descriptors, reserve, shares) {
            Err(e) if descriptors / 2 < reserve => {
                tracing::warn!("{e}; keeping half of the limit as the reserve instead");
                Budget::split(descriptors, descriptors / 2, shares)
            }
            r => r,
        }
    }

    /// The caps of the listener `name` (one of the shares it was made of).
    ///
    /// # Panics
    ///
    /// If no share had that name: a programming error.
    pub fn caps(&self, name: &str) -> Caps {
        self.listeners
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, c)| *c)
            .unwrap_or_else(|| panic!("no listener {name:?} in the budget"))
    }

    /// Every listener's caps, in the order of the shares.
    pub fn listeners(&self) -> &[(&'static str, Caps)] {
        &self.listeners
    }

    /// The sum of every listener's caps: at most `descriptors - reserve`.
    pub fn total_caps(&self) -> u64 {
        self.listeners
            .iter()
            .map(|(_, c)| (c.proven + c.unproven) as u64)
            .sum()
    }

    /// One line for the log: the limit, the reserve and each listener's caps.
    pub fn summary(&self) -> String {
        let caps = self
            .listeners
            .iter()
            .map(|(n, c)| format!("{n} {}+{}", c.proven, c.unproven))
            .collect::<Vec<_>>()
            .join(", ");
        format!(
            "descriptor limit {}, reserve {}, listeners (proven+unproven): {caps}",
            self.descriptors, self.reserve
        )
    }
}

/// Raises the soft `RLIMIT_NOFILE` to the hard limit (at most 2^20: a
/// larger table only costs memory) and returns the soft limit now in force.
pub fn raise_descriptor_limit() -> std::io::Result<u64> {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).map_err(std::io::Error::from)?;
    let want = hard.min(1 << 20);
    if want > soft {
        setrlimit(Resource::RLIMIT_NOFILE, want, hard).map_err(std::io::Error::from)?;
        return Ok(want);
    }
    Ok(soft)
}

/// The labels of one listener's gauges.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ListenerLabels {
    /// The listener (`api`, `metrics`, `controller`, `mesh`).
    pub listener: &'static str,
    /// `proven` or `unproven`.
    pub kind: &'static str,
}

/// The budget as metrics: the limit, the reserve, and per listener and
/// kind of slot its cap and what is in use.
#[derive(Clone, Debug, Default)]
pub struct BudgetMetrics {
    /// The soft descriptor limit.
    pub limit: Gauge,
    /// The reserve kept for the process's own work.
    pub reserve: Gauge,
    /// Each listener's caps.
    pub caps: Family<ListenerLabels, Gauge>,
    /// Each listener's open connections.
    pub used: Family<ListenerLabels, Gauge>,
}

impl BudgetMetrics {
    /// Registers the gauges in `registry` (names `descriptor_limit`,
    /// `descriptor_reserve`, `listener_cap`, `listener_connections`).
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "descriptor_limit",
            "The soft descriptor limit (RLIMIT_NOFILE) the budget splits",
            self.limit.clone(),
        );
        registry.register(
            "descriptor_reserve",
            "Descriptors kept for the process's own work (stores, logs, supervision, outgoing connections)",
            self.reserve.clone(),
        );
        registry.register(
            "listener_cap",
            "The cap of each listener's proven and unproven connections",
            self.caps.clone(),
        );
        registry.register(
            "listener_connections",
            "Each listener's open proven and unproven connections",
            self.used.clone(),
        );
    }

    /// Sets the limit, the reserve and the caps from `budget`.
    pub fn set(&self, budget: &Budget) {
        self.limit.set(budget.descriptors as i64);
        self.reserve.set(budget.reserve as i64);
        for (listener, caps) in budget.listeners() {
            for (kind, cap) in [("proven", caps.proven), ("unproven", caps.unproven)] {
                self.caps
                    .get_or_create(&ListenerLabels { listener, kind })
                    .set(cap as i64);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shares() -> [Share; 2] {
        [
            Share {
                name: "api",
                weight: 3,
                max_proven: 4096,
                unproven: 64,
            },
            Share {
                name: "metrics",
                weight: 1,
                max_proven: 256,
                unproven: 32,
            },
        ]
    }

    #[test]
    fn every_cap_together_stays_below_the_limit_with_the_reserve_kept() {
        for descriptors in [64u64, 100, 256, 512, 1024, 4096, 65_536, 1 << 20] {
            let Ok(b) = Budget::split(descriptors, MIN_RESERVE.min(descriptors / 2), &shares())
            else {
                assert!(descriptors < 128, "{descriptors} should be enough");
                continue;
            };
            assert!(b.reserve >= descriptors / 4);
            assert!(
                b.total_caps() + b.reserve <= descriptors,
                "{descriptors}: {}",
                b.summary()
            );
            assert!(b.caps("api").proven >= b.caps("metrics").proven);
        }
    }

    #[test]
    fn at_1024_descriptors_the_api_and_metrics_no_longer_take_them_all() {
        // The attack of issue 45: 512 API plus 512 metrics connections took
        // 1024 of 1024 descriptors.
        let b = Budget::split(1024, MIN_RESERVE, &shares()).unwrap();
        assert_eq!(b.reserve, 256);
        assert!(b.total_caps() <= 768, "{}", b.summary());
        // An eighth of what the reserve leaves, shared by the two pools.
        assert_eq!(b.caps("api").unproven, 48);
    }

    #[test]
    fn a_large_limit_is_capped_by_what_a_listener_needs() {
        let b = Budget::split(1 << 20, MIN_RESERVE, &shares()).unwrap();
        assert_eq!(b.caps("api").proven, 4096);
        assert_eq!(b.caps("metrics").proven, 256);
    }

    #[test]
    fn too_small_a_limit_is_an_error_naming_it() {
        let e = Budget::split(20, 16, &shares()).unwrap_err();
        assert!(e.to_string().contains("descriptor limit (20)"), "{e}");
    }

    #[test]
    fn the_soft_limit_is_raised_to_the_hard_one() {
        use nix::sys::resource::{getrlimit, Resource};
        let now = raise_descriptor_limit().unwrap();
        let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
        assert_eq!(now, soft);
        assert_eq!(soft, hard.min(1 << 20).max(soft));
    }
}
