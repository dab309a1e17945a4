//! `virtio_blk_request`: one split virtqueue in guest memory the guest controls completely.
//!
//! ```text
//! u8  flags     bit 0 read-only disk, bit 1 4096-byte blocks, bit 2 writethrough,
//!               bit 3 EVENT_IDX, bit 4 the used ring at the avail ring's address
//! u8  capacity  index into CAPACITIES
//! u8  ring size log2 (mod 9: 1..=256 entries)
//! u16 next avail index (what SET_VRING_BASE said)
//! then patches until the end: u32 guest address, u16 length, that many bytes
//! ```
//!
//! Guest memory is three regions of one memfd, as the unit tests' `two_regions` plus one
//! after a hole: [0, 64K), [64K, 128K), [1M, 1M + 4K). The ring lives at fixed addresses
//! (descriptor table [`DESC_TABLE`], avail ring [`AVAIL_RING`], used ring [`USED_RING`]);
//! everything else, including the rings' contents, comes from the patches.

use crate::{Reader, Writer};

/// Guest address of the descriptor table (as in request.rs's tests).
pub const DESC_TABLE: u64 = 0x1000;
/// Guest address of the avail ring (not 0: virtio-queue takes an avail ring at 0 for an
/// unset one and refuses to pop).
pub const AVAIL_RING: u64 = 0x800;
/// Guest address of the used ring.
pub const USED_RING: u64 = 0xe000;
/// Largest ring; also the disk's queue size (so the slot table has this many slots).
pub const MAX_RING: u16 = 256;
/// Guest memory regions: (guest address, size, offset in the memfd).
pub const REGIONS: [(u64, u64, u64); 3] = [
    (0, 1 << 16, 0),
    (1 << 16, 1 << 16, 1 << 16),
    (1 << 20, 4096, 1 << 17),
];
/// Disk sizes in bytes the capacity byte picks from.
pub const CAPACITIES: [u64; 4] = [1 << 20, 4096, 1 << 40, u64::MAX];

/// `flags` bits.
pub const READ_ONLY: u8 = 1;
/// A 4096-byte logical block.
pub const BLOCK_4K: u8 = 2;
/// Writethrough cache mode (SYNC slots).
pub const WRITETHROUGH: u8 = 4;
/// VIRTIO_RING_F_EVENT_IDX negotiated.
pub const EVENT_IDX: u8 = 8;

/// The driver put the used ring where the avail ring is (its idx then moves with every used
/// entry).
pub const USED_ON_AVAIL: u8 = 16;

/// A decoded input.
#[derive(Debug, Clone, Default)]
pub struct Input<'a> {
    /// `READ_ONLY` | `BLOCK_4K` | `WRITETHROUGH` | `EVENT_IDX` | `USED_ON_AVAIL`.
    pub flags: u8,
    /// Disk size in bytes.
    pub capacity: u64,
    /// Ring size, a power of two in 1..=256.
    pub ring_size: u16,
    /// The first avail index the device takes.
    pub next_avail: u16,
    /// Bytes written into guest memory before the queue is processed.
    pub patches: Vec<(u64, &'a [u8])>,
}

impl<'a> Input<'a> {
    /// Decodes `data`.
    pub fn decode(data: &'a [u8]) -> Self {
        let mut r = Reader::new(data);
        let flags = r.u8();
        let capacity = CAPACITIES[usize::from(r.u8()) % CAPACITIES.len()];
        let ring_size = 1u16 << (r.u8() % 9);
        let next_avail = r.u16();
        let mut patches = Vec::new();
        while !r.is_empty() {
            let addr = u64::from(r.u32());
            let len = usize::from(r.u16());
            patches.push((addr, r.bytes(len)));
        }
        Self {
            flags,
            capacity,
            ring_size,
            next_avail,
            patches,
        }
    }
}

/// Builds an input (for seeds): a ring of `ring_size` with the given patches.
#[derive(Debug, Clone)]
pub struct Builder {
    w: Writer,
}

impl Builder {
    /// Starts an input; `capacity` is an index into [`CAPACITIES`], `ring_log2` the ring size.
    pub fn new(flags: u8, capacity: u8, ring_log2: u8, next_avail: u16) -> Self {
        let mut w = Writer::default();
        w.u8(flags).u8(capacity).u8(ring_log2).u16(next_avail);
        Self { w }
    }

    /// Writes `bytes` at guest address `addr`.
    pub fn patch(mut self, addr: u32, bytes: &[u8]) -> Self {
        self.w.u32(addr).u16(bytes.len() as u16).bytes(bytes);
        self
    }

    /// Writes descriptor `index` of the table at `table`.
    pub fn desc(self, table: u64, index: u16, addr: u64, len: u32, flags: u16, next: u16) -> Self {
        let mut d = Writer::default();
        d.u64(addr).u32(len).u16(flags).u16(next);
        self.patch((table + u64::from(index) * 16) as u32, &d.0)
    }

    /// Writes a virtio-blk request header at `addr`.
    pub fn header(self, addr: u64, request_type: u32, sector: u64) -> Self {
        let mut h = Writer::default();
        h.u32(request_type).u32(0).u64(sector);
        self.patch(addr as u32, &h.0)
    }

    /// Writes a discard / write-zeroes range at `addr`.
    pub fn range(self, addr: u64, sector: u64, sectors: u32, flags: u32) -> Self {
        let mut r = Writer::default();
        r.u64(sector).u32(sectors).u32(flags);
        self.patch(addr as u32, &r.0)
    }

    /// Publishes `heads` on the avail ring, starting at avail index `first`.
    pub fn avail(self, ring_size: u16, first: u16, heads: &[u16]) -> Self {
        let mut b = self;
        for (i, head) in heads.iter().enumerate() {
            let idx = first.wrapping_add(i as u16) % ring_size;
            b = b.patch(
                (AVAIL_RING + 4 + 2 * u64::from(idx)) as u32,
                &head.to_le_bytes(),
            );
        }
        let idx = first.wrapping_add(heads.len() as u16);
        b.patch((AVAIL_RING + 2) as u32, &idx.to_le_bytes())
    }

    /// The encoded input.
    pub fn finish(self) -> Vec<u8> {
        self.w.0
    }
}
