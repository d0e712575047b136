//! The fd-passing socket: hands the file descriptors of registered VMM memory to peer
//! processes over a Unix socket (SCM_RIGHTS), so they can map it, and takes message rings
//! from them ([`crate::messages`]). The server ([`FdServer`], in `server`) serves this
//! engine's shares and reads the rings handed to it; the client (in `client`) asks a peer's
//! ([`fetch_fds`]), confirms its IPC handles ([`confirm_ipc`]) and hands it rings
//! ([`open_messages`]); this module holds the protocol's constants and the descriptor
//! passing both ends share.
//!
//! # Where the socket is
//! Every server binds the abstract socket [`fd_socket_name`], which lives in the network
//! namespace: processes of one namespace reach each other through it. With a socket
//! directory (`dir`: [`crate::NvlinkConfig::socket_dir`] or [`SOCKET_DIR_ENV`]) it also binds
//! the file `<dir>/ferry-<instance>.sock` (`socket_file`), which processes of other network
//! namespaces that mount the same directory reach (two pods of one node with a shared
//! hostPath volume). Exports and the descriptor's `nvlink` endpoint carry the file's path;
//! a client tries the abstract name first and the file where nothing listens under the name
//! (`address`).
//!
//! # Who may connect
//! Both ends read the other's user from the kernel (`SO_PEERCRED`) before anything else. With
//! a shared secret any user may go on, and the handshake below is the credential; without
//! one, only the same user (`credentials`). The socket file's permissions follow the same
//! rule: 0o666 with a secret, 0o600 without.
//!
//! # Protocol
//! 1. The client sends one byte: 1 when it will authenticate, 0 when it has no secret. With 1,
//!    the handshake of [`ferry_core::auth`] follows.
//! 2. The client sends what it asks for: [`FETCH_FDS`] or [`OPEN_MESSAGES`] (one byte).
//! 3. For [`FETCH_FDS`], it sends the registered buffer's address (8 bytes, little-endian).
//!    The server answers with a status byte 0 with one descriptor per allocation attached, in
//!    mapping order, repeated for every [`FDS_PER_MESSAGE`] allocations.
//! 4. For [`OPEN_MESSAGES`], it sends its engine's name (its length in 2 bytes,
//!    little-endian, then UTF-8), then one 0 byte with the ring's memory file attached. The
//!    server answers with a status byte 0 and from then on sends a verdict for each message
//!    it takes from the ring, until either side closes the socket.
//! 5. For [`CONFIRM_IPC`], it sends the registered buffer's address (8 bytes, little-endian)
//!    and the 64-byte CUDA IPC handle its descriptor carries. The server answers with a status
//!    byte 0 when it exported that handle for a buffer it has registered at that address,
//!    [`DISOWNED`] when that buffer's handle is another (a descriptor that names this engine
//!    but carries another engine's handle is found out before anything is mapped), and
//!    [`NOT_REGISTERED`] when no buffer is registered there.
//! 6. For [`STAGE`], it sends the address of a registered `cudaMalloc` buffer (8 bytes,
//!    little-endian), which names the GPU, and the staging bytes it asks for (8 bytes). The
//!    server answers with a status byte 0 with the descriptor of a fresh VMM staging
//!    allocation attached, then the staging buffer's length (8 bytes); from then on the
//!    connection carries staged-copy requests (`stage`) until the client closes it.
//! 7. A refusal, at any step, is a status byte 1 followed by the reason as UTF-8 until the
//!    socket closes.
//!
//! A server with a secret refuses a client that does not authenticate (status 1, before the
//! address is read); one without a secret refuses a client that does, in the handshake. The
//! protocol is the same over the abstract socket and the socket file.

mod address;
mod client;
mod credentials;
mod dir;
#[cfg(test)]
mod dir_tests;
mod registered;
mod server;
mod socket_file;
mod stage;
mod stale;
#[cfg(test)]
mod tests;
mod vouched;

