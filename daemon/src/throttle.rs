//! I/O throttling of disks as blkplaned keeps it: QEMU's limits per disk, throttle groups and
//! their members' indices, the group's shared state file, and what a frontend is sent.
//!
//! The arithmetic and the validation rules are the `blkplane-throttle` crate's (the frontend
//! uses the same), and the limits travel as `blkplane_proto::v1::ThrottleLimits` everywhere:
//! in the gRPC API, on the admin channel and, field by field, in `state.json`.
//!
//! A group is not an object of its own: it is the set of disks whose setting names it, and
//! its limits are the limits every member carries (kept equal by [`plan_set`], which changes
//! them for all members at once). Its shared state is the file `GROUP.state` in
//! `RUNTIME_DIR/throttle`, which exists exactly while the group has a member.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::OpenOptions;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use blkplane_proto::v1::{SetThrottle, ThrottleLimits};
use blkplane_throttle::{GROUP_STATE_LEN, MAX_GROUP_MEMBERS};
use log::warn;

use crate::state::ThrottleSetting;

/// Suffix of a group's state file in the throttle directory (after the group's name).
pub const GROUP_FILE_SUFFIX: &str = ".state";

/// The state file of `group` in the throttle directory `dir`.
pub fn group_file(dir: &Path, group: &str) -> PathBuf {
    dir.join(format!("{group}{GROUP_FILE_SUFFIX}"))
}

/// What a frontend is sent for `setting`: the limits, the group's file (empty without a group)
/// and the member index (0 without a group).
pub fn frontend_request(setting: &ThrottleSetting, dir: &Path) -> SetThrottle {
    let grouped = !setting.group.is_empty();
    SetThrottle {
        limits: Some(setting.limits),
        group_state_path: if grouped {
            group_file(dir, &setting.group)
                .to_string_lossy()
                .into_owned()
        } else {
            String::new()
        },
        member_index: if grouped { setting.member_index } else { 0 },
    }
}

/// Caps `limits` so that writes go at most `bytes_per_second` (auto-converge of a copy to
/// another node): the write bucket's average, or the total's where the limits have a total
/// (a total cannot be combined with a write bucket), lowered to the cap, never raised.
pub fn cap_writes(limits: &mut ThrottleLimits, bytes_per_second: u64) {
    let bucket = match (&mut limits.bps_total, &mut limits.bps_write) {
        (Some(total), _) if total.avg != 0 => total,
        (_, write) => write.get_or_insert_with(Default::default),
    };
    if bucket.avg == 0 || bucket.avg > bytes_per_second {
        bucket.avg = bytes_per_second;
    }
    // A burst rate must not be below the average.
    if bucket.max != 0 && bucket.max < bucket.avg {
        bucket.max = bucket.avg;
    }
}

/// What a frontend that was never sent any limits has: none, alone. A frontend started for a
/// disk without a setting is recorded as having this, so that it is not sent a no-op.
pub fn unthrottled_request() -> SetThrottle {
    frontend_request(&ThrottleSetting::default(), Path::new(""))
}

/// The members of `group` among `settings` (disk id → setting) with their indices, ordered by
/// id.
pub fn members<'a>(
    settings: &'a BTreeMap<String, ThrottleSetting>,
    group: &str,
) -> Vec<(&'a str, u32)> {
    if group.is_empty() {
        return Vec::new();
    }
    settings
        .iter()
        .filter(|(_, s)| s.group == group)
        .map(|(id, s)| (id.as_str(), s.member_index))
        .collect()
}

/// The lowest index below [`MAX_GROUP_MEMBERS`] that none of `taken` is; `None` when all are.
pub fn lowest_free(taken: impl IntoIterator<Item = u32>) -> Option<u32> {
    let taken: BTreeSet<u32> = taken.into_iter().collect();
    (0..MAX_GROUP_MEMBERS as u32).find(|i| !taken.contains(i))
}

/// A SetThrottle that cannot be done: the group is full.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupFull {
    /// The group.
    pub group: String,
}

