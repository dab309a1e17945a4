//! I/O through libblkio, the way a VMM uses the device: properties, round trips, discard and
//! write-zeroes, multiqueue, a whole-image integrity pass, reconnects, cache modes and the
//! 4 KiB block size.

use std::path::Path;
use std::time::Duration;

use blkplane_tests::client::{check_fresh_connection, errno_name};
use blkplane_tests::raw::RawDevice;
use blkplane_tests::*;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

fn connect(fe: &Frontend) -> Client {
    connect_with(fe, &ClientOptions::default())
}

fn connect_with(fe: &Frontend, opts: &ClientOptions) -> Client {
    Client::connect_with(fe.socket(), opts)
        .unwrap_or_else(|e| panic!("libblkio connect: {e} ({:?})", e.errno()))
}

#[track_caller]
fn ok<T>(what: &str, r: Result<T, i32>) -> T {
    r.unwrap_or_else(|e| panic!("{what}: {}", errno_name(e)))
}

/// Writes `pattern(seed)` over `len` bytes at `offset`, reads it back and compares.
#[track_caller]
fn round_trip(q: &mut IoQueue, offset: u64, len: usize, seed: u64) -> Vec<u8> {
    let data = pattern(seed, len);
    ok(
        &format!("write {len} at {offset}"),
        q.write_at(offset, &data),
    );
    let back = ok(&format!("read {len} at {offset}"), q.read_at(offset, len));
    assert_same_data(
        &format!("round trip of {len} bytes at {offset}"),
        &back,
        &data,
    );
    data
}

#[test]
fn capacity_is_image_size_in_sectors() {
    let dir = TempDir::new("cap");
    // A multiple of 512 but not of 4096, and one with a partial last sector.
    for (size, want) in [
        (8 * MIB + 1536, 8 * MIB + 1536),
        (8 * MIB + 700, 8 * MIB + 512),
    ] {
        let img = create_image(&dir.join(&format!("disk-{size}.img")), size);
        let fe = Frontend::start(&img, &[]);
        let mut c = connect(&fe);
        assert_eq!(c.capacity(), want, "capacity of a {size}-byte image");
        let q = c.queue(0);
        // The last sector is usable, the one after it is not.
        round_trip(q, want - 512, 512, 1);
        let err = q
            .read_at(want, 512)
            .expect_err("read past the capacity succeeded");
        assert_eq!(
            err,
            libc::EIO,
            "read past the capacity: {}",
            errno_name(err)
        );
        println!(
            "image of {size} bytes: capacity {} bytes; last sector r/w ok; read past end -> EIO",
            want
        );
        drop(c);
        fe.finish();
    }
}

#[test]
fn read_only_device() {
    let dir = TempDir::new("ro");
    let img = create_random_image(&dir.join("disk.img"), 4 * MIB, 11);
    let fe = Frontend::start(&img, &["--read-only"]);

    // libblkio refuses to start a VIRTIO_BLK_F_RO device unless the client asked for read-only:
    // that is how a client "sees" the flag.
    match Client::connect(fe.socket()) {
        Ok(_) => panic!("read-write start of a read-only device succeeded"),
        Err(e) => assert_eq!(e.errno(), blkio::Errno::ROFS, "unexpected error: {e}"),
    }
    let mut c = connect_with(
        &fe,
        &ClientOptions {
            read_only: true,
            ..Default::default()
        },
    );
    assert!(c.blkio().get_bool("read-only").unwrap());
    let q = c.queue(0);
    let got = ok("read", q.read_at(MIB, 64 * KIB as usize));
    assert_same_data(
        "read-only data",
        &got,
        &read_file_at(&img, MIB, 64 * KIB as usize),
    );
    let err = q
        .write_at(0, &[0x55; 4096])
        .expect_err("write on a read-only device succeeded");
    ok("flush", q.flush());
    drop(c);
    assert_same_data(
        "image after refused write",
        &read_file_at(&img, 0, 4096),
        &pattern(11, 4096),
    );
    println!(
        "read-only: rw start -> EROFS, ro start ok, read ok, write -> {}, image unchanged \
         (device-side refusal is covered in bad_requests)",
        errno_name(err)
    );
    fe.finish();
}

