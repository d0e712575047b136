use crate::args::ArgumentPool;
use crate::import::PeerMapping;
use crate::kernels::{CopyKernels, KernelShare, THREADS_PER_BLOCK};
use crate::plan::{self, Copy, CopyPath};
use crate::transport::NvlinkConfig;
use ferry_core::cuda::{Context, DeviceInfo, Driver, Event, Kernel, KernelArg, Poller, Stream};
use ferry_core::{
    BlockOps, BufferDescriptor, Direction, Error, Export, Link, Location, Result, TransferOp,
};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

/// Mappings of one peer's allocations and the local streams and kernels that copy to and from
/// them.
pub(crate) struct NvlinkLink {
    peer: String,
    /// Both engines live in this process: remote addresses are usable as they are.
    same_process: bool,
    config: NvlinkConfig,
    /// The GPUs this process sees, to tell which peer GPUs a kernel can reach.
    gpus: Arc<Vec<DeviceInfo>>,
    /// The peer's allocations mapped here, by the export that names them.
    mappings: Mutex<HashMap<Export, Arc<(PeerMapping, u64)>>>,
    /// Streams, kernels and argument buffers of each local GPU, by ordinal.
    lanes: Mutex<HashMap<u32, Arc<GpuLane>>>,
    alive: AtomicBool,
}

/// What one local GPU copies with.
struct GpuLane {
    streams: Vec<Stream>,
    /// `None` when the kernels could not be loaded; every copy then uses the copy engines.
    kernels: Option<KernelShare>,
    args: ArgumentPool,
    /// Peer GPUs (ordinals) whose memory this GPU's kernels may touch, by whether enabling
    /// peer access to them worked.
    peers: Mutex<HashMap<u32, bool>>,
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Every update is one insert, so a poisoned map is still consistent.
    mutex.lock().unwrap_or_else(|poison| poison.into_inner())
}

impl NvlinkLink {
    pub(crate) fn new(
        peer: String,
        same_process: bool,
        config: NvlinkConfig,
        gpus: Arc<Vec<DeviceInfo>>,
    ) -> NvlinkLink {
        NvlinkLink {
            peer,
            same_process,
            config,
            gpus,
            mappings: Mutex::default(),
            lanes: Mutex::default(),
            alive: AtomicBool::new(true),
        }
    }

    fn lane(&self, ordinal: u32) -> Result<Arc<GpuLane>> {
        let cached = lock(&self.lanes).get(&ordinal).cloned();
        if let Some(lane) = cached {
            return Ok(lane);
        }
        let context = Context::get(ordinal)?;
        let streams = (0..self.config.streams_per_gpu.max(1))
            .map(|_| Stream::new(Arc::clone(&context)))
            .collect::<Result<Vec<_>, _>>()?;
        let kernels = match CopyKernels::of(&context) {
            Ok(kernels) => Some(kernels.share()),
            Err(error) => {
                tracing::warn!(gpu = ordinal, %error, "the copy kernels did not load; every nvlink copy on this GPU uses the copy engines");
                None
            }
        };
        let lane = Arc::new(GpuLane {
            streams,
            kernels,
            args: ArgumentPool::new(context),
            peers: Mutex::default(),
        });
        lock(&self.lanes).insert(ordinal, Arc::clone(&lane));
        Ok(lane)
    }

    /// What to add to a remote address of `remote` to get where it is mapped in this process.
    fn remote_shift(&self, remote: &BufferDescriptor, ordinal: u32) -> Result<u64> {
        if self.same_process {
            return Ok(0);
        }
        let Some(export) = &remote.export else {
            return Err(self.refused("its buffer carries no export"));
        };
        // The lookup is its own statement so its guard is released before the insert below.
        let cached = lock(&self.mappings).get(export).cloned();
        let mapping = match cached {
            Some(mapping) => mapping,
            None => {
                let opened = PeerMapping::open(Context::get(ordinal)?, export)
                    .map_err(|reason| self.refused(&reason))?;
                let mapping = Arc::new(opened);
                lock(&self.mappings).insert(export.clone(), Arc::clone(&mapping));
                mapping
            }
        };
        let (mapping, offset) = mapping.as_ref();
        Ok((mapping.base() + offset).wrapping_sub(remote.addr))
    }

