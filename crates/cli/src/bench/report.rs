//! What `ferry bench` prints and writes: the table, the JSON rows, the SVG plot.

use super::workload::size;
use std::fmt::Write as _;

/// One measured row.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub(crate) struct Row {
    pub(crate) workload: String,
    /// Copy path asked for (`auto`, `kernel`, `copy-engine`).
    pub(crate) path: String,
    /// `write` or `read`, seen from the prefill process.
    pub(crate) direction: String,
    /// Size of the blocks (the largest, where they differ).
    pub(crate) block_bytes: u64,
    /// Bytes one round moves.
    pub(crate) bytes: u64,
    /// Median bandwidth in GB/s (decimal); absent for latency-only workloads.
    pub(crate) gbps: Option<f64>,
    /// `gbps` over the same-run `peer_copy`.
    pub(crate) ratio: Option<f64>,
    /// Latency of one round, microseconds.
    pub(crate) p50_us: f64,
    pub(crate) p99_us: f64,
    /// Median host time to build and submit one round's batch, microseconds.
    pub(crate) submit_us: f64,
    /// Median time inside the engine, from routing to the last byte, microseconds (the rest
    /// of a round's latency is handing the batch over and the result back).
    pub(crate) engine_us: f64,
    /// Whether every destination byte matched its source after the rounds.
    pub(crate) verified: bool,
}

/// A whole run.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub(crate) struct Report {
    pub(crate) prefill_gpu: u32,
    pub(crate) decode_gpu: u32,
    /// Same-run baseline: one in-process copy of a contiguous 1 GiB buffer, GB/s.
    pub(crate) peer_copy_gbps: f64,
    pub(crate) rows: Vec<Row>,
    /// The `--plot` sweep: bandwidth per block size and copy path.
    pub(crate) sweep: Vec<Row>,
}

