//! Notifications between processes of one host through shared memory, instead of a round
//! of TCP through the kernel's network stack.
//!
//! The sender of each direction creates a ring ([`ring`]) in a sealed memory file and hands
//! it over on the receiving engine's fd-passing socket, which authenticates the sender as it
//! does for VMM memory. The receiver reads its rings on a few threads (up to 127 rings each)
//! that poll while messages come and then sleep on all their rings' futex words at once,
//! which the senders wake; the verdict on each message (taken into the inbox, or refused
//! because the inbox is full) goes back over the socket, a delivery's after the hand-over, with the ring recording
//! deliveries before it so that the sender learns of one even if the socket ends first.
//! Where the socket cannot be reached (the two processes are in different network
//! namespaces and share no socket directory, or run as different users without a shared
//! secret), notifications keep going over TCP.

mod receiver;
mod ring;
mod sender;
mod shared;

#[cfg(test)]
pub(crate) use receiver::RINGS_PER_THREAD;
pub(crate) use receiver::{Incoming, RingReaders, RingSlot};
pub(crate) use sender::MessageSender;
pub(crate) use shared::SharedMemory;

use std::os::fd::OwnedFd;
use tokio::io::AsyncReadExt;

/// Bytes of a refusal's reason sent back at most.
const MAX_REASON_BYTES: usize = 1024;

/// A fresh ring to send through, and the memory file to hand its reader.
pub(crate) fn create_ring() -> std::io::Result<(SharedMemory, OwnedFd)> {
    SharedMemory::create("ferry-messages", ring::RING_BYTES)
}

/// Maps the ring a sender handed over, checking that it cannot change size under the mapping.
pub(crate) fn map_ring(fd: &OwnedFd) -> Result<SharedMemory, shared::RingRefused> {
    SharedMemory::map(fd, ring::RING_BYTES)
}

/// What the reader did with one message, as it tells the sender.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// In the engine's inbox.
    Delivered,
    /// Refused, for this reason.
    Refused(String),
}

impl Verdict {
    /// The verdict on the wire: 0 for delivered; 1, the reason's length (2 bytes,
    /// little-endian) and the reason for refused.
    pub(crate) fn encode(&self) -> Vec<u8> {
        match self {
            Verdict::Delivered => vec![0],
            Verdict::Refused(reason) => {
                let reason = cut(reason);
                let mut bytes = Vec::with_capacity(3 + reason.len());
                bytes.push(1);
                bytes.extend_from_slice(&(reason.len() as u16).to_le_bytes());
                bytes.extend_from_slice(reason.as_bytes());
                bytes
            }
        }
    }

    /// Reads one verdict.
    ///
    /// # Errors
    /// The socket's, and [`std::io::ErrorKind::InvalidData`] for what no reader sends.
    pub(crate) async fn read(
        socket: &mut (impl tokio::io::AsyncRead + Unpin),
    ) -> std::io::Result<Verdict> {
        match socket.read_u8().await? {
            0 => Ok(Verdict::Delivered),
            1 => {
                let len = usize::from(socket.read_u16_le().await?);
                if len > MAX_REASON_BYTES {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::InvalidData,
                        format!(
                            "a refusal's reason of {len} bytes is longer than {MAX_REASON_BYTES}"
                        ),
                    ));
                }
                let mut reason = vec![0; len];
                socket.read_exact(&mut reason).await?;
                // Invalid UTF-8 grows as it is replaced: cut again.
                let reason = String::from_utf8_lossy(&reason);
                Ok(Verdict::Refused(cut(&reason).to_owned()))
            }
            other => Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("verdict {other} is neither 0 (delivered) nor 1 (refused)"),
            )),
        }
    }
}

/// `reason`'s first [`MAX_REASON_BYTES`] bytes at most, ending on a character.
fn cut(reason: &str) -> &str {
    let mut end = reason.len().min(MAX_REASON_BYTES);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    &reason[..end]
}

/// What [`crate::fuzzing::message_ring`] runs: `data` as the words of a ring of 64 data words
/// (8 bytes each, little-endian, missing bytes zero), read by a reader and then written by a
/// writer, and again as a stream of verdicts.
#[cfg(any(fuzzing, test))]
pub(crate) fn fuzz_message_ring(data: &[u8]) -> usize {
    use std::sync::atomic::AtomicU64;
    const MAX_LEN: usize = 4096;
    let word = |index: usize| {
        let mut bytes = [0u8; 8];
        for (offset, byte) in bytes.iter_mut().enumerate() {
            *byte = data.get(index * 8 + offset).copied().unwrap_or(0);
        }
        u64::from_le_bytes(bytes)
    };
    let words: Vec<AtomicU64> = (0..ring::DATA + 64)
        .map(|index| AtomicU64::new(word(index)))
        .collect();
    let mut accepted = 0;
    let mut reader = ring::Reader::default();
    for _ in 0..128 {
        match reader.pop(&words, MAX_LEN) {
            Ok(Some(record)) => {
                assert!(
                    record.len() <= MAX_LEN,
                    "a record of {} bytes",
                    record.len()
                );
                accepted += 1;
            }
            Ok(None) | Err(_) => break,
        }
    }
    let mut writer = ring::Writer::default();
    for chunk in data.chunks(37).take(16) {
        if writer.push(&words, chunk).is_err() {
            break;
        }
    }
    let mut reading = data;
    while let Ok(verdict) = futures::executor::block_on(Verdict::read(&mut reading)) {
        let encoded = verdict.encode();
        let again = futures::executor::block_on(Verdict::read(&mut encoded.as_slice()));
        assert_eq!(
            again.ok(),
            Some(verdict),
            "a verdict that does not read back"
        );
        accepted += 1;
    }
    accepted
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn verdicts_read_back_as_written_and_long_reasons_are_cut_at_a_character() {
        let long = "é".repeat(MAX_REASON_BYTES);
        let mut wire = Vec::new();
        for verdict in [
            Verdict::Delivered,
            Verdict::Refused("the inbox is full".into()),
            Verdict::Refused(long.clone()),
        ] {
            wire.extend(verdict.encode());
        }
        let mut reading = wire.as_slice();
        assert_eq!(
            Verdict::read(&mut reading).await.unwrap(),
            Verdict::Delivered
        );
        assert_eq!(
            Verdict::read(&mut reading).await.unwrap(),
            Verdict::Refused("the inbox is full".into())
        );
        let Verdict::Refused(cut) = Verdict::read(&mut reading).await.unwrap() else {
            panic!("a refusal read back as something else");
        };
        assert!(long.starts_with(&cut) && cut.len() == MAX_REASON_BYTES);
        assert!(reading.is_empty());
    }

    #[tokio::test]
    async fn a_verdict_no_reader_sends_is_invalid_data() {
        for wire in [&[7u8][..], &[1, 0xff, 0xff][..]] {
            let error = Verdict::read(&mut &wire[..]).await.unwrap_err();
            assert_eq!(error.kind(), std::io::ErrorKind::InvalidData, "{wire:?}");
        }
    }
}
