//! What `blkplanectl` prints, and how it reads sizes and I/O limits: tables for people, JSON
//! for scripts.
//!
//! JSON output is one document per answer (`disk list` an array, `disk show` an object), and
//! one document per line for streams (`events`, `stats --watch`). Field names follow the
//! .proto; enums are lower-case words (`"ready"`, `"restarted"`, `"direct"`).

use std::time::Duration;

use blkplane_proto::v1::{LatencyHistogram, QueueStats, QueueStatus, ResizeDone};
use serde_json::{json, Value};

use blkplane_api::limits::set_limits;
use blkplane_api::names::{
    format_name, kind_name, reason_name, state_name, storage_name, KIND_NAME_WIDTH,
};
use blkplane_api::pb::{
    CacheMode, Disk, DiskState, DiskStatistics, DrainDiskResponse, Event, EventKind, ImageFormat,
    MigrationBlocker, MigrationBlockerReason, MigrationCopy, MigrationCopyPhase, MigrationStatus,
    MigrationStorage,
};
use blkplane_api::time::format_time;

use crate::limits::{group_text, limits_text, throttle_json};
use crate::text::{format_bytes, render_table};

/// The canonical upper-case name of a gRPC status code, as printed in error messages.
pub fn code_name(code: tonic::Code) -> &'static str {
    use tonic::Code::*;
    match code {
        Ok => "OK",
        Cancelled => "CANCELLED",
        Unknown => "UNKNOWN",
        InvalidArgument => "INVALID_ARGUMENT",
        DeadlineExceeded => "DEADLINE_EXCEEDED",
        NotFound => "NOT_FOUND",
        AlreadyExists => "ALREADY_EXISTS",
        PermissionDenied => "PERMISSION_DENIED",
        ResourceExhausted => "RESOURCE_EXHAUSTED",
        FailedPrecondition => "FAILED_PRECONDITION",
        Aborted => "ABORTED",
        OutOfRange => "OUT_OF_RANGE",
        Unimplemented => "UNIMPLEMENTED",
        Internal => "INTERNAL",
        Unavailable => "UNAVAILABLE",
        DataLoss => "DATA_LOSS",
        Unauthenticated => "UNAUTHENTICATED",
    }
}

/// The lower-case name of a cache mode.
pub fn cache_name(cache: i32) -> &'static str {
    match CacheMode::try_from(cache) {
        Ok(CacheMode::Unspecified | CacheMode::Direct) => "direct",
        Ok(CacheMode::Writeback) => "writeback",
        Ok(CacheMode::Writethrough) => "writethrough",
        Err(_) => "unknown",
    }
}

/// The name of an image format (`probe` for a disk whose frontend probes at each start,
/// `unknown` for a number this blkplanectl does not know).
pub fn image_format_name(format: i32) -> &'static str {
    ImageFormat::try_from(format)
        .map(format_name)
        .unwrap_or("unknown")
}

fn disk_state(d: &Disk) -> &'static str {
    state_name(DiskState::try_from(d.state).unwrap_or(DiskState::Unspecified))
}

/// The name of a blocker's reason (`unknown` for a number this blkplanectl does not know).
fn blocker_reason(b: &MigrationBlocker) -> &'static str {
    MigrationBlockerReason::try_from(b.reason)
        .map(reason_name)
        .unwrap_or("unknown")
}

/// A migration blocker as JSON.
pub fn blocker_json(b: &MigrationBlocker) -> Value {
    json!({
        "reason": blocker_reason(b),
        "message": b.message,
        "automatic": b.automatic,
        "since": format_time(b.since_unix_ms),
        "since_unix_ms": b.since_unix_ms,
    })
}

/// `disk blocker list|add|remove` as JSON.
pub fn migration_json(m: &MigrationStatus) -> Value {
    json!({
        "id": m.id,
        "migratable": m.migratable,
        "blockers": m.blockers.iter().map(blocker_json).collect::<Vec<_>>(),
    })
}

/// `disk blocker list|add|remove` for people: whether the disk may migrate, and every
/// blocker with its reason.
pub fn migration_table(m: &MigrationStatus) -> String {
    let mut out = format!(
        "{}: {}\n",
        m.id,
        if m.migratable {
            "migratable"
        } else {
            "not migratable"
        }
    );
    if !m.blockers.is_empty() {
        let rows: Vec<Vec<String>> = m
            .blockers
            .iter()
            .map(|b| {
                vec![
                    blocker_reason(b).to_string(),
                    if b.automatic { "automatic" } else { "operator" }.to_string(),
                    format_time(b.since_unix_ms),
                    b.message.clone(),
                ]
            })
            .collect();
        out.push_str(&render_table(
            &["REASON", "SOURCE", "SINCE", "MESSAGE"],
            &rows,
        ));
    }
    out
}

/// A drain's answer as JSON.
pub fn drain_json(id: &str, d: &DrainDiskResponse) -> Value {
    json!({ "id": id, "drained": true, "waited_requests": d.waited_requests, "flushed": d.flushed })
}

fn yes_no(b: bool) -> &'static str {
    if b {
        "yes"
    } else {
        "no"
    }
}

fn queue_status_json(q: &QueueStatus) -> Value {
    json!({ "index": q.index, "running": q.running, "broken": q.broken })
}

