//! The message ring: one writer process, one reader process, records of bytes in shared
//! words. Each side keeps its own position and trusts nothing it reads from the other's:
//! a position or length that cannot be is a [`Corrupt`] ring, never a panic or a read out of
//! bounds.
//!
//! Layout, in 8-byte words:
//! - word 0: bytes the writer has published (only the writer stores it);
//! - word 8: bytes the reader has taken (only the reader stores it);
//! - word 9: bytes of records the reader has handed to its engine's inbox, stored before it
//!   hands each over (only the reader stores it): the verdict on a delivered record goes
//!   over the socket after the hand-over, and a sender whose socket ends before that verdict
//!   came reads its record's fate here;
//! - word 16: the reader's futex word ([`AWAKE`] or [`SLEEPING`]), reached as a 32-bit atomic;
//! - word 24: nonzero once the writer has closed the ring (only the writer stores it): the
//!   reader then delivers nothing more from it;
//! - from word 32: the data, a circle of records, each a length word and the payload padded
//!   to whole words; a record may wrap around the circle's end.

use std::sync::atomic::{AtomicU64, Ordering};

const PUBLISHED: usize = 0;
const TAKEN: usize = 8;
/// Index of the word of bytes delivered through (only the reader stores it).
pub(crate) const DELIVERED: usize = 9;
/// Byte offset of the reader's futex word.
pub(crate) const STATE_OFFSET: usize = 16 * 8;
/// Index of the first data word.
pub(crate) const DATA: usize = 32;
/// Index of the word the writer sets when it closes the ring.
const CLOSED: usize = 24;

/// The reader is polling the ring.
pub(crate) const AWAKE: u32 = 0;
/// The reader sleeps on its futex word until the writer wakes it.
pub(crate) const SLEEPING: u32 = 1;

/// Bytes of shared memory one ring takes: the header and 1 MiB of data, room for fifteen of
/// the largest notifications.
pub(crate) const RING_BYTES: usize = (DATA * 8) + (1 << 20);

/// The ring's words hold what no writer of this protocol writes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the message ring is corrupt: {0}")]
pub(crate) struct Corrupt(pub(crate) String);

/// Bytes a record of `len` payload bytes takes in the ring.
fn record_bytes(len: u64) -> u64 {
    8 + len.div_ceil(8) * 8
}

fn data_words(words: &[AtomicU64]) -> &[AtomicU64] {
    words.get(DATA..).unwrap_or(&[])
}

/// Bytes of records the reader has decided on, up to the last one it handed over
/// ([`Reader::delivering`]): a record that ends at or before it was delivered, unless the
/// reader refused it, which it answers before it takes the next record.
pub(crate) fn delivered_through(words: &[AtomicU64]) -> u64 {
    words[DELIVERED].load(Ordering::Acquire)
}

/// Whether the writer has closed the ring ([`Writer::close`]).
pub(crate) fn is_closed(words: &[AtomicU64]) -> bool {
    words[CLOSED].load(Ordering::SeqCst) != 0
}

/// The writing end's state: where its next record goes.
#[derive(Debug, Default)]
pub(crate) struct Writer {
    written: u64,
}

/// What [`Writer::push`] did.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Pushed {
    /// The record is in the ring and published.
    Published,
    /// Not enough room until the reader takes more.
    Full,
}

impl Writer {
    /// Marks the ring closed: the reader delivers no record it has not delivered yet.
    pub(crate) fn close(&self, words: &[AtomicU64]) {
        words[CLOSED].store(1, Ordering::SeqCst);
    }

    /// Appends `payload` as one record and publishes it, or reports the ring full. Payloads
    /// larger than the ring can ever hold are refused as corrupt use.
    pub(crate) fn push(&mut self, words: &[AtomicU64], payload: &[u8]) -> Result<Pushed, Corrupt> {
        if !self.write(words, payload)? {
            return Ok(Pushed::Full);
        }
        self.publish(words);
        Ok(Pushed::Published)
    }

