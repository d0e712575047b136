//! One thread that turns finished CUDA events into woken futures, so no async worker ever
//! blocks on the GPU. After new work, or work that finished, it spins, then yields its core,
//! for a few milliseconds (most transfers finish within that, and a sleep would add the
//! kernel's timer slack, some 50 us, to every completion); past that it backs off to short
//! sleeps. It parks only once nothing has been outstanding for those few milliseconds: a
//! parked poller took 15-20 us to wake for the next job on an H200 host, longer than a short
//! copy takes, so transfers that follow each other closely would each have waited for it.

use super::error::CudaError;
use super::event::Event;
use crate::error::Error;
use parking_lot::Mutex;
use std::future::Future;
use std::pin::Pin;
use std::sync::mpsc;
use std::sync::OnceLock;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

/// Something the poller can ask "are you done?": a CUDA event, or a fake in tests.
pub trait Pollable: Send + 'static {
    /// `Ok(true)` when done, `Ok(false)` while pending, the error when the work failed.
    fn query(&self) -> Result<bool, CudaError>;
}

impl Pollable for Event {
    fn query(&self) -> Result<bool, CudaError> {
        Event::query(self)
    }
}

impl<T: Pollable + Sync> Pollable for std::sync::Arc<T> {
    fn query(&self) -> Result<bool, CudaError> {
        T::query(self)
    }
}

struct Job {
    source: Box<dyn Pollable>,
    done: oneshot::Sender<Result<(), CudaError>>,
}

/// The poller thread's inbox.
#[derive(Debug)]
pub struct Poller {
    jobs: Mutex<mpsc::Sender<Job>>,
}

/// How long the poller spins after the last new or finished job before it starts sleeping.
const SPIN: Duration = Duration::from_micros(50);
/// How long after the last new or finished job the poller yields instead of sleeping.
const YIELD: Duration = Duration::from_millis(5);
/// The longest sleep between two rounds of queries while work is outstanding.
const MAX_NAP: Duration = Duration::from_micros(20);

impl Poller {
    /// The process-wide poller, started on first use.
    pub fn global() -> &'static Poller {
        static POLLER: OnceLock<Poller> = OnceLock::new();
        POLLER.get_or_init(Poller::start)
    }

    /// Starts a poller thread of its own (tests use one each).
    pub fn start() -> Poller {
        let (jobs, inbox) = mpsc::channel();
        let spawned = std::thread::Builder::new()
            .name("ferry-cuda-poller".into())
            .spawn(move || run(inbox));
        if let Err(error) = spawned {
            tracing::error!(%error, "starting the CUDA event poller failed; GPU transfers will fail");
        }
        Poller {
            jobs: Mutex::new(jobs),
        }
    }

    /// A future that resolves when `source` reports done (or failed).
    pub fn wait(&self, source: impl Pollable) -> Completed {
        let (done, receiver) = oneshot::channel();
        let job = Job {
            source: Box::new(source),
            done,
        };
        // A send error drops the job and its sender, so the future reports the poller gone.
        let _ = self.jobs.lock().send(job);
        Completed { receiver }
    }
}

fn run(inbox: mpsc::Receiver<Job>) {
    // The poller holds no lock while it wakes a job's waiter, and it is awake already: the
    // engine task waiting for the job takes its next step here (see `engine::task`).
    crate::task::run_wakes_here();
    let mut pending: Vec<Job> = Vec::new();
    let mut last_news = Instant::now();
    let mut nap = Duration::from_micros(5);
    loop {
        if pending.is_empty() && last_news.elapsed() >= YIELD {
            match inbox.recv() {
                Ok(job) => pending.push(job),
                Err(_) => return,
            }
            last_news = Instant::now();
        }
        loop {
            match inbox.try_recv() {
                Ok(job) => {
                    pending.push(job);
                    last_news = Instant::now();
                }
                Err(mpsc::TryRecvError::Disconnected) if pending.is_empty() => return,
                Err(_) => break,
            }
        }
        let before = pending.len();
        pending.retain_mut(|job| match job.source.query() {
            Ok(false) => !job.done.is_closed(),
            Ok(true) => {
                finish(job, Ok(()));
                false
            }
            Err(error) => {
                finish(job, Err(error));
                false
            }
        });
        // Work that finishes is news too: jobs queued long before they can run (copies
        // waiting for a layer's compute, say) then finish one after another, and each would
        // otherwise be noticed only after a sleep and the timer's slack.
        if pending.len() < before {
            last_news = Instant::now();
        }
        if pending.is_empty() {
            nap = Duration::from_micros(5);
        }
        // Idle for YIELD with nothing outstanding, the next pass parks in `recv`.
        let idle = last_news.elapsed();
        if idle < SPIN {
            std::hint::spin_loop();
        } else if idle < YIELD {
            std::thread::yield_now();
        } else if !pending.is_empty() {
            std::thread::sleep(nap);
            nap = (nap * 2).min(MAX_NAP);
        }
    }
}

