//! Pinned host buffers that carry kernel arguments too large for a launch (copy lists, block
//! ids). The kernels read them in place over the bus, so no upload is queued before a launch.

use crate::kernels::THREADS_PER_BLOCK;
use ferry_core::cuda::{Context, CudaError, Event, Kernel, KernelArg, PinnedBuffer, Stream};
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

    /// Launches `kernel` on `stream` with its large arguments in a buffer of this pool of
    /// `arg_bytes` bytes, which `fill` writes (given the buffer's address) before returning
    /// the launch's arguments. Returns the event recorded right after the launch; the buffer
    /// goes back to the pool only with it, so nothing overwrites it while the launch reads it.
    ///
    /// # Safety
    /// The arguments `fill` returns must match `kernel`'s parameters, and every range they
    /// name must stay valid for the kernel on `stream`'s GPU until the returned event fires.
    pub(crate) unsafe fn launch(
        &self,
        stream: &Stream,
        kernel: &Kernel,
        grid: u32,
        arg_bytes: usize,
        fill: impl FnOnce(&mut [u8], u64) -> Vec<KernelArg>,
    ) -> ferry_core::Result<Arc<Event>> {
        let mut args = self.take(arg_bytes)?;
        let base = args.addr();
        let launch_args = fill(args.as_mut_slice(), base);
        // SAFETY: the caller vouches for the arguments and the ranges they name (this
        // function's contract); the argument buffer itself lives until the fence below.
        let launched = unsafe { kernel.launch(stream, grid, THREADS_PER_BLOCK, &launch_args) };
        let fence = match Event::record(stream) {
            Ok(fence) => Arc::new(fence),
            Err(error) => {
                // The launch may still read the arguments: leak them rather than free them
                // under the GPU.
                std::mem::forget(args);
                return Err(error.into());
            }
        };
        self.give_back(args, Arc::clone(&fence));
        launched.map(|()| fence)
    }
}
