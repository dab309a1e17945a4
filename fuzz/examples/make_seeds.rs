//! Writes the seed corpora `seeds/<target>/` from the unit tests' fixtures, encoded with the
//! targets' own input formats: `cargo run --example make_seeds` in `fuzz/` (after a change
//! of an input format; the seeds are committed).

use std::path::Path;

use blkplane_fuzz::{blk, inflight, ring, vhost, vring};

const NEXT: u16 = 1;
const WRITE: u16 = 2;
const INDIRECT: u16 = 4;
// virtio-blk request types.
const T_IN: u32 = 0;
const T_OUT: u32 = 1;
const T_FLUSH: u32 = 4;
const T_GET_ID: u32 = 8;
const T_DISCARD: u32 = 11;
const T_WRITE_ZEROES: u32 = 13;

fn main() -> std::io::Result<()> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("seeds");
    let sets = [
        ("virtio_blk_request", blk_seeds()),
        ("inflight_recovery", inflight_seeds()),
        ("ring_consumer", ring_seeds()),
        ("vhost_user_messages", vhost::seeds()),
        ("used_rings", vring_seeds()),
    ];
    for (target, seeds) in sets {
        let dir = root.join(target);
        std::fs::create_dir_all(&dir)?;
        for (name, bytes) in seeds {
            std::fs::write(dir.join(name), bytes)?;
        }
    }
    Ok(())
}

