//! A peer's set of TCP connections, and the planner that turns ops into frames.

use super::driver::{Connection, Frame, Outgoing};
use super::tracker::{Ticket, Tracker};
use super::{TcpConfig, TcpTransport};
use crate::error::{Error, Result};
use crate::memory::{RegionUse, Span};
use crate::transport::{Direction, Link, TransferOps};
use crate::wire::{self, Header, Kind, WriteManyEntry};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

/// Every connection this engine holds to one peer.
pub(crate) struct TcpLink {
    peer: Arc<str>,
    connections: Vec<Connection>,
    config: TcpConfig,
    /// Most entries the peer accepts in one write-many frame.
    max_entries: usize,
    next_connection: AtomicUsize,
    next_id: AtomicU64,
}

impl TcpLink {
    pub(crate) async fn connect(
        address: &str,
        peer: &str,
        transport: &TcpTransport,
    ) -> Result<Arc<TcpLink>> {
        let peer: Arc<str> = Arc::from(peer);
        let count = transport.config.connections.max(1);
        let mut connections = Vec::with_capacity(count);
        for _ in 0..count {
            connections.push(
                Connection::open(
                    address,
                    Arc::clone(&peer),
                    &transport.local_name,
                    transport.limits,
                    transport.io_timeout,
                    (transport.secret.as_ref(), transport.frame_tags),
                )
                .await?,
            );
        }
        let mut config = transport.config;
        config.slice_bytes = config.slice_bytes.clamp(1, transport.limits.max_data);
        config.pack_bytes = config.pack_bytes.min(transport.limits.max_data);
        Ok(Arc::new(TcpLink {
            peer,
            connections,
            config,
            max_entries: transport.limits.max_entries as usize,
            next_connection: AtomicUsize::new(0),
            next_id: AtomicU64::new(1),
        }))
    }

    /// Sends a notification and waits until the peer has queued it for its reader. Sent on the
    /// first connection only, so notifications keep their order.
    async fn queue_notification(&self, payload: &[u8]) -> Result<()> {
        let (tracker, done) = Tracker::new(1);
        let header = Header::for_body(
            Kind::Notify,
            self.next_id.fetch_add(1, Ordering::Relaxed),
            payload,
        );
        self.connections[0].send(Outgoing {
            frame: Frame {
                header,
                prefix: payload.to_vec(),
                data: Vec::new(),
                read_into: None,
            },
            ticket: Ticket::new(tracker, Arc::clone(&self.peer)),
        });
        self.wait(done).await
    }

    async fn wait(&self, done: tokio::sync::oneshot::Receiver<Result<()>>) -> Result<()> {
        done.await.unwrap_or_else(|_| {
            Err(Error::PeerGone {
                peer: self.peer.to_string(),
                reason: "the link was dropped".into(),
            })
        })
    }

    fn dispatch(&self, frame: Outgoing) {
        let index = self.next_connection.fetch_add(1, Ordering::Relaxed) % self.connections.len();
        self.connections[index].send(frame);
    }

    fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }
}

/// One slice of an op, at most `slice_bytes` long.
struct Piece {
    direction: Direction,
    region: Arc<RegionUse>,
    local_addr: u64,
    remote_addr: u64,
    len: u32,
}

fn slice(ops: &TransferOps, slice_bytes: u32) -> Vec<Piece> {
    let mut pieces = Vec::with_capacity(ops.len());
    for op in ops {
        let region = ops.region(op);
        let mut done = 0u64;
        while done < op.len {
            let len = (op.len - done).min(u64::from(slice_bytes)) as u32;
            pieces.push(Piece {
                direction: op.direction,
                region: Arc::clone(region),
                local_addr: op.local_addr + done,
                remote_addr: op.remote_addr + done,
                len,
            });
            done += u64::from(len);
        }
    }
    pieces
}

/// Frames being packed: small writes gathered into one write-many frame.
#[derive(Default)]
struct Pack {
    entries: Vec<WriteManyEntry>,
    data: Vec<Span>,
    bytes: u32,
}

impl TcpLink {
    fn span(&self, piece: &Piece) -> Result<Span> {
        Span::new(Arc::clone(&piece.region), piece.local_addr, u64::from(piece.len)).ok_or_else(
            || Error::ApiMisuse(format!(
                "local range {:#x}..+{} is not inside its region, or is GPU memory for which no pinned staging buffer could be had",
                piece.local_addr, piece.len
            )),
        )
    }

    /// Turns pieces into frames; returns them without sending, so a bad piece sends nothing.
    fn plan(&self, pieces: Vec<Piece>) -> Result<Vec<Frame>> {
        let mut frames = Vec::new();
        let mut pack = Pack::default();
        let flush = |pack: &mut Pack, frames: &mut Vec<_>| {
            if pack.entries.is_empty() {
                return;
            }
            let Pack {
                entries,
                data,
                bytes,
            } = std::mem::take(pack);
            let prefix = wire::encode_write_many_table(&entries);
            let header = Header::new(Kind::WriteMany, self.next_id(), prefix.len() as u32 + bytes);
            frames.push(Frame {
                header,
                prefix,
                data,
                read_into: None,
            });
        };
        for piece in pieces {
            let span = self.span(&piece)?;
            match piece.direction {
                Direction::Read => {
                    let prefix = wire::encode_read_request(piece.remote_addr, piece.len).to_vec();
                    let header = Header::new(Kind::ReadRequest, self.next_id(), 12);
                    frames.push(Frame {
                        header,
                        prefix,
                        data: Vec::new(),
                        read_into: Some(span),
                    });
                }
                Direction::Write if piece.len < self.config.pack_below => {
                    if pack.bytes + piece.len > self.config.pack_bytes
                        || pack.entries.len() >= self.max_entries
                    {
                        flush(&mut pack, &mut frames);
                    }
                    pack.entries.push(WriteManyEntry {
                        addr: piece.remote_addr,
                        len: piece.len,
                    });
                    pack.data.push(span);
                    pack.bytes += piece.len;
                }
                Direction::Write => {
                    let header = Header::new(Kind::Write, self.next_id(), 8 + piece.len);
                    frames.push(Frame {
                        header,
                        prefix: piece.remote_addr.to_le_bytes().to_vec(),
                        data: vec![span],
                        read_into: None,
                    });
                }
            }
        }
        flush(&mut pack, &mut frames);
        Ok(frames)
    }
}

#[async_trait::async_trait]
impl Link for TcpLink {
    async fn transfer(&self, ops: TransferOps) -> Result<()> {
        let frames = self.plan(slice(&ops, self.config.slice_bytes))?;
        // The frames' spans hold the regions they touch from here on.
        drop(ops);
        let (tracker, done) = Tracker::new(frames.len());
        for frame in frames {
            self.dispatch(Outgoing {
                frame,
                ticket: Ticket::new(Arc::clone(&tracker), Arc::clone(&self.peer)),
            });
        }
        drop(tracker);
        self.wait(done).await
    }

    async fn notify(&self, payload: &[u8]) -> Result<()> {
        self.queue_notification(payload).await
    }

    fn is_alive(&self) -> bool {
        self.connections.iter().all(Connection::is_alive)
    }

    fn close(&self) {
        for connection in &self.connections {
            connection.close();
        }
    }
}
