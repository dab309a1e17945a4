//! The virtio-blk request path of a frontend worker over a virtqueue the guest wrote: pop
//! (virtio-queue), walk the chain (`request::collect_chain`), parse it into a ring slot
//! (`request::parse` with the production `SlotSink`), answer GET_ID and rejections in guest
//! memory, and complete on the used ring — the call sequence of `worker.rs`'s
//! `process_queue` / `handle_chain` / `complete_now`. Every accepted request is then read back
//! by the iothread's slot parser (`blkplane_iothread::request::parse`) from a second mapping
//! of the same ring and executed as a null image does (`SlotState::run_null`), and the two
//! sides must agree: whatever the frontend lets through, the iothread must accept as the same
//! request.
//!
//! Input format: `blkplane_fuzz::blk`.

#![no_main]

use std::cell::RefCell;
use std::fs::File;
use std::os::fd::BorrowedFd;
use std::sync::atomic::Ordering;

use blkplane_frontend::config::{CacheMode, DiskConfig};
use blkplane_frontend::memory::{MemoryTable, RegionDescriptor};
use blkplane_frontend::request::{self, ChainError, Rejected, RequestKind, SlotSink};
use blkplane_frontend::vhost_user::used_ring_overlap;
use blkplane_fuzz::blk::{self, Input};
use blkplane_iothread::request::{ImageRange, Request as IoRequest};
use blkplane_iothread::slot::{SlotState, Step};
use blkplane_proto::ring::{SharedRing, SlotTable};
use libfuzzer_sys::fuzz_target;
use virtio_bindings::virtio_blk::{VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK};
use virtio_queue::desc::split::Descriptor;
use virtio_queue::{Queue, QueueOwnedT, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryMmap};

/// What stays across executions: mapping guest memory and the ring is the expensive part.
struct Fixture {
    memory: MemoryTable,
    slots: SlotTable,
    /// The iothread's view: the ring opened from its fd, guest memory mapped from the fds
    /// the frontend would send.
    io_slots: SlotTable,
    io_memory: blkplane_iothread::memory::MemoryTable,
    state: SlotState,
    scratch: Vec<Descriptor>,
    _ring: SharedRing,
    _io_ring: SharedRing,
}

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
        memory,
        slots: ring.slots(),
        io_slots: io_ring.slots(),
        io_memory,
        state: SlotState::new(segments),
        scratch: Vec::with_capacity(usize::from(blk::MAX_RING) + 1024),
        _ring: ring,
        _io_ring: io_ring,
    }
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

/// Did the guest break the ring (the worker stops serving it)?
struct Broken;

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
    let disk = disk(input.flags, input.capacity);

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

    // process_queue: pop everything, re-check after re-enabling notifications. Every request
    // completes at once here, as the worker only completes those it answers itself
    // (rejections, GET_ID, empty transfers): the budget stands in for a guest vCPU that keeps
    // publishing such chains (docs/fuzzing.md, "Findings").
    let _ = process_queue(f, &disk, &mut queue);
}

fn process_queue(f: &mut Fixture, disk: &DiskConfig, queue: &mut Queue) -> Result<(), Broken> {
    let mut budget = 16 * u32::from(blk::MAX_RING);
    loop {
        queue
            .disable_notification(f.memory.guest_memory())
            .map_err(|_| Broken)?;
        loop {
            let head = match queue.iter(f.memory.guest_memory()) {
                Ok(mut chains) => chains.next().map(|chain| chain.head_index()),
                Err(_) => return Err(Broken),
            };
            let Some(head) = head else { break };
            budget = budget.checked_sub(1).ok_or(Broken)?;
            handle_chain(f, disk, queue, head)?;
        }
        match queue.enable_notification(f.memory.guest_memory()) {
            Ok(true) => continue,
            Ok(false) => return Ok(()),
            Err(_) => return Err(Broken),
        }
    }
}

