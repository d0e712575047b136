//! What the nvlink and mnnvl transports publish for a registered GPU buffer, and how they read
//! a peer's: a [`GpuExport`], carried in the descriptor as the transport's opaque
//! [`ferry_core::Export`].

use crate::fd_passing::{FdServer, Share, Vouch};
use ferry_core::cuda::{
    AllocationHandle, Context, DevicePointer, Driver, IpcHandle, FABRIC_HANDLE, POSIX_FD_HANDLE,
};
use ferry_core::{BufferDescriptor, Error, Export, ExportGuard, ProtocolViolation, Result};
use serde::{Deserialize, Serialize};

/// The format of [`GpuExport`] this build writes and reads.
///
/// Fields added later are optional and left out when empty (`VmmFd::socket_path`), and
/// readers ignore fields they do not know, so builds of one version read each other's exports:
/// an older build's export simply has no socket path, and an older build reads a newer one's
/// without it. The version changes only for a change that older readers would misread.
pub const EXPORT_VERSION: u32 = 1;

/// How a process elsewhere maps one registered GPU buffer.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum GpuExport {
    /// A legacy CUDA IPC handle of the `cudaMalloc` allocation holding the buffer.
    CudaIpc {
        /// The 64-byte handle as hex.
        handle: String,
        /// Offset of the buffer's first byte from the allocation's first byte.
        offset: u64,
    },
    /// VMM allocations (one or more, back to back) shared as POSIX file descriptors, which the
    /// owner hands out over its fd-passing socket: to processes of the same user, or of any
    /// user that proves the engines' shared secret.
    VmmFd {
        /// The owner's abstract Unix socket name.
        socket: String,
        /// The owner's fd socket as a file in its socket directory, for processes of another
        /// network namespace (another pod) that mount that directory at the same path; `None`
        /// when the owner has no socket directory (or is older than socket directories).
        /// Must name the file `ferry-<instance>.sock` of the owner's own instance id.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        socket_path: Option<String>,
        /// The registered buffer's address, which names it to the socket.
        region: u64,
        /// Offset of the buffer's first byte from the first allocation's first byte.
        offset: u64,
        /// Size of each allocation, in mapping order.
        pieces: Vec<u64>,
    },
    /// VMM allocations (one or more, back to back) shared by FABRIC handle, importable on any
    /// node of the NVLink domain (GB200/GB300 racks with an IMEX channel).
    Fabric {
        /// Each allocation's 64-byte FABRIC handle as hex, in mapping order.
        handles: Vec<String>,
        /// Offset of the buffer's first byte from the first allocation's first byte.
        offset: u64,
        /// Size of each allocation, in mapping order.
        pieces: Vec<u64>,
    },
}

impl GpuExport {
    /// This export as `transport`'s entry of a buffer descriptor.
    pub fn to_export(&self, transport: &str) -> Export {
        Export {
            transport: transport.to_owned(),
            version: EXPORT_VERSION,
            // Serializing an enum of strings and integers cannot fail.
            data: serde_json::to_string(self).unwrap_or_default(),
        }
    }

    /// Reads `transport`'s export of `buffer`: `None` when the peer published none.
    ///
    /// # Errors
    /// [`ProtocolViolation::Descriptor`] for another format version or data that is not an
    /// export.
    pub fn of(
        buffer: &BufferDescriptor,
        transport: &str,
    ) -> std::result::Result<Option<GpuExport>, ProtocolViolation> {
        let Some(export) = buffer.export(transport) else {
            return Ok(None);
        };
        if export.version != EXPORT_VERSION {
            return Err(ProtocolViolation::Descriptor {
                field: "export.version",
                problem: format!(
                    "is {}, and this build reads {EXPORT_VERSION}; run the same ferry version on both sides",
                    export.version
                ),
            });
        }
        serde_json::from_str(&export.data)
            .map(Some)
            .map_err(|error| ProtocolViolation::Descriptor {
                field: "export.data",
                problem: format!("is not a GPU export ({error})"),
            })
    }
}