pub(crate) use address::FdSocket;
pub(crate) use client::{confirm_ipc, fetch_fds, open_messages, open_staging};
pub(crate) use dir::{
    configured as configured_socket_dir, socket_file_name, SocketDir, MAX_SOCKET_PATH,
};
pub use dir::{SocketDirError, SOCKET_DIR_ENV};
pub(crate) use server::{FdServer, Share};
#[cfg(any(fuzzing, test))]
pub(crate) use stage::fuzz_request as fuzz_stage_request;
pub(crate) use stage::{
    encode_request as encode_stage_request, SessionEnded, StageEntry, StageOp, ANSWER_TIMEOUT,
    DONE as STAGE_DONE, FAILED as STAGE_FAILED, MAX_ENTRIES as STAGE_MAX_ENTRIES,
    MAX_REASON_BYTES as STAGE_MAX_REASON_BYTES, MAX_STAGING_BYTES, MIN_STAGING_BYTES,
};
pub(crate) use vouched::{InUse, Vouch, Vouched};

use ferry_core::{AuthFailure, InstanceId};
use rustix::net::{
    recvmsg, sendmsg, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};
use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::time::Duration;
use tokio::io::Interest;
use tokio::net::UnixStream;

/// Most descriptors passed with one message (the kernel's SCM_MAX_FD); an answer with more
/// comes as several messages of one 0 byte each, in mapping order.
pub const FDS_PER_MESSAGE: usize = 253;

/// How long one request may take, the handshake included.
const TIMEOUT: Duration = Duration::from_secs(5);

/// The request for the descriptors of a registered buffer.
const FETCH_FDS: u8 = 0;
/// The request to read a message ring.
const OPEN_MESSAGES: u8 = 1;
/// The request to confirm that a CUDA IPC handle is this engine's.
const CONFIRM_IPC: u8 = 2;
/// The request for a staging session ([`crate::staging`]).
const STAGE: u8 = 3;
/// The answer to [`CONFIRM_IPC`] for a handle this engine did not export for that buffer.
const DISOWNED: u8 = 2;
/// The answer to [`CONFIRM_IPC`] when no buffer is registered at that address (any more: the
/// asker's descriptor is older than a deregistration).
const NOT_REGISTERED: u8 = 3;
/// Bytes of a refusal's reason read at most.
const MAX_REFUSAL_BYTES: u64 = 64 << 10;
/// Longest engine name a ring's sender may give.
const MAX_SENDER_NAME: usize = 1024;

/// The abstract socket name of the fd-passing socket of engine `owner`. A peer's export must
/// name its own engine's socket: one naming another engine's is refused, so a peer cannot
/// point this engine at a third engine's memory.
pub fn fd_socket_name(owner: InstanceId) -> String {
    format!("{FD_SOCKET_PREFIX}{owner}")
}

/// What every engine's fd socket name starts with ([`fd_socket_name`]).
const FD_SOCKET_PREFIX: &str = "ferry-";

