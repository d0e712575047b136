//! The reading end of a message ring: one thread per ring that polls it while messages come
//! and sleeps on its futex word when they stop, hands each message to the engine's inbox and
//! answers the sender with the verdict.

use super::ring::{is_closed, Reader, AWAKE, SLEEPING, STATE_OFFSET};
use super::shared::{futex_wait, SharedMemory};
use super::Verdict;
use ferry_core::{InboxHandle, MAX_NOTIFICATION_BYTES};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{fence, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

/// How long the reader spins after the last message before it starts yielding its core.
const SPIN: Duration = Duration::from_micros(50);
/// How long after the last message the reader polls (yielding its core between looks)
/// before it sleeps: waking a sleeping thread costs more than most messages take to come.
const POLL: Duration = Duration::from_millis(5);
/// How long one sleep lasts at most: the reader then checks that the sender and the engine
/// are still there.
const NAP: Duration = Duration::from_millis(100);
/// How long the sender may leave verdicts unread before its ring is closed.
const VERDICT_TIMEOUT: Duration = Duration::from_secs(5);

/// One ring being read.
pub(crate) struct Incoming {
    /// The ring's shared memory.
    pub(crate) memory: SharedMemory,
    /// The sender's engine name, as it claimed it.
    pub(crate) from: String,
    /// Where verdicts go; its closing ends the ring.
    pub(crate) socket: UnixStream,
    /// The engine's inbox.
    pub(crate) inbox: InboxHandle,
    /// Gone when the serving engine stops.
    pub(crate) running: Weak<()>,
    /// The ring's place in its engine's count, given back when the reader ends.
    pub(crate) _slot: RingSlot,
}

/// One ring's place among the rings an engine reads at once; given back when dropped.
pub(crate) struct RingSlot(Arc<AtomicUsize>);

impl RingSlot {
    /// A place among `count`'s rings, or `None` when `max` are read already.
    pub(crate) fn take(count: &Arc<AtomicUsize>, max: usize) -> Option<RingSlot> {
        count
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |rings| {
                (rings < max).then_some(rings + 1)
            })
            .ok()
            .map(|_| RingSlot(Arc::clone(count)))
    }
}

impl Drop for RingSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Incoming {
    /// Reads the ring on a thread of its own until the sender or the engine is gone.
    pub(crate) fn start(self) -> std::io::Result<()> {
        self.socket.set_write_timeout(Some(VERDICT_TIMEOUT))?;
        std::thread::Builder::new()
            .name("ferry-messages".into())
            .spawn(move || match self.run() {
                Ok(ended) => {
                    tracing::debug!(from = %self.from, reason = ended, "a message ring ended")
                }
                Err(reason) => tracing::warn!(from = %self.from, %reason, "closed a message ring"),
            })
            .map(drop)
    }

    /// Reads until the ring ends as rings do (why, in words), or must be closed (why).
    fn run(&self) -> Result<&'static str, String> {
        let words = self.memory.words();
        let state = self.memory.word32(STATE_OFFSET);
        let mut reader = Reader::default();
        let mut last = Instant::now();
        loop {
            match reader
                .pop(words, MAX_NOTIFICATION_BYTES)
                .map_err(|corrupt| corrupt.to_string())?
            {
                Some(_) if is_closed(words) => return Ok("the sender closed the ring"),
                Some(payload) => {
                    // A delivery is recorded in the ring before the hand-over and answered
                    // over the socket after it, so the send (a few microseconds) is not on
                    // the notification's way: a receiver that acts on it at once and exits
                    // before the answer left still leaves the sender its record's fate.
                    let verdict = match self.inbox.reserve(&self.from, payload) {
                        Ok(reserved) => {
                            reader.delivering(words);
                            reserved.deliver();
                            Verdict::Delivered
                        }
                        Err(reason) => Verdict::Refused(reason),
                    };
                    self.answer(&verdict.encode())
                        .map_err(|error| format!("answering the sender failed: {error}"))?;
                    last = Instant::now();
                }
                None if last.elapsed() < SPIN => std::hint::spin_loop(),
                None if last.elapsed() < POLL => std::thread::yield_now(),
                None => {
                    if let Some(ended) = self.ended()? {
                        return Ok(ended);
                    }
                    state.store(SLEEPING, Ordering::SeqCst);
                    fence(Ordering::SeqCst);
                    if !reader.has_news(words) {
                        futex_wait(state, SLEEPING, NAP);
                    }
                    state.store(AWAKE, Ordering::SeqCst);
                }
            }
        }
    }

    /// Sends `verdict` whole. Without SIGPIPE: a sender that closed its end mid-verdict must
    /// not kill this process.
    fn answer(&self, mut verdict: &[u8]) -> rustix::io::Result<()> {
        while !verdict.is_empty() {
            match rustix::net::send(&self.socket, verdict, rustix::net::SendFlags::NOSIGNAL) {
                Ok(sent) => verdict = &verdict[sent..],
                Err(rustix::io::Errno::INTR) => {}
                Err(error) => return Err(error),
            }
        }
        Ok(())
    }

    /// Why the ring ended, if it did: the engine stopped, or the sender let go of its end of
    /// the socket. A sender that writes to it breaks the protocol.
    fn ended(&self) -> Result<Option<&'static str>, String> {
        if self.running.strong_count() == 0 {
            return Ok(Some("the engine stopped"));
        }
        if is_closed(self.memory.words()) {
            return Ok(Some("the sender closed the ring"));
        }
        let mut byte = [0u8; 1];
        match rustix::net::recv(
            &self.socket,
            &mut byte,
            rustix::net::RecvFlags::PEEK | rustix::net::RecvFlags::DONTWAIT,
        ) {
            Ok((0, _)) => Ok(Some("the sender closed its end")),
            Ok(_) => Err("the sender wrote to a socket it must only read".into()),
            Err(rustix::io::Errno::AGAIN) => Ok(None),
            Err(error) => Err(format!("watching the sender's socket failed: {error}")),
        }
    }
}
