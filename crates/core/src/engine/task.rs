//! The engine's tasks (a transfer, a notification, a connect): each takes its first step on
//! the caller's thread, and each later step on the thread that wakes it where that thread
//! allows it, else on the engine's runtime.
//!
//! A transfer's copies end when the CUDA event poller sees their event. Handing the rest of
//! the transfer (its notification, its outcome) to a runtime worker cost the wake-up of a
//! parked worker on every transfer: 5-26 us measured on an H200 machine, the largest single
//! part of a small write's latency and of a layer's tail. The poller's thread is awake
//! already, so it marks itself ([`run_wakes_here`]) and takes the step itself. Every other
//! waker (sockets, timers, channels) hands the step to the runtime as before: a waker called
//! there may hold a lock that the task's next step takes.

use parking_lot::Mutex;
use std::cell::Cell;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};

thread_local! {
    /// Whether a wake on this thread may run the woken task's step right here.
    static RUNS_WAKES: Cell<bool> = const { Cell::new(false) };
    /// Whether this thread is inside a task's step: a wake from inside one goes to the
    /// runtime rather than nesting a second step in the first.
    static IN_STEP: Cell<bool> = const { Cell::new(false) };
}

/// Lets wakes on the calling thread run the engine tasks they wake, for a thread that wakes
/// tasks from a loop holding no locks (the CUDA event poller).
pub(crate) fn run_wakes_here() {
    RUNS_WAKES.set(true);
}

/// No step runs and no wake is pending.
const IDLE: u8 = 0;
/// A thread runs steps (or is about to).
const RUNNING: u8 = 1;
/// A wake came while a step ran: the runner takes another step.
const WOKEN: u8 = 2;
/// The future finished or was dropped.
const DONE: u8 = 3;

type Steps = Pin<Box<dyn Future<Output = ()> + Send>>;

/// Runs `future` as a task of the runtime `handle`: its first step now, on this thread.
/// From the first step on which `stopping` says true, the future is dropped unpolled.
pub(crate) fn start(
    handle: &tokio::runtime::Handle,
    stopping: impl Fn() -> bool + Send + Sync + 'static,
    future: impl Future<Output = ()> + Send + 'static,
) {
    let task = Arc::new(Task {
        state: AtomicU8::new(RUNNING),
        future: Mutex::new(Some(Box::pin(future))),
        handle: handle.clone(),
        stopping: Box::new(stopping),
    });
    task.run();
}

struct Task {
    state: AtomicU8,
    /// Touched only by the thread that set [`RUNNING`].
    future: Mutex<Option<Steps>>,
    handle: tokio::runtime::Handle,
    stopping: Box<dyn Fn() -> bool + Send + Sync>,
}

impl Task {
    /// Takes steps until the future waits with no wake pending, or ends; the caller set
    /// [`RUNNING`]. Once it is `stopping` (the engine shutting down), drops the future instead
    /// of polling it, as the runtime's shutdown drops its own tasks.
    fn run(self: &Arc<Self>) {
        let waker = Waker::from(Arc::clone(self));
        let mut context = Context::from_waker(&waker);
        let outer = IN_STEP.replace(true);
        let _runtime = self.handle.enter();
        loop {
            if self.step(&mut context) {
                let future = self.future.lock().take();
                self.state.store(DONE, Ordering::Release);
                drop(future);
                break;
            }
            match self
                .state
                .compare_exchange(RUNNING, IDLE, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => break,
                Err(_) => self.state.store(RUNNING, Ordering::Release),
            }
        }
        IN_STEP.set(outer);
    }

