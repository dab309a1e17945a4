//! The copy job on the source node (StartMigration): the bulk pass, the passes over written
//! blocks, the switch-over, and watching the source until it is retired.
//!
//! The job talks to the disk's frontend through [`SourceDisk`] (the admin channel in
//! production) and to the destination node over one ReceiveMigrationData stream. Its
//! progress is a [`pb::MigrationCopy`] others read; its milestones are events.
//!
//! The switch-over: the VMM stops the source's rings when it hands the VM over (GET_VRING_BASE,
//! which the frontend answers once every request of the ring has completed, and after an
//! fdatasync); the job sees no ring running, sends every block still marked, then `complete`,
//! and the destination, once its image is durable, serves. Should the source's rings run
//! again before it is retired (the VMM's migration failed and the VM goes on here), the job
//! tells the destination it is `reopened` — it stops serving — and copies on.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use blkplane_api::endpoint::HostPort;
use blkplane_proto::v1::FrontendStatus;
use blkplane_proto::write_bitmap::WriteBitmap;
use log::{info, warn};
use thiserror::Error;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;

use super::extents::{chunks, is_zero, runs_of_word, Range};
use super::image::SourceImage;
use super::pace::{Convergence, Decision, Pacer, PassReport};
use super::{granularity, CHUNK};
use crate::events::EventBus;
use crate::migration;
use crate::pb::{self, EventKind, MigrationCopyPhase, MigrationData, MigrationDataAck};
use crate::peer::{PeerError, Peers};
use crate::sync::lock;

/// How long one message may wait for the destination to take it, and an ack to come.
pub const STALL_TIMEOUT: Duration = Duration::from_secs(30);

/// How often the source's rings are looked at while nothing is left to send.
const IDLE_POLL: Duration = Duration::from_millis(5);

/// How often a pass looks whether the frontend still marks writes.
const FRONTEND_CHECK: Duration = Duration::from_millis(500);

/// Reads of the source image a pass keeps in flight.
const READS_IN_FLIGHT: usize = 16;

/// How often a complete copy looks whether the source serves again.
const COMPLETE_POLL: Duration = Duration::from_millis(20);

/// What the job needs of the source disk's frontend.
pub trait SourceDisk {
    /// The frontend's status now.
    fn status(&self) -> impl std::future::Future<Output = Result<FrontendStatus, String>> + Send;
    /// Starts (`Some`) or stops marking written blocks.
    fn track_writes(
        &self,
        bitmap: Option<&WriteBitmap>,
    ) -> impl std::future::Future<Output = Result<(), String>> + Send;
    /// Limits the disk's writes to `bytes_per_second` (0: back to the disk's own limits).
    fn limit_writes(
        &self,
        bytes_per_second: u64,
    ) -> impl std::future::Future<Output = Result<(), String>> + Send;
}

/// What to copy where.
#[derive(Debug, Clone)]
pub struct CopyRequest {
    /// The source disk's id.
    pub id: String,
    /// Its image.
    pub image: PathBuf,
    /// Its capacity in bytes.
    pub capacity: u64,
    /// The destination node.
    pub endpoint: HostPort,
    /// The destination disk's id there.
    pub to_disk: String,
    /// The copy's limit, bytes/s (0: none).
    pub bandwidth: u64,
}

