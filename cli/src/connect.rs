//! How blkplanectl reaches blkplaned: its control socket (`--socket`, `--endpoint unix:PATH`)
//! or TCP with mutual TLS (`--endpoint tcp:HOST:PORT` with `--tls-ca`, `--tls-cert` and
//! `--tls-key`), chosen from the options and the environment, and the channel made there.

use std::error::Error as StdError;
use std::ffi::OsString;
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use blkplane_api::endpoint::HostPort;
use blkplane_api::names::ADMIN_SOCKET_SUFFIX;
use thiserror::Error;
use tonic::transport::{Channel, Endpoint};

/// Where blkplanectl looks for blkplaned when neither option nor variable names it: the
/// control socket of a blkplaned started with its embedded default in the same directory.
const DEFAULT_SOCKET: &str = "blkplane-run/control.sock";
/// The variable that stands for `--endpoint`.
const ENDPOINT_VAR: &str = "BLKPLANE_ENDPOINT";
/// The variable that stands for `--socket`.
const SOCKET_VAR: &str = "BLKPLANE_SOCKET";

/// The options that say where blkplaned is. Global: accepted after any command that
/// connects, and not by `completions` (see `main`'s `command`).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct ConnectArgs {
    /// blkplaned's control socket, the same as --endpoint unix:PATH [env: BLKPLANE_SOCKET;
    /// default: ./blkplane-run/control.sock]
    #[arg(long, global = true, value_name = "PATH", conflicts_with = "endpoint")]
    pub socket: Option<PathBuf>,
    /// Where blkplaned serves its API, as its --listen says: unix:PATH, or tcp:HOST:PORT
    /// (needs --tls-ca, --tls-cert and --tls-key) [env: BLKPLANE_ENDPOINT]
    #[arg(long, global = true, value_name = "unix:PATH|tcp:HOST:PORT",
          value_parser = |s: &str| Address::parse(s, "--endpoint"))]
    pub endpoint: Option<Address>,
    /// PEM certificate(s) of the CA that signed blkplaned's certificate (tcp: only).
    #[arg(long, global = true, value_name = "FILE")]
    pub tls_ca: Option<PathBuf>,
    /// PEM client certificate (chain) shown to blkplaned, signed by the CA of its
    /// --tls-client-ca (tcp: only).
    #[arg(long, global = true, value_name = "FILE")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert (tcp: only).
    #[arg(long, global = true, value_name = "FILE")]
    pub tls_key: Option<PathBuf>,
}

/// An endpoint as blkplaned's `--listen` writes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Address {
    /// `unix:PATH`.
    Unix(PathBuf),
    /// `tcp:HOST:PORT`; `host` without the brackets of an IPv6 address.
    Tcp {
        /// A DNS name or an IP address: what blkplaned's certificate must be for.
        host: String,
        /// The port.
        port: u16,
    },
}

impl fmt::Display for Address {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Address::Unix(path) => write!(f, "unix:{}", path.display()),
            Address::Tcp { host, port } if host.contains(':') => write!(f, "tcp:[{host}]:{port}"),
            Address::Tcp { host, port } => write!(f, "tcp:{host}:{port}"),
        }
    }
}

impl Address {
    /// Parses `unix:PATH` or `tcp:HOST:PORT` (`tcp:[::1]:PORT` for IPv6) given as `given`
    /// (the option or variable, for the error).
    pub fn parse(text: &str, given: &'static str) -> Result<Address, ConnectError> {
        let bad = || ConnectError::BadEndpoint {
            given,
            text: text.to_string(),
        };
        if let Some(path) = text.strip_prefix("unix:") {
            return match path {
                "" => Err(bad()),
                path => Ok(Address::Unix(PathBuf::from(path))),
            };
        }
        let HostPort { host, port } = text
            .strip_prefix("tcp:")
            .and_then(HostPort::parse)
            .ok_or_else(bad)?;
        Ok(Address::Tcp { host, port })
    }
}

