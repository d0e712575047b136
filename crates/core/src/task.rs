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
//! there may hold a lock that the task's next step takes. A task that keeps waking itself
//! (`yield_now`) goes to the runtime after a few steps, so neither a caller nor the poller
//! spins for it.
//!
//! The runtime does not own these tasks, so [`Tasks`] keeps track of them: when the engine
//! stops, a task that nothing will wake again (its event never fires, say) is dropped all the
//! same, as the runtime's shutdown drops its own tasks.
//!
//! Known costs on the poller's thread: a batch of flat entries with `Batch::after` plans and
//! launches its copies there once the event fires, and a transfer that outlives its engine
//! drops the engine's last handle there.

use parking_lot::Mutex;
use std::cell::Cell;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Weak};
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

/// Drops `value` on a thread of its own when called on a thread that runs wakes (where a
/// blocking drop, freeing GPU memory say, would hold up every GPU completion of the process),
/// else right here.
pub(crate) fn drop_off_waking_thread<T: Send + 'static>(value: T) {
    match RUNS_WAKES.get() {
        true => drop_on_own_thread(value),
        false => drop(value),
    }
}

/// Drops `value` on a thread of its own; where no thread can be started, right here (the
/// failed spawn drops the closure that holds it).
fn drop_on_own_thread<T: Send + 'static>(value: T) {
    let _ = std::thread::Builder::new()
        .name("ferry-drop".into())
        .spawn(move || drop(value));
}

/// No step runs and no wake is pending.
const IDLE: u8 = 0;
/// A thread runs steps (or is about to).
const RUNNING: u8 = 1;
/// A wake came while a step ran: the runner takes another step.
const WOKEN: u8 = 2;
/// The future finished or was dropped.
const DONE: u8 = 3;

/// Steps a task takes in a row on one thread because it woke itself, before the rest go to
/// the runtime.
const SELF_WAKES_HERE: u32 = 2;

pub(crate) type Steps = Pin<Box<dyn Future<Output = ()> + Send>>;

/// What one poll of a task's future came to.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Step {
    /// It waits for a wake.
    Pending,
    /// It finished.
    Ended,
    /// It is given up half-way: the engine is stopping, or the poll panicked.
    Abandoned,
}

/// The tasks an engine started, so that stopping it drops those nothing will wake.
#[derive(Default)]
pub(crate) struct Tasks {
    live: Mutex<Vec<Weak<Task>>>,
}

impl Tasks {
    /// Runs `future` as a task of the runtime `handle`: its first step now, on this thread.
    /// From the first step on which `stopping` says true, the future is dropped unpolled.
    pub(crate) fn start(
        &self,
        handle: &tokio::runtime::Handle,
        stopping: impl Fn() -> bool + Send + Sync + 'static,
        future: Steps,
    ) {
        let task = Arc::new(Task {
            state: AtomicU8::new(RUNNING),
            future: Mutex::new(Some(future)),
            handle: handle.clone(),
            stopping: Box::new(stopping),
        });
        {
            let mut live = self.live.lock();
            // Finished tasks leave dead entries: clear them whenever the list doubles, so it
            // stays about as long as the tasks alive.
            if live.len() == live.capacity() {
                live.retain(|task| task.strong_count() > 0);
            }
            live.push(Arc::downgrade(&task));
        }
        task.run();
    }

    /// Drops the future of every task that waits for a wake, on a thread of its own: a
    /// transfer's drop waits for the GPU streams it used, which the caller (an engine being
    /// dropped) must not. A task whose step runs now drops its own future at its next step,
    /// the engine stopping by then.
    pub(crate) fn stop(&self) {
        let tasks: Vec<Arc<Task>> = std::mem::take(&mut *self.live.lock())
            .iter()
            .filter_map(Weak::upgrade)
            .collect();
        let futures: Vec<Steps> = tasks
            .iter()
            .filter_map(|task| task.take_waiting())
            .collect();
        if !futures.is_empty() {
            drop_on_own_thread(futures);
        }
    }
}

struct Task {
    state: AtomicU8,
    /// Touched only by the thread that set [`RUNNING`].
    future: Mutex<Option<Steps>>,
    handle: tokio::runtime::Handle,
    stopping: Box<dyn Fn() -> bool + Send + Sync>,
}

/// Restores [`IN_STEP`] when a run ends, also by a panic.
struct InStep(bool);

impl InStep {
    fn enter() -> InStep {
        InStep(IN_STEP.replace(true))
    }
}

impl Drop for InStep {
    fn drop(&mut self) {
        IN_STEP.set(self.0);
    }
}

