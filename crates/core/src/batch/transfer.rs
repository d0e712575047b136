//! A submitted batch: the task that moves it, and the future that reports its completion.

use super::pipeline::{slices, Routing, Started};
use super::route::signal_route;
use super::{BatchEngine, Work};
use crate::cuda::Poller;
use crate::error::{Error, Result};
use crate::peer::Peer;
use crate::transport::Notified;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};
use tokio::sync::oneshot;
use tracing::Instrument;

/// What a finished transfer did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completion {
    /// Bytes moved.
    pub bytes: u64,
    /// The transports that carried them.
    pub transports: Vec<&'static str>,
    /// From the start of the transfer to its completion.
    pub elapsed: Duration,
}

/// A submitted batch; resolves once every byte is visible at its destination.
///
/// Until it resolves with `Ok`, the destination ranges are undefined: a transfer that fails
/// may have written part of them (see [`Batch`](crate::Batch)).
///
/// # Cancel safety
/// Dropping it does not stop the transfer: the bytes keep moving, and the regions it uses stay
/// registered (dropping a [`Region`](crate::Region) waits) until it ends or times out.
#[must_use = "a transfer reports its errors only when awaited"]
#[derive(Debug)]
pub struct Transfer {
    receiver: oneshot::Receiver<Result<Completion>>,
}

impl Transfer {
    /// Blocks the calling thread until the transfer completes; for callers without an async
    /// runtime.
    ///
    /// # Errors
    /// [`Error::ApiMisuse`] on a thread of a tokio runtime (await the transfer there; the
    /// refused transfer goes on as if dropped); otherwise as awaiting the transfer.
    pub fn wait(self) -> Result<Completion> {
        crate::blocking::refuse_on_runtime("Transfer::wait", "the Transfer")?;
        // The engine's runtime drives the transfer and sends its outcome down a oneshot, which
        // needs no runtime to receive: the thread parks until the sender wakes it.
        futures::executor::block_on(self)
    }

    /// [`Transfer::wait`] for a latency-critical thread: looks for the outcome for up to
    /// `spin`, yielding the core between looks, and parks only after that. A transfer that
    /// completes within `spin` is seen at once instead of after a parked thread's wake-up,
    /// which costs a 0.6 ms NVLink transfer 5-15% of its rate (measured on an H200); the
    /// thread keeps its core busy meanwhile.
    ///
    /// # Errors
    /// As [`Transfer::wait`].
    pub fn wait_spinning(mut self, spin: Duration) -> Result<Completion> {
        crate::blocking::refuse_on_runtime("Transfer::wait_spinning", "the Transfer")?;
        let started = Instant::now();
        while started.elapsed() < spin {
            match self.receiver.try_recv() {
                Ok(outcome) => return outcome,
                Err(oneshot::error::TryRecvError::Empty) => std::thread::yield_now(),
                Err(oneshot::error::TryRecvError::Closed) => break,
            }
        }
        futures::executor::block_on(self)
    }
}

impl Transfer {
    /// [`Transfer::wait_spinning`] that gives up at `deadline`: `None` then, and the transfer
    /// goes on and may be waited for again. For callers that must look up between waits (a
    /// Python caller runs its signal handlers, so that Ctrl-C stops a blocked program).
    ///
    /// # Errors
    /// As [`Transfer::wait`], in the `Some`.
    pub fn wait_until(&mut self, spin: Duration, deadline: Instant) -> Option<Result<Completion>> {
        if let Err(misuse) =
            crate::blocking::refuse_on_runtime("Transfer::wait_until", "the Transfer")
        {
            return Some(Err(misuse));
        }
        let started = Instant::now();
        while started.elapsed() < spin && Instant::now() < deadline {
            match self.receiver.try_recv() {
                Ok(outcome) => return Some(outcome),
                Err(oneshot::error::TryRecvError::Empty) => std::thread::yield_now(),
                Err(oneshot::error::TryRecvError::Closed) => break,
            }
        }
        let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
        let mut context = Context::from_waker(&waker);
        loop {
            if let Poll::Ready(outcome) = Pin::new(&mut *self).poll(&mut context) {
                return Some(outcome);
            }
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            std::thread::park_timeout(deadline - now);
        }
    }
}

/// Wakes the thread that waits in [`Transfer::wait_until`].
struct Unpark(std::thread::Thread);

