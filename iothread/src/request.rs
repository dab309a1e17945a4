//! Turns a request slot written by the frontend into a validated, typed [`Request`].
//!
//! The frontend may be compromised, so nothing read from a slot reaches the kernel unchecked:
//! the opcode must be known, the segment count must fit the slot, every data segment must lie
//! inside a mapped memory region, and every byte the request touches must lie inside the image.
//! The slot is read exactly once and what was checked is copied into the iothread's own
//! per-slot buffers, so a frontend rewriting the slot while the request runs changes nothing
//! (no time-of-check/time-of-use gap).

use blkplane_proto::ring::{
    Opcode, RingError, SlotHeader, SlotTable, NO_STATUS, RANGE_FLAG_UNMAP, SLOT_FLAG_SYNC,
};
use virtio_bindings::virtio_blk::{VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK, VIRTIO_BLK_S_UNSUPP};

use crate::memory::MemoryTable;

/// A byte range of the image to discard or zero.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ImageRange {
    /// First byte.
    pub offset: u64,
    /// Length in bytes, never zero.
    pub len: u64,
    /// The frontend allows deallocating the range (`RANGE_FLAG_UNMAP`).
    pub unmap: bool,
}

/// A validated request. Its iovecs or ranges were written into the buffers given to [`parse`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Request {
    /// Read `len` bytes at `image_offset` into the first `iovecs` iovecs.
    Read {
        /// Image byte offset.
        image_offset: u64,
        /// Total bytes.
        len: u64,
        /// Number of iovecs filled in.
        iovecs: usize,
    },
    /// Write the first `iovecs` iovecs (`len` bytes) at `image_offset`.
    Write {
        /// Image byte offset.
        image_offset: u64,
        /// Total bytes.
        len: u64,
        /// Number of iovecs filled in.
        iovecs: usize,
        /// fdatasync before completing (writethrough).
        sync: bool,
    },
    /// Make completed writes durable.
    Flush,
    /// Deallocate the first `ranges` ranges.
    Discard {
        /// Number of ranges filled in.
        ranges: usize,
    },
    /// Zero the first `ranges` ranges.
    WriteZeroes {
        /// Number of ranges filled in.
        ranges: usize,
    },
    /// No I/O: the frontend's own answer, completed at once with `status`.
    Answer {
        /// `VIRTIO_BLK_S_OK`, `_IOERR` or `_UNSUPP` (anything else became `_IOERR`).
        status: u32,
    },
}

/// How a slot's request is completed in guest memory, as its header says: read once when the
/// request starts, so a frontend rewriting the slot meanwhile changes nothing.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UsedTarget {
    /// The queue's index among those started on this iothread.
    pub queue: u16,
    /// The descriptor head the used entry returns.
    pub head: u16,
    /// The status byte: memory region index and offset (`None`: the chain has none).
    pub status: Option<(u32, u64)>,
    /// Used length on success (and, for an answer, whatever its status).
    pub used_len: u32,
    /// The frontend's own answer: `used_len` holds whatever the status.
    pub answer: bool,
}

impl UsedTarget {
    /// Reads the completion part of a slot header.
    pub fn from_header(header: &SlotHeader) -> Self {
        Self {
            queue: header.queue,
            head: header.head,
            status: (header.status_region != NO_STATUS)
                .then_some((header.status_region, header.status_offset)),
            used_len: header.used_len,
            answer: header.opcode == Opcode::Answer as u32,
        }
    }

    /// The used length to report with `status`: what the frontend said on success (or for
    /// an answer), else just the status byte, if there is one.
    pub fn used_len(&self, status: u32) -> u32 {
        if self.answer || status == VIRTIO_BLK_S_OK {
            self.used_len
        } else {
            u32::from(self.status.is_some())
        }
    }
}

