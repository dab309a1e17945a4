//! Pieces of the soak test (`tests/tests/soak.rs`, `docs/soak.md`): verified mixed I/O through a
//! libblkio queue with a per-block model, and what the test reads in /proc about the processes
//! it checks for leaks.
//!
//! **The verification model.** A client thread owns a range of 4 KiB blocks of a disk and keeps
//! the generation it last wrote to each (0: zeros — never written, discarded or
//! write-zeroed). A write stamps each block with a header (magic, disk tag, block number,
//! generation) followed by bytes derived from the three, so a read tells a stale block (older
//! generation), a misdirected one (other block or disk) and a torn or corrupted one (header
//! right, body wrong) apart. Requests in flight never overlap (a block is busy from submission
//! to completion), so the expected content of every block is known at every read.

use std::collections::{BTreeMap, HashMap};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use crate::client::{errno_name, IoQueue, Op};
use crate::Rng;

/// The unit of the model: 4 KiB, a multiple of both logical block sizes.
pub const BLOCK: usize = 4096;
/// The longest request, in blocks.
pub const MAX_BLOCKS: usize = 16;
/// Bytes of queue buffer a [`Worker`] needs per request in flight.
pub const SLOT: usize = MAX_BLOCKS * BLOCK;
/// The stamp's magic.
const MAGIC: &[u8; 8] = b"BPSOAK01";
/// A block whose content is unknown after a failed write (not checked until rewritten).
const UNKNOWN: u64 = u64::MAX;
/// How many error messages a [`ClientStats`] keeps.
const KEEP_MESSAGES: usize = 8;

/// Writes the content of `block` at generation `gen` of disk `tag` into `buf` (one block).
pub fn stamp(buf: &mut [u8], tag: u32, block: u64, gen: u64) {
    debug_assert_eq!(buf.len(), BLOCK);
    if gen == 0 {
        buf.fill(0);
        return;
    }
    buf[..8].copy_from_slice(MAGIC);
    buf[8..12].copy_from_slice(&tag.to_le_bytes());
    buf[12..16].copy_from_slice(&0u32.to_le_bytes());
    buf[16..24].copy_from_slice(&block.to_le_bytes());
    buf[24..32].copy_from_slice(&gen.to_le_bytes());
    Rng::new(u64::from(tag) << 48 ^ block << 24 ^ gen).fill(&mut buf[32..]);
}

/// Checks one block read back against the model; the error says what was found instead.
pub fn check(buf: &[u8], tag: u32, block: u64, gen: u64) -> Result<(), String> {
    if gen == UNKNOWN {
        return Ok(());
    }
    let mut want = vec![0u8; BLOCK];
    stamp(&mut want, tag, block, gen);
    if buf == want.as_slice() {
        return Ok(());
    }
    let found = if buf.iter().all(|&b| b == 0) {
        "zeros".to_string()
    } else if &buf[..8] == MAGIC {
        let f_tag = u32::from_le_bytes(buf[8..12].try_into().unwrap());
        let f_block = u64::from_le_bytes(buf[16..24].try_into().unwrap());
        let f_gen = u64::from_le_bytes(buf[24..32].try_into().unwrap());
        let body = if f_tag == tag && f_block == block && f_gen == gen {
            " with a corrupted body"
        } else {
            ""
        };
        format!("the stamp of disk tag {f_tag} block {f_block} generation {f_gen}{body}")
    } else {
        format!("unstamped data {:02x?}", &buf[..16])
    };
    Err(format!(
        "block {block}: want generation {gen}{}, found {found}",
        if gen == 0 { " (zeros)" } else { "" }
    ))
}

/// Counters of one client (all its threads), shared with the test's main thread.
#[derive(Debug, Default)]
pub struct ClientStats {
    /// Reads completed (including vectored ones and the final verification).
    pub reads: AtomicU64,
    /// Writes completed (including vectored ones).
    pub writes: AtomicU64,
    /// Flushes completed.
    pub flushes: AtomicU64,
    /// Discards completed.
    pub discards: AtomicU64,
    /// Write-zeroes completed.
    pub write_zeroes: AtomicU64,
    /// Bytes read and written.
    pub bytes: AtomicU64,
    /// Blocks read and checked against the model.
    pub verified_blocks: AtomicU64,
    /// Requests that failed (a negative errno, or libblkio giving up on the queue).
    pub errors: AtomicU64,
    /// Blocks read back with content the model does not expect.
    pub mismatches: AtomicU64,
    /// The first few error and mismatch messages.
    pub messages: Mutex<Vec<String>>,
}

