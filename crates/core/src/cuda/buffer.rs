use super::context::Context;
use super::error::CudaError;
use super::transfer::{download, upload};
use crate::error::{Error, RangeError};
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

    /// The context of the GPU the buffer lives on.
    pub fn context(&self) -> &Arc<Context> {
        &self.context
    }

    /// Copies `bytes` into the buffer, `offset` bytes from its start, and waits for the copy.
    ///
    /// # Errors
    /// [`RangeError::OutsideRegion`] when the range runs past the buffer's end, else the
    /// driver's error as [`Error::Cuda`].
    pub fn write_at(&self, offset: usize, bytes: &[u8]) -> Result<(), Error> {
        let addr = self.inside(offset, bytes.len())?;
        // SAFETY: the range lies inside this live allocation of the context's GPU (checked
        // just above), which the borrow of `self` keeps allocated across the call.
        unsafe { upload(&self.context, addr, bytes)? };
        Ok(())
    }

    /// Copies `out.len()` bytes of the buffer, from `offset` bytes past its start, into `out`
    /// and waits for the copy.
    ///
    /// # Errors
    /// As [`DeviceBuffer::write_at`].
    pub fn read_at(&self, offset: usize, out: &mut [u8]) -> Result<(), Error> {
        let addr = self.inside(offset, out.len())?;
        // SAFETY: as in `write_at`: the range lies inside this live allocation.
        unsafe { download(&self.context, addr, out)? };
        Ok(())
    }

    /// The device address `offset` bytes in, when `len` bytes from there end inside the buffer.
    fn inside(&self, offset: usize, len: usize) -> Result<u64, RangeError> {
        within(self.len, offset, len)?;
        Ok(self.addr + offset as u64)
    }
}

/// Whether `len` bytes from `offset` end inside a buffer of `size` bytes.
fn within(size: usize, offset: usize, len: usize) -> Result<(), RangeError> {
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(RangeError::OutsideRegion {
            offset: offset as u64,
            len: len as u64,
            region_len: size as u64,
        }),
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

#[cfg(test)]
mod tests {
    use super::within;
    use crate::error::RangeError;

    #[test]
    fn ranges_must_end_inside_the_buffer_without_wrapping() {
        assert!(within(4096, 0, 4096).is_ok());
        assert!(within(4096, 4096, 0).is_ok());
        assert!(within(0, 0, 0).is_ok());
        assert!(matches!(
            within(4096, 1, 4096),
            Err(RangeError::OutsideRegion {
                offset: 1,
                len: 4096,
                region_len: 4096
            })
        ));
        assert!(within(4096, usize::MAX, 2).is_err());
    }
}
