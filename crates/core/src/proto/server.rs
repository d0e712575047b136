//! The listener's side of one connection: hello, frame by frame, each request answered in order.

use super::input::Input;
use super::output::Output;
use crate::cuda::CudaError;
use crate::error::{ProtocolViolation, RangeError, Side};
use crate::wire::{self, Header, Kind, Limits, HEADER_LEN};
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A range of the served engine's memory while bytes move through it.
pub(crate) trait Landing {
    /// Length in bytes.
    fn len(&self) -> usize;
    /// Where received bytes go; for GPU memory a staging buffer, taken on the first call.
    fn receive_into(&mut self) -> Result<&mut [u8], CudaError>;
    /// The bytes to send, once loaded.
    fn as_slice(&self) -> &[u8];
}

/// What a session needs from the engine it serves.
pub(crate) trait Served {
    /// The memory ranges this engine hands out.
    type Span: Landing;
    /// The registered range `addr..addr+len`, kept registered while the span lives; `None`
    /// when no single registration covers it.
    fn span(&self, addr: u64, len: u64) -> Option<Self::Span>;
    /// The engine's descriptor as JSON.
    fn descriptor(&self) -> Vec<u8>;
}

/// Limits and timeouts of a session.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SessionConfig {
    /// Body size limits, checked at each header.
    pub(crate) limits: Limits,
    /// Bounds the hello, each frame from its first byte to its answer, and how long the peer
    /// may leave queued answers unread.
    pub(crate) io_timeout: Duration,
    /// How long a connection may sit between frames after its hello.
    pub(crate) idle_timeout: Duration,
}

/// Work the driver must do before the session reads on.
pub(crate) enum Event<S> {
    /// A write's bytes were received into these spans: make them visible in memory (copy GPU
    /// staging buffers to the GPU), drop the spans, then call
    /// [`ServerSession::handle_stored`].
    Store(Vec<S>),
    /// A read asks for this span: load its bytes (copy GPU memory into its staging buffer),
    /// then give it back with [`ServerSession::handle_loaded`].
    Load(S),
    /// A notification arrived: offer it to the inbox, then call
    /// [`ServerSession::handle_delivery`]. Hand it to the reader only once the answer queued
    /// by that call has been written, so a reader that acts on it at once cannot cut the
    /// sender off before its answer left.
    Notify(Vec<u8>),
}

/// Why a session ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Closed {
    /// The peer closed the connection between frames.
    Finished,
    /// The peer broke the protocol.
    Protocol(ProtocolViolation),
    /// The peer closed the connection in the middle of a frame.
    EndedMidFrame,
    /// No hello arrived within the limit.
    NoHello(Duration),
    /// A frame was not complete within the limit of its first byte.
    Stalled(Duration),
    /// No frame arrived within the idle timeout.
    Idle(Duration),
    /// The peer read none of its answers within the limit.
    NotReading(Duration),
    /// GPU memory could not be staged, so the rest of the frame had nowhere to go.
    Staging(CudaError),
}

impl fmt::Display for Closed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Closed::Finished => f.write_str("the peer closed the connection"),
            Closed::Protocol(violation) => write!(f, "{violation}"),
            Closed::EndedMidFrame => {
                f.write_str("the peer closed the connection in the middle of a frame")
            }
            Closed::NoHello(limit) => write!(f, "no hello within {limit:?}"),
            Closed::Stalled(limit) => {
                write!(f, "a frame was not complete within {limit:?} of its first byte")
            }
            Closed::Idle(limit) => write!(
                f,
                "no frame for {limit:?} (the engine's idle timeout); the peer reconnects when it needs to"
            ),
            Closed::NotReading(limit) => {
                write!(f, "the peer read none of its answers for {limit:?}")
            }
            Closed::Staging(error) => write!(f, "no staging buffer for GPU memory: {error}"),
        }
    }
}

/// What the bytes being collected are, with the header of the frame they belong to.
#[derive(Debug, Clone, Copy)]
enum Part {
    Header,
    Hello,
    Body(Header),
    WriteAddress(Header),
    WriteManyCount(Header),
    WriteManyTable(Header),
}

/// Where the session is within the current frame.
enum State<S> {
    /// Collecting `need` bytes into the scratch buffer.
    Collect { part: Part, need: usize },
    /// Receiving a write's data into its spans.
    Land {
        id: u64,
        spans: Vec<S>,
        index: usize,
        filled: usize,
    },
    /// Throwing away the data of a refused write, then answering with `reason`.
    Discard { id: u64, left: u64, reason: String },
    /// Waiting for the driver to answer the event about request `id`.
    Waiting { id: u64 },
}

