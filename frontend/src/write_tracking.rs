//! blkplaned's TrackWrites, applied: the admin channel's [`TrackWrites`] for a disk, which
//! hands the bitmap of written image blocks (a [`WriteBitmap`] blkplaned copies the disk to
//! another node by) to every queue worker, or takes it back.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use blkplane_lock::lock;
use blkplane_proto::write_bitmap::WriteBitmap;
use log::{info, warn};

use crate::admin::TrackWrites;
use crate::stats::DeviceStatus;
use crate::worker::{Command, Workers};

/// Installs or removes the write bitmap in every queue worker of the disk, at once: a command
/// each, answered once every worker marks in the new bitmap (the writes it has in flight
/// included) or in none.
pub struct WriteTracking {
    workers: Workers,
    status: Arc<DeviceStatus>,
    /// Serializes changes (two admin connections may ask at once): the workers and the
    /// status flag agree after each.
    serial: Mutex<()>,
}

impl WriteTracking {
    /// Control over the write tracking of `workers`, reported in `status`.
    pub fn new(workers: Workers, status: Arc<DeviceStatus>) -> Self {
        Self {
            workers,
            status,
            serial: Mutex::new(()),
        }
    }

    /// Hands `bitmap` to every worker and waits for each; the error names the first worker
    /// that is gone.
    fn install(&self, bitmap: &Option<Arc<WriteBitmap>>) -> Result<(), usize> {
        // Posted to all first, so that every worker switches at about the same time.
        let answers: Vec<_> = self
            .workers
            .iter()
            .map(|w| {
                w.post(|reply| Command::TrackWrites {
                    bitmap: bitmap.clone(),
                    reply,
                })
            })
            .collect();
        let mut failed = None;
        for (index, answer) in answers.into_iter().enumerate() {
            if answer.ok().and_then(|a| a.recv().ok()).is_none() {
                failed.get_or_insert(index);
            }
        }
        failed.map_or(Ok(()), Err)
    }
}

impl TrackWrites for WriteTracking {
    fn track_writes(&self, bitmap: Option<Arc<WriteBitmap>>) -> Result<(), String> {
        let _serial = lock(&self.serial);
        let geometry = bitmap.as_ref().map(|b| (b.blocks(), b.granularity()));
        if let Err(index) = self.install(&bitmap) {
            // Some workers would mark and others not: none does, and the status says so.
            if bitmap.is_some() && self.install(&None).is_err() {
                warn!("taking the write bitmap back: a queue worker is gone");
            }
            self.status.tracking_writes.store(false, Ordering::Relaxed);
            return Err(format!("queue worker {index} is gone"));
        }
        self.status
            .tracking_writes
            .store(geometry.is_some(), Ordering::Relaxed);
        match geometry {
            Some((blocks, granularity)) => info!(
                "tracking the guest's writes: {blocks} blocks of {granularity} bytes (blkplaned \
                 copies the disk)"
            ),
            None => info!("no longer tracking the guest's writes"),
        }
        Ok(())
    }
}
