//! `ferry bench`: GPU0 -> GPU1 between two processes through ferry, against the same-run
//! `peer_copy` baseline (one in-process copy of a contiguous 1 GiB buffer), with the bytes
//! verified after every workload.

use crate::serve_child::ServeChild;
use ferry::cuda::{Context, DeviceBuffer, Event, Stream};
use ferry::{Engine, NvlinkConfig, Peer, Region};
use std::time::{Duration, Instant};

const GIB: usize = 1 << 30;

/// The two GPUs of a run.
pub(crate) struct Gpus {
    /// GPU of the sending (prefill) process.
    pub(crate) prefill: u32,
    /// GPU of the receiving (decode) process.
    pub(crate) decode: u32,
}

/// One row of the table.
struct Row {
    workload: &'static str,
    streams: usize,
    gbps: f64,
    verified: bool,
}

/// Source and destination offset and length of every block of a workload.
fn blocks_of(workload: &str) -> Result<Vec<(u64, u64, u64)>, String> {
    match workload {
        "contiguous" => Ok(vec![(0, 0, GIB as u64)]),
        "blocks-1m" => Ok((0..1024u64)
            .map(|index| (index << 20, ((index * 389 + 7) % 1024) << 20, 1 << 20))
            .collect()),
        other => Err(format!(
            "unknown workload {other:?}; known: contiguous, blocks-1m"
        )),
    }
}

/// Runs the workloads once per stream count and prints the table; `Ok(false)` when some bytes
/// did not verify.
pub(crate) fn run(
    workloads: &[String],
    gpus: Gpus,
    iterations: usize,
    streams: &[usize],
) -> Result<bool, Box<dyn std::error::Error>> {
    let decode = ServeChild::start(GIB, gpus.decode)?;
    let pattern: Vec<u8> = (0..GIB).map(|index| (index * 131 % 251) as u8).collect();
    let baseline = peer_copy(gpus.prefill, gpus.decode, iterations)?;
    println!(
        "peer_copy (GPU{} -> GPU{}, 1 GiB, one process): {baseline:.1} GB/s",
        gpus.prefill, gpus.decode
    );
    let mut rows = Vec::new();
    for &stream_count in streams {
        let engine = Engine::builder()
            .transfer_timeout(Duration::from_secs(60))
            .nvlink(NvlinkConfig {
                streams_per_gpu: stream_count.max(1),
                ..NvlinkConfig::default()
            })
            .build_blocking()?;
        let source = engine.allocate_device(gpus.prefill, GIB)?;
        let back = engine.allocate_device(gpus.prefill, GIB)?;
        source.write_at(0, &pattern)?;
        let peer = engine.connect_blocking(&decode.name)?;
        for workload in workloads {
            let blocks = blocks_of(workload)?;
            let gbps = measure(
                &engine,
                &peer,
                &source,
                decode.buffer_addr,
                &blocks,
                iterations,
            )?;
            let verified = verify(&engine, &peer, &back, decode.buffer_addr, &blocks, &pattern)?;
            rows.push(Row {
                workload: workload_name(workload),
                streams: stream_count,
                gbps,
                verified,
            });
        }
    }
    println!(
        "{:<16} {:>7} {:>10} {:>10} {:>7}  verified",
        "workload", "streams", "GB/s", "peer_copy", "ratio"
    );
    for row in &rows {
        println!(
            "{:<16} {:>7} {:>10.1} {:>10.1} {:>7.3}  {}",
            row.workload,
            row.streams,
            row.gbps,
            baseline,
            row.gbps / baseline,
            row.verified
        );
    }
    Ok(rows.iter().all(|row| row.verified))
}

fn workload_name(name: &str) -> &'static str {
    match name {
        "contiguous" => "contiguous",
        _ => "blocks-1m",
    }
}

fn median(mut samples: Vec<f64>) -> f64 {
    samples.sort_by(f64::total_cmp);
    samples[samples.len() / 2]
}

/// One copy of a contiguous 1 GiB buffer GPU `from` -> GPU `to` in this process, median GB/s.
fn peer_copy(from: u32, to: u32, iterations: usize) -> Result<f64, Box<dyn std::error::Error>> {
    let (source_context, target_context) = (Context::get(from)?, Context::get(to)?);
    if from != to {
        source_context.enable_peer_access(&target_context)?;
    }
    let source = DeviceBuffer::new(source_context.clone(), GIB)?;
    let target = DeviceBuffer::new(target_context, GIB)?;
    let stream = Stream::new(source_context)?;
    let mut samples = Vec::new();
    for round in 0..iterations + 2 {
        let started = Instant::now();
        stream.copy_buffer(&target, &source, GIB)?;
        let event = Event::record(&stream)?;
        stream.synchronize()?;
        while !event.query()? {}
        if round >= 2 {
            samples.push(GIB as f64 / started.elapsed().as_secs_f64() / 1e9);
        }
    }
    Ok(median(samples))
}

fn measure(
    engine: &Engine,
    peer: &Peer,
    source: &Region,
    remote: u64,
    blocks: &[(u64, u64, u64)],
    iterations: usize,
) -> Result<f64, Box<dyn std::error::Error>> {
    let bytes: u64 = blocks.iter().map(|block| block.2).sum();
    let mut samples = Vec::new();
    for round in 0..iterations + 2 {
        let started = Instant::now();
        let mut batch = engine.batch(peer);
        for &(local, target, len) in blocks {
            batch = batch.write(source, local, remote + target, len);
        }
        batch.submit_blocking()?;
        if round >= 2 {
            samples.push(bytes as f64 / started.elapsed().as_secs_f64() / 1e9);
        }
    }
    Ok(median(samples))
}

/// Reads the peer's whole buffer back and checks every block against what was sent.
fn verify(
    engine: &Engine,
    peer: &Peer,
    back: &Region,
    remote: u64,
    blocks: &[(u64, u64, u64)],
    pattern: &[u8],
) -> Result<bool, Box<dyn std::error::Error>> {
    back.write_at(0, &vec![0u8; GIB])?;
    engine
        .batch(peer)
        .read(back, 0, remote, GIB as u64)
        .submit_blocking()?;
    let mut landed = vec![0u8; GIB];
    back.read_at(0, &mut landed)?;
    Ok(blocks.iter().all(|&(local, target, len)| {
        let (local, target, len) = (local as usize, target as usize, len as usize);
        landed[target..target + len] == pattern[local..local + len]
    }))
}