impl ClientStats {
    /// Requests completed without error.
    pub fn ops(&self) -> u64 {
        self.reads.load(Ordering::Relaxed)
            + self.writes.load(Ordering::Relaxed)
            + self.flushes.load(Ordering::Relaxed)
            + self.discards.load(Ordering::Relaxed)
            + self.write_zeroes.load(Ordering::Relaxed)
    }

    /// Errors plus mismatches: anything but 0 fails the soak.
    pub fn failures(&self) -> u64 {
        self.errors.load(Ordering::Relaxed) + self.mismatches.load(Ordering::Relaxed)
    }

    fn note(&self, counter: &AtomicU64, msg: String) {
        counter.fetch_add(1, Ordering::Relaxed);
        let mut m = self.messages.lock().unwrap();
        if m.len() < KEEP_MESSAGES {
            m.push(msg);
        }
    }

    /// Records a failed request.
    pub fn error(&self, msg: String) {
        self.note(&self.errors, msg);
    }

    /// Records a block that read back wrong.
    pub fn mismatch(&self, msg: String) {
        self.note(&self.mismatches, msg);
    }

    /// One line for the summary.
    pub fn line(&self) -> String {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        format!(
            "{} ops ({} reads, {} writes, {} flushes, {} discards, {} write-zeroes; {} MiB; {} \
             blocks verified), {} errors, {} mismatches",
            self.ops(),
            g(&self.reads),
            g(&self.writes),
            g(&self.flushes),
            g(&self.discards),
            g(&self.write_zeroes),
            g(&self.bytes) >> 20,
            g(&self.verified_blocks),
            g(&self.errors),
            g(&self.mismatches)
        )
    }
}

/// The kinds of request a [`Worker`] sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Read,
    Readv,
    Write,
    Writev,
    Flush,
    Discard,
    WriteZeroes,
}

/// A request in flight: what the model must do when it completes.
struct Pending {
    kind: Kind,
    /// First block (relative to the worker's range) and count.
    first: usize,
    count: usize,
    /// The generation written (writes).
    gen: u64,
    /// For a vectored request: the buffer offset (within the slot) of each block.
    layout: Vec<usize>,
}

/// The model of one range of blocks and the I/O loop that exercises and checks it.
pub struct Worker {
    /// The disk tag written into every stamp.
    pub tag: u32,
    /// First block (4 KiB units) of the range on the device.
    pub base: u64,
    gens: Vec<u64>,
    busy: Vec<bool>,
    next_gen: u64,
    rng: Rng,
    /// Discard is advisory on this disk (a qcow2 image keeps the data of partial clusters):
    /// a discarded block is not checked until it is rewritten.
    pub advisory_discard: bool,
}

impl Worker {
    /// A model of `blocks` blocks from block `base`, all zeros (a fresh sparse image).
    pub fn new(tag: u32, base: u64, blocks: usize, seed: u64) -> Worker {
        Worker {
            tag,
            base,
            gens: vec![0; blocks],
            busy: vec![false; blocks],
            next_gen: 1,
            rng: Rng::new(seed),
            advisory_discard: false,
        }
    }

    /// Blocks in the range.
    pub fn blocks(&self) -> usize {
        self.gens.len()
    }

    /// Runs mixed verified I/O on `q` (its buffer at least `depth` × [`SLOT`] bytes) with up to
    /// `depth` requests in flight until `stop()` says so (checked between submissions) or
    /// `max_ops` requests completed, then waits for what is in flight. A panic in libblkio's
    /// wait (a request that never completes, the connection gone) is recorded as an error and
    /// ends the loop. Returns false if the queue is unusable afterwards.
    pub fn run(
        &mut self,
        q: &mut IoQueue,
        depth: usize,
        stats: &ClientStats,
        max_ops: u64,
        stop: &dyn Fn() -> bool,
    ) -> bool {
        let r = std::panic::catch_unwind(AssertUnwindSafe(|| {
            self.run_inner(q, depth, stats, max_ops, stop)
        }));
        match r {
            Ok(()) => true,
            Err(e) => {
                stats.error(format!("libblkio gave up: {}", panic_text(&*e)));
                false
            }
        }
    }

