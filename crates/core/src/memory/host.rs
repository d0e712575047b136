//! Host memory: spans of registered host regions, which hand their bytes out only as raw
//! sources and destinations (see `raw`), and copies to or from an address a caller names
//! (Mooncake's `write_bytes_to_buffer`), checked against the process's mappings first.

use super::raw::{RawDestination, RawSource};
use super::region::{Location, RegionUse};
use crate::error::Error;
use std::alloc::{self, Layout};
use std::sync::Arc;

/// A byte range inside a registered host region, valid while it lives.
pub(crate) struct HostSpan {
    addr: u64,
    len: usize,
    /// Keeps the region registered, and so its memory valid, while the span exists.
    _use: Arc<RegionUse>,
}

impl HostSpan {
    /// A span of `len` bytes at `addr`, or `None` when that is not inside the used region or
    /// the region is not host memory.
    pub(crate) fn new(region: Arc<RegionUse>, addr: u64, len: u64) -> Option<Self> {
        if !matches!(region.entry.info.location, Location::Host { .. })
            || !region.entry.contains(addr, len)
        {
            return None;
        }
        Some(HostSpan {
            addr,
            len: usize::try_from(len).ok()?,
            _use: region,
        })
    }

    /// Length in bytes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The bytes, for sending or copying out.
    pub(crate) fn source(&self) -> RawSource<'_> {
        // SAFETY: the span lies inside a registered host region (checked in `new`), and the
        // RegionUse it holds keeps that registration alive while the source borrows the span;
        // `Engine::register`'s contract keeps registered memory mapped and readable. Ferry
        // forms no Rust reference to registered memory anywhere (all access is through
        // `raw`), so none can alias the source.
        unsafe { RawSource::new(self.addr as *const u8, self.len) }
    }

    /// Room for received bytes.
    pub(crate) fn destination(&mut self) -> RawDestination<'_> {
        // SAFETY: as in `source`, and `Engine::register`'s contract makes the memory writable;
        // `&mut self` keeps this span's own sources and destinations from overlapping in time.
        unsafe { RawDestination::new(self.addr as *mut u8, self.len) }
    }

    /// Copies `bytes` into the span, as many as fit.
    pub(crate) fn copy_from(&mut self, bytes: &[u8]) {
        self.destination().fill(bytes);
    }

    /// Copies the span into `out`, as many bytes as both hold.
    pub(crate) fn copy_to(&self, out: &mut [u8]) {
        self.source().copy_to(out);
    }
}

/// Copies `bytes` to `addr` in this process, registered memory or not: what Mooncake's
/// `write_bytes_to_buffer` does with any address its caller names. The range must be readable
/// and writable host memory of this process (checked against `/proc/self/maps`, so a hole or
/// GPU memory is an error, not a crash).
///
/// # Errors
/// [`Error::ApiMisuse`] naming the first byte that is not such memory, or when the process's
/// mappings cannot be read.
///
/// # Safety
/// The caller owns `[addr, addr + bytes.len())`, and nothing reads or writes it meanwhile (no
/// Rust reference to it lives across the call).
pub unsafe fn write_caller_memory(addr: u64, bytes: &[u8]) -> Result<(), Error> {
    caller_range(addr, bytes.len())?;
    // SAFETY: the range is mapped readable and writable host memory (checked just now) that
    // the caller owns and leaves alone meanwhile, as this function's contract says; `bytes`
    // is a separate Rust slice, so the two do not overlap.
    unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), addr as *mut u8, bytes.len()) };
    Ok(())
}

/// Copies `out.len()` bytes at `addr` of this process into `out`, registered memory or not:
/// Mooncake's `read_bytes_from_buffer`. Checked as [`write_caller_memory`].
///
/// # Errors
/// As [`write_caller_memory`].
///
/// # Safety
/// As [`write_caller_memory`].
pub unsafe fn read_caller_memory(addr: u64, out: &mut [u8]) -> Result<(), Error> {
    caller_range(addr, out.len())?;
    // SAFETY: as in `write_caller_memory`; `out` is a separate, caller-owned slice.
    unsafe { std::ptr::copy_nonoverlapping(addr as *const u8, out.as_mut_ptr(), out.len()) };
    Ok(())
}

/// Refuses `len` bytes at `addr` unless they are readable and writable host memory here.
fn caller_range(addr: u64, len: usize) -> Result<(), Error> {
    let first = super::first_unmapped_strictly(addr, len as u64).map_err(|error| {
        Error::ApiMisuse(format!(
            "cannot read /proc/self/maps to check {len} bytes at {addr:#x} before copying: {error}"
        ))
    })?;
    match first {
        None if addr != 0 => Ok(()),
        None => Err(Error::ApiMisuse("address 0 is no memory to copy to or from".into())),
        Some(first) => Err(Error::ApiMisuse(format!(
            "{len} bytes at {addr:#x} are not readable and writable host memory of this process (the first byte that is not: {first:#x}); pass an address of your own host memory"
        ))),
    }
}

/// Zeroed host memory the engine allocated for a caller ([`crate::Engine::allocate`]).
pub(crate) struct OwnedBuffer {
    ptr: *mut u8,
    layout: Layout,
}

// SAFETY: OwnedBuffer is a uniquely owned heap allocation; it is only freed in Drop, and all
// access to its bytes goes through HostSpan, whose users follow the region rules.
unsafe impl Send for OwnedBuffer {}
// SAFETY: shared references to OwnedBuffer expose only the address, never the bytes.
unsafe impl Sync for OwnedBuffer {}

impl OwnedBuffer {
    /// Allocates `len` zeroed bytes, or `None` when the allocator refuses.
    ///
    /// The alignment stays at 16 so the allocator can use `calloc`, which maps fresh zero pages
    /// for large sizes: a 20 GiB KV pool costs memory only for the blocks that are touched.
    pub(crate) fn zeroed(len: usize) -> Option<Self> {
        let layout = Layout::from_size_align(len.max(1), 16).ok()?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { alloc::alloc_zeroed(layout) };
        (!ptr.is_null()).then_some(OwnedBuffer { ptr, layout })
    }

    pub(crate) fn addr(&self) -> u64 {
        self.ptr as u64
    }
}

impl Drop for OwnedBuffer {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from alloc_zeroed with this exact layout and is freed only here.
        unsafe { alloc::dealloc(self.ptr, self.layout) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caller_memory_is_copied_only_where_it_is_mapped_host_memory() {
        let mut own = vec![0u8; 8192];
        let addr = own.as_mut_ptr() as u64;
        // SAFETY: `own` is this test's buffer, and no reference to it is used during the calls.
        unsafe { write_caller_memory(addr + 100, b"caller bytes") }.unwrap();
        let mut back = [0u8; 12];
        // SAFETY: as above.
        unsafe { read_caller_memory(addr + 100, &mut back) }.unwrap();
        assert_eq!(&back, b"caller bytes");
        assert_eq!(&own[100..112], b"caller bytes");
        for nowhere in [0u64, 0x1000] {
            // SAFETY: refused before any byte is touched.
            let error = unsafe { write_caller_memory(nowhere, b"x") }.unwrap_err();
            assert!(matches!(error, Error::ApiMisuse(_)), "{error}");
        }
    }
}
