//! Malformed virtio-blk requests put straight on the ring by the raw front-end. Each must be
//! answered (the right status, or used length 0 when no status byte can be found) and the
//! device must keep serving the same queue afterwards. Each rejection is counted under the
//! rule it broke (the frontend's admin statistics, which blkplaned exports as
//! `blkplane_queue_rejected_total{reason}`): every case checks that exactly that one counter
//! moved, by one, and a valid request moves none.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use blkplane_tests::client::check_fresh_connection;
use blkplane_tests::raw::{
    blk_header, dwz_segment, BlkRequest, BlkResult, Buf, Desc, RawDevice, Seg, Status, F_INDIRECT,
    F_NEXT, F_WRITE, MEM_SIZE, STATUS_SENTINEL,
};
use blkplane_tests::*;
use virtio_bindings::virtio_blk::*;
use virtio_bindings::virtio_ring::VIRTIO_RING_F_INDIRECT_DESC;

const MIB: u64 = 1 << 20;
const IMAGE_SIZE: u64 = 8 * MIB;
const CAPACITY: u64 = IMAGE_SIZE / 512;
const SERIAL: &str = "bp-serial-0001";
const QUEUE_SIZE: u16 = 256;

/// What a case must produce.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expect {
    /// VIRTIO_BLK_S_OK.
    Ok,
    /// VIRTIO_BLK_S_IOERR.
    IoErr,
    /// VIRTIO_BLK_S_UNSUPP.
    Unsupp,
    /// Used length 0 and the status byte untouched.
    NoStatus,
    /// IOERR or "used length 0, no status": for chains so broken that either is reasonable.
    Rejected,
    /// Anything, as long as the request completes and the device lives on.
    Survive,
}

struct Setup {
    fe: Frontend,
    dev: RawDevice,
    /// The frontend's admin socket, for its rejection counters.
    admin: PathBuf,
    /// Queue 0's rejections by reason after the last case.
    rejections: BTreeMap<String, u64>,
    /// The counters the last case moved, and by how much.
    last_moved: Vec<(String, u64)>,
    /// Cases with the wrong outcome. Collected rather than panicking at once, so one run shows
    /// every broken rule; the test fails at `finish` if there are any.
    failures: Vec<String>,
    _dir: TempDir,
}

fn setup(tag: &str, args: &[&str]) -> Setup {
    let dir = TempDir::new(tag);
    let img = create_random_image(&dir.join("disk.img"), IMAGE_SIZE, 31);
    let admin = dir.join("admin.sock");
    let mut all = vec![
        "--serial",
        SERIAL,
        "--admin-socket",
        admin.to_str().unwrap(),
    ];
    all.extend_from_slice(args);
    let fe = Frontend::start(&img, &all);
    let dev = RawDevice::connect(fe.socket(), 1, QUEUE_SIZE)
        .unwrap_or_else(|e| panic!("raw vhost-user setup: {e}"));
    let mut s = Setup {
        fe,
        dev,
        admin,
        rejections: BTreeMap::new(),
        last_moved: Vec::new(),
        failures: Vec::new(),
        _dir: dir,
    };
    s.rejections = s.read_rejections();
    assert!(
        s.rejections.contains_key("status_read_only") && s.rejections.values().all(|&n| n == 0),
        "a new frontend lists every rule at zero: {:?}",
        s.rejections
    );
    s
}

impl Setup {
    /// Runs `req`, checks the outcome, then that the frontend lives and the queue still serves
    /// a valid read.
    #[track_caller]
    fn check(&mut self, name: &str, req: &BlkRequest, expect: Expect) -> BlkResult {
        let r = self.dev.request(0, req);
        self.verify(name, &r, expect);
        r
    }

    /// [`Setup::check`] of a request that breaks the rule named `reason`.
    #[track_caller]
    fn rejects(&mut self, name: &str, req: &BlkRequest, expect: Expect, reason: &str) -> BlkResult {
        let r = self.check(name, req, expect);
        self.rejected_for(name, reason);
        r
    }

