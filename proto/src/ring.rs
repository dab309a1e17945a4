//! The shared-memory batch ring between a frontend and one of its iothreads.
//!
//! One memfd per iothread holds, in this order (all offsets from the start of the file, all
//! integers little-endian, x86_64/aarch64 natural alignment):
//!
//! | offset | size | what |
//! |---|---|---|
//! | 0 | 4096 | [`RingHeader`]: magic `BLKPRING`, version, geometry, offsets below |
//! | `sq_offset` | 192 + 4 × `sq_entries` | submission queue: [`QueueIndices`], then `u32` slot numbers |
//! | `cq_offset` | 192 + 16 × `cq_entries` | completion queue: [`QueueIndices`], then [`Completion`]s |
//! | `slots_offset` | `slot_stride` × `slot_count` | request slots: [`SlotHeader`] then `segments_per_slot` [`Segment`]s |
//!
//! [`QueueIndices`] is three 64-byte cache lines: the producer index, the consumer index and the
//! consumer's "sleeping" flag. Indices are free-running `u32` counters; entry `i` lives at
//! `i & (entries - 1)`.
//!
//! A request is written into its slot by the frontend (slot number = queue-local index ×
//! queue size + descriptor head, so a slot is never used by two in-flight requests), then the
//! slot number is pushed on the submission queue. The iothread executes it, completes it in
//! guest memory (status byte, used ring, interrupt: it is the only writer of the used rings of
//! its virtqueues) and pushes a [`Completion`], which tells the frontend the slot is free and
//! feeds its statistics. The frontend reads completions when it wakes anyway (a kick) and asks
//! to be woken for them only when it waits for requests to finish (a drain, a ring stop, a
//! memory-table change): completing a request costs it no wake-up. Each queue has exactly one producer and one consumer process. Because a slot
//! is in at most one of the two queues at a time, both queues have room for every slot and a
//! push never finds them full unless the peer is misbehaving.
//!
//! Wake-ups follow io_uring's `NEED_WAKEUP` idea: a consumer about to sleep sets its
//! `consumer_sleeping` flag, issues a full fence and checks the queue once more; a producer
//! publishes its index, issues a full fence and only writes the peer's eventfd if the flag is
//! set. So a busy peer is never woken, and a sleeping one is never missed.
//!
//! Either side may be hostile or crash half-way: every index and slot number read from the
//! mapping is checked before use, and a violation is reported as [`RingError`] instead of
//! panicking.

use std::fs::File;
use std::io;
use std::mem::size_of;
use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use crate::shm::{sealed_memfd, SharedMapping};

/// The eight bytes at offset 0 of every ring file.
pub const RING_MAGIC: [u8; 8] = *b"BLKPRING";
/// The layout version this crate reads and writes; bumped on any incompatible change.
pub const RING_VERSION: u32 = 2;
/// Bytes reserved for the header, so that the queues start on their own page.
pub const HEADER_SIZE: u64 = 4096;
/// Offset in the header page of the iothread's [`RingCounters`], on a cache line of their own
/// after [`RingHeader`].
pub const COUNTERS_OFFSET: u64 = 1024;
/// Offset in the header page of the dirty-log epoch ([`LogEpoch`]), on its own cache line
/// after the counters.
pub const LOG_EPOCH_OFFSET: u64 = 1088;
/// The largest number of segments a slot may hold; bounds the memfd size.
pub const MAX_SEGMENTS_PER_SLOT: u32 = 4096;
/// The largest number of slots a ring may have (all queues of an iothread × queue size).
pub const MAX_SLOTS: u32 = 1 << 20;