/// What nvlink publishes for `len` bytes of device memory at `addr`: `cudaMalloc` memory by
/// legacy IPC handle; VMM memory with POSIX-fd handles through `fds` (which keeps the
/// allocations while the returned guard lives); nothing for VMM memory that only FABRIC
/// handles share (mnnvl's).
///
/// # Errors
/// [`Error::Unsupported`] for memory nothing can share (pool memory, a `cudaMalloc` range over
/// several allocations, VMM memory without the fd socket), with what to do instead;
/// [`Error::Cuda`] when a driver call fails.
pub(crate) fn export_local(
    addr: u64,
    len: u64,
    fds: Option<&FdServer>,
) -> Result<Option<(GpuExport, Option<ExportGuard>)>> {
    let pointer = Driver::get().device_pointer(addr)?;
    if pointer.legacy_ipc {
        let (export, handle) = export_ipc(addr, len, &pointer)?;
        // Peers confirm the handle with this engine before they map it; without the fd
        // socket only peers with the secret (whose descriptors are signed) will.
        let guard = fds.map(|server| {
            Box::new(server.vouch(addr, Vouch::new(handle, pointer.ordinal, len))) as ExportGuard
        });
        return Ok(Some((export, guard)));
    }
    if pointer.handle_types & POSIX_FD_HANDLE != 0 {
        let server = fds.ok_or_else(|| Error::Unsupported {
            memory: "VMM GPU memory".into(),
            addr,
            remedy: "the engine's fd-passing socket could not be opened (see the log); VMM memory cannot be shared without it".into(),
        })?;
        let (pieces, handles) = vmm_pieces(addr, len, pointer, POSIX_FD_HANDLE)?;
        let export = GpuExport::VmmFd {
            socket: server.name().to_owned(),
            socket_path: server.socket_path().map(str::to_owned),
            region: addr,
            offset: addr - pointer.allocation_base,
            pieces,
        };
        let guard = server.share(
            addr,
            Share {
                ordinal: pointer.ordinal,
                handles,
            },
        );
        return Ok(Some((export, Some(Box::new(guard)))));
    }
    if pointer.handle_types & FABRIC_HANDLE != 0 {
        return Ok(None);
    }
    Err(Error::Unsupported {
        memory: "GPU memory that cannot be shared (a stream-ordered pool allocation from cudaMallocAsync, or VMM memory created without a POSIX-fd handle type)".into(),
        addr,
        remedy: "allocate it with cudaMalloc (PyTorch's default caching allocator does), or create VMM memory with CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR (PyTorch's expandable segments do)".into(),
    })
}

/// What mnnvl publishes for device memory at `addr`: FABRIC handles of its VMM allocations,
/// when they allow them; `None` otherwise.
///
/// # Errors
/// [`Error::Unsupported`] for a range whose allocations do not continue each other;
/// [`Error::Cuda`] when a driver call fails.
pub(crate) fn export_fabric(addr: u64, len: u64) -> Result<Option<GpuExport>> {
    let pointer = Driver::get().device_pointer(addr)?;
    if pointer.legacy_ipc || pointer.handle_types & FABRIC_HANDLE == 0 {
        return Ok(None);
    }
    let (pieces, handles) = vmm_pieces(addr, len, pointer, FABRIC_HANDLE)?;
    let handles = handles
        .iter()
        .map(|handle| handle.export_fabric().map(hex::encode))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    Ok(Some(GpuExport::Fabric {
        handles,
        offset: addr - pointer.allocation_base,
        pieces,
    }))
}

/// The legacy IPC export of the `cudaMalloc` allocation under `addr..addr+len`, and its handle.
fn export_ipc(addr: u64, len: u64, pointer: &DevicePointer) -> Result<(GpuExport, IpcHandle)> {
    let allocation_end = pointer.allocation_base + pointer.allocation_size;
    if addr.checked_add(len).is_none_or(|end| end > allocation_end) {
        return Err(Error::Unsupported {
            memory: format!(
                "cudaMalloc memory spanning several allocations (the one at {:#x} ends {} bytes into the range)",
                pointer.allocation_base,
                allocation_end - addr
            ),
            addr,
            remedy: "register each allocation as its own region".into(),
        });
    }
    let context = Context::get(pointer.ordinal)?;
    let handle = IpcHandle::export(&context, pointer.allocation_base)?;
    let export = GpuExport::CudaIpc {
        handle: handle.to_hex(),
        offset: addr - pointer.allocation_base,
    };
    Ok((export, handle))
}

