//! Paged-KV block copies over loopback TCP: blocks land at the ids asked for, in every layout,
//! and malformed copies are refused before a byte moves.

mod common;

use common::{assert_bytes_eq, engine, pattern, Pair};
use ferry::{BlockCopy, BlockLayout, BufferDescriptor, Error, RangeError, Side};

const BLOCK: u64 = 1024;
const POOL_BLOCKS: u64 = 32;
const POOL: u64 = BLOCK * POOL_BLOCKS;
const POOLS: u64 = 3;

/// Copies `len` bytes of each listed block from the source pools into a zeroed decode pool
/// region and returns what landed.
fn expected_after(
    source: &[u8],
    local: BlockLayout,
    remote: BlockLayout,
    len: u64,
    ids: (&[u32], &[u32]),
    remote_len: usize,
) -> Vec<u8> {
    let mut expected = vec![0u8; remote_len];
    for pool in 0..POOLS {
        for (&from, &to) in ids.0.iter().zip(ids.1) {
            let src = (pool * local.pool_bytes
                + u64::from(from) * local.block_stride
                + local.offset) as usize;
            let dst = (pool * remote.pool_bytes
                + u64::from(to) * remote.block_stride
                + remote.offset) as usize;
            expected[dst..dst + len as usize].copy_from_slice(&source[src..src + len as usize]);
        }
    }
    expected
}

#[tokio::test]
async fn paged_writes_land_in_the_blocks_named_by_the_ids() {
    let pair = Pair::new((POOL * POOLS) as usize, (POOL * POOLS) as usize).await;
    let source = pattern(11, (POOL * POOLS) as usize);
    pair.source.write_at(0, &source).unwrap();
    let layout = BlockLayout::packed(POOL, BLOCK);
    // Runs of consecutive ids on both sides (merged) next to scattered ones.
    let local_ids: Vec<u32> = vec![0, 1, 2, 9, 31, 17, 5];
    let remote_ids: Vec<u32> = vec![4, 5, 6, 0, 30, 12, 31];
    let remote = pair.peer.buffers().swap_remove(0);
    let mut copy = BlockCopy::new(BLOCK, layout, layout, local_ids.clone(), remote_ids.clone());
    for pool in 0..POOLS {
        copy = copy.pool_at(&pair.source, pool * POOL, &remote, pool * POOL);
    }
    let done = pair
        .prefill
        .batch(&pair.peer)
        .write_blocks(copy)
        .submit()
        .unwrap()
        .await
        .unwrap();
    assert_eq!(done.bytes, BLOCK * local_ids.len() as u64 * POOLS);
    let expected = expected_after(
        &source,
        layout,
        layout,
        BLOCK,
        (&local_ids, &remote_ids),
        (POOL * POOLS) as usize,
    );
    let mut landed = vec![0u8; (POOL * POOLS) as usize];
    pair.pool.read_at(0, &mut landed).unwrap();
    assert_bytes_eq(&landed, &expected, "decode pools after the paged write");
}

#[tokio::test]
async fn interleaved_pools_and_head_slices_read_back_into_their_places() {
    // The peer interleaves K and V (stride two blocks); this side keeps half of each block
    // (a slice of the heads) in blocks of half the size.
    let pair = Pair::new((2 * POOL * POOLS) as usize, (POOL * POOLS) as usize).await;
    let remote_bytes = pattern(12, (2 * POOL * POOLS) as usize);
    pair.pool.write_at(0, &remote_bytes).unwrap();
    let half = BLOCK / 2;
    let remote = BlockLayout {
        pool_bytes: 2 * POOL,
        block_stride: 2 * BLOCK,
        offset: half,
    };
    let local = BlockLayout::packed(POOL / 2, half);
    let local_ids: Vec<u32> = vec![3, 0, 7];
    let remote_ids: Vec<u32> = vec![1, 31, 8];
    let buffer = pair.peer.buffers().swap_remove(0);
    let mut copy = BlockCopy::new(half, local, remote, local_ids.clone(), remote_ids.clone());
    // Pool p of this side reads the V half-blocks of the peer's tensor p (V sits one block in).
    for pool in 0..POOLS {
        copy = copy.pool_at(
            &pair.source,
            pool * (POOL / 2),
            &buffer,
            pool * 2 * POOL + BLOCK,
        );
    }
    pair.prefill
        .batch(&pair.peer)
        .read_blocks(copy)
        .submit()
        .unwrap()
        .await
        .unwrap();
    let mut landed = vec![0u8; (POOL * POOLS) as usize];
    pair.source.read_at(0, &mut landed).unwrap();
    for pool in 0..POOLS {
        for (&mine, &theirs) in local_ids.iter().zip(&remote_ids) {
            let at = (pool * (POOL / 2) + u64::from(mine) * half) as usize;
            let from = (pool * 2 * POOL + BLOCK + u64::from(theirs) * 2 * BLOCK + half) as usize;
            assert_bytes_eq(
                &landed[at..at + half as usize],
                &remote_bytes[from..from + half as usize],
                &format!("pool {pool}, local block {mine}"),
            );
        }
    }
}

