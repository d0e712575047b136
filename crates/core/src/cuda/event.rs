use super::context::Context;
use super::error::CudaError;
use super::stream::Stream;
use cudarc::driver::sys::{self, CUcontext, CUevent, CUevent_flags, CUresult, CUstream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// A CUDA event without timing, recorded once after work to learn when it finished.
#[derive(Debug)]
pub struct Event {
    raw: CUevent,
    context: Arc<Context>,
    /// Set once a query saw the work finished: an event recorded once stays finished, so
    /// later queries (the argument pool's, after the poller's) skip the driver.
    finished: AtomicBool,
}

// SAFETY: an event handle may be queried and destroyed from any thread with its context
// current; every method binds it first.
unsafe impl Send for Event {}
// SAFETY: cuEventQuery is thread-safe.
unsafe impl Sync for Event {}

impl Event {
    /// Records a new event after everything queued on `stream` so far.
    pub fn record(stream: &Stream) -> Result<Event, CudaError> {
        let context = stream.context();
        context.bind()?;
        // SAFETY: the stream is a live stream of `context`, which is current.
        unsafe { Event::record_on_current(context, stream.raw()) }
    }

    /// Records a new event after everything queued so far on a stream another library owns
    /// (PyTorch's `torch.cuda.Stream.cuda_stream`, say), named by its driver handle: `0` is
    /// the legacy default stream and `2` the per-thread one, of `context`'s GPU.
    ///
    /// # Errors
    /// [`CudaError`] when the driver refuses the handle, or `CUDA_ERROR_INVALID_CONTEXT` when
    /// the stream belongs to a context other than `context` (another GPU's, or one that is not
    /// a primary context).
    ///
    /// # Safety
    /// `handle` must be `0`, `2`, or a stream handle that stays alive until this call returns:
    /// the driver cannot tell a made-up or destroyed handle from a live one.
    pub unsafe fn record_on_handle(
        context: &Arc<Context>,
        handle: usize,
    ) -> Result<Event, CudaError> {
        context.bind()?;
        let stream = handle as CUstream;
        if handle != 0 && handle != 2 {
            let mut owner: CUcontext = std::ptr::null_mut();
            // SAFETY: the caller vouches that `stream` is a live stream handle; `owner` is a
            // valid place for the context handle.
            CudaError::check("cuStreamGetCtx", unsafe {
                sys::cuStreamGetCtx(stream, &mut owner)
            })?;
            if owner != context.raw() {
                return Err(CudaError {
                    call: "cuStreamGetCtx",
                    code: Some(CUresult::CUDA_ERROR_INVALID_CONTEXT as u32),
                    name: "CUDA_ERROR_INVALID_CONTEXT".into(),
                });
            }
        }
        // SAFETY: the stream is a default stream or (checked above) a live stream of
        // `context`, which is current.
        unsafe { Event::record_on_current(context, stream) }
    }

    /// Creates an event in `context` and records it on `stream`.
    ///
    /// # Safety
    /// `context` is current on this thread, and `stream` is a default stream or a live stream
    /// of `context`.
    unsafe fn record_on_current(
        context: &Arc<Context>,
        stream: CUstream,
    ) -> Result<Event, CudaError> {
        let mut raw: CUevent = std::ptr::null_mut();
        // SAFETY: the context is current and `raw` is a valid place for the handle.
        CudaError::check("cuEventCreate", unsafe {
            sys::cuEventCreate(&mut raw, CUevent_flags::CU_EVENT_DISABLE_TIMING as u32)
        })?;
        let event = Event {
            raw,
            context: Arc::clone(context),
            finished: AtomicBool::new(false),
        };
        // SAFETY: the event is valid in the current context, and the caller vouches for the
        // stream.
        CudaError::check("cuEventRecord", unsafe {
            sys::cuEventRecord(event.raw, stream)
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
        if self.finished.load(Ordering::Acquire) {
            return Ok(true);
        }
        self.context.bind()?;
        // SAFETY: the event is valid.
        match unsafe { sys::cuEventQuery(self.raw) } {
            CUresult::CUDA_SUCCESS => {
                self.finished.store(true, Ordering::Release);
                Ok(true)
            }
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