/// worker.rs's handle_chain, for local queue 0 (slot = head), with the iothread inline.
fn handle_chain(
    f: &mut Fixture,
    disk: &DiskConfig,
    queue: &mut Queue,
    head: u16,
) -> Result<(), Broken> {
    let mem = f.memory.guest_memory();
    let size = queue.size();
    if head >= size {
        return Err(Broken);
    }
    let slot = u32::from(head);
    let desc_table = GuestAddress(queue.desc_table());
    match request::collect_chain(mem, desc_table, size, head, &mut f.scratch) {
        Ok(()) => {}
        Err(ChainError::HeadOutOfRange(_)) => return Err(Broken),
        Err(_) => return complete_now(mem, queue, head, None, 0),
    }
    let mut sink = SlotSink::new(&f.slots, slot);
    let request = match request::parse(&f.scratch, &f.memory, disk, &mut sink) {
        Ok(request) => request,
        Err(Rejected { error, status }) => {
            if let Some(addr) = status {
                assert!(
                    mem.address_in_range(addr),
                    "rejection status {addr:?} outside guest memory: {error}"
                );
            }
            let used = u32::from(status.is_some());
            let status = status.map(|addr| (addr, error.status()));
            return complete_now(mem, queue, head, status, used);
        }
    };
    assert!(
        mem.address_in_range(request.status),
        "status outside memory"
    );
    assert!(request.segments <= disk.segments_per_slot());
    // The worker's hand-over: what is answered without the iothread, or the slot header.
    let Some((_, header)) = request.slot_header(disk.writeback()) else {
        if request.kind != RequestKind::GetId {
            let ok = Some((request.status, VIRTIO_BLK_S_OK as u8));
            return complete_now(mem, queue, head, ok, 1);
        }
        let status = match request::write_stream(mem, &f.scratch, &disk.serial) {
            Ok(()) => VIRTIO_BLK_S_OK as u8,
            Err(_) => VIRTIO_BLK_S_IOERR as u8,
        };
        let used = request.used_len();
        return complete_now(mem, queue, head, Some((request.status, status)), used);
    };
    f.slots
        .set_header(slot, header)
        .expect("a parsed request always fits its slot");

    // The iothread: engine.rs's start() on a null image of the disk's size.
    let image_size = disk.capacity_bytes();
    let (iovecs, ranges) = f.state.buffers().expect("slot idle");
    let parsed = blkplane_iothread::request::parse(
        &f.io_slots,
        slot,
        &f.io_memory,
        image_size,
        iovecs,
        ranges,
    );
    let parsed = match parsed {
        Ok(parsed) => parsed,
        Err(e) => panic!("the iothread refuses what the frontend accepted ({request:?}): {e}"),
    };
    check_agreement(&request, &parsed, ranges_of(&mut f.state, &parsed));
    // SAFETY: parse just filled the iovecs with ranges inside io_memory's mappings, which
    // stay mapped for the fixture's life; nothing else touches them during the call.
    let step = unsafe { f.state.run_null(parsed) };
    assert_eq!(step, Step::Complete(VIRTIO_BLK_S_OK));
    let ok = Some((request.status, VIRTIO_BLK_S_OK as u8));
    complete_now(mem, queue, head, ok, request.used_len())
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

/// The frontend's request and the iothread's reading of its slot describe the same I/O.
fn check_agreement(request: &request::Request, parsed: &IoRequest, ranges: Vec<ImageRange>) {
    let segments = request.segments as usize;
    match (request.kind, *parsed) {
        (
            RequestKind::Read { offset },
            IoRequest::Read {
                image_offset,
                len,
                iovecs,
            },
        )
        | (
            RequestKind::Write { offset },
            IoRequest::Write {
                image_offset,
                len,
                iovecs,
                ..
            },
        ) => {
            assert_eq!(offset, image_offset);
            assert_eq!(len, u64::from(request.data_len));
            assert_eq!(iovecs, segments);
        }
        (RequestKind::Flush, IoRequest::Flush) => {}
        (RequestKind::Discard, IoRequest::Discard { ranges: n })
        | (RequestKind::WriteZeroes, IoRequest::WriteZeroes { ranges: n }) => {
            assert_eq!(n, segments);
            let bytes: u64 = ranges.iter().map(|r| r.len).sum();
            assert_eq!(bytes, request.bytes);
        }
        (kind, parsed) => panic!("frontend {kind:?} became {parsed:?} in the iothread"),
    }
}

/// worker.rs's complete_now: status byte, then the used entry.
fn complete_now(
    mem: &GuestMemoryMmap,
    queue: &mut Queue,
    head: u16,
    status: Option<(GuestAddress, u8)>,
    used_len: u32,
) -> Result<(), Broken> {
    if let Some((addr, value)) = status {
        let _ = mem.write_obj(value, addr);
    }
    queue.add_used(mem, head, used_len).map_err(|_| Broken)
}
