//! Host cost of handing ferry the kv-llama70b-4k request: 40,960 blocks (160 tensors x 256
//! blocks), as one paged block copy (the tensors in one region, and a region per tensor as
//! vLLM registers them) and as 40,960 separate entries (reported per entry:
//! written and read, planned into a block copy for a transport that prefers them, as nvlink
//! does, and kept flat for one that does not); the same request as vLLM's MooncakeConnector
//! sends it, one entry per run of 1-64 consecutive blocks (reported per block); a
//! token-granularity request: 250,000 block ids of one pool as one paged block copy; and one
//! 4 KiB write, the latency-bound case.
//! Measures what the submitting thread pays, from building the batch until `submit` returns:
//! checking every range against both sides' registrations, choosing the transport and handing
//! it the ops.
//!
//! Host memory with 256-byte blocks; the transport is a stand-in that takes the ops and moves
//! nothing, so the figure is the
//! engine's own cost on any machine; on GPU memory the nvlink transport adds building its
//! kernel arguments and the launch (`ferry bench` shows the whole cost as `submit us`).

use criterion::{criterion_group, criterion_main, Criterion};
use ferry::transport::{BlockOps, Endpoint, Link, Reach, TransferOps, Transport};
use ferry::{
    BlockCopy, BlockLayout, BufferDescriptor, Engine, Location, Peer, Region, RegionInfo,
    SegmentDescriptor,
};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Takes every host-memory op (cheaper than TCP) and completes it without moving a byte;
/// `blocks` says whether it prefers block copies (so the engine plans flat entries for it).
struct Counting {
    blocks: bool,
}

#[async_trait::async_trait]
impl Transport for Counting {
    fn name(&self) -> &'static str {
        "counting"
    }

    fn endpoint(&self) -> Option<Endpoint> {
        None
    }

    fn prefers_blocks(&self) -> bool {
        self.blocks
    }

    fn reach(&self, local: &RegionInfo, _: &SegmentDescriptor, _: &BufferDescriptor) -> Reach {
        match local.location {
            Location::Host { .. } => Reach::Yes { cost: 1 },
            _ => Reach::No {
                reason: "host memory only".into(),
            },
        }
    }

    async fn open(&self, _: &SegmentDescriptor) -> ferry::Result<Arc<dyn Link>> {
        Ok(Arc::new(Counting {
            blocks: self.blocks,
        }))
    }
}

#[async_trait::async_trait]
impl Link for Counting {
    async fn transfer(&self, ops: TransferOps) -> ferry::Result<()> {
        let bytes: u64 = ops.iter().map(|op| op.len).sum();
        assert!(bytes > 0);
        Ok(())
    }

    async fn transfer_blocks(&self, blocks: BlockOps) -> ferry::Result<()> {
        assert!(blocks.bytes() > 0);
        Ok(())
    }

    fn is_alive(&self) -> bool {
        true
    }

    fn close(&self) {}
}

const TENSORS: u64 = 160;
const POOL_BLOCKS: u64 = 4096;
const REQUEST_BLOCKS: u64 = 256;
const BLOCK: u64 = 256;
const POOL: u64 = POOL_BLOCKS * BLOCK;
/// Entries of the flat form: one per block of every tensor.
const ENTRIES: u64 = TENSORS * REQUEST_BLOCKS;
/// Block ids of the token-granularity request, and the blocks of its one pool.
const TOKEN_IDS: u64 = 250_000;
const TOKEN_POOL_BLOCKS: u64 = 1 << 18;
/// The MLA request (`ferry bench`'s mla-tokens): 61 layer pools of 8,192 tokens of 1,152
/// bytes, 4,096 tokens a layer in runs of 1-64 tokens.
const MLA_LAYERS: u64 = 61;
const MLA_POOL_TOKENS: u64 = 8192;
const MLA_TOKEN: u64 = 1152;
const MLA_REQUEST_TOKENS: u64 = 4096;

struct Sides {
    _decode: Engine,
    _pool: Region,
    prefill: Engine,
    source: Region,
    peer: Peer,
    /// The decode pool as the prefill side sees it.
    remote: BufferDescriptor,
}