impl<S> State<S> {
    fn header() -> Self {
        State::Collect {
            part: Part::Header,
            need: HEADER_LEN,
        }
    }
}

/// The listener's protocol state for one connection. See the [module docs](super) for the
/// call order.
pub(crate) struct ServerSession<M: Served> {
    served: Arc<M>,
    config: SessionConfig,
    state: State<M::Span>,
    /// Bytes of the part being collected.
    scratch: Vec<u8>,
    input: Input,
    /// Whether the last read target handed out was the current span itself.
    direct: bool,
    output: Output<M::Span>,
    event: Option<Event<M::Span>>,
    /// The caller's segment name, from its hello.
    peer: Option<String>,
    accepted: Instant,
    /// When the first byte of the current frame arrived.
    frame_started: Option<Instant>,
    /// When the last frame was answered (or the hello arrived).
    last_frame: Instant,
    /// When queued answers last made progress.
    output_since: Option<Instant>,
    /// The peer closed its side.
    ended: bool,
    closed: Option<Closed>,
}

impl<M: Served> ServerSession<M> {
    /// A session for a connection accepted at `now`.
    pub(crate) fn new(served: Arc<M>, config: SessionConfig, now: Instant) -> Self {
        ServerSession {
            served,
            config,
            state: State::header(),
            scratch: Vec::with_capacity(HEADER_LEN),
            input: Input::new(),
            direct: false,
            output: Output::new(),
            event: None,
            peer: None,
            accepted: now,
            frame_started: None,
            last_frame: now,
            output_since: None,
            ended: false,
            closed: None,
        }
    }

    /// The caller's segment name as it introduced itself, once it has.
    pub(crate) fn peer(&self) -> Option<&str> {
        self.peer.as_deref()
    }

    /// Why the session ended, once it has. Answers queued before the end are still offered by
    /// [`Self::poll_transmit`] (and given up on by [`Self::handle_timeout`] when the peer reads
    /// none of them in time).
    pub(crate) fn closed(&self) -> Option<&Closed> {
        self.closed.as_ref()
    }

    /// The next piece of work for the driver.
    pub(crate) fn poll_event(&mut self) -> Option<Event<M::Span>> {
        self.event.take()
    }

    /// The next bytes to write to the peer.
    pub(crate) fn poll_transmit(&self) -> Option<&[u8]> {
        self.output.front()
    }

    /// When [`Self::handle_timeout`] must be called if nothing else happens first.
    pub(crate) fn poll_timeout(&self) -> Option<Instant> {
        let io = self.config.io_timeout;
        if self.closed.is_some() {
            return self.output_since.map(|since| since + io);
        }
        let mut deadlines = Vec::with_capacity(3);
        if self.peer.is_none() {
            deadlines.push(self.accepted + io);
        }
        match self.frame_started {
            Some(started) => deadlines.push(started + io),
            None if self.peer.is_some() && self.output.is_empty() => {
                deadlines.push(self.last_frame + self.config.idle_timeout)
            }
            None => {}
        }
        if let Some(since) = self.output_since {
            deadlines.push(since + io);
        }
        deadlines.into_iter().min()
    }

    /// Closes the session if a limit has passed at `now`.
    pub(crate) fn handle_timeout(&mut self, now: Instant) {
        let io = self.config.io_timeout;
        let passed = |since: Instant, limit: Duration| now >= since + limit;
        if self.closed.is_some() {
            // Answers still queued when the session ended are given up on once the peer has
            // read none of them for the limit.
            if self.output_since.is_some_and(|since| passed(since, io)) {
                self.output = Output::new();
                self.output_since = None;
            }
            return;
        }
        let closed = if self.peer.is_none() && passed(self.accepted, io) {
            Closed::NoHello(io)
        } else if self
            .frame_started
            .is_some_and(|started| passed(started, io))
        {
            Closed::Stalled(io)
        } else if self.output_since.is_some_and(|since| passed(since, io)) {
            Closed::NotReading(io)
        } else if self.peer.is_some()
            && self.frame_started.is_none()
            && self.output.is_empty()
            && passed(self.last_frame, self.config.idle_timeout)
        {
            Closed::Idle(self.config.idle_timeout)
        } else {
            return;
        };
        self.close(closed);
    }

