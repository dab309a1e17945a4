//! qcow2 allocating writes on an image served through O_DIRECT: the cluster is written whole,
//! through io_uring, while the loop goes on.
//!
//! Why: imago writes what an allocation copies through the buffered fd, so the page cache of
//! the image file filled with dirty clusters, and every later O_DIRECT write into one of them
//! had to wait for the kernel to write it back first (and for the file's lock, which those
//! buffered writes took). A thin clone of a golden image at QD32 ran at a sixth of
//! qemu-storage-daemon's rate, its iothread asleep most of the time.
//!
//! How, for a write that leaves part of a cluster the image leaves unallocated to the backing
//! chain (the first write into a thin clone's cluster; a write with nothing to copy — a whole
//! cluster, a fresh image's zeros — is cheaper in place, through the page cache, and takes
//! [`super::chain`]'s in-place allocation like every other):
//! 1. *Fill*: the cluster's old data — what the backing chain has there — is read into one of
//!    a few cluster-sized buffers, through io_uring (zeros and compressed data without it);
//!    the part the guest overwrites is not read, unless it is small and old data follows it
//!    (then one read takes both sides, as QEMU does: [`MERGED_READ_GAP`]).
//! 2. The guest's data is copied in, and imago maps the cluster in its caches at once
//!    ([`Qcow2Image::allocate_cluster_ahead`](crate::qcow2::Qcow2Image::allocate_cluster_ahead): it copies nothing, the write covers the
//!    cluster), while the L2 entry in the file keeps its old value.
//! 3. *Write*: the whole cluster goes to the image's O_DIRECT fd through io_uring.
//! 4. Its completion lets the entry reach the file ([`Qcow2Image::cluster_written`](crate::qcow2::Qcow2Image::cluster_written)) with the
//!    next write-back, which runs before the request is acknowledged (as for every
//!    allocation: [`Core::write_back_allocations`]). A failed write unmaps the cluster again.
//!
//! From the fill's start to the write's completion every other request that touches the
//! cluster (a read would find the new mapping before its data, a write could be overwritten
//! by the whole cluster) waits in [`ClusterWrites::waiting`]; so do allocations when all
//! buffers are in use; a mapping stops short of the first cluster in flight. A killed
//! iothread leaves the old entry in the file (the cluster is leaked at worst) and the frontend
//! resubmits the request. The image file's size is extended ahead of the cluster writes
//! ([`EXTEND_AHEAD`]), so that they overlap at the device.

use std::collections::VecDeque;
use std::ops::Range;

use io_uring::{opcode, squeue, types};
use log::warn;

use super::{Core, EngineError, Token};
use crate::qcow2::{ClusterAllocation, Extent};
use crate::slot::TransferTarget;

/// The most memory the cluster buffers of one iothread take (resident only as far as
/// used: the free list hands out the buffer freed last first).
const BUFFER_BUDGET: usize = 8 << 20;

/// The most cluster writes in flight at once (beyond queue depth 64 they wait for a buffer).
const MAX_BUFFERS: usize = 64;

/// How far beyond a cluster write that would extend the image file the file's size is
/// extended at once — sparsely (`ftruncate`: a hole, reading as zeros, refcounted by nothing;
/// imago's allocator hands those clusters out next). An O_DIRECT write past the end of a file
/// runs alone: ext4 takes the inode lock exclusively for it and holds it through the device
/// time; one into a hole inside the file holds it only while it allocates the blocks, so
/// cluster writes overlap at the device. Not `fallocate` (what QEMU's `preallocate` filter
/// does): blocks allocated ahead in large extents and written later made every later 4 KiB
/// overwrite of the clusters a quarter slower on the virtual disk measured, where blocks the
/// writes allocate themselves lie as qemu-storage-daemon's do (BENCHMARKS.md, "Issue 17, the
/// thin clone's copy-on-write in one read, its file extended as a hole").
const EXTEND_AHEAD: u64 = 8 << 20;

/// The largest guest part of a cluster the fill reads through (old data the guest's bytes then
/// overwrite) rather than read the old data before and after it separately: QEMU's qcow2
/// merges its copy-on-write reads up to the same size (`perform_cow`).
const MERGED_READ_GAP: u64 = 16 << 10;

/// The alignment of the buffers: O_DIRECT's on any device.
const BUFFER_ALIGN: usize = 4096;

