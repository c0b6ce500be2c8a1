//! The models' own checks, at bounds small enough for `cargo test` in debug
//! mode: the negative controls and deliberate flaws are caught, the real
//! strategies and rules pass, and the partial drop replays as expected.
//! `cargo xtask model` checks the larger CI bounds in release mode.

use std::collections::HashSet;

use lockstep_model::compute::{ComputeAction as A, ComputeState, HistoryCheck};
use lockstep_model::{check, ComputeBounds, ComputeModel, OrphanBounds, OrphanModel, Strategy};
use lockstep_reconcile::{LogHoldMutant, RoundMutant};
use stateright::Model;

const SMALL: ComputeBounds = ComputeBounds {
    processes: 2,
    dataflows: 1,
    commands: 3,
    faults: 1,
};

fn compute(strategy: Strategy, bounds: ComputeBounds) -> ComputeModel {
    ComputeModel::new(strategy, bounds)
}

fn violated(report: &lockstep_model::Report) -> Vec<&'static str> {
    report.violations.iter().map(|v| v.property).collect()
}

#[test]
fn naive_is_caught() {
    let r = check(
        compute(Strategy::Naive, SMALL),
        "naive",
        String::new(),
        true,
    );
    assert!(r.ok(), "naive must be caught");
    assert!(violated(&r).contains(&"I1 lockstep"), "{:?}", violated(&r));
    let i1 = &r.violations[0];
    assert!(i1.trace.contains("I1 broken"), "{}", i1.trace);
    assert!(r.json().contains(r#""caught":true"#));
}

#[test]
fn protected_strategies_pass() {
    for s in [Strategy::Broadcast, Strategy::Barrier, Strategy::Log] {
        let r = check(compute(s, SMALL), s.name(), String::new(), false);
        assert!(
            r.ok(),
            "{s}: {:?} {:?}",
            r.violations.first().map(|v| &v.trace),
            r.missing_examples
        );
        assert!(r.states > 100, "{s}: only {} states", r.states);
        assert!(r.json().contains(r#""passed":1,"failed":0"#));
    }
}

#[test]
fn barrier_with_local_reconciliation_is_caught() {
    let m = compute(Strategy::Barrier, SMALL).with_mutant(RoundMutant::LocalReconcileUnderBarrier);
    let r = check(m, "barrier-local", String::new(), false);
    assert!(!r.ok());
    assert!(violated(&r).contains(&"I1 lockstep"), "{:?}", violated(&r));
}

#[test]
fn barrier_that_ignores_skipped_sessions_deadlocks() {
    // Two faults: a worker can skip a whole session, and a peer waiting in
    // that session's reconciliation round would wait forever.
    let bounds = ComputeBounds {
        processes: 2,
        dataflows: 1,
        commands: 0,
        faults: 2,
    };
    let m = compute(Strategy::Barrier, bounds).with_mutant(RoundMutant::IgnoreNewerSessions);
    let r = check(m, "barrier-no-session-end", String::new(), false);
    assert!(!r.ok());
    assert_eq!(
        violated(&r),
        vec!["I2 target reachable without another fault"]
    );
    // And the real barrier (with `barrier_view`) passes the same bounds.
    let r = check(
        compute(Strategy::Barrier, bounds),
        "barrier",
        String::new(),
        false,
    );
    assert!(r.violations.is_empty(), "{}", r.violations[0].trace);
}

/// Runs `script` from the initial state; every action must be enabled.
fn replay(m: &ComputeModel, script: &[A]) -> ComputeState {
    let mut s = m.init_states().remove(0);
    for a in script {
        let mut enabled = Vec::new();
        m.actions(&s, &mut enabled);
        assert!(
            enabled.contains(a),
            "{a:?} not enabled in {}",
            m.summary(&s)
        );
        s = m.next_state(&s, a.clone()).expect("enabled action");
    }
    s
}

/// Every fault-free continuation without new commands keeps I1 and I4, and
/// every one that ends, ends at the target.
fn all_continuations_reach_the_target(m: &ComputeModel, s: ComputeState) {
    let mut stack = vec![s];
    let mut seen = HashSet::new();
    while let Some(st) = stack.pop() {
        if !seen.insert(st.clone()) {
            continue;
        }
        assert_eq!(m.check_i1(&st), Ok(()), "{}", m.summary(&st));
        assert_eq!(m.check_i4(&st), Ok(()), "{}", m.summary(&st));
        let mut next = Vec::new();
        m.actions(&st, &mut next);
        next.retain(|a| matches!(a, A::Receive(_) | A::Decide(..) | A::Apply(_) | A::Restart));
        if next.is_empty() {
            assert!(m.done(&st), "stuck short of the target: {}", m.summary(&st));
        }
        stack.extend(next.into_iter().filter_map(|a| m.next_state(&st, a)));
    }
}

/// The partial drop: the controller builds A, drops it and asks for it again;
/// p0 sees build and drop, p1 only build; the controller crashes (the last
/// create is lost in flight but durable in the catalog) and restarts wanting A.
#[test]
fn partial_drop_breaks_naive() {
    let m = compute(Strategy::Naive, SMALL);
    let s = replay(
        &m,
        &[
            A::Create(0),
            A::Receive(0),
            A::Receive(1),
            A::Drop(0),
            A::Receive(0),
            A::Create(0),
            A::Crash,
            A::Restart,
            A::Receive(0),
            A::Receive(0),
            A::Receive(1),
            A::Receive(1),
        ],
    );
    assert!(m.quiet(&s));
    let err = m.check_i1(&s).unwrap_err();
    // p0 built a second A alone; p1 still runs the first one.
    assert!(
        err.contains("worker 1 created nothing at position 1"),
        "{err}"
    );
    assert!(m.check_i4(&s).is_err());
    assert!(!m.target_reachable(&s));
}

#[test]
fn partial_drop_is_safe_under_barrier() {
    let m = compute(Strategy::Barrier, SMALL);
    let s = replay(
        &m,
        &[
            A::Create(0),
            A::Receive(0),
            A::Receive(1),
            A::Decide(0, 1),
            A::Decide(1, 1),
            A::Drop(0),
            A::Receive(0),
            A::Create(0),
            A::Crash,
            A::Restart,
        ],
    );
    // Collective reconciliation drops p1's old A and rebuilds A everywhere.
    all_continuations_reach_the_target(&m, s);
}

const ORPHANS: OrphanBounds = OrphanBounds {
    controllers: 3,
    serve_ops: 2,
    crashes: 1,
};

#[test]
fn orphan_rules() {
    for rule in ["epoch", "id-watermark"] {
        let r = check(OrphanModel::new(rule, ORPHANS), rule, String::new(), false);
        assert!(
            r.ok(),
            "{rule}: {:?} {:?}",
            r.violations.first().map(|v| &v.trace),
            r.missing_examples
        );
    }
    let r = check(
        OrphanModel::new("catalog-only", ORPHANS),
        "catalog-only",
        String::new(),
        true,
    );
    assert!(r.ok(), "catalog-only must be caught");
    assert!(violated(&r).contains(&"O1 no wanted service removed"));
    assert!(r.violations[0].trace.contains("O1 broken"));
}

#[test]
fn unconditional_ensure_lets_labels_go_back() {
    // The epoch rule's first version: ensure overwrites, so a stale controller can put an older
    // epoch (and spec) back on a newer controller's service.
    let mut m = OrphanModel::new("epoch", ORPHANS);
    m.conditional_ensure = false;
    let r = check(m, "epoch-unconditional", String::new(), false);
    assert!(
        violated(&r).contains(&"O4 no stale overwrite"),
        "{:?}",
        violated(&r)
    );
}

/// the history check with the *compacted* history digest (what
/// `CommandHistory::digest` hashes) cannot see a dataflow that one process
/// built and dropped and another never built: both compacted histories are
/// empty, yet their timely counters differ.
#[test]
fn history_check_on_compacted_histories_misses_a_dropped_partial_install() {
    let m = compute(Strategy::Naive, SMALL).with_history_check(HistoryCheck::Compacted);
    let r = check(m, "history-compacted", String::new(), true);
    assert!(violated(&r).contains(&"I1 lockstep"), "{:?}", violated(&r));
    let i1 = &r.violations[0];
    assert!(
        i1.trace.contains("checks the reported history digests"),
        "{}",
        i1.trace
    );
}

/// With a digest of everything a process did, a mismatch restarts the
/// replica and naive delivery becomes safe.
#[test]
fn history_check_on_full_histories_protects_naive() {
    let m = compute(Strategy::Naive, SMALL).with_history_check(HistoryCheck::Full);
    let r = check(m, "history-full", String::new(), false);
    assert!(
        r.ok(),
        "{:?} {:?}",
        r.violations.first().map(|v| &v.trace),
        r.missing_examples
    );
}

/// The naive→barrier upgrade: when a naive session's history mismatch is
/// reconciled collectively, the controller's machine sends its
/// InitializationComplete with `barrier` (`completion_strategy`). That
/// cannot keep naive in lockstep: once the round is abandoned for a newer
/// session, the old session's creates apply on some workers only. Caught by
/// I1, with the upgraded InitializationComplete in the counterexample; it is
/// why a naive session's mismatch restarts the replica.
#[test]
fn reconciling_a_naive_mismatch_collectively_is_caught() {
    let bounds = ComputeBounds {
        processes: 2,
        dataflows: 2,
        commands: 2,
        faults: 2,
    };
    let m = compute(Strategy::Naive, bounds).with_history_check(HistoryCheck::FullCollective);
    let r = check(m, "history-full-collective", String::new(), true);
    assert!(violated(&r).contains(&"I1 lockstep"), "{:?}", violated(&r));
    let trace = &r
        .violations
        .iter()
        .find(|v| v.property == "I1 lockstep")
        .expect("an I1 counterexample")
        .trace;
    assert!(
        trace.contains("InitializationComplete with barrier"),
        "{trace}"
    );
}

#[test]
fn without_tombstones_a_stale_ensure_resurrects_a_dropped_replica() {
    let mut m = OrphanModel::new("epoch", ORPHANS);
    m.tombstones = false;
    let r = check(m, "epoch-no-tombstones", String::new(), false);
    assert_eq!(violated(&r), vec!["O2 orphans go"]);
    assert!(r.violations[0].trace.contains("O2 broken"));
}

/// Sessions that alternate between `log` and `barrier`, within one fault:
/// the log-marker hold keeps every worker in lockstep with no halt, and it
/// is exercised (a newer barrier session waits for its marker on some
/// worker). Without the hold a worker joins the barrier session before it
/// read the cut-off log session's create that its peer built: the
/// reconciliation finds their creation logs differ and halts them.
#[test]
fn log_then_barrier_needs_the_log_marker_hold() {
    let bounds = ComputeBounds {
        processes: 2,
        dataflows: 1,
        commands: 1,
        faults: 1,
    };
    let r = check(
        ComputeModel::log_then(Strategy::Barrier, bounds),
        "log-then-barrier",
        String::new(),
        false,
    );
    assert!(
        r.ok(),
        "{:?} {:?}",
        r.violations.first().map(|v| &v.trace),
        r.missing_examples
    );
    assert!(r.states > 100, "only {} states", r.states);
    let m = ComputeModel::log_then(Strategy::Barrier, bounds)
        .with_log_hold_mutant(LogHoldMutant::NoHold);
    let r = check(m, "mutant-no-log-hold", String::new(), true);
    assert_eq!(violated(&r), vec!["no worker loses lockstep"]);
    let trace = &r.violations[0].trace;
    assert!(
        trace.contains("from the log") && trace.contains("lost lockstep"),
        "{trace}"
    );
    assert!(r.json().contains(r#""caught":true"#));
}

/// Every flaw planted in a production machine the model runs is caught, by a
/// violated invariant (M1).
#[test]
fn every_production_mutant_is_caught() {
    for name in lockstep_model::MUTANT_VARIANTS {
        let report = lockstep_model::run_variant(name).expect("a listed variant");
        assert!(report.caught(), "{name} was not caught");
        assert!(report.json().contains(r#""caught":true"#), "{name}");
    }
}
