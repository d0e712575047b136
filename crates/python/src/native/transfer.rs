//! `Transfer`: a submitted batch, waited for from threads or awaited from `asyncio`.
//!
//! The waiter thread awaits ferry's transfer future and records its outcome here; blocking
//! callers sleep on a condition variable with the GIL released, and `asyncio` callers register
//! a callback the waiter calls (which hands the outcome to the event loop thread-safely).

use super::{duration, waiter};
use crate::errors::{to_py, TransferTimeout};
use parking_lot::{Condvar, Mutex, MutexGuard};
use pyo3::prelude::*;
use std::sync::Arc;
use std::time::Instant;

/// What a finished transfer did.
#[pyclass(module = "ferry_kv._ferry", frozen, get_all)]
#[derive(Clone)]
pub(crate) struct Completion {
    /// Bytes moved.
    bytes: u64,
    /// The transports that carried them (`"tcp"`, `"nvlink"`, …).
    transports: Vec<String>,
    /// Seconds from submission to completion.
    elapsed_s: f64,
}

#[pymethods]
impl Completion {
    fn __repr__(&self) -> String {
        format!(
            "Completion(bytes={}, transports=[{}], elapsed_s={})",
            self.bytes,
            self.transports
                .iter()
                .map(|name| format!("'{name}'"))
                .collect::<Vec<_>>()
                .join(", "),
            self.elapsed_s
        )
    }
}

impl From<ferry::Completion> for Completion {
    fn from(completion: ferry::Completion) -> Self {
        Completion {
            bytes: completion.bytes,
            transports: completion
                .transports
                .into_iter()
                .map(str::to_owned)
                .collect(),
            elapsed_s: completion.elapsed.as_secs_f64(),
        }
    }
}

#[derive(Default)]
struct State {
    outcome: Option<Result<Completion, PyErr>>,
    callbacks: Vec<Py<PyAny>>,
}

#[derive(Default)]
struct Shared {
    state: Mutex<State>,
    finished: Condvar,
}

impl Shared {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock()
    }

    /// Records the outcome, wakes the waiting threads and calls the callbacks.
    fn finish(&self, outcome: ferry::Result<ferry::Completion>) {
        let callbacks = {
            let mut state = self.state();
            state.outcome = Some(outcome.map(Completion::from).map_err(to_py));
            std::mem::take(&mut state.callbacks)
        };
        self.finished.notify_all();
        waiter::call_back(callbacks);
    }
}

/// A submitted batch. Its data is visible at the destination once it completes; until then
/// (and after a failure) the destination ranges are undefined. Dropping it does not stop it.
#[pyclass(module = "ferry_kv._ferry", frozen)]
pub(crate) struct Transfer {
    shared: Arc<Shared>,
}

impl Transfer {
    /// Hands `transfer` to the waiter, which records its outcome.
    pub(super) fn start(transfer: ferry::Transfer) -> PyResult<Transfer> {
        let shared = Arc::new(Shared::default());
        let recorder = Arc::clone(&shared);
        waiter::spawn(async move { recorder.finish(transfer.await) })?;
        Ok(Transfer { shared })
    }
}

#[pymethods]
impl Transfer {
    /// Whether the transfer has ended, either way.
    fn done(&self) -> bool {
        self.shared.state().outcome.is_some()
    }

    /// Blocks (GIL released) until the transfer ends and returns its `Completion`, or raises
    /// its error. With `timeout` (seconds), raises `TransferTimeout` when it has not ended by
    /// then; the transfer keeps running and may be waited for again. Ctrl-C interrupts the
    /// wait (`KeyboardInterrupt`), not the transfer.
    #[pyo3(signature = (timeout = None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Completion> {
        let limit = timeout
            .map(|seconds| duration(seconds, "timeout"))
            .transpose()?;
        let deadline = limit.map(|limit| Instant::now() + limit);
        crate::interrupt::wait_interruptibly(py, deadline, |until| {
            let mut state = self.shared.state();
            while state.outcome.is_none() {
                if self
                    .shared
                    .finished
                    .wait_until(&mut state, until)
                    .timed_out()
                {
                    break;
                }
            }
            state.outcome.is_some()
        })?;
        match &self.shared.state().outcome {
            Some(Ok(completion)) => Ok(completion.clone()),
            Some(Err(error)) => Err(error.clone_ref(py)),
            None => Err(TransferTimeout::new_err(format!(
                "the transfer did not end within {} s; it keeps running until the engine's transfer_timeout, so wait again or with a longer timeout",
                timeout.unwrap_or_default()
            ))),
        }
    }

    /// Calls `callback()` (from the waiter thread, or at once when the transfer has ended);
    /// `ferry_kv.Transfer` uses it to wake an `asyncio` event loop.
    fn _on_done(&self, py: Python<'_>, callback: Py<PyAny>) -> PyResult<()> {
        {
            let mut state = self.shared.state();
            if state.outcome.is_none() {
                state.callbacks.push(callback);
                return Ok(());
            }
        }
        callback.call0(py).map(drop)
    }

    fn __repr__(&self) -> String {
        match &self.shared.state().outcome {
            None => "Transfer(pending)".to_owned(),
            Some(Ok(completion)) => format!("Transfer(done, {} bytes)", completion.bytes),
            Some(Err(error)) => format!("Transfer(failed: {error})"),
        }
    }
}
