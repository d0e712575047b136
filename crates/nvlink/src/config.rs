//! How the nvlink transport spreads its copies, and where its fd socket is: the settings a
//! server may tune.

use crate::plan::CopyPath;
use parking_lot::Mutex;
use std::path::Path;

/// How the nvlink transport spreads copies, and where peers of other network namespaces
/// reach its fd socket.
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
    /// A directory engines of other network namespaces also reach this engine's fd socket
    /// through (set it with [`Self::socket_dir`]); `None` (the default) for the
    /// `FERRY_SOCKET_DIR` environment variable ([`crate::SOCKET_DIR_ENV`]), and without that
    /// for the abstract socket only.
    ///
    /// Two pods of one node have their own network namespaces, where abstract Unix sockets
    /// live, so neither reaches the other's fd socket and VMM GPU memory and shared-memory
    /// notifications between them fall back to TCP. Mount one hostPath volume at the same
    /// path in both pods and name it here: the engine then also binds
    /// `<dir>/ferry-<instance>.sock`, publishes its path, and removes the file when it stops.
    /// Peers of other users are served only with a shared secret (the socket file is then
    /// mode 0o666; 0o600 without one). The directory must be an absolute path of at most 63
    /// bytes, exist, and let this process create files in it: otherwise building the engine
    /// fails, with the reason (a [`crate::SocketDirError`]) and what to do.
    ///
    /// A `&'static Path` keeps this config `Copy`; [`Self::socket_dir`] takes any path and
    /// keeps one copy of each distinct directory for the rest of the process.
    pub socket_dir: Option<&'static Path>,
    /// When peers' `cudaMalloc` memory goes through the staging buffers their engines hand
    /// over by file descriptor (one more copy, on the peer's GPU) instead of their CUDA IPC
    /// handles; `None` (the default) for the `FERRY_CUDA_MALLOC_STAGING` environment variable
    /// ([`CUDA_MALLOC_STAGING_ENV`]: `never`, `auto` or `always`), and without it
    /// [`CudaMallocStaging::Auto`]. See [`CudaMallocStaging`].
    pub cuda_malloc_staging: Option<CudaMallocStaging>,
    /// GPU memory asked of a peer for each staging session (see [`Self::cuda_malloc_staging`]):
    /// the peer allocates it on the GPU of its memory for as long as the session lasts (one
    /// session per pair of GPUs, ended after a minute unused), and gives 2 MiB to 1 GiB of
    /// what is asked. A transfer larger than one slot of it goes in several turns.
    pub staging_bytes: u64,
    /// Slots the staging buffer is cut into, the chunks in flight at once; `None` (the
    /// default) for [`STAGING_SLOTS_SAME_GPU`] where the peer's memory is on this process's
    /// GPU and [`STAGING_SLOTS_OTHER_GPU`] otherwise. Two processes' kernels on one GPU take
    /// turns rather than overlap, so there more slots only add turns; between two GPUs the
    /// peer's copy of one chunk overlaps this GPU's copy of the next.
    pub staging_slots: Option<u32>,
}

/// Staging slots where the peer's memory is on this process's GPU
/// ([`NvlinkConfig::staging_slots`]).
pub const STAGING_SLOTS_SAME_GPU: u32 = 1;

/// Staging slots where the peer's memory is on another GPU ([`NvlinkConfig::staging_slots`]).
pub const STAGING_SLOTS_OTHER_GPU: u32 = 4;

/// The environment variable that sets [`NvlinkConfig::cuda_malloc_staging`] where the config
/// leaves it `None`: `never`, `auto` or `always`.
pub const CUDA_MALLOC_STAGING_ENV: &str = "FERRY_CUDA_MALLOC_STAGING";

/// When peers' `cudaMalloc` memory goes through their staging buffers
/// ([`NvlinkConfig::cuda_malloc_staging`]).
///
/// CUDA refuses a legacy IPC handle between two processes whose PIDs, each as its own PID
/// namespace numbers it, are equal: two pods' servers, both PID 1. Staging moves such memory
/// over NVLink anyway, through a VMM buffer its owner hands over by file descriptor
/// (`docs/containers.md`). Measured on one H100 with the default staging, where both copies
/// share the one GPU: a tenth to a quarter of what the direct mapping moves, and 40-72 times
/// what TCP moved for 512 MiB requests between two pods.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CudaMallocStaging {
    /// Never: memory whose IPC handle does not open here moves over TCP.
    Never,
    /// Where the IPC handle does not open here and the peer's fd socket gives a staging
    /// buffer (the default).
    #[default]
    Auto,
    /// Always, even where the IPC handle opens: to measure staging beside the direct mapping
    /// between plain processes.
    Always,
}

