//! [`Verbs`] over rdma-core, through sideway 0.4.3 (feature `sideway`).
//!
//! This layer is the FFI fence of ferry-rdma: its `unsafe` blocks (memory registration, the
//! SG entries of work requests, one read of a QP's cached state) each carry a `// SAFETY:`
//! comment, and nothing above it sees a raw verbs object.
//!
//! Design:
//! - **RAII objects.** [`SidewayContext`], [`SidewayPd`], [`SidewayMr`], [`SidewayCq`] and
//!   [`SidewayQp`] wrap sideway's reference-counted objects; dropping one releases it, and
//!   sideway's internal references keep the release order verbs needs.
//!   `dereg_mr` and `destroy_qp` are drops, so they never see a stale handle.
//! - **One CQ per QP.** sideway's completions lack the QP number, so a CQ is bound to the one
//!   QP created with it ([`SidewayCq`]); [`WorkCompletion::qp_num`](crate::WorkCompletion::qp_num)
//!   is that QP's number. A second QP on the same CQ is refused with
//!   [`VerbsError::Unsupported`].
//! - **Raw values, no panicking conversions.** Port attributes, completion statuses and
//!   opcodes and QP states are read as raw verbs numbers and mapped here; an unknown
//!   value becomes an error (a port left out of [`devices`](Verbs::devices), a QP state
//!   `qp_state` cannot name) or [`WcStatus::GeneralError`](crate::WcStatus::GeneralError).
//!   sideway still converts internally in two places this layer cannot avoid: `modify` reads
//!   the QP's cached state through its conversion when verbs answers `EINVAL` (libibverbs only
//!   stores the kernel's eight states there), and `Drop` of a QP or CQ asserts success.
//! - **Basic verbs.** `ibv_create_cq` and `ibv_create_qp` with `ibv_post_send`, which every
//!   provider has; a list of work requests is posted as one chain, so a refusal part-way
//!   leaves the earlier ones posted (see [`SidewayVerbs`]'s `post_send`).
//! - **Unavailable is an answer.** rdma-core is loaded at run time: without it, without kernel
//!   support or without devices, [`SidewayVerbs::new`] returns
//!   [`VerbsError::Unsupported`] saying what is missing, and ferry keeps using TCP.
//!
//! Nothing here has run on RDMA hardware: it compiles against sideway and its mappings are
//! unit-tested; the transport's behaviour is tested against the in-memory model.

mod completion;
mod devices;
mod failure;
mod handles;
mod memory;
mod post;
mod queue_pair;
mod raw;
#[cfg(test)]
mod tests;

use std::os::fd::BorrowedFd;

pub use self::handles::{SidewayContext, SidewayCq, SidewayMr, SidewayPd, SidewayQp};
use crate::device::DeviceInfo;
use crate::error::VerbsError;
use crate::memory::{AccessFlags, MrKeys};
use crate::probe::RdmaUnavailable;
use crate::qp::{QpCaps, QpState, QpTransition};
use crate::verbs::Verbs;
use crate::work::{RecvRequest, SendRequest, WorkCompletion};

/// The RDMA devices of this host, through rdma-core.
///
/// Created only where rdma-core lists at least one device; every verbs object it hands out is
/// an RAII wrapper. See the module documentation for how it differs from the in-memory model
/// (one CQ per QP; posting is not all or nothing when the provider refuses part-way).
#[derive(Debug, Clone)]
pub struct SidewayVerbs {
    _checked: (),
}

impl SidewayVerbs {
    /// Loads rdma-core and checks that it lists a device.
    ///
    /// # Errors
    /// [`VerbsError::Unsupported`] with `what` "RDMA" when rdma-core's libibverbs is not
    /// installed, the kernel offers no RDMA (no `ib_uverbs`, or a container without
    /// `/dev/infiniband`) or no device is listed; its `reason` says which and what to install
    /// or load. [`VerbsError::Failed`] when listing fails otherwise.
    pub fn new() -> Result<Self, VerbsError> {
        devices::list()?;
        Ok(SidewayVerbs { _checked: () })
    }
}

/// The devices, or why RDMA cannot be used here, for `ferry probe`: the reason of an
/// unavailable host (what is missing and what provides it) alone, any other error in full.
pub(crate) fn devices_or_reason() -> Result<Vec<DeviceInfo>, RdmaUnavailable> {
    SidewayVerbs::new()
        .and_then(|verbs| verbs.devices())
        .map_err(|error| match error {
            VerbsError::Unsupported { what, reason } if what == failure::RDMA => {
                RdmaUnavailable::Missing { reason }
            }
            other => RdmaUnavailable::Verbs(other),
        })
}

impl Verbs for SidewayVerbs {
    type Context = SidewayContext;
    type ProtectionDomain = SidewayPd;
    type MemoryRegion = SidewayMr;
    type CompletionQueue = SidewayCq;
    type QueuePair = SidewayQp;

