//! The control plane: `blkplaned` and `blkplanectl`.
//!
//! Empty until the control-plane issue: today each disk's `blkplane-frontend` is started by
//! hand or by a script, and it spawns its own iothreads.
