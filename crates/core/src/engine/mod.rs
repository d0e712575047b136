//! The engine: one per process. Owns the registered regions, the listener, the transports, the
//! metadata store and the notification inbox, and runs all of its I/O on its own small runtime,
//! so callers with or without an async runtime use it alike.
//!
//! This module holds the API ([`Engine`]) and the state its handles share; [`builder`] starts an
//! engine with the transports of a [`TransportSet`] ([`transport_set`]), and [`liveness`] keeps
//! its descriptor published and its peers current.

mod builder;
mod liveness;
mod transport_set;

pub use builder::EngineBuilder;
pub use transport_set::{TcpOnly, TransportSet};

use crate::batch::{Batch, BatchEngine, Spares};
use crate::cuda::{Context, DeviceBuffer, Driver, MemoryKind};
use crate::descriptor::{HostIdentity, SegmentDescriptor, DESCRIPTOR_VERSION};
use crate::error::{Error, RegistrationProblem, Result};
use crate::identity::InstanceId;
use crate::memory::{
    device_location, Location, OwnedBuffer, OwnedMemory, Region, RegionInfo, RegionTable,
};
use crate::metadata::MetadataStore;
use crate::notify::{Notification, Notifications, MAX_NOTIFICATION_BYTES};
use crate::peer::{Peer, PeerContext};
use crate::transport::Transport;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::runtime::{Handle, Runtime};
use tokio::sync::mpsc;

pub(crate) struct EngineInner {
    name: String,
    local_addr: SocketAddr,
    /// This engine's random identity.
    instance: InstanceId,
    /// The identity shared by the engines of this process.
    process: InstanceId,
    host: HostIdentity,
    pub(crate) table: Arc<RegionTable>,
    /// The transport peers are first reached through, which carries notifications.
    pub(crate) control: Arc<dyn Transport>,
    pub(crate) transports: Vec<Arc<dyn Transport>>,
    pub(crate) metadata: Arc<dyn MetadataStore>,
    pub(crate) handle: Handle,
    /// The inbox's reading side and its count of unread bytes, until taken.
    inbox: Mutex<Option<(mpsc::Receiver<Notification>, Arc<AtomicUsize>)>>,
    peers: Mutex<HashMap<String, Peer>>,
    pub(crate) transfer_timeout: Duration,
    /// The GPUs this process sees, listed in the descriptor.
    gpus: Vec<crate::cuda::DeviceInfo>,
    /// Set when the engine is dropped, before its runtime stops: a transfer that fails from
    /// then on failed because of the shutdown (its connections closing under it).
    pub(crate) shutting_down: AtomicBool,
    /// The tasks it started ([`EngineInner::start_task`]), dropped when it stops.
    pub(crate) tasks: crate::task::Tasks,
    /// Entry lists of finished batches, for the next ones.
    pub(crate) spares: Spares,
}

impl EngineInner {
    /// Runs `future` as one of the engine's tasks ([`task`]), its first step on this thread;
    /// dropped unpolled once the engine is shutting down.
    pub(crate) fn start_task(self: &Arc<Self>, future: crate::task::Steps) {
        let engine = Arc::downgrade(self);
        let stopping = move || {
            engine
                .upgrade()
                .is_none_or(|engine| engine.shutting_down.load(Ordering::Acquire))
        };
        self.tasks.start(&self.handle, stopping, future);
    }

    /// What this engine's peers need of it.
    pub(crate) fn peer_context(&self) -> PeerContext<'_> {
        PeerContext {
            control: self.control.as_ref(),
            transports: &self.transports,
            metadata: self.metadata.as_ref(),
        }
    }

    /// Lets every transport read a peer's descriptor the engine has just learned.
    pub(crate) async fn import(&self, descriptor: &SegmentDescriptor) {
        for transport in &self.transports {
            transport.import(descriptor).await;
        }
    }

    /// Registers `info` with what each transport exports for it; `owned` is freed when the
    /// registration ends.
    fn insert(&self, info: RegionInfo, owned: Option<OwnedMemory>) -> Result<Region> {
        let mut exports = Vec::new();
        let mut guards = Vec::new();
        for transport in &self.transports {
            if let Some(exported) = transport.export(&info)? {
                exports.push(exported.export);
                guards.extend(exported.guard);
            }
        }
        Ok(self.table.insert(info, exports, guards, owned)?)
    }

    async fn publish(&self) -> Result<()> {
        self.metadata.publish(&self.descriptor()).await
    }

    fn descriptor(&self) -> SegmentDescriptor {
        SegmentDescriptor {
            version: DESCRIPTOR_VERSION,
            name: self.name.clone(),
            host: self.host.clone(),
            generation: self.table.generation(),
            instance: self.instance,
            process: self.process,
            pid: std::process::id(),
            gpus: self.gpus.clone(),
            endpoints: self
                .transports
                .iter()
                .filter_map(|transport| transport.endpoint())
                .collect(),
            buffers: self.table.snapshot(),
            signature: None,
        }
    }
}

