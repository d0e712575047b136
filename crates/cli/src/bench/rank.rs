//! One prefill rank of `ferry bench`'s multi-pair mode, run as a hidden `ferry bench-rank`
//! child: it fills its share of the TP-sharded KV cache, writes each decode rank the slice
//! of every block that rank holds when its parent says `round AT`, and checks what landed when
//! it says `verify`.
//!
//! The parent talks to it one line at a time: it prints `ready` once set up; `round AT` (AT in
//! wall-clock nanoseconds, shared by every process of the host) answers
//! `done START DECODE_RANK:BYTES:END ...`; `verify` answers `verified yes` or
//! `verified no WHERE`; end of input ends it.

use super::workload::{random_bytes, Paged};
use super::{now_ns, BoxError};
use ferry::tp::{HeadSlice, HeadSplit};
use ferry::{
    BlockCopy, BlockLayout, BufferDescriptor, CopyPath, Engine, Links, NvlinkConfig, Peer, Region,
};
use std::fmt::Write as _;
use std::io::{BufRead, Write};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What one prefill rank is told by its parent (`ferry bench-rank`, not for direct use).
#[derive(clap::Args, Debug)]
pub(crate) struct RankOptions {
    /// This rank's index on the prefill side.
    #[arg(long)]
    pub(crate) rank: u32,
    /// GPU of this rank's pools.
    #[arg(long)]
    pub(crate) gpu: u32,
    /// Prefill tensor-parallel ranks.
    #[arg(long)]
    pub(crate) prefill_tp: u32,
    /// Decode tensor-parallel ranks.
    #[arg(long)]
    pub(crate) decode_tp: u32,
    /// Decode ranks' engine names, in rank order.
    #[arg(long, value_delimiter = ',')]
    pub(crate) peers: Vec<String>,
    /// Decode ranks' pool addresses, in rank order.
    #[arg(long, value_delimiter = ',')]
    pub(crate) peer_addrs: Vec<u64>,
    /// Copy path.
    #[arg(long)]
    pub(crate) path: CopyPath,
    /// Copy streams per GPU.
    #[arg(long)]
    pub(crate) streams: usize,
    /// Thread blocks of the copy kernel per multiprocessor, at most.
    #[arg(long)]
    pub(crate) kernel_blocks_per_sm: u32,
    /// Bytes one warp of the copy kernel copies at a time, at most.
    #[arg(long)]
    pub(crate) kernel_chunk_bytes: u64,
    /// Multiprocessors the copy kernel may occupy at once, at most (all of them when not
    /// given), leaving the rest to other kernels.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub(crate) kernel_max_sms: Option<u32>,
    /// Seed of the block ids (the same on every rank).
    #[arg(long)]
    pub(crate) seed: u64,
    /// Seed of the data (different per rank and per run).
    #[arg(long)]
    pub(crate) data_seed: u64,
    /// Metadata store URL.
    #[arg(long)]
    pub(crate) metadata: String,
    #[command(flatten)]
    pub(crate) secret: crate::secret_file::SecretFile,
    #[command(flatten)]
    pub(crate) socket_dir: crate::socket_dir::SocketDirArg,
}

/// The sharded cache both sides use: `kv-llama70b-4k` split by heads.
pub(crate) struct Sharded {
    pub(crate) split: HeadSplit,
    pub(crate) paged: Paged,
}

impl Sharded {
    /// Bytes of all pools of one prefill rank.
    pub(crate) fn prefill_area(&self) -> u64 {
        self.paged.pools * self.paged.pool_blocks * self.split.prefill_block_bytes()
    }

    /// Bytes of all pools of one decode rank.
    pub(crate) fn decode_area(&self) -> u64 {
        self.paged.pools * self.paged.pool_blocks * self.split.decode_block_bytes()
    }

    /// Bytes `slice` moves in one request.
    pub(crate) fn slice_request_bytes(&self, slice: &HeadSlice) -> u64 {
        self.paged.pools * self.paged.local_ids.len() as u64 * self.split.slice_bytes(slice)
    }
}

/// One decode rank this prefill rank writes to.
struct Target {
    slice: HeadSlice,
    peer: Peer,
    /// The decode rank's buffer that holds its pools.
    buffer: BufferDescriptor,
    /// Where the pools start in `buffer`.
    offset: u64,
    /// The slice's copy from this rank's pools, built once and cloned for every round.
    copy: BlockCopy,
}

