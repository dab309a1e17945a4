//! The vhost-user back-end: blkplane's own request handler on the `vhost` crate's
//! [`VhostUserBackendReqHandlerMut`] trait.
//!
//! In vhost-user words the frontend process is the *back-end* and the VMM the *front-end*.
//! This handler owns the device state the VMM configures (features, memory table, ring
//! addresses and eventfds) and hands finished rings to the [`WorkerHandle`]s that serve them.
//! Owning the handler (rather than vhost-user-backend's) is what lets it carry
//! INFLIGHT_SHMFD, dirty logging (LOG_SHMFD, LOG_ALL) and config-change messages.

use std::fs::File;
use std::io;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use log::{error, info, warn};
use vhost::vhost_user::message::{
    VhostTransferStateDirection, VhostTransferStatePhase, VhostUserConfigFlags, VhostUserInflight,
    VhostUserLog, VhostUserMemoryRegion, VhostUserProtocolFeatures, VhostUserShMemConfig,
    VhostUserSharedMsg, VhostUserSingleMemoryRegion, VhostUserVirtioFeatures,
    VhostUserVringAddrFlags, VhostUserVringState,
};
use vhost::vhost_user::{
    Backend, Error as VhostError, GpuBackend, Result as VhostResult, VhostUserBackendReqHandlerMut,
};
use vhost::VhostUserMemoryRegionBase;
use virtio_bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX;
use virtio_queue::{Queue, QueueT};
use vm_memory::GuestAddress;

use crate::backend_channel::BackendChannel;
use crate::config::{DiskConfig, MAX_MEM_SLOTS, MAX_QUEUE_SIZE};
use crate::image::Image;
use crate::lifecycle;
use crate::memory::{MemoryTable, RegionDescriptor};
use crate::stats::DeviceStatus;
use crate::worker::{Command, VringStart, WorkerHandle, Workers};
use blkplane_proto::dirty_log::DirtyLog;
use blkplane_proto::inflight::{self, InflightRegion};

/// Setup state of one ring as the VMM has described it so far.
#[derive(Default)]
struct VringSetup {
    size: u16,
    desc_user_addr: u64,
    avail_user_addr: u64,
    used_user_addr: u64,
    addresses_set: bool,
    base: u16,
    kick: Option<File>,
    call: Option<File>,
    err: Option<File>,
    enabled: bool,
    running: bool,
}

/// The device state behind one vhost-user socket; it outlives connections.
pub struct BlkBackend {
    disk: Arc<DiskConfig>,
    status: Arc<DeviceStatus>,
    backend_channel: Arc<BackendChannel>,
    workers: Workers,
    acked_features: u64,
    acked_protocol_features: u64,
    memory: Arc<MemoryTable>,
    vrings: Vec<VringSetup>,
    /// The inflight region of this session (GET_INFLIGHT_FD / SET_INFLIGHT_FD), used by the
    /// rings started after it was set.
    inflight: Option<Arc<InflightRegion>>,
    /// The dirty log of SET_LOG_BASE; the workers mark it while LOG_ALL is acknowledged.
    dirty_log: Option<Arc<DirtyLog>>,
    /// The image, made durable when a migration stops a ring (see `get_vring_base`).
    image: Arc<Image>,
    /// The last request was refused and the VMM was told so with a REPLY_ACK status (see
    /// [`BlkBackend::take_acked_refusal`]).
    acked_refusal: bool,
    /// SET_OWNER was received on this connection: it starts a session, once.
    owned: bool,
    /// What this node's page cache holds of the image may be older than the image (another
    /// node wrote it last: `--incoming-shared`): dropped before the first ring starts.
    stale_cache: bool,
}

/// The most regions one SET_MEM_TABLE may carry: the spec's "up to 8"
/// (VHOST_MEMORY_BASELINE_NREGIONS in QEMU and libvhost-user; its fd array has 8 entries).
/// More memory slots go one by one with ADD_MEM_REG (CONFIGURE_MEM_SLOTS).
pub const SET_MEM_TABLE_MAX_REGIONS: usize = 8;

fn invalid(what: &str) -> VhostError {
    warn!("refused vhost-user request: {what}");
    VhostError::InvalidParam
}

fn handler_error(e: impl std::fmt::Display) -> VhostError {
    warn!("vhost-user request failed: {e}");
    VhostError::ReqHandlerError(io::Error::other(e.to_string()))
}

impl BlkBackend {
    /// A device for `disk` (backed by `image`) whose queue `q` is served by
    /// `workers[q % workers.len()]`.
    pub fn new(
        disk: Arc<DiskConfig>,
        status: Arc<DeviceStatus>,
        backend_channel: Arc<BackendChannel>,
        image: Arc<Image>,
        workers: Workers,
    ) -> Self {
        let vrings = (0..disk.num_queues)
            .map(|_| VringSetup::default())
            .collect();
        Self {
            disk,
            status,
            backend_channel,
            workers,
            acked_features: 0,
            acked_protocol_features: 0,
            memory: Arc::new(MemoryTable::empty()),
            vrings,
            inflight: None,
            dirty_log: None,
            image,
            acked_refusal: false,
            owned: false,
            stale_cache: false,
        }
    }

