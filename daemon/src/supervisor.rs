//! Per-disk processes: starting a frontend and waiting until it serves, adopting one that
//! survived a blkplaned restart, stopping one, and the supervision loop that restarts a
//! crashed frontend with back-off and marks the disk failed when it crashes too often.
//!
//! Every frontend is watched through a pidfd, which works the same for our own children and
//! for adopted processes (children of an earlier blkplaned, now of init). Our own children are
//! reaped as soon as their pidfd says they exited, so no zombie is left.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use blkplane_proto::v1::{FrontendStatus, SetThrottle};
use log::{debug, info, warn};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::admin::{self, AdminError};
use crate::disk_log;
use crate::events::EventBus;
use crate::frontend::{
    adopt, kill_strays, note_in_log, remove_files, start_throttled, wait_iothreads_gone, Frontend,
    Started,
};
use crate::migration;
use crate::paths::DiskPaths;
use crate::pb::{self, DiskState, EventKind, MigrationBlockerReason};
use crate::runtime::{serving, Runtime};
use crate::settings::{RestartPolicy, Settings};
use crate::state::{DiskLifecycle, DiskSpec, OutgoingMigration};
use crate::sync::lock;
use crate::throttle;
use blkplane_api::names::reason_name;

/// A migration blocker as last published: its message and since when it holds.
#[derive(Debug, Clone)]
struct Published {
    message: String,
    since_unix_ms: u64,
}

/// How the supervision of a disk begins.
#[derive(Debug)]
pub enum Initial {
    /// AddDisk already started the frontend ([`start_throttled`]).
    Running(Box<Started>),
    /// blkplaned (re)started: adopt the running frontend, or start one if there is none.
    AdoptOrStart,
}

/// Why the takeover of an incoming disk is waiting, as last logged (each reason is logged,
/// and turned into an event where there is one, once when it begins).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TakeoverWait {
    /// The source's frontend still serves a running ring: both sides serve the image.
    BothServing,
    /// The source's frontend runs but did not answer, so whether its rings run is unknown.
    SourceUnknown,
    /// The source is on another node, which no longer records a migration to this disk (it
    /// was cancelled there): it will not retire the source.
    SourceForgot,
}

/// One disk: its configuration, its runtime state, and its supervision task.
#[derive(Debug)]
pub struct DiskHandle {
    /// The configuration as added. Its `incoming_for` and `incoming_from` are always `None`
    /// here: whether the disk is still incoming changes while it runs, so that lives in
    /// [`Runtime::incoming_for`] and [`Runtime::incoming_from`]; [`DiskHandle::config`] has
    /// them together.
    pub spec: DiskSpec,
    /// Its files.
    pub paths: DiskPaths,
    runtime: Mutex<Runtime>,
    events: EventBus,
    stop_tx: watch::Sender<bool>,
    task: Mutex<Option<JoinHandle<()>>>,
    /// Held by Drain and Resume for their whole call, and by the poll while it makes the
    /// frontend follow the desired drained state, so that they never cross.
    pub lifecycle_op: Arc<tokio::sync::Mutex<()>>,
    /// The blockers last published, by reason number (their events were emitted).
    published: Mutex<BTreeMap<i32, Published>>,
    /// The blocker lines last sent to the frontend, and the pid that took them; the lock
    /// orders the sends.
    pushed: tokio::sync::Mutex<Option<(u32, Vec<String>)>>,
    /// Orders the sends of I/O limits (held across one send).
    throttle_push: tokio::sync::Mutex<()>,
    /// The I/O limits the frontend has, and its pid: the last ones it took (or started with).
    /// Read without waiting for a send under way, for `pending`.
    throttle_pushed: Mutex<Option<(u32, SetThrottle)>>,
    /// `RUNTIME_DIR/throttle`, where the group files are.
    throttle_dir: PathBuf,
    /// For an incoming disk: why its takeover waited at the last attempt, if it did.
    pub takeover_wait: Mutex<Option<TakeoverWait>>,
    /// Auto-converge of a copy to another node: the most the disk may write, bytes/s, on top
    /// of its own limits (0: nothing more). Not persisted: a copy does not outlive blkplaned.
    write_cap: Mutex<u64>,
}

