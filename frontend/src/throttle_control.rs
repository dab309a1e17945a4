//! blkplaned's SetThrottle, applied: the admin channel's [`SetLimits`] for a disk, which turns
//! the request into the disk's [`DiskThrottle`] and hands it to every queue worker.

use std::fs::File;

use blkplane_proto::v1;
use log::info;

use crate::admin::SetLimits;
use crate::throttle::DiskThrottle;
use crate::worker::{Command, Workers};

/// Applies blkplaned's SetThrottle to every queue worker of the disk, at once: a command
/// each, answered once the worker uses the new limits (requests already waiting included).
pub struct ThrottleControl {
    workers: Workers,
}

impl ThrottleControl {
    /// Control over the limits of `workers`.
    pub fn new(workers: Workers) -> Self {
        Self { workers }
    }
}

impl SetLimits for ThrottleControl {
    fn set_limits(
        &self,
        request: &v1::SetThrottle,
        group_file: Option<File>,
    ) -> Result<(), String> {
        let throttle =
            DiskThrottle::from_request(request, group_file).map_err(|e| e.to_string())?;
        // Posted to all first, so that every worker switches at about the same time.
        let answers: Vec<_> = self
            .workers
            .iter()
            .map(|w| {
                w.post(|reply| Command::SetThrottle {
                    throttle: throttle.clone(),
                    reply,
                })
            })
            .collect();
        for (index, answer) in answers.into_iter().enumerate() {
            answer
                .ok()
                .and_then(|a| a.recv().ok())
                .ok_or_else(|| format!("queue worker {index} is gone"))?;
        }
        match &throttle {
            None => info!("I/O limits: none"),
            Some(_) => info!(
                "I/O limits: {:?}{}",
                request.limits.unwrap_or_default(),
                if request.group_state_path.is_empty() {
                    String::new()
                } else {
                    format!(
                        " in group {} as member {}",
                        request.group_state_path, request.member_index
                    )
                }
            ),
        }
        Ok(())
    }
}
