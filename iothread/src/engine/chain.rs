//! How the engine runs a request on a qcow2 image: each transfer is mapped first (an L2 cache
//! hit costs no system call), then
//! - data in a file (the image's allocated clusters, a backing file's) moves between guest
//!   memory and that file with the engine's own readv/writev at the mapped offset, through
//!   io_uring or inline as for a raw image;
//! - a read of zeros (unallocated down the whole chain, a zero cluster) zero-fills the guest
//!   buffers without I/O, and a read of a compressed cluster goes through imago;
//! - a write into a cluster the image does not own yet is an allocating write: imago prepares
//!   the cluster (copy-on-write of what the write leaves), the data is written into it with
//!   `pwritev`, and only then is the mapping committed, all before the loop goes on (see
//!   [`crate::qcow2`] for why it holds nothing across the loop). Two parts that could wait
//!   for a device are moved off it: the old data the copy reads is first read into the page
//!   cache through io_uring ([`Prefetch`]), and the metadata is written back once per pass of
//!   the loop, before anything it completed is published ([`Core::write_back_allocations`]).
//!   On an image served through O_DIRECT, a write that leaves part of its cluster to the
//!   backing chain instead writes the whole cluster through io_uring
//!   (`engine/cluster_write.rs`), and other requests into that cluster wait for it;
//! - write-zeroes and discard become zero clusters through imago (one that frees clusters
//!   first waits for the writes at the device into its range); a flush writes the metadata
//!   back before its fdatasync.
//!
//! A transfer moves at most one mapped extent; its result maps the next one. A failure of the
//! metadata (an entry past the end of the file, a read error) fails that request with IOERR
//! and leaves the disk up.

use std::io;
use std::os::fd::RawFd;

use blkplane_proto::control::ControlReply;
use blkplane_proto::ring::Opcode;
use io_uring::{opcode, squeue, types};
use log::{info, warn};

use super::{Core, EngineError, Token};
use crate::qcow2::Extent;
use crate::slot::{self, RangeMode, Stage, Step, TransferTarget};

/// The most bytes one mapped transfer moves, so that its byte count is a valid result.
const MAX_EXTENT: u64 = 1 << 30;

/// Where a slot's qcow2 allocating write stands with the read ahead of what it copies from
/// the old data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Prefetch {
    /// Not asked (or the allocation it was for is done).
    None,
    /// Queued or at the device: `len` bytes at `host_offset` of `layer`'s file.
    Reading {
        layer: usize,
        host_offset: u64,
        len: u32,
    },
    /// Done (or failed: imago reads what is missing itself): the allocation runs now.
    Read,
}

/// What [`Core::next_extent`] did with the slot's next extent.
enum Next {
    /// Handed to io_uring.
    Queued,
    /// Done on the spot: what the slot's state machine makes of it.
    Step(Step),
}

/// The errno of an imago error: the system call's, or `EIO` for a metadata problem.
fn errno_of(e: &io::Error) -> i32 {
    e.raw_os_error().unwrap_or(libc::EIO)
}

impl Core {
    /// Runs a slot's transfer on a qcow2 image, extent by extent, until it is handed to io_uring
    /// or finished.
    pub(super) fn map_transfer(&mut self, slot: u32) -> Result<(), EngineError> {
        loop {
            match self.next_extent(slot)? {
                Next::Queued => return Ok(()),
                Next::Step(Step::Issue(Stage::Transfer)) => continue,
                Next::Step(step) => return self.apply(slot, step),
            }
        }
    }