impl DiskHandle {
    /// Starts supervising a disk with its persisted `lifecycle` and frontend `restarts` so
    /// far; the task runs until [`DiskHandle::stop`].
    pub fn spawn(
        mut spec: DiskSpec,
        lifecycle: DiskLifecycle,
        restarts: u32,
        settings: Arc<Settings>,
        events: EventBus,
        initial: Initial,
    ) -> Arc<DiskHandle> {
        // One place for a value that changes: the runtime (see the `spec` field).
        let incoming_for = spec.incoming_for.take();
        let incoming_from = spec.incoming_from.take();
        let paths = DiskPaths::new(&settings.disks_dir, &spec);
        let (stop_tx, stop_rx) = watch::channel(false);
        let (state, pid, status, throttle_pushed) = match &initial {
            Initial::Running(started) => (
                state_of(Some(&started.status)),
                started.frontend.pid(),
                Some(started.status.clone()),
                started
                    .throttle
                    .clone()
                    .map(|t| (started.frontend.pid(), t)),
            ),
            Initial::AdoptOrStart => (DiskState::Starting, 0, None, None),
        };
        let disk = Arc::new(DiskHandle {
            spec,
            paths,
            runtime: Mutex::new(Runtime {
                state,
                reason: String::new(),
                pid,
                restarts,
                status,
                lifecycle,
                restarted_unix_ms: 0,
                incoming_for,
                incoming_from,
            }),
            events: events.clone(),
            stop_tx,
            task: Mutex::new(None),
            lifecycle_op: Arc::new(tokio::sync::Mutex::new(())),
            published: Mutex::new(BTreeMap::new()),
            pushed: tokio::sync::Mutex::new(None),
            throttle_push: tokio::sync::Mutex::new(()),
            throttle_pushed: Mutex::new(throttle_pushed),
            throttle_dir: settings.throttle_dir.clone(),
            takeover_wait: Mutex::new(None),
            write_cap: Mutex::new(0),
        });
        disk.refresh_migration();
        let task = tokio::spawn(supervise(
            Arc::clone(&disk),
            settings,
            events,
            initial,
            stop_rx,
        ));
        *lock(&disk.task) = Some(task);
        disk
    }

    /// Records why this incoming disk's takeover waits now; returns whether that is news (to
    /// be reported). An unanswered status between two both-serving answers is not: both
    /// sides were seen serving and nothing since says otherwise.
    pub fn note_takeover_wait(&self, wait: TakeoverWait) -> bool {
        let mut current = lock(&self.takeover_wait);
        if *current == Some(wait)
            || (wait == TakeoverWait::SourceUnknown && *current == Some(TakeoverWait::BothServing))
        {
            return false;
        }
        *current = Some(wait);
        true
    }

    /// A copy of the runtime state.
    pub fn runtime(&self) -> Runtime {
        lock(&self.runtime).clone()
    }

    /// The disk's configuration now, as it is persisted and shown: [`DiskHandle::spec`] with
    /// the current `incoming_for` and `incoming_from`.
    pub fn config(&self) -> DiskSpec {
        let rt = lock(&self.runtime);
        DiskSpec {
            incoming_for: rt.incoming_for.clone(),
            incoming_from: rt.incoming_from.clone(),
            ..self.spec.clone()
        }
    }

    /// The API view of the configuration: [`DiskHandle::config`] with the outgoing migration
    /// the lifecycle records.
    pub fn config_pb(&self) -> crate::pb::DiskConfig {
        let outgoing = lock(&self.runtime).lifecycle.outgoing.clone();
        crate::pb::DiskConfig {
            outgoing: outgoing.as_ref().map(OutgoingMigration::to_pb),
            ..self.config().to_pb()
        }
    }

    /// Records a fresh status of the running frontend (from the supervisor's poll or an API
    /// read), and emits `connected` / `disconnected` when the VMM came or went since the last
    /// one. Ignored unless the frontend that answered is the one being supervised and running.
    pub fn record_status(&self, status: &FrontendStatus) {
        let (change, iothread_restarted) = {
            let mut rt = lock(&self.runtime);
            if rt.pid != status.pid || !serving(rt.state) {
                return;
            }
            let was = rt.status.as_ref().is_some_and(|s| s.vmm_connected);
            // Replacements since the last status of this same process (a new frontend counts
            // from zero, and its start has events of its own).
            let replaced = rt.status.as_ref().is_some_and(|s| {
                s.pid == status.pid && status.iothread_restarts > s.iothread_restarts
            });
            rt.state = state_of(Some(status));
            rt.reason.clear();
            rt.status = Some(status.clone());
            (
                (was != status.vmm_connected).then_some(rt.pid),
                replaced.then(|| status.last_iothread_exit.clone()),
            )
        };
        if let Some(how) = iothread_restarted {
            self.events.emit(
                EventKind::IothreadRestarted,
                &self.spec.id,
                status.pid,
                format!(
                    "replaced ({} replacement(s) so far); the old one: {how}",
                    status.iothread_restarts
                ),
            );
        }
        if let Some(pid) = change {
            let kind = if status.vmm_connected {
                EventKind::Connected
            } else {
                EventKind::Disconnected
            };
            self.events.emit(kind, &self.spec.id, pid, "");
        }
        self.refresh_migration();
    }

