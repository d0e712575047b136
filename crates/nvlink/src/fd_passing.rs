//! The fd-passing socket: hands the file descriptors of registered VMM memory to processes of
//! the same user over an abstract Unix socket (SCM_RIGHTS), so they can map it, and takes
//! message rings from them ([`crate::messages`]). Both ends live here: [`FdServer`] serves
//! this engine's shares and reads the rings handed to it, [`fetch_fds`] asks a peer's and
//! [`open_messages`] hands a peer a ring.
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
//!    byte 0 when it exported that handle for a buffer it has registered at that address, and
//!    [`DISOWNED`] when it did not: a descriptor that names this engine but carries another
//!    engine's handle is found out before anything is mapped.
//! 6. A refusal, at any step, is a status byte 1 followed by the reason as UTF-8 until the
//!    socket closes.
//!
//! A server with a secret refuses a client that does not authenticate (status 1, before the
//! address is read); one without a secret refuses a client that does, in the handshake.

use crate::messages::{Incoming, MessageSender, RingReaders, RingSlot};
use ferry_core::auth::Secret;
use ferry_core::cuda::{AllocationHandle, Context, IpcHandle, IPC_HANDLE_LEN};
use ferry_core::telemetry::Throttle;
use ferry_core::{AuthFailure, InboxHandle, InstanceId};
use parking_lot::Mutex;
use rustix::net::{
    recvmsg, sendmsg, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};
use std::collections::HashMap;
use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::SocketAddr;
use std::sync::{Arc, Weak};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt, Interest};
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
/// The answer to [`CONFIRM_IPC`] for a handle this engine did not export for that buffer.
const DISOWNED: u8 = 2;
/// Bytes of a refusal's reason read at most.
const MAX_REFUSAL_BYTES: u64 = 64 << 10;
/// Longest engine name a ring's sender may give.
const MAX_SENDER_NAME: usize = 1024;

/// The abstract socket name of the fd-passing socket of engine `owner`. A peer's export must
/// name its own engine's socket: one naming another engine's is refused, so a peer cannot
/// point this engine at a third engine's memory.
pub fn fd_socket_name(owner: InstanceId) -> String {
    format!("ferry-{owner}")
}

/// The VMM allocations under one registered buffer, retained while it is shared.
pub(crate) struct Share {
    /// The GPU they live on, whose context exporting needs.
    pub(crate) ordinal: u32,
    /// Each allocation, in mapping order.
    pub(crate) handles: Vec<AllocationHandle>,
}

/// Shares by the address the buffer was registered at.
type Shares = Mutex<HashMap<u64, Share>>;

/// The CUDA IPC handles this engine exported, by the address of the buffer they were
/// exported for.
type Vouched = Mutex<HashMap<u64, IpcHandle>>;

/// This engine's fd-passing socket, served on the engine's runtime.
pub(crate) struct FdServer {
    name: String,
    shares: Arc<Shares>,
    vouched: Arc<Vouched>,
    /// Held while the server runs: the threads reading message rings stop once it is gone.
    _running: Arc<()>,
    #[cfg(test)]
    readers: Arc<RingReaders>,
}

impl std::fmt::Debug for FdServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FdServer")
            .field("name", &self.name)
            .finish()
    }
}

/// Keeps one buffer shared through the socket; dropped when the buffer is deregistered.
pub(crate) struct ShareGuard {
    shares: Weak<Shares>,
    addr: u64,
}

impl Drop for ShareGuard {
    fn drop(&mut self) {
        if let Some(shares) = self.shares.upgrade() {
            shares.lock().remove(&self.addr);
        }
    }
}

/// Keeps one buffer's IPC handle confirmed through the socket; dropped when the buffer is
/// deregistered.
pub(crate) struct VouchGuard {
    vouched: Weak<Vouched>,
    addr: u64,
}

impl Drop for VouchGuard {
    fn drop(&mut self) {
        if let Some(vouched) = self.vouched.upgrade() {
            vouched.lock().remove(&self.addr);
        }
    }
}

impl FdServer {
    /// Binds engine `owner`'s socket and serves it on `runtime` until the server is dropped;
    /// with `secret`, only to clients that prove it. Messages from rings handed to it go to
    /// `inbox`.
    pub(crate) fn start(
        owner: InstanceId,
        secret: Option<Secret>,
        runtime: &tokio::runtime::Handle,
        inbox: InboxHandle,
    ) -> std::io::Result<FdServer> {
        Self::start_with_rings(owner, secret, runtime, inbox, MAX_RINGS)
    }