    /// Whether kernels on GPU `ordinal` can load and store `remote`'s memory directly: its GPU
    /// is visible here and is this one or a peer with access enabled. Memory of a GPU hidden by
    /// `CUDA_VISIBLE_DEVICES` is left to the copy engines.
    fn kernel_reaches(&self, lane: &GpuLane, ordinal: u32, remote: &BufferDescriptor) -> bool {
        let Location::Device { gpu, .. } = remote.location else {
            return false;
        };
        let Some(owner) = self.gpus.iter().find(|info| info.uuid == gpu) else {
            return false;
        };
        if owner.ordinal == ordinal {
            return true;
        }
        let known = lock(&lane.peers).get(&owner.ordinal).copied();
        if let Some(enabled) = known {
            return enabled;
        }
        let enabled = Context::get(ordinal)
            .and_then(|local| local.enable_peer_access(&*Context::get(owner.ordinal)?))
            .inspect_err(|error| {
                tracing::info!(from = ordinal, to = owner.ordinal, %error, "peer access refused; copies between these GPUs use the copy engines");
            })
            .is_ok();
        lock(&lane.peers).insert(owner.ordinal, enabled);
        enabled
    }

    /// The peer's mappings as they are now, so that closing the link while copies run does
    /// not unmap memory the GPU is still writing: they are released when the copies are done.
    fn hold_mappings(&self) -> Vec<Arc<(PeerMapping, u64)>> {
        lock(&self.mappings).values().cloned().collect()
    }

    /// After the copies: the link must not have been closed meanwhile (the peer was found
    /// gone, or the transfer timed out), or the bytes went to memory nobody reads.
    fn still_alive(&self) -> Result<()> {
        match self.alive.load(Ordering::Acquire) {
            true => Ok(()),
            false => Err(Error::PeerGone {
                peer: self.peer.clone(),
                reason: "the peer went away while the copies ran; resend once it is back".into(),
            }),
        }
    }

    fn host_len(&self, len: u64) -> Result<usize> {
        usize::try_from(len)
            .map_err(|_| self.refused("an op is longer than this machine's address space"))
    }

    fn refused(&self, reason: &str) -> Error {
        Error::Unavailable {
            local: "GPU memory".into(),
            peer: self.peer.clone(),
            reason: format!("nvlink: {reason}"),
        }
    }

    /// Where `remote` is mapped here (as a shift) and whether this GPU's kernels reach it,
    /// remembering the last buffer asked about: consecutive ops and pools mostly share one.
    fn resolve(
        &self,
        lane: &GpuLane,
        ordinal: u32,
        remote: &Arc<BufferDescriptor>,
        last: &mut Option<(*const BufferDescriptor, u64, bool)>,
    ) -> Result<(u64, bool)> {
        let key = Arc::as_ptr(remote);
        if let Some((previous, shift, reachable)) = *last {
            if previous == key {
                return Ok((shift, reachable));
            }
        }
        let shift = self.remote_shift(remote, ordinal)?;
        let reachable = lane.kernels.is_some() && self.kernel_reaches(lane, ordinal, remote);
        *last = Some((key, shift, reachable));
        Ok((shift, reachable))
    }

    /// Turns the ops of one local GPU into copies between addresses of this process.
    fn copies(&self, lane: &GpuLane, ordinal: u32, ops: &[&TransferOp]) -> Result<Vec<Copy>> {
        let mut copies = Vec::with_capacity(ops.len());
        let mut last = None;
        for op in ops {
            let (shift, reachable) = self.resolve(lane, ordinal, &op.remote, &mut last)?;
            let remote = op.remote_addr.wrapping_add(shift);
            let (dst, src) = match op.direction {
                Direction::Write => (remote, op.local_addr),
                Direction::Read => (op.local_addr, remote),
            };
            copies.push(Copy {
                dst,
                src,
                len: op.len,
                kernel_reaches: reachable,
            });
        }
        Ok(copies)
    }

    /// Launches `kernel` on the lane's first stream with its large arguments in a pinned
    /// buffer of `arg_bytes` bytes, which `fill` writes (given the buffer's address) before
    /// returning the launch's arguments.
    ///
    /// The caller vouches that the returned arguments match `kernel`'s parameters and that
    /// every range they name was checked against live registrations reachable from this GPU.
    fn launch_kernel(
        &self,
        lane: &GpuLane,
        kernel: &Kernel,
        grid: u32,
        arg_bytes: usize,
        fill: impl FnOnce(&mut [u8], u64) -> Vec<KernelArg>,
    ) -> Result<()> {
        let mut args = lane.args.take(arg_bytes)?;
        let base = args.addr();
        let launch_args = fill(args.as_mut_slice(), base);
        let stream = &lane.streams[0];
        // SAFETY: the caller matched the arguments to the kernel and checked every range they
        // name (the ops keep the local registrations alive until their events fired); the
        // pinned argument buffer goes back to the pool only with a fence recorded after this
        // launch, so nothing overwrites it while the kernel reads it.
        let launched = unsafe { kernel.launch(stream, grid, THREADS_PER_BLOCK, &launch_args) };
        match Event::record(stream) {
            Ok(fence) => lane.args.give_back(args, fence),
            Err(error) => {
                // The launch may still read the arguments: leak them rather than free them
                // under the GPU.
                std::mem::forget(args);
                return Err(error.into());
            }
        }
        launched.map_err(Error::from)
    }

