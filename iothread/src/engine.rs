//! The iothread loop: one thread, one io_uring, no async runtime. Requests come from the
//! frontend's shared-memory ring and are executed straight into guest memory.
//!
//! Every iteration of [`Engine::run`]:
//! 1. pops every published slot, validates it into its preallocated [`SlotState`] and queues
//!    its first operation (a bad slot is completed with `VIRTIO_BLK_S_IOERR` at once);
//! 2. turns every queued operation into an SQE and submits the whole batch with one
//!    `io_uring_enter`, which is also where the thread sleeps when there is nothing else to do;
//! 3. reaps every available CQE, advancing each slot's state machine (continuing short
//!    transfers, fdatasync after a writethrough write, the next discard range...) and, for
//!    each finished request, writing its status byte into guest memory, adding it to its
//!    queue's used batch ([`UsedRings`]) and pushing its completion;
//! 4. writes a qcow2 image's metadata back if an allocation of the pass changed it (once for
//!    all of them; the requests that allocated complete only then), and
//! 5. publishes the batch: used entries and inflight records, then the completions (one index
//!    update, the frontend's eventfd written only if it announced it was going to sleep, which
//!    it does only while it waits for requests to finish), then each queue's used index and
//!    at most one interrupt per queue.
//!
//! Batching is the point (QEMU's dataplane lesson): one system call per batch in each
//! direction, however many requests the batch holds.
//!
//! Two operations besides the requests' are always outstanding, so that the one blocking
//! `io_uring_enter` also waits for them: a read of the submit eventfd (the frontend's kick) and
//! a poll of the control socket. Before every blocking wait the iothread announces it is going
//! to sleep on the submission queue (`prepare_to_sleep`), so the frontend kicks only a sleeping
//! iothread and new work arriving while I/O is in flight is never missed. With nothing at
//! the device (and the disk's `--poll-max-us` not zero) it first polls the submission queue
//! for the frontend's next slot, within an adaptive window ([`blkplane_poll`]): caught, the
//! slot costs neither the frontend's eventfd write nor this thread's sleep and wake-up. It
//! does not poll while requests are at the device: the frontend's worker polls its avail
//! rings then, and a second spinner starves the client on a machine with few CPUs.
//!
//! `SetMemoryTable` and `Shutdown` are handled only while no request is in flight: a new
//! table then cannot unmap memory the kernel is still transferring into, even from a frontend
//! that breaks its promise to send it only when idle, and a `Shutdown` finishes and publishes
//! every started request before the iothread exits. While one waits, no new work is taken.
//! The virtqueue and dirty-log messages are handled as they arrive.
//!
//! Nothing on the request path allocates or locks: slot state, iovec arrays and the queue of
//! operations waiting for room in the io_uring are sized at setup.
//!
//! A null image (`--image null:SIZE`, a benchmarking aid) takes the same path up to step 1:
//! there each validated request is executed on the spot ([`SlotState::run_null`] zero-fills
//! read buffers, everything else has nothing to do) and its completion pushed, so the batch is
//! published in step 4 without any SQE having been queued for it.

use std::collections::VecDeque;
use std::fs::File;
use std::io::{self, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use blkplane_poll::AdaptivePoll;
use blkplane_proto::clock::monotonic_ns;
use blkplane_proto::control::{
    self, ControlError, ControlReply, ControlRequest, QueueSpec, QUEUE_FLAG_CALL,
};
use blkplane_proto::dirty_log::DirtyLog;
use blkplane_proto::inflight::{region_size, InflightRegion, Limits};
use blkplane_proto::ring::{
    Completion, Consumer, LogEpoch, Opcode, Producer, RingCounters, RingError, SharedRing,
    SlotTable,
};
use io_uring::register::Restriction;
use io_uring::{opcode, squeue, types, IoUring, Probe};
use log::{debug, error, info, warn};
use std::sync::atomic::{fence, Ordering};
use std::sync::Arc;
use virtio_bindings::virtio_blk::VIRTIO_BLK_S_IOERR;

use crate::image::Image;
use crate::memory::MemoryTable;
use crate::request::{self, RequestError, UsedTarget};
use crate::slot::{FallocateSupport, SlotState, Stage, Step, Transfer};
use crate::vring::UsedRings;

mod chain;
mod cluster_write;

/// Operations that are not a slot's: the eventfd read (or poll) and the control poll.
const RESERVED_OPS: u32 = 2;
/// Upper bound of the io_uring submission queue; larger batches are submitted in pieces.
const MAX_SQ_ENTRIES: u32 = 4096;
/// Upper bound of the per-slot iovec and range buffers, against absurd ring geometries
/// (4096 slots of 4096 segments need 512 MiB).
const MAX_SLOT_STATE_BYTES: u64 = 1 << 30;
/// Bytes of per-slot buffers per segment: one iovec and one range.
const SLOT_BYTES_PER_SEGMENT: u64 =
    (std::mem::size_of::<libc::iovec>() + std::mem::size_of::<request::ImageRange>()) as u64;

/// Why the engine stopped with an error. Every one of them ends the process with status 1.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// io_uring could not be set up.
    #[error("setting up io_uring: {0}")]
    Uring(io::Error),
    /// io_uring_setup itself was refused (ENOSYS or EPERM): io_uring is forbidden here.
    #[error(
        "setting up io_uring: {0}: io_uring_setup is refused — by a seccomp profile that \
         forbids io_uring (the container runtimes' default profiles do; \
         helm/blkplane/seccomp/blkplane.json allows it), by kernel.io_uring_disabled, or by a \
         kernel without io_uring"
    )]
    UringRefused(io::Error),
    /// The kernel's io_uring lacks an operation the engine needs.
    #[error("the kernel's io_uring does not support {0}")]
    Unsupported(&'static str),
    /// The per-slot state does not fit in memory.
    #[error("cannot allocate state for {0} slots")]
    Alloc(u32),
    /// `io_uring_enter` failed.
    #[error("io_uring_enter: {0}")]
    Enter(io::Error),
    /// The frontend broke the submission queue (e.g. published more entries than it holds).
    #[error("submission queue: {0}")]
    SubmissionQueue(RingError),
    /// The frontend submitted a slot number outside the slot table.
    #[error("frontend submitted slot {slot}, but the ring has {count} slots")]
    BadSlot {
        /// The slot number.
        slot: u32,
        /// Slots in the ring.
        count: u32,
    },
    /// The frontend submitted a slot that was still in flight.
    #[error("frontend submitted slot {0} again while it was in flight")]
    SlotBusy(u32),
    /// Reading a slot failed in a way that is not the request's fault.
    #[error("{0}")]
    Slot(RequestError),
    /// The completion queue had no room: the frontend does not consume completions, or
    /// submitted a slot again before consuming its completion.
    #[error("completion queue full")]
    CompletionQueueFull,
    /// Waiting on the submit eventfd failed.
    #[error("submit eventfd: {0}")]
    Eventfd(io::Error),
    /// Polling the control socket failed.
    #[error("polling the control socket: {0}")]
    ControlPoll(io::Error),
    /// The control channel failed (other than the peer closing it).
    #[error("{0}")]
    Control(ControlError),
}

