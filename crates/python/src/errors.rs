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
    "Base class of the errors ferry raises (host memory it cannot allocate raises MemoryError); the message says what was wrong and what to do."
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
    "A peer could not be reached, went away, refused a request or broke the protocol."
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

/// Which Python exception class a ferry error becomes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Class {
    /// `RangeError`.
    Range,
    /// Python's own `MemoryError`, so `except MemoryError` catches it as for any allocation.
    Memory,
    /// `UnsupportedMemory`.
    Unsupported,
    /// `TransferTimeout`.
    Timeout,
    /// `AuthenticationError`.
    Authentication,
    /// `PeerError`.
    Peer,
    /// `FerryError` itself.
    Other,
}

/// The class of `error`: a range the peer refused as outside its registrations is a range
/// error, as a local one is; every other refusal is the peer's.
fn class_of(error: &ferry::Error) -> Class {
    match error {
        ferry::Error::Range(_)
        | ferry::Error::Registration { .. }
        | ferry::Error::Rejected {
            reason: ferry::Refusal::NotRegistered { .. },
            ..
        } => Class::Range,
        ferry::Error::OutOfMemory { .. } => Class::Memory,
        ferry::Error::Unsupported { .. } => Class::Unsupported,
        ferry::Error::Timeout { .. } => Class::Timeout,
        ferry::Error::Unauthenticated { .. } => Class::Authentication,
        ferry::Error::Protocol { .. }
        | ferry::Error::Unreachable { .. }
        | ferry::Error::PeerGone { .. }
        | ferry::Error::Rejected { .. }
        | ferry::Error::NotPublished { .. } => Class::Peer,
        // Internal (a bug in ferry), ApiMisuse, Cuda, Io, Metadata, Shutdown, Unavailable and
        // whatever is added later: the base class, with ferry's message.
        _ => Class::Other,
    }
}

/// The Python exception for a ferry error.
pub(crate) fn to_py(error: ferry::Error) -> PyErr {
    let message = error.to_string();
    match class_of(&error) {
        Class::Range => RangeError::new_err(message),
        Class::Memory => PyMemoryError::new_err(message),
        Class::Unsupported => UnsupportedMemory::new_err(message),
        Class::Timeout => TransferTimeout::new_err(message),
        Class::Authentication => AuthenticationError::new_err(message),
        Class::Peer => PeerError::new_err(message),
        Class::Other => FerryError::new_err(message),
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

#[cfg(test)]
mod tests {
    use super::*;
    use ferry::{Refusal, RegistrationProblem};

    #[test]
    fn new_error_kinds_map_to_the_class_a_caller_would_catch() {
        let out_of_memory = ferry::Error::OutOfMemory {
            what: "a staging buffer",
            bytes: 1 << 40,
        };
        assert_eq!(class_of(&out_of_memory), Class::Memory);
        let registration = ferry::Error::Registration {
            addr: 0,
            len: 0,
            problem: RegistrationProblem::Empty,
        };
        assert_eq!(class_of(&registration), Class::Range);
        let internal = ferry::Error::Internal {
            what: "a state that cannot happen".into(),
        };
        assert_eq!(class_of(&internal), Class::Other);
        let outside = ferry::Error::Rejected {
            peer: "127.0.0.1:1".into(),
            reason: Refusal::NotRegistered {
                entry: Some(0),
                addr: 0x1000,
                len: 16,
            },
        };
        assert_eq!(class_of(&outside), Class::Range);
        let refused = ferry::Error::Rejected {
            peer: "127.0.0.1:1".into(),
            reason: Refusal::Other("the inbox is full".into()),
        };
        assert_eq!(class_of(&refused), Class::Peer);
    }
}
