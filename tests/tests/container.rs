//! The container image, built here without a registry and run as the Helm chart's pod runs it.
//!
//! - The image is built by `packaging/build-image.sh` from the binaries under test (the
//!   harness's [`binaries`]) as `localhost/blkplane-test:latest`, its Debian rootfs cached by the
//!   script, and the OCI archive it writes is checked to hold that image.
//! - The Containerfile and the script agree: the Containerfile copies every workspace member, its
//!   runtime base installs `packaging/runtime-packages` (the list the script's rootfs is made
//!   from), every shared library the binaries link and the init container's `chown` come from a
//!   package of that list, and its last stage (which the script builds as it is) starts from that
//!   base. The chart's seccomp profile is `packaging/seccomp-profile.py`'s output for the
//!   installed runtime default, which it exceeds by exactly the io_uring calls.
//! - `podman run` with the rendered DaemonSet's pod (`helm template`): the init container's
//!   `chown` first, then blkplaned with the pod's user and groups, no capability, a read-only
//!   root, no privilege escalation, the chart's Localhost seccomp profile installed below a
//!   seccomp root as on a node (runc enforces it), `--init` for the pod's shared process
//!   namespace (a PID 1 that reaps orphaned iothreads), and the hostPath directories bind-mounted
//!   at the chart's paths. Then, from the host: every blkplane process is confined as asked, the
//!   probes' command exits 0 (`podman exec`, as a kubelet's exec probe), a disk added with the
//!   host's blkplanectl through the bind-mounted control socket is served on the bind-mounted
//!   socket directory and libblkio writes and verifies data through it, `/metrics` answers on
//!   the container's IP, a `kill -9` of the frontend inside the container is repaired (a new
//!   frontend, the data still there, I/O going on, no zombie left), and SIGTERM (`podman stop`)
//!   stops the container with status 0.
//! - The same run under the runtime default without io_uring and with every other call logged
//!   (SCMP_ACT_LOG), read from the kernel's audit stream: blkplane makes exactly
//!   io_uring_setup, io_uring_enter and io_uring_register beyond that default.
//! - Under the profile without the io_uring calls the disk does not start, and `blkplanectl disk
//!   add` says so, naming seccomp.
//! - `podman kube play` of the rendered pod (podman's own reading of the manifest, its init
//!   container included), served and stopped the same way; see [`kube_pod`] for what has to be
//!   translated for podman 4.3.
//!
//! podman, runc, catatonit, mmdebstrap and PyYAML come from `tests/setup-container.sh`, helm from
//! `tests/setup.sh` (which runs the former); without them, or without root, these tests fail and
//! say so. Every wait is bounded; containers, pods and temporary directories are removed even
//! when a test fails.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use blkplane_tests::daemon::proc_state;
use blkplane_tests::json::{to_json, Json};
use blkplane_tests::tools::{
    dechunk, on_path, output_within, python_has_yaml, run_tool, text, TOOL_TIMEOUT,
};
use blkplane_tests::{binaries, create_image, pattern, read_file_at, wait_for, Client, TempDir};

/// The image the tests build and run (the chart is rendered with it).
const IMAGE_REPOSITORY: &str = "localhost/blkplane-test";
const IMAGE_TAG: &str = "latest";
/// The longest wait for blkplaned, a disk, a probe or a container.
const TIMEOUT: Duration = Duration::from_secs(30);
/// The longest the image build may take (the first one makes the Debian rootfs).
const BUILD_TIMEOUT: Duration = Duration::from_secs(900);
/// Where the image keeps the binaries.
const IMAGE_BIN: &str = "/usr/local/bin/";
/// What to do when something is missing.
const INSTALL_HINT: &str = "the container checks need root, podman, runc, catatonit, \
                            mmdebstrap, python3 with PyYAML and helm: install them with `sudo \
                            bash tests/setup.sh` (it runs tests/setup-container.sh)";

// ---- the workspace, the tools, the image -------------------------------------------------

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

fn chart() -> PathBuf {
    workspace().join("helm/blkplane")
}

/// The cargo target directory this test binary was built into (the script keeps its rootfs
/// cache and the OCI archive there).
fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    // target/<profile>/deps/<test binary>
    exe.ancestors()
        .find(|d| d.join("CACHEDIR.TAG").is_file())
        .map(Path::to_path_buf)
        .unwrap_or_else(|| workspace().join("target"))
}

/// The external tools, found once.
struct Tools {
    podman: PathBuf,
    helm: PathBuf,
    /// A python3 that can `import yaml`.
    python: PathBuf,
    /// A containers.conf of this test's own (CONTAINERS_CONF), see [`tools`].
    containers_conf: PathBuf,
}

fn tools() -> &'static Tools {
    static TOOLS: OnceLock<Tools> = OnceLock::new();
    TOOLS.get_or_init(|| {
        // SAFETY: plain syscall.
        assert!(
            unsafe { libc::geteuid() } == 0,
            "not root: podman runs the image as root here: {INSTALL_HINT}"
        );
        let find = |name: &str| {
            on_path(name).unwrap_or_else(|| panic!("{name} is not on PATH: {INSTALL_HINT}"))
        };
        let podman = find("podman");
        find("runc");
        find("mmdebstrap");
        let helm = find("helm");
        for file in [
            "/usr/libexec/podman/catatonit",
            "/usr/share/containers/seccomp.json",
        ] {
            assert!(
                Path::new(file).exists(),
                "{file} is missing: {INSTALL_HINT}"
            );
        }
        // Debian's python3 (python3-yaml) first: another python3 may come first on PATH.
        let python = [PathBuf::from("/usr/bin/python3")]
            .into_iter()
            .chain(on_path("python3"))
            .find(|p| python_has_yaml(p))
            .unwrap_or_else(|| panic!("no python3 with PyYAML: {INSTALL_HINT}"));
        // podman raises RLIMIT_NOFILE and RLIMIT_NPROC of every container (its infra containers
        // too) far beyond this process's own hard limits, which a machine may not allow (runc:
        // "error setting rlimits"); the pod is given the limits the test itself has instead,
        // through containers.conf, which `podman kube play` has no flag for. podman lowers its
        // own RLIMIT_NPROC to the kernel's pid_max, so no container can have more than that.
        let pid_max: u64 = std::fs::read_to_string("/proc/sys/kernel/pid_max")
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        let mut limits = Vec::new();
        for (name, resource) in [
            ("nofile", libc::RLIMIT_NOFILE),
            ("nproc", libc::RLIMIT_NPROC),
        ] {
            let mut rl = libc::rlimit {
                rlim_cur: 0,
                rlim_max: 0,
            };
            // SAFETY: getrlimit writes the struct it is given.
            assert_eq!(unsafe { libc::getrlimit(resource, &mut rl) }, 0);
            let max = match resource {
                libc::RLIMIT_NPROC => rl.rlim_max.min(pid_max),
                _ => rl.rlim_max,
            };
            if max != libc::RLIM_INFINITY {
                limits.push(format!("\"{name}={max}:{max}\""));
            }
        }
        let dir = target_dir().join("image");
        std::fs::create_dir_all(&dir).unwrap();
        let containers_conf = dir.join("test-containers.conf");
        std::fs::write(
            &containers_conf,
            format!(
                "# Written by tests/tests/container.rs.\n[containers]\ndefault_ulimits = [{}]\n",
                limits.join(", ")
            ),
        )
        .unwrap();
        let version = run_tool(Command::new(&podman).arg("--version"), "podman --version");
        eprintln!("{} ({})", version.trim(), podman.display());
        Tools {
            podman,
            helm,
            python,
            containers_conf,
        }
    })
}