/// What went wrong with a ring: creating it, opening it, or a peer breaking its rules.
#[derive(Debug, thiserror::Error)]
pub enum RingError {
    /// The requested geometry is zero or too large.
    #[error("invalid ring geometry: {0}")]
    Geometry(&'static str),
    /// The file does not start with [`RING_MAGIC`].
    #[error("ring file has a bad magic")]
    BadMagic,
    /// The file was written by an incompatible version.
    #[error("ring version {0} is not supported (expected {RING_VERSION})")]
    BadVersion(u32),
    /// The header's geometry disagrees with itself or with the file size.
    #[error("ring header is inconsistent: {0}")]
    BadHeader(&'static str),
    /// The peer published a producer index more than a queue's length ahead of the consumer.
    #[error("peer published {published} entries on a queue of {capacity}")]
    Overrun {
        /// Entries the producer index claims are ready.
        published: u32,
        /// The queue's capacity.
        capacity: u32,
    },
    /// A queue had no room: the peer is not consuming, or slots were pushed twice.
    #[error("queue full")]
    Full,
    /// A slot number outside the slot table.
    #[error("slot {0} is outside the slot table")]
    BadSlot(u32),
    /// More segments than a slot holds.
    #[error("{0} segments do not fit a slot")]
    TooManySegments(u32),
    /// A system call failed.
    #[error("{op}: {source}")]
    Os {
        /// The operation that failed.
        op: &'static str,
        /// The error it returned.
        source: io::Error,
    },
}

type Result<T> = std::result::Result<T, RingError>;

/// The operation a slot asks the iothread to perform.
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Opcode {
    /// Read from the image at `image_offset` into the guest-memory segments.
    Read = 1,
    /// Write the guest-memory segments to the image at `image_offset`.
    Write = 2,
    /// Make every completed write durable (fdatasync).
    Flush = 3,
    /// Deallocate the image ranges given as segments.
    Discard = 4,
    /// Zero the image ranges given as segments ([`RANGE_FLAG_UNMAP`] allows deallocation).
    WriteZeroes = 5,
    /// No I/O: complete the request at once with [`SlotHeader::answer`] as its status. The
    /// frontend answers what it decided itself (a rejected request, GET_ID) this way, so that
    /// the iothread stays the only writer of the used ring.
    Answer = 6,
}

impl Opcode {
    /// Decodes a raw opcode read from shared memory.
    pub fn from_raw(raw: u32) -> Option<Self> {
        Some(match raw {
            1 => Self::Read,
            2 => Self::Write,
            3 => Self::Flush,
            4 => Self::Discard,
            5 => Self::WriteZeroes,
            6 => Self::Answer,
            _ => return None,
        })
    }
}

/// [`SlotHeader::flags`]: make the write durable (fdatasync) before completing it. Set when
/// the guest runs the disk in writethrough mode.
pub const SLOT_FLAG_SYNC: u32 = 1;
/// [`Segment::aux`] of a Discard/WriteZeroes range: the range may be deallocated.
pub const RANGE_FLAG_UNMAP: u32 = 1;

/// One piece of a request.
///
/// For `Read`/`Write` it is a guest-memory buffer: `aux` is the index of the memory region in
/// the table last sent with `SetMemoryTable`, `offset` the byte offset inside that region's
/// mapping (not a guest-physical address) and `len` the length.
/// For `Discard`/`WriteZeroes` it is an image range: `offset` and `len` in bytes, `aux` the
/// `RANGE_FLAG_*` bits.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Segment {
    /// Byte offset: inside the memory region, or inside the image.
    pub offset: u64,
    /// Length in bytes.
    pub len: u32,
    /// Region index (data) or range flags (discard, write zeroes).
    pub aux: u32,
}

/// [`SlotHeader::status_region`] of a request whose status byte could not be located (a
/// rejected chain): nothing is written but the used entry, with length 0.
pub const NO_STATUS: u32 = u32::MAX;

/// The fixed part of a request slot; `segment_count` [`Segment`]s follow it.
///
/// Besides what to execute it says how to complete the request, which the iothread does
/// itself: the virtqueue (`queue`, an index into the queues the frontend started on this
/// iothread with `StartQueue`), the descriptor head to put on its used ring, where the status
/// byte goes, and the used length.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SlotHeader {
    /// An [`Opcode`] as `u32`.
    pub opcode: u32,
    /// `SLOT_FLAG_*` bits.
    pub flags: u32,
    /// Image byte offset of a Read or Write.
    pub image_offset: u64,
    /// How many segments follow.
    pub segment_count: u32,
    /// The request's virtqueue: its index among the queues started on this iothread.
    pub queue: u16,
    /// The descriptor head the used entry returns.
    pub head: u16,
    /// The memory region of the status byte, or [`NO_STATUS`].
    pub status_region: u32,
    /// The used length when the request succeeds (a failed one returns only its status byte).
    pub used_len: u32,
    /// Offset of the status byte in its memory region.
    pub status_offset: u64,
    /// The status of an [`Opcode::Answer`]: `VIRTIO_BLK_S_OK`, `_IOERR` or `_UNSUPP`.
    pub answer: u32,
    /// Zero.
    pub reserved: u32,
}

/// A finished request, pushed by the iothread once its used entry is written and before the
/// used index that makes it visible to the guest is published.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Completion {
    /// The slot that was submitted.
    pub slot: u32,
    /// A virtio-blk status: `VIRTIO_BLK_S_OK`, `VIRTIO_BLK_S_IOERR` or `VIRTIO_BLK_S_UNSUPP`.
    pub status: u32,
    /// When the request completed, in [`crate::clock::monotonic_ns`] nanoseconds.
    pub completed_ns: u64,
}

