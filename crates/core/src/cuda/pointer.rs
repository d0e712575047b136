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

/// Reads one 32-bit pointer attribute; `None` when CUDA does not know the address.
fn attribute(
    attribute: CUpointer_attribute,
    call: &'static str,
    addr: u64,
) -> Result<Option<u32>, CudaError> {
    let mut value: u32 = 0;
    // SAFETY: the driver is initialised (memory_kind's contract); the attributes queried here
    // (IS_MANAGED, MEMORY_TYPE) each write one 32-bit value into `value`, and any address is
    // a valid query.
    let result =
        unsafe { sys::cuPointerGetAttribute((&mut value as *mut u32).cast(), attribute, addr) };
    if result == CUresult::CUDA_ERROR_INVALID_VALUE {
        return Ok(None);
    }
    CudaError::check(call, result)?;
    Ok(Some(value))
}

/// Asks the driver what `addr` is.
///
/// Only called once the driver is initialised ([`super::Driver`] checks).
pub(super) fn memory_kind(addr: u64) -> Result<MemoryKind, CudaError> {
    let managed = attribute(
        CUpointer_attribute::CU_POINTER_ATTRIBUTE_IS_MANAGED,
        "cuPointerGetAttribute(IS_MANAGED)",
        addr,
    )?;
    if managed.is_some_and(|flag| flag != 0) {
        return Ok(MemoryKind::Managed);
    }
    let memory_type = attribute(
        CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
        "cuPointerGetAttribute(MEMORY_TYPE)",
        addr,
    )?;
    Ok(match memory_type {
        None => MemoryKind::PageableHost,
        Some(kind) if kind == CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 => MemoryKind::Device,
        Some(_) => MemoryKind::PinnedHost,
    })
}