/// A disk as JSON.
pub fn disk_json(d: &Disk) -> Value {
    let c = d.config.clone().unwrap_or_default();
    let s = c.settings_or_default();
    json!({
        "id": c.id,
        "state": disk_state(d),
        "state_reason": d.state_reason,
        "vmm_connected": d.vmm_connected,
        "frontend_pid": d.frontend_pid,
        "iothread_pids": d.iothread_pids,
        "restarts": d.restarts,
        "iothread_restarts": d.iothread_restarts,
        "acked_features": d.acked_features,
        "acked_protocol_features": d.acked_protocol_features,
        "capacity_bytes": d.capacity_bytes,
        "log_path": d.log_path,
        "drained": d.drained,
        "migratable": d.migratable,
        "migration_blockers": d.migration_blockers.iter().map(blocker_json).collect::<Vec<_>>(),
        "backing_chain": d.backing_chain,
        "config": {
            "image": s.image,
            "format": image_format_name(s.format),
            "read_only": s.read_only,
            "serial": s.serial,
            "num_queues": s.num_queues,
            "queue_size": s.queue_size,
            "block_size": s.block_size,
            "iothreads": s.iothreads,
            "cache": cache_name(s.cache),
            "iothread_cpus": s.iothread_cpus,
            "poll_max_us": s.poll_max_us,
            "vhost_socket": s.vhost_socket,
            "incoming_for": c.incoming_for,
            "incoming_from": c.incoming_from.as_ref().map(|f| json!({
                "endpoint": f.endpoint,
                "disk": f.disk,
                "storage": migration_storage_name(f.storage),
            })).unwrap_or(Value::Null),
            "outgoing": c.outgoing.as_ref().map(|o| json!({
                "node": o.node,
                "disk": o.disk,
                "storage": migration_storage_name(o.storage),
            })).unwrap_or(Value::Null),
            "run_as": s.run_as.as_ref().map(|r| json!({
                "uid": r.uid,
                "gid": r.gid,
                "groups": r.groups,
            })).unwrap_or(Value::Null),
        },
        "queues": d.queues.iter().map(queue_status_json).collect::<Vec<_>>(),
        "throttle": d.throttle.as_ref().map(throttle_json).unwrap_or(Value::Null),
        "migration_copy": d.migration_copy.as_ref().map(copy_json).unwrap_or(Value::Null),
    })
}

/// The name of a copy's phase (`unknown` for a number this build does not know).
fn copy_phase_name(phase: i32) -> &'static str {
    MigrationCopyPhase::try_from(phase).map_or("unknown", blkplane_api::names::copy_phase_name)
}

/// A disk's copy to another node as JSON (`disk show`, `disk migrate --watch -o json`).
pub fn copy_json(c: &MigrationCopy) -> Value {
    json!({
        "destination": c.destination,
        "phase": copy_phase_name(c.phase),
        "bytes_sent": c.bytes_sent,
        "remaining_bytes": c.remaining_bytes,
        "dirty_bytes_per_second": c.dirty_bytes_per_second,
        "bandwidth_bytes_per_second": c.bandwidth_bytes_per_second,
        "passes": c.passes,
        "throttle_write_bytes_per_second": c.throttle_write_bytes_per_second,
        "started_unix_ms": c.started_unix_ms,
        "eta_ms": c.eta_ms,
        "failure": c.failure,
        "switch_over_us": c.switch_over_us,
    })
}

/// A disk's copy to another node in one line: phase, a bar of what was sent against what is
/// left, the rates, auto-converge's limit and the estimate (`disk migrate --watch`, `disk
/// show`).
pub fn copy_line(c: &MigrationCopy) -> String {
    const BAR: u64 = 20;
    let total = c.bytes_sent.saturating_add(c.remaining_bytes).max(1);
    let filled = (c.bytes_sent.min(total) as u128 * BAR as u128 / total as u128) as usize;
    let bar = format!(
        "[{}{}]",
        "#".repeat(filled),
        ".".repeat(BAR as usize - filled)
    );
    let mut line = format!(
        "{:<9} {bar} sent {}, remaining {}, dirty {}/s, pass {}",
        copy_phase_name(c.phase),
        format_bytes(c.bytes_sent),
        format_bytes(c.remaining_bytes),
        format_bytes(c.dirty_bytes_per_second),
        c.passes
    );
    if c.bandwidth_bytes_per_second != 0 {
        line.push_str(&format!(
            ", limit {}/s",
            format_bytes(c.bandwidth_bytes_per_second)
        ));
    }
    if c.throttle_write_bytes_per_second != 0 {
        line.push_str(&format!(
            ", guest writes throttled to {}/s",
            format_bytes(c.throttle_write_bytes_per_second)
        ));
    }
    match MigrationCopyPhase::try_from(c.phase) {
        Ok(MigrationCopyPhase::Complete) => line.push_str(&format!(
            ", switch-over {:.1} ms",
            c.switch_over_us as f64 / 1000.0
        )),
        Ok(MigrationCopyPhase::Failed) => line.push_str(&format!(": {}", c.failure)),
        Ok(MigrationCopyPhase::Converged) => line.push_str(", ready for the switch-over"),
        _ if c.eta_ms != 0 => line.push_str(&format!(
            ", converges in ~{:.1} s",
            c.eta_ms as f64 / 1000.0
        )),
        _ => {}
    }
    line
}

