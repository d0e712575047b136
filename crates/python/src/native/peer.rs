//! `Peer`: another engine, opened by name.

use super::location_name;
use pyo3::prelude::*;

/// An open peer: its name and the memory it had registered when it was opened.
#[pyclass(module = "ferry_kv._ferry", frozen)]
pub(crate) struct Peer {
    peer: ferry::Peer,
}

impl Peer {
    pub(super) fn new(peer: ferry::Peer) -> Self {
        Peer { peer }
    }

    pub(super) fn inner(&self) -> &ferry::Peer {
        &self.peer
    }
}

#[pymethods]
impl Peer {
    /// The peer's name, as passed to `connect`.
    #[getter]
    fn name(&self) -> &str {
        self.peer.name()
    }

    /// The peer's registered buffers as `(addr, nbytes, location)`, in the peer's address space.
    #[getter]
    fn buffers(&self) -> Vec<(u64, u64, String)> {
        self.peer
            .buffers()
            .into_iter()
            .map(|buffer| (buffer.addr, buffer.len, location_name(buffer.location)))
            .collect()
    }

    /// `(addr, nbytes, location)` of the buffer the peer named `name` (`Region.set_name`), as
    /// the peer had it when it was opened; `None` when it has none of that name (connect
    /// again to see names given since).
    fn buffer(&self, name: &str) -> Option<(u64, u64, String)> {
        self.peer
            .buffer(name)
            .map(|buffer| (buffer.addr, buffer.len, location_name(buffer.location)))
    }

    /// False once the control connection to the peer failed; the next transfer or `connect`
    /// opens a new one.
    #[getter]
    fn alive(&self) -> bool {
        self.peer.is_alive()
    }

    fn __repr__(&self) -> String {
        format!(
            "Peer(name={:?}, buffers={})",
            self.peer.name(),
            self.peer.buffers().len()
        )
    }
}