    /// One poll; whether the future is finished with (ended, panicked, or stopping).
    fn step(&self, context: &mut Context<'_>) -> bool {
        if (self.stopping)() {
            return true;
        }
        let mut future = self.future.lock();
        let Some(future) = future.as_mut() else {
            return true;
        };
        // A panic here would otherwise end the waking thread: the CUDA event poller, whose
        // end fails every later GPU transfer of the process. The task ends instead, as a
        // runtime task that panicked would, and its outcome's sender goes with it.
        match std::panic::catch_unwind(AssertUnwindSafe(|| future.as_mut().poll(context))) {
            Ok(Poll::Ready(())) => true,
            Ok(Poll::Pending) => false,
            Err(_) => {
                tracing::error!("an engine task panicked; its caller gets a shutdown error");
                true
            }
        }
    }
}

impl Wake for Task {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        loop {
            match self
                .state
                .compare_exchange(IDLE, RUNNING, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => break,
                Err(RUNNING) => {
                    if self
                        .state
                        .compare_exchange(RUNNING, WOKEN, Ordering::AcqRel, Ordering::Acquire)
                        .is_ok()
                    {
                        return;
                    }
                }
                Err(_) => return,
            }
        }
        if RUNS_WAKES.get() && !IN_STEP.get() {
            self.run();
        } else {
            drop(self.handle.spawn(Resume(Some(Arc::clone(self)))));
        }
    }
}

/// A task's next step, queued on the runtime. Dropped unpolled (the runtime shutting down),
/// it still runs the task, which then drops its future: otherwise the future, whose pending
/// parts hold wakers of the task, would keep itself alive for good.
struct Resume(Option<Arc<Task>>);

impl Future for Resume {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<()> {
        if let Some(task) = self.0.take() {
            task.run();
        }
        Poll::Ready(())
    }
}

impl Drop for Resume {
    fn drop(&mut self) {
        if let Some(task) = self.0.take() {
            task.run();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;
    use std::sync::mpsc;
    use std::thread::ThreadId;
    use std::time::Duration;

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("a test runtime")
    }

    /// Starts a task that reports the thread of each step and waits for `wake` to fire
    /// `steps` times before it ends.
    fn stepping_task(
        handle: &tokio::runtime::Handle,
        wakes: mpsc::Receiver<()>,
        steps: usize,
    ) -> (
        mpsc::Receiver<ThreadId>,
        Arc<Mutex<Option<Waker>>>,
        mpsc::Receiver<()>,
    ) {
        let (threads, stepped) = mpsc::channel();
        let (ended, end) = mpsc::channel();
        let waker: Arc<Mutex<Option<Waker>>> = Arc::default();
        let registered = Arc::clone(&waker);
        let mut seen = 0;
        start(
            handle,
            || false,
            std::future::poll_fn(move |context| {
                threads
                    .send(std::thread::current().id())
                    .expect("the test listens");
                while wakes.try_recv().is_ok() {
                    seen += 1;
                }
                if seen >= steps {
                    ended.send(()).expect("the test listens");
                    return Poll::Ready(());
                }
                *registered.lock() = Some(context.waker().clone());
                Poll::Pending
            }),
        );
        (stepped, waker, end)
    }

    fn wake(waker: &Arc<Mutex<Option<Waker>>>) {
        waker.lock().take().expect("the task waits").wake();
    }

    #[test]
    fn the_first_step_runs_on_the_caller_and_a_marked_thread_runs_the_step_it_wakes() {
        let runtime = runtime();
        let (fire, wakes) = mpsc::channel();
        let (stepped, waker, end) = stepping_task(runtime.handle(), wakes, 1);
        assert_eq!(stepped.recv().unwrap(), std::thread::current().id());
        let marked = std::thread::spawn(move || {
            run_wakes_here();
            fire.send(()).unwrap();
            wake(&waker);
            std::thread::current().id()
        })
        .join()
        .unwrap();
        assert_eq!(
            stepped.recv_timeout(Duration::from_secs(5)).unwrap(),
            marked
        );
        end.recv_timeout(Duration::from_secs(5)).unwrap();
    }

    #[test]
    fn an_unmarked_thread_hands_the_step_it_wakes_to_the_runtime() {
        let runtime = runtime();
        let (fire, wakes) = mpsc::channel();
        let (stepped, waker, end) = stepping_task(runtime.handle(), wakes, 1);
        stepped.recv().unwrap();
        fire.send(()).unwrap();
        wake(&waker);
        let step = stepped.recv_timeout(Duration::from_secs(5)).unwrap();
        assert_ne!(step, std::thread::current().id());
        end.recv_timeout(Duration::from_secs(5)).unwrap();
    }

    #[test]
    fn a_task_that_wakes_itself_inside_its_step_is_stepped_again_not_lost() {
        let runtime = runtime();
        let (done, ended) = mpsc::channel();
        let mut polls = 0;
        start(
            runtime.handle(),
            || false,
            std::future::poll_fn(move |context| {
                polls += 1;
                if polls == 100 {
                    done.send(std::thread::current().id()).unwrap();
                    return Poll::Ready(());
                }
                context.waker().wake_by_ref();
                Poll::Pending
            }),
        );
        // Every step ran on this thread: the wakes came while the step ran.
        assert_eq!(ended.try_recv().unwrap(), std::thread::current().id());
    }

    #[test]
    fn a_stopping_engine_drops_the_future_instead_of_stepping_it() {
        struct Dropped(mpsc::Sender<()>);
        impl Drop for Dropped {
            fn drop(&mut self) {
                let _ = self.0.send(());
            }
        }
        let runtime = runtime();
        let stopping = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stopping);
        let (dropped, gone) = mpsc::channel();
        let guard = Dropped(dropped);
        let waker: Arc<Mutex<Option<Waker>>> = Arc::default();
        let registered = Arc::clone(&waker);
        let (stepped, steps) = mpsc::channel();
        start(
            runtime.handle(),
            move || flag.load(Ordering::SeqCst),
            std::future::poll_fn(move |context| {
                let _held = &guard;
                stepped.send(()).unwrap();
                *registered.lock() = Some(context.waker().clone());
                Poll::<()>::Pending
            }),
        );
        steps.recv().unwrap();
        stopping.store(true, Ordering::SeqCst);
        wake(&waker);
        gone.recv_timeout(Duration::from_secs(5)).unwrap();
        assert!(
            steps.try_recv().is_err(),
            "the stopping task was polled again"
        );
    }

