//! Dirty logging for live migration (VHOST_USER_PROTOCOL_F_LOG_SHMFD, VHOST_F_LOG_ALL), driven
//! by a raw vhost-user front-end that plays the VMM's part: it hands the frontend a log with
//! SET_LOG_BASE, turns logging on and off with SET_FEATURES, and reads the bitmap the way QEMU
//! does. Every guest page blkplane writes — read data (written by the iothread, another
//! process), status bytes, GET_ID strings, the used ring — must be marked, and nothing else:
//! not the pages the device only reads, and nothing while logging is off. A read already in
//! flight when logging starts is marked when it completes. A refused LOG_ALL (no log yet, or
//! migration blocked) is answered with a REPLY_ACK error and the session goes on.

use std::collections::BTreeSet;
use std::os::fd::AsRawFd;
use std::time::Duration;

use blkplane_proto::shm::{sealed_memfd, SharedMapping};
use blkplane_tests::raw::{blk_header, RawDevice, Seg, MEM_SIZE, STATIC_BASE};
use blkplane_tests::*;
use vhost::vhost_user::message::{VhostUserProtocolFeatures, VhostUserVirtioFeatures};
use vhost::{VhostBackend, VhostUserDirtyLogRegion};
use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_S_OK, VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT,
};

const PAGE: u64 = 4096;
const QUEUE_SIZE: u16 = 64;
/// One bit per page of the raw device's guest memory.
const LOG_LEN: u64 = MEM_SIZE / PAGE / 8;

/// The VMM's side of the log: a memfd it maps, reads and clears.
struct Log {
    file: std::fs::File,
    map: SharedMapping,
}

impl Log {
    fn new() -> Log {
        let file = sealed_memfd(c"dirty-log", LOG_LEN).unwrap();
        let map = SharedMapping::new(&file, LOG_LEN, 0).unwrap();
        Log { file, map }
    }

    fn region(&self) -> VhostUserDirtyLogRegion {
        VhostUserDirtyLogRegion {
            mmap_size: LOG_LEN,
            mmap_offset: 0,
            mmap_handle: self.file.as_raw_fd(),
        }
    }

    /// The marked pages, cleared as QEMU's sync does.
    fn take(&self) -> BTreeSet<u64> {
        let mut pages = BTreeSet::new();
        for byte in 0..LOG_LEN {
            // SAFETY: inside the mapping.
            let cell = unsafe { self.map.as_ptr().add(byte as usize) };
            // SAFETY: as above; the frontend only sets bits with atomic ORs.
            let bits = unsafe {
                std::sync::atomic::AtomicU8::from_ptr(cell)
                    .swap(0, std::sync::atomic::Ordering::AcqRel)
            };
            for bit in 0..8 {
                if bits & (1 << bit) != 0 {
                    pages.insert(byte * 8 + bit);
                }
            }
        }
        pages
    }

    /// The pages marked once every page of `want` is, with whatever else is marked by then.
    /// The iothread marks a batch right after it stores the used index (as Linux's vhost marks
    /// after it adds used entries), so a driver polling the ring can see a completion a moment
    /// before its pages are marked; a VMM reads the log for the last time only after
    /// GET_VRING_BASE, which the frontend answers once the iothread has stopped the ring, by
    /// when every mark is made. A mark that never comes fails the caller's comparison after
    /// ten seconds.
    fn take_marked(&self, want: &BTreeSet<u64>) -> BTreeSet<u64> {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let mut pages = self.take();
        while !pages.is_superset(want) && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
            pages.extend(self.take());
        }
        // Anything marked beside `want` in the same batch is in the log by now as well.
        std::thread::sleep(Duration::from_millis(20));
        pages.extend(self.take());
        pages
    }
}

fn pages(addr: u64, len: u64) -> BTreeSet<u64> {
    (addr / PAGE..=(addr + len - 1) / PAGE).collect()
}

/// A chain laid out by hand at known addresses, each part on pages of its own: header at
/// `base`, `data` bytes from `base + PAGE + 100` (so it straddles pages), status two pages
/// after the data.
struct Chain {
    segs: Vec<Seg>,
    data: u64,
    status: u64,
}

fn chain(
    dev: &mut RawDevice,
    base: u64,
    type_: u32,
    sector: u64,
    data: u32,
    writable: bool,
) -> Chain {
    let header = blk_header(type_, sector);
    dev.mem.write(base, &header);
    let data_addr = base + PAGE + 100;
    let status = (data_addr + u64::from(data)).next_multiple_of(PAGE) + PAGE;
    dev.mem.fill(status, 1, 0xff);
    Chain {
        segs: vec![
            Seg {
                addr: base,
                len: header.len() as u32,
                writable: false,
            },
            Seg {
                addr: data_addr,
                len: data,
                writable,
            },
            Seg {
                addr: status,
                len: 1,
                writable: true,
            },
        ],
        data: data_addr,
        status,
    }
}

