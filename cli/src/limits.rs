//! blkplanectl's I/O limits: the `disk throttle` flags (one per limit, QEMU's names with
//! dashes), what they ask for, and how limits and throttle groups are printed.

use blkplane_proto::v1::ThrottleLimits;
use serde_json::{json, Map, Value};

use blkplane_api::limits::{limit, limit_mut, set_limits, LIMIT_FIELDS};
use blkplane_api::pb::{Disk, SetThrottleRequest, ThrottleConfig};

use crate::text::parse_size;

/// A limit's name as blkplanectl's option spells it (QEMU's, with dashes): `iops-total-max`.
pub fn limit_flag(name: &str) -> String {
    name.replace('_', "-")
}

/// The limits that are set, for people: `iops-total=500 bps-read=1048576`, or `none`.
pub fn limits_text(limits: &ThrottleLimits) -> String {
    let set = set_limits(limits);
    if set.is_empty() {
        return "none".into();
    }
    set.iter()
        .map(|(name, value)| format!("{}={value}", limit_flag(name)))
        .collect::<Vec<_>>()
        .join(" ")
}

/// A disk's group, its index and the members, for people.
pub fn group_text(t: &ThrottleConfig) -> String {
    format!(
        "{} (member index {}; members: {})",
        t.group,
        t.member_index,
        t.group_members.join(" ")
    )
}

/// All 19 limits as JSON, by the .proto's names (zeros included, so the keys are fixed).
pub fn limits_json(limits: &ThrottleLimits) -> Value {
    let mut map = Map::new();
    for name in LIMIT_FIELDS {
        let value = limit(limits, name).unwrap_or(0);
        map.insert(name.to_string(), json!(value));
    }
    Value::Object(map)
}

/// A disk's I/O limits and group as JSON.
pub fn throttle_json(t: &ThrottleConfig) -> Value {
    json!({
        "id": t.id,
        "limits": limits_json(&t.limits.unwrap_or_default()),
        "group": t.group,
        "group_members": t.group_members,
        "member_index": t.member_index,
        "pending": t.pending,
    })
}

/// `disk throttle ID` for people.
pub fn throttle_detail(t: &ThrottleConfig) -> String {
    let limits = t.limits.unwrap_or_default();
    let mut rows: Vec<(String, String)> = vec![("id".into(), t.id.clone())];
    rows.push((
        "group".into(),
        if t.group.is_empty() {
            "none".into()
        } else {
            group_text(t)
        },
    ));
    let set = set_limits(&limits);
    if set.is_empty() {
        rows.push(("limits".into(), "none (not throttled)".into()));
    }
    for (name, value) in set {
        rows.push((limit_flag(name), value.to_string()));
    }
    if !t.pending.is_empty() {
        rows.push((
            "pending".into(),
            format!(
                "{} (the frontend does not have these limits yet; blkplaned keeps sending them)",
                t.pending.join(" ")
            ),
        ));
    }
    let width = rows.iter().map(|(k, _)| k.len() + 1).max().unwrap_or(0);
    rows.iter()
        .map(|(k, v)| format!("{:<width$}  {v}\n", format!("{k}:")))
        .collect()
}

/// Parses a byte rate or size option: bytes, or with a binary unit (`100M`, `1GiB`).
fn parse_bytes(s: &str) -> Result<u64, String> {
    parse_size(s)
}