    /// With `stale`, the node's page cache of the image is dropped before the first ring
    /// starts (a live-migration destination whose image another node wrote last).
    pub fn with_stale_cache(mut self, stale: bool) -> Self {
        self.stale_cache = stale;
        self
    }

    /// Drops the image's pages from this node's page cache, once, if they may be stale.
    /// Until a ring starts no request has read the image here, so from then on every read
    /// comes from the image as the source node left it (it fdatasync'ed it when its rings
    /// stopped, before the VMM handed the VM over).
    /// Fails (and no ring starts) if the pages cannot be dropped: stale data would reach
    /// the guest; the next ring start tries again.
    fn drop_stale_cache(&mut self) -> VhostResult<()> {
        if !self.stale_cache {
            return Ok(());
        }
        let start = Instant::now();
        match self.image.drop_cached_pages() {
            Ok(dropped) => {
                self.stale_cache = false;
                if dropped {
                    info!(
                        "dropped this node's cached pages of the image before serving, in {} µs",
                        start.elapsed().as_micros()
                    );
                }
                Ok(())
            }
            Err(e) => {
                error!(
                    "dropping this node's cached pages of the image failed: {e}; no ring \
                     starts, since reads could return data older than the migration source's \
                     last writes"
                );
                Err(handler_error(e))
            }
        }
    }

    /// Whether the last handled request was refused with a REPLY_ACK error status (rather than
    /// failing in a way the VMM cannot see): the session can go on. Clears the flag.
    pub fn take_acked_refusal(&mut self) -> bool {
        std::mem::take(&mut self.acked_refusal)
    }

    /// The VMM acknowledged VHOST_F_LOG_ALL: a migration is copying guest memory.
    fn logging(&self) -> bool {
        self.acked_features & VhostUserVirtioFeatures::LOG_ALL.bits() != 0
    }

    /// Hands every worker the log to mark (`None`: stop marking). Synchronous: once it
    /// returns, every write a worker completes is marked.
    fn set_workers_log(&self, log: Option<&Arc<DirtyLog>>) -> VhostResult<()> {
        for worker in self.workers.iter() {
            worker
                .call(|reply| Command::SetDirtyLog {
                    log: log.cloned(),
                    reply,
                })
                .map_err(handler_error)?;
        }
        Ok(())
    }

    /// Refuses a request the VMM sent with NEED_REPLY: noted, so that the vhost-user loop
    /// keeps the session once the crate has sent the error status (when REPLY_ACK was
    /// negotiated; without it the VMM would not learn of the refusal and the session ends).
    fn refuse_with_status(&mut self, error: VhostError) -> VhostError {
        let reply_ack = VhostUserProtocolFeatures::REPLY_ACK.bits();
        self.acked_refusal = self.acked_protocol_features & reply_ack != 0;
        error
    }

    fn worker_for(&self, queue: u16) -> VhostResult<&WorkerHandle> {
        self.workers
            .for_queue(queue)
            .ok_or(VhostError::BackendInternalError)
    }

    fn vring(&mut self, index: u32) -> VhostResult<&mut VringSetup> {
        let count = self.vrings.len();
        usize::try_from(index)
            .ok()
            .and_then(|i| self.vrings.get_mut(i))
            .ok_or_else(|| invalid(&format!("queue index {index} (device has {count})")))
    }

    fn protocol_features_negotiated(&self) -> bool {
        self.acked_features & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits() != 0
    }