    /// Where the driver should read the peer's next bytes; `None` while the session waits for
    /// an event's answer or has ended, when it must not read.
    pub(crate) fn read_target(&mut self) -> Option<&mut [u8]> {
        if self.closed.is_some() || self.ended || matches!(self.state, State::Waiting { .. }) {
            return None;
        }
        self.direct = false;
        if self.input.is_empty() {
            if let State::Land {
                spans,
                index,
                filled,
                ..
            } = &mut self.state
            {
                let start = *filled;
                if let Some(span) = spans.get_mut(*index) {
                    if span.len() - start >= Input::CAPACITY {
                        if let Ok(destination) = span.receive_into() {
                            self.direct = true;
                            return destination.get_mut(start..);
                        }
                    }
                }
            }
        }
        Some(self.input.free())
    }

    /// `len` bytes were read into the last [`Self::read_target`].
    pub(crate) fn handle_read(&mut self, now: Instant, len: usize) {
        if std::mem::take(&mut self.direct) {
            if let State::Land { filled, .. } = &mut self.state {
                *filled += len;
            }
        } else {
            self.input.filled(len);
        }
        self.process(now);
    }

    /// The peer closed its side of the connection.
    pub(crate) fn handle_end(&mut self, now: Instant) {
        self.ended = true;
        self.process(now);
    }

    /// `len` bytes of [`Self::poll_transmit`] were written.
    pub(crate) fn handle_transmitted(&mut self, now: Instant, len: usize) {
        self.output.advance(len);
        if self.output.is_empty() {
            self.output_since = None;
        } else if len > 0 {
            self.output_since = Some(now);
        }
    }

    /// Answers [`Event::Store`]: whether the bytes are in memory, or why not.
    pub(crate) fn handle_stored(&mut self, now: Instant, outcome: Result<(), String>) {
        if let State::Waiting { id } = self.state {
            self.ack(now, id, outcome);
            self.finish_frame(now);
            self.process(now);
        }
    }

    /// Answers [`Event::Load`] with its span, loaded or not.
    pub(crate) fn handle_loaded(
        &mut self,
        now: Instant,
        span: M::Span,
        outcome: Result<(), String>,
    ) {
        if let State::Waiting { id } = self.state {
            match outcome {
                Ok(()) => {
                    let header = Header {
                        kind: Kind::ReadData,
                        id,
                        len: u32::try_from(span.len()).unwrap_or(u32::MAX),
                    };
                    self.queue(now, |output| output.frame_from(header, span));
                }
                Err(reason) => self.ack(now, id, Err(reason)),
            }
            self.finish_frame(now);
            self.process(now);
        }
    }

    /// Answers [`Event::Notify`]: taken into the inbox, or why not.
    pub(crate) fn handle_delivery(&mut self, now: Instant, outcome: Result<(), String>) {
        self.handle_stored(now, outcome);
    }

    /// Bytes the session holds for the peer: buffers and queued answers, not the spans.
    #[cfg(any(test, fuzzing))]
    pub(crate) fn held_bytes(&self) -> usize {
        Input::CAPACITY + self.scratch.capacity() + self.output.queued()
    }

    fn close(&mut self, reason: Closed) {
        if self.closed.is_none() {
            self.closed = Some(reason);
            self.state = State::header();
            self.event = None;
        }
    }

    fn queue(&mut self, now: Instant, add: impl FnOnce(&mut Output<M::Span>)) {
        if self.output.is_empty() {
            self.output_since = Some(now);
        }
        add(&mut self.output);
    }

    fn ack(&mut self, now: Instant, id: u64, outcome: Result<(), String>) {
        let body = wire::encode_ack(outcome.as_ref().map(|_| ()).map_err(String::as_str));
        let header = Header {
            kind: Kind::Ack,
            id,
            len: body.len() as u32,
        };
        self.queue(now, |output| output.frame(header, &body));
    }

    fn finish_frame(&mut self, now: Instant) {
        self.scratch.clear();
        self.state = State::header();
        self.frame_started = None;
        self.last_frame = now;
    }

    fn collect(&mut self, part: Part, need: usize) {
        self.scratch.clear();
        self.state = State::Collect { part, need };
    }

