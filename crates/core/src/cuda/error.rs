use cudarc::driver::sys::{self, CUresult};
use std::ffi::CStr;

/// A CUDA driver call that returned something other than success.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("CUDA call {call} failed with {name} ({code}); see https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__TYPES.html for what it means")]
pub struct CudaError {
    /// The driver function that failed.
    pub call: &'static str,
    /// The numeric `CUresult`.
    pub code: u32,
    /// The symbolic name of the result, as the driver reports it.
    pub name: String,
}

impl CudaError {
    /// Turns a `CUresult` into `Ok` or a typed error naming `call`.
    pub(crate) fn check(call: &'static str, result: CUresult) -> Result<(), CudaError> {
        if result == CUresult::CUDA_SUCCESS {
            return Ok(());
        }
        Err(CudaError {
            call,
            code: result as u32,
            name: name_of(result),
        })
    }
}

fn name_of(result: CUresult) -> String {
    let mut text: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: the driver library is loaded (a CUresult only exists after a driver call), and
    // cuGetErrorName writes a pointer to a static, NUL-terminated string or leaves it null.
    let status = unsafe { sys::cuGetErrorName(result, &mut text) };
    if status != CUresult::CUDA_SUCCESS || text.is_null() {
        return format!("{result:?}");
    }
    // SAFETY: checked non-null above; the driver's error strings are static and NUL-terminated.
    unsafe { CStr::from_ptr(text) }
        .to_string_lossy()
        .into_owned()
}
