//! Paged-KV block copies: the same few bytes of many fixed-size blocks of many pools (one pool
//! per layer and K/V), named by block ids rather than by one entry per block, so a transport
//! can compute the addresses itself (the nvlink kernel does, on the GPU).

use crate::descriptor::BufferDescriptor;
use crate::error::{RangeError, Side};
use crate::memory::{Region, RegionEntry, RegionUse};
use crate::transport::{Direction, TransferOp};
use std::sync::Arc;

/// How one side's pools are laid out: every pool of a [`BlockCopy`] has this layout.
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

    /// From a pool's base to the end of the last byte a copy of `len` bytes per block can touch.
    fn extent(&self, len: u64) -> u64 {
        self.pool_bytes - self.block_stride + self.offset + len
    }

    fn check(&self, side: Side, len: u64) -> Result<(), String> {
        if self.block_stride == 0 || self.pool_bytes % self.block_stride != 0 {
            return Err(format!(
                "the {side} block stride {} does not divide the {side} pool of {} bytes; pass the pool size in whole blocks",
                self.block_stride, self.pool_bytes
            ));
        }
        if self.blocks() > u64::from(u32::MAX) {
            return Err(format!(
                "the {side} pool holds {} blocks, more than block ids (u32) can name",
                self.blocks()
            ));
        }
        if self
            .offset
            .checked_add(len)
            .is_none_or(|end| end > self.block_stride)
        {
            return Err(format!(
                "the sub-range {}..+{len} lies outside the {side} block of {} bytes",
                self.offset, self.block_stride
            ));
        }
        Ok(())
    }
}

/// One pool: where it starts in a local region and at the peer.
#[derive(Clone)]
struct Pool {
    region: Arc<RegionEntry>,
    offset: u64,
    remote_addr: u64,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field(
                "local",
                &format_args!("{:#x}", self.region.info.addr + self.offset),
            )
            .field("remote", &format_args!("{:#x}", self.remote_addr))
            .finish()
    }
}

/// A paged copy: `len` bytes of block `local_ids[i]` of every local pool to or from block
/// `remote_ids[i]` of the matching remote pool, for every `i`. Add pools with
/// [`BlockCopy::pool`], then hand it to [`crate::Batch::write_blocks`] or
/// [`crate::Batch::read_blocks`]. Everything is checked when the batch is submitted.
#[derive(Debug, Clone)]
pub struct BlockCopy {
    len: u64,
    local: BlockLayout,
    remote: BlockLayout,
    local_ids: Arc<[u32]>,
    remote_ids: Arc<[u32]>,
    pools: Vec<Pool>,
}

