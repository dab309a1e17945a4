//! The blocks of a disk image the guest writes, while blkplaned copies the image to another
//! node (a live migration with local storage).
//!
//! blkplaned copies a running disk in passes: everything once, then the blocks written
//! meanwhile, again and again, and the last ones once the VM stopped. It learns which blocks
//! were written from this bitmap, in a memfd blkplaned creates ([`WriteBitmap::create`]) and
//! hands to the disk's frontend, which maps it ([`WriteBitmap::open`]): one bit per
//! `granularity` bytes of image, bit `b % 64` of the native-endian u64 word `b / 64`, every
//! word only ever accessed as an [`AtomicU64`].
//!
//! The frontend sets the bits of every block a write, write-zeroes or discard may change
//! ([`WriteBitmap::mark`], an atomic OR) *before* the request goes to an iothread, and again
//! when its completion is read; blkplaned's copy clears a word ([`WriteBitmap::take_word`], an
//! atomic swap with 0) before it reads the blocks it names. A bit is set from before the write
//! starts until the copy has taken it after the write ended, so the copy of a block it took
//! while the write was in flight is redone: the completion's mark sets it again.
//!
//! The file comes from another process and is not trusted: its length is checked against the
//! capacity, it must be sealed against shrinking (a shrunk file would turn accesses into
//! SIGBUS), and no bit beyond [`WriteBitmap::blocks`] is ever stored.

use std::ffi::CStr;
use std::fs::File;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::shm::{is_sealed_against_shrinking, sealed_memfd, SharedMapping};

/// QEMU's mirror job's default granularity, a common choice for tests and tools (blkplaned
/// picks one by the disk's size, 4 KiB per bit up to 512 GiB).
pub const DEFAULT_GRANULARITY: u64 = 64 * 1024;
/// The smallest granularity: a page, the smallest block any disk has.
pub const MIN_GRANULARITY: u64 = 4 * 1024;
/// The largest granularity.
pub const MAX_GRANULARITY: u64 = 64 * 1024 * 1024;

/// Bits per word of the bitmap.
const WORD_BITS: u64 = u64::BITS as u64;

/// The memfd's name (seen in /proc/PID/fd).
const MEMFD_NAME: &CStr = c"blkplane-write-bitmap";

/// Why a bitmap cannot be made or used.
#[derive(Debug, thiserror::Error)]
pub enum WriteBitmapError {
    /// The granularity is not a power of two in [`MIN_GRANULARITY`]..=[`MAX_GRANULARITY`].
    #[error(
        "write-bitmap granularity {0} is not a power of two from {MIN_GRANULARITY} to \
         {MAX_GRANULARITY} bytes"
    )]
    Granularity(u64),
    /// A disk of no bytes has no block to track.
    #[error("a write bitmap of a disk of 0 bytes")]
    EmptyDisk,
    /// The bitmap of this capacity would not fit the address space.
    #[error("the write bitmap of a {0}-byte disk is too large")]
    Overflow(u64),
    /// The file is shorter than the bitmap: touching its end would raise SIGBUS.
    #[error("the write bitmap needs {needed} bytes but its file has {file_len}")]
    FileTooShort {
        /// The bitmap's length in bytes.
        needed: u64,
        /// The file's length.
        file_len: u64,
    },
    /// The file is not sealed against shrinking: whoever else holds it could truncate it
    /// under the mapping.
    #[error("the write bitmap's file is not sealed against shrinking")]
    NotSealed,
    /// memfd_create, fstat or mmap failed.
    #[error("write bitmap: {0}")]
    Os(#[from] std::io::Error),
}

/// A mapped bitmap of written image blocks (see the module documentation).
#[derive(Debug)]
pub struct WriteBitmap {
    mapping: SharedMapping,
    file: File,
    /// The disk's capacity the bitmap was made for, in bytes.
    capacity_bytes: u64,
    /// log2 of the granularity.
    shift: u32,
    /// Bits in use: the capacity in granules, rounded up.
    blocks: u64,
    /// u64 words of the bitmap (`blocks` / 64, rounded up).
    words: usize,
}

