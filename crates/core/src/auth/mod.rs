//! Peer authentication with a shared secret: a mutual challenge-response at the start of every
//! connection, before anything about registered memory is sent.
//!
//! Engines configured with the same [`Secret`] prove to each other that they hold it; engines
//! without one skip this step and talk as before. One side with a secret and the other without
//! is refused on both sides, with [`crate::AuthFailure::PeerHasNoSecret`] or
//! [`crate::AuthFailure::NoLocalSecret`].
//!
//! # Protocol
//!
//! Four fixed-size messages; `CODE` is 0 to go on, or a refusal code (1: no secret here,
//! 2: your proof does not match, 3: a secret is required):
//!
//! | # | from | bytes | layout |
//! |---|---|---|---|
//! | 1 | client | 38 | `FRYA` · version · flags · client nonce (32) |
//! | 2 | server | 70 | `FRYA` · version · CODE · server nonce (32) · server proof (32) |
//! | 3 | client | 33 | CODE · client proof (32) |
//! | 4 | server | 1 | CODE |
//!
//! A proof is HMAC-SHA256 keyed with the secret over a label naming the prover's role
//! (`ferry-auth-v1 server` or `ferry-auth-v1 client`), the client nonce, the server nonce and
//! the flags byte (bit 0: the frames that follow carry tags; the client's choice, which a path
//! that changes it makes both proofs fail).
//! Both nonces are 32 random bytes per connection, so a recorded proof is worth nothing on
//! another connection, and the role label keeps a server's proof from being reflected back as a
//! client's. The server proves first; the client checks that proof before it sends its own, so
//! a client never hands its proof to a listener that does not hold the secret. Proofs are
//! compared in constant time.
//!
//! A successful handshake that asked for tags also gives both sides the connection's
//! [`FrameKeys`]: HMAC-SHA256 keyed with the secret over `ferry-frames-v1 client to server`
//! (or `server to client`) and both nonces. The TCP transport asks for them on every
//! connection to a non-loopback address and tags every frame that follows
//! ([`crate::wire::seal`]), so bytes altered, dropped or replayed on the path fail the transfer
//! and close the connection. Nothing is encrypted: an attacker on the path can still read the
//! bytes; use a private network or a tunnel where that matters.
//!
//! [`Handshake`] is the protocol as a state machine without I/O; [`client`] and [`server`] drive
//! it over any tokio stream (the TCP transport's connections, nvlink's fd-passing socket).

mod handshake;
pub(crate) mod io;
mod secret;
pub(crate) mod signature;

pub use handshake::{FrameKeys, Handshake, Role, HELLO_LEN, MAGIC, NONCE_LEN, VERSION};
pub use io::{client, server};
pub use secret::{read_secret_file, Secret, SECRET_ENV};
pub use signature::sign_descriptor;

/// Fresh random bytes for a nonce.
///
/// # Errors
/// [`crate::Error::Io`] when the operating system's random source fails.
pub fn nonce() -> crate::Result<[u8; NONCE_LEN]> {
    let mut nonce = [0u8; NONCE_LEN];
    getrandom::fill(&mut nonce).map_err(|error| {
        crate::Error::io(
            "reading random bytes for an authentication nonce",
            std::io::Error::other(error.to_string()),
        )
    })?;
    Ok(nonce)
}
