//! The distribution suite's variants: what a variant name on the command
//! line (`STRATEGY[+history-check|+reachability][@postgres|@hosts]`) means,
//! and the variants run by default.

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
    /// The dataflow family the replica builds (`+reachability`: the example
    /// family of `examples/reachability`, on its own replica binary).
    pub(crate) family: Family,
}

/// A dataflow family the suite's workload can be written in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Family {
    /// The built-in plan language (`lockstep-plan`), on `lockstep-replica`.
    Plan,
    /// Breadth-first distances (`lockstep-example-reachability`), on
    /// `lockstep-replica-reachability`.
    Reachability,
}

impl Family {
    /// The replica binary that builds this family.
    pub(crate) fn binary(self) -> &'static str {
        match self {
            Family::Plan => "lockstep-replica",
            Family::Reachability => "lockstep-replica-reachability",
        }
    }
}

impl std::fmt::Display for Variant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.strategy)?;
        if self.check_reconciles {
            write!(f, "+history-check")?;
        }
        if self.family == Family::Reachability {
            write!(f, "+reachability")?;
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
        let (s, family) = match s.strip_suffix("+reachability") {
            Some(n) => (n, Family::Reachability),
            None => (s, Family::Plan),
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
            family,
        })
    }
}

/// The variants run by default: the three strategies that must pass, the
/// log strategy with its command log in PostgreSQL, the negative control,
/// naive delivery repaired by the history check, and the strategies and the
/// negative control again with the reachability family (its scenarios are
/// [`super::scenarios::FAMILY_SCENARIOS`]).
pub(crate) const DEFAULT_VARIANTS: [&str; 10] = [
    "broadcast",
    "barrier",
    "log",
    "log@postgres",
    "naive",
    "naive+history-check",
    "broadcast+reachability",
    "barrier+reachability",
    "log+reachability",
    "naive+reachability",
];

/// The partition variants, run by default where simulated hosts can be made.
pub(crate) const HOSTS_VARIANTS: [&str; 4] = [
    "broadcast@hosts",
    "barrier@hosts",
    "log@hosts",
    "naive@hosts",
];
