//! The caller's session ([`ClientSession`]) paired in memory with a listener's
//! ([`super::test_memory::Harness`]): requests framed as the TCP driver frames them, answers
//! carried back in reads of any size, time passed in by hand. For the client session's tests
//! and its fuzz target.

use super::test_memory::{TestMemory, TestSpan};
use super::{Answer, ClientSession, Request, Served};
use crate::auth::FrameKeys;
use crate::error::{ProtocolViolation, Refusal};
use crate::wire::seal::{self, Sealer};
use crate::wire::{self, Header, Hello, Kind, Limits};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A request of the test client: its id, and where a read's answer lands.
pub(crate) struct TestRequest {
    id: u64,
    destination: Option<TestSpan>,
}

impl Request for TestRequest {
    type Span = TestSpan;

    fn destination(&mut self) -> Option<&mut TestSpan> {
        self.destination.as_mut()
    }
}

/// The requests a test client waits on.
pub(crate) type Waiting = Mutex<HashMap<u64, TestRequest>>;

/// What became of one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// Acknowledged, or its read data stored.
    Done,
    /// The listener refused it.
    Refused(Refusal),
    /// Its answer failed its tag.
    Tampered(ProtocolViolation),
}

/// Drives a client session the way the TCP driver's reader does, with memory in place of a
/// socket, and frames requests the way its writer does.
pub(crate) struct Client {
    /// Where read answers land once stored.
    pub(crate) memory: Arc<TestMemory>,
    waiting: Arc<Waiting>,
    pub(crate) session: ClientSession<Waiting>,
    pub(crate) now: Instant,
    /// Requests framed and not yet carried to the listener.
    pub(crate) outgoing: Vec<u8>,
    /// What became of each request, in the order the answers arrived.
    pub(crate) outcomes: Vec<(u64, Outcome)>,
    /// The most bytes the session held at any point.
    pub(crate) peak_held: usize,
    /// Tags the requests, once sealed ([`Client::seal`]).
    sealer: Option<Sealer>,
    next_id: u64,
}

impl Client {
    /// A client whose reads land in `memory_len` bytes at [`TestMemory::BASE`].
    pub(crate) fn new(memory_len: usize, limits: Limits, io_timeout: Duration) -> Client {
        let waiting: Arc<Waiting> = Arc::default();
        Client {
            memory: TestMemory::new(memory_len),
            session: ClientSession::new(Arc::clone(&waiting), limits, io_timeout),
            waiting,
            now: Instant::now(),
            outgoing: Vec::new(),
            outcomes: Vec::new(),
            peak_held: 0,
            sealer: None,
            next_id: 1,
        }
    }

    /// Tags requests with `keys.send` and checks answers with `keys.receive`.
    pub(crate) fn seal(&mut self, keys: FrameKeys) {
        self.sealer = Some(Sealer::new(keys.send));
        self.session.seal(keys.receive);
    }

    /// Frames a hello naming this client.
    pub(crate) fn hello(&mut self, name: &str) {
        let body = wire::encode_hello(&Hello { name: name.into() });
        self.send(Kind::Hello, 0, &body);
    }

    /// Frames a write of `data` to the listener's `addr`; returns its id.
    pub(crate) fn write(&mut self, addr: u64, data: &[u8]) -> u64 {
        let id = self.expect_ack();
        let mut body = addr.to_le_bytes().to_vec();
        body.extend_from_slice(data);
        self.send(Kind::Write, id, &body);
        id
    }

    /// Frames a read of `len` bytes at the listener's `addr` into this client's `local`;
    /// returns its id.
    pub(crate) fn read(&mut self, addr: u64, local: u64, len: u32) -> u64 {
        let id = self.expect_read(local, len);
        self.send(Kind::ReadRequest, id, &wire::encode_read_request(addr, len));
        id
    }

    /// Frames a notification; returns its id.
    pub(crate) fn notify(&mut self, payload: &[u8]) -> u64 {
        let id = self.expect_ack();
        self.send(Kind::Notify, id, payload);
        id
    }

    /// Registers a request answered by an ack, sending nothing; returns its id.
    pub(crate) fn expect_ack(&mut self) -> u64 {
        self.register(None)
    }

    /// Registers a read of `len` bytes into this client's `local`, sending nothing; returns its
    /// id.
    pub(crate) fn expect_read(&mut self, local: u64, len: u32) -> u64 {
        let span = self.memory.span(local, u64::from(len));
        assert!(
            span.is_some(),
            "a test read lands inside the client's memory"
        );
        self.register(span)
    }

    /// How many requests still wait for an answer.
    pub(crate) fn waiting(&self) -> usize {
        self.waiting.lock().len()
    }

