//! What `ferry bench` prints and writes: the table and the JSON rows (`plot` draws the SVG).

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
    /// `gbps` over the same-run `peer_copy`; absent where there is no baseline.
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
    /// `kv-layerwise` only: one layer's transfer alone (submitted with its data ready), p50
    /// microseconds; the target for the row's p50, which is how long after the last layer's
    /// compute ended its last byte landed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) one_layer_us: Option<f64>,
    /// `small-write` only: the path its notifications took and a notification alone.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) notified: Option<Notified>,
}

/// How notifications reached the decode process in a latency row.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub(crate) struct Notified {
    /// The transport whose link carried them (`nvlink`: shared memory; `tcp`).
    pub(crate) through: String,
    /// A notification sent alone, from the call to the decode process holding it, p50 and
    /// p99 microseconds.
    pub(crate) alone_p50_us: f64,
    pub(crate) alone_p99_us: f64,
}

/// A whole run.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub(crate) struct Report {
    pub(crate) prefill_gpu: u32,
    pub(crate) decode_gpu: u32,
    /// Same-run baseline: one in-process copy of a contiguous 1 GiB buffer, GB/s; absent over
    /// RDMA, which has no copy to compare with.
    pub(crate) peer_copy_gbps: Option<f64>,
    /// Over RDMA, the baseline instead: the line rate of this host's fastest active RDMA
    /// port, GB/s, when the port reports it.
    pub(crate) line_rate_gbps: Option<f64>,
    pub(crate) rows: Vec<Row>,
    /// The `--plot` sweep: bandwidth per block size and copy path.
    pub(crate) sweep: Vec<Row>,
}

impl Report {
    /// The human-readable table.
    pub(crate) fn table(&self) -> String {
        let mut out = String::new();
        let _ = match (self.peer_copy_gbps, self.line_rate_gbps) {
            (Some(gbps), _) => writeln!(
                out,
                "peer_copy (GPU{} -> GPU{}, 1 GiB, one process, same run): {gbps:.1} GB/s",
                self.prefill_gpu, self.decode_gpu
            ),
            (None, Some(gbps)) => writeln!(
                out,
                "GPU{} -> GPU{} over RDMA: no copy-engine baseline; the baseline is the fastest \
                 active port's line rate, {gbps:.1} GB/s",
                self.prefill_gpu, self.decode_gpu
            ),
            (None, None) => writeln!(
                out,
                "GPU{} -> GPU{} over RDMA: no copy-engine baseline, and no port reports its \
                 line rate, so baseline and ratio show -",
                self.prefill_gpu, self.decode_gpu
            ),
        };
        let baseline = self
            .peer_copy_gbps
            .or(self.line_rate_gbps)
            .map_or_else(|| "-".to_owned(), |gbps| format!("{gbps:.1}"));
        let _ = writeln!(
            out,
            "{:<24} {:<11} {:<5} {:>8} {:>9} {:>6} {:>9} {:>9} {:>9} {:>9}  verified",
            "workload",
            "path",
            "dir",
            "GB/s",
            "baseline",
            "ratio",
            "p50 us",
            "p99 us",
            "submit us",
            "engine us"
        );
        for row in self.rows.iter().chain(&self.sweep) {
            let gbps = row
                .gbps
                .map_or_else(|| "-".to_owned(), |gbps| format!("{gbps:.1}"));
            let ratio = row
                .ratio
                .map_or_else(|| "-".to_owned(), |ratio| format!("{ratio:.3}"));
            let _ = writeln!(
                out,
                "{:<24} {:<11} {:<5} {:>8} {:>9} {:>6} {:>9.1} {:>9.1} {:>9.1} {:>9.1}  {}",
                row.workload,
                row.path,
                row.direction,
                gbps,
                baseline,
                ratio,
                row.p50_us,
                row.p99_us,
                row.submit_us,
                row.engine_us,
                if row.verified { "yes" } else { "NO" }
            );
        }
        for (row, one_layer) in self
            .rows
            .iter()
            .filter_map(|row| Some((row, row.one_layer_us?)))
        {
            let _ = writeln!(
                out,
                "{}: the last layer's bytes landed {:.1} us (p50) after its compute ended; one \
                 layer alone takes {one_layer:.1} us ({:.2} layers)",
                row.workload,
                row.p50_us,
                row.p50_us / one_layer.max(f64::MIN_POSITIVE)
            );
        }
        for (row, notified) in self
            .rows
            .iter()
            .filter_map(|row| Some((row, row.notified.as_ref()?)))
        {
            let _ = writeln!(
                out,
                "{}: notifications took {}; one sent alone reached the decode process in {:.1} us \
                 (p50), {:.1} us (p99)",
                row.workload, notified.through, notified.alone_p50_us, notified.alone_p99_us
            );
        }
        out
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
pub(crate) mod tests {
    use super::*;
    use crate::bench::workload::size;

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
            one_layer_us: None,
            notified: None,
        }
    }

    /// A run with two rows, one unverified, and a sweep of two paths at two sizes.
    pub(crate) fn report() -> Report {
        Report {
            prefill_gpu: 0,
            decode_gpu: 1,
            peer_copy_gbps: Some(400.0),
            line_rate_gbps: None,
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
    fn without_a_baseline_the_table_shows_rates_and_dashes_for_the_ratio() {
        let mut report = report();
        report.peer_copy_gbps = None;
        report.sweep.clear();
        for row in &mut report.rows {
            row.path = "rdma".into();
            row.ratio = None;
        }
        let table = report.table();
        let lines: Vec<&str> = table.lines().collect();
        assert!(
            lines[0].contains("over RDMA: no copy-engine baseline"),
            "{table}"
        );
        assert!(
            lines[0].contains("no port reports its line rate"),
            "{table}"
        );
        let cells: Vec<&str> = lines[2].split_whitespace().collect();
        assert_eq!(
            cells[..6],
            ["blocks-4K", "rdma", "write", "360.0", "-", "-"]
        );
        let json = serde_json::to_value(&report).unwrap();
        assert_eq!(json["peer_copy_gbps"], serde_json::Value::Null);
        assert_eq!(json["rows"][0]["ratio"], serde_json::Value::Null);
    }

    #[test]
    fn over_rdma_the_baseline_is_the_ports_line_rate_when_one_is_known() {
        let mut report = report();
        report.peer_copy_gbps = None;
        report.line_rate_gbps = Some(50.0);
        let table = report.table();
        let lines: Vec<&str> = table.lines().collect();
        assert!(
            lines[0].contains("fastest active port's line rate, 50.0 GB/s"),
            "{table}"
        );
        let cells: Vec<&str> = lines[2].split_whitespace().collect();
        assert_eq!(cells[4], "50.0", "{table}");
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
