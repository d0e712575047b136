//! Turns Mooncake's flat entries into ferry's paged block copies.
//!
//! SGLang and vLLM describe a request's KV as one entry per (layer tensor, block): tens of
//! thousands of `(local address, peer address, length)` triples whose lengths are the block
//! size and whose offsets are whole blocks into per-layer pools. ferry moves exactly that shape
//! fastest as a paged copy (block ids, pools), where the GPU computes the addresses. This
//! module finds that shape in the entries: entries of one length at whole-block offsets of one
//! local region and one peer buffer become block ids of that pool pair, and pool pairs with the
//! same ids share one copy. Whatever does not fit stays a flat entry.

use std::collections::HashMap;

/// A registered range on either side: start address and length.
pub(crate) type Span = (u64, u64);

/// A local span index, a peer span index and a block length: entries sharing one are blocks
/// of one pool pair.
type PoolPair = (usize, usize, u64);

/// Block length, local and peer pool sizes, and the id pairs: pool pairs sharing one move in
/// one copy.
type CopyShape = (u64, u64, u64, Vec<(u32, u32)>);

/// Entries that became one paged copy: `len` bytes per block, block `ids[i].0` of every local
/// pool to block `ids[i].1` of its peer pool, for every pool pair.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Paged {
    /// Bytes per block, which is also the block stride of every pool.
    pub(crate) len: u64,
    /// Bytes of each local pool: the whole blocks its region holds.
    pub(crate) local_pool_bytes: u64,
    /// Bytes of each peer pool: the whole blocks its buffer holds.
    pub(crate) remote_pool_bytes: u64,
    /// `(local block id, peer block id)` pairs, in entry order.
    pub(crate) ids: Vec<(u32, u32)>,
    /// `(local span index, peer span index)` of every pool pair.
    pub(crate) pools: Vec<(usize, usize)>,
}

/// An entry moved as it is: local span index, offset in it, peer address, length.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Flat {
    pub(crate) local: usize,
    pub(crate) offset: u64,
    pub(crate) remote: u64,
    pub(crate) len: u64,
}

/// The entries of one call, as paged copies and flat entries.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Plan {
    pub(crate) paged: Vec<Paged>,
    pub(crate) flat: Vec<Flat>,
}

/// The index of the span of `spans` (sorted by start) that holds `[addr, addr + len)`.
pub(crate) fn holding(spans: &[Span], addr: u64, len: u64) -> Option<usize> {
    let end = addr.checked_add(len)?;
    let index = spans
        .partition_point(|&(start, _)| start <= addr)
        .checked_sub(1)?;
    let (start, span_len) = spans[index];
    (end <= start.saturating_add(span_len)).then_some(index)
}

/// An entry no registration holds, on this side or the peer's.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Outside {
    /// The local range is not inside memory registered here.
    Local(String),
    /// The peer's range is not inside memory the peer registered (as far as this engine knows).
    Peer(String),
}

impl std::fmt::Display for Outside {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Outside::Local(message) | Outside::Peer(message) => f.write_str(message),
        }
    }
}

/// `index` when span `index` of `spans` holds `[addr, addr + len)`.
fn within(spans: &[Span], index: usize, addr: u64, len: u64) -> Option<usize> {
    let &(start, span_len) = spans.get(index)?;
    let end = addr.checked_add(len)?;
    (start <= addr && end <= start.saturating_add(span_len)).then_some(index)
}

/// Plans `entries` (local address, peer address, length) over the local `regions` and the
/// peer's `buffers`, both sorted by start.
pub(crate) fn plan(
    regions: &[Span],
    buffers: &[Span],
    entries: &[(u64, u64, u64)],
) -> Result<Plan, Outside> {
    let mut pairs: Vec<(PoolPair, Vec<(u32, u32)>)> = Vec::new();
    let mut pair_of: HashMap<PoolPair, usize> = HashMap::new();
    let mut plan = Plan::default();
    // Callers list a tensor's blocks one after another: the previous entry's region, buffer and
    // pool pair usually hold the next one too, which saves the searches and the map.
    let mut last_region = 0;
    let mut last_buffer = 0;
    let mut last_pair: Option<(PoolPair, usize)> = None;
    for &(local, remote, len) in entries {
        let region = within(regions, last_region, local, len)
            .or_else(|| holding(regions, local, len))
            .ok_or_else(|| {
                Outside::Local(format!("local range {local:#x}+{len} is not inside registered memory; register_memory the buffer it belongs to first"))
            })?;
        let buffer = within(buffers, last_buffer, remote, len)
            .or_else(|| holding(buffers, remote, len))
            .ok_or_else(|| {
                Outside::Peer(format!("peer range {remote:#x}+{len} is not inside memory the peer registered; the peer must register_memory it first"))
            })?;
        (last_region, last_buffer) = (region, buffer);
        let offset = local - regions[region].0;
        let remote_offset = remote - buffers[buffer].0;
        match (block_id(offset, len), block_id(remote_offset, len)) {
            (Some(local_id), Some(remote_id)) => {
                let key = (region, buffer, len);
                let index = match last_pair {
                    Some((last, index)) if last == key => index,
                    _ => *pair_of.entry(key).or_insert_with(|| {
                        pairs.push((key, Vec::new()));
                        pairs.len() - 1
                    }),
                };
                last_pair = Some((key, index));
                pairs[index].1.push((local_id, remote_id));
            }
            _ => plan.flat.push(Flat {
                local: region,
                offset,
                remote,
                len,
            }),
        }
    }
    let mut copy_of: HashMap<CopyShape, usize> = HashMap::new();
    for ((region, buffer, len), ids) in pairs {
        let local_pool_bytes = regions[region].1 / len * len;
        let remote_pool_bytes = buffers[buffer].1 / len * len;
        let key = (len, local_pool_bytes, remote_pool_bytes, ids);
        match copy_of.get(&key) {
            Some(&index) => plan.paged[index].pools.push((region, buffer)),
            None => {
                copy_of.insert(key.clone(), plan.paged.len());
                let (len, local_pool_bytes, remote_pool_bytes, ids) = key;
                plan.paged.push(Paged {
                    len,
                    local_pool_bytes,
                    remote_pool_bytes,
                    ids,
                    pools: vec![(region, buffer)],
                });
            }
        }
    }
    Ok(plan)
}