impl BatchEngine for EngineInner {
    fn table_id(&self) -> u64 {
        self.table.id()
    }

    fn spares(&self) -> &Spares {
        &self.spares
    }

    fn transports(&self) -> &[Arc<dyn Transport>] {
        &self.transports
    }

    fn transfer_timeout(&self) -> Duration {
        self.transfer_timeout
    }

    fn shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::Acquire)
    }

    fn peer_context(&self) -> PeerContext<'_> {
        EngineInner::peer_context(self)
    }

    fn run_task(self: Arc<Self>, task: crate::task::Steps) {
        EngineInner::start_task(&self, task);
    }
}

/// A ferry engine: registers memory, opens peers and moves bytes between them. Started by an
/// [`EngineBuilder`] (`ferry::builder()` gives one with every transport of the `ferry` build).
///
/// One per process is the intended use. It runs its network I/O on its own threads, so its
/// futures can be awaited from any executor, and the `*_blocking` methods serve callers without
/// one. Dropping it stops everything: transfers in flight fail with [`Error::Shutdown`], and
/// the listener closes in the background shortly after (so a new engine binding the same
/// port at once may have to retry).
pub struct Engine {
    inner: Arc<EngineInner>,
    runtime: Option<Runtime>,
}

impl Engine {
    /// This engine's segment name: `host:port` of its listener. Peers connect with it.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The address the control listener is bound to.
    pub fn local_addr(&self) -> SocketAddr {
        self.inner.local_addr
    }

    /// The descriptor peers receive: name, host, endpoints and registered buffers.
    pub fn descriptor(&self) -> SegmentDescriptor {
        self.inner.descriptor()
    }

    /// Registers `len` bytes at `ptr` so peers can read and write them and local batches can
    /// use them. The location (pageable or pinned host, GPU) is detected.
    ///
    /// # Safety
    /// 1. `ptr..ptr+len` must stay valid for reads and writes until the returned [`Region`] is
    ///    dropped (dropping it waits for transfers still using it).
    /// 2. While registered, peers may write these bytes at any time: the caller must not hold
    ///    Rust references to them that assume no one else writes.
    ///
    /// # Errors
    /// [`Error::Registration`] for a null pointer, `len == 0`, a range that wraps or host
    /// memory this process has not mapped readable and writable,
    /// [`crate::RangeError::Overlap`] when the range overlaps a registered region,
    /// [`Error::Unsupported`] for managed memory and for GPU memory a transport should share
    /// but cannot (a stream-ordered pool allocation, a `cudaMalloc` range over several
    /// allocations), [`Error::Cuda`] when exporting fails.
    pub unsafe fn register(&self, ptr: *mut u8, len: u64) -> Result<Region> {
        let addr = ptr as u64;
        if ptr.is_null() {
            return Err(Error::registration(addr, len, RegistrationProblem::Null));
        }
        Error::check_registration(addr, len)?;
        let location = match Driver::get().memory_kind(addr)? {
            MemoryKind::PageableHost => {
                if let Some(first) = crate::memory::first_unmapped_here(addr, len) {
                    return Err(Error::registration(
                        addr,
                        len,
                        RegistrationProblem::NotMapped { first },
                    ));
                }
                Location::Host { pinned: false }
            }
            MemoryKind::PinnedHost => Location::Host { pinned: true },
            MemoryKind::Device => device_location(addr, &self.inner.gpus)?,
            MemoryKind::Managed => {
                return Err(Error::Unsupported {
                    memory: "CUDA managed memory".into(),
                    addr,
                    remedy: "managed memory cannot be shared between processes; register cudaMalloc or host memory instead".into(),
                })
            }
        };
        let info = RegionInfo {
            addr,
            len,
            location,
        };
        self.inner.insert(info, None)
    }

    /// Allocates `len` zeroed bytes of host memory and registers them. The memory is freed when
    /// the region is dropped; reach it with [`Region::write_at`] and [`Region::read_at`].
    ///
    /// # Errors
    /// [`Error::ApiMisuse`] for `len == 0`, [`Error::OutOfMemory`] when the allocation
    /// fails.
    pub fn allocate(&self, len: u64) -> Result<Region> {
        let bytes = Error::check_allocation("Engine::allocate", len)?;
        let buffer = OwnedBuffer::zeroed(bytes).ok_or(Error::OutOfMemory {
            what: "Engine::allocate",
            bytes: len,
        })?;
        let info = RegionInfo {
            addr: buffer.addr(),
            len,
            location: Location::Host { pinned: false },
        };
        self.inner
            .insert(info, Some(OwnedMemory::Host { _buffer: buffer }))
    }

