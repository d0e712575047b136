//! Paged-KV block copies over loopback TCP: blocks land at the ids asked for, in every layout,
//! and malformed copies are refused before a byte moves.

mod common;

use common::{assert_bytes_eq, pattern, Pair};
use ferry::{BlockCopy, BlockLayout, Error, RangeError, Side};

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
    let mut copy = BlockCopy::new(BLOCK, layout, layout, local_ids.clone(), remote_ids.clone());
    for pool in 0..POOLS {
        copy = copy.pool(&pair.source, pool * POOL, pair.remote + pool * POOL);
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
    let mut copy = BlockCopy::new(half, local, remote, local_ids.clone(), remote_ids.clone());
    // Pool p of this side reads the V half-blocks of the peer's tensor p (V sits one block in).
    for pool in 0..POOLS {
        copy = copy.pool(
            &pair.source,
            pool * (POOL / 2),
            pair.remote + pool * 2 * POOL + BLOCK,
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
    let copy = |local: BlockLayout, len: u64, local_ids: Vec<u32>, remote_ids: Vec<u32>| {
        BlockCopy::new(len, local, packed, local_ids, remote_ids).pool(&pair.source, 0, pair.remote)
    };
    let cases = [
        (
            copy(packed, BLOCK, vec![0, 32], vec![0, 1]),
            "local block id 32 at index 1 is outside the pool's 32 blocks",
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
    // A remote pool past the peer's registration is found at submit time, before any byte.
    let outside = BlockCopy::new(BLOCK, packed, packed, vec![0], vec![0]).pool(
        &pair.source,
        0,
        pair.remote + BLOCK,
    );
    match pair
        .prefill
        .batch(&pair.peer)
        .write_blocks(outside)
        .submit()
        .unwrap()
        .await
    {
        Err(Error::Range(RangeError::PoolNotRegistered {
            pool: 0,
            side: Side::Remote,
            ..
        })) => {}
        other => panic!("expected the remote pool to be refused, got {other:?}"),
    }
    let mut landed = vec![0u8; POOL as usize];
    pair.pool.read_at(0, &mut landed).unwrap();
    assert!(
        landed.iter().all(|&byte| byte == 0),
        "a refused block copy wrote into the peer's pool"
    );
}
