//! The Helm chart in `helm/blkplane`, checked for real.
//!
//! - `helm lint --strict` with the default values and with `helm/blkplane/ci/custom-values.yaml`
//!   (other paths, several socket and image directories, the ServiceMonitor on, node selection,
//!   resources, OnDelete updates).
//! - `helm template` both ways, and every manifest validated against the Kubernetes API schemas
//!   of [`KUBERNETES_VERSION`] with `kubernetes-validate --strict` (unknown fields are errors).
//!   The one exception is the ServiceMonitor, a Prometheus Operator CRD the core schemas do not
//!   have: it is skipped by kind, explicitly, and checked by hand instead (it selects the
//!   metrics Service and scrapes its port).
//! - What the manifests promise: no RBAC and no token, no host namespace, no privilege and no
//!   capability for blkplaned, CHOWN alone for the init container (which never touches the
//!   image directories), every hostPath a directory mounted at its own path, the probes'
//!   command, the metrics port, and blkplaned's seccomp profile: the chart's own Localhost
//!   profile by default (helm/blkplane/seccomp/blkplane.json, which tests/tests/container.rs
//!   runs the image under), Unconfined as the fallback value, RuntimeDefault for the init
//!   container.
//! - The rendered DaemonSet's blkplaned run for real: the harness's `blkplaned` started with
//!   exactly the rendered arguments and environment, only the hostPath directories rewritten to
//!   temporary ones (made as the kubelet makes them, then handed over by running the init
//!   container's own `chown` command), as the pod's user (uid 107) when the test runs as root.
//!   Then `/healthz`, `/readyz` and `/metrics` answer (`blkplane_disks 0`: no disk is created by
//!   itself), each probe's `blkplanectl … health` exits 0, a disk added in the image and socket
//!   directories serves libblkio through a socket owned by the pod's user, and SIGTERM stops
//!   blkplaned with status 0.
//!
//! helm and kubernetes-validate are installed by `tests/setup.sh`; without them these tests fail
//! and say so. Every wait is bounded; temporary directories and processes are cleaned up.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use blkplane_tests::daemon::{alive, comm, kill, processes_with_arg_prefix};
use blkplane_tests::frontend::{children_of, SPAWNER_COMM};
use blkplane_tests::json::{to_json, Json};
use blkplane_tests::tools::{
    dechunk, on_path, output_within, python_has_yaml, run_tool, TOOL_TIMEOUT,
};
use blkplane_tests::{binaries, create_image, pattern, read_file_at, wait_for, Client, TempDir};

/// The Kubernetes version the manifests are rendered for and validated against.
const KUBERNETES_VERSION: &str = "1.30.0";
/// Release name and namespace of the rendered chart.
const RELEASE: &str = "blkplane";
const NAMESPACE: &str = "blkplane-system";
/// The longest wait for blkplaned (start, an endpoint, a disk, an exit).
const TIMEOUT: Duration = Duration::from_secs(20);
/// What to do when a tool is missing.
const INSTALL_HINT: &str = "the Helm chart checks need helm 4 and kubernetes-validate (with its \
                            PyYAML): install them with `sudo bash tests/setup.sh`";

// ---- the chart and the tools -------------------------------------------------------------

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

fn chart() -> PathBuf {
    workspace().join("helm/blkplane")
}

fn custom_values() -> PathBuf {
    chart().join("ci/custom-values.yaml")
}

/// The external tools the checks run.
struct Tools {
    helm: PathBuf,
    validate: PathBuf,
    /// A python3 that can `import yaml`, to turn helm's YAML into JSON.
    python: PathBuf,
}

fn tools() -> &'static Tools {
    static TOOLS: OnceLock<Tools> = OnceLock::new();
    TOOLS.get_or_init(|| {
        let helm = on_path("helm").unwrap_or_else(|| panic!("helm is not on PATH: {INSTALL_HINT}"));
        let validate = on_path("kubernetes-validate")
            .unwrap_or_else(|| panic!("kubernetes-validate is not on PATH: {INSTALL_HINT}"));
        // kubernetes-validate's own interpreter has PyYAML (a dependency of it): tests/setup.sh
        // links the script from its virtualenv, whose bin/ holds that python3.
        let beside = std::fs::canonicalize(&validate)
            .ok()
            .and_then(|p| p.parent().map(|d| d.join("python3")));
        let python = beside
            .into_iter()
            .chain(on_path("python3"))
            .find(|p| python_has_yaml(p))
            .unwrap_or_else(|| panic!("no python3 with PyYAML found: {INSTALL_HINT}"));
        let version = run_tool(
            Command::new(&helm).args(["version", "--short"]),
            "helm version",
        );
        eprintln!(
            "helm {} ({}), {}, {}",
            version.trim(),
            helm.display(),
            validate.display(),
            python.display()
        );
        Tools {
            helm,
            validate,
            python,
        }
    })
}

/// The `-f`/`--set` arguments for `values` (None: the defaults) and `set`.
fn values_args(values: Option<&Path>, set: &[String]) -> Vec<String> {
    let mut args = Vec::new();
    if let Some(v) = values {
        args.push("--values".to_string());
        args.push(v.to_str().unwrap().to_string());
    }
    for s in set {
        args.push("--set".to_string());
        args.push(s.clone());
    }
    args
}

/// `helm template` of the chart, parsed: one JSON value per manifest, in helm's order.
fn render(values: Option<&Path>, set: &[String], scratch: &Path) -> Vec<Json> {
    let t = tools();
    let yaml = run_tool(
        Command::new(&t.helm)
            .args(["template", RELEASE])
            .arg(chart())
            .args([
                "--namespace",
                NAMESPACE,
                "--kube-version",
                KUBERNETES_VERSION,
            ])
            .args(values_args(values, set)),
        "helm template",
    );
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
    let docs = Json::parse(&json).arr().to_vec();
    assert!(!docs.is_empty(), "helm rendered nothing:\n{yaml}");
    docs
}

// ---- reading manifests -------------------------------------------------------------------

/// A nested member, if every step exists.
fn at<'a>(v: &'a Json, path: &[&str]) -> Option<&'a Json> {
    path.iter().try_fold(v, |v, k| v.field(k))
}

