//! Where the transport gets dma-bufs of GPU memory to register with its NICs (GPUDirect
//! RDMA without nvidia-peermem): CUDA in an engine, a stand-in in tests.

use std::os::fd::OwnedFd;

/// A dma-buf covering a range of GPU memory.
#[derive(Debug)]
pub struct DmaBufRange {
    /// The dma-buf; the NIC registration holds its own reference, so it may be closed after.
    pub fd: OwnedFd,
    /// Where the range starts inside the dma-buf.
    pub offset: u64,
}

/// Hands out dma-bufs of GPU memory for the NICs to register.
pub trait DmaBufSource: Send + Sync + 'static {
    /// A dma-buf covering `len` bytes at `addr` of GPU memory.
    ///
    /// # Errors
    /// Why the memory cannot be exported (the GPU or driver lacks dma-buf support, say); the
    /// transport then tries registering the pointer itself, which needs nvidia-peermem.
    fn export(&self, addr: u64, len: u64) -> Result<DmaBufRange, String>;
}
