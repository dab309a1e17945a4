//! A minimal vhost-user-blk front-end with a hand-written split virtqueue, for putting requests
//! on the ring that no real driver (libblkio, Linux) would produce.
//!
//! Guest memory is one memfd mapped here and registered at guest-physical address 0. Rings sit
//! at the bottom ([`RING_AREA`] per queue), requests are built in a scratch area above them. The
//! driver posts one chain at a time and polls the used ring for its entry, so descriptor indices
//! are simply reused from 0 for each chain.

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd};
use std::path::Path;
use std::sync::atomic::{fence, Ordering};
use std::time::{Duration, Instant};

use vhost::vhost_user::message::{VhostUserConfigFlags, VhostUserHeaderFlag};
use vhost::vhost_user::{
    Frontend as VhostFrontend, VhostUserFrontend, VhostUserProtocolFeatures,
    VhostUserVirtioFeatures,
};
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use virtio_bindings::virtio_blk::*;
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ring::{
    VIRTIO_RING_F_INDIRECT_DESC, VRING_DESC_F_INDIRECT, VRING_DESC_F_NEXT, VRING_DESC_F_WRITE,
};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

/// Size of the guest memory.
pub const MEM_SIZE: u64 = 16 << 20;
/// Guest memory reserved for each queue's rings (queue `i` starts at `i * RING_AREA`).
pub const RING_AREA: u64 = 64 << 10;
/// Start of the per-request scratch area (headers, data, status bytes, indirect tables).
pub const SCRATCH_BASE: u64 = 1 << 20;
/// Start of the area for [`RawDevice::alloc_static`], never recycled; the scratch area ends here.
pub const STATIC_BASE: u64 = 12 << 20;
/// How long to wait for the used entry of one request.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// The byte a status buffer holds before the request: no valid status has this value, so it
/// still being there means the device wrote no status.
pub const STATUS_SENTINEL: u8 = 0xff;
/// Bytes of config space read (everything up to the secure-erase fields, as libblkio does).
pub const CONFIG_LEN: usize = std::mem::offset_of!(virtio_blk_config, max_secure_erase_sectors);

/// Shared guest memory: a memfd mapped into this process.
pub struct GuestMemory {
    file: File,
    ptr: *mut u8,
    len: u64,
}

// SAFETY: the mapping is plain shared memory owned by this struct; access is bounds-checked.
unsafe impl Send for GuestMemory {}

impl GuestMemory {
    /// Creates `len` bytes of zeroed guest memory.
    pub fn new(len: u64) -> GuestMemory {
        // SAFETY: plain syscalls; results are checked and the fd is owned by `file`.
        unsafe {
            let fd = libc::memfd_create(c"blkplane-test-guest".as_ptr(), libc::MFD_CLOEXEC);
            assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
            let file = File::from_raw_fd(fd);
            file.set_len(len).unwrap();
            let ptr = libc::mmap(
                std::ptr::null_mut(),
                len as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            );
            assert!(
                ptr != libc::MAP_FAILED,
                "mmap: {}",
                std::io::Error::last_os_error()
            );
            GuestMemory {
                file,
                ptr: ptr.cast(),
                len,
            }
        }
    }

    /// The memfd.
    pub fn file(&self) -> &File {
        &self.file
    }

    /// Size in bytes.
    pub fn size(&self) -> u64 {
        self.len
    }

    /// This process's address of guest address `gpa`: what vhost-user calls the "user address",
    /// used in SET_VRING_ADDR.
    pub fn host_addr(&self, gpa: u64) -> u64 {
        self.ptr as u64 + gpa
    }

    fn at(&self, gpa: u64, len: usize) -> *mut u8 {
        assert!(
            gpa.checked_add(len as u64).is_some_and(|e| e <= self.len),
            "guest access {gpa:#x}+{len} outside guest memory"
        );
        // SAFETY: in bounds, checked above.
        unsafe { self.ptr.add(gpa as usize) }
    }

    /// Copies `data` to `gpa`.
    pub fn write(&self, gpa: u64, data: &[u8]) {
        let p = self.at(gpa, data.len());
        // SAFETY: in bounds; the device may access the memory concurrently, which is the nature
        // of shared rings and is why ring fields use volatile accesses.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), p, data.len()) }
    }

