//! I/O limits in the frontend, with QEMU's semantics (the arithmetic is the
//! `blkplane-throttle` crate).
//!
//! blkplaned sends the limits over the admin channel (SetThrottle); [`DiskThrottle`] is what
//! every queue worker of the disk then shares: the limits and the buckets — the frontend's
//! own, or a throttle group's, in a file blkplaned created that every member's frontend maps
//! (each member in its own process). Each worker owns a [`Throttler`]: reads and writes
//! (write-zeroes counts as a write of its range, as in QEMU) are admitted while the buckets
//! have room; otherwise the request — parsed, its ring slot filled — waits in a FIFO per
//! direction (a later request never overtakes an earlier one of its direction, as in QEMU)
//! and a timerfd wakes the worker when the first can go: no busy loop, no error. Flush,
//! discard and GET_ID are not throttled (QEMU throttles reads and writes only); a flush need
//! not wait for throttled writes: by the virtio spec it covers the writes that had completed
//! when it was sent, and a waiting write has not. In a group, members with waiting requests
//! take turns (round robin, [`GroupState`]). Without limits the hot path costs one `Option`
//! test.

use std::collections::VecDeque;
use std::fs::File;
use std::io;
use std::ops::Deref;
use std::sync::Arc;

use blkplane_proto::ring::Opcode;
use blkplane_proto::shm::SharedMapping;
use blkplane_proto::v1;
use blkplane_throttle::{
    Admission, Direction, GroupState, LimitsError, SharedBuckets, Throttle, ThrottleLimits,
    GROUP_STATE_LEN, MAX_GROUP_MEMBERS,
};

/// A group member whose turn it is not looks again this often at the latest, and so keeps
/// its waiting mark fresh (well under `blkplane_throttle::group::STALE_NS`).
const GROUP_RECHECK_NS: u64 = 20_000_000;
/// A member that may not go yet looks again after at least this long.
const MIN_RECHECK_NS: u64 = 200_000;

/// A broken rule as blkplaned names it, by the request's field: `limits.iops_total.max: …`.
fn limits_message(e: &LimitsError) -> String {
    let (field, reason) = blkplane_throttle::wire::api_error(e);
    format!("{field}: {reason}")
}

/// Why a SetThrottle could not be applied (nothing changed then).
#[derive(Debug, thiserror::Error)]
pub enum ThrottleError {
    /// The limits break one of QEMU's rules.
    #[error("{}", limits_message(.0))]
    Limits(#[from] LimitsError),
    /// The member index is not below the group size limit.
    #[error("member_index: {0} is not below {MAX_GROUP_MEMBERS}")]
    MemberIndex(u32),
    /// The group's state file cannot be mapped.
    #[error("group_state_path: {path}: {source}")]
    GroupFile {
        /// The path blkplaned sent.
        path: String,
        /// What failed.
        source: io::Error,
    },
    /// A group without its state file attached.
    #[error(
        "group_state_path: {path}: the group's state file must be attached to the request \
         (SCM_RIGHTS)"
    )]
    GroupFileMissing {
        /// The path the request names.
        path: String,
    },
    /// The group's state file has the wrong size (not made by this blkplane's blkplaned).
    #[error("group_state_path: {path} is {len} bytes, not {GROUP_STATE_LEN}")]
    GroupFileSize {
        /// The path blkplaned sent.
        path: String,
        /// Its length.
        len: u64,
    },
}

/// A throttle group's state file, mapped.
#[derive(Debug)]
struct GroupFile {
    mapping: SharedMapping,
}

impl GroupFile {
    /// Maps `file`, the group's state file that blkplaned created at `path`.
    fn new(file: File, path: &str) -> Result<Self, ThrottleError> {
        let failed = |source| ThrottleError::GroupFile {
            path: path.to_string(),
            source,
        };
        let len = file.metadata().map_err(failed)?.len();
        // Exactly the size blkplaned makes: a shorter file would fault when touched beyond
        // its end, a longer one is not a group file.
        if len != GROUP_STATE_LEN as u64 {
            return Err(ThrottleError::GroupFileSize {
                path: path.to_string(),
                len,
            });
        }
        let mapping = SharedMapping::new(&file, len, 0).map_err(failed)?;
        Ok(Self { mapping })
    }
}

