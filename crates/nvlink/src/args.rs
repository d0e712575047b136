//! Pinned host buffers that carry kernel arguments too large for a launch (copy lists, block
//! ids). The kernels read them in place over the bus, so no upload is queued before a launch.

use ferry_core::cuda::{Context, CudaError, Event, PinnedBuffer};
use parking_lot::Mutex;
use std::sync::Arc;

/// Smallest buffer allocated, so small batches reuse one buffer.
const MIN_BUFFER: usize = 64 << 10;

/// Argument buffers of one GPU, reused once the launch that read them has finished.
#[derive(Debug)]
pub(crate) struct ArgumentPool {
    context: Arc<Context>,
    /// Buffers with the event after the last launch that reads them.
    free: Mutex<Vec<(PinnedBuffer, Arc<Event>)>>,
}

impl ArgumentPool {
    pub(crate) fn new(context: Arc<Context>) -> ArgumentPool {
        ArgumentPool {
            context,
            free: Mutex::default(),
        }
    }

    /// A buffer of at least `len` bytes that no queued launch reads any more.
    pub(crate) fn take(&self, len: usize) -> Result<PinnedBuffer, CudaError> {
        {
            let mut free = self.free.lock();
            let mut index = 0;
            while index < free.len() {
                let (buffer, fence) = &free[index];
                // The size first: a query costs about a microsecond, and after a burst of small
                // launches (80 layers at once, say) the list holds many buffers too small for
                // a large one.
                if buffer.len() < len {
                    index += 1;
                    continue;
                }
                // A fence that reports an error leaves the buffer's state unknown: drop it.
                match fence.query() {
                    Ok(true) => return Ok(free.swap_remove(index).0),
                    Ok(false) => index += 1,
                    Err(_) => drop(free.swap_remove(index)),
                }
            }
        }
        PinnedBuffer::new(
            Arc::clone(&self.context),
            len.next_power_of_two().max(MIN_BUFFER),
        )
    }

    /// Returns `buffer` for reuse once `fence` (recorded after the launch reading it) fires.
    pub(crate) fn give_back(&self, buffer: PinnedBuffer, fence: Arc<Event>) {
        self.free.lock().push((buffer, fence));
    }
}
