//! GET_INFLIGHT_FD / SET_INFLIGHT_FD (VHOST_USER_PROTOCOL_F_INFLIGHT_SHMFD) from a hostile VMM:
//! geometry beyond the device, regions smaller than their queues, areas past the end of the
//! file, files that could shrink under the mapping. Each must be refused (an error ack or a
//! closed connection), the frontend must live on and serve a fresh libblkio connection; the
//! well-formed messages are the positive control. (Recovery from a region's contents is
//! unit-tested in proto/src/inflight.rs; the guest test kills a frontend under QEMU.)

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd};

use blkplane_tests::client::check_fresh_connection;
use blkplane_tests::wire::{header, RawConn, Reply, FLAGS_VERSION_1, REPLY_TIMEOUT};
use blkplane_tests::*;
use vhost::vhost_user::message::{FrontendReq, VhostUserProtocolFeatures};

const MIB: u64 = 1 << 20;
/// The frontend's defaults: one queue of at most 256 entries.
const QUEUE_SIZE: u16 = 256;
/// What one queue of 256 entries takes: 16-byte header + 256 × 16, rounded up to 64.
const REGION_256: u64 = 4160;

/// The `VhostUserInflight` body (repr(C): 20 bytes of fields, padded to 24).
fn inflight_body(mmap_size: u64, mmap_offset: u64, num_queues: u16, queue_size: u16) -> Vec<u8> {
    let mut body = Vec::with_capacity(24);
    body.extend_from_slice(&mmap_size.to_ne_bytes());
    body.extend_from_slice(&mmap_offset.to_ne_bytes());
    body.extend_from_slice(&num_queues.to_ne_bytes());
    body.extend_from_slice(&queue_size.to_ne_bytes());
    body.extend_from_slice(&[0; 4]);
    body
}

/// A memfd of `size` bytes, sealed against shrinking like the one GET_INFLIGHT_FD hands out,
/// or not sealed at all.
fn memfd(size: u64, sealed: bool) -> File {
    let flags = libc::MFD_CLOEXEC | if sealed { libc::MFD_ALLOW_SEALING } else { 0 };
    // SAFETY: plain syscall; the fd is owned by the returned File.
    let fd = unsafe { libc::memfd_create(c"bp-test-inflight".as_ptr(), flags) };
    assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
    // SAFETY: fd is a fresh descriptor nobody else owns.
    let f = unsafe { File::from_raw_fd(fd) };
    f.set_len(size).unwrap();
    if sealed {
        // SAFETY: fcntl on a descriptor we own.
        let r = unsafe {
            libc::fcntl(
                f.as_raw_fd(),
                libc::F_ADD_SEALS,
                libc::F_SEAL_SHRINK | libc::F_SEAL_GROW,
            )
        };
        assert_eq!(r, 0, "sealing: {}", std::io::Error::last_os_error());
    }
    f
}

/// The handshake of the other bad-message tests, plus INFLIGHT_SHMFD.
fn connect(fe: &Frontend) -> RawConn {
    let mut c = RawConn::connect(fe.socket());
    let pf = c.handshake() | VhostUserProtocolFeatures::INFLIGHT_SHMFD;
    c.expect_ok(
        "SET_PROTOCOL_FEATURES with INFLIGHT_SHMFD",
        FrontendReq::SET_PROTOCOL_FEATURES as u32,
        &pf.bits().to_ne_bytes(),
        &[],
    );
    c
}

/// GET_INFLIGHT_FD (its reply is a message of its own, not an ack).
fn get_inflight(c: &mut RawConn, num_queues: u16, queue_size: u16) -> Reply {
    let body = inflight_body(0, 0, num_queues, queue_size);
    let mut msg = header(
        FrontendReq::GET_INFLIGHT_FD as u32,
        FLAGS_VERSION_1,
        body.len() as u32,
    );
    msg.extend_from_slice(&body);
    if c.send_bytes(&msg, &[]).is_err() {
        return Reply::Closed;
    }
    c.recv(REPLY_TIMEOUT)
}

/// Runs one case on its own connection, then checks that the frontend lives and serves.
#[track_caller]
fn case(fe: &mut Frontend, name: &str, seed: u64, f: impl FnOnce(&mut RawConn)) {
    let mut c = connect(fe);
    f(&mut c);
    drop(c);
    fe.assert_running(name);
    check_fresh_connection(fe.socket(), 4096 * (seed % 1024), seed);
    println!("ok: {name}; fresh libblkio connection works");
}