/// Why a copy failed.
#[derive(Debug, Error)]
pub enum CopyError {
    /// The frontend could not be asked, or refused.
    #[error("the source frontend: {0}")]
    Frontend(String),
    /// The frontend was restarted, or stopped marking writes: writes since are not marked.
    #[error(
        "the source frontend {}: writes since are not marked; start the migration again",
        if .was == .now { format!("(pid {was}) stopped marking writes") }
        else { format!("was restarted (pid {was} → {now})") }
    )]
    FrontendRestarted {
        /// The pid that tracked.
        was: u32,
        /// The pid now.
        now: u32,
    },
    /// The write bitmap could not be made (an absurd capacity, no memory).
    #[error("the write bitmap: {0}")]
    Bitmap(#[from] blkplane_proto::write_bitmap::WriteBitmapError),
    /// Reading the source image failed.
    #[error("reading {path}: {source}")]
    Read {
        /// The image.
        path: String,
        /// What failed.
        source: std::io::Error,
    },
    /// The destination node could not be reached.
    #[error(transparent)]
    Peer(#[from] PeerError),
    /// The destination ended the stream or refused a message.
    #[error("the destination {endpoint} ended the copy: {why}")]
    Destination {
        /// The node.
        endpoint: String,
        /// Its words.
        why: String,
    },
    /// The connection to the destination broke (the node died or became unreachable: the
    /// stream's keepalive pings went unanswered), as opposed to the destination's own refusal.
    #[error("the connection to the destination {endpoint} broke ({why})")]
    ConnectionLost {
        /// The node.
        endpoint: String,
        /// The transport's words.
        why: String,
    },
    /// The destination took nothing for too long.
    #[error("the destination {endpoint} took nothing for {STALL_TIMEOUT:?}")]
    Stalled {
        /// The node.
        endpoint: String,
    },
    /// Cancelled before it was complete.
    #[error("cancelled")]
    Cancelled,
}

/// The copy's shared progress.
pub type Progress = Arc<Mutex<pb::MigrationCopy>>;

/// The stream to the destination and what came back.
struct Stream {
    tx: mpsc::Sender<MigrationData>,
    acks: tonic::Streaming<MigrationDataAck>,
    endpoint: String,
    pacer: Pacer,
    clock: Instant,
    /// The bandwidth limit is neither applied nor counted: the switch-over, which the VM waits
    /// for (QEMU lifts its own `max-bandwidth` for a stopped VM's last pass the same way).
    full_speed: bool,
}

impl Stream {
    async fn open(peers: &Peers, req: &CopyRequest) -> Result<Stream, CopyError> {
        let mut client = peers.stream_client(&req.endpoint).await?;
        let (tx, rx) = mpsc::channel(4);
        let endpoint = req.endpoint.to_string();
        tx.send(MigrationData {
            disk: req.to_disk.clone(),
            source_disk: req.id.clone(),
            ..MigrationData::default()
        })
        .await
        .map_err(|_| CopyError::Cancelled)?;
        let call = client.receive_migration_data(ReceiverStream::new(rx));
        let acks = match tokio::time::timeout(STALL_TIMEOUT, call).await {
            Ok(Ok(response)) => response.into_inner(),
            Ok(Err(status)) => {
                return Err(PeerError::Refused {
                    endpoint: endpoint.clone(),
                    status,
                }
                .into())
            }
            Err(_) => return Err(CopyError::Stalled { endpoint }),
        };
        Ok(Stream {
            tx,
            acks,
            endpoint,
            pacer: Pacer::new(req.bandwidth, Duration::ZERO),
            clock: Instant::now(),
            full_speed: false,
        })
    }

    /// Why the destination ended the stream (its status, if it sent one).
    async fn ended(&mut self) -> CopyError {
        let why = match tokio::time::timeout(Duration::from_secs(5), self.acks.message()).await {
            Ok(Err(status)) => return self.failed(&status),
            Ok(Ok(_)) => "the stream ended".to_string(),
            Err(_) => "the stream was closed".to_string(),
        };
        CopyError::Destination {
            endpoint: self.endpoint.clone(),
            why,
        }
    }

    /// The error of a status the stream ended with: one the destination sent (its refusal),
    /// or one the transport made of a broken connection (it carries the transport's error as
    /// its source; a status received from the peer has none).
    fn failed(&self, status: &tonic::Status) -> CopyError {
        let endpoint = self.endpoint.clone();
        let why = status.message().to_string();
        if std::error::Error::source(status).is_some() {
            CopyError::ConnectionLost { endpoint, why }
        } else {
            CopyError::Destination { endpoint, why }
        }
    }

    /// Sends one message, then waits as long as the bandwidth limit says.
    async fn send(&mut self, message: MigrationData, counted: u64) -> Result<(), CopyError> {
        match tokio::time::timeout(STALL_TIMEOUT, self.tx.send(message)).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) => return Err(self.ended().await),
            Err(_) => {
                return Err(CopyError::Stalled {
                    endpoint: self.endpoint.clone(),
                })
            }
        }
        if self.full_speed {
            // Not counted either: a later pass (after a reopen) owes nothing for it.
            return Ok(());
        }
        let wait = self.pacer.sent(counted, self.clock.elapsed());
        if !wait.is_zero() {
            tokio::time::sleep(wait).await;
        }
        Ok(())
    }

    /// Waits for the ack of a marker.
    async fn ack(&mut self) -> Result<MigrationDataAck, CopyError> {
        match tokio::time::timeout(STALL_TIMEOUT, self.acks.message()).await {
            Ok(Ok(Some(ack))) => Ok(ack),
            Ok(Ok(None)) => Err(CopyError::Destination {
                endpoint: self.endpoint.clone(),
                why: "the stream ended".into(),
            }),
            Ok(Err(status)) => Err(self.failed(&status)),
            Err(_) => Err(CopyError::Stalled {
                endpoint: self.endpoint.clone(),
            }),
        }
    }
}