/// What a SetThrottle changes, worked out before anything is changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// The new setting of every disk whose setting changes: the disk itself and, when it is
    /// in a group, the other members (their limits), by id.
    pub changes: BTreeMap<String, ThrottleSetting>,
    /// The group the disk left, when it has no member left afterwards (its file goes).
    pub emptied: Option<String>,
}

/// Plans setting `limits` and `group` (empty: none) on disk `id`, given every disk's setting
/// now (`settings`; `id` missing from it counts as a disk without a setting, as a disk being
/// added is). A disk staying in its group keeps its index; one joining a group gets the lowest
/// free one; every member of the group gets the limits. The disk leaves its old group if it
/// names another one.
pub fn plan_set(
    settings: &BTreeMap<String, ThrottleSetting>,
    id: &str,
    limits: ThrottleLimits,
    group: &str,
) -> Result<Plan, GroupFull> {
    let old = settings.get(id).cloned().unwrap_or_default();
    let mut changes = BTreeMap::new();
    let others: Vec<(&str, u32)> = members(settings, group)
        .into_iter()
        .filter(|(m, _)| *m != id)
        .collect();
    let member_index = if group.is_empty() {
        0
    } else if old.group == group {
        old.member_index
    } else {
        lowest_free(others.iter().map(|(_, i)| *i)).ok_or_else(|| GroupFull {
            group: group.to_string(),
        })?
    };
    let new = ThrottleSetting {
        limits,
        group: group.to_string(),
        member_index,
    };
    if new != old {
        changes.insert(id.to_string(), new);
    }
    for (member, _) in others {
        if let Some(current) = settings.get(member) {
            if current.limits != limits {
                changes.insert(
                    member.to_string(),
                    ThrottleSetting {
                        limits,
                        ..current.clone()
                    },
                );
            }
        }
    }
    let emptied = (!old.group.is_empty()
        && old.group != group
        && members(settings, &old.group).iter().all(|(m, _)| *m == id))
    .then(|| old.group.clone());
    Ok(Plan { changes, emptied })
}

/// Makes the member indices of a loaded state valid (a state file edited by hand, or written
/// by a blkplaned with a bug): in each group, by id, a member keeps its index unless it is out
/// of range or an earlier member has it, and then gets the lowest free one; a disk without a
/// group has index 0. Returns a line per change, for the log. Members beyond
/// [`MAX_GROUP_MEMBERS`] keep their (clashing) index: nothing better exists for them.
pub fn repair_indices(settings: &mut BTreeMap<String, ThrottleSetting>) -> Vec<String> {
    let mut notes = Vec::new();
    let groups: BTreeSet<String> = settings
        .values()
        .filter(|s| !s.group.is_empty())
        .map(|s| s.group.clone())
        .collect();
    for (id, s) in settings.iter_mut() {
        if s.group.is_empty() && s.member_index != 0 {
            notes.push(format!(
                "disk {id}: member index {} without a group; set to 0",
                s.member_index
            ));
            s.member_index = 0;
        }
    }
    for group in groups {
        let mut taken = BTreeSet::new();
        let mut clashing = Vec::new();
        for (id, s) in settings.iter().filter(|(_, s)| s.group == group) {
            if (s.member_index as usize) < MAX_GROUP_MEMBERS && taken.insert(s.member_index) {
                continue;
            }
            clashing.push(id.clone());
        }
        for id in clashing {
            let Some(free) = lowest_free(taken.iter().copied()) else {
                notes.push(format!(
                    "disk {id}: group {group} has more than {MAX_GROUP_MEMBERS} members; its \
                     index stays"
                ));
                continue;
            };
            if let Some(s) = settings.get_mut(&id) {
                notes.push(format!(
                    "disk {id}: member index {} of group {group} is taken or out of range; \
                     now {free}",
                    s.member_index
                ));
                s.member_index = free;
                taken.insert(free);
            }
        }
    }
    notes
}

/// How [`ensure_group_file`] found a group's file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupFile {
    /// It did not exist; it was created.
    Created,
    /// It existed with `GROUP_STATE_LEN` bytes and was left as it is.
    Present,
    /// It existed but was shorter (a crash between creating and sizing it): it was extended
    /// with zeros.
    Extended,
}

