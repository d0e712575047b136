use crate::args::ArgumentPool;
use crate::bounds::{self, MappedBuffer};
use crate::import::{OpenError, Opened, PeerMapping};
use crate::kernels::{CopyKernels, KernelShare, THREADS_PER_BLOCK};
use crate::plan::{self, Launch};
use crate::queue::{self, Launcher};
use crate::transport::NvlinkConfig;
use ferry_core::cuda::{Context, DeviceInfo, Driver, Event, Kernel, KernelArg, Poller, Stream};
use ferry_core::{
    BlockOps, BufferDescriptor, Direction, Error, Export, Link, Location, ProtocolViolation,
    Result, TransferOp,
};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

#[cfg(all(test, feature = "gpu-tests"))]
mod gpu_tests;

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
    mappings: Mutex<HashMap<Export, Arc<Opened>>>,
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

/// The peer mappings a transfer's copies go through, held until the copies are done, so that
/// closing the link meanwhile unmaps nothing the GPU still uses.
type Held = Vec<Arc<Opened>>;

/// A remote buffer resolved for one GPU: where it is mapped here, and whether the GPU's
/// kernels reach it.
#[derive(Clone, Copy)]
struct Resolved {
    buffer: MappedBuffer,
    reachable: bool,
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

    /// Where `remote` is mapped in this process, opening its export on first use; the mapping
    /// is added to `held`. The buffer must lie inside what the driver really mapped.
    fn mapped(
        &self,
        remote: &BufferDescriptor,
        ordinal: u32,
        held: &mut Held,
    ) -> Result<MappedBuffer> {
        if self.same_process {
            return MappedBuffer::in_place(remote.addr, remote.len)
                .map_err(|violation| self.fail(violation));
        }
        let Some(export) = &remote.export else {
            return Err(self.refused("its buffer carries no export"));
        };
        // The lookup is its own statement so its guard is released before the insert below.
        let cached = lock(&self.mappings).get(export).cloned();
        let opened = match cached {
            Some(opened) => opened,
            None => {
                let opened = PeerMapping::open(Context::get(ordinal)?, export).map_err(
                    |error| match error {
                        OpenError::Peer(violation) => self.fail(violation),
                        OpenError::Local(reason) => self.refused(&reason),
                    },
                )?;
                let opened = Arc::new(opened);
                lock(&self.mappings).insert(export.clone(), Arc::clone(&opened));
                opened
            }
        };
        let buffer = MappedBuffer::place(
            opened.mapping.base(),
            opened.len,
            opened.offset,
            remote.addr,
            remote.len,
        )
        .map_err(|violation| self.fail(violation))?;
        if !held.iter().any(|known| Arc::ptr_eq(known, &opened)) {
            held.push(opened);
        }
        Ok(buffer)
    }