/// Where a slot's whole-cluster allocating write stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ClusterWrite {
    /// None in progress.
    Idle,
    /// Reading the cluster's old data into `buffer`: `filled` bytes are in; a read of
    /// `reading` bytes at `filled`, from `host_offset` of `layer`'s file, is queued or at the
    /// device (`reading` 0: none).
    Filling {
        cluster: u64,
        buffer: u32,
        filled: u64,
        reading: u32,
        layer: usize,
        host_offset: u64,
    },
    /// The whole cluster is being written from `buffer`; `guest_bytes` of the request are in
    /// it.
    Writing {
        buffer: u32,
        allocation: ClusterAllocation,
        guest_bytes: u64,
    },
}

/// The per-iothread state of whole-cluster allocating writes.
pub(super) struct ClusterWrites {
    /// Per slot.
    states: Vec<ClusterWrite>,
    /// The buffers, allocated with the first such write: `count` clusters from `start`.
    memory: Vec<u8>,
    start: usize,
    cluster: usize,
    /// One iovec per buffer (what the write's SQE points at).
    iovecs: Vec<libc::iovec>,
    free: Vec<u32>,
    /// The guest ranges of the clusters being filled or written.
    in_flight: Vec<Range<u64>>,
    /// Slots waiting for a cluster in flight or for a free buffer; each at most once.
    waiting: VecDeque<u32>,
    /// A cluster write ended since the waiting slots were last retried.
    ended: bool,
    /// Clusters whose write failed and whose mapping could not be undone: imago maps them to a
    /// cluster without their data, so every request that meets one fails (the image is
    /// read-only from then on; the file keeps the old mapping).
    poisoned: Vec<Range<u64>>,
    /// The O_DIRECT fd refused a cluster write's alignment, or the image file could not be
    /// extended ahead of one: allocations run in place from then on.
    direct_refused: bool,
    /// How far the image file is known to reach (extended ahead by [`EXTEND_AHEAD`]).
    file_end: u64,
    /// The image is not a regular file (a block device): its size is fixed.
    not_a_file: bool,
}

impl ClusterWrites {
    /// The state of `slots` slots; no buffer yet.
    pub(super) fn new(slots: u32) -> Result<Self, EngineError> {
        let count = slots as usize;
        let mut states = Vec::new();
        states
            .try_reserve_exact(count)
            .map_err(|_| EngineError::Alloc(slots))?;
        states.resize(count, ClusterWrite::Idle);
        let mut waiting = VecDeque::new();
        waiting
            .try_reserve_exact(count)
            .map_err(|_| EngineError::Alloc(slots))?;
        Ok(Self {
            states,
            memory: Vec::new(),
            start: 0,
            cluster: 0,
            iovecs: Vec::new(),
            free: Vec::new(),
            in_flight: Vec::new(),
            waiting,
            ended: false,
            poisoned: Vec::new(),
            direct_refused: false,
            file_end: 0,
            not_a_file: false,
        })
    }

    /// Whether a cluster being written overlaps the `len` guest bytes at `offset`.
    pub(super) fn blocks(&self, offset: u64, len: u64) -> bool {
        overlaps(&self.in_flight, offset, len)
    }

    /// How many of the `len` guest bytes at `offset` come before the first cluster being
    /// written; `None` if `offset` is in one.
    fn clear_len(&self, offset: u64, len: u64) -> Option<u64> {
        let mut clear = len;
        for range in &self.in_flight {
            if range.contains(&offset) {
                return None;
            }
            if range.start > offset {
                clear = clear.min(range.start.saturating_sub(offset));
            }
        }
        Some(clear)
    }

    /// Whether the `len` guest bytes at `offset` meet a cluster whose failed write could not
    /// be undone (see [`ClusterWrites::poisoned`]).
    pub(super) fn is_poisoned(&self, offset: u64, len: u64) -> bool {
        !self.poisoned.is_empty() && overlaps(&self.poisoned, offset, len)
    }

