use crate::args::ArgumentPool;
use crate::bounds::{self, MappedBuffer};
use crate::config::NvlinkConfig;
use crate::export::GpuExport;
use crate::fd_passing::{FdSocket, ImportError};
use crate::import::{OpenError, Opened, Owner, PeerMapping};
use crate::kernels::{CopyKernels, KernelShare};
use crate::messages::MessageSender;
use crate::plan;
use crate::trial::Trials;
use ferry_core::auth::Secret;
use ferry_core::cuda::{Context, DeviceInfo, Driver, Stream};
use ferry_core::{
    BlockOps, BufferDescriptor, Direction, Error, Export, InstanceId, Link, Location, Notified,
    ProtocolViolation, Result, TransferOp, TransferOps, TransferPart,
};
use parking_lot::Mutex;
use rustc_hash::FxHashMap;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

#[cfg(all(test, feature = "gpu-tests"))]
mod gpu_tests;
mod lanes;
mod launches;
mod mappings;
mod paged;
mod staged;

use lanes::GpuLane;
use launches::{Paged, Side, Work};
use mappings::{Held, Known};
use paged::ResolvedPools;
use staged::StagingSlot;

/// Mappings of one peer's allocations and the local streams and kernels that copy to and from
/// them.
pub(crate) struct NvlinkLink {
    /// The transport whose exports this link maps (nvlink or mnnvl).
    transport: &'static str,
    peer: String,
    /// The peer engine's instance id: exports must name its own fd socket.
    instance: InstanceId,
    /// The peer engine's fd socket, which confirms its IPC handles.
    socket: FdSocket,
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
    known: Mutex<FxHashMap<usize, Known>>,
    /// Streams, kernels and argument buffers of each local GPU, by ordinal.
    lanes: Mutex<HashMap<u32, Arc<GpuLane>>>,
    alive: AtomicBool,
    /// The shared-memory ring notifications to the peer take, or why there is none.
    messages: std::result::Result<MessageSender, NoRing>,
    /// What trying found for the peer's memory, which says where its `cudaMalloc` memory goes
    /// through staging; `None` for a link that never stages (mnnvl's).
    trials: Option<Arc<Trials>>,
    /// The staging session of each local GPU (by ordinal) with each GPU of the peer.
    staging: Mutex<HashMap<(u32, ferry_core::cuda::GpuId), StagingSlot>>,
    /// The peer pools of the last paged copy planned, for the next one naming the same.
    resolved_pools: Mutex<Option<Arc<ResolvedPools>>>,
}

/// Why a link sends its notifications over TCP instead of a shared-memory message ring.
#[derive(Debug, thiserror::Error)]
pub(crate) enum NoRing {
    /// No ring was asked for: the peer runs on another host, or rings are turned off.
    #[error("nvlink carries no notifications to this peer (it runs on another host, or shared-memory notifications are off)")]
    NotCarried,
    /// The peer's engine did not take the ring.
    #[error("no shared-memory message ring to the peer: {0}")]
    Refused(#[from] ImportError),
    /// The link was made without one.
    #[error("{transport} opened no message ring to this peer")]
    NotOpened {
        /// The transport's name.
        transport: &'static str,
    },
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
            socket: FdSocket::of(instance),
            local_peer,
            config,
            gpus,
            secret,
            mappings: Mutex::default(),
            owner_silent: Mutex::default(),
            known: Mutex::default(),
            lanes: Mutex::default(),
            alive: AtomicBool::new(true),
            messages: Err(NoRing::NotOpened { transport }),
            trials: None,
            staging: Mutex::default(),
            resolved_pools: Mutex::default(),
        }
    }

    /// The link moving the peer's `cudaMalloc` memory through staging on the GPUs where
    /// `trials` found that only staging reaches it.
    pub(crate) fn with_trials(mut self, trials: Arc<Trials>) -> NvlinkLink {
        self.trials = Some(trials);
        self
    }

    /// The link asking the peer engine's fd socket at `socket` (its abstract name and, where
    /// its descriptor gives one, its file in a socket directory) to confirm IPC handles; by
    /// the abstract name only when not given.
    pub(crate) fn with_socket(mut self, socket: FdSocket) -> NvlinkLink {
        self.socket = socket;
        self
    }

    /// The link with `messages` as its path for notifications (or the reason it has none).
    pub(crate) fn with_messages(
        mut self,
        messages: std::result::Result<MessageSender, NoRing>,
    ) -> NvlinkLink {
        self.messages = messages;
        self
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
        // The peer's cudaMalloc memory that maps here only through its staging buffers.
        let mut staged = Vec::new();
        for (ordinal, gpu_ops) in &mut by_gpu {
            let through = self.take_staged(&ops, *ordinal, gpu_ops)?;
            if !through.is_empty() {
                staged.push((*ordinal, through));
            }
        }
        by_gpu.retain(|(_, gpu_ops)| !gpu_ops.is_empty());
        for (ordinal, gpu_ops) in &by_gpu {
            self.map_all(gpu_ops.iter().map(|op| ops.remote(op)), *ordinal)
                .await?;
        }
        // Everything that can fail before the GPUs get work: lanes, mappings, every check.
        let batched = Driver::get().has_batched_copies();
        let mut held = Held::default();
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
        // Staged after every check of the direct part, and before its copies, so that a
        // notification riding on the direct copies' launch is published after every byte.
        for (ordinal, through) in &staged {
            self.move_staged(&ops, *ordinal, through).await?;
        }
        drop(staged);
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
            if self.any_staged(ordinal, blocks.pools().iter().map(|pool| &pool.remote))? {
                blocks.wait_on_host().await?;
                return self.move_ops(blocks.into_ops(), payload).await;
            }
            self.map_all(blocks.pools().iter().map(|pool| &pool.remote), ordinal)
                .await?;
        }
        match self.paged(&blocks)? {
            Some((lane, paged, pools)) => {
                let work = vec![(0, Work::Paged(paged))];
                self.run_with(vec![lane], work, (blocks, pools), payload)
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
        let mut held = Held::default();
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
            Err(reason) => reason.to_string(),
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
        self.resolved_pools.lock().take();
        self.staging.lock().clear();
    }
}
