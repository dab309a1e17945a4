//! I/O limits and throttle groups of the disk table: reading a disk's limits, changing them
//! (for every member of a group at once) and the group files that follow the membership.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use blkplane_proto::v1::ThrottleLimits;
use blkplane_throttle::MAX_GROUP_MEMBERS;
use log::{info, warn};

use crate::pb::{self, EventKind};
use crate::state::{DiskSpec, ThrottleSetting};
use crate::supervisor::DiskHandle;
use crate::sync::lock;
use crate::throttle::{self, GroupFile};
use crate::validate::{self, ValidationError};

use super::{Daemon, DaemonError};

impl Daemon {
    /// Every disk's I/O limits and throttle group, by id.
    pub(super) fn throttle_settings(&self) -> BTreeMap<String, ThrottleSetting> {
        lock(&self.disks)
            .iter()
            .map(|(id, d)| (id.clone(), d.runtime().lifecycle.throttle))
            .collect()
    }

    /// The throttle setting of a disk being added: an incoming disk takes its source's limits
    /// and group, as a member of its own with the lowest free index (RESOURCE_EXHAUSTED
    /// `incoming_for` when the group is full); any other disk starts without. The group's
    /// file is made sure of (the source's membership should have it there already).
    pub(super) fn incoming_throttle(
        &self,
        spec: &DiskSpec,
    ) -> Result<ThrottleSetting, DaemonError> {
        let Some(source) = &spec.incoming_for else {
            return Ok(ThrottleSetting::default());
        };
        let settings = self.throttle_settings();
        let of_source = settings.get(source).cloned().unwrap_or_default();
        let plan = throttle::plan_set(&settings, &spec.id, of_source.limits, &of_source.group)
            .map_err(|full| ValidationError::ResourceExhausted {
                field: "incoming_for",
                reason: format!(
                    "disk {source} is in throttle group {}, which has {MAX_GROUP_MEMBERS} \
                     members already (the most a group can have); its incoming disk would be \
                     one more",
                    full.group
                ),
            })?;
        let setting = plan.changes.get(&spec.id).cloned().unwrap_or_default();
        if !setting.group.is_empty() {
            self.ensure_group(&setting.group)?;
        }
        Ok(setting)
    }

    /// Makes sure the state file of `group` exists; true if it had to be created.
    pub(super) fn ensure_group(&self, group: &str) -> Result<bool, DaemonError> {
        let path = throttle::group_file(&self.settings.throttle_dir, group);
        match throttle::ensure_group_file(&path) {
            Ok(GroupFile::Created) => Ok(true),
            Ok(GroupFile::Present) => Ok(false),
            Ok(GroupFile::Extended) => {
                warn!("{} was short; extended with zeros", path.display());
                Ok(false)
            }
            Err(source) => Err(DaemonError::Io {
                what: "creating",
                path,
                source,
            }),
        }
    }

    /// Removes the state file of `group` (empty: none) if no disk of the table is in it any
    /// more. Callers hold `ops`, so that no disk joins meanwhile.
    pub(super) fn drop_group_if_empty(&self, group: &str) {
        if group.is_empty() {
            return;
        }
        let used = lock(&self.disks)
            .values()
            .any(|d| d.runtime().lifecycle.throttle.group == group);
        if !used {
            info!("throttle group {group} has no member left; removing its file");
            throttle::remove_group_file(&throttle::group_file(&self.settings.throttle_dir, group));
        }
    }

    /// The API view of a disk's I/O limits and throttle group.
    pub(super) fn throttle_config(&self, disk: &DiskHandle) -> pb::ThrottleConfig {
        let setting = disk.runtime().lifecycle.throttle;
        let members: Vec<Arc<DiskHandle>> = if setting.group.is_empty() {
            Vec::new()
        } else {
            lock(&self.disks)
                .values()
                .filter(|d| d.runtime().lifecycle.throttle.group == setting.group)
                .cloned()
                .collect()
        };
        let mut pending: BTreeSet<String> = members
            .iter()
            .filter(|d| d.throttle_pending())
            .map(|d| d.spec.id.clone())
            .collect();
        if disk.throttle_pending() {
            pending.insert(disk.spec.id.clone());
        }
        pb::ThrottleConfig {
            id: disk.spec.id.clone(),
            limits: Some(setting.limits),
            member_index: if setting.group.is_empty() {
                0
            } else {
                setting.member_index
            },
            group_members: members.iter().map(|d| d.spec.id.clone()).collect(),
            group: setting.group,
            pending: pending.into_iter().collect(),
        }
    }