    /// Sets up buffers of `cluster` bytes aligned to `align` (a power of two), once: as many as
    /// [`BUFFER_BUDGET`] holds, at most one per slot and [`MAX_BUFFERS`]; false if that cannot be done.
    fn ensure_buffers(&mut self, cluster: usize, align: usize, slots: usize) -> bool {
        if !self.memory.is_empty() {
            return self.cluster == cluster;
        }
        let count = BUFFER_BUDGET
            .checked_div(cluster)
            .unwrap_or(1)
            .clamp(1, slots.clamp(1, MAX_BUFFERS));
        let Some(bytes) = cluster
            .checked_mul(count)
            .and_then(|n| n.checked_add(align))
        else {
            return false;
        };
        // Zeroed by the allocator (fresh anonymous pages for a size like this): only the
        // buffers in use become resident, not the whole budget.
        let mut memory = vec![0u8; bytes];
        let start = memory.as_ptr().align_offset(align);
        if start >= align {
            return false;
        }
        self.iovecs = (0..count)
            .map(|index| libc::iovec {
                // In bounds: start + count * cluster <= bytes. The memory is never resized
                // or moved afterwards, so the pointers stay valid.
                iov_base: memory
                    .as_mut_ptr()
                    .wrapping_add(start.saturating_add(index.saturating_mul(cluster)))
                    .cast(),
                iov_len: cluster,
            })
            .collect();
        self.memory = memory;
        self.start = start;
        self.cluster = cluster;
        // Handed out from the end: buffer 0 first.
        self.free = (0..count)
            .rev()
            .filter_map(|i| u32::try_from(i).ok())
            .collect();
        true
    }

    /// The bytes of `buffer`.
    fn buffer_mut(&mut self, buffer: u32) -> Option<&mut [u8]> {
        let from = self
            .start
            .checked_add((buffer as usize).checked_mul(self.cluster)?)?;
        self.memory.get_mut(from..from.checked_add(self.cluster)?)
    }

    /// Ends the slot's cluster write: its buffer and cluster are free again.
    fn end(&mut self, slot: u32) {
        let Some(state) = self.states.get_mut(slot as usize) else {
            return;
        };
        let (buffer, cluster) = match std::mem::replace(state, ClusterWrite::Idle) {
            ClusterWrite::Idle => return,
            ClusterWrite::Filling {
                cluster, buffer, ..
            } => (buffer, cluster),
            ClusterWrite::Writing {
                buffer, allocation, ..
            } => (buffer, allocation.cluster_offset()),
        };
        self.free.push(buffer);
        self.in_flight.retain(|range| range.start != cluster);
        self.ended = true;
    }
}

impl Core {
    /// Starts a whole-cluster allocating write of the slot's next bytes (at guest `offset`,
    /// which no cluster in flight overlaps) where it applies: an image served through
    /// io_uring with an O_DIRECT fd whose blocks divide the cluster, and a cluster the image
    /// leaves unallocated. Returns whether it did (or the slot waits for a buffer to do so):
    /// the slot moves on when its I/O completes; if not, the in-place allocation runs.
    pub(super) fn begin_cluster_write(
        &mut self,
        slot: u32,
        offset: u64,
    ) -> Result<bool, EngineError> {
        let Some(chain) = self.image.qcow2_chain() else {
            return Ok(false);
        };
        let count = self.slots.count();
        let remaining = self
            .states
            .get(slot as usize)
            .ok_or(EngineError::BadSlot { slot, count })?
            .remaining();
        let cluster_size = chain.cluster_size();
        let block = u64::from(self.image.block_size()).max(1);
        let cluster = offset & !cluster_size.saturating_sub(1);
        // Only a write that leaves part of its cluster to the backing chain's data: one with
        // nothing to copy (a whole cluster, or a fresh image's zeros) costs nothing but the
        // write in place, to the page cache, which measured faster (BENCHMARKS.md).
        let whole = offset == cluster && remaining >= cluster_size;
        if whole
            || self.cluster_writes.direct_refused
            || self.image.transfers_inline()
            || self.image.direct().is_none()
            || cluster_size.checked_rem(block) != Some(0)
            || !chain.backing_shows_through(offset)
        {
            return Ok(false);
        }
        let slots = self.states.len();
        let align = blkplane_proto::usize_from(block).max(BUFFER_ALIGN);
        let writes = &mut self.cluster_writes;
        if !writes.ensure_buffers(blkplane_proto::usize_from(cluster_size), align, slots) {
            return Ok(false);
        }
        let Some(buffer) = writes.free.pop() else {
            writes.waiting.push_back(slot);
            return Ok(true);
        };
        writes
            .in_flight
            .push(cluster..cluster.saturating_add(cluster_size));
        if let Some(state) = writes.states.get_mut(slot as usize) {
            *state = ClusterWrite::Filling {
                cluster,
                buffer,
                filled: 0,
                reading: 0,
                layer: 0,
                host_offset: 0,
            };
        }
        self.fill_cluster(slot)?;
        Ok(true)
    }

