//! The sending end of a message ring: writes each notification into the shared ring, wakes
//! the reader if it sleeps, and resolves once the reader's verdict comes back over the
//! socket the ring was handed over on.

use super::ring::{Pushed, Writer, AWAKE, SLEEPING, STATE_OFFSET};
use super::shared::{futex_wake, SharedMemory};
use super::Verdict;
use ferry_core::{Error, ProtocolViolation, Refusal, Result};
use parking_lot::Mutex;
use std::collections::VecDeque;
use std::sync::atomic::{fence, Ordering};
use std::sync::Arc;
use tokio::net::UnixStream;
use tokio::sync::{oneshot, Notify};

/// Notifications to one peer engine through shared memory.
pub(crate) struct MessageSender {
    memory: SharedMemory,
    state: Arc<Mutex<SenderState>>,
    /// Signalled at each verdict, since each frees room in the ring.
    room: Arc<Notify>,
    /// Taken first come first served to write a record, so that sends waiting for room
    /// keep their order.
    turn: tokio::sync::Mutex<()>,
    peer: String,
    verdicts: tokio::task::JoinHandle<()>,
}

struct SenderState {
    writer: Writer,
    /// Who waits for each record's verdict, in the order the records were written.
    waiting: VecDeque<oneshot::Sender<Verdict>>,
    /// Why the ring stopped carrying messages, once it did.
    closed: Option<String>,
}

impl std::fmt::Debug for MessageSender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MessageSender")
            .field("peer", &self.peer)
            .finish()
    }
}

impl MessageSender {
    /// The sender for the ring in `memory`, whose reader in `peer` answers over `socket`.
    pub(crate) fn new(memory: SharedMemory, socket: UnixStream, peer: String) -> MessageSender {
        let state = Arc::new(Mutex::new(SenderState {
            writer: Writer::default(),
            waiting: VecDeque::new(),
            closed: None,
        }));
        let room = Arc::new(Notify::new());
        let verdicts = tokio::spawn(read_verdicts(socket, Arc::clone(&state), Arc::clone(&room)));
        MessageSender {
            memory,
            state,
            room,
            turn: tokio::sync::Mutex::new(()),
            peer,
            verdicts,
        }
    }

    /// Why the ring no longer carries messages (the reader has gone or broke the protocol,
    /// or [`Self::close`] closed it); `None` while it does.
    pub(crate) fn closed(&self) -> Option<String> {
        self.state.lock().closed.clone()
    }

    /// Tells the reader, through the ring, to deliver no record it has not delivered yet.
    pub(crate) fn stop_delivery(&self) {
        self.state.lock().writer.close(self.memory.words());
    }

    /// Closes the ring: sends waiting for a verdict fail with [`Error::PeerGone`], and the
    /// reader delivers no record it has not delivered yet, so nothing sent through this ring
    /// can arrive after what is sent next through another path.
    pub(crate) fn close(&self) {
        let mut state = self.state.lock();
        state.writer.close(self.memory.words());
        state
            .closed
            .get_or_insert_with(|| "the link was closed".into());
        state.waiting.clear();
        drop(state);
        self.verdicts.abort();
        self.room.notify_waiters();
        self.wake_reader();
    }

    /// Hands `payload` to the peer's inbox; resolves when the peer took it.
    ///
    /// # Errors
    /// [`Error::Rejected`] when the peer's inbox refused it, [`Error::PeerGone`] when the
    /// reader is gone, [`Error::Protocol`] when the ring holds what no reader writes.
    ///
    /// # Cancel safety
    /// Cancel safe: a record is written whole or not at all, so a dropped send leaves the
    /// ring usable; one already written is still delivered.
    pub(crate) async fn send(&self, payload: &[u8]) -> Result<()> {
        let turn = self.turn.lock().await;
        let verdict = loop {
            let room = self.room.notified();
            let mut room = std::pin::pin!(room);
            room.as_mut().enable();
            {
                let mut state = self.state.lock();
                if let Some(reason) = &state.closed {
                    return Err(Error::PeerGone {
                        peer: self.peer.clone(),
                        reason: reason.clone(),
                    });
                }
                match state.writer.push(self.memory.words(), payload) {
                    Ok(Pushed::Published) => {
                        let (sender, verdict) = oneshot::channel();
                        state.waiting.push_back(sender);
                        self.wake_reader();
                        break verdict;
                    }
                    Ok(Pushed::Full) => {}
                    Err(corrupt) => {
                        tracing::warn!(peer = %self.peer, %corrupt, "closing a message ring");
                        state.closed = Some(corrupt.to_string());
                        return Err(Error::Protocol {
                            peer: self.peer.clone(),
                            violation: ProtocolViolation::Malformed(
                                "its message ring's read position",
                            ),
                        });
                    }
                }
            }
            room.await;
        };
        drop(turn);
        match verdict.await {
            Ok(Verdict::Delivered) => Ok(()),
            Ok(Verdict::Refused(reason)) => Err(Error::Rejected {
                peer: self.peer.clone(),
                reason: Refusal::Other(reason),
            }),
            Err(_) => Err(Error::PeerGone {
                peer: self.peer.clone(),
                reason: self
                    .state
                    .lock()
                    .closed
                    .clone()
                    .unwrap_or_else(|| "its message ring closed".into()),
            }),
        }
    }

    /// Wakes the reader if it went to sleep. The fence pairs with the reader's between
    /// declaring itself asleep and looking at the ring once more, so that one of the two
    /// always sees the other. The word is set back to awake before the wake, so a reader that
    /// had not reached its futex yet does not sleep on it.
    fn wake_reader(&self) {
        fence(Ordering::SeqCst);
        let state = self.memory.word32(STATE_OFFSET);
        if state.swap(AWAKE, Ordering::SeqCst) == SLEEPING {
            futex_wake(state);
        }
    }
}

impl Drop for MessageSender {
    fn drop(&mut self) {
        // Closing the socket tells the reader the ring is done with.
        self.verdicts.abort();
    }
}

/// Reads verdicts until the socket closes, hands each to the oldest waiting send, and then
/// fails every send still waiting.
async fn read_verdicts(mut socket: UnixStream, state: Arc<Mutex<SenderState>>, room: Arc<Notify>) {
    let reason = loop {
        let verdict = match Verdict::read(&mut socket).await {
            Ok(verdict) => verdict,
            Err(error) if error.kind() == std::io::ErrorKind::UnexpectedEof => {
                break "the peer closed its message ring".to_owned();
            }
            Err(error) => break format!("reading the peer's verdicts failed: {error}"),
        };
        let waiting = state.lock().waiting.pop_front();
        match waiting {
            // A send that was dropped no longer listens; its record was still taken.
            Some(waiting) => drop(waiting.send(verdict)),
            None => break "the peer answered a notification that was never sent".to_owned(),
        }
        room.notify_waiters();
    };
    let mut state = state.lock();
    state.closed.get_or_insert(reason);
    state.waiting.clear();
    drop(state);
    room.notify_waiters();
}
