//! Registrations by containment: Mooncake callers register a buffer once and then transfer at
//! any offset inside it, naming only raw addresses.

use ferry::{Engine, Region};
use std::collections::BTreeMap;

/// The regions registered through the compatible API, by start address.
#[derive(Default)]
pub(crate) struct Regions {
    by_start: BTreeMap<u64, Region>,
    /// Bumped at every change of `by_start`: what was found in the regions before may be
    /// found elsewhere now.
    generation: u64,
    /// Every buffer the engine allocated (`allocate_managed_buffer`), by start and length,
    /// kept after it is freed: its memory is the engine's, never the caller's own.
    allocated: BTreeMap<u64, u64>,
}

/// Most freed managed buffers [`Regions::allocated`] remembers before it starts over.
const ALLOCATED_MOST: usize = 1 << 16;

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
        self.generation += 1;
        Ok(true)
    }

    /// Unregisters the region that starts at `addr`; its transfers still in flight finish first.
    pub(crate) fn unregister(&mut self, addr: u64) -> Result<Region, String> {
        let region = self.by_start.remove(&addr).ok_or_else(|| {
            format!("no memory is registered at {addr:#x}; unregister_memory takes the address register_memory was given")
        })?;
        self.generation += 1;
        Ok(region)
    }

    /// Changes every time a region comes or goes.
    pub(crate) fn generation(&self) -> u64 {
        self.generation
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
        if self.allocated.len() >= ALLOCATED_MOST {
            self.allocated
                .retain(|start, _| self.by_start.contains_key(start));
        }
        self.allocated.insert(region.addr(), region.len());
        self.by_start.insert(region.addr(), region);
        self.generation += 1;
    }

    /// Whether `[addr, addr + len)` may be copied as the caller's own memory (Mooncake's
    /// `write_bytes_to_buffer` on memory it never registered): it touches no registered region
    /// (a range running out of one is a mistake, not the caller's memory) and no buffer the
    /// engine allocated, freed or not.
    pub(crate) fn is_callers_own(&self, addr: u64, len: u64) -> bool {
        let Some(end) = addr.checked_add(len) else {
            return false;
        };
        let registered = self
            .by_start
            .range(..end)
            .next_back()
            .is_some_and(|(&start, region)| start + region.len() > addr);
        let allocated = self
            .allocated
            .range(..end)
            .next_back()
            .is_some_and(|(&start, &length)| start + length > addr);
        !registered && !allocated
    }
}