    /// Starts a ring once it is fully set up: addresses, a kick eventfd, enabled (or, without
    /// PROTOCOL_FEATURES, implicitly enabled by the kick), and guest memory present.
    fn maybe_start(&mut self, index: u16) -> VhostResult<()> {
        let event_idx = self.acked_features & (1 << VIRTIO_RING_F_EVENT_IDX) != 0;
        let memory = Arc::clone(&self.memory);
        let max_size = self.disk.queue_size;
        let implicit_enable = !self.protocol_features_negotiated();
        let inflight_region = self.inflight_region();
        let vring = self.vring(u32::from(index))?;
        if vring.running || vring.kick.is_none() || !vring.addresses_set {
            return Ok(());
        }
        if !(vring.enabled || implicit_enable) {
            return Ok(());
        }
        self.drop_stale_cache()?;
        let vring = self.vring(u32::from(index))?;
        let translate = |addr: u64, what: &str| {
            memory.vmm_to_guest(addr).ok_or_else(|| {
                invalid(&format!(
                    "queue {index}: {what} address {addr:#x} is not in guest memory"
                ))
            })
        };
        let desc = translate(vring.desc_user_addr, "descriptor table")?;
        let avail = translate(vring.avail_user_addr, "avail ring")?;
        let used = translate(vring.used_user_addr, "used ring")?;
        let mut queue = Queue::new(max_size).map_err(handler_error)?;
        queue.try_set_size(vring.size).map_err(handler_error)?;
        queue
            .try_set_desc_table_address(desc)
            .map_err(handler_error)?;
        queue
            .try_set_avail_ring_address(avail)
            .map_err(handler_error)?;
        queue
            .try_set_used_ring_address(used)
            .map_err(handler_error)?;
        queue.set_event_idx(event_idx);
        queue.set_ready(true);
        let mem = memory.guest_memory();
        if !queue.is_valid(mem) {
            return Err(invalid(&format!(
                "queue {index}: ring is not inside guest memory"
            )));
        }
        if let Some(area) = used_ring_overlap(desc, avail, used, vring.size) {
            return Err(invalid(&format!(
                "queue {index}: the used ring overlaps the {area}"
            )));
        }
        queue.set_next_avail(vring.base);
        // The used index lives in guest memory: after a reconnect it may differ from the avail
        // base by the requests that were in flight.
        let used_idx = queue
            .used_idx(mem, std::sync::atomic::Ordering::Acquire)
            .map_err(handler_error)?;
        queue.set_next_used(used_idx.0);
        let (inflight, recovered) = match inflight_region {
            Some(region) => track_inflight(&region, index, &mut queue, mem, used_idx.0)?,
            None => (
                private_inflight(index, queue.size(), used_idx.0)?,
                inflight::Recovered::default(),
            ),
        };
        let kick = vring
            .kick
            .as_ref()
            .ok_or(VhostError::InvalidParam)?
            .try_clone()
            .map_err(VhostError::ReqHandlerError)?;
        let clone = |f: &Option<File>| f.as_ref().and_then(|f| f.try_clone().ok());
        let start = Box::new(VringStart {
            queue,
            kick,
            call: clone(&vring.call),
            err: clone(&vring.err),
            inflight,
            reconnected: recovered.next_avail.is_some(),
            resubmit: recovered.resubmit,
        });
        vring.running = true;
        self.worker_for(index)?
            .call(|reply| Command::Start {
                queue: index,
                vring: start,
                reply,
            })
            .map_err(handler_error)?;
        Ok(())
    }

    /// The session's inflight region, when INFLIGHT_SHMFD was negotiated and the VMM set one.
    fn inflight_region(&self) -> Option<Arc<InflightRegion>> {
        let negotiated =
            self.acked_protocol_features & VhostUserProtocolFeatures::INFLIGHT_SHMFD.bits() != 0;
        self.inflight.as_ref().filter(|_| negotiated).cloned()
    }

    /// The largest inflight region a VMM may ask for: this device's queues and ring size.
    fn inflight_limits(&self) -> inflight::Limits {
        inflight::Limits {
            max_queues: self.disk.num_queues,
            max_queue_size: self.disk.queue_size,
        }
    }

    /// Stops a ring after its in-flight requests complete; remembers where it stopped.
    fn stop(&mut self, index: u16) -> VhostResult<()> {
        if !self.vring(u32::from(index))?.running {
            return Ok(());
        }
        let next_avail = self
            .worker_for(index)?
            .call(|reply| Command::Stop {
                queue: index,
                reply,
            })
            .map_err(handler_error)?;
        let vring = self.vring(u32::from(index))?;
        vring.running = false;
        if let Some(base) = next_avail {
            vring.base = base;
        }
        Ok(())
    }

    /// Makes every worker quiesce and map `memory`, then adopts it.
    fn install_memory(&mut self, memory: MemoryTable) -> VhostResult<()> {
        let memory = Arc::new(memory);
        let old = Arc::clone(&self.memory);
        for (i, worker) in self.workers.iter().enumerate() {
            let result = worker
                .call(|reply| Command::SetMemory {
                    memory: Arc::clone(&memory),
                    reply,
                })
                .map_err(handler_error)?;
            if let Err(e) = result {
                // Put back the old table on the workers already switched, so every iothread
                // agrees on region indices again.
                for worker in self.workers.iter().take(i) {
                    let _ = worker.call(|reply| Command::SetMemory {
                        memory: Arc::clone(&old),
                        reply,
                    });
                }
                return Err(handler_error(e));
            }
        }
        self.memory = memory;
        Ok(())
    }

    /// RESET_DEVICE: the virtio device returns to its initial state — rings stopped (after
    /// draining) and forgotten, virtio features and the guest's write-cache setting back to
    /// their defaults. What belongs to the vhost-user session stays: guest memory, protocol
    /// features and the back-end channel, which the VMM does not send again (the guest driver
    /// resets the device at every probe and reboot). Returns whether every ring stopped.
    pub fn reset_device_state(&mut self) -> bool {
        let mut stopped = true;
        for index in 0..self.disk.num_queues {
            if let Err(e) = self.stop(index) {
                warn!("reset: stopping queue {index}: {e}");
                stopped = false;
            }
        }
        // Everything of the rings goes but their error eventfds: QEMU sends SET_VRING_ERR once
        // per connection (when it sets the device up), not again after a reset by the guest
        // driver, so dropping them would leave a later broken ring unable to tell the VMM.
        // `disconnect` drops them with the session.
        let mut errs = std::mem::take(&mut self.vrings)
            .into_iter()
            .map(|vring| vring.err);
        self.vrings = (0..self.disk.num_queues)
            .map(|_| VringSetup {
                err: errs.next().flatten(),
                ..VringSetup::default()
            })
            .collect();
        if self.logging() {
            if let Err(e) = self.set_workers_log(None) {
                warn!("reset: stopping dirty logging: {e}");
            }
        }
        self.acked_features = 0;
        self.status.acked_features.store(0, Ordering::Relaxed);
        self.disk.reset_writeback();
        stopped
    }

