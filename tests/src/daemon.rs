//! Running `blkplaned` for a test and driving it with `blkplanectl` (its JSON output read back
//! with [`Json`]), plus what such tests look at in /proc.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

pub use crate::json::Json;
use crate::{binaries, wait_for, TempDir};

/// How long blkplaned may take to answer, or a disk to reach a state.
pub const TIMEOUT: Duration = Duration::from_secs(20);

pub use blkplane_procfs::{
    alive, find_processes_with_arg_prefix as processes_with_arg_prefix, state as proc_state,
};

/// The command line of `pid` (empty when it is gone).
pub fn cmdline(pid: u32) -> Vec<String> {
    blkplane_procfs::cmdline(pid)
        .unwrap_or_default()
        .iter()
        .map(|a| a.to_string_lossy().into_owned())
        .collect()
}

/// The `comm` (name) of `pid`, if it runs.
pub fn comm(pid: u32) -> Option<String> {
    std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .ok()
        .map(|c| c.trim_end().to_string())
}

/// Sends `signal` to `pid`.
pub fn kill(pid: u32, signal: i32) {
    // SAFETY: plain syscall; callers only name processes this test started (directly or
    // through blkplaned), checked by command line just before.
    unsafe { libc::kill(pid as libc::pid_t, signal) };
}

/// What one blkplanectl run produced.
#[derive(Debug)]
pub struct Out {
    /// The exit code (None: killed by a signal).
    pub code: Option<i32>,
    /// Standard output.
    pub stdout: String,
    /// Standard error.
    pub stderr: String,
}

/// The arguments every test's blkplaned starts with: its state and runtime directories, and
/// status polls every 100 ms so that connects, disconnects and crashes show up quickly.
pub fn base_args(state_dir: &Path, run_dir: &Path) -> Vec<String> {
    vec![
        "--state-dir".into(),
        state_dir.to_string_lossy().into_owned(),
        "--runtime-dir".into(),
        run_dir.to_string_lossy().into_owned(),
        "--poll-interval-ms".into(),
        "100".into(),
    ]
}

/// The frontends serving disks of the runtime directory whose `disks/` is `disks_dir` (found
/// by their admin socket; not their iothread spawners, forks that share their command line),
/// alive ones only.
pub fn frontends_of(disks_dir: &Path) -> Vec<u32> {
    processes_with_arg_prefix(&format!("--admin-socket={}/", disks_dir.display()))
        .into_iter()
        .filter(|&pid| alive(pid))
        .filter(|&pid| comm(pid).as_deref() != Some(crate::frontend::SPAWNER_COMM))
        .collect()
}

/// Kills, on drop, every frontend serving disks of one runtime directory (`disks/`): they
/// outlive blkplaned by design. For tests that run blkplaned themselves; declare it after the
/// directory and before the daemon, so that it runs after the daemon is gone and before the
/// directory is.
pub struct KillFrontends(pub PathBuf);

impl KillFrontends {
    /// The frontends it will kill.
    pub fn pids(&self) -> Vec<u32> {
        frontends_of(&self.0)
    }
}

impl Drop for KillFrontends {
    fn drop(&mut self) {
        for pid in self.pids() {
            kill(pid, libc::SIGKILL);
        }
    }
}

/// A `blkplaned` on a private state and runtime directory, killed (with every frontend it
/// started) on drop. Its log is printed when the test fails.
pub struct Daemon {
    /// Behind a lock so that a test holding the daemon shared (two nodes' sides) can still
    /// kill and restart it.
    child: std::sync::Mutex<Option<Child>>,
    /// `--state-dir`.
    pub state_dir: PathBuf,
    run_dir: PathBuf,
    log: PathBuf,
    /// The command line blkplaned is (re)started with.
    pub args: Vec<String>,
    /// The blkplanectl options that reach it (`--socket RUNTIME_DIR/control.sock` unless
    /// [`Daemon::start_reached_by`] said otherwise).
    pub reach: Vec<String>,
    /// The network namespace blkplaned (and blkplanectl for it) runs in; `None`: this one.
    netns: Option<String>,
    // Last: the directory goes after everything in it was stopped.
    _dir: TempDir,
}

