//! The objects [`SidewayVerbs`](super::SidewayVerbs) hands out: RAII wrappers around sideway's
//! reference-counted verbs objects.
//!
//! Dropping a wrapper releases its object; what other objects still use stays alive through
//! sideway's own `Arc`s (a QP holds its PD and CQs, an MR its PD, a PD and a CQ their device
//! context), so objects are destroyed in the order verbs requires (QP before its CQs, MRs before
//! their PD, everything before the context) whatever order the caller drops them in.
//!
//! sideway's `Drop` of a QP and of a CQ asserts that `ibv_destroy_qp` / `ibv_destroy_cq`
//! succeeded (so a failure there panics inside sideway); the reference ordering above is what
//! keeps those calls from failing (`ibv_destroy_cq` refuses a CQ a QP still uses). sideway
//! ignores the result of `ibv_dereg_mr`, `ibv_dealloc_pd` and `ibv_close_device`.

use std::collections::VecDeque;
use std::fmt;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use ::sideway::ibverbs::completion::BasicCompletionQueue;
use ::sideway::ibverbs::device_context::DeviceContext;
use ::sideway::ibverbs::memory_region::MemoryRegion;
use ::sideway::ibverbs::protection_domain::ProtectionDomain;
use ::sideway::ibverbs::queue_pair::BasicQueuePair;
use parking_lot::Mutex;

use crate::qp::QpCaps;
use crate::work::WorkCompletion;

/// An open RDMA device (`ibv_context`), from [`Verbs::open`](crate::Verbs::open).
pub struct SidewayContext {
    pub(super) name: String,
    pub(super) inner: Arc<DeviceContext>,
}

/// A protection domain (`ibv_pd`), from [`Verbs::alloc_pd`](crate::Verbs::alloc_pd).
pub struct SidewayPd {
    pub(super) device: String,
    /// The context it was allocated on, to refuse CQs of another device.
    pub(super) context: Arc<DeviceContext>,
    pub(super) inner: Arc<ProtectionDomain>,
}

/// A registered memory region (`ibv_mr`), from [`Verbs::reg_mr`](crate::Verbs::reg_mr) or
/// [`Verbs::reg_dmabuf_mr`](crate::Verbs::reg_dmabuf_mr). Dropping it deregisters the region.
pub struct SidewayMr {
    pub(super) inner: Arc<MemoryRegion>,
}

/// A completion queue (`ibv_cq`), from [`Verbs::create_cq`](crate::Verbs::create_cq).
///
/// It serves one QP for its whole life: sideway's work completions do not carry the QP number
/// (no `qp_num` accessor), so the number [`WorkCompletion::qp_num`] reports is the one of the
/// QP this CQ was given to in [`Verbs::create_qp`](crate::Verbs::create_qp) (as its send CQ,
/// its receive CQ or both). A second QP is refused rather than mislabelled.
pub struct SidewayCq {
    pub(super) device: String,
    pub(super) context: Arc<DeviceContext>,
    pub(super) inner: Arc<BasicCompletionQueue>,
    /// [`NO_QP`], [`CLAIMED`] while `create_qp` runs, then the QP's number (24 bits).
    owner: AtomicU32,
    /// Completions `ibv_poll_cq` took off the queue beyond what the caller asked for: a basic
    /// CQ is polled in batches, and the next `poll_cq` returns these first. The lock also keeps
    /// to one poller per CQ at a time, as sideway requires.
    pub(super) backlog: Mutex<VecDeque<WorkCompletion>>,
}

const NO_QP: u32 = u32::MAX;
const CLAIMED: u32 = u32::MAX - 1;

impl SidewayCq {
    pub(super) fn new(
        device: String,
        context: Arc<DeviceContext>,
        inner: Arc<BasicCompletionQueue>,
    ) -> Self {
        SidewayCq {
            device,
            context,
            inner,
            owner: AtomicU32::new(NO_QP),
            backlog: Mutex::new(VecDeque::new()),
        }
    }

    /// Reserves the CQ for a QP being created; false when another QP has it.
    pub(super) fn claim(&self) -> bool {
        self.owner
            .compare_exchange(NO_QP, CLAIMED, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    /// Gives back a reservation whose QP could not be created.
    pub(super) fn release(&self) {
        self.owner.store(NO_QP, Ordering::Release);
    }

    /// Records the QP a reservation was for.
    pub(super) fn bind(&self, qpn: u32) {
        self.owner.store(qpn, Ordering::Release);
    }

    /// The number of the QP this CQ serves; 0 before it serves one (it then has no
    /// completions to report).
    pub(super) fn qp_num(&self) -> u32 {
        match self.owner.load(Ordering::Acquire) {
            NO_QP | CLAIMED => 0,
            qpn => qpn,
        }
    }
}

/// A reliable-connected queue pair (`ibv_qp`), from
/// [`Verbs::create_qp`](crate::Verbs::create_qp). Dropping it destroys the QP.
pub struct SidewayQp {
    pub(super) device: String,
    pub(super) qpn: u32,
    pub(super) caps: QpCaps,
    /// sideway's `modify` and posting take `&mut self`; the lock also orders posts from several
    /// threads as one `ibv_post_send` each.
    pub(super) inner: Mutex<QpInner>,
}

pub(super) struct QpInner {
    pub(super) qp: BasicQueuePair,
    /// The port set by the INIT transition; the RTR address vector names it again.
    pub(super) port: u8,
}

impl fmt::Debug for SidewayContext {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter
            .debug_struct("SidewayContext")
            .field("device", &self.name)
            .finish_non_exhaustive()
    }
}

impl fmt::Debug for SidewayPd {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter
            .debug_struct("SidewayPd")
            .field("device", &self.device)
            .finish_non_exhaustive()
    }
}

impl fmt::Debug for SidewayMr {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter
            .debug_struct("SidewayMr")
            .field("addr", &format_args!("{:#x}", self.inner.get_ptr()))
            .field("len", &self.inner.region_len())
            .field("lkey", &self.inner.lkey())
            .field("rkey", &self.inner.rkey())
            .finish()
    }
}

impl fmt::Debug for SidewayCq {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter
            .debug_struct("SidewayCq")
            .field("device", &self.device)
            .field("qp_num", &self.qp_num())
            .finish_non_exhaustive()
    }
}

impl fmt::Debug for SidewayQp {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter
            .debug_struct("SidewayQp")
            .field("device", &self.device)
            .field("qpn", &self.qpn)
            .field("caps", &self.caps)
            .finish_non_exhaustive()
    }
}
