//! The frontend's queue handling as a state machine: the virtqueues one worker serves, their
//! ring slots, inflight marks, I/O limits, dirty-log marks and write-bitmap marks — and no
//! system call.
//!
//! [`QueueCore`] is told what happened ("the guest kicked ring 1", "the throttle timer fired",
//! "the iothread was replaced") and does the work in guest memory and in the shared ring: it
//! pops every available chain, validates and parses each into a ring slot (or an
//! [`Opcode::Answer`] slot for what it answers itself: rejections, GET_ID, transfers of no
//! data), marks it in the inflight region, admits it under the limits, and queues it for the
//! iothread; it reads the iothread's completions to free slots and count them. What needs the
//! kernel — waking the iothread, signalling a ring's error eventfd, kicking itself to come
//! back to a busy ring, arming the throttle timer, replacing the iothread — it asks its event
//! loop for through [`QueueCore::publish_submissions`] and [`QueueCore::next_action`]. The
//! event loop (the worker, worker.rs) owns every descriptor, thread and channel, and stays thin;
//! the unit tests below and the `virtio_blk_request` fuzz target drive this type as the worker
//! does.
//!
//! While blkplaned copies the disk to another node it has the core mark, in a
//! [`WriteBitmap`], every image block a write, write-zeroes or discard may change: before the
//! slot goes to the iothread (or waits for the limits), and again when its completion is read,
//! since the copy may have taken the bit and read the block while the request was in flight.
//! Without a bitmap this costs one test of an `Option` per request and per completion.
//!
//! The chain is walked once, by [`request::collect_chain`]: virtio-queue's iterator over the
//! avail ring reads only the avail entry (its `DescriptorChain` is lazy), and walking that
//! `DescriptorChain` would end silently on a broken chain (a `next` outside the table, a loop,
//! an unreadable descriptor or a bad indirect table all just end the iteration, so a truncated
//! chain would look complete), where the parser needs one named error per rule.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use blkplane_proto::control::{QueueSpec, QUEUE_FLAG_EVENT_IDX};
use blkplane_proto::dirty_log::DirtyLog;
use blkplane_proto::inflight::{InflightRegion, QueueInflight};
use blkplane_proto::ring::{Completion, Consumer, Opcode, Producer, SlotHeader, SlotTable};
use blkplane_proto::ring::{RingError, NO_STATUS};
use blkplane_proto::write_bitmap::WriteBitmap;
use log::{error, info, warn};
use virtio_bindings::virtio_blk::VIRTIO_BLK_S_OK;
use virtio_queue::desc::split::Descriptor;
use virtio_queue::{Queue, QueueOwnedT, QueueT};
use vm_memory::{GuestAddress, GuestMemoryMmap};

use crate::config::DiskConfig;
use crate::memory::MemoryTable;
use crate::rejection::RejectReason;
use crate::request::{self, ChainError, Rejected, RequestKind};
use crate::stats::{DeviceStatus, QueueCounters};
use crate::throttle::{self, DiskThrottle, Throttler};

/// Guest-caused rejections logged at warn level per worker; the rest go to debug.
const LOUD_REJECTIONS: u32 = 20;

/// The worker's ends of its iothread's shared ring; new ones after every iothread start,
/// which resets the queues.
pub struct RingEnds {
    /// Frontend → iothread: slot numbers to execute.
    pub submissions: Producer<u32>,
    /// Iothread → frontend: finished slots.
    pub completions: Consumer<Completion>,
    /// The request slots.
    pub slots: SlotTable,
}

/// Something only the event loop can do, asked for by the core.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// The driver broke this ring (local index): signal its error eventfd and stop watching
    /// its kick. Asked for once per break.
    RingBroken(usize),
    /// This ring had more than one pass's worth of chains: make its kick readable again, so
    /// that it is served again after the worker's commands and other rings.
    Rekick(usize),
    /// Arm the throttle timer for this `CLOCK_MONOTONIC` deadline (ns); when it fires, call
    /// [`QueueCore::release_throttled`].
    ArmThrottleTimer(u64),
    /// The iothread broke the completion queue's rules: replace it
    /// ([`QueueCore::iothread_gone`] and the rest of the restart).
    ReplaceIothread,
}

/// Why the iothread's completions cannot be trusted: it must be replaced.
#[derive(Debug, thiserror::Error)]
pub enum CompletionError {
    /// The completion queue's indices are broken.
    #[error("completion queue: {0}")]
    Queue(#[from] RingError),
    /// A completion for a slot that is not in flight (or still waits for the limits).
    #[error("completion of slot {0}, which is not in flight")]
    NotInFlight(u32),
}

/// The frontend-private state of one ring slot.
#[derive(Debug, Clone, Copy)]
pub struct SlotState {
    /// Handed to the iothread (or waiting for the limits), not yet completed.
    pub in_flight: bool,
    /// The worker-local queue index.
    pub local_queue: u16,
    /// What the iothread was asked to do.
    pub opcode: Opcode,
    /// Bytes the request transfers (or zeroes, or discards).
    pub bytes: u64,
    /// Waiting for the I/O limits: popped and parsed, not yet handed to the iothread.
    pub throttled: bool,
    /// When the pass that took the request off the avail ring began
    /// ([`blkplane_proto::clock::monotonic_ns`]; one clock read per kick, not per request).
    pub popped_ns: u64,
    /// How many iothreads died of a fault of their own while this request was in flight (see
    /// [`QueueCore::resubmit_in_flight`]).
    pub crashes: u8,
}

impl Default for SlotState {
    fn default() -> Self {
        Self {
            in_flight: false,
            local_queue: 0,
            opcode: Opcode::Flush,
            bytes: 0,
            throttled: false,
            popped_ns: 0,
            crashes: 0,
        }
    }
}

/// A ring being served.
struct Ring {
    queue: Queue,
    in_flight: u32,
    broken: bool,
    /// Broken, and the event loop not yet told ([`Action::RingBroken`]).
    break_unreported: bool,
    /// The pass stopped at its budget ([`Action::Rekick`]).
    rekick: bool,
    /// Inflight tracking: marked here when a head is popped, cleared by the iothread when it
    /// is used.
    inflight: QueueInflight,
    /// The used index the iothread went on from when it was handed the ring.
    next_used: u16,
    /// Heads to resubmit before popping anything new (empty once done).
    resubmit: Vec<u16>,
}

/// The queue state of one worker: see the module documentation.
pub struct QueueCore {
    disk: Arc<DiskConfig>,
    /// Counters and status for the admin channel.
    status: Arc<DeviceStatus>,
    /// Device queue index of each local queue.
    queue_ids: Vec<u16>,
    rings: Vec<Option<Ring>>,
    memory: Arc<MemoryTable>,
    ends: RingEnds,
    /// Slot = local queue × queue size + head.
    slots: Vec<SlotState>,
    in_flight: u32,
    /// The chain being parsed; reserved to the queue size so parsing never allocates.
    scratch: Vec<Descriptor>,
    rejections: u32,
    /// Drained: no request is popped until [`QueueCore::resume`].
    paused: bool,
    /// A migration's dirty log while the VMM has logging on: the guest pages the core writes
    /// (GET_ID strings, the used ring's flags and avail_event) are marked in it; the iothread
    /// has it too, for what it writes.
    dirty_log: Option<Arc<DirtyLog>>,
    /// While blkplaned copies the disk to another node: the image blocks requests may write are
    /// marked in it (before they go to the iothread, and again when they complete).
    write_bitmap: Option<Arc<WriteBitmap>>,
    /// The I/O limits and the requests waiting for them.
    throttler: Throttler,
    /// The iothread broke the completion queue's rules.
    iothread_broken: bool,
}

/// Marks a ring's whole used ring (flags, entries, avail_event: at most a few pages) in the
/// dirty log after the core wrote any of it.
fn log_used_ring(log: Option<&DirtyLog>, queue: &Queue) {
    if let Some(log) = log {
        // 2 (flags) + 2 (idx) + 8 per entry + 2 (avail_event).
        let len = u64::from(queue.size()).saturating_mul(8).saturating_add(6);
        log.mark(queue.used_ring(), len);
    }
}

/// Whether a request of `opcode` may change the image: what the write bitmap tracks.
fn writes_image(opcode: Opcode) -> bool {
    matches!(
        opcode,
        Opcode::Write | Opcode::WriteZeroes | Opcode::Discard
    )
}

/// Marks in `bitmap` every image block the request in `slot` of `slots` may change (`bytes`
/// at the header's image offset for a Write, each range segment for a Discard or WriteZeroes);
/// nothing for the other opcodes. The slot was filled by this core; the ranges lie within the
/// capacity the parser checked (the bitmap clamps anything else).
fn mark_written(bitmap: &WriteBitmap, slots: &SlotTable, slot: u32, opcode: Opcode, bytes: u64) {
    match opcode {
        Opcode::Write => {
            if let Ok(header) = slots.header(slot) {
                bitmap.mark(header.image_offset, bytes);
            }
        }
        Opcode::Discard | Opcode::WriteZeroes => {
            let count = slots.header(slot).map_or(0, |header| header.segment_count);
            for index in 0..count.min(slots.segments_per_slot()) {
                if let Ok(range) = slots.segment(slot, index) {
                    bitmap.mark(range.offset, u64::from(range.len));
                }
            }
        }
        Opcode::Read | Opcode::Flush | Opcode::Answer => {}
    }
}

/// Takes the next available head off the avail ring. An avail index more than a queue size
/// ahead of ours is the driver breaking the ring, reported as an error.
fn next_head(queue: &mut Queue, mem: &GuestMemoryMmap) -> Result<Option<u16>, virtio_queue::Error> {
    Ok(queue.iter(mem)?.next().map(|chain| chain.head_index()))
}

/// A local queue index as the iothread and the slot state name it (below the worker's queue
/// count, a u16).
fn local16(local: usize) -> u16 {
    u16::try_from(local).unwrap_or(u16::MAX)
}

impl QueueCore {
    /// A core serving the device queues `queue_ids` of `disk` (none started yet) through the
    /// shared ring behind `ends`, whose slot count it sizes its state to.
    pub fn new(
        disk: Arc<DiskConfig>,
        status: Arc<DeviceStatus>,
        queue_ids: Vec<u16>,
        memory: Arc<MemoryTable>,
        ends: RingEnds,
    ) -> Self {
        let slot_count = ends.slots.count() as usize;
        let scratch = Vec::with_capacity(
            usize::from(disk.queue_size)
                .saturating_add(usize::from(request::MAX_INDIRECT_DESCRIPTORS)),
        );
        Self {
            rings: queue_ids.iter().map(|_| None).collect(),
            queue_ids,
            memory,
            ends,
            slots: vec![SlotState::default(); slot_count],
            in_flight: 0,
            scratch,
            rejections: 0,
            paused: false,
            dirty_log: None,
            write_bitmap: None,
            throttler: Throttler::new(slot_count),
            iothread_broken: false,
            disk,
            status,
        }
    }