    /// Maps and runs the slot's next extent (or queues it, or the read ahead of its
    /// allocation).
    fn next_extent(&mut self, slot: u32) -> Result<Next, EngineError> {
        let count = self.slots.count();
        let (offset, remaining) = self
            .states
            .get(slot as usize)
            .map(|state| (state.guest_offset(), state.remaining()))
            .ok_or(EngineError::BadSlot { slot, count })?;
        // Up to the first cluster being written whole (a mapping may run into it: its new
        // cluster can follow the last one in the file); waits if it starts in one.
        let Some(clear) = self.clear_of_cluster_writes(slot, offset, remaining) else {
            return Ok(Next::Queued);
        };
        if self.cluster_writes.is_poisoned(offset, clear) {
            let step = self
                .states
                .get_mut(slot as usize)
                .ok_or(EngineError::BadSlot { slot, count })?
                .fail(libc::EIO);
            return Ok(Next::Step(step));
        }
        let bad_slot = EngineError::BadSlot { slot, count };
        let Core { states, image, .. } = self;
        let state = states.get_mut(slot as usize).ok_or(bad_slot)?;
        let inline = image.transfers_inline();
        let Some(chain) = image.qcow2_chain_mut() else {
            return Ok(Next::Step(state.fail(libc::EBADF)));
        };
        let write = state.opcode() == Opcode::Write;
        let extent = match chain.map(offset, clear.min(MAX_EXTENT)) {
            Ok(extent) if !extent.is_empty() => extent,
            Ok(_) => return Ok(Next::Step(state.fail(libc::EIO))),
            Err(e) => {
                if self.complaints.should_log() {
                    warn!("slot {slot}: mapping guest offset {offset}: {e}");
                }
                return Ok(Next::Step(state.fail(errno_of(&e))));
            }
        };
        let step = match (extent, write) {
            (
                Extent::Data {
                    layer,
                    host_offset,
                    len,
                    writable,
                },
                _,
            ) if !write || writable => {
                state.set_target(TransferTarget {
                    layer,
                    host_offset,
                    limit: len,
                });
                if inline {
                    return self.inline_call(slot).map(Next::Step);
                }
                self.counters.count_queued();
                self.pending.push_back(Token::Slot {
                    slot,
                    stage: Stage::Transfer,
                });
                return Ok(Next::Queued);
            }
            (Extent::Zero { len }, false) => {
                let transfer = limited(state, len);
                for iov in iovecs_of(&transfer) {
                    // SAFETY: the slot's iovecs point into guest memory mapped writable while
                    // the request is in flight (as `request::parse` left them); no Rust
                    // reference to guest memory exists, so this raw write aliases nothing.
                    unsafe { std::ptr::write_bytes(iov.iov_base.cast::<u8>(), 0, iov.iov_len) };
                }
                state.on_transfer(result_of(transfer.len))
            }
            (Extent::Compressed { len }, false) => {
                let transfer = limited(state, len);
                // SAFETY: as above, the iovecs describe guest memory mapped writable.
                match unsafe { chain.read_through(offset, transfer.len, iovecs_of(&transfer)) } {
                    Ok(()) => state.on_transfer(result_of(transfer.len)),
                    Err(e) => {
                        if self.complaints.should_log() {
                            warn!("slot {slot}: reading compressed data at {offset}: {e}");
                        }
                        state.fail(errno_of(&e))
                    }
                }
            }
            (extent, _) => {
                let len = extent.len();
                // `Read`: sent back to the in-place allocation (see `map_in_place`).
                let fresh = self.prefetch.get(slot as usize) == Some(&Prefetch::None);
                if fresh && self.begin_cluster_write(slot, offset)? {
                    return Ok(Next::Queued);
                }
                return self.allocate_in_place(slot, offset, len);
            }
        };
        Ok(Next::Step(step))
    }

    /// Runs the slot's allocating write in place (see the module): the in-place path of a
    /// cluster [`Core::begin_cluster_write`] found it could not allocate ahead after all.
    pub(super) fn map_in_place(&mut self, slot: u32) -> Result<(), EngineError> {
        if let Some(prefetch) = self.prefetch.get_mut(slot as usize) {
            // No read ahead either: the fill read the old data into the page cache.
            *prefetch = Prefetch::Read;
        }
        self.map_transfer(slot)
    }