    /// A reset by the VMM (RESET_DEVICE, RESET_OWNER): the driver abandons its rings, so marks
    /// left in the inflight region (heads of a ring the guest broke, never used) must not be
    /// resubmitted into the rings it sets up next. Kept when a ring could not be stopped, as
    /// its requests may still complete. (A disconnect keeps them: the VMM may reconnect with
    /// the same region and rings, and the drained region then tells the true avail position
    /// even if the VMM read the used index before the drain finished.)
    fn reset_by_vmm(&mut self) {
        let stopped = self.reset_device_state();
        if let (true, Some(region)) = (stopped, &self.inflight) {
            region.forget();
        }
    }

    /// The VMM disconnected: reset the device and end the session — memory released,
    /// protocol features and back-end channel forgotten — ready for the next connection.
    pub fn disconnect(&mut self) {
        self.owned = false;
        self.reset_device_state();
        for vring in &mut self.vrings {
            vring.err = None;
        }
        self.acked_protocol_features = 0;
        // The region and the log belong to the session; a reconnecting VMM sends them again.
        self.inflight = None;
        self.dirty_log = None;
        self.backend_channel.clear();
        self.status
            .acked_protocol_features
            .store(0, Ordering::Relaxed);
        if !self.memory.is_empty() {
            if let Err(e) = self.install_memory(MemoryTable::empty()) {
                warn!("reset: releasing guest memory: {e}");
            }
        }
    }
}

fn region_descriptor(region: &VhostUserMemoryRegion) -> RegionDescriptor {
    RegionDescriptor {
        guest_base: region.guest_phys_addr,
        size: region.memory_size,
        user_addr: region.user_addr,
        mmap_offset: region.mmap_offset,
    }
}

/// Attaches queue `index`'s part of the inflight region to a ring about to start, and
/// recovers what a crashed predecessor left in flight: the ring then goes on after those
/// requests (which the worker resubmits first), whatever SET_VRING_BASE said — QEMU sends the
/// used index there when the back-end died, as it could not ask for the real one.
fn track_inflight(
    region: &Arc<InflightRegion>,
    index: u16,
    queue: &mut Queue,
    mem: &vm_memory::GuestMemoryMmap,
    used_idx: u16,
) -> VhostResult<(inflight::QueueInflight, inflight::Recovered)> {
    let refuse = |e: inflight::InflightError| invalid(&format!("queue {index}: inflight: {e}"));
    let mut tracker = region.queue(index).map_err(refuse)?;
    let avail_idx = queue
        .avail_idx(mem, std::sync::atomic::Ordering::Acquire)
        .map_err(handler_error)?;
    let recovered = tracker
        .recover(queue.size(), used_idx, avail_idx.0)
        .map_err(refuse)?;
    if let Some(next_avail) = recovered.next_avail {
        queue.set_next_avail(next_avail);
    }
    if !recovered.resubmit.is_empty() || recovered.repaired_batch > 0 {
        info!(
            "queue {index}: reconnected at used index {used_idx}: {} requests were in flight \
             (resubmitted first; {} of them in a batch the crash left half-published)",
            recovered.resubmit.len(),
            recovered.repaired_batch
        );
    }
    Ok((tracker, recovered))
}

/// An inflight region of the frontend's own for a ring whose VMM set none (it did not
/// negotiate INFLIGHT_SHMFD): it does not survive the frontend, but it tells the successor of
/// a dead iothread what that iothread had put on the used ring, as the VMM's region would.
fn private_inflight(index: u16, size: u16, used_idx: u16) -> VhostResult<inflight::QueueInflight> {
    let refuse = |e: inflight::InflightError| invalid(&format!("queue {index}: inflight: {e}"));
    let limits = inflight::Limits {
        max_queues: 1,
        max_queue_size: size,
    };
    let (region, _file) = InflightRegion::create(1, size, limits).map_err(refuse)?;
    let mut tracker = Arc::new(region).queue(0).map_err(refuse)?;
    // A fresh region: initialized at the used index, nothing to resubmit.
    tracker.recover(size, used_idx, used_idx).map_err(refuse)?;
    Ok(tracker)
}

