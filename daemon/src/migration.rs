//! Migration blockers: the reasons a disk must not be live-migrated now, the analogue of
//! KubeVirt's LiveMigratable condition.
//!
//! Automatic blockers are computed from what blkplaned knows about the disk (its runtime
//! state — including whether it is the incoming destination of a migration — and the
//! frontend's last status); operator blockers are part of the disk's persisted lifecycle.
//! [`blockers`] lists both; `supervisor::DiskHandle` dates them, turns changes into events
//! and sends the list to the frontend, which refuses dirty logging while it is not empty.

use std::time::Duration;

use blkplane_proto::v1::FrontendStatus;

use crate::pb::{DiskState, MigrationBlockerReason as Reason};
use crate::runtime::Runtime;
use crate::state::OperatorReason;
use blkplane_api::names::reason_name;
use blkplane_api::time::format_time;

/// How long migration stays blocked after a frontend or an iothread was restarted: a VMM
/// reconnecting, or requests being resubmitted, should settle before a migration starts.
pub const RESTART_WINDOW: Duration = Duration::from_secs(30);

/// The first reason number that belongs to operators; lower ones are automatic.
pub const FIRST_OPERATOR_REASON: i32 = 16;

/// VHOST_USER_PROTOCOL_F_LOG_SHMFD: the dirty log in shared memory.
const PROTOCOL_F_LOG_SHMFD: u64 = 1 << 1;

/// One blocker, before the daemon dates the automatic ones.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Blocker {
    /// The reason code.
    pub reason: Reason,
    /// What it means for this disk.
    pub message: String,
    /// When an operator blocker was added; `None` for automatic ones.
    pub since_unix_ms: Option<u64>,
}

impl Blocker {
    fn automatic(reason: Reason, message: impl Into<String>) -> Blocker {
        Blocker {
            reason,
            message: message.into(),
            since_unix_ms: None,
        }
    }

    /// Whether blkplaned sets and clears it itself.
    pub fn is_automatic(&self) -> bool {
        (self.reason as i32) < FIRST_OPERATOR_REASON
    }

    /// The line the frontend is sent and logs: `reason: message`.
    pub fn line(&self) -> String {
        format!("{}: {}", reason_name(self.reason), self.message)
    }
}

/// The API reason of an operator reason.
pub fn from_operator(reason: OperatorReason) -> Reason {
    match reason {
        OperatorReason::Backup => Reason::OperatorBackup,
        OperatorReason::Maintenance => Reason::OperatorMaintenance,
        OperatorReason::Other => Reason::OperatorOther,
    }
}

/// The operator reason of an API reason; `None` for automatic ones.
pub fn to_operator(reason: Reason) -> Option<OperatorReason> {
    match reason {
        Reason::OperatorBackup => Some(OperatorReason::Backup),
        Reason::OperatorMaintenance => Some(OperatorReason::Maintenance),
        Reason::OperatorOther => Some(OperatorReason::Other),
        _ => None,
    }
}

/// Whether a frontend serves at least one running ring: its VMM started it and has not
/// stopped it (GET_VRING_BASE, RESET_DEVICE or a disconnect stop it).
pub fn serves_running_ring(status: &FrontendStatus) -> bool {
    status.queues.iter().any(|q| q.running)
}

/// Whether the VMM of an incoming disk runs the migrated VM, which is when the disk takes
/// over: connected, with at least one ring started. A destination VMM (QEMU started with
/// `-incoming`) connects early, but starts the rings only once the migration has completed
/// and the VM runs on it; the source VMM has stopped its rings by then.
pub fn destination_runs(status: &FrontendStatus) -> bool {
    status.vmm_connected && serves_running_ring(status)
}

/// Whether `since` (ms since the epoch, 0 for never) is less than [`RESTART_WINDOW`] before
/// `now`.
fn recent(since: u64, now_ms: u64) -> bool {
    since != 0 && now_ms.saturating_sub(since) < RESTART_WINDOW.as_millis() as u64
}

