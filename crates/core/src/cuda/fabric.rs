//! Whether this node really permits FABRIC-handle allocations (multi-node NVLink), found by
//! making one: the device attribute says "supported" on H100/H200 nodes whose `cuMemCreate`
//! then refuses with CUDA_ERROR_NOT_PERMITTED for want of an IMEX channel.

use super::context::Context;
use super::error::CudaError;
use cudarc::driver::sys::{self, CUmemAllocationHandleType};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::OnceLock;

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
    let mut results = RESULTS.get_or_init(Mutex::default).lock();
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