    /// Handles everything buffered, until more bytes or an event's answer are needed.
    fn process(&mut self, now: Instant) {
        while self.closed.is_none() && self.event.is_none() {
            let progressed = match &mut self.state {
                State::Waiting { .. } => false,
                State::Collect { part, need } => {
                    let (part, need) = (*part, *need);
                    let bytes = self.input.take(need - self.scratch.len());
                    if matches!(part, Part::Header) && self.scratch.is_empty() && !bytes.is_empty()
                    {
                        self.frame_started = Some(now);
                    }
                    self.scratch.extend_from_slice(bytes);
                    if self.scratch.len() < need {
                        false
                    } else {
                        if let Err(violation) = self.collected(now, part) {
                            self.close(Closed::Protocol(violation));
                        }
                        true
                    }
                }
                State::Land {
                    spans,
                    index,
                    filled,
                    ..
                } => match land(&mut self.input, spans, index, filled) {
                    Ok(progressed) => progressed,
                    Err(error) => {
                        self.close(Closed::Staging(error));
                        false
                    }
                },
                State::Discard { left, .. } => {
                    let dropped = self
                        .input
                        .take(usize::try_from(*left).unwrap_or(usize::MAX));
                    *left -= dropped.len() as u64;
                    !dropped.is_empty() || *left == 0
                }
            };
            self.finish_data(now);
            if !progressed {
                break;
            }
        }
        if self.ended && self.closed.is_none() && self.event.is_none() {
            let between_frames = matches!(
                self.state,
                State::Collect {
                    part: Part::Header,
                    ..
                }
            ) && self.scratch.is_empty();
            match self.state {
                State::Waiting { .. } => {}
                _ if between_frames => self.close(Closed::Finished),
                _ => self.close(Closed::EndedMidFrame),
            }
        }
    }

    /// Moves on once a write's data has all arrived or been thrown away.
    fn finish_data(&mut self, now: Instant) {
        match &mut self.state {
            State::Land {
                id, spans, index, ..
            } if *index == spans.len() => {
                let (id, spans) = (*id, std::mem::take(spans));
                self.state = State::Waiting { id };
                self.event = Some(Event::Store(spans));
            }
            State::Discard {
                id,
                left: 0,
                reason,
            } => {
                let (id, reason) = (*id, std::mem::take(reason));
                self.ack(now, id, Err(reason));
                self.finish_frame(now);
            }
            _ => {}
        }
    }

    /// Acts on a completely collected part.
    fn collected(&mut self, now: Instant, part: Part) -> Result<(), ProtocolViolation> {
        match part {
            Part::Header => self.start_frame(now),
            Part::Hello => {
                let hello = wire::decode_hello(&self.scratch)?;
                self.peer = Some(hello.name);
                self.finish_frame(now);
                Ok(())
            }
            Part::Body(header) => self.body(now, header),
            Part::WriteAddress(header) => {
                let mut raw = [0u8; 8];
                raw.copy_from_slice(&self.scratch);
                let addr = u64::from_le_bytes(raw);
                let len = u64::from(header.len - 8);
                if len == 0 {
                    return Err(ProtocolViolation::Malformed("zero-length write"));
                }
                let entry = wire::WriteManyEntry {
                    addr,
                    len: header.len - 8,
                };
                self.land_or_refuse(header.id, &[entry], len);
                Ok(())
            }
            Part::WriteManyCount(header) => {
                let mut count = [0u8; 4];
                count.copy_from_slice(&self.scratch);
                let table_len = wire::decode_write_many_count(
                    count,
                    header.len,
                    self.config.limits.max_entries,
                )?;
                self.collect(Part::WriteManyTable(header), table_len);
                Ok(())
            }
            Part::WriteManyTable(header) => {
                let data_len = u64::from(header.len) - 4 - self.scratch.len() as u64;
                let entries = wire::decode_write_many_table(&self.scratch, data_len)?;
                self.land_or_refuse(header.id, &entries, data_len);
                Ok(())
            }
        }
    }

