//! The `qcow2_image` harness with the requests that allocate: writes into clusters the image
//! does not own yet (`allocating_write`), write-zeroes with and without unmap, discard. Not in
//! `fuzz/run.sh`'s list: imago 0.2.6's allocator recurses until the stack overflows on some
//! corrupt refcount structures (docs/fuzzing.md, Findings); run it by hand once imago is fixed
//! or to look for more.

#![no_main]

/// Whether the requests include those that allocate clusters.
const ALLOCATE: bool = true;

include!("qcow2/harness.rs");