/// The header at offset 0 of a ring file.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct RingHeader {
    /// [`RING_MAGIC`].
    pub magic: [u8; 8],
    /// [`RING_VERSION`].
    pub version: u32,
    /// Number of request slots.
    pub slot_count: u32,
    /// Segments each slot holds.
    pub segments_per_slot: u32,
    /// Entries in the submission queue (power of two ≥ `slot_count`).
    pub sq_entries: u32,
    /// Entries in the completion queue (power of two ≥ `slot_count`).
    pub cq_entries: u32,
    /// Zero.
    pub reserved: u32,
    /// File offset of the submission queue.
    pub sq_offset: u64,
    /// File offset of the completion queue.
    pub cq_offset: u64,
    /// File offset of slot 0.
    pub slots_offset: u64,
    /// Bytes from one slot to the next.
    pub slot_stride: u64,
    /// Size of the whole file.
    pub total_size: u64,
}

const _: () = assert!(size_of::<RingHeader>() as u64 <= COUNTERS_OFFSET);
const _: () = assert!(COUNTERS_OFFSET + size_of::<CounterBlock>() as u64 <= LOG_EPOCH_OFFSET);
const _: () = assert!(LOG_EPOCH_OFFSET + 64 <= HEADER_SIZE);

/// How the frontend tells its iothread that a `SetDirtyLog` is on the control socket without
/// waiting for it to be read: it sends the message, then bumps this counter. The iothread
/// compares it with the last value it acted on before it publishes used indices (and again
/// after, behind a full fence) and reads its control socket when it changed. So a write the
/// iothread makes after the frontend acknowledged LOG_ALL is marked: either the iothread saw
/// the new epoch before marking, or the write came before the bump, and so before the
/// acknowledgement — and an iothread the frontend cannot reach at once (stopped, busy) does not
/// hold up the VMM.
#[derive(Clone)]
pub struct LogEpoch {
    mapping: Arc<Mapping>,
}

impl LogEpoch {
    fn cell(&self) -> &AtomicU32 {
        // SAFETY: LOG_EPOCH_OFFSET + 4 lies inside the header page (asserted above), which
        // every ring mapping covers; it is 64-byte aligned and only accessed atomically.
        unsafe { &*self.mapping.at::<AtomicU32>(LOG_EPOCH_OFFSET) }
    }

    /// The frontend: a `SetDirtyLog` was sent.
    pub fn bump(&self) {
        let cell = self.cell();
        cell.store(
            cell.load(Ordering::Relaxed).wrapping_add(1),
            Ordering::SeqCst,
        );
    }

    /// The current epoch (SeqCst: ordered after the iothread's writes before it).
    pub fn load(&self) -> u32 {
        self.cell().load(Ordering::SeqCst)
    }
}

/// The counters at [`COUNTERS_OFFSET`]: zero in a new ring (a fresh memfd), kept across the
/// iothreads that serve it in turn.
#[repr(C, align(64))]
struct CounterBlock {
    inline_transfers: AtomicU64,
    queued_transfers: AtomicU64,
}

/// How the iothreads of a ring executed reads and writes, for the frontend's statistics. Only
/// the iothread adds to them (relaxed: they order nothing); the frontend reads them on the
/// admin thread, never on the request path. From the frontend's side they are the peer's word:
/// shown, never acted on.
#[derive(Clone)]
pub struct RingCounters {
    mapping: Arc<Mapping>,
}

impl std::fmt::Debug for RingCounters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RingCounters")
            .field("inline_transfers", &self.inline_transfers())
            .field("queued_transfers", &self.queued_transfers())
            .finish()
    }
}

impl RingCounters {
    fn block(&self) -> &CounterBlock {
        // SAFETY: COUNTERS_OFFSET + the block lies inside the header page (asserted above),
        // which every ring mapping covers; the block is 64-byte aligned there and only ever
        // accessed through atomics.
        unsafe { &*self.mapping.at::<CounterBlock>(COUNTERS_OFFSET) }
    }

    /// Transfers (preadv/pwritev calls) run inline on the iothread, without io_uring.
    pub fn inline_transfers(&self) -> u64 {
        self.block().inline_transfers.load(Ordering::Relaxed)
    }

    /// Transfers submitted to io_uring.
    pub fn queued_transfers(&self) -> u64 {
        self.block().queued_transfers.load(Ordering::Relaxed)
    }

    /// Counts one inline transfer.
    pub fn count_inline(&self) {
        bump(&self.block().inline_transfers);
    }

    /// Counts one transfer submitted to io_uring.
    pub fn count_queued(&self) {
        bump(&self.block().queued_transfers);
    }
}

/// Adds one to a counter only one thread writes (the ring's iothread): a plain load and store,
/// no locked read-modify-write on the request path; a reader sees the old or the new value.
fn bump(counter: &AtomicU64) {
    counter.store(
        counter.load(Ordering::Relaxed).wrapping_add(1),
        Ordering::Relaxed,
    );
}

#[repr(C, align(64))]
struct PaddedIndex(AtomicU32);

/// The three cache lines at the start of each queue.
#[repr(C)]
pub struct QueueIndices {
    producer: PaddedIndex,
    consumer: PaddedIndex,
    consumer_sleeping: PaddedIndex,
}

