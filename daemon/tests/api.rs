//! blkplaned's gRPC API against the real binary: the standard health service and server
//! reflection (what grpcurl needs) on the UNIX socket; the TCP listener, which serves only TLS
//! clients that present a certificate signed by the configured CA; and incoming disks (the
//! destination side of a live migration), with real frontends and a libblkio VMM.
//!
//! The tests that add no disk need no frontend (`--frontend-binary /bin/true`); the incoming
//! tests run the real `blkplane-frontend`, built by the e2e harness (`blkplane_tests`). The
//! TLS test makes its certificates with the `openssl` command (`blkplane_tests::tls`).

use blkplane_tests::qemu_img::qemu_img;
use blkplane_tests::tls::{free_port, make_test_certs, server_options};
use blkplane_tests::TempDir;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use blkplane_daemon::pb::control_client::ControlClient;
use blkplane_daemon::pb::{DiskSettings, ListDisksRequest};
use blkplane_tests::daemon::{base_args, KillFrontends};
use tokio_stream::StreamExt;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

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
        .args(base_args(&dir.join("state"), &dir.join("run")))
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
    let dir = TempDir::new("refl");
    let _d = start(dir.path(), &[]);
    let channel = unix_channel(&dir.path().join("run/control.sock")).await;

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

/// Connects through `endpoint` and lists the disks.
async fn list_disks_through(endpoint: Endpoint) -> Result<(), Box<dyn std::error::Error>> {
    let channel = endpoint.connect().await?;
    ControlClient::new(channel)
        .list_disks(ListDisksRequest {})
        .await?;
    Ok(())
}

#[tokio::test]
async fn tcp_needs_tls_and_a_client_certificate() {
    let dir = TempDir::new("tls");
    let d = dir.path();
    make_test_certs(d);
    let port = free_port();
    let options = server_options(d, port);
    let options: Vec<&str> = options.iter().map(String::as_str).collect();
    let _daemon = start(d, &options);
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
        let served = list_disks_through(endpoint(identity)).await;
        assert!(served.is_err(), "served with {what}");
    }
    // Plain-text gRPC (no TLS at all): refused too.
    let plain = Endpoint::from_shared(format!("http://127.0.0.1:{port}")).unwrap();
    assert!(
        list_disks_through(plain).await.is_err(),
        "served a plain-text client"
    );
    // No UNIX socket was created: TCP replaces it.
    assert!(!d.join("run/control.sock").exists());
}

// ---------------------------------------------------------------------------------------------
// Incoming disks (live migration on one node).

use blkplane_daemon::pb::{
    AddDiskRequest, CacheMode, Disk, EventKind, GetDiskRequest, MigrationBlockerReason,
    RemoveDiskRequest, ResizeDiskRequest, WatchEventsRequest,
};
use blkplane_daemon::state::StateStore;
use tonic::{Code, Status};

/// Bound of every wait on blkplaned.
const TIMEOUT: Duration = Duration::from_secs(20);
const MIB: u64 = 1 << 20;

/// An incoming node: blkplaned with the real frontend, fast polls, and an API client.
struct Node {
    // Drop order: the daemon, then the frontends, then the directory.
    client: ControlClient<Channel>,
    daemon: Option<Daemon>,
    frontends: KillFrontends,
    dir: TempDir,
    /// blkplaned's options beyond the directories and the frontend, at every (re)start.
    extra: Vec<String>,
}

impl Node {
    async fn start(tag: &str) -> Node {
        Self::start_in(TempDir::new(tag), Vec::new()).await
    }

    /// A node on `dir` (which may hold images already), blkplaned run with `extra`.
    async fn start_in(dir: TempDir, extra: Vec<String>) -> Node {
        let frontends = KillFrontends(dir.path().join("run/disks"));
        let (daemon, client) = Self::launch(dir.path(), &extra).await;
        Node {
            client,
            daemon: Some(daemon),
            frontends,
            dir,
            extra,
        }
    }

    /// Starts blkplaned on `dir` with `extra` and connects to it.
    async fn launch(dir: &Path, extra: &[String]) -> (Daemon, ControlClient<Channel>) {
        let frontend = &blkplane_tests::binaries().frontend;
        let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
        let daemon = start_with(dir, frontend, &extra);
        let client = ControlClient::new(unix_channel(&dir.join("run/control.sock")).await);
        (daemon, client)
    }

    /// Kills blkplaned with SIGKILL (its frontends keep running) and starts it again on the
    /// same directories.
    async fn restart(&mut self) {
        drop(self.daemon.take());
        let (daemon, client) = Self::launch(self.dir.path(), &self.extra).await;
        self.daemon = Some(daemon);
        self.client = client;
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn disks_dir(&self) -> PathBuf {
        self.dir.path().join("run/disks")
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
        blkplane_tests::file_names(&self.disks_dir())
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
fn incoming_blocker(d: &Disk) -> Option<&blkplane_daemon::pb::MigrationBlocker> {
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
            settings: Some(DiskSettings {
                image: path_str(&img),
                serial: "SER-A".into(),
                num_queues: 2,
                queue_size: 128,
                block_size: 4096,
                iothreads: 2,
                ..Default::default()
            }),
            ..Default::default()
        })
        .await
        .expect("AddDisk a");
    let a_pid = a.frontend_pid;
    let a_socket = a.config.clone().unwrap().settings_or_default().vhost_socket;
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
            incoming(&|r| r.settings_mut().image = path_str(&other)),
            Code::InvalidArgument,
            "settings.image",
        ),
        (
            "a missing image",
            incoming(&|r| r.settings_mut().image = missing.clone()),
            Code::NotFound,
            "settings.image",
        ),
        (
            "read-only on a writable source",
            incoming(&|r| r.settings_mut().read_only = true),
            Code::InvalidArgument,
            "settings.read_only",
        ),
        (
            "another serial",
            incoming(&|r| r.settings_mut().serial = "SER-B".into()),
            Code::InvalidArgument,
            "settings.serial",
        ),
        (
            "other queues",
            incoming(&|r| r.settings_mut().num_queues = 1),
            Code::InvalidArgument,
            "settings.num_queues",
        ),
        (
            "another queue size",
            incoming(&|r| r.settings_mut().queue_size = 256),
            Code::InvalidArgument,
            "settings.queue_size",
        ),
        (
            "another block size",
            incoming(&|r| r.settings_mut().block_size = 512),
            Code::InvalidArgument,
            "settings.block_size",
        ),
        (
            "more iothreads than the source's queues",
            incoming(&|r| r.settings_mut().iothreads = 3),
            Code::InvalidArgument,
            "settings.iothreads",
        ),
        (
            "the source's socket",
            incoming(&|r| r.settings_mut().vhost_socket = a_socket.clone()),
            Code::AlreadyExists,
            "settings.vhost_socket",
        ),
        (
            "an ordinary disk on the source's image (only the pair is exempt)",
            AddDiskRequest::with_image("c", path_str(&link)),
            Code::AlreadyExists,
            "settings.image",
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
            r.settings_mut().image = path_str(&link);
            r.settings_mut().iothreads = 2;
            r.settings_mut().cache = CacheMode::Writeback as i32;
        }))
        .await
        .expect("AddDisk b incoming for a");
    let b_pid = b.frontend_pid;
    let config = b.config.clone().unwrap();
    assert_eq!(config.incoming_for, "a");
    let c = config.settings_or_default();
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
        .add(AddDiskRequest::with_image("c", path_str(&img)))
        .await;
    assert_refused(
        "an ordinary disk on the image",
        r,
        Code::AlreadyExists,
        "settings.image",
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
    node.add(AddDiskRequest::with_image("a", path_str(&img)))
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
        .add(AddDiskRequest::with_image("a", path_str(&other)))
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
        .add(AddDiskRequest::with_image("a", path_str(&other)))
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
    let socket = PathBuf::from(b.config.unwrap().settings_or_default().vhost_socket);
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
    node.add(AddDiskRequest::with_image("a", path_str(&other)))
        .await
        .expect("AddDisk a after the takeover");
}

