//! Decides by trying whether a peer's GPU memory can be mapped here.
//!
//! Whether a CUDA IPC handle opens or the peer's fd socket answers depends on how the two
//! processes are confined (PID, IPC, network and mount namespaces, users, visible GPUs), and
//! nothing in a descriptor says so reliably. So when the engine learns a peer's descriptor
//! ([`ferry_core::Transport::import`]), the transport maps one of its buffers of each export
//! kind into each local GPU, keeps the answer for that peer, kind and GPU, and unmaps it again.
//! A refusal makes the transport decline the pair, so the engine moves those bytes over TCP,
//! and is logged once with its cause.

use crate::config::CudaMallocStaging;
use crate::export::GpuExport;
use crate::fd_passing::FdSocket;
use crate::import::{OpenError, Owner, PeerMapping};
use crate::staging::{SessionEnded, StageEntry, StageOp, StagingSession};
use ferry_core::auth::Secret;
use ferry_core::cuda::Context;
use ferry_core::{InstanceId, SegmentDescriptor};
use futures::future::BoxFuture;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;

/// Why a trial mapping failed, and whether trying again later may go otherwise (the peer's
/// socket did not answer in time): such a failure is not kept as the verdict.
#[derive(Debug)]
pub(crate) struct Failed {
    pub(crate) reason: String,
    pub(crate) passing: bool,
}

impl Failed {
    /// A failure that trying again will not change.
    pub(crate) fn lasting(reason: impl Into<String>) -> Failed {
        Failed {
            reason: reason.into(),
            passing: false,
        }
    }
}

/// How a peer's kind of memory reaches a local GPU, as trying found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Mapped {
    /// It maps here: copies go straight into it.
    Directly,
    /// Its mapping failed for `refused`, but the peer's staging session opened: its bytes
    /// go through staging ([`crate::staging`]).
    ThroughStaging {
        /// Why the direct mapping failed.
        refused: String,
    },
}

/// Maps an export of the buffer at `u64` of the engine behind fd socket `FdSocket` (which
/// confirms its IPC handles) into GPU `ordinal` of this process and releases it again,
/// proving the secret to the peer's fd socket where one is asked (for `cudaMalloc` memory
/// that does not map, opens and closes a staging session instead); `Err` holds why neither
/// worked.
pub(crate) type Mapper = Arc<
    dyn Fn(
            u32,
            GpuExport,
            FdSocket,
            u64,
            Option<Secret>,
        ) -> BoxFuture<'static, Result<Mapped, Failed>>
        + Send
        + Sync,
>;

/// The kinds of export a peer's mapping can fail for independently.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum ExportKind {
    /// Legacy CUDA IPC handles: need the driver to reach the exporting process.
    CudaIpc,
    /// VMM allocations handed out as file descriptors over the peer's fd socket: need a
    /// shared network namespace (abstract sockets live in it) or a socket directory both
    /// mount, and the same user or a shared secret.
    VmmFd,
    /// FABRIC handles (mnnvl's).
    Fabric,
}

impl ExportKind {
    pub(crate) fn of(export: &GpuExport) -> ExportKind {
        match export {
            GpuExport::CudaIpc { .. } => ExportKind::CudaIpc,
            GpuExport::VmmFd { .. } => ExportKind::VmmFd,
            GpuExport::Fabric { .. } => ExportKind::Fabric,
        }
    }

    fn describe(self) -> &'static str {
        match self {
            ExportKind::CudaIpc => "CUDA IPC (cudaMalloc) memory",
            ExportKind::VmmFd => "VMM memory shared by file descriptor",
            ExportKind::Fabric => "VMM memory shared by FABRIC handle",
        }
    }
}

/// What trying found, by peer engine, export kind and local GPU; `Err` holds the reason.
type Verdicts = HashMap<(InstanceId, ExportKind, u32), Result<Mapped, Unmappable>>;

/// Why a peer's kind of GPU memory does not map here: the reason the router gives for taking
/// TCP staging instead.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("mapping the peer's {} here failed ({reason}); its transfers use TCP staging", kind.describe())]
pub(crate) struct Unmappable {
    /// The kind of memory tried.
    kind: ExportKind,
    /// What the mapping reported.
    reason: String,
}

