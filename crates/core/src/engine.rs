//! The engine: one per process. Owns the registered regions, the listener, the transports, the
//! metadata store and the notification inbox, and runs all of its I/O on its own small runtime,
//! so callers with or without an async runtime use it alike.

use crate::auth::{Secret, SECRET_ENV};
use crate::batch::Batch;
use crate::cuda::{Context, DeviceBuffer, Driver, MemoryKind};
use crate::descriptor::{HostIdentity, SegmentDescriptor, DESCRIPTOR_VERSION};
use crate::error::{Error, RegistrationProblem, Result};
use crate::identity::InstanceId;
use crate::memory::{
    device_location, Location, OwnedBuffer, OwnedMemory, Region, RegionInfo, RegionTable,
};
use crate::metadata::{MetadataStore, PeerToPeer};
use crate::notify::{Inbox, Notification, Notifications, MAX_NOTIFICATION_BYTES};
use crate::peer::Peer;
use crate::proto::SessionConfig;
use crate::tcp::{self, ServerContext, TcpConfig, TcpTransport};
use crate::transport::{EngineContext, Transport};
use crate::wire::{Limits, MAX_NAME_BYTES};
use std::collections::HashMap;
use std::future::Future;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Once};
use std::time::Duration;
use tokio::runtime::{Handle, Runtime};
use tokio::sync::mpsc;

/// Configures and starts an [`Engine`]. Made by [`Engine::builder`].
#[must_use = "a builder does nothing until `build` is called"]
pub struct EngineBuilder {
    listen: String,
    advertise: Option<String>,
    tcp: TcpConfig,
    limits: Limits,
    transfer_timeout: Duration,
    worker_threads: usize,
    inbox_capacity: usize,
    inbox_bytes: usize,
    max_connections: usize,
    idle_timeout: Duration,
    metadata: Option<Arc<dyn MetadataStore>>,
    transports: Vec<Arc<dyn Transport>>,
    liveness_interval: Duration,
    secret: Option<Vec<u8>>,
}

impl Default for EngineBuilder {
    fn default() -> Self {
        EngineBuilder {
            listen: "127.0.0.1:0".into(),
            advertise: None,
            tcp: TcpConfig::default(),
            limits: Limits::default(),
            transfer_timeout: Duration::from_secs(30),
            worker_threads: 2,
            inbox_capacity: 4096,
            inbox_bytes: 64 << 20,
            max_connections: 256,
            idle_timeout: Duration::from_secs(300),
            metadata: None,
            transports: Vec::new(),
            liveness_interval: Duration::from_secs(2),
            secret: None,
        }
    }
}

impl EngineBuilder {
    /// Address of the control listener, `127.0.0.1:0` by default (loopback, any free port).
    /// Listen on `0.0.0.0:PORT` to accept peers from other hosts, with [`Self::advertise`].
    pub fn listen(mut self, address: impl Into<String>) -> Self {
        self.listen = address.into();
        self
    }

    /// The host name or IP peers should use to reach this engine; needed when listening on an
    /// unspecified address such as `0.0.0.0`.
    pub fn advertise(mut self, host: impl Into<String>) -> Self {
        self.advertise = Some(host.into());
        self
    }

    /// How the TCP transport uses connections (4 per peer by default).
    pub fn tcp(mut self, config: TcpConfig) -> Self {
        self.tcp = config;
        self
    }

    /// How long a transfer may take before it fails with [`Error::Timeout`] (30 s by default).
    /// Also bounds connecting, a new connection's hello, and the reading or writing of each
    /// frame once it has started; the time between frames is bounded by
    /// [`Self::idle_timeout`] instead.
    pub fn transfer_timeout(mut self, timeout: Duration) -> Self {
        self.transfer_timeout = timeout;
        self
    }

    /// Notifications kept for the reader before senders are refused (4096 by default). A
    /// full inbox refuses new notifications at once rather than stalling the data behind them.
    pub fn notification_capacity(mut self, capacity: usize) -> Self {
        self.inbox_capacity = capacity.max(1);
        self
    }

