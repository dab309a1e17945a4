//! The disk table and the operations on it, below the gRPC layer: adding (validate, start,
//! persist), removing (check, persist, stop), reading, resizing, statistics, draining and
//! resuming. Its child modules hold the rest of the daemon's jobs: [`blockers`] (migration
//! blockers), [`startup`] (directories, locks, orphan sweep, adoption), [`takeover`] (the
//! takeover of an incoming disk from its live-migration source), [`remote`] (an incoming disk
//! whose source is on another node: asking that node), [`outgoing`] (the source side of a
//! migration to another node) and [`limits`] (I/O limits and throttle groups).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use blkplane_proto::v1::ResizeDone;
use log::{info, warn};
use thiserror::Error;

use crate::admin::{self, AdminError};
use crate::disk_log::DiskLogLimit;
use crate::events::EventBus;
use crate::frontend;
use crate::migration::{self};
use crate::paths::DiskPaths;
use crate::pb::{self, AddDiskRequest, DiskState, DiskStatistics, EventKind};
use crate::peer::{PeerError, Peers};
use crate::runtime::serving;
use crate::settings::{RestartPolicy, Settings};
use crate::state::{
    DirLock, DiskLifecycle, DiskSpec, MigrationStorage, RemoteSource, RunAsSpec, State, StateError,
    StateStore, StoredDisk,
};
use crate::supervisor::{DiskHandle, Initial};
use crate::sync::lock;
use crate::throttle;
use crate::validate::{self, ValidationError};
use blkplane_api::names::state_name;

mod blockers;
mod commit;
mod copy;
mod limits;
mod outgoing;
mod receive;
mod remote;
mod snapshot;
mod startup;
mod takeover;
/// How blkplaned is set up.
#[derive(Debug, Clone)]
pub struct Config {
    /// Where the desired state is persisted.
    pub state_dir: PathBuf,
    /// Where sockets, pid files and logs live.
    pub runtime_dir: PathBuf,
    /// The `blkplane-frontend` binary.
    pub frontend_binary: PathBuf,
    /// If not empty, vhost-user sockets must be inside these directories (or the runtime
    /// directory's `disks/`).
    pub socket_dirs: Vec<PathBuf>,
    /// If not empty, images must be inside these directories.
    pub image_dirs: Vec<PathBuf>,
    /// The user a disk added without `run_as` runs as; `None`: blkplaned's own.
    pub disk_user: Option<RunAsSpec>,
    /// When a crashing frontend is given up.
    pub policy: RestartPolicy,
    /// How long a frontend may take to serve.
    pub start_timeout: Duration,
    /// How often running frontends are polled for VMM connects and disconnects.
    pub poll_interval: Duration,
    /// The size cap of each disk's log, checked at every poll.
    pub disk_log: DiskLogLimit,
    /// This node's name, as other nodes' blkplaned record it as a migration's destination.
    pub node_name: String,
    /// How other nodes' blkplaned are reached (live migration across nodes).
    pub peers: Peers,
}