/// Checks, when SET_VRING_ADDR arrives, that the descriptor table, avail ring and used ring
/// named by VMM addresses lie in guest memory: each start translates through the memory
/// table, and, once SET_VRING_NUM gave the ring's `size`, each whole area is inside guest
/// memory. (A later memory-table change is checked again when the ring starts.)
#[allow(
    clippy::arithmetic_side_effects,
    reason = "size <= 32768: every area is below 1 MiB"
)]
fn ring_areas_in_memory(
    memory: &MemoryTable,
    size: u16,
    desc: u64,
    avail: u64,
    used: u64,
) -> Result<(), String> {
    if memory.is_empty() {
        return Err("no memory table yet".into());
    }
    let entries = u32::from(size);
    // With the size unknown yet, only the first byte of each area can be checked.
    let len = |per_entry: u32, fixed: u32| {
        if size == 0 {
            1
        } else {
            per_entry * entries + fixed
        }
    };
    let areas = [
        ("descriptor table", desc, len(16, 0)),
        // flags, idx, ring, used_event
        ("avail ring", avail, len(2, 6)),
        // flags, idx, ring, avail_event
        ("used ring", used, len(8, 6)),
    ];
    for (what, vmm_addr, len) in areas {
        let guest = memory
            .vmm_to_guest(vmm_addr)
            .ok_or_else(|| format!("{what} at VMM address {vmm_addr:#x} is not in guest memory"))?;
        memory
            .for_each_piece::<()>(guest.0, len, |_, _, _| Ok(()))
            .map_err(|_| {
                format!(
                    "{what} at guest address {:#x} ({len} bytes) is not inside guest memory",
                    guest.0
                )
            })?;
    }
    Ok(())
}

/// The area of a split ring of `size` entries that its used ring overlaps, if any.
///
/// The device writes the used ring, so an overlap makes it change what it reads next: a used
/// ring on the avail ring moves the avail index with every used entry, and a worker completing
/// rejected chains at once would then pop forever without the guest doing anything more.
#[allow(
    clippy::arithmetic_side_effects,
    reason = "entries <= 65535: every span is below 1 MiB"
)]
pub fn used_ring_overlap(
    desc: GuestAddress,
    avail: GuestAddress,
    used: GuestAddress,
    size: u16,
) -> Option<&'static str> {
    let entries = u64::from(size);
    // Flags and index, the entries, then used_event / avail_event.
    let span = |start: GuestAddress, len: u64| (start.0, start.0.saturating_add(len));
    let used = span(used, 4 + 8 * entries + 2);
    let overlaps = |(start, end): (u64, u64)| start < used.1 && used.0 < end;
    if overlaps(span(avail, 4 + 2 * entries + 2)) {
        Some("avail ring")
    } else if overlaps(span(desc, 16 * entries)) {
        Some("descriptor table")
    } else {
        None
    }
}

fn queue_index(index: u32) -> VhostResult<u16> {
    u16::try_from(index).map_err(|_| invalid(&format!("queue index {index}")))
}

impl VhostUserBackendReqHandlerMut for BlkBackend {
    fn set_owner(&mut self) -> VhostResult<()> {
        if self.owned {
            let e = invalid("SET_OWNER: this connection already has an owner");
            return Err(self.refuse_with_status(e));
        }
        self.owned = true;
        Ok(())
    }

    fn reset_owner(&mut self) -> VhostResult<()> {
        self.reset_by_vmm();
        // Deprecated, and read by some front-ends as ending the session: a SET_OWNER after it
        // starts one again rather than being refused as a second.
        self.owned = false;
        Ok(())
    }

    fn reset_device(&mut self) -> VhostResult<()> {
        self.reset_by_vmm();
        Ok(())
    }

    fn get_features(&mut self) -> VhostResult<u64> {
        Ok(self.disk.features())
    }

    fn set_features(&mut self, features: u64) -> VhostResult<()> {
        let log_all = VhostUserVirtioFeatures::LOG_ALL.bits();
        let was_logging = self.logging();
        let logging = features & log_all != 0;
        // A VMM starts dirty logging (a migration) with LOG_ALL, asking for a REPLY_ACK
        // status: refused while blocked, with the reasons logged, so that the VMM fails the
        // migration and the VM keeps running here.
        if logging && !was_logging {
            if let Err(blocked) = lifecycle::check_dirty_logging(&self.status, "VHOST_F_LOG_ALL") {
                return Err(self.refuse_with_status(handler_error(blocked)));
            }
            if self.dirty_log.is_none() {
                let e = invalid("VHOST_F_LOG_ALL without a dirty log (no SET_LOG_BASE)");
                return Err(self.refuse_with_status(e));
            }
        }
        let unknown = features & !self.disk.features();
        if unknown != 0 {
            return Err(invalid(&format!("features {unknown:#x} were not offered")));
        }
        if logging != was_logging {
            let log = self.dirty_log.clone().filter(|_| logging);
            self.set_workers_log(log.as_ref())?;
            match &log {
                Some(log) => info!(
                    "dirty logging started (migration): {} GiB of guest memory covered",
                    log.covered_bytes() >> 30
                ),
                None => info!("dirty logging stopped"),
            }
            if let Some(unmarked) = self
                .dirty_log
                .as_ref()
                .map(|l| l.unmarked_pages())
                .filter(|&n| n > 0)
            {
                warn!(
                    "the VMM's dirty log is too small for guest memory: {unmarked} written \
                     pages could not be marked"
                );
            }
        }
        self.acked_features = features;
        self.status
            .acked_features
            .store(features, Ordering::Relaxed);
        Ok(())
    }

