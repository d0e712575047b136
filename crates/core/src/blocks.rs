//! Paged-KV block copies: the same few bytes of many fixed-size blocks of many pools (one pool
//! per layer and K/V), named by block ids rather than by one entry per block, so a transport
//! can compute the addresses itself (the nvlink kernel does, on the GPU).

use crate::cuda::{Event, Poller};
use crate::descriptor::BufferDescriptor;
use crate::error::{RangeError, Result, Side};
use crate::memory::{Region, RegionEntry, RegionUse};
use crate::ops::{Direction, TransferOp, TransferOps};
use std::sync::Arc;

/// How one side's pools are laid out, for the general form [`BlockCopy::new`]: every pool of
/// the copy has this layout. [`BlockCopy::packed`] needs none.
///
/// Separate K and V tensors are separate pools; K and V interleaved in one tensor are two pools
/// of one tensor whose bases differ by the K block's size, each with a stride of both blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockLayout {
    /// Bytes of one pool: a whole number of strides.
    pub pool_bytes: u64,
    /// Bytes from one block's first byte to the next block's.
    pub block_stride: u64,
    /// Where the copied bytes start inside a block (a slice of the heads, for example).
    pub offset: u64,
}

impl BlockLayout {
    /// Pools of `pool_bytes` holding blocks of `block_bytes` back to back, copied whole.
    pub fn packed(pool_bytes: u64, block_bytes: u64) -> BlockLayout {
        BlockLayout {
            pool_bytes,
            block_stride: block_bytes,
            offset: 0,
        }
    }

    /// Blocks in one pool.
    pub fn blocks(&self) -> u64 {
        self.pool_bytes.checked_div(self.block_stride).unwrap_or(0)
    }

    /// From a pool's base to the end of the last byte a copy of `len` bytes per block can
    /// touch (`len` bytes past the block offset when the pool holds no block).
    fn extent(&self, len: u64) -> u64 {
        self.pool_bytes.saturating_sub(self.block_stride) + self.offset + len
    }

    fn check(&self, side: Side, len: u64) -> Result<(), LayoutProblem> {
        if self.block_stride == 0 || self.pool_bytes % self.block_stride != 0 {
            return Err(LayoutProblem::StrideDoesNotDivide {
                side,
                stride: self.block_stride,
                pool_bytes: self.pool_bytes,
            });
        }
        if self.blocks() > u64::from(u32::MAX) {
            return Err(LayoutProblem::TooManyBlocks {
                side,
                blocks: self.blocks(),
            });
        }
        if self
            .offset
            .checked_add(len)
            .is_none_or(|end| end > self.block_stride)
        {
            return Err(LayoutProblem::OutsideBlock {
                side,
                offset: self.offset,
                len,
                stride: self.block_stride,
            });
        }
        Ok(())
    }
}

/// Why a [`BlockLayout`] cannot carry a copy of some length per block.
#[derive(Debug, thiserror::Error)]
enum LayoutProblem {
    #[error("the {side} block stride {stride} does not divide the {side} pool of {pool_bytes} bytes; pass the pool size in whole blocks")]
    StrideDoesNotDivide {
        side: Side,
        stride: u64,
        pool_bytes: u64,
    },
    #[error("the {side} pool holds {blocks} blocks, more than block ids (u32) can name")]
    TooManyBlocks { side: Side, blocks: u64 },
    #[error("the sub-range {offset}..+{len} lies outside the {side} block of {stride} bytes")]
    OutsideBlock {
        side: Side,
        offset: u64,
        len: u64,
        stride: u64,
    },
}

/// Where a pool's size comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Sizing {
    /// Every pool is `pool_bytes` of its side's [`BlockLayout`].
    Layout,
    /// Each pool holds the whole blocks that fit from its start to the end of its region (here)
    /// and of its buffer (at the peer).
    ToTheEnd,
}

/// One pool: where it starts in a local region and in a peer's buffer.
#[derive(Clone)]
struct Pool {
    region: Arc<RegionEntry>,
    local_offset: u64,
    /// The peer's buffer, as the caller named it.
    remote_addr: u64,
    remote_len: u64,
    remote_offset: u64,
}

impl Pool {
    /// One side's memory: its first byte, its length and the pool's offset into it.
    fn memory(&self, side: Side) -> (u64, u64, u64) {
        match side {
            Side::Local => (
                self.region.info.addr,
                self.region.info.len,
                self.local_offset,
            ),
            Side::Remote => (self.remote_addr, self.remote_len, self.remote_offset),
        }
    }

