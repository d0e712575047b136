//! The serving end of the fd-passing socket: this engine's VMM shares and vouched IPC
//! handles, the message rings handed to it, refusals.

use super::credentials::admits;
use super::dir::{SocketDir, SocketDirError};
use super::registered::{ByAddress, Held};
use super::socket_file::SocketFile;
use super::stage::{OwnerServing, OwnerSession, SessionEnded};
use super::vouched::{Vouch, VouchGuard, Vouched};
use super::*;
use crate::config::NvlinkConfig;
use crate::messages::{Incoming, RingReaders, RingSlot};
use ferry_core::auth::Secret;
use ferry_core::cuda::{AllocationHandle, Context, IPC_HANDLE_LEN};
use ferry_core::telemetry::Throttle;
use ferry_core::{AuthFailure, InboxHandle, InstanceId};
use rustix::net::SendFlags;
use std::os::fd::OwnedFd;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::SocketAddr;
use std::sync::{Arc, Weak};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

/// The VMM allocations under one registered buffer, retained while it is shared.
pub(crate) struct Share {
    /// The GPU they live on, whose context exporting needs.
    pub(crate) ordinal: u32,
    /// Each allocation, in mapping order.
    pub(crate) handles: Vec<AllocationHandle>,
}

/// Shares by the address the buffer was registered at.
type Shares = ByAddress<Share>;

/// This engine's fd-passing socket, served on the engine's runtime: its abstract socket and,
/// once [`Self::serve_in`] bound one, its file in a socket directory.
pub(crate) struct FdServer {
    name: String,
    owner: InstanceId,
    /// The socket file's path, once [`Self::serve_in`] bound it.
    path: Option<String>,
    /// The socket file, removed from its directory by [`Self::withdraw_file`] or when the
    /// server drops.
    file: parking_lot::Mutex<Option<SocketFile>>,
    shares: Arc<Shares>,
    vouched: Arc<Vouched>,
    /// What each listener serves with.
    serving: Serving,
    /// Where the listeners run.
    runtime: tokio::runtime::Handle,
    /// Dropped with the server, which stops every listener at once (closing the abstract
    /// socket, so its name is free and refuses connections).
    _stop: tokio::sync::watch::Sender<()>,
    /// Held while the server runs: the threads reading message rings stop once it is gone.
    _running: Arc<()>,
    #[cfg(test)]
    pub(super) readers: Arc<RingReaders>,
}

impl std::fmt::Debug for FdServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FdServer")
            .field("name", &self.name)
            .field("path", &self.socket_path())
            .finish()
    }
}

impl FdServer {
    /// Binds engine `owner`'s socket and serves it on `runtime` until the server is dropped;
    /// with `secret`, only to clients that prove it. Messages from rings handed to it go to
    /// `inbox`; staging sessions copy as `config` lets the engine's copies use the GPU.
    pub(crate) fn start(
        owner: InstanceId,
        secret: Option<Secret>,
        runtime: &tokio::runtime::Handle,
        inbox: InboxHandle,
        config: NvlinkConfig,
    ) -> std::io::Result<FdServer> {
        Self::start_with_rings(owner, secret, runtime, inbox, config, MAX_RINGS)
    }

    /// [`Self::start`], reading at most `max_rings` message rings at once.
    pub(super) fn start_with_rings(
        owner: InstanceId,
        secret: Option<Secret>,
        runtime: &tokio::runtime::Handle,
        inbox: InboxHandle,
        config: NvlinkConfig,
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
        let (stop, stopped) = tokio::sync::watch::channel(());
        let serving = Serving {
            shares: Arc::downgrade(&shares),
            vouched: Arc::downgrade(&vouched),
            secret,
            inbox,
            readers: Arc::clone(&readers),
            rings: Arc::default(),
            max_rings,
            open: Arc::new(tokio::sync::Semaphore::new(MAX_SERVING)),
            staging: Arc::new(tokio::sync::Semaphore::new(MAX_STAGING_SESSIONS)),
            config,
            warnings: Arc::new(Throttle::new(WARN_EVERY)),
            stopped,
        };
        runtime.spawn(accept_loop(listener, serving.clone()));
        Ok(FdServer {
            name,
            owner,
            path: None,
            file: parking_lot::Mutex::new(None),
            shares,
            vouched,
            serving,
            runtime: runtime.clone(),
            _stop: stop,
            _running: running,
            #[cfg(test)]
            readers,
        })
    }

