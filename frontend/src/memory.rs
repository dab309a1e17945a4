//! The guest memory table: the regions the VMM registered (SET_MEM_TABLE, ADD_MEM_REG,
//! REM_MEM_REG), mapped into the frontend, and the same list as the iothreads map it.
//!
//! A table is immutable; a change builds a new one and the frontend swaps it in only after
//! every iothread has quiesced and mapped the new list, so a region index in a ring slot
//! always means the same region to both processes.

use std::fs::File;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;

use blkplane_proto::control::{MemoryRegionSpec, MAX_MEMORY_REGIONS};
use vm_memory::{FileOffset, GuestAddress, GuestMemoryMmap, GuestRegionMmap, MmapRegion};

/// Why a memory table change was refused.
#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    /// A region of zero bytes.
    #[error("memory region at guest address {0:#x} has size 0")]
    EmptyRegion(u64),
    /// Guest address, VMM address or file offset plus size overflows.
    #[error("memory region at guest address {0:#x} wraps around the address space")]
    RegionOverflow(u64),
    /// The mapping would reach past the end of the region's file (SIGBUS on access).
    #[error("memory region at guest address {guest:#x} reaches past its file ({needed} > {file_len} bytes)")]
    PastEndOfFile {
        /// The region's guest address.
        guest: u64,
        /// Bytes the region needs from the file.
        needed: u64,
        /// The file's size.
        file_len: u64,
    },
    /// Two regions share guest addresses.
    #[error("memory region at guest address {0:#x} overlaps another region")]
    Overlap(u64),
    /// Two regions share VMM addresses.
    #[error("memory region at VMM address {0:#x} overlaps another region's VMM addresses")]
    VmmOverlap(u64),
    /// More regions than advertised with GET_MAX_MEM_SLOTS.
    #[error("more than {MAX_MEMORY_REGIONS} memory regions")]
    TooManyRegions,
    /// REM_MEM_REG named a region that is not in the table.
    #[error("no memory region at guest address {0:#x} with that size")]
    NoSuchRegion(u64),
    /// fstat or mmap failed.
    #[error("mapping memory region at guest address {guest:#x}: {source}")]
    Map {
        /// The region's guest address.
        guest: u64,
        /// What failed.
        source: std::io::Error,
    },
}

/// One region as the VMM described it.
#[derive(Debug, Clone)]
pub struct RegionDescriptor {
    /// Guest-physical address of the first byte.
    pub guest_base: u64,
    /// Length in bytes.
    pub size: u64,
    /// The VMM's own virtual address of the first byte (vring addresses use these).
    pub user_addr: u64,
    /// Offset of the first byte in `file`.
    pub mmap_offset: u64,
}

struct Region {
    desc: RegionDescriptor,
    file: Arc<File>,
    mapping: Arc<GuestRegionMmap>,
}

/// An immutable set of mapped guest memory regions, sorted by guest address.
pub struct MemoryTable {
    regions: Vec<Region>,
    memory: GuestMemoryMmap,
}

impl std::fmt::Debug for MemoryTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.regions.iter().map(|r| &r.desc))
            .finish()
    }
}

fn map_region(
    desc: &RegionDescriptor,
    file: &Arc<File>,
) -> Result<Arc<GuestRegionMmap>, MemoryError> {
    let guest = desc.guest_base;
    if desc.size == 0 {
        return Err(MemoryError::EmptyRegion(guest));
    }
    let needed = desc
        .mmap_offset
        .checked_add(desc.size)
        .filter(|_| desc.guest_base.checked_add(desc.size).is_some())
        .filter(|_| desc.user_addr.checked_add(desc.size).is_some())
        .ok_or(MemoryError::RegionOverflow(guest))?;
    let file_len = file
        .metadata()
        .map_err(|source| MemoryError::Map { guest, source })?
        .len();
    // A hugetlbfs or memfd file reports its real size; mapping beyond it would SIGBUS later.
    if needed > file_len {
        return Err(MemoryError::PastEndOfFile {
            guest,
            needed,
            file_len,
        });
    }
    let size = usize::try_from(desc.size).map_err(|_| MemoryError::RegionOverflow(guest))?;
    let file_copy = file
        .try_clone()
        .map_err(|source| MemoryError::Map { guest, source })?;
    let mmap =
        MmapRegion::from_file(FileOffset::new(file_copy, desc.mmap_offset), size).map_err(|e| {
            MemoryError::Map {
                guest,
                source: std::io::Error::other(e),
            }
        })?;
    GuestRegionMmap::new(mmap, GuestAddress(guest))
        .map(Arc::new)
        .ok_or(MemoryError::RegionOverflow(guest))
}

