//! blkplane-iothread as a library: the io_uring engine and the parsing of the frontend's
//! ring, used by its binary (src/main.rs) and by the fuzz targets in fuzz/.

#![warn(missing_docs)]

pub mod engine;
pub mod image;
pub mod memory;
pub mod request;
pub mod slot;
