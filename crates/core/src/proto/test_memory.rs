//! A served engine made of one plain buffer at a fixed address, and a driver that runs a
//! session against it entirely in memory: for the session's tests and the fuzz targets.

use super::{Closed, Event, Landing, Served, ServerSession, SessionConfig};
use crate::auth::FrameKeys;
use crate::error::{Error, Refusal};
use crate::memory::{RawDestination, RawSource};
use crate::wire::seal::{Opener, KEY_LEN, TAG_LEN};
use crate::wire::{Header, Limits, HEADER_LEN};
use parking_lot::Mutex;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One buffer of `len` bytes that claims to live at [`TestMemory::BASE`].
pub(crate) struct TestMemory {
    bytes: Mutex<Vec<u8>>,
}

/// A range of [`TestMemory`], staged like GPU memory: received bytes reach the memory only
/// when the driver stores the span.
pub(crate) struct TestSpan {
    addr: u64,
    staging: Vec<u8>,
}

impl Landing for TestSpan {
    fn len(&self) -> usize {
        self.staging.len()
    }

    fn destination(&mut self) -> Result<RawDestination<'_>, Error> {
        Ok(RawDestination::from_slice(&mut self.staging))
    }

    fn source(&self) -> RawSource<'_> {
        RawSource::from_slice(&self.staging)
    }
}

impl TestMemory {
    /// Where the buffer claims to be, so that test inputs can name fixed addresses.
    pub(crate) const BASE: u64 = 0x10_0000;
    /// What [`Served::descriptor`] answers.
    pub(crate) const DESCRIPTOR: &'static [u8] = b"{\"test\":true}";

    pub(crate) fn new(len: usize) -> Arc<TestMemory> {
        Arc::new(TestMemory {
            bytes: Mutex::new(vec![0u8; len]),
        })
    }

    /// The bytes at `addr..addr+len`, which must lie inside the buffer.
    #[cfg(test)]
    pub(crate) fn read(&self, addr: u64, len: usize) -> Vec<u8> {
        let start = (addr - Self::BASE) as usize;
        self.bytes.lock()[start..start + len].to_vec()
    }

    fn offset(&self, addr: u64, len: u64) -> Option<usize> {
        let start = addr.checked_sub(Self::BASE)?;
        let end = start.checked_add(len)?;
        (len > 0 && end <= self.bytes.lock().len() as u64).then_some(start as usize)
    }

    /// Copies the spans' received bytes into the buffer, as storing GPU staging buffers does.
    pub(crate) fn store(&self, spans: Vec<TestSpan>) {
        let mut bytes = self.bytes.lock();
        for span in spans {
            let start = (span.addr - Self::BASE) as usize;
            bytes[start..start + span.staging.len()].copy_from_slice(&span.staging);
        }
    }

    fn load(&self, span: &mut TestSpan) {
        let start = (span.addr - Self::BASE) as usize;
        let len = span.staging.len();
        span.staging
            .copy_from_slice(&self.bytes.lock()[start..start + len]);
    }
}

impl Served for TestMemory {
    type Span = TestSpan;

    fn span(&self, addr: u64, len: u64) -> Option<TestSpan> {
        self.offset(addr, len)?;
        Some(TestSpan {
            addr,
            staging: vec![0u8; usize::try_from(len).ok()?],
        })
    }

    fn descriptor(&self) -> Vec<u8> {
        Self::DESCRIPTOR.to_vec()
    }
}

/// Limits and timeouts the harness uses unless told otherwise.
pub(crate) fn test_config() -> SessionConfig {
    SessionConfig {
        limits: Limits::default(),
        io_timeout: Duration::from_secs(30),
        hello_timeout: Duration::from_secs(30),
        idle_timeout: Duration::from_secs(300),
    }
}

/// Drives a session the way the TCP driver does, with memory in place of a socket.
pub(crate) struct Harness {
    pub(crate) memory: Arc<TestMemory>,
    pub(crate) session: ServerSession<TestMemory>,
    pub(crate) now: Instant,
    /// Everything the session wrote to its peer.
    pub(crate) sent: Vec<u8>,
    /// Notifications the inbox took, in order.
    pub(crate) delivered: Vec<Vec<u8>>,
    /// How many more notifications the inbox takes before it refuses.
    pub(crate) inbox_room: usize,
    /// The most bytes the session held at any point before its answers were written.
    pub(crate) peak_held: usize,
    /// The key the session tags its answers with, once sealed ([`Harness::seal`]).
    answer_key: Option<[u8; KEY_LEN]>,
}

