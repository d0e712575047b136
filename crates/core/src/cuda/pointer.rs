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

/// Reads one pointer attribute; `None` when CUDA does not know the address.
///
/// Attributes are 1 to 8 bytes wide; the value is read through a zeroed 64-bit slot, which on
/// little-endian machines (all that CUDA supports) holds any of them correctly.
fn attribute(
    attribute: CUpointer_attribute,
    call: &'static str,
    addr: u64,
) -> Result<Option<u64>, CudaError> {
    let mut value: u64 = 0;
    // SAFETY: the driver is initialised (memory_kind's contract); every attribute queried
    // here writes at most 8 bytes into `value`, and any address is a valid query.
    let result =
        unsafe { sys::cuPointerGetAttribute((&mut value as *mut u64).cast(), attribute, addr) };
    if result == CUresult::CUDA_ERROR_INVALID_VALUE {
        return Ok(None);
    }
    CudaError::check(call, result)?;
    Ok(Some(value))
}

/// What the driver says about a device address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DevicePointer {
    /// GPU ordinal (in this process) that owns the memory.
    pub ordinal: u32,
    /// True for `cudaMalloc` memory, exportable with a legacy IPC handle.
    pub legacy_ipc: bool,
    /// Handle types a VMM allocation was created with (`CUmemAllocationHandleType` bits).
    pub handle_types: u32,
    /// First byte of the allocation holding the address.
    pub allocation_base: u64,
    /// Size of that allocation.
    pub allocation_size: u64,
}

/// Describes device memory at `addr`. Only called for addresses `memory_kind` called Device.
pub(super) fn device_pointer(addr: u64) -> Result<DevicePointer, CudaError> {
    let read = |attr, call| {
        attribute(attr, call, addr)?.ok_or(CudaError {
            call,
            code: Some(CUresult::CUDA_ERROR_INVALID_VALUE as u32),
            name: "CUDA_ERROR_INVALID_VALUE".into(),
        })
    };
    let ordinal = read(
        CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
        "cuPointerGetAttribute(DEVICE_ORDINAL)",
    )? as u32;
    let legacy_ipc = read(
        CUpointer_attribute::CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
        "cuPointerGetAttribute(IS_LEGACY_CUDA_IPC_CAPABLE)",
    )? != 0;
    let handle_types = read(
        CUpointer_attribute::CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES,
        "cuPointerGetAttribute(ALLOWED_HANDLE_TYPES)",
    )? as u32;
    // The allocation range is looked up in the current context: make it the owning GPU's,
    // whatever the calling thread had current before (another GPU's, or none).
    super::context::Context::get(ordinal)?.bind()?;
    let mut base = 0u64;
    let mut size = 0usize;
    // SAFETY: the driver is initialised and `addr` is device memory (caller's contract);
    // `base` and `size` are valid places for the results.
    CudaError::check("cuMemGetAddressRange_v2", unsafe {
        sys::cuMemGetAddressRange_v2(&mut base, &mut size, addr)
    })?;
    Ok(DevicePointer {
        ordinal,
        legacy_ipc,
        handle_types,
        allocation_base: base,
        allocation_size: size as u64,
    })
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
        Some(kind) if kind == CUmemorytype::CU_MEMORYTYPE_DEVICE as u64 => MemoryKind::Device,
        Some(_) => MemoryKind::PinnedHost,
    })
}
