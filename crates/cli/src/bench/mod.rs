//! `ferry bench`: every workload of `workload::ALL` GPU -> GPU between two processes through
//! ferry (this one and a `ferry serve` child it starts), against the same-run `peer_copy`
//! baseline (one in-process copy of a contiguous 1 GiB buffer), each as a write and then as a
//! read unless `--direction` picks one, with every destination byte checked after each row.
//! With `--tcp` or `--rdma` the same rows go over that transport alone, and a transfer that
//! another transport carried fails the run.

mod gpus;
mod pairs;
mod plot;
mod rank;
mod rdma;
mod report;
mod workload;

pub(crate) use rank::{run as run_rank, RankOptions};

use crate::serve_child::ServeChild;
use ferry::cuda::{Context, DeviceBuffer, Gemm, GemmRate, Stream};
use ferry::transport::{Reach, RDMA, TCP};
use ferry::{
    BlockCopy, BlockLayout, BufferDescriptor, Completion, CopyPath, Direction, Engine,
    Notifications, NvlinkConfig, Peer, Region,
};
use futures::FutureExt;
use indicatif::{ProgressBar, ProgressStyle};
use report::{quantile, Contention, Notified, Report, Row};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use workload::{random_bytes, Paged, Shape, SWEEP_SIZES};

use workload::{Workload, ALL as ALL_WORKLOADS};

const GIB: u64 = 1 << 30;

/// How long `--contend` measures the GEMM alone before each row.
const GEMM_ALONE: Duration = Duration::from_millis(500);

/// How long a bench thread looks for a transfer's end before it parks.
pub(crate) const WAIT_SPIN: Duration = Duration::from_millis(20);

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
}

/// A cap on the copy kernel's multiprocessors; `None` for all of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SmCap(pub(crate) Option<u32>);

fn parse_sm_cap(text: &str) -> Result<SmCap, String> {
    match text.trim() {
        "all" => Ok(SmCap(None)),
        number => match number.parse::<u32>() {
            Ok(cap) if cap > 0 => Ok(SmCap(Some(cap))),
            _ => Err(format!(
                "{text:?}: give a number of multiprocessors (1 or more) or all"
            )),
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
    fn of(self, workload: &Workload) -> Vec<Direction> {
        match self {
            _ if workload.always_writes() => vec![Direction::Write],
            Directions::One(direction) => vec![direction],
            Directions::Both => vec![Direction::Write, Direction::Read],
        }
    }

    /// The one direction of the `--plot` sweep: a write under `both`, so that the plot keeps
    /// one line per copy path.
    fn sweep(self) -> Direction {
        match self {
            Directions::One(direction) => direction,
            Directions::Both => Direction::Write,
        }
    }
}

/// Parses `--direction`.
fn parse_direction(text: &str) -> Result<Directions, String> {
    match text {
        "write" => Ok(Directions::One(Direction::Write)),
        "read" => Ok(Directions::One(Direction::Read)),
        "both" => Ok(Directions::Both),
        other => Err(format!("{other:?}: use write, read or both")),
    }
}

/// `write` or `read`, as the table, the JSON and the progress bar say it.
fn direction_name(direction: Direction) -> &'static str {
    match direction {
        Direction::Write => "write",
        Direction::Read => "read",
    }
}

/// One row to measure: a workload, its blocks and the direction they go.
#[derive(Clone, Copy)]
struct Job<'a> {
    /// What the row is named after.
    workload: &'a Workload,
    /// What `workload` moves.
    shape: &'a Shape,
    /// Seen from the prefill process.
    direction: Direction,
}

/// A job per direction `directions` asks of each workload of `shapes`, in their order, the
/// read right after the write.
fn jobs(shapes: &[(Workload, Shape)], directions: Directions) -> Vec<Job<'_>> {
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
    fn rounds(&self) -> usize {
        self.iterations as usize
    }

    /// The one transport every transfer must take, when one other than NVLink was asked for.
    fn only_transport(&self) -> Option<&'static str> {
        match (self.rdma, self.tcp) {
            (true, _) => Some(RDMA),
            (false, true) => Some(TCP),
            (false, false) => None,
        }
    }

    /// The one multiprocessor cap of a run that takes only one (the multi-pair mode, `--plot`).
    fn single_cap(&self, mode: &str) -> Result<Option<u32>, BoxError> {
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
    fn workloads(&self) -> Vec<Workload> {
        match self.block_bytes.zip(self.blocks) {
            Some((bytes, count)) => vec![Workload::Blocks { bytes, count }],
            None => self.workloads.clone(),
        }
    }
}