    /// Requests handed to the iothread or waiting for the limits.
    pub fn in_flight(&self) -> u32 {
        self.in_flight
    }

    /// Whether the ring `local` has no request in flight (or is not running).
    pub fn ring_idle(&self, local: usize) -> bool {
        self.rings
            .get(local)
            .and_then(Option::as_ref)
            .is_none_or(|ring| ring.in_flight == 0)
    }

    /// The number of local queues.
    pub fn queue_count(&self) -> usize {
        self.rings.len()
    }

    /// The local index of device queue `queue`, if this core serves it.
    pub fn local_index(&self, queue: u16) -> Option<usize> {
        self.queue_ids.iter().position(|&q| q == queue)
    }

    /// Whether the ring `local` is running and not broken (its kick is worth watching).
    pub fn is_served(&self, local: usize) -> bool {
        matches!(self.rings.get(local), Some(Some(ring)) if !ring.broken)
    }

    /// A slot's state (for the tests and the fuzz target).
    pub fn slot(&self, slot: u32) -> Option<&SlotState> {
        self.slots.get(slot as usize)
    }

    /// The guest memory the rings and requests are read in.
    pub fn memory(&self) -> &Arc<MemoryTable> {
        &self.memory
    }

    /// Adopts a new memory table; the caller waited until nothing is in flight and the
    /// iothread took the table.
    pub fn set_memory(&mut self, memory: Arc<MemoryTable>) {
        self.memory = memory;
    }

    /// Adopts the ends of a freshly started iothread's ring.
    pub fn attach(&mut self, ends: RingEnds) {
        self.ends = ends;
    }

    /// Starts (marks) or stops (`None`) marking the dirty log.
    pub fn set_dirty_log(&mut self, log: Option<Arc<DirtyLog>>) {
        self.dirty_log = log;
    }

    /// The dirty log in force.
    pub fn dirty_log(&self) -> Option<&Arc<DirtyLog>> {
        self.dirty_log.as_ref()
    }

    /// Starts (`Some`) or stops (`None`) marking the image blocks requests may write. A new
    /// bitmap gets the blocks of every write, write-zeroes and discard in flight (waiting for
    /// the limits included) at once: when this returns, every write that may still change the
    /// image is marked, and will be again when it completes.
    pub fn set_write_bitmap(&mut self, bitmap: Option<Arc<WriteBitmap>>) {
        if let Some(bitmap) = &bitmap {
            for (slot, state) in (0u32..).zip(self.slots.iter()) {
                if state.in_flight && writes_image(state.opcode) {
                    mark_written(bitmap, &self.ends.slots, slot, state.opcode, state.bytes);
                }
            }
        }
        self.write_bitmap = bitmap;
    }

    /// The write bitmap in force.
    pub fn write_bitmap(&self) -> Option<&Arc<WriteBitmap>> {
        self.write_bitmap.as_ref()
    }

    /// Whether the core is drained ([`QueueCore::pause`]).
    pub fn paused(&self) -> bool {
        self.paused
    }

    /// Stops popping requests (they stay in the avail rings) until [`QueueCore::resume`].
    pub fn pause(&mut self) {
        self.paused = true;
    }

    /// Serves again after a pause, reading every ring (kicks that came while paused were
    /// consumed without popping). Nothing happens when not paused.
    pub fn resume(&mut self, now_ns: u64) {
        if std::mem::take(&mut self.paused) {
            self.process_all(now_ns);
        }
    }

    /// Starts serving ring `local`: `queue` set up and validated by the vhost-user thread,
    /// `inflight` its part of the inflight region, `resubmit` the heads a crashed predecessor
    /// had in flight. The caller then hands the ring to the iothread and calls
    /// [`QueueCore::process_ring`] (the driver may have queued requests already).
    pub fn start_ring(
        &mut self,
        local: usize,
        queue: Queue,
        inflight: QueueInflight,
        resubmit: Vec<u16>,
    ) {
        let next_used = queue.next_used();
        if let Some(entry) = self.rings.get_mut(local) {
            *entry = Some(Ring {
                queue,
                in_flight: 0,
                broken: false,
                break_unreported: false,
                rekick: false,
                inflight,
                next_used,
                resubmit,
            });
        }
        self.set_queue_flags(local, true, false);
    }

    /// Forgets ring `local` (the caller waited until it is idle); returns its next avail
    /// index, or `None` if it was not running.
    pub fn remove_ring(&mut self, local: usize) -> Option<u16> {
        let ring = self.rings.get_mut(local)?.take()?;
        self.set_queue_flags(local, false, false);
        Some(ring.queue.next_avail())
    }

    /// Ring `local` as the iothread is handed it, and the inflight region its heads are marked
    /// in; `None` if it is not running.
    pub fn ring_handover(&self, local: usize) -> Option<(QueueSpec, &Arc<InflightRegion>)> {
        let ring = self.rings.get(local)?.as_ref()?;
        let spec = QueueSpec {
            queue: local16(local),
            size: ring.queue.size(),
            flags: if ring.queue.event_idx_enabled() {
                QUEUE_FLAG_EVENT_IDX
            } else {
                0
            },
            avail_addr: ring.queue.avail_ring(),
            used_addr: ring.queue.used_ring(),
            next_used: ring.next_used,
            inflight_queue: ring.inflight.queue_index(),
            ..QueueSpec::default()
        };
        Some((spec, ring.inflight.region()))
    }