    /// An allocating write of the slot's next `len` bytes at guest `offset` through imago,
    /// which copies what the write leaves of the old data (read ahead into the page cache
    /// first, through io_uring, where reads may wait for a device).
    fn allocate_in_place(&mut self, slot: u32, offset: u64, len: u64) -> Result<Next, EngineError> {
        let count = self.slots.count();
        let Core {
            states,
            image,
            prefetch,
            prefetch_sink,
            ..
        } = self;
        let state = states
            .get_mut(slot as usize)
            .ok_or(EngineError::BadSlot { slot, count })?;
        let prefetch = prefetch
            .get_mut(slot as usize)
            .ok_or(EngineError::BadSlot { slot, count })?;
        let inline = image.transfers_inline();
        let Some(chain) = image.qcow2_chain_mut() else {
            return Ok(Next::Step(state.fail(libc::EBADF)));
        };
        // The copy-on-write inside imago's allocation reads the old data on this
        // thread: on an image whose reads may wait for a device, that data is read
        // into the page cache through io_uring first, so the loop waits for no device.
        let source = (!inline && *prefetch == Prefetch::None)
            .then(|| chain.copy_on_write_source(offset, len))
            .flatten()
            .filter(|&(layer, _, _)| chain.layer_fd(layer).is_some());
        if let Some((layer, host_offset, len)) = source {
            if prefetch_sink.is_empty() {
                // One cluster (no read ahead is longer), allocated once: reads in
                // flight land in it, so it never moves afterwards.
                *prefetch_sink = vec![0; blkplane_proto::usize_from(chain.cluster_size())];
            }
            *prefetch = Prefetch::Reading {
                layer,
                host_offset,
                len: u32::try_from(len.min(prefetch_sink.len() as u64)).unwrap_or(0),
            };
            self.pending.push_back(Token::Prefetch { slot });
            return Ok(Next::Queued);
        }
        *prefetch = Prefetch::None;
        // Committed in imago's caches only: the loop writes the metadata back once for
        // every allocation of its pass, before any of them is acknowledged
        // ([`Core::write_back_allocations`]).
        let result = chain.allocating_write_in_memory(offset, len, |fd, host_offset, len| {
            state.set_target(TransferTarget {
                layer: 0,
                host_offset,
                limit: len,
            });
            let transfer = state.next_transfer(None);
            write_all(fd, iovecs_of(&transfer), host_offset)
        });
        let step = match result {
            Ok(written) => {
                if let Some(flag) = self.write_back_pending.get_mut(slot as usize) {
                    *flag = true;
                }
                self.metadata_dirty = true;
                state.on_transfer(result_of(written))
            }
            Err(e) => {
                if self.complaints.should_log() {
                    warn!("slot {slot}: allocating write at {offset}: {e}");
                }
                state.fail(errno_of(&e))
            }
        };
        Ok(Next::Step(step))
    }

    /// The SQE of the slot's read ahead: a read of the old data into the sink, only for the
    /// page cache to hold it.
    pub(super) fn prefetch_sqe(&mut self, slot: u32) -> Option<squeue::Entry> {
        let Some(&Prefetch::Reading {
            layer,
            host_offset,
            len,
        }) = self.prefetch.get(slot as usize)
        else {
            warn!("slot {slot}: a read ahead queued without its target");
            return None;
        };
        // `next_extent` checked the fd and sized the sink before it queued the read.
        let fd = self.image.qcow2_chain()?.layer_fd(layer)?;
        let entry = opcode::Read::new(types::Fd(fd), self.prefetch_sink.as_mut_ptr(), len)
            .offset(host_offset)
            .build();
        Some(entry.user_data(Token::Prefetch { slot }.encode()))
    }

