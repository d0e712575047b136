//! One client connection: a writer task that sends queued frames and a reader task that pumps
//! the listener's answers through the connection's [`ClientSession`], which matches them to
//! the frames. They decide nothing; the link planned every frame and the session checks
//! every answer.

use super::frame_io::FrameError;
use super::handshake::refusal_seen_as_frame;
use super::server::until;
use super::tracker::Ticket;
use super::FrameTags;
use crate::auth::Secret;
use crate::error::{AuthFailure, Error, Result};
use crate::memory::{RawSource, Span};
use crate::proto::{Answer, ClientSession, Closed, Request};
use crate::wire::seal::{self, Sealer};
use crate::wire::{self, Header, Hello, Limits};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio::task::AbortHandle;

/// A planned frame: header, body and where its answer lands.
pub(crate) struct Frame {
    pub(crate) header: Header,
    /// Body bytes before the data (write address, write-many table, read request).
    pub(crate) prefix: Vec<u8>,
    /// Local bytes sent after the prefix, in order.
    pub(crate) data: Vec<Span>,
    /// Where the answer of a read request lands.
    pub(crate) read_into: Option<Span>,
}

/// A frame queued on a connection, with the ticket its answer completes.
pub(crate) struct Outgoing {
    pub(crate) frame: Frame,
    pub(crate) ticket: Ticket,
}

/// A request sent on the connection and waiting for its answer.
struct Awaiting {
    read_into: Option<Span>,
    ticket: Ticket,
}

impl Request for Awaiting {
    type Span = Span;

    fn destination(&mut self) -> Option<&mut Span> {
        self.read_into.as_mut()
    }
}

type AwaitingMap = Arc<Mutex<HashMap<u64, Awaiting>>>;

/// A connection's write half and, on a sealed connection, what tags the frames sent on it.
type Sending = (OwnedWriteHalf, Option<Sealer>);

/// Set by the reader, before the connection is marked dead, when the listener refused this
/// engine for want of a shared secret: every frame of the connection then fails with that.
type Refused = Arc<OnceLock<AuthFailure>>;

/// One open connection to a peer's listener.
pub(crate) struct Connection {
    queue: mpsc::UnboundedSender<Outgoing>,
    alive: Arc<AtomicBool>,
    tasks: [AbortHandle; 2],
}

impl Connection {
    /// Connects, authenticates with the secret when set (its frames tagged as `frame_tags`
    /// says for this peer's address), introduces this engine with a hello, and starts the two
    /// tasks.
    pub(crate) async fn open(
        address: &str,
        peer: Arc<str>,
        local_name: &str,
        limits: Limits,
        io_timeout: Duration,
        (secret, frame_tags): (Option<&Secret>, FrameTags),
    ) -> Result<Connection> {
        let unreachable = |reason: String| Error::Unreachable {
            peer: peer.to_string(),
            reason,
        };
        let mut stream = tokio::time::timeout(io_timeout, TcpStream::connect(address))
            .await
            .map_err(|_| unreachable(format!("connecting to {address} took over {io_timeout:?}")))?
            .map_err(|error| unreachable(format!("connecting to {address} failed: {error}")))?;
        stream
            .set_nodelay(true)
            .map_err(|error| Error::io("setting TCP_NODELAY", error))?;
        let tag_frames = frame_tags.apply_to(stream.peer_addr());
        let keys =
            super::handshake::client(&mut stream, secret, tag_frames, &peer, io_timeout).await?;
        let mut sealer = keys.as_ref().map(|keys| Sealer::new(keys.send));
        let listener_key = keys.map(|keys| keys.receive);
        let (read_half, mut writer) = stream.into_split();
        let hello = wire::encode_hello(&Hello {
            name: local_name.to_owned(),
        });
        let header = Header::hello(&hello);
        write_frame(&mut writer, sealer.as_mut(), &header, &hello, &[])
            .await
            .map_err(|error| unreachable(format!("sending hello failed: {error}")))?;

        let (queue, receiver) = mpsc::unbounded_channel();
        let alive = Arc::new(AtomicBool::new(true));
        let awaiting: AwaitingMap = Arc::default();
        let refused: Refused = Arc::default();
        let writer_task = tokio::spawn(write_loop(
            (writer, sealer),
            receiver,
            Arc::clone(&awaiting),
            Arc::clone(&alive),
            Arc::clone(&refused),
            io_timeout,
            Arc::clone(&peer),
        ));
        let mut session = ClientSession::new(Arc::clone(&awaiting), limits, io_timeout);
        if let Some(key) = listener_key {
            session.seal(key);
        }
        let reader_task = tokio::spawn(read_loop(
            read_half,
            session,
            awaiting,
            Arc::clone(&alive),
            refused,
            peer,
        ));
        Ok(Connection {
            queue,
            alive,
            tasks: [writer_task.abort_handle(), reader_task.abort_handle()],
        })
    }

