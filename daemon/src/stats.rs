//! A frontend's per-queue statistics added up into the disk's total (GetStats `total`).

use blkplane_proto::v1::{LatencyHistogram, QueueStats};

/// Adds up per-queue counters into one (index = number of queues). Latency histograms are
/// added bucket by bucket when their bounds agree (they come from one frontend, so they do),
/// rejections reason by reason. The numbers are the frontend's word: sums saturate.
pub fn sum_queues(queues: &[QueueStats]) -> QueueStats {
    let mut t = QueueStats {
        index: u32::try_from(queues.len()).unwrap_or(u32::MAX),
        ..Default::default()
    };
    let mut latency: Option<LatencyHistogram> = None;
    for q in queues {
        for (sum, value) in [
            (&mut t.read_ops, q.read_ops),
            (&mut t.read_bytes, q.read_bytes),
            (&mut t.write_ops, q.write_ops),
            (&mut t.write_bytes, q.write_bytes),
            (&mut t.flush_ops, q.flush_ops),
            (&mut t.discard_ops, q.discard_ops),
            (&mut t.discard_bytes, q.discard_bytes),
            (&mut t.write_zeroes_ops, q.write_zeroes_ops),
            (&mut t.write_zeroes_bytes, q.write_zeroes_bytes),
            (&mut t.other_ops, q.other_ops),
            (&mut t.errors, q.errors),
            (&mut t.rejected, q.rejected),
            (&mut t.in_flight, q.in_flight),
            (&mut t.throttled_ns, q.throttled_ns),
            (&mut t.throttled_ops, q.throttled_ops),
        ] {
            *sum = sum.saturating_add(value);
        }
        for r in &q.rejections {
            match t.rejections.iter_mut().find(|s| s.reason == r.reason) {
                Some(sum) => sum.count = sum.count.saturating_add(r.count),
                None => t.rejections.push(r.clone()),
            }
        }
        if let Some(h) = &q.latency {
            match &mut latency {
                None => latency = Some(h.clone()),
                Some(sum) if sum.upper_bounds_us == h.upper_bounds_us => {
                    for (s, c) in sum.counts.iter_mut().zip(&h.counts) {
                        *s = s.saturating_add(*c);
                    }
                }
                Some(_) => {}
            }
        }
    }
    t.latency = latency;
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn totals() {
        let h = |c: Vec<u64>| LatencyHistogram {
            upper_bounds_us: vec![10, 100, u64::MAX],
            counts: c,
        };
        let q = |i: u32, r: u64, c: Vec<u64>| QueueStats {
            index: i,
            read_ops: r,
            read_bytes: r * 4096,
            in_flight: 1,
            latency: Some(h(c)),
            throttled_ns: 1000 * u64::from(i + 1),
            throttled_ops: 1,
            ..Default::default()
        };
        let t = sum_queues(&[q(0, 3, vec![1, 2, 0]), q(1, 5, vec![0, 4, 1])]);
        assert_eq!(t.index, 2);
        assert_eq!((t.throttled_ns, t.throttled_ops), (3000, 2));
        assert_eq!((t.read_ops, t.read_bytes, t.in_flight), (8, 8 * 4096, 2));
        assert_eq!(t.latency.unwrap().counts, vec![1, 6, 1]);
        assert_eq!(sum_queues(&[]).latency, None);
        // Rejections by reason; sums saturate rather than overflow.
        let r = |reason: &str, count| blkplane_proto::v1::RejectionCount {
            reason: reason.into(),
            count,
        };
        let a = QueueStats {
            rejections: vec![r("read_only", 2), r("empty_range", 0)],
            errors: u64::MAX,
            ..Default::default()
        };
        let b = QueueStats {
            rejections: vec![r("read_only", 3), r("status_empty", 1)],
            errors: 1,
            ..Default::default()
        };
        let t = sum_queues(&[a, b]);
        assert_eq!(
            t.rejections,
            [r("read_only", 5), r("empty_range", 0), r("status_empty", 1)]
        );
        assert_eq!(t.errors, u64::MAX);
    }
}
