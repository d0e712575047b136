//! The waiter: one small runtime thread that awaits transfers and notifications for Python, so
//! that `asyncio` learns of an outcome through a callback instead of polling or blocking a
//! thread per transfer.

use crate::errors::FerryError;
use pyo3::prelude::*;
use std::future::Future;
use std::sync::OnceLock;
use tokio::runtime::{Builder, Runtime};
use tokio::task::JoinHandle;

static WAITER: OnceLock<std::io::Result<Runtime>> = OnceLock::new();

/// The waiter runtime, started on first use.
pub(super) fn runtime() -> PyResult<&'static Runtime> {
    WAITER
        .get_or_init(|| {
            Builder::new_multi_thread()
                .worker_threads(1)
                .thread_name("ferry-py-waiter")
                .enable_time()
                .build()
        })
        .as_ref()
        .map_err(|error| {
            FerryError::new_err(format!(
                "starting the thread that completes transfers failed: {error}; the process may be out of threads"
            ))
        })
}

/// Runs `work` on the waiter.
pub(super) fn spawn<F>(work: F) -> PyResult<JoinHandle<()>>
where
    F: Future<Output = ()> + Send + 'static,
{
    Ok(runtime()?.spawn(work))
}

/// Calls every callback with the GIL held; an exception one raises is reported as unraisable
/// (nothing waits for its result). Nothing is called once the interpreter is shutting down.
pub(super) fn call_back(callbacks: Vec<Py<PyAny>>) {
    if callbacks.is_empty() {
        return;
    }
    let _ = Python::try_attach(|py| {
        for callback in callbacks {
            if let Err(error) = callback.call0(py) {
                error.write_unraisable(py, None);
            }
        }
    });
}
