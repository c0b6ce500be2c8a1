//! Generates the prost types of `proto/lockstep/plan/v1` without a system
//! `protoc` (protox).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = std::path::PathBuf::from(
        std::env::var_os("CARGO_MANIFEST_DIR").ok_or("CARGO_MANIFEST_DIR is not set")?,
    )
    .join("../../proto");
    let file = root.join("lockstep/plan/v1/plan.proto");
    println!("cargo:rerun-if-changed={}", file.display());
    let fds = protox::compile([&file], [&root])?;
    prost_build::Config::new().compile_fds(fds)?;
    Ok(())
}
