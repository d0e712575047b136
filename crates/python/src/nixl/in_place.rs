//! A transfer's index arrays, read where they lie: vLLM hands `make_prepped_xfer` numpy arrays
//! of tens of thousands of ids per request, and copying them first costs as much as planning
//! them on a busy host.

use super::dlist::DescList;
use super::errors::NixlError;
use super::xfer::{self, Indices, Moves};
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

/// A transfer's descriptor pairs, planned.
pub(super) struct Planned {
    pub(super) moves: Moves,
    /// Bytes the transfer moves.
    pub(super) bytes: u64,
    /// Descriptor pairs it names.
    pub(super) descriptors: u64,
}

/// Where one side's index array lies, found with every Python call it needs already made.
enum Located<'a, 'py> {
    /// The Python layer's scratch bytearray (lists and other sequences, converted).
    Scratch(&'a Bound<'py, PyByteArray>),
    /// A numpy array's own buffer: `len` bytes from `addr`.
    Array { addr: usize, len: usize },
}

/// Plans descriptors `local_ids` of `local_list` with `remote_ids` of `remote_list` (see
/// [`xfer::plan`]), the ids being the first `local_bytes` and `remote_bytes` of two arrays,
/// each a bytearray (the Python layer's scratch for lists and other sequences) or a
/// `numpy.ndarray` (exactly that type) of native-endian 64-bit integers in C order; anything
/// else is refused.
///
/// Both arrays are located first, with every Python call that takes; only then are their bytes
/// taken and planned from, with the GIL held and no Python call made until planning ends. The
/// arrays must not be written, nor their memory freed or replaced, while the call runs, which
/// NIXL's API asks of its callers anyway.
pub(super) fn plan(
    local_list: &DescList,
    (local_ids, local_bytes): (&Bound<'_, PyAny>, usize),
    remote_list: &DescList,
    (remote_ids, remote_bytes): (&Bound<'_, PyAny>, usize),
) -> PyResult<Planned> {
    let local = locate(local_ids, "local")?;
    let remote = locate(remote_ids, "remote")?;
    // SAFETY: every Python call was made above; from here until `plan` returns this thread
    // makes none and holds the GIL, so no Python code runs while the bytes are read. Python
    // code that ran during the calls locating `remote` (a garbage collection's callbacks, or
    // another thread let in meanwhile) cannot have freed `local`'s memory: a bytearray's bytes
    // are taken only now, as they are, and this call holds a reference to each array, which
    // keeps a numpy array's own buffer alive. What is left is the caller's, as NIXL's contract
    // has it (the index arrays are inputs of the call): numpy's unchecked calls that replace a
    // buffer (`resize(refcheck=False)`, `__setstate__`), or the owner of memory an array only
    // views (a tensor's `.numpy()`, `np.ctypeslib.as_array`) freeing it, during the call.
    let (local, remote) = unsafe { (local.bytes(), remote.bytes()) };
    let planned = || -> Result<Planned, NixlError> {
        let local = Indices::new(local, local_bytes, "local")?;
        let remote = Indices::new(remote, remote_bytes, "remote")?;
        let (moves, bytes) = xfer::plan(local_list, local, remote_list, remote)?;
        Ok(Planned {
            moves,
            bytes,
            descriptors: local.len() as u64,
        })
    };
    // Planned before an error becomes a Python exception, which takes Python calls.
    let planned = planned();
    Ok(planned?)
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
    /// While the bytes are used, no Python code may run on this thread (which must hold the
    /// GIL: ferry_kv's abi3 build loads only on CPython with one) and no other thread may write
    /// or free them; and since the array was located, nothing may have freed or replaced a
    /// numpy array's memory: neither numpy's unchecked calls (`resize(refcheck=False)`,
    /// `__setstate__`) nor, for an array viewing memory it does not own, that memory's owner.
    unsafe fn bytes(&self) -> &'a [u8] {
        match *self {
            // SAFETY: no Python code runs while the bytes are used (the caller's contract), so
            // nothing resizes or writes the bytearray meanwhile.
            Located::Scratch(scratch) => unsafe { scratch.as_bytes() },
            Located::Array { len: 0, .. } => &[],
            // SAFETY: `locate` found a numpy.ndarray (its exact type checked), whose array
            // interface numpy derives from the array's buffer: `len` (at most isize::MAX) bytes
            // from `addr`, in C order, alive and unchanged while the bytes are used (the
            // caller's contract, above).
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