/// Why a peer's export could not be mapped here (the peer's own faults are [`ferry_core::ProtocolViolation`]s).
#[derive(Debug, thiserror::Error)]
pub(crate) enum ImportError {
    /// The socket could not be named, reached, written or read.
    #[error("{action} the peer's fd socket {socket} failed: {source}")]
    Socket {
        /// The peer's socket: its name, and its path where it has one.
        socket: String,
        /// What was being done.
        action: &'static str,
        /// The operating system's error.
        source: std::io::Error,
    },
    /// Nothing listens under the socket's abstract name in this network namespace, and its
    /// file in the socket directory could not be connected to either.
    #[error("the peer's fd socket is reachable neither by its name {name:?} ({by_name}) nor by its file {path} ({by_path}); engines in different network namespaces reach each other through a socket directory both mount at the same path (FERRY_SOCKET_DIR), and without a shared secret they must run as the same user")]
    Unreachable {
        /// The socket's abstract name.
        name: String,
        /// The socket's path in the socket directory.
        path: String,
        /// Why connecting by name failed.
        by_name: std::io::Error,
        /// Why connecting by path failed.
        by_path: std::io::Error,
    },
    /// The socket reached is bound under another name than the one asked for: a link that
    /// carries the peer's socket name leads to another engine's socket.
    #[error("the fd socket at {asked} is bound as {bound}, another socket: a link in the socket directory leads to another engine's socket, which this engine does not ask")]
    BoundElsewhere {
        /// The name or path connected to.
        asked: String,
        /// What the socket reached is bound as.
        bound: String,
    },
    /// The handshake failed.
    #[error("authenticating with the peer's fd socket {socket} failed: {reason}")]
    Auth {
        /// The peer's socket name.
        socket: String,
        /// Why.
        reason: AuthFailure,
    },
    /// The peer answered with a refusal.
    #[error("the peer refused to share its memory: {reason}")]
    Refused {
        /// The peer's words.
        reason: String,
    },
    /// The socket closed before any answer.
    #[error("the peer's fd socket {socket} closed without answering")]
    NoAnswer {
        /// The peer's socket name.
        socket: String,
    },
    /// The peer took too long.
    #[error("the peer's fd socket {socket} did not answer within {TIMEOUT:?}")]
    TimedOut {
        /// The peer's socket name.
        socket: String,
    },
    /// The engine a descriptor names says the IPC handle in it is not its own.
    #[error("the engine serving fd socket {socket} did not export the IPC handle its descriptor carries")]
    Disowned {
        /// The engine's socket name.
        socket: String,
    },
    /// The engine a descriptor names has no buffer registered at the address it names (any
    /// more: the descriptor is older than a deregistration).
    #[error("the engine serving fd socket {socket} has no buffer registered at {region:#x}; its descriptor is out of date")]
    NotRegistered {
        /// The engine's socket name.
        socket: String,
        /// The address asked about.
        region: u64,
    },
    /// Without a secret, an IPC handle is mapped only when its owner confirms it.
    #[error("the peer's IPC handle could not be confirmed with its engine ({reason}); without a secret only handles their engine confirms are mapped: give both engines a secret (descriptors are then signed) or let them reach each other's fd socket (one network namespace, or a socket directory both mount)")]
    Unconfirmed {
        /// Why the owner could not be asked.
        reason: Box<ImportError>,
    },
    /// Importing a received descriptor, or mapping what it names, failed.
    #[error(transparent)]
    Mapping(#[from] ferry_core::Error),
}

impl ImportError {
    /// Whether trying again later may go otherwise: the peer's socket did not answer in time
    /// or closed without answering (an owner busy with many peers starting at once, say),
    /// as opposed to a refusal or a socket that cannot be reached at all.
    pub(crate) fn is_passing(&self) -> bool {
        match self {
            ImportError::TimedOut { .. } | ImportError::NoAnswer { .. } => true,
            ImportError::Unconfirmed { reason } => reason.is_passing(),
            _ => false,
        }
    }
}

/// Turns an I/O error met while doing `action` on the peer's fd socket `socket` into an
/// [`ImportError`].
fn socket_error<'a>(
    socket: &'a str,
    action: &'static str,
) -> impl Fn(std::io::Error) -> ImportError + 'a {
    move |source| ImportError::Socket {
        socket: socket.to_owned(),
        action,
        source,
    }
}

/// Sends `fds` in messages of at most [`FDS_PER_MESSAGE`], each carried by one 0 byte.
pub(crate) async fn send_fds(stream: &UnixStream, fds: &[OwnedFd]) -> std::io::Result<()> {
    let borrowed: Vec<BorrowedFd<'_>> = fds.iter().map(AsFd::as_fd).collect();
    for batch in borrowed.chunks(FDS_PER_MESSAGE) {
        stream
            .async_io(Interest::WRITABLE, || {
                let mut space =
                    vec![MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(batch.len()))];
                let mut control = SendAncillaryBuffer::new(&mut space);
                if !control.push(SendAncillaryMessage::ScmRights(batch)) {
                    return Err(std::io::Error::other(
                        "the descriptors did not fit their message",
                    ));
                }
                Ok(sendmsg(
                    stream,
                    &[IoSlice::new(&[0])],
                    &mut control,
                    SendFlags::empty(),
                )?)
            })
            .await?;
    }
    Ok(())
}

/// Receives one status byte with up to `room` descriptors attached; `None` at the end of the
/// stream. Descriptors beyond `room` are closed by the kernel.
async fn receive_fds(
    stream: &UnixStream,
    room: usize,
) -> std::io::Result<(Option<u8>, Vec<OwnedFd>)> {
    stream
        .async_io(Interest::READABLE, || {
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
        })
        .await
}
