use super::buffer::DeviceBuffer;
use super::context::Context;
use super::error::CudaError;
use super::event::Event;
use crate::error::Error;
use cudarc::driver::sys::{self, CUstream, CUstream_flags};
use std::sync::Arc;

/// A non-blocking CUDA stream on one GPU; destroyed on drop.
#[derive(Debug)]
pub struct Stream {
    raw: CUstream,
    context: Arc<Context>,
}

// SAFETY: a CUstream may be used from any thread that has its context current; every method
// binds the context first.
unsafe impl Send for Stream {}
// SAFETY: the driver serialises work submitted to one stream from several threads.
unsafe impl Sync for Stream {}

impl Stream {
    /// Creates a stream that does not synchronise with the legacy default stream.
    pub fn new(context: Arc<Context>) -> Result<Stream, CudaError> {
        context.bind()?;
        let mut raw: CUstream = std::ptr::null_mut();
        // SAFETY: the context is current and `raw` is a valid place for the handle.
        CudaError::check("cuStreamCreate", unsafe {
            sys::cuStreamCreate(&mut raw, CUstream_flags::CU_STREAM_NON_BLOCKING as u32)
        })?;
        Ok(Stream { raw, context })
    }

    /// Queues a copy of `len` bytes from `src` to `dst` (any two addresses CUDA knows, on any
    /// GPU or pinned host memory).
    ///
    /// # Safety
    /// 1. `src..src+len` must be readable and `dst..dst+len` writable by this GPU until the
    ///    copy completes (an event recorded after it has fired).
    /// 2. The ranges must not overlap.
    pub unsafe fn copy(&self, dst: u64, src: u64, len: usize) -> Result<(), CudaError> {
        self.context.bind()?;
        // SAFETY: the caller guarantees both ranges (1, 2); the stream is valid.
        CudaError::check("cuMemcpyAsync", unsafe {
            sys::cuMemcpyAsync(dst, src, len, self.raw)
        })
    }

