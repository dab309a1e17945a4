//! The desired state: which disks exist, how they are configured (including whether one is
//! the incoming destination of a live migration), whether each is drained and blocked from
//! migration by an operator, and its I/O limits and throttle group, persisted as JSON in
//! `STATE_DIR/state.json`.
//!
//! Every change is written atomically: a temp file in the same directory is written and
//! fsynced, renamed over the old file, and the directory is fsynced, so that after a crash
//! (of blkplaned or of the machine) the file is either the old or the new state, never a mix.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use blkplane_proto::v1::ThrottleLimits;
use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::pb;

/// The state file's name inside the state directory.
pub const STATE_FILE: &str = "state.json";
/// The format version written into the state file.
pub const STATE_VERSION: u32 = 1;

/// Errors reading or writing the state.
#[derive(Debug, Error)]
pub enum StateError {
    /// A file operation failed.
    #[error("{what} {}: {source}", path.display())]
    Io {
        /// What was being done.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The state file is not valid JSON of the expected shape.
    #[error("{} is corrupt: {source}", path.display())]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// The parse error.
        source: serde_json::Error,
    },
    /// The state file was written by a newer blkplaned.
    #[error("{} has format version {found}; this blkplaned reads version {STATE_VERSION}", path.display())]
    Version {
        /// The file.
        path: PathBuf,
        /// Its version.
        found: u32,
    },
    /// Another process holds the directory's lock.
    #[error("{} is locked by another blkplaned", path.display())]
    Locked {
        /// The lock file.
        path: PathBuf,
    },
}

fn io<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> StateError + 'a {
    move |source| StateError::Io {
        what,
        path: path.to_path_buf(),
        source,
    }
}

/// Host cache mode, as stored and as passed to the frontend's `--cache`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Cache {
    /// O_DIRECT.
    Direct,
    /// Page cache.
    Writeback,
    /// Every write durable.
    Writethrough,
}

impl Cache {
    /// The frontend's `--cache` value.
    pub fn as_arg(self) -> &'static str {
        match self {
            Cache::Direct => "direct",
            Cache::Writeback => "writeback",
            Cache::Writethrough => "writethrough",
        }
    }

    /// The API value.
    pub fn to_pb(self) -> pb::CacheMode {
        match self {
            Cache::Direct => pb::CacheMode::Direct,
            Cache::Writeback => pb::CacheMode::Writeback,
            Cache::Writethrough => pb::CacheMode::Writethrough,
        }
    }
}

/// An image format, as stored and as passed to the frontend's `--format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Format {
    /// The file's bytes are the disk's.
    Raw,
    /// qcow2, with its backing chain.
    Qcow2,
}

impl Format {
    /// The frontend's `--format` value.
    pub fn as_arg(self) -> &'static str {
        self.to_chain().name()
    }

    /// The API value.
    pub fn to_pb(self) -> pb::ImageFormat {
        match self {
            Format::Raw => pb::ImageFormat::Raw,
            Format::Qcow2 => pb::ImageFormat::Qcow2,
        }
    }

    /// The format as `blkplane-chain` (and the frontend) name it.
    pub fn to_chain(self) -> blkplane_chain::ImageFormat {
        match self {
            Format::Raw => blkplane_chain::ImageFormat::Raw,
            Format::Qcow2 => blkplane_chain::ImageFormat::Qcow2,
        }
    }

    /// The stored value of a format `blkplane-chain` found.
    pub fn from_chain(format: blkplane_chain::ImageFormat) -> Format {
        match format {
            blkplane_chain::ImageFormat::Raw => Format::Raw,
            blkplane_chain::ImageFormat::Qcow2 => Format::Qcow2,
        }
    }
}