    /// Queue 0's rejection counters by reason.
    fn read_rejections(&self) -> BTreeMap<String, u64> {
        let stats = admin::stats(&self.admin).unwrap_or_else(|e| panic!("stats: {e}"));
        let q = stats.queues.first().cloned().unwrap_or_default();
        q.rejections
            .into_iter()
            .map(|r| (r.reason, r.count))
            .collect()
    }

    /// The rejection counters that moved since the last look (and remembers the new ones).
    fn moved(&mut self) -> Vec<(String, u64)> {
        let now = self.read_rejections();
        let moved = now
            .iter()
            .filter_map(|(reason, &n)| {
                let before = self.rejections.get(reason).copied().unwrap_or(0);
                (n != before).then(|| (reason.clone(), n.saturating_sub(before)))
            })
            .collect();
        self.rejections = now;
        moved
    }

    /// The last case was counted once, under `reason`, and under nothing else.
    #[track_caller]
    fn rejected_for(&mut self, name: &str, reason: &str) {
        let moved = &self.last_moved;
        if moved != &[(reason.to_string(), 1)] {
            let outcome = format!("{name}: rejections counted {moved:?}, expected {reason} once");
            println!("FAILED: {outcome}");
            self.failures.push(outcome);
        }
    }

    #[track_caller]
    fn verify(&mut self, name: &str, r: &BlkResult, expect: Expect) {
        let status = r.status_u32();
        let good = match expect {
            Expect::Ok => status == Some(VIRTIO_BLK_S_OK),
            Expect::IoErr => status == Some(VIRTIO_BLK_S_IOERR) && r.used_len >= 1,
            Expect::Unsupp => status == Some(VIRTIO_BLK_S_UNSUPP) && r.used_len >= 1,
            Expect::NoStatus => r.used_len == 0 && r.status.is_none(),
            Expect::Rejected => r.is_rejected(),
            Expect::Survive => true,
        };
        let outcome = format!(
            "{name}: used len {}, status {:?} (expected {expect:?})",
            r.used_len, r.status
        );
        self.last_moved = self.moved();
        if good {
            println!("ok: {outcome}");
        } else {
            println!("FAILED: {outcome}");
            self.failures.push(outcome);
        }
        // A valid request is no rejection; a rejected one is counted once, under one rule
        // (which `rejects` names). `alive` below reads valid data, which counts nowhere.
        println!("    counted: {:?}", self.last_moved);
        let counted_right = match expect {
            Expect::Ok => self.last_moved.is_empty(),
            Expect::Survive => true,
            _ => self.last_moved.len() == 1 && self.last_moved.iter().all(|(_, n)| *n == 1),
        };
        if !counted_right {
            let outcome = format!(
                "{name}: rejections counted {:?} (expected {})",
                self.last_moved,
                if expect == Expect::Ok { "none" } else { "one" }
            );
            println!("FAILED: {outcome}");
            self.failures.push(outcome);
        }
        // A device that no longer serves the queue makes every later case meaningless, so
        // that does fail at once.
        self.alive(name);
    }

    #[track_caller]
    fn alive(&mut self, name: &str) {
        self.fe.assert_running(name);
        self.dev.assert_alive(0, name);
    }

    /// The end of every test: no case had the wrong outcome, the frontend survived, and (given
    /// a seed for its test write) a fresh libblkio connection works.
    fn finish(self, fresh_connection_seed: Option<u64>) {
        let Setup {
            mut fe,
            dev,
            failures,
            _dir,
            ..
        } = self;
        drop(dev);
        fe.assert_running("the raw connection closing");
        if let Some(seed) = fresh_connection_seed {
            check_fresh_connection(fe.socket(), 4 * MIB, seed);
            println!("fresh libblkio connection ok");
        }
        assert!(
            failures.is_empty(),
            "{} case(s) had the wrong outcome:\n{}",
            failures.len(),
            failures.join("\n")
        );
        fe.finish();
    }
}

fn read_req(sector: u64, len: u32) -> BlkRequest {
    BlkRequest::new(VIRTIO_BLK_T_IN, sector).data(Buf::In(len))
}

fn write_req(sector: u64, len: usize) -> BlkRequest {
    BlkRequest::new(VIRTIO_BLK_T_OUT, sector).data(Buf::Out(pattern(sector, len)))
}