    fn run_inner(
        &mut self,
        q: &mut IoQueue,
        depth: usize,
        stats: &ClientStats,
        max_ops: u64,
        stop: &dyn Fn() -> bool,
    ) {
        assert!(q.buf().len() >= depth * SLOT, "queue buffer too small");
        let mut free: Vec<usize> = (0..depth).rev().collect();
        let mut pending: HashMap<usize, Pending> = HashMap::new();
        let mut submitted = 0u64;
        loop {
            let stopping = stop() || submitted >= max_ops;
            if !stopping {
                while let Some(slot) = free.pop() {
                    match self.start(q, slot) {
                        Some(p) => {
                            pending.insert(slot, p);
                            submitted += 1;
                        }
                        None => {
                            free.push(slot);
                            break;
                        }
                    }
                }
            }
            if pending.is_empty() {
                if stopping {
                    return;
                }
                continue;
            }
            for (slot, ret) in q.wait(1) {
                let p = pending
                    .remove(&slot)
                    .expect("completion of an unknown request");
                self.complete(q, slot, p, ret, stats);
                free.push(slot);
            }
        }
    }

    /// Picks a request over blocks that are not busy, prepares its buffer in `slot` and
    /// submits it; None if no free range was found.
    fn start(&mut self, q: &mut IoQueue, slot: usize) -> Option<Pending> {
        let roll = self.rng.below(100);
        let kind = match roll {
            0..=29 => Kind::Read,
            30..=39 => Kind::Readv,
            40..=69 => Kind::Write,
            70..=79 => Kind::Writev,
            80..=87 => Kind::Flush,
            88..=93 => Kind::Discard,
            _ => Kind::WriteZeroes,
        };
        let base_buf = slot * SLOT;
        if kind == Kind::Flush {
            q.submit(&Op::Flush, slot);
            return Some(Pending {
                kind,
                first: 0,
                count: 0,
                gen: 0,
                layout: Vec::new(),
            });
        }
        let n = self.blocks();
        let (first, count) = (0..8).find_map(|_| {
            let count = 1 + self.rng.below(MAX_BLOCKS.min(n) as u64) as usize;
            let first = self.rng.below((n - count + 1) as u64) as usize;
            (!self.busy[first..first + count].iter().any(|&b| b)).then_some((first, count))
        })?;
        for b in &mut self.busy[first..first + count] {
            *b = true;
        }
        let offset = (self.base + first as u64) * BLOCK as u64;
        let len = count * BLOCK;
        // Vectored requests with two or more blocks put them in the buffer in reverse order,
        // one segment per block: the device must follow the segments, not the addresses.
        let vectored = matches!(kind, Kind::Readv | Kind::Writev) && count > 1;
        let layout: Vec<usize> = if vectored {
            (0..count).map(|i| (count - 1 - i) * BLOCK).collect()
        } else {
            (0..count).map(|i| i * BLOCK).collect()
        };
        let mut gen = 0;
        if matches!(kind, Kind::Write | Kind::Writev) {
            gen = self.next_gen;
            self.next_gen += 1;
            let tag = self.tag;
            let buf = &mut q.buf()[base_buf..base_buf + SLOT];
            for (i, &at) in layout.iter().enumerate() {
                let block = self.base + (first + i) as u64;
                stamp(&mut buf[at..at + BLOCK], tag, block, gen);
            }
        }
        let iov =
            || -> Vec<(usize, usize)> { layout.iter().map(|&at| (base_buf + at, BLOCK)).collect() };
        let op = match kind {
            Kind::Readv if vectored => Op::Readv { offset, iov: iov() },
            Kind::Read | Kind::Readv => Op::Read {
                offset,
                buf: base_buf,
                len,
            },
            Kind::Writev if vectored => Op::Writev { offset, iov: iov() },
            Kind::Write | Kind::Writev => Op::Write {
                offset,
                buf: base_buf,
                len,
            },
            Kind::Discard => Op::Discard {
                offset,
                len: len as u64,
            },
            Kind::WriteZeroes => Op::WriteZeroes {
                offset,
                len: len as u64,
                unmap: self.rng.below(2) == 0,
            },
            Kind::Flush => unreachable!(),
        };
        q.submit(&op, slot);
        Some(Pending {
            kind,
            first,
            count,
            gen,
            layout,
        })
    }

