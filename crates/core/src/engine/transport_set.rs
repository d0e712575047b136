//! The transports an engine is built with, besides TCP: a set chosen by whoever assembles a
//! build of ferry (the `ferry` crate's `Links`), opened when the engine starts.

use crate::transport::Transport;
use std::sync::Arc;

/// The transports a build of ferry gives an engine besides TCP, which every engine has.
/// [`EngineBuilder::new`](crate::EngineBuilder::new) takes one, so an engine never starts
/// without its build's links by accident: the `ferry` crate's `Links` holds NVLink, MNNVL
/// and RDMA; [`TcpOnly`] holds nothing.
///
/// A set is configuration until the engine starts: [`Self::transports`] runs inside
/// [`EngineBuilder::build`](crate::EngineBuilder::build), so probing the host (RDMA
/// devices, say) happens then, not when the builder is made.
pub trait TransportSet: Send + Sync {
    /// The set's transports, made as the engine starts. A transport the host cannot run is
    /// either left out, with the reason logged, or kept to decline each route with it.
    fn transports(self: Box<Self>) -> Vec<Arc<dyn Transport>>;
}

/// No transport besides TCP: for users of ferry-core alone and for its tests. GPU memory
/// then moves staged through pinned host buffers, even between GPUs of one host.
#[derive(Debug, Clone, Copy, Default)]
pub struct TcpOnly;

impl TransportSet for TcpOnly {
    fn transports(self: Box<Self>) -> Vec<Arc<dyn Transport>> {
        Vec::new()
    }
}