/// Engines on both sides with a pool of `bytes` each, the prefill side's ops taken by
/// [`Counting`] (preferring block copies when `blocks`).
fn engines(bytes: u64, blocks: bool) -> Sides {
    let decode = ferry::builder().build_blocking().expect("decode engine");
    let pool = decode.allocate(bytes).expect("pool");
    let prefill = ferry::builder()
        .transport(Arc::new(Counting { blocks }))
        .build_blocking()
        .expect("prefill engine");
    let source = prefill.allocate(bytes).expect("source");
    let peer = prefill.connect_blocking(decode.name()).expect("connect");
    let remote = peer.buffers().swap_remove(0);
    Sides {
        _decode: decode,
        _pool: pool,
        prefill,
        source,
        peer,
        remote,
    }
}

/// [`Sides`] with a region per tensor.
struct TensorSides {
    _decode: Engine,
    _pools: Vec<Region>,
    prefill: Engine,
    sources: Vec<Region>,
    peer: Peer,
    /// The decode pools as the prefill side sees them, in registration order.
    remotes: Vec<BufferDescriptor>,
}

/// Engines on both sides with [`TENSORS`] regions of `bytes` each, as a server registers one
/// tensor per layer and side; the prefill side's ops taken by [`Counting`], which prefers
/// block copies.
fn tensor_engines(bytes: u64) -> TensorSides {
    let decode = ferry::builder().build_blocking().expect("decode engine");
    let pools: Vec<Region> = (0..TENSORS)
        .map(|_| decode.allocate(bytes).expect("pool"))
        .collect();
    let prefill = ferry::builder()
        .transport(Arc::new(Counting { blocks: true }))
        .build_blocking()
        .expect("prefill engine");
    let sources = (0..TENSORS)
        .map(|_| prefill.allocate(bytes).expect("source"))
        .collect();
    let peer = prefill.connect_blocking(decode.name()).expect("connect");
    let mut remotes = peer.buffers();
    remotes.sort_by_key(|buffer| {
        pools
            .iter()
            .position(|pool| pool.addr() == buffer.addr)
            .expect("a decode pool")
    });
    TensorSides {
        _decode: decode,
        _pools: pools,
        prefill,
        sources,
        peer,
        remotes,
    }
}

/// `count` distinct, scattered ids of a pool of `pool` blocks (a power of two): an odd stride
/// through the pool, different on each side.
fn ids(count: u64, pool: u64, stride: u64, start: u64) -> Vec<u32> {
    (0..count)
        .map(|index| ((start + index * stride) % pool) as u32)
        .collect()
}

/// `blocks` blocks of a pool of `pool` as runs of 1-64 consecutive blocks on both sides:
/// (local first block, remote first block, blocks), the runs scattered over the pool.
fn block_runs(blocks: u64, pool: u64) -> Vec<(u64, u64, u64)> {
    let mut runs = Vec::new();
    let (mut left, mut index) = (blocks, 0u64);
    while left > 0 {
        let count = (1 + (index * 37 + 11) % 64).min(left);
        // Runs start 64 blocks apart in a shuffled order, so none overlaps another.
        let slots = pool / 64;
        let local = (index * 17 + 3) % slots * 64;
        let remote = (index * 29 + 5) % slots * 64;
        runs.push((local, remote, count));
        left -= count;
        index += 1;
    }
    runs
}

/// Times `iterations` submits of the batches `build` makes (building them included); each
/// transfer is awaited outside the timing.
fn timed_submits(iterations: u64, build: impl Fn() -> ferry::Batch) -> Duration {
    let mut spent = Duration::ZERO;
    for _ in 0..iterations {
        let started = Instant::now();
        let transfer = build().submit().expect("submit");
        spent += started.elapsed();
        transfer.wait().expect("transfer");
    }
    spent
}

/// A benchmark group of 20 samples over 3 s.
fn timed_group<'a>(
    c: &'a mut Criterion,
    name: &str,
) -> criterion::BenchmarkGroup<'a, criterion::measurement::WallTime> {
    let mut group = c.benchmark_group(name);
    group.measurement_time(Duration::from_secs(3));
    group.sample_size(20);
    group
}

/// The request's block copy of pools of [`POOL`] bytes, its pools still to be added.
fn request_copy(local_ids: &Arc<[u32]>, remote_ids: &Arc<[u32]>) -> BlockCopy {
    let layout = BlockLayout::packed(POOL, BLOCK);
    BlockCopy::new(
        BLOCK,
        layout,
        layout,
        Arc::clone(local_ids),
        Arc::clone(remote_ids),
    )
}

