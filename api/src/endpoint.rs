//! A blkplaned reached over TCP: `HOST:PORT` as blkplanectl's `--endpoint tcp:` and
//! AddDiskRequest `incoming_from.endpoint` write it, and the TLS channel configuration both
//! blkplanectl and blkplaned (reaching another node's) use with it.

use std::fmt;

use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};

/// `HOST:PORT`: a DNS name or an IP address (an IPv6 one in brackets) and a port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostPort {
    /// The name or address, without an IPv6 address's brackets: what the server's
    /// certificate must be for.
    pub host: String,
    /// The port, 1 to 65535.
    pub port: u16,
}

impl HostPort {
    /// Parses `HOST:PORT` (`[IPv6]:PORT`); `None` if `text` is not of that form, the host is
    /// empty or the port is 0.
    pub fn parse(text: &str) -> Option<HostPort> {
        let (host, port) = text.rsplit_once(':')?;
        let host = match host.strip_prefix('[') {
            Some(inner) => inner.strip_suffix(']')?,
            None if host.contains(':') || host.contains(']') => return None,
            None => host,
        };
        let port: u16 = port.parse().ok()?;
        // A DNS name or IPv4 address, or (in brackets) an IPv6 one: nothing a URI would read
        // as something else (`?`, `#`, `@`, `/`).
        let allowed = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_' | ':');
        if host.is_empty() || port == 0 || !host.chars().all(allowed) {
            return None;
        }
        Some(HostPort {
            host: host.to_string(),
            port,
        })
    }

    /// A tonic endpoint for this address over TLS: the server's certificate must chain to
    /// `ca` and be for the host; this side shows `cert` (with its `key`). All PEM.
    pub fn tls_endpoint(
        &self,
        ca: &[u8],
        cert: &[u8],
        key: &[u8],
    ) -> Result<Endpoint, tonic::transport::Error> {
        let config = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(ca))
            .identity(Identity::from_pem(cert, key))
            .domain_name(self.host.clone());
        Endpoint::from_shared(format!("https://{self}"))?.tls_config(config)
    }
}

impl fmt::Display for HostPort {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

impl HostPort {
    /// Why the server at this address closes a TLS connection, if a handshake of this side's
    /// own with the same PEM files tells: with TLS 1.3 a server refuses a client certificate
    /// only after the client finished its handshake, with an alert that tonic's transport
    /// drops ("broken pipe", "operation was canceled"). Returns the failure's
    /// [`error_chain`] when it is a TLS refusal ([`is_tls_refusal`]); `None` when the
    /// handshake and the first read show nothing wrong within `timeout`, or the files are
    /// not usable.
    pub async fn tls_refusal(
        &self,
        ca: &[u8],
        cert: &[u8],
        key: &[u8],
        timeout: std::time::Duration,
    ) -> Option<String> {
        use std::sync::Arc;
        use tokio::io::AsyncReadExt;
        use tokio_rustls::rustls;
        use tokio_rustls::rustls::pki_types::pem::PemObject;
        use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};

        let mut roots = rustls::RootCertStore::empty();
        for cert in CertificateDer::pem_slice_iter(ca) {
            roots.add(cert.ok()?).ok()?;
        }
        let chain = CertificateDer::pem_slice_iter(cert)
            .collect::<Result<Vec<_>, _>>()
            .ok()?;
        let key = PrivateKeyDer::from_pem_slice(key).ok()?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .ok()?
            .with_root_certificates(roots)
            .with_client_auth_cert(chain, key)
            .ok()?;
        config.alpn_protocols = vec![b"h2".to_vec()];
        let name = ServerName::try_from(self.host.clone()).ok()?;
        let probe = async {
            let tcp = tokio::net::TcpStream::connect((self.host.as_str(), self.port)).await?;
            let mut stream = tokio_rustls::TlsConnector::from(Arc::new(config))
                .connect(name, tcp)
                .await?;
            // A server that took the certificate waits for the HTTP/2 preface: nothing comes
            // until the timeout. One that refused it has sent its alert.
            let mut byte = [0u8; 1];
            stream.read(&mut byte).await.map(|_| ())
        };
        match tokio::time::timeout(timeout, probe).await {
            Ok(Err(e)) => Some(error_chain(&e)).filter(|text| is_tls_refusal(text)),
            _ => None,
        }
    }
}

/// `error` and its sources, each once, joined by ": " (tonic's own Display of a transport
/// error says only "transport error").
pub fn error_chain(error: &dyn std::error::Error) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut next = Some(error);
    while let Some(e) = next {
        let text = e.to_string();
        if !parts.iter().any(|p| p.contains(&text)) {
            parts.push(text);
        }
        next = e.source();
    }
    parts.join(": ")
}

/// Whether a connection failed in its TLS handshake (the other side refused this side's
/// certificate, or this side refused the other's), judged by rustls' words in `chain`
/// ([`error_chain`]).
pub fn is_tls_refusal(chain: &str) -> bool {
    chain.contains("received fatal alert") || chain.contains("invalid peer certificate")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_addresses_parse_and_print_back() {
        for (text, host, port) in [
            ("node-a:7070", "node-a", 7070),
            ("127.0.0.1:1", "127.0.0.1", 1),
            ("[::1]:65535", "::1", 65535),
            ("[fd00::2]:7070", "fd00::2", 7070),
        ] {
            let hp = HostPort::parse(text).unwrap_or_else(|| panic!("{text}"));
            assert_eq!((hp.host.as_str(), hp.port), (host, port), "{text}");
            assert_eq!(hp.to_string(), text);
        }
    }

    #[test]
    fn malformed_ones_are_refused() {
        for text in [
            "",
            "node-a",
            "node-a:",
            ":7070",
            "node-a:0",
            "node-a:65536",
            "node-a:70x",
            "::1:7070",
            "[::1:7070",
            "::1]:7070",
            "[]:7070",
            "node a:7070",
            "node-a/disk:7070",
            "a?b:7070",
            "a#b:7070",
            "user@node-a:7070",
        ] {
            assert_eq!(HostPort::parse(text), None, "{text:?}");
        }
    }

    #[test]
    fn tls_material_that_is_no_pem_is_refused_before_connecting() {
        let hp = HostPort::parse("[::1]:7070").unwrap();
        assert!(hp.tls_endpoint(b"", b"", b"").is_err());
    }
}