    /// Copies `len` bytes from `gpa`.
    pub fn read(&self, gpa: u64, len: usize) -> Vec<u8> {
        let p = self.at(gpa, len);
        let mut v = vec![0; len];
        // SAFETY: as in `write`.
        unsafe { std::ptr::copy_nonoverlapping(p, v.as_mut_ptr(), len) }
        v
    }

    /// Fills `len` bytes at `gpa` with `byte`.
    pub fn fill(&self, gpa: u64, len: usize, byte: u8) {
        let p = self.at(gpa, len);
        // SAFETY: in bounds.
        unsafe { std::ptr::write_bytes(p, byte, len) }
    }

    fn write_u16(&self, gpa: u64, v: u16) {
        assert_eq!(gpa % 2, 0);
        // SAFETY: in bounds and aligned; volatile because the device reads it concurrently.
        unsafe { std::ptr::write_volatile(self.at(gpa, 2).cast::<u16>(), v.to_le()) }
    }

    fn read_u16(&self, gpa: u64) -> u16 {
        assert_eq!(gpa % 2, 0);
        // SAFETY: in bounds and aligned; volatile because the device writes it concurrently.
        u16::from_le(unsafe { std::ptr::read_volatile(self.at(gpa, 2).cast::<u16>()) })
    }

    fn read_u32(&self, gpa: u64) -> u32 {
        assert_eq!(gpa % 4, 0);
        // SAFETY: as in read_u16.
        u32::from_le(unsafe { std::ptr::read_volatile(self.at(gpa, 4).cast::<u32>()) })
    }
}

impl Drop for GuestMemory {
    fn drop(&mut self) {
        // SAFETY: unmapping our own mapping.
        unsafe { libc::munmap(self.ptr.cast(), self.len as usize) };
    }
}

/// One split-virtqueue descriptor, as written into a descriptor table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Desc {
    /// Guest address.
    pub addr: u64,
    /// Length in bytes.
    pub len: u32,
    /// `VRING_DESC_F_*` bits.
    pub flags: u16,
    /// Index of the next descriptor if `VRING_DESC_F_NEXT` is set.
    pub next: u16,
}

/// `VRING_DESC_F_NEXT` as the u16 the descriptor holds.
pub const F_NEXT: u16 = VRING_DESC_F_NEXT as u16;
/// `VRING_DESC_F_WRITE` (device-writable) as the u16 the descriptor holds.
pub const F_WRITE: u16 = VRING_DESC_F_WRITE as u16;
/// `VRING_DESC_F_INDIRECT` as the u16 the descriptor holds.
pub const F_INDIRECT: u16 = VRING_DESC_F_INDIRECT as u16;

impl Desc {
    fn encode(&self) -> [u8; 16] {
        let mut b = [0; 16];
        b[0..8].copy_from_slice(&self.addr.to_le_bytes());
        b[8..12].copy_from_slice(&self.len.to_le_bytes());
        b[12..14].copy_from_slice(&self.flags.to_le_bytes());
        b[14..16].copy_from_slice(&self.next.to_le_bytes());
        b
    }
}

/// A buffer of a chain: guest address, length, and whether the device may write it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Seg {
    /// Guest address.
    pub addr: u64,
    /// Length.
    pub len: u32,
    /// Device-writable (`VRING_DESC_F_WRITE`).
    pub writable: bool,
}

/// The used-ring entry the device returned for a chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Used {
    /// Head descriptor index.
    pub id: u32,
    /// Bytes the device says it wrote.
    pub len: u32,
}

/// A split virtqueue in guest memory.
struct SplitQueue {
    size: u16,
    desc: u64,
    avail: u64,
    used: u64,
    next_avail: u16,
    last_used: u16,
    kick: EventFd,
    call: EventFd,
}

impl SplitQueue {
    fn new(index: usize, size: u16) -> SplitQueue {
        let base = index as u64 * RING_AREA;
        let desc = base;
        let avail = desc + 16 * size as u64;
        let used = (avail + 6 + 2 * size as u64).next_multiple_of(4);
        assert!(used + 6 + 8 * size as u64 <= base + RING_AREA);
        SplitQueue {
            size,
            desc,
            avail,
            used,
            next_avail: 0,
            last_used: 0,
            kick: EventFd::new(EFD_NONBLOCK).unwrap(),
            call: EventFd::new(EFD_NONBLOCK).unwrap(),
        }
    }
}

