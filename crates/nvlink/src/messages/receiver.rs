//! The reading end of the message rings: a few threads per engine, each reading up to
//! [`RINGS_PER_THREAD`] rings. A thread polls its rings while messages come and, when they
//! stop, sleeps on all their futex words at once (`futex_waitv`), so a hundred idle rings
//! cost one sleeping thread, not a hundred. Each message goes to the engine's inbox and its
//! verdict back to the sender without ever blocking the thread: a sender that stops reading
//! its verdicts loses its ring, not the other senders their latency.

use super::ring::{is_closed, Reader, AWAKE, SLEEPING, STATE_OFFSET};
use super::shared::SharedMemory;
use super::Verdict;
use ferry_core::{InboxHandle, MAX_NOTIFICATION_BYTES};
use parking_lot::Mutex;
use rustix::thread::futex;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{fence, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

/// How long a thread spins after the last message before it starts yielding its core.
const SPIN: Duration = Duration::from_micros(50);
/// How long after the last message a thread polls (yielding its core between looks) before
/// it sleeps: waking a sleeping thread costs more than most messages take to come.
const POLL: Duration = Duration::from_millis(5);
/// How long one sleep lasts at most: the thread then checks that the senders and the engine
/// are still there.
const NAP: Duration = Duration::from_millis(100);
/// How long a sleep lasts at most while a sender's socket holds back verdicts: the thread
/// does not wait for the socket to take them, so it comes back to offer them again.
const UNSENT_NAP: Duration = Duration::from_millis(1);
/// How long a sender may leave verdicts unread before its ring is closed.
const VERDICT_TIMEOUT: Duration = Duration::from_secs(5);
/// Verdict bytes held for a sender whose socket takes no more, before its ring is closed.
const MAX_UNSENT: usize = 64 << 10;
/// Messages taken from one ring before the thread looks at its other rings.
const BURST: usize = 32;
/// Rings one thread reads: `futex_waitv` sleeps on at most 128 words, one of which is the
/// thread's own (it wakes for rings handed over).
pub(crate) const RINGS_PER_THREAD: usize = 127;

/// One ring handed over, before a thread reads it.
pub(crate) struct Incoming {
    /// The ring's shared memory.
    pub(crate) memory: SharedMemory,
    /// The sender's engine name, as it claimed it.
    pub(crate) from: String,
    /// Where verdicts go; its closing ends the ring.
    pub(crate) socket: UnixStream,
    /// The engine's inbox.
    pub(crate) inbox: InboxHandle,
    /// The ring's place in its engine's count, given back when the ring ends.
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

/// The threads that read an engine's rings; they end within [`NAP`] of the engine stopping.
pub(crate) struct RingReaders {
    groups: Mutex<Vec<Arc<Group>>>,
    /// Gone when the serving engine stops.
    running: Weak<()>,
}

/// The rings of one thread.
struct Group {
    /// Rings handed over that the thread has not taken yet; `None` once the thread has ended
    /// (the engine stopped, or it panicked), so that nothing is handed to it any more.
    added: Mutex<Option<Vec<Incoming>>>,
    /// Bumped at every hand-over; the thread sleeps on it beside its rings' words.
    news: AtomicU32,
    /// Rings the thread reads or is about to.
    rings: AtomicUsize,
}

impl RingReaders {
    /// Readers for the engine that holds `running`'s `Arc`.
    pub(crate) fn new(running: Weak<()>) -> RingReaders {
        RingReaders {
            groups: Mutex::default(),
            running,
        }
    }

    /// Hands `incoming` to a thread with room, starting one when none has.
    ///
    /// # Errors
    /// The kernel has no `futex_waitv` (Linux 5.16 or later), or no thread could start.
    pub(crate) fn add(&self, incoming: Incoming) -> std::io::Result<()> {
        if self.running.strong_count() == 0 {
            return Err(std::io::Error::other("the engine is stopping"));
        }
        incoming.socket.set_nonblocking(true)?;
        let mut groups = self.groups.lock();
        groups.retain(|group| group.added.lock().is_some());
        let room = |group: &Arc<Group>| {
            group
                .rings
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |rings| {
                    (rings < RINGS_PER_THREAD).then_some(rings + 1)
                })
                .is_ok()
        };
        let mut incoming = Some(incoming);
        if let Some(group) = groups.iter().find(|group| room(group)) {
            let mut added = group.added.lock();
            match (added.as_mut(), incoming.take()) {
                (Some(added), Some(ring)) => added.push(ring),
                // The thread ended since the sweep above: a new one takes the ring.
                (None, ring) => {
                    incoming = ring;
                    group.rings.fetch_sub(1, Ordering::AcqRel);
                }
                (_, None) => {}
            }
            drop(added);
            if incoming.is_none() {
                group.news.fetch_add(1, Ordering::SeqCst);
                let _ = futex::wake(&group.news, futex::Flags::PRIVATE, 1);
                return Ok(());
            }
        }
        waitv_supported()?;
        // The first ring is in place before the thread starts, which takes what is there
        // before it first looks at `news`.
        let group = Arc::new(Group {
            rings: AtomicUsize::new(1),
            added: Mutex::new(Some(incoming.into_iter().collect())),
            news: AtomicU32::new(0),
        });
        let (reading, running) = (Arc::clone(&group), self.running.clone());
        std::thread::Builder::new()
            .name("ferry-messages".into())
            .spawn(move || read_rings(&reading, &running))?;
        groups.push(group);
        Ok(())
    }

    /// Threads started so far (at most one per [`RINGS_PER_THREAD`] rings read at once).
    #[cfg(test)]
    pub(crate) fn threads(&self) -> usize {
        self.groups.lock().len()
    }
}

/// Whether this kernel sleeps on several futex words at once; it is asked once.
fn waitv_supported() -> std::io::Result<()> {
    static SUPPORTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let supported = *SUPPORTED.get_or_init(|| {
        let word = AtomicU32::new(0);
        // The word does not hold 1, so a kernel with futex_waitv answers at once (EAGAIN).
        // Anything else (ENOSYS on kernels before 5.16, EPERM from a seccomp filter) means
        // the thread could not sleep on its rings and would spin.
        let waiters = [waiter(&word, 1, futex::WaitFlags::PRIVATE)];
        futex::waitv(
            &waiters,
            futex::WaitvFlags::empty(),
            None,
            futex::ClockId::Monotonic,
        ) == Err(rustix::io::Errno::AGAIN)
    });
    if supported {
        Ok(())
    } else {
        Err(std::io::Error::other(
            "futex_waitv is unavailable (Linux 5.16 or later, and not filtered out by seccomp), which reading message rings needs",
        ))
    }
}

/// A `futex_waitv` entry: sleep while `word` holds `value`.
fn waiter(word: &AtomicU32, value: u32, flags: futex::WaitFlags) -> futex::Wait {
    let mut wait = futex::Wait::new();
    wait.val = u64::from(value);
    wait.uaddr = futex::WaitPtr::new(word.as_ptr().cast());
    wait.flags = futex::WaitFlags::SIZE_U32 | flags;
    wait
}

/// A thread's loop: reads its group's rings until the engine stops.
fn read_rings(group: &Group, running: &Weak<()>) {
    /// Marks the group ended however the thread leaves (a panic included) and drops the
    /// rings handed to it that it never took, which closes their sockets.
    struct Ended<'a>(&'a Group);
    impl Drop for Ended<'_> {
        fn drop(&mut self) {
            drop(self.0.added.lock().take());
        }
    }
    let _ended = Ended(group);
    let mut seen = group.news.load(Ordering::SeqCst);
    let mut rings: Vec<Reading> = take_added(group);
    let mut last = Instant::now();
    let mut swept = Instant::now();
    loop {
        let news = group.news.load(Ordering::SeqCst);
        if news != seen {
            seen = news;
            rings.extend(take_added(group));
            last = Instant::now();
        }
        let mut busy = false;
        rings.retain_mut(|ring| match ring.read() {
            Ok(read) => {
                busy |= read;
                true
            }
            Err(end) => ring.end(end, group),
        });
        // Rings whose sender went away are let go every nap, also while others keep the
        // thread busy.
        let idle = !busy && last.elapsed() >= POLL;
        if idle || swept.elapsed() >= NAP {
            if running.strong_count() == 0 {
                for ring in &rings {
                    tracing::debug!(from = %ring.incoming.from, "a message ring ended: the engine stopped");
                }
                return;
            }
            rings.retain_mut(|ring| match ring.ended() {
                Ok(()) => true,
                Err(end) => ring.end(end, group),
            });
            swept = Instant::now();
        }
        if busy {
            last = Instant::now();
        } else if last.elapsed() < SPIN {
            std::hint::spin_loop();
        } else if !idle {
            std::thread::yield_now();
        } else {
            sleep(group, &rings, seen);
        }
    }
}

