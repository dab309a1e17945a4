//! A QMP client (QEMU's JSON machine protocol on a UNIX socket) for the guest tests: enough to
//! drive a live migration and read its outcome.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use crate::json::Json;

/// How long one QMP command may take to answer.
pub const REPLY_TIMEOUT: Duration = Duration::from_secs(30);

/// A QMP session in command mode.
pub struct Qmp {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
    /// Events received while waiting for replies, in order.
    pub events: Vec<Json>,
}

impl Qmp {
    /// Connects to the QMP socket at `path` (waiting up to `timeout` for QEMU to create it),
    /// reads the greeting and enters command mode.
    pub fn connect(path: &Path, timeout: Duration) -> Result<Qmp, String> {
        let deadline = Instant::now() + timeout;
        let stream = loop {
            match UnixStream::connect(path) {
                Ok(s) => break s,
                Err(e) if Instant::now() >= deadline => {
                    return Err(format!("QMP socket {}: {e}", path.display()))
                }
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        };
        let io = |e: std::io::Error| format!("QMP {}: {e}", path.display());
        stream.set_read_timeout(Some(REPLY_TIMEOUT)).map_err(io)?;
        let writer = stream.try_clone().map_err(io)?;
        let mut qmp = Qmp {
            reader: BufReader::new(stream),
            writer,
            events: Vec::new(),
        };
        let greeting = qmp.read_message()?;
        if greeting.field("QMP").is_none() {
            return Err(format!("not a QMP greeting: {greeting:?}"));
        }
        qmp.execute("qmp_capabilities", "{}")?;
        Ok(qmp)
    }

    fn read_message(&mut self) -> Result<Json, String> {
        let mut line = String::new();
        let n = self
            .reader
            .read_line(&mut line)
            .map_err(|e| format!("reading QMP: {e}"))?;
        if n == 0 {
            return Err("QMP connection closed".into());
        }
        // QEMU writes one JSON object per line; anything else fails the test in the parser.
        Ok(Json::parse(line.trim()))
    }

    /// Runs `command` with `arguments` (a JSON object's text) and returns its `return`
    /// value; a QMP error is `Err` with its class and description.
    pub fn execute(&mut self, command: &str, arguments: &str) -> Result<Json, String> {
        let msg = format!("{{\"execute\": \"{command}\", \"arguments\": {arguments}}}\r\n");
        self.writer
            .write_all(msg.as_bytes())
            .map_err(|e| format!("sending {command}: {e}"))?;
        loop {
            let reply = self.read_message()?;
            if reply.field("event").is_some() {
                self.events.push(reply);
                continue;
            }
            if let Some(value) = reply.field("return") {
                return Ok(value.clone());
            }
            if let Some(error) = reply.field("error") {
                return Err(format!("{command}: {error:?}"));
            }
            return Err(format!("{command}: unexpected reply {reply:?}"));
        }
    }

    /// The VM's run state (`running`, `inmigrate`, `postmigrate`, `paused`, ...).
    pub fn status(&mut self) -> Result<String, String> {
        let status = self.execute("query-status", "{}")?;
        status
            .field("status")
            .and_then(Json::as_str)
            .map(str::to_string)
            .ok_or_else(|| format!("query-status without a status: {status:?}"))
    }
}
