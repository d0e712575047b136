//! Paged copies named by addresses: what a caller that describes its KV as strided rows of
//! blocks (NIXL's `(addr, len, devID, stride, count)` lists) turns into. The pools are raw
//! addresses here; the session finds the local region and the peer buffer holding each pool
//! when it submits, so one plan can be submitted again after registrations changed.

use ferry::BlockLayout;
use std::collections::HashMap;
use std::sync::Arc;

/// Block `local_ids[i]` of every local pool to (or from) block `remote_ids[i]` of its peer
/// pool, `len` bytes each.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PagedCopy {
    /// Bytes per block.
    pub(crate) len: u64,
    /// The layout of every local pool.
    pub(crate) local: BlockLayout,
    /// The layout of every peer pool.
    pub(crate) remote: BlockLayout,
    /// Local block ids.
    pub(crate) local_ids: Arc<[u32]>,
    /// Peer block ids, one per local id.
    pub(crate) remote_ids: Arc<[u32]>,
    /// `(local pool base, peer pool base)` addresses of every pool pair.
    pub(crate) pools: Vec<(u64, u64)>,
}

impl PagedCopy {
    /// Whether `other` copies the same pools with the same block length and layouts, whatever
    /// its ids.
    pub(crate) fn same_pools(&self, other: &PagedCopy) -> bool {
        self.len == other.len
            && self.local == other.local
            && self.remote == other.remote
            && self.pools == other.pools
    }

    /// This copy with no ids: its pools, length and layouts only.
    pub(crate) fn without_ids(&self) -> PagedCopy {
        PagedCopy {
            local_ids: Arc::from([]),
            remote_ids: Arc::from([]),
            ..self.clone()
        }
    }
}

/// The bytes from a pool's base to the end of the last block byte a copy of `len` bytes per
/// block touches in a pool of `layout`.
pub(crate) fn extent(layout: &BlockLayout, len: u64) -> u64 {
    layout.pool_bytes.saturating_sub(layout.block_stride) + layout.offset + len
}

/// One side's pool: base address and layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Pool {
    pub(crate) base: u64,
    pub(crate) stride: u64,
    pub(crate) blocks: u64,
}

/// A local pool, a peer pool and the block length: the blocks of one pool pair.
type PairKey = (Pool, Pool, u64);

/// Block length, both pools' strides and block counts, and both id lists: pool pairs sharing
/// one move in one copy.
type Shape = (u64, u64, u64, u64, u64, Vec<u32>, Vec<u32>);

/// Collects `(local pool, peer pool)` block pairs and groups pool pairs that move the same ids
/// into one copy each.
#[derive(Default)]
pub(crate) struct Grouper {
    pairs: Vec<(PairKey, Vec<u32>, Vec<u32>)>,
    /// Per pair, the pool pairs known to move exactly its ids (added with [`Grouper::add_twin`]).
    twins: Vec<Vec<(Pool, Pool)>>,
    index: HashMap<PairKey, usize>,
    last: Option<(PairKey, usize)>,
    /// How many ids the last [`Grouper::add`] gave its pair.
    last_added: usize,
}

impl Grouper {
    /// Blocks `local_ids[i]` of `local` to blocks `remote_ids[i]` of `remote`, `len` bytes
    /// each.
    pub(crate) fn add(
        &mut self,
        local: Pool,
        local_ids: impl IntoIterator<Item = u32>,
        remote: Pool,
        remote_ids: impl IntoIterator<Item = u32>,
        len: u64,
    ) {
        let key = (local, remote, len);
        // Callers list one pool pair's blocks one after another: the last pair usually holds
        // the next blocks too, which spares the map.
        let slot = match self.last {
            Some((last, slot)) if last == key => slot,
            _ => {
                let (pairs, twins) = (&mut self.pairs, &mut self.twins);
                let slot = *self.index.entry(key).or_insert_with(|| {
                    pairs.push((key, Vec::new(), Vec::new()));
                    twins.push(Vec::new());
                    pairs.len() - 1
                });
                self.last = Some((key, slot));
                slot
            }
        };
        // Twins moved the ids this pair held so far, not the ones added now: they become pairs
        // of their own first.
        for (local_twin, remote_twin) in std::mem::take(&mut self.twins[slot]) {
            let (_, locals, remotes) = &self.pairs[slot];
            let copied = (
                (local_twin, remote_twin, len),
                locals.clone(),
                remotes.clone(),
            );
            self.index.insert(copied.0, self.pairs.len());
            self.pairs.push(copied);
            self.twins.push(Vec::new());
        }
        let (_, locals, remotes) = &mut self.pairs[slot];
        let before = locals.len();
        locals.extend(local_ids);
        remotes.extend(remote_ids);
        self.last_added = locals.len() - before;
    }

