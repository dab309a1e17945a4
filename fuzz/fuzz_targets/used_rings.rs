//! The iothread's writer of the guest's used rings (`blkplane_iothread::vring::UsedRings`) over
//! what a hostile frontend tells it and a hostile driver does to guest memory, called as
//! `engine.rs` calls it: `start` for StartQueue (with the queue's inflight tracker and call
//! eventfd), `complete` for every finished slot (its `UsedTarget::from_header`, the status,
//! the read segments to mark), the publish in the engine's order — `record`, (the completions
//! published, a SetDirtyLog the log epoch announces), `publish_indices`, a full fence, (another
//! SetDirtyLog), `finish` — and the control messages only after a publish, as the engine's
//! loop handles them: `stop`, `set_call`, `set_dirty_log` (`DirtyLog::new` of hostile sizes),
//! `remap` for SetMemoryTable (the engine holds it until nothing is in flight). Between steps
//! the frontend rewrites slot segments and the driver writes guest memory.
//!
//! The harness keeps a model of guest memory, of each queue and of the dirty log, from the
//! rules vring.rs documents, and checks after every step:
//!
//! - guest memory is exactly the model: a status byte is written where its (region, offset)
//!   lies in the current table, for a started queue only; a publish writes, for each queue
//!   with an accepted completion whose rings lie (aligned) in the current table, one used
//!   element per accepted completion (head < ring size, at most a ring's worth per batch) at
//!   the ring positions after the previous used index, then the used index; nothing else,
//!   and nothing for a queue whose rings are not mapped (a byte two queues' rings both wrote
//!   holds one of their values, in whatever order the queues were published);
//! - `start` succeeds exactly when the queue index, the ring size (1..=inflight_size) and both
//!   rings (inside one region each, avail 2- and used 4-byte aligned) are valid; `set_call`
//!   exactly for a started queue;
//! - `next_used` is the model's (advanced by the accepted completions only, so by at most the
//!   ring size per publish), `None` for a queue not started; after a publish the used index
//!   in guest memory equals it;
//! - the call eventfd is signalled once for the first batch after a start, then as
//!   VRING_AVAIL_F_NO_INTERRUPT or (EVENT_IDX) `vring_need_event` on `used_event` say, never
//!   for a queue that published nothing;
//! - the inflight region no longer marks a published head and records the used index;
//! - with a dirty log on when the batch finishes, exactly the pages of the batch's status
//!   bytes, read segments (from the slot table as it is then) and mapped used rings are marked,
//!   those inside the bitmap only, nothing else in the log's file.
//!
//! Input format: `blkplane_fuzz::vring`.

#![no_main]

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::io::Read;
use std::os::fd::FromRawFd;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{fence, Ordering};
use std::sync::Arc;

use blkplane_fuzz::vring::{self, Complete, DirtyLogChange, Field, Input, Op};
use blkplane_iothread::memory::MemoryTable;
use blkplane_iothread::request::UsedTarget;
use blkplane_iothread::vring::{UsedRings, MAX_QUEUES};
use blkplane_proto::control::{MemoryRegionSpec, QueueSpec, QUEUE_FLAG_CALL, QUEUE_FLAG_EVENT_IDX};
use blkplane_proto::dirty_log::{DirtyLog, LOG_PAGE_SIZE};
use blkplane_proto::inflight::{InflightRegion, Limits, QueueInflight};
use blkplane_proto::ring::{Opcode, Segment, SharedRing, SlotHeader, SlotTable};
use libfuzzer_sys::fuzz_target;
use virtio_bindings::virtio_ring::VRING_AVAIL_F_NO_INTERRUPT;

const GUEST_LEN: usize = vring::GUEST_LEN as usize;
const LOG_LEN: usize = vring::LOG_LEN as usize;
static ZEROS: [u8; GUEST_LEN] = [0; GUEST_LEN];

/// What stays across executions (mapping it per run would dominate the run): guest memory and
/// every memory table of it, the dirty log's file, the ring's slot table. The tables all map
/// the one memfd, so a write through a stale mapping after a swap lands where the model
/// expects nothing and is caught, although the old table stays mapped.
struct Fixture {
    guest: File,
    tables: Vec<MemoryTable>,
    log: File,
    ring: SharedRing,
}