type BoxError = Box<dyn std::error::Error>;

/// Runs every row, prints the table, writes the JSON and the plot; `Ok(false)` when some
/// bytes did not verify.
pub(crate) fn run(options: &Options) -> Result<bool, BoxError> {
    if options.rdma {
        rdma::check()?;
    }
    if !options.prefill_gpus.is_empty() {
        options.single_cap("the multi-pair mode")?;
        gpus::check(&[&options.prefill_gpus[..], &options.decode_gpus[..]].concat())?;
        return pairs::run(options);
    }
    if options.plot.is_some() {
        options.single_cap("--plot")?;
    }
    gpus::check(&[options.prefill_gpu, options.decode_gpu])?;
    let shapes: Vec<(Workload, Shape)> = options
        .workloads()
        .iter()
        .map(|workload| (*workload, workload.shape(options.seed)))
        .collect();
    let sweep: Vec<(Workload, Shape)> = match options.plot {
        Some(_) => SWEEP_SIZES
            .iter()
            .map(|&bytes| {
                let workload = workload::sweep_point(bytes);
                (workload, workload.shape(options.seed))
            })
            .collect(),
        None => Vec::new(),
    };
    let all = || shapes.iter().chain(&sweep);
    let area = all()
        .map(|(_, shape)| shape.area())
        .max()
        .unwrap_or(0)
        .max(1);
    let check = all()
        .map(|(_, shape)| shape.bytes())
        .max()
        .unwrap_or(0)
        .max(1);
    let rows = jobs(&shapes, options.direction);
    let sweep_direction = Directions::One(options.direction.sweep());
    let sweep_rows = jobs(&sweep, sweep_direction);
    let sweep_paths = [CopyPath::Kernel, CopyPath::CopyEngine, CopyPath::Batched];
    let caps = options.kernel_max_sms.len().max(1);
    let total = (rows.len() * options.paths.len() + sweep_rows.len() * sweep_paths.len()) * caps;
    let progress = progress_bar(total as u64 + 1);
    progress.set_message(format!(
        "starting the decode process ({:.1} GiB on GPU{})",
        area as f64 / GIB as f64,
        options.decode_gpu
    ));
    let mut decode = ServeChild::start(
        area,
        options.decode_gpu,
        true,
        !options.rdma,
        &options.metadata,
        &options.secret,
    )?;
    // Over RDMA there is no copy to compare with: the baseline is the port's line rate.
    let line_rate = options.rdma.then(rdma::line_rate_gbps).flatten();
    let peer_copy_gbps = match options.rdma {
        true => None,
        false => {
            progress.set_message("peer_copy baseline");
            Some(peer_copy(
                &[(options.prefill_gpu, options.decode_gpu)],
                options.rounds(),
            )?)
        }
    };
    let gemm = match options.contend {
        true => {
            progress.set_message(format!(
                "loading the {n} x {n} GEMM on GPU{}",
                options.prefill_gpu,
                n = options.gemm_size
            ));
            Some(Gemm::new(
                Context::get(options.prefill_gpu)?,
                options.gemm_size,
            )?)
        }
        false => None,
    };
    progress.inc(1);
    let baseline = peer_copy_gbps.or(line_rate);
    let mut report = Report {
        prefill_gpu: options.prefill_gpu,
        decode_gpu: options.decode_gpu,
        peer_copy_gbps,
        line_rate_gbps: line_rate,
        rows: Vec::new(),
        sweep: Vec::new(),
    };
    let mut paths: Vec<CopyPath> = options.paths.clone();
    for path in sweep_paths {
        if !sweep.is_empty() && !paths.contains(&path) {
            paths.push(path);
        }
    }
    let base = pattern(options.seed);
    let caps = match options.kernel_max_sms.is_empty() {
        true => vec![SmCap(None)],
        false => options.kernel_max_sms.clone(),
    };
    for path in paths {
        for &SmCap(cap) in &caps {
            let side = Side::new(options, path, cap, area, check, &mut decode)?;
            let sms = report::sms(cap);
            if options.paths.contains(&path) {
                for &job in &rows {
                    let (workload, direction) = (job.workload, direction_name(job.direction));
                    progress.set_message(format!("{workload} {direction} ({path}, {sms} SMs)"));
                    let row = side.row(job, options, baseline, &base, gemm.as_ref())?;
                    report.rows.push(row);
                    progress.inc(1);
                }
            }
            if sweep_paths.contains(&path) {
                for &job in &sweep_rows {
                    progress.set_message(format!("sweep {} ({path})", job.workload));
                    let row = side.row(job, options, baseline, &base, None)?;
                    report.sweep.push(row);
                    progress.inc(1);
                }
            }
        }
    }
    progress.finish_and_clear();
    print!("{}", report.table());
    if let Some(path) = &options.json {
        std::fs::write(path, serde_json::to_string_pretty(&report)? + "\n")?;
        println!("wrote {}", path.display());
    }
    if let Some(path) = &options.plot {
        std::fs::write(path, plot::svg(&report)?)?;
        println!("wrote {}", path.display());
    }
    Ok(report
        .rows
        .iter()
        .chain(&report.sweep)
        .all(|row| row.verified))
}

