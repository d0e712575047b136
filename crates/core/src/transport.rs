//! The seam between the engine and the links that move bytes.
//!
//! For every (local region, remote buffer) pair the engine asks each [`Transport`] whether it can
//! reach it and how cheaply ([`Reach`]), picks the cheapest, opens a [`Link`] to the peer through
//! it once, and hands it validated [`TransferOp`]s ([`TransferOps`]).

use crate::auth::Secret;
use crate::blocks::BlockOps;
use crate::descriptor::{BufferDescriptor, Endpoint, Export, SegmentDescriptor};
use crate::error::{Error, Result};
use crate::identity::InstanceId;
pub use crate::memory::ExportGuard;
use crate::memory::RegionInfo;
use crate::notify::InboxHandle;
pub use crate::ops::{Direction, TransferOp, TransferOps};
use std::sync::Arc;

/// What an engine tells each of its transports once, as it starts ([`Transport::attach`]).
#[derive(Debug, Clone)]
pub struct EngineContext {
    /// The engine's random identity, as its descriptor carries it.
    pub instance: InstanceId,
    /// The engine's shared secret, when it has one: every side channel a transport opens to a
    /// peer, or serves, must prove it as the control connection does ([`crate::auth`]).
    pub secret: Option<Secret>,
    /// The engine's runtime, where a transport's background work (a listener, say) runs.
    pub runtime: tokio::runtime::Handle,
    /// The engine's segment name, which notifications it sends carry as their sender.
    pub name: String,
    /// Where notifications a transport carries itself are delivered.
    pub inbox: InboxHandle,
}

/// One transport's export of a newly registered region ([`Transport::export`]).
pub struct Exported {
    /// What peers need, published in the region's [`BufferDescriptor::exports`].
    pub export: Export,
    /// Kept with the registration and dropped when it ends.
    pub guard: Option<ExportGuard>,
}

impl std::fmt::Debug for Exported {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Exported")
            .field("export", &self.export)
            .field("guard", &self.guard.is_some())
            .finish()
    }
}

/// Whether a transport can move bytes between a local region and a remote buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reach {
    /// It can; lower cost wins.
    Yes {
        /// Relative cost; TCP is 100.
        cost: u32,
    },
    /// It cannot, and why (shown to the user when nothing else can either).
    No {
        /// The reason, phrased for a log line.
        reason: String,
    },
}

/// The part of a batch one link moves: ops, or a paged block copy.
#[derive(Debug)]
pub enum TransferPart {
    /// For [`Link::transfer`].
    Ops(TransferOps),
    /// For [`Link::transfer_blocks`].
    Blocks(BlockOps),
}

/// What became of the notification handed to [`Link::transfer_notifying`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Notified {
    /// The peer's inbox took it.
    Sent,
    /// Not sent: the engine sends it the usual way.
    Left,
}

