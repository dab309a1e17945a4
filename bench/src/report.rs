//! Turns the runs into numbers per (image, workload, target) — median and min–max over the
//! repetitions — and writes them as the BENCHMARKS.md tables.

use std::fmt::Write as _;

use crate::client::Measurement;
use crate::workload::{ImageKind, Target, Workload};

/// The per-run figures the report is made of.
#[derive(Debug, Clone, Copy)]
pub struct RunStats {
    /// Requests per second.
    pub iops: f64,
    /// MiB per second.
    pub mib_s: f64,
    /// Median latency, µs.
    pub p50: f64,
    /// 99th percentile latency, µs.
    pub p99: f64,
    /// 99.9th percentile latency, µs.
    pub p999: f64,
    /// Back-end CPU per request, µs (= CPU seconds per million requests); `None` for the
    /// ceiling, which has no back-end process.
    pub backend_cpu: Option<f64>,
    /// Client CPU per request, µs.
    pub client_cpu: f64,
    /// Back-end voluntary context switches per request.
    pub backend_wakeups: Option<f64>,
    /// Client voluntary context switches per request.
    pub client_wakeups: f64,
}

impl RunStats {
    /// The figures of one measurement; `None` if nothing completed in the window.
    pub fn new(m: &Measurement) -> Option<Self> {
        if m.ops == 0 || m.latency.count() == 0 {
            return None;
        }
        let seconds = m.window.as_secs_f64();
        let ops = m.ops as f64;
        let micros = |q| m.latency.quantile(q).map(|ns| ns / 1000.0);
        Some(Self {
            iops: ops / seconds,
            mib_s: m.bytes as f64 / seconds / f64::from(1 << 20),
            p50: micros(0.5)?,
            p99: micros(0.99)?,
            p999: micros(0.999)?,
            backend_cpu: m.backend_cpu.map(|s| s * 1e6 / ops),
            client_cpu: m.client_cpu * 1e6 / ops,
            backend_wakeups: m.backend_wakeups.map(|w| w as f64 / ops),
            client_wakeups: m.client_wakeups as f64 / ops,
        })
    }

    /// Back-end plus client CPU per request, µs: what the whole I/O path costs.
    pub fn total_cpu(&self) -> f64 {
        self.backend_cpu.unwrap_or(0.0) + self.client_cpu
    }
}

/// Median and range of one figure over the repetitions.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Spread {
    /// The median (the mean of the middle two for an even count).
    pub median: f64,
    /// The smallest.
    pub min: f64,
    /// The largest.
    pub max: f64,
}

impl Spread {
    /// The spread of `values`; `None` when empty.
    pub fn of(values: &[f64]) -> Option<Self> {
        let mut sorted = values.to_vec();
        sorted.sort_by(f64::total_cmp);
        let n = sorted.len();
        let median = match n {
            0 => return None,
            _ if n % 2 == 1 => sorted[n / 2],
            _ => (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0,
        };
        Some(Self {
            median,
            min: sorted[0],
            max: sorted[n - 1],
        })
    }
}

/// Every repetition of one workload on one target and image.
#[derive(Debug, Clone)]
pub struct Row {
    /// The image kind.
    pub image: ImageKind,
    /// The workload.
    pub workload: Workload,
    /// The target.
    pub target: Target,
    /// One entry per repetition.
    pub runs: Vec<RunStats>,
}

impl Row {
    /// The spread of one figure over the repetitions.
    pub fn stat(&self, figure: impl Fn(&RunStats) -> Option<f64>) -> Option<Spread> {
        let values: Vec<f64> = self.runs.iter().filter_map(figure).collect();
        Spread::of(&values)
    }

    /// The median of one figure.
    pub fn median(&self, figure: impl Fn(&RunStats) -> Option<f64>) -> Option<f64> {
        self.stat(figure).map(|s| s.median)
    }
}

/// All rows, in report order (image, workload, target).
#[derive(Debug, Clone, Default)]
pub struct Results {
    /// The rows.
    pub rows: Vec<Row>,
}

impl Results {
    /// Adds one run's figures to its row, creating the row on first use.
    pub fn add(&mut self, image: ImageKind, workload: &Workload, target: Target, run: RunStats) {
        match self
            .rows
            .iter_mut()
            .find(|r| r.image == image && r.workload.name == workload.name && r.target == target)
        {
            Some(row) => row.runs.push(run),
            None => self.rows.push(Row {
                image,
                workload: *workload,
                target,
                runs: vec![run],
            }),
        }
    }

