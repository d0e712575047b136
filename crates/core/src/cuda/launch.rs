//! Queues a transfer's launches so that no queued copy is ever abandoned: when a launch fails
//! part-way, on any stream of any GPU, everything queued before it is still waited for before
//! the transfer lets go of its memory (regions, mappings, staging buffers) and reports the
//! failure.
//!
//! The sequence is written against [`Launcher`], so the rule is tested without a GPU.

use std::future::Future;

/// The launches of one transfer, queued one at a time on the streams of one or more GPUs.
pub trait Launcher {
    /// Fires once the work queued on a stream before it has finished.
    type Fence;

    /// What a failed launch or fence reports.
    type Error: std::fmt::Display;

    /// How many launches the transfer has.
    fn count(&self) -> usize;

    /// The stream launch `index` queues on: a number unique among the streams of every GPU
    /// the transfer uses.
    fn stream(&self, index: usize) -> usize;

    /// Queues launch `index`.
    fn launch(&mut self, index: usize) -> Result<(), Self::Error>;

    /// A fence after everything queued on `stream` so far.
    fn fence(&mut self, stream: usize) -> Result<Self::Fence, Self::Error>;

    /// Blocks until everything queued on `stream` has finished: the last resort when no fence
    /// could be recorded there.
    fn drain(&mut self, stream: usize) -> Result<(), Self::Error>;
}

/// Queues every launch of `launcher` in order, stopping at the first that fails; then waits,
/// through `wait`, for everything queued on every stream that was given work (the failed
/// launch's too: it may have queued part of its work), and only then drops `keep`, which
/// holds what the copies read and write (region uses, peer mappings).
///
/// # Errors
/// The failed launch's error, else the first fence that could not be recorded or reported
/// an error.
///
/// # Cancel safety
/// Dropping the future before it resolves (a runtime shutting down, say) still never lets go
/// of `keep` under queued copies: the drop blocks until every stream given work has drained.
pub async fn launch_all<L, W, F, K>(launcher: L, mut wait: W, keep: K) -> Result<(), L::Error>
where
    L: Launcher,
    W: FnMut(L::Fence) -> F,
    F: Future<Output = Result<(), L::Error>>,
{
    let mut held = Held {
        launcher,
        given_work: Vec::new(),
        keep: Some(keep),
        finished: false,
    };
    let mut failure = None;
    for index in 0..held.launcher.count() {
        let stream = held.launcher.stream(index);
        if !held.given_work.contains(&stream) {
            held.given_work.push(stream);
        }
        if let Err(error) = held.launcher.launch(index) {
            failure = Some(error);
            break;
        }
    }
    let mut waits = Vec::with_capacity(held.given_work.len());
    for stream in held.given_work.clone() {
        match held.launcher.fence(stream) {
            Ok(fence) => waits.push(wait(fence)),
            Err(error) => {
                if let Err(drained) = held.launcher.drain(stream) {
                    // A context that can neither record nor synchronize has failed for good
                    // and runs nothing more, so releasing the memory is safe.
                    tracing::error!(%error, %drained, "a stream's queued copies could not be waited for");
                }
                failure.get_or_insert(error);
            }
        }
    }
    // Every fence to its end, even after one failed: stopping at the first would release the
    // memory under the copies the others guard.
    let waited = futures::future::join_all(waits).await;
    held.finished = true;
    drop(held);
    match failure {
        Some(error) => Err(error),
        None => waited.into_iter().collect(),
    }
}

/// What a transfer's copies use, held until they are known to be done.
struct Held<L: Launcher, K> {
    launcher: L,
    /// Every stream that was given work, in the order first used.
    given_work: Vec<usize>,
    keep: Option<K>,
    /// Set once every fence has fired; until then a drop waits for the streams itself.
    finished: bool,
}

impl<L: Launcher, K> Drop for Held<L, K> {
    fn drop(&mut self) {
        if !self.finished {
            for &stream in &self.given_work {
                if let Err(error) = self.launcher.drain(stream) {
                    tracing::error!(%error, "a dropped transfer's copies could not be waited for");
                }
            }
        }
        drop(self.keep.take());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::{Error, Result};
    use futures::channel::oneshot;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};
    use std::task::{Context, Poll};