    /// Queues a paged copy in one kernel launch and returns the event that fires after it, or
    /// `None` when the copy engines should take it (path, size, or a pool the kernel cannot
    /// reach).
    fn launch_blocks(&self, blocks: &BlockOps) -> Result<Option<Event>> {
        let wanted = plan::takes_kernel(
            self.config.copy_path,
            blocks.len,
            Driver::get().has_batched_copies(),
        );
        let Some(first) = blocks.pools.first() else {
            return Ok(None);
        };
        let Location::Device { ordinal, .. } = first.region.info().location else {
            return Err(self.refused("a local range is not GPU memory"));
        };
        let (Ok(pools), Ok(ids)) = (
            u32::try_from(blocks.pools.len()),
            u32::try_from(blocks.local_ids.len()),
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
        let mut local_bases = Vec::with_capacity(blocks.pools.len());
        let mut remote_bases = Vec::with_capacity(blocks.pools.len());
        let mut last = None;
        for pool in &blocks.pools {
            let same_gpu = matches!(pool.region.info().location, Location::Device { ordinal: other, .. } if other == ordinal);
            let (shift, reachable) = self.resolve(&lane, ordinal, &pool.remote, &mut last)?;
            if !same_gpu || !reachable {
                return Ok(None);
            }
            local_bases.push(pool.local_base);
            remote_bases.push(pool.remote_base.wrapping_add(shift));
        }
        let local = (
            &local_bases,
            &blocks.local_ids,
            blocks.local_stride,
            blocks.local_offset,
        );
        let remote = (
            &remote_bases,
            &blocks.remote_ids,
            blocks.remote_stride,
            blocks.remote_offset,
        );
        let (src, dst) = match blocks.direction {
            Direction::Write => (local, remote),
            Direction::Read => (remote, local),
        };
        let layout = plan::PagedArgs::new(blocks.pools.len(), blocks.local_ids.len());
        let chunk = self.config.kernel_chunk_bytes.max(1);
        let items = u64::from(pools) * u64::from(ids) * blocks.len.div_ceil(chunk);
        self.launch_kernel(
            &lane,
            &kernels.paged,
            kernels.grid(items, self.config.kernel_blocks_per_sm),
            layout.bytes(),
            |args, base| {
                layout.write(args, src.0, dst.0, src.1, dst.1);
                vec![
                    KernelArg::U64(base + layout.src_bases),
                    KernelArg::U64(base + layout.dst_bases),
                    KernelArg::U32(pools),
                    KernelArg::U64(base + layout.src_ids),
                    KernelArg::U64(base + layout.dst_ids),
                    KernelArg::U32(ids),
                    KernelArg::U64(src.2),
                    KernelArg::U64(dst.2),
                    KernelArg::U64(src.3),
                    KernelArg::U64(dst.3),
                    KernelArg::U64(blocks.len),
                    KernelArg::U64(chunk),
                ]
            },
        )?;
        Ok(Some(Event::record(&lane.streams[0])?))
    }

    /// Queues `copies` on `lane` and returns the events that fire once they are done.
    fn launch(&self, lane: &GpuLane, copies: &[Copy]) -> Result<Vec<Event>> {
        let path = self.config.copy_path;
        let batched_copies = Driver::get().has_batched_copies();
        let route = plan::route(copies, path, batched_copies);
        let mut used = vec![false; lane.streams.len()];
        if !route.kernel.is_empty() {
            let kernels = lane
                .kernels
                .as_ref()
                .ok_or_else(|| self.refused("the copy kernels are not loaded"))?;
            let entries =
                plan::kernel_entries(copies, &route.kernel, self.config.kernel_chunk_bytes);
            let count = entries.len() as u64;
            self.launch_kernel(
                lane,
                &kernels.list,
                kernels.grid(count, self.config.kernel_blocks_per_sm),
                entries.len() * plan::ENTRY_BYTES,
                |args, base| {
                    plan::write_entries(&entries, args);
                    vec![KernelArg::U64(base), KernelArg::U64(count)]
                },
            )?;
            used[0] = true;
        }
        let engine_streams = if lane.streams.len() > 1 && !route.kernel.is_empty() {
            1..lane.streams.len()
        } else {
            0..lane.streams.len()
        };
        let batched = matches!(path, CopyPath::Batched | CopyPath::Auto) && batched_copies;
        if batched && !route.copy_engine.is_empty() {
            // One call per stream, each with an even share of the copies.
            let share = route.copy_engine.len().div_ceil(engine_streams.len());
            for (turn, indices) in route.copy_engine.chunks(share).enumerate() {
                let stream = engine_streams.start + turn;
                let mut dsts = Vec::with_capacity(indices.len());
                let mut srcs = Vec::with_capacity(indices.len());
                let mut sizes = Vec::with_capacity(indices.len());
                for &index in indices {
                    let copy = &copies[index];
                    dsts.push(copy.dst);
                    srcs.push(copy.src);
                    sizes.push(self.host_len(copy.len)?);
                }
                // SAFETY: as for the single copies below, for every copy of the list.
                unsafe { lane.streams[stream].copy_batch(&dsts, &srcs, &sizes)? };
                used[stream] = true;
            }
        }
        let singles: &[usize] = if batched { &[] } else { &route.copy_engine };
        for (turn, &index) in singles.iter().enumerate() {
            let stream = engine_streams.start + turn % engine_streams.len();
            let copy = &copies[index];
            let len = self.host_len(copy.len)?;
            // SAFETY: the engine checked the local range against a live registration (the
            // op's RegionUse keeps it registered until the ops drop, after the events below
            // fired) and the remote range against the peer's registered buffer, which the
            // mapping covers from its allocation base; the two belong to different
            // registrations, so they do not overlap.
            unsafe { lane.streams[stream].copy(copy.dst, copy.src, len)? };
            used[stream] = true;
        }
        let mut events = Vec::new();
        for (stream, used) in lane.streams.iter().zip(used) {
            if used {
                events.push(Event::record(stream)?);
            }
        }
        Ok(events)
    }
}

#[async_trait::async_trait]
impl Link for NvlinkLink {
    async fn transfer(&self, ops: Vec<TransferOp>) -> Result<()> {
        // Usually one GPU, at most a handful: a short list beats a map here.
        let mut by_gpu: Vec<(u32, Vec<&TransferOp>)> = Vec::new();
        for op in &ops {
            let Location::Device { ordinal, .. } = op.region.info().location else {
                return Err(self.refused("a local range is not GPU memory"));
            };
            match by_gpu.iter_mut().find(|(gpu, _)| *gpu == ordinal) {
                Some((_, gpu_ops)) => gpu_ops.push(op),
                None => by_gpu.push((ordinal, vec![op])),
            }
        }
        let mut events = Vec::new();
        for (ordinal, gpu_ops) in by_gpu {
            let lane = self.lane(ordinal)?;
            let copies = self.copies(&lane, ordinal, &gpu_ops)?;
            events.extend(self.launch(&lane, &copies)?);
        }
        let held = self.hold_mappings();
        let waits = events.into_iter().map(|event| Poller::global().wait(event));
        futures::future::try_join_all(waits).await?;
        drop((ops, held));
        self.still_alive()
    }

