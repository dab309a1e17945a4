//! Running the external tools the packaging tests use (helm, kubernetes-validate, podman, python):
//! finding them on PATH, running them with a bound and their output drained, and reading what
//! they answer.

use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// The longest a helm, kubernetes-validate, podman or python run may take in [`run_tool`].
pub const TOOL_TIMEOUT: Duration = Duration::from_secs(120);

/// An executable `name` in a directory of `PATH`.
pub fn on_path(name: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|dir| dir.join(name))
        .find(|p| {
            std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

/// Whether `python` can `import yaml` (the tests read helm's YAML with it).
pub fn python_has_yaml(python: &Path) -> bool {
    Command::new(python)
        .args(["-c", "import yaml"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Runs `cmd` to completion within `timeout` and returns its output (any status).
pub fn output_within(cmd: &mut Command, timeout: Duration) -> Output {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("running {cmd:?}: {e}"));
    // Drained on threads, so that a chatty tool cannot block on a full pipe.
    let mut out = child.stdout.take().unwrap();
    let mut err = child.stderr.take().unwrap();
    let out_reader = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = out.read_to_end(&mut v);
        v
    });
    let err_reader = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = err.read_to_end(&mut v);
        v
    });
    let deadline = Instant::now() + timeout;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{cmd:?} did not finish within {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    Output {
        status,
        stdout: out_reader.join().unwrap(),
        stderr: err_reader.join().unwrap(),
    }
}

/// Runs a tool that must succeed; returns its stdout.
#[track_caller]
pub fn run_tool(cmd: &mut Command, what: &str) -> String {
    let out = output_within(cmd, TOOL_TIMEOUT);
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{}",
        out.status,
        text(&out)
    );
    String::from_utf8(out.stdout).expect("tool output is not UTF-8")
}

/// The body of an HTTP/1.1 chunked transfer encoding; None if it is malformed.
pub fn dechunk(mut rest: &str) -> Option<String> {
    let mut out = String::new();
    loop {
        let (size, tail) = rest.split_once("\r\n")?;
        let size = usize::from_str_radix(size.split(';').next()?.trim(), 16).ok()?;
        if size == 0 {
            return Some(out);
        }
        out.push_str(tail.get(..size)?);
        rest = tail.get(size + 2..)?;
    }
}

/// stdout then stderr of `out`, as text.
pub fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}
