//! `blkplaned --metrics-listen` against the real binaries: Prometheus text that a strict
//! parser accepts (HELP and TYPE for every family, histograms cumulative and ending with
//! `le="+Inf"` equal to `_count`), the series of two disks served by real frontends and the
//! operations a libblkio VMM did on one of them, `/healthz`, `/readyz` (also while the disks
//! of the state are still starting), 404 and 405, bounded requests, a port in use; and
//! `blkplanectl health` against a running and a stopped blkplaned.

use blkplane_tests::daemon::{base_args, KillFrontends};
use blkplane_tests::TempDir;
use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use blkplane_daemon::pb::control_client::ControlClient;
use blkplane_daemon::pb::{AddDiskRequest, DiskSettings};
use tonic::transport::{Channel, Endpoint};

/// Bound of every wait.
const TIMEOUT: Duration = Duration::from_secs(20);
const MIB: u64 = 1 << 20;

/// blkplaned, killed on drop; its stderr goes to a file.
struct Daemon {
    child: Child,
    log: PathBuf,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Daemon {
    /// Starts blkplaned on `dir` with `frontend` and `extra` arguments, logging at info level.
    fn start(dir: &Path, frontend: &Path, extra: &[&str]) -> Daemon {
        let log = dir.join(format!(
            "blkplaned-{}.log",
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos()
        ));
        let child = Command::new(env!("CARGO_BIN_EXE_blkplaned"))
            .args(base_args(&dir.join("state"), &dir.join("run")))
            .arg("--frontend-binary")
            .arg(frontend)
            .args(extra)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("spawning blkplaned");
        Daemon { child, log }
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The metrics address from the start-up line "metrics on http://ADDR ...".
    fn metrics_addr(&mut self) -> SocketAddr {
        let deadline = Instant::now() + TIMEOUT;
        loop {
            let text = self.log_text();
            if let Some(rest) = text.split("metrics on http://").nth(1) {
                let addr = rest.split_whitespace().next().unwrap();
                return addr.parse().expect("a socket address");
            }
            if let Some(status) = self.child.try_wait().unwrap() {
                panic!("blkplaned exited: {status}\n{text}");
            }
            assert!(Instant::now() < deadline, "no metrics line:\n{text}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGTERM, then waits for the exit.
    fn terminate(&mut self) {
        // SAFETY: plain syscall on our own child.
        unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
        let deadline = Instant::now() + TIMEOUT;
        while self.child.try_wait().unwrap().is_none() {
            assert!(Instant::now() < deadline, "blkplaned ignored SIGTERM");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

async fn client(socket: &Path) -> ControlClient<Channel> {
    let uri = format!("unix:{}", socket.display());
    let deadline = Instant::now() + TIMEOUT;
    loop {
        match Endpoint::from_shared(uri.clone()).unwrap().connect().await {
            Ok(c) => return ControlClient::new(c),
            Err(e) if Instant::now() >= deadline => panic!("blkplaned did not answer: {e}"),
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// HTTP, by hand: what goes over the wire is what is checked.

/// An HTTP answer.
#[derive(Debug)]
struct Answer {
    status: u16,
    headers: BTreeMap<String, String>,
    body: String,
}

/// Sends `request` (raw bytes) and reads the answer until the server closes.
fn http_raw(addr: SocketAddr, request: &[u8]) -> Answer {
    let mut s = TcpStream::connect_timeout(&addr, TIMEOUT).expect("connect");
    s.set_read_timeout(Some(TIMEOUT)).unwrap();
    // The server may answer (and close) before an oversized request is all written.
    let _ = s.write_all(request);
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    let text = String::from_utf8(raw).expect("UTF-8 answer");
    let (head, body) = text.split_once("\r\n\r\n").expect("a complete head");
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap();
    let status = status_line
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("status line {status_line:?}"));
    let headers = lines
        .filter_map(|l| l.split_once(": "))
        .map(|(k, v)| (k.to_ascii_lowercase(), v.to_string()))
        .collect();
    Answer {
        status,
        headers,
        body: body.to_string(),
    }
}

fn get(addr: SocketAddr, path: &str) -> Answer {
    http_raw(
        addr,
        format!("GET {path} HTTP/1.1\r\nHost: test\r\n\r\n").as_bytes(),
    )
}

// ---------------------------------------------------------------------------------------------
// A strict parser of the text exposition format 0.0.4.

#[derive(Debug, Clone, PartialEq)]
struct Sample {
    name: String,
    labels: BTreeMap<String, String>,
    value: f64,
}

#[derive(Debug, Default)]
struct Exposition {
    /// Family name → type.
    types: BTreeMap<String, String>,
    samples: Vec<Sample>,
}

impl Exposition {
    /// The value of the one sample `name{labels}` (labels given all, in any order).
    fn value(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        let want: BTreeMap<String, String> = labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        self.samples
            .iter()
            .find(|s| s.name == name && s.labels == want)
            .map(|s| s.value)
    }

    fn get(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.value(name, labels)
            .unwrap_or_else(|| panic!("no sample {name}{labels:?}"))
    }

    /// The samples of `name` whose labels include `having`.
    fn having(&self, name: &str, having: &[(&str, &str)]) -> Vec<&Sample> {
        self.samples
            .iter()
            .filter(|s| {
                s.name == name
                    && having
                        .iter()
                        .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
            })
            .collect()
    }
}

fn is_name(s: &str, colon: bool) -> bool {
    let mut chars = s.chars();
    let ok_first = |c: char| c.is_ascii_alphabetic() || c == '_' || (colon && c == ':');
    chars.next().is_some_and(ok_first)
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || (colon && c == ':'))
}

/// Parses `name{a="x",b="y"} value` strictly; returns the sample.
fn parse_sample(line: &str) -> Result<Sample, String> {
    let name_end = line
        .find(['{', ' '])
        .ok_or_else(|| format!("no value: {line:?}"))?;
    let name = &line[..name_end];
    if !is_name(name, true) {
        return Err(format!("bad metric name {name:?}"));
    }
    let mut rest = &line[name_end..];
    let mut labels = BTreeMap::new();
    if let Some(r) = rest.strip_prefix('{') {
        rest = r;
        loop {
            if let Some(r) = rest.strip_prefix('}') {
                rest = r;
                break;
            }
            let eq = rest
                .find('=')
                .ok_or_else(|| format!("bad labels: {line:?}"))?;
            let label = &rest[..eq];
            if !is_name(label, false) || label.starts_with("__") {
                return Err(format!("bad label name {label:?} in {line:?}"));
            }
            rest = rest[eq + 1..]
                .strip_prefix('"')
                .ok_or_else(|| format!("unquoted label value: {line:?}"))?;
            let mut value = String::new();
            let mut chars = rest.char_indices();
            let end = loop {
                match chars.next() {
                    None => return Err(format!("unterminated label value: {line:?}")),
                    Some((i, '"')) => break i,
                    Some((_, '\\')) => match chars.next() {
                        Some((_, '\\')) => value.push('\\'),
                        Some((_, '"')) => value.push('"'),
                        Some((_, 'n')) => value.push('\n'),
                        _ => return Err(format!("bad escape: {line:?}")),
                    },
                    Some((_, c)) => value.push(c),
                }
            };
            if labels.insert(label.to_string(), value).is_some() {
                return Err(format!("label {label} twice: {line:?}"));
            }
            rest = &rest[end + 1..];
            if let Some(r) = rest.strip_prefix(',') {
                rest = r;
            } else if !rest.starts_with('}') {
                return Err(format!("bad label separator: {line:?}"));
            }
        }
    }
    let value = rest
        .strip_prefix(' ')
        .ok_or_else(|| format!("no space before the value: {line:?}"))?;
    // No timestamps: blkplaned writes none.
    let value = match value {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        "NaN" => f64::NAN,
        v => v
            .parse::<f64>()
            .map_err(|_| format!("bad value {v:?}: {line:?}"))?,
    };
    Ok(Sample {
        name: name.to_string(),
        labels,
        value,
    })
}

/// Parses an exposition strictly: only HELP, TYPE and sample lines; every family has HELP
/// then TYPE before its samples, appears once and its samples are together; sample names
/// belong to their family (`_bucket`, `_sum`, `_count` for histograms); no series twice;
/// counters are not negative; every histogram series has buckets with increasing `le`,
/// cumulative counts, a last bucket `le="+Inf"` equal to `_count`, and a `_count`.
fn parse(text: &str) -> Result<Exposition, String> {
    let mut e = Exposition::default();
    let mut current: Option<(String, String)> = None;
    let mut help_of: Option<String> = None;
    let mut series = BTreeSet::new();
    if !text.ends_with('\n') {
        return Err("the text does not end with a newline".into());
    }
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, help) = rest.split_once(' ').ok_or("HELP without text")?;
            if !is_name(name, true) || help.is_empty() {
                return Err(format!("bad HELP line {line:?}"));
            }
            if e.types.contains_key(name) || help_of.as_deref() == Some(name) {
                return Err(format!("family {name} declared twice"));
            }
            help_of = Some(name.to_string());
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').ok_or("TYPE without type")?;
            if help_of.as_deref() != Some(name) {
                return Err(format!("TYPE of {name} without its HELP just before"));
            }
            if !["counter", "gauge", "histogram", "summary", "untyped"].contains(&kind) {
                return Err(format!("bad type {kind:?}"));
            }
            e.types.insert(name.to_string(), kind.to_string());
            current = Some((name.to_string(), kind.to_string()));
            help_of = None;
            continue;
        }
        if line.starts_with('#') || line.is_empty() {
            return Err(format!("unexpected line {line:?}"));
        }
        let sample = parse_sample(line)?;
        let (family, kind) = current
            .as_ref()
            .ok_or_else(|| format!("sample before any TYPE: {line:?}"))?;
        let belongs = if kind == "histogram" {
            ["_bucket", "_sum", "_count"]
                .iter()
                .any(|s| sample.name == format!("{family}{s}"))
        } else {
            &sample.name == family
        };
        if !belongs {
            return Err(format!("{line:?} is not of family {family}"));
        }
        if kind == "counter" && (sample.value.is_nan() || sample.value < 0.0) {
            return Err(format!("negative counter: {line:?}"));
        }
        if kind == "histogram"
            && sample.name.ends_with("_bucket") != sample.labels.contains_key("le")
        {
            return Err(format!(
                "le on a non-bucket or a bucket without le: {line:?}"
            ));
        }
        if !series.insert((sample.name.clone(), sample.labels.clone())) {
            return Err(format!("series twice: {line:?}"));
        }
        e.samples.push(sample);
    }
    if let Some(name) = help_of {
        return Err(format!("HELP of {name} without TYPE"));
    }
    // Histograms.
    for (family, kind) in &e.types {
        if kind != "histogram" {
            continue;
        }
        let mut buckets: BTreeMap<BTreeMap<String, String>, Vec<(f64, f64)>> = BTreeMap::new();
        for s in &e.samples {
            if s.name == format!("{family}_bucket") {
                let mut key = s.labels.clone();
                let le = key.remove("le").unwrap_or_default();
                let le: f64 = if le == "+Inf" {
                    f64::INFINITY
                } else {
                    le.parse().map_err(|_| format!("bad le {le:?}"))?
                };
                buckets.entry(key).or_default().push((le, s.value));
            }
        }
        for (labels, b) in &buckets {
            for w in b.windows(2) {
                if w[1].0 <= w[0].0 {
                    return Err(format!("{family}{labels:?}: le not increasing: {b:?}"));
                }
                if w[1].1 < w[0].1 {
                    return Err(format!("{family}{labels:?}: buckets not cumulative: {b:?}"));
                }
            }
            let last = b.last().ok_or("no buckets")?;
            if last.0 != f64::INFINITY {
                return Err(format!("{family}{labels:?}: no +Inf bucket"));
            }
            let count = e
                .samples
                .iter()
                .find(|s| s.name == format!("{family}_count") && &s.labels == labels)
                .ok_or_else(|| format!("{family}{labels:?}: no _count"))?;
            if count.value != last.1 {
                return Err(format!(
                    "{family}{labels:?}: +Inf bucket {} != _count {}",
                    last.1, count.value
                ));
            }
        }
    }
    Ok(e)
}

#[test]
fn the_parser_is_strict() {
    let good = "# HELP x_total X.\n# TYPE x_total counter\nx_total{a=\"1\"} 3\n\
                # HELP h H.\n# TYPE h histogram\nh_bucket{le=\"1\"} 1\nh_bucket{le=\"+Inf\"} 2\n\
                h_sum 1.5\nh_count 2\n";
    let e = parse(good).unwrap();
    assert_eq!(e.get("x_total", &[("a", "1")]), 3.0);
    for bad in [
        "x 1\n",                                                            // no TYPE
        "# TYPE x gauge\nx 1\n",                                            // no HELP
        "# HELP x X.\n# TYPE x gauge\ny 1\n",                               // other family
        "# HELP x X.\n# TYPE x gauge\nx 1\nx 2\n",                          // twice
        "# HELP x X.\n# TYPE x gauge\nx{a=1} 1\n",                          // unquoted
        "# HELP x X.\n# TYPE x gauge\nx one\n",                             // not a number
        "# HELP x X.\n# TYPE x counter\nx -1\n",                            // negative counter
        "# HELP h H.\n# TYPE h histogram\nh_bucket{le=\"1\"} 2\nh_bucket{le=\"+Inf\"} 1\nh_count 1\n",
        "# HELP h H.\n# TYPE h histogram\nh_bucket{le=\"1\"} 1\nh_count 1\n", // no +Inf
        "# HELP h H.\n# TYPE h histogram\nh_bucket{le=\"+Inf\"} 2\nh_count 1\n",
        "# HELP x X.\n# TYPE x gauge\nx 1",                                 // no final newline
    ] {
        assert!(parse(bad).is_err(), "accepted: {bad:?}");
    }
}

// ---------------------------------------------------------------------------------------------

fn ctl(socket: &Path, args: &[&str]) -> (Option<i32>, String, String) {
    let out = Command::new(&blkplane_tests::binaries().blkplanectl)
        .arg("--socket")
        .arg(socket)
        .args(args)
        .output()
        .expect("running blkplanectl");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Scrapes until `pred` holds (the status poll and the counters catch up), strictly parsed
/// every time; returns the last exposition.
fn scrape_until(addr: SocketAddr, what: &str, pred: impl Fn(&Exposition) -> bool) -> Exposition {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let a = get(addr, "/metrics");
        assert_eq!(a.status, 200, "{a:?}");
        assert_eq!(
            a.headers.get("content-type").map(String::as_str),
            Some("text/plain; version=0.0.4; charset=utf-8")
        );
        let e = parse(&a.body).unwrap_or_else(|err| panic!("{err}\n{}", a.body));
        if pred(&e) {
            return e;
        }
        assert!(Instant::now() < deadline, "not {what}:\n{}", a.body);
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Two disks with real frontends, I/O by libblkio on one of them (on two queues): every series
/// of both, the operations counted per queue and kind, the latency histogram, the disk's
/// state, VMM and migration blocker; the HTTP edges; `blkplanectl health` before and after
/// blkplaned stops.
#[tokio::test]
async fn metrics_of_two_disks_and_health() {
    let t0 = Instant::now();
    let dir = TempDir::new("two");
    let _frontends = KillFrontends(dir.path().join("run/disks"));
    let frontend = &blkplane_tests::binaries().frontend;
    let mut daemon = Daemon::start(dir.path(), frontend, &["--metrics-listen", "127.0.0.1:0"]);
    let addr = daemon.metrics_addr();
    let socket = dir.path().join("run/control.sock");
    let mut api = client(&socket).await;

    // Liveness and readiness; anything else is 404 (405 for a known path with another method).
    // The metrics line is logged before the gRPC server runs: healthy a moment later.
    let deadline = Instant::now() + TIMEOUT;
    let a = loop {
        let a = get(addr, "/healthz");
        if a.status == 200 || Instant::now() >= deadline {
            break a;
        }
        assert_eq!(a.status, 503, "{a:?}");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!((a.status, a.body.as_str()), (200, "ok"), "{a:?}");
    while get(addr, "/readyz").status != 200 {
        assert!(Instant::now() < deadline, "never ready");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(get(addr, "/readyz").body, "ok");
    assert_eq!(get(addr, "/").status, 404);
    assert_eq!(get(addr, "/metrics/x").status, 404);
    let post = http_raw(
        addr,
        b"POST /metrics HTTP/1.1\r\nHost: t\r\nContent-Length: 0\r\n\r\n",
    );
    assert_eq!(post.status, 405);
    assert_eq!(
        post.headers.get("allow").map(String::as_str),
        Some("GET, HEAD")
    );
    // A request head larger than the bound is refused, not buffered.
    let mut huge = b"GET /metrics HTTP/1.1\r\nHost: t\r\nX-Big: ".to_vec();
    huge.extend(std::iter::repeat_n(b'a', 64 * 1024));
    huge.extend_from_slice(b"\r\n\r\n");
    let big = http_raw(addr, &huge);
    assert_eq!(big.status, 431, "{big:?}");
    // A client that sends nothing holds its own connection only.
    let idle = TcpStream::connect(addr).unwrap();
    let t = Instant::now();
    assert_eq!(get(addr, "/healthz").status, 200);
    assert!(t.elapsed() < Duration::from_secs(2));
    drop(idle);

    // No disk yet: the daemon-wide series only.
    let e = scrape_until(addr, "empty", |_| true);
    assert_eq!(e.get("blkplane_disks", &[]), 0.0);
    assert_eq!(
        e.having("blkplane_build_info", &[]).len(),
        1,
        "build info: {:?}",
        e.samples
    );
    assert_eq!(
        e.types.get("blkplane_build_info").map(String::as_str),
        Some("gauge")
    );

    let img_a = blkplane_tests::create_image(&dir.path().join("a.img"), 8 * MIB);
    let img_b = blkplane_tests::create_image(&dir.path().join("b.img"), 16 * MIB);
    let a = api
        .add_disk(AddDiskRequest {
            id: "a".into(),
            settings: Some(DiskSettings {
                image: img_a.to_str().unwrap().into(),
                num_queues: 2,
                iothreads: 2,
                block_size: 4096,
                ..Default::default()
            }),
            ..Default::default()
        })
        .await
        .expect("AddDisk a")
        .into_inner();
    api.add_disk(AddDiskRequest::with_image("b", img_b.to_str().unwrap()))
        .await
        .expect("AddDisk b");

    // I/O on a: 4 writes and a flush on queue 0, 3 reads on queue 1.
    let vmm_socket = PathBuf::from(a.config.unwrap().settings_or_default().vhost_socket);
    let mut vmm = blkplane_tests::Client::connect_with(
        &vmm_socket,
        &blkplane_tests::ClientOptions {
            num_queues: 2,
            ..Default::default()
        },
    )
    .expect("libblkio connect");
    for i in 0..4 {
        vmm.queue(0)
            .write_at(i * 4096, &blkplane_tests::pattern(i, 4096))
            .expect("write");
    }
    vmm.queue(0).flush().expect("flush");
    for i in 0..3 {
        vmm.queue(1).read_at(i * 4096, 4096).expect("read");
    }

    let ops = |e: &Exposition, q: &str, kind: &str| {
        e.value(
            "blkplane_queue_ops_total",
            &[("disk", "a"), ("queue", q), ("kind", kind)],
        )
    };
    let e = scrape_until(addr, "counted and connected", |e| {
        ops(e, "0", "write") == Some(4.0)
            && ops(e, "0", "flush") == Some(1.0)
            && ops(e, "1", "read") == Some(3.0)
            && e.value("blkplane_disk_vmm_connected", &[("disk", "a")]) == Some(1.0)
    });
    let t_scraped = t0.elapsed();

    // Daemon-wide.
    assert_eq!(e.get("blkplane_disks", &[]), 2.0);
    // Per disk, both disks.
    for (disk, state, connected, capacity, queues) in [
        ("a", "connected", 1.0, 8 * MIB, 2),
        ("b", "ready", 0.0, 16 * MIB, 1),
    ] {
        let d = [("disk", disk)];
        for s in [
            "starting",
            "ready",
            "connected",
            "restarting",
            "failed",
            "stopping",
            "drained",
        ] {
            let want = if s == state { 1.0 } else { 0.0 };
            assert_eq!(
                e.get("blkplane_disk_state", &[("disk", disk), ("state", s)]),
                want,
                "{disk} {s}"
            );
        }
        assert_eq!(e.get("blkplane_disk_vmm_connected", &d), connected);
        assert_eq!(e.get("blkplane_disk_capacity_bytes", &d), capacity as f64);
        assert_eq!(e.get("blkplane_disk_frontend_restarts_total", &d), 0.0);
        assert_eq!(e.get("blkplane_disk_iothread_restarts_total", &d), 0.0);
        assert_eq!(e.get("blkplane_disk_stats_available", &d), 1.0);
        assert_eq!(e.having("blkplane_disk_migration_blockers", &d).len(), 8);
        for family in [
            "blkplane_queue_in_flight",
            "blkplane_queue_errors_total",
            "blkplane_queue_throttled_seconds_total",
            "blkplane_queue_throttled_ops_total",
            "blkplane_queue_latency_seconds_count",
            "blkplane_queue_latency_seconds_sum",
        ] {
            assert_eq!(e.having(family, &d).len(), queues, "{family} of {disk}");
        }
        assert_eq!(e.having("blkplane_queue_ops_total", &d).len(), 6 * queues);
        assert_eq!(e.having("blkplane_queue_bytes_total", &d).len(), 4 * queues);
        // Rejections: every rule the frontend checks, per queue, zero (nothing was rejected).
        let rejected = e.having("blkplane_queue_rejected_total", &d);
        let reasons: BTreeSet<&str> = rejected
            .iter()
            .map(|s| s.labels["reason"].as_str())
            .collect();
        assert!(
            reasons.len() > 20 && reasons.contains("status_read_only"),
            "{reasons:?}"
        );
        assert_eq!(rejected.len(), reasons.len() * queues, "{disk}");
        assert!(rejected.iter().all(|s| s.value == 0.0), "{disk}");
    }
    // libblkio negotiates no dirty logging: a is not migratable, for that reason only.
    assert_eq!(e.get("blkplane_disk_migratable", &[("disk", "a")]), 0.0);
    let blocking: Vec<&str> = e
        .having("blkplane_disk_migration_blockers", &[("disk", "a")])
        .into_iter()
        .filter(|s| s.value == 1.0)
        .map(|s| s.labels["reason"].as_str())
        .collect();
    assert_eq!(blocking, ["unsupported_feature"]);
    assert_eq!(e.get("blkplane_disk_migratable", &[("disk", "b")]), 1.0);

    // The I/O done, by queue and kind.
    let q = |queue: &'static str| [("disk", "a"), ("queue", queue)];
    let kind =
        |queue: &'static str, kind: &'static str| [("disk", "a"), ("queue", queue), ("kind", kind)];
    assert_eq!(e.get("blkplane_queue_ops_total", &kind("0", "read")), 0.0);
    assert_eq!(e.get("blkplane_queue_ops_total", &kind("1", "write")), 0.0);
    assert_eq!(
        e.get("blkplane_queue_bytes_total", &kind("0", "write")),
        16384.0
    );
    assert_eq!(
        e.get("blkplane_queue_bytes_total", &kind("1", "read")),
        12288.0
    );
    assert_eq!(e.get("blkplane_queue_errors_total", &q("0")), 0.0);
    assert_eq!(e.get("blkplane_queue_in_flight", &q("0")), 0.0);
    assert_eq!(e.get("blkplane_queue_throttled_ops_total", &q("0")), 0.0);
    // Every write, read and flush went to an iothread: in the histograms.
    assert_eq!(e.get("blkplane_queue_latency_seconds_count", &q("0")), 5.0);
    assert_eq!(e.get("blkplane_queue_latency_seconds_count", &q("1")), 3.0);
    assert!(e.get("blkplane_queue_latency_seconds_sum", &q("0")) > 0.0);
    assert_eq!(
        e.get(
            "blkplane_queue_latency_seconds_bucket",
            &[("disk", "a"), ("queue", "0"), ("le", "+Inf")]
        ),
        5.0
    );
    assert_eq!(
        e.types
            .get("blkplane_queue_latency_seconds")
            .map(String::as_str),
        Some("histogram")
    );
    // b saw nothing.
    assert_eq!(
        e.get(
            "blkplane_queue_ops_total",
            &[("disk", "b"), ("queue", "0"), ("kind", "read")]
        ),
        0.0
    );
    drop(vmm);

    // blkplanectl health: SERVING while blkplaned runs (JSON too), 1 for an unknown service.
    let (code, out, err) = ctl(&socket, &["health"]);
    assert_eq!((code, out.as_str()), (Some(0), "SERVING\n"), "{err}");
    let (code, out, _) = ctl(
        &socket,
        &["-o", "json", "health", "--service", "blkplane.v1.Control"],
    );
    assert_eq!(code, Some(0));
    assert!(out.contains("\"status\": \"SERVING\""), "{out}");
    let (code, _, err) = ctl(&socket, &["health", "--service", "nope"]);
    assert_eq!(code, Some(1));
    assert!(err.contains("NOT_FOUND"), "{err}");
    assert_eq!(ctl(&socket, &["health", "--bogus"]).0, Some(2));

    // Stopped: the socket is gone and nothing answers. (The API channel goes first: an open
    // one would hold blkplaned for its shutdown grace.)
    drop(api);
    daemon.terminate();
    let (code, _, err) = ctl(&socket, &["health"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(TcpStream::connect(addr).is_err());
    eprintln!(
        "metrics_of_two_disks_and_health: scraped after {t_scraped:?}, done after {:?}",
        t0.elapsed()
    );
}

/// `/readyz` is 503 while the disks of the state are being started at start-up, and 200 once
/// their first start is over (here: failed); `/healthz` is 200 meanwhile. A port in use stops
/// blkplaned at start with a message naming the flag.
#[tokio::test]
async fn readiness_waits_for_startup_and_a_busy_port_is_refused() {
    let dir = TempDir::new("ready");
    let disks_dir = dir.path().join("run/disks");
    let _frontends = KillFrontends(disks_dir.clone());
    // A disk in the state, added with the real frontend; then blkplaned and it are killed.
    {
        let frontend = &blkplane_tests::binaries().frontend;
        let mut daemon = Daemon::start(dir.path(), frontend, &[]);
        let mut api = client(&dir.path().join("run/control.sock")).await;
        let img = blkplane_tests::create_image(&dir.path().join("a.img"), 8 * MIB);
        api.add_disk(AddDiskRequest::with_image("a", img.to_str().unwrap()))
            .await
            .expect("AddDisk a");
        let _ = daemon.child.kill();
        let _ = daemon.child.wait();
        drop(KillFrontends(disks_dir.clone()));
    }
    // A "frontend" that never serves: the start-up start of disk a takes --start-timeout. The
    // shell stays (no exec), so its command line names the disk and the cleanup finds it.
    let hang = dir.path().join("hang.sh");
    std::fs::write(&hang, "#!/bin/sh\nwhile :; do sleep 1; done\n").unwrap();
    std::fs::set_permissions(&hang, std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut daemon = Daemon::start(
        dir.path(),
        &hang,
        &["--metrics-listen", "127.0.0.1:0", "--start-timeout", "5"],
    );
    let addr = daemon.metrics_addr();
    let started = Instant::now();
    // Healthy (the API serves) but not ready while a is starting.
    let deadline = Instant::now() + TIMEOUT;
    while get(addr, "/healthz").status != 200 {
        assert!(Instant::now() < deadline, "never healthy");
        std::thread::sleep(Duration::from_millis(20));
    }
    let r = get(addr, "/readyz");
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "too slow to check within the start timeout"
    );
    assert_eq!(r.status, 503, "{r:?}");
    assert!(r.body.contains("adopted or started"), "{r:?}");
    let e = scrape_until(addr, "starting", |_| true);
    assert_eq!(
        e.get(
            "blkplane_disk_state",
            &[("disk", "a"), ("state", "starting")]
        ),
        1.0
    );
    assert_eq!(
        e.get("blkplane_disk_stats_available", &[("disk", "a")]),
        0.0
    );
    assert!(e.having("blkplane_queue_ops_total", &[]).is_empty());
    // The start times out: start-up is over, ready (the disk restarts, as the API shows).
    let deadline = Instant::now() + TIMEOUT;
    while get(addr, "/readyz").status != 200 {
        assert!(
            Instant::now() < deadline,
            "never ready:\n{}",
            daemon.log_text()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(started.elapsed() >= Duration::from_secs(4));

    // The same port again: refused at start, naming the flag.
    let port = addr.to_string();
    let out = Command::new(env!("CARGO_BIN_EXE_blkplaned"))
        .arg("--state-dir")
        .arg(dir.path().join("state2"))
        .arg("--runtime-dir")
        .arg(dir.path().join("run2"))
        .arg("--frontend-binary")
        .arg("/bin/true")
        .args(["--metrics-listen", &port])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains(&format!("--metrics-listen {port}: cannot listen")),
        "{err}"
    );
    // Not an address at all: a usage error.
    let out = Command::new(env!("CARGO_BIN_EXE_blkplaned"))
        .args(["--metrics-listen", "localhost"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--metrics-listen"));
    drop(daemon);
}

/// Requests a hostile driver puts on the ring are counted by the rule they break, and the
/// count reaches the operator three ways: `blkplane_queue_rejected_total{reason}`, GetStats
/// (`blkplanectl stats -o json`) and `blkplanectl stats ID --rejections`.
#[tokio::test]
async fn rejected_requests_are_counted_by_reason() {
    use blkplane_tests::raw::{BlkRequest, Buf, RawDevice, Status};
    use virtio_bindings::virtio_blk::{VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT};

    let dir = TempDir::new("rejections");
    let _frontends = KillFrontends(dir.path().join("run/disks"));
    let frontend = &blkplane_tests::binaries().frontend;
    let mut daemon = Daemon::start(dir.path(), frontend, &["--metrics-listen", "127.0.0.1:0"]);
    let addr = daemon.metrics_addr();
    let socket = dir.path().join("run/control.sock");
    let mut api = client(&socket).await;
    let img = blkplane_tests::create_image(&dir.path().join("r.img"), 8 * MIB);
    let disk = api
        .add_disk(AddDiskRequest::with_image("r", img.to_str().unwrap()))
        .await
        .expect("AddDisk r")
        .into_inner();
    let vhost = PathBuf::from(disk.config.unwrap().settings_or_default().vhost_socket);
    let mut dev = RawDevice::connect(&vhost, 1, 64).expect("raw vhost-user connection");
    let read = || BlkRequest::new(VIRTIO_BLK_T_IN, 0).data(Buf::In(512));
    // Twice a status byte the device cannot write, once a read past the end, once a write
    // whose data the device would have to write into.
    for _ in 0..2 {
        assert_eq!(dev.request(0, &read().status(Status::ReadOnly)).used_len, 0);
    }
    let past_end = BlkRequest::new(VIRTIO_BLK_T_IN, 8 * MIB / 512).data(Buf::In(512));
    assert!(dev
        .request(0, &past_end)
        .status_u32()
        .is_some_and(|s| s != 0));
    let wrong_way = BlkRequest::new(VIRTIO_BLK_T_OUT, 0).data(Buf::In(512));
    assert!(dev
        .request(0, &wrong_way)
        .status_u32()
        .is_some_and(|s| s != 0));
    dev.assert_alive(0, "after the rejected requests");

    let want = [
        ("status_read_only", 2.0),
        ("beyond_capacity", 1.0),
        ("wrong_direction", 1.0),
    ];
    let labels = |reason| [("disk", "r"), ("queue", "0"), ("reason", reason)];
    let e = scrape_until(addr, "rejections by reason", |e| {
        want.iter().all(|(reason, n)| {
            e.value("blkplane_queue_rejected_total", &labels(reason)) == Some(*n)
        })
    });
    let rejected = e.having("blkplane_queue_rejected_total", &[("disk", "r")]);
    let total: f64 = rejected.iter().map(|s| s.value).sum();
    assert_eq!(total, 4.0, "only these four, each once: {rejected:?}");

    let (code, out, err) = ctl(&socket, &["stats", "r", "--rejections"]);
    assert_eq!(code, Some(0), "{err}");
    let rows: Vec<Vec<&str>> = out
        .lines()
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(
        rows,
        [
            vec!["DISK", "QUEUE", "REASON", "COUNT"],
            // In the frontend's order of its rules.
            vec!["r", "-", "status_read_only", "2"],
            vec!["r", "-", "wrong_direction", "1"],
            vec!["r", "-", "beyond_capacity", "1"],
        ],
        "{out}"
    );
    let (code, out, err) = ctl(&socket, &["-o", "json", "stats", "r"]);
    assert_eq!(code, Some(0), "{err}");
    let json: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    let by_reason = &json[0]["queues"][0]["rejections"];
    assert_eq!(by_reason["status_read_only"], 2, "{json}");
    assert_eq!(
        json[0]["total"]["rejections"]["beyond_capacity"], 1,
        "{json}"
    );
    assert_eq!(json[0]["total"]["rejected"], 4, "{json}");
    // The frontend's log names the rule too.
    let log = std::fs::read_to_string(dir.path().join("run/disks/r.log")).unwrap_or_default();
    assert!(
        log.contains("rejected request (status_read_only): status descriptor is read-only"),
        "{log}"
    );
    drop(dev);
    daemon.terminate();
}
