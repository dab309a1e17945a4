//! The gRPC API of blkplaned: the service `blkplane.v1.Control` of
//! `proto/blkplane/v1/control.proto`, generated (client and server), and the words both sides
//! print for its enums and fields. blkplaned (`blkplane-daemon`) serves it; blkplanectl
//! (`blkplane-cli`) depends on this crate alone, not on the daemon.
//!
//! | module | what |
//! |---|---|
//! | [`pb`] | the generated service and messages, and the descriptor set reflection serves |
//! | [`endpoint`] | `HOST:PORT` of a blkplaned reached over TCP, and its TLS channel |
//! | [`names`] | lower-case names of disk states, event kinds, image formats and migration-blocker reasons |
//! | [`limits`] | the fields of `ThrottleLimits` by QEMU's names |
//! | [`settings`] | the optional `settings` of AddDiskRequest and DiskConfig, filled in or read |
//! | [`time`] | wall-clock times as the API carries them (Unix milliseconds) and prints them |

#![warn(missing_docs)]

pub mod endpoint;
pub mod limits;
pub mod names;
pub mod settings;
pub mod time;

/// gRPC service and messages of `blkplane/v1/control.proto` (package `blkplane.v1`). The
/// messages it shares with `frontend.proto` (QueueStats, QueueStatus, LatencyHistogram,
/// ResizeDone) are the types of [`blkplane_proto::v1`].
#[allow(missing_docs, clippy::all)]
pub mod pb {
    include!(concat!(env!("OUT_DIR"), "/blkplane.v1.rs"));

    /// The encoded `FileDescriptorSet` of control.proto and its imports, for server reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] =
        include_bytes!(concat!(env!("OUT_DIR"), "/blkplane_descriptor.bin"));
}