impl Wake for Unpark {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }
}

impl Future for Transfer {
    type Output = Result<Completion>;

    fn poll(mut self: Pin<&mut Self>, context: &mut Context<'_>) -> Poll<Self::Output> {
        Pin::new(&mut self.receiver).poll(context).map(|outcome| {
            outcome.unwrap_or_else(|_| {
                Err(Error::Shutdown {
                    what: "the transfer".into(),
                })
            })
        })
    }
}

/// Starts the task that moves `work` and then sends `notification`, and returns the future of
/// its outcome.
pub(super) fn start(
    engine: Arc<dyn BatchEngine>,
    peer: Peer,
    work: Work,
    notification: Option<Vec<u8>>,
) -> Transfer {
    let (sender, receiver) = oneshot::channel();
    let owner = Arc::clone(&engine);
    let span = crate::telemetry::transfer_span(peer.name(), notification.as_deref());
    // Routed and launched on the caller's thread, so the copies start without waiting for a
    // runtime worker to wake; what follows the copies runs on the thread that sees them end.
    owner.run_task(Box::pin(async move {
        let ran = run(engine.as_ref(), &peer, work, notification)
            .instrument(span)
            .await;
        let outcome = match ran {
            Err(error) if engine.shutting_down() => Err(Error::Shutdown {
                what: format!("the transfer (it stopped with: {error})"),
            }),
            outcome => outcome,
        };
        match &outcome {
            Ok(done) => crate::telemetry::transfer_succeeded(
                &peer.shared_name(),
                &done.transports,
                done.bytes,
                done.elapsed,
            ),
            Err(error) => crate::telemetry::transfer_failed(&peer.shared_name(), error),
        }
        let _ = sender.send(outcome);
    }));
    Transfer { receiver }
}