    /// Whether an avail ring has an entry not popped yet (one look at guest memory each; what
    /// a polling event loop spins on).
    pub fn avail_pending(&self) -> bool {
        if self.paused {
            return false;
        }
        let mem = self.memory.guest_memory();
        self.rings.iter().flatten().any(|ring| {
            !ring.broken
                && ring
                    .queue
                    .avail_idx(mem, Ordering::Acquire)
                    .is_ok_and(|idx| idx.0 != ring.queue.next_avail())
        })
    }

    /// The next thing the event loop must do, until `None`.
    pub fn next_action(&mut self) -> Option<Action> {
        if std::mem::take(&mut self.iothread_broken) {
            return Some(Action::ReplaceIothread);
        }
        if let Some(deadline) = self.throttler.take_timer_request() {
            return Some(Action::ArmThrottleTimer(deadline));
        }
        for (local, ring) in self.rings.iter_mut().enumerate() {
            let Some(ring) = ring else { continue };
            if std::mem::take(&mut ring.break_unreported) {
                return Some(Action::RingBroken(local));
            }
            if std::mem::take(&mut ring.rekick) {
                return Some(Action::Rekick(local));
            }
        }
        None
    }

    /// The throttle timer could not be armed ([`Action::ArmThrottleTimer`]).
    pub fn throttle_timer_not_armed(&mut self) {
        self.throttler.timer_not_armed();
    }

    /// Publishes the slots queued since the last call; `true` if the iothread sleeps and must
    /// be woken.
    pub fn publish_submissions(&mut self) -> bool {
        self.ends.submissions.unpublished() > 0 && self.ends.submissions.publish()
    }

    /// Hands back what [`QueueCore::reap`] read, and says whether the iothread should write
    /// the completion eventfd when it publishes more: `true` (sleep now) unless completions
    /// arrived meanwhile. Call [`QueueCore::woke_up`] after the sleep.
    pub fn prepare_to_wait_for_completions(&mut self) -> bool {
        self.ends.completions.prepare_to_sleep()
    }

    /// The sleep [`QueueCore::prepare_to_wait_for_completions`] allowed is over.
    pub fn woke_up(&mut self) {
        self.ends.completions.woke_up();
    }

    /// Hands back the completion entries read so far (the iothread may reuse them).
    pub fn release_completions(&mut self) {
        self.ends.completions.release();
    }

    /// Pops and handles every chain available on ring `local` at `now_ns`, re-checking after
    /// re-enabling notifications so that no request slips between the last pop and the
    /// re-enable. One pass pops at most a ring's worth ([`Action::Rekick`] for the rest).
    pub fn process_ring(&mut self, local: usize, now_ns: u64) {
        // Drained: the requests stay in the avail ring; resume reads every ring again.
        if self.paused {
            return;
        }
        let memory = Arc::clone(&self.memory);
        let mem = memory.guest_memory();
        self.resubmit_inflight(local, &memory, now_ns);
        loop {
            let Some(Some(ring)) = self.rings.get_mut(local) else {
                return;
            };
            if ring.broken {
                return;
            }
            if let Err(e) = ring.queue.disable_notification(mem) {
                return self.break_ring(local, &e.to_string());
            }
            log_used_ring(self.dirty_log.as_deref(), &ring.queue);
            // A guest that keeps publishing chains rejected on the spot must not keep this
            // worker from its commands (stop, drain) and its other queues.
            let mut budget = ring.queue.size();
            loop {
                let Some(Some(ring)) = self.rings.get_mut(local) else {
                    return;
                };
                if budget == 0 {
                    ring.rekick = true;
                    return;
                }
                budget = budget.saturating_sub(1);
                let head = match next_head(&mut ring.queue, mem) {
                    Ok(Some(head)) => head,
                    Ok(None) => break,
                    Err(e) => return self.break_ring(local, &e.to_string()),
                };
                self.handle_chain(local, head, &memory, now_ns);
                if self.ring_broken(local) {
                    return;
                }
            }
            let Some(Some(ring)) = self.rings.get_mut(local) else {
                return;
            };
            let enabled = ring.queue.enable_notification(mem);
            log_used_ring(self.dirty_log.as_deref(), &ring.queue);
            match enabled {
                Ok(true) => continue,
                Ok(false) => return,
                Err(e) => return self.break_ring(local, &e.to_string()),
            }
        }
    }

    /// [`QueueCore::process_ring`] for every ring (an empty one costs a look at its avail
    /// index).
    pub fn process_all(&mut self, now_ns: u64) {
        for local in 0..self.rings.len() {
            self.process_ring(local, now_ns);
        }
    }

    fn ring_broken(&self, local: usize) -> bool {
        matches!(self.rings.get(local), Some(Some(ring)) if ring.broken)
    }

    /// Handles the heads a crashed predecessor had in flight (once, on the first look at the
    /// ring), before anything new is popped: their avail entries were consumed already, and
    /// reads and writes are idempotent, so running them again is what completes them.
    fn resubmit_inflight(&mut self, local: usize, memory: &MemoryTable, now_ns: u64) {
        let Some(Some(ring)) = self.rings.get_mut(local) else {
            return;
        };
        if ring.resubmit.is_empty() {
            return;
        }
        let heads = std::mem::take(&mut ring.resubmit);
        let queue = self.queue_ids.get(local).copied().unwrap_or(u16::MAX);
        info!(
            "queue {queue}: resubmitting {} requests in flight before the reconnect",
            heads.len()
        );
        for head in heads {
            self.handle_chain(local, head, memory, now_ns);
            if self.ring_broken(local) {
                return;
            }
        }
    }

    fn counters(&self, local: usize) -> Option<&QueueCounters> {
        self.queue_ids
            .get(local)
            .and_then(|&queue| self.status.queue(queue))
    }

    fn set_queue_flags(&self, local: usize, running: bool, broken: bool) {
        if let Some(counters) = self.counters(local) {
            counters.running.store(running, Ordering::Relaxed);
            counters.broken.store(broken, Ordering::Relaxed);
        }
    }

