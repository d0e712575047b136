//! Notifications: small messages that arrive after the data they announce.

use crate::error::{Error, Result};
use futures::Stream;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::sync::mpsc;

/// Why the inbox takes no notification now: the sender hears it as its refusal.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InboxRefusal {
    /// As many notifications as the inbox holds are unread.
    #[error("the receiver's notification inbox is full ({unread} unread); it must read its notifications before more can be delivered")]
    FullCount {
        /// How many the inbox holds.
        unread: usize,
    },
    /// The unread notifications hold as many bytes as the inbox allows.
    #[error("the receiver's notification inbox is full ({held} of its {max} bytes unread, this one needs {bytes}); it must read its notifications before more can be delivered")]
    FullBytes {
        /// Bytes unread.
        held: usize,
        /// Bytes the inbox allows.
        max: usize,
        /// Bytes this notification needs.
        bytes: usize,
    },
    /// The engine is stopping.
    #[error("the engine is shutting down and takes no notifications")]
    ShuttingDown,
    /// The notification is longer than any notification may be.
    #[error("a notification of {bytes} bytes exceeds the {MAX_NOTIFICATION_BYTES}-byte limit")]
    TooLarge {
        /// Its length.
        bytes: usize,
    },
}

/// Largest notification payload, in bytes.
pub const MAX_NOTIFICATION_BYTES: usize = 64 << 10;

/// A message from a peer, delivered after the data of the batch it was sent with is visible.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notification {
    /// The sender's segment name as the sender itself claims it in its hello: unauthenticated,
    /// since any process that reaches the listener can claim any name (with a shared secret,
    /// only a holder of the secret can, but still any name). Show it to people; never connect
    /// to it or answer it as if it were the sender's address: name the peer to answer in your
    /// own configuration and open it with [`crate::Engine::connect`].
    pub from: String,
    /// What the sender attached, such as a request id.
    pub payload: Vec<u8>,
}

impl Notification {
    /// What the notification counts against the inbox's byte bound.
    fn held_bytes(&self) -> usize {
        self.from.len() + self.payload.len()
    }
}

/// The listener's side of the notification inbox: bounded in notifications and in bytes, and
/// never waiting for room (a sender is refused at once instead).
#[derive(Clone)]
pub(crate) struct Inbox {
    sender: mpsc::Sender<Notification>,
    /// Bytes of the notifications queued and not yet read.
    held: Arc<AtomicUsize>,
    max_bytes: usize,
}

/// Room taken in the inbox for one notification; given back if it is dropped undelivered.
pub(crate) struct Room {
    permit: Option<mpsc::OwnedPermit<Notification>>,
    held: Arc<AtomicUsize>,
    bytes: usize,
}

impl Inbox {
    /// An inbox of `slots` notifications and `max_bytes` bytes, with its reading side.
    pub(crate) fn new(
        slots: usize,
        max_bytes: usize,
    ) -> (Inbox, mpsc::Receiver<Notification>, Arc<AtomicUsize>) {
        let (sender, receiver) = mpsc::channel(slots.max(1));
        let held = Arc::new(AtomicUsize::new(0));
        let inbox = Inbox {
            sender,
            held: Arc::clone(&held),
            max_bytes,
        };
        (inbox, receiver, held)
    }

    /// Takes room for a notification of `from` and `payload` bytes, or says why there is none.
    pub(crate) fn reserve(&self, from: &str, payload: &[u8]) -> Result<Room, InboxRefusal> {
        let permit = self
            .sender
            .clone()
            .try_reserve_owned()
            .map_err(|error| match error {
                mpsc::error::TrySendError::Full(_) => InboxRefusal::FullCount {
                    unread: self.sender.max_capacity(),
                },
                mpsc::error::TrySendError::Closed(_) => InboxRefusal::ShuttingDown,
            })?;
        let bytes = from.len() + payload.len();
        let max = self.max_bytes;
        self.held
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                held.checked_add(bytes).filter(|&total| total <= max)
            })
            .map_err(|held| InboxRefusal::FullBytes { held, max, bytes })?;
        Ok(Room {
            permit: Some(permit),
            held: Arc::clone(&self.held),
            bytes,
        })
    }
}

/// The engine's notification inbox as its transports see it: a transport that carries
/// notifications on a path of its own ([`crate::Transport::carries_notifications`]) hands each
/// one in here, and it reaches [`Notifications`] as those the control transport carries do.
#[derive(Clone)]
pub struct InboxHandle {
    inbox: Inbox,
}

