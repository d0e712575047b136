//! The seam between the engine and the links that move bytes.
//!
//! For every (local region, remote buffer) pair the engine asks each [`Transport`] whether it can
//! reach it and how cheaply ([`Reach`]), picks the cheapest, opens a [`Link`] to the peer through
//! it once, and hands it validated [`TransferOp`]s.

use crate::blocks::BlockOps;
use crate::descriptor::{BufferDescriptor, Endpoint, SegmentDescriptor};
use crate::error::{Error, Result};
use crate::memory::{RegionInfo, RegionUse};
use std::sync::Arc;

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

/// Direction of one operation, seen from the initiator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// Local bytes go to the peer.
    Write,
    /// Peer bytes come here.
    Read,
}

/// One validated, contiguous piece of a batch: both ranges were checked against registrations.
pub struct TransferOp {
    /// Which way the bytes go.
    pub direction: Direction,
    /// Keeps the local region registered until the op is dropped.
    pub region: Arc<RegionUse>,
    /// First local byte.
    pub local_addr: u64,
    /// First remote byte.
    pub remote_addr: u64,
    /// The peer's buffer holding the remote range, with how to map it.
    pub remote: Arc<BufferDescriptor>,
    /// Bytes to move.
    pub len: u64,
}

impl TransferOp {
    /// Appends `op` to `ops`, or lengthens the last op instead when `op` continues it on both
    /// sides (same direction, local registration and peer buffer), so the two move as one.
    pub(crate) fn push_merged(ops: &mut Vec<TransferOp>, op: TransferOp) {
        if let Some(last) = ops.last_mut() {
            if last.direction == op.direction
                && Arc::ptr_eq(&last.region, &op.region)
                && Arc::ptr_eq(&last.remote, &op.remote)
                && last.local_addr + last.len == op.local_addr
                && last.remote_addr + last.len == op.remote_addr
            {
                last.len += op.len;
                return;
            }
        }
        ops.push(op);
    }
}

impl std::fmt::Debug for TransferOp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransferOp")
            .field("direction", &self.direction)
            .field("local_addr", &format_args!("{:#x}", self.local_addr))
            .field("remote_addr", &format_args!("{:#x}", self.remote_addr))
            .field("len", &self.len)
            .finish()
    }
}

/// A way of moving bytes (TCP, NVLink, RDMA). Implementations must not block the caller.
#[async_trait::async_trait]
pub trait Transport: Send + Sync + 'static {
    /// Short name shown to users, such as `tcp`.
    fn name(&self) -> &'static str;

    /// The endpoint this transport publishes in the engine's descriptor, if any.
    fn endpoint(&self) -> Option<Endpoint>;

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
    async fn open(&self, peer: &SegmentDescriptor) -> Result<Arc<dyn Link>>;
}

/// An open path to one peer through one transport.
#[async_trait::async_trait]
pub trait Link: Send + Sync + 'static {
    /// Moves every op; resolves once all bytes are visible at their destinations.
    ///
    /// # Errors
    /// The first failure among the ops; the others still ran or were abandoned.
    async fn transfer(&self, ops: Vec<TransferOp>) -> Result<()>;

    /// Moves a paged block copy; resolves once all bytes are visible at their destinations.
    /// The default turns it into one op per block (merged where blocks continue each other).
    ///
    /// # Errors
    /// As [`Link::transfer`].
    async fn transfer_blocks(&self, blocks: BlockOps) -> Result<()> {
        self.transfer(blocks.into_ops()).await
    }

    /// Writes the 32-bit `value` to the peer's `addr` (4-byte aligned, inside `remote`) from
    /// GPU `gpu` of this process, so the peer's GPU can wait for it; the engine calls it only
    /// after every byte of the batch it belongs to is visible at the peer. Transports that
    /// cannot write into a peer GPU's memory directly keep the default, which refuses.
    ///
    /// # Errors
    /// [`Error::Unavailable`] from the default; the transport's error otherwise.
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

    /// False once the link has failed; the engine then opens a new one.
    fn is_alive(&self) -> bool;

    /// Fails everything in flight and closes the link; used when a transfer timed out.
    fn close(&self);
}