#[test]
fn read_write_flush_round_trips() {
    let dir = TempDir::new("rw");
    let size = 32 * MIB;
    let img = create_image(&dir.join("disk.img"), size);
    let fe = Frontend::start(&img, &[]);
    let mut c = connect(&fe);
    let q = c.queue(0);
    let cases: [(u64, usize); 8] = [
        (0, 512),
        (4 * KIB, 4096),
        (MIB + 512, 4096),
        (3 * MIB, 128 * KIB as usize),
        (5 * MIB + 7 * 512, 64 * KIB as usize + 512),
        (9 * MIB, MIB as usize),
        (size - 128 * KIB, 128 * KIB as usize),
        (size - 512, 512),
    ];
    // What the image must hold at the end, kept up to date with every write.
    let mut model = vec![0u8; size as usize];
    let mut apply = |offset: u64, data: &[u8]| {
        model[offset as usize..offset as usize + data.len()].copy_from_slice(data)
    };
    for (i, &(offset, len)) in cases.iter().enumerate() {
        apply(offset, &round_trip(q, offset, len, 100 + i as u64));
        ok("flush", q.flush());
    }
    println!("write/read/flush ok for (offset, len) {cases:?}");

    // Overlapping writes: the later one wins where they overlap.
    let a = pattern(200, 64 * KIB as usize);
    let b = pattern(201, 16 * KIB as usize);
    ok("write a", q.write_at(12 * MIB, &a));
    ok("write b", q.write_at(12 * MIB + 8 * KIB, &b));
    let mut want = a.clone();
    want[8 * KIB as usize..24 * KIB as usize].copy_from_slice(&b);
    let got = ok("read overlap", q.read_at(12 * MIB, 64 * KIB as usize));
    assert_same_data("overlapping writes", &got, &want);
    apply(12 * MIB, &want);
    println!("overlapping writes ok");

    // Vectored I/O: a writev from scattered (and one odd-sized) buffer pieces, read back
    // contiguously and then with a readv into other scattered pieces.
    let segs = [
        (0usize, 4096usize),
        (64 * 1024, 512),
        (200 * 1024, 8192 + 512),
        (300 * 1024, 3072),
    ];
    let total: usize = segs.iter().map(|s| s.1).sum();
    let data = pattern(300, total);
    let mut at = 0;
    for &(off, len) in &segs {
        q.buf()[off..off + len].copy_from_slice(&data[at..at + len]);
        at += len;
    }
    let offset = 16 * MIB + 4096;
    ok(
        "writev",
        q.run(&Op::Writev {
            offset,
            iov: segs.to_vec(),
        }),
    );
    let got = ok("read after writev", q.read_at(offset, total));
    assert_same_data("writev data", &got, &data);
    let rsegs = [
        (1024 * 1024, 512),
        (1100 * 1024, 12 * 1024),
        (1500 * 1024, 3584),
    ];
    assert_eq!(rsegs.iter().map(|s| s.1).sum::<usize>(), total);
    ok(
        "readv",
        q.run(&Op::Readv {
            offset,
            iov: rsegs.to_vec(),
        }),
    );
    let mut got = Vec::new();
    for &(off, len) in &rsegs {
        got.extend_from_slice(&q.buf()[off..off + len]);
    }
    assert_same_data("readv data", &got, &data);
    apply(offset, &data);
    println!("writev of {segs:?} and readv of {rsegs:?} ok ({total} bytes)");

    // A buffer that is not even 512-byte aligned in memory (libblkio's buf-alignment is 1, so
    // a VMM may legitimately pass one); the frontend must cope, e.g. in O_DIRECT mode.
    let data = pattern(400, 8192);
    q.buf()[3..3 + 8192].copy_from_slice(&data);
    ok(
        "write from an unaligned buffer",
        q.run(&Op::Write {
            offset: 20 * MIB,
            buf: 3,
            len: 8192,
        }),
    );
    ok(
        "read into an unaligned buffer",
        q.run(&Op::Read {
            offset: 20 * MIB,
            buf: 4096 + 5,
            len: 8192,
        }),
    );
    let got = q.buf()[4096 + 5..4096 + 5 + 8192].to_vec();
    assert_same_data("unaligned buffers", &got, &data);
    apply(20 * MIB, &data);
    println!("write/read through byte-aligned buffers ok");

    ok("final flush", q.flush());
    drop(c);
    assert_same_data("image file", &read_file(&img), &model);
    println!("image file matches a model of all writes");
    fe.finish();
}