/// Walks the VMM allocations mapped back to back under `addr..addr+len`, each of which must
/// allow `handle_type`, and retains each. Returns their sizes and handles in mapping order.
fn vmm_pieces(
    addr: u64,
    len: u64,
    first: DevicePointer,
    handle_type: u32,
) -> Result<(Vec<u64>, Vec<AllocationHandle>)> {
    let end = addr
        .checked_add(len)
        .ok_or_else(|| Error::ApiMisuse("the range wraps".into()))?;
    let mut pieces = Vec::new();
    let mut handles = Vec::new();
    let mut piece = first;
    loop {
        let piece_end = piece.allocation_base + piece.allocation_size;
        handles.push(AllocationHandle::retain(piece.allocation_base)?);
        pieces.push(piece.allocation_size);
        if piece_end >= end {
            return Ok((pieces, handles));
        }
        piece = Driver::get()
            .device_pointer(piece_end)
            .map_err(|error| Error::Unsupported {
                memory: format!("a range with no GPU memory mapped at {piece_end:#x} ({error})"),
                addr,
                remedy: "register only ranges that are mapped from end to end".into(),
            })?;
        if piece.allocation_base != piece_end || piece.handle_types & handle_type == 0 {
            return Err(Error::Unsupported {
                memory: format!("a range whose allocation at {piece_end:#x} is not a VMM allocation of the same handle type continuing the previous one"),
                addr,
                remedy: "register each allocation on its own".into(),
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_core::cuda::GpuId;
    use ferry_core::Location;

    fn buffer(exports: Vec<Export>) -> BufferDescriptor {
        BufferDescriptor {
            addr: 0x1000,
            len: 0x1000,
            location: Location::Device {
                gpu: GpuId([1; 16]),
                ordinal: 0,
            },
            name: None,
            exports,
        }
    }

    #[test]
    fn an_export_reads_back_as_written_and_only_for_its_transport() {
        for socket_path in [None, Some("/run/ferry/ferry-x.sock".to_owned())] {
            let export = GpuExport::VmmFd {
                socket: "ferry-x".into(),
                socket_path,
                region: 0x1000,
                offset: 16,
                pieces: vec![2 << 20, 2 << 20],
            };
            let buffer = buffer(vec![export.to_export("nvlink")]);
            assert_eq!(GpuExport::of(&buffer, "nvlink").unwrap(), Some(export));
            assert_eq!(GpuExport::of(&buffer, "mnnvl").unwrap(), None);
        }
    }

    #[test]
    fn exports_with_and_without_a_socket_path_read_across_builds() {
        // What a build older than socket directories writes: read with no path.
        let old =
            r#"{"kind":"vmm_fd","socket":"ferry-x","region":4096,"offset":0,"pieces":[2097152]}"#;
        let export = |data: &str| Export {
            transport: "nvlink".into(),
            version: EXPORT_VERSION,
            data: data.into(),
        };
        assert_eq!(
            GpuExport::of(&buffer(vec![export(old)]), "nvlink").unwrap(),
            Some(GpuExport::VmmFd {
                socket: "ferry-x".into(),
                socket_path: None,
                region: 0x1000,
                offset: 0,
                pieces: vec![2 << 20],
            })
        );
        // Without a path, this build writes exactly what the older one did.
        let written = GpuExport::VmmFd {
            socket: "ferry-x".into(),
            socket_path: None,
            region: 0x1000,
            offset: 0,
            pieces: vec![2 << 20],
        }
        .to_export("nvlink");
        assert_eq!(written.data, old);
        assert_eq!(written.version, EXPORT_VERSION);
        // With a path, the fields an older build knows are all there: it reads the export
        // as before and ignores the path (serde's default for unknown fields).
        #[derive(Deserialize)]
        #[serde(tag = "kind", rename_all = "snake_case")]
        enum OlderGpuExport {
            VmmFd {
                socket: String,
                region: u64,
                offset: u64,
                pieces: Vec<u64>,
            },
        }
        let newer = GpuExport::VmmFd {
            socket: "ferry-x".into(),
            socket_path: Some("/run/ferry/ferry-x.sock".into()),
            region: 0x1000,
            offset: 0,
            pieces: vec![2 << 20],
        }
        .to_export("nvlink");
        assert!(newer
            .data
            .contains(r#""socket_path":"/run/ferry/ferry-x.sock""#));
        let OlderGpuExport::VmmFd {
            socket,
            region,
            offset,
            pieces,
        } = serde_json::from_str(&newer.data).unwrap();
        assert_eq!(
            (socket.as_str(), region, offset, pieces),
            ("ferry-x", 0x1000, 0, vec![2 << 20])
        );
    }

    #[test]
    fn another_version_or_junk_is_a_violation_naming_the_field() {
        let mut export = GpuExport::CudaIpc {
            handle: "00".into(),
            offset: 0,
        }
        .to_export("nvlink");
        export.version = 9;
        let error = GpuExport::of(&buffer(vec![export.clone()]), "nvlink").unwrap_err();
        assert!(error.to_string().contains("export.version"), "{error}");
        export.version = EXPORT_VERSION;
        export.data = "{\"kind\":\"teleport\"}".into();
        let error = GpuExport::of(&buffer(vec![export]), "nvlink").unwrap_err();
        assert!(error.to_string().contains("export.data"), "{error}");
    }
}
