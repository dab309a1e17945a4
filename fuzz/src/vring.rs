//! `used_rings`: what the iothread's writer of the guest's used rings (`iothread/src/vring.rs`)
//! is told by a hostile frontend and sees a hostile driver do: queue specs, completions of
//! slots whose headers and segments the frontend wrote, memory-table swaps, dirty logs, and
//! guest memory written between the steps.
//!
//! ```text
//! u8  the memory table in force at the start (index into TABLES, mod its length)
//! then operations until the end, each a u8 kind (mod 10) and its fields:
//! 0 start      StartQueue: u16 queue, u16 size, u32 flags (QUEUE_FLAG_EVENT_IDX,
//!              QUEUE_FLAG_CALL: a call eventfd comes with it), u64 avail ring address,
//!              u64 used ring address, u16 next_used, u16 inflight_size (entries per queue of
//!              the queue's inflight region, which is made for it)
//! 1 complete   a request finishes: u8 slot (mod SLOTS), then the slot header's u8 opcode,
//!              u16 queue, u16 head, u32 status_region, u64 status_offset, u32 used_len,
//!              u32 segment_count, then the u32 status it finished with
//! 2 segment    the frontend writes a slot's segment: u8 slot (mod SLOTS), u8 index
//!              (mod SEGMENTS), u64 offset, u32 len, u32 aux (memory region)
//! 3 publish    the engine publishes its batch: u8 bit 0 a SetDirtyLog arrives after the used
//!              entries were recorded, bit 1 one after the indices moved (the engine reads
//!              the control socket at both points when the log epoch changed); each (bit 0's
//!              first) a dirty-log change as kind 7 has it
//! 4 remap      SetMemoryTable: u8 table (mod the number of TABLES)
//! 5 stop       StopQueue: u16 queue
//! 6 set_call   SetCall: u16 queue, u8 bit 0 an eventfd comes with it (else none)
//! 7 dirty log  SetDirtyLog: u8 bit 0 on (else off), u64 size, u64 offset of the bitmap in the
//!              log file (LOG_LEN bytes)
//! 8 driver     the driver writes its ring: u16 queue, u8 field (mod 3: avail flags, used_event,
//!              used idx), u16 value
//! 9 patch      the guest writes its memory: u16 offset in the guest memfd (mod GUEST_LEN),
//!              u8 length, the bytes (what lies past the memfd's end is dropped)
//! ```
//!
//! A short last operation reads as zeros. Guest memory is one memfd of [`GUEST_LEN`] bytes that
//! every table in [`TABLES`] maps, each in its own layout, so a table swap can take a ring out
//! of guest memory, move it or misalign it.

use blkplane_proto::control::QueueSpec;
use blkplane_proto::ring::Segment;

use crate::{Reader, Writer};

/// Bytes of the guest memfd.
pub const GUEST_LEN: u64 = 0xc000;
/// Bytes of the dirty log's memfd.
pub const LOG_LEN: u64 = 0x2000;
/// Slots in the ring's slot table.
pub const SLOTS: u32 = 8;
/// Segments per slot.
pub const SEGMENTS: u32 = 4;
/// The memory tables, as regions `(guest address, size, offset in the guest memfd)` in the
/// order the frontend numbers them: 0 a low and a high region with a hole between; 1 the low
/// one only; 2 the high one first and misaligned (its memfd offset is odd), the low one
/// shrunk and moved in the memfd; 3 no region at all.
pub const TABLES: [&[(u64, u64, u64)]; 4] = [
    &[(LOW, 0x8000, 0), (HIGH, 0x4000, 0x8000)],
    &[(LOW, 0x8000, 0)],
    &[(HIGH, 0x3fff, 0x8001), (LOW, 0x4000, 0x4000)],
    &[],
];
/// Guest-physical address of the low region.
pub const LOW: u64 = 0x10000;
/// Guest-physical address of the high region.
pub const HIGH: u64 = 0x40000;

/// A dirty-log change: `Some((size, offset))` a new log, `None` logging off.
pub type DirtyLogChange = Option<(u64, u64)>;

