//! `ferry probe`'s report for Python (`python -m ferry_kv probe`): the same text the CLI
//! prints, so an operator with only the wheel sees which path a peer's buffers take and why.

use super::engine::Engine;
use crate::errors::to_py;
use pyo3::prelude::*;

/// This machine's CUDA driver, GPUs, peer access, FABRIC support, transports and RDMA
/// devices, as `ferry probe` prints them.
#[pyfunction]
pub(crate) fn probe_machine(py: Python<'_>) -> PyResult<String> {
    py.detach(ferry::probe::machine).map_err(to_py)
}

/// Which transport each buffer of the engine named `name` gets from `engine` (from host
/// memory and from each GPU here) and what every transport answered, as `ferry probe --peer`
/// prints it. Writes nothing into the peer.
#[pyfunction]
pub(crate) fn probe_routes(
    py: Python<'_>,
    engine: PyRef<'_, Engine>,
    name: &str,
) -> PyResult<String> {
    let engine = engine.running()?;
    py.detach(|| ferry::probe::routes(&engine, name))
        .map_err(to_py)
}
