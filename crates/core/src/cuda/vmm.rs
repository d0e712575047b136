//! VMM memory (`cuMemCreate`): the allocations behind PyTorch's expandable segments. Shared
//! between processes as POSIX file descriptors, and mapped back to back on the importer so a
//! range over several allocations is one range there too.

use super::context::Context;
use super::error::CudaError;
use crate::error::{Error, Result};
use cudarc::driver::sys::{
    self, CUmemAccessDesc, CUmemAccess_flags, CUmemAllocationGranularity_flags,
    CUmemAllocationHandleType, CUmemAllocationProp, CUmemAllocationProp_st__bindgen_ty_1,
    CUmemAllocationType, CUmemGenericAllocationHandle, CUmemLocation, CUmemLocationType,
};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;

/// The `ALLOWED_HANDLE_TYPES` bit of POSIX file-descriptor handles.
pub const POSIX_FD_HANDLE: u32 = 1;
/// The `ALLOWED_HANDLE_TYPES` bit of FABRIC handles (multi-node NVLink, needs IMEX).
pub const FABRIC_HANDLE: u32 = 8;
/// Size of a FABRIC handle.
pub const FABRIC_HANDLE_LEN: usize = 64;

/// One physical VMM allocation, held by this process; released on drop.
#[derive(Debug)]
pub struct AllocationHandle {
    raw: CUmemGenericAllocationHandle,
}

impl AllocationHandle {
    /// Takes a reference to the allocation mapped at `addr` (its first byte).
    pub fn retain(addr: u64) -> Result<AllocationHandle, CudaError> {
        let mut raw = 0;
        // SAFETY: the driver only reads `addr` to find the allocation; `raw` is a valid place.
        CudaError::check("cuMemRetainAllocationHandle", unsafe {
            sys::cuMemRetainAllocationHandle(&mut raw, addr as *mut std::ffi::c_void)
        })?;
        Ok(AllocationHandle { raw })
    }

