//! `ferry bench`: every workload of `workload::ALL` GPU -> GPU between two processes through
//! ferry (this one and a `ferry serve` child it starts), against the same-run `peer_copy`
//! baseline (one in-process copy of a contiguous 1 GiB buffer), each as a write and then as a
//! read unless `--direction` picks one, with every destination byte checked after each row.
//! With `--tcp` or `--rdma` the same rows go over that transport alone, and a transfer that
//! another transport carried fails the run.

mod gpus;
mod options;
mod pairs;
mod plot;
mod rank;
mod rdma;
mod report;
mod side;
mod workload;

pub(crate) use options::Options;
use options::{direction_name, jobs, Directions, Job, SmCap};
pub(crate) use rank::{run as run_rank, RankOptions};
use side::Side;

use crate::serve_child::ServeChild;
use ferry::cuda::{Context, DeviceBuffer, Gemm, GemmRate, Stream};
use ferry::transport::{Reach, RDMA, TCP};
use ferry::{
    BlockCopy, BlockLayout, BufferDescriptor, Completion, CopyPath, Direction, Engine, Links,
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

type BoxError = Box<dyn std::error::Error>;

/// How long `--contend` measures the GEMM alone before each row.
const GEMM_ALONE: Duration = Duration::from_millis(500);

/// How long a bench thread looks for a transfer's end before it parks.
pub(crate) const WAIT_SPIN: Duration = Duration::from_millis(20);

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
    if !options.host {
        gpus::check(&[options.prefill_gpu, options.decode_gpu])?;
    }
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
    let decode_gpu = (!options.host).then_some(options.decode_gpu);
    progress.set_message(format!(
        "starting the decode process ({:.1} GiB {})",
        area as f64 / GIB as f64,
        decode_gpu.map_or_else(|| "of host memory".to_owned(), |gpu| format!("on GPU{gpu}"))
    ));
    let mut decode = ServeChild::start(
        area,
        decode_gpu,
        true,
        !options.rdma,
        &options.metadata,
        &options.secret,
        &options.socket_dir,
    )?;
    // Over RDMA there is no copy to compare with: the baseline is the port's line rate.
    let line_rate = options.rdma.then(rdma::line_rate_gbps).flatten();
    let peer_copy_gbps = match (options.rdma, options.host) {
        (true, _) => None,
        (false, true) => {
            progress.set_message("memcpy baseline");
            Some(host_copy(options.rounds()))
        }
        (false, false) => {
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
        host_memory: options.host,
        prefill_gpu: options.prefill_gpu,
        decode_gpu: options.decode_gpu,
        peer_copy_gbps,
        line_rate_gbps: line_rate,
        notify_requests: options.notify_requests,
        stage_cuda_malloc: options.stage_cuda_malloc,
        staging_bytes: options.stage_cuda_malloc.then_some(options.staging_bytes),
        staging_slots: options.staging_slots.filter(|_| options.stage_cuda_malloc),
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

/// The sending engine of a bench process: `links`, with the secret and metadata store the
/// command was given, and transfers allowed a minute (a cold first request is measured, not
/// failed).
fn sending_engine(
    links: Links,
    secret: &crate::secret_file::SecretFile,
    metadata: &str,
) -> Result<Engine, BoxError> {
    Ok(secret
        .apply(links.builder())?
        .metadata(ferry::metadata::from_url(metadata)?)
        .transfer_timeout(Duration::from_secs(60))
        .build_blocking()?)
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

/// The same-run baseline of host memory: GB/s of one in-process copy of 1 GiB between two
/// buffers whose pages were touched first, the median of `iterations` rounds (at least 10)
/// after two warm-up rounds.
fn host_copy(iterations: usize) -> f64 {
    let source = vec![7u8; GIB as usize];
    let mut target = vec![0u8; GIB as usize];
    let mut samples = Vec::new();
    for round in 0..iterations.max(10) + 2 {
        let started = Instant::now();
        target.copy_from_slice(&source);
        std::hint::black_box(&mut target);
        if round >= 2 {
            samples.push(GIB as f64 / started.elapsed().as_secs_f64() / 1e9);
        }
    }
    median(&samples)
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