/// A podman command with the test's containers.conf and runc as the OCI runtime (crun 1.8,
/// Debian's, refuses hybrid cgroup layouts).
fn podman() -> Command {
    let t = tools();
    let mut cmd = Command::new(&t.podman);
    cmd.env("CONTAINERS_CONF", &t.containers_conf)
        .args(["--runtime", "runc"]);
    cmd
}

/// `REPOSITORY:TAG` of the image under test, built on first use by packaging/build-image.sh
/// from the binaries under test, and its OCI archive checked.
fn image() -> &'static str {
    static IMAGE: OnceLock<String> = OnceLock::new();
    IMAGE.get_or_init(|| {
        let tag = format!("{IMAGE_REPOSITORY}:{IMAGE_TAG}");
        let bins = binaries();
        let bin_dir = bins.blkplaned.parent().unwrap();
        let out_dir = target_dir().join("image");
        let started = Instant::now();
        let out = output_within(
            Command::new("bash")
                .arg(workspace().join("packaging/build-image.sh"))
                .arg("--bin-dir")
                .arg(bin_dir)
                .args(["--tag", &tag])
                .arg("--out")
                .arg(&out_dir)
                .env("CONTAINERS_CONF", &tools().containers_conf),
            BUILD_TIMEOUT,
        );
        assert!(
            out.status.success(),
            "packaging/build-image.sh failed ({}):\n{}",
            out.status,
            text(&out)
        );
        eprintln!(
            "built {tag} in {:.1?}:\n{}",
            started.elapsed(),
            String::from_utf8_lossy(&out.stdout).trim_end()
        );
        check_archive(&out_dir.join("blkplane-test-latest.oci.tar"), &tag);
        tag
    })
}

/// The OCI archive holds the image: its index names the tag, and its manifest's config is the
/// local image's (podman's image ID is the config's digest).
fn check_archive(archive: &Path, tag: &str) {
    let member = |name: &str| {
        run_tool(
            Command::new("tar").arg("-xOf").arg(archive).arg(name),
            &format!("reading {name} of {}", archive.display()),
        )
    };
    let index = Json::parse(&member("index.json"));
    let manifests = index.get("manifests").arr();
    assert_eq!(manifests.len(), 1, "{index:?}");
    assert_eq!(
        manifests[0]
            .get("annotations")
            .get("org.opencontainers.image.ref.name")
            .str(),
        tag
    );
    let digest = manifests[0].get("digest").str();
    let manifest = Json::parse(&member(&format!(
        "blobs/sha256/{}",
        digest.trim_start_matches("sha256:")
    )));
    let id = run_tool(
        podman().args(["image", "inspect", "--format", "{{.Id}}", tag]),
        "podman image inspect",
    );
    assert_eq!(
        manifest.get("config").get("digest").str(),
        format!("sha256:{}", id.trim()),
        "{} holds another image than {tag}",
        archive.display()
    );
}

// ---- the chart ---------------------------------------------------------------------------

/// The manifests of `helm template` with the test's image and `set`, as JSON.
fn render(set: &[&str], scratch: &Path) -> Vec<Json> {
    let t = tools();
    let mut cmd = Command::new(&t.helm);
    cmd.args(["template", "blkplane"])
        .arg(chart())
        .args(["--namespace", "blkplane-system"])
        .args(["--set", &format!("image.repository={IMAGE_REPOSITORY}")])
        .args(["--set", &format!("image.tag={IMAGE_TAG}")]);
    for s in set {
        cmd.args(["--set", s]);
    }
    let yaml = run_tool(&mut cmd, "helm template");
    let file = scratch.join("rendered.yaml");
    std::fs::write(&file, &yaml).unwrap();
    let json = run_tool(
        Command::new(&t.python)
            .arg("-c")
            .arg(
                "import json, sys, yaml\n\
                 docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d is not None]\n\
                 json.dump(docs, sys.stdout)\n",
            )
            .arg(&file),
        "converting helm's YAML to JSON",
    );
    Json::parse(&json).arr().to_vec()
}

/// The pod template of the rendered DaemonSet.
fn pod_template(docs: &[Json]) -> &Json {
    docs.iter()
        .find(|d| d.get("kind").str() == "DaemonSet")
        .expect("no DaemonSet rendered")
        .get("spec")
        .get("template")
}

fn container<'a>(pod: &'a Json, list: &str, name: &str) -> &'a Json {
    pod.get(list)
        .arr()
        .iter()
        .find(|c| c.get("name").str() == name)
        .unwrap_or_else(|| panic!("no {list} entry {name:?}"))
}

fn strs(v: Option<&Json>) -> Vec<String> {
    v.map(|a| a.arr().iter().map(|s| s.str().to_string()).collect())
        .unwrap_or_default()
}

/// The members of the JSON object `v` (none when it is absent).
fn keys(v: Option<&Json>) -> Vec<String> {
    match v {
        Some(Json::Obj(m)) => m.keys().cloned().collect(),
        _ => Vec::new(),
    }
}

// ---- the node ------------------------------------------------------------------------------

/// A node's side of the pod: a directory per hostPath volume, created as the kubelet creates
/// them (root's, mode 0755), and a kubelet seccomp root with the chart's profile installed as
/// packaging/README.md says.
struct Node {
    dir: TempDir,
    /// hostPath volume name → its directory here.
    volumes: BTreeMap<String, PathBuf>,
    /// Mount path in the container → the directory here.
    mounts: BTreeMap<String, PathBuf>,
    /// The kubelet's seccomp root (KUBELET_ROOT_DIR/seccomp).
    seccomp_root: PathBuf,
}

impl Node {
    /// `profile` is the text installed as the pod's Localhost profile (the chart's own, or a
    /// variant of it).
    fn new(tag: &str, template: &Json, profile: &str) -> Node {
        let dir = TempDir::new(tag);
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let spec = template.get("spec");
        let mut volumes = BTreeMap::new();
        for (i, v) in spec.get("volumes").arr().iter().enumerate() {
            assert!(
                v.field("hostPath").is_some(),
                "only hostPath volumes are known here: {v:?}"
            );
            let path = dir.join(&format!("h{i}"));
            std::fs::create_dir(&path).unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
            volumes.insert(v.get("name").str().to_string(), path);
        }
        let main = container(spec, "containers", "blkplaned");
        let mut mounts = BTreeMap::new();
        for m in main.get("volumeMounts").arr() {
            mounts.insert(
                m.get("mountPath").str().to_string(),
                volumes[m.get("name").str()].clone(),
            );
        }
        let seccomp_root = dir.join("seccomp");
        let sc = main.get("securityContext").get("seccompProfile");
        assert_eq!(sc.get("type").str(), "Localhost", "the chart's default");
        let installed = seccomp_root.join(sc.get("localhostProfile").str());
        std::fs::create_dir_all(installed.parent().unwrap()).unwrap();
        std::fs::write(&installed, profile).unwrap();
        Node {
            dir,
            volumes,
            mounts,
            seccomp_root,
        }
    }

    /// The node directory mounted at `mount_path`.
    fn host(&self, mount_path: &str) -> &Path {
        self.mounts
            .get(mount_path)
            .unwrap_or_else(|| panic!("{mount_path} is not mounted into blkplaned"))
    }

    /// The node directory mounted at the directory given as `flag` in blkplaned's arguments,
    /// with that path: the first such directory when the flag repeats.
    fn dir_of_flag(&self, template: &Json, flag: &str) -> (String, PathBuf) {
        let args = strs(container(template.get("spec"), "containers", "blkplaned").field("args"));
        let path = args
            .windows(2)
            .find(|w| w[0] == flag)
            .map(|w| w[1].clone())
            .unwrap_or_else(|| panic!("no {flag} in {args:?}"));
        let host = self.host(&path).to_path_buf();
        (path, host)
    }
}

