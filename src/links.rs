//! This build's links: the transports the facade gives every engine besides TCP.

use crate::{EngineBuilder, NvlinkConfig};
use ferry_core::{Transport, TransportSet};
use ferry_nvlink::{MnnvlTransport, NvlinkTransport};
use std::sync::Arc;

/// A builder for an engine with every link of this build and the defaults: listen on
/// `127.0.0.1:0`, peer-to-peer metadata, TCP, nvlink and mnnvl, and RDMA with the `rdma`
/// feature where the host has RDMA devices. [`Links::builder`] starts from links set up
/// otherwise.
///
/// ```
/// # fn main() -> ferry::Result<()> {
/// let engine = ferry::builder().listen("127.0.0.1:0").build_blocking()?;
/// assert!(engine.name().starts_with("127.0.0.1:"));
/// # Ok(()) }
/// ```
pub fn builder() -> EngineBuilder {
    Links::default().builder()
}

/// The transports this build of ferry gives an engine besides TCP, and how each is set up:
/// nvlink and mnnvl between GPUs, and with the `rdma` feature RDMA between hosts. The
/// default has all of them with their default settings; the engine opens them when it is
/// built, so RDMA devices are looked for then.
///
/// ```
/// # fn main() -> ferry::Result<()> {
/// // Two streams per GPU for nvlink's copies, and the fd socket also served in a directory
/// // that a second pod mounts at the same path.
/// # let shared = std::env::temp_dir().join(format!("ferry-doc-{}", std::process::id()));
/// # std::fs::create_dir_all(&shared).expect("a directory");
/// let nvlink = ferry::NvlinkConfig {
///     streams_per_gpu: 2,
///     ..ferry::NvlinkConfig::default()
/// }
/// .socket_dir(&shared);
/// let engine = ferry::Links::default().nvlink(nvlink).builder().build_blocking()?;
/// # drop(engine);
/// # std::fs::remove_dir_all(&shared).expect("removed");
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
#[must_use = "links do nothing until an engine is built with them"]
pub struct Links {
    nvlink: NvlinkConfig,
    gpu_links: bool,
    #[cfg(feature = "rdma")]
    rdma: Option<ferry_rdma::RdmaConfig>,
}

impl Default for Links {
    fn default() -> Self {
        Links {
            nvlink: NvlinkConfig::default(),
            gpu_links: true,
            #[cfg(feature = "rdma")]
            rdma: Some(ferry_rdma::RdmaConfig::default()),
        }
    }
}

impl Links {
    /// How the GPU links work: the nvlink transport's streams, copy path and kernels, the
    /// socket directory its fd socket is also served in ([`NvlinkConfig::socket_dir`]), and
    /// the same settings for mnnvl. Has no effect with [`Links::gpu_links`] off (a socket
    /// directory set then is logged as unused).
    pub fn nvlink(self, config: NvlinkConfig) -> Self {
        Links {
            nvlink: config,
            ..self
        }
    }

    /// Whether the GPU-to-GPU transports (nvlink, mnnvl) are used (the default). Without them
    /// GPU memory moves over TCP, staged through pinned host buffers, and notifications to
    /// and from engines of this host go over TCP instead of shared memory: for testing those
    /// paths, or to rule NVLink out while diagnosing.
    pub fn gpu_links(self, enabled: bool) -> Self {
        Links {
            gpu_links: enabled,
            ..self
        }
    }

    /// How the RDMA transport uses the host's NICs, or `None` to leave RDMA out. By default
    /// it uses every NIC with an active port; without rdma-core or devices the engine starts
    /// without RDMA and logs why (`ferry probe` says it too).
    #[cfg(feature = "rdma")]
    pub fn rdma(self, config: Option<ferry_rdma::RdmaConfig>) -> Self {
        Links {
            rdma: config,
            ..self
        }
    }

    /// A builder for an engine with these links and the defaults of [`builder`].
    pub fn builder(self) -> EngineBuilder {
        EngineBuilder::new(self)
    }
}

impl TransportSet for Links {
    fn transports(self: Box<Self>) -> Vec<Arc<dyn Transport>> {
        let mut transports: Vec<Arc<dyn Transport>> = Vec::new();
        #[cfg(feature = "rdma")]
        transports.extend(rdma(self.rdma));
        if self.gpu_links {
            transports.push(Arc::new(NvlinkTransport::new(self.nvlink)));
            transports.push(Arc::new(MnnvlTransport::new(self.nvlink)));
        } else if let Some(dir) = self.nvlink.socket_dir {
            tracing::warn!(dir = %dir.display(), "a socket directory is set but the GPU links are off: no fd socket is served there, and every byte goes over TCP");
        }
        transports
    }
}

/// The RDMA transport over rdma-core when `config` asks for it and the host has RDMA
/// devices; otherwise none, with the reason logged.
#[cfg(feature = "rdma")]
fn rdma(config: Option<ferry_rdma::RdmaConfig>) -> Option<Arc<dyn Transport>> {
    let config = config?;
    match ferry_rdma::SidewayVerbs::new() {
        Ok(verbs) => {
            let gpus = Arc::new(ferry_rdma::CudaGpus);
            Some(Arc::new(ferry_rdma::RdmaTransport::new(
                verbs, config, gpus,
            )))
        }
        Err(error) => {
            tracing::info!(%error, "RDMA is unavailable; transfers between hosts use TCP");
            None
        }
    }
}
