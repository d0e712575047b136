use super::*;

fn secret(text: &str) -> Secret {
    Secret::new(format!("{text}-0123456789abcdef").into_bytes()).unwrap()
}

fn nonce(byte: u8) -> [u8; NONCE_LEN] {
    [byte; NONCE_LEN]
}

/// A client's hello as its bytes: magic, `version`, `flags`, a nonce of `byte`s.
fn hello(version: u8, flags: u8, byte: u8) -> Vec<u8> {
    let mut hello = MAGIC.to_vec();
    hello.extend_from_slice(&[version, flags]);
    hello.extend_from_slice(&nonce(byte));
    hello
}

/// Moves bytes between the two machines until both finished; `alter` may change each message
/// in flight (by sender). Fails rather than loops when neither side can go on.
fn drive_altered(
    client: &mut Handshake,
    server: &mut Handshake,
    mut alter: impl FnMut(Role, &mut Vec<u8>),
) -> (Result<(), AuthFailure>, Result<(), AuthFailure>) {
    for _ in 0..16 {
        let moved = deliver(client, server, &mut alter) | deliver(server, client, &mut alter);
        match (client.outcome(), server.outcome()) {
            (Some(client), Some(server)) => return (client, server),
            (Some(_), None) if !moved => server.handle_eof(),
            (None, Some(_)) if !moved => client.handle_eof(),
            _ => {}
        }
    }
    panic!("the handshake did not finish: {client:?} / {server:?}");
}

/// Hands everything `from` has to send to `to`; whether anything moved.
fn deliver(
    from: &mut Handshake,
    to: &mut Handshake,
    alter: &mut impl FnMut(Role, &mut Vec<u8>),
) -> bool {
    let mut moved = false;
    while let Some(mut bytes) = from.poll_transmit() {
        alter(from.role(), &mut bytes);
        moved = true;
        // Bytes a finished side does not take are lost with its closed connection.
        let mut at = 0;
        while at < bytes.len() && to.wants() > 0 {
            at += to.handle_input(&bytes[at..]);
        }
    }
    moved
}

fn drive(
    client: &mut Handshake,
    server: &mut Handshake,
) -> (Result<(), AuthFailure>, Result<(), AuthFailure>) {
    drive_altered(client, server, |_, _| {})
}

#[test]
fn same_secret_authenticates_both_sides() {
    let mut client = Handshake::client(secret("a"), nonce(1), false);
    let mut server = Handshake::server(Some(secret("a")), nonce(2));
    assert_eq!(drive(&mut client, &mut server), (Ok(()), Ok(())));
    assert_eq!(client.wants(), 0);
    assert_eq!(server.wants(), 0);
}

#[test]
fn different_secrets_fail_on_both_sides_with_the_exact_reason() {
    let mut client = Handshake::client(secret("a"), nonce(1), false);
    let mut server = Handshake::server(Some(secret("b")), nonce(2));
    assert_eq!(
        drive(&mut client, &mut server),
        (
            Err(AuthFailure::PeerProofMismatch),
            Err(AuthFailure::RejectedByPeer)
        )
    );
}

#[test]
fn a_server_without_a_secret_refuses_an_authenticating_client() {
    let mut client = Handshake::client(secret("a"), nonce(1), false);
    let mut server = Handshake::server(None, nonce(2));
    assert_eq!(
        drive(&mut client, &mut server),
        (
            Err(AuthFailure::PeerHasNoSecret),
            Err(AuthFailure::NoLocalSecret)
        )
    );
}

#[test]
fn a_server_with_a_secret_refuses_a_plain_frame_after_four_bytes() {
    let mut server = Handshake::server(Some(secret("a")), nonce(2));
    let frame = crate::wire::Header::new(crate::wire::Kind::Hello, 0, 1).encode();
    assert_eq!(server.wants(), 4);
    assert_eq!(server.handle_input(&frame), 4, "only the magic is read");
    assert_eq!(server.outcome(), None, "the refusal is still to be sent");
    let refusal = server.poll_transmit().unwrap();
    assert_eq!(refusal[..4], MAGIC, "a frame reader sees a foreign magic");
    assert_eq!(server.outcome(), Some(Err(AuthFailure::PeerHasNoSecret)));
}

