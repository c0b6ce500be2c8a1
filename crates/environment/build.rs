//! Generates the gRPC service of `proto/lockstep/environment/v1` without a
//! system `protoc`: protox compiles the file, tonic-prost-build generates
//! from the descriptor set.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../proto");
    let file = root.join("lockstep/environment/v1/environment.proto");
    println!("cargo:rerun-if-changed={}", file.display());
    let fds = protox::compile([&file], [&root])?;
    tonic_prost_build::configure()
        .btree_map(".")
        .compile_fds(fds)?;
    Ok(())
}