impl EngineError {
    /// The errno to answer a `Setup` with when the engine cannot be created.
    pub fn errno(&self) -> i32 {
        match self {
            Self::Uring(e) | Self::UringRefused(e) => e.raw_os_error().unwrap_or(libc::EIO),
            Self::Unsupported(_) => libc::ENOSYS,
            Self::Alloc(_) => libc::ENOMEM,
            _ => libc::EIO,
        }
    }
}

/// How the engine ended without error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    /// The frontend sent `Shutdown`.
    Shutdown,
    /// The frontend closed the control socket (it exited or died).
    PeerClosed,
}

/// What an io_uring operation is for, packed into its user data.
///
/// Layout: bits 56..64 a tag, and for slot operations bits 32..40 the [`Stage`] and bits 0..32
/// the slot number. Anything else decodes to `None` and is ignored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Token {
    /// The read of the submit eventfd.
    SubmitRead,
    /// The poll of a non-blocking submit eventfd whose read returned `EAGAIN`.
    SubmitPoll,
    /// The poll of the control socket.
    ControlPoll,
    /// An operation of a request.
    Slot { slot: u32, stage: Stage },
    /// The read into the page cache of what a qcow2 allocating write of the slot copies from
    /// the old data (see `engine/chain.rs`).
    Prefetch { slot: u32 },
    /// A read of a cluster's old data into the buffer of the slot's whole-cluster allocating
    /// write (see `engine/cluster_write.rs`).
    FillCluster { slot: u32 },
    /// The write of that cluster.
    WriteCluster { slot: u32 },
}

const TAG_SHIFT: u32 = 56;
const STAGE_SHIFT: u32 = 32;
const TAG_SUBMIT_READ: u64 = 1;
const TAG_SUBMIT_POLL: u64 = 2;
const TAG_CONTROL_POLL: u64 = 3;
const TAG_SLOT: u64 = 4;
const TAG_PREFETCH: u64 = 5;
const TAG_FILL_CLUSTER: u64 = 6;
const TAG_WRITE_CLUSTER: u64 = 7;

impl Token {
    fn encode(self) -> u64 {
        match self {
            Self::SubmitRead => TAG_SUBMIT_READ << TAG_SHIFT,
            Self::SubmitPoll => TAG_SUBMIT_POLL << TAG_SHIFT,
            Self::ControlPoll => TAG_CONTROL_POLL << TAG_SHIFT,
            Self::Slot { slot, stage } => {
                (TAG_SLOT << TAG_SHIFT) | (u64::from(stage as u8) << STAGE_SHIFT) | u64::from(slot)
            }
            Self::Prefetch { slot } => (TAG_PREFETCH << TAG_SHIFT) | u64::from(slot),
            Self::FillCluster { slot } => (TAG_FILL_CLUSTER << TAG_SHIFT) | u64::from(slot),
            Self::WriteCluster { slot } => (TAG_WRITE_CLUSTER << TAG_SHIFT) | u64::from(slot),
        }
    }

    fn decode(data: u64) -> Option<Self> {
        let payload = data & ((1 << TAG_SHIFT) - 1);
        match (data >> TAG_SHIFT, payload) {
            (TAG_SUBMIT_READ, 0) => Some(Self::SubmitRead),
            (TAG_SUBMIT_POLL, 0) => Some(Self::SubmitPoll),
            (TAG_CONTROL_POLL, 0) => Some(Self::ControlPoll),
            (TAG_SLOT, _) if payload >> (STAGE_SHIFT + 8) == 0 => Some(Self::Slot {
                stage: Stage::from_raw(u8::try_from(payload >> STAGE_SHIFT).ok()?)?,
                slot: u32::try_from(payload & u64::from(u32::MAX)).ok()?,
            }),
            (TAG_PREFETCH, _) => Some(Self::Prefetch {
                slot: u32::try_from(payload).ok()?,
            }),
            (TAG_FILL_CLUSTER, _) => Some(Self::FillCluster {
                slot: u32::try_from(payload).ok()?,
            }),
            (TAG_WRITE_CLUSTER, _) => Some(Self::WriteCluster {
                slot: u32::try_from(payload).ok()?,
            }),
            _ => None,
        }
    }
}

/// The io_uring loop of one iothread.
pub struct Engine {
    uring: IoUring,
    core: Core,
    /// The window of polling the submission queue before a sleep with nothing at the device.
    poll: AdaptivePoll,
}

/// Everything but the io_uring, so that CQEs can be handled while the completion queue is
/// borrowed.
struct Core {
    slots: SlotTable,
    states: Vec<SlotState>,
    submissions: Consumer<u32>,
    completions: Producer<Completion>,
    submit_eventfd: File,
    complete_eventfd: File,
    /// Where the eventfd read lands; boxed so its address is stable while the read is queued.
    eventfd_buf: Box<[u8; 8]>,
    control_fd: RawFd,
    image: Image,
    memory: MemoryTable,
    support: FallocateSupport,
    /// Operations waiting for room in the io_uring submission queue. Each slot appears at most
    /// once, so the capacity reserved at setup is never exceeded.
    pending: VecDeque<Token>,
    /// Slots between `begin` and their completion.
    in_flight: usize,
    /// qcow2 discards and unmapping write-zeroes waiting for the writes in flight into their
    /// range (see `engine/chain.rs`); each slot at most once, so the capacity reserved at
    /// setup is never exceeded.
    parked: VecDeque<u32>,
    /// Per slot, the read ahead of its qcow2 allocating write (see `engine/chain.rs`).
    prefetch: Vec<chain::Prefetch>,
    /// Where those reads land: read into only to fill the page cache, never looked at (one
    /// cluster; allocated with the first, never moved while one is in flight).
    prefetch_sink: Vec<u8>,
    /// Per slot: its request committed a qcow2 allocation in imago's caches that has not been
    /// written back yet.
    write_back_pending: Vec<bool>,
    /// Completed requests (slot, status) waiting for that write-back, which runs before the
    /// next publish; each slot at most once, so the capacity reserved at setup is never
    /// exceeded.
    awaiting_write_back: Vec<(u32, u32)>,
    /// qcow2 allocating writes of whole clusters through O_DIRECT (see
    /// `engine/cluster_write.rs`).
    cluster_writes: cluster_write::ClusterWrites,
    /// An allocation was committed in imago's caches since the last write-back: whatever
    /// completes now may rely on it (a write into the new cluster), so the metadata is written
    /// back before the next publish.
    metadata_dirty: bool,
    /// A control message is waiting to be read.
    control_ready: bool,
    /// A `SetMemoryTable` or `Shutdown` waiting for the requests in flight to finish.
    held: Option<(ControlRequest, Vec<File>)>,
    /// A message read in the middle of publishing a batch (looking for a `SetDirtyLog`),
    /// handled once the batch is out: a queue must not change under a batch.
    deferred: Option<(ControlRequest, Vec<File>)>,
    complaints: Complaints,
    /// Inline and queued transfers, for the frontend's statistics.
    counters: RingCounters,
    /// How each slot's request is completed (from its header, read when it started) and how
    /// many segments of read data to mark in the dirty log.
    targets: Vec<(UsedTarget, u32)>,
    /// The used rings this iothread writes.
    vrings: UsedRings,
    /// The frontend's dirty-log epoch, and the last one acted on.
    log_epoch: LogEpoch,
    log_epoch_seen: u32,
    /// The control socket (non-blocking), for reading a `SetDirtyLog` the epoch announces.
    control: Option<UnixStream>,
    /// A poll of the control socket is queued or in flight.
    control_poll_armed: bool,
    /// The time completions are stamped with: read once per loop iteration (after the wait
    /// and before taking new work), not per request.
    now_ns: u64,
}

