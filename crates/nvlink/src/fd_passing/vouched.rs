//! The `cudaMalloc` buffers this engine exported: what its fd socket confirms to peers that
//! map their IPC handles, and what staging sessions may copy, with the staged copies of each
//! still on the GPU counted so that deregistering waits for them.

use super::registered::{ByAddress, Held};
use ferry_core::cuda::IpcHandle;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What this engine exported for one registered `cudaMalloc` buffer.
pub(crate) struct Vouch {
    /// The CUDA IPC handle of its allocation, which peers confirm before they map it.
    pub(crate) handle: IpcHandle,
    /// The GPU it lives on.
    pub(crate) ordinal: u32,
    /// The registered bytes from the buffer's address: what a staging session may copy.
    pub(crate) len: u64,
    /// Staged copies into or out of it not finished yet.
    in_flight: Arc<AtomicUsize>,
}

impl Vouch {
    /// The export of `len` bytes of GPU `ordinal` whose allocation has IPC handle `handle`.
    pub(crate) fn new(handle: IpcHandle, ordinal: u32, len: u64) -> Vouch {
        Vouch {
            handle,
            ordinal,
            len,
            in_flight: Arc::default(),
        }
    }

    /// Counts one more staged copy of this buffer until the returned token drops. Taken while
    /// the buffer is found in [`Vouched`] (under its lock), so that a deregistration either
    /// sees the copy or keeps it from finding the buffer.
    pub(crate) fn in_use(&self) -> InUse {
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        InUse(Arc::clone(&self.in_flight))
    }
}

/// The `cudaMalloc` buffers this engine exported, by the address they were registered at.
pub(crate) type Vouched = ByAddress<Vouch>;

/// A staged copy's hold on a buffer: dropped once the copy finished on the GPU.
pub(crate) struct InUse(Arc<AtomicUsize>);

impl Drop for InUse {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Keeps a buffer vouched for until dropped. Dropping it first takes the buffer out of
/// [`Vouched`] (no staged copy finds it after), then waits for the staged copies already
/// queued on it, at most [`IN_FLIGHT_WAIT`], so its memory may be freed right after.
pub(crate) struct VouchGuard {
    held: Option<Held<Vouch>>,
    in_flight: Arc<AtomicUsize>,
}

/// The longest a deregistration waits for staged copies of its buffer: one slot's copy takes
/// well under a millisecond, so only a GPU that stopped making progress reaches it.
const IN_FLIGHT_WAIT: Duration = Duration::from_secs(2);

impl VouchGuard {
    /// Inserts `vouch` into `vouched` at `addr`.
    pub(crate) fn insert(vouched: &Arc<Vouched>, addr: u64, vouch: Vouch) -> VouchGuard {
        let in_flight = Arc::clone(&vouch.in_flight);
        VouchGuard {
            held: Some(vouched.insert(addr, vouch)),
            in_flight,
        }
    }
}

impl Drop for VouchGuard {
    fn drop(&mut self) {
        drop(self.held.take());
        let started = Instant::now();
        while self.in_flight.load(Ordering::Acquire) > 0 {
            if started.elapsed() > IN_FLIGHT_WAIT {
                tracing::warn!(
                    "a deregistered cudaMalloc buffer still has staged copies on the GPU after {IN_FLIGHT_WAIT:?}; freeing its memory now may let them touch it"
                );
                return;
            }
            std::thread::sleep(Duration::from_micros(50));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dropping_the_guard_hides_the_buffer_then_waits_for_its_staged_copies() {
        let vouched = Arc::new(Vouched::default());
        let guard = VouchGuard::insert(&vouched, 0x1000, Vouch::new(IpcHandle([1; 64]), 0, 4096));
        let in_use = vouched
            .with(0x1000, |vouch| vouch.map(Vouch::in_use))
            .unwrap();
        let (found, dropped) = std::sync::mpsc::channel();
        let watcher = {
            let vouched = Arc::clone(&vouched);
            std::thread::spawn(move || {
                // The buffer is gone from the map before the guard's drop returns.
                while vouched.with(0x1000, |vouch| vouch.is_some()) {
                    std::thread::yield_now();
                }
                found.send(Instant::now()).unwrap();
                std::thread::sleep(Duration::from_millis(50));
                drop(in_use);
            })
        };
        drop(guard);
        let returned = Instant::now();
        let hidden = dropped.recv().unwrap();
        watcher.join().unwrap();
        assert!(returned.duration_since(hidden) >= Duration::from_millis(50));
    }
}
