//! What a session asks of its driver, and why it ended.

use crate::error::ProtocolViolation;
use std::fmt;
use std::time::Duration;

/// Work the driver must do before the session reads on.
pub(crate) enum Event<S> {
    /// A write's bytes were received into these spans: make them visible in memory (copy GPU
    /// staging buffers to the GPU), drop the spans, then call
    /// [`ServerSession::handle_stored`].
    Store(Vec<S>),
    /// A read asks for this span: load its bytes (copy GPU memory into its staging buffer),
    /// then give it back with [`ServerSession::handle_loaded`].
    Load(S),
    /// A notification arrived: offer it to the inbox, then call
    /// [`ServerSession::handle_delivery`]. Hand it to the reader only once the answer queued
    /// by that call has been written, so a reader that acts on it at once cannot cut the
    /// sender off before its answer left.
    Notify(Vec<u8>),
}

/// Why a session ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Closed {
    /// The peer closed the connection between frames.
    Finished,
    /// The peer broke the protocol.
    Protocol(ProtocolViolation),
    /// The peer closed the connection in the middle of a frame.
    EndedMidFrame,
    /// No hello arrived within the limit.
    NoHello(Duration),
    /// A frame was not complete within the limit of its first byte.
    Stalled(Duration),
    /// No frame arrived within the idle timeout.
    Idle(Duration),
    /// The peer read none of its answers within the limit.
    NotReading(Duration),
    /// The rest of an answer (its body, or the tag after it) did not arrive within the limit
    /// of its header (or of its body).
    AnswerStalled(Duration),
    /// GPU memory could not be staged, so the rest of the frame had nowhere to go: the
    /// error's message.
    Staging(String),
}

impl fmt::Display for Closed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Closed::Finished => f.write_str("the peer closed the connection"),
            Closed::Protocol(violation) => write!(f, "{violation}"),
            Closed::EndedMidFrame => {
                f.write_str("the peer closed the connection in the middle of a frame")
            }
            Closed::NoHello(limit) => write!(f, "no hello within {limit:?}"),
            Closed::Stalled(limit) => {
                write!(f, "a frame was not complete within {limit:?} of its first byte")
            }
            Closed::Idle(limit) => write!(
                f,
                "no frame for {limit:?} (the engine's idle timeout); the peer reconnects when it needs to"
            ),
            Closed::NotReading(limit) => {
                write!(f, "the peer read none of its answers for {limit:?}")
            }
            Closed::AnswerStalled(limit) => write!(
                f,
                "the rest of an answer did not arrive within {limit:?} (the engine's I/O timeout)"
            ),
            Closed::Staging(error) => write!(f, "no staging buffer for GPU memory: {error}"),
        }
    }
}