// ---------------------------------------------------------------------------------------------
// I/O limits and throttle groups.

use blkplane_daemon::pb::{
    GetStatsRequest, GetThrottleRequest, SetThrottleRequest, ThrottleConfig,
};
use blkplane_proto::v1::ThrottleLimits;
use blkplane_throttle::{GROUP_STATE_LEN, MAX_GROUP_MEMBERS};
use std::os::unix::fs::PermissionsExt;

fn iops(n: u64) -> ThrottleLimits {
    blkplane_api::limits::named(&[("iops_total", n)]).unwrap()
}

impl Node {
    fn throttle_dir(&self) -> PathBuf {
        self.dir.path().join("run/throttle")
    }

    async fn set_throttle(
        &mut self,
        id: &str,
        limits: ThrottleLimits,
        group: &str,
    ) -> Result<ThrottleConfig, Status> {
        self.client
            .set_throttle(SetThrottleRequest {
                id: id.into(),
                limits: Some(limits),
                group: group.into(),
            })
            .await
            .map(|r| r.into_inner())
    }

    async fn throttle(&mut self, id: &str) -> ThrottleConfig {
        self.client
            .get_throttle(GetThrottleRequest { id: id.into() })
            .await
            .unwrap_or_else(|e| panic!("GetThrottle {id}: {e}"))
            .into_inner()
    }

    /// Every disk's (limits, group, index) as GetThrottle reports them.
    async fn throttles(&mut self) -> Vec<(String, ThrottleLimits, String, u32)> {
        let mut out = Vec::new();
        for id in self.ids().await {
            let t = self.throttle(&id).await;
            out.push((id, t.limits.unwrap_or_default(), t.group, t.member_index));
        }
        out
    }

    fn state_text(&self) -> String {
        std::fs::read_to_string(self.path("state/state.json")).unwrap_or_default()
    }

    /// Adds an ordinary disk on a new 8 MiB image.
    async fn add_plain(&mut self, id: &str) -> Disk {
        let img = blkplane_tests::create_image(&self.path(&format!("{id}.img")), 8 * MIB);
        self.add(AddDiskRequest::with_image(id, path_str(&img)))
            .await
            .unwrap_or_else(|e| panic!("AddDisk {id}: {e}"))
    }
}