impl BlockCopy {
    /// A copy of `len` bytes per block between pools laid out as `local` and `remote`, moving
    /// block `local_ids[i]` to or from block `remote_ids[i]`.
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
            local_ids: local_ids.into(),
            remote_ids: remote_ids.into(),
            pools: Vec::new(),
        }
    }

    /// Adds a pool starting `offset` bytes into `region` here and at `remote_addr` at the peer.
    pub fn pool(mut self, region: &Region, offset: u64, remote_addr: u64) -> BlockCopy {
        self.pools.push(Pool {
            region: Arc::clone(&region.entry),
            offset,
            remote_addr,
        });
        self
    }

    /// Bytes the copy moves.
    pub fn bytes(&self) -> u64 {
        self.len * self.local_ids.len() as u64 * self.pools.len() as u64
    }

    pub(crate) fn regions(&self) -> impl Iterator<Item = &Arc<RegionEntry>> {
        self.pools.iter().map(|pool| &pool.region)
    }

    /// Checks everything that does not depend on the peer: lengths, layouts, ids, local pools,
    /// and (for reads) that no local block is written twice.
    pub(crate) fn validate(&self, copy: usize, direction: Direction) -> Result<(), RangeError> {
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
        self.local.check(Side::Local, self.len).map_err(fail)?;
        self.remote.check(Side::Remote, self.len).map_err(fail)?;
        for (side, ids, layout) in [
            (Side::Local, &self.local_ids, &self.local),
            (Side::Remote, &self.remote_ids, &self.remote),
        ] {
            let blocks = layout.blocks();
            // The maximum is one fast pass; the offending index is looked up only on failure.
            let highest = ids.iter().copied().max().unwrap_or(0);
            if u64::from(highest) < blocks {
                continue;
            }
            if let Some(index) = ids.iter().position(|&id| u64::from(id) >= blocks) {
                return Err(fail(format!(
                    "{side} block id {} at index {index} is outside the pool's {blocks} blocks",
                    ids[index]
                )));
            }
        }
        let extent = self.local.extent(self.len);
        for (index, pool) in self.pools.iter().enumerate() {
            let region_len = pool.region.info.len;
            if pool
                .offset
                .checked_add(extent)
                .is_none_or(|end| end > region_len)
            {
                return Err(RangeError::PoolNotRegistered {
                    copy,
                    pool: index,
                    side: Side::Local,
                    addr: pool.region.info.addr.saturating_add(pool.offset),
                    len: extent,
                });
            }
        }
        if direction == Direction::Read {
            let mut seen = vec![false; self.local.blocks() as usize];
            for (index, &id) in self.local_ids.iter().enumerate() {
                if std::mem::replace(&mut seen[id as usize], true) {
                    return Err(fail(format!(
                        "local block id {id} at index {index} is read into twice; the copies would race"
                    )));
                }
            }
        }
        Ok(())
    }

    /// Resolves every pool against its region use (`uses`, in pool order) and the peer's
    /// buffers (`covering`).
    pub(crate) fn resolve(
        &self,
        copy: usize,
        uses: &[Arc<RegionUse>],
        covering: impl Fn(u64, u64) -> Option<Arc<BufferDescriptor>>,
    ) -> Result<Vec<BlockPoolOp>, RangeError> {
        let extent = self.remote.extent(self.len);
        let mut resolved = Vec::with_capacity(self.pools.len());
        for (index, (pool, region)) in self.pools.iter().zip(uses).enumerate() {
            let remote =
                covering(pool.remote_addr, extent).ok_or(RangeError::PoolNotRegistered {
                    copy,
                    pool: index,
                    side: Side::Remote,
                    addr: pool.remote_addr,
                    len: extent,
                })?;
            resolved.push(BlockPoolOp {
                region: Arc::clone(region),
                local_base: pool.region.info.addr + pool.offset,
                remote,
                remote_base: pool.remote_addr,
            });
        }
        Ok(resolved)
    }

    /// The shape shared by every pool, for [`BlockOps`].
    pub(crate) fn ops(&self, direction: Direction, pools: Vec<BlockPoolOp>) -> BlockOps {
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
        }
    }
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
/// region and remote buffer.
#[derive(Debug, Clone)]
pub struct BlockOps {
    /// Which way the bytes go.
    pub direction: Direction,
    /// The pools, checked.
    pub pools: Vec<BlockPoolOp>,
    /// Bytes per block.
    pub len: u64,
    /// Bytes between local blocks.
    pub local_stride: u64,
    /// Where the bytes start inside a local block.
    pub local_offset: u64,
    /// Bytes between remote blocks.
    pub remote_stride: u64,
    /// Where the bytes start inside a remote block.
    pub remote_offset: u64,
    /// Local block of each pair.
    pub local_ids: Arc<[u32]>,
    /// Remote block of each pair.
    pub remote_ids: Arc<[u32]>,
}

impl BlockOps {
    /// Bytes moved.
    pub fn bytes(&self) -> u64 {
        self.len * self.local_ids.len() as u64 * self.pools.len() as u64
    }

    /// The same copy as one op per block, with blocks that continue each other on both sides
    /// merged: for transports that take address lists.
    pub fn into_ops(self) -> Vec<TransferOp> {
        let mut ops: Vec<TransferOp> = Vec::with_capacity(self.pools.len() * self.local_ids.len());
        for pool in &self.pools {
            for (&local, &remote) in self.local_ids.iter().zip(self.remote_ids.iter()) {
                let local_addr =
                    pool.local_base + u64::from(local) * self.local_stride + self.local_offset;
                let remote_addr =
                    pool.remote_base + u64::from(remote) * self.remote_stride + self.remote_offset;
                TransferOp::push_merged(
                    &mut ops,
                    TransferOp {
                        direction: self.direction,
                        region: Arc::clone(&pool.region),
                        local_addr,
                        remote_addr,
                        remote: Arc::clone(&pool.remote),
                        len: self.len,
                    },
                );
            }
        }
        ops
    }
}