    /// Reads the slot's cluster's old data into its buffer until a read has to wait for
    /// io_uring, then writes the cluster.
    fn fill_cluster(&mut self, slot: u32) -> Result<(), EngineError> {
        let count = self.slots.count();
        loop {
            let Some(&ClusterWrite::Filling {
                cluster,
                buffer,
                filled,
                ..
            }) = self.cluster_writes.states.get(slot as usize)
            else {
                return Ok(());
            };
            let state = self
                .states
                .get(slot as usize)
                .ok_or(EngineError::BadSlot { slot, count })?;
            let Some(chain) = self.image.qcow2_chain_mut() else {
                return self.fail_cluster_write(slot, libc::EBADF);
            };
            let size = chain.cluster_size();
            // The guest's own bytes in the cluster are not read (but see below).
            let guest_start = state.guest_offset().saturating_sub(cluster);
            let guest_end = guest_start.saturating_add(state.remaining()).min(size);
            let from = if (guest_start..guest_end).contains(&filled) {
                guest_end
            } else {
                filled
            };
            if from >= size {
                return self.write_cluster(slot);
            }
            // Up to the guest's part — or through it to the cluster's end when it is small and
            // old data follows it: one device round trip instead of two (the guest's bytes
            // are copied over it afterwards), as QEMU's qcow2 merges its two copy-on-write
            // reads.
            let read_through_guest =
                guest_end < size && guest_end.saturating_sub(guest_start) <= MERGED_READ_GAP;
            let upto = if from < guest_start && !read_through_guest {
                guest_start
            } else {
                size
            };
            let want = upto.saturating_sub(from);
            let extent = match chain.map(cluster.saturating_add(from), want) {
                Ok(extent) if !extent.is_empty() => extent,
                Ok(_) => return self.fail_cluster_write(slot, libc::EIO),
                Err(e) => {
                    if self.complaints.should_log() {
                        warn!("slot {slot}: mapping the old data of the cluster at {cluster}: {e}");
                    }
                    return self.fail_cluster_write(slot, e.raw_os_error().unwrap_or(libc::EIO));
                }
            };
            let len = extent.len().min(want);
            let (Ok(at), Ok(n)) = (usize::try_from(from), usize::try_from(len)) else {
                return self.fail_cluster_write(slot, libc::EINVAL);
            };
            match extent {
                Extent::Data {
                    layer, host_offset, ..
                } => {
                    if chain.layer_fd(layer).is_none() {
                        return self.fail_cluster_write(slot, libc::EBADF);
                    }
                    // At most a cluster (2 MiB): fits.
                    let reading = u32::try_from(len).unwrap_or(u32::MAX);
                    if let Some(ClusterWrite::Filling {
                        filled,
                        reading: r,
                        layer: l,
                        host_offset: h,
                        ..
                    }) = self.cluster_writes.states.get_mut(slot as usize)
                    {
                        *filled = from;
                        *r = reading;
                        *l = layer;
                        *h = host_offset;
                    }
                    self.pending.push_back(Token::FillCluster { slot });
                    return Ok(());
                }
                Extent::Zero { .. } => {
                    if let Some(part) = self
                        .cluster_writes
                        .buffer_mut(buffer)
                        .and_then(|b| b.get_mut(at..at.saturating_add(n)))
                    {
                        part.fill(0);
                    }
                }
                Extent::Compressed { .. } => {
                    let Some(part) = self
                        .cluster_writes
                        .buffer_mut(buffer)
                        .and_then(|b| b.get_mut(at..at.saturating_add(n)))
                    else {
                        return self.fail_cluster_write(slot, libc::EINVAL);
                    };
                    let iov = [libc::iovec {
                        iov_base: part.as_mut_ptr().cast(),
                        iov_len: part.len(),
                    }];
                    let chain = self.image.qcow2_chain_mut();
                    // SAFETY: the iovec describes a part of the engine's own buffer, which
                    // nothing else uses while the slot fills it.
                    let read = chain.map(|chain| unsafe {
                        chain.read_through(cluster.saturating_add(from), len, &iov)
                    });
                    if let Some(Err(e)) = read {
                        if self.complaints.should_log() {
                            warn!("slot {slot}: reading compressed data at {cluster}: {e}");
                        }
                        return self
                            .fail_cluster_write(slot, e.raw_os_error().unwrap_or(libc::EIO));
                    }
                }
            }
            if let Some(ClusterWrite::Filling { filled, .. }) =
                self.cluster_writes.states.get_mut(slot as usize)
            {
                *filled = from.saturating_add(len);
            }
        }
    }