/// Decoded fields of the virtio-blk config space.
#[derive(Debug, Clone, Copy, Default)]
pub struct BlkConfig {
    /// Capacity in 512-byte sectors.
    pub capacity: u64,
    /// Largest segment (VIRTIO_BLK_F_SIZE_MAX).
    pub size_max: u32,
    /// Most data segments per request (VIRTIO_BLK_F_SEG_MAX).
    pub seg_max: u32,
    /// Logical block size (VIRTIO_BLK_F_BLK_SIZE).
    pub blk_size: u32,
    /// Write cache enabled (VIRTIO_BLK_F_CONFIG_WCE).
    pub wce: u8,
    /// Queues (VIRTIO_BLK_F_MQ).
    pub num_queues: u16,
    /// Most sectors per discard segment.
    pub max_discard_sectors: u32,
    /// Most segments per discard request.
    pub max_discard_seg: u32,
    /// Discard alignment in sectors.
    pub discard_sector_alignment: u32,
    /// Most sectors per write-zeroes segment.
    pub max_write_zeroes_sectors: u32,
    /// Most segments per write-zeroes request.
    pub max_write_zeroes_seg: u32,
}

impl BlkConfig {
    /// Decodes a (little-endian) config space of at least [`CONFIG_LEN`] bytes.
    pub fn parse(b: &[u8]) -> BlkConfig {
        use std::mem::offset_of;
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap());
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap());
        let u16_at = |o: usize| u16::from_le_bytes(b[o..o + 2].try_into().unwrap());
        type C = virtio_blk_config;
        BlkConfig {
            capacity: u64_at(offset_of!(C, capacity)),
            size_max: u32_at(offset_of!(C, size_max)),
            seg_max: u32_at(offset_of!(C, seg_max)),
            blk_size: u32_at(offset_of!(C, blk_size)),
            wce: b[offset_of!(C, wce)],
            num_queues: u16_at(offset_of!(C, num_queues)),
            max_discard_sectors: u32_at(offset_of!(C, max_discard_sectors)),
            max_discard_seg: u32_at(offset_of!(C, max_discard_seg)),
            discard_sector_alignment: u32_at(offset_of!(C, discard_sector_alignment)),
            max_write_zeroes_sectors: u32_at(offset_of!(C, max_write_zeroes_sectors)),
            max_write_zeroes_seg: u32_at(offset_of!(C, max_write_zeroes_seg)),
        }
    }
}

/// A buffer of a [`BlkRequest`].
#[derive(Debug, Clone)]
pub enum Buf {
    /// Device-readable, with this content (placed in scratch memory).
    Out(Vec<u8>),
    /// Device-writable, this many bytes (placed in scratch memory, pre-filled with 0xaa).
    In(u32),
    /// An explicit segment, e.g. pointing outside guest memory.
    Raw(Seg),
}

/// Where a [`BlkRequest`]'s status byte goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// A separate 1-byte device-writable descriptor at the end (the normal layout).
    Normal,
    /// No status descriptor at all: the chain ends with the last data buffer.
    Missing,
    /// A 1-byte descriptor that is device-readable only.
    ReadOnly,
    /// A device-writable descriptor of length 0.
    ZeroLength,
    /// A 1-byte device-writable descriptor at this guest address (e.g. outside guest memory).
    At(u64),
}

/// A virtio-blk request as laid out on the ring; build with [`BlkRequest::new`].
#[derive(Debug, Clone)]
pub struct BlkRequest {
    /// The header buffer (normally `Buf::Out(blk_header(..))`).
    pub header: Buf,
    /// Data buffers, in order.
    pub data: Vec<Buf>,
    /// The status descriptor.
    pub status: Status,
    /// Whether the chain is put in an indirect table.
    pub indirect: bool,
}

/// The 16-byte `virtio_blk_outhdr` for request `type_` at `sector`.
pub fn blk_header(type_: u32, sector: u64) -> Vec<u8> {
    let mut b = Vec::with_capacity(16);
    b.extend_from_slice(&type_.to_le_bytes());
    b.extend_from_slice(&0u32.to_le_bytes()); // ioprio
    b.extend_from_slice(&sector.to_le_bytes());
    assert_eq!(b.len(), std::mem::size_of::<virtio_blk_outhdr>());
    b
}