    /// [`Self::start`], reading at most `max_rings` message rings at once.
    fn start_with_rings(
        owner: InstanceId,
        secret: Option<Secret>,
        runtime: &tokio::runtime::Handle,
        inbox: InboxHandle,
        max_rings: usize,
    ) -> std::io::Result<FdServer> {
        let name = fd_socket_name(owner);
        let listener = std::os::unix::net::UnixListener::bind_addr(
            &SocketAddr::from_abstract_name(name.as_bytes())?,
        )?;
        listener.set_nonblocking(true)?;
        let listener = {
            let _entered = runtime.enter();
            tokio::net::UnixListener::from_std(listener)?
        };
        let shares = Arc::new(Shares::default());
        let vouched = Arc::new(Vouched::default());
        let running = Arc::new(());
        let readers = Arc::new(RingReaders::new(Arc::downgrade(&running)));
        let serving = Serving {
            shares: Arc::downgrade(&shares),
            vouched: Arc::downgrade(&vouched),
            secret,
            inbox,
            readers: Arc::clone(&readers),
            rings: Arc::default(),
            max_rings,
        };
        runtime.spawn(accept_loop(listener, serving));
        Ok(FdServer {
            name,
            shares,
            vouched,
            _running: running,
            #[cfg(test)]
            readers,
        })
    }

    /// The socket's abstract name, as exports carry it.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// Confirms `handle` as the IPC handle of the buffer registered at `addr`, to peers that
    /// ask before mapping it, until the guard drops.
    pub(crate) fn vouch(&self, addr: u64, handle: IpcHandle) -> VouchGuard {
        self.vouched.lock().insert(addr, handle);
        VouchGuard {
            vouched: Arc::downgrade(&self.vouched),
            addr,
        }
    }

    /// Shares the allocations of the buffer registered at `addr` until the guard drops.
    pub(crate) fn share(&self, addr: u64, share: Share) -> ShareGuard {
        self.shares.lock().insert(addr, share);
        ShareGuard {
            shares: Arc::downgrade(&self.shares),
            addr,
        }
    }
}

/// What the accept loop serves with.
#[derive(Clone)]
struct Serving {
    shares: Weak<Shares>,
    vouched: Weak<Vouched>,
    secret: Option<Secret>,
    inbox: InboxHandle,
    /// The threads that read the rings handed over.
    readers: Arc<RingReaders>,
    /// Rings read now, each held by its [`RingSlot`].
    rings: Arc<std::sync::atomic::AtomicUsize>,
    /// Most rings read at once.
    max_rings: usize,
}

/// Message rings an engine reads at once (on at most three threads of 127 rings each); a
/// sender over it is refused and sends its notifications over TCP instead.
const MAX_RINGS: usize = 256;

/// Connections the fd socket serves at once; more are closed as they arrive, so a flood of
/// connections (another user's included, refused as they are) cannot take the process's file
/// descriptors.
const MAX_SERVING: usize = 64;

/// Failed or refused requests are logged at most once per this interval, with a count.
const WARN_EVERY: Duration = Duration::from_secs(10);

/// Logs why an fd-socket request failed or was refused, at most once per [`WARN_EVERY`].
fn warn_failed(throttle: &Throttle, reason: &str) {
    if let Some(count) = throttle.due() {
        tracing::warn!(%reason, count, "fd-passing requests failed or were refused (the latest reason shown)");
    }
}

