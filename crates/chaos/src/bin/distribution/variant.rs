//! The distribution suite's variants: what a variant name on the command
//! line (`STRATEGY[+history-check][@postgres|@hosts]`) means, and the
//! variants run by default.

use lockstep_protocol::Strategy;

/// What a scenario runs: one strategy for every command, what the
/// history check on connect does on a mismatch, and where the command log
/// lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Variant {
    pub(crate) strategy: Strategy,
    /// `STRATEGY@postgres`: the replica's command log is in PostgreSQL (a
    /// throw-away server this binary starts), not a SQLite file.
    pub(crate) postgres: bool,
    /// `naive+history-check`: naive delivery, but the history check on
    /// connect (history check) restarts the replica on a mismatch, which
    /// the harness then does through the orchestrator, as the environment
    /// does. Plain `naive` is the negative control: its mismatches are
    /// reported and nobody acts on them.
    pub(crate) check_reconciles: bool,
    /// `@hosts`: the partition scenarios, on two simulated hosts.
    pub(crate) hosts: bool,
}

impl std::fmt::Display for Variant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.strategy)?;
        if self.check_reconciles {
            write!(f, "+history-check")?;
        }
        if self.hosts {
            write!(f, "@hosts")?;
        }
        if self.postgres {
            write!(f, "@postgres")?;
        }
        Ok(())
    }
}

impl std::str::FromStr for Variant {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (s, postgres, hosts) = match s.split_once('@') {
            Some((s, "postgres")) => (s, true, false),
            Some((s, "hosts")) => (s, false, true),
            Some((_, other)) => {
                return Err(format!(
                    "unknown variant suffix @{other} (known: @postgres, @hosts)"
                ))
            }
            None => (s, false, false),
        };
        let (name, check_reconciles) = match s.strip_suffix("+history-check") {
            Some(n) => (n, true),
            None => (s, false),
        };
        Ok(Variant {
            strategy: name.parse()?,
            postgres,
            check_reconciles,
            hosts,
        })
    }
}

/// The variants run by default: the three strategies that must pass, the
/// log strategy with its command log in PostgreSQL, the negative control,
/// and naive delivery repaired by the history check.
pub(crate) const DEFAULT_VARIANTS: [&str; 6] = [
    "broadcast",
    "barrier",
    "log",
    "log@postgres",
    "naive",
    "naive+history-check",
];

/// The partition variants, run by default where simulated hosts can be made.
pub(crate) const HOSTS_VARIANTS: [&str; 4] = [
    "broadcast@hosts",
    "barrier@hosts",
    "log@hosts",
    "naive@hosts",
];