    fn set_mem_table(
        &mut self,
        ctx: &[VhostUserMemoryRegion],
        files: Vec<File>,
        _postcopy_listening: Option<bool>,
    ) -> VhostResult<Option<Vec<VhostUserMemoryRegionBase>>> {
        if ctx.len() > SET_MEM_TABLE_MAX_REGIONS {
            let e = invalid(&format!(
                "SET_MEM_TABLE with {} regions: at most {SET_MEM_TABLE_MAX_REGIONS} (more go \
                 with ADD_MEM_REG)",
                ctx.len()
            ));
            return Err(self.refuse_with_status(e));
        }
        let regions = ctx.iter().map(region_descriptor).zip(files).collect();
        // Refused with the reason and nothing installed: the previous table stays, so the
        // session can go on when the VMM asked to be told (REPLY_ACK).
        let table = match MemoryTable::new(regions) {
            Ok(table) => table,
            Err(e) => return Err(self.refuse_with_status(handler_error(e))),
        };
        info!("guest memory: {table:?}");
        self.install_memory(table)?;
        Ok(None)
    }

    fn set_vring_num(&mut self, index: u32, num: u32) -> VhostResult<()> {
        let max = self.disk.queue_size;
        let vring = self.vring(index)?;
        let size = u16::try_from(num)
            .ok()
            .filter(|n| *n > 0 && n.is_power_of_two() && *n <= max && *n <= MAX_QUEUE_SIZE);
        vring.size = size.ok_or_else(|| {
            invalid(&format!(
                "ring size {num}: must be a power of two in 1..={max}"
            ))
        })?;
        Ok(())
    }

    fn set_vring_addr(
        &mut self,
        index: u32,
        _flags: VhostUserVringAddrFlags,
        descriptor: u64,
        used: u64,
        available: u64,
        _log: u64,
    ) -> VhostResult<()> {
        let size = self.vring(index)?.size;
        if let Err(what) = ring_areas_in_memory(&self.memory, size, descriptor, available, used) {
            let e = invalid(&format!("SET_VRING_ADDR of queue {index}: {what}"));
            return Err(self.refuse_with_status(e));
        }
        let vring = self.vring(index)?;
        vring.desc_user_addr = descriptor;
        vring.used_user_addr = used;
        vring.avail_user_addr = available;
        vring.addresses_set = true;
        Ok(())
    }

    fn set_vring_base(&mut self, index: u32, base: u32) -> VhostResult<()> {
        let vring = self.vring(index)?;
        vring.base = u16::try_from(base).map_err(|_| invalid(&format!("ring base {base}")))?;
        Ok(())
    }

    fn get_vring_base(&mut self, index: u32) -> VhostResult<VhostUserVringState> {
        let queue = queue_index(index)?;
        self.vring(index)?;
        let asked = Instant::now();
        self.stop(queue)?;
        let stopped = asked.elapsed();
        // The VMM stops a ring when the VM stops running here — a migration's switch-over
        // (whether or not LOG_ALL is still on by then: QEMU may end logging first), a VM
        // stop, a reset. Make what the ring wrote durable before answering, as QEMU flushes
        // its block devices when it stops a VM, so that a destination on another host
        // sharing the storage reads it (on this host the page cache is shared anyway).
        if let Err(e) = lifecycle::sync_image(&self.image) {
            return Err(handler_error(format!(
                "queue {queue} stopped, but fdatasync of the image failed: {e}"
            )));
        }
        // What the disk adds to a migration's downtime on this side, for the operator.
        info!(
            "queue {queue} stopped{} in {} µs: requests in flight {} µs, fdatasync {} µs",
            if self.logging() { " for migration" } else { "" },
            asked.elapsed().as_micros(),
            stopped.as_micros(),
            asked.elapsed().saturating_sub(stopped).as_micros()
        );
        let vring = self.vring(index)?;
        // The ring is stopped until the next SET_VRING_KICK.
        vring.kick = None;
        Ok(VhostUserVringState::new(index, u32::from(vring.base)))
    }

    fn set_vring_kick(&mut self, index: u8, fd: Option<File>) -> VhostResult<()> {
        let queue = u16::from(index);
        self.vring(u32::from(index))?;
        let fd = fd.ok_or_else(|| invalid("polling mode (no kick fd) is not supported"))?;
        self.stop(queue)?;
        self.vring(u32::from(index))?.kick = Some(fd);
        self.maybe_start(queue)
    }

    fn set_vring_call(&mut self, index: u8, fd: Option<File>) -> VhostResult<()> {
        let queue = u16::from(index);
        let vring = self.vring(u32::from(index))?;
        let running = vring.running;
        vring.call = fd;
        let call = vring.call.as_ref().and_then(|f| f.try_clone().ok());
        if running {
            self.worker_for(queue)?
                .call(|reply| Command::SetCall { queue, call, reply })
                .map_err(handler_error)?;
        }
        Ok(())
    }

