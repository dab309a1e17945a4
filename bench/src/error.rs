//! Why a benchmark run failed.

use std::io;
use std::path::PathBuf;

/// Everything that stops the benchmark. A failed measurement is never reported as a number.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// A file or process operation failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The error.
        source: io::Error,
    },
    /// libblkio refused something.
    #[error("libblkio {what}: {source} ({errno:?})")]
    Blkio {
        /// What was being done.
        what: String,
        /// libblkio's error.
        source: blkio::Error,
        /// Its errno, kept for the message.
        errno: blkio::Errno,
    },
    /// A back-end exited (or never listened) before or during a run.
    #[error("{name} did not come up or died: {reason}; its log {log}:\n{tail}")]
    Backend {
        /// The target.
        name: String,
        /// What happened.
        reason: String,
        /// Where its stderr went.
        log: PathBuf,
        /// The end of that log.
        tail: String,
    },
    /// A request completed with an error.
    #[error("{workload} on {target}: a request failed with errno {errno}")]
    Request {
        /// The workload.
        workload: String,
        /// The target.
        target: String,
        /// The negative errno libblkio returned, made positive.
        errno: i32,
    },
    /// A binary that is needed is missing.
    #[error("{0}")]
    Missing(String),
}

impl BenchError {
    /// Wraps an I/O error with what was being done.
    pub fn io(what: impl Into<String>) -> impl FnOnce(io::Error) -> BenchError {
        let what = what.into();
        move |source| BenchError::Io { what, source }
    }

    /// Wraps a libblkio error with what was being done.
    pub fn blkio(what: impl Into<String>) -> impl FnOnce(blkio::Error) -> BenchError {
        let what = what.into();
        move |source| BenchError::Blkio {
            what,
            errno: source.errno(),
            source,
        }
    }
}
