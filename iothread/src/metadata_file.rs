//! The storage object imago reads and writes a qcow2 chain's files through: imago's own file
//! driver, with the writes of the image's *pointer* structures — its header, L1 table and
//! refcount table — held back until [`Barrier::apply`], which the iothread calls right after
//! imago has written its L2 and refcount-block caches back.
//!
//! Why: imago 0.2.6 writes a new L2 table's L1 entry to the file as soon as it allocates the
//! table, while the refcount that marks the table's cluster as used is still only in its
//! refcount-block cache (QEMU flushes that cache first). An iothread killed in between leaves
//! an L1 entry pointing at a cluster whose refcount on disk is 0; the next iothread allocates
//! that cluster again as data, and the guest's data and the L2 table overwrite each other.
//! Held back until the caches are on disk, a pointer never reaches the file before what it
//! points to is described there; at worst a crash leaks the clusters, which `qemu-img check`
//! reports as leaks, as QEMU's own crashes do. (An upstream fix in imago — flushing the
//! refcount cache before the L1 write in `ensure_l2` — would make this unnecessary.)
//!
//! imago keeps those structures in memory once the image is open, so it never needs to read
//! back what is held; reads that meet a held write see it anyway.
//!
//! A held refcount-table entry (a new refcount block's) holds the L2 tables written after it
//! too: imago has written the refcount blocks before any L2 table that needs them, but the
//! entry naming a new block is what makes the file count the clusters in it. Once an L2
//! table is held so, refcount blocks are held behind it (imago frees clusters L2 tables
//! first), and a write over a held one always waits behind it.
//!
//! And the engine's whole-cluster allocating writes map a cluster before its data is written
//! (`engine/cluster_write.rs`): its L2 entry is kept at its old value in every write of its
//! table until the data has landed ([`Barrier::hold_entry`]).
//!
//! The structures move: imago 0.2.6 writes a new L1 table on every grow (and a new refcount
//! table when the old one is full), then the header that points there, then frees the old
//! table. Until that header is applied, the old table is what the file's header names and the
//! new one is what imago writes to, so both are held; afterwards only the new one, and the old
//! cluster is an ordinary one again (held for good, a data cluster imago puts there next would
//! have its copy-on-write applied after the guest's data written to it directly). The old
//! cluster must not be reused before the header is applied either: imago asks
//! [`Storage::settle_writes`] before it frees metadata clusters, and is refused while a moved
//! table's header is held, so it keeps them (a leak `qemu-img check` reports) instead.

use std::fmt;
use std::fs::File;
use std::io;
use std::ops::Range;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use imago::file::File as ImagoFile;
use imago::io_buffers::{IoVector, IoVectorMut};
use imago::storage::drivers::CommonStorageHelper;
use imago::storage::PreallocateMode;
use imago::{Storage, StorageOpenOptions};

/// The writes held back for one file, and the ranges whose writes are held.
#[derive(Debug)]
pub struct Barrier {
    /// A duplicate of the file's fd, to apply the held writes with.
    file: File,
    /// What is held, and where the pointer structures are.
    state: Mutex<Held>,
    /// How far the file was last seen to reach (0: not looked yet; `u64::MAX`: not a regular
    /// file). Only grows (a file cut shorter only loosens the bound).
    reach: AtomicU64,
    /// A qcow2 file served writable, whose writes [`Barrier::check_write_at`] holds to
    /// [`WRITE_REACH`] past its end.
    bounded: bool,
    /// The end of the last cluster of the disk whose external data file this is (`u64::MAX`:
    /// not one): its clusters sit at their guest offsets, wherever the file ends (it may be
    /// shorter than the disk), so writes are held below this instead.
    disk_end: AtomicU64,
}

/// The held writes and the pointer structures they must wait with.
#[derive(Debug, Default)]
struct Held {
    /// Held writes in the order imago made them: (offset, data).
    writes: Vec<(u64, Vec<u8>)>,
    /// Byte ranges of the pointer structures the header in the file names.
    on_disk: Vec<Range<u64>>,
    /// Those the header will name once the held writes are applied: where imago has moved
    /// its L1 or refcount table (a grow moves the L1 table every time) and the new header
    /// is still held, they differ. Until then both are pointer structures: the file's old
    /// ones are what a crash would leave in use, the new ones what imago now writes to.
    pending: Vec<Range<u64>>,
    /// L2 entries that map a cluster whose data is still being written (see
    /// [`Barrier::hold_entry`]): every write of their table carries their old value instead.
    unlanded: Vec<Unlanded>,
    /// L2 entries whose cluster's data has landed since a write of their table carried the
    /// old value: their new value, written with the held writes (after the refcount blocks),
    /// unless imago writes their table again first. (offset, big-endian value)
    landed: Vec<(u64, [u8; 8])>,
    /// An L2 table write is held behind a refcount-table write (see `pure_writev`): refcount
    /// block writes are held too from then on, so that they keep their order with it.
    holds_l2_table: bool,
}

/// An L2 entry kept out of the file until its cluster's data is there.
#[derive(Debug, Clone, Copy)]
struct Unlanded {
    /// Where the entry is in the file.
    at: u64,
    /// What the file must say until the data has landed (big-endian).
    old: [u8; 8],
    /// What imago last wrote there instead, if it wrote the table since (big-endian).
    wanted: Option<[u8; 8]>,
}

/// An L1 entry's L2 table offset bits (the qcow2 specification's bits 9-55).
const L1_OFFSET_MASK: u64 = 0x00ff_ffff_ffff_fe00;

/// The farthest past a qcow2 file's end a write into it may start. imago's allocator hands out
/// the first clusters its refcounts leave free — a hole inside the file or its end — so an
/// operation's new clusters (tables, data, the refcount structures that count them; imago
/// caps its L1 and refcount tables at 32 MiB) start well within this; a write farther out
/// comes from a corrupt entry (a zero cluster's preallocated offset, a data cluster that a
/// write-zeroes rewrites) and would grow the file to wherever the entry points.
pub const WRITE_REACH: u64 = 1 << 30;

impl Held {
    /// Whether a write of `len` bytes at `offset` meets a pointer structure, old or new.
    fn holds(&self, offset: u64, len: u64) -> bool {
        let end = offset.saturating_add(len);
        self.on_disk
            .iter()
            .chain(&self.pending)
            .any(|range| offset < range.end && range.start < end)
    }

