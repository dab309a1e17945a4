//! The life of one request inside the iothread: a small state machine per ring slot that says
//! which operation to issue next and interprets each result (short transfers, `EAGAIN`, the
//! O_DIRECT fallback, fdatasync after a writethrough write, the fallocate fallbacks).
//!
//! It performs no system call itself, so every transition is unit-tested without io_uring; the
//! engine turns [`Step::Issue`] into an SQE and feeds the CQE result back. A null image's
//! requests never issue anything: [`SlotState::run_null`] completes them on the spot.
//!
//! A slot has at most one operation queued or in flight at any time (multi-range requests run
//! their ranges one after the other), which bounds the io_uring completion queue by the slot
//! count and keeps the buffers an operation points at untouched until its CQE arrives.

use blkplane_proto::ring::Opcode;
use virtio_bindings::virtio_blk::VIRTIO_BLK_S_OK;

use crate::request::{ImageRange, Request};

/// The kernel's limit on iovecs per readv/writev (`UIO_MAXIOV`); longer requests are split.
pub const MAX_IOVECS_PER_OP: usize = libc::UIO_MAXIOV as usize;

/// The kind of operation a slot has queued or in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Stage {
    /// A readv/writev.
    Transfer = 1,
    /// An fdatasync (a flush, or the tail of a writethrough write).
    Fsync = 2,
    /// An fallocate on one discard/write-zeroes range.
    Range = 3,
}

impl Stage {
    /// Decodes a stage packed into io_uring user data.
    pub fn from_raw(raw: u8) -> Option<Self> {
        Some(match raw {
            1 => Self::Transfer,
            2 => Self::Fsync,
            3 => Self::Range,
            _ => return None,
        })
    }
}

/// What the engine must do next for a slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Queue the slot's next operation of this kind.
    Issue(Stage),
    /// The request is done; complete it with this virtio-blk status.
    Complete(u32),
    /// The request failed with this errno; complete it with `VIRTIO_BLK_S_IOERR`.
    Failed(i32),
}

/// How a range is zeroed or deallocated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RangeMode {
    /// `FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE`: deallocates; reads back zeros.
    PunchHole,
    /// `FALLOC_FL_ZERO_RANGE | FALLOC_FL_KEEP_SIZE`: zeroes, keeping the blocks allocated.
    ZeroRange,
}

impl RangeMode {
    /// The fallocate mode bits.
    pub fn flags(self) -> i32 {
        match self {
            Self::PunchHole => libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            Self::ZeroRange => libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE,
        }
    }

    fn other(self) -> Self {
        match self {
            Self::PunchHole => Self::ZeroRange,
            Self::ZeroRange => Self::PunchHole,
        }
    }
}

/// Which fallocate modes the image supports, learnt from `EOPNOTSUPP` results and shared by all
/// slots, so that e.g. tmpfs pays the failed `ZERO_RANGE` once rather than on every request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FallocateSupport {
    punch_hole: bool,
    zero_range: bool,
}

impl Default for FallocateSupport {
    fn default() -> Self {
        Self {
            punch_hole: true,
            zero_range: true,
        }
    }
}

impl FallocateSupport {
    fn supports(&self, mode: RangeMode) -> bool {
        match mode {
            RangeMode::PunchHole => self.punch_hole,
            RangeMode::ZeroRange => self.zero_range,
        }
    }

    fn mark_unsupported(&mut self, mode: RangeMode) {
        match mode {
            RangeMode::PunchHole => self.punch_hole = false,
            RangeMode::ZeroRange => self.zero_range = false,
        }
    }
}

/// Where the next transfer of a qcow2 image's request goes, as its mapping said: the file
/// (`layer`: 0 the image, *i* its *i*-th backing file), the offset in it, and how many bytes
/// are contiguous there. A raw image's transfers have none: they go to the image offset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TransferTarget {
    /// The file of the chain.
    pub layer: usize,
    /// Offset in that file of the request's next byte.
    pub host_offset: u64,
    /// Bytes contiguous there; the transfer moves at most this many.
    pub limit: u64,
}

/// One readv/writev to submit, as computed by [`SlotState::next_transfer`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transfer {
    /// First iovec; points into the slot's own buffer, stable until the slot completes.
    pub iovecs: *const libc::iovec,
    /// Number of iovecs.
    pub count: u32,
    /// Image offset.
    pub offset: u64,
    /// Write (true) or read (false).
    pub write: bool,
    /// Use the O_DIRECT fd.
    pub direct: bool,
    /// The file of a qcow2 chain (0, the image, for a raw image).
    pub layer: usize,
    /// Bytes the iovecs describe.
    pub len: u64,
}

/// One fallocate to submit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RangeOp {
    /// Image offset.
    pub offset: u64,
    /// Length.
    pub len: u64,
    /// fallocate mode bits.
    pub mode: i32,
}

