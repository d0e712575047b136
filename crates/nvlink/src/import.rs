//! Maps a peer's exported GPU buffer into this process: a legacy IPC handle or FABRIC handles
//! directly, VMM memory through file descriptors fetched from the peer's fd socket.

use crate::bounds;
use crate::export::GpuExport;
use crate::fd_passing::{confirm_ipc, fetch_fds, FdSocket, ImportError};
use ferry_core::auth::Secret;
use ferry_core::cuda::{
    AllocationHandle, Context, CudaError, IpcHandle, IpcMapping, VmmMapping, FABRIC_HANDLE_LEN,
};
use ferry_core::ProtocolViolation;
use parking_lot::Mutex;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A peer allocation mapped here; unmapped on drop.
pub(crate) enum PeerMapping {
    Ipc(IpcMapping),
    Vmm(VmmMapping),
}

/// A peer's export mapped here: the mapping, the offset of the buffer's first byte in it (the
/// peer's word, checked before use) and the bytes the driver really mapped.
pub(crate) struct Opened {
    pub(crate) mapping: PeerMapping,
    pub(crate) offset: u64,
    pub(crate) len: u64,
}

/// Why an export could not be mapped: the peer's fault, or this side's.
#[derive(Debug)]
pub(crate) enum OpenError {
    /// The export itself is wrong (a piece list that does not match, for example).
    Peer(ProtocolViolation),
    /// Mapping failed here, or the peer's fd socket could not be used.
    Local(ImportError),
}

impl From<ferry_core::Error> for OpenError {
    fn from(error: ferry_core::Error) -> Self {
        OpenError::Local(ImportError::Mapping(error))
    }
}

impl From<CudaError> for OpenError {
    fn from(error: CudaError) -> Self {
        OpenError::from(ferry_core::Error::Cuda(error))
    }
}

impl PeerMapping {
    /// Maps what `export` (of the buffer `owner` names) names into `context`'s GPU, with the
    /// offset of the buffer's first byte inside the mapping and the mapping's real size. VMM
    /// descriptors are fetched from the owner's fd socket and IPC handles confirmed with it
    /// first, proving `secret` when there is one: a handle the owner disowns is refused, and
    /// without a secret so is one it cannot be asked about.
    ///
    /// # Cancel safety
    /// Cancel safe: dropped half-way, nothing stays mapped.
    pub(crate) async fn open(
        context: Arc<Context>,
        export: &GpuExport,
        owner: Owner<'_>,
        secret: Option<&Secret>,
    ) -> Result<Opened, OpenError> {
        match export {
            GpuExport::CudaIpc { handle, offset } => {
                let handle = IpcHandle::from_hex(handle).ok_or_else(|| {
                    OpenError::Peer(ProtocolViolation::Descriptor {
                        field: "export.handle",
                        problem: "is not a 64-byte IPC handle written as hex".into(),
                    })
                })?;
                owner.confirm(&handle, secret).await?;
                let mapping = IpcMapping::open(context, &handle)?;
                Ok(Opened {
                    len: mapping.len(),
                    mapping: PeerMapping::Ipc(mapping),
                    offset: *offset,
                })
            }
            GpuExport::VmmFd {
                socket,
                socket_path,
                region,
                offset,
                pieces,
            } => {
                let sizes = bounds::vmm_pieces(pieces, pieces.len()).map_err(OpenError::Peer)?;
                let socket = FdSocket::new(socket.clone(), socket_path.clone());
                let fds = fetch_fds(&socket, *region, pieces.len(), secret)
                    .await
                    .map_err(OpenError::Local)?;
                if fds.len() != pieces.len() {
                    return Err(OpenError::Peer(ProtocolViolation::Descriptor {
                        field: "export.pieces",
                        problem: format!(
                            "lists {} allocations, but the peer's fd socket sent {} descriptors",
                            pieces.len(),
                            fds.len()
                        ),
                    }));
                }
                let mut handles = Vec::with_capacity(fds.len());
                for (fd, size) in fds.iter().zip(sizes) {
                    handles.push((AllocationHandle::import_fd(fd)?, size));
                }
                drop(fds);
                map_vmm(context, handles, *offset)
            }
            GpuExport::Fabric {
                handles,
                offset,
                pieces,
            } => {
                let sizes = bounds::vmm_pieces(pieces, handles.len()).map_err(OpenError::Peer)?;
                let mut imported = Vec::with_capacity(handles.len());
                for (handle, size) in handles.iter().zip(sizes) {
                    let bytes = fabric_handle(handle).map_err(OpenError::Peer)?;
                    imported.push((AllocationHandle::import_fabric(&bytes)?, size));
                }
                map_vmm(context, imported, *offset)
            }
        }
    }