impl std::str::FromStr for CudaMallocStaging {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text {
            "never" => Ok(CudaMallocStaging::Never),
            "auto" => Ok(CudaMallocStaging::Auto),
            "always" => Ok(CudaMallocStaging::Always),
            other => Err(format!(
                "unknown cudaMalloc staging {other:?}; use never, auto or always"
            )),
        }
    }
}

impl CudaMallocStaging {
    /// `configured`, else what `env` (the value of [`CUDA_MALLOC_STAGING_ENV`]) says, else
    /// [`CudaMallocStaging::Auto`]; a value that is none of the three is logged and ignored.
    pub(crate) fn resolve(
        configured: Option<CudaMallocStaging>,
        env: Option<std::ffi::OsString>,
    ) -> CudaMallocStaging {
        if let Some(mode) = configured {
            return mode;
        }
        let Some(text) = env else {
            return CudaMallocStaging::default();
        };
        match text.to_string_lossy().parse() {
            Ok(mode) => mode,
            Err(reason) => {
                tracing::warn!(%reason, "ignoring {CUDA_MALLOC_STAGING_ENV}");
                CudaMallocStaging::default()
            }
        }
    }
}

impl NvlinkConfig {
    /// The staging slots of a session with a peer whose memory is on this process's GPU
    /// (`same_gpu`) or not: [`Self::staging_slots`] (which [`crate::staging::slots_of`] bounds).
    pub(crate) fn staging_slots_for(&self, same_gpu: bool) -> u64 {
        let auto = match same_gpu {
            true => STAGING_SLOTS_SAME_GPU,
            false => STAGING_SLOTS_OTHER_GPU,
        };
        u64::from(self.staging_slots.unwrap_or(auto))
    }

    /// This config with socket directory `dir` (see [`Self::socket_dir`](field@Self::socket_dir)).
    /// Each distinct directory is kept once for the life of the process, however many
    /// configs name it.
    #[must_use]
    pub fn socket_dir(self, dir: impl AsRef<Path>) -> NvlinkConfig {
        NvlinkConfig {
            socket_dir: Some(interned(dir.as_ref())),
            ..self
        }
    }
}

/// `dir`, kept for the rest of the process: the copy kept for an equal path before, or a
/// new one.
fn interned(dir: &Path) -> &'static Path {
    static KEPT: Mutex<Vec<&'static Path>> = Mutex::new(Vec::new());
    let mut kept = KEPT.lock();
    if let Some(known) = kept.iter().find(|known| **known == dir) {
        return known;
    }
    let leaked: &'static Path = Box::leak(dir.to_path_buf().into_boxed_path());
    kept.push(leaked);
    leaked
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
            socket_dir: None,
            cuda_malloc_staging: None,
            staging_bytes: 256 << 20,
            staging_slots: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_socket_directory_is_kept_once_and_the_config_stays_copy() {
        let first = NvlinkConfig::default().socket_dir("/run/ferry-config-test");
        let second =
            NvlinkConfig::default().socket_dir(std::path::PathBuf::from("/run/ferry-config-test"));
        let (a, b) = (first.socket_dir.unwrap(), second.socket_dir.unwrap());
        assert_eq!(a, Path::new("/run/ferry-config-test"));
        assert!(std::ptr::eq(a, b), "the same directory was kept twice");
        let copied = first;
        assert_eq!(copied, first);
        assert_eq!(NvlinkConfig::default().socket_dir, None);
    }

    #[test]
    fn staging_comes_from_the_config_else_the_environment_else_auto() {
        let env = |text: &str| Some(std::ffi::OsString::from(text));
        let resolve = CudaMallocStaging::resolve;
        assert_eq!(resolve(None, None), CudaMallocStaging::Auto);
        assert_eq!(resolve(None, env("never")), CudaMallocStaging::Never);
        assert_eq!(resolve(None, env("auto")), CudaMallocStaging::Auto);
        assert_eq!(resolve(None, env("always")), CudaMallocStaging::Always);
        assert_eq!(resolve(None, env("sometimes")), CudaMallocStaging::Auto);
        assert_eq!(
            resolve(Some(CudaMallocStaging::Never), env("always")),
            CudaMallocStaging::Never
        );
        assert!("Auto"
            .parse::<CudaMallocStaging>()
            .unwrap_err()
            .contains("never, auto or always"));
    }
}
