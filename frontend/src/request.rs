//! virtio-blk request parsing: a descriptor chain from hostile guest memory becomes a typed
//! [`Request`] whose data is already split into ring [`Segment`]s, or a [`Rejected`] that says
//! which rule it broke and where (if anywhere) its status byte can be written.
//!
//! The chain is walked once into a caller-owned scratch vector (no allocation once it has
//! grown to the queue size), so a guest changing descriptors behind our back cannot make two
//! reads of the same descriptor disagree. Every address, length and sector is checked with
//! checked arithmetic; nothing here can panic on guest data.

use std::mem::size_of;

use blkplane_proto::ring::{
    Opcode, Segment, SlotHeader, SlotTable, RANGE_FLAG_UNMAP, SLOT_FLAG_SYNC,
};
use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK, VIRTIO_BLK_S_UNSUPP, VIRTIO_BLK_T_DISCARD,
    VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT,
    VIRTIO_BLK_T_WRITE_ZEROES, VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP,
};
use virtio_queue::desc::split::Descriptor;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use crate::config::{
    DiskConfig, MAX_DISCARD_SECTORS, MAX_DISCARD_SEGMENTS, SECTOR_SHIFT, SERIAL_LEN,
};
use crate::memory::{MemoryTable, PieceError};
use crate::rejection::RejectReason;

/// Size of `struct virtio_blk_outhdr`: type, ioprio, sector.
const HEADER_LEN: u32 = 16;
/// Size of `struct virtio_blk_discard_write_zeroes`.
const RANGE_LEN: u32 = 16;
const DESC_SIZE: u64 = size_of::<Descriptor>() as u64;
/// Most descriptors an indirect table may hold. Linux sizes its tables by seg_max (+2), not by
/// the ring size the VMM chose, so the ring size is no bound here; QEMU's virtio core allows
/// the same 1024 (VIRTQUEUE_MAX_SIZE).
pub const MAX_INDIRECT_DESCRIPTORS: u16 = 1024;

/// A chain that cannot be walked. No status byte can be trusted, so such a chain is returned
/// with used length 0 (or, for a bad head, dropped).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ChainError {
    /// The avail ring named a head outside the descriptor table.
    #[error("head index {0} is outside the descriptor table")]
    HeadOutOfRange(u16),
    /// A `next` field points outside the descriptor table (or indirect table).
    #[error("next index {0} is outside its table")]
    NextOutOfRange(u16),
    /// A descriptor could not be read from guest memory.
    #[error("descriptor table entry at {0:#x} is outside guest memory")]
    TableOutsideMemory(u64),
    /// More descriptors than the queue has: a loop, or a chain longer than allowed.
    #[error("descriptor chain longer than the queue size {0}")]
    TooLong(u16),
    /// An indirect table with more than [`MAX_INDIRECT_DESCRIPTORS`] entries, or a loop in
    /// one.
    #[error("indirect descriptor table of more than {MAX_INDIRECT_DESCRIPTORS} entries, or a loop in it")]
    IndirectTooLong,
    /// An indirect descriptor inside an indirect table.
    #[error("indirect descriptor inside an indirect table")]
    NestedIndirect,
    /// An indirect descriptor that also has NEXT set.
    #[error("indirect descriptor with the NEXT flag")]
    IndirectWithNext,
    /// An indirect table whose length is 0 or not a multiple of 16.
    #[error("indirect table length {0} is zero or not a multiple of 16")]
    IndirectTableLength(u32),
}

/// A request that breaks a rule. The variant says which.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    /// See [`ChainError`].
    #[error(transparent)]
    Chain(#[from] ChainError),
    /// No descriptor at all is device-writable, and the chain is a single descriptor.
    #[error("no status descriptor")]
    StatusMissing,
    /// The last descriptor, where the status goes, is not device-writable.
    #[error("status descriptor is read-only")]
    StatusReadOnly,
    /// The last descriptor has length 0.
    #[error("status descriptor has length 0")]
    StatusEmpty,
    /// A descriptor's address plus length overflows.
    #[error("descriptor at {0:#x} wraps around the address space")]
    AddressOverflow(u64),
    /// A descriptor lies (partly) outside guest memory.
    #[error("descriptor at {0:#x} is outside guest memory")]
    OutsideMemory(u64),
    /// A device-readable descriptor after a device-writable one.
    #[error("device-readable descriptor after a device-writable one")]
    ReadableAfterWritable,
    /// Fewer than 16 device-readable bytes for the header.
    #[error("request header of {0} bytes is shorter than 16")]
    HeaderTooShort(u32),
    /// Data in the wrong direction: readable data for a read, writable data for a write.
    #[error("data buffer in the wrong direction for request type {0}")]
    WrongDirection(u32),
    /// A request type this device does not implement.
    #[error("unsupported request type {0}")]
    UnsupportedType(u32),
    /// The data length is not a multiple of the logical block size.
    #[error("length {0} is not a multiple of the block size")]
    Misaligned(u64),
    /// The sector is not aligned to the logical block size.
    #[error("sector {0} is not aligned to the block size")]
    MisalignedSector(u64),
    /// Sector × 512 or sector + length overflows.
    #[error("sector {0} overflows")]
    SectorOverflow(u64),
    /// The request reaches past the end of the disk.
    #[error("sectors {sector}+{sectors} are beyond the capacity {capacity}")]
    BeyondCapacity {
        /// First sector.
        sector: u64,
        /// Number of sectors.
        sectors: u64,
        /// Disk capacity in sectors.
        capacity: u64,
    },
    /// A write, discard or write-zeroes on a read-only disk.
    #[error("write to a read-only disk")]
    ReadOnly,
    /// GET_ID with fewer than 20 writable bytes before the status.
    #[error("GET_ID buffer of {0} bytes is smaller than 20")]
    GetIdTooSmall(u32),
    /// A discard/write-zeroes payload that is empty or not a multiple of 16 bytes.
    #[error("discard/write-zeroes payload of {0} bytes is not a non-empty multiple of 16")]
    RangeListLength(u32),
    /// More ranges than max_discard_seg / max_write_zeroes_seg.
    #[error("{0} ranges exceed the advertised maximum")]
    TooManyRanges(u32),
    /// A range of zero sectors.
    #[error("range of zero sectors")]
    EmptyRange,
    /// A range larger than max_discard_sectors / max_write_zeroes_sectors.
    #[error("range of {0} sectors exceeds the advertised maximum")]
    RangeTooLarge(u32),
    /// Flags the device does not support (any flag on discard, any but UNMAP on write-zeroes).
    #[error("unsupported range flags {0:#x}")]
    UnsupportedFlags(u32),
    /// The data needs more segments than a ring slot holds.
    #[error("request needs more than {0} segments")]
    TooManySegments(u32),
}

