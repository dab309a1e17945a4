//! Inflight I/O tracking for crash-safe reconnect (`VHOST_USER_PROTOCOL_F_INFLIGHT_SHMFD`).
//!
//! The frontend creates a shared-memory region (GET_INFLIGHT_FD) that the VMM keeps; after a
//! frontend crash the VMM hands it to the restarted frontend (SET_INFLIGHT_FD) before it starts
//! the rings again. The region records which descriptor heads were taken off the avail ring but
//! not yet returned on the used ring, so they can be resubmitted: the avail ring alone cannot
//! tell, because requests complete out of order and the driver reuses avail entries.
//!
//! Layout (vhost-user spec, "Inflight I/O tracking", split virtqueue; native byte order): one
//! region per queue, each [`queue_region_size`] bytes (64-byte aligned, as libvhost-user lays
//! it out):
//!
//! | offset | field |
//! |---|---|
//! | 0 | `features: u64` (0) |
//! | 8 | `version: u16` (2; 0 = never initialized; 1 = libvhost-user's order, below) |
//! | 10 | `desc_num: u16` (entries, = queue size) |
//! | 12 | `last_batch_head: u16` (head of the list of the last used batch) |
//! | 14 | `used_idx: u16` (the used ring's idx once that batch is on it) |
//! | 16 + 16·i | `desc[i]`: `inflight: u8`, padding `[u8; 5]`, `next: u16`, `counter: u64` |
//!
//! Two processes write it. The frontend marks a head when it takes it off the avail ring
//! ([`QueueInflight::mark`]: `counter`, then `inflight` = 1). The iothread, which puts requests
//! on the used ring, records each batch before the used index in guest memory moves
//! ([`QueueInflight::record_batch`]): it links the batch's heads through `next` from
//! `last_batch_head`, stores the used index the batch will reach in `used_idx`, and clears
//! their flags; only then does it write the used index in guest memory. So a head is cleared
//! before the driver can see it used and make it available again — the frontend's next mark
//! of that head can never be undone by a late clear — and after a crash the two indices say
//! where the crash fell: equal, and every head still marked is in flight; the region's ahead,
//! and the last batch was cleared but never reached the guest, so its heads are marked again
//! ([`QueueInflight::repair_last_batch`]). Version 1 regions (libvhost-user's order: clear
//! after the used index moved, which only works with one writer) are still recovered.
//!
//! The region is hostile input: a previous process or the VMM wrote it. Every access is bounds
//! checked and goes through atomics (another process may write concurrently), and recovery
//! never trusts a head, a count or a counter it read without checking it.

use std::fs::File;
use std::io;
use std::sync::atomic::{AtomicU16, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;

use crate::shm::{is_sealed_against_shrinking, sealed_memfd, SharedMapping};
use log::warn;

/// The region protocol version blkplane writes (see the module documentation).
pub const VERSION: u16 = 2;
/// The version of regions written in libvhost-user's order (flags cleared after the used index
/// moved), which recovery still understands.
pub const VERSION_CLEAR_AFTER_USED: u16 = 1;
/// Bytes of a queue region's header.
pub const QUEUE_HEADER_SIZE: u64 = 16;
/// Bytes of one `DescStateSplit` entry.
pub const DESC_STATE_SIZE: u64 = 16;
/// Alignment of each queue region.
pub const QUEUE_REGION_ALIGN: u64 = 64;

// Offsets inside a queue region's header.
const OFF_FEATURES: usize = 0;
const OFF_VERSION: usize = 8;
const OFF_DESC_NUM: usize = 10;
const OFF_LAST_BATCH_HEAD: usize = 12;
const OFF_USED_IDX: usize = 14;
// Offsets inside one descriptor entry.
const OFF_DESC_INFLIGHT: usize = 0;
const OFF_DESC_NEXT: usize = 6;
const OFF_DESC_COUNTER: usize = 8;

/// Bytes one queue of `queue_size` entries takes in the region.
#[allow(
    clippy::arithmetic_side_effects,
    reason = "at most 65535 entries of 16 bytes and a header: about 1 MiB"
)]
pub fn queue_region_size(queue_size: u16) -> u64 {
    let raw = QUEUE_HEADER_SIZE + DESC_STATE_SIZE * u64::from(queue_size);
    raw.div_ceil(QUEUE_REGION_ALIGN) * QUEUE_REGION_ALIGN
}

/// Bytes the whole region takes for `num_queues` queues of `queue_size` entries.
pub fn region_size(num_queues: u16, queue_size: u16) -> u64 {
    // At most 65535 × ~1 MiB: no overflow in u64.
    u64::from(num_queues).saturating_mul(queue_region_size(queue_size))
}

/// The largest geometry a VMM may ask for: the device's own queue count and ring size, so a
/// hostile message cannot make the frontend map more than its configuration implies.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Queues the device offers.
    pub max_queues: u16,
    /// Largest ring size the device accepts.
    pub max_queue_size: u16,
}

