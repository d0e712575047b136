//! `ferry_kv._ferry`: the compiled half of the `ferry_kv` Python package.
//!
//! Two APIs sit on one engine: [`mooncake`] speaks Mooncake's `TransferEngine` conventions
//! (integer addresses, `0`/`-1` returns, batch ids) so SGLang and vLLM run unchanged, and
//! [`native`] is ferry's own API in Python terms (regions, peers, transfers, exceptions). The
//! pure-Python half of the package (`python/ferry_kv`) turns tensors and buffers into
//! addresses and adds `asyncio`. Every call that moves or registers memory releases the GIL.

mod compat;
mod errors;
mod interrupt;
mod lists;
mod logging;
mod mooncake;
mod native;
mod nixl;

use pyo3::prelude::*;

/// The extension module; `ferry_kv` re-exports what callers use.
#[pymodule]
fn _ferry(m: &Bound<'_, PyModule>) -> PyResult<()> {
    logging::init();
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    errors::register(m)?;
    mooncake::register(m)?;
    native::register(m)?;
    nixl::register(m)?;
    Ok(())
}
