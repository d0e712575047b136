//! What a session needs from the engine it serves, and its limits.

use crate::error::Error;
use crate::memory::{RawDestination, RawSource};
use crate::wire::Limits;
use std::time::Duration;

/// A range of the served engine's memory while bytes move through it.
pub(crate) trait Landing {
    /// Length in bytes.
    fn len(&self) -> usize;
    /// Where received bytes go; for GPU memory a staging buffer, taken on the first call. Raw,
    /// never a slice: registered memory may be written by others at any time.
    fn destination(&mut self) -> Result<RawDestination<'_>, Error>;
    /// The bytes to send, once loaded; raw, as [`Self::destination`].
    fn source(&self) -> RawSource<'_>;
}

/// What a session needs from the engine it serves.
pub(crate) trait Served {
    /// The memory ranges this engine hands out.
    type Span: Landing;
    /// The registered range `addr..addr+len`, kept registered while the span lives; `None`
    /// when no single registration covers it.
    fn span(&self, addr: u64, len: u64) -> Option<Self::Span>;
    /// The engine's descriptor as JSON.
    fn descriptor(&self) -> Vec<u8>;
}

/// Limits and timeouts of a session.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SessionConfig {
    /// Body size limits, checked at each header.
    pub(crate) limits: Limits,
    /// Bounds each frame from its first byte to its answer, and how long the peer may leave
    /// queued answers unread.
    pub(crate) io_timeout: Duration,
    /// Bounds the hello, from the accept (an authentication handshake included).
    pub(crate) hello_timeout: Duration,
    /// How long a connection may sit between frames after its hello.
    pub(crate) idle_timeout: Duration,
}