    /// Whether a write to the refcount table (a new refcount block's entry) is held, or a
    /// new refcount table waits for its header.
    fn holds_refcount_table_write(&self) -> bool {
        if self.pending.get(2) != self.on_disk.get(2) {
            return true;
        }
        // `pointer_ranges` lists the refcount table third.
        let tables = [self.on_disk.get(2), self.pending.get(2)];
        self.writes.iter().any(|(at, data)| {
            let end = at.saturating_add(data.len() as u64);
            tables
                .iter()
                .flatten()
                .any(|range| *at < range.end && range.start < end)
        })
    }

    /// Whether a held write overlaps the `len` bytes at `offset` (a later write there must
    /// not reach the file before it).
    fn overlaps_held_write(&self, offset: u64, len: u64) -> bool {
        let end = offset.saturating_add(len);
        self.writes
            .iter()
            .any(|(at, data)| *at < end && offset < at.saturating_add(data.len() as u64))
    }

    /// Whether a read of `len` bytes at `offset` must see something the file does not have
    /// yet: a held write, a landed entry, or what imago wrote for an unlanded one.
    fn overlays(&self, offset: u64, len: u64) -> bool {
        let end = offset.saturating_add(len);
        let meets = |at: u64, n: u64| at < end && offset < at.saturating_add(n);
        self.writes
            .iter()
            .any(|(at, data)| meets(*at, data.len() as u64))
            || self.landed.iter().any(|(at, _)| meets(*at, 8))
            || self
                .unlanded
                .iter()
                .any(|u| u.wanted.is_some() && meets(u.at, 8))
    }

    /// Whether a held header moves a pointer structure.
    fn moves_a_table(&self) -> bool {
        self.pending != self.on_disk
    }

    /// The header fields as they will be once the held writes are applied over `header`
    /// (the header in the file).
    fn pending_header(&self, mut header: [u8; HEADER_FIELDS]) -> [u8; HEADER_FIELDS] {
        for (at, data) in &self.writes {
            overlay(&mut header, 0, *at, data);
        }
        header
    }
}

/// Lays `data`, written at file offset `at`, over the part of `buffer` (which holds the file
/// from offset `offset`) it covers.
fn overlay(buffer: &mut [u8], offset: u64, at: u64, data: &[u8]) {
    let end = offset.saturating_add(buffer.len() as u64);
    let data_end = at.saturating_add(data.len() as u64);
    let (from, to) = (at.max(offset), data_end.min(end));
    if from >= to {
        return;
    }
    // All three are within their buffers: from..to lies inside both ranges.
    let (Ok(dst), Ok(src), Ok(n)) = (
        usize::try_from(from.saturating_sub(offset)),
        usize::try_from(from.saturating_sub(at)),
        usize::try_from(to.saturating_sub(from)),
    ) else {
        return;
    };
    if let (Some(dst), Some(src)) = (
        buffer.get_mut(dst..dst.saturating_add(n)),
        data.get(src..src.saturating_add(n)),
    ) {
        dst.copy_from_slice(src);
    }
}

impl Barrier {
    /// The file's own descriptor (a duplicate), for reads of its header.
    pub fn file_ref(&self) -> &File {
        &self.file
    }

    /// Writes every held write to the file, in order, and takes the structures the header
    /// now names as the pointer structures. Called once the metadata caches have been
    /// written back.
    pub fn apply(&self) -> io::Result<()> {
        let mut held = lock(&self.state);
        if held.writes.is_empty() && held.landed.is_empty() {
            return Ok(());
        }
        for (offset, data) in held.writes.iter() {
            self.file.write_all_at(data, *offset)?;
        }
        held.writes.clear();
        held.holds_l2_table = false;
        while let Some((offset, entry)) = held.landed.last().copied() {
            self.file.write_all_at(&entry, offset)?;
            held.landed.pop();
        }
        if held.moves_a_table() {
            held.on_disk = std::mem::take(&mut held.pending);
            held.pending = held.on_disk.clone();
        }
        Ok(())
    }

    /// Whether any held write is waiting.
    pub fn is_empty(&self) -> bool {
        let held = lock(&self.state);
        held.writes.is_empty() && held.landed.is_empty()
    }

    /// Where in the file the L2 entry of the cluster at guest offset `guest_offset` is: read
    /// through the L1 table the header names (as the held writes will leave both). `None`
    /// when the header does not parse or no L2 table covers the offset yet.
    pub fn l2_entry_offset(&self, guest_offset: u64) -> Option<u64> {
        let held = lock(&self.state);
        let header = held.pending_header(read_header(&self.file)?);
        let cluster_bits = u32::try_from(be::<4>(&header, 20)?)
            .ok()
            .filter(|b| (9..=21).contains(b))?;
        let l1_size = be::<4>(&header, 36)?;
        let l1_offset = be::<8>(&header, 40)?;
        // Each L2 table maps cluster_size / 8 clusters.
        let l2_bits = cluster_bits.checked_sub(3)?;
        let l1_index = guest_offset.checked_shr(cluster_bits.checked_add(l2_bits)?)?;
        if l1_index >= l1_size {
            return None;
        }
        let at = l1_offset.checked_add(l1_index.checked_mul(8)?)?;
        let mut entry = [0u8; 8];
        self.file.read_exact_at(&mut entry, at).ok()?;
        for (offset, data) in &held.writes {
            overlay(&mut entry, at, *offset, data);
        }
        let l2_offset = u64::from_be_bytes(entry) & L1_OFFSET_MASK;
        if l2_offset == 0 {
            return None;
        }
        let l2_index = (guest_offset >> cluster_bits) & (1u64 << l2_bits).saturating_sub(1);
        l2_offset.checked_add(l2_index.checked_mul(8)?)
    }

    /// Whether `offset` is in an L2 table, as the L1 table the header names says
    /// (with the held writes laid over both). Read from the file: only asked while a refcount
    /// table write is held.
    fn names_l2_table(&self, held: &Held, offset: u64) -> bool {
        // L1: its entry count at 36, its offset at 40.
        self.table_names(held, offset, (36, 40), false)
    }

    /// Whether `offset` is in a refcount block, as the refcount table says (as
    /// [`Barrier::names_l2_table`]).
    fn names_refcount_block(&self, held: &Held, offset: u64) -> bool {
        // The refcount table: its cluster count at 56, its offset at 48.
        self.table_names(held, offset, (56, 48), true)
    }