/// Discards and zeroes ranges of a random image on a file in `base` and checks zeros come
/// back (through the device and in the file) while the neighbours keep their data.
fn discard_and_write_zeroes_in(base: &Path) {
    let dir = TempDir::new_in(base, "dwz");
    let size = 16 * MIB;
    let img = create_random_image(&dir.join("disk.img"), size, 21);
    let original = read_file(&img);
    let fe = Frontend::start(&img, &[]);
    let mut c = connect(&fe);
    let max_discard = c.blkio().get_u64("max-discard-len").unwrap();
    let max_wz = c.blkio().get_u64("max-write-zeroes-len").unwrap();
    let align = c.blkio().get_i32("discard-alignment").unwrap() as u64;
    let q = c.queue(0);

    let ranges = [
        (
            "discard",
            MIB,
            MIB,
            Op::Discard {
                offset: MIB,
                len: MIB,
            },
        ),
        (
            "discard (small, aligned)",
            3 * MIB + align,
            align.max(4096),
            Op::Discard {
                offset: 3 * MIB + align,
                len: align.max(4096),
            },
        ),
        (
            "write-zeroes (unmap)",
            4 * MIB,
            64 * KIB + 512,
            Op::WriteZeroes {
                offset: 4 * MIB,
                len: 64 * KIB + 512,
                unmap: true,
            },
        ),
        (
            "write-zeroes (no unmap)",
            8 * MIB + 512,
            MIB,
            Op::WriteZeroes {
                offset: 8 * MIB + 512,
                len: MIB,
                unmap: false,
            },
        ),
    ];
    for (name, offset, len, op) in &ranges {
        let limit = if matches!(op, Op::Discard { .. }) {
            max_discard
        } else {
            max_wz
        };
        assert!(
            *len <= limit,
            "{name}: {len} bytes exceed the limit {limit}"
        );
        ok(name, q.run(op));
        let got = ok("read back", q.read_at(*offset, *len as usize));
        assert!(
            got.iter().all(|&b| b == 0),
            "{name} of {len} bytes at {offset}: non-zero data reads back"
        );
        // The neighbours are untouched.
        for (o, l) in [(*offset - 4096, 4096usize), (*offset + *len, 4096)] {
            let got = ok("read neighbour", q.read_at(o, l));
            assert_same_data(
                &format!("{name}: neighbour at {o}"),
                &got,
                &original[o as usize..o as usize + l],
            );
        }
    }
    ok("flush", q.flush());
    drop(c);
    let mut want = original;
    for (_, offset, len, _) in &ranges {
        want[*offset as usize..(*offset + *len) as usize].fill(0);
    }
    assert_same_data(
        "image file after discard/write-zeroes",
        &read_file(&img),
        &want,
    );
    println!(
        "{}: discard and write-zeroes (unmap and no-unmap) read back as zeros, neighbours \
         intact, image file matches (max-discard-len {max_discard}, max-write-zeroes-len \
         {max_wz}, discard-alignment {align})",
        base.display()
    );
    fe.finish();
}

#[test]
fn discard_and_write_zeroes_regular_file() {
    discard_and_write_zeroes_in(&std::env::temp_dir());
}

#[test]
fn discard_and_write_zeroes_dev_shm() {
    let shm = Path::new("/dev/shm");
    if !shm.is_dir() {
        println!("SKIPPED: no /dev/shm");
        return;
    }
    discard_and_write_zeroes_in(shm);
}

#[test]
fn two_queues_on_two_iothreads() {
    let dir = TempDir::new("mq");
    let size = 32 * MIB;
    let img = create_image(&dir.join("disk.img"), size);
    let fe = Frontend::start(&img, &["--num-queues", "2", "--iothreads", "2"]);
    let iothreads = fe.wait_iothreads(2, &[], Duration::from_secs(10));
    let mut c = connect_with(
        &fe,
        &ClientOptions {
            num_queues: 2,
            ..Default::default()
        },
    );
    assert_eq!(c.blkio().get_i32("max-queues").unwrap(), 2);
    const CHUNK: usize = 64 * 1024;
    let half = size / 2;
    let chunks = (half / CHUNK as u64) as usize;
    let seed = |qi: usize, chunk: usize| ((qi as u64) << 32) | chunk as u64;
    // Each queue fills its own half at queue depth 8, both at the same time, then verifies it.
    std::thread::scope(|s| {
        for (qi, q) in c.queues_mut().iter_mut().enumerate() {
            s.spawn(move || {
                let base = qi as u64 * half;
                q.pipeline(
                    chunks,
                    8,
                    |i, slot| {
                        slot[..CHUNK].copy_from_slice(&pattern(seed(qi, i), CHUNK));
                        Op::Write {
                            offset: base + (i * CHUNK) as u64,
                            buf: 0,
                            len: CHUNK,
                        }
                    },
                    |i, _, ret| assert_eq!(ret, 0, "queue {qi}: write {i}: {}", errno_name(-ret)),
                );
                q.pipeline(
                    chunks,
                    8,
                    |i, _| Op::Read {
                        offset: base + (i * CHUNK) as u64,
                        buf: 0,
                        len: CHUNK,
                    },
                    |i, slot, ret| {
                        assert_eq!(ret, 0, "queue {qi}: read {i}: {}", errno_name(-ret));
                        assert_same_data(
                            &format!("queue {qi} chunk {i}"),
                            &slot[..CHUNK],
                            &pattern(seed(qi, i), CHUNK),
                        );
                    },
                );
            });
        }
    });
    // Each queue sees the other's data too.
    for qi in 0..2 {
        let other = 1 - qi;
        let q = c.queue(qi);
        for i in [0, chunks / 2, chunks - 1] {
            let got = ok(
                "cross read",
                q.read_at(other as u64 * half + (i * CHUNK) as u64, CHUNK),
            );
            assert_same_data("cross-queue read", &got, &pattern(seed(other, i), CHUNK));
        }
    }
    assert_eq!(
        fe.iothread_pids(),
        iothreads,
        "iothreads changed during the test"
    );
    drop(c);
    println!(
        "2 queues on iothreads {iothreads:?}: {chunks} x 64 KiB written and verified per queue \
         concurrently at QD 8, cross-queue reads ok"
    );
    fe.finish();
}