/// Where everything lives in a ring file, computed from its geometry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingLayout {
    /// Number of request slots.
    pub slot_count: u32,
    /// Segments each slot holds.
    pub segments_per_slot: u32,
    /// Submission queue entries.
    pub sq_entries: u32,
    /// Completion queue entries.
    pub cq_entries: u32,
    /// File offset of the submission queue.
    pub sq_offset: u64,
    /// File offset of the completion queue.
    pub cq_offset: u64,
    /// File offset of slot 0.
    pub slots_offset: u64,
    /// Bytes per slot.
    pub slot_stride: u64,
    /// Total file size.
    pub total_size: u64,
}

#[allow(
    clippy::arithmetic_side_effects,
    reason = "only called by RingLayout::new on bounded geometry, far below u64::MAX"
)]
fn align_up(value: u64, align: u64) -> u64 {
    value.div_ceil(align) * align
}

impl RingLayout {
    /// Computes the layout for `slot_count` slots of `segments_per_slot` segments each.
    #[allow(
        clippy::arithmetic_side_effects,
        reason = "slot_count <= 2^20 and segments_per_slot <= 4096 are checked first: the ring \
                  is below 2^37 bytes"
    )]
    pub fn new(slot_count: u32, segments_per_slot: u32) -> Result<Self> {
        if slot_count == 0 || slot_count > MAX_SLOTS {
            return Err(RingError::Geometry("slot count must be 1..=2^20"));
        }
        if segments_per_slot == 0 || segments_per_slot > MAX_SEGMENTS_PER_SLOT {
            return Err(RingError::Geometry("segments per slot must be 1..=4096"));
        }
        let entries = slot_count.next_power_of_two();
        let indices = size_of::<QueueIndices>() as u64;
        let sq_offset = HEADER_SIZE;
        let cq_offset = align_up(sq_offset + indices + 4 * u64::from(entries), 64);
        let slots_offset = align_up(
            cq_offset + indices + size_of::<Completion>() as u64 * u64::from(entries),
            4096,
        );
        let slot_stride = align_up(
            size_of::<SlotHeader>() as u64
                + size_of::<Segment>() as u64 * u64::from(segments_per_slot),
            64,
        );
        let total_size = align_up(slots_offset + slot_stride * u64::from(slot_count), 4096);
        Ok(Self {
            slot_count,
            segments_per_slot,
            sq_entries: entries,
            cq_entries: entries,
            sq_offset,
            cq_offset,
            slots_offset,
            slot_stride,
            total_size,
        })
    }

    fn header(&self) -> RingHeader {
        RingHeader {
            magic: RING_MAGIC,
            version: RING_VERSION,
            slot_count: self.slot_count,
            segments_per_slot: self.segments_per_slot,
            sq_entries: self.sq_entries,
            cq_entries: self.cq_entries,
            reserved: 0,
            sq_offset: self.sq_offset,
            cq_offset: self.cq_offset,
            slots_offset: self.slots_offset,
            slot_stride: self.slot_stride,
            total_size: self.total_size,
        }
    }

    /// Validates a header read from a file of `file_len` bytes written by the peer.
    pub fn from_header(header: &RingHeader, file_len: u64) -> Result<Self> {
        if header.magic != RING_MAGIC {
            return Err(RingError::BadMagic);
        }
        if header.version != RING_VERSION {
            return Err(RingError::BadVersion(header.version));
        }
        // Recomputing from the geometry and comparing rejects every inconsistent offset.
        let layout = Self::new(header.slot_count, header.segments_per_slot)
            .map_err(|_| RingError::BadHeader("geometry out of range"))?;
        if layout.header().as_comparable() != header.as_comparable() {
            return Err(RingError::BadHeader("offsets disagree with geometry"));
        }
        if layout.total_size > file_len {
            return Err(RingError::BadHeader("file shorter than the layout"));
        }
        Ok(layout)
    }
}

impl RingHeader {
    fn as_comparable(&self) -> [u64; 12] {
        [
            u64::from_le_bytes(self.magic),
            u64::from(self.version),
            u64::from(self.slot_count),
            u64::from(self.segments_per_slot),
            u64::from(self.sq_entries),
            u64::from(self.cq_entries),
            u64::from(self.reserved),
            self.sq_offset,
            self.cq_offset,
            self.slots_offset,
            self.slot_stride,
            self.total_size,
        ]
    }
}

/// A shared mapping of a ring file; unmapped when the last user drops it.
struct Mapping(SharedMapping);

impl Mapping {
    fn new(file: &File, len: u64) -> Result<Self> {
        SharedMapping::new(file, len, 0)
            .map(Self)
            .map_err(|source| RingError::Os {
                op: "mmap ring",
                source,
            })
    }