    /// Whether the table whose size and offset are the header fields at `fields` names the
    /// cluster `offset` is in (a size in clusters if `in_clusters`, else in entries).
    fn table_names(
        &self,
        held: &Held,
        offset: u64,
        fields: (usize, usize),
        in_clusters: bool,
    ) -> bool {
        let Some(header) = read_header(&self.file) else {
            return false;
        };
        let header = held.pending_header(header);
        let (Some(size), Some(table_offset), Some(cluster_bits)) = (
            be::<4>(&header, fields.0),
            be::<8>(&header, fields.1),
            be::<4>(&header, 20).filter(|b| (9..=21).contains(b)),
        ) else {
            return false;
        };
        let bytes = if in_clusters {
            size.checked_shl(u32::try_from(cluster_bits).unwrap_or(0))
        } else {
            size.checked_mul(8)
        };
        // imago refuses tables beyond 32 MiB; a header naming more is not read here.
        let Some(len) = bytes
            .filter(|&n| n <= 32 << 20)
            .and_then(|n| usize::try_from(n).ok())
        else {
            return false;
        };
        let mut table = vec![0u8; len];
        if self.file.read_exact_at(&mut table, table_offset).is_err() {
            return false;
        }
        for (at, data) in &held.writes {
            overlay(&mut table, table_offset, *at, data);
        }
        let cluster = 1u64 << cluster_bits;
        table.chunks_exact(8).any(|entry| {
            let entry: [u8; 8] = entry.try_into().unwrap_or([0; 8]);
            let named = u64::from_be_bytes(entry) & L1_OFFSET_MASK;
            named != 0 && (named..named.saturating_add(cluster)).contains(&offset)
        })
    }

    /// Keeps the L2 entry at `at` out of the file: every write of its table carries `old`
    /// there instead, until [`Barrier::land`] or [`Barrier::forget`]. For a cluster mapped
    /// in imago's caches before its data is written (the engine's allocations through
    /// O_DIRECT): a crash before the data lands must leave the old mapping in the file.
    pub fn hold_entry(&self, at: u64, old: u64) {
        lock(&self.state).unlanded.push(Unlanded {
            at,
            old: old.to_be_bytes(),
            wanted: None,
        });
    }

    /// The data of the cluster the entry at `at` maps has landed: the entry may reach the
    /// file. If a write of its table carried the old value meanwhile, the new one is written
    /// with the held writes (after the caches: its refcount first).
    pub fn land(&self, at: u64) {
        let mut held = lock(&self.state);
        if let Some(index) = held.unlanded.iter().position(|u| u.at == at) {
            let unlanded = held.unlanded.swap_remove(index);
            if let Some(wanted) = unlanded.wanted {
                held.landed.push((at, wanted));
            }
        }
    }

    /// Stops holding the entry at `at` without writing it: the mapping it was held for was
    /// undone in imago's caches (back to the old value).
    pub fn forget(&self, at: u64) {
        let mut held = lock(&self.state);
        held.unlanded.retain(|u| u.at != at);
    }

    /// Refuses (`InvalidData`) a write that only a corrupt entry sends there: into a writable
    /// qcow2 file, one starting more than [`WRITE_REACH`] past the file's end (looked up again,
    /// with a `statx`, only when the end last seen is too short: the iothread's own writes
    /// grow the file too); into an external data file, one starting past the disk's last
    /// cluster.
    pub fn check_write_at(&self, offset: u64) -> io::Result<()> {
        let disk_end = self.disk_end.load(Ordering::Relaxed);
        if offset >= disk_end {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "a write at byte {offset} of the data file, past the disk's last cluster \
                     (which ends at {disk_end}): a corrupt entry"
                ),
            ));
        }
        let within = |end: u64| offset <= end.saturating_add(WRITE_REACH);
        if !self.bounded || within(self.reach.load(Ordering::Relaxed)) {
            return Ok(());
        }
        let end = file_end(self.file.as_raw_fd())?;
        self.reach.fetch_max(end, Ordering::Relaxed);
        if within(end) {
            return Ok(());
        }
        Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "a write at byte {offset} of a file of {end} bytes, more than {WRITE_REACH} \
                 past its end: a corrupt entry"
            ),
        ))
    }

    /// Records that the file reaches at least `end` (a write that ended there succeeded).
    pub fn reached(&self, end: u64) {
        self.reach.fetch_max(end, Ordering::Relaxed);
    }

    /// Makes this the external data file of a disk whose last cluster ends at `end` (again
    /// after a grow): no write may start at or past it.
    pub fn hold_below_disk_end(&self, end: u64) {
        self.disk_end.store(end, Ordering::Relaxed);
    }
}

/// The size of the file `fd` is open on; `u64::MAX` for anything but a regular file (a block
/// device's size never changes under a mapping). Only the type and size are asked for, and
/// without a sync with a network file system's server: NFS writes a file's dirty pages back
/// before it answers for its times.
pub(crate) fn file_end(fd: RawFd) -> io::Result<u64> {
    // SAFETY: `libc::statx` is plain integers, for which all zeros is a valid value.
    let mut stat: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: statx writes only the buffer handed to it, which is ours and of its type; the
    // empty path with AT_EMPTY_PATH names `fd` itself, which the caller keeps open.
    let rc = unsafe {
        libc::statx(
            fd,
            c"".as_ptr(),
            libc::AT_EMPTY_PATH | libc::AT_STATX_DONT_SYNC,
            libc::STATX_TYPE | libc::STATX_SIZE,
            &mut stat,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    let regular = u32::from(stat.stx_mode) & libc::S_IFMT == libc::S_IFREG;
    Ok(if regular && stat.stx_mask & libc::STATX_SIZE != 0 {
        stat.stx_size
    } else {
        u64::MAX
    })
}

/// Takes the mutex, ignoring poisoning: the held state is consistent after every change.
fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// imago's file driver with the pointer structures' writes held back (see the module).
#[derive(Debug)]
pub struct MetadataFile {
    inner: ImagoFile,
    barrier: Arc<Barrier>,
}

impl fmt::Display for MetadataFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.inner.fmt(f)
    }
}