/// Every blocker of a disk whose runtime is `rt`, at `now_ms`: automatic ones first (in
/// reason order), then the operator's in the order they were added.
pub fn blockers(rt: &Runtime, now_ms: u64) -> Vec<Blocker> {
    let mut out = Vec::new();
    // The frontend's status is only meaningful while it runs.
    let status = rt.status.as_ref().filter(|_| rt.pid != 0);
    if rt.lifecycle.drained || status.is_some_and(|s| s.drained) {
        out.push(Blocker::automatic(
            Reason::Draining,
            "the disk is drained (Drain) until Resume",
        ));
    }
    let window = RESTART_WINDOW.as_secs();
    let frontend = match rt.state {
        DiskState::Starting => Some("blkplaned is starting the frontend".to_string()),
        DiskState::Restarting => Some(format!("the frontend is restarting: {}", rt.reason)),
        DiskState::Failed => Some(format!("the frontend failed: {}", rt.reason)),
        DiskState::Stopping => Some("the disk is being removed".to_string()),
        _ if recent(rt.restarted_unix_ms, now_ms) => Some(format!(
            "blkplaned restarted the frontend at {}; migration stays blocked for {window} s \
             after a restart",
            format_time(rt.restarted_unix_ms)
        )),
        _ => None,
    };
    if let Some(message) = frontend {
        out.push(Blocker::automatic(Reason::FrontendRestarting, message));
    }
    if let Some(s) = status {
        if recent(s.last_iothread_restart_unix_ms, now_ms) {
            out.push(Blocker::automatic(
                Reason::IothreadRestarted,
                format!(
                    "an iothread was replaced at {}; migration stays blocked for {window} s \
                     after a replacement",
                    format_time(s.last_iothread_restart_unix_ms)
                ),
            ));
        }
    }
    // Whatever the frontend says: a destination that has not taken over yet is not where the
    // VM runs, so migrating it on would start from a disk the guest has not used.
    if let Some(source) = &rt.incoming_for {
        out.push(Blocker::automatic(
            Reason::Incoming,
            format!(
                "destination of a live migration of disk {source}: it becomes migratable once \
                 its VMM has started the rings (and disk {source} is retired)"
            ),
        ));
    } else if let Some(source) = &rt.incoming_from {
        out.push(Blocker::automatic(
            Reason::Incoming,
            format!(
                "destination of a live migration of {source}: it becomes migratable once its \
                 VMM has started the rings (and the source is retired)"
            ),
        ));
    }
    if let Some(s) = status {
        if s.vmm_connected && s.acked_protocol_features & PROTOCOL_F_LOG_SHMFD == 0 {
            let message = if s.offered_protocol_features & PROTOCOL_F_LOG_SHMFD == 0 {
                // A frontend binary from before dirty logging, still running (adopted).
                "dirty logging is not supported by this disk's frontend: it is an older \
                 blkplane-frontend that offers neither VHOST_USER_PROTOCOL_F_LOG_SHMFD nor \
                 VHOST_F_LOG_ALL, so the guest pages the disk writes could not be tracked \
                 during a migration"
            } else {
                "the VMM did not negotiate dirty logging: the frontend offers \
                 VHOST_USER_PROTOCOL_F_LOG_SHMFD, but this VMM did not acknowledge it, so the \
                 guest pages the disk writes could not be tracked during a migration (a VMM \
                 that migrates, such as QEMU, negotiates it when it connects)"
            };
            out.push(Blocker::automatic(Reason::UnsupportedFeature, message));
        }
    }
    out.extend(rt.lifecycle.migration_blockers.iter().map(|b| Blocker {
        reason: from_operator(b.reason),
        message: b.message.clone(),
        since_unix_ms: Some(b.since_unix_ms),
    }));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::{DiskLifecycle, OperatorBlocker};
    use blkplane_proto::v1::QueueStatus;

    const NOW: u64 = 1_700_000_000_000;

    fn running(status: FrontendStatus) -> Runtime {
        Runtime {
            state: DiskState::Ready,
            reason: String::new(),
            pid: 42,
            restarts: 0,
            status: Some(status),
            lifecycle: DiskLifecycle::default(),
            restarted_unix_ms: 0,
            incoming_for: None,
            incoming_from: None,
        }
    }

    fn reasons(rt: &Runtime, now: u64) -> Vec<Reason> {
        blockers(rt, now).iter().map(|b| b.reason).collect()
    }

    #[test]
    fn an_idle_disk_is_migratable_and_a_connected_one_is_not() {
        let mut rt = running(FrontendStatus::default());
        assert!(blockers(&rt, NOW).is_empty());
        rt.status = Some(FrontendStatus {
            vmm_connected: true,
            acked_protocol_features: 0x1,
            ..Default::default()
        });
        let b = blockers(&rt, NOW);
        assert_eq!(b.len(), 1);
        assert_eq!(b[0].reason, Reason::UnsupportedFeature);
        // An older frontend: it offers no dirty logging, and nothing says "yet".
        assert!(b[0].message.contains("offers neither"), "{}", b[0].message);
        assert!(!b[0].message.contains("yet"), "{}", b[0].message);
        assert!(b[0].line().starts_with("unsupported_feature: "));
        // A frontend that offers dirty logging, with a VMM that did not negotiate it.
        rt.status = Some(FrontendStatus {
            vmm_connected: true,
            acked_protocol_features: 0x1,
            offered_protocol_features: PROTOCOL_F_LOG_SHMFD | 0x1,
            ..Default::default()
        });
        let b = blockers(&rt, NOW);
        assert_eq!(b.len(), 1);
        assert_eq!(b[0].reason, Reason::UnsupportedFeature);
        assert!(
            b[0].line()
                .starts_with("unsupported_feature: the VMM did not negotiate dirty logging"),
            "{}",
            b[0].line()
        );
        assert!(!b[0].message.contains("does not offer"), "{}", b[0].message);
        // No VMM connected: nothing to say about what it negotiated.
        rt.status = Some(FrontendStatus {
            offered_protocol_features: PROTOCOL_F_LOG_SHMFD,
            ..Default::default()
        });
        assert!(blockers(&rt, NOW).is_empty());
        // A frontend that offers dirty logging, with a VMM that negotiated it: fine.
        rt.status = Some(FrontendStatus {
            vmm_connected: true,
            acked_protocol_features: PROTOCOL_F_LOG_SHMFD,
            offered_protocol_features: PROTOCOL_F_LOG_SHMFD,
            ..Default::default()
        });
        assert!(blockers(&rt, NOW).is_empty());
    }

    #[test]
    fn drained_restarting_and_operator_blockers() {
        let mut rt = running(FrontendStatus::default());
        rt.lifecycle = DiskLifecycle {
            drained: true,
            migration_blockers: vec![OperatorBlocker {
                reason: OperatorReason::Backup,
                message: "nightly".into(),
                since_unix_ms: 7,
            }],
            ..Default::default()
        };
        let b = blockers(&rt, NOW);
        assert_eq!(
            b.iter().map(|b| b.reason).collect::<Vec<_>>(),
            [Reason::Draining, Reason::OperatorBackup]
        );
        assert!(b[0].is_automatic() && !b[1].is_automatic());
        assert_eq!(b[1].since_unix_ms, Some(7));
        assert_eq!(b[1].line(), "operator_backup: nightly");
        // A frontend restarted a moment ago, an iothread replaced a moment ago.
        rt.lifecycle = DiskLifecycle::default();
        rt.restarted_unix_ms = NOW - 1000;
        rt.status = Some(FrontendStatus {
            last_iothread_restart_unix_ms: NOW - 2000,
            ..Default::default()
        });
        assert_eq!(
            reasons(&rt, NOW),
            [Reason::FrontendRestarting, Reason::IothreadRestarted]
        );
        // Both expire after the window.
        let later = NOW + RESTART_WINDOW.as_millis() as u64;
        assert!(reasons(&rt, later).is_empty());
        // Not serving: blocked whatever the last status said.
        for state in [
            DiskState::Starting,
            DiskState::Restarting,
            DiskState::Failed,
            DiskState::Stopping,
        ] {
            rt.state = state;
            rt.pid = 0;
            assert_eq!(
                reasons(&rt, later),
                [Reason::FrontendRestarting],
                "{state:?}"
            );
        }
    }

    #[test]
    fn an_incoming_disk_is_blocked_until_it_took_over() {
        let mut rt = running(FrontendStatus::default());
        rt.incoming_for = Some("src".into());
        let b = blockers(&rt, NOW);
        assert_eq!(b.len(), 1);
        assert_eq!(b[0].reason, Reason::Incoming);
        assert!(b[0].is_automatic());
        assert!(
            b[0].line().starts_with(
                "incoming: destination of a live migration of disk src: it becomes \
                 migratable once its VMM has started the rings"
            ),
            "{}",
            b[0].line()
        );
        // Whatever the frontend does: even a VMM running with dirty logging does not lift
        // it, and it stays while the frontend is restarting, in reason order with the rest.
        rt.status = Some(FrontendStatus {
            vmm_connected: true,
            acked_protocol_features: PROTOCOL_F_LOG_SHMFD,
            offered_protocol_features: PROTOCOL_F_LOG_SHMFD,
            ..Default::default()
        });
        assert_eq!(reasons(&rt, NOW), [Reason::Incoming]);
        rt.status = Some(FrontendStatus {
            vmm_connected: true,
            offered_protocol_features: PROTOCOL_F_LOG_SHMFD,
            last_iothread_restart_unix_ms: NOW - 1,
            ..Default::default()
        });
        rt.lifecycle.drained = true;
        assert_eq!(
            reasons(&rt, NOW),
            [
                Reason::Draining,
                Reason::IothreadRestarted,
                Reason::Incoming,
                Reason::UnsupportedFeature
            ]
        );
        rt.lifecycle.drained = false;
        rt.state = DiskState::Restarting;
        rt.pid = 0;
        assert_eq!(
            reasons(&rt, NOW),
            [Reason::FrontendRestarting, Reason::Incoming]
        );
        // Taken over: gone.
        rt.incoming_for = None;
        assert_eq!(reasons(&rt, NOW), [Reason::FrontendRestarting]);
    }

    #[test]
    fn running_rings() {
        let queue = |index, running| QueueStatus {
            index,
            running,
            broken: false,
        };
        let mut s = FrontendStatus {
            vmm_connected: true,
            queues: vec![queue(0, false), queue(1, false)],
            ..Default::default()
        };
        // Connected, rings not started: a destination VMM waiting for the migration.
        assert!(!serves_running_ring(&s) && !destination_runs(&s));
        s.queues[1].running = true;
        assert!(serves_running_ring(&s) && destination_runs(&s));
        // A status without a VMM (stale flags cannot count as a running VM).
        s.vmm_connected = false;
        assert!(!destination_runs(&s));
    }

    #[test]
    fn reason_names() {
        for r in [
            OperatorReason::Backup,
            OperatorReason::Maintenance,
            OperatorReason::Other,
        ] {
            assert_eq!(to_operator(from_operator(r)), Some(r));
            assert!((from_operator(r) as i32) >= FIRST_OPERATOR_REASON);
        }
        assert_eq!(to_operator(Reason::Draining), None);
    }
}