#[test]
fn valid_requests_direct_and_indirect() {
    let mut s = setup("valid", &[]);
    assert!(
        s.dev.features & (1 << VIRTIO_RING_F_INDIRECT_DESC) != 0,
        "RING_INDIRECT_DESC not negotiated"
    );
    let w = s.check("write 4 KiB at sector 8", &write_req(8, 4096), Expect::Ok);
    assert_eq!(w.used_len, 1, "a write's used len is the status byte only");
    let r = s.check("read it back", &read_req(8, 4096), Expect::Ok);
    assert_eq!(r.used_len, 4097);
    assert_same_data("read back", &r.data[0], &pattern(8, 4096));
    let r = s.check("indirect read", &read_req(8, 4096).indirect(), Expect::Ok);
    assert_same_data("indirect read", &r.data[0], &pattern(8, 4096));
    s.check(
        "indirect write",
        &write_req(64, 8192).indirect(),
        Expect::Ok,
    );
    // The header split over two descriptors and the data over eight: legal with VERSION_1's
    // free layout.
    let hdr = blk_header(VIRTIO_BLK_T_IN, 64);
    let mut req = BlkRequest::new(VIRTIO_BLK_T_IN, 64)
        .header(Buf::Out(hdr[..8].to_vec()))
        .data(Buf::Out(hdr[8..].to_vec()));
    for _ in 0..8 {
        req = req.data(Buf::In(1024));
    }
    let r = s.check("split header, 8 data descriptors", &req, Expect::Ok);
    assert_eq!(r.used_len, 8193);
    assert_same_data("scattered read", &r.data.concat(), &pattern(64, 8192));
    let r = s.check("flush", &BlkRequest::new(VIRTIO_BLK_T_FLUSH, 0), Expect::Ok);
    assert_eq!(r.used_len, 1);
    s.check(
        "read of the last sector",
        &read_req(CAPACITY - 1, 512),
        Expect::Ok,
    );
    s.finish(Some(1));
}

#[test]
fn descriptors_outside_guest_memory() {
    let mut s = setup("oob", &[]);
    let outside = |len| {
        Buf::Raw(Seg {
            addr: MEM_SIZE,
            len,
            writable: true,
        })
    };
    s.rejects(
        "header outside guest memory",
        &read_req(0, 512).header(Buf::Raw(Seg {
            addr: MEM_SIZE + 4096,
            len: 16,
            writable: false,
        })),
        Expect::Rejected,
        "outside_memory",
    );
    s.rejects(
        "read into a buffer outside guest memory",
        &BlkRequest::new(VIRTIO_BLK_T_IN, 0).data(outside(512)),
        Expect::IoErr,
        "outside_memory",
    );
    s.rejects(
        "read into a buffer straddling the end of guest memory",
        &BlkRequest::new(VIRTIO_BLK_T_IN, 0).data(Buf::Raw(Seg {
            addr: MEM_SIZE - 256,
            len: 512,
            writable: true,
        })),
        Expect::IoErr,
        "outside_memory",
    );
    s.rejects(
        "write from a buffer far outside guest memory",
        &BlkRequest::new(VIRTIO_BLK_T_OUT, 0).data(Buf::Raw(Seg {
            addr: 1 << 40,
            len: 4096,
            writable: false,
        })),
        Expect::IoErr,
        "outside_memory",
    );
    s.rejects(
        "buffer whose address + length wraps around u64",
        &BlkRequest::new(VIRTIO_BLK_T_IN, 0).data(Buf::Raw(Seg {
            addr: u64::MAX - 100,
            len: 512,
            writable: true,
        })),
        Expect::IoErr,
        "address_overflow",
    );
    s.rejects(
        "status byte outside guest memory",
        &read_req(0, 512).status(Status::At(MEM_SIZE + 1)),
        Expect::NoStatus,
        "outside_memory",
    );
    s.rejects(
        "indirect request whose header is outside guest memory",
        &read_req(0, 512)
            .header(Buf::Raw(Seg {
                addr: MEM_SIZE,
                len: 16,
                writable: false,
            }))
            .indirect(),
        Expect::Rejected,
        "outside_memory",
    );
    // An indirect table that is itself outside guest memory.
    let used = s.dev.run_descs(
        0,
        &[Desc {
            addr: MEM_SIZE,
            len: 48,
            flags: F_INDIRECT,
            next: 0,
        }],
        0,
    );
    assert_eq!(used.len, 0, "indirect table outside guest memory: {used:?}");
    s.last_moved = s.moved();
    s.rejected_for(
        "indirect table outside guest memory",
        "table_outside_memory",
    );
    s.alive("indirect table outside guest memory");
    println!("ok: indirect table outside guest memory: used len 0");
    s.finish(Some(2));
}

