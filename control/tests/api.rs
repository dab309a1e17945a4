//! blkplaned's gRPC API against the real binary: the standard health service and server
//! reflection (what grpcurl needs) on the UNIX socket; the TCP listener, which serves only TLS
//! clients that present a certificate signed by the configured CA; and incoming disks (the
//! destination side of a live migration), with real frontends and a libblkio VMM.
//!
//! The tests that add no disk need no frontend (`--frontend-binary /bin/true`); the incoming
//! tests run the real `blkplane-frontend`, built by the e2e harness (`blkplane_tests`). The
//! TLS test makes its certificates with the `openssl` command.

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
    start_with(dir, Path::new("/bin/true"), extra)
}

/// blkplaned on `dir` with `frontend` as its blkplane-frontend.
fn start_with(dir: &Path, frontend: &Path, extra: &[&str]) -> Daemon {
    let child = Command::new(env!("CARGO_BIN_EXE_blkplaned"))
        .arg("--state-dir")
        .arg(dir.join("state"))
        .arg("--runtime-dir")
        .arg(dir.join("run"))
        .arg("--frontend-binary")
        .arg(frontend)
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

// ---------------------------------------------------------------------------------------------
// Incoming disks (live migration on one node).

use blkplane_control::pb::{
    AddDiskRequest, CacheMode, Disk, EventKind, GetDiskRequest, MigrationBlockerReason,
    RemoveDiskRequest, ResizeDiskRequest, WatchEventsRequest,
};
use blkplane_control::state::StateStore;
use tonic::{Code, Status};

/// Bound of every wait on blkplaned.
const TIMEOUT: Duration = Duration::from_secs(20);
const MIB: u64 = 1 << 20;

/// Kills, on drop, every frontend serving disks of one runtime directory: they outlive
/// blkplaned by design. Declared after the directory and before the daemon, so that it runs
/// after the daemon is gone and before the directory is.
struct KillFrontends(PathBuf);

impl KillFrontends {
    /// The frontends serving disks of `disks_dir` (by their admin socket), sorted.
    fn pids(&self) -> Vec<u32> {
        blkplane_control::proc::find_processes_with_arg_prefix(&format!(
            "--admin-socket={}/",
            self.0.display()
        ))
        .into_iter()
        .filter(|&pid| blkplane_control::proc::alive(pid))
        .collect()
    }
}

impl Drop for KillFrontends {
    fn drop(&mut self) {
        for pid in self.pids() {
            // SAFETY: plain syscall on a process found by its blkplane-frontend command line
            // naming this test's own runtime directory.
            unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
        }
    }
}

/// An incoming node: blkplaned with the real frontend, fast polls, and an API client.
struct Node {
    // Drop order: the daemon, then the frontends, then the directory.
    client: ControlClient<Channel>,
    daemon: Option<Daemon>,
    frontends: KillFrontends,
    dir: Dir,
}

impl Node {
    async fn start(tag: &str) -> Node {
        let dir = Dir::new(tag);
        let frontends = KillFrontends(dir.0.join("run/disks"));
        let (daemon, client) = Self::launch(&dir.0).await;
        Node {
            client,
            daemon: Some(daemon),
            frontends,
            dir,
        }
    }

    /// Starts blkplaned on `dir` and connects to it.
    async fn launch(dir: &Path) -> (Daemon, ControlClient<Channel>) {
        let frontend = &blkplane_tests::binaries().frontend;
        let daemon = start_with(dir, frontend, &["--poll-interval-ms", "100"]);
        let client = ControlClient::new(unix_channel(&dir.join("run/control.sock")).await);
        (daemon, client)
    }

    /// Kills blkplaned with SIGKILL (its frontends keep running) and starts it again on the
    /// same directories.
    async fn restart(&mut self) {
        drop(self.daemon.take());
        let (daemon, client) = Self::launch(&self.dir.0).await;
        self.daemon = Some(daemon);
        self.client = client;
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.0.join(name)
    }

    fn disks_dir(&self) -> PathBuf {
        self.dir.0.join("run/disks")
    }

    async fn add(&mut self, req: AddDiskRequest) -> Result<Disk, Status> {
        self.client.add_disk(req).await.map(|r| r.into_inner())
    }

    async fn get(&mut self, id: &str) -> Disk {
        self.client
            .get_disk(GetDiskRequest { id: id.into() })
            .await
            .unwrap_or_else(|e| panic!("GetDisk {id}: {e}"))
            .into_inner()
    }

    async fn ids(&mut self) -> Vec<String> {
        self.client
            .list_disks(ListDisksRequest {})
            .await
            .expect("ListDisks")
            .into_inner()
            .disks
            .into_iter()
            .map(|d| d.config.unwrap_or_default().id)
            .collect()
    }

    /// Waits until `pred` holds for disk `id`; returns it.
    async fn wait_disk(&mut self, id: &str, what: &str, pred: impl Fn(&Disk) -> bool) -> Disk {
        let deadline = Instant::now() + TIMEOUT;
        loop {
            let d = self.get(id).await;
            if pred(&d) {
                return d;
            }
            assert!(
                Instant::now() < deadline,
                "disk {id}: not {what} within {TIMEOUT:?}: {d:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The disks of the state file, with their `incoming_for`.
    fn state(&self) -> Vec<(String, Option<String>)> {
        StateStore::new(&self.path("state"))
            .load()
            .expect("state.json")
            .disks
            .into_iter()
            .map(|d| (d.spec.id, d.spec.incoming_for))
            .collect()
    }

    /// The file names in the runtime disks directory, sorted.
    fn runtime_files(&self) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(self.disks_dir())
            .map(|d| {
                d.filter_map(|e| e.ok())
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        v.sort();
        v
    }
}

/// Asserts that a call was refused with `code` and a message that starts with `field`.
#[track_caller]
fn assert_refused<T: std::fmt::Debug>(what: &str, r: Result<T, Status>, code: Code, field: &str) {
    match r {
        Ok(v) => panic!("{what}: accepted, expected {code:?}: {v:?}"),
        Err(s) => {
            assert_eq!(s.code(), code, "{what}: {}", s.message());
            assert!(
                s.message().starts_with(&format!("{field}: ")),
                "{what}: the message does not name {field:?}: {}",
                s.message()
            );
        }
    }
}

fn path_str(p: &Path) -> String {
    p.to_str().expect("UTF-8 path").to_string()
}

/// The INCOMING blocker of a disk, if it has one.
fn incoming_blocker(d: &Disk) -> Option<&blkplane_control::pb::MigrationBlocker> {
    d.migration_blockers
        .iter()
        .find(|b| b.reason == MigrationBlockerReason::Incoming as i32)
}

/// Every AddDisk rule of `incoming_for` (code and field), nothing left behind by a refusal;
/// an incoming disk takes what the guest sees from its source, shows `incoming_for` and the
/// INCOMING blocker (not migratable), blocks resizing both disks, stays incoming across a
/// blkplaned restart (its frontend adopted), and its removal leaves the source untouched.
#[tokio::test]
async fn incoming_disk_rules_and_persistence() {
    let mut node = Node::start("incoming").await;
    let img = blkplane_tests::create_image(&node.path("a.img"), 8 * MIB);
    let other = blkplane_tests::create_image(&node.path("other.img"), 8 * MIB);
    let link = node.path("link.img");
    std::os::unix::fs::symlink(&img, &link).unwrap();
    let a = node
        .add(AddDiskRequest {
            id: "a".into(),
            image: path_str(&img),
            serial: "SER-A".into(),
            num_queues: 2,
            queue_size: 128,
            block_size: 4096,
            iothreads: 2,
            ..Default::default()
        })
        .await
        .expect("AddDisk a");
    let a_pid = a.frontend_pid;
    let a_socket = a.config.clone().unwrap().vhost_socket;
    assert!(a.config.as_ref().unwrap().incoming_for.is_empty());

    let incoming = |f: &dyn Fn(&mut AddDiskRequest)| {
        let mut r = AddDiskRequest {
            id: "b".into(),
            incoming_for: "a".into(),
            ..Default::default()
        };
        f(&mut r);
        r
    };
    let missing = path_str(&node.path("missing.img"));
    let cases: Vec<(&str, AddDiskRequest, Code, &str)> = vec![
        (
            "no such source",
            incoming(&|r| r.incoming_for = "nope".into()),
            Code::NotFound,
            "incoming_for",
        ),
        (
            "malformed source id",
            incoming(&|r| r.incoming_for = "a/b".into()),
            Code::InvalidArgument,
            "incoming_for",
        ),
        (
            "its own id",
            incoming(&|r| r.incoming_for = "b".into()),
            Code::InvalidArgument,
            "incoming_for",
        ),
        (
            "another image",
            incoming(&|r| r.image = path_str(&other)),
            Code::InvalidArgument,
            "image",
        ),
        (
            "a missing image",
            incoming(&|r| r.image = missing.clone()),
            Code::NotFound,
            "image",
        ),
        (
            "read-only on a writable source",
            incoming(&|r| r.read_only = true),
            Code::InvalidArgument,
            "read_only",
        ),
        (
            "another serial",
            incoming(&|r| r.serial = "SER-B".into()),
            Code::InvalidArgument,
            "serial",
        ),
        (
            "other queues",
            incoming(&|r| r.num_queues = 1),
            Code::InvalidArgument,
            "num_queues",
        ),
        (
            "another queue size",
            incoming(&|r| r.queue_size = 256),
            Code::InvalidArgument,
            "queue_size",
        ),
        (
            "another block size",
            incoming(&|r| r.block_size = 512),
            Code::InvalidArgument,
            "block_size",
        ),
        (
            "more iothreads than the source's queues",
            incoming(&|r| r.iothreads = 3),
            Code::InvalidArgument,
            "iothreads",
        ),
        (
            "the source's socket",
            incoming(&|r| r.vhost_socket = a_socket.clone()),
            Code::AlreadyExists,
            "vhost_socket",
        ),
        (
            "an ordinary disk on the source's image (only the pair is exempt)",
            AddDiskRequest {
                id: "c".into(),
                image: path_str(&link),
                ..Default::default()
            },
            Code::AlreadyExists,
            "image",
        ),
    ];
    for (what, req, code, field) in cases {
        let r = node.add(req).await;
        assert_refused(what, r, code, field);
    }
    // Nothing behind: one disk, one frontend, its files.
    assert_eq!(node.ids().await, ["a"]);
    assert_eq!(node.state(), [("a".to_string(), None)]);
    assert_eq!(node.frontends.pids(), [a_pid]);
    assert_eq!(
        node.runtime_files(),
        ["a.admin", "a.log", "a.pid", "a.sock"]
    );

    // The incoming disk: the image by another name, the guest's view from the source, its
    // own iothreads and cache.
    let b = node
        .add(incoming(&|r| {
            r.image = path_str(&link);
            r.iothreads = 2;
            r.cache = CacheMode::Writeback as i32;
        }))
        .await
        .expect("AddDisk b incoming for a");
    let b_pid = b.frontend_pid;
    let c = b.config.clone().unwrap();
    assert_eq!(c.incoming_for, "a");
    assert_eq!(c.image, path_str(&link));
    assert_eq!(
        (
            c.read_only,
            c.serial.as_str(),
            c.num_queues,
            c.queue_size,
            c.block_size
        ),
        (false, "SER-A", 2, 128, 4096)
    );
    assert_eq!((c.iothreads, c.cache), (2, CacheMode::Writeback as i32));
    assert_eq!(c.vhost_socket, path_str(&node.disks_dir().join("b.sock")));
    assert_eq!(b.capacity_bytes, 8 * MIB);
    assert!(!b.migratable, "{b:?}");
    let blocker = incoming_blocker(&b).unwrap_or_else(|| panic!("no INCOMING blocker: {b:?}"));
    assert!(blocker.automatic);
    assert!(
        blocker.message.starts_with(
            "destination of a live migration of disk a: it becomes migratable once its VMM \
             has started the rings"
        ),
        "{}",
        blocker.message
    );
    let a = node.get("a").await;
    assert!(a.config.unwrap().incoming_for.is_empty());
    assert!(a.migratable, "{:?}", a.migration_blockers);

    // One migration at a time, and no chains; the image now belongs to both.
    let r = node.add(incoming(&|r| r.id = "c".into())).await;
    assert_refused(
        "a second incoming disk",
        r,
        Code::FailedPrecondition,
        "incoming_for",
    );
    let r = node
        .add(incoming(&|r| {
            r.id = "c".into();
            r.incoming_for = "b".into();
        }))
        .await;
    assert_refused(
        "incoming for an incoming disk",
        r,
        Code::FailedPrecondition,
        "incoming_for",
    );
    let r = node
        .add(AddDiskRequest {
            id: "c".into(),
            image: path_str(&img),
            ..Default::default()
        })
        .await;
    assert_refused(
        "an ordinary disk on the image",
        r,
        Code::AlreadyExists,
        "image",
    );
    // Neither side may be resized while the migration is under way.
    for id in ["a", "b"] {
        let r = node
            .client
            .resize_disk(ResizeDiskRequest {
                id: id.into(),
                new_size_bytes: 16 * MIB,
            })
            .await;
        let e = r.expect_err("resize during a migration");
        assert_eq!(e.code(), Code::FailedPrecondition, "{}", e.message());
        assert!(
            e.message().contains("live migration is under way"),
            "{}",
            e.message()
        );
    }
    assert_eq!(std::fs::metadata(&img).unwrap().len(), 8 * MIB);
    assert_eq!(node.ids().await, ["a", "b"]);
    assert_eq!(node.frontends.pids(), {
        let mut v = vec![a_pid, b_pid];
        v.sort_unstable();
        v
    });

    // Persisted: blkplaned SIGKILLed and restarted adopts both frontends, and b is still
    // incoming (no VMM ran it, so no takeover).
    assert_eq!(
        node.state(),
        [
            ("a".to_string(), None),
            ("b".to_string(), Some("a".to_string()))
        ]
    );
    node.restart().await;
    let b = node
        .wait_disk("b", "adopted", |d| d.frontend_pid == b_pid)
        .await;
    assert_eq!(b.config.as_ref().unwrap().incoming_for, "a");
    assert!(incoming_blocker(&b).is_some() && !b.migratable, "{b:?}");
    node.wait_disk("a", "adopted", |d| d.frontend_pid == a_pid)
        .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(node.ids().await, ["a", "b"]);
    assert_eq!(node.get("b").await.config.unwrap().incoming_for, "a");

    // Cancelled: removing b leaves a as it was.
    node.client
        .remove_disk(RemoveDiskRequest {
            id: "b".into(),
            force: false,
        })
        .await
        .expect("RemoveDisk b");
    let a = node.get("a").await;
    assert_eq!(a.frontend_pid, a_pid);
    assert!(a.migratable, "{:?}", a.migration_blockers);
    assert_eq!(node.ids().await, ["a"]);
    assert_eq!(node.state(), [("a".to_string(), None)]);
    assert_eq!(node.frontends.pids(), [a_pid]);
    assert_eq!(
        node.runtime_files(),
        ["a.admin", "a.log", "a.pid", "a.sock"]
    );
    // And it still serves (its ring size is 128, below libblkio's default).
    let opts = blkplane_tests::ClientOptions {
        queue_size: Some(128),
        ..Default::default()
    };
    let mut vmm = blkplane_tests::Client::connect_with(Path::new(&a_socket), &opts)
        .expect("libblkio connect to a");
    let data = blkplane_tests::pattern(5, 4096);
    vmm.queue(0).write_at(0, &data).expect("write through a");
    assert_eq!(vmm.queue(0).read_at(0, 4096).expect("read through a"), data);
}

/// The source removed before the destination VMM ran: its id stays reserved (also after a
/// blkplaned restart), and the incoming disk, reloaded from the state by the restarted
/// blkplaned, takes over without anything to retire once a VMM runs its rings.
#[tokio::test]
async fn incoming_disk_whose_source_is_gone_takes_over() {
    let mut node = Node::start("incgone").await;
    let img = blkplane_tests::create_image(&node.path("a.img"), 8 * MIB);
    let other = blkplane_tests::create_image(&node.path("other.img"), 8 * MIB);
    node.add(AddDiskRequest {
        id: "a".into(),
        image: path_str(&img),
        ..Default::default()
    })
    .await
    .expect("AddDisk a");
    let b = node
        .add(AddDiskRequest {
            id: "b".into(),
            incoming_for: "a".into(),
            ..Default::default()
        })
        .await
        .expect("AddDisk b");
    node.client
        .remove_disk(RemoveDiskRequest {
            id: "a".into(),
            force: false,
        })
        .await
        .expect("RemoveDisk a");
    // The name of the source is not free while b may still take over from it.
    let r = node
        .add(AddDiskRequest {
            id: "a".into(),
            image: path_str(&other),
            ..Default::default()
        })
        .await;
    assert_refused("the source's id", r, Code::AlreadyExists, "id");
    assert!(incoming_blocker(&node.get("b").await).is_some());

    // Across a restart of blkplaned (SIGKILL): still incoming, the name still reserved.
    let b_pid = b.frontend_pid;
    node.restart().await;
    let reloaded = node
        .wait_disk("b", "adopted", |d| d.frontend_pid == b_pid)
        .await;
    assert_eq!(reloaded.config.as_ref().unwrap().incoming_for, "a");
    let r = node
        .add(AddDiskRequest {
            id: "a".into(),
            image: path_str(&other),
            ..Default::default()
        })
        .await;
    assert_refused(
        "the source's id after a restart",
        r,
        Code::AlreadyExists,
        "id",
    );

    let mut events = node
        .client
        .watch_events(WatchEventsRequest { id: "b".into() })
        .await
        .expect("WatchEvents")
        .into_inner();
    // A VMM that runs b's ring: the migrated VM.
    let socket = PathBuf::from(b.config.unwrap().vhost_socket);
    let mut vmm = blkplane_tests::Client::connect(&socket).expect("libblkio connect");
    vmm.queue(0)
        .write_at(0, &blkplane_tests::pattern(3, 4096))
        .expect("write through b");
    let migrated = tokio::time::timeout(TIMEOUT, async {
        loop {
            let e = events
                .message()
                .await
                .expect("event stream")
                .expect("event stream ended");
            if e.kind == EventKind::Migrated as i32 {
                return e;
            }
        }
    })
    .await
    .expect("no migrated event");
    assert_eq!(migrated.disk_id, "b");
    assert!(
        migrated
            .message
            .contains("disk b took over from a; a had already been removed"),
        "{}",
        migrated.message
    );
    let b = node
        .wait_disk("b", "taken over", |d| incoming_blocker(d).is_none())
        .await;
    assert!(b.config.unwrap().incoming_for.is_empty());
    assert_eq!(node.state(), [("b".to_string(), None)]);
    drop(vmm);
    // The name is free again.
    node.add(AddDiskRequest {
        id: "a".into(),
        image: path_str(&other),
        ..Default::default()
    })
    .await
    .expect("AddDisk a after the takeover");
}