/// Where blkplanectl connects: the address and, for TCP, the TLS material read from the files.
#[derive(Debug, Clone)]
pub struct Target {
    /// The address.
    pub address: Address,
    tls: Option<Tls>,
}

/// The PEM contents of `--tls-ca`, `--tls-cert` and `--tls-key`.
#[derive(Debug, Clone)]
struct Tls {
    ca: Vec<u8>,
    cert: Vec<u8>,
    key: Vec<u8>,
}

/// Why blkplanectl cannot connect.
#[derive(Debug, Error)]
pub enum ConnectError {
    /// Not `unix:PATH` nor `tcp:HOST:PORT`.
    #[error("{given} {text:?}: not unix:PATH or tcp:HOST:PORT (HOST a name, an IPv4 address or [IPv6]; PORT 1 to 65535)")]
    BadEndpoint {
        /// The option or the variable.
        given: &'static str,
        /// What it said.
        text: String,
    },
    /// `--socket` and `--endpoint` both given.
    #[error("--socket and --endpoint both name where blkplaned is: give one")]
    SocketAndEndpoint,
    /// Both variables are set and no option chooses.
    #[error("{ENDPOINT_VAR} and {SOCKET_VAR} are both set: unset one, or choose with --endpoint or --socket")]
    BothVariables,
    /// A TCP endpoint without all three TLS options.
    #[error("{endpoint} needs {missing}: blkplaned serves TCP only with TLS and client certificates (--tls-ca, --tls-cert, --tls-key)")]
    TlsMissing {
        /// The endpoint.
        endpoint: String,
        /// The options not given.
        missing: String,
    },
    /// TLS options with a UNIX socket.
    #[error("{given} apply to tcp: endpoints only; {endpoint} is a UNIX socket")]
    TlsWithUnix {
        /// The endpoint.
        endpoint: String,
        /// The TLS options given.
        given: String,
    },
    /// A TLS file could not be read.
    #[error("{option} {}: {source}", path.display())]
    Read {
        /// The option.
        option: &'static str,
        /// Its file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The TLS files do not make a TLS configuration.
    #[error("--tls-ca, --tls-cert, --tls-key: not usable PEM certificates and key: {0}")]
    TlsConfig(String),
    /// A disk's admin socket given as blkplaned's.
    #[error("{} is a disk's admin socket (blkplaned's channel to its frontend), not blkplaned's: --socket names RUNTIME_DIR/control.sock", .0.display())]
    AdminSocket(PathBuf),
    /// The TLS handshake failed (see [`tls_refusal`]).
    #[error("{endpoint}: {why}")]
    Tls {
        /// The endpoint.
        endpoint: String,
        /// What failed.
        why: String,
    },
    /// Nothing to connect to.
    #[error("cannot reach blkplaned at {endpoint}: {reason} (is it running? {names} where it is)")]
    Unreachable {
        /// The endpoint.
        endpoint: String,
        /// What failed.
        reason: String,
        /// The options and variables that name the endpoint.
        names: &'static str,
    },
}

impl ConnectArgs {
    /// The target the options and the environment name.
    pub fn target(&self) -> Result<Target, ConnectError> {
        self.target_in(|name| std::env::var_os(name))
    }

