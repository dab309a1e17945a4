//! Counters the queue workers keep for the admin channel, and the device status it reports.
//!
//! Each queue's counters have exactly one writer (the worker thread that owns the queue), so
//! an update is a relaxed load and store — no locked read-modify-write, no lock, no allocation
//! on the I/O path. The admin thread reads them with relaxed loads; a snapshot may mix values
//! from a few requests apart, which is fine for statistics.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use blkplane_lock::lock;

use crate::rejection::RejectReason;
use blkplane_proto::ring::Opcode;

/// Latency buckets: bucket `i` holds latencies up to 2^i µs; the last one everything longer.
pub const LATENCY_BUCKETS: usize = 24;

/// Adds `n` to a counter that only the calling thread writes.
fn bump(counter: &AtomicU64, n: u64) {
    counter.store(
        counter.load(Ordering::Relaxed).wrapping_add(n),
        Ordering::Relaxed,
    );
}

/// The bucket a latency falls in.
pub fn latency_bucket(latency: Duration) -> usize {
    let micros = u64::try_from(latency.as_micros())
        .unwrap_or(u64::MAX)
        .max(1);
    // ceil(log2(micros)): 1 µs → 0, 2 → 1, 3..=4 → 2, …
    // micros >= 1, and leading_zeros() <= 64 = u64::BITS.
    let bits = u64::BITS.saturating_sub(micros.saturating_sub(1).leading_zeros());
    (bits as usize).min(LATENCY_BUCKETS.saturating_sub(1))
}

/// Upper bound of bucket `i` in µs (the last is unbounded).
pub fn bucket_upper_bound_us(i: usize) -> u64 {
    if i.saturating_add(1) >= LATENCY_BUCKETS {
        u64::MAX
    } else {
        1u64 << i
    }
}

/// One queue's counters.
#[derive(Debug, Default)]
pub struct QueueCounters {
    /// Completed reads.
    pub read_ops: AtomicU64,
    /// Bytes read.
    pub read_bytes: AtomicU64,
    /// Completed writes.
    pub write_ops: AtomicU64,
    /// Bytes written.
    pub write_bytes: AtomicU64,
    /// Completed flushes.
    pub flush_ops: AtomicU64,
    /// Completed discards.
    pub discard_ops: AtomicU64,
    /// Bytes discarded.
    pub discard_bytes: AtomicU64,
    /// Completed write-zeroes.
    pub write_zeroes_ops: AtomicU64,
    /// Bytes zeroed.
    pub write_zeroes_bytes: AtomicU64,
    /// Requests answered by the frontend (GET_ID).
    pub other_ops: AtomicU64,
    /// Requests completed with an error status.
    pub errors: AtomicU64,
    /// Requests rejected by validation.
    pub rejected: AtomicU64,
    /// `rejected` by rule, indexed by [`RejectReason::index`].
    pub rejected_by_reason: [AtomicU64; RejectReason::COUNT],
    /// Requests in flight.
    pub in_flight: AtomicU64,
    /// Latency histogram of requests that went to an iothread.
    pub latency: [AtomicU64; LATENCY_BUCKETS],
    /// Nanoseconds requests waited for the I/O limits, summed.
    pub throttled_ns: AtomicU64,
    /// Requests that waited for the I/O limits.
    pub throttled_ops: AtomicU64,
    /// The ring is being served.
    pub running: AtomicBool,
    /// The driver broke the ring.
    pub broken: AtomicBool,
}

impl QueueCounters {
    /// Records a request handed to an iothread.
    pub fn submitted(&self) {
        bump(&self.in_flight, 1);
    }

    /// Records a request the iothread finished.
    pub fn completed(&self, opcode: Opcode, bytes: u64, ok: bool, latency: Duration) {
        self.in_flight.store(
            self.in_flight.load(Ordering::Relaxed).saturating_sub(1),
            Ordering::Relaxed,
        );
        if let Some(bucket) = self.latency.get(latency_bucket(latency)) {
            bump(bucket, 1);
        }
        if !ok {
            bump(&self.errors, 1);
            return;
        }
        let (ops, total) = match opcode {
            Opcode::Read => (&self.read_ops, Some(&self.read_bytes)),
            Opcode::Write => (&self.write_ops, Some(&self.write_bytes)),
            Opcode::Flush => (&self.flush_ops, None),
            Opcode::Discard => (&self.discard_ops, Some(&self.discard_bytes)),
            Opcode::WriteZeroes => (&self.write_zeroes_ops, Some(&self.write_zeroes_bytes)),
            // The worker's own answers are counted when decided (`answered`, `rejected`).
            Opcode::Answer => return,
        };
        bump(ops, 1);
        if let Some(total) = total {
            bump(total, bytes);
        }
    }

