use super::context::Context;
use super::error::CudaError;
use cudarc::driver::sys;

/// Copies `bytes` to device address `dst` on the context's GPU and waits for the copy.
///
/// # Safety
/// 1. `dst..dst+bytes.len()` must be device memory this context can write.
pub unsafe fn upload(context: &Context, dst: u64, bytes: &[u8]) -> Result<(), CudaError> {
    context.bind()?;
    // SAFETY: the caller guarantees the destination (1); `bytes` is readable.
    CudaError::check("cuMemcpyHtoD_v2", unsafe {
        sys::cuMemcpyHtoD_v2(dst, bytes.as_ptr().cast(), bytes.len())
    })?;
    // From pageable memory the call returns once the bytes are staged, while the DMA into the
    // GPU may still run on the legacy stream; a later copy on another stream could then be
    // overwritten by it. Waiting for the legacy stream makes the upload complete on return.
    // SAFETY: the null stream is the context's legacy default stream.
    CudaError::check("cuStreamSynchronize", unsafe {
        sys::cuStreamSynchronize(std::ptr::null_mut())
    })
}

/// Copies `out.len()` bytes from device address `src` into `out` and waits for the copy.
///
/// # Safety
/// 1. `src..src+out.len()` must be device memory this context can read.
pub unsafe fn download(context: &Context, src: u64, out: &mut [u8]) -> Result<(), CudaError> {
    context.bind()?;
    // SAFETY: the caller guarantees the source (1); `out` is writable.
    CudaError::check("cuMemcpyDtoH_v2", unsafe {
        sys::cuMemcpyDtoH_v2(out.as_mut_ptr().cast(), src, out.len())
    })
}
