//! `--image null:SIZE`, the benchmarking aid: through libblkio the device has SIZE bytes,
//! reads return zeros whatever was written, and flush, discard and write-zeroes succeed. The
//! requests still travel frontend → ring → iothread → back.

use std::path::Path;

use blkplane_tests::client::errno_name;
use blkplane_tests::*;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

#[track_caller]
fn ok<T>(what: &str, r: Result<T, i32>) -> T {
    r.unwrap_or_else(|e| panic!("{what}: {}", errno_name(e)))
}

#[test]
fn null_image_reads_zeros_after_writes() {
    // 8 GiB that exist nowhere: nothing is allocated for a null image.
    let fe = Frontend::start(
        Path::new("null:8G"),
        &["--num-queues", "2", "--iothreads", "2"],
    );
    assert_eq!(
        fe.wait_iothreads(2, &[], std::time::Duration::from_secs(10))
            .len(),
        2
    );
    let mut c = Client::connect_with(
        fe.socket(),
        &ClientOptions {
            num_queues: 2,
            ..Default::default()
        },
    )
    .unwrap_or_else(|e| panic!("libblkio connect: {e} ({:?})", e.errno()));
    assert_eq!(c.capacity(), 8 * GIB, "capacity is the null image's size");

    for queue in 0..2 {
        let q = c.queue(queue);
        for (offset, len) in [
            (0, 512),
            (MIB + 512, 4096),
            (3 * GIB, 128 * KIB as usize),
            (8 * GIB - 4096, 4096),
        ] {
            ok("write", q.write_at(offset, &pattern(offset, len)));
            ok("flush", q.flush());
            // The buffer still holds the pattern: only the read can have zeroed it.
            assert_eq!(q.buf()[..len], pattern(offset, len));
            let back = ok("read", q.read_at(offset, len));
            assert_same_data(
                &format!("queue {queue}: read of {len} at {offset} after a write"),
                &back,
                &vec![0; len],
            );
        }
        ok(
            "discard",
            q.run(&Op::Discard {
                offset: GIB,
                len: 64 * MIB,
            }),
        );
        for unmap in [false, true] {
            ok(
                "write zeroes",
                q.run(&Op::WriteZeroes {
                    offset: 2 * GIB,
                    len: MIB,
                    unmap,
                }),
            );
        }
        let err = q
            .read_at(8 * GIB, 512)
            .expect_err("a read past the capacity succeeded");
        assert_eq!(err, libc::EIO, "read past the end: {}", errno_name(err));
    }

    // Many requests in flight at once, scattered reads into a buffer full of garbage.
    let q = c.queue(1);
    q.buf().fill(0xa5);
    let mut rng = Rng::new(7);
    q.pipeline(
        512,
        32,
        |_, slot| {
            slot.fill(0xa5);
            Op::Readv {
                offset: rng.below(8 * GIB / 4096) * 4096,
                iov: vec![(0, 1024), (2048, 3072)],
            }
        },
        |i, slot, ret| {
            assert_eq!(ret, 0, "read {i}");
            assert!(
                slot[..1024].iter().all(|&b| b == 0),
                "read {i}: first iovec"
            );
            assert!(slot[1024..2048].iter().all(|&b| b == 0xa5), "read {i}: gap");
            assert!(
                slot[2048..5120].iter().all(|&b| b == 0),
                "read {i}: second iovec"
            );
        },
    );
    drop(c);

    // The iothreads served a null image: nothing else could have answered.
    let log = fe.stderr();
    assert_eq!(
        log.matches("null image 8589934592 bytes").count(),
        2,
        "{log}"
    );
    fe.finish();
}

#[test]
fn null_image_sizes_are_checked() {
    for (image, args, why) in [
        ("null:0", &[][..], "zero"),
        ("null:1000", &[][..], "not a multiple of 512"),
        (
            "null:6K",
            &["--block-size", "4096"][..],
            "not a multiple of 4096",
        ),
        ("null:8Q", &[][..], "unknown suffix"),
    ] {
        let err = match Frontend::try_start(Path::new(image), args) {
            Ok(_) => panic!("{image} {args:?} ({why}) was accepted"),
            Err(e) => e,
        };
        println!("{image} {args:?}: refused ({why}): {err}");
    }
    // 4 KiB blocks on a null image: capacity in whole blocks, as given.
    let fe = Frontend::start(Path::new("null:12K"), &["--block-size", "4096"]);
    let mut c = Client::connect(fe.socket()).unwrap();
    assert_eq!(c.capacity(), 12 * KIB);
    let back = ok("read", c.queue(0).read_at(8 * KIB, 4096));
    assert_eq!(back, vec![0; 4096]);
    drop(c);
    fe.finish();
}