    /// The SQE of the slot's fill read or cluster write.
    pub(super) fn cluster_write_sqe(&mut self, token: Token) -> Option<squeue::Entry> {
        let slot = match token {
            Token::FillCluster { slot } | Token::WriteCluster { slot } => slot,
            _ => return None,
        };
        let state = *self.cluster_writes.states.get(slot as usize)?;
        let entry = match (token, state) {
            (
                Token::FillCluster { .. },
                ClusterWrite::Filling {
                    buffer,
                    filled,
                    reading,
                    layer,
                    host_offset,
                    ..
                },
            ) => {
                // `fill_cluster` checked the fd before it queued the read.
                let fd = self.image.qcow2_chain()?.layer_fd(layer)?;
                let at = usize::try_from(filled).ok()?;
                let target = self
                    .cluster_writes
                    .buffer_mut(buffer)?
                    .get_mut(at..at.checked_add(reading as usize)?)?;
                opcode::Read::new(types::Fd(fd), target.as_mut_ptr(), reading)
                    .offset(host_offset)
                    .build()
            }
            (
                Token::WriteCluster { .. },
                ClusterWrite::Writing {
                    buffer, allocation, ..
                },
            ) => {
                let fd = self.image.direct()?;
                let iovec = self.cluster_writes.iovecs.get(buffer as usize)?;
                opcode::Writev::new(types::Fd(std::os::fd::AsRawFd::as_raw_fd(fd)), iovec, 1)
                    .offset(allocation.host_offset)
                    .build()
            }
            _ => {
                warn!("slot {slot}: {token:?} queued in cluster write state {state:?}");
                return None;
            }
        };
        Some(entry.user_data(token.encode()))
    }

    /// A fill read or cluster write whose SQE could not be built: failed as if the kernel had
    /// failed it, so that the slot does not hold its buffer and cluster for good.
    pub(super) fn cluster_write_unqueued(&mut self, token: Token) -> Result<(), EngineError> {
        match token {
            Token::FillCluster { slot } => self.cluster_filled(slot, -libc::EIO),
            Token::WriteCluster { slot } => self.cluster_written(slot, -libc::EIO),
            _ => Ok(()),
        }
    }

    /// A fill read of the slot completed with `result`.
    pub(super) fn cluster_filled(&mut self, slot: u32, result: i32) -> Result<(), EngineError> {
        let Some(ClusterWrite::Filling {
            buffer,
            filled,
            reading,
            ..
        }) = self.cluster_writes.states.get_mut(slot as usize)
        else {
            warn!("ignoring a stale cluster fill completion for slot {slot}");
            return Ok(());
        };
        if matches!(result.saturating_neg(), libc::EAGAIN | libc::EINTR) {
            self.pending.push_back(Token::FillCluster { slot });
            return Ok(());
        }
        if result < 0 {
            if self.complaints.should_log() {
                warn!(
                    "slot {slot}: reading the old data of a cluster: {}",
                    std::io::Error::from_raw_os_error(result.saturating_neg())
                );
            }
            return self.fail_cluster_write(slot, result.saturating_neg());
        }
        let (buffer, from, asked) = (*buffer, *filled, *reading);
        // At most what was asked; 0: the file ends there, and reads as zeros beyond.
        let got = u32::try_from(result).unwrap_or(0).min(asked);
        let len = if got == 0 { asked } else { got };
        if got == 0 {
            if let (Ok(at), Some(buffer)) = (
                usize::try_from(from),
                self.cluster_writes.buffer_mut(buffer),
            ) {
                if let Some(part) = buffer.get_mut(at..at.saturating_add(asked as usize)) {
                    part.fill(0);
                }
            }
        }
        if let Some(ClusterWrite::Filling {
            filled, reading, ..
        }) = self.cluster_writes.states.get_mut(slot as usize)
        {
            *filled = from.saturating_add(u64::from(len));
            *reading = 0;
        }
        self.fill_cluster(slot)
    }

