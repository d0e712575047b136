//! Drives a [`Handshake`] over a blocking Unix stream, as the fd-passing socket uses it.

use super::{Handshake, Secret, MAGIC};
use crate::error::AuthFailure;
use std::io::{ErrorKind, Read, Write};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

/// Proves `secret` to the listener at the other end of `stream` and checks its proof, within
/// `timeout`. Leaves the stream's read and write timeouts set; callers set their own after.
///
/// # Errors
/// The [`AuthFailure`] that ended the handshake; the stream must then be closed.
pub fn client(
    stream: &mut UnixStream,
    secret: &Secret,
    timeout: Duration,
) -> Result<(), AuthFailure> {
    let nonce = super::nonce().map_err(|error| AuthFailure::Io(error.to_string()))?;
    drive(stream, Handshake::client(secret.clone(), nonce), timeout)
}

/// Checks the proof of the process at the other end of `stream` against `secret`, within
/// `timeout`. Without a secret, a caller that does not authenticate passes untouched (nothing
/// is read), and one that does is refused with [`AuthFailure::NoLocalSecret`], so it learns why.
///
/// # Errors
/// The [`AuthFailure`] that ended the handshake; the stream must then be closed.
pub fn server(
    stream: &mut UnixStream,
    secret: Option<&Secret>,
    timeout: Duration,
) -> Result<(), AuthFailure> {
    let deadline = Instant::now() + timeout;
    if secret.is_none() && !opens_with_magic(stream, deadline, timeout)? {
        return Ok(());
    }
    let nonce = super::nonce().map_err(|error| AuthFailure::Io(error.to_string()))?;
    drive(stream, Handshake::server(secret.cloned(), nonce), timeout)
}

/// Whether the first bytes waiting on `stream` are an authentication hello's, without taking
/// them off the stream.
fn opens_with_magic(
    stream: &UnixStream,
    deadline: Instant,
    timeout: Duration,
) -> Result<bool, AuthFailure> {
    let mut first = [0u8; MAGIC.len()];
    loop {
        arm(stream, deadline, timeout)?;
        let (peeked, _) = rustix::net::recv(stream, &mut first, rustix::net::RecvFlags::PEEK)
            .map_err(|error| failure(error.into(), timeout))?;
        if peeked == 0 || first[..peeked] != MAGIC[..peeked] {
            return Ok(false);
        }
        if peeked == MAGIC.len() {
            return Ok(true);
        }
        // A prefix of the magic so far; the rest is on its way.
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn drive(
    stream: &mut UnixStream,
    mut handshake: Handshake,
    timeout: Duration,
) -> Result<(), AuthFailure> {
    let deadline = Instant::now() + timeout;
    let mut buffer = [0u8; 128];
    loop {
        while let Some(bytes) = handshake.poll_transmit() {
            arm(stream, deadline, timeout)?;
            stream
                .write_all(&bytes)
                .map_err(|error| failure(error, timeout))?;
        }
        if let Some(outcome) = handshake.outcome() {
            return outcome;
        }
        let wanted = handshake.wants().min(buffer.len());
        arm(stream, deadline, timeout)?;
        match stream.read(&mut buffer[..wanted]) {
            Ok(0) => handshake.handle_eof(),
            Ok(read) => {
                handshake.handle_input(&buffer[..read]);
            }
            Err(error) if error.kind() == ErrorKind::Interrupted => {}
            Err(error) => return Err(failure(error, timeout)),
        }
    }
}

/// Bounds the next read or write by what is left of the handshake's time.
fn arm(stream: &UnixStream, deadline: Instant, timeout: Duration) -> Result<(), AuthFailure> {
    let left = deadline
        .checked_duration_since(Instant::now())
        .filter(|left| !left.is_zero())
        .ok_or(AuthFailure::TimedOut { after: timeout })?;
    stream
        .set_read_timeout(Some(left))
        .and_then(|()| stream.set_write_timeout(Some(left)))
        .map_err(|error| AuthFailure::Io(error.to_string()))
}

fn failure(error: std::io::Error, timeout: Duration) -> AuthFailure {
    match error.kind() {
        ErrorKind::WouldBlock | ErrorKind::TimedOut => AuthFailure::TimedOut { after: timeout },
        ErrorKind::UnexpectedEof | ErrorKind::ConnectionReset | ErrorKind::BrokenPipe => {
            AuthFailure::Closed
        }
        _ => AuthFailure::Io(error.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret(text: &str) -> Secret {
        Secret::new(format!("{text}-0123456789abcdef").into_bytes()).unwrap()
    }

    const LIMIT: Duration = Duration::from_secs(5);

    /// Runs the client on a thread and the server here, over a fresh Unix stream pair.
    fn pair(
        client_secret: Option<Secret>,
        server_secret: Option<Secret>,
    ) -> (Result<(), AuthFailure>, Result<(), AuthFailure>, UnixStream) {
        let (mut near, mut far) = UnixStream::pair().unwrap();
        let client = std::thread::spawn(move || {
            let outcome = match client_secret {
                Some(secret) => client(&mut far, &secret, LIMIT),
                // A client without a secret goes straight to its request, as the fd client does.
                None => far
                    .write_all(&0x1000u64.to_le_bytes())
                    .map_err(|error| failure(error, LIMIT)),
            };
            (outcome, far)
        });
        let served = server(&mut near, server_secret.as_ref(), LIMIT);
        drop(near);
        let (client, far) = client.join().unwrap();
        (client, served, far)
    }

    #[test]
    fn same_secret_authenticates_both_ends_of_a_unix_stream() {
        let (client, server, _) = pair(Some(secret("a")), Some(secret("a")));
        assert_eq!(client, Ok(()));
        assert_eq!(server, Ok(()));
    }

    #[test]
    fn fd_server_refuses_a_client_with_another_secret() {
        let (client, server, _) = pair(Some(secret("a")), Some(secret("b")));
        assert_eq!(client, Err(AuthFailure::PeerProofMismatch));
        assert_eq!(server, Err(AuthFailure::RejectedByPeer));
    }

    #[test]
    fn fd_server_refuses_a_client_without_a_secret_and_reads_no_request() {
        let (client, server, _) = pair(None, Some(secret("a")));
        assert_eq!(
            client,
            Ok(()),
            "the unauthenticated client only wrote its request"
        );
        assert_eq!(server, Err(AuthFailure::PeerHasNoSecret));
    }

    #[test]
    fn fd_server_without_a_secret_refuses_an_authenticating_client() {
        let (client, server, _) = pair(Some(secret("a")), None);
        assert_eq!(client, Err(AuthFailure::PeerHasNoSecret));
        assert_eq!(server, Err(AuthFailure::NoLocalSecret));
    }

    #[test]
    fn fd_server_without_a_secret_leaves_a_plain_request_unread() {
        let (mut near, mut far) = UnixStream::pair().unwrap();
        far.write_all(&0x1000u64.to_le_bytes()).unwrap();
        assert_eq!(server(&mut near, None, LIMIT), Ok(()));
        let mut request = [0u8; 8];
        near.read_exact(&mut request).unwrap();
        assert_eq!(u64::from_le_bytes(request), 0x1000);
    }

    #[test]
    fn a_silent_peer_times_out() {
        let (mut near, _far) = UnixStream::pair().unwrap();
        let limit = Duration::from_millis(100);
        assert_eq!(
            server(&mut near, Some(&secret("a")), limit),
            Err(AuthFailure::TimedOut { after: limit })
        );
    }
}
