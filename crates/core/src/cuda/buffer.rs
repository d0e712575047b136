use super::context::Context;
use super::error::CudaError;
use cudarc::driver::sys;
use std::sync::Arc;

/// GPU memory from `cuMemAlloc` (what `cudaMalloc` and PyTorch's caching allocator hand out);
/// freed on drop. For examples, tests and benchmarks; servers register memory they already have.
#[derive(Debug)]
pub struct DeviceBuffer {
    addr: u64,
    len: usize,
    context: Arc<Context>,
}

impl DeviceBuffer {
    /// Allocates `len` bytes on the context's GPU.
    pub fn new(context: Arc<Context>, len: usize) -> Result<DeviceBuffer, CudaError> {
        context.bind()?;
        let mut addr = 0u64;
        // SAFETY: the context is current and `addr` is a valid place for the address.
        CudaError::check("cuMemAlloc_v2", unsafe {
            sys::cuMemAlloc_v2(&mut addr, len.max(1))
        })?;
        Ok(DeviceBuffer { addr, len, context })
    }

    /// The first byte's device address.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a zero-length buffer.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        let outcome = self.context.bind().and_then(|()| {
            // SAFETY: `addr` came from cuMemAlloc_v2 and is freed exactly once, here.
            CudaError::check("cuMemFree_v2", unsafe { sys::cuMemFree_v2(self.addr) })
        });
        if let Err(error) = outcome {
            tracing::warn!(%error, "freeing GPU memory failed");
        }
    }
}