    /// Queues `dsts.len()` copies (`sizes[i]` bytes from `srcs[i]` to `dsts[i]`) with one
    /// `cuMemcpyBatchAsync` call, ordered after earlier work on this stream.
    ///
    /// # Safety
    /// As [`Stream::copy`] for every copy; the three slices must have the same length.
    ///
    /// # Errors
    /// [`Error::Internal`] for lists of different lengths or without a CUDA 13 driver (check
    /// [`super::Driver::has_batched_copies`] first), else the driver's error as
    /// [`Error::Cuda`].
    pub unsafe fn copy_batch(
        &self,
        dsts: &[u64],
        srcs: &[u64],
        sizes: &[usize],
    ) -> Result<(), Error> {
        if dsts.len() != srcs.len() || dsts.len() != sizes.len() {
            return Err(Error::internal(format!(
                "Stream::copy_batch got {} destinations, {} sources and {} sizes",
                dsts.len(),
                srcs.len(),
                sizes.len()
            )));
        }
        if dsts.is_empty() {
            return Ok(());
        }
        if !super::Driver::get().has_batched_copies() {
            return Err(Error::internal(
                "Stream::copy_batch was called without a CUDA 13 driver, which batched copies need",
            ));
        }
        self.context.bind()?;
        let nowhere = sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_INVALID,
            id: 0,
        };
        let mut attributes = sys::CUmemcpyAttributes {
            srcAccessOrder: sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
            srcLocHint: nowhere,
            dstLocHint: nowhere,
            flags: 0,
        };
        let mut first = 0usize;
        // The driver takes mutable pointers but only reads the lists: copies keep the
        // caller's slices untouched.
        let (mut dsts, mut srcs, mut sizes) = (dsts.to_vec(), srcs.to_vec(), sizes.to_vec());
        // SAFETY: the three lists hold `count` entries each (checked above) and outlive the
        // call; one attribute applies from copy 0; the driver has the entry point (version
        // checked above); the caller guarantees every range (see Stream::copy).
        CudaError::check("cuMemcpyBatchAsync_v2", unsafe {
            sys::cuMemcpyBatchAsync_v2(
                dsts.as_mut_ptr(),
                srcs.as_mut_ptr(),
                sizes.as_mut_ptr(),
                dsts.len(),
                &mut attributes,
                &mut first,
                1,
                self.raw,
            )
        })?;
        Ok(())
    }

    /// Queues a copy of the first `len` bytes of `src` into `dst`, on any two GPUs.
    ///
    /// Safe because both are whole allocations owned by their buffers, and freeing one
    /// (`cuMemFree`) waits for work queued on it to finish.
    ///
    /// # Errors
    /// [`Error::ApiMisuse`] when `len` exceeds either buffer, else the driver's error as
    /// [`Error::Cuda`].
    pub fn copy_buffer(
        &self,
        dst: &DeviceBuffer,
        src: &DeviceBuffer,
        len: usize,
    ) -> Result<(), Error> {
        if len > dst.len() || len > src.len() {
            return Err(Error::ApiMisuse(format!(
                "Stream::copy_buffer: {len} bytes do not fit both the {}-byte destination and the {}-byte source; copy at most the smaller length",
                dst.len(),
                src.len()
            )));
        }
        // SAFETY: both ranges lie inside live allocations (checked above), which stay
        // allocated until the copy finishes (see above); two allocations never overlap.
        unsafe { self.copy(dst.addr(), src.addr(), len)? };
        Ok(())
    }

    /// Queues a write of the 32-bit `value` to `addr` after everything queued before it, with a
    /// memory barrier that makes the earlier writes visible to any reader of `value` first.
    ///
    /// # Safety
    /// `addr..addr+4` must be 4-byte aligned and writable by this GPU (local or peer-mapped
    /// memory) until the write completes.
    pub unsafe fn write_value32(&self, addr: u64, value: u32) -> Result<(), CudaError> {
        self.context.bind()?;
        // SAFETY: the caller guarantees the address; the stream is valid; DEFAULT keeps the
        // barrier that orders earlier writes before this one.
        CudaError::check("cuStreamWriteValue32_v2", unsafe {
            sys::cuStreamWriteValue32_v2(
                self.raw,
                addr,
                value,
                sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32,
            )
        })
    }

    /// [`Self::write_value32`] for a 64-bit `value` at an 8-byte aligned `addr`, which may be
    /// host memory registered with the GPUs ([`super::HostRegistration`]). Only where
    /// [`Context::can_write_values64`] says the GPU can.
    ///
    /// # Safety
    /// `addr..addr+8` must be 8-byte aligned and writable by this GPU until the write
    /// completes.
    pub unsafe fn write_value64(&self, addr: u64, value: u64) -> Result<(), CudaError> {
        self.context.bind()?;
        // SAFETY: the caller guarantees the address; the stream is valid; DEFAULT keeps the
        // barrier that orders earlier writes before this one.
        CudaError::check("cuStreamWriteValue64_v2", unsafe {
            sys::cuStreamWriteValue64_v2(
                self.raw,
                addr,
                value,
                sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32,
            )
        })
    }

    /// Makes work queued on this stream from now on wait, on the GPU, until the 32-bit word at
    /// `addr` is at least `value` (compared as unsigned, wrapping as the driver defines).
    ///
    /// # Safety
    /// `addr..addr+4` must be 4-byte aligned GPU memory readable by this GPU for as long as the
    /// stream may wait on it.
    pub unsafe fn wait_value32(&self, addr: u64, value: u32) -> Result<(), CudaError> {
        self.context.bind()?;
        // SAFETY: the caller guarantees the address; the stream is valid.
        CudaError::check("cuStreamWaitValue32_v2", unsafe {
            sys::cuStreamWaitValue32_v2(
                self.raw,
                addr,
                value,
                sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32,
            )
        })
    }

    /// Makes work queued on this stream from now on wait, on the GPU, until `event` has
    /// fired. The event may belong to another stream, context or GPU of this process.
    ///
    /// # Errors
    /// The driver's error.
    pub fn wait_event(&self, event: &Event) -> Result<(), CudaError> {
        self.context.bind()?;
        // SAFETY: both handles are valid (the event is borrowed for the call); waiting on an
        // event of another context is allowed.
        CudaError::check("cuStreamWaitEvent", unsafe {
            sys::cuStreamWaitEvent(self.raw, event.raw(), 0)
        })
    }

    /// Blocks until everything queued so far has finished. For set-up and tests, never on a
    /// transfer's path.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.context.bind()?;
        // SAFETY: the stream is valid.
        CudaError::check("cuStreamSynchronize", unsafe {
            sys::cuStreamSynchronize(self.raw)
        })
    }

    pub(super) fn raw(&self) -> CUstream {
        self.raw
    }

    /// The context the stream belongs to.
    pub fn context(&self) -> &Arc<Context> {
        &self.context
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        let outcome = self.context.bind().and_then(|()| {
            // SAFETY: the stream is valid and destroyed exactly once, here.
            CudaError::check("cuStreamDestroy_v2", unsafe {
                sys::cuStreamDestroy_v2(self.raw)
            })
        });
        if let Err(error) = outcome {
            tracing::warn!(%error, "destroying a CUDA stream failed");
        }
    }
}
