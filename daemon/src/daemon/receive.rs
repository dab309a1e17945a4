//! ReceiveMigrationData: the destination node's side of a copy from another node. The
//! stream's messages are written into the incoming disk's new image
//! ([`crate::mirror::sink`]); `complete` makes the image durable, marks it complete
//! (persisted) and resumes the frontend, which was drained until then; `reopened` drains it
//! again.
//!
//! "Complete" holds only while the source can still say otherwise: when the stream ends (the
//! source node gone, the copy cancelled there) before this disk's VMM runs the VM, the disk
//! goes back to incomplete and drained, since the source may be written again unseen. Once
//! the VMM runs the VM here, nothing takes the image back: a `reopened` then is refused
//! (both nodes would serve; the takeover reports it).

use std::sync::Arc;
use std::time::{Duration, Instant};

use log::{info, warn};
use tokio::sync::mpsc;
use tonic::{Status, Streaming};

use crate::admin;
use crate::migration;
use crate::mirror::image::DestinationImage;
use crate::mirror::sink::{Sink, Step};
use crate::pb::{EventKind, MigrationData, MigrationDataAck};
use crate::state::{MigrationStorage, RemoteSource};
use crate::supervisor::DiskHandle;
use crate::sync::lock;

use super::Daemon;

/// A checked stream: the incoming disk and its image.
pub struct Receiving {
    disk: Arc<DiskHandle>,
    from: RemoteSource,
    /// Used by one blocking task at a time.
    sink: Arc<std::sync::Mutex<Sink>>,
}

/// What the disk does after a marker.
enum After {
    /// It serves (complete), or goes on serving (a `reopened` refused: its VMM runs the VM).
    Serves,
    /// It serves nothing until the copy completes (again).
    Waits,
}

impl Daemon {
    /// Checks the first message of a stream: it names an incoming disk of this node whose
    /// source is `source_disk` with local storage, whose image is not complete and that
    /// receives no other stream now; the image is reset to zeros (a new copy starts over).
    pub async fn start_receiving(&self, first: &MigrationData) -> Result<Receiving, Status> {
        let id = &first.disk;
        let disk = self
            .get_handle(id)
            .map_err(|_| Status::not_found(format!("disk: no disk named {id:?} here")))?;
        let from = disk
            .runtime()
            .incoming_from
            .filter(|from| from.storage == MigrationStorage::Local)
            .ok_or_else(|| {
                Status::failed_precondition(format!(
                    "disk: {id} is not the destination of a copy from another node"
                ))
            })?;
        if !from.image_incomplete {
            return Err(Status::failed_precondition(format!(
                "disk: the image of {id} is complete already (its copy from {from} ended)"
            )));
        }
        if from.disk != first.source_disk {
            return Err(Status::failed_precondition(format!(
                "source_disk: {id} is the destination of {from}, not of disk {:?}",
                first.source_disk
            )));
        }
        if !lock(&self.receiving).insert(id.clone()) {
            return Err(Status::failed_precondition(format!(
                "disk: {id} is receiving a copy already"
            )));
        }
        // Created with the source's capacity (AddDisk), which a migrating disk keeps. An
        // earlier, broken copy may have written blocks that are holes on the source now.
        let path = disk.spec.image.clone();
        let opened = tokio::task::spawn_blocking(move || {
            let image = DestinationImage::open(&path, std::fs::metadata(&path)?.len())?;
            image.reset()?;
            Ok::<_, std::io::Error>(image)
        })
        .await
        .map_err(std::io::Error::other)
        .and_then(|r| r);
        let image = match opened {
            Ok(image) => image,
            Err(e) => {
                lock(&self.receiving).remove(id);
                return Err(Status::internal(format!(
                    "disk: opening {}: {e}",
                    disk.spec.image.display()
                )));
            }
        };
        info!("disk {id}: receiving its image from {from}");
        Ok(Receiving {
            disk,
            from,
            sink: Arc::new(std::sync::Mutex::new(Sink::new(image))),
        })
    }

