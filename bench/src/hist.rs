//! A fixed log-linear latency histogram: recording is an index computation and one increment,
//! so the client can time every request without allocating.
//!
//! Values (nanoseconds) below 128 have a bucket each; above that every power of two is split
//! into 64 equal buckets, so a bucket is at most 1/64 of its lower bound wide and a reported
//! percentile (the bucket's midpoint) is within 0.8 % of the true value. The largest bucket
//! starts at 2^46 ns (about 19 hours); anything longer is counted there.

/// Linear buckets per power of two, as a bit count.
const SUB_BITS: u32 = 6;
/// Linear buckets per power of two.
const SUB: u64 = 1 << SUB_BITS;
/// Values below this have a bucket of their own.
const EXACT: u64 = 2 * SUB;
/// The largest bucket width, as a shift.
const MAX_SHIFT: u32 = 40;
/// Number of buckets.
pub const BUCKETS: usize = ((MAX_SHIFT as u64 + 2) * SUB) as usize;

/// Counts of latencies in nanoseconds.
#[derive(Clone)]
pub struct Histogram {
    counts: Box<[u64]>,
    total: u64,
}

impl Default for Histogram {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for Histogram {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Histogram")
            .field("total", &self.total)
            .finish_non_exhaustive()
    }
}

/// The bucket holding `value`.
fn index(value: u64) -> usize {
    if value < EXACT {
        return value as usize;
    }
    let msb = 63 - value.leading_zeros();
    // `value >> shift` keeps the top SUB_BITS + 1 bits: 64..128.
    let shift = msb - SUB_BITS;
    if shift > MAX_SHIFT {
        return BUCKETS - 1;
    }
    (u64::from(shift) * SUB + (value >> shift)) as usize
}

/// The smallest value of bucket `index` and the bucket's width.
fn bounds(index: usize) -> (u64, u64) {
    let index = index as u64;
    if index < EXACT {
        return (index, 1);
    }
    let shift = index / SUB - 1;
    let mantissa = index - shift * SUB;
    (mantissa << shift, 1 << shift)
}

impl Histogram {
    /// An empty histogram (one allocation of [`BUCKETS`] counters).
    pub fn new() -> Self {
        Self {
            counts: vec![0; BUCKETS].into_boxed_slice(),
            total: 0,
        }
    }

    /// Counts one latency.
    #[inline]
    pub fn record(&mut self, nanos: u64) {
        // `index` never exceeds BUCKETS - 1.
        if let Some(count) = self.counts.get_mut(index(nanos)) {
            *count += 1;
            self.total += 1;
        }
    }

    /// Adds every count of `other`.
    pub fn merge(&mut self, other: &Histogram) {
        for (mine, theirs) in self.counts.iter_mut().zip(other.counts.iter()) {
            *mine += theirs;
        }
        self.total += other.total;
    }

    /// How many latencies were recorded.
    pub fn count(&self) -> u64 {
        self.total
    }

    /// The latency (ns) at or below which a fraction `quantile` (0..=1) of the recorded ones
    /// lie, as the midpoint of its bucket; `None` when nothing was recorded.
    pub fn quantile(&self, quantile: f64) -> Option<f64> {
        if self.total == 0 {
            return None;
        }
        // The rank of the wanted sample, 1-based: ceil(q × n), at least 1.
        let rank = ((quantile.clamp(0.0, 1.0) * self.total as f64).ceil() as u64).max(1);
        let mut seen = 0;
        for (index, &count) in self.counts.iter().enumerate() {
            seen += count;
            if seen >= rank {
                let (low, width) = bounds(index);
                return Some(low as f64 + (width - 1) as f64 / 2.0);
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_contiguous_and_tight() {
        let mut previous_end = 0;
        for index in 0..BUCKETS {
            let (low, width) = bounds(index);
            assert_eq!(
                low, previous_end,
                "bucket {index} starts where the last ended"
            );
            assert_eq!(self::index(low), index);
            assert_eq!(self::index(low + width - 1), index);
            assert!(
                width == 1 || width * SUB <= low,
                "bucket {index} is too wide"
            );
            previous_end = low + width;
        }
        assert_eq!(index(u64::MAX), BUCKETS - 1);
    }

    #[test]
    fn quantiles_are_within_a_bucket() {
        let mut h = Histogram::new();
        assert_eq!(h.quantile(0.5), None);
        // 1..=100_000 ns, uniformly: the p-quantile is p × 100_000.
        for ns in 1..=100_000u64 {
            h.record(ns);
        }
        assert_eq!(h.count(), 100_000);
        for (q, want) in [(0.5, 50_000.0), (0.99, 99_000.0), (0.999, 99_900.0)] {
            let got = h.quantile(q).unwrap();
            assert!(
                (got - want).abs() / want < 0.01,
                "q{q}: {got} instead of {want}"
            );
        }
        assert_eq!(h.quantile(0.0), Some(1.0));
        let mut other = Histogram::new();
        other.record(5);
        h.merge(&other);
        assert_eq!(h.count(), 100_001);
    }

    #[test]
    fn small_values_are_exact() {
        let mut h = Histogram::new();
        for ns in [3, 3, 3, 100] {
            h.record(ns);
        }
        assert_eq!(h.quantile(0.5), Some(3.0));
        assert_eq!(h.quantile(1.0), Some(100.0));
    }
}