fn finish(job: &mut Job, outcome: Result<(), CudaError>) {
    let (sender, _) = oneshot::channel();
    let done = std::mem::replace(&mut job.done, sender);
    let _ = done.send(outcome);
}

/// Resolves when the polled work is done; [`Error::Cuda`] when the work failed, and
/// [`Error::Internal`] when the poller thread is not running (it could not be started).
///
/// # Cancel safety
/// Dropping it stops nothing on the GPU: the work it watches runs to its end. The poller
/// notices the drop on its next pass and drops the source (an event, say) unqueried.
#[derive(Debug)]
pub struct Completed {
    receiver: oneshot::Receiver<Result<(), CudaError>>,
}

impl Future for Completed {
    type Output = Result<(), Error>;

    fn poll(mut self: Pin<&mut Self>, context: &mut Context<'_>) -> Poll<Self::Output> {
        Pin::new(&mut self.receiver)
            .poll(context)
            .map(|outcome| match outcome {
                Ok(done) => done.map_err(Error::Cuda),
                Err(_) => Err(Error::internal(
                    "the CUDA event poller thread is not running, so GPU work cannot be waited for (see the log for why it did not start)",
                )),
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::task::{waker, ArcWake};
    use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
    use std::sync::Arc;

    /// 0 pending, 1 done, 2 failed.
    struct FakeEvent(Arc<AtomicU8>);

    impl Pollable for FakeEvent {
        fn query(&self) -> Result<bool, CudaError> {
            match self.0.load(Ordering::SeqCst) {
                0 => Ok(false),
                1 => Ok(true),
                _ => Err(CudaError {
                    call: "cuEventQuery",
                    code: Some(700),
                    name: "CUDA_ERROR_ILLEGAL_ADDRESS".into(),
                }),
            }
        }
    }

    #[derive(Default)]
    struct CountingWaker(AtomicUsize);

    impl ArcWake for CountingWaker {
        fn wake_by_ref(this: &Arc<Self>) {
            this.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn drive(state: u8) -> (Result<(), Error>, usize) {
        let poller = Poller::start();
        let flag = Arc::new(AtomicU8::new(0));
        let mut future = poller.wait(FakeEvent(Arc::clone(&flag)));
        let counter = Arc::new(CountingWaker::default());
        let waker = waker(Arc::clone(&counter));
        let mut context = Context::from_waker(&waker);
        assert!(Pin::new(&mut future).poll(&mut context).is_pending());
        assert_eq!(
            counter.0.load(Ordering::SeqCst),
            0,
            "not woken while pending"
        );
        flag.store(state, Ordering::SeqCst);
        let deadline = Instant::now() + Duration::from_secs(5);
        while counter.0.load(Ordering::SeqCst) == 0 {
            assert!(
                Instant::now() < deadline,
                "the poller never woke the future"
            );
            std::thread::yield_now();
        }
        match Pin::new(&mut future).poll(&mut context) {
            Poll::Ready(outcome) => (outcome, counter.0.load(Ordering::SeqCst)),
            Poll::Pending => panic!("woken but not ready"),
        }
    }

    #[test]
    fn a_finished_event_wakes_its_future_once() {
        let (outcome, wakes) = drive(1);
        assert!(outcome.is_ok(), "{outcome:?}");
        assert_eq!(wakes, 1);
    }

    #[test]
    fn jobs_are_seen_while_the_poller_lingers_and_after_it_parked() {
        let poller = Poller::start();
        for pause in [Duration::ZERO, YIELD * 4] {
            std::thread::sleep(pause);
            let flag = Arc::new(AtomicU8::new(1));
            let waiting = poller.wait(FakeEvent(flag));
            let (done, outcome) = mpsc::channel();
            std::thread::spawn(move || done.send(futures::executor::block_on(waiting)));
            let outcome = outcome
                .recv_timeout(Duration::from_secs(5))
                .unwrap_or_else(|_| {
                    panic!("after a pause of {pause:?} the poller never saw the job")
                });
            assert!(outcome.is_ok(), "after a pause of {pause:?}: {outcome:?}");
        }
    }

    #[test]
    fn a_failed_event_is_an_error_not_a_hang() {
        let (outcome, _) = drive(2);
        match outcome {
            Err(Error::Cuda(error)) => assert_eq!(error.code, Some(700)),
            other => panic!("expected the event's CUDA error, got {other:?}"),
        }
    }

    #[test]
    fn a_poller_that_is_gone_is_an_internal_error_not_a_cuda_code() {
        let (done, receiver) = oneshot::channel::<Result<(), CudaError>>();
        drop(done);
        let outcome = futures::executor::block_on(Completed { receiver });
        match outcome {
            Err(Error::Internal { what }) => assert!(what.contains("poller thread"), "{what}"),
            other => panic!("expected an internal error, got {other:?}"),
        }
    }
}
