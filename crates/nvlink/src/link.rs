use crate::args::ArgumentPool;
use crate::bounds::{self, MappedBuffer};
use crate::config::NvlinkConfig;
use crate::export::GpuExport;
use crate::fd_passing::fd_socket_name;
use crate::import::{OpenError, Opened, Owner, PeerMapping};
use crate::kernels::{CopyKernels, KernelShare};
use crate::messages::MessageSender;
use crate::plan;
use ferry_core::auth::Secret;
use ferry_core::cuda::{Context, DeviceInfo, Driver, Stream};
use ferry_core::{
    BlockOps, BufferDescriptor, Direction, Error, Export, InstanceId, Link, Location, Notified,
    ProtocolViolation, Result, TransferOp, TransferOps, TransferPart,
};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

#[cfg(all(test, feature = "gpu-tests"))]
mod gpu_tests;
mod launches;

use launches::{Paged, Side, Work};

/// Mappings of one peer's allocations and the local streams and kernels that copy to and from
/// them.
pub(crate) struct NvlinkLink {
    /// The transport whose exports this link maps (nvlink or mnnvl).
    transport: &'static str,
    peer: String,
    /// The peer engine's instance id: exports must name its own fd socket.
    instance: InstanceId,
    /// The peer is this engine of this process: remote addresses are usable as they are,
    /// for ranges that engine registered.
    local_peer: Option<InstanceId>,
    config: NvlinkConfig,
    /// The GPUs this process sees, to tell which peer GPUs a kernel can reach.
    gpus: Arc<Vec<DeviceInfo>>,
    /// This engine's secret, proven to the peer's fd socket.
    secret: Option<Secret>,
    /// The peer's allocations mapped here, by the export that names them.
    mappings: Mutex<HashMap<Export, Arc<Opened>>>,
    /// When the peer's fd socket last failed to confirm an IPC handle in time.
    owner_silent: Mutex<Option<std::time::Instant>>,
    /// The mapping of each peer buffer descriptor planned before, by the descriptor's address
    /// ([`descriptor_key`]): a paged copy names one buffer per pool, and hashing every pool's
    /// export on every transfer cost more than the launch.
    known: Mutex<HashMap<usize, Known>>,
    /// Streams, kernels and argument buffers of each local GPU, by ordinal.
    lanes: Mutex<HashMap<u32, Arc<GpuLane>>>,
    alive: AtomicBool,
    /// The shared-memory ring notifications to the peer take, or why there is none.
    messages: std::result::Result<MessageSender, String>,
}

/// What one local GPU copies with.
struct GpuLane {
    /// The copy streams (`streams_per_gpu`), then one more for block copies that wait for a
    /// caller's event ([`ferry_core::Batch::after`]), so that waiting holds back no other copy.
    streams: Vec<Stream>,
    /// `None` when the kernels could not be loaded; every copy then uses the copy engines.
    kernels: Option<KernelShare>,
    args: ArgumentPool,
    /// Peer GPUs (ordinals) whose memory this GPU's kernels may touch, by whether enabling
    /// peer access to them worked.
    peers: Mutex<HashMap<u32, bool>>,
}

/// A peer buffer descriptor planned before (kept, so that no other descriptor takes its
/// address) and the mapping it lies in.
type Known = (Arc<BufferDescriptor>, Arc<Opened>);

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

impl GpuLane {
    /// Streams the copies of a transfer are dealt over.
    fn copy_streams(&self) -> usize {
        self.streams.len() - 1
    }

    /// The stream of block copies that wait for a caller's event.
    fn waiting_stream(&self) -> usize {
        self.streams.len() - 1
    }

    /// How this GPU's kernel cuts long copies: pieces of at most the configured chunk, fewer
    /// bytes where that would leave part of its grid idle.
    fn pieces(&self, config: &NvlinkConfig) -> plan::Pieces {
        plan::Pieces {
            most: config.kernel_chunk_bytes,
            full_grid: self
                .kernels
                .as_ref()
                .map_or(1, |kernels| kernels.items_for_full_grid(config)),
        }
    }
}

