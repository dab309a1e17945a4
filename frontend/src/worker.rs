//! The frontend's queue workers: one thread per iothread, the event loop around the
//! [`QueueCore`] of the virtqueues assigned to that iothread.
//!
//! A worker sleeps in epoll on its queues' kick eventfds, its command eventfd, its throttle
//! timer and its iothread's pidfd (readable once the iothread has died). On a kick
//! the core pops **every** available chain, validates each into a ring slot, and the worker
//! publishes the whole batch with one index store — waking the iothread only if it sleeps.
//!
//! The iothread completes what it executes — status byte, used ring, inflight region, dirty
//! log, interrupt — and is the only writer of the used rings (see [`crate::queue_core`]). Its
//! completions tell the core which slots are free and feed the statistics; the worker has the
//! core read them whenever it wakes anyway, before it looks at the avail rings, and is woken
//! for them only while it waits for requests to finish (a ring stop, a drain, a memory-table
//! change, statistics asked for).
//!
//! Everything here is descriptors, threads and channels; every decision about a request is
//! the core's. No lock is taken on the I/O path. The vhost-user, admin and lifecycle threads
//! talk to the workers through [`Workers`], by [`Command`]s, and wait for the reply.

use std::fs::File;
use std::io::{self, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use blkplane_poll::AdaptivePoll;
use blkplane_proto::clock::monotonic_ns;
use blkplane_proto::control::ControlError;
use blkplane_proto::dirty_log::DirtyLog;
use blkplane_proto::inflight::QueueInflight;
use blkplane_proto::write_bitmap::WriteBitmap;
use log::{error, info, warn};
use virtio_queue::Queue;
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};
use vmm_sys_util::timerfd::TimerFd;

use crate::config::DiskConfig;
use crate::iothread::{IothreadError, IothreadLink};
use crate::memory::MemoryTable;
use crate::queue_core::{Action, QueueCore};
use crate::stats::DeviceStatus;
use crate::throttle::DiskThrottle;