/// One 16-byte `virtio_blk_discard_write_zeroes` segment.
pub fn dwz_segment(sector: u64, num_sectors: u32, flags: u32) -> Vec<u8> {
    let mut b = Vec::with_capacity(16);
    b.extend_from_slice(&sector.to_le_bytes());
    b.extend_from_slice(&num_sectors.to_le_bytes());
    b.extend_from_slice(&flags.to_le_bytes());
    assert_eq!(
        b.len(),
        std::mem::size_of::<virtio_blk_discard_write_zeroes>()
    );
    b
}

impl BlkRequest {
    /// A request of `type_` at `sector` with a normal header and status and no data.
    pub fn new(type_: u32, sector: u64) -> BlkRequest {
        BlkRequest {
            header: Buf::Out(blk_header(type_, sector)),
            data: Vec::new(),
            status: Status::Normal,
            indirect: false,
        }
    }

    /// Adds a data buffer.
    pub fn data(mut self, b: Buf) -> BlkRequest {
        self.data.push(b);
        self
    }

    /// Sets the status layout.
    pub fn status(mut self, s: Status) -> BlkRequest {
        self.status = s;
        self
    }

    /// Replaces the header buffer.
    pub fn header(mut self, b: Buf) -> BlkRequest {
        self.header = b;
        self
    }

    /// Puts the chain into an indirect descriptor table.
    pub fn indirect(mut self) -> BlkRequest {
        self.indirect = true;
        self
    }
}

/// What came back for a [`BlkRequest`].
#[derive(Debug, Clone)]
pub struct BlkResult {
    /// The used length the device reported.
    pub used_len: u32,
    /// The status byte, or `None` if the device did not write one.
    pub status: Option<u8>,
    /// Contents of the `Buf::In` buffers after completion.
    pub data: Vec<Vec<u8>>,
}

impl BlkResult {
    /// The status as u32 for comparison with `VIRTIO_BLK_S_*`.
    pub fn status_u32(&self) -> Option<u32> {
        self.status.map(u32::from)
    }

    /// Whether this is a well-formed rejection of a malformed chain: either an IOERR status or
    /// "used len 0, no status written" (the device could not locate a usable status byte).
    pub fn is_rejected(&self) -> bool {
        self.status_u32() == Some(VIRTIO_BLK_S_IOERR)
            || (self.used_len == 0 && self.status.is_none())
    }
}

/// Virtio features this driver accepts when the device offers them (no EVENT_IDX: the driver
/// polls the used ring and kicks after every chain, so notification suppression buys nothing).
pub fn wanted_features() -> u64 {
    let bits = [
        VIRTIO_F_VERSION_1,
        VIRTIO_RING_F_INDIRECT_DESC,
        VIRTIO_BLK_F_SIZE_MAX,
        VIRTIO_BLK_F_SEG_MAX,
        VIRTIO_BLK_F_RO,
        VIRTIO_BLK_F_BLK_SIZE,
        VIRTIO_BLK_F_FLUSH,
        VIRTIO_BLK_F_TOPOLOGY,
        VIRTIO_BLK_F_CONFIG_WCE,
        VIRTIO_BLK_F_MQ,
        VIRTIO_BLK_F_DISCARD,
        VIRTIO_BLK_F_WRITE_ZEROES,
    ];
    bits.iter().fold(0, |acc, b| acc | 1u64 << b)
        | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits()
}

/// A connected raw vhost-user-blk front-end with started queues.
pub struct RawDevice {
    /// The `vhost` crate connection, for sending further (valid) messages.
    pub fe: VhostFrontend,
    /// The guest memory.
    pub mem: GuestMemory,
    /// Virtio features the device offered.
    pub offered_features: u64,
    /// Virtio features acknowledged.
    pub features: u64,
    /// Protocol features acknowledged.
    pub protocol_features: VhostUserProtocolFeatures,
    /// Our end of the back-end request channel, when it was asked for.
    pub backend_channel: Option<std::os::unix::net::UnixStream>,
    queues: Vec<SplitQueue>,
    scratch: u64,
    static_next: u64,
}

impl RawDevice {
    /// Connects, negotiates, registers guest memory and starts `num_queues` queues of
    /// `queue_size` entries.
    pub fn connect(
        socket: &Path,
        num_queues: usize,
        queue_size: u16,
    ) -> Result<RawDevice, vhost::Error> {
        Self::connect_with(socket, num_queues, queue_size, false)
    }

