//! The only code that touches the bytes of registered host memory.
//!
//! Memory a caller registers may be written at any time by others: the application, a peer's
//! GPU, another connection landing in the same region. A Rust `&[u8]` or `&mut [u8]` over it
//! would promise the compiler that nobody else writes it (nor, for `&mut`, reads it) while the
//! reference lives, a promise ferry cannot keep. So ferry never forms one. The bytes are named
//! by address and length, [`RawSource`] to send from and [`RawDestination`] to receive into,
//! and only this module moves them: `read(2)` and `writev(2)` between them and a socket, and
//! copies between them and buffers ferry owns (received bytes it buffered, a scratch buffer
//! that feeds a frame's tag).
//!
//! Both types also wrap ferry's own buffers (the sessions' input buffer, pinned staging
//! memory), so a driver moves every kind of memory the same way. The module sits beside the
//! registrations rather than under `tcp` because its pointers are valid for exactly as long as
//! a span keeps its region registered: each value borrows the span it came from.

use std::io;
use std::marker::PhantomData;
use std::os::fd::AsRawFd;
use tokio::io::Interest;
use tokio::net::TcpStream;

/// Bytes of the scratch buffer that carries registered bytes to code that needs a slice (a
/// frame's tag): enough for BLAKE3 to hash many of its 1 KiB chunks in one pass.
const SCRATCH: usize = 16 << 10;

/// The most buffers one `writev(2)` takes on Linux (`UIO_MAXIOV`); more fail with `EINVAL`.
const MAX_IOVECS: usize = 1024;

/// `len` bytes at `start` to send or copy out, readable while `'a` lasts.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RawSource<'a> {
    start: *const u8,
    len: usize,
    /// Ties the source to the span (or slice) that keeps its bytes valid.
    _memory: PhantomData<&'a [u8]>,
}

// SAFETY: a RawSource only reads through its pointer, like `&[u8]`, which is Send and Sync;
// whoever made it vouched that the bytes stay valid for `'a` on any thread.
unsafe impl Send for RawSource<'_> {}
// SAFETY: as for Send: shared access reads the bytes and nothing else.
unsafe impl Sync for RawSource<'_> {}

impl<'a> RawSource<'a> {
    /// The `len` bytes at `start`.
    ///
    /// # Safety
    /// 1. `start..start + len` is host memory of this process that stays mapped and readable
    ///    while `'a` lasts (for a span: the region stays registered while it is borrowed).
    /// 2. No Rust reference to any of those bytes lives while `'a` lasts.
    pub(crate) unsafe fn new(start: *const u8, len: usize) -> Self {
        RawSource {
            start,
            len,
            _memory: PhantomData,
        }
    }

    /// Bytes ferry owns, sent or copied the same way as registered ones.
    pub(crate) fn from_slice(bytes: &'a [u8]) -> Self {
        RawSource {
            start: bytes.as_ptr(),
            len: bytes.len(),
            _memory: PhantomData,
        }
    }

    /// Length in bytes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The bytes from `start` on; `None` when `start` is past the end.
    pub(crate) fn after(self, start: usize) -> Option<Self> {
        let len = self.len.checked_sub(start)?;
        self.range(start, len)
    }

    /// The `len` bytes from `start`; `None` unless they lie inside this source.
    pub(crate) fn range(self, start: usize, len: usize) -> Option<Self> {
        if start.checked_add(len)? > self.len {
            return None;
        }
        Some(RawSource {
            // SAFETY: `start + len <= self.len` (checked above), so the result stays inside
            // (or one past the end of) the valid range this source names.
            start: unsafe { self.start.add(start) },
            len,
            _memory: PhantomData,
        })
    }

    /// Copies the first bytes of this source into `out`, as many as both hold; returns how many.
    pub(crate) fn copy_to(&self, out: &mut [u8]) -> usize {
        let len = out.len().min(self.len);
        // SAFETY: `self.start..+len` is readable for `'a` (`new`'s contract, or the slice
        // `from_slice` borrows), and reading it through a pointer forms no reference to it.
        // `out` cannot overlap it: a source over ferry's own slice holds a shared borrow that
        // excludes `out`'s exclusive one, and registered memory has no Rust reference at all
        // (`new`'s contract 2). Bytes another party writes meanwhile come out as some mix of
        // old and new, which the protocol already treats as undefined until a frame is acked.
        unsafe { std::ptr::copy_nonoverlapping(self.start, out.as_mut_ptr(), len) };
        len
    }