    /// Feeds the listener's `bytes` in reads of at most `chunk` bytes, one millisecond apart,
    /// acting on every answer; returns how many the session took before it stopped reading.
    pub(crate) fn receive(&mut self, bytes: &[u8], chunk: usize) -> usize {
        let mut taken = 0;
        while taken < bytes.len() {
            self.answer_events();
            let Some(mut target) = self.session.read_target() else {
                break;
            };
            let len = target
                .remaining()
                .min(chunk.max(1))
                .min(bytes.len() - taken);
            target.fill(&bytes[taken..taken + len]);
            taken += len;
            self.now += Duration::from_millis(1);
            self.session.handle_read(self.now, len);
            self.peak_held = self.peak_held.max(self.session.held_bytes());
        }
        self.answer_events();
        taken
    }

    /// The listener closes its side.
    pub(crate) fn end(&mut self) {
        self.session.handle_end(self.now);
        self.answer_events();
    }

    /// Lets `elapsed` pass and fires the session's timer if it is due.
    pub(crate) fn wait(&mut self, elapsed: Duration) {
        self.now += elapsed;
        if self
            .session
            .poll_timeout()
            .is_some_and(|due| due <= self.now)
        {
            self.session.handle_timeout(self.now);
        }
        self.answer_events();
    }

    /// Acts on every answer as the TCP driver does: a read's bytes are stored into memory.
    pub(crate) fn answer_events(&mut self) {
        while let Some(answer) = self.session.poll_event() {
            let (id, outcome) = match answer {
                Answer::Acked { request, outcome } => (
                    request.id,
                    outcome.map_or_else(Outcome::Refused, |()| Outcome::Done),
                ),
                Answer::Arrived(request) => {
                    self.memory.store(request.destination.into_iter().collect());
                    (request.id, Outcome::Done)
                }
                Answer::Tampered { request, violation } => {
                    (request.id, Outcome::Tampered(violation))
                }
            };
            self.outcomes.push((id, outcome));
        }
    }

    fn register(&mut self, destination: Option<TestSpan>) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        self.waiting
            .lock()
            .insert(id, TestRequest { id, destination });
        id
    }

    /// Frames `body` as the driver's writer does: on a sealed connection a write's address is
    /// followed by a first tag and every frame ends with one.
    fn send(&mut self, kind: Kind, id: u64, body: &[u8]) {
        let header = Header::for_body(kind, id, body).encode();
        self.outgoing.extend_from_slice(&header);
        let Some(sealer) = &mut self.sealer else {
            self.outgoing.extend_from_slice(body);
            return;
        };
        let prefix = if seal::tags_prefix(kind) {
            8
        } else {
            body.len()
        };
        sealer.begin(&header);
        sealer.update(&body[..prefix]);
        self.outgoing.extend_from_slice(&body[..prefix]);
        if seal::tags_prefix(kind) {
            self.outgoing.extend_from_slice(&sealer.prefix_tag());
        }
        sealer.update(&body[prefix..]);
        self.outgoing.extend_from_slice(&body[prefix..]);
        self.outgoing.extend_from_slice(&sealer.finish());
    }
}

/// A client and a listener joined in memory.
#[cfg(test)]
pub(crate) struct Pair {
    pub(crate) client: Client,
    pub(crate) server: super::test_memory::Harness,
    /// Bytes of the listener's answers already carried to the client.
    carried: usize,
}

#[cfg(test)]
impl Pair {
    /// Both sides over `memory_len` bytes each, with `config`'s limits and I/O timeout.
    pub(crate) fn new(memory_len: usize, config: super::SessionConfig) -> Pair {
        Pair {
            client: Client::new(memory_len, config.limits, config.io_timeout),
            server: super::test_memory::Harness::new(memory_len, config),
            carried: 0,
        }
    }

    /// Seals both sides with matching keys ([`client_keys`]).
    pub(crate) fn seal(&mut self) {
        let FrameKeys { send, receive } = client_keys();
        self.client.seal(FrameKeys { send, receive });
        self.server.seal(FrameKeys {
            send: receive,
            receive: send,
        });
    }

    /// Carries every request to the listener and every answer back, in reads of at most
    /// `chunk` bytes, with `alter` applied to the answers on the way.
    pub(crate) fn drive_altered(&mut self, chunk: usize, alter: impl Fn(&mut Vec<u8>)) {
        let requests = std::mem::take(&mut self.client.outgoing);
        self.server.feed(&requests, chunk);
        let mut answers = self.server.sent[self.carried..].to_vec();
        self.carried = self.server.sent.len();
        alter(&mut answers);
        self.client.receive(&answers, chunk);
    }

    /// [`Self::drive_altered`] with the answers carried as they were sent.
    pub(crate) fn drive(&mut self, chunk: usize) {
        self.drive_altered(chunk, |_| {});
    }

    /// Every answer the listener sent so far.
    pub(crate) fn answers(&self) -> &[u8] {
        &self.server.sent
    }
}

/// The keys a sealed pair's client tags its requests with and checks the answers with; the
/// listener's are the same two the other way round.
pub(crate) fn client_keys() -> FrameKeys {
    FrameKeys {
        send: [0x31; 32],
        receive: [0x47; 32],
    }
}