/// Why an inflight region was refused or could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum InflightError {
    /// The queue count or size is zero or larger than the device's.
    #[error(
        "{num_queues} queues of {queue_size} entries: the device has 1..={max_queues} queues of \
         1..={max_queue_size} entries"
    )]
    Geometry {
        /// Queues asked for.
        num_queues: u16,
        /// Entries per queue asked for.
        queue_size: u16,
        /// The device's queue count.
        max_queues: u16,
        /// The device's largest ring.
        max_queue_size: u16,
    },
    /// `mmap_size` does not cover the queues described.
    #[error("mmap_size {given} is smaller than the {needed} bytes the queues need")]
    TooSmall {
        /// The message's mmap_size.
        given: u64,
        /// What the layout needs.
        needed: u64,
    },
    /// `mmap_offset` cannot be mapped.
    #[error("mmap_offset {0:#x} is not page aligned")]
    Unaligned(u64),
    /// The area lies (partly) past the end of the file: touching it would SIGBUS.
    #[error("the area {offset:#x}+{size:#x} is past the end of the file ({file_size} bytes)")]
    PastEnd {
        /// mmap_offset.
        offset: u64,
        /// mmap_size.
        size: u64,
        /// The file's size.
        file_size: u64,
    },
    /// The file could shrink under the mapping (SIGBUS): only a memfd sealed against
    /// shrinking, like the one GET_INFLIGHT_FD hands out, is accepted.
    #[error("the file is not a memfd sealed against shrinking (F_SEAL_SHRINK)")]
    NotSealed,
    /// A system call failed.
    #[error("{op}: {source}")]
    Os {
        /// What was being done.
        op: &'static str,
        /// The error.
        source: io::Error,
    },
    /// A queue outside the region was started.
    #[error("queue {queue} is not in the inflight region ({num_queues} queues)")]
    NoSuchQueue {
        /// Device queue index.
        queue: u16,
        /// Queues the region holds.
        num_queues: u16,
    },
    /// The ring is larger than the region's entries, so some heads could not be tracked.
    #[error("ring size {ring_size} is larger than the inflight region's {entries} entries")]
    RingTooLarge {
        /// The ring's size.
        ring_size: u16,
        /// Entries per queue in the region.
        entries: u16,
    },
    /// The queue region carries a layout this frontend does not know.
    #[error("unknown inflight region version {0}")]
    Version(u16),
    /// More requests are marked in flight than the avail ring has entries not yet used.
    #[error(
        "{in_flight} requests marked in flight, but the avail ring has only {outstanding} \
         entries past the used index"
    )]
    Inconsistent {
        /// Heads marked in flight.
        in_flight: usize,
        /// avail idx − used idx.
        outstanding: u16,
    },
}

fn check_geometry(num_queues: u16, queue_size: u16, limits: Limits) -> Result<(), InflightError> {
    if num_queues == 0
        || queue_size == 0
        || num_queues > limits.max_queues
        || queue_size > limits.max_queue_size
    {
        return Err(InflightError::Geometry {
            num_queues,
            queue_size,
            max_queues: limits.max_queues,
            max_queue_size: limits.max_queue_size,
        });
    }
    Ok(())
}

/// The region's mapping; every access goes through [`Mapping::atomic`].
struct Mapping(SharedMapping);

/// The atomic types fields of the region are accessed as.
trait Field: Sized {
    /// # Safety
    /// `ptr` must be aligned, valid for reads and writes for `'a`, and only ever accessed
    /// atomically by this process.
    unsafe fn at_ptr<'a>(ptr: *mut u8) -> &'a Self;
}

macro_rules! field {
    ($atomic:ty, $int:ty) => {
        impl Field for $atomic {
            unsafe fn at_ptr<'a>(ptr: *mut u8) -> &'a Self {
                // SAFETY: forwarded to the caller (alignment, validity, atomic-only access).
                unsafe { <$atomic>::from_ptr(ptr.cast::<$int>()) }
            }
        }
    };
}
field!(AtomicU8, u8);
field!(AtomicU16, u16);
field!(AtomicU64, u64);

impl Mapping {
    fn new(file: &File, len: u64, offset: u64) -> Result<Self, InflightError> {
        SharedMapping::new(file, len, offset)
            .map(Self)
            .map_err(|source| InflightError::Os {
                op: "mmap inflight region",
                source,
            })
    }

    /// The field of type `T` at byte `offset`, or `None` if it is not entirely inside the
    /// mapping or misaligned (neither happens for offsets computed from a checked layout; the
    /// check keeps a bug from becoming an out-of-bounds access).
    fn atomic<T: Field>(&self, offset: usize) -> Option<&T> {
        let end = offset.checked_add(size_of::<T>())?;
        if end > self.0.len() || !offset.is_multiple_of(align_of::<T>()) {
            return None;
        }
        // SAFETY: in bounds (checked above) of a mapping that lives as long as `self`; the base
        // is page aligned so `offset` alignment is the field's; this process only accesses
        // the region through atomics.
        Some(unsafe { T::at_ptr(self.0.as_ptr().add(offset)) })
    }
}

/// The inflight region of one vhost-user session, mapped.
pub struct InflightRegion {
    mapping: Mapping,
    num_queues: u16,
    queue_size: u16,
    /// The file, kept to hand to the iothreads that clear requests in it.
    file: File,
    /// Where the mapping starts in the file.
    mmap_offset: u64,
}

impl std::fmt::Debug for InflightRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InflightRegion")
            .field("num_queues", &self.num_queues)
            .field("queue_size", &self.queue_size)
            .field("bytes", &self.mapping.0.len())
            .finish()
    }
}