/// A nested string member, or "" when absent.
fn at_str<'a>(v: &'a Json, path: &[&str]) -> &'a str {
    at(v, path).and_then(Json::as_str).unwrap_or("")
}

/// A nested boolean member (None when absent).
fn at_bool(v: &Json, path: &[&str]) -> Option<bool> {
    match at(v, path) {
        Some(Json::Bool(b)) => Some(*b),
        _ => None,
    }
}

/// The strings of a nested array member (empty when absent).
fn at_strs(v: &Json, path: &[&str]) -> Vec<String> {
    at(v, path)
        .map(|a| a.arr().iter().map(|s| s.str().to_string()).collect())
        .unwrap_or_default()
}

fn kinds(docs: &[Json]) -> Vec<String> {
    let mut k: Vec<String> = docs
        .iter()
        .map(|d| d.get("kind").str().to_string())
        .collect();
    k.sort();
    k
}

/// The one manifest of `kind`.
#[track_caller]
fn one<'a>(docs: &'a [Json], kind: &str) -> &'a Json {
    let found: Vec<&Json> = docs
        .iter()
        .filter(|d| d.get("kind").str() == kind)
        .collect();
    assert_eq!(found.len(), 1, "expected one {kind}, got {}", found.len());
    found[0]
}

#[track_caller]
fn container<'a>(list: &'a Json, name: &str) -> &'a Json {
    list.arr()
        .iter()
        .find(|c| c.get("name").str() == name)
        .unwrap_or_else(|| panic!("no container {name:?} in {list:?}"))
}

// ---- lint and schema validation ----------------------------------------------------------

#[test]
fn lint_passes_with_default_and_custom_values() {
    let t = tools();
    for values in [None, Some(custom_values())] {
        let out = run_tool(
            Command::new(&t.helm)
                .args(["lint", "--strict"])
                .arg(chart())
                .args([
                    "--namespace",
                    NAMESPACE,
                    "--kube-version",
                    KUBERNETES_VERSION,
                ])
                .args(values_args(values.as_deref(), &[])),
            "helm lint --strict",
        );
        assert!(
            out.contains("1 chart(s) linted, 0 chart(s) failed"),
            "helm lint: {out}"
        );
    }
    // The values schema refuses what would render a broken DaemonSet.
    for bad in [
        "paths.stateDir=relative/dir",
        "daemon.extraArgs[0]=--state-dir",
        "metrics.port=0",
        "metrcs.port=9000",
        "seccompProfile.type=Localhos",
        "seccompProfile.localhostProfile=/var/lib/kubelet/seccomp/blkplane.json",
        "seccompProfile.localhostProfile=../blkplane.json",
        "seccompProfile.localhostProfile=",
        // One place for the profile: not also in securityContext.
        "securityContext.seccompProfile.type=Unconfined",
    ] {
        let out = output_within(
            Command::new(&t.helm)
                .args(["template", RELEASE])
                .arg(chart())
                .args(["--set", bad]),
            TOOL_TIMEOUT,
        );
        assert!(!out.status.success(), "helm template accepted --set {bad}");
    }
}

#[test]
fn manifests_validate_against_kubernetes_schemas() {
    let dir = TempDir::new("helm-validate");
    for (name, values, set, expected) in [
        (
            "default",
            None,
            &[][..],
            vec!["DaemonSet", "ServiceAccount"],
        ),
        (
            "custom",
            Some(custom_values()),
            &[],
            vec!["DaemonSet", "Service", "ServiceAccount", "ServiceMonitor"],
        ),
        (
            "disk-users",
            None,
            &["diskUsers.enabled=true".to_string()],
            vec!["DaemonSet", "ServiceAccount"],
        ),
        (
            "unconfined",
            None,
            &["seccompProfile.type=Unconfined".to_string()],
            vec!["DaemonSet", "ServiceAccount"],
        ),
    ] {
        let scratch = dir.join(name);
        std::fs::create_dir(&scratch).unwrap();
        let docs = render(values.as_deref(), set, &scratch);
        assert_eq!(kinds(&docs), expected, "{name}: rendered kinds");
        let mut files = Vec::new();
        for (i, doc) in docs.iter().enumerate() {
            // Not in the core schemas (a CRD of the Prometheus Operator): checked below.
            if doc.get("kind").str() == "ServiceMonitor" {
                assert_eq!(doc.get("apiVersion").str(), "monitoring.coreos.com/v1");
                continue;
            }
            let mut text = String::new();
            to_json(doc, &mut text);
            let file = scratch.join(format!("{i}-{}.json", doc.get("kind").str()));
            std::fs::write(&file, text).unwrap();
            files.push(file);
        }
        let out = output_within(
            Command::new(&tools().validate)
                .args(["--strict", "--kubernetes-version", KUBERNETES_VERSION])
                .args(&files),
            TOOL_TIMEOUT,
        );
        let report = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            out.status.success(),
            "{name}: kubernetes-validate --strict -k {KUBERNETES_VERSION} failed:\n{report}"
        );
        for f in &files {
            assert!(
                report
                    .lines()
                    .any(|l| l.contains(f.to_str().unwrap()) && l.contains(" passed ")),
                "{name}: {} was not validated:\n{report}",
                f.display()
            );
        }
        assert!(
            !report.contains("WARN") && !report.contains("ERROR"),
            "{name}: {report}"
        );
        if name == "custom" {
            check_service_monitor(&docs);
        }
    }
}

