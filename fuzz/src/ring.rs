//! `ring_consumer`: a frontend–iothread batch ring whose shared memory a hostile peer wrote.
//!
//! ```text
//! u8  slot_count - 1 (mod 64)
//! u8  segments_per_slot - 1 (mod 16)
//! u8  mode: bit 0 file image (the slot state machine runs on kernel results below) rather
//!     than a null image; bit 1 an O_DIRECT fd exists (4096-byte blocks)
//! u64 image size
//! u8  number of results, then that many i32 results fed to the slot state machine in
//!     order (readv/writev/fdatasync/fallocate return values); when they run out every
//!     operation succeeds in full
//! u8  number of slots the frontend pushes on the submission queue after the peer's writes
//! then patches until the end: u32 file offset (mod the ring's size), u16 length, bytes
//! ```
//!
//! Patches inside the 4096-byte header land before the iothread opens the ring (the header
//! is only read then); the others after both ends were set up, as a peer writing while the
//! ring runs.

use crate::{Reader, Writer};

/// `mode` bit: a file image; operations are issued and their results taken from the input.
pub const FILE_IMAGE: u8 = 1;
/// `mode` bit: an O_DIRECT fd exists.
pub const DIRECT: u8 = 2;
/// Guest memory regions as the iothread maps them: (size, offset in the memfd).
pub const REGIONS: [(u64, u64); 2] = [(1 << 16, 0), (4096, 1 << 16)];

/// A decoded input.
#[derive(Debug, Clone, Default)]
pub struct Input<'a> {
    /// Slots in the ring.
    pub slot_count: u32,
    /// Segments per slot.
    pub segments_per_slot: u32,
    /// `FILE_IMAGE` | `DIRECT`.
    pub mode: u8,
    /// The image size requests are checked against.
    pub image_size: u64,
    /// Results of the operations the state machine issues.
    pub results: Vec<i32>,
    /// Slots the frontend submits after the peer's writes.
    pub pushes: u8,
    /// (file offset, bytes) written by the peer.
    pub patches: Vec<(u32, &'a [u8])>,
}

impl<'a> Input<'a> {
    /// Decodes `data`.
    pub fn decode(data: &'a [u8]) -> Self {
        let mut r = Reader::new(data);
        let slot_count = u32::from(r.u8() % 64) + 1;
        let segments_per_slot = u32::from(r.u8() % 16) + 1;
        let mode = r.u8();
        let image_size = r.u64();
        let count = r.u8();
        let results = (0..count).map(|_| r.u32() as i32).collect();
        let pushes = r.u8();
        let mut patches = Vec::new();
        while !r.is_empty() {
            let offset = r.u32();
            let len = usize::from(r.u16());
            patches.push((offset, r.bytes(len)));
        }
        Self {
            slot_count,
            segments_per_slot,
            mode,
            image_size,
            results,
            pushes,
            patches,
        }
    }

    /// Encodes (for seeds).
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        w.u8((self.slot_count - 1) as u8)
            .u8((self.segments_per_slot - 1) as u8)
            .u8(self.mode)
            .u64(self.image_size)
            .u8(self.results.len() as u8);
        for &r in &self.results {
            w.u32(r as u32);
        }
        w.u8(self.pushes);
        for (offset, bytes) in &self.patches {
            w.u32(*offset).u16(bytes.len() as u16).bytes(bytes);
        }
        w.0
    }
}