    /// Pools `local` and `remote` move exactly the ids, block length and pool shapes that the
    /// last [`Grouper::add`] gave its pool pair; the caller checked that. Spares copying the
    /// ids of every layer of a request.
    pub(crate) fn add_twin(&mut self, local: Pool, remote: Pool) {
        let Some(((_, _, len), slot)) = self.last else {
            return;
        };
        let (_, locals, remotes) = &self.pairs[slot];
        if locals.len() == self.last_added {
            self.twins[slot].push((local, remote));
            return;
        }
        // The pair held ids before the last add: the twin moves only the ones added last.
        let from = locals.len() - self.last_added;
        let (locals, remotes) = (locals[from..].to_vec(), remotes[from..].to_vec());
        self.add(local, locals, remote, remotes, len);
    }

    /// The copies: pool pairs of one shape and the same id lists share one.
    pub(crate) fn copies(self) -> Vec<PagedCopy> {
        let mut copies: Vec<PagedCopy> = Vec::new();
        let mut by_shape: HashMap<Shape, usize> = HashMap::new();
        for (((local, remote, len), local_ids, remote_ids), twins) in
            self.pairs.into_iter().zip(self.twins)
        {
            let twin_bases = twins
                .iter()
                .map(|(local, remote)| (local.base, remote.base));
            let shape = (
                len,
                local.stride,
                local.blocks,
                remote.stride,
                remote.blocks,
                local_ids,
                remote_ids,
            );
            // Pool pairs that move the same ids usually come one after another (every layer of
            // a request): comparing with the last copy spares hashing the id lists.
            let joins_last = copies.last().is_some_and(|last| same_shape(last, &shape));
            let slot = if joins_last {
                copies.len() - 1
            } else if let Some(&slot) = by_shape.get(&shape) {
                slot
            } else {
                let layout = |pool: Pool| BlockLayout {
                    pool_bytes: pool.stride * pool.blocks,
                    block_stride: pool.stride,
                    offset: 0,
                };
                copies.push(PagedCopy {
                    len,
                    local: layout(local),
                    remote: layout(remote),
                    local_ids: shape.5.clone().into(),
                    remote_ids: shape.6.clone().into(),
                    pools: Vec::new(),
                });
                by_shape.insert(shape, copies.len() - 1);
                copies.len() - 1
            };
            let pools = &mut copies[slot].pools;
            pools.push((local.base, remote.base));
            pools.extend(twin_bases);
        }
        copies
    }
}

/// Whether pool pairs of `shape` can join `copy`.
fn same_shape(copy: &PagedCopy, shape: &Shape) -> bool {
    let (len, local_stride, local_blocks, remote_stride, remote_blocks, local_ids, remote_ids) =
        shape;
    copy.len == *len
        && copy.local.block_stride == *local_stride
        && copy.local.pool_bytes == local_stride * local_blocks
        && copy.remote.block_stride == *remote_stride
        && copy.remote.pool_bytes == remote_stride * remote_blocks
        && *copy.local_ids == **local_ids
        && *copy.remote_ids == **remote_ids
}

#[cfg(test)]
mod tests {
    use super::*;

    const BLOCK: u64 = 4096;

    fn pool(base: u64) -> Pool {
        Pool {
            base,
            stride: BLOCK,
            blocks: 8,
        }
    }