/// request.rs's tests: a 16-entry ring, the table at 0x1000, requests at 0x2000 on.
fn blk_seeds() -> Vec<(String, Vec<u8>)> {
    let ring = |flags| blk::Builder::new(flags, 0, 4, 0);
    let table = blk::DESC_TABLE;
    // A direct chain at descriptors 0.. published as head 0.
    let chain = |b: blk::Builder, descs: &[(u64, u32, u16)]| {
        let mut b = b;
        for (i, &(addr, len, flags)) in descs.iter().enumerate() {
            let last = i + 1 == descs.len();
            let flags = if last { flags } else { flags | NEXT };
            b = b.desc(table, i as u16, addr, len, flags, i as u16 + 1);
        }
        b.avail(16, 0, &[0]).finish()
    };
    let mut seeds = vec![
        (
            "read",
            chain(
                ring(0).header(0x2000, T_IN, 8),
                &[(0x2000, 16, 0), (0x3000, 4096, WRITE), (0x5000, 1, WRITE)],
            ),
        ),
        (
            "write_split_header_cross_region",
            chain(
                ring(0).header(0x2000, T_OUT, 0),
                &[
                    (0x2000, 8, 0),
                    (0x2008, 8, 0),
                    ((1 << 16) - 512, 1024, 0),
                    (0x5000, 1, WRITE),
                ],
            ),
        ),
        (
            "flush_read_only",
            chain(
                ring(blk::READ_ONLY).header(0x2000, T_FLUSH, 0),
                &[(0x2000, 16, 0), (0x5000, 1, WRITE)],
            ),
        ),
        (
            "write_read_only",
            chain(
                ring(blk::READ_ONLY).header(0x2000, T_OUT, 0),
                &[(0x2000, 16, 0), (0x3000, 512, 0), (0x5000, 1, WRITE)],
            ),
        ),
        (
            "get_id",
            chain(
                ring(0).header(0x2000, T_GET_ID, 0),
                &[(0x2000, 16, 0), (0x3000, 20, WRITE), (0x5000, 1, WRITE)],
            ),
        ),
        (
            "write_zeroes_two_ranges",
            chain(
                ring(blk::WRITETHROUGH)
                    .header(0x2000, T_WRITE_ZEROES, 0)
                    .range(0x2010, 8, 16, 1)
                    .range(0x2020, 100, 1, 0),
                &[(0x2000, 48, 0), (0x5000, 1, WRITE)],
            ),
        ),
        (
            "discard",
            chain(
                ring(0).header(0x2000, T_DISCARD, 0).range(0x2010, 0, 8, 0),
                &[(0x2000, 32, 0), (0x5000, 1, WRITE)],
            ),
        ),
        (
            "outside_memory",
            chain(
                ring(0).header(0x2000, T_IN, 0),
                &[(0x2000, 16, 0), (1 << 40, 512, WRITE), (0x5000, 1, WRITE)],
            ),
        ),
        (
            "wraps",
            chain(
                ring(0).header(0x2000, T_IN, 0),
                &[
                    (0x2000, 16, 0),
                    (u64::MAX - 100, 512, WRITE),
                    (0x5000, 1, WRITE),
                ],
            ),
        ),
        (
            "beyond_capacity",
            chain(
                ring(0).header(0x2000, T_IN, 2048),
                &[(0x2000, 16, 0), (0x3000, 512, WRITE), (0x5000, 1, WRITE)],
            ),
        ),
        (
            "unsupported_type",
            chain(
                ring(0).header(0x2000, 99, 0),
                &[(0x2000, 16, 0), (0x5000, 1, WRITE)],
            ),
        ),
        (
            "read_4k_blocks_event_idx",
            chain(
                blk::Builder::new(blk::BLOCK_4K | blk::EVENT_IDX, 2, 8, 0).header(0x2000, T_IN, 8),
                &[(0x2000, 16, 0), (0x3000, 4096, WRITE), (0x5000, 1, WRITE)],
            ),
        ),
    ];
    // indirect_table_is_followed.
    let ind = 0x8000;
    let indirect = ring(0)
        .header(0x2000, T_IN, 0)
        .desc(ind, 0, 0x2000, 16, NEXT, 1)
        .desc(ind, 1, 0x3000, 512, WRITE | NEXT, 2)
        .desc(ind, 2, 0x5000, 1, WRITE, 0)
        .desc(table, 3, ind, 48, INDIRECT, 0)
        .avail(16, 0, &[3])
        .finish();
    seeds.push(("indirect", indirect));
    // chain_rules: a loop, and an indirect table inside an indirect table.
    let looped = ring(0)
        .desc(table, 0, 0x2000, 16, NEXT, 0)
        .avail(16, 0, &[0])
        .finish();
    seeds.push(("loop", looped));
    let nested = ring(0)
        .desc(ind, 0, 0x9000, 16, INDIRECT, 0)
        .desc(table, 1, ind, 16, INDIRECT, 0)
        .avail(16, 0, &[1])
        .finish();
    seeds.push(("nested_indirect", nested));
    // too_many_segments: every buffer straddles the region boundary.
    let mut straddle = ring(0)
        .header(0x2000, T_IN, 0)
        .desc(table, 0, 0x2000, 16, NEXT, 1);
    for i in 1..14u16 {
        straddle = straddle.desc(table, i, (1 << 16) - 256, 512, WRITE | NEXT, i + 1);
    }
    let straddle = straddle
        .desc(table, 14, 0x5000, 1, WRITE, 0)
        .avail(16, 0, &[0])
        .finish();
    seeds.push(("straddling_buffers", straddle));
    // worker.rs's tests: heads in order, an avail index a queue ahead, a head outside.
    seeds.push(("two_heads", ring(0).avail(16, 0, &[5, 3]).finish()));
    let ahead = ring(0)
        .patch((blk::AVAIL_RING + 2) as u32, &17u16.to_le_bytes())
        .finish();
    seeds.push(("avail_a_queue_ahead", ahead));
    seeds.push(("head_outside", ring(0).avail(16, 0, &[40]).finish()));
    // A used ring on the avail ring, one request behind: each used entry would publish
    // another (refused at ring start, see vhost_user.rs's used_ring_overlap).
    let spin = blk::Builder::new(blk::USED_ON_AVAIL, 0, 4, 0)
        .patch((blk::AVAIL_RING + 2) as u32, &1u16.to_le_bytes())
        .finish();
    seeds.push(("used_ring_on_avail_ring", spin));
    seeds
        .into_iter()
        .map(|(name, bytes)| (name.to_string(), bytes))
        .collect()
}