    /// Changes the runtime state (and publishes what that changes about migration).
    pub fn update(&self, f: impl FnOnce(&mut Runtime)) {
        f(&mut lock(&self.runtime));
        self.refresh_migration();
    }

    /// The disk's migration blockers now, dated; blockers that appeared or went away since
    /// the last call (or an operator blocker whose message changed) become events.
    pub fn refresh_migration(&self) -> Vec<pb::MigrationBlocker> {
        let rt = self.runtime();
        let now = blkplane_api::time::unix_time_ms();
        let current = migration::blockers(&rt, now);
        let mut events = Vec::new();
        let mut out = Vec::with_capacity(current.len());
        {
            let mut published = lock(&self.published);
            let present: BTreeSet<i32> = current.iter().map(|b| b.reason as i32).collect();
            published.retain(|reason, _| {
                let keep = present.contains(reason);
                if !keep {
                    let name = MigrationBlockerReason::try_from(*reason)
                        .map(reason_name)
                        .unwrap_or("unknown");
                    events.push((EventKind::BlockerRemoved, name.to_string()));
                }
                keep
            });
            for b in current {
                let automatic = b.is_automatic();
                let entry = published.entry(b.reason as i32);
                let since = match entry {
                    std::collections::btree_map::Entry::Occupied(mut e) => {
                        let p = e.get_mut();
                        // Automatic messages may say more as things go on (a restart's
                        // delay); only an operator's new words are news.
                        if !automatic && p.message != b.message {
                            events.push((EventKind::BlockerAdded, b.line()));
                        }
                        p.message = b.message.clone();
                        if let Some(since) = b.since_unix_ms {
                            p.since_unix_ms = since;
                        }
                        p.since_unix_ms
                    }
                    std::collections::btree_map::Entry::Vacant(e) => {
                        events.push((EventKind::BlockerAdded, b.line()));
                        let since = b.since_unix_ms.unwrap_or(now);
                        e.insert(Published {
                            message: b.message.clone(),
                            since_unix_ms: since,
                        });
                        since
                    }
                };
                out.push(pb::MigrationBlocker {
                    reason: b.reason as i32,
                    message: b.message,
                    automatic,
                    since_unix_ms: since,
                });
            }
        }
        for (kind, message) in events {
            self.events.emit(kind, &self.spec.id, rt.pid, message);
        }
        out
    }

    /// Sends the current blocker lines to the frontend if it does not have them yet (a new
    /// frontend, or a change). Failures are left to the next poll.
    pub async fn push_blockers(&self) {
        let mut pushed = self.pushed.lock().await;
        let rt = self.runtime();
        if rt.pid == 0 || !serving(rt.state) {
            return;
        }
        let lines: Vec<String> = migration::blockers(&rt, blkplane_api::time::unix_time_ms())
            .iter()
            .map(migration::Blocker::line)
            .collect();
        if pushed
            .as_ref()
            .is_some_and(|(pid, sent)| *pid == rt.pid && *sent == lines)
        {
            return;
        }
        match admin::set_migration_blockers(&self.paths.admin_socket, lines.clone()).await {
            Ok(()) => *pushed = Some((rt.pid, lines)),
            Err(e) => debug!("disk {}: sending migration blockers: {e}", self.spec.id),
        }
    }

    /// What the frontend is to be sent for the disk's current I/O limits and group.
    fn throttle_request(&self, rt: &Runtime) -> SetThrottle {
        let mut setting = rt.lifecycle.throttle.clone();
        let cap = *lock(&self.write_cap);
        // A group shares its limits among its members: a cap of one would not hold.
        if cap != 0 && setting.group.is_empty() {
            throttle::cap_writes(&mut setting.limits, cap);
        }
        throttle::frontend_request(&setting, &self.throttle_dir)
    }

