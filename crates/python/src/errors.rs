//! ferry's errors as Python exceptions: one base class, `FerryError`, and a subclass for each
//! kind a caller may want to catch on its own. The message is ferry's, which says what was
//! wrong and what to do.

use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyMemoryError};
use pyo3::prelude::*;

create_exception!(
    _ferry,
    FerryError,
    PyException,
    "Base class of every error ferry raises; the message says what was wrong and what to do."
);
create_exception!(
    _ferry,
    RangeError,
    FerryError,
    "A local or remote range is empty or not inside a registered region."
);
create_exception!(
    _ferry,
    UnsupportedMemory,
    FerryError,
    "Memory of a kind ferry cannot register (pool or managed memory, for example)."
);
create_exception!(
    _ferry,
    PeerError,
    FerryError,
    "A peer could not be reached, went away, rejected a request or broke the protocol."
);
create_exception!(
    _ferry,
    TransferTimeout,
    FerryError,
    "A transfer or a wait did not finish within its time limit."
);
create_exception!(
    _ferry,
    AuthenticationError,
    FerryError,
    "A peer did not prove it holds the shared secret, or refused this engine's proof."
);

/// The Python exception for a ferry error.
pub(crate) fn to_py(error: ferry::Error) -> PyErr {
    let message = error.to_string();
    match error {
        ferry::Error::Range(_) | ferry::Error::Registration { .. } => RangeError::new_err(message),
        ferry::Error::OutOfMemory { .. } => PyMemoryError::new_err(message),
        ferry::Error::Unsupported { .. } => UnsupportedMemory::new_err(message),
        ferry::Error::Timeout { .. } => TransferTimeout::new_err(message),
        ferry::Error::Unauthenticated { .. } => AuthenticationError::new_err(message),
        ferry::Error::Protocol { .. }
        | ferry::Error::Unreachable { .. }
        | ferry::Error::PeerGone { .. }
        | ferry::Error::Rejected { .. }
        | ferry::Error::NotPublished { .. } => PeerError::new_err(message),
        _ => FerryError::new_err(message),
    }
}

/// Adds the exception classes to the module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("FerryError", py.get_type::<FerryError>())?;
    m.add("RangeError", py.get_type::<RangeError>())?;
    m.add("UnsupportedMemory", py.get_type::<UnsupportedMemory>())?;
    m.add("PeerError", py.get_type::<PeerError>())?;
    m.add("TransferTimeout", py.get_type::<TransferTimeout>())?;
    m.add("AuthenticationError", py.get_type::<AuthenticationError>())?;
    Ok(())
}