    fn handle_chain(&mut self, local: usize, head: u16, memory: &MemoryTable, now_ns: u64) {
        let mem = memory.guest_memory();
        let Some(Some(ring)) = self.rings.get(local) else {
            return;
        };
        let desc_table = GuestAddress(ring.queue.desc_table());
        let size = ring.queue.size();
        if head >= size {
            // Not a chain we can return: the guest breaks the ring.
            return self.break_ring(local, "avail ring names a head outside the table");
        }
        // Checked before anything completes the head: completing it would return the chain
        // that is still in flight. The iothread completes concurrently, and publishes a
        // completion before the used index that lets the driver reuse the head: a head that
        // looks in flight is looked up again after reading the completions published since.
        let Some(slot) = u32::try_from(local)
            .ok()
            .and_then(|local| local.checked_mul(u32::from(self.disk.queue_size)))
            .and_then(|first| first.checked_add(u32::from(head)))
        else {
            return self.break_ring(local, "avail ring names a head outside the table");
        };
        let busy = |core: &Self| core.slots.get(slot as usize).is_none_or(|s| s.in_flight);
        if busy(self) && self.reap().is_err() {
            self.iothread_broken = true;
        }
        if busy(self) {
            return self.break_ring(local, "driver made an in-flight head available again");
        }
        // From here on every path ends in a slot for the iothread, which puts the head on the
        // used ring; until then a crash leaves the head marked and the next process
        // resubmits it.
        if let Some(Some(ring)) = self.rings.get_mut(local) {
            ring.inflight.mark(head);
        }
        match request::collect_chain(mem, desc_table, size, head, &mut self.scratch) {
            Ok(()) => {}
            Err(ChainError::HeadOutOfRange(_)) => {
                return self.break_ring(local, "avail ring names a head outside the table");
            }
            Err(e) => {
                self.note_rejection(local, e.reason(), &e.to_string(), false);
                return self.answer(local, slot, head, None, 0, memory);
            }
        }
        let mut sink = request::SlotSink::new(&self.ends.slots, slot);
        let parsed = request::parse(&self.scratch, memory, &self.disk, &mut sink);
        let request = match parsed {
            Ok(request) => request,
            Err(Rejected { error, status }) => {
                self.note_rejection(local, error.reason(), &error.to_string(), status.is_some());
                let used = u32::from(status.is_some());
                let status = status.map(|addr| (addr, error.status()));
                return self.answer(local, slot, head, status, used, memory);
            }
        };
        let Some((opcode, mut header)) = request.slot_header(self.disk.writeback()) else {
            // GET_ID and reads or writes of no data are answered here, without I/O.
            if request.kind != RequestKind::GetId {
                if let Some(counters) = self.counters(local) {
                    counters.answered(true);
                }
                let ok = Some((request.status, request::STATUS_OK));
                return self.answer(local, slot, head, ok, 1, memory);
            }
            let status = match request::write_stream(mem, &self.scratch, &self.disk.serial) {
                Ok(()) => request::STATUS_OK,
                Err(_) => request::STATUS_IOERR,
            };
            // Marked after the write; the iothread marks the status byte and the used ring.
            if let Some(log) = &self.dirty_log {
                for d in self.scratch.iter().filter(|d| d.is_write_only()) {
                    log.mark(d.addr().0, u64::from(d.len()));
                }
            }
            let used = request.used_len();
            if let Some(counters) = self.counters(local) {
                counters.answered(u32::from(status) == VIRTIO_BLK_S_OK);
            }
            return self.answer(
                local,
                slot,
                head,
                Some((request.status, status)),
                used,
                memory,
            );
        };
        // The parser checked that the status byte lies in guest memory.
        let (status_region, status_offset) =
            memory.locate(request.status).unwrap_or((NO_STATUS, 0));
        header.queue = local16(local);
        header.head = head;
        header.status_region = status_region;
        header.status_offset = status_offset;
        header.used_len = request.used_len();
        // Reads and writes within the I/O limits go now; the rest wait, slot filled, until
        // the throttle timer lets them go (a test of `None` when there are no limits).
        let throttled = self.throttler.is_active()
            && throttle::direction(opcode).is_some_and(|dir| {
                !self
                    .throttler
                    .admit_or_queue(dir, slot, request.bytes, now_ns)
            });
        let pushed = self.ends.slots.set_header(slot, header).and_then(|()| {
            // Marked before the iothread can see the slot: the copy then reads the block
            // again after taking the bit, whenever the write lands.
            if let Some(bitmap) = &self.write_bitmap {
                mark_written(bitmap, &self.ends.slots, slot, opcode, request.bytes);
            }
            if throttled {
                Ok(())
            } else {
                self.ends.submissions.push(slot)
            }
        });
        if let Err(e) = pushed {
            // Cannot happen while every slot has a queue entry reserved.
            error!("cannot submit slot {slot}: {e}");
            return self.break_ring(local, "its request could not be submitted");
        }
        self.track(
            slot,
            SlotState {
                in_flight: true,
                local_queue: local16(local),
                opcode,
                bytes: request.bytes,
                throttled,
                popped_ns: now_ns,
                crashes: 0,
            },
        );
    }

    /// Records a slot handed to the iothread (or waiting for the limits) as in flight.
    fn track(&mut self, slot: u32, state: SlotState) {
        let local = usize::from(state.local_queue);
        if let Some(entry) = self.slots.get_mut(slot as usize) {
            *entry = state;
        }
        if let Some(counters) = self.counters(local) {
            counters.submitted();
        }
        // At most one per slot: neither count can overflow.
        if let Some(Some(ring)) = self.rings.get_mut(local) {
            ring.in_flight = ring.in_flight.saturating_add(1);
        }
        self.in_flight = self.in_flight.saturating_add(1);
    }

    fn note_rejection(&mut self, local: usize, reason: RejectReason, why: &str, with_status: bool) {
        if let Some(counters) = self.counters(local) {
            counters.rejected(reason, with_status);
        }
        self.rejections = self.rejections.saturating_add(1);
        let queue = self.queue_ids.get(local).copied().unwrap_or(u16::MAX);
        let reason = reason.name();
        if self.rejections <= LOUD_REJECTIONS {
            warn!("queue {queue}: rejected request ({reason}): {why}");
        } else {
            log::debug!("queue {queue}: rejected request ({reason}): {why}");
        }
    }

    /// Completes a chain without I/O: hands the iothread an answer slot with the status to
    /// write (if the chain has a status byte) and the used length, so the iothread stays the
    /// only writer of the used ring.
    fn answer(
        &mut self,
        local: usize,
        slot: u32,
        head: u16,
        status: Option<(GuestAddress, u8)>,
        used_len: u32,
        memory: &MemoryTable,
    ) {
        let located = status.and_then(|(addr, value)| Some((memory.locate(addr)?, value)));
        let ((status_region, status_offset), value) =
            located.unwrap_or(((NO_STATUS, 0), request::STATUS_IOERR));
        let pushed = self.submit_answer(
            slot,
            local16(local),
            head,
            (status_region, status_offset),
            used_len,
            value,
        );
        if let Err(e) = pushed {
            error!("cannot submit answer slot {slot}: {e}");
            return self.break_ring(local, "its answer could not be submitted");
        }
        self.track(
            slot,
            SlotState {
                in_flight: true,
                local_queue: local16(local),
                opcode: Opcode::Answer,
                bytes: 0,
                throttled: false,
                popped_ns: 0,
                crashes: 0,
            },
        );
    }

    /// Marks a ring broken (the guest violated the ring protocol): it is no longer served,
    /// the event loop is asked to signal its error eventfd, and every other ring and disk
    /// carries on.
    pub fn break_ring(&mut self, local: usize, why: &str) {
        let queue = self.queue_ids.get(local).copied().unwrap_or(u16::MAX);
        let Some(Some(ring)) = self.rings.get_mut(local) else {
            return;
        };
        if ring.broken {
            return;
        }
        error!("queue {queue}: ring broken by the driver, no longer served until reset: {why}");
        ring.broken = true;
        ring.break_unreported = true;
        if let Some(counters) = self.counters(local) {
            counters.broken.store(true, Ordering::Relaxed);
        }
    }

