//! How the engine runs a request on a qcow2 image: each transfer is mapped first (an L2 cache
//! hit costs no system call), then
//! - data in a file (the image's allocated clusters, a backing file's) moves between guest
//!   memory and that file with the engine's own readv/writev at the mapped offset, through
//!   io_uring or inline as for a raw image;
//! - a read of zeros (unallocated down the whole chain, a zero cluster) zero-fills the guest
//!   buffers without I/O, and a read of a compressed cluster goes through imago;
//! - a write into a cluster the image does not own yet is an allocating write: imago prepares
//!   the cluster (copy-on-write of what the write leaves), the data is written into it, and
//!   only then is the mapping committed and the metadata written back. On an image whose
//!   transfers go through io_uring the data write is an io_uring write like any other, and
//!   the loop serves other requests until it lands ([`Core::start_allocation`]); the
//!   requests that would need the allocation's L2 table locked wait parked meanwhile. On an
//!   image served inline (memory-fast) the whole allocation runs on the spot;
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
use log::{info, warn};

use super::{Core, EngineError, Token};
use crate::qcow2::{Allocation, Extent};
use crate::slot::{self, RangeMode, Stage, Step, TransferTarget};

/// The most bytes one mapped transfer moves, so that its byte count is a valid result.
const MAX_EXTENT: u64 = 1 << 30;

/// The most allocating writes whose data may be at the device at once. Each keeps its L2
/// table locked and pinned in imago's L2 cache (128 tables), which fails a lookup when every
/// table in it is pinned.
const MAX_ALLOCATING: usize = 16;

/// An allocating write whose data is on its way to the file: its prepared (uncommitted)
/// allocation, kept per slot until the data has landed.
#[derive(Debug)]
pub(super) struct AllocatingWrite {
    /// The L2 table it locks ([`crate::qcow2::Qcow2Image::l2_table_of`]).
    table: u64,
    /// The guest offset of its first byte.
    guest_start: u64,
    /// Where its data goes.
    allocation: Allocation,
}