/// The name of a MigrationStorage value (`unknown` for a number this build does not know).
fn migration_storage_name(storage: i32) -> &'static str {
    MigrationStorage::try_from(storage).map_or("unknown", storage_name)
}

/// Where an incoming disk migrates from, as `disk list` and `disk show` name it: the source's
/// id on this node, or `SRC@HOST:PORT` on another; `None` for a disk that is not incoming.
fn incoming_source(c: &blkplane_api::pb::DiskConfig) -> Option<String> {
    match &c.incoming_from {
        Some(f) => Some(format!("{}@{}", f.disk, f.endpoint)),
        None if !c.incoming_for.is_empty() => Some(c.incoming_for.clone()),
        None => None,
    }
}

fn pid_or_dash(pid: u32) -> String {
    if pid == 0 {
        "-".into()
    } else {
        pid.to_string()
    }
}

/// `disk list` as a table. The INCOMING column (the source an incoming disk migrates from)
/// is there only while some disk is incoming, so that the usual table stays narrow.
pub fn disks_table(disks: &[Disk]) -> String {
    let incoming = disks
        .iter()
        .any(|d| d.config.as_ref().and_then(incoming_source).is_some());
    let rows: Vec<Vec<String>> = disks
        .iter()
        .map(|d| {
            let c = d.config.clone().unwrap_or_default();
            let s = c.settings_or_default();
            let source = incoming_source(&c);
            let mut row = vec![
                c.id,
                disk_state(d).into(),
                if d.vmm_connected { "yes" } else { "no" }.into(),
                pid_or_dash(d.frontend_pid),
                if d.capacity_bytes == 0 {
                    "-".into()
                } else {
                    format_bytes(d.capacity_bytes)
                },
                s.num_queues.to_string(),
                d.restarts.to_string(),
                yes_no(d.migratable).into(),
            ];
            if incoming {
                row.push(source.unwrap_or_else(|| "-".into()));
            }
            row.push(s.vhost_socket);
            row
        })
        .collect();
    let mut headers = vec![
        "ID",
        "STATE",
        "VMM",
        "PID",
        "SIZE",
        "QUEUES",
        "RESTARTS",
        "MIGRATABLE",
    ];
    if incoming {
        headers.push("INCOMING");
    }
    headers.push("SOCKET");
    render_table(&headers, &rows)
}

/// `disk show` for people.
pub fn disk_detail(d: &Disk) -> String {
    let c = d.config.clone().unwrap_or_default();
    let s = c.settings_or_default();
    let mut rows: Vec<(&str, String)> = vec![("id", c.id.clone()), ("state", disk_state(d).into())];
    if !d.state_reason.is_empty() {
        rows.push(("reason", d.state_reason.clone()));
    }
    if !c.incoming_for.is_empty() {
        rows.push((
            "incoming for",
            format!(
                "{} (live-migration destination; takes over once its VMM runs the rings)",
                c.incoming_for
            ),
        ));
    }
    if let Some(f) = &c.incoming_from {
        rows.push((
            "incoming from",
            format!(
                "disk {} on {} ({} storage; live-migration destination; takes over once its \
                 VMM runs the rings and that node has retired the source)",
                f.disk,
                f.endpoint,
                migration_storage_name(f.storage)
            ),
        ));
    }
    if let Some(o) = &c.outgoing {
        rows.push((
            "migrating to",
            format!(
                "disk {} on node {} ({} storage; retired once the VM runs there)",
                o.disk,
                o.node,
                migration_storage_name(o.storage)
            ),
        ));
    }
    if let Some(copy) = &d.migration_copy {
        rows.push((
            "copy",
            format!("to {}: {}", copy.destination, copy_line(copy)),
        ));
    }
    rows.extend([
        (
            "vmm connected",
            if d.vmm_connected { "yes" } else { "no" }.into(),
        ),
        ("vhost socket", s.vhost_socket.clone()),
        ("image", s.image.clone()),
        (
            "format",
            match ImageFormat::try_from(s.format) {
                Ok(ImageFormat::Unspecified) => "probed at each start".into(),
                _ => image_format_name(s.format).into(),
            },
        ),
        (
            "backing chain",
            if d.backing_chain.is_empty() {
                "-".into()
            } else {
                d.backing_chain.join(" -> ")
            },
        ),
        (
            "capacity",
            format!(
                "{} bytes ({})",
                d.capacity_bytes,
                format_bytes(d.capacity_bytes)
            ),
        ),
        ("read-only", if s.read_only { "yes" } else { "no" }.into()),
        ("serial", s.serial.clone()),
        (
            "queues",
            format!("{} × {} descriptors", s.num_queues, s.queue_size),
        ),
        ("block size", s.block_size.to_string()),
        ("iothreads", s.iothreads.to_string()),
        ("cache", cache_name(s.cache).into()),
        (
            "iothread cpus",
            if s.iothread_cpus.is_empty() {
                "any".into()
            } else {
                s.iothread_cpus.clone()
            },
        ),
        (
            "poll max",
            match s.poll_max_us {
                None => "the frontend's default".into(),
                Some(0) => "off".into(),
                Some(us) => format!("{us} µs"),
            },
        ),
        (
            "run as",
            match &s.run_as {
                None => "blkplaned's user".into(),
                Some(r) if r.groups.is_empty() => format!("uid {} gid {}", r.uid, r.gid),
                Some(r) => format!(
                    "uid {} gid {} groups {}",
                    r.uid,
                    r.gid,
                    r.groups
                        .iter()
                        .map(u32::to_string)
                        .collect::<Vec<_>>()
                        .join(",")
                ),
            },
        ),
        ("frontend pid", pid_or_dash(d.frontend_pid)),
        (
            "iothread pids",
            d.iothread_pids
                .iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(" "),
        ),
        ("restarts", d.restarts.to_string()),
        ("iothread restarts", d.iothread_restarts.to_string()),
        ("features", format!("{:#x}", d.acked_features)),
        (
            "protocol features",
            format!("{:#x}", d.acked_protocol_features),
        ),
        ("log", d.log_path.clone()),
        ("drained", yes_no(d.drained).into()),
        ("migratable", yes_no(d.migratable).into()),
    ]);
    for b in &d.migration_blockers {
        rows.push((
            "migration blocker",
            format!("{}: {}", blocker_reason(b), b.message),
        ));
    }
    if let Some(t) = &d.throttle {
        let limits = t.limits.unwrap_or_default();
        if !set_limits(&limits).is_empty() || !t.group.is_empty() {
            rows.push(("throttle", limits_text(&limits)));
        }
        if !t.group.is_empty() {
            rows.push(("throttle group", group_text(t)));
        }
        if !t.pending.is_empty() {
            rows.push(("throttle pending", t.pending.join(" ")));
        }
    }
    let broken: Vec<String> = d
        .queues
        .iter()
        .filter(|q| q.broken)
        .map(|q| q.index.to_string())
        .collect();
    if !broken.is_empty() {
        rows.push(("broken queues", broken.join(" ")));
    }
    // The key and its colon are one column.
    let width = rows.iter().map(|(k, _)| k.len() + 1).max().unwrap_or(0);
    rows.iter()
        .map(|(k, v)| format!("{:<width$}  {v}\n", format!("{k}:")))
        .collect()
}