    fn set_vring_err(&mut self, index: u8, fd: Option<File>) -> VhostResult<()> {
        self.vring(u32::from(index))?.err = fd;
        Ok(())
    }

    fn get_protocol_features(&mut self) -> VhostResult<VhostUserProtocolFeatures> {
        Ok(DiskConfig::protocol_features())
    }

    fn set_protocol_features(&mut self, features: u64) -> VhostResult<()> {
        let unknown = features & !DiskConfig::protocol_features().bits();
        if unknown != 0 {
            return Err(invalid(&format!(
                "protocol features {unknown:#x} were not offered"
            )));
        }
        self.acked_protocol_features = features;
        self.status
            .acked_protocol_features
            .store(features, Ordering::Relaxed);
        Ok(())
    }

    fn get_queue_num(&mut self) -> VhostResult<u64> {
        Ok(u64::from(self.disk.num_queues))
    }

    fn set_vring_enable(&mut self, index: u32, enable: bool) -> VhostResult<()> {
        let queue = queue_index(index)?;
        self.vring(index)?.enabled = enable;
        if enable {
            self.maybe_start(queue)
        } else {
            self.stop(queue)
        }
    }

    fn get_config(
        &mut self,
        offset: u32,
        size: u32,
        _flags: VhostUserConfigFlags,
    ) -> VhostResult<Vec<u8>> {
        self.disk
            .read_config(offset, size)
            .ok_or_else(|| invalid(&format!("config read of {size} bytes at {offset}")))
    }

    fn set_config(
        &mut self,
        offset: u32,
        buf: &[u8],
        _flags: VhostUserConfigFlags,
    ) -> VhostResult<()> {
        self.disk.write_config(offset, buf).map_err(handler_error)
    }

    fn set_backend_req_fd(&mut self, _backend: Backend) {
        // The crate validated the descriptor; use the duplicate taken by the peek (see
        // backend_channel.rs). The crate's own `Backend` cannot send CONFIG_CHANGE_MSG.
        self.backend_channel.adopt();
    }

    fn set_gpu_socket(&mut self, _gpu_backend: GpuBackend) -> VhostResult<()> {
        Err(VhostError::InvalidOperation("not a GPU"))
    }

    fn get_shared_object(&mut self, _uuid: VhostUserSharedMsg) -> VhostResult<File> {
        Err(VhostError::InvalidOperation(
            "shared objects are not supported",
        ))
    }

    fn get_inflight_fd(
        &mut self,
        request: &VhostUserInflight,
    ) -> VhostResult<(VhostUserInflight, File)> {
        let (region, file) = InflightRegion::create(
            request.num_queues,
            request.queue_size,
            self.inflight_limits(),
        )
        .map_err(|e| invalid(&format!("GET_INFLIGHT_FD: {e}")))?;
        let reply =
            VhostUserInflight::new(region.size(), 0, request.num_queues, request.queue_size);
        info!("inflight region created: {region:?}");
        // Used from now on, as libvhost-user does; QEMU also sends it back with
        // SET_INFLIGHT_FD before it starts the rings.
        self.inflight = Some(Arc::new(region));
        Ok((reply, file))
    }

    fn set_inflight_fd(&mut self, request: &VhostUserInflight, file: File) -> VhostResult<()> {
        let region = InflightRegion::open(
            &file,
            request.mmap_size,
            request.mmap_offset,
            request.num_queues,
            request.queue_size,
            self.inflight_limits(),
        )
        .map_err(|e| invalid(&format!("SET_INFLIGHT_FD: {e}")))?;
        // Rings already running keep the region they started with (their worker holds it);
        // rings started from now on use this one. The descriptor itself is not needed: the
        // mapping keeps the memory.
        info!("inflight region set: {region:?}");
        self.inflight = Some(Arc::new(region));
        Ok(())
    }

    fn get_max_mem_slots(&mut self) -> VhostResult<u64> {
        Ok(MAX_MEM_SLOTS)
    }

    fn add_mem_region(
        &mut self,
        region: &VhostUserSingleMemoryRegion,
        fd: File,
        _postcopy_listening: Option<bool>,
    ) -> VhostResult<Option<VhostUserMemoryRegionBase>> {
        let table = self
            .memory
            .with_region(region_descriptor(region), fd)
            .map_err(handler_error)?;
        self.install_memory(table)?;
        Ok(None)
    }

    fn remove_mem_region(&mut self, region: &VhostUserSingleMemoryRegion) -> VhostResult<()> {
        let table = self
            .memory
            .without_region(region.guest_phys_addr, region.memory_size)
            .map_err(handler_error)?;
        self.install_memory(table)
    }

    fn set_device_state_fd(
        &mut self,
        _direction: VhostTransferStateDirection,
        _phase: VhostTransferStatePhase,
        _fd: File,
    ) -> VhostResult<Option<File>> {
        Err(VhostError::InvalidOperation(
            "device state transfer is not supported",
        ))
    }

