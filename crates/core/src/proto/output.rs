//! Answers queued for the peer: header and control bytes gathered into one buffer, and the
//! bytes of read answers sent from their source without a copy.

use super::Landing;
use crate::memory::RawSource;
use crate::wire::Header;
use std::collections::VecDeque;

enum Chunk<S> {
    Bytes(Vec<u8>),
    Span(S),
}

/// What is waiting to be written to the peer, in order.
pub(super) struct Output<S> {
    chunks: VecDeque<Chunk<S>>,
    /// Bytes of the first chunk already written.
    sent: usize,
    /// Bytes queued and not yet written.
    queued: usize,
    /// Of those, bytes this session made and holds (headers, acks, descriptors), as opposed
    /// to read answers' spans, which are registered memory sent from where it is.
    copied: usize,
}

impl<S: Landing> Output<S> {
    pub(super) fn new() -> Self {
        Output {
            chunks: VecDeque::new(),
            sent: 0,
            queued: 0,
            copied: 0,
        }
    }

    pub(super) fn is_empty(&self) -> bool {
        self.chunks.is_empty()
    }

    /// Bytes queued and not yet written, read answers' spans included.
    pub(super) fn queued(&self) -> usize {
        self.queued
    }

    /// Bytes queued and not yet written that this session allocated (not spans).
    pub(super) fn copied(&self) -> usize {
        self.copied
    }

    /// Queues a frame whose body is `body`.
    pub(super) fn frame(&mut self, header: Header, body: &[u8]) {
        self.bytes(&header.encode());
        self.bytes(body);
    }

    /// Queues `added` (a header, a body, a tag) after what is queued.
    pub(super) fn bytes(&mut self, added: &[u8]) {
        let bytes = match self.chunks.back_mut() {
            Some(Chunk::Bytes(bytes)) => bytes,
            _ => {
                self.chunks.push_back(Chunk::Bytes(Vec::new()));
                match self.chunks.back_mut() {
                    Some(Chunk::Bytes(bytes)) => bytes,
                    _ => return,
                }
            }
        };
        bytes.extend_from_slice(added);
        self.queued += added.len();
        self.copied += added.len();
    }

    /// Queues a frame whose body is the bytes of `span`, sent from where they are.
    pub(super) fn frame_from(&mut self, header: Header, span: S) {
        self.frame(header, &[]);
        self.queued += span.len();
        self.chunks.push_back(Chunk::Span(span));
    }

    /// The next bytes to write: this session's own, or a read answer's span in place.
    pub(super) fn front(&self) -> Option<RawSource<'_>> {
        let bytes = match self.chunks.front()? {
            Chunk::Bytes(bytes) => RawSource::from_slice(bytes),
            Chunk::Span(span) => span.source(),
        };
        bytes.after(self.sent)
    }

    /// Records that `len` bytes of [`Self::front`] were written.
    pub(super) fn advance(&mut self, len: usize) {
        let mut len = len.min(self.queued);
        self.queued -= len;
        while let Some(front) = self.chunks.front() {
            let (size, owned) = match front {
                Chunk::Bytes(bytes) => (bytes.len(), true),
                Chunk::Span(span) => (span.len(), false),
            };
            if self.sent >= size {
                self.chunks.pop_front();
                self.sent = 0;
                continue;
            }
            if len == 0 {
                return;
            }
            let step = len.min(size - self.sent);
            self.sent += step;
            len -= step;
            if owned {
                self.copied -= step;
            }
        }
    }
}
