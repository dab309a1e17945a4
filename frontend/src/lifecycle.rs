//! Quiescing a disk (drain and resume, for a snapshot or backup) and the frontend's side of
//! migration blockers.
//!
//! **Drain** pauses every queue worker at once — each stops popping requests (they stay in
//! the avail rings, so the guest's requests wait rather than fail), waits until the requests
//! it had handed to its iothread have completed (an iothread replaced meanwhile gets them
//! resubmitted, so the wait survives it), and reports how many that were — and then, if
//! asked, fdatasyncs the image once on the frontend's own descriptor. From then on nothing
//! touches the image until **resume**, which makes every worker read all its rings again.
//! A paused worker keeps serving vhost-user commands: a ring stopped while drained
//! (GET_VRING_BASE, RESET_DEVICE, a disconnect) stays stopped, a ring started while drained
//! is not read until resume. Drains and resumes are serialized.
//!
//! **Migration blockers:** blkplaned sends the reasons a disk must not be migrated
//! (SetMigrationBlockers on the admin channel); [`check_dirty_logging`] refuses a VMM's
//! attempt to start dirty logging (SET_FEATURES with VHOST_F_LOG_ALL) while any reason holds,
//! and logs them. The frontend adds its own reason: it is drained. (SET_LOG_BASE is accepted
//! even then: its reply carries no status, and a mapped log marks nothing until LOG_ALL.)

use std::io;
use std::sync::mpsc::Receiver;
use std::sync::{Arc, Mutex};

use blkplane_lock::lock;

use blkplane_proto::v1::Drained;
use log::{info, warn};

use crate::admin::Lifecycle;
use crate::image::Image;
use crate::stats::DeviceStatus;
use crate::worker::{Command, WorkerGone, WorkerHandle, Workers};

/// Why a drain or resume failed.
#[derive(Debug, thiserror::Error)]
pub enum LifecycleError {
    /// A queue worker thread is gone (the frontend is broken; it is not expected).
    #[error("queue worker {0} is gone")]
    WorkerGone(usize),
    /// Every worker is idle, but the image could not be made durable. The disk stays
    /// drained.
    #[error("the disk is drained, but fdatasync of the image failed: {0}")]
    Flush(io::Error),
}

/// A VMM asked to start dirty logging while the disk must not be migrated.
#[derive(Debug, thiserror::Error)]
#[error("{what} refused: the disk must not be migrated now: {}", .reasons.join("; "))]
pub struct MigrationBlocked {
    /// What the VMM asked for.
    pub what: &'static str,
    /// Every reason, as [`DeviceStatus::migration_blockers`] lists them.
    pub reasons: Vec<String>,
}

/// Refuses to start dirty logging (`what`: the VMM's request) while any migration blocker
/// holds, logging every reason; the caller turns the error into a vhost-user error reply.
pub fn check_dirty_logging(
    status: &DeviceStatus,
    what: &'static str,
) -> Result<(), MigrationBlocked> {
    let reasons = status.migration_blockers();
    if reasons.is_empty() {
        return Ok(());
    }
    let blocked = MigrationBlocked { what, reasons };
    warn!("{blocked}");
    Err(blocked)
}

/// A queue worker as drain and resume see it: each request is posted at once and answered
/// later, so that every worker waits for its in-flight requests at the same time.
pub trait Pausable {
    /// Posts a pause; the receiver yields the number of requests that were in flight.
    fn post_pause(&self) -> Result<Receiver<u64>, WorkerGone>;
    /// Posts a resume; the receiver yields once the worker serves its rings again.
    fn post_resume(&self) -> Result<Receiver<()>, WorkerGone>;
}

impl Pausable for WorkerHandle {
    fn post_pause(&self) -> Result<Receiver<u64>, WorkerGone> {
        self.post(|reply| Command::Pause { reply })
    }

    fn post_resume(&self) -> Result<Receiver<()>, WorkerGone> {
        self.post(|reply| Command::Resume { reply })
    }
}

/// Pauses every worker and waits until each is idle; returns the requests they waited for.
/// If a worker is gone, the others are resumed again (a half-drained disk would hold the
/// guest's requests back for nothing) and the error names it.
pub fn pause_all<P: Pausable>(workers: &[P]) -> Result<u64, LifecycleError> {
    let mut failed = None;
    let mut pending = Vec::with_capacity(workers.len());
    for (index, worker) in workers.iter().enumerate() {
        match worker.post_pause() {
            Ok(answer) => pending.push((index, answer)),
            Err(WorkerGone) => {
                failed = Some(index);
                break;
            }
        }
    }
    let mut waited = 0u64;
    for (index, answer) in pending {
        match answer.recv() {
            Ok(n) => waited = waited.saturating_add(n),
            Err(_) => {
                failed.get_or_insert(index);
            }
        }
    }
    match failed {
        None => Ok(waited),
        Some(index) => {
            if let Err(e) = resume_all(workers) {
                warn!("drain failed; resuming the other workers: {e}");
            }
            Err(LifecycleError::WorkerGone(index))
        }
    }
}