    /// Auto-converge: caps the disk's writes at `bytes_per_second` on top of its own limits
    /// (0: lifts the cap) and sends the result to the frontend. A disk in a throttle group
    /// is not capped (the group's members share their limits): an error says so.
    pub async fn cap_writes(&self, bytes_per_second: u64) -> Result<(), String> {
        if bytes_per_second != 0 && !self.runtime().lifecycle.throttle.group.is_empty() {
            return Err(format!(
                "disk {} is in a throttle group, whose limits its members share: its writes \
                 are not capped for the copy",
                self.spec.id
            ));
        }
        let before = std::mem::replace(&mut *lock(&self.write_cap), bytes_per_second);
        let pushed = self.push_throttle().await.map_err(|e| e.to_string());
        if pushed.is_err() {
            // Not left for the poll to push later: the copy that asked knows it failed. The
            // frontend may have taken it all the same (an answer that came too late): what
            // it has is unknown, so the poll sends the disk's limits again.
            *lock(&self.write_cap) = before;
            *lock(&self.throttle_pushed) = None;
        }
        pushed
    }

    /// Sends the disk's current I/O limits to its frontend unless it has them (a new
    /// frontend, an adopted one, or a change). Ok when the frontend has them, or when none is
    /// running (a frontend started later gets them before it serves); the admin error when
    /// sending failed (the next poll tries again).
    pub async fn push_throttle(&self) -> Result<(), AdminError> {
        let _order = self.throttle_push.lock().await;
        let rt = self.runtime();
        if rt.pid == 0 || !serving(rt.state) {
            return Ok(());
        }
        let want = self.throttle_request(&rt);
        if lock(&self.throttle_pushed)
            .as_ref()
            .is_some_and(|(pid, had)| *pid == rt.pid && *had == want)
        {
            return Ok(());
        }
        admin::set_throttle(&self.paths.admin_socket, want.clone()).await?;
        *lock(&self.throttle_pushed) = Some((rt.pid, want));
        Ok(())
    }

    /// Whether the running frontend does not have the disk's current I/O limits (yet). False
    /// when no frontend runs.
    pub fn throttle_pending(&self) -> bool {
        let rt = self.runtime();
        if rt.pid == 0 || !serving(rt.state) {
            return false;
        }
        let want = self.throttle_request(&rt);
        lock(&self.throttle_pushed)
            .as_ref()
            .is_none_or(|(pid, had)| *pid != rt.pid || *had != want)
    }

    /// Stops supervision: the frontend (if any) is stopped and its files removed. Returns
    /// once everything is gone.
    pub async fn stop(&self) {
        self.update(|rt| rt.state = DiskState::Stopping);
        let _ = self.stop_tx.send(true);
        let task = lock(&self.task).take();
        if let Some(task) = task {
            if let Err(e) = task.await {
                warn!("disk {}: supervisor task ended badly: {e}", self.spec.id);
            }
        }
    }
}

/// The disk state a running frontend's status implies.
fn state_of(status: Option<&FrontendStatus>) -> DiskState {
    match status {
        Some(s) if s.drained => DiskState::Drained,
        Some(s) if s.vmm_connected => DiskState::Connected,
        _ => DiskState::Ready,
    }
}

/// Grace between SIGTERM and SIGKILL when a disk is removed.
const STOP_GRACE: Duration = Duration::from_secs(5);

/// Waits until a stop is requested (or the handle is gone).
async fn stop_requested(rx: &mut watch::Receiver<bool>) {
    let _ = rx.wait_for(|stop| *stop).await;
}

