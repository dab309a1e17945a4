//! Malformed vhost-user messages written byte by byte. Each must get an error reply (REPLY_ACK
//! with a non-zero value) or a closed connection, never a crash; afterwards a fresh libblkio
//! connection must work, and the frontend must not leak the descriptors it was sent.

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::time::Duration;

use blkplane_tests::client::check_fresh_connection;
use blkplane_tests::raw::RawDevice;
use blkplane_tests::wire::{
    header, mem_table_body, single_region_body, vring_state_body, Body, RawConn, Region, Reply,
    FLAGS_VERSION_1, REPLY_TIMEOUT,
};
use blkplane_tests::*;
use vhost::vhost_user::message::{FrontendReq, VhostUserHeaderFlag};
use vhost::vhost_user::VhostUserFrontend;
use vhost::VhostBackend;
use vmm_sys_util::eventfd::EventFd;

const MIB: u64 = 1 << 20;

fn start(tag: &str) -> (TempDir, Frontend) {
    let dir = TempDir::new(tag);
    let img = create_image(&dir.join("disk.img"), 8 * MIB);
    let fe = Frontend::start(&img, &[]);
    (dir, fe)
}

fn memfd(size: u64) -> File {
    // SAFETY: plain syscall; the fd is owned by the returned File.
    let fd = unsafe { libc::memfd_create(c"bp-test-region".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
    // SAFETY: fd is a fresh descriptor nobody else owns.
    let f = unsafe { File::from_raw_fd(fd) };
    f.set_len(size).unwrap();
    f
}

fn eventfd() -> EventFd {
    EventFd::new(0).unwrap()
}

fn region(gpa: u64, size: u64, mmap_offset: u64) -> Region {
    Region {
        gpa,
        size,
        // Only ring addresses are translated through user_addr; any value unique per gpa
        // will do (kept small so that a huge gpa does not also overflow user_addr).
        user_addr: 0x7000_0000_0000 + gpa % (1 << 40),
        mmap_offset,
    }
}

const REQ_NEED_REPLY: u32 = FLAGS_VERSION_1 | VhostUserHeaderFlag::NEED_REPLY.bits();

fn req(r: FrontendReq) -> u32 {
    r as u32
}

/// One bad-message case on its own connection (after a proper handshake), followed by the
/// checks that the frontend lives and serves a fresh libblkio connection.
#[track_caller]
fn case(fe: &mut Frontend, name: &str, seed: u64, f: impl FnOnce(&mut RawConn) -> Reply) {
    let mut c = RawConn::connect(fe.socket());
    c.handshake();
    let reply = f(&mut c);
    drop(c);
    fe.assert_running(name);
    check_fresh_connection(fe.socket(), 4096 * (seed % 1024), seed);
    let how = match reply {
        Reply::Closed => "connection closed".to_string(),
        r => format!("error reply {:?}", r.u64_body()),
    };
    println!("ok: {name}: {how}; fresh libblkio connection works");
}

#[test]
fn unknown_request_codes_and_bad_headers() {
    let (_dir, mut fe) = start("codes");
    // Positive control: the same path with a valid message is acknowledged with 0, so the
    // rejections below are not an artefact of the harness.
    let mut c = RawConn::connect(fe.socket());
    c.handshake();
    c.expect_ok(
        "SET_VRING_NUM(0, 256)",
        req(FrontendReq::SET_VRING_NUM),
        &vring_state_body(0, 256),
        &[],
    );
    drop(c);
    println!("ok: positive control: a valid SET_VRING_NUM is acked with 0");

    for code in [0u32, 45, 99, 0xdead, u32::MAX] {
        case(&mut fe, &format!("request code {code:#x}"), 1, |c| {
            c.expect_rejected("unknown code", code, &Body::new().u64(0).0, &[])
        });
    }
    case(&mut fe, "header with version 0", 2, |c| {
        c.send_bytes(&header(req(FrontendReq::GET_FEATURES), 0, 0), &[])
            .unwrap();
        c.expect_rejection("version 0")
    });
    case(&mut fe, "header with version 2", 3, |c| {
        c.send_bytes(&header(req(FrontendReq::GET_FEATURES), 2, 0), &[])
            .unwrap();
        c.expect_rejection("version 2")
    });
    case(&mut fe, "header with reserved flag bits", 4, |c| {
        c.send_bytes(
            &header(req(FrontendReq::SET_OWNER), REQ_NEED_REPLY | 0x100, 0),
            &[],
        )
        .unwrap();
        c.expect_rejection("reserved flags")
    });
    fe.finish();
}

/// Sends GET_CONFIG with `body` and asserts it is refused. GET_CONFIG has no ack: a refusal is
/// a closed connection or a reply whose config size is 0 (what the `vhost` crate sends when the
/// back-end's handler fails).
#[track_caller]
fn config_rejected(c: &mut RawConn, what: &str, body: &[u8]) -> Reply {
    c.send(req(FrontendReq::GET_CONFIG), body, &[]).unwrap();
    let reply = c.recv(REPLY_TIMEOUT);
    match &reply {
        Reply::Closed => {}
        Reply::Message { body, .. }
            if body.len() >= 12 && u32::from_ne_bytes(body[4..8].try_into().unwrap()) == 0 => {}
        other => panic!("{what}: expected a refusal, got {other:?}"),
    }
    reply
}

#[test]
fn size_field_disagrees_with_body() {
    let (_dir, mut fe) = start("size");
    let set_features = req(FrontendReq::SET_FEATURES);
    case(&mut fe, "SET_FEATURES with a 4-byte body", 1, |c| {
        c.expect_rejected("short body", set_features, &[0; 4], &[])
    });
    case(&mut fe, "SET_FEATURES with a 16-byte body", 2, |c| {
        c.expect_rejected("long body", set_features, &[0; 16], &[])
    });
    case(&mut fe, "GET_FEATURES with an 8-byte body", 3, |c| {
        c.expect_rejected(
            "body on a query",
            req(FrontendReq::GET_FEATURES),
            &[0; 8],
            &[],
        )
    });
    case(&mut fe, "SET_VRING_NUM with a 4-byte body", 4, |c| {
        c.expect_rejected(
            "short vring state",
            req(FrontendReq::SET_VRING_NUM),
            &[0; 4],
            &[],
        )
    });
    case(
        &mut fe,
        "SET_MEM_TABLE claiming 2 regions, carrying 1",
        5,
        |c| {
            let m = memfd(MIB);
            let body = mem_table_body(2, &[region(0, MIB, 0)]);
            c.expect_rejected(
                "region count",
                req(FrontendReq::SET_MEM_TABLE),
                &body,
                &[m.as_raw_fd()],
            )
        },
    );
    case(
        &mut fe,
        "SET_MEM_TABLE with the region list cut off",
        6,
        |c| {
            let m = memfd(MIB);
            let mut body = mem_table_body(1, &[region(0, MIB, 0)]);
            body.truncate(20);
            c.expect_rejected(
                "truncated regions",
                req(FrontendReq::SET_MEM_TABLE),
                &body,
                &[m.as_raw_fd()],
            )
        },
    );
    case(
        &mut fe,
        "GET_CONFIG whose size exceeds its payload",
        7,
        |c| {
            let body = Body::new().u32(0).u32(60).u32(0).0; // offset, size, flags, no payload
            config_rejected(c, "config size", &body)
        },
    );
    case(&mut fe, "GET_CONFIG beyond the config space", 8, |c| {
        let mut body = Body::new().u32(u32::MAX - 10).u32(60).u32(0).0;
        body.extend_from_slice(&[0; 60]);
        config_rejected(c, "config offset", &body)
    });
    case(&mut fe, "size 64 but 8 bytes then EOF", 9, |c| {
        let mut msg = header(set_features, REQ_NEED_REPLY, 64);
        msg.extend_from_slice(&[0; 8]);
        c.send_bytes(&msg, &[]).unwrap();
        c.shutdown_write();
        let r = c.recv(REPLY_TIMEOUT);
        assert_eq!(
            r,
            Reply::Closed,
            "a truncated message must end the connection"
        );
        r
    });
    case(&mut fe, "size 0x10000000 (beyond any message)", 10, |c| {
        c.send_bytes(&header(set_features, REQ_NEED_REPLY, 0x1000_0000), &[])
            .unwrap();
        c.shutdown_write();
        c.expect_rejection("huge size")
    });
    case(&mut fe, "6-byte header then EOF", 11, |c| {
        c.send_bytes(&header(set_features, REQ_NEED_REPLY, 8)[..6], &[])
            .unwrap();
        c.shutdown_write();
        let r = c.recv(REPLY_TIMEOUT);
        assert_eq!(
            r,
            Reply::Closed,
            "a truncated header must end the connection"
        );
        r
    });
    fe.finish();
}

#[test]
fn set_vring_num_out_of_range() {
    let (_dir, mut fe) = start("vringnum");
    let num = req(FrontendReq::SET_VRING_NUM);
    for (i, (index, size)) in [
        (5u32, 256u32),
        (0xffff_ffff, 256),
        (0, 0),
        (0, 3),
        (0, 65536),
    ]
    .into_iter()
    .enumerate()
    {
        case(
            &mut fe,
            &format!("SET_VRING_NUM(index {index:#x}, size {size})"),
            i as u64,
            |c| c.expect_rejected("vring num", num, &vring_state_body(index, size), &[]),
        );
    }
    // Other per-ring messages with a queue index the device does not have.
    case(&mut fe, "SET_VRING_BASE(index 5)", 10, |c| {
        c.expect_rejected(
            "vring base",
            req(FrontendReq::SET_VRING_BASE),
            &vring_state_body(5, 0),
            &[],
        )
    });
    case(&mut fe, "SET_VRING_ENABLE(index 5)", 11, |c| {
        c.expect_rejected(
            "vring enable",
            req(FrontendReq::SET_VRING_ENABLE),
            &vring_state_body(5, 1),
            &[],
        )
    });
    case(&mut fe, "SET_VRING_ADDR(index 5)", 12, |c| {
        let body = Body::new().u32(5).u32(0).u64(0).u64(0).u64(0).u64(0).0;
        c.expect_rejected("vring addr", req(FrontendReq::SET_VRING_ADDR), &body, &[])
    });
    case(&mut fe, "SET_VRING_KICK(index 5)", 13, |c| {
        let e = eventfd();
        c.expect_rejected(
            "vring kick",
            req(FrontendReq::SET_VRING_KICK),
            &Body::new().u64(5).0,
            &[e.as_raw_fd()],
        )
    });
    case(&mut fe, "GET_VRING_BASE(index 5)", 14, |c| {
        c.send(
            req(FrontendReq::GET_VRING_BASE),
            &vring_state_body(5, 0),
            &[],
        )
        .unwrap();
        c.expect_rejection("get vring base")
    });
    fe.finish();
}

#[test]
fn set_mem_table_bad_regions() {
    let (_dir, mut fe) = start("memtable");
    let table = req(FrontendReq::SET_MEM_TABLE);
    // Positive control.
    let mut c = RawConn::connect(fe.socket());
    c.handshake();
    let m = memfd(MIB);
    c.expect_ok(
        "valid SET_MEM_TABLE",
        table,
        &mem_table_body(1, &[region(0, MIB, 0)]),
        &[m.as_raw_fd()],
    );
    drop(c);
    println!("ok: positive control: a valid SET_MEM_TABLE is acked with 0");

    type Case = (&'static str, Vec<Region>, Vec<u64>);
    let cases: Vec<Case> = vec![
        ("region of size 0", vec![region(0, 0, 0)], vec![MIB]),
        (
            "two overlapping regions",
            vec![region(0, MIB, 0), region(MIB / 2, MIB, 0)],
            vec![MIB, MIB],
        ),
        (
            "two regions at the same address",
            vec![region(0, MIB, 0), region(0, MIB, 0)],
            vec![MIB, MIB],
        ),
        (
            "region larger than its memfd",
            vec![region(0, 2 * MIB, 0)],
            vec![MIB],
        ),
        (
            "mmap_offset + size beyond the memfd",
            vec![region(0, MIB, MIB / 2)],
            vec![MIB],
        ),
        (
            "mmap_offset at the end of the memfd",
            vec![region(0, MIB, MIB)],
            vec![MIB],
        ),
        (
            "mmap_offset + size overflowing u64",
            vec![region(0, 8192, u64::MAX - 4095)],
            vec![MIB],
        ),
        (
            "guest address + size overflowing u64",
            vec![region(u64::MAX - 4095, MIB, 0)],
            vec![MIB],
        ),
    ];
    for (i, (name, regions, sizes)) in cases.iter().enumerate() {
        case(&mut fe, name, 10 + i as u64, |c| {
            let files: Vec<File> = sizes.iter().map(|&s| memfd(s)).collect();
            let fds: Vec<RawFd> = files.iter().map(|f| f.as_raw_fd()).collect();
            c.expect_rejected(
                name,
                table,
                &mem_table_body(regions.len() as u32, regions),
                &fds,
            )
        });
    }
    case(&mut fe, "SET_MEM_TABLE with 0 regions", 30, |c| {
        c.expect_rejected("no regions", table, &mem_table_body(0, &[]), &[])
    });
    case(&mut fe, "one region, no fd", 31, |c| {
        c.expect_rejected(
            "no fd",
            table,
            &mem_table_body(1, &[region(0, MIB, 0)]),
            &[],
        )
    });
    case(&mut fe, "one region, two fds", 32, |c| {
        let (a, b) = (memfd(MIB), memfd(MIB));
        c.expect_rejected(
            "extra fd",
            table,
            &mem_table_body(1, &[region(0, MIB, 0)]),
            &[a.as_raw_fd(), b.as_raw_fd()],
        )
    });
    case(&mut fe, "region backed by an eventfd", 33, |c| {
        let e = eventfd();
        c.expect_rejected(
            "eventfd region",
            table,
            &mem_table_body(1, &[region(0, MIB, 0)]),
            &[e.as_raw_fd()],
        )
    });
    case(
        &mut fe,
        "33 regions (more than the advertised slots)",
        34,
        |c| {
            let files: Vec<File> = (0..33).map(|_| memfd(64 * 1024)).collect();
            let regions: Vec<Region> = (0..33).map(|i| region(i * MIB, 64 * 1024, 0)).collect();
            let fds: Vec<RawFd> = files.iter().map(|f| f.as_raw_fd()).collect();
            c.expect_rejected("33 regions", table, &mem_table_body(33, &regions), &fds)
        },
    );

    // The same rules through ADD_MEM_REG (CONFIGURE_MEM_SLOTS).
    let add = req(FrontendReq::ADD_MEM_REG);
    case(&mut fe, "ADD_MEM_REG of size 0", 40, |c| {
        let m = memfd(MIB);
        c.expect_rejected(
            "size 0",
            add,
            &single_region_body(&region(0, 0, 0)),
            &[m.as_raw_fd()],
        )
    });
    case(&mut fe, "ADD_MEM_REG larger than its memfd", 41, |c| {
        let m = memfd(MIB);
        c.expect_rejected(
            "beyond fd",
            add,
            &single_region_body(&region(0, 4 * MIB, 0)),
            &[m.as_raw_fd()],
        )
    });
    case(
        &mut fe,
        "ADD_MEM_REG overlapping an existing region",
        42,
        |c| {
            let (a, b) = (memfd(MIB), memfd(MIB));
            c.expect_ok(
                "first region",
                add,
                &single_region_body(&region(0, MIB, 0)),
                &[a.as_raw_fd()],
            );
            c.expect_rejected(
                "overlap",
                add,
                &single_region_body(&region(MIB / 2, MIB, 0)),
                &[b.as_raw_fd()],
            )
        },
    );
    case(&mut fe, "ADD_MEM_REG without an fd", 43, |c| {
        c.expect_rejected("no fd", add, &single_region_body(&region(0, MIB, 0)), &[])
    });
    fe.finish();
}

#[test]
fn fds_where_none_belong() {
    let (_dir, mut fe) = start("strayfd");
    let cases: [(&str, FrontendReq, Vec<u8>, usize); 5] = [
        (
            "GET_FEATURES with an fd",
            FrontendReq::GET_FEATURES,
            vec![],
            1,
        ),
        (
            "GET_QUEUE_NUM with two fds",
            FrontendReq::GET_QUEUE_NUM,
            vec![],
            2,
        ),
        ("SET_OWNER with an fd", FrontendReq::SET_OWNER, vec![], 1),
        (
            "SET_FEATURES with an fd",
            FrontendReq::SET_FEATURES,
            Body::new().u64(0).0,
            1,
        ),
        (
            "SET_VRING_NUM with an fd",
            FrontendReq::SET_VRING_NUM,
            vring_state_body(0, 256),
            1,
        ),
    ];
    for (i, (name, code, body, nfds)) in cases.iter().enumerate() {
        case(&mut fe, name, i as u64, |c| {
            let fds: Vec<EventFd> = (0..*nfds).map(|_| eventfd()).collect();
            let raw: Vec<RawFd> = fds.iter().map(|f| f.as_raw_fd()).collect();
            c.expect_rejected(name, *code as u32, body, &raw)
        });
    }
    fe.finish();
}

/// (name, desc, avail, used) as offsets from the region's VMM address; the region is 1 MiB
/// and the ring has 256 entries (4 KiB of descriptors, 518 B avail, 2054 B used).
const RINGS_OUTSIDE: [(&str, u64, u64, u64); 4] = [
    (
        "rings far outside guest memory",
        0x1_0000_0000,
        0x1_0001_0000,
        0x1_0002_0000,
    ),
    (
        "descriptor table straddling the end",
        MIB - 16,
        0x1000,
        0x2000,
    ),
    ("avail ring straddling the end", 0, MIB - 8, 0x2000),
    ("used ring straddling the end", 0, 0x1000, MIB - 8),
];

#[test]
fn ring_outside_guest_memory() {
    let (_dir, mut fe) = start("ringaddr");
    for (i, (name, desc, avail, used)) in RINGS_OUTSIDE.iter().enumerate() {
        case(&mut fe, name, 20 + i as u64, |c| {
            let m = memfd(MIB);
            let r = region(0, MIB, 0);
            let (kick, call) = (eventfd(), eventfd());
            let setup: Vec<(FrontendReq, Vec<u8>, Vec<RawFd>)> = vec![
                (
                    FrontendReq::SET_MEM_TABLE,
                    mem_table_body(1, &[r]),
                    vec![m.as_raw_fd()],
                ),
                (FrontendReq::SET_VRING_NUM, vring_state_body(0, 256), vec![]),
                (
                    FrontendReq::SET_VRING_ADDR,
                    Body::new()
                        .u32(0)
                        .u32(0)
                        .u64(r.user_addr + desc)
                        .u64(r.user_addr + used)
                        .u64(r.user_addr + avail)
                        .u64(0)
                        .0,
                    vec![],
                ),
                (FrontendReq::SET_VRING_BASE, vring_state_body(0, 0), vec![]),
                (
                    FrontendReq::SET_VRING_CALL,
                    Body::new().u64(0).0,
                    vec![call.as_raw_fd()],
                ),
                (
                    FrontendReq::SET_VRING_KICK,
                    Body::new().u64(0).0,
                    vec![kick.as_raw_fd()],
                ),
                (
                    FrontendReq::SET_VRING_ENABLE,
                    vring_state_body(0, 1),
                    vec![],
                ),
            ];
            // The device may refuse at any step, at the latest when the ring would start.
            for (code, body, fds) in &setup {
                c.send(*code as u32, body, fds).unwrap();
                let reply = c.recv(REPLY_TIMEOUT);
                if reply.is_rejection() {
                    println!("  refused at {code:?}");
                    return reply;
                }
                assert_eq!(reply.u64_body(), Some(0), "{code:?}: {reply:?}");
            }
            panic!("{name}: the device started a ring that is not inside guest memory");
        });
    }
    fe.finish();
}

/// The fd count once it has stopped changing (the frontend may still be tearing down the
/// previous connection).
fn settled_fd_count(fe: &Frontend) -> usize {
    let mut last = fe.fd_count();
    for _ in 0..50 {
        std::thread::sleep(Duration::from_millis(50));
        let now = fe.fd_count();
        if now == last {
            return now;
        }
        last = now;
    }
    last
}

#[test]
fn no_fd_leaks_after_bad_connections() {
    const SLACK: usize = 3;
    const ROUNDS: usize = 8;
    let (_dir, mut fe) = start("fdleak");
    // Warm up every lazily created resource with one good and one bad connection first.
    check_fresh_connection(fe.socket(), 0, 1);
    {
        let mut c = RawConn::connect(fe.socket());
        c.handshake();
        c.expect_rejected("warm-up", 0xdead, &[], &[]);
    }
    let before = settled_fd_count(&fe);
    let targets_before = fe.fd_targets();
    let table = req(FrontendReq::SET_MEM_TABLE);
    for round in 0..ROUNDS {
        // A refused table carrying two memfds.
        let mut c = RawConn::connect(fe.socket());
        c.handshake();
        let (a, b) = (memfd(MIB), memfd(MIB));
        c.expect_rejected(
            "overlap",
            table,
            &mem_table_body(2, &[region(0, MIB, 0), region(0, MIB, 0)]),
            &[a.as_raw_fd(), b.as_raw_fd()],
        );
        drop(c);
        // An fd on a message that takes none.
        let mut c = RawConn::connect(fe.socket());
        c.handshake();
        let e = eventfd();
        c.expect_rejected(
            "stray fd",
            req(FrontendReq::GET_FEATURES),
            &[],
            &[e.as_raw_fd()],
        );
        drop(c);
        // An accepted table and ring eventfds, replaced several times, then a disconnect
        // without any teardown.
        let mut c = RawConn::connect(fe.socket());
        c.handshake();
        let m = memfd(MIB);
        c.expect_ok(
            "table",
            table,
            &mem_table_body(1, &[region(0, MIB, 0)]),
            &[m.as_raw_fd()],
        );
        let m2 = memfd(2 * MIB);
        c.expect_ok(
            "replacement table",
            table,
            &mem_table_body(1, &[region(0, 2 * MIB, 0)]),
            &[m2.as_raw_fd()],
        );
        for code in [FrontendReq::SET_VRING_CALL, FrontendReq::SET_VRING_ERR] {
            for _ in 0..3 {
                let e = eventfd();
                c.expect_ok(
                    "vring fd",
                    code as u32,
                    &Body::new().u64(0).0,
                    &[e.as_raw_fd()],
                );
            }
        }
        drop(c);
        // A message cut off in the middle.
        let mut c = RawConn::connect(fe.socket());
        c.handshake();
        let m = memfd(MIB);
        let mut msg = header(table, REQ_NEED_REPLY, 40);
        msg.extend_from_slice(&[1, 0, 0, 0]);
        c.send_bytes(&msg, &[m.as_raw_fd()]).unwrap();
        drop(c);
        fe.assert_running(&format!("bad connection round {round}"));
    }
    check_fresh_connection(fe.socket(), 0, 2);
    let after = wait_for(Duration::from_secs(10), || {
        let n = settled_fd_count(&fe);
        (n <= before + SLACK).then_some(n)
    });
    match after {
        Some(n) => println!(
            "fds: {before} before, {n} after {ROUNDS} rounds of 4 bad connections (slack {SLACK})"
        ),
        None => panic!(
            "the frontend leaks fds: {before} before, {} after {ROUNDS} rounds of bad \
             connections.\nbefore: {targets_before:#?}\nafter: {:#?}",
            fe.fd_count(),
            fe.fd_targets()
        ),
    }
    fe.finish();
}

/// A broken ring signals its error eventfd, also after the driver reset the device: QEMU
/// sends SET_VRING_ERR once per connection, then RESET_DEVICE and a new ring set-up (without
/// it) whenever the guest driver resets the device.
#[test]
fn a_broken_ring_signals_its_error_eventfd_also_after_a_reset() {
    let (_dir, fe) = start("vring-err");
    let mut dev = RawDevice::connect(fe.socket(), 1, 256).expect("raw connect");
    let err = EventFd::new(libc::EFD_NONBLOCK).unwrap();
    dev.fe.set_vring_err(0, &err).unwrap();
    dev.fe.reset_device().expect("RESET_DEVICE");
    dev.restart_queue(0).unwrap();
    // An avail index more than a ring ahead of the used index breaks the ring.
    dev.publish_avail_index(0, 300);
    let signalled = wait_for(Duration::from_secs(10), || err.read().ok());
    assert!(
        signalled.is_some(),
        "the broken ring did not signal its error eventfd"
    );
    drop(dev);
    check_fresh_connection(fe.socket(), 0, 3);
    fe.finish();
}

/// Sends `request` and asserts the refusal is an error status for this very message (not a
/// closed connection, not a failure later): with REPLY_ACK the session then goes on, which a
/// round trip shows.
#[track_caller]
fn refused_here(c: &mut RawConn, what: &str, request: u32, body: &[u8], fds: &[RawFd]) -> Reply {
    let reply = c.expect_rejected(what, request, body, fds);
    assert!(
        matches!(reply.u64_body(), Some(v) if v != 0),
        "{what}: expected an error status for this message, got {reply:?}"
    );
    c.query_u64(FrontendReq::GET_FEATURES);
    reply
}

/// SET_VRING_ADDR's body: queue `index`, no flags, the three VMM addresses, no log address.
fn vring_addr_body(index: u32, desc: u64, used: u64, avail: u64) -> Vec<u8> {
    Body::new()
        .u32(index)
        .u32(0)
        .u64(desc)
        .u64(used)
        .u64(avail)
        .u64(0)
        .0
}

#[test]
fn invalid_messages_are_refused_at_the_message() {
    let (_dir, mut fe) = start("strict");
    let table = req(FrontendReq::SET_MEM_TABLE);
    let addr = req(FrontendReq::SET_VRING_ADDR);
    let num = req(FrontendReq::SET_VRING_NUM);

    case(&mut fe, "a second SET_OWNER", 1, |c| {
        refused_here(c, "second SET_OWNER", req(FrontendReq::SET_OWNER), &[], &[])
    });

    case(&mut fe, "SET_VRING_ADDR before any memory table", 2, |c| {
        c.expect_ok("SET_VRING_NUM", num, &vring_state_body(0, 256), &[]);
        let base = region(0, MIB, 0).user_addr;
        refused_here(
            c,
            "rings before memory",
            addr,
            &vring_addr_body(0, base, base + 0x2000, base + 0x1000),
            &[],
        )
    });

    for (i, (name, desc, avail, used)) in RINGS_OUTSIDE.iter().enumerate() {
        case(&mut fe, name, 3 + i as u64, |c| {
            let m = memfd(MIB);
            let r = region(0, MIB, 0);
            c.expect_ok("memory", table, &mem_table_body(1, &[r]), &[m.as_raw_fd()]);
            c.expect_ok("SET_VRING_NUM", num, &vring_state_body(0, 256), &[]);
            let base = r.user_addr;
            refused_here(
                c,
                name,
                addr,
                &vring_addr_body(0, base + desc, base + used, base + avail),
                &[],
            )
        });
    }
    // Positive control: the same ring inside memory is accepted at SET_VRING_ADDR.
    {
        let mut c = RawConn::connect(fe.socket());
        c.handshake();
        let m = memfd(MIB);
        let r = region(0, MIB, 0);
        c.expect_ok("memory", table, &mem_table_body(1, &[r]), &[m.as_raw_fd()]);
        c.expect_ok("SET_VRING_NUM", num, &vring_state_body(0, 256), &[]);
        let base = r.user_addr;
        c.expect_ok(
            "rings inside memory",
            addr,
            &vring_addr_body(0, base, base + 0x2000, base + 0x1000),
            &[],
        );
        println!("ok: positive control: rings inside guest memory are accepted");
    }

    // SET_MEM_TABLE carries up to 8 regions (more go with ADD_MEM_REG): 8 are accepted, 9
    // refused at the message.
    let regions_of = |n: u64| -> (Vec<File>, Vec<Region>) {
        let files = (0..n).map(|_| memfd(64 * 1024)).collect();
        let regions = (0..n).map(|i| region(i * MIB, 64 * 1024, 0)).collect();
        (files, regions)
    };
    {
        let mut c = RawConn::connect(fe.socket());
        c.handshake();
        let (files, regions) = regions_of(8);
        let fds: Vec<RawFd> = files.iter().map(|f| f.as_raw_fd()).collect();
        c.expect_ok("8 regions", table, &mem_table_body(8, &regions), &fds);
        println!("ok: positive control: SET_MEM_TABLE with 8 regions is accepted");
    }
    case(&mut fe, "SET_MEM_TABLE with 9 regions", 10, |c| {
        let (files, regions) = regions_of(9);
        let fds: Vec<RawFd> = files.iter().map(|f| f.as_raw_fd()).collect();
        refused_here(c, "9 regions", table, &mem_table_body(9, &regions), &fds)
    });
    case(
        &mut fe,
        "two regions at overlapping VMM addresses",
        11,
        |c| {
            let (a, b) = (memfd(MIB), memfd(MIB));
            let first = region(0, MIB, 0);
            let second = Region {
                user_addr: first.user_addr + MIB / 2,
                ..region(4 * MIB, MIB, 0)
            };
            refused_here(
                c,
                "VMM overlap",
                table,
                &mem_table_body(2, &[first, second]),
                &[a.as_raw_fd(), b.as_raw_fd()],
            )
        },
    );
    fe.finish();
}
