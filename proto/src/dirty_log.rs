//! The dirty log of a live migration (VHOST_USER_PROTOCOL_F_LOG_SHMFD, VHOST_F_LOG_ALL).
//!
//! While the VMM migrates the guest it copies guest memory to the destination and copies
//! again every page written since; pages written by the VMM's own vCPUs it tracks itself,
//! pages written by a vhost-user back-end it learns from this log: a bitmap in shared memory
//! the VMM hands over with SET_LOG_BASE, one bit per 4 KiB page of guest-physical memory,
//! bit `page % 8` of byte `page / 8`. The VMM reads and clears it with atomic exchanges, so a
//! bit is only ever set here, with an atomic OR, and only *after* the write it stands for —
//! set before, a sync between the mark and the write would clear it and the write would never
//! be copied. blkplane writes guest memory in four places: read data, status bytes and the used
//! ring are written and marked by the iothread that completes the request (before it publishes
//! the used index), GET_ID strings and the avail-event and notification flags by the frontend
//! worker. Both processes map the same log and mark it with atomic ORs.
//!
//! The log's contents and size come from the VMM and are not trusted: a page beyond the
//! bitmap is not marked (and counted), never an out-of-bounds store.

use std::fs::File;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};

use crate::shm::SharedMapping;

/// Bytes of guest memory per bit of the log (VHOST_LOG_PAGE in the vhost-user spec and in
/// Linux's vhost; no rust-vmm crate exports it).
pub const LOG_PAGE_SIZE: u64 = 0x1000;

/// Why a log the VMM sent cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum DirtyLogError {
    /// SET_LOG_BASE gave an empty log.
    #[error("the dirty log is empty (mmap_size 0)")]
    Empty,
    /// mmap_offset + mmap_size overflows or does not fit the address space.
    #[error("dirty log offset {offset:#x} + size {size:#x} overflows")]
    Overflow {
        /// mmap_offset.
        offset: u64,
        /// mmap_size.
        size: u64,
    },
    /// The file is shorter than offset + size: touching the end would raise SIGBUS.
    #[error("dirty log needs {needed} bytes but its file has {file_len}")]
    PastEndOfFile {
        /// mmap_offset + mmap_size.
        needed: u64,
        /// The file's length.
        file_len: u64,
    },
    /// fstat or mmap failed.
    #[error("cannot map the dirty log: {0}")]
    Map(#[from] std::io::Error),
}

/// A mapped dirty log.
#[derive(Debug)]
pub struct DirtyLog {
    mapping: SharedMapping,
    /// The file, kept to hand to the iothreads.
    file: File,
    /// Where the bitmap starts in the mapping (the VMM's mmap_offset).
    offset: usize,
    /// Bitmap length in bytes (the VMM's mmap_size).
    len: usize,
    /// Pages that could not be marked because they lie beyond the bitmap.
    unmarked: AtomicU64,
}

impl DirtyLog {
    /// Maps the log of SET_LOG_BASE: `size` bytes of bitmap at `offset` in `file`.
    pub fn new(file: &File, size: u64, offset: u64) -> Result<Self, DirtyLogError> {
        if size == 0 {
            return Err(DirtyLogError::Empty);
        }
        let overflow = DirtyLogError::Overflow { offset, size };
        let needed = offset.checked_add(size).ok_or(overflow)?;
        let as_usize =
            |v: u64| usize::try_from(v).map_err(|_| DirtyLogError::Overflow { offset, size });
        let (offset_bytes, len) = (as_usize(offset)?, as_usize(size)?);
        as_usize(needed)?;
        let file_len = file.metadata()?.len();
        if needed > file_len {
            return Err(DirtyLogError::PastEndOfFile { needed, file_len });
        }
        // Mapped from the start of the file: mmap_offset need not be page aligned.
        let mapping = SharedMapping::new(file, needed, 0)?;
        Ok(Self {
            mapping,
            file: file.try_clone()?,
            offset: offset_bytes,
            len,
            unmarked: AtomicU64::new(0),
        })
    }

    /// The log's file (to hand to an iothread).
    pub fn file(&self) -> &File {
        &self.file
    }

    /// Where the bitmap lies in [`DirtyLog::file`].
    pub fn spec(&self) -> crate::control::DirtyLogSpec {
        crate::control::DirtyLogSpec {
            size: self.len as u64,
            offset: self.offset as u64,
        }
    }

    /// Guest memory the bitmap covers, in bytes.
    pub fn covered_bytes(&self) -> u64 {
        (self.len as u64).saturating_mul(8 * LOG_PAGE_SIZE)
    }

    /// Pages that were written but lie beyond the bitmap (a VMM that sized its log too small).
    pub fn unmarked_pages(&self) -> u64 {
        self.unmarked.load(Ordering::Relaxed)
    }