    /// What the fake did, in order.
    #[derive(Debug, Clone, PartialEq, Eq)]
    enum Did {
        Launch(usize),
        Fence(usize),
        Drain(usize),
    }

    /// Launch `i` goes to stream `streams[i]`; launch `fail_at` fails, and fences on the
    /// streams in `no_fence` cannot be recorded.
    struct Fake {
        streams: Vec<usize>,
        fail_at: Option<usize>,
        no_fence: Vec<usize>,
        log: Arc<Mutex<Vec<Did>>>,
        fences: Fences,
    }

    impl Launcher for Fake {
        type Fence = oneshot::Receiver<Result<()>>;
        type Error = Error;

        fn count(&self) -> usize {
            self.streams.len()
        }

        fn stream(&self, index: usize) -> usize {
            self.streams[index]
        }

        fn launch(&mut self, index: usize) -> Result<()> {
            self.log.lock().unwrap().push(Did::Launch(index));
            match self.fail_at == Some(index) {
                true => Err(Error::internal(format!("launch {index} failed"))),
                false => Ok(()),
            }
        }

        fn fence(&mut self, stream: usize) -> Result<Self::Fence> {
            self.log.lock().unwrap().push(Did::Fence(stream));
            if self.no_fence.contains(&stream) {
                return Err(Error::internal(format!("no fence on stream {stream}")));
            }
            let (sender, receiver) = oneshot::channel();
            self.fences.lock().unwrap().push((stream, sender));
            Ok(receiver)
        }

        fn drain(&mut self, stream: usize) -> Result<()> {
            self.log.lock().unwrap().push(Did::Drain(stream));
            Ok(())
        }
    }

    /// The sending halves of the fences handed out, with their streams.
    type Fences = Arc<Mutex<Vec<(usize, oneshot::Sender<Result<()>>)>>>;

    /// Sets its flag when dropped: stands for the region uses and mappings.
    struct Guard(Arc<AtomicBool>);

    impl Drop for Guard {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    struct Run {
        future: std::pin::Pin<Box<dyn Future<Output = Result<()>>>>,
        log: Arc<Mutex<Vec<Did>>>,
        fences: Fences,
        released: Arc<AtomicBool>,
    }

    fn start(streams: &[usize], fail_at: Option<usize>, no_fence: &[usize]) -> Run {
        let log = Arc::new(Mutex::new(Vec::new()));
        let fences = Arc::new(Mutex::new(Vec::new()));
        let released = Arc::new(AtomicBool::new(false));
        let fake = Fake {
            streams: streams.to_vec(),
            fail_at,
            no_fence: no_fence.to_vec(),
            log: Arc::clone(&log),
            fences: Arc::clone(&fences),
        };
        let wait = |fence: oneshot::Receiver<Result<()>>| async move {
            fence
                .await
                .unwrap_or_else(|_| Err(Error::internal("fence dropped")))
        };
        let future = Box::pin(launch_all(fake, wait, Guard(Arc::clone(&released))));
        Run {
            future,
            log,
            fences,
            released,
        }
    }

    impl Run {
        fn poll(&mut self) -> Poll<Result<()>> {
            self.future
                .as_mut()
                .poll(&mut Context::from_waker(std::task::Waker::noop()))
        }

        /// Fires the fence of `stream` with `outcome`.
        fn fire(&self, stream: usize, outcome: Result<()>) {
            let mut fences = self.fences.lock().unwrap();
            let index = fences
                .iter()
                .position(|(fenced, _)| *fenced == stream)
                .expect("a fence on that stream");
            let (_, sender) = fences.swap_remove(index);
            sender.send(outcome).expect("the run still waits");
        }

        fn log(&self) -> Vec<Did> {
            self.log.lock().unwrap().clone()
        }
    }

    fn launch_error(outcome: Poll<Result<()>>) -> String {
        match outcome {
            Poll::Ready(Err(Error::Internal { what })) => what,
            other => panic!("expected the launch's error, got {other:?}"),
        }
    }

