//! The `ferry` command line: inspect this machine and run a standalone engine.
#![forbid(unsafe_code)]

use clap::{Parser, Subcommand};
use ferry::cuda::{probe_fabric, Driver, FabricSupport};
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
mod echo;
mod secret_file;
mod serve;
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
    /// Show what this machine offers: CUDA driver, GPUs, available transports.
    Probe,
    /// Run an engine that owns one host buffer peers can read and write, and print every
    /// notification it receives. Prints `segment: NAME` and `buffer: ADDR LEN` first.
    Serve(serve::Options),
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
        Command::Probe => probe(),
        Command::Serve(options) => serve::run(&options),
    };
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error}");
            ExitCode::FAILURE
        }
    }
}

fn probe() -> Result<(), Box<dyn std::error::Error>> {
    let driver = Driver::get();
    println!("cuda: {}", driver.status());
    let gpus = driver.devices()?;
    for gpu in &gpus {
        println!(
            "gpu {}: {} {} pci {}",
            gpu.ordinal, gpu.name, gpu.uuid, gpu.pci_bus_id
        );
    }
    if gpus.len() > 1 {
        println!("peer access (row reads/writes column):");
        for from in &gpus {
            let row: Vec<String> = gpus
                .iter()
                .map(|to| match from.ordinal == to.ordinal {
                    true => "  -".to_owned(),
                    false => match driver.can_access_peer(from.ordinal, to.ordinal) {
                        Ok(true) => "yes".to_owned(),
                        Ok(false) => " no".to_owned(),
                        Err(error) => format!("error: {error}"),
                    },
                })
                .collect();
            println!("  gpu {}: {}", from.ordinal, row.join(" "));
        }
    }
    let fabric: Vec<(u32, FabricSupport)> = gpus
        .iter()
        .map(|gpu| (gpu.ordinal, probe_fabric(gpu.ordinal)))
        .collect();
    for (ordinal, support) in &fabric {
        match support {
            FabricSupport::Permitted => println!("fabric handles on gpu {ordinal}: permitted"),
            FabricSupport::Refused(error) => {
                println!("fabric handles on gpu {ordinal}: refused ({error})")
            }
        }
    }
    println!("transports:");
    println!("  tcp: available (any host; GPU memory staged through pinned host buffers)");
    match gpus.is_empty() {
        true => println!("  nvlink: unavailable ({})", driver.status()),
        false => {
            println!("  nvlink: available (cudaMalloc and POSIX-fd VMM memory of processes on this host)")
        }
    }
    let permitted = fabric
        .iter()
        .any(|(_, support)| *support == FabricSupport::Permitted);
    match (gpus.is_empty(), permitted) {
        (true, _) => println!("  mnnvl: unavailable ({})", driver.status()),
        (false, false) => println!("  mnnvl: unavailable (no GPU here permits FABRIC-handle allocations)"),
        (false, true) => println!("  mnnvl: available (VMM memory with FABRIC handles, any node of the NVLink domain; not yet run on GB200 hardware)"),
    }
    Ok(())
}
