//! `ferry bench --prefill-gpus A,B.. --decode-gpus X,Y..`: the `kv-llama70b-4k` request split
//! over tensor-parallel ranks, one process per rank. Prefill rank p (on the p-th prefill GPU)
//! writes every decode rank that holds some of its KV heads the slice of each block those heads
//! occupy, all ranks starting at the same instant. Reports aggregate GB/s and per-pair GB/s
//! against same-run `peer_copy` baselines (each pair alone, and all pairs at once), and checks
//! every byte of every slice that landed.

use super::rank::Sharded;
use super::report::quantile;
use super::workload::{llama, LLAMA_BLOCK_BYTES};
use super::{median, now_ns, peer_copy, progress_bar, BoxError, Options, GIB};
use crate::serve_child::ServeChild;
use ferry::tp::{HeadSlice, HeadSplit};
use ferry::CopyPath;
use std::collections::hash_map::{Entry, HashMap};
use std::fmt::Write as _;
use std::io::{BufRead, BufReader, Lines, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::Duration;

/// KV heads of Llama-3-70B.
const HEADS: u32 = 8;

/// How far ahead of now a round is scheduled, so every rank is waiting when it starts. Kept
/// short, as rounds follow each other about as closely as the single-pair rows' do: after an
/// idle gap of 20 ms the same rounds measured 2-4% slower.
const ROUND_LEAD: Duration = Duration::from_millis(2);

/// A rank that starts this long after its round's instant counts the round as late.
const LATE: Duration = Duration::from_micros(200);

/// The head split of `kv-llama70b-4k` (8 heads of 4 KiB per 32 KiB block) over the two sides.
pub(crate) fn split(prefill_tp: u32, decode_tp: u32) -> HeadSplit {
    HeadSplit {
        heads: HEADS,
        head_bytes: LLAMA_BLOCK_BYTES / u64::from(HEADS),
        prefill_tp,
        decode_tp,
    }
}

/// One (prefill rank, decode rank) pair's figures.
#[derive(Debug, Clone, serde::Serialize)]
pub(crate) struct PairRow {
    /// The sending rank and its GPU.
    pub(crate) prefill_rank: u32,
    pub(crate) prefill_gpu: u32,
    /// The receiving rank and its GPU.
    pub(crate) decode_rank: u32,
    pub(crate) decode_gpu: u32,
    /// KV heads the pair moves.
    pub(crate) heads: u32,
    /// Bytes one request moves over this pair.
    pub(crate) bytes: u64,
    /// Median GB/s, from its prefill rank's start to this pair's completion.
    pub(crate) gbps: f64,
    /// Median GB/s with only this pair's prefill rank writing (its other pairs too): what
    /// the pair gets through ferry without the other ranks competing.
    pub(crate) rank_alone_gbps: f64,
    /// Same-run `peer_copy` of this GPU pair alone, GB/s.
    pub(crate) peer_copy_gbps: f64,
}

/// One copy path's run.
#[derive(Debug, Clone, serde::Serialize)]
pub(crate) struct PairsRun {
    /// Copy path asked for.
    pub(crate) path: String,
    /// Median over rounds of all bytes over the time from the first rank's start to the last
    /// pair's completion, GB/s.
    pub(crate) aggregate_gbps: f64,
    /// 10th percentile of the same.
    pub(crate) aggregate_p10_gbps: f64,
    /// 90th percentile of the same.
    pub(crate) aggregate_p90_gbps: f64,
    /// `aggregate_gbps` over the sum of the pairs' `peer_copy` baselines.
    pub(crate) ratio_to_sum: f64,
    /// `aggregate_gbps` over the all-pairs-at-once `peer_copy`.
    pub(crate) ratio_to_all_at_once: f64,
    /// Timed rounds in which some rank started more than [`LATE`] after the scheduled
    /// instant (its figures still count; many such rounds mean the ranks did not start
    /// together).
    pub(crate) late_rounds: usize,
    /// Every pair's figures.
    pub(crate) pairs: Vec<PairRow>,
    /// Whether every byte of every slice matched what its prefill rank sent.
    pub(crate) verified: bool,
}

/// The whole multi-pair run.
#[derive(Debug, Clone, serde::Serialize)]
pub(crate) struct PairsReport {
    /// The workload and the two TP degrees.
    pub(crate) workload: String,
    /// GPU of each prefill rank, in rank order.
    pub(crate) prefill_gpus: Vec<u32>,
    /// GPU of each decode rank, in rank order.
    pub(crate) decode_gpus: Vec<u32>,
    /// Always `write`: prefill ranks push.
    pub(crate) direction: String,
    /// Bytes one request moves over all pairs.
    pub(crate) bytes: u64,
    /// Sum of the pairs' `peer_copy` baselines, each pair alone, GB/s.
    pub(crate) peer_copy_sum_gbps: f64,
    /// `peer_copy` of every pair at once (1 GiB each, one stream per pair), aggregate GB/s.
    pub(crate) peer_copy_all_at_once_gbps: f64,
    /// One run per copy path.
    pub(crate) runs: Vec<PairsRun>,
}

/// Runs the multi-pair mode; `Ok(false)` when some bytes did not verify.
pub(crate) fn run(options: &Options) -> Result<bool, BoxError> {
    let (prefill_gpus, decode_gpus) = (&options.prefill_gpus, &options.decode_gpus);
    let sharded = Sharded {
        split: split(prefill_gpus.len() as u32, decode_gpus.len() as u32),
        paged: llama(options.seed),
    };
    sharded.split.validate()?;
    let slices = sharded.split.slices();
    let gpu_pairs: Vec<(u32, u32)> = slices
        .iter()
        .map(|slice| {
            (
                prefill_gpus[slice.prefill_rank as usize],
                decode_gpus[slice.decode_rank as usize],
            )
        })
        .collect();
    let progress = progress_bar(options.paths.len() as u64 + 1);
    progress.set_message("peer_copy baselines");
    let mut alone: HashMap<(u32, u32), f64> = HashMap::new();
    for &(from, to) in &gpu_pairs {
        if let Entry::Vacant(slot) = alone.entry((from, to)) {
            slot.insert(peer_copy(&[(from, to)], options.rounds())?);
        }
    }
    let all_at_once = peer_copy(&gpu_pairs, options.rounds())?;
    let sum: f64 = gpu_pairs.iter().map(|pair| alone[pair]).sum();
    progress.inc(1);
    progress.set_message(format!(
        "starting {} decode processes ({:.1} GiB each)",
        decode_gpus.len(),
        sharded.decode_area() as f64 / GIB as f64
    ));
    let decoders = decode_gpus
        .iter()
        .map(|&gpu| {
            ServeChild::start(
                sharded.decode_area(),
                Some(gpu),
                false,
                true,
                &options.metadata,
                &options.secret,
                &options.socket_dir,
            )
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mut report = PairsReport {
        workload: format!(
            "kv-llama70b-4k TP{}->TP{}",
            prefill_gpus.len(),
            decode_gpus.len()
        ),
        prefill_gpus: prefill_gpus.clone(),
        decode_gpus: decode_gpus.clone(),
        direction: "write".into(),
        bytes: slices
            .iter()
            .map(|slice| sharded.slice_request_bytes(slice))
            .sum(),
        peer_copy_sum_gbps: sum,
        peer_copy_all_at_once_gbps: all_at_once,
        runs: Vec::new(),
    };
    for (index, &path) in options.paths.iter().enumerate() {
        progress.set_message(format!(
            "{} ({path}): starting {} prefill processes",
            report.workload,
            prefill_gpus.len()
        ));
        let mut ranks = prefill_gpus
            .iter()
            .enumerate()
            .map(|(rank, &gpu)| {
                RankChild::start(options, rank as u32, gpu, &decoders, path, index as u64)
            })
            .collect::<Result<Vec<_>, _>>()?;
        for rank in &mut ranks {
            rank.expect("ready")?;
        }
        progress.set_message(format!("{} ({path})", report.workload));
        let run = measure(options, &mut ranks, &sharded, &slices, path)?;
        report.runs.push(finish(
            run,
            &sharded,
            &slices,
            &gpu_pairs,
            &alone,
            sum,
            all_at_once,
        ));
        progress.inc(1);
    }
    progress.finish_and_clear();
    print!("{}", table(&report));
    if let Some(path) = &options.json {
        std::fs::write(path, serde_json::to_string_pretty(&report)? + "\n")?;
        println!("wrote {}", path.display());
    }
    Ok(report.runs.iter().all(|run| run.verified))
}

/// What the rounds of one path measured, before the baselines are put beside it.
struct Measured {
    path: CopyPath,
    aggregates: Vec<f64>,
    /// GB/s per round, by slice.
    pairs: Vec<Vec<f64>>,
    /// The same with the slice's prefill rank writing alone.
    rank_alone: Vec<Vec<f64>>,
    late_rounds: usize,
    verified: bool,
}

fn measure(
    options: &Options,
    ranks: &mut [RankChild],
    sharded: &Sharded,
    slices: &[HeadSlice],
    path: CopyPath,
) -> Result<Measured, BoxError> {
    let mut measured = Measured {
        path,
        aggregates: Vec::new(),
        pairs: vec![Vec::new(); slices.len()],
        rank_alone: vec![Vec::new(); slices.len()],
        late_rounds: 0,
        verified: true,
    };
    let everyone: Vec<usize> = (0..ranks.len()).collect();
    for round in 0..options.rounds() + 2 {
        let figures = together(ranks, &everyone, sharded, slices)?;
        if round >= 2 {
            measured.late_rounds += usize::from(figures.late);
            measured.aggregates.push(figures.aggregate);
            for (samples, sample) in measured.pairs.iter_mut().zip(figures.pairs) {
                samples.extend(sample);
            }
        }
    }
    for rank in 0..ranks.len() {
        for round in 0..options.rounds() + 2 {
            let figures = together(ranks, &[rank], sharded, slices)?;
            if round >= 2 {
                for (samples, sample) in measured.rank_alone.iter_mut().zip(figures.pairs) {
                    samples.extend(sample);
                }
            }
        }
    }
    for rank in ranks.iter_mut() {
        rank.say("verify")?;
    }
    for (prefill_rank, rank) in ranks.iter_mut().enumerate() {
        let verdict = rank.expect("verified")?;
        if verdict != "verified yes" {
            eprintln!("prefill rank {prefill_rank}: {verdict}");
            measured.verified = false;
        }
    }
    Ok(measured)
}

/// What one round measured.
struct RoundFigures {
    /// All bytes over the first start to the last completion, GB/s.
    aggregate: f64,
    /// GB/s by slice, for the slices of the ranks that took part.
    pairs: Vec<Option<f64>>,
    /// Whether some rank started more than [`LATE`] after the scheduled instant.
    late: bool,
}

/// One round in which the prefill ranks `which` all start writing at the same instant.
fn together(
    ranks: &mut [RankChild],
    which: &[usize],
    sharded: &Sharded,
    slices: &[HeadSlice],
) -> Result<RoundFigures, BoxError> {
    let at = now_ns() + ROUND_LEAD.as_nanos() as u64;
    for &rank in which {
        ranks[rank].say(&format!("round {at}"))?;
    }
    let (mut first, mut last, mut bytes) = (u64::MAX, 0u64, 0u64);
    let mut pairs = vec![None; slices.len()];
    let mut late = false;
    for &prefill_rank in which {
        let line = ranks[prefill_rank].expect("done")?;
        let mut words = line.split(' ').skip(1);
        let start: u64 = words
            .next()
            .ok_or("a round answer without its start")?
            .parse()?;
        first = first.min(start);
        late |= start > at + LATE.as_nanos() as u64;
        for word in words {
            let fields: Vec<u64> = word.split(':').map(str::parse).collect::<Result<_, _>>()?;
            let [decode_rank, moved, end] = fields[..] else {
                return Err(format!("unexpected pair figures {word:?}").into());
            };
            let slice = slices
                .iter()
                .position(|slice| {
                    slice.prefill_rank as usize == prefill_rank
                        && u64::from(slice.decode_rank) == decode_rank
                })
                .ok_or("a rank reported a pair it does not have")?;
            if moved != sharded.slice_request_bytes(&slices[slice]) {
                return Err(format!("pair {word} moved an unexpected number of bytes").into());
            }
            pairs[slice] = Some(moved as f64 / (end.saturating_sub(start).max(1) as f64));
            last = last.max(end);
            bytes += moved;
        }
    }
    Ok(RoundFigures {
        aggregate: bytes as f64 / (last.saturating_sub(first).max(1) as f64),
        pairs,
        late,
    })
}

fn finish(
    measured: Measured,
    sharded: &Sharded,
    slices: &[HeadSlice],
    gpu_pairs: &[(u32, u32)],
    alone: &HashMap<(u32, u32), f64>,
    sum: f64,
    all_at_once: f64,
) -> PairsRun {
    let aggregate = median(&measured.aggregates);
    PairsRun {
        path: measured.path.to_string(),
        aggregate_gbps: aggregate,
        aggregate_p10_gbps: quantile(&measured.aggregates, 0.1),
        aggregate_p90_gbps: quantile(&measured.aggregates, 0.9),
        ratio_to_sum: aggregate / sum,
        ratio_to_all_at_once: aggregate / all_at_once,
        late_rounds: measured.late_rounds,
        pairs: slices
            .iter()
            .zip(gpu_pairs)
            .zip(measured.pairs.iter().zip(&measured.rank_alone))
            .map(|((slice, &(from, to)), (samples, alone_samples))| PairRow {
                prefill_rank: slice.prefill_rank,
                prefill_gpu: from,
                decode_rank: slice.decode_rank,
                decode_gpu: to,
                heads: slice.heads,
                bytes: sharded.slice_request_bytes(slice),
                gbps: median(samples),
                rank_alone_gbps: median(alone_samples),
                peer_copy_gbps: alone[&(from, to)],
            })
            .collect(),
        verified: measured.verified,
    }
}

fn table(report: &PairsReport) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{}: prefill GPUs {:?} -> decode GPUs {:?}, {} per request, write, one process per rank",
        report.workload,
        report.prefill_gpus,
        report.decode_gpus,
        super::workload::size(report.bytes)
    );
    let _ = writeln!(
        out,
        "peer_copy (1 GiB per pair, same run): sum of pairs alone {:.1} GB/s, all pairs at once {:.1} GB/s",
        report.peer_copy_sum_gbps, report.peer_copy_all_at_once_gbps
    );
    for run in &report.runs {
        let _ = writeln!(
            out,
            "path {}: aggregate {:.1} GB/s (p10 {:.1}, p90 {:.1}) = {:.3} of the sum, {:.3} of all at once; verified {}",
            run.path,
            run.aggregate_gbps,
            run.aggregate_p10_gbps,
            run.aggregate_p90_gbps,
            run.ratio_to_sum,
            run.ratio_to_all_at_once,
            if run.verified { "yes" } else { "NO" }
        );
        if run.late_rounds > 0 {
            let _ = writeln!(
                out,
                "  {} of the timed rounds had a rank start over {} us late",
                run.late_rounds,
                LATE.as_micros()
            );
        }
        let _ = writeln!(
            out,
            "  {:<22} {:>5} {:>9} {:>8} {:>10} {:>9} {:>6}",
            "pair", "heads", "bytes", "GB/s", "rank alone", "peer_copy", "ratio"
        );
        for pair in &run.pairs {
            let _ = writeln!(
                out,
                "  {:<22} {:>5} {:>9} {:>8.1} {:>10.1} {:>9.1} {:>6.3}",
                format!(
                    "p{} (GPU{}) -> d{} (GPU{})",
                    pair.prefill_rank, pair.prefill_gpu, pair.decode_rank, pair.decode_gpu
                ),
                pair.heads,
                super::workload::size(pair.bytes),
                pair.gbps,
                pair.rank_alone_gbps,
                pair.peer_copy_gbps,
                pair.gbps / pair.peer_copy_gbps
            );
        }
    }
    out
}

/// A running `ferry bench-rank`, killed on drop.
struct RankChild {
    rank: u32,
    child: Child,
    input: ChildStdin,
    output: Lines<BufReader<ChildStdout>>,
}

impl RankChild {
    fn start(
        options: &Options,
        rank: u32,
        gpu: u32,
        decoders: &[ServeChild],
        path: CopyPath,
        run: u64,
    ) -> Result<RankChild, BoxError> {
        let names: Vec<&str> = decoders.iter().map(|child| child.name.as_str()).collect();
        let addrs: Vec<String> = decoders
            .iter()
            .map(|child| child.buffer_addr.to_string())
            .collect();
        let mut child = Command::new(std::env::current_exe()?)
            .arg("bench-rank")
            .args(["--rank", &rank.to_string(), "--gpu", &gpu.to_string()])
            .args(["--prefill-tp", &options.prefill_gpus.len().to_string()])
            .args(["--decode-tp", &options.decode_gpus.len().to_string()])
            .args([
                "--peers",
                &names.join(","),
                "--peer-addrs",
                &addrs.join(","),
            ])
            .args(["--path", &path.to_string()])
            .args(["--streams", &options.streams.to_string()])
            .args([
                "--kernel-blocks-per-sm",
                &options.kernel_blocks_per_sm.to_string(),
            ])
            .args([
                "--kernel-chunk-bytes",
                &options.kernel_chunk_bytes.to_string(),
            ])
            .args(
                options
                    .kernel_max_sms
                    .iter()
                    .filter_map(|cap| cap.0)
                    .flat_map(|most| ["--kernel-max-sms".to_string(), most.to_string()]),
            )
            .args(["--seed", &options.seed.to_string()])
            .args([
                "--data-seed",
                &(options.seed ^ (run << 32) ^ (u64::from(rank) << 16) ^ 0x5eed).to_string(),
            ])
            .args(["--metadata", &options.metadata])
            .args(options.secret.args())
            .args(options.socket_dir.args())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()?;
        let (Some(input), Some(output)) = (child.stdin.take(), child.stdout.take()) else {
            return Err("a prefill rank's input and output were not captured".into());
        };
        Ok(RankChild {
            rank,
            child,
            input,
            output: BufReader::new(output).lines(),
        })
    }

    fn say(&mut self, line: &str) -> Result<(), BoxError> {
        writeln!(self.input, "{line}")?;
        self.input.flush()?;
        Ok(())
    }

    /// The rank's next line, which must start with `word`.
    fn expect(&mut self, word: &str) -> Result<String, BoxError> {
        let line = self
            .output
            .next()
            .ok_or_else(|| format!("prefill rank {} exited (its error is above)", self.rank))??;
        if line.split(' ').next() == Some(word) {
            Ok(line)
        } else {
            Err(format!("prefill rank {} said {line:?}, not {word}", self.rank).into())
        }
    }
}

impl Drop for RankChild {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        options: Options,
    }

    #[test]
    fn every_split_moves_the_whole_request_once() {
        let whole = {
            let paged = llama(3);
            paged.pools * paged.local_ids.len() as u64 * paged.block_bytes
        };
        for (prefill, decode) in [(1, 1), (2, 2), (4, 4), (4, 2), (2, 4), (1, 4), (8, 8)] {
            let sharded = Sharded {
                split: split(prefill, decode),
                paged: llama(3),
            };
            sharded.split.validate().unwrap();
            let moved: u64 = sharded
                .split
                .slices()
                .iter()
                .map(|slice| sharded.slice_request_bytes(slice))
                .sum();
            assert_eq!(moved, whole, "TP{prefill}->TP{decode}");
            assert_eq!(
                sharded.decode_area() * u64::from(decode),
                sharded.prefill_area() * u64::from(prefill)
            );
        }
    }

    #[test]
    fn the_multi_pair_mode_refuses_options_it_does_not_measure() {
        let parse = |args: &[&str]| Cli::try_parse_from([&["bench"], args].concat());
        let cli = parse(&["--prefill-gpus", "0,1,2,3", "--decode-gpus", "4,5"]).unwrap();
        assert_eq!(cli.options.prefill_gpus, [0, 1, 2, 3]);
        assert_eq!(cli.options.decode_gpus, [4, 5]);
        for extra in [
            &["--tcp"][..],
            &["--rdma"],
            &["--direction", "read"],
            &["--workloads", "blocks-4k"],
            &["--plot", "x.svg"],
            &["--prefill-gpu", "1"],
            &["--decode-gpu", "0"],
        ] {
            let args = [&["--prefill-gpus", "0", "--decode-gpus", "1"], extra].concat();
            let error = parse(&args)
                .err()
                .expect("a conflicting option was accepted");
            assert_eq!(
                error.kind(),
                clap::error::ErrorKind::ArgumentConflict,
                "{extra:?}: {error}"
            );
        }
        let error = parse(&["--prefill-gpus", "0"]).err().expect("accepted");
        assert_eq!(
            error.kind(),
            clap::error::ErrorKind::MissingRequiredArgument
        );
    }
}