    /// The read ahead of the slot's allocation is done (whatever its result: imago reads what
    /// is not in the page cache itself, and reports a failure of its own): the allocation runs.
    pub(super) fn prefetched(&mut self, slot: u32, result: i32) -> Result<(), EngineError> {
        let Some(prefetch) = self.prefetch.get_mut(slot as usize) else {
            warn!("ignoring a read-ahead completion for unknown slot {slot}");
            return Ok(());
        };
        if !matches!(prefetch, Prefetch::Reading { .. }) {
            warn!("ignoring a stale read-ahead completion for slot {slot}");
            return Ok(());
        }
        if result < 0 && self.complaints.should_log() {
            warn!(
                "slot {slot}: reading ahead for an allocation: {}",
                io::Error::from_raw_os_error(result.saturating_neg())
            );
        }
        *prefetch = Prefetch::Read;
        self.map_transfer(slot)
    }

    /// Runs a write-zeroes' or discard's ranges on a qcow2 image, one after the other, through
    /// imago.
    ///
    /// A range that frees clusters (a discard, an unmapping write-zeroes) waits while a write
    /// into it is at the device: that write goes to the host offset mapped when it started,
    /// and a cluster freed under it may be handed out again at once — as an L2 or refcount
    /// table too — before the write lands. (What imago's `settle_writes` is for; the engine,
    /// which owns those writes, keeps the rule.) Only racing requests of the guest's own meet
    /// it; the slot is parked and [`Core::retry_parked`] runs it again after the next
    /// completions.
    pub(super) fn zero_or_discard(&mut self, slot: u32) -> Result<(), EngineError> {
        let count = self.slots.count();
        loop {
            let Some((range, opcode)) = self
                .states
                .get(slot as usize)
                .map(|state| (state.current_range(), state.opcode()))
            else {
                return Err(EngineError::BadSlot { slot, count });
            };
            // A cluster being allocated through O_DIRECT is left alone until its data landed.
            if range.is_some_and(|r| self.wait_for_cluster_writes(slot, r.offset, r.len)) {
                return Ok(());
            }
            let Core {
                states,
                image,
                support,
                parked,
                ..
            } = self;
            let unmap = range.is_some_and(|r| r.mode == RangeMode::PunchHole.flags());
            if let Some(range) = range.filter(|_| opcode == Opcode::Discard || unmap) {
                if write_at_device_over(states, slot, range.offset, range.len) {
                    parked.push_back(slot);
                    return Ok(());
                }
            }
            let state = states
                .get_mut(slot as usize)
                .ok_or(EngineError::BadSlot { slot, count })?;
            let (Some(range), Some(chain)) = (range, image.qcow2_chain_mut()) else {
                let step = state.fail(libc::EIO);
                return self.apply(slot, step);
            };
            let result = if opcode == Opcode::Discard {
                chain.discard(range.offset, range.len)
            } else {
                chain.zero(range.offset, range.len, unmap)
            };
            let step = match result {
                Ok(()) => state.on_range(0, support),
                Err(e) => {
                    if self.complaints.should_log() {
                        warn!(
                            "slot {slot}: zeroing {} bytes at {}: {e}",
                            range.len, range.offset
                        );
                    }
                    state.fail(errno_of(&e))
                }
            };
            if step != Step::Issue(Stage::Range) {
                return self.apply(slot, step);
            }
        }
    }

    /// Runs the parked discards again (each parks itself anew while its range is still being
    /// written).
    #[cold]
    pub(super) fn retry_parked(&mut self) -> Result<(), EngineError> {
        for _ in 0..self.parked.len() {
            // The oldest first; it may push itself back at the end.
            let Some(slot) = self.parked.pop_front() else {
                break;
            };
            self.zero_or_discard(slot)?;
        }
        Ok(())
    }

    /// Grows a qcow2 image's virtual size (the frontend's ResizeDisk); requests in flight are
    /// unaffected: their clusters stay where they are. A raw image is grown by the frontend.
    pub(super) fn grow_image(&mut self, size: u64) -> ControlReply {
        let Some(chain) = self.image.qcow2_chain_mut() else {
            warn!("refusing GrowImage: a raw image is grown by the frontend");
            return ControlReply(libc::EINVAL);
        };
        match chain.grow(size) {
            Ok(()) => {
                info!("qcow2 image grown to {size} bytes");
                self.image.set_qcow2_size(size);
                ControlReply::OK
            }
            Err(e) => {
                warn!("growing the qcow2 image to {size} bytes: {e}");
                ControlReply(errno_of(&e))
            }
        }
    }