impl Deref for GroupFile {
    type Target = GroupState;

    fn deref(&self) -> &GroupState {
        // SAFETY: the mapping is GROUP_STATE_LEN bytes, page aligned (so aligned for the
        // 8-byte atomics), lives as long as `self`, and GroupState is made of atomics only,
        // valid for any bit pattern another process may have stored.
        unsafe { &*self.mapping.as_ptr().cast::<GroupState>() }
    }
}

/// Where a disk's buckets live.
#[derive(Debug, Clone)]
enum Buckets {
    /// The disk is throttled alone.
    Own(Arc<SharedBuckets>),
    /// The disk is a member of a group.
    Group(Arc<GroupFile>),
}

impl Deref for Buckets {
    type Target = SharedBuckets;

    fn deref(&self) -> &SharedBuckets {
        match self {
            Buckets::Own(b) => b,
            Buckets::Group(g) => &g.buckets,
        }
    }
}

/// The limits of a disk and the buckets they are accounted in, shared by its workers.
#[derive(Debug)]
pub struct DiskThrottle {
    throttle: Throttle<Buckets>,
    /// The group state and this disk's member index, in a group.
    group: Option<(Arc<GroupFile>, usize)>,
}

impl DiskThrottle {
    /// The throttle of a SetThrottle request; `None` when it sets no limit. A group's state
    /// file comes attached to the request (`group_file`); `group_state_path` only names it.
    /// The buckets start empty (a group's are emptied, as QEMU does whenever limits are set).
    pub fn from_request(
        request: &v1::SetThrottle,
        group_file: Option<File>,
    ) -> Result<Option<Arc<Self>>, ThrottleError> {
        let limits = request
            .limits
            .as_ref()
            .map(ThrottleLimits::from)
            .unwrap_or_default();
        limits.validate()?;
        if limits.is_unlimited() {
            return Ok(None);
        }
        let (buckets, group) = if request.group_state_path.is_empty() {
            (Buckets::Own(Arc::new(SharedBuckets::new())), None)
        } else {
            let index = usize::try_from(request.member_index)
                .ok()
                .filter(|&i| i < MAX_GROUP_MEMBERS)
                .ok_or(ThrottleError::MemberIndex(request.member_index))?;
            let file = group_file.ok_or_else(|| ThrottleError::GroupFileMissing {
                path: request.group_state_path.clone(),
            })?;
            let file = Arc::new(GroupFile::new(file, &request.group_state_path)?);
            (Buckets::Group(Arc::clone(&file)), Some((file, index)))
        };
        let throttle = Throttle::new(limits, buckets)?;
        // Setting limits empties the buckets, as QEMU's throttle_config does (a group's file
        // may hold levels of the limits before).
        throttle.clear();
        Ok(Some(Arc::new(Self { throttle, group })))
    }

    /// Asks whether a request may go now (accounted) or how long to wait: in a group, only
    /// when it is this member's turn or the member holding it is not waiting.
    fn admit(&self, dir: Direction, bytes: u64, now_ns: u64) -> Admission {
        if let Some((group, member)) = &self.group {
            if !group.may_go(*member, now_ns) {
                let wait = self.throttle.wait_ns(dir, now_ns);
                return Admission::Wait(wait.clamp(MIN_RECHECK_NS, GROUP_RECHECK_NS));
            }
        }
        let admission = self.throttle.try_admit(dir, bytes, now_ns);
        if let (Admission::Go, Some((group, member))) = (&admission, &self.group) {
            group.pass_turn(*member, now_ns);
        }
        match (admission, &self.group) {
            // Keep the waiting mark fresh while waiting longer than it stays valid.
            (Admission::Wait(ns), Some(_)) => Admission::Wait(ns.min(GROUP_RECHECK_NS)),
            (a, _) => a,
        }
    }