/// Makes sure a group's state file exists with `GROUP_STATE_LEN` bytes. A new one is
/// created zero-filled (set_len on an empty file) with mode 0600. One that exists is never
/// truncated or rewritten — running frontends map it — only extended if it is short (zeros
/// are the cleared state, so the extension is valid). A longer one is not a group file that
/// blkplaned made (frontends refuse it): an error, and it is left alone. Symlinks are not
/// followed.
pub fn ensure_group_file(path: &Path) -> std::io::Result<GroupFile> {
    let len = GROUP_STATE_LEN as u64;
    match OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
    {
        Ok(file) => {
            if let Err(e) = file.set_len(len) {
                drop(file);
                let _ = std::fs::remove_file(path);
                return Err(e);
            }
            Ok(GroupFile::Created)
        }
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            let file = OpenOptions::new()
                .write(true)
                .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
                .open(path)?;
            let meta = file.metadata()?;
            if !meta.is_file() {
                return Err(std::io::Error::other(format!(
                    "{} is not a regular file",
                    path.display()
                )));
            }
            if meta.len() < len {
                file.set_len(len)?;
                return Ok(GroupFile::Extended);
            }
            if meta.len() > len {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!(
                        "{} is {} bytes, not the {len} of a throttle group's state",
                        path.display(),
                        meta.len()
                    ),
                ));
            }
            Ok(GroupFile::Present)
        }
        Err(e) => Err(e),
    }
}

/// Removes a group's state file (frontends that still map it keep their mapping); a missing
/// file is fine, other errors are logged.
pub fn remove_group_file(path: &Path) {
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => warn!("removing {}: {e}", path.display()),
    }
}