impl InflightRegion {
    /// GET_INFLIGHT_FD: a new zeroed region for `num_queues` queues of `queue_size` entries in
    /// a sealed memfd. Returns the region and the memfd to hand to the VMM.
    pub fn create(
        num_queues: u16,
        queue_size: u16,
        limits: Limits,
    ) -> Result<(Self, File), InflightError> {
        check_geometry(num_queues, queue_size, limits)?;
        let size = region_size(num_queues, queue_size);
        // A new memfd reads as zeros — the zeroed region the spec asks for, without committing
        // memory for pages never touched — and is sealed so that neither the VMM nor anyone it
        // passes the fd to can shrink it under a mapping (SIGBUS in the worker).
        let file =
            sealed_memfd(c"blkplane-inflight", size).map_err(|source| InflightError::Os {
                op: "create inflight memfd",
                source,
            })?;
        let mapping = Mapping::new(&file, size, 0)?;
        let kept = file.try_clone().map_err(|source| InflightError::Os {
            op: "duplicate inflight memfd",
            source,
        })?;
        Ok((
            Self {
                mapping,
                num_queues,
                queue_size,
                file: kept,
                mmap_offset: 0,
            },
            file,
        ))
    }

    /// SET_INFLIGHT_FD: maps the region the VMM sends back (normally the memfd a previous
    /// frontend process created), after checking the message against the device and the file.
    /// Only the bytes the layout needs are mapped, whatever `mmap_size` says.
    pub fn open(
        file: &File,
        mmap_size: u64,
        mmap_offset: u64,
        num_queues: u16,
        queue_size: u16,
        limits: Limits,
    ) -> Result<Self, InflightError> {
        check_geometry(num_queues, queue_size, limits)?;
        let needed = region_size(num_queues, queue_size);
        if mmap_size < needed {
            return Err(InflightError::TooSmall {
                given: mmap_size,
                needed,
            });
        }
        if !mmap_offset.is_multiple_of(page_size()) {
            return Err(InflightError::Unaligned(mmap_offset));
        }
        let file_size = file
            .metadata()
            .map_err(|source| InflightError::Os {
                op: "fstat inflight region",
                source,
            })?
            .len();
        let past_end = InflightError::PastEnd {
            offset: mmap_offset,
            size: mmap_size,
            file_size,
        };
        match mmap_offset.checked_add(mmap_size) {
            Some(end) if end <= file_size => {}
            _ => return Err(past_end),
        }
        if !is_sealed_against_shrinking(file) {
            return Err(InflightError::NotSealed);
        }
        let mapping = Mapping::new(file, needed, mmap_offset)?;
        let file = file.try_clone().map_err(|source| InflightError::Os {
            op: "duplicate inflight fd",
            source,
        })?;
        Ok(Self {
            mapping,
            num_queues,
            queue_size,
            file,
            mmap_offset,
        })
    }

    /// The file the region lives in (to hand to an iothread).
    pub fn file(&self) -> &File {
        &self.file
    }

    /// Where the region starts in [`InflightRegion::file`].
    pub fn mmap_offset(&self) -> u64 {
        self.mmap_offset
    }

    /// Queues the region holds.
    pub fn num_queues(&self) -> u16 {
        self.num_queues
    }

    /// Entries per queue.
    pub fn queue_size(&self) -> u16 {
        self.queue_size
    }

    /// Bytes of the region (what GET_INFLIGHT_FD reports as mmap_size).
    pub fn size(&self) -> u64 {
        self.mapping.0.len() as u64
    }

    /// Device reset: every ring is stopped and drained, so nothing the region still marks
    /// (heads of a ring the guest broke, which are never used) may be resubmitted into the
    /// rings the driver sets up next. Each queue goes back to "never initialized"; its next
    /// start initializes it with the ring's indices.
    pub fn forget(&self) {
        let stride = queue_region_size(self.queue_size);
        for queue in 0..self.num_queues {
            let version = u64::from(queue)
                .checked_mul(stride)
                .and_then(|base| usize::try_from(base).ok())
                .and_then(|base| base.checked_add(OFF_VERSION))
                .and_then(|offset| self.mapping.atomic::<AtomicU16>(offset));
            if let Some(version) = version {
                version.store(0, Ordering::Release);
            }
        }
    }

    /// The tracker of device queue `queue`, which keeps the mapping alive.
    pub fn queue(self: &Arc<Self>, queue: u16) -> Result<QueueInflight, InflightError> {
        if queue >= self.num_queues {
            return Err(InflightError::NoSuchQueue {
                queue,
                num_queues: self.num_queues,
            });
        }
        let stride = queue_region_size(self.queue_size);
        // Within the mapping: queue < num_queues and the mapping is num_queues × stride.
        let base = u64::from(queue)
            .checked_mul(stride)
            .and_then(|base| usize::try_from(base).ok())
            .ok_or(InflightError::NoSuchQueue {
                queue,
                num_queues: self.num_queues,
            })?;
        Ok(QueueInflight {
            region: Arc::clone(self),
            queue,
            base,
            entries: self.queue_size,
            counter: 0,
        })
    }
}

fn page_size() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(size).ok().filter(|s| *s > 0).unwrap_or(4096)
}

/// What recovery found when a ring starts on a region that was in use before.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Recovered {
    /// Heads that were taken off the avail ring but never used, oldest first: resubmit them
    /// before anything new.
    pub resubmit: Vec<u16>,
    /// The avail index to go on from (used idx + requests in flight), when the region had been
    /// initialized before; `None` for a fresh region (then the VMM's SET_VRING_BASE holds).
    pub next_avail: Option<u16>,
    /// Heads of the last batch a crash left half-recorded: in a version 2 region cleared but
    /// never used (marked again, so resubmitted), in a version 1 region used but still marked
    /// (cleared).
    pub repaired_batch: u16,
}