    fn set_waiting(&self, waiting: bool, now_ns: u64) {
        if let Some((group, member)) = &self.group {
            if waiting {
                group.set_waiting(*member, now_ns);
            } else {
                group.clear_waiting(*member);
            }
        }
    }
}

/// The direction a request is throttled in; `None` for requests QEMU does not throttle.
pub fn direction(opcode: Opcode) -> Option<Direction> {
    match opcode {
        Opcode::Read => Some(Direction::Read),
        Opcode::Write | Opcode::WriteZeroes => Some(Direction::Write),
        Opcode::Flush | Opcode::Discard | Opcode::Answer => None,
    }
}

/// A request waiting for the limits.
#[derive(Debug, Clone, Copy)]
struct Waiting {
    slot: u32,
    bytes: u64,
    since_ns: u64,
}

/// One worker's side of throttling: the limits in force, the waiting requests and when the
/// first of them may go. It makes no system call: the caller passes the time
/// ([`blkplane_proto::clock::monotonic_ns`], the clock a group's members share) and arms its
/// timer when [`Throttler::take_timer_request`] says so.
pub struct Throttler {
    limits: Option<Arc<DiskThrottle>>,
    /// Per direction (read, write), in arrival order.
    waiting: [VecDeque<Waiting>; 2],
    /// When the timer fires (`CLOCK_MONOTONIC` ns), if armed.
    deadline: Option<u64>,
    /// A deadline the caller has not armed its timer for yet.
    unarmed: Option<u64>,
}

fn lane(dir: Direction) -> usize {
    match dir {
        Direction::Read => 0,
        Direction::Write => 1,
    }
}

impl Throttler {
    /// No limits; room for `capacity` waiting requests (the worker's slots), so that queueing
    /// never allocates.
    pub fn new(capacity: usize) -> Self {
        Self {
            limits: None,
            waiting: [
                VecDeque::with_capacity(capacity),
                VecDeque::with_capacity(capacity),
            ],
            deadline: None,
            unarmed: None,
        }
    }

    /// The deadline (`CLOCK_MONOTONIC` ns) to arm the caller's timer for, once: when it
    /// passes, call [`Throttler::release`].
    pub fn take_timer_request(&mut self) -> Option<u64> {
        self.unarmed.take()
    }

    /// The caller could not arm its timer: the next request that must wait asks again.
    pub fn timer_not_armed(&mut self) {
        self.deadline = None;
    }

    /// Limits are set.
    pub fn is_active(&self) -> bool {
        self.limits.is_some()
    }

    /// Requests waiting.
    pub fn waiting(&self) -> usize {
        self.waiting.iter().map(VecDeque::len).sum()
    }

    /// Replaces the limits; call [`Throttler::release`] next (the new ones may let waiting
    /// requests go, and none at all lets every one go).
    pub fn set(&mut self, limits: Option<Arc<DiskThrottle>>) {
        if let Some(old) = &self.limits {
            old.set_waiting(false, 0);
        }
        self.limits = limits;
        self.deadline = None;
        self.unarmed = None;
    }

    /// Decides at `now` for a new request of `bytes` in `dir`, its slot ready: `true` if it
    /// may be submitted now (it has been accounted), `false` if it was queued.
    pub fn admit_or_queue(&mut self, dir: Direction, slot: u32, bytes: u64, now: u64) -> bool {
        let Some(limits) = &self.limits else {
            return true;
        };
        let lane = lane(dir);
        let queue_empty = self.waiting.get(lane).is_some_and(VecDeque::is_empty);
        let wait = if queue_empty {
            match limits.admit(dir, bytes, now) {
                Admission::Go => return true,
                Admission::Wait(ns) => ns,
            }
        } else {
            // Behind earlier requests of its direction: the timer is armed for them.
            0
        };
        limits.set_waiting(true, now);
        if let Some(q) = self.waiting.get_mut(lane) {
            q.push_back(Waiting {
                slot,
                bytes,
                since_ns: now,
            });
        }
        if wait > 0 {
            self.arm(now.saturating_add(wait));
        }
        false
    }