#[test]
fn whole_image_integrity() {
    let dir = TempDir::new("integrity");
    let size = 64 * MIB;
    const CHUNK: usize = 128 * 1024;
    const DEPTH: usize = 16;
    let chunks = (size / CHUNK as u64) as usize;
    let img = create_image(&dir.join("disk.img"), size);
    let fe = Frontend::start(&img, &[]);
    let mut c = connect_with(
        &fe,
        &ClientOptions {
            buf_size: DEPTH * CHUNK,
            ..Default::default()
        },
    );
    // Write the chunks in a shuffled order, so completions race across the whole image.
    let mut order: Vec<usize> = (0..chunks).collect();
    let mut rng = Rng::new(77);
    for i in (1..order.len()).rev() {
        order.swap(i, rng.below(i as u64 + 1) as usize);
    }
    let seed = |chunk: usize| 0x5eed_0000 + chunk as u64;
    let q = c.queue(0);
    q.pipeline(
        chunks,
        DEPTH,
        |i, slot| {
            let chunk = order[i];
            slot[..CHUNK].copy_from_slice(&pattern(seed(chunk), CHUNK));
            Op::Write {
                offset: (chunk * CHUNK) as u64,
                buf: 0,
                len: CHUNK,
            }
        },
        |i, _, ret| assert_eq!(ret, 0, "write of chunk {}: {}", order[i], errno_name(-ret)),
    );
    ok("flush", q.flush());
    q.pipeline(
        chunks,
        DEPTH,
        |i, _| Op::Read {
            offset: (i * CHUNK) as u64,
            buf: 0,
            len: CHUNK,
        },
        |i, slot, ret| {
            assert_eq!(ret, 0, "read of chunk {i}: {}", errno_name(-ret));
            assert_same_data(
                &format!("chunk {i}"),
                &slot[..CHUNK],
                &pattern(seed(i), CHUNK),
            );
        },
    );
    drop(c);
    let file = read_file(&img);
    assert_eq!(file.len() as u64, size, "image size changed");
    for i in 0..chunks {
        assert_same_data(
            &format!("image file chunk {i}"),
            &file[i * CHUNK..(i + 1) * CHUNK],
            &pattern(seed(i), CHUNK),
        );
    }
    println!(
        "{} MiB image: {chunks} random 128 KiB chunks written in shuffled order at QD {DEPTH}, \
         re-read and verified through the device and in the image file",
        size / MIB
    );
    fe.finish();
}

#[test]
fn disconnect_and_reconnect() {
    let dir = TempDir::new("reconnect");
    let img = create_image(&dir.join("disk.img"), 16 * MIB);
    let fe = Frontend::start(&img, &[]);
    let pid = fe.pid();
    let offsets = [0, 5 * MIB + 4096, 16 * MIB - 64 * KIB];
    for round in 0..3u64 {
        let mut c = connect(&fe);
        let q = c.queue(0);
        for (i, &off) in offsets.iter().enumerate() {
            if round > 0 {
                // What the previous connection wrote is there.
                let got = ok("read", q.read_at(off, 64 * KIB as usize));
                assert_same_data(
                    &format!("round {round}: data of the previous connection at {off}"),
                    &got,
                    &pattern(round * 10 + i as u64 - 10, 64 * KIB as usize),
                );
            }
            round_trip(q, off, 64 * KIB as usize, round * 10 + i as u64);
        }
        // Leave without flushing or any goodbye: the frontend must take the next connection.
        drop(c);
    }
    assert_eq!(fe.pid(), pid);
    println!("3 connections in a row to frontend {pid}: each read the previous one's data and wrote its own");
    fe.finish();
}

