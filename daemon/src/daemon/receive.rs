//! ReceiveMigrationData: the destination node's side of a copy from another node. The
//! stream's messages are written into the incoming disk's new image
//! ([`crate::mirror::sink`]); `complete` makes the image durable, marks it complete
//! (persisted) and resumes the frontend, which was drained until then; `reopened` drains it
//! again.

use std::sync::Arc;
use std::time::{Duration, Instant};

use log::{info, warn};
use tokio::sync::mpsc;
use tonic::{Status, Streaming};

use crate::admin;
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

impl Daemon {
    /// Checks the first message of a stream: it names an incoming disk of this node whose
    /// source is `source_disk` with local storage, not receiving another stream now.
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
        // Created with the source's capacity (AddDisk), which a migrating disk keeps.
        let image = match std::fs::metadata(&disk.spec.image)
            .and_then(|m| DestinationImage::open(&disk.spec.image, m.len()))
            .and_then(|image| image.reset().map(|()| image))
        {
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
            // Applied off the async threads: a write of up to 4 MiB, or an fdatasync.
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
            let ack = self.image_complete(&receiving, complete, synced).await;
            match ack {
                Ok(serving) => {
                    let ack = MigrationDataAck {
                        serving,
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
        lock(&self.receiving).remove(&id);
        let complete = !receiving
            .disk
            .runtime()
            .incoming_from
            .is_some_and(|f| f.image_incomplete);
        match failure {
            None if complete => info!("disk {id}: the copy's stream from {} ended", receiving.from),
            Some(why) if complete => {
                info!(
                    "disk {id}: the copy's stream from {} ended: {why}",
                    receiving.from
                )
            }
            why => {
                let message = format!(
                    "the copy from {} ended before the image was complete{}; the disk serves \
                     nothing until a new copy completes it (or RemoveDisk deletes it)",
                    receiving.from,
                    why.map(|w| format!(": {w}")).unwrap_or_default()
                );
                warn!("disk {id}: {message}");
                self.events.emit(
                    EventKind::MigrationFailed,
                    &id,
                    receiving.disk.runtime().pid,
                    message,
                );
            }
        }
    }

    /// The image is complete (`true`: persisted, then the frontend resumed) or not any more
    /// (`false`: persisted, then the frontend drained). Returns whether the disk serves.
    async fn image_complete(
        &self,
        receiving: &Receiving,
        complete: bool,
        synced: Duration,
    ) -> Result<bool, String> {
        let disk = &receiving.disk;
        let id = &disk.spec.id;
        let _op = disk.lifecycle_op.lock().await;
        {
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
        }
        let socket = &disk.paths.admin_socket;
        let rt = disk.runtime();
        let result = if complete {
            if rt.wants_drained() {
                // The operator drained the disk: it stays so until Resume.
                Ok(())
            } else {
                admin::resume(socket).await
            }
        } else {
            admin::drain(socket, false).await.map(|_| ())
        };
        // A frontend that does not answer now follows at the supervisor's next poll.
        if let Err(e) = result {
            warn!("disk {id}: {e}; the supervisor's poll makes the frontend follow");
        }
        if let Ok(status) = admin::status(socket).await {
            disk.record_status(&status);
        }
        let (kind, message) = if complete {
            (
                EventKind::MigrationCopied,
                format!(
                    "the image from {} is complete and durable ({} bytes written; fdatasync \
                     {} µs): the disk serves",
                    receiving.from,
                    lock(&receiving.sink).written(),
                    synced.as_micros()
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
        self.events.emit(kind, id, rt.pid, message);
        Ok(complete && !rt.lifecycle.drained)
    }
}