    fn arm(&mut self, deadline: u64) {
        if self.deadline.is_some_and(|d| d <= deadline) {
            return;
        }
        self.deadline = Some(deadline);
        self.unarmed = Some(deadline);
    }

    /// Lets every waiting request go at `now` that may (all of them without limits), in order
    /// per direction, calling `submit(slot, waited_ns)` for each, and asks for the timer for
    /// the first that may not.
    pub fn release(&mut self, now: u64, mut submit: impl FnMut(u32, u64)) {
        self.deadline = None;
        let mut next: Option<u64> = None;
        for dir in [Direction::Read, Direction::Write] {
            let Some(queue) = self.waiting.get_mut(lane(dir)) else {
                continue;
            };
            while let Some(front) = queue.front().copied() {
                let admission = match &self.limits {
                    Some(limits) => limits.admit(dir, front.bytes, now),
                    None => Admission::Go,
                };
                match admission {
                    Admission::Go => {
                        queue.pop_front();
                        submit(front.slot, now.saturating_sub(front.since_ns));
                    }
                    Admission::Wait(ns) => {
                        next = Some(next.map_or(ns, |n| n.min(ns)));
                        break;
                    }
                }
            }
        }
        if let Some(limits) = &self.limits {
            limits.set_waiting(self.waiting() > 0, now);
        }
        if let Some(ns) = next {
            self.arm(now.saturating_add(ns));
        }
    }

