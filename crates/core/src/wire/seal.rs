//! Integrity of the frames between two engines that authenticated each other: a tag after
//! each frame, keyed per connection and direction from the handshake ([`crate::auth`]).
//!
//! A tag is the first [`TAG_LEN`] bytes of a keyed BLAKE3 hash over the frame's sequence
//! number in its direction (from 0, little-endian `u64`), its header and its body bytes in
//! order. Frames that carry data to land (`write`, `write-many`) get a first tag right after
//! their address or table, over everything before it, so the receiver knows the destinations
//! are the sender's before a byte lands; their last tag then covers the whole frame. Every
//! other frame gets one tag after its body. Tags are not counted in the header's `len`.
//!
//! The sequence number makes a dropped, repeated or reordered frame fail the next tag, and
//! the per-direction keys keep a frame from being reflected back to its sender. Nothing is
//! encrypted: the bytes stay readable on the path.

use super::{Kind, HEADER_LEN};
use crate::error::ProtocolViolation;

/// Bytes of one tag.
pub const TAG_LEN: usize = 16;

/// Bytes of a direction's key.
pub const KEY_LEN: usize = 32;

/// Whether frames of `kind` carry a first tag after their address or table.
pub fn tags_prefix(kind: Kind) -> bool {
    matches!(kind, Kind::Write | Kind::WriteMany)
}

/// The running hash of one frame in one direction.
struct Running {
    key: [u8; KEY_LEN],
    next: u64,
    hasher: blake3::Hasher,
}

impl Running {
    fn new(key: [u8; KEY_LEN]) -> Running {
        Running {
            key,
            next: 0,
            hasher: blake3::Hasher::new_keyed(&key),
        }
    }

    fn begin(&mut self, header: &[u8; HEADER_LEN]) {
        self.hasher = blake3::Hasher::new_keyed(&self.key);
        self.hasher.update(&self.next.to_le_bytes());
        self.hasher.update(header);
    }

    fn update(&mut self, bytes: &[u8]) {
        self.hasher.update(bytes);
    }

    /// The tag over the frame so far, and the sequence number moved past the frame.
    fn finish(&mut self) -> [u8; TAG_LEN] {
        let tag = self.tag();
        self.next += 1;
        tag
    }

    fn tag(&self) -> [u8; TAG_LEN] {
        let mut tag = [0u8; TAG_LEN];
        tag.copy_from_slice(&self.hasher.finalize().as_bytes()[..TAG_LEN]);
        tag
    }
}

/// Tags the frames one side sends.
pub struct Sealer(Running);

impl Sealer {
    /// A sealer keyed with this side's sending key.
    pub fn new(key: [u8; KEY_LEN]) -> Sealer {
        Sealer(Running::new(key))
    }

    /// Starts the next frame with its encoded header.
    pub fn begin(&mut self, header: &[u8; HEADER_LEN]) {
        self.0.begin(header);
    }

    /// Adds body bytes of the current frame, in the order they are sent.
    pub fn update(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }

    /// The tag over the frame so far, sent before its data.
    pub fn prefix_tag(&self) -> [u8; TAG_LEN] {
        self.0.tag()
    }

    /// The tag that ends the current frame.
    pub fn finish(&mut self) -> [u8; TAG_LEN] {
        self.0.finish()
    }

    /// The tag of a whole frame without a tag before its data: its encoded header and body.
    pub fn seal(&mut self, header: &[u8; HEADER_LEN], body: &[u8]) -> [u8; TAG_LEN] {
        self.begin(header);
        self.update(body);
        self.finish()
    }
}

/// Checks the tags of the frames one side receives.
pub struct Opener(Running);

impl Opener {
    /// An opener keyed with this side's receiving key (the peer's sending key).
    pub fn new(key: [u8; KEY_LEN]) -> Opener {
        Opener(Running::new(key))
    }

    /// Starts the next frame with its header, as received.
    pub fn begin(&mut self, header: &[u8; HEADER_LEN]) {
        self.0.begin(header);
    }

    /// Adds body bytes of the current frame, in the order they arrived.
    pub fn update(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }

    /// Checks the tag that follows a frame's address or table.
    ///
    /// # Errors
    /// [`ProtocolViolation::Tampered`] when it does not match.
    pub fn check_prefix(&self, kind: Kind, tag: &[u8]) -> Result<(), ProtocolViolation> {
        matches(&self.0.tag(), tag, kind)
    }

