use super::context::Context;
use super::error::CudaError;
use cudarc::driver::sys;
use parking_lot::Mutex;
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

/// A pinned buffer handed out front to back in disjoint slices, so that many small staging
/// copies share one allocation. Each [`PinnedSlice`] keeps its chunk alive; the chunk starts
/// over from the front only once no slice of it is left ([`PinnedChunk::rewind`]).
#[derive(Debug)]
pub struct PinnedChunk {
    buffer: PinnedBuffer,
    /// Bytes handed out from the front.
    used: Mutex<usize>,
}

impl PinnedChunk {
    /// Hands `buffer` out in slices.
    pub fn new(buffer: PinnedBuffer) -> Arc<PinnedChunk> {
        Arc::new(PinnedChunk {
            buffer,
            used: Mutex::new(0),
        })
    }

    /// The next `len` bytes, starting at a multiple of `align` (a power of two) from the
    /// chunk's first byte; `None` when they do not fit in what is left.
    pub fn carve(self: &Arc<Self>, len: usize, align: usize) -> Option<PinnedSlice> {
        let mut used = self.used.lock();
        let (offset, end) = place(*used, len, align, self.buffer.len())?;
        *used = end;
        Some(PinnedSlice {
            chunk: Arc::clone(self),
            offset,
            len,
        })
    }

    /// Starts handing out from the front again, when `chunk` is the only handle left (no
    /// slice of it is alive); `false`, changing nothing, otherwise.
    pub fn rewind(chunk: &mut Arc<PinnedChunk>) -> bool {
        match Arc::get_mut(chunk) {
            Some(chunk) => {
                *chunk.used.get_mut() = 0;
                true
            }
            None => false,
        }
    }

    /// Bytes of the whole chunk.
    pub fn capacity(&self) -> usize {
        self.buffer.len()
    }
}

/// Where the next `len` bytes go in a buffer of `capacity` bytes whose first `used` are handed
/// out: their offset, aligned up to `align` (a power of two), and the new `used`; `None` when
/// they do not fit.
pub(crate) fn place(
    used: usize,
    len: usize,
    align: usize,
    capacity: usize,
) -> Option<(usize, usize)> {
    let offset = used.checked_next_multiple_of(align.max(1))?;
    let end = offset.checked_add(len)?;
    (end <= capacity).then_some((offset, end))
}

/// `len` bytes of a [`PinnedChunk`] that no other slice overlaps; keeps the chunk alive.
#[derive(Debug)]
pub struct PinnedSlice {
    chunk: Arc<PinnedChunk>,
    offset: usize,
    len: usize,
}

impl PinnedSlice {
    /// The address GPUs use for the first byte (the host address: unified addressing).
    pub fn addr(&self) -> u64 {
        self.chunk.buffer.addr() + self.offset as u64
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a zero-length slice.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes, for the host to read. A GPU copy into the slice must have completed first.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `offset..offset+len` lies inside the chunk's buffer (`place` checked it) and
        // no other slice covers any of it (the chunk hands out each byte once until it is
        // rewound, which needs every slice gone); the chunk is kept alive by `self.chunk`.
        unsafe { std::slice::from_raw_parts(self.chunk.buffer.ptr.add(self.offset), self.len) }
    }

    /// The bytes, for the host to fill. No GPU copy out of the slice may be in flight.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`; `&mut self` makes this the only reference to these bytes,
        // since no other slice and no other handle of this slice reaches them.
        unsafe { std::slice::from_raw_parts_mut(self.chunk.buffer.ptr.add(self.offset), self.len) }
    }
}

#[cfg(test)]
mod tests {
    use super::place;

    #[test]
    fn slices_are_placed_aligned_back_to_back_and_only_where_they_fit() {
        assert_eq!(place(0, 100, 64, 4096), Some((0, 100)));
        assert_eq!(place(100, 100, 64, 4096), Some((128, 228)));
        assert_eq!(place(128, 100, 64, 4096), Some((128, 228)));
        assert_eq!(place(4000, 96, 64, 4096), None);
        assert_eq!(place(3968, 128, 64, 4096), Some((3968, 4096)));
        assert_eq!(place(3968, 129, 64, 4096), None);
        assert_eq!(place(5, 3, 0, 8), Some((5, 8)));
        assert_eq!(place(usize::MAX - 3, 1, 64, usize::MAX), None);
        assert_eq!(place(64, usize::MAX, 64, usize::MAX), None);
    }
}
