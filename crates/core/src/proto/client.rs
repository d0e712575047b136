//! The caller's side of one connection: what the listener answers, read as a plain state
//! machine. The requests themselves are framed and sent by the connection's writer
//! (`crate::tcp::driver`); this side matches each answer to the request it names, checks it
//! and says what became of the request.
//!
//! # Call order
//!
//! A [`ClientSession`] is made with the connection's [`Requests`], which the writer fills
//! before each request's first byte goes out, so the fastest answer finds its request. Then,
//! in a loop:
//!
//! 1. [`ClientSession::poll_event`] until `None`, doing what each [`Answer`] says (completing
//!    the request; for [`Answer::Arrived`], storing its destination first). Answers come in
//!    the order the listener sent them.
//! 2. Stop once [`ClientSession::closed`] says so: every request still waiting then fails.
//! 3. Read from the listener into [`ClientSession::read_target`] and report the count with
//!    [`ClientSession::handle_read`], or the end of the stream with
//!    [`ClientSession::handle_end`]; whatever happens first of that and
//!    [`ClientSession::poll_timeout`] passing, which is reported with
//!    [`ClientSession::handle_timeout`].
//!
//! # Zero-copy receive
//!
//! While a read's data is arriving, [`ClientSession::read_target`] returns the not yet filled
//! part of the request's destination itself whenever no received bytes are buffered and the
//! part is at least as large as the input buffer, so block data lands where it belongs without
//! a copy. The destination is raw (address and length, filled by the read system call), never a
//! slice: registered memory may be written by others meanwhile. On a sealed connection the tag
//! is hashed over the bytes as they landed, read back through a small owned scratch buffer, and
//! the request completes only once the tag after its data checked out.
//!
//! # Timeouts
//!
//! Once a header names its request, the rest of its body must arrive within the I/O timeout,
//! and on a sealed connection the tag after it within another. Nothing bounds the wait for a
//! header: a connection may sit idle between answers.

use super::input::Input;
use super::{Closed, Landing};
use crate::error::{ProtocolViolation, Refusal};
use crate::memory::RawDestination;
use crate::wire::seal::{Opener, KEY_LEN, TAG_LEN};
use crate::wire::{self, Header, Kind, Limits, HEADER_LEN};
use parking_lot::Mutex;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The requests of one connection that wait for their answers.
pub(crate) trait Requests {
    /// One request, as its sender keeps it.
    type Request: Request;
    /// Takes request `id` out of the waiting ones; `None` when no request `id` waits.
    fn take(&self, id: u64) -> Option<Self::Request>;
}

/// One request waiting for its answer.
pub(crate) trait Request {
    /// Memory a read's answer lands in.
    type Span: Landing;
    /// Where the answer of a read request lands; `None` for a request answered by an ack only.
    fn destination(&mut self) -> Option<&mut Self::Span>;
}

impl<Q: Request> Requests for Mutex<HashMap<u64, Q>> {
    type Request = Q;

    fn take(&self, id: u64) -> Option<Q> {
        self.lock().remove(&id)
    }
}

/// What the listener said about one request.
pub(crate) enum Answer<Q> {
    /// The listener acknowledged the request: done, or refused with a reason.
    Acked {
        /// The request answered.
        request: Q,
        /// What the listener did with it.
        outcome: Result<(), Refusal>,
    },
    /// A read's data is in its destination (on a sealed connection, its tag checked out):
    /// make it visible in memory (copy a GPU staging buffer to the GPU), then complete it.
    Arrived(Q),
    /// The answer to this request failed its tag: the request fails with the violation, and
    /// the session has closed with it.
    Tampered {
        /// The request whose answer was altered.
        request: Q,
        /// Why the tag did not check out.
        violation: ProtocolViolation,
    },
}