/// A field of its rings the driver writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Field {
    /// `avail->flags` (VRING_AVAIL_F_NO_INTERRUPT).
    AvailFlags = 0,
    /// `used_event`, after the avail ring's entries (VIRTIO_RING_F_EVENT_IDX).
    UsedEvent = 1,
    /// `used->idx`, which only the device should write.
    UsedIdx = 2,
}

/// A request finishing: the header its slot held, and its status.
#[derive(Debug, Clone, Copy, Default)]
pub struct Complete {
    /// Its slot.
    pub slot: u32,
    /// The header's `opcode`.
    pub opcode: u32,
    /// The header's `queue`.
    pub queue: u16,
    /// The header's `head`.
    pub head: u16,
    /// The header's `status_region`.
    pub status_region: u32,
    /// The header's `status_offset`.
    pub status_offset: u64,
    /// The header's `used_len`.
    pub used_len: u32,
    /// The header's `segment_count` (for a read, the segments marked in the dirty log).
    pub segment_count: u32,
    /// The status it finished with.
    pub status: u32,
}

/// One step.
#[derive(Debug, Clone)]
pub enum Op<'a> {
    /// StartQueue with this spec (`inflight_queue`, `inflight_queues`, `inflight_offset` are
    /// the engine's concern and not encoded: 0, 1, 0).
    Start(QueueSpec),
    /// A request finishes.
    Complete(Complete),
    /// The frontend writes segment `index` of `slot`.
    Segment {
        /// The slot.
        slot: u32,
        /// The segment's index.
        index: u32,
        /// What it writes.
        segment: Segment,
    },
    /// The engine publishes, with dirty-log changes after the record and after the fence.
    Publish([Option<DirtyLogChange>; 2]),
    /// SetMemoryTable: index into [`TABLES`].
    Remap(usize),
    /// StopQueue.
    Stop(u16),
    /// SetCall, with an eventfd or none.
    SetCall {
        /// The queue.
        queue: u16,
        /// Whether an eventfd comes with it.
        call: bool,
    },
    /// SetDirtyLog.
    DirtyLog(DirtyLogChange),
    /// The driver writes `value` to a field of queue `queue`'s rings.
    Driver {
        /// The queue.
        queue: u16,
        /// Which field.
        field: Field,
        /// The value.
        value: u16,
    },
    /// The guest writes `bytes` at `offset` of the guest memfd.
    Patch {
        /// Offset in the memfd (below [`GUEST_LEN`]).
        offset: u64,
        /// The bytes.
        bytes: &'a [u8],
    },
}

/// A decoded input.
#[derive(Debug, Clone, Default)]
pub struct Input<'a> {
    /// The memory table at the start: index into [`TABLES`].
    pub table: usize,
    /// The steps, in order.
    pub ops: Vec<Op<'a>>,
}

fn log_change(r: &mut Reader) -> DirtyLogChange {
    let on = r.u8() & 1 != 0;
    let (size, offset) = (r.u64(), r.u64());
    on.then_some((size, offset))
}

fn write_log_change(w: &mut Writer, change: DirtyLogChange) {
    let (size, offset) = change.unwrap_or((0, 0));
    w.u8(u8::from(change.is_some())).u64(size).u64(offset);
}

