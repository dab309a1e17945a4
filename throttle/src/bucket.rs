//! QEMU's leaky buckets, kept as theoretical arrival times in atomics that several processes
//! can share.
//!
//! # QEMU's model (`util/throttle.c`)
//!
//! Every limited bucket has a *level* (bytes or operations) that leaks at `avg` units per
//! second, and a *size*: `max × max_length` when a burst rate is set, otherwise `avg / 10`
//! (100 ms of I/O at the average rate: without it every other request would be throttled).
//! With `max_length > 1` a second, *burst* level leaks at `max` per second and has the size
//! `max / 10`; it keeps the guest at `max` per second while the main level fills up.
//!
//! A request may go when no level of the buckets of its direction is above its size (total
//! and read buckets for a read, total and write buckets for a write). It is then accounted in
//! full, its bytes in the bps buckets and its operations in the iops buckets, so a level may
//! end up above its size by one request: QEMU admits, then accounts. Otherwise the request
//! waits until the level that is furthest above its size *in time* has leaked down to its
//! size: `(level − size) / rate`, the maximum over the levels.
//!
//! A request of `bytes` counts `bytes / iops_size` operations when `iops_size` is set and the
//! request is larger, otherwise one (fractions included, as in QEMU).
//!
//! One difference in the reported wait, not in what is admitted: when a bucket's main level
//! is full, QEMU's `throttle_compute_wait` returns the main level's wait without looking at
//! the same bucket's burst level, and re-checks when its timer fires. Here the wait is the
//! maximum over every level, i.e. the instant at which the request can actually go, which is
//! when QEMU's second check would let it go.
//!
//! # The same buckets as theoretical arrival times (GCRA)
//!
//! A level that leaks at `r` units per second is described completely by the instant at which
//! it will be empty, its *theoretical arrival time* `TAT`:
//! `level(t) = max(TAT − t, 0) × r`. One `u64` of nanoseconds of `CLOCK_MONOTONIC` therefore
//! stores one level, and:
//!
//! - leaking costs nothing: time passing is the leak (QEMU's `throttle_leak_bucket`);
//! - accounting `u` units at `t` is `TAT ← max(TAT, t) + u / r` (`throttle_account`);
//! - "level ≤ size" is `TAT − t ≤ size / r`, the level's tolerance `τ`;
//! - the wait is `(level − size) / r = TAT − t − τ` (`throttle_compute_wait`).
//!
//! Main level: `r = avg`, `τ = max × max_length / avg` seconds, or exactly 100 ms without a
//! burst rate. Burst level: `r = max`, `τ` = 100 ms.
//!
//! # Fixed point
//!
//! A request's cost `u / r` is computed in nanoseconds as `⌈units × 10⁹ / rate⌉`, with
//! fractional units as `bytes / iops_size`, in 128-bit arithmetic: no product of `u64` inputs
//! overflows, and each request is charged less than 1 ns more than the exact value (rounding
//! up, so that rounding never admits more than the limit). Tolerances round down, which is
//! exact for the integer comparison `TAT − t ≤ τ`. Waits are exact integer differences, so a
//! request retried at `now + wait` goes. Values that do not fit 64 bits (a cost or tolerance
//! of centuries) saturate at `u64::MAX`.
//!
//! # Sharing between processes
//!
//! [`SharedBuckets`] is `#[repr(C)]`, 12 `AtomicU64`s (a main and a burst level for each of
//! the six buckets), no pointers, and all zero bytes is its cleared state: it can sit in a
//! shared memory file mapped by every member of a throttle group. Each member has its own
//! [`Throttle`] view with the group's limits.
//!
//! [`Throttle::try_admit`] checks all the levels of the direction and, if the request may go,
//! accounts it on each level with a compare-and-swap loop. The check and the accounting are
//! not one atomic step: when `k` members pass the check at the same instant, all `k` go, and
//! a level may end up `k` requests above its size instead of one, an over-admission of at
//! most one request per concurrent member. Every admitted request is still accounted in
//! full, so the excess delays the following requests and never accumulates: over any window
//! the group admits at most `k − 1` requests more than QEMU's serial model would, and its
//! long-run rate is exact. Making it exact would need every level of a direction to be
//! updated as one atomic step (a lock, or a rollback that can under-account under
//! contention), not worth one request.

use std::ops::Deref;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::config::{BucketKind, LimitsError, ThrottleLimits};

// Processes share the levels through memory: the atomics must be the lock-free instructions,
// not a library emulation with a process-local lock.
#[cfg(not(target_has_atomic = "64"))]
compile_error!(
    "blkplane-throttle needs lock-free 64-bit atomics to share buckets between processes"
);

const NS_PER_SEC: u128 = 1_000_000_000;

/// Tolerance of a main level without a burst rate (size `avg / 10` at rate `avg`) and of
/// every burst level (size `max / 10` at rate `max`): 100 ms.
const TENTH_SECOND_NS: u64 = 100_000_000;

/// Two levels (main, burst) per bucket.
const LEVELS: usize = 2 * BucketKind::ALL.len();

/// The index of a bucket's main level in [`SharedBuckets`].
const fn main_level(kind: BucketKind) -> usize {
    2 * kind.index()
}

/// The index of a bucket's burst level in [`SharedBuckets`].
const fn burst_level(kind: BucketKind) -> usize {
    2 * kind.index() + 1
}

