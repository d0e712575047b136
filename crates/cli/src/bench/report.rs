//! What `ferry bench` prints and writes: the table and the JSON rows (`plot` draws the SVG).

use ferry::cuda::GemmRate;
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
    /// `kv-layerwise` only: how long after the host released the last layer's compute (its
    /// gate write returned) the last byte landed, p50 microseconds: the row's p50 plus the
    /// time the GPU took to notice the release.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) released_us: Option<f64>,
    /// `small-write` only: the path its notifications took and a notification alone.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) notified: Option<Notified>,
    /// The copy kernel's multiprocessor cap (`--kernel-max-sms`); `null` for none (all).
    pub(crate) kernel_max_sms: Option<u32>,
    /// `--contend` only: the GEMM on the prefill GPU alone and beside the row's rounds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) contention: Option<Contention>,
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

/// What a bf16 GEMM on the prefill GPU lost while a row's timed rounds ran (`--contend`).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub(crate) struct Contention {
    /// The matrices are `gemm_n x gemm_n`.
    pub(crate) gemm_n: usize,
    /// TFLOP/s of the GEMM alone, measured just before the row.
    pub(crate) alone_tflops: f64,
    /// TFLOP/s of the GEMM while the row's rounds ran.
    pub(crate) during_tflops: f64,
    /// Multiplications that ended inside each window.
    pub(crate) alone_gemms: u64,
    pub(crate) during_gemms: u64,
    /// How much slower the GEMM ran beside the transfers, percent of its rate alone;
    /// absent when it did not run alone.
    pub(crate) slowdown_pct: Option<f64>,
}

impl Contention {
    /// The figures of a GEMM that ran at `alone` by itself and at `during` beside a row.
    pub(crate) fn new(alone: &GemmRate, during: &GemmRate) -> Contention {
        let (alone_tflops, during_tflops) = (alone.tflops(), during.tflops());
        Contention {
            gemm_n: alone.n,
            alone_tflops,
            during_tflops,
            alone_gemms: alone.multiplications,
            during_gemms: during.multiplications,
            slowdown_pct: slowdown_percent(alone_tflops, during_tflops),
        }
    }
}

/// How much slower `during` is than `alone`, percent of `alone` (negative when faster); `None`
/// when `alone` is not a positive rate.
pub(crate) fn slowdown_percent(alone: f64, during: f64) -> Option<f64> {
    (alone > 0.0).then(|| (1.0 - during / alone) * 100.0)
}

/// A multiprocessor cap as shown: the number, or `all` for none.
pub(crate) fn sms(cap: Option<u32>) -> String {
    cap.map_or_else(|| "all".to_owned(), |cap| cap.to_string())
}

/// A whole run.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub(crate) struct Report {
    /// Whether both sides moved host memory (`--host`), not GPU memory; the GPU numbers
    /// are then unused and the baseline is an in-process `memcpy`.
    pub(crate) host_memory: bool,
    pub(crate) prefill_gpu: u32,
    pub(crate) decode_gpu: u32,
    /// Same-run baseline: one in-process copy of a contiguous 1 GiB buffer, GB/s; absent over
    /// RDMA, which has no copy to compare with.
    pub(crate) peer_copy_gbps: Option<f64>,
    /// Over RDMA, the baseline instead: the line rate of this host's fastest active RDMA
    /// port, GB/s, when the port reports it.
    pub(crate) line_rate_gbps: Option<f64>,
    /// Whether each bandwidth round's request carried a notification (`--notify-requests`).
    pub(crate) notify_requests: bool,
    /// Whether the decode process's `cudaMalloc` memory went through its staging buffers
    /// (`--stage-cuda-malloc`).
    pub(crate) stage_cuda_malloc: bool,
    /// With `stage_cuda_malloc`, the staging asked for (`--staging-bytes`); the decode
    /// process gives 2 MiB to 1 GiB of it.
    pub(crate) staging_bytes: Option<u64>,
    /// With `stage_cuda_malloc`, the slots asked for (`--staging-slots`); `None` for the
    /// engine's choice.
    pub(crate) staging_slots: Option<u32>,
    pub(crate) rows: Vec<Row>,
    /// The `--plot` sweep: bandwidth per block size and copy path.
    pub(crate) sweep: Vec<Row>,
}

