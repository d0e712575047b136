//! The vocabulary transfers are made of, below the transports and the block copies that both
//! speak it: which way an op goes, one validated op, and the ops of one transfer with the
//! registrations they name.

use crate::descriptor::BufferDescriptor;
use crate::memory::RegionUse;
use std::sync::Arc;

/// Direction of one operation, seen from the initiator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Direction {
    /// Local bytes go to the peer.
    Write,
    /// Peer bytes come here.
    Read,
}

/// One validated, contiguous piece of a batch: both ranges were checked against registrations.
///
/// The op names its local region and remote buffer by index into the tables of the
/// [`TransferOps`] that holds it ([`TransferOps::region`], [`TransferOps::remote`]), so building
/// and handing over an op touches no reference count.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct TransferOp {
    /// Which way the bytes go.
    pub direction: Direction,
    /// Index of the local region in [`TransferOps::regions`].
    pub region: u32,
    /// First local byte.
    pub local_addr: u64,
    /// First remote byte.
    pub remote_addr: u64,
    /// Index of the peer's buffer holding the remote range in [`TransferOps::remotes`].
    pub remote: u32,
    /// Bytes to move.
    pub len: u64,
}

impl std::fmt::Debug for TransferOp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransferOp")
            .field("direction", &self.direction)
            .field("region", &self.region)
            .field("local_addr", &format_args!("{:#x}", self.local_addr))
            .field("remote_addr", &format_args!("{:#x}", self.remote_addr))
            .field("remote", &self.remote)
            .field("len", &self.len)
            .finish()
    }
}

/// The ops of one transfer with the registrations they name, as
/// [`crate::transport::Link::transfer`] receives them.
///
/// The tables keep every local region registered and every remote buffer's descriptor alive
/// until this value is dropped; every op's indices are inside them.
#[derive(Clone)]
pub struct TransferOps {
    regions: Arc<[Arc<RegionUse>]>,
    remotes: Arc<[Arc<BufferDescriptor>]>,
    ops: Vec<TransferOp>,
}

impl TransferOps {
    /// No ops yet, over the given tables.
    pub(crate) fn new(
        regions: Arc<[Arc<RegionUse>]>,
        remotes: Arc<[Arc<BufferDescriptor>]>,
        capacity: usize,
    ) -> Self {
        TransferOps {
            regions,
            remotes,
            ops: Vec::with_capacity(capacity),
        }
    }

    /// Appends `op`, or lengthens the last op instead when `op` continues it on both sides
    /// (same direction, local region and peer buffer), so the two move as one.
    ///
    /// The caller passes indices inside the tables.
    pub(crate) fn push_merged(&mut self, op: TransferOp) {
        debug_assert!((op.region as usize) < self.regions.len());
        debug_assert!((op.remote as usize) < self.remotes.len());
        if let Some(last) = self.ops.last_mut() {
            if last.direction == op.direction
                && last.region == op.region
                && last.remote == op.remote
                && last.local_addr + last.len == op.local_addr
                && last.remote_addr + last.len == op.remote_addr
            {
                last.len += op.len;
                return;
            }
        }
        self.ops.push(op);
    }

    /// Reserves room for at least `additional` more ops.
    pub(crate) fn reserve_exact(&mut self, additional: usize) {
        self.ops.reserve_exact(additional);
    }

    /// Room for ops without reallocating.
    pub(crate) fn capacity(&self) -> usize {
        self.ops.capacity()
    }

    /// The ops, in batch order.
    pub fn ops(&self) -> &[TransferOp] {
        &self.ops
    }

    /// Iterates over the ops, in batch order.
    pub fn iter(&self) -> std::slice::Iter<'_, TransferOp> {
        self.ops.iter()
    }

    /// Number of ops.
    pub fn len(&self) -> usize {
        self.ops.len()
    }

    /// Whether there are no ops.
    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    /// The local regions the ops name by index.
    pub fn regions(&self) -> &[Arc<RegionUse>] {
        &self.regions
    }

    /// The peer's buffers the ops name by index.
    pub fn remotes(&self) -> &[Arc<BufferDescriptor>] {
        &self.remotes
    }

    /// The local region `op` reads or writes.
    ///
    /// # Panics
    /// When `op` is not one of these ops' (its index is outside the table).
    pub fn region(&self, op: &TransferOp) -> &Arc<RegionUse> {
        &self.regions[op.region as usize]
    }

    /// The peer's buffer holding `op`'s remote range, with how to map it.
    ///
    /// # Panics
    /// When `op` is not one of these ops' (its index is outside the table).
    pub fn remote(&self, op: &TransferOp) -> &Arc<BufferDescriptor> {
        &self.remotes[op.remote as usize]
    }
}

impl<'a> IntoIterator for &'a TransferOps {
    type Item = &'a TransferOp;
    type IntoIter = std::slice::Iter<'a, TransferOp>;

    fn into_iter(self) -> Self::IntoIter {
        self.ops.iter()
    }
}

impl std::fmt::Debug for TransferOps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransferOps")
            .field("regions", &self.regions.len())
            .field("remotes", &self.remotes.len())
            .field("ops", &self.ops)
            .finish()
    }
}