/// The most preadv/pwritev calls one inline transfer may take (each moving some bytes) before
/// the rest goes to io_uring: bounds the time one request holds the loop.
const MAX_INLINE_CALLS: u32 = 16;

/// The fd a transfer goes through: the image's O_DIRECT fd when the transfer may use it, its
/// buffered fd otherwise, or a backing file's (a qcow2 chain's layer).
fn transfer_fd(image: &Image, transfer: &Transfer) -> Option<RawFd> {
    if transfer.layer != 0 {
        return image.qcow2_chain()?.layer_fd(transfer.layer);
    }
    match (transfer.direct, image.direct()) {
        (true, Some(direct)) => Some(direct.as_raw_fd()),
        _ => image.buffered().map(AsRawFd::as_raw_fd),
    }
}

/// Rate-limits per-request warnings so that a misbehaving frontend or failing disk cannot flood
/// the log: the first few are logged, then only every power-of-two-th.
#[derive(Default)]
struct Complaints(u64);

impl Complaints {
    fn should_log(&mut self) -> bool {
        self.0 = self.0.saturating_add(1);
        self.0 <= 16 || self.0.is_power_of_two()
    }
}

impl Engine {
    /// Sets up the io_uring and the per-slot state for `ring`.
    pub fn new(
        ring: &SharedRing,
        submit_eventfd: File,
        complete_eventfd: File,
        image: Image,
    ) -> Result<Self, EngineError> {
        let slots = ring.slots();
        let count = slots.count();
        let uring = build_uring(count)?;
        check_opcodes(&uring)?;
        restrict_and_enable(&uring)?;
        let segments = slots.segments_per_slot() as usize;
        let state_bytes = u64::from(count)
            .saturating_mul(segments as u64)
            .saturating_mul(SLOT_BYTES_PER_SEGMENT);
        if state_bytes > MAX_SLOT_STATE_BYTES {
            return Err(EngineError::Alloc(count));
        }
        let mut states = Vec::new();
        states
            .try_reserve_exact(count as usize)
            .map_err(|_| EngineError::Alloc(count))?;
        states.extend((0..count).map(|_| SlotState::new(segments)));
        let mut targets = Vec::new();
        targets
            .try_reserve_exact(count as usize)
            .map_err(|_| EngineError::Alloc(count))?;
        targets.resize(count as usize, (UsedTarget::default(), 0));
        let mut pending = VecDeque::new();
        pending
            .try_reserve_exact((count as usize).saturating_add(RESERVED_OPS as usize))
            .map_err(|_| EngineError::Alloc(count))?;
        let mut parked = VecDeque::new();
        parked
            .try_reserve_exact(count as usize)
            .map_err(|_| EngineError::Alloc(count))?;
        let mut prefetch = Vec::new();
        prefetch
            .try_reserve_exact(count as usize)
            .map_err(|_| EngineError::Alloc(count))?;
        prefetch.resize(count as usize, chain::Prefetch::None);
        let mut write_back_pending = Vec::new();
        write_back_pending
            .try_reserve_exact(count as usize)
            .map_err(|_| EngineError::Alloc(count))?;
        write_back_pending.resize(count as usize, false);
        let mut awaiting_write_back = Vec::new();
        awaiting_write_back
            .try_reserve_exact(count as usize)
            .map_err(|_| EngineError::Alloc(count))?;
        let cluster_writes = cluster_write::ClusterWrites::new(count)?;
        info!(
            "{count} slots of {segments} segments, io_uring {}/{} entries, {} image {} bytes{}{}",
            uring.params().sq_entries(),
            uring.params().cq_entries(),
            if image.is_null() { "null" } else { "file" },
            image.size(),
            match image.direct() {
                Some(_) => format!(", O_DIRECT for {}-byte aligned I/O", image.block_size()),
                None => String::new(),
            },
            if image.transfers_inline() {
                ", reads and writes inline (the file cannot be read without blocking, and \
                 reads of it are memory-fast)"
            } else {
                ""
            }
        );
        Ok(Self {
            uring,
            core: Core {
                submissions: ring.submission_consumer(),
                completions: ring.completion_producer(),
                slots,
                states,
                submit_eventfd,
                complete_eventfd,
                eventfd_buf: Box::new([0; 8]),
                control_fd: -1,
                image,
                memory: MemoryTable::empty(),
                support: FallocateSupport::default(),
                pending,
                in_flight: 0,
                parked,
                prefetch,
                prefetch_sink: Vec::new(),
                write_back_pending,
                awaiting_write_back,
                cluster_writes,
                metadata_dirty: false,
                control_ready: false,
                held: None,
                deferred: None,
                complaints: Complaints::default(),
                counters: ring.counters(),
                targets,
                vrings: UsedRings::default(),
                log_epoch_seen: ring.log_epoch().load(),
                log_epoch: ring.log_epoch(),
                control: None,
                control_poll_armed: false,
                now_ns: monotonic_ns(),
            },
            poll: AdaptivePoll::new(Duration::ZERO),
        })
    }

    /// Lets the engine poll its submission queue for up to `max` before it sleeps with no
    /// request at the device (zero, the default: it never polls).
    pub fn with_poll_max(mut self, max: Duration) -> Self {
        self.poll = AdaptivePoll::new(max);
        self
    }