    /// [`ConnectArgs::target`] with `env` for the environment. An option overrides both
    /// variables; of the variables, one alone must be set, as `--socket` and `--endpoint`
    /// exclude each other.
    fn target_in(&self, env: impl Fn(&str) -> Option<OsString>) -> Result<Target, ConnectError> {
        let address = match (&self.socket, &self.endpoint) {
            // Clap refuses both at one level, not one before the command and one after it.
            (Some(_), Some(_)) => return Err(ConnectError::SocketAndEndpoint),
            (Some(path), None) => Address::Unix(path.clone()),
            (None, Some(address)) => address.clone(),
            (None, None) => match (env(ENDPOINT_VAR), env(SOCKET_VAR)) {
                (Some(_), Some(_)) => return Err(ConnectError::BothVariables),
                (Some(text), None) => Address::parse(&text.to_string_lossy(), ENDPOINT_VAR)?,
                (None, Some(path)) => Address::Unix(PathBuf::from(path)),
                (None, None) => Address::Unix(PathBuf::from(DEFAULT_SOCKET)),
            },
        };
        let files = [
            ("--tls-ca", &self.tls_ca),
            ("--tls-cert", &self.tls_cert),
            ("--tls-key", &self.tls_key),
        ];
        let named = |given: bool| {
            files
                .iter()
                .filter(|(_, path)| path.is_some() == given)
                .map(|(option, _)| *option)
                .collect::<Vec<_>>()
                .join(", ")
        };
        let tls = match &address {
            Address::Unix(_) if files.iter().any(|(_, p)| p.is_some()) => {
                return Err(ConnectError::TlsWithUnix {
                    endpoint: address.to_string(),
                    given: named(true),
                })
            }
            Address::Unix(_) => None,
            Address::Tcp { .. } => match (&self.tls_ca, &self.tls_cert, &self.tls_key) {
                (Some(ca), Some(cert), Some(key)) => Some(Tls {
                    ca: read("--tls-ca", ca)?,
                    cert: read("--tls-cert", cert)?,
                    key: read("--tls-key", key)?,
                }),
                _ => {
                    return Err(ConnectError::TlsMissing {
                        endpoint: address.to_string(),
                        missing: named(false),
                    })
                }
            },
        };
        Ok(Target { address, tls })
    }
}

fn read(option: &'static str, path: &Path) -> Result<Vec<u8>, ConnectError> {
    std::fs::read(path).map_err(|source| ConnectError::Read {
        option,
        path: path.to_path_buf(),
        source,
    })
}

/// `error` and its sources, each once, joined by ": " (tonic's own Display says only
/// "transport error").
pub fn chain(error: &dyn StdError) -> String {
    blkplane_api::endpoint::error_chain(error)
}

/// What a failed TLS handshake means, if `error` (or a source of it) is one: rustls' alert
/// from blkplaned, which refused this side's certificate, or this side's refusal of
/// blkplaned's. With TLS 1.3 the former may only show at the first call, so both the
/// connection and a call's status are looked at.
pub fn tls_refusal(error: &dyn StdError) -> Option<String> {
    let text = chain(error);
    if text.contains("received fatal alert") {
        return Some(format!(
            "the TLS handshake was refused by blkplaned ({text}): it did not accept this \
             client certificate (--tls-cert must be signed by the CA of blkplaned's \
             --tls-client-ca)"
        ));
    }
    if text.contains("invalid peer certificate") {
        return Some(format!(
            "the TLS handshake failed ({text}): blkplaned's certificate is not signed by \
             --tls-ca, or is not for the endpoint's host"
        ));
    }
    None
}

impl Target {
    /// The options and variables that name this kind of endpoint, for error messages.
    fn names(&self) -> &'static str {
        match self.address {
            Address::Unix(_) => "--socket, --endpoint unix:PATH or BLKPLANE_SOCKET name",
            Address::Tcp { .. } => "--endpoint tcp:HOST:PORT or BLKPLANE_ENDPOINT name",
        }
    }