    /// A new file descriptor naming the allocation; the caller owns (and closes) it.
    pub fn export_fd(&self) -> Result<OwnedFd, CudaError> {
        let mut fd: std::ffi::c_int = -1;
        // SAFETY: for POSIX-fd handles the driver writes one int into `fd`.
        CudaError::check("cuMemExportToShareableHandle", unsafe {
            sys::cuMemExportToShareableHandle(
                (&mut fd as *mut std::ffi::c_int).cast(),
                self.raw,
                CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        })?;
        // SAFETY: the export succeeded, so `fd` is a new descriptor that nothing else owns.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// The allocation's FABRIC handle, valid on every node of the NVLink domain.
    pub fn export_fabric(&self) -> Result<[u8; FABRIC_HANDLE_LEN], CudaError> {
        let mut handle = sys::CUmemFabricHandle {
            data: [0; FABRIC_HANDLE_LEN],
        };
        // SAFETY: for FABRIC handles the driver writes one CUmemFabricHandle into `handle`.
        CudaError::check("cuMemExportToShareableHandle(FABRIC)", unsafe {
            sys::cuMemExportToShareableHandle(
                (&mut handle as *mut sys::CUmemFabricHandle).cast(),
                self.raw,
                CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_FABRIC,
                0,
            )
        })?;
        Ok(handle.data)
    }

    /// Imports an allocation by its FABRIC handle.
    pub fn import_fabric(handle: &[u8; FABRIC_HANDLE_LEN]) -> Result<AllocationHandle, CudaError> {
        let mut fabric = sys::CUmemFabricHandle { data: *handle };
        let mut raw = 0;
        // SAFETY: for FABRIC handles the driver reads one CUmemFabricHandle from the pointer,
        // which points at `fabric` for the duration of the call.
        CudaError::check("cuMemImportFromShareableHandle(FABRIC)", unsafe {
            sys::cuMemImportFromShareableHandle(
                &mut raw,
                (&mut fabric as *mut sys::CUmemFabricHandle).cast(),
                CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_FABRIC,
            )
        })?;
        Ok(AllocationHandle { raw })
    }

    /// Imports an allocation another process exported; the descriptor stays the caller's.
    pub fn import_fd(fd: &OwnedFd) -> Result<AllocationHandle, CudaError> {
        let mut raw = 0;
        // SAFETY: for POSIX-fd handles the driver takes the descriptor's number as the handle
        // pointer value; `fd` is open for the duration of the call.
        CudaError::check("cuMemImportFromShareableHandle", unsafe {
            sys::cuMemImportFromShareableHandle(
                &mut raw,
                fd.as_raw_fd() as usize as *mut std::ffi::c_void,
                CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            )
        })?;
        Ok(AllocationHandle { raw })
    }
}

impl Drop for AllocationHandle {
    fn drop(&mut self) {
        // SAFETY: `raw` came from retain, import or create and is released exactly once.
        if let Err(error) = CudaError::check("cuMemRelease", unsafe { sys::cuMemRelease(self.raw) })
        {
            tracing::warn!(%error, "releasing a VMM allocation handle failed");
        }
    }
}

/// Allocations mapped back to back into one reserved address range of this process, readable
/// and writable by one GPU; unmapped, unreserved and released on drop.
#[derive(Debug)]
pub struct VmmMapping {
    base: u64,
    /// Bytes reserved at `base`.
    reserved: usize,
    /// Bytes mapped from `base` (all of `reserved` once `map` succeeded).
    mapped: usize,
    context: Arc<Context>,
    /// Released after the range is unmapped and freed (fields drop after `Drop::drop`).
    pieces: Vec<AllocationHandle>,
}

impl VmmMapping {
    /// Maps `pieces` (each with its size) in order and gives the context's GPU access. The
    /// driver refuses a size larger than its allocation holds, so [`VmmMapping::len`] counts
    /// only bytes that are really there.
    ///
    /// # Errors
    /// [`Error::ApiMisuse`] for no pieces, a piece of size 0, or sizes whose sum overflows,
    /// before anything is reserved; else the driver's error.
    pub fn map(
        context: Arc<Context>,
        pieces: Vec<(AllocationHandle, usize)>,
    ) -> Result<VmmMapping> {
        let size = total_size(pieces.iter().map(|(_, size)| *size))?;
        context.bind()?;
        let mut base = 0u64;
        // SAFETY: the context is current; `base` is a valid place for the reserved address.
        CudaError::check("cuMemAddressReserve", unsafe {
            sys::cuMemAddressReserve(&mut base, size, 0, 0, 0)
        })?;
        // From here on, Drop undoes whatever was done, also on the error paths below.
        let mut mapping = VmmMapping {
            base,
            reserved: size,
            mapped: 0,
            context,
            pieces: Vec::with_capacity(pieces.len()),
        };
        for (handle, piece_size) in pieces {
            let at = base + mapping.mapped as u64;
            mapping.pieces.push(handle);
            let raw = mapping.pieces[mapping.pieces.len() - 1].raw;
            // SAFETY: the range lies inside the reservation made above and is not mapped yet.
            CudaError::check("cuMemMap", unsafe {
                sys::cuMemMap(at, piece_size, 0, raw, 0)
            })?;
            mapping.mapped += piece_size;
        }
        let access = CUmemAccessDesc {
            location: CUmemLocation {
                type_: CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                id: mapping.context.ordinal() as i32,
            },
            flags: CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: the whole range is mapped (above) and `access` is one valid descriptor.
        CudaError::check("cuMemSetAccess", unsafe {
            sys::cuMemSetAccess(base, size, &access, 1)
        })?;
        Ok(mapping)
    }

    /// The first byte of the mapped range.
    pub fn base(&self) -> u64 {
        self.base
    }

    /// Length of the mapped range.
    pub fn len(&self) -> usize {
        self.mapped
    }

    /// True for an empty mapping.
    pub fn is_empty(&self) -> bool {
        self.mapped == 0
    }
}

impl Drop for VmmMapping {
    fn drop(&mut self) {
        let outcome = self.context.bind().and_then(|()| {
            if self.mapped > 0 {
                // SAFETY: `base..base+mapped` is exactly what `map` mapped; unmapped once, here.
                CudaError::check("cuMemUnmap", unsafe {
                    sys::cuMemUnmap(self.base, self.mapped)
                })?;
            }
            // SAFETY: `base..base+reserved` is the reservation `map` made; freed once, here.
            CudaError::check("cuMemAddressFree", unsafe {
                sys::cuMemAddressFree(self.base, self.reserved)
            })
        });
        if let Err(error) = outcome {
            tracing::warn!(%error, "unmapping VMM memory failed");
        }
    }
}

/// The sum of `sizes`, or `None` when there are none, one is 0, or the sum overflows.
fn total_size(sizes: impl Iterator<Item = usize>) -> Result<usize> {
    let mut total = 0usize;
    let mut count = 0usize;
    for (index, size) in sizes.enumerate() {
        if size == 0 {
            return Err(Error::ApiMisuse(format!(
                "VmmMapping::map: piece {index} has size 0; pass each allocation's real size"
            )));
        }
        total = total.checked_add(size).ok_or_else(|| {
            Error::ApiMisuse(format!(
                "VmmMapping::map: the sizes of pieces 0..={index} add up past the address space; pass each allocation's real size"
            ))
        })?;
        count += 1;
    }
    match count {
        0 => Err(Error::ApiMisuse(
            "VmmMapping::map: no pieces; pass at least one allocation to map".into(),
        )),
        _ => Ok(total),
    }
}

/// The properties of a pinned VMM allocation on `context`'s GPU exportable as `handles`, with
/// the GPU's minimum granularity for it (at least 1). Binds the context.
pub(super) fn device_allocation(
    context: &Context,
    handles: CUmemAllocationHandleType,
) -> Result<(CUmemAllocationProp, usize), CudaError> {
    context.bind()?;
    let prop = CUmemAllocationProp {
        type_: CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: handles,
        location: CUmemLocation {
            type_: CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: context.ordinal() as i32,
        },
        win32HandleMetaData: std::ptr::null_mut(),
        allocFlags: CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: 0,
            usage: 0,
            reserved: [0; 4],
        },
    };
    let mut granularity = 0usize;
    // SAFETY: the context is current; `prop` is fully initialised and `granularity` is a
    // valid place for the answer.
    CudaError::check("cuMemGetAllocationGranularity", unsafe {
        sys::cuMemGetAllocationGranularity(
            &mut granularity,
            &prop,
            CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
        )
    })?;
    Ok((prop, granularity.max(1)))
}

/// Creates `pieces` VMM allocations of `piece_bytes` (rounded up to the GPU's granularity)
/// with POSIX-fd handles, mapped back to back, as PyTorch's expandable segments are. For tests
/// and tools; servers register the memory they already have.
pub fn create_vmm(context: Arc<Context>, piece_bytes: usize, pieces: usize) -> Result<VmmMapping> {
    let (prop, granularity) = device_allocation(
        &context,
        CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
    )?;
    let size = piece_bytes.max(1).div_ceil(granularity) * granularity;
    let mut handles = Vec::with_capacity(pieces);
    for _ in 0..pieces.max(1) {
        let mut raw = 0;
        // SAFETY: as above; the handle is owned by the AllocationHandle made right after.
        CudaError::check("cuMemCreate", unsafe {
            sys::cuMemCreate(&mut raw, size, &prop, 0)
        })?;
        handles.push((AllocationHandle { raw }, size));
    }
    VmmMapping::map(context, handles)
}

#[cfg(test)]
mod tests {
    use super::total_size;
    use crate::error::Error;

    /// The caller-mistake message of `sizes`, or a panic naming what was summed.
    fn refusal(sizes: &[usize]) -> String {
        match total_size(sizes.iter().copied()) {
            Err(Error::ApiMisuse(message)) => message,
            other => panic!("expected ApiMisuse for {sizes:?}, got {other:?}"),
        }
    }

    #[test]
    fn piece_sizes_are_summed_only_when_every_piece_is_real_and_the_sum_fits() {
        assert_eq!(total_size([2 << 20, 2 << 20].into_iter()).unwrap(), 4 << 20);
        assert!(refusal(&[]).contains("no pieces"));
        assert!(refusal(&[2 << 20, 0]).contains("piece 1 has size 0"));
        assert!(refusal(&[usize::MAX, 1]).contains("pieces 0..=1 add up past"));
        assert!(refusal(&[usize::MAX / 2, usize::MAX / 2 + 2]).contains("past the address space"));
    }
}