    /// The slot's cluster is filled: the guest's bytes go in, imago maps the cluster, and the
    /// whole of it is queued for writing.
    fn write_cluster(&mut self, slot: u32) -> Result<(), EngineError> {
        let count = self.slots.count();
        let Some(&ClusterWrite::Filling {
            cluster, buffer, ..
        }) = self.cluster_writes.states.get(slot as usize)
        else {
            return Ok(());
        };
        let state = self
            .states
            .get_mut(slot as usize)
            .ok_or(EngineError::BadSlot { slot, count })?;
        let size = self.cluster_writes.cluster as u64;
        let guest_start = state.guest_offset().saturating_sub(cluster);
        let guest_len = state.remaining().min(size.saturating_sub(guest_start));
        state.set_target(TransferTarget {
            layer: 0,
            host_offset: 0,
            limit: guest_len,
        });
        let transfer = state.next_transfer(None);
        let Some(part) = usize::try_from(guest_start).ok().and_then(|at| {
            self.cluster_writes
                .buffer_mut(buffer)
                .and_then(|b| b.get_mut(at..))
        }) else {
            return self.fail_cluster_write(slot, libc::EINVAL);
        };
        let mut copied = 0usize;
        for iov in super::chain::iovecs_of(&transfer) {
            let Some(to) = part.get_mut(copied..copied.saturating_add(iov.iov_len)) else {
                break;
            };
            // SAFETY: the iovec describes guest memory mapped while the request is in flight
            // (as `request::parse` left it), at least `to.len()` bytes; guest memory is never
            // a Rust reference, so nothing aliases the copy.
            unsafe {
                std::ptr::copy_nonoverlapping(iov.iov_base.cast::<u8>(), to.as_mut_ptr(), to.len())
            };
            copied = copied.saturating_add(to.len());
        }
        let guest_bytes = copied as u64;
        if guest_bytes < guest_len {
            // More iovecs than one transfer takes: the bytes after them were not read into
            // the buffer either. Allocated in place instead.
            self.cluster_writes.end(slot);
            return self.map_in_place(slot);
        }
        let Some(chain) = self.image.qcow2_chain() else {
            return self.fail_cluster_write(slot, libc::EBADF);
        };
        match chain.allocate_cluster_ahead(cluster) {
            Ok(Some(allocation)) => {
                if let Some(state) = self.cluster_writes.states.get_mut(slot as usize) {
                    *state = ClusterWrite::Writing {
                        buffer,
                        allocation,
                        guest_bytes,
                    };
                }
                let size = self.cluster_writes.cluster as u64;
                if !self.extend_file_ahead(allocation.host_offset.saturating_add(size), size) {
                    // The write would extend the file itself while in flight, and the metadata
                    // file's zeroing counts on no write in flight ending past the file
                    // (`MetadataFile::pure_write_zeroes`): undone, and allocations run in place
                    // from now on.
                    return self.undo_unwritten_cluster(slot, allocation, libc::EIO);
                }
                self.counters.count_queued();
                self.pending.push_back(Token::WriteCluster { slot });
                Ok(())
            }
            Ok(None) => {
                // Not allocated ahead after all (an external data file, say): the in-place
                // allocation writes it, from the guest's buffers again.
                self.cluster_writes.end(slot);
                self.map_in_place(slot)
            }
            Err(e) => {
                if self.complaints.should_log() {
                    warn!("slot {slot}: allocating the cluster at {cluster}: {e}");
                }
                self.fail_cluster_write(slot, e.raw_os_error().unwrap_or(libc::EIO))
            }
        }
    }

    /// Makes the image file reach at least `end` before a cluster write there, extending its
    /// size by [`EXTEND_AHEAD`] past that (rounded to `cluster`) when it does not; false if a
    /// regular file could not be (a block device has its size and is never extended). The
    /// loop is the only thing that extends the file (no write in flight ends past
    /// `file_end`), so the size read first is current and this only grows it.
    fn extend_file_ahead(&mut self, end: u64, cluster: u64) -> bool {
        let writes = &mut self.cluster_writes;
        if end <= writes.file_end || writes.not_a_file {
            return true;
        }
        let Some(file) = self.image.direct() else {
            return false;
        };
        match file.metadata() {
            Ok(meta) if meta.file_type().is_file() => writes.file_end = meta.len(),
            Ok(_) => {
                writes.not_a_file = true;
                return true;
            }
            Err(error) => {
                warn!("the image file's size cannot be read: {error}");
                return false;
            }
        }
        if end <= writes.file_end {
            return true;
        }
        let target = end
            .saturating_add(EXTEND_AHEAD)
            .checked_next_multiple_of(cluster.max(1))
            .unwrap_or(end);
        match file.set_len(target) {
            Ok(()) => {
                writes.file_end = target;
                true
            }
            Err(error) => {
                warn!("the image file cannot be extended ahead of its allocations: {error}");
                false
            }
        }
    }

