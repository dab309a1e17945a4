//! The disk as the guest sees it: virtio feature bits, protocol features and the
//! `virtio_blk_config` space.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use vhost::vhost_user::message::{VhostUserProtocolFeatures, VhostUserVirtioFeatures};
use virtio_bindings::virtio_blk::{
    virtio_blk_config, VIRTIO_BLK_F_BLK_SIZE, VIRTIO_BLK_F_CONFIG_WCE, VIRTIO_BLK_F_DISCARD,
    VIRTIO_BLK_F_FLUSH, VIRTIO_BLK_F_MQ, VIRTIO_BLK_F_RO, VIRTIO_BLK_F_SEG_MAX,
    VIRTIO_BLK_F_SIZE_MAX, VIRTIO_BLK_F_TOPOLOGY, VIRTIO_BLK_F_WRITE_ZEROES,
};
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ring::{VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC};

/// log2 of the virtio-blk sector (512 bytes): the unit of every sector number on the wire,
/// whatever the logical block size.
pub const SECTOR_SHIFT: u32 = 9;
/// Most memory slots the VMM may register (GET_MAX_MEM_SLOTS).
pub const MAX_MEM_SLOTS: u64 = blkplane_proto::control::MAX_MEMORY_REGIONS as u64;
/// Largest ring the virtio spec allows.
pub const MAX_QUEUE_SIZE: u16 = 32768;
/// Most data segments a request may have (advertised as seg_max), before queue-size limits.
pub const MAX_SEG_MAX: u32 = 254;
/// Largest segment, advertised as size_max: large enough never to split a guest buffer.
pub const SIZE_MAX: u32 = 1 << 22;
/// Most ranges in one discard or write-zeroes request.
pub const MAX_DISCARD_SEGMENTS: u32 = 32;
/// Most sectors in one discard or write-zeroes range (2 GiB: fallocate is cheap at any size).
pub const MAX_DISCARD_SECTORS: u32 = 1 << 22;
/// Bytes the serial (GET_ID) answer holds.
pub const SERIAL_LEN: usize = virtio_bindings::virtio_blk::VIRTIO_BLK_ID_BYTES as usize;

/// A set of CPUs, sorted, without duplicates.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CpuList(pub Vec<usize>);

/// Parses a CPU list such as `0-1,3` (see [`blkplane_proto::cpus`]).
pub fn parse_cpu_list(text: &str) -> Result<CpuList, String> {
    blkplane_proto::cpus::parse_cpu_list(text).map(CpuList)
}

/// How the image is accessed and what the guest is told about its write cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum CacheMode {
    /// O_DIRECT (falls back to buffered where the file system refuses it); volatile write
    /// cache, so FLUSH runs fdatasync. Like QEMU's cache=none.
    Direct,
    /// Page cache; volatile write cache, FLUSH runs fdatasync. Like QEMU's cache=writeback.
    Writeback,
    /// Page cache; every write is made durable before it completes. Like QEMU's
    /// cache=writethrough.
    Writethrough,
}

/// Everything fixed about a disk for the life of the frontend, plus the two values the guest
/// or the operator may change while it runs.
#[derive(Debug)]
pub struct DiskConfig {
    /// Capacity in 512-byte sectors.
    capacity: AtomicU64,
    /// Refuse writes, discards and write-zeroes.
    pub read_only: bool,
    /// GET_ID answer, NUL padded.
    pub serial: [u8; SERIAL_LEN],
    /// Number of request queues offered.
    pub num_queues: u16,
    /// Largest ring size accepted.
    pub queue_size: u16,
    /// Logical block size in bytes (512 or 4096).
    pub block_size: u32,
    /// The guest's write-cache-enable setting (CONFIG_WCE); false means writethrough.
    writeback: AtomicBool,
    /// The setting the device starts with, from the cache mode.
    default_writeback: bool,
    /// The bound of the adaptive polling (zero: never poll): the workers' of the avail rings
    /// and the iothreads' of their submission queues; see `blkplane_poll`.
    pub poll_max: std::time::Duration,
}

impl DiskConfig {
    /// Builds the configuration; `serial` longer than 20 bytes is truncated, as QEMU does.
    pub fn new(
        capacity_bytes: u64,
        read_only: bool,
        serial: &str,
        num_queues: u16,
        queue_size: u16,
        block_size: u32,
        cache: CacheMode,
    ) -> Self {
        let mut serial_bytes = [0u8; SERIAL_LEN];
        for (dst, src) in serial_bytes.iter_mut().zip(serial.bytes()) {
            *dst = src;
        }
        Self {
            capacity: AtomicU64::new(Self::sectors(capacity_bytes, block_size)),
            read_only,
            serial: serial_bytes,
            num_queues,
            queue_size,
            block_size,
            writeback: AtomicBool::new(cache != CacheMode::Writethrough),
            default_writeback: cache != CacheMode::Writethrough,
            poll_max: std::time::Duration::ZERO,
        }
    }