/// Resumes every worker (all of them, even if one is gone) and waits until each serves its
/// rings again; the error names the first worker that is gone.
pub fn resume_all<P: Pausable>(workers: &[P]) -> Result<(), LifecycleError> {
    let mut failed = None;
    let answers: Vec<_> = workers
        .iter()
        .enumerate()
        .map(|(index, worker)| (index, worker.post_resume()))
        .collect();
    for (index, answer) in answers {
        let done = answer.ok().and_then(|a| a.recv().ok());
        if done.is_none() {
            failed.get_or_insert(index);
        }
    }
    match failed {
        None => Ok(()),
        Some(index) => Err(LifecycleError::WorkerGone(index)),
    }
}

/// Makes the image durable: fdatasync on the frontend's own (buffered) descriptor, which
/// covers what the iothreads wrote through theirs, O_DIRECT included, as it is one file.
/// Returns whether there was anything to sync (a null image has no file).
pub(crate) fn sync_image(image: &Image) -> io::Result<bool> {
    match image {
        // A qcow2 image's external data file holds the guest's data: synced too.
        Image::File(file) => {
            file.buffered.sync_data()?;
            if let Some(data_file) = &file.data_file {
                data_file.sync_data()?;
            }
            Ok(true)
        }
        Image::Null { .. } => Ok(false),
    }
}

/// Drains and resumes the device; what the admin channel's Drain and Resume run.
pub struct Quiescer {
    workers: Workers,
    image: Arc<Image>,
    status: Arc<DeviceStatus>,
    /// Serializes drains and resumes (two admin connections may ask at once).
    serial: Mutex<()>,
}

impl Quiescer {
    /// A quiescer for the device whose queues `workers` serve, from `image`.
    pub fn new(workers: Workers, image: Arc<Image>, status: Arc<DeviceStatus>) -> Self {
        Self {
            workers,
            image,
            status,
            serial: Mutex::new(()),
        }
    }

    /// Drains the disk (see the module documentation); with `flush`, fdatasyncs the image
    /// after the last request in flight completed.
    pub fn drain(&self, flush: bool) -> Result<Drained, LifecycleError> {
        let _serial = lock(&self.serial);
        // Marked first: a VMM that tries to start dirty logging meanwhile is refused.
        let was_drained = self
            .status
            .drained
            .swap(true, std::sync::atomic::Ordering::Relaxed);
        // A worker handles its commands one by one: what the vhost-user thread asks of it
        // meanwhile (a ring started or stopped) waits until it is paused, and a ring started
        // while paused is not read until resume.
        let paused = pause_all(self.workers.as_slice());
        let waited = match paused {
            Ok(waited) => waited,
            Err(e) => {
                self.status
                    .drained
                    .store(was_drained, std::sync::atomic::Ordering::Relaxed);
                return Err(e);
            }
        };
        let flushed = if flush {
            sync_image(&self.image).map_err(LifecycleError::Flush)?
        } else {
            false
        };
        info!(
            "drained: waited for {waited} requests in flight{}",
            if flushed { "; image synced" } else { "" }
        );
        Ok(Drained {
            waited_requests: waited,
            flushed,
        })
    }

    /// Ends a drain: every worker reads its rings again. A disk that is not drained is left
    /// as it is.
    pub fn resume(&self) -> Result<(), LifecycleError> {
        let _serial = lock(&self.serial);
        resume_all(self.workers.as_slice())?;
        if self
            .status
            .drained
            .swap(false, std::sync::atomic::Ordering::Relaxed)
        {
            info!("resumed");
        }
        Ok(())
    }
}

impl Lifecycle for Quiescer {
    fn drain(&self, flush: bool) -> Result<Drained, String> {
        Quiescer::drain(self, flush).map_err(|e| e.to_string())
    }

