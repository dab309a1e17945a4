//! A libblkio (`blkio` crate) client: what a well-behaved VMM does to the frontend.
//!
//! libblkio's vhost-user driver only accepts buffers inside memory regions it shared with the
//! back-end, so every queue gets its own region from `alloc_mem_region` + `map_mem_region`, and
//! all request buffers are windows of it, addressed by offset.

use std::collections::HashMap;
use std::mem::MaybeUninit;
use std::path::Path;
use std::time::Duration;

use blkio::{Blkio, Blkioq, Completion, MemoryRegion, ReqFlags};

/// The longest a client waits for any one completion. Generous because an iothread restart
/// (SIGKILL + respawn + resubmission) happens inside it on a loaded 2-core CI machine.
pub const IO_TIMEOUT: Duration = Duration::from_secs(30);

/// How to connect a [`Client`].
#[derive(Debug, Clone)]
pub struct ClientOptions {
    /// Queues to start (libblkio's `num-queues`).
    pub num_queues: i32,
    /// Virtqueue size; `None` keeps libblkio's default (256).
    pub queue_size: Option<i32>,
    /// libblkio's `read-only`; it must be set to start a device that offers VIRTIO_BLK_F_RO.
    pub read_only: bool,
    /// Bytes of shared buffer memory per queue.
    pub buf_size: usize,
}

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions {
            num_queues: 1,
            queue_size: None,
            read_only: false,
            buf_size: 4 << 20,
        }
    }
}

/// A started libblkio `virtio-blk-vhost-user` instance with its queues.
pub struct Client {
    // Declared before `blkio` so that the queues go first on drop: their rings live in memory
    // owned by the driver inside `blkio`.
    queues: Vec<IoQueue>,
    blkio: Blkio,
}

impl Client {
    /// Connects with default options (one queue).
    pub fn connect(socket: &Path) -> Result<Client, blkio::Error> {
        Self::connect_with(socket, &ClientOptions::default())
    }

    /// Connects, starts `opts.num_queues` queues and maps a buffer region for each.
    pub fn connect_with(socket: &Path, opts: &ClientOptions) -> Result<Client, blkio::Error> {
        let mut blkio = Blkio::new("virtio-blk-vhost-user")?;
        blkio.set_str("path", socket.to_str().expect("socket path is not UTF-8"))?;
        blkio.set_bool("read-only", opts.read_only)?;
        blkio.connect()?;
        blkio.set_i32("num-queues", opts.num_queues)?;
        if let Some(size) = opts.queue_size {
            blkio.set_i32("queue-size", size)?;
        }
        let started = blkio.start()?;
        let mut queues = Vec::new();
        for q in started.queues {
            let region = blkio.alloc_mem_region(opts.buf_size)?;
            blkio.map_mem_region(&region)?;
            queues.push(IoQueue::new(q, region));
        }
        Ok(Client { queues, blkio })
    }

    /// The libblkio instance, for property reads.
    pub fn blkio(&self) -> &Blkio {
        &self.blkio
    }

    /// The device capacity in bytes (libblkio's `capacity`).
    pub fn capacity(&self) -> u64 {
        self.blkio.get_u64("capacity").expect("capacity")
    }

    /// Queue `i`.
    pub fn queue(&mut self, i: usize) -> &mut IoQueue {
        &mut self.queues[i]
    }

    /// All queues, to hand one to each thread.
    pub fn queues_mut(&mut self) -> &mut [IoQueue] {
        &mut self.queues
    }

    /// The libblkio instance (to map and unmap memory regions) and the queues at the same
    /// time, so that one thread changes the memory table while others do I/O.
    pub fn split_mut(&mut self) -> (&mut Blkio, &mut [IoQueue]) {
        (&mut self.blkio, &mut self.queues)
    }
}

