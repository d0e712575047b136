//! Configuring and starting an engine: its listener, runtime, transports and first publish.

use super::liveness::{republish_on_change, watch_peers};
use super::{Engine, EngineInner, TransportSet};
use crate::auth::{Secret, SECRET_ENV};
use crate::cuda::Driver;
use crate::descriptor::{HostIdentity, SegmentDescriptor, DESCRIPTOR_VERSION};
use crate::error::{Error, Result};
use crate::identity::InstanceId;
use crate::memory::RegionTable;
use crate::metadata::{MetadataStore, PeerToPeer, Signed};
use crate::notify::{Inbox, InboxHandle};
use crate::proto::SessionConfig;
use crate::tcp::{self, FrameTags, ServerContext, TcpConfig, TcpTransport};
use crate::transport::{EngineContext, Transport};
use crate::wire::{Limits, MAX_NAME_BYTES};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Once};
use std::time::Duration;

/// Configures and starts an [`Engine`]. Made by [`Self::new`] with the build's
/// [`TransportSet`]; the `ferry` crate's `ferry::builder()` gives one with every link of its
/// build.
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
    max_unauthenticated: usize,
    max_unauthenticated_per_source: usize,
    handshake_timeout: Duration,
    idle_timeout: Duration,
    metadata: Option<Arc<dyn MetadataStore>>,
    links: Box<dyn TransportSet>,
    transports: Vec<Arc<dyn Transport>>,
    liveness_interval: Duration,
    secret: Option<Vec<u8>>,
    frame_tags: FrameTags,
}