    #[test]
    fn pool_pairs_with_the_same_ids_share_one_copy() {
        let mut grouper = Grouper::default();
        for layer in 0..3u64 {
            for (local, remote) in [(1, 5), (2, 6)] {
                grouper.add(
                    pool(layer << 20),
                    [local],
                    pool(0x100_0000 + (layer << 20)),
                    [remote],
                    BLOCK,
                );
            }
        }
        grouper.add(pool(0x80_0000), [7], pool(0x180_0000), [0], BLOCK);
        let copies = grouper.copies();
        assert_eq!(copies.len(), 2);
        assert_eq!(&*copies[0].local_ids, &[1, 2]);
        assert_eq!(&*copies[0].remote_ids, &[5, 6]);
        assert_eq!(
            copies[0].pools,
            vec![
                (0, 0x100_0000),
                (1 << 20, 0x110_0000),
                (2 << 20, 0x120_0000)
            ]
        );
        assert_eq!(copies[0].local.pool_bytes, 8 * BLOCK);
        assert_eq!(&*copies[1].local_ids, &[7]);
        assert_eq!(extent(&copies[1].local, BLOCK), 8 * BLOCK);
    }

    #[test]
    fn twins_join_their_pair_s_copy_and_leave_it_when_the_pair_gets_more_ids() {
        let mut grouper = Grouper::default();
        grouper.add(pool(0), [1, 2], pool(0x100_0000), [5, 6], BLOCK);
        grouper.add_twin(pool(1 << 20), pool(0x110_0000));
        grouper.add_twin(pool(2 << 20), pool(0x120_0000));
        let copies = grouper.copies();
        assert_eq!(copies.len(), 1);
        assert_eq!(
            copies[0].pools,
            vec![
                (0, 0x100_0000),
                (1 << 20, 0x110_0000),
                (2 << 20, 0x120_0000)
            ]
        );
        let mut grouper = Grouper::default();
        grouper.add(pool(0), [1], pool(0x100_0000), [5], BLOCK);
        grouper.add_twin(pool(1 << 20), pool(0x110_0000));
        grouper.add(pool(0), [3], pool(0x100_0000), [7], BLOCK);
        let copies = grouper.copies();
        assert_eq!(copies.len(), 2, "the twin keeps only the ids it moved");
        assert_eq!(
            (&*copies[0].local_ids, &*copies[0].remote_ids),
            (&[1, 3][..], &[5, 7][..])
        );
        assert_eq!(copies[0].pools, vec![(0, 0x100_0000)]);
        assert_eq!(
            (&*copies[1].local_ids, &*copies[1].remote_ids),
            (&[1][..], &[5][..])
        );
        assert_eq!(copies[1].pools, vec![(1 << 20, 0x110_0000)]);
    }

    #[test]
    fn a_twin_of_a_pair_seen_before_moves_only_the_ids_added_last() {
        let mut grouper = Grouper::default();
        grouper.add(pool(0), [1], pool(0x100_0000), [5], BLOCK);
        grouper.add(pool(1 << 20), [2], pool(0x110_0000), [6], BLOCK);
        grouper.add(pool(0), [3], pool(0x100_0000), [7], BLOCK);
        grouper.add_twin(pool(2 << 20), pool(0x120_0000));
        let copies = grouper.copies();
        let twin = copies
            .iter()
            .find(|copy| copy.pools.contains(&(2 << 20, 0x120_0000)))
            .expect("the twin moves");
        assert_eq!((&*twin.local_ids, &*twin.remote_ids), (&[3][..], &[7][..]));
        let first = copies
            .iter()
            .find(|copy| copy.pools.contains(&(0, 0x100_0000)))
            .expect("the pair moves");
        assert_eq!(
            (&*first.local_ids, &*first.remote_ids),
            (&[1, 3][..], &[5, 7][..])
        );
    }

    #[test]
    fn strides_wider_than_the_block_make_their_own_copy() {
        let mut grouper = Grouper::default();
        let wide = Pool {
            base: 0x2000,
            stride: 2 * BLOCK,
            blocks: 4,
        };
        grouper.add(pool(0), [1], wide, [1], BLOCK);
        grouper.add(pool(1 << 20), [1], pool(0x4000_0000), [1], BLOCK);
        let copies = grouper.copies();
        assert_eq!(copies.len(), 2);
        assert_eq!(copies[0].remote.block_stride, 2 * BLOCK);
        assert_eq!(extent(&copies[0].remote, BLOCK), 7 * BLOCK);
    }
}
