//! `Notifications`: the messages peers send this engine, received blocking, polled, or
//! awaited from `asyncio` through the waiter thread.

use super::{duration, waiter};
use crate::errors::{to_py, FerryError, TransferTimeout};
use parking_lot::{Mutex, MutexGuard};
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use std::collections::VecDeque;
use std::sync::Arc;
use tokio::task::AbortHandle;

/// A message from a peer, delivered after the data of the batch it was sent with is visible.
#[pyclass(module = "ferry_kv._ferry", frozen)]
#[derive(Clone)]
pub(crate) struct Notification {
    sender: String,
    payload: Vec<u8>,
}

#[pymethods]
impl Notification {
    /// The sender's name as the sender claims it: unauthenticated (any process reaching the
    /// listener can claim any name, and with a secret any holder of it can). Show it to
    /// people; never connect to it or answer it as if it were the sender's address.
    #[getter]
    fn sender(&self) -> &str {
        &self.sender
    }

    /// What the sender attached, such as a request id.
    #[getter]
    fn payload<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.payload)
    }

    fn __eq__(&self, other: PyRef<'_, Notification>) -> bool {
        self.sender == other.sender && self.payload == other.payload
    }

    fn __repr__(&self) -> String {
        format!(
            "Notification(sender={:?}, payload={} bytes)",
            self.sender,
            self.payload.len()
        )
    }
}

impl From<ferry::Notification> for Notification {
    fn from(note: ferry::Notification) -> Self {
        Notification {
            sender: note.from,
            payload: note.payload,
        }
    }
}

/// The engine's notification stream. One receive at a time takes the stream: a `try_recv`
/// while another receive waits finds nothing.
#[pyclass(module = "ferry_kv._ferry", frozen)]
pub(crate) struct Notifications {
    stream: Arc<tokio::sync::Mutex<ferry::Notifications>>,
    /// Notifications an `asyncio` receiver took but could no longer hand over (its wait was
    /// cancelled): they come first.
    returned: Arc<Mutex<VecDeque<Notification>>>,
}

impl Notifications {
    pub(super) fn new(stream: ferry::Notifications) -> Self {
        Notifications {
            stream: Arc::new(tokio::sync::Mutex::new(stream)),
            returned: Arc::default(),
        }
    }

    fn returned(&self) -> MutexGuard<'_, VecDeque<Notification>> {
        self.returned.lock()
    }
}

#[pymethods]
impl Notifications {
    /// The next notification if one is waiting, else `None`, without waiting. Raises
    /// `FerryError` once the engine is closed and every notification was read.
    fn try_recv(&self) -> PyResult<Option<Notification>> {
        if let Some(note) = self.returned().pop_front() {
            return Ok(Some(note));
        }
        let Ok(mut stream) = self.stream.try_lock() else {
            return Ok(None);
        };
        Ok(stream.try_recv().map_err(to_py)?.map(Notification::from))
    }

    /// Blocks (GIL released) until the next notification arrives; `None` once the engine is
    /// closed. With `timeout` (seconds), raises `TransferTimeout` when none arrived by then.
    /// Ctrl-C interrupts the wait (`KeyboardInterrupt`).
    #[pyo3(signature = (timeout = None))]
    fn recv(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Option<Notification>> {
        if let Some(note) = self.returned().pop_front() {
            return Ok(Some(note));
        }
        let limit = timeout
            .map(|seconds| duration(seconds, "timeout"))
            .transpose()?;
        if tokio::runtime::Handle::try_current().is_ok() {
            return Err(FerryError::new_err(
                "recv() cannot block inside a ferry callback; use try_recv() or arecv()",
            ));
        }
        let runtime = waiter::runtime()?;
        let stream = Arc::clone(&self.stream);
        let deadline = limit.map(|limit| std::time::Instant::now() + limit);
        let mut received = None;
        // Each slice's receive is dropped at its end: an mpsc receive taken mid-way loses
        // nothing, so the next slice gets what this one did not.
        let arrived = crate::interrupt::wait_interruptibly(py, deadline, |until| {
            let next = async { stream.lock().await.recv().await };
            let until = tokio::time::Instant::from_std(until);
            match runtime.block_on(async { tokio::time::timeout_at(until, next).await }) {
                Ok(note) => {
                    received = Some(note);
                    true
                }
                Err(_) => false,
            }
        })?;
        match (arrived, received) {
            (true, Some(note)) => Ok(note.map(Notification::from)),
            _ => Err(TransferTimeout::new_err(format!(
                "no notification arrived within {} s; wait again, or check that the peer sends one",
                timeout.unwrap_or_default()
            ))),
        }
    }

    /// Receives on the waiter thread and calls `deliver(note)` there (`None` once the engine
    /// is closed); a notification `deliver` refuses by raising is kept for the next receive.
    /// `ferry_kv.Notifications.arecv` uses it; cancel the returned handle to stop waiting.
    fn _recv_async(&self, deliver: Py<PyAny>) -> PyResult<Receiving> {
        let stream = Arc::clone(&self.stream);
        let returned = Arc::clone(&self.returned);
        let task = waiter::spawn(async move {
            let note = stream.lock().await.recv().await.map(Notification::from);
            let _ = Python::try_attach(|py| {
                let handed = match &note {
                    Some(note) => Py::new(py, note.clone())
                        .and_then(|note| deliver.call1(py, (note,)).map(drop)),
                    None => deliver.call1(py, (py.None(),)).map(drop),
                };
                if let Err(error) = handed {
                    error.write_unraisable(py, None);
                    if let Some(note) = note {
                        returned.lock().push_front(note);
                    }
                }
            });
        })?;
        Ok(Receiving {
            task: task.abort_handle(),
        })
    }

    /// Puts `note` back in front of the stream, for an `asyncio` receiver that was cancelled
    /// after its notification arrived.
    fn _push_back(&self, note: PyRef<'_, Notification>) {
        self.returned().push_front(note.clone());
    }
}

/// An `asyncio` receive in progress on the waiter thread.
#[pyclass(module = "ferry_kv._ferry", frozen)]
pub(crate) struct Receiving {
    task: AbortHandle,
}

#[pymethods]
impl Receiving {
    /// Stops waiting; a notification not yet taken stays in the stream.
    fn cancel(&self) {
        self.task.abort();
    }
}