    /// Records a request that waited `waited_ns` for the I/O limits.
    pub fn throttled(&self, waited_ns: u64) {
        bump(&self.throttled_ops, 1);
        bump(&self.throttled_ns, waited_ns);
    }

    /// Records a request the frontend answered itself.
    pub fn answered(&self, ok: bool) {
        if ok {
            bump(&self.other_ops, 1);
        } else {
            bump(&self.errors, 1);
        }
    }

    /// Records a request rejected by validation for `reason` (`with_status`: an error status
    /// was written).
    pub fn rejected(&self, reason: RejectReason, with_status: bool) {
        bump(&self.rejected, 1);
        if let Some(by_reason) = self.rejected_by_reason.get(reason.index()) {
            bump(by_reason, 1);
        }
        if with_status {
            bump(&self.errors, 1);
        }
    }
}

/// One iothread's status.
#[derive(Debug, Default)]
pub struct IothreadStatus {
    /// Its pid (0 while none runs).
    pub pid: AtomicU32,
    /// How often it was replaced.
    pub restarts: AtomicU64,
    /// When it was last replaced, in ms since the Unix epoch (0: never).
    pub last_restart_unix_ms: AtomicU64,
    /// The counters its ring carries (inline and queued transfers), once the ring exists.
    pub ring_counters: std::sync::OnceLock<blkplane_proto::ring::RingCounters>,
}

/// Everything the admin channel reports, shared by the vhost-user thread, the workers and the
/// admin thread.
#[derive(Debug)]
pub struct DeviceStatus {
    /// Per device queue.
    pub queues: Vec<QueueCounters>,
    /// Per iothread.
    pub iothreads: Vec<IothreadStatus>,
    /// A VMM is connected.
    pub vmm_connected: AtomicBool,
    /// Acknowledged virtio features.
    pub acked_features: AtomicU64,
    /// Acknowledged protocol features.
    pub acked_protocol_features: AtomicU64,
    /// The disk is drained: no worker pops a request until it is resumed.
    pub drained: AtomicBool,
    /// Every worker marks the guest's writes in a bitmap blkplaned sent (TrackWrites).
    pub tracking_writes: AtomicBool,
    /// The migration blockers blkplaned sent (SetMigrationBlockers). Read and written on the
    /// control path only (admin channel, SET_FEATURES, SET_LOG_BASE), never per request.
    migration_blockers: Mutex<Vec<String>>,
    /// How the iothread replaced last had ended (empty: none was). Written when one is
    /// replaced, read by the admin channel.
    last_iothread_exit: Mutex<String>,
}

/// The prefix of a blocker line that names its reason (`"draining: …"` → `"draining:"`), so
/// that the frontend's own blockers are not listed twice when blkplaned sent the same reason.
fn reason_prefix(line: &str) -> Option<&str> {
    line.find(':').map(|end| &line[..=end])
}

impl DeviceStatus {
    /// Zeroed status for `queues` queues and `iothreads` iothreads.
    pub fn new(queues: u16, iothreads: u16) -> Self {
        Self {
            queues: (0..queues).map(|_| QueueCounters::default()).collect(),
            iothreads: (0..iothreads).map(|_| IothreadStatus::default()).collect(),
            vmm_connected: AtomicBool::new(false),
            acked_features: AtomicU64::new(0),
            acked_protocol_features: AtomicU64::new(0),
            drained: AtomicBool::new(false),
            tracking_writes: AtomicBool::new(false),
            migration_blockers: Mutex::new(Vec::new()),
            last_iothread_exit: Mutex::new(String::new()),
        }
    }

    /// Records how a replaced iothread had ended.
    pub fn set_last_iothread_exit(&self, how: String) {
        *lock(&self.last_iothread_exit) = how;
    }

    /// How the iothread replaced last had ended; empty if none was.
    pub fn last_iothread_exit(&self) -> String {
        lock(&self.last_iothread_exit).clone()
    }

