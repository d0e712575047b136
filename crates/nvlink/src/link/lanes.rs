//! What one local GPU copies with: its streams, kernels and argument buffers, and the
//! peer GPUs its kernels may touch.

use super::*;

/// What one local GPU copies with.
pub(super) struct GpuLane {
    /// The copy streams (`streams_per_gpu`), then one more for block copies that wait for a
    /// caller's event ([`ferry_core::Batch::after`]), so that waiting holds back no other copy.
    pub(super) streams: Vec<Stream>,
    /// `None` when the kernels could not be loaded; every copy then uses the copy engines.
    pub(super) kernels: Option<KernelShare>,
    pub(super) args: ArgumentPool,
    /// Peer GPUs (ordinals) whose memory this GPU's kernels may touch, by whether enabling
    /// peer access to them worked.
    pub(super) peers: Mutex<HashMap<u32, bool>>,
}

impl GpuLane {
    /// Streams the copies of a transfer are dealt over.
    pub(super) fn copy_streams(&self) -> usize {
        self.streams.len() - 1
    }

    /// The stream of block copies that wait for a caller's event.
    pub(super) fn waiting_stream(&self) -> usize {
        self.streams.len() - 1
    }

    /// How this GPU's kernel cuts long copies: pieces of at most the configured chunk, fewer
    /// bytes where that would leave part of its grid idle.
    pub(super) fn pieces(&self, config: &NvlinkConfig) -> plan::Pieces {
        plan::Pieces {
            most: config.kernel_chunk_bytes,
            full_grid: self
                .kernels
                .as_ref()
                .map_or(1, |kernels| kernels.items_for_full_grid(config)),
        }
    }
}

impl NvlinkLink {
    pub(super) fn lane(&self, ordinal: u32) -> Result<Arc<GpuLane>> {
        let cached = self.lanes.lock().get(&ordinal).cloned();
        if let Some(lane) = cached {
            return Ok(lane);
        }
        let context = Context::get(ordinal)?;
        let streams = (0..self.config.streams_per_gpu.max(1) + 1)
            .map(|_| Stream::new(Arc::clone(&context)))
            .collect::<Result<Vec<_>, _>>()?;
        let kernels = match CopyKernels::of(&context) {
            Ok(kernels) => Some(kernels.share()),
            Err(error) => {
                tracing::warn!(gpu = ordinal, %error, "the copy kernels did not load; every nvlink copy on this GPU uses the copy engines");
                None
            }
        };
        let lane = Arc::new(GpuLane {
            streams,
            kernels,
            args: ArgumentPool::new(context),
            peers: Mutex::default(),
        });
        self.lanes.lock().insert(ordinal, Arc::clone(&lane));
        Ok(lane)
    }
}