#[tokio::test]
async fn malformed_block_copies_are_refused_naming_the_index_and_nothing_moves() {
    let pair = Pair::new(POOL as usize, POOL as usize).await;
    pair.source.write_at(0, &[0xAB; POOL as usize]).unwrap();
    let packed = BlockLayout::packed(POOL, BLOCK);
    let remote = pair.peer.buffers().swap_remove(0);
    let copy = |local: BlockLayout, len: u64, local_ids: Vec<u32>, remote_ids: Vec<u32>| {
        BlockCopy::new(len, local, packed, local_ids, remote_ids).pool(&pair.source, &remote)
    };
    let cases = [
        (
            copy(packed, BLOCK, vec![0, 32], vec![0, 1]),
            "local block id 32 at index 1 is outside the 32 blocks of pool 0",
        ),
        (
            copy(packed, BLOCK, vec![0, 1], vec![2, 7, 9]),
            "2 local block ids but 3 remote ones",
        ),
        (
            copy(BlockLayout::packed(POOL, 3000), BLOCK, vec![0], vec![0]),
            "does not divide the local pool",
        ),
        (
            copy(
                BlockLayout {
                    offset: BLOCK / 2,
                    ..packed
                },
                BLOCK,
                vec![0],
                vec![0],
            ),
            "sub-range 512..+1024 lies outside the local block",
        ),
    ];
    for (copy, expected) in cases {
        match pair.prefill.batch(&pair.peer).write_blocks(copy).submit() {
            Err(Error::Range(RangeError::Blocks { copy: 0, problem })) => {
                assert!(
                    problem.contains(expected),
                    "{problem:?} should say {expected:?}"
                )
            }
            other => panic!("expected a block-copy error saying {expected:?}, got {other:?}"),
        }
    }
    // A remote pool running past the end of the peer's buffer is refused by submit.
    let outside = BlockCopy::new(BLOCK, packed, packed, vec![0], vec![0]).pool_at(
        &pair.source,
        0,
        &remote,
        BLOCK,
    );
    match pair
        .prefill
        .batch(&pair.peer)
        .write_blocks(outside)
        .submit()
    {
        Err(Error::Range(RangeError::PoolNotRegistered {
            copy: 0,
            pool: 0,
            side: Side::Remote,
            addr,
            len,
        })) => assert_eq!((addr, len), (pair.remote + BLOCK, POOL)),
        other => panic!("expected the remote pool to be refused, got {other:?}"),
    }
    // A buffer the peer does not have (a stale or foreign descriptor) is found when the batch
    // is routed against the peer's buffers, before any byte.
    let foreign = BufferDescriptor {
        addr: pair.remote + 2 * POOL,
        ..remote.clone()
    };
    let stale =
        BlockCopy::new(BLOCK, packed, packed, vec![0], vec![0]).pool(&pair.source, &foreign);
    match pair
        .prefill
        .batch(&pair.peer)
        .write_blocks(stale)
        .submit()
        .unwrap()
        .await
    {
        Err(Error::Range(RangeError::PoolNotRegistered {
            pool: 0,
            side: Side::Remote,
            ..
        })) => {}
        other => panic!("expected the unknown remote buffer to be refused, got {other:?}"),
    }
    let mut landed = vec![0u8; POOL as usize];
    pair.pool.read_at(0, &mut landed).unwrap();
    assert!(
        landed.iter().all(|&byte| byte == 0),
        "a refused block copy wrote into the peer's pool"
    );
}

/// Two layers' K and V as four regions on each side, named on the decode side. Fields are in
/// reverse order of creation, so they drop like locals would.
struct NamedPools {
    peer: ferry::Peer,
    sources: Vec<ferry::Region>,
    prefill: ferry::Engine,
    pools: Vec<ferry::Region>,
    _decode: ferry::Engine,
}

const NAMES: [&str; 4] = ["k.0", "v.0", "k.1", "v.1"];