    /// Holds back the completion of a slot whose allocation is committed in imago's caches but
    /// not written back yet; true if it did.
    pub(super) fn defer_until_written_back(&mut self, slot: u32, status: u32) -> bool {
        if !self
            .write_back_pending
            .get(slot as usize)
            .is_some_and(|&pending| pending)
        {
            return false;
        }
        // At most one entry per slot: the capacity reserved at setup is never exceeded.
        self.awaiting_write_back.push((slot, status));
        true
    }

    /// Writes the qcow2 metadata back once for every allocation the pass committed, then
    /// completes the requests that waited for it (with IOERR if it failed; the next pass tries
    /// again). Runs before each publish, whenever an allocation was committed since the last
    /// one — not only when its own request completes: a write into the new cluster by another
    /// request completes through the mapping too. So nothing is acknowledged before the
    /// mapping it relies on is in the file (the page cache), and a killed iothread loses no
    /// acknowledged write.
    pub(super) fn write_back_allocations(&mut self) -> Result<(), EngineError> {
        if !self.metadata_dirty && self.awaiting_write_back.is_empty() {
            return Ok(());
        }
        let written_back = match self.image.qcow2_chain() {
            Some(chain) => chain.flush_metadata(),
            None => Err(io::Error::from_raw_os_error(libc::EBADF)),
        };
        match &written_back {
            Ok(()) => self.metadata_dirty = false,
            Err(e) => warn!("writing the qcow2 metadata of allocating writes back: {e}"),
        }
        while let Some((slot, status)) = self.awaiting_write_back.pop() {
            if let Some(flag) = self.write_back_pending.get_mut(slot as usize) {
                *flag = false;
            }
            let step = match &written_back {
                Ok(()) => Step::Complete(status),
                Err(e) => Step::Failed(errno_of(e)),
            };
            self.apply(slot, step)?;
        }
        Ok(())
    }

    /// Writes the qcow2 metadata back before a flush's fdatasync (and syncs an external data
    /// file); `Some` with the failed step if that fails.
    pub(super) fn flush_metadata(&mut self, slot: u32) -> Option<Step> {
        let chain = self.image.qcow2_chain()?;
        let written_back = chain.flush_metadata();
        if written_back.is_ok() {
            // Every allocation so far is in the file: nothing needs to wait for the next pass.
            self.metadata_dirty = false;
            if let Some(pending) = self.write_back_pending.get_mut(slot as usize) {
                *pending = false;
            }
        }
        let error = written_back.and_then(|()| chain.sync_data_file()).err()?;
        warn!("slot {slot}: writing the qcow2 metadata back: {error}");
        Some(self.states.get_mut(slot as usize)?.fail(errno_of(&error)))
    }
}

/// Whether a write other than `slot`'s has a transfer queued or at the device that may land
/// in the `len` guest bytes at `offset` (it moves bytes from its current offset on).
fn write_at_device_over(states: &[slot::SlotState], slot: u32, offset: u64, len: u64) -> bool {
    let end = offset.saturating_add(len);
    states.iter().enumerate().any(|(index, state)| {
        index != slot as usize
            && state.opcode() == Opcode::Write
            && state.stage() == Some(Stage::Transfer)
            && state.guest_offset() < end
            && offset < state.guest_offset().saturating_add(state.remaining())
    })
}

/// The slot's next transfer, limited to `len` bytes, to no file (the caller moves the data).
fn limited(state: &mut slot::SlotState, len: u64) -> slot::Transfer {
    state.set_target(TransferTarget {
        layer: 0,
        host_offset: 0,
        limit: len,
    });
    state.next_transfer(None)
}