#[test]
fn every_tampered_byte_of_the_server_challenge_fails_the_client() {
    for index in 6..CHALLENGE_LEN {
        let mut client = Handshake::client(secret("a"), nonce(1), false);
        let mut server = Handshake::server(Some(secret("a")), nonce(2));
        let (client_outcome, server_outcome) =
            drive_altered(&mut client, &mut server, |role, bytes| {
                if role == Role::Server && bytes.len() == CHALLENGE_LEN {
                    bytes[index] ^= 0x01;
                }
            });
        assert_eq!(
            client_outcome,
            Err(AuthFailure::PeerProofMismatch),
            "byte {index}"
        );
        assert_eq!(
            server_outcome,
            Err(AuthFailure::RejectedByPeer),
            "byte {index}"
        );
    }
}

#[test]
fn a_tampered_client_proof_fails_the_server() {
    for index in 1..PROOF_MESSAGE_LEN {
        let mut client = Handshake::client(secret("a"), nonce(1), false);
        let mut server = Handshake::server(Some(secret("a")), nonce(2));
        let (client_outcome, server_outcome) =
            drive_altered(&mut client, &mut server, |role, bytes| {
                if role == Role::Client && bytes.len() == PROOF_MESSAGE_LEN {
                    bytes[index] ^= 0x80;
                }
            });
        assert_eq!(
            server_outcome,
            Err(AuthFailure::PeerProofMismatch),
            "byte {index}"
        );
        assert_eq!(
            client_outcome,
            Err(AuthFailure::RejectedByPeer),
            "byte {index}"
        );
    }
}

#[test]
fn a_tampered_hello_nonce_fails_both_sides() {
    let mut client = Handshake::client(secret("a"), nonce(1), false);
    let mut server = Handshake::server(Some(secret("a")), nonce(2));
    let outcome = drive_altered(&mut client, &mut server, |role, bytes| {
        if role == Role::Client && bytes.len() == HELLO_LEN {
            bytes[HELLO_LEN - 1] ^= 0x01;
        }
    });
    assert_eq!(
        outcome,
        (
            Err(AuthFailure::PeerProofMismatch),
            Err(AuthFailure::RejectedByPeer)
        )
    );
}

#[test]
fn truncated_messages_fail_with_closed() {
    // The server's challenge cut short, then the stream ends.
    let mut client = Handshake::client(secret("a"), nonce(1), false);
    let mut server = Handshake::server(Some(secret("a")), nonce(2));
    let hello = client.poll_transmit().unwrap();
    server.handle_input(&hello);
    let challenge = server.poll_transmit().unwrap();
    client.handle_input(&challenge[..CHALLENGE_LEN - 1]);
    assert_eq!(client.outcome(), None);
    client.handle_eof();
    assert_eq!(client.outcome(), Some(Err(AuthFailure::Closed)));
    // The client's hello cut short.
    let mut server = Handshake::server(Some(secret("a")), nonce(2));
    server.handle_input(&hello[..HELLO_LEN - 1]);
    server.handle_eof();
    assert_eq!(server.outcome(), Some(Err(AuthFailure::Closed)));
}

#[test]
fn a_replayed_client_transcript_is_refused() {
    let mut client = Handshake::client(secret("a"), nonce(1), false);
    let mut server = Handshake::server(Some(secret("a")), nonce(2));
    let mut recorded = Vec::new();
    let outcome = drive_altered(&mut client, &mut server, |role, bytes| {
        if role == Role::Client {
            recorded.push(bytes.clone());
        }
    });
    assert_eq!(outcome, (Ok(()), Ok(())));
    // The same hello and proof, replayed to a server that draws a fresh nonce.
    let mut fresh = Handshake::server(Some(secret("a")), nonce(3));
    for message in &recorded {
        fresh.handle_input(message);
        let _ = fresh.poll_transmit();
    }
    assert_eq!(fresh.outcome(), Some(Err(AuthFailure::PeerProofMismatch)));
}

#[test]
fn a_reflected_server_proof_is_not_a_client_proof() {
    // An attacker without the secret sends a hello, takes the server's proof and hands it back
    // as its own.
    let mut server = Handshake::server(Some(secret("a")), nonce(2));
    server.handle_input(&hello(VERSION, 0, 9));
    let challenge = server.poll_transmit().unwrap();
    let mut reflected = vec![GO_ON];
    reflected.extend_from_slice(&challenge[CHALLENGE_LEN - PROOF_LEN..]);
    server.handle_input(&reflected);
    assert_eq!(server.poll_transmit(), Some(vec![BAD_PROOF]));
    assert_eq!(server.outcome(), Some(Err(AuthFailure::PeerProofMismatch)));
}