// ---- a Kubernetes container as podman options ------------------------------------------------

/// The `podman run` options that give the container `c` of pod spec `pod` what the kubelet would:
/// its user and groups (the container's settings over the pod's), capabilities, read-only root,
/// no_new_privs, seccomp profile (Localhost: the file below the node's seccomp root; podman's
/// own default is the same containers-common profile as RuntimeDefault), environment, hostPath
/// mounts with their propagation, and command. A setting this does not know fails the test, so
/// that a chart change cannot make the run differ from the pod unnoticed.
fn run_options(pod: &Json, c: &Json, node: &Node) -> Vec<String> {
    let mut o = Vec::new();
    let psc = pod.field("securityContext");
    let sc = c.field("securityContext");
    for k in keys(psc) {
        assert!(
            [
                "runAsUser",
                "runAsGroup",
                "runAsNonRoot",
                "supplementalGroups"
            ]
            .contains(&k.as_str()),
            "pod securityContext.{k} is not translated to podman"
        );
    }
    for k in keys(sc) {
        assert!(
            [
                "runAsUser",
                "runAsGroup",
                "runAsNonRoot",
                "privileged",
                "allowPrivilegeEscalation",
                "readOnlyRootFilesystem",
                "capabilities",
                "seccompProfile"
            ]
            .contains(&k.as_str()),
            "container securityContext.{k} is not translated to podman"
        );
    }
    let setting = |name: &str| {
        sc.and_then(|s| s.field(name))
            .or_else(|| psc.and_then(|s| s.field(name)))
    };
    let uid = setting("runAsUser").map_or(0, Json::u64);
    let gid = setting("runAsGroup").map_or(uid, Json::u64);
    if setting("runAsNonRoot").is_some_and(Json::bool) {
        assert_ne!(uid, 0, "runAsNonRoot with uid 0 would not start");
    }
    o.push(format!("--user={uid}:{gid}"));
    for g in psc
        .and_then(|s| s.field("supplementalGroups"))
        .map(|a| a.arr().to_vec())
        .unwrap_or_default()
    {
        o.push(format!("--group-add={}", g.u64()));
    }
    let sc = sc.expect("the chart sets every container's securityContext");
    // Kubernetes' defaults where a field is absent.
    assert!(
        !sc.field("privileged").is_some_and(Json::bool),
        "privileged is not translated"
    );
    if sc
        .field("allowPrivilegeEscalation")
        .is_some_and(|b| !b.bool())
    {
        o.push("--security-opt=no-new-privileges".into());
    }
    if sc.field("readOnlyRootFilesystem").is_some_and(Json::bool) {
        // Not podman's tmpfs on /run, /tmp and /var/tmp: a pod has none.
        o.extend(["--read-only".into(), "--read-only-tmpfs=false".into()]);
    }
    for cap in strs(sc.get("capabilities").field("drop")) {
        o.push(format!("--cap-drop={cap}"));
    }
    for cap in strs(sc.get("capabilities").field("add")) {
        o.push(format!("--cap-add={cap}"));
    }
    let seccomp = sc.get("seccompProfile");
    match seccomp.get("type").str() {
        "Localhost" => o.push(format!(
            "--security-opt=seccomp={}",
            node.seccomp_root
                .join(seccomp.get("localhostProfile").str())
                .display()
        )),
        "RuntimeDefault" => {}
        "Unconfined" => o.push("--security-opt=seccomp=unconfined".into()),
        other => panic!("seccompProfile type {other}"),
    }
    for e in c.field("env").map(|a| a.arr().to_vec()).unwrap_or_default() {
        o.push(format!(
            "--env={}={}",
            e.get("name").str(),
            e.get("value").str()
        ));
    }
    for m in c.get("volumeMounts").arr() {
        let host = &node.volumes[m.get("name").str()];
        let propagation = match m.field("mountPropagation").map(Json::str) {
            None | Some("None") => "",
            Some("HostToContainer") => ":rslave",
            Some(other) => panic!("mountPropagation {other} is not translated"),
        };
        o.push(format!(
            "--volume={}:{}{propagation}",
            host.display(),
            m.get("mountPath").str()
        ));
    }
    let command = strs(c.field("command"));
    assert!(
        !command.is_empty(),
        "{} has no command",
        c.get("name").str()
    );
    let mut entrypoint = String::new();
    to_json(
        &Json::Arr(command.into_iter().map(Json::Str).collect()),
        &mut entrypoint,
    );
    o.push(format!("--entrypoint={entrypoint}"));
    o
}

