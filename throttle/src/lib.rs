//! QEMU-compatible I/O throttling arithmetic for blkplane's frontends.
//!
//! - [`config`]: [`ThrottleLimits`], QEMU's six buckets (`bps_total`, `bps_read`, `bps_write`,
//!   `iops_total`, `iops_read`, `iops_write`, each with `avg`, `max`, `max_length`) and
//!   `iops_size`, validated with QEMU's rules; every error names its field.
//! - [`bucket`]: the leaky buckets of QEMU's `util/throttle.c`, stored as theoretical arrival
//!   times in a `#[repr(C)]` block of atomics ([`SharedBuckets`]) that the processes of a
//!   throttle group can share in memory, and a per-process view ([`Throttle`]) that admits or
//!   delays a request.
//! - [`group`]: a throttle group's shared file: the buckets and the round robin between the
//!   members with waiting requests.
//!
//! The crate computes only: it reads no clock and sleeps nowhere. The caller passes
//! `CLOCK_MONOTONIC` in nanoseconds, and on [`Admission::Wait`] arms its own timer.
//!
//! ```
//! use blkplane_throttle::{Admission, BucketLimit, Direction, SharedBuckets, Throttle, ThrottleLimits};
//!
//! let limits = ThrottleLimits { iops_total: BucketLimit::avg(100), ..Default::default() };
//! let shared = SharedBuckets::new();
//! let throttle = Throttle::new(limits, &shared).unwrap();
//! // QEMU lets 100 ms of I/O (10 operations) through at once, and accounts the 11th in full.
//! for _ in 0..11 {
//!     assert_eq!(throttle.try_admit(Direction::Read, 4096, 0), Admission::Go);
//! }
//! assert_eq!(throttle.try_admit(Direction::Read, 4096, 0), Admission::Wait(10_000_000));
//! ```

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod bucket;
pub mod config;
pub mod group;
#[cfg(feature = "wire")]
pub mod wire;

pub use bucket::{Admission, Direction, Operation, SharedBuckets, Throttle};
pub use config::{BucketKind, BucketLimit, LimitsError, ThrottleLimits, MAX_LENGTH_MAX, VALUE_MAX};
pub use group::{GroupState, GROUP_STATE_LEN, MAX_GROUP_MEMBERS};
