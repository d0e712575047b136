//! NIXL notifications over ferry's: each carries the sending agent's name (NIXL keys them by
//! it, also for agents the receiver never added), and a message longer than one ferry
//! notification is cut into pieces sent in order and put back together here.
//!
//! A payload is the marker, a kind byte, the name's length (u32 LE) and the name, then for a
//! whole message the message; for a piece, the message id (u64 LE), the piece's index and the
//! number of pieces (u32 LE each), then the piece.

use ferry::MAX_NOTIFICATION_BYTES;
use std::collections::HashMap;

const MARKER: &[u8; 4] = b"fnx1";
const WHOLE: u8 = 0;
const PIECE: u8 = 1;

/// Longest message accepted in pieces: what vLLM's push-mode registration message reaches for
/// very long prompts, with room to spare.
pub(crate) const MAX_MESSAGE_BYTES: usize = 64 << 20;

/// Bytes of unfinished messages kept at once; a sender past it loses its oldest pieces.
const MAX_PENDING_BYTES: usize = 256 << 20;

/// Bytes of a payload before a whole message from agent `name`.
fn head_bytes(name: &str) -> usize {
    MARKER.len() + 5 + name.len()
}

/// Whether a message of `len` bytes from agent `name` fits one notification.
pub(crate) fn fits_whole(name: &str, len: usize) -> bool {
    head_bytes(name) + len <= MAX_NOTIFICATION_BYTES
}

/// The payloads that carry `msg` from agent `name`: one when it fits, else its pieces.
pub(crate) fn encode(name: &str, id: u64, msg: &[u8]) -> Vec<Vec<u8>> {
    let head = |kind: u8, room: usize| {
        let mut payload = Vec::with_capacity(head_bytes(name) + room);
        payload.extend_from_slice(MARKER);
        payload.push(kind);
        payload.extend_from_slice(&(name.len() as u32).to_le_bytes());
        payload.extend_from_slice(name.as_bytes());
        payload
    };
    if fits_whole(name, msg.len()) {
        let mut payload = head(WHOLE, msg.len());
        payload.extend_from_slice(msg);
        return vec![payload];
    }
    let room = MAX_NOTIFICATION_BYTES - head_bytes(name) - 16;
    let count = msg.len().div_ceil(room) as u32;
    msg.chunks(room)
        .enumerate()
        .map(|(index, piece)| {
            let mut payload = head(PIECE, 16 + piece.len());
            payload.extend_from_slice(&id.to_le_bytes());
            payload.extend_from_slice(&(index as u32).to_le_bytes());
            payload.extend_from_slice(&count.to_le_bytes());
            payload.extend_from_slice(piece);
            payload
        })
        .collect()
}

/// One decoded payload.
#[derive(Debug, PartialEq, Eq)]
enum Part<'a> {
    Whole {
        name: &'a [u8],
        msg: &'a [u8],
    },
    Piece {
        name: &'a [u8],
        id: u64,
        index: u32,
        count: u32,
        piece: &'a [u8],
    },
}

fn take<'a>(bytes: &mut &'a [u8], n: usize) -> Option<&'a [u8]> {
    if bytes.len() < n {
        return None;
    }
    let (head, rest) = bytes.split_at(n);
    *bytes = rest;
    Some(head)
}

fn u32_of(bytes: &mut &[u8]) -> Option<u32> {
    Some(u32::from_le_bytes(take(bytes, 4)?.try_into().ok()?))
}

fn part(payload: &[u8]) -> Option<Part<'_>> {
    let mut rest = payload.strip_prefix(MARKER.as_slice())?;
    let kind = *take(&mut rest, 1)?.first()?;
    let length = usize::try_from(u32_of(&mut rest)?).ok()?;
    let name = take(&mut rest, length)?;
    match kind {
        WHOLE => Some(Part::Whole { name, msg: rest }),
        PIECE => {
            let id = u64::from_le_bytes(take(&mut rest, 8)?.try_into().ok()?);
            let index = u32_of(&mut rest)?;
            let count = u32_of(&mut rest)?;
            Some(Part::Piece {
                name,
                id,
                index,
                count,
                piece: rest,
            })
        }
        _ => None,
    }
}

/// A message whose pieces are still arriving.
struct Pending {
    pieces: Vec<u8>,
    next: u32,
    count: u32,
}

/// Puts pieces back together, per sending engine, agent and message id.
#[derive(Default)]
pub(crate) struct Assembler {
    pending: HashMap<(String, String, u64), Pending>,
    held: usize,
}

