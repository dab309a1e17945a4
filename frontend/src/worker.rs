//! The frontend's queue handling: one worker thread per iothread, owning the virtqueues
//! assigned to that iothread.
//!
//! A worker sleeps in epoll on its queues' kick eventfds, its iothread's completion eventfd,
//! its command eventfd and its iothread's control socket (which hangs up when the iothread
//! dies). On a kick it pops **every** available chain, parses and validates each into a ring
//! slot, and publishes the whole batch with one index store — waking the iothread only if it
//! sleeps. Completions are reaped as a batch, their status bytes and used entries written, and
//! each queue's call eventfd signalled at most once per batch (honouring EVENT_IDX).
//!
//! The worker is the only writer of its queues' used rings, so no lock is taken on the I/O
//! path. The vhost-user thread talks to it through [`Command`]s and waits for the reply.

use std::fs::File;
use std::io::{self, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use blkplane_proto::ring::{Completion, Opcode};
use log::{error, info, warn};
use virtio_bindings::virtio_blk::{VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK, VIRTIO_BLK_S_UNSUPP};
use virtio_queue::desc::split::Descriptor;
use virtio_queue::{Queue, QueueOwnedT, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::config::DiskConfig;
use crate::dirty_log::DirtyLog;
use crate::inflight::QueueInflight;
use crate::iothread::IothreadLink;
use crate::memory::MemoryTable;
use crate::poll::AdaptivePoll;
use crate::request::{self, ChainError, Rejected, RequestKind};
use crate::stats::{DeviceStatus, QueueCounters};
use crate::throttle::{self, DiskThrottle, Throttler};

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
    /// This ring's part of the inflight region (INFLIGHT_SHMFD), when the VMM set one.
    pub inflight: Option<QueueInflight>,
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
    /// Start (`Some`) or stop (`None`) marking the guest pages this worker writes in a
    /// migration's dirty log. Requests in flight are marked when they complete.
    SetDirtyLog {
        /// The log, while the VMM has VHOST_F_LOG_ALL set.
        log: Option<Arc<DirtyLog>>,
        /// Acknowledgement: every write completed from now on is marked.
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

    /// Sends a command built around a fresh reply channel and waits for the reply.
    pub fn call<R>(&self, make: impl FnOnce(Sender<R>) -> Command) -> Result<R, WorkerGone> {
        let (reply, answer) = mpsc::channel();
        self.commands.send(make(reply)).map_err(|_| WorkerGone)?;
        self.wake.write(1).map_err(|_| WorkerGone)?;
        answer.recv().map_err(|_| WorkerGone)
    }
}

#[derive(Debug, Clone, Copy)]
struct SlotState {
    in_flight: bool,
    local_queue: u16,
    head: u16,
    status: GuestAddress,
    used_len: u32,
    opcode: Opcode,
    bytes: u64,
    /// Segments in the ring slot (a read's are marked in the dirty log on completion).
    segments: u32,
    /// Waiting for the I/O limits: popped and parsed, not yet handed to the iothread.
    throttled: bool,
    popped: Instant,
}

impl Default for SlotState {
    fn default() -> Self {
        Self {
            in_flight: false,
            local_queue: 0,
            head: 0,
            status: GuestAddress(0),
            used_len: 0,
            opcode: Opcode::Flush,
            bytes: 0,
            segments: 0,
            throttled: false,
            popped: Instant::now(),
        }
    }
}

struct RunningQueue {
    queue: Queue,
    kick: File,
    call: Option<File>,
    err: Option<File>,
    in_flight: u32,
    notify: bool,
    broken: bool,
    /// Inflight tracking: marked when a head is popped, cleared when it is used.
    inflight: Option<QueueInflight>,
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
    /// How long to watch for completions before sleeping while requests are in flight.
    poll: AdaptivePoll,
    /// Drained ([`Command::Pause`]): no request is popped until [`Command::Resume`]. Only
    /// this thread reads it, once per batch.
    paused: bool,
    /// A migration's dirty log while the VMM has logging on: every guest page this worker
    /// writes is marked in it before the used entry is published.
    dirty_log: Option<Arc<DirtyLog>>,
    /// The I/O limits and the requests waiting for them.
    throttler: Throttler,
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
            // With requests in flight the next thing to happen is usually a completion: when
            // the last waits were short, watch the completion queue (no system call) before
            // sleeping, and so save the sleep and the iothread's wake-up write.
            let waiting = (self.in_flight > 0 && !self.disk.poll_max.is_zero()).then(Instant::now);
            let caught = waiting.is_some_and(|start| self.poll_completions(start));
            let may_sleep = !caught && self.link.completions.prepare_to_sleep();
            let timeout = if may_sleep { -1 } else { 0 };
            let ready = match self.epoll.wait(timeout, &mut events) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => 0,
                Err(e) => {
                    error!("worker {}: epoll_wait: {e}", self.index);
                    std::thread::sleep(Duration::from_millis(10));
                    0
                }
            };
            self.link.completions.woke_up();
            if let Some(start) = waiting {
                self.poll.record(start.elapsed());
            }
            let mut iothread_died = false;
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
            self.flush_submissions();
            if iothread_died || self.reap_completions().is_err() {
                self.restart_iothread();
            }
            self.notify_guests();
        }
    }

    /// Spins until a completion is published or the poll window since `start` has passed;
    /// returns whether one was.
    fn poll_completions(&self, start: Instant) -> bool {
        let window = self.poll.window();
        if window.is_zero() {
            return false;
        }
        loop {
            if self.link.completions.has_published() {
                return true;
            }
            if start.elapsed() >= window {
                return false;
            }
            std::hint::spin_loop();
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
                    if let Some(slot) = self.queues.get_mut(local) {
                        *slot = Some(RunningQueue {
                            queue: ring,
                            kick,
                            call,
                            err,
                            in_flight: 0,
                            notify: false,
                            broken: false,
                            inflight,
                            resubmit,
                        });
                    }
                    self.set_queue_flags(local, true, false);
                    // The driver may have queued requests before the ring started; a
                    // predecessor's requests in flight are resubmitted first.
                    self.process_queue(local);
                    self.flush_submissions();
                    self.notify_guests();
                }
                let _ = reply.send(());
            }
            Command::Stop { queue, reply } => {
                let next_avail = self.local_index(queue).and_then(|l| self.stop_queue(l));
                let _ = reply.send(next_avail);
            }
            Command::SetCall { queue, call, reply } => {
                if let Some(Some(rq)) = self.local_index(queue).and_then(|l| self.queues.get_mut(l))
                {
                    rq.call = call;
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
                self.dirty_log = log;
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
                    self.notify_guests();
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
            self.notify_guests();
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
        // that is still in flight.
        let slot = u32::try_from(local)
            .ok()
            .and_then(|local| local.checked_mul(u32::from(self.disk.queue_size)))
            .and_then(|first| first.checked_add(u32::from(head)))
            .filter(|&slot| self.slots.get(slot as usize).is_some_and(|s| !s.in_flight));
        let Some(slot) = slot else {
            return self.break_queue(local, "driver made an in-flight head available again");
        };
        // From here on every path ends in add_used (at once or after the iothread); until
        // then a crash leaves the head marked and the next process resubmits it.
        if let Some(Some(RunningQueue {
            inflight: Some(tracker),
            ..
        })) = self.queues.get_mut(local)
        {
            tracker.mark(head);
        }
        match request::collect_chain(mem, desc_table, size, head, &mut self.scratch) {
            Ok(()) => {}
            Err(ChainError::HeadOutOfRange(_)) => {
                return self.break_queue(local, "avail ring names a head outside the table");
            }
            Err(e) => {
                self.note_rejection(local, &e.to_string(), false);
                return self.complete_now(local, head, None, 0, mem);
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
                return self.complete_now(local, head, status, used, mem);
            }
        };
        let Some((opcode, header)) = request.slot_header(self.disk.writeback()) else {
            // GET_ID and reads or writes of no data are answered here, without the iothread.
            if request.kind != RequestKind::GetId {
                if let Some(counters) = self.counters(local) {
                    counters.answered(true);
                }
                let ok = Some((request.status, request::STATUS_OK));
                return self.complete_now(local, head, ok, 1, mem);
            }
            let status = match request::write_stream(mem, &self.scratch, &self.disk.serial) {
                Ok(()) => request::STATUS_OK,
                Err(_) => request::STATUS_IOERR,
            };
            if let Some(log) = &self.dirty_log {
                for d in self.scratch.iter().filter(|d| d.is_write_only()) {
                    log.mark(d.addr().0, u64::from(d.len()));
                }
            }
            let used = request.used_len();
            if let Some(counters) = self.counters(local) {
                counters.answered(u32::from(status) == VIRTIO_BLK_S_OK);
            }
            return self.complete_now(local, head, Some((request.status, status)), used, mem);
        };
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
            // Cannot happen while every slot has a queue entry reserved; fail the request
            // rather than lose it. (A throttled one is only queued once its header is set.)
            error!("worker {}: cannot submit slot {slot}: {e}", self.index);
            let failed = Some((request.status, request::STATUS_IOERR));
            return self.complete_now(local, head, failed, 1, mem);
        }
        if let Some(state) = self.slots.get_mut(slot as usize) {
            *state = SlotState {
                in_flight: true,
                // local < num_queues, a u16.
                local_queue: u16::try_from(local).unwrap_or(u16::MAX),
                head,
                status: request.status,
                used_len: request.used_len(),
                opcode,
                bytes: request.bytes,
                segments: request.segments,
                throttled,
                popped: Instant::now(),
            };
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

    /// Completes a chain without the iothread: writes its status (if any) and used entry.
    fn complete_now(
        &mut self,
        local: usize,
        head: u16,
        status: Option<(GuestAddress, u8)>,
        used_len: u32,
        mem: &GuestMemoryMmap,
    ) {
        if let Some((addr, value)) = status {
            // The address was checked to be in guest memory by the parser.
            let _ = mem.write_obj(value, addr);
            if let Some(log) = &self.dirty_log {
                log.mark(addr.0, 1);
            }
        }
        let Some(Some(rq)) = self.queues.get_mut(local) else {
            return;
        };
        if let Some(tracker) = &rq.inflight {
            tracker.before_used(head);
        }
        let added = rq.queue.add_used(mem, head, used_len);
        // Marked before the interrupt: the guest can only act on the entry after it.
        log_used_ring(self.dirty_log.as_deref(), &rq.queue);
        match added {
            Ok(()) => {
                rq.notify = true;
                // After the used index store (add_used's Release store): see inflight.rs.
                if let Some(tracker) = &rq.inflight {
                    tracker.after_used(head, rq.queue.next_used());
                }
            }
            Err(e) => self.break_queue(local, &e.to_string()),
        }
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

    /// Completes every request the iothread has finished. An error means the iothread broke
    /// the ring protocol and must be replaced.
    fn reap_completions(&mut self) -> Result<(), ()> {
        let memory = Arc::clone(&self.memory);
        let mem = memory.guest_memory();
        let mut result = Ok(());
        loop {
            match self.link.completions.pop() {
                Ok(Some(completion)) => {
                    if let Err(why) = self.finish(completion, mem) {
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

    fn finish(
        &mut self,
        completion: Completion,
        mem: &GuestMemoryMmap,
    ) -> Result<(), &'static str> {
        let state = self
            .slots
            .get_mut(completion.slot as usize)
            .filter(|s| s.in_flight)
            .ok_or("slot not in flight")?;
        state.in_flight = false;
        let state = *state;
        // This slot was in flight, so the count is at least 1.
        self.in_flight = self.in_flight.saturating_sub(1);
        let status = match completion.status {
            VIRTIO_BLK_S_OK => request::STATUS_OK,
            VIRTIO_BLK_S_UNSUPP => request::STATUS_UNSUPP,
            _ => request::STATUS_IOERR,
        };
        let used = if u32::from(status) == VIRTIO_BLK_S_OK {
            state.used_len
        } else {
            1
        };
        if state.opcode == Opcode::Read {
            // Even a failed read may have written part of its buffers.
            self.log_read_data(completion.slot, state.segments);
        }
        let local = usize::from(state.local_queue);
        if let Some(Some(rq)) = self.queues.get_mut(local) {
            rq.in_flight = rq.in_flight.saturating_sub(1);
        }
        if let Some(counters) = self.counters(local) {
            let ok = u32::from(status) == VIRTIO_BLK_S_OK;
            counters.completed(state.opcode, state.bytes, ok, state.popped.elapsed());
        }
        self.complete_now(local, state.head, Some((state.status, status)), used, mem);
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

    /// Marks the guest pages a completed read wrote (its slot's segments: region index and
    /// offset, as the parser wrote them) in the dirty log, when logging is on.
    fn log_read_data(&self, slot: u32, segments: u32) {
        let Some(log) = &self.dirty_log else {
            return;
        };
        for index in 0..segments {
            let Ok(segment) = self.link.slots.segment(slot, index) else {
                break;
            };
            match self.memory.guest_address(segment.aux, segment.offset) {
                Some(addr) => {
                    log.mark(addr, u64::from(segment.len));
                }
                None => warn!(
                    "worker {}: read segment {index} of slot {slot} names no guest memory; \
                     not marked in the dirty log",
                    self.index
                ),
            }
        }
    }

    fn notify_guests(&mut self) {
        let memory = Arc::clone(&self.memory);
        let mem = memory.guest_memory();
        for rq in self.queues.iter_mut().flatten() {
            if !rq.notify {
                continue;
            }
            rq.notify = false;
            // Without EVENT_IDX this is always true; with it, one interrupt per batch at most.
            if rq.queue.needs_notification(mem).unwrap_or(true) {
                if let Some(call) = &rq.call {
                    signal(call);
                }
            }
        }
    }

    /// Replaces a dead or misbehaving iothread and resubmits everything it had in flight.
    fn restart_iothread(&mut self) {
        let old_pid = self.link.pid();
        if let Some(fd) = self.link.control_fd() {
            self.unwatch(fd);
        }
        // Reaped before returning, so none of its I/O can still land after a resubmission.
        self.link.stop();
        // What it completed before dying is genuine; anything malformed is simply resubmitted.
        let _ = self.reap_completions();
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
                        self.fail_in_flight();
                        return;
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

    /// Last resort when no iothread can be started: fail what is in flight (a stuck guest is
    /// worse than an I/O error it can retry).
    fn fail_in_flight(&mut self) {
        let slots = &mut self.slots;
        self.throttler.abandon(|slot| {
            if let Some(s) = slots.get_mut(slot as usize) {
                s.throttled = false;
            }
        });
        let memory = Arc::clone(&self.memory);
        let mem = memory.guest_memory();
        let count = u32::try_from(self.slots.len()).unwrap_or(u32::MAX);
        for slot in 0..count {
            if self.slots.get(slot as usize).is_some_and(|s| s.in_flight) {
                let _ = self.finish(
                    Completion {
                        slot,
                        status: VIRTIO_BLK_S_IOERR,
                    },
                    mem,
                );
            }
        }
        self.notify_guests();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::tests::two_regions;

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