impl InboxHandle {
    pub(crate) fn new(inbox: Inbox) -> InboxHandle {
        InboxHandle { inbox }
    }

    /// An inbox of `slots` notifications and `max_bytes` bytes that belongs to no engine,
    /// with the stream that reads it: for testing a transport on its own. `runtime` times
    /// the stream's blocking receives.
    pub fn standalone(
        slots: usize,
        max_bytes: usize,
        runtime: tokio::runtime::Handle,
    ) -> (InboxHandle, Notifications) {
        let (inbox, receiver, held) = Inbox::new(slots, max_bytes);
        let stream = Notifications {
            receiver,
            held,
            handle: runtime,
        };
        (InboxHandle { inbox }, stream)
    }

    /// Takes room for a notification with `payload` from the engine named `from` (the
    /// sender's own claim), or says why there is none: the inbox is full, or the engine is
    /// shutting down. Never waits. Answer the sender first, then [`Reserved::deliver`]: a
    /// receiver that acts on the notification at once (and exits, say) must not cut the
    /// sender off before it heard the answer.
    pub fn reserve(
        &self,
        from: &str,
        payload: Vec<u8>,
    ) -> std::result::Result<Reserved, InboxRefusal> {
        if payload.len() > MAX_NOTIFICATION_BYTES {
            return Err(InboxRefusal::TooLarge {
                bytes: payload.len(),
            });
        }
        let room = self.inbox.reserve(from, &payload)?;
        Ok(Reserved {
            room,
            notification: Notification {
                from: from.to_owned(),
                payload,
            },
        })
    }
}

/// A notification with room taken for it in the inbox ([`InboxHandle::reserve`]); dropped
/// undelivered, it gives the room back.
pub struct Reserved {
    room: Room,
    notification: Notification,
}

impl Reserved {
    /// Hands the notification to the engine's reader.
    pub fn deliver(self) {
        self.room.deliver(self.notification);
    }
}

impl std::fmt::Debug for Reserved {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reserved")
            .field("from", &self.notification.from)
            .field("bytes", &self.notification.payload.len())
            .finish()
    }
}

impl std::fmt::Debug for InboxHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InboxHandle")
            .field("max_bytes", &self.inbox.max_bytes)
            .finish()
    }
}

impl Room {
    /// Hands the notification, made of the `from` and `payload` the room was taken for, to
    /// the reader, who gives its bytes back as it takes it.
    pub(crate) fn deliver(mut self, notification: Notification) {
        if let Some(permit) = self.permit.take() {
            crate::telemetry::notification_received();
            permit.send(notification);
        }
    }
}

impl Drop for Room {
    fn drop(&mut self) {
        if self.permit.is_some() {
            self.held.fetch_sub(self.bytes, Ordering::AcqRel);
        }
    }
}

/// The stream of notifications sent to this engine, in the order each peer sent them.
///
/// Ends when the engine is dropped.
#[derive(Debug)]
pub struct Notifications {
    pub(crate) receiver: mpsc::Receiver<Notification>,
    /// Bytes of the inbox's unread notifications, given back as they are read.
    pub(crate) held: Arc<AtomicUsize>,
    /// The engine's runtime, whose timer bounds [`Notifications::recv_timeout_blocking`].
    pub(crate) handle: tokio::runtime::Handle,
}

/// How long a blocking receive watches for a notification before it sleeps.
const WATCH: Duration = Duration::from_millis(1);

impl Notifications {
    /// Waits for the next notification; `None` once the engine is gone.
    ///
    /// # Cancel safety
    /// Cancel safe: a notification is never lost by dropping this future.
    pub async fn recv(&mut self) -> Option<Notification> {
        let note = self.receiver.recv().await;
        self.taken(note)
    }

    /// Gives the bytes of a notification taken from the inbox back to it.
    fn taken(&self, note: Option<Notification>) -> Option<Notification> {
        if let Some(note) = &note {
            self.held.fetch_sub(note.held_bytes(), Ordering::AcqRel);
        }
        note
    }

    /// The next notification if one is waiting, without waiting: for a scheduler loop that
    /// polls. `Ok(None)` when none is waiting.
    ///
    /// # Errors
    /// [`Error::Shutdown`] once the engine is gone and every notification was read.
    pub fn try_recv(&mut self) -> Result<Option<Notification>> {
        match self.receiver.try_recv() {
            Ok(note) => Ok(self.taken(Some(note))),
            Err(mpsc::error::TryRecvError::Empty) => Ok(None),
            Err(mpsc::error::TryRecvError::Disconnected) => Err(Error::Shutdown {
                what: "the engine's notification stream".into(),
            }),
        }
    }

