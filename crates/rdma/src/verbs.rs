//! The seam between the transport and ibverbs.

use crate::device::DeviceInfo;
use crate::error::VerbsError;
use crate::memory::{AccessFlags, MrKeys};
use crate::qp::{QpCaps, QpState, QpTransition};
use crate::work::{RecvRequest, SendRequest, WorkCompletion};
use std::os::fd::BorrowedFd;

/// The ibverbs calls the RDMA transport makes, and nothing more.
///
/// The sideway layer implements it over rdma-core; the in-memory model (`model`, for tests)
/// implements it with byte buffers in one process. The associated types are the objects verbs
/// hands out; the sideway layer's are RAII wrappers (dropping one destroys the object), the
/// model's are plain handles.
///
/// Call order, as for real verbs: [`devices`](Self::devices) -> [`open`](Self::open) ->
/// [`alloc_pd`](Self::alloc_pd) -> [`reg_mr`](Self::reg_mr) and
/// [`create_cq`](Self::create_cq) -> [`create_qp`](Self::create_qp) ->
/// [`modify_qp`](Self::modify_qp) through INIT, RTR (with the peer's
/// [`QpEndpoint`](crate::QpEndpoint)) and RTS -> [`post_send`](Self::post_send) /
/// [`post_recv`](Self::post_recv) -> [`poll_cq`](Self::poll_cq).
///
/// Calls that are refused return a [`VerbsError`] and change nothing; work that fails after
/// being posted completes with an error [`WcStatus`](crate::WcStatus) and moves its QP to
/// [`QpState::Error`].
pub trait Verbs: Send + Sync {
    /// An open device (`ibv_context`).
    type Context: Send + Sync;
    /// A protection domain (`ibv_pd`): regions and QPs of one domain may be used together.
    type ProtectionDomain: Send + Sync;
    /// A registered memory region (`ibv_mr`).
    type MemoryRegion: Send + Sync;
    /// A completion queue (`ibv_cq`).
    type CompletionQueue: Send + Sync;
    /// A reliable-connected queue pair (`ibv_qp` of type `IBV_QPT_RC`).
    type QueuePair: Send + Sync;

    /// The RDMA devices of this host, their ports and GID tables.
    ///
    /// # Errors
    /// [`VerbsError::DeviceGone`] when the device list cannot be read.
    fn devices(&self) -> Result<Vec<DeviceInfo>, VerbsError>;

    /// Opens the device named `name`.
    ///
    /// # Errors
    /// [`VerbsError::NoSuchDevice`], [`VerbsError::DeviceGone`].
    fn open(&self, name: &str) -> Result<Self::Context, VerbsError>;

    /// Allocates a protection domain on the device.
    ///
    /// # Errors
    /// [`VerbsError::DeviceGone`].
    fn alloc_pd(&self, context: &Self::Context) -> Result<Self::ProtectionDomain, VerbsError>;

    /// Registers `len` bytes at `addr` with `access`; the keys come from
    /// [`mr_keys`](Self::mr_keys).
    ///
    /// # Errors
    /// [`VerbsError::InvalidAccess`] (REMOTE_WRITE without LOCAL_WRITE),
    /// [`VerbsError::BadAddress`] (the range is not mapped memory), [`VerbsError::InvalidSize`]
    /// (zero length).
    fn reg_mr(
        &self,
        pd: &Self::ProtectionDomain,
        addr: u64,
        len: u64,
        access: AccessFlags,
    ) -> Result<Self::MemoryRegion, VerbsError>;

    /// Registers `len` bytes of the dma-buf `dmabuf` from `offset` (GPU memory a driver
    /// exported, such as CUDA's `cuMemGetHandleForAddressRange`), addressed by peers and in
    /// SG entries as the range starting at `iova` (ferry passes the memory's own virtual
    /// address, so host and GPU regions are addressed alike). The dma-buf may be closed after.
    ///
    /// # Errors
    /// As [`reg_mr`](Self::reg_mr); [`VerbsError::Unsupported`] when the device or the
    /// installed rdma-core cannot import dma-bufs (rdma-core before v34, no kernel support).
    fn reg_dmabuf_mr(
        &self,
        pd: &Self::ProtectionDomain,
        dmabuf: BorrowedFd<'_>,
        offset: u64,
        len: u64,
        iova: u64,
        access: AccessFlags,
    ) -> Result<Self::MemoryRegion, VerbsError>;

