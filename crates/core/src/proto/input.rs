//! Bytes read from the peer and not yet handled.

use super::served::Landing;
use crate::memory::RawDestination;

/// A fixed buffer the driver reads into when the bytes are not going straight into a
/// destination. Everything in it is handled before the next read, except while the session
/// waits for an event's answer.
pub(super) struct Input {
    buffer: Box<[u8]>,
    start: usize,
    end: usize,
}

impl Input {
    /// Size of the buffer. Data pieces at least this long are read straight into their
    /// destination instead.
    pub(super) const CAPACITY: usize = 16 << 10;

    pub(super) fn new() -> Input {
        Input {
            buffer: vec![0u8; Self::CAPACITY].into_boxed_slice(),
            start: 0,
            end: 0,
        }
    }

    pub(super) fn is_empty(&self) -> bool {
        self.start == self.end
    }

    /// Up to `max` buffered bytes, taken out of the buffer.
    pub(super) fn take(&mut self, max: usize) -> &[u8] {
        let start = self.start;
        let len = max.min(self.end - start);
        self.start += len;
        &self.buffer[start..start + len]
    }

    /// Where the next socket read goes, and whether it goes straight into `landing` (a data
    /// piece filled up to byte `filled`): with nothing buffered and at least a buffer's worth
    /// of the piece left, the read fills it in place, with no copy; otherwise it goes into
    /// this buffer's free room. `None` when the buffer is full.
    pub(super) fn read_target<'a, L: Landing>(
        &'a mut self,
        landing: Option<(&'a mut L, usize)>,
    ) -> Option<(RawDestination<'a>, bool)> {
        if self.is_empty() {
            if let Some((span, filled)) = landing {
                if span.len().saturating_sub(filled) >= Self::CAPACITY {
                    if let Ok(destination) = span.destination() {
                        return Some((destination.after(filled), true));
                    }
                }
            }
        }
        let free = self.free();
        (!free.is_empty()).then(|| (RawDestination::from_slice(free), false))
    }

    /// The free space to read into; empty only when the buffer is full.
    pub(super) fn free(&mut self) -> &mut [u8] {
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        } else if self.end == self.buffer.len() {
            self.buffer.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        &mut self.buffer[self.end..]
    }

    /// Records that `len` bytes were read into [`Self::free`].
    pub(super) fn filled(&mut self, len: usize) {
        self.end = (self.end + len).min(self.buffer.len());
    }
}
