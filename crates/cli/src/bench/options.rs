//! `ferry bench`'s command-line options and the jobs they ask for: which workloads, which
//! directions, caps and transports.

use super::*;

/// Everything `ferry bench` was asked for (its command-line options).
#[derive(clap::Args, Debug)]
pub(crate) struct Options {
    /// Comma-separated workloads, all of them by default (README.md, "More", says what each
    /// one moves).
    #[arg(long, default_value = ALL_WORKLOADS, value_delimiter = ',')]
    pub(crate) workloads: Vec<Workload>,
    /// Instead of the named workloads, `--blocks` scattered blocks of this many bytes.
    #[arg(long, requires = "blocks", value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) block_bytes: Option<u64>,
    /// Number of blocks for `--block-bytes`.
    #[arg(long, requires = "block_bytes", value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) blocks: Option<u64>,
    /// GPU of the sending (prefill) process.
    #[arg(long, default_value_t = 0)]
    pub(crate) prefill_gpu: u32,
    /// GPU of the receiving (decode) process.
    #[arg(long, default_value_t = 1)]
    pub(crate) decode_gpu: u32,
    /// Multi-pair mode: one prefill process per GPU listed (a GPU may repeat), the prefill
    /// side's tensor-parallel ranks in order. `kv-llama70b-4k` is split by KV heads over
    /// these ranks and `--decode-gpus`'s, and every rank writes at once.
    #[arg(long, value_delimiter = ',', requires = "decode_gpus",
          conflicts_with_all = ["workloads", "block_bytes", "plot", "tcp", "rdma", "direction", "prefill_gpu", "decode_gpu"])]
    pub(crate) prefill_gpus: Vec<u32>,
    /// Multi-pair mode: one decode process per GPU listed, the decode side's ranks in order.
    #[arg(long, value_delimiter = ',', requires = "prefill_gpus")]
    pub(crate) decode_gpus: Vec<u32>,
    /// Timed rounds per row (after two warm-up rounds); the median is reported.
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..))]
    pub(crate) iterations: u32,
    /// Copy streams per GPU.
    #[arg(long, default_value_t = 4)]
    pub(crate) streams: usize,
    /// Thread blocks of the copy kernel per multiprocessor, at most.
    #[arg(long, default_value_t = NvlinkConfig::default().kernel_blocks_per_sm)]
    pub(crate) kernel_blocks_per_sm: u32,
    /// Bytes one warp of the copy kernel copies at a time, at most.
    #[arg(long, default_value_t = NvlinkConfig::default().kernel_chunk_bytes)]
    pub(crate) kernel_chunk_bytes: u64,
    /// Multiprocessors the copy kernel may occupy at once, at most, leaving the rest to other
    /// kernels: a number, or `all` for no cap. A comma-separated list (`8,16,32,66,all`) runs
    /// every row once per cap (one cap only with `--plot` and the multi-pair mode).
    #[arg(long, default_value = "all", value_delimiter = ',', value_parser = parse_sm_cap)]
    pub(crate) kernel_max_sms: Vec<SmCap>,
    /// Run a bf16 GEMM on the prefill GPU, on a stream and thread of its own, while each row's
    /// timed rounds run, and report its TFLOP/s alone (measured just before the row) and
    /// beside the transfers, and the slowdown; the row's GB/s are then those beside the GEMM.
    /// With `--kernel-max-sms 8,16,32,66,all` this gives the curve multiprocessors -> GB/s ->
    /// GEMM slowdown.
    #[arg(long, conflicts_with_all = ["prefill_gpus", "tcp", "rdma"])]
    pub(crate) contend: bool,
    /// `--contend`: rows (and columns) of the GEMM's square matrices, a multiple of 128.
    #[arg(long, default_value_t = 4096, requires = "contend")]
    pub(crate) gemm_size: usize,
    /// Send the prefill's notifications over the control connection's TCP instead of the
    /// shared-memory ring (the same-run baseline of `small-write`'s notification path).
    #[arg(long)]
    pub(crate) notify_over_tcp: bool,
    /// Every request of the bandwidth rows carries a notification to the decode process, as a
    /// server's request does (NIXL's and Mooncake's layers send one with each): its transfer
    /// ends once the peer accepted the notification, and the rows time that too. The decode
    /// process's echo of it is awaited between rounds, outside the timing.
    #[arg(long)]
    pub(crate) notify_requests: bool,
    /// Move the decode process's `cudaMalloc` memory through the staging buffers its engine
    /// hands over by file descriptor, as between two pods whose servers have equal PIDs,
    /// instead of through its IPC handles: the staged path's figure, for a run without the
    /// option as its baseline.
    #[arg(long, conflicts_with_all = ["host", "tcp"])]
    pub(crate) stage_cuda_malloc: bool,
    /// With `--stage-cuda-malloc`: bytes of staging asked of the decode process (it gives
    /// 2 MiB to 1 GiB).
    #[arg(long, default_value_t = NvlinkConfig::default().staging_bytes, requires = "stage_cuda_malloc")]
    pub(crate) staging_bytes: u64,
    /// With `--stage-cuda-malloc`: slots the staging buffer is cut into (chunks in flight at
    /// once); without it, one where both processes use the same GPU and four otherwise.
    #[arg(long, requires = "stage_cuda_malloc", value_parser = clap::value_parser!(u32).range(1..))]
    pub(crate) staging_slots: Option<u32>,
    /// Batches of at most this many bytes have the GPU publish their notification into the
    /// shared-memory ring right after their copies; 0 leaves every notification to the host
    /// (the same-run baseline of GPU-published notifications).
    #[arg(long, default_value_t = NvlinkConfig::default().gpu_notification_max_bytes)]
    pub(crate) gpu_notification_max_bytes: u64,
    /// Copy paths, comma-separated: auto, kernel, copy-engine, batched (one row each).
    #[arg(long, default_value = "auto", value_delimiter = ',')]
    pub(crate) paths: Vec<CopyPath>,
    /// Move the GPU memory over TCP, staged through pinned host buffers, instead of NVLink
    /// (the path GPUs of different hosts take without RDMA).
    #[arg(long)]
    pub(crate) tcp: bool,
    /// Move the GPU memory over RDMA instead of NVLink: both processes' engines leave the GPU
    /// links out, and every transfer takes the RDMA transport (one-sided WRITE/READ,
    /// GPUDirect). Both processes run on this host, so the bytes go through the NIC's
    /// loopback. A transfer that any other transport carried fails the run. There is no
    /// copy-engine baseline over RDMA: the baseline is the line rate of the host's fastest
    /// active RDMA port (`-`, with no ratio, where no port reports it). Needs a build
    /// with `--features rdma` and a host where `ferry probe` lists an RDMA device.
    #[arg(long, conflicts_with_all = ["tcp", "paths", "plot"])]
    pub(crate) rdma: bool,
    /// Move host memory over TCP instead of GPU memory: needs no GPU (nor CUDA). Both
    /// processes register host memory, every row but `kv-layerwise` (which waits on a GPU
    /// stream) runs over TCP, and the baseline is one in-process `memcpy` of 1 GiB.
    #[arg(long, conflicts_with_all = [
        "rdma", "plot", "contend", "prefill_gpus", "decode_gpus", "kernel_max_sms",
    ])]
    pub(crate) host: bool,
    /// `write` (prefill pushes), `read` (prefill pulls) or `both`: every row that honours the
    /// direction runs as a write and then as a read (`small-write` and `kv-layerwise` always
    /// write; under `both` the `--plot` sweep writes, one line per path; the multi-pair mode
    /// always writes).
    #[arg(long, default_value = "both", value_parser = parse_direction)]
    pub(crate) direction: Directions,
    /// Also write the rows as JSON to this file.
    #[arg(long)]
    pub(crate) json: Option<PathBuf>,
    /// Also sweep block sizes for the kernel, copy-engine and batched paths and draw bandwidth
    /// against block size, with the baseline as a line, into this SVG file.
    #[arg(long)]
    pub(crate) plot: Option<PathBuf>,
    /// `kv-layerwise`: how long the prefill's compute of each layer takes, microseconds (the
    /// host holds the computing stream that long per layer).
    #[arg(long, default_value_t = 1000)]
    pub(crate) layer_compute_us: u64,
    /// Seed of the block ids and the data.
    #[arg(long, default_value_t = 42)]
    pub(crate) seed: u64,
    /// Metadata store URL both processes use (`p2p`, `etcd://...`, `redis://...`).
    #[arg(long, default_value = "p2p")]
    pub(crate) metadata: String,
    #[command(flatten)]
    pub(crate) secret: crate::secret_file::SecretFile,
    #[command(flatten)]
    pub(crate) socket_dir: crate::socket_dir::SocketDirArg,
}

