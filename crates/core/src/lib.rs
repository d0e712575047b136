//! ferry-core: the engine, memory registration, engine descriptors, the wire protocol, the TCP
//! transport and the CUDA layer of ferry.
//!
//! Most users want the `ferry` crate, which re-exports this one and starts engines with every
//! transport of its build (`ferry::builder()`). The model:
//!
//! 1. **Build** an [`Engine`] with an [`EngineBuilder`] and the [`TransportSet`] it gets
//!    besides TCP; [`TcpOnly`] adds none.
//! 2. **Register** memory with an [`Engine`]: [`Engine::register`] for memory you already have,
//!    [`Engine::allocate`] for a fresh host buffer. Each registration becomes a [`Region`]
//!    and is listed in the engine's [`SegmentDescriptor`].
//! 3. **Connect** to a peer by name ([`Engine::connect`]); by default the name is the peer's
//!    `host:port`, and its descriptor is fetched from its own listener ([`PeerToPeer`]).
//! 4. **Batch** reads and writes ([`Engine::batch`]), optionally with a notification that the
//!    peer receives only after the data is visible ([`Engine::notifications`]).
//! 5. **Complete**: the [`Transfer`] future resolves when every byte has landed, or fails with
//!    an [`Error`] that says what to do. Ranges are checked on both sides before bytes move.
//!
//! ```
//! # fn main() -> Result<(), ferry_core::Error> {
//! use ferry_core::{EngineBuilder, TcpOnly};
//!
//! let decode = EngineBuilder::new(TcpOnly).build_blocking()?;
//! let kv = decode.allocate(1 << 20)?;
//! let mut inbox = decode.notifications()?;
//!
//! let prefill = EngineBuilder::new(TcpOnly).build_blocking()?;
//! let source = prefill.allocate(1 << 20)?;
//! source.write_at(0, &[7u8; 4096])?;
//! let peer = prefill.connect_blocking(decode.name())?;
//! let remote = peer.buffers()[0].addr;
//! prefill.batch(&peer).write(&source, 0, remote, 4096).notify(b"req-1".to_vec()).submit_blocking()?;
//!
//! let note = inbox.recv_blocking()?.expect("engine alive");
//! assert_eq!(note.payload, b"req-1");
//! let mut landed = [0u8; 4096];
//! kv.read_at(0, &mut landed)?;
//! assert_eq!(landed, [7u8; 4096]);
//! # Ok(()) }
//! ```

pub mod auth;
mod batch;
mod blocking;
mod blocks;
#[doc(hidden)]
pub mod corpus;
pub mod cuda;
mod descriptor;
mod engine;
mod error;
#[cfg(any(test, fuzzing))]
#[doc(hidden)]
pub mod fuzzing;
mod identity;
mod local;
mod memory;
mod metadata;
mod notify;
mod ops;
mod peer;
mod proto;
mod route;
mod task;
mod tcp;
pub mod telemetry;
mod transport;
pub mod wire;

pub use auth::Secret;
pub use batch::{Batch, Completion, Transfer};
pub use blocks::{BlockCopy, BlockLayout, BlockOps, BlockPoolOp};
pub use descriptor::{
    BufferDescriptor, Endpoint, Export, HostIdentity, SegmentDescriptor, DESCRIPTOR_VERSION,
};
pub use engine::{Engine, EngineBuilder, TcpOnly, TransportSet};
pub use error::{
    AuthFailure, Error, ProtocolViolation, RangeError, Refusal, RegistrationProblem, Result, Side,
};
pub use identity::InstanceId;
pub use local::{is_local_engine, local_engine_registered};
pub use memory::{
    read_caller_memory, write_caller_memory, Location, Region, RegionInfo, RegionUse,
};
pub use metadata::{MetadataStore, PeerToPeer};
pub use notify::{
    InboxHandle, InboxRefusal, Notification, Notifications, Reserved, MAX_NOTIFICATION_BYTES,
};
pub use peer::Peer;
pub use route::Route;
pub use tcp::{FrameTags, TcpConfig, TCP};
pub use transport::{
    Direction, EngineContext, ExportGuard, Exported, Link, Notified, Reach, TransferOp,
    TransferOps, TransferPart, Transport,
};
