//! The `ferry` command line: inspect this machine and run a standalone engine.
#![forbid(unsafe_code)]

use clap::{Parser, Subcommand};
use std::io::Write;
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "ferry",
    version,
    about = "Moves KV caches between processes over the fastest link they share"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

mod bench;
mod probe;
mod serve_child;

#[derive(Subcommand)]
enum Command {
    /// Measure GPU to GPU transfers between two processes (this one and a `ferry serve` it
    /// starts) against the same-run `peer_copy` baseline, verifying every destination byte;
    /// with --prefill-gpus/--decode-gpus, between tensor-parallel groups of processes.
    Bench(bench::Options),
    /// One prefill rank of `ferry bench`'s multi-pair mode, driven by its parent.
    #[command(hide = true)]
    BenchRank(bench::RankOptions),
    /// Show what this machine offers: CUDA driver, GPUs, available transports; with --peer,
    /// which transport each of a peer's buffers gets from here, and why.
    Probe {
        /// Segment name of a running engine (`host:port` with p2p metadata) to check the
        /// paths to, from host memory and from every GPU this process sees.
        #[arg(long)]
        peer: Option<String>,
        /// Metadata store URL, to look the peer up.
        #[arg(long, default_value = "p2p")]
        metadata: String,
    },
    /// Run an engine that owns one host buffer peers can read and write, and print every
    /// notification it receives. Prints `segment: NAME` and `buffer: ADDR LEN` first.
    Serve {
        /// Control listener address.
        #[arg(long, default_value = "127.0.0.1:0")]
        listen: String,
        /// Host name or IP peers use to reach this engine (needed with 0.0.0.0).
        #[arg(long)]
        advertise: Option<String>,
        /// Size of the registered buffer in bytes.
        #[arg(long, default_value_t = 64 << 20)]
        bytes: usize,
        /// Metadata store URL.
        #[arg(long, default_value = "p2p")]
        metadata: String,
        /// Exit after this many notifications (run until killed when absent).
        #[arg(long)]
        notifications: Option<u64>,
        /// Put the buffer on this GPU (`cudaMalloc` memory) instead of in host memory.
        #[arg(long)]
        gpu: Option<u32>,
        /// Answer every notification with one to its sender carrying `held <ns>`: the
        /// wall-clock time this process held it (for `ferry bench`'s latency rows).
        #[arg(long)]
        echo: bool,
        /// With --gpu: make the buffer VMM memory in this many allocations mapped back to
        /// back (as PyTorch's expandable segments are), each rounded up to the granularity.
        #[arg(long, requires = "gpu")]
        vmm_pieces: Option<usize>,
    },
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let outcome = match Cli::parse().command {
        Command::Bench(options) => match bench::run(&options) {
            Ok(true) => Ok(()),
            Ok(false) => Err("some bytes did not verify".into()),
            Err(error) => Err(error),
        },
        Command::BenchRank(options) => bench::run_rank(&options),
        Command::Probe { peer, metadata } => probe::run(peer.as_deref(), &metadata),
        Command::Serve {
            listen,
            advertise,
            bytes,
            metadata,
            notifications,
            gpu,
            echo,
            vmm_pieces,
        } => serve(
            listen,
            advertise,
            bytes,
            &metadata,
            notifications,
            gpu.map(|ordinal| (ordinal, vmm_pieces)),
            echo,
        ),
    };
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error}");
            ExitCode::FAILURE
        }
    }
}

fn serve(
    listen: String,
    advertise: Option<String>,
    bytes: usize,
    metadata: &str,
    limit: Option<u64>,
    gpu: Option<(u32, Option<usize>)>,
    echo: bool,
) -> Result<(), Box<dyn std::error::Error>> {
    let mut builder = ferry::Engine::builder()
        .listen(listen)
        .metadata(ferry::metadata::from_url(metadata)?);
    if let Some(host) = advertise {
        builder = builder.advertise(host);
    }
    let engine = builder.build_blocking()?;
    let buffer = match gpu {
        Some((ordinal, None)) => engine.allocate_device(ordinal, bytes)?,
        Some((ordinal, Some(pieces))) => {
            engine.allocate_device_vmm(ordinal, bytes.div_ceil(pieces.max(1)), pieces)?
        }
        None => engine.allocate(bytes)?,
    };
    if gpu.is_some() {
        // GPU memory starts with whatever was there: clear it a chunk at a time.
        let chunk = vec![0u8; buffer.len().min(256 << 20) as usize];
        let mut at = 0;
        while at < buffer.len() {
            let len = (buffer.len() - at).min(chunk.len() as u64);
            buffer.write_at(at, &chunk[..len as usize])?;
            at += len;
        }
    }
    let mut inbox = engine.notifications()?;
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "segment: {}", engine.name())?;
    writeln!(stdout, "buffer: {:#x} {}", buffer.addr(), buffer.len())?;
    stdout.flush()?;
    let mut received = 0u64;
    // Senders answered before, so each echo costs no metadata lookup.
    let mut senders = std::collections::HashMap::new();
    while limit.is_none_or(|limit| received < limit) {
        let Some(note) = inbox.recv_blocking() else {
            break;
        };
        received += 1;
        if echo {
            let held = bench::now_ns();
            let sender = match senders.entry(note.from) {
                std::collections::hash_map::Entry::Occupied(known) => known.into_mut(),
                std::collections::hash_map::Entry::Vacant(slot) => {
                    let peer = engine.connect_blocking(slot.key())?;
                    slot.insert(peer)
                }
            };
            let reply = format!("held {held}");
            futures::executor::block_on(engine.notify(sender, reply.into_bytes()))?;
            continue;
        }
        writeln!(
            stdout,
            "notification from {}: {}",
            note.from,
            String::from_utf8_lossy(&note.payload)
        )?;
        stdout.flush()?;
    }
    Ok(())
}
