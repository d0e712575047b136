//! The FFI step of the FABRIC-handle probe: the device attribute says "supported" on H100/H200
//! nodes whose `cuMemCreate` then refuses with CUDA_ERROR_NOT_PERMITTED for want of an IMEX
//! channel, so the only test is to make one allocation.

use super::context::Context;
use super::error::CudaError;
use cudarc::driver::sys::{self, CUmemAllocationHandleType};

/// Makes one tiny FABRIC-handle allocation on GPU `ordinal` and releases it: the only reliable
/// test of whether this node permits them.
///
/// # Errors
/// The driver's refusal (`CUDA_ERROR_NOT_PERMITTED` without an IMEX channel, for one).
pub fn try_fabric_allocation(ordinal: u32) -> Result<(), CudaError> {
    let context = Context::get(ordinal)?;
    let (prop, granularity) = super::vmm::device_allocation(
        &context,
        CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_FABRIC,
    )?;
    let mut handle = 0;
    // SAFETY: as above; on success the handle is released right below.
    CudaError::check("cuMemCreate(FABRIC)", unsafe {
        sys::cuMemCreate(&mut handle, granularity, &prop, 0)
    })?;
    // SAFETY: `handle` came from the successful cuMemCreate above and is released once.
    CudaError::check("cuMemRelease", unsafe { sys::cuMemRelease(handle) })
}