    /// Allocates `len` bytes on GPU `ordinal` with `cudaMalloc` and registers them, exported
    /// for peers on this host. The memory is freed when the region is dropped; its contents are
    /// undefined until written ([`Region::write_at`] copies into it).
    ///
    /// # Errors
    /// [`Error::ApiMisuse`] for `len == 0`, [`Error::Cuda`] when there is no such GPU or
    /// the allocation or export fails.
    pub fn allocate_device(&self, ordinal: u32, len: u64) -> Result<Region> {
        let bytes = Error::check_allocation("Engine::allocate_device", len)?;
        let buffer = DeviceBuffer::new(Context::get(ordinal)?, bytes)?;
        let info = RegionInfo {
            addr: buffer.addr(),
            len,
            location: device_location(buffer.addr(), &self.inner.gpus)?,
        };
        self.inner
            .insert(info, Some(OwnedMemory::Device { _buffer: buffer }))
    }

    /// Creates `pieces` VMM allocations of `piece_bytes` each (rounded up to the GPU's
    /// granularity) on GPU `ordinal`, with POSIX-fd handles, mapped back to back as PyTorch's
    /// expandable segments are, and registers the whole range. Freed when the region drops.
    ///
    /// # Errors
    /// [`Error::Registration`] when `piece_bytes` or `pieces` is 0 or their product
    /// overflows; [`Error::Cuda`] when there is no such GPU or an allocation, mapping or
    /// export fails; [`Error::Unsupported`] when a transport cannot share it (nvlink without
    /// its fd-passing socket).
    pub fn allocate_device_vmm(
        &self,
        ordinal: u32,
        piece_bytes: u64,
        pieces: usize,
    ) -> Result<Region> {
        const WHAT: &str = "Engine::allocate_device_vmm";
        let total = u64::try_from(pieces)
            .ok()
            .and_then(|pieces| piece_bytes.checked_mul(pieces))
            .ok_or(Error::OutOfMemory {
                what: WHAT,
                bytes: u64::MAX,
            })?;
        Error::check_allocation(WHAT, total)?;
        let piece_bytes = Error::check_allocation(WHAT, piece_bytes)?;
        let mapping = crate::cuda::create_vmm(Context::get(ordinal)?, piece_bytes, pieces)?;
        let len = mapping.len() as u64;
        let info = RegionInfo {
            addr: mapping.base(),
            len,
            location: device_location(mapping.base(), &self.inner.gpus)?,
        };
        self.inner
            .insert(info, Some(OwnedMemory::Vmm { _mapping: mapping }))
    }

    /// Opens the peer named `name` (`host:port` with the default metadata): fetches its
    /// descriptor and connects. An open peer is reused, with its descriptor fetched afresh.
    ///
    /// # Errors
    /// [`Error::Unreachable`] when nothing answers at `name`, [`Error::Metadata`] when what
    /// answers is not a ferry engine of this version.
    ///
    /// # Cancel safety
    /// The connection is opened by a task on the engine's runtime, which dropping the future
    /// does not stop: it runs to its end, and a peer it opens is kept, so the next `connect`
    /// to `name` reuses it.
    pub async fn connect(&self, name: &str) -> Result<Peer> {
        let inner = Arc::clone(&self.inner);
        let name = name.to_owned();
        self.run(async move { inner.connect(&name).await }).await
    }

    /// [`Self::connect`] for callers without an async runtime: blocks the calling thread until
    /// the peer is open.
    ///
    /// # Errors
    /// [`Error::ApiMisuse`] on a thread of a tokio runtime (await [`Self::connect`] there);
    /// otherwise as [`Self::connect`].
    pub fn connect_blocking(&self, name: &str) -> Result<Peer> {
        crate::blocking::refuse_on_runtime("Engine::connect_blocking", "Engine::connect")?;
        futures::executor::block_on(self.connect(name))
    }

    /// Publishes the current descriptor to the metadata store now.
    ///
    /// The engine republishes in the background after every registration change; await this
    /// when a peer must see a new registration at once. With the peer-to-peer default, peers
    /// always ask this engine directly, so there is nothing to wait for.
    ///
    /// # Errors
    /// The store's error when it cannot be written.
    ///
    /// # Cancel safety
    /// The write is made by a task on the engine's runtime, which dropping the future does
    /// not stop: the descriptor still reaches the store unless the write fails, and nothing
    /// reports that failure.
    pub async fn publish(&self) -> Result<()> {
        let inner = Arc::clone(&self.inner);
        self.run(async move { inner.publish().await }).await
    }

    /// The transports routes are chosen among, TCP last.
    pub(crate) fn transports(&self) -> &[Arc<dyn Transport>] {
        &self.inner.transports
    }