/// A rule a slot breaks. Apart from [`RequestError::Slot`] these concern one request only: it is
/// completed with `VIRTIO_BLK_S_IOERR` and the iothread carries on.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    /// The opcode is none of [`Opcode`].
    #[error("unknown opcode {0}")]
    UnknownOpcode(u32),
    /// More segments than a slot holds.
    #[error("{count} segments, but a slot holds {max}")]
    TooManySegments {
        /// `segment_count` of the slot.
        count: u32,
        /// Segments per slot.
        max: u32,
    },
    /// A data segment names a region the memory table does not have.
    #[error("segment {segment} names memory region {region}, but the table has {regions}")]
    NoSuchRegion {
        /// Index of the segment in the slot.
        segment: u32,
        /// The region index it names.
        region: u32,
        /// Regions in the table.
        regions: usize,
    },
    /// A data segment extends past the end of its memory region.
    #[error("segment {segment}: {len} bytes at offset {offset} exceed memory region {region}")]
    OutsideRegion {
        /// Index of the segment in the slot.
        segment: u32,
        /// The region index it names.
        region: u32,
        /// Offset in the region.
        offset: u64,
        /// Length.
        len: u32,
    },
    /// A read or write extends past the end of the image.
    #[error("{len} bytes at image offset {offset} exceed the image ({size} bytes)")]
    OutsideImage {
        /// Image offset of the request.
        offset: u64,
        /// Bytes it transfers.
        len: u64,
        /// Image size.
        size: u64,
    },
    /// A discard or write-zeroes range extends past the end of the image.
    #[error(
        "range {segment}: {len} bytes at image offset {offset} exceed the image ({size} bytes)"
    )]
    RangeOutsideImage {
        /// Index of the range in the slot.
        segment: u32,
        /// Image offset of the range.
        offset: u64,
        /// Its length.
        len: u32,
        /// Image size.
        size: u64,
    },
    /// The slot table itself refused the access: the slot number is not in the table. The
    /// frontend is broken beyond a single request.
    #[error("reading the slot: {0}")]
    Slot(#[from] RingError),
}

impl RequestError {
    /// Whether the error means the frontend is broken (rather than one request being bad).
    pub fn is_fatal(&self) -> bool {
        matches!(self, Self::Slot(_))
    }

    /// Whether the request reaches past the image as last measured (it may have grown).
    pub fn is_outside_image(&self) -> bool {
        matches!(
            self,
            Self::OutsideImage { .. } | Self::RangeOutsideImage { .. }
        )
    }
}

/// Reads and validates `slot`, filling `iovecs` (data requests) or `ranges` (discard and write
/// zeroes). Both buffers should hold `slots.segments_per_slot()` entries; a request needing
/// more is refused with [`RequestError::TooManySegments`]. Zero-length segments and ranges are
/// validated but left out, so that every iovec and range produced moves at least one byte.
pub fn parse(
    slots: &SlotTable,
    slot: u32,
    memory: &MemoryTable,
    image_size: u64,
    iovecs: &mut [libc::iovec],
    ranges: &mut [ImageRange],
) -> Result<Request, RequestError> {
    let header = slots.header(slot)?;
    let opcode =
        Opcode::from_raw(header.opcode).ok_or(RequestError::UnknownOpcode(header.opcode))?;
    let count = header.segment_count;
    let max = slots.segments_per_slot();
    if count > max {
        return Err(RequestError::TooManySegments { count, max });
    }
    match opcode {
        Opcode::Read | Opcode::Write => {
            let (len, filled) = parse_data(slots, slot, count, memory, iovecs)?;
            let in_image = header
                .image_offset
                .checked_add(len)
                .is_some_and(|end| end <= image_size);
            if !in_image {
                return Err(RequestError::OutsideImage {
                    offset: header.image_offset,
                    len,
                    size: image_size,
                });
            }
            Ok(if opcode == Opcode::Read {
                Request::Read {
                    image_offset: header.image_offset,
                    len,
                    iovecs: filled,
                }
            } else {
                Request::Write {
                    image_offset: header.image_offset,
                    len,
                    iovecs: filled,
                    sync: header.flags & SLOT_FLAG_SYNC != 0,
                }
            })
        }
        Opcode::Flush => Ok(Request::Flush),
        Opcode::Answer => Ok(Request::Answer {
            status: match header.answer {
                VIRTIO_BLK_S_OK | VIRTIO_BLK_S_UNSUPP => header.answer,
                _ => VIRTIO_BLK_S_IOERR,
            },
        }),
        Opcode::Discard | Opcode::WriteZeroes => {
            let filled = parse_ranges(slots, slot, count, image_size, ranges)?;
            Ok(if opcode == Opcode::Discard {
                Request::Discard { ranges: filled }
            } else {
                Request::WriteZeroes { ranges: filled }
            })
        }
    }
}

