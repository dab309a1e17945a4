//! Drives the real `blkplane-iothread` binary the way a frontend does: a shared ring, two
//! eventfds, a memfd as guest memory and an image file, the control handshake over a socket
//! pair, then requests written into slots, pushed, published and waited for.
//!
//! Every wait is bounded (see [`TIMEOUT`]) so a broken iothread fails a test instead of hanging
//! it, and every spawned iothread is killed when its [`Frontend`] is dropped.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::arithmetic_side_effects,
    clippy::cast_possible_truncation
)]

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use blkplane_proto::control::{
    self, ControlError, ControlReply, ControlRequest, MemoryRegionSpec, SetupSpec, MAX_POLL_MAX_US,
    SETUP_FLAG_DIRECT_FD, SETUP_FLAG_NULL_IMAGE,
};
use blkplane_proto::ring::{
    Completion, Consumer, Opcode, Producer, Segment, SharedRing, SlotHeader, SlotTable,
    RANGE_FLAG_UNMAP, SLOT_FLAG_SYNC,
};
use virtio_bindings::virtio_blk::{VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK};

/// The bound on every wait; generous because the machine may be busy, never a timing check.
const TIMEOUT: Duration = Duration::from_secs(30);
const GUEST_SIZE: u64 = 4 << 20;
const IMAGE_SIZE: u64 = 8 << 20;
const OK: u32 = VIRTIO_BLK_S_OK;
const IOERR: u32 = VIRTIO_BLK_S_IOERR;

/// Region 0 is the first 2 MiB of the guest memfd; region 1 is 1 MiB starting 512 bytes past
/// the 2 MiB mark, so that an mmap_offset that is not page aligned is exercised too.
const REGIONS: [MemoryRegionSpec; 2] = [
    MemoryRegionSpec {
        size: 2 << 20,
        mmap_offset: 0,
        guest_addr: 0,
    },
    MemoryRegionSpec {
        size: 1 << 20,
        mmap_offset: (2 << 20) + 512,
        guest_addr: 2 << 20,
    },
];

fn eventfd(nonblocking: bool) -> File {
    let flags = libc::EFD_CLOEXEC | if nonblocking { libc::EFD_NONBLOCK } else { 0 };
    // SAFETY: plain syscall; the result is checked.
    let fd = unsafe { libc::eventfd(0, flags) };
    assert!(fd >= 0, "eventfd: {}", io::Error::last_os_error());
    // SAFETY: a fresh fd owned by nobody else.
    unsafe { File::from_raw_fd(fd) }
}

fn memfd(len: u64) -> File {
    // SAFETY: NUL-terminated literal name; the result is checked.
    let fd = unsafe { libc::memfd_create(c"guest-ram".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0, "memfd_create: {}", io::Error::last_os_error());
    // SAFETY: a fresh fd owned by nobody else.
    let file = unsafe { File::from_raw_fd(fd) };
    file.set_len(len).unwrap();
    file
}

/// An image file removed when dropped.
struct TempImage {
    path: PathBuf,
    file: File,
}

impl TempImage {
    fn new(dir: &Path) -> Self {
        static COUNTER: AtomicU32 = AtomicU32::new(0);
        let name = format!(
            "blkplane-iothread-test-{}-{}.img",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        );
        let path = dir.join(name);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .unwrap_or_else(|e| panic!("creating {}: {e}", path.display()));
        file.set_len(IMAGE_SIZE).unwrap();
        Self { path, file }
    }

    /// The image opened again with O_DIRECT, or `None` if the file system refuses O_DIRECT.
    fn open_direct(&self, writable: bool) -> Option<File> {
        match OpenOptions::new()
            .read(true)
            .write(writable)
            .custom_flags(libc::O_DIRECT)
            .open(&self.path)
        {
            Ok(file) => Some(file),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => None,
            Err(e) => panic!("opening {} with O_DIRECT: {e}", self.path.display()),
        }
    }

    fn read(&self, offset: u64, len: usize) -> Vec<u8> {
        let mut buf = vec![0; len];
        self.file.read_exact_at(&mut buf, offset).unwrap();
        buf
    }

    fn write(&self, offset: u64, data: &[u8]) {
        self.file.write_all_at(data, offset).unwrap();
    }
}

impl Drop for TempImage {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// How to set an iothread up.
struct Options {
    slots: u32,
    segments: u32,
    image_dir: PathBuf,
    /// Send an O_DIRECT fd with this logical block size.
    direct_block_size: Option<u32>,
    /// Open the O_DIRECT fd read-only, so that writes through it fail visibly.
    direct_read_only: bool,
    nonblocking_submit_eventfd: bool,
    /// Set up a null image of this size instead of the image file (which is then untouched).
    null_image: Option<u64>,
    /// The bound of the engine's polling of its submission queue (`Setup`'s `poll_max_us`).
    poll_max_us: u32,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            slots: 16,
            segments: 8,
            image_dir: std::env::temp_dir(),
            direct_block_size: None,
            direct_read_only: false,
            nonblocking_submit_eventfd: true,
            null_image: None,
            poll_max_us: 0,
        }
    }
}

/// The test's side of one iothread: what a frontend holds.
struct Frontend {
    child: Child,
    control: UnixStream,
    ring: SharedRing,
    sq: Producer<u32>,
    cq: Consumer<Completion>,
    slots: SlotTable,
    submit_eventfd: File,
    complete_eventfd: File,
    guest: File,
    image: TempImage,
}

/// One request for [`Frontend::run`]: (slot, header, segments).
type Req = (u32, SlotHeader, Vec<Segment>);

