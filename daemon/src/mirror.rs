//! Copying a running disk to another node (live migration with local storage): what to send
//! and when, apart from the I/O that sends it.
//!
//! The source disk's frontend marks every image block a guest request may write in a
//! [`WriteBitmap`](blkplane_proto::write_bitmap::WriteBitmap) that blkplaned made and maps too:
//! when it hands the request to its iothread (before the write can complete) and again when
//! it reads the request's completion (after the data is in the image). The copy clears a
//! block's bit when it takes the block; a block written while or after it was read is marked
//! again by the completion, so it is sent again. One bit covers 4 KiB ([`granularity`]): a
//! guest's small writes re-send what they wrote; a disk over 512 GiB gets coarser bits, so
//! that the bitmap stays within 16 MiB.
//!
//! - [`extents`]: the ranges a pass sends (allocated extents, marked blocks), in chunks.
//! - [`pace`]: the bandwidth limit, the dirty rate, when the copy has converged, and
//!   auto-converge's write limit.
//! - [`image`]: reading the source image (O_DIRECT where the file system allows it: the same
//!   view the frontend's own writes have) and writing the destination's.
//! - [`source`]: the copy job on the source node, driving the others.
//! - [`sink`]: the destination node's side of the stream.

pub mod extents;
pub mod image;
pub mod pace;
pub mod sink;
pub mod source;

/// The finest granularity of the write bitmap: 4 KiB, the guest's page and the block most
/// file systems write, so that a guest's small random writes re-send what they wrote and not
/// sixteen times as much (at 64 KiB, a guest writing 4 KiB blocks at random at 20 MiB/s
/// dirties 320 MiB/s of image, which no copy converges on).
pub const MIN_GRANULARITY: u64 = blkplane_proto::write_bitmap::MIN_GRANULARITY;

/// The most bits a write bitmap has: 2^27, 16 MiB of bitmap (shared by the frontend and
/// blkplaned) and 2 million words a pass looks at; reached at 512 GiB with 4 KiB blocks.
pub const MAX_BITS: u64 = 1 << 27;

/// Bytes of image per bit of a disk of `capacity` bytes: [`MIN_GRANULARITY`], or the power of
/// two that keeps the bitmap within [`MAX_BITS`] for a larger disk.
pub fn granularity(capacity: u64) -> u64 {
    capacity
        .div_ceil(MAX_BITS)
        .next_power_of_two()
        .max(MIN_GRANULARITY)
}

/// The largest range one message carries.
pub const CHUNK: u64 = 1 << 20;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn granularity_is_4k_up_to_512g_then_grows() {
        assert_eq!(granularity(1 << 20), 4096);
        assert_eq!(granularity(512 << 30), 4096);
        assert_eq!(granularity((512 << 30) + 1), 8192);
        assert_eq!(granularity(4 << 40), 32768);
        assert!(granularity(u64::MAX) <= 1 << 37);
    }
}
