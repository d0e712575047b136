//! ferry moves the KV cache of LLM requests between prefill and decode processes over the
//! fastest link they share (NVLink between GPUs of one host, TCP otherwise). It registers the
//! memory a server already has, finds each peer by its name, and moves batches of reads and
//! writes that complete as one future, with a notification that arrives only after the data it
//! announces.
//!
//! # From builder to notification
//!
//! 1. **Build an engine**: [`builder`] gives an [`EngineBuilder`] (listen address, metadata
//!    store, shared secret, timeouts) for an engine with every link of this build: TCP,
//!    nvlink, mnnvl, and RDMA with the `rdma` feature; [`Links`] sets them up otherwise
//!    ([`Links::builder`]). [`EngineBuilder::build`] starts it. The engine's *name*
//!    ([`Engine::name`], `host:port` of its listener by default) is what other engines
//!    connect with.
//! 2. **Register or allocate memory**: [`Engine::register`] (`unsafe`: memory the server
//!    already has, host or GPU, found out at run time) or [`Engine::allocate`] /
//!    [`Engine::allocate_device`]. Each is a [`Region`], listed as a *buffer* in the engine's
//!    *descriptor* ([`SegmentDescriptor`]) that peers fetch by name. Dropping a region waits
//!    for the transfers using it.
//! 3. **Name a region** with [`Region::set_name`], so a peer finds it with [`Peer::buffer`]
//!    rather than by position or address.
//! 4. **Connect**: [`Engine::connect`] with the other engine's name gives a [`Peer`], a
//!    remote engine as last fetched: its buffers, with their addresses in its process.
//! 5. **Batch** with [`Engine::batch`]: flat [`Batch::write`] and [`Batch::read`] (a local
//!    region and offset, a remote address, a length) and paged
//!    [`Batch::write_blocks`] / [`Batch::read_blocks`] (a [`BlockCopy`]: block ids and one pool
//!    per layer and K/V, given as a local region and the peer's buffer), plus
//!    [`Batch::notify`] and, for GPU memory, [`Batch::signal`].
//! 6. **Transfer**: [`Batch::submit`] checks every range on both sides before a byte moves and
//!    returns a [`Transfer`], a future that resolves to a [`Completion`] once every byte is
//!    visible at its destination, or to an [`Error`] that says what to do.
//! 7. **Notification**: the peer's [`Engine::notifications`] stream yields a [`Notification`]
//!    after the data it announces.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), ferry::Error> {
//! const BLOCK: u64 = 4096;
//! // The decode side: K and V pools of 64 blocks, named for peers, and its notifications.
//! let decode = ferry::builder().listen("127.0.0.1:0").build().await?;
//! let (k_pool, v_pool) = (decode.allocate(64 * 4096)?, decode.allocate(64 * 4096)?);
//! k_pool.set_name("k.0")?;
//! v_pool.set_name("v.0")?;
//! let mut inbox = decode.notifications()?;
//!
//! // The prefill side registers memory it already has ...
//! let prefill = ferry::builder().build().await?;
//! let mut kv = vec![42u8; 2 * 16 * 4096]; // its own K and V pools of 16 blocks
//! // SAFETY: `kv` outlives `region` (dropped first, at the end of scope in reverse order),
//! // and nothing else reads or writes it while it is registered.
//! let region = unsafe { prefill.register(kv.as_mut_ptr(), kv.len() as u64)? };
//!
//! // ... opens the decode engine by name and finds its pools by theirs ...
//! let peer = prefill.connect(decode.name()).await?;
//! let pool = |name: &str| {
//!     let missing = || ferry::Error::ApiMisuse(format!("decode has no pool named {name}"));
//!     peer.buffer(name).ok_or_else(missing)
//! };
//! let (k, v) = (pool("k.0")?, pool("v.0")?);
//!
//! // ... and sends blocks 0 and 1 of each pool to the decode side's blocks 7 and 3, plus a
//! // flat write of a block, then a notification.
//! let blocks = ferry::BlockCopy::packed(BLOCK, vec![0, 1], vec![7, 3])
//!     .pool_at(&region, 0, &k, 0)
//!     .pool_at(&region, 16 * BLOCK, &v, 0);
//! let done = prefill
//!     .batch(&peer)
//!     .write_blocks(blocks)
//!     .write(&region, 0, k.addr + 63 * BLOCK, BLOCK)
//!     .notify(b"req-42".to_vec())
//!     .submit()?
//!     .await?;
//! assert_eq!(done.bytes, 5 * BLOCK);
//!
//! let note = inbox.recv().await.expect("the engine is alive");
//! assert_eq!(note.payload, b"req-42");
//! let mut landed = vec![0u8; BLOCK as usize];
//! v_pool.read_at(3 * BLOCK, &mut landed)?;
//! assert!(landed.iter().all(|&byte| byte == 42));
//! # drop(region);
//! # Ok(()) }
//! ```
//!
//! # Blocking callers
//!
//! A server without an async runtime uses [`EngineBuilder::build_blocking`],
//! [`Engine::connect_blocking`], [`Batch::submit_blocking`], [`Transfer::wait`],
//! [`Engine::notify_blocking`] and [`Notifications::recv_blocking`]. Each of them refuses with
//! [`Error::ApiMisuse`] on a thread of a tokio runtime (where blocking would stall the
//! runtime's other tasks) and names the async call to await instead.
//!
//! # Where the rest lives
//!
//! - [`tp`]: which KV heads each tensor-parallel rank sends to each other rank, as block copies.
//! - [`cuda`]: GPUs, contexts, device buffers and a stream that waits on a [`Batch::signal`],
//!   all safe to call.
//! - [`metadata`]: where engines publish their descriptors (peer to peer by default, etcd,
//!   redis, in memory); [`auth`]: the shared secret.
//! - [`probe`]: what `ferry probe` reports: the machine (with its FABRIC-handle and RDMA
//!   probes), and the path to a peer's buffers.
//! - [`transport`]: for authors of transports and tools: the [`transport::Transport`] trait,
//!   the ops a transport receives, and the descriptor's parts.
#![forbid(unsafe_code)]

