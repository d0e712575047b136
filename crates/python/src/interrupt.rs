//! Blocking waits that Ctrl-C interrupts: the wait runs without the GIL in slices of at most
//! [`SLICE`], and between slices the interpreter's signal handlers run (`KeyboardInterrupt`
//! for Ctrl-C), so a Python program blocked in ferry stops as it would anywhere else.

use pyo3::prelude::*;
use std::time::{Duration, Instant};

/// The longest a Ctrl-C waits to be seen.
pub(crate) const SLICE: Duration = Duration::from_millis(50);

/// Runs `step(until)` (which waits no later than `until` and says whether it is done) without
/// the GIL, again and again, until it is done or `deadline` passes; between steps, Python's
/// signal handlers run and what they raise is returned. `Ok(false)` when `deadline` passed
/// first.
pub(crate) fn wait_interruptibly(
    py: Python<'_>,
    deadline: Option<Instant>,
    mut step: impl FnMut(Instant) -> bool + Send,
) -> PyResult<bool> {
    loop {
        let now = Instant::now();
        let until = match deadline {
            Some(deadline) if deadline <= now => return Ok(false),
            Some(deadline) => deadline.min(now + SLICE),
            None => now + SLICE,
        };
        if py.detach(|| step(until)) {
            return Ok(true);
        }
        py.check_signals()?;
    }
}