/// The granularity's log2, if it is allowed.
fn granularity_shift(granularity: u64) -> Result<u32, WriteBitmapError> {
    if granularity.is_power_of_two() && (MIN_GRANULARITY..=MAX_GRANULARITY).contains(&granularity) {
        Ok(granularity.trailing_zeros())
    } else {
        Err(WriteBitmapError::Granularity(granularity))
    }
}

/// The blocks, words and bytes of the bitmap of `capacity_bytes` at granularity `1 << shift`.
fn geometry(capacity_bytes: u64, shift: u32) -> Result<(u64, usize, u64), WriteBitmapError> {
    if capacity_bytes == 0 {
        return Err(WriteBitmapError::EmptyDisk);
    }
    let mask = 1u64
        .checked_shl(shift)
        .map_or(u64::MAX, |g| g.saturating_sub(1));
    let partial = u64::from(capacity_bytes & mask != 0);
    let blocks = capacity_bytes
        .checked_shr(shift)
        .unwrap_or(0)
        .saturating_add(partial);
    let words = blocks.div_ceil(WORD_BITS);
    let overflow = WriteBitmapError::Overflow(capacity_bytes);
    let bytes = words.checked_mul(8).ok_or(overflow)?;
    // The mapping's length is a usize and an off_t.
    let words = usize::try_from(words)
        .ok()
        .filter(|_| i64::try_from(bytes).is_ok())
        .ok_or(WriteBitmapError::Overflow(capacity_bytes))?;
    Ok((blocks, words, bytes))
}

impl WriteBitmap {
    /// A new, clear bitmap of a disk of `capacity_bytes` (blkplaned's side): a sealed memfd
    /// of [`WriteBitmap::words`] × 8 zero bytes, mapped.
    pub fn create(capacity_bytes: u64, granularity: u64) -> Result<WriteBitmap, WriteBitmapError> {
        let shift = granularity_shift(granularity)?;
        let (blocks, words, bytes) = geometry(capacity_bytes, shift)?;
        let file = sealed_memfd(MEMFD_NAME, bytes)?;
        let mapping = SharedMapping::new(&file, bytes, 0)?;
        Ok(Self {
            mapping,
            file,
            capacity_bytes,
            shift,
            blocks,
            words,
        })
    }

    /// Maps the bitmap another process made of a disk of `capacity_bytes` (the frontend's
    /// side). The file is checked, not trusted: long enough for the capacity, sealed against
    /// shrinking.
    pub fn open(
        file: File,
        capacity_bytes: u64,
        granularity: u64,
    ) -> Result<WriteBitmap, WriteBitmapError> {
        let shift = granularity_shift(granularity)?;
        let (blocks, words, bytes) = geometry(capacity_bytes, shift)?;
        let file_len = file.metadata()?.len();
        if file_len < bytes {
            return Err(WriteBitmapError::FileTooShort {
                needed: bytes,
                file_len,
            });
        }
        if !is_sealed_against_shrinking(&file) {
            return Err(WriteBitmapError::NotSealed);
        }
        let mapping = SharedMapping::new(&file, bytes, 0)?;
        Ok(Self {
            mapping,
            file,
            capacity_bytes,
            shift,
            blocks,
            words,
        })
    }

    /// The bitmap's file (to send to the frontend).
    pub fn file(&self) -> &File {
        &self.file
    }

    /// The disk's capacity the bitmap was made for, in bytes.
    pub fn capacity_bytes(&self) -> u64 {
        self.capacity_bytes
    }

    /// Bytes of image per bit.
    pub fn granularity(&self) -> u64 {
        1u64.checked_shl(self.shift).unwrap_or(0)
    }

    /// Bits in use: the capacity in granules, a partial last one included.
    pub fn blocks(&self) -> u64 {
        self.blocks
    }

    /// u64 words of the bitmap.
    pub fn words(&self) -> usize {
        self.words
    }