impl Harness {
    pub(crate) fn new(memory_len: usize, config: SessionConfig) -> Harness {
        let memory = TestMemory::new(memory_len);
        let now = Instant::now();
        Harness {
            session: ServerSession::new(Arc::clone(&memory), config, now),
            memory,
            now,
            sent: Vec::new(),
            delivered: Vec::new(),
            inbox_room: 4,
            peak_held: 0,
            answer_key: None,
        }
    }

    /// Seals the session with `keys` ([`ServerSession::seal`]); [`Self::answers`] then checks
    /// every answer's tag.
    pub(crate) fn seal(&mut self, keys: FrameKeys) {
        self.answer_key = Some(keys.send);
        self.session.seal(keys);
    }

    /// Answers every event and writes every answer, as a driver does before it reads again.
    pub(crate) fn pump(&mut self) {
        // Writing answers can let the session take its next buffered frame: go round until
        // neither events nor answers are left.
        while self.session.has_event() || self.session.poll_transmit().is_some() {
            self.answer_events();
            self.transmit();
        }
    }

    /// Answers every event the session has, without writing any answer.
    pub(crate) fn answer_events(&mut self) {
        while let Some(event) = self.session.poll_event() {
            match event {
                Event::Store(spans) => {
                    self.memory.store(spans);
                    self.session.handle_stored(self.now, Ok(()));
                }
                Event::Load(mut span) => {
                    self.memory.load(&mut span);
                    self.session.handle_loaded(self.now, span, Ok(()));
                }
                Event::Notify(payload) => {
                    let outcome = if self.inbox_room > 0 {
                        self.inbox_room -= 1;
                        self.delivered.push(payload);
                        Ok(())
                    } else {
                        Err(Refusal::Other("the test inbox is full".to_owned()))
                    };
                    self.session.handle_delivery(self.now, outcome);
                }
            }
            self.peak_held = self.peak_held.max(self.session.held_bytes());
        }
    }

    /// Writes every queued answer to the peer.
    pub(crate) fn transmit(&mut self) {
        while let Some(bytes) = self.session.poll_transmit() {
            let start = self.sent.len();
            self.sent.resize(start + bytes.len(), 0);
            let len = bytes.copy_to(&mut self.sent[start..]);
            self.session.handle_transmitted(self.now, len);
        }
    }

    /// Feeds `bytes` in reads of at most `chunk` bytes, one millisecond apart; returns how many
    /// the session took before it stopped reading.
    pub(crate) fn feed(&mut self, bytes: &[u8], chunk: usize) -> usize {
        let mut taken = 0;
        while taken < bytes.len() {
            self.pump();
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
        }
        self.pump();
        taken
    }

    /// The peer closes its side.
    pub(crate) fn end(&mut self) {
        self.session.handle_end(self.now);
        self.pump();
    }

    /// Lets `elapsed` pass and fires the session's timer if it is due.
    #[cfg(test)]
    pub(crate) fn wait(&mut self, elapsed: Duration) {
        self.now += elapsed;
        if self
            .session
            .poll_timeout()
            .is_some_and(|due| due <= self.now)
        {
            self.session.handle_timeout(self.now);
        }
        self.pump();
    }

    pub(crate) fn closed(&self) -> Option<&Closed> {
        self.session.closed()
    }

    /// The frames the session sent, decoded and, on a sealed session, checked against their
    /// tags; panics on a malformed or wrongly tagged one, which the session must never write.
    pub(crate) fn answers(&self) -> Vec<(Header, Vec<u8>)> {
        let limits = Limits::default();
        let mut opener = self.answer_key.map(Opener::new);
        let mut answers = Vec::new();
        let mut rest = self.sent.as_slice();
        while !rest.is_empty() {
            let mut raw = [0u8; HEADER_LEN];
            raw.copy_from_slice(&rest[..HEADER_LEN]);
            let header = Header::decode(&raw, &limits).expect("the session writes valid headers");
            let mut end = HEADER_LEN + header.len as usize;
            let body = rest[HEADER_LEN..end].to_vec();
            if let Some(opener) = &mut opener {
                opener
                    .open(&raw, &body, header.kind, &rest[end..end + TAG_LEN])
                    .expect("the session tags every answer");
                end += TAG_LEN;
            }
            answers.push((header, body));
            rest = &rest[end..];
        }
        answers
    }
}