/// The state of a throttle group: the theoretical arrival time, in nanoseconds of
/// `CLOCK_MONOTONIC`, of each level (see the module documentation).
///
/// Layout, for a shared memory file: `#[repr(C)]`, 96 bytes, 8-byte aligned; level `2 × b` is
/// the main level and `2 × b + 1` the burst level of bucket `b` in QEMU's order
/// ([`BucketKind::ALL`]). All zero bytes is the cleared state (every bucket empty), so a
/// freshly created file needs no initialisation. Levels are only meaningful on one boot's
/// `CLOCK_MONOTONIC`: a file that outlives a reboot must be [cleared](Self::clear).
#[repr(C)]
#[derive(Debug, Default)]
pub struct SharedBuckets {
    tat: [AtomicU64; LEVELS],
}

const _: () = assert!(size_of::<SharedBuckets>() == 96);
const _: () = assert!(align_of::<SharedBuckets>() == 8);

impl SharedBuckets {
    /// Empty buckets.
    pub const fn new() -> Self {
        SharedBuckets {
            tat: [const { AtomicU64::new(0) }; LEVELS],
        }
    }

    /// Empties every bucket. A time of 0 is in the past of any `now`, i.e. an empty level.
    pub fn clear(&self) {
        for tat in &self.tat {
            // Relaxed: each level is an independent value and no other memory is published
            // through it; stores and CAS on one atomic are totally ordered whatever the
            // ordering, which is all the accounting relies on.
            tat.store(0, Ordering::Relaxed);
        }
    }

    /// How long a level must leak before it is back at its size (0 if it is not above it).
    fn excess_ns(&self, level: usize, now_ns: u64, tolerance_ns: u64) -> u64 {
        self.tat[level]
            .load(Ordering::Relaxed)
            .saturating_sub(now_ns)
            .saturating_sub(tolerance_ns)
    }

    /// Adds `cost_ns` to a level at `now_ns`: `TAT ← max(TAT, now) + cost`.
    fn account(&self, level: usize, now_ns: u64, cost_ns: u64) {
        // The closure always returns Some, so fetch_update cannot fail; it is a CAS loop.
        let _ = self.tat[level].fetch_update(Ordering::Relaxed, Ordering::Relaxed, |tat| {
            Some(tat.max(now_ns).saturating_add(cost_ns))
        });
    }
}

/// The direction of a request for throttling: which buckets it is checked against and
/// accounted in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Direction {
    /// `bps_total`, `bps_read`, `iops_total`, `iops_read`.
    Read,
    /// `bps_total`, `bps_write`, `iops_total`, `iops_write`.
    Write,
}

impl Direction {
    /// The buckets of this direction, in the order QEMU's `throttle_compute_wait_for` checks
    /// them (the order does not change the result: the wait is their maximum).
    const fn buckets(self) -> [BucketKind; 4] {
        match self {
            Direction::Read => [
                BucketKind::BpsTotal,
                BucketKind::IopsTotal,
                BucketKind::BpsRead,
                BucketKind::IopsRead,
            ],
            Direction::Write => [
                BucketKind::BpsTotal,
                BucketKind::IopsTotal,
                BucketKind::BpsWrite,
                BucketKind::IopsWrite,
            ],
        }
    }
}

/// A virtio-blk request type, to decide what is throttled the way QEMU does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Operation {
    /// `VIRTIO_BLK_T_IN`.
    Read,
    /// `VIRTIO_BLK_T_OUT`.
    Write,
    /// `VIRTIO_BLK_T_WRITE_ZEROES`.
    WriteZeroes,
    /// `VIRTIO_BLK_T_DISCARD`.
    Discard,
    /// `VIRTIO_BLK_T_FLUSH`.
    Flush,
    /// `VIRTIO_BLK_T_GET_ID`.
    GetId,
}

impl Operation {
    /// The direction the request is throttled as, or `None` if it is not throttled.
    ///
    /// This is QEMU's block-backend throttling, the one behind `-drive throttling.*`,
    /// `block_set_io_throttle` and throttle groups on a device: it intercepts the read and
    /// write paths (`blk_co_do_preadv_part`, `blk_co_do_pwritev_part`). Write-zeroes goes
    /// through the write path, so it counts as a write of its full byte count; discard and
    /// flush take other paths and are not throttled. (QEMU's separate `throttle` filter
    /// driver also counts a discard as a write; that is not followed here, because a discard
    /// moves no data and charging its byte count would stall a guest for trimming.)
    pub const fn throttled_as(self) -> Option<Direction> {
        match self {
            Operation::Read => Some(Direction::Read),
            Operation::Write | Operation::WriteZeroes => Some(Direction::Write),
            Operation::Discard | Operation::Flush | Operation::GetId => None,
        }
    }
}

/// The answer of [`Throttle::try_admit`].
#[must_use]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// The request may go; it has been accounted.
    Go,
    /// The request must wait this many nanoseconds (at least 1) and then ask again; nothing
    /// has been accounted.
    Wait(u64),
}

/// What one bucket's limits mean for its levels, computed once per limits change.
#[derive(Debug, Clone, Copy, Default)]
struct BucketParams {
    /// Leak rate of the main level, units per second; 0: the bucket is not limited.
    avg: u64,
    /// Leak rate of the burst level.
    max: u64,
    /// Tolerance of the main level.
    main_tolerance_ns: u64,
    /// Whether the burst level is in use (`max_length > 1`).
    burst: bool,
}

