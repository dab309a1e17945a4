//! The libblkio client: one thread per queue keeps `depth` requests in flight (fio-style),
//! times every request from submission to completion, and counts what completes inside the
//! measured window. The main thread samples CPU time at the window's edges.

use std::mem::MaybeUninit;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Barrier;
use std::time::{Duration, Instant};

use blkio::{Blkio, Blkioq, Completion, ReqFlags};

use crate::error::BenchError;
use crate::hist::Histogram;
use crate::procfs;
use crate::workload::Workload;

/// The longest a client waits for one completion before the run is declared stuck.
const STALL_TIMEOUT: Duration = Duration::from_secs(10);
/// Attempts to connect while a freshly started back-end may still be setting up.
const CONNECT_ATTEMPTS: u32 = 50;

/// How the client reaches the disk.
#[derive(Debug, Clone, Copy)]
pub enum Connection<'a> {
    /// libblkio's `virtio-blk-vhost-user` driver on a back-end's socket.
    VhostUser(&'a Path),
    /// libblkio's `io_uring` driver on the image file: no back-end, the ceiling.
    IoUring {
        /// The image.
        path: &'a Path,
        /// Open it with O_DIRECT.
        direct: bool,
    },
}

/// Ramp and measured window of one run.
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    /// Time to run before measuring, so that queues are full and caches warm.
    pub ramp: Duration,
    /// The measured window.
    pub runtime: Duration,
}

/// CPU time of a set of processes, and the voluntary context switches of their threads.
#[derive(Debug, Clone, Default)]
struct CpuSample {
    seconds: f64,
    switches: Vec<(u32, u64)>,
}

fn sample(pids: &[u32]) -> CpuSample {
    let mut total = CpuSample::default();
    for &pid in pids {
        total.seconds += procfs::cpu_seconds(pid).unwrap_or(0.0);
        total.switches.extend(procfs::voluntary_switches(pid));
    }
    total
}

/// This process's user + system CPU seconds, all threads (getrusage has µs resolution, the
/// /proc ticks only 10 ms).
fn own_cpu_seconds() -> f64 {
    // SAFETY: getrusage writes one rusage into the zeroed struct we pass.
    let usage = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut usage);
        usage
    };
    let seconds = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 / 1e6;
    seconds(usage.ru_utime) + seconds(usage.ru_stime)
}

/// What one run measured.
#[derive(Debug, Clone)]
pub struct Measurement {
    /// Requests completed inside the window.
    pub ops: u64,
    /// Bytes they transferred.
    pub bytes: u64,
    /// Their latencies.
    pub latency: Histogram,
    /// The window's length.
    pub window: Duration,
    /// CPU seconds of the client process during the window (all its threads).
    pub client_cpu: f64,
    /// CPU seconds of the back-end's processes during the window; `None` for the ceiling.
    pub backend_cpu: Option<f64>,
    /// Voluntary context switches of the client's threads during the window.
    pub client_wakeups: u64,
    /// Voluntary context switches of the back-end's threads during the window.
    pub backend_wakeups: Option<u64>,
}

/// One queue and the buffers of its requests: `depth` slots of `block_size` bytes.
struct QueueCtx {
    queue: Blkioq,
    /// Start of the queue's buffer region (an address: libblkio owns the mapping).
    buf: usize,
}

/// What one client thread counted.
struct ThreadResult {
    ops: u64,
    bytes: u64,
    latency: Histogram,
    error: Option<i32>,
    stalled: bool,
}

/// A xorshift64* generator: random offsets without the rand crate.
struct XorShift(u64);

impl XorShift {
    fn new(seed: u64) -> Self {
        // Scrambled, and never the all-zero state xorshift cannot leave.
        Self((seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03).max(1))
    }

    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
}

/// Where request after request goes: random blocks, or a sequential cursor per thread.
struct Offsets {
    rng: XorShift,
    random: bool,
    block: u64,
    blocks: u64,
    next: u64,
}

impl Offsets {
    fn new(workload: &Workload, size: u64, thread: usize, seed: u64) -> Self {
        let block = workload.block_size as u64;
        let blocks = (size / block).max(1);
        Self {
            rng: XorShift::new(seed ^ (thread as u64 + 1)),
            random: workload.random,
            block,
            blocks,
            // Sequential threads start apart, so that two never read the same blocks.
            next: blocks / workload.queues.max(1) as u64 * thread as u64,
        }
    }