    /// A pointer `offset` bytes into the mapping; callers only pass offsets that come from a
    /// validated [`RingLayout`] whose `total_size` is at most the mapping's length.
    fn at<T>(&self, offset: u64) -> *mut T {
        let offset = crate::usize_from(offset);
        debug_assert!(offset.checked_add(size_of::<T>()) <= Some(self.0.len()));
        // SAFETY: in bounds per the contract above.
        unsafe { self.0.as_ptr().add(offset).cast::<T>() }
    }
}

/// A ring file mapped into this process.
pub struct SharedRing {
    file: File,
    layout: RingLayout,
    mapping: Arc<Mapping>,
}

impl SharedRing {
    /// Creates a new ring in a fresh memfd (the frontend does this, once per iothread).
    pub fn create(slot_count: u32, segments_per_slot: u32) -> Result<Self> {
        let layout = RingLayout::new(slot_count, segments_per_slot)?;
        // Sealed so that a hostile iothread cannot shrink the file under us (SIGBUS).
        let file =
            sealed_memfd(c"blkplane-ring", layout.total_size).map_err(|source| RingError::Os {
                op: "create ring memfd",
                source,
            })?;
        let mapping = Arc::new(Mapping::new(&file, layout.total_size)?);
        // SAFETY: the header fits in HEADER_SIZE at offset 0 of a mapping of total_size bytes.
        unsafe { std::ptr::write_volatile(mapping.at::<RingHeader>(0), layout.header()) };
        Ok(Self {
            file,
            layout,
            mapping,
        })
    }

    /// Maps a ring file received from the peer and validates its header.
    pub fn open(file: File) -> Result<Self> {
        let file_len = file
            .metadata()
            .map_err(|source| RingError::Os {
                op: "fstat ring",
                source,
            })?
            .len();
        if file_len < HEADER_SIZE {
            return Err(RingError::BadHeader("file shorter than the header"));
        }
        let header_map = Mapping::new(&file, HEADER_SIZE)?;
        // SAFETY: the header lies within the first HEADER_SIZE bytes just mapped.
        let header = unsafe { std::ptr::read_volatile(header_map.at::<RingHeader>(0)) };
        drop(header_map);
        let layout = RingLayout::from_header(&header, file_len)?;
        let mapping = Arc::new(Mapping::new(&file, layout.total_size)?);
        Ok(Self {
            file,
            layout,
            mapping,
        })
    }

    /// The memfd, to pass to the peer.
    pub fn file(&self) -> &File {
        &self.file
    }

    /// The geometry.
    pub fn layout(&self) -> &RingLayout {
        &self.layout
    }

    /// The iothread's counters (see [`RingCounters`]).
    pub fn counters(&self) -> RingCounters {
        RingCounters {
            mapping: Arc::clone(&self.mapping),
        }
    }

    /// The dirty-log epoch (see [`LogEpoch`]).
    pub fn log_epoch(&self) -> LogEpoch {
        LogEpoch {
            mapping: Arc::clone(&self.mapping),
        }
    }

    /// Zeroes both queues' indices and flags. Only while no peer is attached (before a new
    /// iothread is handed the ring after the previous one died).
    pub fn reset_queues(&self) {
        for offset in [self.layout.sq_offset, self.layout.cq_offset] {
            // SAFETY: the indices are at a validated offset inside the mapping.
            let indices = unsafe { &*self.mapping.at::<QueueIndices>(offset) };
            indices.producer.0.store(0, Ordering::SeqCst);
            indices.consumer.0.store(0, Ordering::SeqCst);
            indices.consumer_sleeping.0.store(0, Ordering::SeqCst);
        }
    }

    #[allow(
        clippy::arithmetic_side_effects,
        reason = "offset and entries (a power of two, at least 1) come from a validated RingLayout"
    )]
    fn queue<T: Copy>(&self, offset: u64, entries: u32) -> QueueView<T> {
        QueueView {
            indices: self.mapping.at::<QueueIndices>(offset),
            entries: self
                .mapping
                .at::<T>(offset + size_of::<QueueIndices>() as u64),
            mask: entries - 1,
            capacity: entries,
            _mapping: Arc::clone(&self.mapping),
        }
    }

    /// The frontend's end of the submission queue.
    pub fn submission_producer(&self) -> Producer<u32> {
        Producer::new(self.queue(self.layout.sq_offset, self.layout.sq_entries))
    }

    /// The iothread's end of the submission queue.
    pub fn submission_consumer(&self) -> Consumer<u32> {
        Consumer::new(self.queue(self.layout.sq_offset, self.layout.sq_entries))
    }

    /// The iothread's end of the completion queue.
    pub fn completion_producer(&self) -> Producer<Completion> {
        Producer::new(self.queue(self.layout.cq_offset, self.layout.cq_entries))
    }

    /// The frontend's end of the completion queue.
    pub fn completion_consumer(&self) -> Consumer<Completion> {
        Consumer::new(self.queue(self.layout.cq_offset, self.layout.cq_entries))
    }

    /// Access to the request slots.
    pub fn slots(&self) -> SlotTable {
        SlotTable {
            base: self.mapping.at::<u8>(self.layout.slots_offset),
            stride: self.layout.slot_stride,
            count: self.layout.slot_count,
            segments_per_slot: self.layout.segments_per_slot,
            _mapping: Arc::clone(&self.mapping),
        }
    }
}