impl Daemon {
    /// Starts blkplaned with private state and runtime directories (named after `tag`),
    /// fast status polls and `extra` arguments, and waits until its API answers.
    pub fn start(tag: &str, extra: &[&str]) -> Daemon {
        Self::start_reached_by(tag, extra, None)
    }

    /// [`Daemon::start`] for a blkplaned that blkplanectl reaches with the options `reach`
    /// (e.g. `--endpoint tcp:…` and the TLS files, for one started with `--listen tcp:…`);
    /// `None`: its control socket.
    pub fn start_reached_by(tag: &str, extra: &[&str], reach: Option<&[&str]>) -> Daemon {
        Self::start_in(tag, extra, reach, None)
    }

    /// [`Daemon::start_reached_by`] in network namespace `netns` (`None`: this one); its
    /// blkplanectl runs there too.
    pub fn start_in(
        tag: &str,
        extra: &[&str],
        reach: Option<&[&str]>,
        netns: Option<&str>,
    ) -> Daemon {
        let dir = TempDir::new(tag);
        let state_dir = dir.join("state");
        let run_dir = dir.join("run");
        let socket = run_dir.join("control.sock");
        let mut args = base_args(&state_dir, &run_dir);
        args.extend(extra.iter().map(|s| s.to_string()));
        let reach = match reach {
            Some(options) => options.iter().map(|s| s.to_string()).collect(),
            None => vec!["--socket".into(), socket.to_str().unwrap().into()],
        };
        let d = Daemon {
            child: std::sync::Mutex::new(None),
            log: dir.join("blkplaned.log"),
            state_dir,
            run_dir,
            args,
            reach,
            netns: netns.map(str::to_string),
            _dir: dir,
        };
        d.spawn();
        d
    }