    /// The slot's cluster write completed with `result`.
    pub(super) fn cluster_written(&mut self, slot: u32, result: i32) -> Result<(), EngineError> {
        let count = self.slots.count();
        let Some(&ClusterWrite::Writing {
            allocation,
            guest_bytes,
            ..
        }) = self.cluster_writes.states.get(slot as usize)
        else {
            warn!("ignoring a stale cluster write completion for slot {slot}");
            return Ok(());
        };
        let whole = u64::try_from(result).is_ok_and(|n| n == self.cluster_writes.cluster as u64);
        let errno = match result {
            r if r < 0 => r.saturating_neg(),
            _ => libc::EIO,
        };
        if !whole && matches!(errno, libc::EAGAIN | libc::EINTR) {
            self.pending.push_back(Token::WriteCluster { slot });
            return Ok(());
        }
        let Some(chain) = self.image.qcow2_chain_mut() else {
            return self.fail_cluster_write(slot, libc::EBADF);
        };
        if !whole {
            if self.complaints.should_log() {
                warn!(
                    "slot {slot}: writing the new cluster at guest offset {}: {}",
                    allocation.cluster_offset(),
                    std::io::Error::from_raw_os_error(errno)
                );
            }
            if errno == libc::EINVAL && result < 0 {
                // The O_DIRECT fd refuses the alignment: in place from now on.
                warn!("the image's O_DIRECT fd refused a cluster write; allocating in place");
                return self.undo_unwritten_cluster(slot, allocation, errno);
            }
            self.unmap_cluster(slot, allocation);
            return self.fail_cluster_write(slot, errno);
        }
        chain.cluster_written(&allocation);
        self.cluster_writes.end(slot);
        if let Some(pending) = self.write_back_pending.get_mut(slot as usize) {
            *pending = true;
        }
        self.metadata_dirty = true;
        let state = self
            .states
            .get_mut(slot as usize)
            .ok_or(EngineError::BadSlot { slot, count })?;
        let step = state.on_transfer(i32::try_from(guest_bytes).unwrap_or(-libc::EIO));
        self.apply(slot, step)
    }

    /// Unmaps the slot's allocated cluster, whose data did not reach it, in imago's caches
    /// again; false if that failed too, and requests into the cluster fail from then on.
    fn unmap_cluster(&mut self, slot: u32, allocation: ClusterAllocation) -> bool {
        let cluster = allocation.cluster_offset();
        let undone = match self.image.qcow2_chain_mut() {
            Some(chain) => chain.cluster_not_written(&allocation),
            None => Err(std::io::Error::from_raw_os_error(libc::EBADF)),
        };
        if let Err(e) = undone {
            warn!("slot {slot}: undoing the allocation: {e}; requests into it fail from now on");
            let size = self.cluster_writes.cluster as u64;
            self.cluster_writes
                .poisoned
                .push(cluster..cluster.saturating_add(size));
            return false;
        }
        true
    }

    /// Undoes the slot's cluster write that cannot go through the O_DIRECT fd, and runs the
    /// write in place instead — as every allocation from now on (or fails it with `errno` if
    /// the undo failed).
    fn undo_unwritten_cluster(
        &mut self,
        slot: u32,
        allocation: ClusterAllocation,
        errno: i32,
    ) -> Result<(), EngineError> {
        if !self.unmap_cluster(slot, allocation) {
            return self.fail_cluster_write(slot, errno);
        }
        self.cluster_writes.direct_refused = true;
        self.cluster_writes.end(slot);
        self.map_in_place(slot)
    }

    /// Fails the slot's request with `errno` and ends its cluster write.
    fn fail_cluster_write(&mut self, slot: u32, errno: i32) -> Result<(), EngineError> {
        self.cluster_writes.end(slot);
        let count = self.slots.count();
        let step = self
            .states
            .get_mut(slot as usize)
            .ok_or(EngineError::BadSlot { slot, count })?
            .fail(errno);
        self.apply(slot, step)
    }

    /// Parks the slot until the clusters in flight that its next `len` bytes at `offset`
    /// overlap are written; true if it did.
    pub(super) fn wait_for_cluster_writes(&mut self, slot: u32, offset: u64, len: u64) -> bool {
        if !self.cluster_writes.blocks(offset, len) {
            return false;
        }
        self.cluster_writes.waiting.push_back(slot);
        true
    }

    /// How many of the slot's next `len` bytes at `offset` come before the first cluster in
    /// flight; `None` (the slot parked until a cluster write ends) if `offset` is in one.
    pub(super) fn clear_of_cluster_writes(
        &mut self,
        slot: u32,
        offset: u64,
        len: u64,
    ) -> Option<u64> {
        let clear = self.cluster_writes.clear_len(offset, len);
        if clear.is_none() {
            self.cluster_writes.waiting.push_back(slot);
        }
        clear
    }