    /// Word `index`, if it is one of the bitmap's.
    fn word(&self, index: usize) -> Option<&AtomicU64> {
        if index >= self.words {
            return None;
        }
        // SAFETY: index < words and the mapping holds words × 8 bytes (checked against the
        // file when it was made), page aligned, so the word is in bounds and 8-byte aligned;
        // it lives as long as `self`, which the reference borrows. Any bit pattern is a valid
        // u64, and every process accesses the words only atomically.
        Some(unsafe { AtomicU64::from_ptr(self.mapping.as_ptr().cast::<u64>().add(index)) })
    }

    /// Sets the bit of every block `[offset, offset + len)` touches (nothing for `len` 0);
    /// blocks beyond the bitmap are not marked. Atomic ORs, with Release ordering.
    pub fn mark(&self, offset: u64, len: u64) {
        if len == 0 || self.blocks == 0 {
            return;
        }
        let first = offset.checked_shr(self.shift).unwrap_or(0);
        if first >= self.blocks {
            return;
        }
        let last_byte = offset.saturating_add(len.saturating_sub(1));
        let last = last_byte
            .checked_shr(self.shift)
            .unwrap_or(0)
            .min(self.blocks.saturating_sub(1));
        let (first_word, last_word) = (first / WORD_BITS, last / WORD_BITS);
        let mut word = first_word;
        while word <= last_word {
            let low = if word == first_word {
                first % WORD_BITS
            } else {
                0
            };
            let high = if word == last_word {
                last % WORD_BITS
            } else {
                WORD_BITS.saturating_sub(1)
            };
            // low <= high <= 63: neither shift overflows.
            let mask = (u64::MAX << low) & (u64::MAX >> 63u64.saturating_sub(high));
            if let Some(cell) = usize::try_from(word).ok().and_then(|w| self.word(w)) {
                // Release: whatever preceded the mark (the slot it stands for) is visible
                // to whoever takes the bit.
                cell.fetch_or(mask, Ordering::Release);
            }
            word = match word.checked_add(1) {
                Some(next) => next,
                None => break,
            };
        }
    }

    /// Word `index` as it is now, without clearing it (0 if the bitmap has no such word): a
    /// reader that skips clear words this way leaves their cache lines with the marking CPUs.
    pub fn peek_word(&self, index: usize) -> u64 {
        self.word(index)
            .map_or(0, |cell| cell.load(Ordering::Acquire))
    }

    /// Takes word `index`: returns its bits and clears them, in one atomic swap (0 if the
    /// bitmap has no such word). Block `index × 64 + i` was written if bit `i` is set.
    pub fn take_word(&self, index: usize) -> u64 {
        self.word(index)
            .map_or(0, |cell| cell.swap(0, Ordering::AcqRel))
    }

    /// Sets the bit of every block (and of no bit past [`WriteBitmap::blocks`]).
    pub fn mark_all(&self) {
        let full = usize::try_from(self.blocks / WORD_BITS).unwrap_or(self.words);
        for index in 0..full.min(self.words) {
            if let Some(cell) = self.word(index) {
                cell.fetch_or(u64::MAX, Ordering::Release);
            }
        }
        let rest = self.blocks % WORD_BITS;
        if rest != 0 {
            if let Some(cell) = self.word(full) {
                // rest < 64: the shift cannot overflow.
                cell.fetch_or(
                    u64::MAX >> WORD_BITS.saturating_sub(rest),
                    Ordering::Release,
                );
            }
        }
    }