    /// Address of the remote pool's first byte (saturating: validation refuses an overflow).
    fn remote_base(&self) -> u64 {
        self.remote_addr.saturating_add(self.remote_offset)
    }
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field(
                "local",
                &format_args!(
                    "{:#x}",
                    self.region.info.addr.saturating_add(self.local_offset)
                ),
            )
            .field("remote", &format_args!("{:#x}", self.remote_base()))
            .finish()
    }
}

/// A paged copy: `len` bytes of block `local_ids[i]` of every local pool to or from block
/// `remote_ids[i]` of the matching remote pool, for every `i`.
///
/// Make one with [`BlockCopy::packed`] (whole blocks of one size, back to back on both sides)
/// or the general [`BlockCopy::new`] (a [`BlockLayout`] per side: strides, sub-ranges of
/// blocks, fixed pool sizes). Add pools, one per layer and K/V, with [`BlockCopy::pool`] (a
/// whole local [`Region`] and a whole buffer of the peer, from [`crate::Peer::buffer`]) or
/// [`BlockCopy::pool_at`] (a pool starting inside them), then hand the copy to
/// [`crate::Batch::write_blocks`] or [`crate::Batch::read_blocks`].
///
/// Everything is checked when the batch is submitted, before a byte moves: lengths, layouts,
/// every block id against every pool (the error names the offending index and pool), and every
/// pool against its region here and its buffer at the peer.
///
/// # Examples
///
/// ```no_run
/// # async fn demo(engine: ferry_core::Engine, peer: ferry_core::Peer, k: ferry_core::Region,
/// #     v: ferry_core::Region) -> Result<(), ferry_core::Error> {
/// const BLOCK: u64 = 16 << 10;
/// let missing = || ferry_core::Error::ApiMisuse("the peer has no pool of that name".into());
/// let copy = ferry_core::BlockCopy::packed(BLOCK, vec![3, 17, 9], vec![40, 0, 63])
///     .pool(&k, &peer.buffer("k").ok_or_else(missing)?)
///     .pool(&v, &peer.buffer("v").ok_or_else(missing)?);
/// engine.batch(&peer).write_blocks(copy).submit()?.await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct BlockCopy {
    len: u64,
    local: BlockLayout,
    remote: BlockLayout,
    sizing: Sizing,
    local_ids: Arc<[u32]>,
    remote_ids: Arc<[u32]>,
    pools: Vec<Pool>,
}

impl BlockCopy {
    /// The common copy: whole blocks of `block_bytes`, back to back in every pool on both
    /// sides, moving block `local_ids[i]` to or from block `remote_ids[i]`.
    ///
    /// A pool holds the whole blocks that fit from where it starts to the end of its region
    /// (here) and of its buffer (at the peer); block ids are checked against each pool.
    pub fn packed(
        block_bytes: u64,
        local_ids: impl Into<Arc<[u32]>>,
        remote_ids: impl Into<Arc<[u32]>>,
    ) -> BlockCopy {
        // The pool sizes are filled in per pool, at validation.
        let layout = BlockLayout::packed(0, block_bytes);
        BlockCopy {
            sizing: Sizing::ToTheEnd,
            ..BlockCopy::new(block_bytes, layout, layout, local_ids, remote_ids)
        }
    }

    /// The general copy: `len` bytes per block between pools laid out as `local` (here) and
    /// `remote` (at the peer), moving block `local_ids[i]` to or from block `remote_ids[i]`.
    /// Every pool is `pool_bytes` of its side's layout long.
    pub fn new(
        len: u64,
        local: BlockLayout,
        remote: BlockLayout,
        local_ids: impl Into<Arc<[u32]>>,
        remote_ids: impl Into<Arc<[u32]>>,
    ) -> BlockCopy {
        BlockCopy {
            len,
            local,
            remote,
            sizing: Sizing::Layout,
            local_ids: local_ids.into(),
            remote_ids: remote_ids.into(),
            pools: Vec::new(),
        }
    }

    /// Adds a pool that starts at the first byte of `region` here and of `remote` at the peer
    /// (a buffer from [`crate::Peer::buffer`] or [`crate::Peer::buffers`]).
    pub fn pool(self, region: &Region, remote: &BufferDescriptor) -> BlockCopy {
        self.pool_at(region, 0, remote, 0)
    }