/// A cap on the copy kernel's multiprocessors; `None` for all of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SmCap(pub(crate) Option<u32>);

/// A value `--kernel-max-sms` or `--direction` does not take; clap prints it after the option.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(super) enum InvalidValue {
    /// Not a positive number of multiprocessors, nor `all`.
    #[error("{text:?}: give a number of multiprocessors (1 or more) or all")]
    SmCap {
        /// The value given.
        text: String,
    },
    /// Not `write`, `read` or `both`.
    #[error("{text:?}: use write, read or both")]
    Direction {
        /// The value given.
        text: String,
    },
}

/// Parses one cap of `--kernel-max-sms`.
pub(super) fn parse_sm_cap(text: &str) -> Result<SmCap, InvalidValue> {
    match text.trim() {
        "all" => Ok(SmCap(None)),
        number => match number.parse::<u32>() {
            Ok(cap) if cap > 0 => Ok(SmCap(Some(cap))),
            _ => Err(InvalidValue::SmCap {
                text: text.to_owned(),
            }),
        },
    }
}

/// The directions `--direction` asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Directions {
    /// One direction for every row.
    One(Direction),
    /// Every row that honours the direction twice: a write, then a read.
    Both,
}

impl Directions {
    /// The directions `workload`'s rows run in, write first.
    pub(super) fn of(self, workload: &Workload) -> Vec<Direction> {
        match self {
            _ if workload.always_writes() => vec![Direction::Write],
            Directions::One(direction) => vec![direction],
            Directions::Both => vec![Direction::Write, Direction::Read],
        }
    }

