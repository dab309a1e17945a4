//! Tracking the guest's writes for a copy of a running disk to another node (TrackWrites on
//! the admin channel), and starting a frontend drained (`--drained`, the destination of
//! such a copy until its image is complete), against a real frontend driven by libblkio.
//!
//! - The test makes a `WriteBitmap` (64 KiB per bit) as blkplaned does and sends its memfd
//!   with TrackWrites; writes, a write-zeroes and a discard, through both queues of a frontend
//!   with two iothreads, mark exactly their blocks; reads mark nothing; taking a word clears
//!   it; once tracking stops nothing is marked; FrontendStatus `tracking_writes` follows.
//!   Refusals: no file, another capacity, a bad granularity; a resize while tracked.
//! - A write in flight when tracking starts (its iothread SIGSTOPped) is marked by the time
//!   TrackWrites is answered, and marked again once its completion is read, after the copy
//!   took the bit.
//! - `--drained`: a libblkio read does not complete until the admin Resume; then it does.

use std::path::{Path, PathBuf};
use std::time::Duration;

use blkplane_proto::v1::{
    frontend_request, frontend_response, FrontendStatus, ResizeRequest, StatsRequest,
    StatusRequest, TrackWrites,
};
use blkplane_proto::write_bitmap::{WriteBitmap, DEFAULT_GRANULARITY};
use blkplane_tests::*;

const MIB: u64 = 1 << 20;
const KIB: u64 = 1 << 10;
const CAPACITY: u64 = 64 * MIB;
const G: u64 = DEFAULT_GRANULARITY;

/// A frontend with an admin socket on a fresh raw image of [`CAPACITY`] bytes.
fn frontend(dir: &TempDir, extra: &[&str]) -> (Frontend, PathBuf) {
    let image = create_image(&dir.join("disk.img"), CAPACITY);
    let admin = dir.join("admin.sock");
    let mut args = vec!["--admin-socket", admin.to_str().unwrap()];
    args.extend_from_slice(extra);
    (Frontend::start(&image, &args), admin)
}

fn status(admin: &Path) -> FrontendStatus {
    match admin::call(admin, frontend_request::Request::Status(StatusRequest {})) {
        Ok(frontend_response::Response::Status(s)) => s,
        other => panic!("status: {other:?}"),
    }
}

/// Sends TrackWrites as blkplaned does: the bitmap's memfd along with the request.
fn track(
    admin: &Path,
    bitmap: Option<&WriteBitmap>,
    granularity_bytes: u64,
    capacity_bytes: u64,
) -> Result<(), String> {
    let request = frontend_request::Request::TrackWrites(TrackWrites {
        granularity_bytes,
        capacity_bytes,
    });
    match admin::call_with_file(admin, request, bitmap.map(WriteBitmap::file))? {
        frontend_response::Response::WritesTracked(_) => Ok(()),
        other => Err(format!("unexpected answer to TrackWrites: {other:?}")),
    }
}

fn start_tracking(admin: &Path, bitmap: &WriteBitmap) {
    track(
        admin,
        Some(bitmap),
        bitmap.granularity(),
        bitmap.capacity_bytes(),
    )
    .unwrap_or_else(|e| panic!("TrackWrites: {e}"));
}

/// Takes every word, as blkplaned's copy does, and returns the blocks that were set.
fn take_blocks(bitmap: &WriteBitmap) -> Vec<u64> {
    let mut blocks = Vec::new();
    for index in 0..bitmap.words() {
        let word = bitmap.take_word(index);
        for bit in 0..64 {
            if word & (1 << bit) != 0 {
                blocks.push(index as u64 * 64 + bit);
            }
        }
    }
    blocks
}

/// Makes every worker read its iothread's completions (a Stats request does), so that the
/// marks made when completions are read are there.
fn settle(admin: &Path) {
    match admin::call(admin, frontend_request::Request::Stats(StatsRequest {})) {
        Ok(frontend_response::Response::Stats(_)) => {}
        other => panic!("stats: {other:?}"),
    }
}

fn run(q: &mut IoQueue, op: Op, what: &str) {
    q.run(&op)
        .unwrap_or_else(|e| panic!("{what}: {}", client::errno_name(e)));
}