    /// What else may be at the endpoint when no gRPC answer came, for error messages.
    pub fn not_blkplaned_hint(&self) -> &'static str {
        match self.address {
            Address::Unix(_) => {
                "blkplaned closed the connection, or the socket is not blkplaned's (a disk's \
                 vhost-user socket?); blkplaned's is RUNTIME_DIR/control.sock"
            }
            Address::Tcp { .. } => {
                "blkplaned closed the connection, or what listens there is not blkplaned's \
                 TLS API (its --listen tcp:ADDR:PORT)"
            }
        }
    }

    /// Connects, waiting at most `timeout` to connect and for each call.
    pub async fn connect(&self, timeout: Duration) -> Result<Channel, ConnectError> {
        let endpoint = self.endpoint()?.connect_timeout(timeout).timeout(timeout);
        endpoint.connect().await.map_err(|e| match tls_refusal(&e) {
            Some(why) => ConnectError::Tls {
                endpoint: self.address.to_string(),
                why,
            },
            None => self.unreachable(chain(&e)),
        })
    }

    /// Why blkplaned closed a TCP connection without a gRPC answer, if a TLS handshake of
    /// this side's own, with the same files, tells: with TLS 1.3 a server refuses a client
    /// certificate only after the client finished its handshake, with an alert that tonic's
    /// transport drops ("broken pipe", "operation was canceled"). `None` for a UNIX socket,
    /// or when the handshake and the first read show nothing wrong within `timeout`.
    pub async fn refusal(&self, timeout: Duration) -> Option<String> {
        let (Address::Tcp { host, port }, Some(tls)) = (&self.address, &self.tls) else {
            return None;
        };
        let address = HostPort {
            host: host.clone(),
            port: *port,
        };
        let text = address
            .tls_refusal(&tls.ca, &tls.cert, &tls.key, timeout)
            .await?;
        tls_refusal(&std::io::Error::other(text))
    }

    fn unreachable(&self, reason: String) -> ConnectError {
        ConnectError::Unreachable {
            endpoint: self.address.to_string(),
            reason,
            names: self.names(),
        }
    }

    /// The tonic endpoint, checked as far as can be without connecting.
    fn endpoint(&self) -> Result<Endpoint, ConnectError> {
        match (&self.address, &self.tls) {
            (Address::Unix(socket), _) => {
                if !socket.exists() {
                    return Err(self.unreachable("no such socket".into()));
                }
                if socket
                    .file_name()
                    .is_some_and(|n| n.to_string_lossy().ends_with(ADMIN_SOCKET_SUFFIX))
                {
                    return Err(ConnectError::AdminSocket(socket.clone()));
                }
                Endpoint::from_shared(format!("unix:{}", socket.display()))
                    .map_err(|e| self.unreachable(chain(&e)))
            }
            (Address::Tcp { host, port }, Some(tls)) => HostPort {
                host: host.clone(),
                port: *port,
            }
            .tls_endpoint(&tls.ca, &tls.cert, &tls.key)
            .map_err(|e| ConnectError::TlsConfig(chain(&e))),
            // `target_in` gives every TCP target its TLS material.
            (Address::Tcp { .. }, None) => Err(ConnectError::TlsMissing {
                endpoint: self.address.to_string(),
                missing: "--tls-ca, --tls-cert, --tls-key".into(),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tcp(host: &str, port: u16) -> Address {
        Address::Tcp {
            host: host.into(),
            port,
        }
    }

    #[test]
    fn endpoints() {
        let p = |s| Address::parse(s, "--endpoint");
        assert_eq!(
            p("unix:/run/c.sock").unwrap(),
            Address::Unix("/run/c.sock".into())
        );
        assert_eq!(p("tcp:127.0.0.1:7000").unwrap(), tcp("127.0.0.1", 7000));
        assert_eq!(
            p("tcp:node-1.example:443").unwrap(),
            tcp("node-1.example", 443)
        );
        assert_eq!(p("tcp:[::1]:7000").unwrap(), tcp("::1", 7000));
        for (text, shown) in [
            ("tcp:[::1]:7000", "tcp:[::1]:7000"),
            ("tcp:h:1", "tcp:h:1"),
            ("unix:x", "unix:x"),
        ] {
            assert_eq!(p(text).unwrap().to_string(), shown);
        }
        for bad in [
            "",
            "unix:",
            "tcp:",
            "tcp:host",
            "tcp::7000",
            "tcp:h:0",
            "tcp:h:65536",
            "tcp:h:x",
            "tcp:::1:7000",
            "tcp:[::1:7000",
            "http://h:1",
            "/run/c.sock",
        ] {
            let e = p(bad).unwrap_err().to_string();
            assert!(e.starts_with("--endpoint "), "{bad}: {e}");
        }
    }

    /// A readable file (its content does not matter until a TLS connection is made).
    fn readable() -> PathBuf {
        PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml"))
    }

    fn target(args: &ConnectArgs, env: &[(&str, &str)]) -> Result<Target, ConnectError> {
        args.target_in(|name| {
            env.iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| OsString::from(v))
        })
    }

    #[test]
    fn options_and_variables() {
        let none = ConnectArgs::default();
        let addr = |args: &ConnectArgs, env: &[(&str, &str)]| target(args, env).unwrap().address;
        assert_eq!(addr(&none, &[]), Address::Unix(DEFAULT_SOCKET.into()));
        assert_eq!(
            addr(&none, &[(SOCKET_VAR, "/s")]),
            Address::Unix("/s".into())
        );
        assert_eq!(
            addr(&none, &[(ENDPOINT_VAR, "unix:/e")]),
            Address::Unix("/e".into())
        );
        let e = target(&none, &[(ENDPOINT_VAR, "tcp:h")]).unwrap_err();
        assert!(e.to_string().starts_with(ENDPOINT_VAR), "{e}");
        let e = target(&none, &[(ENDPOINT_VAR, "unix:/e"), (SOCKET_VAR, "/s")]).unwrap_err();
        assert!(matches!(e, ConnectError::BothVariables), "{e}");
        // An option beats both variables; the two options exclude each other.
        let socket = ConnectArgs {
            socket: Some("/o".into()),
            ..ConnectArgs::default()
        };
        let env = [(ENDPOINT_VAR, "unix:/e"), (SOCKET_VAR, "/s")];
        assert_eq!(addr(&socket, &env), Address::Unix("/o".into()));
        let endpoint = ConnectArgs {
            endpoint: Some(Address::Unix("/p".into())),
            ..ConnectArgs::default()
        };
        assert_eq!(addr(&endpoint, &env), Address::Unix("/p".into()));
        let both = ConnectArgs {
            socket: Some("/o".into()),
            ..endpoint
        };
        let e = target(&both, &[]).unwrap_err().to_string();
        assert!(e.contains("--socket and --endpoint"), "{e}");
    }

    #[test]
    fn tls_options_go_with_tcp_only() {
        let tcp_only = ConnectArgs {
            endpoint: Some(tcp("127.0.0.1", 7000)),
            tls_ca: Some(readable()),
            ..ConnectArgs::default()
        };
        let e = target(&tcp_only, &[]).unwrap_err().to_string();
        assert!(
            e.contains("needs --tls-cert, --tls-key") && e.contains("tcp:127.0.0.1:7000"),
            "{e}"
        );
        let all = ConnectArgs {
            tls_cert: Some(readable()),
            tls_key: Some(readable()),
            ..tcp_only.clone()
        };
        assert!(target(&all, &[]).unwrap().tls.is_some());
        let unreadable = ConnectArgs {
            tls_key: Some("/nonexistent/client.key".into()),
            ..all.clone()
        };
        let e = target(&unreadable, &[]).unwrap_err().to_string();
        assert!(e.starts_with("--tls-key /nonexistent/client.key: "), "{e}");
        let unix = ConnectArgs {
            socket: Some("/s".into()),
            tls_cert: Some(readable()),
            ..ConnectArgs::default()
        };
        let e = target(&unix, &[]).unwrap_err().to_string();
        assert!(
            e.starts_with("--tls-cert apply to tcp: endpoints only"),
            "{e}"
        );
        // From the variable too: TLS options say nothing about a UNIX socket.
        let e = target(
            &ConnectArgs {
                socket: None,
                ..unix
            },
            &[(ENDPOINT_VAR, "unix:/e")],
        )
        .unwrap_err();
        assert!(matches!(e, ConnectError::TlsWithUnix { .. }), "{e}");
    }
}