/// Checks the data segments and writes their iovecs; returns the total length and the number
/// of iovecs written.
fn parse_data(
    slots: &SlotTable,
    slot: u32,
    count: u32,
    memory: &MemoryTable,
    iovecs: &mut [libc::iovec],
) -> Result<(u64, usize), RequestError> {
    let mut total: u64 = 0;
    let mut filled = 0;
    for index in 0..count {
        let segment = slots.segment(slot, index)?;
        let region = memory
            .region(segment.aux)
            .ok_or(RequestError::NoSuchRegion {
                segment: index,
                region: segment.aux,
                regions: memory.len(),
            })?;
        let address =
            region
                .address(segment.offset, segment.len)
                .ok_or(RequestError::OutsideRegion {
                    segment: index,
                    region: segment.aux,
                    offset: segment.offset,
                    len: segment.len,
                })?;
        if segment.len == 0 {
            continue;
        }
        let too_many = RequestError::TooManySegments {
            count,
            max: u32::try_from(iovecs.len()).unwrap_or(u32::MAX),
        };
        let iovec = iovecs.get_mut(filled).ok_or(too_many)?;
        *iovec = libc::iovec {
            iov_base: address.cast(),
            iov_len: segment.len as usize,
        };
        // Bounded by the slot's segment count.
        filled = filled.saturating_add(1);
        // At most 4096 segments of under 4 GiB each: the sum cannot overflow a u64.
        total = total.saturating_add(u64::from(segment.len));
    }
    Ok((total, filled))
}