/// The supervision loop of one disk.
async fn supervise(
    disk: Arc<DiskHandle>,
    settings: Arc<Settings>,
    events: EventBus,
    initial: Initial,
    mut stop_rx: watch::Receiver<bool>,
) {
    let id = disk.spec.id.clone();
    let policy = &settings.policy;
    let mut crashes: VecDeque<Instant> = VecDeque::new();
    let mut current: Option<Frontend> = None;
    // Why the next start is a restart (None: the start needs no event, it is AddDisk's).
    let mut restart_reason: Option<String> = None;
    match initial {
        Initial::Running(started) => current = Some(started.frontend),
        Initial::AdoptOrStart => match adopt(&disk.paths).await {
            Ok(fe) => {
                let status = admin::status(&disk.paths.admin_socket).await.ok();
                let pid = fe.pid();
                disk.update(|rt| {
                    rt.pid = pid;
                    rt.state = state_of(status.as_ref());
                    rt.status = status;
                });
                note_in_log(
                    &disk.paths,
                    &format!("frontend {pid} adopted by blkplaned {}", std::process::id()),
                );
                events.emit(EventKind::Adopted, &id, pid, "");
                current = Some(fe);
            }
            Err(e) => {
                info!("disk {id}: not adopting a frontend ({e}); starting one");
                // Whatever else still runs for this disk would hold its sockets.
                for pid in kill_strays(&disk.paths).await {
                    warn!("disk {id}: killed stray frontend {pid}");
                }
                restart_reason = Some(format!("no running frontend to adopt: {e}"));
            }
        },
    }

    loop {
        let fe = match current.take() {
            Some(fe) => fe,
            None => {
                disk.update(|rt| {
                    rt.state = DiskState::Starting;
                    rt.pid = 0;
                    rt.status = None;
                });
                // Not cancelled by a stop request: a start is bounded by start_timeout and
                // cleans up after itself, while a dropped half-start could leave a process.
                // A drained disk comes back drained: its frontend starts that way.
                // A throttled disk's frontend gets its limits before it serves.
                let rt = disk.runtime();
                let throttle = disk.throttle_request(&rt);
                let drained = rt.wants_drained();
                match start_throttled(&settings, &disk.config(), &disk.paths, drained, &throttle)
                    .await
                {
                    Ok(Started {
                        frontend: fe,
                        status,
                        throttle,
                    }) => {
                        let pid = fe.pid();
                        *lock(&disk.throttle_pushed) = throttle.map(|t| (pid, t));
                        disk.update(|rt| {
                            rt.pid = pid;
                            rt.restarts += 1;
                            rt.state = state_of(Some(&status));
                            rt.reason.clear();
                            rt.status = Some(status);
                            rt.restarted_unix_ms = blkplane_api::time::unix_time_ms();
                        });
                        events.emit(
                            EventKind::Restarted,
                            &id,
                            pid,
                            restart_reason.take().unwrap_or_default(),
                        );
                        fe
                    }
                    Err(e) => {
                        let reason = format!("start failed: {e}");
                        warn!("disk {id}: {reason}");
                        if !crashed(&disk, &events, policy, &mut crashes, reason, &mut stop_rx)
                            .await
                        {
                            break;
                        }
                        restart_reason = Some("after a failed start".into());
                        continue;
                    }
                }
            }
        };

        // Running: watch for exit, stop requests and VMM connects/disconnects. A new frontend
        // learns its migration blockers at once, not at the first poll; so does an adopted
        // one its I/O limits (which it may have had from before, but blkplaned cannot tell:
        // the limits may have changed while it was down), or a new one whose start could not
        // give them.
        let pid = fe.pid();
        if let Err(e) = disk.push_throttle().await {
            let unthrottled =
                disk.throttle_request(&disk.runtime()) == throttle::unthrottled_request();
            if unthrottled {
                debug!("disk {id}: sending the I/O limits to frontend {pid}: {e}");
            } else {
                warn!("disk {id}: sending the I/O limits to frontend {pid}: {e}; trying again at every poll");
            }
        }
        disk.push_blockers().await;
        let reason = loop {
            tokio::select! {
                _ = stop_requested(&mut stop_rx) => {
                    let iothreads = disk.runtime().status.map(|s| s.iothread_pids).unwrap_or_default();
                    let how = fe.stop(STOP_GRACE).await;
                    info!("disk {id}: frontend {pid} stopped ({how})");
                    wait_iothreads_gone(&iothreads).await;
                    remove_files(&disk.paths);
                    return;
                }
                how = fe.wait() => break how,
                _ = tokio::time::sleep(settings.poll_interval) => {
                    poll(&disk).await;
                    cap_log(&disk, &settings).await;
                }
            }
        };
        let was_connected = disk
            .runtime()
            .status
            .is_some_and(|s| s.vmm_connected && s.pid == pid);
        note_in_log(&disk.paths, &format!("frontend {pid} {reason}"));
        events.emit(EventKind::Exited, &id, pid, format!("frontend {reason}"));
        if was_connected {
            events.emit(EventKind::Disconnected, &id, pid, "the frontend exited");
        }
        if !crashed(
            &disk,
            &events,
            policy,
            &mut crashes,
            format!("frontend {pid} {reason}"),
            &mut stop_rx,
        )
        .await
        {
            break;
        }
        restart_reason = Some(format!("frontend {pid} {reason}"));
    }
    // Stopped while not running (failed, or during back-off).
    remove_files(&disk.paths);
}