/// `blkplanectl disk throttle`'s options: one per QEMU limit, with QEMU's names (dashes for
/// underscores), and the group. Without any, the command shows the disk's limits.
#[derive(Debug, Clone, Default, PartialEq, Eq, clap::Args)]
#[command(group(clap::ArgGroup::new("settings").multiple(true)))]
pub struct ThrottleArgs {
    /// Bytes per second, reads and writes together (a unit is allowed: 100M).
    #[arg(long, value_name = "BYTES", value_parser = parse_bytes, group = "settings")]
    pub bps_total: Option<u64>,
    /// Burst rate of bps-total, in bytes per second.
    #[arg(long, value_name = "BYTES", value_parser = parse_bytes, group = "settings")]
    pub bps_total_max: Option<u64>,
    /// Seconds the bps-total burst may last [0: 1].
    #[arg(long, value_name = "SECS", group = "settings")]
    pub bps_total_max_length: Option<u64>,
    /// Bytes per second of reads (a unit is allowed: 100M).
    #[arg(long, value_name = "BYTES", value_parser = parse_bytes, group = "settings")]
    pub bps_read: Option<u64>,
    /// Burst rate of bps-read, in bytes per second.
    #[arg(long, value_name = "BYTES", value_parser = parse_bytes, group = "settings")]
    pub bps_read_max: Option<u64>,
    /// Seconds the bps-read burst may last [0: 1].
    #[arg(long, value_name = "SECS", group = "settings")]
    pub bps_read_max_length: Option<u64>,
    /// Bytes per second of writes (a unit is allowed: 100M).
    #[arg(long, value_name = "BYTES", value_parser = parse_bytes, group = "settings")]
    pub bps_write: Option<u64>,
    /// Burst rate of bps-write, in bytes per second.
    #[arg(long, value_name = "BYTES", value_parser = parse_bytes, group = "settings")]
    pub bps_write_max: Option<u64>,
    /// Seconds the bps-write burst may last [0: 1].
    #[arg(long, value_name = "SECS", group = "settings")]
    pub bps_write_max_length: Option<u64>,
    /// Operations per second, reads and writes together.
    #[arg(long, value_name = "N", group = "settings")]
    pub iops_total: Option<u64>,
    /// Burst rate of iops-total, in operations per second.
    #[arg(long, value_name = "N", group = "settings")]
    pub iops_total_max: Option<u64>,
    /// Seconds the iops-total burst may last [0: 1].
    #[arg(long, value_name = "SECS", group = "settings")]
    pub iops_total_max_length: Option<u64>,
    /// Operations per second of reads.
    #[arg(long, value_name = "N", group = "settings")]
    pub iops_read: Option<u64>,
    /// Burst rate of iops-read, in operations per second.
    #[arg(long, value_name = "N", group = "settings")]
    pub iops_read_max: Option<u64>,
    /// Seconds the iops-read burst may last [0: 1].
    #[arg(long, value_name = "SECS", group = "settings")]
    pub iops_read_max_length: Option<u64>,
    /// Operations per second of writes.
    #[arg(long, value_name = "N", group = "settings")]
    pub iops_write: Option<u64>,
    /// Burst rate of iops-write, in operations per second.
    #[arg(long, value_name = "N", group = "settings")]
    pub iops_write_max: Option<u64>,
    /// Seconds the iops-write burst may last [0: 1].
    #[arg(long, value_name = "SECS", group = "settings")]
    pub iops_write_max_length: Option<u64>,
    /// A request larger than this many bytes counts as size / iops-size operations.
    #[arg(long, value_name = "BYTES", value_parser = parse_bytes, group = "settings")]
    pub iops_size: Option<u64>,
    /// The throttle group, whose members share the limits: setting limits sets them for every
    /// member. With limits: the group's new limits; without: the disk joins with the group's
    /// current ones. "" takes the disk out of its group. [default: the disk's current group]
    #[arg(long, value_name = "NAME", group = "settings")]
    pub group: Option<String>,
    /// Remove the disk's limits and take it out of its group.
    #[arg(long, conflicts_with = "settings")]
    pub clear: bool,
}