const TOKEN_COMMAND: u64 = u64::MAX;
const TOKEN_COMPLETION: u64 = u64::MAX - 1;
const TOKEN_IOTHREAD: u64 = u64::MAX - 2;
const TOKEN_THROTTLE: u64 = u64::MAX - 3;
/// Consecutive failed iothread starts before the frontend gives up.
const MAX_START_ATTEMPTS: u32 = 5;

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
    /// Grow a qcow2 image's virtual size: the iothread owns its metadata (ResizeDisk).
    GrowImage {
        /// The new virtual size in bytes.
        size: u64,
        /// Whether the iothread grew it.
        reply: Sender<Result<(), String>>,
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
    /// Start (`Some`) or stop (`None`) marking the image blocks the guest writes in a bitmap
    /// blkplaned copies the disk by (TrackWrites on the admin channel).
    TrackWrites {
        /// The bitmap.
        bitmap: Option<Arc<WriteBitmap>>,
        /// Acknowledgement: every write in flight is marked, and every later one will be.
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

/// A nonblocking timerfd, so that an expiry that has not come can be consumed without waiting.
fn nonblocking_timer() -> io::Result<TimerFd> {
    let timer = TimerFd::new()?;
    // SAFETY: fcntl on a descriptor this function owns; the result is checked.
    if unsafe { libc::fcntl(timer.as_raw_fd(), libc::F_SETFL, libc::O_NONBLOCK) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(timer)
}

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
        let memory = Arc::new(MemoryTable::empty());
        link.start(&memory).map_err(io::Error::other)?;
        let fds = queue_ids.iter().map(|_| None).collect();
        let core = QueueCore::new(
            Arc::clone(&disk),
            Arc::clone(&status),
            queue_ids,
            memory,
            link.ring_ends(),
        );
        let worker = Worker {
            index,
            status,
            core,
            fds,
            link,
            epoll: Epoll::new()?,
            commands: receiver,
            wake: wake.try_clone()?,
            poll: AdaptivePoll::new(disk.poll_max),
            throttle_timer: nonblocking_timer()?,
            replace_iothread: false,
        };
        if let Some(iothread) = worker.status.iothreads.get(index) {
            // The ring outlives its iothreads: its counters are the statistics' for good.
            let _ = iothread.ring_counters.set(worker.link.ring_counters());
        }
        worker.publish_iothread_pid();
        worker.watch(worker.wake.as_raw_fd(), TOKEN_COMMAND)?;
        worker.watch(worker.link.complete_event.as_raw_fd(), TOKEN_COMPLETION)?;
        worker.watch(worker.throttle_timer.as_raw_fd(), TOKEN_THROTTLE)?;
        if let Some(fd) = worker.link.death_fd() {
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
        self.post(make)?.recv().map_err(|_| WorkerGone)
    }
}

/// Every worker of a disk, as the vhost-user, admin and lifecycle threads reach them: device
/// queue `q` is served by worker `q % len`. Cheap to clone; a command reaches a worker without
/// any lock.
#[derive(Clone)]
pub struct Workers(Arc<[WorkerHandle]>);

impl Workers {
    /// The disk's workers, worker `i` serving the queues `i, i + n, …`.
    pub fn new(handles: Vec<WorkerHandle>) -> Self {
        Self(handles.into())
    }

    /// Every worker, in index order.
    pub fn iter(&self) -> std::slice::Iter<'_, WorkerHandle> {
        self.0.iter()
    }

    /// The workers as a slice (what drain and resume go through).
    pub fn as_slice(&self) -> &[WorkerHandle] {
        &self.0
    }

    /// The worker serving device queue `queue`.
    pub fn for_queue(&self, queue: u16) -> Option<&WorkerHandle> {
        let count = self.0.len().max(1);
        self.0
            .get(usize::from(queue).checked_rem(count).unwrap_or(0))
    }
}

/// How the admin thread makes every worker read its completions before it reads the
/// statistics: completions do not wake a worker, so without this the counters of a disk that
/// went idle would lag behind its last requests.
pub struct WorkerStatistics(pub Workers);

/// How long the admin thread waits for each worker to read its completions.
const SETTLE_TIMEOUT: Duration = Duration::from_millis(200);

impl crate::admin::SettleStatistics for WorkerStatistics {
    fn settle(&self) {
        let answers: Vec<Receiver<()>> = self
            .0
            .iter()
            .filter_map(|worker| {
                worker
                    .post(|reply| Command::SettleStatistics { reply })
                    .ok()
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

/// The descriptors of a running ring.
struct RingFds {
    /// The driver's kick eventfd.
    kick: File,
    /// The call eventfd, kept for the iothread's successors.
    call: Option<File>,
    /// The error eventfd, signalled when the ring is found broken.
    err: Option<File>,
}

struct Worker {
    index: usize,
    /// Counters and status for the admin channel (the iothread's pid and restarts).
    status: Arc<DeviceStatus>,
    /// Every decision about the rings and their requests.
    core: QueueCore,
    /// Per local queue, the descriptors of the ring while it runs.
    fds: Vec<Option<RingFds>>,
    link: IothreadLink,
    epoll: Epoll,
    commands: Receiver<Command>,
    wake: EventFd,
    /// How long to watch the avail rings before sleeping while requests are in flight.
    /// The polling window, bounded by the disk's `--poll-max-us`.
    poll: AdaptivePoll,
    /// Fires when throttled requests may go ([`Action::ArmThrottleTimer`]).
    throttle_timer: TimerFd,
    /// The core found the iothread breaking the completion queue's rules
    /// ([`Action::ReplaceIothread`]): it is replaced by the event loop.
    replace_iothread: bool,
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

impl Worker {
    fn publish_iothread_pid(&self) {
        if let Some(iothread) = self.status.iothreads.get(self.index) {
            iothread.pid.store(
                self.link.pid().unwrap_or(0),
                std::sync::atomic::Ordering::Relaxed,
            );
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
            let waiting = (self.core.in_flight() > 0 && self.poll.enabled()).then(Instant::now);
            let caught = waiting.is_some_and(|start| self.poll_avail(start));
            // The worker is not woken for completions: it reads them below, whenever it wakes.
            self.core.release_completions();
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
            let mut iothread_died = self.core.reap().is_err();
            for event in events.iter().take(ready) {
                match event.data() {
                    TOKEN_COMMAND => {
                        drain_eventfd(self.wake.as_raw_fd());
                        while let Ok(command) = self.commands.try_recv() {
                            self.handle(command);
                        }
                    }
                    TOKEN_COMPLETION => self.link.clear_completion_event(),
                    TOKEN_THROTTLE => self.throttle_timer_fired(),
                    TOKEN_IOTHREAD => iothread_died = true,
                    local => {
                        let local = blkplane_proto::usize_from(local);
                        if let Some(Some(ring)) = self.fds.get(local) {
                            drain_eventfd(ring.kick.as_raw_fd());
                            // Read per kick, not per wake-up: a command handled before it
                            // may have waited (a stop, a drain).
                            self.core.process_ring(local, monotonic_ns());
                        }
                    }
                }
            }
            if caught {
                self.core.process_all(monotonic_ns());
            }
            self.flush();
            if iothread_died || std::mem::take(&mut self.replace_iothread) {
                self.restart_iothread();
            }
        }
    }

    /// Polls the avail rings until one has a new entry or the poll window since `start` has
    /// passed; returns whether one had.
    fn poll_avail(&self, start: Instant) -> bool {
        let window = self.poll.window();
        if window.is_zero() || self.core.paused() {
            return false;
        }
        blkplane_poll::spin_until(start, window, || self.core.avail_pending())
    }

    /// Publishes what the core queued (waking the iothread if it sleeps) and does what the
    /// core asked for.
    fn flush(&mut self) {
        if self.core.publish_submissions() {
            self.link.wake();
        }
        while let Some(action) = self.core.next_action() {
            match action {
                Action::RingBroken(local) => {
                    if let Some(Some(ring)) = self.fds.get(local) {
                        if let Some(err) = &ring.err {
                            signal(err);
                        }
                        self.unwatch(ring.kick.as_raw_fd());
                    }
                }
                Action::Rekick(local) => {
                    if let Some(Some(ring)) = self.fds.get(local) {
                        signal(&ring.kick);
                    }
                }
                Action::ArmThrottleTimer(deadline) => {
                    let after = Duration::from_nanos(deadline.saturating_sub(monotonic_ns()));
                    let armed = self
                        .throttle_timer
                        .reset(after.max(Duration::from_nanos(1)), None);
                    if let Err(e) = armed {
                        warn!("worker {}: arming the throttle timer: {e}", self.index);
                        self.core.throttle_timer_not_armed();
                    }
                }
                Action::ReplaceIothread => self.replace_iothread = true,
            }
        }
    }

    /// The throttle timer fired (or may have): consume it and let go what may go.
    fn throttle_timer_fired(&mut self) {
        // Nonblocking: nothing to read is fine.
        let _ = self.throttle_timer.wait();
        self.core.release_throttled(monotonic_ns());
    }

    /// Hands a running ring to the iothread. A refusal (the ring does not lie in the memory
    /// table the iothread has) breaks the ring; an iothread that is gone is replaced by the
    /// event loop, which hands it every running ring.
    fn start_on_iothread(&mut self, local: usize) {
        let Some((spec, region)) = self.core.ring_handover(local) else {
            return;
        };
        let call = self
            .fds
            .get(local)
            .and_then(Option::as_ref)
            .and_then(|ring| ring.call.as_ref());
        match self.link.start_queue(spec, region, call) {
            Ok(()) => {}
            Err(IothreadError::Control {
                source: ControlError::Refused(e),
                ..
            }) => self
                .core
                .break_ring(local, &format!("the iothread refused the ring: {e}")),
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
                if let Some(local) = self.core.local_index(queue) {
                    self.start_ring(local, *vring);
                }
                let _ = reply.send(());
            }
            Command::Stop { queue, reply } => {
                let next_avail = self
                    .core
                    .local_index(queue)
                    .and_then(|local| self.stop_ring(local));
                let _ = reply.send(next_avail);
            }
            Command::SetCall { queue, call, reply } => {
                if let Some(local) = self.core.local_index(queue) {
                    if let Some(Some(ring)) = self.fds.get_mut(local) {
                        // Kept for the iothread's successors.
                        ring.call = call;
                        let local16 = u16::try_from(local).unwrap_or(u16::MAX);
                        if let Err(e) = self.link.set_call(local16, ring.call.as_ref()) {
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
                self.wait_until(|core| core.in_flight() == 0);
                let result = self.link.set_memory(&memory).map_err(|e| e.to_string());
                if result.is_ok() {
                    self.core.set_memory(memory);
                }
                let _ = reply.send(result);
            }
            Command::Pause { reply } => {
                self.core.pause();
                let waited = u64::from(self.core.in_flight());
                self.wait_until(|core| core.in_flight() == 0);
                let _ = reply.send(waited);
            }
            Command::GrowImage { size, reply } => {
                let mut result = self.link.grow_image(size);
                if result.as_ref().is_err_and(IothreadError::iothread_gone) {
                    // It died before answering, having grown the image or not: its successor
                    // reads the header afresh, and growing to the size it has changes nothing.
                    self.restart_iothread();
                    result = self.link.grow_image(size);
                }
                let _ = reply.send(result.map_err(|e| e.to_string()));
            }
            Command::SetThrottle { throttle, reply } => {
                self.core.set_throttle(throttle, monotonic_ns());
                self.flush();
                let _ = reply.send(());
            }
            Command::SetDirtyLog { log, reply } => {
                if let Err(e) = self.link.announce_dirty_log(log.as_deref()) {
                    // A dead iothread's successor gets the log when it starts; one that
                    // refuses it cannot mark what it writes, which the VMM must hear of.
                    error!("worker {}: handing the dirty log over: {e}", self.index);
                }
                self.core.set_dirty_log(log);
                let _ = reply.send(());
            }
            Command::TrackWrites { bitmap, reply } => {
                self.core.set_write_bitmap(bitmap);
                let _ = reply.send(());
            }
            Command::SettleStatistics { reply } => {
                if self.core.reap().is_err() {
                    self.restart_iothread();
                }
                let _ = reply.send(());
            }
            Command::Resume { reply } => {
                self.core.resume(monotonic_ns());
                self.flush();
                let _ = reply.send(());
            }
        }
    }

    /// Serves a ring the vhost-user thread set up (replacing the one at `local`, if any).
    fn start_ring(&mut self, local: usize, vring: VringStart) {
        self.stop_ring(local);
        let VringStart {
            queue,
            kick,
            call,
            err,
            inflight,
            resubmit,
            reconnected,
        } = vring;
        if reconnected {
            // Used entries a crashed predecessor published may never have been signalled; a
            // spurious interrupt is harmless, a missing one hangs the guest.
            if let Some(call) = &call {
                signal(call);
            }
        }
        if let Err(e) = self.watch(kick.as_raw_fd(), local as u64) {
            error!(
                "worker {}: cannot watch kick fd of queue {local}: {e}",
                self.index
            );
        }
        if let Some(entry) = self.fds.get_mut(local) {
            *entry = Some(RingFds { kick, call, err });
        }
        self.core.start_ring(local, queue, inflight, resubmit);
        self.start_on_iothread(local);
        // The driver may have queued requests before the ring started; a predecessor's
        // requests in flight are resubmitted first.
        self.core.process_ring(local, monotonic_ns());
        self.flush();
    }

    /// Drains and removes a ring; returns its next avail index.
    fn stop_ring(&mut self, local: usize) -> Option<u16> {
        self.wait_until(|core| core.ring_idle(local));
        // A break found while waiting is signalled before the ring's descriptors go.
        self.flush();
        let next_avail = self.core.remove_ring(local)?;
        if let Some(ring) = self.fds.get_mut(local).and_then(Option::take) {
            self.unwatch(ring.kick.as_raw_fd());
        }
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
        Some(next_avail)
    }

    /// Serves completions (and iothread restarts) until `done` holds. Pops nothing new.
    fn wait_until(&mut self, done: impl Fn(&QueueCore) -> bool) {
        // Nothing new is popped while waiting: what waits for the limits goes now.
        self.core.release_all_throttled(monotonic_ns());
        while !done(&self.core) {
            self.flush();
            let mut died = std::mem::take(&mut self.replace_iothread);
            if !died && self.core.prepare_to_wait_for_completions() {
                let death = self.link.death_fd().unwrap_or(-1);
                let mut fds = [
                    libc::pollfd {
                        fd: self.link.complete_event.as_raw_fd(),
                        events: libc::POLLIN,
                        revents: 0,
                    },
                    libc::pollfd {
                        fd: death,
                        events: libc::POLLIN,
                        revents: 0,
                    },
                    // Throttled requests count as in flight: their timer must keep firing.
                    libc::pollfd {
                        fd: self.throttle_timer.as_raw_fd(),
                        events: libc::POLLIN,
                        revents: 0,
                    },
                ];
                // SAFETY: polls three descriptors described by a local array.
                let _ = unsafe { libc::poll(fds.as_mut_ptr(), 3, 1000) };
                self.core.woke_up();
                died = death < 0 || fds[1].revents != 0;
                self.link.clear_completion_event();
                if fds[2].revents != 0 {
                    self.throttle_timer_fired();
                }
            }
            if died || self.core.reap().is_err() {
                self.restart_iothread();
            }
        }
    }

    /// Replaces a dead or misbehaving iothread and resubmits everything it had not put on the
    /// used rings; the inflight regions say what that is ([`QueueCore::iothread_gone`]).
    fn restart_iothread(&mut self) {
        let old_pid = self.link.pid();
        if let Some(fd) = self.link.death_fd() {
            self.unwatch(fd);
        }
        // Reaped before returning, so none of its I/O can still land after a resubmission.
        self.link.stop();
        // What it completed before dying frees its slots; anything malformed is ignored.
        let _ = self.core.reap();
        self.core.iothread_gone();
        let mut attempt = 0u32;
        loop {
            match self.link.start(self.core.memory()) {
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
        self.core.attach(self.link.ring_ends());
        self.publish_iothread_pid();
        let previous = self.link.take_previous_exit();
        let how = match previous {
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
        if let Some(fd) = self.link.death_fd() {
            if let Err(e) = self.watch(fd, TOKEN_IOTHREAD) {
                error!("worker {}: cannot watch iothread: {e}", self.index);
            }
        }
        for local in 0..self.core.queue_count() {
            self.start_on_iothread(local);
        }
        if let Some(log) = self.core.dirty_log() {
            if let Err(e) = self.link.set_dirty_log(Some(log)) {
                error!("worker {}: handing the dirty log over: {e}", self.index);
            }
        }
        let crashed = previous.is_some_and(|exit| exit.is_own_fault());
        let done = self.core.resubmit_in_flight(crashed);
        info!(
            "worker {}: iothread {:?} replaced by {:?}; resubmitted {} requests{}",
            self.index,
            old_pid,
            self.link.pid(),
            done.resubmitted,
            if done.failed > 0 {
                format!(", failed {} that every iothread crashed on", done.failed)
            } else {
                String::new()
            }
        );
        self.flush();
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