/// One queue's part of the region, as the worker that owns the queue updates it.
///
/// Per request the worker does two or three stores into shared memory: no syscall, no lock,
/// no allocation.
pub struct QueueInflight {
    region: Arc<InflightRegion>,
    /// The queue's index in the region.
    queue: u16,
    /// Byte offset of this queue's area in the mapping.
    base: usize,
    /// Entries in this queue's area.
    entries: u16,
    /// The next `counter` value: the order heads were taken off the avail ring.
    counter: u64,
}

impl std::fmt::Debug for QueueInflight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueueInflight")
            .field("base", &self.base)
            .field("entries", &self.entries)
            .field("counter", &self.counter)
            .finish()
    }
}

impl QueueInflight {
    /// The region this queue's area is part of.
    pub fn region(&self) -> &Arc<InflightRegion> {
        &self.region
    }

    /// The queue's index in [`QueueInflight::region`].
    pub fn queue_index(&self) -> u16 {
        self.queue
    }

    fn header<T: Field>(&self, offset: usize) -> Option<&T> {
        self.region.mapping.atomic(self.base.checked_add(offset)?)
    }

    fn desc<T: Field>(&self, head: u16, offset: usize) -> Option<&T> {
        if head >= self.entries {
            return None;
        }
        let entry = usize::from(head)
            .checked_mul(usize::try_from(DESC_STATE_SIZE).ok()?)?
            .checked_add(usize::try_from(QUEUE_HEADER_SIZE).ok()?)?;
        self.header(entry.checked_add(offset)?)
    }

    fn load16(&self, offset: usize) -> u16 {
        self.header::<AtomicU16>(offset)
            .map_or(0, |f| f.load(Ordering::Acquire))
    }

    fn store16(&self, offset: usize, value: u16) {
        if let Some(f) = self.header::<AtomicU16>(offset) {
            f.store(value, Ordering::Release);
        }
    }

    fn set_inflight(&self, head: u16, value: u8) {
        if let Some(f) = self.desc::<AtomicU8>(head, OFF_DESC_INFLIGHT) {
            f.store(value, Ordering::Release);
        }
    }

    fn inflight(&self, head: u16) -> bool {
        self.desc::<AtomicU8>(head, OFF_DESC_INFLIGHT)
            .is_some_and(|f| f.load(Ordering::Acquire) != 0)
    }

    fn counter_of(&self, head: u16) -> u64 {
        self.desc::<AtomicU64>(head, OFF_DESC_COUNTER)
            .map_or(0, |f| f.load(Ordering::Acquire))
    }

    fn next_of(&self, head: u16) -> u16 {
        self.desc::<AtomicU16>(head, OFF_DESC_NEXT)
            .map_or(0, |f| f.load(Ordering::Acquire))
    }

    /// A head was taken off the avail ring: record its order, then mark it in flight. From
    /// here until [`QueueInflight::record_batch`] a crash makes the next process resubmit it.
    pub fn mark(&mut self, head: u16) {
        if let Some(counter) = self.desc::<AtomicU64>(head, OFF_DESC_COUNTER) {
            counter.store(self.counter, Ordering::Relaxed);
        }
        // Release: the counter is in place before the flag says the entry is valid.
        self.set_inflight(head, 1);
        self.counter = self.counter.wrapping_add(1);
    }

    /// Whether `head` is marked in flight.
    pub fn is_marked(&self, head: u16) -> bool {
        self.inflight(head)
    }

    /// The iothread is about to put `heads` on the used ring, which takes the used index to
    /// `used_after`: links them as the last batch, records `used_after`, then clears their
    /// flags. The caller writes the used index in guest memory only after this returns (the
    /// stores are Release, in this order), so the driver can make a head available again only
    /// once its flag is cleared, and a crash before the used index moved is recognized (the
    /// region's used_idx ahead of the ring's) and undone by [`QueueInflight::repair_last_batch`].
    pub fn record_batch<I>(&self, heads: I, used_after: u16)
    where
        I: IntoIterator<Item = u16> + Clone,
    {
        let mut last = self.load16(OFF_LAST_BATCH_HEAD);
        for head in heads.clone() {
            if let Some(next) = self.desc::<AtomicU16>(head, OFF_DESC_NEXT) {
                next.store(last, Ordering::Relaxed);
            }
            last = head;
        }
        self.store16(OFF_LAST_BATCH_HEAD, last);
        self.store16(OFF_USED_IDX, used_after);
        for head in heads {
            self.set_inflight(head, 0);
        }
    }

    /// After the iothread that used this ring died (or the process before this one): if the
    /// region's used_idx is ahead of `used_idx`, the ring's used index in guest memory, the
    /// last batch was cleared but never put on the ring, so its heads (at most `ring_size`,
    /// walked through `next`) are marked in flight again. Returns how many were.
    pub fn repair_last_batch(&self, ring_size: u16, used_idx: u16) -> u16 {
        let batch = self.load16(OFF_USED_IDX).wrapping_sub(used_idx);
        self.set_last_batch(ring_size, batch, 1, used_idx)
    }