    /// Reads every completion the iothread has published and hands the entries back. An
    /// error means the iothread broke the ring protocol and must be replaced.
    pub fn reap(&mut self) -> Result<(), CompletionError> {
        let mut result = Ok(());
        loop {
            match self.ends.completions.pop() {
                Ok(Some(completion)) => {
                    if let Err(e) = self.finish(completion) {
                        result = Err(e);
                        break;
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    result = Err(CompletionError::Queue(e));
                    break;
                }
            }
        }
        self.ends.completions.release();
        if let Err(e) = &result {
            error!("the iothread broke the completion queue: {e}");
        }
        result
    }

    /// A slot the iothread completed (its used entry is written): free it and count it.
    fn finish(&mut self, completion: Completion) -> Result<(), CompletionError> {
        let state = self
            .slots
            .get_mut(completion.slot as usize)
            .filter(|s| s.in_flight && !s.throttled)
            .ok_or(CompletionError::NotInFlight(completion.slot))?;
        state.in_flight = false;
        let state = *state;
        // This slot was in flight, so the count is at least 1.
        self.in_flight = self.in_flight.saturating_sub(1);
        let local = usize::from(state.local_queue);
        if let Some(Some(ring)) = self.rings.get_mut(local) {
            ring.in_flight = ring.in_flight.saturating_sub(1);
        }
        // The core's own answers were counted when they were decided.
        if state.opcode == Opcode::Answer {
            return Ok(());
        }
        // Marked again once the write is done: the copy may have taken the bit and read the
        // block while it was in flight.
        if let Some(bitmap) = &self.write_bitmap {
            mark_written(
                bitmap,
                &self.ends.slots,
                completion.slot,
                state.opcode,
                state.bytes,
            );
        }
        if let Some(counters) = self.counters(local) {
            let ok = completion.status == VIRTIO_BLK_S_OK;
            let latency =
                Duration::from_nanos(completion.completed_ns.saturating_sub(state.popped_ns));
            counters.completed(state.opcode, state.bytes, ok, latency);
        }
        Ok(())
    }

    /// Replaces the I/O limits at `now_ns` (`None`: none); requests waiting for the old ones
    /// are judged by the new ones at once.
    pub fn set_throttle(&mut self, limits: Option<Arc<DiskThrottle>>, now_ns: u64) {
        self.throttler.set(limits);
        self.release_throttled(now_ns);
    }

    /// Queues for the iothread every throttled request the limits let go at `now_ns` (in
    /// order per direction); the timer is asked for the rest.
    pub fn release_throttled(&mut self, now_ns: u64) {
        self.submit_throttled(false, now_ns);
    }

    /// Queues every throttled request, limits or not: a stop, drain or memory change waits
    /// for them (as QEMU lifts its limits during a drain).
    pub fn release_all_throttled(&mut self, now_ns: u64) {
        self.submit_throttled(true, now_ns);
    }

    fn submit_throttled(&mut self, all: bool, now_ns: u64) {
        let Self {
            throttler,
            slots,
            ends,
            status,
            queue_ids,
            ..
        } = self;
        let submit = |slot: u32, waited_ns: u64| {
            let Some(state) = slots.get_mut(slot as usize) else {
                return;
            };
            state.throttled = false;
            if let Some(counters) = queue_ids
                .get(usize::from(state.local_queue))
                .and_then(|&q| status.queue(q))
            {
                counters.throttled(waited_ns);
            }
            // Cannot fail: every slot has a submission entry reserved.
            if let Err(e) = ends.submissions.push(slot) {
                error!("cannot submit throttled slot {slot}: {e}");
            }
        };
        if all {
            throttler.release_all(now_ns, submit);
        } else {
            throttler.release(now_ns, submit);
        }
    }

    /// After the iothread died and was reaped (its completions read): per running ring, the
    /// used index in guest memory is where its successor goes on, the last batch is repaired,
    /// and every slot whose head is marked in the inflight region (but for heads a predecessor
    /// process left, which wait in `resubmit` to be parsed again) is in flight — even if its
    /// completion was read (published just before the used index would have moved).
    pub fn iothread_gone(&mut self) {
        let memory = Arc::clone(&self.memory);
        let mem = memory.guest_memory();
        let queue_size = u32::from(self.disk.queue_size);
        let mut in_flight = 0u32;
        for (local, entry) in (0u32..).zip(self.rings.iter_mut()) {
            let Some(ring) = entry else {
                continue;
            };
            let used = ring
                .queue
                .used_idx(mem, Ordering::Acquire)
                .map_or(ring.next_used, |used| used.0);
            let size = ring.queue.size();
            let repaired = ring.inflight.repair_last_batch(size, used);
            if repaired > 0 {
                info!(
                    "queue {local}: {repaired} requests the iothread had not put on the used \
                     ring are in flight again"
                );
            }
            ring.next_used = used;
            ring.in_flight = 0;
            for head in 0..size {
                let slot = local
                    .checked_mul(queue_size)
                    .and_then(|first| first.checked_add(u32::from(head)));
                let Some(state) = slot.and_then(|slot| self.slots.get_mut(slot as usize)) else {
                    continue;
                };
                if ring.inflight.is_marked(head) && !ring.resubmit.contains(&head) {
                    if !state.in_flight {
                        // Read as completed, but its used entry never reached the ring.
                        state.in_flight = true;
                    }
                } else if state.in_flight && !state.throttled {
                    warn!(
                        "queue {local}: head {head} in flight but not marked in the inflight \
                         region; resubmitted"
                    );
                }
                if state.in_flight {
                    ring.in_flight = ring.in_flight.saturating_add(1);
                }
            }
            in_flight = in_flight.saturating_add(ring.in_flight);
        }
        self.in_flight = in_flight;
    }

    /// Queues for a new iothread (its ring ends attached, its rings handed over) every slot in
    /// flight but for those waiting for the limits.
    ///
    /// `crashed`: the iothread before it died of a fault of its own (a crash signal, not a
    /// kill from outside). A request in flight at
    /// [`MAX_CRASHES_IN_FLIGHT`] such deaths — one that crashes every iothread that runs it,
    /// as an image whose metadata trips the image library does — is answered with
    /// IOERR instead of being run again, with the others in flight then, as QEMU fails the
    /// I/O of an image it found corrupt: the disk stays up and its other requests are served.
    /// A death by SIGKILL (an operator, the OOM killer) never fails a request.
    pub fn resubmit_in_flight(&mut self, crashed: bool) -> Resubmitted {
        let mut done = Resubmitted::default();
        for slot in 0..u32::try_from(self.slots.len()).unwrap_or(u32::MAX) {
            let Some(state) = self.slots.get_mut(slot as usize) else {
                break;
            };
            if !state.in_flight || state.throttled {
                continue;
            }
            if crashed {
                state.crashes = state.crashes.saturating_add(1);
            }
            let (opcode, bytes, local) = (state.opcode, state.bytes, state.local_queue);
            // A write run again is a write: marked before the new iothread sees it. One that is
            // failed instead is marked too: the dead iothread may have written part of it.
            if let Some(bitmap) = &self.write_bitmap {
                mark_written(bitmap, &self.ends.slots, slot, opcode, bytes);
            }
            if state.crashes >= MAX_CRASHES_IN_FLIGHT
                && opcode != Opcode::Answer
                && self.fail_in_flight(slot)
            {
                if let Some(state) = self.slots.get_mut(slot as usize) {
                    state.opcode = Opcode::Answer;
                }
                done.failed = done.failed.saturating_add(1);
                if let Some(counters) = self.counters(usize::from(local)) {
                    counters.answered(false);
                }
                continue;
            }
            if self.ends.submissions.push(slot).is_ok() {
                done.resubmitted = done.resubmitted.saturating_add(1);
            }
        }
        done
    }

    /// Writes an answer slot's header — the status byte `value` at `status` (region, offset;
    /// `NO_STATUS` for none) and a used entry of `used_len` bytes for `head` of `queue` — and
    /// submits it.
    fn submit_answer(
        &mut self,
        slot: u32,
        queue: u16,
        head: u16,
        status: (u32, u64),
        used_len: u32,
        value: u8,
    ) -> std::result::Result<(), RingError> {
        let header = SlotHeader {
            opcode: Opcode::Answer as u32,
            queue,
            head,
            status_region: status.0,
            status_offset: status.1,
            used_len,
            answer: u32::from(value),
            ..SlotHeader::default()
        };
        self.ends
            .slots
            .set_header(slot, header)
            .and_then(|()| self.ends.submissions.push(slot))
    }

    /// Turns an in-flight slot into an answer with IOERR (its status byte and used entry, as
    /// its header located them) and submits it; false if its header cannot be rewritten.
    fn fail_in_flight(&mut self, slot: u32) -> bool {
        let Ok(request) = self.ends.slots.header(slot) else {
            return false;
        };
        let pushed = self.submit_answer(
            slot,
            request.queue,
            request.head,
            (request.status_region, request.status_offset),
            u32::from(request.status_region != NO_STATUS),
            request::STATUS_IOERR,
        );
        match pushed {
            Ok(()) => {
                error!(
                    "queue {} head {}: failed with IOERR: in flight at {MAX_CRASHES_IN_FLIGHT} \
                     iothread crashes (the image may be corrupt)",
                    request.queue, request.head
                );
                true
            }
            Err(e) => {
                error!("cannot submit the failure of slot {slot}: {e}");
                false
            }
        }
    }
}

/// How many iothreads may die of a fault of their own with a request in flight before it is
/// failed (see [`QueueCore::resubmit_in_flight`]).
pub const MAX_CRASHES_IN_FLIGHT: u8 = 3;

/// What [`QueueCore::resubmit_in_flight`] did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Resubmitted {
    /// Requests handed to the new iothread to run again.
    pub resubmitted: u32,
    /// Requests answered with IOERR instead.
    pub failed: u32,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::CacheMode;
    use crate::memory::tests::two_regions;
    use blkplane_proto::inflight::InflightRegion;
    use blkplane_proto::ring::SharedRing;
    use blkplane_proto::write_bitmap::{WriteBitmap, MIN_GRANULARITY};
    use virtio_bindings::virtio_blk::{
        VIRTIO_BLK_T_DISCARD, VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN,
        VIRTIO_BLK_T_OUT, VIRTIO_BLK_T_WRITE_ZEROES, VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP,
    };
    use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
    use vm_memory::Bytes;