    /// Starts a batch of reads and writes with `peer`.
    pub fn batch(&self, peer: &Peer) -> Batch {
        Batch::new(Arc::clone(&self.inner) as Arc<dyn BatchEngine>, peer)
    }

    /// Sends `payload` to `peer` on its own. Notifications from one engine arrive in the order
    /// they were sent; to announce data, attach the notification to its batch instead
    /// ([`Batch::notify`]), which delivers it only after the data is visible.
    ///
    /// # Errors
    /// [`Error::ApiMisuse`] for a payload over 64 KiB, [`Error::PeerGone`] when the peer is
    /// gone, [`Error::Rejected`] when its inbox is full, [`Error::Timeout`] after the engine's
    /// transfer timeout.
    ///
    /// # Cancel safety
    /// Past the size check, the notification is sent by a task on the engine's runtime, which
    /// dropping the future does not stop: it may still be delivered, or be refused or time out
    /// with nothing to report it. Notifications sent after it still arrive after it.
    pub async fn notify(&self, peer: &Peer, payload: impl Into<Vec<u8>>) -> Result<()> {
        let payload = payload.into();
        if payload.len() > MAX_NOTIFICATION_BYTES {
            return Err(Error::ApiMisuse(format!(
                "a notification of {} bytes exceeds the {MAX_NOTIFICATION_BYTES}-byte limit",
                payload.len()
            )));
        }
        let inner = Arc::clone(&self.inner);
        let peer = peer.clone();
        let limit = self.inner.transfer_timeout;
        let name = peer.name().to_owned();
        self.run(async move {
            tokio::time::timeout(limit, peer.notify(inner.peer_context(), &payload))
                .await
                .map_err(|_| Error::Timeout {
                    what: format!("a notification to {name}"),
                    after: limit,
                })??;
            crate::telemetry::notification_sent();
            Ok(())
        })
        .await
    }

    /// [`Self::notify`] for callers without an async runtime: blocks the calling thread until
    /// the peer has taken the notification into its inbox.
    ///
    /// # Errors
    /// [`Error::ApiMisuse`] on a thread of a tokio runtime (await [`Self::notify`] there);
    /// otherwise as [`Self::notify`].
    pub fn notify_blocking(&self, peer: &Peer, payload: impl Into<Vec<u8>>) -> Result<()> {
        crate::blocking::refuse_on_runtime("Engine::notify_blocking", "Engine::notify")?;
        futures::executor::block_on(self.notify(peer, payload))
    }

    /// The stream of notifications peers send to this engine. There is one stream per engine.
    ///
    /// # Errors
    /// [`Error::ApiMisuse`] when it was already taken.
    pub fn notifications(&self) -> Result<Notifications> {
        let (receiver, held) = self.inner.inbox.lock().take().ok_or_else(|| {
            Error::ApiMisuse(
                "notifications() was already called; keep the stream it returned".into(),
            )
        })?;
        Ok(Notifications {
            receiver,
            held,
            handle: self.inner.handle.clone(),
        })
    }

    /// Runs `work` as one of the engine's tasks and waits for it from any executor. Its first
    /// step runs on the caller's thread ([`task`]), so that what it can do at once (a
    /// notification written into a shared-memory ring, say) does not wait for a runtime
    /// worker to wake.
    async fn run<T: Send + 'static>(
        &self,
        work: impl Future<Output = Result<T>> + Send + 'static,
    ) -> Result<T> {
        let (sender, receiver) = tokio::sync::oneshot::channel();
        self.inner.start_task(Box::pin(async move {
            let _ = sender.send(work.await);
        }));
        receiver.await.map_err(|_| Error::Shutdown {
            what: "the request".into(),
        })?
    }
}

impl EngineInner {
    async fn connect(&self, name: &str) -> Result<Peer> {
        let descriptor = self.metadata.fetch(name).await?;
        self.import(&descriptor).await;
        let cached = self.peers.lock().get(name).cloned();
        if let Some(peer) = cached {
            if peer.is_alive() && peer.view().descriptor.instance == descriptor.instance {
                peer.update(descriptor);
                return Ok(peer);
            }
            // Another engine took the name (a restart): the old one's links and mappings
            // must not carry transfers meant for the new one.
            peer.close();
        }
        let link = self.control.open(&descriptor).await?;
        let peer = Peer::new(descriptor, self.control.name(), link);
        self.peers.lock().insert(name.to_owned(), peer.clone());
        Ok(peer)
    }
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("name", &self.inner.name)
            .finish()
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.inner.shutting_down.store(true, Ordering::Release);
        for transport in self.inner.transports.iter() {
            transport.stop();
        }
        self.inner.tasks.stop();
        crate::local::forget(self.inner.instance);
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}