/// The `p`-quantile (0..1) of a histogram as its bucket's upper bound in microseconds, or
/// `None` without samples.
pub fn percentile(h: &LatencyHistogram, p: f64) -> Option<u64> {
    let total: u64 = h.counts.iter().sum();
    if total == 0 {
        return None;
    }
    let want = ((total as f64) * p).ceil().max(1.0) as u64;
    let mut seen = 0;
    for (count, bound) in h.counts.iter().zip(&h.upper_bounds_us) {
        seen += count;
        if seen >= want {
            return Some(*bound);
        }
    }
    h.upper_bounds_us.last().copied()
}

fn format_us(us: Option<u64>) -> String {
    match us {
        None => "-".into(),
        Some(u64::MAX) => "inf".into(),
        Some(us) if us >= 10_000 => format!("{}ms", us / 1000),
        Some(us) => format!("{us}us"),
    }
}

fn histogram_json(h: &Option<LatencyHistogram>) -> Value {
    match h {
        Some(h) => json!({ "upper_bounds_us": h.upper_bounds_us, "counts": h.counts }),
        None => Value::Null,
    }
}

/// One queue's (or a total's) counters as JSON.
pub fn queue_stats_json(q: &QueueStats) -> Value {
    json!({
        "index": q.index,
        "read_ops": q.read_ops,
        "read_bytes": q.read_bytes,
        "write_ops": q.write_ops,
        "write_bytes": q.write_bytes,
        "flush_ops": q.flush_ops,
        "discard_ops": q.discard_ops,
        "discard_bytes": q.discard_bytes,
        "write_zeroes_ops": q.write_zeroes_ops,
        "write_zeroes_bytes": q.write_zeroes_bytes,
        "other_ops": q.other_ops,
        "errors": q.errors,
        "rejected": q.rejected,
        "rejections": q
            .rejections
            .iter()
            .map(|r| (r.reason.clone(), Value::from(r.count)))
            .collect::<serde_json::Map<_, _>>(),
        "in_flight": q.in_flight,
        "throttled_ns": q.throttled_ns,
        "throttled_ops": q.throttled_ops,
        "latency": histogram_json(&q.latency),
    })
}

/// Statistics as JSON: an array of per-disk objects.
pub fn stats_json(disks: &[DiskStatistics]) -> Value {
    Value::Array(
        disks
            .iter()
            .map(|d| {
                json!({
                    "id": d.id,
                    "frontend_pid": d.frontend_pid,
                    "total": d.total.as_ref().map(queue_stats_json).unwrap_or(Value::Null),
                    "queues": d.queues.iter().map(queue_stats_json).collect::<Vec<_>>(),
                    "iothreads": d.iothreads.iter().map(|t| json!({
                        "index": t.index,
                        "inline_transfers": t.inline_transfers,
                        "queued_transfers": t.queued_transfers,
                    })).collect::<Vec<_>>(),
                })
            })
            .collect(),
    )
}