    const DESC: u64 = 0x1000;
    const AVAIL: u64 = 0x2000;
    const USED: u64 = 0x3000;
    const SIZE: u16 = 16;

    fn ring(mem: &GuestMemoryMmap) -> Queue {
        let mut queue = Queue::new(SIZE).unwrap();
        queue
            .try_set_desc_table_address(GuestAddress(DESC))
            .unwrap();
        queue
            .try_set_avail_ring_address(GuestAddress(AVAIL))
            .unwrap();
        queue.try_set_used_ring_address(GuestAddress(USED)).unwrap();
        queue.set_ready(true);
        assert!(queue.is_valid(mem));
        queue
    }

    fn publish(mem: &GuestMemoryMmap, idx: u16, heads: &[u16]) {
        for (i, head) in heads.iter().enumerate() {
            mem.write_obj(*head, GuestAddress(AVAIL + 4 + 2 * i as u64))
                .unwrap();
        }
        mem.write_obj(idx, GuestAddress(AVAIL + 2)).unwrap();
    }

    fn desc(mem: &GuestMemoryMmap, index: u16, addr: u64, len: u32, flags: u32, next: u16) {
        let d = Descriptor::new(addr, len, flags as u16, next);
        mem.write_obj(d, GuestAddress(DESC + 16 * u64::from(index)))
            .unwrap();
    }

    /// A request chain at `index`: header, optional data, status; returns the status address.
    fn request(mem: &GuestMemoryMmap, index: u16, kind: u32, data: Option<(u64, u32)>) -> u64 {
        let header = 0x4000 + 0x100 * u64::from(index);
        let status = header + 0x80;
        mem.write_obj(kind, GuestAddress(header)).unwrap();
        mem.write_obj(0u32, GuestAddress(header + 4)).unwrap();
        mem.write_obj(0u64, GuestAddress(header + 8)).unwrap();
        let next = index + 1;
        desc(mem, index, header, 16, VRING_DESC_F_NEXT, next);
        match data {
            Some((addr, len)) => {
                desc(
                    mem,
                    next,
                    addr,
                    len,
                    VRING_DESC_F_NEXT | VRING_DESC_F_WRITE,
                    next + 1,
                );
                desc(mem, next + 1, status, 1, VRING_DESC_F_WRITE, 0);
            }
            None => desc(mem, next, status, 1, VRING_DESC_F_WRITE, 0),
        }
        status
    }

    /// A chain at `index` whose data the device reads: the header (`kind` at `sector`), `len`
    /// bytes at `data` (a write's data, or discard/write-zeroes ranges), the status byte.
    fn outgoing(mem: &GuestMemoryMmap, index: u16, kind: u32, sector: u64, data: u64, len: u32) {
        let header = 0x4000 + 0x100 * u64::from(index);
        mem.write_obj(kind, GuestAddress(header)).unwrap();
        mem.write_obj(0u32, GuestAddress(header + 4)).unwrap();
        mem.write_obj(sector, GuestAddress(header + 8)).unwrap();
        desc(mem, index, header, 16, VRING_DESC_F_NEXT, index + 1);
        desc(mem, index + 1, data, len, VRING_DESC_F_NEXT, index + 2);
        desc(mem, index + 2, header + 0x80, 1, VRING_DESC_F_WRITE, 0);
    }

    /// A `virtio_blk_discard_write_zeroes` range at `addr`.
    fn range(mem: &GuestMemoryMmap, addr: u64, sector: u64, sectors: u32, flags: u32) {
        mem.write_obj(sector, GuestAddress(addr)).unwrap();
        mem.write_obj(sectors, GuestAddress(addr + 8)).unwrap();
        mem.write_obj(flags, GuestAddress(addr + 12)).unwrap();
    }

    /// A bitmap of the fixture's 1 MiB disk, one bit per 4 KiB: 256 blocks, 4 words.
    fn bitmap() -> Arc<WriteBitmap> {
        Arc::new(WriteBitmap::create(1 << 20, MIN_GRANULARITY).unwrap())
    }

    /// Takes every word of `bitmap`, as blkplaned's copy does.
    fn take_all(bitmap: &WriteBitmap) -> Vec<u64> {
        (0..bitmap.words()).map(|i| bitmap.take_word(i)).collect()
    }

    /// The iothread completes every published slot.
    fn complete_all(f: &mut Fixture, iothread: &mut Consumer<u32>) {
        let slots: Vec<u32> = submitted(f, iothread).into_iter().map(|(s, _)| s).collect();
        complete(f, &slots);
    }

    /// The iothread completes `slots`; the core reads the completions.
    fn complete(f: &mut Fixture, slots: &[u32]) {
        let mut completions = f.ring.completion_producer();
        for &slot in slots {
            completions
                .push(Completion {
                    slot,
                    status: VIRTIO_BLK_S_OK,
                    completed_ns: 1,
                })
                .unwrap();
        }
        completions.publish();
        f.core.reap().unwrap();
    }

    struct Fixture {
        core: QueueCore,
        ring: SharedRing,
        memory: Arc<MemoryTable>,
        status: Arc<DeviceStatus>,
        _region: Arc<InflightRegion>,
    }

    fn fixture() -> Fixture {
        let memory = Arc::new(two_regions());
        let disk = Arc::new(DiskConfig::new(
            1 << 20,
            false,
            "serial-1",
            1,
            SIZE,
            512,
            CacheMode::Writeback,
        ));
        let status = Arc::new(DeviceStatus::new(1, 1));
        let ring = SharedRing::create(u32::from(SIZE), disk.segments_per_slot()).unwrap();
        let ends = RingEnds {
            submissions: ring.submission_producer(),
            completions: ring.completion_consumer(),
            slots: ring.slots(),
        };
        let mut core = QueueCore::new(
            disk,
            Arc::clone(&status),
            vec![0],
            Arc::clone(&memory),
            ends,
        );
        let limits = blkplane_proto::inflight::Limits {
            max_queues: 1,
            max_queue_size: SIZE,
        };
        let (region, _file) = InflightRegion::create(1, SIZE, limits).unwrap();
        let region = Arc::new(region);
        let mut inflight = region.queue(0).unwrap();
        inflight.recover(SIZE, 0, 0).unwrap();
        core.start_ring(0, ring_of(&memory), inflight, Vec::new());
        Fixture {
            core,
            ring,
            memory,
            status,
            _region: region,
        }
    }

    fn ring_of(memory: &MemoryTable) -> Queue {
        ring(memory.guest_memory())
    }

    /// The iothread's side: every slot submitted, in order.
    fn submitted(f: &Fixture, consumer: &mut Consumer<u32>) -> Vec<(u32, SlotHeader)> {
        let slots = f.ring.slots();
        let mut out = Vec::new();
        while let Some(slot) = consumer.pop().unwrap() {
            out.push((slot, slots.header(slot).unwrap()));
        }
        consumer.release();
        out
    }