    /// Adds a pool that starts `local_offset` bytes into `region` here and `remote_offset`
    /// bytes into the peer's buffer `remote`: for several pools in one region or buffer.
    pub fn pool_at(
        mut self,
        region: &Region,
        local_offset: u64,
        remote: &BufferDescriptor,
        remote_offset: u64,
    ) -> BlockCopy {
        self.pools.push(Pool {
            region: Arc::clone(&region.entry),
            local_offset,
            remote_addr: remote.addr,
            remote_len: remote.len,
            remote_offset,
        });
        self
    }

    /// The same copy (length, layouts, pools) moving other blocks: block `local_ids[i]` to or
    /// from block `remote_ids[i]` of every pool. A caller that submits one set of pools request
    /// after request builds it once and gives each request its ids; they are checked at submit
    /// as any copy's are.
    pub fn with_ids(
        mut self,
        local_ids: impl Into<Arc<[u32]>>,
        remote_ids: impl Into<Arc<[u32]>>,
    ) -> BlockCopy {
        self.local_ids = local_ids.into();
        self.remote_ids = remote_ids.into();
        self
    }

    /// Bytes the copy moves.
    pub fn bytes(&self) -> u64 {
        self.len * self.local_ids.len() as u64 * self.pools.len() as u64
    }

    pub(crate) fn regions(&self) -> impl ExactSizeIterator<Item = &Arc<RegionEntry>> {
        self.pools.iter().map(|pool| &pool.region)
    }

    /// `side`'s layout for `pool`: the copy's own, or sized to the end of the pool's memory.
    fn layout(&self, side: Side, pool: &Pool) -> BlockLayout {
        let layout = match side {
            Side::Local => self.local,
            Side::Remote => self.remote,
        };
        match self.sizing {
            Sizing::Layout => layout,
            Sizing::ToTheEnd => {
                let (_, len, offset) = pool.memory(side);
                let room = len.saturating_sub(offset);
                BlockLayout {
                    pool_bytes: room - room % layout.block_stride.max(1),
                    ..layout
                }
            }
        }
    }

    /// Checks everything that can be checked before the peer's current buffers are consulted:
    /// lengths, layouts, ids against every pool, every pool against its region and the buffer
    /// the caller named. Returns the highest remote block id (0 without ids), for
    /// [`BlockOps::remote_highest`]. Whether a read writes a local block twice is
    /// [`BlockCopy::check_repeats`].
    pub(crate) fn validate(&self, copy: usize) -> Result<u32, RangeError> {
        let fail = |problem: String| RangeError::Blocks { copy, problem };
        if self.len == 0 || self.pools.is_empty() || self.local_ids.is_empty() {
            return Err(fail(format!(
                "nothing to move ({} bytes per block, {} pools, {} blocks); give a length, at least one pool and one block",
                self.len,
                self.pools.len(),
                self.local_ids.len()
            )));
        }
        if self.local_ids.len() != self.remote_ids.len() {
            return Err(fail(format!(
                "{} local block ids but {} remote ones; the lists pair up and must be the same length",
                self.local_ids.len(),
                self.remote_ids.len()
            )));
        }
        for (layout, side) in [(&self.local, Side::Local), (&self.remote, Side::Remote)] {
            layout
                .check(side, self.len)
                .map_err(|problem| fail(problem.to_string()))?;
        }
        // One pass per side against the smallest pool's block count: when every id is below
        // it, no pool can refuse an id and only the pools' extents are left to check. Else the
        // exact walk below finds the first offending pool and index.
        let fewest = |side: Side| {
            self.pools
                .iter()
                .map(|pool| self.layout(side, pool).blocks())
                .min()
                .unwrap_or(0)
        };
        let (local_highest, remote_highest) = (highest(&self.local_ids), highest(&self.remote_ids));
        let ids_fit = u64::from(local_highest) < fewest(Side::Local)
            && u64::from(remote_highest) < fewest(Side::Remote);
        for (index, pool) in self.pools.iter().enumerate() {
            for (side, ids, highest) in [
                (Side::Local, &self.local_ids, local_highest),
                (Side::Remote, &self.remote_ids, remote_highest),
            ] {
                let layout = self.layout(side, pool);
                let (addr, len, offset) = pool.memory(side);
                let extent = layout.extent(self.len);
                if offset.checked_add(extent).is_none_or(|end| end > len) {
                    return Err(RangeError::PoolNotRegistered {
                        copy,
                        pool: index,
                        side,
                        addr: addr.saturating_add(offset),
                        len: extent,
                    });
                }
                let blocks = layout.blocks();
                if ids_fit || u64::from(highest) < blocks {
                    continue;
                }
                if let Some(at) = ids.iter().position(|&id| u64::from(id) >= blocks) {
                    return Err(fail(format!(
                        "{side} block id {} at index {at} is outside the {blocks} blocks of pool {index}",
                        ids[at]
                    )));
                }
            }
        }
        Ok(remote_highest)
    }

