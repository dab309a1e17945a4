//! The virtio-blk request path of a frontend worker over a virtqueue the guest wrote, through
//! the worker's own state machine: `QueueCore::process_ring` pops (virtio-queue), walks,
//! validates and parses every chain into a ring slot of a real shared ring, answers GET_ID and
//! rejections as answer slots, marks the inflight region, and publishes the batch — the code
//! the worker runs on a kick, not a copy of it. The fuzz target then plays the iothread: it
//! reads every published slot with the iothread's slot parser
//! (`blkplane_iothread::request::parse`) from a second mapping of the same ring, executes it as
//! a null image does (`SlotState::run_null`), and hands the completion back, which the core
//! must accept. Whatever the frontend lets through, the iothread must accept as the same
//! request; the core must never report a correct iothread as broken; a guest that keeps
//! publishing chains is served a ring's worth per pass. A write bitmap is installed (as
//! blkplaned's TrackWrites does): before the iothread sees a pass's slots, and again after
//! their completions were read, exactly the blocks of the writes, write-zeroes and discards the
//! iothread executed are marked — none of reads, flushes or the core's answers.
//!
//! Input format: `blkplane_fuzz::blk`.

#![no_main]

use std::cell::RefCell;
use std::fs::File;
use std::os::fd::BorrowedFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use blkplane_frontend::config::{CacheMode, DiskConfig};
use blkplane_frontend::memory::{MemoryTable, RegionDescriptor};
use blkplane_frontend::queue_core::{Action, QueueCore, RingEnds};
use blkplane_frontend::stats::DeviceStatus;
use blkplane_frontend::vhost_user::used_ring_overlap;
use blkplane_fuzz::blk::{self, Input};
use blkplane_iothread::request::{ImageRange, Request as IoRequest};
use blkplane_iothread::slot::{SlotState, Step};
use blkplane_proto::inflight::{InflightRegion, Limits};
use blkplane_proto::ring::{Completion, Opcode, SharedRing, NO_STATUS};
use blkplane_proto::write_bitmap::{WriteBitmap, DEFAULT_GRANULARITY};
use libfuzzer_sys::fuzz_target;
use virtio_bindings::virtio_blk::VIRTIO_BLK_S_OK;
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress};

/// What stays across executions: mapping guest memory and the ring is the expensive part.
struct Fixture {
    memory: Arc<MemoryTable>,
    ring: SharedRing,
    /// The iothread's view: the ring opened from its fd, guest memory mapped from the fds
    /// the frontend would send.
    io_ring: SharedRing,
    io_memory: blkplane_iothread::memory::MemoryTable,
    state: SlotState,
    /// The write bitmap, of the first [`BITMAP_CAPACITY`] bytes (marks beyond are clamped).
    bitmap: Arc<WriteBitmap>,
}

/// The capacity the write bitmap covers: 256 words at 64 KiB per bit.
const BITMAP_CAPACITY: u64 = 1 << 30;

fn fixture() -> Fixture {
    let size = blk::REGIONS.iter().map(|r| r.1).sum();
    let file = blkplane_fuzz::memfd(c"fuzz-guest", size).expect("memfd");
    let regions = blk::REGIONS
        .iter()
        .map(|&(guest_base, size, mmap_offset)| {
            let desc = RegionDescriptor {
                guest_base,
                size,
                user_addr: 0x7f00_0000_0000 + guest_base,
                mmap_offset,
            };
            (desc, file.try_clone().expect("dup"))
        })
        .collect();
    let memory = MemoryTable::new(regions).expect("guest memory");
    // Same geometry as a worker serving one queue of the largest ring.
    let disk = disk(0, u64::MAX);
    let ring =
        SharedRing::create(u32::from(blk::MAX_RING), disk.segments_per_slot()).expect("ring");
    let io_ring = SharedRing::open(ring.file().try_clone().expect("dup")).expect("open ring");
    let (specs, fds) = memory.iothread_table();
    let files: Vec<File> = fds
        .iter()
        .map(|&fd| {
            // SAFETY: the fd belongs to `memory`, alive here; it is only duplicated.
            let fd = unsafe { BorrowedFd::borrow_raw(fd) };
            File::from(fd.try_clone_to_owned().expect("dup"))
        })
        .collect();
    let io_memory = blkplane_iothread::memory::MemoryTable::map(&specs, &files).expect("map");
    let segments = io_ring.slots().segments_per_slot() as usize;
    Fixture {
        memory: Arc::new(memory),
        ring,
        io_ring,
        io_memory,
        state: SlotState::new(segments),
        bitmap: Arc::new(
            WriteBitmap::create(BITMAP_CAPACITY, DEFAULT_GRANULARITY).expect("write bitmap"),
        ),
    }
}

