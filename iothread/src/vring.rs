//! Completing requests in guest memory. The iothread is the only writer of the used rings of
//! the virtqueues its frontend started on it (`StartQueue`): it writes each request's status
//! byte as the request finishes, and once per batch puts the batch on the used ring, clears
//! the requests in the inflight region, marks what it wrote in a migration's dirty log and
//! signals the guest's call eventfd (at most once per queue and batch, honouring
//! `VIRTIO_RING_F_EVENT_IDX` or the avail ring's `VRING_AVAIL_F_NO_INTERRUPT`).
//!
//! A batch is published in steps around the completion queue's publication
//! ([`UsedRings::record`], then the engine publishes its completions, then
//! [`UsedRings::publish_indices`] and [`UsedRings::finish`]): the used entries are written and
//! the inflight region records the batch first, the frontend's completions become visible
//! next, and only then does the used index in guest memory move. What the batch wrote (read
//! data, status bytes, the used ring) is marked in the dirty log last, after every write it
//! stands for; the frontend waits for that through a control-socket round trip before it lets a
//! ring stop (GET_VRING_BASE), which is when the VMM takes its last look at the log. So whenever the driver has seen a head used and made it
//! available again, the frontend can already see that head's completion (it would otherwise
//! take the head for a driver reusing a request still in flight), and the head's inflight flag
//! is already cleared (the frontend's next mark of it can never be undone by a late clear).
//!
//! Guest memory is shared with the guest and the VMM: every access goes through raw pointers
//! (volatile or atomic), never a reference, into the iothread's own mappings, each checked
//! against the memory table when the queue starts or the table changes. The frontend is not
//! trusted either: heads, queues and status addresses from a slot are checked, and a
//! violation only costs the request's used entry (logged), never an access outside a mapping.

use std::fs::File;
use std::io::Write;
use std::sync::atomic::{AtomicU16, Ordering};

use blkplane_proto::control::{QueueSpec, QUEUE_FLAG_EVENT_IDX};
use blkplane_proto::dirty_log::DirtyLog;
use blkplane_proto::inflight::QueueInflight;
use blkplane_proto::ring::{SlotTable, NO_STATUS};
use log::warn;
use virtio_bindings::virtio_ring::VRING_AVAIL_F_NO_INTERRUPT;

use crate::memory::MemoryTable;
use crate::request::UsedTarget;

/// The most queues one iothread completes for (the frontend numbers them from 0).
pub const MAX_QUEUES: u16 = 1024;
/// Bytes of a used element (`struct virtq_used_elem`: id, len).
const USED_ELEM_SIZE: u32 = 8;

/// Why a queue could not be started.
#[derive(Debug, thiserror::Error)]
pub enum VringError {
    /// The queue index or ring size is out of range.
    #[error("queue {queue} of size {size}: {why}")]
    Geometry {
        /// The queue's index.
        queue: u16,
        /// Its ring size.
        size: u16,
        /// What is wrong.
        why: &'static str,
    },
    /// A ring is not inside one memory region, or misaligned.
    #[error("queue {queue}: the {ring} ring at {addr:#x} is not inside guest memory, aligned")]
    Ring {
        /// The queue's index.
        queue: u16,
        /// `avail` or `used`.
        ring: &'static str,
        /// Its guest-physical address.
        addr: u64,
    },
}

impl VringError {
    /// The errno to answer the frontend with.
    pub fn errno(&self) -> i32 {
        libc::EINVAL
    }
}

/// Where a queue's rings are in this process, valid for the memory table they were resolved
/// against.
#[derive(Clone, Copy)]
struct RingAreas {
    /// `struct virtq_avail`: flags, idx, ring[size], used_event.
    avail: *mut u8,
    /// `struct virtq_used`: flags, idx, ring[size], avail_event.
    used: *mut u8,
}

