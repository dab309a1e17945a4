//! Generates the protobuf messages of `blkplane/v1/frontend.proto` (the admin channel between
//! blkplaned and a frontend) into `OUT_DIR/blkplane.v1.rs`, included by `src/lib.rs` as `v1`.
//!
//! Only messages are generated here (no gRPC service code), so the frontend, which links this
//! crate, does not pull in tonic. protoc comes from the system (Debian: `protobuf-compiler`) or
//! from the `PROTOC` environment variable, as prost-build looks it up.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "blkplane/v1/frontend.proto";
    println!("cargo:rerun-if-changed={proto}");
    println!("cargo:rerun-if-env-changed=PROTOC");
    prost_build::Config::new().compile_protos(&[proto], &["."])?;
    Ok(())
}
