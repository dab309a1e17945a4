//! The iothread is the only writer of the used ring: requests it executes and the frontend's
//! own answers (rejected chains, GET_ID, requests of no data) reach the guest through one
//! writer, each exactly once. A raw front-end puts batches that mix all of them — and hostile
//! chains (descriptor loops, no status byte) — on one ring at once, repeatedly, killing the
//! iothread in the middle of some batches; every head must come back exactly once with the
//! right status, length and data, and nothing more may appear on the ring. Two writers of one
//! used ring would lose or duplicate entries here: each would put its entries at the used index
//! it knows and move the index past them.

use std::collections::BTreeMap;
use std::time::Duration;

use blkplane_tests::raw::{blk_header, Desc, RawDevice, F_NEXT, F_WRITE};
use blkplane_tests::*;
use virtio_bindings::virtio_blk::*;

const MIB: u64 = 1 << 20;
const IMAGE_SIZE: u64 = 8 * MIB;
const QUEUE_SIZE: u16 = 256;
const SERIAL: &str = "bp-one-writer";
/// Requests per batch: three descriptors each, so the batch fills most of the table.
const BATCH: u16 = 60;
const ROUNDS: u32 = 120;
const DATA: u32 = 4096;
const STATUS_UNTOUCHED: u8 = 0xee;

/// What a request of the batch is, and so what it must complete with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// A 4 KiB read, executed by the iothread.
    Read,
    /// A 4 KiB write, executed by the iothread.
    Write,
    /// GET_ID, answered by the frontend.
    GetId,
    /// An unknown request type: UNSUPP from the frontend.
    Unknown,
    /// A read past the end of the disk: IOERR from the frontend.
    PastEnd,
    /// A chain whose descriptors loop: used length 0, no status.
    Loop,
    /// A chain without a device-writable status byte: used length 0.
    NoStatus,
}

const KINDS: [Kind; 7] = [
    Kind::Read,
    Kind::GetId,
    Kind::Write,
    Kind::Unknown,
    Kind::PastEnd,
    Kind::Loop,
    Kind::NoStatus,
];

struct Buffers {
    header: u64,
    data: u64,
    status: u64,
}