/// Verdicts per peer engine, export kind and local GPU.
pub(crate) struct Trials {
    map: Mapper,
    verdicts: Mutex<Verdicts>,
}

impl Trials {
    /// Trials that really map, and open a staging session of `staging_bytes` for
    /// `cudaMalloc` memory as `staging` says ([`crate::NvlinkConfig::cuda_malloc_staging`]).
    pub(crate) fn real(staging: CudaMallocStaging, staging_bytes: u64) -> Trials {
        let staging = Staging {
            mode: staging,
            bytes: staging_bytes,
        };
        Trials::new(Arc::new(move |ordinal, export, owner, region, secret| {
            Box::pin(map_and_release(
                ordinal, export, owner, region, secret, staging,
            ))
        }))
    }
}

impl std::fmt::Debug for Trials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Trials").finish_non_exhaustive()
    }
}

impl Trials {
    /// Trials that map with `map`.
    pub(crate) fn new(map: Mapper) -> Trials {
        Trials {
            map,
            verdicts: Mutex::default(),
        }
    }

    /// What trying found for `peer`'s memory of `kind` on GPU `ordinal`; `None` when it was
    /// not tried. `Err` is the reason, phrased for a log.
    pub(crate) fn verdict(
        &self,
        ordinal: u32,
        peer: InstanceId,
        kind: ExportKind,
    ) -> Option<Result<Mapped, Unmappable>> {
        self.verdicts.lock().get(&(peer, kind, ordinal)).cloned()
    }

    /// Whether `peer`'s `cudaMalloc` memory reaches GPU `ordinal` only through staging.
    pub(crate) fn stages(&self, ordinal: u32, peer: InstanceId) -> bool {
        matches!(
            self.verdicts
                .lock()
                .get(&(peer, ExportKind::CudaIpc, ordinal)),
            Some(Ok(Mapped::ThroughStaging { .. }))
        )
    }

    /// Tries one of `exports` (the peer's, as this transport reads them, each with its
    /// buffer's address) of each kind into
    /// each GPU of `ordinals` that was not tried yet for `peer`, and keeps the verdicts; the
    /// peer's fd socket `socket` confirms its IPC handles.
    /// Exports naming another engine's fd socket are left untried: that is the peer's lie,
    /// not a layout's limit, and a transfer routed to one fails with the violation.
    pub(crate) async fn try_peer(
        &self,
        peer: &SegmentDescriptor,
        exports: impl IntoIterator<Item = (GpuExport, u64)>,
        ordinals: &[u32],
        socket: &FdSocket,
        secret: Option<&Secret>,
    ) {
        let mut samples: HashMap<ExportKind, (GpuExport, u64)> = HashMap::new();
        for (export, region) in exports {
            if crate::bounds::export_owner(&export, peer.instance).is_ok() {
                samples
                    .entry(ExportKind::of(&export))
                    .or_insert((export, region));
            }
        }
        for (kind, (export, region)) in samples {
            for &ordinal in ordinals {
                if self.verdict(ordinal, peer.instance, kind).is_some() {
                    continue;
                }
                // Tried outside the lock: a mapping may take a while, and other peers need
                // not wait.
                let verdict = (self.map)(
                    ordinal,
                    export.clone(),
                    socket.clone(),
                    region,
                    secret.cloned(),
                )
                .await;
                let verdict = match verdict {
                    Err(Failed {
                        reason,
                        passing: true,
                    }) => {
                        tracing::info!(peer = %peer.name, gpu = ordinal, %reason, "mapping the peer's {} failed for now; it is tried again at the next lookup", kind.describe());
                        continue;
                    }
                    verdict => verdict.map_err(|failed| Unmappable {
                        kind,
                        reason: with_pid_hint(failed.reason, kind, peer.pid),
                    }),
                };
                let mut verdicts = self.verdicts.lock();
                verdicts.entry((peer.instance, kind, ordinal)).or_insert_with(|| {
                    match &verdict {
                        Ok(Mapped::Directly) => tracing::debug!(peer = %peer.name, kind = kind.describe(), gpu = ordinal, "peer memory maps over nvlink"),
                        Ok(Mapped::ThroughStaging { refused }) => tracing::warn!(peer = %peer.name, instance = %peer.instance, pid = peer.pid, gpu = ordinal, "mapping the peer's {} here failed ({}); its transfers go over nvlink through staging buffers the peer hands over by file descriptor, with one more copy on the peer's GPU", kind.describe(), with_pid_hint(refused.clone(), kind, peer.pid)),
                        Err(reason) => tracing::warn!(peer = %peer.name, instance = %peer.instance, pid = peer.pid, gpu = ordinal, "{reason}"),
                    }
                    verdict
                });
            }
        }
    }
}

