use super::error::CudaError;
use cudarc::driver::sys::{self, CUmemorytype, CUpointer_attribute, CUresult};

/// What a registered address turned out to be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemoryKind {
    /// Ordinary host memory that CUDA does not know about.
    PageableHost,
    /// Host memory pinned through CUDA (`cudaHostAlloc`/`cuMemHostRegister`).
    PinnedHost,
    /// Memory on a GPU.
    Device,
    /// CUDA managed (unified) memory.
    Managed,
}

/// Asks the driver what `addr` is.
///
/// Only called once the driver is initialised ([`super::Driver`] checks).
pub(super) fn memory_kind(addr: u64) -> Result<MemoryKind, CudaError> {
    let mut is_managed: u32 = 0;
    // SAFETY: the driver is initialised (caller's contract); IS_MANAGED writes one 32-bit
    // boolean into `is_managed`, and any address value is a valid query.
    let managed = unsafe {
        sys::cuPointerGetAttribute(
            (&mut is_managed as *mut u32).cast(),
            CUpointer_attribute::CU_POINTER_ATTRIBUTE_IS_MANAGED,
            addr,
        )
    };
    if managed == CUresult::CUDA_ERROR_INVALID_VALUE {
        return Ok(MemoryKind::PageableHost);
    }
    CudaError::check("cuPointerGetAttribute(IS_MANAGED)", managed)?;
    if is_managed != 0 {
        return Ok(MemoryKind::Managed);
    }
    let mut memory_type: u32 = 0;
    // SAFETY: as above; MEMORY_TYPE writes one CUmemorytype (32 bits) into `memory_type`.
    let result = unsafe {
        sys::cuPointerGetAttribute(
            (&mut memory_type as *mut u32).cast(),
            CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
            addr,
        )
    };
    if result == CUresult::CUDA_ERROR_INVALID_VALUE {
        return Ok(MemoryKind::PageableHost);
    }
    CudaError::check("cuPointerGetAttribute(MEMORY_TYPE)", result)?;
    Ok(
        if memory_type == CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 {
            MemoryKind::Device
        } else {
            MemoryKind::PinnedHost
        },
    )
}