    /// Serves the ring and the control socket until `Shutdown`, the control socket closing, or
    /// an error.
    pub fn run(mut self, control: &UnixStream) -> Result<Exit, EngineError> {
        self.core.control_fd = control.as_raw_fd();
        // Non-blocking on this side only: a poll says when to read, and a dirty-log epoch may
        // send the engine to read before its poll fired (or find nothing after it did).
        control
            .set_nonblocking(true)
            .map_err(EngineError::ControlPoll)?;
        self.core.control = Some(control.try_clone().map_err(EngineError::ControlPoll)?);
        self.core.pending.push_back(Token::SubmitRead);
        self.core.arm_control_poll();
        loop {
            self.core.now_ns = monotonic_ns();
            if self.core.held.is_none() {
                self.core.take_new_work()?;
            }
            self.queue_sqes()?;

            // Sleep only with nothing left to submit or publish. While a held message waits
            // no new work is taken, so only in-flight I/O needs to wake us.
            let idle = self.core.pending.is_empty()
                && self.core.completions.unpublished() == 0
                && self.core.awaiting_write_back.is_empty();
            // With nothing at the device, only the frontend's next slot (or a control message)
            // can end the wait: poll for it first. Not while requests are at the device: the
            // worker polls its avail rings then, and two pollers starve the client of a
            // 2-vCPU machine (BENCHMARKS.md).
            let polled = (self.poll.enabled()
                && idle
                && self.core.held.is_none()
                && self.core.in_flight == 0)
                .then(Instant::now);
            let caught = polled.is_some_and(|start| self.poll_for_work(start));
            let mut announced = false;
            let block = if !idle || caught {
                false
            } else if self.core.held.is_some() {
                self.core.in_flight > 0
            } else {
                announced = self.core.submissions.prepare_to_sleep();
                announced
            };
            self.enter(block)?;
            if announced {
                self.core.submissions.woke_up();
            }
            if let Some(start) = polled {
                self.poll.record(start.elapsed());
            }
            self.core.now_ns = monotonic_ns();

            self.reap()?;
            if !self.core.parked.is_empty() {
                self.core.retry_parked()?;
            }
            if self.core.cluster_waiters() {
                self.core.retry_cluster_waiters()?;
            }
            self.core.write_back_allocations()?;
            self.core.publish();
            if let Some((request, files)) = self.core.deferred.take() {
                self.core.handle_message(request, files)?;
            }
            if self.core.control_ready {
                if let Some(exit) = self.core.receive_control(control)? {
                    return Ok(exit);
                }
            }
            if self.core.held.is_some() && self.core.in_flight == 0 {
                if let Some(exit) = self.core.handle_held(control)? {
                    return Ok(exit);
                }
            }
        }
    }

    /// Polls until the frontend published a slot or a CQE arrived (a control message, the
    /// submit eventfd), or the poll window since `start` has passed; returns whether one did.
    fn poll_for_work(&mut self, start: Instant) -> bool {
        let window = self.poll.window();
        if window.is_zero() {
            return false;
        }
        let Self { uring, core, .. } = self;
        blkplane_poll::spin_until(start, window, || {
            core.submissions.has_published() || !uring.completion().is_empty()
        })
    }

    /// Moves queued operations into the io_uring submission queue, submitting whenever it fills
    /// up. Whatever the kernel cannot take now stays queued for the next iteration.
    fn queue_sqes(&mut self) -> Result<(), EngineError> {
        let Self { uring, core, .. } = self;
        loop {
            {
                let mut sq = uring.submission();
                while !sq.is_full() {
                    let Some(token) = core.pending.pop_front() else {
                        break;
                    };
                    let Some(entry) = core.sqe(token) else {
                        core.cluster_write_unqueued(token)?;
                        continue;
                    };
                    // SAFETY: every pointer in the entry stays valid until its CQE: iovecs
                    // live in the slot's boxed buffer, which is not touched again until the
                    // slot's operation completes; the iovecs point into guest memory mappings,
                    // which are only replaced while no request is in flight; the eventfd
                    // buffer is boxed and owned by the engine, and so is the read-ahead sink,
                    // allocated once and never read or moved; the fds are owned by the engine
                    // (the control socket is borrowed for the whole of `run`).
                    if unsafe { sq.push(&entry) }.is_err() {
                        core.pending.push_front(token);
                        break;
                    }
                }
            }
            if core.pending.is_empty() {
                return Ok(());
            }
            match uring.submit() {
                Ok(0) => return Ok(()),
                Ok(_) => {}
                Err(e) if is_transient(&e) => return Ok(()),
                Err(e) => return Err(EngineError::Enter(e)),
            }
        }
    }

    /// Submits everything in the submission queue and, if `block`, waits for one completion.
    fn enter(&mut self, block: bool) -> Result<(), EngineError> {
        let needed = {
            let sq = self.uring.submission();
            block || !sq.is_empty() || sq.cq_overflow()
        };
        if !needed {
            return Ok(());
        }
        match self.uring.submitter().submit_and_wait(usize::from(block)) {
            Ok(_) => Ok(()),
            // Interrupted, or the kernel wants completions reaped first / is short of memory:
            // the loop reaps and comes back.
            Err(e) if is_transient(&e) => Ok(()),
            Err(e) => Err(EngineError::Enter(e)),
        }
    }

    /// Handles every available CQE.
    fn reap(&mut self) -> Result<(), EngineError> {
        let Self { uring, core, .. } = self;
        let mut cq = uring.completion();
        loop {
            for cqe in &mut cq {
                core.on_cqe(cqe.user_data(), cqe.result())?;
            }
            cq.sync();
            if cq.is_empty() {
                return Ok(());
            }
        }
    }
}

impl Core {
    /// Pops every published slot and starts it.
    fn take_new_work(&mut self) -> Result<(), EngineError> {
        while let Some(slot) = self
            .submissions
            .pop()
            .map_err(EngineError::SubmissionQueue)?
        {
            self.start(slot)?;
        }
        self.submissions.release();
        Ok(())
    }

    fn start(&mut self, slot: u32) -> Result<(), EngineError> {
        let count = self.slots.count();
        if let Some(prefetch) = self.prefetch.get_mut(slot as usize) {
            *prefetch = chain::Prefetch::None;
        }
        if let Some(pending) = self.write_back_pending.get_mut(slot as usize) {
            *pending = false;
        }
        let state = usize::try_from(slot)
            .ok()
            .and_then(|index| self.states.get_mut(index))
            .ok_or(EngineError::BadSlot { slot, count })?;
        let (iovecs, ranges) = state.buffers().ok_or(EngineError::SlotBusy(slot))?;
        let header = self
            .slots
            .header(slot)
            .map_err(|e| EngineError::Slot(e.into()))?;
        let read_segments = if header.opcode == Opcode::Read as u32 {
            header.segment_count
        } else {
            0
        };
        if let Some(target) = self.targets.get_mut(slot as usize) {
            *target = (UsedTarget::from_header(&header), read_segments);
        }
        let mut parsed = request::parse(
            &self.slots,
            slot,
            &self.memory,
            self.image.size(),
            iovecs,
            ranges,
        );
        if matches!(&parsed, Err(e) if e.is_outside_image()) && self.image.refresh_size() {
            info!("image grew to {} bytes", self.image.size());
            let (iovecs, ranges) = state.buffers().ok_or(EngineError::SlotBusy(slot))?;
            parsed = request::parse(
                &self.slots,
                slot,
                &self.memory,
                self.image.size(),
                iovecs,
                ranges,
            );
        }
        match parsed {
            Ok(request) => {
                // At most one per slot: cannot saturate.
                self.in_flight = self.in_flight.saturating_add(1);
                let step = if self.image.is_null() {
                    // SAFETY: `parse` just filled the slot's iovecs with ranges inside the
                    // current memory table's mappings, which stay mapped until the next
                    // SetMemoryTable; that is only handled between batches, and this request
                    // is over before `run_null` returns.
                    unsafe { state.run_null(request) }
                } else {
                    state.begin(request, &self.support)
                };
                self.apply(slot, step)
            }
            Err(e) if e.is_fatal() => Err(EngineError::Slot(e)),
            Err(e) => {
                if self.complaints.should_log() {
                    warn!("slot {slot}: refusing request: {e}");
                }
                self.push_completion(slot, VIRTIO_BLK_S_IOERR)
            }
        }
    }

