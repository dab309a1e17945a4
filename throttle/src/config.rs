//! Throttling limits with QEMU's names, defaults and validation rules.
//!
//! The fields mirror QEMU's `ThrottleLimits` (QAPI): six buckets (bps and iops, each total,
//! read and write), each with an average rate, an optional burst rate and a burst length, plus
//! `iops_size`. [`ThrottleLimits::validate`] applies the rules of QEMU's
//! `throttle_limits_to_config` and `throttle_is_valid`, in the same order, and every error
//! names the offending field in QEMU's option spelling with underscores (`iops_total_max`,
//! `bps_read_max_length`), so that an API layer can point at the field to fix.

use thiserror::Error;

/// Largest rate or burst rate, and largest `max × max_length` (QEMU's `THROTTLE_VALUE_MAX`).
pub const VALUE_MAX: u64 = 1_000_000_000_000_000;

/// Largest `max_length` (seconds): QEMU keeps the burst length in an `unsigned int` and rejects
/// anything above `UINT_MAX`.
pub const MAX_LENGTH_MAX: u64 = u32::MAX as u64;

/// One of QEMU's six buckets. The discriminants are QEMU's `BucketType` order, which is also
/// the order in which [`ThrottleLimits::validate`] checks the buckets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BucketKind {
    /// Bytes per second, reads and writes together.
    BpsTotal = 0,
    /// Bytes per second of reads.
    BpsRead = 1,
    /// Bytes per second of writes.
    BpsWrite = 2,
    /// Operations per second, reads and writes together.
    IopsTotal = 3,
    /// Operations per second of reads.
    IopsRead = 4,
    /// Operations per second of writes.
    IopsWrite = 5,
}

impl BucketKind {
    /// All six buckets in QEMU's order.
    pub const ALL: [BucketKind; 6] = [
        BucketKind::BpsTotal,
        BucketKind::BpsRead,
        BucketKind::BpsWrite,
        BucketKind::IopsTotal,
        BucketKind::IopsRead,
        BucketKind::IopsWrite,
    ];

    /// The position of this bucket in [`BucketKind::ALL`] (and in the shared levels).
    pub const fn index(self) -> usize {
        self as usize
    }

    /// Whether the bucket counts bytes (bps) rather than operations (iops).
    pub const fn counts_bytes(self) -> bool {
        matches!(
            self,
            BucketKind::BpsTotal | BucketKind::BpsRead | BucketKind::BpsWrite
        )
    }

    /// The name of the average rate, e.g. `bps_total`.
    pub const fn avg_field(self) -> &'static str {
        match self {
            BucketKind::BpsTotal => "bps_total",
            BucketKind::BpsRead => "bps_read",
            BucketKind::BpsWrite => "bps_write",
            BucketKind::IopsTotal => "iops_total",
            BucketKind::IopsRead => "iops_read",
            BucketKind::IopsWrite => "iops_write",
        }
    }

    /// The name of the burst rate, e.g. `bps_total_max`.
    pub const fn max_field(self) -> &'static str {
        match self {
            BucketKind::BpsTotal => "bps_total_max",
            BucketKind::BpsRead => "bps_read_max",
            BucketKind::BpsWrite => "bps_write_max",
            BucketKind::IopsTotal => "iops_total_max",
            BucketKind::IopsRead => "iops_read_max",
            BucketKind::IopsWrite => "iops_write_max",
        }
    }

    /// The name of the burst length, e.g. `bps_total_max_length`.
    pub const fn max_length_field(self) -> &'static str {
        match self {
            BucketKind::BpsTotal => "bps_total_max_length",
            BucketKind::BpsRead => "bps_read_max_length",
            BucketKind::BpsWrite => "bps_write_max_length",
            BucketKind::IopsTotal => "iops_total_max_length",
            BucketKind::IopsRead => "iops_read_max_length",
            BucketKind::IopsWrite => "iops_write_max_length",
        }
    }
}

/// The limits of one bucket. All zero (the default) means unlimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BucketLimit {
    /// Average rate in units (bytes or operations) per second; 0 = unlimited.
    pub avg: u64,
    /// Burst rate in units per second; 0 = no configured burst (QEMU then still lets a guest
    /// run `avg / 10` units ahead, see the `bucket` module).
    pub max: u64,
    /// How long, in seconds, the guest may run at `max` (QEMU's `burst_length`, option
    /// `*-max-length`). 0 means "not set" and is read as QEMU's default, 1 second.
    pub max_length: u64,
}

