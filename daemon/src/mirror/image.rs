//! The copy's image I/O: reading the source image, writing the destination's.
//!
//! The source is read with O_DIRECT where its file system allows: the frontend writes with
//! O_DIRECT (cache=none), and a buffered read racing such a write could leave the old data in
//! the page cache for the next pass to read again; a direct read sees what the device has, and
//! makes the kernel write back any dirty cached range first (cache=writeback disks). Where
//! O_DIRECT is refused (tmpfs) there is only the page cache, which is coherent by itself.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;

use super::extents::Range;

/// O_DIRECT's alignment of buffers, offsets and lengths (the largest logical block size).
const DIRECT_ALIGN: usize = 4096;

/// The source image, open for reading.
#[derive(Debug)]
pub struct SourceImage {
    file: File,
    direct: bool,
    /// Bytes the disk has.
    capacity: u64,
}

impl SourceImage {
    /// Opens `path` (a disk of `capacity` bytes), with O_DIRECT where possible.
    pub fn open(path: &Path, capacity: u64) -> io::Result<SourceImage> {
        let direct = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(path);
        let (file, direct) = match direct {
            Ok(file) => (file, true),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                (std::fs::OpenOptions::new().read(true).open(path)?, false)
            }
            Err(e) => return Err(e),
        };
        Ok(SourceImage {
            file,
            direct,
            capacity,
        })
    }

    /// Whether reads bypass the page cache.
    pub fn direct(&self) -> bool {
        self.direct
    }

    /// The allocated extents of the image within the disk (SEEK_DATA / SEEK_HOLE), in order;
    /// the whole disk where the file cannot say (a block device, a file system without them).
    pub fn data_extents(&self) -> Vec<Range> {
        let whole = vec![Range {
            offset: 0,
            len: self.capacity,
        }];
        if self.capacity == 0 {
            return Vec::new();
        }
        let fd = self.file.as_raw_fd();
        let seek = |offset: u64, whence: i32| -> io::Result<Option<u64>> {
            let Ok(offset) = libc::off_t::try_from(offset) else {
                return Ok(None);
            };
            // SAFETY: lseek on a descriptor we own; no memory is involved.
            let at = unsafe { libc::lseek(fd, offset, whence) };
            if at < 0 {
                let e = io::Error::last_os_error();
                // ENXIO: no data (or hole) at or after `offset`.
                return if e.raw_os_error() == Some(libc::ENXIO) {
                    Ok(None)
                } else {
                    Err(e)
                };
            }
            Ok(u64::try_from(at).ok())
        };
        let mut out = Vec::new();
        let mut at = 0u64;
        while at < self.capacity {
            let data = match seek(at, libc::SEEK_DATA) {
                Ok(Some(data)) => data,
                Ok(None) => break,
                Err(_) => return whole,
            };
            if data >= self.capacity {
                break;
            }
            let hole = match seek(data, libc::SEEK_HOLE) {
                Ok(Some(hole)) => hole.min(self.capacity),
                Ok(None) => self.capacity,
                Err(_) => return whole,
            };
            if hole <= data {
                return whole;
            }
            out.push(Range {
                offset: data,
                len: hole - data,
            });
            at = hole;
        }
        out
    }

    /// Reads `range` (within the disk) into `buf`, which it resizes; returns the bytes, the
    /// range's length (a file shorter than the disk reads as zeros past its end).
    pub fn read<'a>(&self, range: Range, buf: &'a mut Vec<u8>) -> io::Result<&'a [u8]> {
        let len = usize::try_from(range.len).map_err(|_| io::ErrorKind::InvalidInput)?;
        if !self.direct {
            buf.clear();
            buf.resize(len, 0);
            let got = read_full(&self.file, buf, range.offset)?;
            if let Some(rest) = buf.get_mut(got..) {
                rest.fill(0);
            }
            return Ok(buf.as_slice());
        }
        // Aligned offset, length and buffer: read the aligned cover and return the middle.
        let align = DIRECT_ALIGN as u64;
        let start = range.offset / align * align;
        let end = range.end().div_ceil(align) * align;
        let cover = usize::try_from(end - start).map_err(|_| io::ErrorKind::InvalidInput)?;
        buf.clear();
        buf.resize(cover + DIRECT_ALIGN, 0);
        let skew = buf.as_ptr().align_offset(DIRECT_ALIGN);
        let lead =
            usize::try_from(range.offset - start).map_err(|_| io::ErrorKind::InvalidInput)?;
        let Some(aligned) = buf.get_mut(skew..skew + cover) else {
            return Err(io::ErrorKind::InvalidInput.into());
        };
        let got = read_full(&self.file, aligned, start)?;
        if let Some(rest) = aligned.get_mut(got..) {
            rest.fill(0);
        }
        buf.get(skew + lead..skew + lead + len)
            .ok_or_else(|| io::ErrorKind::InvalidInput.into())
    }
}

/// Reads at `offset` until `buf` is full or the file ends; returns the bytes read.
fn read_full(file: &File, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        let Some(rest) = buf.get_mut(got..) else {
            break;
        };
        match file.read_at(rest, offset + got as u64) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(got)
}

/// Creates the destination's image at `path`: a new sparse file of `capacity` bytes, mode
/// 0600; refuses an existing one.
pub fn create_destination(path: &Path, capacity: u64) -> io::Result<()> {
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)?;
    if let Err(e) = file.set_len(capacity).and_then(|()| file.sync_all()) {
        let _ = std::fs::remove_file(path);
        return Err(e);
    }
    Ok(())
}

