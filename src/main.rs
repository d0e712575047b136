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

#[derive(Subcommand)]
enum Command {
    /// Show what this machine offers: CUDA driver, GPUs, available transports.
    Probe,
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
        Command::Probe => probe(),
        Command::Serve {
            listen,
            advertise,
            bytes,
            metadata,
            notifications,
        } => serve(listen, advertise, bytes, &metadata, notifications),
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
    let driver = ferry::cuda::Driver::get();
    println!("cuda: {}", driver.status());
    println!("transports:");
    println!("  tcp: available (host memory, any host)");
    let reason = if driver.is_ready() {
        "GPU memory transports are not in this build yet"
    } else {
        "needs a CUDA driver and GPUs"
    };
    println!("  nvlink: unavailable ({reason})");
    Ok(())
}

fn serve(
    listen: String,
    advertise: Option<String>,
    bytes: usize,
    metadata: &str,
    limit: Option<u64>,
) -> Result<(), Box<dyn std::error::Error>> {
    let mut builder = ferry::Engine::builder()
        .listen(listen)
        .metadata(ferry::metadata::from_url(metadata)?);
    if let Some(host) = advertise {
        builder = builder.advertise(host);
    }
    let engine = builder.build_blocking()?;
    let buffer = engine.allocate(bytes)?;
    let mut inbox = engine.notifications()?;
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "segment: {}", engine.name())?;
    writeln!(stdout, "buffer: {:#x} {}", buffer.addr(), buffer.len())?;
    stdout.flush()?;
    let mut received = 0u64;
    while limit.is_none_or(|limit| received < limit) {
        let Some(note) = inbox.recv_blocking() else {
            break;
        };
        received += 1;
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
