//! The guest memory table: the regions of the last `SetMemoryTable`, mapped into this process so
//! that read/write iovecs can point straight into guest RAM (no bounce buffer).
//!
//! For a file image the iothread never dereferences guest memory itself. It only computes
//! addresses inside a mapping and hands them to the kernel, so a guest or frontend changing that
//! memory concurrently cannot break Rust's aliasing rules, and a file truncated after it was
//! mapped makes the I/O fail with `EFAULT` instead of raising `SIGBUS` in this process. The size
//! check against `fstat` at mapping time is still done, so that an honest mistake is refused up
//! front.
//!
//! Two exceptions. The iothread completes requests itself, so it writes status bytes and
//! used-ring entries and reads the avail ring's flags and `used_event`, through raw pointers
//! and atomics (never references) into these mappings, checked against them first
//! (`iothread/src/vring.rs`). And a null image: its reads are zero-filled by this process, through raw
//! pointers (never references), so concurrent guest accesses still alias nothing. A region
//! whose file the VMM shrinks after it was mapped then raises `SIGBUS` here, and the frontend
//! replaces the iothread; only the VMM can do that, and it only hurts its own guest.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::ptr::NonNull;

use blkplane_proto::control::MemoryRegionSpec;

/// Why a memory table was refused. The previous table stays in place.
#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    /// The message carried a different number of fds than regions.
    #[error("{fds} fds for {regions} memory regions")]
    FdCount {
        /// Fds received.
        fds: usize,
        /// Regions described.
        regions: usize,
    },
    /// A region of zero bytes.
    #[error("memory region {index} is empty")]
    Empty {
        /// Index of the region in the table.
        index: usize,
    },
    /// `mmap_offset + size` does not fit the address space.
    #[error("memory region {index}: mmap_offset {mmap_offset} + size {size} overflows")]
    Overflow {
        /// Index of the region in the table.
        index: usize,
        /// The region's offset in its fd.
        mmap_offset: u64,
        /// The region's size.
        size: u64,
    },
    /// The region extends past the end of its fd; touching it would raise SIGBUS.
    #[error("memory region {index} ends at byte {end} but its fd holds {file_size} bytes")]
    BeyondFile {
        /// Index of the region in the table.
        index: usize,
        /// `mmap_offset + size`.
        end: u64,
        /// Size of the fd.
        file_size: u64,
    },
    /// A system call failed.
    #[error("memory region {index}: {op}: {source}")]
    Os {
        /// Index of the region in the table.
        index: usize,
        /// The operation that failed.
        op: &'static str,
        /// Its error.
        source: io::Error,
    },
}

impl MemoryError {
    /// The errno to answer the frontend with.
    pub fn errno(&self) -> i32 {
        match self {
            Self::Os { source, .. } => source.raw_os_error().unwrap_or(libc::EIO),
            _ => libc::EINVAL,
        }
    }
}

/// One mapped guest memory region; unmapped on drop.
#[derive(Debug)]
pub struct Region {
    /// Start of the mmap, which may begin before the region (see [`MemoryTable::map`]).
    mapping: NonNull<u8>,
    /// Length of the mmap.
    mapping_len: usize,
    /// Bytes from `mapping` to the region's first byte.
    lead: usize,
    /// The region's size.
    len: u64,
    /// Guest-physical address of the region's first byte.
    guest_addr: u64,
}

impl Region {
    /// The address of `len` bytes at `offset` in the region, or `None` if they do not all lie
    /// inside it.
    pub fn address(&self, offset: u64, len: u32) -> Option<*mut u8> {
        let end = offset.checked_add(u64::from(len))?;
        if end > self.len {
            return None;
        }
        // `offset < len <= mapping_len - lead`, so the sum does not overflow a usize.
        let start = self.lead.checked_add(usize::try_from(offset).ok()?)?;
        // SAFETY: `start <= lead + len <= mapping_len`, so the pointer stays inside (or one past
        // the end of) the mapping, which is at most isize::MAX bytes long (checked in `map_one`).
        Some(unsafe { self.mapping.as_ptr().add(start) })
    }

    /// The guest-physical address of byte `offset` of the region, if it is inside it.
    pub fn guest_address(&self, offset: u64) -> Option<u64> {
        if offset >= self.len {
            return None;
        }
        self.guest_addr.checked_add(offset)
    }

    /// The offset in this region of `len` bytes at guest-physical `addr`, if they all lie
    /// inside it.
    fn offset_of(&self, addr: u64, len: u64) -> Option<u64> {
        let offset = addr.checked_sub(self.guest_addr)?;
        (offset.checked_add(len)? <= self.len).then_some(offset)
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly what `map_one` mapped. Nothing refers to the mapping any
        // more: the table is only replaced while no request is in flight, and the kernel holds
        // its own page references for any I/O it still runs.
        unsafe {
            libc::munmap(self.mapping.as_ptr().cast(), self.mapping_len);
        }
    }
}

