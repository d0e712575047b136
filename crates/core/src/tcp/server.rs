//! The engine's listener: admits connections through its [`Admission`] ledger and runs each
//! one's [`ServerSession`] with a small task that moves bytes and time in and out of it and
//! does the work its events ask for. Every protocol decision is the session's; a peer that
//! breaks the protocol loses its connection and nobody else notices.

use super::admission::{Admission, AdmissionLimits, Refused, Ticket};
use crate::descriptor::SegmentDescriptor;
use crate::error::Refusal;
use crate::memory::{RawDestination, RawSource, RegionTable, Span};
use crate::notify::{Inbox, Notification, Room};
use crate::proto::{Closed, Event, Landing, Served, ServerSession, SessionConfig};
use crate::telemetry::{self, Throttle};
use parking_lot::Mutex;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;

/// What every served connection needs from the engine.
pub(crate) struct ServerContext {
    pub(crate) table: Arc<RegionTable>,
    pub(crate) inbox: Inbox,
    pub(crate) descriptor: Box<dyn Fn() -> SegmentDescriptor + Send + Sync>,
    pub(crate) session: SessionConfig,
    /// How many authenticated and unauthenticated connections are kept.
    pub(crate) admission: AdmissionLimits,
    /// When set, peers prove they hold it before they are served.
    pub(crate) secret: Option<crate::auth::Secret>,
}

impl Served for ServerContext {
    type Span = Span;

    fn span(&self, addr: u64, len: u64) -> Option<Span> {
        let region = self.table.acquire(addr, len)?;
        Span::new(Arc::new(region), addr, len)
    }

    fn descriptor(&self) -> Vec<u8> {
        (self.descriptor)().to_json()
    }
}

impl Landing for Span {
    fn len(&self) -> usize {
        Span::len(self)
    }

    fn destination(&mut self) -> Result<RawDestination<'_>, crate::Error> {
        Span::destination(self)
    }

    fn source(&self) -> RawSource<'_> {
        Span::source(self)
    }
}

/// How often, at most, the listener warns that it evicts unauthenticated connections.
const EVICTION_WARNING_EVERY: Duration = Duration::from_secs(10);

/// The listener's [`Admission`] ledger, each stranger kept with the sender that closes it.
struct Gate {
    admission: Admission<oneshot::Sender<()>>,
    evictions_logged: Throttle,
}

impl Gate {
    /// Admits a connection from `source` as a stranger, closing the stranger it evicts.
    fn arrive(&mut self, source: IpAddr) -> (Ticket, oneshot::Receiver<()>) {
        let (close, closed) = oneshot::channel();
        let (ticket, evicted) = self.admission.arrive(source, close);
        if let Some((_, close)) = evicted {
            let _ = close.send(());
            if let Some(evicted) = self.evictions_logged.due() {
                tracing::warn!(
                    %source,
                    evicted,
                    "closing unauthenticated connections to admit newer ones: something opens connections that do not authenticate (EngineBuilder::max_unauthenticated)"
                );
            }
        }
        (ticket, closed)
    }
}

/// One accepted connection's place in the gate; gives it back when dropped.
struct Admitted {
    gate: Arc<Mutex<Gate>>,
    ticket: Ticket,
    /// Fires when the gate evicts this connection; `None` once it is a peer.
    evicted: Option<oneshot::Receiver<()>>,
}

impl Admitted {
    /// Makes this connection a peer; `false` (with a log line) when the peers' cap is full or
    /// it was evicted meanwhile.
    fn promote(&mut self, address: SocketAddr, limit: usize) -> bool {
        match self.gate.lock().admission.promote(self.ticket) {
            Ok(()) => {
                self.evicted = None;
                true
            }
            Err(Refused::PeersFull) => {
                tracing::warn!(
                    %address,
                    limit,
                    "refusing a connection: the engine already serves its maximum number of connections (EngineBuilder::max_connections)"
                );
                false
            }
            Err(Refused::NotWaiting) => false,
        }
    }