    /// Marks every page of the guest-physical range `[addr, addr + len)` written. Call it
    /// after the write. Returns false if part of the range lies beyond the bitmap.
    pub fn mark(&self, addr: u64, len: u64) -> bool {
        if len == 0 {
            return true;
        }
        let first = addr / LOG_PAGE_SIZE;
        let last = addr.saturating_add(len.saturating_sub(1)) / LOG_PAGE_SIZE;
        let mut all = true;
        let mut page = first;
        while page <= last {
            let byte = page / 8;
            let first_bit = page % 8;
            // The pages of this byte that the range covers: bits first_bit..=last_bit.
            let last_bit = if last / 8 == byte { last % 8 } else { 7 };
            // first_bit <= last_bit <= 7, so neither shift nor the count can overflow.
            let mask = (0xffu8 << first_bit) & (0xffu8 >> 7u64.saturating_sub(last_bit));
            let covered = last_bit.saturating_sub(first_bit).saturating_add(1);
            match usize::try_from(byte).ok().filter(|&b| b < self.len) {
                Some(byte) => {
                    // SAFETY: offset + byte < offset + len, which `new` mapped; any byte is
                    // a valid, aligned AtomicU8, and the VMM also only accesses it atomically.
                    let cell = unsafe {
                        AtomicU8::from_ptr(self.mapping.as_ptr().add(self.offset).add(byte))
                    };
                    // Release: the write this mark stands for is visible before the mark.
                    cell.fetch_or(mask, Ordering::Release);
                }
                None => {
                    self.unmarked.fetch_add(covered, Ordering::Relaxed);
                    all = false;
                }
            }
            page = match byte.checked_add(1).and_then(|next| next.checked_mul(8)) {
                Some(next) => next,
                None => break,
            };
        }
        all
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shm::sealed_memfd;

    fn log(size: u64, offset: u64) -> (DirtyLog, File) {
        let file = sealed_memfd(c"log-test", offset + size).unwrap();
        (DirtyLog::new(&file, size, offset).unwrap(), file)
    }

    fn bits(log: &DirtyLog) -> Vec<u8> {
        (0..log.len)
            // SAFETY: in bounds of the mapping.
            .map(|i| unsafe { log.mapping.as_ptr().add(log.offset + i).read_volatile() })
            .collect()
    }

    #[test]
    fn one_byte_marks_its_page() {
        let (log, _f) = log(4, 0);
        assert!(log.mark(0x3000 + 17, 1));
        assert_eq!(bits(&log), [0b0000_1000, 0, 0, 0]);
    }

    #[test]
    fn a_range_across_pages_and_bytes_marks_each_page_once() {
        let (log, _f) = log(4, 0);
        // Last byte of page 6 to first byte of page 17: pages 6..=17.
        assert!(log.mark(7 * LOG_PAGE_SIZE - 1, 10 * LOG_PAGE_SIZE + 2));
        assert_eq!(bits(&log), [0b1100_0000, 0xff, 0b0000_0011, 0]);
        // Marking again changes nothing; other bits stay.
        assert!(log.mark(6 * LOG_PAGE_SIZE, 1));
        assert_eq!(bits(&log), [0b1100_0000, 0xff, 0b0000_0011, 0]);
    }

    #[test]
    fn the_bitmap_starts_at_the_offset() {
        let (log, file) = log(2, 100);
        assert!(log.mark(LOG_PAGE_SIZE * 9, 1));
        let whole = SharedMapping::new(&file, 102, 0).unwrap();
        // SAFETY: in bounds.
        let at = |i: usize| unsafe { whole.as_ptr().add(i).read() };
        assert_eq!((at(99), at(100), at(101)), (0, 0, 0b10));
    }

    #[test]
    fn pages_beyond_the_bitmap_are_counted_not_stored() {
        let (log, _f) = log(1, 0);
        assert_eq!(log.covered_bytes(), 8 * LOG_PAGE_SIZE);
        // Pages 6..=9: two inside, two beyond.
        assert!(!log.mark(6 * LOG_PAGE_SIZE, 4 * LOG_PAGE_SIZE));
        assert_eq!(bits(&log), [0b1100_0000]);
        assert_eq!(log.unmarked_pages(), 2);
        // At the very top of the address space: no overflow, nothing stored.
        assert!(!log.mark(u64::MAX - 10, 100));
        assert!(!log.mark(u64::MAX, 1));
        assert!(log.mark(0, 0));
    }

    #[test]
    fn hostile_sizes_are_refused() {
        let file = sealed_memfd(c"log-test", 4096).unwrap();
        assert!(matches!(
            DirtyLog::new(&file, 0, 0),
            Err(DirtyLogError::Empty)
        ));
        assert!(matches!(
            DirtyLog::new(&file, u64::MAX, 1),
            Err(DirtyLogError::Overflow { .. })
        ));
        assert!(matches!(
            DirtyLog::new(&file, 4096, 1),
            Err(DirtyLogError::PastEndOfFile { .. })
        ));
        assert!(DirtyLog::new(&file, 4000, 96).is_ok());
    }
}