    /// Closes the link over what the peer sent and returns the error that names it: nothing of
    /// the transfer was queued, and nothing more goes to this peer through the link.
    fn fail(&self, violation: ProtocolViolation) -> Error {
        tracing::warn!(peer = %self.peer, %violation, "closing the nvlink link to a peer whose descriptor does not fit its memory");
        self.close();
        Error::Protocol {
            peer: self.peer.clone(),
            violation,
        }
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

    /// Where `remote` is mapped here and whether this GPU's kernels reach it, remembering the
    /// last buffer asked about: consecutive ops and pools mostly share one.
    fn resolve(
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
        let buffer = self.mapped(remote, ordinal, held)?;
        let reachable = lane.kernels.is_some() && self.kernel_reaches(lane, ordinal, remote);
        let resolved = Resolved { buffer, reachable };
        *last = Some((key, resolved));
        Ok(resolved)
    }

    /// Turns the ops of one local GPU into copies between addresses of this process, each
    /// remote range checked against what its buffer's mapping really holds.
    fn copies(
        &self,
        lane: &GpuLane,
        ordinal: u32,
        ops: &[&TransferOp],
        held: &mut Held,
    ) -> Result<Vec<plan::Copy>> {
        let mut copies = Vec::with_capacity(ops.len());
        let mut last = None;
        for op in ops {
            let resolved = self.resolve(lane, ordinal, &op.remote, &mut last, held)?;
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
        // name (the transfer keeps the local registrations and the peer mappings until every
        // stream it gave work has finished); the pinned argument buffer goes back to the pool
        // only with a fence recorded after this launch, so nothing overwrites it meanwhile.
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

    /// Plans a paged copy as one kernel launch, or `None` when the copy engines should take
    /// it (path, size, or a pool the kernel cannot reach). Every remote pool is checked up to
    /// its highest block id against what its buffer's mapping really holds.
    fn paged(&self, blocks: &BlockOps, held: &mut Held) -> Result<Option<(Arc<GpuLane>, Paged)>> {
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
        let highest = blocks.remote_ids.iter().copied().max().unwrap_or(0);
        let extent = bounds::block_extent(
            highest,
            blocks.remote_stride,
            blocks.remote_offset,
            blocks.len,
        )
        .ok_or_else(|| {
            Error::ApiMisuse(format!(
                "remote block {highest} of a paged copy lies past the end of the address space; fix the block ids or the layout"
            ))
        })?;
        let mut local_bases = Vec::with_capacity(blocks.pools.len());
        let mut remote_bases = Vec::with_capacity(blocks.pools.len());
        let mut last = None;
        for pool in &blocks.pools {
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
            ids: Arc::clone(&blocks.local_ids),
            stride: blocks.local_stride,
            offset: blocks.local_offset,
        };
        let remote = Side {
            bases: remote_bases,
            ids: Arc::clone(&blocks.remote_ids),
            stride: blocks.remote_stride,
            offset: blocks.remote_offset,
        };
        let (src, dst) = match blocks.direction {
            Direction::Write => (local, remote),
            Direction::Read => (remote, local),
        };
        let chunk = self.config.kernel_chunk_bytes.max(1);
        let items = u64::from(pools) * u64::from(ids) * blocks.len.div_ceil(chunk);
        let paged = Paged {
            layout: plan::PagedArgs::new(blocks.pools.len(), blocks.local_ids.len()),
            grid: kernels.grid(items, self.config.kernel_blocks_per_sm),
            pools,
            ids,
            src,
            dst,
            len: blocks.len,
            chunk,
        };
        Ok(Some((lane, paged)))
    }

    /// Queues one launch of a transfer on `lane`.
    fn launch(&self, lane: &GpuLane, work: &Work) -> Result<()> {
        match work {
            Work::Copies(Launch::Kernel(entries)) => {
                let kernels = lane
                    .kernels
                    .as_ref()
                    .ok_or_else(|| self.refused("the copy kernels are not loaded"))?;
                let count = entries.len() as u64;
                self.launch_kernel(
                    lane,
                    &kernels.list,
                    kernels.grid(count, self.config.kernel_blocks_per_sm),
                    entries.len() * plan::ENTRY_BYTES,
                    |args, base| {
                        plan::write_entries(entries, args);
                        vec![KernelArg::U64(base), KernelArg::U64(count)]
                    },
                )
            }
            Work::Copies(Launch::Batch { stream, copies }) => {
                let dsts: Vec<u64> = copies.iter().map(|copy| copy.dst).collect();
                let srcs: Vec<u64> = copies.iter().map(|copy| copy.src).collect();
                let sizes = copies
                    .iter()
                    .map(|copy| self.host_len(copy.len))
                    .collect::<Result<Vec<_>>>()?;
                // SAFETY: as for the single copies below, for every copy of the list.
                unsafe { lane.streams[*stream].copy_batch(&dsts, &srcs, &sizes)? };
                Ok(())
            }
            Work::Copies(Launch::Single { stream, copy }) => {
                let len = self.host_len(copy.len)?;
                // SAFETY: the engine checked the local range against a live registration and
                // the remote range against the peer's buffer, which was checked against the
                // size the driver reports for its mapping (`copies`); the transfer keeps both
                // (the ops' RegionUses, the held mappings) until every stream it gave work has
                // finished; the two belong to different registrations, so they do not overlap.
                unsafe { lane.streams[*stream].copy(copy.dst, copy.src, len)? };
                Ok(())
            }
            Work::Paged(paged) => {
                let kernels = lane
                    .kernels
                    .as_ref()
                    .ok_or_else(|| self.refused("the copy kernels are not loaded"))?;
                let (src, dst, layout) = (&paged.src, &paged.dst, paged.layout);
                self.launch_kernel(
                    lane,
                    &kernels.paged,
                    paged.grid,
                    layout.bytes(),
                    |args, base| {
                        layout.write(args, &src.bases, &dst.bases, &src.ids, &dst.ids);
                        vec![
                            KernelArg::U64(base + layout.src_bases),
                            KernelArg::U64(base + layout.dst_bases),
                            KernelArg::U32(paged.pools),
                            KernelArg::U64(base + layout.src_ids),
                            KernelArg::U64(base + layout.dst_ids),
                            KernelArg::U32(paged.ids),
                            KernelArg::U64(src.stride),
                            KernelArg::U64(dst.stride),
                            KernelArg::U64(src.offset),
                            KernelArg::U64(dst.offset),
                            KernelArg::U64(paged.len),
                            KernelArg::U64(paged.chunk),
                        ]
                    },
                )
            }
            Work::Signal { addr, value } => {
                // SAFETY: the engine checked that the word lies inside the peer's registered
                // buffer and is 4-byte aligned, and `write_value` translated it through the
                // buffer's checked mapping, which this GPU reaches; the transfer holds the
                // mapping until the stream has finished.
                unsafe { lane.streams[0].write_value32(*addr, *value)? };
                Ok(())
            }
        }
    }

    /// Queues `work` (each with the index of its lane in `lanes`) and waits for everything it
    /// queued, also when a launch failed part-way, before dropping `keep`.
    async fn run<K>(
        &self,
        lanes: Vec<Arc<GpuLane>>,
        work: Vec<(usize, Work)>,
        keep: K,
    ) -> Result<()> {
        let launches = Launches {
            link: self,
            streams: self.config.streams_per_gpu.max(1),
            lanes,
            work,
        };
        let wait =
            |event: Event| async move { Poller::global().wait(event).await.map_err(Error::from) };
        queue::launch_all(launches, wait, keep).await?;
        self.still_alive()
    }
}

/// One side of a paged copy, as the kernel takes it.
struct Side {
    bases: Vec<u64>,
    ids: Arc<[u32]>,
    stride: u64,
    offset: u64,
}

/// A paged copy planned as one kernel launch, every address checked.
struct Paged {
    layout: plan::PagedArgs,
    grid: u32,
    pools: u32,
    ids: u32,
    src: Side,
    dst: Side,
    len: u64,
    chunk: u64,
}

/// What one launch of a transfer queues.
enum Work {
    Copies(Launch),
    Paged(Paged),
    /// A 32-bit store into the peer's memory at `addr` (mapped here), on stream 0.
    Signal {
        addr: u64,
        value: u32,
    },
}

impl Work {
    fn stream(&self) -> usize {
        match self {
            Work::Copies(launch) => launch.stream(),
            Work::Paged(_) | Work::Signal { .. } => 0,
        }
    }
}

/// The launches of one transfer over the lanes of its GPUs.
struct Launches<'a> {
    link: &'a NvlinkLink,
    /// Streams of every lane: a stream's number in the transfer is lane * streams + stream.
    streams: usize,
    lanes: Vec<Arc<GpuLane>>,
    work: Vec<(usize, Work)>,
}

impl Launches<'_> {
    fn stream_of(&self, stream: usize) -> &Stream {
        &self.lanes[stream / self.streams].streams[stream % self.streams]
    }
}

impl Launcher for Launches<'_> {
    type Fence = Event;