    /// Applies the rest of a stream checked by [`Daemon::start_receiving`], answering the
    /// markers on `acks`; an error ends the stream with its status.
    pub async fn receive(
        &self,
        receiving: Receiving,
        mut inbound: Streaming<MigrationData>,
        acks: mpsc::Sender<Result<MigrationDataAck, Status>>,
    ) {
        let id = receiving.disk.spec.id.clone();
        let failure = loop {
            let message = match inbound.message().await {
                Ok(Some(message)) => message,
                Ok(None) => break None,
                Err(status) => break Some(format!("the stream broke: {}", status.message())),
            };
            // Applied off the async threads: a write of up to 2 MiB, or an fdatasync.
            let sink = Arc::clone(&receiving.sink);
            let step = tokio::task::spawn_blocking(move || lock(&sink).apply(&message))
                .await
                .map_err(|e| e.to_string())
                .and_then(|step| step.map_err(|e| e.to_string()));
            let (synced, complete) = match step {
                Ok(Step::Wrote(_) | Step::Nothing) => continue,
                Ok(Step::Complete(synced)) => (synced, true),
                Ok(Step::Reopened) => (Duration::ZERO, false),
                Err(e) => {
                    let _ = acks.send(Err(Status::internal(e.clone()))).await;
                    break Some(e);
                }
            };
            let started = Instant::now();
            match self.image_complete(&receiving, complete, synced).await {
                Ok(after) => {
                    let ack = MigrationDataAck {
                        serving: matches!(after, After::Serves),
                        bytes_written: lock(&receiving.sink).written(),
                        sync_us: synced.as_micros() as u64,
                        frontend_us: started.elapsed().as_micros() as u64,
                    };
                    if acks.send(Ok(ack)).await.is_err() {
                        break Some("the source went away".into());
                    }
                }
                Err(why) => {
                    let _ = acks.send(Err(Status::internal(why.clone()))).await;
                    break Some(why);
                }
            }
        };
        // Still marked as receiving while it ends: a new stream's reset and writes must not
        // race with this one's discard of the partial image.
        self.stream_ended(&receiving, failure).await;
        lock(&self.receiving).remove(&id);
    }

    /// After the stream: an incomplete image is reported; a complete one whose VMM does not
    /// run the VM yet goes back to incomplete (the source can no longer say it was written).
    async fn stream_ended(&self, receiving: &Receiving, failure: Option<String>) {
        let disk = &receiving.disk;
        let id = &disk.spec.id;
        let why = failure.map(|w| format!(": {w}")).unwrap_or_default();
        let Some(from) = disk.runtime().incoming_from else {
            // Taken over: the source was retired, which ended the stream.
            info!(
                "disk {id}: the copy's stream from {} ended{why}",
                receiving.from
            );
            return;
        };
        if from.image_incomplete {
            // Nothing of the disk stays on this node after a failed copy: the part copied so
            // far is discarded (a new copy starts over from zeros anyway). It was never
            // served: the frontend stays drained while the image is incomplete.
            let sink = Arc::clone(&receiving.sink);
            let discarded = tokio::task::spawn_blocking(move || lock(&sink).discard())
                .await
                .map_err(std::io::Error::other)
                .and_then(|r| r);
            let discarded = match discarded {
                Ok(()) => "its partial image was discarded".to_string(),
                Err(e) => format!("discarding its partial image failed ({e})"),
            };
            let message = format!(
                "the copy from {} ended before the image was complete{why}; {discarded}, and \
                 the disk serves nothing until a new copy completes it (or RemoveDisk deletes \
                 it)",
                receiving.from
            );
            warn!("disk {id}: {message}");
            self.events
                .emit(EventKind::MigrationFailed, id, disk.runtime().pid, message);
            return;
        }
        if self.vmm_runs(disk).await {
            info!(
                "disk {id}: the copy's stream from {} ended{why}",
                receiving.from
            );
            return;
        }
        let message = format!(
            "the copy from {} ended{why} after it was complete, before this disk's VMM ran \
             the VM: the source may be written again unseen, so the disk serves nothing until \
             a new copy completes it",
            receiving.from
        );
        warn!("disk {id}: {message}");
        let _op = disk.lifecycle_op.lock().await;
        if let Err(e) = self.set_image_complete(disk, false).await {
            warn!("disk {id}: {e}");
        }
        self.follow_image_state(disk, false).await;
        self.events
            .emit(EventKind::MigrationFailed, id, disk.runtime().pid, message);
    }

