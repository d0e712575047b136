//! The `ferry` command line: inspect this machine and run a standalone engine.
#![forbid(unsafe_code)]

use clap::{Parser, Subcommand};
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
mod metrics_endpoint;
mod printable;
mod probe;
mod secret;
mod secret_file;
mod serve;
mod serve_child;
mod socket_dir;

#[derive(Subcommand)]
enum Command {
    /// Measure GPU to GPU transfers between two processes (this one and a `ferry serve` it
    /// starts) against the same-run `peer_copy` baseline, verifying every destination byte;
    /// with --rdma, over this host's RDMA NIC; with --prefill-gpus/--decode-gpus, between
    /// tensor-parallel groups of processes.
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
        #[command(flatten)]
        secret: secret_file::SecretFile,
        #[command(flatten)]
        socket_dir: socket_dir::SocketDirArg,
    },
    /// Run an engine that owns one host buffer peers can read and write, and print every
    /// notification it receives. Prints `segment: NAME` and `buffer: ADDR LEN` first, then
    /// `metrics: http://ADDR/metrics` with --metrics-addr.
    Serve(serve::Options),
    /// Print a new shared secret: 32 random bytes as one line of base64, for `--secret-file`
    /// (`ferry secret > ferry.secret`) or `FERRY_SECRET`. Give every engine of a deployment the
    /// same one.
    Secret,
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let outcome = match Cli::parse().command {
        Command::Bench(options) => match bench::run(&options) {
            Ok(true) => Ok(()),
            Ok(false) => Err("some bytes did not verify".into()),
            Err(error) => Err(error),
        },
        Command::BenchRank(options) => bench::run_rank(&options),
        Command::Probe {
            peer,
            metadata,
            secret,
            socket_dir,
        } => probe::run(peer.as_deref(), &metadata, &secret, &socket_dir),
        Command::Serve(options) => serve::run(&options),
        Command::Secret => secret::run(),
    };
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error}");
            ExitCode::FAILURE
        }
    }
}
