//! The facade's engine: ferry-core's engine with every transport of this build wired in.

use ferry_core::{MetadataStore, TcpConfig, Transport};
use ferry_nvlink::{MnnvlTransport, NvlinkConfig, NvlinkTransport};
use std::sync::Arc;
use std::time::Duration;

/// A ferry engine with the TCP, nvlink and mnnvl transports, and RDMA with the `rdma`
/// feature where the host has RDMA devices. Everything it does is
/// [`ferry_core::Engine`]'s, reached through `Deref`: register memory, connect to peers,
/// submit batches, receive notifications.
#[derive(Debug)]
pub struct Engine(ferry_core::Engine);

impl Engine {
    /// A builder with the defaults: listen on `127.0.0.1:0`, peer-to-peer metadata, TCP,
    /// nvlink and mnnvl.
    pub fn builder() -> EngineBuilder {
        EngineBuilder {
            core: ferry_core::Engine::builder(),
            nvlink: NvlinkConfig::default(),
            gpu_links: true,
            #[cfg(feature = "rdma")]
            rdma: Some(ferry_rdma::RdmaConfig::default()),
        }
    }
}

impl std::ops::Deref for Engine {
    type Target = ferry_core::Engine;

    fn deref(&self) -> &ferry_core::Engine {
        &self.0
    }
}

/// Configures and starts an [`Engine`]; see [`ferry_core::EngineBuilder`] for each setting.
#[must_use = "a builder does nothing until `build` is called"]
pub struct EngineBuilder {
    core: ferry_core::EngineBuilder,
    nvlink: NvlinkConfig,
    gpu_links: bool,
    #[cfg(feature = "rdma")]
    rdma: Option<ferry_rdma::RdmaConfig>,
}

impl EngineBuilder {
    /// Address of the control listener (`127.0.0.1:0` by default).
    pub fn listen(self, address: impl Into<String>) -> Self {
        EngineBuilder {
            core: self.core.listen(address),
            ..self
        }
    }

    /// The host name or IP peers use to reach this engine (needed with `0.0.0.0`).
    pub fn advertise(self, host: impl Into<String>) -> Self {
        EngineBuilder {
            core: self.core.advertise(host),
            ..self
        }
    }

    /// How the TCP transport uses connections.
    pub fn tcp(self, config: TcpConfig) -> Self {
        EngineBuilder {
            core: self.core.tcp(config),
            ..self
        }
    }

    /// How the nvlink transport spreads copies over streams.
    pub fn nvlink(self, config: NvlinkConfig) -> Self {
        EngineBuilder {
            nvlink: config,
            ..self
        }
    }

    /// Whether the GPU-to-GPU transports (nvlink, mnnvl) are used (the default). Without them
    /// GPU memory moves over TCP, staged through pinned host buffers, and notifications to
    /// and from engines of this host go over TCP instead of shared memory: for testing those
    /// paths, or to rule NVLink out while diagnosing.
    pub fn gpu_links(self, enabled: bool) -> Self {
        EngineBuilder {
            gpu_links: enabled,
            ..self
        }
    }

    /// How long a transfer may take (30 s by default).
    pub fn transfer_timeout(self, timeout: Duration) -> Self {
        EngineBuilder {
            core: self.core.transfer_timeout(timeout),
            ..self
        }
    }

    /// How often open peers are looked up again, to close those that are gone (2 s by
    /// default).
    pub fn liveness_interval(self, interval: Duration) -> Self {
        EngineBuilder {
            core: self.core.liveness_interval(interval),
            ..self
        }
    }

    /// Notifications kept for the reader before senders are refused (4096 by default).
    pub fn notification_capacity(self, capacity: usize) -> Self {
        EngineBuilder {
            core: self.core.notification_capacity(capacity),
            ..self
        }
    }

    /// Bytes of unread notifications kept for the reader before senders are refused (64 MiB
    /// by default); see [`ferry_core::EngineBuilder::notification_bytes`].
    pub fn notification_bytes(self, bytes: u64) -> Self {
        EngineBuilder {
            core: self.core.notification_bytes(bytes),
            ..self
        }
    }

    /// Most authenticated connections the listener serves at once (256 by default); more are
    /// closed as they authenticate. See [`ferry_core::EngineBuilder::max_connections`].
    pub fn max_connections(self, connections: usize) -> Self {
        EngineBuilder {
            core: self.core.max_connections(connections),
            ..self
        }
    }

