//! The challenge-response as a state machine: bytes in, bytes out, no I/O and no clock.

use super::Secret;
use crate::error::AuthFailure;
use crate::wire::seal::KEY_LEN;
use hmac::Mac;

/// The first four bytes of the first message of each side.
pub const MAGIC: [u8; 4] = *b"FRYA";
/// The authentication protocol version this build speaks (2: the frames that follow carry
/// integrity tags under [`FrameKeys`]).
pub const VERSION: u8 = 2;
/// Bytes of each side's nonce.
pub const NONCE_LEN: usize = 32;
/// Bytes of the client's first message.
pub const HELLO_LEN: usize = MAGIC.len() + 2 + NONCE_LEN;

/// The client's hello flag asking that the frames after the handshake carry tags.
const TAG_FRAMES: u8 = 1;

const PROOF_LEN: usize = 32;
const CHALLENGE_LEN: usize = MAGIC.len() + 2 + NONCE_LEN + PROOF_LEN;
const PROOF_MESSAGE_LEN: usize = 1 + PROOF_LEN;
const VERDICT_LEN: usize = 1;

/// Codes of the one-byte field that lets a side go on or refuse.
const GO_ON: u8 = 0;
const NO_SECRET: u8 = 1;
const BAD_PROOF: u8 = 2;
const SECRET_REQUIRED: u8 = 3;

/// Which end of the connection a handshake is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The side that connected.
    Client,
    /// The side that accepted.
    Server,
}

impl Role {
    /// What a proof by this role is computed over, before the two nonces.
    fn label(self) -> &'static [u8] {
        match self {
            Role::Client => b"ferry-auth-v1 client",
            Role::Server => b"ferry-auth-v1 server",
        }
    }
}

/// The keys of one connection's frame tags ([`crate::wire::seal`]), one per direction, from
/// the secret and both nonces: each side's sending key is the other's receiving key.
#[derive(Clone)]
pub struct FrameKeys {
    /// Tags the frames this side sends.
    pub send: [u8; KEY_LEN],
    /// Checks the frames this side receives.
    pub receive: [u8; KEY_LEN],
}

impl std::fmt::Debug for FrameKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FrameKeys(..)")
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Stage {
    ServerAwaitsHello,
    ClientAwaitsChallenge,
    ServerAwaitsProof,
    ClientAwaitsVerdict,
    Finished(Result<(), AuthFailure>),
}

/// One side of the handshake described in [`crate::auth`].
///
/// Call order, as a driver does it: send what [`Self::poll_transmit`] hands out; once
/// [`Self::outcome`] is `Some`, stop (after a failure the stream must be closed); otherwise
/// read at most [`Self::wants`] bytes, pass them to [`Self::handle_input`] (or call
/// [`Self::handle_eof`] when the stream ended), and start over. The machine never asks for a
/// byte past its last message, so the stream carries on with the next protocol untouched.
#[derive(Debug)]
pub struct Handshake {
    role: Role,
    secret: Option<Secret>,
    /// Whether the frames after the handshake carry tags: the client's choice, which both
    /// proofs cover so that no one on the path can change it.
    tag_frames: bool,
    client_nonce: [u8; NONCE_LEN],
    server_nonce: [u8; NONCE_LEN],
    stage: Stage,
    /// The message being assembled.
    received: Vec<u8>,
    /// Bytes waiting to be sent.
    transmit: Vec<u8>,
}

impl Handshake {
    /// The connecting side, with its fresh random `nonce` ([`super::nonce`]), asking that the
    /// frames that follow carry tags when `tag_frames`. Its hello is ready to send at once.
    pub fn client(secret: Secret, nonce: [u8; NONCE_LEN], tag_frames: bool) -> Handshake {
        let mut transmit = Vec::with_capacity(HELLO_LEN);
        transmit.extend_from_slice(&MAGIC);
        transmit.push(VERSION);
        transmit.push(if tag_frames { TAG_FRAMES } else { 0 });
        transmit.extend_from_slice(&nonce);
        Handshake {
            role: Role::Client,
            secret: Some(secret),
            tag_frames,
            client_nonce: nonce,
            server_nonce: [0; NONCE_LEN],
            stage: Stage::ClientAwaitsChallenge,
            received: Vec::with_capacity(CHALLENGE_LEN),
            transmit,
        }
    }

    /// The accepting side, with its fresh random `nonce`. Without a secret it only refuses:
    /// it reads a client's hello and answers that this side has no secret.
    pub fn server(secret: Option<Secret>, nonce: [u8; NONCE_LEN]) -> Handshake {
        Handshake {
            role: Role::Server,
            secret,
            tag_frames: false,
            client_nonce: [0; NONCE_LEN],
            server_nonce: nonce,
            stage: Stage::ServerAwaitsHello,
            received: Vec::with_capacity(HELLO_LEN),
            transmit: Vec::new(),
        }
    }