/// Runs one prefill rank until its input ends; errors end it with a message on stderr.
pub(crate) fn run(options: &RankOptions) -> Result<(), BoxError> {
    let sharded = Sharded {
        split: super::pairs::split(options.prefill_tp, options.decode_tp),
        paged: super::workload::llama(options.seed),
    };
    sharded.split.validate()?;
    let links = Links::default().nvlink(options.socket_dir.config(NvlinkConfig {
        streams_per_gpu: options.streams.max(1),
        copy_path: options.path,
        kernel_blocks_per_sm: options.kernel_blocks_per_sm.max(1),
        kernel_chunk_bytes: options.kernel_chunk_bytes.max(16),
        kernel_max_sms: options.kernel_max_sms,
        ..NvlinkConfig::default()
    }));
    let engine = super::sending_engine(links, &options.secret, &options.metadata)?;
    let pools = engine.allocate_device(options.gpu, sharded.prefill_area())?;
    let sent = fill(&pools, &sharded, options.data_seed)?;
    let mut targets = Vec::new();
    for slice in sharded.split.slices() {
        if slice.prefill_rank != options.rank {
            continue;
        }
        let rank = slice.decode_rank as usize;
        let (Some(name), Some(&addr)) = (options.peers.get(rank), options.peer_addrs.get(rank))
        else {
            return Err(format!("no --peers/--peer-addrs entry for decode rank {rank}").into());
        };
        let paged = &sharded.paged;
        let (local, _) = sharded.split.layouts(&slice, paged.pool_blocks);
        let copy = sharded.split.block_copy(
            &slice,
            paged.pool_blocks,
            Arc::clone(&paged.local_ids),
            Arc::clone(&paged.remote_ids),
        );
        let peer = engine.connect_blocking(name)?;
        let buffer = peer
            .buffer_at(addr)
            .ok_or_else(|| format!("decode rank {rank} registered no buffer at {addr:#x}"))?;
        let offset = addr - buffer.addr;
        targets.push(Target {
            copy: with_pools(
                &sharded,
                &slice,
                copy,
                &pools,
                local.pool_bytes,
                (&buffer, offset),
            ),
            slice,
            peer,
            buffer,
            offset,
        });
    }
    let widest = targets
        .iter()
        .map(|target| sharded.slice_request_bytes(&target.slice))
        .max()
        .unwrap_or(1);
    let check = engine.allocate_device(options.gpu, widest)?;
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "ready")?;
    stdout.flush()?;
    for line in std::io::stdin().lock().lines() {
        let line = line?;
        let mut words = line.split(' ');
        let answer = match (words.next(), words.next()) {
            (Some("round"), Some(at)) => round(&engine, &targets, at.parse()?)?,
            (Some("verify"), None) => verify(&engine, &check, &targets, &sharded, &sent)?,
            _ => return Err(format!("unexpected instruction {line:?}").into()),
        };
        writeln!(stdout, "{answer}")?;
        stdout.flush()?;
    }
    Ok(())
}

/// Random bytes for every block of the request, `[pool][request block][block]`, written to
/// the blocks' slots in `pools`; returns them to check against later.
fn fill(pools: &Region, sharded: &Sharded, seed: u64) -> Result<Vec<u8>, BoxError> {
    let block = sharded.split.prefill_block_bytes();
    let paged = &sharded.paged;
    let blocks = paged.pools as usize * paged.local_ids.len();
    let sent = random_bytes(seed, blocks * block as usize);
    let pool_bytes = paged.pool_blocks * block;
    let mut bytes = sent.chunks_exact(block as usize);
    for pool in 0..paged.pools {
        for &id in paged.local_ids.iter() {
            let chunk = bytes.next().ok_or("fewer bytes than blocks")?;
            pools.write_at(pool * pool_bytes + u64::from(id) * block, chunk)?;
        }
    }
    Ok(sent)
}

/// `copy` with one pool per tensor: tensor `t` at `t * local_pool_bytes` in `local`, and `t`
/// decode pools past `offset` in the decode rank's `buffer`.
fn with_pools(
    sharded: &Sharded,
    slice: &HeadSlice,
    mut copy: BlockCopy,
    local: &Region,
    local_pool_bytes: u64,
    (buffer, offset): (&BufferDescriptor, u64),
) -> BlockCopy {
    let paged = &sharded.paged;
    let (_, remote) = sharded.split.layouts(slice, paged.pool_blocks);
    for pool in 0..paged.pools {
        copy = copy.pool_at(
            local,
            pool * local_pool_bytes,
            buffer,
            offset + pool * remote.pool_bytes,
        );
    }
    copy
}