/// A way of moving bytes (TCP, NVLink, RDMA). Implementations must not block the caller.
///
/// A transport owns everything about its kind of memory access: what it publishes for a
/// registered region ([`Transport::export`]), how it reads a peer's export ([`Transport::reach`]
/// decides from it, the [`Link`] maps or uses it), and the side channels it needs. The engine
/// keeps the region table, the descriptor envelope and the scheduling of batches.
#[async_trait::async_trait]
pub trait Transport: Send + Sync + 'static {
    /// Short name shown to users, such as `tcp`.
    fn name(&self) -> &'static str;

    /// Reads a peer's descriptor each time the engine learns it (a connect, a refresh), before
    /// any of its buffers is routed: a transport checks the exports it reads and tries what
    /// only trying tells (whether a mapping opens here), so that [`Transport::reach`] answers
    /// at once. The default does nothing.
    ///
    /// # Cancel safety
    /// Must be cancel safe: the engine may drop it when the connect it belongs to is dropped.
    async fn import(&self, peer: &SegmentDescriptor) {
        let _ = peer;
    }

    /// Called once when an engine starts with this transport, on a thread inside the engine's
    /// runtime. The default does nothing.
    ///
    /// # Errors
    /// When the transport cannot serve this engine (it serves another already, say); the
    /// engine then does not start.
    fn attach(&self, engine: &EngineContext) -> Result<()> {
        let _ = engine;
        Ok(())
    }

    /// The engine this transport serves is stopping (it is being dropped): withdraw now what
    /// other processes reach this transport by, a listening socket's file say. The transport
    /// itself may be dropped later, with the engine's last task, on a thread the process does
    /// not wait for, so what is left to its `Drop` may outlive a process that exits right
    /// after. Called once, before the engine's tasks stop. The default does nothing.
    fn stop(&self) {}

    /// Describes a newly registered region for peers in other processes, or `None` when this
    /// transport does not reach such memory from elsewhere. The export is published with the
    /// region; the guard lives until the region is deregistered. The default exports nothing.
    ///
    /// # Errors
    /// When the memory is of a kind this transport should reach but cannot share (the error
    /// says what to register instead); the registration then fails.
    fn export(&self, region: &RegionInfo) -> Result<Option<Exported>> {
        let _ = region;
        Ok(None)
    }

    /// The endpoint this transport publishes in the engine's descriptor, if any.
    fn endpoint(&self) -> Option<Endpoint>;

    /// Whether this transport's link to `peer` may carry notifications on a faster path than
    /// the control transport's (shared memory between processes of one host). The engine
    /// then sends every notification to `peer` through that link ([`Link::notify`]); when
    /// the link answers [`Error::Unavailable`], which it must do before anything of the
    /// notification was sent, the engine uses the control link for `peer` from then on. The
    /// default says no.
    fn carries_notifications(&self, peer: &SegmentDescriptor) -> bool {
        let _ = peer;
        false
    }

    /// Whether this transport's links move a paged block copy faster than the same bytes as
    /// one op per block ([`Link::transfer_blocks`] computes the addresses itself). The engine
    /// then plans flat entries of block shape into block copies for it; others get the entries
    /// as ops. The default says no.
    fn prefers_blocks(&self) -> bool {
        false
    }

    /// Whether this transport can move bytes between `local` and `remote` of `peer`.
    fn reach(
        &self,
        local: &RegionInfo,
        peer: &SegmentDescriptor,
        remote: &BufferDescriptor,
    ) -> Reach;

    /// Opens a link to `peer`. Called once per peer; the engine caches the result.
    ///
    /// # Errors
    /// When the peer cannot be reached through this transport.
    ///
    /// # Cancel safety
    /// Must be cancel safe: the engine awaits it inside `Engine::connect`, whose future the
    /// caller may drop at any point, so a dropped open must leave nothing half-open behind
    /// (a connection it started closes with the future). Only a finished open is cached.
    async fn open(&self, peer: &SegmentDescriptor) -> Result<Arc<dyn Link>>;
}