fn submit_cost(c: &mut Criterion) {
    let sides = engines(TENSORS * POOL, true);
    // Shared, as a server keeps a request's ids, so the timed loop copies none.
    let (local_ids, remote_ids): (Arc<[u32]>, Arc<[u32]>) = (
        ids(REQUEST_BLOCKS, POOL_BLOCKS, 17, 3).into(),
        ids(REQUEST_BLOCKS, POOL_BLOCKS, 29, 11).into(),
    );
    let mut group = timed_group(c, "submit the 40,960-block request");
    group.bench_function("paged block copy", |b| {
        b.iter_custom(|iterations| {
            timed_submits(iterations, || {
                let mut copy = request_copy(&local_ids, &remote_ids);
                for tensor in 0..TENSORS {
                    let at = tensor * POOL;
                    copy = copy.pool_at(&sides.source, at, &sides.remote, at);
                }
                sides.prefill.batch(&sides.peer).write_blocks(copy)
            })
        })
    });
    group.bench_function("paged block copy, read", |b| {
        b.iter_custom(|iterations| {
            timed_submits(iterations, || {
                let mut copy = request_copy(&local_ids, &remote_ids);
                for tensor in 0..TENSORS {
                    let at = tensor * POOL;
                    copy = copy.pool_at(&sides.source, at, &sides.remote, at);
                }
                sides.prefill.batch(&sides.peer).read_blocks(copy)
            })
        })
    });
    // As vLLM registers the request: one region and one peer buffer per tensor.
    let tensors = tensor_engines(POOL);
    group.bench_function("paged block copy, a region per tensor", |b| {
        b.iter_custom(|iterations| {
            timed_submits(iterations, || {
                let mut copy = request_copy(&local_ids, &remote_ids);
                for (source, remote) in tensors.sources.iter().zip(&tensors.remotes) {
                    copy = copy.pool_at(source, 0, remote, 0);
                }
                tensors.prefill.batch(&tensors.peer).write_blocks(copy)
            })
        })
    });
    group.finish();
    // The whole submit divided by its entries, so the figure is the cost of one entry.
    let mut group = timed_group(c, "one entry of the 40,960-entry request");
    let flat = |batch: ferry::Batch, sides: &Sides, read: bool| {
        let mut batch = batch;
        for tensor in 0..TENSORS {
            for (&local, &remote) in local_ids.iter().zip(remote_ids.iter()) {
                let (offset, remote, len) = (
                    tensor * POOL + u64::from(local) * BLOCK,
                    sides.remote.addr + tensor * POOL + u64::from(remote) * BLOCK,
                    BLOCK,
                );
                batch = match read {
                    false => batch.write(&sides.source, offset, remote, len),
                    true => batch.read(&sides.source, offset, remote, len),
                };
            }
        }
        batch
    };
    group.bench_function("flat entries as one list, planned into a block copy", |b| {
        b.iter_custom(|iterations| {
            let spent = timed_submits(iterations, || {
                let source = &sides.source;
                let entries = (0..TENSORS).flat_map(|tensor| {
                    local_ids
                        .iter()
                        .zip(remote_ids.iter())
                        .map(move |(&local, &remote)| {
                            (
                                tensor * POOL + u64::from(local) * BLOCK,
                                sides.remote.addr + tensor * POOL + u64::from(remote) * BLOCK,
                                BLOCK,
                            )
                        })
                });
                sides
                    .prefill
                    .batch(&sides.peer)
                    .write_entries(source, entries)
            });
            spent / ENTRIES as u32
        })
    });
    let unplanned = engines(TENSORS * POOL, false);
    for (name, sides, read) in [
        ("flat entries, planned into a block copy", &sides, false),
        ("flat entries read, planned into a block copy", &sides, true),
        ("flat entries, kept flat", &unplanned, false),
    ] {
        group.bench_function(name, |b| {
            b.iter_custom(|iterations| {
                let spent = timed_submits(iterations, || {
                    flat(sides.prefill.batch(&sides.peer), sides, read)
                });
                spent / ENTRIES as u32
            })
        });
    }
    group.finish();
    drop(unplanned);

    // vLLM's MooncakeConnector merges runs of consecutive blocks into one entry each: the
    // request as runs of 1-64 blocks on both sides, per block moved.
    let runs = block_runs(REQUEST_BLOCKS, POOL_BLOCKS);
    let mut group = timed_group(c, "one block of the 40,960-block request sent as runs");
    group.bench_function("runs of 1-64 blocks, planned into a block copy", |b| {
        b.iter_custom(|iterations| {
            let spent = timed_submits(iterations, || {
                let mut batch = sides.prefill.batch(&sides.peer);
                for tensor in 0..TENSORS {
                    for &(local, remote, count) in &runs {
                        batch = batch.write(
                            &sides.source,
                            tensor * POOL + local * BLOCK,
                            sides.remote.addr + tensor * POOL + remote * BLOCK,
                            count * BLOCK,
                        );
                    }
                }
                batch
            });
            spent / ENTRIES as u32
        })
    });
    group.finish();

    // A latency-bound request: one 4 KiB write. What the engine adds before the transport
    // gets it is on the way of every small write and of every layer of a layer-wise transfer.
    let mut group = timed_group(c, "submit one 4 KiB write");
    group.bench_function("one entry", |b| {
        b.iter_custom(|iterations| {
            timed_submits(iterations, || {
                sides
                    .prefill
                    .batch(&sides.peer)
                    .write(&sides.source, 0, sides.remote.addr, 4096)
            })
        })
    });
    group.finish();
    drop(sides);

    let sides = engines(TOKEN_POOL_BLOCKS * BLOCK, true);
    let (local_ids, remote_ids): (Arc<[u32]>, Arc<[u32]>) = (
        ids(TOKEN_IDS, TOKEN_POOL_BLOCKS, 7919, 5).into(),
        ids(TOKEN_IDS, TOKEN_POOL_BLOCKS, 104_729, 13).into(),
    );
    let mut group = timed_group(c, "submit 250,000 block ids");
    group.bench_function("paged block copy", |b| {
        b.iter_custom(|iterations| {
            timed_submits(iterations, || {
                let copy =
                    BlockCopy::packed(BLOCK, Arc::clone(&local_ids), Arc::clone(&remote_ids))
                        .pool(&sides.source, &sides.remote);
                sides.prefill.batch(&sides.peer).write_blocks(copy)
            })
        })
    });
    group.bench_function("paged block copy, read", |b| {
        b.iter_custom(|iterations| {
            timed_submits(iterations, || {
                let copy =
                    BlockCopy::packed(BLOCK, Arc::clone(&local_ids), Arc::clone(&remote_ids))
                        .pool(&sides.source, &sides.remote);
                sides.prefill.batch(&sides.peer).read_blocks(copy)
            })
        })
    });
    group.finish();
    drop(sides);

    // A latent (MLA) cache is per token: the request's runs as one entry each, or one entry
    // per token as a caller that lists tokens sends them; the planner keeps both as runs.
    let pool = MLA_POOL_TOKENS * MLA_TOKEN;
    let sides = engines(MLA_LAYERS * pool, true);
    let runs = block_runs(MLA_REQUEST_TOKENS, MLA_POOL_TOKENS);
    let mla = |per_token: bool| {
        let mut batch = sides.prefill.batch(&sides.peer);
        for layer in 0..MLA_LAYERS {
            for &(local, remote, count) in &runs {
                let (local, remote) = (
                    layer * pool + local * MLA_TOKEN,
                    sides.remote.addr + layer * pool + remote * MLA_TOKEN,
                );
                if !per_token {
                    batch = batch.write(&sides.source, local, remote, count * MLA_TOKEN);
                    continue;
                }
                for token in 0..count {
                    let at = token * MLA_TOKEN;
                    batch = batch.write(&sides.source, local + at, remote + at, MLA_TOKEN);
                }
            }
        }
        batch
    };
    let mut group = timed_group(c, "submit the 249,856-token MLA request");
    for (name, per_token) in [
        ("runs of 1-64 tokens, one entry a run", false),
        ("one entry a token", true),
    ] {
        group.bench_function(name, |b| {
            b.iter_custom(|iterations| timed_submits(iterations, || mla(per_token)))
        });
    }
    group.finish();
}

criterion_group!(benches, submit_cost);
criterion_main!(benches);
