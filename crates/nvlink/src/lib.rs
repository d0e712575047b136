//! ferry-nvlink: moves GPU memory between processes of one host over NVLink (or PCIe where the
//! GPUs have no NVLink), with the copy engines of the initiator's GPU.
//!
//! A peer's `cudaMalloc` buffers arrive in its descriptor with a CUDA IPC handle; the first
//! transfer to a buffer maps its allocation into this process (cached until the link drops),
//! and every op becomes one `cuMemcpyAsync` on one of a few streams of the local GPU. An event
//! recorded after the copies completes the transfer through ferry-core's event poller, so no
//! thread waits on the GPU.

mod import;
mod link;
mod transport;

pub use transport::{NvlinkConfig, NvlinkTransport, NVLINK};
