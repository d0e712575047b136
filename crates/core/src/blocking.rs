//! The one rule every blocking call follows: on a tokio runtime thread it refuses with
//! [`Error::ApiMisuse`] instead of running.
//!
//! Blocking a runtime's thread stalls every task scheduled there, and deadlocks outright when
//! the awaited work needs that thread; tokio's own blocking calls panic there instead. Some of
//! ferry's blocking calls would panic, others would quietly stall the caller's runtime, so all
//! of them check first and answer the same error, naming the async call to await instead.

use crate::error::{Error, Result};

/// `Ok` when the calling thread may block; [`Error::ApiMisuse`] naming `call` (the blocking
/// call, such as `Transfer::wait`) and `alternative` (what to await instead) when it is a
/// thread of a tokio runtime, a task's or one of its blocking pool's.
pub(crate) fn refuse_on_runtime(call: &str, alternative: &str) -> Result<()> {
    if tokio::runtime::Handle::try_current().is_ok() {
        return Err(Error::ApiMisuse(format!(
            "{call} blocks its thread, and this thread belongs to an async runtime; await {alternative} there instead, or call {call} from a thread outside the runtime"
        )));
    }
    Ok(())
}