    /// Most connections kept while they have not authenticated (128 by default, 64 from one
    /// source address); a newer one evicts the oldest. See
    /// [`ferry_core::EngineBuilder::max_unauthenticated`].
    pub fn max_unauthenticated(self, connections: usize, per_source: usize) -> Self {
        EngineBuilder {
            core: self.core.max_unauthenticated(connections, per_source),
            ..self
        }
    }

    /// How long a new connection has to authenticate, or say hello without a secret (5 s by
    /// default). See [`ferry_core::EngineBuilder::handshake_timeout`].
    pub fn handshake_timeout(self, timeout: Duration) -> Self {
        EngineBuilder {
            core: self.core.handshake_timeout(timeout),
            ..self
        }
    }

    /// How long a connection may go without a frame after its hello before the listener
    /// closes it (5 minutes by default). See [`ferry_core::EngineBuilder::idle_timeout`].
    pub fn idle_timeout(self, timeout: Duration) -> Self {
        EngineBuilder {
            core: self.core.idle_timeout(timeout),
            ..self
        }
    }

    /// Threads of the engine's own I/O runtime (2 by default).
    pub fn worker_threads(self, threads: usize) -> Self {
        EngineBuilder {
            core: self.core.worker_threads(threads),
            ..self
        }
    }

    /// Where descriptors are published and fetched (peer-to-peer by default).
    pub fn metadata(self, store: Arc<dyn MetadataStore>) -> Self {
        EngineBuilder {
            core: self.core.metadata(store),
            ..self
        }
    }

    /// A shared secret peers must prove they hold; `FERRY_SECRET` when not set. See
    /// [`ferry_core::EngineBuilder::secret`].
    pub fn secret(self, secret: impl Into<Vec<u8>>) -> Self {
        EngineBuilder {
            core: self.core.secret(secret),
            ..self
        }
    }

    /// Which authenticated TCP connections tag their frames (between hosts by default). See
    /// [`ferry_core::EngineBuilder::frame_tags`].
    pub fn frame_tags(self, tags: ferry_core::FrameTags) -> Self {
        EngineBuilder {
            core: self.core.frame_tags(tags),
            ..self
        }
    }

    /// Adds a transport of the caller's own.
    pub fn transport(self, transport: Arc<dyn Transport>) -> Self {
        EngineBuilder {
            core: self.core.transport(transport),
            ..self
        }
    }

    /// How the RDMA transport uses the host's NICs, or `None` to leave RDMA out. By default
    /// it uses every NIC with an active port; without rdma-core or devices the engine starts
    /// without RDMA and logs why (`ferry probe` says it too).
    #[cfg(feature = "rdma")]
    pub fn rdma(self, config: Option<ferry_rdma::RdmaConfig>) -> Self {
        EngineBuilder {
            rdma: config,
            ..self
        }
    }

    fn wired(self) -> ferry_core::EngineBuilder {
        #[cfg(feature = "rdma")]
        let core = with_rdma(self.core, self.rdma);
        #[cfg(not(feature = "rdma"))]
        let core = self.core;
        if !self.gpu_links {
            return core;
        }
        core.transport(Arc::new(NvlinkTransport::new(self.nvlink)))
            .transport(Arc::new(MnnvlTransport::new(self.nvlink)))
    }

    /// Starts the engine.
    ///
    /// # Errors
    /// As [`ferry_core::EngineBuilder::build`].
    ///
    /// # Cancel safety
    /// As [`ferry_core::EngineBuilder::build`]: the engine starts on the first poll, and
    /// dropping the future later drops it.
    pub async fn build(self) -> ferry_core::Result<Engine> {
        self.wired().build().await.map(Engine)
    }

    /// [`Self::build`] for callers without an async runtime. Never call it from inside one.
    ///
    /// # Errors
    /// As [`ferry_core::EngineBuilder::build`].
    pub fn build_blocking(self) -> ferry_core::Result<Engine> {
        self.wired().build_blocking().map(Engine)
    }
}

/// `core` with the RDMA transport over rdma-core when `config` asks for it and the host has
/// RDMA devices; otherwise `core` as it is, with the reason logged.
#[cfg(feature = "rdma")]
fn with_rdma(
    core: ferry_core::EngineBuilder,
    config: Option<ferry_rdma::RdmaConfig>,
) -> ferry_core::EngineBuilder {
    let Some(config) = config else { return core };
    match ferry_rdma::SidewayVerbs::new() {
        Ok(verbs) => {
            let gpus = Arc::new(ferry_rdma::CudaGpus);
            core.transport(Arc::new(ferry_rdma::RdmaTransport::new(
                verbs, config, gpus,
            )))
        }
        Err(error) => {
            tracing::info!(%error, "RDMA is unavailable; transfers between hosts use TCP");
            core
        }
    }
}