/// The mapped regions, indexed as the frontend numbered them.
#[derive(Debug, Default)]
pub struct MemoryTable {
    regions: Vec<Region>,
}

impl MemoryTable {
    /// A table with no regions: every data segment is refused until the first `SetMemoryTable`.
    pub fn empty() -> Self {
        Self::default()
    }

    /// Validates and maps every region; on any error, whatever was mapped is unmapped again and
    /// nothing changes for the caller.
    ///
    /// The mapping starts at `mmap_offset` rounded down to the fd's allocation unit (the page
    /// size, or the huge page size on hugetlbfs), because mmap needs an aligned offset while
    /// vhost-user allows any.
    pub fn map(specs: &[MemoryRegionSpec], files: &[File]) -> Result<Self, MemoryError> {
        if specs.len() != files.len() {
            return Err(MemoryError::FdCount {
                fds: files.len(),
                regions: specs.len(),
            });
        }
        let regions = specs
            .iter()
            .zip(files)
            .enumerate()
            .map(|(index, (spec, file))| map_one(index, spec, file))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self { regions })
    }

    /// Number of regions.
    pub fn len(&self) -> usize {
        self.regions.len()
    }

    /// Whether the table has no region (before the first SetMemoryTable).
    pub fn is_empty(&self) -> bool {
        self.regions.is_empty()
    }

    /// Region `index`, if the table has it.
    pub fn region(&self, index: u32) -> Option<&Region> {
        self.regions.get(usize::try_from(index).ok()?)
    }

    /// The address in this process of `len` bytes at guest-physical `addr`, if they all lie
    /// inside one region.
    pub fn translate(&self, addr: u64, len: u32) -> Option<*mut u8> {
        self.regions.iter().find_map(|region| {
            let offset = region.offset_of(addr, u64::from(len))?;
            region.address(offset, len)
        })
    }

    /// The guest-physical address of byte `offset` of region `index`.
    pub fn guest_address(&self, index: u32, offset: u64) -> Option<u64> {
        self.region(index)?.guest_address(offset)
    }
}

fn map_one(index: usize, spec: &MemoryRegionSpec, file: &File) -> Result<Region, MemoryError> {
    let os = |op, source| MemoryError::Os { index, op, source };
    if spec.size == 0 {
        return Err(MemoryError::Empty { index });
    }
    let overflow = MemoryError::Overflow {
        index,
        mmap_offset: spec.mmap_offset,
        size: spec.size,
    };
    let Some(end) = spec.mmap_offset.checked_add(spec.size) else {
        return Err(overflow);
    };
    let meta = file.metadata().map_err(|e| os("fstat", e))?;
    if end > meta.len() {
        return Err(MemoryError::BeyondFile {
            index,
            end,
            file_size: meta.len(),
        });
    }
    let align = map_alignment(file);
    // map_alignment is a power of two, never 0; the remainder is at most the offset.
    let lead = spec.mmap_offset.checked_rem(align).unwrap_or(0);
    let map_offset = spec.mmap_offset.saturating_sub(lead);
    let (Ok(lead), Some(map_len)) = (
        usize::try_from(lead),
        lead.checked_add(spec.size)
            .and_then(|len| usize::try_from(len).ok())
            .filter(|&len| isize::try_from(len).is_ok()),
    ) else {
        return Err(overflow);
    };
    let Ok(file_offset) = libc::off_t::try_from(map_offset) else {
        return Err(overflow);
    };
    // SAFETY: a fresh shared mapping of a file we hold an fd for, at an address the kernel
    // picks; the result is checked before use. MAP_NORESERVE because guest RAM is usually
    // larger than what the guest ever touches.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            map_len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_NORESERVE,
            file.as_raw_fd(),
            file_offset,
        )
    };
    if ptr == libc::MAP_FAILED {
        return Err(os("mmap", io::Error::last_os_error()));
    }
    let mapping = NonNull::new(ptr.cast::<u8>())
        .ok_or_else(|| os("mmap", io::Error::from_raw_os_error(libc::ENOMEM)))?;
    Ok(Region {
        mapping,
        mapping_len: map_len,
        lead,
        len: spec.size,
        guest_addr: spec.guest_addr,
    })
}

