//! vhost-user message handling over a byte stream from a hostile VMM, with descriptors.
//!
//! One device (`BlkBackend`, a real worker and its `blkplane-iothread` process on a null
//! image) lives across runs, as a frontend outlives its connections. Each run is a
//! connection: the messages are written to one end of a socket pair, their descriptors
//! attached, and the other end is served by `session::serve`, what the accept loop of
//! `frontend/src/main.rs` runs for each connection — `BackendReqHandler::from_stream`, then
//! per message the header peek of the back-end channel, `handle_request`, and the REPLY_ACK
//! refusal check — until the stream ends or a message ends the session, then
//! `BlkBackend::disconnect` as on a VMM disconnect.
//!
//! The iothread binary is `$BLKPLANE_IOTHREAD`, by default the workspace's
//! `target/debug/blkplane-iothread` (`fuzz/run.sh` builds it).
//!
//! Input format: `blkplane_fuzz::vhost`.

#![no_main]

use std::fs::File;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};

use blkplane_frontend::backend_channel::BackendChannel;
use blkplane_frontend::config::{CacheMode, DiskConfig};
use blkplane_frontend::image::{Image, ImageSpec};
use blkplane_frontend::iothread::IothreadLink;
use blkplane_frontend::session;
use blkplane_frontend::spawner::Spawner;
use blkplane_frontend::stats::DeviceStatus;
use blkplane_frontend::vhost_user::BlkBackend;
use blkplane_frontend::worker::{WorkerHandle, Workers};
use blkplane_fuzz::vhost::{self, FdKind};
use libfuzzer_sys::fuzz_target;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};
use vmm_sys_util::sock_ctrl_msg::ScmSocket;

struct Device {
    backend: Arc<Mutex<BlkBackend>>,
    channel: Arc<BackendChannel>,
}

static DEVICE: OnceLock<Device> = OnceLock::new();

/// main.rs's `run`, for a 2-queue null disk of 1 MiB with one iothread.
fn device() -> Device {
    let binary = std::env::var_os("BLKPLANE_IOTHREAD")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/debug/blkplane-iothread")
        });
    assert!(
        binary.exists(),
        "{} not found: build it (cargo build -p blkplane-iothread) or set BLKPLANE_IOTHREAD",
        binary.display()
    );
    let spec = ImageSpec::parse("null:1M".into()).expect("image spec");
    let image = Arc::new(Image::open(&spec, false, CacheMode::Writeback, None).expect("image"));
    let disk = Arc::new(DiskConfig::new(
        image.size(),
        false,
        "fuzz",
        vhost::NUM_QUEUES,
        vhost::QUEUE_SIZE,
        512,
        CacheMode::Writeback,
    ));
    let status = Arc::new(DeviceStatus::new(vhost::NUM_QUEUES, 1));
    let channel = Arc::new(BackendChannel::default());
    // Forked here, in libFuzzer's initialization, while the process has one thread.
    let spawner = Arc::new(Spawner::start(&binary, &[], None).expect("iothread spawner"));
    let link = IothreadLink::new(
        0,
        spawner,
        Arc::clone(&image),
        disk.block_size,
        u32::from(vhost::NUM_QUEUES) * u32::from(vhost::QUEUE_SIZE),
        disk.segments_per_slot(),
    )
    .expect("iothread link");
    let worker = WorkerHandle::spawn(
        0,
        Arc::clone(&disk),
        Arc::clone(&status),
        link,
        (0..vhost::NUM_QUEUES).collect(),
    )
    .expect("worker");
    let backend = Arc::new(Mutex::new(BlkBackend::new(
        disk,
        status,
        Arc::clone(&channel),
        image,
        Workers::new(vec![worker]),
    )));
    Device { backend, channel }
}

fuzz_target!(init: {
    // The iothread logs every memory table at info level: thousands of lines a second.
    if std::env::var_os("RUST_LOG").is_none() {
        std::env::set_var("RUST_LOG", "error");
    }
    DEVICE.get_or_init(device);
}, |data: &[u8]| {
    if let Some(device) = DEVICE.get() {
        session(device, data);
    }
});

/// A descriptor the harness made for a message, and the peer end it keeps for a socket.
fn make_fd(kind: FdKind) -> (OwnedFd, Option<UnixStream>) {
    match kind {
        FdKind::EventFd => {
            let fd = EventFd::new(EFD_NONBLOCK).expect("eventfd");
            // SAFETY: a fresh duplicate owned by nobody else.
            let dup = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 0) };
            assert!(dup >= 0, "dup eventfd");
            // SAFETY: `dup` was just created and is owned by nobody else.
            (unsafe { std::os::fd::FromRawFd::from_raw_fd(dup) }, None)
        }
        FdKind::GuestMemory => (memfd(vhost::GUEST_MEMORY), None),
        FdKind::Sealed => (
            OwnedFd::from(
                blkplane_proto::shm::sealed_memfd(c"fuzz-sealed", vhost::SEALED).expect("memfd"),
            ),
            None,
        ),
        FdKind::Small => (memfd(vhost::SMALL), None),
        FdKind::Socket => {
            let (ours, theirs) = UnixStream::pair().expect("socketpair");
            (OwnedFd::from(theirs), Some(ours))
        }
    }
}

fn memfd(len: u64) -> OwnedFd {
    OwnedFd::from(blkplane_fuzz::memfd(c"fuzz-vmm", len).expect("memfd"))
}

fn session(device: &Device, data: &[u8]) {
    let messages = vhost::decode(data);
    let (vmm, ours) = UnixStream::pair().expect("socketpair");
    // The VMM side: every message written up front (they fit the socket buffer; replies
    // wait in ours), then EOF.
    let mut keep: Vec<File> = Vec::new();
    let mut peers: Vec<UnixStream> = Vec::new();
    for message in &messages {
        let mut fds: Vec<OwnedFd> = Vec::new();
        for &kind in &message.fds {
            let (fd, peer) = make_fd(kind);
            fds.push(fd);
            peers.extend(peer);
        }
        let raw: Vec<RawFd> = fds.iter().map(AsRawFd::as_raw_fd).collect();
        let sent = if raw.is_empty() {
            std::io::Write::write_all(&mut &vmm, message.bytes).is_ok()
        } else if message.bytes.is_empty() {
            // Descriptors need a byte to travel with; a message without one loses them.
            true
        } else {
            match vmm.send_with_fds(&[message.bytes], &raw) {
                Ok(n) => std::io::Write::write_all(&mut &vmm, &message.bytes[n..]).is_ok(),
                Err(_) => false,
            }
        };
        // The VMM keeps its descriptors (guest memory) for the session.
        keep.extend(fds.into_iter().map(File::from));
        if !sent {
            break;
        }
    }
    let _ = vmm.shutdown(std::net::Shutdown::Write);

    // What main.rs's accept loop runs for this one connection.
    session::serve(ours, &device.backend, &device.channel);
    drop(keep);
    drop(peers);
}