/// The ServiceMonitor scrapes the metrics Service's port, in the release's namespace, and the
/// Service selects exactly the DaemonSet's pods.
fn check_service_monitor(docs: &[Json]) {
    let sm = one(docs, "ServiceMonitor");
    let svc = one(docs, "Service");
    let ds = one(docs, "DaemonSet");
    let svc_labels = svc.get("metadata").get("labels");
    let Json::Obj(wanted) = sm.get("spec").get("selector").get("matchLabels") else {
        panic!("ServiceMonitor selector is not matchLabels: {sm:?}");
    };
    for (k, v) in wanted {
        assert_eq!(svc_labels.field(k), Some(v), "Service lacks label {k}");
    }
    assert_eq!(
        at_strs(sm, &["spec", "namespaceSelector", "matchNames"]),
        [NAMESPACE]
    );
    let endpoint = &sm.get("spec").get("endpoints").arr()[0];
    assert_eq!(endpoint.get("port").str(), "metrics");
    assert_eq!(endpoint.get("path").str(), "/metrics");
    let port = &svc.get("spec").get("ports").arr()[0];
    assert_eq!(port.get("name").str(), "metrics");
    assert_eq!(port.get("targetPort").str(), "metrics");
    assert_eq!(at_str(svc, &["spec", "clusterIP"]), "None");
    assert_eq!(
        svc.get("spec").get("selector"),
        ds.get("spec").get("selector").get("matchLabels")
    );
    let c = container(
        ds.get("spec").get("template").get("spec").get("containers"),
        "blkplaned",
    );
    let cport = &c.get("ports").arr()[0];
    assert_eq!(cport.get("name").str(), "metrics");
    assert_eq!(cport.get("containerPort"), port.get("port"));
}

// ---- what the manifests grant ------------------------------------------------------------

/// What a rendering must contain, from the values it was rendered with.
struct Expect {
    state_dir: &'static str,
    runtime_dir: &'static str,
    socket_dirs: &'static [&'static str],
    image_dirs: &'static [&'static str],
    metrics_listen: &'static str,
    /// blkplaned's seccompProfile: type and localhostProfile.
    seccomp: (&'static str, Option<&'static str>),
}

const DEFAULTS: Expect = Expect {
    state_dir: "/var/lib/blkplane",
    runtime_dir: "/run/blkplane",
    socket_dirs: &["/run/blkplane-vhost"],
    image_dirs: &["/var/lib/blkplane-images"],
    metrics_listen: "0.0.0.0:9474",
    seccomp: ("Localhost", Some("profiles/blkplane.json")),
};

const CUSTOM: Expect = Expect {
    state_dir: "/srv/blkplane/state",
    runtime_dir: "/var/run/blkplane-custom",
    socket_dirs: &["/srv/vm-sockets/a", "/srv/vm-sockets/b"],
    image_dirs: &["/srv/images", "/mnt/nfs/images"],
    metrics_listen: "0.0.0.0:9480",
    seccomp: ("Localhost", Some("storage/blkplane-0.1.0.json")),
};

