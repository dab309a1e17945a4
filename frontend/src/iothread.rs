//! The frontend's side of one iothread: its shared ring, its wake-up eventfds, and the
//! `blkplane-iothread` process itself, which the spawner (spawner.rs) starts, this link hands
//! its descriptors, and which is replaced when it dies.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::Arc;

use blkplane_proto::control::{
    self, ControlError, ControlReply, ControlRequest, QueueSpec, SetupSpec, QUEUE_FLAG_CALL,
    SETUP_FLAG_DATA_FILE, SETUP_FLAG_DIRECT_FD, SETUP_FLAG_NULL_IMAGE,
};
use blkplane_proto::dirty_log::DirtyLog;
use blkplane_proto::inflight::InflightRegion;
use blkplane_proto::ring::{RingError, SharedRing};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::image::Image;
use crate::memory::MemoryTable;
use crate::queue_core::RingEnds;
use crate::spawner::{ExitStatus, Spawner, SpawnerError};
use blkplane_chain::ImageFormat;

/// What went wrong talking to an iothread.
#[derive(Debug, thiserror::Error)]
pub enum IothreadError {
    /// The ring could not be created.
    #[error("iothread ring: {0}")]
    Ring(#[from] RingError),
    /// The process could not be started.
    #[error(transparent)]
    Spawn(#[from] SpawnerError),
    /// A control message failed or was refused.
    #[error("iothread {index} control: {source}")]
    Control {
        /// Which iothread.
        index: usize,
        /// What failed.
        source: ControlError,
    },
    /// eventfd or socketpair failed.
    #[error("iothread setup: {0}")]
    Os(#[from] io::Error),
}

impl IothreadError {
    /// Whether the iothread went away during the call (its control socket failed or was
    /// closed), rather than refusing it: a successor may be asked again.
    pub fn iothread_gone(&self) -> bool {
        matches!(
            self,
            Self::Control {
                source: ControlError::Io(_) | ControlError::Closed,
                ..
            }
        )
    }
}

struct Process {
    pid: u32,
    /// Readable once the process has exited; signals go through it (no pid reuse race).
    pidfd: OwnedFd,
    control: UnixStream,
    /// Replies to messages sent without waiting (`SetDirtyLog`), read before the next call's.
    unread_replies: std::cell::Cell<u32>,
}

/// One iothread as its frontend worker sees it.
pub struct IothreadLink {
    index: usize,
    spawner: Arc<Spawner>,
    image: Arc<Image>,
    block_size: u32,
    ring: SharedRing,
    /// Written to wake a sleeping iothread.
    pub submit_event: EventFd,
    /// Written by the iothread to wake this worker.
    pub complete_event: EventFd,
    process: Option<Process>,
    /// How the process before the current one ended, as the spawner saw it.
    previous_exit: Option<ExitStatus>,
    /// CPUs the process may run on (`--iothread-cpus`); all when `None`.
    cpus: Option<libc::cpu_set_t>,
    /// The bound of the process's polling of its submission queue, in µs (`--poll-max-us`).
    poll_max_us: u32,
}

impl IothreadLink {
    /// The counters the iothreads of this ring keep in it (for the statistics).
    pub fn ring_counters(&self) -> blkplane_proto::ring::RingCounters {
        self.ring.counters()
    }

    /// The frontend's ends of the ring, valid until the next [`IothreadLink::start`] (which
    /// resets its queues).
    pub fn ring_ends(&self) -> RingEnds {
        RingEnds {
            submissions: self.ring.submission_producer(),
            completions: self.ring.completion_consumer(),
            slots: self.ring.slots(),
        }
    }

    /// Creates the ring and eventfds; the process is started by [`IothreadLink::start`].
    pub fn new(
        index: usize,
        spawner: Arc<Spawner>,
        image: Arc<Image>,
        block_size: u32,
        slot_count: u32,
        segments_per_slot: u32,
    ) -> Result<Self, IothreadError> {
        let ring = SharedRing::create(slot_count, segments_per_slot)?;
        Ok(Self {
            index,
            spawner,
            image,
            block_size,
            ring,
            submit_event: EventFd::new(EFD_NONBLOCK)?,
            complete_event: EventFd::new(EFD_NONBLOCK)?,
            process: None,
            previous_exit: None,
            cpus: None,
            poll_max_us: 0,
        })
    }

    /// Restricts this iothread (from its next start on) to `cpus`.
    pub fn set_cpus(&mut self, cpus: &[usize]) {
        // SAFETY: an all-zero cpu_set_t is the empty set.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        for &cpu in cpus {
            // SAFETY: CPU_SET ignores CPUs beyond the set's capacity (the CLI bounds them).
            unsafe { libc::CPU_SET(cpu, &mut set) };
        }
        self.cpus = Some(set);
    }

    /// Lets this iothread (from its next start on) poll its submission queue for up to `max`
    /// before it sleeps with nothing at the device (`--poll-max-us`; zero: never).
    pub fn set_poll_max(&mut self, max: std::time::Duration) {
        self.poll_max_us = u32::try_from(max.as_micros()).unwrap_or(u32::MAX);
    }

    /// The process's pidfd, readable once it has exited: what the worker watches for the
    /// iothread's death. (Not the control socket: it is also readable while a reply is owed,
    /// such as the one to an announced dirty log, and a live iothread would then be taken for
    /// a dead one and replaced.) `None` when no process runs.
    pub fn death_fd(&self) -> Option<RawFd> {
        self.process.as_ref().map(|p| p.pidfd.as_raw_fd())
    }

    /// How the process the last [`IothreadLink::start`] replaced had ended (`None` if none
    /// had, or it was asked already).
    pub fn take_previous_exit(&mut self) -> Option<ExitStatus> {
        self.previous_exit.take()
    }

    /// The process id, when one runs.
    pub fn pid(&self) -> Option<u32> {
        self.process.as_ref().map(|p| p.pid)
    }

    fn control_error(&self, source: ControlError) -> IothreadError {
        IothreadError::Control {
            index: self.index,
            source,
        }
    }

    /// Starts a process on a fresh ring (queues reset) and hands it `memory`.
    pub fn start(&mut self, memory: &MemoryTable) -> Result<(), IothreadError> {
        self.stop();
        self.ring.reset_queues();
        let (ours, theirs) = control::socket_pair()?;
        let index = u32::try_from(self.index).unwrap_or(u32::MAX);
        let spawned = self
            .spawner
            .spawn(index, theirs.as_raw_fd(), self.cpus.as_ref())?;
        drop(theirs);
        // The first death since the worker last asked is the one that matters: a start that
        // failed set-up (and was stopped) must not hide how the iothread before it ended.
        if self.previous_exit.is_none() {
            self.previous_exit = spawned.previous;
        }
        self.process = Some(Process {
            pid: spawned.pid,
            pidfd: spawned.pidfd,
            control: ours,
            unread_replies: std::cell::Cell::new(0),
        });
        let result = self.setup(memory);
        if result.is_err() {
            self.stop();
        }
        result
    }

    fn setup(&mut self, memory: &MemoryTable) -> Result<(), IothreadError> {
        let mut fds = vec![
            self.ring.file().as_raw_fd(),
            self.submit_event.as_raw_fd(),
            self.complete_event.as_raw_fd(),
        ];
        let mut backing_files = 0u32;
        let mut qcow2_layers = 0u32;
        let (flags, image_size) = match &*self.image {
            Image::File(file) => {
                fds.push(file.buffered.as_raw_fd());
                let mut flags = match &file.direct {
                    Some(direct) => {
                        fds.push(direct.as_raw_fd());
                        SETUP_FLAG_DIRECT_FD
                    }
                    None => 0,
                };
                if let Some(data_file) = &file.data_file {
                    fds.push(data_file.as_raw_fd());
                    flags |= SETUP_FLAG_DATA_FILE;
                }
                if file.format == ImageFormat::Qcow2 {
                    qcow2_layers = 1;
                    // At most MAX_BACKING_FILES (chain::open bounds the chain): the shifts
                    // stay inside a u32.
                    for (index, backing) in (1u32..).zip(&file.backing) {
                        fds.push(backing.file.as_raw_fd());
                        backing_files = index;
                        if backing.format == ImageFormat::Qcow2 {
                            qcow2_layers |= 1u32.checked_shl(index).unwrap_or(0);
                        }
                    }
                }
                // The iothread reads a raw file's size from the fd itself, a qcow2 image's
                // from its header.
                (flags, 0)
            }
            Image::Null { size } => (SETUP_FLAG_NULL_IMAGE, *size),
        };
        let request = ControlRequest::Setup(SetupSpec {
            flags,
            logical_block_size: self.block_size,
            image_size,
            poll_max_us: self.poll_max_us,
            backing_files,
            qcow2_layers,
        });
        self.call(&request, &fds)?;
        self.set_memory(memory)
    }

    fn call(&self, request: &ControlRequest, fds: &[RawFd]) -> Result<(), IothreadError> {
        let process = self
            .process
            .as_ref()
            .ok_or_else(|| self.control_error(ControlError::Closed))?;
        self.read_unread_replies(process)?;
        control::send_request(&process.control, request, fds)
            .and_then(|()| ControlReply::recv(&process.control))
            .map_err(|e| self.control_error(e))
    }

    fn read_unread_replies(&self, process: &Process) -> Result<(), IothreadError> {
        while process.unread_replies.get() > 0 {
            process
                .unread_replies
                .set(process.unread_replies.get().saturating_sub(1));
            match ControlReply::recv(&process.control) {
                Ok(()) => {}
                Err(ControlError::Refused(e)) => {
                    log::error!("iothread {} refused the dirty log: {e}", self.index);
                }
                Err(e) => return Err(self.control_error(e)),
            }
        }
        Ok(())
    }

    /// Hands the iothread a new memory table. The caller has made sure that none of this
    /// iothread's requests is in flight.
    pub fn set_memory(&mut self, memory: &MemoryTable) -> Result<(), IothreadError> {
        let (regions, fds) = memory.iothread_table();
        self.call(&ControlRequest::SetMemoryTable(regions), &fds)
    }

    /// Asks the iothread to grow its qcow2 image's virtual size to `size` bytes.
    pub fn grow_image(&self, size: u64) -> Result<(), IothreadError> {
        self.call(&ControlRequest::GrowImage { size }, &[])
    }

    /// Hands the iothread a virtqueue to complete requests of: `spec` says where its rings
    /// are, `region` is the inflight region its requests are marked in, `call` its call
    /// eventfd.
    pub fn start_queue(
        &self,
        mut spec: QueueSpec,
        region: &InflightRegion,
        call: Option<&std::fs::File>,
    ) -> Result<(), IothreadError> {
        spec.inflight_queues = region.num_queues();
        spec.inflight_size = region.queue_size();
        spec.inflight_offset = region.mmap_offset();
        let mut fds = vec![region.file().as_raw_fd()];
        match call {
            Some(call) => {
                spec.flags |= QUEUE_FLAG_CALL;
                fds.push(call.as_raw_fd());
            }
            None => spec.flags &= !QUEUE_FLAG_CALL,
        }
        self.call(&ControlRequest::StartQueue(spec), &fds)
    }

    /// Tells the iothread to forget a queue (none of its requests is in flight).
    pub fn stop_queue(&self, queue: u16) -> Result<(), IothreadError> {
        self.call(&ControlRequest::StopQueue { queue }, &[])
    }

    /// Replaces a started queue's call eventfd.
    pub fn set_call(&self, queue: u16, call: Option<&std::fs::File>) -> Result<(), IothreadError> {
        let fds: Vec<RawFd> = call.iter().map(|f| f.as_raw_fd()).collect();
        let request = ControlRequest::SetCall {
            queue,
            has_call: call.is_some(),
        };
        self.call(&request, &fds)
    }

    /// Starts (`Some`) or stops marking a migration's dirty log in the iothread, waiting for
    /// the answer (a freshly started iothread, before it is given requests).
    pub fn set_dirty_log(&self, log: Option<&DirtyLog>) -> Result<(), IothreadError> {
        match log {
            Some(log) => self.call(
                &ControlRequest::SetDirtyLog(Some(log.spec())),
                &[log.file().as_raw_fd()],
            ),
            None => self.call(&ControlRequest::SetDirtyLog(None), &[]),
        }
    }

    /// Announces a new dirty log (or none) to a running iothread without waiting for it: the
    /// message is sent, then the ring's [`blkplane_proto::ring::LogEpoch`] is bumped, which the
    /// iothread checks before it publishes anything — so the VMM's LOG_ALL is acknowledged at
    /// once even while the iothread is busy or stopped, and every write of the iothread after
    /// the acknowledgement is marked. The reply is read before the next call's.
    pub fn announce_dirty_log(&self, log: Option<&DirtyLog>) -> Result<(), IothreadError> {
        let process = self
            .process
            .as_ref()
            .ok_or_else(|| self.control_error(ControlError::Closed))?;
        let (request, fds) = match log {
            Some(log) => (
                ControlRequest::SetDirtyLog(Some(log.spec())),
                vec![log.file().as_raw_fd()],
            ),
            None => (ControlRequest::SetDirtyLog(None), Vec::new()),
        };
        control::send_request(&process.control, &request, &fds)
            .map_err(|e| self.control_error(e))?;
        process
            .unread_replies
            .set(process.unread_replies.get().saturating_add(1));
        self.ring.log_epoch().bump();
        Ok(())
    }

    /// Kills the process (if any) and waits for it, so that none of its I/O is still
    /// running: the kernel cancels or completes a dying task's io_uring requests before the
    /// task can be reaped.
    pub fn stop(&mut self) {
        if let Some(process) = self.process.take() {
            kill_and_wait(&process.pidfd);
        }
    }

    /// Wakes the iothread.
    pub fn wake(&self) {
        // EAGAIN only means the counter is already non-zero: it is awake-pending anyway.
        let _ = self.submit_event.write(1);
    }

    /// Consumes a pending completion wake-up.
    pub fn clear_completion_event(&self) {
        let _ = self.complete_event.read();
    }
}

impl Drop for IothreadLink {
    fn drop(&mut self) {
        if let Some(process) = &self.process {
            let _ = control::send_request(&process.control, &ControlRequest::Shutdown, &[]);
        }
        self.stop();
    }
}

/// Kills the process behind `pidfd` and waits until it has exited. The pidfd turns readable
/// only once every thread of the process is gone, which is after the kernel cancelled or
/// completed its io_uring requests (each exiting task does that first), as with a wait for a
/// child. The spawner, its parent, reaps it.
fn kill_and_wait(pidfd: &OwnedFd) {
    // SAFETY: pidfd_send_signal on a pidfd we own, no siginfo.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd.as_raw_fd(),
            libc::SIGKILL,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
    if rc < 0 {
        // ESRCH: it has exited already, which the poll below sees at once.
        log::debug!("pidfd_send_signal: {}", io::Error::last_os_error());
    }
    let mut fds = [libc::pollfd {
        fd: pidfd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    }];
    loop {
        // SAFETY: one pollfd for a pidfd we own, no timeout.
        let rc = unsafe { libc::poll(fds.as_mut_ptr(), 1, -1) };
        if rc > 0 || (rc < 0 && io::Error::last_os_error().kind() != io::ErrorKind::Interrupted) {
            return;
        }
    }
}
