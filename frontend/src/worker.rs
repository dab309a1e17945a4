//! The frontend's queue handling: one worker thread per iothread, owning the virtqueues
//! assigned to that iothread.
//!
//! A worker sleeps in epoll on its queues' kick eventfds, its command eventfd and its
//! iothread's control socket (which hangs up when the iothread dies). On a kick it pops
//! **every** available chain, parses and validates each into a ring slot, and publishes the
//! whole batch with one index store — waking the iothread only if it sleeps.
//!
//! The iothread completes what it executes — status byte, used ring, inflight region, dirty
//! log, interrupt — and is the only writer of the used rings: what the worker answers itself (a
//! rejected request, GET_ID) goes to it as an [`Opcode::Answer`] slot. Its completions tell the
//! worker which slots are free and feed the statistics; the worker reads them whenever it wakes
//! anyway, before it looks at the avail rings, and is woken for them only while it waits for
//! requests to finish (a ring stop, a drain, a memory-table change, statistics asked for).
//!
//! No lock is taken on the I/O path. The vhost-user thread talks to a worker through
//! [`Command`]s and waits for the reply.

use std::fs::File;
use std::io::{self, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use blkplane_proto::clock::monotonic_ns;
use blkplane_proto::control::{QueueSpec, QUEUE_FLAG_EVENT_IDX};
use blkplane_proto::ring::{Completion, Opcode, SlotHeader, NO_STATUS};
use log::{error, info, warn};
use virtio_bindings::virtio_blk::VIRTIO_BLK_S_OK;
use virtio_queue::desc::split::Descriptor;
use virtio_queue::{Queue, QueueOwnedT, QueueT};
use vm_memory::{GuestAddress, GuestMemoryMmap};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::config::DiskConfig;
use crate::iothread::{IothreadError, IothreadLink};
use crate::memory::MemoryTable;
use crate::poll::AdaptivePoll;
use crate::request::{self, ChainError, Rejected, RequestKind};
use crate::stats::{DeviceStatus, QueueCounters};
use crate::throttle::{self, DiskThrottle, Throttler};
use blkplane_proto::control::ControlError;
use blkplane_proto::dirty_log::DirtyLog;
use blkplane_proto::inflight::QueueInflight;

const TOKEN_COMMAND: u64 = u64::MAX;
const TOKEN_COMPLETION: u64 = u64::MAX - 1;
const TOKEN_IOTHREAD: u64 = u64::MAX - 2;
const TOKEN_THROTTLE: u64 = u64::MAX - 3;
/// Consecutive failed iothread starts before in-flight requests are failed.
const MAX_START_ATTEMPTS: u32 = 5;
/// Guest-caused rejections logged at warn level per worker; the rest go to debug.
const LOUD_REJECTIONS: u32 = 20;

/// A ring the vhost-user thread hands to a worker once the VMM has set it up and enabled it.
pub struct VringStart {
    /// The split ring, addresses and indices already set and validated.
    pub queue: Queue,
    /// The driver's kick eventfd.
    pub kick: File,
    /// The call eventfd (interrupt), if the driver wants interrupts.
    pub call: Option<File>,
    /// The error eventfd, signalled when the ring is found broken.
    pub err: Option<File>,
    /// This ring's part of the inflight region: the VMM's (INFLIGHT_SHMFD), or one of the
    /// frontend's own, which lets an iothread's successor tell what it had completed.
    pub inflight: QueueInflight,
    /// Heads a crashed predecessor had in flight, oldest first: served before anything new
    /// from the avail ring (see [`QueueInflight::recover`]).
    pub resubmit: Vec<u16>,
    /// The ring resumes after a reconnect: the guest may have missed an interrupt for used
    /// entries the predecessor published, so one is sent when the ring starts.
    pub reconnected: bool,
}

/// Requests from the vhost-user thread to a worker; each carries its reply channel.
pub enum Command {
    /// Start serving a ring.
    Start {
        /// Device queue index.
        queue: u16,
        /// The ring.
        vring: Box<VringStart>,
        /// Acknowledgement.
        reply: Sender<()>,
    },
    /// Stop a ring after every in-flight request of it has completed (GET_VRING_BASE, disable,
    /// reset). Replies with the next avail index, or `None` if the ring was not running.
    Stop {
        /// Device queue index.
        queue: u16,
        /// The ring's next avail index.
        reply: Sender<Option<u16>>,
    },
    /// Replace a running ring's call eventfd.
    SetCall {
        /// Device queue index.
        queue: u16,
        /// The new eventfd.
        call: Option<File>,
        /// Acknowledgement.
        reply: Sender<()>,
    },
    /// Quiesce, hand the iothread a new memory table, resume.
    SetMemory {
        /// The new table.
        memory: Arc<MemoryTable>,
        /// Whether the iothread took it.
        reply: Sender<Result<(), String>>,
    },
    /// Drain: stop popping requests (new ones stay in the avail rings; kicks are consumed
    /// and every ring is re-read on resume), wait until every request in flight has
    /// completed — through iothread restarts — and reply with how many that were. Rings
    /// started while paused are not served until [`Command::Resume`].
    Pause {
        /// Requests that were in flight when the pause began.
        reply: Sender<u64>,
    },
    /// End a pause: process every ring (requests may have arrived meanwhile) and serve them
    /// again. A worker that is not paused just acknowledges.
    Resume {
        /// Acknowledgement.
        reply: Sender<()>,
    },
    /// Replace the I/O limits (`None`: none). Requests waiting for the old ones are judged by
    /// the new ones at once.
    SetThrottle {
        /// The disk's limits and buckets.
        throttle: Option<Arc<DiskThrottle>>,
        /// Acknowledgement.
        reply: Sender<()>,
    },
    /// Start (`Some`) or stop (`None`) marking the guest pages this worker and its iothread
    /// write in a migration's dirty log. Requests in flight are marked when they complete.
    SetDirtyLog {
        /// The log, while the VMM has VHOST_F_LOG_ALL set.
        log: Option<Arc<DirtyLog>>,
        /// Acknowledgement: every write completed from now on is marked.
        reply: Sender<()>,
    },
    /// Read the completions the iothread published, so that the statistics are current.
    SettleStatistics {
        /// Acknowledgement.
        reply: Sender<()>,
    },
}

/// The vhost-user thread's handle on a worker thread.
pub struct WorkerHandle {
    commands: Sender<Command>,
    wake: EventFd,
    _thread: JoinHandle<()>,
}

/// The worker thread is gone (it only exits by panicking, which the release build turns into
/// an abort, so this is not expected outside tests).
#[derive(Debug, thiserror::Error)]
#[error("frontend worker thread exited")]
pub struct WorkerGone;

impl WorkerHandle {
    /// Starts the worker for `link`'s iothread serving the device queues `queue_ids`.
    pub fn spawn(
        index: usize,
        disk: Arc<DiskConfig>,
        status: Arc<DeviceStatus>,
        mut link: IothreadLink,
        queue_ids: Vec<u16>,
    ) -> io::Result<Self> {
        let (commands, receiver) = mpsc::channel();
        let wake = EventFd::new(EFD_NONBLOCK)?;
        let epoll = Epoll::new()?;
        let memory = Arc::new(MemoryTable::empty());
        link.start(&memory).map_err(io::Error::other)?;
        let slot_count = link.slots.count() as usize;
        let mut worker = Worker {
            index,
            status,
            queues: queue_ids.iter().map(|_| None).collect(),
            queue_ids,
            memory,
            link,
            slots: vec![SlotState::default(); slot_count],
            in_flight: 0,
            scratch: Vec::new(),
            epoll,
            commands: receiver,
            wake: wake.try_clone()?,
            rejections: 0,
            poll: AdaptivePoll::new(disk.poll_max),
            disk,
            paused: false,
            dirty_log: None,
            throttler: Throttler::new(slot_count)?,
            iothread_broken: false,
        };
        worker.scratch.reserve(
            usize::from(worker.disk.queue_size)
                .saturating_add(usize::from(request::MAX_INDIRECT_DESCRIPTORS)),
        );
        if let Some(iothread) = worker.status.iothreads.get(index) {
            // The ring outlives its iothreads: its counters are the statistics' for good.
            let _ = iothread.ring_counters.set(worker.link.ring_counters());
        }
        worker.publish_iothread_pid();
        worker.watch(worker.wake.as_raw_fd(), TOKEN_COMMAND)?;
        worker.watch(worker.link.complete_event.as_raw_fd(), TOKEN_COMPLETION)?;
        worker.watch(worker.throttler.timer_fd(), TOKEN_THROTTLE)?;
        if let Some(fd) = worker.link.control_fd() {
            worker.watch(fd, TOKEN_IOTHREAD)?;
        }
        let thread = std::thread::Builder::new()
            .name(format!("worker-{index}"))
            .spawn(move || worker.run())?;
        Ok(Self {
            commands,
            wake,
            _thread: thread,
        })
    }

    /// Sends a command built around a fresh reply channel without waiting: the reply comes
    /// on the returned receiver (so that several workers can work on a command at once).
    pub fn post<R>(
        &self,
        make: impl FnOnce(Sender<R>) -> Command,
    ) -> Result<Receiver<R>, WorkerGone> {
        let (reply, answer) = mpsc::channel();
        self.commands.send(make(reply)).map_err(|_| WorkerGone)?;
        self.wake.write(1).map_err(|_| WorkerGone)?;
        Ok(answer)
    }

    /// A handle that reaches this worker from another thread (the admin channel's).
    pub fn statistics_handle(&self) -> io::Result<StatisticsHandle> {
        Ok(StatisticsHandle {
            commands: self.commands.clone(),
            wake: self.wake.try_clone()?,
        })
    }

    /// Sends a command built around a fresh reply channel and waits for the reply.
    pub fn call<R>(&self, make: impl FnOnce(Sender<R>) -> Command) -> Result<R, WorkerGone> {
        let (reply, answer) = mpsc::channel();
        self.commands.send(make(reply)).map_err(|_| WorkerGone)?;
        self.wake.write(1).map_err(|_| WorkerGone)?;
        answer.recv().map_err(|_| WorkerGone)
    }
}

/// How the admin thread makes a worker read its completions before it reads the statistics:
/// completions do not wake a worker, so without this the counters of a disk that went idle
/// would lag behind its last requests.
pub struct StatisticsHandle {
    commands: Sender<Command>,
    wake: EventFd,
}

/// The statistics handles of every worker of the disk.
pub struct WorkerStatistics(pub Vec<StatisticsHandle>);

/// How long the admin thread waits for each worker to read its completions.
const SETTLE_TIMEOUT: Duration = Duration::from_millis(200);

impl crate::admin::SettleStatistics for WorkerStatistics {
    fn settle(&self) {
        let answers: Vec<Receiver<()>> = self
            .0
            .iter()
            .filter_map(|worker| {
                let (reply, answer) = mpsc::channel();
                worker
                    .commands
                    .send(Command::SettleStatistics { reply })
                    .ok()?;
                worker.wake.write(1).ok()?;
                Some(answer)
            })
            .collect();
        let start = Instant::now();
        for answer in answers {
            // A worker busy with a long command answers late: its counters are read as they
            // are.
            let _ = answer.recv_timeout(SETTLE_TIMEOUT.saturating_sub(start.elapsed()));
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct SlotState {
    in_flight: bool,
    local_queue: u16,
    opcode: Opcode,
    bytes: u64,
    /// Waiting for the I/O limits: popped and parsed, not yet handed to the iothread.
    throttled: bool,
    /// When the request was taken off the avail ring ([`monotonic_ns`]).
    popped_ns: u64,
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
        }
    }
}

struct RunningQueue {
    queue: Queue,
    kick: File,
    call: Option<File>,
    err: Option<File>,
    in_flight: u32,
    broken: bool,
    /// Inflight tracking: marked here when a head is popped, cleared by the iothread when it
    /// is used.
    inflight: QueueInflight,
    /// The used index the iothread went on from when it was handed the ring.
    next_used: u16,
    /// Heads to resubmit before popping anything new (empty once done).
    resubmit: Vec<u16>,
}

struct Worker {
    index: usize,
    /// Counters and status for the admin channel.
    status: Arc<DeviceStatus>,
    disk: Arc<DiskConfig>,
    /// Device queue index of each local queue.
    queue_ids: Vec<u16>,
    queues: Vec<Option<RunningQueue>>,
    memory: Arc<MemoryTable>,
    link: IothreadLink,
    /// Frontend-private state of each ring slot (slot = local queue × queue size + head).
    slots: Vec<SlotState>,
    in_flight: u32,
    /// The chain being parsed; reserved to the queue size so parsing never allocates.
    scratch: Vec<Descriptor>,
    epoll: Epoll,
    commands: Receiver<Command>,
    wake: EventFd,
    rejections: u32,
    /// How long to watch the avail rings before sleeping while requests are in flight.
    poll: AdaptivePoll,
    /// Drained ([`Command::Pause`]): no request is popped until [`Command::Resume`]. Only
    /// this thread reads it, once per batch.
    paused: bool,
    /// A migration's dirty log while the VMM has logging on: the guest pages this worker
    /// writes (GET_ID strings, the used ring's flags and avail_event) are marked in it; the
    /// iothread has it too, for what it writes.
    dirty_log: Option<Arc<DirtyLog>>,
    /// The I/O limits and the requests waiting for them.
    throttler: Throttler,
    /// The iothread broke the completion queue's rules: it is replaced by the event loop.
    iothread_broken: bool,
}

/// Takes the next available head off the avail ring. An avail index more than a queue size
/// ahead of ours is the driver breaking the ring, reported as an error.
fn next_head(queue: &mut Queue, mem: &GuestMemoryMmap) -> Result<Option<u16>, virtio_queue::Error> {
    Ok(queue.iter(mem)?.next().map(|chain| chain.head_index()))
}

/// Marks a ring's whole used ring (flags, entries, avail_event: at most a few pages) in the
/// dirty log after the worker wrote any of it.
fn log_used_ring(log: Option<&DirtyLog>, queue: &Queue) {
    if let Some(log) = log {
        // 2 (flags) + 2 (idx) + 8 per entry + 2 (avail_event).
        let len = u64::from(queue.size()).saturating_mul(8).saturating_add(6);
        log.mark(queue.used_ring(), len);
    }
}

/// Signals an eventfd owned by the VMM; a full counter (EAGAIN) means it is signalled already.
fn signal(file: &File) {
    let _ = (&*file).write(&1u64.to_ne_bytes());
}

/// Consumes an eventfd's counter.
fn drain_eventfd(fd: RawFd) {
    let mut buf = [0u8; 8];
    // SAFETY: reads at most 8 bytes into a local buffer.
    let _ = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
}

/// Makes an eventfd readable, as the VMM's kick would.
fn signal_eventfd(fd: RawFd) {
    let one = 1u64.to_ne_bytes();
    // SAFETY: writes 8 bytes from a local buffer; EAGAIN only means it is readable already.
    let _ = unsafe { libc::write(fd, one.as_ptr().cast(), one.len()) };
}

impl Worker {
    fn counters(&self, local: usize) -> Option<&QueueCounters> {
        self.queue_ids
            .get(local)
            .and_then(|&queue| self.status.queue(queue))
    }

    fn publish_iothread_pid(&self) {
        if let Some(iothread) = self.status.iothreads.get(self.index) {
            iothread.pid.store(
                self.link.pid().unwrap_or(0),
                std::sync::atomic::Ordering::Relaxed,
            );
        }
    }

    fn set_queue_flags(&self, local: usize, running: bool, broken: bool) {
        if let Some(counters) = self.counters(local) {
            counters
                .running
                .store(running, std::sync::atomic::Ordering::Relaxed);
            counters
                .broken
                .store(broken, std::sync::atomic::Ordering::Relaxed);
        }
    }

    fn watch(&self, fd: RawFd, token: u64) -> io::Result<()> {
        self.epoll.ctl(
            ControlOperation::Add,
            fd,
            EpollEvent::new(EventSet::IN, token),
        )
    }

    fn unwatch(&self, fd: RawFd) {
        let _ = self
            .epoll
            .ctl(ControlOperation::Delete, fd, EpollEvent::default());
    }

    fn run(mut self) {
        let mut events = vec![EpollEvent::default(); 64];
        loop {
            // With requests in flight the guest is likely to queue more soon: when the last
            // waits were short, watch the avail rings (guest memory, no system call) before
            // sleeping, and so save the sleep and the wake-up.
            let waiting = (self.in_flight > 0 && !self.disk.poll_max.is_zero()).then(Instant::now);
            let caught = waiting.is_some_and(|start| self.poll_avail(start));
            // The worker is not woken for completions: it reads them below, whenever it wakes.
            self.link.completions.release();
            let timeout = if caught { 0 } else { -1 };
            let ready = match self.epoll.wait(timeout, &mut events) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => 0,
                Err(e) => {
                    error!("worker {}: epoll_wait: {e}", self.index);
                    std::thread::sleep(Duration::from_millis(10));
                    0
                }
            };
            if let Some(start) = waiting {
                self.poll.record(start.elapsed());
            }
            // Completions first: a head the driver made available again after its use is
            // free only once its completion is read.
            let mut iothread_died = self.reap_completions().is_err();
            for event in events.iter().take(ready) {
                match event.data() {
                    TOKEN_COMMAND => {
                        drain_eventfd(self.wake.as_raw_fd());
                        while let Ok(command) = self.commands.try_recv() {
                            self.handle(command);
                        }
                    }
                    TOKEN_COMPLETION => self.link.clear_completion_event(),
                    TOKEN_THROTTLE => self.release_throttled(),
                    TOKEN_IOTHREAD => iothread_died = true,
                    local => {
                        let local = blkplane_proto::usize_from(local);
                        if let Some(Some(rq)) = self.queues.get(local) {
                            drain_eventfd(rq.kick.as_raw_fd());
                            self.process_queue(local);
                        }
                    }
                }
            }
            if caught {
                for local in 0..self.queues.len() {
                    self.process_queue(local);
                }
            }
            self.flush_submissions();
            if iothread_died || std::mem::take(&mut self.iothread_broken) {
                self.restart_iothread();
            }
        }
    }

    /// Spins until an avail ring has a new entry or the poll window since `start` has passed;
    /// returns whether one had.
    fn poll_avail(&self, start: Instant) -> bool {
        let window = self.poll.window();
        if window.is_zero() || self.paused {
            return false;
        }
        let mem = self.memory.guest_memory();
        loop {
            let arrived = self.queues.iter().flatten().any(|rq| {
                !rq.broken
                    && rq
                        .queue
                        .avail_idx(mem, std::sync::atomic::Ordering::Acquire)
                        .is_ok_and(|idx| idx.0 != rq.queue.next_avail())
            });
            if arrived {
                return true;
            }
            if start.elapsed() >= window {
                return false;
            }
            std::hint::spin_loop();
        }
    }

    /// The ring as the iothread is handed it.
    fn queue_spec(local: usize, rq: &RunningQueue) -> QueueSpec {
        QueueSpec {
            // local < the worker's queue count, a u16.
            queue: u16::try_from(local).unwrap_or(u16::MAX),
            size: rq.queue.size(),
            flags: if rq.queue.event_idx_enabled() {
                QUEUE_FLAG_EVENT_IDX
            } else {
                0
            },
            avail_addr: rq.queue.avail_ring(),
            used_addr: rq.queue.used_ring(),
            next_used: rq.next_used,
            inflight_queue: rq.inflight.queue_index(),
            ..QueueSpec::default()
        }
    }

    /// Hands a running ring to the iothread. A refusal (the ring does not lie in the memory
    /// table the iothread has) breaks the ring; an iothread that is gone is replaced by the
    /// event loop, which hands it every running ring.
    fn start_on_iothread(&mut self, local: usize) {
        let Some(Some(rq)) = self.queues.get(local) else {
            return;
        };
        let spec = Self::queue_spec(local, rq);
        match self
            .link
            .start_queue(spec, rq.inflight.region(), rq.call.as_ref())
        {
            Ok(()) => {}
            Err(IothreadError::Control {
                source: ControlError::Refused(e),
                ..
            }) => self.break_queue(local, &format!("the iothread refused the ring: {e}")),
            Err(e) => warn!("worker {}: handing queue {local} over: {e}", self.index),
        }
    }

    fn handle(&mut self, command: Command) {
        match command {
            Command::Start {
                queue,
                vring,
                reply,
            } => {
                if let Some(local) = self.local_index(queue) {
                    self.stop_queue(local);
                    let VringStart {
                        queue: ring,
                        kick,
                        call,
                        err,
                        inflight,
                        resubmit,
                        reconnected,
                    } = *vring;
                    if reconnected {
                        // Used entries a crashed predecessor published may never have been
                        // signalled; a spurious interrupt is harmless, a missing one hangs
                        // the guest.
                        if let Some(call) = &call {
                            signal(call);
                        }
                    }
                    if let Err(e) = self.watch(kick.as_raw_fd(), local as u64) {
                        error!(
                            "worker {}: cannot watch kick fd of queue {queue}: {e}",
                            self.index
                        );
                    }
                    let next_used = ring.next_used();
                    if let Some(slot) = self.queues.get_mut(local) {
                        *slot = Some(RunningQueue {
                            queue: ring,
                            kick,
                            call,
                            err,
                            in_flight: 0,
                            broken: false,
                            inflight,
                            next_used,
                            resubmit,
                        });
                    }
                    self.set_queue_flags(local, true, false);
                    self.start_on_iothread(local);
                    // The driver may have queued requests before the ring started; a
                    // predecessor's requests in flight are resubmitted first.
                    self.process_queue(local);
                    self.flush_submissions();
                }
                let _ = reply.send(());
            }
            Command::Stop { queue, reply } => {
                let next_avail = self.local_index(queue).and_then(|l| self.stop_queue(l));
                let _ = reply.send(next_avail);
            }
            Command::SetCall { queue, call, reply } => {
                if let Some(local) = self.local_index(queue) {
                    if let Some(Some(rq)) = self.queues.get_mut(local) {
                        // Kept for the iothread's successors.
                        rq.call = call;
                        let local16 = u16::try_from(local).unwrap_or(u16::MAX);
                        if let Err(e) = self.link.set_call(local16, rq.call.as_ref()) {
                            warn!(
                                "worker {}: new call eventfd of queue {queue}: {e}",
                                self.index
                            );
                        }
                    }
                }
                let _ = reply.send(());
            }
            Command::SetMemory { memory, reply } => {
                self.wait_until(|w| w.in_flight == 0);
                let result = self.link.set_memory(&memory).map_err(|e| e.to_string());
                if result.is_ok() {
                    self.memory = memory;
                }
                let _ = reply.send(result);
            }
            Command::Pause { reply } => {
                self.paused = true;
                let waited = u64::from(self.in_flight);
                self.wait_until(|w| w.in_flight == 0);
                let _ = reply.send(waited);
            }
            Command::SetThrottle { throttle, reply } => {
                self.throttler.set(throttle);
                self.release_throttled();
                self.flush_submissions();
                let _ = reply.send(());
            }
            Command::SetDirtyLog { log, reply } => {
                if let Err(e) = self.link.announce_dirty_log(log.as_deref()) {
                    // A dead iothread's successor gets the log when it starts; one that
                    // refuses it cannot mark what it writes, which the VMM must hear of.
                    error!("worker {}: handing the dirty log over: {e}", self.index);
                }
                self.dirty_log = log;
                let _ = reply.send(());
            }
            Command::SettleStatistics { reply } => {
                if self.reap_completions().is_err() {
                    self.restart_iothread();
                }
                let _ = reply.send(());
            }
            Command::Resume { reply } => {
                if self.paused {
                    self.paused = false;
                    // Kicks that came while paused were consumed without popping: read every
                    // ring now (an empty one costs a look at its avail index).
                    for local in 0..self.queues.len() {
                        self.process_queue(local);
                    }
                    self.flush_submissions();
                }
                let _ = reply.send(());
            }
        }
    }

    fn local_index(&self, queue: u16) -> Option<usize> {
        self.queue_ids.iter().position(|&q| q == queue)
    }

    /// Drains and removes a ring; returns its next avail index.
    fn stop_queue(&mut self, local: usize) -> Option<u16> {
        self.wait_until(|w| {
            w.queues
                .get(local)
                .and_then(Option::as_ref)
                .is_none_or(|rq| rq.in_flight == 0)
        });
        let rq = self.queues.get_mut(local)?.take()?;
        self.unwatch(rq.kick.as_raw_fd());
        self.set_queue_flags(local, false, false);
        if let Err(e) = self
            .link
            .stop_queue(u16::try_from(local).unwrap_or(u16::MAX))
        {
            // A dead iothread's successor is never handed a stopped ring.
            warn!(
                "worker {}: stopping queue {local} on the iothread: {e}",
                self.index
            );
        }
        Some(rq.queue.next_avail())
    }

    /// Serves completions (and iothread restarts) until `done` holds. Pops nothing new.
    fn wait_until(&mut self, done: impl Fn(&Self) -> bool) {
        // Nothing new is popped while waiting: what waits for the limits goes now.
        self.submit_throttled(true);
        while !done(self) {
            self.flush_submissions();
            let mut died = false;
            if self.link.completions.prepare_to_sleep() {
                let control = self.link.control_fd().unwrap_or(-1);
                let mut fds = [
                    libc::pollfd {
                        fd: self.link.complete_event.as_raw_fd(),
                        events: libc::POLLIN,
                        revents: 0,
                    },
                    libc::pollfd {
                        fd: control,
                        events: libc::POLLIN,
                        revents: 0,
                    },
                    // Throttled requests count as in flight: their timer must keep firing.
                    libc::pollfd {
                        fd: self.throttler.timer_fd(),
                        events: libc::POLLIN,
                        revents: 0,
                    },
                ];
                // SAFETY: polls three descriptors described by a local array.
                let _ = unsafe { libc::poll(fds.as_mut_ptr(), 3, 1000) };
                self.link.completions.woke_up();
                died = control < 0 || fds[1].revents != 0;
                self.link.clear_completion_event();
                if fds[2].revents != 0 {
                    self.release_throttled();
                }
            }
            if died || self.reap_completions().is_err() {
                self.restart_iothread();
            }
        }
    }

    /// Pops and handles every available chain of a ring, re-checking after re-enabling
    /// notifications so that no request slips between the last pop and the re-enable.
    fn process_queue(&mut self, local: usize) {
        // Drained: the requests stay in the avail ring; Resume reads every ring again.
        if self.paused {
            return;
        }
        let memory = Arc::clone(&self.memory);
        let mem = memory.guest_memory();
        self.resubmit_inflight(local, &memory);
        loop {
            let Some(Some(rq)) = self.queues.get_mut(local) else {
                return;
            };
            if rq.broken {
                return;
            }
            if let Err(e) = rq.queue.disable_notification(mem) {
                return self.break_queue(local, &e.to_string());
            }
            log_used_ring(self.dirty_log.as_deref(), &rq.queue);
            // One pass pops at most a ring's worth: a guest that keeps publishing chains
            // rejected on the spot must not keep this worker from its commands (stop, drain)
            // and its other queues. A kick of our own brings it back here after them.
            let mut budget = rq.queue.size();
            loop {
                let Some(Some(rq)) = self.queues.get_mut(local) else {
                    return;
                };
                if budget == 0 {
                    signal_eventfd(rq.kick.as_raw_fd());
                    return;
                }
                budget = budget.saturating_sub(1);
                let head = match next_head(&mut rq.queue, mem) {
                    Ok(Some(head)) => head,
                    Ok(None) => break,
                    Err(e) => return self.break_queue(local, &e.to_string()),
                };
                self.handle_chain(local, head, &memory);
                if matches!(self.queues.get(local), Some(Some(rq)) if rq.broken) {
                    return;
                }
            }
            let Some(Some(rq)) = self.queues.get_mut(local) else {
                return;
            };
            let enabled = rq.queue.enable_notification(mem);
            log_used_ring(self.dirty_log.as_deref(), &rq.queue);
            match enabled {
                Ok(true) => continue,
                Ok(false) => return,
                Err(e) => return self.break_queue(local, &e.to_string()),
            }
        }
    }

    /// Handles the heads a crashed predecessor had in flight (once, on the first look at the
    /// ring), before anything new is popped: their avail entries were consumed already, and
    /// reads and writes are idempotent, so running them again is what completes them.
    fn resubmit_inflight(&mut self, local: usize, memory: &MemoryTable) {
        let Some(Some(rq)) = self.queues.get_mut(local) else {
            return;
        };
        if rq.resubmit.is_empty() {
            return;
        }
        let heads = std::mem::take(&mut rq.resubmit);
        let queue = self.queue_ids.get(local).copied().unwrap_or(u16::MAX);
        info!(
            "queue {queue}: resubmitting {} requests in flight before the reconnect",
            heads.len()
        );
        for head in heads {
            self.handle_chain(local, head, memory);
            if matches!(self.queues.get(local), Some(Some(rq)) if rq.broken) {
                return;
            }
        }
    }

    fn handle_chain(&mut self, local: usize, head: u16, memory: &MemoryTable) {
        let mem = memory.guest_memory();
        let Some(Some(rq)) = self.queues.get(local) else {
            return;
        };
        let desc_table = GuestAddress(rq.queue.desc_table());
        let size = rq.queue.size();
        if head >= size {
            // Not a chain we can return: the guest breaks the ring.
            return self.break_queue(local, "avail ring names a head outside the table");
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
            return self.break_queue(local, "avail ring names a head outside the table");
        };
        let busy = |w: &Self| w.slots.get(slot as usize).is_none_or(|s| s.in_flight);
        if busy(self) && self.reap_completions().is_err() {
            self.iothread_broken = true;
        }
        if busy(self) {
            return self.break_queue(local, "driver made an in-flight head available again");
        }
        // From here on every path ends in a slot for the iothread, which puts the head on the
        // used ring; until then a crash leaves the head marked and the next process
        // resubmits it.
        if let Some(Some(rq)) = self.queues.get_mut(local) {
            rq.inflight.mark(head);
        }
        let popped_ns = monotonic_ns();
        match request::collect_chain(mem, desc_table, size, head, &mut self.scratch) {
            Ok(()) => {}
            Err(ChainError::HeadOutOfRange(_)) => {
                return self.break_queue(local, "avail ring names a head outside the table");
            }
            Err(e) => {
                self.note_rejection(local, &e.to_string(), false);
                return self.answer(local, slot, head, None, 0, memory);
            }
        }
        let mut sink = request::SlotSink::new(&self.link.slots, slot);
        let parsed = request::parse(&self.scratch, memory, &self.disk, &mut sink);
        let request = match parsed {
            Ok(request) => request,
            Err(Rejected { error, status }) => {
                self.note_rejection(local, &error.to_string(), status.is_some());
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
        header.queue = u16::try_from(local).unwrap_or(u16::MAX);
        header.head = head;
        header.status_region = status_region;
        header.status_offset = status_offset;
        header.used_len = request.used_len();
        // Reads and writes within the I/O limits go now; the rest wait, slot filled, until
        // the throttle timer lets them go (a test of `None` when there are no limits).
        let throttled = self.throttler.is_active()
            && throttle::direction(opcode)
                .is_some_and(|dir| !self.throttler.admit_or_queue(dir, slot, request.bytes));
        let pushed = self.link.slots.set_header(slot, header).and_then(|()| {
            if throttled {
                Ok(())
            } else {
                self.link.submissions.push(slot)
            }
        });
        if let Err(e) = pushed {
            // Cannot happen while every slot has a queue entry reserved.
            error!("worker {}: cannot submit slot {slot}: {e}", self.index);
            return self.break_queue(local, "its request could not be submitted");
        }
        self.track(
            slot,
            SlotState {
                in_flight: true,
                // local < num_queues, a u16.
                local_queue: u16::try_from(local).unwrap_or(u16::MAX),
                opcode,
                bytes: request.bytes,
                throttled,
                popped_ns,
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
        if let Some(Some(rq)) = self.queues.get_mut(local) {
            rq.in_flight = rq.in_flight.saturating_add(1);
        }
        self.in_flight = self.in_flight.saturating_add(1);
    }

    fn note_rejection(&mut self, local: usize, why: &str, with_status: bool) {
        if let Some(counters) = self.counters(local) {
            counters.rejected(with_status);
        }
        self.rejections = self.rejections.saturating_add(1);
        let queue = self.queue_ids.get(local).copied().unwrap_or(u16::MAX);
        if self.rejections <= LOUD_REJECTIONS {
            warn!("queue {queue}: rejected request: {why}");
        } else {
            log::debug!("queue {queue}: rejected request: {why}");
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
        let header = SlotHeader {
            opcode: Opcode::Answer as u32,
            queue: u16::try_from(local).unwrap_or(u16::MAX),
            head,
            status_region,
            status_offset,
            used_len,
            answer: u32::from(value),
            ..SlotHeader::default()
        };
        let pushed = self
            .link
            .slots
            .set_header(slot, header)
            .and_then(|()| self.link.submissions.push(slot));
        if let Err(e) = pushed {
            error!(
                "worker {}: cannot submit answer slot {slot}: {e}",
                self.index
            );
            return self.break_queue(local, "its answer could not be submitted");
        }
        self.track(
            slot,
            SlotState {
                in_flight: true,
                local_queue: u16::try_from(local).unwrap_or(u16::MAX),
                opcode: Opcode::Answer,
                bytes: 0,
                throttled: false,
                popped_ns: 0,
            },
        );
    }

    /// Marks a ring broken (the guest violated the ring protocol): it is no longer served,
    /// its error eventfd is signalled, and every other ring and disk carries on.
    fn break_queue(&mut self, local: usize, why: &str) {
        let queue = self.queue_ids.get(local).copied().unwrap_or(u16::MAX);
        let Some(Some(rq)) = self.queues.get_mut(local) else {
            return;
        };
        if !rq.broken {
            if let Some(counters) = self
                .queue_ids
                .get(local)
                .and_then(|&q| self.status.queue(q))
            {
                counters
                    .broken
                    .store(true, std::sync::atomic::Ordering::Relaxed);
            }
            error!("queue {queue}: ring broken by the driver, no longer served until reset: {why}");
            rq.broken = true;
            if let Some(err) = &rq.err {
                signal(err);
            }
            let kick = rq.kick.as_raw_fd();
            self.unwatch(kick);
        }
    }

    fn flush_submissions(&mut self) {
        if self.link.submissions.unpublished() > 0 && self.link.submissions.publish() {
            self.link.wake();
        }
    }

    /// Reads every completion the iothread has published. An error means the iothread broke
    /// the ring protocol and must be replaced.
    fn reap_completions(&mut self) -> Result<(), ()> {
        let mut result = Ok(());
        loop {
            match self.link.completions.pop() {
                Ok(Some(completion)) => {
                    if let Err(why) = self.finish(completion) {
                        error!(
                            "worker {}: iothread sent a bad completion: {why}",
                            self.index
                        );
                        result = Err(());
                        break;
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    error!("worker {}: completion queue: {e}", self.index);
                    result = Err(());
                    break;
                }
            }
        }
        self.link.completions.release();
        result
    }

    /// A slot the iothread completed (its used entry is written): free it and count it.
    fn finish(&mut self, completion: Completion) -> Result<(), &'static str> {
        let state = self
            .slots
            .get_mut(completion.slot as usize)
            .filter(|s| s.in_flight && !s.throttled)
            .ok_or("slot not in flight")?;
        state.in_flight = false;
        let state = *state;
        // This slot was in flight, so the count is at least 1.
        self.in_flight = self.in_flight.saturating_sub(1);
        let local = usize::from(state.local_queue);
        if let Some(Some(rq)) = self.queues.get_mut(local) {
            rq.in_flight = rq.in_flight.saturating_sub(1);
        }
        // The worker's own answers were counted when they were decided.
        if state.opcode == Opcode::Answer {
            return Ok(());
        }
        if let Some(counters) = self.counters(local) {
            let ok = completion.status == VIRTIO_BLK_S_OK;
            let latency =
                Duration::from_nanos(completion.completed_ns.saturating_sub(state.popped_ns));
            counters.completed(state.opcode, state.bytes, ok, latency);
        }
        Ok(())
    }

    /// Hands the iothread every throttled request the limits now let go (in order per
    /// direction) and re-arms the throttle timer for the rest.
    fn release_throttled(&mut self) {
        self.submit_throttled(false);
    }

    /// Submits throttled requests: those the limits let go, or with `all` every one (a stop,
    /// drain or memory change is waiting for them, as QEMU lifts its limits during a drain).
    fn submit_throttled(&mut self, all: bool) {
        let Worker {
            throttler,
            slots,
            link,
            status,
            queue_ids,
            index,
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
            if let Err(e) = link.submissions.push(slot) {
                error!("worker {index}: cannot submit throttled slot {slot}: {e}");
            }
        };
        if all {
            throttler.release_all(submit);
        } else {
            throttler.release(submit);
        }
    }

    /// Replaces a dead or misbehaving iothread and resubmits everything it had not put on the
    /// used rings. The inflight regions are the truth: what the dead one recorded but never
    /// published is marked again ([`QueueInflight::repair_last_batch`]), and a slot whose head
    /// is still marked is in flight — even if its completion was read (published just before
    /// the used index would have moved).
    fn restart_iothread(&mut self) {
        let old_pid = self.link.pid();
        if let Some(fd) = self.link.control_fd() {
            self.unwatch(fd);
        }
        // Reaped before returning, so none of its I/O can still land after a resubmission.
        self.link.stop();
        // What it completed before dying frees its slots; anything malformed is ignored.
        let _ = self.reap_completions();
        self.reconcile_with_inflight();
        let mut attempt = 0u32;
        loop {
            match self.link.start(&self.memory) {
                Ok(()) => break,
                Err(e) => {
                    attempt = attempt.saturating_add(1);
                    error!(
                        "worker {}: cannot restart iothread (attempt {attempt}): {e}",
                        self.index
                    );
                    if attempt >= MAX_START_ATTEMPTS {
                        self.give_up();
                    }
                    std::thread::sleep(Duration::from_millis(50 << attempt));
                }
            }
        }
        self.publish_iothread_pid();
        let how = match self.link.take_previous_exit() {
            Some(exit) => format!("iothread {} ({exit})", self.index),
            None => format!("iothread {} (pid {})", self.index, old_pid.unwrap_or(0)),
        };
        warn!("worker {}: replaced {how}", self.index);
        self.status.set_last_iothread_exit(how);
        if let Some(iothread) = self.status.iothreads.get(self.index) {
            iothread
                .restarts
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            // blkplaned blocks migration for a while after a replacement.
            let now_ms = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
            iothread
                .last_restart_unix_ms
                .store(now_ms, std::sync::atomic::Ordering::Relaxed);
        }
        if let Some(fd) = self.link.control_fd() {
            if let Err(e) = self.watch(fd, TOKEN_IOTHREAD) {
                error!("worker {}: cannot watch iothread: {e}", self.index);
            }
        }
        for local in 0..self.queues.len() {
            self.start_on_iothread(local);
        }
        if let Some(log) = &self.dirty_log {
            if let Err(e) = self.link.set_dirty_log(Some(log)) {
                error!("worker {}: handing the dirty log over: {e}", self.index);
            }
        }
        let mut resubmitted = 0u32;
        for (slot, state) in (0u32..).zip(self.slots.iter()) {
            if state.in_flight && !state.throttled && self.link.submissions.push(slot).is_ok() {
                resubmitted = resubmitted.saturating_add(1);
            }
        }
        info!(
            "worker {}: iothread {:?} replaced by {:?}; resubmitted {resubmitted} requests",
            self.index,
            old_pid,
            self.link.pid()
        );
        self.flush_submissions();
    }

    /// After an iothread died: per running ring, the used index in guest memory is where its
    /// successor goes on, the last batch is repaired, and every slot whose head is marked in
    /// the inflight region (but for heads a predecessor process left, which wait in
    /// `resubmit` to be parsed again) is in flight.
    fn reconcile_with_inflight(&mut self) {
        let memory = Arc::clone(&self.memory);
        let mem = memory.guest_memory();
        let queue_size = u32::from(self.disk.queue_size);
        let mut in_flight = 0u32;
        for (local, entry) in (0u32..).zip(self.queues.iter_mut()) {
            let Some(rq) = entry else {
                continue;
            };
            let used = rq
                .queue
                .used_idx(mem, std::sync::atomic::Ordering::Acquire)
                .map_or(rq.next_used, |used| used.0);
            let size = rq.queue.size();
            let repaired = rq.inflight.repair_last_batch(size, used);
            if repaired > 0 {
                info!(
                    "queue {local}: {repaired} requests the iothread had not put on the used                      ring are in flight again"
                );
            }
            rq.next_used = used;
            rq.in_flight = 0;
            for head in 0..size {
                let slot = local
                    .checked_mul(queue_size)
                    .and_then(|first| first.checked_add(u32::from(head)));
                let Some(state) = slot.and_then(|slot| self.slots.get_mut(slot as usize)) else {
                    continue;
                };
                if rq.inflight.is_marked(head) && !rq.resubmit.contains(&head) {
                    if !state.in_flight {
                        // Read as completed, but its used entry never reached the ring.
                        state.in_flight = true;
                    }
                } else if state.in_flight && !state.throttled {
                    warn!(
                        "queue {local}: head {head} in flight but not marked in the inflight                          region; resubmitted"
                    );
                }
                if state.in_flight {
                    rq.in_flight = rq.in_flight.saturating_add(1);
                }
            }
            in_flight = in_flight.saturating_add(rq.in_flight);
        }
        self.in_flight = in_flight;
    }

    /// Last resort when no iothread can be started: the frontend exits, so that its
    /// supervisor starts it again and the VMM's reconnect resubmits, from the inflight region,
    /// everything in flight (a stuck guest is worse than a restarted back-end).
    fn give_up(&self) -> ! {
        error!(
            "worker {}: no iothread can be started; exiting so that the frontend is restarted",
            self.index
        );
        std::process::exit(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::tests::two_regions;
    use vm_memory::Bytes;

    fn ring(mem: &GuestMemoryMmap) -> Queue {
        let mut queue = Queue::new(16).unwrap();
        queue
            .try_set_desc_table_address(GuestAddress(0x1000))
            .unwrap();
        queue
            .try_set_avail_ring_address(GuestAddress(0x2000))
            .unwrap();
        queue
            .try_set_used_ring_address(GuestAddress(0x3000))
            .unwrap();
        queue.set_ready(true);
        assert!(queue.is_valid(mem));
        queue
    }

    fn publish(mem: &GuestMemoryMmap, idx: u16, heads: &[u16]) {
        for (i, head) in heads.iter().enumerate() {
            mem.write_obj(*head, GuestAddress(0x2004 + 2 * i as u64))
                .unwrap();
        }
        mem.write_obj(idx, GuestAddress(0x2002)).unwrap();
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
    fn a_head_outside_the_table_is_reported_by_the_parser() {
        let table = two_regions();
        let mem = table.guest_memory();
        let mut queue = ring(mem);
        publish(mem, 1, &[40]);
        let head = next_head(&mut queue, mem).unwrap().unwrap();
        let mut scratch = Vec::new();
        let result = request::collect_chain(mem, GuestAddress(0x1000), 16, head, &mut scratch);
        assert_eq!(result, Err(ChainError::HeadOutOfRange(40)));
    }
}