fn fixture() -> Fixture {
    let guest = blkplane_fuzz::memfd(c"fuzz-guest", vring::GUEST_LEN).expect("memfd");
    let tables = vring::TABLES
        .iter()
        .map(|regions| {
            let specs: Vec<MemoryRegionSpec> = regions
                .iter()
                .map(|&(guest_addr, size, mmap_offset)| MemoryRegionSpec {
                    size,
                    mmap_offset,
                    guest_addr,
                })
                .collect();
            let files: Vec<File> = specs
                .iter()
                .map(|_| guest.try_clone().expect("dup"))
                .collect();
            MemoryTable::map(&specs, &files).expect("map guest memory")
        })
        .collect();
    Fixture {
        guest,
        tables,
        log: blkplane_fuzz::memfd(c"fuzz-log", vring::LOG_LEN).expect("memfd"),
        ring: SharedRing::create(vring::SLOTS, vring::SEGMENTS).expect("ring"),
    }
}

thread_local! {
    static FIXTURE: Fixture = fixture();
}

fuzz_target!(|data: &[u8]| {
    let input = Input::decode(data);
    FIXTURE.with(|f| run(f, &input));
});

fn run(f: &Fixture, input: &Input) {
    f.guest
        .write_all_at(&ZEROS, 0)
        .expect("clearing guest memory");
    f.log
        .write_all_at(&ZEROS[..LOG_LEN], 0)
        .expect("clearing the log");
    let slots = f.ring.slots();
    for slot in 0..vring::SLOTS {
        for index in 0..vring::SEGMENTS {
            slots
                .set_segment(slot, index, Segment::default())
                .expect("clearing a segment");
        }
    }
    let mut run = Run {
        f,
        slots,
        rings: UsedRings::default(),
        table: input.table,
        queues: BTreeMap::new(),
        named: BTreeSet::new(),
        guest: vec![0; GUEST_LEN],
        segments: [[Segment::default(); vring::SEGMENTS as usize]; vring::SLOTS as usize],
        log: None,
        pending: false,
    };
    for op in &input.ops {
        run.step(op);
    }
    // The engine publishes what completed before it goes to sleep.
    run.publish_pending();
}

/// A request in a queue's batch, as the model has it.
struct Entry {
    head: u16,
    used_len: u32,
    slot: u32,
    read_segments: u32,
    /// Guest-physical address of its status byte, if one was written.
    status_gpa: Option<u64>,
}

/// A started queue, as the model has it.
struct Queue {
    spec: QueueSpec,
    /// Offsets of the avail and used rings in the guest memfd while they lie (aligned) in the
    /// current table.
    rings: Option<(usize, usize)>,
    next_used: u16,
    signalled_once: bool,
    /// Our end of its call eventfd.
    call: Option<File>,
    /// The frontend's tracker of the same inflight region (marks heads as it takes them).
    marker: QueueInflight,
    batch: Vec<Entry>,
}

struct Run<'a> {
    f: &'a Fixture,
    slots: SlotTable,
    rings: UsedRings,
    /// The current memory table: index into `vring::TABLES`.
    table: usize,
    queues: BTreeMap<u16, Queue>,
    /// Every queue index an operation named (for the `next_used` check).
    named: BTreeSet<u16>,
    /// What guest memory must hold.
    guest: Vec<u8>,
    /// What the slot table's segments hold.
    segments: [[Segment; vring::SEGMENTS as usize]; vring::SLOTS as usize],
    /// The dirty log in force: (size, offset).
    log: Option<(u64, u64)>,
    /// Whether a completion was pushed since the last publish (the engine publishes then).
    pending: bool,
}

fn eventfd() -> File {
    // SAFETY: plain syscall; the result is checked.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
    assert!(fd >= 0, "eventfd");
    // SAFETY: a fresh fd owned by nobody else.
    unsafe { File::from_raw_fd(fd) }
}

/// Signals an eventfd received since it was last read.
fn signals(call: &File) -> u64 {
    let mut b = [0u8; 8];
    match (&*call).read(&mut b) {
        Ok(8) => u64::from_ne_bytes(b),
        _ => 0,
    }
}

