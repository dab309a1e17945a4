//! The fields of [`ThrottleLimits`] by QEMU's names (`iops_total_max`): one list for
//! blkplaned's state file and error messages and for blkplanectl's flags and tables.

use blkplane_proto::v1::ThrottleLimits;

/// The names of [`ThrottleLimits`]' fields (QEMU's, with underscores), and field access by
/// name: one list for the state file, the API's error messages and blkplanectl.
macro_rules! limit_fields {
    ($($field:ident),* $(,)?) => {
        /// Every field of [`ThrottleLimits`], in the order of the .proto, by QEMU's names.
        pub const LIMIT_FIELDS: [&str; 19] = [$(stringify!($field)),*];

        /// The API's name of each field of [`LIMIT_FIELDS`] (`limits.NAME`), for messages
        /// that name the field of a request.
        const API_FIELDS: [&str; 19] = [$(concat!("limits.", stringify!($field))),*];

        /// The value of the field called `name`; `None` for an unknown name.
        pub fn limit(limits: &ThrottleLimits, name: &str) -> Option<u64> {
            match name {
                $(stringify!($field) => Some(limits.$field),)*
                _ => None,
            }
        }

        /// The field called `name`; `None` for an unknown name.
        pub fn limit_mut<'a>(limits: &'a mut ThrottleLimits, name: &str) -> Option<&'a mut u64> {
            match name {
                $(stringify!($field) => Some(&mut limits.$field),)*
                _ => None,
            }
        }
    };
}

limit_fields!(
    bps_total,
    bps_total_max,
    bps_total_max_length,
    bps_read,
    bps_read_max,
    bps_read_max_length,
    bps_write,
    bps_write_max,
    bps_write_max_length,
    iops_total,
    iops_total_max,
    iops_total_max_length,
    iops_read,
    iops_read_max,
    iops_read_max_length,
    iops_write,
    iops_write_max,
    iops_write_max_length,
    iops_size,
);

/// The request field of the limit called `name` (`limits.iops_total_max`); `limits` for a name
/// that is not one (which the throttle crate never reports).
pub fn api_field(name: &str) -> &'static str {
    LIMIT_FIELDS
        .iter()
        .position(|f| *f == name)
        .and_then(|i| API_FIELDS.get(i).copied())
        .unwrap_or("limits")
}

/// The fields that are not zero, in .proto order, with their values.
pub fn set_limits(limits: &ThrottleLimits) -> Vec<(&'static str, u64)> {
    LIMIT_FIELDS
        .iter()
        .filter_map(|name| limit(limits, name).filter(|v| *v != 0).map(|v| (*name, v)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_reaches_its_own_field() {
        let mut l = ThrottleLimits::default();
        for (i, name) in LIMIT_FIELDS.iter().enumerate() {
            *limit_mut(&mut l, name).unwrap() = i as u64 + 1;
        }
        assert_eq!(
            (l.bps_total, l.bps_read_max_length, l.iops_write_max),
            (1, 6, 17)
        );
        assert_eq!(limit(&l, "iops_read_max"), Some(14));
        assert_eq!(limit(&l, "nope"), None);
        assert_eq!(api_field("iops_total_max"), "limits.iops_total_max");
        assert_eq!(api_field("iops_size"), "limits.iops_size");
        assert_eq!(api_field("x"), "limits");
        let only = ThrottleLimits {
            iops_total: 5,
            ..Default::default()
        };
        assert_eq!(set_limits(&only), [("iops_total", 5)]);
    }
}
