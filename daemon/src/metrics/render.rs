//! A scrape's [`Snapshot`] in Prometheus' text exposition format 0.0.4, written by the
//! `prometheus-client` crate (the official Rust client): the snapshot is a [`Collector`] of
//! constant metrics, encoded once per scrape. blkplaned keeps no metric objects of its own
//! between scrapes because every number is someone else's already — the disk table's, or a
//! frontend's atomic counters read at this scrape — so there is nothing to increment here.

use std::fmt;

use blkplane_proto::v1::{LatencyHistogram, QueueStats};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

use super::{DiskMetrics, Snapshot, REASONS, STATES};
use crate::pb::{MigrationCopy, MigrationCopyPhase};
use blkplane_api::names::{copy_phase_name, reason_name, state_name};

/// The phases of a copy as series of `blkplane_disk_migration_copy_phase`, in the API's order.
const COPY_PHASES: [MigrationCopyPhase; 5] = [
    MigrationCopyPhase::Bulk,
    MigrationCopyPhase::Dirty,
    MigrationCopyPhase::Converged,
    MigrationCopyPhase::Complete,
    MigrationCopyPhase::Failed,
];

/// The `Content-Type` of `/metrics`: Prometheus' text exposition format 0.0.4 (UTF-8).
pub const METRICS_CONTENT_TYPE: &str = prometheus_client::encoding::prometheus_text::CONTENT_TYPE;

/// The daemon's version, for `blkplane_build_info`.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The label name `reason` of a rejection counted before frontends named their reasons (an
/// older frontend still running, adopted by this blkplaned): its total, under this value.
pub const UNNAMED_REJECTION: &str = "unnamed";

/// Renders a scrape.
pub fn render(snapshot: Snapshot) -> String {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(Scrape(snapshot)));
    let mut text = String::new();
    // Writing to a String cannot fail; an encoder error would be a bug in a collector, and a
    // scrape then shows what was written before it.
    let _ = prometheus_client::encoding::prometheus_text::encode(&mut text, &registry);
    text
}

/// One scrape's numbers, as prometheus-client collects them.
#[derive(Debug)]
struct Scrape(Snapshot);

/// A family's samples, gathered before anything is written, so that a family without samples
/// is left out altogether (no HELP and TYPE of a metric nobody has).
struct Family<'a, M> {
    name: &'static str,
    help: &'static str,
    samples: Vec<(Vec<(&'static str, &'a str)>, M)>,
}

impl<'a, M: EncodeMetric> Family<'a, M> {
    fn new(name: &'static str, help: &'static str) -> Self {
        Family {
            name,
            help,
            samples: Vec::new(),
        }
    }

    fn add(&mut self, labels: &[(&'static str, &'a str)], metric: M) {
        self.samples.push((labels.to_vec(), metric));
    }

    fn write(self, encoder: &mut DescriptorEncoder) -> fmt::Result {
        let Some((_, first)) = self.samples.first() else {
            return Ok(());
        };
        let mut family =
            encoder.encode_descriptor(self.name, self.help, None, first.metric_type())?;
        for (labels, metric) in &self.samples {
            metric.encode(family.encode_family(labels)?)?;
        }
        Ok(())
    }
}

/// A histogram whose buckets were counted elsewhere (by the frontend): prometheus-client's
/// `Histogram` observes values itself, so the counts are handed to its encoder as they are.
#[derive(Debug)]
struct CountedHistogram {
    /// (upper bound in seconds, requests in this bucket alone); the encoder makes them
    /// cumulative and adds `+Inf` unless the last bound is infinite.
    buckets: Vec<(f64, u64)>,
    sum_seconds: f64,
    count: u64,
}

impl EncodeMetric for CountedHistogram {
    fn encode(&self, mut encoder: MetricEncoder) -> fmt::Result {
        encoder.encode_histogram::<NoLabelSet>(self.sum_seconds, self.count, &self.buckets, None)
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Histogram
    }
}

