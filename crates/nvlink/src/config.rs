//! How the nvlink transport spreads its copies: the settings a server may tune.

use crate::plan::CopyPath;

/// How the nvlink transport spreads copies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NvlinkConfig {
    /// Streams per local GPU and peer that copies are dealt over (each peer link has its own,
    /// so one pair's copies never queue behind another's in a stream).
    pub streams_per_gpu: usize,
    /// Which copies go to the copy kernel and which to the copy engines.
    pub copy_path: CopyPath,
    /// Thread blocks of the copy kernel per multiprocessor of the GPU, at most. The kernel's
    /// registers leave room for two (the default); copies whose ends disagree modulo 16 use
    /// a deeper build of it that always gets one.
    pub kernel_blocks_per_sm: u32,
    /// The copy kernel's unit of work: one warp copies at most this many bytes at a time, so
    /// long copies are shared out among warps. A launch with too few bytes to give every warp
    /// of the grid two such pieces cuts shorter ones (down to 4 KiB).
    pub kernel_chunk_bytes: u64,
    /// Multiprocessors the copy kernel may occupy at once, at most; `None` for all of them
    /// (`Some(0)` counts as 1). A launch then has at most this many thread blocks, so it runs
    /// on at most this many multiprocessors, leaving the rest to the model's kernels (prefill
    /// computes while its KV leaves). Copies that go to the copy engines are not limited.
    pub kernel_max_sms: Option<u32>,
    /// Whether notifications to engines of this host go through shared memory (the
    /// default) rather than the control connection's TCP; off only to compare the two or to
    /// rule shared memory out while diagnosing.
    pub shared_memory_notifications: bool,
    /// Batches of at most this many bytes have their notification published into the
    /// shared-memory ring by the GPU right after their copies, so it reaches the peer without
    /// waiting for this host to see the copies end (about 12 us sooner on an H200). Until it
    /// is published the ring carries nothing else to that peer, so a larger batch would hold
    /// the peer's other notifications back for as long as its copies take; its notification
    /// goes once this host has seen them end. 0 turns GPU-published notifications off.
    pub gpu_notification_max_bytes: u64,
}

impl Default for NvlinkConfig {
    fn default() -> Self {
        NvlinkConfig {
            streams_per_gpu: 4,
            copy_path: CopyPath::Auto,
            kernel_blocks_per_sm: 2,
            kernel_chunk_bytes: 64 << 10,
            kernel_max_sms: None,
            shared_memory_notifications: true,
            gpu_notification_max_bytes: 4 << 20,
        }
    }
}
