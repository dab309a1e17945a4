//! Generates the protobuf messages of `blkplane/v1/frontend.proto` (the admin channel between
//! blkplaned and a frontend) into `OUT_DIR/blkplane.v1.rs`, included by `src/lib.rs` as `v1`.
//!
//! Only messages are generated here (no gRPC service code), so the frontend, which links this
//! crate, does not pull in tonic. The `.proto` file is parsed by protox, a protobuf compiler in
//! Rust, so that building needs no system `protoc`: its file descriptor set goes to prost-build
//! as `protoc` output would.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "blkplane/v1/frontend.proto";
    println!("cargo:rerun-if-changed={proto}");
    let descriptors = protox::compile([proto], ["."])?;
    prost_build::Config::new().compile_fds(descriptors)?;
    Ok(())
}