    /// Whether disk's VMM runs the VM (connected, a ring running), asked now.
    async fn vmm_runs(&self, disk: &DiskHandle) -> bool {
        match admin::status(&disk.paths.admin_socket).await {
            Ok(status) => {
                disk.record_status(&status);
                migration::destination_runs(&status)
            }
            // Unknown: taken as running, so that a VM that may run here is never stopped.
            Err(_) => true,
        }
    }

    /// Records the image as complete or not (persisted), unless the disk was removed.
    async fn set_image_complete(
        &self,
        disk: &Arc<DiskHandle>,
        complete: bool,
    ) -> Result<(), String> {
        let id = &disk.spec.id;
        let _ops = self.ops.lock().await;
        if !lock(&self.disks)
            .get(id)
            .is_some_and(|d| Arc::ptr_eq(d, disk))
        {
            return Err(format!("disk {id} was removed here"));
        }
        let before = disk.runtime().incoming_from;
        disk.update(|rt| {
            if let Some(from) = &mut rt.incoming_from {
                from.image_incomplete = !complete;
            }
        });
        if let Err(e) = self.persist() {
            disk.update(|rt| rt.incoming_from = before);
            return Err(format!("persisting the state: {e}"));
        }
        Ok(())
    }

    /// Makes the frontend serve (`complete`, unless the operator drained the disk) or not;
    /// returns whether it serves. A frontend that does not answer now follows at the
    /// supervisor's next poll.
    async fn follow_image_state(&self, disk: &DiskHandle, complete: bool) -> bool {
        let socket = &disk.paths.admin_socket;
        let result = if disk.runtime().wants_drained() {
            admin::drain(socket, false).await.map(|_| ())
        } else {
            admin::resume(socket).await
        };
        if let Err(e) = result {
            warn!(
                "disk {}: {e}; the supervisor's poll makes the frontend follow",
                disk.spec.id
            );
        }
        match admin::status(socket).await {
            Ok(status) => {
                disk.record_status(&status);
                complete && !status.drained
            }
            Err(_) => false,
        }
    }

    /// A marker: the image is complete (persisted, then the frontend resumed) or not any
    /// more (persisted, then the frontend drained) — but for a `reopened` while the VMM runs
    /// the VM here, which is refused (the disk serves on).
    async fn image_complete(
        &self,
        receiving: &Receiving,
        complete: bool,
        synced: Duration,
    ) -> Result<After, String> {
        let disk = &receiving.disk;
        let id = &disk.spec.id;
        // The order Drain and Resume take them: this disk's lifecycle, then the table.
        let _op = disk.lifecycle_op.lock().await;
        let pid = disk.runtime().pid;
        if !complete && self.vmm_runs(disk).await {
            let message = format!(
                "{} serves again, but this disk's VMM runs the VM already: it serves on, and \
                 the source's writes since are not copied (both nodes served the disk)",
                receiving.from
            );
            warn!("disk {id}: {message}");
            self.events.emit(EventKind::BothServing, id, pid, message);
            return Ok(After::Serves);
        }
        self.set_image_complete(disk, complete).await?;
        let serves = self.follow_image_state(disk, complete).await;
        let (kind, message) = if complete {
            (
                EventKind::MigrationCopied,
                format!(
                    "the image from {} is complete and durable ({} bytes written; fdatasync {} \
                     µs): the disk {}",
                    receiving.from,
                    lock(&receiving.sink).written(),
                    synced.as_micros(),
                    if serves {
                        "serves"
                    } else {
                        "serves once it is resumed"
                    }
                ),
            )
        } else {
            (
                EventKind::MigrationFailed,
                format!(
                    "{} serves again after the copy was complete: the disk serves nothing \
                     until the copy completes again",
                    receiving.from
                ),
            )
        };
        info!("disk {id}: {message}");
        self.events.emit(kind, id, pid, message);
        Ok(if serves { After::Serves } else { After::Waits })
    }
}
