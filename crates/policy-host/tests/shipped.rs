//! The shipped policies decide as specified, through the real host.

mod common;

use common::*;
use lockstep_policy::{
    CommandInfo, DistributionPolicy, EpochRule, FixedStrategy, IdWatermarkRule, MismatchAction,
    MismatchInfo, OrphanDecision, OrphanPolicy, Service, Strategy,
};
use lockstep_policy_host::{
    conformance, detect_kind, Limits, PolicyKind, WasmDistributionPolicy, WasmOrphanPolicy,
};

#[test]
fn distribution_policies_choose_their_strategy_for_every_command() {
    for (name, strategy) in [
        ("broadcast", Strategy::Broadcast),
        ("barrier", Strategy::Barrier),
        ("log", Strategy::Log),
    ] {
        let mut wasm = WasmDistributionPolicy::load(shipped(name), Limits::default()).unwrap();
        assert_eq!(wasm.name(), name);
        let mut native = FixedStrategy(strategy);
        for class in CLASSES {
            for reconciling in [false, true] {
                for (size_bytes, dataflow_id) in [(0, None), (1 << 30, Some(u64::MAX))] {
                    let info = CommandInfo {
                        class,
                        size_bytes,
                        dataflow_id,
                        process_count: 4,
                        workers_per_process: 8,
                        reconciling,
                    };
                    let got = wasm.choose(&info).unwrap();
                    assert_eq!(got, strategy, "{name} for {info:?}");
                    let fuel = wasm.last_fuel_used().unwrap();
                    assert!(fuel < 1_000, "{name} used {fuel} fuel for one decision");
                    assert_eq!(got, native.choose(&info).unwrap());
                }
            }
        }
        for (p, d, m) in [(2, 2, 0), (2, 2, 1), (16, 3, 5)] {
            let info = MismatchInfo {
                process_count: p,
                distinct_digests: d,
                matching_controller: m,
            };
            assert_eq!(
                wasm.on_mismatch(&info).unwrap(),
                MismatchAction::ReconcileCollectively,
                "{name} on a mismatch"
            );
        }
    }
}

#[test]
fn epoch_policy_spares_newer_and_kept_services() {
    let mut p = WasmOrphanPolicy::load(shipped("epoch"), Limits::default()).unwrap();
    let services = [svc(1, 1), svc(2, 1), svc(3, 5), svc(4, 3)];
    // 1 kept, 2 older and unkept, 3 newer, 4 same epoch as ours.
    assert_eq!(
        p.classify(&services, &view(&[1], 3, 10)).unwrap(),
        OrphanDecision::Delete(vec![2])
    );
    assert_eq!(
        p.classify(&[], &view(&[1], 3, 10)).unwrap(),
        OrphanDecision::Delete(vec![])
    );
    // The epoch rule never halts, even on an ID above the watermark.
    assert_eq!(
        p.classify(&[svc(12, 1)], &view(&[], 3, 10)).unwrap(),
        OrphanDecision::Delete(vec![12])
    );
}

#[test]
fn id_watermark_policy_halts_on_a_newer_id_and_deletes_the_rest() {
    let mut p = WasmOrphanPolicy::load(shipped("id-watermark"), Limits::default()).unwrap();
    let services = [svc(1, 1), svc(7, 4)];
    match p.classify(&services, &view(&[1], 3, 7)).unwrap() {
        OrphanDecision::Halt(reason) => {
            assert!(reason.contains("another controller"), "{reason}");
            assert!(reason.contains("replica-7"), "{reason}");
        }
        other => panic!("expected a halt, got {other:?}"),
    }
    // Epochs do not matter to it: 7 is below the watermark and unkept.
    assert_eq!(
        p.classify(&services, &view(&[1], 3, 8)).unwrap(),
        OrphanDecision::Delete(vec![7])
    );
}

/// A small deterministic generator, so the differential test needs no crate.
struct Lcg(u64);

impl Lcg {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) % n
    }
}