#[test]
fn writes_mark_their_blocks_until_tracking_stops() {
    let dir = TempDir::new("wtrack");
    let (fe, admin) = frontend(&dir, &["--num-queues", "2", "--iothreads", "2"]);
    assert!(!status(&admin).tracking_writes);
    let bitmap = WriteBitmap::create(CAPACITY, G).unwrap();
    assert_eq!((bitmap.blocks(), bitmap.words()), (1024, 16));

    // Refused, each with what is wrong; nothing is tracked after them.
    let refused = |result: Result<(), String>, what: &str| match result {
        Err(e) => assert!(e.contains(what), "expected {what:?}, got {e}"),
        Ok(()) => panic!("accepted; expected a refusal with {what:?}"),
    };
    refused(track(&admin, None, G, CAPACITY), "no bitmap file attached");
    refused(
        track(&admin, Some(&bitmap), G, CAPACITY / 2),
        "made for a disk of 33554432 bytes, but this disk has 67108864",
    );
    refused(
        track(&admin, Some(&bitmap), 1000, CAPACITY),
        "granularity 1000",
    );
    let small = WriteBitmap::create(CAPACITY / 2, G).unwrap();
    refused(
        track(&admin, Some(&small), G, CAPACITY),
        "needs 128 bytes but its file has 64",
    );
    assert!(!status(&admin).tracking_writes);

    start_tracking(&admin, &bitmap);
    assert!(status(&admin).tracking_writes);
    // The bitmap covers the capacity it was made for: the disk cannot grow meanwhile.
    let grow = frontend_request::Request::Resize(ResizeRequest {
        new_size_bytes: 2 * CAPACITY,
    });
    match admin::call(&admin, grow) {
        Err(e) => assert!(e.contains("stop tracking"), "{e}"),
        Ok(other) => panic!("resized while tracked: {other:?}"),
    }

    let opts = ClientOptions {
        num_queues: 2,
        ..Default::default()
    };
    let mut client = Client::connect_with(fe.socket(), &opts).unwrap_or_else(|e| panic!("{e}"));
    // Reads mark nothing.
    client.queue(0).read_at(0, 64 * KIB as usize).unwrap();
    client.queue(1).read_at(40 * MIB, 4096).unwrap();
    settle(&admin);
    assert_eq!(bitmap.count(), 0, "reads marked blocks");

    // 4 KiB inside block 16, on queue 0.
    client
        .queue(0)
        .write_at(MIB + 512, &pattern(1, 4096))
        .unwrap();
    // 128 KiB from 4 KiB before block 160: blocks 159, 160, 161, on queue 1 (the other worker).
    client
        .queue(1)
        .write_at(10 * MIB - 4 * KIB, &pattern(2, 128 * KIB as usize))
        .unwrap();
    // Write-zeroes of block 320, discard of blocks 480 and 481.
    run(
        client.queue(0),
        Op::WriteZeroes {
            offset: 20 * MIB,
            len: 64 * KIB,
            unmap: false,
        },
        "write-zeroes",
    );
    run(
        client.queue(1),
        Op::Discard {
            offset: 30 * MIB,
            len: 128 * KIB,
        },
        "discard",
    );
    settle(&admin);
    assert_eq!(take_blocks(&bitmap), [16, 159, 160, 161, 320, 480, 481]);
    assert_eq!(bitmap.count(), 0, "taken words are clear");
    // A block written again after its copy is marked again.
    client.queue(1).write_at(MIB, &pattern(3, 512)).unwrap();
    settle(&admin);
    assert_eq!(take_blocks(&bitmap), [16]);

    // Stopped: nothing is marked any more.
    track(&admin, None, 0, 0).unwrap();
    assert!(!status(&admin).tracking_writes);
    client
        .queue(0)
        .write_at(50 * MIB, &pattern(4, 4096))
        .unwrap();
    client.queue(1).write_at(MIB, &pattern(5, 4096)).unwrap();
    settle(&admin);
    assert_eq!(bitmap.count(), 0, "marked after tracking stopped");
    // And a new bitmap can be installed again.
    start_tracking(&admin, &bitmap);
    client
        .queue(0)
        .write_at(CAPACITY - 512, &pattern(6, 512))
        .unwrap();
    settle(&admin);
    assert_eq!(take_blocks(&bitmap), [1023]);
}

#[test]
fn a_write_in_flight_when_tracking_starts_is_marked_before_and_after_it_lands() {
    let dir = TempDir::new("wtflight");
    let (fe, admin) = frontend(&dir, &[]);
    let mut client = Client::connect(fe.socket()).unwrap_or_else(|e| panic!("{e}"));
    let iothread = fe.wait_iothreads(1, &[], Duration::from_secs(10))[0];
    // SAFETY: plain signal to a child process of the frontend.
    assert_eq!(unsafe { libc::kill(iothread as i32, libc::SIGSTOP) }, 0);
    let q = client.queue(0);
    q.buf()[..8192].copy_from_slice(&pattern(7, 8192));
    // 8 KiB across blocks 99 and 100.
    q.submit(
        &Op::Write {
            offset: 100 * G - 4096,
            buf: 0,
            len: 8192,
        },
        1,
    );
    assert!(q.wait(0).is_empty());
    // Popped by the worker and handed to the stopped iothread.
    let in_flight = wait_for(Duration::from_secs(10), || {
        let stats = admin::stats(&admin).unwrap();
        (stats.queues[0].in_flight == 1).then_some(())
    });
    assert!(in_flight.is_some(), "the write never reached the worker");

    let bitmap = WriteBitmap::create(CAPACITY, G).unwrap();
    start_tracking(&admin, &bitmap);
    // Answered once every worker marked what it has in flight.
    assert_eq!(
        take_blocks(&bitmap),
        [99, 100],
        "the write in flight is not marked"
    );
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(iothread as i32, libc::SIGCONT) }, 0);
    let done = q.wait(1);
    assert_eq!(done, [(1, 0)]);
    // The copy took the bits while the write was in flight: its completion marks them again.
    settle(&admin);
    assert_eq!(
        take_blocks(&bitmap),
        [99, 100],
        "the completed write is not marked again"
    );
}

#[test]
fn a_frontend_started_drained_serves_nothing_until_resume() {
    let dir = TempDir::new("wtdrained");
    let (fe, admin) = frontend(&dir, &["--drained"]);
    let s = status(&admin);
    assert!(s.drained, "{s:?}");
    // The VMM connects and starts its ring, but no request is served.
    let mut client = Client::connect(fe.socket()).unwrap_or_else(|e| panic!("{e}"));
    let q = client.queue(0);
    q.submit(
        &Op::Read {
            offset: 0,
            buf: 0,
            len: 4096,
        },
        1,
    );
    assert!(q.wait(0).is_empty());
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        q.wait(0).is_empty(),
        "a read completed on a drained frontend"
    );
    assert_eq!(admin::stats(&admin).unwrap().queues[0].in_flight, 0);

    admin::resume(&admin).unwrap();
    assert_eq!(q.wait(1), [(1, 0)]);
    assert!(!status(&admin).drained);
    q.read_at(4096, 4096).unwrap();
}
