//! How blkplaned reaches another node's blkplaned, for a live migration across nodes: over
//! TCP with mutual TLS, with this node's `--peer-tls-ca`, `--peer-tls-cert` and
//! `--peer-tls-key` (read once at start), each call bounded by a deadline.

use std::path::Path;
use std::time::Duration;

use blkplane_api::endpoint::{error_chain as chain, is_tls_refusal, HostPort};
use thiserror::Error;
use tonic::transport::Channel;

use crate::pb::control_client::ControlClient;

/// How often a connection between two blkplaned is pinged (both ways), so that a node that
/// went away is found within this and [`PEER_TIMEOUT`].
pub const PEER_KEEPALIVE: Duration = Duration::from_secs(5);

/// How long connecting to another node's blkplaned, and each call to it, may take.
pub const PEER_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the handshake that tells a TLS refusal from a dropped connection may take.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// The PEM material this blkplaned shows and trusts when it calls another node's.
#[derive(Clone)]
pub struct PeerTls {
    ca: Vec<u8>,
    cert: Vec<u8>,
    key: Vec<u8>,
}

impl std::fmt::Debug for PeerTls {
    // The key is not printed.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PeerTls { .. }")
    }
}

impl PeerTls {
    /// Reads the three files: the CA other nodes' certificates must chain to, and this
    /// node's client certificate and key.
    pub fn read(ca: &Path, cert: &Path, key: &Path) -> Result<PeerTls, String> {
        let read = |option: &str, path: &Path| {
            std::fs::read(path).map_err(|e| format!("{option} {}: {e}", path.display()))
        };
        Ok(PeerTls {
            ca: read("--peer-tls-ca", ca)?,
            cert: read("--peer-tls-cert", cert)?,
            key: read("--peer-tls-key", key)?,
        })
    }
}

/// Why another node's blkplaned could not be asked, or what it answered instead.
#[derive(Debug, Error)]
pub enum PeerError {
    /// This blkplaned was started without the peer TLS files.
    #[error("this blkplaned has no --peer-tls-ca, --peer-tls-cert and --peer-tls-key to reach another node's blkplaned with")]
    NoCredentials,
    /// The files do not make a TLS client configuration.
    #[error("--peer-tls-ca, --peer-tls-cert, --peer-tls-key: {0}")]
    Tls(String),
    /// No connection, or no answer in time.
    #[error("the blkplaned at {endpoint} cannot be reached: {why}")]
    Unreachable {
        /// `HOST:PORT`.
        endpoint: String,
        /// What failed.
        why: String,
    },
    /// It answered with an error.
    #[error("the blkplaned at {endpoint} refused: {}", refusal_text(.status))]
    Refused {
        /// `HOST:PORT`.
        endpoint: String,
        /// Its answer.
        status: tonic::Status,
    },
}

impl PeerError {
    /// The status code of the local call this failure fails: the other node's own code for
    /// a refusal, UNAVAILABLE when it could not be asked, FAILED_PRECONDITION when this
    /// node cannot ask anybody.
    pub fn code(&self) -> tonic::Code {
        match self {
            PeerError::NoCredentials | PeerError::Tls(_) => tonic::Code::FailedPrecondition,
            PeerError::Unreachable { .. } => tonic::Code::Unavailable,
            PeerError::Refused { status, .. } => match status.code() {
                // A TLS refusal that TLS 1.3 shows only at the first call: no retry helps.
                _ if is_tls_refusal(&refusal_text(status)) => tonic::Code::FailedPrecondition,
                // Its deadline, or a transport failure tonic reports as a status.
                tonic::Code::Unknown | tonic::Code::Cancelled | tonic::Code::DeadlineExceeded => {
                    tonic::Code::Unavailable
                }
                // A field of what this blkplaned sent, not of the caller's request.
                tonic::Code::InvalidArgument => tonic::Code::FailedPrecondition,
                code => code,
            },
        }
    }

    /// Whether the other node answered that the call does not fit the disk's state there
    /// (FAILED_PRECONDITION of its own, not a TLS refusal or this node's lack of credentials).
    pub fn is_refused_precondition(&self) -> bool {
        matches!(self, PeerError::Refused { status, .. }
            if status.code() == tonic::Code::FailedPrecondition
                && !is_tls_refusal(&refusal_text(status)))
    }

    /// Whether the other node answered that it has no such disk.
    pub fn is_not_found(&self) -> bool {
        matches!(self, PeerError::Refused { status, .. } if status.code() == tonic::Code::NotFound)
    }
}

/// A status's words: its message, and for a transport failure (whose message says only
/// "transport error") the errors behind it.
fn refusal_text(status: &tonic::Status) -> String {
    use std::error::Error;
    match status.source() {
        Some(behind) => format!("{}: {}", status.message(), chain(behind)),
        None => status.message().to_string(),
    }
}

/// The other nodes' blkplaned, as this one reaches them.
#[derive(Debug, Clone, Default)]
pub struct Peers {
    tls: Option<PeerTls>,
}

impl Peers {
    /// Peers reached with `tls`; `None`: this blkplaned reaches none.
    pub fn new(tls: Option<PeerTls>) -> Peers {
        Peers { tls }
    }

    /// A client of the blkplaned at `endpoint`, connected (TCP and the TLS handshake within
    /// [`PEER_TIMEOUT`]: a peer that accepts and then says nothing holds nobody up longer),
    /// each call bounded by [`PEER_TIMEOUT`] too.
    pub async fn client(&self, endpoint: &HostPort) -> Result<ControlClient<Channel>, PeerError> {
        self.connect(endpoint, Some(PEER_TIMEOUT)).await
    }