    /// Like [`RawDevice::connect`]; with `backend_channel` it also negotiates BACKEND_REQ and
    /// hands the device a back-end request channel (as QEMU does), kept in
    /// [`RawDevice::backend_channel`].
    pub fn connect_with(
        socket: &Path,
        num_queues: usize,
        queue_size: u16,
        backend_channel: bool,
    ) -> Result<RawDevice, vhost::Error> {
        let extra = if backend_channel {
            VhostUserProtocolFeatures::BACKEND_REQ
        } else {
            VhostUserProtocolFeatures::empty()
        };
        Self::connect_negotiating(socket, num_queues, queue_size, extra)
    }

    /// Like [`RawDevice::connect`], also negotiating the protocol features in `extra` when
    /// the device offers them (BACKEND_REQ: a back-end channel is handed over as QEMU does;
    /// LOG_SHMFD: the test drives dirty logging itself).
    pub fn connect_negotiating(
        socket: &Path,
        num_queues: usize,
        queue_size: u16,
        extra: VhostUserProtocolFeatures,
    ) -> Result<RawDevice, vhost::Error> {
        let mut fe = VhostFrontend::connect(socket, num_queues as u64)?;
        fe.set_owner()?;
        let offered = fe.get_features()?;
        let features = offered & wanted_features();
        fe.set_features(features)?;
        let protocol_features = if features & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits() != 0
        {
            let pf = fe.get_protocol_features()?;
            let pf = pf
                & (VhostUserProtocolFeatures::REPLY_ACK
                    | VhostUserProtocolFeatures::CONFIG
                    | VhostUserProtocolFeatures::MQ
                    | VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS
                    | VhostUserProtocolFeatures::RESET_DEVICE
                    | extra);
            fe.set_protocol_features(pf)?;
            pf
        } else {
            VhostUserProtocolFeatures::empty()
        };
        if protocol_features.contains(VhostUserProtocolFeatures::REPLY_ACK) {
            // Every message then gets an ack, so a refused setup step surfaces here as an error
            // instead of as a mysteriously dead queue later.
            fe.set_hdr_flags(VhostUserHeaderFlag::NEED_REPLY);
        }
        let mut channel = None;
        if protocol_features.contains(VhostUserProtocolFeatures::BACKEND_REQ) {
            let (ours, theirs) = std::os::unix::net::UnixStream::pair().map_err(|e| {
                vhost::Error::VhostUserProtocol(vhost::vhost_user::Error::SocketError(e))
            })?;
            fe.set_backend_request_fd(&theirs)?;
            channel = Some(ours);
        }
        if protocol_features.contains(VhostUserProtocolFeatures::MQ) {
            let n = fe.get_queue_num()?;
            assert!(
                n as usize >= num_queues,
                "device has {n} queues, {num_queues} wanted"
            );
        }
        assert!(
            num_queues as u64 * RING_AREA <= SCRATCH_BASE,
            "too many queues for the ring area"
        );
        let mem = GuestMemory::new(MEM_SIZE);
        fe.set_mem_table(&[VhostUserMemoryRegionInfo {
            guest_phys_addr: 0,
            memory_size: mem.size(),
            userspace_addr: mem.host_addr(0),
            mmap_offset: 0,
            mmap_handle: mem.file().as_raw_fd(),
        }])?;
        let mut queues = Vec::new();
        for i in 0..num_queues {
            let q = SplitQueue::new(i, queue_size);
            fe.set_vring_num(i, queue_size)?;
            fe.set_vring_addr(
                i,
                &VringConfigData {
                    queue_max_size: queue_size,
                    queue_size,
                    flags: 0,
                    desc_table_addr: mem.host_addr(q.desc),
                    used_ring_addr: mem.host_addr(q.used),
                    avail_ring_addr: mem.host_addr(q.avail),
                    log_addr: None,
                },
            )?;
            fe.set_vring_base(i, 0)?;
            fe.set_vring_call(i, &q.call)?;
            fe.set_vring_kick(i, &q.kick)?;
            if features & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits() != 0 {
                fe.set_vring_enable(i, true)?;
            }
            queues.push(q);
        }
        Ok(RawDevice {
            fe,
            mem,
            offered_features: offered,
            features,
            protocol_features,
            backend_channel: channel,
            queues,
            scratch: SCRATCH_BASE,
            static_next: STATIC_BASE,
        })
    }

    /// Reads and decodes the config space.
    pub fn config(&mut self) -> BlkConfig {
        let (_, payload) = self
            .fe
            .get_config(
                0,
                CONFIG_LEN as u32,
                VhostUserConfigFlags::empty(),
                &[0; CONFIG_LEN],
            )
            .expect("GET_CONFIG");
        BlkConfig::parse(&payload)
    }