/// A name no other test (or run) uses at the same time.
fn unique(tag: &str) -> String {
    static N: AtomicUsize = AtomicUsize::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    format!(
        "bp-{tag}-{}-{}-{nanos:x}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

// ---- the running pod ---------------------------------------------------------------------------

/// The chart's pod, run by podman one way or another; removed (with `podman rm --force` or `pod
/// rm --force`) on drop, its blkplaned log printed when the test failed.
struct Pod {
    node: Node,
    template: Json,
    /// The blkplaned container's name.
    container: String,
    /// The kube-played pod, if it is one.
    pod: Option<String>,
    /// The container holding the network namespace (the pod's infra container, or blkplaned's).
    network_holder: String,
}

impl Pod {
    /// Runs the init container to completion, then blkplaned, as the kubelet runs the pod.
    fn run(tag: &str, template: Json, profile: &str) -> Pod {
        let node = Node::new(tag, &template, profile);
        let name = unique(tag);
        let spec = template.get("spec");
        let image = image();
        // Removed before anything runs, so that a failure in between leaves nothing behind.
        let pod = Pod {
            node,
            container: name.clone(),
            pod: None,
            network_holder: name.clone(),
            template: template.clone(),
        };
        for init in spec.get("initContainers").arr() {
            let mut cmd = podman();
            cmd.args(["run", "--rm", "--name", &format!("{name}-init")])
                .args(run_options(spec, init, &pod.node))
                .arg(image)
                .args(strs(init.field("args")));
            let out = output_within(&mut cmd, TOOL_TIMEOUT);
            assert!(
                out.status.success(),
                "init container {} failed ({}): {}",
                init.get("name").str(),
                out.status,
                text(&out)
            );
        }
        let main = container(spec, "containers", "blkplaned");
        assert!(
            spec.field("shareProcessNamespace").is_some_and(Json::bool),
            "the pod shares its process namespace: its pause process is PID 1"
        );
        for ns in ["hostNetwork", "hostPID", "hostIPC"] {
            assert!(
                !spec.field(ns).is_some_and(Json::bool),
                "{ns} is not translated"
            );
        }
        let mut cmd = podman();
        cmd.args(["run", "--detach", "--name", &name])
            // The pause process of the pod's shared process namespace: a PID 1 that reaps.
            .arg("--init")
            .args(run_options(spec, main, &pod.node))
            .arg(image)
            .args(strs(main.field("args")));
        run_tool(&mut cmd, "podman run blkplaned");
        pod.wait_started();
        pod
    }

    /// Plays the pod with `podman kube play` (see [`kube_pod`]) and waits until it serves.
    fn play(tag: &str, template: Json, profile: &str) -> Pod {
        // Built (or rebuilt from the binaries under test) before the manifest names it.
        image();
        let node = Node::new(tag, &template, profile);
        let name = unique(tag);
        let (manifest, seccomp_dir) = kube_pod(&name, &template, &node);
        let file = node.dir.join("pod.json");
        let mut manifest_text = String::new();
        to_json(&manifest, &mut manifest_text);
        std::fs::write(&file, manifest_text).unwrap();
        let mut pod = Pod {
            node,
            template,
            container: format!("{name}-blkplaned"),
            pod: Some(name.clone()),
            network_holder: String::new(),
        };
        let out = output_within(
            podman()
                .args(["kube", "play", "--seccomp-profile-root"])
                .arg(&seccomp_dir)
                .arg(&file),
            TOOL_TIMEOUT,
        );
        assert!(
            out.status.success(),
            "podman kube play failed ({}): {}",
            out.status,
            text(&out)
        );
        let infra = run_tool(
            podman().args(["pod", "inspect", "--format", "{{.InfraContainerID}}", &name]),
            "podman pod inspect",
        );
        pod.network_holder = infra.trim().to_string();
        pod.wait_started();
        pod
    }

    /// Waits until the startup probe's command succeeds, as the kubelet does before it looks at
    /// the other probes.
    fn wait_started(&self) {
        let mut last = None;
        let ok = wait_for(TIMEOUT, || {
            let out = self.probe("startupProbe");
            if out.status.success() {
                return Some(());
            }
            last = Some(text(&out));
            std::thread::sleep(Duration::from_millis(100));
            None
        });
        assert!(
            ok.is_some(),
            "the startup probe did not succeed within {TIMEOUT:?}: {last:?}\n{}",
            self.logs()
        );
    }

    fn main(&self) -> &Json {
        container(self.template.get("spec"), "containers", "blkplaned")
    }

    /// Runs a command in blkplaned's container, as `kubectl exec` does.
    fn exec(&self, args: &[&str]) -> Output {
        output_within(
            podman().arg("exec").arg(&self.container).args(args),
            TIMEOUT,
        )
    }

    /// Runs the rendered probe's command in the container, as the kubelet's exec probe does.
    fn probe(&self, probe: &str) -> Output {
        let command = strs(self.main().get(probe).get("exec").field("command"));
        assert!(command[0].starts_with(IMAGE_BIN), "{probe}: {command:?}");
        let args: Vec<&str> = command.iter().map(String::as_str).collect();
        self.exec(&args)
    }

    fn logs(&self) -> String {
        let out = output_within(podman().args(["logs", &self.container]), TOOL_TIMEOUT);
        text(&out)
    }

    /// The host pid of the container's first process (`--init`'s catatonit, or blkplaned in a
    /// kube-played pod, whose PID 1 is the infra container's).
    fn host_pid(&self) -> u32 {
        run_tool(
            podman().args(["inspect", "--format", "{{.State.Pid}}", &self.container]),
            "podman inspect",
        )
        .trim()
        .parse()
        .unwrap()
    }

    /// The pod's IP address (the pod network's, not the node's).
    fn ip(&self) -> IpAddr {
        let out = run_tool(
            podman().args([
                "inspect",
                "--format",
                "{{.NetworkSettings.IPAddress}} {{range .NetworkSettings.Networks}}{{.IPAddress}} {{end}}",
                &self.network_holder,
            ]),
            "podman inspect",
        );
        out.split_whitespace()
            .find_map(|a| a.parse().ok())
            .unwrap_or_else(|| panic!("no IP address for {}: {out:?}", self.network_holder))
    }

    /// The host's blkplanectl on the bind-mounted control socket.
    fn ctl(&self, args: &[&str]) -> Output {
        let (_, runtime) = self.node.dir_of_flag(&self.template, "--runtime-dir");
        output_within(
            Command::new(&binaries().blkplanectl)
                .arg("--socket")
                .arg(runtime.join("control.sock"))
                .args(args),
            TIMEOUT,
        )
    }

    fn disk(&self, id: &str) -> Json {
        let out = self.ctl(&["-o", "json", "disk", "show", id]);
        assert!(out.status.success(), "disk show {id}: {}", text(&out));
        Json::parse(&String::from_utf8_lossy(&out.stdout))
    }

    /// `podman stop` with the pod's grace period: SIGTERM, SIGKILL when it expires. Returns the
    /// exit status and how long it took.
    fn stop(&self) -> (i64, Duration) {
        let grace = self
            .template
            .get("spec")
            .get("terminationGracePeriodSeconds")
            .u64();
        let started = Instant::now();
        run_tool(
            podman().args(["stop", "--time", &grace.to_string(), &self.container]),
            "podman stop",
        );
        let took = started.elapsed();
        let code = run_tool(
            podman().args([
                "inspect",
                "--format",
                "{{.State.ExitCode}}",
                &self.container,
            ]),
            "podman inspect",
        );
        (code.trim().parse().unwrap(), took)
    }
}

impl Drop for Pod {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "---- {} log ----\n{}---- end ----",
                self.container,
                self.logs()
            );
        }
        let mut cmd = podman();
        match &self.pod {
            Some(pod) => cmd.args(["pod", "rm", "--force", pod]),
            None => cmd.args(["rm", "--force", "--time", "0", &self.container]),
        };
        let _ = output_within(&mut cmd, TOOL_TIMEOUT);
    }
}

/// The rendered DaemonSet's pod template as a Pod that podman 4.3 (Debian's) plays like the
/// kubelet runs it, and the directory to pass as `--seccomp-profile-root`. What is translated,
/// and why:
///
/// - kind: a Pod with the template's metadata and spec (`kube play` does not know DaemonSets);
/// - hostPath paths: the node's directories of this test;
/// - restartPolicy Always → OnFailure: podman applies the pod's policy to its init containers
///   too, so it restarts the `chown` that has just succeeded, waits 20 s for it to exit and then
///   may fail to remove it (the kubelet never reruns a succeeded init container); OnFailure
///   keeps the init container's semantics and still restarts a failing blkplaned;
/// - securityContext.seccompProfile: podman 4.3 ignores the field and reads only the older
///   per-container annotation, `localhost/NAME` with one path component, so the annotation names
///   the profile's file and the seccomp root given to podman is its directory. The field stays.
///
/// The probes are left as they are (podman runs them only with systemd; the test runs their
/// command itself).
fn kube_pod(name: &str, template: &Json, node: &Node) -> (Json, PathBuf) {
    let Json::Obj(mut spec) = template.get("spec").clone() else {
        panic!("the pod spec is not an object");
    };
    assert_eq!(
        spec.get("restartPolicy"),
        None,
        "the template sets restartPolicy"
    );
    spec.insert("restartPolicy".into(), Json::Str("OnFailure".into()));
    let Some(Json::Arr(volumes)) = spec.get_mut("volumes") else {
        panic!("no volumes");
    };
    for v in volumes.iter_mut() {
        let host = node.volumes[v.get("name").str()]
            .to_str()
            .unwrap()
            .to_string();
        let Json::Obj(v) = v else { unreachable!() };
        let Some(Json::Obj(hp)) = v.get_mut("hostPath") else {
            panic!("not a hostPath volume");
        };
        hp.insert("path".into(), Json::Str(host));
    }
    let mut annotations = BTreeMap::new();
    let mut seccomp_dir = None;
    for list in ["initContainers", "containers"] {
        for c in spec[list].arr() {
            let profile = c.get("securityContext").get("seccompProfile");
            let value = match profile.get("type").str() {
                "Localhost" => {
                    let file = node
                        .seccomp_root
                        .join(profile.get("localhostProfile").str());
                    seccomp_dir = Some(file.parent().unwrap().to_path_buf());
                    format!("localhost/{}", file.file_name().unwrap().to_str().unwrap())
                }
                "RuntimeDefault" => "runtime/default".into(),
                "Unconfined" => "unconfined".into(),
                other => panic!("seccompProfile type {other}"),
            };
            annotations.insert(
                format!(
                    "container.seccomp.security.alpha.kubernetes.io/{}",
                    c.get("name").str()
                ),
                Json::Str(value),
            );
        }
    }
    let metadata = BTreeMap::from([
        ("name".to_string(), Json::Str(name.to_string())),
        (
            "labels".to_string(),
            template.get("metadata").get("labels").clone(),
        ),
        ("annotations".to_string(), Json::Obj(annotations)),
    ]);
    let pod = Json::Obj(BTreeMap::from([
        ("apiVersion".to_string(), Json::Str("v1".into())),
        ("kind".to_string(), Json::Str("Pod".into())),
        ("metadata".to_string(), Json::Obj(metadata)),
        ("spec".to_string(), Json::Obj(spec)),
    ]));
    (
        pod,
        seccomp_dir.unwrap_or_else(|| node.seccomp_root.clone()),
    )
}