#[test]
fn orphan_policies_agree_with_the_native_rules() {
    let mut epoch = WasmOrphanPolicy::load(shipped("epoch"), Limits::default()).unwrap();
    let mut watermark = WasmOrphanPolicy::load(shipped("id-watermark"), Limits::default()).unwrap();
    let mut rng = Lcg(42);
    let mut halts = 0;
    for _ in 0..300 {
        let n = rng.below(12);
        let mut ids: Vec<u64> = (0..n).map(|_| rng.below(20)).collect();
        ids.sort();
        ids.dedup();
        let services: Vec<Service> = ids.iter().map(|&id| svc(id, rng.below(6))).collect();
        let keep: Vec<u64> = ids.iter().copied().filter(|_| rng.below(2) == 0).collect();
        let v = view(&keep, rng.below(6) + 1, rng.below(22));
        assert_eq!(
            epoch.classify(&services, &v).unwrap(),
            EpochRule.classify(&services, &v).unwrap(),
            "epoch on {services:?} {v:?}"
        );
        let d = watermark.classify(&services, &v).unwrap();
        halts += matches!(d, OrphanDecision::Halt(_)) as u32;
        assert_eq!(
            d,
            IdWatermarkRule.classify(&services, &v).unwrap(),
            "id-watermark on {services:?} {v:?}"
        );
    }
    assert!(halts > 10, "the generator must exercise halts ({halts})");
}

#[test]
fn kinds_are_detected() {
    for name in ["broadcast", "barrier", "log"] {
        assert_eq!(
            detect_kind(shipped(name)).unwrap(),
            PolicyKind::Distribution
        );
    }
    for name in ["epoch", "id-watermark"] {
        assert_eq!(detect_kind(shipped(name)).unwrap(), PolicyKind::Orphans);
    }
}

#[test]
fn shipped_policies_pass_the_conformance_check() {
    for (name, kind, scenarios) in [
        ("broadcast", PolicyKind::Distribution, 28),
        ("barrier", PolicyKind::Distribution, 28),
        ("log", PolicyKind::Distribution, 28),
        ("epoch", PolicyKind::Orphans, 12),
        ("id-watermark", PolicyKind::Orphans, 12),
    ] {
        let lines = conformance::check(shipped(name)).unwrap();
        assert_eq!(lines.len(), 1);
        let line = &lines[0];
        assert!(line.ok(), "{}", conformance::report(&lines));
        assert_eq!(line.kind, kind);
        assert_eq!(line.scenarios, scenarios, "{name}");
        assert_eq!(
            line.to_json(),
            format!(
                r#"{{"suite":"policy-conformance","variant":"{name}","scenarios":{scenarios},"passed":{scenarios},"failed":0}}"#
            )
        );
    }
}

#[test]
fn conformance_catches_the_catalog_only_negative_control() {
    let line = conformance::check_orphans(&mut lockstep_policy::CatalogOnlyRule, "catalog-only");
    assert!(!line.ok());
    assert_eq!(line.failed, 2, "{:?}", line.failures);
    assert!(
        line.failures.iter().all(|f| f.contains("O1")),
        "{:?}",
        line.failures
    );
    let report = conformance::report(&[line]);
    assert!(report.contains("FAILED scenario \"three controllers: envd@2 sees r2"));
    assert!(report.ends_with("\"failed\":2}\n"), "{report}");
    // The native reference rules pass, like their WASM twins.
    assert!(conformance::check_orphans(&mut EpochRule, "epoch").ok());
    assert!(conformance::check_orphans(&mut IdWatermarkRule, "id-watermark").ok());
}

#[test]
fn a_large_listing_fits_the_default_limits() {
    let mut p = WasmOrphanPolicy::load(shipped("id-watermark"), Limits::default()).unwrap();
    let services: Vec<Service> = (0..10_000).map(|id| svc(id, 1)).collect();
    let keep: Vec<u64> = (0..10_000).filter(|id| id % 2 == 0).collect();
    match p.classify(&services, &view(&keep, 2, 10_000)).unwrap() {
        OrphanDecision::Delete(ids) => assert_eq!(ids.len(), 5_000),
        other => panic!("{other:?}"),
    }
    let used = p.last_fuel_used().unwrap();
    assert!(
        used < Limits::default().fuel_per_call / 4,
        "10,000 services used {used} fuel: the default leaves too little room"
    );
    eprintln!("classifying 10,000 services used {used} fuel");
}
