//! blkplaned's gRPC surface beside the disk API, against the real binary: the standard health
//! service and server reflection (what grpcurl needs) on the UNIX socket, and the TCP listener,
//! which serves only TLS clients that present a certificate signed by the configured CA.
//!
//! No disk is added here, so no frontend is needed (`--frontend-binary /bin/true`). The TLS
//! test makes its certificates with the `openssl` command.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use blkplane_control::pb::control_client::ControlClient;
use blkplane_control::pb::ListDisksRequest;
use tokio_stream::StreamExt;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

/// A scratch directory removed on drop.
struct Dir(PathBuf);

impl Dir {
    fn new(tag: &str) -> Dir {
        let p = std::env::temp_dir().join(format!("bpapi-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        Dir(p)
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// blkplaned, killed on drop.
struct Daemon(Child);

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start(dir: &Path, extra: &[&str]) -> Daemon {
    let child = Command::new(env!("CARGO_BIN_EXE_blkplaned"))
        .arg("--state-dir")
        .arg(dir.join("state"))
        .arg("--runtime-dir")
        .arg(dir.join("run"))
        .args(["--frontend-binary", "/bin/true"])
        .args(extra)
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .expect("spawning blkplaned");
    Daemon(child)
}

/// Retries `connect` until it works (blkplaned is starting) or 10 s passed.
async fn retry<T, E: std::fmt::Debug, F: std::future::Future<Output = Result<T, E>>>(
    mut connect: impl FnMut() -> F,
) -> T {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match connect().await {
            Ok(v) => return v,
            Err(e) if Instant::now() >= deadline => panic!("blkplaned did not answer: {e:?}"),
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

async fn unix_channel(socket: &Path) -> Channel {
    let uri = format!("unix:{}", socket.display());
    retry(|| {
        let uri = uri.clone();
        async move { Endpoint::from_shared(uri).unwrap().connect().await }
    })
    .await
}

#[tokio::test]
async fn health_and_reflection() {
    let dir = Dir::new("refl");
    let _d = start(&dir.0, &[]);
    let channel = unix_channel(&dir.0.join("run/control.sock")).await;

    let mut health = HealthClient::new(channel.clone());
    for service in ["", "blkplane.v1.Control"] {
        let r = health
            .check(HealthCheckRequest {
                service: service.into(),
            })
            .await
            .unwrap_or_else(|e| panic!("health of {service:?}: {e}"))
            .into_inner();
        assert_eq!(r.status, ServingStatus::Serving as i32, "{service:?}");
    }

    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
    use tonic_reflection::pb::v1::ServerReflectionRequest;
    let mut reflection = ServerReflectionClient::new(channel.clone());
    let requests = tokio_stream::iter(vec![
        ServerReflectionRequest {
            host: String::new(),
            message_request: Some(MessageRequest::ListServices(String::new())),
        },
        ServerReflectionRequest {
            host: String::new(),
            message_request: Some(MessageRequest::FileContainingSymbol(
                "blkplane.v1.Control".into(),
            )),
        },
        ServerReflectionRequest {
            host: String::new(),
            message_request: Some(MessageRequest::FileByFilename(
                "blkplane/v1/frontend.proto".into(),
            )),
        },
    ]);
    let mut answers = reflection
        .server_reflection_info(requests)
        .await
        .expect("reflection")
        .into_inner();
    let Some(MessageResponse::ListServicesResponse(list)) =
        answers.next().await.unwrap().unwrap().message_response
    else {
        panic!("not a service list")
    };
    let names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
    for want in [
        "blkplane.v1.Control",
        "grpc.health.v1.Health",
        "grpc.reflection.v1.ServerReflection",
    ] {
        assert!(names.iter().any(|n| n == want), "{want} not in {names:?}");
    }
    let Some(MessageResponse::FileDescriptorResponse(files)) =
        answers.next().await.unwrap().unwrap().message_response
    else {
        panic!("no file descriptors for blkplane.v1.Control")
    };
    use prost::Message;
    let control = prost_types::FileDescriptorProto::decode(&files.file_descriptor_proto[0][..])
        .expect("a file descriptor");
    assert_eq!(control.name(), "blkplane/v1/control.proto");
    assert_eq!(control.dependency, ["blkplane/v1/frontend.proto"]);
    // The import is served too, so a client can decode QueueStats & co.
    let Some(MessageResponse::FileDescriptorResponse(files)) =
        answers.next().await.unwrap().unwrap().message_response
    else {
        panic!("frontend.proto is not served")
    };
    let frontend = prost_types::FileDescriptorProto::decode(&files.file_descriptor_proto[0][..])
        .expect("a file descriptor");
    assert!(frontend
        .message_type
        .iter()
        .any(|m| m.name() == "QueueStats"));

    // v1alpha too: older grpcurl versions only speak that one.
    {
        use tonic_reflection::pb::v1alpha::server_reflection_client::ServerReflectionClient;
        use tonic_reflection::pb::v1alpha::server_reflection_request::MessageRequest;
        use tonic_reflection::pb::v1alpha::server_reflection_response::MessageResponse;
        use tonic_reflection::pb::v1alpha::ServerReflectionRequest;
        let mut alpha = ServerReflectionClient::new(channel.clone());
        let mut answers = alpha
            .server_reflection_info(tokio_stream::iter(vec![ServerReflectionRequest {
                host: String::new(),
                message_request: Some(MessageRequest::ListServices(String::new())),
            }]))
            .await
            .expect("v1alpha reflection")
            .into_inner();
        let Some(MessageResponse::ListServicesResponse(list)) =
            answers.next().await.unwrap().unwrap().message_response
        else {
            panic!("not a service list")
        };
        assert!(list.service.iter().any(|s| s.name == "blkplane.v1.Control"));
    }

    // The API itself on the same channel.
    let disks = ControlClient::new(channel)
        .list_disks(ListDisksRequest {})
        .await
        .unwrap()
        .into_inner()
        .disks;
    assert!(disks.is_empty());
}

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("running openssl (install the openssl package)");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Makes a CA and a certificate signed by it for `name` (with `san` as subjectAltName).
fn make_certs(dir: &Path, ca: &str, name: &str, san: &str) {
    let ext = format!("{name}.ext");
    std::fs::write(dir.join(&ext), format!("subjectAltName={san}\n")).unwrap();
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-days",
            "2",
            "-subj",
            &format!("/CN={ca}"),
            "-keyout",
            &format!("{ca}.key"),
            "-out",
            &format!("{ca}.pem"),
        ],
    );
    openssl(
        dir,
        &[
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-subj",
            &format!("/CN={name}"),
            "-keyout",
            &format!("{name}.key"),
            "-out",
            &format!("{name}.csr"),
        ],
    );
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            &format!("{name}.csr"),
            "-CA",
            &format!("{ca}.pem"),
            "-CAkey",
            &format!("{ca}.key"),
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            &ext,
            "-out",
            &format!("{name}.pem"),
        ],
    );
}

#[tokio::test]
async fn tcp_needs_tls_and_a_client_certificate() {
    let dir = Dir::new("tls");
    let d = &dir.0;
    make_certs(d, "server-ca", "server", "DNS:localhost,IP:127.0.0.1");
    make_certs(d, "client-ca", "client", "DNS:blkplanectl");
    make_certs(d, "other-ca", "stranger", "DNS:stranger");
    // A free port (released again; blkplaned binds it a moment later).
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let p = |f: &str| d.join(f).to_str().unwrap().to_string();
    let _daemon = start(
        d,
        &[
            "--listen",
            &format!("tcp:127.0.0.1:{port}"),
            "--tls-cert",
            &p("server.pem"),
            "--tls-key",
            &p("server.key"),
            "--tls-client-ca",
            &p("client-ca.pem"),
        ],
    );
    let read = |f: &str| std::fs::read(d.join(f)).unwrap();
    let endpoint = |identity: Option<(&str, &str)>| {
        let mut tls = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(read("server-ca.pem")))
            .domain_name("localhost");
        if let Some((cert, key)) = identity {
            tls = tls.identity(Identity::from_pem(read(cert), read(key)));
        }
        Endpoint::from_shared(format!("https://127.0.0.1:{port}"))
            .unwrap()
            .tls_config(tls)
            .unwrap()
    };
    // With the client certificate: served.
    let good = endpoint(Some(("client.pem", "client.key")));
    let channel = retry(|| good.connect()).await;
    let disks = ControlClient::new(channel)
        .list_disks(ListDisksRequest {})
        .await
        .expect("ListDisks with a client certificate")
        .into_inner()
        .disks;
    assert!(disks.is_empty());

    // Without one, or with one from another CA: refused.
    for (what, identity) in [
        ("no client certificate", None),
        (
            "a certificate of another CA",
            Some(("stranger.pem", "stranger.key")),
        ),
    ] {
        let result = async {
            let channel = endpoint(identity).connect().await?;
            ControlClient::new(channel)
                .list_disks(ListDisksRequest {})
                .await
                .map_err(|e| Box::new(e) as Box<dyn std::error::Error>)?;
            Ok::<_, Box<dyn std::error::Error>>(())
        }
        .await;
        assert!(result.is_err(), "served with {what}");
    }
    // No UNIX socket was created: TCP replaces it.
    assert!(!d.join("run/control.sock").exists());
}