/// Decode pools of `decode_blocks` blocks named [`NAMES`], prefill pools of `prefill_blocks`
/// filled with a pattern each, connected.
async fn named_pools(decode_blocks: u64, prefill_blocks: u64) -> NamedPools {
    let decode = engine().await;
    let pools: Vec<ferry::Region> = NAMES
        .iter()
        .map(|name| {
            let pool = decode.allocate(decode_blocks * BLOCK).unwrap();
            pool.set_name(*name).unwrap();
            pool
        })
        .collect();
    let prefill = engine().await;
    let sources: Vec<ferry::Region> = (0..NAMES.len() as u64)
        .map(|seed| {
            let source = prefill.allocate(prefill_blocks * BLOCK).unwrap();
            source
                .write_at(0, &pattern(40 + seed, (prefill_blocks * BLOCK) as usize))
                .unwrap();
            source
        })
        .collect();
    let peer = prefill.connect(decode.name()).await.unwrap();
    NamedPools {
        peer,
        sources,
        prefill,
        pools,
        _decode: decode,
    }
}

impl NamedPools {
    /// A packed copy of whole blocks from every prefill pool to the decode pool of its name.
    fn copy(&self, local_ids: Vec<u32>, remote_ids: Vec<u32>) -> BlockCopy {
        let mut copy = BlockCopy::packed(BLOCK, local_ids, remote_ids);
        for (source, name) in self.sources.iter().zip(NAMES) {
            copy = copy.pool(source, &self.peer.buffer(name).unwrap());
        }
        copy
    }
}

#[tokio::test]
async fn packed_copies_between_named_pools_land_whole_blocks_at_the_ids() {
    // The pools differ in size on the two sides: each side's ids are checked against its own.
    let sides = named_pools(16, 8).await;
    let local_ids = vec![7u32, 0, 3];
    let remote_ids = vec![15u32, 2, 3];
    let done = sides
        .prefill
        .batch(&sides.peer)
        .write_blocks(sides.copy(local_ids.clone(), remote_ids.clone()))
        .submit()
        .unwrap()
        .await
        .unwrap();
    assert_eq!(done.bytes, BLOCK * 3 * NAMES.len() as u64);
    for (index, (source, pool)) in sides.sources.iter().zip(&sides.pools).enumerate() {
        let mut sent = vec![0u8; (8 * BLOCK) as usize];
        source.read_at(0, &mut sent).unwrap();
        let mut expected = vec![0u8; (16 * BLOCK) as usize];
        for (&from, &to) in local_ids.iter().zip(&remote_ids) {
            let (from, to) = (
                (u64::from(from) * BLOCK) as usize,
                (u64::from(to) * BLOCK) as usize,
            );
            expected[to..to + BLOCK as usize].copy_from_slice(&sent[from..from + BLOCK as usize]);
        }
        let mut landed = vec![0u8; (16 * BLOCK) as usize];
        pool.read_at(0, &mut landed).unwrap();
        assert_bytes_eq(&landed, &expected, &format!("decode pool {}", NAMES[index]));
    }
}

#[tokio::test]
async fn packed_ids_past_a_pool_and_pools_smaller_than_a_block_are_refused_naming_them() {
    let sides = named_pools(16, 8).await;
    let refused =
        |copy: BlockCopy| match sides.prefill.batch(&sides.peer).write_blocks(copy).submit() {
            Err(Error::Range(error)) => error,
            other => panic!("expected a range error, got {other:?}"),
        };
    // Prefill pools hold 8 blocks: local id 8 at index 2 is one past.
    match refused(sides.copy(vec![1, 2, 8], vec![0, 1, 2])) {
        RangeError::Blocks { copy: 0, problem } => assert!(
            problem.contains("local block id 8 at index 2 is outside the 8 blocks of pool 0"),
            "{problem}"
        ),
        other => panic!("expected the local id to be refused, got {other:?}"),
    }
    // Decode pools hold 16 blocks.
    match refused(sides.copy(vec![1, 2], vec![3, 16])) {
        RangeError::Blocks { copy: 0, problem } => assert!(
            problem.contains("remote block id 16 at index 1 is outside the 16 blocks of pool 0"),
            "{problem}"
        ),
        other => panic!("expected the remote id to be refused, got {other:?}"),
    }
    // A pool starting less than a block before the end of its region holds no block.
    let k = sides.peer.buffer("k.0").unwrap();
    let short = BlockCopy::packed(BLOCK, vec![0], vec![0])
        .pool(&sides.sources[0], &k)
        .pool_at(&sides.sources[1], 8 * BLOCK - 1, &k, 0);
    match refused(short) {
        RangeError::PoolNotRegistered {
            copy: 0,
            pool: 1,
            side: Side::Local,
            addr,
            len,
        } => assert_eq!(
            (addr, len),
            (sides.sources[1].addr() + 8 * BLOCK - 1, BLOCK)
        ),
        other => panic!("expected pool 1 to be refused, got {other:?}"),
    }
    for pool in &sides.pools {
        let mut landed = vec![0u8; (16 * BLOCK) as usize];
        pool.read_at(0, &mut landed).unwrap();
        assert!(
            landed.iter().all(|&byte| byte == 0),
            "a refused block copy wrote into the peer's pool"
        );
    }
}