    /// Whether virtio feature bit `bit` was offered by the device.
    pub fn offers(&self, bit: u32) -> bool {
        self.offered_features & (1 << bit) != 0
    }

    /// Takes `len` bytes (16-byte aligned) of scratch memory. Scratch is recycled for every
    /// [`RawDevice::request`], as only one request is on the ring at a time.
    pub fn alloc(&mut self, len: u64) -> u64 {
        let addr = self.scratch.next_multiple_of(16);
        assert!(addr + len <= STATIC_BASE, "scratch area exhausted");
        self.scratch = addr + len;
        addr
    }

    /// Takes `len` bytes (16-byte aligned) of guest memory that is never recycled: for
    /// hand-made chains that must survive the liveness reads in between.
    pub fn alloc_static(&mut self, len: u64) -> u64 {
        let addr = self.static_next.next_multiple_of(16);
        assert!(addr + len <= MEM_SIZE, "static area exhausted");
        self.static_next = addr + len;
        addr
    }

    /// Writes `entries` as a descriptor table into fresh static memory (for hand-made indirect
    /// tables) and returns its guest address.
    pub fn write_desc_table(&mut self, entries: &[Desc]) -> u64 {
        let table = self.alloc_static(16 * entries.len().max(1) as u64);
        for (i, e) in entries.iter().enumerate() {
            self.mem.write(table + 16 * i as u64, &e.encode());
        }
        table
    }

    /// Writes `descs` into queue `q`'s descriptor table at indices 0.., publishes `head` in the
    /// available ring and kicks. Used directly for chains that no builder makes (e.g. loops).
    pub fn post(&mut self, q: usize, descs: &[Desc], head: u16) {
        let vq = &self.queues[q];
        assert!(descs.len() <= vq.size as usize);
        for (i, d) in descs.iter().enumerate() {
            self.mem.write(vq.desc + 16 * i as u64, &d.encode());
        }
        let slot = vq.next_avail % vq.size;
        self.mem.write_u16(vq.avail + 4 + 2 * slot as u64, head);
        // The descriptors and ring entry must be visible before the index that publishes them.
        fence(Ordering::SeqCst);
        let idx = vq.next_avail.wrapping_add(1);
        self.mem.write_u16(vq.avail + 2, idx);
        fence(Ordering::SeqCst);
        self.queues[q].next_avail = idx;
        self.queues[q].kick.write(1).unwrap();
    }

    /// Writes `descs` (descriptor table index, descriptor) into queue `q`'s table, puts every
    /// head of `heads` on the avail ring and publishes them with one index store and one kick,
    /// as a driver with many requests queued does.
    pub fn post_batch(&mut self, q: usize, descs: &[(u16, Desc)], heads: &[u16]) {
        let vq = &self.queues[q];
        assert!(heads.len() <= vq.size as usize);
        for (index, d) in descs {
            assert!(*index < vq.size);
            self.mem
                .write(vq.desc + 16 * u64::from(*index), &d.encode());
        }
        let mut idx = vq.next_avail;
        for head in heads {
            let slot = idx % vq.size;
            self.mem.write_u16(vq.avail + 4 + 2 * slot as u64, *head);
            idx = idx.wrapping_add(1);
        }
        fence(Ordering::SeqCst);
        self.mem.write_u16(vq.avail + 2, idx);
        fence(Ordering::SeqCst);
        self.queues[q].next_avail = idx;
        self.queues[q].kick.write(1).unwrap();
    }

    /// The used index of queue `q` as the device last wrote it.
    pub fn used_index(&self, q: usize) -> u16 {
        self.mem.read_u16(self.queues[q].used + 2)
    }

    /// The call eventfd of queue `q` (the guest's interrupt).
    pub fn call_event(&self, q: usize) -> &EventFd {
        &self.queues[q].call
    }