struct QueueView<T> {
    indices: *const QueueIndices,
    entries: *mut T,
    mask: u32,
    capacity: u32,
    _mapping: Arc<Mapping>,
}

// SAFETY: the view points into a mapping it keeps alive; one thread owns each end.
unsafe impl<T: Send> Send for QueueView<T> {}

impl<T: Copy> QueueView<T> {
    fn indices(&self) -> &QueueIndices {
        // SAFETY: points at validated, mapped, suitably aligned indices kept alive by _mapping.
        unsafe { &*self.indices }
    }

    fn entry(&self, index: u32) -> *mut T {
        // SAFETY: `index & mask` < capacity, and the layout reserved `capacity` entries.
        unsafe { self.entries.add((index & self.mask) as usize) }
    }
}

/// The writing end of a queue. Pushes are private until [`Producer::publish`].
pub struct Producer<T: Copy> {
    view: QueueView<T>,
    tail: u32,
}

impl<T: Copy> Producer<T> {
    fn new(view: QueueView<T>) -> Self {
        let tail = view.indices().producer.0.load(Ordering::Acquire);
        Self { view, tail }
    }

    /// Queues `value`; fails with [`RingError::Full`] when the consumer has not freed room.
    pub fn push(&mut self, value: T) -> Result<()> {
        let head = self.view.indices().consumer.0.load(Ordering::Acquire);
        if self.tail.wrapping_sub(head) >= self.view.capacity {
            return Err(RingError::Full);
        }
        // SAFETY: the entry is inside the queue, and the consumer does not read it until the
        // producer index is published past it.
        unsafe { std::ptr::write_volatile(self.view.entry(self.tail), value) };
        self.tail = self.tail.wrapping_add(1);
        Ok(())
    }

    /// Entries pushed but not yet published.
    pub fn unpublished(&self) -> u32 {
        self.tail
            .wrapping_sub(self.view.indices().producer.0.load(Ordering::Relaxed))
    }

    /// Makes every pushed entry visible. Returns true when the consumer is asleep and must be
    /// woken through its eventfd.
    pub fn publish(&mut self) -> bool {
        let indices = self.view.indices();
        indices.producer.0.store(self.tail, Ordering::Release);
        // Pairs with the fence in `Consumer::prepare_to_sleep`: either it sees our entries or
        // we see its flag.
        fence(Ordering::SeqCst);
        indices.consumer_sleeping.0.load(Ordering::Relaxed) != 0
    }
}

/// The reading end of a queue.
pub struct Consumer<T: Copy> {
    view: QueueView<T>,
    head: u32,
}

impl<T: Copy> Consumer<T> {
    fn new(view: QueueView<T>) -> Self {
        let head = view.indices().consumer.0.load(Ordering::Acquire);
        Self { view, head }
    }

    /// Takes the next published entry, if any. The slot it frees becomes visible to the
    /// producer at the next [`Consumer::release`].
    pub fn pop(&mut self) -> Result<Option<T>> {
        let tail = self.view.indices().producer.0.load(Ordering::Acquire);
        let published = tail.wrapping_sub(self.head);
        if published == 0 {
            return Ok(None);
        }
        if published > self.view.capacity {
            return Err(RingError::Overrun {
                published,
                capacity: self.view.capacity,
            });
        }
        // SAFETY: the entry is inside the queue and was published (Acquire above).
        let value = unsafe { std::ptr::read_volatile(self.view.entry(self.head)) };
        self.head = self.head.wrapping_add(1);
        Ok(Some(value))
    }

    /// Whether an entry is published that [`Consumer::pop`] would return (one Acquire load: a
    /// poller's check).
    pub fn has_published(&self) -> bool {
        self.view.indices().producer.0.load(Ordering::Acquire) != self.head
    }

    /// Hands the room of every popped entry back to the producer.
    pub fn release(&mut self) {
        self.view
            .indices()
            .consumer
            .0
            .store(self.head, Ordering::Release);
    }

    /// Announces that this consumer is going to sleep on its eventfd. Returns true if it may
    /// sleep; false if entries arrived meanwhile (the flag is cleared again then).
    pub fn prepare_to_sleep(&mut self) -> bool {
        self.release();
        let indices = self.view.indices();
        indices.consumer_sleeping.0.store(1, Ordering::Relaxed);
        fence(Ordering::SeqCst);
        let empty = indices.producer.0.load(Ordering::Acquire) == self.head;
        if !empty {
            indices.consumer_sleeping.0.store(0, Ordering::Relaxed);
        }
        empty
    }