    /// Also serves the socket as the file `<dir>/ferry-<instance>.sock`, for engines of other
    /// network namespaces that mount `dir` at the same path; the file is removed when the
    /// server drops. Its permissions let through the users the server admits: every user
    /// with a secret (0o666), only this one without (0o600).
    ///
    /// # Errors
    /// [`SocketDirError`] when the file cannot be bound or given its permissions.
    pub(crate) fn serve_in(&mut self, dir: &SocketDir) -> Result<(), SocketDirError> {
        let with_secret = self.serving.secret.is_some();
        let (listener, file) = SocketFile::bind(dir, self.owner, with_secret)?;
        let listener = {
            let _entered = self.runtime.enter();
            tokio::net::UnixListener::from_std(listener).map_err(|source| SocketDirError::Bind {
                path: file.path().to_owned(),
                source,
            })?
        };
        self.runtime
            .spawn(accept_loop(listener, self.serving.clone()));
        tracing::debug!(
            path = file.path(),
            "serving the fd socket in the socket directory too"
        );
        self.path = Some(file.path().to_owned());
        *self.file.get_mut() = Some(file);
        Ok(())
    }

    /// Removes the socket file from its directory now, while the server may live on a little
    /// (its engine stopping; see `Transport::stop`): no new peer reaches it by the file, and
    /// a process that exits right after leaves no file behind.
    pub(crate) fn withdraw_file(&self) {
        drop(self.file.lock().take());
    }

    /// The socket's abstract name, as exports carry it.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// The socket file's path in the socket directory, as exports and the descriptor's
    /// endpoint carry it; `None` without a socket directory.
    pub(crate) fn socket_path(&self) -> Option<&str> {
        self.path.as_deref()
    }

    /// Where peers reach this server: its name, and its file where it has one.
    #[cfg(test)]
    pub(crate) fn address(&self) -> FdSocket {
        FdSocket::new(self.name.clone(), self.socket_path().map(str::to_owned))
    }

    /// Confirms `vouch`'s handle as the IPC handle of the buffer registered at `addr`, to
    /// peers that ask before mapping it, and lets staging sessions copy its bytes, until the
    /// guard drops.
    pub(crate) fn vouch(&self, addr: u64, vouch: Vouch) -> VouchGuard {
        VouchGuard::insert(&self.vouched, addr, vouch)
    }

