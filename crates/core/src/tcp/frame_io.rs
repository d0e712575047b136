//! Reading whole headers and small bodies off a stream.

use crate::error::ProtocolViolation;
use crate::wire::seal::TAG_LEN;
use crate::wire::{Header, Limits, HEADER_LEN};
use tokio::io::{AsyncRead, AsyncReadExt};

/// Why a frame could not be read.
#[derive(Debug, thiserror::Error)]
pub(crate) enum FrameError {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("{0}")]
    Protocol(#[from] ProtocolViolation),
}

impl From<crate::Error> for FrameError {
    /// No staging buffer for GPU memory mid-frame: the rest of the frame cannot be placed, so
    /// the connection ends as after an I/O error.
    fn from(error: crate::Error) -> Self {
        FrameError::Io(std::io::Error::other(error))
    }
}

/// Reads one header; `None` on a clean end of stream before its first byte.
pub(crate) async fn read_header<R: AsyncRead + Unpin>(
    reader: &mut R,
    limits: &Limits,
) -> Result<Option<Header>, FrameError> {
    let mut bytes = [0u8; HEADER_LEN];
    let first = reader.read(&mut bytes).await?;
    if first == 0 {
        return Ok(None);
    }
    reader.read_exact(&mut bytes[first..]).await?;
    Ok(Some(Header::decode(&bytes, limits)?))
}

/// Reads a body whose length the header announced (and whose limit it already checked).
pub(crate) async fn read_body<R: AsyncRead + Unpin>(
    reader: &mut R,
    len: u32,
) -> Result<Vec<u8>, std::io::Error> {
    let mut body = vec![0u8; len as usize];
    reader.read_exact(&mut body).await?;
    Ok(body)
}

/// Reads the integrity tag that follows a frame's body on a sealed connection.
pub(crate) async fn read_tag<R: AsyncRead + Unpin>(
    reader: &mut R,
) -> Result<[u8; TAG_LEN], std::io::Error> {
    let mut tag = [0u8; TAG_LEN];
    reader.read_exact(&mut tag).await?;
    Ok(tag)
}
