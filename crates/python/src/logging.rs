//! Log lines of the engine go to stderr, filtered by `FERRY_LOG` (as `RUST_LOG`; `warn` when
//! unset), so a Python process sees the one-line warnings a fallback or a refusal writes.

use std::io::IsTerminal;
use tracing_subscriber::EnvFilter;

/// Installs the stderr logger once per process; a logger the host program installed wins.
pub(crate) fn init() {
    let filter = EnvFilter::try_from_env("FERRY_LOG").unwrap_or_else(|_| EnvFilter::new("warn"));
    // Fails only when a global subscriber exists already, which is then the one to keep.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .try_init();
}
