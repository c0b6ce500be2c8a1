//! The orphan suite: every scenario of `lockstep_environment::chaos` for one
//! orphan rule, as pass / violation / harness error.

use std::path::Path;

use lockstep_environment::chaos::{
    crash_scenario, o4_control, stale_binary_halts, stale_cannot_resurrect, stale_halts_on_write,
    stale_loads_before_newer_creates, timeline, Outcome, CREATE_FAILPOINTS, DROP_FAILPOINTS,
};

use crate::outcome::{violation, Failure, Tally};

pub use lockstep_environment::chaos::VARIANTS;

/// An orphan scenario's outcome in the shared form. A violation's text starts
/// with the invariant it names (`O1: ...`).
pub fn to_result(outcome: Outcome) -> Result<(), Failure> {
    match outcome {
        Outcome::Pass => Ok(()),
        Outcome::Violation(v) => {
            let invariant = v
                .split(|c: char| c == ':' || c.is_whitespace())
                .next()
                .filter(|i| i.len() == 2 && i.starts_with('O'))
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

/// Runs every scenario for one rule. `lockstep_bin` (built with the
/// `failpoints` feature) enables the crash scenarios; without it only the
/// library scenarios run.
pub async fn run_variant(rule: &str, lockstep_bin: Option<&Path>) -> RuleReport {
    let negative_control = VARIANTS
        .iter()
        .find(|(v, _)| *v == rule)
        .is_some_and(|(_, must_pass)| !must_pass);
    let mut results: Vec<(String, Outcome)> = Vec::new();
    if let Some(bin) = lockstep_bin {
        for fp in CREATE_FAILPOINTS.iter().chain(&DROP_FAILPOINTS) {
            results.push((
                format!("crash-at-{fp}"),
                crash_scenario(bin, rule, fp).await,
            ));
        }
        results.push((
            "stale-binary-halts-on-write".into(),
            stale_binary_halts(bin, rule).await,
        ));
    }
    results.push((
        "three-controller-timeline".into(),
        timeline(rule, true).await,
    ));
    results.push((
        "o4-control-unconditional-ensure-goes-backwards".into(),
        o4_control(rule).await,
    ));
    results.push((
        "stale-loads-before-newer-creates".into(),
        stale_loads_before_newer_creates(rule).await,
    ));
    results.push((
        "stale-ensure-cannot-resurrect-a-dropped-replica".into(),
        stale_cannot_resurrect(rule).await,
    ));
    results.push((
        "stale-halts-on-catalog-write".into(),
        stale_halts_on_write(rule).await,
    ));
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