    fn check_device_state(&mut self) -> VhostResult<()> {
        Err(VhostError::InvalidOperation(
            "device state transfer is not supported",
        ))
    }

    fn get_shmem_config(&mut self) -> VhostResult<VhostUserShMemConfig> {
        Err(VhostError::InvalidOperation("no shared memory regions"))
    }

    fn set_log_base(&mut self, log: &VhostUserLog, file: File) -> VhostResult<()> {
        // Taken even while migration is blocked: the reply has no status to refuse with, and
        // a log marks nothing until LOG_ALL, which is where a blocked migration is refused.
        let dirty = DirtyLog::new(&file, log.mmap_size, log.mmap_offset)
            .map_err(|e| invalid(&format!("SET_LOG_BASE: {e}")))?;
        info!(
            "dirty log set: {} bytes at offset {}, covering {} MiB of guest memory",
            log.mmap_size,
            log.mmap_offset,
            dirty.covered_bytes() >> 20
        );
        let dirty = Arc::new(dirty);
        if self.logging() {
            // The VMM resized the log during a migration (guest memory grew).
            self.set_workers_log(Some(&dirty))?;
        }
        self.dirty_log = Some(dirty);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::CacheMode;
    use std::sync::Mutex;

    #[test]
    fn a_used_ring_on_the_avail_ring_or_the_table_is_refused() {
        let at = GuestAddress;
        // QEMU's layout for 64 entries: table, avail ring, used ring on the next 4 KiB.
        assert_eq!(
            used_ring_overlap(at(0x1000), at(0x1400), at(0x2000), 64),
            None
        );
        // The avail index would follow the used index: the worker would pop forever.
        assert_eq!(
            used_ring_overlap(at(0x1000), at(0x2000), at(0x2000), 64),
            Some("avail ring")
        );
        // The used ring's last byte (avail_event) on the avail ring's first.
        let used_end = 0x2000 + 4 + 8 * 64 + 2;
        assert_eq!(
            used_ring_overlap(at(0x1000), at(used_end - 1), at(0x2000), 64),
            Some("avail ring")
        );
        assert_eq!(
            used_ring_overlap(at(0x1000), at(used_end), at(0x2000), 64),
            None
        );
        assert_eq!(
            used_ring_overlap(at(0x2100), at(0x4000), at(0x2000), 64),
            Some("descriptor table")
        );
        // Near the top of the address space the spans saturate instead of wrapping.
        assert_eq!(
            used_ring_overlap(at(0), at(0x1000), at(u64::MAX - 8), 64),
            None
        );
    }

    fn device(status: &Arc<DeviceStatus>) -> Arc<Mutex<BlkBackend>> {
        let disk = Arc::new(DiskConfig::new(
            1 << 20,
            false,
            "",
            1,
            256,
            512,
            CacheMode::Writeback,
        ));
        Arc::new(Mutex::new(BlkBackend::new(
            disk,
            Arc::clone(status),
            Arc::new(BackendChannel::default()),
            Arc::new(Image::Null { size: 1 << 20 }),
            Workers::new(Vec::new()),
        )))
    }

    #[test]
    fn dirty_logging_is_refused_while_blocked() {
        let status = Arc::new(DeviceStatus::new(1, 1));
        let backend = device(&status);
        let mut backend = backend.lock().unwrap();
        let log_all = VhostUserVirtioFeatures::LOG_ALL.bits();
        let offered = backend.get_features().unwrap();
        status.set_migration_blockers(vec!["operator_backup: nightly".into()]);
        let err = lifecycle::check_dirty_logging(&status, "VHOST_F_LOG_ALL").unwrap_err();
        assert!(
            err.to_string().contains("operator_backup: nightly"),
            "{err}"
        );
        assert_ne!(offered & log_all, 0, "LOG_ALL is offered");
        // The log itself is taken (its reply has no status); logging is what is refused.
        let log = blkplane_proto::shm::sealed_memfd(c"log", 4096).unwrap();
        backend
            .set_log_base(&VhostUserLog::new(4096, 0), log)
            .unwrap();
        // Refused with a REPLY_ACK status once the VMM negotiated it: the session goes on.
        assert!(backend.set_features(offered | log_all).is_err());
        assert!(!backend.take_acked_refusal(), "no REPLY_ACK negotiated");
        backend
            .set_protocol_features(VhostUserProtocolFeatures::REPLY_ACK.bits())
            .unwrap();
        assert!(backend.set_features(offered | log_all).is_err());
        assert!(backend.take_acked_refusal());
        assert!(!backend.take_acked_refusal(), "taken once");
        // Features without LOG_ALL are still fine.
        backend.set_features(offered & !log_all).unwrap();
        status.set_migration_blockers(Vec::new());
        assert!(lifecycle::check_dirty_logging(&status, "VHOST_F_LOG_ALL").is_ok());
        backend.set_features(offered | log_all).unwrap();
        // Clearing LOG_ALL (a cancelled migration) stops logging.
        backend.set_features(offered & !log_all).unwrap();
    }
}