/// A progress bar of `len` steps (drawn only on a terminal).
fn progress_bar(len: u64) -> ProgressBar {
    ProgressBar::new(len).with_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} {msg} [{elapsed}]")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    )
}

/// Random bytes that the blocks' contents are cut from: 1 GiB plus room to shift each block's
/// window, so no two blocks look alike.
fn pattern(seed: u64) -> Vec<u8> {
    random_bytes(seed, (GIB + SHIFT_SPAN) as usize)
}

const SHIFT_SPAN: u64 = 64 << 20;

/// What block `index` of a row carries.
fn block_bytes(base: &[u8], index: usize, len: u64) -> &[u8] {
    let start = (index as u64 * 4099 * 16) % SHIFT_SPAN;
    &base[start as usize..(start + len) as usize]
}

fn median(samples: &[f64]) -> f64 {
    quantile(samples, 0.5)
}

/// In-process copies of a contiguous 1 GiB buffer for every (from, to) GPU pair at once, one
/// stream per pair on its source GPU: median aggregate GB/s. One pair is the `peer_copy`
/// baseline.
fn peer_copy(pairs: &[(u32, u32)], iterations: usize) -> Result<f64, BoxError> {
    let mut copies = Vec::with_capacity(pairs.len());
    for &(from, to) in pairs {
        let (source_context, target_context) = (Context::get(from)?, Context::get(to)?);
        if from != to {
            source_context.enable_peer_access(&target_context)?;
        }
        let source = DeviceBuffer::new(source_context.clone(), GIB as usize)?;
        let target = DeviceBuffer::new(target_context, GIB as usize)?;
        copies.push((Stream::new(source_context)?, source, target));
    }
    let mut samples = Vec::new();
    for round in 0..iterations.max(10) + 2 {
        let started = Instant::now();
        for (stream, source, target) in &copies {
            stream.copy_buffer(target, source, GIB)?;
        }
        for (stream, _, _) in &copies {
            let event = stream.record_event()?;
            stream.synchronize()?;
            while !event.query()? {}
        }
        if round >= 2 {
            samples
                .push((GIB * copies.len() as u64) as f64 / started.elapsed().as_secs_f64() / 1e9);
        }
    }
    Ok(median(&samples))
}

/// Per-round times of one row, microseconds.
#[derive(Default)]
struct Timing {
    /// From the start of building the batch to the result in hand.
    latencies: Vec<f64>,
    /// Building and submitting the batch.
    submits: Vec<f64>,
    /// Inside the engine ([`ferry::Completion::elapsed`]).
    inside: Vec<f64>,
}

/// What one row's timed rounds measured.
struct Measured {
    /// GB/s; absent for latency-only workloads.
    gbps: Option<f64>,
    timing: Timing,
    /// `kv-layerwise`: one layer's transfer alone, p50 microseconds.
    one_layer_us: Option<f64>,
    /// `kv-layerwise`: from the host's release of the last layer's compute, p50 microseconds.
    released_us: Option<f64>,
    /// `small-write`: the path its notifications took and one notification alone.
    notified: Option<Notified>,
}

impl Measured {
    fn new(gbps: Option<f64>, timing: Timing) -> Measured {
        Measured {
            gbps,
            timing,
            one_layer_us: None,
            released_us: None,
            notified: None,
        }
    }
}