    fn next(&mut self) -> u64 {
        let block = if self.random {
            self.rng.next() % self.blocks
        } else {
            let block = self.next % self.blocks;
            self.next = block + 1;
            block
        };
        block * self.block
    }
}

/// Connects, runs `workload` for ramp + runtime and returns what the window saw.
/// `backend_pids` is asked at the start of the window for the processes to charge.
pub fn run(
    connection: Connection<'_>,
    workload: &Workload,
    size: u64,
    timing: Timing,
    seed: u64,
    backend_pids: Option<&dyn Fn() -> Vec<u32>>,
) -> Result<Measurement, BenchError> {
    let mut blkio = connect(connection, workload.queues)?;
    let align = blkio
        .get_u64("mem-region-alignment")
        .map_err(BenchError::blkio("reading mem-region-alignment"))?
        .max(1) as usize;
    let started = blkio.start().map_err(BenchError::blkio("starting"))?;
    if started.queues.len() < workload.queues {
        return Err(BenchError::Missing(format!(
            "asked for {} queues, libblkio started {}",
            workload.queues,
            started.queues.len()
        )));
    }
    let region_len = (workload.depth * workload.block_size).div_ceil(align) * align;
    let mut queues = Vec::new();
    for (index, queue) in started.queues.into_iter().enumerate() {
        let region = blkio
            .alloc_mem_region(region_len)
            .map_err(BenchError::blkio("allocating buffers"))?;
        blkio
            .map_mem_region(&region)
            .map_err(BenchError::blkio("mapping buffers"))?;
        // Data that is neither zeros nor repetitive, so no layer can shortcut the writes.
        let mut rng = XorShift::new(seed.wrapping_add(index as u64));
        for offset in (0..region.len).step_by(8) {
            // SAFETY: the region is mapped read/write for `len` bytes (a multiple of the
            // alignment, itself a multiple of 8) and nothing else uses it yet.
            unsafe { ((region.addr + offset) as *mut u64).write_unaligned(rng.next()) };
        }
        queues.push(QueueCtx {
            queue,
            buf: region.addr,
        });
    }

    let start = Instant::now();
    let window_start = start + timing.ramp;
    let window_end = window_start + timing.runtime;
    let failed = AtomicBool::new(false);
    // The client threads stay until the window's last sample is taken: their context switches
    // leave /proc with them.
    let sampled = Barrier::new(queues.len() + 1);
    let (results, cpu) = std::thread::scope(|scope| {
        let failed = &failed;
        let sampled = &sampled;
        let threads: Vec<_> = queues
            .iter_mut()
            .enumerate()
            .map(|(thread, ctx)| {
                let offsets = Offsets::new(workload, size, thread, seed);
                scope.spawn(move || {
                    let result = drive(ctx, workload, offsets, window_start, window_end, failed);
                    sampled.wait();
                    result
                })
            })
            .collect();
        // Sample at the window's edges; the client threads keep the queues full throughout.
        sleep_until(window_start);
        let pids = backend_pids.map(|f| f());
        let before = (
            own_cpu_seconds(),
            sample_self(),
            pids.as_deref().map(sample),
        );
        sleep_until(window_end);
        let after = (
            own_cpu_seconds(),
            sample_self(),
            pids.as_deref().map(sample),
        );
        sampled.wait();
        let results: Vec<ThreadResult> = threads
            .into_iter()
            .map(|t| {
                t.join().unwrap_or(ThreadResult {
                    ops: 0,
                    bytes: 0,
                    latency: Histogram::new(),
                    error: Some(libc::EIO),
                    stalled: false,
                })
            })
            .collect();
        (results, (before, after))
    });
    drop(queues);
    drop(blkio);

    let target = match connection {
        Connection::VhostUser(path) => path.display().to_string(),
        Connection::IoUring { .. } => "io_uring".into(),
    };
    let mut latency = Histogram::new();
    let (mut ops, mut bytes) = (0, 0);
    for result in &results {
        if let Some(errno) = result.error {
            return Err(BenchError::Request {
                workload: workload.name.into(),
                target,
                errno,
            });
        }
        if result.stalled {
            return Err(BenchError::Missing(format!(
                "{} on {target}: no completion for {STALL_TIMEOUT:?}",
                workload.name
            )));
        }
        ops += result.ops;
        bytes += result.bytes;
        latency.merge(&result.latency);
    }
    // The CPU samples may be a few µs late at either edge; the counts use the exact window.
    let (before, after) = cpu;
    Ok(Measurement {
        ops,
        bytes,
        latency,
        window: timing.runtime,
        client_cpu: after.0 - before.0,
        backend_cpu: after
            .2
            .as_ref()
            .zip(before.2.as_ref())
            .map(|(a, b)| a.seconds - b.seconds),
        client_wakeups: procfs::switches_between(&before.1, &after.1),
        backend_wakeups: after
            .2
            .as_ref()
            .zip(before.2.as_ref())
            .map(|(a, b)| procfs::switches_between(&b.switches, &a.switches)),
    })
}