    /// Hands the bytes to `update` in order, through an owned scratch buffer of at most
    /// [`SCRATCH`] bytes at a time, so code that needs a slice (a frame's tag) never gets
    /// one of registered memory.
    pub(crate) fn digest(&self, mut update: impl FnMut(&[u8])) {
        let mut scratch = [0u8; SCRATCH];
        let mut done = 0;
        while let Some(piece) = self.range(done, SCRATCH.min(self.len - done)) {
            if piece.len == 0 {
                break;
            }
            let len = piece.copy_to(&mut scratch);
            update(&scratch[..len]);
            done += len;
        }
    }

    /// Writes from `sources`, in order, with one `writev(2)` once the socket is writable;
    /// returns how many bytes it took (0 only when there was nothing to write).
    ///
    /// # Errors
    /// The call's error, other than its asking to wait or being interrupted.
    ///
    /// # Cancel safety
    /// Safe: bytes are written only inside the call that returns their count.
    pub(crate) async fn write(stream: &TcpStream, sources: &[RawSource<'_>]) -> io::Result<usize> {
        loop {
            stream.writable().await?;
            let written = stream.try_io(Interest::WRITABLE, || {
                let iovecs: Vec<libc::iovec> = sources
                    .iter()
                    .take(MAX_IOVECS)
                    .map(|source| libc::iovec {
                        iov_base: source.start.cast_mut().cast(),
                        iov_len: source.len,
                    })
                    .collect();
                // SAFETY: each iovec names a source's bytes, readable while `sources` is
                // borrowed; `writev` only reads them (its `*mut` base is the C type, not a
                // licence to write), and the kernel copies them without any Rust reference
                // being formed. At most MAX_IOVECS entries, so the count fits a c_int.
                let written = unsafe {
                    libc::writev(
                        stream.as_raw_fd(),
                        iovecs.as_ptr(),
                        iovecs.len() as libc::c_int,
                    )
                };
                usize::try_from(written).map_err(|_| io::Error::last_os_error())
            });
            match written {
                Err(error) if retry(&error) => continue,
                written => return written,
            }
        }
    }

    /// Writes all of `sources`, in order, with as many `writev(2)` calls as the socket needs;
    /// `sources` is left advanced past what went out.
    ///
    /// # Errors
    /// [`io::ErrorKind::WriteZero`] when the socket takes nothing; else the failed call's.
    ///
    /// # Cancel safety
    /// Not cancel safe: dropped part-way, an unknown prefix of the bytes has been sent.
    pub(crate) async fn write_all(
        stream: &TcpStream,
        sources: &mut [RawSource<'_>],
    ) -> io::Result<()> {
        let mut first = 0;
        while first < sources.len() {
            let mut written = RawSource::write(stream, &sources[first..]).await?;
            if written == 0 {
                return Err(io::ErrorKind::WriteZero.into());
            }
            // Past every source the count covers (empty ones included), into the next.
            while let Some(source) = sources.get_mut(first) {
                match source.after(written) {
                    Some(rest) if written < source.len => {
                        *source = rest;
                        break;
                    }
                    _ => {
                        written -= source.len;
                        first += 1;
                    }
                }
            }
        }
        Ok(())
    }
}

/// Room for `len` bytes at `start`, of which the first `filled` have been received.
#[derive(Debug)]
pub(crate) struct RawDestination<'a> {
    start: *mut u8,
    len: usize,
    filled: usize,
    /// Ties the destination to the span (or slice) that keeps its bytes valid.
    _memory: PhantomData<&'a mut [u8]>,
}

// SAFETY: a RawDestination writes its bytes only through `&mut self`, like `&mut [u8]`, which
// is Send; whoever made it vouched that the bytes stay valid for `'a` on any thread.
unsafe impl Send for RawDestination<'_> {}
// SAFETY: shared access reads only the address and counts, never the bytes.
unsafe impl Sync for RawDestination<'_> {}

impl<'a> RawDestination<'a> {
    /// Room for the `len` bytes at `start`, none received yet.
    ///
    /// # Safety
    /// 1. `start..start + len` is host memory of this process that stays mapped, readable and
    ///    writable while `'a` lasts (for a span: the region stays registered while it is
    ///    mutably borrowed).
    /// 2. No Rust reference to any of those bytes lives while `'a` lasts.
    pub(crate) unsafe fn new(start: *mut u8, len: usize) -> Self {
        RawDestination {
            start,
            len,
            filled: 0,
            _memory: PhantomData,
        }
    }

