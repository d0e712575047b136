//! ferry's own API in Python terms: the engine, regions, peers, batches, transfers and
//! notifications of the Rust crate, one class each. These classes take integer addresses;
//! `ferry_kv` (the pure-Python half) turns tensors and buffers into addresses, and wraps
//! transfers and notifications for `asyncio`. Every call that may block releases the GIL, and
//! errors are ferry's exceptions with ferry's message.

mod batch;
mod engine;
mod notifications;
mod peer;
mod probe;
mod region;
mod transfer;
mod waiter;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use std::time::Duration;

/// Adds the native classes to the module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<engine::Engine>()?;
    m.add_class::<region::Region>()?;
    m.add_class::<peer::Peer>()?;
    m.add_class::<batch::Batch>()?;
    m.add_class::<transfer::Transfer>()?;
    m.add_class::<transfer::Completion>()?;
    m.add_class::<notifications::Notifications>()?;
    m.add_class::<notifications::Notification>()?;
    m.add_class::<notifications::Receiving>()?;
    m.add_function(wrap_pyfunction!(probe::probe_machine, m)?)?;
    m.add_function(wrap_pyfunction!(probe::probe_routes, m)?)?;
    Ok(())
}

/// `seconds` as a duration, or a `ValueError` naming `what` when it is negative or not finite.
fn duration(seconds: f64, what: &str) -> PyResult<Duration> {
    Duration::try_from_secs_f64(seconds).map_err(|_| {
        PyValueError::new_err(format!(
            "{what} must be a finite, non-negative number of seconds, not {seconds}"
        ))
    })
}

/// Where memory lives, as Python names it: `"host"`, or `"cuda:N"` for GPU `N` of the process
/// that registered it.
fn location_name(location: ferry::Location) -> String {
    match location {
        ferry::Location::Host { .. } => "host".to_owned(),
        ferry::Location::Device { ordinal, .. } => format!("cuda:{ordinal}"),
        other => other.to_string(),
    }
}

/// Drops `value` on a thread of its own when called from inside an async runtime: dropping an
/// engine stops its runtime and dropping a region waits for its transfers, neither of which a
/// runtime thread may do. Python may drop objects on the waiter thread while it runs a callback.
fn drop_outside_runtime<T: Send + 'static>(value: T) {
    if tokio::runtime::Handle::try_current().is_ok() {
        std::thread::spawn(move || drop(value));
    } else {
        drop(value);
    }
}