/// The rings handed to `group`'s thread since it last looked.
fn take_added(group: &Group) -> Vec<Reading> {
    group
        .added
        .lock()
        .as_mut()
        .map(|added| added.drain(..).map(Reading::new).collect())
        .unwrap_or_default()
}

/// Sleeps until a sender wakes a ring, a ring is handed over (`news` moves past `seen`) or
/// [`NAP`] passes ([`UNSENT_NAP`] while a sender's socket holds back verdicts); not at all
/// when a ring already holds a message.
fn sleep(group: &Group, rings: &[Reading], seen: u32) {
    for ring in rings {
        ring.state().store(SLEEPING, Ordering::SeqCst);
    }
    fence(Ordering::SeqCst);
    if !rings.iter().any(Reading::has_news) {
        let mut waiters = Vec::with_capacity(rings.len() + 1);
        waiters.push(waiter(&group.news, seen, futex::WaitFlags::PRIVATE));
        // Shared, not private: the wakers are other processes.
        waiters.extend(
            rings
                .iter()
                .map(|ring| waiter(ring.state(), SLEEPING, futex::WaitFlags::empty())),
        );
        let nap = match rings.iter().any(|ring| !ring.unsent.is_empty()) {
            true => UNSENT_NAP,
            false => NAP,
        };
        // The deadline is absolute on the monotonic clock. An early return (EAGAIN, EINTR,
        // the deadline) is harmless: the thread looks at its rings again either way.
        let now = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
        let nanos = now.tv_nsec + i64::from(nap.subsec_nanos());
        let deadline = futex::Timespec {
            tv_sec: now.tv_sec + nap.as_secs() as i64 + nanos / 1_000_000_000,
            tv_nsec: nanos % 1_000_000_000,
        };
        match futex::waitv(
            &waiters,
            futex::WaitvFlags::empty(),
            Some(&deadline),
            futex::ClockId::Monotonic,
        ) {
            Ok(_)
            | Err(
                rustix::io::Errno::AGAIN | rustix::io::Errno::INTR | rustix::io::Errno::TIMEDOUT,
            ) => {}
            // Checked before the first thread started; should the kernel refuse later all
            // the same, the thread naps instead of spinning.
            Err(error) => {
                static WARNED: std::sync::Once = std::sync::Once::new();
                WARNED.call_once(|| tracing::warn!(%error, "futex_waitv failed; message ring readers nap instead of sleeping on their rings"));
                std::thread::sleep(nap);
            }
        }
    }
    for ring in rings {
        ring.state().store(AWAKE, Ordering::SeqCst);
    }
}