/// Statistics for people: one row per disk and per queue. With `prev` (the previous sample
/// and the time since), rates per second instead of totals.
pub fn stats_table(
    disks: &[DiskStatistics],
    prev: Option<(&[DiskStatistics], Duration)>,
) -> String {
    let rate = prev.is_some();
    let mut rows = Vec::new();
    for d in disks {
        let before = prev.and_then(|(p, dt)| {
            p.iter()
                .find(|o| o.id == d.id && o.frontend_pid == d.frontend_pid)
                .map(|o| (o, dt))
        });
        let mut add = |name: String, q: &QueueStats, old: Option<(&QueueStats, Duration)>| {
            let per_s = |now: u64, then: Option<u64>| -> String {
                match (old, then) {
                    (Some((_, dt)), Some(then)) if dt.as_secs_f64() > 0.0 => {
                        format!("{:.0}", now.saturating_sub(then) as f64 / dt.as_secs_f64())
                    }
                    _ if rate => "-".into(),
                    _ => now.to_string(),
                }
            };
            let bytes = |now: u64, then: Option<u64>| -> String {
                match (old, then) {
                    (Some((_, dt)), Some(then)) if dt.as_secs_f64() > 0.0 => format!(
                        "{}/s",
                        format_bytes((now.saturating_sub(then) as f64 / dt.as_secs_f64()) as u64)
                    ),
                    _ if rate => "-".into(),
                    _ => format_bytes(now),
                }
            };
            let o = old.map(|(o, _)| o);
            let h = q.latency.clone().unwrap_or_default();
            rows.push(vec![
                name,
                per_s(q.read_ops, o.map(|o| o.read_ops)),
                bytes(q.read_bytes, o.map(|o| o.read_bytes)),
                per_s(q.write_ops, o.map(|o| o.write_ops)),
                bytes(q.write_bytes, o.map(|o| o.write_bytes)),
                per_s(q.flush_ops, o.map(|o| o.flush_ops)),
                per_s(
                    q.discard_ops + q.write_zeroes_ops,
                    o.map(|o| o.discard_ops + o.write_zeroes_ops),
                ),
                q.in_flight.to_string(),
                q.errors.to_string(),
                match (old, rate) {
                    (Some((o, dt)), _) if dt.as_secs_f64() > 0.0 => format!(
                        "{}/s",
                        format_ns(
                            (q.throttled_ns.saturating_sub(o.throttled_ns) as f64
                                / dt.as_secs_f64()) as u64
                        )
                    ),
                    (_, true) => "-".into(),
                    _ => format_ns(q.throttled_ns),
                },
                format_us(percentile(&h, 0.5)),
                format_us(percentile(&h, 0.99)),
            ]);
        };
        if let Some(t) = &d.total {
            add(
                d.id.clone(),
                t,
                before.and_then(|(o, dt)| o.total.as_ref().map(|t| (t, dt))),
            );
        }
        if d.queues.len() > 1 {
            for q in &d.queues {
                let old = before.and_then(|(o, dt)| {
                    o.queues
                        .iter()
                        .find(|p| p.index == q.index)
                        .map(|p| (p, dt))
                });
                add(format!("  q{}", q.index), q, old);
            }
        }
    }
    // THROTTLED: time the queue's requests waited for the I/O limits, summed over requests
    // (so it can exceed the wall time: 2 requests waiting 1 s each are 2 s).
    let headers: [&str; 12] = if rate {
        [
            "DISK",
            "READ/s",
            "READ B/s",
            "WRITE/s",
            "WRITE B/s",
            "FLUSH/s",
            "DISCARD/s",
            "INFLIGHT",
            "ERRORS",
            "THROTTLED/s",
            "P50",
            "P99",
        ]
    } else {
        [
            "DISK",
            "READS",
            "READ",
            "WRITES",
            "WRITTEN",
            "FLUSHES",
            "DISCARDS",
            "INFLIGHT",
            "ERRORS",
            "THROTTLED",
            "P50",
            "P99",
        ]
    };
    render_table(&headers, &rows)
}

/// `stats --rejections`: the rejected requests of each disk by the rule they broke, per queue
/// (`-` for the disk's total when it has one queue); only reasons that happened. A frontend
/// that predates named reasons shows its total as `unnamed`.
pub fn rejections_table(disks: &[DiskStatistics]) -> String {
    let mut rows = Vec::new();
    for d in disks {
        let queues: Vec<(String, &QueueStats)> = match (d.queues.len(), &d.total) {
            (0 | 1, Some(total)) => vec![("-".into(), total)],
            _ => d.queues.iter().map(|q| (q.index.to_string(), q)).collect(),
        };
        for (queue, q) in queues {
            if q.rejections.is_empty() && q.rejected != 0 {
                rows.push(vec![
                    d.id.clone(),
                    queue.clone(),
                    "unnamed".into(),
                    q.rejected.to_string(),
                ]);
            }
            for r in q.rejections.iter().filter(|r| r.count != 0) {
                rows.push(vec![
                    d.id.clone(),
                    queue.clone(),
                    r.reason.clone(),
                    r.count.to_string(),
                ]);
            }
        }
    }
    if rows.is_empty() {
        return "no rejected requests\n".into();
    }
    render_table(&["DISK", "QUEUE", "REASON", "COUNT"], &rows)
}

/// A duration in nanoseconds for people: `0`, `850us`, `12ms`, `3.5s`.
pub fn format_ns(ns: u64) -> String {
    match ns {
        0 => "0".into(),
        n if n < 1_000_000 => format!("{}us", n / 1000),
        n if n < 10_000_000_000 => format!("{}ms", n / 1_000_000),
        n => format!("{:.1}s", n as f64 / 1e9),
    }
}