/// What [`Core::next_extent`] did with the slot's next extent.
enum Next {
    /// Handed to io_uring, or parked.
    Queued,
    /// Done on the spot: what the slot's state machine makes of it.
    Step(Step),
    /// An allocating write of `len` bytes at guest offset `offset` to start.
    Allocate { offset: u64, len: u64 },
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
                Next::Allocate { offset, len } => return self.start_allocation(slot, offset, len),
            }
        }
    }

    /// Maps and runs the slot's next extent, or says it is an allocating write to start.
    fn next_extent(&mut self, slot: u32) -> Result<Next, EngineError> {
        let count = self.slots.count();
        let bad_slot = EngineError::BadSlot { slot, count };
        let Core { states, image, .. } = self;
        let state = states.get_mut(slot as usize).ok_or(bad_slot)?;
        let inline = image.transfers_inline();
        let Some(chain) = image.qcow2_chain_mut() else {
            return Ok(Next::Step(state.fail(libc::EBADF)));
        };
        let offset = state.guest_offset();
        let write = state.opcode() == Opcode::Write;
        let extent = match chain.map(offset, state.remaining().min(MAX_EXTENT)) {
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
                // imago's compressed read takes its L2 table's lock for reading.
                if allocating_in(
                    &self.allocations,
                    chain.l2_table_of(offset)..=chain.l2_table_of(offset),
                ) {
                    self.parked.push_back(slot);
                    return Ok(Next::Queued);
                }
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
            (extent, _) if !inline => {
                return Ok(Next::Allocate {
                    offset,
                    len: extent.len(),
                })
            }
            // An image served inline is memory-fast: the whole allocation runs on the spot.
            (extent, _) => {
                let result =
                    chain.allocating_write(offset, extent.len(), |fd, host_offset, len| {
                        state.set_target(TransferTarget {
                            layer: 0,
                            host_offset,
                            limit: len,
                        });
                        let transfer = state.next_transfer(None);
                        write_all(fd, iovecs_of(&transfer), host_offset)
                    });
                match result {
                    Ok(written) => state.on_transfer(result_of(written)),
                    Err(e) => {
                        if self.complaints.should_log() {
                            warn!("slot {slot}: allocating write at {offset}: {e}");
                        }
                        state.fail(errno_of(&e))
                    }
                }
            }
        };
        Ok(Next::Step(step))
    }

    /// Starts an allocating write of the slot's next `len` bytes at guest offset `offset` (one
    /// L2 table's at most, as mapped): imago prepares the new clusters here (metadata I/O, and
    /// the copy-on-write of what the write leaves of the old data), the data goes to io_uring
    /// like any transfer, and the mapping is committed once it has landed
    /// ([`Core::allocation_transferred`]); the loop serves the other requests meanwhile, and
    /// the range reads as before until the commit.
    ///
    /// The data goes through the buffered fd even where the image has an O_DIRECT one: the
    /// allocation holds its L2 table locked until then, so it is kept at page-cache speed, and
    /// the new cluster reaches the disk with the metadata at the guest's next flush.
    ///
    /// An allocation into an L2 table with one in flight already (imago's table lock is not
    /// reentrant: preparing it would wait for itself) or beyond [`MAX_ALLOCATING`] is parked
    /// until the next completions.
    fn start_allocation(&mut self, slot: u32, offset: u64, len: u64) -> Result<(), EngineError> {
        let count = self.slots.count();
        let Core {
            states,
            image,
            allocations,
            parked,
            ..
        } = self;
        let state = states
            .get_mut(slot as usize)
            .ok_or(EngineError::BadSlot { slot, count })?;
        let Some(chain) = image.qcow2_chain() else {
            let step = state.fail(libc::EBADF);
            return self.apply(slot, step);
        };
        let table = chain.l2_table_of(offset);
        if allocations.iter().flatten().count() >= MAX_ALLOCATING
            || allocating_in(allocations, table..=table)
        {
            parked.push_back(slot);
            return Ok(());
        }
        let allocation = match chain.prepare_allocation(offset, len) {
            Ok(allocation) => allocation,
            Err(e) => {
                if self.complaints.should_log() {
                    warn!("slot {slot}: allocating {len} bytes at {offset}: {e}");
                }
                let step = state.fail(errno_of(&e));
                return self.apply(slot, step);
            }
        };
        state.set_target(TransferTarget {
            layer: allocation.layer,
            host_offset: allocation.host_offset,
            limit: allocation.len,
        });
        if allocation.needs_commit() {
            let record = allocations
                .get_mut(slot as usize)
                .ok_or(EngineError::BadSlot { slot, count })?;
            *record = Some(AllocatingWrite {
                table,
                guest_start: offset,
                allocation,
            });
        }
        self.counters.count_queued();
        self.pending.push_back(Token::Slot {
            slot,
            stage: Stage::Transfer,
        });
        Ok(())
    }

    /// Whether the slot's transfer in flight is an allocating write's (its data goes through
    /// the buffered fd, and its result goes to [`Core::allocation_transferred`]).
    pub(super) fn is_allocating(&self, slot: u32) -> bool {
        self.allocations
            .get(slot as usize)
            .is_some_and(Option::is_some)
    }

    /// Takes what the slot's state machine made of an allocating write's transfer result: the
    /// rest of a short write goes to the same clusters; once all of its bytes have landed the
    /// allocation is committed and the metadata written back (a failure of either fails the
    /// request; the range keeps its old data unless the commit itself succeeded); a failed
    /// write drops it, which releases its clusters.
    pub(super) fn allocation_transferred(
        &mut self,
        slot: u32,
        step: Step,
    ) -> Result<(), EngineError> {
        let count = self.slots.count();
        let bad_slot = EngineError::BadSlot { slot, count };
        let Core {
            states,
            image,
            allocations,
            ..
        } = self;
        let (Some(state), Some(record)) = (
            states.get_mut(slot as usize),
            allocations.get_mut(slot as usize),
        ) else {
            return Err(bad_slot);
        };
        let Some(write) = record.take() else {
            return self.apply(slot, step);
        };
        let guest_end = write.guest_start.saturating_add(write.allocation.len);
        let step = match step {
            Step::Issue(Stage::Transfer) if state.guest_offset() < guest_end => {
                let done = state.guest_offset().saturating_sub(write.guest_start);
                state.set_target(TransferTarget {
                    layer: write.allocation.layer,
                    host_offset: write.allocation.host_offset.saturating_add(done),
                    limit: guest_end.saturating_sub(state.guest_offset()),
                });
                *record = Some(write);
                self.counters.count_queued();
                self.pending.push_back(Token::Slot {
                    slot,
                    stage: Stage::Transfer,
                });
                return Ok(());
            }
            // Dropping the allocation releases its clusters.
            failed @ Step::Failed(_) => failed,
            step => match image.qcow2_chain() {
                Some(chain) => match chain.commit_allocation(write.allocation) {
                    Ok(()) => step,
                    Err(e) => {
                        if self.complaints.should_log() {
                            warn!(
                                "slot {slot}: committing the allocation at {}: {e}",
                                write.guest_start
                            );
                        }
                        state.fail(errno_of(&e))
                    }
                },
                None => state.fail(libc::EBADF),
            },
        };
        self.apply(slot, step)
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
            let Core {
                states,
                image,
                support,
                parked,
                allocations,
                ..
            } = self;
            let Some((range, opcode)) = states
                .get(slot as usize)
                .map(|state| (state.current_range(), state.opcode()))
            else {
                return Err(EngineError::BadSlot { slot, count });
            };
            let unmap = range.is_some_and(|r| r.mode == RangeMode::PunchHole.flags());
            if let Some(range) = range.filter(|_| opcode == Opcode::Discard || unmap) {
                if write_at_device_over(states, slot, range.offset, range.len) {
                    parked.push_back(slot);
                    return Ok(());
                }
            }
            // imago zeroes and discards under the write locks of the range's L2 tables.
            if let (Some(range), Some(chain)) = (range, image.qcow2_chain()) {
                let last = range.offset.saturating_add(range.len.saturating_sub(1));
                if allocating_in(
                    allocations,
                    chain.l2_table_of(range.offset)..=chain.l2_table_of(last),
                ) {
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

    /// Runs the parked requests again: discards and zeroings waiting for the writes into
    /// their range, transfers waiting for an allocation in their L2 table (each parks itself
    /// anew while it still has to wait).
    #[cold]
    pub(super) fn retry_parked(&mut self) -> Result<(), EngineError> {
        for _ in 0..self.parked.len() {
            // The oldest first; it may push itself back at the end.
            let Some(slot) = self.parked.pop_front() else {
                break;
            };
            match self
                .states
                .get(slot as usize)
                .and_then(slot::SlotState::stage)
            {
                Some(Stage::Transfer) => self.map_transfer(slot)?,
                Some(Stage::Range) => self.zero_or_discard(slot)?,
                stage => warn!("slot {slot}: parked in stage {stage:?}, which never waits"),
            }
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

    /// Writes the qcow2 metadata back before a flush's fdatasync (and syncs an external data
    /// file); `Some` with the failed step if that fails.
    pub(super) fn flush_metadata(&mut self, slot: u32) -> Option<Step> {
        let chain = self.image.qcow2_chain()?;
        let error = chain
            .flush_metadata()
            .and_then(|()| chain.sync_data_file())
            .err()?;
        warn!("slot {slot}: writing the qcow2 metadata back: {error}");
        Some(self.states.get_mut(slot as usize)?.fail(errno_of(&error)))
    }
}

/// Whether an allocating write in flight locks one of the L2 tables `tables`.
fn allocating_in(
    allocations: &[Option<AllocatingWrite>],
    tables: std::ops::RangeInclusive<u64>,
) -> bool {
    allocations
        .iter()
        .flatten()
        .any(|write| tables.contains(&write.table))
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
fn iovecs_of(transfer: &slot::Transfer) -> &[libc::iovec] {
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