/// Failed operations. Each maps to one gRPC status code (see `service.rs`).
#[derive(Debug, Error)]
pub enum DaemonError {
    /// Bad input.
    #[error(transparent)]
    Validation(#[from] ValidationError),
    /// No disk with that id.
    #[error("id: no disk named {0:?}")]
    NotFound(String),
    /// RemoveDisk without force while a VMM is connected.
    #[error("disk {0}: a VMM is connected; disconnect it first or remove with force")]
    VmmConnected(String),
    /// The disk's frontend is not running (failed, restarting or starting).
    #[error("disk {id}: the frontend is not running (state {state}{})", if .reason.is_empty() { String::new() } else { format!(": {}", .reason) })]
    NotRunning {
        /// The disk.
        id: String,
        /// Its state.
        state: &'static str,
        /// Why.
        reason: String,
    },
    /// ResizeDisk of a drained disk (growing the image would touch it).
    #[error("disk {0} is drained: nothing may touch its image until Resume")]
    Drained(String),
    /// ResizeDisk of either disk of a live migration under way: the other frontend, on the
    /// same image, would keep the old capacity.
    #[error("disk {id}: a live migration is under way (disk {destination} is incoming for disk {origin}); resize once disk {destination} has taken over, or after removing it")]
    Migrating {
        /// The disk asked for.
        id: String,
        /// The migration's source disk (not named `source`, which thiserror takes for the
        /// underlying error).
        origin: String,
        /// Its incoming disk.
        destination: String,
    },
    /// ResizeDisk or Snapshot of a disk in a live migration across nodes: the other node's
    /// frontend, on the same image, would keep the old capacity or image.
    #[error("disk {id}: a live migration across nodes is under way ({what}); try again once it has finished or is cancelled")]
    MigratingAcross {
        /// The disk asked for.
        id: String,
        /// Which migration, for people.
        what: String,
    },
    /// Another node's blkplaned, which a migration across nodes needs, could not be asked or
    /// refused.
    #[error("{field}: {source}")]
    Peer {
        /// The request field that named the other node.
        field: &'static str,
        /// What failed.
        source: PeerError,
    },
    /// RemoveMigrationBlocker of a reason the disk has no operator blocker for.
    #[error("reason: disk {id} has no {reason} blocker")]
    NoSuchBlocker {
        /// The disk.
        id: String,
        /// The reason's name.
        reason: &'static str,
    },
    /// ResizeDisk to a smaller size.
    #[error("new_size_bytes: {requested} is smaller than the current capacity {current} of disk {id}; shrinking is refused")]
    Shrink {
        /// The disk.
        id: String,
        /// Its capacity now.
        current: u64,
        /// The requested size.
        requested: u64,
    },
    /// The frontend refused a request.
    #[error("disk {id}: the frontend refused: {reason}")]
    Refused {
        /// The disk.
        id: String,
        /// The frontend's reason.
        reason: String,
    },
    /// The frontend's admin channel failed.
    #[error("disk {id}: {source}")]
    Admin {
        /// The disk.
        id: String,
        /// What failed.
        source: AdminError,
    },
    /// The frontend could not be started.
    #[error("disk {id}: {source}")]
    Start {
        /// The disk.
        id: String,
        /// What failed.
        source: frontend::StartError,
    },
    /// A Commit, Snapshot, ResizeDisk, RemoveDisk or migration of a disk whose commit runs.
    #[error("disk {0}: a commit of its image runs; try again once it has finished")]
    Committing(String),
    /// Commit of a disk that cannot be committed.
    #[error("id: disk {id} cannot be committed: {reason}")]
    CannotCommit {
        /// The disk.
        id: String,
        /// Why.
        reason: String,
    },
    /// A commit failed once under way; the reason says which image the disk serves now.
    #[error("disk {id}: the commit failed: {reason}")]
    CommitFailed {
        /// The disk.
        id: String,
        /// What failed, and where the disk is.
        reason: String,
    },
    /// The state could not be read or written.
    #[error(transparent)]
    State(#[from] StateError),
    /// A directory could not be created or resolved.
    #[error("{what} {}: {source}", path.display())]
    Io {
        /// What was being done.
        what: &'static str,
        /// The path.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
}

/// The running control plane.
#[derive(Debug)]
pub struct Daemon {
    settings: Arc<Settings>,
    store: StateStore,
    events: EventBus,
    ctx: validate::Context,
    state_dir: PathBuf,
    runtime_dir: PathBuf,
    disks: Mutex<BTreeMap<String, Arc<DiskHandle>>>,
    /// Serializes AddDisk and RemoveDisk: each checks the table, changes processes and
    /// persists the state, and must not interleave with another.
    ops: tokio::sync::Mutex<()>,
    /// Set once every disk of the state loaded at start-up has been adopted or started (or
    /// its first start has failed): see [`Daemon::startup_done`].
    startup_done: AtomicBool,
    /// This node's name (`--node-name`).
    node_name: String,
    /// Other nodes' blkplaned.
    peers: Peers,
    /// Ids of removed incoming disks whose source node is still being told (RemoveDisk):
    /// AddDisk refuses them meanwhile.
    cancelling: Mutex<std::collections::BTreeSet<String>>,
    /// Copies of disks to other nodes (StartMigration), by source disk id.
    copies: Mutex<BTreeMap<String, copy::CopyJob>>,
    /// Incoming disks receiving a copy now (ReceiveMigrationData).
    receiving: Mutex<std::collections::BTreeSet<String>>,
    /// Disks whose commit runs (Commit).
    commits: commit::Commits,
    _locks: [DirLock; 2],
}

impl Daemon {
    /// The state directory (canonical).
    pub fn state_dir(&self) -> &Path {
        &self.state_dir
    }

    /// The runtime directory (canonical).
    pub fn runtime_dir(&self) -> &Path {
        &self.runtime_dir
    }

    /// The event bus.
    pub fn events(&self) -> &EventBus {
        &self.events
    }

    /// Every disk of the table, ordered by id (for the metrics endpoint, which reads their
    /// runtime state and asks their frontends itself).
    pub fn disks(&self) -> Vec<Arc<DiskHandle>> {
        lock(&self.disks).values().cloned().collect()
    }

    /// The desired state as it is in the table.
    fn state_from(disks: &BTreeMap<String, Arc<DiskHandle>>) -> State {
        State {
            disks: disks
                .values()
                .map(|d| {
                    let rt = d.runtime();
                    StoredDisk {
                        spec: d.config(),
                        lifecycle: rt.lifecycle,
                        frontend_restarts: rt.restarts,
                    }
                })
                .collect(),
            ..State::default()
        }
    }

    /// Writes the desired state as the table has it now. Callers hold `ops`, so that two
    /// writes never interleave.
    fn persist(&self) -> Result<(), DaemonError> {
        let state = Self::state_from(&lock(&self.disks));
        self.store.save(&state).map_err(DaemonError::from)
    }

    /// Changes a disk's lifecycle and persists it; on a failed write the change is undone.
    async fn change_lifecycle(
        &self,
        disk: &DiskHandle,
        change: impl FnOnce(&mut DiskLifecycle),
    ) -> Result<(), DaemonError> {
        let _ops = self.ops.lock().await;
        self.change_lifecycle_held(disk, change)
    }

    /// [`Daemon::change_lifecycle`] for a caller that holds `ops` already.
    fn change_lifecycle_held(
        &self,
        disk: &DiskHandle,
        change: impl FnOnce(&mut DiskLifecycle),
    ) -> Result<(), DaemonError> {
        let old = disk.runtime().lifecycle;
        disk.update(|rt| change(&mut rt.lifecycle));
        if let Err(e) = self.persist() {
            disk.update(|rt| rt.lifecycle = old);
            return Err(e);
        }
        Ok(())
    }

    /// Disk `id`'s handle with its lifecycle lock held: the table's handle once the lock is
    /// held (a Snapshot's or a Commit's switch replaces it while one waits, holding the old
    /// one's lock).
    async fn lock_lifecycle(
        &self,
        id: &str,
    ) -> Result<(Arc<DiskHandle>, tokio::sync::OwnedMutexGuard<()>), DaemonError> {
        loop {
            let disk = self.get_handle(id)?;
            let op = Arc::clone(&disk.lifecycle_op).lock_owned().await;
            if self.still_in_table(id, &disk).is_ok() {
                return Ok((disk, op));
            }
        }
    }

    fn get_handle(&self, id: &str) -> Result<Arc<DiskHandle>, DaemonError> {
        lock(&self.disks)
            .get(id)
            .cloned()
            .ok_or_else(|| DaemonError::NotFound(id.to_string()))
    }

    /// Checks an AddDisk request against the other disks.
    fn check_conflicts(
        &self,
        spec: &DiskSpec,
        identity: validate::ImageIdentity,
    ) -> Result<(), ValidationError> {
        // A running commit writes its image's backing file and then drops its image from the
        // chain: neither may join another disk meanwhile. (Before the table's lock: this reads
        // files.)
        let files = std::iter::once(spec.image.clone()).chain(
            backing_chain(spec, &self.ctx.image_dirs)
                .into_iter()
                .map(PathBuf::from),
        );
        for file in files {
            let committing = validate::image_identity(&file).and_then(|i| self.commits.holding(i));
            if let Some(other) = committing {
                return Err(ValidationError::FailedPrecondition {
                    field: "settings.image",
                    reason: format!(
                        "{} is written by the commit of disk {other} now; add the disk once \
                         that has finished",
                        file.display()
                    ),
                });
            }
        }
        let disks = lock(&self.disks);
        if disks.contains_key(&spec.id) {
            return Err(ValidationError::AlreadyExists {
                field: "id",
                reason: format!("a disk named {:?} exists", spec.id),
            });
        }
        // blkplaned's own files are no disk images (a guest could rewrite the state).
        for own in [self.store.path(), self.state_dir.join(".lock")] {
            if validate::image_identity(&own) == Some(identity) {
                return Err(ValidationError::Invalid {
                    field: "settings.image",
                    reason: format!("{} is blkplaned's own file", spec.image.display()),
                });
            }
        }
        let own = DiskPaths::new(&self.settings.disks_dir, spec);
        for reserved in own.own_files() {
            if spec.vhost_socket == reserved {
                return Err(ValidationError::Invalid {
                    field: "settings.vhost_socket",
                    reason: format!("{} is reserved for blkplaned's own use", reserved.display()),
                });
            }
        }
        for other in disks.values() {
            // This disk's own files must not be another disk's (custom) vhost-user socket.
            if let Some(f) = own
                .own_files()
                .into_iter()
                .find(|f| *f == other.spec.vhost_socket)
            {
                return Err(ValidationError::AlreadyExists {
                    field: "id",
                    reason: format!(
                        "disk {:?} would need {}, the vhost-user socket of disk {}",
                        spec.id,
                        f.display(),
                        other.spec.id
                    ),
                });
            }
            // The one disk that may share the image: the source this one migrates from
            // (validate::resolve_incoming made sure it is the source's image).
            let is_source = spec.incoming_for.as_deref() == Some(other.spec.id.as_str());
            if !is_source && validate::image_identity(&other.spec.image) == Some(identity) {
                return Err(ValidationError::AlreadyExists {
                    field: "settings.image",
                    reason: format!(
                        "{} is already served by disk {}",
                        spec.image.display(),
                        other.spec.id
                    ),
                });
            }
            if spec.vhost_socket == other.spec.vhost_socket
                || other
                    .paths
                    .own_files()
                    .contains(&spec.vhost_socket.as_path())
            {
                return Err(ValidationError::AlreadyExists {
                    field: "settings.vhost_socket",
                    reason: format!(
                        "{} is already used by disk {}",
                        spec.vhost_socket.display(),
                        other.spec.id
                    ),
                });
            }
        }
        Ok(())
    }

    /// The request with the values of its migration source filled in, after checking
    /// `incoming_for` against the disk table (see [`validate::resolve_incoming`]).
    fn resolve_incoming(&self, req: &AddDiskRequest) -> Result<AddDiskRequest, ValidationError> {
        if req.incoming_for.is_empty() {
            return Ok(req.clone());
        }
        let source = lock(&self.disks).get(&req.incoming_for).map(|d| {
            let blockers: Vec<String> =
                migration::blockers(&d.runtime(), blkplane_api::time::unix_time_ms())
                    .iter()
                    .map(migration::Blocker::line)
                    .collect();
            (d.config(), blockers)
        });
        if self.commits.running(&req.incoming_for) {
            return Err(ValidationError::FailedPrecondition {
                field: "incoming_for",
                reason: format!(
                    "a commit of disk {}'s image runs; migrate it once that has finished",
                    req.incoming_for
                ),
            });
        }
        // A source migrating to another node has its destination already.
        if let Some(outgoing) = lock(&self.disks)
            .get(&req.incoming_for)
            .and_then(|d| d.runtime().lifecycle.outgoing)
        {
            return Err(ValidationError::FailedPrecondition {
                field: "incoming_for",
                reason: format!(
                    "disk {} is being migrated to {outgoing}; cancel that first",
                    req.incoming_for
                ),
            });
        }
        let incoming = self
            .migration_of_id(&req.incoming_for)
            .map(|(_, destination)| destination);
        validate::resolve_incoming(
            req,
            source
                .as_ref()
                .map(|(spec, blockers)| validate::MigrationSource {
                    spec,
                    incoming: incoming.as_deref(),
                    blockers,
                }),
        )
    }

    /// AddDisk: validate, start the frontend and wait until it serves, persist, supervise.
    /// On any failure nothing is left: no process, no socket, no state entry, no log.
    pub async fn add_disk(&self, req: AddDiskRequest) -> Result<pb::Disk, DaemonError> {
        let _ops = self.ops.lock().await;
        // The id first: a taken id is the answer whatever else is wrong with the request.
        validate::check_id(&req.id)?;
        if lock(&self.disks).contains_key(&req.id) {
            return Err(ValidationError::AlreadyExists {
                field: "id",
                reason: format!("a disk named {:?} exists", req.id),
            }
            .into());
        }
        if lock(&self.cancelling).contains(&req.id) {
            return Err(ValidationError::AlreadyExists {
                field: "id",
                reason: format!(
                    "disk {:?} was just removed, and the node of its migration's source is \
                     still being told; try again",
                    req.id
                ),
            }
            .into());
        }
        // The takeover retires the disk by this name: a new disk must not get it.
        if let Some((source, destination)) = self.migration_of_id(&req.id) {
            return Err(ValidationError::AlreadyExists {
                field: "id",
                reason: format!(
                    "disk {destination} is the incoming destination of a migration of a disk \
                     named {source:?} (removed since); the name stays reserved until \
                     {destination} has taken over or is removed"
                ),
            }
            .into());
        }
        let Some((from, endpoint)) = validate::check_incoming_from(&req, &self.node_name)? else {
            let req = self.resolve_incoming(&req)?;
            return self.add_checked(req, None).await;
        };
        // The source node agrees (and records the migration) first; anything that fails
        // after that is undone there too.
        let source = self
            .prepare_remote_source(&req.id, &from, &endpoint)
            .await?;
        let added = match validate::resolve_remote_incoming(&req, &from, &source) {
            Ok(req) if from.storage == MigrationStorage::Local => {
                self.add_local_destination(req, &source).await
            }
            Ok(req) => self.add_checked(req, Some(&source)).await,
            Err(e) => Err(e.into()),
        };
        if added.is_err() {
            self.cancel_remote_source(&req.id, &from, &endpoint).await;
        }
        added
    }

    /// AddDisk of the destination of a copy from another node: its new image is created
    /// (sparse, the source's capacity) and the disk added on it, serving nothing until the
    /// copy completes; a failed add removes the image again.
    async fn add_local_destination(
        &self,
        req: AddDiskRequest,
        source: &pb::Disk,
    ) -> Result<pb::Disk, DaemonError> {
        let image = validate::disk::check_new_image(
            "settings.image",
            req.settings.as_ref().map_or("", |s| s.image.as_str()),
            &self.ctx.image_dirs,
        )?;
        crate::mirror::image::create_destination(&image, source.capacity_bytes).map_err(|e| {
            let reason = format!(
                "{}: cannot create the new image of a copy from another node: {e}",
                image.display()
            );
            if e.kind() == std::io::ErrorKind::AlreadyExists {
                DaemonError::from(ValidationError::AlreadyExists {
                    field: "settings.image",
                    reason,
                })
            } else {
                ValidationError::Invalid {
                    field: "settings.image",
                    reason,
                }
                .into()
            }
        })?;
        let added = self.add_checked(req, Some(source)).await;
        if added.is_err() {
            if let Err(e) = std::fs::remove_file(&image) {
                warn!("{}: removing the new image again: {e}", image.display());
            }
        }
        added
    }

    /// The rest of AddDisk, for a request whose migration source (if any) was resolved:
    /// check it, start the frontend, persist, supervise. `remote_source` is the source on
    /// another node, as that node described it, for the capacity check.
    async fn add_checked(
        &self,
        req: AddDiskRequest,
        remote_source: Option<&pb::Disk>,
    ) -> Result<pb::Disk, DaemonError> {
        let (spec, identity) = validate::check_add(&req, &self.ctx)?;
        self.check_conflicts(&spec, identity)?;
        let throttle_setting = self.incoming_throttle(&spec)?;
        let lifecycle = DiskLifecycle {
            throttle: throttle_setting.clone(),
            ..DiskLifecycle::default()
        };
        let paths = DiskPaths::new(&self.settings.disks_dir, &spec);
        // A frontend left over from an earlier disk of this id would answer on the admin
        // socket in place of the new one.
        for pid in frontend::kill_strays(&paths).await {
            warn!("disk {}: killed a stray frontend {pid}", spec.id);
        }
        let throttle_request =
            throttle::frontend_request(&throttle_setting, &self.settings.throttle_dir);
        // The destination of a copy from another node serves nothing before its image is
        // complete.
        let incomplete = RemoteSource::awaits_image(spec.incoming_from.as_ref());
        let started =
            frontend::start_throttled(&self.settings, &spec, &paths, incomplete, &throttle_request)
                .await;
        let started = match started {
            Ok(started) => started,
            Err(source) => {
                frontend::remove_files(&paths);
                return Err(DaemonError::Start {
                    id: spec.id.clone(),
                    source,
                });
            }
        };
        // Shared storage: the image this node names must be the source's. The capacity the
        // frontend found is what the guest would see.
        if let Some(source) = remote_source {
            let here = started.status.capacity_bytes;
            if here != source.capacity_bytes {
                started.frontend.stop(Duration::from_secs(5)).await;
                frontend::remove_files(&paths);
                return Err(ValidationError::Invalid {
                    field: "settings.image",
                    reason: format!(
                        "{} holds {here} bytes here, but the migration source has {} bytes: \
                         not the same image (an incoming disk on shared storage serves the \
                         source's image, as this node names it)",
                        spec.image.display(),
                        source.capacity_bytes
                    ),
                }
                .into());
            }
        }
        let mut state = Self::state_from(&lock(&self.disks));
        state.disks.push(StoredDisk {
            spec: spec.clone(),
            lifecycle: lifecycle.clone(),
            frontend_restarts: 0,
        });
        state.disks.sort_by(|a, b| a.spec.id.cmp(&b.spec.id));
        if let Err(e) = self.store.save(&state) {
            warn!(
                "disk {}: persisting failed, stopping it again: {e}",
                spec.id
            );
            started.frontend.stop(Duration::from_secs(5)).await;
            frontend::remove_files(&paths);
            return Err(e.into());
        }
        let pid = started.frontend.pid();
        let handle = DiskHandle::spawn(
            spec.clone(),
            lifecycle,
            0,
            Arc::clone(&self.settings),
            self.events.clone(),
            Initial::Running(Box::new(started)),
        );
        lock(&self.disks).insert(spec.id.clone(), Arc::clone(&handle));
        self.events.emit(
            EventKind::Added,
            &spec.id,
            pid,
            match (&spec.incoming_for, &spec.incoming_from) {
                (Some(source), _) => format!(
                    "serving on {}; incoming live-migration destination of disk {source}",
                    spec.vhost_socket.display()
                ),
                (None, Some(from)) => format!(
                    "serving on {}; incoming live-migration destination of {from} ({})",
                    spec.vhost_socket.display(),
                    from.storage.name()
                ),
                (None, None) => format!("serving on {}", spec.vhost_socket.display()),
            },
        );
        Ok(self.disk_info(&handle, false).await)
    }

    /// RemoveDisk: refuse while a VMM is connected unless `force`; persist; stop; clean up.
    pub async fn remove_disk(&self, id: &str, force: bool) -> Result<(), DaemonError> {
        let _ops = self.ops.lock().await;
        let disk = self.get_handle(id)?;
        self.refuse_while_committing(id)?;
        if !force {
            let rt = disk.runtime();
            let connected = if rt.pid != 0 {
                match admin::status(&disk.paths.admin_socket).await {
                    Ok(s) => s.vmm_connected,
                    // Cannot ask: trust the last poll.
                    Err(_) => rt.status.is_some_and(|s| s.vmm_connected),
                }
            } else {
                false
            };
            if connected {
                return Err(DaemonError::VmmConnected(id.to_string()));
            }
        }
        let incoming_from = disk.runtime().incoming_from;
        self.forget_and_stop(id, &disk, String::new()).await?;
        // A copy from another node that never completed: its image is a part of one.
        if let Some(from) = incoming_from.as_ref().filter(|f| f.image_incomplete) {
            match std::fs::remove_file(&disk.spec.image) {
                Ok(()) => info!(
                    "disk {id}: removed {}, the incomplete copy from {from}",
                    disk.spec.image.display()
                ),
                Err(e) => warn!(
                    "disk {id}: removing {}, the incomplete copy from {from}: {e}",
                    disk.spec.image.display()
                ),
            }
        }
        // An incoming disk from another node: that node's source forgets the migration (asked
        // without `ops`: a slow node holds up no other call here). Until it has been told,
        // the id is not given to a new disk, whose migration from the same source the late
        // cancel would otherwise erase there.
        let Some(from) = incoming_from else {
            return Ok(());
        };
        lock(&self.cancelling).insert(id.to_string());
        drop(_ops);
        self.cancel_incoming_from(id, &from).await;
        lock(&self.cancelling).remove(id);
        Ok(())
    }

    /// Removes disk `id` from the table and the persisted state, stops its processes, and
    /// emits REMOVED with `message`. Callers hold `ops`.
    async fn forget_and_stop(
        &self,
        id: &str,
        disk: &DiskHandle,
        message: String,
    ) -> Result<(), DaemonError> {
        // Persist first: once the call returns the disk must not come back, even if blkplaned
        // dies while stopping it (a restart then sweeps what is left as an orphan).
        let mut state = Self::state_from(&lock(&self.disks));
        state.disks.retain(|d| d.spec.id != id);
        self.store.save(&state)?;
        lock(&self.disks).remove(id);
        self.stop_copy(id);
        lock(&self.copies).remove(id);
        let pid = disk.runtime().pid;
        disk.stop().await;
        self.drop_group_if_empty(&disk.runtime().lifecycle.throttle.group);
        self.events.emit(EventKind::Removed, id, pid, message);
        Ok(())
    }

    /// The API view of a disk; with `fresh`, the frontend is asked for its status now rather
    /// than reporting the last poll.
    async fn disk_info(&self, disk: &DiskHandle, fresh: bool) -> pb::Disk {
        let mut rt = disk.runtime();
        if fresh && rt.pid != 0 && serving(rt.state) {
            match admin::status(&disk.paths.admin_socket).await {
                Ok(s) => {
                    disk.record_status(&s);
                    rt = disk.runtime();
                }
                Err(e) => rt.reason = format!("status unavailable: {e}"),
            }
        }
        let blockers = disk.refresh_migration();
        let s = rt.status.unwrap_or_default();
        pb::Disk {
            config: Some(disk.config_pb()),
            state: rt.state as i32,
            state_reason: rt.reason,
            vmm_connected: rt.pid != 0 && s.vmm_connected,
            frontend_pid: rt.pid,
            iothread_pids: s.iothread_pids,
            restarts: rt.restarts,
            iothread_restarts: s.iothread_restarts,
            acked_features: s.acked_features,
            acked_protocol_features: s.acked_protocol_features,
            capacity_bytes: s.capacity_bytes,
            log_path: disk.paths.log_file.to_string_lossy().into_owned(),
            queues: s.queues,
            drained: rt.lifecycle.drained,
            migratable: blockers.is_empty(),
            migration_blockers: blockers,
            throttle: Some(self.throttle_config(disk)),
            backing_chain: backing_chain(&disk.config(), &self.ctx.image_dirs),
            migration_copy: self.copy_progress(&disk.spec.id),
        }
    }

    /// GetDisk.
    pub async fn get_disk(&self, id: &str) -> Result<pb::Disk, DaemonError> {
        let disk = self.get_handle(id)?;
        Ok(self.disk_info(&disk, true).await)
    }

    /// ListDisks, ordered by id.
    pub async fn list_disks(&self) -> Vec<pb::Disk> {
        let disks: Vec<Arc<DiskHandle>> = lock(&self.disks).values().cloned().collect();
        let mut out = Vec::with_capacity(disks.len());
        for d in disks {
            out.push(self.disk_info(&d, true).await);
        }
        out
    }

    /// The disk's admin socket if its frontend is running, else why not.
    fn running(&self, disk: &DiskHandle) -> Result<(), DaemonError> {
        let rt = disk.runtime();
        if rt.pid == 0 || !serving(rt.state) {
            return Err(DaemonError::NotRunning {
                id: disk.spec.id.clone(),
                state: state_name(rt.state),
                reason: rt.reason,
            });
        }
        Ok(())
    }

    /// ResizeDisk: grow only, in whole blocks; the frontend grows the image and tells the guest.
    pub async fn resize_disk(&self, id: &str, new_size: u64) -> Result<ResizeDone, DaemonError> {
        // The disk's lifecycle, as Snapshot and Commit take it: neither reads the capacity
        // while a grow is under way.
        let (handle, _op) = self.lock_lifecycle(id).await?;
        let disk = &handle;
        validate::check_new_size(new_size, disk.spec.block_size)?;
        self.running(disk)?;
        if disk.runtime().lifecycle.drained {
            return Err(DaemonError::Drained(id.to_string()));
        }
        if let Some((origin, destination)) = self.migration_of(disk) {
            return Err(DaemonError::Migrating {
                id: id.to_string(),
                origin,
                destination,
            });
        }
        self.refuse_while_outgoing(id, disk)?;
        self.refuse_while_committing(id)?;
        let admin_err = |source| DaemonError::Admin {
            id: id.to_string(),
            source,
        };
        let status = admin::status(&disk.paths.admin_socket)
            .await
            .map_err(admin_err)?;
        if new_size < status.capacity_bytes {
            return Err(DaemonError::Shrink {
                id: id.to_string(),
                current: status.capacity_bytes,
                requested: new_size,
            });
        }
        let done = admin::resize(&disk.paths.admin_socket, new_size)
            .await
            .map_err(|e| match e {
                AdminError::Refused(reason) => DaemonError::Refused {
                    id: id.to_string(),
                    reason,
                },
                other => admin_err(other),
            })?;
        self.events.emit(
            EventKind::Resized,
            id,
            disk.runtime().pid,
            format!(
                "capacity {} bytes; guest notified: {}",
                done.capacity_bytes, done.guest_notified
            ),
        );
        Ok(done)
    }

    /// GetStats of one disk, or (empty id) of every running disk.
    pub async fn get_stats(&self, id: &str) -> Result<Vec<DiskStatistics>, DaemonError> {
        let disks: Vec<Arc<DiskHandle>> = if id.is_empty() {
            lock(&self.disks).values().cloned().collect()
        } else {
            let disk = self.get_handle(id)?;
            self.running(&disk)?;
            vec![disk]
        };
        let mut out = Vec::new();
        for disk in disks {
            let pid = disk.runtime().pid;
            if pid == 0 {
                continue;
            }
            match admin::stats(&disk.paths.admin_socket).await {
                Ok(stats) => out.push(DiskStatistics {
                    id: disk.spec.id.clone(),
                    total: Some(crate::stats::sum_queues(&stats.queues)),
                    queues: stats.queues,
                    frontend_pid: pid,
                    iothreads: stats.iothreads,
                }),
                Err(source) if !id.is_empty() => {
                    return Err(DaemonError::Admin {
                        id: id.to_string(),
                        source,
                    })
                }
                Err(e) => warn!("disk {}: statistics unavailable: {e}", disk.spec.id),
            }
        }
        Ok(out)
    }

    /// Drain: the disk's frontend stops popping requests, waits for those in flight and, with
    /// `flush`, syncs the image. The drained state is persisted first, so that a frontend
    /// restarted meanwhile starts drained; if the drain fails it is undone.
    pub async fn drain(&self, id: &str, flush: bool) -> Result<pb::DrainDiskResponse, DaemonError> {
        let (handle, _op) = self.lock_lifecycle(id).await?;
        let disk = &handle;
        self.running(disk)?;
        let was_drained = disk.runtime().lifecycle.drained;
        self.change_lifecycle(disk, |l| l.drained = true).await?;
        let socket = &disk.paths.admin_socket;
        match admin::drain(socket, flush).await {
            Ok(done) => {
                if let Ok(status) = admin::status(socket).await {
                    disk.record_status(&status);
                }
                disk.push_blockers().await;
                self.events.emit(
                    EventKind::Drained,
                    id,
                    disk.runtime().pid,
                    format!(
                        "waited for {} requests in flight{}",
                        done.waited_requests,
                        if done.flushed { "; image synced" } else { "" }
                    ),
                );
                Ok(pb::DrainDiskResponse {
                    waited_requests: done.waited_requests,
                    flushed: done.flushed,
                })
            }
            Err(e) => {
                if !was_drained {
                    // The frontend may have drained before the failure (a timeout, a failed
                    // sync): a disk the caller believes not drained must not hold requests.
                    if let Err(r) = admin::resume(socket).await {
                        warn!("disk {id}: undoing a failed drain: {r}");
                    }
                    if let Err(p) = self.change_lifecycle(disk, |l| l.drained = false).await {
                        warn!("disk {id}: undoing a failed drain: {p}");
                    }
                }
                Err(frontend_error(id, e))
            }
        }
    }

    /// Resume: the disk is no longer drained (persisted), and its frontend, if it runs,
    /// serves its rings again. A disk that is not drained is left as it is.
    pub async fn resume(&self, id: &str) -> Result<bool, DaemonError> {
        let (handle, _op) = self.lock_lifecycle(id).await?;
        let disk = &handle;
        let was_drained = disk.runtime().lifecycle.drained;
        if was_drained {
            self.change_lifecycle(disk, |l| l.drained = false).await?;
        }
        let rt = disk.runtime();
        // A frontend that is not running starts undrained; one that does not answer now is
        // resumed by the supervisor's next poll. The destination of a copy from another node
        // stays drained until its image is complete.
        if rt.pid != 0 && serving(rt.state) && !rt.wants_drained() {
            let socket = &disk.paths.admin_socket;
            admin::resume(socket)
                .await
                .map_err(|e| frontend_error(id, e))?;
            if let Ok(status) = admin::status(socket).await {
                disk.record_status(&status);
            }
            disk.push_blockers().await;
        }
        if was_drained {
            self.events.emit(EventKind::Resumed, id, rt.pid, "");
        }
        Ok(was_drained)
    }

    /// Waits until no disk is starting or restarting (or `timeout` passed); returns the
    /// disks as they are then.
    pub async fn settle(&self, timeout: Duration) -> Vec<pb::Disk> {
        let deadline = Instant::now() + timeout;
        loop {
            let busy = lock(&self.disks).values().any(|d| {
                matches!(
                    d.runtime().state,
                    DiskState::Starting | DiskState::Restarting
                )
            });
            if !busy || Instant::now() >= deadline {
                return self.list_disks().await;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// A qcow2 disk's backing files as its headers name them now (resolved), for the API; empty
/// for a raw image, or when the chain cannot be read (the frontend's start reports why).
fn backing_chain(spec: &DiskSpec, image_dirs: &[PathBuf]) -> Vec<String> {
    if spec.format != Some(crate::state::Format::Qcow2) {
        return Vec::new();
    }
    chain_files(spec, image_dirs)
        .map(|files| {
            files
                .iter()
                .skip(1)
                .map(|f| f.to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// The files of `spec`'s chain: its image, then its backing files (a qcow2 image's, with the
/// format probed if the disk has none recorded).
fn chain_files(spec: &DiskSpec, image_dirs: &[PathBuf]) -> Result<Vec<PathBuf>, String> {
    let file = std::fs::File::open(&spec.image).map_err(|e| e.to_string())?;
    let format = match spec.format {
        Some(crate::state::Format::Raw) => blkplane_chain::ImageFormat::Raw,
        Some(crate::state::Format::Qcow2) => blkplane_chain::ImageFormat::Qcow2,
        None => blkplane_chain::probe(&file, &spec.image).map_err(|e| e.to_string())?,
    };
    let mut files = vec![spec.image.clone()];
    if format == blkplane_chain::ImageFormat::Qcow2 {
        let chain =
            blkplane_chain::open(&file, &spec.image, image_dirs).map_err(|e| e.to_string())?;
        files.extend(chain.backing.into_iter().map(|b| b.path));
    }
    Ok(files)
}

/// A failed admin call on behalf of an API call: the frontend's refusal is a precondition
/// (FAILED_PRECONDITION), anything else means it did not answer (UNAVAILABLE).
fn frontend_error(id: &str, e: AdminError) -> DaemonError {
    match e {
        AdminError::Refused(reason) => DaemonError::Refused {
            id: id.to_string(),
            reason,
        },
        source => DaemonError::Admin {
            id: id.to_string(),
            source,
        },
    }
}