    /// Clears the sleeping flag after a wake-up.
    pub fn woke_up(&mut self) {
        self.view
            .indices()
            .consumer_sleeping
            .0
            .store(0, Ordering::Relaxed);
    }
}

/// Reads and writes request slots. Slot contents are plain copies: the queue protocol orders
/// them (the frontend writes a slot before publishing its number; the iothread reads it after).
pub struct SlotTable {
    base: *mut u8,
    stride: u64,
    count: u32,
    segments_per_slot: u32,
    _mapping: Arc<Mapping>,
}

// SAFETY: the table points into a mapping it keeps alive; slot ownership is passed through the
// queues, so no two threads access one slot at a time.
unsafe impl Send for SlotTable {}

impl SlotTable {
    /// Number of slots.
    pub fn count(&self) -> u32 {
        self.count
    }

    /// Segments each slot holds.
    pub fn segments_per_slot(&self) -> u32 {
        self.segments_per_slot
    }

    fn slot_base(&self, slot: u32) -> Result<*mut u8> {
        if slot >= self.count {
            return Err(RingError::BadSlot(slot));
        }
        // slot < count and the layout reserved count × stride bytes, so this cannot overflow.
        let offset = u64::from(slot).saturating_mul(self.stride);
        // SAFETY: slot < count, and the layout reserved count × stride bytes.
        Ok(unsafe { self.base.add(crate::usize_from(offset)) })
    }

    /// Reads a slot's header.
    pub fn header(&self, slot: u32) -> Result<SlotHeader> {
        let base = self.slot_base(slot)?;
        // SAFETY: the header is at the start of the slot, 8-byte aligned (stride is 64-aligned).
        Ok(unsafe { std::ptr::read_volatile(base.cast::<SlotHeader>()) })
    }

    /// Writes a slot's header.
    pub fn set_header(&self, slot: u32, header: SlotHeader) -> Result<()> {
        if header.segment_count > self.segments_per_slot {
            return Err(RingError::TooManySegments(header.segment_count));
        }
        let base = self.slot_base(slot)?;
        // SAFETY: as in `header`.
        unsafe { std::ptr::write_volatile(base.cast::<SlotHeader>(), header) };
        Ok(())
    }

    fn segment_ptr(&self, slot: u32, index: u32) -> Result<*mut Segment> {
        if index >= self.segments_per_slot {
            return Err(RingError::TooManySegments(index.saturating_add(1)));
        }
        let base = self.slot_base(slot)?;
        // SAFETY: index < segments_per_slot, and the stride holds that many segments after the
        // header.
        Ok(unsafe {
            base.add(size_of::<SlotHeader>())
                .cast::<Segment>()
                .add(index as usize)
        })
    }

    /// Reads segment `index` of `slot`.
    pub fn segment(&self, slot: u32, index: u32) -> Result<Segment> {
        let ptr = self.segment_ptr(slot, index)?;
        // SAFETY: in bounds and aligned (see segment_ptr).
        Ok(unsafe { std::ptr::read_volatile(ptr) })
    }