impl BucketParams {
    fn new(limits: &ThrottleLimits, kind: BucketKind) -> Self {
        let bucket = limits.bucket(kind);
        if !bucket.is_limited() {
            return BucketParams::default();
        }
        let main_tolerance_ns = if bucket.max == 0 {
            TENTH_SECOND_NS
        } else {
            // size / rate = max × length / avg seconds; ≤ 10^15 × 10^9 after validation, and
            // saturating in any case (more than 584 years is as good as forever).
            let size_ns = u128::from(bucket.max)
                .saturating_mul(u128::from(bucket.burst_length()))
                .saturating_mul(NS_PER_SEC);
            size_ns
                .checked_div(u128::from(bucket.avg)) // avg ≠ 0: is_limited above
                .and_then(|ns| u64::try_from(ns).ok())
                .unwrap_or(u64::MAX)
        };
        BucketParams {
            avg: bucket.avg,
            max: bucket.max,
            main_tolerance_ns,
            burst: bucket.max != 0 && bucket.burst_length() > 1,
        }
    }
}

/// `⌈num × 10⁹ / (den × rate)⌉`: the time, in ns, that `num / den` units take to leak at
/// `rate` units per second, saturated at `u64::MAX`. 0 if `den × rate` is 0 (never the case
/// for a limited bucket).
fn cost_ns(num: u64, den: u64, rate: u64) -> u64 {
    // Both products fit 128 bits (u64 × 10⁹ and u64 × u64), so nothing here can overflow.
    let n = u128::from(num) * NS_PER_SEC;
    let d = u128::from(den) * u128::from(rate);
    if d == 0 {
        return 0;
    }
    // The common case (requests below 18 GB, rates within 64 bits) divides in 64 bits, which
    // is several times faster than the 128-bit division.
    let q = match (u64::try_from(n), u64::try_from(d)) {
        (Ok(n), Ok(d)) => u128::from(n.div_ceil(d)),
        _ => n.div_ceil(d),
    };
    u64::try_from(q).unwrap_or(u64::MAX)
}

/// One process's view of a throttle group: the group's limits and the shared levels.
///
/// `B` is whatever holds the [`SharedBuckets`]: a reference, an `Arc`, or a handle on a
/// shared memory mapping. Views are cheap; each worker thread may have its own.
#[derive(Debug)]
pub struct Throttle<B> {
    limits: ThrottleLimits,
    params: [BucketParams; 6],
    shared: B,
}

impl<B: Deref<Target = SharedBuckets>> Throttle<B> {
    /// A view with `limits` on `shared`, which is left as it is (joining a group does not
    /// reset it). Fails if the limits break one of QEMU's rules.
    pub fn new(limits: ThrottleLimits, shared: B) -> Result<Self, LimitsError> {
        limits.validate()?;
        Ok(Throttle {
            limits,
            params: BucketKind::ALL.map(|kind| BucketParams::new(&limits, kind)),
            shared,
        })
    }

    /// The limits in force.
    pub fn limits(&self) -> &ThrottleLimits {
        &self.limits
    }

    /// The shared levels.
    pub fn shared(&self) -> &SharedBuckets {
        &self.shared
    }

    /// Replaces the limits; the next [`try_admit`](Self::try_admit) uses them.
    ///
    /// Like QEMU's `throttle_config`, which zeroes every level whenever limits are set (also
    /// when they did not change), this [clears](Self::clear) the shared levels: a level kept
    /// as a time would otherwise be reinterpreted at the new rate. Every member of a group
    /// clearing the levels as it learns the new limits clears them a few times in a row,
    /// which is the same thing. Invalid limits are refused and change nothing.
    pub fn set_limits(&mut self, limits: ThrottleLimits) -> Result<(), LimitsError> {
        limits.validate()?;
        self.limits = limits;
        self.params = BucketKind::ALL.map(|kind| BucketParams::new(&limits, kind));
        self.shared.clear();
        Ok(())
    }

    /// Empties every bucket of the group.
    pub fn clear(&self) {
        self.shared.clear();
    }

    /// Asks whether a request of `bytes` in direction `dir` may go at `now_ns` (nanoseconds of
    /// `CLOCK_MONOTONIC`, the clock all members share).
    ///
    /// [`Admission::Go`]: no level of the direction is above its size; the request has been
    /// accounted and must be executed. [`Admission::Wait`]: the time until the level
    /// furthest above its size is back at it (the maximum over all levels); nothing has been
    /// accounted. Queueing is the caller's business: QEMU also makes a request wait while
    /// earlier ones of the same direction are waiting, so that they go in order, and in a
    /// group while another member's request of that direction waits (round robin).
    ///
    /// Read `now_ns` right before the call: an older time makes the check stricter, but if a
    /// bucket was empty it also charges the request from that older time, under-accounting
    /// the time in between.
    pub fn try_admit(&self, dir: Direction, bytes: u64, now_ns: u64) -> Admission {
        let wait = self.wait_ns(dir, now_ns);
        if wait > 0 {
            return Admission::Wait(wait);
        }

        for kind in dir.buckets() {
            let p = &self.params[kind.index()];
            if p.avg == 0 {
                continue;
            }
            let (num, den) = self.units(kind, bytes);
            self.shared
                .account(main_level(kind), now_ns, cost_ns(num, den, p.avg));
            if p.burst {
                self.shared
                    .account(burst_level(kind), now_ns, cost_ns(num, den, p.max));
            }
        }
        Admission::Go
    }

