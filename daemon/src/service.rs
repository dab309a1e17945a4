//! The gRPC service `blkplane.v1.Control`: a thin layer over [`Daemon`] that turns its errors
//! into canonical status codes.

use std::sync::Arc;

use blkplane_proto::v1::ResizeDone;
use log::{info, warn};
use tonic::{Request, Response, Status};

use crate::daemon::{Daemon, DaemonError};
use crate::events::EventStream;
use crate::pb::control_server::Control;
use crate::pb::{
    AddDiskRequest, AddMigrationBlockerRequest, CancelMigrationSourceResponse, CommitRequest, Disk,
    DrainDiskRequest, DrainDiskResponse, GetDiskRequest, GetStatsRequest, GetStatsResponse,
    GetThrottleRequest, GetVersionRequest, ListDisksRequest, ListDisksResponse,
    MigrationSourceRequest, MigrationStatus, RemoveDiskRequest, RemoveDiskResponse,
    RemoveMigrationBlockerRequest, ResizeDiskRequest, ResumeDiskRequest, ResumeDiskResponse,
    RetireMigrationSourceResponse, SetThrottleRequest, SnapshotRequest, StartMigrationRequest,
    ThrottleConfig, VersionInfo, WatchEventsRequest,
};
use crate::pb::{MigrationData, MigrationDataAck};
use crate::validate::ValidationError;

/// The gRPC service.
#[derive(Debug, Clone)]
pub struct ControlService {
    daemon: Arc<Daemon>,
}

impl ControlService {
    /// A service over `daemon`.
    pub fn new(daemon: Arc<Daemon>) -> ControlService {
        ControlService { daemon }
    }
}

/// The status code of each error: the message already names the field or the disk.
pub fn to_status(e: DaemonError) -> Status {
    let msg = e.to_string();
    match &e {
        DaemonError::Validation(v) => match v {
            ValidationError::Invalid { .. } => Status::invalid_argument(msg),
            ValidationError::NotFound { .. } => Status::not_found(msg),
            ValidationError::AlreadyExists { .. } => Status::already_exists(msg),
            ValidationError::FailedPrecondition { .. } => Status::failed_precondition(msg),
            ValidationError::ResourceExhausted { .. } => Status::resource_exhausted(msg),
            ValidationError::Unimplemented { .. } => Status::unimplemented(msg),
        },
        DaemonError::NotFound(_) | DaemonError::NoSuchBlocker { .. } => Status::not_found(msg),
        DaemonError::Peer { source, .. } => Status::new(source.code(), msg),
        DaemonError::VmmConnected(_)
        | DaemonError::Drained(_)
        | DaemonError::Migrating { .. }
        | DaemonError::MigratingAcross { .. }
        | DaemonError::NotRunning { .. }
        | DaemonError::Shrink { .. }
        | DaemonError::Committing(_)
        | DaemonError::CannotCommit { .. }
        | DaemonError::Refused { .. } => Status::failed_precondition(msg),
        DaemonError::Admin { .. } => Status::unavailable(msg),
        // The message carries the frontend's own words (the end of its log).
        DaemonError::Start { .. }
        | DaemonError::State(_)
        | DaemonError::Io { .. }
        | DaemonError::CommitFailed { .. } => Status::internal(msg),
    }
}

/// Logs a failed call (the caller sees the same message).
fn logged(call: &str, e: DaemonError) -> Status {
    let status = to_status(e);
    warn!("{call}: {:?}: {}", status.code(), status.message());
    status
}

#[tonic::async_trait]
impl Control for ControlService {
    async fn add_disk(&self, request: Request<AddDiskRequest>) -> Result<Response<Disk>, Status> {
        let req = request.into_inner();
        let image = req.settings.as_ref().map_or("", |s| s.image.as_str());
        if let Some(from) = &req.incoming_from {
            info!(
                "AddDisk {:?} image {image:?} incoming from disk {:?} on {:?}",
                req.id, from.disk, from.endpoint
            );
        } else if req.incoming_for.is_empty() {
            info!("AddDisk {:?} image {image:?}", req.id);
        } else {
            info!(
                "AddDisk {:?} image {image:?} incoming for {:?}",
                req.id, req.incoming_for
            );
        }
        // Run to the end even if the caller goes away: an AddDisk cut between the source
        // node's agreement and its undo would leave the migration recorded there.
        let daemon = Arc::clone(&self.daemon);
        let disk = tokio::spawn(async move { daemon.add_disk(req).await })
            .await
            .map_err(|e| Status::internal(format!("AddDisk: {e}")))?
            .map_err(|e| logged("AddDisk", e))?;
        Ok(Response::new(disk))
    }

