//! Hostile and malformed policies: each is a clear error, and the host (the
//! same policy object) answers the next call.

mod common;

use std::time::{Duration, Instant};

use common::*;
use lockstep_policy::{
    CommandClass, DistributionPolicy, OrphanDecision, OrphanPolicy, PolicyError, Strategy,
};
use lockstep_policy_host::{
    conformance, detect_kind, CallError, Limits, LoadError, PolicyKind, SafeOrphans,
    WasmDistributionPolicy, WasmOrphanPolicy,
};

fn load_dist(name: &str) -> WasmDistributionPolicy {
    WasmDistributionPolicy::load(hostile(name), Limits::default()).unwrap()
}

#[test]
fn an_infinite_loop_runs_out_of_fuel_and_the_policy_answers_next() {
    let mut p = load_dist("loop");
    let started = Instant::now();
    let err = p
        .call_choose(&command(CommandClass::CreateDataflow))
        .unwrap_err();
    assert!(
        matches!(
            err,
            CallError::OutOfFuel {
                fuel: 100_000_000,
                ..
            }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("ran out of fuel"), "{err}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "fuel must stop the loop quickly ({:?})",
        started.elapsed()
    );
    assert_eq!(
        p.call_choose(&command(CommandClass::Hello)).unwrap(),
        Strategy::Broadcast
    );
    // Again: the fresh instance traps just the same, and recovers again.
    assert!(matches!(
        p.call_choose(&command(CommandClass::CreateDataflow)),
        Err(CallError::OutOfFuel { .. })
    ));
    assert_eq!(
        p.call_choose(&command(CommandClass::Peek)).unwrap(),
        Strategy::Broadcast
    );
}

#[test]
fn fuel_is_per_call_and_configurable() {
    let limits = Limits {
        fuel_per_call: 1_000_000,
        ..Limits::default()
    };
    let mut p = WasmDistributionPolicy::load(hostile("loop"), limits).unwrap();
    assert_eq!(p.limits(), limits);
    let err = p
        .call_choose(&command(CommandClass::CreateDataflow))
        .unwrap_err();
    assert_eq!(
        err,
        CallError::OutOfFuel {
            policy: "loop".into(),
            fuel: 1_000_000
        }
    );
    // Many cheap calls in a row never run out: fuel is refilled per call.
    for _ in 0..1000 {
        p.call_choose(&command(CommandClass::Hello)).unwrap();
    }
}

#[test]
fn unbounded_memory_growth_hits_the_memory_limit_and_the_policy_answers_next() {
    let mut p = load_dist("grow");
    let err = p
        .call_choose(&command(CommandClass::CreateDataflow))
        .unwrap_err();
    match &err {
        CallError::MemoryLimit {
            policy,
            limit,
            requested,
        } => {
            assert_eq!(policy, "grow");
            assert_eq!(*limit, 64 << 20);
            assert!(requested > limit);
        }
        other => panic!("expected a memory limit, got {other:?}"),
    }
    assert!(err.to_string().contains("memory limit"), "{err}");
    assert_eq!(
        p.call_choose(&command(CommandClass::Hello)).unwrap(),
        Strategy::Barrier
    );
}

#[test]
fn a_panic_is_a_trap_carrying_the_panic_message_and_the_policy_answers_next() {
    let mut p = load_dist("panic");
    let err = p
        .call_choose(&command(CommandClass::CreateDataflow))
        .unwrap_err();
    match &err {
        CallError::Trap {
            policy, message, ..
        } => {
            assert_eq!(policy, "panic");
            let message = message.as_deref().unwrap_or_default();
            assert!(
                message.contains("hostile policy refuses dataflow Some(7)"),
                "{message}"
            );
        }
        other => panic!("expected a trap, got {other:?}"),
    }
    assert!(
        err.to_string().contains("hostile policy refuses dataflow"),
        "{err}"
    );
    assert_eq!(
        p.call_choose(&command(CommandClass::Hello)).unwrap(),
        Strategy::Log
    );
    // Through the trait it is a PolicyError naming the policy.
    match p.choose(&command(CommandClass::CreateDataflow)) {
        Err(PolicyError::Failed { policy, reason }) => {
            assert_eq!(policy, "panic");
            assert!(reason.starts_with("trapped"), "{reason}");
            assert!(reason.contains("refuses dataflow"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn nonsense_orphan_decisions_are_refused_and_the_policy_answers_next() {
    let mut p = WasmOrphanPolicy::load(hostile("nonsense"), Limits::default()).unwrap();
    let services = [svc(1, 1), svc(2, 1)];
    for (epoch, expected) in [
        (1, "deletes service ID 999, which was not listed"),
        (2, "deletes service ID 1 more than once"),
        (3, "deletes service ID 2, which the catalog keeps"),
        (4, "halts without a reason"),
    ] {
        let err = p
            .call_classify(&services, &view(&[2], epoch, 10))
            .unwrap_err();
        match &err {
            CallError::Nonsense { policy, reason } => {
                assert_eq!(policy, "nonsense");
                assert!(reason.contains(expected), "{reason}");
            }
            other => panic!("expected nonsense, got {other:?}"),
        }
        assert!(matches!(
            p.classify(&services, &view(&[2], epoch, 10)),
            Err(PolicyError::Nonsense { .. })
        ));
    }
    assert_eq!(
        p.call_classify(&services, &view(&[2], 5, 10)).unwrap(),
        OrphanDecision::Delete(vec![])
    );
    // The conformance check reports it rather than passing it.
    let line = &conformance::check(hostile("nonsense")).unwrap()[0];
    assert!(!line.ok());
    assert_eq!(line.scenarios, line.passed + line.failed);
    assert!(
        line.failures
            .iter()
            .any(|f| f.contains("answered nonsense")),
        "{:?}",
        line.failures
    );
}

#[test]
fn a_failing_distribution_policy_is_an_error_and_a_failing_orphan_rule_deletes_nothing() {
    // The error reaches the controller's machine, which applies its
    // fallback (no wrapper decides it here); the next call is answered.
    let mut d = load_dist("panic");
    assert!(d.choose(&command(CommandClass::CreateDataflow)).is_err());
    assert_eq!(
        d.choose(&command(CommandClass::Hello)).unwrap(),
        Strategy::Log
    );
    assert_eq!(d.name(), "panic");

    let mut o =
        SafeOrphans::new(WasmOrphanPolicy::load(hostile("nonsense"), Limits::default()).unwrap());
    let services = [svc(1, 1), svc(2, 1)];
    assert_eq!(
        o.decide(&services, &view(&[], 1, 10)),
        OrphanDecision::Delete(vec![])
    );
    assert_eq!(o.failures(), 1);
}

fn wrong_world(err: LoadError) -> String {
    match err {
        LoadError::WrongWorld { reason, .. } => reason,
        other => panic!("expected a wrong world, got {other:?}"),
    }
}

#[test]
fn a_policy_of_the_other_world_is_refused_naming_the_missing_exports() {
    let err = WasmDistributionPolicy::load(shipped("epoch"), Limits::default()).unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("does not implement the distribution world"),
        "{text}"
    );
    let reason = wrong_world(err);
    assert!(
        reason.contains("missing exports `choose`, `on-mismatch`"),
        "{reason}"
    );
    assert!(reason.contains("orphans world"), "{reason}");

    let reason =
        wrong_world(WasmOrphanPolicy::load(shipped("broadcast"), Limits::default()).unwrap_err());
    assert!(reason.contains("missing export `classify`"), "{reason}");
    assert!(reason.contains("distribution world"), "{reason}");

    // The host is still usable.
    let mut p = WasmOrphanPolicy::load(shipped("epoch"), Limits::default()).unwrap();
    assert!(p.classify(&[], &view(&[], 1, 1)).is_ok());
}

#[test]
fn a_policy_built_against_an_old_version_is_refused_naming_it() {
    let reason = wrong_world(
        WasmDistributionPolicy::load(hostile("old-version"), Limits::default()).unwrap_err(),
    );
    assert!(reason.contains("lockstep:policy@0.0.9"), "{reason}");
    assert!(reason.contains("lockstep:policy/types@0.1.0"), "{reason}");
}

#[test]
fn a_policy_wanting_a_clock_is_refused_naming_the_import() {
    let reason = wrong_world(
        WasmDistributionPolicy::load(hostile("extra-import"), Limits::default()).unwrap_err(),
    );
    assert!(reason.contains("imports `now`"), "{reason}");
    assert!(reason.contains("no WASI"), "{reason}");
}

#[test]
fn a_policy_with_the_wrong_signatures_is_refused() {
    let reason = wrong_world(
        WasmDistributionPolicy::load(hostile("wrong-signature"), Limits::default()).unwrap_err(),
    );
    assert!(reason.contains("choose"), "{reason}");
}

#[test]
fn files_that_are_no_component_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let text = dir.path().join("notes.wasm");
    std::fs::write(&text, "this is not wasm\n").unwrap();
    let err = WasmDistributionPolicy::load(&text, Limits::default()).unwrap_err();
    assert!(matches!(err, LoadError::NotWasm { .. }), "{err:?}");
    assert!(err.to_string().contains("not a WebAssembly file"), "{err}");

    let empty = dir.path().join("empty.wasm");
    std::fs::write(&empty, "").unwrap();
    assert!(matches!(
        WasmOrphanPolicy::load(&empty, Limits::default()),
        Err(LoadError::NotWasm { .. })
    ));

    let err = WasmDistributionPolicy::load(hostile("core-module"), Limits::default()).unwrap_err();
    assert!(matches!(err, LoadError::CoreModule { .. }), "{err:?}");
    assert!(err.to_string().contains("wasm-component-ld"), "{err}");

    let missing = dir.path().join("nowhere.wasm");
    let err = WasmDistributionPolicy::load(&missing, Limits::default()).unwrap_err();
    assert!(matches!(err, LoadError::Missing { .. }), "{err:?}");
    assert!(err.to_string().contains("does not exist"), "{err}");

    // A component header with garbage after it: wasmtime refuses to compile.
    let garbage = dir.path().join("garbage.wasm");
    std::fs::write(&garbage, b"\0asm\x0d\0\x01\0garbage").unwrap();
    assert!(matches!(
        WasmDistributionPolicy::load(&garbage, Limits::default()),
        Err(LoadError::Compile { .. })
    ));

    assert!(matches!(detect_kind(&text), Err(LoadError::NotWasm { .. })));
    assert!(matches!(
        conformance::check(&missing),
        Err(LoadError::Missing { .. })
    ));
    assert!(matches!(
        detect_kind(hostile("wrong-signature")),
        Ok(PolicyKind::Distribution)
    ));
}

#[test]
fn a_memory_limit_below_the_initial_memory_refuses_the_load() {
    let limits = Limits {
        memory_bytes: 64 << 10,
        ..Limits::default()
    };
    let err = WasmDistributionPolicy::load(shipped("barrier"), limits).unwrap_err();
    match err {
        LoadError::Instantiate { source, .. } => {
            assert!(
                matches!(source, CallError::MemoryLimit { .. }),
                "{source:?}"
            )
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_chatty_policy_keeps_its_last_messages_and_its_panic() {
    let mut p = load_dist("chatty");
    assert_eq!(
        p.call_choose(&command(CommandClass::Hello)).unwrap(),
        Strategy::Barrier
    );
    match p
        .call_choose(&command(CommandClass::CreateDataflow))
        .unwrap_err()
    {
        CallError::Trap { message, .. } => {
            let message = message.unwrap();
            assert!(
                message.starts_with("(9986 earlier messages) noise 9985; "),
                "{message}"
            );
            assert!(message.ends_with("chatty policy gives up"), "{message}");
            assert!(message.len() < 2_000, "{} bytes kept", message.len());
        }
        other => panic!("expected a trap, got {other:?}"),
    }
    assert_eq!(
        p.call_choose(&command(CommandClass::Peek)).unwrap(),
        Strategy::Barrier
    );
}
