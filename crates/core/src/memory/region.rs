use super::host::{HostSpan, OwnedBuffer};
use super::table::RegionTable;
use crate::descriptor::Export;
pub use crate::descriptor::Location;
use crate::error::{Error, RangeError};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Something a transport keeps alive for as long as a region it exported stays registered
/// (retained allocation handles, a memory registration with a NIC); dropped after the last
/// transfer through the region has ended.
pub type ExportGuard = Box<dyn std::any::Any + Send + Sync>;

/// A snapshot of one registration: address, length and location.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegionInfo {
    /// First byte of the region.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Where the memory lives.
    pub location: Location,
}

/// The shared state of one registration.
pub(crate) struct RegionEntry {
    pub(crate) info: RegionInfo,
    /// Registration order, so descriptors list buffers in the order they were registered.
    pub(crate) sequence: u64,
    /// Identity of the owning table, so a handle cannot be used with another engine.
    pub(crate) table_id: u64,
    in_use: AtomicUsize,
    closed: AtomicBool,
    /// The name peers find it by ([`Region::set_name`]), once given.
    pub(crate) name: parking_lot::Mutex<Option<String>>,
    /// What each transport publishes for peers to reach it.
    pub(crate) exports: Vec<Export>,
    /// What the transports keep alive while it is registered; dropped before owned memory.
    guards: Vec<ExportGuard>,
    /// One event after each [`Region::wait_value32`] that a stream may not have passed yet;
    /// dropping the [`Region`] waits for them.
    stream_waits: parking_lot::Mutex<Vec<crate::cuda::Event>>,
    /// Memory the engine allocated on the caller's behalf; freed once the last use ends.
    owned: Option<OwnedMemory>,
}

/// Memory an engine allocated itself ([`crate::Engine::allocate`],
/// [`crate::Engine::allocate_device`]); it lives as long as its registration.
/// Held only to be dropped (freed) with the registration.
pub(crate) enum OwnedMemory {
    Host { _buffer: OwnedBuffer },
    Device { _buffer: crate::cuda::DeviceBuffer },
    Vmm { _mapping: crate::cuda::VmmMapping },
}

impl RegionEntry {
    pub(crate) fn new(
        info: RegionInfo,
        sequence: u64,
        table_id: u64,
        exports: Vec<Export>,
        guards: Vec<ExportGuard>,
        owned: Option<OwnedMemory>,
    ) -> Self {
        RegionEntry {
            info,
            sequence,
            table_id,
            in_use: AtomicUsize::new(0),
            closed: AtomicBool::new(false),
            name: parking_lot::Mutex::new(None),
            exports,
            guards,
            stream_waits: parking_lot::Mutex::new(Vec::new()),
            owned,
        }
    }

    /// True when `addr..addr+len` lies inside this region.
    pub(crate) fn contains(&self, addr: u64, len: u64) -> bool {
        addr >= self.info.addr
            && addr
                .checked_add(len)
                .is_some_and(|end| end <= self.info.addr + self.info.len)
    }

    /// Marks the region in use, unless it is being deregistered.
    pub(crate) fn acquire(self: &Arc<Self>) -> Option<RegionUse> {
        // SeqCst pairs with `close`: either this sees `closed`, or `close` sees the count.
        self.in_use.fetch_add(1, Ordering::SeqCst);
        if self.closed.load(Ordering::SeqCst) {
            self.in_use.fetch_sub(1, Ordering::SeqCst);
            return None;
        }
        Some(RegionUse {
            entry: Arc::clone(self),
        })
    }

