//! Notifications between processes of one host through shared memory, instead of a round
//! of TCP through the kernel's network stack.
//!
//! The sender of each direction creates a ring ([`ring`]) in a sealed memory file and hands
//! it over on the receiving engine's fd-passing socket, which authenticates the sender as it
//! does for VMM memory. The receiver reads the ring on a thread of its own that polls while
//! messages come and then sleeps on a futex word in the ring, which the sender wakes; the
//! verdict on each message (taken into the inbox, or refused because the inbox is full)
//! goes back over the socket. Where the socket cannot be reached (the two processes are in
//! different network namespaces), notifications keep going over TCP.

mod receiver;
mod ring;
mod sender;
mod shared;

pub(crate) use receiver::Incoming;
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
pub(crate) fn map_ring(fd: &OwnedFd) -> Result<SharedMemory, String> {
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
                let mut end = reason.len().min(MAX_REASON_BYTES);
                while !reason.is_char_boundary(end) {
                    end -= 1;
                }
                let mut bytes = Vec::with_capacity(3 + end);
                bytes.push(1);
                bytes.extend_from_slice(&(end as u16).to_le_bytes());
                bytes.extend_from_slice(&reason.as_bytes()[..end]);
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
                Ok(Verdict::Refused(
                    String::from_utf8_lossy(&reason).into_owned(),
                ))
            }
            other => Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("verdict {other} is neither 0 (delivered) nor 1 (refused)"),
            )),
        }
    }
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