    /// Starts blkplaned (again) with the same arguments and waits until its API answers.
    pub fn spawn(&self) {
        let mut child = self.child();
        assert!(child.is_none(), "blkplaned is already running");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap();
        let mut cmd = self.command(&binaries().blkplaned);
        cmd.args(&self.args)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log);
        if std::env::var_os("RUST_LOG").is_none() {
            cmd.env("RUST_LOG", "info");
        }
        let running = child.insert(cmd.spawn().expect("spawning blkplaned"));
        let deadline = Instant::now() + TIMEOUT;
        loop {
            if let Some(status) = running.try_wait().unwrap() {
                panic!("blkplaned exited at start: {status}\n{}", self.log_text());
            }
            if self.ctl(&["disk", "list"]).code == Some(0) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "blkplaned did not answer within {TIMEOUT:?}\n{}",
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// blkplaned's pid.
    pub fn pid(&self) -> u32 {
        self.child()
            .as_ref()
            .expect("blkplaned is not running")
            .id()
    }

    fn child(&self) -> std::sync::MutexGuard<'_, Option<Child>> {
        self.child.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// SIGKILL, like a crash: nothing is cleaned up.
    pub fn kill9(&self) {
        let mut child = self.child().take().expect("blkplaned is not running");
        child.kill().unwrap();
        child.wait().unwrap();
    }

    /// SIGTERM and wait for a clean exit.
    pub fn stop(&self) {
        let mut child = self.child().take().expect("blkplaned is not running");
        kill(child.id(), libc::SIGTERM);
        let deadline = Instant::now() + TIMEOUT;
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                assert!(
                    status.success(),
                    "blkplaned exited with {status} on SIGTERM"
                );
                return;
            }
            assert!(Instant::now() < deadline, "blkplaned ignored SIGTERM");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// What blkplaned logged so far.
    pub fn log_text(&self) -> String {
        std::fs::read(&self.log)
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default()
    }

    /// RUNTIME_DIR/disks: sockets, admin sockets, pid files and frontend logs.
    pub fn disks_dir(&self) -> PathBuf {
        self.run_dir.join("disks")
    }

    /// blkplanectl with the options that reach this daemon.
    pub fn ctl_command(&self) -> Command {
        let mut cmd = self.command(&binaries().blkplanectl);
        cmd.args(&self.reach);
        cmd
    }

    /// `program`, to run in this daemon's network namespace.
    fn command(&self, program: &Path) -> Command {
        match &self.netns {
            Some(ns) => crate::netns::in_netns(ns, program),
            None => Command::new(program),
        }
    }

    /// Runs blkplanectl against this daemon.
    pub fn ctl(&self, args: &[&str]) -> Out {
        let out = self
            .ctl_command()
            .args(args)
            .stdin(Stdio::null())
            .output()
            .expect("running blkplanectl");
        Out {
            code: out.status.code(),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        }
    }

    /// Runs blkplanectl and expects success; returns stdout.
    #[track_caller]
    pub fn ctl_ok(&self, args: &[&str]) -> String {
        let out = self.ctl(args);
        assert_eq!(
            out.code,
            Some(0),
            "blkplanectl {args:?} failed: {}{}",
            out.stderr,
            out.stdout
        );
        out.stdout
    }

    /// Runs blkplanectl with `-o json` and parses the answer.
    #[track_caller]
    pub fn ctl_json(&self, args: &[&str]) -> Json {
        let mut all = vec!["-o", "json"];
        all.extend_from_slice(args);
        Json::parse(&self.ctl_ok(&all))
    }

    /// Runs blkplanectl expecting a refusal with `code` and a message naming `field`.
    #[track_caller]
    pub fn ctl_refused(&self, args: &[&str], code: &str, field: &str) -> String {
        let out = self.ctl(args);
        assert_eq!(
            out.code,
            Some(1),
            "blkplanectl {args:?} should fail with {code}; stdout: {} stderr: {}",
            out.stdout,
            out.stderr
        );
        assert!(
            out.stderr.contains(&format!("{code}: ")),
            "blkplanectl {args:?}: expected {code}, got: {}",
            out.stderr
        );
        assert!(
            out.stderr.contains(field),
            "blkplanectl {args:?}: the message does not name {field:?}: {}",
            out.stderr
        );
        out.stderr
    }

    #[track_caller]
    /// `disk show ID` as JSON.
    pub fn disk(&self, id: &str) -> Json {
        self.ctl_json(&["disk", "show", id])
    }

    /// Waits until `pred` holds for the disk's JSON; returns it.
    #[track_caller]
    pub fn wait_disk(&self, id: &str, what: &str, pred: impl Fn(&Json) -> bool) -> Json {
        let deadline = Instant::now() + TIMEOUT;
        loop {
            let d = self.disk(id);
            if pred(&d) {
                return d;
            }
            assert!(
                Instant::now() < deadline,
                "disk {id}: not {what} within {TIMEOUT:?}: {d:?}\n{}",
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Frontends serving this daemon's disks (by their admin socket's directory; not their
    /// iothread spawners, forks that share their command line).
    pub fn frontends(&self) -> Vec<u32> {
        frontends_of(&self.disks_dir())
    }

    /// The disk ids in the persisted state, read from the file itself.
    pub fn state_ids(&self) -> Vec<String> {
        let text = std::fs::read_to_string(self.state_dir.join("state.json")).unwrap_or_default();
        if text.is_empty() {
            return Vec::new();
        }
        Json::parse(&text)
            .get("disks")
            .arr()
            .iter()
            .map(|d| d.get("id").str().to_string())
            .collect()
    }

    /// The names of the files in the runtime disks directory.
    pub fn runtime_files(&self) -> Vec<String> {
        crate::file_names(&self.disks_dir())
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Some(mut child) = self.child().take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        // The disks outlive blkplaned by design: stop them here. Their iothreads die with them.
        for pid in self.frontends() {
            kill(pid, libc::SIGKILL);
        }
        if std::thread::panicking() {
            eprintln!(
                "---- blkplaned log ----\n{}\n---- end of blkplaned log ----",
                self.log_text()
            );
            if let Ok(dir) = std::fs::read_dir(self.disks_dir()) {
                for e in dir.filter_map(|e| e.ok()) {
                    let p = e.path();
                    if p.extension().is_some_and(|x| x == "log") {
                        eprintln!(
                            "---- {} ----\n{}",
                            p.display(),
                            String::from_utf8_lossy(&std::fs::read(&p).unwrap_or_default())
                        );
                    }
                }
            }
        }
    }
}

/// `blkplanectl events -o json` running in the background, collecting events.
pub struct Watcher {
    child: Child,
    /// Every event received so far.
    pub events: Arc<Mutex<Vec<Json>>>,
    reader: Option<JoinHandle<()>>,
}

impl Watcher {
    /// Starts `blkplanectl events` against `d`, collecting every event.
    pub fn start(d: &Daemon) -> Watcher {
        let mut child = d
            .ctl_command()
            .args(["-o", "json", "events"])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("running blkplanectl events");
        let stdout = child.stdout.take().unwrap();
        let events = Arc::new(Mutex::new(Vec::new()));
        let sink = Arc::clone(&events);
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                sink.lock().unwrap().push(Json::parse(&line));
            }
        });
        // The stream starts when the call is made: give it a moment to be established.
        std::thread::sleep(Duration::from_millis(300));
        Watcher {
            child,
            events,
            reader: Some(reader),
        }
    }

    /// Waits until an event of `kind` for `disk` arrived; returns it.
    #[track_caller]
    pub fn wait(&self, kind: &str, disk: &str) -> Json {
        wait_for(TIMEOUT, || {
            self.events
                .lock()
                .unwrap()
                .iter()
                .find(|e| e.get("kind").str() == kind && e.get("disk_id").str() == disk)
                .cloned()
        })
        .unwrap_or_else(|| {
            panic!(
                "no {kind} event for {disk} within {TIMEOUT:?}; got {:?}",
                self.events.lock().unwrap()
            )
        })
    }
}

impl Drop for Watcher {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
    }
}