impl ThrottleArgs {
    /// The limits given (the ones not given are 0), or `None` if no limit option was given.
    pub fn limits(&self) -> Option<ThrottleLimits> {
        let given = [
            self.bps_total,
            self.bps_total_max,
            self.bps_total_max_length,
            self.bps_read,
            self.bps_read_max,
            self.bps_read_max_length,
            self.bps_write,
            self.bps_write_max,
            self.bps_write_max_length,
            self.iops_total,
            self.iops_total_max,
            self.iops_total_max_length,
            self.iops_read,
            self.iops_read_max,
            self.iops_read_max_length,
            self.iops_write,
            self.iops_write_max,
            self.iops_write_max_length,
            self.iops_size,
        ];
        if given.iter().all(Option::is_none) {
            return None;
        }
        let mut limits = ThrottleLimits::default();
        // Same order as LIMIT_FIELDS (the .proto's), which the unit test checks by name. A
        // bucket none of whose numbers is given stays absent (the same as all zero).
        for (name, value) in LIMIT_FIELDS.iter().zip(given) {
            let Some(value) = value else { continue };
            if let Some(field) = limit_mut(&mut limits, name) {
                *field = value;
            }
        }
        Some(limits)
    }

    /// Whether the command only shows the limits (no option given).
    pub fn is_show(&self) -> bool {
        !self.clear && self.group.is_none() && self.limits().is_none()
    }

    /// Whether [`ThrottleArgs::request`] needs the limits of the group named by `--group`:
    /// the group is given without limits (the disk joins with the group's limits).
    pub fn needs_group_limits(&self) -> Option<&str> {
        match (&self.group, self.limits()) {
            (Some(group), None) if !self.clear && !group.is_empty() => Some(group),
            _ => None,
        }
    }

    /// The SetThrottle request for disk `current.id`, whose setting is `current`:
    /// `--clear` is no limits and no group; a group not given is the disk's current one (as
    /// QEMU's block_set_io_throttle keeps the group when none is named); limits not given
    /// are, with `--group`, that group's current ones (`group_limits`, from a member; zero
    /// for a new group), so that joining a group does not reset its limits.
    pub fn request(
        &self,
        current: &ThrottleConfig,
        group_limits: Option<ThrottleLimits>,
    ) -> SetThrottleRequest {
        if self.clear {
            return SetThrottleRequest {
                id: current.id.clone(),
                limits: Some(ThrottleLimits::default()),
                group: String::new(),
            };
        }
        let group = self.group.clone().unwrap_or_else(|| current.group.clone());
        let limits = match self.limits() {
            Some(limits) => limits,
            None if group == current.group => current.limits.unwrap_or_default(),
            None => group_limits.unwrap_or_default(),
        };
        SetThrottleRequest {
            id: current.id.clone(),
            limits: Some(limits),
            group,
        }
    }
}