impl BucketLimit {
    /// A limit of `avg` units per second without a configured burst.
    pub const fn avg(avg: u64) -> Self {
        BucketLimit {
            avg,
            max: 0,
            max_length: 0,
        }
    }

    /// A limit of `avg` units per second with bursts at `max` for `max_length` seconds.
    pub const fn with_burst(avg: u64, max: u64, max_length: u64) -> Self {
        BucketLimit {
            avg,
            max,
            max_length,
        }
    }

    /// The burst length QEMU would use: `max_length`, or 1 when it is 0 (not set).
    pub const fn burst_length(&self) -> u64 {
        if self.max_length == 0 {
            1
        } else {
            self.max_length
        }
    }

    /// Whether the bucket limits anything (QEMU ignores a bucket whose `avg` is 0).
    pub const fn is_limited(&self) -> bool {
        self.avg != 0
    }
}

/// QEMU's I/O limits of a disk or of a throttle group. The default is unlimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ThrottleLimits {
    /// Bytes per second, reads and writes together.
    pub bps_total: BucketLimit,
    /// Bytes per second of reads.
    pub bps_read: BucketLimit,
    /// Bytes per second of writes.
    pub bps_write: BucketLimit,
    /// Operations per second, reads and writes together.
    pub iops_total: BucketLimit,
    /// Operations per second of reads.
    pub iops_read: BucketLimit,
    /// Operations per second of writes.
    pub iops_write: BucketLimit,
    /// Size in bytes of one operation for the iops buckets; 0 = every request counts as one.
    /// A larger request counts `bytes / iops_size` operations (fractions included).
    pub iops_size: u64,
}

impl ThrottleLimits {
    /// The limits of one bucket.
    pub const fn bucket(&self, kind: BucketKind) -> &BucketLimit {
        match kind {
            BucketKind::BpsTotal => &self.bps_total,
            BucketKind::BpsRead => &self.bps_read,
            BucketKind::BpsWrite => &self.bps_write,
            BucketKind::IopsTotal => &self.iops_total,
            BucketKind::IopsRead => &self.iops_read,
            BucketKind::IopsWrite => &self.iops_write,
        }
    }

    /// Whether nothing is limited (QEMU's `!throttle_enabled`): every `avg` is 0. A `max`
    /// without its `avg` does not count; [`validate`](Self::validate) rejects it anyway.
    pub fn is_unlimited(&self) -> bool {
        BucketKind::ALL
            .iter()
            .all(|&kind| !self.bucket(kind).is_limited())
    }

