//! A throttle group's shared state: the buckets every member accounts in, and the round robin
//! that makes members with waiting requests take turns, as QEMU's throttle groups do.
//!
//! blkplaned creates the group's file, [`GROUP_STATE_LEN`] zero bytes (the cleared state:
//! empty buckets, member 0's turn, nobody waiting), and every member's frontend maps it. A
//! member with requests waiting keeps its `waiting` mark fresh (the time it last looked);
//! the member whose turn it is may admit one request, then passes the turn to the next member
//! that is waiting. A member whose turn it is not waits while the turn holder is waiting —
//! unless the holder's mark is older than [`STALE_NS`] (its process died, or it stopped
//! waiting without clearing the mark), so that a crashed member never stalls the others.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::bucket::SharedBuckets;

/// The most members a group can have (a member's index is below this).
pub const MAX_GROUP_MEMBERS: usize = 64;

/// A waiting mark older than this no longer holds the turn: its member is presumed gone.
pub const STALE_NS: u64 = 100_000_000;

/// The state of a throttle group, `#[repr(C)]` for a shared memory file; all zero bytes is a
/// valid, cleared state.
#[repr(C)]
#[derive(Debug)]
pub struct GroupState {
    /// The group's buckets.
    pub buckets: SharedBuckets,
    /// The member whose turn it is.
    turn: AtomicU64,
    /// Per member: the `CLOCK_MONOTONIC` time it last had requests waiting, 0 for none.
    waiting: [AtomicU64; MAX_GROUP_MEMBERS],
}

/// Bytes of a group's state file.
pub const GROUP_STATE_LEN: usize = size_of::<GroupState>();

const _: () = assert!(align_of::<GroupState>() == 8);

impl Default for GroupState {
    fn default() -> Self {
        Self::new()
    }
}

impl GroupState {
    /// A cleared state (as a zero-filled file holds).
    pub const fn new() -> Self {
        GroupState {
            buckets: SharedBuckets::new(),
            turn: AtomicU64::new(0),
            waiting: [const { AtomicU64::new(0) }; MAX_GROUP_MEMBERS],
        }
    }

    fn mark(&self, member: usize) -> Option<&AtomicU64> {
        self.waiting.get(member)
    }

    /// `member` has requests waiting at `now_ns`.
    pub fn set_waiting(&self, member: usize, now_ns: u64) {
        if let Some(mark) = self.mark(member) {
            // Relaxed: a hint for the round robin; the buckets do the accounting.
            mark.store(now_ns.max(1), Ordering::Relaxed);
        }
    }

    /// `member` has no request waiting any more.
    pub fn clear_waiting(&self, member: usize) {
        if let Some(mark) = self.mark(member) {
            mark.store(0, Ordering::Relaxed);
        }
    }

    fn is_waiting(&self, member: usize, now_ns: u64) -> bool {
        self.mark(member).is_some_and(|m| {
            let since = m.load(Ordering::Relaxed);
            since != 0 && now_ns.saturating_sub(since) < STALE_NS
        })
    }

    /// Whether `member` may try to admit a request now: it has the turn, or the member that
    /// has it is not waiting.
    pub fn may_go(&self, member: usize, now_ns: u64) -> bool {
        let turn = self.turn.load(Ordering::Relaxed);
        let turn = usize::try_from(turn).unwrap_or(usize::MAX);
        turn == member || turn >= MAX_GROUP_MEMBERS || !self.is_waiting(turn, now_ns)
    }

    /// `member` admitted a request: the turn goes to the next member after it (cyclically)
    /// that is waiting; if none is, it stays.
    pub fn pass_turn(&self, member: usize, now_ns: u64) {
        for step in 1..=MAX_GROUP_MEMBERS {
            let next = (member + step) % MAX_GROUP_MEMBERS;
            if next == member {
                break;
            }
            if self.is_waiting(next, now_ns) {
                self.turn.store(next as u64, Ordering::Relaxed);
                return;
            }
        }
        self.turn.store(member as u64, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    #[test]
    fn a_zeroed_state_lets_anyone_go() {
        let g = GroupState::new();
        assert!(g.may_go(0, 10 * MS));
        assert!(g.may_go(5, 10 * MS));
        assert_eq!(GROUP_STATE_LEN, 96 + 8 + 8 * MAX_GROUP_MEMBERS);
    }

    #[test]
    fn waiting_members_take_turns() {
        let g = GroupState::new();
        let now = 1000 * MS;
        for m in [0, 3, 7] {
            g.set_waiting(m, now);
        }
        // Member 0 has the turn: 3 and 7 wait for it.
        assert!(g.may_go(0, now) && !g.may_go(3, now) && !g.may_go(7, now));
        g.pass_turn(0, now);
        assert!(g.may_go(3, now) && !g.may_go(0, now) && !g.may_go(7, now));
        g.pass_turn(3, now);
        assert!(g.may_go(7, now) && !g.may_go(0, now));
        g.pass_turn(7, now);
        assert!(g.may_go(0, now), "wraps around");
        // A member that stops waiting leaves the rotation.
        g.clear_waiting(3);
        g.pass_turn(0, now);
        assert!(g.may_go(7, now) && !g.may_go(3, now));
    }

    #[test]
    fn alone_a_member_keeps_the_turn() {
        let g = GroupState::new();
        g.set_waiting(2, MS);
        g.pass_turn(2, MS);
        assert!(g.may_go(2, MS));
        // Nobody waiting at all: anyone may go.
        g.clear_waiting(2);
        assert!(g.may_go(9, MS));
    }

    #[test]
    fn a_stale_turn_holder_does_not_stall_the_group() {
        let g = GroupState::new();
        g.set_waiting(0, MS);
        g.set_waiting(1, MS);
        assert!(!g.may_go(1, MS + STALE_NS - 1));
        // Member 0's process died with its mark set: after STALE_NS member 1 goes.
        assert!(g.may_go(1, MS + STALE_NS));
    }

    #[test]
    fn indices_out_of_range_are_ignored() {
        let g = GroupState::new();
        g.set_waiting(MAX_GROUP_MEMBERS, MS);
        g.clear_waiting(usize::MAX);
        g.pass_turn(MAX_GROUP_MEMBERS + 5, MS);
        assert!(g.may_go(0, MS));
    }
}