/// The running copy: what the loops share.
struct Job<'a, D: SourceDisk> {
    disk: &'a D,
    req: &'a CopyRequest,
    image: Arc<SourceImage>,
    bitmap: Arc<WriteBitmap>,
    stream: Stream,
    progress: Progress,
    events: EventBus,
    stop: watch::Receiver<bool>,
    /// The frontend that marks writes.
    pid: u32,
    /// Auto-converge limited the disk's writes (lifted when the job ends).
    limited: bool,
    /// When the source last looked at the frontend's status.
    checked: Instant,
}

/// Whether `status` is of the frontend `pid` and it marks writes.
fn tracks(status: &FrontendStatus, pid: u32) -> bool {
    status.pid == pid && status.tracking_writes
}

impl<D: SourceDisk> Job<'_, D> {
    fn update(&self, f: impl FnOnce(&mut pb::MigrationCopy)) {
        f(&mut lock(&self.progress));
    }

    fn stopped(&self) -> bool {
        *self.stop.borrow()
    }

    fn marked_bytes(&self) -> u64 {
        self.bitmap
            .count()
            .saturating_mul(self.bitmap.granularity())
    }

    /// Reads every range of `ranges` (up to [`READS_IN_FLIGHT`] at once, so that a real
    /// device works at a queue depth that hides its latency) and sends it, in the order the
    /// reads finish; an all-zero range is sent as zeros, or skipped with `skip_zeros` (the
    /// bulk pass: the new image is all zeros). `each` is told every range done. Returns the
    /// bytes sent.
    async fn send_ranges(
        &mut self,
        ranges: impl IntoIterator<Item = Range>,
        skip_zeros: bool,
        mut each: impl FnMut(&Self, Range),
    ) -> Result<u64, CopyError> {
        let failed = |path: &PathBuf, source| CopyError::Read {
            path: path.display().to_string(),
            source,
        };
        let mut ranges = ranges.into_iter();
        let mut reads = tokio::task::JoinSet::new();
        let mut sent = 0u64;
        loop {
            // A long pass (the bulk pass of a large disk) still notices a restarted frontend
            // soon: its writes are not marked.
            if self.checked.elapsed() >= FRONTEND_CHECK {
                self.tracked_status().await?;
            }
            while reads.len() < READS_IN_FLIGHT {
                let Some(range) = ranges.next() else { break };
                if self.stopped() {
                    return Err(CopyError::Cancelled);
                }
                let image = Arc::clone(&self.image);
                reads.spawn_blocking(move || {
                    let mut buf = Vec::new();
                    let read = image
                        .read(range, &mut buf)
                        .map(|bytes| (!is_zero(bytes)).then(|| bytes.to_vec()));
                    (range, read)
                });
            }
            let Some(done) = reads.join_next().await else {
                return Ok(sent);
            };
            let (range, read) =
                done.map_err(|e| failed(&self.req.image, std::io::Error::other(e.to_string())))?;
            let data = read.map_err(|e| failed(&self.req.image, e))?;
            if data.is_some() || !skip_zeros {
                sent = sent.saturating_add(self.send(range, data).await?);
            }
            each(self, range);
        }
    }

    /// Sends `range` as read (`None`: zeros); returns its length.
    async fn send(&mut self, range: Range, data: Option<Vec<u8>>) -> Result<u64, CopyError> {
        let (message, counted) = match data {
            Some(data) => (
                MigrationData {
                    offset: range.offset,
                    data,
                    ..MigrationData::default()
                },
                range.len,
            ),
            None => (
                MigrationData {
                    offset: range.offset,
                    zero_length: range.len,
                    ..MigrationData::default()
                },
                // A zero range costs a message, not its length.
                64,
            ),
        };
        self.stream.send(message, counted).await?;
        self.update(|p| p.bytes_sent = p.bytes_sent.saturating_add(range.len));
        Ok(range.len)
    }

    /// The bulk pass: every allocated extent, all-zero chunks skipped (the new image is
    /// sparse, all zeros).
    async fn bulk(&mut self) -> Result<(), CopyError> {
        let image = Arc::clone(&self.image);
        let extents = tokio::task::spawn_blocking(move || image.data_extents())
            .await
            .map_err(|e| CopyError::Read {
                path: self.req.image.display().to_string(),
                source: std::io::Error::other(e.to_string()),
            })?;
        let total: u64 = extents.iter().map(|r| r.len).sum();
        self.update(|p| p.remaining_bytes = total);
        let capacity = self.req.capacity;
        let ranges = extents
            .into_iter()
            .flat_map(move |e| chunks(e.offset, e.end(), capacity, CHUNK));
        let mut left = total;
        let mut marked = 0;
        let mut counted = Instant::now();
        self.send_ranges(ranges, true, |job, range| {
            left = left.saturating_sub(range.len);
            // Counting looks at every word: not for every range of a large disk.
            if counted.elapsed() >= FRONTEND_CHECK {
                marked = job.marked_bytes();
                counted = Instant::now();
            }
            job.update(|p| p.remaining_bytes = left.saturating_add(marked));
        })
        .await?;
        Ok(())
    }

    /// One pass over the marked blocks; returns the bytes sent.
    async fn dirty_pass(&mut self) -> Result<u64, CopyError> {
        let mut ranges = Vec::new();
        for index in 0..self.bitmap.words() {
            // Looked at before it is taken: a swap of a clear word would still take its cache
            // line from the frontend's CPU.
            if self.bitmap.peek_word(index) == 0 {
                continue;
            }
            let word = self.bitmap.take_word(index);
            if word != 0 {
                runs_of_word(
                    index as u64,
                    word,
                    self.bitmap.granularity(),
                    self.req.capacity,
                    CHUNK,
                    &mut ranges,
                );
            }
        }
        let capacity = self.req.capacity;
        let ranges = ranges
            .into_iter()
            .flat_map(move |run| chunks(run.offset, run.end(), capacity, CHUNK));
        self.send_ranges(ranges, false, |_, _| {}).await
    }

    /// The frontend's status, refusing one that no longer tracks writes.
    async fn tracked_status(&mut self) -> Result<FrontendStatus, CopyError> {
        let status = self.disk.status().await.map_err(CopyError::Frontend)?;
        self.checked = Instant::now();
        if !tracks(&status, self.pid) {
            return Err(CopyError::FrontendRestarted {
                was: self.pid,
                now: status.pid,
            });
        }
        Ok(status)
    }

    fn phase(&self, phase: MigrationCopyPhase) {
        self.update(|p| p.phase = phase as i32);
    }

    /// The passes over written blocks until the source's rings stop; the switch-over; then
    /// watching until the job is stopped (retired) — or copying on if the source serves again.
    async fn follow(&mut self) -> Result<(), CopyError> {
        let mut convergence = Convergence::new(self.req.bandwidth);
        let mut announced = false;
        loop {
            if self.stopped() {
                return Err(CopyError::Cancelled);
            }
            let status = self.tracked_status().await?;
            if !migration::serves_running_ring(&status) {
                self.switch_over().await?;
                if !self.wait_while_complete().await? {
                    return Ok(());
                }
                announced = false;
                continue;
            }
            let started = Instant::now();
            let sent = self.dirty_pass().await?;
            let took = started.elapsed().max(Duration::from_millis(1));
            let remaining = self.marked_bytes();
            let per_second = |bytes: u64| (bytes as f64 / took.as_secs_f64()) as u64;
            let report = PassReport {
                remaining,
                dirty_rate: per_second(remaining),
                send_rate: if sent >= CHUNK { per_second(sent) } else { 0 },
            };
            let decision = convergence.after_pass(&report);
            let eta = convergence.eta(&report);
            self.update(|p| {
                p.passes = p.passes.saturating_add(1);
                p.remaining_bytes = remaining;
                p.dirty_bytes_per_second = report.dirty_rate;
                p.eta_ms = eta.map_or(0, |d| d.as_millis() as u64);
            });
            match decision {
                Decision::Converged => {
                    self.phase(MigrationCopyPhase::Converged);
                    if !announced {
                        announced = true;
                        self.events.emit(
                            EventKind::MigrationConverged,
                            &self.req.id,
                            self.pid,
                            format!(
                                "the copy to disk {} on {} converged: {remaining} bytes left; the \
                                 VM may be migrated now",
                                self.req.to_disk, self.req.endpoint
                            ),
                        );
                    }
                }
                Decision::Continue => {}
                Decision::Throttle(limit) => {
                    // Marked before the call: a limit the frontend took before the call
                    // failed is still lifted at the end.
                    self.limited = true;
                    let message = match self.disk.limit_writes(limit).await {
                        Ok(()) => {
                            self.update(|p| p.throttle_write_bytes_per_second = limit);
                            format!(
                                "the guest dirties {} bytes/s, too fast for the copy to \
                                 converge: its writes are limited to {limit} bytes/s",
                                report.dirty_rate
                            )
                        }
                        // A disk in a throttle group, or a frontend that does not answer:
                        // the copy goes on without the limit.
                        Err(e) => format!(
                            "the guest dirties {} bytes/s, too fast for the copy to converge, \
                             but its writes cannot be limited: {e}",
                            report.dirty_rate
                        ),
                    };
                    self.events.emit(
                        EventKind::MigrationAutoConverge,
                        &self.req.id,
                        self.pid,
                        message,
                    );
                }
            }
            if sent == 0 {
                let mut stop = self.stop.clone();
                let _ = tokio::time::timeout(IDLE_POLL, stop.changed()).await;
            }
        }
    }

    /// The source's rings have stopped: the rest, then `complete`, acknowledged once the
    /// destination serves.
    async fn switch_over(&mut self) -> Result<(), CopyError> {
        let started = Instant::now();
        // The VM is stopped and waits for the rest and the marker: no bandwidth limit.
        self.stream.full_speed = true;
        let finished = self.finish().await;
        self.stream.full_speed = false;
        let (last, passed, ack) = finished?;
        let took = started.elapsed();
        let sent = lock(&self.progress).bytes_sent;
        self.update(|p| {
            p.phase = MigrationCopyPhase::Complete as i32;
            p.remaining_bytes = 0;
            p.eta_ms = 0;
            p.switch_over_us = took.as_micros() as u64;
        });
        let message = format!(
            "the copy to disk {} on {} is complete: the source's rings stopped, the last {last} \
             bytes were sent and the destination serves ({} µs from the rings found stopped to \
             the destination serving: the last pass {} µs, the destination's fdatasync {} µs \
             and frontend {} µs; {sent} bytes sent in all, {} written there)",
            self.req.to_disk,
            self.req.endpoint,
            took.as_micros(),
            passed.as_micros(),
            ack.sync_us,
            ack.frontend_us,
            ack.bytes_written
        );
        info!("disk {}: {message}", self.req.id);
        self.events
            .emit(EventKind::MigrationCopied, &self.req.id, self.pid, message);
        Ok(())
    }

    /// The switch-over's sends: the last pass, then `complete`; returns the bytes of the
    /// pass, how long it took, and the destination's ack.
    async fn finish(&mut self) -> Result<(u64, Duration, MigrationDataAck), CopyError> {
        let started = Instant::now();
        let last = self.dirty_pass().await?;
        let passed = started.elapsed();
        self.stream
            .send(
                MigrationData {
                    complete: true,
                    ..MigrationData::default()
                },
                0,
            )
            .await?;
        let ack = self.stream.ack().await?;
        Ok((last, passed, ack))
    }

    /// After the switch-over: waits until the job is stopped (`Ok(false)`) or the source
    /// wrote again — a ring runs, or a block was marked since the last pass (a ring that ran
    /// and stopped between two looks) — or its frontend was restarted (it marks nothing, so
    /// whether it wrote is unknown). Then the destination is told it is `reopened`: it stops
    /// serving and the copy goes on (`Ok(true)`), or, after a restart, fails. A destination
    /// whose VMM runs the VM already answers that it serves on: the VM runs there, the
    /// source is about to be retired, and the job ends with the copy complete (`Ok(false)`).
    async fn wait_while_complete(&mut self) -> Result<bool, CopyError> {
        loop {
            let mut stop = self.stop.clone();
            if self.stopped() {
                return Ok(false);
            }
            let _ = tokio::time::timeout(COMPLETE_POLL, stop.changed()).await;
            if self.stopped() {
                return Ok(false);
            }
            let status = match self.disk.status().await {
                Ok(status) => status,
                // Retired meanwhile (its frontend stopped), or restarting: looked at again.
                Err(_) => continue,
            };
            let restarted = !tracks(&status, self.pid);
            let wrote = migration::serves_running_ring(&status) || self.bitmap.count() != 0;
            if !restarted && !wrote {
                continue;
            }
            self.stream
                .send(
                    MigrationData {
                        reopened: true,
                        ..MigrationData::default()
                    },
                    0,
                )
                .await?;
            let ack = self.stream.ack().await?;
            if ack.serving {
                warn!(
                    "disk {}: {} after its copy to {} was complete, but the VM runs there \
                     already: not copied",
                    self.req.id,
                    if restarted {
                        "its frontend was restarted"
                    } else {
                        "it was written"
                    },
                    self.req.endpoint
                );
                return Ok(false);
            }
            warn!(
                "disk {}: {} after its copy to {} was complete; the destination stopped serving",
                self.req.id,
                if restarted {
                    "its frontend was restarted"
                } else {
                    "it served again"
                },
                self.req.endpoint
            );
            if restarted {
                return Err(CopyError::FrontendRestarted {
                    was: self.pid,
                    now: status.pid,
                });
            }
            self.phase(MigrationCopyPhase::Dirty);
            return Ok(true);
        }
    }
}

