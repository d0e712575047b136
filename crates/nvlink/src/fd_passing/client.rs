//! The asking end of the fd-passing socket: fetching a peer's descriptors, confirming its IPC
//! handles, handing it a message ring.

use super::credentials::admits;
use super::*;
use crate::messages::MessageSender;
use ferry_core::auth::Secret;
use ferry_core::cuda::IpcHandle;
use std::os::fd::OwnedFd;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

/// Asks an engine's fd socket `target` whether `handle` is the IPC handle it exported for
/// its buffer at `region`, proving `secret` when there is one.
///
/// # Errors
/// [`ImportError::Disowned`] when the engine says it is not; the others when it could not be
/// asked.
pub(crate) async fn confirm_ipc(
    target: &FdSocket,
    region: u64,
    handle: &IpcHandle,
    secret: Option<&Secret>,
) -> Result<(), ImportError> {
    let socket = &target.to_string();
    let asked = async {
        let failed = |action| socket_error(socket, action);
        let mut stream = connect(target, secret, CONFIRM_IPC).await?;
        let mut request = region.to_le_bytes().to_vec();
        request.extend_from_slice(&handle.0);
        stream
            .write_all(&request)
            .await
            .map_err(failed("writing to"))?;
        match stream.read_u8().await {
            Ok(0) => Ok(()),
            Ok(DISOWNED) => Err(ImportError::Disowned {
                socket: socket.to_owned(),
            }),
            Ok(NOT_REGISTERED) => Err(ImportError::NotRegistered {
                socket: socket.to_owned(),
                region,
            }),
            Ok(_) => Err(refusal(&mut stream).await),
            Err(_) => Err(ImportError::NoAnswer {
                socket: socket.to_owned(),
            }),
        }
    };
    tokio::time::timeout(TIMEOUT, asked)
        .await
        .unwrap_or_else(|_| {
            Err(ImportError::TimedOut {
                socket: socket.to_owned(),
            })
        })
}

/// Asks the peer's fd socket `target` for the descriptors of the buffer registered at
/// `region`, with room for `count` of them (what the peer sends beyond is dropped by the
/// kernel), proving `secret` first when there is one.
///
/// # Cancel safety
/// Cancel safe: dropped half-way, the connection closes and nothing is kept.
pub(crate) async fn fetch_fds(
    target: &FdSocket,
    region: u64,
    count: usize,
    secret: Option<&Secret>,
) -> Result<Vec<OwnedFd>, ImportError> {
    tokio::time::timeout(TIMEOUT, fetch(target, region, count, secret))
        .await
        .unwrap_or_else(|_| {
            Err(ImportError::TimedOut {
                socket: target.to_string(),
            })
        })
}

async fn fetch(
    target: &FdSocket,
    region: u64,
    count: usize,
    secret: Option<&Secret>,
) -> Result<Vec<OwnedFd>, ImportError> {
    let socket = &target.to_string();
    let failed = |action| socket_error(socket, action);
    let mut stream = connect(target, secret, FETCH_FDS).await?;
    stream
        .write_u64_le(region)
        .await
        .map_err(failed("writing to"))?;
    let room = count.clamp(1, FDS_PER_MESSAGE);
    let (status, mut fds) = receive_fds(&stream, room)
        .await
        .map_err(failed("reading from"))?;
    match status {
        None => {
            return Err(ImportError::NoAnswer {
                socket: socket.to_owned(),
            })
        }
        Some(0) => {}
        Some(_) => return Err(refusal(&mut stream).await),
    }
    // More allocations than one message carries come in further messages; a peer that sends
    // fewer is caught by the caller's count check.
    while fds.len() < count {
        let wanted = (count - fds.len()).min(FDS_PER_MESSAGE);
        match receive_fds(&stream, wanted)
            .await
            .map_err(failed("reading from"))?
        {
            (Some(0), more) if !more.is_empty() => fds.extend(more),
            _ => break,
        }
    }
    Ok(fds)
}

/// Connects to the peer's fd socket `target` (by name, else by path: [`FdSocket::connect`]),
/// checks who serves it, proves `secret` when there is one, and sends `request`.
pub(super) async fn connect(
    target: &FdSocket,
    secret: Option<&Secret>,
    request: u8,
) -> Result<UnixStream, ImportError> {
    let socket = &target.to_string();
    let failed = |action| socket_error(socket, action);
    let mut stream = target.connect()?;
    // The socket's name is only a name: after its engine is gone, a process of another user
    // could have bound it. Without a secret the server checks the client's user and the
    // client the server's; with one, the handshake proves the server holds it.
    let server = stream
        .peer_cred()
        .map_err(failed("reading the credentials of"))?;
    let own = rustix::process::getuid().as_raw();
    if !admits(server.uid(), own, secret.is_some()) {
        return Err(ImportError::Refused {
            reason: format!(
                "the socket is served by uid {}, not by this engine's uid {own}, and without a shared secret only the same user is trusted: it is not the peer engine's, or the engines run as different users and need a shared secret",
                server.uid()
            ),
        });
    }
    stream
        .write_u8(u8::from(secret.is_some()))
        .await
        .map_err(failed("writing to"))?;
    if let Some(secret) = secret {
        ferry_core::auth::client(&mut stream, secret, TIMEOUT)
            .await
            .map_err(|reason| ImportError::Auth {
                socket: socket.to_owned(),
                reason,
            })?;
    }
    stream
        .write_u8(request)
        .await
        .map_err(failed("writing to"))?;
    Ok(stream)
}

