use super::*;

const BLOCK: u64 = 32 << 10;

fn blocks(pairs: &[(u64, u64)], len: u64) -> Vec<Piece> {
    pairs
        .iter()
        .map(|&(local, remote)| Piece {
            local: local * len,
            remote: remote * len,
            len,
        })
        .collect()
}

#[test]
fn whole_blocks_become_their_ids() {
    let pieces = blocks(
        &[
            (3, 40),
            (17, 0),
            (9, 63),
            (4, 2),
            (5, 7),
            (6, 8),
            (100, 1),
            (8, 9),
        ],
        BLOCK,
    );
    let shape = shape(pieces.iter().copied()).expect("block shape");
    assert_eq!(shape.len, BLOCK);
    assert_eq!(shape.local.offset, 0);
    assert_eq!(shape.remote.offset, 0);
    assert_eq!(shape.local.stride % BLOCK, 0);
    let ids = ids(pieces.iter().copied(), shape);
    // Ids are in units of the inferred stride, which may be a multiple of the block when
    // every offset happens to be one: map them back to byte offsets to compare.
    let local: Vec<u64> = ids
        .local
        .iter()
        .map(|&id| u64::from(id) * shape.local.stride + shape.local.offset)
        .collect();
    let remote: Vec<u64> = ids
        .remote
        .iter()
        .map(|&id| u64::from(id) * shape.remote.stride + shape.remote.offset)
        .collect();
    assert_eq!(
        local,
        pieces.iter().map(|piece| piece.local).collect::<Vec<_>>()
    );
    assert_eq!(
        remote,
        pieces.iter().map(|piece| piece.remote).collect::<Vec<_>>()
    );
    assert_eq!(
        u64::from(shape.remote_highest) * shape.remote.stride,
        63 * BLOCK
    );
}

#[test]
fn runs_of_consecutive_blocks_are_split_into_blocks() {
    // vLLM's MooncakeConnector: one entry per run of 1..4 consecutive blocks.
    let runs = [(0, 10, 3), (5, 20, 1), (7, 30, 4), (12, 2, 2)];
    let mut pieces: Vec<Piece> = runs
        .iter()
        .map(|&(local, remote, count)| Piece {
            local: local * BLOCK,
            remote: remote * BLOCK,
            len: count * BLOCK,
        })
        .collect();
    pieces.extend(blocks(&[(20, 40), (21, 41), (22, 42), (23, 43)], BLOCK));
    let shape = shape(pieces.iter().copied()).expect("block shape");
    assert_eq!(
        shape,
        Shape {
            len: BLOCK,
            local: SideShape {
                stride: BLOCK,
                offset: 0
            },
            remote: SideShape {
                stride: BLOCK,
                offset: 0
            },
            runs: true,
            blocks: 14,
            remote_highest: 43,
        }
    );
    let ids = ids(pieces.iter().copied(), shape);
    assert_eq!(
        *ids.local,
        [0, 1, 2, 5, 7, 8, 9, 10, 12, 13, 20, 21, 22, 23]
    );
    assert_eq!(
        *ids.remote,
        [10, 11, 12, 20, 30, 31, 32, 33, 2, 3, 40, 41, 42, 43]
    );
}

#[test]
fn slices_at_one_offset_of_each_block_keep_the_block_stride() {
    // Heterogeneous TP: the decode takes 12 KiB at 4 KiB into each 32 KiB block of the
    // prefill, and lays them out 12 KiB apart.
    let pieces: Vec<Piece> = [
        (1u64, 0u64),
        (4, 1),
        (9, 2),
        (2, 3),
        (7, 4),
        (3, 5),
        (6, 6),
        (0, 7),
    ]
    .iter()
    .map(|&(local, remote)| Piece {
        local: local * BLOCK + (4 << 10),
        remote: remote * (12 << 10),
        len: 12 << 10,
    })
    .collect();
    let shape = shape(pieces.iter().copied()).expect("sliced block shape");
    assert_eq!(shape.len, 12 << 10);
    assert_eq!(
        shape.local,
        SideShape {
            stride: BLOCK,
            offset: 4 << 10
        }
    );
    assert_eq!(
        shape.remote,
        SideShape {
            stride: 12 << 10,
            offset: 0
        }
    );
    let ids = ids(pieces.iter().copied(), shape);
    assert_eq!(*ids.local, [1, 4, 9, 2, 7, 3, 6, 0]);
    assert_eq!(*ids.remote, [0, 1, 2, 3, 4, 5, 6, 7]);
}