    fn sectors(bytes: u64, block_size: u32) -> u64 {
        // Only whole logical blocks are exposed.
        let partial = bytes.checked_rem(u64::from(block_size)).unwrap_or(0);
        bytes.saturating_sub(partial) >> SECTOR_SHIFT
    }

    /// Capacity in sectors.
    pub fn capacity(&self) -> u64 {
        self.capacity.load(Ordering::Relaxed)
    }

    /// Sets the capacity from a new image size (resize).
    pub fn set_capacity_bytes(&self, bytes: u64) {
        self.capacity
            .store(Self::sectors(bytes, self.block_size), Ordering::Relaxed);
    }

    /// Capacity in bytes.
    pub fn capacity_bytes(&self) -> u64 {
        self.capacity() << SECTOR_SHIFT
    }

    /// Whether writes may complete before they are durable.
    pub fn writeback(&self) -> bool {
        self.writeback.load(Ordering::Relaxed)
    }

    /// Data segments one request may carry (seg_max): a direct chain also needs a header and
    /// a status descriptor, hence queue size − 2, as QEMU does.
    pub fn seg_max(&self) -> u32 {
        u32::from(self.queue_size)
            .saturating_sub(2)
            .clamp(1, MAX_SEG_MAX)
    }

    /// Segments a ring slot holds: room for every data descriptor to straddle a memory-region
    /// boundary, and for the most discard ranges.
    pub fn segments_per_slot(&self) -> u32 {
        self.seg_max()
            .saturating_mul(2)
            .saturating_add(16)
            .max(MAX_DISCARD_SEGMENTS)
    }

    /// The virtio feature bits offered.
    pub fn features(&self) -> u64 {
        let mut bits = [
            VIRTIO_F_VERSION_1,
            VIRTIO_RING_F_INDIRECT_DESC,
            VIRTIO_RING_F_EVENT_IDX,
            VIRTIO_BLK_F_SEG_MAX,
            VIRTIO_BLK_F_SIZE_MAX,
            VIRTIO_BLK_F_BLK_SIZE,
            VIRTIO_BLK_F_TOPOLOGY,
            VIRTIO_BLK_F_FLUSH,
            VIRTIO_BLK_F_CONFIG_WCE,
            VIRTIO_BLK_F_MQ,
            VIRTIO_BLK_F_DISCARD,
            VIRTIO_BLK_F_WRITE_ZEROES,
        ]
        .iter()
        .fold(0u64, |acc, bit| acc | (1u64 << bit));
        if self.read_only {
            bits |= 1 << VIRTIO_BLK_F_RO;
        }
        // LOG_ALL: the VMM may start dirty logging for a live migration (see dirty_log.rs).
        bits | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits()
            | VhostUserVirtioFeatures::LOG_ALL.bits()
    }

    /// The vhost-user protocol features offered (REPLY_ACK is added by the vhost crate).
    pub fn protocol_features() -> VhostUserProtocolFeatures {
        VhostUserProtocolFeatures::MQ
            | VhostUserProtocolFeatures::CONFIG
            | VhostUserProtocolFeatures::REPLY_ACK
            | VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS
            | VhostUserProtocolFeatures::RESET_DEVICE
            | VhostUserProtocolFeatures::BACKEND_REQ
            | VhostUserProtocolFeatures::INFLIGHT_SHMFD
            | VhostUserProtocolFeatures::LOG_SHMFD
    }

    /// The config space as the guest reads it now.
    pub fn config_space(&self) -> virtio_blk_config {
        let block_sectors = self.block_size >> SECTOR_SHIFT;
        virtio_blk_config {
            capacity: self.capacity(),
            size_max: SIZE_MAX,
            seg_max: self.seg_max(),
            blk_size: self.block_size,
            physical_block_exp: 0,
            alignment_offset: 0,
            min_io_size: 1,
            opt_io_size: 0,
            wce: u8::from(self.writeback()),
            num_queues: self.num_queues,
            max_discard_sectors: MAX_DISCARD_SECTORS,
            max_discard_seg: MAX_DISCARD_SEGMENTS,
            discard_sector_alignment: block_sectors,
            max_write_zeroes_sectors: MAX_DISCARD_SECTORS,
            max_write_zeroes_seg: MAX_DISCARD_SEGMENTS,
            write_zeroes_may_unmap: 1,
            ..Default::default()
        }
    }

