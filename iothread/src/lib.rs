//! blkplane-iothread as a library: the io_uring engine and the parsing of the frontend's
//! ring, used by its binary (src/main.rs) and by the fuzz targets in fuzz/.

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

pub mod engine;
pub mod image;
pub mod memory;
pub mod metadata_file;
pub mod qcow2;
pub mod request;
pub mod slot;
pub mod vring;