/// The iothread's private state for one ring slot, allocated once at setup.
pub struct SlotState {
    stage: Option<Stage>,
    opcode: Opcode,
    iovecs: Box<[libc::iovec]>,
    /// First iovec not completely transferred yet.
    iov_next: usize,
    /// One past the request's last iovec.
    iov_end: usize,
    /// Image offset of the next byte to transfer.
    offset: u64,
    /// Bytes still to transfer.
    remaining: u64,
    /// fdatasync once the write is done.
    sync: bool,
    /// Bytes the in-flight transfer asked for.
    submitted: u64,
    /// The in-flight transfer went through the O_DIRECT fd.
    used_direct: bool,
    /// O_DIRECT failed with EINVAL for this request: finish it buffered.
    direct_refused: bool,
    ranges: Box<[ImageRange]>,
    range_next: usize,
    range_end: usize,
    mode: RangeMode,
    /// Where the next transfer goes (a qcow2 image's mapping), if not to `offset`.
    target: Option<TransferTarget>,
    /// An iovec the transfer in flight cut short to its target's limit: its index and the
    /// bytes cut off, given back when the transfer's result comes.
    split: Option<(usize, usize)>,
}

impl SlotState {
    /// An idle slot with room for `segments` iovecs or ranges.
    pub fn new(segments: usize) -> Self {
        let empty = libc::iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: 0,
        };
        Self {
            stage: None,
            opcode: Opcode::Flush,
            iovecs: vec![empty; segments].into_boxed_slice(),
            iov_next: 0,
            iov_end: 0,
            offset: 0,
            remaining: 0,
            sync: false,
            submitted: 0,
            used_direct: false,
            direct_refused: false,
            ranges: vec![ImageRange::default(); segments].into_boxed_slice(),
            range_next: 0,
            range_end: 0,
            mode: RangeMode::PunchHole,
            target: None,
            split: None,
        }
    }

    /// The guest offset of the transfer's next byte (meaningful during [`Stage::Transfer`]).
    pub fn guest_offset(&self) -> u64 {
        self.offset
    }

    /// The bytes the transfer still has to move.
    pub fn remaining(&self) -> u64 {
        self.remaining
    }

    /// Sends the next transfer to `target` instead of the image offset (a qcow2 image's
    /// mapping of [`SlotState::guest_offset`]); it moves at most `target.limit` bytes. Holds
    /// for one transfer: its result clears it.
    pub fn set_target(&mut self, target: TransferTarget) {
        self.target = Some(target);
    }

    /// Fails the request with `errno` outside any transfer result (a qcow2 metadata error).
    pub fn fail(&mut self, errno: i32) -> Step {
        self.restore_split();
        self.target = None;
        self.record(Step::Failed(errno))
    }

    /// Gives back the bytes [`SlotState::next_transfer`] cut off an iovec.
    fn restore_split(&mut self) {
        if let Some((index, tail)) = self.split.take() {
            if let Some(iov) = self.iovecs.get_mut(index) {
                iov.iov_len = iov.iov_len.saturating_add(tail);
            }
        }
    }

    /// The operation queued or in flight; `None` when the slot is idle.
    pub fn stage(&self) -> Option<Stage> {
        self.stage
    }

    /// The request's opcode (meaningful while the slot is busy).
    pub fn opcode(&self) -> Opcode {
        self.opcode
    }

    /// The buffers [`crate::request::parse`] fills. Only while the slot is idle: a busy slot's
    /// iovecs may still be read by the kernel.
    pub fn buffers(&mut self) -> Option<(&mut [libc::iovec], &mut [ImageRange])> {
        if self.stage.is_some() {
            return None;
        }
        Some((&mut self.iovecs, &mut self.ranges))
    }

    fn record(&mut self, step: Step) -> Step {
        self.stage = match step {
            Step::Issue(stage) => Some(stage),
            Step::Complete(_) | Step::Failed(_) => None,
        };
        step
    }

    /// Starts a request parsed into [`SlotState::buffers`].
    pub fn begin(&mut self, request: Request, support: &FallocateSupport) -> Step {
        self.direct_refused = false;
        let step = match request {
            Request::Read {
                image_offset,
                len,
                iovecs,
            } => self.begin_transfer(Opcode::Read, image_offset, len, iovecs, false),
            Request::Write {
                image_offset,
                len,
                iovecs,
                sync,
            } => self.begin_transfer(Opcode::Write, image_offset, len, iovecs, sync),
            Request::Flush => {
                self.opcode = Opcode::Flush;
                Step::Issue(Stage::Fsync)
            }
            Request::Answer { status } => {
                self.opcode = Opcode::Answer;
                Step::Complete(status)
            }
            Request::Discard { ranges } => self.begin_ranges(Opcode::Discard, ranges, support),
            Request::WriteZeroes { ranges } => {
                self.begin_ranges(Opcode::WriteZeroes, ranges, support)
            }
        };
        self.record(step)
    }

    /// Executes `request` on a null image, at once and without I/O: a read zero-fills its
    /// buffers (as QEMU's null-co with read-zeroes=on does), a write is dropped, and flush,
    /// discard and write-zeroes have nothing to do — nor does a writethrough write's sync.
    /// The slot is idle again when this returns.
    ///
    /// # Safety
    /// For a read, the first `iovecs` entries of [`SlotState::buffers`] must describe memory
    /// that is mapped writable for the whole call, as [`crate::request::parse`] leaves them
    /// for the current memory table.
    pub unsafe fn run_null(&mut self, request: Request) -> Step {
        self.opcode = match request {
            Request::Answer { status } => {
                self.opcode = Opcode::Answer;
                return self.record(Step::Complete(status));
            }
            Request::Read { iovecs, .. } => {
                for iov in self.iovecs.get(..iovecs).unwrap_or_default() {
                    // SAFETY: the caller guarantees the buffer is mapped writable. Guest memory
                    // is shared with the guest, which may touch it concurrently, as it may
                    // while a device DMAs into it; no Rust reference to it exists, so this
                    // raw write aliases nothing.
                    unsafe { std::ptr::write_bytes(iov.iov_base.cast::<u8>(), 0, iov.iov_len) };
                }
                Opcode::Read
            }
            Request::Write { .. } => Opcode::Write,
            Request::Flush => Opcode::Flush,
            Request::Discard { .. } => Opcode::Discard,
            Request::WriteZeroes { .. } => Opcode::WriteZeroes,
        };
        self.record(Step::Complete(VIRTIO_BLK_S_OK))
    }

    fn begin_transfer(
        &mut self,
        opcode: Opcode,
        offset: u64,
        len: u64,
        iovecs: usize,
        sync: bool,
    ) -> Step {
        self.opcode = opcode;
        self.target = None;
        self.split = None;
        self.iov_next = 0;
        self.iov_end = iovecs.min(self.iovecs.len());
        self.offset = offset;
        self.remaining = len;
        self.sync = sync;
        self.transfer_done_or_continue()
    }

    fn transfer_done_or_continue(&mut self) -> Step {
        if self.remaining > 0 {
            Step::Issue(Stage::Transfer)
        } else if self.sync {
            Step::Issue(Stage::Fsync)
        } else {
            Step::Complete(VIRTIO_BLK_S_OK)
        }
    }

    fn begin_ranges(&mut self, opcode: Opcode, ranges: usize, support: &FallocateSupport) -> Step {
        self.opcode = opcode;
        self.range_next = 0;
        self.range_end = ranges.min(self.ranges.len());
        self.next_range(support)
    }

    /// Picks the mode for range `range_next`, or finishes the request.
    fn next_range(&mut self, support: &FallocateSupport) -> Step {
        let Some(range) = self
            .ranges
            .get(self.range_next)
            .filter(|_| self.range_next < self.range_end)
        else {
            return Step::Complete(VIRTIO_BLK_S_OK);
        };
        if self.opcode == Opcode::Discard {
            if !support.supports(RangeMode::PunchHole) {
                // Discard is advisory: a file system that cannot deallocate just keeps the data.
                return Step::Complete(VIRTIO_BLK_S_OK);
            }
            self.mode = RangeMode::PunchHole;
            return Step::Issue(Stage::Range);
        }
        let preferred = if range.unmap {
            RangeMode::PunchHole
        } else {
            RangeMode::ZeroRange
        };
        if support.supports(preferred) {
            self.mode = preferred;
        } else if support.supports(preferred.other()) {
            // Both modes read back zeros; only the allocation differs.
            self.mode = preferred.other();
        } else {
            return Step::Failed(libc::EOPNOTSUPP);
        }
        Step::Issue(Stage::Range)
    }

    /// The readv/writev to submit for [`Stage::Transfer`]. `direct_block_size` is the logical
    /// block size when an O_DIRECT fd exists; it is used only if the image offset and every
    /// iovec are aligned to it (the buffered fd is correct for any alignment), and only for the
    /// image itself, not a backing file. With a target ([`SlotState::set_target`]) the
    /// transfer goes there and moves at most its limit, cutting the last iovec short if need
    /// be (until the result comes).
    pub fn next_transfer(&mut self, direct_block_size: Option<u32>) -> Transfer {
        self.restore_split();
        let start = self.iov_next.min(self.iov_end);
        let available = self.iov_end.saturating_sub(start).min(MAX_IOVECS_PER_OP);
        let mut count = available;
        if let Some(target) = self.target {
            let mut total = 0u64;
            for (i, iov) in self
                .iovecs
                .get_mut(start..start.saturating_add(available))
                .unwrap_or_default()
                .iter_mut()
                .enumerate()
            {
                let len = iov.iov_len as u64;
                if total.saturating_add(len) >= target.limit {
                    // Fits a usize: it is less than or equal to this iovec's length.
                    let needed = blkplane_proto::usize_from(target.limit.saturating_sub(total));
                    if needed < iov.iov_len {
                        self.split =
                            Some((start.saturating_add(i), iov.iov_len.saturating_sub(needed)));
                        iov.iov_len = needed;
                    }
                    count = i.saturating_add(1);
                    break;
                }
                total = total.saturating_add(len);
            }
        }
        let chunk = self
            .iovecs
            .get(start..start.saturating_add(count))
            .unwrap_or_default();
        let (offset, layer) = match self.target {
            Some(target) => (target.host_offset, target.layer),
            None => (self.offset, 0),
        };
        let direct = !self.direct_refused
            && layer == 0
            && direct_block_size.is_some_and(|block| direct_io_allowed(offset, chunk, block));
        self.submitted = chunk.iter().map(|iov| iov.iov_len as u64).sum();
        self.used_direct = direct;
        Transfer {
            iovecs: chunk.as_ptr(),
            // At most MAX_IOVECS_PER_OP, so the conversion never saturates.
            count: u32::try_from(chunk.len()).unwrap_or(u32::MAX),
            offset,
            write: self.opcode == Opcode::Write,
            direct,
            layer,
            len: self.submitted,
        }
    }

    /// Interprets the result of the transfer issued last.
    pub fn on_transfer(&mut self, result: i32) -> Step {
        self.restore_split();
        // A qcow2 image's next transfer is mapped anew from where this one ended.
        self.target = None;
        // The kernel returns -4095..=-1 for errors; saturating keeps a result outside that
        // (i32::MIN) an unknown errno instead of an overflow.
        let step = if result < 0 {
            match result.saturating_neg() {
                libc::EAGAIN | libc::EINTR => Step::Issue(Stage::Transfer),
                // The device wants a stricter alignment than the logical block size promised;
                // the buffered fd accepts anything.
                libc::EINVAL if self.used_direct => {
                    self.direct_refused = true;
                    Step::Issue(Stage::Transfer)
                }
                errno => Step::Failed(errno),
            }
        } else {
            let done = u64::from(result.unsigned_abs());
            if done == 0 || done > self.submitted {
                // A read at end of file, a write that makes no progress, or a kernel claiming
                // more than was asked: retrying cannot help.
                Step::Failed(libc::EIO)
            } else {
                let pending = self
                    .iovecs
                    .get_mut(self.iov_next..self.iov_end)
                    .unwrap_or_default();
                // advance() returns at most pending.len() = iov_end - iov_next.
                self.iov_next = self.iov_next.saturating_add(advance(pending, done));
                self.offset = self.offset.saturating_add(done);
                self.remaining = self.remaining.saturating_sub(done);
                if self.remaining > 0 && self.iov_next >= self.iov_end {
                    Step::Failed(libc::EIO)
                } else {
                    self.transfer_done_or_continue()
                }
            }
        };
        self.record(step)
    }

    /// Interprets the result of an fdatasync.
    pub fn on_fsync(&mut self, result: i32) -> Step {
        let step = match result {
            0.. => Step::Complete(VIRTIO_BLK_S_OK),
            _ => match result.saturating_neg() {
                libc::EAGAIN | libc::EINTR => Step::Issue(Stage::Fsync),
                errno => Step::Failed(errno),
            },
        };
        self.record(step)
    }

    /// The fallocate to submit for [`Stage::Range`].
    pub fn current_range(&self) -> Option<RangeOp> {
        let range = self.ranges.get(self.range_next)?;
        Some(RangeOp {
            offset: range.offset,
            len: range.len,
            mode: self.mode.flags(),
        })
    }

    /// Interprets the result of the fallocate issued last; `support` learns from `EOPNOTSUPP`.
    pub fn on_range(&mut self, result: i32, support: &mut FallocateSupport) -> Step {
        let step = match result {
            0.. => {
                // Bounded by the slot's range count.
                self.range_next = self.range_next.saturating_add(1);
                self.next_range(support)
            }
            _ => match result.saturating_neg() {
                libc::EAGAIN | libc::EINTR => Step::Issue(Stage::Range),
                libc::EOPNOTSUPP => {
                    // Retries the same range in the other mode, completes a discard, or fails a
                    // write-zeroes when neither mode works.
                    support.mark_unsupported(self.mode);
                    self.next_range(support)
                }
                errno => Step::Failed(errno),
            },
        };
        self.record(step)
    }
}