    #[test]
    fn a_failed_launch_waits_for_every_earlier_launch_before_releasing_and_failing() {
        // Launches 0..=2 go to streams 0, 1, 5 (stream 5: the second GPU); launch 3 fails.
        let mut run = start(&[0, 1, 5, 1, 2], Some(3), &[]);
        assert!(run.poll().is_pending());
        assert_eq!(
            run.log(),
            vec![
                Did::Launch(0),
                Did::Launch(1),
                Did::Launch(2),
                Did::Launch(3),
                Did::Fence(0),
                Did::Fence(1),
                Did::Fence(5),
            ],
            "launch 4 never starts, and every stream given work is fenced"
        );
        run.fire(0, Ok(()));
        run.fire(5, Ok(()));
        assert!(run.poll().is_pending(), "stream 1 still runs");
        assert!(
            !run.released.load(Ordering::SeqCst),
            "the memory was released under a queued copy"
        );
        run.fire(1, Ok(()));
        assert_eq!(launch_error(run.poll()), "launch 3 failed");
        assert!(run.released.load(Ordering::SeqCst));
    }

    #[test]
    fn a_failing_first_launch_still_fences_its_own_stream() {
        let mut run = start(&[2, 0], Some(0), &[]);
        assert!(run.poll().is_pending());
        assert_eq!(run.log(), vec![Did::Launch(0), Did::Fence(2)]);
        assert!(!run.released.load(Ordering::SeqCst));
        run.fire(2, Ok(()));
        assert_eq!(launch_error(run.poll()), "launch 0 failed");
        assert!(run.released.load(Ordering::SeqCst));
    }

    #[test]
    fn a_failed_fence_is_waited_for_by_draining_and_the_others_still_run_out() {
        let mut run = start(&[0, 1, 2], None, &[1]);
        assert!(run.poll().is_pending());
        assert_eq!(
            run.log()[3..],
            [Did::Fence(0), Did::Fence(1), Did::Drain(1), Did::Fence(2)]
        );
        run.fire(2, Err(Error::internal("stream 2 failed")));
        assert!(run.poll().is_pending(), "stream 0 still runs");
        assert!(!run.released.load(Ordering::SeqCst));
        run.fire(0, Ok(()));
        assert_eq!(launch_error(run.poll()), "no fence on stream 1");
        assert!(run.released.load(Ordering::SeqCst));
    }

    #[test]
    fn a_fence_that_reports_an_error_fails_the_transfer_after_all_fences_ran_out() {
        let mut run = start(&[0, 1], None, &[]);
        assert!(run.poll().is_pending());
        run.fire(0, Err(Error::internal("copy on stream 0 failed")));
        assert!(run.poll().is_pending());
        assert!(!run.released.load(Ordering::SeqCst));
        run.fire(1, Ok(()));
        assert_eq!(launch_error(run.poll()), "copy on stream 0 failed");
        assert!(run.released.load(Ordering::SeqCst));
    }

    #[test]
    fn a_transfer_whose_launches_all_succeed_resolves_once_every_fence_fired() {
        let mut run = start(&[0, 0, 1], None, &[]);
        assert!(run.poll().is_pending());
        assert_eq!(run.log().len(), 5, "three launches, two fences");
        run.fire(1, Ok(()));
        assert!(run.poll().is_pending());
        run.fire(0, Ok(()));
        assert!(matches!(run.poll(), Poll::Ready(Ok(()))));
        assert!(run.released.load(Ordering::SeqCst));
    }

    #[test]
    fn a_transfer_dropped_while_its_copies_run_drains_every_stream_before_releasing() {
        let mut run = start(&[0, 1, 0, 2], None, &[]);
        assert!(run.poll().is_pending());
        assert!(!run.released.load(Ordering::SeqCst));
        let Run {
            future,
            log,
            released,
            ..
        } = run;
        drop(future);
        assert!(released.load(Ordering::SeqCst));
        let drained: Vec<Did> = log
            .lock()
            .unwrap()
            .iter()
            .filter(|did| matches!(did, Did::Drain(_)))
            .cloned()
            .collect();
        assert_eq!(drained, vec![Did::Drain(0), Did::Drain(1), Did::Drain(2)]);
    }
}
