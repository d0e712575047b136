//! The sending end of a message ring: writes each notification into the shared ring, wakes
//! the reader if it sleeps, and resolves once the reader's verdict comes back over the
//! socket the ring was handed over on, or, where the socket ends first, once the ring says
//! the reader delivered it.

use super::ring::{delivered_through, Pushed, Writer, AWAKE, SLEEPING, STATE_OFFSET};
use super::shared::{futex_wake, SharedMemory};
use super::Verdict;
use ferry_core::cuda::Context;
use ferry_core::{Error, ProtocolViolation, Refusal, Result};
use parking_lot::Mutex;
use std::collections::VecDeque;
use std::sync::atomic::{fence, Ordering};
use std::sync::Arc;
use tokio::net::UnixStream;
use tokio::sync::{oneshot, Notify};

/// Notifications to one peer engine through shared memory.
pub(crate) struct MessageSender {
    memory: Arc<SharedMemory>,
    state: Arc<Mutex<SenderState>>,
    /// Signalled at each verdict, since each frees room in the ring.
    room: Arc<Notify>,
    /// Taken first come first served to write a record, so that sends waiting for room
    /// keep their order.
    turn: tokio::sync::Mutex<()>,
    peer: String,
    verdicts: tokio::task::JoinHandle<()>,
    /// Where each GPU (by ordinal) stores the ring's published position, or `None` where it
    /// cannot ([`Self::device_word`]).
    device_words: Mutex<Vec<(u32, Option<u64>)>>,
}

struct SenderState {
    writer: Writer,
    /// Who waits for each record's verdict, in the order the records were written.
    waiting: VecDeque<Waiting>,
    /// Why the ring stopped carrying messages, once it did.
    closed: Option<String>,
}

