//! What the wire-compatibility tests (`golden.rs`) share:
//! where a release's golden files are, today's `proto/` compiled with
//! protox, and a release's recorded descriptors.

use std::path::PathBuf;

/// The golden files of `release`, under `crates/protocol/golden/`.
pub fn golden_dir(release: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("golden")
        .join(release)
}

/// A protox compiler with today's `proto/` open: the compute and
/// environment APIs and the built-in plan family, imports included, no
/// source info.
pub fn todays_compiler() -> protox::Compiler {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../proto");
    let mut compiler = protox::Compiler::new([&root]).expect("proto root");
    compiler.include_imports(true).include_source_info(false);
    compiler
        .open_files([
            "lockstep/compute/v1/compute.proto",
            "lockstep/environment/v1/environment.proto",
            "lockstep/plan/v1/plan.proto",
        ])
        .expect("proto/ compiles");
    compiler
}

/// The encoded `FileDescriptorSet` recorded for `release`
/// (`descriptors.binpb`).
pub fn release_descriptor_bytes(release: &str) -> Vec<u8> {
    let path = golden_dir(release).join("descriptors.binpb");
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}
