//! Notifications: small messages that arrive after the data they announce.

use crate::error::{Error, Result};
use futures::Stream;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::sync::mpsc;

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

/// The stream of notifications sent to this engine, in the order each peer sent them.
///
/// Ends when the engine is dropped.
#[derive(Debug)]
pub struct Notifications {
    pub(crate) receiver: mpsc::Receiver<Notification>,
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
        self.receiver.recv().await
    }

    /// The next notification if one is waiting, without waiting: for a scheduler loop that
    /// polls. `Ok(None)` when none is waiting.
    ///
    /// # Errors
    /// [`Error::Shutdown`] once the engine is gone and every notification was read.
    pub fn try_recv(&mut self) -> Result<Option<Notification>> {
        match self.receiver.try_recv() {
            Ok(note) => Ok(Some(note)),
            Err(mpsc::error::TryRecvError::Empty) => Ok(None),
            Err(mpsc::error::TryRecvError::Disconnected) => Err(Error::Shutdown {
                what: "the engine's notification stream".into(),
            }),
        }
    }

    /// Blocks the calling thread until the next notification arrives; for callers without an
    /// async runtime. Never call it from inside one.
    ///
    /// The thread watches for a notification for up to a millisecond before it sleeps, since
    /// waking a sleeping thread costs more than most notifications take to arrive.
    pub fn recv_blocking(&mut self) -> Option<Notification> {
        if let Some(note) = self.watch(WATCH) {
            return note;
        }
        self.receiver.blocking_recv()
    }

    /// Polls for up to `limit`: `Some(result)` when the stream answered, `None` when it
    /// stayed empty.
    fn watch(&mut self, limit: Duration) -> Option<Option<Notification>> {
        let started = std::time::Instant::now();
        while started.elapsed() < limit {
            match self.receiver.try_recv() {
                Ok(note) => return Some(Some(note)),
                Err(mpsc::error::TryRecvError::Disconnected) => return Some(None),
                Err(mpsc::error::TryRecvError::Empty) => std::thread::yield_now(),
            }
        }
        None
    }

    /// Like [`Self::recv_blocking`], but gives up after `timeout`. Never call it from inside
    /// an async runtime.
    ///
    /// # Errors
    /// [`Error::Timeout`] when nothing arrived in time.
    pub fn recv_timeout_blocking(&mut self, timeout: Duration) -> Result<Option<Notification>> {
        if let Some(note) = self.watch(WATCH.min(timeout)) {
            return Ok(note);
        }
        let handle = self.handle.clone();
        // The timer is created inside `block_on`, where the engine's runtime is entered.
        handle
            .block_on(async { tokio::time::timeout(timeout, self.receiver.recv()).await })
            .map_err(|_| Error::Timeout {
                what: "waiting for a notification".into(),
                after: timeout,
            })
    }
}

impl Stream for Notifications {
    type Item = Notification;

    fn poll_next(
        mut self: Pin<&mut Self>,
        context: &mut Context<'_>,
    ) -> Poll<Option<Notification>> {
        self.receiver.poll_recv(context)
    }
}
