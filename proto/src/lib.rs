//! Wire formats between blkplane's processes.
//!
//! - [`ring`]: the shared-memory batch ring a frontend and one iothread exchange requests on.
//! - [`control`]: the control messages (setup, memory table, shutdown) on the socket between
//!   them.
//!
//! The gRPC API of `blkplaned` will live under `proto/blkplane/v1/` beside this crate.

pub mod control;
pub mod ring;