/// One request for [`IoQueue::submit`]. `buf` values are byte offsets into the queue's buffer
/// (in [`IoQueue::pipeline`]: into the request's slot).
#[derive(Debug, Clone)]
pub enum Op {
    /// Read `len` bytes at device `offset` into `buf`.
    Read {
        /// Device offset.
        offset: u64,
        /// Buffer offset.
        buf: usize,
        /// Bytes.
        len: usize,
    },
    /// Write `len` bytes from `buf` at device `offset`.
    Write {
        /// Device offset.
        offset: u64,
        /// Buffer offset.
        buf: usize,
        /// Bytes.
        len: usize,
    },
    /// Vectored read into the (buffer offset, length) segments.
    Readv {
        /// Device offset.
        offset: u64,
        /// (buffer offset, length) segments.
        iov: Vec<(usize, usize)>,
    },
    /// Vectored write from the (buffer offset, length) segments.
    Writev {
        /// Device offset.
        offset: u64,
        /// (buffer offset, length) segments.
        iov: Vec<(usize, usize)>,
    },
    /// Flush the device's write cache.
    Flush,
    /// Discard `len` bytes at `offset`.
    Discard {
        /// Device offset.
        offset: u64,
        /// Bytes.
        len: u64,
    },
    /// Write zeroes over `len` bytes at `offset`; `unmap` allows deallocation.
    WriteZeroes {
        /// Device offset.
        offset: u64,
        /// Bytes.
        len: u64,
        /// Whether the device may deallocate (libblkio: absence of `NO_UNMAP`).
        unmap: bool,
    },
}

impl Op {
    /// The same request with buffer offsets moved by `base`, checked to stay within `limit`
    /// bytes from `base`.
    fn rebased(&self, base: usize, limit: usize) -> Op {
        let check = |b: usize, l: usize| {
            assert!(
                b.checked_add(l).is_some_and(|e| e <= limit),
                "buffer {b}+{l} outside {limit}-byte window"
            );
            base + b
        };
        match self {
            Op::Read { offset, buf, len } => Op::Read {
                offset: *offset,
                buf: check(*buf, *len),
                len: *len,
            },
            Op::Write { offset, buf, len } => Op::Write {
                offset: *offset,
                buf: check(*buf, *len),
                len: *len,
            },
            Op::Readv { offset, iov } => Op::Readv {
                offset: *offset,
                iov: iov.iter().map(|&(b, l)| (check(b, l), l)).collect(),
            },
            Op::Writev { offset, iov } => Op::Writev {
                offset: *offset,
                iov: iov.iter().map(|&(b, l)| (check(b, l), l)).collect(),
            },
            other => other.clone(),
        }
    }
}

/// A libblkio queue plus its shared buffer region.
pub struct IoQueue {
    q: Blkioq,
    buf: *mut u8,
    len: usize,
    // libblkio borrows iovec arrays until the request is in the ring (or later, if it had to
    // backlog the request), so they are kept until completion.
    iovecs: HashMap<usize, Vec<libc::iovec>>,
    in_flight: usize,
}

// SAFETY: the raw pointers (`buf` and inside `iovecs`) point into this queue's own mapped region,
// which stays mapped until the `Blkio` and all its queues are gone; an `IoQueue` is only ever
// used by one thread at a time (`&mut`).
unsafe impl Send for IoQueue {}

impl IoQueue {
    fn new(q: Blkioq, region: MemoryRegion) -> IoQueue {
        IoQueue {
            q,
            buf: region.addr as *mut u8,
            len: region.len,
            iovecs: HashMap::new(),
            in_flight: 0,
        }
    }

    /// The whole shared buffer of this queue.
    pub fn buf(&mut self) -> &mut [u8] {
        // SAFETY: the region is mapped read/write for `len` bytes as long as `self` lives.
        unsafe { std::slice::from_raw_parts_mut(self.buf, self.len) }
    }

    /// Requests submitted and not yet completed.
    pub fn in_flight(&self) -> usize {
        self.in_flight
    }