    fn complete(
        &mut self,
        q: &mut IoQueue,
        slot: usize,
        p: Pending,
        ret: i32,
        stats: &ClientStats,
    ) {
        let range = p.first..p.first + p.count;
        for b in &mut self.busy[range.clone()] {
            *b = false;
        }
        let bytes = (p.count * BLOCK) as u64;
        if ret != 0 {
            stats.error(format!(
                "{:?} of blocks {}+{}: {}",
                p.kind,
                self.base + p.first as u64,
                p.count,
                errno_name(-ret)
            ));
            if matches!(
                p.kind,
                Kind::Write | Kind::Writev | Kind::Discard | Kind::WriteZeroes
            ) {
                // Old or new content: no longer known.
                for g in &mut self.gens[range] {
                    *g = UNKNOWN;
                }
            }
            return;
        }
        match p.kind {
            Kind::Read | Kind::Readv => {
                let base_buf = slot * SLOT;
                let buf = &q.buf()[base_buf..base_buf + SLOT];
                for (i, &at) in p.layout.iter().enumerate() {
                    let rel = p.first + i;
                    let block = self.base + rel as u64;
                    if let Err(e) = check(&buf[at..at + BLOCK], self.tag, block, self.gens[rel]) {
                        stats.mismatch(format!("{:?}: {e}", p.kind));
                    }
                }
                stats.reads.fetch_add(1, Ordering::Relaxed);
                stats.bytes.fetch_add(bytes, Ordering::Relaxed);
                stats
                    .verified_blocks
                    .fetch_add(p.count as u64, Ordering::Relaxed);
            }
            Kind::Write | Kind::Writev => {
                for g in &mut self.gens[range] {
                    *g = p.gen;
                }
                stats.writes.fetch_add(1, Ordering::Relaxed);
                stats.bytes.fetch_add(bytes, Ordering::Relaxed);
            }
            Kind::Discard | Kind::WriteZeroes => {
                let now = if p.kind == Kind::Discard && self.advisory_discard {
                    UNKNOWN
                } else {
                    0
                };
                for g in &mut self.gens[range] {
                    *g = now;
                }
                let c = if p.kind == Kind::Discard {
                    &stats.discards
                } else {
                    &stats.write_zeroes
                };
                c.fetch_add(1, Ordering::Relaxed);
            }
            Kind::Flush => {
                stats.flushes.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Reads the whole range back (up to `depth` reads of [`MAX_BLOCKS`] in flight) and checks
    /// every block. Returns false if the queue is unusable afterwards.
    pub fn verify_all(&mut self, q: &mut IoQueue, depth: usize, stats: &ClientStats) -> bool {
        let r = std::panic::catch_unwind(AssertUnwindSafe(|| {
            let n = self.blocks();
            let chunks = n.div_ceil(MAX_BLOCKS);
            let tag = self.tag;
            let base = self.base;
            let gens = &self.gens;
            q.pipeline(
                chunks,
                depth,
                |i, _| {
                    let first = i * MAX_BLOCKS;
                    let count = MAX_BLOCKS.min(n - first);
                    Op::Read {
                        offset: (base + first as u64) * BLOCK as u64,
                        buf: 0,
                        len: count * BLOCK,
                    }
                },
                |i, buf, ret| {
                    let first = i * MAX_BLOCKS;
                    let count = MAX_BLOCKS.min(n - first);
                    if ret != 0 {
                        stats.error(format!(
                            "verifying read of blocks {}+{count}: {}",
                            base + first as u64,
                            errno_name(-ret)
                        ));
                        return;
                    }
                    for j in 0..count {
                        let rel = first + j;
                        let block = base + rel as u64;
                        if let Err(e) =
                            check(&buf[j * BLOCK..(j + 1) * BLOCK], tag, block, gens[rel])
                        {
                            stats.mismatch(format!("final read-back: {e}"));
                        }
                    }
                    stats.reads.fetch_add(1, Ordering::Relaxed);
                    stats
                        .bytes
                        .fetch_add((count * BLOCK) as u64, Ordering::Relaxed);
                    stats
                        .verified_blocks
                        .fetch_add(count as u64, Ordering::Relaxed);
                },
            );
        }));
        match r {
            Ok(()) => true,
            Err(e) => {
                stats.error(format!("libblkio gave up verifying: {}", panic_text(&*e)));
                false
            }
        }
    }
}

/// The message of a caught panic.
pub fn panic_text(e: &(dyn std::any::Any + Send)) -> String {
    e.downcast_ref::<String>()
        .cloned()
        .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "(no message)".into())
}

// ---------------------------------------------------------------------------------------------
// /proc.

/// Open file descriptors of `pid` (None when it is gone).
pub fn fd_count(pid: u32) -> Option<usize> {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .ok()
        .map(|d| d.count())
}

/// What the fds of `pid` point to, grouped and counted: `socket`, `anon_inode:[eventfd]`,
/// a file's path (kind → count), for a leak report.
pub fn fd_kinds(pid: u32) -> BTreeMap<String, usize> {
    let mut kinds = BTreeMap::new();
    if let Ok(d) = std::fs::read_dir(format!("/proc/{pid}/fd")) {
        for e in d.filter_map(|e| e.ok()) {
            let t = std::fs::read_link(e.path())
                .map(|t| t.display().to_string())
                .unwrap_or_default();
            // socket:[123] and the like: the kind, not the inode (anon_inode:[eventfd] stays).
            let kind = match t.find(":[") {
                Some(i) if t[i + 2..].starts_with(|c: char| c.is_ascii_digit()) => {
                    t[..i].to_string()
                }
                _ => t,
            };
            *kinds.entry(kind).or_default() += 1;
        }
    }
    kinds
}

/// [`fd_kinds`] as one line.
pub fn fd_summary(kinds: &BTreeMap<String, usize>) -> String {
    kinds
        .iter()
        .map(|(k, n)| format!("{n}× {k}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// What `now` has more or fewer of than `then` ("+3× anon_inode:[eventfd]").
pub fn fd_diff(then: &BTreeMap<String, usize>, now: &BTreeMap<String, usize>) -> String {
    let mut out = Vec::new();
    for k in then
        .keys()
        .chain(now.keys())
        .collect::<std::collections::BTreeSet<_>>()
    {
        let (a, b) = (
            then.get(k).copied().unwrap_or(0),
            now.get(k).copied().unwrap_or(0),
        );
        if a != b {
            out.push(format!("{:+}× {k}", b as i64 - a as i64));
        }
    }
    out.join(", ")
}

/// A field (kB) of /proc/PID/status, e.g. `RssAnon`.
pub fn status_kib(pid: u32, field: &str) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
}

/// Makes this process the reaper of its orphaned descendants (PR_SET_CHILD_SUBREAPER): the
/// frontends of a blkplaned the test killed become its children instead of init's, so that
/// their exits are reaped by [`reap_zombies`] whatever init does.
pub fn become_subreaper() {
    // SAFETY: prctl with integer arguments only.
    let r = unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
    assert_eq!(r, 0, "PR_SET_CHILD_SUBREAPER");
}

/// Reaps this process's zombie children whose `comm` is one of `comms` (never the children
/// the test waits for itself: blkplaned, QEMU, blkplanectl). Returns how many.
pub fn reap_zombies(comms: &[&str]) -> usize {
    let me = std::process::id();
    let mut n = 0;
    for (pid, comm, state) in crate::frontend::children_of(me) {
        if state == 'Z' && comms.contains(&comm.as_str()) {
            let mut status = 0;
            // SAFETY: waitpid on a zombie child of this process, by pid.
            if unsafe { libc::waitpid(pid as libc::pid_t, &mut status, libc::WNOHANG) } > 0 {
                n += 1;
            }
        }
    }
    n
}

/// Sets FD_CLOEXEC on every descriptor of this process above stderr, so that the processes
/// the test starts (blkplaned, and through it the frontends; QEMU) do not inherit the test's
/// own — libblkio's memfds and eventfds, or whatever the test runner passed down — which
/// would otherwise show up in their fd counts depending on when they were started.
pub fn cloexec_all() {
    let fds: Vec<i32> = std::fs::read_dir("/proc/self/fd")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .filter_map(|e| e.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default();
    for fd in fds.into_iter().filter(|&fd| fd > 2) {
        // SAFETY: fcntl on a descriptor number; one that closed meanwhile fails with EBADF.
        unsafe {
            let flags = libc::fcntl(fd, libc::F_GETFD);
            if flags >= 0 {
                libc::fcntl(fd, libc::F_SETFD, flags | libc::FD_CLOEXEC);
            }
        }
    }
}