    /// The lkey and rkey of a registered region.
    fn mr_keys(&self, mr: &Self::MemoryRegion) -> MrKeys;

    /// Deregisters a region: peers' rkeys for it stop working.
    ///
    /// # Errors
    /// [`VerbsError::StaleHandle`] when it was already deregistered.
    fn dereg_mr(&self, mr: Self::MemoryRegion) -> Result<(), VerbsError>;

    /// Creates a completion queue with room for `capacity` completions.
    ///
    /// # Errors
    /// [`VerbsError::InvalidSize`] for a zero capacity, [`VerbsError::DeviceGone`].
    fn create_cq(
        &self,
        context: &Self::Context,
        capacity: u32,
    ) -> Result<Self::CompletionQueue, VerbsError>;

    /// Creates an RC queue pair in [`QpState::Reset`].
    ///
    /// # Errors
    /// [`VerbsError::ForeignHandle`] when the CQs belong to another device,
    /// [`VerbsError::InvalidSize`] for zero capacities.
    fn create_qp(
        &self,
        pd: &Self::ProtectionDomain,
        send_cq: &Self::CompletionQueue,
        recv_cq: &Self::CompletionQueue,
        caps: QpCaps,
    ) -> Result<Self::QueuePair, VerbsError>;

    /// Destroys a QP: its outstanding work is dropped without completions, and the peer's
    /// requests to it fail with retries exceeded.
    ///
    /// # Errors
    /// [`VerbsError::StaleHandle`] when it was destroyed already.
    fn destroy_qp(&self, qp: Self::QueuePair) -> Result<(), VerbsError>;

    /// The QP's number, what the peer's `dest_qpn` names.
    fn qp_num(&self, qp: &Self::QueuePair) -> u32;

    /// The QP's current state (`ibv_query_qp`); it reads [`QpState::Error`] after a failed
    /// work request.
    ///
    /// # Errors
    /// [`VerbsError::DeviceGone`], [`VerbsError::StaleHandle`].
    fn qp_state(&self, qp: &Self::QueuePair) -> Result<QpState, VerbsError>;

    /// Moves the QP to another state with the attributes that move needs.
    ///
    /// # Errors
    /// [`VerbsError::InvalidTransition`], [`VerbsError::InvalidAttribute`] (a port that does
    /// not exist, a path MTU above the port's, RoCE without a global route, a GID index not in
    /// the table, retry counts above 7).
    fn modify_qp(&self, qp: &Self::QueuePair, transition: &QpTransition) -> Result<(), VerbsError>;

    /// Posts send work requests, in order. All or nothing: when one is refused, none is posted.
    ///
    /// # Errors
    /// [`VerbsError::QpNotReady`] (the QP is in RESET, INIT or RTR; a QP in ERROR takes them
    /// and flushes them), [`VerbsError::TooManySge`], [`VerbsError::QueueFull`].
    fn post_send(&self, qp: &Self::QueuePair, requests: &[SendRequest]) -> Result<(), VerbsError>;

    /// Posts receive work requests, in order. All or nothing.
    ///
    /// # Errors
    /// [`VerbsError::QpNotReady`] (the QP is in RESET), [`VerbsError::TooManySge`],
    /// [`VerbsError::QueueFull`].
    fn post_recv(&self, qp: &Self::QueuePair, requests: &[RecvRequest]) -> Result<(), VerbsError>;

    /// Moves up to `max` completions from the CQ to the end of `out`; returns how many.
    ///
    /// # Errors
    /// [`VerbsError::CqOverrun`] when completions were lost.
    fn poll_cq(
        &self,
        cq: &Self::CompletionQueue,
        max: usize,
        out: &mut Vec<WorkCompletion>,
    ) -> Result<usize, VerbsError>;
}
