//! Counts a batch's outstanding frames and resolves once the last is acknowledged.

use crate::error::{Error, Result};
use parking_lot::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use tokio::sync::oneshot;

/// Shared by all frames of one `Link::transfer` call.
pub(crate) struct Tracker {
    remaining: AtomicUsize,
    failure: Mutex<Option<Error>>,
    done: Mutex<Option<oneshot::Sender<Result<()>>>>,
}

impl Tracker {
    /// A tracker waiting for `frames` completions, and the receiver of its result.
    pub(crate) fn new(frames: usize) -> (Arc<Tracker>, oneshot::Receiver<Result<()>>) {
        let (sender, receiver) = oneshot::channel();
        let tracker = Arc::new(Tracker {
            remaining: AtomicUsize::new(frames),
            failure: Mutex::new(None),
            done: Mutex::new(Some(sender)),
        });
        if frames == 0 {
            tracker.resolve();
        }
        (tracker, receiver)
    }

    fn finish_one(&self, result: Result<()>) {
        if let Err(error) = result {
            let mut failure = self.failure.lock();
            failure.get_or_insert(error);
        }
        if self.remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.resolve();
        }
    }

    fn resolve(&self) {
        let failure = self.failure.lock().take();
        let sender = self.done.lock().take();
        if let Some(sender) = sender {
            let _ = sender.send(failure.map_or(Ok(()), Err));
        }
    }
}

/// One frame's claim on a tracker. Completing it reports the frame's outcome; dropping it
/// unreported (its connection died, the engine shut down) reports the peer as gone.
pub(crate) struct Ticket {
    tracker: Option<Arc<Tracker>>,
    peer: Arc<str>,
}

impl Ticket {
    pub(crate) fn new(tracker: Arc<Tracker>, peer: Arc<str>) -> Self {
        Ticket {
            tracker: Some(tracker),
            peer,
        }
    }

    /// Reports this frame's outcome.
    pub(crate) fn complete(mut self, result: Result<()>) {
        if let Some(tracker) = self.tracker.take() {
            tracker.finish_one(result);
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if let Some(tracker) = self.tracker.take() {
            tracker.finish_one(Err(Error::PeerGone {
                peer: self.peer.to_string(),
                reason: "the connection closed before the peer confirmed the data".into(),
            }));
        }
    }
}