impl EngineBuilder {
    /// A builder with the defaults (listen on `127.0.0.1:0`, peer-to-peer metadata) whose
    /// engine has TCP and the transports of `links`.
    pub fn new(links: impl TransportSet + 'static) -> Self {
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
            max_unauthenticated: 128,
            max_unauthenticated_per_source: 64,
            handshake_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(300),
            metadata: None,
            links: Box::new(links),
            transports: Vec::new(),
            liveness_interval: Duration::from_secs(2),
            secret: None,
            frame_tags: FrameTags::default(),
        }
    }

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
    /// Also bounds connecting and the reading or writing of each
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
    pub fn notification_bytes(mut self, bytes: u64) -> Self {
        // More than the address space holds is no limit at all.
        self.inbox_bytes = usize::try_from(bytes).unwrap_or(usize::MAX);
        self
    }

    /// Most authenticated connections the listener serves at once (256 by default): those
    /// that proved the secret, or, without one, said hello. A connection that authenticates
    /// over the cap is closed then, with a warning in the log; the cap keeps peers from taking
    /// every file descriptor of the process. Each peer holds [`TcpConfig::connections`]
    /// connections (4 by default), and a descriptor lookup one more for a moment, so the
    /// default serves about 60 peers. Connections that have not authenticated yet count
    /// against [`Self::max_unauthenticated`] instead, so strangers never keep a peer out.
    pub fn max_connections(mut self, connections: usize) -> Self {
        self.max_connections = connections.max(1);
        self
    }

    /// Most connections kept while they have not authenticated (128 by default), and most of
    /// those from one source address (64 by default: the ranks of a server on one host may
    /// all connect at once, each with several connections). A connection over either closes the
    /// oldest unauthenticated one (of its own source first) instead of being refused, so a
    /// flood of silent or slow connections evicts itself and a real peer, which authenticates
    /// within milliseconds, still gets in; a warning in the log (at most one every 10 s) says
    /// that something opens connections that do not authenticate.
    pub fn max_unauthenticated(mut self, connections: usize, per_source: usize) -> Self {
        self.max_unauthenticated = connections.max(1);
        self.max_unauthenticated_per_source = per_source.max(1);
        self
    }

    /// How long a new connection has, from its accept, to authenticate (or, without a secret,
    /// to say hello) before it is closed (5 s by default): a peer needs a round trip or two.
    pub fn handshake_timeout(mut self, timeout: Duration) -> Self {
        self.handshake_timeout = timeout;
        self
    }

    /// How long a connection may go without a frame after its hello before the listener
    /// closes it (5 minutes by default). A peer whose connection was closed opens a new one
    /// on its next transfer; a frame already under way when the time passes fails with
    /// [`Error::PeerGone`] and must be resent. A connection that has not said hello yet is
    /// bounded by [`Self::handshake_timeout`] instead.
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

    /// Which authenticated TCP connections this engine opens tag every frame
    /// ([`crate::wire::seal`]): [`FrameTags::BetweenHosts`] by default. Tags cost CPU on both
    /// sides; on an H200 host's loopback, GPU memory over TCP moved 4.0 GB/s tagged against
    /// 7.8 plain with the default two I/O threads ([`Self::worker_threads`] adds cores).
    pub fn frame_tags(mut self, tags: FrameTags) -> Self {
        self.frame_tags = tags;
        self
    }

    /// Replaces the set of transports the engine gets besides TCP, given to [`Self::new`].
    pub fn links(mut self, links: impl TransportSet + 'static) -> Self {
        self.links = Box::new(links);
        self
    }

    /// Adds a transport of the caller's own, besides TCP and those of the builder's
    /// [`TransportSet`].
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
        let mut transports: Vec<Arc<dyn Transport>> = self.transports;
        transports.extend(self.links.transports());
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
            frame_tags: self.frame_tags,
        });
        let control: Arc<dyn Transport> = tcp;
        transports.push(Arc::clone(&control));
        let (inbox, receiver, inbox_held) = Inbox::new(self.inbox_capacity, self.inbox_bytes);
        let listener = {
            let _entered = runtime.enter();
            let context = EngineContext {
                instance,
                secret: secret.clone(),
                runtime: runtime.handle().clone(),
                name: name.clone(),
                inbox: InboxHandle::new(inbox.clone()),
            };
            for transport in &transports {
                transport.attach(&context)?;
            }
            tokio::net::TcpListener::from_std(listener)
                .map_err(|error| Error::io("registering the listener", error))?
        };
        let external_store = self.metadata.is_some();
        let metadata = self
            .metadata
            .unwrap_or_else(|| Arc::new(PeerToPeer::new(self.transfer_timeout)));
        let metadata: Arc<dyn MetadataStore> = match &secret {
            Some(secret) => Arc::new(Signed::new(
                metadata.with_secret(secret).unwrap_or(metadata),
                secret.clone(),
            )),
            None => {
                if external_store {
                    tracing::info!(
                        "no shared secret: descriptors from the metadata store are trusted as they are, so whoever can write the store can point this engine at other memory"
                    );
                }
                metadata
            }
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
            tasks: crate::task::Tasks::default(),
            spares: crate::batch::Spares::default(),
        });
        crate::local::remember(instance, &inner.table);
        let describer = Arc::downgrade(&inner);
        let serving_secret = secret.clone();
        let context = Arc::new(ServerContext {
            table: Arc::clone(&inner.table),
            inbox,
            descriptor: Box::new(move || {
                describer
                    .upgrade()
                    .map(|engine| {
                        let descriptor = engine.descriptor();
                        // Served signed, as published: a peer with the secret checks it.
                        match &serving_secret {
                            Some(secret) => crate::auth::sign_descriptor(&descriptor, secret),
                            None => descriptor,
                        }
                    })
                    .unwrap_or_else(|| empty_descriptor(instance, process))
            }),
            session: SessionConfig {
                limits: self.limits,
                io_timeout: self.transfer_timeout,
                hello_timeout: self.handshake_timeout,
                idle_timeout: self.idle_timeout,
            },
            admission: tcp::AdmissionLimits {
                peers: self.max_connections,
                strangers: self.max_unauthenticated,
                strangers_per_source: self.max_unauthenticated_per_source,
            },
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
        signature: None,
    }
}

fn segment_name(local: SocketAddr, advertise: Option<&str>) -> Result<String> {
    let name = match advertise {
        Some(host) if host.contains(':') && !host.starts_with('[') => Ok(format!("[{host}]:{}", local.port())),
        Some(host) => Ok(format!("{host}:{}", local.port())),
        None if local.ip().is_unspecified() => Err(Error::ApiMisuse(format!(
            "listening on {local} needs the host peers reach this engine at: `EngineBuilder::advertise(host)`, `--advertise HOST` on the command line, `advertise=` in Python"
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