impl SenderState {
    /// Queues a wait for the verdict on the record written last.
    fn wait_for_verdict(&mut self) -> oneshot::Receiver<Verdict> {
        let (sender, verdict) = oneshot::channel();
        self.waiting.push_back(Waiting {
            end: self.writer.position(),
            sender,
        });
        verdict
    }
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
        let memory = Arc::new(memory);
        let verdicts = tokio::spawn(read_verdicts(
            socket,
            Arc::clone(&memory),
            Arc::clone(&state),
            Arc::clone(&room),
        ));
        MessageSender {
            memory,
            state,
            room,
            turn: tokio::sync::Mutex::new(()),
            peer,
            verdicts,
            device_words: Mutex::default(),
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

    /// Closes the ring: sends waiting for a verdict whose record the ring says was delivered
    /// succeed, the others fail with [`Error::PeerGone`], and the reader delivers no record it
    /// has not delivered yet, so nothing sent through this ring can arrive after what is sent
    /// next through another path.
    pub(crate) fn close(&self) {
        self.close_trusting(true);
    }

    /// Closes the ring as [`Self::close`] does; `trust_ring` false fails every waiting send,
    /// for a ring whose reader broke the protocol.
    fn close_trusting(&self, trust_ring: bool) {
        let mut state = self.state.lock();
        state.writer.close(self.memory.words());
        state
            .closed
            .get_or_insert_with(|| "the link was closed".into());
        settle(&mut state, &self.memory, trust_ring);
        drop(state);
        self.verdicts.abort();
        self.room.notify_waiters();
        self.wake_reader();
    }

    /// Closes the ring for `reason`, failing every waiting send (see [`Self::close`]).
    fn fail(&self, reason: String) {
        tracing::warn!(peer = %self.peer, %reason, "closing a message ring");
        self.state.lock().closed.get_or_insert(reason);
        self.close_trusting(false);
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
                        let verdict = state.wait_for_verdict();
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
        self.outcome(verdict.await)
    }

    /// What a send reports for the verdict it waited for (none: the ring closed meanwhile).
    fn outcome(
        &self,
        verdict: std::result::Result<Verdict, oneshot::error::RecvError>,
    ) -> Result<()> {
        match verdict {
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

    /// Where GPU `context` stores the ring's published position (word 0) to publish a record
    /// itself ([`Self::write_unpublished`]); `None` where it cannot: a driver or GPU without
    /// 64-bit stream writes, or a ring CUDA would not register (said once in the log).
    pub(crate) fn device_word(&self, context: &Arc<Context>) -> Option<u64> {
        let ordinal = context.ordinal();
        let known = self
            .device_words
            .lock()
            .iter()
            .find(|(gpu, _)| *gpu == ordinal)
            .map(|(_, word)| *word);
        if let Some(word) = known {
            return word;
        }
        let word = match context.can_write_values64() {
            Ok(true) => self
                .memory
                .gpu_page(context)
                .map_err(ToString::to_string)
                .and_then(|page| page.device_addr(context).map_err(|error| error.to_string())),
            Ok(false) => Err("the driver or GPU has no 64-bit stream writes".into()),
            Err(error) => Err(error.to_string()),
        };
        let word = word
            .inspect_err(|reason| tracing::info!(peer = %self.peer, gpu = ordinal, %reason, "this GPU cannot publish notifications into the message ring; the host publishes them once it sees the copies end"))
            .ok();
        self.device_words.lock().push((ordinal, word));
        word
    }

    /// Writes `payload` as the ring's next record without publishing it: a GPU publishes it
    /// by storing [`Unpublished::position`] at [`Self::device_word`] after the copies it
    /// announces, and nothing else goes into the ring until [`Unpublished::published`],
    /// [`Unpublished::withdraw`] or [`Unpublished::abandon`]. `None` when another send holds
    /// the ring, or it is full or closed: the notification then goes the usual way.
    pub(crate) fn write_unpublished(&self, payload: &[u8]) -> Option<Unpublished<'_>> {
        let turn = self.turn.try_lock().ok()?;
        let mut state = self.state.lock();
        if state.closed.is_some() {
            return None;
        }
        let start = state.writer.position();
        match state.writer.write(self.memory.words(), payload) {
            Ok(true) => {}
            Ok(false) => return None,
            Err(corrupt) => {
                tracing::warn!(peer = %self.peer, %corrupt, "closing a message ring");
                state.closed = Some(corrupt.to_string());
                return None;
            }
        }
        let verdict = state.wait_for_verdict();
        let position = state.writer.position();
        drop(state);
        // The record's words must be visible before the device's store of the position is.
        fence(Ordering::SeqCst);
        Some(Unpublished {
            sender: self,
            turn: Some(turn),
            start,
            position,
            verdict,
        })
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

#[cfg(test)]
impl MessageSender {
    /// Stores `position` into the ring's word 0, as a GPU does to publish a record.
    pub(crate) fn store_position(&self, position: u64) {
        self.memory.words()[0].store(position, Ordering::Release);
    }
}

/// A record written into the ring and not yet published, holding the ring's turn
/// ([`MessageSender::write_unpublished`]).
pub(crate) struct Unpublished<'a> {
    sender: &'a MessageSender,
    /// The ring's turn, held until the record is settled: published, withdrawn or abandoned.
    turn: Option<tokio::sync::MutexGuard<'a, ()>>,
    /// Where the record starts.
    start: u64,
    /// The published position that takes the record in.
    position: u64,
    verdict: oneshot::Receiver<Verdict>,
}

impl Unpublished<'_> {
    /// The value whose store at the device word publishes the record.
    pub(crate) fn position(&self) -> u64 {
        self.position
    }

    /// The store of [`Self::position`] has run (the fence after it fired): wakes the reader
    /// should it sleep, lets the next send in, and resolves with the reader's verdict, as
    /// [`MessageSender::send`] does.
    ///
    /// # Errors
    /// As [`MessageSender::send`].
    pub(crate) async fn published(mut self) -> Result<()> {
        let sender = self.sender;
        let unseen = {
            let state = sender.state.lock();
            !state.writer.is_published(sender.memory.words()) && state.closed.is_none()
        };
        if unseen {
            // The device's store ran before its fence fired, so this finds the position there
            // already; a ring whose word says otherwise is not trusted.
            sender.fail(format!(
                "the GPU's store of the ring position {} is not visible after its fence",
                self.position
            ));
        }
        sender.wake_reader();
        self.turn = None;
        sender.outcome((&mut self.verdict).await)
    }

    /// Takes the record back: its store was never queued, so no device will publish it.
    pub(crate) fn withdraw(mut self) {
        let mut state = self.sender.state.lock();
        state.writer.rewind(self.start);
        state.waiting.pop_back();
        drop(state);
        self.turn = None;
    }

    /// The store may or may not have run (the copies before it failed): the ring can no
    /// longer be trusted to carry only what was meant, so it closes and the reader delivers
    /// nothing more from it.
    pub(crate) fn abandon(mut self, reason: &str) {
        self.sender.fail(format!(
            "a notification the GPU was to publish after copies that failed ({reason})"
        ));
        self.turn = None;
    }
}

impl Drop for Unpublished<'_> {
    fn drop(&mut self) {
        if self.turn.is_some() {
            // Dropped unsettled (its transfer was given up): whether a store will still
            // publish it is unknown, so the ring is not trusted further.
            self.sender.fail(
                "a notification left for the GPU to publish was dropped before its copies were seen to end"
                    .into(),
            );
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
async fn read_verdicts(
    mut socket: UnixStream,
    memory: Arc<SharedMemory>,
    state: Arc<Mutex<SenderState>>,
    room: Arc<Notify>,
) {
    // Whether the socket ended as a reader's does (its process gone), rather than with bytes
    // no reader sends, after which nothing else it wrote is trusted either.
    let (reason, trust_ring) = loop {
        let verdict = match Verdict::read(&mut socket).await {
            Ok(verdict) => verdict,
            Err(error) if error.kind() == std::io::ErrorKind::UnexpectedEof => {
                break ("the peer closed its message ring".to_owned(), true);
            }
            Err(error) if error.kind() == std::io::ErrorKind::InvalidData => {
                break (format!("the peer sent a malformed verdict: {error}"), false);
            }
            Err(error) => break (format!("reading the peer's verdicts failed: {error}"), true),
        };
        let waiting = state.lock().waiting.pop_front();
        match waiting {
            // A send that was dropped no longer listens; its record was still taken.
            Some(waiting) => drop(waiting.sender.send(verdict)),
            None => {
                break (
                    "the peer answered a notification that was never sent".to_owned(),
                    false,
                )
            }
        }
        room.notify_waiters();
    };
    let mut state = state.lock();
    state.closed.get_or_insert(reason);
    settle(&mut state, &memory, trust_ring);
    drop(state);
    room.notify_waiters();
}

/// Settles every send still waiting for its verdict once none will come: with `trust_ring`,
/// those whose record ends within what the ring says the reader delivered succeed (it records
/// a delivery before the hand-over and answers after it, so a reader whose process acted on
/// a notification and exited in between did deliver it, and every refusal before it was
/// answered already); the others fail with [`Error::PeerGone`]. A delivered position past
/// what was ever written is no reader's, and settles nothing.
fn settle(state: &mut SenderState, memory: &SharedMemory, trust_ring: bool) {
    let delivered = delivered_through(memory.words());
    let trusted = trust_ring && delivered <= state.writer.position();
    for waiting in state.waiting.drain(..) {
        if trusted && waiting.end <= delivered {
            drop(waiting.sender.send(Verdict::Delivered));
        }
    }
}

/// A send waiting for its verdict.
struct Waiting {
    /// The ring position at the end of its record.
    end: u64,
    sender: oneshot::Sender<Verdict>,
}

#[cfg(test)]
mod tests {
    use super::super::ring::{Reader, DELIVERED};
    use super::super::{create_ring, map_ring};
    use super::*;
    use std::time::Duration;

    /// A sender and, standing in for the peer's reader, its own mapping of the ring and its
    /// end of the socket.
    fn pair() -> (MessageSender, SharedMemory, std::os::unix::net::UnixStream) {
        let (memory, fd) = create_ring().unwrap();
        let seen = map_ring(&fd).unwrap();
        let (ours, theirs) = std::os::unix::net::UnixStream::pair().unwrap();
        ours.set_nonblocking(true).unwrap();
        let sender =
            MessageSender::new(memory, UnixStream::from_std(ours).unwrap(), "decode".into());
        (sender, seen, theirs)
    }

    /// Takes the next record as the reader does, polling for at most 5 s.
    async fn take(reader: &mut Reader, memory: &SharedMemory) -> Vec<u8> {
        for _ in 0..5000 {
            if let Some(payload) = reader.pop(memory.words(), 1 << 16).unwrap() {
                return payload;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        panic!("no record within 5 s");
    }

    #[tokio::test]
    async fn a_reader_gone_after_delivering_but_before_answering_still_counts_as_delivered() {
        let (sender, memory, socket) = pair();
        let mut reader = Reader::default();
        let (sent, ()) = tokio::join!(sender.send(b"first"), async {
            assert_eq!(take(&mut reader, &memory).await, b"first");
            reader.delivering(memory.words());
            drop(socket);
        });
        sent.unwrap();
        assert!(sender.closed().is_some(), "the ring outlived its reader");
    }

    #[tokio::test]
    async fn a_ring_closed_here_after_the_reader_delivered_still_counts_as_delivered() {
        let (sender, memory, _socket) = pair();
        let mut reader = Reader::default();
        let (sent, ()) = tokio::join!(sender.send(b"first"), async {
            assert_eq!(take(&mut reader, &memory).await, b"first");
            reader.delivering(memory.words());
            sender.close();
        });
        sent.unwrap();
    }

    #[tokio::test]
    async fn a_delivered_position_past_what_was_written_settles_nothing() {
        let (sender, memory, socket) = pair();
        let mut reader = Reader::default();
        let (sent, ()) = tokio::join!(sender.send(b"first"), async {
            assert_eq!(take(&mut reader, &memory).await, b"first");
            memory.words()[DELIVERED].store(u64::MAX, Ordering::Release);
            drop(socket);
        });
        assert!(
            matches!(&sent, Err(Error::PeerGone { .. })),
            "a send was settled by a position no reader writes: {sent:?}"
        );
    }

    #[tokio::test]
    async fn a_reader_gone_after_taking_but_before_delivering_leaves_the_send_failed() {
        let (sender, memory, mut socket) = pair();
        let mut reader = Reader::default();
        let (sent, ()) = tokio::join!(
            async {
                sender.send(b"first").await?;
                sender.send(b"second").await
            },
            async {
                assert_eq!(take(&mut reader, &memory).await, b"first");
                reader.delivering(memory.words());
                std::io::Write::write_all(&mut socket, &Verdict::Delivered.encode()).unwrap();
                assert_eq!(take(&mut reader, &memory).await, b"second");
                drop(socket);
            }
        );
        assert!(
            matches!(&sent, Err(Error::PeerGone { .. })),
            "a record taken but never delivered was reported as {sent:?}"
        );
    }
}