impl Task {
    /// Takes steps until the future waits with no wake pending, or ends; the caller set
    /// [`RUNNING`]. Once it is `stopping` (the engine shutting down), drops the future instead
    /// of polling it, as the runtime's shutdown drops its own tasks. A task that woke itself
    /// [`SELF_WAKES_HERE`] times goes on on the runtime.
    fn run(self: &Arc<Self>) {
        let waker = Waker::from(Arc::clone(self));
        let mut context = Context::from_waker(&waker);
        let _in_step = InStep::enter();
        let _runtime = self.handle.enter();
        let mut self_wakes = 0;
        loop {
            let step = self.step(&mut context);
            if step != Step::Pending {
                let future = self.future.lock().take();
                self.state.store(DONE, Ordering::Release);
                // A future that ended holds little; one given up half-way may block in its
                // drop (a transfer's waits for its streams), so it goes off a waking thread.
                // Either may panic there.
                let dropped = std::panic::catch_unwind(AssertUnwindSafe(|| match step {
                    Step::Abandoned => drop_off_waking_thread(future),
                    _ => drop(future),
                }));
                if dropped.is_err() {
                    tracing::error!("dropping an engine task panicked");
                }
                break;
            }
            match self
                .state
                .compare_exchange(RUNNING, IDLE, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => break,
                Err(_) => {
                    self.state.store(RUNNING, Ordering::Release);
                    self_wakes += 1;
                    if self_wakes >= SELF_WAKES_HERE {
                        drop(self.handle.spawn(Resume(Some(Arc::clone(self)))));
                        break;
                    }
                }
            }
        }
    }

    /// One poll.
    fn step(&self, context: &mut Context<'_>) -> Step {
        // A panic here would otherwise end the waking thread: the CUDA event poller, whose
        // end fails every later GPU transfer of the process. The task ends instead, as a
        // runtime task that panicked would, and its outcome's sender goes with it.
        let stepped = std::panic::catch_unwind(AssertUnwindSafe(|| {
            if (self.stopping)() {
                return Step::Abandoned;
            }
            let mut future = self.future.lock();
            match future.as_mut().map(|future| future.as_mut().poll(context)) {
                Some(Poll::Pending) => Step::Pending,
                Some(Poll::Ready(())) | None => Step::Ended,
            }
        }));
        stepped.unwrap_or_else(|_| {
            tracing::error!("an engine task panicked; its caller gets a shutdown error");
            Step::Abandoned
        })
    }

    /// The future of a task that waits for a wake, which is then done; `None` for a task
    /// that runs or ended.
    fn take_waiting(&self) -> Option<Steps> {
        self.state
            .compare_exchange(IDLE, RUNNING, Ordering::AcqRel, Ordering::Acquire)
            .ok()?;
        let future = self.future.lock().take();
        self.state.store(DONE, Ordering::Release);
        future
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

    const WAIT: Duration = Duration::from_secs(5);

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("a test runtime")
    }

    /// Reports on its channel when dropped.
    struct Dropped(mpsc::Sender<()>);

    impl Drop for Dropped {
        fn drop(&mut self) {
            let _ = self.0.send(());
        }
    }

    /// Where a pending task left its waker.
    type Registered = Arc<Mutex<Option<Waker>>>;

    /// Wakes the task that left its waker in `registered`, holding no lock meanwhile (a step
    /// run inside the wake registers the waker again).
    fn wake(registered: &Registered) {
        let waker = registered.lock().take().expect("the task waits");
        waker.wake();
    }

    /// Starts a task that reports the thread of each step, registers its waker, and ends at
    /// its second step; and the receiver of the report that its future was dropped.
    fn two_step_task(
        tasks: &Tasks,
        handle: &tokio::runtime::Handle,
        stopping: impl Fn() -> bool + Send + Sync + 'static,
    ) -> (mpsc::Receiver<ThreadId>, Registered, mpsc::Receiver<()>) {
        let (threads, stepped) = mpsc::channel();
        let (dropped, gone) = mpsc::channel();
        let guard = Dropped(dropped);
        let registered: Registered = Arc::default();
        let waker = Arc::clone(&registered);
        let mut steps = 0;
        tasks.start(
            handle,
            stopping,
            Box::pin(std::future::poll_fn(move |context| {
                let _held = &guard;
                let _ = threads.send(std::thread::current().id());
                steps += 1;
                if steps == 2 {
                    return Poll::Ready(());
                }
                *waker.lock() = Some(context.waker().clone());
                Poll::Pending
            })),
        );
        (stepped, registered, gone)
    }

    #[test]
    fn the_first_step_runs_on_the_caller_and_a_marked_thread_runs_the_step_it_wakes() {
        let runtime = runtime();
        let tasks = Tasks::default();
        let (stepped, registered, gone) = two_step_task(&tasks, runtime.handle(), || false);
        assert_eq!(
            stepped.recv_timeout(WAIT).unwrap(),
            std::thread::current().id()
        );
        let (marked, waker_thread) = mpsc::channel();
        std::thread::spawn(move || {
            run_wakes_here();
            wake(&registered);
            let _ = marked.send(std::thread::current().id());
        });
        let waker_thread = waker_thread.recv_timeout(WAIT).unwrap();
        assert_eq!(stepped.recv_timeout(WAIT).unwrap(), waker_thread);
        gone.recv_timeout(WAIT).unwrap();
    }

