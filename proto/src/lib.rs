//! Wire formats between blkplane's processes.
//!
//! - [`ring`]: the shared-memory batch ring a frontend and one iothread exchange requests on.
//! - [`cpus`]: CPU lists (`0-1,3`) as the API and the command lines take them.
//! - [`shm`]: sealed memfds and shared mappings, the ground both of the above stand on.
//! - [`control`]: the control messages (setup, memory table, shutdown) on the socket between
//!   them.
//! - [`v1`]: the protobuf messages of `blkplane/v1/frontend.proto`, the admin channel between
//!   `blkplaned` and a frontend (status, statistics, resize). The gRPC API of `blkplaned`
//!   (`blkplane/v1/control.proto`) is generated in the `blkplane-control` crate and reuses
//!   these messages.

pub mod control;
pub mod cpus;
pub mod ring;
pub mod shm;
pub mod throttle;

/// Protobuf messages of package `blkplane.v1` generated from `blkplane/v1/frontend.proto`.
#[allow(missing_docs, clippy::all)]
pub mod v1 {
    include!(concat!(env!("OUT_DIR"), "/blkplane.v1.rs"));
}