    /// Sets queue `q` up again from scratch (empty rings, index 0, new kick and call
    /// eventfds), as a VMM does after a device reset. No SET_VRING_ERR: QEMU sends that once
    /// per connection.
    pub fn restart_queue(&mut self, q: usize) -> Result<(), vhost::Error> {
        let size = self.queues[q].size;
        let fresh = SplitQueue::new(q, size);
        self.mem.fill(fresh.avail, 6 + 2 * size as usize, 0);
        self.mem.fill(fresh.used, 6 + 8 * size as usize, 0);
        self.fe.set_vring_num(q, size)?;
        self.fe.set_vring_addr(
            q,
            &VringConfigData {
                queue_max_size: size,
                queue_size: size,
                flags: 0,
                desc_table_addr: self.mem.host_addr(fresh.desc),
                used_ring_addr: self.mem.host_addr(fresh.used),
                avail_ring_addr: self.mem.host_addr(fresh.avail),
                log_addr: None,
            },
        )?;
        self.fe.set_vring_base(q, 0)?;
        self.fe.set_vring_call(q, &fresh.call)?;
        self.fe.set_vring_kick(q, &fresh.kick)?;
        if self.features & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits() != 0 {
            self.fe.set_vring_enable(q, true)?;
        }
        self.queues[q] = fresh;
        Ok(())
    }

    /// Publishes avail index `idx` on queue `q` with nothing behind it, and kicks: an index
    /// more than a ring ahead breaks the ring.
    pub fn publish_avail_index(&mut self, q: usize, idx: u16) {
        let vq = &self.queues[q];
        self.mem.write_u16(vq.avail + 2, idx);
        fence(Ordering::SeqCst);
        vq.kick.write(1).unwrap();
    }

    /// Waits up to `timeout` for the next used entry of queue `q`.
    pub fn wait_used(&mut self, q: usize, timeout: Duration) -> Option<Used> {
        let deadline = Instant::now() + timeout;
        loop {
            let vq = &self.queues[q];
            let used_idx = self.mem.read_u16(vq.used + 2);
            if used_idx != vq.last_used {
                let outstanding = vq.next_avail.wrapping_sub(vq.last_used);
                let new = used_idx.wrapping_sub(vq.last_used);
                assert!(
                    new <= outstanding,
                    "device advanced used idx by {new} with only {outstanding} chains outstanding"
                );
                // The entry must be read after the index that published it.
                fence(Ordering::SeqCst);
                let slot = (vq.last_used % vq.size) as u64;
                let id = self.mem.read_u32(vq.used + 4 + 8 * slot);
                let len = self.mem.read_u32(vq.used + 8 + 8 * slot);
                self.queues[q].last_used = vq.last_used.wrapping_add(1);
                let _ = self.queues[q].call.read();
                return Some(Used { id, len });
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_micros(500));
        }
    }

    /// Posts `descs` with `head` and waits for the used entry; panics after
    /// [`REQUEST_TIMEOUT`] (a hung request is a bug by itself).
    pub fn run_descs(&mut self, q: usize, descs: &[Desc], head: u16) -> Used {
        self.try_run_descs(q, descs, head, REQUEST_TIMEOUT)
            .unwrap_or_else(|| panic!("no used entry within {REQUEST_TIMEOUT:?} for {descs:x?}"))
    }

    /// Like [`RawDevice::run_descs`], but `None` after `timeout`.
    pub fn try_run_descs(
        &mut self,
        q: usize,
        descs: &[Desc],
        head: u16,
        timeout: Duration,
    ) -> Option<Used> {
        self.post(q, descs, head);
        let used = self.wait_used(q, timeout)?;
        assert_eq!(used.id, head as u32, "used entry for the wrong head");
        Some(used)
    }

    /// The guest address of queue `q`'s used ring.
    pub fn used_ring_addr(&self, q: usize) -> u64 {
        self.queues[q].used
    }

    /// Posts `segs` as one chain (directly in the table, or via an indirect table) and waits
    /// up to `timeout` for its used entry.
    pub fn try_run_chain(
        &mut self,
        q: usize,
        segs: &[Seg],
        indirect: bool,
        timeout: Duration,
    ) -> Option<Used> {
        let head = self.post_chain(q, segs, indirect);
        let used = self.wait_used(q, timeout)?;
        assert_eq!(used.id, head as u32, "used entry for the wrong head");
        Some(used)
    }