/// Why a ring stopped being read.
enum End {
    /// As rings end (the sender or the engine went away), in words.
    Ended(&'static str),
    /// Closed by this side, for this reason.
    Closed(String),
}

/// One ring being read.
struct Reading {
    incoming: Incoming,
    reader: Reader,
    /// Verdicts the socket has not taken yet, and since when some are waiting.
    unsent: Vec<u8>,
    unsent_since: Option<Instant>,
}

impl Reading {
    fn new(incoming: Incoming) -> Reading {
        Reading {
            incoming,
            reader: Reader::default(),
            unsent: Vec::new(),
            unsent_since: None,
        }
    }

    fn state(&self) -> &AtomicU32 {
        self.incoming.memory.word32(STATE_OFFSET)
    }

    fn has_news(&self) -> bool {
        self.reader.has_news(self.incoming.memory.words())
    }

    /// Takes up to [`BURST`] messages into the inbox and queues their verdicts; whether it
    /// took any.
    fn read(&mut self) -> Result<bool, End> {
        self.flush()?;
        let mut took = false;
        for _ in 0..BURST {
            let words = self.incoming.memory.words();
            let payload = match self.reader.pop(words, MAX_NOTIFICATION_BYTES) {
                Ok(Some(_)) if is_closed(words) => {
                    return Err(End::Ended("the sender closed the ring"))
                }
                Ok(Some(payload)) => payload,
                Ok(None) => break,
                Err(corrupt) => return Err(End::Closed(corrupt.to_string())),
            };
            took = true;
            // A delivery is recorded in the ring before the hand-over and answered over the
            // socket after it, so the send (a few microseconds) is not on the notification's
            // way: a receiver that acts on it at once and exits before the answer left still
            // leaves the sender its record's fate.
            let verdict = match self.incoming.inbox.reserve(&self.incoming.from, payload) {
                Ok(reserved) => {
                    self.reader.delivering(words);
                    reserved.deliver();
                    Verdict::Delivered
                }
                Err(refusal) => Verdict::Refused(refusal.to_string()),
            };
            self.unsent.extend(verdict.encode());
            self.flush()?;
        }
        Ok(took)
    }