/// The group state files in `dir` whose group is not in `wanted`: leftovers of a crash
/// between a state write and the file's creation or removal.
pub fn stale_group_files(dir: &Path, wanted: &BTreeSet<String>) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok())
        .filter(|e| {
            let name = e.file_name();
            let name = name.to_string_lossy();
            name.strip_suffix(GROUP_FILE_SUFFIX)
                .is_some_and(|g| !wanted.contains(g))
        })
        .map(|e| e.path())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use blkplane_api::limits::{limit_mut, LIMIT_FIELDS};
    use std::os::unix::fs::PermissionsExt;

    fn iops(n: u64) -> ThrottleLimits {
        blkplane_api::limits::named(&[("iops_total", n)]).unwrap()
    }

    fn member(group: &str, index: u32, limits: ThrottleLimits) -> ThrottleSetting {
        ThrottleSetting {
            limits,
            group: group.into(),
            member_index: index,
        }
    }

    fn table(entries: &[(&str, ThrottleSetting)]) -> BTreeMap<String, ThrottleSetting> {
        entries
            .iter()
            .map(|(id, s)| (id.to_string(), s.clone()))
            .collect()
    }

    /// Applies a plan as the daemon does.
    fn apply(t: &mut BTreeMap<String, ThrottleSetting>, plan: Plan) {
        t.extend(plan.changes);
    }

    #[test]
    fn field_table() {
        let mut l = ThrottleLimits::default();
        for (i, name) in LIMIT_FIELDS.iter().enumerate() {
            *limit_mut(&mut l, name).unwrap() = i as u64 + 1;
        }
        // Every name reaches its own field: the conversion to the throttle crate's buckets
        // (which the proto crate tests field by field) sees 1..=19 in .proto order.
        let t = blkplane_throttle::ThrottleLimits::from(&l);
        assert_eq!(
            (t.bps_total.avg, t.bps_read.max_length, t.iops_write.max),
            (1, 6, 17)
        );
        assert_eq!(t.iops_size, 19);
    }

    #[test]
    fn alone_and_clear() {
        let t = table(&[("a", ThrottleSetting::default())]);
        let p = plan_set(&t, "a", iops(100), "").unwrap();
        assert_eq!(p.changes, table(&[("a", member("", 0, iops(100)))]));
        assert_eq!(p.emptied, None);
        // Setting what is there changes nothing.
        let t = table(&[("a", member("", 0, iops(100)))]);
        assert!(plan_set(&t, "a", iops(100), "").unwrap().changes.is_empty());
        // Clear.
        let p = plan_set(&t, "a", ThrottleLimits::default(), "").unwrap();
        assert_eq!(p.changes["a"], ThrottleSetting::default());
        assert!(p.changes["a"].is_none());
    }

    #[test]
    fn joining_takes_the_lowest_free_index_and_sets_the_group() {
        let mut t = table(&[
            ("a", member("g", 0, iops(10))),
            ("b", member("g", 2, iops(10))),
            ("c", ThrottleSetting::default()),
            ("d", member("h", 0, iops(99))),
        ]);
        let p = plan_set(&t, "c", iops(50), "g").unwrap();
        // c gets 1 (0 and 2 are taken); a and b get the new limits, d is not touched.
        assert_eq!(
            p.changes,
            table(&[
                ("a", member("g", 0, iops(50))),
                ("b", member("g", 2, iops(50))),
                ("c", member("g", 1, iops(50))),
            ])
        );
        assert_eq!(p.emptied, None);
        apply(&mut t, p);
        // Setting limits on a member again keeps every index.
        let p = plan_set(&t, "b", iops(70), "g").unwrap();
        assert_eq!(p.changes.len(), 3);
        assert_eq!(p.changes["b"].member_index, 2);
        assert_eq!(p.changes["c"].member_index, 1);
        apply(&mut t, p);
        // A group without limits is a group.
        let p = plan_set(&t, "a", ThrottleLimits::default(), "g").unwrap();
        assert!(p.changes.values().all(|s| s.group == "g" && !s.is_none()));
        // The last member of h leaving for g empties h; d gets index 3.
        let p = plan_set(&t, "d", iops(70), "g").unwrap();
        assert_eq!(p.emptied.as_deref(), Some("h"));
        assert_eq!(p.changes["d"], member("g", 3, iops(70)));
        apply(&mut t, p);
        // b leaving g: g keeps its other members (and its limits), nothing emptied; b's index
        // is free again for the next one to join.
        let p = plan_set(&t, "b", iops(1), "").unwrap();
        assert_eq!(p.emptied, None);
        assert_eq!(p.changes, table(&[("b", member("", 0, iops(1)))]));
        apply(&mut t, p);
        let p = plan_set(&t, "b", iops(70), "g").unwrap();
        assert_eq!(p.changes["b"].member_index, 2);
    }

    #[test]
    fn a_new_disk_and_a_full_group() {
        let mut t = BTreeMap::new();
        for i in 0..MAX_GROUP_MEMBERS {
            t.insert(format!("m{i:02}"), member("g", i as u32, iops(5)));
        }
        // A disk not in the table yet (an incoming disk being added) joins like any other.
        let err = plan_set(&t, "new", iops(5), "g").unwrap_err();
        assert_eq!(err.group, "g");
        // A member may still change the limits of the full group.
        let p = plan_set(&t, "m07", iops(6), "g").unwrap();
        assert_eq!(p.changes.len(), MAX_GROUP_MEMBERS);
        t.remove("m07");
        let p = plan_set(&t, "new", iops(5), "g").unwrap();
        assert_eq!(p.changes, table(&[("new", member("g", 7, iops(5)))]));
    }

    #[test]
    fn repairs() {
        let mut t = table(&[
            ("a", member("g", 1, iops(1))),
            ("b", member("g", 1, iops(1))),
            ("c", member("g", 64, iops(1))),
            ("d", member("", 5, iops(1))),
            ("e", member("h", 0, iops(1))),
        ]);
        let notes = repair_indices(&mut t);
        assert_eq!(notes.len(), 3, "{notes:?}");
        assert_eq!(
            [
                t["a"].member_index,
                t["b"].member_index,
                t["c"].member_index,
                t["d"].member_index,
                t["e"].member_index
            ],
            [1, 0, 2, 0, 0]
        );
        assert!(repair_indices(&mut t).is_empty());
    }

    #[test]
    fn requests() {
        let dir = Path::new("/run/bp/throttle");
        let r = frontend_request(&member("g", 3, iops(9)), dir);
        assert_eq!(r.group_state_path, "/run/bp/throttle/g.state");
        assert_eq!((r.member_index, r.limits), (3, Some(iops(9))));
        let r = frontend_request(&member("", 3, iops(9)), dir);
        assert_eq!((r.group_state_path.as_str(), r.member_index), ("", 0));
        assert_eq!(
            unthrottled_request(),
            SetThrottle {
                limits: Some(ThrottleLimits::default()),
                group_state_path: String::new(),
                member_index: 0,
            }
        );
    }

    #[test]
    fn a_write_cap_lowers_the_write_or_total_bucket_only() {
        use blkplane_proto::v1::ThrottleBucket;
        let bucket = |avg| {
            Some(ThrottleBucket {
                avg,
                max: 0,
                max_length: 0,
            })
        };
        let mut none = ThrottleLimits::default();
        cap_writes(&mut none, 1000);
        assert_eq!(none.bps_write, bucket(1000));
        let mut higher = ThrottleLimits {
            bps_write: bucket(5000),
            iops_read: bucket(7),
            ..ThrottleLimits::default()
        };
        cap_writes(&mut higher, 1000);
        assert_eq!(higher.bps_write, bucket(1000));
        assert_eq!(higher.iops_read, bucket(7));
        let mut lower = ThrottleLimits {
            bps_write: bucket(500),
            ..ThrottleLimits::default()
        };
        cap_writes(&mut lower, 1000);
        assert_eq!(lower.bps_write, bucket(500));
        let mut total = ThrottleLimits {
            bps_total: bucket(9000),
            ..ThrottleLimits::default()
        };
        cap_writes(&mut total, 1000);
        assert_eq!(total.bps_total, bucket(1000));
        assert_eq!(total.bps_write, None);
    }

    #[test]
    fn group_files() {
        let scratch = blkplane_tests::TempDir::new("bpth");
        let dir = scratch.path().to_path_buf();
        let f = group_file(&dir, "g");
        assert_eq!(ensure_group_file(&f).unwrap(), GroupFile::Created);
        let meta = std::fs::metadata(&f).unwrap();
        assert_eq!(meta.len(), GROUP_STATE_LEN as u64);
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
        assert!(std::fs::read(&f).unwrap().iter().all(|b| *b == 0));
        // Present: never rewritten (a frontend's state survives).
        let mut bytes = std::fs::read(&f).unwrap();
        bytes[0] = 7;
        std::fs::write(&f, &bytes).unwrap();
        assert_eq!(ensure_group_file(&f).unwrap(), GroupFile::Present);
        assert_eq!(std::fs::read(&f).unwrap()[0], 7);
        // Short: extended, the start kept.
        std::fs::write(&f, [9u8; 8]).unwrap();
        assert_eq!(ensure_group_file(&f).unwrap(), GroupFile::Extended);
        let bytes = std::fs::read(&f).unwrap();
        assert_eq!((bytes.len(), bytes[0]), (GROUP_STATE_LEN, 9));
        // Long: not ours; refused and left alone.
        let long = vec![3u8; GROUP_STATE_LEN + 1];
        std::fs::write(&f, &long).unwrap();
        assert!(ensure_group_file(&f).is_err());
        assert_eq!(std::fs::read(&f).unwrap(), long);
        // Stale ones: files of groups not wanted, nothing else.
        ensure_group_file(&group_file(&dir, "old")).unwrap();
        std::fs::write(dir.join("notes.txt"), "x").unwrap();
        let wanted = BTreeSet::from(["g".to_string()]);
        assert_eq!(stale_group_files(&dir, &wanted), [group_file(&dir, "old")]);
        remove_group_file(&group_file(&dir, "old"));
        remove_group_file(&group_file(&dir, "old"));
        assert!(stale_group_files(&dir, &wanted).is_empty());
        // A symlink is not followed.
        std::os::unix::fs::symlink(dir.join("notes.txt"), group_file(&dir, "link")).unwrap();
        assert!(ensure_group_file(&group_file(&dir, "link")).is_err());
        assert_eq!(std::fs::read(dir.join("notes.txt")).unwrap(), b"x");
    }
}