/// Writes a header and a sentinel status byte into static memory for hand-made chains.
fn header_and_status(dev: &mut RawDevice) -> (u64, u64) {
    let hdr = dev.alloc_static(16);
    dev.mem.write(hdr, &blk_header(VIRTIO_BLK_T_IN, 0));
    let st = dev.alloc_static(16);
    dev.mem.fill(st, 16, STATUS_SENTINEL);
    (hdr, st)
}

#[test]
fn descriptor_loops_and_broken_chains() {
    let mut s = setup("loops", &[]);
    let (hdr, st) = header_and_status(&mut s.dev);
    let data = s.dev.alloc_static(512);
    let d = |addr, len, flags, next| Desc {
        addr,
        len,
        flags,
        next,
    };

    // (what, the rule it breaks, the chain)
    type Case = (&'static str, &'static str, Vec<Desc>);
    let mut cases: Vec<Case> = vec![
        (
            "descriptor 0 chained to itself",
            "chain_too_long",
            vec![d(hdr, 16, F_NEXT, 0)],
        ),
        (
            "two descriptors chained in a cycle",
            "chain_too_long",
            vec![d(hdr, 16, F_NEXT, 1), d(st, 1, F_WRITE | F_NEXT, 0)],
        ),
        (
            "next index beyond the queue size",
            "next_out_of_range",
            vec![d(hdr, 16, F_NEXT, QUEUE_SIZE + 5)],
        ),
    ];
    // A chain through every descriptor of the table and back to the start: longer than the
    // queue without any single short cycle.
    let mut long: Vec<Desc> = (0..QUEUE_SIZE)
        .map(|i| d(data, 512, F_WRITE | F_NEXT, (i + 1) % QUEUE_SIZE))
        .collect();
    long[0] = d(hdr, 16, F_NEXT, 1);
    cases.push((
        "chain of queue-size descriptors that wraps to its head",
        "chain_too_long",
        long,
    ));

    // Indirect tables that break the rules.
    let inner = s
        .dev
        .write_desc_table(&[d(hdr, 16, F_NEXT, 1), d(st, 1, F_WRITE, 0)]);
    let nested = s.dev.write_desc_table(&[d(inner, 32, F_INDIRECT, 0)]);
    cases.push((
        "indirect descriptor inside an indirect table",
        "nested_indirect",
        vec![d(nested, 16, F_INDIRECT, 0)],
    ));
    let looping = s
        .dev
        .write_desc_table(&[d(hdr, 16, F_NEXT, 1), d(st, 1, F_WRITE | F_NEXT, 0)]);
    cases.push((
        "loop inside an indirect table",
        "indirect_too_long",
        vec![d(looping, 32, F_INDIRECT, 0)],
    ));
    let escaping = s
        .dev
        .write_desc_table(&[d(hdr, 16, F_NEXT, 7), d(st, 1, F_WRITE, 0)]);
    cases.push((
        "indirect next index beyond the table",
        "next_out_of_range",
        vec![d(escaping, 32, F_INDIRECT, 0)],
    ));
    cases.push((
        "indirect table of length 0",
        "indirect_table_length",
        vec![d(inner, 0, F_INDIRECT, 0)],
    ));
    cases.push((
        "indirect table length not a multiple of 16",
        "indirect_table_length",
        vec![d(inner, 24, F_INDIRECT, 0)],
    ));
    cases.push((
        "indirect descriptor that also has NEXT",
        "indirect_with_next",
        vec![d(inner, 32, F_INDIRECT | F_NEXT, 1), d(st, 1, F_WRITE, 0)],
    ));
    // An indirect table may hold more descriptors than the ring (Linux sizes its tables by
    // seg_max, not by the ring size the VMM chose), but not more than 1024.
    let chain = |n: u16| -> Vec<Desc> {
        (0..n)
            .map(|i| {
                if i == 0 {
                    d(hdr, 16, F_NEXT, 1)
                } else if i == n - 1 {
                    d(st, 1, F_WRITE, 0)
                } else {
                    d(data, 512, F_WRITE | F_NEXT, i + 1)
                }
            })
            .collect()
    };
    let longer_than_ring = s.dev.write_desc_table(&chain(QUEUE_SIZE + 1));
    s.dev.mem.write(hdr, &blk_header(VIRTIO_BLK_T_IN, 0));
    let used = s.dev.run_descs(
        0,
        &[d(
            longer_than_ring,
            16 * (u32::from(QUEUE_SIZE) + 1),
            F_INDIRECT,
            0,
        )],
        0,
    );
    assert_eq!(
        used.len,
        (u32::from(QUEUE_SIZE) - 1) * 512 + 1,
        "an indirect table longer than the ring is a valid request"
    );
    assert_eq!(u32::from(s.dev.mem.read(st, 1)[0]), VIRTIO_BLK_S_OK);
    println!(
        "ok: indirect table of {} entries (ring of {QUEUE_SIZE}) served",
        QUEUE_SIZE + 1
    );
    let huge = s.dev.write_desc_table(&chain(1025));
    cases.push((
        "indirect table with more than 1024 entries",
        "indirect_too_long",
        vec![d(huge, 16 * 1025, F_INDIRECT, 0)],
    ));

    // The valid indirect table above is no rejection.
    let moved = s.moved();
    assert!(
        moved.is_empty(),
        "a valid indirect table counted as rejected: {moved:?}"
    );
    for (name, reason, descs) in &cases {
        s.dev.mem.fill(st, 16, STATUS_SENTINEL);
        let used = s.dev.run_descs(0, descs, 0);
        s.last_moved = s.moved();
        s.rejected_for(name, reason);
        assert_eq!(used.len, 0, "{name}: used entry {used:?}");
        assert_eq!(
            s.dev.mem.read(st, 1)[0],
            STATUS_SENTINEL,
            "{name}: the device wrote a status byte into a broken chain"
        );
        s.alive(name);
        println!("ok: {name}: used len 0, no status written");
    }

    // Last, as it may legitimately end the queue: a head index outside the descriptor table
    // corrupts the avail ring itself. The device may return it with used len 0, drop it, or stop
    // serving the queue until the next reset; it must not crash, and a new connection (which
    // resets the device) must work.
    s.dev.post(0, &[], QUEUE_SIZE + 3);
    match s.dev.wait_used(0, Duration::from_millis(500)) {
        None => println!("ok: head index beyond the queue: not returned"),
        Some(u) => {
            assert_eq!(u.len, 0, "head index beyond the queue: {u:?}");
            println!("ok: head index beyond the queue: used len 0");
        }
    }
    s.fe.assert_running("head index beyond the queue");
    match s
        .dev
        .try_request(0, &read_req(0, 4096), Duration::from_secs(1))
    {
        Some(r) => {
            assert_eq!(
                r.status_u32(),
                Some(VIRTIO_BLK_S_OK),
                "read after a bad head: {r:?}"
            );
            println!("ok: the queue is still served after a bad head");
        }
        None => println!("ok: the queue stopped after a bad head (until a reset)"),
    }
    s.finish(Some(3));
}