    /// Bytes ferry owns, received into the same way as registered ones.
    pub(crate) fn from_slice(bytes: &'a mut [u8]) -> Self {
        RawDestination {
            start: bytes.as_mut_ptr(),
            len: bytes.len(),
            filled: 0,
            _memory: PhantomData,
        }
    }

    /// The same room with its first `filled` bytes counted as received (at most all).
    pub(crate) fn after(mut self, filled: usize) -> Self {
        self.filled = filled.min(self.len);
        self
    }

    /// Bytes received so far.
    pub(crate) fn filled(&self) -> usize {
        self.filled
    }

    /// Bytes still to receive.
    pub(crate) fn remaining(&self) -> usize {
        self.len - self.filled
    }

    /// Address of the next byte to receive, for tests that check where bytes land.
    #[cfg(test)]
    pub(crate) fn next_addr(&self) -> u64 {
        self.start as u64 + self.filled as u64
    }

    /// The whole room as a source, to read back what was received.
    pub(crate) fn into_source(self) -> RawSource<'a> {
        // SAFETY: the room is readable for `'a` under the same terms it is writable (`new`'s
        // contract, or the slice `from_slice` borrows exclusively), and `self` is consumed,
        // so nothing writes through it while the source lives.
        unsafe { RawSource::new(self.start, self.len) }
    }

    /// Copies `bytes` (ferry's own) after what was received, as many as fit; returns how many.
    pub(crate) fn fill(&mut self, bytes: &[u8]) -> usize {
        let len = bytes.len().min(self.remaining());
        // SAFETY: `start + filled .. + len` lies inside the room (len <= remaining), writable
        // for `'a`; writing through a pointer forms no reference to it. `bytes` cannot
        // overlap: a room over ferry's own slice borrows it exclusively, and registered memory
        // has no Rust reference at all (`new`'s contract 2).
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.start.add(self.filled), len) };
        self.filled += len;
        len
    }

    /// Receives what the socket has, up to [`Self::remaining`], with one `read(2)` once the
    /// socket is readable; returns how many bytes arrived, 0 at the end of the stream (or when
    /// nothing remains to receive).
    ///
    /// # Errors
    /// The call's error, other than its asking to wait or being interrupted.
    ///
    /// # Cancel safety
    /// Safe: bytes arrive only inside the call that returns their count.
    pub(crate) async fn read(&mut self, stream: &TcpStream) -> io::Result<usize> {
        if self.remaining() == 0 {
            return Ok(0);
        }
        loop {
            stream.readable().await?;
            let read = stream.try_io(Interest::READABLE, || {
                // SAFETY: `start + filled .. + remaining` is the unreceived part of the room,
                // writable for `'a` (`new`'s contract, or the slice `from_slice` borrows); the
                // kernel writes it and Rust forms no reference to it, so bytes others write
                // meanwhile break no aliasing rule.
                let read = unsafe {
                    libc::read(
                        stream.as_raw_fd(),
                        self.start.add(self.filled).cast(),
                        self.remaining(),
                    )
                };
                usize::try_from(read).map_err(|_| io::Error::last_os_error())
            });
            match read {
                Ok(len) => {
                    self.filled += len;
                    return Ok(len);
                }
                Err(error) if retry(&error) => continue,
                Err(error) => return Err(error),
            }
        }
    }
}