    fn resume(&self) -> Result<(), String> {
        Quiescer::resume(self).map_err(|e| e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::CacheMode;
    use std::cell::Cell;
    use std::sync::atomic::Ordering;
    use std::sync::mpsc;

    /// A worker that answers at once: `in_flight` requests waited for, or gone.
    struct FakeWorker {
        in_flight: Option<u64>,
        /// The reply channel is dropped unanswered (the thread died during the wait).
        dies_while_pausing: bool,
        paused: Cell<bool>,
        resumes: Cell<u32>,
    }

    impl FakeWorker {
        fn new(in_flight: Option<u64>) -> Self {
            Self {
                in_flight,
                dies_while_pausing: false,
                paused: Cell::new(false),
                resumes: Cell::new(0),
            }
        }
    }

    impl Pausable for FakeWorker {
        fn post_pause(&self) -> Result<Receiver<u64>, WorkerGone> {
            let n = self.in_flight.ok_or(WorkerGone)?;
            let (tx, rx) = mpsc::channel();
            self.paused.set(true);
            if !self.dies_while_pausing {
                tx.send(n).map_err(|_| WorkerGone)?;
            }
            Ok(rx)
        }

        fn post_resume(&self) -> Result<Receiver<()>, WorkerGone> {
            self.in_flight.ok_or(WorkerGone)?;
            let (tx, rx) = mpsc::channel();
            self.paused.set(false);
            self.resumes.set(self.resumes.get() + 1);
            tx.send(()).map_err(|_| WorkerGone)?;
            Ok(rx)
        }
    }

    #[test]
    fn pause_counts_every_worker_and_resume_undoes_it() {
        let workers = [FakeWorker::new(Some(3)), FakeWorker::new(Some(5))];
        assert_eq!(pause_all(&workers).unwrap(), 8);
        assert!(workers.iter().all(|w| w.paused.get()));
        // Draining a drained disk waits for nothing more.
        let idle = [FakeWorker::new(Some(0)), FakeWorker::new(Some(0))];
        assert_eq!(pause_all(&idle).unwrap(), 0);
        resume_all(&workers).unwrap();
        assert!(workers
            .iter()
            .all(|w| !w.paused.get() && w.resumes.get() == 1));
    }

    #[test]
    fn a_gone_worker_fails_the_drain_and_the_others_resume() {
        let workers = [
            FakeWorker::new(Some(2)),
            FakeWorker::new(None),
            FakeWorker::new(Some(1)),
        ];
        assert!(matches!(
            pause_all(&workers),
            Err(LifecycleError::WorkerGone(1))
        ));
        assert!(!workers[0].paused.get(), "worker 0 was left paused");
        assert_eq!(workers[0].resumes.get(), 1);
        // Worker 2 was never paused but resumed anyway: harmless, as resume is idempotent.
        assert!(!workers[2].paused.get());

        let mut dying = FakeWorker::new(Some(4));
        dying.dies_while_pausing = true;
        let workers = [FakeWorker::new(Some(1)), dying];
        assert!(matches!(
            pause_all(&workers),
            Err(LifecycleError::WorkerGone(1))
        ));
        assert!(!workers[0].paused.get());
    }

    #[test]
    fn resume_reaches_every_worker_even_past_a_gone_one() {
        let workers = [
            FakeWorker::new(None),
            FakeWorker::new(Some(0)),
            FakeWorker::new(Some(0)),
        ];
        assert!(matches!(
            resume_all(&workers),
            Err(LifecycleError::WorkerGone(0))
        ));
        assert_eq!(workers[1].resumes.get(), 1);
        assert_eq!(workers[2].resumes.get(), 1);
    }

    #[test]
    fn drain_marks_the_status_and_syncs_a_file_image() {
        let status = Arc::new(DeviceStatus::new(1, 1));
        let path = std::env::temp_dir().join(format!("bp-quiesce-{}.img", std::process::id()));
        std::fs::File::create(&path)
            .unwrap()
            .set_len(1 << 20)
            .unwrap();
        let spec = crate::image::ImageSpec::Path(path.clone());
        let image = Arc::new(Image::open(&spec, false, CacheMode::Writeback, None).unwrap());
        let q = Quiescer::new(Workers::new(Vec::new()), image, Arc::clone(&status));
        let done = q.drain(true).unwrap();
        assert_eq!((done.waited_requests, done.flushed), (0, true));
        assert!(status.drained.load(Ordering::Relaxed));
        assert!(status.migration_blockers()[0].starts_with("draining: "));
        // Idempotent both ways.
        assert!(!q.drain(false).unwrap().flushed);
        q.resume().unwrap();
        q.resume().unwrap();
        assert!(!status.drained.load(Ordering::Relaxed));
        let null = Arc::new(
            Image::open(
                &crate::image::ImageSpec::Null { size: 1 << 20 },
                false,
                CacheMode::Writeback,
                None,
            )
            .unwrap(),
        );
        let q = Quiescer::new(Workers::new(Vec::new()), null, Arc::clone(&status));
        assert!(!q.drain(true).unwrap().flushed);
        let _ = std::fs::remove_file(&path);
    }
}
