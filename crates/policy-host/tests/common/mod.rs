//! Paths of the built policies; a missing file fails the test with what to run.

#![allow(dead_code)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use lockstep_policy::{CatalogView, CommandClass, CommandInfo, Service};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .unwrap()
        .to_path_buf()
}

fn existing(path: PathBuf) -> PathBuf {
    assert!(
        path.exists(),
        "{} is missing: run `cargo xtask build-policies` first (`cargo xtask test` does)",
        path.display()
    );
    path
}

/// A shipped policy: target/lockstep/policies/NAME.wasm.
pub fn shipped(name: &str) -> PathBuf {
    existing(lockstep_policy_host::shipped_policy(name))
}

/// A hostile test policy: target/lockstep/test-policies/NAME.wasm.
pub fn hostile(name: &str) -> PathBuf {
    existing(root().join(format!("target/lockstep/test-policies/{name}.wasm")))
}

pub const CLASSES: [CommandClass; 12] = CommandClass::ALL;

pub fn command(class: CommandClass) -> CommandInfo {
    CommandInfo {
        class,
        size_bytes: 100,
        dataflow_id: Some(7),
        process_count: 2,
        workers_per_process: 2,
        reconciling: false,
    }
}

pub fn svc(id: u64, epoch: u64) -> Service {
    Service {
        id,
        name: format!("replica-{id}"),
        epoch,
        labels: BTreeMap::from([("lockstep.io/kind".to_string(), "replica".to_string())]),
    }
}

pub fn view(keep: &[u64], our_epoch: u64, next_id: u64) -> CatalogView {
    CatalogView {
        keep: keep.iter().copied().collect::<BTreeSet<_>>(),
        our_epoch,
        next_id,
    }
}
