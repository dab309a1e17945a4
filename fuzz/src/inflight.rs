//! `inflight_recovery`: an inflight region (INFLIGHT_SHMFD) as a crashed predecessor or a
//! hostile VMM left it, handed over with SET_INFLIGHT_FD, and the ring start that recovers it.
//!
//! ```text
//! u8  num_queues - 1 (mod 4)       the message's num_queues
//! u16 queue_size - 1 (mod 256)     the message's queue_size (entries per queue region)
//! u8  queue index (mod 8: may name a queue the region lacks)
//! u8  ring size log2 (mod 9: 1..=256, as SET_VRING_NUM allows)
//! u16 used index in guest memory
//! u16 avail index in guest memory
//! u8  file: bit 0 mmap_size one page larger than needed, bit 1 area at offset one page,
//!     bit 2 unsealed memfd, bit 3 mmap_size one byte short, bit 4 mmap_size u64::MAX (the
//!     area's end overflows when it starts one page in)
//! then the region's bytes, from the area's start
//! ```

use crate::{Reader, Writer};

/// The device the region is checked against: 4 queues of up to 256 entries.
pub const MAX_QUEUES: u16 = 4;
/// See [`MAX_QUEUES`].
pub const MAX_QUEUE_SIZE: u16 = 256;
/// `file` bit: mmap_size one page larger than needed.
pub const LARGER: u8 = 1;
/// `file` bit: the area starts one page into the file.
pub const OFFSET: u8 = 2;
/// `file` bit: a memfd without seals.
pub const UNSEALED: u8 = 4;
/// `file` bit: mmap_size one byte short of what the queues need.
pub const SHORT: u8 = 8;

/// `file` bit: mmap_size is `u64::MAX`.
pub const OVERFLOW: u8 = 16;

/// A decoded input.
#[derive(Debug, Clone)]
pub struct Input<'a> {
    /// Queues in the region.
    pub num_queues: u16,
    /// Entries per queue region.
    pub queue_size: u16,
    /// The ring being started.
    pub queue: u16,
    /// Its size.
    pub ring_size: u16,
    /// Used index in guest memory.
    pub used_idx: u16,
    /// Avail index in guest memory.
    pub avail_idx: u16,
    /// `LARGER` | `OFFSET` | `UNSEALED` | `SHORT` | `OVERFLOW`.
    pub file: u8,
    /// Region contents.
    pub contents: &'a [u8],
}

impl<'a> Input<'a> {
    /// Decodes `data`.
    pub fn decode(data: &'a [u8]) -> Self {
        let mut r = Reader::new(data);
        Self {
            num_queues: u16::from(r.u8() % 4) + 1,
            queue_size: r.u16() % MAX_QUEUE_SIZE + 1,
            queue: u16::from(r.u8() % 8),
            ring_size: 1 << (r.u8() % 9),
            used_idx: r.u16(),
            avail_idx: r.u16(),
            file: r.u8(),
            contents: r.rest(),
        }
    }

    /// Encodes (for seeds).
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        w.u8((self.num_queues - 1) as u8)
            .u16(self.queue_size - 1)
            .u8(self.queue as u8)
            .u8(self.ring_size.trailing_zeros() as u8)
            .u16(self.used_idx)
            .u16(self.avail_idx)
            .u8(self.file)
            .bytes(self.contents);
        w.0
    }
}