/// What lets `cudaMalloc` memory map directly between two processes on one host whose PIDs,
/// each as its own PID namespace numbers it, are equal (CUDA refuses IPC handles between them,
/// and the memory otherwise takes TCP, or the owner's staging buffers where
/// [`crate::NvlinkConfig::cuda_malloc_staging`] allows), as the mapping's warning and
/// `ferry probe --peer` name it.
pub const PID_CLASH_REMEDIES: &str = "share one PID namespace (hostPID, or \
    shareProcessNamespace in one pod), run one of the two servers under an init that stays PID 1 \
    (tini, or a shell that does not exec it) so that their PIDs differ, or use VMM memory \
    (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) with a socket directory both mount";

/// `reason` with the likely cause added when a CUDA IPC handle of a peer whose PID, as its own
/// PID namespace numbers it, equals this process's was refused: the driver then takes the
/// handle for one this process exported itself and refuses it (measured on H100 with driver
/// 580: equal PIDs in two PID namespaces fail with `CUDA_ERROR_INVALID_CONTEXT`, different
/// ones map). Not documented driver behaviour, so ferry only names it and never relies on it.
fn with_pid_hint(reason: String, kind: ExportKind, peer_pid: u32) -> String {
    if kind != ExportKind::CudaIpc
        || peer_pid != std::process::id()
        || !reason.contains("CUDA_ERROR_INVALID_CONTEXT")
    {
        return reason;
    }
    format!(
        "{reason}; likely because the peer's process has this process's PID ({peer_pid}) in another \
         PID namespace, and CUDA refuses an IPC handle whose exporter's PID equals the importer's: {PID_CLASH_REMEDIES}"
    )
}

/// How a trial stages `cudaMalloc` memory that does not map.
#[derive(Clone, Copy)]
struct Staging {
    mode: CudaMallocStaging,
    /// The staging a transfer asks for: the trial asks for as much, so that an owner that
    /// cannot give it is found out here rather than by a transfer.
    bytes: u64,
}

/// The real trial: maps the export of the buffer at `region` of the engine behind `socket`
/// into GPU `ordinal`'s context and unmaps it at once; where `cudaMalloc` memory does not
/// map for good (with staging auto), or always with staging always, opens a staging session
/// for it, gathers one byte through it and closes it again.
async fn map_and_release(
    ordinal: u32,
    export: GpuExport,
    socket: FdSocket,
    region: u64,
    secret: Option<Secret>,
    staging: Staging,
) -> Result<Mapped, Failed> {
    let context = Context::get(ordinal).map_err(|error| Failed::lasting(error.to_string()))?;
    let ipc = matches!(export, GpuExport::CudaIpc { .. });
    let refused = match stages_without_mapping(ipc, staging.mode) {
        true => "cudaMalloc staging is set to always".to_owned(),
        false => {
            let silent = Mutex::new(None);
            let owner = Owner {
                socket: &socket,
                region,
                silent: &silent,
            };
            match PeerMapping::open(context, &export, owner, secret.as_ref()).await {
                Ok(_) => return Ok(Mapped::Directly),
                // A malformed export is the peer's fault, not the layout's: the transfer
                // routed here meets the same violation, fails with it and closes the peer,
                // instead of quietly taking TCP.
                Err(OpenError::Peer(_)) => return Ok(Mapped::Directly),
                Err(OpenError::Local(reason))
                    if !stages_after_failed_mapping(ipc, reason.is_passing(), staging.mode) =>
                {
                    return Err(Failed {
                        passing: reason.is_passing(),
                        reason: reason.to_string(),
                    })
                }
                Err(OpenError::Local(reason)) => reason.to_string(),
            }
        }
    };
    let failed = |passing: bool, error: &dyn std::fmt::Display| Failed {
        passing,
        reason: format!("{refused}; staging through the peer's fd socket failed too: {error}"),
    };
    let mut session =
        StagingSession::open(&socket, region, staging.bytes, ordinal, secret.as_ref())
            .await
            .map_err(|error| failed(error.is_passing(), &error))?;
    // One byte gathered on the owner's GPU proves its side of a staged copy (the request, its
    // checks, its kernel) before any transfer relies on it; reading leaves its memory as it is.
    let probe = StageEntry {
        buffer: region,
        addr: region,
        staging: 0,
        len: 1,
    };
    // An owner that did not answer in time, or whose socket broke, may do better at the next
    // lookup; one that refused the gather will not.
    let passing =
        |ended: &SessionEnded| matches!(ended, SessionEnded::TimedOut | SessionEnded::Io { .. });
    session
        .send(StageOp::Gather, &[probe])
        .await
        .map_err(|error| failed(passing(&error), &error))?;
    session
        .answer()
        .await
        .map_err(|error| failed(passing(&error), &error))?;
    Ok(Mapped::ThroughStaging { refused })
}

