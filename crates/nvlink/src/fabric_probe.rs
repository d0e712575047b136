//! Whether this node really permits FABRIC-handle allocations (multi-node NVLink), found once
//! per GPU by making one ([`ferry_core::cuda::try_fabric_allocation`]).

use ferry_core::cuda::{try_fabric_allocation, CudaError};
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