/// Checks the discard/write-zeroes ranges and copies them; returns how many were written.
fn parse_ranges(
    slots: &SlotTable,
    slot: u32,
    count: u32,
    image_size: u64,
    ranges: &mut [ImageRange],
) -> Result<usize, RequestError> {
    let mut filled = 0;
    for index in 0..count {
        let segment = slots.segment(slot, index)?;
        let in_image = segment
            .offset
            .checked_add(u64::from(segment.len))
            .is_some_and(|end| end <= image_size);
        if !in_image {
            return Err(RequestError::RangeOutsideImage {
                segment: index,
                offset: segment.offset,
                len: segment.len,
                size: image_size,
            });
        }
        if segment.len == 0 {
            continue;
        }
        let too_many = RequestError::TooManySegments {
            count,
            max: u32::try_from(ranges.len()).unwrap_or(u32::MAX),
        };
        let range = ranges.get_mut(filled).ok_or(too_many)?;
        *range = ImageRange {
            offset: segment.offset,
            len: u64::from(segment.len),
            unmap: segment.aux & RANGE_FLAG_UNMAP != 0,
        };
        // Bounded by the slot's segment count.
        filled = filled.saturating_add(1);
    }
    Ok(filled)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::tests::memfd;
    use blkplane_proto::control::MemoryRegionSpec;
    use blkplane_proto::ring::{Segment, SharedRing, SlotHeader};

    const SEGS: u32 = 4;
    const IMAGE: u64 = 1 << 20;

    struct Fixture {
        ring: SharedRing,
        memory: MemoryTable,
        iovecs: Vec<libc::iovec>,
        ranges: Vec<ImageRange>,
    }

    impl Fixture {
        fn new() -> Self {
            let file = memfd(3 * 4096);
            let memory = MemoryTable::map(
                &[
                    MemoryRegionSpec {
                        size: 4096,
                        mmap_offset: 0,
                        guest_addr: 0,
                    },
                    MemoryRegionSpec {
                        size: 8192,
                        mmap_offset: 4096,
                        guest_addr: 0,
                    },
                ],
                &[file.try_clone().unwrap(), file],
            )
            .unwrap();
            let empty = libc::iovec {
                iov_base: std::ptr::null_mut(),
                iov_len: 0,
            };
            Self {
                ring: SharedRing::create(4, SEGS).unwrap(),
                memory,
                iovecs: vec![empty; SEGS as usize],
                ranges: vec![ImageRange::default(); SEGS as usize],
            }
        }

        fn write_slot(&self, opcode: u32, flags: u32, image_offset: u64, segments: &[Segment]) {
            let slots = self.ring.slots();
            slots
                .set_header(
                    1,
                    SlotHeader {
                        opcode,
                        flags,
                        image_offset,
                        segment_count: segments.len() as u32,
                        ..Default::default()
                    },
                )
                .unwrap();
            for (i, segment) in segments.iter().enumerate() {
                slots.set_segment(1, i as u32, *segment).unwrap();
            }
        }

        fn parse(&mut self) -> Result<Request, RequestError> {
            parse(
                &self.ring.slots(),
                1,
                &self.memory,
                IMAGE,
                &mut self.iovecs,
                &mut self.ranges,
            )
        }
    }

    fn seg(offset: u64, len: u32, aux: u32) -> Segment {
        Segment { offset, len, aux }
    }

    #[test]
    fn valid_write_fills_iovecs_and_skips_empty_segments() {
        let mut f = Fixture::new();
        f.write_slot(
            Opcode::Write as u32,
            SLOT_FLAG_SYNC,
            512,
            &[seg(100, 1000, 0), seg(0, 0, 1), seg(8000, 192, 1)],
        );
        let request = f.parse().unwrap();
        assert_eq!(
            request,
            Request::Write {
                image_offset: 512,
                len: 1192,
                iovecs: 2,
                sync: true
            }
        );
        let region0 = f.memory.region(0).unwrap().address(100, 0).unwrap();
        let region1 = f.memory.region(1).unwrap().address(8000, 0).unwrap();
        assert_eq!(f.iovecs[0].iov_base, region0.cast());
        assert_eq!(f.iovecs[0].iov_len, 1000);
        assert_eq!(f.iovecs[1].iov_base, region1.cast());
        assert_eq!(f.iovecs[1].iov_len, 192);
    }

    #[test]
    fn read_flush_and_ranges() {
        let mut f = Fixture::new();
        f.write_slot(Opcode::Read as u32, 0, IMAGE - 4096, &[seg(0, 4096, 0)]);
        assert!(matches!(
            f.parse().unwrap(),
            Request::Read { iovecs: 1, .. }
        ));
        f.write_slot(Opcode::Flush as u32, 0, 0, &[]);
        assert_eq!(f.parse().unwrap(), Request::Flush);
        f.write_slot(
            Opcode::WriteZeroes as u32,
            0,
            0,
            &[
                seg(0, 512, RANGE_FLAG_UNMAP),
                seg(4096, 0, 0),
                seg(IMAGE - 1, 1, 0),
            ],
        );
        assert_eq!(f.parse().unwrap(), Request::WriteZeroes { ranges: 2 });
        assert_eq!(
            f.ranges[..2],
            [
                ImageRange {
                    offset: 0,
                    len: 512,
                    unmap: true
                },
                ImageRange {
                    offset: IMAGE - 1,
                    len: 1,
                    unmap: false
                }
            ]
        );
        f.write_slot(Opcode::Discard as u32, 0, 0, &[seg(0, 4096, 0)]);
        assert_eq!(f.parse().unwrap(), Request::Discard { ranges: 1 });
    }

    #[test]
    fn unknown_opcode() {
        let mut f = Fixture::new();
        for opcode in [0, 7, u32::MAX] {
            f.write_slot(opcode, 0, 0, &[]);
            assert!(matches!(f.parse(), Err(RequestError::UnknownOpcode(o)) if o == opcode));
        }
    }

    #[test]
    fn an_answer_carries_a_known_status_or_ioerr() {
        let mut f = Fixture::new();
        let slots = f.ring.slots();
        for (given, parsed) in [
            (VIRTIO_BLK_S_OK, VIRTIO_BLK_S_OK),
            (VIRTIO_BLK_S_UNSUPP, VIRTIO_BLK_S_UNSUPP),
            (VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_IOERR),
            (77, VIRTIO_BLK_S_IOERR),
        ] {
            let header = SlotHeader {
                opcode: Opcode::Answer as u32,
                answer: given,
                ..Default::default()
            };
            slots.set_header(1, header).unwrap();
            assert_eq!(f.parse().unwrap(), Request::Answer { status: parsed });
        }
    }

    #[test]
    fn the_used_length_depends_on_the_status() {
        let io = UsedTarget::from_header(&SlotHeader {
            opcode: Opcode::Read as u32,
            used_len: 4097,
            status_region: 0,
            ..Default::default()
        });
        assert_eq!(io.used_len(VIRTIO_BLK_S_OK), 4097);
        assert_eq!(io.used_len(VIRTIO_BLK_S_IOERR), 1, "only the status byte");
        let rejected = UsedTarget::from_header(&SlotHeader {
            opcode: Opcode::Answer as u32,
            status_region: NO_STATUS,
            used_len: 0,
            ..Default::default()
        });
        assert_eq!(rejected.status, None);
        assert_eq!(rejected.used_len(VIRTIO_BLK_S_IOERR), 0);
        let get_id = UsedTarget::from_header(&SlotHeader {
            opcode: Opcode::Answer as u32,
            used_len: 21,
            ..Default::default()
        });
        assert_eq!(
            get_id.used_len(VIRTIO_BLK_S_IOERR),
            21,
            "an answer's length holds"
        );
    }

    #[test]
    fn more_segments_than_the_buffers_hold() {
        let mut f = Fixture::new();
        f.write_slot(Opcode::Read as u32, 0, 0, &[seg(0, 1, 0), seg(1, 1, 0)]);
        f.iovecs.truncate(1);
        assert!(matches!(
            f.parse(),
            Err(RequestError::TooManySegments { count: 2, max: 1 })
        ));
    }

    #[test]
    fn segment_count_beyond_the_slot_is_refused() {
        let mut f = Fixture::new();
        // What a hostile frontend writes into shared memory, bypassing SlotTable's own check.
        let bytes = SlotHeader {
            opcode: Opcode::Read as u32,
            flags: 0,
            image_offset: 0,
            segment_count: SEGS + 1,
            ..Default::default()
        };
        let layout = *f.ring.layout();
        let offset = layout.slots_offset + layout.slot_stride;
        poke_header(&f.ring, offset, bytes);
        assert!(matches!(
            f.parse(),
            Err(RequestError::TooManySegments { count, max: SEGS }) if count == SEGS + 1
        ));
    }

    /// Writes a raw slot header into the ring file at `offset`, the way a peer process could.
    fn poke_header(ring: &SharedRing, offset: u64, header: SlotHeader) {
        use std::os::unix::fs::FileExt;
        let mut raw = Vec::new();
        raw.extend_from_slice(&header.opcode.to_le_bytes());
        raw.extend_from_slice(&header.flags.to_le_bytes());
        raw.extend_from_slice(&header.image_offset.to_le_bytes());
        raw.extend_from_slice(&header.segment_count.to_le_bytes());
        raw.extend_from_slice(&header.reserved.to_le_bytes());
        ring.file().write_all_at(&raw, offset).unwrap();
    }

    #[test]
    fn no_such_region() {
        let mut f = Fixture::new();
        f.write_slot(
            Opcode::Write as u32,
            0,
            0,
            &[seg(0, 512, 0), seg(0, 512, 2)],
        );
        assert!(matches!(
            f.parse(),
            Err(RequestError::NoSuchRegion {
                segment: 1,
                region: 2,
                regions: 2
            })
        ));
        f.memory = MemoryTable::empty();
        f.write_slot(Opcode::Read as u32, 0, 0, &[seg(0, 0, 0)]);
        assert!(
            matches!(f.parse(), Err(RequestError::NoSuchRegion { .. })),
            "even an empty segment must name a real region"
        );
    }

    #[test]
    fn outside_region() {
        let mut f = Fixture::new();
        for segment in [
            seg(4000, 97, 0),
            seg(4096, 1, 0),
            seg(u64::MAX, 1, 1),
            seg(u64::MAX - 10, 100, 1),
            seg(4097, 0, 0),
        ] {
            f.write_slot(Opcode::Read as u32, 0, 0, &[segment]);
            assert!(
                matches!(f.parse(), Err(RequestError::OutsideRegion { .. })),
                "{segment:?}"
            );
        }
    }

    #[test]
    fn outside_image() {
        let mut f = Fixture::new();
        for (offset, len) in [(IMAGE - 511, 512), (IMAGE, 1), (u64::MAX, 1)] {
            f.write_slot(Opcode::Write as u32, 0, offset, &[seg(0, len, 0)]);
            assert!(
                matches!(f.parse(), Err(RequestError::OutsideImage { .. })),
                "{offset}+{len}"
            );
        }
        for opcode in [Opcode::Discard, Opcode::WriteZeroes] {
            for (offset, len) in [(IMAGE - 1, 2), (u64::MAX, 1), (IMAGE + 1, 0)] {
                f.write_slot(opcode as u32, 0, 0, &[seg(0, 1, 0), seg(offset, len, 0)]);
                assert!(
                    matches!(
                        f.parse(),
                        Err(RequestError::RangeOutsideImage { segment: 1, .. })
                    ),
                    "{opcode:?} {offset}+{len}"
                );
            }
        }
    }

    #[test]
    fn bad_slot_number_is_fatal() {
        let mut f = Fixture::new();
        let err = parse(
            &f.ring.slots(),
            99,
            &f.memory,
            IMAGE,
            &mut f.iovecs,
            &mut f.ranges,
        )
        .unwrap_err();
        assert!(err.is_fatal());
        assert!(!RequestError::UnknownOpcode(9).is_fatal());
    }
}
