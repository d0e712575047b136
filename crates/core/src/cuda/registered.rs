//! Host memory the process mapped itself (a shared memory file, say), page-locked and mapped
//! into the GPUs' address space, so that a stream can store into it.

use super::context::Context;
use super::error::CudaError;
use cudarc::driver::sys;
use std::sync::Arc;

/// A host range registered with CUDA (`cuMemHostRegister`, portable and device-mapped);
/// unregistered on drop.
#[derive(Debug)]
pub struct HostRegistration {
    ptr: *mut u8,
    context: Arc<Context>,
}

// SAFETY: the registration only hands out addresses; registering and unregistering are
// driver calls any thread may make with a context current.
unsafe impl Send for HostRegistration {}
// SAFETY: as above; `&self` methods only query the driver.
unsafe impl Sync for HostRegistration {}

impl HostRegistration {
    /// Registers `ptr..ptr+len` for every GPU of the process.
    ///
    /// # Safety
    /// The range must be mapped host memory that stays mapped until the registration drops.
    ///
    /// # Errors
    /// The driver's (memory it cannot lock, a range registered already).
    pub unsafe fn new(
        context: Arc<Context>,
        ptr: *mut u8,
        len: usize,
    ) -> Result<HostRegistration, CudaError> {
        context.bind()?;
        // SAFETY: the caller guarantees the range is mapped for the registration's life;
        // the context is current.
        CudaError::check("cuMemHostRegister", unsafe {
            sys::cuMemHostRegister_v2(
                ptr.cast(),
                len,
                sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP,
            )
        })?;
        Ok(HostRegistration { ptr, context })
    }

    /// The address kernels and stream writes of `context`'s GPU use for the range's first
    /// byte; the rest follows it contiguously.
    ///
    /// # Errors
    /// The driver's.
    pub fn device_addr(&self, context: &Context) -> Result<u64, CudaError> {
        context.bind()?;
        let mut base: sys::CUdeviceptr = 0;
        // SAFETY: `ptr` starts a registered range; `base` is a valid place for the result;
        // flags must be 0.
        CudaError::check("cuMemHostGetDevicePointer", unsafe {
            sys::cuMemHostGetDevicePointer_v2(&mut base, self.ptr.cast(), 0)
        })?;
        Ok(base)
    }
}

impl Drop for HostRegistration {
    fn drop(&mut self) {
        let outcome = self.context.bind().and_then(|()| {
            // SAFETY: `ptr` was registered in `new` and is unregistered exactly once, here.
            CudaError::check("cuMemHostUnregister", unsafe {
                sys::cuMemHostUnregister(self.ptr.cast())
            })
        });
        if let Err(error) = outcome {
            tracing::warn!(%error, "unregistering host memory from CUDA failed");
        }
    }
}