// ---- /proc ----------------------------------------------------------------------------------

/// The processes in the PID namespace of host pid `pid` (itself included): (host pid, exe).
fn processes_in_pid_namespace(pid: u32) -> Vec<(u32, String)> {
    match std::fs::read_link(format!("/proc/{pid}/ns/pid")) {
        Ok(ns) => processes_in(&ns),
        Err(_) => Vec::new(),
    }
}

/// The processes in the PID namespace `ns` (a /proc/PID/ns/pid link's target): (host pid, exe).
fn processes_in(ns: &Path) -> Vec<(u32, String)> {
    let mut out: Vec<(u32, String)> = blkplane_procfs::pids()
        .into_iter()
        .filter(|p| std::fs::read_link(format!("/proc/{p}/ns/pid")).is_ok_and(|n| n == *ns))
        .map(|p| {
            let exe = std::fs::read_link(format!("/proc/{p}/exe"))
                .map(|e| e.to_string_lossy().into_owned())
                .unwrap_or_default();
            (p, exe)
        })
        .collect();
    out.sort();
    out
}

/// The `Name:\tvalue` fields of /proc/PID/status.
fn status_fields(pid: u32) -> BTreeMap<String, String> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.to_string(), v.trim().to_string()))
        .collect()
}

/// Every blkplane process of the pod runs as the pod's user with no capability, no_new_privs
/// and a seccomp filter: what the securityContext asks for, seen from the host.
fn check_confinement(pod: &Pod) {
    let spec = pod.template.get("spec");
    let uid = spec
        .get("securityContext")
        .get("runAsUser")
        .u64()
        .to_string();
    let gid = spec
        .get("securityContext")
        .get("runAsGroup")
        .u64()
        .to_string();
    let procs = processes_in_pid_namespace(pod.host_pid());
    let ours: Vec<&(u32, String)> = procs
        .iter()
        .filter(|(_, exe)| exe.starts_with(IMAGE_BIN))
        .collect();
    // blkplaned, the frontend, its spawner and its iothread.
    assert!(ours.len() >= 4, "blkplane processes: {procs:?}");
    for (p, exe) in ours {
        let s = status_fields(*p);
        let ids = |k: &str| {
            s[k].split_whitespace()
                .map(str::to_string)
                .collect::<Vec<_>>()
        };
        assert_eq!(ids("Uid"), vec![uid.clone(); 4], "{exe} ({p})");
        assert_eq!(ids("Gid"), vec![gid.clone(); 4], "{exe} ({p})");
        for caps in ["CapPrm", "CapEff", "CapBnd", "CapAmb"] {
            assert_eq!(s[caps], "0000000000000000", "{exe} ({p}): {caps}");
        }
        assert_eq!(s["NoNewPrivs"], "1", "{exe} ({p})");
        assert_eq!(s["Seccomp"], "2", "{exe} ({p}): no seccomp filter");
    }
    // The root is read-only.
    let out = pod.exec(&["sh", "-c", "echo x >/usr/local/bin/x"]);
    assert!(!out.status.success(), "the root file system is writable");
    assert!(
        text(&out).contains("Read-only file system"),
        "{}",
        text(&out)
    );
}

// ---- HTTP and metrics ------------------------------------------------------------------------

/// One HTTP/1.1 GET: (status, body); None if nothing answered.
fn http_get(addr: SocketAddr, path: &str) -> Option<(u16, String)> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: blkplane\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).ok()?;
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text.split_once("\r\n\r\n")?;
    let status = head.split_whitespace().nth(1)?.parse().ok()?;
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        dechunk(body)?
    } else {
        body.to_string()
    };
    Some((status, body))
}

/// GET /metrics on the pod's IP and port (200 within [`TIMEOUT`]).
fn metrics(pod: &Pod) -> String {
    let port = pod.main().get("ports").arr()[0].get("containerPort").u64() as u16;
    let addr = SocketAddr::new(pod.ip(), port);
    let mut last = None;
    wait_for(TIMEOUT, || match http_get(addr, "/metrics") {
        Some((200, body)) => Some(body),
        other => {
            last = other;
            std::thread::sleep(Duration::from_millis(50));
            None
        }
    })
    .unwrap_or_else(|| panic!("GET /metrics on {addr}: no 200 within {TIMEOUT:?}: {last:?}"))
}

/// The sum of the samples of `name` whose labels include every pair of `labels`.
fn metric(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    text.lines()
        .filter_map(|l| {
            let rest = l.strip_prefix(name)?;
            let (lbl, value) = match rest.strip_prefix('{') {
                Some(inner) => {
                    let end = inner.rfind('}')?;
                    (&inner[..end], inner[end + 1..].trim())
                }
                None if rest.starts_with(' ') => ("", rest.trim()),
                None => return None,
            };
            labels
                .iter()
                .all(|(k, v)| lbl.contains(&format!("{k}=\"{v}\"")))
                .then(|| value.split_whitespace().next()?.parse::<f64>().ok())?
        })
        .sum()
}

// ---- the checks --------------------------------------------------------------------------------

/// How the disk is added: with the host's blkplanectl through the bind-mounted control socket,
/// or with the image's, inside the container (`kubectl exec POD -- blkplanectl`, as NOTES.txt
/// says; it finds the socket through the container's BLKPLANE_SOCKET).
#[derive(Clone, Copy)]
enum AddVia {
    HostSocket,
    Exec,
}

/// Adds disk vd0 in the pod's first image and socket directories; returns blkplanectl's output.
fn add_disk(pod: &Pod, via: AddVia) -> (Output, PathBuf, PathBuf) {
    let (image_dir, image_host) = pod.node.dir_of_flag(&pod.template, "--image-dir");
    let (socket_dir, socket_host) = pod.node.dir_of_flag(&pod.template, "--socket-dir");
    let image = image_host.join("vd0.img");
    create_image(&image, 64 << 20);
    // Image files must be readable and writable by the pod's user (values.yaml).
    let uid = pod
        .template
        .get("spec")
        .get("securityContext")
        .get("runAsUser")
        .u64() as u32;
    std::os::unix::fs::chown(&image, Some(uid), Some(uid)).unwrap();
    // Paths as blkplaned sees them: the chart's.
    let image_arg = format!("{image_dir}/vd0.img");
    let socket_arg = format!("{socket_dir}/vd0.sock");
    let args = [
        "disk",
        "add",
        "vd0",
        "--image",
        &image_arg,
        "--vhost-socket",
        &socket_arg,
    ];
    let out = match via {
        AddVia::HostSocket => pod.ctl(&args),
        AddVia::Exec => {
            let mut all = vec!["blkplanectl"];
            all.extend(args);
            pod.exec(&all)
        }
    };
    (out, image, socket_host.join("vd0.sock"))
}