    /// Puts the rows in report order: image, then workload as listed, then target.
    pub fn sort(&mut self, workloads: &[Workload]) {
        let position = |w: &Workload| workloads.iter().position(|x| x.name == w.name);
        self.rows
            .sort_by_key(|r| (r.image, position(&r.workload), r.target));
    }

    /// The row of `target` for the same image and workload as `row`.
    pub fn peer(&self, row: &Row, target: Target) -> Option<&Row> {
        self.rows.iter().find(|r| {
            r.image == row.image && r.workload.name == row.workload.name && r.target == target
        })
    }

    /// The best peer back-end ([`Target::PEERS`]) for the same image and workload as `row`:
    /// the one with the highest median IOPS; the earlier in `PEERS` on a tie.
    pub fn best_peer(&self, row: &Row) -> Option<&Row> {
        let mut best: Option<(&Row, f64)> = None;
        for target in Target::PEERS {
            let Some(peer) = self.peer(row, target) else {
                continue;
            };
            let Some(iops) = peer.median(|r| Some(r.iops)) else {
                continue;
            };
            if best.is_none_or(|(_, b)| iops > b) {
                best = Some((peer, iops));
            }
        }
        best.map(|(peer, _)| peer)
    }
}

/// 123456 → "123.5k".
pub fn si(value: f64) -> String {
    if value >= 1e6 {
        format!("{:.2}M", value / 1e6)
    } else if value >= 1e3 {
        format!("{:.1}k", value / 1e3)
    } else {
        format!("{value:.0}")
    }
}

/// A figure with as many decimals as it needs to show three significant digits.
pub fn num(value: f64) -> String {
    if value >= 100.0 {
        format!("{value:.0}")
    } else if value >= 10.0 {
        format!("{value:.1}")
    } else {
        format!("{value:.2}")
    }
}

fn spread_cell(spread: Option<Spread>, format: fn(f64) -> String) -> String {
    match spread {
        None => "—".into(),
        Some(s) if s.min == s.max => format(s.median),
        Some(s) => format!("{} ({}–{})", format(s.median), format(s.min), format(s.max)),
    }
}

fn ratio(ours: Option<f64>, theirs: Option<f64>) -> String {
    match (ours, theirs) {
        (Some(a), Some(b)) if b > 0.0 => format!("{:.2}×", a / b),
        _ => "—".into(),
    }
}

/// The table of measured figures: median (min–max) over the repetitions.
pub fn figures_table(results: &Results) -> String {
    let mut out = String::new();
    out.push_str(
        "| image | workload | target | IOPS | MiB/s | p50 µs | p99 µs | p99.9 µs | back-end CPU \
         µs/I/O | client CPU µs/I/O | back-end wake-ups/I/O | client wake-ups/I/O |\n\
         |---|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|\n",
    );
    for row in &results.rows {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            row.image,
            row.workload.name,
            row.target,
            spread_cell(row.stat(|r| Some(r.iops)), si),
            row.median(|r| Some(r.mib_s)).map_or("—".into(), num),
            spread_cell(row.stat(|r| Some(r.p50)), num),
            spread_cell(row.stat(|r| Some(r.p99)), num),
            spread_cell(row.stat(|r| Some(r.p999)), num),
            spread_cell(row.stat(|r| r.backend_cpu), num),
            spread_cell(row.stat(|r| Some(r.client_cpu)), num),
            row.median(|r| r.backend_wakeups).map_or("—".into(), num),
            row.median(|r| Some(r.client_wakeups))
                .map_or("—".into(), num),
        );
    }
    out
}