    /// A version 1 region (flags cleared after the used index moved): a used index ahead of
    /// the region's means the last batch was used but its flags were not cleared yet.
    fn clear_used_batch(&self, ring_size: u16, used_idx: u16) -> u16 {
        let batch = used_idx.wrapping_sub(self.load16(OFF_USED_IDX));
        self.set_last_batch(ring_size, batch, 0, used_idx)
    }

    /// Sets the flag of the last `batch` heads recorded (walked back from `last_batch_head`
    /// through `next`, at most `ring_size`) to `inflight`, then records `used_idx`. Returns
    /// how many were set.
    fn set_last_batch(&self, ring_size: u16, batch: u16, inflight: u8, used_idx: u16) -> u16 {
        if batch == 0 {
            return 0;
        }
        let mut head = self.load16(OFF_LAST_BATCH_HEAD);
        let mut set = 0u16;
        // A batch is never larger than the ring; the bound also ends loops in the list.
        for _ in 0..batch.min(ring_size) {
            if head >= ring_size {
                warn!("inflight region: last batch names head {head} outside the ring");
                break;
            }
            self.set_inflight(head, inflight);
            set = set.saturating_add(1);
            head = self.next_of(head);
        }
        self.store16(OFF_USED_IDX, used_idx);
        set
    }

    /// Brings the region in line with the ring as the ring starts, and says what to resubmit.
    ///
    /// `ring_size` is the ring's size, `used_idx` and `avail_idx` the indices in guest memory
    /// now. A fresh region (version 0) is initialized and nothing is resubmitted. Otherwise
    /// (the spec's "when reconnecting"): a last batch whose clear was lost is cleared, then
    /// every head still marked is returned ordered by counter, and the avail ring goes on
    /// after them. Hostile contents (heads outside the ring, loops in the batch list, huge
    /// counters, a wrong `desc_num`) are ignored or corrected, never trusted.
    pub fn recover(
        &mut self,
        ring_size: u16,
        used_idx: u16,
        avail_idx: u16,
    ) -> Result<Recovered, InflightError> {
        if ring_size > self.entries {
            return Err(InflightError::RingTooLarge {
                ring_size,
                entries: self.entries,
            });
        }
        let version = self.load16(OFF_VERSION);
        match version {
            0 => {
                self.initialize(used_idx);
                return Ok(Recovered::default());
            }
            VERSION | VERSION_CLEAR_AFTER_USED => {}
            other => return Err(InflightError::Version(other)),
        }
        let desc_num = self.load16(OFF_DESC_NUM);
        if desc_num != self.entries {
            warn!(
                "inflight region: desc_num {desc_num}, expected {}; corrected",
                self.entries
            );
            self.store16(OFF_DESC_NUM, self.entries);
        }
        let repaired_batch = if version == VERSION {
            self.repair_last_batch(ring_size, used_idx)
        } else {
            let cleared = self.clear_used_batch(ring_size, used_idx);
            // Consistent now: from here on this process writes in its own order.
            self.store16(OFF_VERSION, VERSION);
            cleared
        };

        let mut marked: Vec<(u64, u16)> = Vec::new();
        let mut outside = 0u32;
        for head in 0..self.entries {
            if !self.inflight(head) {
                continue;
            }
            if head >= ring_size {
                // Cannot be a head of this ring: stale or forged. Cleared so it never counts.
                outside = outside.saturating_add(1);
                self.set_inflight(head, 0);
                continue;
            }
            marked.push((self.counter_of(head), head));
        }
        if outside > 0 {
            warn!(
                "inflight region: {outside} entries at or past the ring size {ring_size} were \
                 marked in flight; cleared"
            );
        }
        let outstanding = avail_idx.wrapping_sub(used_idx);
        if marked.len() > usize::from(outstanding) {
            return Err(InflightError::Inconsistent {
                in_flight: marked.len(),
                outstanding,
            });
        }
        // Oldest first; the head breaks ties between forged equal counters deterministically.
        marked.sort_unstable();
        self.counter = marked
            .last()
            .map_or(0, |(counter, _)| counter.wrapping_add(1));
        // marked.len() ≤ outstanding ≤ u16::MAX (checked above).
        let in_flight = u16::try_from(marked.len()).unwrap_or(outstanding);
        Ok(Recovered {
            resubmit: marked.into_iter().map(|(_, head)| head).collect(),
            next_avail: Some(used_idx.wrapping_add(in_flight)),
            repaired_batch,
        })
    }