/// Writes `data` at `offset` through the socket with libblkio and reads it back, then checks
/// `earlier` (offset, data) written before.
fn io(socket: &Path, image: &Path, offset: u64, data: &[u8], earlier: &[(u64, Vec<u8>)]) {
    let mut client = Client::connect(socket).expect("libblkio connects to the disk");
    for (off, d) in earlier {
        assert_eq!(
            client.queue(0).read_at(*off, d.len()).unwrap(),
            *d,
            "data written before at {off}"
        );
    }
    client
        .queue(0)
        .write_at(offset, data)
        .expect("write through blkplane");
    assert_eq!(client.queue(0).read_at(offset, data.len()).unwrap(), data);
    client.queue(0).flush().unwrap();
    assert_eq!(read_file_at(image, offset, data.len()), data, "the image");
}

/// Everything a served pod must do, as described in the module documentation, up to and
/// including its stop.
fn serve_and_repair(pod: &Pod, via: AddVia) {
    let started = Instant::now();
    for probe in ["startupProbe", "livenessProbe", "readinessProbe"] {
        let out = pod.probe(probe);
        assert!(out.status.success(), "{probe}: {}", text(&out));
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "SERVING");
    }
    let m = metrics(pod);
    assert_eq!(metric(&m, "blkplane_disks", &[]), 0.0, "{m}");

    let (out, image, socket) = add_disk(pod, via);
    assert!(
        out.status.success(),
        "disk add: {}\n{}",
        text(&out),
        pod.logs()
    );
    let md = std::fs::symlink_metadata(&socket)
        .unwrap_or_else(|e| panic!("{} on the node: {e}", socket.display()));
    assert!(md.file_type().is_socket());
    check_confinement(pod);

    let first = pattern(1, 8192);
    io(&socket, &image, 1 << 20, &first, &[]);
    let m = metrics(pod);
    assert_eq!(metric(&m, "blkplane_disks", &[]), 1.0, "{m}");
    assert!(
        metric(
            &m,
            "blkplane_queue_ops_total",
            &[("disk", "vd0"), ("kind", "write")]
        ) >= 1.0,
        "no write counted for vd0:\n{m}"
    );

    // kill -9 of the frontend, inside the container, by the user it runs as.
    let before = pod.disk("vd0");
    let frontend = before.get("frontend_pid").u64();
    let out = pod.exec(&["sh", "-c", &format!("kill -9 {frontend}")]);
    assert!(out.status.success(), "kill -9 {frontend}: {}", text(&out));
    let after = wait_for(TIMEOUT, || {
        let d = pod.disk("vd0");
        let pid = d.get("frontend_pid").u64();
        (pid != 0 && pid != frontend && d.get("state").str() == "ready").then_some(d)
    })
    .unwrap_or_else(|| {
        panic!(
            "vd0 was not repaired within {TIMEOUT:?}: {:?}\n{}",
            pod.disk("vd0"),
            pod.logs()
        )
    });
    assert_eq!(after.get("restarts").u64(), 1, "{after:?}");
    // The dead frontend's iothreads were reaped by PID 1: no zombie in the pod.
    let init = pod.host_pid();
    let zombies = || {
        processes_in_pid_namespace(init)
            .into_iter()
            .filter(|(p, _)| proc_state(*p) == Some('Z'))
            .collect::<Vec<_>>()
    };
    assert!(
        wait_for(TIMEOUT, || zombies().is_empty().then_some(())).is_some(),
        "zombies in the pod: {:?}",
        zombies()
    );
    let second = pattern(2, 4096);
    io(&socket, &image, 3 << 20, &second, &[(1 << 20, first)]);
    let m = metrics(pod);
    assert_eq!(
        metric(
            &m,
            "blkplane_disk_frontend_restarts_total",
            &[("disk", "vd0")]
        ),
        1.0,
        "{m}"
    );

    // The namespace outlives blkplaned's container in a kube-played pod (its infra container
    // holds it): nothing of blkplane may be left in it after the stop.
    let namespace = std::fs::read_link(format!("/proc/{init}/ns/pid")).unwrap();
    let (code, took) = pod.stop();
    assert_eq!(
        code,
        0,
        "blkplaned's exit status on SIGTERM\n{}",
        pod.logs()
    );
    let left = || {
        processes_in(&namespace)
            .into_iter()
            .filter(|(p, exe)| exe.starts_with(IMAGE_BIN) && proc_state(*p) != Some('Z'))
            .collect::<Vec<_>>()
    };
    assert!(
        wait_for(TIMEOUT, || left().is_empty().then_some(())).is_some(),
        "blkplane processes left after the stop: {:?}",
        left()
    );
    eprintln!(
        "{}: served, repaired and stopped (SIGTERM, {took:.1?}) in {:.1?}",
        pod.container,
        started.elapsed()
    );
}

/// The chart's seccomp profile as shipped.
fn shipped_profile() -> String {
    std::fs::read_to_string(chart().join("seccomp/blkplane.json")).unwrap()
}

/// packaging/seccomp-profile.py's output with `args`.
fn generated_profile(args: &[&str]) -> String {
    run_tool(
        Command::new(&tools().python)
            .arg(workspace().join("packaging/seccomp-profile.py"))
            .args(args),
        "packaging/seccomp-profile.py",
    )
}

/// The rendered chart's pod template with the default values.
fn default_template(scratch: &Path) -> Json {
    pod_template(&render(&[], scratch)).clone()
}

// ---- the kernel's audit records -------------------------------------------------------------

/// SECCOMP_RET_LOG, as audit records show it (`code=`).
const RET_LOG: &str = "0x7ffc0000";
/// AUDIT_SECCOMP.
const AUDIT_SECCOMP: u16 = 1326;

/// The kernel's audit records, read from its multicast group (AUDIT_NLGRP_READLOG): every record,
/// with or without an audit daemon, and not rate-limited like the copies in the kernel log.
struct AuditLog {
    records: Arc<Mutex<Vec<String>>>,
    lost: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
    reader: Option<JoinHandle<()>>,
}

