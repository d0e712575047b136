//! Who may be at the other end of an fd socket: the one rule both ends apply to the user the
//! kernel reports for the other end (`SO_PEERCRED`), before anything else is sent.

/// Whether the process at the other end of an fd-socket connection, running as `peer_uid`,
/// may go on to the request (server) or be asked (client), for a process running as
/// `own_uid`.
///
/// With a shared secret (`with_secret`), any user may: the handshake of [`ferry_core::auth`]
/// that follows is the credential, and a peer without the secret is refused there. That is
/// what lets two pods that run as different users share GPU memory through a socket
/// directory both mount. Without a secret, the user is the only credential there is, so only
/// the same user may: another user's process could otherwise fetch this engine's memory, or
/// pose as the peer engine behind a socket name it bound first.
pub(super) fn admits(peer_uid: u32, own_uid: u32, with_secret: bool) -> bool {
    with_secret || peer_uid == own_uid
}

#[cfg(test)]
mod tests {
    use super::admits;

    #[test]
    fn the_same_user_is_admitted_with_or_without_a_secret() {
        assert!(admits(1000, 1000, false));
        assert!(admits(1000, 1000, true));
        assert!(admits(0, 0, false));
    }

    #[test]
    fn another_user_is_admitted_only_with_a_secret() {
        assert!(!admits(1001, 1000, false));
        assert!(!admits(0, 1000, false), "root is another user too");
        assert!(!admits(1000, 0, false));
        assert!(admits(1001, 1000, true));
        assert!(admits(65534, 0, true));
    }
}
