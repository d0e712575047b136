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
