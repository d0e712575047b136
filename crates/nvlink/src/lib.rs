//! ferry-nvlink: moves GPU memory between processes of one host over NVLink (or PCIe where the
//! GPUs have no NVLink), with the copy engines of the initiator's GPU.
//!
//! A peer's `cudaMalloc` buffers arrive in its descriptor with a CUDA IPC handle; the first
//! transfer to a buffer maps its allocation into this process (cached until the link drops),
//! and every op becomes one `cuMemcpyAsync` on one of a few streams of the local GPU. An event
//! recorded after the copies completes the transfer through ferry-core's event poller, so no
//! thread waits on the GPU.
//!
//! The `mnnvl` transport ([`MnnvlTransport`]) reuses the same link for VMM memory shared by
//! FABRIC handles across the nodes of a multi-node NVLink domain. It has not run on GB200
//! hardware yet: the H200 nodes it was built on refuse FABRIC allocations.

mod args;
mod import;
mod kernels;
mod link;
mod mnnvl;
mod plan;
mod transport;

pub use mnnvl::{MnnvlTransport, MNNVL};
pub use plan::{CopyPath, ENGINE_FROM};
pub use transport::{NvlinkConfig, NvlinkTransport, NVLINK};