/// Where the session is within the current answer.
enum State<Q> {
    /// Collecting a header into the scratch buffer.
    Header,
    /// Collecting an ack's body into the scratch buffer, then (`tag`) on a sealed connection
    /// the tag after it.
    Ack {
        header: Header,
        request: Q,
        tag: bool,
    },
    /// Receiving a read's data into the request's destination.
    Data {
        header: Header,
        request: Q,
        filled: usize,
    },
    /// Collecting the tag after a read's data into the scratch buffer.
    DataTag { header: Header, request: Q },
}

/// The caller's protocol state for one connection. See the [module docs](self) for the call
/// order.
pub(crate) struct ClientSession<R: Requests> {
    requests: Arc<R>,
    limits: Limits,
    io_timeout: Duration,
    state: State<R::Request>,
    /// Bytes of the header, ack body or tag being collected.
    scratch: Vec<u8>,
    input: Input,
    /// Whether the last read target handed out was the current destination itself.
    direct: bool,
    events: VecDeque<Answer<R::Request>>,
    /// When the part being received (a body, a read's data, a tag) must be complete.
    deadline: Option<Instant>,
    /// The listener closed its side.
    ended: bool,
    closed: Option<Closed>,
    /// Checks the tags of the answers, on a sealed connection ([`Self::seal`]).
    opener: Option<Opener>,
}

impl<R: Requests> ClientSession<R> {
    /// A session that matches answers to `requests`; `limits` bound every body the listener
    /// announces, and `io_timeout` each part of an answer once its header arrived.
    pub(crate) fn new(requests: Arc<R>, limits: Limits, io_timeout: Duration) -> Self {
        ClientSession {
            requests,
            limits,
            io_timeout,
            state: State::Header,
            scratch: Vec::with_capacity(HEADER_LEN),
            input: Input::new(),
            direct: false,
            events: VecDeque::new(),
            deadline: None,
            ended: false,
            closed: None,
            opener: None,
        }
    }

    /// Checks every answer's tag with `key`, the listener's sending key from the connection's
    /// authentication ([`crate::wire::seal`]); called before the first byte is handled.
    pub(crate) fn seal(&mut self, key: [u8; KEY_LEN]) {
        self.opener = Some(Opener::new(key));
    }

    /// Why the session ended, once it has. Answers handled before the end are still offered by
    /// [`Self::poll_event`].
    pub(crate) fn closed(&self) -> Option<&Closed> {
        self.closed.as_ref()
    }

    /// The next answer for the driver to act on, in the order they arrived.
    pub(crate) fn poll_event(&mut self) -> Option<Answer<R::Request>> {
        self.events.pop_front()
    }

    /// When [`Self::handle_timeout`] must be called if nothing else happens first.
    pub(crate) fn poll_timeout(&self) -> Option<Instant> {
        self.closed.is_none().then_some(self.deadline).flatten()
    }

    /// Closes the session if the current part's deadline has passed at `now`.
    pub(crate) fn handle_timeout(&mut self, now: Instant) {
        if self.poll_timeout().is_some_and(|due| now >= due) {
            self.close(Closed::AnswerStalled(self.io_timeout));
        }
    }

