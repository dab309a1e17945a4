//! The I/O limits of [`ThrottleLimits`](blkplane_proto::v1::ThrottleLimits) by QEMU's names
//! (`iops_total_max` for `iops_total.max`): one list for blkplaned's state file and error
//! messages and for blkplanectl's flags and tables. The mapping itself lives with the
//! conversion to the throttle arithmetic (`blkplane_throttle::wire`), so that the frontend,
//! which does not link this crate, names fields the same way.

pub use blkplane_throttle::wire::{
    api_error, api_field, limit, limit_mut, named, set_limits, LIMIT_FIELDS,
};
