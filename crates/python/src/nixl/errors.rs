//! NIXL's exceptions (`nixl._bindings.nixl*Error`, each a plain `Exception` whose text starts
//! with NIXL's status name) and the error that becomes them.

// The exception types carry NIXL's Python names, which callers catch by.
#![allow(non_camel_case_types)]

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

/// What went wrong in a NIXL call, sorted by the status NIXL reports for it. The text says
/// what to do.
#[derive(Debug, thiserror::Error)]
pub(crate) enum NixlError {
    /// An agent, registration, list or handle that does not exist (any more).
    #[error("NIXL_ERR_NOT_FOUND: {0}")]
    NotFound(String),
    /// An argument out of range or of the wrong shape.
    #[error("NIXL_ERR_INVALID_PARAM: {0}")]
    InvalidParam(String),
    /// Two sides of a transfer that do not fit each other.
    #[error("NIXL_ERR_MISMATCH: {0}")]
    Mismatch(String),
    /// The engine could not do it: a peer unreachable or gone, a transfer refused.
    #[error("NIXL_ERR_BACKEND: {0}")]
    Backend(String),
    /// A transfer handle posted again, or released, while it still moves.
    #[error("NIXL_ERR_REPOST_ACTIVE: {0}")]
    RepostActive(String),
    /// A transfer handle asked for its state before it was ever posted.
    #[error("NIXL_ERR_NOT_POSTED: {0}")]
    NotPosted(String),
    /// Telemetry asked of an agent created without `capture_telemetry`.
    #[error("NIXL_ERR_NO_TELEMETRY: {0}")]
    NoTelemetry(String),
}

create_exception!(
    _ferry,
    nixlNotPostedError,
    PyException,
    "A transfer handle that was never posted."
);
create_exception!(
    _ferry,
    nixlInvalidParamError,
    PyException,
    "An argument out of range or of the wrong shape."
);
create_exception!(
    _ferry,
    nixlBackendError,
    PyException,
    "The engine could not carry the request out."
);
create_exception!(
    _ferry,
    nixlNotFoundError,
    PyException,
    "An agent, registration, list or handle that does not exist."
);
create_exception!(
    _ferry,
    nixlMismatchError,
    PyException,
    "Two sides of a transfer that do not fit each other."
);
create_exception!(
    _ferry,
    nixlNotAllowedError,
    PyException,
    "A call not allowed in the agent's state."
);
create_exception!(
    _ferry,
    nixlRepostActiveError,
    PyException,
    "A transfer handle posted or released while it moves."
);
create_exception!(
    _ferry,
    nixlUnknownError,
    PyException,
    "An error of no other class."
);
create_exception!(
    _ferry,
    nixlNotSupportedError,
    PyException,
    "A request this engine does not support."
);
create_exception!(
    _ferry,
    nixlRemoteDisconnectError,
    PyException,
    "The remote agent went away."
);
create_exception!(
    _ferry,
    nixlCancelledError,
    PyException,
    "A transfer that was cancelled."
);
create_exception!(
    _ferry,
    nixlNoTelemetryError,
    PyException,
    "Telemetry asked of an agent that does not capture it."
);

impl From<NixlError> for PyErr {
    fn from(error: NixlError) -> PyErr {
        let text = error.to_string();
        match error {
            NixlError::NotFound(_) => nixlNotFoundError::new_err(text),
            NixlError::InvalidParam(_) => nixlInvalidParamError::new_err(text),
            NixlError::Mismatch(_) => nixlMismatchError::new_err(text),
            NixlError::Backend(_) => nixlBackendError::new_err(text),
            NixlError::RepostActive(_) => nixlRepostActiveError::new_err(text),
            NixlError::NoTelemetry(_) => nixlNoTelemetryError::new_err(text),
            NixlError::NotPosted(_) => nixlNotPostedError::new_err(text),
        }
    }
}

/// Adds every exception class to the module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("nixlNotPostedError", py.get_type::<nixlNotPostedError>())?;
    m.add(
        "nixlInvalidParamError",
        py.get_type::<nixlInvalidParamError>(),
    )?;
    m.add("nixlBackendError", py.get_type::<nixlBackendError>())?;
    m.add("nixlNotFoundError", py.get_type::<nixlNotFoundError>())?;
    m.add("nixlMismatchError", py.get_type::<nixlMismatchError>())?;
    m.add("nixlNotAllowedError", py.get_type::<nixlNotAllowedError>())?;
    m.add(
        "nixlRepostActiveError",
        py.get_type::<nixlRepostActiveError>(),
    )?;
    m.add("nixlUnknownError", py.get_type::<nixlUnknownError>())?;
    m.add(
        "nixlNotSupportedError",
        py.get_type::<nixlNotSupportedError>(),
    )?;
    m.add(
        "nixlRemoteDisconnectError",
        py.get_type::<nixlRemoteDisconnectError>(),
    )?;
    m.add("nixlCancelledError", py.get_type::<nixlCancelledError>())?;
    m.add(
        "nixlNoTelemetryError",
        py.get_type::<nixlNoTelemetryError>(),
    )?;
    Ok(())
}