impl AuditLog {
    fn start() -> AuditLog {
        // SAFETY: plain syscalls on a socket this function owns; results are checked.
        let fd = unsafe {
            let fd = libc::socket(
                libc::AF_NETLINK,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                libc::NETLINK_AUDIT,
            );
            assert!(
                fd >= 0,
                "audit netlink socket: {}",
                std::io::Error::last_os_error()
            );
            OwnedFd::from_raw_fd(fd)
        };
        let mut addr: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
        addr.nl_family = libc::AF_NETLINK as u16;
        addr.nl_groups = 1; // AUDIT_NLGRP_READLOG
                            // SAFETY: addr is a valid sockaddr_nl of the size given.
        let rc = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                &addr as *const libc::sockaddr_nl as *const libc::sockaddr,
                std::mem::size_of::<libc::sockaddr_nl>() as u32,
            )
        };
        assert_eq!(
            rc,
            0,
            "joining the audit log group (CAP_AUDIT_READ, a kernel with audit): {}",
            std::io::Error::last_os_error()
        );
        let size: libc::c_int = 16 << 20;
        let timeout = libc::timeval {
            tv_sec: 0,
            tv_usec: 100_000,
        };
        // SAFETY: setsockopt with values of the sizes given.
        unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVBUFFORCE,
                &size as *const _ as *const libc::c_void,
                std::mem::size_of_val(&size) as u32,
            );
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                &timeout as *const _ as *const libc::c_void,
                std::mem::size_of_val(&timeout) as u32,
            );
        }
        let records = Arc::new(Mutex::new(Vec::new()));
        let lost = Arc::new(AtomicBool::new(false));
        let stop = Arc::new(AtomicBool::new(false));
        let reader = {
            let (records, lost, stop) = (records.clone(), lost.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut buf = vec![0u8; 1 << 16];
                while !stop.load(Ordering::Relaxed) {
                    // SAFETY: recv into a buffer of the length given.
                    let n = unsafe {
                        libc::recv(
                            fd.as_raw_fd(),
                            buf.as_mut_ptr() as *mut libc::c_void,
                            buf.len(),
                            0,
                        )
                    };
                    if n < 0 {
                        match std::io::Error::last_os_error().raw_os_error() {
                            Some(libc::EAGAIN | libc::EINTR) => continue,
                            _ => {
                                // ENOBUFS: the kernel dropped records for this socket.
                                lost.store(true, Ordering::Relaxed);
                                continue;
                            }
                        }
                    }
                    // One netlink message per datagram: header (len, type, flags, seq, pid).
                    let msg = &buf[..n as usize];
                    if msg.len() < 16 || u16::from_ne_bytes([msg[4], msg[5]]) != AUDIT_SECCOMP {
                        continue;
                    }
                    let body = String::from_utf8_lossy(&msg[16..]);
                    records
                        .lock()
                        .unwrap()
                        .push(body.trim_end_matches('\0').to_string());
                }
            })
        };
        AuditLog {
            records,
            lost,
            stop,
            reader: Some(reader),
        }
    }

    /// Every record up to now: once a call made after everything else is recorded, every call
    /// before it is (the kernel queues its records in order). The mark is a getppid that a child
    /// of this test makes under a seccomp filter of its own that logs it.
    fn all(&self) -> Vec<String> {
        let child = mark_with_a_logged_call();
        let needle = format!(" pid={child} ");
        let found = wait_for(TIMEOUT, || {
            let r = self.records.lock().unwrap();
            r.iter().any(|l| l.contains(&needle)).then_some(())
        });
        assert!(
            found.is_some(),
            "the kernel logged no audit record of the mark within {TIMEOUT:?} (is \"log\" in \
             /proc/sys/kernel/seccomp/actions_logged?)"
        );
        assert!(
            !self.lost.load(Ordering::Relaxed),
            "the kernel dropped audit records"
        );
        self.records.lock().unwrap().clone()
    }
}

impl Drop for AuditLog {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
    }
}

/// Runs /bin/true in a child that first logs one getppid through a seccomp filter
/// (SECCOMP_RET_LOG for getppid, allow everything else); returns the child's pid.
fn mark_with_a_logged_call() -> u32 {
    let mut cmd = Command::new("/bin/true");
    // SAFETY: prctl, seccomp and getppid are async-signal-safe; the filter is built on this
    // stack frame and outlives the call that installs it.
    unsafe {
        cmd.pre_exec(|| {
            let filter = [
                // A = seccomp_data.nr
                libc::sock_filter {
                    code: (libc::BPF_LD | libc::BPF_W | libc::BPF_ABS) as u16,
                    jt: 0,
                    jf: 0,
                    k: 0,
                },
                libc::sock_filter {
                    code: (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16,
                    jt: 0,
                    jf: 1,
                    k: libc::SYS_getppid as u32,
                },
                libc::sock_filter {
                    code: (libc::BPF_RET | libc::BPF_K) as u16,
                    jt: 0,
                    jf: 0,
                    k: libc::SECCOMP_RET_LOG,
                },
                libc::sock_filter {
                    code: (libc::BPF_RET | libc::BPF_K) as u16,
                    jt: 0,
                    jf: 0,
                    k: libc::SECCOMP_RET_ALLOW,
                },
            ];
            let prog = libc::sock_fprog {
                len: filter.len() as u16,
                filter: filter.as_ptr() as *mut libc::sock_filter,
            };
            if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0
                || libc::syscall(
                    libc::SYS_seccomp,
                    libc::SECCOMP_SET_MODE_FILTER,
                    0,
                    &prog as *const libc::sock_fprog,
                ) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            libc::syscall(libc::SYS_getppid);
            Ok(())
        });
    }
    let mut child = cmd.spawn().expect("the audit mark");
    let pid = child.id();
    assert!(child.wait().unwrap().success());
    pid
}

/// A field `key=value` of an audit record.
fn audit_field<'a>(record: &'a str, key: &str) -> Option<&'a str> {
    record
        .split_whitespace()
        .find_map(|f| f.strip_prefix(key)?.strip_prefix('='))
}

/// The system call names of the numbers that may show up here (the generic table: the same on
/// x86_64 and arm64).
fn syscall_name(nr: &str) -> String {
    match nr {
        "425" => "io_uring_setup".into(),
        "426" => "io_uring_enter".into(),
        "427" => "io_uring_register".into(),
        other => format!("system call {other}"),
    }
}

// ---- the tests ---------------------------------------------------------------------------------

