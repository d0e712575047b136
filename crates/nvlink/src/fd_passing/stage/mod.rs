//! The owner's side of a staging session on the fd socket ([`crate::staging`] has the
//! initiator's): the staged-copy requests as bytes (`wire`), and the session that carries
//! them out on the owner's GPU (`owner`).

mod owner;
mod wire;

pub(crate) use owner::{OwnerSession, Serving as OwnerServing};
#[cfg(any(fuzzing, test))]
pub(crate) use wire::fuzz_request;
pub(crate) use wire::{
    encode_request, StageEntry, StageOp, StageViolation, DONE, FAILED, MAX_ENTRIES,
    MAX_REASON_BYTES,
};

/// Least staging an owner gives (one VMM granule on every GPU ferry knows).
pub(crate) const MIN_STAGING_BYTES: u64 = 2 << 20;

/// Most staging an owner gives one session.
pub(crate) const MAX_STAGING_BYTES: u64 = 1 << 30;

/// How long an initiator waits for the owner's answer to one request: a slot's copy takes
/// well under a millisecond, so this only bounds an owner that stopped answering.
pub(crate) const ANSWER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);
/// Why a staging session ended, on either side.
#[derive(Debug, thiserror::Error)]
pub(crate) enum SessionEnded {
    /// Reading from or writing to the session's socket failed.
    #[error("{action} the staging session's socket failed: {source}")]
    Io {
        /// What was being done.
        action: &'static str,
        /// The operating system's error.
        source: std::io::Error,
    },
    /// The initiator sent a request that is not one.
    #[error("the peer sent a staged-copy request that is not one: {0}")]
    Violation(#[from] StageViolation),
    /// A range the initiator named is not the owner's to copy.
    #[error("{0}")]
    NotRegistered(String),
    /// The owner's engine is stopping.
    #[error("the engine is stopping; its memory is not copied any more")]
    Stopping,
    /// The owner refused or failed a request, for this reason.
    #[error("the peer did not carry out a staged copy: {0}")]
    Refused(String),
    /// The owner gave no answer in time.
    #[error("the peer did not answer a staged copy within {ANSWER_TIMEOUT:?}")]
    TimedOut,
    /// The staging buffer or a copy failed on the GPU.
    #[error("{0}")]
    Gpu(#[from] ferry_core::Error),
}

impl SessionEnded {
    /// The failure of `action` with the operating system's `error`.
    pub(crate) fn io(action: &'static str) -> impl Fn(std::io::Error) -> SessionEnded {
        move |source| SessionEnded::Io { action, source }
    }
}