/// One disk's configuration: validated, defaults filled in, paths absolute.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiskSpec {
    /// The disk's name.
    pub id: String,
    /// The image.
    pub image: PathBuf,
    /// The image's format, given or probed when the disk was added, so that every start
    /// serves it so (a guest that writes qcow2's magic into a raw disk does not make it qcow2
    /// at the next start). `None` only in files written before the format was kept: the
    /// frontend probes at each start, as it did then.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub format: Option<Format>,
    /// Offered read-only.
    #[serde(default)]
    pub read_only: bool,
    /// Serial number (GET_ID).
    #[serde(default)]
    pub serial: String,
    /// Request queues.
    pub num_queues: u16,
    /// Largest ring size.
    pub queue_size: u16,
    /// Logical block size.
    pub block_size: u32,
    /// Iothread processes.
    pub iothreads: u16,
    /// Host cache mode.
    pub cache: Cache,
    /// CPU list for the iothreads; empty for none.
    #[serde(default)]
    pub iothread_cpus: String,
    /// The vhost-user socket.
    pub vhost_socket: PathBuf,
    /// The disk this one is the incoming live-migration destination of, until it has taken
    /// over (then `None`). Absent in files written before live migration existed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub incoming_for: Option<String>,
    /// The disk on another node this one is the incoming live-migration destination of,
    /// until it has taken over (then `None`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub incoming_from: Option<RemoteSource>,
    /// The user the disk's processes run as (DiskSettings `run_as`); `None`: blkplaned's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_as: Option<RunAsSpec>,
    /// The bound of the frontend's adaptive polling in µs (DiskSettings `poll_max_us`);
    /// `None`: the frontend's default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub poll_max_us: Option<u32>,
}

/// How a migrated disk's contents reach the destination node (the API's MigrationStorage).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MigrationStorage {
    /// Both nodes reach the image: nothing is copied.
    Shared,
    /// The image is the source node's own: its contents are copied.
    Local,
}

impl MigrationStorage {
    /// The API value.
    pub fn to_pb(self) -> pb::MigrationStorage {
        match self {
            MigrationStorage::Shared => pb::MigrationStorage::Shared,
            MigrationStorage::Local => pb::MigrationStorage::Local,
        }
    }

    /// The stored value of an API value; `None` for UNSPECIFIED (or an unknown number).
    pub fn from_pb(value: i32) -> Option<MigrationStorage> {
        match pb::MigrationStorage::try_from(value).ok()? {
            pb::MigrationStorage::Shared => Some(MigrationStorage::Shared),
            pb::MigrationStorage::Local => Some(MigrationStorage::Local),
            pb::MigrationStorage::Unspecified => None,
        }
    }

    /// Its name in messages.
    pub fn name(self) -> &'static str {
        match self {
            MigrationStorage::Shared => "shared storage",
            MigrationStorage::Local => "local storage",
        }
    }
}

/// The source of a live migration from another node (AddDiskRequest `incoming_from`), as
/// stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoteSource {
    /// The source node's blkplaned, `HOST:PORT`.
    pub endpoint: String,
    /// The source disk's id there.
    pub disk: String,
    /// How the contents reach this node.
    pub storage: MigrationStorage,
    /// The name this node gave itself when the source node agreed (its `--node-name` then),
    /// so that the source node still recognises its destination if the name changes (a
    /// restart with another `--node-name` or host name) before the takeover.
    #[serde(default)]
    pub as_node: String,
    /// Local storage: the image here is not complete yet (the source node has not sent all
    /// of it, or serves again since it had); the frontend serves nothing until it is.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub image_incomplete: bool,
}

impl RemoteSource {
    /// Whether a disk incoming from `from` waits for its image: the destination of a copy
    /// from another node that is not complete. Such a disk's frontend serves nothing.
    pub fn awaits_image(from: Option<&RemoteSource>) -> bool {
        from.is_some_and(|f| f.image_incomplete)
    }

    /// The API value.
    pub fn to_pb(&self) -> pb::IncomingFrom {
        pb::IncomingFrom {
            endpoint: self.endpoint.clone(),
            disk: self.disk.clone(),
            storage: self.storage.to_pb() as i32,
        }
    }
}

impl std::fmt::Display for RemoteSource {
    /// `disk D on HOST:PORT`, as messages name the source.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "disk {} on {}", self.disk, self.endpoint)
    }
}