fn header(opcode: Opcode, flags: u32, image_offset: u64, segments: usize) -> SlotHeader {
    SlotHeader {
        opcode: opcode as u32,
        flags,
        image_offset,
        segment_count: segments as u32,
        ..Default::default()
    }
}

/// A data segment: `len` bytes at `offset` in region `region`.
fn data(region: u32, offset: u64, len: u32) -> Segment {
    Segment {
        offset,
        len,
        aux: region,
    }
}

/// An image range for discard / write zeroes.
fn range(offset: u64, len: u32, flags: u32) -> Segment {
    Segment {
        offset,
        len,
        aux: flags,
    }
}

fn rw(slot: u32, opcode: Opcode, image_offset: u64, segments: &[Segment]) -> Req {
    (
        slot,
        header(opcode, 0, image_offset, segments.len()),
        segments.to_vec(),
    )
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(31).wrapping_add(u32::from(seed)) as u8)
        .collect()
}

impl Frontend {
    /// Spawns an iothread, completes `Setup` and sends the two-region memory table.
    fn start(options: Options) -> Self {
        let frontend = Self::spawn_and_setup(options).unwrap_or_else(|e| panic!("setup: {e}"));
        frontend.set_memory_table(&REGIONS).unwrap();
        frontend
    }

    fn spawn_and_setup(options: Options) -> Result<Self, ControlError> {
        let image = TempImage::new(&options.image_dir);
        let direct = options.direct_block_size.map(|block_size| {
            (
                image
                    .open_direct(!options.direct_read_only)
                    .expect("caller checks O_DIRECT support first"),
                block_size,
            )
        });
        let ring = SharedRing::create(options.slots, options.segments).unwrap();
        let submit_eventfd = eventfd(options.nonblocking_submit_eventfd);
        let complete_eventfd = eventfd(true);
        let frontend = Self::spawn(ring, submit_eventfd, complete_eventfd, image);
        let (flags, logical_block_size) = match &direct {
            Some((_, block_size)) => (SETUP_FLAG_DIRECT_FD, *block_size),
            None if options.null_image.is_some() => (SETUP_FLAG_NULL_IMAGE, 512),
            None => (0, 512),
        };
        let mut fds = vec![
            frontend.ring.file().as_raw_fd(),
            frontend.submit_eventfd.as_raw_fd(),
            frontend.complete_eventfd.as_raw_fd(),
        ];
        if options.null_image.is_none() {
            fds.push(frontend.image.file.as_raw_fd());
        }
        if let Some((file, _)) = &direct {
            fds.push(file.as_raw_fd());
        }
        let setup = ControlRequest::Setup(SetupSpec {
            flags,
            logical_block_size,
            image_size: options.null_image.unwrap_or(0),
            poll_max_us: options.poll_max_us,
            backing_files: 0,
            qcow2_layers: 0,
        });
        frontend.request(&setup, &fds)?;
        Ok(frontend)
    }