    /// Replaces blkplaned's list of migration blockers.
    pub fn set_migration_blockers(&self, reasons: Vec<String>) {
        *lock(&self.migration_blockers) = reasons;
    }

    /// Every reason dirty logging must be refused now: blkplaned's list, then the frontend's
    /// own (it is drained) unless blkplaned already gave the same reason.
    pub fn migration_blockers(&self) -> Vec<String> {
        let mut all = lock(&self.migration_blockers).clone();
        let mut own = Vec::new();
        if self.drained.load(Ordering::Relaxed) {
            own.push("draining: the disk is drained until it is resumed".to_string());
        }
        for line in own {
            let prefix = reason_prefix(&line);
            if !all.iter().any(|l| reason_prefix(l) == prefix) {
                all.push(line);
            }
        }
        all
    }

    /// The counters of device queue `index`.
    pub fn queue(&self, index: u16) -> Option<&QueueCounters> {
        self.queues.get(usize::from(index))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_powers_of_two_microseconds() {
        assert_eq!(latency_bucket(Duration::from_nanos(10)), 0);
        assert_eq!(latency_bucket(Duration::from_micros(1)), 0);
        assert_eq!(latency_bucket(Duration::from_micros(2)), 1);
        assert_eq!(latency_bucket(Duration::from_micros(3)), 2);
        assert_eq!(latency_bucket(Duration::from_micros(4)), 2);
        assert_eq!(latency_bucket(Duration::from_micros(5)), 3);
        assert_eq!(
            latency_bucket(Duration::from_secs(3600)),
            LATENCY_BUCKETS - 1
        );
        for i in 0..LATENCY_BUCKETS - 1 {
            let bound = Duration::from_micros(bucket_upper_bound_us(i));
            assert_eq!(latency_bucket(bound), i, "bound of bucket {i}");
        }
    }

    #[test]
    fn completions_count_by_type() {
        let q = QueueCounters::default();
        q.submitted();
        q.submitted();
        q.completed(Opcode::Read, 4096, true, Duration::from_micros(3));
        q.completed(Opcode::Write, 512, false, Duration::from_micros(100));
        assert_eq!(q.read_ops.load(Ordering::Relaxed), 1);
        assert_eq!(q.read_bytes.load(Ordering::Relaxed), 4096);
        assert_eq!(q.write_ops.load(Ordering::Relaxed), 0);
        assert_eq!(q.errors.load(Ordering::Relaxed), 1);
        assert_eq!(q.in_flight.load(Ordering::Relaxed), 0);
        assert_eq!(q.latency[2].load(Ordering::Relaxed), 1);
        q.rejected(RejectReason::StatusEmpty, true);
        q.rejected(RejectReason::BeyondCapacity, false);
        q.rejected(RejectReason::BeyondCapacity, true);
        assert_eq!(q.rejected.load(Ordering::Relaxed), 3);
        let by = |r: RejectReason| q.rejected_by_reason[r.index()].load(Ordering::Relaxed);
        assert_eq!(
            (
                by(RejectReason::StatusEmpty),
                by(RejectReason::BeyondCapacity),
                by(RejectReason::ReadOnly)
            ),
            (1, 2, 0)
        );
        // The two written with a status are errors too, beside the failed completion above.
        assert_eq!(q.errors.load(Ordering::Relaxed), 3);
    }

    #[test]
    fn migration_blockers_combine_without_duplicates() {
        let status = DeviceStatus::new(1, 1);
        assert!(status.migration_blockers().is_empty());
        status.drained.store(true, Ordering::Relaxed);
        let own = status.migration_blockers();
        assert_eq!(own.len(), 1);
        assert!(own[0].starts_with("draining: "), "{own:?}");
        status.set_migration_blockers(vec!["operator_backup: nightly backup".into()]);
        assert_eq!(
            status.migration_blockers(),
            ["operator_backup: nightly backup", own[0].as_str()]
        );
        // blkplaned's own wording wins for a reason both know.
        status.set_migration_blockers(vec!["draining: drained by blkplaned".into()]);
        assert_eq!(
            status.migration_blockers(),
            ["draining: drained by blkplaned"]
        );
        status.set_migration_blockers(Vec::new());
        status.drained.store(false, Ordering::Relaxed);
        assert!(status.migration_blockers().is_empty());
    }
}