    fn ptr(&self, off: usize, len: usize) -> *mut u8 {
        assert!(
            off.checked_add(len).is_some_and(|e| e <= self.len),
            "buffer {off}+{len} outside the {}-byte queue buffer",
            self.len
        );
        // SAFETY: in bounds, checked above.
        unsafe { self.buf.add(off) }
    }

    fn iovec(&self, iov: &[(usize, usize)]) -> Vec<libc::iovec> {
        iov.iter()
            .map(|&(off, len)| libc::iovec {
                iov_base: self.ptr(off, len).cast(),
                iov_len: len,
            })
            .collect()
    }

    /// Queues `op` (libblkio submits it on the next [`IoQueue::wait`]); its completion carries
    /// `user_data`.
    pub fn submit(&mut self, op: &Op, user_data: usize) {
        let none = ReqFlags::empty();
        match op {
            Op::Read { offset, buf, len } => {
                let p = self.ptr(*buf, *len);
                self.q.read(*offset, p, *len, user_data, none)
            }
            Op::Write { offset, buf, len } => {
                let p = self.ptr(*buf, *len);
                self.q.write(*offset, p, *len, user_data, none)
            }
            Op::Readv { offset, iov } => {
                let v = self.iovec(iov);
                let (p, n) = (v.as_ptr(), v.len() as u32);
                self.iovecs.insert(user_data, v);
                self.q.readv(*offset, p, n, user_data, none)
            }
            Op::Writev { offset, iov } => {
                let v = self.iovec(iov);
                let (p, n) = (v.as_ptr(), v.len() as u32);
                self.iovecs.insert(user_data, v);
                self.q.writev(*offset, p, n, user_data, none)
            }
            Op::Flush => self.q.flush(user_data, none),
            Op::Discard { offset, len } => self.q.discard(*offset, *len, user_data, none),
            Op::WriteZeroes { offset, len, unmap } => {
                let flags = if *unmap { none } else { ReqFlags::NO_UNMAP };
                self.q.write_zeroes(*offset, *len, user_data, flags)
            }
        }
        self.in_flight += 1;
    }

    /// Waits for at least `min` completions (at most [`IO_TIMEOUT`], then panics) and returns
    /// all that are available as (user_data, ret), ret being 0 or a negative errno.
    pub fn wait(&mut self, min: usize) -> Vec<(usize, i32)> {
        let mut completions: Vec<MaybeUninit<Completion>> = (0..self.in_flight.max(1))
            .map(|_| MaybeUninit::uninit())
            .collect();
        let mut timeout = IO_TIMEOUT;
        let n = self
            .q
            .do_io(&mut completions, min, Some(&mut timeout), None)
            .unwrap_or_else(|e| {
                panic!(
                    "do_io (waiting for {min} of {} requests): {e} ({:?})",
                    self.in_flight,
                    e.errno()
                )
            });
        let mut out = Vec::with_capacity(n);
        for c in &completions[..n] {
            // SAFETY: do_io initialized the first `n` entries.
            let c = unsafe { c.assume_init_ref() };
            self.iovecs.remove(&c.user_data);
            out.push((c.user_data, c.ret));
        }
        self.in_flight -= n;
        out
    }

    /// Runs one request to completion: Ok, or Err(errno).
    pub fn run(&mut self, op: &Op) -> Result<(), i32> {
        assert_eq!(self.in_flight, 0, "run() needs an idle queue");
        self.submit(op, 0);
        let done = self.wait(1);
        assert_eq!(done.len(), 1);
        match done[0].1 {
            0 => Ok(()),
            ret => Err(-ret),
        }
    }

