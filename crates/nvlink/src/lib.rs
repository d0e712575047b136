//! ferry-nvlink: moves GPU memory between processes of one host over NVLink (or PCIe where the
//! GPUs have no NVLink), with the copy engines of the initiator's GPU.
//!
//! The transport owns its kind of memory sharing: it exports each registered GPU buffer
//! ([`GpuExport`], carried opaquely in the descriptor): `cudaMalloc` memory by CUDA IPC handle,
//! VMM memory by POSIX fds that its fd-passing socket hands out. When the engine learns a
//! peer's descriptor it tries one mapping of each kind (namespaces decide what opens); the
//! first transfer to a buffer maps its allocation into this process (cached until the link
//! drops). Each transfer then takes one of
//! three copy paths ([`CopyPath`], chosen per copy from measured crossovers, see
//! `docs/copy-paths.md`):
//!
//! - the gather/scatter kernel of `kernels/copy.cu` (PTX committed beside it): one launch per
//!   GPU for any number of small copies, warps copying 16-byte vectors straight into the
//!   peer's memory through the P2P mapping; paged block copies compute their addresses on the
//!   GPU from the block ids;
//! - `cuMemcpyBatchAsync`, one call per stream, for large copies on CUDA 13 drivers;
//! - one `cuMemcpyAsync` per copy otherwise.
//!
//! An event recorded after the work completes the transfer through ferry-core's event poller,
//! so no thread waits on the GPU.
//!
//! [`Gemm`] multiplies bf16 matrices on the tensor cores (`kernels/gemm.cu`), standing in for a
//! model's compute when measuring what the copy kernel takes from it (`ferry bench --contend`).
//!
//! The `mnnvl` transport ([`MnnvlTransport`]) reuses the same link for VMM memory shared by
//! FABRIC handles across the nodes of a multi-node NVLink domain. It has not run on GB200
//! hardware yet: the H200 nodes it was built on refuse FABRIC allocations.

mod args;
mod bounds;
mod config;
mod export;
mod fabric_probe;
mod fd_passing;
#[cfg(any(fuzzing, test))]
pub mod fuzzing;
mod gemm;
mod import;
mod kernels;
mod link;
mod messages;
mod mnnvl;
mod plan;
mod staging;
mod transport;
mod trial;

pub use config::{
    CudaMallocStaging, CUDA_MALLOC_STAGING_ENV, STAGING_SLOTS_OTHER_GPU, STAGING_SLOTS_SAME_GPU,
};
pub use export::{GpuExport, EXPORT_VERSION};
pub use fabric_probe::{probe_fabric, FabricSupport};
pub use fd_passing::{fd_socket_name, SocketDirError, FDS_PER_MESSAGE, SOCKET_DIR_ENV};
pub use gemm::{Gemm, GemmRate, GEMM_TILE};
pub use mnnvl::{MnnvlTransport, MNNVL};
pub use plan::{engines_from, CopyPath, BATCHED_FROM, ENGINE_FROM};
pub use transport::{NvlinkConfig, NvlinkTransport, NVLINK};
pub use trial::PID_CLASH_REMEDIES;