    /// Block ids of this copy (one per pair).
    pub(crate) fn pairs(&self) -> usize {
        self.local_ids.len()
    }

    /// For a read: that no local block id appears twice, since the copies into it would race.
    /// [`RangeError::Blocks`] naming the second appearance when one does.
    pub(crate) fn check_repeats(&self, copy: usize) -> Result<(), RangeError> {
        match repeated(&self.local_ids, highest(&self.local_ids)) {
            Some((index, id)) => Err(RangeError::Blocks {
                copy,
                problem: format!(
                    "local block id {id} at index {index} is read into twice; the copies would race"
                ),
            }),
            None => Ok(()),
        }
    }

    /// Resolves every pool against its region use (`uses`, in pool order) and the peer's
    /// buffers (`covering`), after [`BlockCopy::validate`].
    pub(crate) fn resolve(
        &self,
        copy: usize,
        uses: &[Arc<RegionUse>],
        covering: impl Fn(u64, u64) -> Option<Arc<BufferDescriptor>>,
    ) -> Result<Vec<BlockPoolOp>, RangeError> {
        let mut resolved = Vec::with_capacity(self.pools.len());
        for (index, (pool, region)) in self.pools.iter().zip(uses).enumerate() {
            let extent = self.layout(Side::Remote, pool).extent(self.len);
            let remote_base = pool.remote_base();
            let remote = covering(remote_base, extent).ok_or(RangeError::PoolNotRegistered {
                copy,
                pool: index,
                side: Side::Remote,
                addr: remote_base,
                len: extent,
            })?;
            resolved.push(BlockPoolOp {
                region: Arc::clone(region),
                local_base: pool.region.info.addr + pool.local_offset,
                remote,
                remote_base,
            });
        }
        Ok(resolved)
    }

    /// The shape shared by every pool, for [`BlockOps`]; `remote_highest` is what
    /// [`BlockCopy::validate`] returned.
    pub(crate) fn ops(
        &self,
        direction: Direction,
        pools: Vec<BlockPoolOp>,
        remote_highest: u32,
    ) -> BlockOps {
        BlockOps {
            direction,
            pools,
            len: self.len,
            local_stride: self.local.block_stride,
            local_offset: self.local.offset,
            remote_stride: self.remote.block_stride,
            remote_offset: self.remote.offset,
            local_ids: Arc::clone(&self.local_ids),
            remote_ids: Arc::clone(&self.remote_ids),
            remote_highest,
            after: None,
        }
    }
}

/// The first id that appears earlier in `ids` too, with its index; every id is at most
/// `highest`. One bit per id, set without looking at it first, then counted: a branch per id
/// (or a bool per id) made this check most of a large read's host cost.
fn repeated(ids: &[u32], highest: u32) -> Option<(usize, u32)> {
    let words = highest as usize / 64 + 1;
    let mut seen = vec![0u64; words];
    for &id in ids {
        seen[id as usize / 64] |= 1 << (id % 64);
    }
    let distinct: usize = seen.iter().map(|word| word.count_ones() as usize).sum();
    if distinct == ids.len() {
        return None;
    }
    seen.fill(0);
    ids.iter().enumerate().find_map(|(index, &id)| {
        let (word, bit) = (id as usize / 64, 1u64 << (id % 64));
        let before = seen[word];
        seen[word] = before | bit;
        (before & bit != 0).then_some((index, id))
    })
}

/// The highest id, 0 without ids: one pass of vector compares. Built for AVX2 and SSE4.1 as
/// well and chosen at run time: baseline x86-64 has no unsigned 32-bit vector max, and
/// emulating it made this pass most of a large submit's host cost.
#[multiversion::multiversion(targets("x86_64+avx2", "x86_64+sse4.1"))]
fn highest(ids: &[u32]) -> u32 {
    ids.iter().copied().max().unwrap_or(0)
}

