//! The wire's `ThrottleLimits` (proto/blkplane/v1/frontend.proto, also used by the gRPC API)
//! and this crate's limits are the same eighteen numbers and `iops_size`: one conversion each
//! way, so blkplaned and the frontend validate exactly the same thing. Behind the `wire`
//! feature, so that blkplane-proto holds wire formats only and the arithmetic needs no
//! protobuf.

use blkplane_proto::v1;

use crate::{BucketLimit, ThrottleLimits};

fn bucket(avg: u64, max: u64, max_length: u64) -> BucketLimit {
    BucketLimit {
        avg,
        max,
        max_length,
    }
}

impl From<&v1::ThrottleLimits> for ThrottleLimits {
    fn from(l: &v1::ThrottleLimits) -> Self {
        ThrottleLimits {
            bps_total: bucket(l.bps_total, l.bps_total_max, l.bps_total_max_length),
            bps_read: bucket(l.bps_read, l.bps_read_max, l.bps_read_max_length),
            bps_write: bucket(l.bps_write, l.bps_write_max, l.bps_write_max_length),
            iops_total: bucket(l.iops_total, l.iops_total_max, l.iops_total_max_length),
            iops_read: bucket(l.iops_read, l.iops_read_max, l.iops_read_max_length),
            iops_write: bucket(l.iops_write, l.iops_write_max, l.iops_write_max_length),
            iops_size: l.iops_size,
        }
    }
}

impl From<&ThrottleLimits> for v1::ThrottleLimits {
    fn from(l: &ThrottleLimits) -> Self {
        v1::ThrottleLimits {
            bps_total: l.bps_total.avg,
            bps_total_max: l.bps_total.max,
            bps_total_max_length: l.bps_total.max_length,
            bps_read: l.bps_read.avg,
            bps_read_max: l.bps_read.max,
            bps_read_max_length: l.bps_read.max_length,
            bps_write: l.bps_write.avg,
            bps_write_max: l.bps_write.max,
            bps_write_max_length: l.bps_write.max_length,
            iops_total: l.iops_total.avg,
            iops_total_max: l.iops_total.max,
            iops_total_max_length: l.iops_total.max_length,
            iops_read: l.iops_read.avg,
            iops_read_max: l.iops_read.max,
            iops_read_max_length: l.iops_read.max_length,
            iops_write: l.iops_write.avg,
            iops_write_max: l.iops_write.max,
            iops_write_max_length: l.iops_write.max_length,
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
        let wire = v1::ThrottleLimits {
            bps_total: 1,
            bps_total_max: 2,
            bps_total_max_length: 3,
            bps_read: 4,
            bps_read_max: 5,
            bps_read_max_length: 6,
            bps_write: 7,
            bps_write_max: 8,
            bps_write_max_length: 9,
            iops_total: 10,
            iops_total_max: 11,
            iops_total_max_length: 12,
            iops_read: 13,
            iops_read_max: 14,
            iops_read_max_length: 15,
            iops_write: 16,
            iops_write_max: 17,
            iops_write_max_length: 18,
            iops_size: 19,
        };
        let limits = ThrottleLimits::from(&wire);
        assert_eq!(limits.iops_read, bucket(13, 14, 15));
        assert_eq!(limits.bps_write, bucket(7, 8, 9));
        assert_eq!(v1::ThrottleLimits::from(&limits), wire);
    }
}