/// An event as JSON.
pub fn event_json(e: &Event) -> Value {
    json!({
        "kind": kind_name(EventKind::try_from(e.kind).unwrap_or(EventKind::Unspecified)),
        "disk_id": e.disk_id,
        "time": format_time(e.unix_time_ms),
        "unix_time_ms": e.unix_time_ms,
        "pid": e.pid,
        "message": e.message,
    })
}

/// An event as one line for people.
pub fn event_line(e: &Event) -> String {
    let kind = kind_name(EventKind::try_from(e.kind).unwrap_or(EventKind::Unspecified));
    let mut s = format!(
        "{}  {kind:<KIND_NAME_WIDTH$}  {}",
        format_time(e.unix_time_ms),
        e.disk_id
    );
    if e.pid != 0 {
        s.push_str(&format!("  pid {}", e.pid));
    }
    if !e.message.is_empty() {
        s.push_str(&format!("  {}", e.message));
    }
    s
}

/// A resize answer as JSON.
pub fn resize_json(id: &str, r: &ResizeDone) -> Value {
    json!({ "id": id, "capacity_bytes": r.capacity_bytes, "guest_notified": r.guest_notified })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limits::throttle_detail;
    use blkplane_api::pb::{DiskConfig, DiskSettings, ThrottleConfig};
    use blkplane_proto::v1::ThrottleLimits;

    #[test]
    fn percentiles() {
        let h = LatencyHistogram {
            upper_bounds_us: vec![10, 100, 1000, u64::MAX],
            counts: vec![50, 40, 9, 1],
        };
        assert_eq!(percentile(&h, 0.5), Some(10));
        assert_eq!(percentile(&h, 0.9), Some(100));
        assert_eq!(percentile(&h, 0.99), Some(1000));
        assert_eq!(percentile(&h, 1.0), Some(u64::MAX));
        assert_eq!(percentile(&LatencyHistogram::default(), 0.5), None);
    }

    #[test]
    fn throttle_output() {
        let t = ThrottleConfig {
            id: "d".into(),
            limits: Some(
                blkplane_api::limits::named(&[
                    ("iops_total", 100),
                    ("bps_read_max_length", 0),
                    ("bps_write", 4096),
                ])
                .unwrap(),
            ),
            group: "g".into(),
            group_members: vec!["d".into(), "e".into()],
            member_index: 1,
            pending: vec!["e".into()],
        };
        let text = throttle_detail(&t);
        assert!(
            text.contains("group:       g (member index 1; members: d e)\n"),
            "{text}"
        );
        assert!(text.contains("\nbps-write:   4096\n"), "{text}");
        assert!(text.contains("\niops-total:  100\n"), "{text}");
        assert!(text.contains("pending:     e (the frontend"), "{text}");
        let j = throttle_json(&t);
        assert_eq!(j["limits"].as_object().unwrap().len(), 19);
        assert_eq!(j["limits"]["iops_total"], 100);
        assert_eq!(j["limits"]["bps_read"], 0);
        assert_eq!(j["group_members"][1], "e");
        assert_eq!(j["member_index"], 1);
        assert_eq!(j["pending"][0], "e");
        let none = throttle_detail(&ThrottleConfig {
            id: "x".into(),
            ..Default::default()
        });
        assert_eq!(
            none,
            "id:      x\ngroup:   none\nlimits:  none (not throttled)\n"
        );
        assert_eq!(
            limits_text(&t.limits.unwrap()),
            "bps-write=4096 iops-total=100"
        );
        assert_eq!(limits_text(&ThrottleLimits::default()), "none");
        // disk show: the limits and the group only when set.
        let mut d = Disk {
            config: Some(blkplane_api::pb::DiskConfig {
                id: "d".into(),
                ..Default::default()
            }),
            throttle: Some(t.clone()),
            ..Default::default()
        };
        let text = disk_detail(&d);
        assert!(
            text.contains("\nthrottle:           bps-write=4096 iops-total=100\n"),
            "{text}"
        );
        assert!(
            text.contains("\nthrottle group:     g (member index 1"),
            "{text}"
        );
        assert_eq!(disk_json(&d)["throttle"]["group"], "g");
        d.throttle = Some(ThrottleConfig {
            id: "d".into(),
            limits: Some(ThrottleLimits::default()),
            ..Default::default()
        });
        assert!(!disk_detail(&d).contains("throttle"));
        assert_eq!(disk_json(&d)["throttle"]["limits"]["iops_total"], 0);
        for (ns, text) in [
            (0, "0"),
            (999, "0us"),
            (850_000, "850us"),
            (12_000_000, "12ms"),
            (3_500_000_000, "3500ms"),
            (12_340_000_000, "12.3s"),
        ] {
            assert_eq!(format_ns(ns), text);
        }
    }

    #[test]
    fn a_copys_progress_in_one_line() {
        let mib = 1 << 20;
        let copy = MigrationCopy {
            destination: "disk d on n:7070".into(),
            phase: MigrationCopyPhase::Dirty as i32,
            bytes_sent: 30 * mib,
            remaining_bytes: 10 * mib,
            dirty_bytes_per_second: 2 * mib,
            bandwidth_bytes_per_second: 20 * mib,
            passes: 3,
            throttle_write_bytes_per_second: 5 * mib,
            eta_ms: 1500,
            ..MigrationCopy::default()
        };
        assert_eq!(
            copy_line(&copy),
            "dirty     [###############.....] sent 30.0 MiB, remaining 10.0 MiB, dirty \
             2.0 MiB/s, pass 3, limit 20.0 MiB/s, guest writes throttled to 5.0 MiB/s, \
             converges in ~1.5 s"
        );
        let done = MigrationCopy {
            phase: MigrationCopyPhase::Complete as i32,
            remaining_bytes: 0,
            throttle_write_bytes_per_second: 0,
            bandwidth_bytes_per_second: 0,
            switch_over_us: 4250,
            ..copy.clone()
        };
        assert!(
            copy_line(&done).ends_with("switch-over 4.2 ms"),
            "{}",
            copy_line(&done)
        );
        assert!(copy_line(&done).contains("[####################]"));
        let failed = MigrationCopy {
            phase: MigrationCopyPhase::Failed as i32,
            failure: "cancelled".into(),
            ..done
        };
        assert!(copy_line(&failed).ends_with(": cancelled"));
        assert_eq!(copy_json(&failed)["phase"], "failed");
    }

    #[test]
    fn tables_and_json() {
        let d = Disk {
            config: Some(DiskConfig {
                id: "disk0".into(),
                settings: Some(DiskSettings {
                    num_queues: 2,
                    vhost_socket: "/run/disk0.sock".into(),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            state: DiskState::Connected as i32,
            vmm_connected: true,
            frontend_pid: 42,
            capacity_bytes: 1 << 30,
            ..Default::default()
        };
        let t = disks_table(std::slice::from_ref(&d));
        let lines: Vec<&str> = t.lines().collect();
        assert!(lines[0].starts_with("ID     STATE"), "{t}");
        assert!(
            lines[1].contains("connected") && lines[1].contains("1.0 GiB"),
            "{t}"
        );
        let j = disk_json(&d);
        assert_eq!(j["state"], "connected");
        assert_eq!(j["migratable"], false);
        let blocked = MigrationStatus {
            id: "disk0".into(),
            migratable: false,
            blockers: vec![MigrationBlocker {
                reason: MigrationBlockerReason::OperatorBackup as i32,
                message: "nightly".into(),
                automatic: false,
                since_unix_ms: 0,
            }],
        };
        let t = migration_table(&blocked);
        assert!(t.starts_with("disk0: not migratable\nREASON"), "{t}");
        assert!(
            t.contains("operator_backup  operator  1970-01-01T00:00:00.000Z  nightly"),
            "{t}"
        );
        assert_eq!(
            migration_json(&blocked)["blockers"][0]["reason"],
            "operator_backup"
        );
        assert_eq!(j["frontend_pid"], 42);
        assert_eq!(j["config"]["cache"], "direct");
        // The image format: unspecified only for a disk kept from before formats were.
        assert_eq!(j["config"]["format"], "probe");
        assert!(disk_detail(&d).contains("\nformat:             probed at each start\n"));
        let mut qcow2 = d.clone();
        if let Some(s) = qcow2.config.as_mut().and_then(|c| c.settings.as_mut()) {
            s.format = ImageFormat::Qcow2 as i32;
        }
        assert_eq!(disk_json(&qcow2)["config"]["format"], "qcow2");
        let text = disk_detail(&qcow2);
        assert!(text.contains("\nformat:             qcow2\n"), "{text}");
        assert_eq!(j["config"]["incoming_for"], "");
        assert!(disk_detail(&d).contains("frontend pid:"));
        assert!(!disk_detail(&d).contains("incoming"));
        // The disk's user: blkplaned's unless run_as names one.
        assert_eq!(j["config"]["run_as"], Value::Null);
        assert!(disk_detail(&d).contains("\nrun as:             blkplaned's user\n"));
        let mut own_user = d.clone();
        if let Some(s) = own_user.config.as_mut().and_then(|c| c.settings.as_mut()) {
            s.run_as = Some(blkplane_api::pb::RunAs {
                uid: 107,
                gid: 107,
                groups: vec![36, 995],
            });
        }
        assert_eq!(
            disk_json(&own_user)["config"]["run_as"],
            json!({"uid": 107, "gid": 107, "groups": [36, 995]})
        );
        let text = disk_detail(&own_user);
        assert!(
            text.contains("\nrun as:             uid 107 gid 107 groups 36,995\n"),
            "{text}"
        );
        assert!(!t.contains("INCOMING"));
        // An incoming disk: shown in the detail, and the list grows a column for it.
        let mut incoming = d.clone();
        if let Some(c) = incoming.config.as_mut() {
            c.id = "disk1".into();
            c.incoming_for = "disk0".into();
        }
        assert_eq!(disk_json(&incoming)["config"]["incoming_for"], "disk0");
        assert!(
            disk_detail(&incoming).contains("\nincoming for:       disk0 (live-migration"),
            "{}",
            disk_detail(&incoming)
        );
        let t = disks_table(&[d.clone(), incoming]);
        let lines: Vec<&str> = t.lines().collect();
        assert!(lines[0].contains("MIGRATABLE  INCOMING  SOCKET"), "{t}");
        assert!(lines[1].contains("  -         /run/disk0.sock"), "{t}");
        assert!(lines[2].contains("  disk0     /run/disk0.sock"), "{t}");
        let e = Event {
            kind: EventKind::Restarted as i32,
            disk_id: "disk0".into(),
            unix_time_ms: 0,
            pid: 7,
            message: "m".into(),
        };
        assert_eq!(
            event_line(&e),
            "1970-01-01T00:00:00.000Z  restarted                disk0  pid 7  m"
        );
        // The longest kind keeps the disk column where the others have it.
        let long = Event {
            kind: EventKind::MigrationAutoConverge as i32,
            ..e.clone()
        };
        assert_eq!(
            event_line(&long).find("disk0"),
            event_line(&e).find("disk0"),
            "{}",
            event_line(&long)
        );
        assert_eq!(event_json(&e)["kind"], "restarted");
        let s = DiskStatistics {
            id: "disk0".into(),
            total: Some(QueueStats {
                read_ops: 10,
                ..Default::default()
            }),
            queues: vec![
                QueueStats::default(),
                QueueStats {
                    index: 1,
                    ..Default::default()
                },
            ],
            frontend_pid: 42,
            iothreads: vec![blkplane_proto::v1::IothreadStats {
                index: 0,
                inline_transfers: 5,
                queued_transfers: 7,
            }],
        };
        let j = stats_json(std::slice::from_ref(&s));
        assert_eq!(j[0]["iothreads"][0]["inline_transfers"], 5);
        assert_eq!(j[0]["iothreads"][0]["queued_transfers"], 7);
        let t = stats_table(std::slice::from_ref(&s), None);
        assert!(t.contains("  q1"), "{t}");
        assert!(
            t.lines().next().unwrap().contains("ERRORS  THROTTLED  P50"),
            "{t}"
        );
        let mut later = s.clone();
        later.total.as_mut().unwrap().read_ops = 30;
        let t = stats_table(
            std::slice::from_ref(&later),
            Some((std::slice::from_ref(&s), Duration::from_secs(2))),
        );
        assert!(t.lines().nth(1).unwrap().starts_with("disk0  10 "), "{t}");
        assert_eq!(
            stats_json(std::slice::from_ref(&s))[0]["total"]["read_ops"],
            10
        );
        // Throttled time: per queue, as a total and as a rate.
        let mut throttled = s.clone();
        throttled.queues[1].throttled_ns = 2_000_000_000;
        throttled.queues[1].throttled_ops = 4;
        let j = stats_json(std::slice::from_ref(&throttled));
        assert_eq!(j[0]["queues"][1]["throttled_ns"], 2_000_000_000u64);
        assert_eq!(j[0]["queues"][1]["throttled_ops"], 4);
        assert_eq!(j[0]["queues"][0]["throttled_ns"], 0);
        let t = stats_table(std::slice::from_ref(&throttled), None);
        let q1 = t.lines().find(|l| l.starts_with("  q1")).unwrap();
        assert!(q1.contains(" 2000ms "), "{t}");
        let t = stats_table(
            std::slice::from_ref(&throttled),
            Some((std::slice::from_ref(&s), Duration::from_secs(2))),
        );
        assert!(t.lines().next().unwrap().contains("THROTTLED/s"), "{t}");
        let q1 = t.lines().find(|l| l.starts_with("  q1")).unwrap();
        assert!(q1.contains(" 1000ms/s "), "{t}");
    }

    #[test]
    fn rejections_by_queue_and_reason() {
        let r = |reason: &str, count| blkplane_proto::v1::RejectionCount {
            reason: reason.into(),
            count,
        };
        let q = |index, rejections| QueueStats {
            index,
            rejections,
            ..Default::default()
        };
        let two = DiskStatistics {
            id: "d2".into(),
            queues: vec![
                q(0, vec![r("read_only", 2), r("empty_range", 0)]),
                q(1, vec![r("read_only", 0), r("status_empty", 1)]),
            ],
            ..Default::default()
        };
        let one = DiskStatistics {
            id: "d1".into(),
            total: Some(q(1, vec![r("beyond_capacity", 4)])),
            queues: vec![q(0, vec![r("beyond_capacity", 4)])],
            ..Default::default()
        };
        let old = DiskStatistics {
            id: "old".into(),
            total: Some(QueueStats {
                rejected: 3,
                ..Default::default()
            }),
            queues: vec![QueueStats::default()],
            ..Default::default()
        };
        let t = rejections_table(&[two.clone(), one, old]);
        let lines: Vec<&str> = t.lines().map(str::trim_end).collect();
        assert_eq!(
            lines,
            [
                "DISK  QUEUE  REASON           COUNT",
                "d2    0      read_only        2",
                "d2    1      status_empty     1",
                "d1    -      beyond_capacity  4",
                "old   -      unnamed          3",
            ],
            "{t}"
        );
        assert_eq!(
            rejections_table(&[DiskStatistics::default()]),
            "no rejected requests\n"
        );
        let j = stats_json(std::slice::from_ref(&two));
        assert_eq!(j[0]["queues"][1]["rejections"]["status_empty"], 1);
        assert_eq!(j[0]["queues"][0]["rejections"]["empty_range"], 0);
    }
}
