//! Maps a peer's exported GPU buffer into this process: a legacy IPC handle directly, VMM
//! memory through file descriptors fetched from the peer's fd socket.

use crate::bounds;
use ferry_core::cuda::{
    AllocationHandle, Context, CudaError, IpcHandle, IpcMapping, VmmMapping, FABRIC_HANDLE_LEN,
};
use ferry_core::{Export, ProtocolViolation};
use rustix::net::{recvmsg, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags};
use std::io::{IoSliceMut, Read, Write};
use std::mem::MaybeUninit;
use std::os::fd::OwnedFd;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixStream};
use std::sync::Arc;
use std::time::Duration;

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
    Local(String),
}

impl From<CudaError> for OpenError {
    fn from(error: CudaError) -> Self {
        OpenError::Local(error.to_string())
    }
}

impl PeerMapping {
    /// Maps what `export` names into `context`'s GPU, with the offset of the buffer's first
    /// byte inside the mapping and the mapping's real size.
    pub(crate) fn open(context: Arc<Context>, export: &Export) -> Result<Opened, OpenError> {
        match export {
            Export::CudaIpc { handle, offset } => {
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
            Export::VmmFd {
                socket,
                region,
                offset,
                pieces,
            } => {
                let sizes = bounds::vmm_pieces(pieces, pieces.len()).map_err(OpenError::Peer)?;
                let fds = fetch_fds(socket, *region, pieces.len()).map_err(OpenError::Local)?;
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
            Export::Fabric {
                handles,
                offset,
                pieces,
            } => {
                let sizes = bounds::vmm_pieces(pieces, handles.len()).map_err(OpenError::Peer)?;
                let mut imported = Vec::with_capacity(handles.len());
                for (handle, size) in handles.iter().zip(sizes) {
                    let bytes = fabric_handle(handle).map_err(|problem| {
                        OpenError::Peer(ProtocolViolation::Descriptor {
                            field: "export.handles",
                            problem,
                        })
                    })?;
                    imported.push((AllocationHandle::import_fabric(&bytes)?, size));
                }
                map_vmm(context, imported, *offset)
            }
            other => Err(OpenError::Local(format!("unknown export {other:?}"))),
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
        if error.call == "cuMemMap" && matches!(error.code, 1 | 801) {
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
fn fabric_handle(text: &str) -> Result<[u8; FABRIC_HANDLE_LEN], String> {
    let malformed = || format!("the descriptor holds a malformed FABRIC handle {text:?}");
    if text.len() != FABRIC_HANDLE_LEN * 2 || !text.is_ascii() {
        return Err(malformed());
    }
    let mut bytes = [0u8; FABRIC_HANDLE_LEN];
    for (index, byte) in bytes.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&text[index * 2..index * 2 + 2], 16).map_err(|_| malformed())?;
    }
    Ok(bytes)
}

/// Asks the peer's fd socket for the descriptors of the region registered at `region`, with
/// room for `count` of them (what the peer sends beyond is dropped by the kernel), proving
/// first the secret of the engine this thread works for, when it has one.
fn fetch_fds(socket: &str, region: u64, count: usize) -> Result<Vec<OwnedFd>, String> {
    let failed = |what: &str, error: std::io::Error| {
        format!("{what} the peer's fd socket {socket:?}: {error}")
    };
    let address = SocketAddr::from_abstract_name(socket.as_bytes())
        .map_err(|error| failed("naming", error))?;
    let mut stream =
        UnixStream::connect_addr(&address).map_err(|error| failed("connecting to", error))?;
    if let Some(secret) = ferry_core::auth::engine_secret() {
        ferry_core::auth::blocking::client(&mut stream, &secret, Duration::from_secs(5)).map_err(
            |reason| {
                format!("authenticating with the peer's fd socket {socket:?} failed: {reason}")
            },
        )?;
    }
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .map_err(|error| failed("configuring", error))?;
    stream
        .write_all(&region.to_le_bytes())
        .map_err(|error| failed("writing to", error))?;
    let (status, mut fds) = receive_fds(&stream, count.min(ferry_core::FDS_PER_MESSAGE))
        .map_err(|error| failed("reading from", error))?;
    if status.is_none() {
        return Err(format!(
            "the peer's fd socket {socket:?} closed without answering"
        ));
    }
    let status = status.unwrap_or_default();
    if status == ferry_core::auth::MAGIC[0] {
        // An authentication refusal, sent to a client that did not authenticate.
        return Err(format!(
            "the peer's fd socket {socket:?} refused this engine: {}",
            ferry_core::AuthFailure::NoLocalSecret
        ));
    }
    if status != 0 {
        let mut reason = String::new();
        let _ = stream.read_to_string(&mut reason);
        return Err(format!("the peer refused to share its memory: {reason}"));
    }
    // More allocations than one message carries come in further messages; a peer that
    // sends fewer is caught by the caller's count check.
    while fds.len() < count {
        let wanted = (count - fds.len()).min(ferry_core::FDS_PER_MESSAGE);
        match receive_fds(&stream, wanted).map_err(|error| failed("reading from", error))? {
            (Some(0), more) if !more.is_empty() => fds.extend(more),
            _ => break,
        }
    }
    Ok(fds)
}

/// Receives one status byte with up to `room` descriptors attached; `None` at the end of the
/// stream. Descriptors beyond `room` are closed by the kernel.
fn receive_fds(stream: &UnixStream, room: usize) -> std::io::Result<(Option<u8>, Vec<OwnedFd>)> {
    let mut status = [0u8; 1];
    let mut space = vec![MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(room))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let received = recvmsg(
        stream,
        &mut [IoSliceMut::new(&mut status)],
        &mut control,
        RecvFlags::CMSG_CLOEXEC,
    )?;
    let fds = control
        .drain()
        .filter_map(|message| match message {
            RecvAncillaryMessage::ScmRights(fds) => Some(fds.collect::<Vec<_>>()),
            _ => None,
        })
        .flatten()
        .collect();
    Ok(((received.bytes > 0).then_some(status[0]), fds))
}

#[cfg(test)]
mod tests {
    use super::{fabric_handle, fetch_fds};
    use std::io::Read;
    use std::os::linux::net::SocketAddrExt;
    use std::os::unix::net::{SocketAddr, UnixListener};
    use std::time::Duration;

    #[test]
    fn an_fd_socket_that_requires_a_secret_is_named_as_the_reason() {
        let name = format!("ferry-test-fd-auth-{}", std::process::id());
        let address = SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
        let listener = UnixListener::bind_addr(&address).unwrap();
        let server = std::thread::spawn(move || {
            let (mut stream, _) = listener.accept().unwrap();
            let secret = ferry_core::Secret::new(b"fd-secret-0123456789abcdef".to_vec()).unwrap();
            let outcome = ferry_core::auth::blocking::server(
                &mut stream,
                Some(&secret),
                Duration::from_secs(5),
            );
            stream.shutdown(std::net::Shutdown::Write).unwrap();
            let _ = stream.read_to_end(&mut Vec::new());
            outcome
        });
        // This thread belongs to no engine, so the client has no secret to prove.
        let error = fetch_fds(&name, 0x1000, 1).unwrap_err();
        assert_eq!(
            server.join().unwrap(),
            Err(ferry_core::AuthFailure::PeerHasNoSecret)
        );
        assert!(error.contains("requires a shared secret"), "{error}");
    }

    #[test]
    fn more_descriptors_than_one_message_carries_arrive_in_order() {
        use rustix::net::{sendmsg, SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
        use std::os::fd::AsFd;
        let name = format!("ferry-test-fd-batches-{}", std::process::id());
        let address = SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
        let listener = UnixListener::bind_addr(&address).unwrap();
        let count = ferry_core::FDS_PER_MESSAGE + 47;
        let server = std::thread::spawn(move || {
            let (mut stream, _) = listener.accept().unwrap();
            let mut request = [0u8; 8];
            stream.read_exact(&mut request).unwrap();
            // Pipes whose write ends tell them apart: descriptor i carries the byte i % 251.
            let mut readers = Vec::new();
            for index in 0..count {
                let (reader, mut writer) = std::io::pipe().unwrap();
                std::io::Write::write_all(&mut writer, &[(index % 251) as u8]).unwrap();
                readers.push(reader);
            }
            let fds: Vec<_> = readers.iter().map(AsFd::as_fd).collect();
            for batch in fds.chunks(ferry_core::FDS_PER_MESSAGE) {
                let mut space = vec![
                    std::mem::MaybeUninit::uninit();
                    rustix::cmsg_space!(ScmRights(batch.len()))
                ];
                let mut control = SendAncillaryBuffer::new(&mut space);
                assert!(control.push(SendAncillaryMessage::ScmRights(batch)));
                sendmsg(
                    &stream,
                    &[std::io::IoSlice::new(&[0])],
                    &mut control,
                    SendFlags::empty(),
                )
                .unwrap();
            }
        });
        let fds = fetch_fds(&name, 0x1000, count).unwrap();
        server.join().unwrap();
        assert_eq!(fds.len(), count);
        for (index, fd) in fds.into_iter().enumerate() {
            let mut byte = [0u8; 1];
            std::fs::File::from(fd).read_exact(&mut byte).unwrap();
            assert_eq!(
                byte[0],
                (index % 251) as u8,
                "descriptor {index} out of order"
            );
        }
    }

    #[test]
    fn fabric_handles_parse_from_hex_and_junk_is_named() {
        let text: String = (0..64u8).map(|byte| format!("{byte:02x}")).collect();
        let bytes = fabric_handle(&text).unwrap();
        assert_eq!(bytes[0], 0);
        assert_eq!(bytes[63], 63);
        for junk in ["", "00", &"zz".repeat(64), &"é".repeat(64)] {
            let error = fabric_handle(junk).unwrap_err();
            assert!(error.contains("malformed FABRIC handle"), "{error}");
        }
    }
}