/// One started queue.
struct Vring {
    spec: QueueSpec,
    /// `None` while the rings lie outside the current memory table: nothing is written.
    areas: Option<RingAreas>,
    next_used: u16,
    /// Whether an interrupt decision has been made since the queue started (the first batch
    /// always signals, as a VMM may have missed one across a restart).
    signalled_once: bool,
    call: Option<File>,
    inflight: QueueInflight,
    /// The batch being collected (capacity: the ring size).
    batch: Vec<Finished>,
    /// The used index before the batch was recorded (for EVENT_IDX).
    batch_start: u16,
}

/// A request on its way to the used ring.
#[derive(Clone, Copy)]
struct Finished {
    head: u16,
    used_len: u32,
    /// Its slot, whose segments are read data to mark when `read_segments` > 0.
    slot: u32,
    read_segments: u32,
    /// Guest-physical address of the status byte written, if one was.
    status_addr: Option<u64>,
}

/// The bytes of the used ring: flags, idx, the elements and avail_event.
fn used_ring_len(size: u16) -> u32 {
    u32::from(size)
        .saturating_mul(USED_ELEM_SIZE)
        .saturating_add(6)
}

/// The bytes of the avail ring: flags, idx, the ring and used_event.
fn avail_ring_len(size: u16) -> u32 {
    u32::from(size).saturating_mul(2).saturating_add(6)
}

impl RingAreas {
    fn resolve(spec: &QueueSpec, memory: &MemoryTable) -> Result<Self, VringError> {
        let ring = |ring, addr: u64, len, align: u64| {
            memory
                .translate(addr, len)
                .filter(|ptr| (*ptr as u64).is_multiple_of(align))
                .ok_or(VringError::Ring {
                    queue: spec.queue,
                    ring,
                    addr,
                })
        };
        Ok(Self {
            avail: ring("avail", spec.avail_addr, avail_ring_len(spec.size), 2)?,
            used: ring("used", spec.used_addr, used_ring_len(spec.size), 4)?,
        })
    }

    /// The u16 at byte `offset` of the avail ring.
    ///
    /// # Safety
    /// `offset + 2` must be at most [`avail_ring_len`] of the ring's size and even.
    unsafe fn avail_u16(&self, offset: u32) -> &AtomicU16 {
        // SAFETY: inside the area `resolve` checked to lie in a mapping, 2-byte aligned (the
        // area is, and the caller passes an even offset). The mapping outlives `self`
        // (re-resolved before the table is replaced). Guest memory is only accessed
        // atomically here, so no reference to plain memory aliases the guest's stores.
        unsafe { AtomicU16::from_ptr(self.avail.add(offset as usize).cast()) }
    }

    /// The u16 at byte `offset` of the used ring.
    ///
    /// # Safety
    /// As [`RingAreas::avail_u16`], for the used ring.
    unsafe fn used_u16(&self, offset: u32) -> &AtomicU16 {
        // SAFETY: as in avail_u16.
        unsafe { AtomicU16::from_ptr(self.used.add(offset as usize).cast()) }
    }
}

impl Vring {
    /// Writes the collected batch's used elements and records the batch in the inflight
    /// region; the used index does not move yet.
    fn record(&mut self) {
        let Some(areas) = self.areas else {
            return;
        };
        let size = self.spec.size;
        self.batch_start = self.next_used;
        let mut index = self.next_used;
        for &Finished {
            head,
            used_len: len,
            ..
        } in &self.batch
        {
            // `index % size` < size, so the element lies inside the used ring checked by
            // `resolve`: offset 4 + 8 × slot + 8 <= used_ring_len(size).
            let slot = u32::from(index.checked_rem(size).unwrap_or(0));
            let offset = slot.saturating_mul(USED_ELEM_SIZE).saturating_add(4);
            // SAFETY: in bounds (above) of a mapped, 4-byte aligned area (the used ring's
            // alignment, checked by `resolve`, and 4 + 8 × slot keeps it); volatile, through a
            // raw pointer: the guest may read it concurrently but only acts on it after the
            // used index store in `commit`. Two u32 stores, as the element is two fields.
            unsafe {
                let ptr = areas.used.add(offset as usize).cast::<u32>();
                ptr.write_volatile(u32::from(head));
                ptr.add(1).write_volatile(len);
            }
            index = index.wrapping_add(1);
        }
        self.inflight
            .record_batch(self.batch.iter().map(|f| f.head), index);
        self.next_used = index;
    }

