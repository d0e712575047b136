//! The engine's listener: answers descriptor requests, lands writes, serves reads and takes
//! notifications. Every range is checked against the region table before a byte moves; a peer
//! that breaks the protocol loses its connection and nobody else notices.

use super::frame_io::{self, FrameError};
use crate::descriptor::SegmentDescriptor;
use crate::error::{ProtocolViolation, Side};
use crate::memory::{RegionTable, Span};
use crate::notify::Notification;
use crate::wire::{self, Header, Kind, Limits};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

/// What every served connection needs from the engine.
pub(crate) struct ServerContext {
    pub(crate) table: Arc<RegionTable>,
    pub(crate) inbox: mpsc::Sender<Notification>,
    pub(crate) descriptor: Box<dyn Fn() -> SegmentDescriptor + Send + Sync>,
    pub(crate) limits: Limits,
    pub(crate) io_timeout: Duration,
    /// When set, peers prove they hold it before they are served.
    pub(crate) secret: Option<crate::auth::Secret>,
}

/// Accepts connections until the engine's runtime shuts down.
pub(crate) async fn serve(listener: TcpListener, context: Arc<ServerContext>) {
    loop {
        match listener.accept().await {
            Ok((stream, address)) => {
                tokio::spawn(serve_connection(stream, address, Arc::clone(&context)));
            }
            Err(error) => {
                tracing::warn!(%error, "accepting a connection failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

async fn serve_connection(stream: TcpStream, address: SocketAddr, context: Arc<ServerContext>) {
    let Some(stream) =
        super::handshake::accept(stream, address, context.secret.as_ref(), context.io_timeout)
            .await
    else {
        return;
    };
    let _ = stream.set_nodelay(true);
    let (read_half, write_half) = stream.into_split();
    let mut session = Session {
        // Small enough that block-sized reads bypass it and land straight in registered memory.
        reader: BufReader::with_capacity(16 << 10, read_half),
        writer: BufWriter::with_capacity(64 << 10, write_half),
        peer: None,
        context,
    };
    match session.run().await {
        Ok(()) => tracing::debug!(%address, "connection closed by the peer"),
        Err(error) => tracing::error!(
            %address,
            peer = session.peer.as_deref().unwrap_or("(no hello)"),
            %error,
            "closing a connection"
        ),
    }
}

struct Session {
    reader: BufReader<OwnedReadHalf>,
    writer: BufWriter<OwnedWriteHalf>,
    /// The caller's segment name, from its hello.
    peer: Option<String>,
    context: Arc<ServerContext>,
}

impl Session {
    async fn run(&mut self) -> Result<(), FrameError> {
        loop {
            let next = frame_io::read_header(&mut self.reader, &self.context.limits);
            // A caller gets one timeout to introduce itself; after the hello, a connection may
            // idle between frames for as long as its peer keeps it.
            let header = if self.peer.is_none() {
                tokio::time::timeout(self.context.io_timeout, next)
                    .await
                    .map_err(|_| {
                        std::io::Error::new(std::io::ErrorKind::TimedOut, "no hello in time")
                    })??
            } else {
                next.await?
            };
            let Some(header) = header else {
                return Ok(());
            };
            let timeout = self.context.io_timeout;
            tokio::time::timeout(timeout, self.handle(header))
                .await
                .map_err(|_| {
                    std::io::Error::new(std::io::ErrorKind::TimedOut, "frame stalled")
                })??;
            if self.reader.buffer().is_empty() {
                self.writer.flush().await?;
            }
        }
    }

    async fn handle(&mut self, header: Header) -> Result<(), FrameError> {
        if self.peer.is_none() && header.kind != Kind::Hello {
            return Err(unexpected(header.kind, "before hello"));
        }
        match header.kind {
            Kind::Hello => {
                if self.peer.is_some() {
                    return Err(unexpected(header.kind, "twice on one connection"));
                }
                let body = frame_io::read_body(&mut self.reader, header.len).await?;
                self.peer = Some(wire::decode_hello(&body)?.name);
            }
            Kind::DescriptorRequest => {
                if header.len != 0 {
                    return Err(ProtocolViolation::TrailingBytes(header.len as usize).into());
                }
                let json = (self.context.descriptor)().to_json();
                self.respond(Kind::DescriptorResponse, header.id, &json)
                    .await?;
            }
            Kind::Write => self.handle_write(header).await?,
            Kind::WriteMany => self.handle_write_many(header).await?,
            Kind::ReadRequest => self.handle_read(header).await?,
            Kind::Notify => self.handle_notify(header).await?,
            Kind::DescriptorResponse | Kind::ReadData | Kind::Ack => {
                return Err(unexpected(header.kind, "at a listener"));
            }
        }
        Ok(())
    }

    async fn respond(&mut self, kind: Kind, id: u64, body: &[u8]) -> std::io::Result<()> {
        let header = Header {
            kind,
            id,
            len: body.len() as u32,
        };
        self.writer.write_all(&header.encode()).await?;
        self.writer.write_all(body).await
    }

    async fn ack(&mut self, id: u64, outcome: Result<(), String>) -> std::io::Result<()> {
        let body = wire::encode_ack(outcome.as_ref().map(|_| ()).map_err(String::as_str));
        self.respond(Kind::Ack, id, &body).await
    }

    fn rejection(addr: u64, len: u64, index: usize) -> String {
        crate::error::RangeError::NotRegistered {
            index,
            side: Side::Remote,
            addr,
            len,
        }
        .to_string()
    }

    async fn handle_write(&mut self, header: Header) -> Result<(), FrameError> {
        let mut raw = [0u8; 8];
        if header.len < 8 {
            return Err(ProtocolViolation::TooShort {
                what: "write address",
                needed: 8 - header.len as usize,
            }
            .into());
        }
        self.reader.read_exact(&mut raw).await?;
        let addr = u64::from_le_bytes(raw);
        let len = u64::from(header.len - 8);
        if len == 0 {
            return Err(ProtocolViolation::Malformed("zero-length write").into());
        }
        match self.span(addr, len) {
            Some(mut span) => {
                self.reader.read_exact(span.receive_into()?).await?;
                let stored = Span::store_all(std::slice::from_mut(&mut span))
                    .await
                    .map_err(|error| error.to_string());
                drop(span);
                self.ack(header.id, stored).await?;
            }
            None => {
                frame_io::discard(&mut self.reader, len).await?;
                self.ack(header.id, Err(Self::rejection(addr, len, 0)))
                    .await?;
            }
        }
        Ok(())
    }

    async fn handle_write_many(&mut self, header: Header) -> Result<(), FrameError> {
        let mut count = [0u8; 4];
        if header.len < 4 {
            return Err(ProtocolViolation::TooShort {
                what: "write-many count",
                needed: 4 - header.len as usize,
            }
            .into());
        }
        self.reader.read_exact(&mut count).await?;
        let table_len =
            wire::decode_write_many_count(count, header.len, self.context.limits.max_entries)?;
        let mut table = vec![0u8; table_len];
        self.reader.read_exact(&mut table).await?;
        let data_len = u64::from(header.len) - 4 - table_len as u64;
        let entries = wire::decode_write_many_table(&table, data_len)?;
        // Every entry is checked before the first byte lands: a frame is written whole or not at all.
        let mut spans = Vec::with_capacity(entries.len());
        for (index, entry) in entries.iter().enumerate() {
            match self.span(entry.addr, u64::from(entry.len)) {
                Some(span) => spans.push(span),
                None => {
                    drop(spans);
                    frame_io::discard(&mut self.reader, data_len).await?;
                    let reason = Self::rejection(entry.addr, u64::from(entry.len), index);
                    self.ack(header.id, Err(reason)).await?;
                    return Ok(());
                }
            }
        }
        for span in &mut spans {
            self.reader.read_exact(span.receive_into()?).await?;
        }
        let stored = Span::store_all(&mut spans)
            .await
            .map_err(|error| error.to_string());
        drop(spans);
        self.ack(header.id, stored).await?;
        Ok(())
    }

    async fn handle_read(&mut self, header: Header) -> Result<(), FrameError> {
        let body = frame_io::read_body(&mut self.reader, header.len).await?;
        let (addr, len) = wire::decode_read_request(&body)?;
        if len > self.context.limits.max_data {
            return Err(ProtocolViolation::Oversized {
                kind: "read-request",
                len: u64::from(len),
                limit: u64::from(self.context.limits.max_data),
            }
            .into());
        }
        match self.span(addr, u64::from(len)) {
            Some(mut span) => match Span::load_all(std::slice::from_mut(&mut span)).await {
                Ok(()) => {
                    self.respond(Kind::ReadData, header.id, span.as_slice())
                        .await?
                }
                Err(error) => self.ack(header.id, Err(error.to_string())).await?,
            },
            None => {
                self.ack(header.id, Err(Self::rejection(addr, u64::from(len), 0)))
                    .await?
            }
        }
        Ok(())
    }

    async fn handle_notify(&mut self, header: Header) -> Result<(), FrameError> {
        let payload = frame_io::read_body(&mut self.reader, header.len).await?;
        let from = self.peer.clone().unwrap_or_default();
        // Never wait for room: this connection also carries data, which must not stall
        // behind a receiver that stopped reading. The sender learns at once instead.
        // A slot is reserved first and the notification handed over only once the ack is on
        // the wire: a receiver that acts on it at once (and exits, say) never cuts the sender
        // off before its ack left.
        let context = Arc::clone(&self.context);
        let slot = context.inbox.try_reserve().map_err(|error| match error {
            mpsc::error::TrySendError::Full(()) => format!(
                "the receiver's notification inbox is full ({} unread); it must read its notifications before more can be delivered",
                context.inbox.max_capacity()
            ),
            mpsc::error::TrySendError::Closed(()) => {
                "the engine is shutting down and takes no notifications".to_owned()
            }
        });
        match slot {
            Ok(slot) => {
                let acked = match self.ack(header.id, Ok(())).await {
                    Ok(()) => self.writer.flush().await,
                    Err(error) => Err(error),
                };
                slot.send(Notification { from, payload });
                acked?;
            }
            Err(reason) => self.ack(header.id, Err(reason)).await?,
        }
        Ok(())
    }

    fn span(&self, addr: u64, len: u64) -> Option<Span> {
        let region = self.context.table.acquire(addr, len)?;
        Span::new(Arc::new(region), addr, len)
    }
}

fn unexpected(kind: Kind, context: &'static str) -> FrameError {
    ProtocolViolation::Unexpected {
        kind: kind.name(),
        context,
    }
    .into()
}
