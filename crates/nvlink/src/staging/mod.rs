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
//! memory ([`StageOp::Scatter`]); the owner checks every range against its own
//! registrations, copies on its GPU and answers. A read asks the owner to gather into a slot
//! first, then copies the slot out. With several slots (between two GPUs) the owner's copy of
//! one chunk runs while the initiator copies the next
//! ([`crate::NvlinkConfig::staging_slots`]).
//!
//! Staging is taken only where [`crate::NvlinkConfig::cuda_malloc_staging`] allows it (by
//! default it does), the trial mapping of the peer's `cudaMalloc` memory
//! failed (or staging is set to always), and a trial session gathered a byte
//! ([`crate::trial`]); everything else keeps its direct mapping.

mod chunks;
mod session;

pub(crate) use crate::fd_passing::{SessionEnded, StageEntry, StageOp, ANSWER_TIMEOUT};
pub(crate) use chunks::{plan_chunks, slots_of, Chunk, Piece};
pub(crate) use session::StagingSession;

/// How long an initiator keeps an unused session: past it, a transfer opens a fresh one
/// (owners end sessions idle for a minute, freeing their staging).
pub(crate) const REUSE_IDLE: std::time::Duration = std::time::Duration::from_secs(30);
