//! ferry-rdma: the RDMA transport of ferry (ibverbs RC queue pairs, one-sided WRITE and READ
//! between hosts, GPU memory through dma-buf).
//!
//! - [`RdmaTransport`] is ferry's [`Transport`](ferry_core::Transport) over any [`Verbs`]:
//!   it registers each region with its NICs (GPU memory with the NICs nearest its GPU on the
//!   PCI tree, [`Topology`]), publishes the rkeys in the region's export, brings up RC queue
//!   pairs with each peer over an authenticated side channel, and moves transfers as sliced,
//!   packed and striped one-sided WRITE and READ work requests.
//! - [`Verbs`] is the seam between the transport and ibverbs: devices and ports, device
//!   context, protection domain, memory registration (plain and dma-buf), completion queue,
//!   RC queue pair and its RESET -> INIT -> RTR -> RTS transitions, posting one-sided work
//!   requests, polling completions, with typed attributes and completion statuses named as
//!   verbs names them. `SidewayVerbs` (crate feature `sideway`, which the facade's `rdma`
//!   feature turns on) implements it over rdma-core, loaded at run time; where rdma-core,
//!   kernel support or a device is missing it says which, and [`probe`] reports it for
//!   `ferry probe`.
//! - The in-memory model (`model`: this crate's tests, or the `model` feature for other
//!   crates' tests) implements [`Verbs`] for several "hosts" in one process, faithful to the
//!   QP state machine, access flags, rkey and bounds checks and the error completions, with
//!   fault injection (a host that dies, a fabric that stops).
//!
//! The transport has run only against the model: nothing here has run on RDMA hardware.

// Used by the Verbs implementations: the model (tests) and the sideway layer.
#[cfg(any(test, feature = "model", feature = "sideway"))]
mod checks;
mod device;
mod error;
#[cfg(any(fuzzing, test))]
pub mod fuzzing;
mod memory;
#[cfg(any(test, feature = "model"))]
pub mod model;
mod probe;
mod qp;
mod qp_state;
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
pub use probe::{probe, RdmaProbe, RdmaUnavailable};
pub use qp::{
    AddressVector, GlobalRoute, InitAttr, Psn, QpCaps, QpEndpoint, QpState, QpTransition, RtrAttr,
    RtsAttr,
};
pub use topology::{NicChoice, PathClass, Topology};
pub use transport::{
    CudaGpus, DmaBufRange, DmaBufSource, NoDmaBuf, NoUsableNic, RdmaConfig, RdmaTransport, RDMA,
};
pub use verbs::Verbs;
pub use work::{
    RecvRequest, RemoteSegment, SendOpcode, SendRequest, Sge, WcOpcode, WcStatus, WorkCompletion,
};