    /// Refuses new uses and waits until the current ones have ended.
    fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        let started = Instant::now();
        let mut warned = false;
        while self.in_use.load(Ordering::SeqCst) != 0 {
            if started.elapsed() < Duration::from_millis(1) {
                std::hint::spin_loop();
                continue;
            }
            if !warned && started.elapsed() > Duration::from_secs(1) {
                warned = true;
                tracing::warn!(
                    addr = self.info.addr,
                    len = self.info.len,
                    "deregistration is waiting for transfers that still use the region"
                );
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}

/// Proof that a region stays registered (and its memory valid) while this value lives.
/// Transports receive it with every op; dropping a [`Region`] waits for all of them.
pub struct RegionUse {
    pub(crate) entry: Arc<RegionEntry>,
}

impl RegionUse {
    /// The region this use keeps registered.
    pub fn info(&self) -> RegionInfo {
        self.entry.info
    }
}

impl Drop for RegionEntry {
    fn drop(&mut self) {
        // The last use may end on the CUDA event poller's thread, where freeing GPU memory
        // could wait for the whole device and hold up every completion of the process.
        let guards = std::mem::take(&mut self.guards);
        match self.owned.take() {
            Some(owned) => crate::task::drop_off_waking_thread((guards, owned)),
            None => drop(guards),
        }
    }
}

impl Drop for RegionUse {
    fn drop(&mut self) {
        self.entry.in_use.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A registered memory region. Transfers name it as their local side.
///
/// Dropping it deregisters the memory: peers can no longer reach it, and `drop` returns only
/// after every transfer still reading or writing it has ended (each is bounded by the engine's
/// transfer timeout). After that the caller may free the memory.
pub struct Region {
    pub(crate) entry: Arc<RegionEntry>,
    pub(crate) table: Arc<RegionTable>,
}

impl Region {
    /// First byte of the region in this process's address space.
    pub fn addr(&self) -> u64 {
        self.entry.info.addr
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.entry.info.len
    }

    /// True for a zero-length region (registration refuses those, so never in practice).
    pub fn is_empty(&self) -> bool {
        self.entry.info.len == 0
    }

    /// Where the memory lives.
    pub fn location(&self) -> Location {
        self.entry.info.location
    }

    /// Address, length and location in one value.
    pub fn info(&self) -> RegionInfo {
        self.entry.info
    }
}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Region")
            .field("addr", &format_args!("{:#x}", self.entry.info.addr))
            .field("len", &self.entry.info.len)
            .field("location", &self.entry.info.location)
            .finish()
    }
}

impl Region {
    /// Names the region for peers: its buffer in this engine's descriptor carries `name`, and
    /// a peer finds it with [`crate::Peer::buffer`] instead of by position or address. The
    /// descriptor is republished in the background ([`crate::Engine::publish`] waits for it).
    ///
    /// # Errors
    /// [`Error::ApiMisuse`] for an empty name, one over 256 bytes, or one another region of
    /// this engine already has.
    pub fn set_name(&self, name: impl Into<String>) -> Result<(), Error> {
        self.table.rename(&self.entry, name.into())
    }

    /// The name given with [`Region::set_name`], if any.
    pub fn name(&self) -> Option<String> {
        self.entry.name()
    }
}

impl RegionEntry {
    pub(crate) fn name(&self) -> Option<String> {
        self.name.lock().clone()
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        self.table.remove(&self.entry);
        self.entry.close();
        self.entry.await_stream_waits();
    }
}

impl RegionEntry {
    /// Waits until every stream that waited on a word of this region has passed the wait, so
    /// no GPU reads the memory after the region is dropped. A failed query (a broken context
    /// runs nothing more) counts as passed.
    fn await_stream_waits(&self) {
        let mut waits = std::mem::take(&mut *self.stream_waits.lock());
        let started = Instant::now();
        let mut warned = false;
        loop {
            waits.retain(|event| match event.query() {
                Ok(passed) => !passed,
                Err(error) => {
                    tracing::warn!(%error, "a stream waiting on a dropped region failed");
                    false
                }
            });
            if waits.is_empty() {
                return;
            }
            if !warned && started.elapsed() > Duration::from_secs(1) {
                warned = true;
                tracing::warn!(
                    addr = self.info.addr,
                    len = self.info.len,
                    "dropping the region waits for a stream that waits on a word in it; write the value it waits for to release it"
                );
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}

impl Region {
    /// Makes work queued on `stream` from now on wait, on the GPU, until the 32-bit word
    /// `offset` bytes into this region is at least `value` (compared as unsigned). A peer's
    /// [`crate::Batch::signal`] sets the word once its data is visible, so a decode stream
    /// starts on the data without a CPU round trip. From the `ferry` crate, call
    /// `ferry::cuda::Stream::wait_value32`.
    ///
    /// Dropping the region waits until the stream has passed the wait (the memory must stay
    /// valid while the GPU may read it); write the value yourself ([`Region::write_at`]) to
    /// release a stream whose signal will not come.
    ///
    /// # Errors
    /// [`Error::ApiMisuse`] when the region is not GPU memory, the stream belongs to another
    /// GPU, or the word is not 4-byte aligned; [`RangeError::OutsideRegion`] when the word runs
    /// past the region; [`Error::Cuda`] when the driver refuses the wait.
    pub fn wait_value32(
        &self,
        stream: &crate::cuda::Stream,
        offset: u64,
        value: u32,
    ) -> Result<(), Error> {
        let Location::Device { ordinal, .. } = self.location() else {
            return Err(Error::ApiMisuse(format!(
                "Region::wait_value32: the region at {:#x} is {}; a stream waits on GPU memory, so register the word on a GPU",
                self.addr(),
                self.location()
            )));
        };
        let stream_gpu = stream.context().ordinal();
        if stream_gpu != ordinal {
            return Err(Error::ApiMisuse(format!(
                "Region::wait_value32: the stream is on GPU {stream_gpu}, the region on GPU {ordinal}; wait with a stream of the region's GPU"
            )));
        }
        let (guard, addr) = self.checked(offset, 4)?;
        if addr % 4 != 0 {
            return Err(Error::ApiMisuse(format!(
                "Region::wait_value32: the word at {addr:#x} is not 4-byte aligned; GPUs wait on aligned 32-bit words"
            )));
        }
        // SAFETY: `addr..addr+4` is aligned (checked) and lies inside this region (checked),
        // which is memory of the stream's GPU (checked) that `guard` keeps registered while the
        // wait is queued. Registration keeps it allocated until the region is dropped
        // (`register`'s contract, or the engine's own allocation), and dropping the region
        // waits for the event recorded below (or, when no event can be recorded, this call
        // synchronises the stream), so the GPU reads it only while it is valid. The caller
        // keeps nothing else alive: the stream may be dropped at any time (the driver finishes
        // its queued work).
        unsafe { stream.wait_value32(addr, value)? };
        let passed = match crate::cuda::Event::record(stream) {
            Ok(event) => event,
            Err(error) => {
                // Nothing would tell the region's drop when the wait has passed; a driver that
                // cannot record an event has usually failed, and then this returns at once.
                stream.synchronize()?;
                return Err(error.into());
            }
        };
        let mut waits = self.entry.stream_waits.lock();
        waits.retain(|event| !matches!(event.query(), Ok(true)));
        waits.push(passed);
        drop(guard);
        Ok(())
    }
}

impl Region {
    /// Copies `buf.len()` bytes starting at `offset` into the region (host or GPU memory),
    /// returning once they are there.
    ///
    /// # Errors
    /// [`RangeError::OutsideRegion`] when the range runs past the region; [`Error::Cuda`] when
    /// a GPU copy fails.
    pub fn write_at(&self, offset: u64, buf: &[u8]) -> Result<(), Error> {
        let (guard, addr) = self.checked(offset, buf.len() as u64)?;
        match self.entry.info.location {
            Location::Host { .. } => {
                let mut span = HostSpan::new(Arc::new(guard), addr, buf.len() as u64)
                    .ok_or_else(|| self.unspannable(offset, buf.len()))?;
                span.copy_from(buf);
            }
            Location::Device { ordinal, .. } => {
                let context = crate::cuda::Context::get(ordinal)?;
                // SAFETY: the range lies inside this registered GPU region (checked), which the
                // guard keeps registered and `register`'s contract keeps allocated.
                unsafe { crate::cuda::upload(&context, addr, buf)? };
            }
        }
        Ok(())
    }

    /// Copies `buf.len()` bytes starting at `offset` out of the region (host or GPU memory).
    ///
    /// # Errors
    /// As [`Region::write_at`].
    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), Error> {
        let (guard, addr) = self.checked(offset, buf.len() as u64)?;
        match self.entry.info.location {
            Location::Host { .. } => {
                let span = HostSpan::new(Arc::new(guard), addr, buf.len() as u64)
                    .ok_or_else(|| self.unspannable(offset, buf.len()))?;
                span.copy_to(buf);
            }
            Location::Device { ordinal, .. } => {
                let context = crate::cuda::Context::get(ordinal)?;
                // SAFETY: as in `write_at`.
                unsafe { crate::cuda::download(&context, addr, buf)? };
            }
        }
        Ok(())
    }

    /// The host span of a range `checked` accepted could not be made.
    fn unspannable(&self, offset: u64, len: usize) -> Error {
        Error::internal(format!(
            "the checked range at offset {offset}, {len} bytes, of the {}-byte host region at {:#x} gave no host span",
            self.len(),
            self.addr()
        ))
    }

    /// Checks `offset..+len` against the region and marks it in use.
    fn checked(&self, offset: u64, len: u64) -> Result<(RegionUse, u64), Error> {
        let addr = self
            .addr()
            .checked_add(offset)
            .filter(|&addr| self.entry.contains(addr, len))
            .ok_or(RangeError::OutsideRegion {
                offset,
                len,
                region_len: self.len(),
            })?;
        // Only dropping the region deregisters it, and `self` is alive.
        let guard = self.entry.acquire().ok_or_else(|| {
            Error::internal(format!(
                "the {}-byte region at {:#x} is being deregistered while its handle is in use",
                self.len(),
                self.addr()
            ))
        })?;
        Ok((guard, addr))
    }
}