/// inflight.rs's tests: fresh regions, a crash with requests in flight, a crash inside a
/// batch, hostile heads and versions.
fn inflight_seeds() -> Vec<(String, Vec<u8>)> {
    // One queue region of `entries` entries with the given header and marked heads.
    let region = |entries: u16, version: u16, last: u16, used: u16, marked: &[(u16, u16, u64)]| {
        let size = 16 + 16 * usize::from(entries);
        let mut bytes = vec![0u8; size.div_ceil(64) * 64];
        bytes[8..10].copy_from_slice(&version.to_ne_bytes());
        bytes[10..12].copy_from_slice(&entries.to_ne_bytes());
        bytes[12..14].copy_from_slice(&last.to_ne_bytes());
        bytes[14..16].copy_from_slice(&used.to_ne_bytes());
        for &(head, next, counter) in marked {
            let at = 16 + 16 * usize::from(head);
            bytes[at] = 1;
            bytes[at + 6..at + 8].copy_from_slice(&next.to_ne_bytes());
            bytes[at + 8..at + 16].copy_from_slice(&counter.to_ne_bytes());
        }
        bytes
    };
    let input = |queue_size, ring_size, used_idx, avail_idx, file, contents: &[u8]| {
        inflight::Input {
            num_queues: 1,
            queue_size,
            queue: 0,
            ring_size,
            used_idx,
            avail_idx,
            file,
            contents,
        }
        .encode()
    };
    let in_flight = region(16, 1, 0, 5, &[(3, 0, 7), (9, 0, 5), (1, 0, 6)]);
    let batch = region(16, 1, 4, 5, &[(4, 2, 1), (2, 0, 0), (7, 0, 2)]);
    let hostile = region(
        16,
        1,
        15,
        0,
        &[(15, 15, u64::MAX), (0, 3, u64::MAX), (3, 0, 0)],
    );
    let bad_version = region(16, 7, 0, 0, &[]);
    let wrong_desc_num = {
        let mut r = region(16, 1, 0, 2, &[(1, 0, 1)]);
        r[10..12].copy_from_slice(&3u16.to_ne_bytes());
        r
    };
    vec![
        ("fresh".into(), input(16, 16, 0, 0, 0, &[])),
        (
            "fresh_offset_larger".into(),
            input(256, 256, 9, 9, inflight::LARGER | inflight::OFFSET, &[]),
        ),
        ("in_flight".into(), input(16, 16, 5, 8, 0, &in_flight)),
        ("repaired_batch".into(), input(16, 16, 7, 8, 0, &batch)),
        ("hostile_heads".into(), input(16, 8, 2, 4, 0, &hostile)),
        ("bad_version".into(), input(16, 16, 0, 0, 0, &bad_version)),
        (
            "wrong_desc_num".into(),
            input(16, 16, 2, 3, 0, &wrong_desc_num),
        ),
        ("ring_too_large".into(), input(8, 16, 0, 0, 0, &[])),
        (
            "unsealed".into(),
            input(16, 16, 0, 0, inflight::UNSEALED, &[]),
        ),
        ("short".into(), input(16, 16, 0, 0, inflight::SHORT, &[])),
    ]
}

