//! Hands out the file descriptors of registered VMM memory to processes of the same user, over
//! an abstract Unix socket (SCM_RIGHTS), so they can map it.
//!
//! With a shared secret, a connection starts with the handshake of [`crate::auth`]; a client
//! that fails it is refused before it can ask for anything. Then the client sends the
//! registered buffer's address (8 bytes, little-endian). The answer is a status byte 0 with
//! one descriptor per allocation attached, in mapping order, repeated for every
//! [`FDS_PER_MESSAGE`] allocations; or 1 followed by the reason as UTF-8 until the socket
//! closes.

use super::table::RegionTable;
use crate::auth::Secret;
use crate::cuda::Context;
use crate::memory::Location;
use rustix::net::{sendmsg, SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
use std::io::{IoSlice, Read, Write};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::{Arc, Weak};
use std::time::Duration;

/// The abstract socket name of the fd-passing socket of engine `owner`. A peer's export
/// must name its own engine's socket: one naming another engine's is refused, so a peer
/// cannot point this engine at a third engine's memory.
pub fn fd_socket_name(owner: crate::InstanceId) -> String {
    format!("ferry-{owner}")
}

/// Most descriptors passed with one message (the kernel's SCM_MAX_FD); an answer with more
/// comes as several messages of one 0 byte each, in mapping order.
pub const FDS_PER_MESSAGE: usize = 253;

/// How long one request may take, the handshake included.
const TIMEOUT: Duration = Duration::from_secs(5);

/// Binds the abstract socket `name` and serves it on the current tokio runtime until the
/// runtime shuts down or the table is gone; with `secret`, only to clients that prove it.
pub(crate) fn start(
    name: &str,
    table: &Arc<RegionTable>,
    secret: Option<Secret>,
) -> std::io::Result<()> {
    let listener = UnixListener::bind_addr(&SocketAddr::from_abstract_name(name.as_bytes())?)?;
    listener.set_nonblocking(true)?;
    let listener = tokio::net::UnixListener::from_std(listener)?;
    let table = Arc::downgrade(table);
    tokio::spawn(accept_loop(listener, table, secret));
    Ok(())
}

async fn accept_loop(
    listener: tokio::net::UnixListener,
    table: Weak<RegionTable>,
    secret: Option<Secret>,
) {
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(error) => {
                tracing::warn!(%error, "accepting on the fd-passing socket failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Some(table) = table.upgrade() else { return };
        let served = stream.into_std().and_then(|stream| {
            stream.set_nonblocking(false)?;
            Ok(stream)
        });
        match served {
            Ok(stream) => {
                let secret = secret.clone();
                tokio::task::spawn_blocking(move || {
                    if let Err(error) = serve(stream, &table, secret.as_ref()) {
                        tracing::warn!(%error, "an fd-passing request failed");
                    }
                });
            }
            Err(error) => tracing::warn!(%error, "preparing an fd-passing connection failed"),
        }
    }
}

fn serve(
    mut stream: UnixStream,
    table: &RegionTable,
    secret: Option<&Secret>,
) -> std::io::Result<()> {
    stream.set_read_timeout(Some(TIMEOUT))?;
    stream.set_write_timeout(Some(TIMEOUT))?;
    let peer = PeerCredentials::of(&stream)?;
    let own = rustix::process::getuid().as_raw();
    if peer.uid != own {
        let reason = format!(
            "{} runs as uid {}, this engine as uid {own}; GPU memory is shared with the same user only",
            peer.describe(),
            peer.uid,
        );
        tracing::error!(%reason, "refused an fd-passing request");
        return refuse(&mut stream, &reason);
    }
    if let Err(reason) = crate::auth::blocking::server(&mut stream, secret, TIMEOUT) {
        tracing::warn!(
            peer = %peer.describe(),
            %reason,
            "refused an fd-passing connection that did not authenticate"
        );
        // Closing with the client's bytes unread would reset the connection and could take
        // the refusal with it: stop sending, and drop what the client still sends until it
        // closes (bounded by the timeouts and 64 KiB).
        stream.shutdown(std::net::Shutdown::Write)?;
        let _ = std::io::copy(&mut (&stream).take(64 << 10), &mut std::io::sink());
        return Ok(());
    }
    stream.set_read_timeout(Some(TIMEOUT))?;
    stream.set_write_timeout(Some(TIMEOUT))?;
    let mut request = [0u8; 8];
    stream.read_exact(&mut request)?;
    let addr = u64::from_le_bytes(request);
    match export(table, addr) {
        Ok(fds) => {
            let borrowed: Vec<BorrowedFd<'_>> = fds.iter().map(AsFd::as_fd).collect();
            // The kernel passes at most FDS_PER_MESSAGE descriptors with one message: a range
            // of many expandable-segment pieces goes out in several, each after a 0 byte.
            for batch in borrowed.chunks(FDS_PER_MESSAGE) {
                let mut space =
                    vec![MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(batch.len()))];
                let mut control = SendAncillaryBuffer::new(&mut space);
                if !control.push(SendAncillaryMessage::ScmRights(batch)) {
                    return refuse(&mut stream, "the descriptors did not fit their message");
                }
                sendmsg(
                    &stream,
                    &[IoSlice::new(&[0])],
                    &mut control,
                    SendFlags::empty(),
                )?;
            }
            Ok(())
        }
        Err(reason) => refuse(&mut stream, &reason),
    }
}

/// Who is at the other end of a Unix stream, as the kernel saw it connect.
struct PeerCredentials {
    /// The peer's process id in this PID namespace; 0 when it lives in another one (the
    /// kernel has no number for it here).
    pid: i32,
    uid: u32,
}

impl PeerCredentials {
    fn of(stream: &UnixStream) -> std::io::Result<PeerCredentials> {
        // Not rustix's `socket_peercred`: its PID type cannot hold the 0 the kernel reports for
        // a peer in another PID namespace, which is the usual case between containers.
        let credentials =
            nix::sys::socket::getsockopt(stream, nix::sys::socket::sockopt::PeerCredentials)
                .map_err(std::io::Error::from)?;
        Ok(PeerCredentials {
            pid: credentials.pid(),
            uid: credentials.uid(),
        })
    }

    fn describe(&self) -> String {
        match self.pid {
            0 => "a process in another PID namespace".to_owned(),
            pid => format!("process {pid}"),
        }
    }
}

fn refuse(stream: &mut UnixStream, reason: &str) -> std::io::Result<()> {
    stream.write_all(&[1])?;
    stream.write_all(reason.as_bytes())
}

/// Fresh descriptors for every allocation of the VMM region registered at `addr`.
fn export(table: &RegionTable, addr: u64) -> Result<Vec<OwnedFd>, String> {
    let region = table
        .acquire(addr, 1)
        .filter(|region| region.entry.info.addr == addr)
        .ok_or_else(|| format!("no region is registered at {addr:#x}"))?;
    if region.entry.vmm.is_empty() {
        return Err(format!("the region at {addr:#x} is not VMM memory"));
    }
    let Location::Device { ordinal, .. } = region.entry.info.location else {
        return Err(format!("the region at {addr:#x} is not GPU memory"));
    };
    let context = Context::get(ordinal).map_err(|error| error.to_string())?;
    context.bind().map_err(|error| error.to_string())?;
    region
        .entry
        .vmm
        .iter()
        .map(|handle| handle.export_fd().map_err(|error| error.to_string()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peer_credentials_name_the_peer_and_a_foreign_pid_namespace() {
        let (near, _far) = UnixStream::pair().unwrap();
        let peer = PeerCredentials::of(&near).unwrap();
        assert_eq!(peer.pid, std::process::id() as i32);
        assert_eq!(peer.uid, rustix::process::getuid().as_raw());
        assert_eq!(peer.describe(), format!("process {}", std::process::id()));
        let foreign = PeerCredentials { pid: 0, uid: 0 };
        assert_eq!(foreign.describe(), "a process in another PID namespace");
    }

    fn secret(text: &str) -> Secret {
        Secret::new(format!("{text}-0123456789abcdef").into_bytes()).unwrap()
    }

    /// Serves one connection on a thread; the caller plays the client on the other end.
    fn serving(secret: Option<Secret>) -> (UnixStream, std::thread::JoinHandle<()>) {
        let (near, far) = UnixStream::pair().unwrap();
        let table = RegionTable::new();
        let server = std::thread::spawn(move || {
            serve(near, &table, secret.as_ref()).unwrap();
        });
        (far, server)
    }

    #[test]
    fn a_client_without_the_secret_gets_a_refusal_and_no_answer_to_its_request() {
        let (mut client, server) = serving(Some(secret("a")));
        client.write_all(&0x1000u64.to_le_bytes()).unwrap();
        client.shutdown(std::net::Shutdown::Write).unwrap();
        let mut answer = Vec::new();
        client.read_to_end(&mut answer).unwrap();
        server.join().unwrap();
        assert_eq!(answer[..4], crate::auth::MAGIC, "{answer:?}");
        assert!(
            !String::from_utf8_lossy(&answer).contains("registered"),
            "the request must not be served"
        );
    }

    #[test]
    fn a_client_with_another_secret_is_refused_before_its_request() {
        let (mut client, server) = serving(Some(secret("a")));
        let outcome =
            crate::auth::blocking::client(&mut client, &secret("b"), Duration::from_secs(5));
        assert_eq!(outcome, Err(crate::AuthFailure::PeerProofMismatch));
        drop(client);
        server.join().unwrap();
    }

    #[test]
    fn a_client_with_the_secret_is_served() {
        let (mut client, server) = serving(Some(secret("a")));
        crate::auth::blocking::client(&mut client, &secret("a"), Duration::from_secs(5)).unwrap();
        client.write_all(&0x1000u64.to_le_bytes()).unwrap();
        server.join().unwrap();
        let mut answer = Vec::new();
        client.read_to_end(&mut answer).unwrap();
        assert_eq!(answer[0], 1, "refused for the address, not for the secret");
        assert_eq!(
            String::from_utf8_lossy(&answer[1..]),
            "no region is registered at 0x1000"
        );
    }
}