/// The events of `kind` for `disk` the watcher has seen so far.
pub fn events_of(watcher: &Watcher, kind: &str, disk: &str) -> Vec<Json> {
    watcher
        .events
        .lock()
        .unwrap()
        .iter()
        .filter(|e| e.get("kind").str() == kind && e.get("disk_id").str() == disk)
        .cloned()
        .collect()
}

/// Adds a disk with blkplanectl and returns its JSON.
#[track_caller]
pub fn add_disk(d: &Daemon, id: &str, image: &Path, extra: &[&str]) -> Json {
    let mut args = vec!["disk", "add", id, "--image", image.to_str().unwrap()];
    args.extend_from_slice(extra);
    let mut all = vec!["-o", "json"];
    all.extend_from_slice(&args);
    Json::parse(&d.ctl_ok(&all))
}

/// A disk's vhost-user socket, from its JSON.
pub fn socket_of(disk: &Json) -> PathBuf {
    PathBuf::from(disk.get("config").get("vhost_socket").str())
}

/// Whether a disk's frontend reports a running ring, from its JSON.
pub fn any_ring_running(disk: &Json) -> bool {
    disk.get("queues")
        .arr()
        .iter()
        .any(|q| q.get("running").bool())
}

/// The reason names of a disk's migration blockers (`disk show -o json`).
pub fn blocker_reasons(disk: &Json) -> Vec<String> {
    disk.get("migration_blockers")
        .arr()
        .iter()
        .map(|b| b.get("reason").str().to_string())
        .collect()
}

/// One "node" on this machine: a blkplaned serving its API on 127.0.0.1:PORT with the test
/// certificates (`crate::tls::make_test_certs`), which blkplanectl reaches over TLS.
pub struct Node {
    /// Its blkplaned.
    pub daemon: Daemon,
    /// `127.0.0.1:PORT`, as another node names it.
    pub endpoint: String,
}

impl Node {
    /// Starts node `name` (its logs tagged `tag`) with the certificates in `certs`; `peers`
    /// gives it the files to reach another node's blkplaned.
    pub fn start(tag: &str, name: &str, certs: &Path, peers: bool) -> Node {
        let endpoint = format!("127.0.0.1:{}", crate::tls::free_port());
        let (args, reach) = crate::tls::node_options(certs, &endpoint, name, peers);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let reach: Vec<&str> = reach.iter().map(String::as_str).collect();
        Node {
            daemon: Daemon::start_reached_by(&format!("{tag}-{name}"), &args, Some(&reach)),
            endpoint,
        }
    }
}