    /// Reads `size` bytes of config space at `offset`; `None` when the range is outside it.
    pub fn read_config(&self, offset: u32, size: u32) -> Option<Vec<u8>> {
        let config = ConfigSpace(self.config_space());
        let bytes = vm_memory::ByteValued::as_slice(&config);
        let start = usize::try_from(offset).ok()?;
        let end = start.checked_add(usize::try_from(size).ok()?)?;
        bytes.get(start..end).map(<[u8]>::to_vec)
    }

    /// Restores the write-cache setting the device starts with (device reset).
    pub fn reset_writeback(&self) {
        self.writeback
            .store(self.default_writeback, Ordering::Relaxed);
    }

    /// Applies a config-space write from the guest. Only `wce` is writable (CONFIG_WCE).
    pub fn write_config(&self, offset: u32, data: &[u8]) -> Result<(), ConfigWriteError> {
        let wce_offset = u32::try_from(std::mem::offset_of!(virtio_blk_config, wce)).ok();
        let wce_offset = wce_offset.unwrap_or(u32::MAX);
        match (offset, data) {
            (o, [value]) if o == wce_offset => {
                self.writeback.store(*value != 0, Ordering::Relaxed);
                Ok(())
            }
            _ => Err(ConfigWriteError {
                offset,
                len: data.len(),
            }),
        }
    }
}

/// `virtio_blk_config` as raw bytes.
#[repr(transparent)]
#[derive(Clone, Copy, Default)]
struct ConfigSpace(virtio_blk_config);

// SAFETY: virtio_blk_config is `repr(C, packed)` and made of integers only, so it has no padding
// and every byte pattern is a valid value.
unsafe impl vm_memory::ByteValued for ConfigSpace {}

/// A config write the device does not allow.
#[derive(Debug, thiserror::Error)]
#[error(
    "config space write of {len} bytes at offset {offset} is not allowed (only wce is writable)"
)]
pub struct ConfigWriteError {
    offset: u32,
    len: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn disk(read_only: bool, cache: CacheMode) -> DiskConfig {
        DiskConfig::new(1 << 30, read_only, "serial-1", 2, 256, 4096, cache)
    }

    #[test]
    fn config_space_matches_the_disk() {
        let d = disk(false, CacheMode::Direct);
        let c = d.config_space();
        assert_eq!({ c.capacity }, (1 << 30) / 512);
        assert_eq!({ c.blk_size }, 4096);
        assert_eq!({ c.num_queues }, 2);
        assert_eq!({ c.seg_max }, 254);
        assert_eq!(c.wce, 1);
        assert_eq!({ c.discard_sector_alignment }, 8);
        // libblkio reads the first 60 bytes: up to write_zeroes_may_unmap and its padding.
        assert_eq!(d.read_config(0, 60).unwrap().len(), 60);
        assert!(d.read_config(u32::MAX, 2).is_none());
        assert!(d.read_config(0, 4096).is_none());
    }

    #[test]
    fn capacity_rounds_down_to_whole_blocks() {
        let d = DiskConfig::new(4096 * 3 + 1000, false, "", 1, 256, 4096, CacheMode::Direct);
        assert_eq!(d.capacity(), 24);
    }

    #[test]
    fn features_follow_the_options() {
        let rw = disk(false, CacheMode::Direct).features();
        let ro = disk(true, CacheMode::Direct).features();
        assert_eq!(rw & (1 << VIRTIO_BLK_F_RO), 0);
        assert_ne!(ro & (1 << VIRTIO_BLK_F_RO), 0);
        assert_ne!(rw & (1 << VIRTIO_F_VERSION_1), 0);
    }

    #[test]
    fn guest_toggles_the_write_cache() {
        let d = disk(false, CacheMode::Writethrough);
        assert!(!d.writeback());
        let wce = std::mem::offset_of!(virtio_blk_config, wce) as u32;
        d.write_config(wce, &[1]).unwrap();
        assert!(d.writeback());
        d.reset_writeback();
        assert!(
            !d.writeback(),
            "a device reset restores the cache mode's setting"
        );
        assert!(d.write_config(0, &[1]).is_err());
        assert!(d.write_config(wce, &[1, 2]).is_err());
    }

    #[test]
    fn serial_is_truncated_and_padded() {
        let d = DiskConfig::new(
            512,
            false,
            "0123456789abcdefghijXYZ",
            1,
            4,
            512,
            CacheMode::Direct,
        );
        assert_eq!(&d.serial, b"0123456789abcdefghij");
        assert_eq!(d.seg_max(), 2);
        assert!(d.segments_per_slot() >= MAX_DISCARD_SEGMENTS);
    }
}
