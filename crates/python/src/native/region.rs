//! `Region`: registered memory, and the Python object that owns it kept alive with it.

use super::{drop_outside_runtime, location_name};
use crate::errors::{to_py, FerryError};
use parking_lot::{Mutex, MutexGuard};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyType};

/// A registration and the object whose memory it is. Fields drop in order: the region is
/// deregistered before the owner is released.
struct Registered {
    region: ferry::Region,
    owner: Option<Py<PyAny>>,
}

/// Registered memory. Peers may read and write it until it is closed; closing waits for the
/// transfers still using it, then releases the object that owns the memory.
#[pyclass(module = "ferry_kv._ferry", frozen)]
pub(crate) struct Region {
    registered: Mutex<Option<Registered>>,
    addr: u64,
    nbytes: u64,
    location: String,
}

impl Region {
    pub(super) fn new(region: ferry::Region, owner: Option<Py<PyAny>>) -> Self {
        Region {
            addr: region.addr(),
            nbytes: region.len(),
            location: location_name(region.location()),
            registered: Mutex::new(Some(Registered { region, owner })),
        }
    }

    fn registered(&self) -> MutexGuard<'_, Option<Registered>> {
        self.registered.lock()
    }

    /// Runs `work` on the open region, or raises `FerryError` once it was closed.
    pub(super) fn with<R>(&self, work: impl FnOnce(&ferry::Region) -> R) -> PyResult<R> {
        match self.registered().as_ref() {
            Some(registered) => Ok(work(&registered.region)),
            None => Err(FerryError::new_err(format!(
                "the region at {:#x} is closed; register the memory again to use it",
                self.addr
            ))),
        }
    }
}

#[pymethods]
impl Region {
    /// The first byte's address, in this process.
    #[getter]
    fn addr(&self) -> u64 {
        self.addr
    }

    /// Length in bytes.
    #[getter]
    fn nbytes(&self) -> u64 {
        self.nbytes
    }

    /// Where the memory lives: `"host"`, or `"cuda:N"`.
    #[getter]
    fn location(&self) -> &str {
        &self.location
    }

    /// The name given with `set_name`, or `None`.
    #[getter]
    fn name(&self) -> PyResult<Option<String>> {
        self.with(|region| region.name())
    }

    /// Names the region, so peers find it by name (`Peer.buffer(name)`) instead of by
    /// address; published with the engine's descriptor. Raises `FerryError` for a name
    /// another region of this engine has.
    fn set_name(&self, name: &str) -> PyResult<()> {
        self.with(|region| region.set_name(name))?.map_err(to_py)
    }

    /// The object that owns the memory (a tensor, an array, a buffer), or `None`.
    #[getter]
    fn owner(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        self.registered()
            .as_ref()
            .and_then(|registered| registered.owner.as_ref().map(|owner| owner.clone_ref(py)))
    }

    /// Whether `close` was called.
    #[getter]
    fn closed(&self) -> bool {
        self.registered().is_none()
    }

    /// Copies `data` into the region at `offset` (host or GPU memory).
    fn write(&self, py: Python<'_>, offset: u64, data: &[u8]) -> PyResult<()> {
        py.detach(|| self.with(|region| region.write_at(offset, data)))?
            .map_err(to_py)
    }

    /// Copies `nbytes` of the region at `offset` out as `bytes`.
    fn read<'py>(
        &self,
        py: Python<'py>,
        offset: u64,
        nbytes: usize,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let mut data = vec![0; nbytes];
        py.detach(|| self.with(|region| region.read_at(offset, &mut data)))?
            .map_err(to_py)?;
        Ok(PyBytes::new(py, &data))
    }

    /// Deregisters the memory, after the transfers still using it end, then releases its
    /// owner. Closing twice does nothing.
    fn close(&self, py: Python<'_>) {
        let Some(Registered { region, owner }) = self.registered().take() else {
            return;
        };
        py.detach(|| drop(region));
        drop(owner);
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (_kind = None, _value = None, _traceback = None))]
    fn __exit__(
        &self,
        py: Python<'_>,
        _kind: Option<Bound<'_, PyType>>,
        _value: Option<Bound<'_, PyAny>>,
        _traceback: Option<Bound<'_, PyAny>>,
    ) {
        self.close(py);
    }

    fn __repr__(&self) -> String {
        format!(
            "Region(addr={:#x}, nbytes={}, location={:?}{})",
            self.addr,
            self.nbytes,
            self.location,
            if self.closed() { ", closed" } else { "" }
        )
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        if let Some(registered) = self.registered.get_mut().take() {
            drop_outside_runtime(registered);
        }
    }
}
