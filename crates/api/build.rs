//! Generates the gRPC service of `proto/lockstep/environment/v1` without a
//! system `protoc`: protox compiles the file, tonic-prost-build generates
//! from the descriptor set.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = std::path::PathBuf::from(
        std::env::var_os("CARGO_MANIFEST_DIR").ok_or("CARGO_MANIFEST_DIR is not set")?,
    )
    .join("../../proto");
    let file = root.join("lockstep/environment/v1/environment.proto");
    println!("cargo:rerun-if-changed={}", file.display());
    let fds = protox::compile([&file], [&root])?;
    println!(
        "cargo:rerun-if-changed={}",
        root.join("lockstep/compute/v1/compute.proto").display()
    );
    // The descriptor set, for server reflection.
    let out = std::path::PathBuf::from(std::env::var_os("OUT_DIR").ok_or("OUT_DIR is not set")?);
    std::fs::write(
        out.join("environment_descriptor.bin"),
        prost::Message::encode_to_vec(&fds),
    )?;
    tonic_prost_build::configure()
        .btree_map(".")
        // The compute protocol's types are lockstep-protocol's.
        .extern_path(".lockstep.compute.v1", "::lockstep_protocol::proto")
        .compile_fds(fds)?;
    Ok(())
}