    /// Sends what the socket takes of the queued verdicts, without waiting and without
    /// SIGPIPE (a sender that closed its end mid-verdict must not kill this process).
    fn flush(&mut self) -> Result<(), End> {
        while !self.unsent.is_empty() {
            match rustix::net::send(
                &self.incoming.socket,
                &self.unsent,
                rustix::net::SendFlags::NOSIGNAL | rustix::net::SendFlags::DONTWAIT,
            ) {
                Ok(sent) => {
                    self.unsent.drain(..sent);
                }
                Err(rustix::io::Errno::INTR) => {}
                Err(rustix::io::Errno::AGAIN) => break,
                Err(error) => {
                    return Err(End::Closed(format!("answering the sender failed: {error}")))
                }
            }
        }
        if self.unsent.is_empty() {
            self.unsent_since = None;
        } else if self.unsent.len() > MAX_UNSENT {
            return Err(End::Closed(format!(
                "the sender left {} bytes of verdicts unread",
                self.unsent.len()
            )));
        } else {
            self.unsent_since.get_or_insert_with(Instant::now);
        }
        Ok(())
    }

    /// Whether the ring goes on: the sender may have closed it or let go of its end of the
    /// socket, or left its verdicts unread too long. A sender that writes to the socket
    /// breaks the protocol.
    fn ended(&mut self) -> Result<(), End> {
        if is_closed(self.incoming.memory.words()) {
            return Err(End::Ended("the sender closed the ring"));
        }
        self.flush()?;
        if self
            .unsent_since
            .is_some_and(|since| since.elapsed() > VERDICT_TIMEOUT)
        {
            return Err(End::Closed(format!(
                "the sender left its verdicts unread for over {} s",
                VERDICT_TIMEOUT.as_secs()
            )));
        }
        let mut byte = [0u8; 1];
        match rustix::net::recv(
            &self.incoming.socket,
            &mut byte,
            rustix::net::RecvFlags::PEEK | rustix::net::RecvFlags::DONTWAIT,
        ) {
            Ok((0, _)) => Err(End::Ended("the sender closed its end")),
            Ok(_) => Err(End::Closed(
                "the sender wrote to a socket it must only read".into(),
            )),
            Err(rustix::io::Errno::AGAIN) => Ok(()),
            Err(error) => Err(End::Closed(format!(
                "watching the sender's socket failed: {error}"
            ))),
        }
    }

    /// Logs why the ring ended and gives its place in `group` back; always `false`, for
    /// `retain_mut`.
    fn end(&self, end: End, group: &Group) -> bool {
        let from = &self.incoming.from;
        match end {
            End::Ended(reason) => tracing::debug!(%from, reason, "a message ring ended"),
            End::Closed(reason) => tracing::warn!(%from, %reason, "closed a message ring"),
        }
        group.rings.fetch_sub(1, Ordering::AcqRel);
        false
    }
}

#[cfg(test)]
mod tests {
    use super::super::ring::{Pushed, Writer};
    use super::*;

    #[tokio::test]
    async fn a_sender_that_reads_no_verdicts_loses_its_ring_without_the_reader_ever_waiting() {
        let (memory, fd) = super::super::create_ring().unwrap();
        let seen = super::super::map_ring(&fd).unwrap();
        let (reading_end, sending_end) = UnixStream::pair().unwrap();
        reading_end.set_nonblocking(true).unwrap();
        rustix::net::sockopt::set_socket_send_buffer_size(&reading_end, 4096).unwrap();
        // One slot: every message after the first is refused with a reason of ~150 bytes.
        let (inbox, _notifications) =
            InboxHandle::standalone(1, 1 << 20, tokio::runtime::Handle::current());
        let count = Arc::new(AtomicUsize::new(0));
        let mut reading = Reading::new(Incoming {
            memory: seen,
            from: "prefill:1".into(),
            socket: reading_end,
            inbox,
            _slot: RingSlot::take(&count, 1).unwrap(),
        });
        let mut writer = Writer::default();
        let mut closed = None;
        for _ in 0..10_000 {
            while writer.push(memory.words(), b"refused").unwrap() == Pushed::Published {}
            let started = Instant::now();
            let read = reading.read();
            assert!(started.elapsed() < Duration::from_secs(1), "read waited");
            if let Err(End::Closed(reason)) = read {
                closed = Some(reason);
                break;
            }
            assert!(matches!(read, Ok(true)), "the reader took nothing");
        }
        let reason = closed.expect("the ring was never closed");
        assert!(reason.contains("verdicts unread"), "{reason}");
        assert!(reading.unsent.len() > MAX_UNSENT);
        drop(sending_end);
    }
}