/// Consumes `done` bytes from the front of `iovecs`: returns how many iovecs are now fully
/// transferred, and shortens the first partially transferred one in place so that it describes
/// what is left of it.
pub fn advance(iovecs: &mut [libc::iovec], mut done: u64) -> usize {
    for (index, iov) in iovecs.iter_mut().enumerate() {
        let len = iov.iov_len as u64;
        if done < len {
            // `done < len` fits a usize because `iov_len` does.
            let done = blkplane_proto::usize_from(done);
            iov.iov_base = iov.iov_base.cast::<u8>().wrapping_add(done).cast();
            iov.iov_len = iov.iov_len.saturating_sub(done);
            return index;
        }
        // done >= len here.
        done = done.saturating_sub(len);
    }
    iovecs.len()
}

/// Whether a transfer may use the O_DIRECT fd: the image offset, every buffer address and every
/// length must be multiples of `block_size`.
pub fn direct_io_allowed(image_offset: u64, iovecs: &[libc::iovec], block_size: u32) -> bool {
    let block = u64::from(block_size);
    block != 0
        && image_offset.is_multiple_of(block)
        && iovecs.iter().all(|iov| {
            (iov.iov_base as usize as u64).is_multiple_of(block)
                && (iov.iov_len as u64).is_multiple_of(block)
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use virtio_bindings::virtio_blk::VIRTIO_BLK_S_OK as OK;

    fn iov(base: usize, len: usize) -> libc::iovec {
        libc::iovec {
            iov_base: base as *mut libc::c_void,
            iov_len: len,
        }
    }

    fn parts(iovecs: &[libc::iovec]) -> Vec<(usize, usize)> {
        iovecs
            .iter()
            .map(|i| (i.iov_base as usize, i.iov_len))
            .collect()
    }

    #[test]
    fn advance_within_between_and_past_iovecs() {
        let fresh = || [iov(0x1000, 100), iov(0x2000, 50), iov(0x3000, 10)];
        let mut v = fresh();
        assert_eq!(advance(&mut v, 0), 0);
        assert_eq!(parts(&v), parts(&fresh()));
        assert_eq!(advance(&mut v, 30), 0);
        assert_eq!(parts(&v)[0], (0x1000 + 30, 70));
        // Continuing from the adjusted iovec.
        assert_eq!(advance(&mut v, 70), 1);
        let mut v = fresh();
        assert_eq!(advance(&mut v, 120), 1);
        assert_eq!(parts(&v)[1], (0x2000 + 20, 30));
        assert_eq!(parts(&v)[2], (0x3000, 10));
        let mut v = fresh();
        assert_eq!(advance(&mut v, 150), 2);
        assert_eq!(parts(&v)[2], (0x3000, 10));
        let mut v = fresh();
        assert_eq!(advance(&mut v, 160), 3);
        let mut v = fresh();
        assert_eq!(advance(&mut v, 1000), 3, "never runs past the end");
        assert_eq!(advance(&mut [], 5), 0);
    }

    #[test]
    fn direct_io_needs_everything_aligned() {
        let aligned = [iov(0x10000, 4096), iov(0x20200, 512)];
        assert!(direct_io_allowed(0, &aligned, 512));
        assert!(direct_io_allowed(1 << 40, &aligned, 512));
        assert!(
            !direct_io_allowed(0, &aligned, 4096),
            "second iovec is 512-aligned only"
        );
        assert!(!direct_io_allowed(512 + 1, &aligned, 512), "image offset");
        assert!(!direct_io_allowed(0, &[iov(0x10001, 512)], 512), "address");
        assert!(!direct_io_allowed(0, &[iov(0x10000, 513)], 512), "length");
        assert!(!direct_io_allowed(0, &aligned, 0));
        assert!(direct_io_allowed(4096, &[], 4096));
    }

    fn slot_with(iovecs: &[libc::iovec]) -> SlotState {
        let mut slot = SlotState::new(8);
        let (buf, _) = slot.buffers().unwrap();
        buf[..iovecs.len()].copy_from_slice(iovecs);
        slot
    }

    fn read(len: u64, iovecs: usize) -> Request {
        Request::Read {
            image_offset: 4096,
            len,
            iovecs,
        }
    }

    /// The iovecs of a transfer, as (address, length) pairs.
    fn chunk(t: &Transfer) -> Vec<(usize, usize)> {
        // SAFETY: t.iovecs points at t.count iovecs in the slot's buffer.
        parts(unsafe { std::slice::from_raw_parts(t.iovecs, t.count as usize) })
    }

    #[test]
    fn a_mapped_transfer_stops_at_its_extent_and_the_next_goes_on_from_there() {
        let mut slot = slot_with(&[iov(0x1000, 100), iov(0x2000, 50), iov(0x3000, 10)]);
        let support = FallocateSupport::default();
        assert_eq!(
            slot.begin(read(160, 3), &support),
            Step::Issue(Stage::Transfer)
        );
        assert_eq!((slot.guest_offset(), slot.remaining()), (4096, 160));
        // The extent ends 20 bytes into the second iovec: it is cut there.
        slot.set_target(TransferTarget {
            layer: 2,
            host_offset: 1 << 20,
            limit: 120,
        });
        let t = slot.next_transfer(Some(512));
        assert_eq!(
            (t.offset, t.layer, t.len, t.direct),
            (1 << 20, 2, 120, false)
        );
        assert_eq!(chunk(&t), [(0x1000, 100), (0x2000, 20)]);
        // A short result inside the cut: the cut bytes come back, the rest goes on.
        assert_eq!(slot.on_transfer(110), Step::Issue(Stage::Transfer));
        assert_eq!((slot.guest_offset(), slot.remaining()), (4096 + 110, 50));
        let t = slot.next_transfer(None);
        assert_eq!(
            (t.offset, t.layer),
            (4096 + 110, 0),
            "no target: the guest offset"
        );
        assert_eq!(chunk(&t), [(0x2000 + 10, 40), (0x3000, 10)]);
        // The next extent is exactly one iovec long: nothing is cut.
        slot.set_target(TransferTarget {
            layer: 0,
            host_offset: 8192,
            limit: 40,
        });
        let t = slot.next_transfer(None);
        assert_eq!(chunk(&t), [(0x2000 + 10, 40)]);
        assert_eq!(slot.on_transfer(40), Step::Issue(Stage::Transfer));
        // A longer extent than the request: all that is left.
        slot.set_target(TransferTarget {
            layer: 0,
            host_offset: 0,
            limit: 1 << 30,
        });
        let t = slot.next_transfer(None);
        assert_eq!(chunk(&t), [(0x3000, 10)]);
        assert_eq!(slot.on_transfer(10), Step::Complete(OK));
    }

    #[test]
    fn a_failed_mapping_gives_the_cut_bytes_back() {
        let mut slot = slot_with(&[iov(0x1000, 100)]);
        let support = FallocateSupport::default();
        slot.begin(read(100, 1), &support);
        slot.set_target(TransferTarget {
            layer: 0,
            host_offset: 0,
            limit: 30,
        });
        let t = slot.next_transfer(None);
        assert_eq!(chunk(&t), [(0x1000, 30)]);
        assert_eq!(slot.fail(libc::EIO), Step::Failed(libc::EIO));
        assert_eq!(slot.stage(), None);
        let (buf, _) = slot.buffers().unwrap();
        assert_eq!(parts(&buf[..1]), [(0x1000, 100)]);
    }

    #[test]
    fn short_transfers_continue_where_they_stopped() {
        let mut slot = slot_with(&[iov(0x1000, 512), iov(0x8000, 1024)]);
        let support = FallocateSupport::default();
        assert_eq!(
            slot.begin(read(1536, 2), &support),
            Step::Issue(Stage::Transfer)
        );
        assert!(
            slot.buffers().is_none(),
            "busy slots do not hand out buffers"
        );
        let t = slot.next_transfer(None);
        assert_eq!(
            (t.count, t.offset, t.write, t.direct),
            (2, 4096, false, false)
        );
        assert_eq!(slot.on_transfer(700), Step::Issue(Stage::Transfer));
        let t = slot.next_transfer(None);
        assert_eq!((t.count, t.offset), (1, 4096 + 700));
        // SAFETY: t.iovecs points at one iovec in the slot's buffer.
        let first = unsafe { *t.iovecs };
        assert_eq!(
            (first.iov_base as usize, first.iov_len),
            (0x8000 + 188, 836)
        );
        assert_eq!(
            slot.on_transfer(-libc::EAGAIN),
            Step::Issue(Stage::Transfer)
        );
        assert_eq!(
            slot.next_transfer(None).offset,
            4096 + 700,
            "EAGAIN retries as is"
        );
        assert_eq!(slot.on_transfer(836), Step::Complete(OK));
        assert_eq!(slot.stage(), None);
    }

    #[test]
    fn transfer_failures() {
        let support = FallocateSupport::default();
        let mut slot = slot_with(&[iov(0x1000, 512)]);
        slot.begin(read(512, 1), &support);
        slot.next_transfer(None);
        assert_eq!(slot.on_transfer(0), Step::Failed(libc::EIO), "EOF");
        slot.begin(read(512, 1), &support);
        slot.next_transfer(None);
        assert_eq!(slot.on_transfer(-libc::EIO), Step::Failed(libc::EIO));
        slot.begin(read(512, 1), &support);
        slot.next_transfer(None);
        assert_eq!(
            slot.on_transfer(513),
            Step::Failed(libc::EIO),
            "more than asked"
        );
        slot.begin(read(512, 1), &support);
        slot.next_transfer(None);
        assert_eq!(slot.on_transfer(-libc::EINVAL), Step::Failed(libc::EINVAL));
    }

    #[test]
    fn any_result_is_an_answer_even_i32_min() {
        let mut support = FallocateSupport::default();
        let mut slot = slot_with(&[iov(0x1000, 512)]);
        slot.begin(read(512, 1), &support);
        slot.next_transfer(None);
        assert_eq!(slot.on_transfer(i32::MIN), Step::Failed(i32::MAX));
        slot.begin(Request::Flush, &support);
        assert_eq!(slot.on_fsync(i32::MIN), Step::Failed(i32::MAX));
        let mut slot = ranges_slot(&[range(0, false)]);
        slot.begin(Request::WriteZeroes { ranges: 1 }, &support);
        assert_eq!(
            slot.on_range(i32::MIN, &mut support),
            Step::Failed(i32::MAX)
        );
    }

    #[test]
    fn direct_einval_falls_back_to_buffered() {
        let support = FallocateSupport::default();
        let mut slot = slot_with(&[iov(0x1000, 512)]);
        slot.begin(read(512, 1), &support);
        assert!(slot.next_transfer(Some(512)).direct);
        assert_eq!(
            slot.on_transfer(-libc::EINVAL),
            Step::Issue(Stage::Transfer)
        );
        assert!(!slot.next_transfer(Some(512)).direct);
        assert_eq!(slot.on_transfer(512), Step::Complete(OK));
        // The next request tries O_DIRECT again.
        slot.begin(read(512, 1), &support);
        assert!(slot.next_transfer(Some(512)).direct);
        // Misaligned for 4096.
        assert!(!slot.next_transfer(Some(4096)).direct);
    }

    #[test]
    fn long_requests_are_split_at_the_iovec_limit() {
        let count = MAX_IOVECS_PER_OP + 5;
        let mut slot = SlotState::new(count);
        let (buf, _) = slot.buffers().unwrap();
        for (i, v) in buf.iter_mut().enumerate() {
            *v = iov(0x10000 + i * 0x1000, 512);
        }
        let support = FallocateSupport::default();
        let total = 512 * count as u64;
        slot.begin(read(total, count), &support);
        let t = slot.next_transfer(None);
        assert_eq!(t.count as usize, MAX_IOVECS_PER_OP);
        let step = slot.on_transfer(512 * MAX_IOVECS_PER_OP as i32);
        assert_eq!(step, Step::Issue(Stage::Transfer));
        let t = slot.next_transfer(None);
        assert_eq!(t.count, 5);
        assert_eq!(slot.on_transfer(5 * 512), Step::Complete(OK));
    }

    #[test]
    fn writethrough_write_syncs_before_completing() {
        let support = FallocateSupport::default();
        let mut slot = slot_with(&[iov(0x1000, 512)]);
        let write = Request::Write {
            image_offset: 0,
            len: 512,
            iovecs: 1,
            sync: true,
        };
        assert_eq!(slot.begin(write, &support), Step::Issue(Stage::Transfer));
        assert!(slot.next_transfer(None).write);
        assert_eq!(slot.on_transfer(512), Step::Issue(Stage::Fsync));
        assert_eq!(slot.on_fsync(-libc::EINTR), Step::Issue(Stage::Fsync));
        assert_eq!(slot.on_fsync(0), Step::Complete(OK));
        assert_eq!(slot.begin(write, &support), Step::Issue(Stage::Transfer));
        slot.next_transfer(None);
        slot.on_transfer(512);
        assert_eq!(slot.on_fsync(-libc::EIO), Step::Failed(libc::EIO));
        // An empty write with SYNC is just a sync; an empty read completes at once.
        let empty = Request::Write {
            image_offset: 0,
            len: 0,
            iovecs: 0,
            sync: true,
        };
        assert_eq!(slot.begin(empty, &support), Step::Issue(Stage::Fsync));
        slot.on_fsync(0);
        assert_eq!(slot.begin(read(0, 0), &support), Step::Complete(OK));
        assert_eq!(
            slot.begin(Request::Flush, &support),
            Step::Issue(Stage::Fsync)
        );
    }

    fn ranges_slot(ranges: &[ImageRange]) -> SlotState {
        let mut slot = SlotState::new(8);
        let (_, buf) = slot.buffers().unwrap();
        buf[..ranges.len()].copy_from_slice(ranges);
        slot
    }

    fn range(offset: u64, unmap: bool) -> ImageRange {
        ImageRange {
            offset,
            len: 4096,
            unmap,
        }
    }

    #[test]
    fn ranges_run_one_after_the_other() {
        let mut support = FallocateSupport::default();
        let mut slot = ranges_slot(&[range(0, false), range(8192, true)]);
        let step = slot.begin(Request::WriteZeroes { ranges: 2 }, &support);
        assert_eq!(step, Step::Issue(Stage::Range));
        let op = slot.current_range().unwrap();
        assert_eq!((op.offset, op.len), (0, 4096));
        assert_eq!(op.mode, RangeMode::ZeroRange.flags());
        assert_eq!(slot.on_range(0, &mut support), Step::Issue(Stage::Range));
        let op = slot.current_range().unwrap();
        assert_eq!(op.offset, 8192);
        assert_eq!(
            op.mode,
            RangeMode::PunchHole.flags(),
            "UNMAP prefers punching"
        );
        assert_eq!(
            slot.on_range(-libc::EAGAIN, &mut support),
            Step::Issue(Stage::Range)
        );
        assert_eq!(slot.on_range(0, &mut support), Step::Complete(OK));
        slot.begin(Request::WriteZeroes { ranges: 2 }, &support);
        assert_eq!(
            slot.on_range(-libc::EIO, &mut support),
            Step::Failed(libc::EIO)
        );
        assert_eq!(
            slot.begin(Request::Discard { ranges: 0 }, &support),
            Step::Complete(OK)
        );
    }

    #[test]
    fn write_zeroes_falls_back_between_modes() {
        let mut support = FallocateSupport::default();
        let mut slot = ranges_slot(&[range(0, false), range(4096, false)]);
        slot.begin(Request::WriteZeroes { ranges: 2 }, &support);
        // tmpfs: no ZERO_RANGE, so the same range is retried with PUNCH_HOLE.
        let step = slot.on_range(-libc::EOPNOTSUPP, &mut support);
        assert_eq!(step, Step::Issue(Stage::Range));
        let op = slot.current_range().unwrap();
        assert_eq!((op.offset, op.mode), (0, RangeMode::PunchHole.flags()));
        assert_eq!(slot.on_range(0, &mut support), Step::Issue(Stage::Range));
        assert_eq!(
            slot.current_range().unwrap().mode,
            RangeMode::PunchHole.flags()
        );
        assert_eq!(slot.on_range(0, &mut support), Step::Complete(OK));
        // Remembered for the next request.
        slot.begin(Request::WriteZeroes { ranges: 1 }, &support);
        assert_eq!(
            slot.current_range().unwrap().mode,
            RangeMode::PunchHole.flags()
        );
        // Neither mode: IOERR.
        assert_eq!(
            slot.on_range(-libc::EOPNOTSUPP, &mut support),
            Step::Failed(libc::EOPNOTSUPP)
        );
        assert_eq!(
            slot.begin(Request::WriteZeroes { ranges: 1 }, &support),
            Step::Failed(libc::EOPNOTSUPP)
        );
    }

    #[test]
    fn discard_without_punch_hole_succeeds() {
        let mut support = FallocateSupport::default();
        let mut slot = ranges_slot(&[range(0, false), range(4096, false)]);
        slot.begin(Request::Discard { ranges: 2 }, &support);
        assert_eq!(
            slot.current_range().unwrap().mode,
            RangeMode::PunchHole.flags()
        );
        assert_eq!(
            slot.on_range(-libc::EOPNOTSUPP, &mut support),
            Step::Complete(OK)
        );
        assert_eq!(
            slot.begin(Request::Discard { ranges: 2 }, &support),
            Step::Complete(OK)
        );
        // With UNMAP a write-zeroes now goes straight to ZERO_RANGE.
        let mut slot = ranges_slot(&[range(0, true)]);
        slot.begin(Request::WriteZeroes { ranges: 1 }, &support);
        assert_eq!(
            slot.current_range().unwrap().mode,
            RangeMode::ZeroRange.flags()
        );
    }

    #[test]
    fn null_reads_zero_fill_and_everything_else_just_completes() {
        let mut memory = vec![0xaau8; 8192];
        let base = memory.as_mut_ptr() as usize;
        let mut slot = slot_with(&[iov(base + 100, 1000), iov(base + 4096, 512)]);
        let write = Request::Write {
            image_offset: 0,
            len: 1512,
            iovecs: 2,
            sync: true,
        };
        // SAFETY: the iovecs point into `memory`, which outlives the calls and is not borrowed
        // meanwhile.
        unsafe {
            assert_eq!(slot.run_null(write), Step::Complete(OK));
            assert_eq!(slot.opcode(), Opcode::Write);
            assert!(
                memory.iter().all(|&b| b == 0xaa),
                "a write leaves the buffers"
            );
            for other in [
                Request::Flush,
                Request::Discard { ranges: 1 },
                Request::WriteZeroes { ranges: 2 },
            ] {
                assert_eq!(slot.run_null(other), Step::Complete(OK));
                assert_eq!(slot.stage(), None);
            }
            assert_eq!(slot.run_null(read(1512, 2)), Step::Complete(OK));
        }
        assert_eq!(slot.opcode(), Opcode::Read);
        assert_eq!(slot.stage(), None, "idle again: nothing is in flight");
        assert!(slot.buffers().is_some());
        assert!(memory[..100].iter().all(|&b| b == 0xaa));
        assert!(memory[100..1100].iter().all(|&b| b == 0));
        assert!(memory[1100..4096].iter().all(|&b| b == 0xaa));
        assert!(memory[4096..4608].iter().all(|&b| b == 0));
        assert!(memory[4608..].iter().all(|&b| b == 0xaa));
    }

    #[test]
    fn stages_round_trip() {
        for stage in [Stage::Transfer, Stage::Fsync, Stage::Range] {
            assert_eq!(Stage::from_raw(stage as u8), Some(stage));
        }
        assert_eq!(Stage::from_raw(0), None);
        assert_eq!(Stage::from_raw(9), None);
    }
}
