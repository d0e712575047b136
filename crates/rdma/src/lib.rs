//! ferry-rdma: the RDMA transport of ferry (ibverbs RC queue pairs, one-sided WRITE and READ
//! between hosts).
//!
//! This first part needs no hardware. [`Verbs`] is the seam between the transport and
//! ibverbs: the handful of calls the transport makes (devices and ports, device context,
//! protection domain, memory registration, completion queue, RC queue pair and its
//! RESET -> INIT -> RTR -> RTS transitions, posting one-sided work requests, polling
//! completions), with typed attributes, work requests and completion statuses named as verbs
//! names them. `SidewayVerbs` (crate feature `sideway`, which the facade's `rdma` feature
//! turns on) implements it over rdma-core; where rdma-core, kernel support or a device is
//! missing it says which, and [`probe`] reports it for `ferry probe`.
//!
//! The in-memory model (`model`: this crate's tests, or the `model` feature for other crates'
//! tests) implements [`Verbs`] for several "hosts" in one process, faithful to the QP state
//! machine, access flags, rkey and bounds checks and the error completions, with fault
//! injection (a host that dies). Nothing here has run on RDMA hardware.
//!
//! Connecting an RC pair, as the transport will over its control connection:
//! 1. each side creates a QP and moves it to INIT with its port and remote access flags;
//! 2. each side sends the other its [`QpEndpoint`] (QPN, first PSN, LID, GID);
//! 3. each side moves to RTR with the peer's endpoint ([`RtrAttr`]) and then to RTS with its
//!    own PSN ([`RtsAttr`]);
//! 4. WRITE/READ requests carry the peer's address and rkey from the peer's export.

mod device;
mod error;
mod memory;
#[cfg(any(test, feature = "model"))]
pub mod model;
mod probe;
mod qp;
#[cfg(feature = "sideway")]
mod sideway;
mod topology;
mod transport;
mod verbs;
mod work;

#[cfg(feature = "sideway")]
pub use self::sideway::{SidewayContext, SidewayCq, SidewayMr, SidewayPd, SidewayQp, SidewayVerbs};
pub use device::{DeviceInfo, Gid, GidEntry, GidType, LinkLayer, Mtu, PortInfo, PortState};
pub use error::VerbsError;
pub use memory::{AccessFlags, MrKeys};
pub use probe::{probe, RdmaProbe};
pub use qp::{
    AddressVector, GlobalRoute, InitAttr, Psn, QpCaps, QpEndpoint, QpState, QpTransition, RtrAttr,
    RtsAttr,
};
pub use topology::{NicChoice, PathClass, Topology};
pub use transport::{CudaGpus, DmaBufRange, DmaBufSource, RdmaConfig, RdmaTransport, RDMA};
pub use verbs::Verbs;
pub use work::{
    RecvRequest, RemoteSegment, SendOpcode, SendRequest, Sge, WcOpcode, WcStatus, WorkCompletion,
};