    /// GetThrottle.
    pub fn get_throttle(&self, id: &str) -> Result<pb::ThrottleConfig, DaemonError> {
        let disk = self.get_handle(id)?;
        Ok(self.throttle_config(&disk))
    }

    /// SetThrottle: checks the request, works out what changes (the disk's setting and, in a
    /// group, every member's limits), creates the group's file, persists all changes in one
    /// write (undone on failure, with the file if it was new), removes the file of a group
    /// the disk was the last member of, then sends the limits to every frontend whose
    /// setting changed — all at once — and returns when each has them or failed to take
    /// them (`pending`). A refused call changes nothing.
    pub async fn set_throttle(
        &self,
        id: &str,
        limits: ThrottleLimits,
        group: &str,
    ) -> Result<pb::ThrottleConfig, DaemonError> {
        let (disk, targets) = {
            let _ops = self.ops.lock().await;
            let disk = self.get_handle(id)?;
            let limits = validate::check_limits(&limits)?;
            if !group.is_empty() {
                validate::check_group(group)?;
            }
            let settings = self.throttle_settings();
            let plan = throttle::plan_set(&settings, id, limits, group).map_err(|full| {
                ValidationError::ResourceExhausted {
                    field: "group",
                    reason: format!(
                        "throttle group {} has {MAX_GROUP_MEMBERS} members already, the most a \
                         group can have",
                        full.group
                    ),
                }
            })?;
            // The file before the state: a group in the state always has its file.
            let created = !group.is_empty() && self.ensure_group(group)?;
            let mut changed = Vec::with_capacity(plan.changes.len());
            for (member, setting) in &plan.changes {
                if let Ok(handle) = self.get_handle(member) {
                    let old = handle.runtime().lifecycle.throttle;
                    handle.update(|rt| rt.lifecycle.throttle = setting.clone());
                    changed.push((handle, old));
                }
            }
            if let Err(e) = self.persist() {
                for (handle, old) in &changed {
                    handle.update(|rt| rt.lifecycle.throttle = old.clone());
                }
                if created {
                    throttle::remove_group_file(&throttle::group_file(
                        &self.settings.throttle_dir,
                        group,
                    ));
                }
                return Err(e);
            }
            for (handle, old) in &changed {
                let rt = handle.runtime();
                let new = &rt.lifecycle.throttle;
                let change = format!(
                    "{}{}",
                    describe_limits(&new.limits),
                    describe_group(old, new)
                );
                info!("disk {}: I/O limits {change}", handle.spec.id);
                self.events
                    .emit(EventKind::ThrottleChanged, &handle.spec.id, rt.pid, change);
            }
            if let Some(emptied) = &plan.emptied {
                self.drop_group_if_empty(emptied);
            }
            let mut targets: Vec<Arc<DiskHandle>> = changed.into_iter().map(|(h, _)| h).collect();
            // The disk itself even when nothing changed: its frontend may still lack them.
            if !targets.iter().any(|h| h.spec.id == id) {
                targets.push(Arc::clone(&disk));
            }
            (disk, targets)
        };
        // Outside `ops`: a hung frontend must not hold up the other disks' calls. Each send
        // reads the disk's current setting under the disk's own lock, so a later SetThrottle
        // that overtakes this one is never undone by it.
        let mut sends = tokio::task::JoinSet::new();
        for handle in targets {
            sends.spawn(async move {
                let result = handle.push_throttle().await;
                (handle.spec.id.clone(), result)
            });
        }
        while let Some(done) = sends.join_next().await {
            match done {
                Ok((member, Err(e))) => warn!(
                    "disk {member}: the frontend did not take the new I/O limits: {e}; \
                     trying again at every poll"
                ),
                Ok((_, Ok(()))) => {}
                Err(e) => warn!("sending I/O limits: {e}"),
            }
        }
        Ok(self.throttle_config(&disk))
    }
}

/// The limits that are set, for the log: `iops_total=500 bps_read=1048576`, or `none`.
pub(super) fn describe_limits(limits: &ThrottleLimits) -> String {
    let set = blkplane_api::limits::set_limits(limits);
    if set.is_empty() {
        return "none".into();
    }
    set.iter()
        .map(|(name, value)| format!("{name}={value}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// A group change, for the log.
pub(super) fn describe_group(old: &ThrottleSetting, new: &ThrottleSetting) -> String {
    match (old.group.as_str(), new.group.as_str()) {
        ("", "") => String::new(),
        (o, n) if o == n => format!(" (group {n}, member {})", new.member_index),
        ("", n) => format!("; joined group {n} as member {}", new.member_index),
        (o, "") => format!("; left group {o}"),
        (o, n) => format!(
            "; left group {o}, joined group {n} as member {}",
            new.member_index
        ),
    }
}