    #[test]
    fn a_kick_turns_chains_into_slots_and_completions_free_them() {
        let mut f = fixture();
        let mut iothread = f.ring.submission_consumer();
        let mut completions = f.ring.completion_producer();
        let mem = f.memory.guest_memory();
        request(mem, 0, VIRTIO_BLK_T_IN, Some((0x8000, 512)));
        request(mem, 4, VIRTIO_BLK_T_GET_ID, Some((0x9000, 20)));
        // A chain whose `next` leaves the table: rejected without a status byte.
        desc(mem, 8, 0x5000, 16, VRING_DESC_F_NEXT, 99);
        publish(mem, 3, &[0, 4, 8]);
        f.core.process_ring(0, 1_000);
        f.core.publish_submissions();
        assert_eq!(f.core.in_flight(), 3);
        let slots = submitted(&f, &mut iothread);
        let opcodes: Vec<_> = slots.iter().map(|(slot, h)| (*slot, h.opcode)).collect();
        assert_eq!(
            opcodes,
            [
                (0, Opcode::Read as u32),
                (4, Opcode::Answer as u32),
                (8, Opcode::Answer as u32)
            ]
        );
        // GET_ID wrote the serial into guest memory; its answer carries OK and the length.
        let mut serial = [0u8; 8];
        mem.read_slice(&mut serial, GuestAddress(0x9000)).unwrap();
        assert_eq!(&serial, b"serial-1");
        let (_, get_id) = slots[1];
        assert_eq!(get_id.answer, u32::from(request::STATUS_OK));
        let (_, broken_chain) = slots[2];
        assert_eq!(
            (broken_chain.status_region, broken_chain.used_len),
            (NO_STATUS, 0)
        );
        assert_eq!(f.core.next_action(), None, "nothing for the event loop");
        // The iothread completes them; the core frees the slots and counts the read.
        for (slot, _) in &slots {
            completions
                .push(Completion {
                    slot: *slot,
                    status: VIRTIO_BLK_S_OK,
                    completed_ns: 5_000,
                })
                .unwrap();
        }
        completions.publish();
        f.core.reap().unwrap();
        assert_eq!(f.core.in_flight(), 0);
        assert!(f.core.ring_idle(0));
        let counters = f.status.queue(0).unwrap();
        assert_eq!(counters.read_ops.load(Ordering::Relaxed), 1);
        // A completion of a slot that is not in flight: the iothread must go.
        completions.push(Completion::default()).unwrap();
        completions.publish();
        assert!(matches!(
            f.core.reap(),
            Err(CompletionError::NotInFlight(0))
        ));
    }

    #[test]
    fn a_head_offered_again_while_in_flight_breaks_only_that_ring() {
        let mut f = fixture();
        let mem = f.memory.guest_memory();
        request(mem, 0, VIRTIO_BLK_T_IN, Some((0x8000, 512)));
        publish(mem, 2, &[0, 0]);
        f.core.process_ring(0, 0);
        assert_eq!(f.core.next_action(), Some(Action::RingBroken(0)));
        assert_eq!(f.core.next_action(), None, "reported once");
        assert!(!f.core.is_served(0));
        assert!(f.status.queue(0).unwrap().broken.load(Ordering::Relaxed));
        // Nothing more is popped from a broken ring.
        publish(mem, 3, &[0, 0, 2]);
        f.core.process_ring(0, 0);
        assert_eq!(f.core.in_flight(), 1);
    }

    #[test]
    fn a_paused_core_pops_nothing_until_resumed() {
        let mut f = fixture();
        let mem = f.memory.guest_memory();
        request(mem, 0, VIRTIO_BLK_T_IN, Some((0x8000, 512)));
        publish(mem, 1, &[0]);
        f.core.pause();
        assert!(!f.core.avail_pending(), "a paused core does not poll");
        f.core.process_ring(0, 0);
        assert_eq!(f.core.in_flight(), 0);
        f.core.resume(0);
        assert_eq!(f.core.in_flight(), 1);
        assert!(!f.core.avail_pending());
    }

    #[test]
    fn a_ring_of_rejected_chains_is_served_one_ring_per_pass() {
        let mut f = fixture();
        let mut iothread = f.ring.submission_consumer();
        let mut completions = f.ring.completion_producer();
        let mem = f.memory.guest_memory();
        // Every head a one-descriptor chain without a status byte, answered on the spot; the
        // driver keeps a full ring's worth available.
        for head in 0..SIZE {
            desc(mem, head, 0x5000, 16, 0, 0);
        }
        let heads: Vec<u16> = (0..SIZE).collect();
        publish(mem, SIZE, &heads);
        f.core.process_ring(0, 0);
        assert_eq!(f.core.in_flight(), u32::from(SIZE));
        f.core.publish_submissions();
        for (slot, _) in submitted(&f, &mut iothread) {
            completions
                .push(Completion {
                    slot,
                    ..Completion::default()
                })
                .unwrap();
        }
        completions.publish();
        publish(mem, 2 * SIZE, &heads);
        // The heads are free once the completions are read, which the core does itself when
        // a head looks in flight; it stops after one ring's worth and asks to come back.
        f.core.process_ring(0, 0);
        assert_eq!(f.core.next_action(), Some(Action::Rekick(0)));
        assert!(f.core.is_served(0));
    }

    #[test]
    fn the_inflight_region_decides_what_a_new_iothread_gets() {
        let mut f = fixture();
        let mut iothread = f.ring.submission_consumer();
        let mem = f.memory.guest_memory();
        request(mem, 0, VIRTIO_BLK_T_IN, Some((0x8000, 512)));
        request(mem, 4, VIRTIO_BLK_T_IN, Some((0x8200, 512)));
        publish(mem, 2, &[0, 4]);
        f.core.process_ring(0, 0);
        f.core.publish_submissions();
        assert_eq!(submitted(&f, &mut iothread).len(), 2);
        // The iothread dies with both in flight: both are marked, both go to its successor.
        f.core.iothread_gone();
        assert_eq!(f.core.in_flight(), 2);
        let fresh = SharedRing::create(u32::from(SIZE), 4).unwrap();
        f.core.attach(RingEnds {
            submissions: fresh.submission_producer(),
            completions: fresh.completion_consumer(),
            slots: fresh.slots(),
        });
        assert_eq!(
            f.core.resubmit_in_flight(false),
            Resubmitted {
                resubmitted: 2,
                failed: 0
            }
        );
        let (spec, _) = f.core.ring_handover(0).unwrap();
        assert_eq!((spec.next_used, spec.size), (0, SIZE));
    }

