//! The chart, written by hand as SVG: for every workload (and image) a group of horizontal
//! bars, one per target, IOPS on the left and CPU µs per I/O on the right. Each group has its
//! own scale (IOPS differ by orders of magnitude between workloads), so bars compare targets
//! within a workload; the numbers are printed beside them.

use std::fmt::Write as _;

use crate::report::{num, si, Results, Row};
use crate::workload::Target;

const WIDTH: f64 = 1180.0;
const LABEL_W: f64 = 190.0;
/// Bar length of the largest IOPS in a group; its label needs room after it.
const IOPS_W: f64 = 360.0;
/// Bar length of the largest CPU figure in a group; likewise.
const CPU_W: f64 = 320.0;
const GAP: f64 = 125.0;
const BAR_H: f64 = 13.0;
const BAR_GAP: f64 = 3.0;
const GROUP_GAP: f64 = 14.0;
const TOP: f64 = 92.0;

fn color(target: Target) -> &'static str {
    match target {
        Target::Blkplane => "#2b6cb0",
        Target::Qsd => "#dd6b20",
        Target::Ch => "#38a169",
        Target::Ceiling => "#718096",
    }
}

/// A lighter shade for the client's share of the CPU bar.
fn light(target: Target) -> &'static str {
    match target {
        Target::Blkplane => "#90cdf4",
        Target::Qsd => "#fbd38d",
        Target::Ch => "#9ae6b4",
        Target::Ceiling => "#cbd5e0",
    }
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// The chart for `results` (rows already in report order); `subtitle` says what was measured.
pub fn chart(results: &Results, subtitle: &str) -> String {
    // Groups of consecutive rows with the same image and workload.
    let mut groups: Vec<Vec<&Row>> = Vec::new();
    for row in &results.rows {
        match groups.last_mut() {
            Some(group)
                if group[0].image == row.image && group[0].workload.name == row.workload.name =>
            {
                group.push(row)
            }
            _ => groups.push(vec![row]),
        }
    }
    let height = TOP
        + groups
            .iter()
            .map(|g| g.len() as f64 * (BAR_H + BAR_GAP) + GROUP_GAP)
            .sum::<f64>()
        + 40.0;
    let iops_x = LABEL_W;
    let cpu_x = LABEL_W + IOPS_W + GAP;
    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height:.0}" viewBox="0 0 {WIDTH} {height:.0}" font-family="sans-serif" font-size="11">"##
    );
    let _ = writeln!(
        svg,
        r##"<rect width="100%" height="100%" fill="white"/>
<text x="10" y="20" font-size="15" font-weight="bold">blkplane vs qemu-storage-daemon vs cloud-hypervisor vhost_user_block (ch) vs io_uring ceiling</text>
<text x="10" y="37" fill="#4a5568">{}</text>"##,
        escape(subtitle)
    );
    // Legend.
    let mut x = 10.0;
    for target in Target::ALL {
        let _ = writeln!(
            svg,
            r##"<rect x="{x}" y="47" width="12" height="12" fill="{}"/><text x="{}" y="57">{}</text>"##,
            color(target),
            x + 16.0,
            target
        );
        x += 80.0;
    }
    let _ = writeln!(
        svg,
        r##"<text x="{x}" y="57" fill="#4a5568">lighter part of a CPU bar: the client's share (the ceiling's client does all of its I/O)</text>"##
    );
    let _ = writeln!(
        svg,
        r##"<text x="{iops_x}" y="82" font-weight="bold">IOPS (median; whisker: min–max of the repetitions)</text>
<text x="{cpu_x}" y="82" font-weight="bold">CPU µs per I/O (back-end + client, medians)</text>"##
    );
    let mut y = TOP;
    for group in &groups {
        let first = group[0];
        let group_h = group.len() as f64 * (BAR_H + BAR_GAP);
        let _ = writeln!(
            svg,
            r##"<text x="10" y="{:.1}" font-weight="bold">{}</text><text x="10" y="{:.1}" fill="#4a5568">{} image</text>"##,
            y + group_h / 2.0 - 2.0,
            escape(first.workload.name),
            y + group_h / 2.0 + 11.0,
            first.image
        );
        let iops_max = group
            .iter()
            .filter_map(|r| r.stat(|s| Some(s.iops)).map(|s| s.max))
            .fold(0.0, f64::max);
        let cpu_max = group
            .iter()
            .filter_map(|r| r.median(|s| Some(s.total_cpu())))
            .fold(0.0, f64::max);
        for row in group {
            let fill = color(row.target);
            if let Some(iops) = row.stat(|s| Some(s.iops)) {
                let scale = |v: f64| {
                    if iops_max > 0.0 {
                        v / iops_max * IOPS_W
                    } else {
                        0.0
                    }
                };
                let w = scale(iops.median);
                let mid = y + BAR_H / 2.0;
                let _ = writeln!(
                    svg,
                    r##"<rect x="{iops_x}" y="{y:.1}" width="{w:.1}" height="{BAR_H}" fill="{fill}"><title>{} {}: {:.0} IOPS</title></rect>
<line x1="{:.1}" x2="{:.1}" y1="{mid:.1}" y2="{mid:.1}" stroke="black"/>
<text x="{:.1}" y="{:.1}">{} {}</text>"##,
                    row.target,
                    escape(row.workload.name),
                    iops.median,
                    iops_x + scale(iops.min),
                    iops_x + scale(iops.max),
                    iops_x + scale(iops.max).max(w) + 4.0,
                    y + BAR_H - 2.5,
                    row.target,
                    si(iops.median)
                );
            }
            let backend = row.median(|s| s.backend_cpu).unwrap_or(0.0);
            let client = row.median(|s| Some(s.client_cpu)).unwrap_or(0.0);
            let scale = |v: f64| {
                if cpu_max > 0.0 {
                    v / cpu_max * CPU_W
                } else {
                    0.0
                }
            };
            let (wb, wc) = (scale(backend), scale(client));
            let label = match row.target {
                Target::Ceiling => format!("client {}", num(client)),
                _ => format!("{} + client {}", num(backend), num(client)),
            };
            let _ = writeln!(
                svg,
                r##"<rect x="{cpu_x}" y="{y:.1}" width="{wb:.1}" height="{BAR_H}" fill="{fill}"><title>{} back-end: {:.2} µs/I/O</title></rect>
<rect x="{:.1}" y="{y:.1}" width="{wc:.1}" height="{BAR_H}" fill="{}"><title>{} client: {:.2} µs/I/O</title></rect>
<text x="{:.1}" y="{:.1}">{}</text>"##,
                row.target,
                backend,
                cpu_x + wb,
                light(row.target),
                row.target,
                client,
                cpu_x + wb + wc + 4.0,
                y + BAR_H - 2.5,
                escape(&label)
            );
            y += BAR_H + BAR_GAP;
        }
        let _ = writeln!(
            svg,
            r##"<line x1="10" x2="{:.0}" y1="{:.1}" y2="{:.1}" stroke="#e2e8f0"/>"##,
            WIDTH - 10.0,
            y + GROUP_GAP / 2.0 - BAR_GAP,
            y + GROUP_GAP / 2.0 - BAR_GAP
        );
        y += GROUP_GAP;
    }
    svg.push_str("</svg>\n");
    svg
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::RunStats;
    use crate::workload::{ImageKind, WORKLOADS};

    #[test]
    fn chart_has_a_bar_pair_per_row_and_escapes_text() {
        let mut results = Results::default();
        let run = RunStats {
            iops: 1000.0,
            mib_s: 3.9,
            p50: 1.0,
            p99: 2.0,
            p999: 3.0,
            backend_cpu: Some(5.0),
            client_cpu: 2.0,
            backend_wakeups: Some(1.0),
            client_wakeups: 1.0,
        };
        for target in Target::ALL {
            results.add(ImageKind::Shm, &WORKLOADS[0], target, run);
        }
        results.add(ImageKind::Null, &WORKLOADS[0], Target::Qsd, run);
        let svg = chart(&results, "a < b & c");
        assert!(svg.starts_with("<svg"));
        assert!(svg.trim_end().ends_with("</svg>"));
        assert!(svg.contains("a &lt; b &amp; c"));
        // Per row: one IOPS bar, two CPU bars; plus the background and a legend square per
        // target.
        let rows = Target::ALL.len() + 1;
        assert_eq!(
            svg.matches("<rect").count(),
            rows * 3 + 1 + Target::ALL.len()
        );
    }
}