    /// Appends `payload` as one record without publishing it: the reader sees it only once
    /// [`Self::publish`] (or a store of [`Self::position`] into word 0 by someone else, a GPU
    /// after the copies the record announces) has published it. False when the ring has no
    /// room until the reader takes more; errors as [`Self::push`].
    pub(crate) fn write(&mut self, words: &[AtomicU64], payload: &[u8]) -> Result<bool, Corrupt> {
        let data = data_words(words);
        let capacity = data.len() as u64 * 8;
        let needed = record_bytes(payload.len() as u64);
        if needed > capacity {
            return Err(Corrupt(format!(
                "a record of {} bytes does not fit a ring of {capacity}",
                payload.len()
            )));
        }
        let taken = words[TAKEN].load(Ordering::Acquire);
        let used = self.written.wrapping_sub(taken);
        if used > capacity {
            return Err(Corrupt(format!(
                "the reader claims to have taken {taken} bytes of the {} written",
                self.written
            )));
        }
        if capacity - used < needed {
            return Ok(false);
        }
        let slots = data.len();
        let first = (self.written / 8) as usize;
        data[first % slots].store(payload.len() as u64, Ordering::Relaxed);
        for (index, chunk) in payload.chunks(8).enumerate() {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            data[(first + 1 + index) % slots].store(u64::from_le_bytes(word), Ordering::Relaxed);
        }
        self.written = self.written.wrapping_add(needed);
        Ok(true)
    }

    /// Publishes every record written so far.
    pub(crate) fn publish(&self, words: &[AtomicU64]) {
        words[PUBLISHED].store(self.written, Ordering::Release);
    }

    /// The position word 0 holds once every record written so far is published.
    pub(crate) fn position(&self) -> u64 {
        self.written
    }

    /// Whether word 0 holds [`Self::position`]: every record written is published.
    pub(crate) fn is_published(&self, words: &[AtomicU64]) -> bool {
        words[PUBLISHED].load(Ordering::Acquire) == self.written
    }

    /// Forgets the records written after `position` (an earlier [`Self::position`]), none
    /// of which may be published.
    pub(crate) fn rewind(&mut self, position: u64) {
        self.written = position;
    }
}

/// The reading end's state: where the next record starts.
#[derive(Debug, Default)]
pub(crate) struct Reader {
    taken: u64,
}

impl Reader {
    /// Takes the next record, `None` when the writer has published nothing more.
    pub(crate) fn pop(
        &mut self,
        words: &[AtomicU64],
        max_len: usize,
    ) -> Result<Option<Vec<u8>>, Corrupt> {
        let data = data_words(words);
        let capacity = data.len() as u64 * 8;
        let published = words[PUBLISHED].load(Ordering::Acquire);
        let ready = published.wrapping_sub(self.taken);
        if ready == 0 {
            return Ok(None);
        }
        if ready > capacity || ready % 8 != 0 {
            return Err(Corrupt(format!(
                "the writer claims {published} bytes written where {} were taken",
                self.taken
            )));
        }
        let slots = data.len();
        let first = (self.taken / 8) as usize;
        let len = data[first % slots].load(Ordering::Relaxed);
        if len > max_len as u64 || record_bytes(len) > ready {
            return Err(Corrupt(format!(
                "a record claims {len} bytes where at most {} fit and {ready} are written",
                max_len.min(ready.saturating_sub(8) as usize)
            )));
        }
        let len = len as usize;
        let mut payload = Vec::with_capacity(len.div_ceil(8) * 8);
        for index in 0..len.div_ceil(8) {
            let word = data[(first + 1 + index) % slots].load(Ordering::Relaxed);
            payload.extend_from_slice(&word.to_le_bytes());
        }
        payload.truncate(len);
        self.taken = self.taken.wrapping_add(record_bytes(len as u64));
        words[TAKEN].store(self.taken, Ordering::Release);
        Ok(Some(payload))
    }

    /// Records, before the hand-over, that the record taken last is being handed over: the
    /// delivered position moves to its end.
    pub(crate) fn delivering(&self, words: &[AtomicU64]) {
        words[DELIVERED].store(self.taken, Ordering::Release);
    }