#[test]
fn manifests_grant_only_what_blkplaned_needs() {
    let dir = TempDir::new("helm-grants");
    for (name, values, expect) in [
        ("default", None, &DEFAULTS),
        ("custom", Some(custom_values()), &CUSTOM),
    ] {
        let scratch = dir.join(name);
        std::fs::create_dir(&scratch).unwrap();
        let docs = render(values.as_deref(), &[], &scratch);
        check_grants(name, &docs, expect);
    }
    // The custom values reach the manifests.
    let scratch = dir.join("custom-details");
    std::fs::create_dir(&scratch).unwrap();
    let docs = render(Some(&custom_values()), &[], &scratch);
    let ds = one(&docs, "DaemonSet");
    let pod = ds.get("spec").get("template").get("spec");
    let c = container(pod.get("containers"), "blkplaned");
    assert_eq!(
        at(pod, &["nodeSelector"]),
        Some(&Json::parse(r#"{"node-role.example.com/vm": "true"}"#)),
        "a null in the values drops the default node label"
    );
    assert_eq!(pod.get("tolerations").arr()[0].get("value").str(), "vms");
    assert_eq!(at_str(pod, &["priorityClassName"]), "system-node-critical");
    assert_eq!(at_str(c, &["resources", "limits", "memory"]), "8Gi");
    assert_eq!(at_str(c, &["resources", "requests", "cpu"]), "1");
    assert_eq!(
        ds.get("spec").get("updateStrategy"),
        &Json::parse(r#"{"type": "OnDelete"}"#),
        "OnDelete must not carry rollingUpdate"
    );
    let args = at_strs(c, &["args"]);
    assert!(args.ends_with(&[
        "--restart-max".to_string(),
        "10".to_string(),
        "--poll-interval-ms".to_string(),
        "250".to_string()
    ]));
    assert_eq!(
        one(&docs, "ServiceAccount")
            .get("metadata")
            .get("name")
            .str(),
        "blkplane-node"
    );
    assert_eq!(at_str(pod, &["serviceAccountName"]), "blkplane-node");

    // diskUsers: blkplaned is root with exactly the five capabilities that giving disks
    // their users takes, nothing else changes, and disks default to the pod's user.
    // From a values file (its numbers are floats to helm: a large gid must still print as an
    // integer), with a securityContext that sets a user of its own (the root settings win).
    let scratch = dir.join("disk-users");
    std::fs::create_dir(&scratch).unwrap();
    let values = scratch.join("disk-users.yaml");
    std::fs::write(
        &values,
        "diskUsers: {enabled: true}\n\
         podSecurityContext: {runAsUser: 107, runAsGroup: 107, runAsNonRoot: true, \
         supplementalGroups: [36, 1000660000]}\n\
         securityContext: {runAsNonRoot: true, runAsUser: 5, runAsGroup: 5, privileged: false, \
         allowPrivilegeEscalation: false, readOnlyRootFilesystem: true, \
         capabilities: {drop: [ALL], add: [NET_ADMIN]}}\n",
    )
    .unwrap();
    let docs = render(Some(&values), &[], &scratch);
    let ds = one(&docs, "DaemonSet");
    let pod = ds.get("spec").get("template").get("spec");
    let c = container(pod.get("containers"), "blkplaned");
    let sc = c.get("securityContext");
    assert_eq!(at(sc, &["runAsUser"]).map(Json::u64), Some(0));
    assert_eq!(at(sc, &["runAsGroup"]).map(Json::u64), Some(0));
    assert_eq!(at_bool(sc, &["runAsNonRoot"]), Some(false));
    assert_eq!(at_strs(sc, &["capabilities", "drop"]), ["ALL"]);
    assert_eq!(
        at_strs(sc, &["capabilities", "add"]),
        ["CHOWN", "DAC_OVERRIDE", "KILL", "SETGID", "SETUID"]
    );
    assert_eq!(at_bool(sc, &["privileged"]), Some(false));
    assert_eq!(at_bool(sc, &["allowPrivilegeEscalation"]), Some(false));
    assert_eq!(at_bool(sc, &["readOnlyRootFilesystem"]), Some(true));
    assert_eq!(
        at(pod, &["securityContext", "runAsUser"]).map(Json::u64),
        Some(107)
    );
    let args = at_strs(c, &["args"]);
    let disk_user: Vec<&[String]> = args.windows(2).filter(|w| w[0] == "--disk-user").collect();
    assert_eq!(disk_user.len(), 1, "{args:?}");
    assert_eq!(disk_user[0][1], "107:107:36,1000660000");
    assert_eq!(
        at(sc, &["seccompProfile"]),
        Some(&Json::parse(
            r#"{"type": "Localhost", "localhostProfile": "profiles/blkplane.json"}"#
        )),
        "diskUsers keeps the profile"
    );

    // The fallback: Unconfined, without the localhostProfile the API refuses with it (also
    // when diskUsers sets the root fields); the init container keeps RuntimeDefault.
    for (name, set) in [
        ("unconfined", vec!["seccompProfile.type=Unconfined"]),
        (
            "unconfined-disk-users",
            vec!["seccompProfile.type=Unconfined", "diskUsers.enabled=true"],
        ),
    ] {
        let scratch = dir.join(name);
        std::fs::create_dir(&scratch).unwrap();
        let set: Vec<String> = set.into_iter().map(String::from).collect();
        let docs = render(None, &set, &scratch);
        let pod = one(&docs, "DaemonSet")
            .get("spec")
            .get("template")
            .get("spec");
        let c = container(pod.get("containers"), "blkplaned");
        assert_eq!(
            at(c, &["securityContext", "seccompProfile"]),
            Some(&Json::parse(r#"{"type": "Unconfined"}"#)),
            "{name}"
        );
        let init = container(pod.get("initContainers"), "chown-dirs");
        assert_eq!(
            at_str(init, &["securityContext", "seccompProfile", "type"]),
            "RuntimeDefault"
        );
    }
}

#[track_caller]
fn check_grants(name: &str, docs: &[Json], e: &Expect) {
    for k in ["Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding"] {
        assert!(
            docs.iter().all(|d| d.get("kind").str() != k),
            "{name}: blkplaned needs no {k}"
        );
    }
    let sa = one(docs, "ServiceAccount");
    assert_eq!(at_bool(sa, &["automountServiceAccountToken"]), Some(false));
    let ds = one(docs, "DaemonSet");
    assert_eq!(at_str(ds, &["metadata", "namespace"]), NAMESPACE);
    let pod = ds.get("spec").get("template").get("spec");
    assert_eq!(
        at_str(pod, &["serviceAccountName"]),
        sa.get("metadata").get("name").str()
    );
    assert_eq!(at_bool(pod, &["automountServiceAccountToken"]), Some(false));
    for ns in ["hostNetwork", "hostPID", "hostIPC"] {
        assert_ne!(at_bool(pod, &[ns]), Some(true), "{name}: {ns}");
    }
    assert_eq!(
        at(pod, &["securityContext", "runAsUser"]).map(Json::u64),
        Some(107)
    );
    assert_eq!(
        at_bool(pod, &["securityContext", "runAsNonRoot"]),
        Some(true)
    );

    // blkplaned: no privilege, no capability, read-only root.
    let c = container(pod.get("containers"), "blkplaned");
    let sc = c.get("securityContext");
    assert_eq!(at_bool(sc, &["privileged"]), Some(false), "{name}");
    assert_eq!(at_bool(sc, &["allowPrivilegeEscalation"]), Some(false));
    assert_eq!(at_bool(sc, &["readOnlyRootFilesystem"]), Some(true));
    assert_eq!(at_strs(sc, &["capabilities", "drop"]), ["ALL"]);
    assert!(
        at(sc, &["capabilities", "add"]).is_none(),
        "{name}: added capabilities"
    );
    assert_ne!(at_bool(sc, &["runAsNonRoot"]), Some(false));
    assert!(at(sc, &["runAsUser"]).is_none());
    // The chart's own profile (RuntimeDefault forbids io_uring on current runtimes).
    let (seccomp_type, localhost_profile) = e.seccomp;
    assert_eq!(
        at_str(sc, &["seccompProfile", "type"]),
        seccomp_type,
        "{name}"
    );
    assert_eq!(
        at(sc, &["seccompProfile", "localhostProfile"]).and_then(Json::as_str),
        localhost_profile,
        "{name}"
    );
    if let Some(profile) = localhost_profile {
        // Installed on the nodes under any name; the chart ships it as seccomp/blkplane.json.
        assert!(profile.ends_with(".json"), "{name}: {profile}");
        assert!(chart().join("seccomp/blkplane.json").is_file());
    }

    // Every hostPath is a directory, mounted at its own path (paths mean the same on the node,
    // in the pod and in launcher pods).
    let volumes: BTreeMap<&str, &Json> = pod
        .get("volumes")
        .arr()
        .iter()
        .map(|v| (v.get("name").str(), v))
        .collect();
    let mut mounted = Vec::new();
    for m in c.get("volumeMounts").arr() {
        let v = volumes[m.get("name").str()];
        let host = at_str(v, &["hostPath", "path"]);
        assert_eq!(m.get("mountPath").str(), host, "{name}: mounted elsewhere");
        assert!(
            matches!(
                at_str(v, &["hostPath", "type"]),
                "Directory" | "DirectoryOrCreate"
            ),
            "{name}: {host} must be a directory (a socket file would not follow a new socket)"
        );
        assert_ne!(
            at_str(m, &["mountPropagation"]),
            "Bidirectional",
            "{name}: Bidirectional needs privilege"
        );
        mounted.push(host.to_string());
    }
    let mut want: Vec<String> = [e.state_dir, e.runtime_dir]
        .iter()
        .chain(e.socket_dirs)
        .chain(e.image_dirs)
        .map(|s| s.to_string())
        .collect();
    want.sort();
    mounted.sort();
    assert_eq!(mounted, want, "{name}: hostPath mounts");

    // The command line: blkplaned with the directories, the restrictions and the metrics.
    assert_eq!(at_strs(c, &["command"]), ["/usr/local/bin/blkplaned"]);
    let args = at_strs(c, &["args"]);
    let pairs: Vec<(String, String)> = args
        .windows(2)
        .filter(|w| w[0].starts_with("--"))
        .map(|w| (w[0].clone(), w[1].clone()))
        .collect();
    let values_of = |flag: &str| -> Vec<String> {
        pairs
            .iter()
            .filter(|(f, _)| f == flag)
            .map(|(_, v)| v.clone())
            .collect()
    };
    assert_eq!(values_of("--state-dir"), [e.state_dir]);
    assert_eq!(values_of("--runtime-dir"), [e.runtime_dir]);
    assert_eq!(values_of("--socket-dir"), e.socket_dirs);
    assert_eq!(values_of("--image-dir"), e.image_dirs);
    assert_eq!(values_of("--metrics-listen"), [e.metrics_listen]);
    let port = &c.get("ports").arr()[0];
    assert_eq!(port.get("name").str(), "metrics");
    assert_eq!(
        e.metrics_listen.rsplit(':').next().unwrap(),
        port.get("containerPort").u64().to_string()
    );

    // Probes: a gRPC health check through blkplanectl on the control socket.
    let socket = format!("{}/control.sock", e.runtime_dir);
    for probe in ["startupProbe", "livenessProbe", "readinessProbe"] {
        assert_eq!(
            at_strs(c, &[probe, "exec", "command"]),
            ["/usr/local/bin/blkplanectl", "--socket", &socket, "health"],
            "{name}: {probe}"
        );
    }

    // The init container: root with CHOWN only, on the state, runtime and socket directories
    // themselves, never an image directory.
    let init = container(pod.get("initContainers"), "chown-dirs");
    let isc = init.get("securityContext");
    assert_eq!(at_strs(isc, &["capabilities", "drop"]), ["ALL"]);
    assert_eq!(at_strs(isc, &["capabilities", "add"]), ["CHOWN"]);
    assert_eq!(
        at_str(isc, &["seccompProfile", "type"]),
        "RuntimeDefault",
        "{name}: chown needs nothing beyond the runtime's default"
    );
    assert_eq!(at_bool(isc, &["allowPrivilegeEscalation"]), Some(false));
    assert_eq!(at_bool(isc, &["privileged"]), Some(false));
    let cmd = at_strs(init, &["command"]);
    assert_eq!(cmd[..2], ["chown".to_string(), "107:107".to_string()]);
    let chowned: Vec<&str> = cmd[2..].iter().map(String::as_str).collect();
    let expected: Vec<&str> = [e.state_dir, e.runtime_dir]
        .into_iter()
        .chain(e.socket_dirs.iter().copied())
        .collect();
    assert_eq!(chowned, expected, "{name}: chowned directories");
}

// ---- running the rendered blkplaned --------------------------------------------------------

fn is_root() -> bool {
    // SAFETY: plain syscall.
    unsafe { libc::geteuid() == 0 }
}

/// A TCP port free right now on every address.
fn free_port() -> u16 {
    TcpListener::bind("0.0.0.0:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The binaries under test, hard-linked (or copied) into `dir`, which the pod's user can
/// reach whatever the permissions of the checkout are. blkplaned finds blkplane-frontend,
/// and the frontend blkplane-iothread, next to itself.
fn link_binaries(dir: &Path) -> PathBuf {
    let bins = binaries();
    std::fs::create_dir(dir).unwrap();
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    for src in [
        &bins.blkplaned,
        &bins.blkplanectl,
        &bins.frontend,
        &bins.iothread,
    ] {
        let dst = dir.join(src.file_name().unwrap());
        if std::fs::hard_link(src, &dst).is_err() {
            std::fs::copy(src, &dst).unwrap();
        }
    }
    dir.to_path_buf()
}

/// The node's hostPath directories, as mounted into the container, and where the test put
/// them instead.
struct HostDirs {
    /// (path in the manifest, temporary directory), longest path first.
    map: Vec<(String, PathBuf)>,
}

impl HostDirs {
    /// Rewrites a path (or a flag value) that is, or is inside, one of the directories.
    fn rewrite(&self, s: &str) -> String {
        for (from, to) in &self.map {
            if s == from {
                return to.to_str().unwrap().to_string();
            }
            if let Some(rest) = s.strip_prefix(from.as_str()) {
                if rest.starts_with('/') {
                    return format!("{}{rest}", to.display());
                }
            }
        }
        s.to_string()
    }

    fn get(&self, manifest_path: &str) -> &Path {
        &self
            .map
            .iter()
            .find(|(from, _)| from == manifest_path)
            .unwrap_or_else(|| panic!("{manifest_path} is not a hostPath mount"))
            .1
    }
}

/// The pod's user: (uid, gid) from its securityContext, when the test can switch to it.
type User = Option<(u32, u32)>;

/// Makes `cmd` run as `user` (root only: std drops the supplementary groups with it).
fn as_user(cmd: &mut Command, user: User) -> &mut Command {
    if let Some((uid, gid)) = user {
        cmd.uid(uid).gid(gid);
    }
    cmd
}

/// A blkplaned started from the rendered DaemonSet; on drop it is killed with every frontend
/// it started (as the container runtime does when the pod goes), and its log is printed when
/// the test failed.
struct Running {
    child: Option<Child>,
    log: PathBuf,
    disks_dir: PathBuf,
}

impl Running {
    fn log_text(&self) -> String {
        String::from_utf8_lossy(&std::fs::read(&self.log).unwrap_or_default()).into_owned()
    }

    /// The frontends (not their iothread spawners, which share their command line).
    fn frontends(&self) -> Vec<u32> {
        processes_with_arg_prefix(&format!("--admin-socket={}/", self.disks_dir.display()))
            .into_iter()
            .filter(|&pid| comm(pid).as_deref() != Some(SPAWNER_COMM))
            .collect()
    }

    /// SIGTERM; the exit status within [`TIMEOUT`].
    fn terminate(&mut self) -> ExitStatus {
        let mut child = self.child.take().expect("blkplaned is not running");
        kill(child.id(), libc::SIGTERM);
        let deadline = Instant::now() + TIMEOUT;
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                return status;
            }
            if Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "blkplaned ignored SIGTERM for {TIMEOUT:?}\n{}",
                    self.log_text()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let frontends = self.frontends();
        for &pid in &frontends {
            kill(pid, libc::SIGKILL);
        }
        // Gone before the directories are removed (their iothreads die with them).
        let _ = wait_for(Duration::from_secs(10), || {
            frontends.iter().all(|&p| !alive(p)).then_some(())
        });
        if std::thread::panicking() {
            eprintln!(
                "---- blkplaned log ----\n{}\n---- end ----",
                self.log_text()
            );
        }
    }
}

/// One HTTP/1.1 GET: (status, headers in lower case, body); None if nothing answered.
fn http_get(addr: SocketAddr, path: &str) -> Option<(u16, String, String)> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    s.set_write_timeout(Some(Duration::from_secs(10))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).ok()?;
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text.split_once("\r\n\r\n")?;
    let status = head.split_whitespace().nth(1)?.parse().ok()?;
    let head = head.to_ascii_lowercase();
    let body = if head.contains("transfer-encoding: chunked") {
        dechunk(body)?
    } else {
        body.to_string()
    };
    Some((status, head, body))
}

/// Waits until `path` answers 200; returns the answer.
#[track_caller]
fn get_ok(run: &Running, addr: SocketAddr, path: &str) -> (String, String) {
    let mut last = None;
    wait_for(TIMEOUT, || match http_get(addr, path) {
        Some((200, head, body)) => Some((head, body)),
        other => {
            last = other;
            std::thread::sleep(Duration::from_millis(50));
            None
        }
    })
    .unwrap_or_else(|| {
        panic!(
            "GET {path} on {addr}: no 200 within {TIMEOUT:?}, last answer {last:?}\n{}",
            run.log_text()
        )
    })
}

/// The samples of metric `name` in a Prometheus text exposition: (labels, value).
fn samples(text: &str, name: &str) -> Vec<(BTreeMap<String, String>, f64)> {
    let mut out = Vec::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        let (labels, value) = if let Some(inner) = rest.strip_prefix('{') {
            let Some(end) = inner.rfind('}') else {
                continue;
            };
            (parse_labels(&inner[..end]), inner[end + 1..].trim())
        } else if rest.starts_with(' ') {
            (BTreeMap::new(), rest.trim())
        } else {
            continue; // another metric whose name starts with `name`
        };
        if let Ok(v) = value.split_whitespace().next().unwrap_or("").parse() {
            out.push((labels, v));
        }
    }
    out
}

fn parse_labels(s: &str) -> BTreeMap<String, String> {
    let mut labels = BTreeMap::new();
    let mut chars = s.chars().peekable();
    loop {
        let key: String = chars.by_ref().take_while(|&c| c != '=').collect();
        if key.is_empty() {
            return labels;
        }
        if chars.next() != Some('"') {
            return labels;
        }
        let mut value = String::new();
        while let Some(c) = chars.next() {
            match c {
                '\\' => match chars.next() {
                    Some('n') => value.push('\n'),
                    Some(c) => value.push(c),
                    None => break,
                },
                '"' => break,
                c => value.push(c),
            }
        }
        labels.insert(key.trim_start_matches(',').trim().to_string(), value);
        if chars.peek() == Some(&',') {
            chars.next();
        }
    }
}

/// The value of a metric without labels.
#[track_caller]
fn gauge(text: &str, name: &str) -> f64 {
    let s = samples(text, name);
    assert_eq!(s.len(), 1, "{name}: expected one sample in:\n{text}");
    s[0].1
}

/// Renders the chart with `values`, runs its blkplaned and checks it as described in the
/// module documentation.
fn run_rendered_daemon(tag: &str, values: Option<&Path>, set: &[&str]) {
    let dir = TempDir::new(tag);
    // Reachable by the pod's user whatever this process's umask is.
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let bin = link_binaries(&dir.join("bin"));
    let scratch = dir.join("render");
    std::fs::create_dir(&scratch).unwrap();
    let node = dir.join("node");
    std::fs::create_dir(&node).unwrap();
    std::fs::set_permissions(&node, std::fs::Permissions::from_mode(0o755)).unwrap();

    // A port free now; should another process take it before blkplaned binds it, blkplaned
    // exits at once and the test tries another (at most three times).
    let mut attempts = 0;
    let (mut run, addr, docs, host, user, disk_user) = loop {
        attempts += 1;
        let port = free_port();
        let mut sets = vec![format!("metrics.port={port}")];
        sets.extend(set.iter().map(|s| s.to_string()));
        let docs = render(values, &sets, &scratch);
        let (run, host, user, disk_user) = start(&docs, &bin, &node, &dir.join("blkplaned.log"));
        match wait_metrics_address(&run) {
            Ok(addr) => {
                assert_eq!(addr.port(), port, "blkplaned listens on another port");
                break (run, addr, docs, host, user, disk_user);
            }
            Err(log) if attempts < 3 && log.contains("in use") => {
                eprintln!("port {port} was taken meanwhile; trying another");
                drop(run);
            }
            Err(log) => panic!("blkplaned did not serve its metrics:\n{log}"),
        }
    };
    let ds = one(&docs, "DaemonSet");
    let pod = ds.get("spec").get("template").get("spec");
    let c = container(pod.get("containers"), "blkplaned");
    let loopback = SocketAddr::from(([127, 0, 0, 1], addr.port()));
    match user {
        Some((uid, gid)) => eprintln!("{tag}: blkplaned runs as {uid}:{gid}, metrics on {addr}"),
        None => eprintln!("{tag}: not root, so blkplaned runs as this user; metrics on {addr}"),
    }

    // The endpoints a kubelet, Prometheus or a person would look at.
    let started = Instant::now();
    get_ok(&run, loopback, "/healthz");
    get_ok(&run, loopback, "/readyz");
    let (head, metrics) = get_ok(&run, loopback, "/metrics");
    assert!(head.contains("content-type: text/plain"), "{head}");
    assert_eq!(
        gauge(&metrics, "blkplane_disks"),
        0.0,
        "no disk may be created by itself:\n{metrics}"
    );
    eprintln!("{tag}: endpoints answered in {:.1?}", started.elapsed());

    // Every probe's command exits 0, run as the container's user.
    for probe in ["startupProbe", "livenessProbe", "readinessProbe"] {
        let command = at_strs(c, &[probe, "exec", "command"]);
        assert!(command[0].ends_with("/blkplanectl"), "{probe}: {command:?}");
        let timeout = at(c, &[probe, "timeoutSeconds"]).map_or(1, Json::u64);
        let mut cmd = Command::new(bin.join("blkplanectl"));
        cmd.args(command[1..].iter().map(|a| host.rewrite(a)));
        let out = output_within(as_user(&mut cmd, user), Duration::from_secs(timeout));
        assert!(
            out.status.success(),
            "{probe} {command:?} failed ({}): {}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "SERVING");
    }

    // A disk as an operator adds it: the image in an image directory, the socket in a socket
    // directory, blkplanectl run in the container (as its user, with its BLKPLANE_SOCKET).
    let image_dirs: Vec<String> = at_strs(c, &["args"])
        .windows(2)
        .filter(|w| w[0] == "--image-dir")
        .map(|w| w[1].clone())
        .collect();
    let socket_dirs: Vec<String> = at_strs(c, &["args"])
        .windows(2)
        .filter(|w| w[0] == "--socket-dir")
        .map(|w| w[1].clone())
        .collect();
    let image = host.get(&image_dirs[0]).join("vd0.img");
    create_image(&image, 64 << 20);
    if let Some((uid, gid)) = disk_user {
        std::os::unix::fs::chown(&image, Some(uid), Some(gid)).unwrap();
    }
    let socket = host.get(&socket_dirs[0]).join("vd0.sock");
    let mut add = Command::new(bin.join("blkplanectl"));
    for env in c.get("env").arr() {
        add.env(env.get("name").str(), host.rewrite(env.get("value").str()));
    }
    add.args(["disk", "add", "vd0", "--image"])
        .arg(&image)
        .arg("--vhost-socket")
        .arg(&socket);
    let out = output_within(as_user(&mut add, user), TIMEOUT);
    assert!(
        out.status.success(),
        "blkplanectl disk add: {}{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
        run.log_text()
    );
    let md = std::fs::symlink_metadata(&socket).unwrap();
    assert!(md.file_type().is_socket());
    if let Some((uid, gid)) = disk_user {
        // Every process of the disk runs as the pod's user.
        let frontends = run.frontends();
        assert_eq!(frontends.len(), 1, "frontends: {frontends:?}");
        // The frontend, its spawner and the spawner's iothreads.
        let spawners: Vec<u32> = children_of(frontends[0])
            .into_iter()
            .map(|(pid, _, _)| pid)
            .collect();
        assert_eq!(spawners.len(), 1, "children of frontend {}", frontends[0]);
        let iothreads = wait_for(TIMEOUT, || {
            let its: Vec<u32> = children_of(spawners[0])
                .into_iter()
                .map(|(pid, _, _)| pid)
                .collect();
            (!its.is_empty()).then_some(its)
        })
        .expect("an iothread");
        let processes = [frontends[0], spawners[0]].into_iter().chain(iothreads);
        for pid in processes {
            let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
            let ids = |field: &str| {
                status
                    .lines()
                    .find_map(|l| l.strip_prefix(field))
                    .unwrap()
                    .split_whitespace()
                    .map(|v| v.parse::<u32>().unwrap())
                    .collect::<Vec<_>>()
            };
            assert_eq!(ids("Uid:"), [uid; 4], "process {pid} of vd0");
            assert_eq!(ids("Gid:"), [gid; 4], "process {pid} of vd0");
        }
    }
    if let Some((uid, _)) = disk_user {
        // QEMU running as this user may connect: the socket is its own, writable by it.
        assert_eq!(md.uid(), uid, "the vhost-user socket's owner");
        assert_ne!(
            md.mode() & 0o200,
            0,
            "the socket is not writable by its owner"
        );
    }
    {
        let mut client = Client::connect(&socket).expect("libblkio connects to the disk");
        let data = pattern(7, 8192);
        client
            .queue(0)
            .write_at(1 << 20, &data)
            .expect("write through blkplane");
        assert_eq!(client.queue(0).read_at(1 << 20, 8192).unwrap(), data);
        client.queue(0).flush().unwrap();
        assert_eq!(read_file_at(&image, 1 << 20, 8192), data, "the image");
    }
    let (_, metrics) = get_ok(&run, loopback, "/metrics");
    assert_eq!(gauge(&metrics, "blkplane_disks"), 1.0, "{metrics}");
    let writes: f64 = samples(&metrics, "blkplane_queue_ops_total")
        .iter()
        .filter(|(l, _)| {
            l.get("disk").map(String::as_str) == Some("vd0")
                && l.get("kind").map(String::as_str) == Some("write")
        })
        .map(|(_, v)| v)
        .sum();
    assert!(writes >= 1.0, "no write counted for vd0:\n{metrics}");

    // SIGTERM: blkplaned stops cleanly (its disks stay; in the pod the runtime stops them,
    // here the guard does).
    let status = run.terminate();
    assert!(
        status.success(),
        "blkplaned exited with {status} on SIGTERM\n{}",
        run.log_text()
    );
    drop(run);
}

/// Prepares the hostPath directories of the rendered pod under `node` and starts blkplaned
/// with the rendered command line. Returns who blkplaned runs as and who its disks run as
/// (the pod's user; both None when the test is not root).
fn start(docs: &[Json], bin: &Path, node: &Path, log: &Path) -> (Running, HostDirs, User, User) {
    let ds = one(docs, "DaemonSet");
    let pod = ds.get("spec").get("template").get("spec");
    let c = container(pod.get("containers"), "blkplaned");
    let command = at_strs(c, &["command"]);
    assert_eq!(command.len(), 1, "{command:?}");
    assert!(command[0].ends_with("/blkplaned"), "{command:?}");

    // The hostPath volumes as mounted into the container, each to a directory of its own,
    // created as the kubelet creates them (root's, 0755).
    let volumes: BTreeMap<&str, &Json> = pod
        .get("volumes")
        .arr()
        .iter()
        .map(|v| (v.get("name").str(), v))
        .collect();
    let mut map = Vec::new();
    for (i, m) in c.get("volumeMounts").arr().iter().enumerate() {
        if at(volumes[m.get("name").str()], &["hostPath"]).is_none() {
            continue;
        }
        let to = node.join(format!("h{i}"));
        std::fs::create_dir_all(&to).unwrap();
        std::fs::set_permissions(&to, std::fs::Permissions::from_mode(0o755)).unwrap();
        map.push((m.get("mountPath").str().to_string(), to));
    }
    map.sort_by_key(|(from, _)| std::cmp::Reverse(from.len()));
    let host = HostDirs { map };

    // The pod's user, when the test may become it; then the init container's own command
    // hands it the directories, as in the pod. The container's own runAsUser (root, with
    // diskUsers.enabled) overrides it for blkplaned; the disks run as the pod's user then.
    let user_of = |sc: &Json| {
        let uid = at(sc, &["runAsUser"]).map(|v| v.u64() as u32)?;
        let gid = at(sc, &["runAsGroup"]).map_or(uid, |v| v.u64() as u32);
        Some((uid, gid))
    };
    let pod_user = user_of(pod.get("securityContext")).filter(|_| is_root());
    let user = user_of(c.get("securityContext"))
        .filter(|_| is_root())
        .or(pod_user);
    if user.is_some() {
        let init = container(pod.get("initContainers"), "chown-dirs");
        let cmd = at_strs(init, &["command"]);
        run_tool(
            Command::new(&cmd[0]).args(cmd[1..].iter().map(|a| host.rewrite(a))),
            "the init container's command",
        );
    }

    let args: Vec<String> = at_strs(c, &["args"])
        .iter()
        .map(|a| host.rewrite(a))
        .collect();
    let runtime = args
        .windows(2)
        .find(|w| w[0] == "--runtime-dir")
        .map(|w| PathBuf::from(&w[1]))
        .expect("--runtime-dir");
    let logf = std::fs::File::create(log).unwrap();
    let mut cmd = Command::new(bin.join("blkplaned"));
    cmd.args(&args)
        .current_dir(node)
        .stdin(Stdio::null())
        .stdout(logf.try_clone().unwrap())
        .stderr(logf);
    for env in c.get("env").arr() {
        cmd.env(env.get("name").str(), host.rewrite(env.get("value").str()));
    }
    if user.is_some_and(|(uid, _)| uid == 0) {
        // As the container runtime starts it: only the added capabilities, no_new_privs.
        let added = at(c, &["securityContext", "capabilities", "add"])
            .map(|_| at_strs(c, &["securityContext", "capabilities", "add"]))
            .unwrap_or_default();
        only_capabilities(&mut cmd, &added);
    }
    let child = as_user(&mut cmd, user).spawn().expect("spawning blkplaned");
    let run = Running {
        child: Some(child),
        log: log.to_path_buf(),
        disks_dir: runtime.join("disks"),
    };
    (run, host, user, pod_user)
}

/// The capability numbers of <linux/capability.h> the chart may add.
fn capability_number(name: &str) -> u32 {
    match name {
        "CHOWN" => 0,
        "DAC_OVERRIDE" => 1,
        "KILL" => 5,
        "SETGID" => 6,
        "SETUID" => 7,
        other => panic!("capability {other} is not one the chart may add"),
    }
}

/// Makes `cmd` (run as root) start with exactly the capabilities `names` and no_new_privs,
/// as a container runtime starts a root container with `drop: [ALL]` and `add: names`: every
/// other capability leaves the bounding set, and root's exec grants the bounding set.
fn only_capabilities(cmd: &mut Command, names: &[String]) {
    let keep: Vec<u32> = names.iter().map(|n| capability_number(n)).collect();
    // SAFETY: prctl is async-signal-safe and the closure touches only `keep`, which it owns.
    unsafe {
        cmd.pre_exec(move || {
            for cap in 0..64u32 {
                if keep.contains(&cap) {
                    continue;
                }
                if libc::prctl(libc::PR_CAPBSET_DROP, libc::c_ulong::from(cap), 0, 0, 0) < 0 {
                    let e = std::io::Error::last_os_error();
                    if e.raw_os_error() == Some(libc::EINVAL) {
                        break; // past the last capability this kernel knows
                    }
                    return Err(e);
                }
            }
            if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// Waits for blkplaned's "metrics on http://ADDR" line; Err(log) if it exited or never said.
fn wait_metrics_address(run: &Running) -> Result<SocketAddr, String> {
    let mut run_exited = false;
    let found = wait_for(TIMEOUT, || {
        let text = run.log_text();
        if let Some(addr) = text
            .lines()
            .find_map(|l| l.split("metrics on http://").nth(1))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|a| a.parse::<SocketAddr>().ok())
        {
            return Some(addr);
        }
        if !run.child.as_ref().is_some_and(|c| alive(c.id())) {
            run_exited = true;
            return Some(SocketAddr::from(([0, 0, 0, 0], 0)));
        }
        std::thread::sleep(Duration::from_millis(20));
        None
    });
    match found {
        Some(addr) if !run_exited => Ok(addr),
        _ => Err(run.log_text()),
    }
}

#[test]
fn rendered_daemon_serves_with_default_values() {
    run_rendered_daemon("helm-default", None, &[]);
}

#[test]
fn rendered_daemon_serves_with_custom_values() {
    run_rendered_daemon("helm-custom", Some(&custom_values()), &[]);
}

#[test]
fn rendered_daemon_gives_disks_their_users() {
    // blkplaned as root with the five capabilities the chart adds; the disk as the pod's
    // user, which the rendered --disk-user names (checked in run_rendered_daemon).
    run_rendered_daemon("helm-disk-users", None, &["diskUsers.enabled=true"]);
}