    /// A request in flight at every iothread death: run again after kills from outside, however
    /// many, and after crashes until the third, which fails it with IOERR (its
    /// status byte and used entry, through an answer slot).
    #[test]
    fn a_request_every_iothread_crashes_on_is_failed_with_ioerr() {
        let mut f = fixture();
        let mut iothread = f.ring.submission_consumer();
        let mem = f.memory.guest_memory();
        request(mem, 0, VIRTIO_BLK_T_IN, Some((0x8000, 512)));
        publish(mem, 1, &[0]);
        f.core.process_ring(0, 0);
        f.core.publish_submissions();
        let sent = submitted(&f, &mut iothread);
        assert_eq!(sent.len(), 1);
        let (slot, asked) = sent[0];
        let slots = f.ring.slots();
        let mut replaced = |f: &mut Fixture, crashed: bool| {
            f.core.iothread_gone();
            f.ring.reset_queues();
            iothread = f.ring.submission_consumer();
            f.core.attach(RingEnds {
                submissions: f.ring.submission_producer(),
                completions: f.ring.completion_consumer(),
                slots: f.ring.slots(),
            });
            let done = f.core.resubmit_in_flight(crashed);
            f.core.publish_submissions();
            assert_eq!(submitted(f, &mut iothread).len(), 1);
            done
        };
        let again = Resubmitted {
            resubmitted: 1,
            failed: 0,
        };
        for _ in 0..5 {
            assert_eq!(replaced(&mut f, false), again, "killed from outside");
        }
        for _ in 1..MAX_CRASHES_IN_FLIGHT {
            assert_eq!(replaced(&mut f, true), again);
        }
        assert_eq!(slots.header(slot).unwrap(), asked);
        let failed = Resubmitted {
            resubmitted: 0,
            failed: 1,
        };
        assert_eq!(replaced(&mut f, true), failed);
        let answer = slots.header(slot).unwrap();
        assert_eq!(answer.opcode, Opcode::Answer as u32);
        assert_eq!(answer.answer, u32::from(request::STATUS_IOERR));
        assert_eq!(
            (answer.queue, answer.head, answer.used_len),
            (asked.queue, asked.head, 1)
        );
        assert_eq!(
            (answer.status_region, answer.status_offset),
            (asked.status_region, asked.status_offset)
        );
        // An answer crashes nothing: should its iothread die anyway, it is answered again.
        assert_eq!(replaced(&mut f, true), again);
        let errors = &f.status.queue(0).unwrap().errors;
        assert_eq!(errors.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn heads_are_taken_in_order() {
        let table = two_regions();
        let mem = table.guest_memory();
        let mut queue = ring(mem);
        publish(mem, 2, &[5, 3]);
        assert_eq!(next_head(&mut queue, mem).unwrap(), Some(5));
        assert_eq!(next_head(&mut queue, mem).unwrap(), Some(3));
        assert_eq!(next_head(&mut queue, mem).unwrap(), None);
    }

    #[test]
    fn avail_index_more_than_a_queue_ahead_breaks_the_ring() {
        let table = two_regions();
        let mem = table.guest_memory();
        let mut queue = ring(mem);
        publish(mem, 17, &[]);
        assert!(next_head(&mut queue, mem).is_err());
        // Exactly a queue's worth is legal.
        publish(mem, 16, &[]);
        assert!(next_head(&mut queue, mem).unwrap().is_some());
    }

    #[test]
    fn a_head_outside_the_table_breaks_the_ring() {
        let mut f = fixture();
        let mem = f.memory.guest_memory();
        publish(mem, 1, &[40]);
        f.core.process_ring(0, 0);
        assert_eq!(f.core.next_action(), Some(Action::RingBroken(0)));
        assert_eq!(f.core.in_flight(), 0);
    }

    #[test]
    fn a_write_is_marked_before_the_iothread_sees_it_and_again_when_reaped() {
        let mut f = fixture();
        let mut iothread = f.ring.submission_consumer();
        let bitmap = bitmap();
        f.core.set_write_bitmap(Some(Arc::clone(&bitmap)));
        let mem = f.memory.guest_memory();
        // 8 KiB at byte 8192: blocks 2 and 3.
        outgoing(mem, 0, VIRTIO_BLK_T_OUT, 16, 0x8000, 8192);
        publish(mem, 1, &[0]);
        f.core.process_ring(0, 0);
        // Marked before the slot is published to the iothread.
        assert_eq!(bitmap.count(), 2);
        assert!(submitted(&f, &mut iothread).is_empty(), "not published yet");
        f.core.publish_submissions();
        let slots = submitted(&f, &mut iothread);
        assert_eq!(slots.len(), 1);
        assert_eq!(slots[0].1.opcode, Opcode::Write as u32);
        // The copy takes the bits (and reads the blocks) while the write is in flight.
        assert_eq!(take_all(&bitmap), [0b1100, 0, 0, 0]);
        // Its completion marks them again, so that they are copied once more.
        complete(&mut f, &[slots[0].0]);
        assert_eq!(f.core.in_flight(), 0);
        assert_eq!(take_all(&bitmap), [0b1100, 0, 0, 0]);
    }

    #[test]
    fn discards_and_write_zeroes_mark_their_ranges_reads_and_rejections_nothing() {
        let mut f = fixture();
        let mut iothread = f.ring.submission_consumer();
        let bitmap = bitmap();
        f.core.set_write_bitmap(Some(Arc::clone(&bitmap)));
        let mem = f.memory.guest_memory();
        request(mem, 0, VIRTIO_BLK_T_IN, Some((0x8000, 4096)));
        // Discard of sectors 64..80 (bytes 32 KiB..40 KiB): blocks 8 and 9.
        range(mem, 0xa000, 64, 16, 0);
        outgoing(mem, 3, VIRTIO_BLK_T_DISCARD, 0, 0xa000, 16);
        // Write-zeroes of two ranges: sector 1024 (block 128) and sector 2040 (block 255).
        range(mem, 0xa100, 1024, 8, VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP);
        range(mem, 0xa110, 2040, 8, 0);
        outgoing(mem, 6, VIRTIO_BLK_T_WRITE_ZEROES, 0, 0xa100, 32);
        // A write past the capacity: rejected, answered by the core, writes nothing.
        outgoing(mem, 9, VIRTIO_BLK_T_OUT, 2048, 0x8000, 4096);
        request(mem, 12, VIRTIO_BLK_T_FLUSH, None);
        publish(mem, 5, &[0, 3, 6, 9, 12]);
        f.core.process_ring(0, 0);
        f.core.publish_submissions();
        let opcodes: Vec<_> = submitted(&f, &mut iothread)
            .iter()
            .map(|(slot, h)| (*slot, h.opcode))
            .collect();
        assert_eq!(
            opcodes,
            [
                (0, Opcode::Read as u32),
                (3, Opcode::Discard as u32),
                (6, Opcode::WriteZeroes as u32),
                (9, Opcode::Answer as u32),
                (12, Opcode::Flush as u32),
            ]
        );
        assert_eq!(take_all(&bitmap), [0b11 << 8, 0, 1, 1 << 63]);
        // Their completions mark the same blocks again, and nothing else.
        complete(&mut f, &[0, 3, 6, 9, 12]);
        assert_eq!(take_all(&bitmap), [0b11 << 8, 0, 1, 1 << 63]);
    }

    #[test]
    fn a_bitmap_installed_marks_the_writes_in_flight_and_none_once_removed() {
        let mut f = fixture();
        let mut iothread = f.ring.submission_consumer();
        let mem = f.memory.guest_memory();
        // A read and a 4 KiB write at byte 12 KiB (block 3) in flight, no bitmap yet.
        request(mem, 0, VIRTIO_BLK_T_IN, Some((0x8000, 4096)));
        outgoing(mem, 3, VIRTIO_BLK_T_OUT, 24, 0x9000, 4096);
        publish(mem, 2, &[0, 3]);
        f.core.process_ring(0, 0);
        f.core.publish_submissions();
        let bitmap = bitmap();
        f.core.set_write_bitmap(Some(Arc::clone(&bitmap)));
        assert!(f.core.write_bitmap().is_some());
        assert_eq!(take_all(&bitmap), [1 << 3, 0, 0, 0]);
        // Removed: the write's completion marks nothing any more.
        f.core.set_write_bitmap(None);
        complete_all(&mut f, &mut iothread);
        assert_eq!(f.core.in_flight(), 0);
        assert_eq!(bitmap.count(), 0);
    }

    #[test]
    fn writes_resubmitted_to_a_new_iothread_are_marked_again() {
        let mut f = fixture();
        let mut iothread = f.ring.submission_consumer();
        let bitmap = bitmap();
        f.core.set_write_bitmap(Some(Arc::clone(&bitmap)));
        let mem = f.memory.guest_memory();
        // 4 KiB at byte 256 KiB: block 64, bit 0 of word 1.
        outgoing(mem, 0, VIRTIO_BLK_T_OUT, 512, 0x8000, 4096);
        request(mem, 3, VIRTIO_BLK_T_IN, Some((0x9000, 512)));
        publish(mem, 2, &[0, 3]);
        f.core.process_ring(0, 0);
        f.core.publish_submissions();
        assert_eq!(submitted(&f, &mut iothread).len(), 2);
        assert_eq!(take_all(&bitmap), [0, 1, 0, 0]);
        // The iothread dies; its successor gets the same ring (slots kept, queues reset).
        f.core.iothread_gone();
        f.ring.reset_queues();
        f.core.attach(RingEnds {
            submissions: f.ring.submission_producer(),
            completions: f.ring.completion_consumer(),
            slots: f.ring.slots(),
        });
        assert_eq!(f.core.resubmit_in_flight(false).resubmitted, 2);
        assert_eq!(take_all(&bitmap), [0, 1, 0, 0]);
    }

    #[test]
    fn a_bitmap_installed_marks_writes_waiting_for_the_limits_too() {
        let mut f = fixture();
        let limits = blkplane_proto::v1::SetThrottle {
            limits: Some(blkplane_throttle::wire::named(&[("iops_write", 1)]).unwrap()),
            ..Default::default()
        };
        let limits = DiskThrottle::from_request(&limits, None).unwrap();
        f.core.set_throttle(limits, 0);
        let mem = f.memory.guest_memory();
        // Writes at blocks 1 and 2: the first goes, the second waits for the limits.
        outgoing(mem, 0, VIRTIO_BLK_T_OUT, 8, 0x8000, 4096);
        outgoing(mem, 3, VIRTIO_BLK_T_OUT, 16, 0x9000, 4096);
        publish(mem, 2, &[0, 3]);
        f.core.process_ring(0, 0);
        assert!(!f.core.slot(0).unwrap().throttled);
        assert!(f.core.slot(3).unwrap().throttled);
        let bitmap = bitmap();
        f.core.set_write_bitmap(Some(Arc::clone(&bitmap)));
        assert_eq!(take_all(&bitmap), [0b110, 0, 0, 0]);
    }
}
