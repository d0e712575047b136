//! The CUDA helpers a server needs beside the engine: GPUs, contexts, device buffers, streams
//! and events; and a bf16 [`Gemm`] that stands in for a model's compute in benchmarks.
//! Everything here is safe to call. GPU memory reaches the engine allocated by it
//! ([`ferry_core::Engine::allocate_device`]) or, when a server allocated it itself, through the
//! `unsafe` [`ferry_core::Engine::register`].

use crate::{Error, Region};
pub use ferry_core::cuda::{
    Context, CudaError, DeviceBuffer, DeviceInfo, Driver, DriverStatus, Event, GpuId,
};
pub use ferry_nvlink::{Gemm, GemmRate, GEMM_TILE};
use std::sync::Arc;

/// A non-blocking CUDA stream on one GPU, destroyed on drop, with only the operations whose
/// memory ferry can check: copies between whole [`DeviceBuffer`]s and waits on a word of a
/// registered GPU [`Region`].
#[derive(Debug)]
pub struct Stream {
    inner: ferry_core::cuda::Stream,
}

impl Stream {
    /// Creates a stream on `context`'s GPU that does not synchronise with the legacy default
    /// stream.
    ///
    /// # Errors
    /// The driver's error.
    pub fn new(context: Arc<Context>) -> Result<Stream, CudaError> {
        Ok(Stream {
            inner: ferry_core::cuda::Stream::new(context)?,
        })
    }

    /// Makes work queued on this stream from now on wait, on the GPU, until the 32-bit word
    /// `offset` bytes into `region` is at least `value`: the word a peer's
    /// [`crate::Batch::signal`] sets once the data it follows is visible. Dropping `region`
    /// waits until the stream has passed the wait.
    ///
    /// # Errors
    /// As [`Region::wait_value32`]: the region is not memory of this stream's GPU, the word is
    /// unaligned or past the region's end, or the driver refuses.
    pub fn wait_value32(&self, region: &Region, offset: u64, value: u32) -> Result<(), Error> {
        region.wait_value32(&self.inner, offset, value)
    }

    /// Queues a copy of `len` bytes from the start of `src` to the start of `dst`.
    ///
    /// # Errors
    /// [`Error::ApiMisuse`] when `len` exceeds either buffer, else the driver's error.
    pub fn copy_buffer(
        &self,
        dst: &DeviceBuffer,
        src: &DeviceBuffer,
        len: u64,
    ) -> Result<(), Error> {
        let len = usize::try_from(len).map_err(|_| {
            Error::ApiMisuse(format!(
                "a copy of {len} bytes does not fit this machine's address space"
            ))
        })?;
        self.inner.copy_buffer(dst, src, len)
    }

    /// Records an event after everything queued on the stream so far.
    ///
    /// # Errors
    /// The driver's error.
    pub fn record_event(&self) -> Result<Event, CudaError> {
        Event::record(&self.inner)
    }

    /// Blocks until everything queued so far has finished; for set-up and tests.
    ///
    /// # Errors
    /// The driver's error, including one from earlier work on the stream.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.inner.synchronize()
    }

    /// The context the stream belongs to.
    pub fn context(&self) -> &Arc<Context> {
        self.inner.context()
    }
}