/// The destination of a live migration to another node (PrepareMigrationSource), as the
/// source node stores it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OutgoingMigration {
    /// The destination node's name (its `--node-name`).
    pub node: String,
    /// The destination disk's id there.
    pub disk: String,
    /// How the contents reach that node.
    pub storage: MigrationStorage,
}

impl OutgoingMigration {
    /// The API value.
    pub fn to_pb(&self) -> pb::OutgoingMigration {
        pb::OutgoingMigration {
            node: self.node.clone(),
            disk: self.disk.clone(),
            storage: self.storage.to_pb() as i32,
        }
    }
}

impl std::fmt::Display for OutgoingMigration {
    /// `disk D on node N`, as messages name the destination.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "disk {} on node {}", self.disk, self.node)
    }
}

/// A disk's configured user, as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunAsSpec {
    /// User id.
    pub uid: u32,
    /// Primary group id.
    pub gid: u32,
    /// Supplementary groups.
    #[serde(default)]
    pub groups: Vec<u32>,
}

impl RunAsSpec {
    /// The frontend's `--run-as` value.
    pub fn to_arg(&self) -> String {
        blkplane_sandbox::RunAs {
            uid: self.uid,
            gid: self.gid,
            groups: self.groups.clone(),
        }
        .to_string()
    }
}

impl DiskSpec {
    /// The API view of this configuration.
    pub fn to_pb(&self) -> pb::DiskConfig {
        pb::DiskConfig {
            id: self.id.clone(),
            settings: Some(self.settings()),
            incoming_for: self.incoming_for.clone().unwrap_or_default(),
            incoming_from: self.incoming_from.as_ref().map(RemoteSource::to_pb),
            // The lifecycle's; see `DiskHandle::config_pb` in the supervisor.
            outgoing: None,
        }
    }

    /// The settings part of [`DiskSpec::to_pb`].
    fn settings(&self) -> pb::DiskSettings {
        pb::DiskSettings {
            image: self.image.to_string_lossy().into_owned(),
            format: self
                .format
                .map_or(pb::ImageFormat::Unspecified, Format::to_pb) as i32,
            read_only: self.read_only,
            serial: self.serial.clone(),
            num_queues: u32::from(self.num_queues),
            queue_size: u32::from(self.queue_size),
            block_size: self.block_size,
            iothreads: u32::from(self.iothreads),
            cache: self.cache.to_pb() as i32,
            iothread_cpus: self.iothread_cpus.clone(),
            vhost_socket: self.vhost_socket.to_string_lossy().into_owned(),
            run_as: self.run_as.as_ref().map(|r| pb::RunAs {
                uid: r.uid,
                gid: r.gid,
                groups: r.groups.clone(),
            }),
            poll_max_us: self.poll_max_us,
        }
    }
}

/// The reason of an operator's migration blocker, as stored (the OPERATOR_* values of the
/// API's MigrationBlockerReason).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OperatorReason {
    /// A backup or snapshot of the image is running.
    Backup,
    /// Maintenance of the node or the storage.
    Maintenance,
    /// Anything else (the message says what).
    Other,
}

/// An operator's migration blocker, persisted with its disk.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OperatorBlocker {
    /// Why.
    pub reason: OperatorReason,
    /// What the operator said.
    pub message: String,
    /// When it was added (or its message last replaced), in ms since the Unix epoch.
    pub since_unix_ms: u64,
}

/// A disk's I/O limits and throttle group (SetThrottle), persisted with the disk as
/// `"throttle": {"limits": {"iops_total": 500}, "group": "g", "member_index": 1}` (fields that
/// are zero or empty are left out; a disk without limits or group has no `throttle` at all).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ThrottleSetting {
    /// QEMU's limits; for a member of a group, the group's (every member carries the same).
    /// All zero: no limits.
    #[serde(default, with = "limits_serde")]
    pub limits: ThrottleLimits,
    /// The throttle group; empty when the disk is throttled alone (or not at all).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub group: String,
    /// The disk's slot among the group's members (its turn in the round robin), below
    /// `blkplane_throttle::MAX_GROUP_MEMBERS` and kept while it stays in the group, so that a
    /// restarted frontend takes the same slot; 0 without a group.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub member_index: u32,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