    /// Checks the limits with QEMU's rules, in QEMU's order, and returns the first broken one.
    pub fn validate(&self) -> Result<(), LimitsError> {
        // throttle_limits_to_config: the burst length must fit QEMU's unsigned int.
        for kind in BucketKind::ALL {
            let bucket = self.bucket(kind);
            if bucket.max_length > MAX_LENGTH_MAX {
                return Err(LimitsError::MaxLengthOutOfRange {
                    field: kind.max_length_field(),
                    value: bucket.max_length,
                });
            }
        }

        // throttle_is_valid: a total limit excludes read/write limits of the same kind, first
        // for the averages (bps, then iops), then for the burst rates.
        let pairs = [
            (
                BucketKind::BpsTotal,
                BucketKind::BpsRead,
                BucketKind::BpsWrite,
            ),
            (
                BucketKind::IopsTotal,
                BucketKind::IopsRead,
                BucketKind::IopsWrite,
            ),
        ];
        for burst in [false, true] {
            let value = |kind| {
                let bucket = self.bucket(kind);
                if burst {
                    bucket.max
                } else {
                    bucket.avg
                }
            };
            let name = |kind: BucketKind| {
                if burst {
                    kind.max_field()
                } else {
                    kind.avg_field()
                }
            };
            for (total, read, write) in pairs {
                if value(total) == 0 {
                    continue;
                }
                for split in [read, write] {
                    if value(split) != 0 {
                        return Err(LimitsError::TotalConflict {
                            total: name(total),
                            split: name(split),
                        });
                    }
                }
            }
        }

        if self.iops_size != 0
            && !self.iops_total.is_limited()
            && !self.iops_read.is_limited()
            && !self.iops_write.is_limited()
        {
            return Err(LimitsError::IopsSizeWithoutIops);
        }

        for kind in BucketKind::ALL {
            let bucket = self.bucket(kind);
            if bucket.avg > VALUE_MAX {
                return Err(LimitsError::ValueTooLarge {
                    field: kind.avg_field(),
                    value: bucket.avg,
                });
            }
            if bucket.max > VALUE_MAX {
                return Err(LimitsError::ValueTooLarge {
                    field: kind.max_field(),
                    value: bucket.max,
                });
            }
            // QEMU rejects a burst length of 0; here 0 means "not set" and reads as 1, so that
            // rule cannot trigger.
            let length = bucket.burst_length();
            if length > 1 && bucket.max == 0 {
                return Err(LimitsError::MaxLengthWithoutMax {
                    field: kind.max_length_field(),
                    max_field: kind.max_field(),
                });
            }
            // Keeps the bucket size max × length within VALUE_MAX (QEMU's integer division).
            if bucket.max != 0 && length > VALUE_MAX / bucket.max {
                return Err(LimitsError::MaxLengthTooLong {
                    field: kind.max_length_field(),
                    max_field: kind.max_field(),
                });
            }
            if bucket.max != 0 && bucket.avg == 0 {
                return Err(LimitsError::MaxWithoutAvg {
                    field: kind.max_field(),
                    avg_field: kind.avg_field(),
                });
            }
            if bucket.max != 0 && bucket.max < bucket.avg {
                return Err(LimitsError::MaxBelowAvg {
                    field: kind.max_field(),
                    avg_field: kind.avg_field(),
                    max: bucket.max,
                    avg: bucket.avg,
                });
            }
        }
        Ok(())
    }
}

/// A broken rule of [`ThrottleLimits::validate`]. One variant per QEMU rule; every message
/// starts with the offending field's name, which [`LimitsError::field`] also returns.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum LimitsError {
    /// A burst length above QEMU's `UINT_MAX`.
    #[error("{field}: must be in the range [0, {MAX_LENGTH_MAX}], got {value}")]
    MaxLengthOutOfRange {
        /// The `*_max_length` field.
        field: &'static str,
        /// Its value.
        value: u64,
    },
    /// A total limit together with a read or write limit of the same kind (bps or iops, and
    /// average or burst rate).
    #[error("{split}: cannot be used together with {total}")]
    TotalConflict {
        /// The total field, e.g. `bps_total` or `iops_total_max`.
        total: &'static str,
        /// The read or write field set with it, e.g. `bps_read`; the one reported as wrong.
        split: &'static str,
    },
    /// `iops_size` without any iops limit.
    #[error("iops_size: requires iops_total, iops_read or iops_write to be set")]
    IopsSizeWithoutIops,
    /// A rate or burst rate above [`VALUE_MAX`].
    #[error("{field}: must be within [0, {VALUE_MAX}], got {value}")]
    ValueTooLarge {
        /// The rate field.
        field: &'static str,
        /// Its value.
        value: u64,
    },
    /// A burst length above 1 without a burst rate.
    #[error("{field}: a burst length requires {max_field} to be set")]
    MaxLengthWithoutMax {
        /// The `*_max_length` field.
        field: &'static str,
        /// The burst rate that is missing.
        max_field: &'static str,
    },
    /// `max × max_length` above [`VALUE_MAX`].
    #[error(
        "{field}: too high for this burst rate ({max_field} × {field} must not exceed {VALUE_MAX})"
    )]
    MaxLengthTooLong {
        /// The `*_max_length` field.
        field: &'static str,
        /// The burst rate it multiplies.
        max_field: &'static str,
    },
    /// A burst rate without the average rate of the same bucket.
    #[error("{field}: requires {avg_field} to be set")]
    MaxWithoutAvg {
        /// The `*_max` field.
        field: &'static str,
        /// The average rate that is missing.
        avg_field: &'static str,
    },
    /// A burst rate below the average rate.
    #[error("{field}: {max} cannot be lower than {avg_field} ({avg})")]
    MaxBelowAvg {
        /// The `*_max` field.
        field: &'static str,
        /// The average rate it is compared with.
        avg_field: &'static str,
        /// The burst rate.
        max: u64,
        /// The average rate.
        avg: u64,
    },
}