    /// Where the driver should read the listener's next bytes; `None` while answers wait in
    /// [`Self::poll_event`] or once the session has ended: it must not read then.
    pub(crate) fn read_target(&mut self) -> Option<RawDestination<'_>> {
        if self.closed.is_some() || self.ended || !self.events.is_empty() {
            return None;
        }
        let landing = match &mut self.state {
            State::Data {
                request, filled, ..
            } => request.destination().map(|span| (span, *filled)),
            _ => None,
        };
        let target = self.input.read_target(landing);
        self.direct = target.as_ref().is_some_and(|(_, direct)| *direct);
        target.map(|(destination, _)| destination)
    }

    /// `len` bytes were read into the last [`Self::read_target`] at `now`.
    pub(crate) fn handle_read(&mut self, now: Instant, len: usize) {
        if std::mem::take(&mut self.direct) {
            if let State::Data {
                request, filled, ..
            } = &mut self.state
            {
                let landed = request
                    .destination()
                    .and_then(|span| span.destination().ok())
                    .and_then(|destination| destination.into_source().range(*filled, len));
                if let Some(landed) = landed {
                    if let Some(opener) = &mut self.opener {
                        landed.digest(|bytes| opener.update(bytes));
                    }
                    *filled += landed.len();
                }
            }
        } else {
            self.input.filled(len);
        }
        self.process(now);
    }

    /// The listener closed its side of the connection at `now`.
    pub(crate) fn handle_end(&mut self, now: Instant) {
        self.ended = true;
        self.process(now);
    }

    /// Bytes the session holds: its input buffer and the part it collects.
    #[cfg(any(test, fuzzing))]
    pub(crate) fn held_bytes(&self) -> usize {
        Input::CAPACITY + self.scratch.capacity()
    }

    /// Ends the session; the request of an answer in progress is dropped, which fails it.
    /// Answers already handled stay queued for [`Self::poll_event`].
    fn close(&mut self, reason: Closed) {
        if self.closed.is_none() {
            self.closed = Some(reason);
            self.state = State::Header;
            self.deadline = None;
        }
    }

    /// Handles buffered bytes until more are needed or the session closes.
    fn process(&mut self, now: Instant) {
        while self.closed.is_none() {
            let progressed = match self.step(now) {
                Ok(progressed) => progressed,
                Err(reason) => {
                    self.close(reason);
                    false
                }
            };
            if !progressed {
                break;
            }
        }
        if self.ended && self.closed.is_none() {
            let between = matches!(self.state, State::Header) && self.scratch.is_empty();
            self.close(match between {
                true => Closed::Finished,
                false => Closed::EndedMidFrame,
            });
        }
    }

    /// Moves buffered bytes into the current part and acts on it once complete; `true` when
    /// anything moved or changed.
    fn step(&mut self, now: Instant) -> Result<bool, Closed> {
        match std::mem::replace(&mut self.state, State::Header) {
            State::Header => {
                if !self.collect(HEADER_LEN) {
                    return Ok(false);
                }
                self.start_answer(now).map_err(Closed::Protocol)?;
                Ok(true)
            }
            State::Ack {
                header,
                request,
                tag,
            } => {
                let body_len = header.len as usize;
                let need = body_len + if tag { TAG_LEN } else { 0 };
                if !self.collect(need) {
                    self.state = State::Ack {
                        header,
                        request,
                        tag,
                    };
                    return Ok(false);
                }
                if !tag && self.opener.is_some() {
                    // The tag has its own deadline, from the end of the body.
                    self.deadline = now.checked_add(self.io_timeout);
                    self.state = State::Ack {
                        header,
                        request,
                        tag: true,
                    };
                    return Ok(true);
                }
                self.acked(header, request)?;
                Ok(true)
            }
            State::Data {
                header,
                mut request,
                filled,
            } => {
                let before = filled;
                let filled = self.land(&mut request, filled)?;
                if filled < header.len as usize {
                    if filled == before && !self.input.is_empty() {
                        // Bytes wait and the destination takes none: it is smaller than it
                        // said, and reading on would only fill the buffer for nothing.
                        return Err(Closed::Staging(
                            "the read's destination is smaller than its data".into(),
                        ));
                    }
                    self.state = State::Data {
                        header,
                        request,
                        filled,
                    };
                    return Ok(filled > before);
                }
                match self.opener {
                    Some(_) => {
                        self.scratch.clear();
                        self.deadline = now.checked_add(self.io_timeout);
                        self.state = State::DataTag { header, request };
                    }
                    None => self.answered(Answer::Arrived(request)),
                }
                Ok(true)
            }
            State::DataTag { header, request } => {
                if !self.collect(TAG_LEN) {
                    self.state = State::DataTag { header, request };
                    return Ok(false);
                }
                let checked = match &mut self.opener {
                    Some(opener) => opener.finish(header.kind, &self.scratch),
                    None => Ok(()),
                };
                match checked {
                    Ok(()) => self.answered(Answer::Arrived(request)),
                    Err(violation) => return Err(self.tampered(request, violation)),
                }
                Ok(true)
            }
        }
    }

    /// Moves buffered bytes into the scratch buffer until it holds `need`; `true` once it does.
    fn collect(&mut self, need: usize) -> bool {
        let bytes = self.input.take(need.saturating_sub(self.scratch.len()));
        self.scratch.extend_from_slice(bytes);
        self.scratch.len() >= need
    }

    /// Moves buffered bytes into a read's destination after its first `filled` bytes; returns
    /// how many it holds now.
    fn land(&mut self, request: &mut R::Request, filled: usize) -> Result<usize, Closed> {
        let Some(span) = request.destination() else {
            return Ok(filled);
        };
        let destination = span
            .destination()
            .map_err(|error| Closed::Staging(error.to_string()))?;
        if filled > destination.remaining() {
            return Ok(filled);
        }
        let mut rest = destination.after(filled);
        let bytes = self.input.take(rest.remaining());
        rest.fill(bytes);
        if let Some(opener) = &mut self.opener {
            opener.update(bytes);
        }
        Ok(rest.filled())
    }

    /// A whole header arrived: checks it, finds its request and starts on its body.
    fn start_answer(&mut self, now: Instant) -> Result<(), ProtocolViolation> {
        let mut bytes = [0u8; HEADER_LEN];
        bytes.copy_from_slice(&self.scratch);
        self.scratch.clear();
        let header = Header::decode(&bytes, &self.limits)?;
        let mut request = self
            .requests
            .take(header.id)
            .ok_or(ProtocolViolation::UnknownRequest(header.id))?;
        match header.kind {
            Kind::Ack => {
                self.state = State::Ack {
                    header,
                    request,
                    tag: false,
                }
            }
            Kind::ReadData => {
                let Some(span) = request.destination() else {
                    return Err(ProtocolViolation::Unexpected {
                        kind: "read-data",
                        context: "in answer to a write",
                    });
                };
                if span.len() != header.len as usize {
                    return Err(ProtocolViolation::Malformed(
                        "read data of the wrong length",
                    ));
                }
                self.state = State::Data {
                    header,
                    request,
                    filled: 0,
                };
            }
            other => {
                return Err(ProtocolViolation::Unexpected {
                    kind: other.name(),
                    context: "from a listener",
                })
            }
        }
        if let Some(opener) = &mut self.opener {
            opener.begin(&bytes);
        }
        self.deadline = now.checked_add(self.io_timeout);
        Ok(())
    }

    /// An ack's body (and tag) are in the scratch buffer: checks the tag before anything the
    /// ack says is acted on, then decodes it.
    fn acked(&mut self, header: Header, request: R::Request) -> Result<(), Closed> {
        let body_len = header.len as usize;
        if let Some(opener) = &mut self.opener {
            let (body, tag) = self.scratch.split_at(body_len.min(self.scratch.len()));
            opener.update(body);
            if let Err(violation) = opener.finish(header.kind, tag) {
                return Err(self.tampered(request, violation));
            }
        }
        let body = self.scratch.get(..body_len).unwrap_or_default();
        let outcome = wire::decode_ack(body).map_err(Closed::Protocol)?;
        self.answered(Answer::Acked { request, outcome });
        Ok(())
    }

    /// Hands the request whose answer failed its tag to the driver; the session closes with
    /// the returned reason.
    fn tampered(&mut self, request: R::Request, violation: ProtocolViolation) -> Closed {
        self.events.push_back(Answer::Tampered {
            request,
            violation: violation.clone(),
        });
        Closed::Protocol(violation)
    }

    /// Queues a complete answer and waits for the next header.
    fn answered(&mut self, answer: Answer<R::Request>) {
        self.events.push_back(answer);
        self.scratch.clear();
        self.deadline = None;
        self.state = State::Header;
    }
}