/// Zeroes `len` bytes at `offset` of `fd`'s file, keeping its size: a hole where the file
/// system makes one, else zeroed blocks.
pub(crate) fn zero_range(fd: RawFd, offset: u64, len: u64) -> io::Result<()> {
    let (Ok(offset), Ok(len)) = (libc::off_t::try_from(offset), libc::off_t::try_from(len)) else {
        return Err(io::Error::from_raw_os_error(libc::EINVAL));
    };
    for mode in [
        libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
        libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE,
    ] {
        // SAFETY: fallocate on an fd the caller holds open; integer arguments only.
        if unsafe { libc::fallocate(fd, mode, offset, len) } == 0 {
            return Ok(());
        }
    }
    Err(io::Error::last_os_error())
}

/// Makes the `length` bytes at `offset` of `file` (a regular file `file_len` bytes long) read as
/// zeros, as imago's own write-zeroes does: a hole punched in what lies inside the file, the
/// file grown over the rest (never shrunk). `Unsupported` where the file system can neither
/// punch nor zero a range: imago then writes zeros itself.
fn zero_file_range(file: &File, file_len: u64, offset: u64, length: u64) -> io::Result<()> {
    let end = offset
        .checked_add(length)
        .ok_or_else(|| io::Error::other("write-zeroes range wraps around"))?;
    let inside = end.min(file_len).saturating_sub(offset);
    if inside > 0 {
        zero_range(file.as_raw_fd(), offset, inside).map_err(|error| {
            match error.raw_os_error() {
                Some(libc::EOPNOTSUPP | libc::ENODEV | libc::ENOTTY) => {
                    io::Error::new(io::ErrorKind::Unsupported, error)
                }
                _ => error,
            }
        })?;
    }
    if end > file_len {
        file.set_len(end)?;
    }
    Ok(())
}

/// Reads a big-endian integer of `N` bytes at `offset` of `header`.
fn be<const N: usize>(header: &[u8], offset: usize) -> Option<u64> {
    let bytes: [u8; N] = header
        .get(offset..offset.checked_add(N)?)?
        .try_into()
        .ok()?;
    Some(bytes.iter().fold(0u64, |acc, b| (acc << 8) | u64::from(*b)))
}

/// The bytes of a qcow2 header that say where its pointer structures are (up to and
/// including the refcount table's cluster count).
const HEADER_FIELDS: usize = 64;

/// The first [`HEADER_FIELDS`] bytes of the header in `file`; `None` if it is shorter.
fn read_header(file: &File) -> Option<[u8; HEADER_FIELDS]> {
    let mut header = [0u8; HEADER_FIELDS];
    file.read_exact_at(&mut header, 0).ok()?;
    Some(header)
}

/// The cluster size of the qcow2 image in `file`, as log2 (`cluster_bits`, 9 to 21); `None`
/// if the header is short or says something else.
pub fn cluster_bits(file: &File) -> Option<u32> {
    let bits = be::<4>(&read_header(file)?, 20)?;
    u32::try_from(bits).ok().filter(|b| (9..=21).contains(b))
}

/// The pointer structures (header cluster, L1 table, refcount table) that `header` names;
/// empty when it cannot say (imago refuses such an image).
fn pointer_ranges(header: &[u8; HEADER_FIELDS]) -> Vec<Range<u64>> {
    let (Some(cluster_bits), Some(l1_size), Some(l1_offset), Some(rt_offset), Some(rt_clusters)) = (
        be::<4>(header, 20),
        be::<4>(header, 36),
        be::<8>(header, 40),
        be::<8>(header, 48),
        be::<4>(header, 56),
    ) else {
        return Vec::new();
    };
    if !(9..=21).contains(&cluster_bits) {
        return Vec::new();
    }
    let cluster = 1u64 << cluster_bits;
    let range = |start: u64, len: Option<u64>| start..start.saturating_add(len.unwrap_or(u64::MAX));
    vec![
        0..cluster,
        range(l1_offset, l1_size.checked_mul(8)),
        range(rt_offset, rt_clusters.checked_mul(cluster)),
    ]
}

impl MetadataFile {
    /// The file, for checks of its own before imago opens it.
    pub fn file(&self) -> &File {
        &self.barrier.file
    }

    /// Wraps `file` (opened `writable` or not) for imago; for a writable qcow2 image, writes to
    /// its pointer structures are held back until the returned barrier is applied. A read-only
    /// file holds nothing.
    pub fn open(file: File, writable: bool, qcow2: bool) -> io::Result<(Self, Arc<Barrier>)> {
        let on_disk = match read_header(&file) {
            Some(header) if writable && qcow2 => pointer_ranges(&header),
            _ => Vec::new(),
        };
        let barrier = Arc::new(Barrier {
            reach: AtomicU64::new(0),
            bounded: writable && qcow2,
            disk_end: AtomicU64::new(u64::MAX),
            file: file.try_clone()?,
            state: Mutex::new(Held {
                writes: Vec::new(),
                pending: on_disk.clone(),
                on_disk,
                unlanded: Vec::new(),
                landed: Vec::new(),
                holds_l2_table: false,
            }),
        });
        let inner = ImagoFile::from_open_file(file, StorageOpenOptions::new().write(writable))?;
        Ok((
            Self {
                inner,
                barrier: Arc::clone(&barrier),
            },
            barrier,
        ))
    }
}

impl Storage for MetadataFile {
    fn mem_align(&self) -> usize {
        self.inner.mem_align()
    }

    fn req_align(&self) -> usize {
        self.inner.req_align()
    }

    fn zero_align(&self) -> usize {
        self.inner.zero_align()
    }

    fn discard_align(&self) -> usize {
        self.inner.discard_align()
    }

    fn size(&self) -> io::Result<u64> {
        self.inner.size()
    }

    fn resolve_relative_path<P: AsRef<Path>>(&self, relative: P) -> io::Result<PathBuf> {
        self.inner.resolve_relative_path(relative)
    }

    fn get_filename(&self) -> Option<PathBuf> {
        self.inner.get_filename()
    }

