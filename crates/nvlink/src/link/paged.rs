//! Turning a transfer's ops and block copies into the kernel's work: each remote buffer
//! resolved for the GPU that copies, flat copies planned into pieces, paged copies into
//! pools and ids.

use super::*;

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

    /// Plans a paged copy as one kernel launch, or `None` when the copy engines should take
    /// it (path, size, or a pool the kernel cannot reach). Every remote pool is checked up to
    /// its highest block id against what its buffer's mapping really holds.
    pub(super) fn paged(
        &self,
        blocks: &BlockOps,
        held: &mut Held,
    ) -> Result<Option<(Arc<GpuLane>, Paged)>> {
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
        let mut remote_bases = Vec::with_capacity(blocks.pools().len());
        let mut last = None;
        for pool in blocks.pools() {
            let same_gpu = matches!(pool.region.info().location, Location::Device { ordinal: other, .. } if other == ordinal);
            let resolved = self.resolve(&lane, ordinal, &pool.remote, &mut last, held)?;
            if !same_gpu || !resolved.reachable {
                return Ok(None);
            }
            let remote_base = resolved
                .buffer
                .translate(pool.remote_base, extent)
                .map_err(|violation| self.fail(violation))?;
            local_bases.push(pool.local_base);
            remote_bases.push(remote_base);
        }
        let local = Side {
            bases: local_bases,
            ids: Arc::clone(blocks.local_ids()),
            stride: blocks.local_stride(),
            offset: blocks.local_offset(),
        };
        let remote = Side {
            bases: remote_bases,
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
        Ok(Some((lane, paged)))
    }
}
