//! The orphan suite: every scenario of `lockstep_chaos::environment` for one
//! orphan rule, as pass / violation / harness error, on the process backend
//! (variant `RULE`), on the Kubernetes backend over the in-memory API
//! server double (variant `RULE@kubernetes`: every scenario, the crash ones
//! with `lockstep serve` reaching the double over loopback HTTP, plus the
//! Kubernetes-only ones), and on the process backend with the catalog in
//! PostgreSQL (variant `RULE@postgres`: every scenario, each on a fresh
//! database of one throw-away server, so the fence under test is
//! PostgreSQL's).

use std::path::Path;

use crate::environment::{
    crash_scenario_on, k8s_conflict_on_ensure, k8s_delete_races_recreate, k8s_watch_drops,
    o4_control_on, stale_binary_halts_on, stale_cannot_resurrect_on, stale_halts_on_write_on,
    stale_loads_before_newer_creates_on, timeline_on, Backend, FreshDatabase, Outcome,
    CREATE_FAILPOINTS, DROP_FAILPOINTS,
};

use crate::environment::real_kube::RealCluster;
use crate::outcome::{violation, Failure, Tally};

pub use crate::environment::VARIANTS;

/// An orphan scenario's outcome in the shared form. A violation's text starts
/// with the invariant it names (`O1: ...`).
pub fn to_result(outcome: Outcome) -> Result<(), Failure> {
    match outcome {
        Outcome::Pass => Ok(()),
        Outcome::Violation(v) => {
            let invariant = v
                .split(|c: char| c == ':' || c.is_whitespace())
                .next()
                .filter(|i| i.len() == 2 && (i.starts_with('O') || i.starts_with('I')))
                .unwrap_or("O?")
                .to_string();
            let what = v
                .strip_prefix(&format!("{invariant}: "))
                .map(str::to_string)
                .unwrap_or(v);
            Err(violation(&invariant, what))
        }
        Outcome::Harness(h) => Err(Failure::Harness(h)),
    }
}

/// One rule's results: the tally and one line per failed scenario.
#[derive(Clone, Debug)]
pub struct RuleReport {
    /// The orphan rule.
    pub rule: String,
    /// Whether it is the negative control (must be caught).
    pub negative_control: bool,
    /// The outcomes.
    pub tally: Tally,
    /// What broke, one line per failed scenario.
    pub failures: Vec<String>,
}

impl RuleReport {
    /// Whether the rule met its expectation.
    pub fn ok(&self) -> bool {
        self.tally.ok(self.negative_control)
    }

    /// The reporting contract's JSON line.
    pub fn summary_line(&self) -> String {
        self.tally
            .summary_line("orphans", &self.rule, self.negative_control)
    }
}

/// Where the suite runs each rule: the process backend, the Kubernetes
/// backend (both with the catalog in SQLite), and the process backend with
/// the catalog in PostgreSQL.
pub const BACKENDS: [&str; 3] = ["process", "kubernetes", "postgres"];

/// The variant's name: `RULE` on the process backend, `RULE@BACKEND` else.
pub fn variant_name(rule: &str, backend: &str) -> String {
    if backend == "process" {
        rule.to_string()
    } else {
        format!("{rule}@{backend}")
    }
}

/// Runs every scenario for one rule on the process backend. `lockstep_bin`
/// (built with the `failpoints` feature) enables the crash scenarios;
/// without it only the library scenarios run.
pub async fn run_variant(rule: &str, lockstep_bin: Option<&Path>) -> RuleReport {
    run_variant_on("process", rule, lockstep_bin, None).await
}

/// Runs every scenario for one rule on `backend` (`process`, `kubernetes`,
/// or `postgres`, which needs `databases`, the maker of fresh databases);
/// see [`run_variant`].
pub async fn run_variant_on(
    backend: &str,
    rule: &str,
    lockstep_bin: Option<&Path>,
    databases: Option<&FreshDatabase>,
) -> RuleReport {
    run_variant_with(backend, rule, lockstep_bin, databases, None).await
}

/// [`run_variant_on`], also on a real API server (`backend`
/// `kube-apiserver`, with `real`: every scenario but the three that need
/// the double's fault injection, which stay on the double).
pub async fn run_variant_with(
    backend: &str,
    rule: &str,
    lockstep_bin: Option<&Path>,
    databases: Option<&FreshDatabase>,
    real: Option<&RealCluster>,
) -> RuleReport {
    let negative_control = VARIANTS
        .iter()
        .find(|(v, _)| *v == rule)
        .is_some_and(|(_, must_pass)| !must_pass);
    let kubernetes = backend == "kubernetes";
    let on = || match (backend, databases) {
        ("postgres", Some(fresh)) => Backend::ProcessOnPostgres(fresh.clone()),
        ("postgres", None) => panic!("the postgres variants need a database maker"),
        ("kube-apiserver", _) => Backend::RealKubernetes(
            real.expect("the kube-apiserver variants need a cluster")
                .clone(),
        ),
        (other, _) => Backend::named(other).expect("a known backend"),
    };
    let mut results: Vec<(String, Outcome)> = Vec::new();
    if let Some(bin) = lockstep_bin {
        for fp in CREATE_FAILPOINTS.iter().chain(&DROP_FAILPOINTS) {
            results.push((
                format!("crash-at-{fp}"),
                crash_scenario_on(on(), bin, rule, fp).await,
            ));
        }
        results.push((
            "stale-binary-halts-on-write".into(),
            stale_binary_halts_on(on(), bin, rule).await,
        ));
    }
    results.push((
        "three-controller-timeline".into(),
        timeline_on(on(), rule, true).await,
    ));
    results.push((
        "o4-control-unconditional-ensure-goes-backwards".into(),
        o4_control_on(on(), rule).await,
    ));
    results.push((
        "stale-loads-before-newer-creates".into(),
        stale_loads_before_newer_creates_on(on(), rule).await,
    ));
    results.push((
        "stale-ensure-cannot-resurrect-a-dropped-replica".into(),
        stale_cannot_resurrect_on(on(), rule).await,
    ));
    results.push((
        "stale-halts-on-catalog-write".into(),
        stale_halts_on_write_on(on(), rule).await,
    ));
    if kubernetes {
        results.push((
            "delete-racing-recreate-stopped-by-preconditions".into(),
            k8s_delete_races_recreate().await,
        ));
        results.push((
            "conflict-409-on-ensure".into(),
            k8s_conflict_on_ensure(rule).await,
        ));
        results.push(("watch-drops".into(), k8s_watch_drops().await));
    }
    let rule = variant_name(rule, backend);
    let rule = rule.as_str();
    let mut tally = Tally::default();
    let mut failures = Vec::new();
    for (name, outcome) in results {
        let result = to_result(outcome);
        let line = tally.record(&result);
        if result.is_err() {
            failures.push(format!("orphans/{rule}/{name}: {line}"));
        }
    }
    RuleReport {
        rule: rule.to_string(),
        negative_control,
        tally,
        failures,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn violations_name_their_invariant() {
        match to_result(Outcome::Violation("O2: the orphan 3 survived".into())) {
            Err(Failure::Violation { invariant, what }) => {
                assert_eq!(invariant, "O2");
                assert_eq!(what, "the orphan 3 survived");
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(
            to_result(Outcome::Harness("timeout".into())),
            Err(Failure::Harness("timeout".into()))
        );
        assert_eq!(to_result(Outcome::Pass), Ok(()));
    }
}
