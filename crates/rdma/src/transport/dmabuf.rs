//! What the transport asks of the GPUs: dma-bufs of their memory to register with its NICs
//! (GPUDirect RDMA without nvidia-peermem), and their PCI addresses to pick the nearest NIC.
//! CUDA in an engine ([`CudaGpus`]), a stand-in in tests.

use std::io;
use std::os::fd::OwnedFd;

/// Why a [`DmaBufSource`] hands out no dma-buf for a range of GPU memory. The transport then
/// registers the pointer itself, which needs nvidia-peermem, and names this reason if that
/// fails too.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NoDmaBuf {
    /// CUDA refused the export: the GPU, driver or kernel lacks dma-buf support, or the range
    /// is not GPU memory; its message says which and what to do.
    #[error(transparent)]
    Cuda(#[from] ferry_core::Error),
    /// A system call of the source failed.
    #[error("{what} failed: {source}")]
    Io {
        /// The operation that failed.
        what: String,
        /// The operating system's error.
        #[source]
        source: io::Error,
    },
}

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
    /// [`NoDmaBuf`]: why the memory cannot be exported (the GPU or driver lacks dma-buf
    /// support, say); the transport then tries registering the pointer itself, which needs
    /// nvidia-peermem, and names this reason if that fails too.
    fn export(&self, addr: u64, len: u64) -> Result<DmaBufRange, NoDmaBuf>;

    /// The PCI address (`0000:18:00.0`) of GPU `ordinal` of this process, to find the NICs
    /// nearest it; `None` when it cannot be known, and then every NIC serves the GPU.
    fn pci_bus_id(&self, ordinal: u32) -> Option<String> {
        let _ = ordinal;
        None
    }
}

/// The GPUs as CUDA reports them.
#[derive(Debug, Clone, Copy, Default)]
pub struct CudaGpus;

impl DmaBufSource for CudaGpus {
    fn export(&self, addr: u64, len: u64) -> Result<DmaBufRange, NoDmaBuf> {
        let buffer = ferry_core::cuda::export_dmabuf(addr, len)?;
        Ok(DmaBufRange {
            offset: addr - buffer.base,
            fd: buffer.fd,
        })
    }

    fn pci_bus_id(&self, ordinal: u32) -> Option<String> {
        let devices = ferry_core::cuda::Driver::get().devices().ok()?;
        devices
            .into_iter()
            .find(|device| device.ordinal == ordinal)
            .map(|device| device.pci_bus_id)
    }
}
