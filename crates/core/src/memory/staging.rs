//! Pinned staging memory for GPU spans that cross TCP. Small spans get a slice of a shared
//! pinned chunk, carved front to back, so a frame of many tiny entries pins one chunk rather
//! than a buffer per entry; large spans get a buffer of their own from a pool of power-of-two
//! sizes. Both are reused, never freed and pinned again per transfer.

use crate::cuda::{Context, CudaError, PinnedBuffer, PinnedChunk, PinnedSlice};
use crate::error::{Error, Result};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

/// Spans up to this length are carved from shared chunks.
const SLICE_LIMIT: usize = 64 << 10;
/// Bytes of one shared chunk.
const CHUNK_BYTES: usize = 4 << 20;
/// Slices start on this boundary, a cache line, so neighbours never share one.
const SLICE_ALIGN: usize = 64;
/// Chunks kept for reuse beside the one being carved; more are freed once their slices end.
const KEPT_CHUNKS: usize = 16;
/// Whole buffers come in powers of two from this size up.
const SMALLEST: usize = SLICE_LIMIT * 2;
/// Bytes of whole buffers of one size kept for reuse; more are freed.
const KEPT_PER_SIZE: usize = 64 << 20;

/// What stands in for a span's GPU bytes: at least as many pinned bytes as the span has.
/// Hand it back with [`Staging::release`]; dropped otherwise, its memory is freed.
#[derive(Debug)]
pub(super) enum Staging {
    /// A slice of a chunk shared with other small spans.
    Slice(PinnedSlice),
    /// A buffer of its own, returned to the pool on drop.
    Whole(PinnedBuffer),
}

impl Staging {
    /// Pinned memory for a span of `len` bytes of GPU `ordinal`'s memory.
    pub(super) fn new(ordinal: u32, len: usize) -> Result<Staging> {
        if len > SLICE_LIMIT {
            return Ok(whole_buffer(ordinal, len).map(Staging::Whole)?);
        }
        let mut carver = carver().lock();
        carver
            .slice(len, || {
                PinnedBuffer::new(Context::get(ordinal)?, CHUNK_BYTES).map(PinnedChunk::new)
            })
            .map(Staging::Slice)
    }

    /// The address GPUs use for the first byte.
    pub(super) fn addr(&self) -> u64 {
        match self {
            Staging::Slice(slice) => slice.addr(),
            Staging::Whole(buffer) => buffer.addr(),
        }
    }

    /// The first `len` bytes, for the host to read.
    pub(super) fn bytes(&self, len: usize) -> &[u8] {
        match self {
            Staging::Slice(slice) => &slice.as_slice()[..len],
            Staging::Whole(buffer) => &buffer.as_slice()[..len],
        }
    }

    /// Gives the memory back for reuse: a whole buffer to its pool; a slice ends, and its
    /// chunk is carved again once all its slices have.
    pub(super) fn release(self) {
        if let Staging::Whole(buffer) = self {
            give_back(buffer);
        }
    }

    /// The first `len` bytes, for the host to fill.
    pub(super) fn bytes_mut(&mut self, len: usize) -> &mut [u8] {
        match self {
            Staging::Slice(slice) => &mut slice.as_mut_slice()[..len],
            Staging::Whole(buffer) => &mut buffer.as_mut_slice()[..len],
        }
    }
}

/// One shared chunk, as the carver sees it: it hands out slices and starts over once none of
/// its slices is left.
pub(super) trait Chunk {
    /// What the chunk hands out.
    type Slice;

    /// The next `len` bytes, at a multiple of `align`, or `None` when they do not fit.
    fn carve(self: &Arc<Self>, len: usize, align: usize) -> Option<Self::Slice>;

    /// Starts over from the front when no slice of `chunk` is alive; `false` otherwise.
    fn rewind(chunk: &mut Arc<Self>) -> bool;
}

impl Chunk for PinnedChunk {
    type Slice = PinnedSlice;

    fn carve(self: &Arc<Self>, len: usize, align: usize) -> Option<PinnedSlice> {
        PinnedChunk::carve(self, len, align)
    }

    fn rewind(chunk: &mut Arc<Self>) -> bool {
        PinnedChunk::rewind(chunk)
    }
}

/// Hands out slices of shared chunks: from the chunk being carved while it has room (from its
/// front again whenever its earlier slices have all ended), then from a kept chunk whose
/// slices have all ended, and only then from a new chunk.
pub(super) struct Carver<C> {
    current: Option<Arc<C>>,
    /// Chunks carved before, some with slices still alive; at most [`KEPT_CHUNKS`].
    kept: Vec<Arc<C>>,
}

