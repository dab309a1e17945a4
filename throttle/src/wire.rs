//! The wire's `ThrottleLimits` (proto/blkplane/v1/frontend.proto, also used by the gRPC API):
//! six `ThrottleBucket`s and `iops_size`, the same numbers as this crate's [`ThrottleLimits`],
//! so one conversion each way lets blkplaned and the frontend validate exactly the same thing;
//! and the numbers by QEMU's flat names (`iops_total_max` is `iops_total.max` on the wire), which
//! blkplaned's state file, blkplanectl's flags and every error message use. Behind the `wire`
//! feature, so that blkplane-proto holds wire formats only and the arithmetic needs no
//! protobuf.

use blkplane_proto::v1;

use crate::{BucketKind, BucketLimit, LimitsError, ThrottleLimits};

/// QEMU's name of the one limit that is not part of a bucket.
const IOPS_SIZE: &str = "iops_size";

/// Which of a bucket's three numbers a flat name means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Part {
    Avg,
    Max,
    MaxLength,
}

macro_rules! wire_buckets {
    ($(($kind:ident, $field:ident)),* $(,)?) => {
        /// The wire's bucket of `kind`, if it is present.
        fn bucket(limits: &v1::ThrottleLimits, kind: BucketKind) -> Option<&v1::ThrottleBucket> {
            match kind {
                $(BucketKind::$kind => limits.$field.as_ref(),)*
            }
        }

        /// The wire's bucket of `kind`, added (all zero) if it is absent.
        fn bucket_mut(limits: &mut v1::ThrottleLimits, kind: BucketKind) -> &mut v1::ThrottleBucket {
            match kind {
                $(BucketKind::$kind => limits.$field.get_or_insert_with(Default::default),)*
            }
        }

        /// The request field of each number of each bucket, in [`BucketKind::ALL`]'s order.
        const API_FIELDS: [[&str; 3]; 6] = [$([
            concat!("limits.", stringify!($field), ".avg"),
            concat!("limits.", stringify!($field), ".max"),
            concat!("limits.", stringify!($field), ".max_length"),
        ]),*];
    };
}

wire_buckets!(
    (BpsTotal, bps_total),
    (BpsRead, bps_read),
    (BpsWrite, bps_write),
    (IopsTotal, iops_total),
    (IopsRead, iops_read),
    (IopsWrite, iops_write),
);

/// Every limit by QEMU's name, bucket by bucket in the .proto's order (`bps_total`,
/// `bps_total_max`, `bps_total_max_length`, `bps_read`, …), `iops_size` last.
pub const LIMIT_FIELDS: [&str; 19] = {
    let mut names = [IOPS_SIZE; 19];
    let mut i = 0;
    while i < BucketKind::ALL.len() {
        let kind = BucketKind::ALL[i];
        names[3 * i] = kind.avg_field();
        names[3 * i + 1] = kind.max_field();
        names[3 * i + 2] = kind.max_length_field();
        i += 1;
    }
    names
};

/// The bucket and number a flat name means; `None` for `iops_size` and unknown names.
fn parse(name: &str) -> Option<(BucketKind, Part)> {
    BucketKind::ALL.into_iter().find_map(|kind| {
        let part = if name == kind.avg_field() {
            Part::Avg
        } else if name == kind.max_field() {
            Part::Max
        } else if name == kind.max_length_field() {
            Part::MaxLength
        } else {
            return None;
        };
        Some((kind, part))
    })
}

fn number(bucket: &v1::ThrottleBucket, part: Part) -> u64 {
    match part {
        Part::Avg => bucket.avg,
        Part::Max => bucket.max,
        Part::MaxLength => bucket.max_length,
    }
}

/// The value of the limit called `name` (0 when its bucket is absent); `None` for an unknown
/// name.
pub fn limit(limits: &v1::ThrottleLimits, name: &str) -> Option<u64> {
    if name == IOPS_SIZE {
        return Some(limits.iops_size);
    }
    let (kind, part) = parse(name)?;
    Some(bucket(limits, kind).map_or(0, |b| number(b, part)))
}

/// The limit called `name`, its bucket added if it was absent; `None` for an unknown name.
pub fn limit_mut<'a>(limits: &'a mut v1::ThrottleLimits, name: &str) -> Option<&'a mut u64> {
    if name == IOPS_SIZE {
        return Some(&mut limits.iops_size);
    }
    let (kind, part) = parse(name)?;
    let bucket = bucket_mut(limits, kind);
    Some(match part {
        Part::Avg => &mut bucket.avg,
        Part::Max => &mut bucket.max,
        Part::MaxLength => &mut bucket.max_length,
    })
}

/// The limits that are not zero, in [`LIMIT_FIELDS`]' order, with their values.
pub fn set_limits(limits: &v1::ThrottleLimits) -> Vec<(&'static str, u64)> {
    LIMIT_FIELDS
        .iter()
        .filter_map(|name| limit(limits, name).filter(|v| *v != 0).map(|v| (*name, v)))
        .collect()
}

/// Limits given by QEMU's names (`[("iops_total", 500), ("iops_total_max", 1000)]`); `None`
/// if a name is not one of [`LIMIT_FIELDS`].
pub fn named(values: &[(&str, u64)]) -> Option<v1::ThrottleLimits> {
    let mut limits = v1::ThrottleLimits::default();
    for (name, value) in values {
        *limit_mut(&mut limits, name)? = *value;
    }
    Some(limits)
}

