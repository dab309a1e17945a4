//! Serving the API: on a UNIX socket (mode 0600), or on TCP with TLS and required client
//! certificates; beside `blkplane.v1.Control`, the standard `grpc.health.v1.Health` service
//! and server reflection (v1 and v1alpha), so that grpcurl works without .proto files.

use std::future::Future;
use std::net::SocketAddr;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use log::info;
use thiserror::Error;
use tokio::net::UnixListener;
use tokio::sync::watch;
use tokio_stream::wrappers::UnixListenerStream;
use tonic::transport::{Certificate, Identity, Server, ServerTlsConfig};
use tonic_health::pb::health_server::{Health, HealthServer};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::server::{HealthReporter, HealthService};
use tonic_health::ServingStatus;

use crate::daemon::Daemon;
use crate::pb;
use crate::pb::control_server::ControlServer;
use crate::peer::PEER_KEEPALIVE;
use crate::service::ControlService;

/// Where the API listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Listen {
    /// A UNIX socket.
    Unix(PathBuf),
    /// TCP with TLS; clients must present a certificate signed by `client_ca`.
    Tcp {
        /// Address and port.
        addr: SocketAddr,
        /// PEM certificate chain of the server.
        cert: PathBuf,
        /// PEM private key of the server.
        key: PathBuf,
        /// PEM CA certificate(s) client certificates must chain to.
        client_ca: PathBuf,
    },
}