    /// Carries out what a slot's state machine decided.
    fn apply(&mut self, slot: u32, step: Step) -> Result<(), EngineError> {
        if self.image.qcow2_chain().is_some() {
            match step {
                Step::Issue(Stage::Transfer) => return self.map_transfer(slot),
                Step::Issue(Stage::Range) => return self.zero_or_discard(slot),
                Step::Issue(Stage::Fsync) => {
                    if let Some(step) = self.flush_metadata(slot) {
                        return self.apply(slot, step);
                    }
                }
                Step::Complete(_) | Step::Failed(_) => {}
            }
        }
        match step {
            Step::Issue(Stage::Transfer) if self.image.transfers_inline() => {
                self.transfer_inline(slot)
            }
            Step::Issue(stage) => {
                if stage == Stage::Transfer {
                    self.counters.count_queued();
                }
                self.pending.push_back(Token::Slot { slot, stage });
                Ok(())
            }
            Step::Complete(status) => {
                if self.defer_until_written_back(slot, status) {
                    return Ok(());
                }
                self.in_flight = self.in_flight.saturating_sub(1);
                self.push_completion(slot, status)
            }
            Step::Failed(errno) => {
                if self.complaints.should_log() {
                    let opcode = self.states.get(slot as usize).map(SlotState::opcode);
                    warn!(
                        "slot {slot}: {opcode:?} failed: {}",
                        io::Error::from_raw_os_error(errno)
                    );
                }
                self.in_flight = self.in_flight.saturating_sub(1);
                self.push_completion(slot, VIRTIO_BLK_S_IOERR)
            }
        }
    }

    /// Runs a slot's transfer as plain preadv/pwritev calls on this thread (an image whose
    /// reads io_uring would hand to an io-wq worker: see [`Image::transfers_inline`]), feeding
    /// each result to the slot's state machine as a CQE would; what is still left after
    /// [`MAX_INLINE_CALLS`] calls goes to io_uring.
    fn transfer_inline(&mut self, slot: u32) -> Result<(), EngineError> {
        for _ in 0..MAX_INLINE_CALLS {
            match self.inline_call(slot)? {
                Step::Issue(Stage::Transfer) => continue,
                step => return self.apply(slot, step),
            }
        }
        self.counters.count_queued();
        self.pending.push_back(Token::Slot {
            slot,
            stage: Stage::Transfer,
        });
        Ok(())
    }

    /// One preadv/pwritev of a slot's next transfer on this thread; returns what the slot's
    /// state machine makes of its result.
    fn inline_call(&mut self, slot: u32) -> Result<Step, EngineError> {
        let block_size = self.image.direct().map(|_| self.image.block_size());
        let Some(state) = self.states.get_mut(slot as usize) else {
            return Err(EngineError::BadSlot {
                slot,
                count: self.slots.count(),
            });
        };
        let transfer = state.next_transfer(block_size);
        let Some(fd) = transfer_fd(&self.image, &transfer) else {
            return Ok(state.on_transfer(-libc::EBADF));
        };
        let count = libc::c_int::try_from(transfer.count).unwrap_or(libc::c_int::MAX);
        let Ok(offset) = libc::off_t::try_from(transfer.offset) else {
            return Ok(state.on_transfer(-libc::EINVAL));
        };
        // SAFETY: the iovecs live in the slot's own buffer and point into guest memory
        // mappings that stay mapped while the request is in flight (exactly what an SQE of
        // the same transfer would hand the kernel); the call returns before either changes.
        let rc = unsafe {
            if transfer.write {
                libc::pwritev(fd, transfer.iovecs, count, offset)
            } else {
                libc::preadv(fd, transfer.iovecs, count, offset)
            }
        };
        let result = match i32::try_from(rc) {
            Ok(n) if n >= 0 => n,
            _ if rc < 0 => io::Error::last_os_error()
                .raw_os_error()
                .unwrap_or(libc::EIO)
                .saturating_neg(),
            // More than i32::MAX bytes in one call: more than a slot ever asks for.
            _ => -libc::EIO,
        };
        self.counters.count_inline();
        Ok(state.on_transfer(result))
    }

    /// Completes a request: its status byte and used entry (published with the batch), and
    /// its completion for the frontend.
    fn push_completion(&mut self, slot: u32, status: u32) -> Result<(), EngineError> {
        if let Some((target, read_segments)) = self.targets.get(slot as usize) {
            self.vrings.complete(
                target,
                status,
                (&self.slots, slot, *read_segments),
                &self.memory,
            );
        }
        self.completions
            .push(Completion {
                slot,
                status,
                completed_ns: self.now_ns,
            })
            .map_err(|_| EngineError::CompletionQueueFull)
    }

    /// Builds the SQE for a queued operation.
    fn sqe(&mut self, token: Token) -> Option<squeue::Entry> {
        let entry = match token {
            Token::SubmitRead => opcode::Read::new(
                types::Fd(self.submit_eventfd.as_raw_fd()),
                self.eventfd_buf.as_mut_ptr(),
                8,
            )
            .build(),
            Token::SubmitPoll => {
                opcode::PollAdd::new(types::Fd(self.submit_eventfd.as_raw_fd()), poll_in()).build()
            }
            Token::ControlPoll => {
                opcode::PollAdd::new(types::Fd(self.control_fd), poll_in()).build()
            }
            Token::Prefetch { slot } => self.prefetch_sqe(slot)?,
            Token::FillCluster { .. } | Token::WriteCluster { .. } => {
                return self.cluster_write_sqe(token)
            }
            Token::Slot { slot, stage } => {
                let Some(buffered) = self.image.buffered() else {
                    // `run_null` completes every request of a null image on the spot.
                    error!("slot {slot}: {stage:?} queued for a null image");
                    return None;
                };
                let buffered = types::Fd(buffered.as_raw_fd());
                let state = self.states.get_mut(slot as usize)?;
                if state.stage() != Some(stage) {
                    error!(
                        "slot {slot}: queued {stage:?} but the slot is {:?}",
                        state.stage()
                    );
                    return None;
                }
                match stage {
                    Stage::Transfer => {
                        let block_size = self.image.direct().map(|_| self.image.block_size());
                        let transfer = state.next_transfer(block_size);
                        let Some(fd) = transfer_fd(&self.image, &transfer) else {
                            error!(
                                "slot {slot}: transfer to layer {} of the chain, which has none",
                                transfer.layer
                            );
                            return None;
                        };
                        let fd = types::Fd(fd);
                        if transfer.write {
                            opcode::Writev::new(fd, transfer.iovecs, transfer.count)
                                .offset(transfer.offset)
                                .build()
                        } else {
                            opcode::Readv::new(fd, transfer.iovecs, transfer.count)
                                .offset(transfer.offset)
                                .build()
                        }
                    }
                    // fdatasync on the buffered fd also covers O_DIRECT writes: same inode.
                    Stage::Fsync => opcode::Fsync::new(buffered)
                        .flags(types::FsyncFlags::DATASYNC)
                        .build(),
                    Stage::Range => {
                        let range = state.current_range()?;
                        opcode::Fallocate::new(buffered, range.len)
                            .offset(range.offset)
                            .mode(range.mode)
                            .build()
                    }
                }
            }
        };
        Some(entry.user_data(token.encode()))
    }