impl<C: Chunk> Carver<C> {
    pub(super) const fn new() -> Carver<C> {
        Carver {
            current: None,
            kept: Vec::new(),
        }
    }

    /// A slice of `len` bytes (at most a chunk's size), allocating a chunk with `allocate`
    /// only when no chunk has room.
    ///
    /// # Errors
    /// `allocate`'s error; [`Error::Internal`] for a `len` larger than a new chunk holds
    /// (callers give larger spans a buffer of their own).
    pub(super) fn slice(
        &mut self,
        len: usize,
        allocate: impl FnOnce() -> Result<Arc<C>, CudaError>,
    ) -> Result<C::Slice> {
        if let Some(current) = &mut self.current {
            C::rewind(current);
            if let Some(slice) = current.carve(len, SLICE_ALIGN) {
                return Ok(slice);
            }
        }
        self.kept.extend(self.current.take());
        if let Some(index) = self.kept.iter_mut().position(|chunk| C::rewind(chunk)) {
            self.current = Some(self.kept.swap_remove(index));
        } else {
            self.current = Some(allocate()?);
        }
        if self.kept.len() > KEPT_CHUNKS {
            // The oldest goes: its memory is freed once its last slice ends.
            self.kept.remove(0);
        }
        self.current
            .as_ref()
            .and_then(|chunk| chunk.carve(len, SLICE_ALIGN))
            .ok_or_else(|| {
                Error::internal(format!(
                    "a staging slice of {len} bytes does not fit a fresh staging chunk"
                ))
            })
    }
}

fn carver() -> &'static Mutex<Carver<PinnedChunk>> {
    static CARVER: Mutex<Carver<PinnedChunk>> = Mutex::new(Carver::new());
    &CARVER
}

fn pool() -> &'static Mutex<HashMap<usize, Vec<PinnedBuffer>>> {
    static POOL: OnceLock<Mutex<HashMap<usize, Vec<PinnedBuffer>>>> = OnceLock::new();
    POOL.get_or_init(Mutex::default)
}

fn whole_buffer(ordinal: u32, len: usize) -> Result<PinnedBuffer, CudaError> {
    let size = len.next_power_of_two().max(SMALLEST);
    let reused = pool().lock().get_mut(&size).and_then(Vec::pop);
    match reused {
        Some(buffer) => Ok(buffer),
        None => PinnedBuffer::new(Context::get(ordinal)?, size),
    }
}

