//! The listener's side of one connection: hello, frame by frame, each request answered in
//! order. This file holds the session's state and its driver-facing calls; `frames` parses
//! and acts on the frames themselves.

mod frames;

use super::input::Input;
use super::output::Output;

/// Bytes of answers a session allocates (acks, descriptors) that may wait for a peer to read
/// them before the session takes no new frame from it.
pub(crate) const MAX_COPIED_ANSWERS: usize = 256 << 10;
use super::{Closed, Event, Landing, Served, SessionConfig};
use crate::auth::FrameKeys;
use crate::error::Refusal;
use crate::memory::{RawDestination, RawSource};
use crate::wire::seal::{Opener, Sealer, TAG_LEN};
use crate::wire::{self, Header, Kind, HEADER_LEN};
use std::sync::Arc;
use std::time::{Duration, Instant};

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
    Discard { id: u64, left: u64, reason: Refusal },
    /// Collecting the tag that ends a write's data on a sealed connection, then doing `then`.
    Seal {
        id: u64,
        kind: Kind,
        then: AfterData<S>,
    },
    /// Waiting for the driver to answer the event about request `id`.
    Waiting { id: u64 },
}

/// What a write's data leads to once its last tag checked out.
enum AfterData<S> {
    /// The bytes are in their spans: store them.
    Store(Vec<S>),
    /// The write was refused before its data, which was thrown away.
    Refuse(Refusal),
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
    /// The caller's engine name, from its hello.
    peer: Option<String>,
    accepted: Instant,
    /// When the first byte of the current frame arrived.
    frame_started: Option<Instant>,
    /// The kind of the frame being handled, once its header is in.
    frame_kind: Option<Kind>,
    /// When the last frame was answered (or the hello arrived).
    last_frame: Instant,
    /// When queued answers last made progress.
    output_since: Option<Instant>,
    /// The peer closed its side.
    ended: bool,
    closed: Option<Closed>,
    /// Checks the tags of the frames received, on a sealed connection ([`Self::seal`]).
    opener: Option<Opener>,
    /// Tags the answers, on a sealed connection.
    sealer: Option<Sealer>,
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
            frame_kind: None,
            last_frame: now,
            output_since: None,
            ended: false,
            closed: None,
            opener: None,
            sealer: None,
        }
    }

    /// Tags every frame both ways with `keys`, from the connection's authentication
    /// ([`crate::wire::seal`]); called before the first byte is handled.
    pub(crate) fn seal(&mut self, keys: FrameKeys) {
        self.opener = Some(Opener::new(keys.receive));
        self.sealer = Some(Sealer::new(keys.send));
    }

    /// The caller's engine name as it introduced itself, once it has.
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

    /// Whether an event waits for the driver: it must be handled before waiting for bytes.
    pub(crate) fn has_event(&self) -> bool {
        self.event.is_some()
    }

    /// The next bytes to write to the peer.
    pub(crate) fn poll_transmit(&self) -> Option<RawSource<'_>> {
        self.output.front()
    }

    /// When [`Self::handle_timeout`] must be called if nothing else happens first.
    pub(crate) fn poll_timeout(&self) -> Option<Instant> {
        let io = self.config.io_timeout;
        let sending = self.output_since.and_then(|since| since.checked_add(io));
        if self.closed.is_some() {
            return sending;
        }
        let hello = self
            .peer
            .is_none()
            .then(|| self.accepted.checked_add(self.config.hello_timeout))
            .flatten();
        let frame = match self.frame_started {
            Some(started) => started.checked_add(io),
            None if self.peer.is_some() && self.output.is_empty() => {
                self.last_frame.checked_add(self.config.idle_timeout)
            }
            None => None,
        };
        [hello, frame, sending].into_iter().flatten().min()
    }

    /// Closes the session if a limit has passed at `now`.
    pub(crate) fn handle_timeout(&mut self, now: Instant) {
        let io = self.config.io_timeout;
        // A limit too large to add to an instant never passes.
        let passed = |since: Instant, limit: Duration| {
            since.checked_add(limit).is_some_and(|due| now >= due)
        };
        if self.closed.is_some() {
            // Answers still queued when the session ended are given up on once the peer has
            // read none of them for the limit.
            if self.output_since.is_some_and(|since| passed(since, io)) {
                self.output = Output::new();
                self.output_since = None;
            }
            return;
        }
        let hello = self.config.hello_timeout;
        let closed = if self.peer.is_none() && passed(self.accepted, hello) {
            Closed::NoHello(hello)
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
    /// an event's answer, holds a full buffer of frames it will take once the peer has read
    /// its answers, or has ended: it must not read then.
    pub(crate) fn read_target(&mut self) -> Option<RawDestination<'_>> {
        if self.closed.is_some() || self.ended || matches!(self.state, State::Waiting { .. }) {
            return None;
        }
        let landing = match &mut self.state {
            State::Land {
                spans,
                index,
                filled,
                ..
            } => spans.get_mut(*index).map(|span| (span, *filled)),
            _ => None,
        };
        let target = self.input.read_target(landing);
        self.direct = target.as_ref().is_some_and(|(_, direct)| *direct);
        target.map(|(destination, _)| destination)
    }

    /// `len` bytes were read into the last [`Self::read_target`].
    ///
    /// On a sealed connection, bytes read straight into their destination are hashed into the
    /// frame's tag by reading them back through a small owned scratch buffer, never a slice of
    /// registered memory; nothing the tag covers is acted on (stored, acknowledged) before the
    /// tag at the frame's end checked out.
    pub(crate) fn handle_read(&mut self, now: Instant, len: usize) {
        if std::mem::take(&mut self.direct) {
            if let State::Land {
                spans,
                index,
                filled,
                ..
            } = &mut self.state
            {
                if let (Some(opener), Some(span)) = (&mut self.opener, spans.get_mut(*index)) {
                    if let Some(landed) = span
                        .destination()
                        .ok()
                        .and_then(|destination| destination.into_source().range(*filled, len))
                    {
                        landed.digest(|bytes| opener.update(bytes));
                    }
                }
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
        let backed_up = self.answers_backed_up();
        self.output.advance(len);
        if self.output.is_empty() {
            self.output_since = None;
        } else if len > 0 {
            self.output_since = Some(now);
        }
        if backed_up && !self.answers_backed_up() {
            self.process(now);
        }
    }

    /// Whether the answers queued for the peer hold a frame's worth of bytes or more, or
    /// [`MAX_COPIED_ANSWERS`] of bytes this session allocated for them; new frames wait until
    /// the peer has read them. The second bound is what keeps a peer that pipelines small
    /// requests with large answers (descriptor requests) and reads none from making the
    /// engine hold many times what it sent.
    fn answers_backed_up(&self) -> bool {
        self.output.queued() >= self.config.limits.max_data as usize
            || self.output.copied() >= MAX_COPIED_ANSWERS
    }

    /// Answers [`Event::Store`]: whether the bytes are in memory, or why not.
    pub(crate) fn handle_stored(&mut self, now: Instant, outcome: Result<(), Refusal>) {
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
        outcome: Result<(), Refusal>,
    ) {
        if let State::Waiting { id } = self.state {
            match outcome {
                Ok(()) => {
                    let header = Header::new(
                        Kind::ReadData,
                        id,
                        u32::try_from(span.len()).unwrap_or(u32::MAX),
                    );
                    // Tagged through a scratch buffer: the span is registered memory.
                    let tag = self.sealer.as_mut().map(|sealer| {
                        sealer.begin(&header.encode());
                        span.source().digest(|bytes| sealer.update(bytes));
                        sealer.finish()
                    });
                    self.queue(now, |output| {
                        output.frame_from(header, span);
                        if let Some(tag) = tag {
                            output.bytes(&tag);
                        }
                    });
                }
                Err(refusal) => self.ack(now, id, Err(refusal)),
            }
            self.finish_frame(now);
            self.process(now);
        }
    }

    /// Answers [`Event::Notify`]: taken into the inbox, or why not.
    pub(crate) fn handle_delivery(&mut self, now: Instant, outcome: Result<(), Refusal>) {
        self.handle_stored(now, outcome);
    }

    /// Bytes the session holds for the peer: buffers and queued answers, read answers'
    /// spans included.
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

    fn ack(&mut self, now: Instant, id: u64, outcome: Result<(), Refusal>) {
        let body = wire::encode_ack(outcome.as_ref().map(|_| ()));
        self.answer(now, Header::for_body(Kind::Ack, id, &body), &body);
    }

    /// Queues a frame with `body`, tagged on a sealed connection.
    fn answer(&mut self, now: Instant, header: Header, body: &[u8]) {
        let tag = self
            .sealer
            .as_mut()
            .map(|sealer| sealer.seal(&header.encode(), body));
        self.queue(now, |output| {
            output.frame(header, body);
            if let Some(tag) = tag {
                output.bytes(&tag);
            }
        });
    }

    /// Bytes to collect for a part of `len` bytes that ends with a tag on a sealed connection.
    fn tagged(&self, len: usize) -> usize {
        len + self.opener.as_ref().map_or(0, |_| TAG_LEN)
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
}