    /// Posts `segs` as one chain at head 0 (directly in the table, or via an indirect table)
    /// without waiting; returns the head. Only one chain may be outstanding at a time.
    pub fn post_chain(&mut self, q: usize, segs: &[Seg], indirect: bool) -> u16 {
        let chain: Vec<Desc> = segs
            .iter()
            .enumerate()
            .map(|(i, s)| Desc {
                addr: s.addr,
                len: s.len,
                flags: if s.writable { F_WRITE } else { 0 }
                    | if i + 1 < segs.len() { F_NEXT } else { 0 },
                next: if i + 1 < segs.len() { i as u16 + 1 } else { 0 },
            })
            .collect();
        if indirect {
            let table = self.alloc(16 * chain.len() as u64);
            for (i, d) in chain.iter().enumerate() {
                self.mem.write(table + 16 * i as u64, &d.encode());
            }
            let head = Desc {
                addr: table,
                len: 16 * chain.len() as u32,
                flags: F_INDIRECT,
                next: 0,
            };
            self.post(q, &[head], 0);
        } else {
            self.post(q, &chain, 0);
        }
        0
    }

    /// Lays out `req` in scratch memory, runs it, and reports used len, status and read data;
    /// panics if it does not complete within [`REQUEST_TIMEOUT`].
    pub fn request(&mut self, q: usize, req: &BlkRequest) -> BlkResult {
        self.try_request(q, req, REQUEST_TIMEOUT)
            .unwrap_or_else(|| panic!("no used entry within {REQUEST_TIMEOUT:?} for {req:?}"))
    }

    /// Like [`RawDevice::request`], but `None` after `timeout`.
    pub fn try_request(
        &mut self,
        q: usize,
        req: &BlkRequest,
        timeout: Duration,
    ) -> Option<BlkResult> {
        self.scratch = SCRATCH_BASE;
        let mut segs = Vec::new();
        let mut in_bufs = Vec::new();
        for b in std::iter::once(&req.header).chain(&req.data) {
            match b {
                Buf::Out(content) => {
                    let addr = self.alloc(content.len() as u64);
                    self.mem.write(addr, content);
                    segs.push(Seg {
                        addr,
                        len: content.len() as u32,
                        writable: false,
                    });
                }
                Buf::In(len) => {
                    let addr = self.alloc(*len as u64);
                    self.mem.fill(addr, *len as usize, 0xaa);
                    segs.push(Seg {
                        addr,
                        len: *len,
                        writable: true,
                    });
                    in_bufs.push((addr, *len));
                }
                Buf::Raw(seg) => segs.push(*seg),
            }
        }
        let mut status_addr = None;
        match req.status {
            Status::Missing => {}
            Status::Normal | Status::ReadOnly | Status::ZeroLength => {
                let addr = self.alloc(16);
                self.mem.fill(addr, 16, STATUS_SENTINEL);
                segs.push(Seg {
                    addr,
                    len: if req.status == Status::ZeroLength {
                        0
                    } else {
                        1
                    },
                    writable: req.status != Status::ReadOnly,
                });
                status_addr = Some(addr);
            }
            Status::At(addr) => segs.push(Seg {
                addr,
                len: 1,
                writable: true,
            }),
        }
        let used = self.try_run_chain(q, &segs, req.indirect, timeout)?;
        let status = status_addr
            .map(|a| self.mem.read(a, 1)[0])
            .filter(|&s| s != STATUS_SENTINEL);
        Some(BlkResult {
            used_len: used.len,
            status,
            data: in_bufs
                .iter()
                .map(|&(a, l)| self.mem.read(a, l as usize))
                .collect(),
        })
    }

    /// A plain read of `len` bytes at `sector`.
    pub fn read(&mut self, q: usize, sector: u64, len: u32) -> BlkResult {
        self.request(
            q,
            &BlkRequest::new(VIRTIO_BLK_T_IN, sector).data(Buf::In(len)),
        )
    }

    /// A plain write of `data` at `sector`.
    pub fn write(&mut self, q: usize, sector: u64, data: &[u8]) -> BlkResult {
        self.request(
            q,
            &BlkRequest::new(VIRTIO_BLK_T_OUT, sector).data(Buf::Out(data.to_vec())),
        )
    }

    /// Asserts that a valid 4 KiB read of sector 0 on queue `q` still works: the liveness
    /// check after every piece of bad input (4 KiB suits both logical block sizes).
    #[track_caller]
    pub fn assert_alive(&mut self, q: usize, after: &str) {
        let r = self.read(q, 0, 4096);
        assert_eq!(
            r.status_u32(),
            Some(VIRTIO_BLK_S_OK),
            "valid read after {after} failed: {r:?}"
        );
        assert_eq!(r.used_len, 4097, "valid read after {after}: wrong used len");
    }
}