#[test]
fn short_headers() {
    let mut s = setup("hdr", &[]);
    let hdr = blk_header(VIRTIO_BLK_T_IN, 0);
    for len in [0usize, 1, 8, 15] {
        s.rejects(
            &format!("{len}-byte header"),
            &BlkRequest::new(VIRTIO_BLK_T_IN, 0).header(Buf::Out(hdr[..len].to_vec())),
            Expect::IoErr,
            "header_too_short",
        );
    }
    s.rejects(
        "8-byte header followed by a writable data buffer",
        &read_req(0, 512).header(Buf::Out(hdr[..8].to_vec())),
        Expect::IoErr,
        "header_too_short",
    );
    s.finish(Some(4));
}

#[test]
fn unusable_status_descriptor() {
    let mut s = setup("status", &[]);
    s.rejects(
        "header only, no status descriptor",
        &BlkRequest::new(VIRTIO_BLK_T_IN, 0).status(Status::Missing),
        Expect::NoStatus,
        "status_missing",
    );
    s.rejects(
        "write with header and data but no status descriptor",
        &write_req(0, 512).status(Status::Missing),
        Expect::NoStatus,
        "status_read_only",
    );
    s.rejects(
        "read-only status descriptor",
        &read_req(0, 512).status(Status::ReadOnly),
        Expect::NoStatus,
        "status_read_only",
    );
    s.rejects(
        "read-only status descriptor (flush)",
        &BlkRequest::new(VIRTIO_BLK_T_FLUSH, 0).status(Status::ReadOnly),
        Expect::NoStatus,
        "status_read_only",
    );
    s.rejects(
        "zero-length status descriptor",
        &read_req(0, 512).status(Status::ZeroLength),
        Expect::NoStatus,
        "status_empty",
    );
    s.rejects(
        "zero-length status descriptor (indirect)",
        &write_req(0, 512).status(Status::ZeroLength).indirect(),
        Expect::NoStatus,
        "status_empty",
    );
    s.finish(Some(5));
}