    /// Resolves when the gate evicts this connection; never once it is a peer.
    async fn evicted(&mut self) {
        match self.evicted.as_mut() {
            // An error means the gate forgot the connection without evicting it: wait forever.
            Some(evicted) => {
                if evicted.await.is_err() {
                    std::future::pending::<()>().await;
                }
            }
            None => std::future::pending::<()>().await,
        }
    }
}

impl Drop for Admitted {
    fn drop(&mut self) {
        let mut gate = self.gate.lock();
        match self.evicted {
            None => gate.admission.peer_left(),
            Some(_) => gate.admission.stranger_left(self.ticket),
        }
    }
}

/// Accepts connections until the engine's runtime shuts down.
pub(crate) async fn serve(listener: TcpListener, context: Arc<ServerContext>) {
    let gate = Arc::new(Mutex::new(Gate {
        admission: Admission::new(context.admission),
        evictions_logged: Throttle::new(EVICTION_WARNING_EVERY),
    }));
    loop {
        match listener.accept().await {
            Ok((stream, address)) => {
                let (ticket, evicted) = gate.lock().arrive(address.ip());
                let admitted = Admitted {
                    gate: Arc::clone(&gate),
                    ticket,
                    evicted: Some(evicted),
                };
                tokio::spawn(serve_connection(
                    stream,
                    address,
                    Arc::clone(&context),
                    admitted,
                ));
            }
            Err(error) => {
                tracing::warn!(%error, "accepting a connection failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// Runs one accepted connection to its end and logs why it ended.
async fn serve_connection(
    stream: TcpStream,
    address: SocketAddr,
    context: Arc<ServerContext>,
    mut admitted: Admitted,
) {
    // The hello's deadline runs from the accept: a caller that stays silent through the
    // handshake's wait does not get a second full wait for its hello.
    let accepted = Instant::now();
    let handshake = super::handshake::accept(
        stream,
        address,
        context.secret.as_ref(),
        context.session.hello_timeout,
    );
    let stream = tokio::select! {
        stream = handshake => stream,
        () = admitted.evicted() => {
            tracing::debug!(%address, "closed an unauthenticated connection to admit a newer one");
            return;
        }
    };
    let Some((stream, keys)) = stream else {
        return;
    };
    if context.secret.is_some() && !admitted.promote(address, context.admission.peers) {
        return;
    }
    let _ = stream.set_nodelay(true);
    let mut session = ServerSession::new(Arc::clone(&context), context.session, accepted);
    if let Some(keys) = keys {
        session.seal(keys);
    }
    let mut driver = Driver {
        stream,
        session,
        context,
        admitted,
        address,
    };
    let ended = driver.run().await;
    let peer = driver.session.peer().unwrap_or("(no hello)");
    match ended {
        Ok(Ended::Closed(Closed::Finished)) => {
            tracing::debug!(%address, peer, "connection closed by the peer")
        }
        Ok(Ended::Closed(closed @ Closed::Idle(_))) => {
            tracing::info!(%address, peer, reason = %closed, "closing an idle connection")
        }
        Ok(Ended::Closed(closed)) => {
            tracing::error!(%address, peer, error = %closed, "closing a connection")
        }
        Ok(Ended::Evicted) => {
            tracing::debug!(%address, "closed a connection without a hello to admit a newer one")
        }
        Ok(Ended::Refused) => {}
        Err(error) => tracing::error!(%address, peer, %error, "closing a connection"),
    }
}

/// Why [`Driver::run`] stopped.
enum Ended {
    /// The session ended.
    Closed(Closed),
    /// The gate evicted the connection before its hello.
    Evicted,
    /// The connection said hello when the peers' cap was full.
    Refused,
}

/// Pumps one connection's socket, timer and events through its session.
struct Driver {
    stream: TcpStream,
    session: ServerSession<ServerContext>,
    context: Arc<ServerContext>,
    admitted: Admitted,
    address: SocketAddr,
}

impl Driver {
    async fn run(&mut self) -> std::io::Result<Ended> {
        loop {
            let deliveries = self.handle_events().await;
            // Handed over only once their answers are on the wire (see `Event::Notify`): a
            // sender whose ack was lost may send again, and must not be delivered twice.
            self.transmit().await?;
            for (room, notification) in deliveries {
                room.deliver(notification);
            }
            if let Some(closed) = self.session.closed() {
                return Ok(Ended::Closed(closed.clone()));
            }
            // Without a secret, a connection becomes a peer with its hello.
            if self.admitted.evicted.is_some()
                && self.session.peer().is_some()
                && !self
                    .admitted
                    .promote(self.address, self.context.admission.peers)
            {
                return Ok(Ended::Refused);
            }
            // Writing answers may have let the session take the next buffered frame.
            if self.session.has_event() {
                continue;
            }
            let deadline = self.session.poll_timeout();
            let Some(mut target) = self.session.read_target() else {
                continue;
            };
            let read = tokio::select! {
                read = until(deadline, target.read(&self.stream)) => read,
                () = self.admitted.evicted() => return Ok(Ended::Evicted),
            };
            let now = Instant::now();
            match read {
                Some(Ok(0)) => self.session.handle_end(now),
                Some(Ok(len)) => self.session.handle_read(now, len),
                Some(Err(error)) => return Err(error),
                None => self.session.handle_timeout(now),
            }
        }
    }

    /// Does what the session's events ask; returns the notifications to hand over once their
    /// answers have been written (several frames may arrive in one read).
    async fn handle_events(&mut self) -> Vec<(Room, Notification)> {
        let mut deliveries = Vec::new();
        while let Some(event) = self.session.poll_event() {
            // Staging copies are awaited to their end, never cut short by the session's timer:
            // dropping one half-way would free staging buffers under a running GPU copy.
            match event {
                Event::Store(mut spans) => {
                    let stored = Span::store_all(&mut spans)
                        .await
                        .map_err(|error| Refusal::Other(error.to_string()));
                    if stored.is_ok() {
                        let bytes = spans.iter().map(|span| span.len() as u64).sum();
                        telemetry::served(super::TCP, "write", bytes);
                    }
                    drop(spans);
                    self.session.handle_stored(Instant::now(), stored);
                }
                Event::Load(mut span) => {
                    let loaded = Span::load_all(std::slice::from_mut(&mut span))
                        .await
                        .map_err(|error| Refusal::Other(error.to_string()));
                    if loaded.is_ok() {
                        telemetry::served(super::TCP, "read", span.len() as u64);
                    }
                    self.session.handle_loaded(Instant::now(), span, loaded);
                }
                Event::Notify(payload) => {
                    let from = self.session.peer().unwrap_or_default().to_owned();
                    match self.context.inbox.reserve(&from, &payload) {
                        Ok(room) => {
                            self.session.handle_delivery(Instant::now(), Ok(()));
                            deliveries.push((room, Notification { from, payload }));
                        }
                        Err(refusal) => self.session.handle_delivery(
                            Instant::now(),
                            Err(Refusal::Other(refusal.to_string())),
                        ),
                    }
                }
            }
        }
        deliveries
    }

    /// Writes every queued answer, within the session's timer.
    async fn transmit(&mut self) -> std::io::Result<()> {
        loop {
            let deadline = self.session.poll_timeout();
            let Some(bytes) = self.session.poll_transmit() else {
                return Ok(());
            };
            let written = until(deadline, RawSource::write(&self.stream, &[bytes])).await;
            let now = Instant::now();
            match written {
                Some(Ok(0)) => return Err(std::io::ErrorKind::WriteZero.into()),
                Some(Ok(len)) => self.session.handle_transmitted(now, len),
                Some(Err(error)) => return Err(error),
                None => self.session.handle_timeout(now),
            }
        }
    }
}

/// `work`, unless `deadline` passes first (`None`).
pub(super) async fn until<T>(
    deadline: Option<Instant>,
    work: impl Future<Output = T>,
) -> Option<T> {
    match deadline {
        Some(deadline) => tokio::time::timeout_at(deadline.into(), work).await.ok(),
        None => Some(work.await),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::descriptor::{HostIdentity, DESCRIPTOR_VERSION};
    use crate::memory::{Location, OwnedBuffer, OwnedMemory, RegionInfo};
    use crate::proto::test_memory::test_config;
    use crate::wire::{self, Header, Hello, Kind, HEADER_LEN};

    fn context() -> Arc<ServerContext> {
        let (inbox, _receiver, _held) = Inbox::new(4, 1 << 20);
        Arc::new(ServerContext {
            table: RegionTable::new(),
            inbox,
            descriptor: Box::new(|| SegmentDescriptor {
                version: DESCRIPTOR_VERSION,
                name: "test".into(),
                host: HostIdentity::current(),
                generation: 0,
                instance: crate::InstanceId::from_u128(1),
                process: crate::InstanceId::from_u128(1),
                pid: 0,
                endpoints: Vec::new(),
                gpus: Vec::new(),
                buffers: Vec::new(),
                signature: None,
            }),
            session: test_config(),
            admission: AdmissionLimits {
                peers: 1,
                strangers: 1,
                strangers_per_source: 1,
            },
            secret: None,
        })
    }

    fn feed(session: &mut ServerSession<ServerContext>, now: Instant, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            let mut target = session.read_target().expect("the session reads");
            let len = target.fill(bytes);
            session.handle_read(now, len);
            bytes = &bytes[len..];
        }
    }

    #[test]
    fn block_sized_write_data_is_read_straight_into_registered_memory() {
        let context = context();
        let buffer = OwnedBuffer::zeroed(1 << 20).unwrap();
        let addr = buffer.addr();
        let info = RegionInfo {
            addr,
            len: 1 << 20,
            location: Location::Host { pinned: false },
        };
        let region = context
            .table
            .insert(
                info,
                Vec::new(),
                Vec::new(),
                Some(OwnedMemory::Host { _buffer: buffer }),
            )
            .unwrap();
        let now = Instant::now();
        let mut session = ServerSession::new(Arc::clone(&context), context.session, now);
        let hello = wire::encode_hello(&Hello {
            name: "peer".into(),
        });
        let mut bytes = Header::hello(&hello).encode().to_vec();
        bytes.extend_from_slice(&hello);
        let data: Vec<u8> = (0..64 << 10).map(|index| (index % 251) as u8).collect();
        bytes.extend_from_slice(&Header::new(Kind::Write, 9, 8 + data.len() as u32).encode());
        bytes.extend_from_slice(&(addr + 4096).to_le_bytes());
        feed(&mut session, now, &bytes);

        let mut target = session.read_target().unwrap();
        assert_eq!(
            target.next_addr(),
            addr + 4096,
            "the data is read into the registered memory itself"
        );
        assert_eq!(target.remaining(), data.len());
        target.fill(&data);
        session.handle_read(now, data.len());
        let Some(Event::Store(spans)) = session.poll_event() else {
            panic!("a complete write asks for its bytes to be stored");
        };
        drop(spans);
        session.handle_stored(now, Ok(()));
        let answer = session.poll_transmit().unwrap();
        let mut raw = [0u8; HEADER_LEN];
        assert_eq!(answer.copy_to(&mut raw), HEADER_LEN);
        let ack = Header::decode(&raw, &wire::Limits::default()).unwrap();
        assert_eq!((ack.kind, ack.id, ack.len), (Kind::Ack, 9, 0));
        let mut landed = vec![0u8; data.len()];
        region.read_at(4096, &mut landed).unwrap();
        assert_eq!(landed, data);
    }
}