    /// Checks the tag that ends the current frame.
    ///
    /// # Errors
    /// [`ProtocolViolation::Tampered`] when it does not match; the connection must close.
    pub fn finish(&mut self, kind: Kind, tag: &[u8]) -> Result<(), ProtocolViolation> {
        matches(&self.0.tag(), tag, kind)?;
        self.0.next += 1;
        Ok(())
    }

    /// Checks the tag of a whole frame without a tag before its data: its header as received,
    /// body and tag.
    ///
    /// # Errors
    /// As [`Self::finish`].
    pub fn open(
        &mut self,
        header: &[u8; HEADER_LEN],
        body: &[u8],
        kind: Kind,
        tag: &[u8],
    ) -> Result<(), ProtocolViolation> {
        self.begin(header);
        self.update(body);
        self.finish(kind, tag)
    }
}

/// Compares in time independent of where the tags differ.
fn matches(expected: &[u8; TAG_LEN], found: &[u8], kind: Kind) -> Result<(), ProtocolViolation> {
    let differ = found.len() != TAG_LEN
        || expected
            .iter()
            .zip(found)
            .fold(0u8, |differ, (a, b)| differ | (a ^ b))
            != 0;
    match differ {
        true => Err(ProtocolViolation::Tampered { kind: kind.name() }),
        false => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::Header;

    fn keys() -> ([u8; KEY_LEN], [u8; KEY_LEN]) {
        ([7; KEY_LEN], [9; KEY_LEN])
    }

    /// The tags a sealer gives a write of `data` at `addr`.
    fn sealed_write(sealer: &mut Sealer, addr: u64, data: &[u8]) -> ([u8; TAG_LEN], [u8; TAG_LEN]) {
        let header = Header::new(Kind::Write, 1, 8 + data.len() as u32).encode();
        sealer.begin(&header);
        sealer.update(&addr.to_le_bytes());
        let prefix = sealer.prefix_tag();
        sealer.update(data);
        (prefix, sealer.finish())
    }

    #[test]
    fn tags_check_out_in_order_and_fail_for_any_change() {
        let (send, _) = keys();
        let mut sealer = Sealer::new(send);
        let first = sealed_write(&mut sealer, 0x1000, b"kv bytes");
        let second = sealed_write(&mut sealer, 0x1000, b"kv bytes");
        assert_ne!(first, second, "the sequence number is in the tag");
        let open = |addr: u64, data: &[u8], tags: &[([u8; TAG_LEN], [u8; TAG_LEN])]| {
            let mut opener = Opener::new(send);
            let header = Header::new(Kind::Write, 1, 8 + data.len() as u32).encode();
            tags.iter().try_for_each(|(prefix, end)| {
                opener.begin(&header);
                opener.update(&addr.to_le_bytes());
                opener.check_prefix(Kind::Write, prefix)?;
                opener.update(data);
                opener.finish(Kind::Write, end)
            })
        };
        assert_eq!(open(0x1000, b"kv bytes", &[first, second]), Ok(()));
        let tampered = Err(ProtocolViolation::Tampered { kind: "write" });
        assert_eq!(open(0x1000, b"kv bytez", &[first]), tampered);
        assert_eq!(open(0x2000, b"kv bytes", &[first]), tampered);
        assert_eq!(
            open(0x1000, b"kv bytes", &[second]),
            tampered,
            "replayed out of order"
        );
        assert_eq!(
            open(0x1000, b"kv bytes", &[first, first]),
            tampered,
            "repeated"
        );
        let mut truncated = Opener::new(send);
        truncated.begin(&Header::new(Kind::Ack, 1, 0).encode());
        assert!(truncated.finish(Kind::Ack, &first.1[..8]).is_err());
    }

    #[test]
    fn a_direction_s_tags_do_not_open_with_the_other_key() {
        let (send, receive) = keys();
        let mut sealer = Sealer::new(send);
        let (prefix, _) = sealed_write(&mut sealer, 0x1000, b"kv");
        let mut opener = Opener::new(receive);
        opener.begin(&Header::new(Kind::Write, 1, 10).encode());
        opener.update(&0x1000u64.to_le_bytes());
        assert!(opener.check_prefix(Kind::Write, &prefix).is_err());
    }
}