    /// Reads `len` bytes at device `offset` into `buf`, which must lie in a memory region
    /// mapped with `map_mem_region` (not necessarily this queue's).
    ///
    /// # Safety
    /// `buf` must be valid for writes of `len` bytes until this returns.
    pub unsafe fn read_into(&mut self, offset: u64, buf: *mut u8, len: usize) -> Result<(), i32> {
        assert_eq!(self.in_flight, 0, "read_into() needs an idle queue");
        self.q.read(offset, buf, len, 0, ReqFlags::empty());
        self.in_flight += 1;
        let done = self.wait(1);
        match done.first().map(|c| c.1) {
            Some(0) => Ok(()),
            Some(ret) => Err(-ret),
            None => Err(libc::EIO),
        }
    }

    /// Writes `data` at `offset` (through the start of the queue buffer).
    pub fn write_at(&mut self, offset: u64, data: &[u8]) -> Result<(), i32> {
        self.buf()[..data.len()].copy_from_slice(data);
        self.run(&Op::Write {
            offset,
            buf: 0,
            len: data.len(),
        })
    }

    /// Reads `len` bytes at `offset` (through the start of the queue buffer).
    pub fn read_at(&mut self, offset: u64, len: usize) -> Result<Vec<u8>, i32> {
        self.run(&Op::Read {
            offset,
            buf: 0,
            len,
        })?;
        Ok(self.buf()[..len].to_vec())
    }

    /// Flushes.
    pub fn flush(&mut self) -> Result<(), i32> {
        self.run(&Op::Flush)
    }

    /// Runs `count` requests with up to `depth` in flight.
    ///
    /// The buffer is cut into `depth` slots. `start(i, slot)` prepares request `i` in a free
    /// slot and returns it with buffer offsets relative to the slot; `done(i, slot, ret)` sees
    /// the slot right after request `i` completed, before it is reused. Requests may complete
    /// in any order.
    pub fn pipeline(
        &mut self,
        count: usize,
        depth: usize,
        mut start: impl FnMut(usize, &mut [u8]) -> Op,
        mut done: impl FnMut(usize, &[u8], i32),
    ) {
        assert!(depth > 0 && self.in_flight == 0);
        let slot_len = self.len / depth;
        let mut free: Vec<usize> = (0..depth).rev().collect();
        let mut slot_of = HashMap::new();
        let mut next = 0;
        while next < count || !slot_of.is_empty() {
            while next < count {
                let Some(slot) = free.pop() else { break };
                let base = slot * slot_len;
                let op = start(next, &mut self.buf()[base..base + slot_len]);
                self.submit(&op.rebased(base, slot_len), next);
                slot_of.insert(next, slot);
                next += 1;
            }
            for (i, ret) in self.wait(1) {
                let slot = slot_of
                    .remove(&i)
                    .expect("completion for an unknown request");
                let base = slot * slot_len;
                done(i, &self.buf()[base..base + slot_len], ret);
                free.push(slot);
            }
        }
    }
}

/// A readable name for a libblkio errno value.
pub fn errno_name(errno: i32) -> String {
    format!("{errno} ({})", std::io::Error::from_raw_os_error(errno))
}

/// Liveness check through a fresh libblkio connection: connects to `socket`, writes 4 KiB of
/// `pattern(seed)` at `offset` (4 KiB aligned, so it suits either block size), reads it back
/// and disconnects. Panics on any failure.
#[track_caller]
pub fn check_fresh_connection(socket: &Path, offset: u64, seed: u64) {
    let mut c = Client::connect(socket)
        .unwrap_or_else(|e| panic!("fresh libblkio connection failed: {e} ({:?})", e.errno()));
    let q = c.queue(0);
    let data = crate::pattern(seed, 4096);
    q.write_at(offset, &data)
        .unwrap_or_else(|e| panic!("write on a fresh connection: {}", errno_name(e)));
    let back = q
        .read_at(offset, 4096)
        .unwrap_or_else(|e| panic!("read on a fresh connection: {}", errno_name(e)));
    crate::assert_same_data("read-back on a fresh connection", &back, &data);
}