    /// Bytes of unread notifications (payloads plus sender names) kept for the reader before
    /// senders are refused (64 MiB by default), whatever [`Self::notification_capacity`]
    /// allows: a sender whose notification would pass it gets [`Error::Rejected`] at once,
    /// as with a full inbox. A notification larger than the bound is always refused.
    pub fn notification_bytes(mut self, bytes: usize) -> Self {
        self.inbox_bytes = bytes;
        self
    }

    /// Most connections the listener serves at once (256 by default). A connection over the
    /// cap is closed as soon as it is accepted, with a warning in the log, never queued; the
    /// cap keeps a flood of connections from taking every file descriptor of the process.
    /// Each peer holds [`TcpConfig::connections`] connections (4 by default), and a
    /// descriptor lookup one more for a moment, so the default serves about 60 peers.
    pub fn max_connections(mut self, connections: usize) -> Self {
        self.max_connections = connections.max(1);
        self
    }

    /// How long a connection may go without a frame after its hello before the listener
    /// closes it (5 minutes by default). A peer whose connection was closed opens a new one
    /// on its next transfer; a frame already under way when the time passes fails with
    /// [`Error::PeerGone`] and must be resent. A connection that has not said hello yet is
    /// bounded by [`Self::transfer_timeout`] instead.
    pub fn idle_timeout(mut self, timeout: Duration) -> Self {
        self.idle_timeout = timeout;
        self
    }

    /// Threads of the engine's own I/O runtime (2 by default).
    pub fn worker_threads(mut self, threads: usize) -> Self {
        self.worker_threads = threads.max(1);
        self
    }

    /// How often the open peers are looked up again (2 s by default): a peer that vanished
    /// from the metadata store (or whose listener stopped answering) or that came back as a
    /// new engine (another instance id) has its links and GPU mappings closed, transfers in flight to it fail with
    /// [`Error::PeerGone`], and the next `connect` opens it afresh.
    pub fn liveness_interval(mut self, interval: Duration) -> Self {
        self.liveness_interval = interval.max(Duration::from_millis(10));
        self
    }

    /// Where descriptors are published and fetched; peer-to-peer ([`PeerToPeer`]) by default.
    pub fn metadata(mut self, store: Arc<dyn MetadataStore>) -> Self {
        self.metadata = Some(store);
        self
    }

    /// A shared secret (at least [`Secret::MIN_LEN`] bytes) that peers must prove they hold.
    ///
    /// With it, every connection this engine opens or accepts (TCP, descriptor lookups, the
    /// fd-passing socket) starts with a mutual challenge-response ([`crate::auth`]), and a peer
    /// with another secret or none is refused on both sides with
    /// [`Error::Unauthenticated`] before anything about registered memory is sent.
    ///
    /// Where the secret comes from, first match wins: this method; the environment variable
    /// `FERRY_SECRET` (its bytes as they are), read when the engine is built; none. Without
    /// one, any process that reaches the listener can read and write every registered byte.
    pub fn secret(mut self, secret: impl Into<Vec<u8>>) -> Self {
        self.secret = Some(secret.into());
        self
    }

    /// Adds a transport besides TCP, which every engine has.
    pub fn transport(mut self, transport: Arc<dyn Transport>) -> Self {
        self.transports.push(transport);
        self
    }

    /// Starts the engine: binds the listener, starts its runtime and publishes its descriptor.
    ///
    /// # Errors
    /// [`Error::Io`] when the address cannot be bound, [`Error::ApiMisuse`] for an
    /// unspecified listen address without [`Self::advertise`] or a secret (given or in
    /// `FERRY_SECRET`) shorter than [`Secret::MIN_LEN`], and the metadata store's error when
    /// publishing fails.
    ///
    /// # Cancel safety
    /// The engine starts on the first poll; dropping the future later drops the engine, which
    /// closes its listener and stops its runtime. The descriptor may or may not have reached
    /// the store by then: an entry left in a leased store (etcd, redis) is no longer renewed
    /// and expires after its time to live.
    pub async fn build(self) -> Result<Engine> {
        let (engine, published) = self.start()?;
        published.await.map_err(|_| Error::Shutdown {
            what: "publishing the descriptor".into(),
        })??;
        Ok(engine)
    }