    fn spawn(
        ring: SharedRing,
        submit_eventfd: File,
        complete_eventfd: File,
        image: TempImage,
    ) -> Self {
        let (control, child_end) = control::socket_pair().unwrap();
        control.set_read_timeout(Some(TIMEOUT)).unwrap();
        let child_fd = child_end.as_raw_fd();
        let mut command = Command::new(env!("CARGO_BIN_EXE_blkplane-iothread"));
        command.args(["--control-fd", "3"]);
        command.env(
            "RUST_LOG",
            std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into()),
        );
        // SAFETY: the closure runs between fork and exec and only calls async-signal-safe
        // functions (dup2, fcntl) on fds it does not free.
        unsafe {
            command.pre_exec(move || {
                let rc = if child_fd == 3 {
                    // dup2 onto itself keeps FD_CLOEXEC: clear it explicitly.
                    libc::fcntl(3, libc::F_SETFD, 0)
                } else {
                    // The new fd 3 does not inherit FD_CLOEXEC.
                    libc::dup2(child_fd, 3)
                };
                if rc < 0 {
                    return Err(io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = command.spawn().unwrap();
        drop(child_end);
        Self {
            child,
            control,
            sq: ring.submission_producer(),
            cq: ring.completion_consumer(),
            slots: ring.slots(),
            ring,
            submit_eventfd,
            complete_eventfd,
            guest: memfd(GUEST_SIZE),
            image,
        }
    }

    /// Sends a control request and waits (bounded) for its reply.
    fn request(&self, request: &ControlRequest, fds: &[RawFd]) -> Result<(), ControlError> {
        control::send_request(&self.control, request, fds)?;
        ControlReply::recv(&self.control)
    }

    fn set_memory_table(&self, regions: &[MemoryRegionSpec]) -> Result<(), ControlError> {
        let fds = vec![self.guest.as_raw_fd(); regions.len()];
        self.request(&ControlRequest::SetMemoryTable(regions.to_vec()), &fds)
    }

    fn guest_offset(region: u32, offset: u64) -> u64 {
        REGIONS[region as usize].mmap_offset + offset
    }

    fn write_guest(&self, region: u32, offset: u64, bytes: &[u8]) {
        self.guest
            .write_all_at(bytes, Self::guest_offset(region, offset))
            .unwrap();
    }

    fn read_guest(&self, region: u32, offset: u64, len: usize) -> Vec<u8> {
        let mut buf = vec![0; len];
        self.guest
            .read_exact_at(&mut buf, Self::guest_offset(region, offset))
            .unwrap();
        buf
    }

    /// Writes the requests into their slots, pushes them all and publishes once.
    fn submit(&mut self, requests: &[Req]) {
        for (slot, header, segments) in requests {
            self.slots.set_header(*slot, *header).unwrap();
            for (index, segment) in segments.iter().enumerate() {
                self.slots
                    .set_segment(*slot, index as u32, *segment)
                    .unwrap();
            }
            self.sq.push(*slot).unwrap();
        }
        if self.sq.publish() {
            self.kick();
        }
    }

    fn kick(&self) {
        (&self.submit_eventfd)
            .write_all(&1u64.to_ne_bytes())
            .unwrap();
    }

    /// Waits for exactly `count` completions.
    fn wait(&mut self, count: usize) -> Vec<Completion> {
        let deadline = Instant::now() + TIMEOUT;
        let mut done = Vec::new();
        loop {
            while let Some(completion) = self.cq.pop().unwrap() {
                done.push(completion);
            }
            self.cq.release();
            if done.len() >= count {
                assert_eq!(done.len(), count, "more completions than requests");
                return done;
            }
            if let Some(status) = self.child.try_wait().unwrap() {
                panic!(
                    "iothread exited with {status} after {} completions",
                    done.len()
                );
            }
            assert!(
                Instant::now() < deadline,
                "timed out with {} of {count} completions",
                done.len()
            );
            if self.cq.prepare_to_sleep() {
                // Short slices so that a dead iothread is noticed above.
                poll_readable(
                    self.complete_eventfd.as_raw_fd(),
                    Duration::from_millis(100),
                );
                let mut counter = [0u8; 8];
                let _ = (&self.complete_eventfd).read(&mut counter);
                self.cq.woke_up();
            }
        }
    }

    /// Submits `requests` as one batch and returns (slot, status) sorted by slot.
    fn run(&mut self, requests: &[Req]) -> Vec<(u32, u32)> {
        self.submit(requests);
        let mut statuses: Vec<_> = self
            .wait(requests.len())
            .into_iter()
            .map(|c| (c.slot, c.status))
            .collect();
        statuses.sort_unstable();
        statuses
    }

    /// Runs one request and returns its status.
    fn run_one(&mut self, request: Req) -> u32 {
        let slot = request.0;
        let done = self.run(&[request]);
        assert_eq!(done[0].0, slot);
        done[0].1
    }

    /// Waits for the iothread to exit.
    fn wait_exit(&mut self) -> ExitStatus {
        let deadline = Instant::now() + TIMEOUT;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(Instant::now() < deadline, "iothread did not exit");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn shutdown(mut self) -> ExitStatus {
        self.request(&ControlRequest::Shutdown, &[]).unwrap();
        self.wait_exit()
    }
}

impl Drop for Frontend {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn poll_readable(fd: RawFd, timeout: Duration) {
    let mut pollfd = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    let millis = timeout.as_millis().min(i32::MAX as u128) as i32;
    // SAFETY: one valid pollfd.
    unsafe { libc::poll(&mut pollfd, 1, millis) };
}

#[test]
fn write_then_read_back_across_two_regions() {
    let mut fe = Frontend::start(Options::default());
    let a = pattern(1, 8192);
    let b = pattern(2, 5000);
    let c = pattern(3, 3);
    fe.write_guest(0, 0, &a);
    fe.write_guest(1, 100, &b);
    fe.write_guest(0, 10_000, &c);
    let image_offset = 12_345;
    let write = rw(
        0,
        Opcode::Write,
        image_offset,
        &[data(0, 0, 8192), data(1, 100, 5000), data(0, 10_000, 3)],
    );
    assert_eq!(fe.run_one(write), OK);
    let expected = [a, b, c].concat();
    assert_eq!(fe.image.read(image_offset, expected.len()), expected);

    // Read it back split differently, into other places of both regions.
    let read = rw(
        3,
        Opcode::Read,
        image_offset,
        &[data(1, 300_000, 7000), data(0, 1 << 20, 6195)],
    );
    assert_eq!(fe.run_one(read), OK);
    let mut got = fe.read_guest(1, 300_000, 7000);
    got.extend(fe.read_guest(0, 1 << 20, 6195));
    assert_eq!(got, expected);

    // Several slots in one batch, each to its own place.
    let mut batch = Vec::new();
    for slot in 0..8u32 {
        let bytes = pattern(10 + slot as u8, 4096 + slot as usize);
        fe.write_guest(0, 65536 * u64::from(slot), &bytes);
        batch.push(rw(
            slot,
            Opcode::Write,
            (1 << 20) + 65536 * u64::from(slot),
            &[data(0, 65536 * u64::from(slot), bytes.len() as u32)],
        ));
    }
    let done = fe.run(&batch);
    assert_eq!(done, (0..8).map(|s| (s, OK)).collect::<Vec<_>>());
    for slot in 0..8u32 {
        let expected = pattern(10 + slot as u8, 4096 + slot as usize);
        let image_offset = (1 << 20) + 65536 * u64::from(slot);
        assert_eq!(fe.image.read(image_offset, expected.len()), expected);
    }
    assert!(fe.shutdown().success());
}

#[test]
fn writethrough_write_and_flush() {
    let mut fe = Frontend::start(Options {
        nonblocking_submit_eventfd: false,
        ..Options::default()
    });
    let bytes = pattern(7, 10_000);
    fe.write_guest(1, 0, &bytes);
    let (slot, mut header, segments) = rw(5, Opcode::Write, 4096, &[data(1, 0, 10_000)]);
    header.flags = SLOT_FLAG_SYNC;
    assert_eq!(fe.run_one((slot, header, segments)), OK);
    assert_eq!(fe.image.read(4096, bytes.len()), bytes);
    assert_eq!(fe.run_one(rw(6, Opcode::Flush, 0, &[])), OK);
    // A write and a flush in the same batch.
    let write = rw(1, Opcode::Write, 0, &[data(0, 0, 512)]);
    let done = fe.run(&[write, rw(2, Opcode::Flush, 0, &[])]);
    assert_eq!(done, [(1, OK), (2, OK)]);
    assert!(fe.shutdown().success());
}

fn zeroing_on(dir: PathBuf) {
    let mut fe = Frontend::start(Options {
        image_dir: dir,
        ..Options::default()
    });
    let filler = vec![0xaa; 1 << 20];
    fe.image.write(0, &filler);
    let zeroed: [(u64, u32); 6] = [
        (0, 65536),
        (131_072, 65536),
        (262_144, 65536),
        (400_000, 1000),
        (500_000, 4096),
        (600_001, 333),
    ];
    let requests = vec![
        (
            0,
            header(Opcode::Discard, 0, 0, 1),
            vec![range(zeroed[0].0, zeroed[0].1, 0)],
        ),
        (
            1,
            header(Opcode::WriteZeroes, 0, 0, 1),
            vec![range(zeroed[1].0, zeroed[1].1, 0)],
        ),
        (
            2,
            header(Opcode::WriteZeroes, 0, 0, 1),
            vec![range(zeroed[2].0, zeroed[2].1, RANGE_FLAG_UNMAP)],
        ),
        (
            3,
            header(Opcode::WriteZeroes, 0, 0, 3),
            vec![
                range(zeroed[3].0, zeroed[3].1, 0),
                range(zeroed[4].0, zeroed[4].1, RANGE_FLAG_UNMAP),
                range(zeroed[5].0, zeroed[5].1, 0),
            ],
        ),
    ];
    let done = fe.run(&requests);
    assert_eq!(done, [(0, OK), (1, OK), (2, OK), (3, OK)]);
    let image = fe.image.read(0, 1 << 20);
    let mut expected = filler;
    for (offset, len) in zeroed {
        expected[offset as usize..offset as usize + len as usize].fill(0);
    }
    assert!(
        image == expected,
        "zeroed ranges or their neighbours differ"
    );

    // And through the iothread: the zeroed range reads back as zeros into guest memory.
    fe.write_guest(0, 0, &[0x55; 4096]);
    assert_eq!(
        fe.run_one(rw(4, Opcode::Read, 131_072, &[data(0, 0, 4096)])),
        OK
    );
    assert_eq!(fe.read_guest(0, 0, 4096), vec![0; 4096]);
    assert!(fe.shutdown().success());
}

#[test]
fn discard_and_write_zeroes_read_back_zeros() {
    zeroing_on(std::env::temp_dir());
}

/// tmpfs has no FALLOC_FL_ZERO_RANGE: write zeroes falls back to punching holes.
#[test]
fn discard_and_write_zeroes_on_tmpfs() {
    let shm = PathBuf::from("/dev/shm");
    if !shm.is_dir() {
        eprintln!("skipped: no /dev/shm");
        return;
    }
    zeroing_on(shm);
}

#[test]
fn direct_fd_with_aligned_and_misaligned_buffers() {
    if !temp_dir_supports_direct_io() {
        return;
    }
    let mut fe = Frontend::start(Options {
        direct_block_size: Some(4096),
        ..Options::default()
    });
    let aligned = pattern(21, 65536);
    let misaligned = pattern(22, 1000);
    let mixed = pattern(23, 8192);
    fe.write_guest(0, 0, &aligned);
    fe.write_guest(1, 7, &misaligned);
    fe.write_guest(0, 1 << 20, &mixed[..4096]);
    fe.write_guest(1, 4096, &mixed[4096..]);
    let writes = [
        // Everything 4 KiB aligned: eligible for O_DIRECT.
        rw(0, Opcode::Write, 0, &[data(0, 0, 65536)]),
        // Buffer, length and image offset misaligned: must go buffered.
        rw(1, Opcode::Write, 81_923, &[data(1, 7, 1000)]),
        // Aligned image offset and lengths, but region 1 starts 512 bytes into a page, so the
        // second buffer is not 4 KiB aligned (the empty segment in between is skipped).
        rw(
            2,
            Opcode::Write,
            1 << 20,
            &[data(0, 1 << 20, 4096), data(1, 0, 0), data(1, 4096, 4096)],
        ),
    ];
    assert_eq!(fe.run(&writes), [(0, OK), (1, OK), (2, OK)]);
    assert_eq!(fe.image.read(0, 65536), aligned);
    assert_eq!(fe.image.read(81_923, 1000), misaligned);
    assert_eq!(fe.image.read(1 << 20, 8192), mixed);

    let reads = [
        rw(3, Opcode::Read, 0, &[data(0, 1 << 19, 65536)]),
        rw(4, Opcode::Read, 81_923, &[data(1, 333, 1000)]),
        rw(5, Opcode::Read, 1 << 20, &[data(1, 8192, 8192)]),
    ];
    assert_eq!(fe.run(&reads), [(3, OK), (4, OK), (5, OK)]);
    assert_eq!(fe.read_guest(0, 1 << 19, 65536), aligned);
    assert_eq!(fe.read_guest(1, 333, 1000), misaligned);
    assert_eq!(fe.read_guest(1, 8192, 8192), mixed);
    let (slot, mut header, segments) = rw(6, Opcode::Write, 0, &[data(0, 0, 4096)]);
    header.flags = SLOT_FLAG_SYNC;
    assert_eq!(fe.run_one((slot, header, segments)), OK);
    assert!(fe.shutdown().success());
}

fn temp_dir_supports_direct_io() -> bool {
    let probe = TempImage::new(&std::env::temp_dir());
    let supported = probe.open_direct(true).is_some();
    if !supported {
        eprintln!(
            "skipped: {} does not support O_DIRECT",
            std::env::temp_dir().display()
        );
    }
    supported
}

/// Makes the O_DIRECT decision visible: with a read-only O_DIRECT fd, a write that goes through
/// it fails (EBADF, so IOERR) while one that goes through the buffered fd succeeds.
#[test]
fn only_aligned_transfers_use_the_direct_fd() {
    if !temp_dir_supports_direct_io() {
        return;
    }
    let mut fe = Frontend::start(Options {
        direct_block_size: Some(4096),
        direct_read_only: true,
        ..Options::default()
    });
    let bytes = pattern(30, 8192);
    fe.write_guest(0, 0, &bytes);
    fe.write_guest(1, 0, &bytes);
    let requests = [
        // Aligned everywhere: O_DIRECT, which cannot write.
        rw(0, Opcode::Write, 0, &[data(0, 0, 8192)]),
        // Misaligned image offset.
        rw(1, Opcode::Write, 16_384 + 512, &[data(0, 0, 4096)]),
        // Misaligned length.
        rw(2, Opcode::Write, 32_768, &[data(0, 0, 4095)]),
        // Misaligned buffer (region 1 starts 512 bytes into a page).
        rw(3, Opcode::Write, 49_152, &[data(1, 0, 4096)]),
    ];
    assert_eq!(fe.run(&requests), [(0, IOERR), (1, OK), (2, OK), (3, OK)]);
    // Aligned reads do go through the O_DIRECT fd and work.
    assert_eq!(
        fe.run_one(rw(4, Opcode::Read, 49_152, &[data(0, 65536, 4096)])),
        OK
    );
    assert_eq!(fe.read_guest(0, 65536, 4096), bytes[..4096]);
    assert!(fe.shutdown().success());
}

#[test]
fn a_batch_of_200_requests_completes() {
    let mut fe = Frontend::start(Options {
        slots: 256,
        segments: 4,
        nonblocking_submit_eventfd: false,
        ..Options::default()
    });
    let writes: Vec<Req> = (0..200u32)
        .map(|slot| {
            let bytes = pattern(slot as u8, 4096);
            fe.write_guest(0, 4096 * u64::from(slot), &bytes);
            rw(
                slot,
                Opcode::Write,
                8192 * u64::from(slot),
                &[data(0, 4096 * u64::from(slot), 4096)],
            )
        })
        .collect();
    let done = fe.run(&writes);
    assert_eq!(done, (0..200).map(|s| (s, OK)).collect::<Vec<_>>());
    for slot in 0..200u32 {
        let got = fe.image.read(8192 * u64::from(slot), 4096);
        assert!(got == pattern(slot as u8, 4096), "slot {slot}");
    }
    let reads: Vec<Req> = (0..200u32)
        .map(|slot| {
            let split = 1000 + slot;
            rw(
                slot + 50,
                Opcode::Read,
                8192 * u64::from(slot),
                &[
                    data(1, 4096 * u64::from(slot), split),
                    data(0, (1 << 20) + 4096 * u64::from(slot), 4096 - split),
                ],
            )
        })
        .collect();
    let done = fe.run(&reads);
    assert_eq!(done, (50..250).map(|s| (s, OK)).collect::<Vec<_>>());
    for slot in 0..200u32 {
        let split = 1000 + slot as usize;
        let mut got = fe.read_guest(1, 4096 * u64::from(slot), split);
        got.extend(fe.read_guest(0, (1 << 20) + 4096 * u64::from(slot), 4096 - split));
        assert!(got == pattern(slot as u8, 4096), "slot {slot}");
    }
    assert!(fe.shutdown().success());
}

#[test]
fn requests_longer_than_the_iovec_limit() {
    let segments = 1500u32;
    let mut fe = Frontend::start(Options {
        slots: 2,
        segments,
        ..Options::default()
    });
    let bytes = pattern(9, 512 * segments as usize);
    // Alternate regions so that no two consecutive segments are contiguous.
    let layout: Vec<Segment> = (0..segments)
        .map(|i| data(i % 2, 1024 * u64::from(i / 2), 512))
        .collect();
    for (i, segment) in layout.iter().enumerate() {
        fe.write_guest(segment.aux, segment.offset, &bytes[512 * i..512 * (i + 1)]);
    }
    assert_eq!(fe.run_one(rw(0, Opcode::Write, 4096, &layout)), OK);
    assert!(fe.image.read(4096, bytes.len()) == bytes);
    fe.guest
        .write_all_at(&vec![0; GUEST_SIZE as usize], 0)
        .unwrap();
    assert_eq!(fe.run_one(rw(1, Opcode::Read, 4096, &layout)), OK);
    for (i, segment) in layout.iter().enumerate() {
        let got = fe.read_guest(segment.aux, segment.offset, 512);
        assert!(got == bytes[512 * i..512 * (i + 1)], "segment {i}");
    }
    assert!(fe.shutdown().success());
}

/// Writes a raw `segment_count` into a slot header, as a compromised frontend could (the
/// proto's own `set_header` refuses it).
fn poke_segment_count(fe: &Frontend, slot: u32, count: u32) {
    let layout = fe.ring.layout();
    let offset = layout.slots_offset + u64::from(slot) * layout.slot_stride + 16;
    fe.ring
        .file()
        .write_all_at(&count.to_le_bytes(), offset)
        .unwrap();
}

#[test]
fn bad_slots_complete_with_ioerr_and_valid_ones_still_work() {
    let mut fe = Frontend::start(Options::default());
    let bytes = pattern(5, 4096);
    fe.write_guest(0, 0, &bytes);
    let region_len = REGIONS[0].size;
    let mut unknown_opcode = rw(5, Opcode::Flush, 0, &[]);
    unknown_opcode.1.opcode = 42;
    let requests = vec![
        rw(0, Opcode::Write, 0, &[data(0, 0, 512), data(7, 0, 512)]),
        rw(1, Opcode::Read, 0, &[data(0, region_len - 10, 100)]),
        rw(2, Opcode::Write, IMAGE_SIZE - 100, &[data(0, 0, 512)]),
        rw(3, Opcode::Write, u64::MAX - 10, &[data(0, 0, 512)]),
        rw(4, Opcode::Read, 0, &[data(0, 0, 512)]),
        unknown_opcode,
        (
            6,
            header(Opcode::Discard, 0, 0, 1),
            vec![range(IMAGE_SIZE, 1, 0)],
        ),
        (
            7,
            header(Opcode::WriteZeroes, 0, 0, 1),
            vec![range(u64::MAX, 2, 0)],
        ),
        rw(8, Opcode::Write, 4096, &[data(0, 0, 4096)]),
        rw(9, Opcode::Read, 0, &[data(1, u64::MAX, 1)]),
    ];
    fe.submit(&requests[..4]);
    fe.submit(&requests[5..]);
    // Slot 4's header claims more segments than a slot holds.
    let (slot, header4, segments4) = &requests[4];
    fe.slots.set_header(*slot, *header4).unwrap();
    fe.slots.set_segment(*slot, 0, segments4[0]).unwrap();
    poke_segment_count(&fe, 4, 9);
    fe.sq.push(4).unwrap();
    if fe.sq.publish() {
        fe.kick();
    }
    let mut done: Vec<_> = fe
        .wait(requests.len())
        .into_iter()
        .map(|c| (c.slot, c.status))
        .collect();
    done.sort_unstable();
    let expected: Vec<_> = (0..10)
        .map(|slot| (slot, if slot == 8 { OK } else { IOERR }))
        .collect();
    assert_eq!(done, expected);
    assert_eq!(fe.image.read(4096, 4096), bytes);
    // The image was not touched by the refused write to offset 0.
    assert_eq!(fe.image.read(0, 512), vec![0; 512]);

    // Everything still works afterwards.
    assert_eq!(
        fe.run_one(rw(4, Opcode::Read, 4096, &[data(1, 0, 4096)])),
        OK
    );
    assert_eq!(fe.read_guest(1, 0, 4096), bytes);
    assert!(fe.shutdown().success());
}

#[test]
fn bad_memory_tables_are_refused_and_the_old_one_kept() {
    let mut fe = Frontend::start(Options::default());
    let too_big = [MemoryRegionSpec {
        size: GUEST_SIZE + 4096,
        mmap_offset: 0,
        guest_addr: 0,
    }];
    let beyond = [
        REGIONS[0],
        MemoryRegionSpec {
            size: 4096,
            mmap_offset: GUEST_SIZE - 100,
            guest_addr: 0,
        },
    ];
    let empty = [MemoryRegionSpec {
        size: 0,
        mmap_offset: 0,
        guest_addr: 0,
    }];
    let overflow = [MemoryRegionSpec {
        size: 4096,
        mmap_offset: u64::MAX - 10,
        guest_addr: 0,
    }];
    for table in [&too_big[..], &beyond, &empty, &overflow] {
        match fe.set_memory_table(table) {
            Err(ControlError::Refused(e)) => assert_eq!(e.raw_os_error(), Some(libc::EINVAL)),
            other => panic!("{table:?}: {other:?}"),
        }
    }
    // The two-region table is still in force: region 1 is still usable.
    let bytes = pattern(3, 2048);
    fe.write_guest(1, 4096, &bytes);
    assert_eq!(
        fe.run_one(rw(0, Opcode::Write, 0, &[data(1, 4096, 2048)])),
        OK
    );
    assert_eq!(fe.image.read(0, 2048), bytes);

    // A good table replaces the old one as a whole: only one region now.
    fe.set_memory_table(&REGIONS[..1]).unwrap();
    assert_eq!(
        fe.run_one(rw(1, Opcode::Write, 0, &[data(1, 0, 512)])),
        IOERR
    );
    assert_eq!(fe.run_one(rw(1, Opcode::Write, 0, &[data(0, 0, 512)])), OK);
    assert!(fe.shutdown().success());
}

#[test]
fn shutdown_exits_zero() {
    let fe = Frontend::start(Options::default());
    let status = fe.shutdown();
    assert_eq!(status.code(), Some(0));
}

#[test]
fn closing_the_control_socket_makes_it_exit() {
    let mut fe = Frontend::start(Options::default());
    // Replace our end with a dead socket: the iothread sees EOF.
    let (dead, _) = UnixStream::pair().unwrap();
    drop(std::mem::replace(&mut fe.control, dead));
    assert_eq!(fe.wait_exit().code(), Some(0));
}

#[test]
fn a_slot_number_outside_the_ring_is_fatal() {
    let mut fe = Frontend::start(Options::default());
    assert_eq!(fe.run_one(rw(0, Opcode::Flush, 0, &[])), OK);
    fe.sq.push(1000).unwrap();
    if fe.sq.publish() {
        fe.kick();
    }
    assert_eq!(fe.wait_exit().code(), Some(1));
}

#[test]
fn an_overrun_submission_queue_is_fatal() {
    let mut fe = Frontend::start(Options::default());
    // The producer index is the first word of the submission queue.
    let sq_offset = fe.ring.layout().sq_offset;
    fe.ring
        .file()
        .write_all_at(&1000u32.to_le_bytes(), sq_offset)
        .unwrap();
    fe.kick();
    assert_eq!(fe.wait_exit().code(), Some(1));
}

/// A memfd of zeros, optionally sealed against shrinking like a real ring.
fn garbage_ring(sealed: bool) -> File {
    // SAFETY: NUL-terminated literal name; the result is checked.
    let fd = unsafe {
        libc::memfd_create(
            c"not-a-ring".as_ptr(),
            libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
        )
    };
    assert!(fd >= 0, "memfd_create: {}", io::Error::last_os_error());
    // SAFETY: a fresh fd owned by nobody else.
    let file = unsafe { File::from_raw_fd(fd) };
    file.set_len(1 << 16).unwrap();
    if sealed {
        // SAFETY: plain fcntl on our own fd.
        let rc = unsafe { libc::fcntl(fd, libc::F_ADD_SEALS, libc::F_SEAL_SHRINK) };
        assert_eq!(rc, 0, "{}", io::Error::last_os_error());
    }
    file
}

#[test]
fn a_bad_setup_is_refused() {
    // Unsealed (it could shrink under the mapping), then sealed but without a ring header.
    for sealed in [false, true] {
        let ring = SharedRing::create(4, 4).unwrap();
        let image = TempImage::new(&std::env::temp_dir());
        let mut fe = Frontend::spawn(ring, eventfd(true), eventfd(true), image);
        let not_a_ring = garbage_ring(sealed);
        let fds = [
            not_a_ring.as_raw_fd(),
            fe.submit_eventfd.as_raw_fd(),
            fe.complete_eventfd.as_raw_fd(),
            fe.image.file.as_raw_fd(),
        ];
        let setup = ControlRequest::Setup(SetupSpec {
            flags: 0,
            logical_block_size: 512,
            image_size: 0,
            poll_max_us: 0,
            backing_files: 0,
            qcow2_layers: 0,
        });
        match fe.request(&setup, &fds) {
            Err(ControlError::Refused(e)) => assert_eq!(e.raw_os_error(), Some(libc::EINVAL)),
            other => panic!("sealed {sealed}: {other:?}"),
        }
        assert_eq!(fe.wait_exit().code(), Some(1));
    }
}

/// Sends `setup` to a fresh iothread (with a file image's four fds) and checks it is refused
/// with EINVAL and the iothread exits with status 1.
fn assert_setup_refused(setup: ControlRequest) {
    let ring = SharedRing::create(4, 4).unwrap();
    let image = TempImage::new(&std::env::temp_dir());
    let mut fe = Frontend::spawn(ring, eventfd(true), eventfd(true), image);
    let fds = [
        fe.ring.file().as_raw_fd(),
        fe.submit_eventfd.as_raw_fd(),
        fe.complete_eventfd.as_raw_fd(),
        fe.image.file.as_raw_fd(),
    ];
    match fe.request(&setup, &fds) {
        Err(ControlError::Refused(e)) => assert_eq!(e.raw_os_error(), Some(libc::EINVAL)),
        other => panic!("{other:?}"),
    }
    assert_eq!(fe.wait_exit().code(), Some(1));
}

#[test]
fn unknown_setup_flags_are_refused() {
    assert_setup_refused(ControlRequest::Setup(SetupSpec {
        flags: 0x100,
        logical_block_size: 512,
        image_size: 0,
        poll_max_us: 0,
        backing_files: 0,
        qcow2_layers: 0,
    }));
}

#[test]
fn a_polling_bound_beyond_the_largest_is_refused() {
    assert_setup_refused(ControlRequest::Setup(SetupSpec {
        flags: 0,
        logical_block_size: 512,
        image_size: 0,
        poll_max_us: MAX_POLL_MAX_US + 1,
        backing_files: 0,
        qcow2_layers: 0,
    }));
}

/// With polling on, requests that come one after another (each published while the engine
/// may be polling, kicked only when it announced that it sleeps) are all served, and an idle
/// engine stops polling within its bound: its submission queue shows it asleep.
#[test]
fn a_polling_engine_serves_requests_and_sleeps_when_idle() {
    let mut fe = Frontend::start(Options {
        poll_max_us: MAX_POLL_MAX_US,
        ..Options::default()
    });
    for i in 0..300u32 {
        fe.write_guest(0, 4096 * u64::from(i % 16), &pattern(i as u8, 4096));
        let write = rw(
            i % 16,
            Opcode::Write,
            4096 * u64::from(i),
            &[data(0, 4096 * u64::from(i % 16), 4096)],
        );
        assert_eq!(fe.run_one(write), OK, "write {i}");
    }
    for i in 0..300u32 {
        assert!(
            fe.image.read(4096 * u64::from(i), 4096) == pattern(i as u8, 4096),
            "block {i}"
        );
    }
    // 100 times the bound after the last request.
    std::thread::sleep(Duration::from_millis(100));
    assert!(
        fe.sq.publish(),
        "the engine still polls 100 ms after its last request: its 1 ms bound does not hold"
    );
    // And a kick still wakes it.
    fe.write_guest(0, 0, &pattern(7, 4096));
    let write = rw(0, Opcode::Write, 0, &[data(0, 0, 4096)]);
    assert_eq!(fe.run_one(write), OK);
    assert!(fe.image.read(0, 4096) == pattern(7, 4096));
    assert!(fe.shutdown().success());
}

#[test]
fn exits_when_the_frontend_goes_away_before_setup() {
    let ring = SharedRing::create(4, 4).unwrap();
    let image = TempImage::new(&std::env::temp_dir());
    let mut fe = Frontend::spawn(ring, eventfd(true), eventfd(true), image);
    let (dead, _) = UnixStream::pair().unwrap();
    drop(std::mem::replace(&mut fe.control, dead));
    assert_eq!(fe.wait_exit().code(), Some(0));
}

/// `--image null:SIZE`: requests still go through the ring and the iothread, which zero-fills
/// read buffers in guest memory, drops writes and completes everything else at once.
#[test]
fn null_image_reads_zeros_and_drops_writes() {
    const NULL_SIZE: u64 = 1 << 40;
    let mut fe = Frontend::start(Options {
        null_image: Some(NULL_SIZE),
        ..Options::default()
    });
    let bytes = pattern(40, 8192);
    fe.write_guest(0, 0, &bytes);
    fe.write_guest(1, 4096, &bytes);
    let (slot, mut sync_write, segments) = rw(1, Opcode::Write, 8192, &[data(0, 0, 8192)]);
    sync_write.flags = SLOT_FLAG_SYNC;
    let requests = vec![
        rw(0, Opcode::Write, 0, &[data(0, 0, 8192)]),
        (slot, sync_write, segments),
        rw(2, Opcode::Flush, 0, &[]),
        (
            3,
            header(Opcode::Discard, 0, 0, 1),
            vec![range(0, 1 << 20, 0)],
        ),
        (
            4,
            header(Opcode::WriteZeroes, 0, 0, 2),
            vec![
                range(NULL_SIZE - 4096, 4096, RANGE_FLAG_UNMAP),
                range(0, 512, 0),
            ],
        ),
    ];
    assert_eq!(
        fe.run(&requests),
        (0..5).map(|s| (s, OK)).collect::<Vec<_>>()
    );
    // Writes were dropped: the guest buffers are untouched and no image file was written.
    assert_eq!(fe.read_guest(0, 0, 8192), bytes);
    assert_eq!(fe.image.read(0, 8192), vec![0; 8192]);

    // Reads zero-fill exactly their buffers, across both regions, at the end of the image too.
    let read = rw(
        5,
        Opcode::Read,
        NULL_SIZE - 5000,
        &[data(0, 100, 1000), data(1, 4096 + 10, 4000)],
    );
    assert_eq!(fe.run_one(read), OK);
    let mut region0 = bytes.clone();
    region0[100..1100].fill(0);
    assert_eq!(fe.read_guest(0, 0, 8192), region0);
    let mut region1 = bytes.clone();
    region1[10..4010].fill(0);
    assert_eq!(fe.read_guest(1, 4096, 8192), region1);

    // The size bounds requests like a file's does, and bad slots are refused as usual.
    assert_eq!(
        fe.run_one(rw(6, Opcode::Read, NULL_SIZE - 512, &[data(0, 0, 1024)])),
        IOERR
    );
    assert_eq!(
        fe.run_one(rw(7, Opcode::Read, 0, &[data(5, 0, 512)])),
        IOERR
    );
    assert_eq!(
        fe.read_guest(0, 0, 8192),
        region0,
        "refused reads fill nothing"
    );

    // A batch of every slot completes too.
    let reads: Vec<Req> = (0..16u32)
        .map(|slot| {
            rw(
                slot,
                Opcode::Read,
                4096 * u64::from(slot),
                &[data(1, 4096 * u64::from(slot), 4096)],
            )
        })
        .collect();
    fe.write_guest(1, 0, &vec![0xee; 16 * 4096]);
    assert_eq!(fe.run(&reads), (0..16).map(|s| (s, OK)).collect::<Vec<_>>());
    assert_eq!(fe.read_guest(1, 0, 16 * 4096), vec![0; 16 * 4096]);
    assert!(fe.shutdown().success());
}

/// What a null image's `Setup` must not carry: an O_DIRECT flag or a zero size; and a file
/// image must not carry a size. (A wrong fd count is refused by the proto's own checks.)
#[test]
fn bad_null_image_setups_are_refused() {
    let ring_fds = |fe: &Frontend| {
        vec![
            fe.ring.file().as_raw_fd(),
            fe.submit_eventfd.as_raw_fd(),
            fe.complete_eventfd.as_raw_fd(),
        ]
    };
    let spawn = || {
        let ring = SharedRing::create(4, 4).unwrap();
        let image = TempImage::new(&std::env::temp_dir());
        Frontend::spawn(ring, eventfd(true), eventfd(true), image)
    };
    let cases: [(u32, u64, bool); 3] = [
        // (flags, image_size, send the image fd)
        (SETUP_FLAG_NULL_IMAGE, 0, false),
        (SETUP_FLAG_NULL_IMAGE | SETUP_FLAG_DIRECT_FD, 1 << 20, false),
        (0, 1 << 20, true),
    ];
    for (flags, image_size, with_image_fd) in cases {
        let mut fe = spawn();
        let mut fds = ring_fds(&fe);
        if with_image_fd {
            fds.push(fe.image.file.as_raw_fd());
        }
        let setup = ControlRequest::Setup(SetupSpec {
            flags,
            logical_block_size: 512,
            image_size,
            poll_max_us: 0,
            backing_files: 0,
            qcow2_layers: 0,
        });
        match fe.request(&setup, &fds) {
            Err(ControlError::Refused(e)) => {
                assert_eq!(
                    e.raw_os_error(),
                    Some(libc::EINVAL),
                    "{flags:#x} {image_size}"
                )
            }
            other => panic!("{flags:#x} {image_size} {with_image_fd}: {other:?}"),
        }
        assert_eq!(fe.wait_exit().code(), Some(1));
    }
}