/// blkplane against the best peer back-end (of qsd and ch, by median IOPS) of every image and
/// workload: the medians side by side and their ratios.
pub fn best_peer_table(results: &Results) -> String {
    let mut out = String::new();
    out.push_str(
        "| image | workload | best peer | IOPS blkplane / peer | IOPS ÷ peer | p50 µs blkplane / \
         peer | p50 ÷ peer | p99 ÷ peer | back-end CPU µs/I/O blkplane / peer | CPU/I/O ÷ peer \
         | back-end wake-ups/I/O blkplane / peer | other peer: IOPS, p50 µs |\n\
         |---|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|\n",
    );
    for row in results.rows.iter().filter(|r| r.target == Target::Blkplane) {
        let Some(peer) = results.best_peer(row) else {
            continue;
        };
        let pair = |figure: fn(&RunStats) -> Option<f64>, format: fn(f64) -> String| {
            let cell = |r: &Row| r.median(figure).map_or("—".into(), format);
            format!("{} / {}", cell(row), cell(peer))
        };
        let vs =
            |figure: fn(&RunStats) -> Option<f64>| ratio(row.median(figure), peer.median(figure));
        let other = Target::PEERS
            .iter()
            .filter(|&&t| t != peer.target)
            .filter_map(|&t| results.peer(row, t))
            .map(|o| {
                format!(
                    "{} {}, {}",
                    o.target,
                    o.median(|r| Some(r.iops)).map_or("—".into(), si),
                    o.median(|r| Some(r.p50)).map_or("—".into(), num)
                )
            })
            .collect::<Vec<_>>()
            .join("; ");
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            row.image,
            row.workload.name,
            peer.target,
            pair(|r| Some(r.iops), si),
            vs(|r| Some(r.iops)),
            pair(|r| Some(r.p50), num),
            vs(|r| Some(r.p50)),
            vs(|r| Some(r.p99)),
            pair(|r| r.backend_cpu, num),
            vs(|r| r.backend_cpu),
            pair(|r| r.backend_wakeups, num),
            if other.is_empty() {
                "—".into()
            } else {
                other
            },
        );
    }
    out
}

/// The table of ratios (of medians) to the best peer (blkplane's rows) and to the ceiling
/// (every back-end's rows).
pub fn ratios_table(results: &Results) -> String {
    let mut out = String::new();
    out.push_str(
        "| image | workload | target | IOPS ÷ best peer | p50 ÷ best peer | p99 ÷ best peer | \
         p99.9 ÷ best peer | back-end CPU/I/O ÷ best peer | IOPS ÷ ceiling | p50 ÷ ceiling | \
         p99 ÷ ceiling | p99.9 ÷ ceiling | total CPU/I/O ÷ ceiling |\n\
         |---|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|\n",
    );
    for row in results.rows.iter().filter(|r| r.target != Target::Ceiling) {
        let best = results
            .best_peer(row)
            .filter(|_| row.target == Target::Blkplane);
        let ceiling = results.peer(row, Target::Ceiling);
        let vs = |peer: Option<&Row>, figure: fn(&RunStats) -> Option<f64>| {
            ratio(row.median(figure), peer.and_then(|p| p.median(figure)))
        };
        let best_cell = |figure: fn(&RunStats) -> Option<f64>| match best {
            Some(peer) => format!("{} ({})", vs(best, figure), peer.target),
            None => "—".into(),
        };
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            row.image,
            row.workload.name,
            row.target,
            best_cell(|r| Some(r.iops)),
            vs(best, |r| Some(r.p50)),
            vs(best, |r| Some(r.p99)),
            vs(best, |r| Some(r.p999)),
            vs(best, |r| r.backend_cpu),
            vs(ceiling, |r| Some(r.iops)),
            vs(ceiling, |r| Some(r.p50)),
            vs(ceiling, |r| Some(r.p99)),
            vs(ceiling, |r| Some(r.p999)),
            vs(ceiling, |r| Some(r.total_cpu())),
        );
    }
    out
}

/// Where hand-written analysis lives in BENCHMARKS.md: kept across reruns.
pub const NOTES_BEGIN: &str = "<!-- notes: kept when the benchmark rewrites this file -->";
/// The end of the kept section.
pub const NOTES_END: &str = "<!-- end of notes -->";

