//! blkplane-frontend as a library: the per-disk vhost-user-blk endpoint's parts, used by
//! its binary (src/main.rs) and by the fuzz targets in fuzz/.

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
#![warn(missing_docs)]

pub mod admin;
pub mod backend_channel;
pub mod config;
pub mod image;
pub mod iothread;
pub mod lifecycle;
pub mod memory;
pub mod queue_core;
pub mod rejection;
pub mod request;
pub mod resize;
pub mod session;
pub mod socket_lock;
pub mod spawner;
pub mod stats;
pub mod throttle;
pub mod throttle_control;
pub mod vhost_user;
pub mod worker;
pub mod write_tracking;