/// Where `len` bytes at guest-physical `addr` lie in the guest memfd under `table`: in the
/// first region that holds them all, as `MemoryTable::translate` finds them.
fn translate(table: usize, addr: u64, len: u64) -> Option<usize> {
    vring::TABLES[table]
        .iter()
        .find_map(|&(gpa, size, offset)| {
            let at = addr.checked_sub(gpa)?;
            (at.checked_add(len)? <= size).then(|| (offset + at) as usize)
        })
}

/// Region `index` of `table`: (guest address, size, memfd offset).
fn region(table: usize, index: u32) -> Option<(u64, u64, u64)> {
    vring::TABLES[table].get(index as usize).copied()
}

/// Where a queue's avail and used rings lie in the guest memfd, if `UsedRings` may use them
/// under `table`. A mapping starts at a page boundary of the memfd, so a ring's alignment in
/// this process is its memfd offset's.
fn rings_at(table: usize, spec: &QueueSpec) -> Option<(usize, usize)> {
    let size = u64::from(spec.size);
    let avail = translate(table, spec.avail_addr, 2 * size + 6).filter(|o| o % 2 == 0)?;
    let used = translate(table, spec.used_addr, 8 * size + 6).filter(|o| o % 4 == 0)?;
    Some((avail, used))
}

fn u16_at(memory: &[u8], offset: usize) -> u16 {
    u16::from_le_bytes([memory[offset], memory[offset + 1]])
}

