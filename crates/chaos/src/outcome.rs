//! How a fault scenario ends, and the suite's reporting-contract line.
//!
//! Both fault suites (distribution and orphans) report through this module.
//! A scenario passes, or fails with a [`Failure`]: a violation of a named
//! invariant (what the suite exists to find) or a harness error (the suite
//! itself could not do its job). A harness error fails the run for every
//! variant and never counts as catching a negative control.

/// Why a scenario did not pass.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Failure {
    /// An invariant broke: which one (`I1`..`I4`), and what was seen.
    Violation {
        /// The invariant, as docs/invariants.md names it.
        invariant: String,
        /// What was seen.
        what: String,
    },
    /// The harness failed: nothing is known about the invariants.
    Harness(String),
}

/// A violation of `invariant`.
pub fn violation(invariant: &str, what: String) -> Failure {
    Failure::Violation {
        invariant: invariant.to_string(),
        what,
    }
}

/// Errors of the harness's own steps (`?` on a `Result<_, String>`).
impl From<String> for Failure {
    fn from(e: String) -> Self {
        Failure::Harness(e)
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Violation { invariant, what } => {
                write!(f, "VIOLATION of {invariant}: {what}")
            }
            Failure::Harness(e) => write!(f, "HARNESS ERROR: {e}"),
        }
    }
}

/// The outcomes of one variant's scenarios.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Tally {
    /// Scenarios that passed.
    pub passed: usize,
    /// Scenarios that found an invariant broken.
    pub violations: usize,
    /// Scenarios whose harness failed.
    pub harness_errors: usize,
}

impl Tally {
    /// Counts one outcome and returns its one-line description.
    pub fn record(&mut self, outcome: &Result<(), Failure>) -> String {
        match outcome {
            Ok(()) => {
                self.passed += 1;
                "ok".into()
            }
            Err(f @ Failure::Violation { .. }) => {
                self.violations += 1;
                f.to_string()
            }
            Err(f @ Failure::Harness(_)) => {
                self.harness_errors += 1;
                f.to_string()
            }
        }
    }

    /// A negative control is caught by violations alone, with a working
    /// harness.
    pub fn caught(&self) -> bool {
        self.violations > 0 && self.harness_errors == 0
    }

    /// Whether the variant met its expectation.
    pub fn ok(&self, negative_control: bool) -> bool {
        if negative_control {
            self.caught()
        } else {
            self.violations == 0 && self.harness_errors == 0
        }
    }

    /// The reporting contract's JSON line (`caught` only for a negative
    /// control).
    pub fn summary_line(&self, suite: &str, variant: &str, negative_control: bool) -> String {
        /// The line's fields, in the contract's order.
        #[derive(serde::Serialize)]
        struct Line<'a> {
            suite: &'a str,
            variant: &'a str,
            scenarios: usize,
            passed: usize,
            failed: usize,
            violations: usize,
            harness_errors: usize,
            #[serde(skip_serializing_if = "Option::is_none")]
            caught: Option<bool>,
        }
        serde_json::to_string(&Line {
            suite,
            variant,
            scenarios: self.passed + self.violations + self.harness_errors,
            passed: self.passed,
            failed: self.violations + self.harness_errors,
            violations: self.violations,
            harness_errors: self.harness_errors,
            caught: negative_control.then(|| self.caught()),
        })
        .expect("a summary line serializes")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_harness_error_never_catches_a_negative_control() {
        let mut t = Tally::default();
        t.record(&Err(Failure::Harness("replica did not start".into())));
        assert!(!t.caught());
        assert!(!t.ok(true));
        assert!(!t.ok(false));
        t.record(&Err(violation("I1", "logs differ".into())));
        assert!(!t.caught(), "a harness error still fails the run");
        assert!(t.summary_line("s", "v", true).contains(r#""caught":false"#));
    }

    #[test]
    fn violations_catch_a_negative_control_and_fail_the_others() {
        let mut t = Tally::default();
        t.record(&Ok(()));
        t.record(&Err(violation("I2", "hung".into())));
        assert!(t.caught());
        assert!(t.ok(true));
        assert!(!t.ok(false));
        let line = t.summary_line("distribution", "naive", true);
        assert!(line.contains(r#""scenarios":2,"passed":1,"failed":1,"violations":1,"harness_errors":0,"caught":true"#), "{line}");
    }
}