    /// Whether the writer has published a record not yet taken.
    pub(crate) fn has_news(&self, words: &[AtomicU64]) -> bool {
        words[PUBLISHED].load(Ordering::SeqCst) != self.taken
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ring(data_bytes: usize) -> Vec<AtomicU64> {
        (0..DATA + data_bytes / 8)
            .map(|_| AtomicU64::new(0))
            .collect()
    }

    #[test]
    fn a_written_record_is_read_only_once_published_and_a_rewound_one_never() {
        let words = ring(256);
        let (mut writer, mut reader) = (Writer::default(), Reader::default());
        let start = writer.position();
        assert!(writer.write(&words, b"rewound").unwrap());
        assert_eq!(reader.pop(&words, 64).unwrap(), None);
        assert!(!writer.is_published(&words));
        writer.rewind(start);
        assert!(writer.write(&words, b"kept").unwrap());
        assert_eq!(reader.pop(&words, 64).unwrap(), None);
        words[PUBLISHED].store(writer.position(), Ordering::Release);
        assert!(writer.is_published(&words));
        assert_eq!(reader.pop(&words, 64).unwrap(), Some(b"kept".to_vec()));
        assert_eq!(writer.push(&words, b"next").unwrap(), Pushed::Published);
        assert_eq!(reader.pop(&words, 64).unwrap(), Some(b"next".to_vec()));
        assert_eq!(reader.pop(&words, 64).unwrap(), None);
    }

    #[test]
    fn records_of_every_length_arrive_whole_and_in_order_across_the_wrap() {
        let words = ring(256);
        let (mut writer, mut reader) = (Writer::default(), Reader::default());
        let mut next = 0u8;
        let mut expected = std::collections::VecDeque::new();
        for round in 0..400usize {
            let len = (round * 7) % 61;
            let payload: Vec<u8> = (0..len)
                .map(|_| {
                    next = next.wrapping_add(1);
                    next
                })
                .collect();
            match writer.push(&words, &payload).unwrap() {
                Pushed::Published => expected.push_back(payload),
                Pushed::Full => {
                    while let Some(got) = reader.pop(&words, 64).unwrap() {
                        assert_eq!(Some(got), expected.pop_front());
                    }
                    assert_eq!(writer.push(&words, &payload).unwrap(), Pushed::Published);
                    expected.push_back(payload);
                }
            }
            if round % 3 == 0 {
                if let Some(got) = reader.pop(&words, 64).unwrap() {
                    assert_eq!(Some(got), expected.pop_front());
                }
            }
        }
        while let Some(got) = reader.pop(&words, 64).unwrap() {
            assert_eq!(Some(got), expected.pop_front());
        }
        assert!(expected.is_empty());
        assert!(!reader.has_news(&words));
        assert!(!is_closed(&words));
        writer.close(&words);
        assert!(is_closed(&words));
    }

    #[test]
    fn a_full_ring_refuses_until_the_reader_takes_and_a_record_larger_than_it_never_fits() {
        let words = ring(64);
        let (mut writer, mut reader) = (Writer::default(), Reader::default());
        assert_eq!(writer.push(&words, &[1; 24]).unwrap(), Pushed::Published);
        assert_eq!(writer.push(&words, &[2; 24]).unwrap(), Pushed::Published);
        assert_eq!(writer.push(&words, &[3; 1]).unwrap(), Pushed::Full);
        assert_eq!(reader.pop(&words, 64).unwrap(), Some(vec![1; 24]));
        assert_eq!(writer.push(&words, &[3; 1]).unwrap(), Pushed::Published);
        assert!(writer.push(&words, &[0; 57]).is_err());
    }

    #[test]
    fn a_reader_refuses_lengths_and_positions_no_writer_wrote() {
        let words = ring(64);
        let mut writer = Writer::default();
        writer.push(&words, &[9; 8]).unwrap();
        // A length beyond what was published.
        words[DATA].store(40, Ordering::Relaxed);
        assert!(Reader::default().pop(&words, 64).is_err());
        // A length beyond the caller's limit.
        words[DATA].store(8, Ordering::Relaxed);
        assert!(Reader::default().pop(&words, 4).is_err());
        // More published than the ring holds, or not a whole number of words.
        words[PUBLISHED].store(1 << 20, Ordering::Relaxed);
        assert!(Reader::default().pop(&words, 64).is_err());
        words[PUBLISHED].store(12, Ordering::Relaxed);
        assert!(Reader::default().pop(&words, 64).is_err());
        // A writer told that more was taken than it wrote.
        words[TAKEN].store(1 << 40, Ordering::Relaxed);
        assert!(writer.push(&words, &[1]).is_err());
    }
}