#[test]
fn entries_off_one_grid_short_or_few_stay_flat() {
    let mut crooked = blocks(
        &[(1, 1), (2, 2), (3, 3), (4, 4), (5, 5), (6, 6), (7, 7)],
        BLOCK,
    );
    crooked.push(Piece {
        local: 9 * BLOCK + 100,
        remote: 0,
        len: BLOCK,
    });
    assert_eq!(
        shape(crooked.iter().copied()),
        None,
        "one entry off the grid of the rest"
    );
    let few = blocks(&[(1, 1), (2, 2)], BLOCK);
    assert_eq!(
        shape(few.iter().copied()),
        None,
        "too few to gain from a block copy"
    );
    let tiny = blocks(
        &[
            (1, 1),
            (2, 2),
            (3, 3),
            (4, 4),
            (5, 5),
            (6, 6),
            (7, 7),
            (8, 8),
        ],
        16,
    );
    assert_eq!(shape(tiny.iter().copied()), None, "blocks of 16 bytes");
    let mut odd = blocks(
        &[(1, 1), (2, 2), (3, 3), (4, 4), (5, 5), (6, 6), (7, 7)],
        BLOCK,
    );
    odd.push(Piece {
        local: 20 * BLOCK,
        remote: 20 * BLOCK,
        len: BLOCK + 8,
    });
    assert_eq!(
        shape(odd.iter().copied()),
        None,
        "an odd length would cut blocks of 8 bytes"
    );
    assert_eq!(shape(std::iter::empty::<Piece>()), None);
}

#[test]
fn short_blocks_in_long_runs_stay_flat_and_scattered_ones_are_paged() {
    // An MLA latent: 1,152 bytes a token, a request's tokens in runs of 4-11 on both sides.
    const TOKEN: u64 = 1152;
    let runs: Vec<Piece> = (0..16)
        .map(|run| Piece {
            local: run * 100 * TOKEN,
            remote: (1600 - run * 90) * TOKEN,
            len: (4 + run % 8) * TOKEN,
        })
        .collect();
    assert_eq!(shape(runs.iter().copied()), None);
    // The same tokens as one entry each: they continue each other, so they stay flat too.
    let tokens: Vec<Piece> = runs
        .iter()
        .flat_map(|run| {
            (0..run.len / TOKEN).map(move |token| Piece {
                local: run.local + token * TOKEN,
                remote: run.remote + token * TOKEN,
                len: TOKEN,
            })
        })
        .collect();
    assert_eq!(shape(tokens.iter().copied()), None);
    // Scattered tokens, one per entry, are block ids.
    let scattered = blocks(
        &[
            (3, 40),
            (17, 0),
            (9, 63),
            (4, 2),
            (50, 7),
            (6, 18),
            (100, 1),
            (8, 9),
        ],
        TOKEN,
    );
    assert_eq!(
        shape(scattered.iter().copied()).map(|shape| shape.len),
        Some(TOKEN)
    );
    // Long blocks in long runs are split into blocks: the paged kernel copies them as fast.
    let long_runs: Vec<Piece> = runs
        .iter()
        .map(|run| Piece {
            local: run.local / TOKEN * BLOCK,
            remote: run.remote / TOKEN * BLOCK,
            len: run.len / TOKEN * BLOCK,
        })
        .collect();
    assert_eq!(
        shape(long_runs.iter().copied()).map(|shape| shape.blocks),
        Some(120)
    );
}

#[test]
fn ids_past_32_bits_leave_the_pair_flat() {
    let far = u64::from(u32::MAX) + 1;
    let pieces = blocks(
        &[
            (0, far),
            (1, 1),
            (2, 2),
            (3, 3),
            (4, 4),
            (5, 5),
            (6, 6),
            (7, 7),
        ],
        64,
    );
    assert_eq!(shape(pieces.iter().copied()), None);
}

#[test]
fn the_same_block_sent_to_many_places_is_one_id_repeated() {
    let pieces: Vec<Piece> = (0..8)
        .map(|remote| Piece {
            local: 5 * BLOCK,
            remote: remote * BLOCK,
            len: BLOCK,
        })
        .collect();
    let shape = shape(pieces.iter().copied()).expect("block shape");
    let ids = ids(pieces.iter().copied(), shape);
    assert_eq!(*ids.local, [5; 8]);
    assert_eq!(*ids.remote, (0..8).collect::<Vec<u32>>());
}

#[test]
fn gcd_and_fold_agree() {
    assert_eq!(gcd(0, 12), 12);
    assert_eq!(gcd(12, 18), 6);
    let folded = |values: &[u64]| {
        let mut folded = Gcd::default();
        for &value in values {
            folded.fold(value);
        }
        folded.value()
    };
    assert_eq!(folded(&[]), 0);
    assert_eq!(folded(&[0, 0]), 0);
    assert_eq!(folded(&[0, 40]), 40);
    assert_eq!(folded(&[4096, 8192]), 4096);
    assert_eq!(folded(&[4096, 6144]), 2048);
    assert_eq!(folded(&[1152, 3456, 0, 1152 * 1001]), 1152);
    assert_eq!(folded(&[1152, 1000]), 8);
    assert_eq!(folded(&[u64::MAX, u64::MAX / 3]), u64::MAX / 3);
    // The multiplicative test against plain remainders, over odd, even and large divisors.
    let mut random = 0x9e37_79b9_7f4a_7c15u64;
    for _ in 0..20_000 {
        random ^= random << 13;
        random ^= random >> 7;
        random ^= random << 17;
        let divisor = (random >> 40) | 1 << (random % 5);
        let value = match random % 3 {
            0 => random % 1_000_003 * divisor,
            1 => random >> (random % 64),
            _ => (random >> 30) * divisor + random % divisor,
        };
        assert_eq!(
            Gcd::new(divisor).divides(value),
            value % divisor == 0,
            "{value} by {divisor}"
        );
    }
}