    /// Every device with its ports and GID tables. A port reporting a state, link layer or MTU
    /// verbs does not define is left out, with a warning.
    ///
    /// # Errors
    /// As [`SidewayVerbs::new`] (the devices may have gone since); [`VerbsError::Failed`] when
    /// a device cannot be opened or queried.
    fn devices(&self) -> Result<Vec<DeviceInfo>, VerbsError> {
        devices::describe_all()
    }

    fn open(&self, name: &str) -> Result<SidewayContext, VerbsError> {
        Ok(SidewayContext {
            name: name.to_owned(),
            inner: devices::open(name)?,
        })
    }

    fn alloc_pd(&self, context: &SidewayContext) -> Result<SidewayPd, VerbsError> {
        let inner = context.inner.alloc_pd().map_err(|error| match &error.0 {
            ::sideway::ibverbs::device_context::AllocateProtectionDomainErrorKind::Ibverbs(io) => {
                failure::os("ibv_alloc_pd", &context.name, io)
            }
            _ => failure::failed("ibv_alloc_pd", &error),
        })?;
        Ok(SidewayPd {
            device: context.name.clone(),
            context: std::sync::Arc::clone(&context.inner),
            inner,
        })
    }

    /// Registers host memory (`ibv_reg_mr`). `ENOMEM` usually means the locked-memory limit is
    /// too low; the error says how to raise it.
    fn reg_mr(
        &self,
        pd: &SidewayPd,
        addr: u64,
        len: u64,
        access: AccessFlags,
    ) -> Result<SidewayMr, VerbsError> {
        memory::register(pd, addr, len, access)
    }

    fn reg_dmabuf_mr(
        &self,
        pd: &SidewayPd,
        dmabuf: BorrowedFd<'_>,
        offset: u64,
        len: u64,
        iova: u64,
        access: AccessFlags,
    ) -> Result<SidewayMr, VerbsError> {
        memory::register_dmabuf(pd, dmabuf, offset, len, iova, access)
    }

    fn mr_keys(&self, mr: &SidewayMr) -> MrKeys {
        MrKeys {
            lkey: mr.inner.lkey(),
            rkey: mr.inner.rkey(),
        }
    }

    /// Drops the region, which deregisters it; never fails (sideway does not report
    /// `ibv_dereg_mr`'s result).
    fn dereg_mr(&self, mr: SidewayMr) -> Result<(), VerbsError> {
        drop(mr);
        Ok(())
    }

    fn create_cq(&self, context: &SidewayContext, capacity: u32) -> Result<SidewayCq, VerbsError> {
        completion::create(context, capacity)
    }

    /// Creates the QP and binds `send_cq` and `recv_cq` to it for their life (see
    /// [`SidewayCq`]).
    ///
    /// # Errors
    /// As the trait says; [`VerbsError::Unsupported`] when a CQ already serves another QP.
    fn create_qp(
        &self,
        pd: &SidewayPd,
        send_cq: &SidewayCq,
        recv_cq: &SidewayCq,
        caps: QpCaps,
    ) -> Result<SidewayQp, VerbsError> {
        queue_pair::create(pd, send_cq, recv_cq, caps)
    }

    /// Drops the QP, which destroys it. Its CQs stay bound to its number: give a new QP new
    /// CQs.
    fn destroy_qp(&self, qp: SidewayQp) -> Result<(), VerbsError> {
        drop(qp);
        Ok(())
    }

    fn qp_num(&self, qp: &SidewayQp) -> u32 {
        qp.qpn
    }

    fn qp_state(&self, qp: &SidewayQp) -> Result<QpState, VerbsError> {
        queue_pair::state(qp)
    }

    fn modify_qp(&self, qp: &SidewayQp, transition: &QpTransition) -> Result<(), VerbsError> {
        queue_pair::modify(qp, transition)
    }

    /// Posts the list as one `ibv_post_send`. Refusals this layer finds (QP state, SG counts)
    /// post nothing; one the provider finds part-way (a full queue) leaves the earlier
    /// requests posted and is reported as [`VerbsError::Failed`] saying so, not as
    /// [`VerbsError::QueueFull`], whose "nothing was posted" would not hold.
    fn post_send(&self, qp: &SidewayQp, requests: &[SendRequest]) -> Result<(), VerbsError> {
        post::send(qp, requests)
    }

    /// Posts the list as one `ibv_post_recv`; refusals as for [`post_send`](Self::post_send).
    fn post_recv(&self, qp: &SidewayQp, requests: &[RecvRequest]) -> Result<(), VerbsError> {
        post::recv(qp, requests)
    }

    /// Polls; completions report the number of the QP the CQ serves.
    ///
    /// # Errors
    /// [`VerbsError::Failed`] when `ibv_poll_cq` fails (a CQ overrun ends that way) rather
    /// than [`VerbsError::CqOverrun`]: verbs does not say why.
    fn poll_cq(
        &self,
        cq: &SidewayCq,
        max: usize,
        out: &mut Vec<WorkCompletion>,
    ) -> Result<usize, VerbsError> {
        completion::poll(cq, max, out)
    }
}