/// The iovecs of a transfer.
pub(super) fn iovecs_of(transfer: &slot::Transfer) -> &[libc::iovec] {
    if transfer.count == 0 || transfer.iovecs.is_null() {
        return &[];
    }
    // SAFETY: `next_transfer` points `iovecs` at `count` initialized iovecs in the slot's own
    // buffer, which is neither moved nor changed until the slot's next transfer is computed.
    unsafe { std::slice::from_raw_parts(transfer.iovecs, transfer.count as usize) }
}

/// A byte count as a transfer result (at most [`MAX_EXTENT`], so it fits).
fn result_of(len: u64) -> i32 {
    i32::try_from(len).unwrap_or(-libc::EIO)
}

/// Writes every byte `iovecs` describe at `offset` of `fd`, continuing short writes.
fn write_all(fd: RawFd, iovecs: &[libc::iovec], mut offset: u64) -> io::Result<()> {
    // The slow path of a qcow2 image (the first write into a cluster): a copy to advance is fine.
    let mut left = iovecs.to_vec();
    let mut start = 0usize;
    while let Some(pending) = left.get_mut(start..).filter(|p| !p.is_empty()) {
        let count = libc::c_int::try_from(pending.len().min(slot::MAX_IOVECS_PER_OP))
            .unwrap_or(libc::c_int::MAX);
        let at = libc::off_t::try_from(offset)
            .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
        // SAFETY: the iovecs describe guest memory mapped while the request is in flight (the
        // kernel only reads it); the call returns before anything changes.
        let rc = unsafe { libc::pwritev(fd, pending.as_ptr(), count, at) };
        let written = match u64::try_from(rc) {
            Ok(0) => return Err(io::Error::from_raw_os_error(libc::EIO)),
            Ok(n) => n,
            Err(_) => {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
        };
        offset = offset.saturating_add(written);
        // advance() returns at most pending.len().
        start = start.saturating_add(slot::advance(pending, written));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::Request;
    use crate::slot::{FallocateSupport, SlotState};

    /// Slots 0..3: a write of 8 KiB at 64 KiB at the device, a read at 0 at the device, an
    /// idle slot, and a write of 8 KiB at 1 MiB that failed (idle, its offset left behind).
    fn slots() -> Vec<SlotState> {
        let support = FallocateSupport::default();
        let mut states: Vec<SlotState> = (0..4).map(|_| SlotState::new(4)).collect();
        let write = |image_offset| Request::Write {
            image_offset,
            len: 8192,
            iovecs: 1,
            sync: false,
        };
        let read = Request::Read {
            image_offset: 0,
            len: 8192,
            iovecs: 1,
        };
        for (index, request) in [(0, write(65536)), (1, read), (3, write(1 << 20))] {
            assert_eq!(
                states[index].begin(request, &support),
                Step::Issue(Stage::Transfer)
            );
        }
        // Slot 3's write fails before moving anything: idle again, its offset left behind.
        assert_eq!(states[3].fail(libc::EIO), Step::Failed(libc::EIO));
        states
    }

    #[test]
    fn a_discard_waits_only_for_writes_at_the_device_into_its_range() {
        let states = slots();
        // Overlapping the write's 8 KiB at 64 KiB, at either edge.
        assert!(write_at_device_over(&states, 2, 0, 65537));
        assert!(write_at_device_over(&states, 2, 65536 + 8191, 4096));
        // Next to it, on either side.
        assert!(!write_at_device_over(&states, 2, 0, 65536));
        assert!(!write_at_device_over(&states, 2, 65536 + 8192, 1 << 20));
        // A read there, a write that is over, and the discard's own slot do not count.
        assert!(!write_at_device_over(&states, 2, 0, 8192));
        assert!(!write_at_device_over(&states, 2, 1 << 20, 4096));
        assert!(!write_at_device_over(&states, 0, 65536, 8192));
        // A range reaching past u64 is cut, not wrapped.
        assert!(write_at_device_over(&states, 2, 65536, u64::MAX));
    }
}