    /// The one direction of the `--plot` sweep: a write under `both`, so that the plot keeps
    /// one line per copy path.
    pub(super) fn sweep(self) -> Direction {
        match self {
            Directions::One(direction) => direction,
            Directions::Both => Direction::Write,
        }
    }
}

/// Parses `--direction`.
pub(super) fn parse_direction(text: &str) -> Result<Directions, InvalidValue> {
    match text {
        "write" => Ok(Directions::One(Direction::Write)),
        "read" => Ok(Directions::One(Direction::Read)),
        "both" => Ok(Directions::Both),
        other => Err(InvalidValue::Direction {
            text: other.to_owned(),
        }),
    }
}

/// `write` or `read`, as the table, the JSON and the progress bar say it.
pub(super) fn direction_name(direction: Direction) -> &'static str {
    match direction {
        Direction::Write => "write",
        Direction::Read => "read",
    }
}

/// One row to measure: a workload, its blocks and the direction they go.
#[derive(Clone, Copy)]
pub(super) struct Job<'a> {
    /// What the row is named after.
    pub(super) workload: &'a Workload,
    /// What `workload` moves.
    pub(super) shape: &'a Shape,
    /// Seen from the prefill process.
    pub(super) direction: Direction,
}

/// A job per direction `directions` asks of each workload of `shapes`, in their order, the
/// read right after the write.
pub(super) fn jobs(shapes: &[(Workload, Shape)], directions: Directions) -> Vec<Job<'_>> {
    shapes
        .iter()
        .flat_map(|(workload, shape)| {
            directions
                .of(workload)
                .into_iter()
                .map(move |direction| Job {
                    workload,
                    shape,
                    direction,
                })
        })
        .collect()
}

impl Options {
    /// Timed rounds per row.
    pub(super) fn rounds(&self) -> usize {
        self.iterations as usize
    }

