//! ferry moves the KV cache of LLM requests between prefill and decode processes over the
//! fastest link they share. It registers the memory a server already has, finds each peer by
//! name, and moves batches of reads and writes that complete as one future, with a notification
//! that arrives only after the data it announces.
//!
//! This build moves host memory over TCP between processes on one host or across hosts, and
//! detects CUDA at run time (a machine without a GPU runs host-only and says so once).
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), ferry::Error> {
//! // The decode side: a pool peers may write into, and the stream of notifications.
//! let decode = ferry::Engine::builder().listen("127.0.0.1:0").build().await?;
//! let pool = decode.allocate(64 << 10)?;
//! let mut inbox = decode.notifications()?;
//!
//! // The prefill side registers memory it already has ...
//! let prefill = ferry::Engine::builder().build().await?;
//! let mut kv = vec![42u8; 64 << 10];
//! // SAFETY: `kv` outlives `region` (dropped first, at the end of scope in reverse order),
//! // and nothing else reads or writes it while it is registered.
//! let region = unsafe { prefill.register(kv.as_mut_ptr(), kv.len())? };
//!
//! // ... opens the peer by name, and writes with a notification.
//! let peer = prefill.connect(decode.name()).await?;
//! let remote = peer.buffers()[0].addr;
//! let done = prefill
//!     .batch(&peer)
//!     .write(&region, 0, remote, 64 << 10)
//!     .notify(b"req-42".to_vec())
//!     .submit()?;
//! done.await?;
//!
//! let note = inbox.recv().await.expect("the engine is alive");
//! assert_eq!(note.payload, b"req-42");
//! let mut landed = vec![0u8; 64 << 10];
//! pool.read_at(0, &mut landed)?;
//! assert!(landed.iter().all(|&byte| byte == 42));
//! # drop(region);
//! # Ok(()) }
//! ```
//!
//! Blocking callers use [`EngineBuilder::build_blocking`], [`Engine::connect_blocking`],
//! [`Batch::submit_blocking`] and [`Transfer::wait`].
#![forbid(unsafe_code)]

pub mod cuda;
mod engine;
pub mod tp;

pub use engine::{Engine, EngineBuilder};
pub use ferry_core::{
    AuthFailure, Batch, BlockCopy, BlockLayout, BufferDescriptor, Completion, Direction, Error,
    Location, Notification, Notifications, Peer, ProtocolViolation, RangeError, Refusal, Region,
    RegionInfo, RegistrationProblem, Result, Route, SegmentDescriptor, Side, TcpConfig, Transfer,
    MAX_NOTIFICATION_BYTES,
};
pub use ferry_nvlink::{CopyPath, NvlinkConfig};

/// Shared-secret authentication of peers: the secret type and where it is read from.
pub mod auth {
    pub use ferry_core::auth::{read_secret_file, Secret, SECRET_ENV};
}

/// Metadata stores, selected by URL.
pub mod metadata {
    pub use ferry_metadata::{from_url, Error, MemoryStore, MetadataStore, PeerToPeer};
}

/// For authors of transports and tools: the seam between the engine and the links that move
/// bytes, the descriptor's parts, and what each transport of this build publishes.
pub mod transport {
    pub use ferry_core::{
        BlockOps, BlockPoolOp, Endpoint, EngineContext, Export, ExportGuard, Exported,
        HostIdentity, InstanceId, Link, Reach, RegionUse, TransferOp, Transport,
        DESCRIPTOR_VERSION, TCP,
    };
    pub use ferry_nvlink::{
        fd_socket_name, probe_fabric, FabricSupport, GpuExport, MnnvlTransport, NvlinkTransport,
        BATCHED_FROM, ENGINE_FROM, EXPORT_VERSION, FDS_PER_MESSAGE, MNNVL, NVLINK,
    };
}

#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