/// The prefill side of one copy path: an engine and its GPU memory.
struct Side {
    engine: Engine,
    peer: Peer,
    /// Blocks are copied from (write) or into (read) this area.
    local: Region,
    /// Zeros, to clear destinations.
    zeros: Region,
    /// Staging for verification and for filling the peer before reads.
    check: Region,
    /// The decode process's area, at this address in its buffer `remote_buffer`.
    remote: u64,
    remote_buffer: BufferDescriptor,
    /// Echoes from the decode process, for `small-write`.
    inbox: std::cell::RefCell<Notifications>,
    /// The one transport every transfer must take (`--rdma`, `--tcp`); any transport when
    /// `None`.
    only: Option<&'static str>,
    /// The copy path asked for.
    path: CopyPath,
    /// The copy kernel's multiprocessor cap; `None` for all.
    cap: Option<u32>,
    /// `kv-layerwise`'s stand-in for prefill's computing stream: it waits on `gate` and
    /// records the event a layer's blocks start after.
    computing: Stream,
    /// The word the host raises as each layer's compute ends (`kv-layerwise`).
    gate: Region,
}

impl Side {
    fn new(
        options: &Options,
        path: CopyPath,
        cap: Option<u32>,
        area: u64,
        check: u64,
        decode: &mut ServeChild,
    ) -> Result<Side, BoxError> {
        let only = options.only_transport();
        let builder = options
            .secret
            .apply(Engine::builder())?
            .metadata(ferry::metadata::from_url(&options.metadata)?)
            .gpu_links(only.is_none())
            .transfer_timeout(Duration::from_secs(60))
            .nvlink(NvlinkConfig {
                streams_per_gpu: options.streams.max(1),
                copy_path: path,
                kernel_blocks_per_sm: options.kernel_blocks_per_sm.max(1),
                kernel_chunk_bytes: options.kernel_chunk_bytes.max(16),
                kernel_max_sms: cap,
                shared_memory_notifications: !options.notify_over_tcp,
                gpu_notification_max_bytes: options.gpu_notification_max_bytes,
            });
        // `--tcp` measures TCP: RDMA, which would win over it, stays out.
        #[cfg(feature = "rdma")]
        let builder = builder.rdma((!options.tcp).then(ferry::RdmaConfig::default));
        let engine = builder.build_blocking()?;
        let gpu = options.prefill_gpu;
        let local = engine.allocate_device(gpu, area)?;
        let zeros = engine.allocate_device(gpu, GIB.min(area))?;
        let check = engine.allocate_device(gpu, check)?;
        let gate = engine.allocate_device(gpu, 4096)?;
        gate.write_at(0, &[0u8; 4096])?;
        let computing = Stream::new(Context::get(gpu)?)?;
        let peer = engine.connect_blocking(&decode.name)?;
        decode.reply_to(engine.name())?;
        let inbox = std::cell::RefCell::new(engine.notifications()?);
        let remote = decode.buffer_addr;
        let remote_buffer = peer
            .buffer_at(remote)
            .ok_or_else(|| format!("the decode process registered no buffer at {remote:#x}"))?;
        if let Some(wanted) = only {
            routed_over(&engine, &local, &peer, &remote_buffer, wanted)?;
        }
        Ok(Side {
            inbox,
            engine,
            peer,
            local,
            zeros,
            check,
            remote,
            remote_buffer,
            only,
            path,
            cap,
            computing,
            gate,
        })
    }

    /// `done`, when the transport the run asked for carried all of it.
    fn carried(&self, done: Completion) -> Result<Completion, BoxError> {
        match self.only {
            Some(wanted) if done.transports != [wanted] => Err(format!(
                "a transfer of {} bytes went over {} where the run asked for {wanted} alone; \
                 stopping rather than report another transport's figures",
                done.bytes,
                done.transports.join("+")
            )
            .into()),
            _ => Ok(done),
        }
    }

