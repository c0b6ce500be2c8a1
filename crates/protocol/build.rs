//! Generates the prost types of `proto/` without a system `protoc` (protox).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = std::path::PathBuf::from(
        std::env::var_os("CARGO_MANIFEST_DIR").ok_or("CARGO_MANIFEST_DIR is not set")?,
    )
    .join("../../proto");
    let file = root.join("lockstep/compute/v1/compute.proto");
    println!("cargo:rerun-if-changed={}", file.display());
    let fds = protox::compile([&file], [&root])?;
    let mut config = prost_build::Config::new();
    // BTreeMap keeps the encoding of maps deterministic, which the history hash needs.
    config.btree_map(["."]);
    config.compile_fds(fds)?;
    Ok(())
}