    /// Moves the used index past the recorded batch.
    fn publish_index(&self) {
        if self.batch.is_empty() {
            return;
        }
        let Some(areas) = self.areas else {
            return;
        };
        // SAFETY: offset 2 (idx) is inside every used ring and even.
        let used_idx = unsafe { areas.used_u16(2) };
        // Release: the elements written in `record` are visible before the index.
        used_idx.store(self.next_used, Ordering::Release);
    }

    /// After the used index moved (and a full fence): marks what the batch wrote in the dirty
    /// log and signals the guest if it wants it.
    fn finish(&mut self, log: Option<&DirtyLog>, slots: &SlotTable, memory: &MemoryTable) {
        if self.batch.is_empty() {
            return;
        }
        if let Some(log) = log {
            for finished in &self.batch {
                if let Some(addr) = finished.status_addr {
                    log.mark(addr, 1);
                }
                for index in 0..finished.read_segments {
                    let Ok(segment) = slots.segment(finished.slot, index) else {
                        break;
                    };
                    if let Some(addr) = memory.guest_address(segment.aux, segment.offset) {
                        log.mark(addr, u64::from(segment.len));
                    }
                }
            }
            if self.areas.is_some() {
                log.mark(
                    self.spec.used_addr,
                    u64::from(used_ring_len(self.spec.size)),
                );
            }
        }
        self.batch.clear();
        let Some(areas) = self.areas else {
            return;
        };
        // The driver's suppression flags are read after the index store (virtio 2.7.10: a
        // full barrier, which the caller issued), or an interrupt it asked for could be
        // missed.
        if self.wants_interrupt(&areas) {
            if let Some(call) = &self.call {
                // A full counter (EAGAIN) means it is signalled already.
                let _ = (&*call).write(&1u64.to_ne_bytes());
            }
        }
    }

    fn wants_interrupt(&mut self, areas: &RingAreas) -> bool {
        if !self.signalled_once {
            self.signalled_once = true;
            return true;
        }
        if self.spec.flags & QUEUE_FLAG_EVENT_IDX != 0 {
            // used_event sits after the avail ring's entries: offset 4 + 2 × size.
            let offset = u32::from(self.spec.size)
                .saturating_mul(2)
                .saturating_add(4);
            // SAFETY: offset + 2 = avail_ring_len(size), even.
            let event = unsafe { areas.avail_u16(offset) }.load(Ordering::Acquire);
            // vring_need_event: the driver asked to be told once the used index passes it.
            let new = self.next_used;
            new.wrapping_sub(event).wrapping_sub(1) < new.wrapping_sub(self.batch_start)
        } else {
            // SAFETY: offset 0 (flags) is inside every avail ring and even.
            let flags = unsafe { areas.avail_u16(0) }.load(Ordering::Acquire);
            u32::from(flags) & VRING_AVAIL_F_NO_INTERRUPT == 0
        }
    }
}

/// The used rings of every queue started on this iothread, and the dirty log.
#[derive(Default)]
pub struct UsedRings {
    queues: Vec<Option<Vring>>,
    log: Option<DirtyLog>,
    /// Requests whose used entry could not be written (logged, rate-limited).
    dropped: u64,
}