impl MemoryTable {
    /// The table before the VMM sent any memory.
    pub fn empty() -> Self {
        Self {
            regions: Vec::new(),
            memory: GuestMemoryMmap::new(),
        }
    }

    fn from_regions(mut regions: Vec<Region>) -> Result<Self, MemoryError> {
        if regions.len() > MAX_MEMORY_REGIONS {
            return Err(MemoryError::TooManyRegions);
        }
        regions.sort_by_key(|r| r.desc.guest_base);
        for pair in regions.windows(2) {
            if let [a, b] = pair {
                // Sizes were checked not to overflow in map_region.
                let a_end = a.desc.guest_base.checked_add(a.desc.size);
                if a_end.is_none_or(|end| end > b.desc.guest_base) {
                    return Err(MemoryError::Overlap(b.desc.guest_base));
                }
            }
        }
        // The VMM's addresses of two regions must not overlap either: SET_VRING_ADDR names
        // rings by VMM address, which would then translate to two guest addresses.
        regions.sort_by_key(|r| r.desc.user_addr);
        for pair in regions.windows(2) {
            if let [a, b] = pair {
                let a_end = a.desc.user_addr.checked_add(a.desc.size);
                if a_end.is_none_or(|end| end > b.desc.user_addr) {
                    return Err(MemoryError::VmmOverlap(b.desc.user_addr));
                }
            }
        }
        regions.sort_by_key(|r| r.desc.guest_base);
        let memory = GuestMemoryMmap::from_arc_regions(
            regions.iter().map(|r| Arc::clone(&r.mapping)).collect(),
        )
        .map_err(|_| MemoryError::Overlap(regions.first().map_or(0, |r| r.desc.guest_base)))?;
        Ok(Self { regions, memory })
    }

    /// Maps a whole new table (SET_MEM_TABLE).
    pub fn new(regions: Vec<(RegionDescriptor, File)>) -> Result<Self, MemoryError> {
        if regions.len() > MAX_MEMORY_REGIONS {
            return Err(MemoryError::TooManyRegions);
        }
        let mut mapped = Vec::with_capacity(regions.len());
        for (desc, file) in regions {
            let file = Arc::new(file);
            let mapping = map_region(&desc, &file)?;
            mapped.push(Region {
                desc,
                file,
                mapping,
            });
        }
        Self::from_regions(mapped)
    }

    /// This table plus one region (ADD_MEM_REG).
    pub fn with_region(&self, desc: RegionDescriptor, file: File) -> Result<Self, MemoryError> {
        let file = Arc::new(file);
        let mapping = map_region(&desc, &file)?;
        let mut regions = self.clone_regions();
        regions.push(Region {
            desc,
            file,
            mapping,
        });
        Self::from_regions(regions)
    }

    /// This table less the region at `guest_base` of `size` bytes (REM_MEM_REG).
    pub fn without_region(&self, guest_base: u64, size: u64) -> Result<Self, MemoryError> {
        let mut regions = self.clone_regions();
        let before = regions.len();
        regions.retain(|r| !(r.desc.guest_base == guest_base && r.desc.size == size));
        if regions.len() == before {
            return Err(MemoryError::NoSuchRegion(guest_base));
        }
        Self::from_regions(regions)
    }

    fn clone_regions(&self) -> Vec<Region> {
        self.regions
            .iter()
            .map(|r| Region {
                desc: r.desc.clone(),
                file: Arc::clone(&r.file),
                mapping: Arc::clone(&r.mapping),
            })
            .collect()
    }

