//! The consuming ends of the shared-memory batch ring over contents a hostile peer wrote.
//!
//! The iothread side does what `engine.rs`'s `take_new_work` / `start` / `apply` do for each
//! slot number the frontend published: open and validate the ring (`SharedRing::open`), pop
//! (`Consumer::pop`), read and validate the slot (`blkplane_iothread::request::parse`), and
//! run it — on a null image (`SlotState::run_null`) or through the slot state machine
//! (`SlotState::begin`, `next_transfer`, `on_transfer`, `on_fsync`, `current_range`,
//! `on_range`) fed with kernel results from the input — then push its completion. The
//! frontend side pops the completions a hostile iothread published (`Consumer::pop`, checked
//! as `worker.rs`'s `finish` checks them) and pushes new submissions against the consumer
//! index the peer wrote (`Producer::push`, `publish`).
//!
//! Input format: `blkplane_fuzz::ring`.

#![no_main]

use std::cell::RefCell;
use std::fs::File;
use std::os::unix::fs::FileExt;

use blkplane_fuzz::ring::{self, Input};
use blkplane_iothread::memory::MemoryTable;
use blkplane_iothread::request::RequestError;
use blkplane_iothread::slot::{FallocateSupport, SlotState, Stage, Step};
use blkplane_proto::control::MemoryRegionSpec;
use blkplane_proto::ring::{Completion, SharedRing, HEADER_SIZE};
use libfuzzer_sys::fuzz_target;
use virtio_bindings::virtio_blk::VIRTIO_BLK_S_IOERR;

/// Operations one request may go through before the harness gives up on it (a result list
/// of EAGAINs would otherwise retry forever, as the kernel could make the engine do).
const MAX_STEPS: usize = 64;

thread_local! {
    /// Guest memory as the iothread maps it (mapping it per run would dominate the run).
    static MEMORY: RefCell<MemoryTable> = RefCell::new(guest_memory());
}

fn guest_memory() -> MemoryTable {
    let len = ring::REGIONS.iter().map(|r| r.0).sum();
    let file = blkplane_fuzz::memfd(c"fuzz-guest", len).expect("memfd");
    let specs: Vec<MemoryRegionSpec> = ring::REGIONS
        .iter()
        .map(|&(size, mmap_offset)| MemoryRegionSpec {
            size,
            mmap_offset,
            guest_addr: 0,
        })
        .collect();
    let files: Vec<File> = specs
        .iter()
        .map(|_| file.try_clone().expect("dup"))
        .collect();
    MemoryTable::map(&specs, &files).expect("map guest memory")
}

fuzz_target!(|data: &[u8]| {
    let input = Input::decode(data);
    MEMORY.with(|memory| run(&memory.borrow(), &input));
});

fn run(memory: &MemoryTable, input: &Input) {
    let frontend = SharedRing::create(input.slot_count, input.segments_per_slot).expect("ring");
    let file = frontend.file();
    let total = frontend.layout().total_size;
    let patch = |header: bool| {
        for &(offset, bytes) in &input.patches {
            let offset = u64::from(offset) % total;
            if (offset < HEADER_SIZE) == header {
                // Sealed against growing: the part past the end is not written.
                let room = usize::try_from(total - offset).unwrap_or(0);
                let bytes = &bytes[..bytes.len().min(room)];
                file.write_all_at(bytes, offset).expect("writing the ring");
            }
        }
    };
    patch(true);
    let Ok(iothread) = SharedRing::open(file.try_clone().expect("dup")) else {
        return;
    };
    let mut submissions = iothread.submission_consumer();
    let mut completions = iothread.completion_producer();
    let mut fe_submissions = frontend.submission_producer();
    let mut fe_completions = frontend.completion_consumer();
    patch(false);

    // The iothread: Engine::new's per-slot state, then take_new_work.
    let slots = iothread.slots();
    let segments = slots.segments_per_slot() as usize;
    let mut states: Vec<SlotState> = (0..slots.count())
        .map(|_| SlotState::new(segments))
        .collect();
    let mut support = FallocateSupport::default();
    let mut results = input.results.iter().copied();
    let null = input.mode & ring::FILE_IMAGE == 0;
    let direct = (input.mode & ring::DIRECT != 0).then_some(4096);
    let _ = (|| -> Result<(), &'static str> {
        while let Some(slot) = submissions.pop().map_err(|_| "submission queue")? {
            let state = usize::try_from(slot)
                .ok()
                .and_then(|index| states.get_mut(index))
                .ok_or("bad slot")?;
            let (iovecs, ranges) = state.buffers().ok_or("slot busy")?;
            let parsed = blkplane_iothread::request::parse(
                &slots,
                slot,
                memory,
                input.image_size,
                iovecs,
                ranges,
            );
            let status = match parsed {
                Ok(request) if null => {
                    // SAFETY: parse just filled the iovecs with ranges inside `memory`'s
                    // mappings, alive for the whole run; nothing else touches them meanwhile.
                    match unsafe { state.run_null(request) } {
                        Step::Complete(status) => Some(status),
                        other => panic!("a null image request did not complete: {other:?}"),
                    }
                }
                Ok(request) => {
                    let step = state.begin(request, &support);
                    drive(state, step, &mut results, &mut support, direct)
                }
                Err(RequestError::Slot(_)) => return Err("slot"),
                Err(_) => Some(VIRTIO_BLK_S_IOERR),
            };
            if let Some(status) = status {
                completions
                    .push(Completion {
                        slot,
                        status,
                        completed_ns: 0,
                    })
                    .map_err(|_| "completion queue full")?;
            }
        }
        Ok(())
    })();
    submissions.release();
    completions.publish();

    // The frontend: reap (worker.rs's reap_completions / finish checks), then submit more.
    let count = frontend.slots().count();
    loop {
        match fe_completions.pop() {
            Ok(Some(completion)) if completion.slot < count => {}
            Ok(Some(_)) | Ok(None) | Err(_) => break,
        }
    }
    fe_completions.release();
    for slot in 0..u32::from(input.pushes) {
        if fe_submissions.push(slot % count).is_err() {
            break;
        }
    }
    fe_submissions.publish();
}

/// Runs a slot's state machine the way the engine does (issue, then feed the CQE result
/// back) until the request completes; the results come from the input, then succeed.
/// `None` when the request is still busy after [`MAX_STEPS`].
fn drive(
    state: &mut SlotState,
    mut step: Step,
    results: &mut impl Iterator<Item = i32>,
    support: &mut FallocateSupport,
    direct: Option<u32>,
) -> Option<u32> {
    for _ in 0..MAX_STEPS {
        step = match step {
            Step::Complete(status) => return Some(status),
            Step::Failed(_) => return Some(VIRTIO_BLK_S_IOERR),
            Step::Issue(Stage::Transfer) => {
                let transfer = state.next_transfer(direct);
                // SAFETY: the transfer's iovecs point into the slot's own buffer, which lives
                // as long as `state` and is not changed until the next call on it.
                let iovecs =
                    unsafe { std::slice::from_raw_parts(transfer.iovecs, transfer.count as usize) };
                let asked: usize = iovecs.iter().map(|iov| iov.iov_len).sum();
                let full = i32::try_from(asked).unwrap_or(i32::MAX);
                state.on_transfer(results.next().unwrap_or(full))
            }
            Step::Issue(Stage::Fsync) => state.on_fsync(results.next().unwrap_or(0)),
            Step::Issue(Stage::Range) => {
                assert!(
                    state.current_range().is_some(),
                    "a range stage without a range"
                );
                state.on_range(results.next().unwrap_or(0), support)
            }
        };
    }
    None
}