/// The write bitmap of a running copy, for the retirement's check that nothing was written
/// since the copy completed (set once the copy has one).
pub type Marks = Arc<std::sync::OnceLock<Arc<WriteBitmap>>>;

/// Runs a copy to its end: `Ok` once it was complete and the job was stopped (the source
/// retired), an error otherwise. Tracking and any auto-converge limit are undone whatever the
/// outcome, also when starting them failed halfway.
pub async fn run<D: SourceDisk>(
    disk: &D,
    req: &CopyRequest,
    peers: &Peers,
    events: &EventBus,
    progress: &Progress,
    marks: &Marks,
    stop: watch::Receiver<bool>,
) -> Result<(), CopyError> {
    let status = disk.status().await.map_err(CopyError::Frontend)?;
    let bitmap = Arc::new(WriteBitmap::create(
        req.capacity,
        granularity(req.capacity),
    )?);
    let image = SourceImage::open(&req.image, req.capacity).map_err(|source| CopyError::Read {
        path: req.image.display().to_string(),
        source,
    })?;
    let stream = Stream::open(peers, req).await?;
    let _ = marks.set(Arc::clone(&bitmap));
    let mut job = Job {
        disk,
        req,
        image: Arc::new(image),
        bitmap,
        stream,
        progress: Arc::clone(progress),
        events: events.clone(),
        stop,
        pid: status.pid,
        limited: false,
        checked: Instant::now(),
    };
    info!(
        "disk {}: copying to disk {} on {} ({} reads{})",
        req.id,
        req.to_disk,
        req.endpoint,
        if job.image.direct() {
            "direct"
        } else {
            "buffered"
        },
        if req.bandwidth == 0 {
            String::new()
        } else {
            format!(", at most {} bytes/s", req.bandwidth)
        }
    );
    let result = async {
        disk.track_writes(Some(&job.bitmap))
            .await
            .map_err(CopyError::Frontend)?;
        job.bulk().await?;
        job.phase(MigrationCopyPhase::Dirty);
        job.follow().await
    }
    .await;
    if let Err(e) = disk.track_writes(None).await {
        warn!("disk {}: stopping the write tracking: {e}", req.id);
    }
    if job.limited {
        match disk.limit_writes(0).await {
            Ok(()) => {
                job.update(|p| p.throttle_write_bytes_per_second = 0);
                events.emit(
                    EventKind::MigrationAutoConverge,
                    &req.id,
                    job.pid,
                    "the copy ended: the disk's own I/O limits apply again",
                );
            }
            Err(e) => warn!("disk {}: lifting auto-converge's limit: {e}", req.id),
        }
    }
    result
}