async fn accept_loop(listener: tokio::net::UnixListener, serving: Serving) {
    let open = Arc::new(tokio::sync::Semaphore::new(MAX_SERVING));
    let warnings = Arc::new(Throttle::new(WARN_EVERY));
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(error) => {
                warn_failed(
                    &warnings,
                    &format!("accepting on the fd-passing socket failed: {error}"),
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(slot) = Arc::clone(&open).try_acquire_owned() else {
            warn_failed(
                &warnings,
                &format!("more than {MAX_SERVING} connections at once; the newest is closed"),
            );
            continue;
        };
        let Some(shares) = serving.shares.upgrade() else {
            return;
        };
        let (serving, warnings) = (serving.clone(), Arc::clone(&warnings));
        tokio::spawn(async move {
            let served = tokio::time::timeout(TIMEOUT, serve(stream, shares, &serving))
                .await
                .unwrap_or_else(|_| Err(format!("the client took longer than {TIMEOUT:?}")));
            drop(slot);
            if let Err(reason) = served {
                warn_failed(&warnings, &reason);
            }
        });
    }
}

/// Serves one connection: checks who asks, then answers with the descriptors, takes the
/// message ring, or refuses.
async fn serve(
    mut stream: UnixStream,
    shares: Arc<Shares>,
    serving: &Serving,
) -> Result<(), String> {
    let secret = serving.secret.as_ref();
    let io = |what: &str, error: std::io::Error| format!("{what}: {error}");
    let credentials = stream
        .peer_cred()
        .map_err(|error| io("reading the client's credentials", error))?;
    let client = match credentials.pid() {
        Some(0) | None => "a process in another PID namespace".to_owned(),
        Some(pid) => format!("process {pid}"),
    };
    let own = rustix::process::getuid().as_raw();
    if credentials.uid() != own {
        let reason = format!(
            "{client} runs as uid {}, this engine as uid {own}; GPU memory is shared with the same user only",
            credentials.uid()
        );
        refuse(&mut stream, &reason).await?;
        return Err(format!("refused: {reason}"));
    }
    let authenticates = stream
        .read_u8()
        .await
        .map_err(|error| io("reading the request", error))?;
    match (authenticates, secret) {
        (0, Some(_)) => {
            tracing::warn!(%client, reason = %AuthFailure::PeerHasNoSecret, "refused an fd-passing request");
            return refuse(&mut stream, &AuthFailure::NoLocalSecret.to_string()).await;
        }
        (0, None) => {}
        (_, secret) => {
            if let Err(reason) = ferry_core::auth::server(&mut stream, secret, TIMEOUT).await {
                return Err(format!("{client} did not authenticate: {reason}"));
            }
        }
    }
    let request = stream
        .read_u8()
        .await
        .map_err(|error| io("reading the request", error))?;
    match request {
        FETCH_FDS => {}
        OPEN_MESSAGES => return take_ring(stream, &client, serving).await,
        CONFIRM_IPC => return confirm(stream, serving).await,
        other => {
            return refuse(
                &mut stream,
                &format!("request {other} is none of {FETCH_FDS} (descriptors), {OPEN_MESSAGES} (a message ring) and {CONFIRM_IPC} (an IPC handle); are both engines the same ferry version?"),
            )
            .await
        }
    }
    let addr = stream
        .read_u64_le()
        .await
        .map_err(|error| io("reading the request", error))?;
    let exported = {
        let shares = Arc::clone(&shares);
        tokio::task::spawn_blocking(move || export(&shares, addr))
            .await
            .map_err(|error| format!("exporting the descriptors stopped: {error}"))?
    };
    match exported {
        Ok(fds) => send_fds(&stream, &fds)
            .await
            .map_err(|error| io("sending the descriptors", error)),
        Err(reason) => refuse(&mut stream, &reason).await,
    }
}

/// Takes the message ring a client hands over and starts reading it.
async fn take_ring(mut stream: UnixStream, client: &str, serving: &Serving) -> Result<(), String> {
    let io = |what: &str, error: std::io::Error| format!("{what}: {error}");
    let len = usize::from(
        stream
            .read_u16_le()
            .await
            .map_err(|error| io("reading the sender's name", error))?,
    );
    if len > MAX_SENDER_NAME {
        return refuse(
            &mut stream,
            &format!("a sender name of {len} bytes is longer than {MAX_SENDER_NAME}"),
        )
        .await;
    }
    let mut from = vec![0; len];
    stream
        .read_exact(&mut from)
        .await
        .map_err(|error| io("reading the sender's name", error))?;
    let from = String::from_utf8_lossy(&from).into_owned();
    // Taken before anything is mapped, and given back if the ring does not start.
    let Some(slot) = RingSlot::take(&serving.rings, serving.max_rings) else {
        let max = serving.max_rings;
        return refuse(
            &mut stream,
            &format!("this engine already reads its maximum of {max} message rings; send notifications over TCP"),
        )
        .await;
    };
    let (status, fds) = receive_fds(&stream, 1)
        .await
        .map_err(|error| io("receiving the message ring", error))?;
    let ring = match (status, fds.as_slice()) {
        (Some(0), [fd]) => crate::messages::map_ring(fd),
        _ => Err("the request carried no message ring".to_owned()),
    };
    let memory = match ring {
        Ok(memory) => memory,
        Err(reason) => {
            tracing::warn!(%client, %reason, "refused a message ring");
            return refuse(&mut stream, &reason).await;
        }
    };
    // The ring is read before the sender hears yes, so that a reader that cannot start
    // (a container's thread limit, an old kernel) is a refusal the sender falls back from,
    // not a ring that swallows what it is sent.
    let socket = stream
        .into_std()
        .map_err(|error| io("handing the socket to the ring's reader", error))?;
    let answer = socket
        .try_clone()
        .map_err(|error| io("handing the socket to the ring's reader", error))?;
    let started = serving.readers.add(Incoming {
        memory,
        from,
        socket,
        inbox: serving.inbox.clone(),
        _slot: slot,
    });
    let status = match &started {
        Ok(()) => vec![0],
        Err(error) => {
            let mut refusal = vec![1];
            refusal
                .extend_from_slice(format!("this engine cannot read the ring: {error}").as_bytes());
            refusal
        }
    };
    // The socket is non-blocking now; an empty one takes a status of a few bytes whole.
    rustix::net::send(&answer, &status, SendFlags::NOSIGNAL)
        .map_err(|error| io("answering the ring's sender", error.into()))?;
    started.map_err(|error| io("starting the ring's reader", error))
}

/// Answers whether the IPC handle the client names is the one this engine exported for the
/// buffer at the address it names.
async fn confirm(mut stream: UnixStream, serving: &Serving) -> Result<(), String> {
    let io = |error: std::io::Error| format!("reading the handle to confirm: {error}");
    let addr = stream.read_u64_le().await.map_err(io)?;
    let mut handle = [0u8; IPC_HANDLE_LEN];
    stream.read_exact(&mut handle).await.map_err(io)?;
    let ours = serving.vouched.upgrade().is_some_and(|vouched| {
        vouched
            .lock()
            .get(&addr)
            .is_some_and(|exported| exported.0 == handle)
    });
    stream
        .write_u8(if ours { 0 } else { DISOWNED })
        .await
        .map_err(|error| format!("answering a handle's confirmation: {error}"))
}

/// Sends `fds` in messages of at most [`FDS_PER_MESSAGE`], each carried by one 0 byte.
async fn send_fds(stream: &UnixStream, fds: &[OwnedFd]) -> std::io::Result<()> {
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

/// Sends a refusal, then reads and drops what the client still sends until it closes: a
/// socket closed with unread bytes resets, and the reset would destroy the refusal in flight.
async fn refuse(stream: &mut UnixStream, reason: &str) -> Result<(), String> {
    let mut answer = Vec::with_capacity(1 + reason.len());
    answer.push(1);
    answer.extend_from_slice(reason.as_bytes());
    let sent = async {
        stream.write_all(&answer).await?;
        stream.shutdown().await?;
        tokio::io::copy(&mut (&mut *stream).take(64 << 10), &mut tokio::io::sink()).await
    };
    sent.await
        .map(drop)
        .map_err(|error| format!("sending a refusal: {error}"))
}

/// Fresh descriptors for every allocation of the buffer shared at `addr`.
fn export(shares: &Shares, addr: u64) -> Result<Vec<OwnedFd>, String> {
    let shares = shares.lock();
    let share = shares
        .get(&addr)
        .ok_or_else(|| format!("no VMM region is registered at {addr:#x}"))?;
    let context = Context::get(share.ordinal).map_err(|error| error.to_string())?;
    context.bind().map_err(|error| error.to_string())?;
    share
        .handles
        .iter()
        .map(|handle| handle.export_fd().map_err(|error| error.to_string()))
        .collect()
}

/// Asks engine `socket`'s fd socket whether `handle` is the IPC handle it exported for its
/// buffer at `region`, proving `secret` when there is one.
///
/// # Errors
/// [`ImportError::Disowned`] when the engine says it is not; the others when it could not be
/// asked.
pub(crate) async fn confirm_ipc(
    socket: &str,
    region: u64,
    handle: &IpcHandle,
    secret: Option<&Secret>,
) -> Result<(), ImportError> {
    let asked = async {
        let failed = |action| socket_error(socket, action);
        let mut stream = connect(socket, secret, CONFIRM_IPC).await?;
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
            Ok(_) => {
                let mut reason = String::new();
                let _ = (&mut stream)
                    .take(MAX_REFUSAL_BYTES)
                    .read_to_string(&mut reason)
                    .await;
                Err(ImportError::Refused { reason })
            }
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

/// Why a peer's export could not be mapped here (the peer's own faults are [`ferry_core::ProtocolViolation`]s).
#[derive(Debug, thiserror::Error)]
pub(crate) enum ImportError {
    /// The socket could not be named, reached, written or read.
    #[error("{action} the peer's fd socket {socket:?} failed: {source}")]
    Socket {
        /// The peer's socket name.
        socket: String,
        /// What was being done.
        action: &'static str,
        /// The operating system's error.
        source: std::io::Error,
    },
    /// The handshake failed.
    #[error("authenticating with the peer's fd socket {socket:?} failed: {reason}")]
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
    #[error("the peer's fd socket {socket:?} closed without answering")]
    NoAnswer {
        /// The peer's socket name.
        socket: String,
    },
    /// The peer took too long.
    #[error("the peer's fd socket {socket:?} did not answer within {TIMEOUT:?}")]
    TimedOut {
        /// The peer's socket name.
        socket: String,
    },
    /// The engine a descriptor names says the IPC handle in it is not its own.
    #[error("the engine serving fd socket {socket:?} did not export the IPC handle its descriptor carries")]
    Disowned {
        /// The engine's socket name.
        socket: String,
    },
    /// Without a secret, an IPC handle is mapped only when its owner confirms it.
    #[error("the peer's IPC handle could not be confirmed with its engine ({reason}); without a secret only handles their engine confirms are mapped: give both engines a secret (descriptors are then signed) or let them reach each other's fd socket (one network namespace)")]
    Unconfirmed {
        /// Why the owner could not be asked.
        reason: Box<ImportError>,
    },
    /// Importing a received descriptor, or mapping what it names, failed.
    #[error(transparent)]
    Mapping(#[from] ferry_core::Error),
}

/// Asks the peer's fd socket `socket` for the descriptors of the buffer registered at
/// `region`, with room for `count` of them (what the peer sends beyond is dropped by the
/// kernel), proving `secret` first when there is one.
///
/// # Cancel safety
/// Cancel safe: dropped half-way, the connection closes and nothing is kept.
pub(crate) async fn fetch_fds(
    socket: &str,
    region: u64,
    count: usize,
    secret: Option<&Secret>,
) -> Result<Vec<OwnedFd>, ImportError> {
    tokio::time::timeout(TIMEOUT, fetch(socket, region, count, secret))
        .await
        .unwrap_or_else(|_| {
            Err(ImportError::TimedOut {
                socket: socket.to_owned(),
            })
        })
}

async fn fetch(
    socket: &str,
    region: u64,
    count: usize,
    secret: Option<&Secret>,
) -> Result<Vec<OwnedFd>, ImportError> {
    let failed = |action| socket_error(socket, action);
    let mut stream = connect(socket, secret, FETCH_FDS).await?;
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
        Some(_) => {
            let mut reason = String::new();
            let _ = (&mut stream)
                .take(MAX_REFUSAL_BYTES)
                .read_to_string(&mut reason)
                .await;
            return Err(ImportError::Refused { reason });
        }
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

/// Connects to the peer's fd socket `socket`, proves `secret` when there is one, and sends
/// `request`.
async fn connect(
    socket: &str,
    secret: Option<&Secret>,
    request: u8,
) -> Result<UnixStream, ImportError> {
    let failed = |action| socket_error(socket, action);
    let mut stream = connect_nonblocking(socket).map_err(failed("connecting to"))?;
    // The socket's name is only a name: after its engine is gone, a process of another user
    // could have bound it. The server checks the client's user; the client checks the server's.
    let server = stream
        .peer_cred()
        .map_err(failed("reading the credentials of"))?;
    let own = rustix::process::getuid().as_raw();
    if server.uid() != own {
        return Err(ImportError::Refused {
            reason: format!(
                "the socket is served by uid {}, not by this engine's uid {own}: it is not the peer engine's",
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

/// Connects to the abstract socket `name` without ever blocking: a listener whose backlog is
/// full (its engine stopped accepting) is an error at once, not a thread asleep.
fn connect_nonblocking(name: &str) -> std::io::Result<UnixStream> {
    let socket = rustix::net::socket_with(
        rustix::net::AddressFamily::UNIX,
        rustix::net::SocketType::STREAM,
        rustix::net::SocketFlags::NONBLOCK | rustix::net::SocketFlags::CLOEXEC,
        None,
    )?;
    let address = rustix::net::SocketAddrUnix::new_abstract_name(name.as_bytes())?;
    match rustix::net::connect(&socket, &address) {
        Ok(()) => {}
        Err(rustix::io::Errno::AGAIN) => {
            return Err(std::io::Error::new(
                std::io::ErrorKind::WouldBlock,
                "its backlog is full: the engine behind it is not accepting",
            ))
        }
        Err(error) => return Err(error.into()),
    }
    UnixStream::from_std(std::os::unix::net::UnixStream::from(socket))
}

/// Hands the peer behind fd socket `socket` (engine `peer`) a fresh message ring to read,
/// naming this engine `name` as the sender, proving `secret` first when there is one.
///
/// # Cancel safety
/// Cancel safe: dropped half-way, the connection closes and the peer drops the ring.
pub(crate) async fn open_messages(
    socket: &str,
    peer: &str,
    name: &str,
    secret: Option<&Secret>,
) -> Result<MessageSender, ImportError> {
    let opened = async {
        let failed = |action| socket_error(socket, action);
        let (memory, fd) = crate::messages::create_ring().map_err(failed("making a ring for"))?;
        let mut stream = connect(socket, secret, OPEN_MESSAGES).await?;
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
            Ok(_) => {
                let mut reason = String::new();
                let _ = (&mut stream)
                    .take(MAX_REFUSAL_BYTES)
                    .read_to_string(&mut reason)
                    .await;
                Err(ImportError::Refused { reason })
            }
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

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_core::Notifications;
    use std::io::Read;

    fn secret(text: &str) -> Secret {
        Secret::new(format!("{text}-0123456789abcdef").into_bytes()).unwrap()
    }

    fn server(secret: Option<Secret>) -> FdServer {
        server_with_inbox(secret, 16).0
    }

    /// A server whose message rings deliver into an inbox of `slots` notifications.
    fn server_with_inbox(secret: Option<Secret>, slots: usize) -> (FdServer, Notifications) {
        server_with_rings(secret, slots, MAX_RINGS)
    }

    /// [`server_with_inbox`], reading at most `max_rings` rings at once.
    fn server_with_rings(
        secret: Option<Secret>,
        slots: usize,
        max_rings: usize,
    ) -> (FdServer, Notifications) {
        let owner = InstanceId::random().unwrap();
        let runtime = tokio::runtime::Handle::current();
        let (inbox, notifications) = InboxHandle::standalone(slots, 64 << 20, runtime.clone());
        let server = FdServer::start_with_rings(owner, secret, &runtime, inbox, max_rings).unwrap();
        (server, notifications)
    }

    /// The next notification, waiting up to five seconds.
    async fn next(notifications: &mut Notifications) -> ferry_core::Notification {
        tokio::time::timeout(Duration::from_secs(5), notifications.recv())
            .await
            .expect("no notification within 5 s")
            .expect("the inbox closed")
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn messages_through_a_ring_arrive_in_order_also_after_the_reader_slept() {
        let (server, mut inbox) = server_with_inbox(Some(secret("a")), 64);
        let sender = open_messages(server.name(), "decode", "prefill:1", Some(&secret("a")))
            .await
            .unwrap();
        for round in 0..3u8 {
            for index in 0..20u8 {
                let payload = vec![round ^ index; usize::from(index) * 700];
                sender.send(&payload).await.unwrap();
                let note = next(&mut inbox).await;
                assert_eq!(note.from, "prefill:1");
                assert_eq!(note.payload, payload);
            }
            // Long enough for the reader to stop polling and sleep on its futex word.
            tokio::time::sleep(Duration::from_millis(150)).await;
        }
        // The largest notification, many at once: more than the ring holds, so senders
        // wait for room as the reader takes them.
        let big: Vec<Vec<u8>> = (0..40u8)
            .map(|index| vec![index; ferry_core::MAX_NOTIFICATION_BYTES])
            .collect();
        let sends = futures::future::join_all(big.iter().map(|payload| sender.send(payload)));
        let (sent, received) = tokio::join!(sends, async {
            let mut received = Vec::new();
            for _ in 0..big.len() {
                received.push(next(&mut inbox).await.payload);
            }
            received
        });
        assert!(sent.iter().all(Result::is_ok), "{sent:?}");
        assert_eq!(received, big);
        assert_eq!(sender.closed(), None);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_full_inbox_refuses_a_message_and_the_sender_hears_why() {
        let (server, mut inbox) = server_with_inbox(None, 2);
        let sender = open_messages(server.name(), "decode", "prefill:1", None)
            .await
            .unwrap();
        sender.send(b"one").await.unwrap();
        sender.send(b"two").await.unwrap();
        let error = sender.send(b"three").await.unwrap_err();
        assert!(
            matches!(&error, ferry_core::Error::Rejected { reason, .. } if reason.to_string().contains("inbox is full")),
            "{error}"
        );
        assert_eq!(next(&mut inbox).await.payload, b"one");
        sender.send(b"four").await.unwrap();
        assert_eq!(next(&mut inbox).await.payload, b"two");
        assert_eq!(next(&mut inbox).await.payload, b"four");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_ring_without_the_secret_or_from_a_stopped_server_is_refused() {
        let (server, _inbox) = server_with_inbox(Some(secret("a")), 4);
        let error = open_messages(server.name(), "decode", "prefill:1", None)
            .await
            .unwrap_err();
        assert!(matches!(error, ImportError::Refused { .. }), "{error}");
        let sender = open_messages(server.name(), "decode", "prefill:1", Some(&secret("a")))
            .await
            .unwrap();
        let name = server.name().to_owned();
        drop(server);
        // The reader notices the engine stopped at its next look and closes the ring.
        let error = tokio::time::timeout(Duration::from_secs(5), async {
            loop {
                match sender.send(b"late").await {
                    Ok(()) => tokio::time::sleep(Duration::from_millis(20)).await,
                    Err(error) => break error,
                }
            }
        })
        .await
        .expect("the ring stayed open after its engine stopped");
        assert!(
            matches!(error, ferry_core::Error::PeerGone { .. }),
            "{error}"
        );
        assert!(sender.closed().is_some());
        // The listener closes at the next connection it takes, which it then drops.
        let error = open_messages(&name, "decode", "prefill:1", Some(&secret("a"))).await;
        assert!(error.is_err(), "a stopped server took a ring");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_closed_ring_says_so_and_takes_nothing_more() {
        let (server, mut inbox) = server_with_inbox(None, 16);
        let sender = open_messages(server.name(), "decode", "prefill:1", None)
            .await
            .unwrap();
        sender.send(b"before").await.unwrap();
        assert_eq!(next(&mut inbox).await.payload, b"before");
        sender.close();
        assert!(sender.closed().is_some());
        let error = sender.send(b"after").await.unwrap_err();
        assert!(
            matches!(error, ferry_core::Error::PeerGone { .. }),
            "{error}"
        );
        let nothing = tokio::time::timeout(Duration::from_millis(200), inbox.recv()).await;
        assert!(nothing.is_err(), "a closed ring delivered {nothing:?}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_record_left_for_the_gpu_arrives_once_its_position_is_stored_and_keeps_its_place() {
        let (server, mut inbox) = server_with_inbox(None, 16);
        let sender = open_messages(server.name(), "decode", "prefill:1", None)
            .await
            .unwrap();
        sender.send(b"first").await.unwrap();
        assert_eq!(next(&mut inbox).await.payload, b"first");
        let unpublished = sender.write_unpublished(b"data landed").unwrap();
        assert!(
            sender.write_unpublished(b"another").is_none(),
            "a second record was written while the first waits for its GPU"
        );
        let (later, held) = tokio::join!(sender.send(b"later"), async {
            let early = tokio::time::timeout(Duration::from_millis(150), inbox.recv()).await;
            assert!(
                early.is_err(),
                "delivered before its position was stored: {early:?}"
            );
            sender.store_position(unpublished.position());
            let held = next(&mut inbox).await.payload;
            unpublished.published().await.unwrap();
            held
        });
        later.unwrap();
        assert_eq!(held, b"data landed");
        assert_eq!(next(&mut inbox).await.payload, b"later");
        assert_eq!(sender.closed(), None);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_withdrawn_record_is_never_delivered_and_an_abandoned_one_closes_the_ring() {
        let (server, mut inbox) = server_with_inbox(None, 16);
        let sender = open_messages(server.name(), "decode", "prefill:1", None)
            .await
            .unwrap();
        let withdrawn = sender.write_unpublished(b"never queued").unwrap();
        let position = withdrawn.position();
        withdrawn.withdraw();
        sender.send(b"next").await.unwrap();
        assert_eq!(next(&mut inbox).await.payload, b"next");
        let abandoned = sender.write_unpublished(b"copies failed").unwrap();
        assert!(abandoned.position() > position);
        let stored = abandoned.position();
        abandoned.abandon("an injected failure");
        let reason = sender
            .closed()
            .expect("an abandoned record leaves the ring open");
        assert!(reason.contains("an injected failure"), "{reason}");
        // A GPU store that still ran publishes nothing the reader delivers.
        sender.store_position(stored);
        let nothing = tokio::time::timeout(Duration::from_millis(200), inbox.recv()).await;
        assert!(nothing.is_err(), "a closed ring delivered {nothing:?}");
        assert!(matches!(
            sender.send(b"after").await,
            Err(ferry_core::Error::PeerGone { .. })
        ));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_record_left_for_the_gpu_and_dropped_unsettled_closes_the_ring() {
        let (server, mut inbox) = server_with_inbox(None, 16);
        let sender = open_messages(server.name(), "decode", "prefill:1", None)
            .await
            .unwrap();
        let dropped = sender.write_unpublished(b"given up").unwrap();
        let position = dropped.position();
        drop(dropped);
        let reason = sender.closed().expect("the ring stayed open");
        assert!(reason.contains("dropped before its copies"), "{reason}");
        sender.store_position(position);
        let nothing = tokio::time::timeout(Duration::from_millis(200), inbox.recv()).await;
        assert!(nothing.is_err(), "a closed ring delivered {nothing:?}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_ring_that_could_still_shrink_is_refused() {
        let (server, _inbox) = server_with_inbox(None, 4);
        let mut stream = connect(server.name(), None, OPEN_MESSAGES).await.unwrap();
        stream.write_u16_le(4).await.unwrap();
        stream.write_all(b"evil").await.unwrap();
        let fd = rustix::fs::memfd_create("unsealed", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        rustix::fs::ftruncate(&fd, 1 << 21).unwrap();
        send_fds(&stream, &[fd]).await.unwrap();
        assert_eq!(stream.read_u8().await.unwrap(), 1);
        let mut reason = String::new();
        stream.read_to_string(&mut reason).await.unwrap();
        assert!(reason.contains("not sealed"), "{reason}");
    }

    #[tokio::test]
    async fn a_server_with_a_secret_refuses_a_client_without_one_and_says_so() {
        let server = server(Some(secret("a")));
        let error = fetch_fds(server.name(), 0x1000, 1, None).await.unwrap_err();
        assert!(
            matches!(&error, ImportError::Refused { reason } if reason.contains("requires a shared secret")),
            "{error}"
        );
    }

    #[tokio::test]
    async fn secrets_that_differ_or_are_missing_on_the_server_fail_the_handshake() {
        let server_a = server(Some(secret("a")));
        let error = fetch_fds(server_a.name(), 0x1000, 1, Some(&secret("b")))
            .await
            .unwrap_err();
        assert!(
            matches!(
                &error,
                ImportError::Auth {
                    reason: AuthFailure::PeerProofMismatch,
                    ..
                }
            ),
            "{error}"
        );
        let open = server(None);
        let error = fetch_fds(open.name(), 0x1000, 1, Some(&secret("a")))
            .await
            .unwrap_err();
        assert!(
            matches!(
                &error,
                ImportError::Auth {
                    reason: AuthFailure::PeerHasNoSecret,
                    ..
                }
            ),
            "{error}"
        );
    }

    #[tokio::test]
    async fn a_share_is_served_until_its_guard_drops() {
        let server = server(Some(secret("a")));
        let guard = server.share(
            0x1000,
            Share {
                ordinal: 0,
                handles: Vec::new(),
            },
        );
        let key = secret("a");
        let asked = || fetch_fds(server.name(), 0x1000, 1, Some(&key));
        // Registered: the server tries to export it (and, on a machine without a GPU, says
        // why it could not), instead of not knowing the address.
        let error = asked().await.unwrap_err();
        assert!(!error.to_string().contains("no VMM region"), "{error}");
        drop(guard);
        let error = asked().await.unwrap_err();
        assert!(
            matches!(&error, ImportError::Refused { reason } if reason == "no VMM region is registered at 0x1000"),
            "{error}"
        );
    }

    #[tokio::test]
    async fn more_descriptors_than_one_message_carries_arrive_in_order() {
        let name = fd_socket_name(InstanceId::random().unwrap());
        let listener = std::os::unix::net::UnixListener::bind_addr(
            &SocketAddr::from_abstract_name(name.as_bytes()).unwrap(),
        )
        .unwrap();
        listener.set_nonblocking(true).unwrap();
        let listener = tokio::net::UnixListener::from_std(listener).unwrap();
        let count = FDS_PER_MESSAGE + 47;
        let serving = tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.unwrap();
            assert_eq!(
                stream.read_u8().await.unwrap(),
                0,
                "no secret, no handshake"
            );
            assert_eq!(stream.read_u8().await.unwrap(), FETCH_FDS);
            assert_eq!(stream.read_u64_le().await.unwrap(), 0x1000);
            // Pipes whose write ends tell them apart: descriptor i carries the byte i % 251.
            let mut readers = Vec::new();
            for index in 0..count {
                let (reader, mut writer) = std::io::pipe().unwrap();
                std::io::Write::write_all(&mut writer, &[(index % 251) as u8]).unwrap();
                readers.push(OwnedFd::from(reader));
            }
            send_fds(&stream, &readers).await.unwrap();
        });
        let fds = fetch_fds(&name, 0x1000, count, None).await.unwrap();
        serving.await.unwrap();
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

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_flood_of_silent_connections_is_closed_past_the_cap_and_a_real_request_goes_on() {
        const FLOOD: usize = 3 * MAX_SERVING;
        let (server, mut inbox) = server_with_inbox(None, 4);
        let address = SocketAddr::from_abstract_name(server.name().as_bytes()).unwrap();
        let mut flood: Vec<std::os::unix::net::UnixStream> = (0..FLOOD)
            .map(|_| std::os::unix::net::UnixStream::connect_addr(&address).unwrap())
            .collect();
        // Those past the cap are closed as they arrive: their reads end at once.
        let closed = tokio::task::spawn_blocking(move || {
            let mut closed = 0;
            for stream in &mut flood {
                stream
                    .set_read_timeout(Some(Duration::from_millis(200)))
                    .unwrap();
                if matches!(stream.read(&mut [0u8; 1]), Ok(0)) {
                    closed += 1;
                }
            }
            (closed, flood)
        });
        let (closed, flood) = closed.await.unwrap();
        assert!(
            closed >= FLOOD - MAX_SERVING,
            "only {closed} of {FLOOD} connections were closed"
        );
        // Once the flood goes away, a real client is served.
        drop(flood);
        tokio::time::sleep(Duration::from_millis(200)).await;
        let sender = open_messages(server.name(), "decode", "prefill:1", None)
            .await
            .unwrap();
        sender.send(b"after the flood").await.unwrap();
        assert_eq!(next(&mut inbox).await.payload, b"after the flood");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn rings_past_the_limit_are_refused_and_one_that_ends_makes_room() {
        let (server, mut inbox) = server_with_rings(None, 16, 3);
        let mut senders = Vec::new();
        for index in 0..3 {
            let name = format!("prefill:{index}");
            senders.push(
                open_messages(server.name(), "decode", &name, None)
                    .await
                    .unwrap(),
            );
        }
        let refused = open_messages(server.name(), "decode", "prefill:3", None).await;
        assert!(
            matches!(&refused, Err(ImportError::Refused { reason }) if reason.contains("maximum of 3 message rings")),
            "{refused:?}"
        );
        for sender in &senders {
            sender.send(b"still read").await.unwrap();
            assert_eq!(next(&mut inbox).await.payload, b"still read");
        }
        // A ring whose sender goes away ends, and its place is free again.
        senders.pop().unwrap().close();
        let mut reopened = None;
        for _ in 0..50 {
            match open_messages(server.name(), "decode", "prefill:4", None).await {
                Ok(sender) => {
                    reopened = Some(sender);
                    break;
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
        let reopened = reopened.expect("a ring that ended makes room for another");
        reopened.send(b"in its place").await.unwrap();
        assert_eq!(next(&mut inbox).await.payload, b"in its place");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn two_hundred_rings_are_read_by_two_threads_also_after_they_slept() {
        let rings = 200;
        let (server, mut inbox) = server_with_rings(None, 2 * rings, 256);
        let mut senders = Vec::new();
        for index in 0..rings {
            let name = format!("prefill:{index}");
            senders.push(
                open_messages(server.name(), "decode", &name, None)
                    .await
                    .unwrap(),
            );
        }
        assert_eq!(
            server.readers.threads(),
            rings.div_ceil(crate::messages::RINGS_PER_THREAD)
        );
        for round in 0..2 {
            let sends = senders
                .iter()
                .enumerate()
                .map(|(index, sender)| async move {
                    sender.send(format!("{round}:{index}").as_bytes()).await
                });
            let sent = futures::future::join_all(sends).await;
            assert!(sent.iter().all(Result::is_ok), "{sent:?}");
            let mut received = std::collections::HashSet::new();
            for _ in 0..rings {
                let note = next(&mut inbox).await;
                let index = note.from.strip_prefix("prefill:").unwrap().to_owned();
                assert_eq!(note.payload, format!("{round}:{index}").into_bytes());
                received.insert(index);
            }
            assert_eq!(received.len(), rings);
            // Long enough for both threads to stop polling and sleep on their rings' words.
            tokio::time::sleep(Duration::from_millis(150)).await;
        }
        // Woken by the sender, not found at the end of a nap (100 ms): five wakes in a row
        // each well under a nap.
        for wake in 0..5 {
            tokio::time::sleep(Duration::from_millis(150)).await;
            let started = std::time::Instant::now();
            senders[rings - 1 - wake]
                .send(b"wakes a sleeping thread")
                .await
                .unwrap();
            assert_eq!(next(&mut inbox).await.payload, b"wakes a sleeping thread");
            assert!(
                started.elapsed() < Duration::from_millis(40),
                "a sleeping thread took {:?} to wake",
                started.elapsed()
            );
        }
    }
}