/// Takes every word of the bitmap, as blkplaned's copy does.
fn take_all(bitmap: &WriteBitmap) -> Vec<u64> {
    (0..bitmap.words()).map(|i| bitmap.take_word(i)).collect()
}

/// The bitmap words that marking `ranges` (offset, length) would set.
fn expected_marks(bitmap: &WriteBitmap, ranges: &[(u64, u64)]) -> Vec<u64> {
    let mut words = vec![0u64; bitmap.words()];
    for &(offset, len) in ranges {
        if len == 0 {
            continue;
        }
        let first = offset / DEFAULT_GRANULARITY;
        let last = (offset.saturating_add(len - 1) / DEFAULT_GRANULARITY).min(bitmap.blocks() - 1);
        for block in first..=last {
            words[(block / 64) as usize] |= 1 << (block % 64);
        }
    }
    words
}

fn disk(flags: u8, capacity: u64) -> DiskConfig {
    let block = if flags & blk::BLOCK_4K != 0 {
        4096
    } else {
        512
    };
    let cache = if flags & blk::WRITETHROUGH != 0 {
        CacheMode::Writethrough
    } else {
        CacheMode::Writeback
    };
    DiskConfig::new(
        capacity,
        flags & blk::READ_ONLY != 0,
        "fuzz-serial",
        1,
        blk::MAX_RING,
        block,
        cache,
    )
}

thread_local! {
    static FIXTURE: RefCell<Fixture> = RefCell::new(fixture());
}

static ZEROS: [u8; 1 << 16] = [0; 1 << 16];

/// Passes over the ring per input: a guest that keeps chains coming is served a ring's worth
/// each time it is kicked again.
const PASSES: u32 = 16;

fuzz_target!(|data: &[u8]| {
    let input = Input::decode(data);
    FIXTURE.with(|f| run(&mut f.borrow_mut(), &input));
});