    async fn remove_disk(
        &self,
        request: Request<RemoveDiskRequest>,
    ) -> Result<Response<RemoveDiskResponse>, Status> {
        let req = request.into_inner();
        info!("RemoveDisk {:?} force={}", req.id, req.force);
        self.daemon
            .remove_disk(&req.id, req.force)
            .await
            .map_err(|e| logged("RemoveDisk", e))?;
        Ok(Response::new(RemoveDiskResponse {}))
    }

    async fn list_disks(
        &self,
        _request: Request<ListDisksRequest>,
    ) -> Result<Response<ListDisksResponse>, Status> {
        Ok(Response::new(ListDisksResponse {
            disks: self.daemon.list_disks().await,
        }))
    }

    async fn get_disk(&self, request: Request<GetDiskRequest>) -> Result<Response<Disk>, Status> {
        let id = request.into_inner().id;
        let disk = self.daemon.get_disk(&id).await.map_err(to_status)?;
        Ok(Response::new(disk))
    }

    async fn resize_disk(
        &self,
        request: Request<ResizeDiskRequest>,
    ) -> Result<Response<ResizeDone>, Status> {
        let req = request.into_inner();
        info!("ResizeDisk {:?} to {} bytes", req.id, req.new_size_bytes);
        let done = self
            .daemon
            .resize_disk(&req.id, req.new_size_bytes)
            .await
            .map_err(|e| logged("ResizeDisk", e))?;
        Ok(Response::new(done))
    }

    async fn prepare_migration_source(
        &self,
        request: Request<MigrationSourceRequest>,
    ) -> Result<Response<Disk>, Status> {
        let req = request.into_inner();
        info!(
            "PrepareMigrationSource {:?} to {:?}",
            req.id, req.destination
        );
        let disk = self
            .daemon
            .prepare_migration_source(&req)
            .await
            .map_err(|e| logged("PrepareMigrationSource", e))?;
        Ok(Response::new(disk))
    }

    async fn retire_migration_source(
        &self,
        request: Request<MigrationSourceRequest>,
    ) -> Result<Response<RetireMigrationSourceResponse>, Status> {
        let req = request.into_inner();
        let outcome = self
            .daemon
            .retire_migration_source(&req)
            .await
            .map_err(|e| logged("RetireMigrationSource", e))?;
        Ok(Response::new(RetireMigrationSourceResponse {
            outcome: outcome as i32,
        }))
    }

    async fn cancel_migration_source(
        &self,
        request: Request<MigrationSourceRequest>,
    ) -> Result<Response<CancelMigrationSourceResponse>, Status> {
        let req = request.into_inner();
        info!(
            "CancelMigrationSource {:?} to {:?}",
            req.id, req.destination
        );
        let cancelled = self
            .daemon
            .cancel_migration_source(&req)
            .await
            .map_err(|e| logged("CancelMigrationSource", e))?;
        Ok(Response::new(CancelMigrationSourceResponse {
            cancelled: cancelled.as_ref().map(|c| c.to_pb()),
        }))
    }

    async fn snapshot(&self, request: Request<SnapshotRequest>) -> Result<Response<Disk>, Status> {
        let req = request.into_inner();
        info!("Snapshot {:?} to {:?}", req.id, req.overlay);
        let disk = self
            .daemon
            .snapshot(&req.id, &req.overlay)
            .await
            .map_err(|e| logged("Snapshot", e))?;
        Ok(Response::new(disk))
    }

    async fn commit(&self, request: Request<CommitRequest>) -> Result<Response<Disk>, Status> {
        let req = request.into_inner();
        info!("Commit {:?}", req.id);
        let disk = self
            .daemon
            .commit(&req.id)
            .await
            .map_err(|e| logged("Commit", e))?;
        Ok(Response::new(disk))
    }

    async fn get_stats(
        &self,
        request: Request<GetStatsRequest>,
    ) -> Result<Response<GetStatsResponse>, Status> {
        let id = request.into_inner().id;
        let disks = self.daemon.get_stats(&id).await.map_err(to_status)?;
        Ok(Response::new(GetStatsResponse { disks }))
    }

    async fn drain(
        &self,
        request: Request<DrainDiskRequest>,
    ) -> Result<Response<DrainDiskResponse>, Status> {
        let req = request.into_inner();
        info!("Drain {:?} flush={}", req.id, req.flush);
        let done = self
            .daemon
            .drain(&req.id, req.flush)
            .await
            .map_err(|e| logged("Drain", e))?;
        Ok(Response::new(done))
    }