    /// Handles one CQE.
    fn on_cqe(&mut self, user_data: u64, result: i32) -> Result<(), EngineError> {
        let errno = if result < 0 {
            result.saturating_neg()
        } else {
            0
        };
        let retry = matches!(errno, libc::EINTR | libc::EAGAIN | libc::ECANCELED);
        match Token::decode(user_data) {
            None => warn!("ignoring a completion with unknown user data {user_data:#x}"),
            Some(Token::SubmitRead) => match errno {
                0 => self.pending.push_back(Token::SubmitRead),
                // A non-blocking eventfd: wait for it to become readable, then read it.
                libc::EAGAIN => {
                    debug!("submit eventfd is non-blocking: polling it before reading");
                    self.pending.push_back(Token::SubmitPoll);
                }
                _ if retry => self.pending.push_back(Token::SubmitRead),
                _ => return Err(EngineError::Eventfd(io::Error::from_raw_os_error(errno))),
            },
            Some(Token::SubmitPoll) => match errno {
                0 => self.pending.push_back(Token::SubmitRead),
                _ if retry => self.pending.push_back(Token::SubmitPoll),
                _ => return Err(EngineError::Eventfd(io::Error::from_raw_os_error(errno))),
            },
            // Re-armed once the message has been handled.
            Some(Token::ControlPoll) => match errno {
                0 => {
                    self.control_poll_armed = false;
                    self.control_ready = true;
                }
                _ if retry => self.pending.push_back(Token::ControlPoll),
                _ => {
                    return Err(EngineError::ControlPoll(io::Error::from_raw_os_error(
                        errno,
                    )))
                }
            },
            Some(Token::Prefetch { slot }) => self.prefetched(slot, result)?,
            Some(Token::FillCluster { slot }) => self.cluster_filled(slot, result)?,
            Some(Token::WriteCluster { slot }) => self.cluster_written(slot, result)?,
            Some(Token::Slot { slot, stage }) => {
                let Some(state) = self.states.get_mut(slot as usize) else {
                    warn!("ignoring a completion for unknown slot {slot}");
                    return Ok(());
                };
                if state.stage() != Some(stage) {
                    warn!("ignoring a stale {stage:?} completion for slot {slot}");
                    return Ok(());
                }
                let support = self.support;
                let step = match stage {
                    Stage::Transfer => state.on_transfer(result),
                    Stage::Fsync => state.on_fsync(result),
                    Stage::Range => state.on_range(result, &mut self.support),
                };
                if self.support != support {
                    info!(
                        "the image does not support some fallocate modes; now using {:?}",
                        self.support
                    );
                }
                self.apply(slot, step)?;
            }
        }
        Ok(())
    }

    /// Publishes the batch: used entries and inflight records first, then the completions
    /// (waking the frontend if it waits for them), then the used indices; last, what the batch
    /// wrote is marked in the dirty log and the guests are signalled — so the frontend sees a
    /// completion before the driver can see its head used, and every mark follows its write.
    fn publish(&mut self) {
        if self.completions.unpublished() == 0 {
            return;
        }
        self.vrings.record();
        let wake = self.completions.publish();
        self.follow_log_epoch();
        self.vrings.publish_indices();
        // Orders the index stores before the epoch check (see LogEpoch) and before the reads
        // of the drivers' interrupt suppression.
        fence(Ordering::SeqCst);
        self.follow_log_epoch();
        self.vrings.finish(&self.slots, &self.memory);
        if !wake {
            return;
        }
        match (&self.complete_eventfd).write(&1u64.to_ne_bytes()) {
            Ok(_) => {}
            // The counter is saturated: the frontend has a wake-up pending anyway.
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => warn!("waking the frontend: {e}"),
        }
    }

    /// When the frontend announced a `SetDirtyLog` (its epoch moved), reads the control
    /// socket now, so the log is in place before this batch is marked.
    fn follow_log_epoch(&mut self) {
        let epoch = self.log_epoch.load();
        if epoch == self.log_epoch_seen {
            return;
        }
        self.log_epoch_seen = epoch;
        while self.held.is_none() && self.deferred.is_none() {
            match self.read_control() {
                Ok(Some((ControlRequest::SetDirtyLog(spec), files))) => {
                    if let Err(e) = self.handle_message(ControlRequest::SetDirtyLog(spec), files) {
                        warn!("control message: {e}");
                        return;
                    }
                }
                Ok(Some(other)) => self.deferred = Some(other),
                Ok(None) => return,
                Err(e) => {
                    // The poll reports the same error and ends the engine there.
                    debug!("reading the control socket for the dirty log: {e}");
                    return;
                }
            }
        }
    }

    fn arm_control_poll(&mut self) {
        if !self.control_poll_armed {
            self.control_poll_armed = true;
            self.pending.push_back(Token::ControlPoll);
        }
    }