impl Report {
    /// The human-readable table.
    pub(crate) fn table(&self) -> String {
        let mut out = String::new();
        let _ = match (self.peer_copy_gbps, self.line_rate_gbps) {
            (Some(gbps), _) if self.host_memory => writeln!(
                out,
                "memcpy (host memory, 1 GiB, one process, same run): {gbps:.1} GB/s; host memory \
                 moves over TCP between the two processes"
            ),
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
        if self.stage_cuda_malloc {
            let slots = self.staging_slots.map_or_else(
                || "the engine's choice of".to_owned(),
                |slots| slots.to_string(),
            );
            let _ = writeln!(
                out,
                "the decode process's cudaMalloc memory went through the staging buffers its \
                 engine hands over by file descriptor (one more copy, on its GPU): {} MiB asked, \
                 {slots} slots",
                self.staging_bytes.unwrap_or(0) >> 20
            );
        }
        if self.notify_requests {
            let _ = writeln!(
                out,
                "each request of the bandwidth rows carries a notification; its time includes \
                 the decode process accepting it"
            );
        }
        let baseline = self
            .peer_copy_gbps
            .or(self.line_rate_gbps)
            .map_or_else(|| "-".to_owned(), |gbps| format!("{gbps:.1}"));
        let _ = writeln!(
            out,
            "{:<24} {:<11} {:>4} {:<5} {:>8} {:>9} {:>6} {:>9} {:>9} {:>9} {:>9}  verified",
            "workload",
            "path",
            "SMs",
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
                "{:<24} {:<11} {:>4} {:<5} {:>8} {:>9} {:>6} {:>9.1} {:>9.1} {:>9.1} {:>9.1}  {}",
                row.workload,
                row.path,
                sms(row.kernel_max_sms),
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
            let released = row
                .released_us
                .map(|released| format!(" ({released:.1} us after the host released it)"))
                .unwrap_or_default();
            let _ = writeln!(
                out,
                "{}: the last layer's bytes landed {:.1} us (p50) after its compute ended{released}; \
                 one layer alone takes {one_layer:.1} us ({:.2} layers)",
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
        self.contention_table(&mut out);
        out
    }

    /// `--contend`'s rows: per cap, the transfer's GB/s and what the GEMM lost meanwhile.
    fn contention_table(&self, out: &mut String) {
        let rows: Vec<(&Row, &Contention)> = self
            .rows
            .iter()
            .filter_map(|row| Some((row, row.contention.as_ref()?)))
            .collect();
        let Some((_, first)) = rows.first() else {
            return;
        };
        let _ = writeln!(
            out,
            "bf16 GEMM {n} x {n} on GPU{}: TFLOP/s alone (just before each row) and while the \
             row's rounds ran",
            self.prefill_gpu,
            n = first.gemm_n
        );
        let _ = writeln!(
            out,
            "{:<24} {:<11} {:>4} {:>8} {:>13} {:>14} {:>10}",
            "workload", "path", "SMs", "GB/s", "GEMM alone", "GEMM beside", "slowdown"
        );
        for (row, contention) in rows {
            let gbps = row
                .gbps
                .map_or_else(|| "-".to_owned(), |gbps| format!("{gbps:.1}"));
            let slowdown = contention
                .slowdown_pct
                .map_or_else(|| "-".to_owned(), |pct| format!("{pct:.1}%"));
            let _ = writeln!(
                out,
                "{:<24} {:<11} {:>4} {:>8} {:>13.1} {:>14.1} {:>10}",
                row.workload,
                row.path,
                sms(row.kernel_max_sms),
                gbps,
                contention.alone_tflops,
                contention.during_tflops,
                slowdown
            );
        }
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
            released_us: None,
            notified: None,
            kernel_max_sms: None,
            contention: None,
        }
    }

    /// A run with two rows, one unverified, and a sweep of two paths at two sizes.
    pub(crate) fn report() -> Report {
        Report {
            host_memory: false,
            prefill_gpu: 0,
            decode_gpu: 1,
            peer_copy_gbps: Some(400.0),
            line_rate_gbps: None,
            notify_requests: false,
            stage_cuda_malloc: false,
            staging_bytes: None,
            staging_slots: None,
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
            cells[..7],
            ["blocks-4K", "rdma", "all", "write", "360.0", "-", "-"]
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
        assert_eq!(cells[5], "50.0", "{table}");
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
    fn contended_rows_show_their_cap_and_the_gemm_slowdown_in_the_table_and_json() {
        let mut report = report();
        report.sweep.clear();
        let alone = GemmRate {
            n: 4096,
            multiplications: 400,
            seconds: 0.5,
        };
        let during = GemmRate {
            multiplications: 340,
            ..alone
        };
        report.rows[0].kernel_max_sms = Some(16);
        report.rows[0].contention = Some(Contention::new(&alone, &during));
        let table = report.table();
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(lines[2].split_whitespace().nth(2), Some("16"), "{table}");
        assert_eq!(lines[3].split_whitespace().nth(2), Some("all"), "{table}");
        assert!(
            lines[4].starts_with("bf16 GEMM 4096 x 4096 on GPU0"),
            "{table}"
        );
        let cells: Vec<&str> = lines[6].split_whitespace().collect();
        assert_eq!(
            cells,
            ["blocks-4K", "auto", "16", "360.0", "110.0", "93.5", "15.0%"],
            "{table}"
        );
        assert_eq!(lines.len(), 7, "only contended rows are listed: {table}");
        let json = serde_json::to_value(&report).unwrap();
        assert_eq!(json["rows"][0]["kernel_max_sms"], 16);
        assert_eq!(json["rows"][1]["kernel_max_sms"], serde_json::Value::Null);
        let contention = &json["rows"][0]["contention"];
        assert_eq!(contention["gemm_n"], 4096);
        assert_eq!(contention["alone_gemms"], 400);
        assert_eq!(contention["during_gemms"], 340);
        let slowdown = contention["slowdown_pct"].as_f64().unwrap();
        assert!((slowdown - 15.0).abs() < 1e-9, "{slowdown}");
        assert!(json["rows"][1].get("contention").is_none());
    }

    #[test]
    fn slowdown_is_the_share_of_the_rate_alone_that_was_lost() {
        assert_eq!(slowdown_percent(200.0, 150.0), Some(25.0));
        assert_eq!(slowdown_percent(200.0, 200.0), Some(0.0));
        assert_eq!(slowdown_percent(100.0, 110.0).map(f64::round), Some(-10.0));
        assert_eq!(slowdown_percent(0.0, 10.0), None);
    }

    #[test]
    fn quantiles_use_the_nearest_rank() {
        let samples: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(quantile(&samples, 0.5), 50.0);
        assert_eq!(quantile(&samples, 0.99), 99.0);
        assert_eq!(quantile(&[], 0.5), 0.0);
    }
}