/// Serving failures.
#[derive(Debug, Error)]
pub enum ServerError {
    /// A `--listen` value that is neither `unix:PATH` nor `tcp:ADDR`.
    #[error("--listen {0:?}: expected unix:PATH or tcp:ADDR:PORT")]
    BadListen(String),
    /// TCP without the three TLS files, or TLS files with a UNIX socket.
    #[error("{0}")]
    Tls(String),
    /// A file could not be read or the socket could not be created.
    #[error("{what} {}: {source}", path.display())]
    Io {
        /// What was being done.
        what: &'static str,
        /// The path.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// Something else already serves on the control socket.
    #[error("{} is in use: another blkplaned listens there", .0.display())]
    InUse(PathBuf),
    /// The gRPC server failed.
    #[error("gRPC server: {0}")]
    Transport(#[from] tonic::transport::Error),
    /// The reflection service could not be built.
    #[error("reflection service: {0}")]
    Reflection(#[from] tonic_reflection::server::Error),
}

/// Parses `--listen` with the TLS options into a [`Listen`]; `default_unix` is used when
/// `listen` is `None`.
pub fn parse_listen(
    listen: Option<&str>,
    default_unix: &Path,
    cert: Option<PathBuf>,
    key: Option<PathBuf>,
    client_ca: Option<PathBuf>,
) -> Result<Listen, ServerError> {
    let listen = listen
        .map(str::to_string)
        .unwrap_or_else(|| format!("unix:{}", default_unix.display()));
    if let Some(path) = listen.strip_prefix("unix:") {
        if path.is_empty() {
            return Err(ServerError::BadListen(listen));
        }
        if cert.is_some() || key.is_some() || client_ca.is_some() {
            return Err(ServerError::Tls(
                "--tls-cert, --tls-key and --tls-client-ca apply to --listen tcp: only".into(),
            ));
        }
        return Ok(Listen::Unix(PathBuf::from(path)));
    }
    if let Some(addr) = listen.strip_prefix("tcp:") {
        let addr: SocketAddr = addr
            .parse()
            .map_err(|_| ServerError::BadListen(listen.clone()))?;
        return match (cert, key, client_ca) {
            (Some(cert), Some(key), Some(client_ca)) => Ok(Listen::Tcp {
                addr,
                cert,
                key,
                client_ca,
            }),
            _ => Err(ServerError::Tls(
                "--listen tcp: needs --tls-cert, --tls-key and --tls-client-ca: the API is only \
                 served over TCP with TLS and client certificates"
                    .into(),
            )),
        };
    }
    Err(ServerError::BadListen(listen))
}

fn read(path: &Path) -> Result<Vec<u8>, ServerError> {
    std::fs::read(path).map_err(|source| ServerError::Io {
        what: "reading",
        path: path.to_path_buf(),
        source,
    })
}

/// Binds the control socket with mode 0600. A stale socket file is replaced; a live one
/// (another blkplaned) is an error.
pub fn bind_unix(path: &Path) -> Result<UnixListener, ServerError> {
    match std::fs::symlink_metadata(path) {
        Ok(md) if md.file_type().is_socket() => {
            if blkplane_procfs::is_listening(path) {
                return Err(ServerError::InUse(path.to_path_buf()));
            }
            let _ = std::fs::remove_file(path);
        }
        Ok(_) => {
            return Err(ServerError::Io {
                what: "binding",
                path: path.to_path_buf(),
                source: std::io::Error::new(
                    std::io::ErrorKind::AlreadyExists,
                    "exists and is not a socket",
                ),
            })
        }
        Err(_) => {}
    }
    let io = |what| {
        move |source| ServerError::Io {
            what,
            path: path.to_path_buf(),
            source,
        }
    };
    // Bind under a private umask so the socket never exists with wider permissions, then
    // set the mode explicitly (the umask is process-wide, so it is restored at once; nothing
    // else creates files while blkplaned starts up).
    // SAFETY: umask only swaps the process's file-creation mask.
    let old = unsafe { libc::umask(0o177) };
    let listener = UnixListener::bind(path);
    // SAFETY: as above.
    unsafe { libc::umask(old) };
    let listener = listener.map_err(io("binding"))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
        .map_err(io("setting the mode of"))?;
    Ok(listener)
}

/// The statuses of the `grpc.health.v1.Health` service, shared between the gRPC server and
/// the metrics endpoint's `/healthz` and `/readyz`, so that both tell the same story.
///
/// The overall status (service `""`) and `blkplane.v1.Control` are NOT_SERVING until
/// [`serve`] runs the server, and NOT_SERVING again from the moment shutdown begins.
#[derive(Debug, Clone)]
pub struct ApiHealth {
    reporter: HealthReporter,
}

impl ApiHealth {
    /// Statuses that say "not serving" until [`serve`] starts.
    pub async fn new() -> ApiHealth {
        let health = ApiHealth {
            // tonic-health starts the overall status as SERVING; it is not, yet.
            reporter: HealthReporter::new(),
        };
        health.set(ServingStatus::NotServing).await;
        health
    }

    /// Sets the overall status and the Control service's.
    async fn set(&self, status: ServingStatus) {
        self.reporter.set_service_status("", status).await;
        self.reporter
            .set_service_status(
                <ControlServer<ControlService> as tonic::server::NamedService>::NAME,
                status,
            )
            .await;
    }

    /// The gRPC service to serve these statuses with.
    fn service(&self) -> HealthServer<HealthService> {
        HealthServer::new(HealthService::from_health_reporter(self.reporter.clone()))
    }

    /// The status `grpc.health.v1.Health/Check` answers for `service` now; `None` if the
    /// service is unknown. Asked through the health service itself, so that it is exactly
    /// what a gRPC client (`blkplanectl health`) would be told.
    pub async fn status(&self, service: &str) -> Option<ServingStatus> {
        let request = tonic::Request::new(HealthCheckRequest {
            service: service.to_string(),
        });
        let answer = HealthService::from_health_reporter(self.reporter.clone())
            .check(request)
            .await
            .ok()?
            .into_inner();
        use tonic_health::pb::health_check_response::ServingStatus as Pb;
        Some(match Pb::try_from(answer.status) {
            Ok(Pb::Serving) => ServingStatus::Serving,
            Ok(Pb::NotServing) => ServingStatus::NotServing,
            _ => ServingStatus::Unknown,
        })
    }

    /// Whether blkplaned serves its gRPC API: the overall status is SERVING.
    pub async fn serving(&self) -> bool {
        self.status("").await == Some(ServingStatus::Serving)
    }
}

/// Serves the API on `listen` until `shutdown` completes, with `health` as the statuses of
/// `grpc.health.v1.Health` (SERVING while the server runs). A UNIX socket is removed
/// afterwards.
pub async fn serve(
    daemon: Arc<Daemon>,
    listen: Listen,
    unix_listener: Option<UnixListener>,
    health: ApiHealth,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServerError> {
    let health_service = health.service();
    // Not serving from the moment shutdown begins: probes see it during the grace period,
    // while calls in progress still finish.
    let shutdown = {
        let health = health.clone();
        async move {
            shutdown.await;
            health.set(ServingStatus::NotServing).await;
        }
    };
    let reflection_v1 = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(pb::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()?;
    let reflection_v1alpha = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(pb::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1alpha()?;
    let control = ControlServer::new(ControlService::new(daemon));
    match listen {
        Listen::Unix(path) => {
            let listener = match unix_listener {
                Some(l) => l,
                None => bind_unix(&path)?,
            };
            info!("serving the API on unix:{}", path.display());
            let (stop_tx, stop_rx) = watch::channel(false);
            let server = Server::builder()
                .add_service(health_service)
                .add_service(reflection_v1)
                .add_service(reflection_v1alpha)
                .add_service(control)
                .serve_with_incoming_shutdown(UnixListenerStream::new(listener), stopped(stop_rx));
            // The socket is bound and the server is built: calls are answered from here on.
            health.set(ServingStatus::Serving).await;
            let result = with_grace(server, shutdown, stop_tx).await;
            let _ = std::fs::remove_file(&path);
            result?;
        }
        Listen::Tcp {
            addr,
            cert,
            key,
            client_ca,
        } => {
            let tls = ServerTlsConfig::new()
                .identity(Identity::from_pem(read(&cert)?, read(&key)?))
                .client_ca_root(Certificate::from_pem(read(&client_ca)?))
                .client_auth_optional(false);
            info!("serving the API on tcp:{addr} (TLS, client certificates required)");
            let (stop_tx, stop_rx) = watch::channel(false);
            let server = Server::builder()
                .tls_config(tls)?
                // A client that went away mid-stream (another node's copy of a disk, which
                // only sends) is found by its missing pings, not after hours of TCP.
                .http2_keepalive_interval(Some(PEER_KEEPALIVE))
                .http2_keepalive_timeout(Some(crate::peer::PEER_TIMEOUT))
                .add_service(health_service)
                .add_service(reflection_v1)
                .add_service(reflection_v1alpha)
                .add_service(control)
                .serve_with_shutdown(addr, stopped(stop_rx));
            // Set before the TCP socket is bound (serve_with_shutdown binds when first
            // polled); a bind failure ends `serve`, and with it blkplaned.
            health.set(ServingStatus::Serving).await;
            with_grace(server, shutdown, stop_tx).await?;
        }
    }
    Ok(())
}

/// How long calls in progress (an open WatchEvents stream, say) may go on after shutdown was
/// asked for.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);

async fn stopped(mut rx: watch::Receiver<bool>) {
    let _ = rx.wait_for(|stop| *stop).await;
}

/// Runs `server` until `shutdown`, then lets it close gracefully for at most
/// [`SHUTDOWN_GRACE`]: a client holding an event stream open must not keep blkplaned alive.
async fn with_grace<E>(
    server: impl Future<Output = Result<(), E>>,
    shutdown: impl Future<Output = ()>,
    stop_tx: watch::Sender<bool>,
) -> Result<(), E> {
    tokio::pin!(server);
    tokio::pin!(shutdown);
    tokio::select! {
        r = &mut server => return r,
        _ = &mut shutdown => {}
    }
    let _ = stop_tx.send(true);
    match tokio::time::timeout(SHUTDOWN_GRACE, server).await {
        Ok(r) => r,
        Err(_) => {
            info!("closing the calls still open after {SHUTDOWN_GRACE:?}");
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listen_values() {
        let d = Path::new("/run/bp/control.sock");
        assert_eq!(
            parse_listen(None, d, None, None, None).unwrap(),
            Listen::Unix(d.to_path_buf())
        );
        assert_eq!(
            parse_listen(Some("unix:/x.sock"), d, None, None, None).unwrap(),
            Listen::Unix("/x.sock".into())
        );
        assert!(matches!(
            parse_listen(Some("tcp:127.0.0.1:7000"), d, None, None, None),
            Err(ServerError::Tls(_))
        ));
        assert!(matches!(
            parse_listen(Some("unix:/x"), d, Some("c".into()), None, None),
            Err(ServerError::Tls(_))
        ));
        let tcp = parse_listen(
            Some("tcp:[::1]:7000"),
            d,
            Some("c".into()),
            Some("k".into()),
            Some("ca".into()),
        )
        .unwrap();
        assert!(matches!(tcp, Listen::Tcp { addr, .. } if addr.port() == 7000));
        for bad in ["", "unix:", "tcp:nohost", "http://x"] {
            assert!(
                matches!(
                    parse_listen(Some(bad), d, None, None, None),
                    Err(ServerError::BadListen(_)) | Err(ServerError::Tls(_))
                ),
                "{bad}"
            );
        }
    }

    #[tokio::test]
    async fn health_is_not_serving_until_set() {
        let health = ApiHealth::new().await;
        assert_eq!(health.status("").await, Some(ServingStatus::NotServing));
        assert!(!health.serving().await);
        health.set(ServingStatus::Serving).await;
        assert!(health.serving().await);
        assert_eq!(
            health.status("blkplane.v1.Control").await,
            Some(ServingStatus::Serving)
        );
        assert_eq!(health.status("no.such.Service").await, None);
        health.set(ServingStatus::NotServing).await;
        assert!(!health.serving().await);
    }

    #[tokio::test]
    async fn control_socket_is_private_and_exclusive() {
        let scratch = blkplane_tests::TempDir::new("bpsrv");
        let dir = scratch.path().to_path_buf();
        let path = dir.join("control.sock");
        let l = bind_unix(&path).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert!(matches!(bind_unix(&path), Err(ServerError::InUse(_))));
        drop(l);
        // Stale now: replaced.
        let _l = bind_unix(&path).unwrap();
    }
}