impl ThrottleSetting {
    /// Whether the disk is not throttled and in no group (the default, not written).
    pub fn is_none(&self) -> bool {
        *self == ThrottleSetting::default()
    }
}

/// What the operator set on a disk besides its configuration; it changes while the disk runs.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiskLifecycle {
    /// The disk is drained (Drain) until Resume; a frontend started for it starts drained.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub drained: bool,
    /// Operator migration blockers, at most one per reason, in the order they were added.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub migration_blockers: Vec<OperatorBlocker>,
    /// I/O limits and throttle group (absent in files written before throttling existed:
    /// not throttled).
    #[serde(default, skip_serializing_if = "ThrottleSetting::is_none")]
    pub throttle: ThrottleSetting,
    /// The live migration to another node the disk is the source of (PrepareMigrationSource),
    /// until it is retired or the migration is cancelled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outgoing: Option<OutgoingMigration>,
}

/// One disk in the state file: its configuration, its lifecycle settings and its frontend
/// restart count, side by side in one JSON object (a file written before the lifecycle
/// existed reads as not drained, not blocked; one written before the count was kept, as 0).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredDisk {
    /// The configuration.
    #[serde(flatten)]
    pub spec: DiskSpec,
    /// Drained, operator blockers.
    #[serde(flatten)]
    pub lifecycle: DiskLifecycle,
    /// How often blkplaned started the disk's frontend again (`Runtime::restarts`), kept so
    /// that the count (and `blkplane_disk_frontend_restarts_total`) survives a restart of
    /// blkplaned. Not the operator's setting, so not in the lifecycle: a failed lifecycle
    /// change, which is undone, must not undo a count.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub frontend_restarts: u32,
}

/// The content of the state file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct State {
    /// Format version ([`STATE_VERSION`]).
    pub version: u32,
    /// The disks, ordered by id.
    pub disks: Vec<StoredDisk>,
}

impl Default for State {
    fn default() -> Self {
        State {
            version: STATE_VERSION,
            disks: Vec::new(),
        }
    }
}

/// The state file of one state directory.
#[derive(Debug, Clone)]
pub struct StateStore {
    dir: PathBuf,
}

impl StateStore {
    /// The store in `dir` (which must exist).
    pub fn new(dir: &Path) -> StateStore {
        StateStore {
            dir: dir.to_path_buf(),
        }
    }

    /// The state file's path.
    pub fn path(&self) -> PathBuf {
        self.dir.join(STATE_FILE)
    }

    /// Whether a state file exists (false on the very first run).
    pub fn exists(&self) -> bool {
        self.path().exists()
    }

    /// Reads the state; a missing file is an empty state.
    pub fn load(&self) -> Result<State, StateError> {
        let path = self.path();
        let text = match std::fs::read(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(State::default()),
            Err(e) => return Err(io("reading", &path)(e)),
        };
        let mut state: State =
            serde_json::from_slice(&text).map_err(|source| StateError::Corrupt {
                path: path.clone(),
                source,
            })?;
        if state.version != STATE_VERSION {
            return Err(StateError::Version {
                path,
                found: state.version,
            });
        }
        state.disks.sort_by(|a, b| a.spec.id.cmp(&b.spec.id));
        Ok(state)
    }

    /// Replaces the state atomically: temp file, fsync, rename, fsync of the directory.
    pub fn save(&self, state: &State) -> Result<(), StateError> {
        let path = self.path();
        let tmp = self.dir.join(format!(".{STATE_FILE}.tmp"));
        let mut json = serde_json::to_vec_pretty(state).map_err(|source| StateError::Corrupt {
            path: path.clone(),
            source,
        })?;
        json.push(b'\n');
        let result = (|| {
            let mut f = OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .open(&tmp)
                .map_err(io("creating", &tmp))?;
            f.write_all(&json).map_err(io("writing", &tmp))?;
            f.sync_all().map_err(io("syncing", &tmp))?;
            drop(f);
            std::fs::rename(&tmp, &path).map_err(io("renaming over", &path))?;
            File::open(&self.dir)
                .and_then(|d| d.sync_all())
                .map_err(io("syncing", &self.dir))
        })();
        if result.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        result
    }
}

