//! A policy fresh from `cargo xtask new-policy` builds (build-policies
//! builds one of each kind from the same templates) and passes the
//! conformance check as it is.

mod common;

use common::hostile;
use lockstep_policy_host::{conformance, PolicyKind};

#[test]
fn fresh_scaffolds_pass_the_conformance_check() {
    for (name, kind) in [
        ("scaffold-distribution", PolicyKind::Distribution),
        ("scaffold-orphans", PolicyKind::Orphans),
    ] {
        let lines = conformance::check(hostile(name)).unwrap();
        assert_eq!(lines.len(), 1);
        assert_eq!(lines[0].kind, kind);
        assert!(lines[0].scenarios > 0);
        assert!(lines[0].ok(), "{}", conformance::report(&lines));
    }
}
