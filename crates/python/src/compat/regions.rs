//! Registrations by containment: Mooncake callers register a buffer once and then transfer at
//! any offset inside it, naming only raw addresses.

use ferry::{Engine, Region};
use std::collections::BTreeMap;

/// The regions registered through the compatible API, by start address.
#[derive(Default)]
pub(crate) struct Regions {
    by_start: BTreeMap<u64, Region>,
}

impl Regions {
    /// Registers `len` bytes at `addr`; `true` when it is new. Registering the exact range
    /// again is a no-op (`false`), as callers that register per layer and per tensor sometimes
    /// do.
    ///
    /// # Safety
    /// As [`ferry::Engine::register`]: the memory stays valid until it is unregistered.
    pub(crate) unsafe fn register(
        &mut self,
        engine: &Engine,
        addr: u64,
        len: u64,
    ) -> Result<bool, String> {
        if let Some(region) = self.by_start.get(&addr) {
            if region.len() == len {
                return Ok(false);
            }
        }
        let length = usize::try_from(len)
            .map_err(|_| format!("length {len} does not fit this machine's address space"))?;
        if addr == 0 {
            return Err(
                "address 0 is not memory; pass the buffer's address (tensor.data_ptr())".into(),
            );
        }
        // SAFETY: the caller promises the range stays valid while registered (this fn's contract).
        let region = unsafe { engine.register(addr as *mut u8, length as u64) }
            .map_err(|error| error.to_string())?;
        self.by_start.insert(addr, region);
        Ok(true)
    }

    /// Unregisters the region that starts at `addr`; its transfers still in flight finish first.
    pub(crate) fn unregister(&mut self, addr: u64) -> Result<Region, String> {
        self.by_start.remove(&addr).ok_or_else(|| {
            format!("no memory is registered at {addr:#x}; unregister_memory takes the address register_memory was given")
        })
    }

    /// The region holding `[addr, addr + len)`, and `addr`'s offset in it.
    pub(crate) fn containing(&self, addr: u64, len: u64) -> Result<(&Region, u64), String> {
        let end = addr
            .checked_add(len)
            .ok_or_else(|| format!("{addr:#x} + {len} overflows"))?;
        match self.by_start.range(..=addr).next_back() {
            Some((&start, region)) if end <= start + region.len() => Ok((region, addr - start)),
            _ => Err(format!(
                "local range {addr:#x}..{end:#x} is not inside registered memory; register_memory the buffer it belongs to first"
            )),
        }
    }

    /// Keeps a region the engine allocated (a managed buffer).
    pub(crate) fn insert(&mut self, region: Region) {
        self.by_start.insert(region.addr(), region);
    }
}