    /// One control message, or `None` if none is waiting.
    fn read_control(&self) -> Result<Option<(ControlRequest, Vec<File>)>, ControlError> {
        let Some(control) = &self.control else {
            return Ok(None);
        };
        match control::recv_request(control) {
            Ok(message) => Ok(Some(message)),
            Err(ControlError::Io(e)) if e.kind() == io::ErrorKind::WouldBlock => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Reads the control message the poll announced. Returns how to exit if it ends the
    /// engine.
    fn receive_control(&mut self, control: &UnixStream) -> Result<Option<Exit>, EngineError> {
        self.control_ready = false;
        let message = match self.read_control() {
            Ok(message) => message,
            Err(ControlError::Closed) => return Ok(Some(Exit::PeerClosed)),
            Err(e) => return Err(EngineError::Control(e)),
        };
        if let Some((request, files)) = message {
            self.handle_message(request, files)?;
        }
        if self.held.is_some() {
            if self.in_flight == 0 {
                return self.handle_held(control);
            }
            // Re-armed once the held message is answered.
            return Ok(None);
        }
        self.arm_control_poll();
        Ok(None)
    }

    /// Answers a message at once, or holds a `SetMemoryTable` or `Shutdown` until no request
    /// is in flight.
    fn handle_message(
        &mut self,
        request: ControlRequest,
        files: Vec<File>,
    ) -> Result<(), EngineError> {
        let reply = match request {
            ControlRequest::SetMemoryTable(_) | ControlRequest::Shutdown => {
                self.held = Some((request, files));
                return Ok(());
            }
            ControlRequest::Setup(_) => {
                warn!("refusing a second Setup");
                ControlReply(libc::EINVAL)
            }
            ControlRequest::StartQueue(spec) => self.start_queue(spec, files),
            ControlRequest::GrowImage { size } => self.grow_image(size),
            ControlRequest::StopQueue { queue } => {
                self.vrings.stop(queue);
                ControlReply::OK
            }
            ControlRequest::SetCall { queue, .. } => {
                if self.vrings.set_call(queue, files.into_iter().next()) {
                    ControlReply::OK
                } else {
                    ControlReply(libc::ENOENT)
                }
            }
            ControlRequest::SetDirtyLog(spec) => match (spec, files.into_iter().next()) {
                (Some(spec), Some(file)) => match DirtyLog::new(&file, spec.size, spec.offset) {
                    Ok(log) => {
                        info!("dirty log on: {} bytes of bitmap", spec.size);
                        self.vrings.set_dirty_log(Some(log));
                        ControlReply::OK
                    }
                    Err(e) => {
                        warn!("refusing the dirty log: {e}");
                        ControlReply(libc::EINVAL)
                    }
                },
                _ => {
                    info!("dirty log off");
                    self.vrings.set_dirty_log(None);
                    ControlReply::OK
                }
            },
        };
        self.send_reply(reply)
    }

    fn send_reply(&self, reply: ControlReply) -> Result<(), EngineError> {
        match &self.control {
            Some(control) => reply.send(control).map_err(EngineError::Control),
            None => Ok(()),
        }
    }

    /// Maps the queue's part of the inflight region and starts completing its requests.
    fn start_queue(&mut self, spec: QueueSpec, files: Vec<File>) -> ControlReply {
        let mut files = files.into_iter();
        let Some(region_file) = files.next() else {
            return ControlReply(libc::EINVAL);
        };
        let call = (spec.flags & QUEUE_FLAG_CALL != 0)
            .then(|| files.next())
            .flatten();
        let limits = Limits {
            max_queues: spec.inflight_queues,
            max_queue_size: spec.inflight_size,
        };
        let region = InflightRegion::open(
            &region_file,
            region_size(spec.inflight_queues, spec.inflight_size),
            spec.inflight_offset,
            spec.inflight_queues,
            spec.inflight_size,
            limits,
        )
        .map(Arc::new)
        .and_then(|region| region.queue(spec.inflight_queue));
        let tracker = match region {
            Ok(tracker) => tracker,
            Err(e) => {
                warn!("queue {}: refusing its inflight region: {e}", spec.queue);
                return ControlReply(libc::EINVAL);
            }
        };
        match self.vrings.start(spec, tracker, call, &self.memory) {
            Ok(()) => {
                debug!(
                    "queue {}: {} entries, used index {}",
                    spec.queue, spec.size, spec.next_used
                );
                ControlReply::OK
            }
            Err(e) => {
                warn!("refusing to start {e}");
                ControlReply(e.errno())
            }
        }
    }

    /// Handles the held `SetMemoryTable` or `Shutdown` (no request is in flight).
    fn handle_held(&mut self, control: &UnixStream) -> Result<Option<Exit>, EngineError> {
        let Some((request, files)) = self.held.take() else {
            return Ok(None);
        };
        let reply = match request {
            ControlRequest::SetMemoryTable(specs) => match MemoryTable::map(&specs, &files) {
                Ok(table) => {
                    info!("memory table: {} regions", table.len());
                    // Unmaps the old table, now that no request can point into it; the rings
                    // are found in the new one before anything is completed again.
                    self.memory = table;
                    self.vrings.remap(&self.memory);
                    ControlReply::OK
                }
                Err(e) => {
                    warn!("refusing memory table, keeping the old one: {e}");
                    ControlReply(e.errno())
                }
            },
            ControlRequest::Shutdown => {
                if let Err(e) = ControlReply::OK.send(control) {
                    debug!("answering Shutdown: {e}");
                }
                return Ok(Some(Exit::Shutdown));
            }
            _ => ControlReply(libc::EINVAL),
        };
        self.send_reply(reply)?;
        self.arm_control_poll();
        Ok(None)
    }
}

fn poll_in() -> u32 {
    libc::POLLIN as u32
}

fn is_transient(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)
    )
}

/// An io_uring with room for every slot's operation in the completion queue, so that it does
/// not overflow while all slots are in flight.
fn build_uring(slot_count: u32) -> Result<IoUring, EngineError> {
    let wanted = slot_count
        .saturating_add(RESERVED_OPS)
        .checked_next_power_of_two()
        .unwrap_or(1 << 31);
    let sq_entries = wanted.clamp(8, MAX_SQ_ENTRIES);
    let cq_entries = wanted.max(sq_entries.saturating_mul(2));
    // Cooperative task running and single issuer only save work; older kernels refuse them.
    // Created disabled, to be restricted before its first use (restrict_and_enable).
    IoUring::builder()
        .setup_cqsize(cq_entries)
        .setup_clamp()
        .setup_r_disabled()
        .setup_coop_taskrun()
        .setup_single_issuer()
        .build(sq_entries)
        .or_else(|_| {
            IoUring::builder()
                .setup_cqsize(cq_entries)
                .setup_clamp()
                .setup_r_disabled()
                .build(sq_entries)
        })
        .map_err(|e| match e.raw_os_error() {
            Some(libc::ENOSYS | libc::EPERM) => EngineError::UringRefused(e),
            _ => EngineError::Uring(e),
        })
}

/// The only operations the engine submits; the ring is restricted to them.
const OPCODES: [(u8, &str); 6] = [
    (opcode::Readv::CODE, "READV"),
    (opcode::Writev::CODE, "WRITEV"),
    (opcode::Fsync::CODE, "FSYNC"),
    (opcode::Fallocate::CODE, "FALLOCATE"),
    (opcode::Read::CODE, "READ"),
    (opcode::PollAdd::CODE, "POLL_ADD"),
];

fn check_opcodes(uring: &IoUring) -> Result<(), EngineError> {
    let mut probe = Probe::new();
    uring
        .submitter()
        .register_probe(&mut probe)
        .map_err(EngineError::Uring)?;
    for (code, name) in OPCODES {
        if !probe.is_supported(code) {
            return Err(EngineError::Unsupported(name));
        }
    }
    Ok(())
}