impl NvlinkLink {
    /// A link of `transport` to `peer` (engine `instance`; `local_peer` when it is an engine of
    /// this process).
    pub(crate) fn new(
        transport: &'static str,
        peer: String,
        instance: InstanceId,
        local_peer: Option<InstanceId>,
        config: NvlinkConfig,
        gpus: Arc<Vec<DeviceInfo>>,
        secret: Option<Secret>,
    ) -> NvlinkLink {
        NvlinkLink {
            transport,
            peer,
            instance,
            local_peer,
            config,
            gpus,
            secret,
            mappings: Mutex::default(),
            owner_silent: Mutex::default(),
            known: Mutex::default(),
            lanes: Mutex::default(),
            alive: AtomicBool::new(true),
            messages: Err(format!("{transport} opened no message ring to this peer")),
        }
    }

    /// The link with `messages` as its path for notifications (or the reason it has none).
    pub(crate) fn with_messages(
        mut self,
        messages: std::result::Result<MessageSender, String>,
    ) -> NvlinkLink {
        self.messages = messages;
        self
    }

    fn lane(&self, ordinal: u32) -> Result<Arc<GpuLane>> {
        let cached = self.lanes.lock().get(&ordinal).cloned();
        if let Some(lane) = cached {
            return Ok(lane);
        }
        let context = Context::get(ordinal)?;
        let streams = (0..self.config.streams_per_gpu.max(1) + 1)
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
        self.lanes.lock().insert(ordinal, Arc::clone(&lane));
        Ok(lane)
    }