    /// The mapped memory, for reading headers and writing status bytes and used rings.
    pub fn guest_memory(&self) -> &GuestMemoryMmap {
        &self.memory
    }

    /// Number of regions.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.regions.len()
    }

    /// Whether no memory is registered.
    pub fn is_empty(&self) -> bool {
        self.regions.is_empty()
    }

    /// The regions as the iothreads map them, in index order, with their fds.
    pub fn iothread_table(&self) -> (Vec<MemoryRegionSpec>, Vec<RawFd>) {
        self.regions
            .iter()
            .map(|r| {
                (
                    MemoryRegionSpec {
                        size: r.desc.size,
                        mmap_offset: r.desc.mmap_offset,
                        guest_addr: r.desc.guest_base,
                    },
                    r.file.as_raw_fd(),
                )
            })
            .unzip()
    }

    /// Translates a VMM virtual address (as in SET_VRING_ADDR) to a guest address.
    pub fn vmm_to_guest(&self, user_addr: u64) -> Option<GuestAddress> {
        self.regions.iter().find_map(|r| {
            let offset = user_addr.checked_sub(r.desc.user_addr)?;
            (offset < r.desc.size)
                .then(|| r.desc.guest_base.checked_add(offset))
                .flatten()
                .map(GuestAddress)
        })
    }

    /// The guest address of byte `offset` of region `index` (as a ring segment names it).
    pub fn guest_address(&self, index: u32, offset: u64) -> Option<u64> {
        let region = self.regions.get(usize::try_from(index).ok()?)?;
        (offset < region.desc.size).then(|| region.desc.guest_base.checked_add(offset))?
    }

    /// The region index and offset of the guest byte at `addr` (as a slot names a status byte).
    pub fn locate(&self, addr: GuestAddress) -> Option<(u32, u64)> {
        let mut found = None;
        self.for_each_piece(addr.0, 1, |region, offset, _| {
            found = Some((region, offset));
            Ok::<(), ()>(())
        })
        .ok()?;
        found
    }

    /// Splits the guest range `[addr, addr + len)` into pieces that each lie inside one region
    /// and calls `emit(region index, offset in region, length)` for each, in order.
    pub fn for_each_piece<E>(
        &self,
        addr: u64,
        len: u32,
        mut emit: impl FnMut(u32, u64, u32) -> Result<(), E>,
    ) -> Result<(), PieceError<E>> {
        let mut addr = addr;
        let mut left = len;
        addr.checked_add(u64::from(len))
            .ok_or(PieceError::Overflow)?;
        while left > 0 {
            // Regions are sorted by guest address: the candidate is the last one starting at
            // or below `addr`.
            let index = self
                .regions
                .partition_point(|r| r.desc.guest_base <= addr)
                .checked_sub(1)
                .ok_or(PieceError::OutsideMemory)?;
            let region = self.regions.get(index).ok_or(PieceError::OutsideMemory)?;
            let offset = addr
                .checked_sub(region.desc.guest_base)
                .ok_or(PieceError::OutsideMemory)?;
            let room = region.desc.size.checked_sub(offset).filter(|&r| r > 0);
            let room = room.ok_or(PieceError::OutsideMemory)?;
            let piece = u32::try_from(room.min(u64::from(left))).unwrap_or(left);
            let region_index = u32::try_from(index).map_err(|_| PieceError::OutsideMemory)?;
            emit(region_index, offset, piece).map_err(PieceError::Sink)?;
            // piece <= left, and addr + len was checked above.
            left = left.saturating_sub(piece);
            addr = addr.saturating_add(u64::from(piece));
        }
        Ok(())
    }
}

/// Why a guest range could not be split into region pieces.
#[derive(Debug, PartialEq, Eq)]
pub enum PieceError<E> {
    /// Address plus length overflows.
    Overflow,
    /// Part of the range is not guest memory.
    OutsideMemory,
    /// The callback refused a piece.
    Sink(E),
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::os::fd::FromRawFd;