/// The status byte of a request that succeeded (`VIRTIO_BLK_S_OK`).
pub const STATUS_OK: u8 = status_byte(VIRTIO_BLK_S_OK);
/// The status byte of a request that failed (`VIRTIO_BLK_S_IOERR`).
pub const STATUS_IOERR: u8 = status_byte(VIRTIO_BLK_S_IOERR);
/// The status byte of a request the device does not support (`VIRTIO_BLK_S_UNSUPP`).
pub const STATUS_UNSUPP: u8 = status_byte(VIRTIO_BLK_S_UNSUPP);

/// virtio-bindings' status value as the byte the device writes.
#[allow(
    clippy::cast_possible_truncation,
    reason = "the assertion checks the value fits, at compile time"
)]
const fn status_byte(status: u32) -> u8 {
    assert!(status <= u8::MAX as u32);
    status as u8
}

/// `value` as a u32 for an error message, saturated: a hostile length may exceed it.
fn saturate_u32(value: u64) -> u32 {
    u32::try_from(value).unwrap_or(u32::MAX)
}

impl ChainError {
    /// The rule the chain broke.
    pub const fn reason(&self) -> RejectReason {
        match self {
            Self::HeadOutOfRange(_) => RejectReason::HeadOutOfRange,
            Self::NextOutOfRange(_) => RejectReason::NextOutOfRange,
            Self::TableOutsideMemory(_) => RejectReason::TableOutsideMemory,
            Self::TooLong(_) => RejectReason::ChainTooLong,
            Self::IndirectTooLong => RejectReason::IndirectTooLong,
            Self::NestedIndirect => RejectReason::NestedIndirect,
            Self::IndirectWithNext => RejectReason::IndirectWithNext,
            Self::IndirectTableLength(_) => RejectReason::IndirectTableLength,
        }
    }
}

impl RequestError {
    /// The rule the request broke.
    pub const fn reason(&self) -> RejectReason {
        match self {
            Self::Chain(e) => e.reason(),
            Self::StatusMissing => RejectReason::StatusMissing,
            Self::StatusReadOnly => RejectReason::StatusReadOnly,
            Self::StatusEmpty => RejectReason::StatusEmpty,
            Self::AddressOverflow(_) => RejectReason::AddressOverflow,
            Self::OutsideMemory(_) => RejectReason::OutsideMemory,
            Self::ReadableAfterWritable => RejectReason::ReadableAfterWritable,
            Self::HeaderTooShort(_) => RejectReason::HeaderTooShort,
            Self::WrongDirection(_) => RejectReason::WrongDirection,
            Self::UnsupportedType(_) => RejectReason::UnsupportedType,
            Self::Misaligned(_) => RejectReason::MisalignedLength,
            Self::MisalignedSector(_) => RejectReason::MisalignedSector,
            Self::SectorOverflow(_) => RejectReason::SectorOverflow,
            Self::BeyondCapacity { .. } => RejectReason::BeyondCapacity,
            Self::ReadOnly => RejectReason::ReadOnly,
            Self::GetIdTooSmall(_) => RejectReason::GetIdTooSmall,
            Self::RangeListLength(_) => RejectReason::RangeListLength,
            Self::TooManyRanges(_) => RejectReason::TooManyRanges,
            Self::EmptyRange => RejectReason::EmptyRange,
            Self::RangeTooLarge(_) => RejectReason::RangeTooLarge,
            Self::UnsupportedFlags(_) => RejectReason::UnsupportedFlags,
            Self::TooManySegments(_) => RejectReason::TooManySegments,
        }
    }

    /// The status to report, when the status byte is usable.
    pub fn status(&self) -> u8 {
        match self {
            Self::UnsupportedType(_) | Self::UnsupportedFlags(_) => STATUS_UNSUPP,
            _ => STATUS_IOERR,
        }
    }
}

/// A rejected request: the rule it broke and, when it could be located, its status byte.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejected {
    /// The rule.
    pub error: RequestError,
    /// Where to write the status; `None` returns the chain with used length 0.
    pub status: Option<GuestAddress>,
}

/// What a valid request asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestKind {
    /// Read `data_len` bytes at image byte `offset` into the segments.
    Read {
        /// Image byte offset.
        offset: u64,
    },
    /// Write the segments at image byte `offset`.
    Write {
        /// Image byte offset.
        offset: u64,
    },
    /// Make completed writes durable.
    Flush,
    /// Write the serial into the writable data; answered by the frontend.
    GetId,
    /// Deallocate the ranges in the segments.
    Discard,
    /// Zero the ranges in the segments.
    WriteZeroes,
}

/// A validated request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    /// What to do.
    pub kind: RequestKind,
    /// Where the status byte goes.
    pub status: GuestAddress,
    /// Bytes of data (reads and writes), for the used length.
    pub data_len: u32,
    /// Bytes the request covers on the image: the data, or the sum of the ranges.
    pub bytes: u64,
    /// Segments written to the sink.
    pub segments: u32,
}

impl Request {
    /// The used-ring length: the bytes the device wrote into the chain.
    pub fn used_len(&self) -> u32 {
        match self.kind {
            RequestKind::Read { .. } => self.data_len.saturating_add(1),
            RequestKind::GetId => saturate_u32(SERIAL_LEN as u64).saturating_add(1),
            _ => 1,
        }
    }

    /// What the iothread runs for this request: its opcode and slot header (SYNC on
    /// modifying requests unless the disk caches writes). `None` for what is answered without
    /// it: GET_ID and reads or writes of no data.
    pub fn slot_header(&self, writeback: bool) -> Option<(Opcode, SlotHeader)> {
        let (opcode, image_offset) = match self.kind {
            RequestKind::GetId => return None,
            RequestKind::Read { .. } | RequestKind::Write { .. } if self.data_len == 0 => {
                return None
            }
            RequestKind::Read { offset } => (Opcode::Read, offset),
            RequestKind::Write { offset } => (Opcode::Write, offset),
            RequestKind::Flush => (Opcode::Flush, 0),
            RequestKind::Discard => (Opcode::Discard, 0),
            RequestKind::WriteZeroes => (Opcode::WriteZeroes, 0),
        };
        let modifies = matches!(
            opcode,
            Opcode::Write | Opcode::Discard | Opcode::WriteZeroes
        );
        let header = SlotHeader {
            opcode: opcode as u32,
            flags: if modifies && !writeback {
                SLOT_FLAG_SYNC
            } else {
                0
            },
            image_offset,
            segment_count: self.segments,
            ..SlotHeader::default()
        };
        Some((opcode, header))
    }
}