impl UsedRings {
    /// Starts completing the requests of a queue: `inflight` is its part of the inflight
    /// region, `call` its call eventfd.
    pub fn start(
        &mut self,
        spec: QueueSpec,
        inflight: QueueInflight,
        call: Option<File>,
        memory: &MemoryTable,
    ) -> Result<(), VringError> {
        let geometry = |why| VringError::Geometry {
            queue: spec.queue,
            size: spec.size,
            why,
        };
        if spec.queue >= MAX_QUEUES {
            return Err(geometry("queue index out of range"));
        }
        if spec.size == 0 || spec.size > spec.inflight_size {
            return Err(geometry(
                "ring size is 0 or larger than the inflight region's",
            ));
        }
        let areas = RingAreas::resolve(&spec, memory)?;
        let mut batch = Vec::new();
        batch
            .try_reserve_exact(usize::from(spec.size))
            .map_err(|_| geometry("cannot allocate the batch"))?;
        let index = usize::from(spec.queue);
        if self.queues.len() <= index {
            self.queues.resize_with(index.saturating_add(1), || None);
        }
        if let Some(entry) = self.queues.get_mut(index) {
            *entry = Some(Vring {
                spec,
                areas: Some(areas),
                next_used: spec.next_used,
                signalled_once: false,
                call,
                inflight,
                batch,
                batch_start: spec.next_used,
            });
        }
        Ok(())
    }

    /// Forgets a queue (its requests are done).
    pub fn stop(&mut self, queue: u16) {
        if let Some(entry) = self.queues.get_mut(usize::from(queue)) {
            *entry = None;
        }
    }

    /// Replaces a queue's call eventfd.
    pub fn set_call(&mut self, queue: u16, call: Option<File>) -> bool {
        match self.queues.get_mut(usize::from(queue)) {
            Some(Some(vring)) => {
                vring.call = call;
                true
            }
            _ => false,
        }
    }

    /// Starts (`Some`) or stops marking the dirty log.
    pub fn set_dirty_log(&mut self, log: Option<DirtyLog>) {
        self.log = log;
    }

    /// Resolves every queue's rings against a new memory table (called as the table is
    /// swapped, with no request in flight). A ring the table no longer holds is not written.
    pub fn remap(&mut self, memory: &MemoryTable) {
        for vring in self.queues.iter_mut().flatten() {
            vring.areas = match RingAreas::resolve(&vring.spec, memory) {
                Ok(areas) => Some(areas),
                Err(e) => {
                    warn!("{e}; its requests are no longer completed in guest memory");
                    None
                }
            };
        }
    }

    /// A request finished with `status`: writes its status byte and adds it to its queue's
    /// batch. `slot` is the ring's slot table, the slot and, for a read, how many of its
    /// segments are data to mark in the dirty log.
    pub fn complete(
        &mut self,
        target: &UsedTarget,
        status: u32,
        slot: (&SlotTable, u32, u32),
        memory: &MemoryTable,
    ) {
        let (_, slot_number, read_segments) = slot;
        let Some(Some(vring)) = self.queues.get_mut(usize::from(target.queue)) else {
            self.dropped = self.dropped.saturating_add(1);
            if self.dropped <= 16 || self.dropped.is_power_of_two() {
                warn!(
                    "slot {slot_number}: queue {} is not started; no used entry ({} so far)",
                    target.queue, self.dropped
                );
            }
            return;
        };
        let mut status_addr = None;
        if let Some((region, offset)) = target.status.filter(|(r, _)| *r != NO_STATUS) {
            match memory.region(region).and_then(|r| r.address(offset, 1)) {
                Some(ptr) => {
                    // Statuses are VIRTIO_BLK_S_* (0..=2): the byte holds them.
                    let byte = u8::try_from(status).unwrap_or(u8::MAX);
                    // SAFETY: one byte inside a mapped region (checked by `address`); volatile
                    // through a raw pointer, as the guest shares the memory.
                    unsafe { ptr.write_volatile(byte) };
                    status_addr = memory.guest_address(region, offset);
                }
                None => warn!(
                    "slot {slot_number}: status byte at region {region} offset {offset:#x} is \
                     outside guest memory"
                ),
            }
        }
        if target.head >= vring.spec.size || vring.batch.len() >= usize::from(vring.spec.size) {
            warn!(
                "slot {slot_number}: head {} does not fit queue {}'s ring; no used entry",
                target.head, target.queue
            );
            return;
        }
        vring.batch.push(Finished {
            head: target.head,
            used_len: target.used_len(status),
            slot: slot_number,
            read_segments,
            status_addr,
        });
    }

