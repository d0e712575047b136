//! Drives a [`Handshake`] over any tokio stream: the TCP transport's connections, and side
//! channels transports open of their own (nvlink's fd-passing socket).

use super::{FrameKeys, Handshake, Secret};
use crate::error::AuthFailure;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Proves `secret` to the listener at the other end of `stream` and checks its proof, within
/// `timeout`.
///
/// # Errors
/// The [`AuthFailure`] that ended the handshake; the stream must then be closed.
///
/// # Cancel safety
/// Not cancel safe: dropped half-way, the stream is left mid-handshake and must be closed.
pub async fn client<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    secret: &Secret,
    timeout: Duration,
) -> Result<(), AuthFailure> {
    let nonce = super::nonce().map_err(|error| AuthFailure::Io(error.to_string()))?;
    bounded(
        drive(stream, Handshake::client(secret.clone(), nonce, false)),
        timeout,
    )
    .await
    .map(drop)
}

/// Checks the proof of the peer at the other end of `stream` against `secret`, within
/// `timeout`. Without a secret, a peer that authenticates is refused with
/// [`AuthFailure::NoLocalSecret`], so it learns why.
///
/// # Errors
/// The [`AuthFailure`] that ended the handshake; the stream must then be closed.
///
/// # Cancel safety
/// Not cancel safe: dropped half-way, the stream is left mid-handshake and must be closed.
pub async fn server<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    secret: Option<&Secret>,
    timeout: Duration,
) -> Result<(), AuthFailure> {
    let nonce = super::nonce().map_err(|error| AuthFailure::Io(error.to_string()))?;
    bounded(
        drive(stream, Handshake::server(secret.cloned(), nonce)),
        timeout,
    )
    .await
    .map(drop)
}

pub(crate) async fn bounded<T>(
    work: impl std::future::Future<Output = Result<T, AuthFailure>>,
    timeout: Duration,
) -> Result<T, AuthFailure> {
    tokio::time::timeout(timeout, work)
        .await
        .unwrap_or(Err(AuthFailure::TimedOut { after: timeout }))
}

/// Runs `handshake` over `stream`; when it succeeded, the connection's frame keys if the
/// client asked for tagged frames.
pub(crate) async fn drive<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    mut handshake: Handshake,
) -> Result<Option<FrameKeys>, AuthFailure> {
    let mut buffer = [0u8; 128];
    loop {
        while let Some(bytes) = handshake.poll_transmit() {
            stream.write_all(&bytes).await.map_err(io_failure)?;
        }
        if let Some(outcome) = handshake.outcome() {
            stream.flush().await.map_err(io_failure)?;
            outcome?;
            return Ok(handshake.frame_keys());
        }
        let wanted = handshake.wants().min(buffer.len());
        match stream.read(&mut buffer[..wanted]).await {
            Ok(0) => handshake.handle_eof(),
            Ok(read) => {
                handshake.handle_input(&buffer[..read]);
            }
            Err(error) => return Err(io_failure(error)),
        }
    }
}

fn io_failure(error: std::io::Error) -> AuthFailure {
    match error.kind() {
        std::io::ErrorKind::UnexpectedEof
        | std::io::ErrorKind::ConnectionReset
        | std::io::ErrorKind::BrokenPipe => AuthFailure::Closed,
        _ => AuthFailure::Io(error.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret(text: &str) -> Secret {
        Secret::new(format!("{text}-0123456789abcdef").into_bytes()).unwrap()
    }

    #[tokio::test]
    async fn the_same_secret_passes_and_another_is_refused_on_both_sides() {
        let limit = Duration::from_secs(5);
        let (mut near, mut far) = tokio::io::duplex(1024);
        let (a, b) = (secret("a"), secret("a"));
        let outcome = tokio::join!(
            client(&mut near, &a, limit),
            server(&mut far, Some(&b), limit)
        );
        assert_eq!(outcome, (Ok(()), Ok(())));

        let (mut near, mut far) = tokio::io::duplex(1024);
        let b = secret("b");
        let (near_side, far_side) = tokio::join!(
            client(&mut near, &a, limit),
            server(&mut far, Some(&b), limit)
        );
        assert_eq!(near_side, Err(AuthFailure::PeerProofMismatch));
        assert!(far_side.is_err());
    }

    #[tokio::test]
    async fn a_server_without_a_secret_refuses_an_authenticating_client() {
        let limit = Duration::from_secs(5);
        let (mut near, mut far) = tokio::io::duplex(1024);
        let a = secret("a");
        let (near_side, far_side) =
            tokio::join!(client(&mut near, &a, limit), server(&mut far, None, limit));
        assert_eq!(near_side, Err(AuthFailure::PeerHasNoSecret));
        assert!(far_side.is_err());
    }
}