    /// Blocks marked now (relaxed loads: an estimate while marks and takes go on).
    pub fn count(&self) -> u64 {
        (0..self.words)
            .filter_map(|index| self.word(index))
            .map(|cell| u64::from(cell.load(Ordering::Relaxed).count_ones()))
            .fold(0u64, u64::saturating_add)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const G: u64 = DEFAULT_GRANULARITY;

    fn words(bitmap: &WriteBitmap) -> Vec<u64> {
        (0..bitmap.words())
            .map(|i| bitmap.word(i).unwrap().load(Ordering::Relaxed))
            .collect()
    }

    #[test]
    fn geometry_rounds_up_to_whole_blocks_and_words() {
        let b = WriteBitmap::create(G, G).unwrap();
        assert_eq!((b.blocks(), b.words(), b.granularity()), (1, 1, G));
        let b = WriteBitmap::create(64 * G + 1, G).unwrap();
        assert_eq!(
            (b.blocks(), b.words(), b.capacity_bytes()),
            (65, 2, 64 * G + 1)
        );
        assert_eq!(b.file().metadata().unwrap().len(), 16);
        let b = WriteBitmap::create(1 << 40, G).unwrap();
        assert_eq!((b.blocks(), b.words()), (1 << 24, 1 << 18));
        assert_eq!(b.count(), 0);
    }

    #[test]
    fn one_byte_marks_its_block() {
        let b = WriteBitmap::create(128 * G, G).unwrap();
        b.mark(3 * G + 17, 1);
        assert_eq!(words(&b), [1 << 3, 0]);
        // A range ending exactly at a block boundary does not touch the next block.
        b.mark(5 * G, G);
        assert_eq!(words(&b), [(1 << 3) | (1 << 5), 0]);
        b.mark(9 * G, 0);
        assert_eq!(b.count(), 2);
    }

    #[test]
    fn a_range_across_words_marks_each_block_once() {
        let b = WriteBitmap::create(200 * G, G).unwrap();
        assert_eq!(b.words(), 4);
        // The last byte of block 62 to the first byte of block 129.
        b.mark(63 * G - 1, 66 * G + 2);
        assert_eq!(words(&b), [0b11 << 62, u64::MAX, 0b11, 0]);
        assert_eq!(b.count(), 68);
        b.mark(64 * G, 1);
        assert_eq!(b.count(), 68);
    }

    #[test]
    fn marks_are_clamped_to_the_bitmap() {
        // 130 blocks, the last one partial: bits 0..=129, word 2 holds two of them.
        let b = WriteBitmap::create(129 * G + 512, G).unwrap();
        assert_eq!((b.blocks(), b.words()), (130, 3));
        b.mark(128 * G, 10 * G);
        assert_eq!(words(&b), [0, 0, 0b11]);
        b.mark(130 * G, 1);
        b.mark(u64::MAX - 10, 100);
        b.mark(u64::MAX, u64::MAX);
        assert_eq!(words(&b), [0, 0, 0b11]);
        b.mark(0, u64::MAX);
        assert_eq!(words(&b), [u64::MAX, u64::MAX, 0b11]);
        assert_eq!(b.count(), 130);
    }

    #[test]
    fn take_word_clears_what_it_returns() {
        let b = WriteBitmap::create(100 * G, G).unwrap();
        b.mark(G, 1);
        b.mark(70 * G, 1);
        assert_eq!(b.take_word(0), 0b10);
        assert_eq!(b.take_word(0), 0);
        assert_eq!(b.take_word(1), 1 << 6);
        assert_eq!(b.take_word(2), 0, "no such word");
        assert_eq!(b.take_word(usize::MAX), 0);
        assert_eq!(b.count(), 0);
    }

    #[test]
    fn mark_all_sets_every_block_and_nothing_past_them() {
        let b = WriteBitmap::create(70 * G, G).unwrap();
        b.mark_all();
        assert_eq!(words(&b), [u64::MAX, 0b11_1111]);
        assert_eq!(b.count(), 70);
        let b = WriteBitmap::create(128 * G, G).unwrap();
        b.mark_all();
        assert_eq!(words(&b), [u64::MAX, u64::MAX]);
        let b = WriteBitmap::create(1, MIN_GRANULARITY).unwrap();
        b.mark_all();
        assert_eq!(words(&b), [1]);
    }

    #[test]
    fn two_mappings_of_one_memfd_see_each_others_bits() {
        let ours = WriteBitmap::create(100 * G, G).unwrap();
        let theirs = WriteBitmap::open(ours.file().try_clone().unwrap(), 100 * G, G).unwrap();
        theirs.mark(65 * G, 2 * G);
        assert_eq!(ours.count(), 2);
        assert_eq!(ours.take_word(1), 0b110);
        assert_eq!(theirs.count(), 0);
        ours.mark_all();
        assert_eq!(theirs.count(), 100);
    }

    #[test]
    fn marks_racing_with_takes_are_all_taken_once_or_more() {
        let b = std::sync::Arc::new(WriteBitmap::create(4096 * G, G).unwrap());
        let marker = {
            let b = std::sync::Arc::clone(&b);
            std::thread::spawn(move || {
                for block in 0..4096 {
                    b.mark(block * G + 100, 1);
                }
            })
        };
        let mut seen = vec![0u64; b.words()];
        while !marker.is_finished() {
            for (i, acc) in seen.iter_mut().enumerate() {
                *acc |= b.take_word(i);
            }
        }
        marker.join().unwrap();
        for (i, acc) in seen.iter_mut().enumerate() {
            *acc |= b.take_word(i);
        }
        assert!(seen.iter().all(|&w| w == u64::MAX));
        assert_eq!(b.count(), 0);
    }

    #[test]
    fn open_refuses_what_does_not_fit() {
        let small = WriteBitmap::create(64 * G, G).unwrap();
        let file = || small.file().try_clone().unwrap();
        // One word, where 65 blocks need two.
        assert!(matches!(
            WriteBitmap::open(file(), 65 * G, G),
            Err(WriteBitmapError::FileTooShort {
                needed: 16,
                file_len: 8
            })
        ));
        // A finer granularity needs more bits.
        assert!(matches!(
            WriteBitmap::open(file(), 64 * G, MIN_GRANULARITY),
            Err(WriteBitmapError::FileTooShort { .. })
        ));
        for bad in [0, 1, 512, 2048, 3 * 4096, 65 * 1024, 128 << 20, 1 << 63] {
            assert!(
                matches!(
                    WriteBitmap::open(file(), 64 * G, bad),
                    Err(WriteBitmapError::Granularity(g)) if g == bad
                ),
                "granularity {bad}"
            );
        }
        assert!(matches!(
            WriteBitmap::open(file(), 0, G),
            Err(WriteBitmapError::EmptyDisk)
        ));
        assert!(matches!(
            WriteBitmap::open(file(), u64::MAX, MIN_GRANULARITY),
            Err(WriteBitmapError::FileTooShort { .. } | WriteBitmapError::Overflow(_))
        ));
        // A coarser granularity of the same file is fine (a prefix of it is mapped).
        assert!(WriteBitmap::open(file(), 64 * G, 2 * G).is_ok());
        // Not sealed: a temporary regular file of the right size.
        let path = std::env::temp_dir().join(format!("bp-wb-{}", std::process::id()));
        let plain = File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        std::fs::remove_file(&path).unwrap();
        plain.set_len(8).unwrap();
        assert!(matches!(
            WriteBitmap::open(plain, 64 * G, G),
            Err(WriteBitmapError::NotSealed)
        ));
        assert!(matches!(
            WriteBitmap::create(64 * G, 3 * 4096),
            Err(WriteBitmapError::Granularity(_))
        ));
    }

    #[test]
    fn the_largest_capacities_do_not_overflow() {
        // u64::MAX bytes at 64 MiB granules: 2^38 blocks, 2^32 words, 32 GiB of sparse memfd
        // — not created here; the geometry alone is checked.
        let shift = granularity_shift(MAX_GRANULARITY).unwrap();
        let (blocks, words, bytes) = geometry(u64::MAX, shift).unwrap();
        assert_eq!(blocks, 1 << 38);
        assert_eq!(words, 1 << 32);
        assert_eq!(bytes, 1 << 35);
        let shift = granularity_shift(MIN_GRANULARITY).unwrap();
        let (blocks, _, bytes) = geometry(u64::MAX, shift).unwrap();
        assert_eq!((blocks, bytes), (1 << 52, 1 << 49));
    }
}