/// Why one target's write of a round did not complete.
#[derive(Debug, thiserror::Error)]
enum WriteFailed {
    /// The transfer failed; ferry's error says why and what to do.
    #[error(transparent)]
    Transfer(ferry::Error),
    /// The thread waiting for it panicked (its message went to stderr).
    #[error("a waiting thread panicked")]
    Panicked,
}

/// Waits until wall-clock `at`, writes every target its slice at once, and reports when each
/// write completed.
fn round(engine: &Engine, targets: &[Target], at: u64) -> Result<String, BoxError> {
    let copies: Vec<BlockCopy> = targets.iter().map(|target| target.copy.clone()).collect();
    // Spin on the monotonic clock: a wall clock stepped back must not stretch the wait.
    let wait = Duration::from_nanos(at.saturating_sub(now_ns()));
    let deadline = Instant::now() + wait;
    if let Some(nap) = wait.checked_sub(Duration::from_micros(200)) {
        std::thread::sleep(nap);
    }
    while Instant::now() < deadline {
        std::hint::spin_loop();
    }
    let start = now_ns();
    let mut transfers = Vec::with_capacity(targets.len());
    for (target, copy) in targets.iter().zip(copies) {
        transfers.push(engine.batch(&target.peer).write_blocks(copy).submit()?);
    }
    // One thread per transfer, so each pair's end is taken when it completes.
    let ends: Vec<Result<(u64, u64), WriteFailed>> = std::thread::scope(|scope| {
        let waiting: Vec<_> = transfers
            .into_iter()
            .map(|transfer| {
                scope.spawn(move || {
                    transfer
                        .wait_spinning(super::WAIT_SPIN)
                        .map(|done| (done.bytes, now_ns()))
                        .map_err(WriteFailed::Transfer)
                })
            })
            .collect();
        waiting
            .into_iter()
            .map(|thread| thread.join().unwrap_or(Err(WriteFailed::Panicked)))
            .collect()
    });
    let mut answer = format!("done {start}");
    for (target, end) in targets.iter().zip(ends) {
        let (bytes, end) = end?;
        let _ = write!(answer, " {}:{bytes}:{end}", target.slice.decode_rank);
    }
    Ok(answer)
}

/// Reads every target's slice back from the decode rank into `check` and compares it with
/// what was sent.
fn verify(
    engine: &Engine,
    check: &Region,
    targets: &[Target],
    sharded: &Sharded,
    sent: &[u8],
) -> Result<String, BoxError> {
    let paged = &sharded.paged;
    let block = sharded.split.prefill_block_bytes();
    let request_blocks = paged.local_ids.len() as u64;
    let packed: Arc<[u32]> = (0..request_blocks as u32).collect();
    let mut landed = Vec::new();
    for target in targets {
        let len = sharded.split.slice_bytes(&target.slice);
        let layout = BlockLayout::packed(request_blocks * len, len);
        let (local_layout, remote_layout) = sharded.split.layouts(&target.slice, paged.pool_blocks);
        let copy = BlockCopy::new(
            len,
            layout,
            remote_layout,
            Arc::clone(&packed),
            Arc::clone(&paged.remote_ids),
        );
        let copy = with_pools(
            sharded,
            &target.slice,
            copy,
            check,
            layout.pool_bytes,
            (&target.buffer, target.offset),
        );
        engine
            .batch(&target.peer)
            .read_blocks(copy)
            .submit_blocking()?;
        landed.resize((paged.pools * request_blocks * len) as usize, 0);
        check.read_at(0, &mut landed)?;
        let offset = local_layout.offset as usize;
        for (index, got) in landed.chunks_exact(len as usize).enumerate() {
            let at = index * block as usize + offset;
            if got != &sent[at..at + len as usize] {
                return Ok(format!(
                    "verified no decode rank {} pool {} block {}",
                    target.slice.decode_rank,
                    index as u64 / request_blocks,
                    index as u64 % request_blocks
                ));
            }
        }
    }
    Ok("verified yes".into())
}
