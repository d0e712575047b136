//! Maps a peer's exported GPU buffer into this process: a legacy IPC handle or FABRIC handles
//! directly, VMM memory through file descriptors fetched from the peer's fd socket.

use crate::bounds;
use crate::export::GpuExport;
use crate::fd_passing::{fetch_fds, ImportError};
use ferry_core::auth::Secret;
use ferry_core::cuda::{
    AllocationHandle, Context, CudaError, IpcHandle, IpcMapping, VmmMapping, FABRIC_HANDLE_LEN,
};
use ferry_core::ProtocolViolation;
use std::sync::Arc;

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
    /// Maps what `export` names into `context`'s GPU, with the offset of the buffer's first
    /// byte inside the mapping and the mapping's real size; VMM descriptors are fetched
    /// proving `secret`, when there is one.
    ///
    /// # Cancel safety
    /// Cancel safe: dropped half-way, nothing stays mapped.
    pub(crate) async fn open(
        context: Arc<Context>,
        export: &GpuExport,
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
                let mapping = IpcMapping::open(context, &handle)?;
                Ok(Opened {
                    len: mapping.len(),
                    mapping: PeerMapping::Ipc(mapping),
                    offset: *offset,
                })
            }
            GpuExport::VmmFd {
                socket,
                region,
                offset,
                pieces,
            } => {
                let sizes = bounds::vmm_pieces(pieces, pieces.len()).map_err(OpenError::Peer)?;
                let fds = fetch_fds(socket, *region, pieces.len(), secret)
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
    use super::fabric_handle;

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