    async fn transfer_blocks(&self, blocks: BlockOps) -> Result<()> {
        match self.launch_blocks(&blocks)? {
            Some(event) => {
                let held = self.hold_mappings();
                Poller::global().wait(event).await?;
                drop((blocks, held));
                self.still_alive()
            }
            None => self.transfer(blocks.into_ops()).await,
        }
    }

    async fn write_value(
        &self,
        remote: Arc<BufferDescriptor>,
        addr: u64,
        value: u32,
        gpu: u32,
    ) -> Result<()> {
        let lane = self.lane(gpu)?;
        let (shift, reachable) = self.resolve(&lane, gpu, &remote, &mut None)?;
        if !reachable {
            return Err(self.refused(&format!(
                "GPU {gpu} cannot store into the peer's GPU directly (no peer access), so it cannot signal it"
            )));
        }
        let stream = &lane.streams[0];
        // SAFETY: the engine checked that addr..addr+4 lies inside the peer's registered
        // buffer and is 4-byte aligned; the mapping covers it and this GPU reaches it
        // (checked above); the event below is awaited before returning.
        unsafe { stream.write_value32(addr.wrapping_add(shift), value)? };
        let held = self.hold_mappings();
        Poller::global().wait(Event::record(stream)?).await?;
        drop(held);
        self.still_alive()
    }

    fn is_alive(&self) -> bool {
        self.alive.load(Ordering::Acquire)
    }

    fn close(&self) {
        self.alive.store(false, Ordering::Release);
        lock(&self.mappings).clear();
    }
}