/// A group file as blkplaned must create it: GROUP_STATE_LEN zero bytes, mode 0600.
#[track_caller]
fn assert_fresh_group_file(path: &Path) {
    let meta = std::fs::metadata(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert!(meta.is_file());
    assert_eq!(meta.len(), GROUP_STATE_LEN as u64, "{}", path.display());
    assert_eq!(
        meta.permissions().mode() & 0o777,
        0o600,
        "{}",
        path.display()
    );
    assert!(
        std::fs::read(path).unwrap().iter().all(|b| *b == 0),
        "{} is not zero-filled",
        path.display()
    );
}

/// SetThrottle and GetThrottle against blkplaned with real frontends: every validation rule
/// with its code and field, and nothing changed by a refusal (state, files, other disks);
/// limits alone; a group's file created (GROUP_STATE_LEN zero bytes, 0600) with its first
/// member and removed with its last; member indices lowest-free and stable; limits set on one
/// member read back from every other; an incoming disk taking its source's limits and group;
/// everything kept across a SIGKILL and restart of blkplaned (group files not rewritten);
/// clear; RemoveDisk leaving the group.
#[tokio::test]
async fn throttle_rules_groups_and_persistence() {
    let mut node = Node::start("throttle").await;
    for id in ["a", "b", "c", "d"] {
        node.add_plain(id).await;
    }
    // The directory exists from the start, private, and empty.
    let dir_mode = std::fs::metadata(node.throttle_dir())
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(dir_mode & 0o777, 0o700);
    assert!(blkplane_tests::file_names(&node.throttle_dir()).is_empty());

    let with = |f: &dyn Fn(&mut ThrottleLimits)| {
        let mut l = ThrottleLimits::default();
        f(&mut l);
        l
    };
    let long = "g".repeat(65);
    let cases: Vec<(&str, &str, ThrottleLimits, &str, Code, &str)> = vec![
        ("no such disk", "nope", iops(5), "", Code::NotFound, "id"),
        ("an empty id", "", iops(5), "", Code::NotFound, "id"),
        (
            "a burst without its average",
            "a",
            with(&|l| *blkplane_api::limits::limit_mut(l, "iops_total_max").unwrap() = 10),
            "",
            Code::InvalidArgument,
            "limits.iops_total.max",
        ),
        (
            "a total with a read limit",
            "a",
            with(&|l| {
                *blkplane_api::limits::limit_mut(l, "bps_total").unwrap() = 10;
                *blkplane_api::limits::limit_mut(l, "bps_read").unwrap() = 5
            }),
            "",
            Code::InvalidArgument,
            "limits.bps_read.avg",
        ),
        (
            "iops_size without an iops limit",
            "a",
            with(&|l| *blkplane_api::limits::limit_mut(l, "iops_size").unwrap() = 4096),
            "",
            Code::InvalidArgument,
            "limits.iops_size",
        ),
        (
            "a burst below its average",
            "a",
            with(&|l| {
                *blkplane_api::limits::limit_mut(l, "bps_write").unwrap() = 100;
                *blkplane_api::limits::limit_mut(l, "bps_write_max").unwrap() = 50
            }),
            "",
            Code::InvalidArgument,
            "limits.bps_write.max",
        ),
        (
            "a burst length without a burst",
            "a",
            with(&|l| {
                *blkplane_api::limits::limit_mut(l, "iops_read").unwrap() = 10;
                *blkplane_api::limits::limit_mut(l, "iops_read_max_length").unwrap() = 5
            }),
            "",
            Code::InvalidArgument,
            "limits.iops_read.max_length",
        ),
        (
            "a rate above 1e15",
            "a",
            with(&|l| {
                *blkplane_api::limits::limit_mut(l, "bps_total").unwrap() = 1_000_000_000_000_001
            }),
            "",
            Code::InvalidArgument,
            "limits.bps_total.avg",
        ),
        (
            "a burst length above UINT_MAX",
            "a",
            with(&|l| {
                *blkplane_api::limits::limit_mut(l, "iops_total").unwrap() = 1;
                *blkplane_api::limits::limit_mut(l, "iops_total_max").unwrap() = 2;
                *blkplane_api::limits::limit_mut(l, "iops_total_max_length").unwrap() = 1 << 32
            }),
            "",
            Code::InvalidArgument,
            "limits.iops_total.max_length",
        ),
        (
            "a hidden group",
            "a",
            iops(5),
            ".g",
            Code::InvalidArgument,
            "group",
        ),
        (
            "a group with a slash",
            "a",
            iops(5),
            "a/b",
            Code::InvalidArgument,
            "group",
        ),
        (
            "a group name too long",
            "a",
            iops(5),
            &long,
            Code::InvalidArgument,
            "group",
        ),
        (
            "bad limits with a new group",
            "a",
            with(&|l| *blkplane_api::limits::limit_mut(l, "iops_write_max").unwrap() = 1),
            "new",
            Code::InvalidArgument,
            "limits.iops_write.max",
        ),
    ];
    let before = node.state_text();
    for (what, id, limits, group, code, field) in &cases {
        let r = node.set_throttle(id, *limits, group).await;
        assert_refused(what, r, *code, field);
    }
    let r = node
        .client
        .get_throttle(GetThrottleRequest { id: "nope".into() })
        .await;
    assert_refused("GetThrottle of no disk", r, Code::NotFound, "id");
    // Nothing changed: no state, no file, no limits.
    assert_eq!(node.state_text(), before);
    assert!(!before.contains("\"throttle\""), "{before}");
    assert!(blkplane_tests::file_names(&node.throttle_dir()).is_empty());
    for (id, limits, group, index) in node.throttles().await {
        assert_eq!(
            (limits, group.as_str(), index),
            (ThrottleLimits::default(), "", 0),
            "{id}"
        );
    }

    // Limits of its own: no group, no file.
    let limits = with(&|l| {
        *blkplane_api::limits::limit_mut(l, "iops_total").unwrap() = 100;
        *blkplane_api::limits::limit_mut(l, "iops_total_max").unwrap() = 200;
        *blkplane_api::limits::limit_mut(l, "iops_total_max_length").unwrap() = 5;
        *blkplane_api::limits::limit_mut(l, "bps_read").unwrap() = 1 << 20;
        *blkplane_api::limits::limit_mut(l, "iops_size").unwrap() = 8192;
    });
    let t = node
        .set_throttle("a", limits, "")
        .await
        .expect("SetThrottle a");
    assert_eq!(t.id, "a");
    assert_eq!(t.limits, Some(limits));
    assert!(t.group.is_empty() && t.group_members.is_empty() && t.member_index == 0);
    assert_eq!(node.throttle("a").await, t);
    assert!(blkplane_tests::file_names(&node.throttle_dir()).is_empty());
    // GetDisk shows the same.
    assert_eq!(node.get("a").await.throttle.unwrap().limits, Some(limits));

    // A group: its file comes with the first member, indices are handed out lowest first,
    // and limits set on any member are every member's.
    let g_file = node.throttle_dir().join("g.state");
    let t = node
        .set_throttle("b", iops(200), "g")
        .await
        .expect("b joins g");
    assert_eq!((t.group.as_str(), t.member_index), ("g", 0));
    assert_eq!(t.group_members, ["b"]);
    assert_fresh_group_file(&g_file);
    let t = node
        .set_throttle("c", iops(300), "g")
        .await
        .expect("c joins g");
    assert_eq!(
        (t.member_index, t.group_members.clone()),
        (1, vec!["b".to_string(), "c".into()])
    );
    let b = node.throttle("b").await;
    assert_eq!((b.limits, b.member_index), (Some(iops(300)), 0));
    assert_eq!(b.group_members, ["b", "c"]);
    let t = node
        .set_throttle("d", iops(400), "g")
        .await
        .expect("d joins g");
    assert_eq!(t.member_index, 2);
    // b leaves (its own limits now): c and d keep their indices and the group's limits.
    let t = node
        .set_throttle("b", iops(7), "")
        .await
        .expect("b leaves g");
    assert!(t.group.is_empty() && t.member_index == 0);
    assert_eq!(t.limits, Some(iops(7)));
    for (id, index) in [("c", 1), ("d", 2)] {
        let t = node.throttle(id).await;
        assert_eq!((t.limits, t.member_index), (Some(iops(400)), index), "{id}");
        assert_eq!(t.group_members, ["c", "d"]);
    }
    assert_fresh_group_file(&g_file);
    // b comes back: the lowest free index, 0, again.
    let t = node
        .set_throttle("b", iops(500), "g")
        .await
        .expect("b rejoins g");
    assert_eq!(t.member_index, 0);
    assert_eq!(t.group_members, ["b", "c", "d"]);
    // Limits set on d are b's and c's, indices unchanged; a group without limits is allowed.
    node.set_throttle("d", iops(600), "g")
        .await
        .expect("d sets g");
    node.set_throttle("c", ThrottleLimits::default(), "g")
        .await
        .expect("g without limits");
    for (id, index) in [("b", 0), ("c", 1), ("d", 2)] {
        let t = node.throttle(id).await;
        assert_eq!(
            (t.limits, t.group.as_str(), t.member_index),
            (Some(ThrottleLimits::default()), "g", index),
            "{id}"
        );
    }
    node.set_throttle("d", iops(600), "g")
        .await
        .expect("d sets g");
    // A refusal with a group changes nothing either (no file for the new group).
    let before = node.state_text();
    let r = node
        .set_throttle(
            "b",
            with(&|l| *blkplane_api::limits::limit_mut(l, "bps_total_max").unwrap() = 1),
            "h",
        )
        .await;
    assert_refused(
        "bad limits",
        r,
        Code::InvalidArgument,
        "limits.bps_total.max",
    );
    assert_eq!(node.state_text(), before);
    assert_eq!(
        blkplane_tests::file_names(&node.throttle_dir()),
        ["g.state"]
    );
    assert_eq!(node.throttle("b").await.group, "g");

    // An incoming disk takes its source's limits and group, with an index of its own.
    let e = node
        .add(AddDiskRequest {
            id: "e".into(),
            incoming_for: "d".into(),
            ..Default::default()
        })
        .await
        .expect("AddDisk e incoming for d");
    let t = e.throttle.expect("Disk.throttle");
    assert_eq!(
        (t.limits, t.group.as_str(), t.member_index),
        (Some(iops(600)), "g", 3)
    );
    assert_eq!(t.group_members, ["b", "c", "d", "e"]);
    // An incoming disk of a source that is not in a group takes its limits alone.
    let f = node
        .add(AddDiskRequest {
            id: "f".into(),
            incoming_for: "a".into(),
            ..Default::default()
        })
        .await
        .expect("AddDisk f incoming for a");
    let t = f.throttle.unwrap();
    assert_eq!((t.limits, t.group.as_str()), (Some(limits), ""));

    // Persisted, and kept across a SIGKILL and restart of blkplaned; the group's file is not
    // replaced (frontends map it: the same inode, the same size; that its bytes are kept is
    // checked by throttle_group_limits_and_startup_files, whose file no frontend writes).
    let state = node.state_text();
    assert!(state.contains("\"throttle\""), "{state}");
    assert!(state.contains("\"member_index\": 3"), "{state}");
    use std::os::unix::fs::MetadataExt;
    let inode = std::fs::metadata(&g_file).unwrap().ino();
    let want = node.throttles().await;
    node.restart().await;
    node.settle_all().await;
    assert_eq!(node.throttles().await, want);
    let meta = std::fs::metadata(&g_file).unwrap();
    assert_eq!((meta.ino(), meta.len()), (inode, GROUP_STATE_LEN as u64));
    assert_eq!(node.throttle("c").await.group_members, ["b", "c", "d", "e"]);

    // Clear: no limits, no group, the others untouched.
    let t = node
        .set_throttle("c", ThrottleLimits::default(), "")
        .await
        .expect("clear c");
    assert_eq!(
        t,
        ThrottleConfig {
            id: "c".into(),
            limits: Some(ThrottleLimits::default()),
            ..Default::default()
        }
    );
    assert_eq!(node.throttle("b").await.group_members, ["b", "d", "e"]);
    // A removed disk leaves its group; the file goes with the last member, whether it leaves
    // by SetThrottle or by RemoveDisk.
    for id in ["e", "f"] {
        node.client
            .remove_disk(RemoveDiskRequest {
                id: id.into(),
                force: false,
            })
            .await
            .unwrap_or_else(|e| panic!("RemoveDisk {id}: {e}"));
    }
    assert_eq!(node.throttle("d").await.group_members, ["b", "d"]);
    node.set_throttle("b", iops(1), "")
        .await
        .expect("b leaves g");
    assert!(g_file.exists());
    node.client
        .remove_disk(RemoveDiskRequest {
            id: "d".into(),
            force: false,
        })
        .await
        .expect("RemoveDisk d");
    assert!(!g_file.exists(), "the group file outlived its last member");
    assert!(blkplane_tests::file_names(&node.throttle_dir()).is_empty());
    let state = node.state_text();
    assert!(!state.contains("\"group\""), "{state}");
    // Moving the last member of one group to another removes the first group's file.
    node.set_throttle("a", iops(1), "x")
        .await
        .expect("a joins x");
    assert_eq!(
        blkplane_tests::file_names(&node.throttle_dir()),
        ["x.state"]
    );
    node.set_throttle("a", iops(1), "y")
        .await
        .expect("a moves to y");
    assert_eq!(
        blkplane_tests::file_names(&node.throttle_dir()),
        ["y.state"]
    );
    assert_eq!(node.throttle("a").await.member_index, 0);
}

impl Node {
    /// Waits until no disk is starting or restarting.
    async fn settle_all(&mut self) {
        for id in self.ids().await {
            self.wait_disk(&id, "serving", |d| {
                d.frontend_pid != 0
                    && d.state != blkplane_daemon::pb::DiskState::Starting as i32
                    && d.state != blkplane_daemon::pb::DiskState::Restarting as i32
            })
            .await;
        }
    }
}

/// A group with MAX_GROUP_MEMBERS members refuses another (RESOURCE_EXHAUSTED `group`,
/// nothing changed) but a member may change its limits; a free index goes to the next disk to
/// join. At start-up blkplaned creates the file of a group that has none, keeps an existing
/// one as it is, and removes the file of a group without members. (Its disks' frontends are
/// `/bin/true`, which never serves: none of this needs a running frontend.)
#[tokio::test]
async fn throttle_group_limits_and_startup_files() {
    let dir = TempDir::new("thrfull");
    let mut disks = Vec::new();
    let disk = |id: &str, throttle: serde_json::Value| {
        serde_json::json!({
            "id": id, "image": format!("/nonexistent/{id}.img"), "num_queues": 1,
            "queue_size": 256, "block_size": 512, "iothreads": 1, "cache": "direct",
            "vhost_socket": dir.path().join(format!("run/disks/{id}.sock")),
            "throttle": throttle,
        })
    };
    for i in 0..MAX_GROUP_MEMBERS {
        let mut t = serde_json::json!({"limits": {"iops_total": 10}, "group": "full"});
        if i != 0 {
            t["member_index"] = serde_json::json!(i);
        }
        disks.push(disk(&format!("m{i:02}"), t));
    }
    disks.push(disk("extra", serde_json::json!({"limits": {}})));
    disks.push(disk(
        "solo",
        serde_json::json!({"limits": {"bps_total": 5}, "group": "lonely"}),
    ));
    std::fs::create_dir_all(dir.path().join("state")).unwrap();
    std::fs::write(
        dir.path().join("state/state.json"),
        serde_json::to_vec_pretty(&serde_json::json!({"version": 1, "disks": disks})).unwrap(),
    )
    .unwrap();
    // full.state exists (with a frontend's bytes in it), lonely.state is missing, gone.state
    // belongs to no group.
    let tdir = dir.path().join("run/throttle");
    std::fs::create_dir_all(&tdir).unwrap();
    let mut full = vec![0u8; GROUP_STATE_LEN];
    full[8] = 0x77;
    std::fs::write(tdir.join("full.state"), &full).unwrap();
    std::fs::write(tdir.join("gone.state"), vec![0u8; GROUP_STATE_LEN]).unwrap();

    // Failed at the first exit: 65 frontends in a restart loop would only slow the test.
    let _d = start(dir.path(), &["--restart-max", "1"]);
    let mut client = ControlClient::new(unix_channel(&dir.path().join("run/control.sock")).await);
    // The socket accepts connections before blkplaned has read its state (it is bound first);
    // an answer means the start-up, group files included, is over.
    client.list_disks(ListDisksRequest {}).await.unwrap();
    assert_eq!(
        blkplane_tests::file_names(&tdir),
        ["full.state", "lonely.state"]
    );
    assert_eq!(std::fs::read(tdir.join("full.state")).unwrap(), full);
    assert_fresh_group_file(&tdir.join("lonely.state"));

    let set = |id: &str, limits: ThrottleLimits, group: &str| SetThrottleRequest {
        id: id.into(),
        limits: Some(limits),
        group: group.into(),
    };
    let state_before = std::fs::read(dir.path().join("state/state.json")).unwrap();
    let r = client
        .set_throttle(set("extra", iops(10), "full"))
        .await
        .map(|r| r.into_inner());
    assert_refused("a 65th member", r, Code::ResourceExhausted, "group");
    assert_eq!(
        std::fs::read(dir.path().join("state/state.json")).unwrap(),
        state_before
    );
    let get = |id: &str| GetThrottleRequest { id: id.into() };
    let extra = client
        .get_throttle(get("extra"))
        .await
        .unwrap()
        .into_inner();
    assert!(extra.group.is_empty() && extra.limits == Some(ThrottleLimits::default()));

    // A member may still set the full group's limits: every member has them.
    let t = client
        .set_throttle(set("m05", iops(20), "full"))
        .await
        .expect("a member sets the full group's limits")
        .into_inner();
    assert_eq!(t.group_members.len(), MAX_GROUP_MEMBERS);
    assert_eq!(t.member_index, 5);
    let last = client.get_throttle(get("m63")).await.unwrap().into_inner();
    assert_eq!((last.limits, last.member_index), (Some(iops(20)), 63));
    // m05 leaves; extra joins in its slot, with the group's limits set again.
    client
        .set_throttle(set("m05", ThrottleLimits::default(), ""))
        .await
        .expect("m05 leaves");
    let t = client
        .set_throttle(set("extra", iops(20), "full"))
        .await
        .expect("extra joins")
        .into_inner();
    assert_eq!(t.member_index, 5);
    assert_eq!(std::fs::read(tdir.join("full.state")).unwrap(), full);
}

/// Sums a counter over a disk's queues.
async fn throttled_ops(node: &mut Node, id: &str) -> u64 {
    node.client
        .get_stats(GetStatsRequest { id: id.into() })
        .await
        .expect("GetStats")
        .into_inner()
        .disks[0]
        .total
        .as_ref()
        .map(|t| t.throttled_ops)
        .unwrap_or(0)
}

/// Reads `n` blocks one at a time through `vmm`; returns how long that took.
fn read_blocks(vmm: &mut blkplane_tests::Client, n: u64) -> Duration {
    let t0 = Instant::now();
    for i in 0..n {
        vmm.queue(0).read_at(i * 4096, 4096).expect("read");
    }
    t0.elapsed()
}

/// The frontend takes the limits blkplaned sends (nothing pending) and applies them: a VMM's
/// reads are held to the rate and counted as throttled; a group's members all take theirs; a
/// frontend restarted after SIGKILL and one adopted by a restarted blkplaned have the limits
/// again; after a clear nothing more is throttled.
#[tokio::test]
async fn frontend_takes_the_limits() {
    let mut node = Node::start("thrfe").await;
    let a = node.add_plain("a").await;
    node.add_plain("b").await;
    let socket = PathBuf::from(a.config.unwrap().settings_or_default().vhost_socket);

    // 20 operations per second: QEMU's buckets let a tenth of a second (2) through at once,
    // so 30 reads take at least 1.3 s.
    let t = node
        .set_throttle("a", iops(20), "")
        .await
        .expect("SetThrottle a");
    assert!(
        t.pending.is_empty(),
        "the frontend did not take the limits: {t:?}"
    );
    let mut vmm = blkplane_tests::Client::connect(&socket).expect("libblkio connect");
    let took = read_blocks(&mut vmm, 30);
    assert!(
        took >= Duration::from_millis(1200),
        "30 reads at 20 IOPS took {took:?}"
    );
    assert!(throttled_ops(&mut node, "a").await > 0);

    // A group: both members' frontends map the file and take the limits.
    let t = node
        .set_throttle("a", iops(20), "g")
        .await
        .expect("a joins g");
    assert!(t.pending.is_empty(), "{t:?}");
    let t = node
        .set_throttle("b", iops(20), "g")
        .await
        .expect("b joins g");
    assert!(t.pending.is_empty(), "{t:?}");
    assert_eq!(t.group_members, ["a", "b"]);

    // A frontend SIGKILLed and restarted gets them before it serves again.
    drop(vmm);
    let pid = node.get("a").await.frontend_pid;
    // SAFETY: plain syscall on the frontend this test's blkplaned started.
    unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
    node.wait_disk("a", "restarted", |d| {
        d.frontend_pid != 0
            && d.frontend_pid != pid
            && d.state == blkplane_daemon::pb::DiskState::Ready as i32
    })
    .await;
    let t = node.throttle("a").await;
    assert!(
        t.pending.is_empty(),
        "the restarted frontend lacks the limits: {t:?}"
    );
    let mut vmm = blkplane_tests::Client::connect(&socket).expect("libblkio reconnect");
    let took = read_blocks(&mut vmm, 30);
    assert!(
        took >= Duration::from_millis(1200),
        "30 reads at 20 IOPS took {took:?}"
    );

    // Adopted by a restarted blkplaned: sent again, taken.
    drop(vmm);
    node.restart().await;
    node.settle_all().await;
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let t = node.throttle("a").await;
        if t.pending.is_empty() && node.throttle("b").await.pending.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "still pending after adoption: {t:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Cleared: nothing is throttled any more.
    let t = node
        .set_throttle("a", ThrottleLimits::default(), "")
        .await
        .expect("clear a");
    assert!(t.pending.is_empty(), "{t:?}");
    let mut vmm = blkplane_tests::Client::connect(&socket).expect("libblkio connect");
    let before = throttled_ops(&mut node, "a").await;
    read_blocks(&mut vmm, 30);
    assert_eq!(throttled_ops(&mut node, "a").await, before);
}

// ---------------------------------------------------------------------------------------------
// Image formats and qcow2 backing chains.

use blkplane_daemon::pb::ImageFormat;
use blkplane_daemon::pb::SnapshotRequest;
use blkplane_daemon::state::Format;

/// blkplanectl on the node's control socket.
fn ctl(node: &Node, args: &[&str]) -> std::process::Output {
    Command::new(&blkplane_tests::binaries().blkplanectl)
        .arg("--socket")
        .arg(node.path("run/control.sock"))
        .args(args)
        .output()
        .expect("running blkplanectl")
}

/// A qcow2 image made by qemu-img over a raw base, added without a format: blkplaned probes
/// it, checks its chain, keeps the format (state.json, GetDisk, `blkplanectl disk show`) and
/// starts the frontend with `--format qcow2` and its `--image-dir`; the guest reads the base
/// through it and writes into the overlay only; ResizeDisk grows its virtual size. A
/// backing file outside `--image-dir` is refused naming `settings.image`, leaving nothing
/// behind; a raw image that starts with qcow2's magic is served raw with `--format raw`.
#[tokio::test]
async fn qcow2_disk_format_chain_and_io() {
    let dir = TempDir::new("qcow2");
    let images = dir.path().join("images");
    std::fs::create_dir(&images).unwrap();
    let images_arg = path_str(&images);
    let mut node = Node::start_in(dir, vec!["--image-dir".into(), images_arg.clone()]).await;

    let base = blkplane_tests::create_random_image(&images.join("base.raw"), 8 * MIB, 7);
    let top = images.join("top.qcow2");
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-b",
        "base.raw",
        "-F",
        "raw",
        &path_str(&top),
        "16M",
    ]);
    let added = node
        .add(AddDiskRequest::with_image("q", path_str(&top)))
        .await
        .expect("AddDisk of a qcow2 image");
    let settings = added.config.clone().unwrap().settings_or_default();
    assert_eq!(settings.format, ImageFormat::Qcow2 as i32);
    // The virtual size, not the file's.
    assert_eq!(added.capacity_bytes, 16 * MIB);
    let argv = blkplane_tests::daemon::cmdline(added.frontend_pid);
    for want in [
        "--format=qcow2".to_string(),
        format!("--image-dir={images_arg}"),
    ] {
        assert!(argv.contains(&want), "{want} not in {argv:?}");
    }
    assert_eq!(
        node.get("q")
            .await
            .config
            .unwrap()
            .settings_or_default()
            .format,
        ImageFormat::Qcow2 as i32
    );
    let state = StateStore::new(&node.path("state")).load().unwrap();
    assert_eq!(state.disks[0].spec.format, Some(Format::Qcow2));
    let shown = ctl(&node, &["-o", "json", "disk", "show", "q"]);
    assert!(shown.status.success(), "{shown:?}");
    let shown: serde_json::Value = serde_json::from_slice(&shown.stdout).unwrap();
    assert_eq!(shown["config"]["format"], "qcow2", "{shown}");

    // I/O: the base's data through the overlay; a write lands in the overlay only.
    let socket = PathBuf::from(settings.vhost_socket);
    let mut vmm = blkplane_tests::Client::connect(&socket).expect("libblkio connect");
    let want = blkplane_tests::read_file_at(&base, MIB, 4096);
    let got = vmm.queue(0).read_at(MIB, 4096).expect("read through q");
    blkplane_tests::assert_same_data("the base through the overlay", &got, &want);
    let data = blkplane_tests::pattern(9, 8192);
    vmm.queue(0)
        .write_at(12 * MIB, &data)
        .expect("write through q");
    vmm.queue(0).flush().expect("flush");
    let got = vmm.queue(0).read_at(12 * MIB, 8192).expect("read back");
    blkplane_tests::assert_same_data("written data", &got, &data);
    drop(vmm);
    assert_eq!(std::fs::metadata(&base).unwrap().len(), 8 * MIB);

    // Resizing a qcow2 disk grows its virtual size (the iothread writes the header and L1
    // table): the capacity, qemu-img's view and I/O past the old end all follow.
    let resized = node
        .client
        .resize_disk(ResizeDiskRequest {
            id: "q".into(),
            new_size_bytes: 32 * MIB,
        })
        .await
        .expect("resizing a qcow2 disk")
        .into_inner();
    assert_eq!(resized.capacity_bytes, 32 * MIB);
    assert_eq!(blkplane_tests::qemu_img::virtual_size(&top), Some(32 * MIB));
    let mut vmm = blkplane_tests::Client::connect(&socket).expect("libblkio connect");
    assert_eq!(vmm.capacity(), 32 * MIB);
    vmm.queue(0)
        .write_at(30 * MIB, &data)
        .expect("write past the old end");
    let got = vmm.queue(0).read_at(30 * MIB, 8192).expect("read back");
    blkplane_tests::assert_same_data("data past the old end", &got, &data);
    drop(vmm);

    // A backing file outside --image-dir: refused before anything starts.
    let secret = blkplane_tests::create_image(&node.path("secret.raw"), 8 * MIB);
    let escape = images.join("escape.qcow2");
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-u",
        "-b",
        &path_str(&secret),
        "-F",
        "raw",
        &path_str(&escape),
        "8M",
    ]);
    let files = node.runtime_files();
    let r = node
        .add(AddDiskRequest::with_image("escape", path_str(&escape)))
        .await;
    let message = r.as_ref().err().map(|s| s.message().to_string());
    assert_refused(
        "a backing file outside --image-dir",
        r,
        Code::InvalidArgument,
        "settings.image",
    );
    let message = message.unwrap_or_default();
    assert!(
        message.contains("outside the allowed image directories") && message.contains("secret.raw"),
        "{message}"
    );
    assert_eq!(node.runtime_files(), files);
    assert_eq!(node.ids().await, ["q"]);

    // A qcow2 image whose refcounts do not cover its header (refcount table entry 0 cleared):
    // imago cannot allocate in it, so it is refused for writing, before anything starts.
    let corrupt = images.join("corrupt.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", &path_str(&corrupt), "8M"]);
    {
        use std::os::unix::fs::FileExt;
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&corrupt)
            .unwrap();
        let mut rt_offset = [0u8; 8];
        file.read_exact_at(&mut rt_offset, 48).unwrap();
        file.write_all_at(&[0; 8], u64::from_be_bytes(rt_offset))
            .unwrap();
    }
    let r = node
        .add(AddDiskRequest::with_image("corrupt", path_str(&corrupt)))
        .await;
    let message = r.as_ref().err().map(|s| s.message().to_string());
    assert_refused(
        "refcounts that miss the header",
        r,
        Code::InvalidArgument,
        "settings.image",
    );
    let message = message.unwrap_or_default();
    assert!(
        message.contains("refcounts do not cover its header") && message.contains("corrupt.qcow2"),
        "{message}"
    );
    assert_eq!(node.runtime_files(), files);

    // A raw image that starts with qcow2's magic, served raw because it is said so
    // (blkplanectl's --format).
    let magic = images.join("magic.raw");
    blkplane_tests::create_image(&magic, 8 * MIB);
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&magic)
            .unwrap();
        f.write_all_at(b"QFI\xfb\0\0\0\x03", 0).unwrap();
    }
    let out = ctl(
        &node,
        &[
            "-o",
            "json",
            "disk",
            "add",
            "m",
            "--image",
            &path_str(&magic),
            "--format",
            "raw",
        ],
    );
    assert!(out.status.success(), "{out:?}");
    let m: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(m["config"]["format"], "raw", "{m}");
    assert_eq!(m["capacity_bytes"], 8 * MIB, "{m}");
    let pid = m["frontend_pid"].as_u64().unwrap() as u32;
    assert!(
        blkplane_tests::daemon::cmdline(pid).contains(&"--format=raw".to_string()),
        "{:?}",
        blkplane_tests::daemon::cmdline(pid)
    );
}