#[test]
fn data_in_the_wrong_direction() {
    let mut s = setup("dir", &[]);
    s.rejects(
        "read with a device-readable data buffer",
        &BlkRequest::new(VIRTIO_BLK_T_IN, 0).data(Buf::Out(vec![0; 512])),
        Expect::IoErr,
        "wrong_direction",
    );
    s.rejects(
        "write with a device-writable data buffer",
        &BlkRequest::new(VIRTIO_BLK_T_OUT, 0).data(Buf::In(512)),
        Expect::IoErr,
        "wrong_direction",
    );
    s.rejects(
        "write with both readable and writable data",
        &write_req(0, 512).data(Buf::In(512)),
        Expect::IoErr,
        "wrong_direction",
    );
    s.rejects(
        "device-readable buffer after a device-writable one",
        &read_req(0, 512).data(Buf::Out(vec![0; 512])),
        Expect::Rejected,
        "readable_after_writable",
    );
    s.rejects(
        "discard with a device-writable range list",
        &BlkRequest::new(VIRTIO_BLK_T_DISCARD, 0).data(Buf::In(16)),
        Expect::IoErr,
        "wrong_direction",
    );
    // The image must not have been touched by any of the above.
    let r = s.dev.read(0, 0, 1024);
    assert_same_data("sector 0 after bad writes", &r.data[0], &pattern(31, 1024));
    s.finish(Some(6));
}

#[test]
fn unknown_request_types() {
    let mut s = setup("types", &[]);
    for t in [
        VIRTIO_BLK_T_SCSI_CMD,
        3,
        VIRTIO_BLK_T_SECURE_ERASE,
        VIRTIO_BLK_T_ZONE_REPORT,
        VIRTIO_BLK_T_ZONE_RESET_ALL,
        0xdead,
        u32::MAX,
    ] {
        s.rejects(
            &format!("request type {t:#x}"),
            &BlkRequest::new(t, 0).data(Buf::In(512)),
            Expect::Unsupp,
            "unsupported_type",
        );
    }
    s.finish(Some(7));
}