    /// The one transport every transfer must take, when one other than NVLink was asked for.
    pub(super) fn only_transport(&self) -> Option<&'static str> {
        match (self.rdma, self.tcp || self.host) {
            (true, _) => Some(RDMA),
            (false, true) => Some(TCP),
            (false, false) => None,
        }
    }

    /// The one multiprocessor cap of a run that takes only one (the multi-pair mode, `--plot`).
    pub(super) fn single_cap(&self, mode: &str) -> Result<Option<u32>, BoxError> {
        match self.kernel_max_sms[..] {
            [] => Ok(None),
            [SmCap(cap)] => Ok(cap),
            _ => Err(format!(
                "{mode} takes one --kernel-max-sms value, got {}; run it once per cap",
                self.kernel_max_sms.len()
            )
            .into()),
        }
    }

    /// The workloads to run: the custom blocks when given, else the named ones.
    pub(super) fn workloads(&self) -> Vec<Workload> {
        match self.block_bytes.zip(self.blocks) {
            Some((bytes, count)) => vec![Workload::Blocks { bytes, count }],
            // Its layers wait on a GPU stream, which host memory has none of.
            None if self.host => self
                .workloads
                .iter()
                .copied()
                .filter(|workload| *workload != Workload::KvLayerwise)
                .collect(),
            None => self.workloads.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{direction_name, jobs, Direction, Directions, Options, SmCap, Workload};
    use clap::Parser;

    #[derive(Parser)]
    struct Bench {
        #[command(flatten)]
        options: Options,
    }

    fn parse(args: &[&str]) -> Result<Options, clap::Error> {
        Bench::try_parse_from(std::iter::once("bench").chain(args.iter().copied()))
            .map(|bench| bench.options)
    }

    #[test]
    fn the_cap_list_takes_numbers_and_all_and_defaults_to_no_cap() {
        let options = parse(&[]).unwrap();
        assert_eq!(options.kernel_max_sms, [SmCap(None)]);
        assert!(!options.contend);
        let options = parse(&["--kernel-max-sms", "8,16,32,66,all"]).unwrap();
        let caps: Vec<Option<u32>> = options.kernel_max_sms.iter().map(|cap| cap.0).collect();
        assert_eq!(caps, [Some(8), Some(16), Some(32), Some(66), None]);
        for bad in ["0", "many", "8,,16", "4294967296"] {
            let error = parse(&["--kernel-max-sms", bad])
                .err()
                .map(|e| e.to_string());
            assert!(
                error.as_deref().is_some_and(|e| e.contains("or all")),
                "{bad}: {error:?}"
            );
        }
    }

    #[test]
    fn the_direction_takes_write_read_or_both_and_defaults_to_both() {
        assert_eq!(parse(&[]).unwrap().direction, Directions::Both);
        for (text, direction) in [("write", Direction::Write), ("read", Direction::Read)] {
            let options = parse(&["--direction", text]).unwrap();
            assert_eq!(options.direction, Directions::One(direction));
        }
        assert_eq!(
            parse(&["--direction", "both"]).unwrap().direction,
            Directions::Both
        );
        let error = parse(&["--direction", "push"]).err().map(|e| e.to_string());
        assert!(
            error
                .as_deref()
                .is_some_and(|e| e.contains("use write, read or both")),
            "{error:?}"
        );
        assert_eq!(Directions::Both.sweep(), Direction::Write);
        assert_eq!(Directions::One(Direction::Read).sweep(), Direction::Read);
    }

    #[test]
    fn both_reads_right_after_each_write_except_where_a_workload_always_writes() {
        let shapes: Vec<_> = ["contiguous", "small-write", "kv-layerwise", "blocks-1m"]
            .iter()
            .map(|name| {
                let workload: Workload = name.parse().unwrap();
                (workload, workload.shape(1))
            })
            .collect();
        let listed = |directions| -> Vec<String> {
            jobs(&shapes, directions)
                .iter()
                .map(|job| format!("{} {}", job.workload, direction_name(job.direction)))
                .collect()
        };
        assert_eq!(
            listed(Directions::Both),
            [
                "contiguous write",
                "contiguous read",
                "small-write write",
                "kv-layerwise write",
                "blocks-1m write",
                "blocks-1m read"
            ]
        );
        assert_eq!(
            listed(Directions::One(Direction::Read)),
            [
                "contiguous read",
                "small-write write",
                "kv-layerwise write",
                "blocks-1m read"
            ]
        );
    }

    #[test]
    fn one_cap_only_where_a_run_takes_one() {
        let options = parse(&["--kernel-max-sms", "16"]).unwrap();
        assert_eq!(options.single_cap("--plot").ok(), Some(Some(16)));
        let options = parse(&["--kernel-max-sms", "16,all"]).unwrap();
        let error = options.single_cap("--plot").map_err(|e| e.to_string());
        assert_eq!(
            error,
            Err("--plot takes one --kernel-max-sms value, got 2; run it once per cap".into())
        );
    }

    #[test]
    fn contend_runs_over_nvlink_between_two_processes_only() {
        let options = parse(&["--contend", "--gemm-size", "8192"]).unwrap();
        assert!(options.contend);
        assert_eq!(options.gemm_size, 8192);
        assert_eq!(parse(&["--contend"]).unwrap().gemm_size, 4096);
        for conflicting in [
            &["--contend", "--tcp"][..],
            &["--contend", "--rdma"],
            &["--contend", "--prefill-gpus", "0", "--decode-gpus", "1"],
            &["--gemm-size", "8192"],
        ] {
            assert!(parse(conflicting).is_err(), "{conflicting:?}");
        }
    }
}