    /// [`Self::build`] for callers without an async runtime: blocks the calling thread until
    /// the engine has started.
    ///
    /// # Errors
    /// [`Error::ApiMisuse`] on a thread of a tokio runtime (await [`Self::build`] there);
    /// otherwise as [`Self::build`].
    pub fn build_blocking(self) -> Result<Engine> {
        crate::blocking::refuse_on_runtime(
            "EngineBuilder::build_blocking",
            "EngineBuilder::build",
        )?;
        futures::executor::block_on(self.build())
    }

    fn start(self) -> Result<(Engine, tokio::task::JoinHandle<Result<()>>)> {
        log_driver_once();
        let secret = match self.secret {
            Some(bytes) => Some(Secret::new(bytes)?),
            None => Secret::from_env()?,
        };
        let address = self
            .listen
            .to_socket_addrs()
            .map_err(|error| Error::io(format!("resolving listen address {}", self.listen), error))?
            .next()
            .ok_or_else(|| {
                Error::ApiMisuse(format!(
                    "listen address {} resolves to nothing",
                    self.listen
                ))
            })?;
        let listener = std::net::TcpListener::bind(address).map_err(|error| {
            Error::io(format!("binding the control listener on {address}"), error)
        })?;
        listener
            .set_nonblocking(true)
            .map_err(|error| Error::io("making the listener non-blocking", error))?;
        let local_addr = listener
            .local_addr()
            .map_err(|error| Error::io("reading the listener's address", error))?;
        let name = segment_name(local_addr, self.advertise.as_deref())?;
        if secret.is_none() && !local_addr.ip().is_loopback() {
            tracing::warn!(
                listener = %local_addr,
                "no shared secret: any peer that reaches this port can read and write all registered memory; set one with EngineBuilder::secret, {SECRET_ENV} or --secret-file"
            );
        }
        let instance =
            InstanceId::random().map_err(|error| Error::io("drawing the engine's id", error))?;
        let process = InstanceId::of_this_process()
            .map_err(|error| Error::io("drawing the process's id", error))?;

        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(self.worker_threads)
            .thread_name("ferry-io")
            .enable_all()
            .build()
            .map_err(|error| Error::io("starting the engine's runtime", error))?;
        let table = RegionTable::new();
        let gpus = Driver::get().devices().unwrap_or_else(|error| {
            tracing::warn!(%error, "listing GPUs failed; GPU memory cannot be registered");
            Vec::new()
        });
        let tcp = Arc::new(TcpTransport {
            address: name.clone(),
            local_name: name.clone(),
            config: self.tcp,
            limits: self.limits,
            io_timeout: self.transfer_timeout,
            secret: secret.clone(),
        });
        let control: Arc<dyn Transport> = tcp;
        let mut transports: Vec<Arc<dyn Transport>> = self.transports;
        transports.push(Arc::clone(&control));
        let listener = {
            let _entered = runtime.enter();
            let context = EngineContext {
                instance,
                secret: secret.clone(),
                runtime: runtime.handle().clone(),
            };
            for transport in &transports {
                transport.attach(&context)?;
            }
            tokio::net::TcpListener::from_std(listener)
                .map_err(|error| Error::io("registering the listener", error))?
        };
        let (inbox, receiver, inbox_held) = Inbox::new(self.inbox_capacity, self.inbox_bytes);
        let metadata = self
            .metadata
            .unwrap_or_else(|| Arc::new(PeerToPeer::new(self.transfer_timeout)));
        let metadata = match &secret {
            Some(secret) => metadata.with_secret(secret).unwrap_or(metadata),
            None => metadata,
        };
        let inner = Arc::new(EngineInner {
            name,
            local_addr,
            instance,
            process,
            host: HostIdentity::current(),
            table,
            control,
            transports,
            metadata,
            handle: runtime.handle().clone(),
            inbox: Mutex::new(Some((receiver, inbox_held))),
            peers: Mutex::new(HashMap::new()),
            transfer_timeout: self.transfer_timeout,
            gpus,
            shutting_down: AtomicBool::new(false),
        });
        crate::local::remember(instance, &inner.table);
        let describer = Arc::downgrade(&inner);
        let context = Arc::new(ServerContext {
            table: Arc::clone(&inner.table),
            inbox,
            descriptor: Box::new(move || {
                describer
                    .upgrade()
                    .map(|engine| engine.descriptor())
                    .unwrap_or_else(|| empty_descriptor(instance, process))
            }),
            session: SessionConfig {
                limits: self.limits,
                io_timeout: self.transfer_timeout,
                idle_timeout: self.idle_timeout,
            },
            max_connections: self.max_connections,
            secret,
        });
        runtime.spawn(tcp::serve(listener, context));
        let publisher = Arc::clone(&inner);
        let published = runtime.spawn(async move { publisher.publish().await });
        runtime.spawn(republish_on_change(Arc::downgrade(&inner)));
        runtime.spawn(watch_peers(Arc::downgrade(&inner), self.liveness_interval));
        tracing::info!(name = %inner.name, "ferry engine listening");
        Ok((
            Engine {
                inner,
                runtime: Some(runtime),
            },
            published,
        ))
    }
}

