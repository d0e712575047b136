//! Shared memory between two processes: a sealed memfd mapped into both, seen only as atomic
//! words, since the other process writes it at any time. The only `unsafe` of the message
//! path lives here.

use ferry_core::cuda::{Context, CudaError, HostRegistration};
use rustix::fs::{MemfdFlags, SealFlags};
use rustix::mm::{MapFlags, ProtFlags};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicU32, AtomicU64};
use std::sync::{Arc, OnceLock};

/// Bytes of the mapping [`SharedMemory::gpu_page`] registers: the smallest page a host has.
const GPU_PAGE_BYTES: usize = 4096;

/// A shared mapping of `len` bytes, unmapped on drop.
pub(crate) struct SharedMemory {
    base: std::ptr::NonNull<u8>,
    len: usize,
    /// The mapping's first page registered with CUDA, once asked for ([`Self::gpu_page`]),
    /// or why it could not be.
    gpu_page: OnceLock<Result<HostRegistration, CudaError>>,
}

// SAFETY: the mapping is only ever reached through atomics, which any thread may use.
unsafe impl Send for SharedMemory {}
// SAFETY: as for Send.
unsafe impl Sync for SharedMemory {}

/// Seals a memory file must carry before it is mapped: the sender can then neither shrink it
/// under the mapping (a read past its end would kill this process with SIGBUS) nor unseal it.
const REQUIRED_SEALS: SealFlags = SealFlags::SHRINK
    .union(SealFlags::GROW)
    .union(SealFlags::SEAL);

impl SharedMemory {
    /// A fresh, zeroed, sealed memory file of `len` bytes (a multiple of 8) and its mapping
    /// here; the file is what the other process maps with [`Self::map`].
    pub(crate) fn create(name: &str, len: usize) -> std::io::Result<(SharedMemory, OwnedFd)> {
        let fd = rustix::fs::memfd_create(name, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)?;
        rustix::fs::ftruncate(&fd, len as u64)?;
        rustix::fs::fcntl_add_seals(&fd, REQUIRED_SEALS)?;
        let memory = SharedMemory::map_fd(&fd, len)?;
        Ok((memory, fd))
    }

    /// Maps the memory file `fd` another process created, which must be sealed against
    /// resizing and be exactly `len` bytes long.
    pub(crate) fn map(fd: &OwnedFd, len: usize) -> Result<SharedMemory, RingRefused> {
        let seals = rustix::fs::fcntl_get_seals(fd).map_err(RingRefused::NotSealable)?;
        if !seals.contains(REQUIRED_SEALS) {
            return Err(RingRefused::Unsealed {
                seals: format!("{seals:?}"),
            });
        }
        let size = rustix::fs::fstat(fd)
            .map_err(|error| RingRefused::Io {
                action: "reading the message ring's size",
                source: error.into(),
            })?
            .st_size;
        if u64::try_from(size).ok() != Some(len as u64) {
            return Err(RingRefused::WrongSize { size, len });
        }
        SharedMemory::map_fd(fd, len).map_err(|source| RingRefused::Io {
            action: "mapping the message ring",
            source,
        })
    }

    fn map_fd(fd: &OwnedFd, len: usize) -> std::io::Result<SharedMemory> {
        // SAFETY: a fresh shared mapping chosen by the kernel (null hint) aliases no Rust
        // object; the file is sealed at `len` bytes, so every byte of it stays backed.
        let base = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
                fd.as_fd(),
                0,
            )
        }?;
        let base = std::ptr::NonNull::new(base.cast::<u8>())
            .ok_or_else(|| std::io::Error::other("mmap returned a null mapping"))?;
        Ok(SharedMemory {
            base,
            len,
            gpu_page: OnceLock::new(),
        })
    }

    /// The mapping's first page registered with CUDA, so that GPUs can store into it
    /// (registered through `context` at the first call; later calls return that outcome).
    pub(crate) fn gpu_page(&self, context: &Arc<Context>) -> Result<&HostRegistration, &CudaError> {
        self.gpu_page
            .get_or_init(|| {
                let len = self.len.min(GPU_PAGE_BYTES);
                // SAFETY: the first `len` bytes are mapped until `self` drops, and `drop`
                // unregisters them before it unmaps.
                unsafe { HostRegistration::new(Arc::clone(context), self.base.as_ptr(), len) }
            })
            .as_ref()
    }

    /// The mapping as 64-bit words.
    pub(crate) fn words(&self) -> &[AtomicU64] {
        // SAFETY: the mapping is page aligned, `len / 8` words long and lives as long as
        // `self`; AtomicU64 has the layout of u64, and atomics are the only access, so the
        // other process writing at any time is no data race.
        unsafe { std::slice::from_raw_parts(self.base.as_ptr().cast::<AtomicU64>(), self.len / 8) }
    }

    /// The 32-bit word at byte `offset` (a multiple of 8 that [`Self::words`]' users leave
    /// alone), for a futex.
    pub(crate) fn word32(&self, offset: usize) -> &AtomicU32 {
        let word = &self.words()[offset / 8];
        // SAFETY: the 8-byte aligned word is inside the mapping and lives as long as `self`;
        // callers use its first half only through this AtomicU32.
        unsafe { &*(word as *const AtomicU64).cast::<AtomicU32>() }
    }
}

impl Drop for SharedMemory {
    fn drop(&mut self) {
        drop(self.gpu_page.take());
        // SAFETY: `base` and `len` are the mapping made in `map_fd`, unmapped only here; no
        // reference into it outlives `self`.
        if let Err(error) = unsafe { rustix::mm::munmap(self.base.as_ptr().cast(), self.len) } {
            tracing::warn!(%error, "unmapping a message ring failed");
        }
    }
}

/// Wakes a thread of any process sleeping on `word` (a ring's futex word).
pub(crate) fn futex_wake(word: &AtomicU32) {
    let _ = rustix::thread::futex::wake(word, rustix::thread::futex::Flags::empty(), 1);
}

/// Why a message ring another process handed over is not mapped: the sender hears it as its
/// refusal and sends its notifications over TCP.
#[derive(Debug, thiserror::Error)]
pub(crate) enum RingRefused {
    /// The file is not a memory file that takes seals.
    #[error("the message ring is not a sealable memory file: {0}")]
    NotSealable(rustix::io::Errno),
    /// The file could still change size under the mapping.
    #[error("the message ring's memory file is not sealed against resizing (seals {seals})")]
    Unsealed {
        /// The seals it has.
        seals: String,
    },
    /// The file is not one ring long.
    #[error("the message ring's memory file holds {size} bytes, not {len}")]
    WrongSize {
        /// Its size.
        size: i64,
        /// A ring's size.
        len: usize,
    },
    /// Looking at or mapping the file failed.
    #[error("{action} failed: {source}")]
    Io {
        /// What was being done.
        action: &'static str,
        /// The operating system's error.
        source: std::io::Error,
    },
}