#[test]
fn sectors_out_of_range() {
    let mut s = setup("range", &[]);
    s.rejects(
        "read at the capacity",
        &read_req(CAPACITY, 512),
        Expect::IoErr,
        "beyond_capacity",
    );
    s.rejects(
        "read across the end",
        &read_req(CAPACITY - 1, 1024),
        Expect::IoErr,
        "beyond_capacity",
    );
    s.rejects(
        "write across the end",
        &write_req(CAPACITY - 1, 1024),
        Expect::IoErr,
        "beyond_capacity",
    );
    s.rejects(
        "sector whose byte offset overflows u64",
        &read_req(u64::MAX / 512 + 1, 512),
        Expect::IoErr,
        "sector_overflow",
    );
    s.rejects(
        "sector u64::MAX",
        &read_req(u64::MAX, 512),
        Expect::IoErr,
        "sector_overflow",
    );
    s.rejects(
        "write at sector u64::MAX - 1",
        &write_req(u64::MAX - 1, 1024),
        Expect::IoErr,
        "sector_overflow",
    );
    s.rejects(
        "read of 100 bytes (not whole sectors)",
        &read_req(0, 100),
        Expect::IoErr,
        "misaligned_length",
    );
    s.rejects(
        "write of 512 + 100 bytes",
        &write_req(0, 612),
        Expect::IoErr,
        "misaligned_length",
    );
    // Degenerate but harmless: requests without data.
    s.check(
        "read without data",
        &BlkRequest::new(VIRTIO_BLK_T_IN, 0),
        Expect::Survive,
    );
    s.check(
        "write without data",
        &BlkRequest::new(VIRTIO_BLK_T_OUT, 0),
        Expect::Survive,
    );
    let r = s.dev.read(0, CAPACITY - 2, 1024);
    assert_same_data(
        "end of disk after refused writes",
        &r.data[0],
        &pattern(31, IMAGE_SIZE as usize)[IMAGE_SIZE as usize - 1024..],
    );
    s.finish(Some(8));
}

#[test]
fn read_only_disk_refuses_writes() {
    let mut s = setup("ro", &["--read-only"]);
    assert!(
        s.dev.offers(VIRTIO_BLK_F_RO),
        "--read-only does not offer VIRTIO_BLK_F_RO"
    );
    s.rejects("write", &write_req(0, 4096), Expect::IoErr, "read_only");
    s.rejects(
        "indirect write",
        &write_req(8, 512).indirect(),
        Expect::IoErr,
        "read_only",
    );
    s.rejects(
        "discard",
        &BlkRequest::new(VIRTIO_BLK_T_DISCARD, 0).data(Buf::Out(dwz_segment(0, 8, 0))),
        Expect::IoErr,
        "read_only",
    );
    s.rejects(
        "write-zeroes",
        &BlkRequest::new(VIRTIO_BLK_T_WRITE_ZEROES, 0).data(Buf::Out(dwz_segment(0, 8, 0))),
        Expect::IoErr,
        "read_only",
    );
    s.check("read", &read_req(0, 4096), Expect::Ok);
    s.check(
        "get-id",
        &BlkRequest::new(VIRTIO_BLK_T_GET_ID, 0).data(Buf::In(20)),
        Expect::Ok,
    );
    let r = s.dev.read(0, 0, 8192);
    assert_same_data("data of the read-only disk", &r.data[0], &pattern(31, 8192));
    // The disk is read-only, so the final check cannot write through a fresh connection.
    s.finish(None);
}

fn dwz(type_: u32, segments: &[Vec<u8>]) -> BlkRequest {
    BlkRequest::new(type_, 0).data(Buf::Out(segments.concat()))
}