fn sample_self() -> Vec<(u32, u64)> {
    procfs::voluntary_switches(std::process::id())
}

fn sleep_until(deadline: Instant) {
    let now = Instant::now();
    if deadline > now {
        std::thread::sleep(deadline - now);
    }
}

fn connect(connection: Connection<'_>, queues: usize) -> Result<Blkio, BenchError> {
    let queues = i32::try_from(queues).unwrap_or(i32::MAX);
    match connection {
        Connection::VhostUser(socket) => {
            let mut attempt = 0;
            loop {
                let mut blkio = Blkio::new("virtio-blk-vhost-user")
                    .map_err(BenchError::blkio("virtio-blk-vhost-user driver"))?;
                blkio
                    .set_str("path", &socket.to_string_lossy())
                    .map_err(BenchError::blkio("setting path"))?;
                match blkio.connect() {
                    Ok(()) => {
                        blkio
                            .set_i32("num-queues", queues)
                            .map_err(BenchError::blkio("setting num-queues"))?;
                        return Ok(blkio);
                    }
                    // Listening is not the same as accepting yet.
                    Err(_) if attempt < CONNECT_ATTEMPTS => {
                        attempt += 1;
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    Err(e) => {
                        return Err(BenchError::blkio(format!(
                            "connecting to {}",
                            socket.display()
                        ))(e))
                    }
                }
            }
        }
        Connection::IoUring { path, direct } => {
            let mut blkio = Blkio::new("io_uring").map_err(BenchError::blkio("io_uring driver"))?;
            blkio
                .set_str("path", &path.to_string_lossy())
                .map_err(BenchError::blkio("setting path"))?;
            blkio
                .set_bool("direct", direct)
                .map_err(BenchError::blkio("setting direct"))?;
            blkio
                .connect()
                .map_err(BenchError::blkio(format!("opening {}", path.display())))?;
            blkio
                .set_i32("num-queues", queues)
                .map_err(BenchError::blkio("setting num-queues"))?;
            Ok(blkio)
        }
    }
}

/// One client thread: fills the queue, then resubmits every completed slot at once, until the
/// window is over; then waits for what is still in flight.
fn drive(
    ctx: &mut QueueCtx,
    workload: &Workload,
    mut offsets: Offsets,
    window_start: Instant,
    window_end: Instant,
    failed: &AtomicBool,
) -> ThreadResult {
    let depth = workload.depth;
    let block = workload.block_size;
    let mut result = ThreadResult {
        ops: 0,
        bytes: 0,
        latency: Histogram::new(),
        error: None,
        stalled: false,
    };
    // Allocated once: the submission time of each slot, and room for every completion.
    let mut submitted = vec![Instant::now(); depth];
    let mut completions: Vec<MaybeUninit<Completion>> =
        (0..depth).map(|_| MaybeUninit::uninit()).collect();
    let mut in_flight = 0;
    for (slot, at) in submitted.iter_mut().enumerate() {
        issue(ctx, workload, slot, offsets.next());
        *at = Instant::now();
        in_flight += 1;
    }
    let completion_fd = ctx.queue.get_completion_fd();
    let mut done = false;
    while in_flight > 0 {
        // libblkio's do_io sleeps in ppoll on the completion eventfd but never reads it, so
        // once signalled it stays readable and every later wait would spin instead of sleep.
        // A VMM consumes the eventfd; so does this client, before every wait: a completion
        // that arrives afterwards signals it again (do_io re-checks the ring after enabling
        // notifications, so none is missed).
        if let Some(fd) = completion_fd {
            drain_eventfd(fd);
        }
        let mut timeout = STALL_TIMEOUT;
        let n = match ctx
            .queue
            .do_io(&mut completions, 1, Some(&mut timeout), None)
        {
            Ok(n) => n,
            Err(e) => {
                if e.errno() == blkio::Errno::TIME {
                    result.stalled = true;
                } else {
                    result.error = Some(e.errno().raw_os_error());
                }
                failed.store(true, Ordering::Relaxed);
                return result;
            }
        };
        // One clock read per batch: every completion in it was seen at the same moment.
        let now = Instant::now();
        let counting = now >= window_start && now < window_end;
        if now >= window_end || failed.load(Ordering::Relaxed) {
            done = true;
        }
        for completion in completions.iter().take(n) {
            // SAFETY: do_io initialised the first `n` entries.
            let completion = unsafe { completion.assume_init_ref() };
            in_flight -= 1;
            if completion.ret != 0 {
                result.error = Some(-completion.ret);
                failed.store(true, Ordering::Relaxed);
                done = true;
                continue;
            }
            let slot = completion.user_data;
            let Some(at) = submitted.get_mut(slot) else {
                continue;
            };
            if counting {
                result.ops += 1;
                result.bytes += block as u64;
                let nanos = now.saturating_duration_since(*at).as_nanos();
                result
                    .latency
                    .record(u64::try_from(nanos).unwrap_or(u64::MAX));
            }
            if !done {
                issue(ctx, workload, slot, offsets.next());
                *at = Instant::now();
                in_flight += 1;
            }
        }
    }
    result
}

/// Resets a non-blocking eventfd's counter (EAGAIN when it is zero is fine).
fn drain_eventfd(fd: std::os::fd::RawFd) {
    let mut counter = [0u8; 8];
    // SAFETY: reads at most 8 bytes into a local buffer; the fd stays open as long as the
    // queue that owns it, which outlives this call.
    let _ = unsafe { libc::read(fd, counter.as_mut_ptr().cast(), counter.len()) };
}

/// Queues one request of `workload` for `slot` (libblkio submits it on the next `do_io`).
fn issue(ctx: &mut QueueCtx, workload: &Workload, slot: usize, offset: u64) {
    let buf = (ctx.buf + slot * workload.block_size) as *mut u8;
    let len = workload.block_size;
    if workload.write {
        ctx.queue.write(offset, buf, len, slot, ReqFlags::empty());
    } else {
        ctx.queue.read(offset, buf, len, slot, ReqFlags::empty());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::WORKLOADS;

    #[test]
    fn offsets_stay_in_the_disk_and_aligned() {
        let size = 1 << 30;
        for workload in &WORKLOADS {
            let mut offsets = Offsets::new(workload, size, 1, 42);
            for _ in 0..10_000 {
                let offset = offsets.next();
                assert_eq!(offset % workload.block_size as u64, 0);
                assert!(offset + workload.block_size as u64 <= size);
            }
        }
        // Sequential: one block after the other, wrapping at the end.
        let seq = WORKLOADS.iter().find(|w| !w.random).unwrap();
        let mut offsets = Offsets::new(seq, 4 * seq.block_size as u64, 0, 1);
        let got: Vec<u64> = (0..6)
            .map(|_| offsets.next() / seq.block_size as u64)
            .collect();
        assert_eq!(got, [0, 1, 2, 3, 0, 1]);
    }

    #[test]
    fn xorshift_is_spread() {
        let mut rng = XorShift::new(0);
        let mut buckets = [0u32; 16];
        for _ in 0..16_000 {
            buckets[(rng.next() % 16) as usize] += 1;
        }
        assert!(
            buckets.iter().all(|&b| (800..1200).contains(&b)),
            "{buckets:?}"
        );
    }
}