/// A 0/1 gauge.
fn flag(b: bool) -> ConstGauge<i64> {
    ConstGauge::new(i64::from(b))
}

fn counter(value: u64) -> ConstCounter<u64> {
    ConstCounter::new(value)
}

fn gauge(value: u64) -> ConstGauge<u64> {
    ConstGauge::new(value)
}

/// One queue's counters by request kind: (kind, ops, bytes); bytes are `None` for the kinds
/// that move none (flush, and GET_ID answered by the frontend, "other").
fn by_kind(q: &QueueStats) -> [(&'static str, u64, Option<u64>); 6] {
    [
        ("read", q.read_ops, Some(q.read_bytes)),
        ("write", q.write_ops, Some(q.write_bytes)),
        ("flush", q.flush_ops, None),
        ("discard", q.discard_ops, Some(q.discard_bytes)),
        (
            "write_zeroes",
            q.write_zeroes_ops,
            Some(q.write_zeroes_bytes),
        ),
        ("other", q.other_ops, None),
    ]
}

/// The frontend's latency histogram as Prometheus buckets. Its last bound (u64::MAX µs) is
/// its open-ended bucket, which becomes `+Inf`. The counts are the frontend's word, so they
/// are added with saturation: each bucket gets what its saturated cumulative count grew by,
/// so the encoder's own sum cannot overflow either.
///
/// The frontend counts requests per bucket, not their latencies' sum, so the sum is an
/// estimate: each request counted at the middle of its bucket (lower bound: the previous
/// bucket's upper bound, 0 for the first), those of the open-ended bucket at its lower bound.
fn histogram(h: &LatencyHistogram) -> CountedHistogram {
    let mut buckets = Vec::with_capacity(h.counts.len());
    let mut cumulative: u64 = 0;
    let mut sum_us = 0.0;
    let mut lower_us: u64 = 0;
    for (&upper_us, &count) in h.upper_bounds_us.iter().zip(&h.counts) {
        let before = cumulative;
        cumulative = cumulative.saturating_add(count);
        let added = cumulative - before;
        if upper_us == u64::MAX {
            sum_us += added as f64 * lower_us as f64;
            buckets.push((f64::INFINITY, added));
            break;
        }
        sum_us += added as f64 * (lower_us as f64 + upper_us as f64) / 2.0;
        buckets.push((upper_us as f64 / 1e6, added));
        lower_us = upper_us;
    }
    CountedHistogram {
        buckets,
        sum_seconds: sum_us / 1e6,
        count: cumulative,
    }
}

/// The queues of the disks that answered this scrape: (disk id, queue index, counters).
fn queues(disks: &[DiskMetrics]) -> Vec<(&str, String, &QueueStats)> {
    disks
        .iter()
        .flat_map(|d| {
            d.queues
                .iter()
                .flatten()
                .map(move |q| (d.id.as_str(), q.index.to_string(), q))
        })
        .collect()
}

impl Collector for Scrape {
    fn encode(&self, mut encoder: DescriptorEncoder) -> fmt::Result {
        let disks = &self.0.disks;
        let e = &mut encoder;

        let mut f = Family::new(
            "blkplane_build_info",
            "Always 1; the label says which blkplaned serves the metrics.",
        );
        f.add(&[("version", VERSION)], gauge(1));
        f.write(e)?;

        let mut f = Family::new("blkplane_disks", "Disks blkplaned owns, in any state.");
        f.add(&[], gauge(disks.len() as u64));
        f.write(e)?;

        let mut f = Family::new(
            "blkplane_disk_state",
            "1 for the disk's current state (starting, ready, connected, restarting, failed, \
             stopping, drained), 0 for the others.",
        );
        for d in disks {
            for s in STATES {
                f.add(
                    &[("disk", d.id.as_str()), ("state", state_name(s))],
                    flag(d.state == s),
                );
            }
        }
        f.write(e)?;

        let mut f = Family::new(
            "blkplane_disk_vmm_connected",
            "1 while a VMM is connected to the disk's vhost-user socket (as of the last status \
             poll).",
        );
        for d in disks {
            let connected = d.status.as_ref().is_some_and(|s| s.vmm_connected);
            f.add(&[("disk", d.id.as_str())], flag(connected));
        }
        f.write(e)?;

        let mut f = Family::new(
            "blkplane_disk_capacity_bytes",
            "The disk's capacity in bytes, as its running frontend reports it (absent while \
             none runs).",
        );
        for d in disks {
            if let Some(s) = &d.status {
                f.add(&[("disk", d.id.as_str())], gauge(s.capacity_bytes));
            }
        }
        f.write(e)?;

        let mut f = Family::new(
            "blkplane_disk_frontend_restarts",
            "Times blkplaned started the disk's frontend again (after a crash, a failed start, \
             or a blkplaned start that found none to adopt), since the disk was added; kept \
             in blkplaned's state across its restarts.",
        );
        for d in disks {
            f.add(
                &[("disk", d.id.as_str())],
                counter(u64::from(d.frontend_restarts)),
            );
        }
        f.write(e)?;

        let mut f = Family::new(
            "blkplane_disk_iothread_restarts",
            "Iothreads the disk's frontend replaced since it started (absent while no frontend \
             runs).",
        );
        for d in disks {
            if let Some(s) = &d.status {
                f.add(&[("disk", d.id.as_str())], counter(s.iothread_restarts));
            }
        }
        f.write(e)?;

        let mut f = Family::new(
            "blkplane_disk_migratable",
            "1 if the disk may be live-migrated now (it has no migration blocker), else 0.",
        );
        for d in disks {
            f.add(&[("disk", d.id.as_str())], flag(d.blockers.is_empty()));
        }
        f.write(e)?;

        let mut f = Family::new(
            "blkplane_disk_migration_blockers",
            "1 for each reason that blocks the disk's live migration now, 0 for the others.",
        );
        for d in disks {
            for r in REASONS {
                f.add(
                    &[("disk", d.id.as_str()), ("reason", reason_name(r))],
                    flag(d.blockers.contains(&r)),
                );
            }
        }
        f.write(e)?;

        let mut f = Family::new(
            "blkplane_disk_migration",
            "1 while the disk takes part in a live migration: as its source or its destination, \
             with the disk on the other side (ID on this node, ID@NODE or ID@HOST:PORT on \
             another). Absent otherwise.",
        );
        for d in disks {
            if let Some(m) = &d.migration {
                f.add(
                    &[
                        ("disk", d.id.as_str()),
                        ("role", m.role),
                        ("peer", m.peer.as_str()),
                    ],
                    flag(true),
                );
            }
        }
        f.write(e)?;

        let copies = || {
            disks
                .iter()
                .filter_map(|d| Some((d.id.as_str(), d.copy.as_ref()?)))
        };
        let mut f = Family::new(
            "blkplane_disk_migration_copy_phase",
            "On the source of a copy to another node (StartMigration): 1 for the copy's phase \
             (bulk, dirty, converged, complete, failed), 0 for the others. Absent without a copy.",
        );
        for (id, c) in copies() {
            for phase in COPY_PHASES {
                f.add(
                    &[("disk", id), ("phase", copy_phase_name(phase))],
                    flag(c.phase == phase as i32),
                );
            }
        }
        f.write(e)?;
        for (name, help, value) in [
            (
                "blkplane_disk_migration_copy_sent_bytes",
                "Bytes of image the copy to another node has sent (zero ranges by their length).",
                (|c: &MigrationCopy| c.bytes_sent) as fn(&MigrationCopy) -> u64,
            ),
            (
                "blkplane_disk_migration_copy_remaining_bytes",
                "Bytes the copy to another node still has to send.",
                |c| c.remaining_bytes,
            ),
            (
                "blkplane_disk_migration_copy_dirty_bytes_per_second",
                "How fast the guest wrote blocks the copy had sent, over its last pass.",
                |c| c.dirty_bytes_per_second,
            ),
            (
                "blkplane_disk_migration_copy_write_limit_bytes_per_second",
                "Auto-converge: the limit on the disk's writes while its copy converges; 0: none.",
                |c| c.throttle_write_bytes_per_second,
            ),
        ] {
            let mut f = Family::new(name, help);
            for (id, c) in copies() {
                f.add(&[("disk", id)], gauge(value(c)));
            }
            f.write(e)?;
        }

        let mut f = Family::new(
            "blkplane_disk_stats_available",
            "1 if the disk's frontend answered this scrape's statistics request (then its \
             blkplane_queue_* series are present), 0 if none runs or it did not answer in time.",
        );
        for d in disks {
            f.add(&[("disk", d.id.as_str())], flag(d.queues.is_some()));
        }
        f.write(e)?;

        let queues = queues(disks);
        let rows = || queues.iter().map(|(d, q, s)| (*d, q.as_str(), *s));

        let mut f = Family::new(
            "blkplane_queue_ops",
            "Completed requests by kind (read, write, flush, discard, write_zeroes; other: \
             GET_ID, answered by the frontend), since the frontend started.",
        );
        for (disk, queue, q) in rows() {
            for (kind, ops, _) in by_kind(q) {
                f.add(
                    &[("disk", disk), ("queue", queue), ("kind", kind)],
                    counter(ops),
                );
            }
        }
        f.write(e)?;

        let mut f = Family::new(
            "blkplane_queue_bytes",
            "Bytes moved by completed requests by kind (read, write, discard, write_zeroes; \
             flush and other move none), since the frontend started.",
        );
        for (disk, queue, q) in rows() {
            for (kind, _, bytes) in by_kind(q) {
                if let Some(bytes) = bytes {
                    f.add(
                        &[("disk", disk), ("queue", queue), ("kind", kind)],
                        counter(bytes),
                    );
                }
            }
        }
        f.write(e)?;

        let mut f = Family::new(
            "blkplane_queue_in_flight",
            "Requests of the queue in flight now (including those waiting for the I/O limits).",
        );
        for (disk, queue, q) in rows() {
            f.add(&[("disk", disk), ("queue", queue)], gauge(q.in_flight));
        }
        f.write(e)?;

        let mut f = Family::new(
            "blkplane_queue_errors",
            "Requests completed with an error status (I/O errors and rejected requests).",
        );
        for (disk, queue, q) in rows() {
            f.add(&[("disk", disk), ("queue", queue)], counter(q.errors));
        }
        f.write(e)?;

        let mut f = Family::new(
            "blkplane_queue_rejected",
            "Requests rejected by validation, by the rule they broke (most also count as errors; \
             chains returned unread count only here). Every reason the frontend knows is \
             present, zero until it happens.",
        );
        for (disk, queue, q) in rows() {
            if q.rejections.is_empty() {
                // A frontend that counts no reasons: its total, as one unnamed reason.
                f.add(
                    &[
                        ("disk", disk),
                        ("queue", queue),
                        ("reason", UNNAMED_REJECTION),
                    ],
                    counter(q.rejected),
                );
            }
            for r in &q.rejections {
                f.add(
                    &[
                        ("disk", disk),
                        ("queue", queue),
                        ("reason", r.reason.as_str()),
                    ],
                    counter(r.count),
                );
            }
        }
        f.write(e)?;

        let mut f = Family::new(
            "blkplane_queue_latency_seconds",
            "Latency of requests that went to an iothread, from taking them off the ring to the \
             used entry (power-of-two microsecond buckets). The frontend keeps no sum: _sum is \
             estimated from the bucket bounds, each request at the middle of its bucket (those \
             above the last finite bound at that bound).",
        );
        for (disk, queue, q) in rows() {
            if let Some(h) = &q.latency {
                f.add(&[("disk", disk), ("queue", queue)], histogram(h));
            }
        }
        f.write(e)?;

        let mut f = Family::new(
            "blkplane_queue_throttled_seconds",
            "Time the queue's requests spent waiting for the disk's I/O limits, summed over \
             requests.",
        );
        for (disk, queue, q) in rows() {
            f.add(
                &[("disk", disk), ("queue", queue)],
                ConstCounter::new(q.throttled_ns as f64 / 1e9),
            );
        }
        f.write(e)?;

        let mut f = Family::new(
            "blkplane_queue_throttled_ops",
            "Requests of the queue that had to wait for the disk's I/O limits.",
        );
        for (disk, queue, q) in rows() {
            f.add(
                &[("disk", disk), ("queue", queue)],
                counter(q.throttled_ops),
            );
        }
        f.write(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::MigrationRole;
    use crate::pb::{DiskState, MigrationBlockerReason as Reason};
    use blkplane_proto::v1::{FrontendStatus, RejectionCount};

    fn queue(index: u32) -> QueueStats {
        QueueStats {
            index,
            read_ops: 3,
            read_bytes: 3 * 4096,
            write_ops: 2,
            write_bytes: 8192,
            flush_ops: 1,
            other_ops: 1,
            in_flight: 1,
            errors: 1,
            rejected: 1,
            rejections: vec![
                RejectionCount {
                    reason: "status_empty".into(),
                    count: 1,
                },
                RejectionCount {
                    reason: "beyond_capacity".into(),
                    count: 0,
                },
            ],
            throttled_ns: 1_500_000_001,
            throttled_ops: 2,
            latency: Some(LatencyHistogram {
                upper_bounds_us: vec![1, 2, 4, u64::MAX],
                counts: vec![1, 0, 3, 1],
            }),
            ..Default::default()
        }
    }

    fn snapshot() -> Snapshot {
        Snapshot {
            disks: vec![
                DiskMetrics {
                    id: "a".into(),
                    state: DiskState::Connected,
                    frontend_restarts: 2,
                    status: Some(FrontendStatus {
                        vmm_connected: true,
                        capacity_bytes: 1 << 20,
                        iothread_restarts: 1,
                        ..Default::default()
                    }),
                    blockers: vec![Reason::UnsupportedFeature],
                    queues: Some(vec![queue(0), queue(1)]),
                    migration: Some(MigrationRole {
                        role: "source",
                        peer: "a2@node-b".into(),
                    }),
                    copy: Some(MigrationCopy {
                        phase: MigrationCopyPhase::Converged as i32,
                        bytes_sent: 5000,
                        remaining_bytes: 65536,
                        ..MigrationCopy::default()
                    }),
                },
                DiskMetrics {
                    id: "b".into(),
                    state: DiskState::Failed,
                    frontend_restarts: 5,
                    status: None,
                    blockers: vec![Reason::FrontendRestarting, Reason::OperatorBackup],
                    queues: None,
                    migration: None,
                    copy: None,
                },
            ],
        }
    }

    /// The sample lines of `text` whose name and labels start with `prefix`.
    fn lines<'a>(text: &'a str, prefix: &str) -> Vec<&'a str> {
        text.lines().filter(|l| l.starts_with(prefix)).collect()
    }

    #[test]
    fn histogram_buckets_are_the_frontends_counts() {
        let h = histogram(&LatencyHistogram {
            upper_bounds_us: vec![1, 2, 4, u64::MAX],
            counts: vec![1, 0, 3, 1],
        });
        assert_eq!(
            h.buckets,
            [(1e-6, 1), (2e-6, 0), (4e-6, 3), (f64::INFINITY, 1)]
        );
        assert_eq!(h.count, 5);
        // 1 × 0.5 µs + 3 × 3 µs + 1 × 4 µs (open-ended: its lower bound) = 13.5 µs.
        assert!((h.sum_seconds - 13.5e-6).abs() < 1e-12, "{}", h.sum_seconds);
        // Counts that would overflow saturate instead of wrapping or panicking.
        let h = histogram(&LatencyHistogram {
            upper_bounds_us: vec![1, u64::MAX],
            counts: vec![u64::MAX, 5],
        });
        assert_eq!(h.count, u64::MAX);
        assert_eq!(h.buckets, [(1e-6, u64::MAX), (f64::INFINITY, 0)]);
        let text = render(Snapshot {
            disks: vec![DiskMetrics {
                queues: Some(vec![QueueStats {
                    latency: Some(LatencyHistogram {
                        upper_bounds_us: vec![1, u64::MAX],
                        counts: vec![u64::MAX, 5],
                    }),
                    ..Default::default()
                }]),
                ..snapshot().disks.remove(0)
            }],
        });
        assert!(text.contains(&format!(
            "blkplane_queue_latency_seconds_count{{disk=\"a\",queue=\"0\"}} {}\n",
            u64::MAX
        )));
    }

    #[test]
    fn renders_every_family_once_with_help_and_type() {
        let text = render(snapshot());
        let mut seen = Vec::new();
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# HELP ") {
                let name = rest.split(' ').next().unwrap();
                assert!(!seen.contains(&name.to_string()), "{name} twice");
                seen.push(name.to_string());
                continue;
            }
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                assert_eq!(rest.split(' ').next(), seen.last().map(|s| s.as_str()));
                continue;
            }
            // Every sample belongs to the family declared last.
            let family = seen.last().expect("a sample before any HELP");
            assert!(line.starts_with(family.as_str()), "{line} after {family}");
        }
        assert!(text.ends_with('\n'));
        assert!(text.contains("# TYPE blkplane_queue_latency_seconds histogram\n"));
        assert!(text.contains("# TYPE blkplane_queue_ops_total counter\n"));
        assert!(text.contains("# TYPE blkplane_disk_state gauge\n"));
        assert_eq!(
            METRICS_CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8"
        );
    }

    #[test]
    fn disk_series() {
        let text = render(snapshot());
        assert!(text.contains(&format!("blkplane_build_info{{version=\"{VERSION}\"}} 1\n")));
        assert!(text.contains("\nblkplane_disks 2\n"));
        assert!(text.contains("blkplane_disk_state{disk=\"a\",state=\"connected\"} 1\n"));
        assert!(text.contains("blkplane_disk_state{disk=\"a\",state=\"ready\"} 0\n"));
        assert!(text.contains("blkplane_disk_state{disk=\"b\",state=\"failed\"} 1\n"));
        // Only a disk in a migration has a migration series.
        assert!(text.contains(
            "blkplane_disk_migration{disk=\"a\",role=\"source\",peer=\"a2@node-b\"} 1\n"
        ));
        assert!(!text.contains("blkplane_disk_migration{disk=\"b\""));
        assert!(
            text.contains("blkplane_disk_migration_copy_phase{disk=\"a\",phase=\"converged\"} 1\n")
        );
        assert!(text.contains("blkplane_disk_migration_copy_phase{disk=\"a\",phase=\"bulk\"} 0\n"));
        assert!(text.contains("blkplane_disk_migration_copy_sent_bytes{disk=\"a\"} 5000\n"));
        assert!(text.contains("blkplane_disk_migration_copy_remaining_bytes{disk=\"a\"} 65536\n"));
        assert!(lines(&text, "blkplane_disk_migration_copy_phase{disk=\"b\"").is_empty());
        assert_eq!(
            lines(&text, "blkplane_disk_state{disk=\"b\"").len(),
            STATES.len()
        );
        assert!(text.contains("blkplane_disk_vmm_connected{disk=\"a\"} 1\n"));
        assert!(text.contains("blkplane_disk_vmm_connected{disk=\"b\"} 0\n"));
        assert!(text.contains("blkplane_disk_capacity_bytes{disk=\"a\"} 1048576\n"));
        // No frontend, no capacity or iothread restarts.
        assert!(lines(&text, "blkplane_disk_capacity_bytes{disk=\"b\"").is_empty());
        assert!(lines(&text, "blkplane_disk_iothread_restarts_total{disk=\"b\"").is_empty());
        assert!(text.contains("blkplane_disk_iothread_restarts_total{disk=\"a\"} 1\n"));
        assert!(text.contains("blkplane_disk_frontend_restarts_total{disk=\"b\"} 5\n"));
        assert!(text.contains("blkplane_disk_migratable{disk=\"a\"} 0\n"));
        assert!(text.contains(
            "blkplane_disk_migration_blockers{disk=\"a\",reason=\"unsupported_feature\"} 1\n"
        ));
        assert!(text.contains(
            "blkplane_disk_migration_blockers{disk=\"b\",reason=\"operator_backup\"} 1\n"
        ));
        assert!(
            text.contains("blkplane_disk_migration_blockers{disk=\"b\",reason=\"incoming\"} 0\n")
        );
        assert!(text.contains("blkplane_disk_stats_available{disk=\"a\"} 1\n"));
        assert!(text.contains("blkplane_disk_stats_available{disk=\"b\"} 0\n"));
    }

    #[test]
    fn queue_series() {
        let text = render(snapshot());
        for q in ["0", "1"] {
            let l = |rest: &str| format!("{{disk=\"a\",queue=\"{q}\"{rest}");
            for (line, value) in [
                (
                    format!("blkplane_queue_ops_total{}", l(",kind=\"read\"}")),
                    "3",
                ),
                (
                    format!("blkplane_queue_ops_total{}", l(",kind=\"other\"}")),
                    "1",
                ),
                (
                    format!("blkplane_queue_bytes_total{}", l(",kind=\"write\"}")),
                    "8192",
                ),
                (format!("blkplane_queue_in_flight{}", l("}")), "1"),
                (
                    format!(
                        "blkplane_queue_latency_seconds_bucket{}",
                        l(",le=\"+Inf\"}")
                    ),
                    "5",
                ),
                (
                    format!(
                        "blkplane_queue_latency_seconds_bucket{}",
                        l(",le=\"4e-06\"}")
                    ),
                    "4",
                ),
                (
                    format!("blkplane_queue_latency_seconds_count{}", l("}")),
                    "5",
                ),
                (
                    format!("blkplane_queue_throttled_seconds_total{}", l("}")),
                    "1.500000001",
                ),
                (
                    format!(
                        "blkplane_queue_rejected_total{}",
                        l(",reason=\"status_empty\"}")
                    ),
                    "1",
                ),
                (
                    format!(
                        "blkplane_queue_rejected_total{}",
                        l(",reason=\"beyond_capacity\"}")
                    ),
                    "0",
                ),
            ] {
                assert!(
                    text.contains(&format!("{line} {value}\n")),
                    "{line}:\n{text}"
                );
            }
        }
        // Six kinds of ops, four with bytes, two reasons, per queue; no queue series of b.
        assert_eq!(lines(&text, "blkplane_queue_ops_total{").len(), 12);
        assert_eq!(lines(&text, "blkplane_queue_bytes_total{").len(), 8);
        assert_eq!(lines(&text, "blkplane_queue_rejected_total{").len(), 4);
        assert!(!text.contains("disk=\"b\",queue="));
    }

    #[test]
    fn a_frontend_without_reasons_has_its_total_unnamed() {
        let mut s = snapshot();
        if let Some(queues) = s.disks[0].queues.as_mut() {
            queues.truncate(1);
            queues[0].rejections.clear();
            queues[0].rejected = 7;
        }
        let text = render(s);
        assert!(text.contains(&format!(
            "blkplane_queue_rejected_total{{disk=\"a\",queue=\"0\",reason=\"{UNNAMED_REJECTION}\"}} 7\n"
        )));
    }

    #[test]
    fn empty_families_are_left_out() {
        let text = render(Snapshot::default());
        assert!(text.contains("\nblkplane_disks 0\n"));
        assert!(!text.contains("blkplane_queue"));
        assert!(!text.contains("blkplane_disk_state"));
    }
}
