//! Generates the gRPC service `blkplane.v1.Control` (client and server) and its messages from
//! `proto/blkplane/v1/control.proto` with tonic-prost-build, into `OUT_DIR/blkplane.v1.rs`,
//! and the file descriptor set that server reflection serves.
//!
//! The `.proto` files are parsed by protox, a protobuf compiler in Rust, so that building needs
//! no system `protoc`; its file descriptor set (with the imported file and source info, as
//! `protoc --include_imports --include_source_info` writes it) is both the input of the code
//! generator and what reflection serves.
//!
//! The messages of `frontend.proto` (imported by control.proto for QueueStats, QueueStatus,
//! LatencyHistogram, ResizeDone) are generated once, in `blkplane-proto`; here each of them is
//! mapped to `::blkplane_proto::v1::NAME` with `extern_path`, so one Rust type exists per
//! message and the admin channel's answers can be returned over gRPC as they are.

use std::path::PathBuf;

use prost::Message as _;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?)
        .parent()
        .ok_or("api/ has no parent")?
        .join("proto");
    let control = root.join("blkplane/v1/control.proto");
    let frontend = root.join("blkplane/v1/frontend.proto");
    println!("cargo:rerun-if-changed={}", control.display());
    println!("cargo:rerun-if-changed={}", frontend.display());

    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    let descriptors = protox::Compiler::new([&root])?
        .include_imports(true)
        .include_source_info(true)
        .open_files([&control])?
        .file_descriptor_set();
    std::fs::write(
        out.join("blkplane_descriptor.bin"),
        descriptors.encode_to_vec(),
    )?;
    let mut builder = tonic_prost_build::configure()
        .build_client(true)
        .build_server(true);
    // Every top-level message of frontend.proto (nested types go with their parent). Read
    // from the file so that a message added there is mapped without touching this script.
    let text = std::fs::read_to_string(&frontend)?;
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("message ") {
            let name: String = rest
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            builder = builder.extern_path(
                format!(".blkplane.v1.{name}"),
                format!("::blkplane_proto::v1::{name}"),
            );
        }
    }
    builder.compile_fds(descriptors)?;
    Ok(())
}