    /// First half of publishing: every batch's used entries are written and recorded in the
    /// inflight region. The engine publishes its completions next, then calls
    /// [`UsedRings::commit`].
    pub fn record(&mut self) {
        for vring in self.queues.iter_mut().flatten() {
            if !vring.batch.is_empty() {
                vring.record();
            }
        }
    }

    /// Second: the used indices move.
    pub fn publish_indices(&self) {
        for vring in self.queues.iter().flatten() {
            vring.publish_index();
        }
    }

    /// Last, after a full fence: what each batch wrote is marked in the dirty log (when
    /// logging is on) and each guest that wants it is signalled once.
    pub fn finish(&mut self, slots: &SlotTable, memory: &MemoryTable) {
        let log = self.log.as_ref();
        for vring in self.queues.iter_mut().flatten() {
            vring.finish(log, slots, memory);
        }
    }

    /// The used index queue `queue` goes on from (`None` if it is not started).
    pub fn next_used(&self, queue: u16) -> Option<u16> {
        match self.queues.get(usize::from(queue)) {
            Some(Some(vring)) => Some(vring.next_used),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::tests::memfd;
    use blkplane_proto::control::MemoryRegionSpec;
    use blkplane_proto::inflight::{InflightRegion, Limits};
    use blkplane_proto::ring::{Opcode, Segment, SharedRing, SlotHeader};
    use blkplane_proto::shm::sealed_memfd;
    use std::os::unix::fs::FileExt;
    use std::sync::Arc;
    use virtio_bindings::virtio_blk::{VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK};

    const SIZE: u16 = 8;
    /// Guest-physical layout of the one region (starting at GPA 0x10000).
    const BASE: u64 = 0x10000;
    const AVAIL: u64 = BASE + 0x1000;
    const USED: u64 = BASE + 0x2000;
    const STATUS: u64 = BASE + 0x3000;
    const DATA: u64 = BASE + 0x5000;

    struct Fixture {
        guest: File,
        memory: MemoryTable,
        region: Arc<InflightRegion>,
        ring: SharedRing,
        rings: UsedRings,
        call: File,
    }

    fn eventfd() -> File {
        // SAFETY: plain syscall; the result is checked.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        assert!(fd >= 0);
        // SAFETY: a fresh fd owned by nobody else.
        unsafe { <File as std::os::fd::FromRawFd>::from_raw_fd(fd) }
    }

    fn fixture(event_idx: bool) -> Fixture {
        let guest = memfd(0x10000);
        let memory = MemoryTable::map(
            &[MemoryRegionSpec {
                size: 0x10000,
                mmap_offset: 0,
                guest_addr: BASE,
            }],
            &[guest.try_clone().unwrap()],
        )
        .unwrap();
        let limits = Limits {
            max_queues: 1,
            max_queue_size: SIZE,
        };
        let (region, _file) = InflightRegion::create(1, SIZE, limits).unwrap();
        let region = Arc::new(region);
        let mut tracker = region.queue(0).unwrap();
        tracker.recover(SIZE, 0, 0).unwrap();
        let call = eventfd();
        let mut rings = UsedRings::default();
        let spec = QueueSpec {
            queue: 0,
            size: SIZE,
            flags: if event_idx { QUEUE_FLAG_EVENT_IDX } else { 0 },
            avail_addr: AVAIL,
            used_addr: USED,
            next_used: 0,
            inflight_queue: 0,
            inflight_queues: 1,
            inflight_size: SIZE,
            inflight_offset: 0,
        };
        rings
            .start(spec, tracker, Some(call.try_clone().unwrap()), &memory)
            .unwrap();
        Fixture {
            guest,
            memory,
            region,
            ring: SharedRing::create(u32::from(SIZE), 4).unwrap(),
            rings,
            call,
        }
    }

    impl Fixture {
        fn read_u16(&self, gpa: u64) -> u16 {
            let mut b = [0u8; 2];
            self.guest.read_exact_at(&mut b, gpa - BASE).unwrap();
            u16::from_le_bytes(b)
        }

        fn read_u32(&self, gpa: u64) -> u32 {
            let mut b = [0u8; 4];
            self.guest.read_exact_at(&mut b, gpa - BASE).unwrap();
            u32::from_le_bytes(b)
        }

        fn write_u16(&self, gpa: u64, value: u16) {
            self.guest
                .write_all_at(&value.to_le_bytes(), gpa - BASE)
                .unwrap();
        }

        /// A request of `head` finishing with `status`, its status byte at STATUS + head.
        fn finish(&mut self, head: u16, opcode: Opcode, status: u32) {
            let slot = u32::from(head);
            let header = SlotHeader {
                opcode: opcode as u32,
                queue: 0,
                head,
                status_region: 0,
                status_offset: STATUS - BASE + u64::from(head),
                used_len: 4097,
                segment_count: 1,
                ..Default::default()
            };
            let slots = self.ring.slots();
            slots.set_header(slot, header).unwrap();
            let data = Segment {
                offset: DATA - BASE,
                len: 4096,
                aux: 0,
            };
            slots.set_segment(slot, 0, data).unwrap();
            let target = UsedTarget::from_header(&header);
            let reads = u32::from(opcode == Opcode::Read);
            self.rings
                .complete(&target, status, (&slots, slot, reads), &self.memory);
        }

        fn publish(&mut self) {
            self.rings.record();
            self.rings.publish_indices();
            self.rings.finish(&self.ring.slots(), &self.memory);
        }

        fn interrupts(&self) -> u64 {
            let mut b = [0u8; 8];
            match (&self.call).read(&mut b) {
                Ok(8) => u64::from_ne_bytes(b),
                _ => 0,
            }
        }
    }

    use std::io::Read;

    #[test]
    fn a_batch_goes_on_the_used_ring_once_with_its_statuses() {
        let mut f = fixture(false);
        let q = f.region.queue(0).unwrap();
        let mut marker = f.region.queue(0).unwrap();
        for head in [5, 2, 7] {
            marker.mark(head);
        }
        f.finish(5, Opcode::Read, VIRTIO_BLK_S_OK);
        f.finish(2, Opcode::Write, VIRTIO_BLK_S_IOERR);
        // Nothing is visible before the batch is published.
        assert_eq!(f.read_u16(USED + 2), 0);
        f.publish();
        assert_eq!(f.read_u16(USED + 2), 2);
        assert_eq!((f.read_u32(USED + 4), f.read_u32(USED + 8)), (5, 4097));
        assert_eq!(
            (f.read_u32(USED + 12), f.read_u32(USED + 16)),
            (2, 1),
            "failed: status only"
        );
        let mut status = [0u8; 8];
        f.guest.read_exact_at(&mut status, STATUS - BASE).unwrap();
        assert_eq!((status[5], status[2]), (0, VIRTIO_BLK_S_IOERR as u8));
        // Cleared in the inflight region; 7 is still in flight.
        assert!(!q.is_marked(5) && !q.is_marked(2) && q.is_marked(7));
        assert_eq!(q.repair_last_batch(SIZE, 2), 0, "region and ring agree");
        assert_eq!(f.interrupts(), 1, "the first batch always signals");
        // An empty publish writes nothing and signals nothing.
        f.publish();
        assert_eq!((f.read_u16(USED + 2), f.interrupts()), (2, 0));
        assert_eq!(f.rings.next_used(0), Some(2));
    }

    #[test]
    fn interrupts_follow_the_drivers_suppression() {
        // Without EVENT_IDX: VRING_AVAIL_F_NO_INTERRUPT in the avail ring's flags.
        let mut f = fixture(false);
        f.finish(0, Opcode::Flush, VIRTIO_BLK_S_OK);
        f.publish();
        assert_eq!(f.interrupts(), 1);
        f.write_u16(AVAIL, VRING_AVAIL_F_NO_INTERRUPT as u16);
        f.finish(1, Opcode::Flush, VIRTIO_BLK_S_OK);
        f.publish();
        assert_eq!(f.interrupts(), 0, "suppressed");
        f.write_u16(AVAIL, 0);
        f.finish(2, Opcode::Flush, VIRTIO_BLK_S_OK);
        f.publish();
        assert_eq!(f.interrupts(), 1);

        // With EVENT_IDX: once the used index passes used_event (after the avail ring).
        let mut f = fixture(true);
        let used_event = AVAIL + 4 + 2 * u64::from(SIZE);
        f.finish(0, Opcode::Flush, VIRTIO_BLK_S_OK);
        f.publish();
        assert_eq!(f.interrupts(), 1, "first batch");
        // The driver wants to hear when entry 3 is used (used index passes 3).
        f.write_u16(used_event, 3);
        f.finish(1, Opcode::Flush, VIRTIO_BLK_S_OK);
        f.publish();
        assert_eq!(f.interrupts(), 0, "used index 2 has not passed 3");
        f.finish(2, Opcode::Flush, VIRTIO_BLK_S_OK);
        f.finish(3, Opcode::Flush, VIRTIO_BLK_S_OK);
        f.publish();
        assert_eq!(f.interrupts(), 1, "one interrupt for a batch crossing it");
    }

    #[test]
    fn what_a_batch_wrote_is_marked_in_the_dirty_log() {
        let mut f = fixture(false);
        let log_file = sealed_memfd(c"log", 64).unwrap();
        f.rings
            .set_dirty_log(Some(DirtyLog::new(&log_file, 64, 0).unwrap()));
        f.finish(4, Opcode::Read, VIRTIO_BLK_S_OK);
        f.finish(6, Opcode::Write, VIRTIO_BLK_S_OK);
        f.publish();
        let mut bits = [0u8; 64];
        log_file.read_exact_at(&mut bits, 0).unwrap();
        let marked = |gpa: u64| {
            let page = gpa / 4096;
            bits[(page / 8) as usize] & (1 << (page % 8)) != 0
        };
        assert!(marked(DATA), "read data");
        assert!(marked(STATUS), "status bytes");
        assert!(marked(USED), "used ring");
        assert!(!marked(AVAIL), "the avail ring is only read");
        assert!(!marked(DATA + 4096), "nothing past the read");
    }

    #[test]
    fn hostile_slots_cost_only_their_used_entry() {
        let mut f = fixture(false);
        let slots = f.ring.slots();
        for target in [
            // A queue that was never started.
            UsedTarget {
                queue: 3,
                head: 1,
                ..Default::default()
            },
            // A head outside the ring.
            UsedTarget {
                queue: 0,
                head: SIZE,
                ..Default::default()
            },
            // A status byte outside guest memory: no status, the entry still goes out.
            UsedTarget {
                queue: 0,
                head: 1,
                status: Some((0, 0x10000)),
                used_len: 9,
                answer: false,
            },
            UsedTarget {
                queue: 0,
                head: 2,
                status: Some((7, 0)),
                used_len: 9,
                answer: false,
            },
        ] {
            f.rings
                .complete(&target, VIRTIO_BLK_S_OK, (&slots, 0, 0), &f.memory);
        }
        f.publish();
        assert_eq!(f.read_u16(USED + 2), 2, "heads 1 and 2 only");
        // A ring that does not lie in guest memory is refused when handed over.
        let limits = Limits {
            max_queues: 1,
            max_queue_size: SIZE,
        };
        let (region, _file) = InflightRegion::create(1, SIZE, limits).unwrap();
        let tracker = Arc::new(region).queue(0).unwrap();
        let outside = QueueSpec {
            queue: 1,
            size: SIZE,
            avail_addr: AVAIL,
            used_addr: BASE + 0x10000 - 8,
            inflight_size: SIZE,
            ..Default::default()
        };
        assert!(matches!(
            f.rings.start(outside, tracker, None, &f.memory),
            Err(VringError::Ring { ring: "used", .. })
        ));
    }
}