/// ring.rs's and the iothread's request.rs tests: valid requests of each opcode in a slot,
/// published on the submission queue; completions; a hostile producer index; a bad slot.
fn ring_seeds() -> Vec<(String, Vec<u8>)> {
    use blkplane_proto::ring::{RingLayout, HEADER_SIZE};
    let layout = RingLayout::new(8, 4).expect("layout");
    let sq = layout.sq_offset;
    let cq = layout.cq_offset;
    let slot_at = |slot: u64| layout.slots_offset + slot * layout.slot_stride;
    let u32s = |values: &[u32]| {
        values
            .iter()
            .flat_map(|v| v.to_ne_bytes())
            .collect::<Vec<u8>>()
    };
    // A slot: header (opcode, flags, image offset, segment count, reserved), then segments
    // (offset, len, aux).
    let slot = |opcode: u32, flags: u32, image_offset: u64, segments: &[(u64, u32, u32)]| {
        let mut b = Vec::new();
        b.extend_from_slice(&opcode.to_ne_bytes());
        b.extend_from_slice(&flags.to_ne_bytes());
        b.extend_from_slice(&image_offset.to_ne_bytes());
        b.extend_from_slice(&(segments.len() as u32).to_ne_bytes());
        b.extend_from_slice(&0u32.to_ne_bytes());
        for &(offset, len, aux) in segments {
            b.extend_from_slice(&offset.to_ne_bytes());
            b.extend_from_slice(&len.to_ne_bytes());
            b.extend_from_slice(&aux.to_ne_bytes());
        }
        b
    };
    let submit = |slots: &[u32]| -> Vec<(u32, Vec<u8>)> {
        vec![
            ((sq + 192) as u32, u32s(slots)),
            (sq as u32, u32s(&[slots.len() as u32])),
        ]
    };
    let input = |mode: u8, results: Vec<i32>, pushes: u8, patches: Vec<(u32, Vec<u8>)>| {
        let patches: Vec<(u32, &[u8])> = patches.iter().map(|(o, b)| (*o, b.as_slice())).collect();
        ring::Input {
            slot_count: 8,
            segments_per_slot: 4,
            mode,
            image_size: 1 << 20,
            results,
            pushes,
            patches,
        }
        .encode()
    };
    let requests = |mode: u8, results: Vec<i32>| {
        let mut patches = vec![
            (
                slot_at(0) as u32,
                slot(1, 0, 4096, &[(0, 512, 0), (0, 1024, 1)]),
            ),
            (slot_at(1) as u32, slot(2, 1, 0, &[(8192, 4096, 0)])),
            (slot_at(2) as u32, slot(3, 0, 0, &[])),
            (
                slot_at(3) as u32,
                slot(4, 0, 0, &[(0, 4096, 0), (8192, 512, 0)]),
            ),
            (
                slot_at(5) as u32,
                slot(5, 0, 4096, &[(0, 4096, 1), (1 << 19, 0, 0)]),
            ),
        ];
        patches.extend(submit(&[0, 1, 2, 3, 5]));
        input(mode, results, 2, patches)
    };
    let completions = {
        let mut patches = vec![((cq + 192) as u32, u32s(&[5, 0, 3, 1]))];
        patches.push((cq as u32, u32s(&[2])));
        input(0, vec![], 8, patches)
    };
    let overrun = input(0, vec![], 0, vec![(sq as u32, u32s(&[1000]))]);
    let bad_slot = input(0, vec![], 0, submit(&[99]));
    let bad_header = input(
        0,
        vec![],
        0,
        vec![(8, u32s(&[9])), (HEADER_SIZE as u32, vec![])],
    );
    vec![
        ("null_requests".into(), requests(0, vec![])),
        (
            "file_requests_short_eagain_einval_eopnotsupp".into(),
            requests(
                ring::FILE_IMAGE | ring::DIRECT,
                vec![100, -11, 412, -22, 1024, 4096, 0, -95, 0, -4, 0],
            ),
        ),
        ("completions".into(), completions),
        ("overrun".into(), overrun),
        ("bad_slot".into(), bad_slot),
        ("bad_header".into(), bad_header),
    ]
}