/// Restricts the (still disabled) ring to [`OPCODES`] and no `io_uring_register` operation,
/// then enables it. io_uring requests are not seen by seccomp: without this, a compromised
/// iothread could open files or sockets through its ring (IORING_OP_OPENAT, _SOCKET, ...).
fn restrict_and_enable(uring: &IoUring) -> Result<(), EngineError> {
    let mut restrictions = OPCODES.map(|(code, _)| Restriction::sqe_op(code));
    let submitter = uring.submitter();
    submitter
        .register_restrictions(&mut restrictions)
        .map_err(EngineError::Uring)?;
    submitter
        .register_enable_rings()
        .map_err(EngineError::Uring)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::tests::memfd;
    use std::os::fd::FromRawFd;

    fn eventfd() -> File {
        // SAFETY: plain syscall; the result is checked.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        assert!(fd >= 0);
        // SAFETY: a fresh fd owned by nobody else.
        unsafe { File::from_raw_fd(fd) }
    }

    /// The ring runs what the engine submits and refuses everything else (EACCES), such as
    /// an OPENAT a compromised iothread could use to reach files seccomp keeps it from.
    #[test]
    fn the_ring_is_restricted_to_the_engine_opcodes() {
        let (_ring, mut engine) = engine();
        let uring = &mut engine.uring;
        let event = eventfd();
        let mut buf = [0u8; 8];
        let read = opcode::Read::new(types::Fd(event.as_raw_fd()), buf.as_mut_ptr(), 8)
            .build()
            .user_data(1);
        let openat = opcode::OpenAt::new(types::Fd(libc::AT_FDCWD), c"/etc/hostname".as_ptr())
            .build()
            .user_data(2);
        // SAFETY: the buffer and path outlive the submissions, which complete before the
        // function returns (submit_and_wait(2)).
        unsafe {
            let mut sq = uring.submission();
            sq.push(&read).unwrap();
            sq.push(&openat).unwrap();
        }
        // SAFETY: writing 8 bytes to an eventfd we own.
        let written =
            unsafe { libc::write(event.as_raw_fd(), 1u64.to_ne_bytes().as_ptr().cast(), 8) };
        assert_eq!(written, 8);
        uring.submit_and_wait(2).unwrap();
        let mut results: Vec<(u64, i32)> = uring
            .completion()
            .map(|c| (c.user_data(), c.result()))
            .collect();
        results.sort_unstable();
        assert_eq!(results, [(1, 8), (2, -libc::EACCES)]);
    }

    fn engine() -> (SharedRing, Engine) {
        let ring = SharedRing::create(4, 2).unwrap();
        let image = Image::new(memfd(1 << 20), None, 512).unwrap();
        let engine = Engine::new(&ring, eventfd(), eventfd(), image).unwrap();
        (ring, engine)
    }

    #[test]
    fn unknown_and_stale_completions_are_ignored() {
        let (_ring, mut engine) = engine();
        let core = &mut engine.core;
        for data in [
            0,
            u64::MAX,
            Token::Slot {
                slot: 99,
                stage: Stage::Transfer,
            }
            .encode(),
            // Slot 0 is idle: nothing of it can be in flight.
            Token::Slot {
                slot: 0,
                stage: Stage::Fsync,
            }
            .encode(),
        ] {
            core.on_cqe(data, 0).unwrap();
            core.on_cqe(data, -libc::EIO).unwrap();
        }
        assert!(core.pending.is_empty());
        assert_eq!(core.in_flight, 0);
        assert_eq!(core.completions.unpublished(), 0);
    }

    #[test]
    fn eventfd_and_control_completions_rearm() {
        let (_ring, mut engine) = engine();
        let core = &mut engine.core;
        core.on_cqe(Token::SubmitRead.encode(), 8).unwrap();
        assert_eq!(core.pending.pop_front(), Some(Token::SubmitRead));
        // A non-blocking eventfd with nothing to read: poll first.
        core.on_cqe(Token::SubmitRead.encode(), -libc::EAGAIN)
            .unwrap();
        assert_eq!(core.pending.pop_front(), Some(Token::SubmitPoll));
        core.on_cqe(Token::SubmitPoll.encode(), libc::POLLIN.into())
            .unwrap();
        assert_eq!(core.pending.pop_front(), Some(Token::SubmitRead));
        core.on_cqe(Token::SubmitRead.encode(), -libc::EINTR)
            .unwrap();
        assert_eq!(core.pending.pop_front(), Some(Token::SubmitRead));
        assert!(core
            .on_cqe(Token::SubmitRead.encode(), -libc::EBADF)
            .is_err());

        core.on_cqe(Token::ControlPoll.encode(), libc::POLLIN.into())
            .unwrap();
        assert!(core.control_ready);
        assert!(
            core.pending.is_empty(),
            "re-armed only after the message is read"
        );
        assert!(core
            .on_cqe(Token::ControlPoll.encode(), -libc::EBADF)
            .is_err());
    }

    #[test]
    fn oversized_slot_state_is_refused() {
        let ring = SharedRing::create(1 << 16, 1024);
        // The ring itself may be too large to create here; only check when it exists.
        if let Ok(ring) = ring {
            let image = Image::new(memfd(4096), None, 512).unwrap();
            assert!(matches!(
                Engine::new(&ring, eventfd(), eventfd(), image),
                Err(EngineError::Alloc(_))
            ));
        }
    }

    #[test]
    fn tokens_round_trip() {
        for token in [
            Token::SubmitRead,
            Token::SubmitPoll,
            Token::ControlPoll,
            Token::Prefetch { slot: 0 },
            Token::Prefetch { slot: u32::MAX },
            Token::FillCluster { slot: 7 },
            Token::WriteCluster { slot: u32::MAX },
            Token::Slot {
                slot: 0,
                stage: Stage::Transfer,
            },
            Token::Slot {
                slot: u32::MAX,
                stage: Stage::Range,
            },
            Token::Slot {
                slot: 77,
                stage: Stage::Fsync,
            },
        ] {
            assert_eq!(Token::decode(token.encode()), Some(token), "{token:?}");
        }
    }

    #[test]
    fn garbage_user_data_decodes_to_nothing() {
        for data in [
            0,
            u64::MAX,
            (TAG_SUBMIT_READ << TAG_SHIFT) | 1,
            (TAG_CONTROL_POLL << TAG_SHIFT) | (1 << 40),
            (TAG_SLOT << TAG_SHIFT) | 5,
            (TAG_SLOT << TAG_SHIFT) | (9 << STAGE_SHIFT),
            (TAG_SLOT << TAG_SHIFT) | (1 << 40) | (1 << STAGE_SHIFT),
            99 << TAG_SHIFT,
        ] {
            assert_eq!(Token::decode(data), None, "{data:#x}");
        }
    }

    #[test]
    fn complaints_are_rate_limited() {
        let mut complaints = Complaints::default();
        let logged = (0..10_000).filter(|_| complaints.should_log()).count();
        assert!(logged < 30, "{logged}");
    }

    #[test]
    fn uring_has_room_for_every_slot() {
        let uring = build_uring(1000).unwrap();
        assert!(uring.params().cq_entries() >= 1002);
        assert!(uring.params().sq_entries() >= 8);
        check_opcodes(&uring).unwrap();
    }
}