#[test]
fn written_pages_are_marked_while_logging_and_refusals_keep_the_session() {
    let dir = TempDir::new("dirty-log");
    let image = create_random_image(&dir.join("disk.img"), 4 << 20, 11);
    let admin = dir.join("admin.sock");
    let fe = Frontend::start(&image, &["--admin-socket", admin.to_str().unwrap()]);
    let mut dev = RawDevice::connect_negotiating(
        fe.socket(),
        1,
        QUEUE_SIZE,
        VhostUserProtocolFeatures::LOG_SHMFD,
    )
    .unwrap();
    let log_all = VhostUserVirtioFeatures::LOG_ALL.bits();
    assert_ne!(dev.offered_features & log_all, 0, "VHOST_F_LOG_ALL offered");
    assert!(dev
        .protocol_features
        .contains(VhostUserProtocolFeatures::LOG_SHMFD | VhostUserProtocolFeatures::REPLY_ACK));
    let features = dev.features;
    let used = dev.used_ring_addr(0);
    let used_pages = pages(used, 6 + 8 * u64::from(QUEUE_SIZE));

    // LOG_ALL before any SET_LOG_BASE: refused with a status, the session goes on.
    assert!(dev.fe.set_features(features | log_all).is_err());
    dev.assert_alive(0, "LOG_ALL without a log was refused");

    let log = Log::new();
    dev.fe.set_log_base(0, Some(log.region())).unwrap();

    // Migration blocked (the disk is drained): refused with the reason logged, session kept.
    admin::drain(&admin, false).unwrap();
    assert!(dev.fe.set_features(features | log_all).is_err());
    admin::resume(&admin).unwrap();
    dev.assert_alive(0, "LOG_ALL refused while drained");
    let stderr = fe.stderr();
    assert!(
        stderr.contains("VHOST_F_LOG_ALL refused") && stderr.contains("draining"),
        "refusal not logged with its reason:\n{stderr}"
    );

    // Logging off: reads mark nothing.
    dev.read(0, 0, 8192);
    assert_eq!(log.take(), BTreeSet::new(), "marked while logging is off");

    // A read in flight when logging starts: the iothread is stopped with the request in its
    // ring, logging is turned on, then the iothread goes on and completes it.
    let iothread = fe.wait_iothreads(1, &[], Duration::from_secs(10))[0];
    // SAFETY: plain signal to a child process of the frontend.
    assert_eq!(unsafe { libc::kill(iothread as i32, libc::SIGSTOP) }, 0);
    let len = 3 * PAGE as u32;
    let read = chain(&mut dev, STATIC_BASE, VIRTIO_BLK_T_IN, 8, len, true);
    dev.mem.fill(read.data, len as usize, 0xaa);
    dev.post_chain(0, &read.segs, false);
    std::thread::sleep(Duration::from_millis(300));
    dev.fe.set_features(features | log_all).unwrap();
    assert_eq!(
        log.take(),
        BTreeSet::new(),
        "marked before the iothread wrote anything"
    );
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(iothread as i32, libc::SIGCONT) }, 0);
    let done = dev
        .wait_used(0, Duration::from_secs(10))
        .expect("the read completes after SIGCONT");
    assert_eq!(done.len, len + 1);
    assert_eq!(dev.mem.read(read.status, 1)[0], VIRTIO_BLK_S_OK as u8);
    assert_same_data(
        "read completed while logging",
        &dev.mem.read(read.data, len as usize),
        &read_file_at(&image, 8 * 512, len as usize),
    );
    let mut want = pages(read.data, u64::from(len));
    want.insert(read.status / PAGE);
    want.extend(&used_pages);
    assert_eq!(
        log.take_marked(&want),
        want,
        "read data, status and used ring"
    );

    // A write: the device only reads its data, so only status and used ring are marked.
    let write = chain(
        &mut dev,
        STATIC_BASE + 16 * PAGE,
        VIRTIO_BLK_T_OUT,
        64,
        len,
        false,
    );
    dev.mem.write(write.data, &pattern(5, len as usize));
    dev.post_chain(0, &write.segs, false);
    dev.wait_used(0, Duration::from_secs(10))
        .expect("write completes");
    let mut want: BTreeSet<u64> = [write.status / PAGE].into();
    want.extend(&used_pages);
    assert_eq!(
        log.take_marked(&want),
        want,
        "write: status and used ring only"
    );

    // GET_ID: the frontend writes the serial itself.
    let id = chain(
        &mut dev,
        STATIC_BASE + 32 * PAGE,
        VIRTIO_BLK_T_GET_ID,
        0,
        20,
        true,
    );
    dev.post_chain(0, &id.segs, false);
    dev.wait_used(0, Duration::from_secs(10))
        .expect("GET_ID completes");
    let mut want = pages(id.data, 20);
    want.insert(id.status / PAGE);
    want.extend(&used_pages);
    assert_eq!(
        log.take_marked(&want),
        want,
        "GET_ID string, status and used ring"
    );

    // LOG_ALL cleared (a cancelled migration): nothing is marked any more.
    dev.fe.set_features(features).unwrap();
    dev.read(0, 0, 8192);
    assert_eq!(log.take(), BTreeSet::new(), "marked after logging stopped");
    dev.assert_alive(0, "logging stopped");
    // Starting and stopping logging left the iothread alone (the reply it owes the worker
    // for an announced log was once taken for its death, and it was killed and replaced).
    let stderr = fe.stderr();
    assert!(
        !stderr.contains("replaced iothread"),
        "dirty logging replaced the iothread:\n{stderr}"
    );
    fe.finish();
}