    /// Which side this is.
    pub fn role(&self) -> Role {
        self.role
    }

    /// Bytes to send now, if any.
    pub fn poll_transmit(&mut self) -> Option<Vec<u8>> {
        (!self.transmit.is_empty()).then(|| std::mem::take(&mut self.transmit))
    }

    /// `Some` once the handshake is over and everything to send was handed out: `Ok` when
    /// both sides proved they hold the same secret, the reason otherwise.
    pub fn outcome(&self) -> Option<Result<(), AuthFailure>> {
        match &self.stage {
            Stage::Finished(outcome) if self.transmit.is_empty() => Some(outcome.clone()),
            _ => None,
        }
    }

    /// The connection's frame keys, once both sides proved they hold the secret and the
    /// client asked for tagged frames.
    pub fn frame_keys(&self) -> Option<FrameKeys> {
        let (Stage::Finished(Ok(())), Some(secret), true) =
            (&self.stage, &self.secret, self.tag_frames)
        else {
            return None;
        };
        let key = |label: &[u8]| {
            let mut key = [0u8; KEY_LEN];
            key.copy_from_slice(
                &secret
                    .mac()
                    .chain_update(label)
                    .chain_update(self.client_nonce)
                    .chain_update(self.server_nonce)
                    .finalize()
                    .into_bytes(),
            );
            key
        };
        let to_server = key(b"ferry-frames-v1 client to server");
        let to_client = key(b"ferry-frames-v1 server to client");
        Some(match self.role {
            Role::Client => FrameKeys {
                send: to_server,
                receive: to_client,
            },
            Role::Server => FrameKeys {
                send: to_client,
                receive: to_server,
            },
        })
    }

    /// How many more bytes the machine needs before it can go on; 0 once it is finished.
    pub fn wants(&self) -> usize {
        let have = self.received.len();
        match self.stage {
            // The magic is checked on its own first, so a peer that speaks the frame protocol
            // instead is told apart after four bytes, not after a read that never completes.
            Stage::ServerAwaitsHello | Stage::ClientAwaitsChallenge if have < MAGIC.len() => {
                MAGIC.len() - have
            }
            Stage::ServerAwaitsHello => HELLO_LEN - have,
            Stage::ClientAwaitsChallenge => CHALLENGE_LEN - have,
            Stage::ServerAwaitsProof => PROOF_MESSAGE_LEN - have,
            Stage::ClientAwaitsVerdict => VERDICT_LEN - have,
            Stage::Finished(_) => 0,
        }
    }

    /// Takes received bytes; returns how many it used. It never takes a byte past the
    /// handshake's last message, which belongs to whatever follows on the stream.
    pub fn handle_input(&mut self, bytes: &[u8]) -> usize {
        let mut used = 0;
        while used < bytes.len() && self.wants() > 0 {
            let take = (bytes.len() - used).min(self.wants());
            self.received.extend_from_slice(&bytes[used..used + take]);
            used += take;
            self.step();
        }
        used
    }

    /// Acts on the received bytes once they form a magic to check or a whole message.
    fn step(&mut self) {
        let opening = matches!(
            self.stage,
            Stage::ServerAwaitsHello | Stage::ClientAwaitsChallenge
        );
        if opening && self.received.len() == MAGIC.len() {
            self.check_magic();
        }
        if self.wants() > 0 || matches!(self.stage, Stage::Finished(_)) {
            return;
        }
        let message = std::mem::take(&mut self.received);
        match self.stage {
            Stage::ServerAwaitsHello => self.on_hello(&message),
            Stage::ClientAwaitsChallenge => self.on_challenge(&message),
            Stage::ServerAwaitsProof => self.on_proof(&message),
            Stage::ClientAwaitsVerdict => self.on_verdict(message[0]),
            Stage::Finished(_) => {}
        }
    }

    /// The stream ended: unless the handshake was over, it failed.
    pub fn handle_eof(&mut self) {
        if !matches!(self.stage, Stage::Finished(_)) {
            self.stage = Stage::Finished(Err(AuthFailure::Closed));
        }
    }

    fn check_magic(&mut self) {
        if self.received[..] == MAGIC {
            return;
        }
        let failure = match (&self.stage, &self.secret) {
            // The peer opened with something else, such as a ferry frame: it has no secret.
            (Stage::ServerAwaitsHello, Some(_)) => {
                self.transmit = refusal(SECRET_REQUIRED);
                AuthFailure::PeerHasNoSecret
            }
            (Stage::ServerAwaitsHello, None) => {
                AuthFailure::Malformed("the first message is not an authentication hello")
            }
            _ => AuthFailure::Malformed("the answer to the hello is not an authentication message"),
        };
        self.stage = Stage::Finished(Err(failure));
    }