/// A [`SegmentSink`] has no room for another segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SinkFull;

/// Where parsed segments go: a ring slot in production, a vector in tests.
pub trait SegmentSink {
    /// Appends a segment; `Err` when the sink is full.
    fn push(&mut self, segment: Segment) -> Result<(), SinkFull>;
}

impl SegmentSink for Vec<Segment> {
    fn push(&mut self, segment: Segment) -> Result<(), SinkFull> {
        Vec::push(self, segment);
        Ok(())
    }
}

/// Writes a parsed request's segments straight into its ring slot: the production sink, shared
/// by the worker and the fuzz targets so that both exercise the same path.
pub struct SlotSink<'a> {
    slots: &'a SlotTable,
    slot: u32,
    count: u32,
}

impl<'a> SlotSink<'a> {
    /// A sink writing segments 0, 1, … of `slot`.
    pub fn new(slots: &'a SlotTable, slot: u32) -> Self {
        Self {
            slots,
            slot,
            count: 0,
        }
    }
}

impl SegmentSink for SlotSink<'_> {
    fn push(&mut self, segment: Segment) -> Result<(), SinkFull> {
        self.slots
            .set_segment(self.slot, self.count, segment)
            .map_err(|_| SinkFull)?;
        // set_segment refused any index past the slot's segments.
        self.count = self.count.saturating_add(1);
        Ok(())
    }
}

/// Walks the chain starting at `head` into `out` (cleared first), following one level of
/// indirection. At most `queue_size` descriptors are accepted from the ring's own table, and
/// at most [`MAX_INDIRECT_DESCRIPTORS`] from an indirect one.
pub fn collect_chain(
    memory: &GuestMemoryMmap,
    desc_table: GuestAddress,
    queue_size: u16,
    head: u16,
    out: &mut Vec<Descriptor>,
) -> Result<(), ChainError> {
    out.clear();
    if head >= queue_size {
        return Err(ChainError::HeadOutOfRange(head));
    }
    let read = |table: GuestAddress, index: u16| -> Result<Descriptor, ChainError> {
        let addr = table
            .0
            .checked_add(u64::from(index) * DESC_SIZE)
            .ok_or(ChainError::TableOutsideMemory(table.0))?;
        memory
            .read_obj::<Descriptor>(GuestAddress(addr))
            .map_err(|_| ChainError::TableOutsideMemory(addr))
    };
    let limit = usize::from(queue_size);
    let mut index = head;
    loop {
        let desc = read(desc_table, index)?;
        if desc.refers_to_indirect_table() {
            if desc.has_next() {
                return Err(ChainError::IndirectWithNext);
            }
            let len = desc.len();
            if len == 0 || !u64::from(len).is_multiple_of(DESC_SIZE) {
                return Err(ChainError::IndirectTableLength(len));
            }
            let count = u64::from(len) / DESC_SIZE;
            if count > u64::from(MAX_INDIRECT_DESCRIPTORS) {
                return Err(ChainError::IndirectTooLong);
            }
            // count <= 1024, so it fits u16.
            let count = u16::try_from(count).map_err(|_| ChainError::IndirectTooLong)?;
            let indirect_limit = out.len().saturating_add(usize::from(count));
            let table = desc.addr();
            let mut inner = 0u16;
            loop {
                let d = read(table, inner)?;
                if d.refers_to_indirect_table() {
                    return Err(ChainError::NestedIndirect);
                }
                if out.len() >= indirect_limit {
                    return Err(ChainError::IndirectTooLong);
                }
                out.push(d);
                if !d.has_next() {
                    return Ok(());
                }
                inner = d.next();
                if inner >= count {
                    return Err(ChainError::NextOutOfRange(inner));
                }
            }
        }
        if out.len() >= limit {
            return Err(ChainError::TooLong(queue_size));
        }
        out.push(desc);
        if !desc.has_next() {
            return Ok(());
        }
        index = desc.next();
        if index >= queue_size {
            return Err(ChainError::NextOutOfRange(index));
        }
    }
}