/// Hands the peer behind fd socket `target` (engine `peer`) a fresh message ring to read,
/// naming this engine `name` as the sender, proving `secret` first when there is one.
///
/// # Cancel safety
/// Cancel safe: dropped half-way, the connection closes and the peer drops the ring.
pub(crate) async fn open_messages(
    target: &FdSocket,
    peer: &str,
    name: &str,
    secret: Option<&Secret>,
) -> Result<MessageSender, ImportError> {
    let socket = &target.to_string();
    let opened = async {
        let failed = |action| socket_error(socket, action);
        let (memory, fd) = crate::messages::create_ring().map_err(failed("making a ring for"))?;
        let mut stream = connect(target, secret, OPEN_MESSAGES).await?;
        let name = &name.as_bytes()[..name.len().min(MAX_SENDER_NAME)];
        stream
            .write_u16_le(name.len() as u16)
            .await
            .map_err(failed("writing to"))?;
        stream.write_all(name).await.map_err(failed("writing to"))?;
        send_fds(&stream, &[fd])
            .await
            .map_err(failed("writing to"))?;
        match stream.read_u8().await {
            Ok(0) => Ok(MessageSender::new(memory, stream, peer.to_owned())),
            Ok(_) => Err(refusal(&mut stream).await),
            Err(error) if error.kind() == std::io::ErrorKind::UnexpectedEof => {
                Err(ImportError::NoAnswer {
                    socket: socket.to_owned(),
                })
            }
            Err(error) => Err(failed("reading from")(error)),
        }
    };
    tokio::time::timeout(TIMEOUT, opened)
        .await
        .unwrap_or_else(|_| {
            Err(ImportError::TimedOut {
                socket: socket.to_owned(),
            })
        })
}

/// The refusal whose reason follows a status byte other than 0: the server's words, read until
/// it closes the socket (at most [`MAX_REFUSAL_BYTES`]).
async fn refusal(stream: &mut UnixStream) -> ImportError {
    let mut reason = String::new();
    let _ = stream
        .take(MAX_REFUSAL_BYTES)
        .read_to_string(&mut reason)
        .await;
    ImportError::Refused { reason }
}

/// Opens a staging session with the engine behind fd socket `target` for its `cudaMalloc`
/// buffer registered at `buffer` (which names the GPU), asking for `bytes` of staging and
/// proving `secret` first when there is one. Returns the session's connection, the staging
/// allocation's descriptor and the staging buffer's length (which the owner may have cut).
///
/// # Cancel safety
/// Cancel safe: dropped half-way, the connection closes and the owner frees the staging.
pub(crate) async fn open_staging(
    target: &FdSocket,
    buffer: u64,
    bytes: u64,
    secret: Option<&Secret>,
) -> Result<(UnixStream, OwnedFd, u64), ImportError> {
    let socket = &target.to_string();
    let opened = async {
        let failed = |action| socket_error(socket, action);
        let mut stream = connect(target, secret, STAGE).await?;
        let mut request = buffer.to_le_bytes().to_vec();
        request.extend_from_slice(&bytes.to_le_bytes());
        stream
            .write_all(&request)
            .await
            .map_err(failed("writing to"))?;
        let (status, mut fds) = receive_fds(&stream, 1)
            .await
            .map_err(failed("reading from"))?;
        match (status, fds.pop()) {
            (None, _) => Err(ImportError::NoAnswer {
                socket: socket.to_owned(),
            }),
            (Some(0), Some(fd)) => {
                let len = stream.read_u64_le().await.map_err(failed("reading from"))?;
                Ok((stream, fd, len))
            }
            (Some(0), None) => Err(ImportError::Refused {
                reason: "the staging answer carried no descriptor".into(),
            }),
            (Some(_), _) => Err(refusal(&mut stream).await),
        }
    };
    tokio::time::timeout(TIMEOUT, opened)
        .await
        .unwrap_or_else(|_| {
            Err(ImportError::TimedOut {
                socket: socket.to_owned(),
            })
        })
}
