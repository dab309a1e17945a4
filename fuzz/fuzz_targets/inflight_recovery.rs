//! Inflight region recovery over region contents a crashed predecessor or a hostile VMM
//! wrote: SET_INFLIGHT_FD's checks and mapping (`InflightRegion::open`), then what a ring
//! start does with it (`vhost_user.rs`'s `track_inflight`: `InflightRegion::queue` and
//! `QueueInflight::recover`), then the worker's tracking of the resubmitted requests
//! (`mark`, `before_used`, `after_used`), then a second recovery as the next process would
//! run it, and a device reset (`forget`).
//!
//! Beyond "no panic", recovery must return a plausible answer — distinct heads inside the
//! ring, no more than the avail ring has outstanding, the avail position after them — and once
//! the worker has completed everything it was told to resubmit, a restarted frontend must find
//! nothing left in flight.
//!
//! Input format: `blkplane_fuzz::inflight`.

#![no_main]

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use blkplane_fuzz::inflight::{self, Input};
use blkplane_proto::inflight::{region_size, InflightRegion, Limits};
use libfuzzer_sys::fuzz_target;

const PAGE: u64 = 4096;
const LIMITS: Limits = Limits {
    max_queues: inflight::MAX_QUEUES,
    max_queue_size: inflight::MAX_QUEUE_SIZE,
};

/// The memfds regions are written into, reused (creating one per run would halve the speed):
/// one sealed as GET_INFLIGHT_FD's are, one without seals. Large enough for the largest
/// region one page into the file, plus a page.
struct Files {
    sealed: File,
    unsealed: File,
}

const FILE_LEN: u64 = 3 * PAGE + inflight::MAX_QUEUES as u64 * 4160;
static ZEROS: [u8; FILE_LEN as usize] = [0; FILE_LEN as usize];

thread_local! {
    static FILES: Files = Files {
        sealed: blkplane_proto::shm::sealed_memfd(c"fuzz-inflight", FILE_LEN).expect("memfd"),
        unsealed: blkplane_fuzz::memfd(c"fuzz-inflight", FILE_LEN).expect("memfd"),
    };
}

fuzz_target!(|data: &[u8]| FILES.with(|files| run(files, &Input::decode(data))));

fn run(files: &Files, input: &Input) {
    let needed = region_size(input.num_queues, input.queue_size);
    let offset = if input.file & inflight::OFFSET != 0 {
        PAGE
    } else {
        0
    };
    let mut mmap_size = needed;
    if input.file & inflight::LARGER != 0 {
        mmap_size += PAGE;
    }
    if input.file & inflight::SHORT != 0 {
        mmap_size -= 1;
    }
    if input.file & inflight::OVERFLOW != 0 {
        mmap_size = u64::MAX;
    }
    let file = if input.file & inflight::UNSEALED != 0 {
        &files.unsealed
    } else {
        &files.sealed
    };
    // Only the first `needed` bytes of the area are ever mapped.
    let area = usize::try_from(needed).unwrap_or(0);
    let start = usize::try_from(offset).unwrap_or(0);
    file.write_all_at(&ZEROS[..start + area], 0)
        .expect("clearing the region");
    let contents = &input.contents[..input.contents.len().min(area)];
    file.write_all_at(contents, offset)
        .expect("writing the region");

    let Ok(region) = InflightRegion::open(
        file,
        mmap_size,
        offset,
        input.num_queues,
        input.queue_size,
        LIMITS,
    ) else {
        return;
    };
    let region = Arc::new(region);
    let Ok(mut tracker) = region.queue(input.queue) else {
        return;
    };
    let Ok(recovered) = tracker.recover(input.ring_size, input.used_idx, input.avail_idx) else {
        return;
    };
    let heads = &recovered.resubmit;
    let outstanding = input.avail_idx.wrapping_sub(input.used_idx);
    assert!(heads.len() <= usize::from(outstanding), "{recovered:?}");
    let mut seen = vec![false; usize::from(input.ring_size)];
    for &head in heads {
        let slot = seen.get_mut(usize::from(head));
        let slot = slot.unwrap_or_else(|| panic!("head {head} outside the ring: {recovered:?}"));
        assert!(!*slot, "head {head} resubmitted twice: {recovered:?}");
        *slot = true;
    }
    match recovered.next_avail {
        Some(next) => assert_eq!(next, input.used_idx.wrapping_add(heads.len() as u16)),
        None => assert!(heads.is_empty()),
    }

    // The worker resubmits each head and the iothread completes it (a batch of one each).
    let mut used = input.used_idx;
    for &head in heads {
        tracker.mark(head);
        used = used.wrapping_add(1);
        tracker.record_batch([head], used);
    }
    // A frontend started after that finds nothing in flight. (It would map the region
    // again; the same mapping reads the same shared memory and costs no mmap per run.)
    let mut next = region.queue(input.queue).expect("the same queue");
    let after = next
        .recover(input.ring_size, used, input.avail_idx)
        .expect("recovery after a clean completion");
    assert!(after.resubmit.is_empty(), "{after:?} after {recovered:?}");
    assert_eq!(after.next_avail, Some(used));

    // RESET_DEVICE: the next start finds a fresh region.
    region.forget();
    let fresh = next
        .recover(input.ring_size, used, input.avail_idx)
        .expect("recovery after a reset");
    assert_eq!(fresh, Default::default());
}