    /// Shares the allocations of the buffer registered at `addr` until the guard drops.
    pub(crate) fn share(&self, addr: u64, share: Share) -> Held<Share> {
        self.shares.insert(addr, share)
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
    /// Connections served at once, over all listeners.
    open: Arc<tokio::sync::Semaphore>,
    /// Staging sessions served at once, over all listeners.
    staging: Arc<tokio::sync::Semaphore>,
    /// How the engine's copies may use the GPU, which staging sessions' copies follow.
    config: NvlinkConfig,
    /// Throttles the warnings of all listeners.
    warnings: Arc<Throttle>,
    /// Changes (closes) when the server drops: the listeners stop.
    stopped: tokio::sync::watch::Receiver<()>,
}

/// Message rings an engine reads at once (on at most three threads of 127 rings each); a
/// sender over it is refused and sends its notifications over TCP instead.
pub(super) const MAX_RINGS: usize = 256;

/// Connections the fd socket serves at once; more are closed as they arrive, so a flood of
/// connections (another user's included, refused as they are) cannot take the process's file
/// descriptors.
pub(super) const MAX_SERVING: usize = 64;

/// Staging sessions served at once (each holds a staging buffer of the GPU's memory); a peer
/// asking for another is refused and its `cudaMalloc` transfers take TCP.
pub(super) const MAX_STAGING_SESSIONS: usize = 16;

/// Failed or refused requests are logged at most once per this interval, with a count.
const WARN_EVERY: Duration = Duration::from_secs(10);

/// Logs why an fd-socket request failed or was refused, at most once per [`WARN_EVERY`].
fn warn_failed(throttle: &Throttle, reason: &str) {
    if let Some(count) = throttle.due() {
        tracing::warn!(%reason, count, "fd-passing requests failed or were refused (the latest reason shown)");
    }
}

/// Serves connections to `listener` until the server drops.
async fn accept_loop(listener: tokio::net::UnixListener, serving: Serving) {
    let mut stopped = serving.stopped.clone();
    let (open, warnings) = (&serving.open, &serving.warnings);
    loop {
        let accepted = tokio::select! {
            _ = stopped.changed() => return,
            accepted = listener.accept() => accepted,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(error) => {
                warn_failed(
                    warnings,
                    &format!("accepting on the fd-passing socket failed: {error}"),
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(slot) = Arc::clone(open).try_acquire_owned() else {
            warn_failed(
                warnings,
                &format!("more than {MAX_SERVING} connections at once; the newest is closed"),
            );
            continue;
        };
        let Some(shares) = serving.shares.upgrade() else {
            return;
        };
        let (serving, warnings) = (serving.clone(), Arc::clone(warnings));
        tokio::spawn(async move {
            let served = tokio::time::timeout(TIMEOUT, serve(stream, shares, &serving))
                .await
                .unwrap_or(Err(ServeFailure::TimedOut { after: TIMEOUT }));
            // A staging session lasts as long as its peer's link, past the request's limit.
            let served = match served {
                Ok(Some(session)) => session.run().await.map_err(ServeFailure::Staging),
                Ok(None) => Ok(()),
                Err(failure) => Err(failure),
            };
            drop(slot);
            if let Err(failure) = served {
                warn_failed(&warnings, &failure.to_string());
            }
        });
    }
}

/// Serves one connection: checks who asks, then answers with the descriptors, takes the
/// message ring, confirms a handle, or refuses; a staging request's session is returned, to
/// be run without the request's time limit.
async fn serve(
    mut stream: UnixStream,
    shares: Arc<Shares>,
    serving: &Serving,
) -> Result<Option<OwnerSession>, ServeFailure> {
    let secret = serving.secret.as_ref();
    let io = ServeFailure::io;
    let credentials = stream
        .peer_cred()
        .map_err(|error| io("reading the client's credentials", error))?;
    let client = match credentials.pid() {
        Some(0) | None => "a process in another PID namespace".to_owned(),
        Some(pid) => format!("process {pid}"),
    };
    let own = rustix::process::getuid().as_raw();
    if !admits(credentials.uid(), own, secret.is_some()) {
        let reason = format!(
            "{client} runs as uid {}, this engine as uid {own}; without a shared secret GPU memory is shared with the same user only: give both engines the same secret to share it with other users",
            credentials.uid()
        );
        refuse(&mut stream, &reason).await?;
        return Err(ServeFailure::Refused { reason });
    }
    let authenticates = match stream.read_u8().await {
        Ok(first) => first,
        // A client that closes before asking anything (an engine checking whether this socket
        // file is still served, see `stale`) is not a failed request.
        Err(error) if error.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(error) => return Err(io("reading the request", error)),
    };
    match (authenticates, secret) {
        (0, Some(_)) => {
            tracing::warn!(%client, reason = %AuthFailure::PeerHasNoSecret, "refused an fd-passing request");
            return refuse(&mut stream, &AuthFailure::NoLocalSecret.to_string())
                .await
                .map(|()| None);
        }
        (0, None) => {}
        (_, secret) => {
            if let Err(reason) = ferry_core::auth::server(&mut stream, secret, TIMEOUT).await {
                return Err(ServeFailure::Unauthenticated { client, reason });
            }
        }
    }
    let request = stream
        .read_u8()
        .await
        .map_err(|error| io("reading the request", error))?;
    match request {
        FETCH_FDS => {}
        OPEN_MESSAGES => return take_ring(stream, &client, serving).await.map(|()| None),
        CONFIRM_IPC => return confirm(stream, serving).await.map(|()| None),
        STAGE => return stage(stream, serving).await,
        other => {
            return refuse(
                &mut stream,
                &format!("request {other} is none of {FETCH_FDS} (descriptors), {OPEN_MESSAGES} (a message ring), {CONFIRM_IPC} (an IPC handle) and {STAGE} (a staging session); are both engines the same ferry version?"),
            )
            .await
            .map(|()| None)
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
            .map_err(ServeFailure::ExportStopped)?
    };
    let answered = match exported {
        Ok(fds) => send_fds(&stream, &fds)
            .await
            .map_err(|error| io("sending the descriptors", error)),
        Err(refused) => refuse(&mut stream, &refused.to_string()).await,
    };
    answered.map(|()| None)
}

/// Starts a staging session for the `cudaMalloc` buffer the client names, when a session slot
/// is free, the buffer is registered and its GPU gives the staging memory; refuses otherwise.
async fn stage(
    mut stream: UnixStream,
    serving: &Serving,
) -> Result<Option<OwnerSession>, ServeFailure> {
    let io = |error| ServeFailure::io("reading the staging request", error);
    let buffer = stream.read_u64_le().await.map_err(io)?;
    let bytes = stream.read_u64_le().await.map_err(io)?;
    let Ok(slot) = Arc::clone(&serving.staging).try_acquire_owned() else {
        return refuse(
            &mut stream,
            &format!(
                "this engine already serves its maximum of {MAX_STAGING_SESSIONS} staging sessions"
            ),
        )
        .await
        .map(|()| None);
    };
    let Some(vouched) = serving.vouched.upgrade() else {
        return refuse(&mut stream, "the engine is stopping")
            .await
            .map(|()| None);
    };
    let session = OwnerServing {
        vouched,
        stopped: serving.stopped.clone(),
        config: serving.config,
        slot,
    };
    match OwnerSession::start(stream, session, buffer, bytes).await {
        Ok(session) => Ok(Some(session)),
        Err((mut stream, reason)) => refuse(&mut stream, &reason).await.map(|()| None),
    }
}

/// Takes the message ring a client hands over and starts reading it.
async fn take_ring(
    mut stream: UnixStream,
    client: &str,
    serving: &Serving,
) -> Result<(), ServeFailure> {
    let io = ServeFailure::io;
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
        (Some(0), [fd]) => crate::messages::map_ring(fd).map_err(|error| error.to_string()),
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
async fn confirm(mut stream: UnixStream, serving: &Serving) -> Result<(), ServeFailure> {
    let io = |error| ServeFailure::io("reading the handle to confirm", error);
    let addr = stream.read_u64_le().await.map_err(io)?;
    let mut handle = [0u8; IPC_HANDLE_LEN];
    stream.read_exact(&mut handle).await.map_err(io)?;
    let answer = serving.vouched.upgrade().map_or(NOT_REGISTERED, |vouched| {
        vouched.with(addr, |exported| match exported {
            Some(exported) if exported.handle.0 == handle => 0,
            Some(_) => DISOWNED,
            None => NOT_REGISTERED,
        })
    });
    stream
        .write_u8(answer)
        .await
        .map_err(|error| ServeFailure::io("answering a handle's confirmation", error))
}

/// Sends a refusal, then reads and drops what the client still sends until it closes: a
/// socket closed with unread bytes resets, and the reset would destroy the refusal in flight.
async fn refuse(stream: &mut UnixStream, reason: &str) -> Result<(), ServeFailure> {
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
        .map_err(|error| ServeFailure::io("sending a refusal", error))
}

/// Fresh descriptors for every allocation of the buffer shared at `addr`.
fn export(shares: &Shares, addr: u64) -> Result<Vec<OwnedFd>, ExportRefused> {
    shares.with(addr, |share| {
        let share = share.ok_or(ExportRefused::NotRegistered { addr })?;
        let context = Context::get(share.ordinal)?;
        context.bind()?;
        share
            .handles
            .iter()
            .map(|handle| Ok(handle.export_fd()?))
            .collect()
    })
}

/// Why serving one connection of the fd socket failed: logged (throttled) by the listener,
/// never sent to the client, which hears only the refusal text.
#[derive(Debug, thiserror::Error)]
enum ServeFailure {
    /// Reading from or writing to the client failed.
    #[error("{action} failed: {source}")]
    Io {
        /// What was being done.
        action: &'static str,
        /// The operating system's error.
        source: std::io::Error,
    },
    /// The request was refused, for this reason (the client was told).
    #[error("refused: {reason}")]
    Refused {
        /// Why.
        reason: String,
    },
    /// The client did not prove it holds the engine's secret.
    #[error("{client} did not authenticate: {reason}")]
    Unauthenticated {
        /// Who asked.
        client: String,
        /// Why the proof failed.
        reason: AuthFailure,
    },
    /// The client did not finish its request in time.
    #[error("the client took longer than {after:?}")]
    TimedOut {
        /// The limit.
        after: Duration,
    },
    /// The task that exports the descriptors ended without an answer.
    #[error("exporting the descriptors stopped: {0}")]
    ExportStopped(tokio::task::JoinError),
    /// A staging session ended on a failure.
    #[error("a staging session ended: {0}")]
    Staging(#[from] SessionEnded),
}

impl ServeFailure {
    /// The failure of `action` with the operating system's `error`.
    fn io(action: &'static str, source: std::io::Error) -> ServeFailure {
        ServeFailure::Io { action, source }
    }
}

/// Why the descriptors of a buffer could not be exported: sent to the client as its refusal.
#[derive(Debug, thiserror::Error)]
enum ExportRefused {
    /// No VMM region of this engine starts at the address asked for.
    #[error("no VMM region is registered at {addr:#x}; the descriptor is out of date, fetch the peer's descriptor again")]
    NotRegistered {
        /// The address asked for.
        addr: u64,
    },
    /// The driver refused to export an allocation's handle.
    #[error("{0}")]
    Cuda(#[from] ferry_core::cuda::CudaError),
}
