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

/// Where one side's index array lies, found with every Python call it needs already made.
enum Located<'a, 'py> {
    /// The Python layer's scratch bytearray (lists and other sequences, converted).
    Scratch(&'a Bound<'py, PyByteArray>),
    /// A numpy array's own buffer: `len` bytes from `addr`.
    Array { addr: usize, len: usize },
}

/// Runs `plan` on the bytes of the two index arrays of a transfer, each a bytearray (the
/// Python layer's scratch for lists and other sequences) or a `numpy.ndarray` (exactly that
/// type) of native-endian 64-bit integers in C order; anything else is refused.
///
/// Both arrays are located first, with every Python call that takes; only then are their bytes
/// taken and `plan` run, with the GIL held and no Python call made until `plan` returns (`plan`
/// must make none). The arrays must not be written or reallocated while the call runs, which
/// NIXL's API asks of its callers anyway.
pub(super) fn with_indices<R>(
    local: &Bound<'_, PyAny>,
    remote: &Bound<'_, PyAny>,
    plan: impl FnOnce(&[u8], &[u8]) -> R,
) -> PyResult<R> {
    let local = locate(local, "local")?;
    let remote = locate(remote, "remote")?;
    // SAFETY: every Python call was made above; from here until `plan` returns this thread
    // makes none and holds the GIL, so no Python code runs while the bytes are read. Python
    // code that ran during the calls locating `remote` (a garbage collection's callbacks, or
    // another thread let in meanwhile) cannot have freed `local`'s memory: a bytearray's bytes
    // are taken only now, as they are, this call holds a reference to each array, and a numpy
    // array's buffer is replaced only by numpy's unchecked calls (`resize` with
    // `refcheck=False`, `__setstate__`), which numpy leaves to callers to keep away from arrays
    // in use, as NIXL's contract does.
    let (local, remote) = unsafe { (local.bytes(), remote.bytes()) };
    Ok(plan(local, remote))
}

/// Where `ids`, of the `side` (`"local"` or `"remote"`) of a transfer, lies.
fn locate<'a, 'py>(ids: &'a Bound<'py, PyAny>, side: &'static str) -> PyResult<Located<'a, 'py>> {
    if let Ok(scratch) = ids.cast::<PyByteArray>() {
        return Ok(Located::Scratch(scratch));
    }
    static NDARRAY: PyOnceLock<Py<PyType>> = PyOnceLock::new();
    let py = ids.py();
    let is_array = NDARRAY
        .import(py, "numpy", "ndarray")
        .is_ok_and(|ndarray| ids.get_type().is(ndarray));
    if !is_array {
        return Err(refused(side, "are neither a bytearray nor a numpy.ndarray").into());
    }
    let interface = ids.getattr(intern!(py, "__array_interface__"))?;
    let typestr: String = interface.get_item("typestr")?.extract()?;
    if typestr != NATIVE_I64 {
        return Err(refused(side, &format!("are {typestr}, not {NATIVE_I64}")).into());
    }
    if !interface.get_item("strides")?.is_none() {
        return Err(refused(side, "are not in C order").into());
    }
    let shape: Vec<usize> = interface.get_item("shape")?.extract()?;
    let (addr, _read_only): (usize, bool) = interface.get_item("data")?.extract()?;
    let len = shape
        .iter()
        .try_fold(8usize, |bytes, &dim| bytes.checked_mul(dim))
        .filter(|&len| len <= isize::MAX as usize)
        .ok_or_else(|| refused(side, "are larger than the address space"))?;
    Ok(Located::Array { addr, len })
}

impl<'a> Located<'a, '_> {
    /// The located bytes.
    ///
    /// # Safety
    /// No Python code may run while the bytes are used, and none may have replaced a numpy
    /// array's buffer since it was located.
    unsafe fn bytes(&self) -> &'a [u8] {
        match *self {
            // SAFETY: no Python code runs while the bytes are used (the caller's contract), so
            // nothing resizes or writes the bytearray meanwhile.
            Located::Scratch(scratch) => unsafe { scratch.as_bytes() },
            Located::Array { len: 0, .. } => &[],
            // SAFETY: `locate` found a numpy.ndarray (its exact type checked), whose array
            // interface numpy derives from the array's own buffer: `len` (at most isize::MAX)
            // bytes from `addr`, in C order. The caller's reference keeps the array and the
            // memory it views alive, and no Python code runs while the bytes are used nor
            // replaced the buffer since (the caller's contract). Another thread that released
            // the GIL and writes the array during the call would race with this read: NIXL's
            // contract (the index arrays are inputs of the call) rules that out, and
            // ferry_kv's documentation says so.
            Located::Array { addr, len } => unsafe {
                std::slice::from_raw_parts(addr as *const u8, len)
            },
        }
    }
}

/// Why one side's index array is refused; the Python layer converts every other form before
/// it reaches here.
fn refused(side: &str, problem: &str) -> NixlError {
    NixlError::InvalidParam(format!(
        "the {side} indices {problem}; pass a bytearray or a numpy array of native int64s in C order"
    ))
}