/// The limits of throttle group `group` as `disks` (ListDisks) show them: any member's (they
/// are the same for all); `None` if no disk is in it.
pub fn group_limits(disks: &[Disk], group: &str) -> Option<ThrottleLimits> {
    disks
        .iter()
        .filter_map(|d| d.throttle.as_ref())
        .find(|t| t.group == group)
        .map(|t| t.limits.unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// blkplanectl's `disk throttle` options, on their own.
    #[derive(Debug, clap::Parser)]
    struct Throttle {
        #[command(flatten)]
        args: ThrottleArgs,
    }

    fn parse(args: &[&str]) -> Result<ThrottleArgs, clap::Error> {
        use clap::Parser;
        Throttle::try_parse_from(std::iter::once("t").chain(args.iter().copied())).map(|t| t.args)
    }

    #[test]
    fn every_limit_has_its_flag() {
        for name in LIMIT_FIELDS {
            let flag = format!("--{}", limit_flag(name));
            let a = parse(&[&flag, "7"]).unwrap_or_else(|e| panic!("{flag}: {e}"));
            let limits = a.limits().unwrap();
            // The flag sets its own field and nothing else.
            assert_eq!(set_limits(&limits), [(name, 7)], "{flag}");
            assert!(!a.is_show());
        }
        let a = parse(&[
            "--iops-total",
            "500",
            "--iops-total-max",
            "1000",
            "--bps-read",
            "1M",
        ])
        .unwrap();
        let l = a.limits().unwrap();
        assert_eq!(
            set_limits(&l),
            [
                ("bps_read", 1 << 20),
                ("iops_total", 500),
                ("iops_total_max", 1000)
            ]
        );
        assert_eq!(
            parse(&["--iops-size", "4k"])
                .unwrap()
                .limits()
                .unwrap()
                .iops_size,
            4096
        );
        // Units are for bytes only; seconds and operations are plain numbers.
        assert!(parse(&["--iops-total", "1M"]).is_err());
        assert!(parse(&["--bps-total-max-length", "1k"]).is_err());
        assert!(parse(&["--bps-total", "-1"]).is_err());
        assert!(parse(&["--iops_total", "1"]).is_err());
    }

    #[test]
    fn show_clear_and_group() {
        let show = parse(&[]).unwrap();
        assert!(show.is_show() && show.limits().is_none());
        let clear = parse(&["--clear"]).unwrap();
        assert!(clear.clear && !clear.is_show());
        for bad in [
            &["--clear", "--iops-total", "5"][..],
            &["--clear", "--group", "g"],
        ] {
            let e = parse(bad).unwrap_err();
            assert_eq!(
                e.kind(),
                clap::error::ErrorKind::ArgumentConflict,
                "{bad:?}"
            );
        }
        let current = ThrottleConfig {
            id: "d".into(),
            limits: Some(blkplane_api::limits::named(&[("iops_total", 100)]).unwrap()),
            group: "g".into(),
            group_members: vec!["d".into(), "e".into()],
            member_index: 1,
            pending: vec![],
        };
        let iops = |n| blkplane_api::limits::named(&[("iops_total", n)]).unwrap();
        // Clear: no limits, no group.
        let r = clear.request(&current, None);
        assert_eq!(
            (r.limits, r.group.as_str()),
            (Some(ThrottleLimits::default()), "")
        );
        // Limits without --group: the disk stays in its group (QEMU's behaviour), and the
        // limits not given are zero.
        let r = parse(&["--bps-total", "5"])
            .unwrap()
            .request(&current, None);
        assert_eq!(r.group, "g");
        assert_eq!(
            r.limits,
            Some(blkplane_api::limits::named(&[("bps_total", 5)]).unwrap())
        );
        // Joining another group without limits: that group's limits, not zero.
        let join = parse(&["--group", "h"]).unwrap();
        assert_eq!(join.needs_group_limits(), Some("h"));
        let r = join.request(&current, Some(iops(9)));
        assert_eq!((r.limits, r.group.as_str()), (Some(iops(9)), "h"));
        // A new group (no member yet): zero limits.
        assert_eq!(
            join.request(&current, None).limits,
            Some(ThrottleLimits::default())
        );
        // Its own group again: its limits unchanged.
        let r = parse(&["--group", "g"]).unwrap().request(&current, None);
        assert_eq!(r.limits, Some(iops(100)));
        // --group "": out of the group; without limits that is no limits.
        let out = parse(&["--group", ""]).unwrap();
        assert_eq!(out.needs_group_limits(), None);
        let r = out.request(&current, None);
        assert_eq!(
            (r.limits, r.group.as_str()),
            (Some(ThrottleLimits::default()), "")
        );
        // Limits and a group.
        let r = parse(&["--group", "h", "--iops-total", "3"])
            .unwrap()
            .request(&current, Some(iops(9)));
        assert_eq!((r.limits, r.group.as_str()), (Some(iops(3)), "h"));
        assert_eq!(r.id, "d");
        // The group's limits from a disk list.
        let disk = |id: &str, t: ThrottleConfig| Disk {
            config: Some(blkplane_api::pb::DiskConfig {
                id: id.into(),
                ..Default::default()
            }),
            throttle: Some(t),
            ..Default::default()
        };
        let disks = [
            disk("a", ThrottleConfig::default()),
            disk("d", current.clone()),
        ];
        assert_eq!(group_limits(&disks, "g"), Some(iops(100)));
        assert_eq!(group_limits(&disks, "h"), None);
    }
}