impl Report {
    /// The human-readable table.
    pub(crate) fn table(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "peer_copy (GPU{} -> GPU{}, 1 GiB, one process, same run): {:.1} GB/s",
            self.prefill_gpu, self.decode_gpu, self.peer_copy_gbps
        );
        let _ = writeln!(
            out,
            "{:<24} {:<11} {:<5} {:>8} {:>9} {:>6} {:>9} {:>9} {:>9} {:>9}  verified",
            "workload",
            "path",
            "dir",
            "GB/s",
            "peer_copy",
            "ratio",
            "p50 us",
            "p99 us",
            "submit us",
            "engine us"
        );
        for row in self.rows.iter().chain(&self.sweep) {
            let (gbps, ratio) = match (row.gbps, row.ratio) {
                (Some(gbps), Some(ratio)) => (format!("{gbps:.1}"), format!("{ratio:.3}")),
                _ => ("-".into(), "-".into()),
            };
            let _ = writeln!(
                out,
                "{:<24} {:<11} {:<5} {:>8} {:>9.1} {:>6} {:>9.1} {:>9.1} {:>9.1} {:>9.1}  {}",
                row.workload,
                row.path,
                row.direction,
                gbps,
                self.peer_copy_gbps,
                ratio,
                row.p50_us,
                row.p99_us,
                row.submit_us,
                row.engine_us,
                if row.verified { "yes" } else { "NO" }
            );
        }
        out
    }

    /// Bandwidth against block size, one line per copy path, the baseline as a dashed line.
    pub(crate) fn svg(&self) -> String {
        const WIDTH: f64 = 760.0;
        const HEIGHT: f64 = 440.0;
        const LEFT: f64 = 70.0;
        const RIGHT: f64 = 170.0;
        const TOP: f64 = 40.0;
        const BOTTOM: f64 = 60.0;
        let points: Vec<&Row> = self.sweep.iter().filter(|row| row.gbps.is_some()).collect();
        let sizes: Vec<f64> = points
            .iter()
            .map(|row| (row.block_bytes.max(1) as f64).log2())
            .collect();
        let (low, high) = sizes
            .iter()
            .fold((f64::MAX, f64::MIN), |(lo, hi), &x| (lo.min(x), hi.max(x)));
        let (low, high) = if low < high {
            (low, high)
        } else {
            (10.0, 30.0)
        };
        let top = points
            .iter()
            .filter_map(|row| row.gbps)
            .fold(self.peer_copy_gbps, f64::max)
            * 1.1;
        let top = if top > 0.0 { top } else { 1.0 };
        let plot_w = WIDTH - LEFT - RIGHT;
        let plot_h = HEIGHT - TOP - BOTTOM;
        let x = |log2: f64| LEFT + (log2 - low) / (high - low) * plot_w;
        let y = |gbps: f64| TOP + plot_h - gbps / top * plot_h;
        let mut svg = String::new();
        let _ = writeln!(
            svg,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" font-family="sans-serif" font-size="12">"#
        );
        let _ = writeln!(svg, r#"<rect width="100%" height="100%" fill="white"/>"#);
        let _ = writeln!(
            svg,
            r#"<text x="{LEFT}" y="22" font-size="14">ferry bench: GPU{} -> GPU{} across processes, scattered blocks ({} per point)</text>"#,
            self.prefill_gpu,
            self.decode_gpu,
            size(super::workload::SWEEP_BYTES)
        );
        let _ = writeln!(
            svg,
            r#"<line x1="{LEFT}" y1="{}" x2="{}" y2="{}" stroke="black"/><line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{}" stroke="black"/>"#,
            TOP + plot_h,
            LEFT + plot_w,
            TOP + plot_h,
            TOP + plot_h
        );
        let mut log2 = low.ceil();
        while log2 <= high {
            let _ = writeln!(
                svg,
                r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
                x(log2),
                TOP + plot_h + 18.0,
                size(2f64.powf(log2) as u64)
            );
            log2 += 2.0;
        }
        for step in 0..=5 {
            let gbps = top / 5.0 * f64::from(step);
            let _ = writeln!(
                svg,
                r##"<text x="{:.1}" y="{:.1}" text-anchor="end">{gbps:.0}</text><line x1="{LEFT}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="#ddd"/>"##,
                LEFT - 6.0,
                y(gbps) + 4.0,
                y(gbps),
                LEFT + plot_w,
                y(gbps)
            );
        }
        let _ = writeln!(
            svg,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">block size</text><text x="18" y="{:.1}" transform="rotate(-90 18 {:.1})" text-anchor="middle">GB/s</text>"#,
            LEFT + plot_w / 2.0,
            HEIGHT - 18.0,
            TOP + plot_h / 2.0,
            TOP + plot_h / 2.0
        );
        let _ = writeln!(
            svg,
            r##"<line x1="{LEFT}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="#555" stroke-dasharray="6 4"/>"##,
            y(self.peer_copy_gbps),
            LEFT + plot_w,
            y(self.peer_copy_gbps)
        );
        let mut legend = vec![("#555", format!("peer_copy {:.0} GB/s", self.peer_copy_gbps))];
        let colors = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"];
        let mut paths: Vec<&str> = Vec::new();
        for row in &points {
            if !paths.contains(&row.path.as_str()) {
                paths.push(&row.path);
            }
        }
        for (path, color) in paths.iter().zip(colors.iter().cycle()) {
            let line: Vec<String> = points
                .iter()
                .filter(|row| row.path == *path)
                .filter_map(|row| {
                    let gbps = row.gbps?;
                    Some(format!(
                        "{:.1},{:.1}",
                        x((row.block_bytes.max(1) as f64).log2()),
                        y(gbps)
                    ))
                })
                .collect();
            let _ = writeln!(
                svg,
                r#"<polyline points="{}" fill="none" stroke="{color}" stroke-width="2"/>"#,
                line.join(" ")
            );
            for point in &line {
                let (px, py) = point.split_once(',').unwrap_or(("0", "0"));
                let _ = writeln!(svg, r#"<circle cx="{px}" cy="{py}" r="3" fill="{color}"/>"#);
            }
            legend.push((color, (*path).to_owned()));
        }
        for (index, (color, label)) in legend.iter().enumerate() {
            let ly = TOP + 10.0 + index as f64 * 20.0;
            let _ = writeln!(
                svg,
                r#"<line x1="{:.1}" y1="{ly:.1}" x2="{:.1}" y2="{ly:.1}" stroke="{color}" stroke-width="2"/><text x="{:.1}" y="{:.1}">{label}</text>"#,
                LEFT + plot_w + 12.0,
                LEFT + plot_w + 36.0,
                LEFT + plot_w + 42.0,
                ly + 4.0
            );
        }
        svg.push_str("</svg>\n");
        svg
    }
}

/// The `q` quantile (0..=1) of `samples`, nearest rank; 0 for none.
pub(crate) fn quantile(samples: &[f64], q: f64) -> f64 {
    if samples.is_empty() {
        return 0.0;
    }
    let mut sorted = samples.to_vec();
    sorted.sort_by(f64::total_cmp);
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(path: &str, block_bytes: u64, gbps: Option<f64>, verified: bool) -> Row {
        Row {
            workload: format!("blocks-{}", size(block_bytes)),
            path: path.into(),
            direction: "write".into(),
            block_bytes,
            bytes: 1 << 28,
            gbps,
            ratio: gbps.map(|gbps| gbps / 400.0),
            p50_us: 700.0,
            p99_us: 900.0,
            submit_us: 12.0,
            engine_us: 650.0,
            verified,
        }
    }

    fn report() -> Report {
        Report {
            prefill_gpu: 0,
            decode_gpu: 1,
            peer_copy_gbps: 400.0,
            rows: vec![
                row("auto", 4096, Some(360.0), true),
                row("auto", 4096, None, false),
            ],
            sweep: vec![
                row("kernel", 4096, Some(350.0), true),
                row("kernel", 1 << 20, Some(370.0), true),
                row("copy-engine", 4096, Some(20.0), true),
                row("copy-engine", 1 << 20, Some(200.0), true),
            ],
        }
    }

    #[test]
    fn the_table_shows_ratios_to_the_baseline_and_flags_unverified_rows() {
        let table = report().table();
        assert!(table.contains("400.0 GB/s"), "{table}");
        assert!(table.contains("360.0"), "{table}");
        assert!(table.contains("0.900"), "{table}");
        assert_eq!(table.matches("  NO").count(), 1, "{table}");
        assert_eq!(table.lines().count(), 2 + 2 + 4);
    }

    #[test]
    fn the_plot_has_one_line_per_path_and_the_baseline() {
        let svg = report().svg();
        assert!(svg.starts_with("<svg"));
        assert!(svg.trim_end().ends_with("</svg>"));
        assert_eq!(svg.matches("<polyline").count(), 2);
        assert_eq!(svg.matches("stroke-dasharray").count(), 1);
        assert!(svg.contains(">kernel<") && svg.contains(">copy-engine<"));
        assert!(svg.contains(">4K<") && svg.contains(">1M<"));
    }

    #[test]
    fn rows_serialise_to_json_with_every_field() {
        let json = serde_json::to_value(report()).unwrap();
        assert_eq!(json["peer_copy_gbps"], 400.0);
        assert_eq!(json["rows"][0]["ratio"], 0.9);
        assert_eq!(json["rows"][1]["gbps"], serde_json::Value::Null);
        assert_eq!(json["sweep"].as_array().map(Vec::len), Some(4));
    }

    #[test]
    fn quantiles_use_the_nearest_rank() {
        let samples: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(quantile(&samples, 0.5), 50.0);
        assert_eq!(quantile(&samples, 0.99), 99.0);
        assert_eq!(quantile(&[], 0.5), 0.0);
    }
}