/// Records a crash. Returns true to restart (after the back-off delay, already waited), false
/// when the supervisor should end: a stop was requested, during back-off or after the disk
/// was marked failed.
async fn crashed(
    disk: &DiskHandle,
    events: &EventBus,
    policy: &RestartPolicy,
    crashes: &mut VecDeque<Instant>,
    reason: String,
    stop_rx: &mut watch::Receiver<bool>,
) -> bool {
    let now = Instant::now();
    crashes.push_back(now);
    while crashes
        .front()
        .is_some_and(|t| now.duration_since(*t) > policy.window)
    {
        crashes.pop_front();
    }
    let id = &disk.spec.id;
    if crashes.len() >= policy.max_crashes {
        let why = format!(
            "{} crashes within {:?}; the last: {reason}",
            crashes.len(),
            policy.window
        );
        disk.update(|rt| {
            rt.state = DiskState::Failed;
            rt.reason = why.clone();
            rt.pid = 0;
            rt.status = None;
        });
        events.emit(EventKind::Failed, id, 0, why);
        stop_requested(stop_rx).await;
        return false;
    }
    let delay = policy.backoff(crashes.len());
    disk.update(|rt| {
        rt.state = DiskState::Restarting;
        rt.reason = format!("{reason}; restarting in {delay:?}");
        rt.pid = 0;
        rt.status = None;
    });
    tokio::select! {
        _ = stop_requested(stop_rx) => false,
        _ = tokio::time::sleep(delay) => true,
    }
}

/// Reads the frontend's status; connects and disconnects become events. Then makes the
/// frontend follow the desired state: drained or not (after an adoption, or a Drain or
/// Resume that failed half-way), the current migration blockers, and the current I/O limits
/// (until a frontend that failed to take them has them).
async fn poll(disk: &DiskHandle) {
    match admin::status(&disk.paths.admin_socket).await {
        Ok(status) => {
            disk.record_status(&status);
            follow_drained(disk, &status).await;
            disk.push_blockers().await;
            if let Err(e) = disk.push_throttle().await {
                debug!("disk {}: sending the I/O limits: {e}", disk.spec.id);
            }
        }
        Err(e) => {
            debug!("disk {}: status: {e}", disk.spec.id);
            disk.update(|rt| rt.reason = format!("status unavailable: {e}"));
        }
    }
}

/// Rotates the disk's log if it grew past its cap (see `disk_log`); the copy runs off the
/// async workers, as it may be megabytes.
async fn cap_log(disk: &DiskHandle, settings: &Settings) {
    if !disk_log::over(&disk.paths.log_file, &settings.disk_log) {
        return;
    }
    let log = disk.paths.log_file.clone();
    let limit = settings.disk_log;
    match tokio::task::spawn_blocking(move || disk_log::rotate_if_over(&log, &limit)).await {
        Ok(Ok(rotated)) => {
            if rotated {
                debug!("disk {}: log rotated", disk.spec.id);
            }
        }
        Ok(Err(e)) => warn!("disk {}: rotating the log: {e}", disk.spec.id),
        Err(e) => warn!("disk {}: rotating the log: {e}", disk.spec.id),
    }
}

/// Drains or resumes the frontend when it is not as the disk's lifecycle wants it. Skipped
/// while a Drain or Resume call is under way (it does the same, and reports it).
async fn follow_drained(disk: &DiskHandle, status: &FrontendStatus) {
    let Ok(_op) = disk.lifecycle_op.try_lock() else {
        return;
    };
    let rt = disk.runtime();
    let wanted = rt.wants_drained();
    if rt.pid != status.pid || wanted == status.drained {
        return;
    }
    let id = &disk.spec.id;
    let socket = &disk.paths.admin_socket;
    let result = if wanted {
        warn!(
            "disk {id}: frontend {} is not drained as it should be; draining it",
            rt.pid
        );
        admin::drain(socket, false).await.map(|_| ())
    } else {
        warn!(
            "disk {id}: frontend {} is drained but should not be; resuming it",
            rt.pid
        );
        admin::resume(socket).await
    };
    match result {
        Ok(()) => {
            if let Ok(status) = admin::status(socket).await {
                disk.record_status(&status);
            }
        }
        Err(e) => warn!("disk {id}: {e}"),
    }
}