#[test]
fn discard_and_write_zeroes_bad_segments() {
    let mut s = setup("dwz", &[]);
    let cfg = s.dev.config();
    println!("config: {cfg:?}");
    for (type_, name, max_seg, max_sectors) in [
        (
            VIRTIO_BLK_T_DISCARD,
            "discard",
            cfg.max_discard_seg,
            cfg.max_discard_sectors,
        ),
        (
            VIRTIO_BLK_T_WRITE_ZEROES,
            "write-zeroes",
            cfg.max_write_zeroes_seg,
            cfg.max_write_zeroes_sectors,
        ),
    ] {
        assert!(
            max_seg >= 1 && max_sectors >= 1,
            "{name}: limits {max_seg}/{max_sectors}"
        );
        let case = |what: &str| format!("{name}: {what}");
        s.check(
            &case("one valid range"),
            &dwz(type_, &[dwz_segment(64, 8, 0)]),
            Expect::Ok,
        );
        let r = s.dev.read(0, 64, 4096);
        assert!(r.data[0].iter().all(|&b| b == 0), "{name} left data behind");
        let max: Vec<_> = (0..max_seg as u64)
            .map(|i| dwz_segment(128 + 8 * i, 8, 0))
            .collect();
        s.check(&case("max_seg valid ranges"), &dwz(type_, &max), Expect::Ok);
        let mut over = max.clone();
        over.push(dwz_segment(8000, 8, 0));
        s.check(
            &case("max_seg + 1 ranges"),
            &dwz(type_, &over),
            Expect::IoErr,
        );
        s.check(
            &case("range of zero sectors"),
            &dwz(type_, &[dwz_segment(64, 0, 0)]),
            Expect::IoErr,
        );
        s.check(
            &case("range beyond the capacity"),
            &dwz(type_, &[dwz_segment(CAPACITY - 4, 8, 0)]),
            Expect::IoErr,
        );
        s.check(
            &case("range starting at the capacity"),
            &dwz(type_, &[dwz_segment(CAPACITY, 1, 0)]),
            Expect::IoErr,
        );
        s.check(
            &case("range whose end overflows u64"),
            &dwz(type_, &[dwz_segment(u64::MAX - 2, 8, 0)]),
            Expect::IoErr,
        );
        s.check(
            &case("valid range followed by a bad one"),
            &dwz(type_, &[dwz_segment(64, 8, 0), dwz_segment(CAPACITY, 8, 0)]),
            Expect::IoErr,
        );
        if u64::from(max_sectors) < CAPACITY {
            s.check(
                &case("range longer than the max sectors"),
                &dwz(type_, &[dwz_segment(0, max_sectors + 1, 0)]),
                Expect::IoErr,
            );
        }
        // The spec wants UNSUPP for flags the device does not support (any flag at all on a
        // discard, anything but UNMAP on write-zeroes); the frontend documents the same.
        s.check(
            &case("unknown flag bit 1"),
            &dwz(type_, &[dwz_segment(64, 8, 2)]),
            Expect::Unsupp,
        );
        s.check(
            &case("flags 0xffffffff"),
            &dwz(type_, &[dwz_segment(64, 8, u32::MAX)]),
            Expect::Unsupp,
        );
        s.check(
            &case("UNMAP flag"),
            &dwz(
                type_,
                &[dwz_segment(64, 8, VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP)],
            ),
            if type_ == VIRTIO_BLK_T_DISCARD {
                Expect::Unsupp
            } else {
                Expect::Ok
            },
        );
        s.check(
            &case("range list of 20 bytes"),
            &BlkRequest::new(type_, 0).data(Buf::Out(vec![0; 20])),
            Expect::IoErr,
        );
        s.check(
            &case("empty range list"),
            &BlkRequest::new(type_, 0),
            Expect::IoErr,
        );
    }
    s.finish(Some(9));
}

#[test]
fn get_id_returns_the_serial() {
    let mut s = setup("getid", &[]);
    let mut want = SERIAL.as_bytes().to_vec();
    want.resize(VIRTIO_BLK_ID_BYTES as usize, 0);
    let id = |buf| BlkRequest::new(VIRTIO_BLK_T_GET_ID, 0).data(buf);
    let r = s.check("GET_ID into 20 bytes", &id(Buf::In(20)), Expect::Ok);
    assert_eq!(r.data[0], want, "serial");
    assert_eq!(r.used_len, 21, "GET_ID used len");
    let r = s.check("GET_ID into 512 bytes", &id(Buf::In(512)), Expect::Ok);
    assert_eq!(&r.data[0][..20], &want[..], "serial in a large buffer");
    let r = s.check(
        "GET_ID into 10 + 10 bytes",
        &id(Buf::In(10)).data(Buf::In(10)),
        Expect::Ok,
    );
    assert_eq!(r.data.concat(), want, "serial across two buffers");
    let r = s.rejects(
        "GET_ID into 10 bytes",
        &id(Buf::In(10)),
        Expect::IoErr,
        "get_id_too_small",
    );
    assert_eq!(
        r.data[0],
        vec![0xaa; 10],
        "a too-small GET_ID buffer was written"
    );
    s.rejects(
        "GET_ID into 19 bytes",
        &id(Buf::In(19)),
        Expect::IoErr,
        "get_id_too_small",
    );
    s.rejects(
        "GET_ID without a buffer",
        &BlkRequest::new(VIRTIO_BLK_T_GET_ID, 0),
        Expect::IoErr,
        "get_id_too_small",
    );
    s.rejects(
        "GET_ID with a device-readable buffer",
        &id(Buf::Out(vec![0; 20])),
        Expect::IoErr,
        "get_id_too_small",
    );
    s.finish(Some(10));
}