    /// Queues a frame. A dead connection drops it, which fails its ticket.
    pub(crate) fn send(&self, frame: Outgoing) {
        let _ = self.queue.send(frame);
    }

    pub(crate) fn is_alive(&self) -> bool {
        self.alive.load(Ordering::Acquire) && !self.queue.is_closed()
    }
}

impl Connection {
    /// Stops both tasks; frames in flight fail as their tickets drop.
    pub(crate) fn close(&self) {
        self.alive.store(false, Ordering::Release);
        for task in &self.tasks {
            task.abort();
        }
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        self.close();
    }
}

/// Marks the connection dead and fails everything waiting on it with `error()`.
///
/// `alive` is cleared before the map is drained, and the writer checks it under the map's lock
/// before adding a frame, so no frame can be added after the drain and wait forever.
fn fail_all(awaiting: &AwaitingMap, alive: &AtomicBool, error: impl Fn() -> Error) {
    alive.store(false, Ordering::Release);
    let drained: Vec<Awaiting> = awaiting
        .lock()
        .drain()
        .map(|(_, waiting)| waiting)
        .collect();
    for waiting in drained {
        waiting.ticket.complete(Err(error()));
    }
}

/// Sends header, prefix and data as one gathered write (several when the kernel takes less),
/// so block data goes from registered memory to the socket without a copy; on a sealed
/// connection with the frame's tags where [`crate::wire::seal`] puts them, hashed over the
/// data through a small owned scratch buffer rather than a slice of registered memory.
async fn write_frame(
    writer: &mut OwnedWriteHalf,
    sealer: Option<&mut Sealer>,
    header: &Header,
    prefix: &[u8],
    data: &[Span],
) -> std::io::Result<()> {
    let encoded = header.encode();
    let tags = sealer.map(|sealer| {
        sealer.begin(&encoded);
        sealer.update(prefix);
        let before_data = seal::tags_prefix(header.kind).then(|| sealer.prefix_tag());
        for span in data {
            span.source().digest(|bytes| sealer.update(bytes));
        }
        (before_data, sealer.finish())
    });
    let mut sources = Vec::with_capacity(4 + data.len());
    sources.push(RawSource::from_slice(&encoded));
    if !prefix.is_empty() {
        sources.push(RawSource::from_slice(prefix));
    }
    if let Some((Some(before_data), _)) = &tags {
        sources.push(RawSource::from_slice(before_data));
    }
    sources.extend(data.iter().map(Span::source));
    if let Some((_, last)) = &tags {
        sources.push(RawSource::from_slice(last));
    }
    RawSource::write_all(writer.as_ref(), &mut sources).await
}

async fn write_loop(
    (mut writer, mut sealer): Sending,
    mut queue: mpsc::UnboundedReceiver<Outgoing>,
    awaiting: AwaitingMap,
    alive: Arc<AtomicBool>,
    refused: Refused,
    io_timeout: Duration,
    peer: Arc<str>,
) {
    let gone = |reason: &str| match refused.get() {
        Some(failure) => Error::Unauthenticated {
            peer: peer.to_string(),
            reason: failure.clone(),
        },
        None => Error::PeerGone {
            peer: peer.to_string(),
            reason: reason.to_owned(),
        },
    };
    let reason = loop {
        let Some(frame) = queue.recv().await else {
            break "the link was closed".to_owned();
        };
        let Outgoing {
            frame:
                Frame {
                    header,
                    prefix,
                    mut data,
                    read_into,
                },
            ticket,
        } = frame;
        // GPU memory is copied into its staging buffers first; this connection waits for
        // the copy while the others keep their sockets busy.
        if let Err(error) = Span::load_all(&mut data).await {
            ticket.complete(Err(error));
            continue;
        }
        // Registered before the first byte goes out, so the fastest ack still finds it; refused
        // once the reader has given up, since no answer could ever arrive.
        {
            let mut waiting = awaiting.lock();
            if !alive.load(Ordering::Acquire) {
                drop(waiting);
                ticket.complete(Err(gone("the connection's reader stopped")));
                break "the connection's reader stopped".to_owned();
            }
            waiting.insert(header.id, Awaiting { read_into, ticket });
        }
        let send = write_frame(&mut writer, sealer.as_mut(), &header, &prefix, &data);
        match tokio::time::timeout(io_timeout, send).await {
            Ok(Ok(())) => {}
            Ok(Err(error)) => break format!("sending failed: {error}"),
            Err(_) => break format!("the peer accepted no data for {io_timeout:?}"),
        }
    };
    queue.close();
    while let Ok(frame) = queue.try_recv() {
        frame.ticket.complete(Err(gone(&reason)));
    }
    fail_all(&awaiting, &alive, || gone(&reason));
}