fn run(f: &mut Fixture, input: &Input) {
    let mem = f.memory.guest_memory();
    for &(guest, size, _) in &blk::REGIONS {
        let len = usize::try_from(size).unwrap_or(0).min(ZEROS.len());
        mem.write_slice(&ZEROS[..len], GuestAddress(guest))
            .expect("zeroing guest memory");
    }
    for &(addr, bytes) in &input.patches {
        // Patches outside guest memory are simply lost, as a guest cannot write there.
        let _ = mem.write_slice(bytes, GuestAddress(addr));
    }
    let disk = Arc::new(disk(input.flags, input.capacity));

    // As vhost_user.rs's maybe_start sets a ring up.
    let mut queue = Queue::new(blk::MAX_RING).expect("queue");
    queue.try_set_size(input.ring_size).expect("ring size");
    queue
        .try_set_desc_table_address(GuestAddress(blk::DESC_TABLE))
        .expect("desc");
    queue
        .try_set_avail_ring_address(GuestAddress(blk::AVAIL_RING))
        .expect("avail");
    let used_ring = if input.flags & blk::USED_ON_AVAIL != 0 {
        blk::AVAIL_RING
    } else {
        blk::USED_RING
    };
    queue
        .try_set_used_ring_address(GuestAddress(used_ring))
        .expect("used");
    queue.set_event_idx(input.flags & blk::EVENT_IDX != 0);
    queue.set_ready(true);
    if !queue.is_valid(mem) {
        return;
    }
    let overlap = used_ring_overlap(
        GuestAddress(blk::DESC_TABLE),
        GuestAddress(blk::AVAIL_RING),
        GuestAddress(used_ring),
        input.ring_size,
    );
    if overlap.is_some() {
        return;
    }
    queue.set_next_avail(input.next_avail);
    let Ok(used_idx) = queue.used_idx(mem, Ordering::Acquire) else {
        return;
    };
    queue.set_next_used(used_idx.0);

    // As vhost_user.rs's private_inflight: a fresh region at the used index.
    let limits = Limits {
        max_queues: 1,
        max_queue_size: blk::MAX_RING,
    };
    let (region, _file) = InflightRegion::create(1, blk::MAX_RING, limits).expect("region");
    let mut inflight = Arc::new(region).queue(0).expect("inflight queue");
    inflight
        .recover(input.ring_size, used_idx.0, used_idx.0)
        .expect("a fresh region");

    // A fresh ring, as an iothread start makes it.
    f.ring.reset_queues();
    let ends = RingEnds {
        submissions: f.ring.submission_producer(),
        completions: f.ring.completion_consumer(),
        slots: f.ring.slots(),
    };
    let status = Arc::new(DeviceStatus::new(1, 1));
    let mut core = QueueCore::new(
        Arc::clone(&disk),
        status,
        vec![0],
        Arc::clone(&f.memory),
        ends,
    );
    core.start_ring(0, queue, inflight, Vec::new());
    core.set_write_bitmap(Some(Arc::clone(&f.bitmap)));
    take_all(&f.bitmap);
    let mut iothread = Iothread {
        submissions: f.io_ring.submission_consumer(),
        completions: f.io_ring.completion_producer(),
    };
    for _ in 0..PASSES {
        core.process_ring(0, 0);
        core.publish_submissions();
        // Marked before the iothread saw anything; taken, as a copy would.
        let marked = take_all(&f.bitmap);
        let written = iothread.run(f, &core, disk.capacity_bytes());
        let expected = expected_marks(&f.bitmap, &written);
        assert!(
            marked == expected,
            "marked before submission: not the blocks of {written:?}"
        );
        // A correct iothread's completions are always accepted.
        if let Err(e) = core.reap() {
            panic!("the core refused a correct iothread's completions: {e}");
        }
        assert!(
            take_all(&f.bitmap) == expected,
            "marked at completion: not the blocks of {written:?}"
        );
        assert_eq!(core.in_flight(), 0, "every slot handed over came back");
        let mut again = false;
        while let Some(action) = core.next_action() {
            match action {
                Action::RingBroken(_) => return,
                Action::Rekick(_) => again = true,
                Action::ArmThrottleTimer(_) => panic!("no limits are set"),
                Action::ReplaceIothread => panic!("the iothread was correct"),
            }
        }
        if !again {
            return;
        }
    }
}

/// The iothread's side of the shared ring.
struct Iothread {
    submissions: blkplane_proto::ring::Consumer<u32>,
    completions: blkplane_proto::ring::Producer<Completion>,
}

