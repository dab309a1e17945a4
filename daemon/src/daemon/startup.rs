//! The start-up of blkplaned: its directories and their locks, the desired state read back,
//! the orphan sweep (files and frontends of disks that are not in the state), the throttle
//! groups' files, the partial images of copies that died with the previous blkplaned
//! discarded, and the supervision of every disk begun (adopting running frontends).

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::fs::{DirBuilderExt, FileTypeExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use log::{error, info, warn};
use tokio::sync::broadcast::error::RecvError;
use tokio::sync::broadcast::Receiver;

use crate::events::EventBus;
use crate::frontend;
use crate::mirror;
use crate::paths::{self, DiskPaths};
use crate::pb::{DiskState, Event, EventKind};
use crate::settings::Settings;
use crate::state::{DirLock, RemoteSource, State, StateStore, StoredDisk, ThrottleSetting};
use crate::supervisor::{DiskHandle, Initial};
use crate::sync::lock;
use crate::throttle::{self, GroupFile};
use crate::validate;
use blkplane_procfs as proc;

use super::takeover::watch_incoming;
use super::{Config, Daemon, DaemonError};

impl Daemon {
    /// Starts the control plane: creates and locks the directories, reads the desired state,
    /// removes leftovers of disks that are not in it, and starts supervising every disk
    /// (adopting frontends that still run, starting the missing ones, in the background).
    pub async fn open(config: Config) -> Result<Arc<Daemon>, DaemonError> {
        // The state directory holds nothing anyone else needs. The runtime directory holds
        // the vhost-user sockets, which a VMM running as another user must be able to reach;
        // what must stay private there (control and admin sockets, pid files, logs) is
        // created with mode 0600.
        let state_dir = make_dir(&config.state_dir, 0o700)?;
        let runtime_dir = make_dir(&config.runtime_dir, 0o755)?;
        let disks_dir = make_dir(&runtime_dir.join("disks"), 0o755)?;
        // Group files are for blkplaned and its frontends only.
        let throttle_dir = make_dir(&runtime_dir.join("throttle"), 0o700)?;
        let locks = [
            DirLock::acquire(&state_dir)?,
            DirLock::acquire(&runtime_dir)?,
        ];
        let store = StateStore::new(&state_dir);
        let mut state = store.load()?;
        prepare_throttle(&store, &mut state, &throttle_dir);
        let settings = Arc::new(Settings {
            frontend_binary: config.frontend_binary,
            disks_dir: disks_dir.clone(),
            policy: config.policy,
            start_timeout: config.start_timeout,
            poll_interval: config.poll_interval,
            throttle_dir,
            disk_user: config.disk_user,
            disk_log: config.disk_log,
            can_run_as: validate::can_run_disks_as_other_users(),
            image_dirs: config.image_dirs.clone(),
        });
        let daemon = Arc::new(Daemon {
            settings,
            store,
            events: EventBus::new(),
            ctx: validate::Context {
                disks_dir,
                socket_dirs: config.socket_dirs,
                image_dirs: config.image_dirs,
                can_run_as: validate::can_run_disks_as_other_users(),
                node_name: config.node_name.clone(),
            },
            state_dir,
            runtime_dir,
            disks: Mutex::new(BTreeMap::new()),
            ops: tokio::sync::Mutex::new(()),
            startup_done: AtomicBool::new(false),
            node_name: config.node_name,
            peers: config.peers,
            cancelling: Mutex::new(Default::default()),
            copies: Mutex::new(Default::default()),
            receiving: Mutex::new(Default::default()),
            commits: Default::default(),
            _locks: locks,
        });
        daemon.sweep_orphans(&state).await;
        // Incoming disks found in the state take over like new ones.
        tokio::spawn(watch_incoming(
            Arc::downgrade(&daemon),
            daemon.settings.poll_interval,
        ));
        let mut disks = lock(&daemon.disks);
        // Subscribed before any supervisor runs, so that no restart goes unwritten.
        tokio::spawn(persist_restarts(
            Arc::downgrade(&daemon),
            daemon.events.subscribe(),
        ));
        for StoredDisk {
            spec,
            lifecycle,
            frontend_restarts,
        } in state.disks
        {
            let id = spec.id.clone();
            // A copy from another node that this node's previous blkplaned was receiving
            // when it died: nothing of it stays here (a new copy starts over from zeros).
            if let Some(from) = spec
                .incoming_from
                .as_ref()
                .filter(|from| RemoteSource::awaits_image(Some(from)))
            {
                match mirror::image::discard(&spec.image) {
                    Ok(()) => info!(
                        "disk {id}: discarded the partial image of the copy from {from}: a new \
                         copy starts over"
                    ),
                    Err(e) => warn!(
                        "disk {id}: discarding the partial image of the copy from {from}: {e}"
                    ),
                }
            }
            let handle = DiskHandle::spawn(
                spec,
                lifecycle,
                frontend_restarts,
                Arc::clone(&daemon.settings),
                daemon.events.clone(),
                Initial::AdoptOrStart,
            );
            disks.insert(id, handle);
        }
        drop(disks);
        // Latch the end of start-up as soon as it happens, not at the first /readyz: a disk
        // that crashes later is `Starting` again, which is no start-up any more.
        tokio::spawn(watch_startup(Arc::downgrade(&daemon)));
        Ok(daemon)
    }

    /// Whether start-up is over: every disk of the loaded state has been adopted or started,
    /// or its first start has failed (it is then restarting or failed, as the API shows).
    ///
    /// Each such disk is `Starting` from the moment [`Daemon::open`] puts it in the table
    /// until its first adoption or start is over, so "no disk is starting" means all of them
    /// got that far; from then on this stays true (a later restart is not start-up).
    pub fn startup_done(&self) -> bool {
        if self.startup_done.load(Ordering::Acquire) {
            return true;
        }
        let starting = lock(&self.disks)
            .values()
            .any(|d| d.runtime().state == DiskState::Starting);
        if !starting {
            self.startup_done.store(true, Ordering::Release);
        }
        !starting
    }

    /// Kills frontends and removes files of disk ids in the runtime directory that are not in
    /// the desired state: leftovers of a crash between starting a disk and persisting it, or
    /// during a removal.
    pub(super) async fn sweep_orphans(&self, state: &State) {
        let disks_dir = &self.settings.disks_dir;
        let wanted: BTreeSet<&str> = state.disks.iter().map(|d| d.spec.id.as_str()).collect();
        // Every file of a wanted disk, whatever its name looks like.
        let mut protected: BTreeSet<PathBuf> = BTreeSet::new();
        for disk in &state.disks {
            let paths = DiskPaths::new(disks_dir, &disk.spec);
            protected.insert(paths.vhost_socket.clone());
            protected.extend(paths.own_files().iter().map(|p| p.to_path_buf()));
        }
        let mut orphans = BTreeSet::new();
        if let Ok(dir) = std::fs::read_dir(disks_dir) {
            for entry in dir.filter_map(|e| e.ok()) {
                let path = entry.path();
                if protected.contains(&path) {
                    continue;
                }
                let name = entry.file_name().to_string_lossy().into_owned();
                match paths::split_runtime_name(&name) {
                    // A default vhost-user socket of a disk that is gone, if nobody uses it.
                    Some((id, paths::SOCKET_SUFFIX)) => {
                        let stale = !wanted.contains(id)
                            && entry.file_type().is_ok_and(|t| t.is_socket())
                            && !proc::is_listening(&path);
                        if stale {
                            let _ = std::fs::remove_file(&path);
                        }
                    }
                    Some((id, _)) if !wanted.contains(id) => {
                        orphans.insert(id.to_string());
                    }
                    // A rotated copy of a log: the disk's if it is wanted, else an orphan's.
                    None => match paths::split_rotated_log_name(&name) {
                        Some(id) if !wanted.contains(id) => {
                            orphans.insert(id.to_string());
                        }
                        _ => {}
                    },
                    _ => {}
                }
            }
        }
        // Frontends whose pid file is gone but which still run with an admin socket here.
        let prefix = format!("--admin-socket={}/", disks_dir.display());
        for pid in proc::find_processes_with_arg_prefix(&prefix) {
            for a in proc::cmdline(pid).unwrap_or_default() {
                let a = a.to_string_lossy();
                if let Some(id) = a
                    .strip_prefix(&prefix)
                    .and_then(|rest| rest.strip_suffix(paths::ADMIN_SUFFIX))
                {
                    if !wanted.contains(id) {
                        orphans.insert(id.to_string());
                    }
                }
            }
        }
        for id in orphans {
            warn!("removing leftovers of disk {id}, which is not in the state");
            frontend::sweep_orphan(disks_dir, &id, &protected).await;
        }
    }
}

/// Brings the throttle groups of a just-loaded state in order before any frontend is
/// supervised: member indices repaired if the file had clashes (persisted at once), every
/// group's state file created if it is missing — never truncated if present, as running
/// frontends map it — and files of groups that have no member removed (left by a crash
/// between a state write and the file's creation or removal).
pub(super) fn prepare_throttle(store: &StateStore, state: &mut State, throttle_dir: &Path) {
    let mut settings: BTreeMap<String, ThrottleSetting> = state
        .disks
        .iter()
        .map(|d| (d.spec.id.clone(), d.lifecycle.throttle.clone()))
        .collect();
    let mut notes = Vec::new();
    for (id, s) in settings.iter_mut() {
        // A group name names a file: one that SetThrottle would refuse (a hand-edited state)
        // must not reach the file system. The disk keeps its limits, alone.
        if !s.group.is_empty() {
            if let Err(e) = validate::check_group(&s.group) {
                notes.push(format!("disk {id}: {e}; taken out of the group"));
                s.group.clear();
            }
        }
        // Its frontend would refuse them (and serve unthrottled): say so, once.
        match validate::check_limits(&s.limits) {
            Ok(limits) => s.limits = limits,
            Err(e) => error!(
                "disk {id}: the stored I/O limits are invalid ({e}); its frontend will refuse them"
            ),
        }
    }
    notes.extend(throttle::repair_indices(&mut settings));
    if !notes.is_empty() {
        for note in &notes {
            warn!("{}: {note}", store.path().display());
        }
        for d in &mut state.disks {
            if let Some(s) = settings.remove(&d.spec.id) {
                d.lifecycle.throttle = s;
            }
        }
        if let Err(e) = store.save(state) {
            warn!("persisting the repaired member indices: {e}");
        }
    }
    let groups: BTreeSet<String> = state
        .disks
        .iter()
        .map(|d| d.lifecycle.throttle.group.clone())
        .filter(|g| !g.is_empty())
        .collect();
    for group in &groups {
        let path = throttle::group_file(throttle_dir, group);
        match throttle::ensure_group_file(&path) {
            Ok(GroupFile::Present) => {}
            Ok(GroupFile::Created) => info!("throttle group {group}: created {}", path.display()),
            Ok(GroupFile::Extended) => {
                warn!(
                    "throttle group {group}: {} was short; extended with zeros",
                    path.display()
                )
            }
            // Its members' frontends then refuse the limits and stay pending (logged).
            Err(e) => error!("throttle group {group}: {}: {e}", path.display()),
        }
    }
    for stale in throttle::stale_group_files(throttle_dir, &groups) {
        info!(
            "removing {}: its throttle group has no member",
            stale.display()
        );
        throttle::remove_group_file(&stale);
    }
}

/// Writes the state whenever a supervisor restarted a frontend (its `restarted` event comes
/// after the count went up), so that the counts survive blkplaned. A watcher that fell behind
/// may have missed one: it writes then too.
pub(super) async fn persist_restarts(daemon: Weak<Daemon>, mut events: Receiver<Event>) {
    loop {
        match events.recv().await {
            Ok(e) if e.kind == EventKind::Restarted as i32 => {}
            Ok(_) => continue,
            Err(RecvError::Lagged(_)) => {}
            Err(RecvError::Closed) => return,
        }
        let Some(d) = daemon.upgrade() else { return };
        let _ops = d.ops.lock().await;
        if let Err(e) = d.persist() {
            warn!("persisting the frontend restart counts: {e}");
        }
    }
}

/// Latches [`Daemon::startup_done`] once it holds (checked every 20 ms, as `settle` does).
/// Then stops the write tracking a copy of an earlier blkplaned left on in an adopted
/// frontend.
pub(super) async fn watch_startup(daemon: Weak<Daemon>) {
    loop {
        match daemon.upgrade() {
            Some(d) if !d.startup_done() => {}
            Some(d) => return d.stop_stray_tracking().await,
            None => return,
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Creates `dir` (and parents) with `mode` if missing and returns its canonical path.
pub(super) fn make_dir(dir: &Path, mode: u32) -> Result<PathBuf, DaemonError> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(mode)
        .create(dir)
        .map_err(|source| DaemonError::Io {
            what: "creating",
            path: dir.to_path_buf(),
            source,
        })?;
    std::fs::canonicalize(dir).map_err(|source| DaemonError::Io {
        what: "resolving",
        path: dir.to_path_buf(),
        source,
    })
}
