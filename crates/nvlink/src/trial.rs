//! Decides by trying whether a peer's GPU memory can be mapped here.
//!
//! Whether a CUDA IPC handle opens or the peer's fd socket answers depends on how the two
//! processes are confined (PID, IPC, network and mount namespaces, users, visible GPUs), and
//! nothing in a descriptor says so reliably. So the first time a peer's buffer of one export
//! kind is routed, the transport maps one such buffer, keeps the answer for that peer and kind,
//! and unmaps it again. A refusal makes the transport decline the pair, so the engine moves
//! those bytes over TCP, and is logged once with its cause.

use crate::import::{OpenError, PeerMapping};
use ferry_core::cuda::Context;
use ferry_core::{Export, InstanceId, SegmentDescriptor};
use std::collections::HashMap;
use std::sync::Mutex;

/// Maps `export` into GPU `ordinal` of this process and releases it again; `Err` holds why
/// it could not be mapped.
pub(crate) type Mapper = fn(ordinal: u32, export: &Export) -> Result<(), String>;

/// The kinds of export a peer's mapping can fail for independently.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum ExportKind {
    /// Legacy CUDA IPC handles: need the driver to reach the exporting process.
    CudaIpc,
    /// VMM allocations handed out as file descriptors over the peer's abstract Unix socket:
    /// need a shared network namespace (abstract sockets live in it) and the same user.
    VmmFd,
    /// Anything else is tried under its own kind.
    Other,
}

impl ExportKind {
    fn of(export: &Export) -> ExportKind {
        match export {
            Export::CudaIpc { .. } => ExportKind::CudaIpc,
            Export::VmmFd { .. } => ExportKind::VmmFd,
            _ => ExportKind::Other,
        }
    }

    fn describe(self) -> &'static str {
        match self {
            ExportKind::CudaIpc => "CUDA IPC (cudaMalloc) memory",
            ExportKind::VmmFd => "VMM memory shared by file descriptor",
            ExportKind::Other => "exported GPU memory",
        }
    }
}

/// What trying found, by peer engine, export kind and local GPU; `Err` holds the reason.
type Verdicts = HashMap<(InstanceId, ExportKind, u32), Result<(), String>>;

/// Verdicts per peer engine, export kind and local GPU.
pub(crate) struct Trials {
    map: Mapper,
    verdicts: Mutex<Verdicts>,
}

impl Default for Trials {
    fn default() -> Self {
        Trials::new(map_and_release)
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

    /// Whether `peer`'s memory of `export`'s kind maps into GPU `ordinal`: tried with this
    /// very export the first time, remembered after. `Err` is the reason, phrased for a log.
    pub(crate) fn verdict(
        &self,
        ordinal: u32,
        peer: &SegmentDescriptor,
        export: &Export,
    ) -> Result<(), String> {
        let key = (peer.instance, ExportKind::of(export), ordinal);
        if let Some(known) = self.lock().get(&key) {
            return known.clone();
        }
        // An export naming another engine's fd socket is the peer's lie, not a layout's
        // limit: routed here, its transfer fails with the violation and closes the peer.
        if crate::bounds::export_owner(export, peer.instance).is_err() {
            return Ok(());
        }
        // Tried outside the lock: a mapping may take a while, and other peers need not wait.
        let verdict = (self.map)(ordinal, export).map_err(|cause| {
            format!(
                "mapping the peer's {} here failed ({cause}); its transfers use TCP staging",
                key.1.describe()
            )
        });
        let mut verdicts = self.lock();
        let kept = verdicts.entry(key).or_insert_with(|| {
            match &verdict {
                Ok(()) => tracing::debug!(peer = %peer.name, kind = key.1.describe(), "peer memory maps over nvlink"),
                Err(reason) => tracing::warn!(peer = %peer.name, instance = %peer.instance, pid = peer.pid, "{reason}"),
            }
            verdict
        });
        kept.clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Verdicts> {
        // Each update is one insert, so a poisoned map is still consistent.
        self.verdicts
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
    }
}

/// The real trial: maps the export into GPU `ordinal`'s context and unmaps it at once.
fn map_and_release(ordinal: u32, export: &Export) -> Result<(), String> {
    let context = Context::get(ordinal).map_err(|error| error.to_string())?;
    match PeerMapping::open(context, export) {
        Ok(_) => Ok(()),
        // A malformed export is the peer's fault, not the layout's: the transfer routed here
        // meets the same violation, fails with it and closes the peer, instead of quietly
        // taking TCP.
        Err(OpenError::Peer(_)) => Ok(()),
        Err(OpenError::Local(reason)) => Err(reason),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_core::HostIdentity;
    use std::sync::atomic::{AtomicUsize, Ordering};

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
        }
    }

    fn ipc() -> Export {
        Export::CudaIpc {
            handle: "00".repeat(64),
            offset: 0,
        }
    }

    fn vmm() -> Export {
        Export::VmmFd {
            socket: ferry_core::fd_socket_name(InstanceId::from_u128(1)),
            region: 0x1000,
            offset: 0,
            pieces: vec![2 << 20],
        }
    }

    static TRIED: AtomicUsize = AtomicUsize::new(0);

    /// IPC handles open, fd sockets are out of reach (as in separate network namespaces).
    fn ipc_only(_: u32, export: &Export) -> Result<(), String> {
        TRIED.fetch_add(1, Ordering::SeqCst);
        match export {
            Export::CudaIpc { .. } => Ok(()),
            _ => Err("connecting to the peer's fd socket \"ferry-x\": Connection refused".into()),
        }
    }

    #[test]
    fn each_peer_and_kind_is_tried_once_and_a_refusal_names_its_cause() {
        let trials = Trials::new(ipc_only);
        let before = TRIED.load(Ordering::SeqCst);
        for _ in 0..3 {
            assert_eq!(trials.verdict(0, &peer(1), &ipc()), Ok(()));
            let refusal = trials.verdict(0, &peer(1), &vmm()).unwrap_err();
            assert!(refusal.contains("VMM memory"), "{refusal}");
            assert!(refusal.contains("Connection refused"), "{refusal}");
            assert!(refusal.contains("TCP staging"), "{refusal}");
        }
        assert_eq!(TRIED.load(Ordering::SeqCst) - before, 2);
        // Another engine (a restart under the same name and PID) is tried afresh.
        assert_eq!(trials.verdict(0, &peer(2), &ipc()), Ok(()));
        assert_eq!(TRIED.load(Ordering::SeqCst) - before, 3);
        // Another local GPU is tried on its own.
        assert_eq!(trials.verdict(1, &peer(1), &ipc()), Ok(()));
        assert_eq!(TRIED.load(Ordering::SeqCst) - before, 4);
    }

    #[test]
    fn an_export_naming_another_engines_socket_is_not_tried_but_left_to_fail_as_a_violation() {
        let trials = Trials::new(|_, _| panic!("another engine's socket must not be connected to"));
        assert_eq!(trials.verdict(0, &peer(2), &vmm()), Ok(()));
    }
}