/// The kept section of an existing BENCHMARKS.md, without its markers.
pub fn existing_notes(old: &str) -> Option<String> {
    let start = old.find(NOTES_BEGIN)? + NOTES_BEGIN.len();
    let end = start + old.get(start..)?.find(NOTES_END)?;
    Some(old.get(start..end)?.trim().to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::WORKLOADS;

    fn run(iops: f64, cpu: f64) -> RunStats {
        RunStats {
            iops,
            mib_s: iops * 4096.0 / 1048576.0,
            p50: 10.0,
            p99: 20.0,
            p999: 30.0,
            backend_cpu: Some(cpu),
            client_cpu: 2.0,
            backend_wakeups: Some(0.5),
            client_wakeups: 1.0,
        }
    }

    #[test]
    fn spreads() {
        assert_eq!(Spread::of(&[]), None);
        let s = Spread::of(&[3.0, 1.0, 2.0]).unwrap();
        assert_eq!((s.median, s.min, s.max), (2.0, 1.0, 3.0));
        assert_eq!(Spread::of(&[1.0, 4.0]).unwrap().median, 2.5);
    }

    #[test]
    fn tables_have_a_row_per_target_and_ratios() {
        let mut results = Results::default();
        let w = &WORKLOADS[0];
        for (iops, cpu) in [(100.0, 4.0), (120.0, 5.0), (110.0, 6.0)] {
            results.add(ImageKind::Shm, w, Target::Qsd, run(iops, cpu));
            results.add(
                ImageKind::Shm,
                w,
                Target::Blkplane,
                run(iops * 2.0, cpu / 2.0),
            );
        }
        results.sort(&WORKLOADS);
        assert_eq!(results.rows[0].target, Target::Blkplane);
        let figures = figures_table(&results);
        assert!(
            figures.contains("| shm | randread-4k-qd1 | qsd | 110 (100–120) |"),
            "{figures}"
        );
        let ratios = ratios_table(&results);
        assert!(
            ratios.contains("| blkplane | 2.00× (qsd) | 1.00× |"),
            "{ratios}"
        );
        assert!(ratios.contains("| 0.50× |"), "{ratios}");
        let best = best_peer_table(&results);
        assert!(
            best.contains("| shm | randread-4k-qd1 | qsd | 220 / 110 | 2.00× |"),
            "{best}"
        );
        assert!(
            best.contains("| 2.50 / 5.00 | 0.50× | 0.50 / 0.50 | — |"),
            "{best}"
        );
    }

    #[test]
    fn the_best_peer_is_the_one_with_more_iops() {
        let mut results = Results::default();
        let w = &WORKLOADS[0];
        let mut slow = run(100.0, 4.0);
        slow.p50 = 40.0;
        for rep in 0..3 {
            results.add(ImageKind::Shm, w, Target::Blkplane, run(300.0, 2.0));
            results.add(ImageKind::Shm, w, Target::Qsd, slow);
            // ch wins on the median although one of its runs is slower than qsd's.
            let ch = if rep == 0 { 50.0 } else { 200.0 };
            results.add(ImageKind::Shm, w, Target::Ch, run(ch, 8.0));
            // On null there is no ch: qsd is the best peer.
            results.add(ImageKind::Null, w, Target::Blkplane, run(300.0, 2.0));
            results.add(ImageKind::Null, w, Target::Qsd, slow);
            // No peer at all on disk.
            results.add(ImageKind::Disk, w, Target::Blkplane, run(300.0, 2.0));
        }
        results.sort(&WORKLOADS);
        let row = |image| {
            results
                .rows
                .iter()
                .find(|r| r.image == image && r.target == Target::Blkplane)
                .unwrap()
        };
        let best = |image| results.best_peer(row(image)).map(|p| p.target);
        assert_eq!(best(ImageKind::Shm), Some(Target::Ch));
        assert_eq!(best(ImageKind::Null), Some(Target::Qsd));
        assert_eq!(best(ImageKind::Disk), None);
        let table = best_peer_table(&results);
        assert!(
            table.contains("| shm | randread-4k-qd1 | ch | 300 / 200 | 1.50× | 10.0 / 10.0 |"),
            "{table}"
        );
        assert!(table.contains("| qsd 100, 40.0 |"), "{table}");
        assert!(
            table.contains(
                "| null | randread-4k-qd1 | qsd | 300 / 100 | 3.00× | 10.0 / 40.0 | 0.25× |"
            ),
            "{table}"
        );
        assert!(!table.contains("| disk |"), "{table}");
        let ratios = ratios_table(&results);
        assert!(
            ratios.contains("| shm | randread-4k-qd1 | blkplane | 1.50× (ch) |"),
            "{ratios}"
        );
        assert!(
            ratios.contains("| shm | randread-4k-qd1 | qsd | — |"),
            "{ratios}"
        );
        assert!(
            ratios.contains("| disk | randread-4k-qd1 | blkplane | — |"),
            "{ratios}"
        );
    }

    #[test]
    fn notes_survive() {
        let old = format!("# x\n{NOTES_BEGIN}\nhand-written\n{NOTES_END}\nrest");
        assert_eq!(existing_notes(&old).as_deref(), Some("hand-written"));
        assert_eq!(existing_notes("nothing"), None);
    }

    #[test]
    fn formatting() {
        assert_eq!(si(123_456.0), "123.5k");
        assert_eq!(si(2_500_000.0), "2.50M");
        assert_eq!(si(999.0), "999");
        assert_eq!(num(1.234), "1.23");
        assert_eq!(num(12.34), "12.3");
        assert_eq!(num(123.4), "123");
    }
}