/// Keeps the metadata store in step with the region table, until the engine is gone.
async fn republish_on_change(engine: std::sync::Weak<EngineInner>) {
    loop {
        let Some(table) = engine.upgrade().map(|engine| Arc::clone(&engine.table)) else {
            return;
        };
        table.changed().await;
        let Some(engine) = engine.upgrade() else {
            return;
        };
        if let Err(error) = engine.publish().await {
            tracing::warn!(%error, "republishing the descriptor failed; peers may see stale buffers");
        }
    }
}

/// Looks the open peers up again every `interval` and closes those that are gone or were
/// replaced by another engine (a new instance id), until the engine is gone.
async fn watch_peers(engine: std::sync::Weak<EngineInner>, interval: Duration) {
    loop {
        tokio::time::sleep(interval).await;
        let Some(engine) = engine.upgrade() else {
            return;
        };
        let open: Vec<(String, Peer)> = engine
            .peers
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
            .iter()
            .map(|(name, peer)| (name.clone(), peer.clone()))
            .collect();
        for (name, peer) in open {
            let why = match engine.metadata.fetch(&name).await {
                Ok(descriptor) => {
                    let known = peer.view();
                    if descriptor.instance == known.descriptor.instance {
                        for transport in &engine.transports {
                            transport.import(&descriptor).await;
                        }
                        peer.update(descriptor);
                        continue;
                    }
                    format!(
                        "it is now another engine ({}, process {} on {})",
                        descriptor.instance, descriptor.pid, descriptor.host.hostname
                    )
                }
                Err(error @ (Error::NotPublished { .. } | Error::Unreachable { .. })) => {
                    error.to_string()
                }
                // The store itself is in trouble: the peer may be fine, keep it.
                Err(error) => {
                    tracing::debug!(peer = %name, %error, "could not look a peer up; keeping it");
                    continue;
                }
            };
            tracing::info!(peer = %name, reason = %why, "peer gone; closing its links and mappings");
            peer.close();
            let mut peers = engine
                .peers
                .lock()
                .unwrap_or_else(|poison| poison.into_inner());
            if peers.get(&name).is_some_and(|current| current.same(&peer)) {
                peers.remove(&name);
            }
        }
    }
}

fn empty_descriptor(instance: InstanceId, process: InstanceId) -> SegmentDescriptor {
    SegmentDescriptor {
        version: DESCRIPTOR_VERSION,
        name: String::new(),
        host: HostIdentity::current(),
        generation: 0,
        instance,
        process,
        pid: std::process::id(),
        endpoints: Vec::new(),
        gpus: Vec::new(),
        buffers: Vec::new(),
    }
}

fn segment_name(local: SocketAddr, advertise: Option<&str>) -> Result<String> {
    let name = match advertise {
        Some(host) if host.contains(':') && !host.starts_with('[') => Ok(format!("[{host}]:{}", local.port())),
        Some(host) => Ok(format!("{host}:{}", local.port())),
        None if local.ip().is_unspecified() => Err(Error::ApiMisuse(format!(
            "listening on {local} needs `advertise(host)` so peers know which address reaches this engine"
        ))),
        None => Ok(local.to_string()),
    }?;
    if name.len() > MAX_NAME_BYTES {
        return Err(Error::ApiMisuse(format!(
            "the segment name {name} is longer than the {MAX_NAME_BYTES} bytes peers accept in a hello; advertise a shorter host name"
        )));
    }
    Ok(name)
}