    /// A whole header arrived: checks it and starts on its body.
    fn start_frame(&mut self, now: Instant) -> Result<(), ProtocolViolation> {
        let mut bytes = [0u8; HEADER_LEN];
        bytes.copy_from_slice(&self.scratch);
        let header = Header::decode(&bytes, &self.config.limits)?;
        match (header.kind, self.peer.is_some()) {
            (Kind::Hello, false) => {
                self.collect(Part::Hello, header.len as usize);
                Ok(())
            }
            (Kind::Hello, true) => Err(unexpected(header.kind, "twice on one connection")),
            (_, false) => Err(unexpected(header.kind, "before hello")),
            (Kind::DescriptorRequest, true) => {
                if header.len != 0 {
                    return Err(ProtocolViolation::TrailingBytes(header.len as usize));
                }
                let json = self.served.descriptor();
                let answer = Header {
                    kind: Kind::DescriptorResponse,
                    id: header.id,
                    len: json.len() as u32,
                };
                self.queue(now, |output| output.frame(answer, &json));
                self.finish_frame(now);
                Ok(())
            }
            (Kind::Write, true) => {
                if header.len < 8 {
                    return Err(ProtocolViolation::TooShort {
                        what: "write address",
                        needed: 8 - header.len as usize,
                    });
                }
                self.collect(Part::WriteAddress(header), 8);
                Ok(())
            }
            (Kind::WriteMany, true) => {
                if header.len < 4 {
                    return Err(ProtocolViolation::TooShort {
                        what: "write-many count",
                        needed: 4 - header.len as usize,
                    });
                }
                self.collect(Part::WriteManyCount(header), 4);
                Ok(())
            }
            (Kind::ReadRequest | Kind::Notify, true) => {
                self.collect(Part::Body(header), header.len as usize);
                Ok(())
            }
            (Kind::DescriptorResponse | Kind::ReadData | Kind::Ack, true) => {
                Err(unexpected(header.kind, "at a listener"))
            }
        }
    }

    /// The whole body of a read request or a notification arrived.
    fn body(&mut self, now: Instant, header: Header) -> Result<(), ProtocolViolation> {
        if header.kind == Kind::Notify {
            let payload = std::mem::take(&mut self.scratch);
            self.state = State::Waiting { id: header.id };
            self.event = Some(Event::Notify(payload));
            return Ok(());
        }
        let (addr, len) = wire::decode_read_request(&self.scratch)?;
        if len > self.config.limits.max_data {
            return Err(ProtocolViolation::Oversized {
                kind: "read-request",
                len: u64::from(len),
                limit: u64::from(self.config.limits.max_data),
            });
        }
        match self.served.span(addr, u64::from(len)) {
            Some(span) => {
                self.state = State::Waiting { id: header.id };
                self.event = Some(Event::Load(span));
            }
            None => {
                self.ack(now, header.id, Err(refusal(addr, u64::from(len), 0)));
                self.finish_frame(now);
            }
        }
        Ok(())
    }

    /// Every entry is checked before the first byte lands: one outside the registrations has
    /// the whole frame's data thrown away and the frame refused, so nothing of it is written.
    /// That is not "whole or not at all": once landing has started, a frame that stalls or
    /// whose connection breaks part-way leaves the bytes that already arrived in their
    /// destinations, and only the missing acknowledgement tells the sender it failed.
    fn land_or_refuse(&mut self, id: u64, entries: &[wire::WriteManyEntry], data_len: u64) {
        let mut spans = Vec::with_capacity(entries.len());
        for (index, entry) in entries.iter().enumerate() {
            match self.served.span(entry.addr, u64::from(entry.len)) {
                Some(span) => spans.push(span),
                None => {
                    drop(spans);
                    self.state = State::Discard {
                        id,
                        left: data_len,
                        reason: refusal(entry.addr, u64::from(entry.len), index),
                    };
                    return;
                }
            }
        }
        self.state = State::Land {
            id,
            spans,
            index: 0,
            filled: 0,
        };
    }
}

/// Moves buffered bytes into the current span; `true` when any moved or a span completed.
fn land<S: Landing>(
    input: &mut Input,
    spans: &mut [S],
    index: &mut usize,
    filled: &mut usize,
) -> Result<bool, CudaError> {
    let Some(span) = spans.get_mut(*index) else {
        return Ok(false);
    };
    let destination = span.receive_into()?;
    let bytes = input.take(destination.len() - *filled);
    destination[*filled..*filled + bytes.len()].copy_from_slice(bytes);
    *filled += bytes.len();
    if *filled < destination.len() {
        return Ok(!bytes.is_empty());
    }
    *index += 1;
    *filled = 0;
    Ok(true)
}

fn refusal(addr: u64, len: u64, index: usize) -> String {
    RangeError::NotRegistered {
        index,
        side: Side::Remote,
        addr,
        len,
    }
    .to_string()
}

fn unexpected(kind: Kind, context: &'static str) -> ProtocolViolation {
    ProtocolViolation::Unexpected {
        kind: kind.name(),
        context,
    }
}