    /// First start on a fresh region: whatever a zeroed (or forged version-0) region holds,
    /// nothing is in flight. The version is written last, so a crash in between leaves a
    /// region that is initialized again.
    fn initialize(&mut self, used_idx: u16) {
        for head in 0..self.entries {
            if self.inflight(head) {
                self.set_inflight(head, 0);
            }
        }
        if let Some(features) = self.header::<AtomicU64>(OFF_FEATURES) {
            features.store(0, Ordering::Relaxed);
        }
        self.store16(OFF_DESC_NUM, self.entries);
        self.store16(OFF_LAST_BATCH_HEAD, 0);
        self.store16(OFF_USED_IDX, used_idx);
        self.store16(OFF_VERSION, VERSION);
        self.counter = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    const LIMITS: Limits = Limits {
        max_queues: 4,
        max_queue_size: 256,
    };

    fn new_region(num_queues: u16, queue_size: u16) -> (Arc<InflightRegion>, File) {
        let (region, file) = InflightRegion::create(num_queues, queue_size, LIMITS).unwrap();
        (Arc::new(region), file)
    }

    /// The region as another process sees it: the memfd mapped again.
    fn reopen(file: &File, num_queues: u16, queue_size: u16) -> Arc<InflightRegion> {
        let size = region_size(num_queues, queue_size);
        Arc::new(InflightRegion::open(file, size, 0, num_queues, queue_size, LIMITS).unwrap())
    }

    /// What the iothread does for a head it uses (a batch of one), then the used index store.
    fn complete(q: &QueueInflight, head: u16, used: &mut u16) {
        *used = used.wrapping_add(1);
        q.record_batch([head], *used);
    }

    /// libvhost-user's order (a version 1 region): link, then (after the used index moved)
    /// clear and record.
    fn link_v1(q: &QueueInflight, head: u16) {
        let last = q.load16(OFF_LAST_BATCH_HEAD);
        q.desc::<AtomicU16>(head, OFF_DESC_NEXT)
            .unwrap()
            .store(last, Ordering::Relaxed);
        q.store16(OFF_LAST_BATCH_HEAD, head);
    }

    #[test]
    fn layout_matches_the_spec_and_libvhost_user() {
        assert_eq!(queue_region_size(1), 64);
        assert_eq!(queue_region_size(2), 64);
        assert_eq!(queue_region_size(3), 64);
        assert_eq!(queue_region_size(4), 128);
        // 16-byte header + 128 entries of 16 bytes, rounded up to 64.
        assert_eq!(queue_region_size(128), 2112);
        assert_eq!(queue_region_size(256), 4160);
        assert_eq!(queue_region_size(32768), 16 * 32768 + 64);
        assert_eq!(region_size(2, 128), 2 * 2112);
        assert_eq!(region_size(u16::MAX, u16::MAX), 65535 * (16 * 65535 + 16));
        // The header and entries are laid out as the spec's C structs.
        assert_eq!(OFF_VERSION, 8);
        assert_eq!(OFF_USED_IDX + 2, QUEUE_HEADER_SIZE as usize);
        assert_eq!(OFF_DESC_COUNTER + 8, DESC_STATE_SIZE as usize);
    }

    #[test]
    fn create_checks_the_geometry_and_seals() {
        assert!(matches!(
            InflightRegion::create(0, 128, LIMITS),
            Err(InflightError::Geometry { .. })
        ));
        assert!(InflightRegion::create(5, 128, LIMITS).is_err());
        assert!(InflightRegion::create(1, 0, LIMITS).is_err());
        assert!(InflightRegion::create(1, 257, LIMITS).is_err());
        let (region, file) = new_region(2, 128);
        assert_eq!(region.size(), 2 * 2112);
        assert_eq!(file.metadata().unwrap().len(), region.size());
        // SAFETY: fcntl on a descriptor we own.
        let seals = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) };
        assert_eq!(
            seals & (libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL),
            libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL
        );
        assert!(file.set_len(10).is_err(), "shrinking is sealed");
        assert!(region.queue(1).is_ok());
        assert!(matches!(
            region.queue(2),
            Err(InflightError::NoSuchQueue { .. })
        ));
    }

    #[test]
    fn open_refuses_bad_messages_and_files() {
        let (_, file) = new_region(2, 128);
        let size = region_size(2, 128);
        let open = |size, offset, nq, qs| InflightRegion::open(&file, size, offset, nq, qs, LIMITS);
        assert!(open(size, 0, 2, 128).is_ok());
        // A message for fewer queues maps a prefix of the same file.
        assert!(open(size, 0, 1, 128).is_ok());
        assert!(matches!(
            open(size - 1, 0, 2, 128),
            Err(InflightError::TooSmall { .. })
        ));
        assert!(matches!(
            open(size, 64, 2, 128),
            Err(InflightError::Unaligned(64))
        ));
        assert!(matches!(
            open(size, 4096, 2, 128),
            Err(InflightError::PastEnd { .. })
        ));
        assert!(matches!(
            open(u64::MAX, 4096, 2, 128),
            Err(InflightError::PastEnd { .. })
        ));
        assert!(matches!(
            open(size, 0, 9, 128),
            Err(InflightError::Geometry { .. })
        ));
        assert!(matches!(
            open(size, 0, 2, 512),
            Err(InflightError::Geometry { .. })
        ));
        // A file that could shrink under the mapping is refused.
        // SAFETY: memfd_create with a static name; the result is checked.
        let fd = unsafe { libc::memfd_create(c"unsealed".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: a fresh fd owned by nobody else.
        let unsealed = unsafe { <File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        unsealed.set_len(size).unwrap();
        assert!(matches!(
            InflightRegion::open(&unsealed, size, 0, 2, 128, LIMITS),
            Err(InflightError::NotSealed)
        ));
    }

    #[test]
    fn a_fresh_region_is_initialized_and_resubmits_nothing() {
        let (region, _file) = new_region(1, 16);
        let mut q = region.queue(0).unwrap();
        // After a migration the first start may find the used index anywhere.
        let got = q.recover(16, 40, 45).unwrap();
        assert_eq!(got, Recovered::default());
        assert_eq!(q.load16(OFF_VERSION), VERSION);
        assert_eq!(q.load16(OFF_DESC_NUM), 16);
        assert_eq!(q.load16(OFF_USED_IDX), 40);
        // Initialized: the next start is a reconnect with nothing in flight.
        let again = q.recover(16, 40, 45).unwrap();
        assert_eq!(again.next_avail, Some(40));
        assert!(again.resubmit.is_empty());
    }

    #[test]
    fn mark_and_clear() {
        let (region, file) = new_region(2, 16);
        let mut q = region.queue(1).unwrap();
        q.recover(16, 0, 0).unwrap();
        let mut used = 0u16;
        q.mark(3);
        q.mark(7);
        assert!(q.inflight(3) && q.inflight(7));
        assert_eq!((q.counter_of(3), q.counter_of(7)), (0, 1));
        complete(&q, 3, &mut used);
        assert!(!q.inflight(3) && q.inflight(7));
        assert_eq!(q.load16(OFF_USED_IDX), 1);
        assert_eq!(q.load16(OFF_LAST_BATCH_HEAD), 3);
        // Queue 1 lives at its own offset; queue 0 is untouched.
        let other = reopen(&file, 2, 16).queue(0).unwrap();
        assert!((0..16).all(|h| !other.inflight(h)));
        assert_eq!(other.load16(OFF_VERSION), 0);
        // Out-of-range heads are ignored, not written past the entries.
        q.mark(16);
        q.mark(u16::MAX);
        q.record_batch([u16::MAX, 16], 9);
        assert_eq!(
            q.repair_last_batch(16, 8),
            0,
            "the list leaves the ring at once"
        );
    }

    #[test]
    fn recovery_resubmits_in_counter_order() {
        let (region, file) = new_region(1, 16);
        let mut q = region.queue(0).unwrap();
        q.recover(16, 0, 0).unwrap();
        let mut used = 0u16;
        // Popped in the order 9, 2, 5, 11, 4; 2 and 11 completed (out of order).
        for head in [9, 2, 5, 11, 4] {
            q.mark(head);
        }
        complete(&q, 11, &mut used);
        complete(&q, 2, &mut used);
        drop(q);
        // The process dies; a new one maps the same memfd.
        let mut q = reopen(&file, 1, 16).queue(0).unwrap();
        let got = q.recover(16, used, 5).unwrap();
        assert_eq!(got.resubmit, vec![9, 5, 4]);
        assert_eq!(got.next_avail, Some(5));
        assert_eq!(got.repaired_batch, 0);
        // New marks continue after the oldest survivors' counters.
        q.mark(6);
        assert_eq!(q.counter_of(6), 5);
    }

    #[test]
    fn a_crash_between_the_clear_and_the_used_index_is_recognized() {
        let (region, file) = new_region(1, 8);
        let mut q = region.queue(0).unwrap();
        q.recover(8, 100, 100).unwrap();
        for head in [1, 2, 3] {
            q.mark(head);
        }
        // The iothread records a batch of 2 and 3 (used 100 → 102), clearing their flags, then
        // dies before the used index in guest memory moved.
        q.record_batch([2, 3], 102);
        assert!(!q.inflight(2) && !q.inflight(3));
        drop(q);
        let mut q = reopen(&file, 1, 8).queue(0).unwrap();
        let got = q.recover(8, 100, 103).unwrap();
        assert_eq!(got.repaired_batch, 2);
        assert_eq!(
            got.resubmit,
            vec![1, 2, 3],
            "marked again, in counter order"
        );
        assert_eq!(got.next_avail, Some(103));
        assert_eq!(q.load16(OFF_USED_IDX), 100);

        // The same batch, with the used index moved: nothing of it is in flight.
        let (region, file) = new_region(1, 8);
        let mut q = region.queue(0).unwrap();
        q.recover(8, 100, 100).unwrap();
        for head in [1, 2, 3] {
            q.mark(head);
        }
        q.record_batch([2, 3], 102);
        drop(q);
        let got = reopen(&file, 1, 8)
            .queue(0)
            .unwrap()
            .recover(8, 102, 103)
            .unwrap();
        assert_eq!((got.resubmit, got.repaired_batch), (vec![1], 0));
        assert_eq!(got.next_avail, Some(103));
    }

    #[test]
    fn a_head_marked_again_after_its_use_stays_marked() {
        // The driver saw head 4 used and made it available again; the frontend marked it. No
        // later step of the iothread's touches its flag.
        let (region, _file) = new_region(1, 8);
        let mut q = region.queue(0).unwrap();
        q.recover(8, 0, 0).unwrap();
        q.mark(4);
        let mut used = 0;
        complete(&q, 4, &mut used);
        q.mark(4);
        assert!(q.is_marked(4));
        assert_eq!(q.repair_last_batch(8, used), 0);
        assert!(q.is_marked(4));
        let got = q.recover(8, used, 2).unwrap();
        assert_eq!(got.resubmit, vec![4]);
    }

    #[test]
    fn a_version_1_region_is_recovered_in_its_own_order() {
        let (region, file) = new_region(1, 8);
        let mut q = region.queue(0).unwrap();
        q.recover(8, 0, 0).unwrap();
        q.store16(OFF_VERSION, VERSION_CLEAR_AFTER_USED);
        for head in [4, 5, 6, 7] {
            q.mark(head);
        }
        // libvhost-user batching three used entries, crashing before clearing any flag.
        link_v1(&q, 4);
        link_v1(&q, 5);
        link_v1(&q, 6);
        drop(q);
        let q = reopen(&file, 1, 8).queue(0).unwrap();
        let mut q = q;
        let got = q.recover(8, 3, 4).unwrap();
        assert_eq!(got.repaired_batch, 3);
        assert_eq!(got.resubmit, vec![7]);
        assert_eq!(got.next_avail, Some(4));
        assert_eq!(
            q.load16(OFF_VERSION),
            VERSION,
            "written in the new order from now on"
        );
    }

    #[test]
    fn a_batch_of_several_is_walked_through_next() {
        let (region, file) = new_region(1, 8);
        let mut q = region.queue(0).unwrap();
        q.recover(8, 0, 0).unwrap();
        for head in [4, 5, 6, 7] {
            q.mark(head);
        }
        let mut used = 0;
        complete(&q, 7, &mut used);
        q.record_batch([4, 5, 6], 4);
        drop(q);
        let q = reopen(&file, 1, 8).queue(0).unwrap();
        assert_eq!(q.repair_last_batch(8, used), 3);
        assert!((4..7).all(|h| q.is_marked(h)) && !q.is_marked(7));
    }

    /// Writes raw values into the queue region, as a hostile VMM or a buggy predecessor could.
    fn forge(q: &QueueInflight, entries: &[(u16, u8, u16, u64)]) {
        for &(head, inflight, next, counter) in entries {
            let base = QUEUE_HEADER_SIZE as usize + usize::from(head) * DESC_STATE_SIZE as usize;
            q.header::<AtomicU8>(base)
                .unwrap()
                .store(inflight, Ordering::Relaxed);
            q.header::<AtomicU16>(base + OFF_DESC_NEXT)
                .unwrap()
                .store(next, Ordering::Relaxed);
            q.header::<AtomicU64>(base + OFF_DESC_COUNTER)
                .unwrap()
                .store(counter, Ordering::Relaxed);
        }
    }

    #[test]
    fn hostile_contents_never_panic() {
        // Region entries 16, ring size 8: heads 8..16 exist in the region but not in the ring.
        let (region, _file) = new_region(1, 16);
        let mut q = region.queue(0).unwrap();
        q.recover(8, 0, 0).unwrap();
        forge(
            &q,
            &[
                (0, 1, 15, u64::MAX),
                (1, 0xff, 1, u64::MAX - 1),
                (3, 1, 3, 0),
                (12, 1, 0, 5),
                (15, 1, 12, 1),
            ],
        );
        q.store16(OFF_DESC_NUM, 999);
        // A used index far from the region's: the batch list loops (1 → 1) and leaves the ring.
        q.store16(OFF_LAST_BATCH_HEAD, 1);
        q.store16(OFF_USED_IDX, 60000);
        let got = q.recover(8, 0, 8).unwrap();
        // 1 was marked again by the batch walk (a loop is bounded); heads 12 and 15 are not
        // ring heads and are cleared; 3, 1 and 0 remain, ordered by counter (huge counters
        // sort last and the next counter wraps).
        assert_eq!(got.resubmit, vec![3, 1, 0]);
        assert_eq!(got.next_avail, Some(3));
        assert_eq!(q.load16(OFF_DESC_NUM), 16);
        assert!(!q.inflight(12) && !q.inflight(15));
        q.mark(5);
        assert_eq!(q.counter_of(5), 0, "u64::MAX + 1 wraps");

        // A batch list that leaves the ring at once.
        q.store16(OFF_LAST_BATCH_HEAD, 40000);
        q.store16(OFF_USED_IDX, 7);
        assert!(q.recover(8, 9, 13).is_ok());

        // More marked than the avail ring can account for.
        forge(&q, &[(0, 1, 0, 1), (1, 1, 0, 2), (2, 1, 0, 3)]);
        assert!(matches!(
            q.recover(8, 9, 10),
            Err(InflightError::Inconsistent { .. })
        ));
        // Unknown version, and a ring larger than the region.
        q.store16(OFF_VERSION, 7);
        assert!(matches!(q.recover(8, 0, 0), Err(InflightError::Version(7))));
        assert!(matches!(
            q.recover(32, 0, 0),
            Err(InflightError::RingTooLarge { .. })
        ));
        // Every index wraps without overflow.
        q.store16(OFF_VERSION, VERSION);
        forge(
            &q,
            &[
                (0, 0, 0, 0),
                (1, 0, 0, 0),
                (2, 0, 0, 0),
                (3, 0, 0, 0),
                (5, 1, 0, 0),
            ],
        );
        let got = q.recover(8, u16::MAX, 0).unwrap();
        assert_eq!((got.resubmit, got.next_avail), (vec![5], Some(0)));
    }

    #[test]
    fn a_reset_forgets_what_a_broken_ring_left_marked() {
        let (region, _file) = new_region(2, 8);
        let mut q0 = region.queue(0).unwrap();
        let mut q1 = region.queue(1).unwrap();
        q0.recover(8, 0, 0).unwrap();
        q1.recover(8, 0, 0).unwrap();
        q0.mark(3);
        q1.mark(4);
        region.forget();
        assert_eq!(q0.recover(8, 0, 2).unwrap(), Recovered::default());
        assert_eq!(q1.recover(8, 0, 2).unwrap(), Recovered::default());
        assert!(!q0.inflight(3) && !q1.inflight(4));
    }

    #[test]
    fn a_forged_version_zero_region_starts_clean() {
        let (region, _file) = new_region(1, 8);
        let mut q = region.queue(0).unwrap();
        forge(&q, &[(1, 1, 0, 3), (5, 1, 0, 4)]);
        assert_eq!(q.recover(8, 0, 0).unwrap(), Recovered::default());
        assert!((0..8).all(|h| !q.inflight(h)));
    }
}