#[test]
fn containerfile_script_and_profile_agree() {
    // Every workspace member is copied into the build stage (cargo loads all of them).
    let manifest = std::fs::read_to_string(workspace().join("Cargo.toml")).unwrap();
    let members_line = manifest
        .lines()
        .find(|l| l.trim_start().starts_with("members"))
        .expect("no workspace members in Cargo.toml");
    let members: Vec<&str> = members_line.split('"').skip(1).step_by(2).collect();
    assert!(members.len() >= 8, "{members_line}");
    let containerfile = std::fs::read_to_string(workspace().join("Containerfile")).unwrap();
    let instructions: Vec<&str> = containerfile
        .lines()
        .map(str::trim)
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .collect();
    let copied: BTreeSet<&str> = instructions
        .iter()
        .filter_map(|l| l.strip_prefix("COPY "))
        .filter(|l| !l.starts_with("--"))
        .flat_map(|l| {
            let words: Vec<&str> = l.split_whitespace().collect();
            words[..words.len() - 1].to_vec()
        })
        .collect();
    for m in &members {
        assert!(
            copied.contains(m),
            "the Containerfile does not copy workspace member {m} (copies {copied:?})"
        );
    }
    for f in ["Cargo.toml", "Cargo.lock"] {
        assert!(copied.contains(f), "the Containerfile does not copy {f}");
    }
    // The .proto files are compiled by protox: no protoc in the build.
    for l in &instructions {
        assert!(
            !l.contains("protobuf-compiler") && !l.contains("protoc"),
            "the Containerfile still installs protoc: {l}"
        );
    }
    // The runtime base installs the shared package list, and the last stage (the one
    // build-image.sh builds on its own rootfs) starts from it.
    let froms: Vec<&&str> = instructions
        .iter()
        .filter(|l| l.starts_with("FROM "))
        .collect();
    assert_eq!(**froms.last().unwrap(), "FROM runtime-base");
    let base = instructions
        .iter()
        .position(|l| l.starts_with("FROM ") && l.ends_with(" AS runtime-base"))
        .expect("no runtime-base stage");
    let stage_end = instructions[base + 1..]
        .iter()
        .position(|l| l.starts_with("FROM "))
        .map_or(instructions.len(), |i| base + 1 + i);
    let stage = instructions[base..stage_end].join("\n");
    assert!(
        stage.contains("COPY packaging/runtime-packages /tmp/runtime-packages")
            && stage.contains("/tmp/runtime-packages | xargs apt-get install"),
        "the runtime-base stage does not install packaging/runtime-packages:\n{stage}"
    );

    // Every shared library of the binaries, and the init container's command, come from a
    // package of the list.
    let listed: BTreeSet<String> =
        std::fs::read_to_string(workspace().join("packaging/runtime-packages"))
            .unwrap()
            .lines()
            .map(|l| l.split('#').next().unwrap().trim().to_string())
            .filter(|l| !l.is_empty())
            .collect();
    let package_of = |path: &str| -> String {
        let p = Path::new(path);
        let canonical = std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf());
        let mut candidates = vec![p.to_path_buf(), canonical.clone()];
        // Merged /usr: dpkg knows a file under the path its package ships it at.
        for c in [p.to_path_buf(), canonical] {
            let s = c.to_str().unwrap().to_string();
            candidates.push(match s.strip_prefix("/usr") {
                Some(rest) => PathBuf::from(rest),
                None => PathBuf::from(format!("/usr{s}")),
            });
        }
        for c in candidates {
            let out = output_within(Command::new("dpkg").arg("-S").arg(&c), TOOL_TIMEOUT);
            if out.status.success() {
                let line = String::from_utf8_lossy(&out.stdout).to_string();
                return line.split(':').next().unwrap().trim().to_string();
            }
        }
        panic!("no Debian package ships {path}")
    };
    let bins = binaries();
    for bin in [
        &bins.blkplaned,
        &bins.blkplanectl,
        &bins.frontend,
        &bins.iothread,
    ] {
        let ldd = run_tool(Command::new("ldd").arg(bin), "ldd");
        for line in ldd.lines() {
            // "libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)" or the loader's own path.
            let Some(path) = line.split_whitespace().find(|w| w.starts_with('/')) else {
                continue; // linux-vdso
            };
            let package = package_of(path);
            assert!(
                listed.contains(&package),
                "{} links {path} of package {package}, which packaging/runtime-packages does \
                 not name ({listed:?})",
                bin.display()
            );
        }
    }
    let scratch = TempDir::new("container-static");
    let template = default_template(scratch.path());
    for init in template.get("spec").get("initContainers").arr() {
        let command = strs(init.field("command"));
        let path = on_path(&command[0]).unwrap_or_else(|| PathBuf::from(&command[0]));
        let package = package_of(path.to_str().unwrap());
        assert!(
            listed.contains(&package),
            "the init container runs {} of package {package}, not in packaging/runtime-packages",
            command[0]
        );
    }

    // The chart's profile is the generator's output for the installed runtime default, and the
    // two differ in exactly the io_uring rule.
    let shipped = shipped_profile();
    assert_eq!(
        shipped,
        generated_profile(&[]),
        "helm/blkplane/seccomp/blkplane.json is not packaging/seccomp-profile.py's output for \
         /usr/share/containers/seccomp.json: regenerate it"
    );
    let with = Json::parse(&shipped);
    let without = Json::parse(&generated_profile(&["--without-io-uring"]));
    let (Json::Obj(w), Json::Obj(wo)) = (&with, &without) else {
        panic!("profiles are not objects");
    };
    for (k, v) in w {
        if k != "syscalls" {
            assert_eq!(Some(v), wo.get(k), "{k} differs from the runtime default");
        }
    }
    let rules = with.get("syscalls").arr();
    let base_rules = without.get("syscalls").arr();
    assert_eq!(&rules[..rules.len() - 1], base_rules);
    let added = rules.last().unwrap();
    assert_eq!(
        strs(added.field("names")),
        ["io_uring_enter", "io_uring_register", "io_uring_setup"]
    );
    assert_eq!(added.get("action").str(), "SCMP_ACT_ALLOW");
    assert!(added.field("args").is_none(), "{added:?}");
    // Plain runtime-spec JSON: nothing containerd would ignore.
    assert!(w.get("archMap").is_none());
    for r in rules {
        for k in keys(Some(r)) {
            assert!(
                ["names", "action", "args", "errnoRet", "comment"].contains(&k.as_str()),
                "rule field {k}: {r:?}"
            );
        }
    }
    // The chart points at it.
    let sp = container(template.get("spec"), "containers", "blkplaned")
        .get("securityContext")
        .get("seccompProfile");
    assert_eq!(sp.get("type").str(), "Localhost");
    assert_eq!(sp.get("localhostProfile").str(), "profiles/blkplane.json");
}

#[test]
fn image_serves_as_the_chart_runs_it() {
    let scratch = TempDir::new("container-run");
    let template = default_template(scratch.path());
    let pod = Pod::run("ctr-run", template, &shipped_profile());
    serve_and_repair(&pod, AddVia::HostSocket);
}

#[test]
fn blkplane_needs_only_io_uring_beyond_the_runtime_default() {
    let scratch = TempDir::new("container-measure");
    let template = default_template(scratch.path());
    let actions = std::fs::read_to_string("/proc/sys/kernel/seccomp/actions_logged").unwrap();
    assert!(
        actions.split_whitespace().any(|a| a == "log"),
        "the kernel does not log SCMP_ACT_LOG (actions_logged: {actions})"
    );
    let audit = AuditLog::start();
    // The runtime default without io_uring, every other call allowed and logged.
    let profile = generated_profile(&["--without-io-uring", "--default-action", "log"]);
    let pod = Pod::run("ctr-measure", template, &profile);
    serve_and_repair(&pod, AddVia::HostSocket);
    let mut calls: BTreeMap<String, usize> = BTreeMap::new();
    for r in audit.all() {
        let ours =
            audit_field(&r, "exe").is_some_and(|e| e.trim_matches('"').starts_with(IMAGE_BIN));
        if ours && audit_field(&r, "code") == Some(RET_LOG) {
            let name = syscall_name(audit_field(&r, "syscall").unwrap_or("?"));
            *calls.entry(name).or_default() += 1;
        }
    }
    eprintln!("calls beyond the runtime default: {calls:?}");
    assert_eq!(
        calls.keys().map(String::as_str).collect::<Vec<_>>(),
        ["io_uring_enter", "io_uring_register", "io_uring_setup"],
        "blkplane's calls outside the runtime default ({calls:?}): the profile must allow \
         exactly these (packaging/seccomp-profile.py)"
    );
}

#[test]
fn without_io_uring_the_disk_fails_and_says_seccomp() {
    let scratch = TempDir::new("container-nouring");
    let template = default_template(scratch.path());
    let pod = Pod::run(
        "ctr-nouring",
        template,
        &generated_profile(&["--without-io-uring"]),
    );
    let (out, _, socket) = add_disk(&pod, AddVia::HostSocket);
    let said = text(&out);
    assert!(
        !out.status.success(),
        "the disk started without io_uring: {said}"
    );
    assert!(
        !socket.exists(),
        "a socket was served: {}",
        socket.display()
    );
    eprintln!("disk add without io_uring: {said}");
    // The line that reports the failed io_uring set-up, not any other (the log also says that
    // the spawner installed its own seccomp filter).
    assert!(
        said.lines().any(|l| {
            let l = l.to_lowercase();
            l.contains("io_uring") && l.contains("seccomp")
        }),
        "no line of the failure says that io_uring was refused by seccomp, so an operator cannot \
         tell that the profile is the cause: {said}"
    );
    let (code, _) = pod.stop();
    assert_eq!(
        code,
        0,
        "blkplaned's exit status on SIGTERM\n{}",
        pod.logs()
    );
}

#[test]
fn kube_play_runs_the_rendered_pod() {
    let scratch = TempDir::new("container-kube");
    let template = default_template(scratch.path());
    let pod = Pod::play("kube", template, &shipped_profile());
    // podman ran the init container: the directories it chowns are the pod user's.
    let init = container(pod.template.get("spec"), "initContainers", "chown-dirs");
    let command = strs(init.field("command"));
    let uid = pod
        .template
        .get("spec")
        .get("securityContext")
        .get("runAsUser")
        .u64() as u32;
    for dir in &command[2..] {
        let md = std::fs::metadata(pod.node.host(dir)).unwrap();
        assert_eq!(std::os::unix::fs::MetadataExt::uid(&md), uid, "{dir}");
    }
    serve_and_repair(&pod, AddVia::Exec);
}