#[test]
fn cache_modes_on_tmpfs() {
    let shm = Path::new("/dev/shm");
    if !shm.is_dir() {
        println!("SKIPPED: no /dev/shm");
        return;
    }
    let dir = TempDir::new_in(shm, "cache");
    for (mode, flush_needed) in [
        ("direct", true),
        ("writeback", true),
        ("writethrough", false),
    ] {
        let img = create_image(&dir.join(&format!("{mode}.img")), 8 * MIB);
        let fe = Frontend::start(&img, &["--cache", mode]);
        let mut c = connect(&fe);
        // CONFIG_WCE reports the cache mode; libblkio turns it into flush-needed.
        assert_eq!(
            c.blkio().get_bool("flush-needed").unwrap(),
            flush_needed,
            "flush-needed with --cache {mode}"
        );
        let q = c.queue(0);
        let data = round_trip(q, MIB + 4096, 128 * KIB as usize, 500);
        ok("flush", q.flush());
        let again = ok(
            "read after flush",
            q.read_at(MIB + 4096, 128 * KIB as usize),
        );
        assert_same_data("after flush", &again, &data);
        drop(c);
        assert_same_data(
            &format!("image file with --cache {mode}"),
            &read_file_at(&img, MIB + 4096, data.len()),
            &data,
        );
        // tmpfs refuses O_DIRECT before Linux 6.6; the frontend must then fall back to
        // buffered I/O and say so.
        let note = match (mode, supports_o_direct(&img)) {
            ("direct", true) => "; this tmpfs accepts O_DIRECT".to_string(),
            ("direct", false) => {
                let stderr = fe.stderr();
                let line = stderr
                    .lines()
                    .find(|l| l.to_ascii_lowercase().contains("direct"))
                    .unwrap_or("(no line mentions O_DIRECT)")
                    .to_string();
                format!("; tmpfs has no O_DIRECT, frontend said: {line}")
            }
            _ => String::new(),
        };
        println!("--cache {mode}: write/read/flush ok, flush-needed {flush_needed}{note}");
        fe.finish();
    }
}

#[test]
fn block_size_4096() {
    let dir = TempDir::new("bs4k");
    let img = create_image(&dir.join("disk.img"), 8 * MIB);
    let fe = Frontend::start(&img, &["--block-size", "4096"]);
    let mut c = connect(&fe);
    // libblkio derives request-alignment from the config space's blk_size.
    assert_eq!(c.blkio().get_i32("request-alignment").unwrap(), 4096);
    assert_eq!(c.capacity(), 8 * MIB);
    let q = c.queue(0);
    round_trip(q, 8 * KIB, 4096, 600);
    round_trip(q, 3 * MIB, 64 * KIB as usize, 601);
    ok("flush", q.flush());
    drop(c);

    let mut dev = RawDevice::connect(fe.socket(), 1, 256).expect("raw connect");
    let cfg = dev.config();
    assert_eq!(cfg.blk_size, 4096, "config blk_size");
    assert_eq!(
        cfg.capacity,
        8 * MIB / 512,
        "capacity stays in 512-byte sectors"
    );
    // Requests that are not whole logical blocks are refused.
    use virtio_bindings::virtio_blk::{VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK};
    let r = dev.read(0, 1, 4096);
    assert_eq!(
        r.status_u32(),
        Some(VIRTIO_BLK_S_IOERR),
        "read at sector 1: {r:?}"
    );
    let r = dev.read(0, 8, 512);
    assert_eq!(
        r.status_u32(),
        Some(VIRTIO_BLK_S_IOERR),
        "512-byte read: {r:?}"
    );
    let r = dev.read(0, 16, 4096);
    assert_eq!(r.status_u32(), Some(VIRTIO_BLK_S_OK), "aligned read: {r:?}");
    assert_same_data("aligned raw read", &r.data[0], &pattern(600, 4096));
    drop(dev);
    check_fresh_connection(fe.socket(), 4 * MIB, 602);
    println!(
        "--block-size 4096: request-alignment 4096, config blk_size 4096, capacity in 512-byte \
         sectors, 4 KiB I/O ok, unaligned sector and 512-byte length -> IOERR"
    );
    fe.finish();
}