    #[test]
    fn a_panicking_step_ends_its_task_and_spares_the_waking_thread() {
        let runtime = runtime();
        let (sender, receiver) = tokio::sync::oneshot::channel::<()>();
        let waker: Arc<Mutex<Option<Waker>>> = Arc::default();
        let registered = Arc::clone(&waker);
        let mut first = true;
        start(
            runtime.handle(),
            || false,
            std::future::poll_fn(move |context| {
                let _sender = &sender;
                if first {
                    first = false;
                    *registered.lock() = Some(context.waker().clone());
                    return Poll::Pending;
                }
                panic!("a step that panics");
            }),
        );
        let survived = std::thread::spawn(move || {
            run_wakes_here();
            wake(&waker);
            true
        })
        .join();
        assert!(matches!(survived, Ok(true)));
        assert!(futures::executor::block_on(receiver).is_err());
    }

    #[test]
    fn a_step_queued_on_a_runtime_that_shuts_down_still_drops_the_future() {
        let runtime = runtime();
        let stopping = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stopping);
        let (sender, receiver) = tokio::sync::oneshot::channel::<()>();
        let waker: Arc<Mutex<Option<Waker>>> = Arc::default();
        let registered = Arc::clone(&waker);
        start(
            runtime.handle(),
            move || flag.load(Ordering::SeqCst),
            std::future::poll_fn(move |context| {
                let _sender = &sender;
                *registered.lock() = Some(context.waker().clone());
                Poll::<()>::Pending
            }),
        );
        stopping.store(true, Ordering::SeqCst);
        runtime.shutdown_background();
        wake(&waker);
        assert!(futures::executor::block_on(receiver).is_err());
    }
}
