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

mod engine;
pub mod tp;

pub use engine::{Engine, EngineBuilder};
pub use ferry_nvlink::{
    probe_fabric, CopyPath, FabricSupport, GpuExport, NvlinkConfig, BATCHED_FROM, ENGINE_FROM,
    MNNVL, NVLINK,
};

pub use ferry_core::{
    auth, cuda, wire, AuthFailure, Batch, BlockCopy, BlockLayout, BlockOps, BlockPoolOp,
    BufferDescriptor, Completion, Direction, Endpoint, Error, Export, HostIdentity, InstanceId,
    Link, Location, MetadataStore, Notification, Notifications, Peer, PeerToPeer,
    ProtocolViolation, RangeError, Reach, Region, RegionInfo, RegionUse, Result, Secret,
    SegmentDescriptor, Side, TcpConfig, Transfer, TransferOp, Transport, DESCRIPTOR_VERSION,
    MAX_NOTIFICATION_BYTES, TCP,
};

#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;

/// Metadata stores, selected by URL.
pub mod metadata {
    pub use ferry_metadata::{from_url, Error, MemoryStore, MetadataStore, PeerToPeer};
}
