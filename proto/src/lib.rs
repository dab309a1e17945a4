//! Wire formats between blkplane's processes.
//!
//! - [`ring`]: the shared-memory batch ring a frontend and one iothread exchange requests on.
//! - [`cpus`]: CPU lists (`0-1,3`) as the API and the command lines take them.
//! - [`shm`]: sealed memfds and shared mappings, the ground both of the above stand on.
//! - [`control`]: the control messages (setup, memory table, virtqueues, dirty log, shutdown)
//!   on the socket between them.
//! - [`inflight`]: the inflight region (INFLIGHT_SHMFD) the frontend marks requests in and the
//!   iothread clears them from as it puts them on the used ring.
//! - [`dirty_log`]: a live migration's dirty-page bitmap, marked by both processes.
//! - [`write_bitmap`]: the image blocks the guest writes while blkplaned copies a disk to
//!   another node, set by the frontend and taken by blkplaned's copy.
//! - [`clock`]: the monotonic clock both processes stamp requests with.
//! - [`v1`]: the protobuf messages of `blkplane/v1/frontend.proto`, the admin channel between
//!   `blkplaned` and a frontend (status, statistics, resize). The gRPC API of `blkplaned`
//!   (`blkplane/v1/control.proto`) is generated in the `blkplane-api` crate and reuses
//!   these messages.

// Tests may panic on what they set up themselves.
#![cfg_attr(
    test,
    allow(
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::indexing_slicing,
        clippy::arithmetic_side_effects,
        clippy::cast_possible_truncation
    )
)]

pub mod clock;
pub mod control;
pub mod cpus;
pub mod dirty_log;
pub mod inflight;
pub mod ring;
pub mod shm;
pub mod write_bitmap;

/// Protobuf messages of package `blkplane.v1` generated from `blkplane/v1/frontend.proto`.
#[allow(missing_docs, clippy::all)]
pub mod v1 {
    include!(concat!(env!("OUT_DIR"), "/blkplane.v1.rs"));
}

// blkplane runs on 64-bit Linux only: u64 file offsets, lengths and guest addresses fit a usize.
const _: () = assert!(usize::BITS == u64::BITS, "blkplane needs a 64-bit target");

/// `value` as a `usize`, losslessly: the crate builds only for 64-bit targets (asserted above),
/// so offsets and lengths of shared mappings and guest memory convert without a check.
#[inline]
#[allow(
    clippy::cast_possible_truncation,
    reason = "usize is 64 bits wide (asserted at compile time)"
)]
pub const fn usize_from(value: u64) -> usize {
    value as usize
}