    /// Blocks the calling thread until the next notification arrives; `Ok(None)` once the
    /// engine is gone. For callers without an async runtime.
    ///
    /// The thread watches for a notification for up to a millisecond before it sleeps, since
    /// waking a sleeping thread costs more than most notifications take to arrive.
    ///
    /// # Errors
    /// [`Error::ApiMisuse`] on a thread of a tokio runtime (await [`Self::recv`] there).
    pub fn recv_blocking(&mut self) -> Result<Option<Notification>> {
        crate::blocking::refuse_on_runtime("Notifications::recv_blocking", "Notifications::recv")?;
        if let Some(note) = self.watch(WATCH) {
            return Ok(note);
        }
        let note = self.receiver.blocking_recv();
        Ok(self.taken(note))
    }

    /// Polls for up to `limit`: `Some(result)` when the stream answered, `None` when it
    /// stayed empty.
    fn watch(&mut self, limit: Duration) -> Option<Option<Notification>> {
        let started = std::time::Instant::now();
        while started.elapsed() < limit {
            match self.receiver.try_recv() {
                Ok(note) => return Some(self.taken(Some(note))),
                Err(mpsc::error::TryRecvError::Disconnected) => return Some(None),
                Err(mpsc::error::TryRecvError::Empty) => std::thread::yield_now(),
            }
        }
        None
    }

    /// Like [`Self::recv_blocking`], but gives up after `timeout`.
    ///
    /// # Errors
    /// [`Error::Timeout`] when nothing arrived in time; [`Error::ApiMisuse`] on a thread of a
    /// tokio runtime (await [`Self::recv`] under `tokio::time::timeout` there).
    pub fn recv_timeout_blocking(&mut self, timeout: Duration) -> Result<Option<Notification>> {
        crate::blocking::refuse_on_runtime(
            "Notifications::recv_timeout_blocking",
            "Notifications::recv",
        )?;
        if let Some(note) = self.watch(WATCH.min(timeout)) {
            return Ok(note);
        }
        let handle = self.handle.clone();
        // The timer is created inside `block_on`, where the engine's runtime is entered.
        let note = handle
            .block_on(async { tokio::time::timeout(timeout, self.receiver.recv()).await })
            .map_err(|_| Error::Timeout {
                what: "waiting for a notification".into(),
                after: timeout,
            })?;
        Ok(self.taken(note))
    }
}

impl Stream for Notifications {
    type Item = Notification;

    fn poll_next(
        mut self: Pin<&mut Self>,
        context: &mut Context<'_>,
    ) -> Poll<Option<Notification>> {
        let note = std::task::ready!(self.receiver.poll_recv(context));
        Poll::Ready(self.taken(note))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_inbox_refuses_past_its_bytes_and_gets_them_back_when_read_or_dropped() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let (inbox, receiver, held) = Inbox::new(10, 100);
        let mut notifications = Notifications {
            receiver,
            held: Arc::clone(&held),
            handle: runtime.handle().clone(),
        };
        let room = inbox.reserve("ab", &[1; 60]).unwrap();
        assert_eq!(held.load(Ordering::Acquire), 62);
        let refused = inbox.reserve("ab", &[2; 40]).err().unwrap();
        assert_eq!(
            refused,
            InboxRefusal::FullBytes {
                held: 62,
                max: 100,
                bytes: 42
            }
        );
        assert!(
            refused
                .to_string()
                .contains("inbox is full (62 of its 100 bytes unread, this one needs 42)"),
            "{refused}"
        );
        drop(room);
        assert_eq!(
            held.load(Ordering::Acquire),
            0,
            "an undelivered room is given back"
        );

        let note = Notification {
            from: "ab".into(),
            payload: vec![3; 98],
        };
        inbox
            .reserve(&note.from, &note.payload)
            .unwrap()
            .deliver(note.clone());
        assert!(inbox.reserve("", &[4]).is_err(), "100 of 100 bytes held");
        assert_eq!(notifications.try_recv().unwrap(), Some(note));
        assert_eq!(
            held.load(Ordering::Acquire),
            0,
            "reading gives the bytes back"
        );
        assert!(inbox.reserve("", &[4; 100]).is_ok());
    }
}