/// An exclusive `flock` on a file, held as long as this value lives (and released by the
/// kernel if the process dies, so a SIGKILLed blkplaned never leaves a stale lock).
#[derive(Debug)]
pub struct DirLock {
    _file: File,
}

impl DirLock {
    /// Takes the lock on `DIR/.lock`, failing at once if another process holds it.
    pub fn acquire(dir: &Path) -> Result<DirLock, StateError> {
        let path = dir.join(".lock");
        let file = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(&path)
            .map_err(io("opening", &path))?;
        // SAFETY: plain syscall on an fd we own.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
                return Err(StateError::Locked { path });
            }
            return Err(io("locking", &path)(e));
        }
        Ok(DirLock { _file: file })
    }
}

/// `serde(with)` for [`ThrottleLimits`] in `state.json`: an object of the fields that are not
/// zero, by QEMU's names (`{"iops_total": 500}`); a missing field is zero. An unknown name is
/// an error: limits silently dropped would unthrottle a disk.
pub mod limits_serde {
    use std::collections::BTreeMap;

    use blkplane_proto::v1::ThrottleLimits;
    use serde::de::Error as _;
    use serde::ser::SerializeMap;
    use serde::{Deserialize, Deserializer, Serializer};

    /// Writes the fields that are not zero.
    pub fn serialize<S: Serializer>(limits: &ThrottleLimits, s: S) -> Result<S::Ok, S::Error> {
        let fields = blkplane_api::limits::set_limits(limits);
        let mut map = s.serialize_map(Some(fields.len()))?;
        for (name, value) in fields {
            map.serialize_entry(name, &value)?;
        }
        map.end()
    }

