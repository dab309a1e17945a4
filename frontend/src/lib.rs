//! blkplane-frontend as a library: the per-disk vhost-user-blk endpoint's parts, used by
//! its binary (src/main.rs) and by the fuzz targets in fuzz/.

#![warn(missing_docs)]

pub mod admin;
pub mod backend_channel;
pub mod config;
pub mod dirty_log;
pub mod image;
pub mod inflight;
pub mod iothread;
pub mod lifecycle;
pub mod memory;
pub mod request;
pub mod resize;
pub mod session;
pub mod socket_lock;
pub mod spawner;
pub mod stats;
pub mod throttle;
pub mod vhost_user;
pub mod worker;