impl<'a> Input<'a> {
    /// Decodes `data`.
    pub fn decode(data: &'a [u8]) -> Self {
        let mut r = Reader::new(data);
        let table = usize::from(r.u8()) % TABLES.len();
        let mut ops = Vec::new();
        // Every operation takes at least its kind byte, so this ends.
        while !r.is_empty() {
            let op = match r.u8() % 10 {
                0 => Op::Start(QueueSpec {
                    queue: r.u16(),
                    size: r.u16(),
                    flags: r.u32(),
                    avail_addr: r.u64(),
                    used_addr: r.u64(),
                    next_used: r.u16(),
                    inflight_queue: 0,
                    inflight_queues: 1,
                    inflight_size: r.u16(),
                    inflight_offset: 0,
                }),
                1 => Op::Complete(Complete {
                    slot: u32::from(r.u8()) % SLOTS,
                    opcode: u32::from(r.u8()),
                    queue: r.u16(),
                    head: r.u16(),
                    status_region: r.u32(),
                    status_offset: r.u64(),
                    used_len: r.u32(),
                    segment_count: r.u32(),
                    status: r.u32(),
                }),
                2 => Op::Segment {
                    slot: u32::from(r.u8()) % SLOTS,
                    index: u32::from(r.u8()) % SEGMENTS,
                    segment: Segment {
                        offset: r.u64(),
                        len: r.u32(),
                        aux: r.u32(),
                    },
                },
                3 => {
                    let bits = r.u8();
                    let mut changes = [None, None];
                    for (bit, change) in changes.iter_mut().enumerate() {
                        if bits & (1 << bit) != 0 {
                            *change = Some(log_change(&mut r));
                        }
                    }
                    Op::Publish(changes)
                }
                4 => Op::Remap(usize::from(r.u8()) % TABLES.len()),
                5 => Op::Stop(r.u16()),
                6 => Op::SetCall {
                    queue: r.u16(),
                    call: r.u8() & 1 != 0,
                },
                7 => Op::DirtyLog(log_change(&mut r)),
                8 => Op::Driver {
                    queue: r.u16(),
                    field: match r.u8() % 3 {
                        0 => Field::AvailFlags,
                        1 => Field::UsedEvent,
                        _ => Field::UsedIdx,
                    },
                    value: r.u16(),
                },
                _ => {
                    let offset = u64::from(r.u16()) % GUEST_LEN;
                    let len = usize::from(r.u8());
                    Op::Patch {
                        offset,
                        bytes: r.bytes(len),
                    }
                }
            };
            ops.push(op);
        }
        Self { table, ops }
    }

    /// Encodes (for seeds).
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        w.u8(self.table as u8);
        for op in &self.ops {
            match op {
                Op::Start(spec) => {
                    w.u8(0)
                        .u16(spec.queue)
                        .u16(spec.size)
                        .u32(spec.flags)
                        .u64(spec.avail_addr)
                        .u64(spec.used_addr)
                        .u16(spec.next_used)
                        .u16(spec.inflight_size);
                }
                Op::Complete(c) => {
                    w.u8(1)
                        .u8(c.slot as u8)
                        .u8(c.opcode as u8)
                        .u16(c.queue)
                        .u16(c.head)
                        .u32(c.status_region)
                        .u64(c.status_offset)
                        .u32(c.used_len)
                        .u32(c.segment_count)
                        .u32(c.status);
                }
                Op::Segment {
                    slot,
                    index,
                    segment,
                } => {
                    w.u8(2)
                        .u8(*slot as u8)
                        .u8(*index as u8)
                        .u64(segment.offset)
                        .u32(segment.len)
                        .u32(segment.aux);
                }
                Op::Publish(changes) => {
                    let bits = changes
                        .iter()
                        .enumerate()
                        .filter(|(_, c)| c.is_some())
                        .fold(0u8, |bits, (bit, _)| bits | 1 << bit);
                    w.u8(3).u8(bits);
                    for change in changes.iter().flatten() {
                        write_log_change(&mut w, *change);
                    }
                }
                Op::Remap(table) => {
                    w.u8(4).u8(*table as u8);
                }
                Op::Stop(queue) => {
                    w.u8(5).u16(*queue);
                }
                Op::SetCall { queue, call } => {
                    w.u8(6).u16(*queue).u8(u8::from(*call));
                }
                Op::DirtyLog(change) => {
                    w.u8(7);
                    write_log_change(&mut w, *change);
                }
                Op::Driver {
                    queue,
                    field,
                    value,
                } => {
                    w.u8(8).u16(*queue).u8(*field as u8).u16(*value);
                }
                Op::Patch { offset, bytes } => {
                    w.u8(9)
                        .u16(*offset as u16)
                        .u8(bytes.len() as u8)
                        .bytes(bytes);
                }
            }
        }
        w.0
    }
}
