//! The component cache: a restart deserializes instead of compiling, and a
//! bad entry only costs a recompile.

mod common;

use common::*;
use lockstep_policy::{CommandClass, DistributionPolicy, OrphanDecision, OrphanPolicy, Strategy};
use lockstep_policy_host::{ComponentCache, Limits, WasmDistributionPolicy, WasmOrphanPolicy};

#[test]
fn a_second_load_comes_from_the_cache() {
    let dir = tempfile::tempdir().unwrap();
    let cache = ComponentCache::new(dir.path().join("cache"));
    let path = shipped("barrier");
    let entry = cache.path_for(&std::fs::read(&path).unwrap());
    assert!(!entry.exists());

    let mut p = WasmDistributionPolicy::load_cached(&path, Limits::default(), &cache).unwrap();
    assert_eq!((cache.hits(), cache.writes()), (0, 1));
    assert!(entry.exists(), "{} written", entry.display());
    assert_eq!(
        p.choose(&command(CommandClass::Hello)).unwrap(),
        Strategy::Barrier
    );

    // A "restart": a new cache object over the same directory.
    let cache = ComponentCache::new(dir.path().join("cache"));
    let mut p = WasmDistributionPolicy::load_cached(&path, Limits::default(), &cache).unwrap();
    assert_eq!((cache.hits(), cache.writes()), (1, 0));
    assert_eq!(
        p.choose(&command(CommandClass::CreateDataflow)).unwrap(),
        Strategy::Barrier
    );
}

#[test]
fn entries_are_keyed_by_the_component_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let cache = ComponentCache::new(dir.path());
    let a = cache.path_for(&std::fs::read(shipped("epoch")).unwrap());
    let b = cache.path_for(&std::fs::read(shipped("id-watermark")).unwrap());
    assert_ne!(a, b);
    let mut epoch =
        WasmOrphanPolicy::load_cached(shipped("epoch"), Limits::default(), &cache).unwrap();
    let mut mark =
        WasmOrphanPolicy::load_cached(shipped("id-watermark"), Limits::default(), &cache).unwrap();
    assert_eq!(cache.writes(), 2);
    // Each got its own code: they decide differently.
    let services = [svc(9, 1)];
    assert_eq!(
        epoch.classify(&services, &view(&[], 2, 5)).unwrap(),
        OrphanDecision::Delete(vec![9])
    );
    assert!(matches!(
        mark.classify(&services, &view(&[], 2, 5)).unwrap(),
        OrphanDecision::Halt(_)
    ));
}

#[test]
fn a_corrupt_entry_is_ignored_and_rewritten() {
    let dir = tempfile::tempdir().unwrap();
    let cache = ComponentCache::new(dir.path());
    let path = shipped("log");
    let entry = cache.path_for(&std::fs::read(&path).unwrap());
    WasmDistributionPolicy::load_cached(&path, Limits::default(), &cache).unwrap();
    let good = std::fs::read(&entry).unwrap();

    // Flip a byte of the code, and separately truncate.
    let mut bad = good.clone();
    let last = bad.len() - 1;
    bad[last] ^= 0xff;
    for corrupt in [bad, good[..good.len() / 2].to_vec(), vec![]] {
        std::fs::write(&entry, &corrupt).unwrap();
        let cache = ComponentCache::new(dir.path());
        let mut p = WasmDistributionPolicy::load_cached(&path, Limits::default(), &cache).unwrap();
        assert_eq!((cache.hits(), cache.writes()), (0, 1));
        assert_eq!(
            p.choose(&command(CommandClass::Hello)).unwrap(),
            Strategy::Log
        );
        assert_eq!(std::fs::read(&entry).unwrap(), good);
    }
}

#[test]
fn an_unwritable_cache_only_costs_time() {
    let dir = tempfile::tempdir().unwrap();
    // The cache "directory" is a file: nothing can be written under it.
    let file = dir.path().join("not-a-dir");
    std::fs::write(&file, "x").unwrap();
    let cache = ComponentCache::new(&file);
    let mut p =
        WasmDistributionPolicy::load_cached(shipped("broadcast"), Limits::default(), &cache)
            .unwrap();
    assert_eq!(cache.writes(), 0);
    assert_eq!(
        p.choose(&command(CommandClass::Hello)).unwrap(),
        Strategy::Broadcast
    );
}