/// The block id of `offset` in a pool of `len`-byte blocks, when it starts a block.
fn block_id(offset: u64, len: u64) -> Option<u32> {
    // Block sizes are mostly powers of two; a shift spares the two divisions per entry that
    // otherwise dominate planning.
    let id = if len.is_power_of_two() {
        (offset & (len - 1) == 0).then(|| offset >> len.trailing_zeros())?
    } else if len != 0 && offset % len == 0 {
        offset / len
    } else {
        return None;
    };
    u32::try_from(id).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    const BLOCK: u64 = 32 << 10;

    #[test]
    fn per_layer_block_entries_become_one_copy_over_every_pool() {
        // Two layer pools of 8 blocks on each side; blocks 3 and 5 go to 1 and 6 in both.
        let regions = [(0x10_0000, 8 * BLOCK), (0x20_0000, 8 * BLOCK)];
        let buffers = [(0x90_0000, 8 * BLOCK), (0xa0_0000, 8 * BLOCK)];
        let mut entries = Vec::new();
        for layer in 0..2 {
            for (local, remote) in [(3, 1), (5, 6)] {
                entries.push((
                    regions[layer].0 + local * BLOCK,
                    buffers[layer].0 + remote * BLOCK,
                    BLOCK,
                ));
            }
        }
        let plan = plan(&regions, &buffers, &entries).expect("inside");
        assert!(plan.flat.is_empty());
        assert_eq!(
            plan.paged,
            vec![Paged {
                len: BLOCK,
                local_pool_bytes: 8 * BLOCK,
                remote_pool_bytes: 8 * BLOCK,
                ids: vec![(3, 1), (5, 6)],
                pools: vec![(0, 0), (1, 1)],
            }]
        );
    }

    #[test]
    fn pools_with_other_ids_or_sizes_get_their_own_copy_and_odd_offsets_stay_flat() {
        let regions = [(0x1000, 4 * BLOCK + 100), (0x100_0000, 2 * BLOCK)];
        let buffers = [(0x900_0000, 4 * BLOCK)];
        let entries = [
            (0x1000 + BLOCK, 0x900_0000, BLOCK),
            (0x100_0000, 0x900_0000 + 2 * BLOCK, BLOCK),
            (0x1000 + 7, 0x900_0000 + 3 * BLOCK, 64),
            (0x1000 + 2 * BLOCK, 0x900_0000 + 3 * BLOCK, 16),
        ];
        let plan = plan(&regions, &buffers, &entries).expect("inside");
        assert_eq!(plan.paged.len(), 3);
        assert_eq!(plan.paged[0].ids, vec![(1, 0)]);
        assert_eq!(
            plan.paged[0].local_pool_bytes,
            4 * BLOCK,
            "the odd tail is not a block"
        );
        assert_eq!(plan.paged[1].ids, vec![(0, 2)]);
        assert_eq!(plan.paged[2].len, 16);
        assert_eq!(
            plan.paged[2].ids,
            vec![((2 * BLOCK / 16) as u32, (3 * BLOCK / 16) as u32)]
        );
        assert_eq!(
            plan.flat,
            vec![Flat {
                local: 0,
                offset: 7,
                remote: 0x900_0000 + 3 * BLOCK,
                len: 64
            }]
        );
    }

    #[test]
    fn ranges_outside_the_registrations_are_named() {
        let regions = [(0x1000, 0x1000)];
        let buffers = [(0x9000, 0x1000)];
        let local =
            plan(&regions, &buffers, &[(0x1800, 0x9000, 0x900)]).expect_err("past the region");
        assert!(
            matches!(&local, Outside::Local(text) if text.contains("local range 0x1800+2304")),
            "{local}"
        );
        let remote =
            plan(&regions, &buffers, &[(0x1000, 0x8fff, 16)]).expect_err("before the buffer");
        assert!(
            matches!(&remote, Outside::Peer(text) if text.contains("peer range 0x8fff+16")),
            "{remote}"
        );
        assert!(plan(&regions, &buffers, &[(u64::MAX, 0x9000, 2)]).is_err());
        assert_eq!(holding(&regions, 0x1000, 0x1000), Some(0));
        assert_eq!(holding(&regions, 0xfff, 1), None);
        assert_eq!(holding(&[], 0, 1), None);
    }

    #[test]
    fn block_ids_come_from_whole_block_offsets_of_any_size() {
        assert_eq!(block_id(3 * BLOCK, BLOCK), Some(3));
        assert_eq!(block_id(3 * BLOCK + 1, BLOCK), None);
        assert_eq!(block_id(5 * 18_432, 18_432), Some(5));
        assert_eq!(block_id(5 * 18_432 + 16, 18_432), None);
        assert_eq!(block_id(0, 0), None);
        assert_eq!(
            block_id(u64::from(u32::MAX) * 2 + 2, 2),
            None,
            "past u32 ids"
        );
    }
}