/// Whether a failed call should just be made again: the socket was not ready after all (tokio
/// then clears its readiness, so the next wait is real), or a signal interrupted it.
fn retry(error: &io::Error) -> bool {
    matches!(
        error.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::future::Future;
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    /// Both ends of a connection on 127.0.0.1.
    async fn connected() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let near = TcpStream::connect(listener.local_addr().unwrap());
        let (near, far) = tokio::join!(near, listener.accept());
        (near.unwrap(), far.unwrap().0)
    }

    /// `work`, failing the test instead of hanging past ten seconds.
    async fn bounded<T>(work: impl Future<Output = T>) -> T {
        tokio::time::timeout(Duration::from_secs(10), work)
            .await
            .expect("the socket work finished in time")
    }

    fn pattern(seed: u8, len: usize) -> Vec<u8> {
        (0..len)
            .map(|index| (index as u8).wrapping_mul(31).wrapping_add(seed))
            .collect()
    }

    /// Reads into `destination` until `want` bytes have arrived in all.
    async fn read_until(destination: &mut RawDestination<'_>, stream: &TcpStream, want: usize) {
        while destination.filled() < want {
            let len = destination.read(stream).await.unwrap();
            assert!(len > 0, "the stream ended early");
        }
    }

    #[tokio::test]
    async fn reads_that_arrive_in_pieces_land_at_their_offsets() {
        bounded(async {
            let (reader, mut writer) = connected().await;
            let mut memory = vec![0u8; 32];
            let mut destination = RawDestination::from_slice(&mut memory).after(4);
            for (piece, end) in [(&b"first"[..], 9), (b"-second", 16), (b"!", 17)] {
                writer.write_all(piece).await.unwrap();
                read_until(&mut destination, &reader, end).await;
                assert_eq!(destination.filled(), end);
            }
            assert_eq!(destination.remaining(), 15);
            let mut expected = vec![0u8; 32];
            expected[4..17].copy_from_slice(b"first-second!");
            assert_eq!(memory, expected);
        })
        .await;
    }

    #[tokio::test]
    async fn the_end_of_the_stream_is_a_zero_length_read_with_the_room_part_filled() {
        bounded(async {
            let (reader, mut writer) = connected().await;
            writer.write_all(b"abc").await.unwrap();
            drop(writer);
            let mut memory = [0u8; 8];
            let mut destination = RawDestination::from_slice(&mut memory);
            read_until(&mut destination, &reader, 3).await;
            assert_eq!(destination.read(&reader).await.unwrap(), 0, "end of stream");
            assert_eq!((destination.filled(), destination.remaining()), (3, 5));
            assert_eq!(&memory, b"abc\0\0\0\0\0");
        })
        .await;
    }

    #[tokio::test]
    async fn several_sources_written_together_arrive_intact_and_in_order() {
        bounded(async {
            let (writer, mut reader) = connected().await;
            // Large pieces make the kernel take partial writes; more pieces than one writev
            // takes, and empty ones among them, exercise the advancing.
            let mut pieces = vec![pattern(1, 3 << 20), Vec::new(), pattern(2, 5)];
            pieces.extend((0..1500).map(|index| pattern(index as u8, index % 7)));
            pieces.push(pattern(3, 1 << 20));
            pieces.push(Vec::new());
            let expected = pieces.concat();
            let receiving = tokio::spawn(async move {
                let mut received = Vec::new();
                reader.read_to_end(&mut received).await.unwrap();
                received
            });
            let mut sources: Vec<RawSource<'_>> = pieces
                .iter()
                .map(|piece| RawSource::from_slice(piece))
                .collect();
            RawSource::write_all(&writer, &mut sources).await.unwrap();
            drop(writer);
            let received = receiving.await.unwrap();
            assert_eq!(received.len(), expected.len());
            assert!(
                received == expected,
                "the bytes arrived altered or out of order"
            );
        })
        .await;
    }

    #[test]
    fn a_digest_covers_ranges_that_are_no_multiple_of_the_scratch_buffer() {
        let bytes = pattern(9, 3 * SCRATCH + 123);
        for (start, len) in [
            (0, bytes.len()),
            (5, 2 * SCRATCH),
            (17, SCRATCH - 1),
            (3, 0),
        ] {
            let source = RawSource::from_slice(&bytes).range(start, len).unwrap();
            let mut seen = Vec::new();
            let mut pieces = 0;
            source.digest(|piece| {
                assert!(!piece.is_empty() && piece.len() <= SCRATCH);
                pieces += 1;
                seen.extend_from_slice(piece);
            });
            assert_eq!(pieces, len.div_ceil(SCRATCH));
            assert!(seen == bytes[start..start + len], "range {start}+{len}");
        }
        assert!(RawSource::from_slice(&bytes)
            .range(1, bytes.len())
            .is_none());
        assert!(RawSource::from_slice(&bytes)
            .after(bytes.len() + 1)
            .is_none());
    }

    #[test]
    fn copies_stop_at_the_smaller_side() {
        let mut memory = [0u8; 6];
        let mut destination = RawDestination::from_slice(&mut memory).after(2);
        assert_eq!(destination.fill(b"abcdef"), 4);
        assert_eq!(destination.fill(b"x"), 0);
        let source = destination.into_source();
        let mut out = [0u8; 4];
        assert_eq!(source.copy_to(&mut out), 4);
        assert_eq!(&out, b"\0\0ab");
        assert_eq!(&memory, b"\0\0abcd");
    }
}