    /// Maps the exports of every distinct buffer of `remotes` not mapped yet into GPU
    /// `ordinal`, so that planning finds them all ([`Self::mapped`]).
    async fn map_all<'a>(
        &self,
        remotes: impl Iterator<Item = &'a Arc<BufferDescriptor>>,
        ordinal: u32,
    ) -> Result<()> {
        if self.local_peer.is_some() {
            return Ok(());
        }
        let mut missing: Vec<&Arc<BufferDescriptor>> = Vec::new();
        {
            let known = self.known.lock();
            for remote in remotes {
                if missing.last().is_some_and(|last| Arc::ptr_eq(last, remote))
                    || known.contains_key(&descriptor_key(remote))
                {
                    continue;
                }
                missing.push(remote);
            }
        }
        for remote in missing {
            let Some(export) = remote.export(self.transport) else {
                return Err(self.refused("its buffer carries no export"));
            };
            let mapped = self.mappings.lock().get(export).cloned();
            let opened = match mapped {
                Some(opened) => opened,
                None => {
                    let decoded = GpuExport::of(remote, self.transport)
                        .map_err(|violation| self.fail(violation))?
                        .ok_or_else(|| self.refused("its buffer carries no export"))?;
                    bounds::export_owner(&decoded, self.instance)
                        .map_err(|violation| self.fail(violation))?;
                    let socket = fd_socket_name(self.instance);
                    let owner = Owner {
                        socket: &socket,
                        region: remote.addr,
                        silent: &self.owner_silent,
                    };
                    let opened = PeerMapping::open(
                        Context::get(ordinal)?,
                        &decoded,
                        owner,
                        self.secret.as_ref(),
                    )
                    .await
                    .map_err(|error| match error {
                        OpenError::Peer(violation) => self.fail(violation),
                        OpenError::Local(reason) => self.refused(&reason.to_string()),
                    })?;
                    let opened = Arc::new(opened);
                    self.mappings
                        .lock()
                        .insert(export.clone(), Arc::clone(&opened));
                    opened
                }
            };
            let mut known = self.known.lock();
            // Descriptors of views the peer has since replaced would otherwise pile up.
            if known.len() >= KNOWN_MOST {
                known.clear();
            }
            known.insert(descriptor_key(remote), (Arc::clone(remote), opened));
        }
        Ok(())
    }

    /// Where `remote` is mapped in this process ([`Self::map_all`] mapped it); the mapping is
    /// added to `held`. The buffer must lie inside what the driver really mapped.
    fn mapped(&self, remote: &BufferDescriptor, held: &mut Held) -> Result<MappedBuffer> {
        if let Some(instance) = self.local_peer {
            if !ferry_core::local_engine_registered(instance, remote.addr, remote.len) {
                return Err(self.fail(ProtocolViolation::Descriptor {
                    field: "addr",
                    problem: format!(
                        "names {} bytes at {:#x}, which the engine of this process does not have registered",
                        remote.len, remote.addr
                    ),
                }));
            }
            return MappedBuffer::in_place(remote.addr, remote.len)
                .map_err(|violation| self.fail(violation));
        }
        let known = self
            .known
            .lock()
            .get(&descriptor_key(remote))
            .map(|(_, opened)| Arc::clone(opened));
        let opened = known.or_else(|| {
            remote
                .export(self.transport)
                .and_then(|export| self.mappings.lock().get(export).cloned())
        });
        let Some(opened) = opened else {
            // Mapped before planning began, so only a close since can have dropped it.
            self.still_alive()?;
            return Err(self.refused("a buffer's mapping went away while the transfer was planned"));
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
        let known = lane.peers.lock().get(&owner.ordinal).copied();
        if let Some(enabled) = known {
            return enabled;
        }
        let enabled = Context::get(ordinal)
            .and_then(|local| local.enable_peer_access(&*Context::get(owner.ordinal)?))
            .inspect_err(|error| {
                tracing::info!(from = ordinal, to = owner.ordinal, %error, "peer access refused; copies between these GPUs use the copy engines");
            })
            .is_ok();
        lane.peers.lock().insert(owner.ordinal, enabled);
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
        let buffer = self.mapped(remote, held)?;
        let reachable = lane.kernels.is_some() && self.kernel_reaches(lane, ordinal, remote);
        let resolved = Resolved { buffer, reachable };
        *last = Some((key, resolved));
        Ok(resolved)
    }

    /// Turns the ops of one local GPU into copies between addresses of this process, each
    /// remote range checked against what its buffer's mapping really holds. `ops` are among
    /// `all`, whose tables name their buffers.
    fn copies(
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
    fn paged(&self, blocks: &BlockOps, held: &mut Held) -> Result<Option<(Arc<GpuLane>, Paged)>> {
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

impl NvlinkLink {
    /// Moves `ops`, and hands `payload` over as [`Link::transfer_notifying`] says when there
    /// is one.
    async fn move_ops(&self, ops: TransferOps, payload: Option<&[u8]>) -> Result<Notified> {
        // Usually one GPU, at most a handful: a short list beats a map here.
        let mut by_gpu: Vec<(u32, Vec<&TransferOp>)> = Vec::new();
        for op in &ops {
            let Location::Device { ordinal, .. } = ops.region(op).info().location else {
                return Err(self.refused("a local range is not GPU memory"));
            };
            match by_gpu.iter_mut().find(|(gpu, _)| *gpu == ordinal) {
                Some((_, gpu_ops)) => gpu_ops.push(op),
                None => by_gpu.push((ordinal, vec![op])),
            }
        }
        for (ordinal, gpu_ops) in &by_gpu {
            self.map_all(gpu_ops.iter().map(|op| ops.remote(op)), *ordinal)
                .await?;
        }
        // Everything that can fail before the GPUs get work: lanes, mappings, every check.
        let batched = Driver::get().has_batched_copies();
        let mut held = Vec::new();
        let mut lanes = Vec::with_capacity(by_gpu.len());
        let mut work = Vec::new();
        for (ordinal, gpu_ops) in &by_gpu {
            let lane = self.lane(*ordinal)?;
            let copies = self.copies(&lane, *ordinal, &ops, gpu_ops, &mut held)?;
            let planned = plan::launches(
                &copies,
                self.config.copy_path,
                batched,
                lane.copy_streams(),
                lane.pieces(&self.config),
            );
            work.extend(
                planned
                    .into_iter()
                    .map(|launch| (lanes.len(), Work::Copies(launch))),
            );
            lanes.push(lane);
        }
        drop(by_gpu);
        self.run_with(lanes, work, (ops, held), payload).await
    }

    /// Moves `blocks`, and hands `payload` over as [`Link::transfer_notifying`] says when
    /// there is one.
    async fn move_blocks(&self, blocks: BlockOps, payload: Option<&[u8]>) -> Result<Notified> {
        if let Some(Location::Device { ordinal, .. }) = blocks
            .pools()
            .first()
            .map(|pool| pool.region.info().location)
        {
            self.map_all(blocks.pools().iter().map(|pool| &pool.remote), ordinal)
                .await?;
        }
        let mut held = Vec::new();
        match self.paged(&blocks, &mut held)? {
            Some((lane, paged)) => {
                let work = vec![(0, Work::Paged(paged))];
                self.run_with(vec![lane], work, (blocks, held), payload)
                    .await
            }
            None => {
                blocks.wait_on_host().await?;
                self.move_ops(blocks.into_ops(), payload).await
            }
        }
    }

    /// [`Self::run`], or [`Self::run_notifying`] with `payload`.
    async fn run_with<K>(
        &self,
        lanes: Vec<Arc<GpuLane>>,
        work: Vec<(usize, Work)>,
        keep: K,
        payload: Option<&[u8]>,
    ) -> Result<Notified> {
        match payload {
            Some(payload) => self.run_notifying(lanes, work, keep, payload).await,
            None => self.run(lanes, work, keep).await.map(|()| Notified::Left),
        }
    }
}

#[async_trait::async_trait]
impl Link for NvlinkLink {
    async fn transfer(&self, ops: TransferOps) -> Result<()> {
        self.move_ops(ops, None).await.map(drop)
    }

    async fn transfer_blocks(&self, blocks: BlockOps) -> Result<()> {
        self.move_blocks(blocks, None).await.map(drop)
    }

    async fn transfer_notifying(&self, part: TransferPart, payload: &[u8]) -> Result<Notified> {
        let bytes = match &part {
            TransferPart::Ops(ops) => ops.iter().map(|op| op.len).sum(),
            TransferPart::Blocks(blocks) => blocks.bytes(),
        };
        let payload = (bytes <= self.config.gpu_notification_max_bytes).then_some(payload);
        match part {
            TransferPart::Ops(ops) => self.move_ops(ops, payload).await,
            TransferPart::Blocks(blocks) => self.move_blocks(blocks, payload).await,
        }
    }

    async fn write_value(
        &self,
        remote: Arc<BufferDescriptor>,
        addr: u64,
        value: u32,
        gpu: u32,
    ) -> Result<()> {
        self.map_all(std::iter::once(&remote), gpu).await?;
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

    async fn notify(&self, payload: &[u8]) -> Result<()> {
        let reason = match &self.messages {
            Ok(sender) => match sender.closed() {
                None => return sender.send(payload).await,
                Some(reason) => {
                    // However it closed, a reader still reading delivers nothing more from it.
                    sender.stop_delivery();
                    format!("its message ring closed: {reason}")
                }
            },
            Err(reason) => reason.clone(),
        };
        // A closed ring delivers nothing more, so what goes another way next cannot be
        // overtaken by it.
        Err(Error::Unavailable {
            local: format!("a notification of {} bytes", payload.len()),
            peer: self.peer.clone(),
            reason,
        })
    }

    fn is_alive(&self) -> bool {
        self.alive.load(Ordering::Acquire)
    }

    fn close(&self) {
        self.alive.store(false, Ordering::Release);
        if let Ok(sender) = &self.messages {
            sender.close();
        }
        self.mappings.lock().clear();
        self.known.lock().clear();
    }
}

/// Most descriptors [`NvlinkLink::known`] keeps before it starts over.
const KNOWN_MOST: usize = 1 << 16;

/// A peer buffer descriptor's identity while [`NvlinkLink::known`] holds it: its address.
fn descriptor_key(remote: &BufferDescriptor) -> usize {
    remote as *const BufferDescriptor as usize
}