    /// One row: `job`'s rounds timed and its bytes verified; with `gemm`, the GEMM's rate
    /// alone just before and beside the rounds.
    fn row(
        &self,
        job: Job<'_>,
        options: &Options,
        baseline: Option<f64>,
        base: &[u8],
        gemm: Option<&Gemm>,
    ) -> Result<Row, BoxError> {
        let Job {
            workload,
            shape,
            direction,
        } = job;
        let blocks = shape.blocks();
        self.prepare(&blocks, direction, base)?;
        let rounds = || self.rounds(workload, shape, direction, options);
        let (measured, contention) = match gemm {
            None => (rounds()?, None),
            Some(gemm) => {
                let alone = gemm.rate_for(GEMM_ALONE)?;
                let (measured, during) = beside(gemm, rounds)?;
                (measured, Some(Contention::new(&alone, &during)))
            }
        };
        let verified = self.verify(&blocks, direction, base)?;
        Ok(Row {
            workload: workload.to_string(),
            path: self
                .only
                .map_or_else(|| self.path.to_string(), str::to_owned),
            direction: direction_name(direction).into(),
            block_bytes: blocks.iter().map(|block| block.2).max().unwrap_or(0),
            bytes: shape.bytes(),
            gbps: measured.gbps,
            ratio: measured
                .gbps
                .zip(baseline)
                .map(|(gbps, baseline)| gbps / baseline),
            p50_us: quantile(&measured.timing.latencies, 0.5),
            p99_us: quantile(&measured.timing.latencies, 0.99),
            submit_us: median(&measured.timing.submits),
            engine_us: median(&measured.timing.inside),
            verified,
            one_layer_us: measured.one_layer_us,
            released_us: measured.released_us,
            notified: measured.notified,
            kernel_max_sms: self.cap,
            contention,
        })
    }

    /// A row's timed rounds: its GB/s (absent for latency-only workloads), the rounds' times,
    /// for `kv-layerwise` one layer's transfer alone, and for `small-write` how its
    /// notifications went.
    fn rounds(
        &self,
        workload: &Workload,
        shape: &Shape,
        direction: Direction,
        options: &Options,
    ) -> Result<Measured, BoxError> {
        Ok(match shape {
            Shape::Paged(paged) if *workload == Workload::KvLayerwise => {
                let compute = Duration::from_micros(options.layer_compute_us);
                let (timing, released, alone) = self.layerwise(paged, compute, options.rounds())?;
                Measured {
                    one_layer_us: Some(alone),
                    released_us: Some(quantile(&released, 0.5)),
                    ..Measured::new(None, timing)
                }
            }
            Shape::Ping(len) => {
                let (latencies, alone) = self.ping(*len, options.rounds().max(200))?;
                let timing = Timing {
                    latencies,
                    ..Timing::default()
                };
                Measured {
                    notified: Some(Notified {
                        through: self.peer.notifications_through().unwrap_or("-").to_owned(),
                        alone_p50_us: quantile(&alone, 0.5),
                        alone_p99_us: quantile(&alone, 0.99),
                    }),
                    ..Measured::new(None, timing)
                }
            }
            _ => {
                let (gbps, timing) = self.measure(shape, direction, options.rounds())?;
                Measured::new(Some(gbps), timing)
            }
        })
    }

    /// Puts each block's bytes at its source and zeros at its destination.
    fn prepare(
        &self,
        blocks: &[(u64, u64, u64)],
        direction: Direction,
        base: &[u8],
    ) -> Result<(), BoxError> {
        match direction {
            Direction::Write => {
                for (index, &(local, _, len)) in blocks.iter().enumerate() {
                    self.local.write_at(local, block_bytes(base, index, len))?;
                }
                let mut clear = self.engine.batch(&self.peer);
                for &(_, remote, len) in blocks {
                    clear = clear.write(&self.zeros, 0, self.remote + remote, len);
                }
                self.carried(clear.submit_blocking()?)?;
            }
            Direction::Read => {
                let mut fill = self.engine.batch(&self.peer);
                let mut at = 0;
                for (index, &(_, remote, len)) in blocks.iter().enumerate() {
                    self.check.write_at(at, block_bytes(base, index, len))?;
                    fill = fill.write(&self.check, at, self.remote + remote, len);
                    at += len;
                }
                self.carried(fill.submit_blocking()?)?;
                let zeros = vec![0u8; blocks.iter().map(|b| b.2).max().unwrap_or(0) as usize];
                for &(local, _, len) in blocks {
                    self.local.write_at(local, &zeros[..len as usize])?;
                }
            }
        }
        Ok(())
    }

