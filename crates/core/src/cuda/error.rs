//! Turning the driver's results into [`CudaError`]s (the type itself is with the crate's other
//! errors, in `crate::error`, which the FFI layer's callers all reach).

pub use crate::error::CudaError;
use cudarc::driver::sys::{self, CUresult};
use std::ffi::CStr;

impl CudaError {
    /// Turns a `CUresult` into `Ok` or a typed error naming `call`.
    pub(crate) fn check(call: &'static str, result: CUresult) -> Result<(), CudaError> {
        if result == CUresult::CUDA_SUCCESS {
            return Ok(());
        }
        Err(CudaError {
            call,
            code: Some(result as u32),
            name: name_of(result),
        })
    }

    /// `call` could not be made: no CUDA driver library (libcuda) could be loaded.
    pub(crate) fn no_driver(call: &'static str) -> CudaError {
        CudaError {
            call,
            code: None,
            name: "no CUDA driver library (libcuda) found".into(),
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_driver_has_no_code_and_says_what_to_do() {
        let error = CudaError::no_driver("cuInit");
        assert_eq!(error.code, None);
        let message = error.to_string();
        assert!(message.contains("CUDA is unavailable"), "{message}");
        assert!(message.contains("cuInit"), "{message}");
        assert!(message.contains("install the NVIDIA driver"), "{message}");
        assert!(!message.contains("failed with"), "{message}");
    }

    #[test]
    fn a_driver_result_names_its_call_code_and_name() {
        let error = CudaError {
            call: "cuMemMap",
            code: Some(801),
            name: "CUDA_ERROR_NOT_SUPPORTED".into(),
        };
        assert_eq!(
            error.to_string(),
            "CUDA call cuMemMap failed with CUDA_ERROR_NOT_SUPPORTED (801); see https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__TYPES.html for what it means"
        );
    }
}