    /// Where the mapping starts in this process.
    pub(crate) fn base(&self) -> u64 {
        match self {
            PeerMapping::Ipc(mapping) => mapping.base(),
            PeerMapping::Vmm(mapping) => mapping.base(),
        }
    }
}

/// The engine a descriptor's buffer belongs to, as its fd socket names it, and the buffer's
/// address there; `silent` remembers when the engine's socket last failed to answer, so that
/// a link to an engine that accepts but never answers does not wait out the timeout once per
/// buffer.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Owner<'a> {
    pub(crate) socket: &'a FdSocket,
    pub(crate) region: u64,
    pub(crate) silent: &'a Mutex<Option<Instant>>,
}

/// How long an engine whose fd socket did not answer is not asked again.
const SILENT_FOR: Duration = Duration::from_secs(10);

impl Owner<'_> {
    /// Whether `handle` may be mapped as this owner's: it says so, or it cannot be asked
    /// (another network namespace, an fd socket that did not open or did not answer) and the
    /// descriptor came signed, which every descriptor an engine with a secret accepts is.
    async fn confirm(&self, handle: &IpcHandle, secret: Option<&Secret>) -> Result<(), OpenError> {
        let recently_silent = self
            .silent
            .lock()
            .is_some_and(|since| since.elapsed() < SILENT_FOR);
        let asked = match recently_silent {
            true => Err(ImportError::NoAnswer {
                socket: self.socket.to_string(),
            }),
            false => confirm_ipc(self.socket, self.region, handle, secret).await,
        };
        match asked {
            Ok(()) => Ok(()),
            Err(ImportError::Disowned { .. }) => {
                Err(OpenError::Peer(ProtocolViolation::Descriptor {
                    field: "export.handle",
                    problem: format!(
                        "is not the IPC handle its engine exported for the buffer at {:#x} (its fd socket {} says so): the descriptor carries another engine's memory",
                        self.region, self.socket
                    ),
                }))
            }
            Err(stale @ ImportError::NotRegistered { .. }) => Err(OpenError::Local(stale)),
            Err(reason) => {
                if reason.is_passing() && !recently_silent {
                    *self.silent.lock() = Some(Instant::now());
                }
                match secret {
                    Some(_) => Ok(()),
                    None => Err(OpenError::Local(ImportError::Unconfirmed {
                        reason: Box::new(reason),
                    })),
                }
            }
        }
    }
}

/// Maps imported VMM allocations back to back. The driver refuses to map more bytes than an
/// allocation holds: that is a piece list that lies about its allocations.
fn map_vmm(
    context: Arc<Context>,
    handles: Vec<(AllocationHandle, usize)>,
    offset: u64,
) -> Result<Opened, OpenError> {
    let mapping = VmmMapping::map(context, handles).map_err(|error| {
        // The driver answers an oversized piece with INVALID_VALUE (1) or, as seen on H200
        // with driver 580, NOT_SUPPORTED (801); the piece sizes are all the peer controls here.
        let refused_size = matches!(
            &error,
            ferry_core::Error::Cuda(CudaError {
                call: "cuMemMap",
                code: Some(1 | 801),
                ..
            })
        );
        if refused_size {
            OpenError::Peer(ProtocolViolation::Descriptor {
                field: "export.pieces",
                problem: format!(
                    "gives an allocation a size it does not have (the driver refused to map it: {error})"
                ),
            })
        } else {
            OpenError::from(error)
        }
    })?;
    Ok(Opened {
        len: mapping.len() as u64,
        mapping: PeerMapping::Vmm(mapping),
        offset,
    })
}