/// One checked pool of [`BlockOps`].
#[derive(Clone)]
pub struct BlockPoolOp {
    /// Keeps the local region registered until the op is dropped.
    pub region: Arc<RegionUse>,
    /// Address of the local pool's first byte.
    pub local_base: u64,
    /// The peer's buffer holding the whole remote pool, with how to map it.
    pub remote: Arc<BufferDescriptor>,
    /// Address of the remote pool's first byte.
    pub remote_base: u64,
}

impl std::fmt::Debug for BlockPoolOp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockPoolOp")
            .field("local_base", &format_args!("{:#x}", self.local_base))
            .field("remote_base", &format_args!("{:#x}", self.remote_base))
            .finish()
    }
}

/// A validated paged copy for one link: every block of every pool lies inside the pool's local
/// region and remote buffer. Only the engine makes one, from a batch it checked, so a link can
/// trust what the accessors report (a remote extent from [`BlockOps::remote_highest`], say)
/// without checking every id again.
#[derive(Debug, Clone)]
pub struct BlockOps {
    pub(crate) direction: Direction,
    pub(crate) pools: Vec<BlockPoolOp>,
    pub(crate) len: u64,
    pub(crate) local_stride: u64,
    pub(crate) local_offset: u64,
    pub(crate) remote_stride: u64,
    pub(crate) remote_offset: u64,
    pub(crate) local_ids: Arc<[u32]>,
    pub(crate) remote_ids: Arc<[u32]>,
    pub(crate) remote_highest: u32,
    pub(crate) after: Option<Arc<Event>>,
}

impl BlockOps {
    /// Which way the bytes go.
    pub fn direction(&self) -> Direction {
        self.direction
    }

    /// The pools, checked.
    pub fn pools(&self) -> &[BlockPoolOp] {
        &self.pools
    }

    /// Bytes per block.
    pub fn block_len(&self) -> u64 {
        self.len
    }

    /// Bytes between local blocks.
    pub fn local_stride(&self) -> u64 {
        self.local_stride
    }

    /// Where the bytes start inside a local block.
    pub fn local_offset(&self) -> u64 {
        self.local_offset
    }

    /// Bytes between remote blocks.
    pub fn remote_stride(&self) -> u64 {
        self.remote_stride
    }

    /// Where the bytes start inside a remote block.
    pub fn remote_offset(&self) -> u64 {
        self.remote_offset
    }

    /// Local block of each pair.
    pub fn local_ids(&self) -> &Arc<[u32]> {
        &self.local_ids
    }

    /// Remote block of each pair.
    pub fn remote_ids(&self) -> &Arc<[u32]> {
        &self.remote_ids
    }

    /// The highest of the remote ids (0 without ids), found when the batch was checked: how
    /// far into each remote pool the copy reaches.
    pub fn remote_highest(&self) -> u32 {
        self.remote_highest
    }

    /// No byte may move before this event has fired ([`crate::Batch::after`]). A transport
    /// whose copies run on GPU streams makes them wait for it there; any other waits on the
    /// host first ([`BlockOps::wait_on_host`]).
    pub fn after(&self) -> Option<&Arc<Event>> {
        self.after.as_ref()
    }

    /// Resolves once [`BlockOps::after`] has fired (at once without one): for transports
    /// that cannot make the GPU wait for it.
    ///
    /// # Errors
    /// [`crate::Error::Cuda`] when the work before the event failed.
    ///
    /// # Cancel safety
    /// Cancel safe: dropping it only stops waiting.
    pub async fn wait_on_host(&self) -> Result<()> {
        match &self.after {
            Some(event) => Poller::global().wait(Arc::clone(event)).await,
            None => Ok(()),
        }
    }

    /// Bytes moved.
    pub fn bytes(&self) -> u64 {
        self.len * self.local_ids.len() as u64 * self.pools.len() as u64
    }

