//! A transfer's index arrays, read where they lie: vLLM hands `make_prepped_xfer` numpy arrays
//! of tens of thousands of ids per request, and copying them first costs as much as planning
//! them on a busy host.

use super::errors::NixlError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyByteArray, PyType};

/// The element type of the arrays read in place: native-endian 64-bit integers.
const NATIVE_I64: &str = if cfg!(target_endian = "little") {
    "<i8"
} else {
    ">i8"
};

/// The bytes of index array `ids` of the `side` (`"local"` or `"remote"`) of a transfer: a
/// bytearray's (the Python layer's scratch for lists and other sequences), or the buffer of a
/// `numpy.ndarray` (exactly that type) of native-endian 64-bit integers in C order. Anything
/// else is refused; the Python layer converts it first.
///
/// The bytes stay valid while `ids` is held and the GIL is not released: the caller plans from
/// them at once, running no Python code meanwhile.
pub(super) fn index_bytes<'a>(ids: &'a Bound<'_, PyAny>, side: &'static str) -> PyResult<&'a [u8]> {
    if let Ok(scratch) = ids.cast::<PyByteArray>() {
        // SAFETY: the GIL is held until the caller has planned from these bytes and no Python
        // code runs meanwhile, so nothing can resize or write the bytearray while it is read.
        return Ok(unsafe { scratch.as_bytes() });
    }
    static NDARRAY: PyOnceLock<Py<PyType>> = PyOnceLock::new();
    let py = ids.py();
    let is_array = NDARRAY
        .import(py, "numpy", "ndarray")
        .is_ok_and(|ndarray| ids.get_type().is(ndarray));
    if !is_array {
        return Err(refused(side, "is neither a bytearray nor a numpy.ndarray").into());
    }
    let interface = ids.getattr(intern!(py, "__array_interface__"))?;
    let typestr: String = interface.get_item("typestr")?.extract()?;
    if typestr != NATIVE_I64 {
        return Err(refused(side, &format!("holds {typestr}, not {NATIVE_I64}")).into());
    }
    if !interface.get_item("strides")?.is_none() {
        return Err(refused(side, "is not in C order").into());
    }
    let shape: Vec<usize> = interface.get_item("shape")?.extract()?;
    let (addr, _read_only): (usize, bool) = interface.get_item("data")?.extract()?;
    let len = shape
        .iter()
        .try_fold(8usize, |bytes, &dim| bytes.checked_mul(dim))
        .ok_or_else(|| refused(side, "is larger than the address space"))?;
    if len == 0 {
        return Ok(&[]);
    }
    // SAFETY: `ids` is a numpy.ndarray (its exact type checked above), whose array interface
    // numpy derives from the array's own buffer: `len` bytes from `addr`, in C order. The
    // reference the caller holds keeps the array and the memory it views alive, and with the
    // GIL held and no Python code run until planning ends, nothing can resize or free it.
    // Threads that released the GIL could still write the ids meanwhile (NIXL's contract
    // forbids it): such a race changes only the values read, and every block id the plan
    // yields is checked against its pool by the engine before anything moves, so it ends in
    // an error or other blocks of registered memory, never an access outside the buffer.
    Ok(unsafe { std::slice::from_raw_parts(addr as *const u8, len) })
}

fn refused(side: &str, problem: &str) -> NixlError {
    NixlError::InvalidParam(format!(
        "the {side} indices {problem}; pass a list or a 1-D integer array"
    ))
}