    /// Writes segment `index` of `slot`.
    pub fn set_segment(&self, slot: u32, index: u32, segment: Segment) -> Result<()> {
        let ptr = self.segment_ptr(slot, index)?;
        // SAFETY: in bounds and aligned (see segment_ptr).
        unsafe { std::ptr::write_volatile(ptr, segment) };
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_is_aligned_and_fits() {
        let layout = RingLayout::new(256, 256).unwrap();
        assert_eq!(layout.sq_entries, 256);
        assert_eq!(layout.sq_offset % 64, 0);
        assert_eq!(layout.cq_offset % 64, 0);
        assert_eq!(layout.slots_offset % 4096, 0);
        assert_eq!(layout.slot_stride % 64, 0);
        assert!(layout.cq_offset >= layout.sq_offset + 192 + 4 * 256);
        assert!(layout.slots_offset >= layout.cq_offset + 192 + 16 * 256);
        assert!(layout.total_size >= layout.slots_offset + 256 * layout.slot_stride);
        assert_eq!(RingLayout::new(3, 1).unwrap().sq_entries, 4);
    }

    #[test]
    fn geometry_limits() {
        assert!(RingLayout::new(0, 1).is_err());
        assert!(RingLayout::new(1, 0).is_err());
        assert!(RingLayout::new(MAX_SLOTS + 1, 1).is_err());
        assert!(RingLayout::new(1, MAX_SEGMENTS_PER_SLOT + 1).is_err());
    }

    #[test]
    fn struct_sizes_are_the_documented_ones() {
        assert_eq!(size_of::<Segment>(), 16);
        assert_eq!(size_of::<SlotHeader>(), 48);
        assert_eq!(size_of::<Completion>(), 16);
        assert_eq!(size_of::<QueueIndices>(), 192);
        assert!(size_of::<RingHeader>() as u64 <= HEADER_SIZE);
    }

    #[test]
    fn submit_and_complete_round_trip_across_two_mappings() {
        let frontend = SharedRing::create(8, 4).unwrap();
        let iothread = SharedRing::open(frontend.file().try_clone().unwrap()).unwrap();
        let mut sq = frontend.submission_producer();
        let mut sq_rx = iothread.submission_consumer();
        let slots = frontend.slots();
        let header = SlotHeader {
            opcode: Opcode::Write as u32,
            flags: SLOT_FLAG_SYNC,
            image_offset: 4096,
            segment_count: 2,
            ..Default::default()
        };
        slots.set_header(5, header).unwrap();
        let seg = Segment {
            offset: 77,
            len: 512,
            aux: 1,
        };
        slots.set_segment(5, 1, seg).unwrap();
        sq.push(5).unwrap();
        assert_eq!(sq_rx.pop().unwrap(), None, "not visible before publish");
        assert!(!sq.publish());
        assert_eq!(sq_rx.pop().unwrap(), Some(5));
        assert_eq!(iothread.slots().header(5).unwrap(), header);
        assert_eq!(iothread.slots().segment(5, 1).unwrap(), seg);
        sq_rx.release();

        let mut cq = iothread.completion_producer();
        let mut cq_rx = frontend.completion_consumer();
        assert!(cq_rx.prepare_to_sleep());
        cq.push(Completion {
            slot: 5,
            status: 0,
            completed_ns: 9,
        })
        .unwrap();
        assert!(cq.publish(), "a sleeping consumer must be woken");
        cq_rx.woke_up();
        assert_eq!(
            cq_rx.pop().unwrap(),
            Some(Completion {
                slot: 5,
                status: 0,
                completed_ns: 9
            })
        );
        assert!(cq_rx.prepare_to_sleep());
    }

    #[test]
    fn prepare_to_sleep_refuses_when_entries_are_pending() {
        let ring = SharedRing::create(4, 1).unwrap();
        let mut tx = ring.submission_producer();
        let mut rx = ring.submission_consumer();
        tx.push(1).unwrap();
        tx.publish();
        assert!(!rx.prepare_to_sleep());
        assert!(!tx.publish(), "flag was cleared again");
    }

    #[test]
    fn full_queue_is_reported() {
        let ring = SharedRing::create(2, 1).unwrap();
        let mut tx = ring.submission_producer();
        tx.push(0).unwrap();
        tx.push(1).unwrap();
        assert!(matches!(tx.push(0), Err(RingError::Full)));
        let mut rx = ring.submission_consumer();
        tx.publish();
        assert_eq!(rx.pop().unwrap(), Some(0));
        rx.release();
        tx.push(0).unwrap();
    }

    #[test]
    fn hostile_producer_index_is_an_error_not_a_panic() {
        let ring = SharedRing::create(4, 1).unwrap();
        // SAFETY: test pokes the index directly, as a hostile peer would.
        let indices = unsafe { &*ring.mapping.at::<QueueIndices>(ring.layout.sq_offset) };
        indices.producer.0.store(1000, Ordering::SeqCst);
        let mut rx = ring.submission_consumer();
        assert!(matches!(rx.pop(), Err(RingError::Overrun { .. })));
    }

    #[test]
    fn bad_slots_and_segments_are_errors() {
        let ring = SharedRing::create(4, 2).unwrap();
        let slots = ring.slots();
        assert!(matches!(slots.header(4), Err(RingError::BadSlot(4))));
        assert!(slots.segment(0, 2).is_err());
        let header = SlotHeader {
            segment_count: 3,
            ..Default::default()
        };
        assert!(slots.set_header(0, header).is_err());
    }

    #[test]
    fn open_rejects_bad_files() {
        let ring = SharedRing::create(4, 2).unwrap();
        let mut header = RingLayout::new(4, 2).unwrap().header();
        header.slots_offset += 64;
        assert!(RingLayout::from_header(&header, ring.layout.total_size).is_err());
        let good = RingLayout::new(4, 2).unwrap().header();
        assert!(RingLayout::from_header(&good, 100).is_err());
        let mut bad_magic = good;
        bad_magic.magic = *b"NOTARING";
        assert!(matches!(
            RingLayout::from_header(&bad_magic, u64::MAX),
            Err(RingError::BadMagic)
        ));
        let mut bad_version = good;
        bad_version.version = 9;
        assert!(matches!(
            RingLayout::from_header(&bad_version, u64::MAX),
            Err(RingError::BadVersion(9))
        ));
    }
}
