//! Whether this node really permits FABRIC-handle allocations (multi-node NVLink), found by
//! making one: the device attribute says "supported" on H100/H200 nodes whose `cuMemCreate`
//! then refuses with CUDA_ERROR_NOT_PERMITTED for want of an IMEX channel.

use super::context::Context;
use super::error::CudaError;
use cudarc::driver::sys::{
    self, CUmemAllocationGranularity_flags, CUmemAllocationHandleType, CUmemAllocationProp,
    CUmemAllocationProp_st__bindgen_ty_1, CUmemAllocationType, CUmemLocation, CUmemLocationType,
};
use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

/// The outcome of the fabric probe on one GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FabricSupport {
    /// A tiny FABRIC-handle allocation succeeded (and was released).
    Permitted,
    /// The driver refused it; the error says why.
    Refused(CudaError),
}

/// Probes GPU `ordinal` once per process (later calls return the first answer) and logs the
/// result once.
pub fn probe_fabric(ordinal: u32) -> FabricSupport {
    static RESULTS: OnceLock<Mutex<HashMap<u32, FabricSupport>>> = OnceLock::new();
    let mut results = RESULTS
        .get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(|poison| poison.into_inner());
    results
        .entry(ordinal)
        .or_insert_with(|| {
            let outcome = match try_fabric_allocation(ordinal) {
                Ok(()) => FabricSupport::Permitted,
                Err(error) => FabricSupport::Refused(error),
            };
            match &outcome {
                FabricSupport::Permitted => {
                    tracing::info!(gpu = ordinal, "FABRIC-handle allocations are permitted")
                }
                FabricSupport::Refused(error) => tracing::info!(
                    gpu = ordinal,
                    %error,
                    "FABRIC-handle allocations are refused here (no IMEX channel?); mnnvl is unavailable, same-host GPUs use CUDA IPC"
                ),
            }
            outcome
        })
        .clone()
}

fn try_fabric_allocation(ordinal: u32) -> Result<(), CudaError> {
    let context = Context::get(ordinal)?;
    context.bind()?;
    let prop = CUmemAllocationProp {
        type_: CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_FABRIC,
        location: CUmemLocation {
            type_: CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: ordinal as i32,
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
    let mut handle = 0;
    // SAFETY: as above; on success the handle is released right below.
    CudaError::check("cuMemCreate(FABRIC)", unsafe {
        sys::cuMemCreate(&mut handle, granularity.max(1), &prop, 0)
    })?;
    // SAFETY: `handle` came from the successful cuMemCreate above and is released once.
    CudaError::check("cuMemRelease", unsafe { sys::cuMemRelease(handle) })
}
