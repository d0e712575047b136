//! Drives the shared-secret handshake ([`crate::auth`]) over tokio streams: first on every
//! connection this engine opens, and on every connection its listener accepts.

use super::frame_io::FrameError;
use crate::auth::io::{bounded, drive};
use crate::auth::{FrameKeys, Handshake, Secret, MAGIC};
use crate::error::{AuthFailure, Error, ProtocolViolation, Result};
use std::net::SocketAddr;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

/// Authenticates this engine to the listener at the other end of `stream`, within `timeout`;
/// with `tag_frames`, the keys the connection's frames are then tagged with. Without a secret
/// it does nothing (no keys, untagged frames), so engines without one talk as they always did.
///
/// # Errors
/// [`Error::Unauthenticated`] naming `peer` when the handshake fails.
pub(crate) async fn client<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    secret: Option<&Secret>,
    tag_frames: bool,
    peer: &str,
    timeout: Duration,
) -> Result<Option<FrameKeys>> {
    let Some(secret) = secret else {
        return Ok(None);
    };
    let refused = |reason| Error::Unauthenticated {
        peer: peer.to_owned(),
        reason,
    };
    let nonce = crate::auth::nonce()?;
    bounded(
        drive(stream, Handshake::client(secret.clone(), nonce, tag_frames)),
        timeout,
    )
    .await
    .map_err(refused)
}

/// Checks the peer that connected on `stream` from `address`; hands the stream back when it
/// may be served, with the keys its frames are tagged with when it authenticated. A refused
/// peer gets one log line and its connection closed.
///
/// Without a secret, a peer that does not authenticate passes with nothing read (after its
/// first bytes arrived, or `timeout` passed: the session then bounds its hello as always), and
/// one that does is refused, so it learns why instead of seeing a stray frame error.
pub(crate) async fn accept(
    mut stream: TcpStream,
    address: SocketAddr,
    secret: Option<&Secret>,
    timeout: Duration,
) -> Option<(TcpStream, Option<FrameKeys>)> {
    if secret.is_none()
        && !tokio::time::timeout(timeout, opens_with_magic(&stream))
            .await
            .unwrap_or(false)
    {
        return Some((stream, None));
    }
    let outcome = match crate::auth::nonce() {
        Ok(nonce) => {
            let handshake = Handshake::server(secret.cloned(), nonce);
            bounded(drive(&mut stream, handshake), timeout).await
        }
        Err(error) => Err(AuthFailure::Io(error.to_string())),
    };
    match outcome {
        Ok(keys) => Some((stream, keys)),
        Err(reason) => {
            tracing::warn!(%address, %reason, "refused a connection that did not authenticate");
            linger(stream, timeout).await;
            None
        }
    }
}

/// The refusal a listener with a secret sends to a peer without one, as that peer's frame
/// reader sees it: a frame with the handshake's magic.
pub(crate) fn refusal_seen_as_frame(error: &FrameError) -> Option<AuthFailure> {
    match error {
        FrameError::Protocol(ProtocolViolation::BadMagic { found }) if *found == MAGIC => {
            Some(AuthFailure::NoLocalSecret)
        }
        _ => None,
    }
}

/// Whether the first bytes the peer sent are an authentication hello's, left unread.
async fn opens_with_magic(stream: &TcpStream) -> bool {
    let mut first = [0u8; MAGIC.len()];
    loop {
        let Ok(peeked) = stream.peek(&mut first).await else {
            return false;
        };
        if peeked == 0 || first[..peeked] != MAGIC[..peeked] {
            return false;
        }
        if peeked == MAGIC.len() {
            return true;
        }
        // A prefix of the magic so far; the rest is on its way.
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// Closes a refused connection so that the refusal reaches the peer: stop sending, then read
/// and drop what the peer still sends until it closes (a close with unread bytes would reset
/// the connection and could destroy the refusal in flight), for at most `timeout` and 1 MiB.
async fn linger(mut stream: TcpStream, timeout: Duration) {
    if stream.shutdown().await.is_err() {
        return;
    }
    let mut rest = (&mut stream).take(1 << 20);
    let mut sink = tokio::io::sink();
    let _ = tokio::time::timeout(timeout, tokio::io::copy(&mut rest, &mut sink)).await;
}
