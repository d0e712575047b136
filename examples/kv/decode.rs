//! The decode role: owns the KV pool, waits for announcements, verifies every block and tells
//! the prefill engine its operator named the outcome, so it does not reuse the blocks before
//! they were checked.

use super::{
    allocate_pools, decode_notification, encode_verdict, first_mismatch, reply_to, Announced,
    SecretFile, Shape, STAGING,
};
use clap::Args;
use std::io::Write;

/// Options of the decode role.
#[derive(Args, Debug, Clone)]
pub(crate) struct DecodeArgs {
    #[command(flatten)]
    pub(crate) shape: Shape,
    #[command(flatten)]
    pub(crate) placement: super::Placement,
    /// Control listener address.
    #[arg(long, default_value = "127.0.0.1:0")]
    pub(crate) listen: String,
    /// Host name or IP peers use to reach this engine (needed with 0.0.0.0).
    #[arg(long)]
    pub(crate) advertise: Option<String>,
    /// Requests to receive before exiting.
    #[arg(long, default_value_t = 1)]
    pub(crate) requests: u32,
    /// Name of the prefill engine to answer (its `segment:` line). Without it, the
    /// line `reply-to NAME` is read from stdin when the first answer is due.
    #[arg(long)]
    pub(crate) reply_to: Option<String>,
    #[command(flatten)]
    pub(crate) secret: SecretFile,
}

/// Runs the decode role; `Ok(false)` when some block did not verify.
pub(crate) fn run(args: DecodeArgs) -> Result<bool, Box<dyn std::error::Error>> {
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
    let pools = allocate_pools(&engine, shape.tensors(), shape.pool_bytes(), args.placement)?;
    // On a GPU, a request's blocks are checked in bulk: one paged copy per tensor gathers them,
    // in request order, into a staging buffer on the pools' GPU, read back in one piece
    // (reading 32 KiB blocks one by one took seconds per request). Host pools are read as
    // they are.
    let request_bytes = u64::from(shape.request_blocks) * shape.block_bytes;
    let gather = match args.placement.gpu {
        None => None,
        Some(_) => {
            let staging = allocate_pools(&engine, 1, request_bytes, args.placement)?
                .pop()
                .ok_or("no staging buffer was allocated")?;
            staging.set_name(STAGING)?;
            let itself = engine.connect_blocking(engine.name())?;
            let staged = itself
                .buffers()
                .into_iter()
                .find(|buffer| buffer.addr == staging.addr())
                .ok_or("the staging buffer is missing from this engine's own descriptor")?;
            Some(Gather {
                staging,
                itself,
                staged,
                order: (0..shape.request_blocks).collect(),
            })
        }
    };
    let mut gathered = vec![0u8; request_bytes as usize];
    let mut inbox = engine.notifications()?;
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "segment: {}", engine.name())?;
    stdout.flush()?;

    let mut all_good = true;
    // Opened when the first answer is due: the prefill engine starts after this one.
    let mut prefill: Option<ferry::Peer> = None;
    let mut handled = 0;
    while handled < args.requests {
        let note = inbox
            .recv_blocking()?
            .ok_or("the engine stopped before a request arrived")?;
        // Anyone who reaches the port may send a notification: one that is not a request of
        // this shape is logged, quoted, and skipped, never a reason to stop.
        let announced = decode_notification(&note.payload).and_then(|announced| {
            if announced.blocks.len() != shape.request_blocks as usize {
                return Err(format!(
                    "it names {} blocks where this shape's requests have {}",
                    announced.blocks.len(),
                    shape.request_blocks
                ));
            }
            match announced
                .blocks
                .iter()
                .find(|&&slot| slot >= shape.pool_blocks)
            {
                Some(slot) => Err(format!(
                    "block id {slot} is outside the {}-block pool",
                    shape.pool_blocks
                )),
                None => Ok(announced),
            }
        });
        let Announced {
            request,
            token,
            blocks,
        } = match announced {
            Ok(announced) => announced,
            Err(reason) => {
                tracing::warn!(
                    from = ?note.from,
                    payload = ?String::from_utf8_lossy(&note.payload),
                    %reason,
                    "ignoring a notification that is not a request"
                );
                continue;
            }
        };
        handled += 1;
        let started = std::time::Instant::now();
        let mut bad = None;
        let slots: std::sync::Arc<[u32]> = blocks.iter().copied().collect();
        'verify: for (tensor, pool) in pools.iter().enumerate() {
            match &gather {
                Some(gather) => gather.blocks(&engine, pool, &slots, shape, &mut gathered)?,
                None => {
                    for (at, &slot) in gathered
                        .chunks_exact_mut(shape.block_bytes as usize)
                        .zip(slots.iter())
                    {
                        pool.read_at(u64::from(slot) * shape.block_bytes, at)?;
                    }
                }
            }
            let chunks = gathered.chunks_exact(shape.block_bytes as usize);
            for ((logical, block), &slot) in chunks.enumerate().zip(blocks.iter()) {
                if let Some(byte) = first_mismatch(block, request, tensor as u32, logical as u32) {
                    bad = Some((tensor, logical, slot, byte));
                    break 'verify;
                }
            }
        }
        let checked = started.elapsed().as_secs_f64();
        let peer = match &prefill {
            Some(peer) => peer.clone(),
            None => {
                let given: Vec<String> = args.reply_to.iter().cloned().collect();
                let name = reply_to(&given)?
                    .into_iter()
                    .next()
                    .ok_or("no prefill engine to answer")?;
                let peer = engine.connect_blocking(&name)?;
                prefill = Some(peer.clone());
                peer
            }
        };
        let verdict = if bad.is_none() { "ok" } else { "bad" };
        engine.notify_blocking(&peer, encode_verdict(request, token, verdict))?;
        match bad {
            None => writeln!(
                stdout,
                "request {request}: {} blocks in {} tensors verified ({checked:.3} s to check)",
                blocks.len(),
                pools.len()
            )?,
            Some((tensor, logical, slot, byte)) => {
                all_good = false;
                writeln!(
                    stdout,
                    "request {request}: tensor {tensor} block {logical} (slot {slot}) differs at byte {byte}"
                )?;
            }
        }
        stdout.flush()?;
    }
    writeln!(stdout, "verified: {all_good}")?;
    Ok(all_good)
}

/// What the decode role gathers a request's blocks with on a GPU: a staging buffer there, this
/// engine as its own peer, the staging buffer as that peer sees it, and the request order.
struct Gather {
    staging: ferry::Region,
    itself: ferry::Peer,
    staged: ferry::BufferDescriptor,
    order: std::sync::Arc<[u32]>,
}

impl Gather {
    /// Copies the blocks `slots` of `pool`, in order, into `into` (the request's bytes of one
    /// tensor): one paged copy into the staging buffer, then one read.
    fn blocks(
        &self,
        engine: &ferry::Engine,
        pool: &ferry::Region,
        slots: &std::sync::Arc<[u32]>,
        shape: &Shape,
        into: &mut [u8],
    ) -> Result<(), Box<dyn std::error::Error>> {
        let copy = ferry::BlockCopy::packed(
            shape.block_bytes,
            std::sync::Arc::clone(slots),
            std::sync::Arc::clone(&self.order),
        )
        .pool(pool, &self.staged);
        engine
            .batch(&self.itself)
            .write_blocks(copy)
            .submit_blocking()?;
        self.staging.read_at(0, into)?;
        Ok(())
    }
}