    unsafe fn pure_readv(&self, mut bufv: IoVectorMut<'_>, offset: u64) -> io::Result<()> {
        let len = bufv.len();
        let held = lock(&self.barrier.state);
        if !held.overlays(offset, len) {
            drop(held);
            // SAFETY: the caller's guarantees for this call are passed on unchanged.
            return unsafe { self.inner.pure_readv(bufv, offset) };
        }
        // A read that meets held writes: read, then lay the held data over it.
        let mut bounce = vec![
            0u8;
            usize::try_from(len)
                .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?
        ];
        // SAFETY: a private buffer, which nothing else accesses during the call.
        unsafe {
            self.inner
                .pure_readv(IoVectorMut::from(&mut bounce[..]), offset)?
        };
        for (at, data) in &held.writes {
            overlay(&mut bounce, offset, *at, data);
        }
        for (at, entry) in &held.landed {
            overlay(&mut bounce, offset, *at, entry);
        }
        // What imago wrote for an entry it must read back as written, not as the file has it.
        for unlanded in &held.unlanded {
            if let Some(wanted) = &unlanded.wanted {
                overlay(&mut bounce, offset, unlanded.at, wanted);
            }
        }
        bufv.copy_from_slice(&bounce);
        Ok(())
    }

    unsafe fn pure_writev(&self, bufv: IoVector<'_>, offset: u64) -> io::Result<()> {
        self.barrier.check_write_at(offset)?;
        let mut held = lock(&self.barrier.state);
        let end = offset.saturating_add(bufv.len());
        let meets = |at: u64| at < end && offset < at.saturating_add(8);
        // An entry whose new value waits for the held writes is written here anyway, with
        // what imago has now: that wins.
        held.landed
            .retain(|&(at, _)| !(offset <= at && at.saturating_add(8) <= end));
        let masks = held.unlanded.iter().any(|u| meets(u.at));
        // An L2 table written while a new refcount block's entry in the refcount table is
        // held waits behind it: imago has written the refcount blocks by now (it flushes them
        // before any L2 table that needs them), but the table that names the new block is
        // still held, and an L2 entry in the file must not point at a cluster counted only
        // by a block the file does not name yet (a crash would leave that cluster free).
        // Once one waits, refcount blocks wait behind it too: when imago frees clusters it
        // writes the L2 tables first and the lowered refcounts after, and that order must
        // hold. And a write over a held one waits behind it, whatever it is.
        let mut hold =
            held.holds(offset, bufv.len()) || held.overlaps_held_write(offset, bufv.len());
        if !hold && held.holds_refcount_table_write() {
            if self.barrier.names_l2_table(&held, offset) {
                held.holds_l2_table = true;
                hold = true;
            } else if held.holds_l2_table {
                hold = self.barrier.names_refcount_block(&held, offset);
            }
        }
        if !masks && !hold {
            drop(held);
            // SAFETY: the caller's guarantees for this call are passed on unchanged.
            return unsafe { self.inner.pure_writev(bufv, offset) };
        }
        let len = usize::try_from(bufv.len())
            .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        let mut data = vec![0u8; len];
        bufv.copy_into_slice(&mut data);
        for unlanded in held.unlanded.iter_mut().filter(|u| meets(u.at)) {
            let mut wanted = unlanded.wanted.unwrap_or(unlanded.old);
            overlay(&mut wanted, unlanded.at, offset, &data);
            unlanded.wanted = Some(wanted);
            overlay(&mut data, offset, unlanded.at, &unlanded.old);
        }
        if !hold {
            drop(held);
            // SAFETY: a private buffer, which nothing else accesses during the call.
            return unsafe { self.inner.pure_writev(IoVector::from(&data[..]), offset) };
        }
        held.writes.push((offset, data));
        if offset < HEADER_FIELDS as u64 {
            // The header changes: where it will put the L1 and refcount tables is a pointer
            // structure from now on, the old ones stay one until the new header is applied.
            if let Some(header) = read_header(&self.barrier.file) {
                let pending = pointer_ranges(&held.pending_header(header));
                if !pending.is_empty() {
                    held.pending = pending;
                }
            }
        }
        Ok(())
    }

    /// Refused while a moved L1 or refcount table's new header is held: imago frees the old
    /// table's clusters right after writing that header, and a cluster reused before the new
    /// header is in the file would be overwritten while the file's header still points there
    /// (and would be held as a pointer structure, behind data written to it directly). imago
    /// then keeps those clusters (leaks them, as `qemu-img check` reports) instead.
    fn settle_writes(&self) -> io::Result<()> {
        if lock(&self.barrier.state).moves_a_table() {
            return Err(io::Error::other(
                "a moved L1 or refcount table's header is not in the file yet",
            ));
        }
        self.inner.settle_writes()
    }

    // imago zeroes and discards data clusters only (copy-on-write of a zero cluster,
    // preallocation), never a pointer structure: nothing here is held.
    //
    // A regular file is zeroed here against its own size, not imago's: the iothread's cluster
    // writes, its extension of the file ahead of them (`engine/cluster_write.rs`) and its
    // in-place data writes grow the file behind imago's back, and imago, which keeps a size
    // of its own, skips zeroing past that size and then *sets* the file's length to the end
    // of the range — which cut off every cluster written beyond (a freed cluster allocated
    // again in place; `tests/tests/qcow2.rs`). No write in flight ends past the file, so the
    // size read here stays true. (imago's `resize` could follow the size instead, but is an
    // ftruncate to the same size: a journal transaction and dropped block preallocations on
    // ext4, a wait for every O_DIRECT write in flight on XFS.)
    unsafe fn pure_write_zeroes(&self, offset: u64, length: u64) -> io::Result<()> {
        let meta = self.barrier.file.metadata()?;
        if !meta.file_type().is_file() {
            // A block device: its size never changes, so imago's is true.
            // SAFETY: the caller's guarantees for this call are passed on unchanged.
            return unsafe { self.inner.pure_write_zeroes(offset, length) };
        }
        let end = meta.len();
        self.barrier.reached(end);
        self.barrier.check_write_at(offset)?;
        zero_file_range(&self.barrier.file, end, offset, length)
    }

    unsafe fn pure_write_allocated_zeroes(&self, offset: u64, length: u64) -> io::Result<()> {
        // SAFETY: the caller's guarantees for this call are passed on unchanged.
        unsafe { self.inner.pure_write_allocated_zeroes(offset, length) }
    }

    // imago's qcow2 code (0.2.6) discards no data through its storage; were it to, a range
    // past imago's stale size would only stay allocated (it never changes the file's size).
    unsafe fn pure_discard(&self, offset: u64, length: u64) -> io::Result<()> {
        // SAFETY: the caller's guarantees for this call are passed on unchanged.
        unsafe { self.inner.pure_discard(offset, length) }
    }

    fn flush(&self) -> io::Result<()> {
        self.inner.flush()
    }