pub mod cuda;
mod links;
pub mod probe;
pub mod tp;

pub use ferry_core::telemetry;
/// Copies to and from an address of this process that need not be registered (Mooncake's
/// `write_bytes_to_buffer` / `read_bytes_from_buffer`), checked against its mappings.
pub use ferry_core::{read_caller_memory, write_caller_memory};
pub use ferry_core::{
    AuthFailure, Batch, BlockCopy, BlockLayout, BufferDescriptor, Completion, Direction, Engine,
    EngineBuilder, Error, FrameTags, Location, Notification, Notifications, Peer,
    ProtocolViolation, RangeError, Refusal, Region, RegionInfo, RegistrationProblem, Result, Route,
    SegmentDescriptor, Side, TcpConfig, Transfer, MAX_NOTIFICATION_BYTES,
};
pub use ferry_nvlink::{
    CopyPath, CudaMallocStaging, NvlinkConfig, CUDA_MALLOC_STAGING_ENV, STAGING_SLOTS_OTHER_GPU,
    STAGING_SLOTS_SAME_GPU,
};
#[cfg(feature = "rdma")]
pub use ferry_rdma::RdmaConfig;
pub use links::{builder, Links};

/// Shared-secret authentication of peers: the secret type and where it is read from.
pub mod auth {
    pub use ferry_core::auth::{read_secret_file, sign_descriptor, Secret, SECRET_ENV};
}

/// Metadata stores, selected by URL.
pub mod metadata {
    pub use ferry_metadata::{from_url, Error, MemoryStore, MetadataStore, PeerToPeer};
}

/// For authors of transports and tools: the seam between the engine and the links that move
/// bytes ([`Transport`](transport::Transport), [`Link`](transport::Link), the ops a transport
/// receives, the [`TransportSet`](transport::TransportSet) an engine is built with), the parts
/// of a descriptor, and the name each transport publishes its endpoint under.
pub mod transport {
    pub use ferry_core::{
        BlockOps, BlockPoolOp, Endpoint, EngineContext, Export, ExportGuard, Exported,
        HostIdentity, InstanceId, Link, Notified, Reach, RegionUse, TransferOp, TransferOps,
        TransferPart, Transport, TransportSet, DESCRIPTOR_VERSION, TCP,
    };
    pub use ferry_nvlink::{GpuExport, MNNVL, NVLINK};
    pub use ferry_rdma::RDMA;
}

#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
