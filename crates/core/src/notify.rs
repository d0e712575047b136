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
    /// The sender's segment name, as the sender introduced itself (not authenticated: any
    /// process that reaches the listener can claim any name).
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

impl Notifications {
    /// Waits for the next notification; `None` once the engine is gone.
    ///
    /// # Cancel safety
    /// Cancel safe: a notification is never lost by dropping this future.
    pub async fn recv(&mut self) -> Option<Notification> {
        self.receiver.recv().await
    }

    /// Blocks the calling thread until the next notification arrives; for callers without an
    /// async runtime. Never call it from inside one.
    pub fn recv_blocking(&mut self) -> Option<Notification> {
        self.receiver.blocking_recv()
    }

    /// Like [`Self::recv_blocking`], but gives up after `timeout`. Never call it from inside
    /// an async runtime.
    ///
    /// # Errors
    /// [`Error::Timeout`] when nothing arrived in time.
    pub fn recv_timeout_blocking(&mut self, timeout: Duration) -> Result<Option<Notification>> {
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