/// A live external snapshot (Snapshot, `blkplanectl disk snapshot`): data written before is in
/// the old image, which is only read from then on; the disk serves the overlay at the same
/// capacity, a new connection reads the old data through it and writes land in the overlay;
/// `disk show` has the chain; state.json keeps it across a blkplaned restart; `qemu-img check`
/// finds the overlay clean and `qemu-img compare` shows the guest view. Refusals leave the
/// disk on its image: an existing overlay, a relative path, a directory outside
/// `--image-dir`; and a chain that cannot grow (past 16 backing files) removes the overlay.
#[tokio::test]
async fn live_external_snapshot_switches_the_disk_to_an_overlay() {
    let dir = TempDir::new("snapshot");
    let images = dir.path().join("images");
    std::fs::create_dir(&images).unwrap();
    let mut node = Node::start_in(dir, vec!["--image-dir".into(), path_str(&images)]).await;
    let base = blkplane_tests::create_image(&images.join("base.raw"), 16 * MIB);
    let added = node
        .add(AddDiskRequest::with_image("s", path_str(&base)))
        .await
        .expect("AddDisk");
    let socket = PathBuf::from(added.config.unwrap().settings_or_default().vhost_socket);
    let before = blkplane_tests::pattern(21, 65536);
    {
        let mut vmm = blkplane_tests::Client::connect(&socket).expect("libblkio connect");
        vmm.queue(0).write_at(MIB, &before).expect("write before");
        vmm.queue(0).flush().expect("flush");
    }

    // Refused, each leaving the disk as it was.
    for (overlay, code) in [
        (path_str(&base), Code::AlreadyExists),
        ("snap.qcow2".to_string(), Code::InvalidArgument),
        (
            "/tmp/outside-images.qcow2".to_string(),
            Code::InvalidArgument,
        ),
        (
            path_str(&images.join("missing/snap.qcow2")),
            Code::InvalidArgument,
        ),
    ] {
        let e = node
            .client
            .snapshot(SnapshotRequest {
                id: "s".into(),
                overlay: overlay.clone(),
            })
            .await
            .expect_err("a bad overlay was taken");
        assert_eq!(e.code(), code, "{overlay}: {}", e.message());
        assert!(e.message().starts_with("overlay: "), "{}", e.message());
    }
    assert_eq!(
        node.get("s")
            .await
            .config
            .unwrap()
            .settings_or_default()
            .image,
        path_str(&base)
    );

    // The snapshot, through blkplanectl.
    let overlay = images.join("snap1.qcow2");
    let out = ctl(
        &node,
        &["-o", "json", "disk", "snapshot", "s", &path_str(&overlay)],
    );
    assert!(out.status.success(), "{out:?}");
    let shown: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(shown["config"]["image"], path_str(&overlay), "{shown}");
    assert_eq!(shown["config"]["format"], "qcow2", "{shown}");
    assert_eq!(shown["backing_chain"][0], path_str(&base), "{shown}");
    assert_eq!(shown["capacity_bytes"], 16 * MIB, "{shown}");
    assert_eq!(shown["drained"], false, "{shown}");
    let base_after_snapshot = std::fs::read(&base).unwrap();
    {
        let mut vmm = blkplane_tests::Client::connect(&socket).expect("connect to the overlay");
        assert_eq!(vmm.capacity(), 16 * MIB);
        let got = vmm.queue(0).read_at(MIB, 65536).expect("read the old data");
        blkplane_tests::assert_same_data("data written before the snapshot", &got, &before);
        let after = blkplane_tests::pattern(22, 8192);
        vmm.queue(0)
            .write_at(MIB + 4096, &after)
            .expect("write after");
        vmm.queue(0).flush().expect("flush");
    }
    assert_eq!(
        std::fs::read(&base).unwrap(),
        base_after_snapshot,
        "the backing file was written after the snapshot"
    );
    blkplane_tests::qemu_img::assert_check_clean(&overlay, false);
    let info = Command::new("qemu-img")
        .args(["info", "-U", "--output=json", &path_str(&overlay)])
        .output()
        .expect("running qemu-img");
    let info: serde_json::Value = serde_json::from_slice(&info.stdout).unwrap();
    assert_eq!(info["backing-filename"], path_str(&base), "{info}");
    assert_eq!(info["virtual-size"], 16 * MIB, "{info}");

    // Persisted: a restarted blkplaned serves the overlay.
    node.restart().await;
    let d = node.get("s").await;
    assert_eq!(
        d.config.unwrap().settings_or_default().image,
        path_str(&overlay)
    );
    assert_eq!(d.backing_chain, vec![path_str(&base)]);

    // A second snapshot stacks on the first; the text view names the chain.
    let overlay2 = images.join("snap2.qcow2");
    let out = ctl(&node, &["disk", "snapshot", "s", &path_str(&overlay2)]);
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains(&format!("{} -> {}", path_str(&overlay), path_str(&base))),
        "{text}"
    );

    // A disk whose chain is as deep as a chain may be: its snapshot is refused, the overlay
    // removed, the disk left on its image and serving.
    let mut below = blkplane_tests::create_image(&images.join("deep0.raw"), MIB);
    let mut format = "raw";
    for i in 1..=16 {
        let next = images.join(format!("deep{i}.qcow2"));
        let name = below.file_name().unwrap().to_str().unwrap().to_string();
        blkplane_tests::qemu_img::create_overlay(&next, &name, format, "");
        below = next;
        format = "qcow2";
    }
    node.add(AddDiskRequest::with_image("deep", path_str(&below)))
        .await
        .expect("AddDisk of a 16-deep chain");
    let refused = images.join("one-too-many.qcow2");
    let e = node
        .client
        .snapshot(SnapshotRequest {
            id: "deep".into(),
            overlay: path_str(&refused),
        })
        .await
        .expect_err("a 17-deep chain");
    assert_eq!(e.code(), Code::FailedPrecondition, "{}", e.message());
    assert!(!refused.exists(), "the refused overlay was left behind");
    let d = node.get("deep").await;
    assert_eq!(
        d.config.unwrap().settings_or_default().image,
        path_str(&below)
    );
    assert!(
        d.frontend_pid != 0 && !d.drained,
        "pid {} drained {}",
        d.frontend_pid,
        d.drained
    );
    println!("snapshot: base.raw <- snap1.qcow2 <- snap2.qcow2, data and chain as expected");
}