    /// Lets every waiting request go at `now`, limits or not (as QEMU does while a drain
    /// waits), calling `submit(slot, waited_ns)` for each.
    pub fn release_all(&mut self, now: u64, mut submit: impl FnMut(u32, u64)) {
        for queue in &mut self.waiting {
            for w in queue.drain(..) {
                submit(w.slot, now.saturating_sub(w.since_ns));
            }
        }
        if let Some(limits) = &self.limits {
            limits.set_waiting(false, 0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use blkplane_proto::clock::monotonic_ns;

    fn request(limits: v1::ThrottleLimits) -> v1::SetThrottle {
        v1::SetThrottle {
            limits: Some(limits),
            group_state_path: String::new(),
            member_index: 0,
        }
    }

    #[test]
    fn no_limits_means_no_throttle() {
        assert!(
            DiskThrottle::from_request(&v1::SetThrottle::default(), None)
                .unwrap()
                .is_none()
        );
        let mut t = Throttler::new(4);
        assert!(t.admit_or_queue(Direction::Read, 0, 1 << 20, monotonic_ns()));
        assert!(!t.is_active());
    }

    #[test]
    fn invalid_limits_name_the_field() {
        let e = DiskThrottle::from_request(
            &request(
                blkplane_throttle::wire::named(&[("iops_total", 100), ("iops_total_max", 50)])
                    .unwrap(),
            ),
            None,
        )
        .unwrap_err();
        assert!(e.to_string().starts_with("limits.iops_total.max: "), "{e}");
        let e = DiskThrottle::from_request(
            &v1::SetThrottle {
                limits: Some(blkplane_throttle::wire::named(&[("iops_total", 100)]).unwrap()),
                group_state_path: "/run/blkplane/throttle/g.state".into(),
                member_index: 0,
            },
            None,
        )
        .unwrap_err();
        assert!(
            matches!(e, ThrottleError::GroupFileMissing { .. }),
            "a group without its file attached: {e}"
        );
        assert!(e.to_string().starts_with("group_state_path: "), "{e}");
    }

    #[test]
    fn requests_queue_in_order_and_go_when_the_bucket_has_room() {
        let limits = DiskThrottle::from_request(
            &request(blkplane_throttle::wire::named(&[("iops_read", 100)]).unwrap()),
            None,
        )
        .unwrap();
        let mut t = Throttler::new(64);
        t.set(limits);
        let start = monotonic_ns();
        // QEMU's default burst: a tenth of a second (10 requests) and one more go at once.
        let admitted = (0..20)
            .filter(|&slot| t.admit_or_queue(Direction::Read, slot, 4096, start))
            .count();
        assert_eq!(admitted, 11);
        assert_eq!(t.waiting(), 9);
        // Writes are not limited here and do not wait behind reads.
        assert!(t.admit_or_queue(Direction::Write, 30, 4096, start));
        // Nothing is due yet: the timer is asked for once, for the first waiting read.
        let mut released = Vec::new();
        let deadline = t
            .take_timer_request()
            .expect("a deadline for the waiting reads");
        assert!(deadline > start, "{deadline} after {start}");
        assert_eq!(t.take_timer_request(), None, "asked for once");
        t.release(start, |slot, _| released.push(slot));
        assert!(released.is_empty());
        // Then one every 10 ms, in order, each time the timer would fire.
        let mut now = start;
        while released.len() < 3 {
            let deadline = t
                .take_timer_request()
                .expect("the timer is asked for again");
            assert!(
                deadline > now && deadline <= now + 20_000_000,
                "{deadline} {now}"
            );
            now = deadline;
            t.release(now, |slot, waited| {
                assert!(waited > 0);
                released.push(slot);
            });
        }
        assert_eq!(&released[..3], &[11, 12, 13]);
        // Limits removed: everything waiting goes at once.
        t.set(None);
        t.release(now, |slot, _| released.push(slot));
        assert_eq!(t.waiting(), 0);
        assert_eq!(released.last(), Some(&19));
    }

    #[test]
    fn group_members_share_the_buckets_and_take_turns() {
        let dir = std::env::temp_dir().join(format!("bp-throttle-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("g.state");
        File::create(&path)
            .unwrap()
            .set_len(GROUP_STATE_LEN as u64)
            .unwrap();
        let member = |index| {
            let file = File::options().read(true).write(true).open(&path).unwrap();
            DiskThrottle::from_request(
                &v1::SetThrottle {
                    limits: Some(blkplane_throttle::wire::named(&[("iops_total", 1000)]).unwrap()),
                    group_state_path: path.to_str().unwrap().into(),
                    member_index: index,
                },
                Some(file),
            )
            .unwrap()
            .unwrap()
        };
        let (a, b) = (member(0), member(1));
        let now = monotonic_ns();
        // The burst (101 requests) is shared: what a takes, b does not get.
        let went = (0..101)
            .filter(|_| a.admit(Direction::Read, 4096, now) == Admission::Go)
            .count();
        assert_eq!(went, 101);
        assert!(matches!(
            b.admit(Direction::Write, 4096, now),
            Admission::Wait(_)
        ));
        // Both waiting: the turn alternates once the bucket has room again.
        let later = now + 1_000_000_000;
        a.set_waiting(true, later);
        b.set_waiting(true, later);
        let first = if a.admit(Direction::Read, 4096, later) == Admission::Go {
            (&a, &b)
        } else {
            assert_eq!(b.admit(Direction::Read, 4096, later), Admission::Go);
            (&b, &a)
        };
        // The one that went passed the turn: it now waits for the other.
        assert!(matches!(
            first.0.admit(Direction::Read, 4096, later),
            Admission::Wait(_)
        ));
        assert_eq!(first.1.admit(Direction::Read, 4096, later), Admission::Go);
        let _ = std::fs::remove_dir_all(&dir);
        let not_a_group_file = |member_index| {
            DiskThrottle::from_request(
                &v1::SetThrottle {
                    limits: Some(blkplane_throttle::wire::named(&[("iops_total", 1)]).unwrap()),
                    group_state_path: "/dev/null".into(),
                    member_index,
                },
                Some(File::open("/dev/null").unwrap()),
            )
        };
        assert!(matches!(
            not_a_group_file(0),
            Err(ThrottleError::GroupFileSize { .. })
        ));
        assert!(matches!(
            not_a_group_file(64),
            Err(ThrottleError::MemberIndex(64))
        ));
    }
}