/// iothread/src/vring.rs's tests: a ring of 8 with its avail ring 0x1000 and its used ring
/// 0x2000 into the low region, each request's status byte at 0x3000 + head and its read data
/// at 0x5000 — a batch with statuses, interrupt suppression with and without EVENT_IDX, the
/// dirty log, hostile slots and rings — and what the engine adds: more completions than the
/// ring holds, a wrapping used index, memory tables that drop, move or misalign a ring and
/// back, rings of two queues overlapping, a driver writing the used ring, hostile log sizes.
fn vring_seeds() -> Vec<(String, Vec<u8>)> {
    use blkplane_proto::control::{QueueSpec, QUEUE_FLAG_CALL, QUEUE_FLAG_EVENT_IDX};
    use blkplane_proto::ring::{Opcode, Segment};
    use vring::{Complete, Field, Op, HIGH, LOW};
    const SIZE: u16 = 8;
    const OK: u32 = 0;
    const IOERR: u32 = 1;
    let (avail, used, status, data) = (LOW + 0x1000, LOW + 0x2000, LOW + 0x3000, LOW + 0x5000);
    let spec = |queue, flags, avail_addr, used_addr, next_used| QueueSpec {
        queue,
        size: SIZE,
        flags,
        avail_addr,
        used_addr,
        next_used,
        inflight_queue: 0,
        inflight_queues: 1,
        inflight_size: SIZE,
        inflight_offset: 0,
    };
    let start = |queue, flags| Op::Start(spec(queue, flags | QUEUE_FLAG_CALL, avail, used, 0));
    // The fixture's `finish`: slot `head`, its data segment, the status byte in region 0.
    let finish = |queue: u16, head: u16, opcode: Opcode, result: u32| {
        let slot = u32::from(head) % vring::SLOTS;
        vec![
            Op::Segment {
                slot,
                index: 0,
                segment: Segment {
                    offset: data - LOW,
                    len: 4096,
                    aux: 0,
                },
            },
            Op::Complete(Complete {
                slot,
                opcode: opcode as u32,
                queue,
                head,
                status_region: 0,
                status_offset: status - LOW + u64::from(head),
                used_len: 4097,
                segment_count: 1,
                status: result,
            }),
        ]
    };
    let flush = |queue, head| finish(queue, head, Opcode::Flush, OK);
    let publish = || vec![Op::Publish([None, None])];
    let driver = |field, value| {
        vec![Op::Driver {
            queue: 0,
            field,
            value,
        }]
    };
    let seed = |table: usize, steps: Vec<Vec<Op<'static>>>| {
        vring::Input {
            table,
            ops: steps.into_iter().flatten().collect(),
        }
        .encode()
    };

    let batch = seed(
        0,
        vec![
            vec![start(0, 0)],
            finish(0, 5, Opcode::Read, OK),
            finish(0, 2, Opcode::Write, IOERR),
            publish(),
            publish(),
        ],
    );
    let no_interrupt = seed(
        0,
        vec![
            vec![start(0, 0)],
            flush(0, 0),
            publish(),
            driver(Field::AvailFlags, 1),
            flush(0, 1),
            publish(),
            driver(Field::AvailFlags, 0),
            flush(0, 2),
            publish(),
        ],
    );
    let event_idx = seed(
        0,
        vec![
            vec![start(0, QUEUE_FLAG_EVENT_IDX)],
            flush(0, 0),
            publish(),
            driver(Field::UsedEvent, 3),
            flush(0, 1),
            publish(),
            flush(0, 2),
            flush(0, 3),
            publish(),
        ],
    );
    let dirty_log = seed(
        0,
        vec![
            vec![Op::DirtyLog(Some((64, 0))), start(0, 0)],
            finish(0, 4, Opcode::Read, OK),
            finish(0, 6, Opcode::Write, OK),
            publish(),
            // SetDirtyLog while a batch is published: after the record, after the fence.
            finish(0, 1, Opcode::Read, OK),
            vec![Op::Publish([Some(None), Some(Some((32, 100)))])],
            finish(0, 3, Opcode::Read, OK),
            vec![Op::Publish([Some(Some((16, 0))), None])],
            vec![Op::DirtyLog(None)],
            finish(0, 7, Opcode::Read, OK),
            publish(),
        ],
    );
    let hostile_log = {
        let segment = |index, offset, len, aux| Op::Segment {
            slot: 0,
            index,
            segment: Segment { offset, len, aux },
        };
        seed(
            0,
            vec![vec![
                Op::DirtyLog(Some((0, 0))),
                Op::DirtyLog(Some((u64::MAX, 1))),
                Op::DirtyLog(Some((vring::LOG_LEN, 1))),
                Op::DirtyLog(Some((1, vring::LOG_LEN - 1))),
                start(0, 0),
                segment(0, u64::MAX, u32::MAX, 0),
                segment(1, 0x7fff, u32::MAX, 0),
                segment(2, 0, 4096, 1),
                segment(3, 0, 4096, 9),
                Op::Complete(Complete {
                    slot: 0,
                    opcode: Opcode::Read as u32,
                    queue: 0,
                    head: 0,
                    status_region: 1,
                    status_offset: 0x3fff,
                    used_len: 4097,
                    segment_count: u32::MAX,
                    status: OK,
                }),
                Op::Publish([None, None]),
            ]],
        )
    };
    let bad = |queue, head, status_region, status_offset| {
        vec![Op::Complete(Complete {
            slot: 0,
            opcode: Opcode::Write as u32,
            queue,
            head,
            status_region,
            status_offset,
            used_len: 9,
            segment_count: 0,
            status: OK,
        })]
    };
    let bad_slots = seed(
        0,
        vec![
            vec![start(0, 0)],
            // A queue never started, a head outside the ring, status bytes outside memory.
            bad(3, 1, 0, 0),
            bad(0, SIZE, 0, 0),
            bad(0, 1, 0, 0x8000),
            bad(0, 2, 7, 0),
            bad(0, u16::MAX, blkplane_proto::ring::NO_STATUS, 0),
            publish(),
            // Rings that do not lie in guest memory, misaligned, straddling the hole; sizes and
            // queue indices out of range.
            vec![
                Op::Start(spec(1, 0, avail, LOW + 0x8000 - 8, 0)),
                Op::Start(spec(1, 0, avail, used + 2, 0)),
                Op::Start(spec(1, 0, avail + 1, used, 0)),
                Op::Start(spec(1, 0, LOW + 0x7ffe, used, 0)),
                Op::Start(spec(1, 0, u64::MAX - 4, used, 0)),
                Op::Start(QueueSpec {
                    size: 0,
                    ..spec(1, 0, avail, used, 0)
                }),
                Op::Start(QueueSpec {
                    inflight_size: SIZE - 1,
                    ..spec(1, 0, avail, used, 0)
                }),
                Op::Start(spec(1024, 0, avail, used, 0)),
            ],
        ],
    );
    let overfull = {
        let mut steps = vec![vec![start(0, 0)]];
        for head in 0..SIZE + 2 {
            steps.push(flush(0, head % SIZE));
        }
        steps.push(publish());
        // Restarted just before the used index wraps; stopped with requests still to come.
        steps.push(vec![Op::Start(spec(
            0,
            QUEUE_FLAG_CALL | QUEUE_FLAG_EVENT_IDX,
            avail,
            used,
            u16::MAX - 2,
        ))]);
        for head in 0..SIZE {
            steps.push(flush(0, head));
        }
        steps.push(publish());
        steps.push(vec![Op::Stop(0)]);
        steps.push(flush(0, 1));
        steps.push(publish());
        seed(0, steps)
    };
    let calls = seed(
        0,
        vec![
            vec![Op::Start(spec(0, 0, avail, used, 0))],
            flush(0, 0),
            publish(),
            vec![Op::SetCall {
                queue: 0,
                call: true,
            }],
            flush(0, 1),
            publish(),
            vec![
                Op::SetCall {
                    queue: 0,
                    call: false,
                },
                Op::SetCall {
                    queue: 5,
                    call: true,
                },
            ],
            flush(0, 2),
            publish(),
        ],
    );
    // Queue 0's used ring in the low region, queue 1's in the high one: remapped to a table
    // without the high region, back, to one where it is misaligned and the low one moved, to
    // an empty table, back.
    let remap = {
        let high = Op::Start(spec(1, QUEUE_FLAG_CALL, HIGH + 0x1000, HIGH + 0x2000, 0));
        let both = |head| [flush(0, head), flush(1, head)].concat();
        seed(
            0,
            vec![
                vec![start(0, 0), high],
                both(0),
                publish(),
                vec![Op::Remap(1)],
                both(1),
                publish(),
                vec![Op::Remap(0)],
                both(2),
                publish(),
                vec![Op::Remap(2)],
                both(3),
                publish(),
                vec![Op::Remap(3)],
                both(4),
                publish(),
                vec![Op::Remap(0)],
                both(5),
                publish(),
            ],
        )
    };
    let overlapping = seed(
        0,
        vec![
            vec![
                start(0, 0),
                Op::Start(spec(1, QUEUE_FLAG_CALL, avail, used + 8, 0)),
                // Queue 2's used ring on queue 0's avail ring.
                Op::Start(spec(2, QUEUE_FLAG_CALL, avail + 0x100, avail, 0)),
            ],
            flush(0, 0),
            flush(1, 1),
            flush(2, 2),
            flush(0, 3),
            publish(),
        ],
    );
    let scribbles = seed(
        0,
        vec![
            vec![start(0, QUEUE_FLAG_EVENT_IDX)],
            flush(0, 0),
            publish(),
            vec![Op::Patch {
                offset: used - LOW,
                bytes: &[0xff; 16],
            }],
            driver(Field::UsedIdx, 7),
            driver(Field::UsedEvent, 0),
            flush(0, 1),
            publish(),
        ],
    );
    vec![
        ("batch_with_statuses".into(), batch),
        ("no_interrupt".into(), no_interrupt),
        ("event_idx".into(), event_idx),
        ("dirty_log".into(), dirty_log),
        ("hostile_log_and_segments".into(), hostile_log),
        ("bad_slots_and_rings".into(), bad_slots),
        ("more_than_a_ring_then_wrap_and_stop".into(), overfull),
        ("set_call".into(), calls),
        ("remap_away_and_back".into(), remap),
        ("overlapping_rings".into(), overlapping),
        ("driver_writes_used_ring".into(), scribbles),
    ]
}