    /// A client for a long stream (a disk's copy, ReceiveMigrationData): the connection and
    /// TLS handshake are bounded as for [`Peers::client`], the call is not (its messages are,
    /// by the caller); HTTP/2 keep-alives find a node that went away.
    pub async fn stream_client(
        &self,
        endpoint: &HostPort,
    ) -> Result<ControlClient<Channel>, PeerError> {
        self.connect(endpoint, None).await
    }

    async fn connect(
        &self,
        endpoint: &HostPort,
        call_timeout: Option<Duration>,
    ) -> Result<ControlClient<Channel>, PeerError> {
        let tls = self.tls.as_ref().ok_or(PeerError::NoCredentials)?;
        let configured = endpoint
            .tls_endpoint(&tls.ca, &tls.cert, &tls.key)
            .map_err(|e| PeerError::Tls(chain(&e)))?
            .connect_timeout(PEER_TIMEOUT)
            .http2_keep_alive_interval(PEER_KEEPALIVE)
            .keep_alive_timeout(PEER_TIMEOUT)
            .keep_alive_while_idle(true);
        let configured = match call_timeout {
            Some(timeout) => configured.timeout(timeout),
            None => configured,
        };
        let connecting = configured.connect();
        let unreachable = |why: String| PeerError::Unreachable {
            endpoint: endpoint.to_string(),
            why,
        };
        let channel = match tokio::time::timeout(PEER_TIMEOUT, connecting).await {
            Ok(Ok(channel)) => channel,
            Ok(Err(e)) => {
                let why = chain(&e);
                return Err(if is_tls_refusal(&why) {
                    PeerError::Tls(format!("{endpoint}: {why}"))
                } else {
                    unreachable(why)
                });
            }
            Err(_) => {
                return Err(unreachable(format!(
                    "no TLS connection within {PEER_TIMEOUT:?}"
                )))
            }
        };
        Ok(ControlClient::new(channel))
    }

    /// Connects to `endpoint` and makes one call there with `call`, turning a failure of
    /// either into a [`PeerError`].
    pub async fn call<T, F, Fut>(&self, endpoint: &HostPort, call: F) -> Result<T, PeerError>
    where
        F: FnOnce(ControlClient<Channel>) -> Fut,
        Fut: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        let client = self.client(endpoint).await?;
        match tokio::time::timeout(PEER_TIMEOUT, call(client)).await {
            Ok(Ok(response)) => Ok(response.into_inner()),
            // The connection closed under the call: with TLS 1.3 that is how a refused client
            // certificate shows (the alert is dropped on the way); a handshake of our own says.
            Ok(Err(status))
                if matches!(
                    status.code(),
                    tonic::Code::Unknown | tonic::Code::Cancelled | tonic::Code::Unavailable
                ) =>
            {
                let refusal = match &self.tls {
                    Some(tls) => {
                        endpoint
                            .tls_refusal(&tls.ca, &tls.cert, &tls.key, PROBE_TIMEOUT)
                            .await
                    }
                    None => None,
                };
                Err(match refusal {
                    Some(why) => PeerError::Tls(format!(
                        "the blkplaned at {endpoint} refused this node's certificate ({why}): \
                         --peer-tls-cert must be signed by the CA of its --tls-client-ca"
                    )),
                    None => PeerError::Refused {
                        endpoint: endpoint.to_string(),
                        status,
                    },
                })
            }
            Ok(Err(status)) => Err(PeerError::Refused {
                endpoint: endpoint.to_string(),
                status,
            }),
            Err(_) => Err(PeerError::Unreachable {
                endpoint: endpoint.to_string(),
                why: format!("no answer within {PEER_TIMEOUT:?}"),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn without_credentials_nobody_is_asked() {
        let peers = Peers::new(None);
        let endpoint = HostPort::parse("127.0.0.1:1").unwrap();
        let e = peers.client(&endpoint).await.unwrap_err();
        assert!(matches!(e, PeerError::NoCredentials), "{e}");
        assert_eq!(e.code(), tonic::Code::FailedPrecondition);
    }

    #[test]
    fn the_other_nodes_codes_are_kept_but_transport_failures() {
        let refused = |status: tonic::Status| PeerError::Refused {
            endpoint: "n:1".into(),
            status,
        };
        assert_eq!(
            refused(tonic::Status::failed_precondition("blocked")).code(),
            tonic::Code::FailedPrecondition
        );
        assert!(refused(tonic::Status::not_found("no")).is_not_found());
        assert!(
            refused(tonic::Status::failed_precondition("no migration")).is_refused_precondition()
        );
        assert!(!PeerError::NoCredentials.is_refused_precondition());
        assert!(!refused(tonic::Status::failed_precondition(
            "invalid peer certificate: UnknownIssuer"
        ))
        .is_refused_precondition());
        assert_eq!(
            refused(tonic::Status::cancelled("gone")).code(),
            tonic::Code::Unavailable
        );
        assert_eq!(
            refused(tonic::Status::invalid_argument("destination.node: bad")).code(),
            tonic::Code::FailedPrecondition
        );
        assert_eq!(
            refused(tonic::Status::unknown(
                "invalid peer certificate: UnknownIssuer"
            ))
            .code(),
            tonic::Code::FailedPrecondition
        );
        let e = refused(tonic::Status::failed_precondition("disk a is drained"));
        assert_eq!(
            e.to_string(),
            "the blkplaned at n:1 refused: disk a is drained"
        );
    }
}