/// The destination's image, open for writing.
#[derive(Debug)]
pub struct DestinationImage {
    file: File,
    capacity: u64,
}

/// [`DestinationImage::discard`] of the image at `path`, all of the file.
pub fn discard(path: &Path) -> io::Result<()> {
    DestinationImage::open(path, std::fs::metadata(path)?.len())?.discard()
}

impl DestinationImage {
    /// Opens the image at `path` (created by [`create_destination`]) of a disk of `capacity`
    /// bytes.
    pub fn open(path: &Path, capacity: u64) -> io::Result<DestinationImage> {
        let file = std::fs::OpenOptions::new().write(true).open(path)?;
        Ok(DestinationImage { file, capacity })
    }

    /// Makes the whole image read as zeros again (a new copy starts over: what an earlier,
    /// broken one wrote may be stale where the source is a hole now).
    pub fn reset(&self) -> io::Result<()> {
        self.zero(0, self.capacity)
    }

    /// Makes the whole image read as zeros again, and durable so: the part of a copy that
    /// failed holds the disk's data, which a node must not keep.
    pub fn discard(&self) -> io::Result<()> {
        self.reset()?;
        self.sync()
    }

    /// Whether `[offset, offset + len)` lies within the disk.
    pub fn within(&self, offset: u64, len: u64) -> bool {
        offset
            .checked_add(len)
            .is_some_and(|end| end <= self.capacity)
    }

    /// Writes `data` at `offset`, and starts writing it back: the fdatasync at the
    /// switch-over, which the guest waits for, then finds little left to write.
    pub fn write(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        self.file.write_all_at(data, offset)?;
        if let (Ok(off), Ok(len)) = (
            libc::off64_t::try_from(offset),
            libc::off64_t::try_from(data.len()),
        ) {
            // SAFETY: sync_file_range on a descriptor we own; no memory is involved. Only a
            // hint: its failure changes nothing but when the pages are written.
            unsafe {
                libc::sync_file_range(self.file.as_raw_fd(), off, len, libc::SYNC_FILE_RANGE_WRITE)
            };
        }
        Ok(())
    }

    /// Makes `len` bytes at `offset` read as zeros, deallocating them where the file system
    /// can (the image stays sparse), writing zeros where it cannot.
    pub fn zero(&self, offset: u64, len: u64) -> io::Result<()> {
        let (Ok(off), Ok(l)) = (libc::off_t::try_from(offset), libc::off_t::try_from(len)) else {
            return Err(io::ErrorKind::InvalidInput.into());
        };
        // SAFETY: fallocate on a descriptor we own; no memory is involved.
        let punched = unsafe {
            libc::fallocate(
                self.file.as_raw_fd(),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                off,
                l,
            )
        };
        if punched == 0 {
            return Ok(());
        }
        let zeros = vec![0u8; super::CHUNK as usize];
        let mut at = offset;
        let end = offset.saturating_add(len);
        while at < end {
            let n = (end - at).min(super::CHUNK) as usize;
            self.file
                .write_all_at(zeros.get(..n).unwrap_or_default(), at)?;
            at += n as u64;
        }
        Ok(())
    }

    /// fdatasync: what was written is on disk.
    pub fn sync(&self) -> io::Result<()> {
        self.file.sync_data()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extents_skip_holes_and_reads_return_the_bytes_at_any_alignment() {
        let dir = tempfile_dir();
        let path = dir.join("src.img");
        let capacity = 8u64 << 20;
        let f = File::create(&path).unwrap();
        f.set_len(capacity).unwrap();
        let pattern: Vec<u8> = (0..(1 << 20)).map(|i| (i % 251) as u8).collect();
        f.write_all_at(&pattern, 3 << 20).unwrap();
        f.sync_all().unwrap();
        let img = SourceImage::open(&path, capacity).unwrap();
        let extents = img.data_extents();
        let total: u64 = extents.iter().map(|r| r.len).sum();
        assert!(total < capacity, "holes found: {extents:?}");
        assert!(extents
            .iter()
            .any(|r| r.offset <= 3 << 20 && r.end() >= 4 << 20));
        let mut buf = Vec::new();
        let got = img
            .read(
                Range {
                    offset: (3 << 20) + 100,
                    len: 1000,
                },
                &mut buf,
            )
            .unwrap();
        assert_eq!(got, &pattern[100..1100]);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_destination_is_created_sparse_once_and_zeroed_ranges_read_zero() {
        let dir = tempfile_dir();
        let path = dir.join("dst.img");
        create_destination(&path, 4 << 20).unwrap();
        assert_eq!(
            create_destination(&path, 4 << 20).unwrap_err().kind(),
            io::ErrorKind::AlreadyExists
        );
        let img = DestinationImage::open(&path, 4 << 20).unwrap();
        assert!(img.within(0, 4 << 20));
        assert!(!img.within(1, 4 << 20));
        assert!(!img.within(u64::MAX, 2));
        img.write(4096, &[7u8; 8192]).unwrap();
        img.zero(8192, 4096).unwrap();
        img.sync().unwrap();
        let data = std::fs::read(&path).unwrap();
        assert!(data[4096..8192].iter().all(|&b| b == 7));
        assert!(data[8192..12288].iter().all(|&b| b == 0));
        assert_eq!(data.len(), 4 << 20);
        let _ = std::fs::remove_dir_all(&dir);
    }

    fn tempfile_dir() -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "blkplane-mirror-image-{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }
}