impl Run<'_> {
    fn step(&mut self, op: &Op) {
        match op {
            Op::Start(spec) => self.start(*spec),
            Op::Complete(c) => self.complete(c),
            Op::Segment {
                slot,
                index,
                segment,
            } => {
                self.slots
                    .set_segment(*slot, *index, *segment)
                    .expect("a segment inside the table");
                self.segments[*slot as usize][*index as usize] = *segment;
            }
            Op::Publish(changes) => {
                if self.pending {
                    self.publish(*changes);
                } else {
                    // Nothing to publish: the engine reads the messages as usual.
                    for change in changes.iter().flatten() {
                        self.set_dirty_log(*change);
                    }
                }
            }
            Op::Remap(table) => {
                self.publish_pending();
                self.table = *table;
                self.rings.remap(&self.f.tables[self.table]);
                for queue in self.queues.values_mut() {
                    queue.rings = rings_at(*table, &queue.spec);
                }
            }
            Op::Stop(queue) => {
                self.publish_pending();
                self.named.insert(*queue);
                self.rings.stop(*queue);
                self.queues.remove(queue);
            }
            Op::SetCall { queue, call } => {
                self.publish_pending();
                self.named.insert(*queue);
                let ours = call.then(eventfd);
                let theirs = ours.as_ref().map(|c| c.try_clone().expect("dup"));
                let replaced = self.rings.set_call(*queue, theirs);
                let model = self.queues.get_mut(queue);
                assert_eq!(replaced, model.is_some(), "set_call of queue {queue}");
                if let Some(model) = model {
                    model.call = ours;
                }
            }
            Op::DirtyLog(change) => {
                self.publish_pending();
                self.set_dirty_log(*change);
            }
            Op::Driver {
                queue,
                field,
                value,
            } => {
                let Some(model) = self.queues.get(queue) else {
                    return;
                };
                let spec = &model.spec;
                let addr = match field {
                    Field::AvailFlags => Some(spec.avail_addr),
                    Field::UsedEvent => spec.avail_addr.checked_add(4 + 2 * u64::from(spec.size)),
                    Field::UsedIdx => spec.used_addr.checked_add(2),
                };
                if let Some(at) = addr.and_then(|addr| translate(self.table, addr, 2)) {
                    self.guest_write(at, &value.to_le_bytes());
                }
            }
            Op::Patch { offset, bytes } => {
                let at = *offset as usize;
                let bytes = &bytes[..bytes.len().min(GUEST_LEN - at)];
                self.guest_write(at, bytes);
            }
        }
        // After the driver's and frontend's own writes (mirrored above) there is nothing to
        // compare; after a step of `UsedRings` memory must be what the model says.
        if !matches!(
            op,
            Op::Segment { .. } | Op::Driver { .. } | Op::Patch { .. }
        ) {
            self.check_guest();
        }
    }

    /// The driver writes guest memory (the model too).
    fn guest_write(&mut self, at: usize, bytes: &[u8]) {
        self.f
            .guest
            .write_all_at(bytes, at as u64)
            .expect("writing guest memory");
        self.guest[at..at + bytes.len()].copy_from_slice(bytes);
    }

    fn read_guest(&self) -> Vec<u8> {
        let mut actual = vec![0; GUEST_LEN];
        self.f
            .guest
            .read_exact_at(&mut actual, 0)
            .expect("reading guest memory");
        actual
    }

    fn check_guest(&self) {
        let actual = self.read_guest();
        if actual != self.guest {
            let at = (0..GUEST_LEN).find(|&i| actual[i] != self.guest[i]);
            let at = at.unwrap_or_default();
            panic!(
                "guest memfd byte {at:#x} is {:#x}, the model says {:#x}",
                actual[at], self.guest[at]
            );
        }
    }

    /// StartQueue, as `engine.rs`'s `start_queue` handles it.
    fn start(&mut self, spec: QueueSpec) {
        self.publish_pending();
        self.named.insert(spec.queue);
        // The engine refuses a queue whose inflight region does not open: one of 0 entries.
        if spec.inflight_size == 0 {
            return;
        }
        let rings = rings_at(self.table, &spec);
        let valid = spec.queue < MAX_QUEUES
            && spec.size != 0
            && spec.size <= spec.inflight_size
            && rings.is_some();
        // The queue's part of the inflight region, made and initialized by the frontend. The
        // engine's has inflight_size entries; this one only the ring's (1 for a queue that
        // must be refused), as UsedRings records heads below the ring size only and creating
        // and initializing 65535 entries per start would dominate the run.
        let entries = if valid { spec.size } else { 1 };
        let limits = Limits {
            max_queues: 1,
            max_queue_size: entries,
        };
        let (region, _file) = InflightRegion::create(1, entries, limits).expect("region");
        let region = Arc::new(region);
        let mut tracker = region.queue(0).expect("queue 0 of a one-queue region");
        tracker
            .recover(entries, spec.next_used, spec.next_used)
            .expect("a fresh region");
        let marker = region.queue(0).expect("queue 0 of a one-queue region");
        let ours = (spec.flags & QUEUE_FLAG_CALL != 0).then(eventfd);
        let theirs = ours.as_ref().map(|c| c.try_clone().expect("dup"));

        let started = self
            .rings
            .start(spec, tracker, theirs, &self.f.tables[self.table]);
        assert_eq!(
            started.is_ok(),
            valid,
            "start of {spec:?} (rings at {rings:?}): {started:?}"
        );
        if started.is_ok() {
            self.queues.insert(
                spec.queue,
                Queue {
                    spec,
                    rings,
                    next_used: spec.next_used,
                    signalled_once: false,
                    call: ours,
                    marker,
                    batch: Vec::new(),
                },
            );
        }
        // A refused start leaves the queue as it was.
    }

    /// A slot finishes: `engine.rs`'s `start` reads its header into a `UsedTarget` (and, for
    /// a read, its segment count), `push_completion` hands it over.
    fn complete(&mut self, c: &Complete) {
        self.named.insert(c.queue);
        let header = SlotHeader {
            opcode: c.opcode,
            queue: c.queue,
            head: c.head,
            status_region: c.status_region,
            status_offset: c.status_offset,
            used_len: c.used_len,
            segment_count: c.segment_count,
            ..Default::default()
        };
        let target = UsedTarget::from_header(&header);
        let read_segments = if header.opcode == Opcode::Read as u32 {
            header.segment_count
        } else {
            0
        };
        let table = self.table;
        if let Some(model) = self.queues.get_mut(&target.queue) {
            // The frontend marked the head in flight as it took it off the avail ring.
            model.marker.mark(target.head);
        }
        self.rings.complete(
            &target,
            c.status,
            (&self.slots, c.slot, read_segments),
            &self.f.tables[table],
        );
        self.pending = true;

        let Some(model) = self.queues.get_mut(&target.queue) else {
            return;
        };
        let mut status_gpa = None;
        if let Some((index, offset)) = target.status {
            if let Some((gpa, _, memfd)) = region(table, index).filter(|r| offset < r.1) {
                self.guest[(memfd + offset) as usize] = u8::try_from(c.status).unwrap_or(u8::MAX);
                status_gpa = Some(gpa + offset);
            }
        }
        if target.head < model.spec.size && model.batch.len() < usize::from(model.spec.size) {
            model.batch.push(Entry {
                head: target.head,
                used_len: target.used_len(c.status),
                slot: c.slot,
                read_segments,
                status_gpa,
            });
        }
    }

    /// SetDirtyLog, as the engine handles it: a log that does not map is refused and the one
    /// in force stays.
    fn set_dirty_log(&mut self, change: DirtyLogChange) {
        let Some((size, offset)) = change else {
            self.rings.set_dirty_log(None);
            self.log = None;
            return;
        };
        let fits = size != 0
            && offset
                .checked_add(size)
                .is_some_and(|end| end <= vring::LOG_LEN);
        match DirtyLog::new(&self.f.log, size, offset) {
            Ok(log) => {
                assert!(fits, "a log of {size} bytes at {offset} was mapped");
                self.rings.set_dirty_log(Some(log));
                self.log = Some((size, offset));
            }
            Err(e) => assert!(!fits, "a log of {size} bytes at {offset} was refused: {e}"),
        }
    }

    fn publish_pending(&mut self) {
        if self.pending {
            self.publish([None, None]);
            self.check_guest();
        }
    }

    /// `engine.rs`'s `publish`, then the checks.
    fn publish(&mut self, changes: [Option<DirtyLogChange>; 2]) {
        self.pending = false;
        // The VMM has read and cleared the log.
        self.f
            .log
            .write_all_at(&ZEROS[..LOG_LEN], 0)
            .expect("clearing the log");
        let before: BTreeMap<u16, u16> = self
            .queues
            .iter()
            .map(|(&index, q)| (index, q.next_used))
            .collect();

        self.rings.record();
        // The engine publishes its completions here, then follows the log epoch.
        if let Some(change) = changes[0] {
            self.set_dirty_log(change);
        }
        self.rings.publish_indices();
        fence(Ordering::SeqCst);
        if let Some(change) = changes[1] {
            self.set_dirty_log(change);
        }
        self.rings.finish(&self.slots, &self.f.tables[self.table]);

        // Guest memory: every queue's used elements, then every used index.
        let mut writes: BTreeMap<usize, Vec<(u16, u8)>> = BTreeMap::new();
        let mut write = |queue: u16, at: usize, bytes: &[u8]| {
            for (i, &b) in bytes.iter().enumerate() {
                writes.entry(at + i).or_default().push((queue, b));
            }
        };
        let mut published = Vec::new();
        for (&index, q) in &mut self.queues {
            let Some((_, used)) = q.rings.filter(|_| !q.batch.is_empty()) else {
                continue;
            };
            let start = q.next_used;
            for (i, e) in q.batch.iter().enumerate() {
                let slot = usize::from(start.wrapping_add(i as u16) % q.spec.size);
                let at = used + 4 + 8 * slot;
                write(index, at, &u32::from(e.head).to_le_bytes());
                write(index, at + 4, &e.used_len.to_le_bytes());
            }
            q.next_used = start.wrapping_add(q.batch.len() as u16);
            published.push((index, start));
        }
        for &(index, _) in &published {
            let q = &self.queues[&index];
            let used = q.rings.map_or(0, |r| r.1);
            write(index, used + 2, &q.next_used.to_le_bytes());
        }
        let actual = self.read_guest();
        for (&at, values) in &writes {
            if values.iter().all(|v| v.0 == values[0].0) {
                // One queue's write: exactly its value.
                self.guest[at] = values.last().map_or(0, |v| v.1);
            } else {
                assert!(
                    values.iter().any(|v| v.1 == actual[at]),
                    "memfd byte {at:#x}, written by queues {values:?}, is {:#x}",
                    actual[at]
                );
                self.guest[at] = actual[at];
            }
        }
        if actual != self.guest {
            let at = (0..GUEST_LEN).find(|&i| actual[i] != self.guest[i]);
            let at = at.unwrap_or_default();
            panic!(
                "publish left guest memfd byte {at:#x} at {:#x}, the model says {:#x} ({})",
                actual[at],
                self.guest[at],
                match writes.get(&at) {
                    Some(values) => format!("written by queue {}", values[0].0),
                    None => "nothing should write it".to_string(),
                }
            );
        }

        for &index in &self.named {
            let got = self.rings.next_used(index);
            match self.queues.get(&index) {
                None => assert_eq!(got, None, "queue {index} is not started"),
                Some(q) => {
                    assert_eq!(got, Some(q.next_used), "next_used of queue {index}");
                    let advanced = q.next_used.wrapping_sub(before[&index]);
                    assert!(advanced <= q.spec.size, "queue {index} advanced {advanced}");
                }
            }
        }
        for &(index, _) in &published {
            let q = &self.queues[&index];
            let used = q.rings.map_or(0, |r| r.1);
            let contested =
                (used + 2..used + 4).any(|at| writes[&at].iter().any(|&(other, _)| other != index));
            if !contested {
                assert_eq!(
                    u16_at(&actual, used + 2),
                    q.next_used,
                    "queue {index}'s used index in guest memory"
                );
            }
        }

        // Interrupts: read as `finish` did, after the indices moved.
        for (&index, q) in &mut self.queues {
            let start = published.iter().find(|p| p.0 == index).map(|p| p.1);
            let wanted = match (start, q.rings) {
                (Some(old), Some((avail, _))) => {
                    if !q.signalled_once {
                        q.signalled_once = true;
                        true
                    } else if q.spec.flags & QUEUE_FLAG_EVENT_IDX != 0 {
                        let event = u16_at(&actual, avail + 4 + 2 * usize::from(q.spec.size));
                        let new = q.next_used;
                        new.wrapping_sub(event).wrapping_sub(1) < new.wrapping_sub(old)
                    } else {
                        u32::from(u16_at(&actual, avail)) & VRING_AVAIL_F_NO_INTERRUPT == 0
                    }
                }
                _ => false,
            };
            if let Some(call) = &q.call {
                assert_eq!(
                    signals(call),
                    u64::from(wanted),
                    "interrupts of queue {index} (published from {start:?})"
                );
            }
        }

        // The inflight region: published heads cleared, the used index recorded.
        for (&index, q) in &self.queues {
            if published.iter().any(|p| p.0 == index) {
                for e in &q.batch {
                    assert!(
                        !q.marker.is_marked(e.head),
                        "queue {index}: head {} still in flight",
                        e.head
                    );
                }
            }
            assert_eq!(
                q.marker.repair_last_batch(q.spec.size, q.next_used),
                0,
                "queue {index}: the inflight region's used index is not {}",
                q.next_used
            );
        }

        // The dirty log: what the batches wrote, marked by `finish` with the log then.
        let mut expected = vec![0u8; LOG_LEN];
        if let Some((size, offset)) = self.log {
            let pages = size * 8;
            let mut mark = |addr: u64, len: u64| {
                if len == 0 {
                    return;
                }
                let first = addr / LOG_PAGE_SIZE;
                let last = (addr.saturating_add(len - 1) / LOG_PAGE_SIZE).min(pages - 1);
                for page in first..=last {
                    expected[(offset + page / 8) as usize] |= 1 << (page % 8);
                }
            };
            for q in self.queues.values() {
                if q.batch.is_empty() {
                    continue;
                }
                for e in &q.batch {
                    if let Some(gpa) = e.status_gpa {
                        mark(gpa, 1);
                    }
                    let segments = &self.segments[e.slot as usize];
                    for s in &segments[..segments.len().min(e.read_segments as usize)] {
                        let Some((gpa, size, _)) = region(self.table, s.aux) else {
                            continue;
                        };
                        if s.offset < size {
                            mark(gpa + s.offset, u64::from(s.len));
                        }
                    }
                }
                if q.rings.is_some() {
                    mark(q.spec.used_addr, 8 * u64::from(q.spec.size) + 6);
                }
            }
        }
        let mut log = vec![0u8; LOG_LEN];
        self.f
            .log
            .read_exact_at(&mut log, 0)
            .expect("reading the log");
        if log != expected {
            let at = (0..LOG_LEN).find(|&i| log[i] != expected[i]);
            let at = at.unwrap_or_default();
            panic!(
                "dirty log ({:?}) byte {at} is {:#010b}, expected {:#010b}",
                self.log, log[at], expected[at]
            );
        }

        for q in self.queues.values_mut() {
            q.batch.clear();
        }
    }
}
