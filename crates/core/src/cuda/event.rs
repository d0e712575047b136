use super::context::Context;
use super::error::CudaError;
use super::stream::Stream;
use cudarc::driver::sys::{self, CUevent, CUevent_flags, CUresult};
use std::sync::Arc;

/// A CUDA event without timing, recorded after work to learn when it finished.
#[derive(Debug)]
pub struct Event {
    raw: CUevent,
    context: Arc<Context>,
}

// SAFETY: an event handle may be queried and destroyed from any thread with its context
// current; every method binds it first.
unsafe impl Send for Event {}
// SAFETY: cuEventQuery is thread-safe.
unsafe impl Sync for Event {}

impl Event {
    /// Records a new event after everything queued on `stream` so far.
    pub fn record(stream: &Stream) -> Result<Event, CudaError> {
        let context = Arc::clone(stream.context());
        context.bind()?;
        let mut raw: CUevent = std::ptr::null_mut();
        // SAFETY: the context is current and `raw` is a valid place for the handle.
        CudaError::check("cuEventCreate", unsafe {
            sys::cuEventCreate(&mut raw, CUevent_flags::CU_EVENT_DISABLE_TIMING as u32)
        })?;
        let event = Event { raw, context };
        // SAFETY: both handles are valid and belong to the current context.
        CudaError::check("cuEventRecord", unsafe {
            sys::cuEventRecord(event.raw, stream.raw())
        })?;
        Ok(event)
    }

    /// The driver's handle, for the other wrappers of this layer.
    pub(super) fn raw(&self) -> CUevent {
        self.raw
    }

    /// `Ok(true)` once the work before the event finished, `Ok(false)` while it runs, and the
    /// error when the work failed: never reads a failure as "not yet".
    pub fn query(&self) -> Result<bool, CudaError> {
        self.context.bind()?;
        // SAFETY: the event is valid.
        match unsafe { sys::cuEventQuery(self.raw) } {
            CUresult::CUDA_SUCCESS => Ok(true),
            CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            other => CudaError::check("cuEventQuery", other).map(|()| true),
        }
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        let outcome = self.context.bind().and_then(|()| {
            // SAFETY: the event is valid and destroyed exactly once, here.
            CudaError::check("cuEventDestroy_v2", unsafe {
                sys::cuEventDestroy_v2(self.raw)
            })
        });
        if let Err(error) = outcome {
            tracing::warn!(%error, "destroying a CUDA event failed");
        }
    }
}