/// Parses the chain in `descs` (from [`collect_chain`]) against `disk`, writing data
/// segments or ranges into `sink`.
pub fn parse(
    descs: &[Descriptor],
    memory: &MemoryTable,
    disk: &DiskConfig,
    sink: &mut impl SegmentSink,
) -> Result<Request, Rejected> {
    let no_status = |error| Rejected {
        error,
        status: None,
    };
    // Device-readable descriptors come first, then device-writable ones.
    let readable_count = descs.iter().take_while(|d| !d.is_write_only()).count();
    let (readable, writable) = descs.split_at(readable_count);

    // The status byte is the last byte of the last descriptor, which must be writable.
    let last = match (readable, writable.last()) {
        (_, Some(last)) => last,
        ([_], None) | ([], None) => return Err(no_status(RequestError::StatusMissing)),
        (_, None) => return Err(no_status(RequestError::StatusReadOnly)),
    };
    if !last.is_write_only() {
        return Err(no_status(RequestError::StatusReadOnly));
    }
    if last.len() == 0 {
        return Err(no_status(RequestError::StatusEmpty));
    }
    let status_addr = last
        .addr()
        .0
        .checked_add(u64::from(last.len().saturating_sub(1)))
        .ok_or(no_status(RequestError::AddressOverflow(last.addr().0)))?;
    if memory
        .for_each_piece::<()>(status_addr, 1, |_, _, _| Ok(()))
        .is_err()
    {
        return Err(no_status(RequestError::OutsideMemory(status_addr)));
    }
    let status = GuestAddress(status_addr);
    let reject = |error| Rejected {
        error,
        status: Some(status),
    };

    if writable.iter().any(|d| !d.is_write_only()) {
        return Err(reject(RequestError::ReadableAfterWritable));
    }
    let mut readable_len = 0u64;
    let mut writable_len = 0u64;
    for d in descs {
        check_in_memory(memory, d).map_err(reject)?;
        // At most queue_size + 1024 descriptors of under 4 GiB: far below u64::MAX.
        if d.is_write_only() {
            writable_len = writable_len.saturating_add(u64::from(d.len()));
        } else {
            readable_len = readable_len.saturating_add(u64::from(d.len()));
        }
    }
    // The status byte is not data (the status descriptor is writable and not empty).
    let writable_data = writable_len.saturating_sub(1);

    let mut header = [0u8; HEADER_LEN as usize];
    if readable_len < u64::from(HEADER_LEN) {
        return Err(reject(RequestError::HeaderTooShort(saturate_u32(
            readable_len,
        ))));
    }
    read_stream(memory.guest_memory(), readable, 0, &mut header)
        .map_err(|addr| reject(RequestError::OutsideMemory(addr)))?;
    let [t0, t1, t2, t3, _, _, _, _, s @ ..] = header;
    let request_type = u32::from_le_bytes([t0, t1, t2, t3]);
    let sector = u64::from_le_bytes(s);
    let readable_payload = readable_len.saturating_sub(u64::from(HEADER_LEN));

    let request = |kind, data_len: u32, bytes, segments| Request {
        kind,
        status,
        data_len,
        bytes,
        segments,
    };
    match request_type {
        VIRTIO_BLK_T_IN | VIRTIO_BLK_T_OUT => {
            let is_read = request_type == VIRTIO_BLK_T_IN;
            let (stream, skip, data_len) = if is_read {
                if readable_payload != 0 {
                    return Err(reject(RequestError::WrongDirection(request_type)));
                }
                (writable, 0, writable_data)
            } else {
                if writable_data != 0 {
                    return Err(reject(RequestError::WrongDirection(request_type)));
                }
                if disk.read_only {
                    return Err(reject(RequestError::ReadOnly));
                }
                (readable, u64::from(HEADER_LEN), readable_payload)
            };
            let offset = check_range(disk, sector, data_len).map_err(reject)?;
            // A chain never exceeds 4 GiB (checked per descriptor sum below u32 range).
            let data_len =
                u32::try_from(data_len).map_err(|_| reject(RequestError::Misaligned(data_len)))?;
            let segments =
                emit_stream(memory, stream, skip, data_len, disk, sink).map_err(reject)?;
            let kind = if is_read {
                RequestKind::Read { offset }
            } else {
                RequestKind::Write { offset }
            };
            Ok(request(kind, data_len, u64::from(data_len), segments))
        }
        VIRTIO_BLK_T_FLUSH => Ok(request(RequestKind::Flush, 0, 0, 0)),
        VIRTIO_BLK_T_GET_ID => {
            if writable_data < SERIAL_LEN as u64 {
                return Err(reject(RequestError::GetIdTooSmall(saturate_u32(
                    writable_data,
                ))));
            }
            Ok(request(RequestKind::GetId, 0, 0, 0))
        }
        VIRTIO_BLK_T_DISCARD | VIRTIO_BLK_T_WRITE_ZEROES => {
            if writable_data != 0 {
                return Err(reject(RequestError::WrongDirection(request_type)));
            }
            if disk.read_only {
                return Err(reject(RequestError::ReadOnly));
            }
            let is_discard = request_type == VIRTIO_BLK_T_DISCARD;
            let (segments, bytes) =
                parse_ranges(memory, readable, readable_payload, is_discard, disk, sink)
                    .map_err(reject)?;
            let kind = if is_discard {
                RequestKind::Discard
            } else {
                RequestKind::WriteZeroes
            };
            Ok(request(kind, 0, bytes, segments))
        }
        other => Err(reject(RequestError::UnsupportedType(other))),
    }
}

fn check_in_memory(memory: &MemoryTable, d: &Descriptor) -> Result<(), RequestError> {
    match memory.for_each_piece::<()>(d.addr().0, d.len(), |_, _, _| Ok(())) {
        Ok(()) => Ok(()),
        Err(PieceError::Overflow) => Err(RequestError::AddressOverflow(d.addr().0)),
        Err(_) => Err(RequestError::OutsideMemory(d.addr().0)),
    }
}

/// Checks that `len` bytes at `sector` are block-aligned and on the disk; returns the byte
/// offset.
fn check_range(disk: &DiskConfig, sector: u64, len: u64) -> Result<u64, RequestError> {
    let block = u64::from(disk.block_size);
    if !len.is_multiple_of(block) {
        return Err(RequestError::Misaligned(len));
    }
    let offset = sector
        .checked_mul(1 << SECTOR_SHIFT)
        .ok_or(RequestError::SectorOverflow(sector))?;
    if !offset.is_multiple_of(block) {
        return Err(RequestError::MisalignedSector(sector));
    }
    let sectors = len >> SECTOR_SHIFT;
    let end = sector
        .checked_add(sectors)
        .ok_or(RequestError::SectorOverflow(sector))?;
    let capacity = disk.capacity();
    if end > capacity {
        return Err(RequestError::BeyondCapacity {
            sector,
            sectors,
            capacity,
        });
    }
    Ok(offset)
}

/// Copies bytes `[skip, skip + buf.len())` of the byte stream formed by `descs` into `buf`.
/// Returns the failing guest address on a memory error.
fn read_stream(
    memory: &GuestMemoryMmap,
    descs: &[Descriptor],
    skip: u64,
    buf: &mut [u8],
) -> Result<(), u64> {
    let mut skip = skip;
    let mut filled = 0usize;
    for d in descs {
        if filled == buf.len() {
            break;
        }
        let len = u64::from(d.len());
        let Some(rest) = len.checked_sub(skip).filter(|&rest| rest > 0) else {
            skip = skip.saturating_sub(len);
            continue;
        };
        // rest <= u32::MAX; filled <= buf.len() (checked at the top of the loop).
        let room = buf.len().saturating_sub(filled);
        let take = blkplane_proto::usize_from(rest).min(room);
        let addr = d.addr().0.checked_add(skip).ok_or(d.addr().0)?;
        let dst = buf
            .get_mut(filled..)
            .and_then(|b| b.get_mut(..take))
            .ok_or(addr)?;
        memory
            .read_slice(dst, GuestAddress(addr))
            .map_err(|_| addr)?;
        filled = filled.saturating_add(take);
        skip = 0;
    }
    if filled == buf.len() {
        Ok(())
    } else {
        Err(descs.last().map_or(0, |d| d.addr().0))
    }
}