/// Parses a FABRIC handle written as hex in a descriptor.
fn fabric_handle(text: &str) -> Result<[u8; FABRIC_HANDLE_LEN], ProtocolViolation> {
    let mut bytes = [0u8; FABRIC_HANDLE_LEN];
    hex::decode_to_slice(text, &mut bytes).map_err(|_| ProtocolViolation::Descriptor {
        field: "export.handles",
        problem: format!("holds a malformed FABRIC handle {text:?}"),
    })?;
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fd_passing::FdServer;
    use ferry_core::{InboxHandle, InstanceId};

    fn secret() -> Secret {
        Secret::new(b"import-tests-0123456789abcdef".to_vec()).unwrap()
    }

    fn server(secret: Option<Secret>) -> FdServer {
        let runtime = tokio::runtime::Handle::current();
        let (inbox, _) = InboxHandle::standalone(4, 1 << 20, runtime.clone());
        FdServer::start(
            InstanceId::random().unwrap(),
            secret,
            &runtime,
            inbox,
            crate::NvlinkConfig::default(),
        )
        .unwrap()
    }

    /// What an export of a 4 KiB buffer on GPU 0 with `handle` vouches for.
    fn vouch(handle: IpcHandle) -> crate::fd_passing::Vouch {
        crate::fd_passing::Vouch::new(handle, 0, 4096)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_ipc_handle_is_mapped_only_as_its_owner_confirms_or_signed() {
        let (ours, theirs) = (IpcHandle([7; 64]), IpcHandle([9; 64]));
        for secret in [None, Some(secret())] {
            let server = server(secret.clone());
            let _vouched = server.vouch(0x1000, vouch(ours));
            let silent = Mutex::new(None);
            let address = server.address();
            let owner = |region| Owner {
                socket: &address,
                region,
                silent: &silent,
            };
            owner(0x1000).confirm(&ours, secret.as_ref()).await.unwrap();
            // Another engine's handle is the descriptor's lie whatever the secret.
            let error = owner(0x1000).confirm(&theirs, secret.as_ref()).await;
            let Err(OpenError::Peer(violation)) = error else {
                panic!("{secret:?}: another engine's handle not refused as the peer's fault");
            };
            assert!(violation.to_string().contains("another engine's memory"));
            // A buffer the engine no longer has: a descriptor out of date, refused here
            // without blaming the peer.
            let error = owner(0x2000).confirm(&ours, secret.as_ref()).await;
            let Err(OpenError::Local(stale)) = error else {
                panic!("{secret:?}: an unregistered buffer not refused as out of date");
            };
            assert!(stale.to_string().contains("out of date"), "{stale}");
            // An owner that cannot be asked: with a secret, the signed descriptor vouches
            // for it; without one, the handle is not mapped and the remedy is named.
            let nowhere = FdSocket::new("ferry-no-such-engine".into(), None);
            let gone = Owner {
                socket: &nowhere,
                region: 0x1000,
                silent: &silent,
            };
            match (gone.confirm(&ours, secret.as_ref()).await, &secret) {
                (Ok(()), Some(_)) => {}
                (Err(OpenError::Local(error)), None) => {
                    let reason = error.to_string();
                    assert!(reason.contains("give both engines a secret"), "{reason}");
                }
                (other, _) => panic!("{secret:?}: an unreachable owner gave {:?}", other.is_ok()),
            }
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_handle_is_unknown_once_its_buffer_is_deregistered() {
        let server = server(None);
        let handle = IpcHandle([3; 64]);
        let vouched = server.vouch(0x1000, vouch(handle));
        confirm_ipc(&server.address(), 0x1000, &handle, None)
            .await
            .unwrap();
        drop(vouched);
        let error = confirm_ipc(&server.address(), 0x1000, &handle, None).await;
        assert!(
            matches!(
                error,
                Err(ImportError::NotRegistered { region: 0x1000, .. })
            ),
            "{error:?}"
        );
    }

    #[test]
    fn fabric_handles_parse_from_hex_and_junk_is_named() {
        let text: String = (0..64u8).map(|byte| format!("{byte:02x}")).collect();
        let bytes = fabric_handle(&text).unwrap();
        assert_eq!(bytes[0], 0);
        assert_eq!(bytes[63], 63);
        for junk in ["", "00", &"zz".repeat(64), &"é".repeat(64)] {
            let error = fabric_handle(junk).unwrap_err();
            assert!(
                error.to_string().contains("malformed FABRIC handle"),
                "{error}"
            );
        }
    }
}
