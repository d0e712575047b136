//! The prefill role: fills one request's blocks, writes them into the decode pool, notifies.

use super::{encode_notification, fill_block, Shape};
use clap::Args;
use std::io::Write;
use std::time::Instant;

/// Options of the prefill role.
#[derive(Args, Debug, Clone)]
pub(crate) struct PrefillArgs {
    #[command(flatten)]
    pub(crate) shape: Shape,
    /// Segment name of the decode engine (printed by `decode`).
    #[arg(long)]
    pub(crate) peer: String,
    /// Request id to send.
    #[arg(long, default_value_t = 0)]
    pub(crate) request: u64,
}

/// Salts that make source and destination block ids different permutations.
pub(crate) const SOURCE_SALT: u64 = 1;
/// See [`SOURCE_SALT`].
pub(crate) const DESTINATION_SALT: u64 = 2;

/// Runs the prefill role and prints `transport:`, `bytes:`, `seconds:` and `gbps:` lines.
pub(crate) fn run(args: PrefillArgs) -> Result<(), Box<dyn std::error::Error>> {
    let shape = &args.shape;
    shape.validate()?;
    let engine = ferry::Engine::builder()
        .metadata(ferry::metadata::from_url(&shape.metadata)?)
        .build_blocking()?;
    let sources = shape.block_ids(SOURCE_SALT);
    let destinations = shape.block_ids(DESTINATION_SALT);
    let pools = (0..shape.tensors())
        .map(|_| engine.allocate(shape.pool_bytes() as usize))
        .collect::<Result<Vec<_>, _>>()?;
    let mut block = vec![0u8; shape.block_bytes as usize];
    for (tensor, pool) in pools.iter().enumerate() {
        for (logical, &slot) in sources.iter().enumerate() {
            fill_block(&mut block, args.request, tensor as u32, logical as u32);
            pool.write_at(u64::from(slot) * shape.block_bytes, &block)?;
        }
    }

    let peer = engine.connect_blocking(&args.peer)?;
    let remote = peer.buffers();
    if remote.len() != pools.len() {
        return Err(format!(
            "the decode engine registered {} buffers, this shape needs {} (one per K and V tensor); run both with the same shape",
            remote.len(),
            pools.len()
        )
        .into());
    }
    let started = Instant::now();
    let mut batch = engine.batch(&peer);
    for (pool, target) in pools.iter().zip(&remote) {
        for (&source, &destination) in sources.iter().zip(&destinations) {
            batch = batch.write(
                pool,
                u64::from(source) * shape.block_bytes,
                target.addr + u64::from(destination) * shape.block_bytes,
                shape.block_bytes,
            );
        }
    }
    let done = batch
        .notify(encode_notification(args.request, &destinations))
        .submit_blocking()?;
    let seconds = started.elapsed().as_secs_f64();
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "transport: {}", done.transports.join(","))?;
    writeln!(stdout, "bytes: {}", done.bytes)?;
    writeln!(stdout, "blocks: {}", pools.len() * sources.len())?;
    writeln!(stdout, "seconds: {seconds:.6}")?;
    writeln!(stdout, "gbps: {:.3}", done.bytes as f64 / seconds / 1e9)?;
    stdout.flush()?;
    Ok(())
}