    #[test]
    fn an_unmarked_thread_hands_the_step_it_wakes_to_the_runtime() {
        let runtime = runtime();
        let tasks = Tasks::default();
        let (stepped, registered, gone) = two_step_task(&tasks, runtime.handle(), || false);
        stepped.recv_timeout(WAIT).unwrap();
        wake(&registered);
        assert_ne!(
            stepped.recv_timeout(WAIT).unwrap(),
            std::thread::current().id()
        );
        gone.recv_timeout(WAIT).unwrap();
    }

    #[test]
    fn a_task_that_keeps_waking_itself_goes_to_the_runtime_after_a_few_steps_here() {
        let runtime = runtime();
        let (threads, stepped) = mpsc::channel();
        let mut polls = 0;
        Tasks::default().start(
            runtime.handle(),
            || false,
            Box::pin(std::future::poll_fn(move |context| {
                polls += 1;
                let _ = threads.send(std::thread::current().id());
                if polls == 100 {
                    return Poll::Ready(());
                }
                context.waker().wake_by_ref();
                Poll::Pending
            })),
        );
        let here = std::thread::current().id();
        let steps: Vec<ThreadId> = (0..100)
            .map(|_| stepped.recv_timeout(WAIT).unwrap())
            .collect();
        let on_caller = steps.iter().filter(|&&thread| thread == here).count();
        assert_eq!(on_caller, SELF_WAKES_HERE as usize, "{steps:?}");
        assert!(steps[..on_caller].iter().all(|&thread| thread == here));
    }

    /// [`two_step_task`] stopping once the returned flag is set, after its first step.
    fn stoppable_task(
        runtime: &tokio::runtime::Runtime,
    ) -> (
        Arc<AtomicBool>,
        mpsc::Receiver<ThreadId>,
        Registered,
        mpsc::Receiver<()>,
    ) {
        let stopping = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stopping);
        let (stepped, registered, gone) =
            two_step_task(&Tasks::default(), runtime.handle(), move || {
                flag.load(Ordering::SeqCst)
            });
        stepped.recv_timeout(WAIT).unwrap();
        (stopping, stepped, registered, gone)
    }

    #[test]
    fn a_stopping_engine_drops_the_future_instead_of_stepping_it() {
        let runtime = runtime();
        let (stopping, stepped, registered, gone) = stoppable_task(&runtime);
        stopping.store(true, Ordering::SeqCst);
        wake(&registered);
        gone.recv_timeout(WAIT).unwrap();
        assert!(
            stepped.try_recv().is_err(),
            "the stopping task was polled again"
        );
    }

    #[test]
    fn stopping_the_tasks_drops_one_that_nothing_will_wake() {
        let runtime = runtime();
        let tasks = Tasks::default();
        let (stepped, _registered, gone) = two_step_task(&tasks, runtime.handle(), || false);
        stepped.recv_timeout(WAIT).unwrap();
        assert!(
            gone.try_recv().is_err(),
            "the waiting task's future was dropped early"
        );
        tasks.stop();
        gone.recv_timeout(WAIT).unwrap();
        assert!(
            stepped.try_recv().is_err(),
            "the stopped task was polled again"
        );
    }

    #[test]
    fn a_panicking_step_ends_its_task_and_spares_the_waking_thread() {
        let runtime = runtime();
        let (dropped, gone) = mpsc::channel();
        let guard = Dropped(dropped);
        let registered: Registered = Arc::default();
        let waker = Arc::clone(&registered);
        let mut first = true;
        Tasks::default().start(
            runtime.handle(),
            || false,
            Box::pin(std::future::poll_fn(move |context| {
                let _held = &guard;
                if first {
                    first = false;
                    *waker.lock() = Some(context.waker().clone());
                    return Poll::Pending;
                }
                panic!("a step that panics");
            })),
        );
        let (survived, alive) = mpsc::channel();
        std::thread::spawn(move || {
            run_wakes_here();
            wake(&registered);
            let _ = survived.send(IN_STEP.get());
        });
        assert!(
            !alive.recv_timeout(WAIT).unwrap(),
            "the thread was left inside a step"
        );
        gone.recv_timeout(WAIT).unwrap();
    }

    #[test]
    fn a_step_queued_on_a_runtime_that_shut_down_still_drops_the_future() {
        let runtime = runtime();
        let (stopping, _stepped, registered, gone) = stoppable_task(&runtime);
        stopping.store(true, Ordering::SeqCst);
        runtime.shutdown_background();
        // The step goes to a runtime that no longer runs anything: only dropping it runs it.
        wake(&registered);
        gone.recv_timeout(WAIT).unwrap();
    }
}