    /// Two warm-up rounds, then `iterations` timed ones: median GB/s and the rounds' times.
    fn measure(
        &self,
        shape: &Shape,
        direction: Direction,
        iterations: usize,
    ) -> Result<(f64, Timing), BoxError> {
        let bytes = shape.bytes() as f64;
        let mut gbps = Vec::new();
        let mut timing = Timing::default();
        for round in 0..iterations + 2 {
            let started = Instant::now();
            let transfer = self.batch(shape, direction).submit()?;
            let submitted = started.elapsed();
            // This thread has nothing else to do: it looks for the end as a latency-critical
            // server thread would, so the figures are the transfer's and not a wake-up's.
            let done = transfer.wait_spinning(WAIT_SPIN)?;
            let elapsed = started.elapsed();
            let done = self.carried(done)?;
            if round >= 2 {
                gbps.push(bytes / elapsed.as_secs_f64() / 1e9);
                timing.latencies.push(elapsed.as_secs_f64() * 1e6);
                timing.submits.push(submitted.as_secs_f64() * 1e6);
                timing.inside.push(done.elapsed.as_secs_f64() * 1e6);
            }
        }
        Ok((median(&gbps), timing))
    }

    /// `kv-layerwise`: per round, every layer's blocks are submitted up front, each to start
    /// after an event of the computing stream, which waits on the gate word; the host then
    /// "computes" each layer for `compute` and raises the gate. The latency is from the end of
    /// the last layer's compute, as this thread sees the computing stream pass its gate (an
    /// event after it, polled), to the last transfer's end; also returned, per round, the same
    /// from the return of the gate write, which adds the GPU's noticing the gate. Also returns
    /// one layer's transfer alone, with its data ready (p50, microseconds). The row's submit
    /// time is that of all layers of a round. Transfers that end while later layers compute
    /// are collected then, as a serving loop polls its finished layers, so the tail holds
    /// only the waits for the layers still moving.
    fn layerwise(
        &self,
        paged: &Paged,
        compute: Duration,
        rounds: usize,
    ) -> Result<(Timing, Vec<f64>, f64), BoxError> {
        let layers = paged.pools / 2;
        // A layer's K and V pools; layer `index` starts this far into both areas.
        let layer = Paged {
            pools: 2,
            ..paged.clone()
        };
        let layer_at = |index: u64| index * 2 * paged.pool_bytes();
        let mut timing = Timing::default();
        let mut released = Vec::with_capacity(rounds);
        let mut gate = 0u32;
        for round in 0..rounds + 2 {
            let started = Instant::now();
            let mut transfers = Vec::with_capacity(layers as usize);
            let mut last = None;
            let mut queue = || -> Result<(), BoxError> {
                for index in 0..layers {
                    self.computing
                        .wait_value32(&self.gate, 0, gate + index as u32 + 1)?;
                    let computed = self.computing.record_event()?;
                    if index + 1 == layers {
                        last = Some(self.computing.record_event()?);
                    }
                    let copy = self.block_copy_at(&layer, layer_at(index));
                    transfers.push(
                        self.engine
                            .batch(&self.peer)
                            .write_blocks(copy)
                            .after(computed)
                            .submit()?,
                    );
                }
                Ok(())
            };
            let queued = queue();
            self.raise_gates_on_error(queued)?;
            let submitted = started.elapsed();
            let mut moving = transfers.into_iter().peekable();
            let mut compute_all = || -> Result<(), BoxError> {
                for _ in 0..layers {
                    let until = Instant::now() + compute;
                    while Instant::now() < until {
                        // Layers queue on one stream, so they end in order: the oldest one
                        // still moving is the one to look at.
                        if let Some(done) = moving.peek_mut().and_then(FutureExt::now_or_never) {
                            self.carried(done?)?;
                            moving.next();
                        }
                        std::hint::spin_loop();
                    }
                    gate += 1;
                    self.gate.write_at(0, &gate.to_le_bytes())?;
                }
                Ok(())
            };
            let ran = compute_all();
            self.raise_gates_on_error(ran)?;
            let release = Instant::now();
            if let Some(last) = &last {
                while !last.query()? {
                    if release.elapsed() > Duration::from_secs(10) {
                        return Err(
                            "the computing stream did not pass its last gate within 10 s".into(),
                        );
                    }
                }
            }
            let computed = Instant::now();
            for transfer in moving {
                self.carried(transfer.wait_spinning(WAIT_SPIN)?)?;
            }
            let tail = computed.elapsed();
            // A layer's time inside the engine includes its wait for the compute, so the row
            // leaves it out (0).
            if round >= 2 {
                released.push(release.elapsed().as_secs_f64() * 1e6);
                timing.latencies.push(tail.as_secs_f64() * 1e6);
                timing.submits.push(submitted.as_secs_f64() * 1e6);
            }
        }
        let mut alone = Vec::with_capacity(rounds);
        for round in 0..rounds + 2 {
            let started = Instant::now();
            let done = self
                .engine
                .batch(&self.peer)
                .write_blocks(self.block_copy_at(&layer, 0))
                .submit()?
                .wait_spinning(WAIT_SPIN)?;
            let elapsed = started.elapsed();
            self.carried(done)?;
            if round >= 2 {
                alone.push(elapsed.as_secs_f64() * 1e6);
            }
        }
        Ok((timing, released, median(&alone)))
    }

