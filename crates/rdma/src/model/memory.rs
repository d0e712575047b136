//! A host's memory: owned buffers at synthetic virtual addresses, or memory a test supplies.

use std::collections::BTreeMap;
use std::fmt;

use crate::error::VerbsError;

/// The memory of one model host, as its NIC sees it: what registration checks and what
/// one-sided work reads and writes. The model's own is [`AddressSpace`]-like owned buffers;
/// a test that drives the transport through real engines supplies one that reads and writes
/// the engines' registered regions ([`Fabric::add_host_with_memory`](super::Fabric::add_host_with_memory)).
pub trait HostMemory: Send + fmt::Debug {
    /// Maps `len` zeroed bytes; returns their address.
    ///
    /// # Errors
    /// [`VerbsError::InvalidSize`] when nothing can be mapped (zero bytes, no room, or memory
    /// the caller manages itself).
    fn alloc(&mut self, len: u64) -> Result<u64, VerbsError>;
    /// Whether all `len` bytes at `addr` are mapped, in one piece.
    fn is_mapped(&self, addr: u64, len: u64) -> bool;
    /// A copy of `len` bytes at `addr`, or `None` when they are not mapped.
    fn read(&self, addr: u64, len: u64) -> Option<Vec<u8>>;
    /// Writes `bytes` at `addr`; `None` when the range is not mapped (nothing written).
    fn write(&mut self, addr: u64, bytes: &[u8]) -> Option<()>;
}

/// Where the first buffer of every host starts (a typical user-space mmap address).
const FIRST_ADDRESS: u64 = 0x7f00_0000_0000;
/// Buffers start on page boundaries with one unmapped page between them, so no range spans
/// two buffers.
const PAGE: u64 = 4096;

/// One host's address space: buffers by their first address.
#[derive(Debug)]
pub(super) struct AddressSpace {
    buffers: BTreeMap<u64, Vec<u8>>,
    next: u64,
}

impl AddressSpace {
    pub(super) fn new() -> Self {
        AddressSpace {
            buffers: BTreeMap::new(),
            next: FIRST_ADDRESS,
        }
    }

    /// The buffer's first address and the range's offset in it.
    fn locate(&self, addr: u64, len: u64) -> Option<(u64, usize, usize)> {
        let (base, buffer) = self.buffers.range(..=addr).next_back()?;
        let start = usize::try_from(addr - base).ok()?;
        let end = start.checked_add(usize::try_from(len).ok()?)?;
        (end <= buffer.len()).then_some((*base, start, end))
    }
}

impl HostMemory for AddressSpace {
    fn alloc(&mut self, len: u64) -> Result<u64, VerbsError> {
        let refuse = |remedy| VerbsError::InvalidSize {
            what: "buffer length",
            value: len,
            remedy,
        };
        if len == 0 {
            return Err(refuse("allocate at least one byte"));
        }
        let size =
            usize::try_from(len).map_err(|_| refuse("allocate less than the address space"))?;
        let pages = len
            .div_ceil(PAGE)
            .checked_add(1)
            .and_then(|pages| pages.checked_mul(PAGE));
        let next = pages
            .and_then(|span| self.next.checked_add(span))
            .ok_or_else(|| refuse("the model's address space is used up: allocate less"))?;
        let addr = self.next;
        self.buffers.insert(addr, vec![0; size]);
        self.next = next;
        Ok(addr)
    }

    fn is_mapped(&self, addr: u64, len: u64) -> bool {
        self.locate(addr, len).is_some()
    }

    fn read(&self, addr: u64, len: u64) -> Option<Vec<u8>> {
        let (base, start, end) = self.locate(addr, len)?;
        self.buffers
            .get(&base)
            .map(|buffer| buffer[start..end].to_vec())
    }

    fn write(&mut self, addr: u64, bytes: &[u8]) -> Option<()> {
        let (base, start, end) = self.locate(addr, bytes.len() as u64)?;
        let buffer = self.buffers.get_mut(&base)?;
        buffer[start..end].copy_from_slice(bytes);
        Some(())
    }
}