impl Assembler {
    /// The message `payload` completes, as (agent name, message), from the engine that
    /// claims to be `from`. A payload not in this form is a whole message of agent `from`.
    pub(crate) fn accept(&mut self, from: &str, payload: &[u8]) -> Option<(String, Vec<u8>)> {
        match part(payload) {
            None => Some((from.to_owned(), payload.to_vec())),
            Some(Part::Whole { name, msg }) => {
                Some((String::from_utf8_lossy(name).into_owned(), msg.to_vec()))
            }
            Some(Part::Piece {
                name,
                id,
                index,
                count,
                piece,
            }) => {
                let name = String::from_utf8_lossy(name).into_owned();
                self.piece(from, name, id, index, count, piece)
            }
        }
    }

    fn piece(
        &mut self,
        from: &str,
        name: String,
        id: u64,
        index: u32,
        count: u32,
        piece: &[u8],
    ) -> Option<(String, Vec<u8>)> {
        let key = (from.to_owned(), name, id);
        if index == 0 {
            self.forget(&key);
            self.pending.insert(
                key.clone(),
                Pending {
                    pieces: Vec::new(),
                    next: 0,
                    count,
                },
            );
        }
        let Some(pending) = self.pending.get_mut(&key) else {
            tracing::warn!(
                "a piece of a notification from {from} came without its first piece; it is dropped"
            );
            return None;
        };
        if index != pending.next || count != pending.count {
            tracing::warn!(
                "a notification from {from} came with its pieces out of order; it is dropped"
            );
            self.forget(&key);
            return None;
        }
        if pending.pieces.len() + piece.len() > MAX_MESSAGE_BYTES
            || self.held + piece.len() > MAX_PENDING_BYTES
        {
            tracing::warn!("a notification from {from} is longer than this agent keeps ({MAX_MESSAGE_BYTES} bytes a message, {MAX_PENDING_BYTES} unfinished); it is dropped");
            self.forget(&key);
            return None;
        }
        pending.pieces.extend_from_slice(piece);
        pending.next += 1;
        self.held += piece.len();
        if pending.next < pending.count {
            return None;
        }
        let done = self.forget(&key)?;
        Some((key.1, done))
    }

    /// Takes the message of `key` out of the unfinished ones; its pieces so far.
    fn forget(&mut self, key: &(String, String, u64)) -> Option<Vec<u8>> {
        let pending = self.pending.remove(key)?;
        self.held -= pending.pieces.len();
        Some(pending.pieces)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_messages_go_whole_and_long_ones_in_pieces_that_come_back_whole() {
        let mut assembler = Assembler::default();
        let short = encode("decode-1", 1, b"req-7:1");
        assert_eq!(short.len(), 1);
        assert_eq!(
            assembler.accept("h:1", &short[0]),
            Some(("decode-1".to_owned(), b"req-7:1".to_vec()))
        );
        let long: Vec<u8> = (0..300_000u32).map(|i| i as u8).collect();
        let pieces = encode("decode-1", 2, &long);
        assert_eq!(pieces.len(), 5);
        assert!(pieces
            .iter()
            .all(|piece| piece.len() <= MAX_NOTIFICATION_BYTES));
        let (last, first) = pieces.split_last().expect("pieces");
        for piece in first {
            assert_eq!(assembler.accept("h:1", piece), None);
        }
        assert_eq!(
            assembler.accept("h:1", last),
            Some(("decode-1".to_owned(), long))
        );
        assert_eq!(assembler.held, 0);
    }

    #[test]
    fn foreign_payloads_are_whole_messages_of_the_claimed_sender_and_broken_pieces_are_dropped() {
        let mut assembler = Assembler::default();
        assert_eq!(
            assembler.accept("h:2", b"plain"),
            Some(("h:2".to_owned(), b"plain".to_vec()))
        );
        let pieces = encode("p", 9, &vec![7u8; 200_000]);
        assert_eq!(assembler.accept("h:2", &pieces[1]), None, "no first piece");
        assert_eq!(assembler.accept("h:2", &pieces[0]), None);
        assert_eq!(assembler.accept("h:2", &pieces[2]), None, "a piece skipped");
        assert_eq!(assembler.held, 0);
        assert_eq!(assembler.accept("h:2", &pieces[3]), None);
        let mut cut = encode("p", 1, b"x").remove(0);
        cut.truncate(7);
        assert_eq!(
            assembler.accept("h:2", &cut),
            Some(("h:2".to_owned(), cut.clone()))
        );
    }
}