    /// `outcome`, after raising every `kv-layerwise` gate when it is an error: a layer that
    /// failed to queue or to end leaves gates down that nothing raises now, and every stream
    /// behind them would stay held.
    fn raise_gates_on_error(&self, outcome: Result<(), BoxError>) -> Result<(), BoxError> {
        if outcome.is_err() {
            self.gate.write_at(0, &u32::MAX.to_le_bytes())?;
        }
        outcome
    }

    fn batch(&self, shape: &Shape, direction: Direction) -> ferry::Batch {
        let mut batch = self.engine.batch(&self.peer);
        match shape {
            Shape::Paged(paged) => {
                let copy = self.block_copy(paged);
                batch = match direction {
                    Direction::Write => batch.write_blocks(copy),
                    Direction::Read => batch.read_blocks(copy),
                };
            }
            Shape::Entries(blocks) => {
                for &(local, remote, len) in blocks {
                    batch = match direction {
                        Direction::Write => {
                            batch.write(&self.local, local, self.remote + remote, len)
                        }
                        Direction::Read => {
                            batch.read(&self.local, local, self.remote + remote, len)
                        }
                    };
                }
            }
            Shape::Ping(len) => {
                batch = batch.write(&self.local, 0, self.remote, *len);
            }
        }
        batch
    }

    fn block_copy(&self, paged: &Paged) -> BlockCopy {
        self.block_copy_at(paged, 0)
    }

    /// The block copy of `paged`'s pools, which start `at` bytes into both sides' areas.
    fn block_copy_at(&self, paged: &Paged, at: u64) -> BlockCopy {
        let layout = BlockLayout::packed(paged.pool_bytes(), paged.block_bytes);
        let mut copy = BlockCopy::new(
            paged.block_bytes,
            layout,
            layout,
            Arc::clone(&paged.local_ids),
            Arc::clone(&paged.remote_ids),
        );
        let area = self.remote - self.remote_buffer.addr;
        for pool in 0..paged.pools {
            let offset = at + pool * paged.pool_bytes();
            copy = copy.pool_at(&self.local, offset, &self.remote_buffer, area + offset);
        }
        copy
    }

    /// `rounds` writes of `len` bytes with a notification each, after 20 warm-up ones: the
    /// microseconds from the start of each submit until the decode process held the
    /// notification, by the clock both processes share; and, interleaved with them, the same
    /// for a notification sent alone ([`ferry::Engine::notify_blocking`]).
    fn ping(&self, len: u64, rounds: usize) -> Result<(Vec<f64>, Vec<f64>), BoxError> {
        let mut latencies = Vec::with_capacity(rounds);
        let mut alone = Vec::with_capacity(rounds);
        for round in 0..rounds + 20 {
            let sent = now_ns();
            self.carried(
                self.engine
                    .batch(&self.peer)
                    .write(&self.local, 0, self.remote, len)
                    .notify(format!("ping {sent}").into_bytes())
                    .submit_blocking()?,
            )?;
            let held = self.echoed()?;
            let sent_alone = now_ns();
            self.engine
                .notify_blocking(&self.peer, format!("alone {sent_alone}"))?;
            let held_alone = self.echoed()?;
            if round >= 20 {
                latencies.push(held.saturating_sub(sent) as f64 / 1e3);
                alone.push(held_alone.saturating_sub(sent_alone) as f64 / 1e3);
            }
        }
        Ok((latencies, alone))
    }