impl LimitsError {
    /// The field to blame, in QEMU's option spelling with underscores.
    pub fn field(&self) -> &'static str {
        match self {
            LimitsError::MaxLengthOutOfRange { field, .. }
            | LimitsError::ValueTooLarge { field, .. }
            | LimitsError::MaxLengthWithoutMax { field, .. }
            | LimitsError::MaxLengthTooLong { field, .. }
            | LimitsError::MaxWithoutAvg { field, .. }
            | LimitsError::MaxBelowAvg { field, .. } => field,
            LimitsError::TotalConflict { split, .. } => split,
            LimitsError::IopsSizeWithoutIops => "iops_size",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(limits: ThrottleLimits) -> LimitsError {
        match limits.validate() {
            Err(e) => e,
            Ok(()) => panic!("{limits:?} was accepted"),
        }
    }

    /// Checks the variant, the field `field()` blames and that the message starts with it.
    fn assert_rule(limits: ThrottleLimits, expected: LimitsError) {
        let e = err(limits);
        assert_eq!(e, expected);
        assert!(
            e.to_string().starts_with(&format!("{}: ", e.field())),
            "{e}"
        );
    }

    #[test]
    fn default_is_valid_and_unlimited() {
        let limits = ThrottleLimits::default();
        assert_eq!(limits.validate(), Ok(()));
        assert!(limits.is_unlimited());
        let limits = ThrottleLimits {
            iops_read: BucketLimit::avg(1),
            ..Default::default()
        };
        assert!(!limits.is_unlimited());
    }

    #[test]
    fn valid_examples() {
        let cases = [
            // Separate bps and iops kinds may mix total and read/write.
            ThrottleLimits {
                bps_total: BucketLimit::avg(1 << 20),
                iops_read: BucketLimit::avg(100),
                iops_write: BucketLimit::with_burst(100, 2000, 60),
                iops_size: 4096,
                ..Default::default()
            },
            // max_length 0 (not set) and 1 are both QEMU's default of 1 second.
            ThrottleLimits {
                iops_total: BucketLimit::with_burst(100, 200, 0),
                bps_read: BucketLimit::with_burst(100, 200, 1),
                ..Default::default()
            },
            // max_length 1 without max is the default, not an error.
            ThrottleLimits {
                iops_total: BucketLimit::with_burst(100, 0, 1),
                ..Default::default()
            },
            // max == avg is allowed; the boundaries themselves are valid.
            ThrottleLimits {
                bps_total: BucketLimit::with_burst(VALUE_MAX, VALUE_MAX, 1),
                iops_total: BucketLimit::with_burst(1, 1, MAX_LENGTH_MAX),
                ..Default::default()
            },
            // max × length exactly VALUE_MAX.
            ThrottleLimits {
                bps_write: BucketLimit::with_burst(1_000_000, 1_000_000, 1_000_000_000),
                ..Default::default()
            },
        ];
        for limits in cases {
            assert_eq!(limits.validate(), Ok(()), "{limits:?}");
        }
    }

    #[test]
    fn total_conflicts_name_both_fields() {
        assert_rule(
            ThrottleLimits {
                bps_total: BucketLimit::avg(10),
                bps_read: BucketLimit::avg(10),
                ..Default::default()
            },
            LimitsError::TotalConflict {
                total: "bps_total",
                split: "bps_read",
            },
        );
        assert_rule(
            ThrottleLimits {
                iops_total: BucketLimit::avg(10),
                iops_write: BucketLimit::avg(10),
                ..Default::default()
            },
            LimitsError::TotalConflict {
                total: "iops_total",
                split: "iops_write",
            },
        );
        // Burst rates conflict on their own (QEMU's bps_max_flag), checked after the averages.
        assert_rule(
            ThrottleLimits {
                bps_total: BucketLimit::with_burst(0, 100, 0),
                bps_write: BucketLimit::with_burst(0, 100, 0),
                ..Default::default()
            },
            LimitsError::TotalConflict {
                total: "bps_total_max",
                split: "bps_write_max",
            },
        );
        assert_rule(
            ThrottleLimits {
                iops_total: BucketLimit::with_burst(0, 100, 0),
                iops_read: BucketLimit::with_burst(0, 100, 0),
                ..Default::default()
            },
            LimitsError::TotalConflict {
                total: "iops_total_max",
                split: "iops_read_max",
            },
        );
    }

    #[test]
    fn iops_size_needs_an_iops_limit() {
        assert_rule(
            ThrottleLimits {
                bps_total: BucketLimit::avg(10),
                iops_size: 4096,
                ..Default::default()
            },
            LimitsError::IopsSizeWithoutIops,
        );
        assert_eq!(
            err(ThrottleLimits {
                iops_size: 1,
                ..Default::default()
            })
            .field(),
            "iops_size"
        );
        // Any u64 is accepted once an iops limit exists: QEMU has no other iops-size rule.
        let limits = ThrottleLimits {
            iops_write: BucketLimit::avg(10),
            iops_size: u64::MAX,
            ..Default::default()
        };
        assert_eq!(limits.validate(), Ok(()));
    }

    #[test]
    fn values_above_value_max() {
        assert_rule(
            ThrottleLimits {
                bps_read: BucketLimit::avg(VALUE_MAX + 1),
                ..Default::default()
            },
            LimitsError::ValueTooLarge {
                field: "bps_read",
                value: VALUE_MAX + 1,
            },
        );
        assert_rule(
            ThrottleLimits {
                iops_write: BucketLimit::with_burst(1, u64::MAX, 0),
                ..Default::default()
            },
            LimitsError::ValueTooLarge {
                field: "iops_write_max",
                value: u64::MAX,
            },
        );
    }

    #[test]
    fn max_length_rules() {
        assert_rule(
            ThrottleLimits {
                bps_write: BucketLimit::with_burst(10, 0, 2),
                ..Default::default()
            },
            LimitsError::MaxLengthWithoutMax {
                field: "bps_write_max_length",
                max_field: "bps_write_max",
            },
        );
        assert_rule(
            ThrottleLimits {
                iops_read: BucketLimit::with_burst(10, 20, MAX_LENGTH_MAX + 1),
                ..Default::default()
            },
            LimitsError::MaxLengthOutOfRange {
                field: "iops_read_max_length",
                value: MAX_LENGTH_MAX + 1,
            },
        );
        // 2 × 10^6 × (5 × 10^8 + 1) exceeds 10^15 by one second's worth of burst.
        assert_rule(
            ThrottleLimits {
                bps_read: BucketLimit::with_burst(1, 2_000_000, 500_000_001),
                ..Default::default()
            },
            LimitsError::MaxLengthTooLong {
                field: "bps_read_max_length",
                max_field: "bps_read_max",
            },
        );
        // The range check comes first (QEMU does it while parsing), even before conflicts.
        assert_rule(
            ThrottleLimits {
                bps_total: BucketLimit::avg(1),
                bps_read: BucketLimit::avg(1),
                iops_total: BucketLimit::with_burst(0, 0, u64::MAX),
                ..Default::default()
            },
            LimitsError::MaxLengthOutOfRange {
                field: "iops_total_max_length",
                value: u64::MAX,
            },
        );
    }

    #[test]
    fn max_rules() {
        assert_rule(
            ThrottleLimits {
                iops_total: BucketLimit::with_burst(0, 100, 0),
                ..Default::default()
            },
            LimitsError::MaxWithoutAvg {
                field: "iops_total_max",
                avg_field: "iops_total",
            },
        );
        assert_rule(
            ThrottleLimits {
                bps_total: BucketLimit::with_burst(100, 99, 0),
                ..Default::default()
            },
            LimitsError::MaxBelowAvg {
                field: "bps_total_max",
                avg_field: "bps_total",
                max: 99,
                avg: 100,
            },
        );
    }

    #[test]
    fn burst_length_default() {
        assert_eq!(BucketLimit::with_burst(1, 2, 0).burst_length(), 1);
        assert_eq!(BucketLimit::with_burst(1, 2, 1).burst_length(), 1);
        assert_eq!(BucketLimit::with_burst(1, 2, 7).burst_length(), 7);
    }
}