/// The request field (of a message that carries the limits as `limits`) of the limit QEMU
/// calls `name`: `limits.iops_total.max` for `iops_total_max`; `limits` for an unknown name
/// (which this crate never reports).
pub fn api_field(name: &str) -> &'static str {
    if name == IOPS_SIZE {
        return "limits.iops_size";
    }
    let Some((kind, part)) = parse(name) else {
        return "limits";
    };
    let numbers = API_FIELDS.get(kind.index()).copied().unwrap_or_default();
    let index = match part {
        Part::Avg => 0,
        Part::Max => 1,
        Part::MaxLength => 2,
    };
    numbers.get(index).copied().unwrap_or("limits")
}

/// A broken rule as a request's field and the reason (`limits.iops_total.max`, `requires
/// iops_total to be set`): the reason keeps QEMU's names, as blkplanectl's flags do.
pub fn api_error(e: &LimitsError) -> (&'static str, String) {
    let text = e.to_string();
    let reason = text
        .strip_prefix(e.field())
        .and_then(|rest| rest.strip_prefix(": "))
        .unwrap_or(&text)
        .to_owned();
    (api_field(e.field()), reason)
}

fn from_wire(bucket: Option<&v1::ThrottleBucket>) -> BucketLimit {
    bucket.map_or_else(BucketLimit::default, |b| {
        BucketLimit::with_burst(b.avg, b.max, b.max_length)
    })
}

/// An all-zero bucket is left out, as it means the same.
fn to_wire(bucket: &BucketLimit) -> Option<v1::ThrottleBucket> {
    (*bucket != BucketLimit::default()).then_some(v1::ThrottleBucket {
        avg: bucket.avg,
        max: bucket.max,
        max_length: bucket.max_length,
    })
}

impl From<&v1::ThrottleLimits> for ThrottleLimits {
    fn from(l: &v1::ThrottleLimits) -> Self {
        let of = |kind| from_wire(bucket(l, kind));
        ThrottleLimits {
            bps_total: of(BucketKind::BpsTotal),
            bps_read: of(BucketKind::BpsRead),
            bps_write: of(BucketKind::BpsWrite),
            iops_total: of(BucketKind::IopsTotal),
            iops_read: of(BucketKind::IopsRead),
            iops_write: of(BucketKind::IopsWrite),
            iops_size: l.iops_size,
        }
    }
}

impl From<&ThrottleLimits> for v1::ThrottleLimits {
    fn from(l: &ThrottleLimits) -> Self {
        v1::ThrottleLimits {
            bps_total: to_wire(&l.bps_total),
            bps_read: to_wire(&l.bps_read),
            bps_write: to_wire(&l.bps_write),
            iops_total: to_wire(&l.iops_total),
            iops_read: to_wire(&l.iops_read),
            iops_write: to_wire(&l.iops_write),
            iops_size: l.iops_size,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_field_goes_both_ways() {
        // Distinct values, so that a field mapped to the wrong place shows.
        let mut wire = v1::ThrottleLimits::default();
        for (i, name) in LIMIT_FIELDS.iter().enumerate() {
            *limit_mut(&mut wire, name).unwrap() = i as u64 + 1;
        }
        let limits = ThrottleLimits::from(&wire);
        assert_eq!(limits.iops_read, BucketLimit::with_burst(13, 14, 15));
        assert_eq!(limits.bps_write, BucketLimit::with_burst(7, 8, 9));
        assert_eq!(limits.iops_size, 19);
        assert_eq!(v1::ThrottleLimits::from(&limits), wire);
    }

    #[test]
    fn every_name_reaches_its_own_number() {
        let mut l = v1::ThrottleLimits::default();
        for (i, name) in LIMIT_FIELDS.iter().enumerate() {
            *limit_mut(&mut l, name).unwrap() = i as u64 + 1;
        }
        let b = |b: &Option<v1::ThrottleBucket>| b.unwrap_or_default();
        assert_eq!(b(&l.bps_total).avg, 1);
        assert_eq!(b(&l.bps_read).max_length, 6);
        assert_eq!(b(&l.iops_write).max, 17);
        assert_eq!(limit(&l, "iops_read_max"), Some(14));
        assert_eq!(limit(&l, "nope"), None);
        assert!(limit_mut(&mut l, "iops_totl").is_none());
        assert_eq!(api_field("iops_total_max"), "limits.iops_total.max");
        assert_eq!(api_field("bps_read"), "limits.bps_read.avg");
        assert_eq!(
            api_field("iops_write_max_length"),
            "limits.iops_write.max_length"
        );
        assert_eq!(api_field("iops_size"), "limits.iops_size");
        assert_eq!(api_field("x"), "limits");
    }

    #[test]
    fn absent_and_zero_buckets_mean_no_limit() {
        let only = v1::ThrottleLimits {
            iops_total: Some(v1::ThrottleBucket {
                avg: 5,
                ..Default::default()
            }),
            bps_read: Some(v1::ThrottleBucket::default()),
            ..Default::default()
        };
        assert_eq!(set_limits(&only), [("iops_total", 5)]);
        assert_eq!(limit(&only, "bps_write_max"), Some(0));
        // Back from the crate's limits, the zero bucket is left out.
        let round = v1::ThrottleLimits::from(&ThrottleLimits::from(&only));
        assert!(round.bps_read.is_none() && round.iops_total.is_some());
    }

    #[test]
    fn errors_name_the_request_field() {
        let limits = ThrottleLimits {
            iops_total: BucketLimit::with_burst(0, 5, 0),
            ..Default::default()
        };
        let e = limits.validate().unwrap_err();
        assert_eq!(
            api_error(&e),
            (
                "limits.iops_total.max",
                "requires iops_total to be set".into()
            )
        );
    }
}
