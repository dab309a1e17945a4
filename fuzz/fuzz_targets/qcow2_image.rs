//! A qcow2 image file as hostile input: the input is the whole image file. First the frontend's
//! read-only look at it (`blkplane_chain::probe`, then `blkplane_chain::open`: imago's header
//! parse, the backing file name and format, the chain rules), then the iothread's
//! `Qcow2Image::open` of it, read-write, and requests on it as the engine runs them
//! (`engine/chain.rs`'s `next_extent`, `zero_or_discard`, `flush_metadata`): reads and writes
//! extent by extent — `map`, then data moved with `pread`/`pwrite` at the mapped offset of the
//! layer's fd, zeros filled without I/O, compressed clusters through `read_through`, writes into
//! clusters the image does not own yet through `allocating_write` — write-zeroes (with and
//! without unmap), discard, the metadata write-back; then the iothread is "restarted": the image
//! it left behind is opened again and read.
//!
//! The image's metadata decides what happens; the requests are a fixed set, as the engine's
//! request parser would let them through (inside the virtual size): a walk over the first MiB,
//! and reads, writes and ranges at the image's first clusters, at cluster boundaries, in the
//! middle and at the last byte. Every result may be an error; nothing may panic, overflow,
//! hang or allocate without bound. Beyond that the target checks what the engine relies on:
//! an extent is never longer than asked and never empty inside the image, a data extent's end
//! does not overflow, `map` past the end fails, `allocating_write` hands its closure and
//! reports no more than it mapped, and the frontend and the iothread agree on the virtual size.
//!
//! Backing files: a fuzzed header may name any file. The frontend's `open` gets an empty
//! directory as its only image directory, so no name can reach a file of the host (only that
//! directory itself resolves inside it). The iothread gets backing files only as fds: an image
//! that names one is opened with a fixed backing file instead — a raw one for an input of even
//! length, a small qcow2 image (compressed and plain clusters, `seeds/qcow2_image/
//! compressed_512.qcow2`) for an odd one — as the frontend would hand them over.
//!
//! Input format: the image file itself (the seeds are `qemu-img` images, see
//! docs/fuzzing.md).

//!
//! This target (run by `fuzz/run.sh` and CI) leaves out every request that allocates —
//! writes into clusters the image does not own, write-zeroes, discard: imago 0.2.6's cluster
//! allocator recurses without end on some corrupt refcount structures (docs/fuzzing.md,
//! Findings), which `qcow2_allocation` (the same harness with them) still finds.

#![no_main]

/// Whether the requests include those that allocate clusters.
const ALLOCATE: bool = false;

include!("qcow2/harness.rs");