/// Writes `bytes` at the start of the byte stream formed by `descs` (GET_ID's answer).
pub fn write_stream(
    memory: &GuestMemoryMmap,
    descs: &[Descriptor],
    bytes: &[u8],
) -> Result<(), u64> {
    let mut written = 0usize;
    for d in descs.iter().filter(|d| d.is_write_only()) {
        if written == bytes.len() {
            break;
        }
        let room = bytes.len().saturating_sub(written);
        let take = (d.len() as usize).min(room);
        let src = bytes
            .get(written..)
            .and_then(|b| b.get(..take))
            .ok_or(d.addr().0)?;
        memory.write_slice(src, d.addr()).map_err(|_| d.addr().0)?;
        written = written.saturating_add(take);
    }
    if written == bytes.len() {
        Ok(())
    } else {
        Err(0)
    }
}

/// Emits bytes `[skip, skip + len)` of the stream as ring segments. Returns how many.
fn emit_stream(
    memory: &MemoryTable,
    descs: &[Descriptor],
    skip: u64,
    len: u32,
    disk: &DiskConfig,
    sink: &mut impl SegmentSink,
) -> Result<u32, RequestError> {
    let limit = disk.segments_per_slot();
    let mut count = 0u32;
    let mut skip = skip;
    let mut left = len;
    for d in descs {
        if left == 0 {
            break;
        }
        let dlen = u64::from(d.len());
        let Some(rest) = dlen.checked_sub(skip).filter(|&rest| rest > 0) else {
            skip = skip.saturating_sub(dlen);
            continue;
        };
        // skip < dlen <= u32::MAX here, so rest fits a u32.
        let start = d
            .addr()
            .0
            .checked_add(skip)
            .ok_or(RequestError::AddressOverflow(d.addr().0))?;
        let take = saturate_u32(rest).min(left);
        memory
            .for_each_piece(start, take, |region, offset, piece| {
                if count >= limit {
                    return Err(SinkFull);
                }
                count = count.saturating_add(1);
                sink.push(Segment {
                    offset,
                    len: piece,
                    aux: region,
                })
            })
            .map_err(|e| match e {
                PieceError::Sink(SinkFull) => RequestError::TooManySegments(limit),
                PieceError::Overflow => RequestError::AddressOverflow(start),
                PieceError::OutsideMemory => RequestError::OutsideMemory(start),
            })?;
        // take <= left.
        left = left.saturating_sub(take);
        skip = 0;
    }
    Ok(count)
}

