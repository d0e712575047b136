//! Turning a transfer's ops and block copies into the kernel's work: each remote buffer
//! resolved for the GPU that copies, flat copies planned into pieces, paged copies into
//! pools and ids.

use super::*;
use ferry_core::BlockPoolOp;

/// The peer pools of the last paged copy a link planned, resolved: a model's requests name
/// the same buffer at the same base for every layer and K/V request after request, and
/// resolving each pool (its mapping looked up and held, its reach and bounds checked) cost a
/// request of 160 pools more than its launch.
pub(super) struct ResolvedPools {
    ordinal: u32,
    /// Bytes from each pool's base checked against its mapping: a copy whose highest block
    /// ends within them is inside the mapping too.
    extent: u64,
    /// Each pool's buffer and base at the peer, as the copy named them.
    remotes: Vec<(Arc<BufferDescriptor>, u64)>,
    /// Each pool's base where it is mapped here, checked for `extent` bytes.
    bases: Vec<u64>,
    /// The mappings the pools lie in, never read: held so that closing the link meanwhile
    /// unmaps nothing a copy planned from them still uses.
    _held: Held,
}

/// A paged copy planned: the lane that launches it, its launch, and the resolved peer pools
/// it copies between, kept until it ends.
pub(super) type PlannedPaged = (Arc<GpuLane>, Paged, Arc<ResolvedPools>);

impl ResolvedPools {
    /// Whether `pools`, copied up to `extent` bytes from each base by GPU `ordinal`, are the
    /// pools resolved, checked for at least as many bytes.
    fn matches(&self, ordinal: u32, extent: u64, pools: &[BlockPoolOp]) -> bool {
        self.ordinal == ordinal
            && extent <= self.extent
            && self.remotes.len() == pools.len()
            && self
                .remotes
                .iter()
                .zip(pools)
                .all(|((remote, base), pool)| {
                    Arc::ptr_eq(remote, &pool.remote) && *base == pool.remote_base
                })
    }
}

/// A remote buffer resolved for one GPU: where it is mapped here, and whether the GPU's
/// kernels reach it.
#[derive(Clone, Copy)]
pub(super) struct Resolved {
    pub(super) buffer: MappedBuffer,
    pub(super) reachable: bool,
}

impl NvlinkLink {
    /// Where `remote` is mapped here and whether this GPU's kernels reach it, remembering the
    /// last buffer asked about: consecutive ops and pools mostly share one.
    pub(super) fn resolve(
        &self,
        lane: &GpuLane,
        ordinal: u32,
        remote: &Arc<BufferDescriptor>,
        last: &mut Option<(*const BufferDescriptor, Resolved)>,
        held: &mut Held,
    ) -> Result<Resolved> {
        let key = Arc::as_ptr(remote);
        if let Some((previous, resolved)) = *last {
            if previous == key {
                return Ok(resolved);
            }
        }
        let buffer = self.mapped(remote, held)?;
        let reachable = lane.kernels.is_some() && self.kernel_reaches(lane, ordinal, remote);
        let resolved = Resolved { buffer, reachable };
        *last = Some((key, resolved));
        Ok(resolved)
    }

    /// Turns the ops of one local GPU into copies between addresses of this process, each
    /// remote range checked against what its buffer's mapping really holds. `ops` are among
    /// `all`, whose tables name their buffers.
    pub(super) fn copies(
        &self,
        lane: &GpuLane,
        ordinal: u32,
        all: &TransferOps,
        ops: &[&TransferOp],
        held: &mut Held,
    ) -> Result<Vec<plan::Copy>> {
        let mut copies = Vec::with_capacity(ops.len());
        let mut last = None;
        for op in ops {
            let resolved = self.resolve(lane, ordinal, all.remote(op), &mut last, held)?;
            let remote = resolved
                .buffer
                .translate(op.remote_addr, op.len)
                .map_err(|violation| self.fail(violation))?;
            self.host_len(op.len)?;
            let (dst, src) = match op.direction {
                Direction::Write => (remote, op.local_addr),
                Direction::Read => (op.local_addr, remote),
            };
            copies.push(plan::Copy {
                dst,
                src,
                len: op.len,
                kernel_reaches: resolved.reachable,
            });
        }
        Ok(copies)
    }

