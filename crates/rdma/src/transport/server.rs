//! The connection side channel's server: a TCP listener where peers bring up queue pairs
//! ending at this engine's NICs. A peer's queue pairs live as long as its connection: when
//! it closes (the peer's link dropped, or the peer died), they are destroyed.

use super::config::RdmaConfig;
use super::handshake::{self, ConnectRequest, ConnectResponse, WireEndpoint};
use super::nic::Nic;
use super::queue::QueuePair;
use super::refusal::Refusal;
use crate::verbs::Verbs;
use ferry_core::auth::Secret;
use ferry_core::AuthFailure;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::AsyncReadExt;
use tokio::net::{TcpListener, TcpStream};

/// The first byte a client sends: whether it authenticates.
pub(crate) const AUTHENTICATES: u8 = 1;
/// The first byte of a client without a secret.
pub(crate) const ANONYMOUS: u8 = 0;

/// What serving needs, shared by every connection.
pub(crate) struct Service<V: Verbs> {
    pub(crate) verbs: Arc<V>,
    pub(crate) nics: Vec<Arc<Nic<V>>>,
    pub(crate) config: RdmaConfig,
    pub(crate) secret: Option<Secret>,
}

/// Accepts peers until the listener fails or the runtime shuts down.
pub(crate) async fn accept_loop<V: Verbs + 'static>(
    listener: TcpListener,
    service: Arc<Service<V>>,
) {
    loop {
        match listener.accept().await {
            Ok((stream, from)) => {
                let service = Arc::clone(&service);
                tokio::spawn(async move {
                    if let Err(reason) = serve(stream, &service).await {
                        tracing::warn!(%from, %reason, "an RDMA connection request failed");
                    }
                });
            }
            Err(error) => {
                tracing::warn!(%error, "the RDMA side channel stopped accepting");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// Serves one peer: authentication, its queue pairs, then holds them until it hangs up.
async fn serve<V: Verbs>(mut stream: TcpStream, service: &Service<V>) -> Result<(), ServeFailure> {
    handshake::keep_alive(&stream);
    let timeout = service.config.connect_timeout;
    let request = tokio::time::timeout(timeout, greet(&mut stream, service))
        .await
        .map_err(|_| ServeFailure::TimedOut { after: timeout })??;
    let queues = match accept(&request, service) {
        Ok((queues, endpoints)) => {
            send(&mut stream, &ConnectResponse::Accepted(endpoints)).await?;
            queues
        }
        Err(refusal) => {
            send(&mut stream, &ConnectResponse::Refused(refusal.to_string())).await?;
            return Err(refusal.into());
        }
    };
    tracing::debug!(client = %request.client, queue_pairs = queues.len(), "an RDMA peer connected");
    // The peer sends nothing more; its hang-up (or death) ends the connection's queue pairs.
    let mut byte = [0u8; 1];
    while matches!(stream.read(&mut byte).await, Ok(1..)) {}
    drop(queues);
    Ok(())
}

/// Reads the authentication flag, authenticates, and reads the request.
async fn greet<V: Verbs>(
    stream: &mut TcpStream,
    service: &Service<V>,
) -> Result<ConnectRequest, ServeFailure> {
    let mut flag = [0u8; 1];
    stream
        .read_exact(&mut flag)
        .await
        .map_err(|error| ServeFailure::io("reading the request", error))?;
    match (flag[0], &service.secret) {
        (AUTHENTICATES, secret) => {
            ferry_core::auth::server(stream, secret.as_ref(), service.config.connect_timeout)
                .await
                .map_err(ServeFailure::Unauthenticated)?;
        }
        (ANONYMOUS, None) => {}
        (ANONYMOUS, Some(_)) => {
            let refusal = ServeFailure::SecretRequired;
            send(stream, &ConnectResponse::Refused(refusal.to_string())).await?;
            return Err(refusal);
        }
        (byte, _) => return Err(ServeFailure::NotARequest { byte }),
    }
    handshake::receive(stream)
        .await
        .map_err(|error| ServeFailure::io("reading the request", error))
}

/// Creates and connects a queue pair for each offer.
fn accept<V: Verbs>(
    request: &ConnectRequest,
    service: &Service<V>,
) -> Result<(Vec<QueuePair<V>>, Vec<WireEndpoint>), Refusal> {
    let remotes = request.check()?;
    let mut queues = Vec::with_capacity(request.offers.len());
    let mut endpoints = Vec::with_capacity(request.offers.len());
    for (offer, remote) in request.offers.iter().zip(remotes) {
        let nic = service
            .nics
            .iter()
            .find(|nic| nic.name == offer.server_nic)
            .ok_or_else(|| Refusal::UnknownNic {
                nic: offer.server_nic.clone(),
            })?;
        let queue = QueuePair::create(&service.verbs, nic, &service.config)?;
        queue.connect(&remote, &service.config)?;
        endpoints.push(queue.wire_endpoint()?);
        queues.push(queue);
    }
    Ok((queues, endpoints))
}

async fn send(stream: &mut TcpStream, response: &ConnectResponse) -> Result<(), ServeFailure> {
    handshake::send(stream, response)
        .await
        .map_err(|error| ServeFailure::io("answering the peer", error))
}

/// Why serving one connection of the side channel failed: logged, and where it is a refusal,
/// sent back to the peer first.
#[derive(Debug, thiserror::Error)]
enum ServeFailure {
    /// The peer's request was refused, for this reason.
    #[error("{0}")]
    Refused(#[from] Refusal),
    /// Reading from or writing to the peer failed.
    #[error("{action} failed: {source}")]
    Io {
        /// What was being done.
        action: &'static str,
        /// The operating system's error.
        source: std::io::Error,
    },
    /// The peer did not prove it holds the engine's secret.
    #[error("authentication failed: {0}")]
    Unauthenticated(AuthFailure),
    /// The peer asked without a secret, and this engine requires one.
    #[error("this engine requires a shared secret: configure the same secret (FERRY_SECRET) on both engines")]
    SecretRequired,
    /// The connection does not start as a ferry RDMA request.
    #[error("the request opened with byte {byte}, not a ferry RDMA request")]
    NotARequest {
        /// The first byte.
        byte: u8,
    },
    /// The peer did not finish its request in time.
    #[error("the peer took longer than {after:?} to ask")]
    TimedOut {
        /// The limit.
        after: Duration,
    },
}

impl ServeFailure {
    /// The failure of `action` with the operating system's `error`.
    fn io(action: &'static str, source: std::io::Error) -> ServeFailure {
        ServeFailure::Io { action, source }
    }
}
