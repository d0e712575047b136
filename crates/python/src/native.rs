//! ferry's own API in Python terms.

use pyo3::prelude::*;

/// Adds the native classes to the module.
pub(crate) fn register(_m: &Bound<'_, PyModule>) -> PyResult<()> {
    Ok(())
}