/// Why the reader stopped.
enum Stopped {
    /// The session ended, for this reason.
    Closed(Closed),
    /// Reading from the socket failed.
    Io(std::io::Error),
}

/// Pumps the socket and the timer into the connection's [`ClientSession`] and completes each
/// request as its answer says; every check of what the listener sent is the session's.
async fn read_loop(
    reader: OwnedReadHalf,
    mut session: ClientSession<Mutex<HashMap<u64, Awaiting>>>,
    awaiting: AwaitingMap,
    alive: Arc<AtomicBool>,
    refused: Refused,
    peer: Arc<str>,
) {
    let stopped = loop {
        while let Some(answer) = session.poll_event() {
            complete(answer, &peer).await;
        }
        if let Some(closed) = session.closed() {
            break Stopped::Closed(closed.clone());
        }
        let deadline = session.poll_timeout();
        let Some(mut target) = session.read_target() else {
            continue;
        };
        let read = until(deadline, target.read(reader.as_ref())).await;
        let now = Instant::now();
        match read {
            Some(Ok(0)) => session.handle_end(now),
            Some(Ok(len)) => session.handle_read(now, len),
            Some(Err(error)) => break Stopped::Io(error),
            None => session.handle_timeout(now),
        }
    };
    // A clean end between answers is no error worth a warning.
    let quiet = matches!(stopped, Stopped::Closed(Closed::Finished));
    let failure = match stopped {
        Stopped::Closed(Closed::Protocol(violation)) => FrameError::Protocol(violation),
        Stopped::Closed(Closed::Finished | Closed::EndedMidFrame) => {
            FrameError::Io(std::io::ErrorKind::UnexpectedEof.into())
        }
        Stopped::Closed(closed @ Closed::AnswerStalled(_)) => FrameError::Io(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            closed.to_string(),
        )),
        Stopped::Closed(Closed::Staging(error)) => FrameError::Io(std::io::Error::other(error)),
        Stopped::Closed(closed) => FrameError::Io(std::io::Error::other(closed.to_string())),
        Stopped::Io(error) => FrameError::Io(error),
    };
    if !quiet {
        tracing::warn!(%peer, error = %failure, "closing the connection to a peer");
    }
    // A listener that requires a secret answers a connection without one with its refusal.
    if let Some(reason) = refusal_seen_as_frame(&failure) {
        let _ = refused.set(reason);
    }
    fail_all(&awaiting, &alive, || match (&failure, refused.get()) {
        (_, Some(reason)) => Error::Unauthenticated {
            peer: peer.to_string(),
            reason: reason.clone(),
        },
        (FrameError::Protocol(violation), None) => Error::Protocol {
            peer: peer.to_string(),
            violation: violation.clone(),
        },
        (FrameError::Io(error), None) if error.kind() == std::io::ErrorKind::UnexpectedEof => {
            Error::PeerGone {
                peer: peer.to_string(),
                reason: "the peer closed the connection".into(),
            }
        }
        (FrameError::Io(error), None) => Error::PeerGone {
            peer: peer.to_string(),
            reason: error.to_string(),
        },
    });
}

/// Completes a request as the listener's answer says; a read's bytes count as arrived once
/// they are in the region (for GPU memory, once its staging buffer was copied there).
async fn complete(answer: Answer<Awaiting>, peer: &Arc<str>) {
    match answer {
        Answer::Acked { request, outcome } => {
            request
                .ticket
                .complete(outcome.map_err(|reason| Error::Rejected {
                    peer: peer.to_string(),
                    reason,
                }))
        }
        Answer::Arrived(Awaiting { read_into, ticket }) => {
            let mut spans: Vec<Span> = read_into.into_iter().collect();
            ticket.complete(Span::store_all(&mut spans).await);
        }
        Answer::Tampered { request, violation } => request.ticket.complete(Err(Error::Protocol {
            peer: peer.to_string(),
            violation,
        })),
    }
}