    fn count(&self) -> usize {
        self.work.len()
    }

    fn stream(&self, index: usize) -> usize {
        let (lane, work) = &self.work[index];
        lane * self.streams + work.stream()
    }

    fn launch(&mut self, index: usize) -> Result<()> {
        let (lane, work) = &self.work[index];
        self.link.launch(&self.lanes[*lane], work)
    }

    fn fence(&mut self, stream: usize) -> Result<Event> {
        Ok(Event::record(self.stream_of(stream))?)
    }

    fn drain(&mut self, stream: usize) -> Result<()> {
        Ok(self.stream_of(stream).synchronize()?)
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
        // Everything that can fail before the GPUs get work: lanes, mappings, every check.
        let batched = Driver::get().has_batched_copies();
        let mut held = Vec::new();
        let mut lanes = Vec::with_capacity(by_gpu.len());
        let mut work = Vec::new();
        for (ordinal, gpu_ops) in &by_gpu {
            let lane = self.lane(*ordinal)?;
            let copies = self.copies(&lane, *ordinal, gpu_ops, &mut held)?;
            let planned = plan::launches(
                &copies,
                self.config.copy_path,
                batched,
                lane.streams.len(),
                self.config.kernel_chunk_bytes,
            );
            work.extend(
                planned
                    .into_iter()
                    .map(|launch| (lanes.len(), Work::Copies(launch))),
            );
            lanes.push(lane);
        }
        drop(by_gpu);
        self.run(lanes, work, (ops, held)).await
    }

    async fn transfer_blocks(&self, blocks: BlockOps) -> Result<()> {
        let mut held = Vec::new();
        match self.paged(&blocks, &mut held)? {
            Some((lane, paged)) => {
                self.run(vec![lane], vec![(0, Work::Paged(paged))], (blocks, held))
                    .await
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
        let mut held = Vec::new();
        let resolved = self.resolve(&lane, gpu, &remote, &mut None, &mut held)?;
        if !resolved.reachable {
            return Err(self.refused(&format!(
                "GPU {gpu} cannot store into the peer's GPU directly (no peer access), so it cannot signal it"
            )));
        }
        let addr = resolved
            .buffer
            .translate(addr, 4)
            .map_err(|violation| self.fail(violation))?;
        self.run(vec![lane], vec![(0, Work::Signal { addr, value })], held)
            .await
    }

    fn is_alive(&self) -> bool {
        self.alive.load(Ordering::Acquire)
    }

    fn close(&self) {
        self.alive.store(false, Ordering::Release);
        lock(&self.mappings).clear();
    }
}