fn give_back(buffer: PinnedBuffer) {
    let mut pool = pool().lock();
    let kept = pool.entry(buffer.len()).or_default();
    if (kept.len() + 1) * buffer.len() <= KEPT_PER_SIZE {
        kept.push(buffer);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::place;

    /// A chunk of `capacity` bytes with no memory behind it: its slices are (offset, len).
    struct FakeChunk {
        id: usize,
        capacity: usize,
        used: Mutex<usize>,
    }

    /// A slice of a fake chunk; keeps the chunk alive, as a pinned slice does.
    struct FakeSlice {
        chunk: Arc<FakeChunk>,
        offset: usize,
        len: usize,
    }

    impl Chunk for FakeChunk {
        type Slice = FakeSlice;

        fn carve(self: &Arc<Self>, len: usize, align: usize) -> Option<FakeSlice> {
            let mut used = self.used.lock();
            let (offset, end) = place(*used, len, align, self.capacity)?;
            *used = end;
            Some(FakeSlice {
                chunk: Arc::clone(self),
                offset,
                len,
            })
        }

        fn rewind(chunk: &mut Arc<Self>) -> bool {
            match Arc::get_mut(chunk) {
                Some(chunk) => {
                    *chunk.used.get_mut() = 0;
                    true
                }
                None => false,
            }
        }
    }

    /// A carver whose chunks hold `capacity` bytes and count how many were allocated.
    struct Bench {
        carver: Carver<FakeChunk>,
        capacity: usize,
        allocated: usize,
    }

    impl Bench {
        fn new(capacity: usize) -> Bench {
            Bench {
                carver: Carver::new(),
                capacity,
                allocated: 0,
            }
        }

        fn slice(&mut self, len: usize) -> FakeSlice {
            let (capacity, id) = (self.capacity, self.allocated);
            let mut fresh = false;
            let slice = self
                .carver
                .slice(len, || {
                    fresh = true;
                    Ok(Arc::new(FakeChunk {
                        id,
                        capacity,
                        used: Mutex::new(0),
                    }))
                })
                .unwrap();
            self.allocated += usize::from(fresh);
            slice
        }
    }

    /// Fails when two slices of one chunk overlap.
    fn assert_disjoint<'a>(slices: impl IntoIterator<Item = &'a FakeSlice>) {
        let mut ranges: Vec<(usize, usize, usize)> = slices
            .into_iter()
            .map(|slice| (slice.chunk.id, slice.offset, slice.offset + slice.len))
            .collect();
        ranges.sort();
        for pair in ranges.windows(2) {
            if pair[0].0 == pair[1].0 {
                assert!(pair[0].2 <= pair[1].1, "overlapping slices {pair:?}");
            }
        }
    }

    #[test]
    fn many_tiny_spans_share_one_chunk_instead_of_a_buffer_each() {
        let mut bench = Bench::new(CHUNK_BYTES);
        let slices: Vec<FakeSlice> = (0..10_000)
            .map(|index| bench.slice(1 + index % 300))
            .collect();
        assert_eq!(
            bench.allocated, 1,
            "ten thousand spans of at most 300 bytes pin one chunk"
        );
        assert_disjoint(&slices);
        assert!(slices.iter().all(|slice| slice.offset % SLICE_ALIGN == 0));
        assert!(slices
            .iter()
            .all(|slice| slice.offset + slice.len <= CHUNK_BYTES));
    }

    #[test]
    fn a_full_chunk_is_followed_by_a_new_one_and_reused_once_its_slices_end() {
        // Four 1000-byte slices (1024 apart) fill a chunk of 4096 bytes.
        let mut bench = Bench::new(4096);
        let first: Vec<FakeSlice> = (0..4).map(|_| bench.slice(1000)).collect();
        assert_eq!(bench.allocated, 1);
        let second: Vec<FakeSlice> = (0..4).map(|_| bench.slice(1000)).collect();
        assert_eq!(bench.allocated, 2, "the fifth slice needs a second chunk");
        assert_disjoint(first.iter().chain(&second));
        drop(first);
        let third: Vec<FakeSlice> = (0..4).map(|_| bench.slice(1000)).collect();
        assert_eq!(
            bench.allocated, 2,
            "the first chunk is carved again once its slices ended"
        );
        assert!(third.iter().all(|slice| slice.chunk.id == 0));
        assert_eq!(
            third.iter().map(|slice| slice.offset).collect::<Vec<_>>(),
            [0, 1024, 2048, 3072]
        );
        // A chunk still in use is never carved again: with both busy, a third one comes.
        let _more = bench.slice(1000);
        assert_eq!(bench.allocated, 3);
    }

    #[test]
    fn an_idle_chunk_is_carved_from_its_front_again() {
        let mut bench = Bench::new(4096);
        for _ in 0..100 {
            let slice = bench.slice(3000);
            assert_eq!((slice.chunk.id, slice.offset), (0, 0));
        }
        assert_eq!(bench.allocated, 1);
    }

    #[test]
    fn chunks_kept_for_reuse_are_bounded() {
        let mut bench = Bench::new(64);
        let busy: Vec<FakeSlice> = (0..KEPT_CHUNKS * 3).map(|_| bench.slice(64)).collect();
        assert_eq!(bench.allocated, KEPT_CHUNKS * 3);
        assert!(bench.carver.kept.len() <= KEPT_CHUNKS);
        drop(busy);
        // Only the kept chunks and the current one are left to reuse.
        let again: Vec<FakeSlice> = (0..=KEPT_CHUNKS).map(|_| bench.slice(64)).collect();
        assert_eq!(bench.allocated, KEPT_CHUNKS * 3, "reused, not allocated");
        assert_disjoint(&again);
        let _one_more = bench.slice(64);
        assert_eq!(bench.allocated, KEPT_CHUNKS * 3 + 1);
    }

    #[test]
    fn a_slice_larger_than_a_chunk_is_refused() {
        let mut carver: Carver<FakeChunk> = Carver::new();
        let outcome = carver.slice(100, || {
            Ok(Arc::new(FakeChunk {
                id: 0,
                capacity: 64,
                used: Mutex::new(0),
            }))
        });
        match outcome {
            Err(Error::Internal { what }) => assert!(what.contains("100 bytes"), "{what}"),
            Err(other) => panic!("expected an internal error, got {other:?}"),
            Ok(_) => panic!("a 100-byte slice of a 64-byte chunk was handed out"),
        }
    }
}