    fn sync(&self) -> io::Result<()> {
        self.inner.sync()
    }

    unsafe fn invalidate_cache(&self) -> io::Result<()> {
        // SAFETY: the caller's guarantees for this call are passed on unchanged.
        unsafe { self.inner.invalidate_cache() }
    }

    fn get_storage_helper(&self) -> &CommonStorageHelper {
        self.inner.get_storage_helper()
    }

    fn resize(&self, new_size: u64, prealloc_mode: PreallocateMode) -> io::Result<()> {
        self.inner.resize(new_size, prealloc_mode)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    const L1: u64 = 0x3_0000;
    const REFTABLE: u64 = 0x1_0000;

    /// A file with a qcow2 header's geometry fields: 64 KiB clusters, a one-entry L1 table at
    /// [`L1`], a one-cluster refcount table at [`REFTABLE`].
    fn image() -> File {
        let mut header = vec![0u8; 0x6_0000];
        header[..4].copy_from_slice(b"QFI\xfb");
        header[20..24].copy_from_slice(&16u32.to_be_bytes());
        header[36..40].copy_from_slice(&1u32.to_be_bytes());
        header[40..48].copy_from_slice(&L1.to_be_bytes());
        header[48..56].copy_from_slice(&REFTABLE.to_be_bytes());
        header[56..60].copy_from_slice(&1u32.to_be_bytes());
        // The refcount table's first block, at 0x20000, counts the header cluster (16-bit).
        header[REFTABLE as usize..REFTABLE as usize + 8]
            .copy_from_slice(&0x2_0000u64.to_be_bytes());
        header[0x2_0000..0x2_0002].copy_from_slice(&1u16.to_be_bytes());
        let mut file = crate::memory::tests::memfd(0);
        file.write_all(&header).unwrap();
        file
    }

    fn read(storage: &MetadataFile, offset: u64, len: usize) -> Vec<u8> {
        let mut buf = vec![0u8; len];
        // SAFETY: a private buffer, which nothing else touches during the call.
        unsafe { storage.pure_readv(IoVectorMut::from(&mut buf[..]), offset) }.unwrap();
        buf
    }

    fn write(storage: &MetadataFile, offset: u64, data: &[u8]) {
        // SAFETY: a private buffer, which nothing else touches during the call.
        unsafe { storage.pure_writev(IoVector::from(data), offset) }.unwrap();
    }

    fn on_disk(file: &File, offset: u64, len: usize) -> Vec<u8> {
        let mut buf = vec![0u8; len];
        file.read_exact_at(&mut buf, offset).unwrap();
        buf
    }

    #[test]
    fn pointer_writes_wait_for_the_barrier_and_reads_see_them() {
        let file = image();
        let (storage, barrier) = MetadataFile::open(file.try_clone().unwrap(), true, true).unwrap();
        // An L1 entry and a refcount-table entry are held; an L2 table's write is not (while
        // no refcount-table entry is held: see below).
        write(&storage, L1, &[0x80, 0, 0, 0, 0, 5, 0, 0]);
        write(&storage, 0x5_0000, &[7; 16]);
        write(&storage, REFTABLE + 8, &[0, 0, 0, 0, 0, 6, 0, 0]);
        assert_eq!(on_disk(&file, 0x5_0000, 16), [7; 16]);
        assert_eq!(
            on_disk(&file, L1, 8),
            [0; 8],
            "the L1 entry reached the file early"
        );
        assert_eq!(on_disk(&file, REFTABLE + 8, 8), [0; 8]);
        assert!(!barrier.is_empty());
        // A read across the held L1 entry sees it, laid over what the file has.
        let around = read(&storage, L1 - 4, 16);
        assert_eq!(around[4..12], [0x80, 0, 0, 0, 0, 5, 0, 0]);
        assert_eq!(around[..4], [0; 4]);
        // A later write of the same entry wins, in order.
        write(&storage, L1 + 5, &[9]);
        assert_eq!(read(&storage, L1, 8), [0x80, 0, 0, 0, 0, 9, 0, 0]);
        barrier.apply().unwrap();
        assert!(barrier.is_empty());
        assert_eq!(on_disk(&file, L1, 8), [0x80, 0, 0, 0, 0, 9, 0, 0]);
        assert_eq!(on_disk(&file, REFTABLE + 8, 8), [0, 0, 0, 0, 0, 6, 0, 0]);
    }

    /// imago moves the L1 table (a grow) the way it moves the refcount table: the new table
    /// written, then the header pointing there, then the old table freed.
    #[test]
    fn a_moved_table_is_held_at_both_places_until_its_header_is_applied() {
        const NEW_L1: u64 = 0x4_0000;
        let file = image();
        let (storage, barrier) = MetadataFile::open(file.try_clone().unwrap(), true, true).unwrap();
        // The new table is no pointer structure yet: written straight away.
        write(&storage, NEW_L1, &[0x80, 0, 0, 0, 0, 5, 0, 0]);
        assert_eq!(on_disk(&file, NEW_L1, 1), [0x80]);
        assert!(storage.settle_writes().is_ok());
        // The header's L1 fields (size, offset) now name it, two entries long.
        let mut fields = 2u32.to_be_bytes().to_vec();
        fields.extend_from_slice(&NEW_L1.to_be_bytes());
        write(&storage, 36, &fields);
        assert_eq!(
            on_disk(&file, 40, 8),
            L1.to_be_bytes(),
            "header written early"
        );
        // Until that header is in the file, imago may not reuse the old table's cluster...
        assert!(storage.settle_writes().is_err());
        // ... and writes to either table wait for it.
        write(&storage, NEW_L1 + 8, &[0x80; 8]);
        write(&storage, L1, &[0x80; 8]);
        assert_eq!(on_disk(&file, NEW_L1 + 8, 8), [0; 8]);
        assert_eq!(on_disk(&file, L1, 8), [0; 8]);
        assert_eq!(read(&storage, NEW_L1 + 8, 8), [0x80; 8]);
        barrier.apply().unwrap();
        assert_eq!(on_disk(&file, 40, 8), NEW_L1.to_be_bytes());
        assert_eq!(on_disk(&file, NEW_L1 + 8, 8), [0x80; 8]);
        assert!(storage.settle_writes().is_ok());
        // The old table's cluster is free for anything now: its writes go straight through,
        // while the new table's wait.
        write(&storage, L1, &[7; 16]);
        assert_eq!(on_disk(&file, L1, 16), [7; 16]);
        write(&storage, NEW_L1, &[9; 8]);
        assert_eq!(on_disk(&file, NEW_L1, 1), [0x80]);
        assert!(!barrier.is_empty());
        // A header write that moves nothing (a new size) holds no cluster back.
        barrier.apply().unwrap();
        write(&storage, 24, &(8 * 1024 * 1024u64).to_be_bytes());
        assert!(storage.settle_writes().is_ok());
        barrier.apply().unwrap();
        assert_eq!(on_disk(&file, 24, 8), (8 * 1024 * 1024u64).to_be_bytes());
    }

    /// An L2 entry held for a cluster whose data is not written yet: every write of its table
    /// carries the old value, reads see what imago wrote; once landed, the new value follows
    /// with the held writes — unless imago wrote the table again meanwhile, whose value wins.
    #[test]
    fn an_unlanded_l2_entry_keeps_its_old_value_in_the_file() {
        const L2: u64 = 0x5_0000;
        let file = image();
        let (storage, barrier) = MetadataFile::open(file.try_clone().unwrap(), true, true).unwrap();
        assert_eq!(barrier.l2_entry_offset(3 << 16), None, "no L2 table yet");
        // The L1 entry names an L2 table (held until applied, seen anyway).
        write(&storage, L1, &(L2 | 1 << 63).to_be_bytes());
        let entry = barrier.l2_entry_offset(3 << 16).unwrap();
        assert_eq!(entry, L2 + 3 * 8);
        barrier.apply().unwrap();
        // Out of the L1 table's one entry (each maps 8192 clusters of 64 KiB).
        assert_eq!(barrier.l2_entry_offset(8192 << 16), None);
        let mapped = 0x8000_0000_0009_0000u64.to_be_bytes();
        let mut table = vec![0u8; 64];
        table[24..32].copy_from_slice(&mapped);
        table[8..16].copy_from_slice(&[0x11; 8]);
        barrier.hold_entry(entry, 0);
        write(&storage, L2, &table);
        assert_eq!(
            on_disk(&file, L2 + 8, 8),
            [0x11; 8],
            "the rest of the table"
        );
        assert_eq!(
            on_disk(&file, entry, 8),
            [0; 8],
            "the entry reached the file"
        );
        assert_eq!(
            read(&storage, entry, 8),
            mapped,
            "imago reads what it wrote"
        );
        barrier.land(entry);
        assert_eq!(on_disk(&file, entry, 8), [0; 8]);
        assert!(!barrier.is_empty());
        barrier.apply().unwrap();
        assert_eq!(on_disk(&file, entry, 8), mapped);
        // Landed, then the table written again: what imago wrote last stays.
        let second = L2 + 5 * 8;
        barrier.hold_entry(second, 0);
        write(&storage, second, &[0x22; 8]);
        assert_eq!(on_disk(&file, second, 8), [0; 8]);
        barrier.land(second);
        write(&storage, L2, &[0x33; 64]);
        barrier.apply().unwrap();
        assert_eq!(on_disk(&file, second, 8), [0x33; 8]);
        // Forgotten (undone): nothing is written for it.
        let third = L2 + 6 * 8;
        barrier.hold_entry(third, 0);
        write(&storage, third, &[0x44; 8]);
        barrier.forget(third);
        barrier.apply().unwrap();
        assert_eq!(on_disk(&file, third, 8), [0; 8]);
        assert!(barrier.is_empty());
    }

    /// While a new refcount block's entry in the refcount table is held, the L2 tables the
    /// L1 table names wait behind it (in order); the refcount block itself, and anything that
    /// is no L2 table, is written at once. Without such an entry, L2 tables go straight on.
    #[test]
    fn l2_tables_wait_behind_a_held_refcount_table_entry() {
        const L2: u64 = 0x5_0000;
        const NEW_BLOCK: u64 = 0x6_0000;
        let file = image();
        let (storage, barrier) = MetadataFile::open(file.try_clone().unwrap(), true, true).unwrap();
        write(&storage, L1, &(L2 | 1 << 63).to_be_bytes());
        barrier.apply().unwrap();
        write(&storage, L2, &[0x11; 16]);
        assert_eq!(on_disk(&file, L2, 16), [0x11; 16]);
        // imago allocates a refcount block: written, then named in the refcount table (held).
        write(&storage, NEW_BLOCK, &[0, 1, 0, 1]);
        write(&storage, REFTABLE + 8, &NEW_BLOCK.to_be_bytes());
        assert_eq!(on_disk(&file, NEW_BLOCK, 4), [0, 1, 0, 1]);
        assert_eq!(on_disk(&file, REFTABLE + 8, 8), [0; 8]);
        // Its flush: the block again (at once), then the L2 table (held), then data (at once).
        write(&storage, NEW_BLOCK, &[0, 1, 0, 1, 0, 1]);
        write(&storage, L2, &[0x22; 16]);
        write(&storage, 0x7_0000, &[0x33; 16]);
        assert_eq!(on_disk(&file, NEW_BLOCK, 6), [0, 1, 0, 1, 0, 1]);
        assert_eq!(
            on_disk(&file, L2, 16),
            [0x11; 16],
            "the L2 table went ahead"
        );
        assert_eq!(on_disk(&file, 0x7_0000, 16), [0x33; 16]);
        assert_eq!(
            read(&storage, L2, 16),
            [0x22; 16],
            "imago reads what it wrote"
        );
        // Clusters freed now: L2 tables first, then the lowered refcounts — a refcount block
        // (the refcount table names both) now waits behind the held table, in order; a second
        // write of a held table waits too.
        write(&storage, 0x2_0002, &[0, 2]);
        write(&storage, NEW_BLOCK, &[0, 0]);
        write(&storage, L2 + 8, &[0x55; 8]);
        assert_eq!(on_disk(&file, 0x2_0002, 2), [0, 0]);
        assert_eq!(on_disk(&file, NEW_BLOCK, 2), [0, 1]);
        assert_eq!(on_disk(&file, L2 + 8, 8), [0x11; 8]);
        barrier.apply().unwrap();
        assert_eq!(on_disk(&file, REFTABLE + 8, 8), NEW_BLOCK.to_be_bytes());
        assert_eq!(on_disk(&file, L2, 16), [[0x22; 8], [0x55; 8]].concat());
        assert_eq!(on_disk(&file, 0x2_0002, 2), [0, 2]);
        assert_eq!(on_disk(&file, NEW_BLOCK, 2), [0, 0]);
        // Nothing held: straight on again.
        write(&storage, L2, &[0x44; 16]);
        assert_eq!(on_disk(&file, L2, 16), [0x44; 16]);
    }

    #[test]
    fn read_only_files_and_raw_layers_hold_nothing() {
        let file = image();
        for (writable, qcow2) in [(false, true), (true, false)] {
            let (storage, barrier) =
                MetadataFile::open(file.try_clone().unwrap(), writable, qcow2).unwrap();
            assert!(lock(&barrier.state).on_disk.is_empty());
            if writable {
                write(&storage, L1, &[1; 8]);
                assert_eq!(on_disk(&file, L1, 8), [1; 8]);
            }
            assert!(barrier.is_empty());
        }
    }

    #[test]
    fn an_image_whose_refcounts_miss_its_header_is_told_apart() {
        use blkplane_chain::header_is_refcounted;
        let good = image();
        assert!(header_is_refcounted(&good));
        // No block for cluster 0 (what made imago recurse until the stack overflowed).
        let no_block = image();
        no_block.write_all_at(&[0; 8], REFTABLE).unwrap();
        assert!(!header_is_refcounted(&no_block));
        // A block that counts the header as free.
        let free_header = image();
        free_header.write_all_at(&[0, 0], 0x2_0000).unwrap();
        assert!(!header_is_refcounted(&free_header));
        // Version 3 with 1-bit refcounts (refcount_order 0 at byte 96), packed from bit 0.
        let narrow = image();
        narrow.write_all_at(&3u32.to_be_bytes(), 4).unwrap();
        narrow.write_all_at(&0u32.to_be_bytes(), 96).unwrap();
        narrow.write_all_at(&[0b0000_0001], 0x2_0000).unwrap();
        assert!(header_is_refcounted(&narrow));
        narrow.write_all_at(&[0b0000_0010], 0x2_0000).unwrap();
        assert!(!header_is_refcounted(&narrow));
        // A refcount table past the end of the file reads as nothing.
        let short = crate::memory::tests::memfd(0);
        short.write_all_at(&on_disk(&image(), 0, 64), 0).unwrap();
        assert!(!header_is_refcounted(&short));
    }

    #[test]
    fn zeroing_punches_inside_the_file_and_grows_it_past_its_end_never_shrinking_it() {
        let dir = std::env::temp_dir().join(format!("bp-zero-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("f");
        std::fs::write(&path, vec![0xaa_u8; 0x4_0000]).unwrap();
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .unwrap();
        // Inside: zeros there, the rest and the size kept.
        zero_file_range(&file, 0x4_0000, 0x1_0000, 0x1_0000).unwrap();
        assert_eq!(on_disk(&file, 0x1_0000, 0x1_0000), vec![0; 0x1_0000]);
        assert_eq!(on_disk(&file, 0, 0x1_0000), vec![0xaa; 0x1_0000]);
        assert_eq!(on_disk(&file, 0x2_0000, 0x2_0000), vec![0xaa; 0x2_0000]);
        assert_eq!(file.metadata().unwrap().len(), 0x4_0000);
        // Across the end: zeros inside, the file grown to the range's end.
        zero_file_range(&file, 0x4_0000, 0x3_0000, 0x2_0000).unwrap();
        assert_eq!(file.metadata().unwrap().len(), 0x5_0000);
        assert_eq!(on_disk(&file, 0x3_0000, 0x2_0000), vec![0; 0x2_0000]);
        assert_eq!(on_disk(&file, 0x2_0000, 0x1_0000), vec![0xaa; 0x1_0000]);
        // A range inside the file ends before it: nothing is cut (imago's own zeroing set the
        // length to the range's end when it thought the file shorter).
        zero_file_range(&file, 0x5_0000, 0, 0x1_0000).unwrap();
        assert_eq!(file.metadata().unwrap().len(), 0x5_0000);
        assert_eq!(on_disk(&file, 0x2_0000, 0x1_0000), vec![0xaa; 0x1_0000]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Writes may start up to [`WRITE_REACH`] past a writable qcow2 file's end, as imago's new
    /// clusters do; one farther out is refused until the file has grown (behind the barrier's
    /// back, as the iothread's own writes grow it); a read-only file is never bounded, an
    /// external data file by the disk's size.
    #[test]
    fn writes_far_past_the_end_are_refused_until_the_file_reaches_them() {
        let dir = std::env::temp_dir().join(format!("bp-reach-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("f");
        std::fs::write(&path, vec![0u8; 0x1_0000]).unwrap();
        let open = |writable, qcow2| {
            let file = std::fs::OpenOptions::new()
                .read(true)
                .write(writable)
                .open(&path)
                .unwrap();
            MetadataFile::open(file, writable, qcow2).unwrap().1
        };
        let barrier = open(true, true);
        let farthest = 0x1_0000 + WRITE_REACH;
        assert!(barrier.check_write_at(0).is_ok());
        assert!(barrier.check_write_at(farthest).is_ok());
        let refused = barrier.check_write_at(farthest + 1).unwrap_err();
        assert_eq!(refused.kind(), io::ErrorKind::InvalidData, "{refused}");
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(0x2_0000)
            .unwrap();
        assert!(barrier.check_write_at(farthest + 1).is_ok());
        assert!(open(false, true).check_write_at(1 << 60).is_ok());
        // An external data file (writable, not qcow2): below the disk's last cluster, however
        // short the file.
        let data = open(true, false);
        data.hold_below_disk_end(4 * WRITE_REACH);
        assert!(data.check_write_at(4 * WRITE_REACH - 512).is_ok());
        assert!(data.check_write_at(4 * WRITE_REACH).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_header_that_does_not_parse_holds_nothing() {
        assert!(read_header(&crate::memory::tests::memfd(16)).is_none());
        assert_eq!(pointer_ranges(&read_header(&image()).unwrap()).len(), 3);
        let bad = image();
        bad.write_all_at(&40u32.to_be_bytes(), 20).unwrap();
        assert!(
            pointer_ranges(&read_header(&bad).unwrap()).is_empty(),
            "cluster_bits 40"
        );
        let (_, barrier) = MetadataFile::open(bad, true, true).unwrap();
        assert!(lock(&barrier.state).on_disk.is_empty());
    }
}
