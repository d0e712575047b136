//! Integer lists from Python, read fast: SGLang and vLLM hand over tens of thousands of
//! addresses and lengths per call, and reading them through the generic sequence protocol
//! cost more than moving the bytes over NVLink.

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::PyList;

// The fast path reads ints as C `unsigned long`, which must be 64 bits (as on 64-bit Linux).
const _: () = assert!(size_of::<std::ffi::c_ulong>() == 8);

/// The unsigned 64-bit integers of `values`: a `list` of `int`s is read straight from the
/// list; any other sequence goes through pyo3's generic conversion.
pub(crate) fn u64s(values: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    let Ok(list) = values.cast::<PyList>() else {
        return values.extract();
    };
    let mut out = Vec::with_capacity(list.len());
    for index in 0..list.len() {
        // SAFETY: the GIL is held (`values` is bound to it) and `index` is below the list's
        // length, which cannot change while this thread holds the GIL and runs no Python code;
        // the returned reference is borrowed from the list and used before anything else runs.
        let item =
            unsafe { pyo3::ffi::PyList_GetItem(list.as_ptr(), index as pyo3::ffi::Py_ssize_t) };
        if item.is_null() {
            return Err(PyErr::fetch(values.py()));
        }
        // SAFETY: `item` is a live object borrowed from the list (above). The call reads it and
        // sets an error for a non-int or a negative or too large value, checked right after.
        // (`unsigned long` is 64 bits on the 64-bit Unix targets ferry runs on, and CPython
        // converts it with a loop over the digits, several times faster than its `unsigned
        // long long` path.)
        let value = unsafe { pyo3::ffi::PyLong_AsUnsignedLong(item) };
        if value == std::ffi::c_ulong::MAX {
            if let Some(error) = PyErr::take(values.py()) {
                return Err(PyTypeError::new_err(format!(
                    "item {index} of the list is not an address or length (an int from 0 to 2**64-1): {error}"
                )));
            }
        }
        out.push(value);
    }
    Ok(out)
}

/// An argument of a Mooncake call, or why it is not one: Mooncake's callers expect a failure
/// code, not an exception, for a negative address or a value that is no int.
pub(crate) type Arg<T> = Result<T, String>;

/// An unsigned 64-bit integer, or why `value` is not one (never an exception).
pub(crate) fn u64_or_reason(value: &Bound<'_, PyAny>) -> PyResult<Arg<u64>> {
    Ok(value.extract::<u64>().map_err(|error| {
        format!("{value} is not an address or length (an int from 0 to 2**64-1): {error}")
    }))
}

/// [`u64s`], or why `values` are not such a list (never an exception).
pub(crate) fn u64s_or_reason(values: &Bound<'_, PyAny>) -> PyResult<Arg<Vec<u64>>> {
    Ok(u64s(values).map_err(|error| error.to_string()))
}