use blkplane_daemon::pb::CommitRequest;

/// `chattr +i` on a file until dropped: not even root opens it for writing meanwhile.
struct Immutable(PathBuf);

impl Immutable {
    fn set(path: &Path) -> Immutable {
        let out = Command::new("chattr")
            .arg("+i")
            .arg(path)
            .output()
            .expect("running chattr");
        assert!(
            out.status.success(),
            "chattr +i {}: {out:?}",
            path.display()
        );
        Immutable(path.to_owned())
    }
}

impl Drop for Immutable {
    fn drop(&mut self) {
        let _ = Command::new("chattr").arg("-i").arg(&self.0).output();
    }
}

/// Commit (`blkplanectl disk commit`): a qcow2 overlay (4 KiB clusters) over a smaller qcow2
/// image (64 KiB clusters, some compressed) over a raw base. What the guest wrote into the
/// overlay (data, part of compressed clusters, a write past the middle image's size, zeroes
/// over the middle's data) ends up in the middle image, which grows to the disk's
/// size; the disk serves the middle image (same capacity, its chain one shorter, persisted
/// across a blkplaned restart), a new connection reads the guest's data through it and writes
/// into it, not into the committed image; `qemu-img check` finds it clean and `qemu-img compare` finds it identical to the
/// overlay's guest view before the commit; the temporary overlay is gone, the committed one
/// left. Refusals leave the disk as it was: a raw disk, a read-only disk, a backing file
/// another disk's chain holds, a taken temporary-overlay path. A commit that fails once under
/// way (the backing file immutable, so it cannot be opened for writing) merges the temporary
/// overlay back and serves the image again, the guest's data intact. The guest writing during a commit (QEMU reconnecting through both
/// restarts) is the soak test's `commit` fault.
#[tokio::test]
async fn commit_merges_the_image_into_its_backing_file() {
    let dir = TempDir::new("commit");
    let images = dir.path().join("images");
    std::fs::create_dir(&images).unwrap();
    let mut node = Node::start_in(dir, vec!["--image-dir".into(), path_str(&images)]).await;
    let base = blkplane_tests::create_random_image(&images.join("base.raw"), 8 * MIB, 31);
    let mid = blkplane_tests::qemu_img::create_overlay(
        &images.join("mid.qcow2"),
        "base.raw",
        "raw",
        "cluster_size=65536",
    );
    qemu_img(&["resize", "-q", &path_str(&mid), "16M"]);
    // Compressed clusters, which the guest's writes below cover in part: the live merge
    // leaves those parts to the drained one.
    let mut io = Command::new("qemu-io");
    io.args(["-f", "qcow2"]);
    for i in 0..16u64 {
        io.args([
            "-c",
            &format!("write -c -P 0x5a {} 64k", 2 * MIB + i * 65536),
        ]);
    }
    let out = io.arg(&mid).output().unwrap();
    assert!(out.status.success(), "{out:?}");
    let top = blkplane_tests::qemu_img::create_overlay(
        &images.join("top.qcow2"),
        "mid.qcow2",
        "qcow2",
        "cluster_size=4096",
    );
    qemu_img(&["resize", "-q", &path_str(&top), "32M"]);
    let added = node
        .add(AddDiskRequest::with_image("c", path_str(&top)))
        .await
        .expect("AddDisk");
    let socket = PathBuf::from(added.config.unwrap().settings_or_default().vhost_socket);
    assert_eq!(added.capacity_bytes, 32 * MIB);
    {
        let mut vmm = blkplane_tests::Client::connect(&socket).expect("libblkio connect");
        for (i, offset) in [MIB, 2 * MIB + 4096, 7 * MIB + 512 * 1024, 20 * MIB]
            .into_iter()
            .enumerate()
        {
            vmm.queue(0)
                .write_at(offset, &blkplane_tests::pattern(40 + i as u64, 12288))
                .expect("write");
        }
        vmm.queue(0)
            .write_at(2 * MIB + 256 * 1024, &vec![0; 65536])
            .expect("zeroes over the middle image's data");
        vmm.queue(0).flush().expect("flush");
    }
    let view = images.join("view.raw");
    qemu_img(&[
        "convert",
        "-U",
        "-O",
        "raw",
        &path_str(&top),
        &path_str(&view),
    ]);

    // Refused, each leaving the disk as it was.
    let raw = blkplane_tests::create_image(&images.join("raw.img"), MIB);
    node.add(AddDiskRequest::with_image("raw", path_str(&raw)))
        .await
        .expect("AddDisk raw");
    let sharer = blkplane_tests::qemu_img::create_overlay(
        &images.join("sharer.qcow2"),
        "mid.qcow2",
        "qcow2",
        "",
    );
    let mut read_only = AddDiskRequest::with_image("ro", path_str(&sharer));
    read_only.settings_mut().read_only = true;
    node.add(read_only).await.expect("AddDisk read-only");
    let temporary = images.join("top.qcow2.commit.qcow2");
    std::fs::write(&temporary, b"someone's file").unwrap();
    for (id, want) in [
        ("raw", "the image is raw"),
        ("ro", "the disk is read-only"),
        ("c", "is in the chain of disk ro"),
    ] {
        let e = node
            .client
            .commit(CommitRequest { id: id.into() })
            .await
            .expect_err("a commit that must be refused");
        assert_eq!(e.code(), Code::FailedPrecondition, "{id}: {}", e.message());
        assert!(e.message().starts_with("id: "), "{}", e.message());
        assert!(e.message().contains(want), "{id}: {}", e.message());
    }
    let e = node
        .client
        .commit(CommitRequest { id: "nope".into() })
        .await
        .expect_err("no such disk");
    assert_eq!(e.code(), Code::NotFound, "{}", e.message());
    node.client
        .remove_disk(RemoveDiskRequest {
            id: "ro".into(),
            force: true,
        })
        .await
        .expect("RemoveDisk ro");
    let e = node
        .client
        .commit(CommitRequest { id: "c".into() })
        .await
        .expect_err("the temporary overlay's path is taken");
    assert_eq!(e.code(), Code::FailedPrecondition, "{}", e.message());
    assert!(e.message().contains("exists"), "{}", e.message());
    std::fs::remove_file(&temporary).unwrap();
    let d = node.get("c").await;
    assert_eq!(
        d.config.unwrap().settings_or_default().image,
        path_str(&top)
    );
    assert!(
        d.frontend_pid != 0 && !d.drained,
        "pid {} drained {}",
        d.frontend_pid,
        d.drained
    );

    // A merge that fails: merged back, the image served again.
    let mid_before = std::fs::read(&mid).unwrap();
    {
        let _immutable = Immutable::set(&mid);
        let e = node
            .client
            .commit(CommitRequest { id: "c".into() })
            .await
            .expect_err("the backing file cannot be written");
        assert_eq!(e.code(), Code::Internal, "{}", e.message());
        assert!(
            e.message()
                .contains(&format!("the disk serves {} again", path_str(&top))),
            "{}",
            e.message()
        );
    }
    assert_eq!(std::fs::read(&mid).unwrap(), mid_before);
    assert!(!temporary.exists(), "the temporary overlay was left behind");
    let d = node.get("c").await;
    assert_eq!(
        d.config.unwrap().settings_or_default().image,
        path_str(&top)
    );
    assert_eq!(d.backing_chain, vec![path_str(&mid), path_str(&base)]);
    assert!(
        d.frontend_pid != 0 && !d.drained,
        "pid {} drained {}",
        d.frontend_pid,
        d.drained
    );
    blkplane_tests::qemu_img::assert_check_clean(&top, false);
    let out = Command::new("qemu-img")
        .args(["compare", "-U", "-F", "raw"])
        .arg(&top)
        .arg(&view)
        .output()
        .unwrap();
    assert!(out.status.success(), "after the failed commit: {out:?}");

    // The commit, through blkplanectl.
    let out = ctl(&node, &["-o", "json", "disk", "commit", "c"]);
    assert!(out.status.success(), "{out:?}");
    let shown: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(shown["config"]["image"], path_str(&mid), "{shown}");
    assert_eq!(shown["config"]["format"], "qcow2", "{shown}");
    assert_eq!(shown["backing_chain"][0], path_str(&base), "{shown}");
    assert_eq!(
        shown["backing_chain"].as_array().map(Vec::len),
        Some(1),
        "{shown}"
    );
    assert_eq!(shown["capacity_bytes"], 32 * MIB, "{shown}");
    assert_eq!(shown["drained"], false, "{shown}");
    assert!(!temporary.exists(), "the temporary overlay was left behind");
    let top_after_commit = std::fs::read(&top).expect("the committed image is left");
    blkplane_tests::qemu_img::assert_check_clean(&mid, false);
    let out = Command::new("qemu-img")
        .args(["compare", "-U", "-F", "raw"])
        .arg(&mid)
        .arg(&view)
        .output()
        .unwrap();
    assert!(out.status.success(), "the committed image: {out:?}");
    {
        let mut vmm = blkplane_tests::Client::connect(&socket).expect("connect after commit");
        assert_eq!(vmm.capacity(), 32 * MIB);
        let got = vmm.queue(0).read_at(20 * MIB, 12288).expect("read");
        blkplane_tests::assert_same_data(
            "data written past the middle image's old size",
            &got,
            &blkplane_tests::pattern(43, 12288),
        );
        let after = blkplane_tests::pattern(50, 4096);
        vmm.queue(0).write_at(5 * MIB, &after).expect("write after");
        vmm.queue(0).flush().expect("flush");
        let got = vmm.queue(0).read_at(5 * MIB, 4096).expect("read back");
        blkplane_tests::assert_same_data("data written after the commit", &got, &after);
    }
    assert_eq!(
        std::fs::read(&top).unwrap(),
        top_after_commit,
        "the committed image was written after the commit"
    );

    // Persisted.
    node.restart().await;
    let d = node.get("c").await;
    assert_eq!(
        d.config.unwrap().settings_or_default().image,
        path_str(&mid)
    );
    assert_eq!(d.backing_chain, vec![path_str(&base)]);
    println!("commit: top.qcow2 merged into mid.qcow2 (grown 16 -> 32 MiB) and served");
}