impl Iothread {
    /// Executes every published slot as engine.rs's start() does on a null image of
    /// `image_size` bytes, and publishes the completions; returns the image ranges (offset,
    /// length) the writes, write-zeroes and discards among them change.
    fn run(&mut self, f: &mut Fixture, core: &QueueCore, image_size: u64) -> Vec<(u64, u64)> {
        let mut written = Vec::new();
        let io_slots = f.io_ring.slots();
        while let Some(slot) = self.submissions.pop().expect("the frontend's indices") {
            let header = io_slots.header(slot).expect("a slot of the table");
            let (iovecs, ranges) = f.state.buffers().expect("slot idle");
            let parsed = blkplane_iothread::request::parse(
                &io_slots,
                slot,
                &f.io_memory,
                image_size,
                iovecs,
                ranges,
            );
            let parsed = match parsed {
                Ok(parsed) => parsed,
                Err(e) => {
                    panic!("the iothread refuses what the frontend handed over ({header:?}): {e}")
                }
            };
            let state = *core.slot(slot).expect("a slot of the core");
            assert!(state.in_flight, "slot {slot} published but not in flight");
            if header.status_region != NO_STATUS {
                let status_byte = f
                    .io_memory
                    .region(header.status_region)
                    .and_then(|region| region.address(header.status_offset, 1));
                assert!(
                    status_byte.is_some(),
                    "status byte at {}:{:#x}, outside the iothread's memory",
                    header.status_region,
                    header.status_offset
                );
            }
            let status = match parsed {
                IoRequest::Answer { status } => {
                    assert_eq!(state.opcode, Opcode::Answer);
                    status
                }
                parsed => {
                    let ranges = ranges_of(&mut f.state, &parsed);
                    match parsed {
                        IoRequest::Write {
                            image_offset, len, ..
                        } => written.push((image_offset, len)),
                        IoRequest::Discard { .. } | IoRequest::WriteZeroes { .. } => {
                            written.extend(ranges.iter().map(|r| (r.offset, r.len)));
                        }
                        _ => {}
                    }
                    check_agreement(&state, &header, &parsed, ranges);
                    // SAFETY: parse just filled the iovecs with ranges inside io_memory's
                    // mappings, which stay mapped for the fixture's life; nothing else touches
                    // them during the call.
                    let step = unsafe { f.state.run_null(parsed) };
                    assert_eq!(step, Step::Complete(VIRTIO_BLK_S_OK));
                    VIRTIO_BLK_S_OK
                }
            };
            self.completions
                .push(Completion {
                    slot,
                    status,
                    completed_ns: 0,
                })
                .expect("a completion entry per slot");
        }
        self.submissions.release();
        self.completions.publish();
        written
    }
}

fn ranges_of(state: &mut SlotState, parsed: &IoRequest) -> Vec<ImageRange> {
    let count = match parsed {
        IoRequest::Discard { ranges } | IoRequest::WriteZeroes { ranges } => *ranges,
        _ => 0,
    };
    state
        .buffers()
        .map(|(_, ranges)| ranges.iter().take(count).copied().collect())
        .unwrap_or_default()
}

/// The core's record of a slot, the header it wrote and the iothread's reading of the slot
/// describe the same I/O.
fn check_agreement(
    state: &blkplane_frontend::queue_core::SlotState,
    header: &blkplane_proto::ring::SlotHeader,
    parsed: &IoRequest,
    ranges: Vec<ImageRange>,
) {
    let segments = header.segment_count as usize;
    match (state.opcode, *parsed) {
        (
            Opcode::Read,
            IoRequest::Read {
                image_offset,
                len,
                iovecs,
            },
        )
        | (
            Opcode::Write,
            IoRequest::Write {
                image_offset,
                len,
                iovecs,
                ..
            },
        ) => {
            assert_eq!(header.image_offset, image_offset);
            assert_eq!(len, state.bytes);
            assert_eq!(iovecs, segments);
        }
        (Opcode::Flush, IoRequest::Flush) => {}
        (Opcode::Discard, IoRequest::Discard { ranges: n })
        | (Opcode::WriteZeroes, IoRequest::WriteZeroes { ranges: n }) => {
            assert_eq!(n, segments);
            let bytes: u64 = ranges.iter().map(|r| r.len).sum();
            assert_eq!(bytes, state.bytes);
        }
        (opcode, parsed) => panic!("frontend {opcode:?} became {parsed:?} in the iothread"),
    }
}