    /// The same copy as one op per block, with blocks that continue each other on both sides
    /// merged: for transports that take address lists.
    ///
    /// # Panics
    /// When the pools span 2^32 or more distinct regions or buffers.
    pub fn into_ops(self) -> TransferOps {
        // Pools mostly share a region and a buffer: each is in its table once, so blocks that
        // continue each other across pools still merge.
        let mut regions: Vec<Arc<RegionUse>> = Vec::new();
        let mut remotes: Vec<Arc<BufferDescriptor>> = Vec::new();
        let indices: Vec<(u32, u32)> = self
            .pools
            .iter()
            .map(|pool| {
                (
                    table_index(&mut regions, &pool.region),
                    table_index(&mut remotes, &pool.remote),
                )
            })
            .collect();
        let mut ops = TransferOps::new(
            regions.into(),
            remotes.into(),
            self.pools.len() * self.local_ids.len(),
        );
        for (pool, &(region, remote_buffer)) in self.pools.iter().zip(&indices) {
            for (&local, &remote) in self.local_ids.iter().zip(self.remote_ids.iter()) {
                let local_addr =
                    pool.local_base + u64::from(local) * self.local_stride + self.local_offset;
                let remote_addr =
                    pool.remote_base + u64::from(remote) * self.remote_stride + self.remote_offset;
                ops.push_merged(TransferOp {
                    direction: self.direction,
                    region,
                    local_addr,
                    remote_addr,
                    remote: remote_buffer,
                    len: self.len,
                });
            }
        }
        ops
    }
}

/// The index of `item` in `table`, appending it first when it is not there yet.
///
/// # Panics
/// When the table would hold 2^32 entries.
fn table_index<T>(table: &mut Vec<Arc<T>>, item: &Arc<T>) -> u32 {
    let index = match table.iter().position(|known| Arc::ptr_eq(known, item)) {
        Some(index) => index,
        None => {
            table.push(Arc::clone(item));
            table.len() - 1
        }
    };
    u32::try_from(index).expect("fewer than 2^32 distinct regions and buffers")
}

#[cfg(test)]
mod tests {
    use super::{highest, BlockOps, BlockPoolOp};
    use crate::descriptor::BufferDescriptor;
    use crate::memory::{Location, RegionEntry, RegionInfo, RegionUse};
    use crate::ops::Direction;
    use std::sync::Arc;

    fn region_use(addr: u64) -> Arc<RegionUse> {
        let info = RegionInfo {
            addr,
            len: 0x1000,
            location: Location::Host { pinned: false },
        };
        let entry = Arc::new(RegionEntry::new(info, 0, 1, Vec::new(), Vec::new(), None));
        Arc::new(entry.acquire().expect("a fresh region is open"))
    }

    fn buffer(addr: u64) -> Arc<BufferDescriptor> {
        Arc::new(BufferDescriptor {
            addr,
            len: 0x1000,
            location: Location::Host { pinned: false },
            name: None,
            exports: Vec::new(),
        })
    }

    #[test]
    fn into_ops_names_each_region_and_buffer_once_and_merges_across_pools_that_share_them() {
        let (region, other_region) = (region_use(0x1_0000), region_use(0x2_0000));
        let remote = buffer(0x9_0000);
        let pool = |region: &Arc<RegionUse>, local_base, remote_base| BlockPoolOp {
            region: Arc::clone(region),
            local_base,
            remote: Arc::clone(&remote),
            remote_base,
        };
        let blocks = BlockOps {
            direction: Direction::Write,
            // The second pool starts where the first one's last block ends, on both sides.
            pools: vec![
                pool(&region, 0x1_0000, 0x9_0000),
                pool(&region, 0x1_0200, 0x9_0200),
                pool(&other_region, 0x2_0000, 0x9_0400),
            ],
            len: 0x100,
            local_stride: 0x100,
            local_offset: 0,
            remote_stride: 0x100,
            remote_offset: 0,
            local_ids: vec![0, 1].into(),
            remote_ids: vec![0, 1].into(),
            remote_highest: 1,
            after: None,
        };
        let ops = blocks.into_ops();
        assert_eq!(ops.regions().len(), 2);
        assert_eq!(ops.remotes().len(), 1);
        let shape: Vec<(u64, u64, u64)> = ops
            .iter()
            .map(|op| (ops.region(op).info().addr, op.local_addr, op.len))
            .collect();
        assert_eq!(
            shape,
            [(0x1_0000, 0x1_0000, 0x400), (0x2_0000, 0x2_0000, 0x200)]
        );
        assert!(ops.iter().all(|op| Arc::ptr_eq(ops.remote(op), &remote)));
    }

    #[test]
    fn the_highest_id_is_found_in_a_chunk_and_in_the_remainder_and_is_zero_without_ids() {
        let mut ids = vec![3u32; 64 * 3 + 5];
        assert_eq!(highest(&ids), 3);
        ids[64 + 17] = 9;
        assert_eq!(highest(&ids), 9);
        ids[64 * 3 + 4] = u32::MAX;
        assert_eq!(highest(&ids), u32::MAX);
        assert_eq!(highest(&[]), 0);
    }
}