/// Routes and moves `work`, then signals and notifies the peer; what a [`Transfer`] reports.
///
/// A batch of many entries is routed, planned and started a slice at a time ([`slices`]): the
/// copies of the first slice run while the host plans the next, instead of every copy waiting
/// until the last entry is planned.
async fn run(
    engine: &dyn BatchEngine,
    peer: &Peer,
    mut work: Work,
    mut notification: Option<Vec<u8>>,
) -> Result<Completion> {
    let started = Instant::now();
    let available = engine.transports();
    let bytes = work.entries.iter().map(|entry| entry.len).sum::<u64>()
        + work
            .blocks
            .iter()
            .map(|blocks| blocks.copy.bytes())
            .sum::<u64>();
    // Kept (moved, not copied) only to name a refused entry should the peer refuse one, and
    // shared with the checks left for later, which start now to overlap the routing.
    let entries = Arc::new(std::mem::take(&mut work.entries));
    let later = std::mem::take(&mut work.later);
    let checked = (!later.is_empty()).then(|| later.start(Arc::clone(&entries)));
    let mut slices = slices(entries.len());
    let first = slices.next().unwrap_or(0..0);
    let mut routing = Routing::new(engine, peer);
    let (groups, block_groups) = routing
        .route(
            &work.uses,
            (&entries[first.clone()], first.start),
            &work.blocks,
        )
        .await?;
    crate::telemetry::transfer_routed(bytes);
    let signal = match work.signal {
        Some((addr, value)) => Some(signal_route(available, peer, &work.uses, addr, value)?),
        None => None,
    };
    let after = work.after.take();
    let uses = Arc::clone(&work.uses);
    drop(work);
    // A batch that goes whole through the link that carries the peer's notifications hands
    // that link its notification, which it may release right after the copies.
    let only = match (groups.as_slice(), block_groups.as_slice(), first.end) {
        ([(transport, _)], [], end) | ([], [(transport, _)], end) if end == entries.len() => {
            Some(*transport)
        }
        _ => None,
    };
    // A batch with checks left keeps its notification until they passed.
    let handed = match only {
        Some(transport)
            if notification.is_some()
                && signal.is_none()
                && checked.is_none()
                && peer.message_transport(engine.peer_context()) == Some(transport) =>
        {
            notification.take()
        }
        _ => None,
    };
    let limit = engine.transfer_timeout();
    let mut parts = Started::new(limit);
    let mut transports = Vec::new();
    let mut routed = Ok((groups, block_groups));
    loop {
        let begun = match routed {
            Ok(routed) => {
                parts
                    .start(
                        engine,
                        peer,
                        routed,
                        &after,
                        handed.as_deref(),
                        &mut transports,
                    )
                    .await
            }
            Err(error) => Err(error),
        };
        if let Err(error) = begun {
            // Parts already started run to their end before the error is reported: their
            // copies may still be using the regions and mappings.
            parts.finish(peer).await;
            return Err(error);
        }
        let Some(slice) = slices.next() else { break };
        routed = routing
            .route(&uses, (&entries[slice.clone()], slice.start), &[])
            .await;
    }
    let moves_data = !parts.is_empty();
    if let Some(checked) = checked {
        // After every part has started its copies, so that a check run here overlaps them.
        parts
            .begin(Box::pin(
                async move { checked.await.map(|()| Notified::Left) },
            ))
            .await;
    }
    let Some(outcomes) = parts.finish(peer).await else {
        return Err(Error::Timeout {
            what: format!("a transfer of {bytes} bytes to {}", peer.name()),
            after: limit,
        });
    };
    if outcomes
        .iter()
        .any(|outcome| matches!(outcome, Err(Error::Protocol { .. })))
    {
        // A peer that sent what the protocol forbids (a descriptor that does not fit its
        // memory, for one) is trusted with nothing further: every link to it closes.
        peer.close();
    }
    let notified = outcomes
        .into_iter()
        .collect::<Result<Vec<Notified>>>()
        .map_err(|error| {
            let ranges: Vec<(u64, u64)> = entries
                .iter()
                .map(|entry| (entry.remote_addr, entry.len))
                .collect();
            error.in_batch(&ranges)
        })?;
    // The checking thread may hold its share a moment after its answer: then the list is not
    // kept for reuse.
    if let Ok(entries) = Arc::try_unwrap(entries) {
        engine.spares().give(entries);
    }
    match (handed, notified.as_slice()) {
        (Some(_), [Notified::Sent]) => crate::telemetry::notification_sent(),
        (Some(payload), _) => notification = Some(payload),
        (None, _) => {}
    }
    if let (false, Some(event)) = (moves_data, after) {
        // A batch with only a notification waits for its event here, as its data would.
        tokio::time::timeout(limit, Poller::global().wait(event))
            .await
            .map_err(|_| Error::Timeout {
                what: format!("the event a notification to {} was to follow", peer.name()),
                after: limit,
            })??;
    }
    if let Some((transport, remote, addr, value, gpu)) = signal {
        let link = peer.link(engine.transports()[transport].as_ref()).await?;
        // As for the copies: a signal store that was queued runs to its end before its
        // mapping is released, also when the time ran out.
        let mut signalled = std::pin::pin!(link.write_value(remote, addr, value, gpu));
        match tokio::time::timeout(limit, &mut signalled).await {
            Ok(outcome) => outcome?,
            Err(_) => {
                peer.close();
                let _ = signalled.await;
                return Err(Error::Timeout {
                    what: format!("the signal to {}", peer.name()),
                    after: limit,
                });
            }
        }
    }
    if let Some(payload) = notification {
        tokio::time::timeout(limit, peer.notify(engine.peer_context(), &payload))
            .await
            .map_err(|_| Error::Timeout {
                what: format!("a notification to {}", peer.name()),
                after: limit,
            })??;
        crate::telemetry::notification_sent();
    }
    Ok(Completion {
        bytes,
        transports,
        elapsed: started.elapsed(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wait_until_gives_up_at_its_deadline_and_the_outcome_is_still_there_later() {
        let (sender, receiver) = oneshot::channel();
        let mut transfer = Transfer { receiver };
        let started = Instant::now();
        let deadline = started + Duration::from_millis(30);
        assert!(transfer.wait_until(Duration::ZERO, deadline).is_none());
        assert!(started.elapsed() >= Duration::from_millis(30));
        let completing = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            let _ = sender.send(Ok(Completion {
                bytes: 7,
                transports: vec!["tcp"],
                elapsed: Duration::from_millis(1),
            }));
        });
        let waited = Instant::now();
        let outcome = transfer
            .wait_until(Duration::ZERO, Instant::now() + Duration::from_secs(5))
            .expect("the outcome arrives before the deadline");
        assert_eq!(outcome.unwrap().bytes, 7);
        assert!(waited.elapsed() < Duration::from_secs(1), "woken late");
        completing.join().unwrap();
    }
}
