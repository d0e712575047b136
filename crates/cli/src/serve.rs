//! `ferry serve`: a standalone engine with one buffer, for tests, benchmarks and trying
//! ferry out.

use std::io::Write;

/// What `ferry serve` was asked for.
#[derive(clap::Args, Debug)]
pub(crate) struct Options {
    /// Control listener address.
    #[arg(long, default_value = "127.0.0.1:0")]
    pub(crate) listen: String,
    /// Host name or IP peers use to reach this engine (needed with 0.0.0.0).
    #[arg(long)]
    pub(crate) advertise: Option<String>,
    /// Size of the registered buffer in bytes.
    #[arg(long, default_value_t = 64 << 20)]
    pub(crate) bytes: usize,
    /// Metadata store URL.
    #[arg(long, default_value = "p2p")]
    pub(crate) metadata: String,
    /// Exit after this many notifications (run until killed when absent).
    #[arg(long)]
    pub(crate) notifications: Option<u64>,
    /// Put the buffer on this GPU (`cudaMalloc` memory) instead of in host memory.
    #[arg(long)]
    pub(crate) gpu: Option<u32>,
    /// Answer every notification with one carrying `held <ns>`: the wall-clock time this
    /// process held it (for `ferry bench`'s latency rows). The answer goes to the engine
    /// named by --reply-to, or by the latest `reply-to NAME` line on stdin (confirmed with
    /// `reply-to: NAME` on stdout), never to the sender a notification claims to be from.
    #[arg(long)]
    pub(crate) echo: bool,
    /// With --echo: segment name of the engine that gets the answers.
    #[arg(long, requires = "echo")]
    pub(crate) reply_to: Option<String>,
    /// With --gpu: make the buffer VMM memory in this many allocations mapped back to
    /// back (as PyTorch's expandable segments are), each rounded up to the granularity.
    #[arg(long, requires = "gpu")]
    pub(crate) vmm_pieces: Option<usize>,
    /// Leave out the GPU-to-GPU transports (nvlink, mnnvl): peers then reach the buffer over
    /// RDMA or TCP (`ferry bench --rdma` starts its decode process so).
    #[arg(long)]
    pub(crate) no_gpu_links: bool,
    /// Serve the engine's metrics as Prometheus text at `http://HOST:PORT/metrics` (a fixed
    /// port, loopback unless --metrics-public); no metrics are kept when absent. At most 8
    /// scrapes at once, each within 5 s.
    #[arg(long, value_name = "HOST:PORT")]
    pub(crate) metrics_addr: Option<String>,
    /// Allow --metrics-addr on a non-loopback address. The endpoint has no authentication and
    /// shows the engine's peers and traffic: admit only the scraper (firewall, network policy).
    #[arg(long, requires = "metrics_addr")]
    pub(crate) metrics_public: bool,
    #[command(flatten)]
    pub(crate) secret: crate::secret_file::SecretFile,
    #[command(flatten)]
    pub(crate) socket_dir: crate::socket_dir::SocketDirArg,
}

/// Runs the engine until `--notifications` arrived, or forever.
pub(crate) fn run(options: &Options) -> Result<(), Box<dyn std::error::Error>> {
    let bytes = options.bytes;
    let limit = options.notifications;
    let gpu = options.gpu.map(|ordinal| (ordinal, options.vmm_pieces));
    let metrics = options
        .metrics_addr
        .as_deref()
        .map(|address| crate::metrics_endpoint::install(address, options.metrics_public))
        .transpose()?;
    let mut builder = options.secret.apply(
        ferry::Links::default()
            .gpu_links(!options.no_gpu_links)
            .nvlink(options.socket_dir.config(ferry::NvlinkConfig::default()))
            .builder()
            .listen(options.listen.clone())
            .metadata(ferry::metadata::from_url(&options.metadata)?),
    )?;
    if let Some(host) = &options.advertise {
        builder = builder.advertise(host.clone());
    }
    let engine = builder.build_blocking()?;
    let buffer = match gpu {
        Some((ordinal, None)) => engine.allocate_device(ordinal, bytes as u64)?,
        Some((ordinal, Some(pieces))) => {
            engine.allocate_device_vmm(ordinal, bytes.div_ceil(pieces.max(1)) as u64, pieces)?
        }
        None => engine.allocate(bytes as u64)?,
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
    {
        let mut stdout = std::io::stdout().lock();
        writeln!(stdout, "segment: {}", engine.name())?;
        writeln!(stdout, "buffer: {:#x} {}", buffer.addr(), buffer.len())?;
        if let Some(address) = metrics {
            writeln!(stdout, "metrics: http://{address}/metrics")?;
        }
        stdout.flush()?;
    }
    let reply_to = options
        .echo
        .then(|| crate::echo::ReplyTo::new(options.reply_to.clone()));
    let mut received = 0u64;
    while limit.is_none_or(|limit| received < limit) {
        let Some(note) = inbox.recv_blocking()? else {
            break;
        };
        received += 1;
        match &reply_to {
            Some(reply_to) => {
                reply_to.answer(&engine, &format!("held {}", crate::bench::now_ns()))?
            }
            None => {
                let mut stdout = std::io::stdout().lock();
                // Both are the peer's words: quoted, so they cannot pass for lines of ours.
                writeln!(
                    stdout,
                    "notification from {} (as it claims): {}",
                    crate::printable::quoted(note.from.as_bytes()),
                    crate::printable::quoted(&note.payload)
                )?;
                stdout.flush()?;
            }
        }
    }
    Ok(())
}