    /// Plans a paged copy as one kernel launch, or `None` when the copy engines should take it
    /// (path, size, or a pool the kernel cannot reach). Every remote pool is checked up to
    /// its highest block id against what its buffer's mapping really holds.
    pub(super) fn paged(&self, blocks: &BlockOps) -> Result<Option<PlannedPaged>> {
        let wanted = plan::takes_kernel(
            self.config.copy_path,
            blocks.block_len(),
            Driver::get().has_batched_copies(),
        );
        let Some(first) = blocks.pools().first() else {
            return Ok(None);
        };
        let Location::Device { ordinal, .. } = first.region.info().location else {
            return Err(self.refused("a local range is not GPU memory"));
        };
        let (Ok(pools), Ok(ids)) = (
            u32::try_from(blocks.pools().len()),
            u32::try_from(blocks.local_ids().len()),
        ) else {
            return Ok(None);
        };
        if !wanted {
            return Ok(None);
        }
        let lane = self.lane(ordinal)?;
        let Some(kernels) = lane.kernels.as_ref() else {
            return Ok(None);
        };
        let highest = blocks.remote_highest();
        let extent = bounds::block_extent(
            highest,
            blocks.remote_stride(),
            blocks.remote_offset(),
            blocks.block_len(),
        )
        .ok_or_else(|| {
            Error::ApiMisuse(format!(
                "remote block {highest} of a paged copy lies past the end of the address space; fix the block ids or the layout"
            ))
        })?;
        let mut local_bases = Vec::with_capacity(blocks.pools().len());
        for pool in blocks.pools() {
            let same_gpu = matches!(pool.region.info().location, Location::Device { ordinal: other, .. } if other == ordinal);
            if !same_gpu {
                return Ok(None);
            }
            local_bases.push(pool.local_base);
        }
        let resolved = match self.kept_pools(ordinal, extent, blocks.pools()) {
            Some(resolved) => resolved,
            None => match self.resolve_pools(&lane, ordinal, extent, blocks.pools())? {
                Some(resolved) => self.keep_pools(resolved),
                None => return Ok(None),
            },
        };
        let local = Side {
            bases: local_bases,
            ids: Arc::clone(blocks.local_ids()),
            stride: blocks.local_stride(),
            offset: blocks.local_offset(),
        };
        let remote = Side {
            bases: resolved.bases.clone(),
            ids: Arc::clone(blocks.remote_ids()),
            stride: blocks.remote_stride(),
            offset: blocks.remote_offset(),
        };
        let (src, dst) = match blocks.direction() {
            Direction::Write => (local, remote),
            Direction::Read => (remote, local),
        };
        // Every block's ends agree modulo 16 when every base, stride and offset is a multiple
        // of 16; otherwise some may not, and blocks long enough to gain from more loads in
        // flight take the `_shifted` build.
        let shifted = blocks.block_len() >= plan::DEEP_SHIFT_FROM
            && [&src, &dst].iter().any(|side| {
                side.bases.iter().any(|base| base % 16 != 0)
                    || side.stride % 16 != 0
                    || side.offset % 16 != 0
            });
        let pairs = u64::from(pools) * u64::from(ids);
        let chunk = lane
            .pieces(&self.config)
            .len_for(pairs.saturating_mul(blocks.block_len()));
        let items = pairs * blocks.block_len().div_ceil(chunk);
        let paged = Paged {
            layout: plan::PagedArgs::new(blocks.pools().len(), blocks.local_ids().len()),
            grid: kernels.grid(items, &self.config, shifted),
            pools,
            ids,
            src,
            dst,
            len: blocks.block_len(),
            chunk,
            shifted,
            stream: match blocks.after() {
                Some(_) => lane.waiting_stream(),
                None => 0,
            },
            after: blocks.after().cloned(),
        };
        Ok(Some((lane, paged, resolved)))
    }

    /// The peer pools kept from an earlier paged copy when `pools` are they, copied by GPU
    /// `ordinal` no further than `extent` bytes from each base. Never for a peer engine of this
    /// process: its buffers are not mapped but checked against its registrations, which it may
    /// change without a new descriptor, so every copy checks them again.
    fn kept_pools(
        &self,
        ordinal: u32,
        extent: u64,
        pools: &[BlockPoolOp],
    ) -> Option<Arc<ResolvedPools>> {
        if self.local_peer.is_some() {
            return None;
        }
        self.resolved_pools
            .lock()
            .as_ref()
            .filter(|resolved| resolved.matches(ordinal, extent, pools))
            .cloned()
    }

    /// Keeps `resolved` for the next paged copy ([`Self::kept_pools`] says when it may be
    /// reused), unless the link closed meanwhile: a closed link holds no mappings.
    fn keep_pools(&self, resolved: ResolvedPools) -> Arc<ResolvedPools> {
        let resolved = Arc::new(resolved);
        let mut kept = self.resolved_pools.lock();
        if self.alive.load(Ordering::Acquire) {
            *kept = Some(Arc::clone(&resolved));
        }
        resolved
    }

    /// Resolves every peer pool of a paged copy by GPU `ordinal` for `extent` bytes each, or
    /// `None` when one lies where this GPU's kernels do not reach.
    fn resolve_pools(
        &self,
        lane: &GpuLane,
        ordinal: u32,
        extent: u64,
        pools: &[BlockPoolOp],
    ) -> Result<Option<ResolvedPools>> {
        let mut held = Held::default();
        let mut bases = Vec::with_capacity(pools.len());
        let mut last = None;
        for pool in pools {
            let resolved = self.resolve(lane, ordinal, &pool.remote, &mut last, &mut held)?;
            if !resolved.reachable {
                return Ok(None);
            }
            let base = resolved
                .buffer
                .translate(pool.remote_base, extent)
                .map_err(|violation| self.fail(violation))?;
            bases.push(base);
        }
        Ok(Some(ResolvedPools {
            ordinal,
            extent,
            remotes: pools
                .iter()
                .map(|pool| (Arc::clone(&pool.remote), pool.remote_base))
                .collect(),
            bases,
            _held: held,
        }))
    }
}
