//! Where a peer engine's fd socket is, and connecting to it: by its abstract name first
//! (processes of one network namespace), then by its file in the socket directory (processes
//! of different network namespaces that mount the same directory, such as two pods).

use super::ImportError;
use ferry_core::InstanceId;
use std::os::linux::net::SocketAddrExt;
use std::path::Path;
use tokio::net::UnixStream;

/// A peer engine's fd socket: its abstract name and, where the engine binds one in a socket
/// directory, the file's path. Both come from the peer's descriptor and are checked there
/// ([`crate::bounds`]) to name the peer engine's own socket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct FdSocket {
    name: String,
    path: Option<String>,
}

impl FdSocket {
    /// The socket of abstract name `name`, also bound at `path` when that is given.
    pub(crate) fn new(name: String, path: Option<String>) -> FdSocket {
        FdSocket { name, path }
    }

    /// Engine `owner`'s socket by its abstract name only.
    pub(crate) fn of(owner: InstanceId) -> FdSocket {
        FdSocket::new(super::fd_socket_name(owner), None)
    }

    /// Connects without ever blocking: by the abstract name, and where nothing listens under
    /// it in this network namespace (`ECONNREFUSED`), by the file. Either way the socket
    /// reached must be bound under the very name or path asked for: a link in the socket
    /// directory (symbolic or hard) named after the peer but leading to another engine's
    /// socket is refused, so a peer cannot point this engine at a third engine's memory.
    ///
    /// # Errors
    /// [`ImportError::Unreachable`] when neither answers, [`ImportError::Socket`] when the
    /// only one tried does not, [`ImportError::BoundElsewhere`] for a link.
    pub(super) fn connect(&self) -> Result<UnixStream, ImportError> {
        let by_name = rustix::net::SocketAddrUnix::new_abstract_name(self.name.as_bytes())
            .map_err(std::io::Error::from)
            .and_then(|address| connect_nonblocking(&address));
        let (stream, asked) = match (by_name, &self.path) {
            (Ok(stream), _) => (stream, Asked::Name(&self.name)),
            (Err(by_name), Some(path)) if another_namespace(&by_name) => {
                let by_path = if super::dir::in_served_dir(path) {
                    rustix::net::SocketAddrUnix::new(path.as_str())
                        .map_err(std::io::Error::from)
                        .and_then(|address| connect_nonblocking(&address))
                } else {
                    Err(std::io::Error::other(
                        "not tried: this engine serves no socket directory there; give both engines the same socket directory, mounted at the same path",
                    ))
                };
                match by_path {
                    Ok(stream) => (stream, Asked::Path(path)),
                    Err(by_path) => {
                        return Err(ImportError::Unreachable {
                            name: self.name.clone(),
                            path: path.clone(),
                            by_name,
                            by_path,
                        })
                    }
                }
            }
            (Err(source), _) => {
                return Err(ImportError::Socket {
                    socket: self.to_string(),
                    action: "connecting to",
                    source,
                })
            }
        };
        asked.check(&stream, self)?;
        let failed = |source| ImportError::Socket {
            socket: self.to_string(),
            action: "connecting to",
            source,
        };
        UnixStream::from_std(stream).map_err(failed)
    }
}

impl std::fmt::Display for FdSocket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.path {
            Some(path) => write!(f, "{:?} (or {path})", self.name),
            None => write!(f, "{:?}", self.name),
        }
    }
}

/// Whether a failed connect by abstract name means that nothing listens under it in this
/// network namespace, so the socket file is worth trying: not a full backlog, which says the
/// engine is there but busy.
fn another_namespace(error: &std::io::Error) -> bool {
    matches!(
        error.kind(),
        std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::NotFound
    )
}

/// How a connection was made, to check what it reached.
enum Asked<'a> {
    /// By abstract name.
    Name(&'a str),
    /// By the file at this path.
    Path(&'a str),
}

impl Asked<'_> {
    /// Checks that `stream`'s other end is bound under the name or path asked for. The
    /// kernel reports the listener's own bound address, whatever link led to it.
    fn check(
        &self,
        stream: &std::os::unix::net::UnixStream,
        socket: &FdSocket,
    ) -> Result<(), ImportError> {
        let bound = stream.peer_addr().map_err(|source| ImportError::Socket {
            socket: socket.to_string(),
            action: "reading the bound address of",
            source,
        })?;
        let same = match self {
            Asked::Name(name) => bound.as_abstract_name() == Some(name.as_bytes()),
            Asked::Path(path) => bound.as_pathname() == Some(Path::new(path)),
        };
        if same {
            return Ok(());
        }
        let bound = match (bound.as_pathname(), bound.as_abstract_name()) {
            (Some(path), _) => path.display().to_string(),
            (None, Some(name)) => format!("@{}", String::from_utf8_lossy(name)),
            (None, None) => "nothing (an unnamed socket)".to_owned(),
        };
        Err(ImportError::BoundElsewhere {
            asked: match self {
                Asked::Name(name) => format!("@{name}"),
                Asked::Path(path) => (*path).to_owned(),
            },
            bound,
        })
    }
}

/// Connects to `address` without ever blocking: a listener whose backlog is full (its
/// engine stopped accepting) is an error at once, not a thread asleep.
pub(super) fn connect_nonblocking(
    address: &rustix::net::SocketAddrUnix,
) -> std::io::Result<std::os::unix::net::UnixStream> {
    let socket = rustix::net::socket_with(
        rustix::net::AddressFamily::UNIX,
        rustix::net::SocketType::STREAM,
        rustix::net::SocketFlags::NONBLOCK | rustix::net::SocketFlags::CLOEXEC,
        None,
    )?;
    match rustix::net::connect(&socket, address) {
        Ok(()) => Ok(std::os::unix::net::UnixStream::from(socket)),
        Err(rustix::io::Errno::AGAIN) => Err(std::io::Error::new(
            std::io::ErrorKind::WouldBlock,
            "its backlog is full: the engine behind it is not accepting",
        )),
        Err(error) => Err(error.into()),
    }
}