    fn on_hello(&mut self, hello: &[u8]) {
        let version = hello[MAGIC.len()];
        let flags = hello[MAGIC.len() + 1];
        let failure = if version != VERSION {
            // The client reads this side's version before the code and reports the mismatch.
            self.transmit = refusal(NO_SECRET);
            AuthFailure::Version {
                found: version,
                ours: VERSION,
            }
        } else if flags & !TAG_FRAMES != 0 {
            AuthFailure::Malformed("the hello carries flags this build does not know")
        } else if let Some(secret) = &self.secret {
            self.tag_frames = flags & TAG_FRAMES != 0;
            self.client_nonce.copy_from_slice(&hello[MAGIC.len() + 2..]);
            let proof = self.proof(secret, Role::Server).finalize().into_bytes();
            self.transmit.extend_from_slice(&MAGIC);
            self.transmit.extend_from_slice(&[VERSION, GO_ON]);
            self.transmit.extend_from_slice(&self.server_nonce);
            self.transmit.extend_from_slice(&proof);
            self.stage = Stage::ServerAwaitsProof;
            return;
        } else {
            self.transmit = refusal(NO_SECRET);
            AuthFailure::NoLocalSecret
        };
        self.stage = Stage::Finished(Err(failure));
    }

    fn on_challenge(&mut self, challenge: &[u8]) {
        let version = challenge[MAGIC.len()];
        let code = challenge[MAGIC.len() + 1];
        let failure = match (version, code, &self.secret) {
            (version, _, _) if version != VERSION => AuthFailure::Version {
                found: version,
                ours: VERSION,
            },
            (_, GO_ON, Some(secret)) => {
                let nonce_at = MAGIC.len() + 2;
                self.server_nonce
                    .copy_from_slice(&challenge[nonce_at..nonce_at + NONCE_LEN]);
                let claimed = &challenge[nonce_at + NONCE_LEN..];
                if self
                    .proof(secret, Role::Server)
                    .verify_slice(claimed)
                    .is_ok()
                {
                    let proof = self.proof(secret, Role::Client).finalize().into_bytes();
                    self.transmit.push(GO_ON);
                    self.transmit.extend_from_slice(&proof);
                    self.stage = Stage::ClientAwaitsVerdict;
                    return;
                }
                // Told, so the server logs why instead of a bare close.
                self.transmit.push(BAD_PROOF);
                self.transmit.extend_from_slice(&[0; PROOF_LEN]);
                AuthFailure::PeerProofMismatch
            }
            (_, NO_SECRET, _) => AuthFailure::PeerHasNoSecret,
            _ => AuthFailure::Malformed("the challenge carries an unknown code"),
        };
        self.stage = Stage::Finished(Err(failure));
    }

    fn on_proof(&mut self, message: &[u8]) {
        let outcome = match (message[0], &self.secret) {
            (GO_ON, Some(secret)) => {
                if self
                    .proof(secret, Role::Client)
                    .verify_slice(&message[1..])
                    .is_ok()
                {
                    self.transmit.push(GO_ON);
                    Ok(())
                } else {
                    self.transmit.push(BAD_PROOF);
                    Err(AuthFailure::PeerProofMismatch)
                }
            }
            (BAD_PROOF, _) => Err(AuthFailure::RejectedByPeer),
            _ => Err(AuthFailure::Malformed("the proof carries an unknown code")),
        };
        self.stage = Stage::Finished(outcome);
    }

    fn on_verdict(&mut self, code: u8) {
        self.stage = Stage::Finished(match code {
            GO_ON => Ok(()),
            BAD_PROOF => Err(AuthFailure::RejectedByPeer),
            _ => Err(AuthFailure::Malformed(
                "the verdict carries an unknown code",
            )),
        });
    }

    /// The MAC `prover` sends: keyed with the secret, over its role, both nonces and whether
    /// frames are tagged.
    fn proof(&self, secret: &Secret, prover: Role) -> hmac::Hmac<sha2::Sha256> {
        secret
            .mac()
            .chain_update(prover.label())
            .chain_update(self.client_nonce)
            .chain_update(self.server_nonce)
            .chain_update([u8::from(self.tag_frames)])
    }
}

/// A challenge that refuses with `code`: no nonce, no proof.
fn refusal(code: u8) -> Vec<u8> {
    let mut message = Vec::with_capacity(CHALLENGE_LEN);
    message.extend_from_slice(&MAGIC);
    message.extend_from_slice(&[VERSION, code]);
    message.resize(CHALLENGE_LEN, 0);
    message
}

#[cfg(test)]
#[path = "handshake_tests.rs"]
mod tests;