/// Whether the trial goes straight to staging for an export (`ipc`: `cudaMalloc` memory)
/// without trying to map it: only `cudaMalloc` memory with staging set to always.
fn stages_without_mapping(ipc: bool, staging: CudaMallocStaging) -> bool {
    ipc && staging == CudaMallocStaging::Always
}

/// Whether the trial tries staging after mapping an export failed (`passing`: a failure that
/// trying again may not meet): only for `cudaMalloc` memory, a lasting failure, and staging
/// not set to never.
fn stages_after_failed_mapping(ipc: bool, passing: bool, staging: CudaMallocStaging) -> bool {
    ipc && !passing && staging != CudaMallocStaging::Never
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_core::HostIdentity;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn only_cudamalloc_memory_is_staged_and_only_as_the_setting_allows() {
        use CudaMallocStaging::{Always, Auto, Never};
        // Straight to staging: cudaMalloc memory with always, nothing else.
        assert!(stages_without_mapping(true, Always));
        for (ipc, staging) in [(true, Auto), (true, Never), (false, Always), (false, Auto)] {
            assert!(!stages_without_mapping(ipc, staging), "{ipc} {staging:?}");
        }
        // After a failed mapping: a lasting failure of cudaMalloc memory with staging on.
        assert!(stages_after_failed_mapping(true, false, Auto));
        assert!(stages_after_failed_mapping(true, false, Always));
        for (ipc, passing, staging) in [
            (true, false, Never),
            (true, true, Auto),
            (false, false, Auto),
            (false, false, Always),
        ] {
            assert!(
                !stages_after_failed_mapping(ipc, passing, staging),
                "{ipc} {passing} {staging:?}"
            );
        }
    }

    fn peer(instance: u128) -> SegmentDescriptor {
        SegmentDescriptor {
            version: ferry_core::DESCRIPTOR_VERSION,
            name: "decode:1".into(),
            host: HostIdentity::current(),
            generation: 1,
            instance: InstanceId::from_u128(instance),
            process: InstanceId::from_u128(instance),
            pid: 1,
            endpoints: Vec::new(),
            gpus: Vec::new(),
            buffers: Vec::new(),
            signature: None,
        }
    }

    fn ipc() -> GpuExport {
        GpuExport::CudaIpc {
            handle: "00".repeat(64),
            offset: 0,
        }
    }

    fn vmm(owner: u128) -> GpuExport {
        GpuExport::VmmFd {
            socket: crate::fd_socket_name(InstanceId::from_u128(owner)),
            socket_path: None,
            region: 0x1000,
            offset: 0,
            pieces: vec![2 << 20],
        }
    }

    fn socket(instance: u128) -> FdSocket {
        FdSocket::of(InstanceId::from_u128(instance))
    }

    /// IPC handles open, fd sockets are out of reach (as in separate network namespaces);
    /// counts the tries.
    fn ipc_only(tried: Arc<AtomicUsize>) -> Mapper {
        Arc::new(move |_, export, _, _, _| {
            tried.fetch_add(1, Ordering::SeqCst);
            Box::pin(async move {
                match export {
                    GpuExport::CudaIpc { .. } => Ok(Mapped::Directly),
                    _ => Err(Failed::lasting(
                        "connecting to the peer's fd socket \"ferry-x\": Connection refused",
                    )),
                }
            })
        })
    }

    #[tokio::test]
    async fn each_peer_kind_and_gpu_is_tried_once_and_a_refusal_names_its_cause() {
        let tried = Arc::new(AtomicUsize::new(0));
        let trials = Trials::new(ipc_only(Arc::clone(&tried)));
        for _ in 0..3 {
            trials
                .try_peer(
                    &peer(1),
                    [(ipc(), 1), (vmm(1), 2), (ipc(), 3)],
                    &[0],
                    &socket(1),
                    None,
                )
                .await;
            assert_eq!(
                trials.verdict(0, InstanceId::from_u128(1), ExportKind::CudaIpc),
                Some(Ok(Mapped::Directly))
            );
            let refusal = trials
                .verdict(0, InstanceId::from_u128(1), ExportKind::VmmFd)
                .unwrap()
                .unwrap_err()
                .to_string();
            assert!(refusal.contains("VMM memory"), "{refusal}");
            assert!(refusal.contains("Connection refused"), "{refusal}");
            assert!(refusal.contains("TCP staging"), "{refusal}");
        }
        assert_eq!(tried.load(Ordering::SeqCst), 2);
        // Another engine (a restart under the same name and PID) is tried afresh.
        trials
            .try_peer(&peer(2), [(ipc(), 1)], &[0], &socket(2), None)
            .await;
        assert_eq!(tried.load(Ordering::SeqCst), 3);
        // Another local GPU is tried on its own.
        trials
            .try_peer(&peer(1), [(ipc(), 1)], &[0, 1], &socket(1), None)
            .await;
        assert_eq!(tried.load(Ordering::SeqCst), 4);
        assert_eq!(
            trials.verdict(1, InstanceId::from_u128(1), ExportKind::CudaIpc),
            Some(Ok(Mapped::Directly))
        );
    }

    /// IPC handles refused, as the driver refuses them between namespaces.
    fn ipc_refused() -> Mapper {
        Arc::new(|_, _, _, _, _| {
            Box::pin(async {
                Err(Failed::lasting(
                    "CUDA call cuIpcOpenMemHandle_v2 failed with CUDA_ERROR_INVALID_CONTEXT (201)",
                ))
            })
        })
    }

    #[tokio::test]
    async fn a_refused_ipc_handle_of_a_peer_with_this_processs_pid_names_the_pid_clash() {
        let trials = Trials::new(ipc_refused());
        let mut same_pid = peer(1);
        same_pid.pid = std::process::id();
        let other_pid = peer(2);
        for peer in [&same_pid, &other_pid] {
            trials
                .try_peer(peer, [(ipc(), 1)], &[0], &socket(1), None)
                .await;
        }
        let refusal = |instance| {
            trials
                .verdict(0, InstanceId::from_u128(instance), ExportKind::CudaIpc)
                .unwrap()
                .unwrap_err()
                .to_string()
        };
        let clash = refusal(1);
        assert!(clash.contains("INVALID_CONTEXT"), "{clash}");
        assert!(clash.contains("this process's PID"), "{clash}");
        assert!(clash.contains("hostPID"), "{clash}");
        assert!(!refusal(2).contains("PID"), "{}", refusal(2));
    }

    #[tokio::test]
    async fn an_export_naming_another_engines_socket_is_not_tried() {
        let trials = Trials::new(Arc::new(|_, _, _, _, _| {
            Box::pin(async { panic!("another engine's socket must not be connected to") })
        }));
        trials
            .try_peer(&peer(2), [(vmm(1), 1)], &[0], &socket(2), None)
            .await;
        assert_eq!(
            trials.verdict(0, InstanceId::from_u128(2), ExportKind::VmmFd),
            None
        );
    }
}
