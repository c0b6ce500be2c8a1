//! Policy costs: a WASM decision against the same logic in native Rust,
//! classifying 10,000 services, and loading a policy cold and from the cache.
//!
//! Goals (issue 5): at most 1 µs per distribution decision (median), under
//! 10 ms for 10,000 services, under 50 ms to load cold. Needs the built
//! policies: `cargo xtask build-policies`.

// `criterion_group!` defines an undocumented `pub fn`.
#![allow(missing_docs)]

use std::collections::BTreeMap;
use std::path::PathBuf;

use criterion::{criterion_group, criterion_main, Criterion};
use lockstep_policy::{
    CatalogView, CommandClass, CommandInfo, DistributionPolicy, FixedStrategy, IdWatermarkRule,
    OrphanPolicy, Service, Strategy,
};
use lockstep_policy_host::{
    shipped_policy, ComponentCache, Limits, WasmDistributionPolicy, WasmOrphanPolicy,
};

fn policy(name: &str) -> PathBuf {
    let path = shipped_policy(name);
    assert!(
        path.exists(),
        "{} is missing: run `cargo xtask build-policies` first",
        path.display()
    );
    path
}

fn command() -> CommandInfo {
    CommandInfo {
        class: CommandClass::CreateDataflow,
        size_bytes: 512,
        dataflow_id: Some(42),
        process_count: 4,
        workers_per_process: 2,
        reconciling: false,
    }
}

fn distribution(c: &mut Criterion) {
    let info = command();
    let mut native: Box<dyn DistributionPolicy> = Box::new(FixedStrategy(Strategy::Barrier));
    c.bench_function("policy/choose_native", |b| {
        b.iter(|| native.choose(std::hint::black_box(&info)).unwrap())
    });
    let mut wasm: Box<dyn DistributionPolicy> =
        Box::new(WasmDistributionPolicy::load(policy("barrier"), Limits::default()).unwrap());
    c.bench_function("policy/choose_wasm", |b| {
        b.iter(|| wasm.choose(std::hint::black_box(&info)).unwrap())
    });
}

/// `n` services, half of them kept; each with two labels if `labels`. The
/// canonical ABI copies every string into the guest with a call to its
/// allocator, so labels dominate the WASM cost (five strings per service
/// instead of one).
fn services(n: u64, labels: bool) -> (Vec<Service>, CatalogView) {
    let services = (0..n)
        .map(|id| Service {
            id,
            name: format!("cluster-u1-replica-{id}"),
            epoch: 1 + id % 3,
            labels: if labels {
                BTreeMap::from([
                    ("lockstep.io/kind".to_string(), "replica".to_string()),
                    ("lockstep.io/cluster".to_string(), "u1".to_string()),
                ])
            } else {
                BTreeMap::new()
            },
        })
        .collect();
    let view = CatalogView {
        keep: (0..n).filter(|id| id % 2 == 0).collect(),
        our_epoch: 4,
        next_id: n,
    };
    (services, view)
}

fn orphans(c: &mut Criterion) {
    let mut group = c.benchmark_group("policy");
    group.sample_size(20);
    let mut wasm = WasmOrphanPolicy::load(policy("id-watermark"), Limits::default()).unwrap();
    for (suffix, labels) in [("", true), ("_no_labels", false)] {
        let (services, view) = services(10_000, labels);
        let mut native = IdWatermarkRule;
        group.bench_function(format!("classify_10000_native{suffix}"), |b| {
            b.iter(|| native.classify(&services, &view).unwrap())
        });
        group.bench_function(format!("classify_10000_wasm{suffix}"), |b| {
            b.iter(|| wasm.classify(&services, &view).unwrap())
        });
    }
    group.finish();
}

fn loading(c: &mut Criterion) {
    let path = policy("epoch");
    let mut group = c.benchmark_group("policy");
    group.sample_size(10);
    group.bench_function("load_cold", |b| {
        b.iter(|| WasmOrphanPolicy::load(&path, Limits::default()).unwrap())
    });
    let dir = tempfile::tempdir().unwrap();
    let cache = ComponentCache::new(dir.path());
    WasmOrphanPolicy::load_cached(&path, Limits::default(), &cache).unwrap();
    group.bench_function("load_cached", |b| {
        b.iter(|| WasmOrphanPolicy::load_cached(&path, Limits::default(), &cache).unwrap())
    });
    group.finish();
}

criterion_group!(benches, distribution, orphans, loading);
criterion_main!(benches);