fn parse_ranges(
    memory: &MemoryTable,
    readable: &[Descriptor],
    payload: u64,
    is_discard: bool,
    disk: &DiskConfig,
    sink: &mut impl SegmentSink,
) -> Result<(u32, u64), RequestError> {
    if payload == 0 || !payload.is_multiple_of(u64::from(RANGE_LEN)) {
        return Err(RequestError::RangeListLength(saturate_u32(payload)));
    }
    let count = payload.checked_div(u64::from(RANGE_LEN)).unwrap_or(0);
    if count > u64::from(MAX_DISCARD_SEGMENTS) {
        return Err(RequestError::TooManyRanges(saturate_u32(count)));
    }
    // count <= MAX_DISCARD_SEGMENTS, a u32.
    let count = saturate_u32(count);
    let mut bytes = 0u64;
    for i in 0..count {
        let mut raw = [0u8; RANGE_LEN as usize];
        // i < count <= MAX_DISCARD_SEGMENTS: a few hundred bytes past the header.
        let skip = u64::from(i)
            .saturating_mul(u64::from(RANGE_LEN))
            .saturating_add(u64::from(HEADER_LEN));
        read_stream(memory.guest_memory(), readable, skip, &mut raw)
            .map_err(RequestError::OutsideMemory)?;
        let [s0, s1, s2, s3, s4, s5, s6, s7, n0, n1, n2, n3, f0, f1, f2, f3] = raw;
        let sector = u64::from_le_bytes([s0, s1, s2, s3, s4, s5, s6, s7]);
        let sectors = u32::from_le_bytes([n0, n1, n2, n3]);
        let flags = u32::from_le_bytes([f0, f1, f2, f3]);
        let allowed = if is_discard {
            0
        } else {
            VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP
        };
        if flags & !allowed != 0 {
            return Err(RequestError::UnsupportedFlags(flags));
        }
        if sectors == 0 {
            return Err(RequestError::EmptyRange);
        }
        if sectors > MAX_DISCARD_SECTORS {
            return Err(RequestError::RangeTooLarge(sectors));
        }
        let len = u64::from(sectors) << SECTOR_SHIFT;
        let offset = check_range(disk, sector, len)?;
        let unmap = if flags & VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP != 0 {
            RANGE_FLAG_UNMAP
        } else {
            0
        };
        sink.push(Segment {
            offset,
            // sectors <= MAX_DISCARD_SECTORS (2^22), so len <= 2^31.
            len: saturate_u32(len),
            aux: unmap,
        })
        .map_err(|SinkFull| RequestError::TooManySegments(count))?;
        bytes = bytes.saturating_add(len);
    }
    Ok((count, bytes))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::CacheMode;
    use crate::memory::tests::two_regions;
    use virtio_bindings::virtio_ring::{
        VRING_DESC_F_INDIRECT, VRING_DESC_F_NEXT, VRING_DESC_F_WRITE,
    };

    const TABLE: u64 = 0x1000;
    const QSIZE: u16 = 16;
    const NEXT: u16 = VRING_DESC_F_NEXT as u16;
    const WRITE: u16 = VRING_DESC_F_WRITE as u16;
    const INDIRECT: u16 = VRING_DESC_F_INDIRECT as u16;

    struct Fixture {
        memory: MemoryTable,
        disk: DiskConfig,
    }

    impl Fixture {
        fn new(read_only: bool) -> Self {
            Self {
                memory: two_regions(),
                // 1 MiB disk = 2048 sectors.
                disk: DiskConfig::new(
                    1 << 20,
                    read_only,
                    "serial",
                    1,
                    QSIZE,
                    512,
                    CacheMode::Direct,
                ),
            }
        }

        fn mem(&self) -> &GuestMemoryMmap {
            self.memory.guest_memory()
        }

        fn set_desc(&self, table: u64, index: u16, d: Descriptor) {
            self.mem()
                .write_obj(d, GuestAddress(table + u64::from(index) * 16))
                .unwrap();
        }

        fn header(&self, addr: u64, request_type: u32, sector: u64) {
            let mut h = [0u8; 16];
            h[..4].copy_from_slice(&request_type.to_le_bytes());
            h[8..].copy_from_slice(&sector.to_le_bytes());
            self.mem().write_slice(&h, GuestAddress(addr)).unwrap();
        }

        /// Writes a direct chain of (addr, len, flags) at descriptors 0.. and parses it.
        fn chain(&self, descs: &[(u64, u32, u16)]) -> Result<(Request, Vec<Segment>), Rejected> {
            for (i, &(addr, len, flags)) in descs.iter().enumerate() {
                let last = i + 1 == descs.len();
                let flags = if last { flags } else { flags | NEXT };
                self.set_desc(
                    TABLE,
                    i as u16,
                    Descriptor::new(addr, len, flags, i as u16 + 1),
                );
            }
            self.parse_head(0)
        }

        fn parse_head(&self, head: u16) -> Result<(Request, Vec<Segment>), Rejected> {
            let mut scratch = Vec::new();
            collect_chain(self.mem(), GuestAddress(TABLE), QSIZE, head, &mut scratch).map_err(
                |e| Rejected {
                    error: e.into(),
                    status: None,
                },
            )?;
            let mut segs = Vec::new();
            parse(&scratch, &self.memory, &self.disk, &mut segs).map(|r| (r, segs))
        }
    }

    fn error(r: Result<(Request, Vec<Segment>), Rejected>) -> RequestError {
        r.unwrap_err().error
    }

    #[test]
    fn read_request_becomes_segments() {
        let f = Fixture::new(false);
        f.header(0x2000, VIRTIO_BLK_T_IN, 8);
        let (req, segs) = f
            .chain(&[(0x2000, 16, 0), (0x3000, 4096, WRITE), (0x5000, 1, WRITE)])
            .unwrap();
        assert_eq!(req.kind, RequestKind::Read { offset: 4096 });
        assert_eq!(req.data_len, 4096);
        assert_eq!(req.used_len(), 4097);
        assert_eq!(req.status, GuestAddress(0x5000));
        assert_eq!(
            segs,
            vec![Segment {
                offset: 0x3000,
                len: 4096,
                aux: 0
            }]
        );
    }

    #[test]
    fn write_with_split_header_and_cross_region_buffer() {
        let f = Fixture::new(false);
        f.header(0x2000, VIRTIO_BLK_T_OUT, 0);
        // Header split over two descriptors; data straddles the region boundary at 64K; data
        // shares its descriptor with the end of the header (any-layout).
        let (req, segs) = f
            .chain(&[
                (0x2000, 8, 0),
                (0x2008, 8, 0),
                ((1 << 16) - 512, 1024, 0),
                (0x5000, 1, WRITE),
            ])
            .unwrap();
        assert_eq!(req.kind, RequestKind::Write { offset: 0 });
        assert_eq!(
            segs,
            vec![
                Segment {
                    offset: (1 << 16) - 512,
                    len: 512,
                    aux: 0
                },
                Segment {
                    offset: 0,
                    len: 512,
                    aux: 1
                },
            ]
        );
    }

    #[test]
    fn indirect_table_is_followed() {
        let f = Fixture::new(false);
        f.header(0x2000, VIRTIO_BLK_T_IN, 0);
        let ind = 0x8000;
        f.set_desc(ind, 0, Descriptor::new(0x2000, 16, NEXT, 1));
        f.set_desc(ind, 1, Descriptor::new(0x3000, 512, WRITE | NEXT, 2));
        f.set_desc(ind, 2, Descriptor::new(0x5000, 1, WRITE, 0));
        f.set_desc(TABLE, 3, Descriptor::new(ind, 48, INDIRECT, 0));
        let (req, segs) = f.parse_head(3).unwrap();
        assert_eq!(req.data_len, 512);
        assert_eq!(segs.len(), 1);
    }

    #[test]
    fn chain_rules() {
        let f = Fixture::new(false);
        // Loop: 0 -> 0.
        f.set_desc(TABLE, 0, Descriptor::new(0x2000, 16, NEXT, 0));
        assert_eq!(error(f.parse_head(0)), ChainError::TooLong(QSIZE).into());
        // Next outside the table.
        f.set_desc(TABLE, 0, Descriptor::new(0x2000, 16, NEXT, 99));
        assert_eq!(
            error(f.parse_head(0)),
            ChainError::NextOutOfRange(99).into()
        );
        // Head outside the table.
        assert_eq!(
            error(f.parse_head(QSIZE)),
            ChainError::HeadOutOfRange(QSIZE).into()
        );
        // Indirect inside indirect.
        let ind = 0x8000;
        f.set_desc(ind, 0, Descriptor::new(0x9000, 16, INDIRECT, 0));
        f.set_desc(TABLE, 1, Descriptor::new(ind, 16, INDIRECT, 0));
        assert_eq!(error(f.parse_head(1)), ChainError::NestedIndirect.into());
        // Indirect table lengths.
        f.set_desc(TABLE, 1, Descriptor::new(ind, 0, INDIRECT, 0));
        assert_eq!(
            error(f.parse_head(1)),
            ChainError::IndirectTableLength(0).into()
        );
        f.set_desc(TABLE, 1, Descriptor::new(ind, 17, INDIRECT, 0));
        assert_eq!(
            error(f.parse_head(1)),
            ChainError::IndirectTableLength(17).into()
        );
        // An indirect table may be longer than the ring (Linux sizes it by seg_max)...
        f.header(0x2000, VIRTIO_BLK_T_IN, 0);
        for i in 0..19u16 {
            f.set_desc(
                ind,
                i,
                Descriptor::new(0x3000 + u64::from(i) * 512, 512, WRITE | NEXT, i + 1),
            );
        }
        f.set_desc(ind, 0, Descriptor::new(0x2000, 16, NEXT, 1));
        f.set_desc(ind, 19, Descriptor::new(0x5000, 1, WRITE, 0));
        f.set_desc(TABLE, 1, Descriptor::new(ind, 16 * 20, INDIRECT, 0));
        let (req, _) = f.parse_head(1).unwrap();
        assert_eq!(req.data_len, 18 * 512);
        // ...but not longer than 1024 entries, and a loop inside it is caught.
        let too_long = 16 * (u32::from(MAX_INDIRECT_DESCRIPTORS) + 1);
        f.set_desc(TABLE, 1, Descriptor::new(ind, too_long, INDIRECT, 0));
        assert_eq!(error(f.parse_head(1)), ChainError::IndirectTooLong.into());
        f.set_desc(ind, 0, Descriptor::new(0x2000, 16, NEXT, 0));
        f.set_desc(TABLE, 1, Descriptor::new(ind, 16 * 4, INDIRECT, 0));
        assert_eq!(error(f.parse_head(1)), ChainError::IndirectTooLong.into());
        // Indirect with NEXT.
        f.set_desc(TABLE, 1, Descriptor::new(ind, 16, INDIRECT | NEXT, 2));
        assert_eq!(error(f.parse_head(1)), ChainError::IndirectWithNext.into());
        // Indirect table outside memory.
        f.set_desc(TABLE, 1, Descriptor::new(1 << 40, 16, INDIRECT, 0));
        assert!(matches!(
            error(f.parse_head(1)),
            RequestError::Chain(ChainError::TableOutsideMemory(_))
        ));
    }

    #[test]
    fn descriptor_address_rules() {
        let f = Fixture::new(false);
        f.header(0x2000, VIRTIO_BLK_T_IN, 0);
        let outside = f.chain(&[(0x2000, 16, 0), (1 << 40, 512, WRITE), (0x5000, 1, WRITE)]);
        assert_eq!(
            outside.clone().unwrap_err().status,
            Some(GuestAddress(0x5000))
        );
        assert_eq!(error(outside), RequestError::OutsideMemory(1 << 40));
        let straddles_end = f.chain(&[
            (0x2000, 16, 0),
            ((1 << 17) - 256, 512, WRITE),
            (0x5000, 1, WRITE),
        ]);
        assert!(matches!(
            error(straddles_end),
            RequestError::OutsideMemory(_)
        ));
        let wraps = f.chain(&[
            (0x2000, 16, 0),
            (u64::MAX - 100, 512, WRITE),
            (0x5000, 1, WRITE),
        ]);
        assert_eq!(error(wraps), RequestError::AddressOverflow(u64::MAX - 100));
    }

    #[test]
    fn status_rules() {
        let f = Fixture::new(false);
        f.header(0x2000, VIRTIO_BLK_T_IN, 0);
        assert_eq!(
            error(f.chain(&[(0x2000, 16, 0)])),
            RequestError::StatusMissing
        );
        let ro = f.chain(&[(0x2000, 16, 0), (0x5000, 1, 0)]);
        assert_eq!(ro.clone().unwrap_err().status, None);
        assert_eq!(error(ro), RequestError::StatusReadOnly);
        assert_eq!(
            error(f.chain(&[(0x2000, 16, 0), (0x5000, 0, WRITE)])),
            RequestError::StatusEmpty
        );
        // A readable last descriptor after writable data: nothing may be written into it.
        let ro_after_data = f.chain(&[(0x2000, 16, 0), (0x3000, 512, WRITE), (0x5000, 1, 0)]);
        assert_eq!(ro_after_data.clone().unwrap_err().status, None);
        assert_eq!(error(ro_after_data), RequestError::StatusReadOnly);
        let outside = f.chain(&[(0x2000, 16, 0), (1 << 40, 1, WRITE)]);
        assert_eq!(outside.clone().unwrap_err().status, None);
        assert!(matches!(error(outside), RequestError::OutsideMemory(_)));
    }

    #[test]
    fn header_and_direction_rules() {
        let f = Fixture::new(false);
        f.header(0x2000, VIRTIO_BLK_T_IN, 0);
        assert_eq!(
            error(f.chain(&[(0x2000, 8, 0), (0x5000, 1, WRITE)])),
            RequestError::HeaderTooShort(8)
        );
        assert_eq!(
            error(f.chain(&[(0x2000, 16, 0), (0x3000, 512, 0), (0x5000, 1, WRITE)])),
            RequestError::WrongDirection(VIRTIO_BLK_T_IN)
        );
        f.header(0x2000, VIRTIO_BLK_T_OUT, 0);
        assert_eq!(
            error(f.chain(&[(0x2000, 16, 0), (0x3000, 512, WRITE), (0x5000, 1, WRITE)])),
            RequestError::WrongDirection(VIRTIO_BLK_T_OUT)
        );
        assert_eq!(
            error(f.chain(&[
                (0x2000, 16, 0),
                (0x5000, 1, WRITE),
                (0x3000, 512, 0),
                (0x5000, 1, WRITE)
            ])),
            RequestError::ReadableAfterWritable
        );
        f.header(0x2000, 99, 0);
        let unsupported = f.chain(&[(0x2000, 16, 0), (0x5000, 1, WRITE)]);
        let e = error(unsupported);
        assert_eq!(e, RequestError::UnsupportedType(99));
        assert_eq!(e.status(), VIRTIO_BLK_S_UNSUPP as u8);
    }

    #[test]
    fn sector_rules() {
        let f = Fixture::new(false);
        f.header(0x2000, VIRTIO_BLK_T_IN, 2048);
        assert!(matches!(
            error(f.chain(&[(0x2000, 16, 0), (0x3000, 512, WRITE), (0x5000, 1, WRITE)])),
            RequestError::BeyondCapacity { sector: 2048, .. }
        ));
        f.header(0x2000, VIRTIO_BLK_T_IN, 2047);
        assert!(f
            .chain(&[(0x2000, 16, 0), (0x3000, 512, WRITE), (0x5000, 1, WRITE)])
            .is_ok());
        f.header(0x2000, VIRTIO_BLK_T_IN, u64::MAX);
        assert_eq!(
            error(f.chain(&[(0x2000, 16, 0), (0x3000, 512, WRITE), (0x5000, 1, WRITE)])),
            RequestError::SectorOverflow(u64::MAX)
        );
        f.header(0x2000, VIRTIO_BLK_T_IN, 0);
        assert_eq!(
            error(f.chain(&[(0x2000, 16, 0), (0x3000, 100, WRITE), (0x5000, 1, WRITE)])),
            RequestError::Misaligned(100)
        );
    }

    #[test]
    fn read_only_disk_refuses_writes() {
        let f = Fixture::new(true);
        f.header(0x2000, VIRTIO_BLK_T_OUT, 0);
        assert_eq!(
            error(f.chain(&[(0x2000, 16, 0), (0x3000, 512, 0), (0x5000, 1, WRITE)])),
            RequestError::ReadOnly
        );
        f.header(0x2000, VIRTIO_BLK_T_FLUSH, 0);
        assert!(f.chain(&[(0x2000, 16, 0), (0x5000, 1, WRITE)]).is_ok());
    }

    #[test]
    fn get_id_rules() {
        let f = Fixture::new(false);
        f.header(0x2000, VIRTIO_BLK_T_GET_ID, 0);
        assert_eq!(
            error(f.chain(&[(0x2000, 16, 0), (0x3000, 10, WRITE), (0x5000, 1, WRITE)])),
            RequestError::GetIdTooSmall(10)
        );
        let (req, _) = f
            .chain(&[(0x2000, 16, 0), (0x3000, 20, WRITE), (0x5000, 1, WRITE)])
            .unwrap();
        assert_eq!(req.kind, RequestKind::GetId);
        let mut scratch = Vec::new();
        collect_chain(f.mem(), GuestAddress(TABLE), QSIZE, 0, &mut scratch).unwrap();
        write_stream(f.mem(), &scratch, &f.disk.serial).unwrap();
        let mut got = [0u8; 20];
        f.mem().read_slice(&mut got, GuestAddress(0x3000)).unwrap();
        assert_eq!(&got[..6], b"serial");
    }

    fn range(f: &Fixture, addr: u64, sector: u64, sectors: u32, flags: u32) {
        let mut r = [0u8; 16];
        r[..8].copy_from_slice(&sector.to_le_bytes());
        r[8..12].copy_from_slice(&sectors.to_le_bytes());
        r[12..].copy_from_slice(&flags.to_le_bytes());
        f.mem().write_slice(&r, GuestAddress(addr)).unwrap();
    }

    #[test]
    fn discard_and_write_zeroes_rules() {
        let f = Fixture::new(false);
        f.header(0x2000, VIRTIO_BLK_T_WRITE_ZEROES, 0);
        range(&f, 0x2010, 8, 16, VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP);
        range(&f, 0x2020, 100, 1, 0);
        let (req, segs) = f.chain(&[(0x2000, 48, 0), (0x5000, 1, WRITE)]).unwrap();
        assert_eq!(req.kind, RequestKind::WriteZeroes);
        assert_eq!(
            segs,
            vec![
                Segment {
                    offset: 4096,
                    len: 8192,
                    aux: RANGE_FLAG_UNMAP
                },
                Segment {
                    offset: 51200,
                    len: 512,
                    aux: 0
                },
            ]
        );
        let cases: [(u32, u64, u32, u32, RequestError); 5] = [
            (VIRTIO_BLK_T_DISCARD, 0, 0, 0, RequestError::EmptyRange),
            (
                VIRTIO_BLK_T_DISCARD,
                0,
                1,
                1,
                RequestError::UnsupportedFlags(1),
            ),
            (
                VIRTIO_BLK_T_WRITE_ZEROES,
                0,
                1,
                6,
                RequestError::UnsupportedFlags(6),
            ),
            (
                VIRTIO_BLK_T_DISCARD,
                2040,
                16,
                0,
                RequestError::BeyondCapacity {
                    sector: 2040,
                    sectors: 16,
                    capacity: 2048,
                },
            ),
            (
                VIRTIO_BLK_T_DISCARD,
                0,
                MAX_DISCARD_SECTORS + 1,
                0,
                RequestError::RangeTooLarge(MAX_DISCARD_SECTORS + 1),
            ),
        ];
        for (t, sector, sectors, flags, expected) in cases {
            f.header(0x2000, t, 0);
            range(&f, 0x2010, sector, sectors, flags);
            assert_eq!(
                error(f.chain(&[(0x2000, 32, 0), (0x5000, 1, WRITE)])),
                expected
            );
        }
        f.header(0x2000, VIRTIO_BLK_T_DISCARD, 0);
        assert_eq!(
            error(f.chain(&[(0x2000, 16, 0), (0x5000, 1, WRITE)])),
            RequestError::RangeListLength(0)
        );
        assert_eq!(
            error(f.chain(&[(0x2000, 24, 0), (0x5000, 1, WRITE)])),
            RequestError::RangeListLength(8)
        );
        let too_many = 16 + 16 * (MAX_DISCARD_SEGMENTS + 1);
        assert_eq!(
            error(f.chain(&[(0x2000, too_many, 0), (0x5000, 1, WRITE)])),
            RequestError::TooManyRanges(MAX_DISCARD_SEGMENTS + 1)
        );
        let ro = Fixture::new(true);
        ro.header(0x2000, VIRTIO_BLK_T_DISCARD, 0);
        range(&ro, 0x2010, 0, 1, 0);
        assert_eq!(
            error(ro.chain(&[(0x2000, 32, 0), (0x5000, 1, WRITE)])),
            RequestError::ReadOnly
        );
    }

    #[test]
    fn too_many_segments_is_an_error_not_a_truncation() {
        let f = Fixture::new(false);
        f.header(0x2000, VIRTIO_BLK_T_IN, 0);
        let limit = f.disk.segments_per_slot();
        assert!(limit < u32::from(QSIZE) * 3);
        struct Bounded(Vec<Segment>, usize);
        impl SegmentSink for Bounded {
            fn push(&mut self, s: Segment) -> Result<(), SinkFull> {
                if self.0.len() >= self.1 {
                    return Err(SinkFull);
                }
                self.0.push(s);
                Ok(())
            }
        }
        // Each 512-byte buffer straddles the region boundary: 2 segments per descriptor.
        for i in 0..14u16 {
            f.set_desc(TABLE, i, Descriptor::new(0x2000, 16, NEXT, i + 1));
        }
        f.set_desc(TABLE, 0, Descriptor::new(0x2000, 16, NEXT, 1));
        for i in 1..14u16 {
            f.set_desc(
                TABLE,
                i,
                Descriptor::new((1 << 16) - 256, 512, WRITE | NEXT, i + 1),
            );
        }
        f.set_desc(TABLE, 14, Descriptor::new(0x5000, 1, WRITE, 0));
        let mut scratch = Vec::new();
        collect_chain(f.mem(), GuestAddress(TABLE), QSIZE, 0, &mut scratch).unwrap();
        let mut sink = Bounded(Vec::new(), 10);
        let e = parse(&scratch, &f.memory, &f.disk, &mut sink).unwrap_err();
        assert!(matches!(e.error, RequestError::TooManySegments(_)));
    }
}
