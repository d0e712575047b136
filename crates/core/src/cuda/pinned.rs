use super::context::Context;
use super::error::CudaError;
use cudarc::driver::sys;
use std::sync::Arc;

/// Page-locked host memory from `cuMemHostAlloc`, which the GPUs' copy engines read and write
/// directly (the staging memory of asynchronous host<->GPU copies); freed on drop.
#[derive(Debug)]
pub struct PinnedBuffer {
    ptr: *mut u8,
    len: usize,
    context: Arc<Context>,
}

// SAFETY: the buffer owns its memory exclusively; access goes through &self / &mut self.
unsafe impl Send for PinnedBuffer {}
// SAFETY: shared access only reads (`as_slice`, `addr`).
unsafe impl Sync for PinnedBuffer {}

impl PinnedBuffer {
    /// Allocates `len` zeroed bytes, usable by every GPU of the process (portable).
    pub fn new(context: Arc<Context>, len: usize) -> Result<PinnedBuffer, CudaError> {
        context.bind()?;
        let mut raw: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: the context is current and `raw` is a valid place for the pointer.
        CudaError::check("cuMemHostAlloc", unsafe {
            sys::cuMemHostAlloc(&mut raw, len.max(1), sys::CU_MEMHOSTALLOC_PORTABLE)
        })?;
        let ptr = raw.cast::<u8>();
        // SAFETY: the allocation holds at least `len` bytes and nothing else refers to it yet.
        unsafe { std::ptr::write_bytes(ptr, 0, len) };
        Ok(PinnedBuffer { ptr, len, context })
    }

    /// The address GPUs use for the first byte (the same as the host pointer: unified
    /// addressing).
    pub fn addr(&self) -> u64 {
        self.ptr as u64
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a zero-length buffer.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes, for the host to read. A GPU copy into the buffer must have completed first.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` points to `len` initialised bytes owned by this buffer.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The bytes, for the host to fill. No GPU copy out of the buffer may be in flight.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` points to `len` initialised bytes owned by this buffer, and `&mut self`
        // makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        let outcome = self.context.bind().and_then(|()| {
            // SAFETY: `ptr` came from cuMemHostAlloc and is freed exactly once, here.
            CudaError::check("cuMemFreeHost", unsafe {
                sys::cuMemFreeHost(self.ptr.cast())
            })
        });
        if let Err(error) = outcome {
            tracing::warn!(%error, "freeing pinned host memory failed");
        }
    }
}
