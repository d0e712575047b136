//! The prefill role: for each request, fills its blocks, writes them into the decode pool in
//! one batch and notifies.

use super::{
    allocate_pools, await_answer, encode_notification, encode_verdict, fill_block, is_verdict_on,
    request_token, SecretFile, Shape,
};
use clap::Args;
use std::io::Write;
use std::time::{Duration, Instant};

/// Options of the prefill role.
#[derive(Args, Debug, Clone)]
pub(crate) struct PrefillArgs {
    #[command(flatten)]
    pub(crate) shape: Shape,
    #[command(flatten)]
    pub(crate) placement: super::Placement,
    /// Name of the decode engine (printed by `decode`).
    #[arg(long)]
    pub(crate) peer: String,
    /// Control listener address; the decode side answers here (`--reply-to` there).
    #[arg(long, default_value = "127.0.0.1:0")]
    pub(crate) listen: String,
    /// Host name or IP peers use to reach this engine (needed with 0.0.0.0).
    #[arg(long)]
    pub(crate) advertise: Option<String>,
    /// Requests to send, one after another (ids 0, 1, ...) into the same destination blocks:
    /// the first pays for first-touch page faults in the decode pool, later ones do not.
    #[arg(long, default_value_t = 1)]
    pub(crate) requests: u32,
    /// Send each block as its own batch entry instead of one paged block copy (the pools and
    /// the two id lists).
    #[arg(long)]
    pub(crate) entries: bool,
    #[command(flatten)]
    pub(crate) secret: SecretFile,
}

/// Salts that make source and destination block ids different permutations.
pub(crate) const SOURCE_SALT: u64 = 1;
/// See [`SOURCE_SALT`].
pub(crate) const DESTINATION_SALT: u64 = 2;

/// Runs the prefill role; prints `segment: NAME` (its engine name, the one the decode side answers), then
/// `transport:` and one `request ID: bytes B seconds S gbps G` line per request.
pub(crate) fn run(args: PrefillArgs) -> Result<(), Box<dyn std::error::Error>> {
    let shape = &args.shape;
    shape.validate()?;
    let mut builder = args.secret.apply(
        ferry::builder()
            .listen(args.listen.clone())
            .metadata(ferry::metadata::from_url(&shape.metadata)?),
    )?;
    if let Some(host) = &args.advertise {
        builder = builder.advertise(host.clone());
    }
    let engine = builder.build_blocking()?;
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "segment: {}", engine.name())?;
    stdout.flush()?;
    // Shared, so each request's block copy takes them without copying.
    let sources: std::sync::Arc<[u32]> = shape.block_ids(SOURCE_SALT).into();
    let destinations: std::sync::Arc<[u32]> = shape.block_ids(DESTINATION_SALT).into();
    let pools = allocate_pools(&engine, shape.tensors(), shape.pool_bytes(), args.placement)?;
    let mut inbox = engine.notifications()?;
    let peer = engine.connect_blocking(&args.peer)?;
    let mut remote = peer.buffers();
    remote.retain(|buffer| buffer.name.as_deref() != Some(super::STAGING));
    if remote.len() != pools.len() {
        return Err(format!(
            "the decode engine registered {} buffers, this shape needs {} (one per K and V tensor); run both with the same shape",
            remote.len(),
            pools.len()
        )
        .into());
    }
    let mut block = vec![0u8; shape.block_bytes as usize];
    for request in 0..u64::from(args.requests) {
        for (tensor, pool) in pools.iter().enumerate() {
            for (logical, &slot) in sources.iter().enumerate() {
                fill_block(&mut block, request, tensor as u32, logical as u32);
                pool.write_at(u64::from(slot) * shape.block_bytes, &block)?;
            }
        }
        let token = request_token()?;
        let started = Instant::now();
        let mut batch = engine.batch(&peer);
        if args.entries {
            for (pool, target) in pools.iter().zip(&remote) {
                for (&source, &destination) in sources.iter().zip(destinations.iter()) {
                    batch = batch.write(
                        pool,
                        u64::from(source) * shape.block_bytes,
                        target.addr + u64::from(destination) * shape.block_bytes,
                        shape.block_bytes,
                    );
                }
            }
        } else {
            let mut copy = ferry::BlockCopy::packed(
                shape.block_bytes,
                std::sync::Arc::clone(&sources),
                std::sync::Arc::clone(&destinations),
            );
            for (pool, target) in pools.iter().zip(&remote) {
                copy = copy.pool(pool, target);
            }
            batch = batch.write_blocks(copy);
        }
        let done = batch
            .notify(encode_notification(request, token, &destinations))
            .submit_blocking()?;
        let seconds = started.elapsed().as_secs_f64();
        if request == 0 {
            writeln!(stdout, "transport: {}", done.transports.join(","))?;
        }
        writeln!(
            stdout,
            "request {request}: bytes {} blocks {} seconds {seconds:.6} gbps {:.3}",
            done.bytes,
            pools.len() * sources.len(),
            done.bytes as f64 / seconds / 1e9
        )?;
        stdout.flush()?;
        // The decode side checks the blocks before this side may fill and send them again;
        // if it dies meanwhile, there is nothing to wait for. Only a verdict carrying this
        // request's token counts: another is not from the process that saw the request.
        let verdict = await_answer(
            &mut inbox,
            std::slice::from_ref(&peer),
            Duration::from_secs(120),
            |payload| is_verdict_on(payload, request, token),
        )
        .map_err(|error| format!("the decode side did not answer: {error}"))?;
        if verdict.payload != encode_verdict(request, token, "ok") {
            return Err(format!(
                "the decode side reported: {}",
                String::from_utf8_lossy(&verdict.payload)
            )
            .into());
        }
    }
    Ok(())
}