    /// The time the decode process says it held the last notification, from its echo.
    fn echoed(&self) -> Result<u64, BoxError> {
        let echo = self
            .inbox
            .borrow_mut()
            .recv_timeout_blocking(Duration::from_secs(10))?
            .ok_or("the decode process did not echo a notification within 10 s")?;
        let text = String::from_utf8_lossy(&echo.payload).into_owned();
        let held = text
            .rsplit(' ')
            .next()
            .and_then(|field| field.parse().ok())
            .ok_or_else(|| format!("unexpected echo {text:?}"))?;
        Ok(held)
    }

    /// Checks every destination block against what its source block carries.
    fn verify(
        &self,
        blocks: &[(u64, u64, u64)],
        direction: Direction,
        base: &[u8],
    ) -> Result<bool, BoxError> {
        match direction {
            Direction::Write => {
                let mut gather = self.engine.batch(&self.peer);
                let mut at = 0;
                for &(_, remote, len) in blocks {
                    gather = gather.read(&self.check, at, self.remote + remote, len);
                    at += len;
                }
                self.carried(gather.submit_blocking()?)?;
                let mut landed = vec![0u8; at as usize];
                self.check.read_at(0, &mut landed)?;
                let mut at = 0usize;
                for (index, &(_, _, len)) in blocks.iter().enumerate() {
                    let len = len as usize;
                    if landed[at..at + len] != *block_bytes(base, index, len as u64) {
                        return Ok(false);
                    }
                    at += len;
                }
                Ok(true)
            }
            Direction::Read => {
                let mut landed = Vec::new();
                for (index, &(local, _, len)) in blocks.iter().enumerate() {
                    landed.resize(len as usize, 0);
                    self.local.read_at(local, &mut landed)?;
                    if landed != block_bytes(base, index, len) {
                        return Ok(false);
                    }
                }
                Ok(true)
            }
        }
    }
}

/// Runs `work` on this thread while `gemm` multiplies back to back on a thread of its own
/// (started first, so `work` begins with the GPU busy): `work`'s outcome and the GEMM's rate
/// over the same time.
fn beside<T>(
    gemm: &Gemm,
    work: impl FnOnce() -> Result<T, BoxError>,
) -> Result<(T, GemmRate), BoxError> {
    let stop = AtomicBool::new(false);
    let (opened, open) = mpsc::channel();
    std::thread::scope(|scope| {
        let running = scope.spawn(|| {
            gemm.rate_until(&stop, move || {
                // The receiver waits below until this is sent or the thread has failed.
                let _ = opened.send(());
            })
        });
        // An error means the GEMM failed before its window opened: `join` reports it.
        let _ = open.recv();
        let outcome = work();
        stop.store(true, Ordering::Release);
        let rate = running.join().map_err(|_| "the GEMM thread panicked")??;
        Ok((outcome?, rate))
    })
}

/// Fails unless a batch between `local` and the peer's buffer `remote` takes the transport
/// `wanted`, saying why `wanted` declined; so that a run asked to measure one transport stops
/// before it measures another.
fn routed_over(
    engine: &Engine,
    local: &Region,
    peer: &Peer,
    remote: &BufferDescriptor,
    wanted: &'static str,
) -> Result<(), BoxError> {
    let routes = engine.routes(local, peer);
    let Some(route) = routes.iter().find(|route| route.remote.addr == remote.addr) else {
        return Err(format!("the decode process has no buffer at {:#x}", remote.addr).into());
    };
    if route.chosen == Some(wanted) {
        return Ok(());
    }
    let why = route
        .answers
        .iter()
        .find(|(name, _)| *name == wanted)
        .map_or_else(
            || format!("this engine has no {wanted} transport"),
            |(_, reach)| match reach {
                Reach::No { reason } => reason.clone(),
                Reach::Yes { .. } => "another transport is cheaper".to_owned(),
            },
        );
    Err(format!(
        "transfers to the decode process would go over {} instead of {wanted}: {why}",
        route.chosen.unwrap_or("no transport")
    )
    .into())
}

/// Wall-clock nanoseconds since the Unix epoch, shared by every process of the host.
pub(crate) fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|since| since.as_nanos() as u64)
        .unwrap_or(0)
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