#[test]
fn a_replayed_server_challenge_fails_a_new_client() {
    let mut client = Handshake::client(secret("a"), nonce(1), false);
    let mut server = Handshake::server(Some(secret("a")), nonce(2));
    let hello = client.poll_transmit().unwrap();
    server.handle_input(&hello);
    let challenge = server.poll_transmit().unwrap();
    let mut later = Handshake::client(secret("a"), nonce(5), false);
    let _ = later.poll_transmit();
    later.handle_input(&challenge);
    let _ = later.poll_transmit();
    assert_eq!(later.outcome(), Some(Err(AuthFailure::PeerProofMismatch)));
}

#[test]
fn another_version_is_named() {
    let mut server = Handshake::server(Some(secret("a")), nonce(2));
    server.handle_input(&hello(VERSION + 1, 0, 1));
    assert!(server.poll_transmit().is_some());
    assert_eq!(
        server.outcome(),
        Some(Err(AuthFailure::Version {
            found: VERSION + 1,
            ours: VERSION,
        }))
    );
}

#[test]
fn byte_at_a_time_input_never_reads_past_the_handshake() {
    let mut client = Handshake::client(secret("a"), nonce(1), false);
    let mut server = Handshake::server(Some(secret("a")), nonce(2));
    let hello = client.poll_transmit().unwrap();
    for byte in hello.chunks(1) {
        assert_eq!(server.handle_input(byte), 1);
    }
    let challenge = server.poll_transmit().unwrap();
    assert_eq!(client.handle_input(&challenge), CHALLENGE_LEN);
    let proof = client.poll_transmit().unwrap();
    let followed = [proof, b"first frame".to_vec()].concat();
    assert_eq!(server.handle_input(&followed), PROOF_MESSAGE_LEN);
    let verdict = server.poll_transmit().unwrap();
    assert_eq!(server.outcome(), Some(Ok(())));
    assert_eq!(
        client.handle_input(&[verdict, b"more".to_vec()].concat()),
        1
    );
    assert_eq!(client.outcome(), Some(Ok(())));
}

#[test]
fn a_client_that_asks_for_tags_gets_mirrored_keys_and_one_that_does_not_gets_none() {
    for tag_frames in [true, false] {
        let mut client = Handshake::client(secret("a"), nonce(1), tag_frames);
        let mut server = Handshake::server(Some(secret("a")), nonce(2));
        assert_eq!(drive(&mut client, &mut server), (Ok(()), Ok(())));
        match (client.frame_keys(), server.frame_keys()) {
            (Some(client), Some(server)) => {
                assert!(tag_frames);
                assert_eq!(client.send, server.receive);
                assert_eq!(client.receive, server.send);
                assert_ne!(client.send, client.receive, "one key per direction");
            }
            (None, None) => assert!(!tag_frames),
            other => panic!("the sides disagree on tags: {other:?}"),
        }
    }
    // Other nonces, other keys.
    let keys = |client_nonce| {
        let mut client = Handshake::client(secret("a"), nonce(client_nonce), true);
        let mut server = Handshake::server(Some(secret("a")), nonce(2));
        assert_eq!(drive(&mut client, &mut server), (Ok(()), Ok(())));
        client.frame_keys().expect("tagged").send
    };
    assert_ne!(keys(1), keys(3));
}

#[test]
fn a_path_that_clears_the_tag_flag_fails_both_proofs() {
    let mut client = Handshake::client(secret("a"), nonce(1), true);
    let mut server = Handshake::server(Some(secret("a")), nonce(2));
    let outcome = drive_altered(&mut client, &mut server, |role, bytes| {
        if role == Role::Client && bytes.len() == HELLO_LEN {
            bytes[MAGIC.len() + 1] = 0;
        }
    });
    assert_eq!(
        outcome,
        (
            Err(AuthFailure::PeerProofMismatch),
            Err(AuthFailure::RejectedByPeer)
        )
    );
    assert!(client.frame_keys().is_none() && server.frame_keys().is_none());
}

#[test]
fn unknown_hello_flags_are_refused() {
    let mut server = Handshake::server(Some(secret("a")), nonce(2));
    server.handle_input(&hello(VERSION, 0x80, 1));
    assert!(matches!(
        server.outcome(),
        Some(Err(AuthFailure::Malformed(_)))
    ));
}