    /// Reads an object of fields.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<ThrottleLimits, D::Error> {
        let map = BTreeMap::<String, u64>::deserialize(d)?;
        let mut limits = ThrottleLimits::default();
        for (name, value) in map {
            let field = blkplane_api::limits::limit_mut(&mut limits, &name)
                .ok_or_else(|| D::Error::custom(format!("unknown throttle limit {name:?}")))?;
            *field = value;
        }
        Ok(limits)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_in_json() {
        #[derive(serde::Serialize, serde::Deserialize, PartialEq, Debug)]
        struct W {
            #[serde(with = "limits_serde")]
            l: ThrottleLimits,
        }
        let w = W {
            l: blkplane_api::limits::named(&[("bps_read", 7), ("iops_size", 4096)]).unwrap(),
        };
        let text = serde_json::to_string(&w).unwrap();
        assert_eq!(text, r#"{"l":{"bps_read":7,"iops_size":4096}}"#);
        assert_eq!(serde_json::from_str::<W>(&text).unwrap(), w);
        assert_eq!(
            serde_json::from_str::<W>(r#"{"l":{}}"#).unwrap().l,
            ThrottleLimits::default()
        );
        assert!(serde_json::from_str::<W>(r#"{"l":{"iops_totl":1}}"#).is_err());
    }

    fn stored(id: &str) -> StoredDisk {
        StoredDisk {
            spec: spec(id),
            lifecycle: DiskLifecycle::default(),
            frontend_restarts: 0,
        }
    }

    fn spec(id: &str) -> DiskSpec {
        DiskSpec {
            id: id.into(),
            image: PathBuf::from(format!("/images/{id}.img")),
            format: Some(Format::Raw),
            read_only: false,
            serial: "s".into(),
            num_queues: 2,
            queue_size: 128,
            block_size: 4096,
            iothreads: 2,
            cache: Cache::Writeback,
            iothread_cpus: "0-1".into(),
            vhost_socket: PathBuf::from(format!("/run/{id}.sock")),
            incoming_for: None,
            incoming_from: None,
            run_as: None,
            poll_max_us: Some(50),
        }
    }

    #[test]
    fn round_trip() {
        let scratch = blkplane_tests::TempDir::new("rt");
        let dir = scratch.path().to_path_buf();
        let store = StateStore::new(&dir);
        assert!(!store.exists());
        assert_eq!(store.load().unwrap(), State::default());
        let state = State {
            version: STATE_VERSION,
            disks: vec![stored("a"), stored("b")],
        };
        store.save(&state).unwrap();
        assert!(store.exists());
        assert_eq!(store.load().unwrap(), state);
        // Replacing leaves no temp file behind and the new content in place.
        let smaller = State {
            version: STATE_VERSION,
            disks: vec![stored("b")],
        };
        store.save(&smaller).unwrap();
        assert_eq!(store.load().unwrap(), smaller);
        let names: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert_eq!(names, vec![STATE_FILE.to_string()]);
    }

    #[test]
    fn old_file_survives_a_failed_write() {
        let scratch = blkplane_tests::TempDir::new("fail");
        let dir = scratch.path().to_path_buf();
        let store = StateStore::new(&dir);
        let state = State {
            version: STATE_VERSION,
            disks: vec![stored("a")],
        };
        store.save(&state).unwrap();
        // A directory where the temp file goes makes the write fail before the rename.
        std::fs::create_dir(dir.join(format!(".{STATE_FILE}.tmp"))).unwrap();
        assert!(store.save(&State::default()).is_err());
        assert_eq!(store.load().unwrap(), state);
    }

    #[test]
    fn lifecycle_is_stored_beside_the_config() {
        let scratch = blkplane_tests::TempDir::new("lifecycle");
        let dir = scratch.path().to_path_buf();
        let store = StateStore::new(&dir);
        let mut a = stored("a");
        a.lifecycle = DiskLifecycle {
            drained: true,
            migration_blockers: vec![OperatorBlocker {
                reason: OperatorReason::Backup,
                message: "nightly".into(),
                since_unix_ms: 5,
            }],
            throttle: ThrottleSetting::default(),
            outgoing: None,
        };
        let state = State {
            version: STATE_VERSION,
            disks: vec![a, stored("b")],
        };
        store.save(&state).unwrap();
        assert_eq!(store.load().unwrap(), state);
        let text = std::fs::read_to_string(store.path()).unwrap();
        assert!(text.contains("\"drained\": true"), "{text}");
        assert!(text.contains("\"reason\": \"backup\""), "{text}");
        // A disk with the defaults writes neither field, and a file without them (written by
        // an older blkplaned) reads as not drained, not blocked.
        assert_eq!(text.matches("drained").count(), 1, "{text}");
        let old = r#"{"version": 1, "disks": [{"id": "x", "image": "/i", "num_queues": 1,
            "queue_size": 256, "block_size": 512, "iothreads": 1, "cache": "direct",
            "vhost_socket": "/s"}]}"#;
        std::fs::write(store.path(), old).unwrap();
        let loaded = store.load().unwrap();
        assert_eq!(loaded.disks[0].lifecycle, DiskLifecycle::default());
        assert_eq!(loaded.disks[0].frontend_restarts, 0);
        assert_eq!(loaded.disks[0].spec.id, "x");
        assert_eq!(loaded.disks[0].spec.incoming_for, None);
        // Written before the format was kept: probed at each start, shown as unspecified.
        assert_eq!(loaded.disks[0].spec.format, None);
        assert_eq!(
            loaded.disks[0].spec.to_pb().settings_or_default().format,
            pb::ImageFormat::Unspecified as i32
        );
    }

    #[test]
    fn format_is_persisted_and_shown() {
        let scratch = blkplane_tests::TempDir::new("format");
        let store = StateStore::new(scratch.path());
        let mut a = stored("a");
        a.spec.format = Some(Format::Qcow2);
        let mut b = stored("b");
        b.spec.format = None;
        let text = saved_text(&store, vec![a.clone(), b.clone(), stored("c")]);
        assert_eq!(text.matches("\"format\": \"qcow2\"").count(), 1, "{text}");
        assert_eq!(text.matches("\"format\": \"raw\"").count(), 1, "{text}");
        // Not kept (an older file's disk): not written either.
        assert_eq!(text.matches("\"format\"").count(), 2, "{text}");
        let shown = |d: &StoredDisk| d.spec.to_pb().settings_or_default().format;
        assert_eq!(shown(&a), pb::ImageFormat::Qcow2 as i32);
        assert_eq!(shown(&b), pb::ImageFormat::Unspecified as i32);
        assert_eq!(Format::Qcow2.as_arg(), "qcow2");
        assert_eq!(Format::Raw.as_arg(), "raw");
    }

    /// Saves `disks`, checks that they load back as saved, and returns the file's text.
    fn saved_text(store: &StateStore, disks: Vec<StoredDisk>) -> String {
        let state = State {
            version: STATE_VERSION,
            disks,
        };
        store.save(&state).unwrap();
        assert_eq!(store.load().unwrap(), state);
        std::fs::read_to_string(store.path()).unwrap()
    }

    #[test]
    fn restart_counts_are_stored() {
        let scratch = blkplane_tests::TempDir::new("restarts");
        let store = StateStore::new(scratch.path());
        let mut a = stored("a");
        a.frontend_restarts = 3;
        let text = saved_text(&store, vec![a, stored("b")]);
        // Written for the disk that has restarts only (an old file without it: see
        // `lifecycle_is_stored_beside_the_config`).
        assert!(text.contains("\"frontend_restarts\": 3"), "{text}");
        assert_eq!(text.matches("frontend_restarts").count(), 1, "{text}");
    }

    #[test]
    fn incoming_for_is_persisted_and_shown() {
        let scratch = blkplane_tests::TempDir::new("incoming");
        let dir = scratch.path().to_path_buf();
        let store = StateStore::new(&dir);
        let mut b = stored("b");
        b.spec.incoming_for = Some("a".into());
        let state = State {
            version: STATE_VERSION,
            disks: vec![stored("a"), b],
        };
        store.save(&state).unwrap();
        assert_eq!(store.load().unwrap(), state);
        let text = std::fs::read_to_string(store.path()).unwrap();
        // Written for the incoming disk only; a file without it reads as not incoming.
        assert_eq!(text.matches("\"incoming_for\": \"a\"").count(), 1, "{text}");
        assert_eq!(text.matches("incoming_for").count(), 1, "{text}");
        assert_eq!(state.disks[1].spec.to_pb().incoming_for, "a");
        assert_eq!(state.disks[0].spec.to_pb().incoming_for, "");
    }

    #[test]
    fn a_migration_across_nodes_is_persisted_and_shown() {
        let scratch = blkplane_tests::TempDir::new("across");
        let dir = scratch.path().to_path_buf();
        let store = StateStore::new(&dir);
        let mut a = stored("a");
        a.lifecycle.outgoing = Some(OutgoingMigration {
            node: "node-b".into(),
            disk: "b".into(),
            storage: MigrationStorage::Shared,
        });
        let mut b = stored("b");
        b.spec.incoming_from = Some(RemoteSource {
            endpoint: "node-a.example:7070".into(),
            disk: "a".into(),
            storage: MigrationStorage::Shared,
            as_node: "node-b".into(),
            image_incomplete: false,
        });
        let state = State {
            version: STATE_VERSION,
            disks: vec![a, b, stored("c")],
        };
        store.save(&state).unwrap();
        assert_eq!(store.load().unwrap(), state);
        let text = std::fs::read_to_string(store.path()).unwrap();
        // Written only where set; files without them read as no migration.
        assert_eq!(text.matches("\"outgoing\"").count(), 1, "{text}");
        assert_eq!(text.matches("\"incoming_from\"").count(), 1, "{text}");
        assert_eq!(text.matches("\"storage\": \"shared\"").count(), 2, "{text}");
        let b = state.disks[1].spec.to_pb();
        let from = b.incoming_from.unwrap();
        assert_eq!(from.endpoint, "node-a.example:7070");
        assert_eq!(from.storage, pb::MigrationStorage::Shared as i32);
        assert_eq!(state.disks[2].spec.to_pb().incoming_from, None);
        assert_eq!(
            MigrationStorage::from_pb(pb::MigrationStorage::Local as i32),
            Some(MigrationStorage::Local)
        );
        assert_eq!(MigrationStorage::from_pb(0), None);
        assert_eq!(MigrationStorage::from_pb(99), None);
    }

    #[test]
    fn run_as_is_persisted_and_shown() {
        let scratch = blkplane_tests::TempDir::new("run-as");
        let dir = scratch.path().to_path_buf();
        let store = StateStore::new(&dir);
        let mut b = stored("b");
        b.spec.run_as = Some(RunAsSpec {
            uid: 107,
            gid: 107,
            groups: vec![36],
        });
        let state = State {
            version: STATE_VERSION,
            disks: vec![stored("a"), b],
        };
        store.save(&state).unwrap();
        assert_eq!(store.load().unwrap(), state);
        let text = std::fs::read_to_string(store.path()).unwrap();
        // Written for that disk only; a file without it reads as blkplaned's user.
        assert_eq!(text.matches("run_as").count(), 1, "{text}");
        let shown = state.disks[1]
            .spec
            .to_pb()
            .settings_or_default()
            .run_as
            .unwrap();
        assert_eq!((shown.uid, shown.gid, shown.groups), (107, 107, vec![36]));
        assert_eq!(
            state.disks[0].spec.to_pb().settings_or_default().run_as,
            None
        );
    }

    #[test]
    fn throttle_is_stored_with_the_disk() {
        let scratch = blkplane_tests::TempDir::new("throttle");
        let dir = scratch.path().to_path_buf();
        let store = StateStore::new(&dir);
        let mut a = stored("a");
        a.lifecycle.throttle = ThrottleSetting {
            limits: blkplane_api::limits::named(&[("iops_total", 500), ("bps_read", 1 << 20)])
                .unwrap(),
            group: "g".into(),
            member_index: 3,
        };
        let mut b = stored("b");
        b.lifecycle.throttle.group = "g".into();
        let state = State {
            version: STATE_VERSION,
            disks: vec![a, b, stored("c")],
        };
        store.save(&state).unwrap();
        assert_eq!(store.load().unwrap(), state);
        let text = std::fs::read_to_string(store.path()).unwrap();
        assert!(text.contains("\"iops_total\": 500"), "{text}");
        assert!(text.contains("\"member_index\": 3"), "{text}");
        // Zeros are left out: b (a group without limits, index 0) writes only its group, c
        // (no setting) nothing at all.
        assert_eq!(text.matches("\"throttle\"").count(), 2, "{text}");
        assert_eq!(text.matches("member_index").count(), 1, "{text}");
        assert_eq!(text.matches("\"limits\": {}").count(), 1, "{text}");
        // An unknown limit name is refused rather than dropped (the disk would run
        // unthrottled).
        let bad = text.replace("iops_total", "iops_totl");
        std::fs::write(store.path(), bad).unwrap();
        assert!(matches!(store.load(), Err(StateError::Corrupt { .. })));
    }

    #[test]
    fn corrupt_and_future_files() {
        let scratch = blkplane_tests::TempDir::new("corrupt");
        let dir = scratch.path().to_path_buf();
        let store = StateStore::new(&dir);
        std::fs::write(store.path(), b"{\"version\": 1, \"disks\": [").unwrap();
        assert!(matches!(store.load(), Err(StateError::Corrupt { .. })));
        std::fs::write(store.path(), b"{\"version\": 9, \"disks\": []}").unwrap();
        assert!(matches!(
            store.load(),
            Err(StateError::Version { found: 9, .. })
        ));
    }

    #[test]
    fn lock_is_exclusive() {
        let scratch = blkplane_tests::TempDir::new("lock");
        let dir = scratch.path().to_path_buf();
        let first = DirLock::acquire(&dir).unwrap();
        // flock locks belong to the open file description, so a second open in the same
        // process conflicts just like another process would.
        assert!(matches!(
            DirLock::acquire(&dir),
            Err(StateError::Locked { .. })
        ));
        drop(first);
        DirLock::acquire(&dir).unwrap();
    }
}