fn log_driver_once() {
    static LOGGED: Once = Once::new();
    LOGGED.call_once(|| match Driver::get().status() {
        status @ crate::cuda::DriverStatus::Ready { .. } => tracing::info!("{status}"),
        status => tracing::info!("running host-only: {status}"),
    });
}

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
}

impl EngineInner {
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
        }
    }
}

/// A ferry engine: registers memory, opens peers and moves bytes between them.
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
    /// A builder with the defaults: listen on `127.0.0.1:0`, peer-to-peer metadata, TCP.
    pub fn builder() -> EngineBuilder {
        EngineBuilder::default()
    }

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
    /// [`Error::Registration`] for a null pointer, `len == 0` or a range that wraps,
    /// [`crate::RangeError::Overlap`] when the range overlaps a registered region,
    /// [`Error::Unsupported`] for managed memory and for GPU memory a transport should share
    /// but cannot (a stream-ordered pool allocation, a `cudaMalloc` range over several
    /// allocations), [`Error::Cuda`] when exporting fails.
    pub unsafe fn register(&self, ptr: *mut u8, len: usize) -> Result<Region> {
        let addr = ptr as u64;
        if ptr.is_null() {
            return Err(Error::registration(addr, len, RegistrationProblem::Null));
        }
        Error::check_registration(addr, len)?;
        let location = match Driver::get().memory_kind(addr)? {
            MemoryKind::PageableHost => Location::Host { pinned: false },
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
            len: len as u64,
            location,
        };
        self.inner.insert(info, None)
    }

    /// Allocates `len` zeroed bytes of host memory and registers them. The memory is freed when
    /// the region is dropped; reach it with [`Region::write_at`] and [`Region::read_at`].
    ///
    /// # Errors
    /// [`Error::Registration`] for `len == 0`, [`Error::OutOfMemory`] when the allocation
    /// fails.
    pub fn allocate(&self, len: usize) -> Result<Region> {
        Error::check_registration(0, len)?;
        let buffer = OwnedBuffer::zeroed(len).ok_or(Error::OutOfMemory {
            what: "Engine::allocate",
            bytes: len,
        })?;
        let info = RegionInfo {
            addr: buffer.addr(),
            len: len as u64,
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
    /// [`Error::Registration`] for `len == 0`, [`Error::Cuda`] when there is no such GPU or
    /// the allocation or export fails.
    pub fn allocate_device(&self, ordinal: u32, len: usize) -> Result<Region> {
        Error::check_registration(0, len)?;
        let buffer = DeviceBuffer::new(Context::get(ordinal)?, len)?;
        let info = RegionInfo {
            addr: buffer.addr(),
            len: len as u64,
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
        piece_bytes: usize,
        pieces: usize,
    ) -> Result<Region> {
        match piece_bytes.checked_mul(pieces) {
            Some(total) => Error::check_registration(0, total)?,
            None => {
                return Err(Error::registration(
                    0,
                    usize::MAX,
                    RegistrationProblem::Wraps,
                ))
            }
        }
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
        Batch::new(Arc::clone(&self.inner), peer)
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
            let link = peer.control(&inner).await?;
            tokio::time::timeout(limit, link.notify(&payload))
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
        let (receiver, held) = self
            .inner
            .inbox
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
            .take()
            .ok_or_else(|| {
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

    /// Runs `work` on the engine's runtime and waits for it from any executor.
    async fn run<T: Send + 'static>(
        &self,
        work: impl Future<Output = Result<T>> + Send + 'static,
    ) -> Result<T> {
        self.inner
            .handle
            .spawn(work)
            .await
            .map_err(|_| Error::Shutdown {
                what: "the request".into(),
            })?
    }
}

impl EngineInner {
    async fn connect(&self, name: &str) -> Result<Peer> {
        let descriptor = self.metadata.fetch(name).await?;
        for transport in &self.transports {
            transport.import(&descriptor).await;
        }
        let cached = self
            .peers
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
            .get(name)
            .cloned();
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
        self.peers
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
            .insert(name.to_owned(), peer.clone());
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
        crate::local::forget(self.inner.instance);
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}