    pub(crate) fn memfd(len: u64) -> File {
        // SAFETY: literal name; result checked.
        let fd = unsafe { libc::memfd_create(c"test-guest".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: fresh fd owned by nobody else.
        let file = unsafe { File::from_raw_fd(fd) };
        file.set_len(len).unwrap();
        file
    }

    pub(crate) fn desc(guest_base: u64, size: u64, mmap_offset: u64) -> RegionDescriptor {
        RegionDescriptor {
            guest_base,
            size,
            user_addr: 0x7f00_0000_0000u64.wrapping_add(guest_base),
            mmap_offset,
        }
    }

    /// Two adjacent regions: [0, 64K) and [64K, 128K), backed by one memfd.
    pub(crate) fn two_regions() -> MemoryTable {
        let f = memfd(1 << 17);
        MemoryTable::new(vec![
            (desc(0, 1 << 16, 0), f.try_clone().unwrap()),
            (desc(1 << 16, 1 << 16, 1 << 16), f),
        ])
        .unwrap()
    }

    #[test]
    fn bad_regions_are_refused() {
        let f = memfd(1 << 16);
        assert!(matches!(
            MemoryTable::new(vec![(desc(0, 0, 0), f.try_clone().unwrap())]),
            Err(MemoryError::EmptyRegion(0))
        ));
        assert!(matches!(
            MemoryTable::new(vec![(desc(0, 1 << 17, 0), f.try_clone().unwrap())]),
            Err(MemoryError::PastEndOfFile { .. })
        ));
        assert!(matches!(
            MemoryTable::new(vec![(desc(u64::MAX - 10, 4096, 0), f.try_clone().unwrap())]),
            Err(MemoryError::RegionOverflow(_))
        ));
        assert!(matches!(
            MemoryTable::new(vec![
                (desc(0, 8192, 0), f.try_clone().unwrap()),
                (desc(4096, 8192, 0), f.try_clone().unwrap()),
            ]),
            Err(MemoryError::Overlap(4096))
        ));
        // Apart in guest addresses, overlapping in the VMM's.
        let apart = |guest_base, user_addr| RegionDescriptor {
            user_addr,
            ..desc(guest_base, 8192, 0)
        };
        assert!(matches!(
            MemoryTable::new(vec![
                (apart(0, 1 << 40), f.try_clone().unwrap()),
                (apart(1 << 20, (1 << 40) + 4096), f.try_clone().unwrap()),
            ]),
            Err(MemoryError::VmmOverlap(_))
        ));
    }

    #[test]
    fn add_and_remove_regions() {
        let table = two_regions();
        let f = memfd(4096);
        let bigger = table.with_region(desc(1 << 20, 4096, 0), f).unwrap();
        assert_eq!(bigger.len(), 3);
        assert!(bigger.with_region(desc(0, 4096, 0), memfd(4096)).is_err());
        let smaller = bigger.without_region(0, 1 << 16).unwrap();
        assert_eq!(smaller.len(), 2);
        assert!(smaller.without_region(0, 1 << 16).is_err());
    }

    #[test]
    fn ranges_split_at_region_boundaries() {
        let table = two_regions();
        let mut pieces = Vec::new();
        table
            .for_each_piece::<()>((1 << 16) - 100, 300, |r, o, l| {
                pieces.push((r, o, l));
                Ok(())
            })
            .unwrap();
        assert_eq!(pieces, vec![(0, (1 << 16) - 100, 100), (1, 0, 200)]);
        let outside = table.for_each_piece::<()>((1 << 17) - 10, 20, |_, _, _| Ok(()));
        assert_eq!(outside, Err(PieceError::OutsideMemory));
        let wrap = table.for_each_piece::<()>(u64::MAX - 1, 20, |_, _, _| Ok(()));
        assert_eq!(wrap, Err(PieceError::Overflow));
    }

    #[test]
    fn vmm_addresses_translate() {
        let table = two_regions();
        assert_eq!(
            table.vmm_to_guest(0x7f00_0000_0000 + 0x10010),
            Some(GuestAddress(0x10010))
        );
        assert_eq!(table.vmm_to_guest(0x10), None);
    }
}