#[test]
fn inflight_messages_are_validated() {
    let dir = TempDir::new("inflight");
    let img = create_image(&dir.join("disk.img"), 8 * MIB);
    let mut fe = Frontend::start(&img, &[]);

    case(&mut fe, "GET for more queues than the device has", 1, |c| {
        let reply = get_inflight(c, 2, QUEUE_SIZE);
        assert!(reply.is_rejection(), "GET for 2 queues: {reply:?}");
    });
    case(&mut fe, "GET for rings larger than the device's", 2, |c| {
        let reply = get_inflight(c, 1, 512);
        assert!(reply.is_rejection(), "GET for 512 entries: {reply:?}");
    });
    case(&mut fe, "GET for the whole u16 range", 3, |c| {
        let reply = get_inflight(c, u16::MAX, u16::MAX);
        assert!(reply.is_rejection(), "GET for 65535 × 65535: {reply:?}");
    });
    case(
        &mut fe,
        "GET within the device (positive control)",
        4,
        |c| {
            let reply = get_inflight(c, 1, QUEUE_SIZE);
            let Reply::Message { request, body, .. } = &reply else {
                panic!("GET_INFLIGHT_FD: no reply: {reply:?}");
            };
            assert_eq!(*request, FrontendReq::GET_INFLIGHT_FD as u32);
            assert_eq!(body.len(), 24);
            let mmap_size = u64::from_ne_bytes(body[0..8].try_into().unwrap());
            let mmap_offset = u64::from_ne_bytes(body[8..16].try_into().unwrap());
            assert_eq!((mmap_size, mmap_offset), (REGION_256, 0));
        },
    );

    let set = FrontendReq::SET_INFLIGHT_FD as u32;
    case(&mut fe, "SET with a file that could shrink", 5, |c| {
        let f = memfd(REGION_256, false);
        let body = inflight_body(REGION_256, 0, 1, QUEUE_SIZE);
        c.expect_rejected("unsealed memfd", set, &body, &[f.as_raw_fd()]);
    });
    case(
        &mut fe,
        "SET with mmap_size smaller than its queues",
        6,
        |c| {
            let f = memfd(REGION_256, true);
            let body = inflight_body(REGION_256 - 64, 0, 1, QUEUE_SIZE);
            c.expect_rejected("mmap_size too small", set, &body, &[f.as_raw_fd()]);
        },
    );
    case(
        &mut fe,
        "SET with an area past the end of the file",
        7,
        |c| {
            let f = memfd(REGION_256, true);
            let body = inflight_body(REGION_256, 4096, 1, QUEUE_SIZE);
            c.expect_rejected("offset past the end", set, &body, &[f.as_raw_fd()]);
            let body = inflight_body(u64::MAX, 0, 1, QUEUE_SIZE);
            c.expect_rejected("mmap_size past the end", set, &body, &[f.as_raw_fd()]);
        },
    );
    case(&mut fe, "SET with an unaligned offset", 8, |c| {
        let f = memfd(2 * REGION_256, true);
        let body = inflight_body(REGION_256, 64, 1, QUEUE_SIZE);
        c.expect_rejected("unaligned offset", set, &body, &[f.as_raw_fd()]);
    });
    case(&mut fe, "SET with a geometry beyond the device", 9, |c| {
        let f = memfd(64 * MIB, true);
        let body = inflight_body(64 * MIB, 0, 300, QUEUE_SIZE);
        c.expect_rejected("300 queues", set, &body, &[f.as_raw_fd()]);
        let body = inflight_body(64 * MIB, 0, 1, 4096);
        c.expect_rejected("4096 entries", set, &body, &[f.as_raw_fd()]);
    });
    case(&mut fe, "SET without a descriptor", 10, |c| {
        let body = inflight_body(REGION_256, 0, 1, QUEUE_SIZE);
        c.expect_rejected("no fd", set, &body, &[]);
    });
    case(
        &mut fe,
        "SET of a sealed region (positive control)",
        11,
        |c| {
            let f = memfd(REGION_256, true);
            let body = inflight_body(REGION_256, 0, 1, QUEUE_SIZE);
            c.expect_ok("sealed region", set, &body, &[f.as_raw_fd()]);
        },
    );
    fe.finish();
}
