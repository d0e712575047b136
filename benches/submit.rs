//! Host cost of handing ferry the kv-llama70b-4k request: 40,960 blocks (160 tensors x 256
//! blocks), as one paged block copy and as 40,960 separate entries. Measures what the
//! submitting thread pays, from building the batch until `submit` returns: checking every
//! range against both sides' registrations, choosing the transport and handing it the ops.
//!
//! Host memory with 256-byte blocks; the transport is a stand-in that takes the ops and moves
//! nothing, so the figure is the
//! engine's own cost on any machine; on GPU memory the nvlink transport adds building its
//! kernel arguments and the launch (`ferry bench` shows the whole cost as `submit us`).

use criterion::{criterion_group, criterion_main, Criterion};
use ferry::transport::{BlockOps, Endpoint, Link, Reach, TransferOp, Transport};
use ferry::{
    BlockCopy, BlockLayout, BufferDescriptor, Engine, Location, Peer, Region, RegionInfo,
    SegmentDescriptor,
};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Takes every host-memory op (cheaper than TCP) and completes it without moving a byte.
struct Counting;

#[async_trait::async_trait]
impl Transport for Counting {
    fn name(&self) -> &'static str {
        "counting"
    }

    fn endpoint(&self) -> Option<Endpoint> {
        None
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
        Ok(Arc::new(Counting))
    }
}

#[async_trait::async_trait]
impl Link for Counting {
    async fn transfer(&self, ops: Vec<TransferOp>) -> ferry::Result<()> {
        let bytes: u64 = ops.iter().map(|op| op.len).sum();
        assert_eq!(bytes, TENSORS * REQUEST_BLOCKS * BLOCK);
        Ok(())
    }

    async fn transfer_blocks(&self, blocks: BlockOps) -> ferry::Result<()> {
        assert_eq!(blocks.bytes(), TENSORS * REQUEST_BLOCKS * BLOCK);
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

struct Sides {
    _decode: Engine,
    _pool: Region,
    prefill: Engine,
    source: Region,
    peer: Peer,
    /// The decode pool as the prefill side sees it.
    remote: BufferDescriptor,
}

fn sides() -> Sides {
    let decode = Engine::builder().build_blocking().expect("decode engine");
    let pool = decode.allocate(TENSORS * POOL).expect("pool");
    let prefill = Engine::builder()
        .transport(Arc::new(Counting))
        .build_blocking()
        .expect("prefill engine");
    let source = prefill.allocate(TENSORS * POOL).expect("source");
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

/// Distinct, scattered ids: a fixed stride through the pool, different on each side.
fn ids(stride: u64, start: u64) -> Vec<u32> {
    (0..REQUEST_BLOCKS)
        .map(|index| ((start + index * stride) % POOL_BLOCKS) as u32)
        .collect()
}

fn submit_cost(c: &mut Criterion) {
    let sides = sides();
    // Shared, as a server keeps a request's ids, so the timed loop copies none.
    let (local_ids, remote_ids): (Arc<[u32]>, Arc<[u32]>) = (ids(17, 3).into(), ids(29, 11).into());
    let mut group = c.benchmark_group("submit the 40,960-block request");
    group.measurement_time(Duration::from_secs(3));
    group.sample_size(20);
    group.bench_function("paged block copy", |b| {
        b.iter_custom(|iterations| {
            let mut spent = Duration::ZERO;
            for _ in 0..iterations {
                let started = Instant::now();
                let layout = BlockLayout::packed(POOL, BLOCK);
                let mut copy = BlockCopy::new(
                    BLOCK,
                    layout,
                    layout,
                    Arc::clone(&local_ids),
                    Arc::clone(&remote_ids),
                );
                for tensor in 0..TENSORS {
                    let at = tensor * POOL;
                    copy = copy.pool_at(&sides.source, at, &sides.remote, at);
                }
                let transfer = sides
                    .prefill
                    .batch(&sides.peer)
                    .write_blocks(copy)
                    .submit()
                    .expect("submit");
                spent += started.elapsed();
                transfer.wait().expect("transfer");
            }
            spent
        })
    });
    group.bench_function("40,960 entries", |b| {
        b.iter_custom(|iterations| {
            let mut spent = Duration::ZERO;
            for _ in 0..iterations {
                let started = Instant::now();
                let mut batch = sides.prefill.batch(&sides.peer);
                for tensor in 0..TENSORS {
                    for (&local, &remote) in local_ids.iter().zip(remote_ids.iter()) {
                        batch = batch.write(
                            &sides.source,
                            tensor * POOL + u64::from(local) * BLOCK,
                            sides.remote.addr + tensor * POOL + u64::from(remote) * BLOCK,
                            BLOCK,
                        );
                    }
                }
                let transfer = batch.submit().expect("submit");
                spent += started.elapsed();
                transfer.wait().expect("transfer");
            }
            spent
        })
    });
    group.finish();
}

criterion_group!(benches, submit_cost);
criterion_main!(benches);
