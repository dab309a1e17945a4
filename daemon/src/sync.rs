//! The daemon takes its locks the blkplane way (`blkplane_lock`): poisoning ignored, because
//! what it keeps behind its mutexes (the disk table, a disk's runtime state) is plain data
//! that every holder leaves consistent, and a panicked API task must not wedge the whole node.

pub use blkplane_lock::lock;