/// The offset alignment mmap needs for `file`: the page size, or the file's block size when
/// that is a larger power of two (hugetlbfs reports its huge page size there).
fn map_alignment(file: &File) -> u64 {
    // SAFETY: sysconf has no memory-safety preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    let page = u64::try_from(page).ok().filter(|p| p.is_power_of_two());
    let page = page.unwrap_or(4096);
    use std::os::unix::fs::MetadataExt;
    let block = file.metadata().map(|m| m.blksize()).unwrap_or(0);
    if block.is_power_of_two() && block > page && block <= 1 << 30 {
        block
    } else {
        page
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::os::fd::FromRawFd;

    /// A memfd of `len` bytes.
    pub(crate) fn memfd(len: u64) -> File {
        // SAFETY: the name is a NUL-terminated literal; the result is checked.
        let fd = unsafe { libc::memfd_create(c"iothread-test".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0, "memfd_create: {}", io::Error::last_os_error());
        // SAFETY: a fresh fd owned by nobody else.
        let file = unsafe { File::from_raw_fd(fd) };
        file.set_len(len).unwrap();
        file
    }

    fn spec(size: u64, mmap_offset: u64) -> MemoryRegionSpec {
        MemoryRegionSpec {
            size,
            mmap_offset,
            guest_addr: mmap_offset << 20,
        }
    }

    #[test]
    fn guest_addresses_translate_inside_one_region() {
        let file = memfd(3 * 4096);
        let table = MemoryTable::map(
            &[spec(4096, 0), spec(4096, 4096)],
            &[file.try_clone().unwrap(), file],
        )
        .unwrap();
        let second = 4096 << 20;
        assert_eq!(
            table.translate(second + 8, 4),
            table.region(1).unwrap().address(8, 4)
        );
        assert!(
            table.translate(4090, 8).is_none(),
            "crosses the first's end"
        );
        assert!(table.translate(second + 4095, 2).is_none());
        assert!(table.translate(u64::MAX, 1).is_none());
        assert_eq!(table.guest_address(1, 10), Some(second + 10));
        assert_eq!(table.guest_address(1, 4096), None);
        assert_eq!(table.guest_address(2, 0), None);
    }

    #[test]
    fn maps_regions_and_bounds_addresses() {
        let file = memfd(3 * 4096);
        let table = MemoryTable::map(
            &[spec(4096, 0), spec(4096, 4096 + 100)],
            &[file.try_clone().unwrap(), file],
        )
        .unwrap();
        assert_eq!(table.len(), 2);
        let first = table.region(0).unwrap();
        let second = table.region(1).unwrap();
        assert!(second.address(0, 4096).is_some());
        assert!(second.address(0, 4097).is_none());
        assert!(first.address(0, 4096).is_some());
        assert!(first.address(1, 4096).is_none());
        assert!(first.address(u64::MAX, 1).is_none());
        assert!(
            first.address(4096, 0).is_some(),
            "an empty tail is in bounds"
        );
        // The unaligned offset is honoured: the region starts 100 bytes into the second page.
        let base = second.address(0, 1).unwrap() as usize;
        assert_eq!(base % 4096, 100);
        assert!(table.region(2).is_none());
    }

    #[test]
    fn writes_through_the_mapping_reach_the_file() {
        use std::os::unix::fs::FileExt;
        let file = memfd(8192);
        let table = MemoryTable::map(&[spec(4096, 4096)], &[file.try_clone().unwrap()]).unwrap();
        let ptr = table.region(0).unwrap().address(10, 1).unwrap();
        // SAFETY: the test owns the mapping and nothing else uses it.
        unsafe { ptr.write(0xab) };
        let mut byte = [0u8];
        file.read_exact_at(&mut byte, 4096 + 10).unwrap();
        assert_eq!(byte[0], 0xab);
    }

    #[test]
    fn refuses_bad_regions() {
        let file = || memfd(4096);
        assert!(matches!(
            MemoryTable::map(&[spec(0, 0)], &[file()]),
            Err(MemoryError::Empty { index: 0 })
        ));
        assert!(matches!(
            MemoryTable::map(&[spec(4096, 0), spec(u64::MAX, 4096)], &[file(), file()]),
            Err(MemoryError::Overflow { index: 1, .. })
        ));
        let err = MemoryTable::map(&[spec(8192, 0)], &[file()]).unwrap_err();
        assert!(matches!(err, MemoryError::BeyondFile { end: 8192, .. }));
        assert_eq!(err.errno(), libc::EINVAL);
        assert!(matches!(
            MemoryTable::map(&[spec(4096, 1)], &[file()]),
            Err(MemoryError::BeyondFile { .. })
        ));
        assert!(matches!(
            MemoryTable::map(&[spec(4096, 0)], &[]),
            Err(MemoryError::FdCount { .. })
        ));
    }
}