    /// Runs the slots that waited for a cluster write again, once one has ended (each waits
    /// anew if it still has to).
    pub(super) fn retry_cluster_waiters(&mut self) -> Result<(), EngineError> {
        if !std::mem::take(&mut self.cluster_writes.ended) {
            return Ok(());
        }
        for _ in 0..self.cluster_writes.waiting.len() {
            let Some(slot) = self.cluster_writes.waiting.pop_front() else {
                break;
            };
            let discard = self
                .states
                .get(slot as usize)
                .is_some_and(|s| s.stage() == Some(crate::slot::Stage::Range));
            if discard {
                self.zero_or_discard(slot)?;
            } else {
                self.map_transfer(slot)?;
            }
        }
        Ok(())
    }

    /// Whether any slot waits for a cluster write.
    pub(super) fn cluster_waiters(&self) -> bool {
        !self.cluster_writes.waiting.is_empty()
    }
}

/// Whether any of `ranges` overlaps the `len` bytes at `offset`.
fn overlaps(ranges: &[Range<u64>], offset: u64, len: u64) -> bool {
    let end = offset.saturating_add(len);
    ranges
        .iter()
        .any(|range| range.start < end && offset < range.end)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_stop_short_of_clusters_being_written() {
        let mut writes = ClusterWrites::new(4).unwrap();
        writes.in_flight.push(65536..131072);
        // A mapping from before the cluster stops at it; one inside waits; one after, or
        // short of it, goes on.
        assert_eq!(writes.clear_len(0, 200_000), Some(65536));
        assert_eq!(writes.clear_len(65536 + 512, 4096), None);
        assert_eq!(writes.clear_len(131072, 4096), Some(4096));
        assert_eq!(writes.clear_len(0, 4096), Some(4096));
        assert!(writes.blocks(0, 65537));
        assert!(!writes.blocks(0, 65536));
        assert!(writes.blocks(131071, u64::MAX), "cut, not wrapped");
        assert!(!writes.is_poisoned(0, u64::MAX));
        writes.poisoned.push(0..4096);
        assert!(writes.is_poisoned(4095, 1));
        assert!(!writes.is_poisoned(4096, 4096));
    }

    #[test]
    fn buffers_are_aligned_and_each_handed_out_once() {
        let mut writes = ClusterWrites::new(8).unwrap();
        assert!(writes.ensure_buffers(65536, 4096, 8));
        assert!(
            !writes.ensure_buffers(4096, 4096, 8),
            "another cluster size"
        );
        // At most one per slot.
        assert_eq!(writes.free.len(), 8);
        for buffer in 0..8u32 {
            let base = writes.buffer_mut(buffer).unwrap().as_ptr() as usize;
            assert_eq!(base % 4096, 0);
            assert_eq!(writes.iovecs[buffer as usize].iov_base as usize, base);
            assert_eq!(writes.iovecs[buffer as usize].iov_len, 65536);
        }
        assert!(writes.buffer_mut(8).is_none());
        // 2 MiB clusters: as many as the budget holds, aligned to a 64 KiB block.
        let mut big = ClusterWrites::new(64).unwrap();
        assert!(big.ensure_buffers(2 << 20, 65536, 64));
        assert_eq!(big.free.len(), BUFFER_BUDGET / (2 << 20));
        assert_eq!(big.buffer_mut(3).unwrap().as_ptr() as usize % 65536, 0);
        // Small clusters: at most MAX_BUFFERS, however many the budget would hold.
        let mut small = ClusterWrites::new(1024).unwrap();
        assert!(small.ensure_buffers(4096, 4096, 1024));
        assert_eq!(small.free.len(), MAX_BUFFERS);
    }

    #[test]
    fn an_ended_cluster_write_frees_its_buffer_and_cluster() {
        let mut writes = ClusterWrites::new(2).unwrap();
        assert!(writes.ensure_buffers(4096, 4096, 2));
        let buffer = writes.free.pop().unwrap();
        writes.in_flight.push(8192..12288);
        writes.states[1] = ClusterWrite::Filling {
            cluster: 8192,
            buffer,
            filled: 0,
            reading: 0,
            layer: 1,
            host_offset: 8192,
        };
        writes.end(1);
        assert_eq!(writes.states[1], ClusterWrite::Idle);
        assert!(writes.in_flight.is_empty());
        assert_eq!(writes.free.len(), 2);
        assert!(writes.ended);
        // Twice, or for a slot out of range: nothing more.
        writes.end(1);
        writes.end(9);
        assert_eq!(writes.free.len(), 2);
    }
}