    /// How long a request in direction `dir` would have to wait at `now_ns` (0: it could go
    /// now), without accounting anything: for a group member whose turn it is not, to know
    /// when to look again.
    pub fn wait_ns(&self, dir: Direction, now_ns: u64) -> u64 {
        let mut wait = 0;
        for kind in dir.buckets() {
            let p = &self.params[kind.index()];
            if p.avg == 0 {
                continue;
            }
            wait = wait.max(
                self.shared
                    .excess_ns(main_level(kind), now_ns, p.main_tolerance_ns),
            );
            if p.burst {
                wait = wait.max(
                    self.shared
                        .excess_ns(burst_level(kind), now_ns, TENTH_SECOND_NS),
                );
            }
        }
        wait
    }

    /// What a request of `bytes` counts in a bucket, as the fraction `num / den` of units.
    fn units(&self, kind: BucketKind, bytes: u64) -> (u64, u64) {
        let size = self.limits.iops_size;
        if kind.counts_bytes() {
            (bytes, 1)
        } else if size != 0 && bytes > size {
            (bytes, size)
        } else {
            (1, 1)
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::thread;

    use super::*;
    use crate::config::{BucketLimit, VALUE_MAX};

    const MS: u64 = 1_000_000;
    const S: u64 = 1_000_000_000;
    const KIB: u64 = 1024;
    const MIB: u64 = 1024 * 1024;

    fn view(limits: ThrottleLimits, shared: &SharedBuckets) -> Throttle<&SharedBuckets> {
        Throttle::new(limits, shared).expect("valid limits")
    }

    fn iops_total(avg: u64) -> ThrottleLimits {
        ThrottleLimits {
            iops_total: BucketLimit::avg(avg),
            ..Default::default()
        }
    }

    fn tat(shared: &SharedBuckets, level: usize) -> u64 {
        shared.tat[level].load(Ordering::Relaxed)
    }

    /// A guest that always has the next request ready: the times in `[start, end)` at which
    /// its requests were admitted, retrying exactly when told to.
    fn greedy<B: Deref<Target = SharedBuckets>>(
        t: &Throttle<B>,
        dir: Direction,
        bytes: u64,
        start: u64,
        end: u64,
    ) -> Vec<u64> {
        let mut now = start;
        let mut times = Vec::new();
        while now < end {
            match t.try_admit(dir, bytes, now) {
                Admission::Go => times.push(now),
                Admission::Wait(ns) => {
                    assert!(ns > 0);
                    now = now.saturating_add(ns);
                }
            }
            assert!(times.len() < 10_000_000, "runaway admission");
        }
        times
    }

    /// Admissions in `[from, to)`.
    fn count_in(times: &[u64], from: u64, to: u64) -> u64 {
        times.iter().filter(|&&t| (from..to).contains(&t)).count() as u64
    }

    /// Asserts that the units admitted per second in `[from, to)` are within 1% of `avg`.
    fn assert_rate(times: &[u64], units_each: f64, from: u64, to: u64, avg: u64) {
        let rate = count_in(times, from, to) as f64 * units_each / ((to - from) as f64 / S as f64);
        let error = (rate / avg as f64 - 1.0).abs();
        assert!(
            error < 0.01,
            "rate {rate} vs {avg}: {:.3}% off",
            error * 100.0
        );
    }

    #[test]
    fn layout_for_shared_memory() {
        assert_eq!(size_of::<SharedBuckets>(), 96);
        assert_eq!(align_of::<SharedBuckets>(), 8);
        assert_eq!(main_level(BucketKind::IopsWrite), 10);
        assert_eq!(burst_level(BucketKind::IopsWrite), 11);
        let shared = SharedBuckets::default();
        assert!((0..LEVELS).all(|l| tat(&shared, l) == 0));
    }

    #[test]
    fn cost_rounds_up_and_saturates() {
        assert_eq!(cost_ns(1, 1, 100), 10 * MS);
        // 10^9 / 3 = 333333333.3…: charged 1 ns more, never less.
        assert_eq!(cost_ns(1, 1, 3), 333_333_334);
        // 6 KiB at iops_size 4 KiB: 1.5 operations.
        assert_eq!(cost_ns(6 * KIB, 4 * KIB, 100), 15 * MS);
        // 128-bit path: u64::MAX bytes at 10^15 B/s = 18446.744073709551615 s.
        assert_eq!(cost_ns(u64::MAX, 1, VALUE_MAX), 18_446_744_073_710);
        assert_eq!(cost_ns(u64::MAX, 1, 1), u64::MAX);
        assert_eq!(cost_ns(5, 0, 0), 0);
    }

    /// iops_total = 100, no max. Cost 1/100 s = 10 ms; size avg/10 = 10 operations, τ = 100 ms.
    /// At t = 0 a request goes while the level before it is ≤ 10: levels 0, 1, …, 10, so 11
    /// go (the 11th takes the level to 11, one request above the size). The 12th sees level
    /// 11 and waits (11 − 10) / 100 s = 10 ms; from then on one goes every 10 ms.
    #[test]
    fn iops_100_without_burst() {
        let shared = SharedBuckets::new();
        let t = view(iops_total(100), &shared);
        for _ in 0..11 {
            assert_eq!(t.try_admit(Direction::Read, 4096, 0), Admission::Go);
        }
        assert_eq!(
            t.try_admit(Direction::Read, 4096, 0),
            Admission::Wait(10 * MS)
        );
        assert_eq!(
            t.try_admit(Direction::Write, 4096, MS),
            Admission::Wait(9 * MS)
        );
        assert_eq!(t.try_admit(Direction::Read, 4096, 10 * MS), Admission::Go);
        assert_eq!(
            t.try_admit(Direction::Read, 4096, 10 * MS),
            Admission::Wait(10 * MS)
        );

        t.clear();
        let times = greedy(&t, Direction::Read, 4096, 0, S + 1);
        // 11 at t = 0, then 10 ms, 20 ms, …, 1000 ms.
        assert_eq!(times.len(), 111);
        assert!(times[..11].iter().all(|&t| t == 0));
        for (i, &at) in times[11..].iter().enumerate() {
            assert_eq!(at, (i as u64 + 1) * 10 * MS);
        }
    }

    /// iops_total = 1000, iops_total_max = 2000, iops_total_max_length = 5.
    ///
    /// Main level: cost 1 ms, size 2000 × 5 = 10000 operations, τ = 10000 / 1000 s = 10 s.
    /// Burst level: cost 0.5 ms, size 2000 / 10 = 200 operations, τ = 100 ms.
    ///
    /// At t = 0 the burst level admits while it is ≤ 200: 201 requests. Then it lets one go
    /// every 0.5 ms: request n (0-based, n ≥ 201) at (n − 200) × 0.5 ms. The main level never
    /// empties, so before request n its TAT is n ms and TAT − t = n ms − (n − 200) × 0.5 ms =
    /// (0.5 n + 100) ms, which must be ≤ 10 s: n ≤ 19800. So the guest runs at 2000/s until
    /// request 19800 at 9.8 s. The burst lasts 9.8 s, not 5: the main bucket fills at
    /// 2000 − 1000 = 1000 per second, since it leaks while it fills (QEMU's docs/throttle.txt
    /// notes the same for its example). After that request n goes when n ms − t = 10 s, i.e.
    /// at n ms − 10 s: 1000/s from request 19801 at 9.801 s.
    #[test]
    fn burst_iops_1000_max_2000_length_5() {
        let shared = SharedBuckets::new();
        let limits = ThrottleLimits {
            iops_total: BucketLimit::with_burst(1000, 2000, 5),
            ..Default::default()
        };
        let t = view(limits, &shared);
        let times = greedy(&t, Direction::Write, 4096, 0, 20 * S + 1);

        assert_eq!(count_in(&times, 0, 1), 201);
        for (n, &at) in times.iter().enumerate().take(19801).skip(201) {
            assert_eq!(at, (n as u64 - 200) * MS / 2, "request {n}");
        }
        for (n, &at) in times.iter().enumerate().skip(19801) {
            assert_eq!(at, n as u64 * MS - 10 * S, "request {n}");
        }
        assert_eq!(times[19801], 9_801 * MS);
        // n ms − 10 s ≤ 20 s: n ≤ 30000.
        assert_eq!(times.len(), 30001);
        assert_eq!(count_in(&times, S, 9 * S), 16000); // 2000/s
        assert_eq!(count_in(&times, 11 * S, 19 * S), 8000); // 1000/s

        // The main level is empty at TAT = 30001 ms: after idling, a full burst is available
        // again, starting with 201 at once.
        assert_eq!(tat(&shared, main_level(BucketKind::IopsTotal)), 30_001 * MS);
        let again = greedy(&t, Direction::Write, 4096, 40 * S, 40 * S + 1);
        assert_eq!(again.len(), 201);
    }

    /// A burst rate with max_length 1 (no burst level): the main bucket is max × 1 = 2000
    /// operations, τ = 2000 / 100 s = 20 s, so 2001 go at once, then one per 10 ms.
    #[test]
    fn burst_length_one_is_one_big_bucket() {
        let shared = SharedBuckets::new();
        let limits = ThrottleLimits {
            iops_read: BucketLimit::with_burst(100, 2000, 0),
            ..Default::default()
        };
        let t = view(limits, &shared);
        let times = greedy(&t, Direction::Read, 512, 0, S);
        assert_eq!(count_in(&times, 0, 1), 2001);
        assert_eq!(times.len(), 2001 + 99);
        assert_eq!(tat(&shared, burst_level(BucketKind::IopsRead)), 0);
    }

    /// bps_total = 20 MiB/s with 128 KiB requests: cost 131072 / 20971520 s = 6.25 ms; size
    /// avg/10 = 2 MiB = 16 requests (τ = 100 ms), so 17 go at t = 0, then one every 6.25 ms:
    /// 17 + 1600 in the first 10 s, 160 per second = 20 MiB/s.
    #[test]
    fn bps_20mib_with_128k_requests() {
        let shared = SharedBuckets::new();
        let limits = ThrottleLimits {
            bps_total: BucketLimit::avg(20 * MIB),
            ..Default::default()
        };
        let t = view(limits, &shared);
        let times = greedy(&t, Direction::Read, 128 * KIB, 0, 10 * S + 1);
        assert_eq!(count_in(&times, 0, 1), 17);
        assert_eq!(times.len(), 17 + 1600);
        assert_eq!(times[17], 6_250_000);
        assert_eq!(times[18], 12_500_000);
        assert_eq!(count_in(&times, S, 2 * S) * 128 * KIB, 20 * MIB);
    }

    /// iops_size = 4 KiB, iops_total = 100 (cost 10 ms per operation).
    #[test]
    fn iops_size_counts_large_requests_proportionally() {
        let shared = SharedBuckets::new();
        let limits = ThrottleLimits {
            iops_total: BucketLimit::avg(100),
            bps_total: BucketLimit::avg(MIB),
            iops_size: 4 * KIB,
            ..Default::default()
        };
        let t = view(limits, &shared);
        let iops = main_level(BucketKind::IopsTotal);
        let bps = main_level(BucketKind::BpsTotal);
        // 64 KiB = 16 operations: TAT 160 ms. In the bps bucket it is 65536 bytes at 1 MiB/s
        // = 62.5 ms: iops_size does not change byte counting.
        assert_eq!(t.try_admit(Direction::Read, 64 * KIB, 0), Admission::Go);
        assert_eq!(tat(&shared, iops), 160 * MS);
        assert_eq!(tat(&shared, bps), 62_500_000);
        // Level 16 > 10: wait (16 − 10) / 100 s = 60 ms.
        assert_eq!(t.try_admit(Direction::Read, 1, 0), Admission::Wait(60 * MS));

        // 4 KiB, 512 B and 0 B count one operation each; 6 KiB counts 1.5.
        for (bytes, cost) in [
            (4 * KIB, 10 * MS),
            (512, 10 * MS),
            (0, 10 * MS),
            (6 * KIB, 15 * MS),
        ] {
            t.clear();
            assert_eq!(t.try_admit(Direction::Write, bytes, 0), Admission::Go);
            assert_eq!(tat(&shared, iops), cost, "{bytes} bytes");
        }
    }

    /// Reads use the total and read buckets, writes the total and write buckets.
    #[test]
    fn read_write_and_total_buckets() {
        // iops_read = 100 (11 at once), iops_write = 10 (size 1: 2 at once, then the level 2
        // is 1 above the size: wait 1/10 s).
        let shared = SharedBuckets::new();
        let limits = ThrottleLimits {
            iops_read: BucketLimit::avg(100),
            iops_write: BucketLimit::avg(10),
            ..Default::default()
        };
        let t = view(limits, &shared);
        assert_eq!(greedy(&t, Direction::Write, 4096, 0, 1).len(), 2);
        assert_eq!(
            t.try_admit(Direction::Write, 4096, 0),
            Admission::Wait(100 * MS)
        );
        assert_eq!(greedy(&t, Direction::Read, 4096, 0, 1).len(), 11);
        assert_eq!(
            t.try_admit(Direction::Read, 4096, 0),
            Admission::Wait(10 * MS)
        );

        // iops_total = 100: reads and writes share 11.
        let shared = SharedBuckets::new();
        let t = view(iops_total(100), &shared);
        for i in 0..11 {
            let dir = if i % 2 == 0 {
                Direction::Read
            } else {
                Direction::Write
            };
            assert_eq!(t.try_admit(dir, 4096, 0), Admission::Go);
        }
        assert_eq!(
            t.try_admit(Direction::Write, 4096, 0),
            Admission::Wait(10 * MS)
        );
        assert_eq!(
            t.try_admit(Direction::Read, 4096, 0),
            Admission::Wait(10 * MS)
        );

        // bps_write only: reads are never held nor accounted.
        let shared = SharedBuckets::new();
        let limits = ThrottleLimits {
            bps_write: BucketLimit::avg(MIB),
            ..Default::default()
        };
        let t = view(limits, &shared);
        assert_eq!(t.try_admit(Direction::Write, 10 * MIB, 0), Admission::Go);
        assert!(matches!(
            t.try_admit(Direction::Write, 1, 0),
            Admission::Wait(_)
        ));
        for _ in 0..1000 {
            assert_eq!(t.try_admit(Direction::Read, 10 * MIB, 0), Admission::Go);
        }
        assert_eq!(tat(&shared, main_level(BucketKind::BpsRead)), 0);
        assert_eq!(tat(&shared, main_level(BucketKind::BpsTotal)), 0);
    }

    /// The wait is the largest over all the levels of the direction.
    #[test]
    fn wait_is_for_the_fullest_level() {
        // 512 KiB at 1 MiB/s costs 500 ms in bps_total (τ 100 ms) but 10 ms in iops_total.
        let shared = SharedBuckets::new();
        let limits = ThrottleLimits {
            bps_total: BucketLimit::avg(MIB),
            iops_total: BucketLimit::avg(100),
            ..Default::default()
        };
        let t = view(limits, &shared);
        assert_eq!(t.try_admit(Direction::Read, 512 * KIB, 0), Admission::Go);
        assert_eq!(
            t.try_admit(Direction::Read, 512 * KIB, 0),
            Admission::Wait(400 * MS)
        );

        // With a burst level: iops_write 100, max 1000 for 2 s (main τ 20 s, burst τ 100 ms,
        // burst cost 1 ms): 101 go at once, then the burst level asks for 1 ms although the
        // main level (1.01 s of 20) is far from full. bps_write (cost 4096 B / 100 MB/s =
        // 40.96 µs) is not full either.
        let shared = SharedBuckets::new();
        let limits = ThrottleLimits {
            iops_write: BucketLimit::with_burst(100, 1000, 2),
            bps_write: BucketLimit::avg(100_000_000),
            ..Default::default()
        };
        let t = view(limits, &shared);
        assert_eq!(greedy(&t, Direction::Write, 4096, 0, 1).len(), 101);
        assert_eq!(t.try_admit(Direction::Write, 4096, 0), Admission::Wait(MS));
        assert_eq!(tat(&shared, main_level(BucketKind::IopsWrite)), 1010 * MS);
    }

    #[test]
    fn unlimited_always_goes_and_touches_nothing() {
        let shared = SharedBuckets::new();
        let t = view(ThrottleLimits::default(), &shared);
        for dir in [Direction::Read, Direction::Write] {
            for _ in 0..100 {
                assert_eq!(t.try_admit(dir, u64::MAX, 0), Admission::Go);
            }
        }
        assert!((0..LEVELS).all(|l| tat(&shared, l) == 0));
    }

    /// A guest that never stops asking, run on a simulated clock: the admitted rate matches
    /// the average within 1%, including rates whose cost is not a whole number of ns.
    #[test]
    fn long_runs_hold_the_average_rate() {
        struct Case {
            limits: ThrottleLimits,
            dir: Direction,
            bytes: u64,
            units_each: f64,
            avg: u64,
        }
        let cases = [
            Case {
                limits: iops_total(3), // 333333333.3 ns per operation
                dir: Direction::Read,
                bytes: 4096,
                units_each: 1.0,
                avg: 3,
            },
            Case {
                limits: ThrottleLimits {
                    bps_read: BucketLimit::avg(20 * MIB),
                    ..Default::default()
                },
                dir: Direction::Read,
                bytes: 128 * KIB,
                units_each: (128 * KIB) as f64,
                avg: 20 * MIB,
            },
            Case {
                limits: ThrottleLimits {
                    bps_write: BucketLimit::with_burst(1_000_000, 3_000_000, 7),
                    ..Default::default()
                },
                dir: Direction::Write,
                bytes: 4097,
                units_each: 4097.0,
                avg: 1_000_000,
            },
            Case {
                limits: ThrottleLimits {
                    iops_write: BucketLimit::with_burst(1000, 2000, 5),
                    iops_size: 4096,
                    ..Default::default()
                },
                dir: Direction::Write,
                bytes: 10_000, // 2.44140625 operations
                units_each: 10_000.0 / 4096.0,
                avg: 1000,
            },
        ];
        for case in cases {
            let shared = SharedBuckets::new();
            let t = view(case.limits, &shared);
            let times = greedy(&t, case.dir, case.bytes, 0, 300 * S);
            // Past the initial bucket (at most 10000 operations or 7 s of burst).
            assert_rate(&times, case.units_each, 60 * S, 300 * S, case.avg);
        }
    }

    /// New limits apply to the next admission, and the levels restart empty (QEMU's
    /// throttle_config zeroes them).
    #[test]
    fn limits_change_mid_run() {
        let shared = SharedBuckets::new();
        let mut t = view(iops_total(100), &shared);
        assert_eq!(greedy(&t, Direction::Read, 4096, 0, S + 1).len(), 111);
        assert_eq!(
            t.try_admit(Direction::Read, 4096, S),
            Admission::Wait(10 * MS)
        );

        // Raised to 1000: cost 1 ms, τ 100 ms, empty: 101 at once, then one per ms.
        let raised = iops_total(1000);
        t.set_limits(raised).expect("valid");
        assert_eq!(t.limits(), &raised);
        let times = greedy(&t, Direction::Read, 4096, S, 2 * S);
        assert_eq!(count_in(&times, S, S + 1), 101);
        assert_eq!(times[101], S + MS);
        assert_eq!(times.len(), 101 + 999);

        // Lowered to 10: cost 100 ms, τ 100 ms: 2 at once, then one per 100 ms.
        t.set_limits(iops_total(10)).expect("valid");
        assert_eq!(greedy(&t, Direction::Read, 4096, 2 * S, 2 * S + 1).len(), 2);
        assert_eq!(
            t.try_admit(Direction::Read, 4096, 2 * S),
            Admission::Wait(100 * MS)
        );

        // Invalid limits change nothing, not even the levels.
        let bad = ThrottleLimits {
            iops_total: BucketLimit::avg(10),
            iops_read: BucketLimit::avg(10),
            ..Default::default()
        };
        assert_eq!(t.set_limits(bad).map_err(|e| e.field()), Err("iops_read"));
        assert_eq!(t.limits(), &iops_total(10));
        assert_eq!(
            t.try_admit(Direction::Read, 4096, 2 * S),
            Admission::Wait(100 * MS)
        );

        // Removing the limits lets everything through.
        t.set_limits(ThrottleLimits::default()).expect("valid");
        assert_eq!(t.try_admit(Direction::Read, 4096, 2 * S), Admission::Go);
    }

    #[test]
    fn clear_empties_the_buckets() {
        let shared = SharedBuckets::new();
        let t = view(iops_total(100), &shared);
        assert_eq!(greedy(&t, Direction::Read, 1, 0, 1).len(), 11);
        t.clear();
        assert!((0..LEVELS).all(|l| tat(&shared, l) == 0));
        assert_eq!(greedy(&t, Direction::Read, 1, 0, 1).len(), 11);
    }

    /// Two views on one SharedBuckets, as two disks in two processes of one throttle group
    /// with iops_total = 100: together they get exactly what one would get alone (11 + 1000
    /// in [0, 10 s]), shared about evenly when they take turns.
    #[test]
    fn two_members_share_the_group_rate() {
        let shared = Arc::new(SharedBuckets::new());
        let a = Throttle::new(iops_total(100), Arc::clone(&shared)).expect("valid");
        let b = Throttle::new(iops_total(100), Arc::clone(&shared)).expect("valid");
        let members = [(&a, Direction::Read), (&b, Direction::Write)];
        let mut counts = [0u64; 2];
        let mut now = 0;
        // Round robin, as QEMU's throttle groups: after a member's request goes, the other
        // member asks first.
        let mut first = 0;
        while now <= 10 * S {
            let mut next = u64::MAX;
            let mut admitted = false;
            for k in 0..2 {
                let i = (first + k) % 2;
                let (member, dir) = members[i];
                match member.try_admit(dir, 4096, now) {
                    Admission::Go => {
                        counts[i] += 1;
                        admitted = true;
                        first = (i + 1) % 2;
                        break;
                    }
                    Admission::Wait(ns) => next = next.min(ns),
                }
            }
            if !admitted {
                now += next;
            }
        }
        assert_eq!(counts[0] + counts[1], 11 + 1000);
        assert!(counts[0].abs_diff(counts[1]) <= 1, "{counts:?}");
    }

    /// Threads (standing in for processes) hammer one SharedBuckets on a shared simulated
    /// clock that advances 1 µs per attempt. iops_total = 10000 (cost 100 µs, τ 100 ms) and a
    /// bps_total that never binds but adds levels to update. A single greedy guest on this
    /// clock gets ⌊(t_last + τ) / cost⌋ + 1 requests by t_last; the threads together must stay
    /// within one request per thread of that.
    #[test]
    fn concurrent_members_stay_within_one_request_each() {
        const THREADS: u64 = 4;
        const STEP: u64 = 1000;
        const END: u64 = 300 * MS;
        let shared = SharedBuckets::new();
        let limits = ThrottleLimits {
            iops_total: BucketLimit::avg(10_000),
            bps_total: BucketLimit::with_burst(1 << 40, 1 << 41, 10),
            ..Default::default()
        };
        let clock = AtomicU64::new(0);
        let total: u64 = thread::scope(|s| {
            let handles: Vec<_> = (0..THREADS)
                .map(|i| {
                    let t = view(limits, &shared);
                    let clock = &clock;
                    s.spawn(move || {
                        let dir = if i % 2 == 0 {
                            Direction::Read
                        } else {
                            Direction::Write
                        };
                        let mut admitted = 0u64;
                        loop {
                            let now = clock.fetch_add(STEP, Ordering::Relaxed);
                            if now >= END {
                                return admitted;
                            }
                            if t.try_admit(dir, 4096, now) == Admission::Go {
                                admitted += 1;
                            }
                        }
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("thread")).sum()
        });
        let ideal = (END - STEP + 100 * MS) / (100 * 1000) + 1; // 3999 + 1
        assert!(
            total.abs_diff(ideal) <= THREADS,
            "{total} admitted, ideal {ideal}"
        );
    }

    #[test]
    fn extreme_values_saturate_without_panicking() {
        // A burst of 10^15 over 1 s at an average of 1 B/s: τ = 10^24 ns saturates, so the
        // main level never fills (the burst would last 31 million years).
        let shared = SharedBuckets::new();
        let limits = ThrottleLimits {
            bps_total: BucketLimit::with_burst(1, VALUE_MAX, 1),
            iops_total: BucketLimit::avg(1),
            iops_size: 1,
            ..Default::default()
        };
        let t = view(limits, &shared);
        assert_eq!(t.try_admit(Direction::Read, u64::MAX, 0), Admission::Go);
        // u64::MAX operations (iops_size 1) at 1/s: the iops TAT saturates instead of
        // wrapping around, and the next request waits until the end of time.
        assert_eq!(tat(&shared, main_level(BucketKind::IopsTotal)), u64::MAX);
        assert_eq!(tat(&shared, main_level(BucketKind::BpsTotal)), u64::MAX);
        assert_eq!(
            t.try_admit(Direction::Write, 0, 0),
            Admission::Wait(u64::MAX - 100 * MS)
        );
        // At the end of the clock everything is in the past again; still no overflow.
        assert_eq!(
            t.try_admit(Direction::Read, u64::MAX, u64::MAX),
            Admission::Go
        );

        // Long bursts at the largest allowed length.
        let limits = ThrottleLimits {
            iops_write: BucketLimit::with_burst(1, 1_000_000, 1_000_000_000),
            ..Default::default()
        };
        let shared = SharedBuckets::new();
        let t = view(limits, &shared);
        // Only the burst level holds: 10^6/10 + 1 at once.
        assert_eq!(greedy(&t, Direction::Write, 1, 0, 1).len(), 100_001);
    }

    #[test]
    fn what_is_throttled() {
        assert_eq!(Operation::Read.throttled_as(), Some(Direction::Read));
        assert_eq!(Operation::Write.throttled_as(), Some(Direction::Write));
        assert_eq!(
            Operation::WriteZeroes.throttled_as(),
            Some(Direction::Write)
        );
        assert_eq!(Operation::Discard.throttled_as(), None);
        assert_eq!(Operation::Flush.throttled_as(), None);
        assert_eq!(Operation::GetId.throttled_as(), None);
    }
}
