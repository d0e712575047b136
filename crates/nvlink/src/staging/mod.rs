//! Staged copies: `cudaMalloc` memory of a peer whose CUDA IPC handles do not open here moves
//! through a VMM staging buffer the peer (the memory's owner) allocates and hands over by file
//! descriptor, which does cross.
//!
//! The driver refuses a legacy IPC handle between two processes whose PIDs, as their own PID
//! namespaces number them, are equal (two pods' servers are both PID 1; see
//! [`crate::PID_CLASH_REMEDIES`]); VMM memory handed over by file descriptor maps between the
//! same two processes. So the initiator opens a staging session on the owner's fd socket
//! ([`StagingSession`]): the owner allocates a staging buffer on the GPU of the buffer named
//! and sends its descriptor, the initiator maps it. A write then goes in chunks of at most one
//! slot of the staging buffer: the initiator's copy kernel moves the chunk's ranges from its
//! memory into the slot (the NVLink copy), and asks the owner to scatter the slot into its
//! memory ([`wire::StageOp::Scatter`]); the owner checks every range against its own
//! registrations, copies on its GPU and answers. A read asks the owner to gather into a slot
//! first, then copies the slot out. With [`SLOTS`] slots the owner's copy of one chunk runs
//! while the initiator copies the next.
//!
//! Staging is taken only where the trial mapping of the peer's `cudaMalloc` memory failed and
//! a trial session worked ([`crate::trial`]); everything else keeps its direct mapping.

mod chunks;
mod owner;
mod session;
mod wire;

pub(crate) use chunks::{plan_chunks, Chunk, Piece};
pub(crate) use owner::{OwnerSession, Serving as OwnerServing};
pub(crate) use session::StagingSession;
#[cfg(any(fuzzing, test))]
pub(crate) use wire::fuzz_request;
pub(crate) use wire::{StageEntry, StageOp};

/// Bytes of staging an initiator asks for: [`SLOTS`] slots of 64 MiB.
pub(crate) const STAGING_BYTES: u64 = 256 << 20;

/// Slots the staging buffer is cut into: chunks in flight at once.
pub(crate) const SLOTS: u64 = 4;

/// Least staging an owner gives (one VMM granule on every GPU ferry knows).
pub(crate) const MIN_STAGING_BYTES: u64 = 2 << 20;

/// Most staging an owner gives one session.
pub(crate) const MAX_STAGING_BYTES: u64 = 1 << 30;

/// How long an initiator keeps an unused session: past it, a transfer opens a fresh one
/// (owners end sessions idle for a minute, freeing their staging).
pub(crate) const REUSE_IDLE: std::time::Duration = std::time::Duration::from_secs(30);

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
    Violation(#[from] wire::StageViolation),
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
    fn io(action: &'static str) -> impl Fn(std::io::Error) -> SessionEnded {
        move |source| SessionEnded::Io { action, source }
    }
}