#[test]
fn every_head_is_used_exactly_once_through_one_writer() {
    let dir = TempDir::new("one-writer");
    let image = create_random_image(&dir.join("disk.img"), IMAGE_SIZE, 77);
    let fe = Frontend::start(&image, &["--serial", SERIAL]);
    let mut dev = RawDevice::connect(fe.socket(), 1, QUEUE_SIZE).unwrap();
    let buffers: Vec<Buffers> = (0..BATCH)
        .map(|_| Buffers {
            header: dev.alloc_static(16),
            data: dev.alloc_static(u64::from(DATA)),
            status: dev.alloc_static(1),
        })
        .collect();
    let capacity = IMAGE_SIZE / 512;
    let mut killed = Vec::new();
    let mut expected_used = dev.used_index(0);
    for round in 0..ROUNDS {
        let mut descs = Vec::new();
        let mut heads = Vec::new();
        let mut plan = BTreeMap::new();
        for i in 0..BATCH {
            let kind = KINDS[usize::from(i + round as u16) % KINDS.len()];
            let b = &buffers[usize::from(i)];
            let head = 3 * i;
            // Reads from the first half, writes to the second: the reads' data stays known.
            let sector = u64::from((round * 7 + u32::from(i)) % 1024) * 8;
            let (type_, sector) = match kind {
                Kind::Read | Kind::Loop | Kind::NoStatus => (VIRTIO_BLK_T_IN, sector),
                Kind::Write => (VIRTIO_BLK_T_OUT, capacity / 2 + sector),
                Kind::GetId => (VIRTIO_BLK_T_GET_ID, 0),
                Kind::Unknown => (0xff, 0),
                Kind::PastEnd => (VIRTIO_BLK_T_IN, capacity),
            };
            dev.mem.write(b.header, &blk_header(type_, sector));
            dev.mem.fill(b.data, DATA as usize, 0x5a);
            dev.mem.write(b.status, &[STATUS_UNTOUCHED]);
            if kind == Kind::Write {
                dev.mem
                    .write(b.data, &pattern(u64::from(round), DATA as usize));
            }
            let data_flags = match kind {
                Kind::Write | Kind::NoStatus => 0,
                _ => F_WRITE,
            };
            let data_len = if kind == Kind::GetId {
                VIRTIO_BLK_ID_BYTES
            } else {
                DATA
            };
            descs.push((
                head,
                Desc {
                    addr: b.header,
                    len: 16,
                    flags: F_NEXT,
                    // A loop: the header points back at itself.
                    next: if kind == Kind::Loop { head } else { head + 1 },
                },
            ));
            descs.push((
                head + 1,
                Desc {
                    addr: b.data,
                    len: data_len,
                    flags: data_flags | F_NEXT,
                    next: head + 2,
                },
            ));
            descs.push((
                head + 2,
                Desc {
                    addr: b.status,
                    len: 1,
                    // Without F_WRITE there is no status byte the device may write.
                    flags: if kind == Kind::NoStatus { 0 } else { F_WRITE },
                    next: 0,
                },
            ));
            heads.push(head);
            plan.insert(head, (kind, sector));
        }
        dev.post_batch(0, &descs, &heads);
        if round % 30 == 17 {
            // The iothread dies with the batch in flight: its successor completes what it had
            // not put on the used ring, and nothing twice.
            let pid = fe.wait_iothreads(1, &killed, Duration::from_secs(10))[0];
            // SAFETY: plain signal to a process of the frontend under test.
            assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGKILL) }, 0);
            killed.push(pid);
        }
        let mut seen = BTreeMap::new();
        for _ in 0..BATCH {
            let used = dev
                .wait_used(0, Duration::from_secs(20))
                .unwrap_or_else(|| {
                    panic!(
                        "round {round}: {} of {BATCH} used entries, then none",
                        seen.len()
                    )
                });
            let head = u16::try_from(used.id).expect("a head of the table");
            assert!(
                seen.insert(head, used.len).is_none(),
                "round {round}: head {head} used twice"
            );
        }
        expected_used = expected_used.wrapping_add(BATCH);
        assert_eq!(
            dev.used_index(0),
            expected_used,
            "round {round}: used index"
        );
        for (head, (kind, sector)) in &plan {
            let len = *seen
                .get(head)
                .unwrap_or_else(|| panic!("round {round}: head {head} ({kind:?}) never used"));
            let b = &buffers[usize::from(head / 3)];
            let status = dev.mem.read(b.status, 1)[0];
            let what = format!("round {round}, head {head}, {kind:?}");
            match kind {
                Kind::Read => {
                    assert_eq!((status, len), (VIRTIO_BLK_S_OK as u8, DATA + 1), "{what}");
                    assert_same_data(
                        &what,
                        &dev.mem.read(b.data, DATA as usize),
                        &read_file_at(&image, sector * 512, DATA as usize),
                    );
                }
                Kind::Write => assert_eq!((status, len), (VIRTIO_BLK_S_OK as u8, 1), "{what}"),
                Kind::GetId => {
                    assert_eq!(status, VIRTIO_BLK_S_OK as u8, "{what}");
                    assert_eq!(len, VIRTIO_BLK_ID_BYTES + 1, "{what}");
                    let id = dev.mem.read(b.data, SERIAL.len());
                    assert_eq!(id, SERIAL.as_bytes(), "{what}");
                }
                Kind::Unknown => {
                    assert_eq!((status, len), (VIRTIO_BLK_S_UNSUPP as u8, 1), "{what}")
                }
                Kind::PastEnd => {
                    assert_eq!((status, len), (VIRTIO_BLK_S_IOERR as u8, 1), "{what}")
                }
                Kind::Loop | Kind::NoStatus => {
                    assert_eq!((status, len), (STATUS_UNTOUCHED, 0), "{what}")
                }
            }
        }
    }
    // Nothing more comes: no head was put on the ring twice, not even late.
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        dev.used_index(0),
        expected_used,
        "entries after the last batch"
    );
    assert!(killed.len() >= 3, "iothreads killed: {killed:?}");
    let stderr = fe.stderr();
    assert!(
        stderr.contains("resubmitted"),
        "the iothread's successor resubmitted nothing:\n{stderr}"
    );
    // The writes landed: the last round's pattern at each write's sector.
    dev.assert_alive(0, "after the batches");
}