    async fn resume(
        &self,
        request: Request<ResumeDiskRequest>,
    ) -> Result<Response<ResumeDiskResponse>, Status> {
        let id = request.into_inner().id;
        info!("Resume {id:?}");
        let was_drained = self
            .daemon
            .resume(&id)
            .await
            .map_err(|e| logged("Resume", e))?;
        Ok(Response::new(ResumeDiskResponse { was_drained }))
    }

    async fn add_migration_blocker(
        &self,
        request: Request<AddMigrationBlockerRequest>,
    ) -> Result<Response<MigrationStatus>, Status> {
        let req = request.into_inner();
        info!(
            "AddMigrationBlocker {:?} reason {} {:?}",
            req.id, req.reason, req.message
        );
        let status = self
            .daemon
            .add_migration_blocker(&req.id, req.reason, &req.message)
            .await
            .map_err(|e| logged("AddMigrationBlocker", e))?;
        Ok(Response::new(status))
    }

    async fn remove_migration_blocker(
        &self,
        request: Request<RemoveMigrationBlockerRequest>,
    ) -> Result<Response<MigrationStatus>, Status> {
        let req = request.into_inner();
        info!("RemoveMigrationBlocker {:?} reason {}", req.id, req.reason);
        let status = self
            .daemon
            .remove_migration_blocker(&req.id, req.reason)
            .await
            .map_err(|e| logged("RemoveMigrationBlocker", e))?;
        Ok(Response::new(status))
    }

    async fn set_throttle(
        &self,
        request: Request<SetThrottleRequest>,
    ) -> Result<Response<ThrottleConfig>, Status> {
        let req = request.into_inner();
        let limits = req.limits.unwrap_or_default();
        info!(
            "SetThrottle {:?} limits {:?} group {:?}",
            req.id,
            blkplane_api::limits::set_limits(&limits),
            req.group
        );
        let config = self
            .daemon
            .set_throttle(&req.id, limits, &req.group)
            .await
            .map_err(|e| logged("SetThrottle", e))?;
        Ok(Response::new(config))
    }

    async fn get_throttle(
        &self,
        request: Request<GetThrottleRequest>,
    ) -> Result<Response<ThrottleConfig>, Status> {
        let id = request.into_inner().id;
        let config = self
            .daemon
            .get_throttle(&id)
            .map_err(|e| logged("GetThrottle", e))?;
        Ok(Response::new(config))
    }

    async fn get_version(
        &self,
        _request: Request<GetVersionRequest>,
    ) -> Result<Response<VersionInfo>, Status> {
        Ok(Response::new(VersionInfo {
            version: blkplane_build_info::PACKAGE_VERSION.to_string(),
            commit: blkplane_build_info::COMMIT.to_string(),
        }))
    }

    async fn start_migration(
        &self,
        request: Request<StartMigrationRequest>,
    ) -> Result<Response<Disk>, Status> {
        let req = request.into_inner();
        info!(
            "StartMigration {:?} to disk {:?} on {:?} at {} bytes/s",
            req.id, req.to_disk, req.to_endpoint, req.bandwidth_bytes_per_second
        );
        let disk = self
            .daemon
            .start_migration(&req)
            .await
            .map_err(|e| logged("StartMigration", e))?;
        Ok(Response::new(disk))
    }

    type ReceiveMigrationDataStream = std::pin::Pin<
        Box<dyn tokio_stream::Stream<Item = Result<MigrationDataAck, Status>> + Send>,
    >;

    async fn receive_migration_data(
        &self,
        request: Request<tonic::Streaming<MigrationData>>,
    ) -> Result<Response<Self::ReceiveMigrationDataStream>, Status> {
        let mut inbound = request.into_inner();
        let first = inbound
            .message()
            .await?
            .ok_or_else(|| Status::invalid_argument("disk: the stream is empty"))?;
        info!(
            "ReceiveMigrationData for disk {:?} from disk {:?}",
            first.disk, first.source_disk
        );
        let receiving = self
            .daemon
            .start_receiving(&first)
            .await
            .inspect_err(|status| {
                warn!(
                    "ReceiveMigrationData: {:?}: {}",
                    status.code(),
                    status.message()
                )
            })?;
        let (acks, answers) = tokio::sync::mpsc::channel(4);
        let daemon = Arc::clone(&self.daemon);
        tokio::spawn(async move { daemon.receive(receiving, inbound, acks).await });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(answers),
        )))
    }

    type WatchEventsStream = EventStream;

    async fn watch_events(
        &self,
        request: Request<WatchEventsRequest>,
    ) -> Result<Response<Self::WatchEventsStream>, Status> {
        let id = request.into_inner().id;
        Ok(Response::new(self.daemon.events().watch(id)))
    }
}