/// An open path to one peer through one transport.
#[async_trait::async_trait]
pub trait Link: Send + Sync + 'static {
    /// Moves every op; resolves once all bytes are visible at their destinations. `ops`
    /// holds the regions and remote buffers its ops name by index; an implementation keeps it
    /// (or its tables) until no queued work touches those ranges any more.
    ///
    /// # Errors
    /// The first failure among the ops; the others still ran or were abandoned.
    ///
    /// # Cancel safety
    /// Not cancel safe, and the engine relies on never cancelling it: once polled, a batch
    /// awaits it to its end, also after another part of the batch failed or the transfer
    /// timeout passed (then it calls [`Link::close`] first, so that network work fails at
    /// once, and still awaits). The batch's region uses and the link's mappings are released
    /// only after it resolves, so queued GPU work never outlives the memory it reads and
    /// writes. The future is dropped unfinished only when the engine's runtime shuts down;
    /// an implementation must then still not release memory under queued GPU copies (wait
    /// for its streams in `Drop`, as `launch_all` does).
    async fn transfer(&self, ops: TransferOps) -> Result<()>;

    /// Moves a paged block copy; resolves once all bytes are visible at their destinations.
    /// No byte may move before [`BlockOps::after`] has fired. The default waits for it on the
    /// host, then turns the copy into one op per block (merged where blocks continue each
    /// other).
    ///
    /// # Errors
    /// As [`Link::transfer`].
    ///
    /// # Cancel safety
    /// As [`Link::transfer`]: the engine awaits it to its end.
    async fn transfer_blocks(&self, blocks: BlockOps) -> Result<()> {
        blocks.wait_on_host().await?;
        self.transfer(blocks.into_ops()).await
    }

    /// Moves `part` as [`Link::transfer`] or [`Link::transfer_blocks`] would and, where the
    /// link can, has the device that moves the bytes release `payload` into the peer's inbox
    /// right after the last of them, without waiting for this host to see the copies end
    /// ([`Notified::Sent`], once the peer took it). Otherwise it resolves
    /// [`Notified::Left`] once the bytes landed, and the engine sends the notification
    /// itself. The engine calls it only for a batch that goes whole through this link and has
    /// no signal, when this link carries the peer's notifications
    /// ([`Transport::carries_notifications`]). The default moves the part and leaves the
    /// notification.
    ///
    /// # Errors
    /// As [`Link::transfer`], and as [`Link::notify`] for the notification. After an error
    /// the notification was not delivered, unless the copies had all ended and the link was
    /// closed while the peer's inbox took it.
    ///
    /// # Cancel safety
    /// As [`Link::transfer`]: the engine awaits it to its end.
    async fn transfer_notifying(&self, part: TransferPart, payload: &[u8]) -> Result<Notified> {
        let _ = payload;
        match part {
            TransferPart::Ops(ops) => self.transfer(ops).await?,
            TransferPart::Blocks(blocks) => self.transfer_blocks(blocks).await?,
        }
        Ok(Notified::Left)
    }

    /// Writes the 32-bit `value` to the peer's `addr` (4-byte aligned, inside `remote`) from
    /// GPU `gpu` of this process, so the peer's GPU can wait for it; the engine calls it only
    /// after every byte of the batch it belongs to is visible at the peer. Transports that
    /// cannot write into a peer GPU's memory directly keep the default, which refuses.
    ///
    /// # Errors
    /// [`Error::Unavailable`] from the default; the transport's error otherwise.
    ///
    /// # Cancel safety
    /// As [`Link::transfer`]: the engine awaits it to its end, also after the transfer
    /// timeout passed (it closes the link first), so a queued store finishes before its
    /// mapping is released.
    async fn write_value(
        &self,
        remote: Arc<BufferDescriptor>,
        addr: u64,
        value: u32,
        gpu: u32,
    ) -> Result<()> {
        let _ = (remote, value, gpu);
        Err(Error::Unavailable {
            local: "a GPU signal".into(),
            peer: format!("the buffer holding {addr:#x}"),
            reason: "this transport cannot write into a peer GPU's memory; signal over nvlink, or rely on the batch's notification".into(),
        })
    }

    /// Hands `payload` to the peer's inbox as a notification. The engine calls it once the data
    /// of the batch it belongs to is visible at the peer. Notifications arrive in the order
    /// their `notify` futures were first polled. [`Error::Unavailable`] says the link cannot
    /// carry it, and must come before anything of it was sent and only once nothing this link
    /// sent before can still arrive, since the engine then sends it another way. The engine
    /// sends notifications over its control transport's link, or the link of a transport that
    /// carries them itself ([`Transport::carries_notifications`]); transports that cannot
    /// carry them keep the default, which refuses.
    ///
    /// # Errors
    /// [`Error::Unavailable`] from the default; the transport's error otherwise.
    ///
    /// # Cancel safety
    /// Must be cancel safe: the engine drops it when the transfer timeout passes and reports
    /// [`Error::Timeout`]. A dropped notify may or may not have reached the peer, but must
    /// leave the link either usable for the next frame or closed, never with part of a
    /// frame sent. It touches no registered memory.
    async fn notify(&self, payload: &[u8]) -> Result<()> {
        Err(Error::Unavailable {
            local: format!("a notification of {} bytes", payload.len()),
            peer: "this link".into(),
            reason: "this transport does not carry notifications; the engine sends them over its control transport".into(),
        })
    }

    /// False once the link has failed; the engine then opens a new one.
    fn is_alive(&self) -> bool;

    /// Fails everything in flight and closes the link; used when a transfer timed out.
    fn close(&self);
}
